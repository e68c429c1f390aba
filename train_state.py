"""The training-side state the trainer steps and checkpoints, each piece its own owner (state_dict /
load_state_dict, registered with checkpoint.Registry): the VAE's training (what DDP wraps, AdamW, the schedule,
the fp16 scaler, the EMA), the training forward (the latent regularisers' transform, a frozen encoder, a teacher
decoder), the alignment projection's training, and the non-finite guard. No loop here: vae_trainer.py's Trainer
drives them."""
from __future__ import annotations

import contextlib
from functools import partial
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import sharding
from ae import AutoEncoder
from common import ConfigError, DistInfo, load_optimizer_state
from config import FP32, OptimConfig, Precision
from run_log import Metrics
from utils import cosine_with_warmup


class EMA:
    """fp32 exponential moving average of the VAE parameters that train (frozen ones, --train_parts decoder, never
    change: their average is themselves), decay warmed up as min(decay, (1+t)/(10+t)). The update is skipped (on
    the device, no host sync) on steps the guard rejected. Under --sharding fsdp|hsdp each shadow is a DTensor laid
    out as its parameter (the rank holds and averages its shard only)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trained]
        self.shadow = [p.detach().float().clone() for _, p in trained]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int, skip: torch.Tensor) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        # the parameters that trained at the start, also those a later stage froze (--last_stage_trains: their
        # average keeps converging on their now fixed value)
        named = dict(model.named_parameters())
        params = [sharding.local(named[n].detach()).float() for n in self.names]
        shadow = [sharding.local(s) for s in self.shadow]  # (views of the DTensors' shards)
        delta = torch._foreach_sub(params, shadow)
        torch._foreach_mul_(delta, (1.0 - decay) * (1.0 - skip))
        torch._foreach_add_(shadow, delta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        sharding.copy_into(self.shadow, [state[name] for name in self.names])

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A whole state dict of `model` with the averaged weights (the frozen ones as they are)."""
        return {**model.state_dict(), **self.state_dict()}


@dataclass
class Decoded:
    """What one micro-batch's training forward gave: the reconstruction, the posterior (mean, log-variance: None for
    the constant one), the decode of also_decode(latent) (the additive scale-equivariance term; None without), and
    the teacher's decode of the latent the reconstruction was decoded from (--distill_weight; None without), and the
    teacher's latent the reconstruction was decoded from (--distill_from: the student encoder's target; None
    without)."""
    recon: torch.Tensor
    mean: torch.Tensor
    logvar: torch.Tensor | None
    added: torch.Tensor | None = None
    teacher: torch.Tensor | None = None
    target_latent: torch.Tensor | None = None


class TrainingForward(torch.nn.Module):
    """The VAE's pass in training, the module DDP wraps: encode, sample the posterior, transform the latent
    (`latent_transform`: the regularisers of latents.py), decode; beside it the decode of also_decode(latent) and the
    teacher's decode of the transformed latent (without gradient). Passed through this forward, the whole pass stays
    inside DDP's. Returns Decoded's fields as a tuple (what DDP hands back): Decoded(*outputs).

    `frozen_encoder` (--train_parts decoder): the encoder side (the encoder and quant_conv: what the family names)
    and the posterior are frozen (no requires_grad, eval mode) and run under no_grad; only post_quant_conv and the
    decoder train, so DDP's buckets hold the decoder's gradients only (DDP skips parameters that do not require
    grad). `teacher`: a frozen decoder (TeacherDecoder). `teacher_latents` (--distill_from): the decoder decodes the
    teacher's latent of the images (TeacherLatents), which is also what the encoder's latent is compared with."""

    def __init__(self, vae: torch.nn.Module, teacher: TeacherDecoder | None = None, frozen_encoder: bool = False,
                 teacher_latents: TeacherLatents | None = None):
        super().__init__()
        self.vae, self.teacher, self.teacher_latents = vae, teacher, teacher_latents
        # what computes the posterior from pixels, as the model names it (ae.Trainable.encoder_side)
        self.frozen = [module for _, module in vae.encoder_side()] if frozen_encoder else []
        for module in self.frozen:
            module.requires_grad_(False).eval()

    def forward(self, x: torch.Tensor, latent_transform=None, also_decode=None) -> tuple:
        for module in self.frozen:
            module.eval()  # evaluation calls vae.train() on its way out
        with torch.no_grad() if self.frozen else contextlib.nullcontext():
            mean, logvar = self.vae.encode_moments(x)
        if self.teacher_latents is not None:  # (config: no latent regulariser, no teacher decoder with it)
            target = self.teacher_latents(x)
            return self.vae.decode(target), mean, logvar, None, None, target
        z = self.vae.sample(mean, logvar)
        added = self.vae.decode(also_decode(z)) if also_decode is not None else None
        if latent_transform is not None:
            z = latent_transform(z)
        teacher = None
        if self.teacher is not None:
            with torch.no_grad():
                teacher = self.teacher.decode(z)
        return self.vae.decode(z), mean, logvar, added, teacher, None


class TeacherLatents(torch.nn.Module):
    """--distill_from: the teacher VAE, frozen and in eval mode (never saved: a resumed run reads it again), and its
    pipelines' latent normalisation (ae.Trainable.diffusion_latents): images -> the latent a diffusion model of the
    teacher's latent space works in (its posterior mean, normalised, fp32), what a tiny autoencoder encodes to and
    decodes from."""

    def __init__(self, model: torch.nn.Module, normalise):
        super().__init__()
        self.model, self.normalise = model.requires_grad_(False).eval(), normalise

    def train(self, mode: bool = True) -> "TeacherLatents":
        return super().train(False)  # frozen: TrainingForward's train() must not switch it

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalise(self.model.encode(x).float())


class TeacherDecoder(torch.nn.Module):
    """The --init_from source's own decoder (with its post_quant_conv), frozen and in eval mode, that a decoder of
    other widths is distilled from (--distill_weight). Part of no checkpoint: a resumed run reads it from the source
    again."""

    def __init__(self, source_model: AutoEncoder):
        super().__init__()
        self.decoder = source_model.decoder
        self.post_quant_conv = source_model.post_quant_conv if source_model.params.quant_conv else None
        self.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> "TeacherDecoder":
        return super().train(False)  # frozen: TrainingForward's train() must not switch it

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z) if self.post_quant_conv is not None else z)


class VAETraining:
    """The VAE and everything that trains it: the module DDP wraps (the VAE, or its decoder behind a frozen
    encoder: `train_parts` "decoder"), AdamW (`make_optimizer(params, lr)`), the schedule, the (fp16) GradScaler
    and the EMA, from the optimisation section. A checkpoint entry ("training")."""

    def __init__(self, vae: AutoEncoder, optim: OptimConfig, make_optimizer, wrap_ddp, device: torch.device,
                 train_parts: str = "all", precision: Precision = FP32, compile: bool = False,
                 alignment: torch.nn.Module | None = None, teacher: TeacherDecoder | None = None,
                 teacher_latents: TeacherLatents | None = None):
        self.vae, self.optim, self.train_parts = vae, optim, train_parts
        self.trained = TrainingForward(vae, teacher, frozen_encoder=train_parts == "decoder",
                                       teacher_latents=teacher_latents)
        # --vf_weight: the alignment's projection trains beside the VAE (its own checkpoint entry)
        self.projection = ProjectionTraining(alignment.projection, optim, make_optimizer) if alignment else None
        if self.projection is not None:
            self.trained = WithProjection(self.trained, alignment.projection)
        if compile:
            vae.encoder.compile()  # the inner modules, never the DDP wrapper
            vae.decoder.compile()
        # a video VAE's temporal layers do not run on one-frame clips (--video_image_prob's steps)
        self.wrap_ddp = partial(wrap_ddp, find_unused=vae.unused_parameters())
        self.ddp = self.wrap_ddp(self.trained)  # (--sharding fsdp|hsdp: sharded in place, its parameters DTensors)
        self.sharded = sharding.is_sharded(vae)
        self.ema = EMA(vae, optim.ema_decay) if optim.ema_decay > 0 else None  # laid out as the parameters
        # the VAE's frozen parts (--train_parts decoder) stay out: no state, and weight decay never moves them
        self.optimizer = make_optimizer([p for p in vae.parameters() if p.requires_grad], optim.learning_rate_vae)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(optim.warmup_steps, optim.max_steps, optim.min_lr_ratio))
        self.precision = precision  # the run's (config.Precision, built once by the trainer)
        self.scaler = precision.grad_scaler(device.type)

    def train_only(self, modules: list[torch.nn.Module]) -> int:
        """Freeze every VAE parameter outside `modules` (--last_stage_trains) and wrap for DDP again, so that its
        buckets hold only what trains (a frozen parameter gets no gradient, which DDP would wait for). The optimizer
        keeps every parameter: fused AdamW skips one without a gradient, so its moments stay and weight decay stops
        moving it. Every rank calls it at the same step. Returns the count of parameters that still train."""
        keep = {id(p) for m in modules for p in m.parameters()}
        for p in self.vae.parameters():
            if id(p) not in keep:
                p.requires_grad_(False)
        self.ddp = None  # the old wrapper's reducer (its gradient hooks) goes before the new one is built
        self.ddp = self.wrap_ddp(self.trained)
        return sum(p.numel() for p in self.vae.parameters() if p.requires_grad)

    def replicated(self) -> torch.nn.Module:
        """What DDP must keep equal on every rank: the VAE and the --vf_weight projection (checked at each save)."""
        return torch.nn.ModuleList([self.vae] + ([self.projection.projection] if self.projection else []))

    def nonfinite(self, guard, metrics: Metrics) -> torch.Tensor:
        """The guard's check of the VAE's gradient, and of the projection's (unscaled by the same fp16 scaler)."""
        bad = guard.nonfinite(self.vae, self.optimizer, self.scaler, "vae", metrics)
        if self.projection is not None:
            bad = bad | guard.nonfinite(self.projection.projection, self.projection.optimizer, self.scaler,
                                        "vf_projection", metrics)
        return bad

    def step(self, bad: torch.Tensor, step: int, step_optimizer) -> None:
        step_optimizer(self.optimizer, self.scaler, bad)
        if self.projection is not None:  # skipped with the VAE; after the scaler's update (it has none of its own)
            self.projection.step(bad, step_optimizer)
        if self.ema is not None:
            self.ema.update(self.vae, step, bad)
        self.scheduler.step()

    def state_dict(self) -> dict:
        """Whole tensors on the CPU; sharded (--sharding fsdp|hsdp), the rank's DTensors on its device and the
        optimizer keyed by parameter name, which checkpoint.write_checkpoint hands to DCP (every rank writes its
        shards)."""
        if self.sharded:
            return {"vae": self.vae.state_dict(), "ema": self.ema.model_state_dict(self.vae) if self.ema else None,
                    "optimizer": sharding.optimizer_state(self.vae, self.optimizer),
                    "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                    "train_parts": self.train_parts}
        return {"vae": {k: v.detach().cpu() for k, v in self.vae.state_dict().items()},
                "ema": ({k: v.detach().cpu() for k, v in self.ema.model_state_dict(self.vae).items()}
                        if self.ema else None),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "train_parts": self.train_parts}

    def load_state_dict(self, state: dict, path: str, log=print) -> None:
        if state["train_parts"] != self.train_parts:
            raise ConfigError(f"{path} was trained with --train_parts {state['train_parts']}: resume with the same "
                              "(its optimizer holds those parameters), or start a new --run_name from it with "
                              "--load_path")
        if "dcp" in state:  # a sharded checkpoint's tensors, read now (every rank together)
            state = {**state, **self.read_sharded(path, state["dcp"])}
        sharding.load_model(self.vae, state["vae"])
        if self.ema is not None:
            if state.get("ema"):
                self.ema.load_state_dict(state["ema"])
            else:
                self.ema = EMA(self.vae, self.optim.ema_decay)
        sharding.load_optimizer(self.vae, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.restore_scaler(self.scaler, state.get("scaler"))


    def read_sharded(self, path: str, written: list[str]) -> dict:
        """The DCP parts (`written`: vae, ema, optimizer) of the sharded checkpoint `path`: this run sharded, each rank
        reads its shards of them (resharded from whatever layout wrote them); otherwise every rank reads them whole."""
        try:
            if not self.sharded:
                return sharding.load_whole(path)["training"]
            template = {"vae": self.vae.state_dict(), "optimizer": sharding.optimizer_state(self.vae, self.optimizer)}
            if "ema" in written and self.ema is not None:
                template["ema"] = self.ema.model_state_dict(self.vae)
            return sharding.load_sharded(path, template)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ConfigError(f"{path}: unreadable sharded checkpoint ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''})") from None


class WithProjection(torch.nn.Module):
    """The module DDP wraps when the alignment trains: the TrainingForward and the alignment's projection, so
    one DDP all-reduces both (in the same buckets, skipped together under no_sync) and broadcasts both at start.
    The projection is used by the objective after the forward; DDP only needs its gradient in the same backward."""

    def __init__(self, trained: torch.nn.Module, projection: torch.nn.Module):
        super().__init__()
        self.trained, self.projection = trained, projection

    def forward(self, *args, **kwargs):
        return self.trained(*args, **kwargs)


class ProjectionTraining:
    """--vf_weight: the alignment's 1x1 projection trains with the VAE (in its DDP wrapper, WithProjection) under
    its own AdamW and schedule with the VAE's settings, unscaled by the VAE's fp16 scaler and skipped with the VAE's
    step. Its own optimizer, so a checkpoint written without it still resumes (the projection then starts afresh).
    No EMA: the EMA is of the VAE, what is evaluated and exported; the projection is never exported. A checkpoint
    entry ("vf_projection")."""

    def __init__(self, projection: torch.nn.Module, optim: OptimConfig, make_optimizer):
        self.projection = projection
        self.optimizer = make_optimizer(projection.parameters(), optim.learning_rate_vae)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(optim.warmup_steps, optim.max_steps, optim.min_lr_ratio))
        self.no_scaler = torch.amp.GradScaler(enabled=False)  # the VAE's scaler updates once, after the VAE's step

    def step(self, bad: torch.Tensor, step_optimizer) -> None:
        step_optimizer(self.optimizer, self.no_scaler, bad)
        self.scheduler.step()

    def state_dict(self) -> dict:
        return {"projection": {k: v.detach().cpu() for k, v in self.projection.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict | None, path: str = "", log=print) -> None:
        if state is None:
            log(f"note: {path} has no alignment projection (written without --vf_weight): it starts afresh")
            return
        saved = state["projection"]
        if "bias" in saved:  # written before the projection lost its bias (alignment.latent_projection)
            log(f"note: {path}'s alignment projection has a bias, which VA-VAE's has not (it lets a constant vector "
                "meet the cosine term): it continues with its weight and without the bias, its optimizer afresh")
            self.projection.load_state_dict({k: v for k, v in saved.items() if k != "bias"})
        else:
            self.projection.load_state_dict(saved)
            load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class NonFiniteGuard:
    """A step whose loss or gradient is not finite on any rank is skipped on every rank (device flags, no host
    sync); the skipped steps are counted, and a streak of --max_bad_steps stops the run. Checked every step: on
    CUDA the streak is read one step late from a pinned copy (waiting only for the previous step's copy, which has
    normally landed: no sync on this step's work); elsewhere exactly. A checkpoint entry ("guard")."""

    def __init__(self, device: torch.device, grad_clip: float):
        self.device, self.grad_clip = device, grad_clip
        self.total = torch.zeros((), device=device)
        self.streak = torch.zeros((), device=device)
        self.cuda = device.type == "cuda"
        self._copies = [torch.zeros((), pin_memory=True) for _ in range(2)] if self.cuda else []
        self._events: list = [None, None]
        self._latest = 0  # which copy the last step wrote

    def nonfinite(self, module, optimizer, scaler, name: str, metrics: Metrics) -> torch.Tensor:
        """Unscale (fp16), clip, log the norm; True (a device bool) if the gradient is not finite."""
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        params = [p for p in module.parameters() if p.grad is not None]
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        # sharded: the norm over every rank's shards (DTensor reduces the local sums), replicated; its local value
        norm = sharding.whole(norm)
        metrics.add(**{f"grad_norm/{name}": norm})
        return ~torch.isfinite(norm)

    @staticmethod
    def step_optimizer(optimizer, scaler, bad: torch.Tensor) -> None:
        optimizer.grad_scale, optimizer.found_inf = None, bad  # grads are already unscaled
        optimizer.step()
        del optimizer.grad_scale, optimizer.found_inf
        if scaler.is_enabled():
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def record(self, bad: torch.Tensor) -> None:
        self.total += bad
        self.streak = (self.streak + 1) * bad
        if self.cuda:
            self._latest = 1 - self._latest
            self._copies[self._latest].copy_(self.streak, non_blocking=True)
            self._events[self._latest] = torch.cuda.Event()
            self._events[self._latest].record()

    def checked_streak(self) -> int:
        """The streak of skipped steps for the every-step check (CUDA: as of the previous step)."""
        if not self.cuda:
            return int(self.streak.item())
        previous = 1 - self._latest
        if self._events[previous] is None:
            return 0
        self._events[previous].synchronize()
        return int(self._copies[previous].item())

    def state_dict(self) -> dict:
        return {"bad_steps_total": int(self.total.item()), "bad_streak": int(self.streak.item())}

    def load_state_dict(self, state: dict | None, **_) -> None:
        state = state or {}
        self.total.fill_(state.get("bad_steps_total", 0))
        self.streak.fill_(state.get("bad_streak", 0))


def compile_for_sizes(sizes: int) -> None:
    """--compile with --train_resolutions: one static graph per crop size. Dynamo would otherwise turn the
    second shape it meets into a dynamic-shape graph (slower kernels, and a recompile at the change) and stop
    recompiling at its limit of 8 graphs per module (evaluation's and the sample grid's shapes count too). Each
    size costs one compilation per module when first met; the steps at that size then run at the static speed."""
    if sizes <= 1:
        return
    import torch._dynamo.config as dynamo_config
    dynamo_config.automatic_dynamic_shapes = False
    limit = 2 * sizes + 8  # each size twice (the last stage's freeze can retrace), evaluation's and the grid's
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def wrap_ddp(module: torch.nn.Module, info: DistInfo, find_unused: bool = False) -> torch.nn.Module:
    """DDP around `module` under torchrun (the gradients' buckets as views: no copy); the module itself otherwise.
    `find_unused`: a step may leave parameters without a gradient (the video VAE's time_convs on a one-frame step),
    which DDP then marks ready instead of waiting for them."""
    if not info.distributed:
        return module
    ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(module, device_ids=ids, gradient_as_bucket_view=True, find_unused_parameters=find_unused)


def wrap_sharded(module: torch.nn.Module, mesh, find_unused: bool = False) -> torch.nn.Module:
    """--sharding fsdp|hsdp: `module` (the training forward) sharded in place over `mesh` by the units its VAE's
    family names (sharding.py); `find_unused` needs nothing here: FSDP reduces the gradients a step produced, and
    every rank of a step takes the same kind of batch."""
    vae = module.trained.vae if hasattr(module, "trained") else module.vae
    if vae.unshardable():
        raise ConfigError(f"--sharding: {vae.describe()}: {vae.unshardable()}; use --sharding ddp")
    return sharding.shard(module, vae.shard_units(), mesh)


def adamw(optim: OptimConfig, params, lr: float) -> torch.optim.AdamW:
    """AdamW with the run's betas and weight decay. Fused: it reads `found_inf` on the device, so a step the guard
    rejected is skipped without a host sync."""
    return torch.optim.AdamW(params, lr=lr, betas=(optim.adam_beta1, optim.adam_beta2),
                             weight_decay=optim.weight_decay, fused=True)
