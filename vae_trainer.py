"""Train a latent-diffusion autoencoder (FLUX-style, constant-variance latent) with torchrun: the config (one
dataclass; every field a flag), `main`, and the Trainer whose `train()` and `train_step()` are the loop.

    torchrun --nproc_per_node=8 vae_trainer.py --dataset_url 'shards/{00000..01023}.tar' --do_ganloss
    python vae_trainer.py --demo                      # no data of your own needed

Recipe: LPIPS + pooled MSE + low-pass MSE + a VGG16 hinge discriminator, each loss branch balanced by
GradNorm; a latent penalty (the KL of the constant-variance posterior). fp32 by default. Every
hyperparameter is a flag (`--help`); the run directory <output_dir>/<run_name>/ holds config.json,
metrics.jsonl, checkpoints/ and samples/, and a run started again in it resumes where it stopped.
The loss is composed in objective.py; checkpoint files are handled by checkpoint.py, metrics by run_log.py.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import data as data_lib
import evaluate as evaluate_lib
import latents as latents_lib
import pretrained
import run_log
from ae import GRAD_CHECKPOINTING, POSTERIORS, AutoEncoder, AutoEncoderParams
from checkpoint import ARCH_FIELDS, checkpoint_files
from common import (ConfigError, DistInfo, OneLineParser, atomic_write, capture_rng, init_distributed, parse_bool,
                    restore_rng)
from objective import VAEObjective
from run_log import CollapseTracker, Metrics
from utils import (DISC_NORMS, DISC_TYPES, WeightsUnavailable, cosine_with_warmup, ensure_vgg16_weights,
                   fetch_weights, load_vgg16_features, vgg16_cache_path, warn_random_vgg)


# ============================================================================================
# Configuration: one dataclass; flags, config.json, checkpoints and wandb all come from it
# ============================================================================================
def opt(default, help: str, group: str, choices=None):
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclass
class Config:
    # data
    dataset_url: str = opt("", "training data: webdataset shards ('shards/{00000..01023}.tar', http(s)://, "
                               "pipe:..., lists joined by '::') or a directory of images", "data")
    test_dataset_url: str = opt("", "held-out data for evaluation and sample grids (same forms)", "data")
    batch_size: int = opt(8, "images per GPU per micro-step", "data")
    num_workers: int = opt(4, "dataloader worker processes per GPU", "data")
    vae_resolution: int = opt(256, "training crop size in pixels", "data")
    shuffle_buffer: int = opt(1000, "samples held (as raw bytes) in each worker's shuffle buffer", "data")
    resize_prob: float = opt(0.5, "probability of resizing the shorter side to the crop size before cropping "
                                  "(a whole-image view); otherwise crops are taken at native scale", "data")
    max_image_pixels: int = opt(100_000_000, "images with more pixels are skipped (decompression bombs)", "data")
    shard_retry_minutes: float = opt(30.0, "while no remote shard can be read (a server outage), keep retrying with "
                                           "back-off for this long before stopping (0: stop at once)", "data")
    # model
    vae_ch: int = opt(128, "base channel count", "model")
    vae_ch_mult: str = opt("1,2,4,4", "channel multiplier per level; downsampling = 2^(levels-1)", "model")
    vae_num_res_blocks: int = opt(2, "ResnetBlocks per level", "model")
    vae_z_channels: int = opt(16, "latent channels", "model")
    vae_norm_groups: int = opt(0, "GroupNorm groups (diffusers' norm_num_groups); every level's channel count must "
                                  "divide by it. 0: auto, the largest divisor of --vae_ch up to min(32, vae_ch/4): "
                                  "32 at 128 (FLUX, SD), 16 at 64, 8 at 32. One channel per group removes each "
                                  "image's per-channel mean (its colour) at every norm and learns slower", "model")
    do_attn: bool = opt(True, "self-attention in the mid blocks", "model")
    posterior: str = opt("constant", "constant: z = mean + sqrt(posterior_var) * noise; learned: the encoder "
                                     "also predicts the log-variance (standard SD VAE)", "model", POSTERIORS)
    posterior_var: float = opt(0.1, "the fixed VARIANCE sigma^2 of the constant posterior (std = sqrt)", "model")
    do_clamp: bool = opt(False, "clamp the posterior mean to [-clamp_th, clamp_th]", "model")
    clamp_th: float = opt(8.0, "latent clamp threshold used with --do_clamp", "model")
    vae_quant_conv: bool = opt(False, "LDM's 1x1 quant_conv/post_quant_conv around the latent (the SD 1.x/2.x/SDXL "
                                      "VAEs; needs --posterior learned). Set by --init_from", "model")
    # fine-tuning a released VAE
    init_from: str = opt("", "start from a released VAE: a diffusers AutoencoderKL folder, FLUX's ae.safetensors, an "
                             "SD VAE file or a full SD checkpoint (first_stage_model.*). The architecture (the --vae_* "
                             "flags, --posterior) and the latent factors are read from it", "finetune")
    init_family: str = opt("auto", "the family of an --init_from single file, for its latent factors (a VAE-only "
                                   "file does not say whether it is SD's or SDXL's, FLUX's or SD3's)", "finetune",
                           pretrained.FAMILY_CHOICES)
    train_parts: str = opt("all", "all: train the whole VAE; decoder: freeze the encoder, quant_conv and the "
                                  "posterior (no_grad, eval mode, not in the optimizer, EMA or DDP), train the "
                                  "decoder: the latent space stays the source's, so export keeps its latent factors",
                           "finetune", ("all", "decoder"))
    # losses
    loss_balance: str = opt("gradnorm", "gradnorm: each branch's gradient on the reconstruction is normalised to "
                                        "its weight; adaptive: LDM's adaptive GAN weight; none: plain weighted sum",
                            "loss", ("gradnorm", "adaptive", "none"))
    perceptual_weight: float = opt(1.0, "LPIPS branch weight", "loss")
    mse_weight: float = opt(1.0, "pixel (pooled + low-pass MSE) branch weight", "loss")
    pooled_mse_weight: float = opt(1.0, "pooled MSE inside the pixel branch", "loss")
    lowpass_mse_weight: float = opt(1.0, "low-pass MSE inside the pixel branch", "loss")
    mse_pool_factor: int = opt(16, "area-pooling factor of the pooled MSE", "loss")
    lowpass_threshold: float = opt(0.8, "blurriness above which a pixel counts as low-frequency", "loss")
    kl_weight: float = opt(0.003, "weight of the KL / latent penalty (constant posterior: 0.5 * mean^2). gradnorm: "
                                  "summed over the rank's latent elements and divided by the square root of their "
                                  "count, so its gradient at the latent has norm kl_weight * rms(mean) at any batch "
                                  "and resolution; adaptive, none: averaged per latent element, like the other "
                                  "losses", "loss")
    # GAN
    do_ganloss: bool = opt(False, "train with the discriminator", "gan")
    discriminator: str = opt("vgg16", "vgg16: VGG16 feature slices with conv heads; patchgan: N-layer PatchGAN",
                             "gan", ("vgg16", "patchgan"))
    disc_type: str = opt("hinge", "discriminator loss", "gan", DISC_TYPES)
    disc_norm: str = opt("group_spectral", "PatchGAN normalisation", "gan", DISC_NORMS)
    gen_loss: str = opt("thresholded", "generator loss: thresholded = relu(D(x) - D(x_hat) - margin) (reference); "
                                       "ldm = -mean(D(x_hat)); nonsaturating = softplus(-D(x_hat))", "gan",
                      ("thresholded", "ldm", "nonsaturating"))
    gan_weight: float = opt(0.5, "GAN branch weight (gradnorm: the branch's gradient norm while every patch is "
                                 "active, times sqrt(active fraction) with the thresholded loss; adaptive: "
                                 "multiplies the adaptive weight)", "gan")
    gan_margin: float = opt(0.1, "margin of the thresholded generator loss", "gan")
    disc_start: int = opt(-1, "step from which the generator gets the adversarial term (D trains from 0). -1: "
                              "auto, a fifth of --max_steps", "gan")
    learning_rate_disc: float = opt(0.0, "discriminator learning rate. 0: auto, 1e-5 for the vgg16 critic (a "
                                         "pretrained trunk, as the reference), --learning_rate_vae for patchgan "
                                         "(as LDM)", "gan")
    lecam_weight: float = opt(0.0, "LeCam regularisation weight for the discriminator (0: off)", "gan")
    adaptive_weight_max: float = opt(1e4, "clamp of LDM's adaptive weight", "gan")
    vgg16_weights: str = opt("torchvision", "VGG16 for LPIPS and the discriminator: torchvision (its download "
                                            "cache), a local state-dict PATH, or random (tests/demo only)", "gan")
    inception_weights: str = opt("torchvision", "FID Inception-v3 for rFID during evaluation: torchvision (torch "
                                                "hub's cache), a local PATH, random (tests only) or none", "run")
    # optimisation
    learning_rate_vae: float = opt(0.0, "VAE learning rate (AdamW). 0: auto, 0.032 / --vae_ch (1e-3 at ch 32, "
                                        "2.5e-4 at ch 128); a tenth of that with --init_from", "optim")
    weight_decay: float = opt(1e-3, "AdamW weight decay (both networks)", "optim")
    adam_beta1: float = opt(0.9, "AdamW beta1", "optim")
    adam_beta2: float = opt(0.95, "AdamW beta2", "optim")
    warmup_steps: int = opt(-1, "linear warm-up steps of the cosine schedule. -1: auto, a tenth of --max_steps, "
                                "at most 1000", "optim")
    min_lr_ratio: float = opt(0.0, "final learning rate as a fraction of the peak", "optim")
    grad_clip: float = opt(1.0, "clip the global gradient norm of each network (0: off)", "optim")
    max_steps: int = opt(10000, "optimizer steps to train (every rank runs exactly this many)", "optim")
    grad_accum: int = opt(1, "micro-batches per optimizer step", "optim")
    ema_decay: float = opt(0.999, "EMA of the VAE weights, in fp32, with warm-up (0: off)", "optim")
    seed: int = opt(42, "random seed", "optim")
    # precision and speed
    precision: str = opt("fp32", "fp32 (recommended for VAEs), or bf16/fp16 autocast with fp32 islands",
                         "speed", ("fp32", "bf16", "fp16"))
    allow_tf32: bool = opt(False, "allow TF32 matmuls/convolutions on Ampere+ GPUs", "speed")
    grad_checkpointing: str = opt("none", "recompute activations in backward, one block at a time: decoder_hr (the "
                                          "decoder's two highest-resolution levels), hr (those of the encoder too), "
                                          "decoder (every decoder level), all", "speed", GRAD_CHECKPOINTING)
    channels_last: bool = opt(True, "channels_last memory format", "speed")
    compile: bool = opt(False, "torch.compile the encoder, decoder and discriminator", "speed")
    # latents for diffusion (latents.py): regularisers, off by default
    scale_equivariance_prob: float = opt(0.0, "probability per micro-batch that the latent is downsampled (and "
                                              "rotated/flipped with --scale_equivariance_rotate) before decoding, "
                                              "and the losses compare with the equally downsampled image "
                                              "(EQ-VAE; a smoother, more diffusable latent). 0: off", "latents")
    scale_equivariance_mode: str = opt("half", "half: x0.5; random: a latent size drawn from a quarter up to one "
                                               "less than the full one", "latents", ("half", "random"))
    scale_equivariance_rotate: bool = opt(False, "also rotate by 0/90/180/270 degrees and flip (both the latent "
                                                 "and the image) on scale-equivariance steps", "latents")
    latent_noise_prob: float = opt(0.0, "probability per image that the decoder sees z + Gaussian noise (a "
                                        "decoder robust to a diffusion model's imperfect latents). 0: off", "latents")
    latent_noise_max: float = opt(0.5, "the noise std is U(0, this) times the batch's latent std", "latents")
    # run, logging, checkpoints
    output_dir: str = opt("runs", "where run directories live", "run")
    run_name: str = opt("vae", "run directory name and wandb run name", "run")
    project_name: str = opt("vae-trainer", "wandb project", "run")
    wandb_mode: str = opt("offline", "wandb: offline (sync later), online, or disabled", "run",
                          ("offline", "online", "disabled"))
    log_every_n_steps: int = opt(50, "log (stdout, metrics.jsonl, wandb) every N steps", "run")
    save_every_n_steps: int = opt(1000, "checkpoint and sample grid every N steps", "run")
    evaluate_every_n_steps: int = opt(1000, "evaluate on --test_dataset_url every N steps (0: off)", "run")
    eval_max_images: int = opt(256, "images of the test set used by evaluation during training", "run")
    num_samples: int = opt(8, "images in each sample grid", "run")
    keep_last_k: int = opt(3, "checkpoints kept in <run_dir>/checkpoints", "run")
    resume: str = opt("auto", "auto: continue from the run directory's latest checkpoint; never: refuse a "
                              "run directory that has checkpoints; or a checkpoint PATH", "run")
    load_path: str = opt("", "initialise the VAE weights from a checkpoint or .safetensors (fine-tuning)", "run")
    force: bool = opt(False, "accept a run directory written with a different architecture", "run")
    max_bad_steps: int = opt(20, "stop after this many consecutive non-finite (skipped) steps", "run")
    demo: bool = opt(False, "train a tiny model on bundled sample photos (defaults below are overridden)", "run")


def uses_vgg16(cfg: Config) -> bool:
    """Whether a loss trains on VGG16 features: LPIPS with a weight, or the VGG16 critic."""
    return cfg.perceptual_weight > 0 or (cfg.do_ganloss and cfg.discriminator == "vgg16")


# The flags --init_from sets from its source (the architecture and the posterior's settings).
SOURCE_FIELDS = ARCH_FIELDS + ("posterior_var", "do_clamp")

# The demo: a tiny f4 model at 64 px that visibly learns in about 5 CPU minutes. Its latent (4 x 4 x 16 x 16
# = 4096 elements per step) takes kl_weight 1/64 = 1/sqrt(4096): the KL strength it was tuned with.
# Without pretrained VGG16 (prepare_demo) it trains on pixels only, and a pixel-only step costs about a sixth
# of one with LPIPS and the VGG16 critic (10.2 vs 1.7 img/s, one CPU thread): 900 steps fit where 300 did.
# With VGG16 weights cached the full recipe runs these 900 steps at that cost (a GPU, or --max_steps 300).
# Held-out PSNR (the 4 photos at 64 px): the former demo (300 steps, LPIPS and critic on a random VGG16,
# 32 groups, lr 5e-4, 4x-pooled MSE) 16.4 dB, colours lost; this config 15.9 / 20.1 / 20.7 dB at steps
# 300 / 600 / 900 (EMA 16.5 / 20.1 / 20.7). --vae_norm_groups 8: 32 groups at --vae_ch 32 are one channel
# each, so every norm removes each image's per-channel means (its colour): this config with 32 groups
# reaches 16.9 / 17.4 / 17.6 dB at 300 / 600 / 900, every reconstruction still grey; 8 groups gave the
# colours back (4 groups: 19.0 dB at 600). --mse_pool_factor 1: full-resolution MSE (the pooled one leaves
# detail to LPIPS, which is off here); lr 1e-3 (3e-3: 15.5 dB at 300, pixel-only); --posterior_var 0.01.
DEMO = dict(vae_ch=32, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4, vae_norm_groups=8,
            do_attn=False, vae_resolution=64, batch_size=4, num_workers=2, shuffle_buffer=64, max_steps=900,
            learning_rate_vae=1e-3, warmup_steps=30, mse_pool_factor=1, posterior_var=0.01,
            do_ganloss=True, disc_start=50, mse_weight=1.0, perceptual_weight=0.5, gan_weight=0.3, kl_weight=1 / 64,
            log_every_n_steps=50, save_every_n_steps=300, evaluate_every_n_steps=300, eval_max_images=16,
            run_name="demo", ema_decay=0.99)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                           argument_default=argparse.SUPPRESS)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        help_text = f"{meta['help']} (default: {f.default})"
        kwargs: dict[str, Any] = dict(help=help_text)
        if f.type in ("bool", bool):
            kwargs.update(nargs="?", const=True, type=parse_bool, metavar="BOOL")
        else:
            kwargs["type"] = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
        group.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_flags(argv: list[str] | None = None) -> tuple[Config, set[str]]:
    """The config as given (automatic values still 0 / -1: resolve_auto, once --init_from has set the
    architecture) and the names of the flags the user gave (argparse leaves the others out: SUPPRESS)."""
    given = vars(build_parser().parse_args(argv))
    values = dict(DEMO) if given.get("demo") else {}
    values.update(given)
    return Config(**values), set(given)


# --learning_rate_vae auto = LR_TIMES_WIDTH / --vae_ch. Adam's step is scale-free, so the update of a layer's
# output grows with its fan-in: a rate inversely proportional to the width keeps it comparable (the
# reference's rule is 2^-7 / vae_ch). The constant comes from this repo's runs at ch 32 (BENCHMARKS.md,
# "Defaults"): 1e-3 there, which makes 2.5e-4 at FLUX width, where LDM's recipe (4.5e-6 x total batch 64) is 2.9e-4.
LR_TIMES_WIDTH = 0.032


def auto_norm_groups(vae_ch: int) -> int:
    """The largest divisor of vae_ch up to min(32, vae_ch // 4): at least 4 channels per group where possible."""
    limit = max(1, min(32, vae_ch // 4))
    return max(d for d in range(1, limit + 1) if vae_ch % d == 0)


def resolve_auto(cfg: Config) -> Config:
    """The automatic defaults (0 or -1, see each flag's help) made concrete; idempotent. config.json records
    the resolved values, so a run shows what it trained with."""
    lr_vae = cfg.learning_rate_vae
    if lr_vae == 0 and cfg.vae_ch > 0:  # (a bad --vae_ch is refused by validate)
        # a fine-tune (--init_from) starts from a trained optimum: a tenth (2.5e-5 at FLUX width)
        lr_vae = LR_TIMES_WIDTH / cfg.vae_ch / (10 if cfg.init_from else 1)
    changes = dict(
        learning_rate_vae=lr_vae,
        learning_rate_disc=cfg.learning_rate_disc or (1e-5 if cfg.discriminator == "vgg16" else lr_vae),
        warmup_steps=min(1000, cfg.max_steps // 10) if cfg.warmup_steps == -1 else cfg.warmup_steps,
        disc_start=cfg.max_steps // 5 if cfg.disc_start == -1 else cfg.disc_start,
        vae_norm_groups=cfg.vae_norm_groups or (auto_norm_groups(cfg.vae_ch) if cfg.vae_ch > 0 else 0))
    return dataclasses.replace(cfg, **changes)


def parse_config(argv: list[str] | None = None) -> Config:
    """The config of these flags with every automatic value resolved (no --init_from source is read)."""
    return resolve_auto(parse_flags(argv)[0])


def ch_mult_of(cfg: Config) -> tuple[int, ...]:
    try:
        mult = tuple(int(m) for m in cfg.vae_ch_mult.split(","))
    except ValueError:
        raise ConfigError(f"--vae_ch_mult must be comma-separated integers, got {cfg.vae_ch_mult!r}") from None
    if not mult or min(mult) <= 0:
        raise ConfigError(f"--vae_ch_mult must be positive integers, got {cfg.vae_ch_mult!r}")
    return mult


def model_params(cfg: Config) -> AutoEncoderParams:
    return AutoEncoderParams(ch=cfg.vae_ch, ch_mult=ch_mult_of(cfg), num_res_blocks=cfg.vae_num_res_blocks,
                             z_channels=cfg.vae_z_channels, norm_groups=cfg.vae_norm_groups,
                             use_attn=cfg.do_attn, posterior=cfg.posterior,
                             posterior_var=cfg.posterior_var, clamp_th=cfg.clamp_th if cfg.do_clamp else 0.0,
                             quant_conv=cfg.vae_quant_conv)


def read_init_source(cfg: Config) -> pretrained.Source:
    try:
        return pretrained.load_source(cfg.init_from, cfg.init_family)
    except pretrained.SourceError as e:
        raise ConfigError(f"--init_from {e}") from None


def apply_init_source(cfg: Config) -> tuple[Config, pretrained.Source | None]:
    """--init_from: load the source and take the run's architecture from it (one ConfigError line if it does not
    load). Runs before `validate`, on every rank, before any process group exists."""
    if not cfg.init_from:
        return cfg, None
    run_config = os.path.join(cfg.output_dir, cfg.run_name, "config.json")
    if not os.path.exists(cfg.init_from) and cfg.resume != "never" and os.path.isfile(run_config):
        # a run being resumed needs its architecture, not the source's weights: the source may have moved
        try:
            with open(run_config) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = {}
        if saved.get("init_from") == cfg.init_from and all(k in saved for k in SOURCE_FIELDS):
            return dataclasses.replace(cfg, **{k: saved[k] for k in SOURCE_FIELDS}), None
    source = read_init_source(cfg)
    p = source.params
    if (p.in_channels, p.out_ch) != (3, 3):
        raise ConfigError(f"--init_from {cfg.init_from}: a VAE of {p.in_channels} input / {p.out_ch} output "
                          "channels; this trainer reads RGB images")
    arch = dict(vae_ch=p.ch, vae_ch_mult=",".join(str(m) for m in p.ch_mult), vae_num_res_blocks=p.num_res_blocks,
                vae_z_channels=p.z_channels, vae_norm_groups=p.norm_groups, do_attn=p.use_attn, posterior=p.posterior,
                posterior_var=p.posterior_var, vae_quant_conv=p.quant_conv, do_clamp=False)
    return dataclasses.replace(cfg, **arch), source


def validate(cfg: Config) -> None:
    """Refuse bad flags and paths with one line, before any process group or worker starts."""
    positive = ["batch_size", "vae_resolution", "vae_ch", "vae_num_res_blocks", "vae_z_channels", "vae_norm_groups",
                "max_steps",
                "grad_accum", "learning_rate_vae", "learning_rate_disc", "log_every_n_steps",
                "save_every_n_steps", "posterior_var", "shuffle_buffer", "mse_pool_factor", "keep_last_k",
                "max_bad_steps", "num_samples", "max_image_pixels", "eval_max_images"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(cfg, name)}")
    non_negative = ["num_workers", "warmup_steps", "weight_decay", "grad_clip", "perceptual_weight", "mse_weight",
                    "pooled_mse_weight", "lowpass_mse_weight", "kl_weight", "gan_weight", "gan_margin",
                    "disc_start", "lecam_weight", "evaluate_every_n_steps", "min_lr_ratio", "shard_retry_minutes"]
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("resize_prob", "lowpass_threshold", "adam_beta1", "adam_beta2", "min_lr_ratio"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ConfigError(f"--{name} must be in [0, 1], got {getattr(cfg, name)}")
    if not 0 <= cfg.ema_decay < 1:
        raise ConfigError(f"--ema_decay must be in [0, 1), got {cfg.ema_decay}")
    if cfg.do_clamp and cfg.clamp_th <= 0:
        raise ConfigError(f"--clamp_th must be positive with --do_clamp, got {cfg.clamp_th}")
    params = model_params(cfg)
    factor = params.downsample_factor
    if cfg.vae_resolution % factor:
        raise ConfigError(f"--vae_resolution {cfg.vae_resolution} is not divisible by the downsample factor "
                          f"{factor} of --vae_ch_mult {cfg.vae_ch_mult}")
    if cfg.vae_resolution % cfg.mse_pool_factor:
        raise ConfigError(f"--vae_resolution {cfg.vae_resolution} is not divisible by --mse_pool_factor "
                          f"{cfg.mse_pool_factor}")
    for mult in (1,) + params.ch_mult:
        if (cfg.vae_ch * mult) % params.norm_groups:
            raise ConfigError(f"channel count {cfg.vae_ch} x {mult} = {cfg.vae_ch * mult} is not divisible by the "
                              f"{params.norm_groups} GroupNorm groups (--vae_ch / --vae_ch_mult / --vae_norm_groups)")
    for name in ("scale_equivariance_prob", "latent_noise_prob"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ConfigError(f"--{name} must be in [0, 1], got {getattr(cfg, name)}")
    if cfg.latent_noise_max < 0:
        raise ConfigError(f"--latent_noise_max must be >= 0, got {cfg.latent_noise_max}")
    if cfg.scale_equivariance_prob > 0 and not scale_equivariance_sizes(cfg):
        critic = " and at least 32 px (the critic's smallest input)" if cfg.do_ganloss else ""
        raise ConfigError(f"--scale_equivariance_mode {cfg.scale_equivariance_mode}: no smaller size of the "
                          f"{cfg.vae_resolution // factor}-pixel latent gives an image divisible by --mse_pool_factor "
                          f"{cfg.mse_pool_factor}{critic}")
    if cfg.do_ganloss and cfg.discriminator == "vgg16" and cfg.vae_resolution < 32:
        raise ConfigError("--vae_resolution must be at least 32 for the VGG16 discriminator")
    if cfg.vgg16_weights not in ("torchvision", "random") and not os.path.isfile(cfg.vgg16_weights):
        raise ConfigError(f"--vgg16_weights {cfg.vgg16_weights}: no such file (or use torchvision / random)")
    if cfg.inception_weights not in ("torchvision", "random", "none") and not os.path.isfile(cfg.inception_weights):
        raise ConfigError(f"--inception_weights {cfg.inception_weights}: no such file (or torchvision / random / none)")
    if cfg.resume not in ("auto", "never") and not os.path.isfile(cfg.resume):
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint file (or use auto / never)")
    if cfg.load_path and not os.path.isfile(cfg.load_path):
        raise ConfigError(f"--load_path {cfg.load_path}: no such file")
    if cfg.load_path and cfg.init_from:
        raise ConfigError("give --init_from (a released VAE) or --load_path (our weights), not both")
    if cfg.vae_quant_conv and cfg.posterior != "learned":
        raise ConfigError("--vae_quant_conv needs --posterior learned (the SD VAEs' 2 x z moments)")
    if not re.fullmatch(r"[A-Za-z0-9_.=+-]+", cfg.run_name):
        raise ConfigError(f"--run_name {cfg.run_name!r}: use letters, digits and _.=+- only")
    for name in ("dataset_url", "test_dataset_url"):
        if name == "dataset_url" or getattr(cfg, name):
            try:
                data_lib.probe_remote_shards(data_lib.list_shards(getattr(cfg, name)))
            except data_lib.DatasetError as e:
                raise ConfigError(f"--{name}: {e}") from None


def scale_equivariance_sizes(cfg: Config) -> list[int]:
    """The latent sizes a scale-equivariance step may decode (latents.equivariance_sizes)."""
    factor = model_params(cfg).downsample_factor
    min_image = 32 if cfg.do_ganloss else 1  # the critics' smallest input
    return latents_lib.equivariance_sizes(cfg.vae_resolution // factor, factor, cfg.scale_equivariance_mode,
                                          cfg.mse_pool_factor, min_image)


# Flags that only matter with --do_ganloss.
GAN_FLAGS = ("discriminator", "disc_type", "disc_norm", "gen_loss", "gan_weight", "gan_margin", "disc_start",
             "learning_rate_disc", "lecam_weight", "adaptive_weight_max")


def config_warnings(cfg: Config, given: set[str]) -> list[str]:
    """One-line warnings for a valid but probably unintended config: flags the user gave that the chosen
    configuration ignores (one line per cause; defaults and --demo's values are never named), and schedules
    that cannot play out within --max_steps."""
    ignored_when = [  # (flags, ignored in this config, why)
        (GAN_FLAGS, not cfg.do_ganloss, "without --do_ganloss"),
        (("disc_norm",), cfg.discriminator != "patchgan", "with --discriminator vgg16 (it normalises the "
                                                          "PatchGAN only)"),
        (("gan_margin",), cfg.gen_loss != "thresholded", f"with --gen_loss {cfg.gen_loss} (it is the margin of the "
                                                          "thresholded loss)"),
        (("adaptive_weight_max",), cfg.loss_balance != "adaptive", f"with --loss_balance {cfg.loss_balance} (it "
                                                                   "clamps the adaptive weight)"),
        (("clamp_th",), not cfg.do_clamp, "without --do_clamp"),
        (("posterior_var",), cfg.posterior != "constant", f"with --posterior {cfg.posterior} (the encoder predicts "
                                                          "the variance)"),
        # --evaluate_every_n_steps 0 is the off switch: consistent with no test set, never "ignored"
        (("evaluate_every_n_steps",) * (cfg.evaluate_every_n_steps > 0) + ("eval_max_images", "inception_weights"),
         not cfg.test_dataset_url, "without --test_dataset_url"),
        (("eval_max_images", "inception_weights"), cfg.evaluate_every_n_steps == 0, "with --evaluate_every_n_steps 0"),
        (("project_name",), cfg.wandb_mode == "disabled", "with --wandb_mode disabled"),
        (("scale_equivariance_mode", "scale_equivariance_rotate"), cfg.scale_equivariance_prob == 0,
         "with --scale_equivariance_prob 0"),
        (("latent_noise_max",), cfg.latent_noise_prob == 0, "with --latent_noise_prob 0"),
        (SOURCE_FIELDS, bool(cfg.init_from), "with --init_from (the architecture is read from the source)"),
        (("init_family",), not cfg.init_from, "without --init_from"),
    ]
    lines, named = [], set()
    for flags, ignored, why in ignored_when:
        hit = [f for f in flags if f in given and f not in named] if ignored else []
        if hit:
            named.update(hit)
            verb = "has" if len(hit) == 1 else "have"
            lines.append(f"warning: {', '.join('--' + f for f in hit)} {verb} no effect {why}")
    if cfg.warmup_steps > cfg.max_steps:
        lines.append(f"warning: --warmup_steps {cfg.warmup_steps} > --max_steps {cfg.max_steps}: the learning rate "
                     f"peaks at {cfg.max_steps / cfg.warmup_steps:.0%} of its set value and never decays")
    if cfg.train_parts == "decoder" and not (cfg.init_from or cfg.load_path):
        lines.append("warning: --train_parts decoder without --init_from or --load_path: the encoder stays random "
                     "(unless resumed)")
    if cfg.do_ganloss and cfg.disc_start >= cfg.max_steps:
        lines.append(f"warning: --disc_start {cfg.disc_start} >= --max_steps {cfg.max_steps}: the generator never "
                     "gets the adversarial term (the critic still trains)")
    return lines


def public_config(cfg: Config) -> dict:
    return {k: data_lib.redact(v) if isinstance(v, str) else v for k, v in dataclasses.asdict(cfg).items()}


# ============================================================================================
# Training-side state: EMA of the weights, the stop flag
# ============================================================================================
class EMA:
    """fp32 exponential moving average of the VAE parameters that train (frozen ones, --train_parts decoder, never
    change: their average is themselves), decay warmed up as min(decay, (1+t)/(10+t)). The update is skipped (on
    the device, no host sync) on steps the guard rejected."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trained]
        self.shadow = [p.detach().float().clone() for _, p in trained]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int, skip: torch.Tensor) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        params = [p.detach().float() for p in model.parameters() if p.requires_grad]
        delta = torch._foreach_sub(params, self.shadow)
        torch._foreach_mul_(delta, (1.0 - decay) * (1.0 - skip))
        torch._foreach_add_(self.shadow, delta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in zip(self.names, self.shadow):
            tensor.copy_(state[name])

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A whole state dict of `model` with the averaged weights (the frozen ones as they are)."""
        return {**model.state_dict(), **self.state_dict()}


class DecoderOnly(torch.nn.Module):
    """--train_parts decoder: the encoder, quant_conv and the posterior are frozen (no requires_grad, eval mode)
    and run under no_grad; only post_quant_conv and the decoder train. Wrapped in DDP in place of the VAE, so DDP's
    buckets hold the decoder's gradients only (DDP skips parameters that do not require grad)."""

    def __init__(self, vae: AutoEncoder):
        super().__init__()
        self.vae = vae
        self.frozen = [vae.encoder] + ([vae.quant_conv] if vae.params.quant_conv else [])
        for module in self.frozen:
            module.requires_grad_(False).eval()

    def forward(self, x: torch.Tensor, latent_transform=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """As AutoEncoder.forward (the same `latent_transform` between encoder and decoder)."""
        for module in self.frozen:
            module.eval()  # evaluation calls vae.train() on its way out
        with torch.no_grad():
            mean, logvar = self.vae.encode_moments(x)
        z = self.vae.sample(mean, logvar)
        if latent_transform is not None:
            z = latent_transform(z)
        return self.vae.decode(z), mean, logvar


class StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current step; a second
    SIGINT aborts."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def agreed(self, info: DistInfo) -> bool:
        """Whether any rank was signalled; over the gloo control group, so no device sync."""
        if not info.distributed:
            return self.signum is not None
        flag = torch.tensor([1 if self.signum is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=info.ctrl_group)
        return bool(flag.item())


# ============================================================================================
# The trainer
# ============================================================================================
class Trainer:
    """One training run: builds the VAE, the objective (losses and critic), optimizers and data from the config,
    resumes from the run directory, and `train()`s. Setup is split into small build_* methods (networks,
    objective, DDP wrapping, optimizers) so that a variant changes one of them. `source`: the --init_from
    source main() already read (None: read here if needed)."""

    def __init__(self, cfg: Config, info: DistInfo, source: pretrained.Source | None = None):
        cfg = resolve_auto(cfg)
        self.cfg, self.info = cfg, info
        self.device = info.device
        self.run_dir = os.path.join(cfg.output_dir, cfg.run_name)
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.sample_dir = os.path.join(self.run_dir, "samples")
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        self.step = 0
        self.gan = cfg.do_ganloss
        self.eval_on = bool(cfg.test_dataset_url and cfg.evaluate_every_n_steps)
        self.created_run_dir = False  # by this run, in _start_run_dir (rank 0)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
            torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
            torch.backends.cudnn.benchmark = True

        # (path, checkpoint) or None; refuses incompatible run dirs. Nothing is written to the run directory
        # before every check that can refuse the run has passed (_start_run_dir, below).
        resume = self._find_resume()

        # networks: built from the same seed on every rank (DDP also broadcasts rank 0's weights), in this
        # order (random initialisations draw from the global RNG)
        torch.manual_seed(cfg.seed)
        # --init_from: what the run started from (path, layout, family, latent factors), in config.json and every
        # checkpoint; export keeps its factors after a decoder-only fine-tune
        self.init_source = resume[1].get("init_source") if resume is not None else None
        self.vae = self.build_vae(init_weights=resume is None, source=source)
        # what trains: the VAE, or (--train_parts decoder) its decoder behind a frozen encoder; DDP wraps this
        self.vae_train = DecoderOnly(self.vae) if cfg.train_parts == "decoder" else self.vae
        self.ema = EMA(self.vae, cfg.ema_decay) if cfg.ema_decay > 0 else None
        self.objective = self.build_objective()
        self.inception = self._inception()
        if cfg.compile:
            for module in (self.vae.encoder, self.vae.decoder, self.disc):
                if module is not None:
                    module.compile()  # the inner modules, never the DDP wrapper
        self.vae_ddp = self.wrap_ddp(self.vae_train)
        self.disc_ddp = self.wrap_ddp(self.disc) if self.disc is not None else None
        self.build_optimizers()

        self.bad_total = torch.zeros((), device=self.device)  # the non-finite guard's counters
        self.bad_streak = torch.zeros((), device=self.device)
        data_state, self.resumed_from = None, None
        torch.manual_seed(cfg.seed + 1000 * info.rank)  # per-rank posterior noise
        if resume is not None:
            data_state = self._restore(*resume)
        self.loader = data_lib.TrainLoader(
            cfg.dataset_url, cfg.vae_resolution, cfg.batch_size, cfg.seed, info.rank, info.world_size,
            cfg.num_workers, cfg.shuffle_buffer, cfg.resize_prob, cfg.max_image_pixels,
            pin_memory=self.device.type == "cuda", state=data_state, shard_retry_minutes=cfg.shard_retry_minutes)
        if self.loader.few_shards and info.is_main:
            self.log(f"note: fewer shards than data workers ({info.world_size} x {max(1, cfg.num_workers)}): "
                     "every worker reads every shard, in its own order")
        self.regularisers = latents_lib.LatentRegularisers(
            cfg.seed, info.rank, equivariance_prob=cfg.scale_equivariance_prob,
            equivariance_sizes=scale_equivariance_sizes(cfg), equivariance_rotate=cfg.scale_equivariance_rotate,
            noise_prob=cfg.latent_noise_prob, noise_max=cfg.latent_noise_max,
            downsample_factor=self.vae.downsample_factor)
        self.metrics, self.tracker = Metrics(), CollapseTracker(self.log)
        self._ema_model = None
        self.sample_images = self._fixed_sample_images() if info.is_main else None
        if info.is_main:
            self._start_run_dir()
        self.wandb = (run_log.init_wandb(cfg.wandb_mode, cfg.project_name, cfg.run_name, self.run_dir,
                                         public_config(cfg), self.log) if info.is_main else None)

    # ----------------------------------------------------------------------------- building the parts
    def build_vae(self, init_weights: bool, source: pretrained.Source | None = None) -> AutoEncoder:
        """The autoencoder on the device; --load_path's or --init_from's weights when not resuming."""
        cfg = self.cfg
        vae = AutoEncoder(model_params(cfg))
        if cfg.load_path and init_weights:
            checkpoint.load_vae_weights_into(vae, cfg.load_path)
            self.log(f"initialised VAE weights from {cfg.load_path}")
        if cfg.init_from and init_weights:
            if source is None:
                source = read_init_source(cfg)
            vae.load_state_dict(source.state)
            self.init_source = source.describe()
            for note in source.notes:
                self.log(f"note: {note}")
            self.log(f"initialised the VAE from {cfg.init_from} ({source.layout}"
                     f"{', ' + source.family if source.family else ''})")
        vae.set_grad_checkpointing(self.cfg.grad_checkpointing)
        return vae.to(self.device, memory_format=self.memory_format)

    def build_objective(self) -> VAEObjective:
        """LPIPS, the pixel losses, the critic and LeCam. A random VGG16 that no loss trains on (the demo without
        pretrained weights) is not built at all: its LPIPS would only add a meaningless number to evaluation."""
        cfg, vgg_features = self.cfg, None
        with_lpips = cfg.vgg16_weights != "random" or uses_vgg16(cfg)
        if with_lpips:
            vgg_features = load_vgg16_features(self._vgg16_weights())
        return VAEObjective(cfg, vgg_features, with_lpips=with_lpips, device=self.device,
                            memory_format=self.memory_format)

    def wrap_ddp(self, module):
        if not self.info.distributed:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(module, device_ids=ids, gradient_as_bucket_view=True)

    def build_optimizers(self) -> None:
        """AdamW + warm-up/cosine schedule + (fp16) GradScaler, one set for the VAE and one for the critic."""
        cfg = self.cfg
        # the VAE's frozen parts (--train_parts decoder) stay out: no state, and weight decay never moves them
        self.opt_vae = self._adamw([p for p in self.vae.parameters() if p.requires_grad], cfg.learning_rate_vae)
        self.opt_disc = self._adamw(self.disc.parameters(), cfg.learning_rate_disc) if self.disc is not None else None
        schedule = cosine_with_warmup(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        self.sched_vae = torch.optim.lr_scheduler.LambdaLR(self.opt_vae, schedule)
        self.sched_disc = torch.optim.lr_scheduler.LambdaLR(self.opt_disc, schedule) if self.opt_disc else None
        fp16 = cfg.precision == "fp16"
        self.scaler_vae = torch.amp.GradScaler(self.device.type, enabled=fp16)
        self.scaler_disc = torch.amp.GradScaler(self.device.type, enabled=fp16 and self.gan)

    def _adamw(self, params, lr):
        kwargs = dict(lr=lr, betas=(self.cfg.adam_beta1, self.cfg.adam_beta2), weight_decay=self.cfg.weight_decay)
        # fused AdamW reads `found_inf` on the device: a rejected step is skipped without a host sync
        return torch.optim.AdamW(params, fused=True, **kwargs)

    @property
    def disc(self):
        """The critic (None without --do_ganloss); it lives in the objective."""
        return self.objective.critic

    @property
    def lpips(self):
        return self.objective.lpips

    @property
    def lecam(self):
        return self.objective.lecam

    def log(self, msg: str) -> None:
        if self.info.is_main:
            print(msg, flush=True)

    def _vgg16_weights(self) -> str | None:
        if self.cfg.vgg16_weights == "random" and self.info.is_main:
            warn_random_vgg("LPIPS" + (" and the discriminator" if self.gan and self.cfg.discriminator == "vgg16"
                                       else ""))
        return fetch_weights(ensure_vgg16_weights, self.cfg.vgg16_weights, self.info.local_rank, self.info.ctrl_group)

    def _inception(self):
        """The FID network for evaluation, or None (rFID then reported missing, never faked)."""
        if not self.eval_on:
            return None
        return evaluate_lib.metric_networks("none", self.cfg.inception_weights, self.device, self.info.local_rank,
                                            log=self.log, group=self.info.ctrl_group)[1]

    def _fixed_sample_images(self) -> torch.Tensor:
        url = self.cfg.test_dataset_url or self.cfg.dataset_url
        batches = data_lib.iter_eval_batches(url, self.cfg.vae_resolution, self.cfg.num_samples,
                                             max_images=self.cfg.num_samples, max_pixels=self.cfg.max_image_pixels)
        return next(iter(batches), (None, torch.zeros(0, 3, self.cfg.vae_resolution, self.cfg.vae_resolution,
                                                      dtype=torch.uint8)))[1]

    # ----------------------------------------------------------------------------- the run directory, resuming
    def _find_resume(self) -> tuple[str, dict] | None:
        found, self._set_aside = checkpoint.find_resume(self.cfg, self.info, self.run_dir, self.log)
        return found

    def _start_run_dir(self) -> None:
        """Rank 0, once every check that can refuse the run has passed (flags, weights, --load_path, data):
        set incompatible checkpoints aside (--force), create the directories, write config.json. A run that
        fails to start leaves no run directory behind (an existing one unchanged)."""
        if self._set_aside:
            aside = f"{self.ckpt_dir}.incompatible-{time.strftime('%Y%m%d-%H%M%S')}"
            os.rename(self.ckpt_dir, aside)
            self.log(f"warning: --force: the checkpoints of the other architecture were moved to {aside}; "
                     "training starts from scratch")
        self.created_run_dir = not os.path.exists(self.run_dir)
        os.makedirs(self.ckpt_dir, exist_ok=True)
        os.makedirs(self.sample_dir, exist_ok=True)
        config = public_config(self.cfg)
        if self.init_source is not None:
            config["init_source"] = self.init_source  # read from the source: not a flag
        atomic_write(os.path.join(self.run_dir, "config.json"), lambda f: f.write(json.dumps(config, indent=2).encode()))

    def remove_run_dir_if_unused(self) -> None:
        """After a user error that stopped the run before its first checkpoint (data with no decodable
        image, ...): remove the run directory this run created, so that none is left holding only
        config.json. An existing directory is never touched."""
        if self.info.is_main and self.created_run_dir and not checkpoint_files(self.ckpt_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def checkpoint_state(self) -> dict:
        """Everything needed to continue exactly; tensors and plain containers only (weights_only loads)."""
        ranks = [None] * self.info.world_size
        mine = {"rng": capture_rng(self.device), "data": self.loader.state_dict()}
        if self.info.distributed:
            dist.all_gather_object(ranks, mine, group=self.info.ctrl_group)
        else:
            ranks = [mine]
        return {
            "format_version": 1,
            "step": self.step,
            "config": public_config(self.cfg),
            "model_params": model_params(self.cfg).to_dict(),
            "vae": {k: v.detach().cpu() for k, v in self.vae.state_dict().items()},
            "ema": {k: v.detach().cpu() for k, v in self.ema.model_state_dict(self.vae).items()} if self.ema else None,
            "init_source": self.init_source,
            "discriminator": self.disc.state_dict() if self.disc is not None else None,
            "optimizer_vae": self.opt_vae.state_dict(),
            "optimizer_disc": self.opt_disc.state_dict() if self.opt_disc else None,
            "scheduler_vae": self.sched_vae.state_dict(),
            "scheduler_disc": self.sched_disc.state_dict() if self.sched_disc else None,
            "scaler_vae": self.scaler_vae.state_dict(),
            "scaler_disc": self.scaler_disc.state_dict(),
            "lecam": self.lecam.state_dict() if self.lecam is not None else None,
            "guard": {"bad_steps_total": int(self.bad_total.item()), "bad_streak": int(self.bad_streak.item())},
            "ranks": ranks,
            "world_size": self.info.world_size,
        }

    def _restore(self, path: str, ckpt: dict) -> dict | None:
        """Load checkpoint_state's contents; returns this rank's data-stream state."""
        saved_parts = ckpt.get("config", {}).get("train_parts", "all")
        if saved_parts != self.cfg.train_parts:
            raise ConfigError(f"{path} was trained with --train_parts {saved_parts}: resume with the same (its "
                              "optimizer holds those parameters), or start a new --run_name from it with --load_path")
        self.vae.load_state_dict(ckpt["vae"])
        if self.ema is not None:
            if ckpt.get("ema"):
                self.ema.load_state_dict(ckpt["ema"])
            else:
                self.ema = EMA(self.vae, self.cfg.ema_decay)
        self.opt_vae.load_state_dict(ckpt["optimizer_vae"])
        self.sched_vae.load_state_dict(ckpt["scheduler_vae"])
        checkpoint.restore_scaler(self.scaler_vae, ckpt.get("scaler_vae"))
        saved_cfg = ckpt.get("config", {})
        same_disc = all(saved_cfg.get(k) == getattr(self.cfg, k) for k in ("discriminator", "disc_norm"))
        if self.disc is not None and ckpt.get("discriminator") is not None and not same_disc:
            self.log("warning: the checkpoint's discriminator is of another kind; the critic starts from scratch")
        if self.disc is not None and ckpt.get("discriminator") is not None and same_disc:
            self.disc.load_state_dict(ckpt["discriminator"])
            self.opt_disc.load_state_dict(ckpt["optimizer_disc"])
            self.sched_disc.load_state_dict(ckpt["scheduler_disc"])
            checkpoint.restore_scaler(self.scaler_disc, ckpt.get("scaler_disc"))
        if self.lecam is not None and ckpt.get("lecam") is not None:
            self.lecam.load_state_dict(ckpt["lecam"])
        self.step = int(ckpt["step"])
        if saved_cfg.get("precision", self.cfg.precision) != self.cfg.precision:
            self.log(f"note: the checkpoint was written with --precision {saved_cfg.get('precision')}; continuing in "
                     f"{self.cfg.precision}" + (" (the fp16 loss scale starts afresh)" if self.cfg.precision == "fp16"
                                                else ""))
        guard = ckpt.get("guard", {})
        self.bad_total.fill_(guard.get("bad_steps_total", 0))
        self.bad_streak.fill_(guard.get("bad_streak", 0))
        self.resumed_from = path
        per_rank = ckpt.get("ranks") or []
        if len(per_rank) == self.info.world_size:
            mine = per_rank[self.info.rank]
            restore_rng(mine["rng"], self.device)
            data_state = mine["data"]
        else:
            self.log(f"warning: {path} was written by {len(per_rank)} ranks, this run has {self.info.world_size}: "
                     "weights and optimizer resume exactly, the data stream and noise restart from new seeds")
            torch.manual_seed(self.cfg.seed + 1000 * self.info.rank + 7919 * self.step)
            data_state = {"batches": self.step * self.cfg.grad_accum}
        self.log(f"resumed from {path} at step {self.step}")
        return data_state

    # ----------------------------------------------------------------------------- the loop
    def train(self) -> int:
        cfg, info = self.cfg, self.info
        stop = StopFlag()
        if self.resumed_from and info.is_main:
            run_log.truncate_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), self.step)
        n_params = sum(p.numel() for p in self.vae.parameters())
        if cfg.train_parts == "decoder":
            trained = sum(p.numel() for p in self.vae.parameters() if p.requires_grad)
            frozen = "the encoder and quant_conv are" if cfg.vae_quant_conv else "the encoder is"
            self.log(f"training the decoder only: {trained / 1e6:.1f}M of {n_params / 1e6:.1f}M parameters; {frozen} "
                     "frozen")
        self.log(f"run dir {self.run_dir} | {info.world_size} x {self.device.type} | VAE {n_params / 1e6:.1f}M params "
                 f"| f{self.vae.downsample_factor} z{cfg.vae_z_channels} {cfg.posterior} posterior | "
                 f"{cfg.precision} | batch {cfg.batch_size} x {cfg.grad_accum} accum x {info.world_size} ranks")
        if self.eval_on and self.step == 0:
            self.evaluate()  # the untrained baseline, and a sanity check of the test set before hours of training
        t_start, steps_since = time.time(), 0
        last_saved = self.step if self.resumed_from else -1
        while self.step < cfg.max_steps:
            self.train_step()
            self.step += 1
            steps_since += 1
            final = self.step == cfg.max_steps
            if self.step % cfg.log_every_n_steps == 0 or final:
                streak = self.log_window(t_start, steps_since)
                t_start, steps_since = time.time(), 0
                if streak >= cfg.max_bad_steps:
                    latest = checkpoint_files(self.ckpt_dir)
                    self.log(f"error: {streak} consecutive steps had non-finite losses or gradients and were "
                             f"skipped; stopping. Last good checkpoint: {latest[0] if latest else 'none'}")
                    return 1
            stopping = stop.agreed(info)
            due = self.step % cfg.save_every_n_steps == 0 or final or stopping
            if due and self.step != last_saved and self.save_unless_in_bad_streak(stopping):
                last_saved = self.step
            if stopping:
                self.log(f"received signal {stop.signum}: checkpoint written at step {self.step}, exiting")
                return 0
            if self.eval_on and (self.step % cfg.evaluate_every_n_steps == 0 or final):
                self.evaluate()
        self.log(f"done: {cfg.max_steps} steps; checkpoints in {self.ckpt_dir}, samples in {self.sample_dir}")
        return 0

    def train_step(self) -> None:
        """One optimizer step over --grad_accum micro-batches: per micro-batch the critic's backward, then the
        VAE's; then both optimizer steps, which the non-finite guard skips on every rank if anything blew up."""
        accum = self.cfg.grad_accum
        step_loss = torch.zeros((), device=self.device)  # this step's losses, for the guard
        for micro in range(accum):
            sync = micro == accum - 1  # DDP all-reduces gradients on the last micro-batch only
            x = data_lib.to_model_input(next(self.loader), self.device, self.cfg.channels_last)
            with no_sync_unless(self.vae_ddp, sync):
                # latents.py's regularisers: the losses below see the transformed image (x unchanged when off)
                target, to_decoder = self.regularisers.draw(x, self.step, micro)
                with self.autocast():
                    recon, mean, logvar = self.vae_ddp(x, latent_transform=to_decoder)
                x, recon = target, recon.float()  # every loss reduces in fp32
                real_logits = fake_logits = None
                if self.disc is not None:  # the critic learns real vs detached fakes, every step
                    d_loss, real_logits, fake_logits = self.critic_backward(x, recon, sync, accum)
                    step_loss = step_loss + d_loss.detach()
                with self.objective.critic_frozen():
                    loss, logs = self.objective(x, recon, mean, logvar, self.step, real_logits, fake_logits, accum,
                                                loss_scale=self.scaler_vae.scale(torch.ones((), device=self.device)),
                                                last_layer=self.vae.decoder.conv_out.weight)
                    step_loss = step_loss + loss.detach()
                    loss.backward()
            self.metrics.add(**{k: v / accum for k, v in logs.items()})
            self.track_latents(mean, logvar, accum)
        self.optimizer_steps(step_loss)
        self.metrics.end_step()

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def critic_backward(self, x, recon, sync, accum):
        """The critic's loss and backward on this micro-batch; its logits for the generator term."""
        with no_sync_unless(self.disc_ddp, sync):
            d_loss, real_logits, fake_logits, logs = self.objective.critic_loss(x, recon, self.disc_ddp)
            self.scaler_disc.scale(d_loss / accum).backward()
        self.metrics.add(**{k: v / accum for k, v in logs.items()})
        return d_loss, real_logits, fake_logits

    def optimizer_steps(self, step_loss: torch.Tensor) -> None:
        """Guarded optimizer steps: a non-finite loss or gradient on any rank skips the step on every rank
        (device flags, no host sync); EMA and LeCam's anchors move only with a step taken."""
        bad_vae = self.nonfinite(self.vae, self.opt_vae, self.scaler_vae, "vae")
        bad_disc = self.nonfinite(self.disc, self.opt_disc, self.scaler_disc, "disc") if self.gan else None
        bad_loss = ~torch.isfinite(step_loss)
        bad_vae = bad_vae | bad_loss
        bad_disc = bad_disc | bad_loss if bad_disc is not None else torch.zeros_like(bad_vae)
        flags = torch.stack([bad_vae, bad_disc]).float()
        if self.info.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.guarded_step(self.opt_vae, self.scaler_vae, flags[0])
        if self.gan:
            self.guarded_step(self.opt_disc, self.scaler_disc, flags[1])
        if self.lecam is not None:
            self.lecam.commit(skip=flags[1])  # the anchors move only with a step the critic took
        if self.ema is not None:
            self.ema.update(self.vae, self.step, flags[0])
        self.sched_vae.step()
        if self.sched_disc is not None:
            self.sched_disc.step()
        bad = flags.amax()
        self.bad_total += bad
        self.bad_streak = (self.bad_streak + 1) * bad
        if self.gan:
            self.metrics.add(**{"guard/skipped_disc": flags[1]})
        self.metrics.add(**{"guard/skipped_vae": flags[0]})

    def nonfinite(self, module, optimizer, scaler, name: str) -> torch.Tensor:
        """Unscale (fp16), clip, log the norm; True (a device bool) if the gradient is not finite."""
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        params = [p for p in module.parameters() if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        self.metrics.add(**{f"grad_norm/{name}": norm})
        return ~torch.isfinite(norm)

    @staticmethod
    def guarded_step(optimizer, scaler, bad: torch.Tensor) -> None:
        optimizer.grad_scale, optimizer.found_inf = None, bad  # grads are already unscaled
        optimizer.step()
        del optimizer.grad_scale, optimizer.found_inf
        if scaler.is_enabled():
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def track_latents(self, mean, logvar, accum) -> None:
        with torch.no_grad():
            mean = mean.float()
            channel_std = mean.std(dim=(0, 2, 3))
            noise_std = (torch.exp(0.5 * logvar.float()).mean(dim=(0, 2, 3)) if logvar is not None
                         else torch.full_like(channel_std, math.sqrt(self.cfg.posterior_var)))
            collapsed = (channel_std / noise_std < 0.1).float().mean()
            self.metrics.add(**{"latent/mean": mean.mean() / accum, "latent/std": mean.std() / accum,
                                "latent/channel_mean": mean.mean(dim=(0, 2, 3)) / accum,
                                "latent/channel_std": channel_std / accum,
                                "latent/collapsed_fraction": collapsed / accum})
            self.metrics.max(**{"latent/abs_max": mean.abs().amax(),
                                "latent/channel_abs_max": mean.abs().amax(dim=(0, 2, 3))})
            if logvar is not None:
                self.metrics.add(**{"latent/logvar_mean": logvar.float().mean() / accum})

    # ----------------------------------------------------------------------------- logging, saving, evaluating
    def log_window(self, t_start: float, steps_done: int) -> int:
        """Reduce and write the metrics of the steps since the last log; returns the streak of skipped steps."""
        metrics = self.metrics.reduce(self.info)
        metrics["guard/bad_steps_total"] = self.bad_total.item()
        streak = int(self.bad_streak.item())
        self.write_log(metrics, t_start, steps_done)
        return streak

    def write_log(self, metrics: dict, t_start: float, steps_done: int) -> None:
        cfg = self.cfg
        elapsed = max(1e-9, time.time() - t_start)
        images = steps_done * cfg.batch_size * cfg.grad_accum * self.info.world_size
        metrics["img_per_s"] = images / elapsed
        metrics["eta_s"] = elapsed / max(1, steps_done) * (cfg.max_steps - self.step)
        metrics["lr/vae"] = self.sched_vae.get_last_lr()[0]
        for k, v in self.loader_skipped().items():
            metrics[f"data/skipped_{k}"] = v
        # the critic winning matters once the generator fights back: a window with generator GAN steps
        self.tracker.check(metrics, self.step, gan_active="loss/gan_g" in metrics)
        if not self.info.is_main:
            return
        print(run_log.log_line(metrics, self.step, cfg.max_steps, self.gan), flush=True)
        run_log.append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), {"step": self.step, **metrics})
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=self.step)

    def loader_skipped(self) -> dict[str, int]:
        skipped = self.loader.skipped()
        counts = torch.tensor(list(skipped.values()), dtype=torch.float64)
        if self.info.distributed:
            dist.all_reduce(counts, group=self.info.ctrl_group)
        return dict(zip(skipped, (int(c) for c in counts.tolist())))

    def save_unless_in_bad_streak(self, stopping: bool) -> bool:
        """Inside a streak of skipped steps the weights are the last good ones, but periodic saves would rotate
        good checkpoints out; a stop request is still honoured (resuming needs it). True if saved."""
        if not (stopping or int(self.bad_streak.item()) == 0):
            self.log(f"not saving at step {self.step}: inside a streak of skipped steps")
            return False
        path = self.save()
        if path:
            self.log(f"saved {path}" + (" (weights identical on all ranks)" if self.info.distributed else ""))
        return True

    def save(self) -> str | None:
        in_sync = self.ranks_in_sync()
        state = self.checkpoint_state()  # every rank takes part in the gather
        state["ranks_in_sync"] = in_sync
        if not self.info.is_main:
            return None
        if not in_sync:
            self.log("warning: VAE weights differ across ranks (DDP desynchronised); saving rank 0's")
        path = checkpoint.write_checkpoint(self.ckpt_dir, self.step, state, self.cfg.keep_last_k)
        self.save_samples()
        return path

    @torch.no_grad()
    def ranks_in_sync(self) -> bool:
        """DDP keeps replicas equal by construction; verify it at each save. The fingerprint of each tensor
        is its float64 dot product with a fixed random vector: any differing element changes it."""
        if not self.info.distributed:
            return True
        gen = torch.Generator(device=self.device).manual_seed(12345)
        sums = torch.stack([torch.dot(t.detach().double().flatten(),
                                      torch.randn(t.numel(), generator=gen, device=self.device, dtype=torch.float64))
                            for t in self.vae.state_dict().values()])
        gathered = [torch.empty_like(sums) for _ in range(self.info.world_size)]
        dist.all_gather(gathered, sums)
        return all(torch.equal(gathered[0], g) for g in gathered[1:])

    @torch.no_grad()
    def save_samples(self) -> str | None:
        import torchvision
        if self.sample_images is None or len(self.sample_images) == 0:
            return None
        x = data_lib.to_model_input(self.sample_images, self.device, self.cfg.channels_last)
        with self.autocast():
            recon = self.vae.decode(self.vae.encode(x)).float()
        grid = torchvision.utils.make_grid(torch.cat([x, recon.clamp(-1, 1)]).float().cpu() * 0.5 + 0.5,
                                           nrow=len(x), padding=2)
        path = os.path.join(self.sample_dir, f"step_{self.step:08d}.png")
        atomic_write(path, lambda f: torchvision.utils.save_image(grid, f, format="png"))
        if self.wandb is not None:
            import wandb
            self.wandb.log({"samples": wandb.Image(path, caption="top: input, bottom: reconstruction")},
                           step=self.step)
        return path

    def evaluate(self) -> dict:
        """PSNR, SSIM, LPIPS, rFID on the fixed test subset, for the weights and (if on) their EMA; every
        rank takes part (images are sharded); rank 0 logs and writes the grid."""
        cfg, results = self.cfg, {}
        models = [("eval", self.vae)]
        if self.ema is not None:
            if self._ema_model is None:
                self._ema_model = AutoEncoder(model_params(cfg)).to(self.device, memory_format=self.memory_format)
            self._ema_model.load_state_dict(self.ema.model_state_dict(self.vae))
            models.append(("eval_ema", self._ema_model))
        for prefix, model in models:
            res = evaluate_lib.evaluate_model(
                model, cfg.test_dataset_url, cfg.vae_resolution, batch_size=cfg.batch_size, device=self.device,
                rank=self.info.rank, world_size=self.info.world_size, max_images=cfg.eval_max_images,
                lpips_model=self.lpips, inception=self.inception, autocast=self.autocast,
                channels_last=cfg.channels_last, grid_images=cfg.num_samples, max_pixels=cfg.max_image_pixels,
                latent_diagnostics=True)
            grid = res.pop("grid")
            results.update({f"{prefix}/{k}": v for k, v in res.items() if not k.endswith("_missing")})
            if self.info.is_main:
                import torchvision
                path = os.path.join(self.sample_dir, f"{prefix}_step_{self.step:08d}.png")
                atomic_write(path, lambda f: torchvision.utils.save_image(grid.float() / 255, f, format="png"))
                if self.wandb is not None:
                    import wandb
                    self.wandb.log({f"{prefix}/grid": wandb.Image(path)}, step=self.step)
        if self.info.is_main:
            def fmt(prefix):
                vals = [f"{k} {results[f'{prefix}/{k}']:.4f}" for k in ("psnr", "ssim", "lpips", "rfid")
                        if results.get(f"{prefix}/{k}") is not None]
                return " ".join(vals) + f" ({results[f'{prefix}/n_images']} images)"
            line = f"eval step {self.step} | {fmt('eval')}"
            if self.ema is not None:
                line += f" | ema {fmt('eval_ema')}"
            print(line, flush=True)
            print(f"latents step {self.step} | high-frequency energy {results['eval/latent_hf_fraction']:.3f} "
                  f"(image at latent size {results['eval/image_hf_fraction']:.3f}) | channel std spread "
                  f"{results['eval/latent_channel_std_spread']:.2f}", flush=True)
            with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": self.step, **results}) + "\n")
            if self.wandb is not None:
                import wandb
                plots = {f"{p}/latent_spectrum_plot": latents_lib.wandb_spectrum_plot(
                    wandb, results[f"{p}/latent_spectrum"], results[f"{p}/image_spectrum"],
                    f"{p} power spectrum, step {self.step}") for p, _ in models}
                self.wandb.log({**{k: v for k, v in results.items() if not isinstance(v, list)}, **plots},
                               step=self.step)
        return results

    def close(self) -> None:
        self.loader.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass


def no_sync_unless(ddp_module, sync: bool):
    """DDP's no_sync (skip the gradient all-reduce) on the micro-batches before the last one."""
    if sync or not isinstance(ddp_module, DDP):
        return contextlib.nullcontext()
    return ddp_module.no_sync()


def prepare_demo(cfg: Config) -> Config:
    """Point the demo at its bundled shards (built once) and pick VGG weights it can use offline."""
    train_url, test_url = data_lib.ensure_demo_shards(os.path.join(cfg.output_dir, "demo_data"))
    changes = {}
    if not cfg.dataset_url:
        changes["dataset_url"] = train_url
    if not cfg.test_dataset_url:
        changes["test_dataset_url"] = test_url
    if cfg.vgg16_weights == "torchvision" and not os.path.isfile(vgg16_cache_path()):
        # LPIPS and the VGG16 critic on a random VGG16 would train on noise gradients: switch both off
        # (demo_summary says so); --vgg16_weights random asks for them anyway, with the loud warning
        changes.update(vgg16_weights="random", perceptual_weight=0.0, do_ganloss=False)
    return dataclasses.replace(cfg, **changes)


def demo_summary(cfg: Config) -> str:
    """The demo's one start-up line: which loss branches it trains and why."""
    if cfg.vgg16_weights == "random" and not uses_vgg16(cfg):
        return (f"demo: no pretrained VGG16 in the torchvision cache ({vgg16_cache_path()}): LPIPS and the VGG16 "
                "critic are OFF (on random features they would train on noise); pixel losses only")
    branches = (["LPIPS"] if cfg.perceptual_weight > 0 else []) + ["pixel"]
    if cfg.do_ganloss:
        branches.append(f"{cfg.discriminator} critic from step {cfg.disc_start}")
    weights = "a RANDOM VGG16" if cfg.vgg16_weights == "random" else "pretrained VGG16"
    return f"demo: {' + '.join(branches)} losses, with {weights}"


def main(argv: list[str] | None = None) -> int:
    is_rank0 = os.environ.get("RANK", "0") == "0"
    try:
        cfg, given = parse_flags(argv)
        if cfg.demo and os.environ.get("LOCAL_RANK", "0") == "0":
            cfg = prepare_demo(cfg)
        elif cfg.demo:
            cfg = prepare_demo_wait(cfg)
        cfg, source = apply_init_source(cfg)
        cfg = resolve_auto(cfg)
        validate(cfg)
        if cfg.demo and is_rank0:
            print(demo_summary(cfg), flush=True)
    except ConfigError as e:
        if is_rank0:
            print(f"error: {data_lib.redact(str(e))}", file=sys.stderr)
        return 2
    for line in config_warnings(cfg, given) if is_rank0 else []:
        print(line, file=sys.stderr, flush=True)
    info = init_distributed()
    trainer, failed = None, False
    try:
        trainer = Trainer(cfg, info, source)
        source = None  # the source's weights are in the model now: do not hold a second copy for the whole run
        return trainer.train()
    except (ConfigError, WeightsUnavailable, data_lib.DatasetError) as e:
        if info.is_main:
            print(f"error: {data_lib.redact(str(e))}", file=sys.stderr)
        failed = True
        return 1
    finally:
        if trainer is not None:
            trainer.close()
            if failed:
                trainer.remove_run_dir_if_unused()
        if dist.is_initialized():
            dist.destroy_process_group()


def prepare_demo_wait(cfg: Config) -> Config:
    """Ranks other than local rank 0 wait for the demo shards that rank builds."""
    data_lib.wait_for_demo_shards(os.path.join(cfg.output_dir, "demo_data"))
    return prepare_demo(cfg)


if __name__ == "__main__":
    sys.exit(main())
