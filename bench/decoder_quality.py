"""The decoder_quality section (issue 25): what the teacher buys a narrower decoder, every step a real command (the
demo as the "released" wide VAE, export.py, decoder-only runs behind its frozen encoder, evaluate.py), and the grid
of their held-out reconstructions."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
from PIL import Image

import config as config_lib
import flags as flags_lib
import shards
from bench.decoders import decode_flops, decoder_parameters
from bench.harness import trainer_argv
from bench.report import Report
from bench.runs import final_eval, run_logged, wait_logged
from weights import vgg16_cache_path


# quality: the demo's model as the "released" wide VAE, then decoders trained behind its frozen encoder
DECODER_QUALITY_VARIANTS = ("wide_finetuned", "narrow_teacher", "narrow")


def decoder_quality_flags(vgg: str) -> dict:
    """The demo's recipe (flags_lib.DEMO) for a decoder-only run, without its architecture (--init_from's) and its
    learning rate (the trainer's rule: a new decoder's rate for a fresh one, a tenth for a fine-tune): pixel losses
    only without pretrained VGG16 (as the demo), LPIPS and the critic with them."""
    demo = flags_lib.DEMO
    keep = ("vae_resolution", "batch_size", "shuffle_buffer", "warmup_steps", "mse_pool_factor", "mse_weight",
            "ema_decay", "eval_max_images")
    flags = {k: demo[k] for k in keep}
    if vgg == "torchvision":
        flags.update({k: demo[k] for k in ("perceptual_weight", "do_ganloss", "disc_start", "gan_weight")})
    else:
        flags.update(perceptual_weight=0.0, do_ganloss=False)
    return flags


def reconstruction_rows(grid_png: str, tile: int, pad: int = 2) -> list[Image.Image]:
    """The rows of evaluate.py's reconstructions.png (torchvision make_grid: inputs, then reconstructions)."""
    grid = Image.open(grid_png).convert("RGB")
    rows = (grid.height - pad) // (tile + pad)
    return [grid.crop((0, pad + i * (tile + pad), grid.width, pad + i * (tile + pad) + tile)) for i in range(rows)]


def labelled_grid(rows: list[tuple[str, Image.Image]], scale: int = 3, label_width: int = 150) -> Image.Image:
    """Rows of images, each enlarged `scale` x (nearest: the pixels as they are), a label on the left."""
    from PIL import ImageDraw, ImageFont
    try:
        font = ImageFont.load_default(size=15)  # Pillow >= 10.1 with FreeType
    except (TypeError, OSError, ImportError):
        font = ImageFont.load_default()
    rows = [(label, row.resize((row.width * scale, row.height * scale), Image.Resampling.NEAREST))
            for label, row in rows]
    gap = 4
    out = Image.new("RGB", (label_width + max(r.width for _, r in rows),
                            sum(r.height + gap for _, r in rows) - gap), "white")
    draw, y = ImageDraw.Draw(out), 0
    for label, row in rows:
        out.paste(row, (label_width, y))
        for i, line in enumerate(label.split("\n")):
            draw.text((6, y + row.height // 2 - 18 + 18 * i), line, fill="black", font=font)
        y += row.height + gap
    return out


def bench_decoder_quality(args, tmp, report: Report) -> dict:
    """A narrower decoder trained with and without the teacher, against the wide decoder, at equal steps: every
    step a real command. The demo's model trained --wide_steps steps (`vae_trainer.py --demo`) is the "released"
    wide VAE, exported as a diffusers folder (`export.py --ema`) so that it serves as --init_from; then, behind its
    frozen encoder (--train_parts decoder), --decoder_steps steps each of: the wide decoder fine-tuned; a decoder of
    --narrow_widths started fresh with --distill_weight 1; the same without. Held-out PSNR/SSIM by `evaluate.py`
    (EMA weights) on the demo's 4 held-out photos at 64 px, and a grid of their reconstructions."""
    from dataclasses import replace

    import families
    root = args.decoder_runs_dir or os.path.join(tmp, "decoder_quality")
    os.makedirs(root, exist_ok=True)
    threads = args.threads or os.cpu_count()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    vgg = "torchvision" if os.path.isfile(vgg16_cache_path()) else "random"
    widths = [int(w) for w in args.narrow_widths.split(",")]
    seeds = [int(s) for s in args.decoder_seeds.split(",")]
    wall = {}

    # 1. the "released" wide VAE: the demo (its model and recipe) for --wide_steps steps, exported with its EMA
    steps = args.wide_steps
    report.line(f"  training the wide VAE: python vae_trainer.py --demo --max_steps {steps} ... (log in {root})")
    wide = run_logged([sys.executable, "vae_trainer.py", "--demo", "--max_steps", str(steps), "--output_dir", root,
                       "--run_name", "wide", "--save_every_n_steps", str(steps), "--evaluate_every_n_steps",
                       str(steps), "--inception_weights", "none", "--wandb_mode", "disabled", "--seed",
                       str(args.seed)], os.path.join(root, "wide.log"), env)
    wall.update(wait_logged({"train wide": wide}))
    train_url, test_url = shards.ensure_demo_shards(os.path.join(root, "demo_data"))  # built by the demo run
    released = os.path.join(root, "wide_vae")
    wall.update(wait_logged({"export wide": run_logged(
        [sys.executable, "export.py", "--ckpt", os.path.join(root, "wide"), "--ema", "--out", released,
         "--format", "diffusers"], os.path.join(root, "export.log"), env)}))

    # 2. decoders behind its frozen encoder, concurrently (one thread each: the same load for all)
    common = dict(decoder_quality_flags(vgg), init_from=released, train_parts="decoder", dataset_url=train_url,
                  test_dataset_url=test_url, max_steps=args.decoder_steps, save_every_n_steps=args.decoder_steps,
                  evaluate_every_n_steps=args.decoder_steps, log_every_n_steps=50, vgg16_weights=vgg,
                  inception_weights="none", wandb_mode="disabled", num_workers=1, num_threads=1, output_dir=root)
    narrow = dict(vae_decoder_ch=",".join(map(str, widths)), decoder_init="fresh")
    variant_flags = {"wide_finetuned": {}, "narrow_teacher": dict(narrow, distill_weight=1.0), "narrow": narrow}
    procs = {}
    for seed in seeds:
        for name in DECODER_QUALITY_VARIANTS:
            run = f"{name}_s{seed}"
            argv = trainer_argv({**common, **variant_flags[name], "seed": seed, "run_name": run})
            procs[run] = run_logged([sys.executable, "vae_trainer.py", *argv], os.path.join(root, f"{run}.log"),
                                    {**env, "OMP_NUM_THREADS": "1"})
    report.line(f"  training {len(procs)} decoders concurrently, {args.decoder_steps} steps each: "
                f"{', '.join(procs)} ...")
    wall.update(wait_logged({f"train {run}": proc for run, proc in procs.items()}))

    # 3. held-out PSNR/SSIM by evaluate.py, and the reconstructions' grid
    lpips_weights = "torchvision" if vgg == "torchvision" else "none"
    evaluated = {}
    for run, ckpt, ema in [("wide_released", released, False)] + [(run, os.path.join(root, run), True)
                                                                     for run in procs]:
        out_dir = os.path.join(root, "eval", run)
        cmd = [sys.executable, "evaluate.py", "--ckpt", ckpt, "--dataset_url", test_url, "--resolution",
               str(common["vae_resolution"]), "--vgg16_weights", lpips_weights, "--inception_weights", "none",
               "--out", out_dir] + (["--ema"] if ema else [])
        wall.update(wait_logged({f"evaluate {run}": run_logged(cmd, os.path.join(root, f"eval_{run}.log"), env)}))
        with open(os.path.join(out_dir, "metrics.json")) as f:
            evaluated[run] = json.load(f)

    # 4. what each decoder costs at this size, and what the runs were
    source = families.load_source(released)
    size = common["vae_resolution"] // source.params.downsample_factor
    latent = (1, source.params.z_channels, size, size)
    narrow_params = replace(source.params, decoder_channels=tuple(widths))
    flops = {"wide": decode_flops(source.params, latent)["total"], "narrow": decode_flops(narrow_params, latent)["total"]}
    n_params = {"wide": decoder_parameters(source.params), "narrow": decoder_parameters(narrow_params)}
    out = {"config": {"wide_steps": args.wide_steps, "decoder_steps": args.decoder_steps, "seeds": seeds,
                      "narrow_widths": widths, "wide_widths": list(source.params.decoder_widths), "vgg16_weights": vgg,
                      "lpips": lpips_weights != "none", "flags": common, "held_out": list(shards.DEMO_TEST),
                      "resolution": common["vae_resolution"]},
           "decode_gflop": {k: v / 1e9 for k, v in flops.items()}, "decoder_params": n_params,
           "flop_ratio": flops["narrow"] / flops["wide"], "wall_s": wall, "runs": {}}
    rows = []
    for run, metrics in evaluated.items():
        kind = "wide" if run.startswith("wide") else "narrow"
        entry = {"psnr": metrics["psnr"], "ssim": metrics["ssim"], "lpips": metrics.get("lpips"),
                 "n_images": metrics["n_images"], "ema": metrics["ema"]}
        if run != "wide_released":
            with open(os.path.join(root, run, "config.json")) as f:
                entry["learning_rate_vae"] = json.load(f)["learning_rate_vae"]
            final = final_eval(os.path.join(root, run))  # the trainer's own last evaluation, of the raw weights
            entry.update(raw_psnr=final.get("eval/psnr"), raw_ssim=final.get("eval/ssim"))
        out["runs"][run] = entry
        rows.append([run, ",".join(map(str, widths if kind == "narrow" else source.params.decoder_widths)),
                     n_params[kind] / 1e3, f"{flops[kind] / flops['wide']:.3f}x",
                     0 if run == "wide_released" else args.decoder_steps, entry.get("learning_rate_vae", "-"),
                     f"{entry['psnr']:.2f}", f"{entry['ssim']:.3f}",
                     f"{entry['raw_psnr']:.2f}" if "raw_psnr" in entry else "-",
                     f"{entry['raw_ssim']:.3f}" if "raw_ssim" in entry else "-"])
    report.table(f"Narrower decoders behind the demo VAE's frozen encoder (the demo trained {args.wide_steps} steps, "
                 f"EMA exported); {len(shards.DEMO_TEST)} held-out photos at {common['vae_resolution']} px, "
                 f"evaluate.py --ema; VGG16 {vgg}",
                 ["run", "decoder widths", "k params", "decode FLOPs", "steps", "lr", "PSNR dB", "SSIM",
                  "PSNR raw", "SSIM raw"], rows)
    for seed in seeds:
        r = out["runs"]
        out[f"teacher_psnr_gain_s{seed}"] = r[f"narrow_teacher_s{seed}"]["psnr"] - r[f"narrow_s{seed}"]["psnr"]
        out[f"teacher_ssim_gain_s{seed}"] = r[f"narrow_teacher_s{seed}"]["ssim"] - r[f"narrow_s{seed}"]["ssim"]
    for metric in ("psnr", "ssim"):
        out[f"teacher_{metric}_gain_mean"] = float(np.mean([out[f"teacher_{metric}_gain_s{s}"] for s in seeds]))
    report.line("  teacher's gain (narrow + teacher - narrow): " + ", ".join(
        f"seed {s} {out[f'teacher_psnr_gain_s{s}']:+.2f} dB, SSIM {out[f'teacher_ssim_gain_s{s}']:+.3f}" for s in seeds))
    report.line("  wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    if args.decoder_grid:
        tile = common["vae_resolution"]
        labels = {"wide_released": "wide, released\n(the teacher)", "wide_finetuned": "wide, decoder\nfine-tuned",
                  "narrow_teacher": f"{','.join(map(str, widths))}\n+ teacher",
                  "narrow": f"{','.join(map(str, widths))}\nwithout teacher"}
        grid_rows = [("input", reconstruction_rows(os.path.join(root, "eval", "wide_released", "reconstructions.png"),
                                                   tile)[0])]
        for run in [r for r in evaluated if r == "wide_released" or r.endswith(f"_s{seeds[0]}")]:
            label = labels[run if run == "wide_released" else run.rsplit("_s", 1)[0]]
            grid_rows.append((label, reconstruction_rows(os.path.join(root, "eval", run, "reconstructions.png"),
                                                         tile)[1]))
        os.makedirs(os.path.dirname(os.path.abspath(args.decoder_grid)), exist_ok=True)
        labelled_grid(grid_rows).save(args.decoder_grid, optimize=True)
        report.line(f"  grid of the held-out reconstructions: {args.decoder_grid}")
        out["grid"] = args.decoder_grid
    return out
