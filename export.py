"""Export a trained autoencoder: a diffusers AutoencoderKL folder, or our own safetensors + config.json.

    python export.py --ckpt runs/vae --out vae-diffusers --format diffusers --ema \\
        --dataset_url 'train/{00000..00099}.tar' --latent_stats_images 5000
    python export.py --ckpt runs/vae --out vae-diffusers --format diffusers --scaling_factor 0.36 --shift_factor 0.12
    python export.py --ckpt runs/vae --out vae-st --format safetensors

    AutoencoderKL.from_pretrained("vae-diffusers")   # latent_dist.mean, decode(z).sample, config.scaling_factor
    vae, config = export.load_autoencoder("vae-st")  # ae.AutoEncoder, config["scaling_factor"]

The latent factors follow the FLUX convention z' = (z - shift_factor) * scaling_factor. They come from
the flags, or from the latent statistics of --dataset_url (evaluate.latent_stats), else 1.0 / 0.0.
With --dataset_url the per-channel statistics go into the config too, as `latents_mean` / `latents_std`
(diffusers' AutoencoderKL keys; per-channel normalisation z' = (z - latents_mean) / latents_std).
The diffusers layout is FLUX's: no quant_conv / post_quant_conv. A constant-variance encoder becomes
AutoencoderKL's (mean, log-variance) output by extra conv_out channels with zero weights and
bias log(posterior_var); a learned-posterior encoder maps as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

import torch
from torch import Tensor

import data as data_lib
import evaluate
from ae import AutoEncoder, AutoEncoderParams
from common import ConfigError, OneLineParser

SAFETENSORS_WEIGHTS = "model.safetensors"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def honour_umask(path: str) -> None:
    """safetensors writes through a private temp file (mode 0600) that it renames: give the file the mode a
    plain open() would have (0666 minus the umask), like config.json next to it, so others on a shared file
    system can read the export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# ============================================================================================
# diffusers AutoencoderKL: config and state-dict conversion
# ============================================================================================
def diffusers_config(params: AutoEncoderParams, resolution: int, scaling_factor: float, shift_factor: float,
                     latents_mean: list[float] | None = None, latents_std: list[float] | None = None) -> dict:
    levels = len(params.ch_mult)
    return dict(
        in_channels=params.in_channels, out_channels=params.out_ch,
        down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=[params.ch * m for m in params.ch_mult], layers_per_block=params.num_res_blocks,
        act_fn="silu", latent_channels=params.z_channels, norm_num_groups=params.norm_groups,
        sample_size=resolution, scaling_factor=scaling_factor, shift_factor=shift_factor,
        force_upcast=True, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=params.use_attn,
        latents_mean=latents_mean, latents_std=latents_std)


def diffusers_key(name: str, levels: int) -> str:
    """Our (LDM/FLUX) parameter name -> diffusers' AutoencoderKL name. diffusers numbers the decoder's
    up_blocks from the lowest resolution, our decoder.up from the highest."""
    def up_block(m: re.Match) -> str:
        return f"decoder.up_blocks.{levels - 1 - int(m[1])}."
    rules = [
        (r"^encoder\.down\.(\d+)\.block\.", r"encoder.down_blocks.\1.resnets."),
        (r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0."),
        (r"^decoder\.up\.(\d+)\.block\.", lambda m: up_block(m) + "resnets."),
        (r"^decoder\.up\.(\d+)\.upsample\.", lambda m: up_block(m) + "upsamplers.0."),
        (r"\.mid\.block_1\.", ".mid_block.resnets.0."),
        (r"\.mid\.block_2\.", ".mid_block.resnets.1."),
        (r"\.mid\.attn_1\.norm\.", ".mid_block.attentions.0.group_norm."),
        (r"\.mid\.attn_1\.([qkv])\.", r".mid_block.attentions.0.to_\1."),
        (r"\.mid\.attn_1\.proj_out\.", ".mid_block.attentions.0.to_out.0."),
        (r"\.nin_shortcut\.", ".conv_shortcut."),
        (r"\.norm_out\.", ".conv_norm_out."),
    ]
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def to_diffusers_state_dict(state: dict[str, Tensor], params: AutoEncoderParams) -> dict[str, Tensor]:
    levels = len(params.ch_mult)
    out = {}
    for name, value in state.items():
        key = diffusers_key(name, levels)
        if ".attentions.0.to_" in key and value.dim() == 4:
            value = value[:, :, 0, 0]  # 1x1 convs become diffusers' linear layers
        out[key] = value.detach().float().contiguous()
    if params.posterior == "constant":
        # AutoencoderKL's encoder outputs (mean, logvar): a constant log-variance is zero weights + a bias
        weight, bias = out["encoder.conv_out.weight"], out["encoder.conv_out.bias"]
        out["encoder.conv_out.weight"] = torch.cat([weight, torch.zeros_like(weight)])
        out["encoder.conv_out.bias"] = torch.cat([bias, torch.full_like(bias, math.log(params.posterior_var))])
    return out


def export_diffusers(vae: AutoEncoder, out_dir: str, resolution: int, scaling_factor: float = 1.0,
                     shift_factor: float = 0.0, latents_mean: list[float] | None = None,
                     latents_std: list[float] | None = None) -> None:
    """Write `out_dir/config.json` and `diffusion_pytorch_model.safetensors` of a diffusers AutoencoderKL.
    The converted weights are loaded strictly into AutoencoderKL before saving: a key or shape mismatch
    fails here, not in the user's pipeline."""
    from diffusers import AutoencoderKL
    params = vae.params
    if params.clamp_th > 0:
        print(f"warning: this model clamps its posterior mean to +-{params.clamp_th}; diffusers' AutoencoderKL does "
              "not clamp, so latents of unusual inputs may exceed that range", file=sys.stderr)
    model = AutoencoderKL(**diffusers_config(params, resolution, scaling_factor, shift_factor, latents_mean,
                                             latents_std))
    model.load_state_dict(to_diffusers_state_dict(vae.state_dict(), params), strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    honour_umask(os.path.join(out_dir, DIFFUSERS_WEIGHTS))


def from_diffusers_state_dict(state: dict[str, Tensor], config: dict) -> tuple[AutoEncoderParams, dict[str, Tensor]]:
    """The inverse of `export_diffusers`: an AutoencoderKL folder's config and weights -> our params and state
    dict. The posterior comes back as it went out: a log-variance half of `conv_out` with zero weights and one
    constant bias is the constant posterior (variance exp(bias)); anything else is a learned one. Raises
    ValueError for a folder that is not in this trainer's (FLUX) layout."""
    if config.get("use_quant_conv", True) or config.get("use_post_quant_conv", True):
        raise ValueError("it has quant_conv layers (the SD layout); this trainer exports the FLUX layout without them")
    channels = list(config["block_out_channels"])
    if any(c % channels[0] for c in channels):
        raise ValueError(f"block_out_channels {channels} are not multiples of the first")
    z = config["latent_channels"]
    weight, bias = state["encoder.conv_out.weight"], state["encoder.conv_out.bias"]
    logvar_weight, logvar_bias = weight[z:], bias[z:]
    constant = bool((logvar_weight == 0).all() and (logvar_bias == logvar_bias[0]).all())
    params = AutoEncoderParams(
        in_channels=config.get("in_channels", 3), out_ch=config.get("out_channels", 3), ch=channels[0],
        ch_mult=tuple(c // channels[0] for c in channels), num_res_blocks=config["layers_per_block"], z_channels=z,
        use_attn=config.get("mid_block_add_attention", True), posterior="constant" if constant else "learned",
        posterior_var=math.exp(logvar_bias[0].item()) if constant else 0.1,
        norm_groups=config.get("norm_num_groups", 32))
    ours = {}
    for name, like in AutoEncoder(params).state_dict().items():
        value = state[diffusers_key(name, len(params.ch_mult))]
        if name.startswith("encoder.conv_out.") and constant:
            value = value[:z]  # drop the constant log-variance channels
        ours[name] = value.reshape(like.shape)  # diffusers' attention linears are our 1x1 convs
    return params, ours


def load_diffusers_export(path: str) -> tuple[AutoEncoder, dict]:
    """(AutoEncoder in eval mode, the diffusers config) from a folder written by `export.py --format diffusers`,
    without diffusers itself. ValueError (one line) for another kind of AutoencoderKL."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    params, state = from_diffusers_state_dict(load_file(os.path.join(path, DIFFUSERS_WEIGHTS)), config)
    vae = AutoEncoder(params)
    vae.load_state_dict(state)
    return vae.eval(), config


# ============================================================================================
# Our own format: ae.py's state dict as safetensors, AutoEncoderParams as config.json
# ============================================================================================
def export_safetensors(vae: AutoEncoder, out_dir: str, resolution: int | None, scaling_factor: float = 1.0,
                       shift_factor: float = 0.0, step: int | None = None, latents_mean: list[float] | None = None,
                       latents_std: list[float] | None = None) -> None:
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in vae.state_dict().items()}
    save_file(state, os.path.join(out_dir, SAFETENSORS_WEIGHTS), metadata={"format": "pt"})
    honour_umask(os.path.join(out_dir, SAFETENSORS_WEIGHTS))
    config = {**vae.params.to_dict(), "scaling_factor": scaling_factor, "shift_factor": shift_factor,
              "resolution": resolution, "step": step, "latents_mean": latents_mean, "latents_std": latents_std}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_autoencoder(path: str) -> tuple[AutoEncoder, dict]:
    """(AutoEncoder in eval mode, config dict with scaling_factor / shift_factor / resolution / step) from a
    folder written by `export.py --format safetensors`."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    fields = {f.name for f in dataclasses.fields(AutoEncoderParams)}
    vae = AutoEncoder(AutoEncoderParams.from_dict({k: v for k, v in config.items() if k in fields}))
    vae.load_state_dict(load_file(os.path.join(path, SAFETENSORS_WEIGHTS)))
    return vae.eval(), config


# ============================================================================================
# The command
# ============================================================================================
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="run directory (its latest readable checkpoint), checkpoint file, "
                                                 "or an export.py folder (either format)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--format", default="diffusers", choices=("diffusers", "safetensors"),
                   help="diffusers: AutoencoderKL folder; safetensors: ae.py weights + config.json (load_autoencoder)")
    p.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    p.add_argument("--scaling_factor", type=float, default=None, help="latent scale (z' = (z - shift) * scale)")
    p.add_argument("--shift_factor", type=float, default=None, help="latent shift")
    p.add_argument("--dataset_url", default="", help="compute scale and shift from the latents of these images")
    p.add_argument("--latent_stats_images", type=int, default=1000, help="images used for the latent statistics")
    p.add_argument("--resolution", type=int, default=0, help="crop size for the statistics and the diffusers "
                                                             "sample_size (default: the checkpoint's vae_resolution)")
    p.add_argument("--batch_size", type=int, default=16, help="batch size of the latent statistics")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.dataset_url and (args.scaling_factor is not None or args.shift_factor is not None):
            raise ConfigError("give --scaling_factor/--shift_factor or --dataset_url, not both")
        if args.scaling_factor is not None and not (math.isfinite(args.scaling_factor) and args.scaling_factor > 0):
            raise ConfigError(f"--scaling_factor must be a positive number, got {args.scaling_factor}")
        if args.latent_stats_images <= 0 or args.batch_size <= 0:
            raise ConfigError("--latent_stats_images and --batch_size must be positive")
        vae, info = evaluate.load_model(args.ckpt, args.ema)
        resolution = args.resolution or info["resolution"]
        if not resolution or resolution % vae.downsample_factor:
            raise ConfigError(f"--resolution must be a positive multiple of {vae.downsample_factor}, got {resolution}")
        if args.dataset_url:
            data_lib.probe_remote_shards(data_lib.list_shards(args.dataset_url))
        if os.path.isfile(args.out):
            raise ConfigError(f"--out {args.out} is a file")

        summary = {"out": args.out, "format": args.format, "checkpoint": info["checkpoint"], "step": info["step"],
                   "ema": args.ema, "resolution": resolution}
        if args.dataset_url:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            stats = evaluate.latent_stats(vae.to(device), args.dataset_url, resolution, batch_size=args.batch_size,
                                          device=device, max_images=args.latent_stats_images)
            vae.cpu()
            scale, shift = stats["scaling_factor"], stats["shift_factor"]
            channel_mean, channel_std = stats["channel_mean"], stats["channel_std"]
            summary["latent_stats"] = stats
        else:
            channel_mean = channel_std = None  # per-channel statistics need --dataset_url
            scale = 1.0 if args.scaling_factor is None else args.scaling_factor
            shift = 0.0 if args.shift_factor is None else args.shift_factor
            if args.scaling_factor is None and args.shift_factor is None:
                print("note: no --scaling_factor/--shift_factor or --dataset_url: writing scaling_factor 1.0 and "
                      "shift_factor 0.0 (compute them with evaluate.py --latent_stats)", file=sys.stderr)
        if args.format == "diffusers":
            export_diffusers(vae, args.out, resolution, scale, shift, channel_mean, channel_std)
        else:
            export_safetensors(vae, args.out, resolution, scale, shift, info["step"], channel_mean, channel_std)
    except (ConfigError, data_lib.DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary.update(scaling_factor=scale, shift_factor=shift)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
