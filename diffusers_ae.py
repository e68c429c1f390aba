"""diffusers' own autoencoders as this trainer's models: the `diffusers` family of families.py. Any class below
trains through the module diffusers keeps (no reimplementation), with ae.AutoEncoder's interface:

    vae = DiffusersAutoEncoder(DiffusersParams.of("AutoencoderKLLTXVideo", config))
    recon, mean, logvar = vae(clip)          # (B, 3, T, H, W) in [-1, 1]; an image is (B, 3, H, W)

What the wrapper does around diffusers' module (`vae.model`, whose state dict is ours under "model."):
- The posterior: `encode(x).latent_dist`'s mean and log-variance (diffusers' DiagonalGaussianDistribution, its
  clamp), sampled here in fp32 from the global generator (the trainer seeds it per micro-batch). A class without
  a posterior (IdentityDistribution, AutoencoderDC's `latent`) is deterministic: z = mean and no KL term
  (--posterior none).
- Images and clips: a video class takes (B, C, T, H, W); an image given to it is a one-frame clip (the causal
  classes encode a first frame on its own). An image class takes (B, C, H, W).
- Training and inference decode differently, as diffusers' own classes do: in eval mode the class's own plan
  (its tiling, frame batching and caches, as constructed: what its pipelines run); in training mode the whole clip
  in one pass (`ClassSpec.whole_clip`: tiling and frame batching off), whose gradient is the clip's own. Where a
  class cannot turn its frame batching off, its cache is reset at each call and carries gradients (tested against
  the whole clip where the class allows one).
- Gradient checkpointing: the class's own (`enable_gradient_checkpointing`), on the decoder's modules only for the
  decoder modes; a class without it (ClassSpec.checkpointing False) runs none (families.py refuses the flag).
- What the class keeps besides weights: its config (every field, save_pretrained writes it back) and buffers such as
  LTX's latents_mean/latents_std (state dict entries, kept or re-estimated by the export, never trained).

Compression and clip rule are measured, not assumed: the module is built on the meta device and a clip encoded
and decoded there (`measure`): the spatial factor, the temporal factor t (clips of 1 + t k frames decode back to
their length) and the latent channels. The table CLASSES says, per class, what cannot be measured: its encoder
side (what --train_parts decoder freezes), its frame batching, how its pipelines normalise latents, what it takes.
REFUSED says, per class, why it does not train here (one line). Adding a class is an entry and its tiny test
config (tests/test_families.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

from ae import LOGVAR_RANGE, Trainable, posterior_noise
from latents import per_channel


class Unfit(ValueError):
    """A class, config or folder this family cannot train: the message is one line."""


@dataclass(frozen=True)
class Norm:
    """How a class's pipelines normalise latents, and where the statistics live: `scale` (scaling_factor = 1 / the
    latents' RMS: z' = z * scaling_factor), `scale_shift` (z' = (z - shift_factor) * scaling_factor), `channels`
    (config latents_mean / latents_std per channel), `buffers` (the same in the model's latents_mean / latents_std
    buffers: LTX), `frames` (per channel and latent frame: Cosmos), or `none` (no pipeline: nothing to write)."""
    kind: str
    formula: str


SCALE = Norm("scale", "z * scaling_factor")
SCALE_SHIFT = Norm("scale_shift", "(z - shift_factor) * scaling_factor")
CHANNELS = Norm("channels", "(z - latents_mean) / latents_std per channel")
CHANNELS_SCALED = Norm("channels", "(z - latents_mean) * scaling_factor / latents_std per channel")
BUFFERS = Norm("buffers", "(z - vae.latents_mean) * scaling_factor / vae.latents_std per channel (buffers)")
FRAMES = Norm("frames", "(z - latents_mean[c, t]) * sigma_data / latents_std[c, t] per channel and latent frame")
NO_NORM = Norm("none", "no diffusers pipeline")


def ltx_decode_timestep(config: dict, z: Tensor) -> dict:
    """A timestep-conditioned LTX decoder (LTX-Video 0.9.1 and later) at its pipelines' default decode_timestep, 0
    (where they add no noise to the latents)."""
    return {"temb": torch.zeros(z.shape[0], device=z.device)} if config.get("timestep_conditioning") else {}


@dataclass(frozen=True)
class ClassSpec:
    """What the generic family needs to know of one diffusers class beyond what `measure` reads off it."""
    norm: Norm
    clip_input: bool = True  # the module reads (B, C, T, H, W); an image is a one-frame clip. False: (B, C, H, W)
    clips: bool = True  # it trains on clips (1 + t k frames); False: images only
    frames_in_batch: bool = False  # a clip's frames go through as a batch of images, decode(z, num_frames=T) (SVD)
    encoder_side: tuple[str, ...] = ("encoder", "quant_conv")  # what computes the posterior (those it has)
    training_plan: dict = field(default_factory=dict)  # attribute -> value in training mode (tiling, frame batching)
    fixed: dict = field(default_factory=dict)  # attribute -> value in both modes (what it cannot run without)
    checkpointing: bool | None = None  # None: the class's _supports_gradient_checkpointing; False: not exact here
    pixel_channels: int = 3  # the channels its encoder reads: 4 for RGBA (an alpha of 1 is added, dropped after)
    decode_kwargs: Callable[[dict, Tensor], dict] | None = None  # what its pipelines pass to decode beside z
    note: str = ""  # what the docs' table says of it
    unshardable: str = ""  # why --sharding fsdp|hsdp refuses it (tests/sharded_families.py); "": it shards

    def supports_checkpointing(self, class_name: str) -> bool:
        if self.checkpointing is not None:
            return self.checkpointing
        return bool(getattr(diffusers_class(class_name), "_supports_gradient_checkpointing", False))


TILING_OFF = {"use_tiling": False, "use_slicing": False}
FRAMEWISE_OFF = {**TILING_OFF, "use_framewise_encoding": False, "use_framewise_decoding": False}

# The classes that train through their own module. The native families (families.py) read AutoencoderKL,
# AutoencoderKLQwenImage and AutoencoderKLWan by default; they train here too with --vae_family diffusers (bench.py
# compares the two paths).
CLASSES: dict[str, ClassSpec] = {
    "AutoencoderKLLTXVideo": ClassSpec(BUFFERS, training_plan=FRAMEWISE_OFF,
                                       decode_kwargs=ltx_decode_timestep,
                                       note="a timestep-conditioned decoder (0.9.1+) trains at decode_timestep 0"),
    "AutoencoderKLLTX2Video": ClassSpec(BUFFERS, training_plan=FRAMEWISE_OFF,
                                        decode_kwargs=ltx_decode_timestep),
    "AutoencoderKLHunyuanVideo": ClassSpec(
        SCALE, training_plan=FRAMEWISE_OFF,
        note="trains on whole clips; its inference tiles clips of more than 16 frames in time (a different result)"),
    "AutoencoderKLHunyuanVideo15": ClassSpec(
        SCALE, training_plan={"use_tiling": False}, fixed={"use_slicing": True},
        note="encodes and decodes a batch one clip at a time (use_slicing: its attention mask fails on batches)"),
    "AutoencoderKLCogVideoX": ClassSpec(
        SCALE, training_plan=TILING_OFF,
        note="trains through its own frame batches (8 frames, 2 latent frames) and their conv cache, as it infers"),
    "AutoencoderKLMochi": ClassSpec(CHANNELS_SCALED, training_plan=FRAMEWISE_OFF),
    "AutoencoderKLCosmos": ClassSpec(FRAMES, training_plan=FRAMEWISE_OFF),
    "AutoencoderKLMagvit": ClassSpec(SCALE, training_plan=FRAMEWISE_OFF, checkpointing=False),
    "AutoencoderKLHunyuanImageRefiner": ClassSpec(SCALE, training_plan=TILING_OFF),
    "Kandinsky6SRVAE": ClassSpec(SCALE, checkpointing=False),
    "AutoencoderKLTemporalDecoder": ClassSpec(SCALE, clip_input=False, frames_in_batch=True),
    "AutoencoderKLQwenImage21": ClassSpec(CHANNELS, clips=False, training_plan=TILING_OFF, pixel_channels=4,
                                          note="RGBA: the images get an alpha of 1; the decoded alpha is not trained"),
    "AutoencoderKLHunyuanImage": ClassSpec(SCALE, clip_input=False, clips=False,
                                           training_plan=TILING_OFF),
    "AutoencoderKLKVAE": ClassSpec(NO_NORM, clip_input=False, clips=False,
                                   training_plan=TILING_OFF),
    "AutoencoderDC": ClassSpec(SCALE, clip_input=False, clips=False,
                               training_plan=TILING_OFF),
    "AutoencoderTiny": ClassSpec(SCALE_SHIFT, clip_input=False, clips=False,
                                 training_plan=TILING_OFF, checkpointing=False),
    "AutoencoderKLWan": ClassSpec(CHANNELS, training_plan=TILING_OFF, unshardable=(
        "sharded by FSDP2 its time_convs' gradients are lost (tests/sharded_families.py); the native Wan family, "
        "this class's default, shards with the right gradients")),
    "AutoencoderKLQwenImage": ClassSpec(CHANNELS, training_plan=TILING_OFF),
    "AutoencoderKL": ClassSpec(SCALE_SHIFT, clip_input=False, clips=False, training_plan=TILING_OFF),
}

# diffusers' autoencoders that do not train here, each with why (one line; docs/families.md's table). Measured with
# tiny random configs on diffusers 0.42.1.
REFUSED: dict[str, str] = {
    "AutoencoderKLAllegro": "it encodes and decodes only in tiles of 24 frames x 320 px (untiled, diffusers raises "
                            "NotImplementedError), and no clip length decodes back to its own",
    "AutoencoderKLMiniMaxH3": "its clips are 17 n + 5 frames of ImageNet-normalised pixels, tiled by default: not a "
                              "clip of 1 + t k frames in [-1, 1]",
    "AutoencoderKLKVAEVideo": "its cached segments of 17 and 16 frames decode a clip of 21 frames to 18, and its "
                              "gradient checkpointing recomputes through a cache the first pass mutated",
    "AutoencoderVidTok": "it decodes a clip to fewer frames than it encoded (9 -> 5): no length round-trips",
    "AsymmetricAutoencoderKL": "its decoder is conditioned on the masked image and mask (inpainting): an unconditioned "
                               "fine-tune would not train what its pipelines run",
    "ConsistencyDecoderVAE": "its decoder is a diffusion model (consistency decoding), not a reconstruction",
    "VQModel": "a quantised autoencoder (a codebook, no KL posterior)",
    "AutoencoderRAE": "a representation autoencoder: a frozen foundation encoder (DINOv2) without a posterior",
    "LTX2VideoDiffusionDecoderModel": "a diffusion decoder for LTX-2's latents, not an autoencoder",
    "AutoencoderKLKVAEAudio": "an audio autoencoder", "AutoencoderKLLTX2Audio": "an audio autoencoder",
    "AutoencoderKLMiniMaxH3Audio": "an audio autoencoder", "AutoencoderOobleck": "an audio autoencoder",
    "Cosmos3AVAEAudioTokenizer": "an audio autoencoder", "LongCatAudioDiTVae": "an audio autoencoder",
    "MMAudioVAE": "an audio autoencoder", "AutoencoderSAME": "an audio autoencoder",
    "MMAudioVocoder": "an audio vocoder", "MiniMaxMusic3Vocoder": "an audio vocoder",
    "RFD4ProteinaAutoencoder": "a protein structure autoencoder",
}


def refusal(class_name: str) -> str:
    """Why a diffusers folder of `class_name` does not train here (the end of a one-line error)."""
    return REFUSED.get(class_name, "not an image or video autoencoder this trainer reads")


def diffusers_class(class_name: str) -> type:
    import diffusers
    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise Unfit(f"{class_name} is not in the installed diffusers {diffusers.__version__}: pip install -U diffusers")
    return cls


# ============================================================================================
# The architecture: the class, its config, and what was measured of it
# ============================================================================================
@dataclass
class DiffusersParams:
    """A diffusers class and its config (every field, as its folder's config.json has it), with what `measure` read
    off the module: the latent channels, the spatial and temporal compression (0: an image class), the posterior
    ("learned" or "none": deterministic), and the width of its first convolution (the learning rate's rule)."""
    class_name: str
    config: dict
    z_channels: int = 0
    spatial_factor: int = 0
    temporal_factor: int = 0
    posterior: str = "learned"
    width: int = 0
    takes_images: bool = True  # an image (a video class's one-frame clip) decodes back to itself

    family: ClassVar[str] = "diffusers"
    in_channels: ClassVar[int] = 3  # the trainer's images: RGB (a class that reads RGBA gets an alpha of 1)
    out_ch: ClassVar[int] = 3

    @property
    def downsample_factor(self) -> int:
        return self.spatial_factor

    @property
    def spec(self) -> ClassSpec:
        return CLASSES[self.class_name]

    def describe(self) -> str:
        return f"diffusers' {self.class_name}"

    def to_dict(self) -> dict:
        return {"family": self.family, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "DiffusersParams":
        return cls(**{k: v for k, v in d.items() if k != "family"})

    @classmethod
    def of(cls, class_name: str, config: dict) -> "DiffusersParams":
        """The params of a class and config, measured (Unfit: one line for a class or config that cannot train)."""
        if class_name not in CLASSES:
            raise Unfit(f"a {class_name}: {refusal(class_name)}")
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        return cls(class_name, config, **measure(class_name, config))


def _module(class_name: str, config: dict) -> nn.Module:
    try:
        with quiet_diffusers():  # (diffusers logs the config keys a class does not take)
            return diffusers_class(class_name).from_config(config)
    except Unfit:
        raise
    except Exception as e:  # a config the class cannot build
        raise Unfit(f"its config does not build a {class_name} ({type(e).__name__}: {str(e).splitlines()[0][:160]})")


def measure(class_name: str, config: dict) -> dict:
    """What a class computes, measured on the meta device (shapes only, no weights, in its training plan): the
    latent channels, the spatial factor, the temporal factor t (0 for images only: the smallest t whose clips of
    1 + t, 1 + 2t and 1 + 3t frames decode back to their length), the posterior, the first convolution's width.
    Measured in a forked child where the OS can fork: PyTorch 2.14 leaves state behind after some meta-device
    forwards that fail (a clip length a class cannot take) such that later CPU ops of other modules dispatch to
    meta kernels (seen: Cosmos's wavelet after Mochi's probes); the child takes it with it. Unfit: one line."""
    key = (class_name, json.dumps(config, sort_keys=True, default=str))
    if key not in _MEASURED:
        _MEASURED[key] = _measure_forked(class_name, config) if hasattr(os, "fork") else _measure(class_name, config)
    return dict(_MEASURED[key])


_MEASURED: dict[tuple[str, str], dict] = {}  # (class, config) -> what measure read: a pure function of them


def _measure_forked(class_name: str, config: dict) -> dict:
    diffusers_class(class_name)  # imported here, once, not in every child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, and leave without running the parent's exit handlers
        os.close(read)
        try:
            result = {"measured": _measure(class_name, config)}
        except Unfit as e:
            result = {"unfit": str(e)}
        except BaseException as e:  # noqa: BLE001 (whatever it was, the parent reports it)
            result = {"unfit": f"measuring it failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"}
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(result))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    result = json.loads(text) if text else {"unfit": "measuring it ended without a result"}
    if "unfit" in result:
        raise Unfit(result["unfit"])
    return result["measured"]


def _measure(class_name: str, config: dict) -> dict:
    spec, size = CLASSES[class_name], 256  # (divisible by every class's spatial compression, at most 64)

    def built() -> DiffusersAutoEncoder:  # in training mode (its training plan); a fresh one for every probe: a
        # call that failed may leave a model unusable (Magvit's caches)
        return DiffusersAutoEncoder(DiffusersParams(class_name, config)).to("meta")  # (buffers made on the CPU)

    def latent_frames(frames: int) -> int:
        try:
            return built().encode(torch.empty(1, 3, frames, size, size)).shape[2]
        except (RuntimeError, ValueError, IndexError, TypeError):
            return 0

    def round_trips(frames: int) -> bool:
        try:
            model = built()
            return model.decode(model.encode(torch.empty(1, 3, frames, size, size))).shape[2] == frames
        except (RuntimeError, ValueError, IndexError, TypeError):  # a length the class cannot take at all
            return False
    try:
        with torch.device("meta"), torch.no_grad():  # (tensors a forward makes without a device are meta too)
            model = built()
            mean, logvar = model.encode_moments(torch.empty(1, 3, size, size))  # an image
            try:
                takes_images = built().decode(mean).shape[-1] == size
            except (RuntimeError, ValueError, IndexError, TypeError):
                takes_images = False
            temporal = 0
            if spec.clips:  # the candidates: what a long clip's latent frames suggest first, then every t
                long = latent_frames(1 + 48)
                first = [48 // (long - 1) * m for m in (1, 2, 3)] if long > 1 and 48 % (long - 1) == 0 else []
                temporal = next((t for t in first + list(range(1, 17)) if all(
                    round_trips(1 + k * t) for k in (1, 2, 3))), -1)
    except Unfit:
        raise
    except Exception as e:
        raise Unfit(f"its config does not run in {class_name} ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:120]})") from None
    if temporal < 0:
        raise Unfit(f"no clip of 1 + t k frames (t up to 16) decodes back to its length in {class_name}")
    width = next((m.out_channels for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))), 0)
    if not temporal and not takes_images:
        raise Unfit(f"an image does not decode back to its size in {class_name}, and it takes no clips")
    return dict(z_channels=mean.shape[1], spatial_factor=size // mean.shape[-1], temporal_factor=temporal,
                posterior="learned" if logvar is not None else "none", width=width, takes_images=takes_images)


def last_run_layer(params: DiffusersParams) -> str:
    """The name (in the diffusers module) of the last module with a weight matrix or kernel that the decoder runs, read
    by forward hooks on a decode of the class's latent on the meta device, in training mode as the trainer decodes."""
    with torch.device("meta"), torch.no_grad():
        model = DiffusersAutoEncoder(params).to("meta")
        ran = []
        for name, module in model.model.decoder.named_modules(prefix="decoder"):
            if isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() > 1:
                module.register_forward_hook(lambda *_, name=name: ran.append(name))
        frames = 1 + params.temporal_factor if params.temporal_factor and not params.takes_images else 0
        size = 2 * params.spatial_factor
        model.decode(model.encode(torch.empty(1, 3, *((frames,) if frames else ()), size, size)))
    return ran[-1]


def _posterior(out) -> tuple[Tensor, Tensor | None]:
    """(mean, log-variance or None: deterministic) of what a class's encode returned."""
    dist = getattr(out, "latent_dist", None)
    if dist is None:  # AutoencoderDC: EncoderOutput(latent=...); AutoencoderTiny: AutoencoderTinyOutput(latents=...)
        return getattr(out, "latent", None) if hasattr(out, "latent") else out.latents, None
    if hasattr(dist, "logvar"):  # DiagonalGaussianDistribution (its clamp of the log-variance)
        return dist.mean, dist.logvar.clamp(*LOGVAR_RANGE)
    return dist.mode(), None  # IdentityDistribution (Cosmos)


# ============================================================================================
# The model
# ============================================================================================
class DiffusersAutoEncoder(Trainable, nn.Module):
    """A diffusers autoencoder with ae.AutoEncoder's interface (params, downsample_factor, encode_moments, sample,
    posterior_std, encode, decode, forward(x, sample) -> (reconstruction, mean, logvar), set_grad_checkpointing),
    its own answers (ae.Trainable: encoder_side, last_layer, its normalisation, ...) and save_pretrained."""

    def __init__(self, params: DiffusersParams):
        super().__init__()
        self.params = params
        self.spec = params.spec
        self.model = _module(params.class_name, params.config)
        for name, value in self.spec.fixed.items():
            setattr(self.model, name, value)
        self.grad_checkpointing = "none"
        self._last_layer = ""  # (last_layer's module, found on first use)
        # the class's inference plan as constructed (eval mode); the training plan in training mode
        self.inference_plan = {k: getattr(self.model, k) for k in self.spec.training_plan if hasattr(self.model, k)}
        self.train()

    @property
    def downsample_factor(self) -> int:
        return self.params.spatial_factor

    def train(self, mode: bool = True) -> "DiffusersAutoEncoder":
        super().train(mode)
        for name, inference in self.inference_plan.items():
            setattr(self.model, name, self.spec.training_plan[name] if mode else inference)
        return self

    def set_grad_checkpointing(self, mode: str) -> None:
        """none; decoder_hr / decoder: the class's own checkpointing on its decoder side; hr / all: everywhere (a
        class checkpoints per block, not per resolution level)."""
        if mode != "none" and not self.spec.supports_checkpointing(self.params.class_name):
            raise ValueError(f"{self.params.class_name} has no exact gradient checkpointing here")
        self.grad_checkpointing = mode
        if mode == "none":
            self.model.disable_gradient_checkpointing()
            return
        self.model.enable_gradient_checkpointing()
        if mode in ("decoder_hr", "decoder"):
            for _, module in self.encoder_side():
                for sub in module.modules():
                    if hasattr(sub, "gradient_checkpointing"):
                        sub.gradient_checkpointing = False

    def encoder_side(self) -> list[tuple[str, nn.Module]]:
        return [(name, getattr(self.model, name)) for name in self.spec.encoder_side
                if isinstance(getattr(self.model, name, None), nn.Module)]

    def last_layer(self) -> Tensor:
        """The weight of the last layer the decoder runs (LDM's adaptive GAN weight: each loss's gradient there).
        The last one *registered* is not always it (Mochi's decoder ends in a Linear, proj_out, after the
        convolutions of its last block), so hooks on a decode find it, once, on the meta device (no memory, no
        arithmetic)."""
        if not self._last_layer:
            self._last_layer = last_run_layer(self.params)
        return self.model.get_submodule(self._last_layer).weight

    # Its other answers (ae.Trainable). What diffusers' own modules allow instead of a chunk plan: their per-block
    # gradient checkpointing (--grad_checkpointing, where the class has it). Their chunked paths (use_tiling,
    # use_framewise_encoding/decoding, AutoencoderKLWan's feat_cache) are inference plans: tiles blend overlaps (not
    # the clip's own gradient), and the caches are module state a chunk's recomputation in backward would overwrite,
    # so a checkpointed chunk would not get its gradient
    time_chunks_refusal = ("its chunked paths (tiling, framewise, its feature cache) are diffusers' inference plans, "
                           "with the cache as module state that a checkpointed chunk's recomputation would overwrite; "
                           "use --grad_checkpointing (its own per-block checkpointing) or --vae_family wan for the "
                           "Wan VAEs")

    @property
    def temporal_factor(self) -> int:
        return self.params.temporal_factor

    def takes_images(self) -> bool:
        return self.params.takes_images

    def unused_parameters(self) -> bool:
        return True  # which parameters a step leaves without a gradient is the class's business (Qwen-Image 2's
        # time_convs never run on its one-frame clips; a video class's temporal layers on an image step)

    def can_checkpoint(self) -> bool:
        return self.spec.supports_checkpointing(self.params.class_name)

    def unshardable(self) -> str:
        return self.spec.unshardable

    def diffusion_latents(self, factors):
        return self.normalise_latents

    def source_fields(self, source):
        return self.normalisation()

    def fields_from_stats(self, stats):
        return self.normalisation_from_stats(stats)

    def norm_label(self):
        return self.spec.norm.kind

    def serves(self):
        return f"{self.params.class_name}'s pipelines ({self.spec.norm.formula})"

    # ------------------------------------------------------------------------- images, clips and pixels
    def _in(self, x: Tensor) -> tuple[Tensor, int]:
        """x as the module reads it, and the frames of the clip (0: x is an image): an image made a one-frame clip for
        a module that reads clips, a clip's frames a batch for one that reads images (SVD's), an alpha of 1 added for
        a module that reads RGBA."""
        frames = x.shape[2] if x.dim() == 5 else 0
        if frames and not self.spec.clips:
            raise ValueError(f"a clip given to {self.params.class_name}, which takes images")
        if self.spec.pixel_channels == 4:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        if self.spec.clip_input and not frames:
            x = x.unsqueeze(2)
        elif self.spec.frames_in_batch and frames:
            x = x.transpose(1, 2).flatten(0, 1)  # (B T, C, H, W)
        return x, frames

    def _latent_out(self, z: Tensor, frames: int) -> Tensor:
        if self.spec.clip_input and not frames:
            return z.squeeze(2)
        if self.spec.frames_in_batch and frames:
            return z.unflatten(0, (-1, frames)).transpose(1, 2)
        return z

    # ------------------------------------------------------------------------- the interface
    def encode_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Posterior mean and log-variance (diffusers' clamp); None for a deterministic class."""
        x, frames = self._in(x)
        mean, logvar = _posterior(self.model.encode(x))
        return self._latent_out(mean, frames), None if logvar is None else self._latent_out(logvar, frames)

    def posterior_std(self, logvar: Tensor | None) -> Tensor | float:
        return 0.0 if logvar is None else torch.exp(0.5 * logvar.float())

    def sample(self, mean: Tensor, logvar: Tensor | None) -> Tensor:
        mean = mean.float()  # the noise is drawn and added in fp32, as ae.AutoEncoder.sample
        if logvar is None:
            return mean
        return mean + self.posterior_std(logvar) * posterior_noise(mean)

    def encode(self, x: Tensor) -> Tensor:
        return self.encode_moments(x)[0]

    def decode(self, z: Tensor) -> Tensor:
        frames = z.shape[2] if z.dim() == 5 else 0
        kwargs = self.spec.decode_kwargs(self.params.config, z) if self.spec.decode_kwargs else {}
        if self.spec.clip_input and not frames:
            z = z.unsqueeze(2)
        elif self.spec.frames_in_batch:
            kwargs["num_frames"] = max(frames, 1)
            z = z.transpose(1, 2).flatten(0, 1) if frames else z
        out = self.model.decode(z, **kwargs).sample
        out = out[:, :3] if self.spec.pixel_channels == 4 else out
        return self._latent_out(out, frames)

    def forward(self, x: Tensor, sample: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        mean, logvar = self.encode_moments(x)
        return self.decode(self.sample(mean, logvar) if sample else mean), mean, logvar

    # ------------------------------------------------------------------------- latent normalisation and export
    def normalisation(self) -> dict:
        """The latent normalisation the model holds now: its config's fields, or LTX's buffers."""
        kind, config = self.spec.norm.kind, self.params.config
        if kind == "buffers":
            return {k: getattr(self.model, k).detach().cpu().tolist() for k in ("latents_mean", "latents_std")}
        if kind in ("channels", "frames"):
            return {k: config.get(k) for k in ("latents_mean", "latents_std")}
        if kind == "scale":
            return {"scaling_factor": config.get("scaling_factor")}
        if kind == "scale_shift":
            return {k: config.get(k) for k in ("scaling_factor", "shift_factor")}
        return {}

    def normalise_latents(self, z: Tensor) -> Tensor:
        """z as the class's pipelines hand it to their diffusion model (spec.norm's formula): what a tiny
        autoencoder distilled from this VAE encodes to (train_state.TeacherLatents). ValueError for Cosmos' per-frame
        statistics (fixed for its pipelines' 121-frame clips) and a class without a pipeline."""
        norm, fields = self.spec.norm, self.normalisation()
        scale = float(self.params.config.get("scaling_factor") or 1.0)
        if norm.kind in ("channels", "buffers"):
            if norm is CHANNELS:
                scale = 1.0  # (z - latents_mean) / latents_std: Wan's and Qwen-Image's pipelines apply no factor
            return per_channel(z, fields["latents_mean"], fields["latents_std"], scale)
        if norm.kind == "scale":
            return z * scale
        if norm.kind == "scale_shift":
            return (z - float(self.params.config.get("shift_factor") or 0.0)) * scale
        raise ValueError(f"{self.params.class_name}'s latents are normalised {norm.formula}: no per-clip "
                         "normalisation of its latents to distil from")

    def normalisation_from_stats(self, stats: dict) -> dict:
        """The fields that normalise latents of these statistics (evaluate.latent_stats') as the class's pipelines
        apply them."""
        kind = self.spec.norm.kind
        if kind in ("channels", "buffers"):
            return {"latents_mean": stats["channel_mean"], "latents_std": stats["channel_std"]}
        if kind == "scale":  # the pipelines scale without a shift: by the latents' RMS
            return {"scaling_factor": 1.0 / (stats["latent_mean"] ** 2 + stats["latent_std"] ** 2) ** 0.5}
        if kind == "scale_shift":
            return {"scaling_factor": 1.0 / stats["latent_std"], "shift_factor": stats["latent_mean"]}
        return {}

    def cannot_reestimate(self) -> str | None:
        """Why export.py --dataset_url cannot re-estimate this class's normalisation, or None."""
        if self.spec.norm.kind == "frames":
            return (f"{self.params.class_name}'s statistics are per channel and latent frame of its pipelines' "
                    "121-frame clips: re-estimating them is not supported (an export without --dataset_url keeps the "
                    "source's)")
        return None

    def set_normalisation(self, fields: dict) -> None:
        """Make the latent normalisation `fields` the model's: its config's fields, or LTX's buffers (both travel
        with the model: its checkpoint, our safetensors export, save_pretrained)."""
        config = dict(self.params.config)
        for name, value in fields.items():
            if value is None:
                continue
            if self.spec.norm.kind == "buffers" and name in ("latents_mean", "latents_std"):
                buffer = getattr(self.model, name)
                with torch.no_grad():
                    buffer.copy_(torch.tensor(value, dtype=buffer.dtype).reshape(buffer.shape))
            else:
                config[name] = [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)
        self.params = dataclasses.replace(self.params, config=config)

    def save_pretrained(self, out_dir: str) -> None:
        """Write the diffusers folder: the class and its config (every field), the trained weights, loaded strictly
        into the class before save_pretrained."""
        state = {k[len("model."):]: v.detach().cpu() for k, v in self.state_dict().items()}
        model = _module(self.params.class_name, self.params.config)
        model.load_state_dict(state, strict=True)
        model.save_pretrained(out_dir, safe_serialization=True)


@contextlib.contextmanager
def quiet_diffusers():
    """diffusers' loading logs (accelerate's absence, unused config keys) are not the user's business here."""
    from diffusers.utils import logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
