"""The configuration's schema: one dataclass per concern (torchtitan's job_config), nested in `Config`
(cfg.loss.kl_weight, cfg.critic.lecam_weight), with flat flag names; each section checks its own values, `validate`
those across sections; the vocabularies of the choice flags; the automatic values (resolve_auto). Pure values: it
imports no owner, reads no disk or network (run_setup.py does, and turns argv into a run's config), and the flags
are generated from it (flags.py).

    cfg = resolve_auto(cfg); cfg.validate()      # the automatic values made concrete; one line for a bad value
    VAEObjective(cfg.loss, cfg.latents, ...)     # each owner is built from the sections it reads

On disk (config.json, a checkpoint's "config", wandb) the config is flat, one key per flag (`flatten` /
`unflatten`), so every run written before the sections were nested still resumes; `as_released` reads a config of
any earlier release.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch

from common import ConfigError, redact


# The vocabularies of the choice flags, which their owners check against too (one home: the schema).
POSTERIORS = ("constant", "learned", "none")  # ae.AutoEncoder: constant, learned; none: a deterministic encoder
GRAD_CHECKPOINTING = ("none", "decoder_hr", "hr", "decoder", "all")  # ae.AutoEncoder.set_grad_checkpointing
DISC_TYPES = ("hinge", "bce")  # utils.discriminator_loss
DISC_NORMS = ("batch", "group_spectral", "spectral", "none")  # critics.NLayerDiscriminator
DIFFAUG_POLICIES = ("color", "translation", "cutout")  # critics.diff_augment
TAE_VARIANTS = ("f8", "flux_2", "f32", "hv")  # tae.VARIANTS
FAMILY_CHOICES = ("auto", "sd", "sdxl", "sd3", "flux", "flux2")  # ldm_layouts.FAMILIES' latent factors, or auto
DECODER_INITS = ("fresh", "slice")  # ldm_layouts.narrow_decoder_model
# evaluation's metrics a run can keep its best checkpoint by (checkpoint.BestCheckpoint), with their direction
HIGHER_IS_BETTER = {"psnr": True, "ssim": True, "lpips": False, "rfid": False}
BEST_METRICS = ("auto", "none", *HIGHER_IS_BETTER, *(f"ema_{m}" for m in HIGHER_IS_BETTER))


def opt(default, help: str, choices=None, arch: bool = False):
    """A config field: its default, its --help text, its allowed values; `arch`: part of the VAE's architecture
    (a run directory written with another value cannot be resumed: checkpoint.check_compatible)."""
    return field(default=default, metadata={"help": help, "choices": choices, "arch": arch})


AUTO_BOOL = ("auto", "true", "false")


def auto_bool_opt(help: str):
    """A switch whose default, auto, is decided per device when the run starts (what it decides is in the start line,
    not in config.json: a run resumed on another kind of machine decides again). `--flag` alone means true; old
    config.json files hold true/false as JSON booleans (unflatten reads them)."""
    return field(default="auto", metadata={"help": help, "choices": AUTO_BOOL, "arch": False, "auto_bool": True})


def check(section, positive=(), non_negative=(), unit=()) -> None:
    """One line for the first field of `section` out of its range: > 0, >= 0, or in [0, 1]."""
    for name in positive:
        if getattr(section, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(section, name)}")
    for name in non_negative:
        if getattr(section, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(section, name)}")
    for name in unit:
        if not 0 <= getattr(section, name) <= 1:
            raise ConfigError(f"--{name} must be in [0, 1], got {getattr(section, name)}")


# --shuffle_buffer auto (0), by what a sample is: an image file (0.1-1 MB: 1000 of them, the reference trainer's
# buffer, are 0.1-1 GB), or a whole video file (a few MB and more: 128 of them are about as much; 64-256 is plenty
# for clips, run_setup.config_warnings says above that)
SHUFFLE_BUFFER_IMAGES, SHUFFLE_BUFFER_CLIPS = 1000, 128


# ==============================================================================================================
# The sections: each holds its flags and checks its own values (validate); checks across sections are Config's
# ==============================================================================================================
@dataclass
class DataConfig:
    """The training and held-out data and how it is read (data.py)."""
    GROUP: ClassVar[str] = "data"  # the --help group
    TITLE: ClassVar[str] = "Data"  # the flag table's heading

    dataset_url: str = opt("", "training data: webdataset shards ('shards/{00000..01023}.tar', http(s)://, "
                               "pipe:..., lists joined by '::') or a directory of images")
    test_dataset_url: str = opt("", "held-out data for evaluation and sample grids (same forms)")
    batch_size: int = opt(8, "images per GPU per micro-step")
    num_workers: int = opt(-1, "dataloader worker processes per rank. -1: auto, from the CPU cores this rank has "
                               "(cpu_use: half of them, at most 4, at least 1)")
    vae_resolution: int = opt(256, "training crop size in pixels; with --train_resolutions the reference size, "
                                   "at which a micro-batch holds --batch_size images (evaluation and sample grids "
                                   "stay at this size)")
    train_resolutions: str = opt("", "multi-resolution training: a schedule of stages separated by ';', each "
                                     "[STEP:]SIZE[,SIZE...] (the first from step 0), e.g. 192,256,320 or "
                                     "256;20000:384,448,512. Each optimizer step draws its crop size uniformly from "
                                     "its stage's sizes, seeded by --seed and the step (the same on every rank and "
                                     "on resume), and a micro-batch at size s holds max(1, round(batch_size x "
                                     "(vae_resolution / s)^2)) images: about constant pixels per step. '': "
                                     "--vae_resolution alone (docs/training.md, 'Train at 256, serve at 1024')")
    shuffle_buffer: int = opt(0, "samples held (as raw bytes) in the shuffle buffers of one micro-batch's lanes "
                                 "(each lane: this / --batch_size); a rank holds --grad_accum x this. 0: auto, "
                                 f"{SHUFFLE_BUFFER_IMAGES} for images, {SHUFFLE_BUFFER_CLIPS} for clips "
                                 "(--video_frames: each sample a whole video file)")
    resize_prob: float = opt(0.5, "probability of resizing the shorter side to the crop size before cropping "
                                  "(a whole-image view); otherwise crops are taken at native scale")
    max_image_pixels: int = opt(100_000_000, "images with more pixels are skipped (decompression bombs)")
    shard_retry_minutes: float = opt(30.0, "while no remote shard can be read (a server outage), keep retrying with "
                                           "back-off for this long before stopping (0: stop at once)")
    video_frames: int = opt(0, "train on clips: each sample a video (mp4, webm, ...: python data.py make-clips), of "
                               "which a window of this many consecutive frames, 1 + t k for the VAE's temporal factor "
                               "t (Wan's 4: 5, 9, 17, 33, ...), is taken with one crop and flip for every frame; "
                               "--batch_size counts clips. Needs --init_from a video VAE's diffusers folder "
                               "(docs/families.md). 0: images (docs/finetuning.md, 'Fine-tune Wan's VAE on your "
                               "videos')")
    video_frame_stride: int = opt(1, "with --video_frames: every k-th frame of a window of (T - 1) k + 1 frames: "
                                     "a 32 fps video at 2 is 16 fps, Wan 2.1's rate (Wan 2.2: 24). Evaluation's clips "
                                     "too")
    video_image_prob: float = opt(0.0, "with --video_frames: the probability that a step trains on single frames "
                                       "instead of clips (Wan's recipe trains its VAE on images and videos): each "
                                       "sample an image of the shards (kept for these steps) or a random frame of a "
                                       "video; drawn from --seed and the step (the same on every rank and on resume)")
    video_pass_frames: int = opt(512, "with --video_frames: a video of two windows or more is read in passes of "
                                      "about this many consecutive frames, each clip of a pass delivered at a later "
                                      "draw: one seek to a keyframe per pass, so a clip costs about its own frames "
                                      "plus (keyframe interval / this) of one (<= 1.5x at x264's 250 and 512). "
                                      "Smaller mixes videos more, at more decoding (docs/data.md, 'Long videos')")

    def validate(self) -> None:
        check(self, positive=("batch_size", "vae_resolution", "max_image_pixels", "video_frame_stride",
                              "video_pass_frames"),
              non_negative=("shard_retry_minutes", "video_frames", "shuffle_buffer"),  # (0: automatic)
              unit=("resize_prob", "video_image_prob"))
        if self.num_workers < -1:  # -1: automatic (run_setup.resolve_cpu)
            raise ConfigError(f"--num_workers must be >= 0 (or -1: auto), got {self.num_workers}")

    @cached_property
    def stages(self) -> list[tuple[int, tuple[int, ...]]]:
        """--train_resolutions as its stages [(first step, sizes)] ([] for ''), parsed once per section object (the
        flag stays the string config.json holds; dataclasses.replace builds a new section, which parses its own)."""
        return parse_schedule(self.train_resolutions)


@dataclass
class ModelConfig:
    """The autoencoder's architecture and posterior (ae.py's AutoEncoderParams)."""
    GROUP: ClassVar[str] = "model"  # the --help group
    TITLE: ClassVar[str] = "Model"  # the flag table's heading

    vae_family: str = opt("ldm", "ldm: the LDM/FLUX autoencoder of ae.py (FLUX.1, FLUX.2, SD, SDXL, SD3); wan: the "
                                 "Wan 2.1 family of wan_ae.py (Qwen-Image's VAE, Wan 2.1/2.2's); diffusers: any other "
                                 "autoencoder diffusers ships, through its own module; tae: the tiny autoencoders "
                                 "of tae.py (TAESD .. TAEF2, TAESANA, TAEHV; docs/families.md). The architecture of "
                                 "wan and diffusers comes from --init_from (or the run's checkpoints). "
                                 "Set by --init_from; give diffusers with it to train a native family's folder through "
                                 "diffusers' module", arch=True)
    vae_class: str = opt("", "the diffusers class of --vae_family diffusers (docs/families.md). Set by --init_from",
                         arch=True)
    tae_variant: str = opt("f8", "the layout of --vae_family tae (tae.py): f8 (TAESD, TAESDXL, TAESD3, TAEF1), flux_2 "
                                 "(TAEF2: a pooled GroupNorm branch in the blocks nearest the latent), f32 (TAESANA), "
                                 "hv (TAEHV's, for clips; --vae_temporal_factor 4 or 8). Set by --init_from, or by "
                                 "--distill_from's teacher", TAE_VARIANTS, arch=True)
    vae_ch: int = opt(128, "base channel count", arch=True)
    vae_ch_mult: str = opt("1,2,4,4", "channel multiplier per level; downsampling = 2^(levels-1)", arch=True)
    vae_num_res_blocks: int = opt(2, "ResnetBlocks per level", arch=True)
    vae_z_channels: int = opt(16, "latent channels", arch=True)
    vae_norm_groups: int = opt(0, "GroupNorm groups (diffusers' norm_num_groups); every level's channel count must "
                                  "divide by it. 0: auto, the largest divisor of --vae_ch up to min(32, vae_ch/4): "
                                  "32 at 128 (FLUX, SD), 16 at 64, 8 at 32. One channel per group removes each "
                                  "image's per-channel mean (its colour) at every norm and learns slower", arch=True)
    do_attn: bool = opt(True, "self-attention in the mid blocks", arch=True)
    posterior: str = opt("constant", "constant: z = mean + sqrt(posterior_var) * noise; learned: the encoder "
                                     "also predicts the log-variance (standard SD VAE); none: a deterministic encoder, "
                                     "z = mean and no KL term (a diffusers class without a posterior: Cosmos, DC-AE; "
                                     "set by --init_from)", POSTERIORS, arch=True)
    posterior_var: float = opt(0.1, "the fixed VARIANCE sigma^2 of the constant posterior (std = sqrt)")
    do_clamp: bool = opt(False, "clamp the posterior mean to [-clamp_th, clamp_th]")
    clamp_th: float = opt(8.0, "latent clamp threshold used with --do_clamp")
    vae_quant_conv: bool = opt(False, "LDM's 1x1 quant_conv/post_quant_conv around the latent (the SD 1.x/2.x/SDXL "
                                      "and FLUX.2 VAEs; needs --posterior learned). Set by --init_from", arch=True)
    vae_decoder_ch: str = opt("", "the decoder's width per level, highest resolution first (e.g. 96,192,384,384: "
                                  "FLUX.2's small decoder behind the 128,256,512,512 encoder). '': the encoder's "
                                  "widths. With --init_from, a narrower decoder for the source's latent space "
                                  "(--decoder_init)", arch=True)
    vae_latent_bn: bool = opt(False, "FLUX.2's latent normalisation: the running statistics of a BatchNorm over the "
                                     "2x2-patchified latent, kept with the model (never trained) and exported in "
                                     "place of scaling/shift factors. Set by --init_from", arch=True)
    vae_latent_bn_eps: float = opt(1e-4, "the eps of --vae_latent_bn's normalisation (FLUX.2's: 1e-4). Set by "
                                         "--init_from")
    vae_patch_size: int = opt(1, "the image enters the encoder as P x P pixel patches stacked on the channels (Wan "
                                 "2.2's VAE: 2), for a downsample factor 2^(levels-1) x P. Set by --init_from",
                              arch=True)
    vae_spatial_factor: int = opt(0, "the latent grid's downsampling where --vae_ch_mult does not give it (a diffusers "
                                     "class's). 0: 2^(levels-1) x --vae_patch_size. Set by --init_from", arch=True)
    vae_temporal_factor: int = opt(0, "a video VAE's temporal compression t: it takes clips of 1 + t k frames "
                                      "(--video_frames). 0: an image VAE. Set by --init_from", arch=True)

    def validate(self) -> None:
        """The values' ranges and what the LDM flags must agree on (every family's flags satisfy them: the other
        families set neutral values); a family's own refusals are its registry entry's (families.py)."""
        check(self, positive=("vae_ch", "vae_num_res_blocks", "vae_z_channels", "vae_norm_groups", "posterior_var",
                              "vae_latent_bn_eps", "vae_patch_size"),
              non_negative=("vae_spatial_factor", "vae_temporal_factor"))
        if self.do_clamp and self.clamp_th <= 0:
            raise ConfigError(f"--clamp_th must be positive with --do_clamp, got {self.clamp_th}")
        if self.vae_quant_conv and self.posterior != "learned":
            raise ConfigError("--vae_quant_conv needs --posterior learned (the SD VAEs' 2 x z moments)")
        groups, ch_mult = self.vae_norm_groups, self.ch_mult
        for mult in (1,) + ch_mult:
            if (self.vae_ch * mult) % groups:
                raise ConfigError(f"channel count {self.vae_ch} x {mult} = {self.vae_ch * mult} is not divisible by "
                                  f"the {groups} GroupNorm groups (--vae_ch / --vae_ch_mult / --vae_norm_groups)")
        decoder, flag = decoder_channels_of(self), f"--vae_decoder_ch {self.vae_decoder_ch}"
        if decoder and len(decoder) != len(ch_mult):
            raise ConfigError(f"{flag}: decoder_channels {list(decoder)} has {len(decoder)} levels, the encoder "
                              f"{len(ch_mult)}: the decoder must upsample the latent as much as the encoder "
                              "downsamples it")
        if decoder and min(decoder) <= 0:
            raise ConfigError(f"{flag}: decoder_channels must be positive, got {list(decoder)}")
        bad = [w for w in decoder if w % groups]
        if bad:
            raise ConfigError(f"{flag}: the decoder's widths {list(decoder)} must be multiples of the {groups} "
                              f"GroupNorm groups (norm_groups): {bad} are not")

    @cached_property
    def ch_mult(self) -> tuple[int, ...]:
        """--vae_ch_mult as integers, parsed once per section object (the flag stays the string config.json holds;
        dataclasses.replace builds a new section, which parses its own). ConfigError (one line) for a malformed one."""
        return parse_ch_mult(self.vae_ch_mult)


@dataclass
class FinetuneConfig:
    """Starting from a released VAE, and which parts train."""
    GROUP: ClassVar[str] = "finetune"  # the --help group
    TITLE: ClassVar[str] = "Fine-tuning a released VAE ([how](finetuning.md))"  # the flag table's heading

    init_from: str = opt("", "start from a released VAE: a diffusers VAE folder of any family (FLUX, SD, SDXL, SD3, "
                             "FLUX.2, Qwen-Image, Wan, LTX-Video, HunyuanVideo, CogVideoX, Mochi, Cosmos, ...: "
                             "docs/families.md), FLUX.1's or FLUX.2's ae.safetensors, an SD VAE file or a full SD "
                             "checkpoint (first_stage_model.*). The architecture (the --vae_* flags, --posterior) and "
                             "the latent normalisation (factors, FLUX.2's bn statistics, per-channel statistics) are "
                             "read from it")
    init_family: str = opt("auto", "the family of an --init_from single file, for its latent factors (a VAE-only "
                                   "file does not say whether it is SD's or SDXL's, FLUX.1's or SD3's; one with bn "
                                   "statistics is FLUX.2's)",
                           FAMILY_CHOICES)
    train_parts: str = opt("all", "all: train the whole VAE; decoder: freeze the encoder, quant_conv and the "
                                  "posterior (no_grad, eval mode, not in the optimizer, EMA or DDP), train the "
                                  "decoder: the latent space stays the source's, so export keeps its latent factors",
                           ("all", "decoder"))
    last_stage_trains: str = opt("all", "in the last stage of a --train_resolutions schedule of 2+ stages (DC-AE's "
                                        "high-resolution adaptation): all, or N: only the decoder's N highest-"
                                        "resolution levels (their up blocks) with norm_out and conv_out train (0: "
                                        "those two alone); everything else is frozen from the stage's first step "
                                        "(no gradient, its AdamW moments kept; DDP wraps what trains)")
    distill_from: str = opt("", "distil a tiny autoencoder (--vae_family tae, the run's model) from this teacher: any "
                                "VAE --init_from reads (FLUX.1/2, SD, SDXL, Wan, a diffusers class, a released TAE), "
                                "frozen. The student's encoder learns the teacher's latents as its pipelines hand them "
                                "to their diffusion model (--distill_latent_weight), its decoder reconstructs the "
                                "images from those latents with the run's losses and critic. Without --init_from the "
                                "student's architecture follows the teacher's latent (docs/finetuning.md)")
    decoder_init: str = opt("fresh", "with --init_from and a --vae_decoder_ch other than the source's: fresh (a new "
                                     "decoder, initialised as a new model's; with --distill_weight) or slice (the "
                                     "source decoder's leading channels of every tensor: a warm start)",
                            DECODER_INITS)

    def validate(self) -> None:
        pass  # its values are choices (argparse) and a path (run_setup checks it)


@dataclass
class LossConfig:
    """Every loss term of the VAE and how the terms are balanced (objective.py's VAEObjective): the reconstruction,
    latent and distillation terms, and the generator's adversarial term against the critic."""
    GROUP: ClassVar[str] = "loss"  # the --help group
    TITLE: ClassVar[str] = "Losses"  # the flag table's heading

    loss_balance: str = opt("gradnorm", "gradnorm: each branch's gradient on the reconstruction is normalised to "
                                        "its weight; adaptive: LDM's adaptive GAN weight; none: plain weighted sum",
                            ("gradnorm", "adaptive", "none"))
    perceptual_weight: float = opt(1.0, "LPIPS branch weight")
    mse_weight: float = opt(1.0, "pixel (pooled + low-pass MSE) branch weight")
    pooled_mse_weight: float = opt(1.0, "pooled MSE inside the pixel branch")
    lowpass_mse_weight: float = opt(1.0, "low-pass MSE inside the pixel branch")
    mse_pool_factor: int = opt(16, "area-pooling factor of the pooled MSE")
    lowpass_threshold: float = opt(0.8, "blurriness above which a pixel counts as low-frequency")
    distill_weight: float = opt(0.0, "a GradNorm branch pulling the reconstruction toward the --init_from source's "
                                     "own decoder's reconstruction of the same latent (the teacher: frozen, never "
                                     "saved), for a narrower decoder (--vae_decoder_ch); what it buys: "
                                     "BENCHMARKS.md section 8. Needs --init_from and --train_parts decoder. 0: off")
    distill_latent_weight: float = opt(1.0, "--distill_from: the weight of the student encoder's MSE to the "
                                            "teacher's latents (outside GradNorm: the encoder gets no other loss; the "
                                            "decoder decodes the teacher's latents)")
    temporal_weight: float = opt(0.0, "clips (--video_frames): a GradNorm branch on the frame-difference error, "
                                      "mean(((r[t+1] - r[t]) - (x[t+1] - x[t]))^2): the reconstruction should change "
                                      "from frame to frame as the input does (no flicker; evaluation's temporal_psnr "
                                      "is its PSNR). What it buys: BENCHMARKS.md section 12. 0: off")
    kl_weight: float = opt(0.003, "weight of the KL / latent penalty (constant posterior: 0.5 * mean^2). gradnorm: "
                                  "summed over the rank's latent elements and divided by the square root of their "
                                  "count, so its gradient at the latent has norm kl_weight * rms(mean) at any batch "
                                  "and resolution; adaptive, none: averaged per latent element, like the other "
                                  "losses")
    # the generator's adversarial term (its critic: CriticConfig)
    gan_weight: float = opt(0.5, "GAN branch weight (gradnorm: the branch's gradient norm while every patch is "
                                 "active, times sqrt(active fraction) with the thresholded loss; adaptive: "
                                 "multiplies the adaptive weight)")
    gen_loss: str = opt("thresholded", "generator loss: thresholded = relu(D(x) - D(x_hat) - margin) (reference); "
                                       "ldm = -mean(D(x_hat)); nonsaturating = softplus(-D(x_hat))",
                      ("thresholded", "ldm", "nonsaturating"))
    gan_margin: float = opt(0.1, "margin of the thresholded generator loss")
    disc_start: int = opt(-1, "step from which the generator gets the adversarial term (D trains from 0). -1: "
                              "auto, a fifth of --max_steps")
    gan_ramp_steps: int = opt(0, "steps over which the generator term ramps linearly from 0 after --disc_start "
                                 "(0: a step function, the reference)")
    adaptive_weight_max: float = opt(1e4, "clamp of LDM's adaptive weight")

    def validate(self) -> None:
        check(self, positive=("mse_pool_factor",), unit=("lowpass_threshold",),
              non_negative=("gan_margin", "disc_start", "gan_ramp_steps"))


@dataclass
class CriticConfig:
    """The critic: its network, loss, optimizer and stabilisers (objective.py's Adversary). The generator's
    adversarial term it trains against is the loss section's (LossConfig: gan_weight, disc_start, ...)."""
    GROUP: ClassVar[str] = "gan"  # the --help group
    TITLE: ClassVar[str] = "Discriminator (GAN)"  # the flag table's heading

    do_ganloss: bool = opt(False, "train with the discriminator")
    discriminator: str = opt("vgg16", "vgg16: VGG16 feature slices with conv heads; patchgan: N-layer PatchGAN; "
                                      "patchgan3d: its Conv3d twin judging whole clips (--video_frames)",
                             ("vgg16", "patchgan", "patchgan3d"))
    disc_type: str = opt("hinge", "discriminator loss", DISC_TYPES)
    disc_norm: str = opt("group_spectral", "the PatchGANs' normalisation (patchgan, patchgan3d)", DISC_NORMS)
    learning_rate_disc: float = opt(0.0, "discriminator learning rate. 0: auto, 1e-5 for the vgg16 critic (a "
                                         "pretrained trunk, as the reference), --learning_rate_vae for the PatchGANs "
                                         "(as LDM)")
    lecam_weight: float = opt(0.0, "LeCam regularisation weight for the discriminator (0: off)")
    critic_trunk: str = opt("trainable", "the vgg16 critic's trunk. trainable: its own VGG16, trained (the "
                                         "reference); frozen: LPIPS' VGG16, run once per micro-batch for LPIPS and "
                                         "the critic, heads train (Projected GAN; docs/recipe.md)",
                            ("trainable", "frozen"))
    diffaug: str = opt("", "DiffAugment policy of the critic's real and fake images, e.g. "
                           "color,translation,cutout ('': off; trainable trunk only)")
    r1_weight: float = opt(0.0, "R1 gamma: gamma/2 * E|grad D(real)|^2 on the critic's inputs (the features when "
                                "frozen; per clip with patchgan3d, summed over its T frames: ~T times a frame "
                                "critic's at the same gamma; 0: off)")
    vgg16_weights: str = opt("torchvision", "VGG16 for LPIPS and the discriminator: torchvision (its download "
                                            "cache), a local state-dict PATH, or random (tests/demo only)")

    def validate(self) -> None:
        check(self, positive=("learning_rate_disc",))
        if self.critic_trunk == "frozen" and self.discriminator != "vgg16":
            raise ConfigError("--critic_trunk frozen needs --discriminator vgg16 (its heads read LPIPS' VGG16 "
                              "features)")
        if self.diffaug and self.critic_trunk == "frozen":
            raise ConfigError("--diffaug needs --critic_trunk trainable: augmented images would need their own pass "
                              "through the frozen trunk, the pass it shares with LPIPS")
        if self.diffaug and self.discriminator == "patchgan3d":
            raise ConfigError("--diffaug draws per image, not per clip: leave it off with --discriminator patchgan3d")
        unknown = sorted(set(filter(None, self.diffaug.split(","))) - set(DIFFAUG_POLICIES))
        if unknown:
            raise ConfigError(f"--diffaug {self.diffaug}: unknown {','.join(unknown)} (choose from "
                              f"{','.join(DIFFAUG_POLICIES)})")

    def kind(self) -> dict:
        """What the critic is: a checkpoint's critic resumes only into one of its kind (objective.Adversary,
        checkpoint's migration of earlier files), and its automatic learning rate is derived again for another
        (run_setup.auto_basis, in words: describe)."""
        return {"discriminator": self.discriminator, "disc_norm": self.disc_norm, "critic_trunk": self.critic_trunk}

    def describe(self) -> str:
        """The critic's kind in words."""
        if self.discriminator != "vgg16":
            return f"the {self.discriminator} critic"
        return f"the vgg16 critic with a {self.critic_trunk} trunk"


@dataclass
class OptimConfig:
    """AdamW, the schedule, the step budget, EMA, the seed."""
    GROUP: ClassVar[str] = "optim"  # the --help group
    TITLE: ClassVar[str] = "Optimisation"  # the flag table's heading

    learning_rate_vae: float = opt(0.0, "VAE learning rate (AdamW). 0: auto, 0.032 / --vae_ch (1e-3 at ch 32, "
                                        "2.5e-4 at ch 128); a tenth of that with --init_from (1e-5 from a "
                                        "released tiny autoencoder: BENCHMARKS.md section 21)")
    weight_decay: float = opt(1e-3, "AdamW weight decay (both networks)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.95, "AdamW beta2")
    warmup_steps: int = opt(-1, "linear warm-up steps of the cosine schedule. -1: auto, a tenth of --max_steps, "
                                "at most 1000")
    min_lr_ratio: float = opt(0.0, "final learning rate as a fraction of the peak")
    grad_clip: float = opt(1.0, "clip the global gradient norm of each network (0: off)")
    max_steps: int = opt(10000, "optimizer steps to train (every rank runs exactly this many)")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    ema_decay: float = opt(0.999, "EMA of the VAE weights, in fp32, with warm-up (0: off)")
    seed: int = opt(42, "random seed")

    def validate(self) -> None:
        check(self, positive=("learning_rate_vae", "max_steps", "grad_accum"),
              non_negative=("warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio"),
              unit=("adam_beta1", "adam_beta2", "min_lr_ratio"))
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"--ema_decay must be in [0, 1), got {self.ema_decay}")


@dataclass
class SpeedConfig:
    """Precision and speed; none of these changes what is learned beyond rounding."""
    GROUP: ClassVar[str] = "speed"  # the --help group
    TITLE: ClassVar[str] = "Precision and speed"  # the flag table's heading

    precision: str = opt("fp32", "fp32 (recommended for VAEs), or bf16/fp16 autocast with fp32 statistics and losses "
                                 "(docs/precision.md)", ("fp32", "bf16", "fp16"))
    allow_tf32: str = auto_bool_opt("TF32 tensor cores for fp32 convolutions and matmuls on Ampere+ GPUs: fp32 "
                                    "storage, range and accumulation, 10-bit multiplicands. auto: on with CUDA "
                                    "(PyTorch's own default for convolutions; quality measured in BENCHMARKS.md "
                                    "section 10), irrelevant on a CPU")
    grad_checkpointing: str = opt("none", "recompute activations in backward, one block at a time: decoder_hr (the "
                                          "decoder's two highest-resolution levels), hr (those of the encoder too), "
                                          "decoder (every decoder level), all", GRAD_CHECKPOINTING)
    channels_last: str = auto_bool_opt("channels_last memory format of the VAE (the loss networks' is channels_last "
                                       "unless false). auto: on a CPU channels_last; with CUDA the VAE stays NCHW, "
                                       "because PyTorch's CUDA GroupNorm copies a channels_last input to NCHW and "
                                       "back at every norm (docs/precision.md)")
    train_time_chunks: str = opt("", "clips (--video_frames): train each clip in temporal chunks of E frames (after "
                                     "its first) through the encoder and D latent frames through the decoder, 'E,D' "
                                     "(e.g. 8,2; 4,1 is diffusers' inference plan), each chunk recomputed in backward "
                                     "and the gradient carried through the temporal cache: peak activation memory "
                                     "follows the chunk, not the clip, for the same gradient (to float rounding) and "
                                     "a slower step (one more forward; BENCHMARKS.md section 17). E a multiple of the "
                                     "temporal "
                                     "factor, both dividing the clip's latent frames after the first; 0 for a part: "
                                     "that part whole. '': the whole clip at once. The Wan family's video model")
    compile: bool = opt(False, "torch.compile the encoder, decoder and discriminator")
    sharding: str = opt("ddp", "how the VAE's training state is spread over the ranks: ddp, whole on every rank (about "
                               "20 bytes per parameter each); fsdp, sharded over every rank (1/N each, FSDP2, "
                               "checkpoints by every rank that resume on any world size); hsdp, sharded within a "
                               "node and replicated across nodes (docs/sharding.md)", ("ddp", "fsdp", "hsdp"))
    memory_check: bool = opt(True, "before the first step, estimate the step's memory: stop (exit 2) if it exceeds "
                                   "the free memory by more than the estimate's error (25%), warn if it may not fit")
    num_threads: int = opt(0, "torch threads per rank. 0: auto, the rank's CPU cores left to it by its data workers")

    def validate(self) -> None:
        check(self, non_negative=("num_threads",))
        time_chunks_of(self)
        for name in ("allow_tf32", "channels_last"):
            if getattr(self, name) not in AUTO_BOOL:
                raise ConfigError(f"--{name} must be one of {', '.join(AUTO_BOOL)}, got {getattr(self, name)!r}")

    @property
    def time_chunks(self) -> tuple[int, int]:
        """--train_time_chunks as (encoder frames, decoder latent frames) per chunk; (0, 0): the whole clip."""
        return time_chunks_of(self)

    def on(self, device_type: str, video_frames: int = 0) -> "DeviceSpeed":
        """This section on one kind of device, resolved once by the run's root (vae_trainer.Trainer) and handed to
        each owner: --precision as a Precision, and --allow_tf32's and --channels_last's auto decided for the device
        (config.json keeps auto: a run resumed on another kind of machine decides again)."""
        tf32 = self.allow_tf32 == "true" or (self.allow_tf32 == "auto" and device_type == "cuda")
        # the VAE: auto is channels_last on a CPU (oneDNN's convolutions and GroupNorm prefer it) and NCHW with CUDA,
        # where native_group_norm copies a channels_last input to NCHW, and cuDNN then copies its NCHW output back
        # for a channels_last convolution, at every norm (BENCHMARKS.md section 4; tests/test_copies.py counts those
        # copies). The video VAE's (Conv3d) is contiguous: the losses see its frames as images.
        vae_channels_last = self.channels_last == "true" or (self.channels_last == "auto" and device_type != "cuda")
        vae_channels_last = vae_channels_last and self.sharding == "ddp"  # FSDP shards contiguous parameters only
        fmt = {True: torch.channels_last, False: torch.contiguous_format}
        return DeviceSpeed(Precision.of(self.precision), tf32, fmt[vae_channels_last and not video_frames],
                           fmt[self.channels_last != "false"], self.compile, device_type)


@dataclass(frozen=True)
class Precision:
    """--precision as its owners use it: the autocast dtype (None: fp32) and whether the loss is scaled (fp16's
    GradScaler). Built once at the run's root (SpeedConfig.on) and handed to every owner that runs autocast or a
    scaler (objective.VAEObjective and Adversary, train_state.VAETraining, memory.StepShape)."""
    name: str  # fp32 | bf16 | fp16, the flag's value
    amp_dtype: torch.dtype | None
    scaled: bool

    @classmethod
    def of(cls, name: str) -> "Precision":
        """The precision of a --precision value; ConfigError (one line) for another."""
        amp_dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # the one copy of this mapping
        if name not in amp_dtypes:
            raise ConfigError(f"--precision must be one of {', '.join(amp_dtypes)}, got {name!r}")
        return cls(name, amp_dtypes[name], scaled=name == "fp16")

    def autocast(self, device_type: str):
        """The autocast context of this precision on the device (disabled for fp32)."""
        return torch.autocast(device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """A GradScaler, enabled when the loss is scaled (fp16)."""
        return torch.amp.GradScaler(device_type, enabled=self.scaled)


FP32 = Precision.of("fp32")  # the owners' default, for those built outside a run (tests, bench)


@dataclass(frozen=True)
class DeviceSpeed:
    """The speed section as it is on one kind of device (SpeedConfig.on): a runtime value, never written (config.json
    holds the flags, auto included)."""
    precision: Precision
    tf32: bool  # TF32 tensor cores for fp32 convolutions and matmuls (auto: on with CUDA)
    memory_format: torch.memory_format  # the VAE's (auto: channels_last on a CPU, NCHW with CUDA)
    loss_memory_format: torch.memory_format  # LPIPS' VGG16 and the critics' (channels_last unless false)
    compiled: bool
    device_type: str

    def describe(self) -> str:
        """The start line's precision, TF32, compile and memory-format state: 'fp32 (TF32 on), eager, VAE NCHW'."""
        name = self.precision.name
        precision = name if name == "fp32" else f"{name} autocast"
        if self.device_type == "cuda" and name == "fp32":
            precision += f" (TF32 {'on' if self.tf32 else 'off'})"
        layout = "channels_last" if self.memory_format == torch.channels_last else "NCHW"
        return f"{precision}, {'compiled' if self.compiled else 'eager'}, VAE {layout}"


@dataclass
class LatentsConfig:
    """Regularisers that make the latent easier for a diffusion model (latents.py)."""
    GROUP: ClassVar[str] = "latents"  # the --help group
    TITLE: ClassVar[str] = "Latents for diffusion"  # the flag table's heading

    scale_equivariance_prob: float = opt(0.0, "probability per step (all its micro-batches) that the latent is "
                                              "downsampled (and rotated/flipped with --scale_equivariance_rotate) "
                                              "and decoded, and "
                                              "the losses compare with the equally downsampled image (a smoother, "
                                              "more diffusable latent; --scale_equivariance_form). 0: off")
    scale_equivariance_form: str = opt("replace", "replace: that decode replaces the full-resolution reconstruction "
                                                  "on those micro-batches (EQ-VAE, Kouzelis et al. 2025); add: the "
                                                  "full-resolution losses stay and the decode adds a term (LPIPS and "
                                                  "pixel losses, no critic) of weight --scale_equivariance_weight "
                                                  "(Skorokhodov et al. 2025, Improving the Diffusability of "
                                                  "Autoencoders)", ("replace", "add"))
    scale_equivariance_weight: float = opt(0.25, "--scale_equivariance_form add: alpha, the added term's weight "
                                                 "relative to the reconstruction's (each of its branches weighs "
                                                 "alpha x the full-resolution branch's weight); our default, to be "
                                                 "measured")
    scale_equivariance_mode: str = opt("half", "half: x0.5; random: a latent size drawn from a quarter up to one "
                                               "less than the full one", ("half", "random"))
    scale_equivariance_rotate: bool = opt(False, "also rotate by 0/90/180/270 degrees and flip (both the latent "
                                                 "and the image) on scale-equivariance steps")
    latent_noise_prob: float = opt(0.0, "probability per image that the decoder sees z + Gaussian noise (a "
                                        "decoder robust to a diffusion model's imperfect latents). 0: off")
    latent_noise_max: float = opt(0.5, "the noise std is U(0, this) times the batch's latent std")
    vf_weight: float = opt(0.0, "vision-foundation alignment (VA-VAE's VF loss, alignment.py): the norm of its "
                                "gradient at the latent (a GradNorm branch, like --mse_weight). 0: off")
    vf_model: str = opt("dinov2_vitl14", "the frozen foundation encoder the latent is aligned with",
                        ("dinov2_vitl14", "dinov2_vitb14", "dinov2_vits14"))
    vf_weights: str = opt("timm", "its weights: timm (timm's Hugging Face cache), a local PATH, random (tests only)")
    vf_image_size: int = opt(224, "the images are resized to this for the foundation encoder (patch 14: 16 x 16 "
                                  "tokens at 224)")
    probe_every_n_steps: int = opt(0, "every N steps, train the diffusability probe's small DiT on the (EMA) VAE's "
                                      "latents of a fixed probe set and log its held-out loss as eval/probe_loss. "
                                      "0: off")
    probe_images: int = opt(64, "images in the probe set (the first ones of --test_dataset_url, else "
                                "--dataset_url)")
    probe_heldout: int = opt(16, "of them, held out for the probe's loss")
    probe_steps: int = opt(100, "the probe DiT's training steps at each probe")
    probe_batch_size: int = opt(32, "the probe DiT's batch size")

    def validate(self) -> None:
        check(self, unit=("scale_equivariance_prob", "latent_noise_prob"), non_negative=("latent_noise_max",))
        if self.vf_image_size < 14 or self.vf_image_size % 14:
            raise ConfigError(f"--vf_image_size must be a positive multiple of 14 (the patch size), got "
                              f"{self.vf_image_size}")
        if min(self.probe_every_n_steps, self.probe_steps, self.probe_batch_size) < 0 or self.probe_heldout < 1 \
                or self.probe_images <= self.probe_heldout:
            raise ConfigError(f"the probe needs --probe_images ({self.probe_images}) > --probe_heldout "
                              f"({self.probe_heldout}) >= 1 and non-negative --probe_every_n_steps/steps/batch_size")


@dataclass
class EvalConfig:
    """Evaluation during training (evaluate.py's Validator)."""
    GROUP: ClassVar[str] = "eval"  # the --help group
    TITLE: ClassVar[str] = "Evaluation"  # the flag table's heading

    evaluate_every_n_steps: int = opt(1000, "evaluate on --test_dataset_url every N steps (0: off)")
    eval_max_images: int = opt(256, "images of the test set used by evaluation during training")
    inception_weights: str = opt("torchvision", "FID Inception-v3 for rFID during evaluation: torchvision (torch "
                                                "hub's cache), a local PATH, random (tests only) or none")
    eval_resolutions: str = opt("", "comma-separated crop sizes in pixels to evaluate at besides --vae_resolution "
                                    "(e.g. 512,1024: the sizes the VAE will serve), logged as eval/psnr@512 and the "
                                    "like; the un-suffixed keys stay --vae_resolution's. '': the training size only")
    eval_tile_size: int = opt(0, "evaluation at sizes above this many pixels encodes and decodes in tiles of this "
                                 "size (evaluate.py's tiling), for sizes whose whole image does not fit. 0: off")
    eval_tile_overlap: int = opt(128, "with --eval_tile_size: overlap of neighbouring tiles, pixels")
    best_metric: str = opt("auto", "keep the checkpoint of the evaluated step with the best held-out value of this "
                                   "metric (higher PSNR and SSIM, lower LPIPS and rFID; ema_*: the EMA weights'), "
                                   "named by checkpoints/best and never rotated out (evaluate.py and export.py "
                                   "--best read it). auto: ema_psnr with EMA, else psnr, whenever the run evaluates "
                                   "(step 0's value is the bar); none: off", BEST_METRICS)

    def validate(self) -> None:
        check(self, positive=("eval_max_images",), non_negative=("evaluate_every_n_steps", "eval_tile_size"))
        parse_sizes(self.eval_resolutions, "eval_resolutions")  # the sizes themselves: validate_across_sections
        if self.eval_tile_size and not 0 <= self.eval_tile_overlap < self.eval_tile_size:
            raise ConfigError(f"--eval_tile_overlap must be >= 0 and smaller than --eval_tile_size "
                              f"{self.eval_tile_size}, got {self.eval_tile_overlap}")


@dataclass
class RunConfig:
    """The run directory, logging, checkpoints, resuming."""
    GROUP: ClassVar[str] = "run"  # the --help group
    TITLE: ClassVar[str] = "Run, logging, checkpoints"  # the flag table's heading

    output_dir: str = opt("runs", "where run directories live")
    run_name: str = opt("vae", "run directory name and wandb run name")
    project_name: str = opt("vae-trainer", "wandb project")
    wandb_mode: str = opt("offline", "wandb: offline (sync later), online, or disabled",
                          ("offline", "online", "disabled"))
    log_every_n_steps: int = opt(50, "log (stdout, metrics.jsonl, wandb) every N steps")
    save_every_n_steps: int = opt(1000, "checkpoint and sample grid every N steps")
    num_samples: int = opt(8, "images in each sample grid")
    keep_last_k: int = opt(3, "checkpoints kept in <run_dir>/checkpoints")
    resume: str = opt("auto", "auto: continue from the run directory's latest checkpoint; never: refuse a "
                              "run directory that has checkpoints; or a checkpoint PATH")
    load_path: str = opt("", "initialise the VAE weights from a checkpoint or .safetensors (fine-tuning)")
    force: bool = opt(False, "accept a run directory written with a different architecture")
    max_bad_steps: int = opt(20, "stop after this many consecutive non-finite (skipped) steps")
    demo: bool = opt(False, "a tiny model at 64 px that trains in minutes on a CPU (its settings, flags.DEMO, "
                            "replace these defaults; a flag given wins): on bundled sample photos, or on your "
                            "--dataset_url (run name demo_own_data; evaluated on the demo's 4 held-out photos "
                            "unless --test_dataset_url); docs/demo.md")

    def validate(self) -> None:
        check(self, positive=("log_every_n_steps", "save_every_n_steps", "num_samples", "keep_last_k",
                              "max_bad_steps"))
        if not re.fullmatch(r"[A-Za-z0-9_.=+-]+", self.run_name):
            raise ConfigError(f"--run_name {self.run_name!r}: use letters, digits and _.=+- only")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.run_name)


# ==============================================================================================================
# The whole config: the sections nested, flat on disk and on the command line
# ==============================================================================================================
@dataclass
class Config:
    """Every section, by name (torchtitan's JobConfig). Owners take their sections: `Reporter(cfg.run, ...)`."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    latents: LatentsConfig = field(default_factory=LatentsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def sections(self) -> list[tuple[str, Any]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def validate(self) -> None:
        """Refuse bad values with one line, before any process group or worker starts: each section's own checks,
        then those across sections. (Paths and remote data are run_setup's: they need the disk and the network.)"""
        for _, section in self.sections():
            section.validate()
        # every weight of a loss term, whatever its section: a new term's weight is checked without an edit here
        for section_name, section in self.sections():
            for f in dataclasses.fields(section):
                if f.name.endswith("_weight") and f.type in (float, "float"):
                    check(section, non_negative=(f.name,))
        validate_across_sections(self)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # name -> section class, in order
FIELD_SECTION = {f.name: name for name, kind in SECTIONS.items() for f in dataclasses.fields(kind)}  # flag -> section
AUTO_BOOL_FIELDS = {f.name for kind in SECTIONS.values() for f in dataclasses.fields(kind) if f.metadata.get("auto_bool")}


def flatten(cfg: Config) -> dict[str, Any]:
    """{flag name: value}, sections in order: what config.json, a checkpoint's "config" and wandb hold."""
    return {f.name: getattr(section, f.name) for _, section in cfg.sections() for f in dataclasses.fields(section)}


def as_written_now(name: str, value):
    """A value of config.json as today's config holds it: true/false of a switch that was a plain bool then."""
    return str(value).lower() if name in AUTO_BOOL_FIELDS and isinstance(value, bool) else value


def unflatten(flat: dict[str, Any], base: Config | None = None) -> Config:
    """The Config of `flat` ({flag name: value}; other keys, such as config.json's "derived", are ignored), over
    `base`'s values (default: the defaults)."""
    base = base if base is not None else Config()
    by_section: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        if name in FIELD_SECTION:
            value = as_written_now(name, value)
            by_section.setdefault(FIELD_SECTION[name], {})[name] = value
    return dataclasses.replace(base, **{name: dataclasses.replace(getattr(base, name), **values)
                                        for name, values in by_section.items()})


def with_values(cfg: Config, **flat) -> Config:
    """`cfg` with some values changed, by flag name: with_values(cfg, kl_weight=0.01)."""
    unknown = set(flat) - set(FIELD_SECTION)
    if unknown:
        raise TypeError(f"no such config fields: {sorted(unknown)}")
    return unflatten(flat, cfg)


def public_config(cfg: Config) -> dict:
    """The flat config with credentials in dataset urls redacted: what is written to disk and sent to wandb."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in flatten(cfg).items()}


# A run directory written with other values of these cannot be resumed (the VAE's weights would not fit).
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata["arch"])
# The flags --init_from sets from its source (the architecture and the posterior's settings).
SOURCE_FIELDS = ARCH_FIELDS + ("posterior_var", "do_clamp", "vae_latent_bn_eps")
# What runs written before a field existed used (config.json without it): 32 groups before --vae_norm_groups,
# no quant convs before --vae_quant_conv.
LEGACY_ARCH = {"vae_norm_groups": 32, "vae_quant_conv": False, "vae_decoder_ch": "", "vae_latent_bn": False,
               "vae_family": "ldm", "vae_patch_size": 1, "vae_class": "", "vae_spatial_factor": 0,
               "vae_temporal_factor": 0, "tae_variant": "f8"}
# Before --vae_temporal_factor, the one video VAE was the Wan family's, whose clips have 1 + 4k frames.
LEGACY_VIDEO_TEMPORAL_FACTOR = 4


def as_released(saved: dict) -> dict:
    """A flat config of any release (config.json, a checkpoint's "config") with every field it lacks filled in
    with what that release did: LEGACY_ARCH's value, else the field's default (a field comes in with the default
    that keeps the behaviour before it: --vae_latent_bn_eps came with FLUX.2 support, and a run written before
    it has no bn to normalise). For comparing a saved run with this one; tests/test_releases.py continues runs
    written by earlier releases."""
    defaults = {f.name: f.default for kind in SECTIONS.values() for f in dataclasses.fields(kind)}
    return {**defaults, **with_legacy_arch(saved)}


def with_legacy_arch(saved: dict) -> dict:
    """`saved` (a flat config of any release) with the architecture fields it lacks as that release had them."""
    legacy = dict(LEGACY_ARCH)
    if saved.get("video_frames"):  # a video run of a release before --vae_temporal_factor: Wan's video model
        legacy["vae_temporal_factor"] = LEGACY_VIDEO_TEMPORAL_FACTOR
    return {**legacy, **{k: as_written_now(k, v) for k, v in saved.items()}}


def parse_ch_mult(text: str) -> tuple[int, ...]:
    """--vae_ch_mult as integers, the one place the string is parsed (ModelConfig.ch_mult holds the result)."""
    try:
        mult = tuple(int(m) for m in text.split(","))
    except ValueError:
        raise ConfigError(f"--vae_ch_mult must be comma-separated integers, got {text!r}") from None
    if not mult or min(mult) <= 0:
        raise ConfigError(f"--vae_ch_mult must be positive integers, got {text!r}")
    return mult


def time_chunks_of(speed: SpeedConfig) -> tuple[int, int]:
    """--train_time_chunks as (encoder frames, decoder latent frames) per chunk; (0, 0): the whole clip."""
    text = speed.train_time_chunks.strip()
    if not text:
        return (0, 0)
    try:
        plan = tuple(int(n) for n in text.split(","))
    except ValueError:
        plan = ()
    if len(plan) != 2 or min(plan) < 0:
        raise ConfigError(f"--train_time_chunks must be E,D: encoder frames and decoder latent frames per chunk (0: "
                          f"that part whole), e.g. 8,2; got {speed.train_time_chunks!r}")
    return plan


def downsample_factor_of(model: ModelConfig) -> int:
    """The latent grid's downsampling: --vae_spatial_factor where a source set it, else 2^(levels - 1) x the pixel
    patch."""
    return model.vae_spatial_factor or 2 ** (len(model.ch_mult) - 1) * model.vae_patch_size


def downsample_factor_named(model: ModelConfig) -> str:
    """The downsample factor with what sets it, for a refusal: a source's own spatial factor (a diffusers class,
    whose --vae_ch_mult is a placeholder), else --vae_ch_mult's levels (and --vae_patch_size's patch)."""
    factor = downsample_factor_of(model)
    if model.vae_spatial_factor:
        return (f"the spatial factor {factor} of {model.vae_class or 'the source'} (--vae_spatial_factor, set by "
                "--init_from)")
    patch = f" and --vae_patch_size {model.vae_patch_size}" if model.vae_patch_size > 1 else ""
    return f"the downsample factor {factor} of --vae_ch_mult {model.vae_ch_mult}{patch}"


def decoder_channels_of(model: ModelConfig) -> tuple[int, ...]:
    """--vae_decoder_ch as widths; () when it is empty or the encoder's own (the canonical form)."""
    if not model.vae_decoder_ch:
        return ()
    try:
        widths = tuple(int(c) for c in model.vae_decoder_ch.split(","))
    except ValueError:
        raise ConfigError(f"--vae_decoder_ch must be comma-separated integers, got {model.vae_decoder_ch!r}") from None
    return () if widths == tuple(model.vae_ch * m for m in model.ch_mult) else widths


def parse_sizes(text: str, flag: str) -> tuple[int, ...]:
    """Comma-separated pixel sizes ('': none), in the order given, each once; one line for anything else."""
    sizes: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) <= 0:
            raise ConfigError(f"--{flag} {text}: {part!r} is not a positive whole number of pixels")
        if int(part) not in sizes:
            sizes.append(int(part))
    return tuple(sizes)


def eval_sizes(ev: EvalConfig, training_size: int) -> tuple[int, ...]:
    """The crop sizes evaluation runs at: the training size first (its keys un-suffixed), then each other size of
    --eval_resolutions in the order given."""
    return (training_size,) + tuple(s for s in parse_sizes(ev.eval_resolutions, "eval_resolutions")
                                    if s != training_size)


def eval_size_problem(size: int, factor: int) -> str | None:
    """Why a crop size cannot be evaluated by a model of this downsample factor, or None."""
    if size % factor:
        return f"not a multiple of the downsample factor {factor}"
    if size < LPIPS_MIN_SIZE:
        return f"smaller than {LPIPS_MIN_SIZE} px, the smallest image LPIPS (and SSIM's 11x11 window) takes"
    return None


def uses_vgg16(cfg: Config) -> bool:
    """Whether a loss trains on VGG16 features: LPIPS with a weight, or the VGG16 critic."""
    return cfg.loss.perceptual_weight > 0 or (cfg.critic.do_ganloss and cfg.critic.discriminator == "vgg16")


# The smallest images the loss networks take: the VGG16 critic's and the PatchGAN's, and LPIPS' (VGG16's four
# max-pools before its last slice: 15 px fails with "Output size is too small").
CRITIC_MIN_SIZE, LPIPS_MIN_SIZE = 32, 16


def min_loss_image_size(cfg: Config) -> int:
    """The smallest image the losses of this config can take (1: pixel losses only)."""
    return max(CRITIC_MIN_SIZE if cfg.critic.do_ganloss else 1, LPIPS_MIN_SIZE if cfg.loss.perceptual_weight > 0 else 1)


def parse_schedule(spec: str) -> list[tuple[int, tuple[int, ...]]]:
    """--train_resolutions as its stages [(first step, sizes)], the one place the string is parsed (DataConfig.stages
    holds the result, data.ResolutionSchedule draws each step's size from them); [] for ''. ConfigError (one line) for a malformed one:
    stages separated by ';', each `[STEP:]SIZE[,SIZE...]`, the first from step 0, each later one after the one
    before."""
    stages: list[tuple[int, tuple[int, ...]]] = []
    flag = f"--train_resolutions {spec!r}"
    for i, part in enumerate(filter(None, (p.strip() for p in spec.split(";"))) if spec.strip() else []):
        start, colon, sizes = part.rpartition(":")
        try:
            begin = int(start) if colon else 0
            values = tuple(int(v) for v in sizes.split(","))
        except ValueError:
            raise ConfigError(f"{flag}: stage {part!r} is not [STEP:]SIZE[,SIZE...]") from None
        if min(values) <= 0:
            raise ConfigError(f"{flag}: stage {part!r}: sizes must be positive")
        if i == 0 and begin != 0:
            raise ConfigError(f"{flag}: the first stage starts at step 0, not {begin}")
        if i > 0 and (not colon or begin <= stages[-1][0]):
            raise ConfigError(f"{flag}: stage {part!r}: a later stage needs STEP: greater than the previous "
                              f"stage's ({stages[-1][0]})")
        stages.append((begin, tuple(dict.fromkeys(values))))
    return stages


def schedule_sizes(data: DataConfig) -> list[int]:
    """Every crop size the run trains at, ascending (--vae_resolution alone without --train_resolutions)."""
    stages = data.stages
    return sorted({s for _, sizes in stages for s in sizes}) if stages else [data.vae_resolution]


def check_train_resolutions(cfg: Config, factor: int) -> None:
    """One line for a --train_resolutions size the model or the losses cannot take, or a flag that assumes one
    training size."""
    data, loss, critic = cfg.data, cfg.loss, cfg.critic
    if not data.train_resolutions:
        return
    sizes = schedule_sizes(data)
    flag = f"--train_resolutions {data.train_resolutions!r}"
    for size in sizes:
        if size % factor or size % loss.mse_pool_factor:
            raise ConfigError(f"{flag}: size {size} is not a multiple of the downsample factor {factor} and of "
                              f"--mse_pool_factor {loss.mse_pool_factor}")
        if loss.perceptual_weight > 0 and size < LPIPS_MIN_SIZE:
            raise ConfigError(f"{flag}: size {size} is below LPIPS' smallest input, {LPIPS_MIN_SIZE} px")
        if critic.do_ganloss and size < CRITIC_MIN_SIZE:
            raise ConfigError(f"{flag}: size {size} is below the critic's smallest input, {CRITIC_MIN_SIZE} px")
    if cfg.latents.scale_equivariance_prob > 0 and sizes != [data.vae_resolution]:
        raise ConfigError(f"{flag}: --scale_equivariance_prob assumes one training latent size (its sizes are "
                          "fractions of --vae_resolution's latent); train it at one resolution")
    if cfg.latents.vf_weight > 0 and cfg.finetune.train_parts != "decoder" and sizes != [data.vae_resolution]:
        raise ConfigError(f"{flag}: --vf_weight aligns the latent with a foundation model that always sees the image "
                          "at --vf_image_size, its feature grid stretched to the latent's, a target that changes "
                          "with each training size; train the alignment at one resolution")


def last_stage_levels(cfg: Config) -> int | None:
    """--last_stage_trains as a count of the decoder's highest levels (None: all); ConfigError (one line) for a
    value that is neither, or one the run cannot use."""
    value = cfg.finetune.last_stage_trains
    if value == "all":
        return None
    levels = len(cfg.model.ch_mult)
    if not value.isdigit() or int(value) > levels:
        raise ConfigError(f"--last_stage_trains {value!r}: all, or a count of the decoder's highest levels from 0 "
                          f"to {levels} (--vae_ch_mult {cfg.model.vae_ch_mult})")
    if len(cfg.data.stages) < 2:
        raise ConfigError(f"--last_stage_trains {value} needs a --train_resolutions schedule of 2 stages or more "
                          "(it freezes the rest in the last one)")
    if cfg.latents.vf_weight > 0:
        raise ConfigError(f"--last_stage_trains {value} freezes the encoder that --vf_weight aligns: use one of them")
    return int(value)


def check_video(cfg: Config) -> None:
    """One line for --video_frames without a video VAE, of a length it cannot take, or with what does not take clips
    yet; for a chunk plan (--train_time_chunks) the clip does not split into."""
    encoder_chunk, decoder_chunk = time_chunks_of(cfg.speed)
    if (encoder_chunk or decoder_chunk) and not cfg.data.video_frames:
        raise ConfigError(f"--train_time_chunks {cfg.speed.train_time_chunks}: chunks are a clip's: it needs "
                          "--video_frames")
    if not cfg.data.video_frames:
        if cfg.critic.discriminator == "patchgan3d":
            raise ConfigError("--discriminator patchgan3d judges clips: a 3D critic with images only needs "
                              "--video_frames (patchgan or vgg16 judge images)")
        if cfg.loss.temporal_weight > 0 or cfg.data.video_image_prob > 0:
            raise ConfigError(f"{'--temporal_weight' if cfg.loss.temporal_weight > 0 else '--video_image_prob'} is "
                              "for clips: it needs --video_frames")
        return
    frames, t = cfg.data.video_frames, cfg.model.vae_temporal_factor
    flag = f"--video_frames {frames}"
    if not t:
        raise ConfigError(f"{flag}: clips train a video VAE, loaded with --init_from from its diffusers folder "
                          "(docs/families.md lists them)")
    if (frames - 1) % t:
        below = 1 + (frames - 1) // t * t
        raise ConfigError(f"{flag}: this VAE takes clips of 1 + {t}k frames: the nearest are "
                          f"{' and '.join(str(n) for n in (below, below + t) if n >= 1)}")
    latents = cfg.latents
    for value, name in ((latents.scale_equivariance_prob, "--scale_equivariance_prob"),
                        (latents.latent_noise_prob, "--latent_noise_prob"), (latents.vf_weight, "--vf_weight"),
                        (latents.probe_every_n_steps, "--probe_every_n_steps"),
                        (cfg.eval.eval_tile_size, "--eval_tile_size"),
                        (cfg.eval.eval_resolutions, "--eval_resolutions")):
        if value:
            raise ConfigError(f"{flag}: {name} takes images, not clips (yet): leave it off for video")
    if cfg.speed.compile:
        raise ConfigError(f"{flag}: --compile is not tested with the video VAEs' temporal caches (their chunks and "
                          "frame counts vary): leave it off for video")
    if encoder_chunk or decoder_chunk:
        check_time_chunks(cfg.speed, frames, t)
        if cfg.loss.loss_balance == "adaptive":
            raise ConfigError(f"--train_time_chunks {cfg.speed.train_time_chunks} does not compose with --loss_balance "
                              "adaptive (LDM's weight differentiates by the decoder's last layer, inside every "
                              "chunk's checkpoint: each of its two gradients recomputes every chunk and holds it to "
                              "the step's end, more memory than the whole clip): use --loss_balance gradnorm")


def check_time_chunks(speed: SpeedConfig, frames: int, t: int) -> None:
    """One line for a chunk plan a clip of `frames` frames (1 + t k) does not split into equal chunks: the encoder's
    chunk a multiple of t frames, each part's chunk dividing the k latent frames after the first. (The model would
    take a shorter last chunk; a plan of equal chunks is refused otherwise so that the memory a run was planned for,
    the largest chunk's, is what every chunk takes, and a typo such as 8,3 for 33 frames is caught before a worker
    starts.)"""
    (encoder_chunk, decoder_chunk), latent_frames = time_chunks_of(speed), (frames - 1) // t
    flag = f"--train_time_chunks {speed.train_time_chunks}"
    if speed.sharding != "ddp":
        raise ConfigError(f"{flag} is not tested with --sharding {speed.sharding} (each sharded unit would be gathered "
                          "once per chunk and again in each chunk's recomputation): use --sharding ddp")
    if encoder_chunk % t:
        raise ConfigError(f"{flag}: the encoder's chunk of {encoder_chunk} frames must be a multiple of the VAE's "
                          f"temporal factor {t} (it compresses {t} frames into one latent frame)")
    for chunk, part, unit in ((encoder_chunk // t, "encoder", t), (decoder_chunk, "decoder", 1)):
        if chunk and latent_frames % chunk:
            divisors = [n * unit for n in range(1, latent_frames + 1) if latent_frames % n == 0]
            what = f"{chunk * unit} frames" if part == "encoder" else f"{chunk} latent frames"
            raise ConfigError(f"{flag}: the {part}'s chunks of {what} do not divide the {latent_frames} latent frames "
                              f"after the first of --video_frames {frames} ({latent_frames * t} frames): take one of "
                              f"{', '.join(map(str, divisors))}")


def check_sharding(cfg: Config) -> None:
    """--sharding fsdp|hsdp with a flag that does not compose with it: one line (sharding.py says why each)."""
    sharding = cfg.speed.sharding
    if sharding == "ddp":
        return
    flag = f"--sharding {sharding}"
    for on, name, why in (
            (cfg.speed.compile, "--compile", "torch.compile of the sharded units is not tested here"),
            (cfg.speed.channels_last == "true", "--channels_last true", "FSDP shards contiguous parameters only"),
            (cfg.loss.loss_balance == "adaptive", "--loss_balance adaptive",
             "LDM's adaptive weight differentiates by the decoder's last weight, which FSDP holds as shards"),
            (cfg.latents.vf_weight > 0, "--vf_weight", "its projection trains in the VAE's DDP wrapper"),
            (cfg.finetune.last_stage_trains != "all", "--last_stage_trains",
             "its freeze rewraps the VAE mid-run")):
        if on:
            raise ConfigError(f"{flag} does not compose with {name} ({why}): use --sharding ddp or leave it off")


def validate_across_sections(cfg: Config) -> None:
    """The checks that read two sections or more."""
    data, model, loss, critic, latents = cfg.data, cfg.model, cfg.loss, cfg.critic, cfg.latents
    check_video(cfg)
    check_sharding(cfg)
    factor = downsample_factor_of(model)
    check_train_resolutions(cfg, factor)
    last_stage_levels(cfg)
    if data.vae_resolution % factor:
        raise ConfigError(f"--vae_resolution {data.vae_resolution} is not divisible by "
                          f"{downsample_factor_named(model)}: take a multiple of {factor}")
    if data.vae_resolution % loss.mse_pool_factor:
        raise ConfigError(f"--vae_resolution {data.vae_resolution} is not divisible by --mse_pool_factor "
                          f"{loss.mse_pool_factor}")
    if latents.vf_weight > 0 and loss.loss_balance != "gradnorm":
        raise ConfigError("--vf_weight is a GradNorm branch: use it with --loss_balance gradnorm")
    if critic.do_ganloss and critic.discriminator == "vgg16" and data.vae_resolution < CRITIC_MIN_SIZE:
        raise ConfigError(f"--vae_resolution must be at least {CRITIC_MIN_SIZE} for the VGG16 discriminator")
    if loss.perceptual_weight > 0 and data.vae_resolution < LPIPS_MIN_SIZE:
        raise ConfigError(f"--vae_resolution must be at least {LPIPS_MIN_SIZE} for LPIPS (--perceptual_weight 0 "
                          "turns it off)")
    for size in eval_sizes(cfg.eval, data.vae_resolution)[1:]:
        problem = eval_size_problem(size, factor)
        if problem:
            raise ConfigError(f"--eval_resolutions {cfg.eval.eval_resolutions}: {size} px is {problem}")
    ev = cfg.eval
    if ev.eval_tile_size and (ev.eval_tile_size % factor or ev.eval_tile_overlap % factor):
        raise ConfigError(f"--eval_tile_size {ev.eval_tile_size} and --eval_tile_overlap {ev.eval_tile_overlap} must "
                          f"be multiples of the downsample factor {factor}")
    check_best_metric(cfg)
    if cfg.run.load_path and cfg.finetune.init_from:
        raise ConfigError("give --init_from (a released VAE) or --load_path (our weights), not both")
    if cfg.finetune.distill_from:
        check_distillation(cfg)
    if loss.distill_weight > 0 and not (cfg.finetune.init_from and cfg.finetune.train_parts == "decoder"):
        raise ConfigError("--distill_weight needs --init_from (the teacher is its decoder) and --train_parts decoder "
                          "(the teacher decodes the same latent as the decoder that trains)")


def check_distillation(cfg: Config) -> None:
    """--distill_from: a student that decodes the teacher's latents as they are (the family's check refuses a model
    that cannot be one: families.Family.check)."""
    if cfg.loss.distill_weight > 0:
        raise ConfigError("--distill_weight pulls a narrower LDM decoder toward its --init_from source's decoder; a "
                          "student of --distill_from decodes the teacher's latents: leave --distill_weight at 0")
    latents = cfg.latents
    for flag, value in (("scale_equivariance_prob", latents.scale_equivariance_prob),
                        ("latent_noise_prob", latents.latent_noise_prob), ("vf_weight", latents.vf_weight)):
        if value > 0:
            raise ConfigError(f"--{flag} {value}: a student of --distill_from learns the teacher's latents as they "
                              "are, which a latent regulariser would change: leave it at 0")


def best_metric_of(cfg: Config) -> str | None:
    """--best_metric made concrete: psnr, ema_psnr, ... or None (off, or no evaluation during training). auto keeps
    the best by PSNR, which needs no pretrained network, of the weights a fine-tune exports (the EMA's when on)."""
    metric = cfg.eval.best_metric
    if metric == "auto":
        evaluates = bool(cfg.data.test_dataset_url and cfg.eval.evaluate_every_n_steps)
        return ("ema_psnr" if cfg.optim.ema_decay > 0 else "psnr") if evaluates else None
    return None if metric == "none" else metric


def check_best_metric(cfg: Config) -> None:
    """One line for a --best_metric this run's evaluation cannot compute (weights this machine lacks are refused as
    the Trainer builds evaluation: checkpoint.BestCheckpoint)."""
    metric = cfg.eval.best_metric
    if metric in ("auto", "none"):
        return
    flag, base = f"--best_metric {metric}", metric.removeprefix("ema_")
    if not (cfg.data.test_dataset_url and cfg.eval.evaluate_every_n_steps):
        raise ConfigError(f"{flag} needs evaluation during training: give --test_dataset_url (and "
                          "--evaluate_every_n_steps > 0), or --best_metric none")
    if metric.startswith("ema_") and cfg.optim.ema_decay == 0:
        raise ConfigError(f"{flag} is the EMA's metric and --ema_decay is 0: use --best_metric {base} or an EMA")
    if base == "rfid" and cfg.eval.inception_weights == "none":
        raise ConfigError(f"{flag}: --inception_weights none turns rFID off")
    if base == "lpips" and cfg.critic.vgg16_weights == "random" and not uses_vgg16(cfg):
        raise ConfigError(f"{flag}: evaluation computes no LPIPS with --vgg16_weights random when no loss uses "
                          "VGG16 (random features measure nothing)")


def is_plain_local_path(url: str) -> bool:
    """A url that names one local directory or file: no brace pattern, list, pipe or scheme."""
    return not any(c in url for c in "{}:*?") and not url.endswith(".tar")


# ==============================================================================================================
# Automatic values (a flag's 0 / -1)
# ==============================================================================================================
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
    """The automatic defaults (0 or -1, see each flag's help) made concrete, but for the CPU split (--num_workers,
    --num_threads: run_setup.resolve_cpu, from the machine's cores); idempotent. config.json records the resolved
    values, so a run shows what it trained with."""
    model, critic, optim = cfg.model, cfg.critic, cfg.optim
    lr_vae = optim.learning_rate_vae
    if lr_vae == 0 and model.vae_ch > 0:  # (a bad --vae_ch is refused by validate)
        # a fine-tune (--init_from) starts from a trained optimum: a tenth (2.5e-5 at FLUX width)
        lr_vae = LR_TIMES_WIDTH / model.vae_ch / (10 if cfg.finetune.init_from else 1)
    changes = dict(
        learning_rate_vae=lr_vae,
        learning_rate_disc=critic.learning_rate_disc or (1e-5 if critic.discriminator == "vgg16" and
                                                          critic.critic_trunk == "trainable" else lr_vae),
        warmup_steps=min(1000, optim.max_steps // 10) if optim.warmup_steps == -1 else optim.warmup_steps,
        disc_start=optim.max_steps // 5 if cfg.loss.disc_start == -1 else cfg.loss.disc_start,
        vae_norm_groups=model.vae_norm_groups or (auto_norm_groups(model.vae_ch) if model.vae_ch > 0 else 0),
        shuffle_buffer=cfg.data.shuffle_buffer or (SHUFFLE_BUFFER_CLIPS if cfg.data.video_frames else
                                                   SHUFFLE_BUFFER_IMAGES))
    return with_values(cfg, **changes)
