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
import layouts
import sources
from checkpoint import (SAFETENSORS_WEIGHTS, best_checkpoint, load_autoencoder, load_diffusers_export,  # noqa: F401
                        load_model)
from common import ConfigError, OneLineParser, honour_umask
from ldm_layouts import export_single_file



def pipelines_served(latent_norm: str, channels: int, shift_factor: float) -> str:
    """Which diffusers pipeline families normalise latents with the config an AutoencoderKL export writes, for this
    channel count (each claim is tested through that family's own code path: tests/test_export.py)."""
    if latent_norm == "scalar":
        scale_only = ("SD 1.x/2.x and SDXL-family pipelines apply scaling_factor only and ignore shift_factor "
                      f"({shift_factor}): their latents would be off by it" if shift_factor else
                      "SD 1.x/2.x and SDXL-family pipelines too (scaling_factor, shift 0)")
        return f"FLUX and SD3 pipelines ((z - shift_factor) * scaling_factor); {scale_only}"
    if channels == 4:
        return ("SDXL-family pipelines (latents * latents_std / scaling_factor + latents_mean) and GLM-Image's (which "
                "reads latent_channels values); FLUX and SD3 pipelines ignore latents_mean/latents_std")
    return (f"pipelines that read latent_channels ({channels}) values of latents_mean/latents_std, as diffusers' "
            "GLM-Image does; NOT SDXL-family pipelines (they read 4 values and fail on this config) nor FLUX and "
            "SD3 pipelines (they ignore latents_mean/latents_std: use --latent_norm scalar for them)")


# ============================================================================================
# Our own format: the model's state dict as safetensors, its params as config.json (any family)
# ============================================================================================
def export_safetensors(vae: torch.nn.Module, out_dir: str, resolution: int | None, scaling_factor: float = 1.0,
                       shift_factor: float = 0.0, step: int | None = None, latents_mean: list[float] | None = None,
                       latents_std: list[float] | None = None, **fields) -> None:
    """`fields`: a model's own latent normalisation (ae.Trainable.source_fields), recorded with the factors."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    state = {k: layouts.as_stored(v) for k, v in vae.state_dict().items()}
    save_file(state, os.path.join(out_dir, SAFETENSORS_WEIGHTS), metadata={"format": "pt"})  # bn.* included
    honour_umask(os.path.join(out_dir, SAFETENSORS_WEIGHTS))
    config = {**vae.params.to_dict(), "scaling_factor": scaling_factor, "shift_factor": shift_factor,
              "resolution": resolution, "step": step, "latents_mean": latents_mean, "latents_std": latents_std,
              **fields}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


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


def source_config(args, info: dict) -> dict | None:
    """The diffusers config.json of the folder the checkpoint's run started from: recorded in the run (runs since
    issue 31), else read from the folder if it is still there, else None (the export writes its own). Its
    sample_size (diffusers' tile size: 1024 for FLUX.2, not a 256 px training crop) is kept unless --resolution
    is given."""
    source, config = info.get("init_source") or {}, None
    path = os.path.join(source.get("path") or "", "config.json")
    if source.get("config"):
        config = source["config"]
    elif source.get("layout") == "diffusers" and os.path.isfile(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = None
    if config and args.resolution:
        config = {k: v for k, v in config.items() if k != "sample_size"}
    return config


def export_summary(args, info: dict, resolution: int) -> dict:
    """What every export's JSON line says of itself."""
    return {"out": args.out, "format": args.format, "checkpoint": info["checkpoint"], "step": info["step"],
            "ema": args.ema, "resolution": resolution}


def export_latent_bn(args, vae: torch.nn.Module, info: dict, resolution: int) -> int:
    """main() for a model that normalises its latents by FLUX.2's bn statistics, not by factors: --dataset_url
    re-estimates them (evaluate.latent_bn_stats: after a run that trained the encoder), else they are exported as
    the model holds them (the source's after a decoder-only fine-tune)."""
    try:
        if args.scaling_factor is not None or args.shift_factor is not None or args.latent_norm != "scalar":
            raise ConfigError("this VAE normalises its latents by FLUX.2's bn statistics, not by factors: "
                              "--scaling_factor / --shift_factor / --latent_norm do not apply (--dataset_url "
                              "re-estimates the bn statistics)")
        if args.dataset_url and resolution % (2 * vae.downsample_factor):
            raise ConfigError(f"--resolution must be a multiple of {2 * vae.downsample_factor} to re-estimate the bn "
                              f"statistics (2x2 patches of the latent), got {resolution}")
        check_data_and_out(args)
        summary = {**export_summary(args, info, resolution), "latent_norm": "bn"}
        if args.dataset_url:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            stats = evaluate.latent_bn_stats(vae.to(device), args.dataset_url, resolution, batch_size=args.batch_size,
                                             device=device, max_images=args.latent_stats_images)
            vae.cpu().set_latent_bn(torch.tensor(stats["running_mean"]), torch.tensor(stats["running_var"]))
            summary["latent_bn_images"] = stats["n_images"]
        elif info.get("train_parts") != "decoder":
            print("note: the bn statistics are exported as the checkpoint holds them; if this run trained the encoder "
                  "they describe the latents of the encoder it started from: give --dataset_url to re-estimate them",
                  file=sys.stderr)
        if args.format == "diffusers":
            families.write_diffusers(vae, args.out, resolution, {}, source_config(args, info), None)
        elif args.format == "single_file":
            summary["file"] = export_single_file(vae, args.out)
        else:
            export_safetensors(vae, args.out, resolution, step=info["step"])
    except (ConfigError, data_lib.DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def export_fields(args, vae: torch.nn.Module, info: dict, resolution: int) -> int:
    """main() for a family whose pipelines normalise latents by fields of its own config (the Wan family's and many
    diffusers classes' latents_mean/latents_std per channel, others' scaling_factor; ae.Trainable.source_fields):
    after a decoder-only fine-tune the source's values are kept; --dataset_url re-estimates them (after a run that
    trained the encoder), over clips of the run's length for a video run. The diffusers layout is the source's own
    (its class and config, every field kept, with the trained weights)."""
    try:
        if args.scaling_factor is not None or args.shift_factor is not None or args.latent_norm != "scalar":
            raise ConfigError(f"{vae.describe()} is normalised by its own config's fields "
                              f"({vae.serves()}), not by --scaling_factor / --shift_factor / --latent_norm "
                              "(--dataset_url re-estimates them)")
        if args.format == "single_file":
            raise ConfigError(f"{vae.describe()} exports as its diffusers folder (--format diffusers) or "
                              "ours (--format safetensors): this trainer writes no single file of it")
        if args.dataset_url and vae.cannot_reestimate():
            raise ConfigError(vae.cannot_reestimate())
        check_data_and_out(args)
        source = info.get("init_source") or {}
        summary = {**export_summary(args, info, resolution), "latent_norm": vae.norm_label()}
        fields = vae.source_fields(source)
        if args.dataset_url:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            # a video run's statistics over clips of its training length (every latent frame counted)
            frames = info.get("video_frames", 0) if vae.temporal_factor else 0
            stats = evaluate.latent_stats(vae.to(device), args.dataset_url, resolution, batch_size=args.batch_size,
                                          device=device, max_images=args.latent_stats_images, frames=frames,
                                          frame_stride=info.get("video_frame_stride", 1))
            vae.cpu()
            fields = vae.fields_from_stats(stats)
            summary["latent_stats"] = stats
        elif info.get("train_parts") != "decoder":
            print("note: the latent normalisation is the source's; if this run trained the encoder it describes the "
                  "latents of the encoder it started from: give --dataset_url to re-estimate it", file=sys.stderr)
        vae.set_normalisation(fields)  # (where the model holds it: a diffusers class's config or buffers)
        if args.format == "diffusers":
            families.write_diffusers(vae, args.out, resolution, fields, source_config(args, info), source.get("path"))
            summary["serves"] = vae.serves()
        else:
            export_safetensors(vae, args.out, resolution, step=info["step"], **fields)
    except (ConfigError, data_lib.DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def export_released(args, vae: torch.nn.Module, info: dict, resolution: int) -> int:
    """main() for a tiny autoencoder (tae.py): its latents are already those of the diffusion model it serves, so
    there is no normalisation to write or re-estimate. --format released writes the released layout, diffusers an
    AutoencoderTiny folder (where the architecture is one it has), safetensors ours."""
    try:
        if (args.scaling_factor is not None or args.shift_factor is not None or args.latent_norm != "scalar"
                or args.dataset_url):
            raise ConfigError(f"{vae.describe()}: its latents are its diffusion model's already (the "
                              "teacher's pipeline normalisation), so --scaling_factor / --shift_factor / --latent_norm "
                              "/ --dataset_url do not apply")
        if args.format == "single_file":
            raise ConfigError("--format single_file is the LDM/FLUX file; a tiny autoencoder's released layout is "
                              "--format released")
        check_data_and_out(args)
        summary = {**export_summary(args, info, resolution), "latent_norm": vae.norm_label()}
        source = info.get("init_source") or {}  # (an AutoencoderTiny folder's factors are kept)
        factors = {"scaling_factor": source.get("scaling_factor", 1.0), "shift_factor": source.get("shift_factor", 0.0)}
        if args.format == "released":
            name = args.name or os.path.basename(os.path.normpath(args.out))
            summary["files"] = families.write_released(vae, args.out, name)
        elif args.format == "diffusers":
            families.write_diffusers(vae, args.out, resolution, factors, None, None)
            summary["serves"] = vae.serves()
        else:
            export_safetensors(vae, args.out, resolution, step=info["step"], **factors)
    except (ConfigError, data_lib.DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


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
        norm = vae.latent_norm()  # factors, bn (the LDM family), the model's own fields, or none
        if norm == "released":
            return export_released(args, vae, info, resolution)
        if args.format == "released":
            raise ConfigError(f"--format released is the tiny autoencoders' layout (tae.py); "
                              f"{vae.describe()} exports as diffusers, safetensors or "
                              "single_file")
        if norm == "fields":
            return export_fields(args, vae, info, resolution)
        if norm == "bn":
            return export_latent_bn(args, vae, info, resolution)
        check_data_and_out(args)

        summary = export_summary(args, info, resolution)
        source = info.get("init_source") or {}
        keep_source = info.get("train_parts") == "decoder" and bool(source) and not args.dataset_url
        latents_mean = latents_std = None
        if keep_source:
            # the encoder was frozen: the latent space is the source's, and so are its factors (a factor given as a
            # flag still wins); recomputed ones would break every diffusion model trained on that latent space
            scale = source["scaling_factor"] if args.scaling_factor is None else args.scaling_factor
            shift = source["shift_factor"] if args.shift_factor is None else args.shift_factor
            latents_mean, latents_std = source.get("latents_mean"), source.get("latents_std")
            print(f"note: decoder-only fine-tune of {source['path']}: keeping its latent factors (scaling_factor "
                  f"{source['scaling_factor']}, shift_factor {source['shift_factor']}) unless given as flags",
                  file=sys.stderr)
        elif args.dataset_url:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            stats = evaluate.latent_stats(vae.to(device), args.dataset_url, resolution, batch_size=args.batch_size,
                                          device=device, max_images=args.latent_stats_images)
            vae.cpu()
            if args.latent_norm == "per_channel":  # the pipeline divides by scaling_factor after latents_std
                scale, shift = 1.0, 0.0
                latents_mean, latents_std = stats["channel_mean"], stats["channel_std"]
            else:
                scale, shift = stats["scaling_factor"], stats["shift_factor"]
            summary["latent_stats"] = stats
        else:
            # per-channel statistics need --dataset_url (latents_mean/latents_std stay None)
            scale = 1.0 if args.scaling_factor is None else args.scaling_factor
            shift = 0.0 if args.shift_factor is None else args.shift_factor
            if args.scaling_factor is None and args.shift_factor is None:
                print("note: no --scaling_factor/--shift_factor or --dataset_url: writing scaling_factor 1.0 and "
                      "shift_factor 0.0 (compute them with evaluate.py --latent_stats)", file=sys.stderr)
        if args.format == "diffusers":
            families.write_diffusers(vae, args.out, resolution, dict(
                scaling_factor=scale, shift_factor=shift, latents_mean=latents_mean, latents_std=latents_std),
                source_config(args, info), None)
        elif args.format == "single_file":
            summary["file"] = export_single_file(vae, args.out, scale, shift)
        else:
            export_safetensors(vae, args.out, resolution, scale, shift, info["step"], latents_mean, latents_std)
    except (ConfigError, data_lib.DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary.update(latent_norm=args.latent_norm, scaling_factor=scale, shift_factor=shift)
    if args.format == "diffusers":  # the single file carries no normalisation; safetensors is read by our code
        summary["serves"] = pipelines_served("per_channel" if latents_mean is not None else "scalar",
                                             vae.params.z_channels, shift)
        print(f"note: the latent normalisation written serves {summary['serves']}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
