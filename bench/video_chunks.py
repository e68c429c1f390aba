"""The video_chunks section (issue 42 item 2): long clips trained in temporal chunks (--train_time_chunks).

measured: a small VAE of Wan 2.1's structure (bench/video.py's SMALL_WAN: base 32, z 8, dim_mult 1,2,2, one block,
time halved at both lower levels) at --chunks_size px, one clip, a training step's forward and backward of the
whole reconstruction's MSE and the KL (no optimizer), whole against chunked, at the clip lengths of
--chunks_frames. Each case is a fresh process: its peak resident memory (ru_maxrss) less its resident memory just
before the first step (the model, the clip, the interpreter) is the step's peak; the step time is the median of
--chunks_steps steps after one warm-up.

estimated: the memory check's own estimate (memory.estimate_step_memory, the probes run with the chunk plan: what
stays outside the chunks plus one chunk's recomputation) for one clip of Wan 2.1's VAE as released (bench/video.py's
wan21_params; random weights: the figure depends on the shapes only), decoder only, bf16, LPIPS and the VGG16 critic
on, at --chunks_estimate_size px, whole against chunked, with and without the decoder checkpointed per level.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from bench.report import Report
from config import Precision

def step_case(frames: int, plan: tuple[int, int], size: int, steps: int) -> dict:
    """One case in this (fresh) process: peak RSS growth of a training step and its median time."""
    import memory
    import wan_ae
    from bench.video import SMALL_WAN
    torch.manual_seed(0)
    params = wan_ae.WanParams(ch=SMALL_WAN["base_dim"], ch_mult=tuple(SMALL_WAN["dim_mult"]),
                              num_res_blocks=SMALL_WAN["num_res_blocks"], z_channels=SMALL_WAN["z_dim"],
                              temporal_downsample=tuple(SMALL_WAN["temperal_downsample"]), video=True)
    vae = wan_ae.WanAutoEncoder(params).train()
    vae.train_chunks = plan
    x = torch.rand(1, 3, frames, size, size) * 2 - 1
    before = memory.rss_bytes()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        recon, mean, logvar = vae(x)
        loss = (recon - x).square().mean() + 1e-6 * (mean.square() + logvar.exp() - logvar).mean()
        loss.backward()
        vae.zero_grad(set_to_none=True)
        del recon, mean, logvar, loss
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_mib": round((peak - before) / 2 ** 20, 1),
            "step_s": round(statistics.median(times[1:] if steps else times), 3)}


def estimate_case(frames: list[int], size: int, plans: list[tuple[int, int]], checkpointing: str,
                  probes: tuple[int, int] = (32, 64)) -> dict:
    """GiB of the memory check's estimate per (frames, plan) for Wan 2.1's VAE, decoder only, bf16; a JSON line of
    what is done so far after each clip length (a long run's partial result)."""
    import memory
    import run_setup
    import wan_ae
    from bench.video import wan21_params
    from objective import VAEObjective
    from train_state import TrainingForward
    torch.manual_seed(0)
    vae = wan_ae.WanAutoEncoder(wan21_params())
    model = TrainingForward(vae, frozen_encoder=True)
    cfg = run_setup.parse_config(["--do_ganloss", "--vgg16_weights", "random", "--train_parts", "decoder"])
    precision = Precision.of("bf16")
    objective = VAEObjective.from_config(cfg.loss, cfg.latents, cfg.critic, precision, None, True,
                                         torch.device("cpu"), torch.channels_last, 16, encoder_trains=False)
    out = {}
    for t in frames:
        for plan in plans:
            shape = memory.StepShape(1, size, precision=precision, grad_checkpointing=checkpointing, frames=t,
                                     time_chunks=plan)
            need = memory.estimate_step_memory(vae, objective, shape, model=model, probe_resolutions=probes)
            out[f"{t} {plan[0]},{plan[1]}"] = round(need.total / 1024 ** 3, 2)
        print(json.dumps(out), flush=True)
    return out


def _in_process(code: str) -> dict:
    """`code`'s last stdout line as JSON, run in a fresh process with glibc's mmap threshold fixed at 128 KiB:
    every large tensor is then its own mapping, returned to the system when freed, so that the peak RSS is the peak
    of what was allocated. (With glibc's default the threshold grows to the largest freed block, later blocks come
    from the heap, which fragments and keeps its pages: measured at 32 px, 33 frames, the chunked step then peaked
    above the whole clip's, 370 against 305 MiB, and 126 against 216 MiB with the threshold fixed.)"""
    import os
    from bench.harness import HERE
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"video_chunks case failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_video_chunks(args, report: Report) -> dict:
    frames = [int(t) for t in args.chunks_frames.split(",")]
    plans = [(0, 0)] + [tuple(int(n) for n in p.split(",")) for p in args.chunks_plans.split(";")]
    out: dict = {"measured": {}, "estimated_gib": {}}
    if not args.chunks_skip_measured:
        _measured(args, frames, plans, out, report)
    if not args.chunks_skip_estimate:
        _estimated(args, frames, plans, out, report)
    return out


def _measured(args, frames, plans, out, report: Report) -> None:
    rows = []
    for t in frames:
        whole = None
        for plan in plans:
            case = _in_process(f"import json, bench.video_chunks as v; "
                               f"print(json.dumps(v.step_case({t}, {plan}, {args.chunks_size}, {args.chunks_steps})))")
            out["measured"][f"{t} {plan[0]},{plan[1]}"] = case
            whole = whole or case
            label = "whole clip" if not any(plan) else f"chunks {plan[0]},{plan[1]}"
            rows.append([t, label, f"{case['peak_mib']:.0f}", f"{case['peak_mib'] / whole['peak_mib']:.2f}",
                         f"{case['step_s']:.2f}", f"{case['step_s'] / whole['step_s']:.2f}"])
            report.line(f"  {t} frames, {label}: peak +{case['peak_mib']} MiB, step {case['step_s']} s")
    report.table(f"A training step of a small Wan 2.1-structured VAE (SMALL_WAN) on one clip at {args.chunks_size} "
                 "px, CPU: peak RSS growth (fresh process per case) and median step time",
                 ["frames", "plan", "peak MiB", "x whole", "step s", "x whole"], rows)


def _estimated(args, frames, plans, out, report: Report) -> None:
    rows = []
    for checkpointing in args.chunks_checkpointing.split(","):
        gib = _in_process(f"import json, bench.video_chunks as v; print(json.dumps(v.estimate_case({frames}, "
                          f"{args.chunks_estimate_size}, {plans}, {checkpointing!r}, ({args.chunks_probes}))))")
        out["estimated_gib"][checkpointing] = gib
        for t in frames:
            rows.append([t, checkpointing] + [f"{gib[f'{t} {p[0]},{p[1]}']:.1f}" for p in plans])
            report.line(f"  estimate {t} frames, --grad_checkpointing {checkpointing}: "
                        + ", ".join(f"{p} {gib[f'{t} {p[0]},{p[1]}']} GiB" for p in plans))
    report.table(f"The memory check's estimate for Wan 2.1's VAE, decoder only, bf16, one clip at "
                 f"{args.chunks_estimate_size} px (GiB; LPIPS and the VGG16 critic on, EMA on; probes at "
                 f"{args.chunks_probes} px)",
                 ["frames", "--grad_checkpointing"] + ["whole clip" if not any(p) else f"chunks {p[0]},{p[1]}"
                                                       for p in plans], rows)
