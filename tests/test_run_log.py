"""run_log.py in-process: metrics are averaged per key over the steps that logged it, then over the ranks (maxima
are the maxima over every rank); the stdout line names every loss term it is given; the Reporter writes the line
and metrics.jsonl on rank 0 and nothing on other ranks."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import config
import run_log
from common import DistInfo
from run_log import Metrics
import run_setup

# per rank, per step: the loss, and the GAN term (None: off on that step, as before --disc_start)
LOSSES = {0: [1.0, 3.0, 5.0], 1: [10.0, 20.0, 60.0]}
GAN = {0: [None, 2.0, 4.0], 1: [None, 7.0, 9.0]}
ABS_MAX = {0: [1.5, 8.0, 2.0], 1: [4.0, 3.0, 6.5]}


def log_window(metrics: Metrics, rank: int) -> None:
    for loss, gan, abs_max in zip(LOSSES[rank], GAN[rank], ABS_MAX[rank]):
        metrics.add(**{"loss/total": torch.tensor(loss), "latent/channel_std": torch.tensor([loss, 2 * loss])})
        if gan is not None:
            metrics.add(**{"loss/gan_g": torch.tensor(gan)})
        metrics.max(**{"latent/abs_max": torch.tensor(abs_max)})
        metrics.end_step()


def _reduce_worker(rank: int, world: int, store_path: str, out) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        metrics = Metrics()
        log_window(metrics, rank)
        out[rank] = metrics.reduce(DistInfo(rank=rank, world_size=world))
    finally:
        dist.destroy_process_group()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_metrics_under_two_ranks_are_the_mean_over_ranks_of_each_ranks_step_average(tmp_path):
    """What the log shows under DDP is what one rank's own average would be if the ranks agreed: every rank's
    window averaged over the steps that logged each key, then the mean over ranks (not their sum), and maxima
    over every rank. Both ranks report the same numbers."""
    out = mp.Manager().dict()
    mp.spawn(_reduce_worker, args=(2, str(tmp_path / "store"), out), nprocs=2)
    per_rank_loss = [mean(LOSSES[r]) for r in (0, 1)]  # 3.0 and 30.0
    per_rank_gan = [mean([g for g in GAN[r] if g is not None]) for r in (0, 1)]  # 3.0 and 8.0: 2 steps each
    expected = {"loss/total": mean(per_rank_loss), "loss/gan_g": mean(per_rank_gan),
                "latent/channel_std": [mean(per_rank_loss), 2 * mean(per_rank_loss)],
                "latent/abs_max": max(ABS_MAX[0] + ABS_MAX[1])}
    assert expected == {"loss/total": 16.5, "loss/gan_g": 5.5, "latent/channel_std": [16.5, 33.0],
                        "latent/abs_max": 8.0}
    for rank in (0, 1):
        assert out[rank].keys() == expected.keys()
        for key, value in expected.items():
            assert out[rank][key] == pytest.approx(value, rel=1e-6), (rank, key)


def test_metrics_of_one_process_and_the_window_reset():
    metrics = Metrics()
    log_window(metrics, 1)
    # these sums and quotients are exact in float32
    assert metrics.reduce(DistInfo()) == {"loss/total": 30.0, "loss/gan_g": 8.0, "latent/channel_std": [30.0, 60.0],
                                          "latent/abs_max": 6.5}
    assert metrics.reduce(DistInfo()) == {}  # the next window starts empty


def test_the_log_line_iterates_over_the_loss_terms():
    metrics = {"loss/total": 1.0, "loss/perceptual": 0.25, "loss/pooled_mse": 0.125, "loss/lowpass_mse": 0.0625,
               "loss/kl": 0.5, "loss/edge": 0.75, "loss/adaptive_weight": 3.0, "img_per_s": 2.0, "eta_s": 61.0}
    line = run_log.log_line(metrics, 5, 10, gan=True)
    assert line.startswith("step 5/10 | loss 1.0000 | lpips 0.2500 | pmse 0.12500 | lpmse 0.06250 | kl 0.5000 | "
                           "edge 0.7500 | g 0.0000 | d 0.0000 | dacc 0.00 | ")
    assert "adaptive_weight" not in line and line.endswith("2.0 img/s | eta 0:01:01")


def reporter_of(cfg, info, run_dir) -> run_log.Reporter:
    """The Reporter the trainer builds from its sections, writing into `run_dir`."""
    cfg = config.with_values(cfg, output_dir=str(run_dir.parent), run_name=run_dir.name)
    return run_log.Reporter(cfg.run, cfg.data, info, max_steps=cfg.optim.max_steps, grad_accum=cfg.optim.grad_accum,
                            gan=cfg.critic.do_ganloss, channels_last=cfg.speed.channels_last)


def test_the_reporter_writes_rank_0s_line_and_record_only(tmp_path, capsys, shard_url):
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--max_steps", "10", "--batch_size", "2",
                               "--vae_resolution", "32", "--num_samples", "2"])
    for rank in (1, 0):
        reporter = reporter_of(cfg, DistInfo(rank=rank, world_size=2), tmp_path)
        assert (reporter.sample_images is None) == (rank == 1)  # the grid's images: rank 0's
        reporter.metrics({"loss/total": 0.5, "loss/kl": 0.25, "latent/mean": 0.0, "latent/std": 1.0}, step=4,
                         elapsed=2.0, steps_done=4, lr_vae=1e-3, skipped={"decode": 0})
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("step 4/10 | loss 0.5000 | kl 0.2500")
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # 4 steps x 2 images x 1 accum x 2 ranks in 2 s; 6 steps left at 0.5 s each
    assert record == {"step": 4, "loss/total": 0.5, "loss/kl": 0.25, "latent/mean": 0.0, "latent/std": 1.0,
                      "img_per_s": 8.0, "img_per_s_avg": 8.0, "s_per_step": 0.5, "eta_s": 3.0, "lr/vae": 1e-3,
                      "data/skipped_decode": 0}


def test_rates_and_eta_mean_what_the_readme_says(tmp_path, capsys, shard_url):
    """img/s: over the window since the last line; avg: every step of this process; the ETA: the steps left at
    that average. A slow first window (start-up) then a fast one: 0.5 and 4.5 img/s, average 2.5."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--max_steps", "100", "--batch_size", "1",
                               "--vae_resolution", "32", "--num_samples", "1"])
    reporter = reporter_of(cfg, DistInfo(), tmp_path)
    reporter.metrics({"loss/total": 1.0}, step=1, elapsed=2.0, steps_done=1, lr_vae=1e-3, skipped={})
    reporter.metrics({"loss/total": 1.0}, step=10, elapsed=2.0, steps_done=9, lr_vae=1e-3, skipped={})
    first, second = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert (first["img_per_s"], first["img_per_s_avg"], first["eta_s"]) == (0.5, 0.5, 99 / 0.5)
    assert (second["img_per_s"], second["img_per_s_avg"], second["eta_s"]) == (4.5, 2.5, 90 / 2.5)
    assert "| 4.5 img/s (avg 2.5) | eta 0:00:36" in capsys.readouterr().out.splitlines()[-1]


def test_a_step_of_seconds_is_shown_in_seconds_per_step(tmp_path, capsys, shard_url):
    """A large video model: one clip in 45 s is 0.022 img/s, which the line's one decimal showed as 0.0 img/s
    (issue 48 item 10). Where a step takes a second or more the line leads with the seconds per step; below, it
    stays img/s, a rate below 1 img/s with three significant digits."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--max_steps", "100", "--batch_size", "1",
                                  "--vae_resolution", "32", "--num_samples", "1"])
    reporter = reporter_of(cfg, DistInfo(), tmp_path)
    reporter.metrics({"loss/total": 1.0}, step=2, elapsed=90.0, steps_done=2, lr_vae=1e-3, skipped={})
    line = capsys.readouterr().out.splitlines()[-1]
    assert "| 45.0 s/step (0.0222 img/s, avg 0.0222) | eta 1:13:30" in line and "0.0 img/s" not in line, line
    reporter.metrics({"loss/total": 1.0}, step=10, elapsed=4.0, steps_done=8, lr_vae=1e-3, skipped={})
    assert "| 2.0 img/s (avg 0.106) |" in capsys.readouterr().out.splitlines()[-1]  # 10 images in 94 s
    assert json.loads(open(tmp_path / "metrics.jsonl").readline())["s_per_step"] == 45.0


def test_a_run_that_logs_rarely_says_something_at_steps_1_and_10(tmp_path, shard_url):
    def due(every):
        cfg = run_setup.parse_config(["--dataset_url", shard_url, "--log_every_n_steps", str(every), "--vae_resolution",
                                   "32", "--num_samples", "1"])
        reporter = reporter_of(cfg, DistInfo(rank=1, world_size=2), tmp_path)
        return [step for step in range(1, 121) if reporter.log_due(step)]
    assert due(50) == [1, 10, 50, 100]
    assert due(2) == list(range(2, 121, 2))  # frequent logs need no early line (and keep their records' steps)


def test_curves_are_drawn_at_most_once_a_minute_and_at_the_end(tmp_path, shard_url, monkeypatch):
    """curves.png costs matplotlib about a second that every rank waits for: checkpoints and evaluations closer
    than run_log.CURVES_EVERY_S draw it once, the first a minute into the run, and the run's end draws what was
    skipped (once, and only then): a run shorter than a minute draws once, at its end."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--wandb_mode", "disabled"])
    drawn = []
    monkeypatch.setattr(run_log.plots, "plot_metrics", lambda run_dir: drawn.append(run_dir))
    reporter = reporter_of(cfg, DistInfo(), tmp_path)
    for _ in range(3):
        reporter.plot_curves()  # three checkpoints in the run's first second
    assert drawn == []
    reporter.curves_drawn_at -= run_log.CURVES_EVERY_S  # a minute later
    for _ in range(3):
        reporter.plot_curves()  # three checkpoints within a second
    assert drawn == [str(tmp_path)]
    reporter.close()  # the end: the skipped ones are drawn
    assert len(drawn) == 2
    reporter.close()
    assert len(drawn) == 2  # nothing skipped since: not drawn again
    short = reporter_of(cfg, DistInfo(), tmp_path)
    short.plot_curves()
    short.close()
    assert len(drawn) == 3  # a run of less than a minute: drawn once, at its end
    quiet = reporter_of(cfg, DistInfo(), tmp_path)
    quiet.curves_drawn_at -= run_log.CURVES_EVERY_S
    quiet.plot_curves()
    quiet.close()
    assert len(drawn) == 4  # a run whose one plot is current draws nothing more at its end


def test_a_decoder_only_fine_tune_is_not_told_to_lower_the_kl_weight():
    """Issue 31 item 7: behind a frozen encoder (--train_parts decoder) the latent is the source's and the KL trains
    nothing, so a collapsed-looking latent is not a posterior collapse to fix with --kl_weight."""
    said = []
    collapsed = {"latent/collapsed_fraction": 0.9}
    run_log.CollapseTracker(said.append).check(collapsed, 10)
    assert len(said) == 1 and "lower --kl_weight" in said[0]
    run_log.CollapseTracker(said.append, encoder_trains=False).check(collapsed, 10)
    assert len(said) == 1


@pytest.mark.parametrize("layers", ["unbuffered", "buffered"])
def test_the_console_survives_a_write_that_itself_fails(layers):
    """common.Console where the write itself meets the dead pipe, not a later flush: `python -u` (PYTHONUNBUFFERED,
    which cli_env and many job scripts set) makes sys.stdout a write-through text layer straight over the file
    descriptor, so every line goes to the pipe as it is written; with the default buffer a line longer than the
    buffer does too. The write returns, the console is lost (BrokenPipeError), and its descriptor now points at
    /dev/null, where later writes and the interpreter's flush at exit go."""
    import io
    import os
    import common
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    raw = io.FileIO(write_fd, "w")
    # `python -u`'s sys.stdout: TextIOWrapper(FileIO, write_through=True), no buffer in between
    stream = (io.TextIOWrapper(raw, write_through=True) if layers == "unbuffered"
              else io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=io.DEFAULT_BUFFER_SIZE)))
    line = "x" * (10 if layers == "unbuffered" else 4 * io.DEFAULT_BUFFER_SIZE)
    console = common.Console(stream)
    assert console.write(line) == len(line)
    assert isinstance(console.lost, BrokenPipeError) and not console.isatty()
    assert os.path.samestat(os.fstat(write_fd), os.stat(os.devnull))
    assert console.write("more") == 4
    console.flush()
    stream.close()  # to /dev/null now: no error at exit either
