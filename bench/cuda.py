"""The cuda section (issue 48): the first hour on a GPU in one command, `python bench.py --sections cuda --json`.

What no GPU had run before it: the copy fix, the diffusers family, temporal chunks, the 3D critic, FSDP2 over NCCL and
the memory check's estimate against what CUDA allocates. One table, a row per check, each with its status (ok,
FAILED and why, or skipped and why) and its figure; --json writes the rows (and the gpu section's keys) as JSON.
On a machine without CUDA every row is skipped with its reason, in a second.

  train      3 steps of bf16 training of each family on CUDA (bench.harness.build_trainer: the real Trainer, the memory
             check on, in-memory pinned batches), one fresh process for them all (a sticky CUDA error starts another
             for the rest): ldm (ae.py, LPIPS and the VGG16 critic); wan_ae.py's video model on 17-frame clips, whole
             and in chunks (--train_time_chunks 4,1); the 3D critic (--discriminator patchgan3d) on those clips; every
             diffusers class that trains here at its tiny config (tests/test_families.py's TINY, decoder only, clips
             of 1 + t frames or images). Step 1 warms up (lazy state, cuDNN's autotuning); steps 2 and 3 run under
             torch.cuda.set_sync_debug_mode("error"), which raises on any host sync (a sync is reported, and the
             steps rerun without the detector); then every logged loss and every weight must be finite and no step
             skipped by the guard. The figure: seconds per step (steps 2-3).
  memory     the memory check's estimate against torch.cuda.max_memory_allocated over 3 steps, for LTX-2's and
             HunyuanVideo 1.5's VAE at their default configs, decoder only, 17 frames of 256 px, decoder checkpointed,
             bf16 (bench/memory_check.py's CUDA_CASES, a fresh process each). The figure: estimate / measured.
  gan_step   the gpu section's GAN step at FLUX width, 256 px, batch --gpu_batch (bench/gpu.py): the reference's habits
             and ours (bf16, frozen trunk), eager and compiled, a fresh process each. The figure: img/s, and ours over
             the reference's in the detail (the gpu_* keys of --json and their targets).
  fsdp       where a second GPU exists: `torchrun --nproc_per_node 2 vae_trainer.py --demo --sharding fsdp --precision
             bf16` (NCCL), 10 steps; exit 0, the sharded checkpoint written, the last logged loss finite.

The rows run in the order train, memory, gan_step (eager, then compiled), fsdp, within --cuda_budget_s (default 450:
under 8 minutes with the start): a child process gets the time left, and a row that no time is left for is skipped
with that reason.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.harness import HERE
from bench.report import Report

GAN_SIZE = "flux_256"
GAN_CASES = ("reference_eager", "ours_bf16_frozen", "reference_compiled", "ours_bf16_frozen_compiled")
MEMORY_CASES = ("ltx2_17f_256", "hunyuanvideo15_17f_256")
CLIP_FRAMES, CLIP_SIZE = 17, 64
# the families' runs: name -> flags (init_from: "wan" a tiny Wan folder, "diffusers:<class>" the class's tiny one)
STEP = dict(precision="bf16", max_steps=100)
FAMILY_CASES = {
    "ldm": dict(STEP, vae_ch=32, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4, vae_resolution=64,
                batch_size=2, do_ganloss=True),
    "wan_17f": dict(STEP, init_from="wan", video_frames=CLIP_FRAMES, vae_resolution=CLIP_SIZE, batch_size=1),
    "wan_17f_chunks": dict(STEP, init_from="wan", video_frames=CLIP_FRAMES, vae_resolution=CLIP_SIZE, batch_size=1,
                           train_time_chunks="4,1"),
    "critic3d": dict(STEP, init_from="wan", video_frames=CLIP_FRAMES, vae_resolution=CLIP_SIZE, batch_size=1,
                     do_ganloss=True, discriminator="patchgan3d"),
}
TRAIN_STEPS = 3  # step 1 warms up; 2 and 3 under the sync detector
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


def _tests_value(module: str, name: str):
    """A value of a test module (the tests' tiny configs: tests/test_families.py's TINY, tests/test_video.py's
    TINY_WAN), imported with tests/ on the path as pytest imports it."""
    import importlib
    tests = os.path.join(HERE, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return getattr(importlib.import_module(module), name)


def tiny_classes() -> dict[str, dict]:
    """The diffusers classes the registry trains, each at its tiny config (tests/test_families.py's TINY)."""
    import diffusers_ae
    return {name: config for name, config in _tests_value("test_families", "TINY").items()
            if name in diffusers_ae.CLASSES}


def planned_rows() -> list[tuple[str, str]]:
    """(part, case) of every row, in the table's order."""
    rows = [("train", name) for name in FAMILY_CASES] + [("train", f"diffusers:{c}") for c in tiny_classes()]
    rows += [("memory", name) for name in MEMORY_CASES]
    rows += [("gan_step", name) for name in GAN_CASES]
    return rows + [("fsdp", "2 ranks, nccl")]


# ----------------------------------------------------------------------------------------- the train rows (child)
def _folder(kind: str, root: str) -> str:
    """A tiny source folder: 'wan' (tests/test_video.py's TINY_WAN, an AutoencoderKLWan) or 'diffusers:<class>'."""
    import diffusers_ae
    folder = os.path.join(root, "sources", kind.replace(":", "_"))  # (the runs' directories are root/<case>)
    if os.path.isdir(folder):
        return folder
    if kind == "wan":
        class_name, config = "AutoencoderKLWan", _tests_value("test_video", "TINY_WAN")
    else:
        class_name = kind.split(":", 1)[1]
        config = tiny_classes()[class_name]
    torch.manual_seed(0)
    with diffusers_ae.quiet_diffusers():
        model = diffusers_ae.diffusers_class(class_name)(**config)
        with torch.no_grad():  # (as tests/test_families.py's tiny_folder: no layer at a degenerate value)
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        model.save_pretrained(folder)
    return folder


def _flags(name: str, root: str, data: dict) -> tuple[dict, str]:
    """The run's flags and its data's url for a train row."""
    import diffusers_ae
    import families
    if not name.startswith("diffusers:"):
        flags = dict(FAMILY_CASES[name])
        if flags.get("init_from") == "wan":
            flags["init_from"] = _folder("wan", root)
        return flags, data["clips"] if flags.get("video_frames") else data["images"]
    class_name = name.split(":", 1)[1]
    folder = _folder(name, root)
    params = diffusers_ae.DiffusersParams.of(class_name, json.load(open(os.path.join(folder, "config.json"))))
    t = params.temporal_factor
    flags = dict(STEP, init_from=folder, vae_resolution=max(32, 2 * params.spatial_factor), batch_size=2,
                 train_parts="decoder", perceptual_weight=0.0, mse_pool_factor=4)
    if t:
        flags["video_frames"] = 1 + t
    if class_name in families.WAN_FAMILY.CLASSES:
        flags["vae_family"] = "diffusers"
    return flags, data["clips"] if t else data["images"]


def _data(root: str) -> dict:
    """Images (the demo's photos) and 17-frame clips of 64 px of them, as shards."""
    from bench.memory_check import data_shards as shards_of
    return {"images": shards_of(os.path.join(root, "images"), 0, 64),
            "clips": shards_of(os.path.join(root, "clips"), CLIP_FRAMES, CLIP_SIZE)}


def train_case(name: str, root: str, data: dict, device: torch.device) -> dict:
    """One train row in this process: 3 bf16 steps, steps 2-3 under CUDA's sync detector; finite losses and weights."""
    from bench.harness import build_trainer
    flags, url = _flags(name, root, data)
    trainer = build_trainer(url, root, name.replace(":", "_"), device, **flags)
    out: dict = {"params": sum(p.numel() for p in trainer.vae.parameters())}
    try:
        trainer.train_step()  # warm-up: lazy state, cuDNN's autotuning
        trainer.step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        sync = None
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(TRAIN_STEPS - 1):
                trainer.train_step()
                trainer.step += 1
        except RuntimeError as e:  # a host sync in the step (the detector raises at the op that syncs)
            if "synchroniz" not in str(e):
                raise
            sync = str(e).strip().splitlines()[0][:200]
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if sync is not None:  # the finite check still wants its steps
            while trainer.step < TRAIN_STEPS:
                trainer.train_step()
                trainer.step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["s_per_step"] = (time.perf_counter() - start) / (TRAIN_STEPS - 1)
        metrics = trainer.metrics.reduce(trainer.info)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        bad = sorted(k for k, v in scalars.items() if not math.isfinite(v))
        bad += [n for n, p in trainer.vae.named_parameters() if not torch.isfinite(p).all()][:3]
        skipped = scalars.get("guard/skipped_vae", 0.0) + scalars.get("guard/skipped_disc", 0.0)
        problems = ([f"host sync in the step: {sync}"] if sync else []) + (
            [f"not finite: {', '.join(bad[:4])}"] if bad else []) + ([f"{skipped:g} steps skipped by the guard"]
                                                                     if skipped else [])
        out["loss"] = scalars.get("loss/total")
        out["status"] = "FAILED" if problems else "ok"
        out["detail"] = "; ".join(problems) or f"loss {out['loss']}, {out['params'] / 1e6:.2f}M params"
    finally:
        trainer.close()
    return out


def run_train_cases(names: list[str], device: str = "cuda") -> None:
    """The child of the train rows: one JSON line per case on stdout as each ends (the trainer's lines go to
    stderr). After a CUDA error (sticky: every later kernel fails) it stops, exit 3: the parent starts another."""
    real_stdout = sys.stdout
    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="cuda_train_") as root, contextlib.redirect_stdout(sys.stderr):
        data = _data(root)
        for name in names:
            try:
                result = train_case(name, root, data, dev)
            except Exception as e:  # a row's failure is its row's
                result = {"status": "FAILED", "detail": f"{type(e).__name__}: " + (str(e).strip().splitlines()
                                                                                  or [""])[0][:200]}
            print(json.dumps({"case": name, **result}), file=real_stdout, flush=True)
            if result["status"] == "FAILED" and "CUDA error" in result["detail"]:
                sys.exit(3)


# ----------------------------------------------------------------------------------------------- the parent
class Budget:
    """The section's wall-clock budget: what a child may take, and the reason a row is skipped when none is left."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def spent(self, least: float = 20.0) -> str | None:
        return (f"the section's --cuda_budget_s {self.seconds:.0f} spent" if self.left() < least else None)


def _train_rows(names: list[str], budget: Budget) -> dict[str, dict]:
    """The train rows, in children: one for all, another after a sticky CUDA error or a crash (the case it was on
    FAILED), until every row has a result or the budget is spent."""
    results: dict[str, dict] = {}
    while len(results) < len(names):
        todo = [n for n in names if n not in results]
        before = len(results)
        reason = budget.spent()
        if reason:
            results.update({n: {"status": "skipped", "detail": reason} for n in todo})
            break
        code = f"import bench.cuda as c; c.run_train_cases({todo!r})"
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                                  timeout=budget.left())
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, rc = "", None
        for line in stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results[record.pop("case")] = record
        left = [n for n in names if n not in results]
        if left and rc is None:
            results[left[0]] = {"status": "FAILED", "detail": "the section's budget ran out during this row"}
        elif left and (rc not in (0, 3) or len(results) == before):  # a crash (a segfault, an abort): this case's
            tail = (stderr.strip().splitlines() or [""])[-1][:200]
            results[left[0]] = {"status": "FAILED", "detail": f"the process died (exit {rc}): {tail}"}
    return results


def _memory_row(name: str, budget: Budget) -> dict:
    from bench.memory_check import spawn_case
    result = spawn_case(name, "cuda", 3, timeout=budget.left())
    if "error" in result:
        return {"status": "FAILED", "detail": result["error"]}
    e = result["estimate_gib"]
    ratio = result["ratio"]
    return {"status": "ok" if 0.75 <= ratio <= 1.25 else "FAILED", "figure": round(ratio, 3),
            "detail": f"estimate {e['total']:.2f} GiB (activations {e['activations']:.2f}), max allocated "
                      f"{result['measured_gib']:.2f}, reserved {result['max_reserved_gib']:.2f} GiB",
            "result": result}


def _gan_row(name: str, url: str, tmp: str, args, budget: Budget, gpu: dict) -> dict:
    from bench.gpu import spawn_gpu_case
    result = spawn_gpu_case({"case": name, "size": GAN_SIZE, "url": url, "output_dir": tmp, "steps": args.gpu_steps,
                             "gpu_batch": args.gpu_batch, "profile": name == "ours_bf16_frozen"},
                            timeout=budget.left())
    gpu[f"{GAN_SIZE}/{name}"] = result
    if "error" in result:
        return {"status": "FAILED", "detail": result["error"].splitlines()[-1][:200]}
    reference = gpu.get(f"{GAN_SIZE}/reference_{'compiled' if 'compiled' in name else 'eager'}", {})
    detail = (f"batch {result['batch_size']}, peak {result['peak_gib']:.2f} GiB, first step "
              f"{result['first_step_s']:.1f} s")
    if reference.get("img_per_s") and not name.startswith("reference"):
        detail += f", {result['img_per_s'] / reference['img_per_s']:.2f}x the reference's"
    return {"status": "ok", "figure": round(result["img_per_s"], 1), "detail": detail}


def fsdp_command(root: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "vae_trainer.py",
            "--demo", "--sharding", "fsdp", "--precision", "bf16", "--max_steps", "10", "--log_every_n_steps", "5",
            "--save_every_n_steps", "10", "--evaluate_every_n_steps", "0", "--inception_weights", "none",
            "--wandb_mode", "disabled", "--output_dir", root, "--run_name", "fsdp"]


def _fsdp_row(budget: Budget) -> dict:
    with tempfile.TemporaryDirectory(prefix="cuda_fsdp_") as root:
        try:
            proc = subprocess.run(fsdp_command(root), capture_output=True, text=True, cwd=HERE, timeout=budget.left())
        except subprocess.TimeoutExpired:
            return {"status": "FAILED", "detail": "the section's budget ran out during this row"}
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
            return {"status": "FAILED", "detail": f"exit {proc.returncode}: {tail}"}
        with open(os.path.join(root, "fsdp", "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if "loss/total" in r]
        last = records[-1]["loss/total"] if records else float("nan")
        sharded = "(sharded: each rank wrote its shards)" in proc.stdout
        ok = sharded and math.isfinite(last)
        return {"status": "ok" if ok else "FAILED", "figure": round(records[-1].get("s_per_step", float("nan")), 3)
                if records else None,
                "detail": f"last loss {last:.4g}" + ("" if sharded else "; no sharded checkpoint written")}


def bench_cuda(args, tmp: str, report: Report) -> dict:
    """Every row of planned_rows, run or skipped with its reason; one table; the results (and the gpu section's
    results, whose keys summarize() makes)."""
    started = time.monotonic()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    budget = Budget(args.cuda_budget_s)
    rows = planned_rows()
    results: dict[tuple[str, str], dict] = {}
    gpu: dict = {}
    if not cuda:
        results = {row: {"status": "skipped", "detail": NO_CUDA} for row in rows}
    else:
        report.line(f"\n== cuda: {torch.cuda.get_device_name(0)} x {gpus}, budget {args.cuda_budget_s:.0f} s ==")
        train = [case for part, case in rows if part == "train"]
        report.line(f"  train: {len(train)} runs of {TRAIN_STEPS} bf16 steps ...")
        results.update({("train", n): r for n, r in _train_rows(train, budget).items()})
        for name in MEMORY_CASES:
            report.line(f"  memory: {name} ...")
            results[("memory", name)] = ({"status": "skipped", "detail": budget.spent(60)} if budget.spent(60)
                                         else _memory_row(name, budget))
        url = None
        if budget.spent(90) is None:  # the GAN step's batches: photo-like crops (bench/images.py), as the gpu section's
            from bench.images import make_datasets
            url = make_datasets(os.path.join(tmp, "gan_images"), 8, 512, 512, args.seed)["jpeg"]["url"]
        for name in GAN_CASES:
            report.line(f"  gan_step: {name} ...")
            reason = budget.spent(90 if "compiled" in name or url is None else 30)
            results[("gan_step", name)] = ({"status": "skipped", "detail": reason} if reason
                                           else _gan_row(name, url, tmp, args, budget, gpu))
        row = ("fsdp", "2 ranks, nccl")
        if gpus < 2:
            results[row] = {"status": "skipped", "detail": f"{gpus} GPU: the run needs 2"}
        else:
            report.line("  fsdp: 2 ranks ...")
            reason = budget.spent(60)
            results[row] = {"status": "skipped", "detail": reason} if reason else _fsdp_row(budget)
    table = [[part, case, results[(part, case)]["status"], results[(part, case)].get("figure", ""),
              results[(part, case)].get("detail", "")] for part, case in rows]
    report.table("The first hour on a GPU (python bench.py --sections cuda): train: s/step; memory: estimate / "
                 "max allocated; gan_step: img/s; fsdp: s/step", ["part", "case", "status", "figure", "detail"],
                 table)
    counts = {s: sum(1 for r in results.values() if r["status"] == s) for s in ("ok", "FAILED", "skipped")}
    report.line(f"  {counts['ok']} ok, {counts['FAILED']} FAILED, {counts['skipped']} skipped in "
                f"{time.monotonic() - started:.0f} s")
    return {"rows": [{"part": p, "case": c, **results[(p, c)]} for p, c in rows], "counts": counts,
            "gpus": gpus, "elapsed_s": round(time.monotonic() - started, 1), "gpu": gpu}
