"""run_log.py in-process: the stdout line names every loss term it is given, and the Reporter writes the line,
metrics.jsonl and (rank 0 only) nothing on other ranks."""
from __future__ import annotations

import json

import config
import run_log
from common import DistInfo


def test_the_log_line_iterates_over_the_loss_terms():
    metrics = {"loss/total": 1.0, "loss/perceptual": 0.25, "loss/pooled_mse": 0.125, "loss/lowpass_mse": 0.0625,
               "loss/kl": 0.5, "loss/edge": 0.75, "loss/adaptive_weight": 3.0, "img_per_s": 2.0, "eta_s": 61.0}
    line = run_log.log_line(metrics, 5, 10, gan=True)
    assert line.startswith("step 5/10 | loss 1.0000 | lpips 0.2500 | pmse 0.12500 | lpmse 0.06250 | kl 0.5000 | "
                           "edge 0.7500 | g 0.0000 | d 0.0000 | dacc 0.00 | ")
    assert "adaptive_weight" not in line and line.endswith("2.0 img/s | eta 0:01:01")


def test_the_reporter_writes_rank_0s_line_and_record_only(tmp_path, capsys, shard_url):
    cfg = config.parse_config(["--dataset_url", shard_url, "--max_steps", "10", "--batch_size", "2",
                               "--vae_resolution", "32", "--num_samples", "2"])
    for rank in (1, 0):
        reporter = run_log.Reporter(cfg, DistInfo(rank=rank, world_size=2), str(tmp_path))
        assert (reporter.sample_images is None) == (rank == 1)  # the grid's images: rank 0's
        reporter.metrics({"loss/total": 0.5, "loss/kl": 0.25, "latent/mean": 0.0, "latent/std": 1.0}, step=4,
                         elapsed=2.0, steps_done=4, lr_vae=1e-3, skipped={"decode": 0})
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("step 4/10 | loss 0.5000 | kl 0.2500")
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # 4 steps x 2 images x 1 accum x 2 ranks in 2 s; 6 steps left at 0.5 s each
    assert record == {"step": 4, "loss/total": 0.5, "loss/kl": 0.25, "latent/mean": 0.0, "latent/std": 1.0,
                      "img_per_s": 8.0, "eta_s": 3.0, "lr/vae": 1e-3, "data/skipped_decode": 0}
