"""The latents section (issue 20): what each latent feature costs per step on the demo's model (FLOPs and
interleaved wall clock), and one in-loop probe call."""
from __future__ import annotations

import contextlib
import io

import config as config_lib
from bench.harness import add_reference_habits, build_trainer, interleave_steps, timed_step, train_step_flops
from bench.report import Report, median


LATENTS_CONFIG = dict(vae_ch=32, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4, vae_norm_groups=8,
                      do_attn=False, vae_resolution=64, batch_size=4, mse_pool_factor=1)  # the demo's model
LATENT_FEATURES = {
    "base": ("nothing", {}),
    "equivariance": ("--scale_equivariance_prob 0.5", dict(scale_equivariance_prob=0.5)),
    "latent_noise": ("--latent_noise_prob 0.5", dict(latent_noise_prob=0.5)),
    "vf_vits14_112": ("--vf_weight 0.5, DINOv2 ViT-S/14 at 112 px",
                      dict(vf_weight=0.5, vf_model="dinov2_vits14", vf_weights="random", vf_image_size=112)),
    "vf_vitl14_224": ("--vf_weight 0.5, DINOv2 ViT-L/14 at 224 px (VA-VAE's)",
                      dict(vf_weight=0.5, vf_model="dinov2_vitl14", vf_weights="random", vf_image_size=224)),
}


def bench_latents(args, url, tmp, device, report: Report) -> dict:
    import probe as probe_lib
    trainers, flops = {}, {}
    for name, (_, flags) in LATENT_FEATURES.items():
        report.line(f"  building and warming up the {name} trainer ...")
        with contextlib.redirect_stderr(io.StringIO()):  # the random-weights banners
            trainers[name] = build_trainer(url, tmp, f"latents_{name}", device, **LATENTS_CONFIG, **flags)
        add_reference_habits(trainers[name])
        for _ in range(2):
            timed_step(trainers[name])
        flops[name] = train_step_flops(trainers[name])
    times = interleave_steps({name: (t, False) for name, t in trainers.items()}, args.train_rounds,
                             max(args.steps_per_round, 5))
    base = median(times["base"])
    rows = [[name, LATENT_FEATURES[name][0], flops[name] / 1e9, f"{flops[name] / flops['base']:.2f}x",
             median(t) * 1e3, f"{median(t) / base:.2f}x"] for name, t in times.items()]
    report.table(f"Latent features (issue 20): the demo's model, batch {LATENTS_CONFIG['batch_size']}, "
                 f"{LATENTS_CONFIG['vae_resolution']} px, LPIPS on, fp32; {args.train_rounds} rounds x "
                 f"{max(args.steps_per_round, 5)} steps",
                 ["feature", "flags", "GFLOP/step", "x base", "median ms/step", "x base (wall)"], rows)
    cfg = trainers["base"].cfg
    probe_images = min(cfg.latents.probe_images, args.images)
    cfg = config_lib.with_values(cfg, probe_images=probe_images,
                                 probe_heldout=min(cfg.latents.probe_heldout, probe_images // 4))
    in_loop = probe_lib.InLoopProbe(cfg.latents, cfg.data, cfg.optim.seed, device)
    trainer = trainers["base"]
    calls = [in_loop(trainer.vae, trainer.training.ema)[1] for _ in range(2)]
    per_call = min(calls)
    latents = cfg.latents
    report.line(f"  one in-loop probe call (--probe_steps {latents.probe_steps}, --probe_batch_size "
                f"{latents.probe_batch_size}, {latents.probe_images} images, {latents.probe_heldout} held out): "
                f"{per_call:.1f} s "
                f"(calls {', '.join(f'{c:.1f}' for c in calls)}); at --probe_every_n_steps 1000 that is "
                f"{per_call / 1000 * 1e3:.1f} ms per step, {per_call / 1000 / base:.1%} of the base step")
    for t in trainers.values():
        t.close()
    return {"config": LATENTS_CONFIG, "rounds": args.train_rounds,
            "features": {name: {"flags": LATENT_FEATURES[name][0], "gflop_per_step": flops[name] / 1e9,
                                "flop_ratio": flops[name] / flops["base"], "median_step_s": median(t),
                                "wall_ratio": median(t) / base, "step_s": [round(v, 4) for v in t]}
                         for name, t in times.items()},
            "probe_call_s": calls, "probe": {"steps": latents.probe_steps, "batch_size": latents.probe_batch_size,
                                             "images": latents.probe_images, "heldout": latents.probe_heldout}}
