"""Everything about checkpoint files (torchtitan's checkpoint.py in spirit): writing them atomically with a
`latest` pointer and rotation, finding and loading them (falling back past an unreadable one), deciding on
rank 0 which one a run resumes from (and broadcasting that decision), refusing another architecture's, and
loading bare VAE weights. What a checkpoint holds is Trainer.checkpoint_state; this module never imports the
trainer, so evaluate.py, export.py and probe.py use it directly."""
from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist

from common import ConfigError, DistInfo, atomic_write

# A run directory written with other values of these cannot be resumed (the VAE's weights would not fit).
# The GAN settings are not among them: switching the critic on after a reconstruction-only warm-up is normal.
ARCH_FIELDS = ("vae_ch", "vae_ch_mult", "vae_num_res_blocks", "vae_z_channels", "vae_norm_groups", "do_attn",
               "posterior", "vae_quant_conv")
# What runs written before a field existed used (config.json without it): 32 groups before --vae_norm_groups,
# no quant convs before --vae_quant_conv.
LEGACY_ARCH = {"vae_norm_groups": 32, "vae_quant_conv": False}


def checkpoint_files(ckpt_dir: str) -> list[str]:
    """Checkpoints of a run, newest first (the `latest` pointer's target leads)."""
    if not os.path.isdir(ckpt_dir):
        return []
    files = sorted((os.path.join(ckpt_dir, f) for f in os.listdir(ckpt_dir) if re.fullmatch(r"step_\d+\.pt", f)),
                   reverse=True)
    pointer = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            target = os.path.join(ckpt_dir, f.read().strip())
        if target in files:
            files.remove(target)
            files.insert(0, target)
    return files


def load_checkpoint(path: str) -> dict:
    """weights_only: a checkpoint from elsewhere cannot run code when loaded."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_latest_checkpoint(ckpt_dir: str, log=print) -> tuple[str, dict] | None:
    for path in checkpoint_files(ckpt_dir):
        try:
            return path, load_checkpoint(path)
        except Exception as e:
            log(f"warning: checkpoint {path} is unreadable ({type(e).__name__}); falling back to the previous one")
    return None


def write_checkpoint(ckpt_dir: str, step: int, state: dict, keep_last_k: int) -> str:
    """step_<step>.pt, then the `latest` pointer, both atomic; older checkpoints beyond keep_last_k removed."""
    name = f"step_{step:08d}.pt"
    path = os.path.join(ckpt_dir, name)
    atomic_write(path, lambda f: torch.save(state, f))
    atomic_write(os.path.join(ckpt_dir, "latest"), lambda f: f.write(name.encode()))
    for old in checkpoint_files(ckpt_dir)[keep_last_k:]:
        if old != path:
            os.remove(old)
    return path


def load_vae_weights(path: str) -> dict:
    """A VAE state dict from one of our checkpoints, a bare state dict, or a .safetensors file."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        obj = load_checkpoint(path)
    except Exception as e:
        raise ConfigError(f"{path}: cannot be loaded as weights ({type(e).__name__})") from None
    return obj["vae"] if isinstance(obj, dict) and "vae" in obj else obj


def load_vae_weights_into(vae: torch.nn.Module, path: str) -> None:
    """--load_path: every tensor must exist here with the same shape, and the GroupNorm group count must be the
    one the weights were trained with where the file says it; else one line (load_state_dict raises a size
    mismatch as a RuntimeError listing every tensor, and loads weights of another group count without a word:
    the model then computes something else)."""
    if path.endswith(".safetensors"):
        weights, file = load_vae_weights(path), None
    else:  # read once: the whole checkpoint holds the weights and the group count (and may be large)
        try:
            file = load_checkpoint(path)
        except Exception as e:
            raise ConfigError(f"{path}: cannot be loaded as weights ({type(e).__name__})") from None
        weights = file["vae"] if isinstance(file, dict) and "vae" in file else file
    own = vae.state_dict()
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ConfigError(f"--load_path {path} holds no VAE state dict")
    missing, unexpected = [k for k in own if k not in weights], [k for k in weights if k not in own]
    if missing or unexpected:
        raise ConfigError(f"--load_path {path} does not fit this architecture "
                          f"(missing {missing[:2]}, unexpected {unexpected[:2]})")
    shapes = [(k, tuple(weights[k].shape), tuple(v.shape)) for k, v in own.items() if weights[k].shape != v.shape]
    if shapes:
        name, theirs, ours = shapes[0]
        raise ConfigError(f"--load_path {path} does not fit this architecture: {len(shapes)} tensors differ in "
                          f"shape, e.g. {name} {list(theirs)} in the file vs {list(ours)} here (--vae_ch, "
                          "--vae_ch_mult, --vae_z_channels, ... must match the weights)")
    theirs, ours = recorded_norm_groups(path, file), vae.params.norm_groups
    if theirs is not None and theirs != ours:
        raise ConfigError(f"--load_path {path} was trained with {theirs} GroupNorm groups, this model has {ours}: "
                          f"add --vae_norm_groups {theirs}")
    vae.load_state_dict(weights)


def recorded_norm_groups(path: str, file) -> int | None:
    """The GroupNorm group count the weights at `path` (`file`: the loaded checkpoint) were trained with, where
    it says: our checkpoints (model_params, else the config: runs from before --vae_norm_groups had 32), or the
    config.json that export.py --format safetensors writes beside its weights. None for a bare state dict or a
    lone .safetensors: their shapes are all that can be checked."""
    if path.endswith(".safetensors"):
        beside = os.path.join(os.path.dirname(path), "config.json")
        try:
            with open(beside) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        groups = config.get("norm_groups") if isinstance(config, dict) else None
        return groups if isinstance(groups, int) else None
    if not isinstance(file, dict) or "vae" not in file:
        return None
    if isinstance(file.get("model_params"), dict) and "norm_groups" in file["model_params"]:
        return file["model_params"]["norm_groups"]
    if isinstance(file.get("config"), dict):
        return {**LEGACY_ARCH, **file["config"]}["vae_norm_groups"]
    return None


def restore_scaler(scaler, state: dict | None) -> None:
    """Precision can change on resume: a disabled GradScaler (fp32/bf16) saves {}, which an enabled one
    refuses to load; it then starts from its initial scale, as in a new fp16 run."""
    if scaler.is_enabled() and state:
        scaler.load_state_dict(state)


# ------------------------------------------------------------------------------------- which checkpoint to resume
def check_compatible(cfg, saved: dict, where: str) -> bool:
    """False (with --force) or ConfigError if `saved` (a config dict) describes another VAE architecture."""
    saved = {**LEGACY_ARCH, **saved}
    diff = [f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in ARCH_FIELDS
            if k in saved and saved[k] != getattr(cfg, k)]
    if diff and not cfg.force:
        raise ConfigError(f"{where} was written with a different architecture ({'; '.join(diff)}): use "
                          "another --run_name, or --force to start this one from scratch")
    return not diff


def decide_resume(cfg, run_dir: str, log=print) -> tuple[tuple[str, dict] | None, bool]:
    """Rank 0: (the checkpoint to resume from or None, whether to set the run's checkpoints aside)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    existing = checkpoint_files(ckpt_dir)
    config_path = os.path.join(run_dir, "config.json")
    set_aside = False
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config_path} is unreadable ({type(e).__name__}): fix or remove it") from None
        if not check_compatible(cfg, saved, config_path) and existing:
            set_aside, existing = True, []
    if cfg.resume == "never":
        if existing:
            raise ConfigError(f"{run_dir} already holds checkpoints and --resume never was given: "
                              "choose another --run_name or --output_dir")
        return None, set_aside
    if cfg.resume == "auto":
        found = load_latest_checkpoint(ckpt_dir, log) if existing else None
        if existing and found is None:
            raise ConfigError(f"no readable checkpoint in {ckpt_dir}")
    else:
        try:
            found = (cfg.resume, load_checkpoint(cfg.resume))
        except Exception as e:
            raise ConfigError(f"--resume {cfg.resume}: unreadable checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if found is not None and not check_compatible(cfg, found[1]["config"], found[0]):
        # --force with a checkpoint of another architecture: start from scratch (keeping the run's own aside)
        return None, set_aside or cfg.resume == "auto"
    return found, set_aside


def find_resume(cfg, info: DistInfo, run_dir: str, log=print) -> tuple[tuple[str, dict] | None, bool]:
    """Rank 0 alone reads the run directory and decides (decide_resume): resume from which checkpoint, start
    anew, set the checkpoints of another architecture aside, or refuse. The decision is broadcast over the
    control group; the other ranks read the chosen checkpoint only after it. (When every rank listed the
    directory itself, a rank listing it after rank 0's set-aside skipped a barrier, the collectives paired up
    wrongly and the run hung.) Returns ((path, checkpoint) or None, set_aside)."""
    decision, found = {"error": "rank 0 could not read the run directory"}, None
    try:
        if info.is_main:
            try:
                found, set_aside = decide_resume(cfg, run_dir, log)
                decision = {"path": found[0] if found else None, "set_aside": set_aside}
            except ConfigError as e:
                decision = {"error": str(e)}
    finally:  # also when rank 0 failed unexpectedly: the other ranks must not wait for it forever
        if info.distributed:
            box = [decision]
            dist.broadcast_object_list(box, src=0, group=info.ctrl_group)
            decision = box[0]
    if "error" in decision:
        raise ConfigError(decision["error"])  # printed by rank 0 only
    if decision["path"] is not None and found is None:
        try:
            found = (decision["path"], load_checkpoint(decision["path"]))
        except Exception as e:
            raise ConfigError(f"rank {info.rank} cannot read {decision['path']} ({type(e).__name__}), "
                              "which rank 0 resumes from: is the run directory on a shared file system?") from None
    return found, decision["set_aside"]
