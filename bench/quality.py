"""The quality section (issue 9): three real vae_trainer.py trainings of the same small f8 VAE with the GAN (our
defaults, the reference trainer's hyperparameters written with our flags, plain MSE) and their held-out
PSNR/SSIM/LPIPS."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import shards
from bench.harness import HERE, QUALITY_CONFIG, trainer_argv
from bench.report import Report
from bench.runs import final_eval
from weights import vgg16_cache_path


def reference_flags(cfg: dict, steps: int = 400) -> dict:
    """The reference trainer's hyperparameters (cloneofsimo/vqgan-training at HEAD and its launcher.sh),
    written with our flags. Not reproducible with our flags: its conv_in learning rate of 1e-4 (ours is one
    rate for the whole VAE), and its latent penalty is on z itself (here on the posterior mean: with its
    zero noise the same)."""
    latent_elements = cfg["batch_size"] * cfg["vae_z_channels"] * (
        cfg["vae_resolution"] // 2 ** (len(cfg["vae_ch_mult"].split(",")) - 1)) ** 2
    return dict(
        learning_rate_vae=2 ** -7 / cfg["vae_ch"],  # launcher: lr 2^-7, divided by the width in the code
        # 200 in its code; at most half of a shorter run, so that one still reaches the peak rate as at 400 steps
        warmup_steps=min(200, steps // 2), learning_rate_disc=1e-5, disc_start=0, do_attn=False, do_clamp=True,
        vae_norm_groups=32,
        disc_type="bce", gen_loss="nonsaturating",  # --disc_type's default is bce; the launcher keeps it
        perceptual_weight=1.0, mse_weight=0.0,  # at HEAD the pixel loss is multiplied by 0.0
        gan_weight=1.0, lecam_weight=0.0, grad_clip=0.0, ema_decay=0.0,
        # its 0.1 * mean(z^2) added outside GradNorm: per-element gradient 0.2 z / n; ours kl * z / sqrt(n)
        kl_weight=0.2 / latent_elements ** 0.5,
        posterior_var=1e-8)  # no noise at HEAD (its README's "fixed variance of 0.1" is not in the code)


def plain_mse_flags(cfg: dict, steps: int = 400) -> dict:
    """The floor: the reference's hyperparameters and architecture, one plain MSE loss (and its latent
    penalty), no LPIPS, no critic."""
    return {**reference_flags(cfg, steps), "perceptual_weight": 0.0, "do_ganloss": False, "loss_balance": "none",
            "mse_weight": 1.0, "pooled_mse_weight": 1.0, "mse_pool_factor": 1, "lowpass_mse_weight": 0.0,
            "kl_weight": 0.2}  # none: the latent penalty is a mean, 0.2 * 0.5 * mean^2 = 0.1 * mean(z^2)


def bench_quality(args, tmp, report: Report) -> dict:
    """Our defaults vs the reference's hyperparameters vs plain MSE: the same model, photos, seed and steps,
    each a real `vae_trainer.py` run; held-out PSNR/SSIM/LPIPS from the trainer's own final evaluation."""
    train_url, test_url = shards.ensure_demo_shards(os.path.join(tmp, "quality_data"))
    vgg = "torchvision" if os.path.isfile(vgg16_cache_path()) else "random"
    cfg = dict(QUALITY_CONFIG)
    common = dict(cfg, precision=args.quality_precision, dataset_url=train_url, test_dataset_url=test_url,
                  max_steps=args.quality_steps,
                  vgg16_weights=vgg, inception_weights="none", wandb_mode="disabled", num_workers=1,
                  shuffle_buffer=64, log_every_n_steps=50, save_every_n_steps=args.quality_steps,
                  evaluate_every_n_steps=args.quality_steps, eval_max_images=64, seed=args.seed,
                  output_dir=os.path.join(tmp, "quality_runs"))
    variants = {"defaults": {}, "reference": reference_flags(cfg, args.quality_steps),
                "plain_mse": plain_mse_flags(cfg, args.quality_steps)}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}
    out = {"config": {**cfg, "steps": args.quality_steps, "precision": args.quality_precision, "vgg16_weights": vgg,
                      "train_images": len(shards.DEMO_PHOTOS) - len(shards.DEMO_TEST),
                      "held_out_images": list(shards.DEMO_TEST)}, "variants": {}}
    procs = {}
    for name, flags in variants.items():  # concurrently: on a shared machine every run sees the same load
        argv = trainer_argv({**common, **flags, "run_name": f"quality_{name}"})
        log = open(os.path.join(tmp, f"quality_{name}.log"), "w")
        procs[name] = (subprocess.Popen([sys.executable, os.path.join(HERE, "vae_trainer.py"), *argv], env=env,
                                        stdout=log, stderr=subprocess.STDOUT), log, time.time())
    report.line(f"  training {', '.join(variants)} concurrently ({args.quality_steps} steps each; logs in {tmp}) ...")
    for name, (proc, log, t0) in procs.items():
        proc.wait()
        log.close()
        if proc.returncode != 0:
            with open(log.name) as f:
                raise RuntimeError(f"quality run {name} failed:\n{f.read()[-3000:]}")
        ev = final_eval(os.path.join(common["output_dir"], f"quality_{name}"))
        out["variants"][name] = {"flags": variants[name], "wall_s": round(time.time() - t0, 1),
                                 **{k: ev.get(f"eval/{k}") for k in ("psnr", "ssim", "lpips", "n_images")},
                                 **{f"ema_{k}": ev.get(f"eval_ema/{k}") for k in ("psnr", "ssim", "lpips")}}
    v = out["variants"]
    rows = [[name, r["psnr"], r["ssim"], r["lpips"], r["wall_s"]] for name, r in v.items()]
    report.table(f"Held-out quality after {args.quality_steps} steps ({len(shards.DEMO_TEST)} held-out photos, "
                 f"VGG16 {vgg}; ch {cfg['vae_ch']} x {cfg['vae_ch_mult']}, z {cfg['vae_z_channels']}, "
                 f"{cfg['vae_resolution']} px, batch {cfg['batch_size']}, GAN)",
                 ["variant", "PSNR dB", "SSIM", "LPIPS", "wall s"], rows)
    for metric in ("psnr", "ssim"):
        out[f"{metric}_over_reference"] = v["defaults"][metric] - v["reference"][metric]
        out[f"{metric}_over_floor"] = v["defaults"][metric] - v["plain_mse"][metric]
    return out
