"""Train a latent-diffusion autoencoder (FLUX-style, constant-variance latent) with torchrun: `main`, and the
Trainer that builds, loops (`train()`, `train_step()`), steps and saves.

    torchrun --nproc_per_node=8 vae_trainer.py --dataset_url 'shards/{00000..01023}.tar' --do_ganloss
    python vae_trainer.py --demo                      # no data of your own needed

Recipe: LPIPS + pooled MSE + low-pass MSE + a VGG16 hinge discriminator, each loss branch balanced by
GradNorm; a latent penalty (the KL of the constant-variance posterior). fp32 by default. Every
hyperparameter is a flag (`--help`; config.py); the run directory <output_dir>/<run_name>/ holds config.json,
metrics.jsonl, checkpoints/ and samples/, and a run started again in it resumes where it stopped.
Who owns what: config.py the flags, objective.py the loss and the critic (Adversary), checkpoint.py the files
and the registry of stateful entries, run_log.py everything the user sees (Reporter).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

import checkpoint
import data as data_lib
import evaluate as evaluate_lib
import latents as latents_lib
import memory
import pretrained
import probe as probe_lib
import run_log
from ae import AutoEncoder
from alignment import fetch_foundation_weights
from checkpoint import checkpoint_files
from common import ConfigError, DistInfo, capture_rng, init_distributed, restore_rng
from config import (DEMO, Config, OptimConfig, build_parser, ch_mult_of, config_warnings, demo_summary,  # noqa: F401
                    cpu_use_line, finish_config, model_params, parse_config, parse_flags, prepare_demo, public_config,
                    read_init_source, resolve_auto, scale_equivariance_sizes, section, uses_vgg16, validate)
from objective import VAEObjective, no_sync_unless
from run_log import Metrics
from utils import (WeightsUnavailable, ensure_vgg16_weights, fetch_weights, load_vgg16_features,
                   vgg16_cache_path, warn_random_vgg)  # noqa: F401
from train_state import EMA, DecoderOnly, NonFiniteGuard, VAETraining, adamw, wrap_ddp  # noqa: F401  (tests and bench use these names)


# ============================================================================================
# The stop flag, and what the loop decides with every rank
# ============================================================================================
class RunComplete(Exception):
    """The run directory's run has reached --max_steps already: the message says so, and nothing is written."""


class StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current step; a second
    SIGINT aborts."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __call__(self) -> bool:
        """Whether this rank was signalled."""
        return self.signum is not None

    def agreed(self, info: DistInfo) -> bool:
        """Whether any rank was signalled."""
        return any_rank(self.signum is not None, info)


def any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether `flag` is true on any rank; over the gloo control group, so no device sync."""
    if not info.distributed:
        return flag
    flags = torch.tensor([int(flag)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=info.ctrl_group)
    return bool(flags.item())


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


def first_error(error: str | None, info: DistInfo) -> str | None:
    """The first rank's error, on every rank (all take part)."""
    errors = [error]
    if info.distributed:
        errors = [None] * info.world_size
        dist.all_gather_object(errors, error, group=info.ctrl_group)
    return next((e for e in errors if e), None)


def build_vae(cfg: Config, device: torch.device, memory_format, init_weights: bool,
              source: pretrained.Source | None = None, log=print) -> tuple[AutoEncoder, dict | None]:
    """The autoencoder on the device, with --load_path's or --init_from's weights when `init_weights` (not
    resuming); and the description of the --init_from source it was initialised from (None otherwise)."""
    vae, described = AutoEncoder(model_params(cfg)), None
    if cfg.load_path and init_weights:
        checkpoint.load_vae_weights_into(vae, cfg.load_path)
        log(f"initialised VAE weights from {cfg.load_path}")
    if cfg.init_from and init_weights:
        if source is None:
            source = read_init_source(cfg)
        vae.load_state_dict(source.state)
        described = source.describe()
        for note in source.notes:
            log(f"note: {note}")
        family = f", {source.family}" if source.family else ""
        log(f"initialised the VAE from {cfg.init_from} ({source.layout}{family})")
    vae.set_grad_checkpointing(cfg.grad_checkpointing)
    return vae.to(device, memory_format=memory_format), described


def build_objective(cfg: Config, info: DistInfo, device: torch.device, memory_format, eval_on: bool, log,
                    z_channels: int) -> VAEObjective:
    """LPIPS, the pixel losses and the adversary (critic, LeCam). VGG16 is needed when a loss trains on it;
    otherwise (pixel-only training) only evaluation's LPIPS metric wants it: loaded if its weights can be had,
    else that metric is reported missing with one note. A random VGG16 that no loss trains on is not built."""
    def vgg16_features():
        if cfg.vgg16_weights == "random" and info.is_main:
            warn_random_vgg("LPIPS" + (" and the discriminator" if cfg.do_ganloss and cfg.discriminator == "vgg16"
                                       else ""))
        path = fetch_weights(ensure_vgg16_weights, cfg.vgg16_weights, info.local_rank, info.ctrl_group)
        return load_vgg16_features(path)

    if cfg.vf_weight > 0 and cfg.train_parts != "decoder":  # the alignment's encoder: local rank 0 downloads first
        fetch_weights(partial(fetch_foundation_weights, cfg.vf_model), cfg.vf_weights, info.local_rank, info.ctrl_group)
    vgg_features, with_lpips = None, uses_vgg16(cfg)  # (features None with --vgg16_weights random: random init)
    if with_lpips:
        vgg_features = vgg16_features()
    elif eval_on and cfg.vgg16_weights != "random":
        try:
            vgg_features, with_lpips = vgg16_features(), True
        except WeightsUnavailable as e:
            if cfg.vgg16_weights != "torchvision":
                raise  # the user named a file: an error, not a missing metric
            log(f"note: evaluation's LPIPS will not be computed: {e}")
    return VAEObjective(cfg, vgg_features, with_lpips=with_lpips, device=device,
                        memory_format=memory_format, z_channels=z_channels)


# ============================================================================================
# The trainer
# ============================================================================================
class Trainer:
    """One training run: builds the VAE's training state, the objective (losses; the critic's owner), data and
    the reporter from the config, resumes from the run directory, and `train()`s. `source`: the --init_from
    source main() already read (None: read here if needed). `cfg` is finished (config.finish_config)."""

    def __init__(self, cfg: Config, info: DistInfo, source: pretrained.Source | None = None,
                 derived: dict[str, str | None] | None = None, run_lock: checkpoint.RunLock | None = None):
        self.cfg, self.info = cfg, info
        self.derived = derived  # {automatic field: its basis} (config.finish_config), recorded for a continued run
        self.device = info.device
        self.run_dir = os.path.join(cfg.output_dir, cfg.run_name)
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.sample_dir = os.path.join(self.run_dir, "samples")
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        self.step = 0
        self.gan = cfg.do_ganloss
        self.eval_on = bool(cfg.test_dataset_url and cfg.evaluate_every_n_steps)
        self.created_run_dir = False  # by this run (rank 0, once every check that can refuse the run passed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
            torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
            torch.backends.cudnn.benchmark = True

        # (path, checkpoint) or None; refuses incompatible run dirs. Nothing is written to the run directory
        # before every check that can refuse the run has passed (checkpoint.start_run_dir, below).
        # The run directory is this job's (rank 0 holds its lock until the run ends): a second job is refused here.
        # `run_lock`: main's, which it releases also when this constructor fails
        self.run_lock = run_lock or (checkpoint.RunLock(self.run_dir) if info.is_main else None)
        resume, set_aside = checkpoint.find_resume(cfg, info, self.run_dir, self.log, self.run_lock)
        # an evaluation or probe due at the resumed step that a stop interrupted (its record missing) is redone
        reached = int(resume[1].get("step", 0)) if resume is not None else 0
        self.owed = self.owed_at(reached) if resume is not None else (False, False)
        if resume is not None and (reached > cfg.max_steps or reached == cfg.max_steps and not any(self.owed)):
            if self.run_lock is not None:
                self.run_lock.release()
            raise RunComplete(f"{self.run_dir} is at step {resume[1]['step']} and --max_steps is {cfg.max_steps}: "
                              "nothing to train, nothing changed (a larger --max_steps continues it)")

        # networks: built from the same seed on every rank (DDP also broadcasts rank 0's weights), in this
        # order (random initialisations draw from the global RNG)
        torch.manual_seed(cfg.seed)
        # --init_from: what the run started from (path, layout, family, latent factors), in config.json and every
        # checkpoint; export keeps its factors after a decoder-only fine-tune
        self.init_source = resume[1].get("init_source") if resume is not None else None
        self.vae, source_described = build_vae(cfg, self.device, self.memory_format, resume is None, source, self.log)
        self.init_source = source_described or self.init_source
        self.objective = build_objective(cfg, info, self.device, self.memory_format, self.eval_on, self.log,
                                         self.vae.params.z_channels)
        self.adversary = self.objective.adversary  # the critic's owner; None without --do_ganloss
        self.validator = (evaluate_lib.Validator(cfg, self.lpips, self.device, info.rank, info.world_size,
                                                 info.local_rank, info.ctrl_group, self.memory_format, self.log)
                          if self.eval_on else None)
        if cfg.compile and self.adversary is not None:
            self.adversary.critic.compile()
        self.training = VAETraining(self.vae, cfg, partial(adamw, cfg), self.wrap_ddp, self.device, self.objective.alignment)
        if cfg.memory_check:  # before the critic's DDP wrapper (the probes run its forward without a backward)
            warning = memory.check_every_rank(self.vae, self.objective, memory.StepShape.of(cfg), self.device,
                                              self.ema is not None, info.ctrl_group)
            if warning:
                self.log(warning)
        if self.adversary is not None:
            self.adversary.prepare_training(section(cfg, OptimConfig), partial(adamw, cfg), self.wrap_ddp)
        self.guard = NonFiniteGuard(self.device, cfg.grad_clip)
        # every piece of state a checkpoint holds, each saved and restored by its owner
        self.state = checkpoint.Registry(
            training=self.training, adversary=self.adversary or checkpoint.ABSENT_ADVERSARY, guard=self.guard,
            run=self, **({"vf_projection": self.training.projection} if self.training.projection else {}))

        data_state, self.resumed_from = None, None
        # a stop between steps saves the stream's position and the RNG from before the step it abandons (None: now)
        self.data_position, self.rng_position = None, None
        torch.manual_seed(cfg.seed + 1000 * info.rank)  # per-rank posterior noise
        if resume is not None:
            data_state = self.state.load_state_dict(*resume, log=self.log)["run"]
        self.loader = data_lib.TrainLoader(
            cfg.dataset_url, cfg.vae_resolution, cfg.batch_size, cfg.seed, info.rank, info.world_size,
            cfg.num_workers, cfg.shuffle_buffer, cfg.resize_prob, cfg.max_image_pixels,
            pin_memory=self.device.type == "cuda", state=data_state, shard_retry_minutes=cfg.shard_retry_minutes)
        if self.loader.few_shards and info.is_main:
            self.log(f"note: fewer shards than data workers ({info.world_size} x {max(1, cfg.num_workers)}): "
                     "every worker reads every shard, in its own order")
        self.regularisers = latents_lib.LatentRegularisers(
            cfg.seed, info.rank, equivariance_prob=cfg.scale_equivariance_prob,
            equivariance_sizes=scale_equivariance_sizes(cfg), equivariance_rotate=cfg.scale_equivariance_rotate,
            noise_prob=cfg.latent_noise_prob, noise_max=cfg.latent_noise_max,
            downsample_factor=self.vae.downsample_factor, equivariance_form=cfg.scale_equivariance_form)
        self.in_loop_probe = probe_lib.InLoopProbe(cfg, self.device) if cfg.probe_every_n_steps else None
        self.metrics = Metrics()
        self.report = run_log.Reporter(cfg, info, self.run_dir)  # reads the grids' images: a bad set refuses here
        if info.is_main:
            config = {**public_config(cfg), **({"init_source": self.init_source} if self.init_source else {}),
                      **({"derived": self.derived} if self.derived is not None else {})}
            self.created_run_dir = checkpoint.start_run_dir(self.run_dir, config, set_aside, self.log)
            self.report.wandb = run_log.init_wandb(cfg.wandb_mode, cfg.project_name, cfg.run_name, self.run_dir,
                                                   public_config(cfg), self.log)

    # ----------------------------------------------------------------------------- building the parts
    def wrap_ddp(self, module):
        return wrap_ddp(module, self.info)

    # the parts under the names callers (bench.py, tests) reach them by; settable, as attributes were
    disc = property(lambda self: self.adversary.critic if self.adversary is not None else None)
    lpips = property(lambda self: self.objective.lpips)
    ema = property(lambda self: self.training.ema)
    opt_vae = property(lambda self: self.training.optimizer, lambda self, v: setattr(self.training, "optimizer", v))
    scaler_vae = property(lambda self: self.training.scaler, lambda self, v: setattr(self.training, "scaler", v))
    opt_disc = property(lambda self: self.adversary.optimizer, lambda self, v: setattr(self.adversary, "optimizer", v))
    scaler_disc = property(lambda self: self.adversary.scaler, lambda self, v: setattr(self.adversary, "scaler", v))

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

    # ----------------------------------------------------------------------------- the run directory, resuming
    def state_dict(self) -> dict:
        """The run's own checkpoint entry: its step, config and architecture, where it started from, and per
        rank the RNG and the data stream's position (every rank takes part in the gather)."""
        ranks = [None] * self.info.world_size
        mine = {"rng": self.rng_position or capture_rng(self.device),
                "data": self.data_position or self.loader.state_dict()}
        if self.info.distributed:
            dist.all_gather_object(ranks, mine, group=self.info.ctrl_group)
        else:
            ranks = [mine]
        return {"format_version": 1, "step": self.step, "config": public_config(self.cfg),
                "model_params": model_params(self.cfg).to_dict(), "init_source": self.init_source,
                "ranks": ranks, "world_size": self.info.world_size,
                **({"derived": self.derived} if self.derived is not None else {})}

    def load_state_dict(self, ckpt: dict, path: str, log=print) -> dict | None:
        """The step, a precision change's note, and this rank's RNG; returns this rank's data-stream state."""
        self.step = int(ckpt["step"])
        saved_precision = ckpt.get("config", {}).get("precision", self.cfg.precision)
        if saved_precision != self.cfg.precision:
            self.log(f"note: the checkpoint was written with --precision {saved_precision}; continuing in "
                     f"{self.cfg.precision}" + (" (the fp16 loss scale starts afresh)" if self.cfg.precision == "fp16"
                                                else ""))
        self.resumed_from = path
        per_rank = ckpt.get("ranks") or []
        if len(per_rank) == self.info.world_size:
            mine = per_rank[self.info.rank]
            restore_rng(mine["rng"], self.device)
            data_state = mine["data"]
        else:
            self.log(f"warning: {path} was written by {len(per_rank)} ranks, this run has {self.info.world_size}: "
                     "weights and optimizer resume exactly, the data stream and noise restart from new seeds")
            torch.manual_seed(self.cfg.seed + 1000 * self.info.rank + 7919 * self.step)
            data_state = {"batches": self.step * self.cfg.grad_accum}
        self.log(f"resumed from {path} at step {self.step}")
        return data_state

    def owed_at(self, step: int) -> tuple[bool, bool]:
        """(evaluation, probe): whether one was due at `step` and metrics.jsonl lacks its record (a stop in the middle
        of it: a second Ctrl-C, kill -9). Rank 0 reads the file; every rank follows (all take part in both)."""
        cfg, owed = self.cfg, (False, False)
        if self.info.is_main:
            keys = run_log.logged_keys(os.path.join(self.run_dir, "metrics.jsonl"), step)
            due = [step % every == 0 or step == cfg.max_steps if every else False
                   for every in (cfg.evaluate_every_n_steps if self.eval_on else 0, cfg.probe_every_n_steps)]
            owed = (due[0] and "eval/psnr" not in keys, due[1] and "eval/probe_loss" not in keys)
        return any_rank(owed[0], self.info), any_rank(owed[1], self.info)

    def checkpoint_state(self) -> dict:
        return self.state.state_dict()

    # ----------------------------------------------------------------------------- the loop
    def train(self) -> int:
        cfg, info = self.cfg, self.info
        stop = self.loader.should_stop = StopFlag()  # a signal also ends the loader's wait through an outage
        if self.resumed_from and info.is_main:
            run_log.truncate_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), self.step)
        self.report.run_start(self.vae)
        owed_evaluation, owed_probe = self.owed
        if self.eval_on and (self.step == 0 or owed_evaluation):
            self.evaluate()  # the untrained baseline, and a sanity check of the test set before hours of training
        if cfg.probe_every_n_steps and (self.step == 0 or owed_probe):
            self.report.probe(self.step, *self.in_loop_probe(self.vae, self.ema))  # the curve's first point
        t_start, steps_since = time.time(), 0
        last_saved = self.step if self.resumed_from else -1
        while self.step < cfg.max_steps:
            position, batches, data_error = read_step_batches(self.loader, cfg.grad_accum)
            if any_rank(batches is None, info):  # agreed before the step, whose collectives a save would cross
                return stop_without_batches(self, position, data_error, last_saved)
            rng = capture_rng(self.device)  # (microseconds) what a checkpoint of an abandoned step must hold
            try:
                self.train_step(batches)
            except torch.OutOfMemoryError as e:
                self.data_position, self.rng_position = position, rng
                return stop_out_of_memory(self, e, last_saved)
            self.step += 1
            steps_since += 1
            self.report.step_done(self.step)
            final = self.step == cfg.max_steps
            if self.report.log_due(self.step) or final:
                self.log_window(t_start, steps_since)
                t_start, steps_since = time.time(), 0
            streak = self.guard.checked_streak()  # every step: a streak that ends between two logs counts
            if streak >= cfg.max_bad_steps:
                latest = checkpoint_files(self.ckpt_dir)
                self.log(f"error: {streak} consecutive steps had non-finite losses or gradients and were "
                         f"skipped; stopping. Last good checkpoint: {latest[0] if latest else 'none'}")
                return 1
            stopping = stop.agreed(info)
            due = self.step % cfg.save_every_n_steps == 0 or final or stopping
            if due and self.step != last_saved and self.save_unless_in_bad_streak(stopping):
                last_saved = self.step
            if stopping:
                self.log(f"received signal {stop.signum}: checkpoint written at step {self.step}, exiting")
                return 0
            if self.eval_on and (self.step % cfg.evaluate_every_n_steps == 0 or final):
                self.evaluate()
            if cfg.probe_every_n_steps and (self.step % cfg.probe_every_n_steps == 0 or final):
                self.report.probe(self.step, *self.in_loop_probe(self.vae, self.ema))  # every rank takes part
        self.log(f"done: {cfg.max_steps} steps; checkpoints in {self.ckpt_dir}, samples in {self.sample_dir}")
        return 0

    def train_step(self, batches: list[torch.Tensor] | None = None) -> None:
        """One optimizer step over --grad_accum micro-batches (`batches`, or the loader's): per micro-batch the
        critic's backward, then the VAE's; then both optimizer steps, which the guard skips if anything blew up."""
        accum, adversary = self.cfg.grad_accum, self.adversary
        step_loss = torch.zeros((), device=self.device)  # this step's losses, for the guard
        for micro in range(accum):
            sync = micro == accum - 1  # DDP all-reduces gradients on the last micro-batch only
            batch = batches[micro] if batches is not None else next(self.loader)
            x = images = data_lib.to_model_input(batch, self.device, self.cfg.channels_last)
            with no_sync_unless(self.training.ddp, sync):
                # latents.py's regularisers: the losses below see the transformed image (x unchanged when off)
                target, to_decoder = self.regularisers.draw(x, self.step, micro)
                added = self.regularisers.draw_added(x, self.step, micro)  # (small image, latent transform) or None
                with self.autocast():
                    recon, mean, logvar, *small = self.training.ddp(x, latent_transform=to_decoder,
                                                                     also_decode=added and added[1])
                x, recon = target, recon.float()  # every loss reduces in fp32
                real_logits = fake_logits = None
                shared = self.objective.shared_trunk_pass(x, recon, self.step)  # --critic_trunk frozen: one pass
                if adversary is not None:  # the critic learns real vs detached fakes, every step
                    critic_x, critic_recon = (shared.x_features, shared.recon_features) if shared else (x, recon)
                    d_loss, real_logits, fake_logits, d_logs = self.critic_backward(critic_x, critic_recon, sync,
                                                                                    accum)
                    self.metrics.add(**{k: v / accum for k, v in d_logs.items()})
                    step_loss = step_loss + d_loss.detach()
                with self.objective.critic_frozen():
                    loss, logs = self.objective(x, recon, mean, logvar, self.step, real_logits, fake_logits, accum,
                                                loss_scale=self.training.scaler.scale(
                                                    torch.ones((), device=self.device)),
                                                last_layer=self.vae.decoder.conv_out.weight, latent=mean,
                                                images=images, added=(added[0], small[0].float()) if added else None,
                                                shared=shared)
                    step_loss = step_loss + loss.detach()
                    loss.backward()
            self.metrics.add(**{k: v / accum for k, v in logs.items()})
            run_log.latent_metrics(self.metrics, mean, logvar, accum, self.cfg.posterior_var)
        self.optimizer_steps(step_loss)
        self.metrics.end_step()

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    # the two steps of train_step a test or a variant may wrap (instance attributes win over these)
    guarded_step = staticmethod(NonFiniteGuard.step_optimizer)

    def critic_backward(self, x, recon, sync: bool, accum: int):
        return self.adversary.backward(x, recon, sync, accum)

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

    # ----------------------------------------------------------------------------- logging, saving, evaluating
    def log_window(self, t_start: float, steps_done: int) -> None:
        """Reduce the metrics of the steps since the last log (one all-reduce, one copy) and report them."""
        self.write_log(self.metrics.reduce(self.info), t_start, steps_done)

    def write_log(self, metrics: dict, t_start: float, steps_done: int) -> None:
        metrics["guard/bad_steps_total"] = self.guard.total.item()
        self.report.metrics(metrics, self.step, time.time() - t_start, steps_done,
                            self.training.scheduler.get_last_lr()[0], run_log.skipped_counts(self.loader, self.info))

    def save_unless_in_bad_streak(self, stopping: bool) -> bool:
        """Inside a streak of skipped steps the weights are the last good ones, but periodic saves would rotate
        good checkpoints out; a stop request is still honoured (resuming needs it). True if saved."""
        if not (stopping or int(self.guard.streak.item()) == 0):
            self.log(f"not saving at step {self.step}: inside a streak of skipped steps")
            return False
        path = self.save()
        if path:
            same = " (weights identical on all ranks)" if self.replicas_equal else " (rank 0's weights: ranks differ)"
            self.log(f"saved {path}" + (same if self.info.distributed else ""))
        return True

    def save(self) -> str | None:
        in_sync = checkpoint.ranks_in_sync(self.training.replicated(), self.info)
        state = self.state.state_dict()  # every rank takes part in the gather
        state["ranks_in_sync"] = in_sync
        # the critic's replicas too (the frozen critic's heads: only they are in its DDP buckets)
        state["critic_in_sync"] = self.adversary is None or checkpoint.ranks_in_sync(self.adversary.critic, self.info)
        self.replicas_equal = in_sync and state["critic_in_sync"]
        if not self.info.is_main:
            return None
        if not in_sync:
            self.log("warning: VAE weights differ across ranks (DDP desynchronised); saving rank 0's")
        path = checkpoint.write_checkpoint(self.ckpt_dir, self.step, state, self.cfg.keep_last_k)
        self.report.sample_grid(self.vae, self.autocast, self.step)
        return path

    def evaluate(self) -> dict:
        results, grids = self.validator.run(self.vae, self.ema.model_state_dict(self.vae) if self.ema else None,
                                            self.autocast)
        self.report.evaluation(results, grids, self.step)
        return results

    def close(self) -> None:
        self.loader.close()
        self.report.close()
        if self.run_lock is not None:
            self.run_lock.release()


def stop_without_batches(trainer: Trainer, position: dict, data_error: str | None, last_saved: int) -> int:
    """Some rank has no batches for the trainer's next step. Every rank is here, before that step, so the
    checkpoint's collectives line up: it is written at the last completed step, with each stream's position before
    the step's reads (an exact resume). A data error ends the run with that error (exit 1), a stop request with 0."""
    error, trainer.data_position = first_error(data_error, trainer.info), position
    saved = trainer.step > 0 and trainer.step != last_saved and trainer.save_unless_in_bad_streak(stopping=True)
    outcome = (f"checkpoint written at step {trainer.step}" if saved else f"checkpoint of step {trainer.step} kept"
               if trainer.step > 0 else "nothing trained, nothing saved")
    if error is not None:
        raise data_lib.DatasetError(error + (f" ({outcome})" if trainer.step > 0 else ""))
    trainer.log(f"stop request received while waiting for data: {outcome}, exiting")
    return 0


def stop_out_of_memory(trainer: Trainer, error: torch.OutOfMemoryError, last_saved: int) -> int:
    """A GPU out-of-memory error in a step: one line with the flags that help, and (one process) a checkpoint
    of the last completed step if none holds it, with the data stream's position and the RNG from before the
    abandoned step (the trainer set them): a resume runs that step as an uninterrupted run would. Under torchrun no
    checkpoint: only this rank may have run out, and the others are blocked inside the step's collectives (DDP's
    gradient all-reduce), which no agreement can reach; torchrun ends them when this one exits, and the run resumes
    from its last periodic checkpoint (README, fault tolerance)."""
    trainer.training.optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradients
    torch.cuda.empty_cache()  # a no-op without CUDA
    line = memory.out_of_memory_message(error, memory.StepShape.of(trainer.cfg), trainer.step + 1)
    trainer.report.print(f"error: {line}", file=sys.stderr)
    if not trainer.info.distributed and trainer.step > 0 and trainer.step != last_saved:
        trainer.save_unless_in_bad_streak(stopping=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    is_rank0 = os.environ.get("RANK", "0") == "0"
    try:
        finished = finish_config(argv, builds_demo_data=os.environ.get("LOCAL_RANK", "0") == "0")
        cfg, given, source, notes = finished
    except ConfigError as e:
        if is_rank0:
            print(f"error: {data_lib.redact(str(e))}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.num_threads)
    for line in [*notes, cpu_use_line(cfg, given)] if is_rank0 else []:
        print(line, flush=True)
    for line in config_warnings(cfg, given) if is_rank0 else []:
        print(line, file=sys.stderr, flush=True)
    info = init_distributed()
    trainer, failed = None, False
    run_lock = checkpoint.RunLock(os.path.join(cfg.output_dir, cfg.run_name)) if info.is_main else None
    try:
        trainer = Trainer(cfg, info, source, finished.derived, run_lock)
        source = None  # the source's weights are in the model now: do not hold a second copy for the whole run
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
            print(f"error: {data_lib.redact(str(e))}", file=sys.stderr)
        failed = True
        return 1
    finally:
        if trainer is not None:
            trainer.close()
            if failed and info.is_main and trainer.created_run_dir:
                checkpoint.remove_run_dir_if_unused(trainer.run_dir)
        if run_lock is not None:
            run_lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
