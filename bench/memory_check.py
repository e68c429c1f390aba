"""The memory_check section (issue 48 item 6): the memory check's estimate against what a real run holds at its peak,
one family at a time at a real configuration, each case in a fresh process (`python -c`, glibc's defaults).

Each case builds vae_trainer.Trainer as the command line does (--init_from a diffusers folder of the family's released
architecture, random weights: the figures depend on the shapes only), with --memory_check on (its verdict is
recorded: trainer.memory_verdict), then trains --check_steps steps on in-memory batches. Measured over the steps:
  * CPU: the process's peak resident memory (VmHWM, reset just before the first step: the build's own peak, the
    init source read and the probes, is reported apart), against the estimate's `peak` (the tensors of the step plus
    what the process holds besides them, measured by the check: memory.StepMemory.process);
  * CUDA: torch.cuda.max_memory_allocated (reset before the first step) against the estimate's tensors (`peak` =
    `total` there); max_memory_reserved beside it (the caching allocator's blocks, which the estimate does not
    count).
The cases: CASES on a CPU (FLUX.1's ae.py layout at 256 px with the VGG16 critic; Wan 2.1's VAE decoder-only on 17
frames of 64 px, whole and in chunks; CogVideoX's at its default 215.6M config, decoder-only, 9 frames of 64 px, the
decoder checkpointed and not: the issue's run), CUDA_CASES on a GPU (LTX-2's and HunyuanVideo 1.5's VAE at their
default configs, decoder-only, 17 frames of 256 px, checkpointed, bf16).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.harness import FLUX_CONFIG, HERE
from bench.machine import current_rss, peak_rss
from bench.report import Report

GIB = 2 ** 30
CRITIC = dict(do_ganloss=True)  # LPIPS (on by default) and the VGG16 critic, from step 0 (bench.harness' disc_start)
CLIPS = dict(batch_size=1, train_parts="decoder", grad_checkpointing="decoder", **CRITIC)
# name: (the diffusers class whose default config is the source, None: --vae_* flags; the run's flags)
CASES = {
    "ldm_flux_256": (None, dict(FLUX_CONFIG, vae_z_channels=16, vae_resolution=256, batch_size=1, **CRITIC)),
    "wan21_17f_64": ("AutoencoderKLWan", dict(CLIPS, video_frames=17, vae_resolution=64)),
    "wan21_17f_64_chunked": ("AutoencoderKLWan", dict(CLIPS, video_frames=17, vae_resolution=64,
                                                      train_time_chunks="4,1")),
    "cogvideox_9f_64": ("AutoencoderKLCogVideoX", dict(CLIPS, video_frames=9, vae_resolution=64)),
    # (the run had no checkpointing: the activations then hold most of the step)
    "cogvideox_9f_64_unchecked": ("AutoencoderKLCogVideoX", dict(CLIPS, video_frames=9, vae_resolution=64,
                                                                 grad_checkpointing="none")),
    # (tests/test_memory.py's, and --quick's: a small model whose step still holds more than the interpreter)
    "ldm_small_128": (None, dict(vae_ch=64, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4,
                                 vae_resolution=128, batch_size=2)),
}
CUDA_CASES = {
    "ltx2_17f_256": ("AutoencoderKLLTX2Video", dict(CLIPS, video_frames=17, vae_resolution=256, precision="bf16")),
    "hunyuanvideo15_17f_256": ("AutoencoderKLHunyuanVideo15", dict(CLIPS, video_frames=17, vae_resolution=256,
                                                                   precision="bf16")),
}
DEFAULT_CASES = ("ldm_flux_256", "wan21_17f_64", "wan21_17f_64_chunked", "cogvideox_9f_64",
                 "cogvideox_9f_64_unchecked")


def reset_peak() -> None:
    """Linux: the peak resident memory (VmHWM) set back to the resident memory now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def source_folder(class_name: str, folder: str) -> str:
    """A diffusers folder of `class_name` at diffusers' default config (the released architecture). Its weights are
    drawn N(0, 0.02) into a module made on the meta device (a 1.2B-parameter default init takes minutes on a CPU;
    what the measurement depends on is the shapes)."""
    import diffusers_ae
    generator = torch.Generator().manual_seed(0)
    with diffusers_ae.quiet_diffusers():
        with torch.device("meta"):
            model = diffusers_ae.diffusers_class(class_name)()
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=generator)
            for b in model.buffers():
                b.zero_()
        model.save_pretrained(folder)
    return folder


def data_shards(tmp: str, frames: int, size: int) -> str:
    """Shards of the demo's photos, or of moving-camera clips of them (`frames` > 0), at `size` px."""
    import skimage
    import shards
    import sources
    root = os.path.join(os.path.dirname(skimage.__file__), "data")
    photos = [os.path.join(root, p) for p in shards.DEMO_PHOTOS[:4]]
    if frames:
        return sources.brace_url(shards.write_photo_clips(photos, os.path.join(tmp, "clips"), frames, size, 1, 16, 0,
                                                          shard_size=2))
    paths, _ = shards.write_shards(photos, os.path.join(tmp, "images"), shard_size=2)
    return sources.brace_url(paths)


def measure_case(name: str, device: str = "cpu", steps: int = 2) -> dict:
    """One case of CASES or CUDA_CASES in this (fresh) process: the check's estimate and the measured peak."""
    from bench.harness import build_trainer
    source, flags = {**CASES, **CUDA_CASES}[name]
    dev = torch.device(device)
    out: dict = {"case": name, "source": source, "device": device}
    with tempfile.TemporaryDirectory(prefix="memory_check_") as tmp:
        url = data_shards(tmp, flags.get("video_frames", 0), flags["vae_resolution"])
        if source:
            flags = {**flags, "init_from": source_folder(source, os.path.join(tmp, "source"))}
        out["rss_before_build_gib"] = current_rss() / GIB
        started = time.perf_counter()
        trainer = build_trainer(url, tmp, name, dev, **{**flags, "memory_check": True})
        out["build_s"] = time.perf_counter() - started
        try:
            out["params"] = sum(p.numel() for p in trainer.vae.parameters())
            out["peak_of_build_gib"] = peak_rss() / GIB
            out["rss_before_steps_gib"] = current_rss() / GIB
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                out["allocated_before_steps_gib"] = torch.cuda.memory_allocated(dev) / GIB
            else:
                reset_peak()
            step_s = []
            for _ in range(steps):
                start = time.perf_counter()
                trainer.train_step()
                trainer.step += 1
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                step_s.append(time.perf_counter() - start)
            out["step_s"] = step_s
            if dev.type == "cuda":
                out["measured_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
                out["max_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / GIB
            else:
                out["measured_gib"] = peak_rss() / GIB
            verdict = trainer.memory_verdict
        finally:
            trainer.close()
    needed = verdict.needed
    out["estimate_gib"] = {part: getattr(needed, part) / GIB for part in
                           ("peak", "total", "activations", "weights", "training_state", "copies", "process")}
    out["judged"] = {"batch_size": verdict.shape.batch_size, "resolution": verdict.shape.resolution,
                     "frames": verdict.shape.frames}
    out["ratio"] = needed.peak / GIB / out["measured_gib"]  # the estimate / the measured peak
    return out


def spawn_case(name: str, device: str, steps: int, timeout: float | None = None) -> dict:
    """measure_case in a fresh process (so that no case's allocator state or peak is another's); an error dict if it
    failed."""
    code = f"import json, bench.memory_check as m; print(json.dumps(m.measure_case({name!r}, {device!r}, {steps})))"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or [""])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(name: str, result: dict) -> list:
    if "error" in result:
        return [name, "-", "-", "-", "-", "-", "failed: " + result["error"][:80]]
    e = result["estimate_gib"]
    return [name, f"{result['params'] / 1e6:.0f}M", round(e["total"], 2), round(e["process"], 2), round(e["peak"], 2),
            round(result["measured_gib"], 2), round(result["ratio"], 2)]


HEADER = ["case", "params", "est. tensors GiB", "est. process GiB", "est. peak GiB", "measured GiB", "est./measured"]


def bench_memory_check(args, device, report: Report) -> dict:
    """The CPU cases of --check_cases (or CUDA_CASES on a GPU), each in a fresh process: the table and the results."""
    report.line("\n== memory_check: the memory check's estimate against the measured peak (issue 48 item 6) ==")
    names = [n for n in args.check_cases.split(",") if n] if device.type == "cpu" else list(CUDA_CASES)
    out, rows = {}, []
    for name in names:
        report.line(f"  {name} (fresh process) ...")
        out[name] = spawn_case(name, device.type, args.check_steps)
        rows.append(row(name, out[name]))
    what = ("peak RSS over the steps (VmHWM)" if device.type == "cpu" else "torch.cuda.max_memory_allocated")
    report.table(f"The memory check's estimate against the measured peak ({what}), {args.check_steps} steps, fresh "
                 "process per case", HEADER, rows)
    return out
