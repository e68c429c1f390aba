"""What the families' layouts share: the `Source` every reader returns, reading a diffusers folder and a weights file.

    config, weights = layouts.read_diffusers_folder("Qwen/Qwen-Image/vae")   # config.json + the weights' path
    state = layouts.read_weights(weights)                                     # safetensors, .bin, .ckpt, sharded

Each family's own layouts live with it: ldm_layouts.py (ae.py's model: AutoencoderKL / AutoencoderKLFlux2 folders, the
LDM/FLUX single file, SD checkpoints), wan_layouts.py (wan_ae.py's: the Wan family's folders), tae.py (the tiny
autoencoders' released files, beside their model); diffusers' own classes are read and written by their module.
families.py, the registry, is the one place that chooses among them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from common import first_line

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_WEIGHTS_BIN = "diffusion_pytorch_model.bin"
DIFFUSERS_WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"  # weights sharded over several files


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
