"""The LDM family's layouts, both ways (families.py is the registry that calls them): diffusers' AutoencoderKL /
AutoencoderKLFlux2 folder and the LDM/FLUX single file for ae.py's model; the Wan family's are wan_layouts.py's.

    source = families.load_source("black-forest-labs/FLUX.1-dev/ae.safetensors")    # or a diffusers folder,
    source.params, source.state, source.factors                                       # an SD VAE / SD checkpoint
    vae = ldm_layouts.narrow_decoder_model(source, (96, 192, 384, 384))                # the same latent space,
                                                                                      # a narrower decoder
    ldm_layouts.export_diffusers(vae, "out", 512, scaling_factor=0.3611, shift_factor=0.1159)   # and back

`load_ldm_folder` and `load_single_file` read a diffusers folder (config.json + weights), FLUX.1's or FLUX.2's
`ae.safetensors`, an SD/LDM VAE file (with `quant_conv`), or a full SD checkpoint whose VAE keys carry
`first_stage_model.` (or `vae.`): they return the architecture (read from the config or from the weights' shapes,
never from flags), the weights in ae.py's names and the latent factors (z' = (z - shift_factor) * scaling_factor;
the config's, or for a single file the released values of its family). FLUX.2 normalises its latent otherwise: by the
running statistics of a BatchNorm (`bn`) over the 2x2-patchified latent, which travel with the weights
(`bn.running_mean`, `bn.running_var`: ae.AutoEncoder's buffers when params.latent_bn) while its factors are the
identity.

The two FLUX.2 layouts (diffusers' scripts/convert_flux2_to_diffusers.py maps one onto the other; BFL's
flux2/src/flux2/autoencoder.py defines the single file):
  diffusers AutoencoderKLFlux2: AutoencoderKL's names, `quant_conv.*`, `post_quant_conv.*`, `bn.running_mean`,
      `bn.running_var`, `bn.num_batches_tracked`; config `batch_norm_eps`, `batch_norm_momentum`, `patch_size`, and
      `decoder_block_out_channels` for a decoder narrower than the encoder (BFL's FLUX.2-small-decoder).
  BFL's ae.safetensors: the LDM names of FLUX.1's file, the quant convs inside the encoder and decoder
      (`encoder.quant_conv.*`, `decoder.post_quant_conv.*`), and `bn.running_mean`, `bn.running_var` (and
      `bn.num_batches_tracked`, which BFL's strict load_state_dict expects); eps 1e-4 and momentum 0.1 are BFL's
      constants, not in the file.
`check_export` and `export` are this family's writer for export.py (through families.export): the factors a
decoder-only fine-tune keeps, measures (--dataset_url) or takes from the flags, or FLUX.2's bn statistics, written
as a diffusers folder, the single file or our safetensors.
What every family's layouts share (`Source`, reading a folder or a weights file) is layouts.py's.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import replace

import torch
from torch import Tensor

from ae import AutoEncoder, AutoEncoderParams, check_widths
from common import ConfigError, honour_umask
from config import DECODER_INITS, FAMILY_CHOICES
from layouts import (DIFFUSERS_WEIGHTS, ExportRequest, Source, SourceError, as_stored, export_safetensors, kept_config,
                     read_weights)

SINGLE_FILE_WEIGHTS = "ae.safetensors"  # export.py --format single_file

# Released latent factors of each family (the diffusers configs of the released VAEs). FLUX.2's are the identity:
# its pipeline normalises by the bn statistics in the weights instead.
FAMILIES = {
    "sd": {"scaling_factor": 0.18215, "shift_factor": 0.0},  # SD 1.x / 2.x
    "sdxl": {"scaling_factor": 0.13025, "shift_factor": 0.0},
    "sd3": {"scaling_factor": 1.5305, "shift_factor": 0.0609},
    "flux": {"scaling_factor": 0.3611, "shift_factor": 0.1159},
    "flux2": {"scaling_factor": 1.0, "shift_factor": 0.0},
}
# What each family's latent space is, as a file's shapes show it: its channel count, and whether bn statistics
# normalise it (FLUX.2). A family the file contradicts would pair a latent space with another's factors.
FAMILY_LATENT_CHANNELS = {"sd": 4, "sdxl": 4, "sd3": 16, "flux": 16, "flux2": 32}
BN_FAMILIES = ("flux2",)
# BFL's FLUX.2 single file keeps the quant convs inside the encoder and the decoder; ours (and LDM's) at the top
BFL_QUANT_CONV_NAMES = (("encoder.quant_conv.", "quant_conv."), ("decoder.post_quant_conv.", "post_quant_conv."))
LDM_PREFIXES = ("first_stage_model.", "vae.")  # where a full checkpoint keeps its VAE (as diffusers' LDM_VAE_KEYS)
# a key only the diffusion model of a full checkpoint has, per family (diffusers' CHECKPOINT_KEY_NAMES)
FAMILY_MARKERS = (("sd3", "model.diffusion_model.joint_blocks.0."), ("flux", "model.diffusion_model.double_blocks.0."),
                  ("sdxl", "conditioner.embedders.1."))


# ============================================================================================
# diffusers AutoencoderKL: config and state-dict conversion
# ============================================================================================
def diffusers_class(params: AutoEncoderParams) -> str:
    """The diffusers class that holds a model of these params. AutoencoderKL has one block_out_channels for encoder
    and decoder; of the classes with a decoder width of their own, AutoencoderKLFlux2 alone has AutoencoderKL's
    Encoder and Decoder (AsymmetricAutoencoderKL's decoder is a MaskConditionDecoder with an inpainting branch and
    always quant convs; AutoencoderTiny and ConsistencyDecoderVAE are other networks). So a narrower decoder of any
    family is exported as an AutoencoderKLFlux2, whose unused bn keeps BatchNorm's defaults where the family has
    factors (export_diffusers writes them into its config)."""
    narrow = params.decoder_widths != params.encoder_channels
    return "AutoencoderKLFlux2" if params.latent_bn or narrow else "AutoencoderKL"


def flux2_config(params: AutoEncoderParams, resolution: int) -> dict:
    """AutoencoderKLFlux2's constructor arguments for `params` (decoder_block_out_channels only when narrower)."""
    levels = len(params.ch_mult)
    narrow = params.decoder_widths != params.encoder_channels
    return dict(
        in_channels=params.in_channels, out_channels=params.out_ch,
        down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=list(params.encoder_channels),
        decoder_block_out_channels=list(params.decoder_widths) if narrow else None,
        layers_per_block=params.num_res_blocks, act_fn="silu", latent_channels=params.z_channels,
        norm_num_groups=params.norm_groups, sample_size=resolution, use_quant_conv=params.quant_conv,
        use_post_quant_conv=params.quant_conv, mid_block_add_attention=params.use_attn,
        batch_norm_eps=params.latent_bn_eps, batch_norm_momentum=params.latent_bn_momentum, patch_size=[2, 2])


def diffusers_config(params: AutoEncoderParams, resolution: int, scaling_factor: float, shift_factor: float,
                     latents_mean: list | None = None, latents_std: list | None = None) -> dict:
    """AutoencoderKL's constructor arguments (diffusers_class(params) == "AutoencoderKL")."""
    levels = len(params.ch_mult)
    config = dict(
        in_channels=params.in_channels, out_channels=params.out_ch,
        down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=[params.ch * m for m in params.ch_mult], layers_per_block=params.num_res_blocks,
        act_fn="silu", latent_channels=params.z_channels, norm_num_groups=params.norm_groups,
        sample_size=resolution, scaling_factor=scaling_factor, shift_factor=shift_factor,
        force_upcast=True, use_quant_conv=params.quant_conv, use_post_quant_conv=params.quant_conv,
        mid_block_add_attention=params.use_attn,
        latents_mean=None if latents_mean is None else list(latents_mean),
        latents_std=None if latents_std is None else list(latents_std))
    return config


def diffusers_key(name: str, levels: int) -> str:
    """Our (LDM/FLUX) parameter name -> diffusers' AutoencoderKL name. diffusers numbers the decoder's
    up_blocks from the lowest resolution, our decoder.up from the highest. quant_conv/post_quant_conv keep
    their names."""
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


def _with_constant_logvar(state: dict[str, Tensor], params: AutoEncoderParams) -> dict[str, Tensor]:
    """Released layouts' encoders output (mean, logvar): a constant log-variance is zero weights + a bias."""
    if params.posterior != "constant":
        return state
    state = dict(state)
    weight, bias = state["encoder.conv_out.weight"], state["encoder.conv_out.bias"]
    state["encoder.conv_out.weight"] = torch.cat([weight, torch.zeros_like(weight)])
    state["encoder.conv_out.bias"] = torch.cat([bias, torch.full_like(bias, math.log(params.posterior_var))])
    return state


def to_diffusers_state_dict(state: dict[str, Tensor], params: AutoEncoderParams) -> dict[str, Tensor]:
    levels = len(params.ch_mult)
    out = {}
    for name, value in _with_constant_logvar(state, params).items():
        key = diffusers_key(name, levels)
        if ".attentions.0.to_" in key and value.dim() == 4:
            value = value[:, :, 0, 0]  # 1x1 convs become diffusers' linear layers
        out[key] = as_stored(value)
    return out


def _constant_logvar(state: dict[str, Tensor], z: int, quant_conv: bool) -> float | None:
    """The constant posterior's variance if the encoder's log-variance half has zero weights and one bias (how
    this trainer writes it), else None (a learned posterior). With quant convs the posterior is learned."""
    weight, bias = state.get("encoder.conv_out.weight"), state.get("encoder.conv_out.bias")
    if quant_conv or weight is None or bias is None or weight.shape[0] != 2 * z:
        return None
    if bool((weight[z:] == 0).all() and (bias[z:] == bias[z]).all()):
        return math.exp(bias[z].item())
    return None


def _shapes(params: AutoEncoderParams) -> dict[str, Tensor]:
    """The model's state dict on the meta device: names and shapes without allocating or initialising weights."""
    with torch.device("meta"):
        return AutoEncoder(params).state_dict()


def _fit(params: AutoEncoderParams, lookup, where: str) -> dict[str, Tensor]:
    """Our state dict for `params`, each tensor from lookup(our name) (None when absent); one SourceError line
    naming the keys that do not fit."""
    try:
        model_state = _shapes(params)
    except (ValueError, RuntimeError) as e:
        raise SourceError(f"{where}: its architecture is not supported ({e})") from None
    ours, missing, wrong = {}, [], []
    constant = params.posterior == "constant"
    for name, like in model_state.items():
        value = lookup(name)
        if value is None and name == "bn.num_batches_tracked":
            value = torch.zeros((), dtype=torch.long)  # a count of no consequence (momentum is set): not required
        if value is None:
            missing.append(name)
            continue
        if name.startswith("encoder.conv_out.") and constant and value.shape[0] == 2 * like.shape[0]:
            value = value[:like.shape[0]]  # drop the constant log-variance channels
        if value.numel() != like.numel():
            wrong.append(f"{name} {list(value.shape)} vs {list(like.shape)}")
            continue
        # attention linears / conv1d are our 1x1 convs; num_batches_tracked stays an integer
        ours[name] = value.reshape(like.shape).to(like.dtype)
    if missing or wrong:
        parts = ([f"{len(missing)} missing (e.g. {', '.join(missing[:3])})"] if missing else []) + \
                ([f"{len(wrong)} of another shape (e.g. {'; '.join(wrong[:2])})"] if wrong else [])
        raise SourceError(f"{where}: keys do not fit the architecture read from it: {', '.join(parts)}")
    return ours


def from_diffusers_state_dict(state: dict[str, Tensor], config: dict,
                              where: str = "the folder") -> tuple[AutoEncoderParams, dict[str, Tensor]]:
    """An AutoencoderKL's or AutoencoderKLFlux2's config and weights -> our params and state dict. The posterior
    comes back as it went out: a log-variance half of `conv_out` with zero weights and one constant bias is the
    constant posterior (variance exp(bias)); anything else (every released VAE) is a learned one. An
    AutoencoderKLFlux2 is FLUX.2's (latent_bn) unless its config carries a scaling_factor (a narrower decoder of
    another family, as export_diffusers writes it; FLUX.2's own configs have none), whose bn is then unused
    and not loaded. SourceError (one line) for a config or weights ae.py cannot hold."""
    kind = config.get("_class_name", "AutoencoderKL")
    if kind not in ("AutoencoderKL", "AutoencoderKLFlux2"):
        raise SourceError(f"{where}: a {kind}, not an AutoencoderKL or AutoencoderKLFlux2")
    flux2 = kind == "AutoencoderKLFlux2"
    latent_bn = flux2 and "scaling_factor" not in config
    try:
        quant = bool(config.get("use_quant_conv", True))
        if quant != bool(config.get("use_post_quant_conv", True)):
            raise SourceError(f"{where}: use_quant_conv without use_post_quant_conv (or the reverse) is not supported")
        kinds = set(config.get("down_block_types", ["DownEncoderBlock2D"])) | \
            set(config.get("up_block_types", ["UpDecoderBlock2D"]))
        if kinds - {"DownEncoderBlock2D", "UpDecoderBlock2D"} or config.get("act_fn", "silu") != "silu":
            raise SourceError(f"{where}: block types {sorted(kinds)} / act_fn {config.get('act_fn')} are not the "
                              "AutoencoderKL of SD/SDXL/SD3/FLUX")
        channels = list(config["block_out_channels"])
        if any(c % channels[0] for c in channels):
            raise SourceError(f"{where}: block_out_channels {channels} are not multiples of the first")
        decoder = list(config.get("decoder_block_out_channels") or channels) if flux2 else channels
        if latent_bn and list(config.get("patch_size", [2, 2])) != [2, 2]:
            raise SourceError(f"{where}: patch_size {config.get('patch_size')}: FLUX.2's pipeline patchifies 2x2, "
                              "the only patch its bn statistics are supported for")
        z = config["latent_channels"]
        variance = _constant_logvar(state, z, quant)
        params = AutoEncoderParams(
            in_channels=config.get("in_channels", 3), out_ch=config.get("out_channels", 3), ch=channels[0],
            ch_mult=tuple(c // channels[0] for c in channels), num_res_blocks=config["layers_per_block"],
            z_channels=z, use_attn=config.get("mid_block_add_attention", True),
            posterior="learned" if variance is None else "constant",
            posterior_var=0.1 if variance is None else variance,
            norm_groups=config.get("norm_num_groups", 32), quant_conv=quant,
            decoder_channels=tuple(decoder) if decoder != channels else (), latent_bn=latent_bn,
            latent_bn_eps=float(config.get("batch_norm_eps", 1e-4)),
            latent_bn_momentum=float(config.get("batch_norm_momentum", 0.1)))
    except KeyError as e:
        raise SourceError(f"{where}: config.json has no {e}") from None
    levels = len(params.ch_mult)
    return params, _fit(params, lambda name: state.get(diffusers_key(name, levels)), where)


# ============================================================================================
# Writing ae.py's model back: a diffusers AutoencoderKL / AutoencoderKLFlux2 folder, the LDM/FLUX single file
# ============================================================================================
# What an export of a run that started from a diffusers folder keeps from that folder's config: what training does
# not change (sample_size sets diffusers' tile size; force_upcast its pipelines' fp32 decode; FLUX.2's bn momentum).
FROM_SOURCE_CONFIG = ("sample_size", "force_upcast", "batch_norm_momentum")


def with_source_config(config: dict, source_config: dict | None, model_class) -> dict:
    """`config` (what this trainer writes for the model) over the source folder's: the source's values of
    FROM_SOURCE_CONFIG, and its entries `config` lacks that `model_class` takes (diffusers' own options); the
    architecture and the latent factors stay `config`'s, since they are what training may change."""
    if not source_config:
        return config
    accepted = constructor_args(model_class)
    kept = {k: v for k, v in source_config.items() if k in accepted and (k not in config or k in FROM_SOURCE_CONFIG)}
    return {**config, **kept}


def constructor_args(model_class) -> set[str]:
    import inspect
    return set(inspect.signature(model_class.__init__).parameters)


def keep_source_extras(model, source_config: dict | None) -> None:
    """The source config's entries that the model's class does not take (FLUX.2's force_upcast on an
    AutoencoderKLFlux2, which diffusers kept in its config when it loaded the folder): kept in the export's config,
    where pipelines read them from model.config."""
    extras = {k: v for k, v in (source_config or {}).items()
              if not k.startswith("_") and k not in constructor_args(type(model)) and k not in model.config}
    if extras:
        model.register_to_config(**extras)


def export_diffusers(vae: AutoEncoder, out_dir: str, resolution: int, scaling_factor: float = 1.0,
                     shift_factor: float = 0.0, latents_mean: list[float] | None = None,
                     latents_std: list[float] | None = None, source_config: dict | None = None) -> None:
    """Write `out_dir/config.json` and `diffusion_pytorch_model.safetensors` of a diffusers AutoencoderKL, or of an
    AutoencoderKLFlux2 (diffusers_class): FLUX.2's VAE with its bn statistics (and
    decoder_block_out_channels where its decoder is narrower), or a narrower decoder of another family, whose
    factors then ride in its config as entries diffusers keeps in `model.config`.
    The converted weights are loaded strictly into the diffusers model before saving: a key or shape mismatch
    fails here, not in the user's pipeline. ValueError for factors on a model that normalises by bn.
    `source_config`: the diffusers config.json of the folder the run started from (--init_from), whose settings
    that training does not change are kept (with_source_config)."""
    params = vae.params
    if params.clamp_th > 0:
        print(f"warning: this model clamps its posterior mean to +-{params.clamp_th}; diffusers' AutoencoderKL does "
              "not clamp, so latents of unusual inputs may exceed that range", file=sys.stderr)
    state = to_diffusers_state_dict(vae.state_dict(), params)
    if diffusers_class(params) == "AutoencoderKL":
        from diffusers import AutoencoderKL
        model = AutoencoderKL(**with_source_config(diffusers_config(
            params, resolution, scaling_factor, shift_factor, latents_mean, latents_std), source_config, AutoencoderKL))
    else:
        model = flux2_model(params, resolution, source_config)
        if params.latent_bn:
            if (scaling_factor, shift_factor, latents_mean, latents_std) != (1.0, 0.0, None, None):
                raise ValueError("a VAE with FLUX.2's bn statistics normalises its latents by them: AutoencoderKLFlux2 "
                                 "has no scaling/shift factors or latents_mean/latents_std")
        else:
            # a narrower decoder of a family with factors: its pipelines read them from model.config, where diffusers
            # keeps config.json entries the constructor does not take (ConfigMixin's hidden config, with a logged
            # warning); their presence also tells from_diffusers_state_dict that the bn is unused, which
            # keeps BatchNorm's defaults
            state.update({f"bn.{k}": v for k, v in model.bn.state_dict().items()})
            model.register_to_config(scaling_factor=scaling_factor, shift_factor=shift_factor,
                                     latents_mean=None if latents_mean is None else list(latents_mean),
                                     latents_std=None if latents_std is None else list(latents_std),
                                     force_upcast=(source_config or {}).get("force_upcast", True))
    keep_source_extras(model, source_config)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    honour_umask(os.path.join(out_dir, DIFFUSERS_WEIGHTS))


def flux2_model(params, resolution: int, source_config: dict | None = None):
    """diffusers' AutoencoderKLFlux2 for `params` (over the source folder's config: with_source_config); ConfigError
    (one line) where the installed diffusers lacks it or, for a narrower decoder, its decoder_block_out_channels
    (diffusers 0.38)."""
    import inspect
    try:
        from diffusers import AutoencoderKLFlux2
    except ImportError:
        raise ConfigError("this export is an AutoencoderKLFlux2, which the installed diffusers lacks: "
                          "pip install 'diffusers>=0.38'") from None
    config = flux2_config(params, resolution)
    if "decoder_block_out_channels" not in inspect.signature(AutoencoderKLFlux2.__init__).parameters:
        if config["decoder_block_out_channels"] is not None:
            raise ConfigError("a decoder narrower than the encoder needs AutoencoderKLFlux2's "
                              "decoder_block_out_channels: pip install 'diffusers>=0.38'")
        del config["decoder_block_out_channels"]
    return AutoencoderKLFlux2(**with_source_config(config, source_config, AutoencoderKLFlux2))


def export_single_file(vae: AutoEncoder, out_dir: str, scaling_factor: float | None = None,
                       shift_factor: float | None = None) -> str:
    """`out_dir/ae.safetensors` in the LDM/FLUX single-file layout: what FLUX's `ae.safetensors` and SD's VAE files
    (`vae-ft-mse-840000-ema-pruned.safetensors`, with quant_conv) hold, loadable by their own code, by
    `--init_from` and by diffusers' `AutoencoderKL.from_single_file` (with `config=` the family's diffusers
    folder: the file carries no latent factors). Returns the path."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, SINGLE_FILE_WEIGHTS)
    metadata = {"format": "pt"}  # the factors ride along as metadata for the reader's information
    metadata.update({k: str(v) for k, v in (("scaling_factor", scaling_factor), ("shift_factor", shift_factor))
                     if v is not None})
    # what the layout cannot hold, for --init_from, evaluate.py and export.py to read back (py)
    recorded = {name: getattr(vae.params, name) for name in SINGLE_FILE_ASSUMED
                if vae.params.latent_bn or not name.startswith("latent_bn")}
    metadata.update({k: str(v) for k, v in recorded.items()})
    unusual = [f"{k} {v}" for k, v in recorded.items() if v != SINGLE_FILE_ASSUMED[k]]
    if unusual:
        assumed = ", ".join(f"{k.split()[0]} {SINGLE_FILE_ASSUMED[k.split()[0]]}" for k in unusual)
        print(f"warning: {SINGLE_FILE_WEIGHTS} records {', '.join(unusual)} in its metadata, which only this trainer "
              f"reads: BFL's and diffusers' single-file loaders assume {assumed}, another model; --format diffusers "
              "carries them for every reader", file=sys.stderr)
    save_file(single_file_state_dict(vae), path, metadata=metadata)
    honour_umask(path)
    return path


# ============================================================================================
# The LDM/FLUX single file: our names, with the log-variance channels of the released layout
# ============================================================================================
def params_from_ldm_state(state: dict[str, Tensor], where: str) -> AutoEncoderParams:
    """The architecture of LDM/FLUX-named VAE weights (quant convs at the top: from_bfl_names first), read from the
    tensors' shapes, the decoder's widths included (GroupNorm's group count is not in the weights: every released
    VAE uses 32; nor are FLUX.2's bn eps and momentum: BFL's constants, ae.py's defaults)."""
    def shape(key):
        if key not in state:
            raise SourceError(f"{where}: no {key}: not a VAE in the LDM/FLUX layout")
        return state[key].shape
    ch = shape("encoder.conv_in.weight")[0]
    levels = 1 + max(int(m[1]) for k in state if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
    blocks = 1 + max(int(m[1]) for k in state if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k)))
    ch_mult = []
    for level in range(levels):
        out = shape(f"encoder.down.{level}.block.0.conv1.weight")[0]
        if out % ch:
            raise SourceError(f"{where}: level {level} has {out} channels, not a multiple of conv_in's {ch}")
        ch_mult.append(out // ch)
    z = shape("decoder.conv_in.weight")[1]
    moments = shape("encoder.conv_out.weight")[0]
    if moments not in (z, 2 * z):
        raise SourceError(f"{where}: encoder.conv_out has {moments} channels for {z} latent channels")
    quant = "quant_conv.weight" in state
    variance = _constant_logvar(state, z, quant)
    learned = moments == 2 * z and variance is None
    # each decoder level's width is its first block's output; a level the encoder lacks shows as a key that does
    # not fit (_load_single_file)
    decoder = tuple(shape(f"decoder.up.{level}.block.0.conv1.weight")[0] for level in range(levels))
    encoder = tuple(ch * m for m in ch_mult)
    return AutoEncoderParams(in_channels=shape("encoder.conv_in.weight")[1], out_ch=shape("decoder.conv_out.weight")[0],
                             ch=ch, ch_mult=tuple(ch_mult), num_res_blocks=blocks, z_channels=z,
                             use_attn="encoder.mid.attn_1.q.weight" in state,
                             posterior="learned" if learned else "constant",
                             posterior_var=variance if variance is not None else 0.1, quant_conv=quant,
                             decoder_channels=decoder if decoder != encoder else (),
                             latent_bn="bn.running_mean" in state)


def _renamed(state: dict[str, Tensor], prefixes) -> dict[str, Tensor]:
    """`state` with each key's prefix `old` replaced by `new`, for the first (old, new) of `prefixes` it starts with."""
    def name(key: str) -> str:
        old, new = next(((old, new) for old, new in prefixes if key.startswith(old)), ("", ""))
        return new + key[len(old):]
    return {name(k): v for k, v in state.items()}


def from_bfl_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """BFL's FLUX.2 names -> ours: `encoder.quant_conv.*` / `decoder.post_quant_conv.*` move to the top."""
    return _renamed(state, BFL_QUANT_CONV_NAMES)


def to_bfl_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Ours -> BFL's FLUX.2 single-file names (the inverse of from_bfl_names)."""
    return _renamed(state, [(top, nested) for nested, top in BFL_QUANT_CONV_NAMES])


def single_file_state_dict(vae: AutoEncoder) -> dict[str, Tensor]:
    """The weights as FLUX's ae.safetensors / an SD VAE file holds them (LDM names; a constant posterior as
    zero-weight log-variance channels, so FLUX's and LDM's code load it). A model with bn statistics is written in
    BFL's FLUX.2 layout (quant convs inside encoder and decoder, bn.*), which BFL's AutoEncoder loads strictly."""
    state = _with_constant_logvar({k: as_stored(v) for k, v in vae.state_dict().items()}, vae.params)
    return to_bfl_names(state) if vae.params.latent_bn else state


def _single_file_family(state: dict[str, Tensor], prefix: str, z: int, notes: list[str], latent_bn: bool) -> str:
    if latent_bn:
        return "flux2"  # the only family whose file carries bn statistics (whose shapes _check_family then checks)
    if prefix:  # a full checkpoint: its diffusion model says which family it is
        for family, marker in FAMILY_MARKERS:
            if any(k.startswith(marker) for k in state):
                return family
        return "sd"
    if z == 4:
        notes.append("a 4-channel VAE file does not say whether it is SD 1.x/2.x's or SDXL's: taking SD 1.x/2.x's "
                     "scaling_factor 0.18215 (give --init_family sdxl for SDXL's 0.13025)")
        return "sd"
    if z == 16:
        notes.append("a 16-channel VAE file without its diffusion model is taken as FLUX.1's (scaling 0.3611, "
                     "shift 0.1159; give --init_family sd3 for SD3's)")
        return "flux"
    raise SourceError(f"a {z}-channel VAE file is none of the known families: give --init_family, or load it as a "
                      "diffusers folder (its config.json carries the latent factors)")


def _check_family(family: str, params: AutoEncoderParams, path: str, given: bool) -> None:
    """SourceError (one line) where the file's shapes contradict the family: its factors (or FLUX.2's bn) would
    normalise a latent space that is not the family's."""
    expected = FAMILY_LATENT_CHANNELS[family]
    flag = f"--init_family {family}" if given else f"detected as {family}"
    if params.latent_bn and family not in BN_FAMILIES:
        raise SourceError(f"{path}: {flag}, but the file carries FLUX.2's bn statistics ({params.z_channels} "
                          "latent channels normalised by bn, not by scaling factors): give --init_family flux2 or "
                          "auto")
    if family in BN_FAMILIES and not params.latent_bn:
        raise SourceError(f"{path}: {flag}, but the file has no bn statistics (bn.running_mean / bn.running_var), "
                          "which FLUX.2's latents are normalised by")
    if params.z_channels != expected:
        raise SourceError(f"{path}: {flag}, whose latent has {expected} channels, but this file's has "
                          f"{params.z_channels}")


# What the LDM/FLUX single-file layout cannot hold (no config travels with it): the GroupNorm group count and
# FLUX.2's bn eps and momentum. export.py writes them into the file's safetensors metadata, which this loader reads;
# other loaders (BFL's, diffusers' from_single_file) assume these defaults.
SINGLE_FILE_ASSUMED = {"norm_groups": 32, "latent_bn_eps": 1e-4, "latent_bn_momentum": 0.1}


def single_file_metadata(path: str) -> dict[str, str]:
    """The safetensors metadata of a file ({} for a PyTorch file or none)."""
    if not path.endswith(".safetensors"):
        return {}
    try:
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            return dict(f.metadata() or {})
    except Exception:
        return {}


def _with_recorded_fields(params: AutoEncoderParams, path: str, notes: list[str]) -> AutoEncoderParams:
    """params with what the file's metadata records of SINGLE_FILE_ASSUMED; a note names what had to be assumed."""
    recorded = single_file_metadata(path)
    values, assumed = {}, []
    for name, default in SINGLE_FILE_ASSUMED.items():
        if name.startswith("latent_bn") and not params.latent_bn:
            continue
        if name in recorded:
            try:
                values[name] = type(default)(recorded[name])
                continue
            except ValueError:
                pass
        assumed.append(f"{name} {default}")
    if assumed:
        notes.append(f"{os.path.basename(path)} does not record {', '.join(a.split()[0] for a in assumed)}: assumed "
                     f"{', '.join(assumed)} (every released FLUX/SD VAE's; a file exported by this trainer records "
                     "them)")
    return replace(params, **values)


def load_single_file(path: str, family: str = "auto") -> Source:
    """An LDM/FLUX single file (module docstring) as ae.py's model; `family`: its release, for the latent factors."""
    if family not in FAMILY_CHOICES:
        raise SourceError(f"family must be one of {FAMILY_CHOICES}, got {family!r}")
    full = read_weights(path)
    # diffusers' names (AutoencoderKL's and the Wan family's) have an encoder.conv_in.weight too: told apart first
    if "encoder.mid_block.resnets.0.conv1.weight" in full:
        raise SourceError(f"{path}: diffusers-named weights without their config: give the folder with config.json")
    prefix = next((p for p in LDM_PREFIXES if f"{p}encoder.conv_in.weight" in full), "")
    if not prefix and "encoder.conv_in.weight" not in full:
        if "decoder.middle.0.residual.0.gamma" in full:  # the original Wan repository's names (diffusers' marker)
            raise SourceError(f"{path}: a Wan 2.1 / Qwen-Image VAE in its original single-file layout: give its "
                              "diffusers folder instead (config.json + diffusion_pytorch_model.safetensors, as in "
                              "Qwen/Qwen-Image's vae/)")
        example = next(iter(full), "none")
        raise SourceError(f"{path}: no VAE of the FLUX/SD family in it (no encoder.conv_in.weight, with or without "
                          f"the {' / '.join(LDM_PREFIXES)} prefix; its first key is {example!r}): the other families "
                          "load from their diffusers folder, config.json beside the weights (docs/families.md)")
    state = from_bfl_names({k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)} if prefix else full)
    notes: list[str] = []
    params = _with_recorded_fields(params_from_ldm_state(state, path), path, notes)
    try:
        check_widths(params)
    except ValueError as e:
        raise SourceError(f"{path}: {e}" + ("" if "norm_groups" in single_file_metadata(path) else
                                           " (the file does not record its group count: 32 was assumed)")) from None
    given = family != "auto"
    if not given:
        family = _single_file_family(full, prefix, params.z_channels, notes, params.latent_bn)
    _check_family(family, params, path, given)
    expected = _shapes(params)
    extra = sorted(k for k in state if k.split(".")[0] in ("encoder", "decoder", "quant_conv", "post_quant_conv", "bn")
                   and k not in expected)
    if extra:
        raise SourceError(f"{path}: {len(extra)} keys do not fit the architecture read from it "
                          f"(e.g. {', '.join(extra[:3])})")
    ours = _fit(params, state.get, path)
    factors = {**FAMILIES[family], "latents_mean": None, "latents_std": None}
    return Source(path, "single_file", family, params, ours, factors, prefix, notes)


def _folder_factors(config: dict, notes: list[str], init_family: str, latent_bn: bool = False) -> dict:
    """The latent factors a diffusers config carries (FLUX.2's none: its bn statistics are in the weights)."""
    if init_family != "auto":
        notes.append(f"--init_family {init_family} ignored: the diffusers config carries the latent factors"
                     + (" (FLUX.2's bn statistics, in its weights)" if latent_bn else ""))
    return {"scaling_factor": float(config.get("scaling_factor", 1.0)),
            "shift_factor": float(config.get("shift_factor") or 0.0),
            "latents_mean": config.get("latents_mean"), "latents_std": config.get("latents_std")}


def load_ldm_folder(path: str, config: dict, weights: str, init_family: str = "auto") -> Source:
    """A diffusers AutoencoderKL / AutoencoderKLFlux2 folder as ae.py's model."""
    params, ours = from_diffusers_state_dict(read_weights(weights), config, path)
    notes: list[str] = []
    factors = _folder_factors(config, notes, init_family, params.latent_bn)
    return Source(path, "diffusers", "flux2" if params.latent_bn else "", params, ours, factors, "", notes,
                  kept_config(config, config.get("_class_name", "AutoencoderKL")))


# ============================================================================================
# A narrower decoder for a released latent space
# ============================================================================================
def narrow_decoder_model(source: Source, decoder_channels: tuple[int, ...], init: str = "fresh",
                         seed: int = 0) -> AutoEncoder:
    """The source's model with a decoder of other widths (one per level, highest resolution first; e.g. FLUX.2's
    small decoder 96,192,384,384 behind the 128,256,512,512 encoder). The encoder, quant_conv, post_quant_conv and
    the bn statistics are the source's, bitwise: the latent space and its normalisation (factors or bn) do not
    change, so diffusion models trained on the source's latents keep working once the decoder is trained.
    The decoder starts
      fresh: as a new model's decoder is initialised (PyTorch's defaults, under torch.manual_seed(seed), the
             global generator left as it was); the rule to use when it is distilled from the source's decoder;
      slice: from the source's decoder, every tensor cut to the leading entries of each dimension (a level of k
             channels keeps channels 0..k-1 of the wide level's, in every conv's inputs and outputs, norm affine
             and attention projection). A warm start, not an approximation: the dropped channels' contributions
             are gone from every sum and GroupNorm regroups the kept ones, so it decodes badly until trained.
             Needs every width <= the source's. Where the widths' pattern differs, a block's 1x1 shortcut
             (nin_shortcut, present when its input and output widths differ) may exist in one decoder only: the
             wide one's is then dropped, the narrow one's starts fresh.
    ValueError (one line) for widths the model cannot have or an unknown init."""
    if init not in DECODER_INITS:
        raise ValueError(f"decoder init must be one of {DECODER_INITS}, got {init!r}")
    wide = source.params
    params = replace(wide, decoder_channels=tuple(int(c) for c in decoder_channels))
    if params.decoder_widths == wide.encoder_channels:
        params = replace(params, decoder_channels=())  # the encoder's widths: the canonical form
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoEncoder(params)  # ValueError for widths the model cannot have
    state = model.state_dict()
    for name, value in source.state.items():
        if not name.startswith("decoder."):
            state[name] = value.clone()
        elif init == "slice" and name in state:  # a 1x1 shortcut only one of them has: dropped, or kept fresh
            narrow = state[name]
            if any(n > w for n, w in zip(narrow.shape, value.shape)):
                raise ValueError(f"decoder init slice needs every decoder width <= the source's "
                                 f"{list(wide.decoder_widths)}, got {list(params.decoder_widths)}")
            state[name] = value[tuple(slice(0, n) for n in narrow.shape)].clone()
    model.load_state_dict(state)
    return model.eval()


# ============================================================================================
# export.py's writer for ae.py's model: the latent normalisation its pipelines read, and the layout written
# ============================================================================================
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


def check_export(vae: AutoEncoder, request: ExportRequest) -> None:
    """ConfigError (one line) for what an export of this model cannot do: factor flags on a model that normalises by
    FLUX.2's bn statistics, or a --resolution they cannot be re-estimated at."""
    if vae.latent_norm() != "bn":
        return
    if request.factor_flags:
        raise ConfigError("this VAE normalises its latents by FLUX.2's bn statistics, not by factors: "
                          "--scaling_factor / --shift_factor / --latent_norm do not apply (--dataset_url "
                          "re-estimates the bn statistics)")
    if request.statistics and request.resolution % (2 * vae.downsample_factor):
        raise ConfigError(f"--resolution must be a multiple of {2 * vae.downsample_factor} to re-estimate the bn "
                          f"statistics (2x2 patches of the latent), got {request.resolution}")


def export(vae: AutoEncoder, request: ExportRequest) -> dict:
    """Write ae.py's model as --format asks (diffusers: export_diffusers; single_file: export_single_file;
    safetensors: ours), normalised for its pipelines: by FLUX.2's bn statistics (export_latent_bn) or by factors
    (export_factors). Returns the JSON line's fields."""
    return (export_latent_bn if vae.latent_norm() == "bn" else export_factors)(vae, request)


def export_latent_bn(vae: AutoEncoder, request: ExportRequest) -> dict:
    """A model that normalises its latents by FLUX.2's bn statistics, not by factors: --dataset_url re-estimates them
    (evaluate.latent_bn_stats: after a run that trained the encoder), else they are exported as the model holds them
    (the source's after a decoder-only fine-tune)."""
    summary = {**request.summary, "latent_norm": "bn"}
    if request.statistics:
        stats = request.statistics(vae, bn=True)
        vae.set_latent_bn(torch.tensor(stats["running_mean"]), torch.tensor(stats["running_var"]))
        summary["latent_bn_images"] = stats["n_images"]
    elif request.info.get("train_parts") != "decoder":
        print("note: the bn statistics are exported as the checkpoint holds them; if this run trained the encoder "
              "they describe the latents of the encoder it started from: give --dataset_url to re-estimate them",
              file=sys.stderr)
    if request.format == "diffusers":
        export_diffusers(vae, request.out, request.resolution, source_config=request.source_config())
    elif request.format == "single_file":
        summary["file"] = export_single_file(vae, request.out)
    else:
        export_safetensors(vae, request.out, request.resolution, step=request.info["step"])
    return summary


def export_factors(vae: AutoEncoder, request: ExportRequest) -> dict:
    """A model normalised by factors: a decoder-only fine-tune keeps its source's (a factor flag still wins);
    --dataset_url measures them (scalar, or per channel with --latent_norm per_channel); else the flags' or 1.0 / 0.0."""
    summary = dict(request.summary)
    source = request.source
    keep_source = request.info.get("train_parts") == "decoder" and bool(source) and not request.statistics
    latents_mean = latents_std = None
    if keep_source:
        # the encoder was frozen: the latent space is the source's, and so are its factors (a factor given as a
        # flag still wins); recomputed ones would break every diffusion model trained on that latent space
        scale = source["scaling_factor"] if request.scaling_factor is None else request.scaling_factor
        shift = source["shift_factor"] if request.shift_factor is None else request.shift_factor
        latents_mean, latents_std = source.get("latents_mean"), source.get("latents_std")
        print(f"note: decoder-only fine-tune of {source['path']}: keeping its latent factors (scaling_factor "
              f"{source['scaling_factor']}, shift_factor {source['shift_factor']}) unless given as flags",
              file=sys.stderr)
    elif request.statistics:
        stats = request.statistics(vae)
        if request.latent_norm == "per_channel":  # the pipeline divides by scaling_factor after latents_std
            scale, shift = 1.0, 0.0
            latents_mean, latents_std = stats["channel_mean"], stats["channel_std"]
        else:
            scale, shift = stats["scaling_factor"], stats["shift_factor"]
        summary["latent_stats"] = stats
    else:
        # per-channel statistics need --dataset_url (latents_mean/latents_std stay None)
        scale = 1.0 if request.scaling_factor is None else request.scaling_factor
        shift = 0.0 if request.shift_factor is None else request.shift_factor
        if request.scaling_factor is None and request.shift_factor is None:
            print("note: no --scaling_factor/--shift_factor or --dataset_url: writing scaling_factor 1.0 and "
                  "shift_factor 0.0 (compute them with evaluate.py --latent_stats)", file=sys.stderr)
    if request.format == "diffusers":
        export_diffusers(vae, request.out, request.resolution, scale, shift, latents_mean, latents_std,
                         request.source_config())
    elif request.format == "single_file":
        summary["file"] = export_single_file(vae, request.out, scale, shift)
    else:
        export_safetensors(vae, request.out, request.resolution, scale, shift, request.info["step"], latents_mean,
                           latents_std)
    summary.update(latent_norm=request.latent_norm, scaling_factor=scale, shift_factor=shift)
    if request.format == "diffusers":  # the single file carries no normalisation; safetensors is read by our code
        summary["serves"] = pipelines_served("per_channel" if latents_mean is not None else "scalar",
                                             vae.params.z_channels, shift)
        print(f"note: the latent normalisation written serves {summary['serves']}", file=sys.stderr)
    return summary
