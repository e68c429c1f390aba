"""The video section (issue 33): fine-tuning Wan's video VAE on clips.

memory: the memory check's own estimate (memory.estimate_step_memory: probes of a clip of the run's length, run
through the trainer's dataflow at 64 and 96 px and extrapolated in pixels) for one clip per GPU of Wan 2.1's VAE as released
(AutoencoderKLWan: base 96, z 16, dim_mult 1,2,4,4, 2 blocks, time halved at the two lower levels; random weights:
the figure depends on the shapes only), LPIPS and the VGG16 critic on, for three recipes (decoder-only fp32; decoder-
only bf16 with the decoder checkpointed; the whole VAE in bf16, every level checkpointed) at the clip lengths of
--video_memory_frames and the sizes of --video_memory_sizes.

quality: what a decoder fine-tune does to held-out clips, every step a real command. A small VAE of Wan 2.1's
structure is first trained on moving-camera clips of the demo's photos (the "release", exported as an
AutoencoderKLWan folder by export.py); then, from it, on clips of other photos (--video_photos, e.g.
mate-backgrounds' nature photos): its decoder fine-tuned, the same with --temporal_weight, and the whole VAE. evaluate.py
--video_frames reports per-frame PSNR/SSIM and the temporal PSNR (the frame-difference error) on held-out clips of
photos none of them trained on.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch

import shards
from bench.report import Report
from bench.runs import run_logged, wait_logged
from config import Precision
from sources import brace_url, image_files

# the recipes of the memory table: (label, --train_parts, --precision, --grad_checkpointing)
MEMORY_RECIPES = (("decoder, fp32", "decoder", "fp32", "none"),
                  ("decoder, bf16, checkpointed", "decoder", "bf16", "decoder"),
                  ("whole VAE, bf16, checkpointed", "all", "bf16", "all"))
# the small VAE of Wan 2.1's structure that the quality part trains (f4, two temporal levels: clips of 1 + 4k)
SMALL_WAN = dict(base_dim=32, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                 latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
MATE_NATURE = "/usr/share/backgrounds/mate/nature"


def wan21_params():
    import wan_ae
    return wan_ae.WanParams(ch=96, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=16,
                            temporal_downsample=(False, True, True), video=True)


def memory_case(recipe: int, frames: list[int], sizes: list[int]) -> dict[str, float]:
    """GiB of each (frames, size) for one recipe of MEMORY_RECIPES, in this process (a fresh one per recipe: the
    allocator keeps what the largest probe took)."""
    import memory
    import run_setup
    import wan_ae
    from objective import VAEObjective
    from train_state import TrainingForward
    label, parts, precision, checkpointing = MEMORY_RECIPES[recipe]
    torch.manual_seed(0)
    vae = wan_ae.WanAutoEncoder(wan21_params())
    model = TrainingForward(vae, frozen_encoder=parts == "decoder")
    cfg = run_setup.parse_config(["--do_ganloss", "--vgg16_weights", "random", "--train_parts", parts])
    precision = Precision.of(precision)
    objective = VAEObjective.from_config(cfg.loss, cfg.latents, cfg.critic, precision, None, True,
                                         torch.device("cpu"), torch.channels_last, 16, encoder_trains=parts == "all")
    out, probes = {}, {}
    for t in frames:
        for size in sizes:
            shape = memory.StepShape(1, size, precision=precision, grad_checkpointing=checkpointing, frames=t)
            need = memory.estimate_step_memory(vae, objective, shape, model=model, probes=probes,
                                               probe_resolutions=(64, 96))
            out[f"{t}x{size}"] = round(need.total / 1024 ** 3, 2)
    return out


def bench_video_memory(args, report: Report) -> dict:
    import subprocess
    from bench.harness import HERE
    frames = [int(t) for t in args.video_memory_frames.split(",")]
    sizes = [int(s) for s in args.video_memory_sizes.split(",")]
    out, rows = {"architecture": wan21_params().to_dict(), "estimates_gib": {}}, []
    for recipe, (label, *_) in enumerate(MEMORY_RECIPES):
        code = f"import json, bench.video as v; print(json.dumps(v.memory_case({recipe}, {frames}, {sizes})))"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE)
        if proc.returncode != 0:
            raise RuntimeError(f"video memory case {label} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        gib = json.loads(proc.stdout.strip().splitlines()[-1])
        for t in frames:
            row = [label, t] + [f"{gib[f'{t}x{s}']:.1f}" for s in sizes]
            rows.append(row)
            out["estimates_gib"].update({f"{label} | {t} frames | {s} px": gib[f"{t}x{s}"] for s in sizes})
            report.line(f"  {label}, {t} frames: " + ", ".join(f"{s} px {g} GiB" for s, g in zip(sizes, row[2:])))
    report.table("Peak memory of one clip per GPU, Wan 2.1's VAE (the memory check's estimate, GiB; LPIPS and the "
                 "VGG16 critic on, EMA on)", ["recipe", "frames"] + [f"{s}x{s}" for s in sizes], rows)
    return out


def clip_shards(photos: list[str], dst: str, frames: int, size: int, per_photo: int, seed: int) -> str:
    paths = shards.write_photo_clips(photos, dst, frames, size, per_photo, 16, seed, shard_size=16)
    return brace_url(paths)


def bench_video_quality(args, tmp, report: Report) -> dict:
    import diffusers
    root = args.video_runs_dir or os.path.join(tmp, "video_quality")
    os.makedirs(root, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}
    frames, size, crop = args.video_frames, 96, 64
    skimage_dir = os.path.join(os.path.dirname(__import__("skimage").__file__), "data")
    demo = [os.path.join(skimage_dir, p) for p in shards.DEMO_PHOTOS
            if p not in shards.DEMO_TEST and os.path.isfile(os.path.join(skimage_dir, p))]
    other = image_files(args.video_photos) if args.video_photos and os.path.isdir(args.video_photos) else []
    if len(other) < 4:  # no second photo collection: the demo's held-out photos are the new domain
        other = [os.path.join(skimage_dir, p) for p in shards.DEMO_TEST]
    held_out, tuning = other[-max(1, len(other) // 4):], other[:-max(1, len(other) // 4)]
    data = os.path.join(root, "data")
    if not os.path.isdir(data):
        release_url = clip_shards(demo, os.path.join(data, "release"), frames, size, 8, 0)
        tune_url = clip_shards(tuning, os.path.join(data, "tune"), frames, size, 8, 1)
        test_url = clip_shards(held_out, os.path.join(data, "test"), frames, size, 4, 2)
        with open(os.path.join(data, "urls.json"), "w") as f:
            json.dump([release_url, tune_url, test_url], f)
    with open(os.path.join(data, "urls.json")) as f:
        release_url, tune_url, test_url = json.load(f)
    init = os.path.join(root, "init")
    if not os.path.isdir(init):
        torch.manual_seed(args.seed)
        diffusers.AutoencoderKLWan(**SMALL_WAN).save_pretrained(init)
    common = ["--video_frames", str(frames), "--vae_resolution", str(crop), "--batch_size", "4",
              "--shuffle_buffer", "64", "--perceptual_weight", "0", "--vgg16_weights", "random",
              "--inception_weights", "none", "--wandb_mode", "disabled", "--mse_pool_factor", "8",
              "--evaluate_every_n_steps", "0", "--num_workers", "1", "--output_dir", root, "--seed", str(args.seed),
              "--warmup_steps", "20", "--log_every_n_steps", "50"]
    wall = {}
    # 1. the release: the small Wan-structured VAE trained on clips of the demo's photos, exported
    steps = args.video_release_steps
    report.line(f"  training the release: {steps} steps on clips of the demo's photos (log in {root})")
    wall.update(wait_logged({"train release": run_logged(
        [sys.executable, "vae_trainer.py", "--init_from", init, "--dataset_url", release_url, "--run_name", "release",
         "--max_steps", str(steps), "--save_every_n_steps", str(steps), "--learning_rate_vae", "1e-3", *common],
        os.path.join(root, "release.log"), env)}))
    released = os.path.join(root, "release_vae")
    if os.path.isdir(released):
        shutil.rmtree(released)
    wall.update(wait_logged({"export release": run_logged(
        [sys.executable, "export.py", "--ckpt", os.path.join(root, "release"), "--ema", "--out", released],
        os.path.join(root, "export.log"), env)}))
    # 2. fine-tunes on the other photos' clips, concurrently (one thread each)
    variants = {"decoder": ["--train_parts", "decoder"],
                "decoder_temporal": ["--train_parts", "decoder", "--temporal_weight", "1"],
                "whole": ["--train_parts", "all"]}
    procs = {}
    for name, extra in variants.items():
        procs[name] = run_logged(
            [sys.executable, "vae_trainer.py", "--init_from", released, "--dataset_url", tune_url, "--run_name", name,
             "--max_steps", str(args.video_finetune_steps), "--save_every_n_steps", str(args.video_finetune_steps),
             "--learning_rate_vae", "2e-4", "--num_threads", "1", *common, *extra],
            os.path.join(root, f"{name}.log"), {**env, "OMP_NUM_THREADS": "1"})
    report.line(f"  fine-tuning {', '.join(procs)} concurrently, {args.video_finetune_steps} steps each ...")
    wall.update(wait_logged({f"train {name}": proc for name, proc in procs.items()}))
    # 3. held-out clips through each
    results, rows = {}, []
    for name, ckpt, ema in [("release", released, False)] + [(n, os.path.join(root, n), True) for n in variants]:
        out_dir = os.path.join(root, "eval", name)
        cmd = [sys.executable, "evaluate.py", "--ckpt", ckpt, "--dataset_url", test_url, "--resolution", str(crop),
               "--video_frames", str(frames), "--vgg16_weights", "none", "--inception_weights", "none",
               "--batch_size", "4", "--out", out_dir] + (["--ema"] if ema else [])
        wall.update(wait_logged({f"evaluate {name}": run_logged(cmd, os.path.join(root, f"eval_{name}.log"), env)}))
        with open(os.path.join(out_dir, "metrics.json")) as f:
            metrics = json.load(f)
        results[name] = {k: metrics[k] for k in ("psnr", "ssim", "temporal_psnr", "n_clips", "n_images")}
        rows.append([name, 0 if name == "release" else args.video_finetune_steps, f"{metrics['psnr']:.2f}",
                     f"{metrics['ssim']:.3f}", f"{metrics['temporal_psnr']:.2f}"])
    report.table(f"Held-out clips ({results['release']['n_clips']} clips of {frames} frames, {crop} px, photos no "
                 f"run trained on), evaluate.py --video_frames {frames} (EMA of the fine-tunes)",
                 ["model", "steps", "PSNR dB", "SSIM", "temporal PSNR dB"], rows)
    base = results["release"]
    gains = {name: {k: results[name][k] - base[k] for k in ("psnr", "ssim", "temporal_psnr")} for name in variants}
    return {"config": {"frames": frames, "crop": crop, "release_steps": args.video_release_steps,
                       "finetune_steps": args.video_finetune_steps, "small_wan": SMALL_WAN,
                       "tuning_photos": [os.path.basename(p) for p in tuning],
                       "held_out_photos": [os.path.basename(p) for p in held_out]},
            "runs": results, "gains_over_release": gains, "wall_s": wall}


def bench_video(args, tmp, report: Report) -> dict:
    out = {}
    if not args.video_skip_memory:
        out["memory"] = bench_video_memory(args, report)
    if not args.video_skip_quality:
        out["quality"] = bench_video_quality(args, tmp, report)
    return out
