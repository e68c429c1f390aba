"""The Wan family's VAE (Qwen-Image's, Wan 2.1's video VAE, and Wan 2.2's), as a 2D image autoencoder with
ae.AutoEncoder's interface. Its diffusers conversion, both ways, is in pretrained.py beside the other families'.

diffusers' AutoencoderKLQwenImage (and AutoencoderKLWan, the same network) is a video VAE: causal Conv3d layers that
pad time with two zero frames in front, RMS norms, a 1x1x1 quant_conv/post_quant_conv around the latent, f8 with 16
latent channels. An image is its first frame, and for one frame every piece collapses to 2D:
- a causal 3x3x3 (or 1x1x1) Conv3d sees the frame only through its kernel's last temporal slice (the others
  multiply the zero padding), so it is a Conv2d with the kernel `weight[:, :, -1]` (tests/test_wan_ae.py checks it);
- the temporal resamplers' `time_conv` never runs on the first frame (the encoder caches the frame, the decoder
  marks it "Rep"), so it is not part of this model at all; the export keeps it from the source;
- the spatial resamplers and the mid attention are 2D convolutions in diffusers already.
Parameter names are diffusers' (`encoder.down_blocks.3.resample.1.weight`, `decoder.up_blocks.0.resnets.1.norm1.gamma`,
`encoder.mid_block.attentions.0.to_qkv.weight`, ...), so the conversion is a reshape per tensor, never a renaming.
Wan 2.2's VAE (AutoencoderKLWan with is_residual and patch_size 2: f16, z48) collapses the same way, with two more
pieces: the image enters as 2x2 patches stacked on the channels, and each level is one residual block whose
parameter-free shortcut averages (down) or duplicates (up) channel groups; on a first frame a level that halves time
averages with the zero frame of the causal padding, and keeps the last of the duplicated frames, as diffusers does.

Numerics. Everything but the causal convolutions runs diffusers' torch ops in diffusers' order and memory layout
(FrameConv2d), so those parts are bitwise equal on any machine. A Conv2d and the single-frame Conv3d are different
kernels, and whether they sum in the same order depends on the machine and the shapes: on an AVX512 CPU (oneDNN, any
thread count) the whole tiny model was bitwise diffusers' for batches of 2, while for a batch of 1 oneDNN picks
another Conv3d kernel from 16 input channels on (one conv 2e-5 apart on outputs of ~30) and the model agrees to
float32 rounding: 1e-6 on the posterior and the image. tests/test_wan_ae.py holds it to 1e-5 of the tensors' scale
and prints whether it was bitwise.
fp32 islands as in ae.py: every RMS norm is computed in fp32 under autocast, and so are the moments head (norm_out,
conv_out, quant_conv) and the posterior.

The decoder's clamp. diffusers clamps the decoded image to [-1, 1] inside the model (`_decode`), not only in the
pipeline, so `decode` clamps as it does in eval mode (evaluation and export then see what diffusers decodes). In
training mode it does not: a clamp has zero gradient wherever the raw output leaves [-1, 1], so a pixel pushed past
the range (decoding 1.3 for a target of 0.9) would get no gradient from any loss and could never come back; without
the clamp every loss sees and corrects it. What that costs: the losses also penalise harmless overshoot at saturated
targets (1.05 for a target of 1.0, which the clamp would hide), the same as training FLUX/SD VAEs, whose pipelines
clamp after decoding.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ae import LOGVAR_RANGE, AutoEncoder, _run_level


@dataclass
class WanImageParams:
    """Architecture of the Wan family's VAE on one frame. Defaults are Qwen-Image's VAE (diffusers'
    AutoencoderKLQwenImage: base_dim 96, z_dim 16, dim_mult 1,2,4,4, 2 blocks a level, f8). The names follow
    ae.AutoEncoderParams where the concept is the same (ch = diffusers' base_dim, z_channels = z_dim); in_channels and
    out_ch are the image's channels (diffusers' in_channels/out_channels count the patchified ones).
    Wan 2.2's VAE (AutoencoderKLWan is_residual, patch_size 2: f16, z48) is patch_size 2 with level_shortcuts."""
    in_channels: int = 3
    out_ch: int = 3
    ch: int = 96
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    # Wan's decoder_base_dim: the decoder's own base width (None: ch, as every Wan 2.1 / Qwen-Image release)
    decoder_ch: int | None = None
    dropout: float = 0.0
    # Wan 2.2: the image enters the encoder as patch_size x patch_size patches stacked on the channels (and leaves the
    # decoder so), a factor patch_size more downsampling
    patch_size: int = 1
    # Wan 2.2 (is_residual): each level is one block with a parameter-free shortcut around it, channel groups
    # averaged down / duplicated up; on a first frame a level that halves time averages with a zero frame, so which
    # levels do (diffusers' temperal_downsample, one per level but the last) shapes the image computation
    level_shortcuts: bool = False
    temporal_downsample: tuple[bool, ...] = ()

    # what checkpoints record beside the fields, so a loader builds this model and not ae.AutoEncoder
    family: ClassVar[str] = "wan"
    # read by the trainer as on ae.AutoEncoderParams: the posterior is always learned (mean and log-variance, LDM's
    # DiagonalGaussianDistribution) and a 1x1 quant_conv/post_quant_conv always surrounds the latent
    posterior: ClassVar[str] = "learned"
    quant_conv: ClassVar[bool] = True

    def __post_init__(self):
        if self.decoder_ch is None:
            self.decoder_ch = self.ch
        self.ch_mult, self.temporal_downsample = tuple(self.ch_mult), tuple(self.temporal_downsample)
        if self.level_shortcuts and len(self.temporal_downsample) != len(self.ch_mult) - 1:
            raise ValueError(f"level_shortcuts needs temporal_downsample for each of the {len(self.ch_mult) - 1} "
                             f"downsampling levels, got {self.temporal_downsample}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1) * self.patch_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ch_mult"], d["temporal_downsample"] = list(self.ch_mult), list(self.temporal_downsample)
        return {"family": self.family, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "WanImageParams":
        d = dict(d)
        family = d.pop("family", cls.family)
        if family != cls.family:
            raise ValueError(f"model_params of family {family!r}, not {cls.family!r}")
        return cls(**d)


# ============================================================================================
# blocks (diffusers' QwenImage*/Wan* blocks on one frame)
# ============================================================================================
class RMSNorm32(nn.Module):
    """Wan's RMS norm over channels, F.normalize(x) * sqrt(C) * gamma, computed in fp32 whatever the autocast (a
    mean square of bf16 activations loses the small ones, as GroupNorm's variance would; ae.GroupNorm32). The output
    keeps the input's dtype. In fp32 it is diffusers' arithmetic op for op (its `+ bias` adds the float 0.0)."""

    def __init__(self, channels: int):
        super().__init__()
        self.scale = channels ** 0.5
        self.gamma = nn.Parameter(torch.ones(channels, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            out = F.normalize(x.float(), dim=1) * self.scale * self.gamma.float()
        return out.to(x.dtype)


def _layout_of(weight: Tensor) -> torch.memory_format:
    if weight.is_contiguous() or not weight.is_contiguous(memory_format=torch.channels_last):
        return torch.contiguous_format
    return torch.channels_last


class FrameConv2d(nn.Conv2d):
    """A causal 3x3x3 Conv3d on one frame: a 3x3 Conv2d with the kernel's last temporal slice.

    It runs on its input in the layout of its weights: contiguous as built, channels-last after
    `model.to(memory_format=torch.channels_last)`. diffusers' F.pad hands every Conv3d a contiguous frame whatever
    its input's layout (after the mid attention that layout is channels-last), and a convolution's kernel, so its
    rounding, depends on the layout: run on the channels-last tensor, the block after the attention came out ~1e-7
    off diffusers."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(in_channels, out_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.contiguous(memory_format=_layout_of(self.weight)))


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = RMSNorm32(in_dim)
        self.conv1 = FrameConv2d(in_dim, out_dim)
        self.norm2 = RMSNorm32(out_dim)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = FrameConv2d(out_dim, out_dim)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        shortcut = self.conv_shortcut(x)
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return h + shortcut


class AttentionBlock(nn.Module):
    """Single-head spatial self-attention, diffusers' QwenImageAttentionBlock op for op (a fused qkv 1x1 conv, its
    output read as (pixels, 3 x channels) tokens)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm32(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, height, width = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        h = F.scaled_dot_product_attention(q, k, v).squeeze(1).permute(0, 2, 1).reshape(b, c, height, width)
        # the attention first: the sum takes its (channels-last) layout, as in diffusers, where the next block's RMS
        # norm reduces over it in that order
        return self.proj(h) + x


class MidBlock(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout), ResidualBlock(dim, dim, dropout)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Downsample(nn.Module):
    """Pad right/bottom by one, then a valid stride-2 conv (diffusers' `resample`, an nn.Sequential: the weights are
    `resample.1.*`). Its `time_conv`, in a temporal level, never sees a first frame."""

    def __init__(self, dim: int):
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))

    def forward(self, x: Tensor) -> Tensor:
        return self.resample(x)


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a conv; Wan 2.1's decoder halves the channels there (out_dim None), Wan 2.2's not."""

    def __init__(self, dim: int, out_dim: int | None = None):
        super().__init__()
        self.resample = nn.Sequential(nn.Upsample(scale_factor=2.0, mode="nearest-exact"),
                                      nn.Conv2d(dim, dim // 2 if out_dim is None else out_dim, 3, padding=1))

    def forward(self, x: Tensor) -> Tensor:
        return self.resample(x)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout) for i in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([Upsample(out_dim)]) if upsample else None

    def segments(self) -> list[nn.Module]:
        """What checkpointing runs as one segment each: every block and the upsampler."""
        return list(self.resnets) + (list(self.upsamplers) if self.upsamplers is not None else [])


# Wan 2.2's levels: a residual block per level, with parameter-free shortcuts (diffusers' AvgDown3D / DupUp3D on a
# first frame, the same copies and sums)
class AverageDownShortcut(nn.Module):
    """Space(-and-time)-to-depth, then the mean of each group of consecutive channels. A level that halves time pads
    one zero frame in front of the first frame (diffusers' causal padding), so half of each group's entries are 0:
    they are kept, and the mean sums what diffusers sums."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool, spatial: bool):
        super().__init__()
        self.out_channels = out_channels
        self.factor_t, self.factor_s = 2 if temporal else 1, 2 if spatial else 1
        factor = self.factor_t * self.factor_s ** 2
        if in_channels * factor % out_channels:
            raise ValueError(f"{in_channels} channels x {factor} do not split into {out_channels} groups")
        self.group_size = in_channels * factor // out_channels

    def forward(self, x: Tensor) -> Tensor:
        b, c, height, width = x.shape
        ft, fs = self.factor_t, self.factor_s
        frames = torch.cat([x.new_zeros(b, c, ft - 1, height, width), x.unsqueeze(2)], dim=2)
        frames = frames.view(b, c, ft, height // fs, fs, width // fs, fs).permute(0, 1, 2, 4, 6, 3, 5).contiguous()
        return frames.view(b, self.out_channels, self.group_size, height // fs, width // fs).mean(dim=2)


class DuplicateUpShortcut(nn.Module):
    """Each channel repeated, then depth-to-space(-and-time); of a level's frames a first frame keeps the last one
    (diffusers drops the first factor_t - 1)."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.out_channels, self.factor_t = out_channels, 2 if temporal else 1
        factor = self.factor_t * 4
        if out_channels * factor % in_channels:
            raise ValueError(f"{out_channels} channels x {factor} are no multiple of {in_channels}")
        self.repeats = out_channels * factor // in_channels

    def forward(self, x: Tensor) -> Tensor:
        b, _, height, width = x.shape
        x = x.repeat_interleave(self.repeats, dim=1).view(b, self.out_channels, self.factor_t, 2, 2, height, width)
        return x[:, :, -1].permute(0, 1, 4, 2, 5, 3).reshape(b, self.out_channels, 2 * height, 2 * width)


class ResidualDownBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, temporal: bool,
                 downsample: bool):
        super().__init__()
        self.avg_shortcut = AverageDownShortcut(in_dim, out_dim, temporal, downsample)
        self.resnets = nn.ModuleList(
            [ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout) for i in range(num_res_blocks)])
        self.downsampler = Downsample(out_dim) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h)
        if self.downsampler is not None:
            h = self.downsampler(h)
        return h + self.avg_shortcut(x)


class ResidualUpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, temporal: bool,
                 upsample: bool):
        super().__init__()
        self.avg_shortcut = DuplicateUpShortcut(in_dim, out_dim, temporal) if upsample else None
        self.resnets = nn.ModuleList(
            [ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout) for i in range(num_res_blocks + 1)])
        self.upsampler = Upsample(out_dim, out_dim) if upsample else None

    def segments(self) -> list[nn.Module]:
        return [self]  # the shortcut spans the level: one checkpoint segment

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h)
        if self.upsampler is not None:
            h = self.upsampler(h) + self.avg_shortcut(x)
        return h


def patchify(x: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, C * p * p, H / p, W / p), channels ordered (C, column in the patch, row), as diffusers'."""
    if patch_size == 1:
        return x
    b, c, height, width = x.shape
    p = patch_size
    x = x.view(b, c, height // p, p, width // p, p).permute(0, 1, 5, 3, 2, 4).contiguous()
    return x.view(b, c * p * p, height // p, width // p)


def unpatchify(x: Tensor, patch_size: int) -> Tensor:
    if patch_size == 1:
        return x
    b, cpp, height, width = x.shape
    p = patch_size
    x = x.view(b, cpp // (p * p), p, p, height, width).permute(0, 1, 4, 3, 5, 2).contiguous()
    return x.view(b, cpp // (p * p), height * p, width * p)


# ============================================================================================
# encoder and decoder
# ============================================================================================
class Encoder(nn.Module):
    """diffusers' `down_blocks`: Wan 2.1's flat list (each level's residual blocks, then a downsampler but in the last
    level), or Wan 2.2's one block a level; `level_blocks[i]` indexes resolution level i's entries for checkpointing.
    (diffusers' `attn_scales` would put attention blocks in the flat list, but its encoder cannot run them: they do
    not take the feature cache.)"""

    def __init__(self, in_channels: int, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, out_channels: int,
                 dropout: float = 0.0, level_shortcuts: bool = False, temporal_downsample: tuple[bool, ...] = ()):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.checkpoint_levels: set[int] = set()
        dims = [ch * m for m in (1,) + tuple(ch_mult)]
        self.conv_in = FrameConv2d(in_channels, dims[0])
        self.down_blocks = nn.ModuleList()
        self.level_blocks: list[range] = []
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            start = len(self.down_blocks)
            if level_shortcuts:  # Wan 2.2: the level is one block (its shortcut spans it: one checkpoint segment)
                last = level == self.num_resolutions - 1
                self.down_blocks.append(ResidualDownBlock(in_dim, out_dim, num_res_blocks, dropout,
                                                          temporal=not last and temporal_downsample[level],
                                                          downsample=not last))
                self.level_blocks.append(range(start, start + 1))
                continue
            for _ in range(num_res_blocks):
                self.down_blocks.append(ResidualBlock(in_dim, out_dim, dropout))
                in_dim = out_dim
            if level != self.num_resolutions - 1:
                self.down_blocks.append(Downsample(out_dim))
            self.level_blocks.append(range(start, len(self.down_blocks)))
        self.mid_block = MidBlock(dims[-1], dropout)
        self.norm_out = RMSNorm32(dims[-1])
        self.conv_out = FrameConv2d(dims[-1], out_channels)

    def _level(self, level: int) -> list[nn.Module]:
        return [self.down_blocks[i] for i in self.level_blocks[level]]

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in range(self.num_resolutions):
            h = _run_level(self._level(level), h, level in self.checkpoint_levels)
        h = self.mid_block(h)
        # the moments head in fp32 whatever the autocast, as ae.Encoder's: the posterior mean and log-variance are
        # what the KL, the latent statistics and a diffusion model see
        with torch.autocast(h.device.type, enabled=False):
            return self.conv_out(F.silu(self.norm_out(h.float())))


class Decoder(nn.Module):
    """diffusers' `up_blocks` run from the lowest resolution; level i (0 = the highest resolution, as ae.Decoder's
    checkpoint levels) is up_blocks[num_resolutions - 1 - i]."""

    def __init__(self, ch: int, out_ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int,
                 dropout: float = 0.0, level_shortcuts: bool = False, temporal_downsample: tuple[bool, ...] = ()):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.checkpoint_levels: set[int] = set()
        dims = [ch * m for m in (ch_mult[-1],) + tuple(ch_mult[::-1])]
        self.conv_in = FrameConv2d(z_channels, dims[0])
        self.mid_block = MidBlock(dims[0], dropout)
        self.up_blocks = nn.ModuleList()
        temporal_upsample = tuple(temporal_downsample[::-1])
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            upsample = i != self.num_resolutions - 1
            if level_shortcuts:  # Wan 2.2
                self.up_blocks.append(ResidualUpBlock(in_dim, out_dim, num_res_blocks, dropout,
                                                      temporal=upsample and temporal_upsample[i], upsample=upsample))
                continue
            if i > 0:
                in_dim //= 2  # the previous block's upsampler halved its channels
            self.up_blocks.append(UpBlock(in_dim, out_dim, num_res_blocks, dropout, upsample))
        self.norm_out = RMSNorm32(dims[-1])
        self.conv_out = FrameConv2d(dims[-1], out_ch)

    def _level(self, level: int) -> list[nn.Module]:
        return self.up_blocks[self.num_resolutions - 1 - level].segments()

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid_block(self.conv_in(z))
        for level in reversed(range(self.num_resolutions)):
            h = _run_level(self._level(level), h, level in self.checkpoint_levels)
        return self.conv_out(F.silu(self.norm_out(h)))


class WanImageAutoEncoder(nn.Module):
    """The Qwen-Image / Wan 2.1 (or Wan 2.2) VAE on images (B, C, H, W), with ae.AutoEncoder's interface (params,
    downsample_factor, encode_moments, sample, posterior_std, encode, decode, forward, set_grad_checkpointing,
    encoder/decoder with their checkpoint_levels, decoder.conv_out as the last layer, quant_conv)."""

    def __init__(self, params: WanImageParams):
        super().__init__()
        self.params = params
        moments = 2 * params.z_channels
        patch_area = params.patch_size ** 2
        self.encoder = Encoder(params.in_channels * patch_area, params.ch, params.ch_mult, params.num_res_blocks,
                               moments, params.dropout, params.level_shortcuts, params.temporal_downsample)
        self.quant_conv = nn.Conv2d(moments, moments, 1)
        self.post_quant_conv = nn.Conv2d(params.z_channels, params.z_channels, 1)
        self.decoder = Decoder(params.decoder_ch, params.out_ch * patch_area, params.ch_mult, params.num_res_blocks,
                               params.z_channels, params.dropout, params.level_shortcuts, params.temporal_downsample)

    @property
    def downsample_factor(self) -> int:
        return self.params.downsample_factor

    # the same levels per mode as ae.AutoEncoder (it reads only encoder/decoder.num_resolutions and sets their
    # checkpoint_levels; the blocks run through ae._run_level, one checkpoint segment each)
    set_grad_checkpointing = AutoEncoder.set_grad_checkpointing

    def encode_moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior mean and log-variance (clamped to LDM's range, as diffusers' DiagonalGaussianDistribution)."""
        h = self.encoder(patchify(x, self.params.patch_size))
        with torch.autocast(h.device.type, enabled=False):  # part of the fp32 moments head
            h = self.quant_conv(h.float())
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(*LOGVAR_RANGE)

    def posterior_std(self, logvar: Tensor) -> Tensor:
        return torch.exp(0.5 * logvar)

    def sample(self, mean: Tensor, logvar: Tensor) -> Tensor:
        mean = mean.float()  # the noise is drawn and added in fp32, as ae.AutoEncoder.sample
        return mean + self.posterior_std(logvar) * torch.randn_like(mean)

    def encode(self, x: Tensor) -> Tensor:
        """Deterministic latent (the posterior mean), for evaluation and export."""
        return self.encode_moments(x)[0]

    def decode(self, z: Tensor) -> Tensor:
        """The image; clamped to [-1, 1] in eval mode as diffusers' decode clamps, raw in training mode (the
        clamp's zero gradient would strand pixels beyond the range: module docstring)."""
        image = unpatchify(self.decoder(self.post_quant_conv(z)), self.params.patch_size)
        return image if self.training else image.clamp(-1.0, 1.0)

    def forward(self, x: Tensor, sample: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        """(reconstruction, mean, logvar), as ae.AutoEncoder.forward."""
        mean, logvar = self.encode_moments(x)
        return self.decode(self.sample(mean, logvar) if sample else mean), mean, logvar
