"""Train a latent-diffusion autoencoder (FLUX-style, constant-variance latent) with torchrun: `main`, and the
Trainer that builds, loops (`train()`, `train_step()`), steps and saves.

    torchrun --nproc_per_node=8 vae_trainer.py --dataset_url 'shards/{00000..01023}.tar' --do_ganloss
    python vae_trainer.py --demo                      # no data of your own needed

Recipe: LPIPS + pooled MSE + low-pass MSE + a VGG16 hinge discriminator, each loss branch balanced by
GradNorm; a latent penalty (the KL of the constant-variance posterior). fp32 by default. Every
hyperparameter is a flag (`--help`; config.py); the run directory <output_dir>/<run_name>/ holds config.json,
metrics.jsonl, checkpoints/ and samples/, and a run started again in it resumes where it stopped.
This module is the composition root: the only place besides config.py that reads the whole config. Each owner
is built here from the sections it reads (config.py the flags, run_setup.py argv to a finished config,
objective.py the loss and the critic, train_state.py what trains the VAE, checkpoint.py the files and the
registry of stateful entries, run_log.py everything the user sees).
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from common import exit_if_torch_pair_broken
if __name__ == "__main__":  # first: a torch/torchvision mismatch is one line, not an import's traceback
    exit_if_torch_pair_broken()
import checkpoint  # noqa: E402 (after the check above; so are the imports below)
import common
import data as data_lib
import evaluate as evaluate_lib
import families
import latents as latents_lib
import layouts
import memory
import probe as probe_lib
import run_log
import sharding
from alignment import fetch_foundation_weights
from common import (ConfigError, DistInfo, StopFlag, any_rank, capture_rng, closing_distributed, init_distributed,
                    redact, restore_rng, signal_handlers_kept)
from config import (Config, DeviceSpeed, best_metric_of, downsample_factor_of, last_stage_levels, min_loss_image_size,
                    public_config, uses_vgg16, with_values)
from objective import Adversary, VAEObjective, micro_step
from run_log import Metrics
from run_setup import config_warnings, cpu_use_line, prepare_run, read_init_source, read_teacher
from train_state import (NonFiniteGuard, TeacherDecoder, TeacherLatents, VAETraining, adamw, compile_for_sizes,
                         wrap_ddp, wrap_sharded)
from weights import WeightsUnavailable, ensure_vgg16_weights, fetch_weights, load_vgg16_features, warn_random_vgg


# ============================================================================================
# Building the parts from the config (the only functions outside config.py that take all of it)
# ============================================================================================
def build_vae(cfg: Config, device: torch.device, memory_format, resume: tuple[str, dict] | None = None,
              source: layouts.Source | None = None, log=print, distill_source: layouts.Source | None = None
              ) -> tuple[torch.nn.Module, dict | None, TeacherDecoder | None, TeacherLatents | None]:
    """The autoencoder of the run's family (families.py) on the device: its architecture the flags' (the LDM
    family's new model), the --init_from source's, or the checkpoint's a run resumes from (the source may have moved
    since); with --load_path's or --init_from's weights when not resuming. Also the description of the --init_from
    source it was initialised from (None otherwise), with --distill_weight the source's own decoder as the teacher
    (read from the source again on resume), and with --distill_from the teacher's latents (run_setup read the
    teacher: `distill_source`; read here if not)."""
    ft, init_weights = cfg.finetune, resume is None
    family = families.named(cfg.model.vae_family)
    if ft.init_from and (init_weights or cfg.loss.distill_weight > 0) and source is None:
        source = read_init_source(ft.init_from, ft.init_family, cfg.data.video_frames > 0, family.name)
    saved = families.params_from_dict(resume[1]["run"]["model_params"]) if resume is not None else None
    vae = family.build(family.architecture(cfg.model, source, saved))
    described, teacher = None, None
    if cfg.run.load_path and init_weights:
        checkpoint.load_vae_weights_into(vae, cfg.run.load_path)
        log(f"initialised VAE weights from {cfg.run.load_path}")
    if ft.init_from and init_weights:
        decoder = family.init_weights(vae, source, ft, cfg.optim)
        described = source.describe()
        for note in source.notes:
            log(f"note: {note}")
        release = f", {source.family}" if source.family else ""
        log(f"initialised the VAE from {ft.init_from} ({source.layout}{release}: {family.describe(source.params)})"
            f"{decoder}")
    if cfg.loss.distill_weight > 0:
        teacher = TeacherDecoder(family.teacher(source)).to(device, memory_format=memory_format)
        log(f"distilling from the decoder of {ft.init_from}")
    teacher_latents = None
    if ft.distill_from:
        distill_source = distill_source or read_teacher(cfg)
        teacher_model = families.build_model(distill_source.params)
        teacher_model.load_state_dict(distill_source.state)
        try:
            normalise = teacher_model.diffusion_latents(distill_source.factors)
        except ValueError as e:
            raise ConfigError(f"--distill_from {ft.distill_from}: {e}") from None
        teacher_latents = TeacherLatents(teacher_model, normalise).to(device, memory_format=memory_format)
        encoder = (family.take_teacher_encoder(vae, distill_source)
                   if init_weights and ft.train_parts == "decoder" and not ft.init_from else "")
        log(f"distilling from {ft.distill_from} ({teacher_model.describe()}): the decoder "
            f"decodes its latents, {'the encoder learns them' if ft.train_parts != 'decoder' else 'the encoder is frozen'}"
            f"{encoder}")
    vae.set_memory_plan(cfg.speed.grad_checkpointing, cfg.speed.time_chunks)
    return vae.to(device, memory_format=memory_format), described, teacher, teacher_latents


def vgg16_for_run(cfg: Config, info: DistInfo, eval_on: bool, log) -> tuple[dict | None, bool]:
    """(VGG16 `features` weights or None (random), whether LPIPS is built). VGG16 is needed when a loss trains on
    it; otherwise (pixel-only training) only evaluation's LPIPS metric wants it: loaded if its weights can be had,
    else that metric is reported missing with one note. A random VGG16 that no loss trains on is not built. The
    alignment's foundation weights are fetched here too (local rank 0 downloads first)."""
    critic = cfg.critic

    def vgg16_features():
        if critic.vgg16_weights == "random" and info.is_main:
            warn_random_vgg("LPIPS" + (" and the discriminator" if critic.do_ganloss and critic.discriminator ==
                                       "vgg16" else ""))
        path = fetch_weights(ensure_vgg16_weights, critic.vgg16_weights, info.local_rank, info.ctrl_group)
        return load_vgg16_features(path)

    latents = cfg.latents
    if latents.vf_weight > 0 and cfg.finetune.train_parts != "decoder":
        fetch_weights(partial(fetch_foundation_weights, latents.vf_model), latents.vf_weights, info.local_rank,
                      info.ctrl_group)
    if uses_vgg16(cfg):
        return vgg16_features(), True
    if eval_on and critic.vgg16_weights != "random":
        try:
            return vgg16_features(), True
        except WeightsUnavailable as e:
            if critic.vgg16_weights != "torchvision":
                raise  # the user named a file: an error, not a missing metric
            log(f"note: evaluation's LPIPS will not be computed: {e}")
    return None, False


def build_regularisers(cfg: Config, downsample_factor: int) -> latents_lib.LatentRegularisers:
    latents = cfg.latents
    sizes = latents_lib.equivariance_sizes_of(downsample_factor_of(cfg.model), cfg.data.vae_resolution,
                                              latents.scale_equivariance_mode, cfg.loss.mse_pool_factor,
                                              min_loss_image_size(cfg))
    return latents_lib.LatentRegularisers(
        cfg.optim.seed, equivariance_prob=latents.scale_equivariance_prob,
        equivariance_sizes=sizes, equivariance_rotate=latents.scale_equivariance_rotate,
        noise_prob=latents.latent_noise_prob, noise_max=latents.latent_noise_max, downsample_factor=downsample_factor,
        equivariance_form=latents.scale_equivariance_form,
        latent_size=cfg.data.vae_resolution // downsample_factor)


def start_lines(cfg: Config, vae: torch.nn.Module, info: DistInfo, run_dir: str,
                schedule: data_lib.ResolutionSchedule, speed: DeviceSpeed) -> list[str]:
    """The lines that open a run: what trains, on what, in which precision and batch."""
    n_params = sum(p.numel() for p in vae.parameters())
    lines = []
    if cfg.finetune.train_parts == "decoder":
        trained = sum(p.numel() for p in vae.parameters() if p.requires_grad)
        lines.append(f"training the decoder only: {trained / 1e6:.1f}M of {n_params / 1e6:.1f}M parameters; "
                     f"{families.frozen_in_words(vae)} frozen")
    if cfg.data.train_resolutions:
        stages = "; ".join(f"from step {begin}: " + ", ".join(f"{size} px x {schedule.batch_for(size)}" for size in sizes)
                           for begin, sizes in schedule.stages)
        lines.append(f"multi-resolution training (--train_resolutions {cfg.data.train_resolutions}), size x images "
                     f"per micro-batch: {stages}")
    lines.append(f"run dir {run_dir} | {info.world_size} x {info.device.type} | VAE {n_params / 1e6:.1f}M params | "
                 f"{vae.describe()} | f{vae.downsample_factor} z{cfg.model.vae_z_channels} "
                 f"{cfg.model.posterior} posterior | "
                 f"{speed.describe()} | batch {cfg.data.batch_size}"
                 f"{f' clips of {cfg.data.video_frames} frames' if cfg.data.video_frames else ''} x "
                 f"{cfg.optim.grad_accum} accum x {info.world_size} ranks")
    trained = sum(p.numel() for p in vae.parameters() if p.requires_grad)
    return lines + sharding.describe(cfg.speed.sharding, info.world_size, trained, cfg.optim.ema_decay > 0)


def set_cuda_backends(speed: DeviceSpeed, device: torch.device) -> None:
    """TF32 as --allow_tf32 says on this device (auto: on with CUDA, PyTorch's own default for cuDNN convolutions,
    which this trainer once turned off at 0.2x the speed: docs/precision.md). cuDNN's autotuner stays as the user
    left it (off by default): on an H100 it bought nothing for this model (FLUX width, 256 px, batch 8: 1.025 s fp32
    and 0.169 s bf16 per step either way), and after the memory check's probe steps the first autotuned step ran for
    minutes (BENCHMARKS.md section 4)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = speed.tf32


# ============================================================================================
# What the ranks decide together
# ============================================================================================
class RunComplete(Exception):
    """The run directory's run has reached --max_steps already: the message says so, and nothing is written."""


def micro_batches_kept(cfg: Config, resume: tuple[str, dict] | None, info: DistInfo, log) -> Config:
    """A run resumed on another number of ranks keeps its M = ranks x --grad_accum micro-batches per step, whose
    images and noise do not depend on the rank computing them (data.TrainStream, micro_seed): --grad_accum becomes
    M / ranks, said in one line, or the run is refused in one line when the ranks cannot share M. An elastic
    relaunch repeats the first command's --grad_accum, so a value given on another world size is set aside (said);
    on the same world size it is the user's, as any flag given anew."""
    if resume is None:
        return cfg
    run = resume[1]["run"]
    world, accum = run.get("world_size", info.world_size), run.get("config", {}).get("grad_accum", 1)
    if world == info.world_size:
        return cfg
    total = world * accum
    if total % info.world_size:
        raise ConfigError(f"{resume[0]} was written by {world} ranks x --grad_accum {accum} = {total} micro-batches "
                          f"per step, which {info.world_size} ranks cannot share: resume on a number of ranks that "
                          f"divides {total} (to change the step, continue on {world} ranks with another --grad_accum)")
    kept = total // info.world_size
    aside = (f" (--grad_accum {cfg.optim.grad_accum} set aside: another step is chosen on the same number of ranks)"
             if cfg.optim.grad_accum not in (accum, kept) else "")
    log(f"note: {resume[0]} was written by {world} ranks x --grad_accum {accum}; on {info.world_size} ranks "
        f"--grad_accum {kept} keeps its {total} micro-batches per step (the same images and noise){aside}")
    return with_values(cfg, grad_accum=kept)


def micro_seed(seed: int, step: int, index: int) -> int:
    """The global RNG's seed for micro-batch `index` of a step (its index among the step's micro-batches of all
    ranks): the posterior noise and the critic's augmentations are the same whichever rank computes it."""
    return hash((seed, step, index, 3)) & 0x7FFF_FFFF_FFFF_FFFF


def read_step_batches(loader, count: int) -> tuple[dict, list[torch.Tensor] | None, str | None]:
    """The stream's position before the step (what a checkpoint at this step records) and the step's `count`
    batches; those are None with a one-line error when the data stream gave up (--shard_retry_minutes spent),
    None and None when a stop request came while it waited through an outage."""
    position = loader.state_dict()
    try:
        return position, [next(loader) for _ in range(count)], None
    except data_lib.DatasetError as e:
        return position, None, str(e)
    except data_lib.WaitInterrupted:
        return position, None, None


def owed_at(step: int, cfg: Config, eval_on: bool, info: DistInfo) -> tuple[bool, bool]:
    """(evaluation, probe): whether one was due at `step` and metrics.jsonl lacks its record (a stop in the middle
    of it: a second Ctrl-C, kill -9). Rank 0 reads the file; every rank follows (all take part in both)."""
    owed = (False, False)
    if info.is_main:
        keys = run_log.logged_keys(os.path.join(cfg.run.run_dir, "metrics.jsonl"), step)
        due = [step % every == 0 or step == cfg.optim.max_steps if every else False for every in (
            cfg.eval.evaluate_every_n_steps if eval_on else 0, cfg.latents.probe_every_n_steps)]
        owed = (due[0] and "eval/psnr" not in keys, due[1] and "eval/probe_loss" not in keys)
    return any_rank(owed[0], info), any_rank(owed[1], info)


def work_left(resume: tuple[str, dict] | None, cfg: Config, eval_on: bool, info: DistInfo,
              run_lock: checkpoint.RunLock | None) -> tuple[bool, bool]:
    """What a run resumed from `resume` still owes at its step (owed_at), or RunComplete (the lock released) when it
    has reached --max_steps with nothing owed, or gone past it: nothing is trained and nothing written."""
    if resume is None:
        return False, False
    reached, max_steps = int(resume[1]["run"]["step"]), cfg.optim.max_steps
    owed = owed_at(reached, cfg, eval_on, info)
    if reached > max_steps or reached == max_steps and not any(owed):
        if run_lock is not None:
            run_lock.release()
        raise RunComplete(f"{cfg.run.run_dir} is at step {reached} and --max_steps is {max_steps}: nothing to train, "
                          "nothing changed (a larger --max_steps continues it)")
    return owed


@dataclass(frozen=True)
class Start:
    """Where a run starts, settled once before its Trainer is built: the config final for this world size
    (--grad_accum kept from the checkpoint's micro-batches), the checkpoint it resumes from, read once ((path,
    checkpoint) or None), whether the run's checkpoints of another architecture are set aside, and what the resumed
    step still owes (work_left), and whether it evaluates during training (a test set and an interval)."""
    cfg: Config
    resume: tuple[str, dict] | None
    set_aside: bool
    owed: tuple[bool, bool]
    eval_on: bool

    @classmethod
    def settle(cls, cfg: Config, info: DistInfo, run_lock: checkpoint.RunLock | None, log,
               record: checkpoint.RunRecord | None = None) -> "Start":
        """Rank 0 decides the resume (checkpoint.find_resume) from `record`, what prepare_run read of the run
        (config.json, --resume's checkpoint; None: read here), then the micro-batches and the owed work follow from
        it. RunComplete when nothing is left to do."""
        resume, set_aside = checkpoint.find_resume(cfg.run, cfg.model, info, log, run_lock, record)
        cfg = micro_batches_kept(cfg, resume, info, log)  # on another number of ranks
        # an evaluation or probe due at the resumed step that a stop interrupted (its record missing) is redone
        eval_on = bool(cfg.data.test_dataset_url and cfg.eval.evaluate_every_n_steps)
        return cls(cfg, resume, set_aside, work_left(resume, cfg, eval_on, info, run_lock), eval_on)


def first_error(error: str | None, info: DistInfo) -> str | None:
    """The first rank's error, on every rank (all take part)."""
    errors = [error]
    if info.distributed:
        errors = [None] * info.world_size
        dist.all_gather_object(errors, error, group=info.ctrl_group)
    return next((e for e in errors if e), None)


# ============================================================================================
# The trainer
# ============================================================================================
class Trainer:
    """One training run. Its parts, each built from the config sections it reads and each the owner of its own
    state (checkpointed under its name through `state`):"""
    vae: torch.nn.Module                              # the model, of its family (families.py)
    training: VAETraining                             # what trains it: DDP, AdamW, schedule, scaler, EMA
    adversary: Adversary | None                       # the critic's owner (objective.py); None without --do_ganloss
    objective: VAEObjective                           # the loss, composed once (objective.py)
    regularisers: latents_lib.LatentRegularisers      # scale equivariance, latent noise (latents.py)
    guard: NonFiniteGuard                             # skips non-finite steps on every rank (train_state.py)
    loader: data_lib.TrainLoader                      # the rank's resumable stream of batches (data.py)
    validator: evaluate_lib.Validator | None          # evaluation during training (evaluate.py)
    in_loop_probe: probe_lib.InLoopProbe | None       # the diffusability probe (probe.py)
    report: run_log.Reporter                          # stdout, metrics.jsonl, wandb, grids, curves (run_log.py)
    state: checkpoint.Registry                        # training, adversary, guard, run, vf_projection

    def __init__(self, cfg: Config, info: DistInfo, source: layouts.Source | None = None,
                 derived: dict[str, str | None] | None = None, run_lock: checkpoint.RunLock | None = None,
                 start: Start | None = None, distill_source: layouts.Source | None = None):
        """`cfg` is finished (run_setup.prepare_run); `source`: the --init_from source it read (None: read here
        if needed); `derived`: {automatic field: its basis}, recorded for a continued run; `run_lock`: main's,
        which main releases however the run ends; `start`: main's settled start (Start.settle; None:
        settled here, with `cfg`), whose config replaces `cfg`."""
        self.info, self.device, self.derived = info, info.device, derived
        # The run directory is this job's (rank 0 holds its lock until the run ends): a second job is refused here.
        # Nothing is written to it before every check that can refuse the run has passed (start_run_dir, below).
        self.run_lock = run_lock or (checkpoint.RunLock(cfg.run.run_dir) if info.is_main else None)
        start = start or Start.settle(cfg, info, self.run_lock, self.log)
        cfg = self.cfg = start.cfg
        resume, set_aside, self.owed = start.resume, start.set_aside, start.owed
        self.run_dir = cfg.run.run_dir
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        # the speed section on this device, resolved once: the Precision every owner holds (its autocast and
        # scaler), TF32, the VAE's memory format and the loss networks' (--channels_last; auto: per device)
        self.speed = cfg.speed.on(self.device.type, cfg.data.video_frames)
        self.precision = self.speed.precision
        self.autocast = partial(self.precision.autocast, self.device.type)
        self.wrap_ddp = partial(wrap_ddp, info=info)  # DDP under torchrun, the module itself otherwise
        self.memory_format, self.loss_memory_format = self.speed.memory_format, self.speed.loss_memory_format
        self.channels_last = self.memory_format == torch.channels_last
        self.step, self.eval_on, self.last_saved = 0, start.eval_on, -1  # (last_saved: the step last checkpointed)
        self.created_run_dir = False  # by this run (rank 0, once every check that can refuse the run passed)
        set_cuda_backends(self.speed, self.device)
        max_steps = cfg.optim.max_steps

        # networks: built from the same seed on every rank (DDP also broadcasts rank 0's weights), in this
        # order (random initialisations draw from the global RNG)
        torch.manual_seed(cfg.optim.seed)
        # --init_from: what the run started from (path, layout, factors), in config.json and every checkpoint
        self.init_source = resume[1]["run"].get("init_source") if resume is not None else None
        self.vae, source_described, teacher, teacher_latents = build_vae(
            cfg, self.device, self.memory_format, resume, source, self.log, distill_source)
        self.init_source = source_described or self.init_source
        if source is not None:  # its weights are in the model now: a second copy would hold memory until main drops
            source.state = {}  # the object, and the memory check would count it as the process's own
        self.last_layer = self.vae.last_layer()  # (LDM's adaptive weight reads it)
        # the constant posterior's noise variance (a deterministic encoder has none: no latent collapses into it)
        self.posterior_var = cfg.model.posterior_var if cfg.model.posterior == "constant" else 0.0
        vgg_features, with_lpips = vgg16_for_run(cfg, info, self.eval_on, self.log)
        self.objective = VAEObjective.from_config(
            cfg.loss, cfg.latents, cfg.critic, self.precision, vgg_features, with_lpips, self.device,
            self.loss_memory_format, cfg.model.vae_z_channels, encoder_trains=cfg.finetune.train_parts != "decoder",
            with_kl=cfg.model.posterior != "none")
        self.adversary = self.objective.adversary
        self.validator = (evaluate_lib.Validator(
            cfg.eval, cfg.data, self.objective.lpips, self.device, info, self.memory_format, self.log,
            channels_last=self.channels_last, grid_images=cfg.run.num_samples) if self.eval_on else None)
        self.best = checkpoint.BestCheckpoint(self.ckpt_dir, best_metric_of(cfg), info, self.validator)
        self.schedule, self.last_stage = resolution_stages(cfg)  # --train_resolutions, --last_stage_trains
        if cfg.speed.compile and self.adversary is not None:
            self.adversary.critic.compile()
        make_optimizer = partial(adamw, cfg.optim)
        # --sharding fsdp|hsdp (under torchrun): the VAE's state sharded (sharding.py); the critic stays under DDP
        self.sharding = cfg.speed.sharding if info.distributed else "ddp"
        wrap_vae, self.whole_template = self.wrap_ddp, None
        if self.sharding != "ddp":
            wrap_vae = partial(wrap_sharded, mesh=sharding.mesh_for(self.sharding, info))
            # evaluation, the sample grid and the probe run a whole copy (sharded, the VAE runs only inside the
            # training forward, on every rank together): its architecture, kept on the CPU, the weights gathered
            self.whole_template = copy.deepcopy(self.vae.cpu())  # (through the CPU: no second copy on the GPU)
            self.vae.to(self.device)
        self.training = VAETraining(self.vae, cfg.optim, make_optimizer, wrap_vae, self.device,
                                    cfg.finetune.train_parts, self.precision, cfg.speed.compile,
                                    self.objective.alignment, teacher, teacher_latents)
        self.regularisers = build_regularisers(cfg, self.vae.downsample_factor)
        self.memory_verdict = None  # the memory check's (memory.Verdict), this rank's
        if cfg.speed.memory_check:  # before the critic's DDP wrapper (the probes run its forward without a backward)
            shapes = memory.StepShape.to_check(
                self.schedule, cfg.optim, cfg.speed, self.precision, cfg.data.video_frames,
                self.vae.can_checkpoint(), memory.shard_count(self.vae), info.world_size)
            checked = memory.check_every_rank(  # sharded, the probes run a whole copy of the template
                self.vae, self.objective, shapes, self.device,
                self.training.ema is not None, info.ctrl_group, model=self.training.trained,
                regularisers=self.regularisers, eval_copy=self.eval_on and self.training.ema is not None,
                probe_copy=bool(cfg.latents.probe_every_n_steps), template=self.whole_template)
            self.memory_verdict = checked.verdict if checked else None
            for line in checked.lines if checked else ():
                self.log(line)
        if self.adversary is not None:
            self.adversary.prepare_training(cfg.optim, make_optimizer, self.wrap_ddp)
        self.guard = NonFiniteGuard(self.device, cfg.optim.grad_clip)
        self.state = checkpoint.Registry(training=self.training, adversary=self.adversary, guard=self.guard, run=self,
                                         vf_projection=self.training.projection)

        data_state, self.resumed_from = None, None
        # a stop between steps saves the stream's position and the RNG from before the step it abandons (None: now)
        self.data_position, self.rng_position = None, None
        if resume is not None:
            data_state = self.state.load_state_dict(*resume, log=self.log)["run"]
        self.loader = data_lib.TrainLoader.of(cfg.data, cfg.optim.seed, info.rank, info.world_size,
                                              pin_memory=self.device.type == "cuda", state=data_state,
                                              grad_accum=cfg.optim.grad_accum, step=self.step, schedule=self.schedule)
        for note in self.loader.notes:
            self.log(f"note: {note}")
        self.in_loop_probe = (probe_lib.InLoopProbe(cfg.latents, cfg.data, cfg.optim.seed, self.device)
                              if cfg.latents.probe_every_n_steps else None)
        self.metrics = Metrics()
        # reads the grids' images: a bad set refuses here
        self.report = run_log.Reporter(cfg.run, cfg.data, info, max_steps=max_steps, grad_accum=cfg.optim.grad_accum,
                                       gan=cfg.critic.do_ganloss, channels_last=self.channels_last,
                                       encoder_trains=self.training.train_parts != "decoder")
        if info.is_main:
            config = {**public_config(cfg), **({"init_source": self.init_source} if self.init_source else {}),
                      **({"derived": self.derived} if self.derived is not None else {})}
            self.created_run_dir = checkpoint.start_run_dir(self.run_dir, config, set_aside, self.log)
            self.report.start_transcript()
            self.report.wandb = run_log.init_wandb(cfg.run, public_config(cfg), self.log)

    def log(self, msg: str) -> None:
        """A line on rank 0: through the reporter once it exists (above the progress bar on a terminal, which a
        plain print would overwrite from its first character), plain before."""
        if not self.info.is_main:
            return
        report = getattr(self, "report", None)
        if report is not None:
            report.print(msg)
        else:
            print(msg, flush=True)

    # ----------------------------------------------------------------------------- the run's checkpoint entry
    def state_dict(self) -> dict:
        """The run's own entry: its step, config and architecture, where it started from, and per rank the RNG and
        the data stream's position (every rank takes part in the gather)."""
        ranks = [None] * self.info.world_size
        mine = {"rng": self.rng_position or capture_rng(self.device),
                "data": self.data_position or self.loader.state_dict()}
        if self.info.distributed:
            dist.all_gather_object(ranks, mine, group=self.info.ctrl_group)
        else:
            ranks = [mine]
        return {"step": self.step, "config": public_config(self.cfg), "model_params": self.vae.params.to_dict(),
                "init_source": self.init_source, "ranks": ranks, "world_size": self.info.world_size,
                **({"derived": self.derived} if self.derived is not None else {})}

    def load_state_dict(self, state: dict, path: str, log=print) -> dict | None:
        """The step, a precision change's note, and this rank's RNG; returns this rank's data-stream state."""
        self.step = int(state["step"])
        precision = self.precision.name
        saved_precision = state.get("config", {}).get("precision", precision)
        if saved_precision != precision:
            self.log(f"note: the checkpoint was written with --precision {saved_precision}; continuing in "
                     f"{precision}" + (" (the fp16 loss scale starts afresh)" if precision == "fp16" else ""))
        self.resumed_from = path
        per_rank = state.get("ranks") or []
        if len(per_rank) == self.info.world_size:  # (the training step seeds its own noise: micro_seed)
            restore_rng(per_rank[self.info.rank]["rng"], self.device)
        self.log(f"resumed from {path} at step {self.step}")
        return data_lib.merge_positions([r["data"] for r in per_rank])  # every lane, whichever rank held it

    # ----------------------------------------------------------------------------- the loop
    def train(self) -> int:
        cfg, info = self.cfg, self.info
        max_steps = cfg.optim.max_steps
        stop = StopFlag(info)
        self.loader.should_stop = stop.anywhere  # a signal, on any rank, also ends the loader's wait in an outage
        if self.resumed_from and info.is_main:
            run_log.truncate_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), self.step)
        for line in start_lines(cfg, self.vae, info, self.run_dir, self.schedule, self.speed):
            self.log(line)
        self.best.resume(self.step, self.log)  # and the step saved last (a --resume PATH may be another run's)
        self.last_saved = self.step if checkpoint.in_folder(self.resumed_from, self.ckpt_dir) else -1
        owed_evaluation, owed_probe = self.owed
        if self.eval_on and (self.step == 0 or owed_evaluation):
            self.evaluate()  # the untrained baseline, and a sanity check of the test set before hours of training
        if self.in_loop_probe and (self.step == 0 or owed_probe):
            self.probe()  # the curve's first point
        t_start, steps_since, compiled_once = time.time(), 0, False
        while self.step < max_steps:
            self.before_step()
            position, batches, data_error = read_step_batches(self.loader, cfg.optim.grad_accum)
            if any_rank(batches is None, info):  # agreed before the step, whose collectives a save would cross
                return self.stop_without_batches(position, data_error, self.last_saved)
            rng = capture_rng(self.device)  # (microseconds) what a checkpoint of an abandoned step must hold
            try:
                self.train_step(batches)
            except torch.OutOfMemoryError as e:
                self.data_position, self.rng_position = position, rng
                return self.stop_out_of_memory(e, self.last_saved)
            compiled_once = compiled_once or self.said_compile_time(t_start, steps_since)
            self.step += 1
            steps_since += 1
            self.report.step_done(self.step)
            final = self.step == max_steps
            if self.report.log_due(self.step) or final:
                self.log_window(t_start, steps_since)
                t_start, steps_since = time.time(), 0
            streak = self.guard.checked_streak()  # every step: a streak that ends between two logs counts
            if streak >= cfg.run.max_bad_steps:
                latest = checkpoint.checkpoint_files(self.ckpt_dir)
                self.log(f"error: {streak} consecutive steps had non-finite losses or gradients and were "
                         f"skipped; stopping. Last good checkpoint: {latest[0] if latest else 'none'}")
                return 1
            stopping = stop.agreed(info)
            due = self.step % cfg.run.save_every_n_steps == 0 or final or stopping
            if due and self.step != self.last_saved and self.save_unless_in_bad_streak(stopping or final):
                self.last_saved = self.step
            if stopping:
                self.log(f"received signal {stop.signum}: checkpoint written at step {self.step}, exiting")
                return 0
            if self.eval_on and (self.step % cfg.eval.evaluate_every_n_steps == 0 or final):
                self.evaluate()  # (a new best is saved at once)
            if self.in_loop_probe and (self.step % cfg.latents.probe_every_n_steps == 0 or final):
                self.probe()  # every rank takes part
        self.log(f"done: {max_steps} steps; checkpoints in {self.ckpt_dir}, samples in {self.report.sample_dir}"
                 f"{self.best.done()}")
        return 0

    def train_step(self, batches: list[torch.Tensor] | None = None) -> None:
        """One optimizer step over --grad_accum micro-batches (`batches`, or the loader's), each through the step's
        one dataflow (objective.micro_step); then both optimizer steps, which the guard skips if anything blew up.
        The critic's buffers are taken as the step finds them first (Adversary.step_began): a step skipped or abandoned
        midway leaves them so, whoever calls the step (the loop, bench, a test)."""
        if self.adversary is not None:
            self.adversary.step_began()
        accum = self.cfg.optim.grad_accum
        step_loss = torch.zeros((), device=self.device)  # this step's losses, for the guard
        for micro in range(accum):
            batch = batches[micro] if batches is not None else next(self.loader)
            x = data_lib.to_model_input(batch, self.device, self.channels_last)
            index = self.info.rank * accum + micro  # among the step's micro-batches: its noise, on any rank count
            torch.manual_seed(micro_seed(self.cfg.optim.seed, self.step, index))
            out = micro_step(self.objective, self.training.ddp, x, self.step, index, accum, micro == accum - 1,
                             self.regularisers, self.training.scaler.scale(torch.ones((), device=self.device)),
                             self.last_layer)
            if out.critic_loss is not None:
                self.metrics.add(**{k: v / accum for k, v in out.critic_logs.items()})
                step_loss = step_loss + out.critic_loss
            step_loss = step_loss + out.loss
            self.metrics.add(**{k: v / accum for k, v in out.logs.items()})
            run_log.latent_metrics(self.metrics, out.mean, out.logvar, accum, self.posterior_var)
        self.optimizer_steps(step_loss)
        self.metrics.end_step()

    guarded_step = staticmethod(NonFiniteGuard.step_optimizer)  # a test or a variant may wrap it (an attribute)

    def optimizer_steps(self, step_loss: torch.Tensor) -> None:
        """Guarded optimizer steps: a non-finite loss or gradient on any rank skips the step on every rank
        (device flags, no host sync); EMA and LeCam's anchors move only with a step taken."""
        guard, adversary, training = self.guard, self.adversary, self.training
        bad_vae = training.nonfinite(guard, self.metrics)
        bad_loss = ~torch.isfinite(step_loss)
        bad_vae = bad_vae | bad_loss
        bad_disc = (guard.nonfinite(adversary.critic, adversary.optimizer, adversary.scaler, "disc", self.metrics)
                    | bad_loss if adversary is not None else torch.zeros_like(bad_vae))
        flags = torch.stack([bad_vae, bad_disc]).float()
        if self.info.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        training.step(flags[0], self.step, self.guarded_step)
        if adversary is not None:
            adversary.step(flags[1], self.guarded_step)
            self.metrics.add(**{"guard/skipped_disc": flags[1]})
        guard.record(flags.amax())
        self.metrics.add(**{"guard/skipped_vae": flags[0]})

    # ----------------------------------------------------------------------------- the loop's turns
    def said_compile_time(self, t_start: float, steps_since: int) -> bool:
        """With --compile, what the first step of this process cost (its compilation), said once; True when said."""
        if not self.cfg.speed.compile or steps_since:
            return False
        self.log(f"step {self.step + 1} (compiling the encoder, decoder and critic) took {time.time() - t_start:.0f}"
                 " s; each new image size compiles again once")
        return True

    def before_step(self) -> None:
        """Before each step: its size in the metrics (--train_resolutions: metrics.jsonl's train/resolution is each
        window's mean size), and the last stage's freeze when its first step has come (a resumed run: before its first
        step)."""
        if self.cfg.data.train_resolutions:
            size = self.schedule.size_at(self.step)
            self.metrics.add(**{"train/resolution": torch.full((), float(size), device=self.device)})
        if self.last_stage is not None and self.step >= self.last_stage[0]:
            self.enter_last_stage()

    def enter_last_stage(self) -> None:
        """--last_stage_trains N: from the last stage's first step, only the decoder's N highest-resolution levels,
        norm_out and conv_out train (DC-AE's high-resolution adaptation); every rank reaches it at the same step."""
        levels = self.last_stage[1]
        trained = self.training.train_only(self.vae.last_stage_modules(levels))
        self.last_stage = None
        self.log(f"step {self.step}: the last stage trains the decoder's {levels} highest levels, norm_out and "
                 f"conv_out ({trained / 1e6:.2f}M parameters); the rest is frozen (--last_stage_trains)")

    def stop_without_batches(self, position: dict, data_error: str | None, last_saved: int) -> int:
        """Some rank has no batches for the trainer's next step. Every rank is here, before that step, so the
        checkpoint's collectives line up: it is written at the last completed step, with each stream's position before
        the step's reads (an exact resume). A data error ends the run with that error (exit 1), a stop request with 0."""
        error, self.data_position = first_error(data_error, self.info), position
        saved = self.step > 0 and self.step != last_saved and self.save_unless_in_bad_streak(final=True)
        outcome = (f"checkpoint written at step {self.step}" if saved else f"checkpoint of step {self.step} kept"
                   if self.step > 0 else "nothing trained, nothing saved")
        if error is not None:
            raise data_lib.DatasetError(error + (f" ({outcome})" if self.step > 0 else ""))
        self.log(f"stop request received while waiting for data: {outcome}, exiting")
        return 0

    def stop_out_of_memory(self, error: torch.OutOfMemoryError, last_saved: int) -> int:
        """A GPU out-of-memory error in a step: one line with the flags that help, and (one process) a checkpoint
        of the last completed step if none holds it, with the data stream's position and the RNG from before the
        abandoned step (train set them): a resume runs that step as an uninterrupted run would. Under torchrun no
        checkpoint: only this rank may have run out, and the others are blocked inside the step's collectives (DDP's
        gradient all-reduce), which no agreement can reach; torchrun ends them when this one exits, and the run resumes
        from its last periodic checkpoint (docs/fault_tolerance.md)."""
        cfg = self.cfg
        self.training.optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradients
        if self.adversary is not None:
            self.adversary.abandon_step()  # what its forward passes moved
        torch.cuda.empty_cache()  # a no-op without CUDA
        shape = memory.StepShape.of(self.schedule, cfg.optim, cfg.speed, self.precision,
                                    self.schedule.size_at(self.step), cfg.data.video_frames,
                                    self.vae.can_checkpoint(),
                                    memory.shard_count(self.vae), self.info.world_size)
        line = memory.out_of_memory_message(error, shape, self.step + 1)
        self.report.print(f"error: {line}", file=sys.stderr)
        if not self.info.distributed and self.step > 0 and self.step != last_saved:
            self.save_unless_in_bad_streak(final=True)
        return 1

    # ----------------------------------------------------------------------------- logging, saving, evaluating
    def log_window(self, t_start: float, steps_done: int, metrics: dict | None = None) -> None:
        """Report the metrics of the steps since the last log (reduced here: one all-reduce, one copy)."""
        metrics = self.metrics.reduce(self.info) if metrics is None else metrics
        metrics["guard/bad_steps_total"] = self.guard.total.item()
        self.report.metrics(metrics, self.step, time.time() - t_start, steps_done,
                            self.training.scheduler.get_last_lr()[0], run_log.skipped_counts(self.loader, self.info))

    def save_unless_in_bad_streak(self, final: bool) -> bool:
        """Inside a streak of skipped steps the weights are the last good ones, but periodic saves would rotate good
        checkpoints out; a stop and the run's last step (`final`) still save: a resume needs them. True if saved."""
        if not (final or int(self.guard.streak.item()) == 0):
            self.log(f"not saving at step {self.step}: inside a streak of skipped steps")
            return False
        path = self.save()
        if path:
            same = (" (sharded: each rank wrote its shards)" if self.training.sharded else
                    " (weights identical on all ranks)" if self.replicas_equal else " (rank 0's weights: ranks differ)")
            self.log(f"saved {path}" + (same if self.info.distributed else ""))
        return True

    def save(self) -> str | None:
        sharded = self.training.sharded
        self.sync_buffers()
        # sharded, each shard has one owner: there are no replicas of the VAE to compare
        in_sync = sharded or checkpoint.ranks_in_sync(self.training.replicated(), self.info)
        state = self.state.state_dict()  # every rank takes part in the gather
        # the critic's replicas too (the frozen critic's heads: only they are in its DDP buckets)
        critic_in_sync = self.adversary is None or checkpoint.ranks_in_sync(self.adversary.critic, self.info)
        state["run"].update(ranks_in_sync=in_sync, critic_in_sync=critic_in_sync)
        self.replicas_equal = in_sync and critic_in_sync
        if sharded:  # every rank writes its shards; the grid's whole weights are gathered by all, kept by rank 0
            path = checkpoint.write_checkpoint(self.ckpt_dir, self.step, state, self.cfg.run.keep_last_k, self.info)
            grid_vae = self.whole_vae(keep=self.info.is_main)
        if not self.info.is_main:
            return None
        if not in_sync:
            self.log("warning: VAE weights differ across ranks (DDP desynchronised); saving rank 0's")
        if not sharded:
            path, grid_vae = checkpoint.write_checkpoint(self.ckpt_dir, self.step, state,
                                                         self.cfg.run.keep_last_k), self.vae
        self.report.sample_grid(grid_vae, self.autocast, self.step)
        return path

    def whole_vae(self, keep: bool = True) -> torch.nn.Module | None:
        """The VAE with whole weights: itself, or sharded a copy of the template with its weights gathered (every
        rank calls it; `keep` False: this rank only takes part in the gathers)."""
        if self.whole_template is None:
            return self.vae
        return sharding.whole_copy(self.whole_template, self.vae, self.device, keep)

    def sync_buffers(self) -> None:
        if self.training.sharded:
            sharding.sync_buffers(self.vae)

    def whole_ema_state(self) -> dict | None:
        """The EMA's whole state dict of the VAE (gathered when sharded: every rank calls it), None without EMA."""
        ema = self.training.ema
        return None if ema is None else sharding.full_state(ema.model_state_dict(self.vae))

    def evaluate(self) -> dict:
        self.sync_buffers()
        results, grids = self.validator.run(self.whole_vae(), self.whole_ema_state(), self.autocast)
        if self.best.improves(results):  # the same on every rank: all take part in its save
            if self.step not in (0, self.last_saved) and self.save_unless_in_bad_streak(final=True):
                self.last_saved = self.step
            self.best.crown(self.step, results, self.training.sharded)
        self.report.evaluation(results, grids, self.step, self.best.record)
        return results

    def probe(self) -> None:
        self.sync_buffers()
        ema = self.training.ema
        if ema is not None and self.training.sharded:
            ema = sharding.Averaged(self.whole_ema_state())
        self.report.probe(self.step, *self.in_loop_probe(self.whole_vae(), ema))

    def close(self) -> None:
        self.loader.close()
        self.report.close()
        if self.run_lock is not None:
            self.run_lock.release()


def resolution_stages(cfg: Config) -> tuple[data_lib.ResolutionSchedule, tuple[int, int] | None]:
    """The --train_resolutions schedule (each step's size: the data workers compute the same), and with
    --last_stage_trains N (its first step, N); --compile set up for the schedule's sizes."""
    schedule, levels = data_lib.ResolutionSchedule.of(cfg.data, cfg.optim.seed), last_stage_levels(cfg)
    if cfg.speed.compile:
        compile_for_sizes(len(schedule.sizes))
    return schedule, None if levels is None else (schedule.stages[-1][0], levels)


def main(argv: list[str] | None = None, give_back_signals: bool = True) -> int:
    """The command. Run inside another program (a notebook, a test), it gives back the SIGINT/SIGTERM handlers its
    run's stop flag took; as the program itself (give_back_signals=False) the flag stays to the interpreter's end,
    so that a late SIGTERM (torchrun or a scheduler forwarding one) still ends it with exit 0."""
    common.guard_console()  # a dead `tee` or ssh session must not end the run (common.Console)
    is_rank0 = os.environ.get("RANK", "0") == "0"
    try:
        setup = prepare_run(argv, builds_demo_data=os.environ.get("LOCAL_RANK", "0") == "0")
    except ConfigError as e:
        if is_rank0:
            print(f"error: {redact(str(e))}", file=sys.stderr)
        return 2
    cfg, given, source, notes = setup
    torch.set_num_threads(cfg.speed.num_threads)
    for line in [*notes, cpu_use_line(cfg, given)] if is_rank0 else []:
        print(line, flush=True)
    for line in config_warnings(cfg, given) if is_rank0 else []:
        print(line, file=sys.stderr, flush=True)
    info = init_distributed()
    trainer, failed = None, False
    run_lock = checkpoint.RunLock(cfg.run.run_dir) if info.is_main else None
    kept = signal_handlers_kept() if give_back_signals else contextlib.nullcontext()
    with kept, closing_distributed(info):  # however the run ends
        try:
            start = Start.settle(cfg, info, run_lock, lambda line: print(line, flush=True) if info.is_main else None,
                                 setup.record)
            setup.record = None  # (its checkpoint is the start's now)
            trainer = Trainer(start.cfg, info, source, setup.derived, run_lock, start=start,
                              distill_source=setup.teacher)
            start = None  # the Trainer holds what it needs of the checkpoint
            source = setup.source = setup.teacher = None  # the weights are in the models now: no second copy
            return trainer.train()
        except RunComplete as e:
            if info.is_main:
                print(str(e), flush=True)
            return 0
        except memory.WontFit as e:  # like a refused flag: exit 2, nothing written
            if info.is_main:
                print(f"error: {e}", file=sys.stderr)
            return 2
        except (ConfigError, WeightsUnavailable, data_lib.DatasetError) as e:
            if info.is_main:
                print(f"error: {redact(str(e))}", file=sys.stderr)
            failed = True
            return 1
        finally:
            if trainer is not None:
                trainer.close()
                if failed and info.is_main and trainer.created_run_dir:
                    checkpoint.remove_run_dir_if_unused(trainer.run_dir)
            if run_lock is not None:
                run_lock.release()
            trainer = None  # its DDP modules hold the process group: closing_distributed ends it


if __name__ == "__main__":
    sys.exit(main(give_back_signals=False))
