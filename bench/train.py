"""The train section: img/s of the real Trainer.train_step() for each speed switch against the reference trainer's
step; with --gan the GAN step's FLOPs, wall clock and saved activations, ours, the reference's way and with the
frozen critic trunk (issue 19)."""
from __future__ import annotations

import gc
import time

import torch

from bench.harness import (TRAIN_CONFIGS, add_reference_habits, build_trainer, interleave_steps, timed_step,
                           train_step_flops)
from bench.machine import mib
from bench.report import Report, median


def bench_train(args, url, tmp, device, report: Report) -> dict:
    config = dict(TRAIN_CONFIGS[args.config])
    if args.gan:
        config["do_ganloss"] = True
    batch = config["batch_size"]
    # one trainer per layout / precision / compile setting; the two NCHW variants share one (host syncs on, off)
    settings = {"nchw": dict(channels_last=False), "channels_last": dict(channels_last=True),
                "bf16": dict(channels_last=True, precision="bf16")}
    if not args.no_compile:
        settings["compiled"] = dict(channels_last=True, compile=True)
    if args.gan:  # issue 19: the same step with the critic's trunk frozen and shared with LPIPS
        settings["frozen"] = dict(channels_last=False, critic_trunk="frozen")
    if args.gan and args.gan_flops_only:
        return gan_flops_only(url, tmp, device, config, report)
    trainers, warmup_s = {}, {}
    for key, extra in settings.items():
        report.line(f"  building and warming up the {key} trainer ...")
        trainer = build_trainer(url, tmp, f"train_{key}", device, **config, **extra)
        add_reference_habits(trainer)
        t0 = time.perf_counter()
        for _ in range(3 if key == "compiled" else 2):  # compile: forward, backward, then steady state
            timed_step(trainer)
        warmup_s[key] = time.perf_counter() - t0
        trainers[key] = trainer
    variants = {"reference": (trainers["nchw"], True), "sync_free": (trainers["nchw"], False),
                "channels_last": (trainers["channels_last"], False)}
    if "compiled" in trainers:
        variants["compile"] = (trainers["compiled"], False)
    variants["bf16"] = (trainers["bf16"], False)
    if "frozen" in trainers:
        variants["frozen_trunk"] = (trainers["frozen"], False)
    times = interleave_steps(variants, args.train_rounds, args.steps_per_round)
    if args.gan:
        flops = gan_step_flops(trainers["nchw"])
        flops["frozen_trainer"] = train_step_flops(trainers["frozen"])
        report.line(f"  GFLOP per step (FlopCounterMode): ours {flops['ours'] / 1e9:.1f}, the reference's way "
                    f"{flops['reference'] / 1e9:.1f} ({flops['reference'] / flops['ours']:.3f}x); critic "
                    f"{flops['ours_critic'] / 1e9:.1f} / {flops['reference_critic'] / 1e9:.1f}, LPIPS "
                    f"{flops['ours_lpips'] / 1e9:.1f}, VAE {flops['ours_vae'] / 1e9:.1f}")
        report.line(f"  frozen trunk (issue 19), the trainer's own step (--critic_trunk frozen): "
                    f"{flops['frozen_trainer'] / 1e9:.1f} GFLOP ({flops['reference'] / flops['frozen_trainer']:.3f}x "
                    f"the reference's way); composed from its parts {flops['frozen'] / 1e9:.1f}: trunk forwards "
                    f"{flops['frozen_trunk_forward'] / 1e9:.1f}, LPIPS heads {flops['frozen_lpips_heads'] / 1e9:.2f}, "
                    f"critic heads' step {flops['frozen_critic_heads_step'] / 1e9:.1f}, generator term + both "
                    f"branches' backward {flops['frozen_generator_and_backward'] / 1e9:.1f}, VAE "
                    f"{flops['ours_vae'] / 1e9:.1f}")
        gan_wall = gan_part_wall_clock(config["vae_resolution"], batch)
        report.line("  the GAN + LPIPS part alone, one thread, 3 interleaved rounds (s): " + ", ".join(
            f"{name} {median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for name, t in gan_wall.items()))
        gan_memory = {size: gan_saved_activations(size) for size in (256, 512)}
        for size, saved in gan_memory.items():
            report.line(f"  GAN + LPIPS activations saved for backward, {size} px, batch 1 (MiB): VAE side ours "
                        f"{saved['ours_vae_side']:.0f}, frozen {saved['frozen_vae_side']:.0f}; critic's step ours "
                        f"{saved['ours_critic_step']:.0f}, frozen {saved['frozen_critic_step']:.0f}")
    del trainers, variants
    gc.collect()

    rate = {name: batch / median(t) for name, t in times.items()}
    all_on = "compile" if "compile" in rate else "channels_last"
    described = {
        "reference": "host syncs, NCHW, eager, fp32" + (", critic weight grads in the generator's pass"
                                                           if args.gan else ""),
        "sync_free": "no host syncs, NCHW, eager, fp32",
        "channels_last": "no host syncs, channels_last, eager, fp32",
        "compile": "no host syncs, channels_last, torch.compile, fp32",
        "bf16": "no host syncs, channels_last, eager, bf16 autocast",
        "frozen_trunk": "no host syncs, NCHW, eager, fp32, --critic_trunk frozen",
    }
    rows = [[name, described[name], rate[name], f"{rate[name] / rate['reference']:.2f}x", median(t),
             f"{min(t):.2f}-{max(t):.2f}"] for name, t in times.items()]
    report.table(f"Training step ({args.config}: ch {config['vae_ch']} x {config['vae_ch_mult']}, "
                 f"{config['vae_resolution']} px, batch {batch}, LPIPS{' + GAN' if args.gan else ''}; "
                 f"{args.train_rounds} rounds x {args.steps_per_round} steps)",
                 ["variant", "settings", "img/s", "x reference", "median s/step", "range s"], rows)
    report.line("  warm-up (s): " + ", ".join(f"{k} {v:.1f}" for k, v in warmup_s.items()))
    return {
        "config": {"name": args.config, **config, "lpips": True},
        "rounds": args.train_rounds, "steps_per_round": args.steps_per_round,
        "variants": {name: {"settings": described[name], "img_per_s": rate[name], "median_step_s": median(t),
                            "step_s": [round(v, 4) for v in t]} for name, t in times.items()},
        "warmup_s": warmup_s,
        "all_switches_on": all_on,
        "speedup_all_on": rate[all_on] / rate["reference"],
        "speedup_sync_free": rate["sync_free"] / rate["reference"],
        "speedup_channels_last": rate["channels_last"] / rate["sync_free"],
        "speedup_compile": rate["compile"] / rate["channels_last"] if "compile" in rate else None,
        "bf16_speedup": rate["bf16"] / rate["channels_last"],
        "frozen_trunk_speedup": rate["frozen_trunk"] / rate["reference"] if "frozen_trunk" in rate else None,
        "gan_step_flops": flops if args.gan else None,
        "gan_saved_mib": gan_memory if args.gan else None,
        "gan_part_wall_s": gan_wall if args.gan else None,
    }


def gan_flops_only(url, tmp, device, config: dict, report: Report) -> dict:
    """--gan_flops_only: the GAN step's FLOPs ours / the reference's way (one trainable-critic trainer) and the
    trainer's own step with --critic_trunk frozen, without warm-up or timed rounds."""
    # NCHW as the timed variants' FLOP counts (FLOPs do not depend on the layout; and FlopCounterMode's module
    # tracker cannot follow the frozen trunk's autograd.grad on a channels_last leaf)
    trainer = build_trainer(url, tmp, "flops_trainable", device, **config, channels_last=False)
    add_reference_habits(trainer)
    flops = gan_step_flops(trainer)
    del trainer
    frozen = build_trainer(url, tmp, "flops_frozen", device, **config, critic_trunk="frozen", channels_last=False)
    flops["frozen_trainer"] = train_step_flops(frozen)
    report.line(f"  GFLOP per step: the reference's way {flops['reference'] / 1e9:.1f}, ours {flops['ours'] / 1e9:.1f} "
                f"(critic {flops['ours_critic'] / 1e9:.1f}, LPIPS {flops['ours_lpips'] / 1e9:.1f}, VAE "
                f"{flops['ours_vae'] / 1e9:.1f}), --critic_trunk frozen {flops['frozen_trainer'] / 1e9:.1f} "
                f"({flops['reference'] / flops['frozen_trainer']:.3f}x the reference's way; composed from its parts "
                f"{flops['frozen'] / 1e9:.1f})")
    return {"config": {"name": "flops_only", **config}, "gan_step_flops": flops}


def gan_saved_activations(size: int, batch: int = 1) -> dict[str, float]:
    """MiB saved for backward by the GAN and LPIPS part of one step at `size` px (the VAE's own activations
    are the same either way and left out), trainable critic (ours) vs frozen trunk (issue 19), random weights:
    the VAE-side graph (live until the VAE's backward: LPIPS and the generator term on the reconstruction)
    and the critic's own step (its graph is freed before the VAE's forward). Saved-tensor hooks, unique
    storages, parameters excluded: exact, free of timing noise and of the allocator."""
    from critics import FeatureCriticHeads, VGG16Discriminator, build_lpips, lpips_from_features, vgg16_features
    from utils import discriminator_loss, generator_loss
    lpips_model, critic, heads = build_lpips(None), VGG16Discriminator(None), FeatureCriticHeads()
    params = {t.untyped_storage().data_ptr() for m in (lpips_model, critic, heads)
              for t in list(m.parameters()) + list(m.buffers())}

    def saved_mib(run) -> float:
        seen: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
        return mib(sum(seen.values()))

    x = torch.rand(batch, 3, size, size) * 2 - 1
    recon = (torch.rand(batch, 3, size, size) * 2 - 1).requires_grad_(True)

    def ours_vae_side():
        critic.requires_grad_(False)
        lpips_model(recon, x).mean() + critic(recon).mean()
        critic.requires_grad_(True)

    def ours_critic_step():
        discriminator_loss(*critic(torch.cat([x, recon.detach()])).chunk(2), "hinge")

    with torch.no_grad():
        x_feats = vgg16_features(lpips_model, x)

    def frozen_vae_side():
        heads.requires_grad_(False)
        feats = vgg16_features(lpips_model, recon)
        lpips_from_features(lpips_model, feats, x_feats).mean() + generator_loss(heads(feats), None, "ldm")
        heads.requires_grad_(True)

    def frozen_critic_step():
        with torch.no_grad():
            fake_feats = vgg16_features(lpips_model, recon)
        discriminator_loss(*heads([torch.cat([a, b]) for a, b in zip(x_feats, fake_feats)]).chunk(2), "hinge")

    return {"ours_vae_side": saved_mib(ours_vae_side), "ours_critic_step": saved_mib(ours_critic_step),
            "frozen_vae_side": saved_mib(frozen_vae_side), "frozen_critic_step": saved_mib(frozen_critic_step)}


def gan_part_wall_clock(size: int, batch: int, rounds: int = 3) -> dict[str, list[float]]:
    """Seconds of the GAN and LPIPS part of one step (the VAE's part is the same in all three and left out),
    interleaved in rotated order each round so load bursts hit all alike: the reference's way (LPIPS on both
    images, the trainable critic's step, the generator's pass with the critic's weight gradients), ours
    (the same, the critic frozen in the generator's pass), and the frozen trunk (issue 19: one trunk pass per
    image, the heads' step, both GradNorm branches' backward through the trunk). Random weights."""
    from critics import FeatureCriticHeads, VGG16Discriminator, build_lpips, lpips_from_features, vgg16_features
    from utils import discriminator_loss, generator_loss
    lpips_model, critic, heads = build_lpips(None), VGG16Discriminator(None), FeatureCriticHeads()
    for head in list(critic.heads) + list(heads.heads):  # past the neutral start: every patch pushes
        torch.nn.init.normal_(head[-1].weight, std=0.01)
    x = torch.rand(batch, 3, size, size) * 2 - 1
    recon = (torch.rand(batch, 3, size, size) * 2 - 1).requires_grad_(True)

    def trainable(reference: bool):
        def step():
            logits = critic(torch.cat([x, recon.detach()]))
            real_logits, fake_logits = logits.float().chunk(2)
            discriminator_loss(real_logits, fake_logits, "hinge").backward()
            critic.requires_grad_(reference)
            perceptual = lpips_model(recon, x).mean()
            g_loss = generator_loss(critic(recon), real_logits.detach(), "thresholded")
            torch.autograd.grad(perceptual, recon, retain_graph=True)  # GradNorm's two branches
            torch.autograd.grad(g_loss, recon)
            critic.requires_grad_(True)
            critic.zero_grad(set_to_none=True)
        return step

    def frozen():
        with torch.no_grad():
            x_feats = vgg16_features(lpips_model, x)
        recon_feats = vgg16_features(lpips_model, recon)
        perceptual = lpips_from_features(lpips_model, recon_feats, x_feats).mean()
        logits = heads([torch.cat([a, b.detach()]) for a, b in zip(x_feats, recon_feats)])
        real_logits, fake_logits = logits.float().chunk(2)
        discriminator_loss(real_logits, fake_logits, "hinge").backward()
        heads.requires_grad_(False)
        g_loss = generator_loss(heads(recon_feats), real_logits.detach(), "thresholded")
        torch.autograd.grad(perceptual, recon, retain_graph=True)
        torch.autograd.grad(g_loss, recon)
        heads.requires_grad_(True)
        heads.zero_grad(set_to_none=True)

    variants = {"reference": trainable(True), "ours": trainable(False), "frozen": frozen}
    times = {name: [] for name in variants}
    names = list(variants)
    for name in names:  # warm-up
        variants[name]()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def gan_step_flops(trainer) -> dict[str, float]:
    """FLOPs of one GAN step our way and the reference's way (the critic's weight gradients also computed in
    the generator's pass), in total and per network: what the step costs wherever FLOPs set its time,
    whatever the load of the machine."""
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for name, reference in (("ours", False), ("reference", True)):
        trainer.metrics.host_sync = reference
        with FlopCounterMode(display=False) as counter:
            trainer.train_step()
        per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        out[name] = float(counter.get_total_flops())
        objective = type(trainer.objective).__name__  # its own modules are counted under its name
        out[f"{name}_critic"] = float(per_module.get(type(trainer.adversary.critic).__name__, 0)  # its own pass
                                      + per_module.get(f"{objective}.critic", 0))   # the generator's pass
        out[f"{name}_lpips"] = float(per_module.get(f"{objective}.lpips", 0))
        out[f"{name}_vae"] = out[name] - out[f"{name}_critic"] - out[f"{name}_lpips"]
    trainer.metrics.host_sync = False
    out.update(frozen_gan_step_flops(trainer, out["ours_vae"]))
    return out


def frozen_gan_step_flops(trainer, vae_flops: float) -> dict[str, float]:
    """FLOPs of one GAN step with the frozen trunk (issue 19), composed of the trainer's own VAE part
    (`vae_flops`: gan_step_flops' `ours_vae`, encoder, decoder, pixel losses) and a count of the frozen
    critic's step on images of the trainer's batch shape: LPIPS' VGG16 once for the input (no grad) and
    once for the reconstruction (with grad), LPIPS from those features, the heads' own step on the detached
    features (real and fake, hinge, backward into the heads), the generator term from the heads on the
    reconstruction's features. GradNorm normalises each branch at the reconstruction, which needs each
    branch's gradient there: two backward passes through the trunk (input gradients only, its weights are
    frozen), one for LPIPS and one for the generator term."""
    from torch.utils.flop_counter import FlopCounterMode
    from critics import FeatureCriticHeads, lpips_from_features, vgg16_features
    from utils import discriminator_loss, generator_loss
    cfg = trainer.cfg
    lpips_model = trainer.objective.lpips
    device = trainer.device
    size, batch = cfg.data.vae_resolution, cfg.data.batch_size
    heads = FeatureCriticHeads().to(device)
    x = torch.rand(batch, 3, size, size, device=device) * 2 - 1
    recon = (torch.rand(batch, 3, size, size, device=device) * 2 - 1).requires_grad_(True)
    counts = {}
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            x_feats = vgg16_features(lpips_model, x)
        recon_feats = vgg16_features(lpips_model, recon)
    counts["trunk_forward"] = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        perceptual = lpips_from_features(lpips_model, recon_feats, x_feats).float().mean()
    counts["lpips_heads"] = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:  # the critic's step: heads only, on detached features
        logits = heads([torch.cat([r, f.detach()]) for r, f in zip(x_feats, recon_feats)])
        real_logits, fake_logits = logits.float().chunk(2)
        discriminator_loss(real_logits, fake_logits, "hinge").backward()
    counts["critic_heads_step"] = counter.get_total_flops()
    heads.requires_grad_(False)
    with FlopCounterMode(display=False) as counter:  # the generator term, and each branch's gradient
        g_loss = generator_loss(heads(recon_feats).float(), real_logits.detach(), "thresholded")
        torch.autograd.grad(perceptual, recon, retain_graph=True)
        torch.autograd.grad(g_loss, recon)
    counts["generator_and_backward"] = counter.get_total_flops()
    frozen = float(sum(counts.values()))
    return {"frozen": vae_flops + frozen, "frozen_critic_and_lpips": frozen,
            **{f"frozen_{k}": float(v) for k, v in counts.items()}}
