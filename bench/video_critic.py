"""The video critic section (issue 42): the frame critic with the temporal term against the spatio-temporal critic.

Every run a real command. The small VAE of Wan 2.1's structure (bench.video.SMALL_WAN, from diffusers'
initialisation) trains on moving-camera clips of the demo's training photos, for each critic of --critic_variants
and each seed of --critic_seeds, concurrently on one thread each: `patchgan` (the frame critic: --discriminator
patchgan judging the clips' frames one by one) + --temporal_weight 1; `patchgan3d` (--discriminator patchgan3d
judging whole clips) + --temporal_weight 1; `none` (no critic, the temporal term alone). Pixel losses only (no
pretrained VGG16 here, so no LPIPS term); the GAN from --critic_disc_start. evaluate.py --video_frames then reports
per-frame PSNR, temporal PSNR and tLP (on a random VGG16: a feature distance, not LPIPS) on held-out clips of the
demo's test photos, which no run trained on.

The critic's cost: one micro-batch of the same model and clips through objective.micro_step in this process (one
thread), timed per phase (micro_step's `phase`): the critic's own step ("critic") against the whole micro-batch,
the generator's pass through the critic included in "loss".
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

import torch

import shards
from bench.report import Report
from bench.runs import run_logged, wait_logged
from bench.video import SMALL_WAN, clip_shards

CRITICS = {"patchgan": ["--do_ganloss", "--discriminator", "patchgan", "--temporal_weight", "1"],
           "patchgan3d": ["--do_ganloss", "--discriminator", "patchgan3d", "--temporal_weight", "1"],
           "none": ["--temporal_weight", "1"]}
METRICS = ("psnr", "temporal_psnr", "tlp")


def critic_step_cost(init: str, frames: int, crop: int, batch: int, rounds: int = 5) -> dict:
    """Seconds of one training micro-batch (forward, the critic's step, the VAE's loss and backward) per critic
    kind, and of its phases, the median of `rounds` after one warm-up, in this process."""
    import families
    import run_setup
    from objective import VAEObjective, micro_step
    from train_state import TrainingForward
    torch.set_num_threads(1)
    out = {}
    for kind, flags in CRITICS.items():
        torch.manual_seed(0)
        source = families.load_source(init, video=True)
        vae = families.build_model(source.params)
        vae.load_state_dict(source.state)
        model = TrainingForward(vae)
        cfg = run_setup.parse_config(["--perceptual_weight", "0", "--vgg16_weights", "random", "--disc_start", "0",
                                      "--mse_pool_factor", "8", "--video_frames", str(frames), *flags])
        objective = VAEObjective.from_config(cfg.loss, cfg.latents, cfg.critic, with_lpips=False,
                                             z_channels=SMALL_WAN["z_dim"])
        if objective.adversary is not None:
            objective.adversary.prepare_training(cfg.optim, lambda p, lr: torch.optim.AdamW(p, lr))
        x = torch.rand(batch, 3, frames, crop, crop, generator=torch.Generator().manual_seed(0)) * 2 - 1
        phases: dict[str, list[float]] = {}

        @contextlib.contextmanager
        def phase(name):
            begin = time.perf_counter()
            yield
            phases.setdefault(name, []).append(time.perf_counter() - begin)

        class NoRegularisers:
            def draw(self, x, step, micro):
                return x, None

            def draw_added(self, x, step, micro):
                return None
        totals = []
        for _ in range(rounds + 1):
            begin = time.perf_counter()
            micro_step(objective, model, x, 1, 0, 1, True, NoRegularisers(), torch.ones(()),
                       None, phase=phase)
            totals.append(time.perf_counter() - begin)
        out[kind] = {"step_s": statistics.median(totals[1:]),
                     **{f"{name}_s": statistics.median(times[1:]) for name, times in phases.items()}}
    return out


def bench_video_critic(args, tmp, report: Report) -> dict:
    import diffusers
    root = args.critic_runs_dir or os.path.join(tmp, "video_critic")
    os.makedirs(root, exist_ok=True)
    frames, size, crop, steps = args.video_frames, 96, 64, args.critic_steps
    skimage_dir = os.path.join(os.path.dirname(__import__("skimage").__file__), "data")
    train = [os.path.join(skimage_dir, p) for p in shards.DEMO_PHOTOS
             if p not in shards.DEMO_TEST and os.path.isfile(os.path.join(skimage_dir, p))]
    held_out = [os.path.join(skimage_dir, p) for p in shards.DEMO_TEST]
    data = os.path.join(root, "data")
    if not os.path.isdir(data):
        train_url = clip_shards(train, os.path.join(data, "train"), frames, size, 8, 0)
        test_url = clip_shards(held_out, os.path.join(data, "test"), frames, size, 4, 2)
        with open(os.path.join(data, "urls.json"), "w") as f:
            json.dump([train_url, test_url], f)
    with open(os.path.join(data, "urls.json")) as f:
        train_url, test_url = json.load(f)
    init = os.path.join(root, "init")
    if not os.path.isdir(init):
        torch.manual_seed(0)
        diffusers.AutoencoderKLWan(**SMALL_WAN).save_pretrained(init)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    variants = [v for v in args.critic_variants.split(",") if v]
    seeds = [int(s) for s in args.critic_seeds.split(",")]
    procs, wall = {}, {}
    for seed in seeds:
        for name in variants:
            run = f"{name}_s{seed}"
            if os.path.isfile(os.path.join(root, run, "checkpoints", f"step_{steps:08d}.pt")):
                continue  # finished in an earlier call with this --critic_runs_dir
            procs[run] = run_logged(
                [sys.executable, "vae_trainer.py", "--init_from", init, "--dataset_url", train_url, "--run_name", run,
                 "--video_frames", str(frames), "--vae_resolution", str(crop), "--batch_size", str(args.critic_batch),
                 "--shuffle_buffer", "64", "--perceptual_weight", "0", "--vgg16_weights", "random",
                 "--inception_weights", "none", "--wandb_mode", "disabled", "--mse_pool_factor", "8",
                 "--evaluate_every_n_steps", "0", "--num_workers", "1", "--num_threads", "1", "--output_dir", root,
                 "--seed", str(seed), "--warmup_steps", "20", "--log_every_n_steps", "25", "--max_steps", str(steps),
                 "--save_every_n_steps", str(steps), "--learning_rate_vae", "1e-3",
                 "--disc_start", str(args.critic_disc_start), *CRITICS[name]],
                os.path.join(root, f"{run}.log"), env)
    report.line(f"  training {', '.join(procs) or 'nothing (all runs finished)'} concurrently, {steps} steps each ...")
    wall.update(wait_logged({f"train {run}": proc for run, proc in procs.items()}))
    results, rows = {}, []
    for seed in seeds:
        for name in variants:
            run = f"{name}_s{seed}"
            out_dir = os.path.join(root, "eval", run)
            if not os.path.isfile(os.path.join(out_dir, "metrics.json")):
                cmd = [sys.executable, "evaluate.py", "--ckpt", os.path.join(root, run), "--ema", "--dataset_url",
                       test_url, "--resolution", str(crop), "--video_frames", str(frames), "--vgg16_weights",
                       "random", "--inception_weights", "none", "--batch_size", "4", "--out", out_dir]
                wall.update(wait_logged({f"evaluate {run}": run_logged(cmd, os.path.join(root, f"eval_{run}.log"),
                                                                       env)}))
            with open(os.path.join(out_dir, "metrics.json")) as f:
                metrics = json.load(f)
            results[run] = {k: metrics[k] for k in (*METRICS, "n_clips")}
            rows.append([name, seed] + [f"{metrics[k]:.4f}" if k == "tlp" else f"{metrics[k]:.2f}" for k in METRICS])
    means = {name: {k: statistics.mean(results[f"{name}_s{s}"][k] for s in seeds) for k in METRICS}
             for name in variants}
    rows += [[name, "mean"] + [f"{m[k]:.4f}" if k == "tlp" else f"{m[k]:.2f}" for k in METRICS]
             for name, m in means.items()]
    report.table(f"Held-out clips ({results[rows[0][0] + '_s' + str(seeds[0])]['n_clips']} clips of {frames} frames, "
                 f"{crop} px), evaluate.py --video_frames {frames} --ema after {steps} steps",
                 ["critic", "seed", "PSNR dB", "temporal PSNR dB", "tLP (random VGG16)"], rows)
    report.line("  timing one micro-batch per critic (one thread) ...")
    cost = critic_step_cost(init, frames, crop, args.critic_batch)
    report.table(f"One micro-batch ({args.critic_batch} clips of {frames} frames, {crop} px), seconds, one thread",
                 ["critic", "whole micro-batch", "critic's step", "VAE loss + backward (generator's pass)"],
                 [[k, f"{c['step_s']:.3f}", f"{c.get('critic_s', 0):.3f}", f"{c.get('loss_s', 0):.3f}"]
                  for k, c in cost.items()])
    return {"config": {"frames": frames, "crop": crop, "steps": steps, "batch": args.critic_batch,
                       "disc_start": args.critic_disc_start, "small_wan": SMALL_WAN, "seeds": seeds,
                       "held_out_photos": [os.path.basename(p) for p in held_out]},
            "runs": results, "means": means, "step_cost_s": cost, "wall_s": wall}
