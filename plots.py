"""Pictures of a run for people to look at, without wandb: sample grids enlarged for viewing, and the curves of
metrics.jsonl (losses, evaluation PSNR/SSIM/LPIPS/rFID, learning rate, latent statistics) as one PNG.

    python plots.py runs/demo          # writes runs/demo/curves.png from runs/demo/metrics.jsonl

Importable without the trainer: `enlarge_for_viewing` for a grid about to be saved, `plot_metrics(run_dir)` at
each evaluation or checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

# A 64 px tile is a thumbnail on a screen; 256 px shows what a reconstruction got wrong without zooming.
MIN_VIEW_TILE = 256

# The panels of curves.png: (title, [(metrics.jsonl key, label)], log scale). Keys a run does not log are left
# out, and so is a panel with none of its keys.
PANELS = [
    ("training losses", [("loss/total", "total"), ("loss/perceptual", "LPIPS"), ("loss/pooled_mse", "pooled MSE"),
                         ("loss/lowpass_mse", "low-pass MSE"), ("loss/gan_g", "generator"),
                         ("loss/disc", "critic")], True),
    ("KL", [("loss/kl", "KL")], False),
    ("held-out PSNR (dB)", [("eval/psnr", "weights"), ("eval_ema/psnr", "EMA")], False),
    ("held-out SSIM", [("eval/ssim", "weights"), ("eval_ema/ssim", "EMA")], False),
    ("held-out LPIPS", [("eval/lpips", "weights"), ("eval_ema/lpips", "EMA")], False),
    ("held-out rFID", [("eval/rfid", "weights"), ("eval_ema/rfid", "EMA")], False),
    ("learning rate", [("lr/vae", "VAE"), ("lr/disc", "critic")], True),
    ("latent", [("latent/mean", "mean"), ("latent/std", "std"), ("eval/latent_global_std", "held-out std")], False),
    ("critic", [("gan/disc_acc", "accuracy"), ("gan/active_fraction", "generator active")], False),
    ("gradient norm", [("grad_norm/vae", "VAE"), ("grad_norm/disc", "critic")], True),
    ("throughput (img/s)", [("img_per_s", "img/s")], False),
]


def enlarge_for_viewing(grid: torch.Tensor, tile_size: int, min_tile: int = MIN_VIEW_TILE) -> torch.Tensor:
    """`grid` (C, H, W) of tiles `tile_size` px wide, repeated by the smallest whole factor that makes each tile
    at least `min_tile` px (nearest neighbour: every pixel becomes a k x k block of the same value, nothing
    is interpolated, and grid[..., ::k, ::k] of the result is the input exactly). Tiles already that big are
    returned as they are."""
    factor = max(1, math.ceil(min_tile / tile_size))
    if factor == 1:
        return grid
    return grid.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a crash is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a scalar key; null, non-finite and list values are left out."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def eval_size_suffixes(records: list[dict]) -> list[str]:
    """The @SIZE suffixes of the evaluation keys (--eval_resolutions: eval/psnr@512), smallest size first."""
    sizes = {int(k.rsplit("@", 1)[1]) for r in records for k in r
             if k.startswith(("eval/", "eval_ema/")) and k.rsplit("@", 1)[-1].isdigit() and "@" in k}
    return [f"@{size}" for size in sorted(sizes)]


def panels_with_data(records: list[dict]) -> list[tuple[str, list, bool]]:
    """The PANELS that `records` have data for: (title, [(label, steps, values)], log scale). An evaluation key
    gets a line per evaluated size in its panel: the training size's as labelled, the others' labelled @SIZE."""
    panels, suffixes = [], eval_size_suffixes(records)
    for title, keys, log_scale in PANELS:
        keys = keys + [(key + suffix, f"{label} {suffix}") for suffix in suffixes for key, label in keys
                       if key.startswith(("eval/", "eval_ema/"))]
        lines = [(label, *series(records, key)) for key, label in keys]
        lines = [line for line in lines if line[1]]
        if lines:
            panels.append((title, lines, log_scale))
    return panels


def plot_metrics(run_dir: str, out_path: str | None = None) -> str | None:
    """Write the curves of `run_dir`/metrics.jsonl to `out_path` (default `run_dir`/curves.png); returns the
    path, or None when there is nothing to plot yet."""
    # the figure API without pyplot: no global figure registry to close, no GUI backend to choose, and safe on
    # any thread
    from matplotlib.figure import Figure

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    panels = panels_with_data(records)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    # fixed margins, not tight_layout: measuring every tick label for the layout and then drawing them again took
    # half of the plot's ~0.8 s, which every rank waits for at a checkpoint
    fig = Figure(figsize=(5 * cols, 3.4 * rows))
    # (1.05 in on the left and between panels: a log axis spanning less than a decade labels its minor ticks,
    # "1.75x10^-3", about 0.95 in at 80 dpi)
    fig.subplots_adjust(left=1.05 / (5 * cols), right=1 - 0.15 / (5 * cols), bottom=0.55 / (3.4 * rows),
                        top=1 - 0.75 / (3.4 * rows), wspace=0.3, hspace=0.55)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, lines, log_scale) in zip(axes.flat, panels):
        for label, steps, values in lines:
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=label)
        if log_scale and all(v > 0 for _, _, values in lines for v in values):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{os.path.basename(os.path.normpath(run_dir))}: step {records[-1]['step']}")
    out_path = out_path or os.path.join(run_dir, "curves.png")
    tmp = out_path + ".tmp"
    fig.savefig(tmp, dpi=80, format="png")  # then renamed: a viewer never sees half a file
    os.replace(tmp, out_path)
    return out_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Plot a run's metrics.jsonl as PNG curves.", allow_abbrev=False)
    parser.add_argument("run_dir", help="a run directory (holding metrics.jsonl), e.g. runs/demo")
    parser.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/curves.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        print(f"error: no metrics.jsonl in {args.run_dir} (give a run directory, e.g. runs/demo)", file=sys.stderr)
        return 2
    path = plot_metrics(args.run_dir, args.out)
    if path is None:
        print(f"error: {metrics_path} holds no step with a metric yet", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
