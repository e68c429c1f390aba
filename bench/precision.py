"""The precision section (issue 30): does fp32 with TF32 (emulated on the CPU: TF32Emulation) or bf16 train as well
as strict fp32, step for step, in real `vae_trainer.py --demo` runs."""
from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shards
import vae_trainer
from bench.report import Report
from bench.runs import run_logged, wait_logged


TF32_OPS = {"convolution": (0, 1), "convolution_backward": (0, 1, 2), "mm": (0, 1), "bmm": (0, 1),
            "addmm": (1, 2), "baddbmm": (1, 2), "_scaled_dot_product_flash_attention_for_cpu": (0, 1, 2)}


def to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values with the mantissa cut to TF32's 10 bits (the 13 low bits zeroed: truncation, the pessimistic
    reading of what a tensor core does with an fp32 operand; rounding to nearest would halve the error)."""
    return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)


class TF32Emulation(TorchDispatchMode):
    """fp32 convolutions and matmuls (forward and backward) whose fp32 operands are cut to TF32 precision before a
    CPU kernel multiplies them in fp32 and accumulates in fp32: what `torch.backends.cudnn.allow_tf32` and
    `torch.backends.cuda.matmul.allow_tf32` do on an Ampere+ GPU (fp32 storage, range and accumulation, 10-bit
    multiplicands), on a machine without one."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        operands = TF32_OPS.get(func.overloadpacket.__name__)
        if operands:
            args = tuple(to_tf32(a) if i in operands and isinstance(a, torch.Tensor) and a.dtype == torch.float32
                         else a for i, a in enumerate(args))
        return func(*args, **(kwargs or {}))


def tf32_trainer_main(argv: list[str]) -> int:
    """vae_trainer.py's main with every step's convolutions and matmuls at TF32 precision (TF32Emulation)."""
    with TF32Emulation():
        return vae_trainer.main(argv)


def bench_precision(args, tmp, report: Report) -> dict:
    """Strict fp32, fp32 with TF32 multiplicands (emulated: the CPU has no TF32) and bf16 autocast with fp32
    statistics (the CPU's real bf16 kernels), each a real `vae_trainer.py --demo` run of --precision_steps steps and
    the same seed, two at a time (one thread each), for each seed of --precision_seeds; held-out PSNR and SSIM at every
    evaluation (the demo's 4 photos, 64 px). The question: does the precision a GPU run gets by default (fp32 with
    TF32) train as well as strict fp32, step for step."""
    root = os.path.join(tmp, "precision")
    shards.ensure_demo_shards(os.path.join(root, "demo_data"))  # once, before the runs that share it
    steps, seeds = args.precision_steps, [int(s) for s in args.precision_seeds.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    every = max(1, steps // 3)
    variants = {"fp32": [sys.executable, "vae_trainer.py"],
                "tf32": [sys.executable, "-c", "import sys; from bench import precision; "
                                               "sys.exit(precision.tf32_trainer_main(sys.argv[1:]))"],
                "bf16": [sys.executable, "vae_trainer.py"]}
    jobs = []
    for seed in seeds:
        for name, cmd in variants.items():
            run = f"{name}_s{seed}"
            argv = ["--demo", "--max_steps", str(steps), "--seed", str(seed), "--output_dir", root, "--run_name", run,
                    "--evaluate_every_n_steps", str(every), "--save_every_n_steps", str(steps), "--num_workers", "1",
                    "--num_threads", "1", "--precision", "bf16" if name == "bf16" else "fp32"]
            jobs.append((run, cmd + argv))
    wall, parallel = {}, max(1, min(len(jobs), (os.cpu_count() or 2)))
    for i in range(0, len(jobs), parallel):
        batch = jobs[i:i + parallel]
        report.line("  training " + ", ".join(run for run, _ in batch) + f" ({steps} demo steps each) ...")
        procs = {run: run_logged(cmd, os.path.join(root, f"{run}.log"), env) for run, cmd in batch}
        wall.update(wait_logged(procs))
    out, rows = {"steps": steps, "seeds": seeds, "wall_s": wall}, []
    for run, _ in jobs:
        with open(os.path.join(root, run, "metrics.jsonl")) as f:
            evals = [r for r in map(json.loads, f) if "eval/psnr" in r]
        out[run] = {int(r["step"]): {k: r[k] for k in ("eval/psnr", "eval/ssim", "eval_ema/psnr", "eval_ema/ssim")}
                    for r in evals}
        for r in evals:
            rows.append([run, int(r["step"]), r["eval/psnr"], r["eval/ssim"], r["eval_ema/psnr"]])
    for name in ("tf32", "bf16"):
        gaps = [out[f"{name}_s{seed}"][steps]["eval_ema/psnr"] - out[f"fp32_s{seed}"][steps]["eval_ema/psnr"]
                for seed in seeds]
        out[f"{name}_minus_fp32_final_ema_psnr"] = gaps
    report.table(f"Held-out quality per step by precision (demo model, {steps} steps, seeds {seeds}; TF32 emulated "
                 "by truncating the fp32 operands of every convolution and matmul to 10 mantissa bits)",
                 ["run", "step", "PSNR", "SSIM", "EMA PSNR"], rows)
    return out
