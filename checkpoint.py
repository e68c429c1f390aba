"""Everything about checkpoint files (torchtitan's checkpoint.py in spirit): writing them atomically with a
`latest` pointer and rotation, finding and loading them (falling back past an unreadable one, migrating the flat
layout of earlier code), deciding on rank 0 which one a run resumes from (and broadcasting that decision),
refusing another architecture's, the registry of what a checkpoint holds (one namespaced entry per owner), the
run directory's lock, and loading trained VAEs. This module never imports the trainer, so evaluate.py, export.py
and probe.py use it directly.

Beside `latest`, `best` records the evaluated step with the best held-out value of --best_metric (BestCheckpoint):
that step's checkpoint, which rotation never removes, is what evaluate.py and export.py --best read (best_checkpoint).

A checkpoint (format_version 2) is {"format_version": 2, <entry>: {...}, ...}, one sub-dict per owner:
    training   VAETraining: vae, ema, optimizer, scheduler, scaler, train_parts
    adversary  Adversary (None without --do_ganloss): critic, optimizer, scheduler, scaler, lecam, kind
    guard      NonFiniteGuard: bad_steps_total, bad_streak
    run        the Trainer's: step, config (flat), model_params, init_source, derived, ranks (rng, data), world_size,
               ranks_in_sync, critic_in_sync
    vf_projection  ProjectionTraining (--vf_weight only): projection, optimizer, scheduler
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist

import families
import sharding
from common import ConfigError, DistInfo, atomic_write, first_line
from config import ARCH_FIELDS, HIGHER_IS_BETTER, CriticConfig, ModelConfig, RunConfig, with_legacy_arch
from layouts import DIFFUSERS_WEIGHTS, SAFETENSORS_WEIGHTS

# A run directory written with other values of config.ARCH_FIELDS (the ModelConfig fields marked `arch`) cannot
# be resumed: the VAE's weights would not fit. The GAN settings are not among them: switching the critic on after
# a reconstruction-only warm-up is normal.


CHECKPOINT_NAME = r"step_\d+(\.pt)?"  # step_<step>.pt, or the directory step_<step> of a sharded run (sharding.py)


def is_checkpoint_name(name: str) -> bool:
    return re.fullmatch(CHECKPOINT_NAME, name) is not None


def checkpoint_files(ckpt_dir: str) -> list[str]:
    """Checkpoints of a run (files, and complete directories of sharded runs), newest first (the `latest` pointer's
    target leads)."""
    if not os.path.isdir(ckpt_dir):
        return []
    files = sorted((os.path.join(ckpt_dir, f) for f in os.listdir(ckpt_dir) if is_checkpoint_name(f)),
                   key=lambda p: int(re.search(r"step_(\d+)", os.path.basename(p)).group(1)), reverse=True)
    files = [f for f in files if (f.endswith(".pt") and os.path.isfile(f)) or sharding.is_dcp_dir(f)]
    pointer = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            target = os.path.join(ckpt_dir, f.read().strip())
        if target in files:
            files.remove(target)
            files.insert(0, target)
    return files


FORMAT_VERSION = 2


def load_checkpoint(path: str, whole: bool = True) -> dict:
    """A checkpoint in today's layout (migrated if written by earlier code). weights_only: a checkpoint from
    elsewhere cannot run code when loaded. A sharded run's directory: with its weights and EMA (`whole`: for
    export, evaluation, --load_path; AdamW's moments are not read), or for a resume without its DCP tensors, which
    the training entry names (`training["dcp"]`) and VAETraining reads with every rank."""
    if os.path.isdir(path):
        return sharding.load_whole(path, weights_only=True) if whole else sharding.load_rest(path)
    return migrate(torch.load(path, map_location="cpu", weights_only=True))


def migrate(ckpt: dict) -> dict:
    """A checkpoint of format_version 1 (every owner's keys merged at the top level) in the namespaced layout of
    FORMAT_VERSION 2; a checkpoint already namespaced, or anything that is not a trainer checkpoint (a bare state
    dict), as it is. The compatibility facts an owner used to read from the flat config (the VAE's --train_parts,
    the critic's kind) move into its own entry."""
    if not isinstance(ckpt, dict) or ckpt.get("format_version", 1) >= 2 or not isinstance(ckpt.get("vae"), dict):
        return ckpt  # (a bare state dict has parameter names for keys, never "vae")
    config = ckpt.get("config") or {}
    adversary = None
    if ckpt.get("discriminator") is not None:
        adversary = {"critic": ckpt["discriminator"], "optimizer": ckpt.get("optimizer_disc"),
                     "scheduler": ckpt.get("scheduler_disc"), "scaler": ckpt.get("scaler_disc") or {},
                     "lecam": ckpt.get("lecam"), "kind": critic_kind_of(config)}
    projection = None
    if ckpt.get("vf_projection") is not None:
        projection = {"projection": ckpt["vf_projection"], "optimizer": ckpt.get("optimizer_vf"),
                      "scheduler": ckpt.get("scheduler_vf")}
    run = {k: ckpt[k] for k in ("step", "config", "model_params", "init_source", "ranks", "world_size", "derived",
                                "ranks_in_sync", "critic_in_sync") if k in ckpt}
    return {"format_version": FORMAT_VERSION,
            "training": {"vae": ckpt["vae"], "ema": ckpt.get("ema"), "optimizer": ckpt.get("optimizer_vae"),
                         "scheduler": ckpt.get("scheduler_vae"), "scaler": ckpt.get("scaler_vae") or {},
                         "train_parts": config.get("train_parts", "all")},
            "adversary": adversary, "guard": ckpt.get("guard") or {}, "run": run, "vf_projection": projection}


def critic_kind_of(config: dict) -> dict:
    """The critic's kind (config.CriticConfig.kind) as an earlier file's flat config describes it (a disc_norm it
    lacks is none: a critic resumes only from a checkpoint of its kind)."""
    return CriticConfig(discriminator=config.get("discriminator", "vgg16"), disc_norm=config.get("disc_norm"),
                        critic_trunk=config.get("critic_trunk", "trainable")).kind()


def load_latest_checkpoint(ckpt_dir: str, log=print, whole: bool = True) -> tuple[str, dict] | None:
    for path in checkpoint_files(ckpt_dir):
        try:
            return path, load_checkpoint(path, whole)
        except Exception as e:
            log(f"warning: checkpoint {path} is unreadable ({type(e).__name__}); falling back to the previous one")
    return None


def checkpoint_name(step: int, sharded: bool) -> str:
    """The name of the checkpoint of `step` in a run's checkpoints folder: a file, or a sharded run's directory."""
    return f"step_{step:08d}" + ("" if sharded else ".pt")


def write_checkpoint(ckpt_dir: str, step: int, state: dict, keep_last_k: int, info: DistInfo | None = None
                     ) -> str | None:
    """step_<step>.pt (rank 0 alone calls it), or with `info` a sharded run's directory step_<step> (every rank
    calls it: sharding.save_dcp), then the `latest` pointer, each atomic; older checkpoints beyond keep_last_k
    removed, but for the one `best` names. Returns the path on rank 0, None on the others."""
    name = checkpoint_name(step, sharded=info is not None)
    path = os.path.join(ckpt_dir, name)
    if info is not None:
        tmp = os.path.join(ckpt_dir, f".{name}.incomplete")  # a kill leaves it; the next save of the step clears it
        if info.is_main:
            os.makedirs(ckpt_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        if info.distributed:
            dist.barrier(group=info.ctrl_group)
        sharding.save_dcp(state, tmp, path, info)
        if not info.is_main:
            return None
    else:
        atomic_write(path, lambda f: torch.save(state, f))
    atomic_write(os.path.join(ckpt_dir, "latest"), lambda f: f.write(name.encode()))
    best = (read_best(ckpt_dir) or {}).get("checkpoint")
    for old in checkpoint_files(ckpt_dir)[keep_last_k:]:
        if best and old == os.path.join(ckpt_dir, best):
            continue
        if old != path and os.path.isdir(old):  # aside first: a kill mid-removal leaves no half checkpoint listed
            aside = os.path.join(ckpt_dir, f".{os.path.basename(old)}.deleting")
            os.replace(old, aside)
            shutil.rmtree(aside, ignore_errors=True)
        elif old != path:
            os.remove(old)
    for entry in os.listdir(ckpt_dir):  # what a save or a removal killed midway left
        if entry.endswith((".incomplete", ".deleting")) and entry != f".{name}.incomplete":
            shutil.rmtree(os.path.join(ckpt_dir, entry), ignore_errors=True)
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
    return trained_weights(obj) or obj


def trained_weights(ckpt, ema: bool = False) -> dict | None:
    """The VAE's weights (or their EMA) of a trainer checkpoint (either layout); None for anything else."""
    ckpt = migrate(ckpt)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("training"), dict):
        return None
    return ckpt["training"]["ema" if ema else "vae"]


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
        weights = trained_weights(file) or file
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
    theirs, ours = recorded_norm_groups(path, file), vae.norm_groups  # (None: Wan's RMS norms, ...)
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
    run = file.get("run") if isinstance(file, dict) and trained_weights(file) is not None else None
    if not isinstance(run, dict):
        return None
    if isinstance(run.get("model_params"), dict) and "norm_groups" in run["model_params"]:
        return run["model_params"]["norm_groups"]
    if isinstance(run.get("config"), dict):
        return with_legacy_arch(run["config"])["vae_norm_groups"]
    return None


def restore_scaler(scaler, state: dict | None) -> None:
    """Precision can change on resume: a disabled GradScaler (fp32/bf16) saves {}, which an enabled one
    refuses to load; it then starts from its initial scale, as in a new fp16 run."""
    if scaler.is_enabled() and state:
        scaler.load_state_dict(state)


# ------------------------------------------------------------------------------------- which checkpoint to resume
def check_compatible(model: ModelConfig, force: bool, saved: dict, where: str) -> bool:
    """False (with --force) or ConfigError if `saved` (a config dict) describes another VAE architecture than
    `model`'s (its fields marked `arch`)."""
    saved = with_legacy_arch(saved)
    diff = [f"{k}: {saved.get(k)!r} -> {getattr(model, k)!r}" for k in ARCH_FIELDS
            if k in saved and saved[k] != getattr(model, k)]
    if diff and not force:
        raise ConfigError(f"{where} was written with a different architecture ({'; '.join(diff)}): use "
                          "another --run_name, or --force to start this one from scratch")
    return not diff


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a start reads of the run it may continue, read once (read_run) and handed to every decision after it
    (run_setup's recipe, decide_resume): the run directory's config.json (None: none there), and --resume PATH's
    checkpoint ((path, checkpoint) or None). An unreadable file is kept as its one-line error, raised by the
    decision that needs it (run_setup starts a new recipe without it; the trainer refuses)."""
    config: dict | None = None
    config_error: str | None = None
    resume: tuple[str, dict] | None = None
    resume_error: str | None = None


def read_run(run: RunConfig) -> RunRecord:
    """The run directory's config.json, parsed once, and with --resume PATH that checkpoint, opened once (without
    its DCP tensors: the training entry names them and every rank reads them). Each rank reads it before any
    process group exists; rank 0 decides from it under the run's lock (decide_resume)."""
    config_path = os.path.join(run.run_dir, "config.json")
    config = config_error = resume = resume_error = None
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            config_error = f"{config_path} is unreadable ({type(e).__name__}): fix or remove it"
        if config is not None and not isinstance(config, dict):
            config, config_error = None, f"{config_path} is unreadable (not a JSON object): fix or remove it"
    if run.resume not in ("auto", "never"):
        try:
            resume = (run.resume, load_checkpoint(run.resume, whole=False))
        except Exception as e:
            resume_error = (f"--resume {run.resume}: unreadable checkpoint ({type(e).__name__}: "
                            f"{first_line(e)})")
    return RunRecord(config, config_error, resume, resume_error)


def decide_resume(run: RunConfig, model: ModelConfig, log=print, record: RunRecord | None = None
                  ) -> tuple[tuple[str, dict] | None, bool]:
    """Rank 0: (the checkpoint to resume from or None, whether to set the run's checkpoints aside), decided from
    `record` (read_run: read here when None) and, for --resume auto, the newest readable checkpoint."""
    record = record if record is not None else read_run(run)
    run_dir = run.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    existing = checkpoint_files(ckpt_dir)
    set_aside = False
    if record.config_error:
        raise ConfigError(record.config_error)
    if record.config is not None:
        config_path = os.path.join(run_dir, "config.json")
        if not check_compatible(model, run.force, record.config, config_path) and existing:
            set_aside, existing = True, []
    if run.resume == "never":
        if existing:
            raise ConfigError(f"{run_dir} already holds checkpoints and --resume never was given: "
                              "choose another --run_name or --output_dir")
        return None, set_aside
    if run.resume == "auto":
        found = load_latest_checkpoint(ckpt_dir, log, whole=False) if existing else None
        if existing and found is None:
            raise ConfigError(f"no readable checkpoint in {ckpt_dir}")
    elif record.resume_error:
        raise ConfigError(record.resume_error)
    else:
        found = record.resume
    if found is not None and not check_compatible(model, run.force, found[1]["run"]["config"], found[0]):
        # --force with a checkpoint of another architecture: start from scratch (keeping the run's own aside)
        return None, set_aside or run.resume == "auto"
    return found, set_aside


def find_resume(run: RunConfig, model: ModelConfig, info: DistInfo, log=print, lock: RunLock | None = None,
                record: RunRecord | None = None) -> tuple[tuple[str, dict] | None, bool]:
    """Rank 0 alone reads the run directory and decides (decide_resume): resume from which checkpoint, start
    anew, set the checkpoints of another architecture aside, or refuse. The decision is broadcast over the
    control group; the other ranks read the chosen checkpoint only after it. (When every rank listed the
    directory itself, a rank listing it after rank 0's set-aside skipped a barrier, the collectives paired up
    wrongly and the run hung.) `lock`: rank 0 takes it first (a second job is refused on every rank). Returns
    ((path, checkpoint) or None, set_aside). `record`: what this rank read of the run (read_run; None: read here);
    a rank whose record holds the chosen checkpoint does not open it again."""
    record = record if record is not None else read_run(run)
    decision, found = {"error": "rank 0 could not read the run directory"}, None
    try:
        if info.is_main:
            try:
                if lock is not None:
                    lock.acquire()
                found, set_aside = decide_resume(run, model, log, record)
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
    if decision["path"] is not None and found is None and record.resume is not None \
            and record.resume[0] == decision["path"]:
        found = record.resume
    if decision["path"] is not None and found is None:
        try:
            found = (decision["path"], load_checkpoint(decision["path"], whole=False))
        except Exception as e:
            raise ConfigError(f"rank {info.rank} cannot read {decision['path']} ({type(e).__name__}), "
                              "which rank 0 resumes from: is the run directory on a shared file system?") from None
    return found, decision["set_aside"]


# ------------------------------------------------------------------------------------- what a checkpoint holds
class Registry:
    """Every stateful piece of a run, each saved and restored by its owner under its own name (torchtitan's
    CheckpointManager and Stateful): an entry (None: absent from this run) has state_dict() -> dict and
    load_state_dict(state, path=, log=), which reads its own sub-dict only and applies its own compatibility rules
    (the VAE refuses another --train_parts, the critic starts afresh when of another kind, a scaler saved disabled
    is not loaded). A checkpoint of earlier code is migrated first (migrate)."""

    def __init__(self, **entries):
        self.entries = entries

    def state_dict(self) -> dict:
        """{format_version, entry name: its state}; an entry that is None (a run without that piece) saves None."""
        return {"format_version": FORMAT_VERSION,
                **{name: entry.state_dict() if entry is not None else None for name, entry in self.entries.items()}}

    def load_state_dict(self, path: str, ckpt: dict, log=print) -> dict:
        """Restore every entry from `ckpt` (read from `path`); returns {entry name: what its load returned}."""
        ckpt = migrate(ckpt)
        return {name: entry.load_state_dict(ckpt.get(name), path=path, log=log)
                for name, entry in self.entries.items() if entry is not None}


# ------------------------------------------------------------------------------------- the best checkpoint
BEST = "best"  # beside `latest`: the record of the best evaluated step (JSON)


def read_best(ckpt_dir: str) -> dict | None:
    """The `best` record of a run's checkpoints folder, {metric, value, step, checkpoint: that step's checkpoint's
    name, or None for step 0, the weights the run started from}; None if there is none."""
    record = json_file(os.path.join(ckpt_dir, BEST))
    return record if {"metric", "value", "step", "checkpoint"} <= set(record) else None


def in_folder(path: str | None, ckpt_dir: str) -> bool:
    """Whether the checkpoint at `path` is one of the folder `ckpt_dir`'s (a --resume PATH may be another run's)."""
    return path is not None and os.path.dirname(os.path.realpath(path)) == os.path.realpath(ckpt_dir)


def best_in_words(record: dict) -> str:
    return f"best {record['metric']} {record['value']:.4f} at step {record['step']}"


class BestCheckpoint:
    """--best_metric during training: after each evaluation, whether its step beats the best so far (strictly, in
    the metric's direction: config.HIGHER_IS_BETTER); the best's record, `best` beside `latest`, names that step's
    checkpoint, which rotation never removes. Step 0's evaluation (the weights the run starts from: the release a
    fine-tune must beat) sets the first bar, without a checkpoint. The record is the same on every rank (rank 0 reads
    it at the start and broadcasts it; evaluation's results are the same on every rank), so the ranks agree on
    every save a new best needs. `metric` None: off (the record on disk is still kept and still protected)."""

    def __init__(self, ckpt_dir: str, metric: str | None, info: DistInfo, validator=None):
        """`validator`: the run's evaluation (evaluate.Validator, None without), which refuses a metric it cannot
        compute here (its `missing`: {metric: why}) in one line."""
        self.ckpt_dir, self.metric, self.info, self.record = ckpt_dir, metric, info, None
        base, missing = (metric or "").removeprefix("ema_"), getattr(validator, "missing", {})
        if metric is not None and base in missing:
            raise ConfigError(f"--best_metric {metric}: evaluation cannot compute {base} on this run "
                              f"({missing[base]}): pick another --best_metric")
        self.key = ("eval_ema/" if metric and metric.startswith("ema_") else "eval/") + base

    def resume(self, step: int, log=print) -> None:
        """At the start (`step`: the one the run resumes at, 0 for a new run): the run's record, if by this metric.
        A record past `step` (a resume from an earlier checkpoint: the later steps are trained again and their
        checkpoints overwritten) is removed: the best is chosen again from here. Every rank calls it."""
        record = read_best(self.ckpt_dir) if self.info.is_main else None
        if record is not None and record["step"] > step:
            log(f"note: the {best_in_words(record)} is past step {step}, where this run resumes: the best is "
                "chosen again from here")
            os.remove(os.path.join(self.ckpt_dir, BEST))
            record = None
        elif record is not None and self.metric is not None and record["metric"] != self.metric:
            log(f"note: the {best_in_words(record)} was chosen by another --best_metric: the best by {self.metric}"
                " is chosen again from here (the record is replaced at its first evaluation)")
            record = None
        if self.info.distributed:
            box = [record]
            dist.broadcast_object_list(box, src=0, group=self.info.ctrl_group)
            record = box[0]
        self.record = record if self.metric is not None else None

    def improves(self, results: dict) -> bool:
        """Whether these results (an evaluation's, the same on every rank) beat the best so far."""
        value = results.get(self.key) if self.metric is not None else None
        if value is None or not math.isfinite(value):
            return False
        if self.record is None:
            return True
        higher = HIGHER_IS_BETTER[self.key.split("/")[1]]
        return value > self.record["value"] if higher else value < self.record["value"]

    def crown(self, step: int, results: dict, sharded: bool) -> None:
        """`step` is the best: its checkpoint (written already; none at step 0) recorded atomically by rank 0, after
        which the previous best's checkpoint rotates out as any other."""
        self.record = {"metric": self.metric, "value": float(results[self.key]), "step": step,
                       "checkpoint": checkpoint_name(step, sharded) if step > 0 else None}
        if self.info.is_main:
            atomic_write(os.path.join(self.ckpt_dir, BEST), lambda f: f.write(json.dumps(self.record).encode()))

    def done(self) -> str:
        """What the run's last line says of the best."""
        if self.record is None:
            return ""
        if self.record["checkpoint"] is None:
            return (f"; {best_in_words(self.record)}: no evaluated step beat the weights the run started from, "
                    "so there is no best checkpoint")
        return f"; {best_in_words(self.record)} (evaluate.py and export.py --best)"


def best_checkpoint(ckpt: str, ema: bool) -> tuple[str, bool]:
    """evaluate.py's and export.py's --best: (--ckpt, --ema) made the checkpoint `best` names in a run directory (or
    its checkpoints folder) and the weights its metric measured (the EMA's for an ema_ metric; --ema always wins),
    said in a note on stderr; ConfigError (one line) naming why there is none."""
    ckpt_dir = os.path.join(ckpt, "checkpoints") if os.path.isdir(os.path.join(ckpt, "checkpoints")) else ckpt
    if not os.path.isdir(ckpt_dir) or sharding.is_dcp_dir(ckpt_dir):
        raise ConfigError(f"--best: --ckpt {ckpt} is not a run directory (--best reads its checkpoints/{BEST})")
    record = read_best(ckpt_dir)
    if record is None:
        raise ConfigError(f"--best: {ckpt} has no best checkpoint ({os.path.join(ckpt_dir, BEST)} is absent: the run "
                          "evaluated no step, had no --test_dataset_url, or --best_metric none)")
    if record["checkpoint"] is None:
        raise ConfigError(f"--best: no evaluated step of {ckpt} beat the weights it started from "
                          f"({best_in_words(record)}): there is no best checkpoint")
    path = os.path.join(ckpt_dir, record["checkpoint"])
    if not os.path.exists(path):
        raise ConfigError(f"--best: {path}, the {best_in_words(record)}, is missing")
    ema = ema or record["metric"].startswith("ema_")
    if os.environ.get("RANK", "0") == "0":
        print(f"note: --best: {path}, the {best_in_words(record)}" + (", its EMA weights" if ema else ""),
              file=sys.stderr)
    return path, ema


RUNNING_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@torch.no_grad()
def ranks_in_sync(model: torch.nn.Module, info: DistInfo) -> bool:
    """DDP keeps replicas equal by construction; verify it at each save. The fingerprint of each tensor
    is its float64 dot product with a fixed random vector: any differing element changes it."""
    if not info.distributed:
        return True
    gen = torch.Generator(device=info.device).manual_seed(12345)
    # a BatchNorm's running statistics (DC-AE's decoder) follow each rank's own batches between DDP's broadcasts of
    # rank 0's at every forward: not a desynchronisation
    kept = [t for name, t in model.state_dict().items() if not name.endswith(RUNNING_STATISTICS)]
    sums = torch.stack([torch.dot(t.detach().double().flatten(),
                                  torch.randn(t.numel(), generator=gen, device=info.device, dtype=torch.float64))
                        for t in kept])
    gathered = [torch.empty_like(sums) for _ in range(info.world_size)]
    dist.all_gather(gathered, sums)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


# ------------------------------------------------------------------------------------- the run directory
class RunLock:
    """A run directory belongs to one job at a time: rank 0 holds an exclusive flock on `<output_dir>/.<run_name>.lock`
    (beside the run directory, so that taking it writes nothing into a run that may still be refused) for the whole
    run. The kernel releases it when the process ends, however it ends (a crash, kill -9), so an elastic restart's
    new rank 0 takes it again; a second job is refused in one line naming the holder. Released, the file is removed
    (a run that failed to start leaves nothing behind); a taker that locked a file since removed tries again, so two
    jobs never hold two files of one name. Re-entrant within a process (a process is one job)."""

    _held: dict[str, tuple[object, int]] = {}  # lock path -> (open file, holders in this process)

    def __init__(self, run_dir: str):
        run_dir = os.path.abspath(run_dir)
        self.run_dir = run_dir
        self.path = os.path.join(os.path.dirname(run_dir), f".{os.path.basename(run_dir)}.lock")
        self.holding = False

    def acquire(self, wait_s: float = 5.0) -> None:
        """Take the lock, trying for `wait_s` (an elastic restart's previous rank 0 may be exiting); ConfigError
        if another job holds it."""
        import fcntl
        if self.holding:
            return
        if self.path in RunLock._held:
            file, count = RunLock._held[self.path]
            RunLock._held[self.path] = (file, count + 1)
            self.holding = True
            return
        parent = os.path.dirname(self.path)
        self.created = [] if os.path.isdir(parent) else [parent]  # removed again on release if left empty
        os.makedirs(parent, exist_ok=True)
        end = time.monotonic() + wait_s
        while True:
            file = open(self.path, "a+")
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "another process"
                file.close()
                if time.monotonic() >= end:
                    raise ConfigError(f"{self.run_dir} is in use by another job ({holder}): wait for it to end, or "
                                      "choose another --run_name") from None
                time.sleep(0.2)
                continue
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(file.fileno()).st_ino:
                break
            file.close()  # locked a file its holder removed on release: take the one at the path now
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        file.flush()
        RunLock._held[self.path] = (file, 1)
        self.holding = True

    def release(self) -> None:
        if not self.holding:
            return
        self.holding = False
        file, count = RunLock._held[self.path]
        if count > 1:
            RunLock._held[self.path] = (file, count - 1)
            return
        del RunLock._held[self.path]
        try:
            os.unlink(self.path)  # while still holding it: a waiting taker sees the inode change and tries again
        except FileNotFoundError:
            pass
        file.close()  # closing the last descriptor releases the flock
        for directory in getattr(self, "created", []):  # the --output_dir this lock made, if nothing else is in it
            try:
                os.rmdir(directory)
            except OSError:
                pass


def start_run_dir(run_dir: str, config: dict, set_aside: bool, log=print) -> bool:
    """Rank 0, once every check that can refuse the run has passed (flags, weights, --load_path, data): set
    incompatible checkpoints aside (--force), create the directories, write config.json. Returns whether this
    run created the directory (a run that fails to start then removes it: remove_run_dir_if_unused)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if set_aside:
        aside = f"{ckpt_dir}.incompatible-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(ckpt_dir, aside)
        log(f"warning: --force: the checkpoints of the other architecture were moved to {aside}; "
            "training starts from scratch")
    created = not os.path.exists(run_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
    atomic_write(os.path.join(run_dir, "config.json"), lambda f: f.write(json.dumps(config, indent=2).encode()))
    return created


def remove_run_dir_if_unused(run_dir: str) -> None:
    """After a user error that stopped a run before its first checkpoint (data with no decodable image, ...),
    remove the run directory it created, so that none is left holding only config.json."""
    if not checkpoint_files(os.path.join(run_dir, "checkpoints")):
        shutil.rmtree(run_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------- loading a trained VAE
# Below both evaluate.py and export.py (which use it): a run directory, a checkpoint file, or an export.py folder.


def json_file(path: str) -> dict:
    """A JSON object's file, {} where there is none or it is not one."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_diffusers_export(path: str, video: bool = False) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode, the diffusers config) from a folder written by `export.py --format diffusers` (a
    diffusers folder of any family: families.load_source reads it; `video`: the Wan family's video model).
    SourceError (one line) for a class no family reads."""
    return families.load_exported_folder(path, video)


def load_autoencoder(path: str) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode, config dict with scaling_factor / shift_factor / resolution / step) from a folder
    written by `export.py --format safetensors`."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    vae = families.build_model(families.our_format_params(config))
    vae.load_state_dict(load_file(os.path.join(path, SAFETENSORS_WEIGHTS)))
    return vae.eval(), config


def load_single_file(path: str, ema: bool = False) -> tuple[torch.nn.Module, dict]:
    """export.py --format single_file's ae.safetensors (or a released FLUX/SD VAE file, or a tiny autoencoder's
    released files): the model its weights and metadata describe, with the notes of what had to be assumed on stderr;
    no step or resolution (--resolution)."""
    from layouts import SourceError
    if ema:
        raise ConfigError(f"--ema: {path} is a released model, which holds one set of weights")
    try:
        source = families.load_source(path)
    except SourceError as e:
        raise ConfigError(f"--ckpt {e}") from None
    if os.environ.get("RANK", "0") == "0":
        for note in source.notes:
            print(f"note: {note}", file=sys.stderr)
    vae = families.build_model(source.params)
    vae.load_state_dict(source.state)
    return vae.eval(), {"checkpoint": path, "step": None, "resolution": None, "init_source": None,
                        "train_parts": None}


def load_model(ckpt: str, ema: bool = False, video: bool = False) -> tuple[torch.nn.Module, dict]:
    """(model on CPU in eval mode, info with `checkpoint`, `step`, `resolution`); ConfigError (one line)
    for anything the user can get wrong. `video`: a Wan-family diffusers folder loads as the video model (a run's
    checkpoints and our exports record which model they hold)."""
    if not os.path.exists(ckpt):
        raise ConfigError(f"--ckpt {ckpt}: no such file or directory")
    exported = [name for name in (SAFETENSORS_WEIGHTS, DIFFUSERS_WEIGHTS) if os.path.isfile(os.path.join(ckpt, name))]
    if os.path.isdir(ckpt) and not exported and "_class_name" in json_file(os.path.join(ckpt, "config.json")):
        exported = [DIFFUSERS_WEIGHTS]  # a diffusers folder whose weights are sharded
    if os.path.isdir(ckpt) and exported:
        if ema:
            raise ConfigError(f"--ema: {ckpt} is an exported model, which holds one set of weights")
        try:
            if exported[0] == SAFETENSORS_WEIGHTS:
                vae, config = load_autoencoder(ckpt)
                return vae, {"checkpoint": ckpt, "step": config.get("step"), "resolution": config.get("resolution")}
            vae, config = load_diffusers_export(ckpt, video)  # diffusers keeps no step; sample_size: resolution
            return vae, {"checkpoint": ckpt, "step": None, "resolution": config.get("sample_size")}
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
            reason = first_line(e) or type(e).__name__
            raise ConfigError(f"--ckpt {ckpt}: not a loadable export.py folder "
                              f"({type(e).__name__}: {reason})") from None
    if (os.path.isfile(ckpt) and ckpt.endswith(".safetensors")) or families.released_tiny(ckpt):
        return load_single_file(ckpt, ema)  # (a tiny autoencoder's released files: tae.py)
    if os.path.isdir(ckpt) and not sharding.is_dcp_dir(ckpt):  # a run, or its checkpoints folder
        ckpt_dir = os.path.join(ckpt, "checkpoints") if os.path.isdir(os.path.join(ckpt, "checkpoints")) else ckpt
        if not checkpoint_files(ckpt_dir):
            raise ConfigError(f"--ckpt {ckpt}: no checkpoints (step_*.pt, step_*/) in {ckpt_dir}, and not an export.py folder "
                              f"({SAFETENSORS_WEIGHTS} or {DIFFUSERS_WEIGHTS})")
        quiet = os.environ.get("RANK", "0") != "0"
        found = load_latest_checkpoint(ckpt_dir, log=lambda m: quiet or print(m, file=sys.stderr))
        if found is None:
            raise ConfigError(f"--ckpt {ckpt}: no readable checkpoint in {ckpt_dir}")
        path, state = found
    else:
        path = ckpt
        try:
            state = load_checkpoint(path)
        except Exception as e:
            raise ConfigError(f"--ckpt {path}: unreadable checkpoint ({type(e).__name__})") from None
    run = state.get("run") if isinstance(state, dict) else None
    if trained_weights(state) is None or not isinstance(run, dict) or "model_params" not in run:
        raise ConfigError(f"--ckpt {path}: not a trainer checkpoint (no model_params/vae)")
    if ema and not trained_weights(state, ema=True):
        raise ConfigError(f"--ema: {path} holds no EMA weights (trained with --ema_decay 0?)")
    try:
        vae = families.build_model(families.params_from_dict(run["model_params"]))
        vae.load_state_dict(trained_weights(state, ema))
    except (TypeError, ValueError, RuntimeError) as e:
        reason = first_line(e) or type(e).__name__
        raise ConfigError(f"--ckpt {path}: weights do not fit its model_params ({reason})") from None
    config = run.get("config") or {}
    # where a fine-tune started (layouts.Source.describe()) and what it trained: export keeps the source's
    # latent factors after a decoder-only fine-tune
    return vae.eval(), {"checkpoint": path, "step": run.get("step"), "resolution": config.get("vae_resolution"),
                        "init_source": run.get("init_source"), "train_parts": state["training"]["train_parts"],
                        "video_frames": config.get("video_frames", 0),
                        "video_frame_stride": config.get("video_frame_stride", 1)}
