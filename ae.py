"""The autoencoder: FLUX-style Encoder and Decoder and the latent posterior.

Parameter names follow the LDM/FLUX layout (`encoder.down.0.block.0.norm1.weight`,
`decoder.up.3.upsample.conv.weight`, `encoder.mid.attn_1.q.weight`, ...) so weights convert
to diffusers' AutoencoderKL and to FLUX without renaming tricks. Pure model code: no training logic.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from common import ConfigError
from config import GRAD_CHECKPOINTING, decoder_channels_of
from latents import per_channel

LOGVAR_RANGE = (-30.0, 20.0)  # LDM's clamp of the learned log-variance


@dataclass
class AutoEncoderParams:
    """Architecture of the autoencoder. Defaults are the FLUX VAE (f8, 16 latent channels)."""
    in_channels: int = 3
    out_ch: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    use_attn: bool = True
    # "constant": the encoder predicts the mean only and z = mean + sqrt(posterior_var) * noise.
    # "learned": the encoder predicts mean and log-variance (standard LDM / SD VAE).
    posterior: str = "constant"
    posterior_var: float = 0.1  # the fixed variance sigma^2 of the constant posterior (std = sqrt of it)
    clamp_th: float = 0.0  # clamp the posterior mean to [-clamp_th, clamp_th]; 0 disables
    norm_groups: int = field(default=32, repr=False)
    # LDM's 1x1 `quant_conv` on the moments after the encoder and `post_quant_conv` on z before the decoder:
    # the SD 1.x/2.x/SDXL and FLUX.2 VAEs have them, FLUX.1 and SD3 do not. Needs the learned posterior (its 2*z
    # moments).
    quant_conv: bool = False
    # The decoder's width per level, highest resolution first like ch * ch_mult; () means the encoder's widths. A
    # narrower decoder decodes the same latent space for less compute (BFL's FLUX.2-small-decoder: 96,192,384,384
    # behind the 128,256,512,512 encoder). Same number of levels as the encoder: the latent grid is the same.
    decoder_channels: tuple[int, ...] = ()
    # FLUX.2: the running statistics of a BatchNorm2d (`bn`, no affine) over the 2x2-patchified latent, with which the
    # FLUX.2 pipeline normalises the latents a diffusion model sees, in place of scaling/shift factors. They are
    # buffers that no forward pass reads or updates: they change only by being loaded or re-estimated
    # (evaluate.latent_bn_stats), so training, the EMA and the optimizer leave them as they are.
    latent_bn: bool = False
    latent_bn_eps: float = 1e-4
    latent_bn_momentum: float = 0.1  # unused here; kept because FLUX.2's configs carry it
    family: ClassVar[str] = "ldm"  # (families.py; not in to_dict: checkpoints without a family are this one's)

    @property
    def encoder_channels(self) -> tuple[int, ...]:
        return tuple(self.ch * m for m in self.ch_mult)

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        """The decoder's width per level (highest resolution first), whether its own or the encoder's."""
        return tuple(self.decoder_channels) or self.encoder_channels

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def describe(self) -> str:
        return "ae.py's LDM/FLUX autoencoder"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ch_mult"] = list(self.ch_mult)
        d["decoder_channels"] = list(self.decoder_channels)
        return d

    @classmethod
    def from_config(cls, model) -> "AutoEncoderParams":
        """The architecture of a run's model section (config.ModelConfig): the LDM family's flags."""
        return cls(ch=model.vae_ch, ch_mult=model.ch_mult, num_res_blocks=model.vae_num_res_blocks,
                   z_channels=model.vae_z_channels, norm_groups=model.vae_norm_groups, use_attn=model.do_attn,
                   posterior=model.posterior, posterior_var=model.posterior_var,
                   clamp_th=model.clamp_th if model.do_clamp else 0.0, quant_conv=model.vae_quant_conv,
                   decoder_channels=decoder_channels_of(model), latent_bn=model.vae_latent_bn,
                   latent_bn_eps=model.vae_latent_bn_eps)

    @classmethod
    def from_dict(cls, d: dict) -> "AutoEncoderParams":
        """Also the params of checkpoints written before a field existed: it takes its default."""
        d = dict(d)
        d["ch_mult"] = tuple(d["ch_mult"])
        d["decoder_channels"] = tuple(d.get("decoder_channels", ()))
        return cls(**d)


# The devices whose group_norm kernel takes a bf16/fp16 input with fp32 gamma and beta (mixed dtypes): the CPU's.
# CUDA's reads gamma, beta and the statistics it saves for backward in the input's dtype and refuses fp32 ones
# (aten/src/ATen/native/cuda/group_norm_kernel.cu: gamma.const_data_ptr<T>() with T the input's type; read in the
# source, not run on a GPU here); other devices get the cast too, as the safe default.
GROUP_NORM_MIXED_DTYPES = ("cpu",)


class GroupNorm32(nn.GroupNorm):
    """GroupNorm whose mean and variance are fp32 whatever the autocast: the statistics of small activations do not
    survive bf16/fp16 (seed note 000). The output keeps the input's dtype.

    An fp32 input is normalised in fp32. A bf16/fp16 input (under autocast) goes to PyTorch's own kernel as it is,
    never as an fp32 copy (two extra reads and writes of every activation in forward and two in backward, which this
    class made before issue 30: tests/test_copies.py, docs/precision.md). The kernel accumulates the mean and variance
    in fp32 and normalises in fp32, rounding only its output. What it does with gamma and beta depends on the device:

    - CPU: gamma and beta stay fp32 (the kernel takes mixed dtypes). It then also saves the mean and rstd in fp32 and
      reduces dgamma and dbeta in fp32: the backward is as close to fp64 as an fp32 GroupNorm's, dx up to its
      rounding to the input's dtype (tests/test_ae.py). With gamma cast to bf16 the kernel saved bf16 statistics
      and wrote a bf16 dgamma: for activations whose mean is 20x their spread dgamma was 2.6% of its largest value
      off, dx twice as far as now.
    - CUDA (and any device not in GROUP_NORM_MIXED_DTYPES): the kernel refuses fp32 gamma and beta with a bf16/fp16
      input, so they are cast to the input's dtype (a per-step copy of C values). Its forward is as accurate, but
      native_group_norm then saves the mean and rstd in the input's dtype, and the backward, though it accumulates in
      fp32, works from that rounded mean: dgamma and dx carry the CPU's old errors above (docs/precision.md). Only an
      fp32 copy of the activation would avoid them; `--precision fp32` is the exact path.

    Autocast is held off inside: CUDA's autocast lists group_norm among its fp32 ops and would cast the input to fp32
    and bring the copies back (the CPU's lists leave it alone; tests/test_ae.py sees it with CUDA's policy)."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            weight, bias = self.weight, self.bias
            if x.dtype != weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
                if not (weight.dtype == torch.float32 and x.device.type in GROUP_NORM_MIXED_DTYPES):
                    weight, bias = weight.to(x.dtype), bias.to(x.dtype)
            elif x.dtype != weight.dtype:
                x = x.to(weight.dtype)
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)


def Normalize(channels: int, groups: int = 32) -> nn.GroupNorm:
    return GroupNorm32(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class AttnBlock(nn.Module):
    """Single-head spatial self-attention (as FLUX and diffusers' AutoencoderKL mid block)."""

    def __init__(self, in_channels: int, groups: int = 32):
        super().__init__()
        self.norm = Normalize(in_channels, groups)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1)

    def _linear(self, conv: nn.Conv2d, tokens: Tensor) -> Tensor:
        return F.linear(tokens, conv.weight.flatten(1), conv.bias)

    def forward(self, x: Tensor) -> Tensor:
        # the 1x1 convs run as linear layers over (batch, pixels, channels) tokens, as diffusers' Attention does:
        # the same sums in the same order, so a released VAE decodes here bitwise as in diffusers (as 1x1 convs:
        # ~1e-5 apart after the decoder, tests/test_finetune.py)
        b, c, height, width = x.shape
        tokens = self.norm(x.reshape(b, c, height * width)).transpose(1, 2)  # normed as (b, c, pixels), as there
        q, k, v = (self._linear(conv, tokens).unsqueeze(1) for conv in (self.q, self.k, self.v))
        h = self._linear(self.proj_out, F.scaled_dot_product_attention(q, k, v).squeeze(1))
        # the attention output first: the sum then takes its (channels-last) layout, as in diffusers, and the next
        # convolution picks the same kernel
        return h.transpose(1, 2).reshape(b, c, height, width) + x


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int = 32):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.norm1 = Normalize(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.norm2 = Normalize(out_channels, groups)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.in_channels != self.out_channels:
            x = self.nin_shortcut(x)
        return x + h


class Downsample(nn.Module):
    def __init__(self, in_channels: int):
        super().__init__()
        # no asymmetric padding in torch conv: pad right/bottom by one, then a valid stride-2 conv
        self.conv = nn.Conv2d(in_channels, in_channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Upsample(nn.Module):
    def __init__(self, in_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, in_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _run_level(modules: list[nn.Module], h: Tensor, use_checkpoint: bool, *args) -> Tensor:
    """Runs one resolution level. Checkpointed, each block (and the resampling conv) is its own segment:
    backward then re-materialises one block at a time rather than the whole level, and non-reentrant
    checkpointing stops recomputing once a block's saved tensors are back, so it also costs fewer FLOPs
    than one segment per level (BENCHMARKS.md). Checkpointing only pays when a backward will follow;
    use_reentrant=False is exact and DDP-safe. `args` go to every module after h (the video model's chunk)."""
    use_checkpoint = use_checkpoint and torch.is_grad_enabled()
    for module in modules:
        if use_checkpoint and h.requires_grad:
            h = checkpoint(module, h, *args, use_reentrant=False)
        else:
            h = module(h, *args)
    return h


class Encoder(nn.Module):
    def __init__(self, in_channels: int, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int,
                 out_channels: int, use_attn: bool = True, groups: int = 32):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.num_res_blocks = num_res_blocks
        self.checkpoint_levels: set[int] = set()
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, stride=1, padding=1)
        in_ch_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        block_in = ch
        for i_level in range(self.num_resolutions):
            block = nn.ModuleList()
            block_in = ch * in_ch_mult[i_level]
            block_out = ch * ch_mult[i_level]
            for _ in range(num_res_blocks):
                block.append(ResnetBlock(block_in, block_out, groups))
                block_in = block_out
            down = nn.Module()
            down.block = block
            if i_level != self.num_resolutions - 1:
                down.downsample = Downsample(block_in)
            self.down.append(down)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, groups)
        self.mid.attn_1 = AttnBlock(block_in, groups) if use_attn else nn.Identity()
        self.mid.block_2 = ResnetBlock(block_in, block_in, groups)
        self.norm_out = Normalize(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, kernel_size=3, stride=1, padding=1)

    def _level(self, i_level: int) -> list[nn.Module]:
        level = self.down[i_level]
        return list(level.block) + ([level.downsample] if i_level != self.num_resolutions - 1 else [])

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for i_level in range(self.num_resolutions):
            h = _run_level(self._level(i_level), h, i_level in self.checkpoint_levels)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        # the moments head runs in fp32 whatever the autocast: the posterior mean (and log-variance) is what
        # the KL, the latent statistics and a diffusion model see; a bf16 conv output carries ~1e-2 errors
        with torch.autocast(h.device.type, enabled=False):
            return self.conv_out(F.silu(self.norm_out(h.float())))


class Decoder(nn.Module):
    def __init__(self, channels: tuple[int, ...], out_ch: int, num_res_blocks: int, z_channels: int,
                 use_attn: bool = True, groups: int = 32):
        """`channels`: the width of each level, highest resolution first (the encoder's ch * ch_mult, or narrower)."""
        super().__init__()
        self.num_resolutions = len(channels)
        self.num_res_blocks = num_res_blocks
        self.checkpoint_levels: set[int] = set()
        block_in = channels[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, kernel_size=3, stride=1, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, groups)
        self.mid.attn_1 = AttnBlock(block_in, groups) if use_attn else nn.Identity()
        self.mid.block_2 = ResnetBlock(block_in, block_in, groups)
        self.up = nn.ModuleList()
        for i_level in reversed(range(self.num_resolutions)):
            block = nn.ModuleList()
            block_out = channels[i_level]
            for _ in range(num_res_blocks + 1):
                block.append(ResnetBlock(block_in, block_out, groups))
                block_in = block_out
            up = nn.Module()
            up.block = block
            if i_level != 0:
                up.upsample = Upsample(block_in)
            self.up.insert(0, up)  # up[0] is the highest resolution, as in the released weights
        self.norm_out = Normalize(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, out_ch, kernel_size=3, stride=1, padding=1)

    def _level(self, i_level: int) -> list[nn.Module]:
        level = self.up[i_level]
        return list(level.block) + ([level.upsample] if i_level != 0 else [])

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i_level in reversed(range(self.num_resolutions)):
            h = _run_level(self._level(i_level), h, i_level in self.checkpoint_levels)
        return self.conv_out(F.silu(self.norm_out(h)))


def kl_divergence(mean: Tensor, logvar: Tensor | None) -> Tensor:
    """KL(q(z|x) || N(0, I)), averaged over latent elements, in fp32.

    With a constant variance (logvar None) the KL is 0.5 * mean^2 + a constant that carries no
    gradient; the constant is dropped, so this returns the latent penalty mean(0.5 * mean^2).
    """
    with torch.autocast(mean.device.type, enabled=False):
        mean = mean.float()
        if logvar is None:
            return 0.5 * mean.square().mean()
        logvar = logvar.float()
        return 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()


def patchify_latents(z: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2): each 2x2 patch of a channel becomes 4 channels, channel-major
    (c, row in patch, column in patch): the layout of FLUX.2's pipeline (diffusers' Flux2Pipeline._patchify_latents,
    BFL's rearrange "c (i pi) (j pj) -> (c pi pj) i j"), whose channels the `bn` statistics are of."""
    b, c, height, width = z.shape
    # reshape where diffusers has view: the same values, and a channels-last latent (the trainer's) works too
    z = z.reshape(b, c, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * 4, height // 2, width // 2)


def unpatchify_latents(z: Tensor) -> Tensor:
    """The inverse of patchify_latents."""
    b, c4, height, width = z.shape
    z = z.reshape(b, c4 // 4, 2, 2, height, width).permute(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c4 // 4, height * 2, width * 2)


def check_widths(params: AutoEncoderParams) -> None:
    """ValueError (one line) for widths the model cannot have: GroupNorm splits every width into norm_groups."""
    widths = params.decoder_widths
    if params.decoder_channels and len(params.decoder_channels) != len(params.ch_mult):
        raise ValueError(f"decoder_channels {list(params.decoder_channels)} has {len(params.decoder_channels)} levels, "
                         f"the encoder {len(params.ch_mult)}: the decoder must upsample the latent as much as the "
                         "encoder downsamples it")
    if min(widths) <= 0:
        raise ValueError(f"decoder_channels must be positive, got {list(widths)}")
    for part, part_widths in (("encoder", params.encoder_channels), ("decoder", widths)):
        bad = [w for w in part_widths if w % params.norm_groups]
        if bad:
            raise ValueError(f"the {part}'s widths {list(part_widths)} must be multiples of the {params.norm_groups} "
                             f"GroupNorm groups (norm_groups): {bad} are not")


def posterior_noise(mean: Tensor) -> Tensor:
    """The posterior's Gaussian noise for `mean`, drawn in NCHW order whatever its memory format (as diffusers'
    randn_tensor(shape)): randn_like follows the mean's strides, so the same seed would give another noise per
    element in another layout (channels_last under ddp on a CPU and NCHW under --sharding fsdp, a clip's mean that
    oneDNN lays out per chunk plan), and a run continued in another layout would train on other numbers."""
    return torch.randn(mean.shape, dtype=mean.dtype, device=mean.device)


class Trainable:
    """What the trainer, the memory check, evaluation and export ask of a trainable autoencoder, which answers for
    itself (as a diffusers class is its own spec): every model class (AutoEncoder here, wan_ae.WanAutoEncoder,
    tae.TinyAutoEncoder, diffusers_ae.DiffusersAutoEncoder) derives from it, beside nn.Module, and overrides what is
    its own; the defaults are the common answers. families.py keeps what is about sources (recognising, reading and
    writing a layout, building the model). tests/test_families.py checks that every family's model class is one."""
    params: object  # its architecture (to_dict, family, describe)
    grad_checkpointing: str  # its --grad_checkpointing mode (set_grad_checkpointing)
    # why --train_time_chunks is refused ("": the model takes a chunk plan): a clip trained chunk by chunk needs the
    # temporal cache as an argument, which only wan_ae.py's video model has
    time_chunks_refusal = "it takes images"

    def describe(self) -> str:
        return self.params.describe()

    # ------------------------------------------------------------------------- what training touches
    def encoder_side(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of what computes the posterior from pixels: what --train_parts decoder freezes."""
        return [("encoder", self.encoder), ("quant_conv", self.quant_conv)]

    def last_layer(self) -> Tensor:
        """The decoder's last weight (LDM's adaptive GAN weight is computed on it)."""
        return self.decoder.conv_out.weight

    def last_stage_modules(self, levels: int) -> list[nn.Module]:
        """What --last_stage_trains trains: the decoder's `levels` highest-resolution levels and its output."""
        raise ConfigError(f"--last_stage_trains: the decoder's levels are the LDM family's, not {self.params.family}'s")

    @property
    def temporal_factor(self) -> int:
        """t of the clips of 1 + t k frames the model takes; 0: it takes images only (the spatial factor is
        downsample_factor)."""
        return 0

    def takes_images(self) -> bool:
        return True

    def unused_parameters(self) -> bool:
        """Whether a step may leave parameters without a gradient (DDP's find_unused_parameters): a video model's
        temporal layers on a step of single frames."""
        return self.temporal_factor > 0

    # ------------------------------------------------------------------------- memory plan and sharding
    def can_checkpoint(self) -> bool:
        """Whether --grad_checkpointing has something to checkpoint (the memory check's remedies offer it)."""
        return True

    def time_chunk_factor(self) -> int:
        """The temporal factor t of a model that takes a chunk plan (t frames per latent frame); 0: it takes none."""
        return 0 if self.time_chunks_refusal else self.temporal_factor

    def memory_plan(self) -> tuple[str, tuple[int, int]]:
        """(--grad_checkpointing, --train_time_chunks) as set on the model now."""
        return self.grad_checkpointing, (0, 0)

    def set_memory_plan(self, grad_checkpointing: str, time_chunks: tuple[int, int]) -> None:
        """--grad_checkpointing and --train_time_chunks on the model (the trainer at start-up, the memory check's
        probes per remedy)."""
        self.set_grad_checkpointing(grad_checkpointing)
        if any(time_chunks):
            raise ConfigError(f"--train_time_chunks: {self.time_chunks_refusal}")

    @property
    def norm_groups(self) -> int | None:
        """Its GroupNorm groups where the architecture chooses them (a checkpoint of others does not load); None."""
        return None

    def unshardable(self) -> str:
        """Why --sharding fsdp|hsdp cannot train this model ("": it can)."""
        return ""

    def shard_units(self) -> list[nn.Module]:
        """The modules --sharding fsdp|hsdp gathers one at a time (sharding.shard_units: the blocks the encoder and
        decoder call, each at most 1/8 of the model where it allows, found the same way in every model here)."""
        import sharding
        return sharding.shard_units(self)

    # ------------------------------------------------------------------------- latent normalisation and export
    def diffusion_latents(self, factors: dict):
        """z -> the latent as the source's pipelines hand it to their diffusion model (what a tiny autoencoder
        distilled from this VAE encodes to and decodes from: tae.py): per channel where `factors` (Source.factors)
        carry latents_mean/latents_std, else (z - shift_factor) * scaling_factor."""
        mean, std = factors.get("latents_mean"), factors.get("latents_std")
        if mean is not None and std is not None:
            scaling = float(factors.get("scaling_factor") or 1.0)
            return lambda z: per_channel(z, mean, std, scaling)
        scale, shift = float(factors.get("scaling_factor") or 1.0), float(factors.get("shift_factor") or 0.0)
        return lambda z: (z - shift) * scale

    def latent_norm(self) -> str:
        """How an export normalises the latents: "fields" (the model's own config fields, source_fields), the LDM
        family's "factors" (scaling/shift, or per channel) and "bn" (FLUX.2's statistics), or "released" (none)."""
        return "fields"

    def norm_label(self) -> str:
        """The export summary's latent_norm."""
        return "per_channel"

    def cannot_reestimate(self) -> str | None:
        """Why --dataset_url cannot re-estimate the normalisation (one line), or None."""
        return None

    def set_normalisation(self, fields: dict) -> None:
        """Make `fields` (source_fields' or fields_from_stats' form) the model's own where it holds them."""

    def source_fields(self, source: dict) -> dict:
        """The latent normalisation the source's config carries (`source`: Source.describe()), kept by an export
        of a run whose encoder did not train."""
        return {k: source.get(k) for k in ("latents_mean", "latents_std")}

    def fields_from_stats(self, stats: dict) -> dict:
        """The config fields re-estimated latent statistics give (evaluate.latent_stats' result)."""
        return {"latents_mean": stats["channel_mean"], "latents_std": stats["channel_std"]}

    def serves(self) -> str:
        """Whose pipelines the export serves (the export summary)."""
        return "the source's pipelines (the source's latent normalisation, re-estimated or kept)"


class AutoEncoder(Trainable, nn.Module):
    def __init__(self, params: AutoEncoderParams):
        super().__init__()
        if params.posterior not in ("constant", "learned"):  # (config.POSTERIORS' none: diffusers classes')
            raise ValueError(f"posterior must be constant or learned, got {params.posterior!r}")
        if params.quant_conv and params.posterior != "learned":
            raise ValueError("quant_conv needs the learned posterior (as in the SD VAEs)")
        check_widths(params)
        self.params = params
        self.grad_checkpointing = "none"
        moments = params.z_channels * (2 if params.posterior == "learned" else 1)
        self.encoder = Encoder(params.in_channels, params.ch, params.ch_mult, params.num_res_blocks,
                               moments, params.use_attn, params.norm_groups)
        self.decoder = Decoder(params.decoder_widths, params.out_ch, params.num_res_blocks,
                               params.z_channels, params.use_attn, params.norm_groups)
        if params.quant_conv:
            self.quant_conv = nn.Conv2d(moments, moments, kernel_size=1)
            self.post_quant_conv = nn.Conv2d(params.z_channels, params.z_channels, kernel_size=1)
        if params.latent_bn:
            # BatchNorm2d for its state-dict names and defaults (running_mean 0, running_var 1,
            # num_batches_tracked), those of FLUX.2's `bn` in both of its layouts; never called
            self.bn = nn.BatchNorm2d(4 * params.z_channels, eps=params.latent_bn_eps,
                                     momentum=params.latent_bn_momentum, affine=False, track_running_stats=True)

    @property
    def downsample_factor(self) -> int:
        return self.params.downsample_factor

    # ------------------------------------------------------------------------- its answers (Trainable)
    def encoder_side(self):
        return [("encoder", self.encoder)] + ([("quant_conv", self.quant_conv)] if self.params.quant_conv else [])

    def last_stage_modules(self, levels):
        return [self.decoder.up[i] for i in range(levels)] + [self.decoder.norm_out, self.decoder.conv_out]

    @property
    def norm_groups(self):
        return self.params.norm_groups

    def diffusion_latents(self, factors):
        """FLUX.2: standardised by its bn statistics over 2x2 patches, unpatchified back to the latent's grid (the
        layout of TAEF2's latents); the others by their factors."""
        if self.params.latent_bn:
            return lambda z: unpatchify_latents(self.normalize_latents(z))
        return super().diffusion_latents(factors)

    def latent_norm(self):
        return "bn" if self.params.latent_bn else "factors"

    def set_grad_checkpointing(self, mode: str) -> None:
        """none | decoder_hr (the two highest-resolution decoder levels) | hr (those and the encoder's two
        highest-resolution levels: in full VAE training the encoder's activations are alive during the
        decoder's backward) | decoder (every decoder level) | all (every level of both)."""
        if mode not in GRAD_CHECKPOINTING:
            raise ValueError(f"grad checkpointing must be one of {GRAD_CHECKPOINTING}, got {mode!r}")
        self.grad_checkpointing = mode  # (the memory check sets its probes' mode and this one back)
        every, high = set(range(self.decoder.num_resolutions)), {0, 1} & set(range(self.decoder.num_resolutions))
        self.decoder.checkpoint_levels = {"none": set(), "decoder_hr": high, "hr": high,
                                          "decoder": every, "all": every}[mode]
        self.encoder.checkpoint_levels = {"hr": high, "all": every}.get(mode, set())

    def encode_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Posterior mean and log-variance (None for the constant-variance posterior)."""
        h = self.encoder(x)
        if self.params.quant_conv:
            with torch.autocast(h.device.type, enabled=False):  # part of the fp32 moments head
                h = self.quant_conv(h.float())
        logvar = None
        if self.params.posterior == "learned":
            h, logvar = h.chunk(2, dim=1)
            logvar = logvar.float().clamp(*LOGVAR_RANGE)
        if self.params.clamp_th > 0:
            h = h.clamp(-self.params.clamp_th, self.params.clamp_th)
        return h, logvar

    def posterior_std(self, logvar: Tensor | None) -> Tensor | float:
        if logvar is None:
            return math.sqrt(self.params.posterior_var)
        return torch.exp(0.5 * logvar)

    def sample(self, mean: Tensor, logvar: Tensor | None) -> Tensor:
        # the noise is drawn and added in fp32; the decoder casts under autocast as it needs
        mean = mean.float()
        return mean + self.posterior_std(logvar) * posterior_noise(mean)

    def encode(self, x: Tensor) -> Tensor:
        """Deterministic latent (the posterior mean), for evaluation and export."""
        return self.encode_moments(x)[0]

    def normalize_latents(self, z: Tensor) -> Tensor:
        """What a diffusion model of a latent_bn VAE sees (FLUX.2): the patchified latent standardised by the bn
        statistics, (patchify(z) - running_mean) / sqrt(running_var + eps), as the FLUX.2 pipeline computes it."""
        if not self.params.latent_bn:
            raise ValueError("normalize_latents: this model has no latent bn statistics (latent_bn False)")
        mean = self.bn.running_mean.view(1, -1, 1, 1).to(z.dtype)
        std = torch.sqrt(self.bn.running_var.view(1, -1, 1, 1) + self.params.latent_bn_eps).to(z.dtype)
        return (patchify_latents(z) - mean) / std

    @torch.no_grad()
    def set_latent_bn(self, mean: Tensor, var: Tensor) -> None:
        """Replace the bn statistics (per patchified channel: 4 * z_channels values each)."""
        if not self.params.latent_bn:
            raise ValueError("set_latent_bn: this model has no latent bn statistics (latent_bn False)")
        self.bn.running_mean.copy_(mean)
        self.bn.running_var.copy_(var)

    def decode(self, z: Tensor) -> Tensor:
        if self.params.quant_conv:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def forward(self, x: Tensor, sample: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        """(reconstruction, posterior mean, log-variance (None: constant)), decoding a sample of the posterior (or,
        `sample` False, its mean). What training adds between encoder and decoder is train_state.TrainingForward's."""
        mean, logvar = self.encode_moments(x)
        return self.decode(self.sample(mean, logvar) if sample else mean), mean, logvar
