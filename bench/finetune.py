"""The finetune section: peak memory and step time of a decoder-only fine-tune (--train_parts decoder) against
training the whole VAE at 512 px, each case in a fresh process (the memory section's cases)."""
from __future__ import annotations

from bench.harness import MEMORY_CONFIG
from bench.memory import spawn_memory_case
from bench.report import Report, percent


FINETUNE_CASES = {  # name: Config overrides
    "full": dict(train_parts="all"),
    "decoder": dict(train_parts="decoder"),
    "decoder+decoder_hr": dict(train_parts="decoder", grad_checkpointing="decoder_hr"),
    "decoder+decoder_hr+bf16": dict(train_parts="decoder", grad_checkpointing="decoder_hr", precision="bf16"),
}


def bench_finetune(args, url, tmp, device, report: Report) -> dict:
    """--train_parts decoder vs the whole VAE at 512 px, one fresh process per case (as the memory section). The
    encoder is random here (no --init_from): memory and time do not depend on the weight values."""
    config = dict(MEMORY_CONFIG, vae_ch=args.memory_ch, vae_resolution=512, posterior="learned")
    cases = {}
    for name, overrides in FINETUNE_CASES.items():
        report.line(f"  finetune case {name} at 512 px (fresh process) ...")
        cases[name] = spawn_memory_case({"device": str(device), "threads": args.threads, "url": url,
                                         "output_dir": tmp, "run_name": f"finetune_{name}", "steps": args.memory_steps,
                                         "overrides": dict(config, **overrides)})
    full = cases["full"]
    out = {"config": {**config, "lpips": True, "channels_last": True}, "device": device.type, "cases": {}}
    rows = []
    for name, c in cases.items():
        entry = {**c, "step_time_s": c["step_s"][-1], "saving_increase": 1 - c["increase_mib"] / full["increase_mib"],
                 "saving_total": 1 - c["peak_mib"] / full["peak_mib"]}
        out["cases"][name] = entry
        rows.append([name, c["before_mib"], c["peak_mib"], c["increase_mib"], percent(entry["saving_increase"]),
                     percent(entry["saving_total"]), entry["step_time_s"]])
    report.table(f"Decoder-only fine-tuning vs full training ({device.type}; ch {config['vae_ch']} x "
                 f"{config['vae_ch_mult']}, {config['vae_num_res_blocks']} blocks, learned posterior, 512 px, batch 1, "
                 f"LPIPS; MiB)", ["case", "before", "peak", "increase", "saving (incr.)", "saving (peak)", "s/step"],
                 rows)
    report.line("  peak: " + ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
                              "peak RSS (VmHWM) of the case's process: CPU memory, not a GPU measurement") +
                "; increase = peak - memory in use before the first step")
    return out
