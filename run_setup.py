"""From argv to a run that can start: the disk and network work of finishing a config (config.py holds only
values). In order: the flags and --demo's values, the demo's bundled data and its VGG16 choice, the architecture
of an --init_from source, the recipe of the run this one continues (every value not given again; the automatic
values derived again where their basis changed), the remaining automatic values, the checks of values
(Config.validate), then those of paths and remote data.

    setup = prepare_run(sys.argv[1:])     # RunSetup: cfg, given, source, notes, derived; ConfigError: one line
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import data as data_lib
import pretrained
import shards
import wan_ae
from common import ConfigError
from config import (AUTO_FIELDS, LEGACY_ARCH, LR_TIMES_WIDTH, SOURCE_FIELDS, Config, as_released, automatic_values,
                    continue_run, continuing_note, demo_summary, is_plain_local_path, model_params, parse_flags,
                    resolve_auto, with_values)
from weights import vgg16_cache_path


@dataclass
class RunSetup:
    """A finished run config and what was learned on the way to it: the flags the user gave, the --init_from
    source read (None if none: its weights go into the model), notes for the user, and `derived`: {automatic
    field: what it was derived from} (config.json's record, read back when the run continues)."""
    cfg: Config
    given: set[str]
    source: pretrained.Source | None
    notes: list[str]
    derived: dict[str, str | None]

    def __iter__(self):  # cfg, given, source, notes = prepare_run(...)
        return iter((self.cfg, self.given, self.source, self.notes))


def prepare_run(argv: list[str] | None = None, builds_demo_data: bool = True) -> RunSetup:
    """argv -> the run's finished, validated config (RunSetup). `builds_demo_data`: this process builds the demo's
    shards (local rank 0); the others wait for them. Raises ConfigError (one line) for anything the user can fix."""
    cfg, given = parse_flags(argv)
    if cfg.run.demo:
        if not builds_demo_data:
            shards.wait_for_demo_shards(os.path.join(cfg.run.output_dir, "demo_data"))
        cfg = prepare_demo(cfg)
    cfg, source = apply_init_source(cfg, given)
    saved = saved_run_config(cfg, given | (set(SOURCE_FIELDS) if source is not None else set()))
    derived, again = {}, []
    if saved is not None:
        cfg, derived, again = continue_run(cfg, given, saved)
    if cfg.model.vae_family != "ldm" and source is None and saved is None:
        raise ConfigError(f"--vae_family {cfg.model.vae_family}: its architecture is read from --init_from (a "
                          "diffusers AutoencoderKLQwenImage / AutoencoderKLWan folder) or the run being continued")
    derived.update(automatic_values(cfg, given))
    cfg = resolve_auto(cfg)
    cfg.validate()
    check_paths(cfg)
    notes = [demo_summary(cfg)] if cfg.run.demo else []
    if saved is not None:
        note = continuing_note(cfg.run.run_dir, given, saved, cfg, again)
        notes += [note] if note else []
    return RunSetup(cfg, given, source, notes, derived)


def prepare_demo(cfg: Config) -> Config:
    """Point the demo at its bundled shards (built once) and pick VGG weights it can use offline."""
    train_url, test_url = shards.ensure_demo_shards(os.path.join(cfg.run.output_dir, "demo_data"))
    changes = {}
    if not cfg.data.dataset_url:
        changes["dataset_url"] = train_url
    if not cfg.data.test_dataset_url:
        changes["test_dataset_url"] = test_url
    if cfg.critic.vgg16_weights == "torchvision" and not os.path.isfile(vgg16_cache_path()):
        # LPIPS and the VGG16 critic on a random VGG16 would train on noise gradients: switch both off
        # (demo_summary says so); --vgg16_weights random asks for them anyway, with the loud warning
        changes.update(vgg16_weights="random", perceptual_weight=0.0, do_ganloss=False)
    return with_values(cfg, **changes)


def read_init_source(init_from: str, init_family: str) -> pretrained.Source:
    try:
        return pretrained.load_source(init_from, init_family)
    except pretrained.SourceError as e:
        raise ConfigError(f"--init_from {e}") from None


def apply_init_source(cfg: Config, given: set[str] = frozenset()) -> tuple[Config, pretrained.Source | None]:
    """--init_from: load the source and take the run's architecture from it (one ConfigError line if it does not
    load), but for a --vae_decoder_ch the user gave: a decoder of its own widths for the source's latent space,
    which then trains from the rate of a new decoder of its width when it starts fresh (--decoder_init) and no
    --learning_rate_vae is given (a tenth of that for a fine-tune). Runs before the checks, on every rank, before
    any process group exists."""
    init_from = cfg.finetune.init_from
    if not init_from:
        return cfg, None
    run_config = os.path.join(cfg.run.run_dir, "config.json")
    if not os.path.exists(init_from) and cfg.run.resume != "never" and os.path.isfile(run_config):
        # a run being resumed needs its architecture, not the source's weights: the source may have moved
        try:
            with open(run_config) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = {}
        if isinstance(saved, dict) and saved.get("init_from") == init_from:
            then = as_released(saved)
            return with_values(cfg, **{k: then[k] for k in SOURCE_FIELDS}), None
    source = read_init_source(init_from, cfg.finetune.init_family)
    p = source.params
    if (p.in_channels, p.out_ch) != (3, 3):
        raise ConfigError(f"--init_from {init_from}: a VAE of {p.in_channels} input / {p.out_ch} output "
                          "channels; this trainer reads RGB images")
    if isinstance(p, wan_ae.WanImageParams):  # its architecture travels in the source and the checkpoints; these
        # flags show it and let a resume check it (no GroupNorm: RMS norms, hence 1 group)
        if "vae_decoder_ch" in given:
            raise ConfigError(f"--vae_decoder_ch: a decoder of other widths is for the LDM family's latent spaces, "
                              f"not {init_from}'s (the Wan family)")
        decoder = "" if p.decoder_ch == p.ch else ",".join(str(p.decoder_ch * m) for m in p.ch_mult)
        return with_values(cfg, vae_family="wan", vae_ch=p.ch, vae_ch_mult=",".join(str(m) for m in p.ch_mult),
                           vae_num_res_blocks=p.num_res_blocks, vae_z_channels=p.z_channels, vae_norm_groups=1,
                           do_attn=True, posterior="learned", vae_quant_conv=True, do_clamp=False,
                           vae_decoder_ch=decoder, vae_latent_bn=False, vae_patch_size=p.patch_size), source
    arch = dict(vae_family="ldm", vae_patch_size=1, vae_ch=p.ch, vae_ch_mult=",".join(str(m) for m in p.ch_mult), vae_num_res_blocks=p.num_res_blocks,
                vae_z_channels=p.z_channels, vae_norm_groups=p.norm_groups, do_attn=p.use_attn, posterior=p.posterior,
                posterior_var=p.posterior_var, vae_quant_conv=p.quant_conv, do_clamp=False,
                vae_decoder_ch=",".join(str(c) for c in p.decoder_channels), vae_latent_bn=p.latent_bn,
                vae_latent_bn_eps=p.latent_bn_eps)
    if "vae_decoder_ch" in given:  # a decoder of its own widths for the source's latent space
        arch.pop("vae_decoder_ch")
    cfg = with_values(cfg, **arch)
    widths = model_params(cfg.model).decoder_widths
    if widths != p.decoder_widths and cfg.finetune.decoder_init == "fresh" and "learning_rate_vae" not in given:
        cfg = with_values(cfg, learning_rate_vae=LR_TIMES_WIDTH / widths[0])  # a new decoder, not a fine-tune
    return cfg, source


def saved_run_config(cfg: Config, explicit: set[str]) -> dict | None:
    """The flat finished config of the run this one continues (config.json of a run directory holding checkpoints,
    or --resume's checkpoint), or None: a new run, --resume never, or another architecture given (`explicit`: the
    fields the user or the --init_from source set; the trainer refuses it or, with --force, starts from scratch)."""
    run = cfg.run
    if run.resume == "never":
        return None
    try:
        if run.resume != "auto":
            import torch

            from checkpoint import migrate
            ckpt = migrate(torch.load(run.resume, map_location="cpu", weights_only=True))["run"]
            saved = {**ckpt.get("config", {}), **({"derived": ckpt["derived"]} if "derived" in ckpt else {})}
        elif any(re.fullmatch(r"step_\d+\.pt", f) for f in os.listdir(os.path.join(run.run_dir, "checkpoints"))):
            with open(os.path.join(run.run_dir, "config.json")) as f:
                saved = json.load(f)
        else:
            return None
    except Exception:  # no run directory, or an unreadable file: the trainer's resume logic says which
        return None
    if not isinstance(saved, dict):
        return None
    then = as_released(saved)  # a field the release that wrote it lacked: what that release did
    model = cfg.model
    same_arch = all(then[k] == getattr(model, k) for k in explicit
                    if hasattr(model, k) and getattr(model, k) != AUTO_FIELDS.get(k))  # (0 groups: automatic)
    return {**LEGACY_ARCH, **saved} if same_arch else None


def check_paths(cfg: Config) -> None:
    """The files the flags name exist, and the datasets can be read (remote shards probed): one line each,
    before any process group or worker starts."""
    critic, ev, latents, run = cfg.critic, cfg.eval, cfg.latents, cfg.run
    if critic.vgg16_weights not in ("torchvision", "random") and not os.path.isfile(critic.vgg16_weights):
        raise ConfigError(f"--vgg16_weights {critic.vgg16_weights}: no such file (or use torchvision / random)")
    if ev.inception_weights not in ("torchvision", "random", "none") and not os.path.isfile(ev.inception_weights):
        raise ConfigError(f"--inception_weights {ev.inception_weights}: no such file (or torchvision / random / "
                          "none)")
    if latents.vf_weights not in ("timm", "random") and not os.path.isfile(latents.vf_weights):
        raise ConfigError(f"--vf_weights {latents.vf_weights}: no such file (or use timm / random)")
    if run.resume not in ("auto", "never") and not os.path.isfile(run.resume):
        raise ConfigError(f"--resume {run.resume}: no such checkpoint file (or use auto / never)")
    if run.load_path and not os.path.isfile(run.load_path):
        raise ConfigError(f"--load_path {run.load_path}: no such file")
    for name in ("dataset_url", "test_dataset_url"):
        url = getattr(cfg.data, name)
        if url and is_plain_local_path(url) and not os.path.exists(url):
            raise ConfigError(f"--{name} {url}: no such directory or file")
        if name == "dataset_url" or url:
            try:
                data_lib.probe_remote_shards(data_lib.list_shards(url))
            except data_lib.DatasetError as e:
                raise ConfigError(f"--{name}: {e}") from None
