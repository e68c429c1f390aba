"""What the families' layouts share: the `Source` every reader returns, reading a diffusers folder and a weights file;
what export.py asks a family's writer (`ExportRequest`), our own safetensors format, and the writer of the families
whose pipelines read their latent normalisation from their config's fields.

    config, weights = layouts.read_diffusers_folder("Qwen/Qwen-Image/vae")   # config.json + the weights' path
    state = layouts.read_weights(weights)                                     # safetensors, .bin, .ckpt, sharded

Each family's own layouts live with it: ldm_layouts.py (ae.py's model: AutoencoderKL / AutoencoderKLFlux2 folders, the
LDM/FLUX single file, SD checkpoints), wan_layouts.py (wan_ae.py's: the Wan family's folders), tae.py (the tiny
autoencoders' released files, beside their model); diffusers' own classes are read and written by their module.
families.py, the registry, is the one place that chooses among them; export.py reaches a family's writer through it
(families.check_export, families.export) and measures the latent statistics a writer asks for.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from common import ConfigError, first_line, honour_umask

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_WEIGHTS_BIN = "diffusion_pytorch_model.bin"
DIFFUSERS_WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"  # weights sharded over several files
SAFETENSORS_WEIGHTS = "model.safetensors"  # export.py --format safetensors (ours; checkpoint.load_autoencoder reads it)


class SourceError(ValueError):
    """A source the user gave cannot be loaded: the message is one line."""


@dataclass
class Source:
    path: str
    layout: str  # "diffusers" (a folder) or "single_file"
    family: str  # sd | sdxl | sd3 | flux | flux2, or "" (a diffusers folder: its config carries the factors)
    params: Any  # the family's architecture: ae.AutoEncoderParams, wan_ae.WanParams, tae.TAEParams, ...
    state: dict[str, Tensor]  # in ae.py's (LDM/FLUX) names; a Wan-family source's in wan_ae.py's (diffusers') names
    factors: dict  # scaling_factor, shift_factor, latents_mean, latents_std (None where the source has none);
    # FLUX.2's bn statistics are not factors: they are in `state` (bn.running_mean / bn.running_var) and `params`
    prefix: str = ""  # the VAE keys' prefix in a full checkpoint
    notes: list[str] = field(default_factory=list)
    config: dict | None = None  # a diffusers folder's config.json: an export of the run starts from it

    def describe(self) -> dict:
        """What a run records about where its weights came from (config.json, checkpoints, export)."""
        return {"path": self.path, "layout": self.layout, "family": self.family, "prefix": self.prefix,
                **self.factors, **({"config": self.config} if self.config is not None else {})}


def read_diffusers_folder(path: str) -> tuple[dict, str]:
    """A diffusers model folder's config.json and the path of its weights; SourceError (one line) for a pipeline's
    root (its VAE is vae/), a folder without config.json or weights, an unreadable config."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        if os.path.isfile(os.path.join(path, "vae", "config.json")):  # a whole pipeline (model_index.json)
            raise SourceError(f"{path}: a pipeline folder: give its VAE, {os.path.join(path, 'vae')}")
        if os.path.isfile(os.path.join(path, "model_index.json")):  # a pipeline whose vae/ is not (all) here
            raise SourceError(f"{path}: a diffusers pipeline folder (model_index.json): its VAE is the vae/ subfolder, "
                              f"{os.path.join(path, 'vae')}, which holds no config.json here (download the VAE too: "
                              "huggingface-cli download REPO --include 'vae/*')")
        raise SourceError(f"{path}: a folder without config.json: not a diffusers model folder (a pipeline's VAE is "
                          "its vae/ subfolder)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SourceError(f"{config_path}: unreadable ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise SourceError(f"{config_path}: not a diffusers config (a JSON object)")
    weights = [os.path.join(path, n) for n in (DIFFUSERS_WEIGHTS, DIFFUSERS_WEIGHTS_BIN, DIFFUSERS_WEIGHTS_INDEX)
               if os.path.isfile(os.path.join(path, n))]
    if not weights:
        raise SourceError(f"{path}: config.json but no weights ({DIFFUSERS_WEIGHTS} or {DIFFUSERS_WEIGHTS_BIN})")
    return config, weights[0]


def read_weights(path: str) -> dict[str, Tensor]:
    if path.endswith(".index.json"):  # a sharded safetensors: the index names each tensor's file
        try:
            with open(path) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise SourceError(f"{path}: unreadable index of sharded weights ({type(e).__name__})") from None
        return {k: v for name in files for k, v in read_weights(os.path.join(os.path.dirname(path), name)).items()}
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)  # never runs code from the file
    except Exception as e:
        reason = first_line(e)
        raise SourceError(f"{path}: unreadable ({type(e).__name__}{': ' + reason if reason else ''}): truncated, "
                          "or not a .safetensors / PyTorch file") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # LDM/SD .ckpt files
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise SourceError(f"{path}: holds no state dict of tensors")
    return state


def kept_config(config: dict, class_name: str) -> dict:
    """What a Source records of a folder's config: every field, with its class (not _diffusers_version or
    _name_or_path)."""
    return {"_class_name": class_name, **{k: v for k, v in config.items() if not k.startswith("_")}}


def as_stored(value: Tensor) -> Tensor:
    """fp32 weights on the CPU; an integer buffer (bn.num_batches_tracked) keeps its dtype."""
    value = value.detach().cpu()
    return (value.float() if value.is_floating_point() else value).contiguous()


# ============================================================================================
# Writing: what export.py asks a family's writer, and the layouts every family writes alike
# ============================================================================================
@dataclass
class ExportRequest:
    """What export.py asks of a family's writer (families.export): where and in which --format, the normalisation
    flags, what the checkpoint records, and --dataset_url's latent statistics, which only the command can measure
    (evaluate.py is a layer above the layouts). Each family decides from it what normalisation its pipelines read,
    what it keeps from the source, which formats it writes and what it refuses."""
    out: str
    format: str  # diffusers | safetensors | single_file | released
    name: str  # --format released: the files' NAME
    resolution: int
    resolution_given: bool  # --resolution: the source folder's sample_size is not kept
    info: dict  # checkpoint.load_model's: step, init_source (Source.describe()), train_parts, video_frames, ...
    scaling_factor: float | None
    shift_factor: float | None
    latent_norm: str  # scalar | per_channel
    summary: dict  # the fields of the JSON line every export prints, which the writer extends
    # --dataset_url's latent statistics, statistics(vae, bn=False, frames=0, frame_stride=1) -> evaluate.latent_stats'
    # result (latent_bn_stats' with bn); the model comes back on the CPU. None without --dataset_url
    statistics: Callable[..., dict] | None = None

    @property
    def factor_flags(self) -> bool:
        """Whether --scaling_factor, --shift_factor or --latent_norm per_channel was given."""
        return self.scaling_factor is not None or self.shift_factor is not None or self.latent_norm != "scalar"

    @property
    def source(self) -> dict:
        """Where the run started (Source.describe(); {} for a run from flags)."""
        return self.info.get("init_source") or {}

    def source_config(self) -> dict | None:
        """The diffusers config.json of the folder the checkpoint's run started from: recorded in the run (runs since
        issue 31), else read from the folder if it is still there, else None (the export writes its own). Its
        sample_size (diffusers' tile size: 1024 for FLUX.2, not a 256 px training crop) is kept unless --resolution
        is given."""
        source, config = self.source, None
        path = os.path.join(source.get("path") or "", "config.json")
        if source.get("config"):
            config = source["config"]
        elif source.get("layout") == "diffusers" and os.path.isfile(path):
            try:
                with open(path) as f:
                    config = json.load(f)
            except (OSError, ValueError):
                config = None
        if config and self.resolution_given:
            config = {k: v for k, v in config.items() if k != "sample_size"}
        return config


def export_safetensors(vae: torch.nn.Module, out_dir: str, resolution: int | None, scaling_factor: float = 1.0,
                       shift_factor: float = 0.0, step: int | None = None, latents_mean: list[float] | None = None,
                       latents_std: list[float] | None = None, **fields) -> None:
    """Our own format, any family's: the model's state dict as safetensors, its params as config.json
    (checkpoint.load_autoencoder). `fields`: a model's own latent normalisation (ae.Trainable.source_fields),
    recorded with the factors."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    state = {k: as_stored(v) for k, v in vae.state_dict().items()}
    save_file(state, os.path.join(out_dir, SAFETENSORS_WEIGHTS), metadata={"format": "pt"})  # bn.* included
    honour_umask(os.path.join(out_dir, SAFETENSORS_WEIGHTS))
    config = {**vae.params.to_dict(), "scaling_factor": scaling_factor, "shift_factor": shift_factor,
              "resolution": resolution, "step": step, "latents_mean": latents_mean, "latents_std": latents_std,
              **fields}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def check_fields_export(vae, request: ExportRequest) -> None:
    """ConfigError (one line) for what an export normalised by the model's own config fields cannot do (the Wan
    family's, diffusers' classes': export_by_fields)."""
    if request.factor_flags:
        raise ConfigError(f"{vae.describe()} is normalised by its own config's fields "
                          f"({vae.serves()}), not by --scaling_factor / --shift_factor / --latent_norm "
                          "(--dataset_url re-estimates them)")
    if request.format == "single_file":
        raise ConfigError(f"{vae.describe()} exports as its diffusers folder (--format diffusers) or "
                          "ours (--format safetensors): this trainer writes no single file of it")
    if request.statistics and vae.cannot_reestimate():
        raise ConfigError(vae.cannot_reestimate())


def export_by_fields(vae, request: ExportRequest, write_diffusers: Callable) -> dict:
    """The writer of a family whose pipelines normalise latents by fields of its own config (the Wan family's and
    many diffusers classes' latents_mean/latents_std per channel, others' scaling_factor; ae.Trainable.source_fields):
    after a decoder-only fine-tune the source's values are kept; --dataset_url re-estimates them (after a run that
    trained the encoder), over clips of the run's length for a video run. `write_diffusers`: the family's
    (Family.write_diffusers), the source's own layout (its class and config, every field kept, with the trained
    weights). Returns the JSON line's fields."""
    source = request.source
    summary = {**request.summary, "latent_norm": vae.norm_label()}
    fields = vae.source_fields(source)
    if request.statistics:
        # a video run's statistics over clips of its training length (every latent frame counted)
        frames = request.info.get("video_frames", 0) if vae.temporal_factor else 0
        stats = request.statistics(vae, frames=frames, frame_stride=request.info.get("video_frame_stride", 1))
        fields = vae.fields_from_stats(stats)
        summary["latent_stats"] = stats
    elif request.info.get("train_parts") != "decoder":
        print("note: the latent normalisation is the source's; if this run trained the encoder it describes the "
              "latents of the encoder it started from: give --dataset_url to re-estimate it", file=sys.stderr)
    vae.set_normalisation(fields)  # (where the model holds it: a diffusers class's config or buffers)
    if request.format == "diffusers":
        write_diffusers(vae, request.out, request.resolution, fields, request.source_config(), source.get("path"))
        summary["serves"] = vae.serves()
    else:
        export_safetensors(vae, request.out, request.resolution, step=request.info["step"], **fields)
    return summary
