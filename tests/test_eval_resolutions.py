"""Evaluation at several resolutions during training (issue 26 item 1): --eval_resolutions through the real trainer,
Validator and Reporter into metrics.jsonl, its keys and numbers against evaluations computed directly at each size,
tiling above --eval_tile_size against evaluate.py's tiled path, the default's keys and numbers unchanged, bad sizes
refused in one line, an evaluation interrupted between two sizes redone on resume, and the curves' lines per size."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from conftest import TINY

import common
import config
import evaluate as ev
import plots
import vae_trainer
from ae import AutoEncoder
import run_setup

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]

CPU = torch.device("cpu")
METRICS = ("psnr", "ssim", "lpips", "rfid")


FEATURES = 32  # the stand-in's feature size: a Frechet distance in 2048 dimensions takes seconds on these CPUs


@pytest.fixture(scope="module", autouse=True)
def small_fid_features():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ev, "FID_DIM", FEATURES)
        yield


class PooledFeatures(nn.Module):
    """A stand-in for the FID Inception with its interface (uint8 NCHW of any size -> (features,)): a fixed
    projection of the 8 x 8 area-pooled image, FEATURES wide. The random Inception-v3 takes minutes on these CPUs;
    the real one runs in test_evaluate.py's command tests."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("projection", torch.randn(3 * 8 * 8, FEATURES, generator=generator))

    def forward(self, images):
        pooled = torch.nn.functional.adaptive_avg_pool2d(images.float() / 255, 8).flatten(1)
        return (torch.tanh(pooled @ self.projection),)


def trainer_for(shard_url, out_dir, *extra) -> vae_trainer.Trainer:
    """The real trainer of the tiny model, in this process, evaluating its first 3 test images at steps 0 and 2."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(out_dir), *TINY, "--num_workers", "0",
                               "--max_steps", "2", "--save_every_n_steps", "2", "--test_dataset_url", shard_url,
                               "--evaluate_every_n_steps", "2", "--eval_max_images", "3", *extra])
    cfg.validate()
    return vae_trainer.Trainer(cfg, common.DistInfo())


def trained(shard_url, out_dir, *extra, inception: nn.Module | None = None) -> vae_trainer.Trainer:
    trainer = trainer_for(shard_url, out_dir, *extra)
    if inception is not None:
        trainer.validator.inception = inception
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()
    return trainer


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_record(run_dir, step: int) -> dict:
    found = [r for r in records(run_dir) if r["step"] == step and "eval/psnr" in r]
    assert len(found) == 1, found
    return found[0]


def weights_and_ema(trainer) -> list[tuple[str, AutoEncoder]]:
    """The trainer's final weights and their EMA, as models of their own."""
    ema = AutoEncoder(trainer.vae.params)
    ema.load_state_dict(trainer.training.ema.model_state_dict(trainer.vae))
    return [("eval", trainer.vae), ("eval_ema", ema)]


TILES = {"tile_size": 64, "tile_overlap": 16}  # multi_size_run's: its 128 px evaluation is tiled


@pytest.fixture(scope="module")
def multi_size_run(shard_url, tmp_path_factory):
    """A run evaluating at its training size 64 and at 128 and 32, with rFID (on PooledFeatures); 128 px is above
    --eval_tile_size 64, so it is encoded and decoded in 64 px tiles (overlap 16), the others whole."""
    out = tmp_path_factory.mktemp("evalres")
    trainer = trained(shard_url, out, "--eval_resolutions", "128,32,64", "--eval_tile_size", "64",
                      "--eval_tile_overlap", "16", "--inception_weights", "none", inception=PooledFeatures())
    return trainer, str(out / "vae")


@pytest.mark.process
@pytest.mark.xdist_group("multi_size_run")  # shares the multi_size_run fixture: built once
def test_each_size_is_logged_with_its_suffix_and_its_own_numbers(multi_size_run, shard_url):
    """metrics.jsonl's @SIZE keys hold an evaluation at that size: equal (to rounding: these run one image per
    batch, the trainer fewer images per batch above its size: fp32 convolutions of other batch shapes round apart by
    a few 1e-6 of an MSE, 1e-5 of a PSNR, where another size's numbers differ by percents) to evaluate_model called
    here at that size on the same weights (128 px by the same tiles). The un-suffixed keys are the training size's."""
    trainer, run_dir = multi_size_run
    record = eval_record(run_dir, 2)
    for prefix, model in weights_and_ema(trainer):
        for size, suffix in ((64, ""), (128, "@128"), (32, "@32")):
            direct = ev.evaluate_model(model, shard_url, size, batch_size=1, device=CPU, max_images=3,
                                       lpips_model=trainer.objective.lpips, inception=trainer.validator.inception,
                                       **(TILES if size == 128 else {}))
            assert record[f"{prefix}/n_images{suffix}"] == direct["n_images"] == 3
            for metric in METRICS:
                logged = record[f"{prefix}/{metric}{suffix}"]
                assert isinstance(logged, float), (prefix, metric, suffix)
                assert logged == pytest.approx(direct[metric], rel=1e-4 if metric == "rfid" else 1e-5), \
                    (prefix, metric, suffix)
    # the sizes differ: a run that evaluated every size at its training size would log one number thrice
    assert len({record["eval/psnr"], record["eval/psnr@128"], record["eval/psnr@32"]}) == 3
    # latent diagnostics and the grids are the training size's only; step 0 has every size too
    assert "eval/latent_hf_fraction" in record and not any(k.startswith("eval/latent") and "@" in k for k in record)
    assert not any("@64" in k for k in record)
    assert {k for k in eval_record(run_dir, 0) if "@" in k} == {k for k in record if "@" in k}


@pytest.mark.process
@pytest.mark.xdist_group("multi_size_run")  # shares the multi_size_run fixture: built once
@pytest.mark.curves
def test_reporter_prints_a_line_per_size_and_curves_draw_one(multi_size_run):
    trainer, run_dir = multi_size_run
    results = {k: v for k, v in eval_record(run_dir, 2).items() if k != "step"}
    lines = []
    trainer.report.print = lambda line, file=None: lines.append(line)
    trainer.report.evaluation(results, {}, 7)  # no grids: no EMA part of the line, nothing saved
    assert [line.split(" |")[0] for line in lines[:3]] == ["eval step 7", "eval @128 step 7", "eval @32 step 7"]
    assert f"psnr {results['eval/psnr@128']:.4f}" in lines[1]
    panels = {title: [label for label, _, _ in lines] for title, lines, _ in
              plots.panels_with_data(records(run_dir))}
    assert panels["held-out PSNR (dB)"] == ["weights", "EMA", "weights @32", "EMA @32", "weights @128", "EMA @128"]
    assert panels["held-out rFID"][-1] == "EMA @128"
    assert plots.plot_metrics(run_dir) is not None


@pytest.mark.process
def test_the_default_logs_the_keys_and_numbers_it_logged_before(shard_url, tmp_path):
    """No --eval_resolutions: the record holds the keys evaluation always logged (evaluate_model's at the training
    size, latent diagnostics included) and the numbers of that call with the trainer's own arguments, bitwise."""
    trainer = trained(shard_url, tmp_path, "--inception_weights", "none")
    record = eval_record(str(tmp_path / "vae"), 2)
    expected = {"step", "best/step", "best/ema_psnr"}  # (and the best evaluated step so far: --best_metric auto)
    for prefix, model in weights_and_ema(trainer):
        direct = ev.evaluate_model(model, shard_url, 64, batch_size=2, device=CPU, max_images=3,
                                   lpips_model=trainer.objective.lpips, inception=None, channels_last=True,
                                   latent_diagnostics=True)
        direct.pop("grid")
        keys = {k for k in direct if not k.endswith("_missing")}
        expected |= {f"{prefix}/{k}" for k in keys}
        for k in keys:
            assert record[f"{prefix}/{k}"] == direct[k], (prefix, k)  # bitwise
    assert set(record) == expected


@pytest.mark.process
@pytest.mark.xdist_group("multi_size_run")  # shares the multi_size_run fixture: built once
def test_sizes_above_the_tile_size_are_evaluated_by_tiles_as_evaluate_py_does(multi_size_run, shard_url, capsys):
    """--eval_tile_size 64 (multi_size_run): the 128 px evaluation encodes and decodes in 64 px tiles (overlap 16),
    the 64 px one whole. The logged values are those of evaluate.py's command with --tile_size 64 --tile_overlap 16
    on the run's final checkpoint (the same key names), and differ from a whole-image evaluation at 128."""
    trainer, run_dir = multi_size_run
    record = eval_record(run_dir, 2)
    capsys.readouterr()
    for ema in (False, True):
        assert ev.main(["--ckpt", run_dir, "--dataset_url", shard_url, "--resolution", "64,128", "--max_images", "3",
                        "--batch_size", "2", "--tile_size", "64", "--tile_overlap", "16", "--vgg16_weights", "random",
                        "--inception_weights", "none"] + ["--ema"] * ema) == 0
        cli = json.loads(capsys.readouterr().out)
        assert cli["resolution"] == 64 and cli["resolutions"] == [64, 128] and cli["step"] == 2
        prefix = "eval_ema" if ema else "eval"
        for metric in ("psnr", "ssim", "lpips"):
            for suffix in ("", "@128"):
                assert record[f"{prefix}/{metric}{suffix}"] == pytest.approx(cli[f"{metric}{suffix}"], rel=1e-6), \
                    (prefix, metric, suffix)
    vae = trainer.vae
    whole = ev.evaluate_model(vae, shard_url, 128, batch_size=1, device=CPU, max_images=3)
    tiled = ev.evaluate_model(vae, shard_url, 128, batch_size=1, device=CPU, max_images=3, tile_size=64,
                              tile_overlap=16)
    assert abs(whole["psnr"] - record["eval/psnr@128"]) > 1e-3  # tiling happened: GroupNorm sees each tile alone
    assert tiled["psnr"] == pytest.approx(record["eval/psnr@128"], rel=1e-6)
    # the tiled path is reconstruct's tiler: the first image by hand
    import data as data_lib
    _, images = next(data_lib.iter_eval_batches(shard_url, 128, 1, max_images=1))
    x = data_lib.to_model_input(images, CPU, channels_last=False)
    with torch.no_grad():
        recon = ev.tiled_decode(vae, ev.tiled_encode(vae, x, 64, 16), 64, 16).clamp(-1, 1)
    one = ev.evaluate_model(vae, shard_url, 128, batch_size=1, device=CPU, max_images=1, tile_size=64, tile_overlap=16)
    assert one["psnr"] == pytest.approx(ev.psnr_per_image(recon * 0.5 + 0.5, x * 0.5 + 0.5).item(), rel=1e-9)


@pytest.mark.parametrize("flags, message", [
    (["--eval_resolutions", "128,66"], "--eval_resolutions 128,66: 66 px is not a multiple of the downsample factor 4"),
    (["--eval_resolutions", "8"], "8 px is smaller than 16 px"),
    (["--eval_resolutions", "128,big"], "'big' is not a positive whole number"),
    (["--eval_resolutions", "128", "--eval_tile_size", "30", "--eval_tile_overlap", "8"],
     "must be multiples of the downsample factor 4"),
    (["--eval_resolutions", "128", "--eval_tile_size", "32", "--eval_tile_overlap", "32"],
     "--eval_tile_overlap must be >= 0 and smaller than --eval_tile_size 32"),
])
def test_a_size_that_cannot_be_evaluated_is_refused_in_one_line_before_anything_starts(shard_url, tmp_path, capsys,
                                                                                     flags, message):
    argv = ["--dataset_url", shard_url, "--test_dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY, *flags]
    assert vae_trainer.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and message in captured.err, captured
    assert captured.out == "" and not os.path.exists(tmp_path / "vae")


@pytest.mark.process
@pytest.mark.xdist_group("multi_size_run")  # shares the multi_size_run fixture: built once
def test_evaluate_py_refuses_a_bad_size_among_several_in_one_line(multi_size_run, shard_url, capsys):
    _, run_dir = multi_size_run
    for sizes, message in (("64,66", "multiple of the downsample factor 4"), ("64,8", "smaller than 16 px")):
        assert ev.main(["--ckpt", run_dir, "--dataset_url", shard_url, "--resolution", sizes]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert ev.main(["--ckpt", run_dir, "--dataset_url", shard_url, "--resolution", "64,128", "--latent_stats"]) == 2
    assert "--latent_stats takes one --resolution" in capsys.readouterr().err


@pytest.mark.process
def test_an_evaluation_stopped_between_two_sizes_is_redone_on_resume(shard_url, tmp_path, monkeypatch):
    """A stop (Ctrl-C twice, kill -9) during the 128 px part of step 2's evaluation, after its checkpoint and its
    64 px part: nothing of step 2's evaluation is in metrics.jsonl, so the resumed run owes it and logs every size."""
    flags = ("--eval_resolutions", "128", "--inception_weights", "none", "--max_steps", "4",
             "--perceptual_weight", "0")  # (pixel losses: without LPIPS, an evaluation still has two sizes to do)
    trainer = trainer_for(shard_url, tmp_path, *flags)
    evaluate_model = ev.evaluate_model

    def stopped_at_128_at_step_2(vae, url, resolution, **kwargs):
        if trainer.step == 2 and resolution == 128:
            raise KeyboardInterrupt
        return evaluate_model(vae, url, resolution, **kwargs)
    monkeypatch.setattr(ev, "evaluate_model", stopped_at_128_at_step_2)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        trainer.close()
    run_dir = str(tmp_path / "vae")
    assert [r["step"] for r in records(run_dir) if "eval/psnr" in r or "eval/psnr@128" in r] == [0]
    monkeypatch.setattr(ev, "evaluate_model", evaluate_model)
    resumed = trainer_for(shard_url, tmp_path, *flags)
    try:
        assert resumed.owed == (True, False) and resumed.train() == 0
    finally:
        resumed.close()
    for key in ("eval/psnr", "eval/psnr@128", "eval_ema/psnr@128"):
        assert [r["step"] for r in records(run_dir) if key in r] == [0, 2, 4], key
    # without --eval_tile_size, 128 px (above the training size) is evaluated whole (multi_size_run's is tiled)
    direct = ev.evaluate_model(resumed.vae, shard_url, 128, batch_size=1, device=CPU, max_images=3)
    assert eval_record(run_dir, 4)["eval/psnr@128"] == pytest.approx(direct["psnr"], rel=1e-5)


def test_eval_sizes_and_batches():
    ev_cfg = config.EvalConfig(eval_resolutions="512, 256,1024,512")
    assert config.eval_sizes(ev_cfg, 256) == (256, 512, 1024)
    assert config.eval_sizes(config.EvalConfig(), 256) == (256,)
    assert [ev.eval_batch_size(8, s, 256) for s in (128, 256, 512, 1024, 4096)] == [8, 8, 2, 1, 1]
    assert ev.size_suffix(256, 256) == "" and ev.size_suffix(512, 256) == "@512"
    with pytest.raises(config.ConfigError, match="'0' is not a positive whole number"):
        config.parse_sizes("0", "eval_resolutions")
