"""The tiny autoencoders: madebyollin's TAESD family (TAESD, TAESDXL, TAESD3, TAEF1, TAEF2, TAESANA) and TAEHV's video
variants (Wan 2.1/2.2, HunyuanVideo, LTX-2, ...), as the `tae` family: the model, its released layouts both ways and
the diffusers AutoencoderTiny folder. The state dicts' keys and shapes are the spec; the code is this project's.

The networks (about 1.2M parameters a side at f8) are plain stacks, kept as `nn.Sequential`s so that the parameter
names are the released ones (`encoder.3.conv.0.weight`):
- a Block is three 3x3 convs with ReLUs between them, a 1x1 skip where the width changes, and a ReLU after the sum;
- f8 (TAESD .. TAEF1): the encoder is a conv, a Block, then three times a stride-2 conv and three Blocks, then a conv
  to the latent; the decoder is a tanh(z/3)*3 clamp, a conv and ReLU, then three times three Blocks, a nearest 2x
  upsample and a conv, then a Block and a conv to RGB;
- flux_2 (TAEF2): f8 with a pooled branch in the three Blocks nearest the latent, x + conv1x1(relu(GroupNorm(4 groups,
  conv1x1(x) to 4x the channels))) before the block: the GroupNorm's statistics are the whole image's;
- f32 (TAESANA): two stride-2 convs in front (3 -> 32 -> 64) and a 256-128-64-64-64 decoder of five upsamplings;
- hv (TAEHV): the f8 stack for clips. Frames run as a batch; a MemBlock's first conv also reads the same block's input
  one frame earlier (zeros before the first frame), a TPool stacks `stride` consecutive frames on the channels and
  mixes them with a 1x1 conv, a TGrow does the reverse. The encoder pools time by 2 before each of its strided convs
  that the layout says (4x: taehv, taew2_1; 8x: taeltx_2), the decoder grows it back and drops its first t - 1
  frames: a clip of 1 + t k frames has 1 + k latent frames and decodes to 1 + t k frames (the causal VAEs' rule).
  A patch size p (taew2_2, taehv1_5: 2; taeltx_2: 4) pixel-unshuffles the frames in and shuffles them out.

Conventions. The released networks read images in [0, 1] and write [0, 1]; here a model reads and writes the trainer's
[-1, 1] (x -> (x + 1) / 2 in, y -> 2 y - 1 out, as diffusers' AutoencoderTiny does). The encoder is deterministic (no
posterior, no KL term: --posterior none) and its latents are the ones the diffusion model of its latent space works
in, already normalised the way that model's pipeline normalises its VAE's latents: a pipeline hands its latents to the
tiny decoder as they are (diffusers' AutoencoderTiny: scaling_factor 1, shift_factor 0). `latent_magnitude` 3 and
`latent_shift` 0.5 are the released code's 8-bit PNG mapping of latents, kept in the diffusers config.

Layouts read (`load`): a pair NAME_encoder.pth + NAME_decoder.pth (each the state dict of one Sequential), given as
either file, their folder, or the folder/NAME prefix; a single .pth or .safetensors with encoder.* and decoder.* keys
(TAEHV's files); a diffusers AutoencoderTiny folder of the standard layout. Layouts written: the pair (or TAEHV's
single file) in fp32 (the released files are fp16: `write_released(..., dtype=torch.float16)` for their size), and
AutoencoderTiny where the architecture is one it has (f8, patch 1; not flux_2's pooled blocks, f32 or hv).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ae import GroupNorm32, Trainable
from config import GRAD_CHECKPOINTING

VARIANTS = ("f8", "flux_2", "f32", "hv")
RELEASED_VARIANTS = ("f8: taesd, taesdxl, taesd3, taef1; flux_2: taef2; f32: taesana; hv: taehv, taew2_1, taew2_2, "
                     "taehv1_5, taeltx_2")
ENCODER_SUFFIX, DECODER_SUFFIX = "_encoder.pth", "_decoder.pth"
LATENT_MAGNITUDE, LATENT_SHIFT = 3.0, 0.5  # the released code's latent <-> [0, 1] mapping (8-bit PNG latents)
AUTOENCODER_TINY = "AutoencoderTiny"


class LayoutError(ValueError):
    """A file or folder that is not a tiny autoencoder of a layout read here: the message is one line."""


# ============================================================================================
# The architecture
# ============================================================================================
@dataclass
class TAEParams:
    """Architecture of a tiny autoencoder: its variant (VARIANTS), latent channels, pixel patch size, and for hv which
    of the encoder's three levels halve time (TPool stride 2) and which of the decoder's double it (TGrow)."""
    z_channels: int = 4
    variant: str = "f8"
    patch_size: int = 1
    time_downscale: tuple[bool, ...] = ()
    time_upscale: tuple[bool, ...] = ()

    family: ClassVar[str] = "tae"
    posterior: ClassVar[str] = "none"  # deterministic: z is the encoder's output
    quant_conv: ClassVar[bool] = False
    in_channels: ClassVar[int] = 3
    out_ch: ClassVar[int] = 3

    def __post_init__(self):
        self.time_downscale, self.time_upscale = tuple(self.time_downscale), tuple(self.time_upscale)
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.variant == "hv":
            if not self.time_downscale:
                self.time_downscale, self.time_upscale = (True, True, False), (False, True, True)
            if len(self.time_downscale) != 3 or len(self.time_upscale) != 3:
                raise ValueError("hv: three time_downscale and three time_upscale flags (one per level)")
            if sum(self.time_downscale) != sum(self.time_upscale):
                raise ValueError(f"hv: the decoder must grow time as much as the encoder pools it, got "
                                 f"{self.time_downscale} and {self.time_upscale}")
        elif self.time_downscale or self.time_upscale:
            raise ValueError(f"{self.variant}: an image variant has no temporal levels")
        if self.variant == "f32" and self.patch_size != 1:
            raise ValueError("f32: the patch size is 1 (its first convs stride)")

    @property
    def video(self) -> bool:
        return self.variant == "hv"

    @property
    def downsample_factor(self) -> int:
        return 32 if self.variant == "f32" else 8 * self.patch_size

    @property
    def temporal_factor(self) -> int:
        """t of the clips of 1 + t k frames the model takes; 0: an image model."""
        return 2 ** sum(self.time_downscale) if self.video else 0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "family": self.family, "time_downscale": list(self.time_downscale),
                "time_upscale": list(self.time_upscale)}

    @classmethod
    def from_dict(cls, d: dict) -> "TAEParams":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def describe(self) -> str:
        video = f", clips of 1 + {self.temporal_factor}k frames" if self.video else ""
        patch = f", patch {self.patch_size}" if self.patch_size > 1 else ""
        return f"a tiny autoencoder ({self.variant}, f{self.downsample_factor} z{self.z_channels}{patch}{video})"


def conv(n_in: int, n_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


def conv1x1(n_in: int, n_out: int) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 1, bias=False)


class Clamp(nn.Module):
    """The decoder's soft clamp of the latent to (-3, 3)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / 3) * 3


class Block(nn.Module):
    """Three 3x3 convs and a skip; `pooled` (flux_2): first x + a 1x1 -> GroupNorm(4) -> ReLU -> 1x1 branch, whose
    GroupNorm (fp32 statistics under autocast, ae.GroupNorm32) pools over the whole image."""

    def __init__(self, n_in: int, n_out: int, pooled: bool = False):
        super().__init__()
        self.conv = nn.Sequential(conv(n_in, n_out), nn.ReLU(), conv(n_out, n_out), nn.ReLU(), conv(n_out, n_out))
        self.skip = conv1x1(n_in, n_out) if n_in != n_out else nn.Identity()
        self.fuse = nn.ReLU()
        wide = 4 * n_in
        self.pool = (nn.Sequential(conv1x1(n_in, wide), GroupNorm32(4, wide), nn.ReLU(), conv1x1(wide, n_in))
                     if pooled else None)

    def forward(self, x: Tensor) -> Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        return self.fuse(self.conv(x) + self.skip(x))


class MemBlock(nn.Module):
    """TAEHV's Block with memory: its first conv reads the frame and the block's input one frame earlier."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.conv = nn.Sequential(conv(2 * n_in, n_out), nn.ReLU(), conv(n_out, n_out), nn.ReLU(), conv(n_out, n_out))
        self.skip = conv1x1(n_in, n_out) if n_in != n_out else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: Tensor, past: Tensor) -> Tensor:
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class TPool(nn.Module):
    """`stride` consecutive frames (of a (N T, C, H, W) batch) stacked on the channels and mixed by a 1x1 conv."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = conv1x1(n_f * stride, n_f)

    def forward(self, x: Tensor) -> Tensor:
        _, c, h, w = x.shape
        return self.conv(x.reshape(-1, self.stride * c, h, w))


class TGrow(nn.Module):
    """A 1x1 conv to `stride` times the channels, unstacked into `stride` consecutive frames."""

    def __init__(self, n_f: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = conv1x1(n_f, n_f * stride)

    def forward(self, x: Tensor) -> Tensor:
        _, c, h, w = x.shape
        return self.conv(x).reshape(-1, c, h, w)


def image_encoder(p: TAEParams) -> nn.Sequential:
    pixels = 3 * p.patch_size ** 2
    if p.variant == "f32":
        head = [conv(3, 32, stride=2), nn.ReLU(), conv(32, 64, stride=2), nn.ReLU(), Block(64, 64)]
    else:
        head = [conv(pixels, 64), Block(64, 64)]
    pooled = p.variant == "flux_2"
    levels = []
    for level in range(3):
        levels += [conv(64, 64, stride=2, bias=False)] + [Block(64, 64, pooled and level == 2) for _ in range(3)]
    return nn.Sequential(*head, *levels, conv(64, p.z_channels))


def image_decoder(p: TAEParams) -> nn.Sequential:
    widths = (256, 128, 64, 64, 64, 64) if p.variant == "f32" else (64, 64, 64, 64)
    pooled = p.variant == "flux_2"
    layers = [Clamp(), conv(p.z_channels, widths[0]), nn.ReLU()]
    for level, (width, after) in enumerate(zip(widths, widths[1:])):
        layers += [Block(width, width, pooled and level == 0) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2), conv(width, after, bias=False)]
    return nn.Sequential(*layers, Block(widths[-1], widths[-1]), conv(widths[-1], 3 * p.patch_size ** 2))


def video_encoder(p: TAEParams) -> nn.Sequential:
    layers = [conv(3 * p.patch_size ** 2, 64), nn.ReLU()]
    for halves in p.time_downscale:
        layers += [TPool(64, 2 if halves else 1), conv(64, 64, stride=2, bias=False)]
        layers += [MemBlock(64, 64) for _ in range(3)]
    return nn.Sequential(*layers, conv(64, p.z_channels))


def video_decoder(p: TAEParams) -> nn.Sequential:
    widths = (256, 128, 64, 64)
    layers = [Clamp(), conv(p.z_channels, widths[0]), nn.ReLU()]
    for width, after, doubles in zip(widths, widths[1:], p.time_upscale):
        layers += [MemBlock(width, width) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2), TGrow(width, 2 if doubles else 1), conv(width, after, bias=False)]
    return nn.Sequential(*layers, nn.ReLU(), conv(widths[-1], 3 * p.patch_size ** 2))


# ============================================================================================
# The model
# ============================================================================================
class TinyAutoEncoder(Trainable, nn.Module):
    """A tiny autoencoder with ae.AutoEncoder's interface (params, downsample_factor, encode_moments, sample,
    posterior_std, encode, decode, forward(x, sample) -> (reconstruction, latent, None), set_grad_checkpointing) and
    its own answers (ae.Trainable). Images are (B, 3, H, W) in [-1, 1]; an hv model takes clips
    (B, 3, T, H, W) of 1 + t k frames, an image being a one-frame clip."""

    def __init__(self, params: TAEParams):
        super().__init__()
        self.params = params
        self.encoder = video_encoder(params) if params.video else image_encoder(params)
        self.decoder = video_decoder(params) if params.video else image_decoder(params)
        self.checkpointed: set[str] = set()  # which of "encoder", "decoder" run block by block under checkpoints
        self.grad_checkpointing = "none"

    @property
    def downsample_factor(self) -> int:
        return self.params.downsample_factor

    def set_grad_checkpointing(self, mode: str) -> None:
        """none; decoder_hr / decoder: every Block of the decoder recomputed in backward; hr / all: the encoder's too
        (the stacks have no levels worth telling apart: each Block is its own segment)."""
        if mode not in GRAD_CHECKPOINTING:
            raise ValueError(f"grad checkpointing must be one of {GRAD_CHECKPOINTING}, got {mode!r}")
        self.grad_checkpointing = mode
        self.checkpointed = {"none": set(), "decoder_hr": {"decoder"}, "decoder": {"decoder"},
                             "hr": {"encoder", "decoder"}, "all": {"encoder", "decoder"}}[mode]

    def encoder_side(self) -> list[tuple[str, nn.Module]]:
        """What computes the latent from pixels (what --train_parts decoder freezes)."""
        return [("encoder", self.encoder)]

    def last_layer(self) -> Tensor:
        """The decoder's last conv's weight (LDM's adaptive GAN weight)."""
        return self.decoder[-1].weight

    time_chunks_refusal = "a tiny autoencoder's clips run whole (its memory is a frame per block)"
    UNSHARDABLE = ("a tiny autoencoder (a few million parameters) fits on any GPU whole: train it under DDP (the "
                   "default --sharding ddp)")

    def unshardable(self) -> str:
        return self.UNSHARDABLE

    @property
    def temporal_factor(self) -> int:
        return self.params.temporal_factor

    def unused_parameters(self) -> bool:
        return False  # an image runs as a one-frame clip through every layer of a TAEHV

    def diffusion_latents(self, factors):
        return lambda z: z  # its latents are the diffusion model's already

    def latent_norm(self):
        return "released"

    def norm_label(self):
        return "none (the diffusion model's latents)"

    def serves(self):
        return ("a pipeline that hands its diffusion model's latents to the tiny decoder as they are (AutoencoderTiny: "
                "scaling_factor 1, shift_factor 0)")

    # ------------------------------------------------------------------------- running the stacks
    def _run(self, stack: nn.Sequential, x: Tensor, frames: int) -> Tensor:
        """x (N F, C, H, W) through a stack, `frames` F per clip (0: images); Blocks under checkpoints when set.
        A MemBlock reads its input shifted one frame later in time (zeros before each clip's first frame)."""
        name = "encoder" if stack is self.encoder else "decoder"
        use_checkpoint = name in self.checkpointed and torch.is_grad_enabled()
        for i, module in enumerate(stack):
            args = (x,)
            if isinstance(module, MemBlock):
                clips = x.unflatten(0, (-1, frames))
                args = (x, F.pad(clips, (0, 0, 0, 0, 0, 0, 1, 0))[:, :frames].flatten(0, 1))
            elif isinstance(module, TPool):
                frames //= module.stride
            elif isinstance(module, TGrow):
                frames *= module.stride
            last = stack is self.encoder and i == len(stack) - 1
            if last:  # the latent in fp32 whatever the autocast: it is what a diffusion model sees
                with torch.autocast(x.device.type, enabled=False):
                    x = module(x.float())
            elif use_checkpoint and isinstance(module, (Block, MemBlock)) and x.requires_grad:
                x = checkpoint(module, *args, use_reentrant=False)
            else:
                x = module(*args)
        return x

    def _clip_in(self, x: Tensor) -> tuple[Tensor, int, int]:
        """A clip (or an image: one frame) as the video stacks read it: (N T', C p^2, H/p, W/p) with T' padded at the
        end to a multiple of the temporal factor by repeating the last frame (as the released code); also N, T."""
        clip = x.unsqueeze(2) if x.dim() == 4 else x
        n, _, t = clip.shape[:3]
        frames = clip.transpose(1, 2)  # (N, T, C, H, W)
        short = -t % self.params.temporal_factor
        if short:
            frames = torch.cat([frames, frames[:, -1:].expand(-1, short, -1, -1, -1)], dim=1)
        frames = frames.flatten(0, 1)
        if self.params.patch_size > 1:
            frames = F.pixel_unshuffle(frames, self.params.patch_size)
        return frames, n, t + short

    # ------------------------------------------------------------------------- the interface
    def encode_moments(self, x: Tensor) -> tuple[Tensor, None]:
        """The latent (fp32) and no log-variance: the encoder is deterministic."""
        x01 = (x + 1) / 2
        if not self.params.video:
            if self.params.patch_size > 1:
                x01 = F.pixel_unshuffle(x01, self.params.patch_size)
            return self._run(self.encoder, x01, 0), None
        frames, n, t = self._clip_in(x01)
        z = self._run(self.encoder, frames, t).unflatten(0, (n, -1)).transpose(1, 2)  # (N, C, T/t, h, w)
        return (z.squeeze(2) if x.dim() == 4 else z), None

    def posterior_std(self, logvar: Tensor | None) -> float:
        return 0.0

    def sample(self, mean: Tensor, logvar: Tensor | None) -> Tensor:
        return mean.float()

    def encode(self, x: Tensor) -> Tensor:
        return self.encode_moments(x)[0]

    def decode(self, z: Tensor) -> Tensor:
        if not self.params.video:
            y = self._run(self.decoder, z, 0)
            if self.params.patch_size > 1:
                y = F.pixel_shuffle(y, self.params.patch_size)
            return y * 2 - 1
        clip = z.unsqueeze(2) if z.dim() == 4 else z
        n, latent_frames = clip.shape[0], clip.shape[2]
        y = self._run(self.decoder, clip.transpose(1, 2).flatten(0, 1), latent_frames)
        if self.params.patch_size > 1:
            y = F.pixel_shuffle(y, self.params.patch_size)
        y = y.unflatten(0, (n, -1))[:, self.params.temporal_factor - 1:].transpose(1, 2)  # the startup frames go
        return (y.squeeze(2) if z.dim() == 4 else y) * 2 - 1

    def forward(self, x: Tensor, sample: bool = True) -> tuple[Tensor, Tensor, None]:
        z, _ = self.encode_moments(x)
        return self.decode(z), z, None


# ============================================================================================
# Released layouts: reading
# ============================================================================================
def _read(path: str) -> dict[str, Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise LayoutError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
                          ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise LayoutError(f"{path}: not a state dict of tensors")
    return state


def _keys(path: str) -> list[str]:
    """A weights file's keys, without reading its tensors where the format allows."""
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(path, "pt") as f:
                return list(f.keys())
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return list(state) if isinstance(state, dict) else []
    except Exception:
        return []


def _sequential_keys(keys) -> bool:
    """Keys of a Sequential's state dict, as a released half has them ("0.weight", "3.conv.0.weight")."""
    keys = list(keys)
    return bool(keys) and all(re.match(r"^\d+\.", k) for k in keys)


def _combined_keys(keys) -> bool:
    """Keys of a whole TAE (TAEHV's files, our checkpoints' model state): encoder.N.* and decoder.N.*."""
    keys = list(keys)
    return (bool(keys) and all(re.match(r"^(encoder|decoder)\.\d+\.", k) for k in keys)
            and any(k.startswith("encoder.") for k in keys) and any(k.startswith("decoder.") for k in keys))


def pair_of(path: str) -> tuple[str, str] | None:
    """(encoder file, decoder file) a path names: either file of a NAME_encoder.pth / NAME_decoder.pth pair, the
    prefix NAME, or a folder holding exactly one pair. None: the path names no pair (maybe a single file). LayoutError
    for a half without its other half, or a folder of several pairs."""
    for suffix, other in ((ENCODER_SUFFIX, DECODER_SUFFIX), (DECODER_SUFFIX, ENCODER_SUFFIX)):
        if path.endswith(suffix) and os.path.isfile(path):
            twin = path[: -len(suffix)] + other
            if not os.path.isfile(twin):
                half = "encoder" if suffix == ENCODER_SUFFIX else "decoder"
                raise LayoutError(f"{path}: a tiny autoencoder's {half} without its other half: "
                                  f"{os.path.basename(twin)} is not beside it (a TAE is a pair NAME{ENCODER_SUFFIX} + "
                                  f"NAME{DECODER_SUFFIX})")
            return (path, twin) if suffix == ENCODER_SUFFIX else (twin, path)
    if not os.path.isdir(path) and os.path.isfile(path + ENCODER_SUFFIX) != os.path.isfile(path + DECODER_SUFFIX):
        return pair_of(path + (ENCODER_SUFFIX if os.path.isfile(path + ENCODER_SUFFIX) else DECODER_SUFFIX))
    if not os.path.isdir(path) and os.path.isfile(path + ENCODER_SUFFIX):
        return path + ENCODER_SUFFIX, path + DECODER_SUFFIX
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        halves = sorted(glob.glob(os.path.join(glob.escape(path), "*" + ENCODER_SUFFIX))
                        + glob.glob(os.path.join(glob.escape(path), "*" + DECODER_SUFFIX)))
        names = sorted({h[: -len(ENCODER_SUFFIX)] for h in halves})
        if len(names) > 1:
            listed = ", ".join(os.path.basename(n) for n in names)
            raise LayoutError(f"{path}: a folder of several tiny autoencoders ({listed}): name one (FOLDER/NAME or "
                              f"its NAME{ENCODER_SUFFIX})")
        if names:
            return pair_of(halves[0])
    return None


def single_file_in(path: str) -> str | None:
    """The one .pth/.safetensors of a whole TAE (encoder.* and decoder.* keys) that a folder without a config.json
    holds, or the file itself."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        files = [f for ext in ("*.pth", "*.safetensors") for f in glob.glob(os.path.join(glob.escape(path), ext))]
        whole = [f for f in sorted(files) if _combined_keys(_keys(f))]
        if len(whole) == 1:
            return whole[0]
    return None


def recognises(path: str) -> bool:
    """Whether a path is a tiny autoencoder in a released layout (the pair, or a whole TAE's single file, or a folder
    of one of those): the registry asks before the other families' readers. A half without its other half is
    recognised (loading it says what is missing)."""
    if path.endswith((ENCODER_SUFFIX, DECODER_SUFFIX)) and os.path.isfile(path):
        return True
    if not os.path.isdir(path) and (os.path.isfile(path + ENCODER_SUFFIX) or os.path.isfile(path + DECODER_SUFFIX)):
        return True
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        try:
            if pair_of(path) is not None:
                return True
        except LayoutError:
            return True
        return single_file_in(path) is not None
    if os.path.isfile(path) and path.endswith((".pth", ".pt", ".safetensors")):
        keys = _keys(path)
        return _combined_keys(keys) or _sequential_keys(keys)
    return False


def _indices(state: dict[str, Tensor]) -> dict[int, set[str]]:
    """{layer index: the names under it} of a Sequential's state dict."""
    layers: dict[int, set[str]] = {}
    for key in state:
        index, _, rest = key.partition(".")
        layers.setdefault(int(index), set()).add(rest)
    return layers


def params_of(encoder: dict[str, Tensor], decoder: dict[str, Tensor], where: str) -> TAEParams:
    """The architecture two Sequentials' state dicts describe (the variant from what they hold); LayoutError (one line)
    naming the layouts read for anything else."""
    not_tae = LayoutError(f"{where}: not a tiny autoencoder of a layout read here ({RELEASED_VARIANTS})")
    if not (_sequential_keys(encoder) and _sequential_keys(decoder)):
        raise not_tae
    enc, dec = _indices(encoder), _indices(decoder)
    first = encoder.get("0.weight")
    last = encoder.get(f"{max(enc)}.weight")
    if first is None or last is None or first.dim() != 4 or last.dim() != 4:
        raise not_tae
    z = last.shape[0]
    mem = any(k.startswith("conv.0.") for names in enc.values() for k in names) and any(
        encoder[f"{i}.conv.0.weight"].shape[1] == 2 * encoder[f"{i}.conv.0.weight"].shape[0]
        for i, names in enc.items() if "conv.0.weight" in names)
    if mem:  # TAEHV: TPools before the strided convs, TGrows in the decoder
        # (in layer order: a safetensors file lists its keys sorted as strings, "10." before "2.")
        pools = sorted(i for i, names in enc.items()
                       if names == {"conv.weight"} and encoder[f"{i}.conv.weight"].shape[2] == 1)
        grows = sorted(i for i, names in dec.items()
                       if names == {"conv.weight"} and decoder[f"{i}.conv.weight"].shape[2] == 1)
        if len(pools) != 3 or len(grows) != 3:
            raise not_tae
        down = tuple(encoder[f"{i}.conv.weight"].shape[1] // encoder[f"{i}.conv.weight"].shape[0] == 2 for i in pools)
        up = tuple(decoder[f"{i}.conv.weight"].shape[0] // decoder[f"{i}.conv.weight"].shape[1] == 2 for i in grows)
        patch = round((first.shape[1] / 3) ** 0.5)
        params = TAEParams(z, "hv", patch, down, up)
    elif first.shape[0] == 32 and first.shape[1] == 3:
        params = TAEParams(z, "f32")
    else:
        pooled = any("pool.0.weight" in names for names in enc.values())
        patch = round((first.shape[1] / 3) ** 0.5)
        params = TAEParams(z, "flux_2" if pooled else "f8", patch)
    model = TinyAutoEncoder(params)
    for half, state, module in (("encoder", encoder, model.encoder), ("decoder", decoder, model.decoder)):
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if expected != got:
            wrong = sorted(set(expected) ^ set(got)) or [k for k in expected if expected[k] != got[k]]
            raise LayoutError(f"{where}: a {params.variant} tiny autoencoder's {half} of another layout "
                              f"({wrong[0]}{' ...' if len(wrong) > 1 else ''}); layouts read: {RELEASED_VARIANTS}")
    return params


def split_combined(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    halves = ({}, {})
    for key, value in state.items():
        half, _, rest = key.partition(".")
        halves[half == "decoder"][rest] = value
    return halves


TINY_STANDARD = {"encoder_block_out_channels": [64] * 4, "decoder_block_out_channels": [64] * 4,
                 "num_encoder_blocks": [1, 3, 3, 3], "num_decoder_blocks": [3, 3, 3, 1], "act_fn": "relu",
                 "upsample_fn": "nearest", "upsampling_scaling_factor": 2, "in_channels": 3, "out_channels": 3}


def tiny_differences(config: dict) -> list[str]:
    """The fields in which a diffusers AutoencoderTiny config is not TAESD's layout (the ones this family reads)."""
    return [k for k, v in TINY_STANDARD.items()
            if k in config and (list(config[k]) if isinstance(v, list) else config[k]) != v]


def diffusers_tiny_halves(path: str, config: dict, state: dict[str, Tensor]
                          ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A diffusers AutoencoderTiny's state dict in the released halves' names: encoder.layers.N -> N, decoder.layers.N
    -> N + 1 (the released decoder's 0 is its parameter-free clamp, which diffusers' forward applies itself).
    LayoutError for a config of another layout (the diffusers family trains those through diffusers' module)."""
    other = tiny_differences(config)
    if other:
        raise LayoutError(f"{path}: an AutoencoderTiny of another layout than TAESD's ({', '.join(other)}): train it "
                          "with --vae_family diffusers (through diffusers' own module)")
    encoder, decoder = {}, {}
    for key, value in state.items():
        match = re.match(r"^(encoder|decoder)\.layers\.(\d+)\.(.*)$", key)
        if not match:
            raise LayoutError(f"{path}: an AutoencoderTiny whose weights hold {key}")
        half, index, rest = match.groups()
        if half == "encoder":
            encoder[f"{index}.{rest}"] = value
        else:
            decoder[f"{int(index) + 1}.{rest}"] = value
    return encoder, decoder


@dataclass
class Loaded:
    """A released tiny autoencoder read: its architecture, the model's state dict (fp32), where each half came
    from, the layout ("pair", "single_file", "diffusers") and the latent factors a diffusers config carried."""
    params: TAEParams
    state: dict[str, Tensor]
    layout: str
    files: tuple[str, ...]
    factors: dict


def load(path: str) -> Loaded:
    """A tiny autoencoder from any layout read here (module docstring). LayoutError: one line."""
    factors = {"scaling_factor": 1.0, "shift_factor": 0.0, "latents_mean": None, "latents_std": None}
    pair = pair_of(path)
    if pair is not None:
        encoder, decoder = (_read(f) for f in pair)
        params = params_of(encoder, decoder, pair[0] if pair[0] == path else path)
        layout, files = "pair", pair
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        weights = os.path.join(path, "diffusion_pytorch_model.safetensors")
        if config.get("_class_name") != AUTOENCODER_TINY or not os.path.isfile(weights):
            raise LayoutError(f"{path}: not a diffusers {AUTOENCODER_TINY} folder (config.json and "
                              "diffusion_pytorch_model.safetensors)")
        encoder, decoder = diffusers_tiny_halves(path, config, _read(weights))
        params = params_of(encoder, decoder, path)
        layout, files = "diffusers", (weights,)
        factors.update(scaling_factor=float(config.get("scaling_factor") or 1.0),
                       shift_factor=float(config.get("shift_factor") or 0.0))
    else:
        single = single_file_in(path)
        if single is None:
            raise LayoutError(f"{path}: no tiny autoencoder here (a NAME{ENCODER_SUFFIX} + NAME{DECODER_SUFFIX} pair, "
                              "a whole TAE's .pth/.safetensors, or a folder of one of them)")
        state = _read(single)
        if _sequential_keys(state):
            raise LayoutError(f"{single}: one half of a tiny autoencoder without its name: a released pair is "
                              f"NAME{ENCODER_SUFFIX} + NAME{DECODER_SUFFIX}")
        if not _combined_keys(state):
            raise LayoutError(f"{single}: not a tiny autoencoder of a layout read here ({RELEASED_VARIANTS})")
        encoder, decoder = split_combined(state)
        params = params_of(encoder, decoder, single)
        layout, files = "single_file", (single,)
    state = {f"encoder.{k}": v.float() for k, v in encoder.items()}
    state.update({f"decoder.{k}": v.float() for k, v in decoder.items()})
    return Loaded(params, state, layout, files, factors)


# ============================================================================================
# Released layouts: writing
# ============================================================================================
def write_released(vae: TinyAutoEncoder, out_dir: str, name: str = "tae", dtype: torch.dtype = torch.float32
                   ) -> list[str]:
    """The released layout: an image TAE as the pair OUT/NAME_encoder.pth + OUT/NAME_decoder.pth (each a Sequential's
    state dict, what the released code and ComfyUI load), an hv TAE as OUT/NAME.pth (encoder.* and decoder.*, as
    TAEHV's files). fp32 unless `dtype` (the released files are fp16). Returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in vae.state_dict().items()}
    if vae.params.video:
        files = {os.path.join(out_dir, name + ".pth"): state}
    else:
        encoder, decoder = split_combined(state)
        files = {os.path.join(out_dir, name + ENCODER_SUFFIX): encoder,
                 os.path.join(out_dir, name + DECODER_SUFFIX): decoder}
    for path, tensors in files.items():
        tmp = path + ".tmp"
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    return list(files)


def diffusers_unfit(params: TAEParams) -> str:
    """Why diffusers' AutoencoderTiny cannot hold this architecture ("": it can)."""
    if params.variant != "f8" or params.patch_size != 1:
        return (f"diffusers' {AUTOENCODER_TINY} has TAESD's f8 layout only, not {params.describe()}: export it with "
                "--format released (the layout the released code and ComfyUI read)")
    return ""


def diffusers_config(params: TAEParams, scaling_factor: float = 1.0, shift_factor: float = 0.0) -> dict:
    return {"in_channels": 3, "out_channels": 3, "encoder_block_out_channels": [64] * 4,
            "decoder_block_out_channels": [64] * 4, "act_fn": "relu", "upsample_fn": "nearest",
            "latent_channels": params.z_channels, "upsampling_scaling_factor": 2,
            "num_encoder_blocks": [1, 3, 3, 3], "num_decoder_blocks": [3, 3, 3, 1],
            "latent_magnitude": LATENT_MAGNITUDE, "latent_shift": LATENT_SHIFT, "force_upcast": False,
            "scaling_factor": scaling_factor, "shift_factor": shift_factor}


def write_diffusers(vae: TinyAutoEncoder, out_dir: str, scaling_factor: float = 1.0, shift_factor: float = 0.0
                    ) -> None:
    """A diffusers AutoencoderTiny folder (ValueError: one line, where the architecture is not one it has), its
    weights loaded strictly into diffusers' class before save_pretrained."""
    why = diffusers_unfit(vae.params)
    if why:
        raise ValueError(why)
    from diffusers import AutoencoderTiny
    model = AutoencoderTiny(**diffusers_config(vae.params, scaling_factor, shift_factor))
    encoder, decoder = split_combined({k: v.detach().cpu().float() for k, v in vae.state_dict().items()})
    state = {f"encoder.layers.{k}": v for k, v in encoder.items()}
    for key, value in decoder.items():
        index, _, rest = key.partition(".")
        state[f"decoder.layers.{int(index) - 1}.{rest}"] = value
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
