"""The sharding section (docs/sharding.md): what --sharding fsdp's communication adds to a step.

measured: the demo's model (0.9M parameters, 64 px, batch 4 per rank, pixel losses, no critic) trained by real
`torchrun --nproc_per_node 2 vae_trainer.py --demo` runs on this CPU, gloo, one torch thread per rank, with
--sharding ddp and with --sharding fsdp (--channels_last false in both: fsdp keeps the VAE NCHW, and ddp would
otherwise be channels_last on a CPU, a layout difference rather than a communication one). The step time is the
trainer's own: metrics.jsonl's img/s of each --log_every_n_steps window, the first window (warm-up) left out,
median over the rest; runs alternate ddp, fsdp, fsdp, ddp, ... over --sharding_rounds, so a drift of the machine's
load falls on both. The ratio fsdp/ddp is a CPU's and gloo's: at 0.9M parameters a step's collectives are latency
(one all-gather per unit and pass), not bandwidth; it bounds nothing on GPUs and says what the sharded step's
extra collectives cost where compute is cheap.

model: the bytes each rank sends per step from the parameter counts (ring collectives: an all-reduce moves
2(N-1)/N of the data per rank, an all-gather or a reduce-scatter (N-1)/N): DDP all-reduces the gradients,
2(N-1)/N x 4P; FSDP all-gathers each unit's fp32 weights in forward and again in backward (reshard_after_forward)
and reduce-scatters the gradients, (N-1)/N x 4(3U + 2R) (U: the parameters in the units, R: the root's group,
gathered once, kept for backward), ~3(N-1)/N x 4P; HSDP does FSDP's within a node of L GPUs and all-reduces its
1/L shard of the gradients across the M nodes, 2(M-1)/M x 4P/L. Divided by a link's bandwidth per GPU that is the
time a step spends communicating if nothing overlaps it (FSDP prefetches the next unit's all-gather during the
current unit's compute, DDP overlaps its buckets' all-reduce with backward: the real cost is what does not hide).
Links: NVLink 4 on an H100 SXM is 900 GB/s bidirectional, 450 GB/s each way (NVIDIA's H100 datasheet); 300 GB/s is
taken as the bus bandwidth NCCL reaches over it (an assumption: about two thirds of the link). InfiniBand NDR:
400 Gb/s = 50 GB/s per GPU (one ConnectX-7 NIC per GPU, as in a DGX H100), the line rate. The model is LTX-2's
VAE (diffusers' AutoencoderKLLTX2Video() at its default config, counted on the meta device), whole and decoder
only, on 8 GPUs (one node: NVLink) and 16 (two nodes: fsdp's rings cross InfiniBand; hsdp's shards stay on NVLink).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import torch

from bench.harness import HERE
from bench.report import Report

NVLINK_GBPS = 300.0  # GB/s per GPU, the bus bandwidth assumed over NVLink 4 (900 GB/s bidirectional per H100 SXM)
IB_GBPS = 50.0  # GB/s per GPU: InfiniBand NDR, 400 Gb/s, one NIC per GPU
GPUS_PER_NODE = 8
RANKS = 2  # the measured runs: torchrun --nproc_per_node 2 on this CPU
WINDOW = 5  # --log_every_n_steps of the measured runs: a timed window


def run_command(sharding: str, steps: int, root: str, run_name: str) -> list[str]:
    """The measured run: `torchrun --standalone --nproc_per_node 2 vae_trainer.py --demo ...` (as python -m)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
            "vae_trainer.py", "--demo", "--sharding", sharding, "--channels_last", "false", "--max_steps", str(steps),
            "--log_every_n_steps", str(WINDOW), "--save_every_n_steps", str(steps), "--evaluate_every_n_steps", "0",
            "--num_workers", "0", "--num_threads", "1", "--wandb_mode", "disabled", "--output_dir", root,
            "--run_name", run_name,
            # the check before the first step is not part of the step
            "--memory_check", "false"]


def seconds_per_step(run_dir: str) -> list[float]:
    """Seconds per step of each logged window of a run but the first (warm-up), from the trainer's own img/s."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        windows = [r for r in map(json.loads, f) if "img_per_s" in r]
    images_per_step = 4 * RANKS  # the demo's --batch_size x ranks (no accumulation)
    return [images_per_step / r["img_per_s"] for r in windows[1:]]


def unit_split(vae: torch.nn.Module) -> tuple[int, int]:
    """(U, R): the trained parameters in FSDP's units (gathered twice a step) and in the root's group (once)."""
    units = vae.shard_units()
    in_units = {id(p) for u in units for p in u.parameters() if p.requires_grad}
    trained = [p for p in vae.parameters() if p.requires_grad]
    u = sum(p.numel() for p in trained if id(p) in in_units)
    return u, sum(p.numel() for p in trained) - u


def bytes_per_rank(u: int, r: int, n: int, kind: str, per_node: int = GPUS_PER_NODE) -> dict[str, float]:
    """Bytes one rank sends per step: {link: bytes}, 'intra' within a node, 'inter' across nodes (fp32)."""
    p = 4 * (u + r)
    if kind == "ddp":
        return {"all": 2 * (n - 1) / n * p}
    fsdp = lambda ranks: (ranks - 1) / ranks * 4 * (3 * u + 2 * r)  # noqa: E731
    if kind == "fsdp":
        return {"all": fsdp(n)}
    nodes = n // per_node  # hsdp: shards within a node, replicas across nodes
    return {"intra": fsdp(per_node), "inter": 2 * (nodes - 1) / nodes * p / per_node}


def comm_seconds(traffic: dict[str, float], n: int) -> float:
    """The time of that traffic if nothing overlaps it: within a node over NVLink, across nodes over InfiniBand
    (a ring over every rank of several nodes is as fast as its inter-node hops)."""
    multi_node = n > GPUS_PER_NODE
    total = 0.0
    for link, b in traffic.items():
        bw = NVLINK_GBPS if link == "intra" or (link == "all" and not multi_node) else IB_GBPS
        total += b / (bw * 1e9)
    return total


def ltx2_counts() -> dict[str, tuple[int, int]]:
    """LTX-2's VAE on the meta device: {recipe: (U, R)} for the whole VAE and for a decoder-only fine-tune."""
    import diffusers_ae
    name = "AutoencoderKLLTX2Video"
    with torch.device("meta"):
        config = dict(diffusers_ae.diffusers_class(name)().config)
        vae = diffusers_ae.DiffusersAutoEncoder(diffusers_ae.DiffusersParams.of(name, config))
    out = {"whole VAE": unit_split(vae)}
    for pname, p in vae.named_parameters():
        p.requires_grad_(".decoder." in f".{pname}")
    out["decoder only"] = unit_split(vae)
    return out


def bench_sharding_measured(args, tmp: str, report: Report) -> dict:
    import shards
    root = os.path.join(tmp, "sharding")
    shards.ensure_demo_shards(os.path.join(root, "demo_data"))  # once, before the timed runs
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    for k in range(args.sharding_rounds):
        for kind in (("ddp", "fsdp"), ("fsdp", "ddp"))[k % 2]:
            run_name = f"{kind}_{k}"
            cmd = run_command(kind, args.sharding_steps, root, run_name)
            report.line(f"  round {k + 1}: torchrun --standalone --nproc_per_node {RANKS} vae_trainer.py "
                        f"{' '.join(cmd[cmd.index('--demo'):])}")
            proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"sharding run {run_name} failed (exit {proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr)[-3000:]}")
            times[kind] += seconds_per_step(os.path.join(root, run_name))
    from checkpoint import load_model
    vae, _ = load_model(os.path.join(root, "ddp_0"))
    u, r = unit_split(vae)
    out = {"steps": args.sharding_steps, "rounds": args.sharding_rounds, "ranks": RANKS, "params": u + r,
           "units_params": u, "root_params": r,
           "ddp_s_per_step": statistics.median(times["ddp"]), "fsdp_s_per_step": statistics.median(times["fsdp"]),
           "windows": times, "load_average": list(os.getloadavg())}
    out["fsdp_over_ddp"] = out["fsdp_s_per_step"] / out["ddp_s_per_step"]
    traffic = {kind: bytes_per_rank(u, r, RANKS, kind)["all"] for kind in ("ddp", "fsdp")}
    report.table(f"Measured: the demo's model ({(u + r) / 1e6:.2f}M parameters, {u / (u + r):.1%} in FSDP's units), "
                 f"{RANKS} ranks, gloo, 1 thread each, {args.sharding_steps} steps per run, {args.sharding_rounds} "
                 f"round(s); median s/step of the logged windows after the first",
                 ["sharding", "s/step", "x ddp", "KiB sent per rank per step (model)"],
                 [["ddp", out["ddp_s_per_step"], 1.0, traffic["ddp"] / 1024],
                  ["fsdp", out["fsdp_s_per_step"], out["fsdp_over_ddp"], traffic["fsdp"] / 1024]])
    return out


def bench_sharding_model(report: Report) -> dict:
    counts = ltx2_counts()
    out, rows = {}, []
    for recipe, (u, r) in counts.items():
        for n in (8, 16):
            for kind in ("ddp", "fsdp") + (("hsdp",) if n > GPUS_PER_NODE else ()):
                traffic = bytes_per_rank(u, r, n, kind)
                seconds = comm_seconds(traffic, n)
                over = n if kind == "fsdp" else GPUS_PER_NODE if kind == "hsdp" else 1
                state_gib = 20 * (u + r) / over / 2 ** 30
                links = " + ".join(f"{b / 1e9:.2f} {'NVLink' if k == 'intra' or (k == 'all' and n <= 8) else 'IB'}"
                                   for k, b in traffic.items())
                out[f"{recipe}|{n}|{kind}"] = {"params": u + r, "bytes": traffic, "seconds": seconds,
                                               "state_gib_per_rank": state_gib}
                rows.append([f"{recipe} ({(u + r) / 1e9:.2f}B)", n, kind, links, seconds * 1e3, state_gib])
    report.table(f"Model: LTX-2's VAE (diffusers' AutoencoderKLLTX2Video), fp32 weights and gradients; GB sent per "
                 f"GPU per step and its time if nothing overlaps it (NVLink {NVLINK_GBPS:.0f} GB/s, InfiniBand NDR "
                 f"{IB_GBPS:.0f} GB/s per GPU; 8 GPUs: one node, 16: two); state: 20 bytes per trained parameter / "
                 f"shards",
                 ["trained", "GPUs", "sharding", "GB per GPU per step", "comm ms", "state GiB/GPU"], rows)
    return out


def bench_sharding(args, tmp: str, report: Report) -> dict:
    report.line("\n== sharding: --sharding fsdp against ddp, measured on this CPU and modelled for LTX-2's VAE ==")
    return {"measured": bench_sharding_measured(args, tmp, report), "model": bench_sharding_model(report)}
