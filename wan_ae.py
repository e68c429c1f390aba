"""The Wan family's VAE (Qwen-Image's, Wan 2.1's video VAE, and Wan 2.2's): one module for images and clips, with
ae.AutoEncoder's interface. Its diffusers conversion, both ways, is wan_layouts.py.

diffusers' AutoencoderKLWan (and AutoencoderKLQwenImage, the same network) is a causal video VAE: Conv3d layers that
pad time with two zero frames in front, RMS norms per frame, spatial resamplers and a mid attention per frame, and
temporal resamplers (`time_conv`) that take a clip of T = 1 + 4k frames to 1 + k latent frames and back; a 1x1x1
quant_conv/post_quant_conv surround the latent. This module builds it two ways from the same blocks:
- `WanParams(video=True)`: the video model. Its parameters are diffusers' tensors (a norm's gamma aside, reshaped),
  every causal Conv3d and time_conv included. A clip is (B, C, T, H, W); an image (B, C, H, W) is a one-frame clip.
- `WanParams(video=False)`, the default: the image model, which is the video model's T = 1 with what a first frame
  never reads left out. A causal 3x3x3 Conv3d sees one frame only through its kernel's last temporal slice (the
  others multiply the zero padding), so it is a Conv2d with `weight[:, :, -1]`; the temporal resamplers never run on
  a first frame (the encoder passes it through, the decoder does not double it), so their time_conv is not part of
  it. Fine-tuning on images then holds a third of the convolution weights and their optimizer state; the export
  puts the other slices and the time_convs back from the source. tests/test_wan_ae.py checks that the video model
  on one frame computes what the image model computes.

Chunks and the temporal cache. diffusers reads a clip in chunks of 1, 4, 4, ... frames (the encoder) and 1, 1, ...
latent frames (the decoder), each causal layer keeping the last frames of its input for the next chunk, so that a
long clip never has to be in memory at once. Here a `Chunk` carries those frames explicitly: what each layer reads of
the chunk before (`prev`) and leaves for the next (`next`); a whole clip is one chunk. Every chunk plan computes the
same clip (the causal windows are the same; tests hold chunked and whole-clip outputs equal). Evaluation runs
diffusers' plan; training runs whole clips by default (one pass per layer is fastest), or `train_chunks` (the
trainer's --train_time_chunks) for memory: each chunk then runs under a non-reentrant checkpoint with its cache as the
checkpoint's tensor inputs and outputs (`_checkpointed_chunk`), so backward recomputes one chunk at a time, the
gradient flows from chunk to chunk through the cache, and it equals the whole clip's to float rounding
(tests/test_chunks.py). What stays alive for backward is each chunk's cache (two frames per causal layer) and the
output clip: it still grows with the clip, several times slower than the whole clip's activations. Because the cache
is an argument and not state hidden in the modules (diffusers' feat_cache list), gradient checkpointing works with it:
a checkpointed block recomputes from the same chunk's frames, and the gradients equal the unchecked ones (a test).

Numerics. Everything runs diffusers' torch ops in diffusers' order and memory layout, so a clip through the video
model is bitwise diffusers' on the same chunk plan. In the image model a Conv2d and the single-frame Conv3d are
different kernels, which may sum in another order: on an AVX512 CPU the tiny model was bitwise diffusers' for batches
of 2, while for a batch of 1 oneDNN picks another Conv3d kernel from 16 input channels on (one conv 2e-5 apart on
outputs of ~30) and the model agrees to float32 rounding: 1e-6 on the posterior and the image. tests/test_wan_ae.py
holds it to 1e-5 of the tensors' scale and prints whether it was bitwise.
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
from torch.utils.checkpoint import checkpoint

from ae import LOGVAR_RANGE, AutoEncoder, Trainable, _run_level, posterior_noise


@dataclass
class WanParams:
    """Architecture of the Wan family's VAE. Defaults are Qwen-Image's VAE (diffusers' AutoencoderKLQwenImage:
    base_dim 96, z_dim 16, dim_mult 1,2,4,4, 2 blocks a level, f8) as the image model. The names follow
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
    # averaged down / duplicated up; on a first frame a level that halves time averages with a zero frame
    level_shortcuts: bool = False
    # diffusers' temperal_downsample, one per level but the last: which levels halve time (the video model's
    # resamplers, and Wan 2.2's shortcuts on a first frame); () for the image model of Wan 2.1 / Qwen-Image
    temporal_downsample: tuple[bool, ...] = ()
    # the video model (clips of 1 + 4k frames, every temporal weight); False: the image model (module docstring)
    video: bool = False

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
        if (self.level_shortcuts or self.video) and len(self.temporal_downsample) != len(self.ch_mult) - 1:
            raise ValueError(f"{'the video model' if self.video else 'level_shortcuts'} needs temporal_downsample for "
                             f"each of the {len(self.ch_mult) - 1} downsampling levels, got {self.temporal_downsample}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1) * self.patch_size

    @property
    def temporal_factor(self) -> int:
        """Frames per latent frame after the first (4 for every release): clips have 1 + temporal_factor * k frames."""
        return 2 ** sum(self.temporal_downsample) if self.video else 1

    def describe(self) -> str:
        return "the Wan family's " + ("video" if self.video else "image") + " model (wan_ae.py)"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ch_mult"], d["temporal_downsample"] = list(self.ch_mult), list(self.temporal_downsample)
        return {"family": self.family, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "WanParams":
        d = dict(d)
        family = d.pop("family", cls.family)
        if family != cls.family:
            raise ValueError(f"model_params of family {family!r}, not {cls.family!r}")
        return cls(**d)


def check_frames(frames: int, temporal_factor: int) -> None:
    """A clip the video model takes, or ValueError in one line (diffusers would silently drop the frames past the
    last 1 + 4k)."""
    if frames < 1 or (frames - 1) % temporal_factor:
        raise ValueError(f"a clip of {frames} frames: the video model takes 1 + {temporal_factor}k frames "
                         f"(1, {1 + temporal_factor}, {1 + 2 * temporal_factor}, ...)")


# ============================================================================================
# the temporal cache
# ============================================================================================
class Chunk:
    """One chunk of a clip on its way through the video model. `prev`: what each causal layer kept of the chunk
    before (empty at the clip's start); `next`: what it keeps for the chunk after (written only when `keep`: a whole
    clip, or the last chunk, keeps nothing alive). Keyed by the layer."""

    def __init__(self, prev: dict | None = None, keep: bool = False):
        self.start = prev is None
        self.prev, self.next, self.keep = prev or {}, {}, keep


def _chunk_sizes(frames: int, first: int, per_chunk: int | None) -> list[int]:
    """A clip of `frames` as chunks: `first` frames, then `per_chunk` at a time (None: the whole clip at once)."""
    if per_chunk is None or frames <= first:
        return [frames]
    rest = frames - first
    return [first] + [per_chunk] * (rest // per_chunk) + ([rest % per_chunk] if rest % per_chunk else [])


def run_chunks(step, x: Tensor, sizes: list[int]) -> Tensor:
    """`step(frames, chunk)` over consecutive chunks of x's frames, each reading the last's cache; the outputs
    concatenated in time. Where autograd records (training) and there are several chunks, each chunk is checkpointed
    (`_checkpointed_chunk`): its activations are recomputed in backward, so that what a chunked pass holds for
    backward is the cache and the outputs, not every chunk's activations (chunking without it would save as much as
    the whole clip, and more: the cache copies)."""
    outputs, prev, start = [], None, 0
    checkpointed = torch.is_grad_enabled() and len(sizes) > 1
    for i, size in enumerate(sizes):
        frames, keep = x[:, :, start:start + size], i < len(sizes) - 1
        if checkpointed:
            out, prev = _checkpointed_chunk(step, frames, prev, keep)
        else:
            chunk = Chunk(prev, keep=keep)
            out, prev = step(frames, chunk), chunk.next
        outputs.append(out)
        start += size
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _checkpointed_chunk(step, frames: Tensor, prev: dict | None, keep: bool) -> tuple[Tensor, dict]:
    """One chunk under torch.utils.checkpoint (non-reentrant: exact, DDP-safe, nests with the per-level
    checkpoints): (its output, its cache for the next chunk). The cache goes in and out as the checkpointed
    function's tensor arguments and outputs, never through a dict the chunk shares: the recomputation in backward
    reads the tensors the forward read (the checkpoint keeps its inputs), writes into a Chunk of its own (nothing the
    next chunk holds is overwritten, nothing counted twice), and the gradient flows from each chunk to the one before
    through the cache tensors, as through any output. Dropout draws the same in recomputation: the checkpoint
    restores the RNG state."""
    keys = list(prev) if prev is not None else None
    written: list = []  # the layers that left frames for the next chunk, in the order they wrote them

    def run(frames: Tensor, *cached: Tensor) -> tuple[Tensor, ...]:
        chunk = Chunk(None if keys is None else dict(zip(keys, cached)), keep=keep)
        out = step(frames, chunk)
        written[:] = list(chunk.next)
        return (out, *chunk.next.values())
    out, *cached = checkpoint(run, frames, *(prev.values() if prev is not None else ()), use_reentrant=False)
    return out, dict(zip(written, cached))


def per_frame(module: nn.Module, x: Tensor) -> Tensor:
    """A 2D module on each frame of (B, C, T, H, W), as diffusers runs its resamplers (frames folded into the
    batch)."""
    b, c, t, height, width = x.shape
    x = module(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, height, width))
    return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


# ============================================================================================
# blocks (diffusers' Wan*/QwenImage* blocks; 4D in the image model, 5D in the video model)
# ============================================================================================
class RMSNorm32(nn.Module):
    """Wan's RMS norm over channels, F.normalize(x) * sqrt(C) * gamma, computed in fp32 whatever the autocast (a
    mean square of bf16 activations loses the small ones, as GroupNorm's variance would; ae.GroupNorm32). The output
    keeps the input's dtype. In fp32 it is diffusers' arithmetic op for op (its `+ bias` adds the float 0.0).
    gamma is (C, 1, 1) in both models; on a clip it broadcasts over time."""

    def __init__(self, channels: int):
        super().__init__()
        self.scale = channels ** 0.5
        self.gamma = nn.Parameter(torch.ones(channels, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            gamma = self.gamma.float()
            out = F.normalize(x.float(), dim=1) * self.scale * (gamma.unsqueeze(1) if x.dim() == 5 else gamma)
        return out.to(x.dtype)


def _layout_of(weight: Tensor) -> torch.memory_format:
    if weight.is_contiguous() or not weight.is_contiguous(memory_format=torch.channels_last):
        return torch.contiguous_format
    return torch.channels_last


class FrameConv2d(nn.Conv2d):
    """The image model's causal 3x3x3 Conv3d: a 3x3 Conv2d with the kernel's last temporal slice.

    It runs on its input in the layout of its weights: contiguous as built, channels-last after
    `model.to(memory_format=torch.channels_last)`. diffusers' F.pad hands every Conv3d a contiguous frame whatever
    its input's layout (after the mid attention that layout is channels-last), and a convolution's kernel, so its
    rounding, depends on the layout: run on the channels-last tensor, the block after the attention came out ~1e-7
    off diffusers."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(in_channels, out_channels, 3, padding=1)

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        return super().forward(x.contiguous(memory_format=_layout_of(self.weight)))


class CausalConv3d(nn.Conv3d):
    """diffusers' WanCausalConv3d: zero padding in space; in time, kt - 1 frames in front (none for a strided
    time_conv, whose resampler supplies them): the frames the chunk before left, and zeros at the clip's start."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int | tuple[int, int, int], stride: int = 1):
        super().__init__(in_channels, out_channels, kernel, stride=(stride, 1, 1))
        kt, kh, _ = self.kernel_size
        self.spatial, self.context = kh // 2, (kt - 1 if stride == 1 else 0)

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        pad = [self.spatial] * 4 + [self.context, 0]
        if self.context and chunk is not None:
            prev = chunk.prev.get(self)
            if prev is not None:
                x = torch.cat([prev, x], dim=2)
                pad[4] -= prev.shape[2]
            if chunk.keep:  # the last frames this layer read (with the chunk before's where this one is short)
                chunk.next[self] = x[:, :, -self.context:].clone()
        return super().forward(F.pad(x, pad))


def causal_conv(in_channels: int, out_channels: int, kernel: int, video: bool) -> nn.Module:
    """diffusers' causal Conv3d of a 3x3x3 or 1x1x1 kernel: itself in the video model, its last slice in the image
    model."""
    if video:
        return CausalConv3d(in_channels, out_channels, kernel)
    return FrameConv2d(in_channels, out_channels) if kernel == 3 else nn.Conv2d(in_channels, out_channels, 1)


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0, video: bool = False):
        super().__init__()
        self.norm1 = RMSNorm32(in_dim)
        self.conv1 = causal_conv(in_dim, out_dim, 3, video)
        self.norm2 = RMSNorm32(out_dim)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = causal_conv(out_dim, out_dim, 3, video)
        self.conv_shortcut = causal_conv(in_dim, out_dim, 1, video) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        shortcut = self.conv_shortcut(x)
        h = self.conv1(F.silu(self.norm1(x)), chunk)
        h = self.conv2(self.dropout(F.silu(self.norm2(h))), chunk)
        return h + shortcut


class AttentionBlock(nn.Module):
    """Single-head spatial self-attention per frame, diffusers' WanAttentionBlock op for op (a fused qkv 1x1 conv, its
    output read as (pixels, 3 x channels) tokens)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm32(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def attend(self, x: Tensor) -> Tensor:
        b, c, height, width = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        h = F.scaled_dot_product_attention(q, k, v).squeeze(1).permute(0, 2, 1).reshape(b, c, height, width)
        return self.proj(h)

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        # the attention first: the sum takes its (channels-last) layout, as in diffusers, where the next block's RMS
        # norm reduces over it in that order
        return (per_frame(self.attend, x) if x.dim() == 5 else self.attend(x)) + x


class MidBlock(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0, video: bool = False):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout, video), ResidualBlock(dim, dim, dropout, video)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x, chunk)), chunk)


class Downsample(nn.Module):
    """Pad right/bottom by one, then a valid stride-2 conv, per frame (diffusers' `resample`, an nn.Sequential: the
    weights are `resample.1.*`). A temporal level of the video model then halves time with `time_conv` (3 frames,
    stride 2): the clip's first frame passes alone, the rest in windows (0, 1, 2), (2, 3, 4), ..., which is what
    diffusers' chunks of 1, 4, 4, ... frames compute, each chunk reading the last frame of the one before."""

    def __init__(self, dim: int, temporal: bool = False, video: bool = False):
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=2) if temporal and video else None

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        if x.dim() == 4:
            return self.resample(x)
        x = per_frame(self.resample, x)
        if self.time_conv is None:
            return x
        prev = chunk.prev.get(self)
        if chunk.keep:
            chunk.next[self] = x[:, :, -1:].clone()
        if chunk.start:
            return torch.cat([x[:, :, :1], self.time_conv(x)], dim=2) if x.shape[2] > 1 else x
        return self.time_conv(torch.cat([prev, x], dim=2))


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a conv, per frame; Wan 2.1's decoder halves the channels there (out_dim None), Wan
    2.2's not. A temporal level of the video model first doubles time: `time_conv` gives two frames' channels for
    each frame but the clip's first, which stays one frame (diffusers' "Rep"); the frames after it see zeros in
    front, not the first frame."""

    def __init__(self, dim: int, out_dim: int | None = None, temporal: bool = False, video: bool = False):
        super().__init__()
        self.resample = nn.Sequential(nn.Upsample(scale_factor=2.0, mode="nearest-exact"),
                                      nn.Conv2d(dim, dim // 2 if out_dim is None else out_dim, 3, padding=1))
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1)) if temporal and video else None

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        if x.dim() == 4:
            return self.resample(x)
        if self.time_conv is not None:
            first, rest = (x[:, :, :1], x[:, :, 1:]) if chunk.start else (None, x)
            if rest.shape[2]:
                b, c, t, height, width = rest.shape
                doubled = self.time_conv(rest, chunk).reshape(b, 2, c, t, height, width)
                rest = torch.stack((doubled[:, 0], doubled[:, 1]), 3).reshape(b, c, t * 2, height, width)
                x = rest if first is None else torch.cat([first, rest], dim=2)
        return per_frame(self.resample, x)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, upsample: bool,
                 temporal: bool = False, video: bool = False):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout, video)
                                      for i in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([Upsample(out_dim, None, temporal, video)]) if upsample else None

    def segments(self) -> list[nn.Module]:
        """What checkpointing runs as one segment each: every block and the upsampler."""
        return list(self.resnets) + (list(self.upsamplers) if self.upsamplers is not None else [])


# Wan 2.2's levels: a residual block per level, with parameter-free shortcuts (diffusers' AvgDown3D / DupUp3D)
class AverageDownShortcut(nn.Module):
    """Space(-and-time)-to-depth, then the mean of each group of consecutive channels (diffusers' AvgDown3D op for
    op). A level that halves time pads zero frames in front to a whole number of pairs (one before a first frame):
    they are kept, and the mean sums what diffusers sums. An image is a one-frame clip."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool, spatial: bool):
        super().__init__()
        self.out_channels = out_channels
        self.factor_t, self.factor_s = 2 if temporal else 1, 2 if spatial else 1
        factor = self.factor_t * self.factor_s ** 2
        if in_channels * factor % out_channels:
            raise ValueError(f"{in_channels} channels x {factor} do not split into {out_channels} groups")
        self.group_size = in_channels * factor // out_channels

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        if x.dim() == 4:
            return self(x.unsqueeze(2)).squeeze(2)
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (ft - x.shape[2] % ft) % ft, 0))
        b, c, t, height, width = x.shape
        x = x.view(b, c, t // ft, ft, height // fs, fs, width // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
        return x.view(b, self.out_channels, self.group_size, t // ft, height // fs, width // fs).mean(dim=2)


class DuplicateUpShortcut(nn.Module):
    """Each channel repeated, then depth-to-space(-and-time) (diffusers' DupUp3D); of the clip's first frame's
    frames only the last is kept (diffusers drops the first factor_t - 1 in the first chunk)."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.out_channels, self.factor_t = out_channels, 2 if temporal else 1
        factor = self.factor_t * 4
        if out_channels * factor % in_channels:
            raise ValueError(f"{out_channels} channels x {factor} are no multiple of {in_channels}")
        self.repeats = out_channels * factor // in_channels

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        if x.dim() == 4:
            return self(x.unsqueeze(2)).squeeze(2)
        b, _, t, height, width = x.shape
        ft = self.factor_t
        x = x.repeat_interleave(self.repeats, dim=1).view(b, self.out_channels, ft, 2, 2, t, height, width)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous().view(b, self.out_channels, t * ft, height * 2, width * 2)
        return x[:, :, ft - 1:] if chunk is None or chunk.start else x


class ResidualDownBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, temporal: bool,
                 downsample: bool, video: bool = False):
        super().__init__()
        self.avg_shortcut = AverageDownShortcut(in_dim, out_dim, temporal, downsample)
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout, video)
                                      for i in range(num_res_blocks)])
        self.downsampler = Downsample(out_dim, temporal, video) if downsample else None

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h, chunk)
        if self.downsampler is not None:
            h = self.downsampler(h, chunk)
        return h + self.avg_shortcut(x, chunk)


class ResidualUpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, temporal: bool,
                 upsample: bool, video: bool = False):
        super().__init__()
        self.avg_shortcut = DuplicateUpShortcut(in_dim, out_dim, temporal) if upsample else None
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dropout, video)
                                      for i in range(num_res_blocks + 1)])
        self.upsampler = Upsample(out_dim, out_dim, temporal, video) if upsample else None

    def segments(self) -> list[nn.Module]:
        return [self]  # the shortcut spans the level: one checkpoint segment

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h, chunk)
        if self.upsampler is not None:
            h = self.upsampler(h, chunk) + self.avg_shortcut(x, chunk)
        return h


def patchify(x: Tensor, patch_size: int) -> Tensor:
    """(B, C, [T,] H, W) -> (B, C * p * p, [T,] H / p, W / p), channels ordered (C, column in the patch, row), as
    diffusers'."""
    if patch_size == 1:
        return x
    if x.dim() == 4:
        return patchify(x.unsqueeze(2), patch_size).squeeze(2)
    b, c, t, height, width = x.shape
    p = patch_size
    x = x.view(b, c, t, height // p, p, width // p, p).permute(0, 1, 6, 4, 2, 3, 5).contiguous()
    return x.view(b, c * p * p, t, height // p, width // p)


def unpatchify(x: Tensor, patch_size: int) -> Tensor:
    if patch_size == 1:
        return x
    if x.dim() == 4:
        return unpatchify(x.unsqueeze(2), patch_size).squeeze(2)
    b, cpp, t, height, width = x.shape
    p = patch_size
    x = x.view(b, cpp // (p * p), p, p, t, height, width).permute(0, 1, 4, 5, 3, 6, 2).contiguous()
    return x.view(b, cpp // (p * p), t, height * p, width * p)


# ============================================================================================
# encoder and decoder
# ============================================================================================
class Encoder(nn.Module):
    """diffusers' `down_blocks`: Wan 2.1's flat list (each level's residual blocks, then a downsampler but in the last
    level), or Wan 2.2's one block a level; `level_blocks[i]` indexes resolution level i's entries for checkpointing.
    (diffusers' `attn_scales` would put attention blocks in the flat list, but its encoder cannot run them: they do
    not take the feature cache.)"""

    def __init__(self, in_channels: int, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, out_channels: int,
                 dropout: float = 0.0, level_shortcuts: bool = False, temporal_downsample: tuple[bool, ...] = (),
                 video: bool = False):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.checkpoint_levels: set[int] = set()
        dims = [ch * m for m in (1,) + tuple(ch_mult)]
        temporal = tuple(temporal_downsample) or (False,) * (self.num_resolutions - 1)
        self.conv_in = causal_conv(in_channels, dims[0], 3, video)
        self.down_blocks = nn.ModuleList()
        self.level_blocks: list[range] = []
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            start, last = len(self.down_blocks), level == self.num_resolutions - 1
            if level_shortcuts:  # Wan 2.2: the level is one block (its shortcut spans it: one checkpoint segment)
                self.down_blocks.append(ResidualDownBlock(in_dim, out_dim, num_res_blocks, dropout,
                                                          temporal=not last and temporal[level], downsample=not last,
                                                          video=video))
                self.level_blocks.append(range(start, start + 1))
                continue
            for _ in range(num_res_blocks):
                self.down_blocks.append(ResidualBlock(in_dim, out_dim, dropout, video))
                in_dim = out_dim
            if not last:
                self.down_blocks.append(Downsample(out_dim, temporal[level], video))
            self.level_blocks.append(range(start, len(self.down_blocks)))
        self.mid_block = MidBlock(dims[-1], dropout, video)
        self.norm_out = RMSNorm32(dims[-1])
        self.conv_out = causal_conv(dims[-1], out_channels, 3, video)

    def _level(self, level: int) -> list[nn.Module]:
        return [self.down_blocks[i] for i in self.level_blocks[level]]

    def forward(self, x: Tensor, chunk: Chunk | None = None) -> Tensor:
        h = self.conv_in(x, chunk)
        for level in range(self.num_resolutions):
            h = _run_level(self._level(level), h, level in self.checkpoint_levels, chunk)
        h = self.mid_block(h, chunk)
        # the moments head in fp32 whatever the autocast, as ae.Encoder's: the posterior mean and log-variance are
        # what the KL, the latent statistics and a diffusion model see
        with torch.autocast(h.device.type, enabled=False):
            return self.conv_out(F.silu(self.norm_out(h.float())), chunk)


class Decoder(nn.Module):
    """diffusers' `up_blocks` run from the lowest resolution; level i (0 = the highest resolution, as ae.Decoder's
    checkpoint levels) is up_blocks[num_resolutions - 1 - i]."""

    def __init__(self, ch: int, out_ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int,
                 dropout: float = 0.0, level_shortcuts: bool = False, temporal_downsample: tuple[bool, ...] = (),
                 video: bool = False):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.checkpoint_levels: set[int] = set()
        dims = [ch * m for m in (ch_mult[-1],) + tuple(ch_mult[::-1])]
        self.conv_in = causal_conv(z_channels, dims[0], 3, video)
        self.mid_block = MidBlock(dims[0], dropout, video)
        self.up_blocks = nn.ModuleList()
        temporal_upsample = tuple(temporal_downsample[::-1]) or (False,) * (self.num_resolutions - 1)
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            upsample = i != self.num_resolutions - 1
            temporal = upsample and temporal_upsample[i]
            if level_shortcuts:  # Wan 2.2
                self.up_blocks.append(ResidualUpBlock(in_dim, out_dim, num_res_blocks, dropout, temporal, upsample,
                                                      video))
                continue
            if i > 0:
                in_dim //= 2  # the previous block's upsampler halved its channels
            self.up_blocks.append(UpBlock(in_dim, out_dim, num_res_blocks, dropout, upsample, temporal, video))
        self.norm_out = RMSNorm32(dims[-1])
        self.conv_out = causal_conv(dims[-1], out_ch, 3, video)

    def _level(self, level: int) -> list[nn.Module]:
        return self.up_blocks[self.num_resolutions - 1 - level].segments()

    def forward(self, z: Tensor, chunk: Chunk | None = None) -> Tensor:
        h = self.mid_block(self.conv_in(z, chunk), chunk)
        for level in reversed(range(self.num_resolutions)):
            h = _run_level(self._level(level), h, level in self.checkpoint_levels, chunk)
        return self.conv_out(F.silu(self.norm_out(h)), chunk)


class WanAutoEncoder(Trainable, nn.Module):
    """The Qwen-Image / Wan 2.1 (or Wan 2.2) VAE with ae.AutoEncoder's interface (params, downsample_factor,
    encode_moments, sample, posterior_std, encode, decode, forward, set_grad_checkpointing, encoder/decoder with their
    checkpoint_levels, decoder.conv_out as the last layer, quant_conv). The image model takes (B, C, H, W); the video
    model takes clips (B, C, T, H, W) of T = 1 + 4k frames, and images as one-frame clips.

    `time_chunks` (video model): (encoder frames, decoder latent frames) per chunk after the clip's first frame, 0
    for the whole clip in one pass; diffusers' plan is (4, 1). Every plan computes the same clip (to float
    rounding). None (the default): in eval mode without gradients (evaluation, export's statistics, sample grids)
    diffusers' plan, so that a long or large clip fits where diffusers' does and the numbers are diffusers'; else
    `train_chunks` (the trainer's --train_time_chunks; (0, 0), the whole clip, by default: one pass per layer is
    faster). A chunked pass that records autograd checkpoints each chunk (run_chunks), so that backward holds one
    chunk's activations at a time and the gradient is the whole clip's (to float rounding; the cache carries it)."""

    def __init__(self, params: WanParams):
        super().__init__()
        self.params = params
        self.grad_checkpointing = "none"
        self.time_chunks: tuple[int, int] | None = None
        self.train_chunks: tuple[int, int] = (0, 0)
        moments, video = 2 * params.z_channels, params.video
        patch_area = params.patch_size ** 2
        self.encoder = Encoder(params.in_channels * patch_area, params.ch, params.ch_mult, params.num_res_blocks,
                               moments, params.dropout, params.level_shortcuts, params.temporal_downsample, video)
        self.quant_conv = causal_conv(moments, moments, 1, video)
        self.post_quant_conv = causal_conv(params.z_channels, params.z_channels, 1, video)
        self.decoder = Decoder(params.decoder_ch, params.out_ch * patch_area, params.ch_mult, params.num_res_blocks,
                               params.z_channels, params.dropout, params.level_shortcuts, params.temporal_downsample,
                               video)

    @property
    def downsample_factor(self) -> int:
        return self.params.downsample_factor

    # the same levels per mode as ae.AutoEncoder (it reads only encoder/decoder.num_resolutions and sets their
    # checkpoint_levels; the blocks run through ae._run_level, one checkpoint segment each)
    set_grad_checkpointing = AutoEncoder.set_grad_checkpointing

    # ------------------------------------------------------------------------- its answers (ae.Trainable)
    time_chunks_refusal = ""  # the video model's; the image model has no --video_frames (config.check_video)

    @property
    def temporal_factor(self) -> int:
        return self.params.temporal_factor if self.params.video else 0

    def memory_plan(self):
        return self.grad_checkpointing, self.train_chunks

    def set_memory_plan(self, grad_checkpointing, time_chunks):
        self.set_grad_checkpointing(grad_checkpointing)
        self.train_chunks = tuple(time_chunks)

    def serves(self):
        return "Qwen-Image and Wan pipelines ((z - latents_mean) / latents_std per channel)"

    def _frames_per_chunk(self, part: int) -> int | None:
        """Frames (part 0: the encoder's) or latent frames (part 1: the decoder's) per chunk; None: the whole clip."""
        plan = self.time_chunks
        if plan is None:
            plan = ((self.params.temporal_factor, 1) if not self.training and not torch.is_grad_enabled() else
                    self.train_chunks)
        return plan[part] or None

    def _as_clip(self, x: Tensor) -> tuple[Tensor, bool]:
        if x.dim() == 5 and not self.params.video:
            raise ValueError("a clip given to the image model of the Wan family: build it with video=True (the "
                             "trainer's --video_frames)")
        if self.params.video and x.dim() == 4:
            return x.unsqueeze(2), True
        return x, False

    def encode_moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior mean and log-variance (clamped to LDM's range, as diffusers' DiagonalGaussianDistribution)."""
        x, image = self._as_clip(x)
        x = patchify(x, self.params.patch_size)
        if x.dim() == 5:
            check_frames(x.shape[2], self.params.temporal_factor)
            per_chunk = self._frames_per_chunk(0)
            if per_chunk is not None and per_chunk % self.params.temporal_factor:
                raise ValueError(f"encoder chunks of {per_chunk} frames: a multiple of {self.params.temporal_factor}")
            h = run_chunks(self.encoder, x, _chunk_sizes(x.shape[2], 1, per_chunk))
        else:
            h = self.encoder(x)
        with torch.autocast(h.device.type, enabled=False):  # part of the fp32 moments head
            h = self.quant_conv(h.float())
        mean, logvar = h.chunk(2, dim=1)
        logvar = logvar.clamp(*LOGVAR_RANGE)
        return (mean.squeeze(2), logvar.squeeze(2)) if image else (mean, logvar)

    def posterior_std(self, logvar: Tensor) -> Tensor:
        return torch.exp(0.5 * logvar)

    def sample(self, mean: Tensor, logvar: Tensor) -> Tensor:
        mean = mean.float()  # the noise is drawn and added in fp32, as ae.AutoEncoder.sample
        # (in NCHW order: the whole clip's mean came out channels-last, a chunked one contiguous, and randn_like
        # gave another noise per element under --train_time_chunks)
        return mean + self.posterior_std(logvar) * posterior_noise(mean)

    def encode(self, x: Tensor) -> Tensor:
        """Deterministic latent (the posterior mean), for evaluation and export."""
        return self.encode_moments(x)[0]

    def decode(self, z: Tensor) -> Tensor:
        """The image or clip; clamped to [-1, 1] in eval mode as diffusers' decode clamps, raw in training mode (the
        clamp's zero gradient would strand pixels beyond the range: module docstring)."""
        z, image = self._as_clip(z)
        z = self.post_quant_conv(z)
        if z.dim() == 5:
            out = run_chunks(self.decoder, z, _chunk_sizes(z.shape[2], 1, self._frames_per_chunk(1)))
        else:
            out = self.decoder(z)
        out = unpatchify(out, self.params.patch_size)
        out = out.squeeze(2) if image else out
        return out if self.training else out.clamp(-1.0, 1.0)

    def forward(self, x: Tensor, sample: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        """(reconstruction, mean, logvar), as ae.AutoEncoder.forward."""
        mean, logvar = self.encode_moments(x)
        return self.decode(self.sample(mean, logvar) if sample else mean), mean, logvar
