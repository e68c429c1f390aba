"""Speed and memory benchmarks of the VAE trainer and its input pipeline, in one run.

    python bench.py --quick --json     # under two minutes on 2 idle CPU cores; one JSON object on stdout
    python bench.py                    # the full run: 8-10 minutes on 2 idle CPU cores
    python bench.py --sections train --config flux --gan    # one section, another model size
    python bench.py --sections cuda --json > cuda.json        # the first command when a GPU is lent: < 8 minutes

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
  video (only when named in --sections) Fine-tuning Wan's video VAE on clips (issue 33; bench/video.py): the memory
          check's estimate for one clip per GPU of Wan 2.1's VAE as released, three recipes x --video_memory_frames x
          --video_memory_sizes; and, with real commands, a small Wan-structured VAE trained on moving-camera clips of
          the demo's photos (--video_release_steps; the "release", exported), then fine-tuned on clips of
          --video_photos (decoder only, the same with --temporal_weight 1, the whole VAE; --video_finetune_steps
          each, concurrently), `evaluate.py --video_frames` of each on held-out clips: per-frame PSNR/SSIM, temporal
          PSNR.
  video_critic (only when named in --sections) The spatio-temporal critic against the frame critic (issue 42;
          bench/video_critic.py): a small Wan-structured VAE trained on clips of the demo's photos with
          --discriminator patchgan (frames) and patchgan3d (clips), each with --temporal_weight 1, and without a
          critic (--critic_variants x --critic_seeds, --critic_steps each, concurrently); `evaluate.py --video_frames`
          on held-out clips: per-frame PSNR, temporal PSNR, tLP; and each critic's share of one micro-batch's time.
  video_decode (only when named in --sections) Issue 42 (bench/video_decode.py): frames decoded per delivered clip
          and clips/s of one data worker against PyAV's raw decode rate of the same files (the limit), on 2 s and 10 s
          H.264 videos (256x256, 30 fps, keyframes <= 250 apart): the code before issue 42 (from frame 0), a seek per
          clip, and the passes of --video_pass_frames (under 2 minutes on 2 CPU cores).
  video_chunks (only when named in --sections) Long clips trained in temporal chunks (issue 42 item 2;
          bench/video_chunks.py): a small Wan-structured VAE's training step on one clip, whole against
          --train_time_chunks 8,2 and 4,1 at --chunks_frames (peak RSS per fresh process, step time); the memory
          check's estimate for Wan 2.1's VAE, decoder only, bf16, at --chunks_estimate_size px, whole and chunked.
  families (only when named in --sections) Issue 39 (bench/families.py): the memory check's estimate per GPU for LTX-2's
          and HunyuanVideo 1.5's VAE at diffusers' default configs (decoder only and whole, --families_frames x
          --families_sizes), and Wan's VAE through wan_ae.py and through diffusers' own AutoencoderKLWan on the same
          clips (step time and saved bytes).
  cuda    (only when named in --sections) The first hour on a GPU in one command (issue 48; bench/cuda.py), within
          --cuda_budget_s: 3 bf16 training steps of every family on CUDA (ldm, Wan clips whole and chunked, the 3D
          critic, every diffusers class at its tiny config), finite and without a host sync in the step; the memory
          check's estimate against torch.cuda.max_memory_allocated for LTX-2's and HunyuanVideo 1.5's VAE; the gpu
          section's GAN step at FLUX width, 256 px, eager and compiled; a 2-rank --sharding fsdp run over NCCL where
          a second GPU exists. One table (a row per check: ok, FAILED and why, skipped and why); on a machine
          without CUDA every row is skipped with its reason.
  memory_check (only when named in --sections) The memory check's estimate against the measured peak, per family at
          a real configuration (issue 48 item 6; bench/memory_check.py), each case a fresh process running the real
          Trainer with the check on: on a CPU the peak RSS over --check_steps steps against the estimate's peak (the
          step's tensors and the process besides them), for --check_cases; on CUDA torch.cuda.max_memory_allocated
          against its tensors, for LTX-2's and HunyuanVideo 1.5's VAE (decoder only, 17 frames of 256 px, bf16).
  sharding (only when named in --sections) What --sharding fsdp's communication adds (bench/sharding.py; under
          5 minutes on 2 CPU cores): real `torchrun --nproc_per_node 2 vae_trainer.py --demo` runs on gloo with
          --sharding ddp and fsdp, alternated over --sharding_rounds of --sharding_steps steps, the step time fsdp/ddp
          from the trainer's logged img/s (the first window left out); and the bytes each sends per step from the
          parameter counts, with their time over NVLink and InfiniBand for LTX-2's VAE on 8 and 16 GPUs.
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
          hyperparameters written with our flags (bench.quality.reference_flags), and plain MSE with the reference's
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

  tae (only when named in --sections) Issue 47 (bench/tae.py): the released TAEF2 fine-tuned on 128 px crops of 8
          photos of one kind (--tae_photos, split by photo: 8 train, 2 validate, 2 test) with real commands, each case
          of --tae_cases --tae_steps steps concurrently (one thread each): the issue's plain-MSE loop (lr 1e-4, no
          EMA), lr 5e-5 and the tae family's fine-tune default 1e-5, decoder only and whole, with and without the
          PatchGAN; held-out
          PSNR/SSIM (evaluate.py) of the test photos' crops and of scikit-image's photos, final EMA weights and the
          best checkpoint, against the release's. And a decoder trained from scratch for TAEF2's latents
          (--distill_from, --tae_student_steps), its validation PSNR against steps against TAEF2's own decoder.

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
  cuda_rows_ok, cuda_rows_failed, cuda_rows_skipped  cuda: the rows of its table by status (no target; on a
                               machine without CUDA all skipped)
  memory_check_ratio_<case>    memory_check: the memory check's estimated peak / the measured peak (docs/training.md
                               promises 0.75-1.25 on a CPU; no target key: one per case)
  sharding_fsdp_over_ddp_step_cpu  sharding: s/step under --sharding fsdp / under ddp, 2 gloo ranks on the CPU
                               (no target)
The peak increase is the peak minus the memory in use right before the first training step, i.e. what
the step itself needs (activations, gradients, optimizer state), the part checkpointing acts on.

Variants are interleaved round by round and medians are reported, because a shared machine's timings are
noisy. LPIPS and the discriminator use randomly initialised VGG16 weights (--vgg16_weights random):
speed and memory do not depend on the weight values.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import torch

from bench.copies import bench_copies
from bench.cuda import bench_cuda
from bench.data import bench_data
from bench.decoder_quality import bench_decoder_quality
from bench.decoders import bench_decoders, run_decode_case
from bench.finetune import bench_finetune
from bench.gpu import GPU_SIZES, bench_gpu, run_gpu_case
from bench.harness import TRAIN_CONFIGS
from bench.images import make_datasets
from bench.latents import bench_latents
from bench.machine import cpu_flags, cpu_model
from bench.memory import CKPT_LEVELS, bench_memory, run_memory_case
from bench.precision import bench_precision
from bench.quality import bench_quality
from bench.report import Report, finite
from bench.resolutions import bench_resolutions
from bench.train import bench_train
from bench.video import bench_video
from bench.video_critic import bench_video_critic
from bench.video_decode import bench_video_decode
from bench.video_chunks import bench_video_chunks
from bench.families import bench_families
from bench.sharding import bench_sharding
from bench.tae import CASES as TAE_CASES, bench_tae
from bench.memory_check import DEFAULT_CASES as CHECK_CASES, bench_memory_check


SECTIONS = ("data", "train", "memory", "gpu", "quality", "finetune", "latents", "decoders", "decoder_quality",
            "resolutions", "copies", "precision", "video", "video_critic", "video_decode", "video_chunks",
            "families", "sharding", "memory_check", "cuda", "tae")
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
                        "quality trains for one to two hours on 2 CPU cores, finetune and sharding take ~5 minutes, "
                        "decoders and decoder_quality several; gpu runs on CUDA only)")
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
    g = p.add_argument_group("video_decode")
    g.add_argument("--video_decode_frames", type=int, default=17, help="frames per clip of the video_decode section")
    g.add_argument("--video_decode_clips", type=int, default=48, help="clips each reader delivers per round")
    g.add_argument("--video_decode_short", type=int, default=8, help="2 s videos of the video_decode section")
    g.add_argument("--video_decode_long", type=int, default=4, help="10 s videos of the video_decode section")
    g.add_argument("--video_decode_rounds", type=int, default=3, help="interleaved rounds of the video_decode section")
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
    g = p.add_argument_group("tae")
    g.add_argument("--tae_photos", default="/usr/share/backgrounds/mate/nature",
                   help="12 photos of one kind (sorted by name: 8 to train on, 2 to validate, 2 to test), e.g. Debian's "
                        "mate-backgrounds' nature photos")
    g.add_argument("--tae_steps", type=int, default=150, help="steps of each fine-tune of TAEF2")
    g.add_argument("--tae_cases", default=",".join(TAE_CASES), help="comma-separated fine-tune cases")
    g.add_argument("--tae_student_steps", type=int, default=600,
                   help="steps of the decoder trained from scratch for TAEF2's latents (0: none)")
    g.add_argument("--tae_runs_dir", default="", help="keep the tae section's runs here (finished runs are not "
                                                      "trained again)")
    g = p.add_argument_group("resolutions")
    g.add_argument("--res_steps", type=int, default=600, help="steps of each run of the resolutions section")
    g.add_argument("--res_heldout_url", default="",
                   help="more held-out photos (shards or a folder) for the resolutions section's evaluation")
    g.add_argument("--res_runs_dir", default="",
                   help="keep the resolutions section's runs here (default: a temporary folder); finished runs are "
                        "not trained again")
    g = p.add_argument_group("video")
    g.add_argument("--video_memory_frames", default="17,33", help="clip lengths of the video memory table")
    g.add_argument("--video_memory_sizes", default="256,480", help="frame sizes of the video memory table")
    g.add_argument("--video_frames", type=int, default=9, help="clip length of the video quality runs (1 + 4k)")
    g.add_argument("--video_release_steps", type=int, default=600,
                   help="steps of the run that is the released small Wan-structured VAE")
    g.add_argument("--video_finetune_steps", type=int, default=300, help="steps of each fine-tune from it")
    g.add_argument("--video_photos", default="/usr/share/backgrounds/mate/nature",
                   help="photos of the fine-tunes' domain (a quarter held out; default mate-backgrounds' nature "
                        "photos; without 4 of them, the demo's held-out photos)")
    g.add_argument("--video_runs_dir", default="", help="keep the video runs here (default: a temporary folder)")
    g.add_argument("--video_skip_memory", action="store_true", help="the video section without its memory table")
    g.add_argument("--video_skip_quality", action="store_true", help="the video section without its quality runs")
    g = p.add_argument_group("video_critic")
    g.add_argument("--critic_variants", default="patchgan,patchgan3d,none",
                   help="the video critic section's runs: patchgan (frames) and patchgan3d (clips), each with "
                        "--temporal_weight 1, and none (the temporal term alone)")
    g.add_argument("--critic_seeds", default="0,1", help="seeds of the video critic section's runs")
    g.add_argument("--critic_steps", type=int, default=240, help="steps of each run of the video critic section")
    g.add_argument("--critic_batch", type=int, default=2, help="clips per step of the video critic section")
    g.add_argument("--critic_disc_start", type=int, default=40, help="the GAN's first step in the video critic runs")
    g.add_argument("--critic_runs_dir", default="", help="keep the video critic runs here (default: a temporary "
                                                         "folder); finished runs are not trained again")
    g = p.add_argument_group("video_chunks")
    g.add_argument("--chunks_frames", default="17,33,81", help="clip lengths of the video_chunks section")
    g.add_argument("--chunks_size", type=int, default=64, help="frame size of the video_chunks section's steps")
    g.add_argument("--chunks_steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    g.add_argument("--chunks_estimate_size", type=int, default=480, help="frame size of the Wan 2.1 estimate")
    g.add_argument("--chunks_probes", default="32,64", help="the probe sizes of the Wan 2.1 estimate")
    g.add_argument("--chunks_plans", default="8,2;4,1", help="the chunk plans against the whole clip, ';'-separated")
    g.add_argument("--chunks_checkpointing", default="decoder",
                   help="--grad_checkpointing values of the Wan 2.1 estimate, comma-separated")
    g.add_argument("--chunks_skip_measured", action="store_true", help="video_chunks without its measured steps")
    g.add_argument("--chunks_skip_estimate", action="store_true", help="video_chunks without the Wan 2.1 estimate")
    g = p.add_argument_group("families")
    g.add_argument("--families_frames", default="17,33", help="clip lengths of the families memory table")
    g.add_argument("--families_sizes", default="256,480", help="frame sizes of the families memory table")
    g.add_argument("--families_steps", type=int, default=5, help="interleaved steps of each path of Wan's VAE")
    g.add_argument("--families_skip_memory", action="store_true", help="the families section without its memory table")
    g = p.add_argument_group("cuda")
    g.add_argument("--cuda_budget_s", type=float, default=450.0,
                   help="wall-clock budget of the cuda section: a row no time is left for is skipped, saying so")
    g = p.add_argument_group("memory_check")
    g.add_argument("--check_cases", default=",".join(CHECK_CASES),
                   help="the CPU cases of the memory_check section (bench/memory_check.py's CASES)")
    g.add_argument("--check_steps", type=int, default=2, help="training steps of each memory_check case")
    g = p.add_argument_group("sharding")
    g.add_argument("--sharding_steps", type=int, default=25,
                   help="steps of each measured run of the sharding section (logged every 5; the first 5 not timed)")
    g.add_argument("--sharding_rounds", type=int, default=1,
                   help="rounds of the sharding section, each a --sharding ddp and a fsdp run (alternating order)")
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
            if "activation_total" in summary:  # (beside the cases: the CPU's bf16 step times by GroupNorm)
                keys[f"copies_activation_mib_{name}"] = summary["activation_total"]["mib"]
    for name, case in results.get("memory_check", {}).items():
        if "ratio" in case:
            keys[f"memory_check_ratio_{name}"] = case["ratio"]
    if results.get("cuda"):
        for status, count in results["cuda"]["counts"].items():
            keys[f"cuda_rows_{status.lower()}"] = count
    s = results.get("sharding")
    if s:
        keys["sharding_fsdp_over_ddp_step_cpu"] = s["measured"]["fsdp_over_ddp"]
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
        if set(args.sections) - {"quality", "decoders", "decoder_quality", "resolutions", "precision", "video",
                                 "video_critic", "video_decode", "video_chunks", "families", "sharding",
                                 "memory_check", "cuda", "tae"}:
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
        if "video" in args.sections:
            results["video"] = bench_video(args, tmp, report)
        if "video_critic" in args.sections:
            results["video_critic"] = bench_video_critic(args, tmp, report)
        if "video_decode" in args.sections:
            results["video_decode"] = bench_video_decode(args, tmp, report)
        if "video_chunks" in args.sections:
            results["video_chunks"] = bench_video_chunks(args, report)
        if "families" in args.sections:
            results["families"] = bench_families(args, report)
        if "sharding" in args.sections:
            results["sharding"] = bench_sharding(args, tmp, report)
        if "memory_check" in args.sections:
            results["memory_check"] = bench_memory_check(args, device, report)
        if "cuda" in args.sections:
            results["cuda"] = bench_cuda(args, tmp, report)
            if results["cuda"]["gpu"]:
                results.setdefault("gpu", {}).update(results["cuda"]["gpu"])  # the gpu_* keys and their targets
        if "tae" in args.sections:
            results["tae"] = bench_tae(args, tmp, report)
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
    if args.sections != ["cuda"]:  # (the cuda section prints one table, its own)
        report.table("Targets", ["key", "value", "target", "met"],
                     [[k, "not measured" if v["value"] is None else v["value"], v["target"],
                       "-" if v["met"] is None else ("yes" if v["met"] else "NO")] for k, v in targets.items()])
    report.line(f"\ntotal {results['elapsed_s']:.0f} s")
    if args.json:
        print(json.dumps(finite(results), indent=1), file=json_out, flush=True)
    return 0
