"""The memory section: peak memory and step time of each --grad_checkpointing level, each case in a fresh process
(`bench.py --_memory_case`); the time cost of decoder_hr interleaved in one process; the activations each part of
the model saves for backward and the FLOPs each level recomputes."""
from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys

import torch

from bench.harness import HERE, LAUNCHER, MEMORY_CONFIG, add_reference_habits, build_trainer, timed_step
from bench.machine import current_rss, mib, peak_rss
from bench.report import Report, median, percent


CKPT_LEVELS = ("none", "decoder_hr", "hr", "decoder", "all")


def run_memory_case(case: dict) -> dict:
    """One level at one resolution, in this (fresh) process: peak memory and step times."""
    device = torch.device(case["device"])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    trainer = build_trainer(case["url"], case["output_dir"], case["run_name"], device, **case["overrides"])
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = current_rss()
    step_s, kernel_s = [], []
    for _ in range(case["steps"]):
        kernel_before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        step_s.append(timed_step(trainer))
        # CPU time spent in the kernel (mostly page faults on freshly mapped activation memory)
        kernel_s.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel_before)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss()
    return {"before_mib": mib(before), "peak_mib": mib(peak), "increase_mib": mib(peak - before), "step_s": step_s,
            "kernel_cpu_s": kernel_s}


def spawn_memory_case(case: dict) -> dict:
    cmd = [sys.executable, LAUNCHER, "--_memory_case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"memory case {case['overrides']} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def saved_activations(trainer) -> dict[str, float]:
    """MiB of activations each part of the network saves for backward in one training step (unique
    storages, parameters excluded), counted with saved-tensor hooks: exact and free of timing noise."""
    critic = trainer.adversary.critic if trainer.adversary is not None else None
    params = {p.untyped_storage().data_ptr() for m in (trainer.vae, trainer.objective.lpips, critic) if m is not None
              for p in list(m.parameters()) + list(m.buffers())}
    counted: dict[int, str] = {}
    totals: dict[str, int] = {}
    stack = ["losses and the rest"]

    def part_of(name: str, root: str) -> str:
        parts = name.split(".")
        if root == "vae" and parts[0] in ("encoder", "decoder") and len(parts) > 2 and parts[1] in ("down", "up"):
            return f"{parts[0]} level {parts[2]}"
        if root == "vae":
            return f"{parts[0]} (mid, in/out)" if parts[0] in ("encoder", "decoder") else "vae"
        return root

    handles = []
    for root, module in (("vae", trainer.vae), ("lpips", trainer.objective.lpips), ("discriminator", critic)):
        if module is None:
            continue
        for name, sub in module.named_modules():
            label = part_of(name, root) if name else (root if root != "vae" else stack[0])
            handles.append(sub.register_forward_pre_hook(lambda m, a, label=label: stack.append(label) and None))
            handles.append(sub.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: keep the output

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in counted:
            counted[ptr] = stack[-1]
            totals[stack[-1]] = totals.get(stack[-1], 0) + storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            trainer.train_step()
    finally:
        for handle in handles:
            handle.remove()
    return {k: mib(v) for k, v in sorted(totals.items())}


def step_flops(trainer, levels) -> dict[str, float]:
    """FLOPs (convolutions, matmuls, attention) of one training step at each checkpointing level, counted
    by torch's FlopCounterMode: the recomputation's cost on hardware where FLOPs set the step time."""
    from torch.utils.flop_counter import FlopCounterMode
    flops = {}
    for level in levels:
        trainer.vae.set_grad_checkpointing(level)
        with FlopCounterMode(display=False) as counter:
            trainer.train_step()
        flops[level] = float(counter.get_total_flops())
    trainer.vae.set_grad_checkpointing("none")
    return flops


def bench_memory(args, url, tmp, device, report: Report) -> dict:
    config = dict(MEMORY_CONFIG, vae_ch=args.memory_ch)
    cases = {}
    for res in args.memory_resolutions:
        for level in args.memory_levels:
            report.line(f"  memory case {level} at {res} px (fresh process) ...")
            case = {"device": str(device), "threads": args.threads, "url": url, "output_dir": tmp,
                    "run_name": f"memory_{level}_{res}", "steps": args.memory_steps,
                    "overrides": dict(config, vae_resolution=res, grad_checkpointing=level)}
            cases[(res, level)] = spawn_memory_case(case)

    # the time cost of decoder_hr again, interleaved in one process (fresh processes run at different times)
    interleaved = {}
    if args.ckpt_time_rounds > 0 and 512 in args.memory_resolutions:
        report.line("  interleaved none / decoder_hr timing at 512 px ...")
        trainer = build_trainer(url, tmp, "ckpt_timing", device, **config, vae_resolution=512)
        add_reference_habits(trainer)
        timed_step(trainer)  # warm-up
        for r in range(args.ckpt_time_rounds):
            for level in (("none", "decoder_hr") if r % 2 == 0 else ("decoder_hr", "none")):
                trainer.vae.set_grad_checkpointing(level)  # what --grad_checkpointing sets at start-up
                interleaved.setdefault(level, []).append(timed_step(trainer))
        del trainer
        gc.collect()

    # where the activations are, and what each level recomputes (at 128 px: both scale with the pixel count)
    trainer = build_trainer(url, tmp, "saved_activations", device, **config, vae_resolution=128)
    parts_128 = saved_activations(trainer)
    flops = step_flops(trainer, args.memory_levels)
    del trainer
    gc.collect()

    out = {"config": {**config, "lpips": True, "precision": "fp32", "channels_last": True},
           "step_gflop_at_128": {k: v / 1e9 for k, v in flops.items()},
           "flop_cost": {k: v / flops["none"] - 1 for k, v in flops.items()},
           "steps_per_case": args.memory_steps, "cases": {}, "interleaved_step_s": interleaved,
           "measure": "increase: peak minus the process's memory right before the first training step "
                      "(activations, gradients, optimizer state); total: the process's peak RSS (CPU) or "
                      "peak allocated (GPU)"}
    rows = []
    for res in args.memory_resolutions:
        base = cases.get((res, "none"))
        for level in args.memory_levels:
            c = cases[(res, level)]
            step = c["step_s"][-1]
            entry = {**c, "step_time_s": step}
            if base:
                entry["saving_increase"] = 1 - c["increase_mib"] / base["increase_mib"]
                entry["saving_total"] = 1 - c["peak_mib"] / base["peak_mib"]
                entry["time_cost"] = step / base["step_s"][-1] - 1
            out["cases"][f"{level}@{res}"] = entry
            rows.append([f"{res} px", level, c["before_mib"], c["peak_mib"], c["increase_mib"],
                         percent(entry.get("saving_increase")), percent(entry.get("saving_total")), step,
                         percent(entry.get("time_cost"), signed=True), c["kernel_cpu_s"][-1],
                         percent(flops[level] / flops["none"] - 1, signed=True)])
    report.table(f"Gradient checkpointing (ch {config['vae_ch']} x {config['vae_ch_mult']}, batch 1, LPIPS, fp32, "
                 f"{args.memory_steps} step(s) per fresh process; MiB)",
                 ["res", "level", "before", "peak", "increase", "saving (incr.)", "saving (peak)", "s/step",
                  "time cost", "kernel s", "FLOP cost"], rows)
    report.line("  before: memory in use before the first step; peak: " +
                ("torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS (VmHWM)") +
                "; increase = peak - before; kernel s: CPU time the step spent in the kernel (page faults on "
                "fresh memory); FLOP cost: extra FLOPs of the recomputation (FlopCounterMode at 128 px)")
    if interleaved:
        # the fastest of a few long steps: another process's load only ever adds time (as timeit argues)
        cost = min(interleaved["decoder_hr"]) / min(interleaved["none"]) - 1
        out["interleaved_time_cost_512"] = cost
        out["interleaved_time_cost_512_of_medians"] = median(interleaved["decoder_hr"]) / median(interleaved["none"]) - 1
        report.line(f"  interleaved at 512 px, {args.ckpt_time_rounds} rounds: none "
                    f"{', '.join(f'{v:.1f}' for v in interleaved['none'])} s/step, decoder_hr "
                    f"{', '.join(f'{v:.1f}' for v in interleaved['decoder_hr'])} s/step -> time cost "
                    f"{cost:+.1%} (fastest steps), {out['interleaved_time_cost_512_of_medians']:+.1%} (medians)")
    scale = (max(args.memory_resolutions) / 128) ** 2
    total = sum(parts_128.values())
    out["saved_activations_mib_at_128"] = parts_128
    report.table(f"Activations saved for backward, no checkpointing (measured at 128 px, x{scale:.0f} for "
                 f"{max(args.memory_resolutions)} px)", ["part", f"MiB at {max(args.memory_resolutions)} px", "share"],
                 [[k, v * scale, f"{v / total:.0%}"] for k, v in parts_128.items()]
                 + [["total", total * scale, "100%"]])
    return out
