"""The resolutions section (issue 26): train at one size or several and serve at larger ones, with real commands;
and whether the aspect of an input changes what a model trained on squares reconstructs (aspect_study)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import torch
from PIL import Image

import data as data_lib
import sources
import shards
from bench.harness import HERE
from bench.report import Report
from bench.runs import run_logged, wait_logged
from weights import vgg16_cache_path


RES_RUNS = {  # the resolutions section's runs: name -> extra flags (the schedule's switch step filled in)
    "single 64": [],
    "multi 64,96,128": ["--train_resolutions", "64,96,128"],
    "staged 64 -> 96,128": ["--train_resolutions", "64;{switch}:96,128", "--last_stage_trains", "1"],
}
RES_SERVE = (64, 128, 256)  # evaluated at the training size, 2x and 4x


def bench_resolutions(args, tmp, report: Report) -> dict:
    """Single-resolution against multi-resolution and staged training of the demo's model at equal steps and pixels
    per step, each evaluated at 1x, 2x and 4x its reference size on held-out photos (every step a real command); and
    the aspect study on the single-size model."""
    root = args.res_runs_dir or os.path.join(tmp, "resolutions")
    os.makedirs(root, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = args.res_steps
    procs = {}
    for name, extra in RES_RUNS.items():
        run = name.split()[0]
        if os.path.isfile(os.path.join(root, run, "checkpoints", f"step_{steps:08d}.pt")):
            continue
        flags = [f.format(switch=2 * steps // 3) for f in extra]
        report.line(f"  training {name}: python vae_trainer.py --demo --max_steps {steps} {' '.join(flags)} ...")
        procs[f"train {name}"] = run_logged(
            [sys.executable, "vae_trainer.py", "--demo", "--max_steps", str(steps), "--output_dir", root, "--run_name",
             run, "--save_every_n_steps", str(steps), "--evaluate_every_n_steps", str(steps), "--inception_weights",
             "none", "--wandb_mode", "disabled", "--num_threads", "1", "--seed", str(args.seed), *flags],
            os.path.join(root, f"{run}.log"), env)
    wall = wait_logged(procs)
    _, demo_test = shards.ensure_demo_shards(os.path.join(root, "demo_data"))  # built by the first run
    heldout = {"demo": demo_test, **({"extra": args.res_heldout_url} if args.res_heldout_url else {})}
    vgg = "torchvision" if os.path.isfile(vgg16_cache_path()) else "random"
    out = {"steps": steps, "vgg16": vgg, "wall_s": wall, "runs": {}}
    rows = []
    for name in RES_RUNS:
        run_dir = os.path.join(root, name.split()[0])
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            logged = [r for r in map(json.loads, f) if "img_per_s" in r]
        # img/s counts images of the reference size (4 a step, the demo's batch), whatever size a step trained at
        result = {"s_per_step": 4 / logged[-1]["img_per_s_avg"], "eval": {}}
        for set_name, url in heldout.items():
            for size in RES_SERVE:
                proc = subprocess.run(
                    [sys.executable, "evaluate.py", "--ckpt", run_dir, "--ema", "--dataset_url", url, "--resolution",
                     str(size), "--vgg16_weights", vgg, "--inception_weights", "none", "--batch_size", "2"],
                    cwd=HERE, env=env, capture_output=True, text=True, check=True)
                metrics = json.loads(proc.stdout)
                result["eval"][f"{set_name}@{size}"] = {k: metrics.get(k) for k in ("psnr", "ssim", "lpips", "images")}
                rows.append([name, set_name, size, metrics.get("psnr"), metrics.get("ssim"), metrics.get("lpips")])
        out["runs"][name] = result
    report.table(f"Held-out reconstruction after {steps} steps (EMA; LPIPS with {vgg} VGG16)",
                 ["run", "photos", "px", "PSNR", "SSIM", "LPIPS"], rows)
    out["aspect"] = aspect_study(os.path.join(root, "single"), list(heldout.values()), report)
    return out


def aspect_study(run_dir: str, urls: list[str], report: Report) -> dict:
    """Whether aspect-ratio buckets could matter to a convolutional VAE: does the shape of the input change what a
    model trained on squares reconstructs? The same 64x64 region (the centre of each held-out photo resized to 96 px
    on its shorter side) reconstructed from the square alone, from a 64x96 and a 96x64 input around it, and from the
    whole photo; PSNR over that region (and over each whole input)."""
    import checkpoint
    vae, _ = checkpoint.load_model(run_dir, ema=True)
    f = vae.downsample_factor
    photos = []
    for url in urls:
        for shard in sources.list_shards(url):
            for _, sample in sources.iter_shard(shard, Counter()):
                img = Image.fromarray(data_lib.load_rgb(data_lib._pick_image(sample)))
                scale = 96 / min(img.size)
                img = img.resize((max(96, round(img.width * scale)), max(96, round(img.height * scale))),
                                 Image.Resampling.BICUBIC)
                photos.append(torch.from_numpy(np.array(img)).permute(2, 0, 1))
    cases = {"square 64x64": (0, 0, 64, 64), "wide 64x96": (0, -16, 64, 96), "tall 96x64": (-16, 0, 96, 64)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in [*cases, "whole photo"]}

    def psnr(a, b) -> float:
        return float(10 * torch.log10(4.0 / ((a - b) ** 2).mean()))
    for photo in photos:
        x = photo[None].float() / 127.5 - 1
        h, w = (s // f * f for s in x.shape[-2:])
        x = x[:, :, :h, :w]
        top, left = h // 2 - 32, w // 2 - 32
        target = x[:, :, top:top + 64, left:left + 64]
        for name, (dt, dl, hh, ww) in {**cases, "whole photo": (-top, -left, h, w)}.items():
            t, l = top + dt, left + dl
            with torch.no_grad():
                recon = vae.decode(vae.encode(x[:, :, t:t + hh, l:l + ww])).clamp(-1, 1)
            results[name].append((psnr(recon[:, :, -dt:-dt + 64, -dl:-dl + 64], target),
                                  psnr(recon, x[:, :, t:t + hh, l:l + ww])))
    out = {name: {"region_psnr": [round(r, 2) for r, _ in v], "region_psnr_mean": float(np.mean([r for r, _ in v])),
                  "input_psnr_mean": float(np.mean([w for _, w in v]))} for name, v in results.items()}
    report.table(f"The same 64x64 region of {len(photos)} held-out photos, by the shape of the input (EMA)",
                 ["input", "region PSNR (mean)", "whole input PSNR (mean)"],
                 [[name, v["region_psnr_mean"], v["input_psnr_mean"]] for name, v in out.items()])
    return out
