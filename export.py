"""Export a trained autoencoder: a diffusers AutoencoderKL folder, or our own safetensors + config.json.

    python export.py --ckpt runs/vae --out vae-diffusers --format diffusers --ema \\
        --dataset_url 'train/{00000..00099}.tar' --latent_stats_images 5000
    python export.py --ckpt runs/vae --out vae-diffusers --format diffusers --scaling_factor 0.36 --shift_factor 0.12
    python export.py --ckpt runs/vae --out vae-st --format safetensors

    AutoencoderKL.from_pretrained("vae-diffusers")   # latent_dist.mean, decode(z).sample, config.scaling_factor
    vae, config = export.load_autoencoder("vae-st")  # ae.AutoEncoder, config["scaling_factor"]

    python export.py --ckpt runs/flux-ft --out flux-ft --format single_file   # ae.safetensors, FLUX's layout

The latent normalisation is written for one pipeline family (--latent_norm), so that the latents its diffusion
model sees have zero mean and unit variance:
  scalar (default; FLUX, SD3, SD 1.x/2.x): z' = (z - shift_factor) * scaling_factor, no latents_mean/latents_std.
      The factors come from the flags, or from the latent statistics of --dataset_url (evaluate.latent_stats),
      else 1.0 / 0.0.
  per_channel (SDXL-style pipelines, which decode with latents * latents_std / scaling_factor + latents_mean):
      latents_mean / latents_std per channel from --dataset_url, scaling_factor 1.0, shift_factor 0.0.
Both at once would compound: an SDXL-style pipeline applies scaling_factor on top of latents_std. Which pipeline
families a written config serves depends on the channel count (SDXL-family pipelines read exactly 4 values of
latents_mean; FLUX and SD3 ignore them; SD 1.x/2.x and SDXL ignore shift_factor): a diffusers export names them in
one line and in its summary's "serves".
A decoder-only fine-tune (--train_parts decoder) keeps its --init_from source's factors unless given others.
FLUX.2 (a model with bn statistics) normalises through bn instead: the diffusers export is an AutoencoderKLFlux2 with
the bn buffers (FLUX.2's pipeline standardises the 2x2-patchified latent by them), the single file BFL's layout;
--dataset_url re-estimates the statistics (needed after a run that trained the encoder), factor flags are refused.
A decoder narrower than the encoder (AutoencoderKL has no width of its own for the decoder) is exported as an
AutoencoderKLFlux2 with decoder_block_out_channels; for the other families with their factors in its config.
quant_conv / post_quant_conv are exported where the model has them (SD 1.x/2.x/SDXL, FLUX.2). A constant-variance
encoder becomes AutoencoderKL's (mean, log-variance) output by extra conv_out channels with zero weights and
bias log(posterior_var); a learned-posterior encoder maps as it is.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from common import exit_if_torch_pair_broken
if __name__ == "__main__":  # first: a torch/torchvision mismatch is one line, not an import's traceback
    exit_if_torch_pair_broken()
import data as data_lib  # noqa: E402 (after the check above; so are the imports below)
import evaluate
import families
import sources
from checkpoint import (SAFETENSORS_WEIGHTS, best_checkpoint, load_autoencoder, load_diffusers_export,  # noqa: F401
                        load_model)
from common import ConfigError, OneLineParser
from layouts import ExportRequest, export_safetensors  # noqa: F401 (export.export_safetensors: our format)
from ldm_layouts import pipelines_served  # noqa: F401 (what an AutoencoderKL export's factors serve)


# ============================================================================================
# The command
# ============================================================================================
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="run directory (its latest readable checkpoint), checkpoint file, "
                                                 "an export.py folder (either format) or single file (with "
                                                 "--resolution)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--format", default="diffusers", choices=("diffusers", "safetensors", "single_file", "released"),
                   help="diffusers: a diffusers folder of the model's class (the source's class for a fine-tune; a "
                        "tiny autoencoder's: diffusers' class of TAESD's layout); safetensors: the model's weights + config.json "
                        "(load_autoencoder); single_file: OUT/ae.safetensors in the LDM/FLUX layout (FLUX's "
                        "ae.safetensors, SD's VAE files); released: a tiny autoencoder's released layout, "
                        "OUT/NAME_encoder.pth + OUT/NAME_decoder.pth (TAEHV's: OUT/NAME.pth), what madebyollin's code "
                        "and ComfyUI read")
    p.add_argument("--name", default="", help="--format released: the files' NAME (default: --out's folder name)")
    p.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    p.add_argument("--best", action="store_true", help="with --ckpt RUN: the run's best checkpoint by its "
                                                       "--best_metric (checkpoints/best), and the EMA weights if "
                                                       "that metric was the EMA's")
    p.add_argument("--latent_norm", default="scalar", choices=("scalar", "per_channel"),
                   help="scalar: scaling_factor/shift_factor (FLUX, SD3, SD 1.x/2.x pipelines); per_channel: "
                        "latents_mean/latents_std from --dataset_url with scaling_factor 1 (SDXL-style pipelines)")
    p.add_argument("--scaling_factor", type=float, default=None, help="latent scale (z' = (z - shift) * scale)")
    p.add_argument("--shift_factor", type=float, default=None, help="latent shift")
    p.add_argument("--dataset_url", default="", help="compute scale and shift from the latents of these images")
    p.add_argument("--latent_stats_images", type=int, default=1000, help="images used for the latent statistics")
    p.add_argument("--resolution", type=int, default=0, help="crop size for the statistics and the diffusers "
                                                             "sample_size (default: the checkpoint's vae_resolution)")
    p.add_argument("--batch_size", type=int, default=16, help="batch size of the latent statistics")
    return p


def check_data_and_out(args) -> None:
    """One line if --dataset_url cannot be read or --out is a file, before anything is computed or written."""
    if args.dataset_url:
        sources.probe_remote_shards(sources.list_shards(args.dataset_url))
    if os.path.isfile(args.out):
        raise ConfigError(f"--out {args.out} is a file")


def export_summary(args, info: dict, resolution: int) -> dict:
    """What every export's JSON line says of itself."""
    return {"out": args.out, "format": args.format, "checkpoint": info["checkpoint"], "step": info["step"],
            "ema": args.ema, "resolution": resolution}


def latent_statistics(args, resolution: int):
    """--dataset_url's latent statistics as a family's writer asks for them (layouts.ExportRequest.statistics):
    evaluate.latent_stats, or with bn=True FLUX.2's bn statistics (evaluate.latent_bn_stats), on the GPU when there
    is one, the model back on the CPU after; None without --dataset_url."""
    if not args.dataset_url:
        return None

    def statistics(vae: torch.nn.Module, bn: bool = False, **clips) -> dict:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        measure = evaluate.latent_bn_stats if bn else evaluate.latent_stats
        stats = measure(vae.to(device), args.dataset_url, resolution, batch_size=args.batch_size, device=device,
                        max_images=args.latent_stats_images, **clips)
        vae.cpu()
        return stats
    return statistics


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.dataset_url and (args.scaling_factor is not None or args.shift_factor is not None):
            raise ConfigError("give --scaling_factor/--shift_factor or --dataset_url, not both")
        if args.latent_norm == "per_channel" and not args.dataset_url:
            raise ConfigError("--latent_norm per_channel needs --dataset_url (the per-channel statistics)")
        if args.latent_norm == "per_channel" and args.format == "single_file":
            raise ConfigError("--latent_norm per_channel needs a config to hold latents_mean/latents_std: "
                              "--format diffusers or safetensors")
        if args.scaling_factor is not None and not (math.isfinite(args.scaling_factor) and args.scaling_factor > 0):
            raise ConfigError(f"--scaling_factor must be a positive number, got {args.scaling_factor}")
        if args.latent_stats_images <= 0 or args.batch_size <= 0:
            raise ConfigError("--latent_stats_images and --batch_size must be positive")
        if args.best:  # the run's best checkpoint, and the weights its --best_metric measured
            args.ckpt, args.ema = best_checkpoint(args.ckpt, args.ema)
        vae, info = load_model(args.ckpt, args.ema)
        resolution = args.resolution or info["resolution"]
        if resolution is None:
            raise ConfigError(f"--ckpt {args.ckpt} does not record the size it was trained at: give --resolution")
        if not resolution or resolution % vae.downsample_factor:
            raise ConfigError(f"--resolution must be a positive multiple of {vae.downsample_factor}, got {resolution}")
        request = ExportRequest(args.out, args.format, args.name, resolution, bool(args.resolution), info,
                                args.scaling_factor, args.shift_factor, args.latent_norm,
                                export_summary(args, info, resolution), latent_statistics(args, resolution))
        families.check_export(vae, request)  # the family's refusals, before anything is read or written
        check_data_and_out(args)
        summary = families.export(vae, request)  # the family's writer: its normalisation, its layouts
    except (ConfigError, data_lib.DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
