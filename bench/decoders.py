"""The decoders section (issue 25): FLUX.2's decoder against BFL's small one, random weights: FLOPs per image
(counted on fake tensors), and wall time and peak memory of a decode, each in a fresh process
(`bench.py --_decode_case`)."""
from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import time

import torch

from bench.harness import HERE, LAUNCHER
from config import Precision
from bench.machine import cpu_model, current_rss, mib, peak_rss, synchronize
from bench.report import Report, median


# FLUX.2's VAE (diffusers' AutoencoderKLFlux2 defaults, BFL's ae.safetensors): the LDM layout at 128,256,512,512
# behind 32 latent channels, quant convs and the bn statistics; BFL's small decoder has widths 96,192,384,384.
FLUX2_PARAMS = dict(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=32, posterior="learned",
                    quant_conv=True, latent_bn=True)
FLUX2_SMALL_DECODER = (96, 192, 384, 384)


def flop_counter():
    """torch's FlopCounterMode (convolutions, matmuls, attention: 2 FLOPs per multiply-add), also counting the
    CPU kernel of scaled_dot_product_attention, which torch's table leaves out (on CUDA it counts the flash and
    efficient kernels), so a count is the same on every device."""
    from torch.utils import flop_counter as fc

    def sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(query_shape, key_shape, value_shape)
    return fc.FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flops})


def decode_flops(params, latent_shape: tuple[int, ...]) -> dict[str, float]:
    """FLOPs of one AutoEncoder.decode (post_quant_conv and the decoder) of a latent of `latent_shape`, counted on
    fake tensors: exact, no compute, no memory, independent of the machine. {"total", "attention"}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ae import AutoEncoder
    with FakeTensorMode():
        vae = AutoEncoder(params)
        z = torch.empty(*latent_shape)
        with flop_counter() as counter, torch.no_grad():
            vae.decode(z)
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for k, v in counts.items() if "attention" in str(k))
    return {"total": float(counter.get_total_flops()), "attention": float(attention)}


def decoder_parameters(params) -> int:
    """Parameters the decode runs through: post_quant_conv (where the model has it) and the decoder."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ae import AutoEncoder
    with FakeTensorMode():
        vae = AutoEncoder(params)
        modules = [vae.decoder] + ([vae.post_quant_conv] if params.quant_conv else [])
        return sum(p.numel() for m in modules for p in m.parameters())


def run_decode_case(case: dict) -> dict:
    """One decoder's decode in this (fresh) process: the encoder dropped (only what a decode runs is in memory),
    random weights, a random latent; `reps` timed decodes after `warmup` untimed ones (and one small decode that
    loads the kernels). Memory: CUDA's max_memory_allocated, else the process's peak RSS (VmHWM)."""
    from ae import AutoEncoder, AutoEncoderParams
    device = torch.device(case["device"])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    params = AutoEncoderParams.from_dict(case["params"])
    torch.manual_seed(0)
    vae = AutoEncoder(params)
    vae.encoder = None  # decode only: the encoder's weights (and quant_conv's) are no part of a decode's memory
    if params.quant_conv:
        vae.quant_conv = None
    vae.eval().to(device)
    size = case["resolution"] // params.downsample_factor
    z = torch.randn(case["batch"], params.z_channels, size, size, device=device)

    def decode(latent):
        amp = (Precision.of("bf16").autocast(device.type) if case["precision"] == "bf16"
               else contextlib.nullcontext())
        with torch.inference_mode(), amp:
            out = vae.decode(latent)
        synchronize(device)
        return out

    decode(z[..., :8, :8])
    for _ in range(case["warmup"]):
        decode(z)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = current_rss()
    times = []
    for _ in range(case["reps"]):
        synchronize(device)
        t0 = time.perf_counter()
        out = decode(z)
        times.append(time.perf_counter() - t0)
        del out
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss()
    weights = sum(p.numel() * p.element_size() for p in vae.parameters() if p is not None)
    return {"decode_s": times, "before_mib": mib(before), "peak_mib": mib(peak), "increase_mib": mib(peak - before),
            "weights_mib": mib(weights), "threads": torch.get_num_threads()}


def spawn_decode_case(case: dict) -> dict:
    cmd = [sys.executable, LAUNCHER, "--_decode_case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"decode case {case['name']} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_decoders(args, device, report: Report) -> dict:
    """FLUX.2's decoder (128,256,512,512) against BFL's small one (96,192,384,384), random weights, batch
    --decode_batch at --decode_resolution: FLOPs per image (fake tensors), and wall time and peak memory per
    decode, each decode in a fresh process, the two variants alternating round by round (rotated order)."""
    from dataclasses import replace

    from ae import AutoEncoderParams
    wide = AutoEncoderParams(**FLUX2_PARAMS)
    variants = {"wide": wide, "narrow": replace(wide, decoder_channels=FLUX2_SMALL_DECODER)}
    res, batch = args.decode_resolution, args.decode_batch
    latent = (1, wide.z_channels, res // wide.downsample_factor, res // wide.downsample_factor)
    flops = {name: decode_flops(p, latent) for name, p in variants.items()}
    n_params = {name: decoder_parameters(p) for name, p in variants.items()}
    cuda = device.type == "cuda"
    precisions = args.decode_precision or (["fp32", "bf16"] if cuda else ["fp32"])
    reps, warmup = (10, 3) if cuda else (1, 0)  # on a CPU one 1024 px decode of the wide decoder takes minutes
    runs = {f"{name}_{precision}": [] for precision in precisions for name in variants}
    names = list(runs)
    for r in range(args.decode_rounds):
        for key in names[r % len(names):] + names[:r % len(names)]:
            name, precision = key.rsplit("_", 1)
            report.line(f"  round {r + 1}/{args.decode_rounds}: {name} decoder, {precision}, {res} px, batch {batch} "
                        "(fresh process) ...")
            runs[key].append(spawn_decode_case({
                "name": key, "device": str(device), "threads": args.threads, "params": variants[name].to_dict(),
                "resolution": res, "batch": batch, "precision": precision, "reps": reps, "warmup": warmup}))
    out = {"resolution": res, "batch": batch, "device": device.type, "rounds": args.decode_rounds,
           "reps_per_round": reps, "warmup_per_round": warmup, "variants": {}, "runs": {}}
    rows = []
    for key, cases in runs.items():
        name, precision = key.rsplit("_", 1)
        times = [t for c in cases for t in c["decode_s"]]
        entry = {"decoder_channels": list(variants[name].decoder_widths), "decoder_params": n_params[name],
                 "gflop_per_image": flops[name]["total"] / 1e9, "attention_gflop": flops[name]["attention"] / 1e9,
                 "median_s_per_image": median(times) / batch, "decode_s": [round(t, 4) for t in times],
                 "peak_mib": max(c["peak_mib"] for c in cases), "increase_mib": max(c["increase_mib"] for c in cases),
                 "before_mib": median([c["before_mib"] for c in cases]), "weights_mib": cases[0]["weights_mib"],
                 "threads": cases[0]["threads"]}
        out["runs"][key] = entry
    for precision in precisions:
        w, n = out["runs"][f"wide_{precision}"], out["runs"][f"narrow_{precision}"]
        out["variants"][precision] = {
            "flop_ratio": n["gflop_per_image"] / w["gflop_per_image"],
            "time_ratio": n["median_s_per_image"] / w["median_s_per_image"],
            "peak_ratio": n["peak_mib"] / w["peak_mib"], "increase_ratio": n["increase_mib"] / w["increase_mib"]}
        for name, e in (("wide", w), ("narrow", n)):
            ratio = (lambda k: f"{n[k] / w[k]:.3f}x") if name == "narrow" else (lambda k: "1x")
            rows.append([name, precision, ",".join(map(str, e["decoder_channels"])), e["decoder_params"] / 1e6,
                         e["gflop_per_image"], ratio("gflop_per_image"), e["median_s_per_image"],
                         f"{min(e['decode_s']) / batch:.3g}-{max(e['decode_s']) / batch:.3g}", ratio("median_s_per_image"),
                         e["peak_mib"], e["increase_mib"], ratio("increase_mib")])
    memory = "torch.cuda.max_memory_allocated" if cuda else "peak RSS (VmHWM) of the process"
    report.table(f"FLUX.2 decoders, random weights, decode of a 1x{latent[1]}x{latent[2]}x{latent[3]} latent "
                 f"({res} px), batch {batch}, {device.type} "
                 f"({torch.cuda.get_device_name(device) if cuda else cpu_model()}, "
                 f"{out['runs'][names[0]]['threads']} threads); {args.decode_rounds} rounds x {reps} decodes",
                 ["decoder", "precision", "widths", "M params", "GFLOP/img", "x wide", "median s/img", "range s",
                  "x wide", "peak MiB", "decode MiB", "x wide"], rows)
    report.line(f"  GFLOP: FlopCounterMode on fake tensors (attention included: wide "
                f"{flops['wide']['attention'] / 1e9:.0f}, narrow {flops['narrow']['attention'] / 1e9:.0f}); peak: "
                f"{memory}; decode MiB = peak - memory in use before the decode (weights and latent)")
    return out
