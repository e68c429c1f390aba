"""Speed and memory benchmarks of the VAE trainer and its input pipeline, in one run.

    python bench.py --quick --json     # under two minutes on 2 idle CPU cores; one JSON object on stdout
    python bench.py                    # the full run: 8-10 minutes on 2 idle CPU cores
    python bench.py --sections train --config flux --gan    # one section, another model size

Sections
  data    One data worker's img/s (in-process, one torch thread, as inside a DataLoader worker), on
          shards of generated photo-like PNG and JPEG (quality 90) images, 768x1024 by default:
            decode    the raw PIL decode of the same tar members' bytes (Image.open + load), nothing else;
            ours      data.TrainLoader(num_workers=0) producing batches of 256x256 uint8 crops;
            naive     decode -> whole image to a float tensor (ToTensor + Normalize) -> random crop 256,
                      like the reference trainer.
          Every reader streams the same tar files, so all see the same bytes and the same image count.
  train   img/s of the real Trainer.train_step() (LPIPS, GradNorm, EMA, guarded AdamW; --gan adds the
          VGG16 discriminator) for each speed switch. The baseline is the step as the reference trainer
          runs it: contiguous (NCHW) tensors, eager, fp32, and a host sync per loss (.item() on every
          scalar the step logs, done here by wrapping trainer.metrics.add; the trainer is unchanged).
          Batches are real crops held in memory, so the data pipeline is not part of the step time.
  memory  Peak memory and step time of each --grad_checkpointing level at 256 and 512 px, each case in a
          fresh process (so one case's peak cannot hide another's); the time cost of decoder_hr is
          measured again in one process with the two levels interleaved. Also the activation memory
          each part of the model saves for backward (counted with saved-tensor hooks).
  finetune  (only when named in --sections) Peak memory and step time of a decoder-only fine-tune (--train_parts decoder: the encoder frozen,
          under no_grad) vs training the whole VAE, at 512 px, FLUX layout at --memory_ch, each case in a fresh
          process: full, decoder, decoder + --grad_checkpointing decoder_hr, and that in bf16.
  gpu     CUDA only: issue 30's table. For each size of --gpu_sizes (FLUX width at 256 px batch 8, the reference
          launcher's ch 64 at 256 px batch 12, FLUX width at 512 px batch 2) and each case of GPU_CASES, in a fresh
          process, 3 warm-up steps then the median of --gpu_steps: the reference's habits on our modules (bf16
          autocast with GroupNorm left to autocast, LPIPS and the trainable critic in fp32 with TF32, NCHW, .item()
          calls), eager and compiled; ours in bf16 with the frozen trunk (NCHW and channels_last, eager and compiled,
          the eager one also under the profiler: the share of CUDA time in aten::copy_), the README's default command,
          and strict fp32 (the old default). Compiled cases only at --gpu_compile_sizes.
  copies  The copy, cast and layout traffic of one step (CopyCensus: ops and bytes at the dispatcher, with the copies
          CUDA's GroupNorm and cuDNN make inside themselves added by their layout rules), FLUX width at 128 px, for
          fp32/bf16 x NCHW/channels_last; and the CPU's bf16 step with today's GroupNorm and the fp32-copy one.
  precision (only when named in --sections) Does fp32 with TF32 (emulated: TF32Emulation) or bf16 train as well as
          strict fp32: `vae_trainer.py --demo` runs of --precision_steps steps for each seed of --precision_seeds,
          held-out PSNR/SSIM at every evaluation.
  latents (only when named in --sections) What each latent feature of issue 20 costs per step, on the demo's
          model (ch 32 x 1,2,2, z 4, 64 px, batch 4; LPIPS on, no critic, fp32): the real Trainer's step with
          nothing, --scale_equivariance_prob 0.5, --latent_noise_prob 0.5, --vf_weight with DINOv2 ViT-S/14 at
          112 px and with VA-VAE's ViT-L/14 at 224 px (random weights: the cost does not depend on them),
          FLOPs per step and interleaved wall clock; and one in-loop probe call (--probe_steps and
          --probe_batch_size at their defaults, on --images of the bench's shards (32: a quarter held out) instead of
          the default 64, the EMA copy included), in seconds and per step at every 1000 steps.
  quality (--quality; not in the default run) Three real `vae_trainer.py` trainings, run concurrently (one
          --threads each), of the same small f8 VAE
          (ch 32 x 1,2,4,4, z 16, 128 px, batch 4, with the GAN), on the same photos (the demo's 12 bundled
          photos), seed and number of steps (--quality_steps, 400): our defaults, the reference trainer's
          hyperparameters written with our flags (bench.reference_flags), and plain MSE with the reference's
          learning rate (the floor). Held-out PSNR/SSIM/LPIPS from each run's final evaluation on the 4
          held-out photos. VGG16 is the pretrained one when torchvision's cache has it, else random for all.
  decoders (only when named in --sections) FLUX.2's decoder (widths 128,256,512,512 behind 32 latent channels and
          quant convs) against BFL's small one (96,192,384,384), random weights, one decode of a 1024 px image
          (--decode_resolution, --decode_batch): FLOPs per image (FlopCounterMode on fake tensors, attention
          included), wall time and peak memory, each decode in a fresh process (the encoder dropped), the two
          alternating for --decode_rounds rounds. CPU: fp32, one timed decode per round, peak RSS; CUDA: fp32 and
          bf16, 3 warm-up and 10 timed decodes per round, torch.cuda.max_memory_allocated.
  decoder_quality (only when named in --sections) What the teacher buys a narrower decoder, with real commands
          (a --decoder_runs_dir that holds finished runs resumes them: only what is missing trains):
          `vae_trainer.py --demo --max_steps N` (N: --wide_steps) is the "released" wide VAE, `export.py --ema
          --format diffusers` makes it an --init_from source; behind its frozen encoder (--train_parts decoder) three runs of
          --decoder_steps steps each, concurrently (one thread each): the wide decoder fine-tuned, a decoder of
          --narrow_widths started fresh with --distill_weight 1, and without; `evaluate.py --ema` on the demo's 4
          held-out photos at 64 px (PSNR, SSIM; LPIPS with pretrained VGG16 only); --decoder_grid writes their
          reconstructions as one PNG.

  resolutions (only when named in --sections) Train at one size or several, serve at larger ones (issue 26), with
          real commands: three `vae_trainer.py --demo --max_steps N` runs (N: --res_steps), concurrently, one thread
          each, the same photos, seed and pixels per step: at 64 px alone; with --train_resolutions 64,96,128 (the
          batch scaled to the pixels: 4, 2, 1 images); and staged (64 px, then 96,128 from 2N/3 with
          --last_stage_trains 1). `evaluate.py --ema` of each at 64, 128 and 256 px (1x, 2x, 4x) on the demo's held-out
          photos and on --res_heldout_url (e.g. mate-backgrounds' nature photos as shards): PSNR, SSIM, LPIPS (random
          VGG16 without the pretrained weights: say so), seconds per step. Then whether the aspect of an input changes
          what the 64 px model reconstructs (aspect_study): the same 64x64 region of each held-out photo given as a
          square, inside a 64x96 and a 96x64 input, and inside the whole photo at 96 px on its shorter side.

Headline keys of --json (the target each is checked against)
  pipeline_fraction_of_decode  PNG: our loader's img/s / the raw decode's img/s            (>= 0.90)
  train_step_speedup           img/s with every speed switch on (no host syncs, channels_last, and
                               compile when measured; fp32) / the reference step's img/s  (>= 1.3)
  ckpt_memory_saving_512       1 - peak increase(decoder_hr) / peak increase(none), 512 px (>= 0.50)
  ckpt_time_cost_512           step time(decoder_hr) / step time(none) - 1, 512 px, the two
                               interleaved in one process, fastest steps               (<= 0.30)
  gpu_eager_speedup_flux_256   CUDA only: img/s of ours (bf16, frozen trunk, eager) / the reference's habits,
                               eager (>= 1.6); gpu_compiled_speedup_* both compiled (>= 2.0); gpu_default_speedup_*
                               the README's command / the reference eager (>= 1.0); gpu_copy_fraction_* aten::copy_'s
                               share of CUDA time (<= 0.10); gpu_peak_ratio_* peak memory / the reference's (<= 0.6)
  copies_activation_mib_<case> the census' activation copies and casts per step (no target; test_copies.py bounds it)
  precision_tf32_minus_fp32_ema_psnr  held-out EMA PSNR at the last step, TF32 emulated - strict fp32, the worse
                               seed (>= -0.3); precision_bf16_minus_fp32_ema_psnr the same for bf16 (no target)
  gan_step_flop_speedup        --gan: FLOPs of the reference's step / ours (issue 9's step target: >= 1.5)
  gan_step_flop_speedup_frozen --gan: FLOPs of the reference's step / the trainer's own step with
                               --critic_trunk frozen (issue 19)                           (>= 2.0)
  gan_step_wall_speedup_frozen --gan: img/s of that frozen-trunk step (no host syncs, NCHW, fp32) /
                               the reference step's img/s, interleaved in the same rounds  (>= 1.6)
  quality_psnr_over_reference  held-out PSNR, defaults - reference hyperparameters, dB      (>= 3)
  quality_psnr_over_floor      held-out PSNR, defaults - plain MSE, dB                      (>= -1)
  quality_ssim_over_reference, quality_ssim_over_floor  the same for SSIM           (>= 0.03, >= -0.03)
  finetune_decoder_memory_saving_512  1 - peak increase(decoder only) / peak increase(full), 512 px (no target)
  small_decoder_{flop,time,peak,increase}_ratio_<device>_<precision>  decoders: BFL's small decoder / FLUX.2's,
                               FLOPs, median time, peak memory, peak - memory before the decode (no target)
  narrow_decoder_teacher_{psnr,ssim}_gain_s<seed>  decoder_quality: narrow + teacher - narrow (no target)
The peak increase is the peak minus the memory in use right before the first training step, i.e. what
the step itself needs (activations, gradients, optimizer state), the part checkpointing acts on.

Variants are interleaved round by round and medians are reported, because a shared machine's timings are
noisy. LPIPS and the discriminator use randomly initialised VGG16 weights (--vgg16_weights random):
speed and memory do not depend on the weight values.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torch.utils._python_dispatch import TorchDispatchMode

import config as config_lib
import data as data_lib
import shards
import vae_trainer
from common import DistInfo
from weights import vgg16_cache_path

# ----------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------
TRAIN_CONFIGS = {  # --config: the model of the train section
    "tiny": dict(vae_ch=32, vae_ch_mult="1,2,4,4", vae_num_res_blocks=1, vae_resolution=128, batch_size=2),
    "small": dict(vae_ch=64, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, vae_resolution=128, batch_size=2),
    "flux": dict(vae_ch=128, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, vae_resolution=256, batch_size=2),
}
# The memory section: the FLUX layout (its decoder's two highest-resolution levels hold the largest share of
# the activations) at batch 1; --memory_ch 128 is the real FLUX width.
MEMORY_CONFIG = dict(vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, batch_size=1)
FLUX_CONFIG = dict(vae_ch=128, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2)
# Flags every benchmark trainer gets: in-memory batches, no evaluation, no wandb, VGG16 without downloads.
# The quality section (issue 9's configuration): a small f8 VAE trained with the GAN on real photos.
QUALITY_CONFIG = dict(vae_ch=32, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, vae_z_channels=16,
                      vae_resolution=128, batch_size=4, do_ganloss=True)
TRAIN_CONFIGS["quality"] = {k: v for k, v in QUALITY_CONFIG.items() if k != "do_ganloss"}  # with --gan: its step
HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_FLAGS = dict(num_workers=0, shuffle_buffer=2, vgg16_weights="random", wandb_mode="disabled",
                   evaluate_every_n_steps=0, inception_weights="none", num_samples=1, disc_start=0,
                   save_every_n_steps=10**9, log_every_n_steps=10**9, max_steps=10**9)
CKPT_LEVELS = ("none", "decoder_hr", "hr", "decoder", "all")
SECTIONS = ("data", "train", "memory", "gpu", "quality", "finetune", "latents", "decoders", "decoder_quality",
            "resolutions", "copies", "precision")
TARGETS = {  # key: (comparison, threshold)
    "pipeline_fraction_of_decode": (">=", 0.90),
    "train_step_speedup": (">=", 1.3),
    "ckpt_memory_saving_512": (">=", 0.50),
    "ckpt_time_cost_512": ("<=", 0.30),
    "gpu_eager_speedup_flux_256": (">=", 1.6),  # issue 30: bf16, frozen trunk, eager / the reference's eager step
    "gpu_compiled_speedup_flux_256": (">=", 2.0),
    "gpu_default_speedup_flux_256": (">=", 1.0),  # the README's command / the reference's default (eager)
    "gpu_copy_fraction_flux_256": ("<=", 0.10),
    "gpu_peak_ratio_flux_256": ("<=", 0.6),
    "precision_tf32_minus_fp32_ema_psnr": (">=", -0.3),  # the default's quality, step for step (TF32 emulated)
    "gan_step_flop_speedup": (">=", 1.5),
    "gan_step_flop_speedup_frozen": (">=", 2.0),
    "gan_step_wall_speedup_frozen": (">=", 1.6),
    "quality_psnr_over_reference": (">=", 3.0),
    "quality_psnr_over_floor": (">=", -1.0),
    "quality_ssim_over_reference": (">=", 0.03),
    "quality_ssim_over_floor": (">=", -0.03),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a run of about two minutes on 2 otherwise idle CPU cores: fewer images and steps, the "
                        "tiny train config, no compile, the memory cases none, decoder_hr and hr at 512 px only with "
                        "--memory_ch 32, one round of the interleaved checkpointing timing")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (the human tables go to stderr)")
    p.add_argument("--sections", default="data,train,memory,gpu",
                   help="comma-separated subset of " + ",".join(SECTIONS) + " (default: data,train,memory,gpu; "
                        "quality trains for one to two hours on 2 CPU cores, finetune takes ~5 minutes, decoders "
                        "and decoder_quality several; gpu runs on CUDA only)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads for the train and memory sections (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--images", type=int, default=0, help="images per format (default 32; 16 with --quick)")
    g.add_argument("--image_size", default="768x1024", help="HEIGHTxWIDTH of the generated images")
    g.add_argument("--data_batch_size", type=int, default=8)
    g.add_argument("--data_rounds", type=int, default=0, help="interleaved repeats (default 5; 3 with --quick)")
    g = p.add_argument_group("train")
    g.add_argument("--config", choices=tuple(TRAIN_CONFIGS), default=None,
                   help="model of the train section (default small; tiny with --quick). " +
                        "; ".join(f"{k}: ch {v['vae_ch']} x {v['vae_ch_mult']}, {v['vae_num_res_blocks']} res "
                                  f"blocks, {v['vae_resolution']} px, batch {v['batch_size']}"
                                  for k, v in TRAIN_CONFIGS.items()))
    g.add_argument("--gan", action="store_true", help="train with the VGG16 discriminator (from step 0)")
    g.add_argument("--no_compile", action="store_true",
                   help="skip the torch.compile variant (on CPU inductor needs minutes to compile)")
    g.add_argument("--train_rounds", type=int, default=0, help="interleaved rounds (default 8; 5 with --quick)")
    g.add_argument("--gan_flops_only", action="store_true",
                   help="with --gan: only count the GAN step's FLOPs (ours, the reference's way, the frozen trunk), "
                        "no timed rounds: for models whose CPU steps take minutes (--config flux)")
    g.add_argument("--steps_per_round", type=int, default=0,
                   help="timed steps per variant per round (default 1 on CPU, 10 on CUDA)")
    g = p.add_argument_group("memory")
    g.add_argument("--memory_ch", type=int, default=0, help="base channels of the memory config "
                                                            "(default 64; 32 with --quick; 128 = FLUX)")
    g.add_argument("--memory_resolutions", default="", help="default 256,512 (512 with --quick)")
    g.add_argument("--memory_levels", default="",
                   help="--grad_checkpointing levels measured (default all: " + ",".join(CKPT_LEVELS) +
                        "; none,decoder_hr,hr with --quick)")
    g.add_argument("--memory_steps", type=int, default=0,
                   help="steps per memory case (default 2; 1 with --quick); the last one's time is reported")
    g.add_argument("--ckpt_time_rounds", type=int, default=None,
                   help="rounds of the interleaved none/decoder_hr timing at 512 px (default 3; 1 with --quick; "
                        "0: the memory cases' own step times are used)")
    g = p.add_argument_group("gpu")
    g.add_argument("--gpu_batch", type=int, default=8,
                   help="FLUX batch at 256 px; the other sizes' batches scale with it (12 at the launcher's size, 2 at "
                        "512 px)")
    g.add_argument("--gpu_steps", type=int, default=15, help="timed steps per GPU case")
    g.add_argument("--gpu_sizes", default=",".join(GPU_SIZES), help="comma-separated sizes of the gpu section: " +
                   ", ".join(f"{k} ({v[0]['vae_ch']} ch, {v[1]} px, batch {v[2]})" for k, v in GPU_SIZES.items()))
    g.add_argument("--gpu_compile_sizes", default="flux_256",
                   help="the sizes whose compiled cases run (each compiles for a minute or more)")
    g = p.add_argument_group("quality")
    g.add_argument("--quality", action="store_true", help="only the quality section (same as --sections quality)")
    g.add_argument("--quality_steps", type=int, default=400, help="training steps of each quality run")
    g.add_argument("--quality_precision", choices=("fp32", "bf16"), default="fp32",
                   help="--precision of all three quality runs (bf16: 2.5x faster on a CPU with AMX)")
    g = p.add_argument_group("decoders")
    g.add_argument("--decode_resolution", type=int, default=1024, help="image size of the decoders section's decode")
    g.add_argument("--decode_batch", type=int, default=1, help="images per decode")
    g.add_argument("--decode_rounds", type=int, default=0,
                   help="rounds of the decoders section, each decoder in a fresh process per round (default 3; 1 with "
                        "--quick); per round one timed decode on a CPU, 3 warm-up and 10 timed ones on CUDA")
    g.add_argument("--decode_precision", default="",
                   help="comma-separated fp32,bf16 (default fp32 on a CPU, fp32,bf16 on CUDA)")
    g = p.add_argument_group("decoder_quality")
    g.add_argument("--wide_steps", type=int, default=600, help="steps of the demo run that is the released wide VAE")
    g.add_argument("--decoder_steps", type=int, default=400, help="steps of each decoder run behind its encoder")
    g.add_argument("--narrow_widths", default="24,48,48",
                   help="the narrower decoder's widths (the demo's are 32,64,64; multiples of its 8 GroupNorm groups)")
    g.add_argument("--decoder_seeds", default="0", help="comma-separated seeds: each trains every decoder run once")
    g.add_argument("--decoder_grid", default="",
                   help="write the held-out reconstructions' grid (PNG; the first seed's runs) here")
    g.add_argument("--decoder_runs_dir", default="",
                   help="keep the runs, exports, logs and evaluations here (default: a temporary folder)")
    g = p.add_argument_group("resolutions")
    g.add_argument("--res_steps", type=int, default=600, help="steps of each run of the resolutions section")
    g.add_argument("--res_heldout_url", default="",
                   help="more held-out photos (shards or a folder) for the resolutions section's evaluation")
    g.add_argument("--res_runs_dir", default="",
                   help="keep the resolutions section's runs here (default: a temporary folder); finished runs are "
                        "not trained again")
    g = p.add_argument_group("precision")
    g.add_argument("--precision_steps", type=int, default=900, help="steps of each run of the precision section")
    g.add_argument("--precision_seeds", default="0,1", help="comma-separated seeds of the precision section")
    p.add_argument("--_memory_case", default=None, help=argparse.SUPPRESS)  # internal: one memory case, as JSON
    p.add_argument("--_decode_case", default=None, help=argparse.SUPPRESS)  # internal: one decode case, as JSON
    p.add_argument("--_gpu_case", default=None, help=argparse.SUPPRESS)  # internal: one GPU case, as JSON
    args = p.parse_args(argv)

    def default(name, full, quick):
        if not getattr(args, name):
            setattr(args, name, quick if args.quick else full)
    default("images", 32, 16)
    default("data_rounds", 5, 3)
    default("config", "small", "tiny")
    default("train_rounds", 8, 5)
    default("memory_ch", 64, 32)
    default("memory_resolutions", "256,512", "512")
    default("memory_steps", 2, 1)
    default("memory_levels", ",".join(CKPT_LEVELS), "none,decoder_hr,hr")
    default("decode_rounds", 3, 1)
    if args.ckpt_time_rounds is None:
        args.ckpt_time_rounds = 1 if args.quick else 3
    if args.quick:
        args.no_compile = True
    if args.quality:
        args.sections = "quality"
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    args.decode_precision = [s.strip() for s in args.decode_precision.split(",") if s.strip()]
    if set(args.decode_precision) - {"fp32", "bf16"}:
        p.error("--decode_precision: fp32, bf16 or both")
    try:
        [int(w) for w in args.narrow_widths.split(",")] + [int(s) for s in args.decoder_seeds.split(",")]
    except ValueError:
        p.error("--narrow_widths and --decoder_seeds are comma-separated integers")
    try:
        args.height, args.width = (int(v) for v in args.image_size.lower().split("x"))
        args.memory_resolutions = [int(r) for r in str(args.memory_resolutions).split(",")]
    except ValueError:
        p.error("--image_size is HEIGHTxWIDTH and --memory_resolutions comma-separated integers")
    args.memory_levels = [level.strip() for level in args.memory_levels.split(",") if level.strip()]
    if set(args.memory_levels) - set(CKPT_LEVELS) or args.memory_levels[:2] != ["none", "decoder_hr"]:
        p.error(f"--memory_levels: none,decoder_hr (the baseline and the key's level), then any of "
                f"{', '.join(CKPT_LEVELS[2:])}")
    if min(args.height, args.width) < 512:
        p.error("--image_size: both sides must be at least 512 (the memory section crops 512 px)")
    if args.images < 2 * args.data_batch_size:
        p.error("--images must be at least twice --data_batch_size")
    return args


# ----------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------
def median(values):
    return statistics.median(values) if values else float("nan")


def percent(value, signed=False) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def finite(obj):
    """NaN and infinities become null: the JSON output stays standard JSON."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(wanted=("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")) -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [w for w in wanted if w in flags]


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    rss = _proc_status("VmRSS")
    if rss is None:  # not Linux: the peak so far is the best available bound
        rss = peak_rss()
    return rss


def peak_rss() -> int:
    """Peak RSS of this process image in bytes. Linux: VmHWM, not getrusage's ru_maxrss, which a child
    inherits from its parent across fork + exec (it would report the benchmark parent's peak)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mib(n_bytes) -> float:
    return n_bytes / 2**20


class Report:
    """Collects the human tables; they go to stdout, or to stderr when stdout carries the JSON."""

    def __init__(self, stream):
        self.stream = stream

    def line(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    @staticmethod
    def cell(value) -> str:
        if isinstance(value, float):
            if not np.isfinite(value):
                return "-"
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
        return str(value)

    def table(self, title: str, header: list[str], rows: list[list]) -> None:
        cells = [header] + [[self.cell(c) for c in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        self.line(f"\n{title}")
        for n, row in enumerate(cells):
            self.line("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
            if n == 0:
                self.line("  " + "  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------------------------------
# Generated photo-like images and their shards
# ----------------------------------------------------------------------------------------------------
def photo_like(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A uint8 (H, W, 3) stand-in for a photo: a smooth sky gradient, a textured ground (mid and high
    frequencies), a few sharp-edged shapes, a slight blur and sensor noise. Pure noise would decode
    unrealistically slowly as PNG, flat colour unrealistically fast."""
    def smooth_field(grid_h, grid_w, amplitude):
        small = rng.normal(0.0, 1.0, (grid_h, grid_w, 3))
        small = ((small - small.min()) / (np.ptp(small) + 1e-9) * 255).astype(np.uint8)
        field = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
        return (np.asarray(field, dtype=np.float32) / 255.0 - 0.5) * amplitude

    sky = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None] * rng.uniform(-80, 80, 3).astype(np.float32)
    image = rng.uniform(60, 190, 3).astype(np.float32) + sky + smooth_field(4, 5, 120)
    horizon = int(height * rng.uniform(0.4, 0.7))
    texture = smooth_field(max(2, height // 12), max(2, width // 12), 60) + smooth_field(height // 3, width // 3, 25)
    image[horizon:] += texture[horizon:]
    img = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 9))):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        w, h = rng.uniform(30, width / 3), rng.uniform(30, height / 3)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + w, y0 + h], fill=color)
        else:
            draw.polygon([(x0 + rng.uniform(-w, w), y0 + rng.uniform(-h, h)) for _ in range(5)], fill=color)
    img = img.filter(ImageFilter.GaussianBlur(1.2))
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0.0, 2.0, (height, width, 3)).astype(np.float32)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def make_datasets(root: str, n: int, height: int, width: int, seed: int) -> dict[str, dict]:
    """PNG and JPEG (quality 90) shards of the same n generated images, written with data.write_shards."""
    rng = np.random.default_rng(seed)
    arrays = [photo_like(rng, height, width) for _ in range(n)]
    datasets = {}
    for fmt, ext, save_kwargs in (("png", "png", {}), ("jpeg", "jpg", {"quality": 90})):
        src = os.path.join(root, f"{fmt}_images")
        os.makedirs(src)
        files = []
        for i, array in enumerate(arrays):
            files.append(os.path.join(src, f"img_{i:05d}.{ext}"))
            Image.fromarray(array).save(files[-1], **save_kwargs)
        paths, _ = shards.write_shards(files, os.path.join(root, f"{fmt}_shards"), shard_size=max(1, n // 4),
                                         verify=False, root=src)
        datasets[fmt] = {"url": data_lib.brace_url(paths), "paths": paths,
                         "mean_file_kib": round(sum(os.path.getsize(f) for f in files) / n / 1024, 1)}
    return datasets


# ----------------------------------------------------------------------------------------------------
# Section 1: the input pipeline, one worker
# ----------------------------------------------------------------------------------------------------
def tar_image_bytes(paths: list[str]):
    """The image members' bytes of tar shards, streamed as webdataset streams them."""
    for path in paths:
        with tarfile.open(path, mode="r|") as tar:
            for member in tar:
                if member.isfile() and member.name.rsplit(".", 1)[-1].lower() in data_lib.IMAGE_EXTS:
                    yield tar.extractfile(member).read()


def decode_rgb(blob: bytes) -> Image.Image:
    """The least work that yields RGB pixels: the decode ceiling of any pipeline."""
    img = Image.open(io.BytesIO(blob))
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def time_raw_decode(paths, n):
    t0 = time.perf_counter()
    count = sum(1 for blob in tar_image_bytes(paths) if decode_rgb(blob) is not None)
    assert count == n, (count, n)
    return time.perf_counter() - t0


def time_train_loader(url, n, batch_size, seed, resize_prob, shuffle_buffer):
    loader = data_lib.TrainLoader(url, 256, batch_size, seed, 0, 1, num_workers=0, shuffle_buffer=shuffle_buffer,
                                  resize_prob=resize_prob)
    try:
        t0 = time.perf_counter()
        for _ in range(n // batch_size):
            batch = next(loader)
        elapsed = time.perf_counter() - t0
    finally:
        loader.close()
    assert batch.dtype == torch.uint8 and tuple(batch.shape) == (batch_size, 3, 256, 256)
    return elapsed


def time_naive(paths, n, batch_size, seed):
    """The reference trainer's way: the whole decoded image becomes a normalised float tensor, then a crop."""
    from torchvision import transforms
    torch.manual_seed(seed)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3),
                                    transforms.RandomCrop(256)])
    t0 = time.perf_counter()
    batch = []
    for blob in itertools.islice(tar_image_bytes(paths), n):
        batch.append(transform(Image.open(io.BytesIO(blob)).convert("RGB")))
        if len(batch) == batch_size:
            torch.stack(batch)
            batch = []
    return time.perf_counter() - t0


def bench_data(args, datasets, report: Report) -> dict:
    n, bs = args.images, args.data_batch_size
    n_timed = n // bs * bs  # the loaders produce whole batches
    buffer = min(64, n // 2)
    methods = {}
    for fmt, ds in datasets.items():
        paths, url = ds["paths"], ds["url"]
        methods[(fmt, "decode")] = (n, lambda p=paths: time_raw_decode(p, n))
        methods[(fmt, "ours")] = (n_timed, lambda u=url: time_train_loader(u, n_timed, bs, args.seed, 0.0, buffer))
        if fmt == "jpeg":
            methods[(fmt, "ours_resize0.5")] = (n_timed, lambda u=url: time_train_loader(u, n_timed, bs, args.seed, 0.5, buffer))
        methods[(fmt, "naive")] = (n_timed, lambda p=paths: time_naive(p, n_timed, bs, args.seed))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a DataLoader worker runs with
    try:
        for fmt, ds in datasets.items():  # warm the page cache and PIL's code paths
            time_raw_decode(ds["paths"], n)
        rates = {key: [] for key in methods}
        keys = list(methods)
        for r in range(args.data_rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate the order each round
                count, run = methods[key]
                rates[key].append(count / run())
    finally:
        torch.set_num_threads(threads)

    out = {"images": n, "image_size": f"{args.height}x{args.width}", "batch_size": bs, "shuffle_buffer": buffer,
           "rounds": args.data_rounds, "torch_threads": 1, "formats": {}}
    rows = []
    for fmt, ds in datasets.items():
        decode = median(rates[(fmt, "decode")])
        entry = {"mean_file_kib": ds["mean_file_kib"]}
        for (f, method), values in rates.items():
            if f != fmt:
                continue
            entry[method] = {"img_per_s": median(values), "fraction_of_decode": median(values) / decode,
                             "runs_img_per_s": [round(v, 2) for v in values]}
            rows.append([f"{fmt} ({ds['mean_file_kib']:.0f} KiB/img)", method, median(values),
                         percent(median(values) / decode), f"{min(values):.1f}-{max(values):.1f}"])
        out["formats"][fmt] = entry
    report.table(f"Input pipeline, one worker: {n} images of {args.height}x{args.width} -> 256 crops, "
                 f"batch {bs}, medians of {args.data_rounds} interleaved rounds",
                 ["dataset", "reader", "img/s", "of decode", "range img/s"], rows)
    report.line("  decode: PIL open + load of the tar members' bytes; ours: data.TrainLoader (resize_prob 0 unless "
                "named); naive: ToTensor + Normalize on the whole image, then RandomCrop(256)")
    return out


# ----------------------------------------------------------------------------------------------------
# Building the real trainer around in-memory batches
# ----------------------------------------------------------------------------------------------------
def trainer_argv(values: dict) -> list[str]:
    """vae_trainer.py's command line for these flag values."""
    argv = []
    for key, value in values.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def build_trainer(url: str, output_dir: str, run_name: str, device: torch.device, **overrides):
    """vae_trainer.Trainer from its own flag parser, with the benchmark flags, fed from memory."""
    values = {**BENCH_FLAGS, **overrides, "dataset_url": url, "output_dir": output_dir, "run_name": run_name}
    cfg = config_lib.parse_config(trainer_argv(values))
    cfg.validate()
    with contextlib.redirect_stderr(io.StringIO()):  # the random-VGG16 banner; the report states it once
        trainer = vae_trainer.Trainer(cfg, DistInfo(device=device))
    batches = [next(trainer.loader) for _ in range(2)]
    trainer.loader.close()
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    trainer.loader = data_lib.FixedBatches(batches)
    return trainer


def add_reference_habits(trainer) -> None:
    """The reference trainer's habits, for the baseline: .item() on every scalar the step logs (each loss,
    grad norm, logit mean, latent statistic) as soon as it exists. Wraps trainer.metrics.add/max on the
    instance; set trainer.metrics.host_sync to switch it on."""
    metrics = trainer.metrics
    metrics.host_sync = False
    for name in ("add", "max"):
        original = getattr(metrics, name)

        def wrapped(_original=original, **values):
            if metrics.host_sync:
                for value in values.values():
                    if value.dim() == 0:
                        value.item()
            _original(**values)
        setattr(metrics, name, wrapped)
    if trainer.adversary is not None:
        # and, with the GAN, the critic's weight gradients in the generator's pass: the reference computes them
        # (and zeroes them after the VAE's step); train_step runs that pass under objective.critic_frozen()
        frozen = trainer.objective.critic_frozen

        def critic_frozen(_frozen=frozen):
            return contextlib.nullcontext() if metrics.host_sync else _frozen()
        trainer.objective.critic_frozen = critic_frozen


def timed_step(trainer) -> float:
    synchronize(trainer.device)
    t0 = time.perf_counter()
    trainer.train_step()
    trainer.step += 1  # as Trainer.train() does
    synchronize(trainer.device)
    return time.perf_counter() - t0


def interleave_steps(variants: dict[str, tuple], rounds: int, steps: int) -> dict[str, list[float]]:
    """variants: name -> (trainer, host_sync). Each round runs `steps` steps of every variant, in an order
    rotated each round, so a burst of load on a shared machine hits all variants alike."""
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            trainer, host_sync = variants[name]
            trainer.metrics.host_sync = host_sync
            times[name] += [timed_step(trainer) for _ in range(steps)]
    return times


# ----------------------------------------------------------------------------------------------------
# Section 2: the training step
# ----------------------------------------------------------------------------------------------------
def bench_train(args, url, tmp, device, report: Report) -> dict:
    config = dict(TRAIN_CONFIGS[args.config])
    if args.gan:
        config["do_ganloss"] = True
    batch = config["batch_size"]
    # one trainer per layout / precision / compile setting; the two NCHW variants share one (host syncs on, off)
    settings = {"nchw": dict(channels_last=False), "channels_last": dict(channels_last=True),
                "bf16": dict(channels_last=True, precision="bf16")}
    if not args.no_compile:
        settings["compiled"] = dict(channels_last=True, compile=True)
    if args.gan:  # issue 19: the same step with the critic's trunk frozen and shared with LPIPS
        settings["frozen"] = dict(channels_last=False, critic_trunk="frozen")
    if args.gan and args.gan_flops_only:
        return gan_flops_only(url, tmp, device, config, report)
    trainers, warmup_s = {}, {}
    for key, extra in settings.items():
        report.line(f"  building and warming up the {key} trainer ...")
        trainer = build_trainer(url, tmp, f"train_{key}", device, **config, **extra)
        add_reference_habits(trainer)
        t0 = time.perf_counter()
        for _ in range(3 if key == "compiled" else 2):  # compile: forward, backward, then steady state
            timed_step(trainer)
        warmup_s[key] = time.perf_counter() - t0
        trainers[key] = trainer
    variants = {"reference": (trainers["nchw"], True), "sync_free": (trainers["nchw"], False),
                "channels_last": (trainers["channels_last"], False)}
    if "compiled" in trainers:
        variants["compile"] = (trainers["compiled"], False)
    variants["bf16"] = (trainers["bf16"], False)
    if "frozen" in trainers:
        variants["frozen_trunk"] = (trainers["frozen"], False)
    times = interleave_steps(variants, args.train_rounds, args.steps_per_round)
    if args.gan:
        flops = gan_step_flops(trainers["nchw"])
        flops["frozen_trainer"] = train_step_flops(trainers["frozen"])
        report.line(f"  GFLOP per step (FlopCounterMode): ours {flops['ours'] / 1e9:.1f}, the reference's way "
                    f"{flops['reference'] / 1e9:.1f} ({flops['reference'] / flops['ours']:.3f}x); critic "
                    f"{flops['ours_critic'] / 1e9:.1f} / {flops['reference_critic'] / 1e9:.1f}, LPIPS "
                    f"{flops['ours_lpips'] / 1e9:.1f}, VAE {flops['ours_vae'] / 1e9:.1f}")
        report.line(f"  frozen trunk (issue 19), the trainer's own step (--critic_trunk frozen): "
                    f"{flops['frozen_trainer'] / 1e9:.1f} GFLOP ({flops['reference'] / flops['frozen_trainer']:.3f}x "
                    f"the reference's way); composed from its parts {flops['frozen'] / 1e9:.1f}: trunk forwards "
                    f"{flops['frozen_trunk_forward'] / 1e9:.1f}, LPIPS heads {flops['frozen_lpips_heads'] / 1e9:.2f}, "
                    f"critic heads' step {flops['frozen_critic_heads_step'] / 1e9:.1f}, generator term + both "
                    f"branches' backward {flops['frozen_generator_and_backward'] / 1e9:.1f}, VAE "
                    f"{flops['ours_vae'] / 1e9:.1f}")
        gan_wall = gan_part_wall_clock(config["vae_resolution"], batch)
        report.line("  the GAN + LPIPS part alone, one thread, 3 interleaved rounds (s): " + ", ".join(
            f"{name} {median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for name, t in gan_wall.items()))
        gan_memory = {size: gan_saved_activations(size) for size in (256, 512)}
        for size, saved in gan_memory.items():
            report.line(f"  GAN + LPIPS activations saved for backward, {size} px, batch 1 (MiB): VAE side ours "
                        f"{saved['ours_vae_side']:.0f}, frozen {saved['frozen_vae_side']:.0f}; critic's step ours "
                        f"{saved['ours_critic_step']:.0f}, frozen {saved['frozen_critic_step']:.0f}")
    del trainers, variants
    gc.collect()

    rate = {name: batch / median(t) for name, t in times.items()}
    all_on = "compile" if "compile" in rate else "channels_last"
    described = {
        "reference": "host syncs, NCHW, eager, fp32" + (", critic weight grads in the generator's pass"
                                                           if args.gan else ""),
        "sync_free": "no host syncs, NCHW, eager, fp32",
        "channels_last": "no host syncs, channels_last, eager, fp32",
        "compile": "no host syncs, channels_last, torch.compile, fp32",
        "bf16": "no host syncs, channels_last, eager, bf16 autocast",
        "frozen_trunk": "no host syncs, NCHW, eager, fp32, --critic_trunk frozen",
    }
    rows = [[name, described[name], rate[name], f"{rate[name] / rate['reference']:.2f}x", median(t),
             f"{min(t):.2f}-{max(t):.2f}"] for name, t in times.items()]
    report.table(f"Training step ({args.config}: ch {config['vae_ch']} x {config['vae_ch_mult']}, "
                 f"{config['vae_resolution']} px, batch {batch}, LPIPS{' + GAN' if args.gan else ''}; "
                 f"{args.train_rounds} rounds x {args.steps_per_round} steps)",
                 ["variant", "settings", "img/s", "x reference", "median s/step", "range s"], rows)
    report.line("  warm-up (s): " + ", ".join(f"{k} {v:.1f}" for k, v in warmup_s.items()))
    return {
        "config": {"name": args.config, **config, "lpips": True},
        "rounds": args.train_rounds, "steps_per_round": args.steps_per_round,
        "variants": {name: {"settings": described[name], "img_per_s": rate[name], "median_step_s": median(t),
                            "step_s": [round(v, 4) for v in t]} for name, t in times.items()},
        "warmup_s": warmup_s,
        "all_switches_on": all_on,
        "speedup_all_on": rate[all_on] / rate["reference"],
        "speedup_sync_free": rate["sync_free"] / rate["reference"],
        "speedup_channels_last": rate["channels_last"] / rate["sync_free"],
        "speedup_compile": rate["compile"] / rate["channels_last"] if "compile" in rate else None,
        "bf16_speedup": rate["bf16"] / rate["channels_last"],
        "frozen_trunk_speedup": rate["frozen_trunk"] / rate["reference"] if "frozen_trunk" in rate else None,
        "gan_step_flops": flops if args.gan else None,
        "gan_saved_mib": gan_memory if args.gan else None,
        "gan_part_wall_s": gan_wall if args.gan else None,
    }


# ----------------------------------------------------------------------------------------------------
# Section: what the latent features cost (issue 20)
# ----------------------------------------------------------------------------------------------------
LATENTS_CONFIG = dict(vae_ch=32, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4, vae_norm_groups=8,
                      do_attn=False, vae_resolution=64, batch_size=4, mse_pool_factor=1)  # the demo's model
LATENT_FEATURES = {
    "base": ("nothing", {}),
    "equivariance": ("--scale_equivariance_prob 0.5", dict(scale_equivariance_prob=0.5)),
    "latent_noise": ("--latent_noise_prob 0.5", dict(latent_noise_prob=0.5)),
    "vf_vits14_112": ("--vf_weight 0.5, DINOv2 ViT-S/14 at 112 px",
                      dict(vf_weight=0.5, vf_model="dinov2_vits14", vf_weights="random", vf_image_size=112)),
    "vf_vitl14_224": ("--vf_weight 0.5, DINOv2 ViT-L/14 at 224 px (VA-VAE's)",
                      dict(vf_weight=0.5, vf_model="dinov2_vitl14", vf_weights="random", vf_image_size=224)),
}


def bench_latents(args, url, tmp, device, report: Report) -> dict:
    import probe as probe_lib
    trainers, flops = {}, {}
    for name, (_, flags) in LATENT_FEATURES.items():
        report.line(f"  building and warming up the {name} trainer ...")
        with contextlib.redirect_stderr(io.StringIO()):  # the random-weights banners
            trainers[name] = build_trainer(url, tmp, f"latents_{name}", device, **LATENTS_CONFIG, **flags)
        add_reference_habits(trainers[name])
        for _ in range(2):
            timed_step(trainers[name])
        flops[name] = train_step_flops(trainers[name])
    times = interleave_steps({name: (t, False) for name, t in trainers.items()}, args.train_rounds,
                             max(args.steps_per_round, 5))
    base = median(times["base"])
    rows = [[name, LATENT_FEATURES[name][0], flops[name] / 1e9, f"{flops[name] / flops['base']:.2f}x",
             median(t) * 1e3, f"{median(t) / base:.2f}x"] for name, t in times.items()]
    report.table(f"Latent features (issue 20): the demo's model, batch {LATENTS_CONFIG['batch_size']}, "
                 f"{LATENTS_CONFIG['vae_resolution']} px, LPIPS on, fp32; {args.train_rounds} rounds x "
                 f"{max(args.steps_per_round, 5)} steps",
                 ["feature", "flags", "GFLOP/step", "x base", "median ms/step", "x base (wall)"], rows)
    cfg = trainers["base"].cfg
    probe_images = min(cfg.latents.probe_images, args.images)
    cfg = config_lib.with_values(cfg, probe_images=probe_images,
                                 probe_heldout=min(cfg.latents.probe_heldout, probe_images // 4))
    in_loop = probe_lib.InLoopProbe(cfg.latents, cfg.data, cfg.optim.seed, device)
    trainer = trainers["base"]
    calls = [in_loop(trainer.vae, trainer.training.ema)[1] for _ in range(2)]
    per_call = min(calls)
    latents = cfg.latents
    report.line(f"  one in-loop probe call (--probe_steps {latents.probe_steps}, --probe_batch_size "
                f"{latents.probe_batch_size}, {latents.probe_images} images, {latents.probe_heldout} held out): "
                f"{per_call:.1f} s "
                f"(calls {', '.join(f'{c:.1f}' for c in calls)}); at --probe_every_n_steps 1000 that is "
                f"{per_call / 1000 * 1e3:.1f} ms per step, {per_call / 1000 / base:.1%} of the base step")
    for t in trainers.values():
        t.close()
    return {"config": LATENTS_CONFIG, "rounds": args.train_rounds,
            "features": {name: {"flags": LATENT_FEATURES[name][0], "gflop_per_step": flops[name] / 1e9,
                                "flop_ratio": flops[name] / flops["base"], "median_step_s": median(t),
                                "wall_ratio": median(t) / base, "step_s": [round(v, 4) for v in t]}
                         for name, t in times.items()},
            "probe_call_s": calls, "probe": {"steps": latents.probe_steps, "batch_size": latents.probe_batch_size,
                                             "images": latents.probe_images, "heldout": latents.probe_heldout}}


# ----------------------------------------------------------------------------------------------------
# Section: quality per step
# ----------------------------------------------------------------------------------------------------
def gan_flops_only(url, tmp, device, config: dict, report: Report) -> dict:
    """--gan_flops_only: the GAN step's FLOPs ours / the reference's way (one trainable-critic trainer) and the
    trainer's own step with --critic_trunk frozen, without warm-up or timed rounds."""
    # NCHW as the timed variants' FLOP counts (FLOPs do not depend on the layout; and FlopCounterMode's module
    # tracker cannot follow the frozen trunk's autograd.grad on a channels_last leaf)
    trainer = build_trainer(url, tmp, "flops_trainable", device, **config, channels_last=False)
    add_reference_habits(trainer)
    flops = gan_step_flops(trainer)
    del trainer
    frozen = build_trainer(url, tmp, "flops_frozen", device, **config, critic_trunk="frozen", channels_last=False)
    flops["frozen_trainer"] = train_step_flops(frozen)
    report.line(f"  GFLOP per step: the reference's way {flops['reference'] / 1e9:.1f}, ours {flops['ours'] / 1e9:.1f} "
                f"(critic {flops['ours_critic'] / 1e9:.1f}, LPIPS {flops['ours_lpips'] / 1e9:.1f}, VAE "
                f"{flops['ours_vae'] / 1e9:.1f}), --critic_trunk frozen {flops['frozen_trainer'] / 1e9:.1f} "
                f"({flops['reference'] / flops['frozen_trainer']:.3f}x the reference's way; composed from its parts "
                f"{flops['frozen'] / 1e9:.1f})")
    return {"config": {"name": "flops_only", **config}, "gan_step_flops": flops}


def reference_flags(cfg: dict, steps: int = 400) -> dict:
    """The reference trainer's hyperparameters (cloneofsimo/vqgan-training at HEAD and its launcher.sh),
    written with our flags. Not reproducible with our flags: its conv_in learning rate of 1e-4 (ours is one
    rate for the whole VAE), and its latent penalty is on z itself (here on the posterior mean: with its
    zero noise the same)."""
    latent_elements = cfg["batch_size"] * cfg["vae_z_channels"] * (
        cfg["vae_resolution"] // 2 ** (len(cfg["vae_ch_mult"].split(",")) - 1)) ** 2
    return dict(
        learning_rate_vae=2 ** -7 / cfg["vae_ch"],  # launcher: lr 2^-7, divided by the width in the code
        # 200 in its code; at most half of a shorter run, so that one still reaches the peak rate as at 400 steps
        warmup_steps=min(200, steps // 2), learning_rate_disc=1e-5, disc_start=0, do_attn=False, do_clamp=True,
        vae_norm_groups=32,
        disc_type="bce", gen_loss="nonsaturating",  # --disc_type's default is bce; the launcher keeps it
        perceptual_weight=1.0, mse_weight=0.0,  # at HEAD the pixel loss is multiplied by 0.0
        gan_weight=1.0, lecam_weight=0.0, grad_clip=0.0, ema_decay=0.0,
        # its 0.1 * mean(z^2) added outside GradNorm: per-element gradient 0.2 z / n; ours kl * z / sqrt(n)
        kl_weight=0.2 / latent_elements ** 0.5,
        posterior_var=1e-8)  # no noise at HEAD (its README's "fixed variance of 0.1" is not in the code)


def plain_mse_flags(cfg: dict, steps: int = 400) -> dict:
    """The floor: the reference's hyperparameters and architecture, one plain MSE loss (and its latent
    penalty), no LPIPS, no critic."""
    return {**reference_flags(cfg, steps), "perceptual_weight": 0.0, "do_ganloss": False, "loss_balance": "none",
            "mse_weight": 1.0, "pooled_mse_weight": 1.0, "mse_pool_factor": 1, "lowpass_mse_weight": 0.0,
            "kl_weight": 0.2}  # none: the latent penalty is a mean, 0.2 * 0.5 * mean^2 = 0.1 * mean(z^2)


def final_eval(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval/psnr" in r]
    return evals[-1]


def bench_quality(args, tmp, report: Report) -> dict:
    """Our defaults vs the reference's hyperparameters vs plain MSE: the same model, photos, seed and steps,
    each a real `vae_trainer.py` run; held-out PSNR/SSIM/LPIPS from the trainer's own final evaluation."""
    train_url, test_url = shards.ensure_demo_shards(os.path.join(tmp, "quality_data"))
    vgg = "torchvision" if os.path.isfile(vgg16_cache_path()) else "random"
    cfg = dict(QUALITY_CONFIG)
    common = dict(cfg, precision=args.quality_precision, dataset_url=train_url, test_dataset_url=test_url,
                  max_steps=args.quality_steps,
                  vgg16_weights=vgg, inception_weights="none", wandb_mode="disabled", num_workers=1,
                  shuffle_buffer=64, log_every_n_steps=50, save_every_n_steps=args.quality_steps,
                  evaluate_every_n_steps=args.quality_steps, eval_max_images=64, seed=args.seed,
                  output_dir=os.path.join(tmp, "quality_runs"))
    variants = {"defaults": {}, "reference": reference_flags(cfg, args.quality_steps),
                "plain_mse": plain_mse_flags(cfg, args.quality_steps)}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}
    out = {"config": {**cfg, "steps": args.quality_steps, "precision": args.quality_precision, "vgg16_weights": vgg,
                      "train_images": len(shards.DEMO_PHOTOS) - len(shards.DEMO_TEST),
                      "held_out_images": list(shards.DEMO_TEST)}, "variants": {}}
    procs = {}
    for name, flags in variants.items():  # concurrently: on a shared machine every run sees the same load
        argv = trainer_argv({**common, **flags, "run_name": f"quality_{name}"})
        log = open(os.path.join(tmp, f"quality_{name}.log"), "w")
        procs[name] = (subprocess.Popen([sys.executable, os.path.join(HERE, "vae_trainer.py"), *argv], env=env,
                                        stdout=log, stderr=subprocess.STDOUT), log, time.time())
    report.line(f"  training {', '.join(variants)} concurrently ({args.quality_steps} steps each; logs in {tmp}) ...")
    for name, (proc, log, t0) in procs.items():
        proc.wait()
        log.close()
        if proc.returncode != 0:
            with open(log.name) as f:
                raise RuntimeError(f"quality run {name} failed:\n{f.read()[-3000:]}")
        ev = final_eval(os.path.join(common["output_dir"], f"quality_{name}"))
        out["variants"][name] = {"flags": variants[name], "wall_s": round(time.time() - t0, 1),
                                 **{k: ev.get(f"eval/{k}") for k in ("psnr", "ssim", "lpips", "n_images")},
                                 **{f"ema_{k}": ev.get(f"eval_ema/{k}") for k in ("psnr", "ssim", "lpips")}}
    v = out["variants"]
    rows = [[name, r["psnr"], r["ssim"], r["lpips"], r["wall_s"]] for name, r in v.items()]
    report.table(f"Held-out quality after {args.quality_steps} steps ({len(shards.DEMO_TEST)} held-out photos, "
                 f"VGG16 {vgg}; ch {cfg['vae_ch']} x {cfg['vae_ch_mult']}, z {cfg['vae_z_channels']}, "
                 f"{cfg['vae_resolution']} px, batch {cfg['batch_size']}, GAN)",
                 ["variant", "PSNR dB", "SSIM", "LPIPS", "wall s"], rows)
    for metric in ("psnr", "ssim"):
        out[f"{metric}_over_reference"] = v["defaults"][metric] - v["reference"][metric]
        out[f"{metric}_over_floor"] = v["defaults"][metric] - v["plain_mse"][metric]
    return out


# ----------------------------------------------------------------------------------------------------
# Section 3: gradient checkpointing memory
# ----------------------------------------------------------------------------------------------------
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
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory_case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
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


def gan_saved_activations(size: int, batch: int = 1) -> dict[str, float]:
    """MiB saved for backward by the GAN and LPIPS part of one step at `size` px (the VAE's own activations
    are the same either way and left out), trainable critic (ours) vs frozen trunk (issue 19), random weights:
    the VAE-side graph (live until the VAE's backward: LPIPS and the generator term on the reconstruction)
    and the critic's own step (its graph is freed before the VAE's forward). Saved-tensor hooks, unique
    storages, parameters excluded: exact, free of timing noise and of the allocator."""
    from critics import FeatureCriticHeads, VGG16Discriminator, build_lpips, lpips_from_features, vgg16_features
    from utils import discriminator_loss, generator_loss
    lpips_model, critic, heads = build_lpips(None), VGG16Discriminator(None), FeatureCriticHeads()
    params = {t.untyped_storage().data_ptr() for m in (lpips_model, critic, heads)
              for t in list(m.parameters()) + list(m.buffers())}

    def saved_mib(run) -> float:
        seen: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
        return mib(sum(seen.values()))

    x = torch.rand(batch, 3, size, size) * 2 - 1
    recon = (torch.rand(batch, 3, size, size) * 2 - 1).requires_grad_(True)

    def ours_vae_side():
        critic.requires_grad_(False)
        lpips_model(recon, x).mean() + critic(recon).mean()
        critic.requires_grad_(True)

    def ours_critic_step():
        discriminator_loss(*critic(torch.cat([x, recon.detach()])).chunk(2), "hinge")

    with torch.no_grad():
        x_feats = vgg16_features(lpips_model, x)

    def frozen_vae_side():
        heads.requires_grad_(False)
        feats = vgg16_features(lpips_model, recon)
        lpips_from_features(lpips_model, feats, x_feats).mean() + generator_loss(heads(feats), None, "ldm")
        heads.requires_grad_(True)

    def frozen_critic_step():
        with torch.no_grad():
            fake_feats = vgg16_features(lpips_model, recon)
        discriminator_loss(*heads([torch.cat([a, b]) for a, b in zip(x_feats, fake_feats)]).chunk(2), "hinge")

    return {"ours_vae_side": saved_mib(ours_vae_side), "ours_critic_step": saved_mib(ours_critic_step),
            "frozen_vae_side": saved_mib(frozen_vae_side), "frozen_critic_step": saved_mib(frozen_critic_step)}


def gan_part_wall_clock(size: int, batch: int, rounds: int = 3) -> dict[str, list[float]]:
    """Seconds of the GAN and LPIPS part of one step (the VAE's part is the same in all three and left out),
    interleaved in rotated order each round so load bursts hit all alike: the reference's way (LPIPS on both
    images, the trainable critic's step, the generator's pass with the critic's weight gradients), ours
    (the same, the critic frozen in the generator's pass), and the frozen trunk (issue 19: one trunk pass per
    image, the heads' step, both GradNorm branches' backward through the trunk). Random weights."""
    from critics import FeatureCriticHeads, VGG16Discriminator, build_lpips, lpips_from_features, vgg16_features
    from utils import discriminator_loss, generator_loss
    lpips_model, critic, heads = build_lpips(None), VGG16Discriminator(None), FeatureCriticHeads()
    for head in list(critic.heads) + list(heads.heads):  # past the neutral start: every patch pushes
        torch.nn.init.normal_(head[-1].weight, std=0.01)
    x = torch.rand(batch, 3, size, size) * 2 - 1
    recon = (torch.rand(batch, 3, size, size) * 2 - 1).requires_grad_(True)

    def trainable(reference: bool):
        def step():
            logits = critic(torch.cat([x, recon.detach()]))
            real_logits, fake_logits = logits.float().chunk(2)
            discriminator_loss(real_logits, fake_logits, "hinge").backward()
            critic.requires_grad_(reference)
            perceptual = lpips_model(recon, x).mean()
            g_loss = generator_loss(critic(recon), real_logits.detach(), "thresholded")
            torch.autograd.grad(perceptual, recon, retain_graph=True)  # GradNorm's two branches
            torch.autograd.grad(g_loss, recon)
            critic.requires_grad_(True)
            critic.zero_grad(set_to_none=True)
        return step

    def frozen():
        with torch.no_grad():
            x_feats = vgg16_features(lpips_model, x)
        recon_feats = vgg16_features(lpips_model, recon)
        perceptual = lpips_from_features(lpips_model, recon_feats, x_feats).mean()
        logits = heads([torch.cat([a, b.detach()]) for a, b in zip(x_feats, recon_feats)])
        real_logits, fake_logits = logits.float().chunk(2)
        discriminator_loss(real_logits, fake_logits, "hinge").backward()
        heads.requires_grad_(False)
        g_loss = generator_loss(heads(recon_feats), real_logits.detach(), "thresholded")
        torch.autograd.grad(perceptual, recon, retain_graph=True)
        torch.autograd.grad(g_loss, recon)
        heads.requires_grad_(True)
        heads.zero_grad(set_to_none=True)

    variants = {"reference": trainable(True), "ours": trainable(False), "frozen": frozen}
    times = {name: [] for name in variants}
    names = list(variants)
    for name in names:  # warm-up
        variants[name]()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def gan_step_flops(trainer) -> dict[str, float]:
    """FLOPs of one GAN step our way and the reference's way (the critic's weight gradients also computed in
    the generator's pass), in total and per network: what the step costs wherever FLOPs set its time,
    whatever the load of the machine."""
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for name, reference in (("ours", False), ("reference", True)):
        trainer.metrics.host_sync = reference
        with FlopCounterMode(display=False) as counter:
            trainer.train_step()
        per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        out[name] = float(counter.get_total_flops())
        objective = type(trainer.objective).__name__  # its own modules are counted under its name
        out[f"{name}_critic"] = float(per_module.get(type(trainer.adversary.critic).__name__, 0)  # its own pass
                                      + per_module.get(f"{objective}.critic", 0))   # the generator's pass
        out[f"{name}_lpips"] = float(per_module.get(f"{objective}.lpips", 0))
        out[f"{name}_vae"] = out[name] - out[f"{name}_critic"] - out[f"{name}_lpips"]
    trainer.metrics.host_sync = False
    out.update(frozen_gan_step_flops(trainer, out["ours_vae"]))
    return out


def frozen_gan_step_flops(trainer, vae_flops: float) -> dict[str, float]:
    """FLOPs of one GAN step with the frozen trunk (issue 19), composed of the trainer's own VAE part
    (`vae_flops`: gan_step_flops' `ours_vae`, encoder, decoder, pixel losses) and a count of the frozen
    critic's step on images of the trainer's batch shape: LPIPS' VGG16 once for the input (no grad) and
    once for the reconstruction (with grad), LPIPS from those features, the heads' own step on the detached
    features (real and fake, hinge, backward into the heads), the generator term from the heads on the
    reconstruction's features. GradNorm normalises each branch at the reconstruction, which needs each
    branch's gradient there: two backward passes through the trunk (input gradients only, its weights are
    frozen), one for LPIPS and one for the generator term."""
    from torch.utils.flop_counter import FlopCounterMode
    from critics import FeatureCriticHeads, lpips_from_features, vgg16_features
    from utils import discriminator_loss, generator_loss
    cfg = trainer.cfg
    lpips_model = trainer.objective.lpips
    device = trainer.device
    size, batch = cfg.data.vae_resolution, cfg.data.batch_size
    heads = FeatureCriticHeads().to(device)
    x = torch.rand(batch, 3, size, size, device=device) * 2 - 1
    recon = (torch.rand(batch, 3, size, size, device=device) * 2 - 1).requires_grad_(True)
    counts = {}
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            x_feats = vgg16_features(lpips_model, x)
        recon_feats = vgg16_features(lpips_model, recon)
    counts["trunk_forward"] = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        perceptual = lpips_from_features(lpips_model, recon_feats, x_feats).float().mean()
    counts["lpips_heads"] = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:  # the critic's step: heads only, on detached features
        logits = heads([torch.cat([r, f.detach()]) for r, f in zip(x_feats, recon_feats)])
        real_logits, fake_logits = logits.float().chunk(2)
        discriminator_loss(real_logits, fake_logits, "hinge").backward()
    counts["critic_heads_step"] = counter.get_total_flops()
    heads.requires_grad_(False)
    with FlopCounterMode(display=False) as counter:  # the generator term, and each branch's gradient
        g_loss = generator_loss(heads(recon_feats).float(), real_logits.detach(), "thresholded")
        torch.autograd.grad(perceptual, recon, retain_graph=True)
        torch.autograd.grad(g_loss, recon)
    counts["generator_and_backward"] = counter.get_total_flops()
    frozen = float(sum(counts.values()))
    return {"frozen": vae_flops + frozen, "frozen_critic_and_lpips": frozen,
            **{f"frozen_{k}": float(v) for k, v in counts.items()}}


def train_step_flops(trainer) -> float:
    """FLOPs of one step of the trainer as it is (host syncs off)."""
    from torch.utils.flop_counter import FlopCounterMode
    trainer.metrics.host_sync = False
    with FlopCounterMode(display=False) as counter:
        trainer.train_step()
    return float(counter.get_total_flops())


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


# ----------------------------------------------------------------------------------------------------
# Section 3b: decoder-only fine-tuning memory
# ----------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------
# Section: narrower decoders (issue 25): what a decode costs, and what the teacher buys
# ----------------------------------------------------------------------------------------------------
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
        amp = (torch.autocast(device.type, dtype=torch.bfloat16) if case["precision"] == "bf16"
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
    cmd = [sys.executable, os.path.abspath(__file__), "--_decode_case", json.dumps(case)]
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


# quality: the demo's model as the "released" wide VAE, then decoders trained behind its frozen encoder
DECODER_QUALITY_VARIANTS = ("wide_finetuned", "narrow_teacher", "narrow")


def decoder_quality_flags(vgg: str) -> dict:
    """The demo's recipe (config.DEMO) for a decoder-only run, without its architecture (--init_from's) and its
    learning rate (the trainer's rule: a new decoder's rate for a fresh one, a tenth for a fine-tune): pixel losses
    only without pretrained VGG16 (as the demo), LPIPS and the critic with them."""
    demo = config_lib.DEMO
    keep = ("vae_resolution", "batch_size", "shuffle_buffer", "warmup_steps", "mse_pool_factor", "mse_weight",
            "ema_decay", "eval_max_images")
    flags = {k: demo[k] for k in keep}
    if vgg == "torchvision":
        flags.update({k: demo[k] for k in ("perceptual_weight", "do_ganloss", "disc_start", "gan_weight")})
    else:
        flags.update(perceptual_weight=0.0, do_ganloss=False)
    return flags


def run_logged(cmd: list[str], log_path: str, env: dict) -> subprocess.Popen:
    log = open(log_path, "a")  # a run resumed in --decoder_runs_dir keeps its first log
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE)
    proc.log, proc.started = log, time.time()
    return proc


def wait_logged(procs: dict[str, subprocess.Popen]) -> dict[str, float]:
    """Wait for every process ({what it does: process}); each one's wall seconds, taken when it ended."""
    wall, running = {}, dict(procs)
    while running:
        for what, proc in list(running.items()):
            if proc.poll() is None:
                continue
            wall[what] = round(time.time() - proc.started, 1)
            proc.log.close()
            del running[what]
            if proc.returncode != 0:
                for other in running.values():
                    other.kill()
                with open(proc.log.name) as f:
                    raise RuntimeError(f"{what} failed (exit {proc.returncode}), log {proc.log.name}:\n"
                                       f"{f.read()[-3000:]}")
        time.sleep(0.5)
    return {what: wall[what] for what in procs}


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


RES_RUNS = {  # the resolutions section's runs: name -> extra flags (the schedule's switch step filled in)
    "single 64": [],
    "multi 64,96,128": ["--train_resolutions", "64,96,128"],
    "staged 64 -> 96,128": ["--train_resolutions", "64;{switch}:96,128", "--last_stage_trains", "1"],
}
RES_SERVE = (64, 128, 256)  # evaluated at the training size, 2x and 4x


def bench_resolutions(args, tmp, report: Report) -> dict:
    """Single-resolution against multi-resolution and staged training of the demo's model at equal steps and pixels
    per step, each evaluated at 1x, 2x and 4x its reference size on held-out photos (every step a real command); and
    the aspect study on the single-size model."""
    root = args.res_runs_dir or os.path.join(tmp, "resolutions")
    os.makedirs(root, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = args.res_steps
    procs = {}
    for name, extra in RES_RUNS.items():
        run = name.split()[0]
        if os.path.isfile(os.path.join(root, run, "checkpoints", f"step_{steps:08d}.pt")):
            continue
        flags = [f.format(switch=2 * steps // 3) for f in extra]
        report.line(f"  training {name}: python vae_trainer.py --demo --max_steps {steps} {' '.join(flags)} ...")
        procs[f"train {name}"] = run_logged(
            [sys.executable, "vae_trainer.py", "--demo", "--max_steps", str(steps), "--output_dir", root, "--run_name",
             run, "--save_every_n_steps", str(steps), "--evaluate_every_n_steps", str(steps), "--inception_weights",
             "none", "--wandb_mode", "disabled", "--num_threads", "1", "--seed", str(args.seed), *flags],
            os.path.join(root, f"{run}.log"), env)
    wall = wait_logged(procs)
    _, demo_test = shards.ensure_demo_shards(os.path.join(root, "demo_data"))  # built by the first run
    heldout = {"demo": demo_test, **({"extra": args.res_heldout_url} if args.res_heldout_url else {})}
    vgg = "torchvision" if os.path.isfile(vgg16_cache_path()) else "random"
    out = {"steps": steps, "vgg16": vgg, "wall_s": wall, "runs": {}}
    rows = []
    for name in RES_RUNS:
        run_dir = os.path.join(root, name.split()[0])
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            logged = [r for r in map(json.loads, f) if "img_per_s" in r]
        # img/s counts images of the reference size (4 a step, the demo's batch), whatever size a step trained at
        result = {"s_per_step": 4 / logged[-1]["img_per_s_avg"], "eval": {}}
        for set_name, url in heldout.items():
            for size in RES_SERVE:
                proc = subprocess.run(
                    [sys.executable, "evaluate.py", "--ckpt", run_dir, "--ema", "--dataset_url", url, "--resolution",
                     str(size), "--vgg16_weights", vgg, "--inception_weights", "none", "--batch_size", "2"],
                    cwd=HERE, env=env, capture_output=True, text=True, check=True)
                metrics = json.loads(proc.stdout)
                result["eval"][f"{set_name}@{size}"] = {k: metrics.get(k) for k in ("psnr", "ssim", "lpips", "images")}
                rows.append([name, set_name, size, metrics.get("psnr"), metrics.get("ssim"), metrics.get("lpips")])
        out["runs"][name] = result
    report.table(f"Held-out reconstruction after {steps} steps (EMA; LPIPS with {vgg} VGG16)",
                 ["run", "photos", "px", "PSNR", "SSIM", "LPIPS"], rows)
    out["aspect"] = aspect_study(os.path.join(root, "single"), list(heldout.values()), report)
    return out


def aspect_study(run_dir: str, urls: list[str], report: Report) -> dict:
    """Whether aspect-ratio buckets could matter to a convolutional VAE: does the shape of the input change what a
    model trained on squares reconstructs? The same 64x64 region (the centre of each held-out photo resized to 96 px
    on its shorter side) reconstructed from the square alone, from a 64x96 and a 96x64 input around it, and from the
    whole photo; PSNR over that region (and over each whole input)."""
    import checkpoint
    vae, _ = checkpoint.load_model(run_dir, ema=True)
    f = vae.downsample_factor
    photos = []
    for url in urls:
        for shard in data_lib.list_shards(url):
            for _, sample in data_lib.iter_shard(shard, Counter()):
                img = Image.fromarray(data_lib.load_rgb(data_lib._pick_image(sample)))
                scale = 96 / min(img.size)
                img = img.resize((max(96, round(img.width * scale)), max(96, round(img.height * scale))),
                                 Image.Resampling.BICUBIC)
                photos.append(torch.from_numpy(np.array(img)).permute(2, 0, 1))
    cases = {"square 64x64": (0, 0, 64, 64), "wide 64x96": (0, -16, 64, 96), "tall 96x64": (-16, 0, 96, 64)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in [*cases, "whole photo"]}

    def psnr(a, b) -> float:
        return float(10 * torch.log10(4.0 / ((a - b) ** 2).mean()))
    for photo in photos:
        x = photo[None].float() / 127.5 - 1
        h, w = (s // f * f for s in x.shape[-2:])
        x = x[:, :, :h, :w]
        top, left = h // 2 - 32, w // 2 - 32
        target = x[:, :, top:top + 64, left:left + 64]
        for name, (dt, dl, hh, ww) in {**cases, "whole photo": (-top, -left, h, w)}.items():
            t, l = top + dt, left + dl
            with torch.no_grad():
                recon = vae.decode(vae.encode(x[:, :, t:t + hh, l:l + ww])).clamp(-1, 1)
            results[name].append((psnr(recon[:, :, -dt:-dt + 64, -dl:-dl + 64], target),
                                  psnr(recon, x[:, :, t:t + hh, l:l + ww])))
    out = {name: {"region_psnr": [round(r, 2) for r, _ in v], "region_psnr_mean": float(np.mean([r for r, _ in v])),
                  "input_psnr_mean": float(np.mean([w for _, w in v]))} for name, v in results.items()}
    report.table(f"The same 64x64 region of {len(photos)} held-out photos, by the shape of the input (EMA)",
                 ["input", "region PSNR (mean)", "whole input PSNR (mean)"],
                 [[name, v["region_psnr_mean"], v["input_psnr_mean"]] for name, v in out.items()])
    return out


def bench_decoder_quality(args, tmp, report: Report) -> dict:
    """A narrower decoder trained with and without the teacher, against the wide decoder, at equal steps: every
    step a real command. The demo's model trained --wide_steps steps (`vae_trainer.py --demo`) is the "released"
    wide VAE, exported as a diffusers folder (`export.py --ema`) so that it serves as --init_from; then, behind its
    frozen encoder (--train_parts decoder), --decoder_steps steps each of: the wide decoder fine-tuned; a decoder of
    --narrow_widths started fresh with --distill_weight 1; the same without. Held-out PSNR/SSIM by `evaluate.py`
    (EMA weights) on the demo's 4 held-out photos at 64 px, and a grid of their reconstructions."""
    from dataclasses import replace

    import pretrained
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
    source = pretrained.load_source(released)
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


# ----------------------------------------------------------------------------------------------------
# Section: the copy, cast and layout traffic of one step, counted at the dispatcher (issue 30)
# ----------------------------------------------------------------------------------------------------
COPY_OPS = ("_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", "contiguous")


class CopyCensus(TorchDispatchMode):
    """The copies, casts and layout changes of the aten ops run inside it: their count and the bytes they write,
    each sorted as a "cast" (another dtype) or a "copy" (the same dtype: a clone, a layout change), of a parameter's
    shape (autocast's per-step bf16 copy of each weight, its gradient's cast back: a fixed cost, not per pixel) or of
    an activation (what grows with the batch and the resolution, and what a step on a GPU must not move).

    `cuda_layouts`: also the copies that CUDA's kernels make inside themselves, which the same step on a CPU does not
    show (PyTorch 2.x sources): native_group_norm and its backward work on NCHW-contiguous copies of their inputs off
    the CPU and return NCHW (aten/src/ATen/native/group_norm.cpp), and cuDNN convolves input, weight and gradient in
    one memory format, channels_last if the input or the weight is (cudnn_conv_suggest_memory_format), copying the
    others. The census counts those as copies, and gives group_norm's outputs CUDA's NCHW layout, so that the ops
    after it meet the layouts they meet on a GPU. Autocast's op lists differ between CPU and CUDA (CUDA's casts the
    inputs of pow, sum and a few others to fp32): those casts, in LPIPS' feature normalisation, are not counted."""

    def __init__(self, parameter_shapes=(), cuda_layouts: bool = True):
        super().__init__()
        self.parameter_shapes = {tuple(s) for s in parameter_shapes}
        self.cuda_layouts = cuda_layouts
        self.counts: Counter = Counter()  # (kind, what) -> ops; kind: cast / copy / cuda_copy; what: parameter / activation
        self.bytes: Counter = Counter()

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        what = "parameter" if tuple(tensor.shape) in self.parameter_shapes else "activation"
        self.counts[kind, what] += 1
        self.bytes[kind, what] += tensor.numel() * tensor.element_size()

    def _implied(self, tensors, memory_format) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous(memory_format=memory_format):
                self._record("cuda_copy", t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.cuda_layouts and name in ("native_group_norm", "native_group_norm_backward"):
            # forward: X; backward: dY, X (mean and rstd are (N, G))
            self._implied(args[:1] if name == "native_group_norm" else args[:2], torch.contiguous_format)
        elif self.cuda_layouts and name in ("convolution", "convolution_backward"):
            inputs = args[:2] if name == "convolution" else args[:3]  # (input, weight) / (grad, input, weight)
            image, weight = inputs[-2], inputs[-1]
            channels_last = any(t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                                and not t.is_contiguous() for t in (image, weight))
            self._implied(inputs, torch.channels_last if channels_last else torch.contiguous_format)
        out = func(*args, **kwargs)
        if name in COPY_OPS:
            source = next((a for a in args if isinstance(a, torch.Tensor)), None)
            written = args[0] if name == "copy_" else out
            if name == "copy_":
                source = args[1]
            if isinstance(written, torch.Tensor) and source is not None:
                self._record("cast" if written.dtype != source.dtype else "copy", written)
        if self.cuda_layouts and name in ("native_group_norm", "native_group_norm_backward"):
            out = tuple(o.contiguous() if isinstance(o, torch.Tensor) and o.dim() == 4 else o for o in out)
        return out

    def summary(self) -> dict:
        """{kind/what: {"ops": n, "mib": MiB}} and the totals of activation traffic."""
        rows = {f"{kind}/{what}": {"ops": self.counts[kind, what], "mib": mib(self.bytes[kind, what])}
                for kind, what in sorted(self.counts)}
        activation = [key for key in self.counts if key[1] == "activation"]
        rows["activation_total"] = {"ops": sum(self.counts[k] for k in activation),
                                    "mib": mib(sum(self.bytes[k] for k in activation))}
        return rows


def parameter_shapes(*modules) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for module in modules if module is not None for p in module.parameters()]


def step_census(trainer, cuda_layouts: bool = True) -> CopyCensus:
    """The copy census of one Trainer.train_step() (after one step outside it: the optimizer's state exists)."""
    census = CopyCensus(parameter_shapes(trainer.vae, trainer.objective), cuda_layouts)
    with census:
        if trainer.adversary is not None:  # what the loop does before each step (a few KB of critic buffers)
            trainer.adversary.step_began()
        trainer.train_step()
    trainer.step += 1
    return census


def bench_copies(args, url, tmp, device, report: Report) -> dict:
    """The census of one step of the FLUX-width VAE (no attention, as issue 30's profile) with LPIPS and the frozen
    VGG16 critic, for each precision and memory format, at 128 px (activation bytes scale with the pixels)."""
    out, rows = {}, []
    for precision in ("fp32", "bf16"):
        for layout in ("false", "true"):
            trainer = build_trainer(url, tmp, f"copies_{precision}_{layout}", torch.device("cpu"), **FLUX_CONFIG,
                                    do_attn=False, vae_resolution=128, batch_size=2, precision=precision,
                                    channels_last=layout, do_ganloss=True, critic_trunk="frozen", memory_check=False)
            trainer.train_step()
            trainer.step += 1
            summary = step_census(trainer).summary()
            trainer.close()
            name = f"{precision}_{'channels_last' if layout == 'true' else 'nchw'}"
            out[name] = summary
            total = summary["activation_total"]
            params = {k: v for k, v in summary.items() if k.endswith("/parameter")}
            rows.append([precision, "channels_last" if layout == "true" else "NCHW", total["ops"], total["mib"],
                         sum(v["ops"] for v in params.values()), sum(v["mib"] for v in params.values())])
    report.table("Copies and casts of one step, FLUX width at 128 px, batch 2, LPIPS + frozen VGG16 critic "
                 "(CPU dispatch count, with the copies CUDA's GroupNorm and cuDNN add)",
                 ["precision", "VAE layout", "activation ops", "activation MiB", "parameter ops", "parameter MiB"],
                 rows)
    out["cpu_bf16_step_s"] = group_norm_step_times(url, tmp, report)
    return out


def fp32_copy_group_norm(self, x):
    """GroupNorm32 before issue 30: an fp32 copy of the input normalised, the output cast back."""
    with torch.autocast(x.device.type, enabled=False):
        out = torch.nn.functional.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(),
                                             self.eps)
    return out.to(x.dtype)


def group_norm_step_times(url, tmp, report: Report, rounds: int = 8) -> dict:
    """The CPU's bf16 step (the train section's small config, channels_last: a CPU's default) with GroupNorm32 as
    it is and as it was (fp32_copy_group_norm), interleaved in one process: does the CPU path get slower?"""
    import ae
    trainer = build_trainer(url, tmp, "gn_times", torch.device("cpu"), **TRAIN_CONFIGS["small"], precision="bf16",
                            channels_last="true", memory_check=False)
    variants, times = {"bf16 statistics in the kernel": ae.GroupNorm32.forward,
                       "fp32 copy (before)": fp32_copy_group_norm}, {}
    timed_step(trainer)
    try:
        for r in range(rounds):
            for name in list(variants)[r % 2:] + list(variants)[:r % 2]:
                ae.GroupNorm32.forward = variants[name]
                times.setdefault(name, []).append(timed_step(trainer))
    finally:
        ae.GroupNorm32.forward = variants["bf16 statistics in the kernel"]
    trainer.close()
    out = {name: median(t) for name, t in times.items()}
    report.table("The CPU's bf16 step by GroupNorm (small config, channels_last, interleaved)", ["GroupNorm", "s/step"],
                 [[name, value] for name, value in out.items()])
    return out


# ----------------------------------------------------------------------------------------------------
# Section: does the default precision train as well as strict fp32 (issue 30), TF32 emulated on the CPU
# ----------------------------------------------------------------------------------------------------
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
                "tf32": [sys.executable, "-c", "import sys, bench; sys.exit(bench.tf32_trainer_main(sys.argv[1:]))"],
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


# ----------------------------------------------------------------------------------------------------
# Section 4: FLUX size on a GPU, bf16 vs fp32
# ----------------------------------------------------------------------------------------------------
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
    trainer.objective.amp_dtype = None
    if trainer.adversary is not None:
        trainer.adversary.amp_dtype = None
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


def spawn_gpu_case(case: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_gpu_case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
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


# ----------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------
def summarize(results: dict) -> dict:
    keys = {}
    d = results.get("data", {}).get("formats", {})
    if d:
        keys["pipeline_fraction_of_decode"] = d["png"]["ours"]["fraction_of_decode"]
        keys["pipeline_fraction_of_decode_jpeg"] = d["jpeg"]["ours"]["fraction_of_decode"]
        keys["pipeline_fraction_of_decode_jpeg_resize0.5"] = d["jpeg"]["ours_resize0.5"]["fraction_of_decode"]
        keys["naive_fraction_of_decode"] = d["png"]["naive"]["fraction_of_decode"]
        keys["naive_fraction_of_decode_jpeg"] = d["jpeg"]["naive"]["fraction_of_decode"]
    t = results.get("train")
    if t and "speedup_all_on" in t:
        keys["train_step_speedup"] = t["speedup_all_on"]
        keys["train_step_speedup_sync_free"] = t["speedup_sync_free"]
        keys["train_step_speedup_channels_last"] = t["speedup_channels_last"]
        keys["train_step_speedup_compile"] = t["speedup_compile"]
        keys[f"{results['device']}_bf16_speedup_{t['config']['name']}"] = t["bf16_speedup"]
    if t:
        if t.get("gan_step_flops"):
            keys["gan_step_flop_speedup"] = t["gan_step_flops"]["reference"] / t["gan_step_flops"]["ours"]
            frozen = t["gan_step_flops"].get("frozen_trainer", t["gan_step_flops"].get("frozen"))
            if frozen:
                keys["gan_step_flop_speedup_frozen"] = t["gan_step_flops"]["reference"] / frozen
        if t.get("frozen_trunk_speedup"):
            keys["gan_step_wall_speedup_frozen"] = t["frozen_trunk_speedup"]
    m = results.get("memory", {}).get("cases", {})
    for res in (256, 512):
        hr = m.get(f"decoder_hr@{res}")
        if hr and "saving_increase" in hr:
            keys[f"ckpt_memory_saving_{res}"] = hr["saving_increase"]
            keys[f"ckpt_memory_saving_{res}_of_total_peak"] = hr["saving_total"]
            keys[f"ckpt_time_cost_{res}"] = hr["time_cost"]
        both = m.get(f"hr@{res}")
        if both and "saving_increase" in both:
            keys[f"ckpt_memory_saving_{res}_hr"] = both["saving_increase"]
            keys[f"ckpt_time_cost_{res}_hr"] = both["time_cost"]
    if "flop_cost" in results.get("memory", {}):
        keys["ckpt_flop_cost"] = results["memory"]["flop_cost"]["decoder_hr"]
        keys["ckpt_flop_cost_hr"] = results["memory"]["flop_cost"].get("hr")
    if "interleaved_time_cost_512" in results.get("memory", {}):
        keys["ckpt_time_cost_512_separate_processes"] = keys.get("ckpt_time_cost_512")
        keys["ckpt_time_cost_512"] = results["memory"]["interleaved_time_cost_512"]
    f = results.get("finetune", {}).get("cases", {})
    if f:
        keys["finetune_decoder_memory_saving_512"] = f["decoder"]["saving_increase"]
        keys["finetune_decoder_hr_memory_saving_512"] = f["decoder+decoder_hr"]["saving_increase"]
        keys["finetune_decoder_hr_bf16_memory_saving_512"] = f["decoder+decoder_hr+bf16"]["saving_increase"]
    q = results.get("quality")
    if q:
        for metric in ("psnr", "ssim"):
            for name in ("defaults", "reference", "plain_mse"):
                keys[f"quality_{metric}_{name}"] = q["variants"][name][metric]
            keys[f"quality_{metric}_over_reference"] = q[f"{metric}_over_reference"]
            keys[f"quality_{metric}_over_floor"] = q[f"{metric}_over_floor"]
    dec = results.get("decoders")
    if dec:
        for precision, ratios in dec["variants"].items():
            for what, ratio in ratios.items():
                keys[f"small_decoder_{what}_{dec['device']}_{precision}"] = ratio
    dq = results.get("decoder_quality")
    if dq:
        keys["narrow_decoder_flop_ratio"] = dq["flop_ratio"]
        for key, value in dq.items():
            if key.startswith("teacher_"):
                keys[f"narrow_decoder_{key}"] = value
    g = results.get("gpu")
    if g:
        def rate(size, case):
            return g.get(f"{size}/{case}", {}).get("img_per_s")
        for size in GPU_SIZES:
            for key, ours, reference in (("eager", "ours_bf16_frozen", "reference_eager"),
                                         ("compiled", "ours_bf16_frozen_compiled", "reference_compiled"),
                                         ("default", "ours_default", "reference_eager"),
                                         ("nchw_over_channels_last", "ours_bf16_frozen",
                                          "ours_bf16_frozen_channels_last")):
                if rate(size, ours) and rate(size, reference):
                    keys[f"gpu_{key}_speedup_{size}"] = rate(size, ours) / rate(size, reference)
            peak, reference_peak = (g.get(f"{size}/{c}", {}).get("peak_gib") for c in ("ours_bf16_frozen",
                                                                                       "reference_eager"))
            if peak and reference_peak:
                keys[f"gpu_peak_ratio_{size}"] = peak / reference_peak
            if g.get(f"{size}/ours_bf16_frozen", {}).get("copy_fraction") is not None:
                keys[f"gpu_copy_fraction_{size}"] = g[f"{size}/ours_bf16_frozen"]["copy_fraction"]
    c = results.get("copies")
    if c:
        for name, summary in c.items():
            keys[f"copies_activation_mib_{name}"] = summary["activation_total"]["mib"]
    p = results.get("precision")
    if p:
        for name in ("tf32", "bf16"):
            keys[f"precision_{name}_minus_fp32_ema_psnr"] = min(p[f"{name}_minus_fp32_final_ema_psnr"])
    return keys


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._memory_case:  # a child process of the memory section
        with contextlib.redirect_stdout(sys.stderr):
            result = run_memory_case(json.loads(args._memory_case))
        print(json.dumps(result), flush=True)
        return 0
    if args._gpu_case:  # a child process of the gpu section
        with contextlib.redirect_stdout(sys.stderr), contextlib.redirect_stderr(io.StringIO()):
            result = run_gpu_case(json.loads(args._gpu_case))
        print(json.dumps(result), flush=True)
        return 0
    if args._decode_case:  # a child process of the decoders section
        with contextlib.redirect_stdout(sys.stderr):
            result = run_decode_case(json.loads(args._decode_case))
        print(json.dumps(result), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")  # as vae_trainer.init_distributed
    if not args.steps_per_round:
        args.steps_per_round = 10 if cuda else 1
    if args.threads:
        torch.set_num_threads(args.threads)
    json_out = sys.stdout
    report = Report(sys.stderr if args.json else sys.stdout)
    started = time.time()
    results = {
        "command": "python bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    report.line(f"bench.py on {results['device_name']} ({device.type}; {os.cpu_count()} CPUs, torch "
                f"{torch.__version__}, {torch.get_num_threads()} threads); VGG16 weights random (timing only)")
    # Trainer construction and the data tools print progress lines: keep stdout for the JSON object
    with contextlib.redirect_stdout(report.stream), tempfile.TemporaryDirectory(prefix="vae_bench_") as tmp:
        if set(args.sections) - {"quality", "decoders", "decoder_quality", "resolutions", "precision"}:
            report.line(f"generating {args.images} photo-like {args.height}x{args.width} images as PNG and JPEG "
                        "shards ...")
            datasets = make_datasets(tmp, args.images, args.height, args.width, args.seed)
            results["datasets"] = {k: {"url_pattern": os.path.basename(v["url"]), "mean_file_kib": v["mean_file_kib"]}
                                   for k, v in datasets.items()}
            train_url = datasets["jpeg"]["url"]  # any real crops do for the model sections
        if "data" in args.sections:
            results["data"] = bench_data(args, datasets, report)
        if "train" in args.sections:
            results["train"] = bench_train(args, train_url, tmp, device, report)
        if "memory" in args.sections:
            results["memory"] = bench_memory(args, train_url, tmp, device, report)
        if "finetune" in args.sections:
            results["finetune"] = bench_finetune(args, train_url, tmp, device, report)
        if "quality" in args.sections:
            results["quality"] = bench_quality(args, tmp, report)
        if "latents" in args.sections:
            results["latents"] = bench_latents(args, train_url, tmp, device, report)
        if "decoders" in args.sections:
            results["decoders"] = bench_decoders(args, device, report)
        if "decoder_quality" in args.sections:
            results["decoder_quality"] = bench_decoder_quality(args, tmp, report)
        if "resolutions" in args.sections:
            results["resolutions"] = bench_resolutions(args, tmp, report)
        if "copies" in args.sections:
            results["copies"] = bench_copies(args, train_url, tmp, device, report)
        if "precision" in args.sections:
            results["precision"] = bench_precision(args, tmp, report)
        if "gpu" in args.sections and device.type == "cuda":
            results["gpu"] = bench_gpu(args, train_url, tmp, device, report)
        elif "gpu" in args.sections:
            report.line("\ngpu section skipped: no CUDA device (gpu_* not measured)")
    results["elapsed_s"] = round(time.time() - started, 1)
    results["load_average_at_end"] = list(os.getloadavg())  # > the core count: other processes shared the CPUs
    keys = summarize(results)
    results = {**keys, **results}
    targets = {}
    for key, (op, threshold) in TARGETS.items():
        value = keys.get(key)
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        targets[key] = {"value": value, "target": f"{op} {threshold}", "met": met}
    results["targets"] = targets
    report.table("Targets", ["key", "value", "target", "met"],
                 [[k, "not measured" if v["value"] is None else v["value"], v["target"],
                   "-" if v["met"] is None else ("yes" if v["met"] else "NO")] for k, v in targets.items()])
    report.line(f"\ntotal {results['elapsed_s']:.0f} s")
    if args.json:
        print(json.dumps(finite(results), indent=1), file=json_out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
