"""The Wan family's layout, both ways: a diffusers AutoencoderKLQwenImage / AutoencoderKLWan folder (Qwen-Image's and
Wan 2.1's VAE, Wan 2.2's) read into wan_ae.py's image model, or with `video=True` its video model (every temporal
weight; its params a wan_ae.WanParams), and the trained model written back as the folder it came from.

    source = families.load_source("Qwen/Qwen-Image/vae")                    # (load_wan_folder, through the registry)
    wan_layouts.export_wan_diffusers(vae, "Qwen/Qwen-Image/vae", "out")     # its class, config and earlier slices kept

The image model runs a clip's first frame only: its 2D kernels are the last temporal slices of the folder's causal 3D
kernels, and the temporal resamplers' time_conv are no part of it (TIME_CONV); writing back puts the trained slices
into the source's kernels and keeps the rest. families.py (the registry) calls it; layouts.py holds what the
families' layouts share.
"""
from __future__ import annotations

import json
import os

import torch
from torch import Tensor

import wan_ae
from common import honour_umask
from layouts import DIFFUSERS_WEIGHTS, DIFFUSERS_WEIGHTS_BIN, Source, SourceError, kept_config, read_weights


def load_wan_folder(path: str, config: dict, weights: str, init_family: str = "auto", video: bool = False) -> Source:
    """A diffusers AutoencoderKLQwenImage / AutoencoderKLWan folder as wan_ae.py's image model, or its video model."""
    params, ours, factors, notes = wan_from_diffusers(config, read_weights(weights), path, video)
    if init_family != "auto":
        notes.append(f"--init_family {init_family} ignored: the diffusers config carries the latent factors")
    return Source(path, "diffusers", "", params, ours, factors, "", notes, kept_config(config, config["_class_name"]))



# ============================================================================================
# diffusers AutoencoderKLQwenImage / AutoencoderKLWan (Wan 2.1): config and weights, both ways
# ============================================================================================
WAN_DIFFUSERS_CLASSES = ("AutoencoderKLQwenImage", "AutoencoderKLWan")
# causal Conv3d kernels are (out, in, k, k, k): their last temporal slice is the one-frame Conv2d
TIME_CONV = ".time_conv."  # the temporal resamplers' convolutions: no part of the first frame's computation


def wan_params_from_diffusers_config(config: dict, where: str, video: bool = False) -> wan_ae.WanParams:
    """An AutoencoderKLQwenImage / AutoencoderKLWan config -> our params (diffusers' defaults where a key is
    missing); SourceError (one line) for a config this 2D model cannot honour."""
    class_name = config.get("_class_name")
    dim_mult = list(config.get("dim_mult", [1, 2, 4, 4]))
    temporal = list(config.get("temperal_downsample", [False, True, True]))
    if not dim_mult or not all(isinstance(m, int) and m > 0 for m in dim_mult):
        raise SourceError(f"{where}: dim_mult {dim_mult} is not a list of positive integers")
    if len(temporal) != len(dim_mult) - 1:
        # diffusers builds one resampler per level but the last, each reading its entry of temperal_downsample
        raise SourceError(f"{where}: temperal_downsample has {len(temporal)} entries for {len(dim_mult)} levels "
                            f"(dim_mult {dim_mult}): not a VAE diffusers can build")
    if config.get("attn_scales"):
        raise SourceError(f"{where}: attn_scales {config['attn_scales']}: diffusers' encoder cannot run those "
                            "attention blocks (they take no feature cache), and no release has them")
    base = config.get("base_dim", 96)
    patch_size, level_shortcuts = 1, False
    if class_name == "AutoencoderKLWan":
        in_channels, out_channels = config.get("in_channels", 3), config.get("out_channels", 3)
        decoder_ch = config.get("decoder_base_dim") or base
        patch_size, level_shortcuts = config.get("patch_size") or 1, bool(config.get("is_residual", False))
        if in_channels % patch_size ** 2 or out_channels % patch_size ** 2:
            raise SourceError(f"{where}: in_channels {in_channels} / out_channels {out_channels} are not the "
                                f"channels of {patch_size}x{patch_size} patches")
        in_channels, out_channels = in_channels // patch_size ** 2, out_channels // patch_size ** 2
    else:  # AutoencoderKLQwenImage: one input_channels for the image in and out
        in_channels = out_channels = config.get("input_channels", 3)
        decoder_ch = base
    z = config.get("z_dim", 16)
    for name in ("latents_mean", "latents_std"):
        if config.get(name) is not None and len(config[name]) != z:
            raise SourceError(f"{where}: {name} has {len(config[name])} entries for z_dim {z}")
    return wan_ae.WanParams(in_channels=in_channels, out_ch=out_channels, ch=base, ch_mult=tuple(dim_mult),
                          num_res_blocks=config.get("num_res_blocks", 2), z_channels=z, decoder_ch=decoder_ch,
                          dropout=float(config.get("dropout", 0.0)), patch_size=patch_size,
                          level_shortcuts=level_shortcuts, video=video,
                          # the first frame depends on it only through Wan 2.2's shortcuts
                          temporal_downsample=tuple(map(bool, temporal)) if level_shortcuts or video else ())


def _wan_one_frame(value: Tensor, like: Tensor) -> Tensor | None:
    """A diffusers tensor -> the tensor of our shape `like`: a causal (out, in, k, k, k) kernel's last temporal slice,
    an RMS norm's (C, 1, 1, 1) gamma reshaped; None when it does not fit."""
    if value.shape == like.shape:  # (the video model's every kernel)
        return value
    if value.dim() == 5 and value.shape[2] == value.shape[3] and value[:, :, -1].shape == like.shape:
        return value[:, :, -1]
    if value.dim() == like.dim() + 1 and value.numel() == like.numel() and value.shape[-1] == 1:
        return value.reshape(like.shape)
    return value if value.shape == like.shape else None


def wan_from_diffusers_state_dict(state: dict[str, Tensor], params: wan_ae.WanParams, where: str) -> dict[str, Tensor]:
    """diffusers' weights -> ours (the same names); SourceError (one line) naming the keys that do not fit. The
    source's time_conv weights are the only ones the image model leaves out (the first frame never runs them)."""
    try:
        with torch.device("meta"):
            ours = wan_ae.WanAutoEncoder(params).state_dict()
    except ValueError as e:  # a shortcut's channel groups that do not divide
        raise SourceError(f"{where}: not a VAE diffusers can build ({e})") from None
    converted, missing, wrong = {}, [], []
    for name, like in ours.items():
        if name not in state:
            missing.append(name)
            continue
        value = _wan_one_frame(state[name], like)
        if value is None:
            wrong.append(f"{name} {list(state[name].shape)} vs {list(like.shape)}")
            continue
        converted[name] = value.float().contiguous()
    extra = sorted(k for k in state if k not in ours and TIME_CONV not in k)
    if missing or wrong or extra:
        parts = ([f"{len(missing)} missing (e.g. {', '.join(missing[:3])})"] if missing else []) + \
                ([f"{len(wrong)} of another shape (e.g. {'; '.join(wrong[:2])})"] if wrong else []) + \
                ([f"{len(extra)} unexpected (e.g. {', '.join(extra[:3])})"] if extra else [])
        raise SourceError(f"{where}: keys do not fit the architecture read from its config: {', '.join(parts)}")
    return converted


def wan_to_diffusers_state_dict(state: dict[str, Tensor], source_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our weights back into the source's diffusers tensors: the video model's as they are; the image model's 2D
    kernels into the last temporal slice of their 3D kernels, the other slices and every time_conv as the source has
    them (they act on later video frames only)."""
    out = {}
    for name, source in source_state.items():
        if name not in state:
            if TIME_CONV not in name:
                raise ValueError(f"{name} is in the source's weights but not in the model's")
            out[name] = source.detach().float().clone()
            continue
        value = state[name].detach().float().cpu()
        if value.shape == source.shape:
            out[name] = value.clone()
        elif source.dim() == 5:
            merged = source.detach().float().clone()
            merged[:, :, -1] = value
            out[name] = merged
        else:
            out[name] = value.reshape(source.shape).clone()
    left = sorted(set(state) - set(source_state))
    if left:
        raise ValueError(f"the model has {len(left)} weights the source lacks (e.g. {', '.join(left[:3])})")
    return out


def wan_from_diffusers(config: dict, state: dict[str, Tensor], where: str, video: bool = False
                   ) -> tuple[wan_ae.WanParams, dict[str, Tensor], dict, list[str]]:
    """A diffusers AutoencoderKLQwenImage / AutoencoderKLWan folder's config and weights -> (params, our weights,
    latent factors, notes). The pipelines normalise with the config's per-channel statistics alone,
    z' = (z - latents_mean) / latents_std: scaling_factor 1, shift_factor 0."""
    params = wan_params_from_diffusers_config(config, where, video)
    converted = wan_from_diffusers_state_dict(state, params, where)
    factors = {"scaling_factor": 1.0, "shift_factor": 0.0, "latents_mean": config.get("latents_mean"),
               "latents_std": config.get("latents_std")}
    notes = []
    if not video and config.get("_class_name") == "AutoencoderKLWan" and any(TIME_CONV in k for k in state):
        notes.append("a video VAE trained here on images: its export decodes images (first frames) as trained; later "
                     "video frames also go through the source's earlier temporal kernel slices and time_conv, which "
                     "training does not touch")
    return params, converted, factors, notes


def export_wan_diffusers(vae: wan_ae.WanAutoEncoder, source_dir: str, out_dir: str,
                         latents_mean: list[float] | None = None, latents_std: list[float] | None = None) -> None:
    """Write `out_dir` as the diffusers folder `source_dir` is (its class and config), with the trained weights: the
    video model's every tensor; the image model's 2D kernels into the last temporal slice of their causal 3D
    kernels, the other slices and the temporal resamplers' time_conv kept from the source (the first frame never
    uses them, so training on images could not learn them). The config's
    latents_mean/latents_std stay the source's unless given (re-estimated statistics). Loaded strictly into the
    diffusers class before saving: a key or shape mismatch fails here. ValueError (one line) for a source that is
    not the one the model was trained from."""
    import diffusers
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("_class_name") not in WAN_DIFFUSERS_CLASSES:
        raise ValueError(f"{source_dir}: a {config.get('_class_name')}, not one of {WAN_DIFFUSERS_CLASSES}")
    params = wan_params_from_diffusers_config(config, source_dir, vae.params.video)
    if params != vae.params:
        raise ValueError(f"{source_dir}: its architecture {params} is not the model's {vae.params}")
    for name, values in (("latents_mean", latents_mean), ("latents_std", latents_std)):
        if values is not None:
            if len(values) != vae.params.z_channels:
                raise ValueError(f"{name} has {len(values)} entries for {vae.params.z_channels} latent channels")
            config[name] = [float(v) for v in values]
    weights = [os.path.join(source_dir, n) for n in (DIFFUSERS_WEIGHTS, DIFFUSERS_WEIGHTS_BIN)
               if os.path.isfile(os.path.join(source_dir, n))]
    if not weights:  # the kept temporal slices come from them
        raise ValueError(f"{source_dir}: no {DIFFUSERS_WEIGHTS}: the export needs the source's weights")
    model = getattr(diffusers, config["_class_name"]).from_config(config)
    model.load_state_dict(wan_to_diffusers_state_dict(vae.state_dict(), read_weights(weights[0])),
                          strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    honour_umask(os.path.join(out_dir, DIFFUSERS_WEIGHTS))
