"""plots.py: sample grids enlarged for viewing (exactly, by whole-pixel blocks) and the curves of metrics.jsonl,
from a synthetic file and from a real few-step run's."""
from __future__ import annotations

import json
import os

import pytest
import numpy as np
import torch
import torchvision
from PIL import Image

import plots
from conftest import TINY

pytestmark = pytest.mark.curves


def test_a_64px_grid_is_enlarged_4x_by_exact_blocks():
    torch.manual_seed(0)
    tiles = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8)
    grid = torchvision.utils.make_grid(tiles, nrow=4, padding=2)
    assert tuple(grid.shape) == (3, 134, 266)  # the unreadable grid
    view = plots.enlarge_for_viewing(grid, tile_size=64)
    assert tuple(view.shape) == (3, 536, 1064) and view.dtype == torch.uint8
    assert torch.equal(view[:, ::4, ::4], grid)  # the stored pixels, each a 4x4 block
    assert torch.equal(view[:, 1::4, 3::4], grid)
    assert plots.enlarge_for_viewing(grid, tile_size=100).shape[-1] == 266 * 3  # ceil(256 / 100)
    assert plots.enlarge_for_viewing(grid, tile_size=256) is grid  # big tiles stay as they are


def write_jsonl(path, records, tail=""):
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_curves_from_a_synthetic_metrics_file(tmp_path):
    records = [{"step": s, "loss/total": 1 / s, "loss/pooled_mse": 0.5 / s, "lr/vae": 1e-3, "img_per_s": 10.0,
                "latent/mean": 0.0, "latent/std": 1.0, "latent/channel_std": [1.0, 1.0]} for s in (10, 20, 30)]
    records.append({"step": 30, "eval/psnr": 21.5, "eval/ssim": 0.7, "eval/lpips": None, "eval/rfid": None})
    write_jsonl(tmp_path / "metrics.jsonl", records, tail='{"step": 40, "loss/tot')  # cut short by a crash
    panels = plots.panels_with_data(plots.read_metrics(str(tmp_path / "metrics.jsonl")))
    assert [title for title, _, _ in panels] == ["training losses", "held-out PSNR (dB)", "held-out SSIM",
                                                 "learning rate", "latent", "throughput (img/s)"]
    losses = dict((label, (steps, values)) for label, steps, values in panels[0][1])
    assert losses["total"] == ([10, 20, 30], [0.1, 0.05, 1 / 30])
    path = plots.plot_metrics(str(tmp_path))
    assert path == str(tmp_path / "curves.png")
    image = np.asarray(Image.open(path).convert("RGB"))
    assert image.shape[0] > 400 and image.shape[1] > 800 and image.std() > 10  # drawn, not blank


def test_every_label_of_the_curves_is_inside_the_picture(tmp_path):
    """A log axis spanning less than a decade (a loss settling, a learning rate) labels its minor ticks, as wide as
    "1.75x10^-3": the fixed margins leave room for them (0.7 in cut them off at the picture's left edge), in the left
    column and between panels. The picture's border is background: nothing drawn past it."""
    records = [{"step": s, "loss/total": 0.0021 + 0.0003 * (s % 3), "loss/kl": 0.1, "eval/psnr": 20 + s / 10,
                "lr/vae": 1.5e-3 + 1e-5 * s, "grad_norm/vae": 1.5e-3 + 1e-5 * s} for s in range(1, 30)]
    write_jsonl(tmp_path / "metrics.jsonl", records)
    image = np.asarray(Image.open(plots.plot_metrics(str(tmp_path))).convert("L"))
    assert image[:, :2].min() == 255 and image[:, -2:].min() == 255, "a label runs past the picture's edge"


@pytest.mark.process
def test_the_command_writes_curves_of_a_real_run_and_one_error_line_without_metrics(shard_url, tmp_path, capsys,
                                                                                    one_torch_thread):
    """The trainer's run (its main, in this process) writes the keys plots.py draws; the command draws them."""
    import vae_trainer
    args = ["--dataset_url", shard_url, "--test_dataset_url", shard_url, "--output_dir", str(tmp_path),
            "--run_name", "r", "--max_steps", "2", "--log_every_n_steps", "1", "--evaluate_every_n_steps", "2",
            "--save_every_n_steps", "2", "--eval_max_images", "2", "--inception_weights", "none", *TINY]
    # (rFID off: a random Inception costs ~10 s an evaluation here and its panel is drawn like PSNR's)
    assert vae_trainer.main(args) == 0
    capsys.readouterr()
    run_dir = str(tmp_path / "r")
    titles = [t for t, _, _ in plots.panels_with_data(plots.read_metrics(os.path.join(run_dir, "metrics.jsonl")))]
    for title in ("training losses", "KL", "held-out PSNR (dB)", "held-out SSIM", "held-out LPIPS", "learning rate",
                  "latent", "gradient norm"):
        assert title in titles  # the keys the trainer writes are the ones plotted
    assert plots.main([run_dir]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run_dir}/curves.png"
    assert Image.open(os.path.join(run_dir, "curves.png")).size[0] > 800
    assert plots.main([str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no metrics.jsonl in")


def test_a_metrics_file_with_nothing_to_plot_is_said_so(tmp_path, capsys):
    write_jsonl(tmp_path / "metrics.jsonl", [], tail='{"step": 2, "loss')
    assert plots.plot_metrics(str(tmp_path)) is None
    assert plots.main([str(tmp_path)]) == 1
    assert "holds no step with a metric yet" in capsys.readouterr().err


@pytest.mark.parametrize("value", [None, float("nan"), [1.0, 2.0], True])
def test_values_that_are_not_one_finite_number_are_left_out(value):
    assert plots.series([{"step": 1, "k": value}, {"step": 2, "k": 3}], "k") == ([2], [3.0])
