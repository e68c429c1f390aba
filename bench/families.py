"""The families section (issue 39): the VAEs of the diffusers family at their size, and the two paths of Wan's VAE.

memory: the memory check's own estimate (memory.estimate_step_memory: probes of one clip of the run's length through
the trainer's dataflow at 64 and 96 px, extrapolated in pixels) per GPU, one clip per GPU, for LTX-2's and
HunyuanVideo 1.5's VAE at diffusers' default configs (1.22B and 1.26B parameters; random weights: the figure depends
on the shapes only), LPIPS and the VGG16 critic on, EMA on: a decoder-only fine-tune (the decoder checkpointed) and a
full one (everything checkpointed), at the clip lengths of --families_frames and the sizes of --families_sizes. The
probes run in fp32: on this CPU a bf16 convolution of these models is a reference kernel (a 64 px 9-frame LTX-2 forward:
8 s in fp32, 632 s in bf16). The bf16 rows scale the fp32 estimate's activations by the bf16/fp32 ratio the check
measures, in both precisions, on a narrow model of the same class and structure (the weights, gradients, AdamW moments
and EMA stay fp32, as the trainer keeps them). Each model in a fresh process.

paths: Wan 2.1's VAE (the structure of bench/video.py's small one: base 32, z 8, f4, two temporal levels) trained on
the same clips through both families that can run it: wan_ae.py's video model (native) and diffusers' own
AutoencoderKLWan (--vae_family diffusers): the time of a training forward and backward (interleaved, median of
--families_steps each), and the bytes the forward saves for backward (saved-tensor hooks, as the memory check counts
them), at 64 px and 9 frames, fp32, and with the decoder checkpointed (the native path only: diffusers' Wan has none).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time

import torch

from bench.report import Report
from config import Precision

MODELS = ("AutoencoderKLLTX2Video", "AutoencoderKLHunyuanVideo15")
RECIPES = (("decoder only", "decoder", "decoder"), ("whole VAE", "all", "all"))  # (label, train_parts, checkpointing)
# the narrow model of each class whose bf16/fp32 ratio scales the big one's activations: its own structure, widths cut
NARROW = {"AutoencoderKLLTX2Video": dict(block_out_channels=(16, 32, 64, 128), decoder_block_out_channels=(32, 64, 128)),
          "AutoencoderKLHunyuanVideo15": dict(block_out_channels=(16, 32, 64, 128, 128))}


def _objective(parts: str, precision: str, z: int):
    import run_setup
    from objective import VAEObjective
    cfg = run_setup.parse_config(["--do_ganloss", "--vgg16_weights", "random", "--train_parts", parts])
    return VAEObjective.from_config(cfg.loss, cfg.latents, cfg.critic, Precision.of(precision), None, True,
                                    torch.device("cpu"),
                                    torch.channels_last, z, encoder_trains=parts == "all")


def _vae(class_name: str, **overrides):
    import diffusers_ae
    with torch.device("meta"):
        config = {**dict(diffusers_ae.diffusers_class(class_name)().config), **overrides}
    torch.manual_seed(0)
    return diffusers_ae.DiffusersAutoEncoder(diffusers_ae.DiffusersParams.of(class_name, config))


def memory_case(class_name: str, frames: list[int], sizes: list[int]) -> dict:
    """GiB per (recipe, precision, frames, size) of one model, in this process; and its parameter count."""
    import memory
    from train_state import TrainingForward
    out = {"params": None, "gib": {}}
    for label, parts, checkpointing in RECIPES:
        vae = _vae(class_name)
        out["params"] = sum(p.numel() for p in vae.parameters())
        narrow = _vae(class_name, **NARROW[class_name])
        for t in frames:
            ratio = []
            for precision in ("fp32", "bf16"):  # the narrow model's saved bytes in each precision, at 64 px
                model = TrainingForward(narrow, frozen_encoder=parts == "decoder")
                shape = memory.StepShape(1, 64, precision=Precision.of(precision), grad_checkpointing=checkpointing,
                                         frames=t)
                ratio.append(memory.probe_activation_bytes(narrow, _objective(parts, precision, narrow.params.z_channels),
                                                           shape, 1, 64, model=model)[0])
            model = TrainingForward(vae, frozen_encoder=parts == "decoder")
            objective, probes = _objective(parts, "fp32", vae.params.z_channels), {}
            for size in sizes:
                shape = memory.StepShape(1, size, precision=Precision.of("fp32"), grad_checkpointing=checkpointing,
                                         frames=t)
                need = memory.estimate_step_memory(vae, objective, shape, model=model, probes=probes,
                                                   probe_resolutions=(64, 96))
                bf16 = need.total - need.activations + need.activations * ratio[1] / ratio[0]
                out["gib"][f"{label}|fp32|{t}|{size}"] = round(need.total / 1024 ** 3, 1)
                out["gib"][f"{label}|bf16|{t}|{size}"] = round(bf16 / 1024 ** 3, 1)
        del vae, narrow
    return out


def bench_families_memory(args, report: Report) -> dict:
    from bench.harness import HERE
    frames = [int(t) for t in args.families_frames.split(",")]
    sizes = [int(s) for s in args.families_sizes.split(",")]
    out, rows = {}, []
    for class_name in MODELS:
        code = (f"import json, bench.families as f; print(json.dumps(f.memory_case({class_name!r}, {frames}, "
                f"{sizes})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE)
        if proc.returncode != 0:
            raise RuntimeError(f"families memory case {class_name} failed (exit {proc.returncode}): "
                               f"{proc.stderr[-2000:]}")
        case = json.loads(proc.stdout.strip().splitlines()[-1])
        out[class_name] = case
        for label, *_ in RECIPES:
            for precision in ("bf16", "fp32"):
                for t in frames:
                    gib = [case["gib"][f"{label}|{precision}|{t}|{s}"] for s in sizes]
                    rows.append([f"{class_name} ({case['params'] / 1e9:.2f}B)", label, precision, t] + gib)
                    report.line(f"  {class_name} {label} {precision} {t} frames: " +
                                ", ".join(f"{s} px {g} GiB" for s, g in zip(sizes, gib)))
    report.table("Per-GPU memory of one clip, the memory check's estimate (GiB; LPIPS and the VGG16 critic on, EMA "
                 "on; decoder only: the decoder checkpointed; whole VAE: everything checkpointed)",
                 ["model", "recipe", "precision", "frames"] + [f"{s}x{s}" for s in sizes], rows)
    return out


def _saved_bytes(vae, x) -> int:
    """Bytes the training forward (encode, sample, decode, an MSE) saves for backward, as the memory check counts."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in vae.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recon, mean, logvar = vae(x)
        (recon - x).square().mean()
    return sum(seen.values())


def bench_families_paths(args, report: Report) -> dict:
    """The native and the diffusers path of one Wan VAE on the same clips (module docstring)."""
    import tempfile

    import diffusers
    import families
    from bench.video import SMALL_WAN
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stderr(report.stream):
        diffusers.AutoencoderKLWan(**SMALL_WAN).save_pretrained(folder)
        models = {}
        for name, family in (("native (wan_ae.py)", None), ("diffusers' AutoencoderKLWan", "diffusers")):
            source = families.load_source(folder, video=True, vae_family=family)
            models[name] = families.build_model(source.params)
            models[name].load_state_dict(source.state)
    x = torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    times = {name: [] for name in models}
    for _ in range(args.families_steps):  # interleaved: the machine's drift falls on both
        for name, vae in models.items():
            vae.zero_grad(set_to_none=True)
            start = time.perf_counter()
            recon, mean, logvar = vae(x)
            ((recon - x).square().mean() + mean.square().mean()).backward()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, vae in models.items():
        out[name] = {"step_s": round(statistics.median(times[name]), 3), "saved_mib": round(_saved_bytes(vae, x) / 2 ** 20, 1)}
    native = models["native (wan_ae.py)"]
    native.set_grad_checkpointing("decoder")
    out["native (wan_ae.py)"]["saved_mib_decoder_checkpointed"] = round(_saved_bytes(native, x) / 2 ** 20, 1)
    native.set_grad_checkpointing("none")
    base = out["native (wan_ae.py)"]
    rows = [[name, r["step_s"], round(r["step_s"] / base["step_s"], 2), r["saved_mib"],
             round(r["saved_mib"] / base["saved_mib"], 2)] for name, r in out.items()]
    report.table(f"Wan's VAE (small, f4, z8) on one 9-frame 64 px clip, fp32, {torch.get_num_threads()} threads: a "
                 "training forward and backward (median of interleaved steps) and the bytes saved for backward",
                 ["path", "step s", "x native", "saved MiB", "x native"], rows)
    report.line(f"  native with the decoder checkpointed: {base['saved_mib_decoder_checkpointed']} MiB saved")
    return out


def bench_families(args, report: Report) -> dict:
    report.line("\n== families: diffusers' own modules at their size; Wan's VAE through both paths ==")
    out = {"paths": bench_families_paths(args, report)}
    if not args.families_skip_memory:
        out["memory"] = bench_families_memory(args, report)
    return out
