"""The gpu section (CUDA only; issue 30's table): the reference's habits and ours, eager and compiled, at each size,
each case in a fresh process (`bench.py --_gpu_case`): img/s, peak memory, the share of CUDA time in copies."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from bench.harness import FLUX_CONFIG, HERE, LAUNCHER, add_reference_habits, build_trainer, timed_step
from bench.machine import peak_rss
from bench.report import Report, median
from config import Precision


GPU_SIZES = {  # name: (model flags, resolution, batch at --gpu_batch 8); issue 30's two sizes and 512 px
    "flux_256": (dict(FLUX_CONFIG, do_attn=False), 256, 8),
    "launcher_256": (dict(FLUX_CONFIG, vae_ch=64, do_attn=False), 256, 12),  # the reference launcher's size
    "flux_512": (dict(FLUX_CONFIG, do_attn=False), 512, 2)}
GPU_CASES = {  # name: (flags, the reference's habits, compiled)
    "reference_eager": (dict(precision="bf16", channels_last="false", critic_trunk="trainable", allow_tf32="true",
                             ema_decay=0.0, grad_clip=0.0), True, False),
    "reference_compiled": (dict(precision="bf16", channels_last="false", critic_trunk="trainable", allow_tf32="true",
                                ema_decay=0.0, grad_clip=0.0), True, True),
    "ours_bf16_frozen": (dict(precision="bf16", critic_trunk="frozen"), False, False),
    "ours_bf16_frozen_channels_last": (dict(precision="bf16", critic_trunk="frozen", channels_last="true"), False,
                                       False),
    "ours_bf16_frozen_compiled": (dict(precision="bf16", critic_trunk="frozen"), False, True),
    "ours_default": ({}, False, False),  # the README's command: fp32 (TF32 auto), layout auto, trainable critic
    "ours_fp32_strict": (dict(allow_tf32="false", channels_last="true"), False, False),  # the old default
}
COPY_KERNELS = ("aten::copy_",)  # _to_copy, contiguous and clone write through it


def reference_habits(trainer, compiled: bool) -> None:
    """Issue 30's baseline, the reference trainer's loop habits on our modules: the encoder and decoder under bf16
    autocast with GroupNorm left to autocast (CUDA's list casts its input to fp32, its output stays fp32 until the
    next convolution), LPIPS and the (trainable VGG16) critic in fp32 with TF32, NCHW, no EMA or clipping, .item()
    on every logged scalar and the critic's weight gradients in the generator's pass (add_reference_habits);
    compiled: the encoder and decoder only, as its --do_compile."""
    import ae
    ae.GroupNorm32.forward = torch.nn.GroupNorm.forward  # this process only (a fresh one per case)
    trainer.objective.precision = Precision.of("fp32")
    if trainer.adversary is not None:
        trainer.adversary.precision = Precision.of("fp32")
    add_reference_habits(trainer)
    trainer.metrics.host_sync = True
    if compiled:
        trainer.vae.encoder.compile()
        trainer.vae.decoder.compile()


def run_gpu_case(case: dict) -> dict:
    """One GPU case in this (fresh) process: 3 warm-up steps (compilation included), then the median of the timed
    steps with a synchronize around each; peak memory; and, with case["profile"], the share of CUDA time in copies."""
    device = torch.device(case.get("device", "cuda"))  # cpu: the tests' smoke run
    cuda = device.type == "cuda"
    flags, habits, compiled = GPU_CASES[case["case"]]
    model, resolution, batch = case.get("size_spec") or GPU_SIZES[case["size"]]
    batch = max(1, round(batch * case["gpu_batch"] / 8))
    overrides = {**model, "vae_resolution": resolution, "batch_size": batch, "do_ganloss": True,
                 "memory_check": False, **flags, "compile": compiled and not habits}
    trainer = build_trainer(case["url"], case["output_dir"], case["case"], device, **overrides)
    if habits:
        reference_habits(trainer, compiled)
    started = time.perf_counter()
    warmup = [timed_step(trainer) for _ in range(case.get("warmup", 3))]
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_s = [timed_step(trainer) for _ in range(case["steps"])]
    out = {"batch_size": batch, "median_step_s": median(step_s), "img_per_s": batch / median(step_s),
           "peak_gib": (torch.cuda.max_memory_allocated(device) if cuda else peak_rss()) / 2 ** 30,
           "first_step_s": warmup[0], "warmup_s": time.perf_counter() - started - sum(step_s)}
    if case.get("profile"):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                timed_step(trainer)
        events = prof.key_averages()

        def self_time(e):
            return e.self_device_time_total if cuda else e.self_cpu_time_total
        total = sum(self_time(e) for e in events)
        copies = sum(self_time(e) for e in events if e.key in COPY_KERNELS)
        top = sorted(events, key=lambda e: -self_time(e))[:12]
        out.update(copy_fraction=copies / total if total else None, device_ms_per_step=total / 3 / 1000,
                   top_device_ms=[(e.key, round(self_time(e) / 3 / 1000, 2)) for e in top])
    return out


def spawn_gpu_case(case: dict, timeout: float | None = None) -> dict:
    cmd = [sys.executable, LAUNCHER, "--_gpu_case", json.dumps(case)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_gpu(args, url, tmp, device, report: Report) -> dict:
    """Issue 30's table: the reference's habits and ours, eager and compiled, on the sizes of GPU_SIZES (compiled
    cases at --gpu_compile_sizes only: each compiles for a minute or more), every case a fresh process with the
    same in-memory batches; the frozen-trunk bf16 case also under the profiler (the share of CUDA time in copies)."""
    out, rows = {}, []
    sizes = [s for s in args.gpu_sizes.split(",") if s]
    for size in sizes:
        for name, (_, _, compiled) in GPU_CASES.items():
            if compiled and size not in args.gpu_compile_sizes.split(","):
                continue
            if name == "ours_fp32_strict" and size != sizes[0]:
                continue
            report.line(f"  {size}: {name} ...")
            result = spawn_gpu_case({"case": name, "size": size, "url": url, "output_dir": tmp, "steps": args.gpu_steps,
                                     "gpu_batch": args.gpu_batch, "profile": name == "ours_bf16_frozen"})
            out[f"{size}/{name}"] = result
            if "error" in result:
                rows.append([size, name, "failed", "", "", result["error"].splitlines()[-1][:60]])
                continue
            reference = out.get(f"{size}/reference_{'compiled' if 'compiled' in name else 'eager'}", {})
            ratio = result["img_per_s"] / reference["img_per_s"] if reference.get("img_per_s") else None
            rows.append([size, name, result["batch_size"], result["median_step_s"] * 1000, result["img_per_s"],
                         result["peak_gib"], ratio])
    report.table(f"The training step on {torch.cuda.get_device_name(device)}: ours and the reference's habits "
                 "(LPIPS, VGG16 hinge critic from step 0, GradNorm; median of --gpu_steps after 3 warm-up steps)",
                 ["size", "case", "batch", "ms/step", "img/s", "peak GiB", "x reference"], rows)
    return out
