"""Will a training step fit in memory? An estimate made before training, from the real networks, and the one
line that says what will not fit and which flags help (also for a CUDA out-of-memory error met during training).

    needed = estimate_step_memory(vae, objective, StepShape(batch_size=4, resolution=2048))
    line = fit_message(needed, available_memory(device), shape, lambda s: estimate_step_memory(vae, objective, s))

The activations a step keeps for backward are measured, not derived: the trainer's own micro-batch dataflow
(objective.micro_step: the regularisers' draws, the forward, the critic's loss, the VAE's loss) runs at two small
probe sizes under torch.autograd.graph.saved_tensors_hooks, which sees every tensor autograd saves (gradient
checkpointing's discarded ones excepted: it installs its own hooks inside), so no loss term or feature the step
has can be left out here. Saved bytes grow linearly with the pixels of a micro-batch, so two probes give the slope
and the constant, and the step at the real batch and resolution is extrapolated from them. To that come the
weights, their gradients, the AdamW moments and the EMA copy (fp32 each) of every trained parameter, the copy of
the VAE that evaluation keeps for the EMA weights, and the in-loop probe's copy (between steps).

Under --sharding fsdp|hsdp (StepShape.shards > 1) the VAE's trained parameters, their gradients, AdamW moments and
EMA are held 1/N per rank (FSDP2 pads each parameter's first dimension to a multiple of N: counted so), plus what is
gathered whole during the step (state_memory): the root group's weights (kept whole from forward to backward) and
two units' at a time (the one computing and the next, prefetched), with the largest unit's whole gradient before its
reduce-scatter. Frozen parameters (--train_parts decoder's encoder side, a teacher), LPIPS and the critic (DDP) stay
whole. Activations are not sharded: the probes run a whole copy of the VAE (whole_for_probes), with no collective.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os

import torch
from torch import nn

from config import FP32, GRAD_CHECKPOINTING, Precision
from train_state import TrainingForward
from common import first_line

GIB = 1024 ** 3
BACKWARD_TENSORS = 4


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What sets a step's memory besides the networks: one micro-batch of `batch_size` images, or clips of `frames`
    frames (a step runs `grad_accum` of them one after another, so accumulation costs no activation memory)."""
    batch_size: int
    resolution: int
    grad_accum: int = 1
    precision: Precision = FP32  # the run's (config.Precision), or a remedy's
    grad_checkpointing: str = "none"  # config.GRAD_CHECKPOINTING
    frames: int = 0  # --video_frames (0: images)
    can_checkpoint: bool = True  # the model has gradient checkpointing (some diffusers classes have none)
    shards: int = 1  # the ranks the VAE's trained state is spread over (--sharding fsdp|hsdp); 1: whole (ddp)
    ranks: int = 1  # the run's processes (torchrun's world size): where --sharding fsdp could help
    time_chunks: tuple[int, int] = (0, 0)  # --train_time_chunks: (encoder frames, decoder latent frames) per chunk
    chunk_factor: int = 0  # the video model's temporal factor where it takes a chunk plan (a remedy); 0: none

    @classmethod
    def of(cls, schedule, optim, speed, precision: Precision, resolution: int | None = None, frames: int = 0,
           can_checkpoint: bool = True, shards: int = 1, ranks: int = 1) -> "StepShape":
        """The shape of a run's step at `resolution` (default: the reference, --vae_resolution) with the micro-batch
        the run's schedule (data.ResolutionSchedule) gives that size, from its optimisation and speed sections and
        its precision (the trainer's config.Precision)."""
        size = schedule.reference if resolution is None else resolution
        return cls(schedule.batch_for(size), size, optim.grad_accum, precision, speed.grad_checkpointing,
                   frames, can_checkpoint, shards, ranks, speed.time_chunks if frames else (0, 0))

    @classmethod
    def to_check(cls, schedule, optim, speed, precision: Precision, frames: int = 0,
                 can_checkpoint: bool = True, shards: int = 1, ranks: int = 1) -> list["StepShape"]:
        """The step shapes the memory check estimates: every size of the run's schedule (one without
        --train_resolutions) with its micro-batch, the largest first (a smaller size holds more images, and the
        floor of one image more pixels: any of them can need the most; the sizes are few)."""
        return [cls.of(schedule, optim, speed, precision, size, frames, can_checkpoint, shards, ranks)
                for size in reversed(schedule.sizes)]


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes of a training run at its peak: a training step's, or the in-loop probe's between steps."""
    activations: int  # saved for backward by one micro-batch (VAE + the larger of critic loss and VAE loss)
    weights: int  # every parameter of the VAE, LPIPS and the critic
    training_state: int  # gradients, AdamW's two moments and the EMA copy of the trained parameters
    copies: int = 0  # whole-VAE copies kept for the run: evaluation's model for the EMA weights
    between_steps: int = 0  # held only between steps, when the step's activations are freed: the probe's copy
    gathered: int = 0  # sharded: the weights (and a gradient) gathered whole during the step (state_memory)
    # CPU: what the process holds besides these tensors (the interpreter, the libraries, the heap the allocator keeps
    # of freed blocks: the probes' and the source's), measured by the check after its probes (process_bytes); 0 on
    # CUDA, where torch.cuda.max_memory_allocated counts tensors only
    process: int = 0

    @property
    def total(self) -> int:
        """The tensors at the peak: what the step adds to the memory in use must fit in the free memory."""
        # (between steps nothing is gathered: the root reshards after backward, every unit after its pass)
        return (max(self.activations + self.gathered, self.between_steps) + self.weights + self.training_state
                + self.copies)

    @property
    def peak(self) -> int:
        """The run's peak as its device measures it: on a CPU the process's peak resident memory (the tensors and
        the process itself), on CUDA torch.cuda.max_memory_allocated (the tensors)."""
        return self.total + self.process


@contextlib.contextmanager
def _probe_settings(vae: nn.Module, objective, shape: StepShape):
    """The VAE's checkpointing mode and chunk plan and the objective's precision as `shape` asks, restored after."""
    old, precision = vae.memory_plan(), objective.precision
    vae.set_memory_plan(shape.grad_checkpointing, shape.time_chunks)
    objective.precision = shape.precision
    try:
        yield
    finally:
        vae.set_memory_plan(*old)
        objective.precision = precision


def _networks(vae: nn.Module, objective) -> list[nn.Module]:
    """The VAE, the objective's loss networks and the critic (owned by the objective's adversary, not a
    submodule of it)."""
    return [vae, objective] + ([objective.critic] if objective.critic is not None else [])


def probe_activation_bytes(vae: nn.Module, objective, shape: StepShape, batch_size: int, resolution: int,
                           step: int | None = None, model: nn.Module | None = None, regularisers=None
                           ) -> tuple[int, int]:
    """Peak bytes saved for backward by one real micro-batch of `batch_size` random images at `resolution`, run
    through the trainer's own dataflow (objective.micro_step, without its backward): the forward's graph plus the
    larger of the critic's loss graph (freed by its backward before the VAE's loss is built) and the VAE loss's
    graph; and the largest single tensor among them. `model`: what the trainer runs forward (what its DDP wraps:
    train_state.TrainingForward, with the alignment's projection; default the VAE's plain TrainingForward);
    `regularisers`: the run's latent regularisers, drawn at their costliest (latents.LatentRegularisers.costliest)."""
    import latents as latents_lib
    from objective import micro_step
    device = next(vae.parameters()).device
    exclude = {p.untyped_storage().data_ptr() for m in _networks(vae, objective) for p in m.parameters()}
    if step is None:  # the generator term on: the costliest step
        step = objective.loss_cfg.disc_start if objective.adversary is not None else 0
    latent = resolution // vae.downsample_factor
    lpips_on = objective.lpips is not None and objective.loss_cfg.perceptual_weight > 0
    regularisers = (regularisers or latents_lib.LatentRegularisers(0)).costliest(
        latent, min_image=16 if lpips_on else 1)  # (LPIPS takes images of 16 px and more: config.LPIPS_MIN_SIZE)
    # a clip of the run's length: what a step keeps grows with its frames (and its latent frames, 1 + (T - 1) / 4)
    x = torch.rand(batch_size, 3, *((shape.frames,) if shape.frames else ()), resolution, resolution,
                   device=device) * 2 - 1
    phases: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def phase(name: str):
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in exclude and t.device.type != "meta":
                seen[ptr] = storage.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        phases[name] = (sum(seen.values()), max(seen.values(), default=0))

    with _probe_settings(vae, objective, shape):
        micro_step(objective, model or TrainingForward(vae), x, step, 0, 1, True, regularisers,
                   loss_scale=torch.ones((), device=device), last_layer=vae.last_layer(), phase=phase,
                   backward=False)
        if any(shape.time_chunks):  # backward recomputes one chunk at a time: the VAE's pass on one chunk's frames
            encoder_chunk, decoder_chunk = shape.time_chunks
            frames = 1 + max(encoder_chunk, decoder_chunk * vae.temporal_factor)
            vae.set_memory_plan(shape.grad_checkpointing, (0, 0))
            with phase("chunk"):  # (an upper bound: the whole VAE on one chunk's frames, and its first frame)
                (model or TrainingForward(vae))(x[:, :, :frames])
            vae.set_memory_plan(shape.grad_checkpointing, shape.time_chunks)
    forward, critic, loss = (phases[name] for name in ("forward", "critic", "loss"))
    chunk = phases.get("chunk", (0, 0))
    return forward[0] + max(critic[0], loss[0]) + chunk[0], max(forward[1], critic[1], loss[1], chunk[1])


def model_bytes(vae: nn.Module) -> int:
    """One copy of the VAE's weights and buffers (evaluation's EMA model, the probe's copy)."""
    return sum(t.numel() * t.element_size() for t in [*vae.parameters(), *vae.buffers()])


def estimate_step_memory(vae: nn.Module, objective, shape: StepShape, ema: bool = True,
                         probe_resolutions: tuple[int, int] | None = None, model: nn.Module | None = None,
                         regularisers=None, eval_copy: bool = False, probe_copy: bool = False,
                         probes: dict | None = None) -> StepMemory:
    """A training run's peak memory for `shape`, from two probes of one image each (default: 64 and 128 px,
    the smaller of them capped at the real resolution) extrapolated linearly in pixels and batch size.
    `vae`: the AutoEncoder (its trainable parameters are the ones with requires_grad); `objective`: the
    VAEObjective with the loss networks that are on; `model`, `regularisers`: probe_activation_bytes'. A frozen part
    (requires_grad off, as --train_parts decoder leaves the encoder) saves nothing for backward and holds no gradient
    or optimizer state, so it is estimated as the trainer will run it. `eval_copy`: evaluation keeps a copy of the
    VAE for its EMA weights (evaluation and EMA on); `probe_copy`: the in-loop probe copies the VAE between steps.
    `probes`: a dict that keeps the probes' results across calls (they depend on the precision, the checkpointing
    and the probe sizes only: another batch size, resolution or shard count is the same probes extrapolated).
    `shape.shards` > 1: the VAE's trained state per rank under --sharding (state_memory); `vae` is whole (sharded, the
    probes run whole_for_probes' copy)."""
    r1, r2 = probe_resolutions or (min(64, shape.resolution), min(128, shape.resolution))
    key = (shape.precision, shape.grad_checkpointing, shape.frames, shape.time_chunks, r1, r2)
    if probes is not None and key in probes:
        a1, a2, largest = probes[key]
    else:
        a1, largest = probe_activation_bytes(vae, objective, shape, 1, r1, model=model, regularisers=regularisers)
        a2 = a1
        if r2 != r1:  # (a step at most 64 px is probed once, at its own size)
            a2, largest = probe_activation_bytes(vae, objective, shape, 1, r2, model=model, regularisers=regularisers)
        if probes is not None:
            probes[key] = (a1, a2, largest)
    slope = (a2 - a1) / (r2 ** 2 - r1 ** 2) if r2 != r1 else a1 / r1 ** 2  # bytes per pixel of an image
    per_image = a1 + slope * (shape.resolution ** 2 - r1 ** 2)
    # Backward holds, beside what was saved, the gradients of the tensors it is working through (and, under
    # checkpointing, one recomputed block): a few tensors of the largest size, BACKWARD_TENSORS of them.
    transient = BACKWARD_TENSORS * largest * (shape.resolution / r2) ** 2
    activations = int((max(0.0, per_image) + transient) * shape.batch_size)
    weights, training_state, gathered = state_memory(vae, _networks(vae, objective)[1:], shape.shards, ema, model)
    copy_bytes = model_bytes(vae)
    between = copy_bytes if probe_copy else 0
    if shape.shards > 1 and (eval_copy or probe_copy):
        between += 2 * copy_bytes  # evaluation and the probe gather a whole VAE: its state dict and the model it fills
    return StepMemory(activations, weights, training_state, copy_bytes if eval_copy else 0, between, gathered)


def _sharded_bytes(p: torch.Tensor, shards: int) -> int:
    """One rank's bytes of `p` sharded `shards` ways on its first dimension (FSDP2's Shard(0), padded to a multiple
    of `shards`: every rank holds ceil(rows / shards) rows)."""
    if shards <= 1 or p.dim() == 0:
        return p.numel() * p.element_size()
    rows = p.shape[0]
    return math.ceil(rows / shards) * (p.numel() // max(rows, 1)) * p.element_size()


def state_memory(vae: nn.Module, others: list[nn.Module], shards: int = 1, ema: bool = True,
                 model: nn.Module | None = None, units: list[nn.Module] | None = None) -> tuple[int, int, int]:
    """(weights, gradients + AdamW + EMA, gathered) bytes per rank, from the parameters alone (a module built on
    the meta device will do). `vae`: the VAE, its trained parameters the ones with requires_grad; `others`: the
    loss networks and the critic (whole: LPIPS frozen, the critic under DDP); `model`: what the trainer wraps (the
    training forward, with the alignment's projection that trains beside the VAE; default the VAE). Gradients are of
    the parameter's dtype, AdamW's two moments and the EMA fp32. `shards` > 1 (--sharding fsdp|hsdp): the trained
    parameters of `model` and their state are 1/shards per rank, and `gathered` is what the step holds whole besides:
    the root group's trained weights (reshard_after_forward False: whole from forward to backward), the two largest
    units' (the one computing and the next one, prefetched) and the largest unit's gradient before its
    reduce-scatter (`units`: default the VAE's shard_units, as the trainer shards them)."""
    networks = [vae, *others] + ([model] if model is not None else [])
    params = list({id(p): p for m in networks for p in m.parameters()}.values())
    sharded = ({id(p) for p in (model or vae).parameters() if p.requires_grad} if shards > 1 else set())

    def local(p: torch.Tensor, per_element: int | None = None) -> int:
        """One rank's bytes of p (or of a state of `per_element` bytes per element of it)."""
        nbytes = _sharded_bytes(p, shards) if id(p) in sharded else p.numel() * p.element_size()
        return nbytes if per_element is None else nbytes // p.element_size() * per_element
    weights = sum(local(p) for p in params)
    trained = [p for p in params if p.requires_grad]  # LPIPS is frozen; the critic trains
    vae_trained = [p for p in vae.parameters() if p.requires_grad]
    training_state = (sum(local(p) for p in trained)  # gradients
                      + sum(local(p, 4 * 2) for p in trained)  # AdamW's exp_avg and exp_avg_sq, fp32
                      + (sum(local(p, 4) for p in vae_trained) if ema else 0))  # the EMA's fp32 shadow
    gathered = 0
    if sharded:
        whole = {id(p): p.numel() * p.element_size() for p in params if id(p) in sharded}
        units = sorted((sum(whole.get(id(p), 0) for p in unit.parameters())
                        for unit in (vae.shard_units() if units is None else units)), reverse=True)
        root = sum(whole.values()) - sum(units)
        gathered = root + sum(units[:2]) + (units[0] if units else 0)
    return weights, training_state, gathered


def shard_count(module: nn.Module) -> int:
    """The ranks each of `module`'s sharded parameters is spread over (the mesh dimensions a DTensor parameter is
    Shard on: all ranks under fsdp, a node's under hsdp); 1 for a module without DTensors (ddp, one process)."""
    from sharding import is_dtensor
    for p in module.parameters():
        if is_dtensor(p):
            return math.prod(p.device_mesh.size(dim) for dim, placement in enumerate(p.placements)
                             if placement.is_shard())
    return 1


@contextlib.contextmanager
def whole_for_probes(template: nn.Module, vae: nn.Module, model: nn.Module, device):
    """Sharded (--sharding fsdp|hsdp), the VAE's parameters are DTensors that only the training forward gathers,
    every rank together; the probes, whose count can differ across ranks (a rank short of memory estimates the
    remedies too), run instead on a whole copy of the VAE on the device: `template` (the trainer's whole CPU copy,
    made before sharding) with the trained/frozen split of the sharded `vae`, inside a training forward like `model`
    (its frozen encoder, its teacher: frozen, so whole). Yields (vae, model) for estimate_step_memory; no
    collective. (--sharding refuses --vf_weight, whose projection would be sharded with the VAE:
    config.check_sharding.)"""
    from train_state import TrainingForward
    whole_vae = copy.deepcopy(template).to(device)
    trains = {name: p.requires_grad for name, p in vae.named_parameters()}
    for name, p in whole_vae.named_parameters():
        p.requires_grad_(trains.get(name, p.requires_grad))
    yield whole_vae, TrainingForward(whole_vae, model.teacher, frozen_encoder=bool(model.frozen))


def available_memory(device: torch.device | str) -> tuple[int, str]:
    """(bytes this process can still allocate, what they are) on `device`: CUDA's free memory, or the
    machine's available RAM (/proc/meminfo's MemAvailable, capped by a cgroup's memory limit)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)}"
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        import psutil  # not Linux: psutil knows
        available = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = open(limit_file).read().strip(), open(usage_file).read().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, int(limit) - int(usage))
        break
    return available, "RAM available"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.0f} MiB"


def remedies(shape: StepShape, fits=None) -> list[tuple[str, StepShape]]:
    """The flags that cut a step's memory, strongest last, each with the shape it gives: under torchrun with DDP,
    sharding the VAE's state over the ranks (the same math; only where `fits(shape) -> bool`, if given, says it
    would fit); checkpointing the high-resolution levels (then all), a smaller micro-batch with accumulation (same
    images per step), bf16."""
    out = []
    if shape.ranks > 1 and shape.shards == 1:
        sharded = dataclasses.replace(shape, shards=shape.ranks)
        if fits is None or fits(sharded):
            out.append(("--sharding fsdp", sharded))
    stronger = [mode for mode in ("hr", "all") if shape.can_checkpoint
                and GRAD_CHECKPOINTING.index(mode) > GRAD_CHECKPOINTING.index(shape.grad_checkpointing)]
    if stronger:
        out.append((f"--grad_checkpointing {stronger[0]}", dataclasses.replace(shape, grad_checkpointing=stronger[0])))
    plan = chunk_remedy(shape)
    if plan is not None and shape.time_chunks != plan:
        out.append((f"--train_time_chunks {plan[0]},{plan[1]}", dataclasses.replace(shape, time_chunks=plan)))
    if shape.batch_size > 1:
        smaller = shape.batch_size // 2
        accum = shape.grad_accum * shape.batch_size // smaller
        out.append((f"--batch_size {smaller} --grad_accum {accum}",
                    dataclasses.replace(shape, batch_size=smaller, grad_accum=accum)))
    if shape.precision.name == "fp32":
        out.append(("--precision bf16", dataclasses.replace(shape, precision=Precision.of("bf16"))))
    return out


def chunk_remedy(shape: StepShape) -> tuple[int, int] | None:
    """The smallest chunk plan (each part's pass of one latent frame at a time) where the model takes one, the clip
    has more than one chunk's frames, and the run is not sharded (config refuses chunks with --sharding fsdp|hsdp)."""
    if shape.chunk_factor and shape.shards == 1 and shape.frames > 1 + shape.chunk_factor:
        return (shape.chunk_factor, 1)
    return None


def all_remedies(shape: StepShape) -> tuple[str, StepShape] | None:
    """Every remedy at once, at their strongest (every level checkpointed, one image per micro-batch, bf16);
    None if the shape has them all already."""
    strongest = dataclasses.replace(shape, grad_checkpointing="all" if shape.can_checkpoint else
                                    shape.grad_checkpointing, batch_size=1,
                                    grad_accum=shape.grad_accum * shape.batch_size,
                                    time_chunks=chunk_remedy(shape) or shape.time_chunks,
                                    precision=Precision.of("bf16") if shape.precision.name == "fp32" else
                                    shape.precision)
    if strongest == shape:
        return None
    flags = ["--grad_checkpointing all"] if strongest.grad_checkpointing != shape.grad_checkpointing else []
    flags += ([f"--train_time_chunks {strongest.chunk_factor},1"] if strongest.time_chunks != shape.time_chunks
              else [])
    flags += [f"--batch_size 1 --grad_accum {strongest.grad_accum}"] if shape.batch_size > 1 else []
    flags += ["--precision bf16"] if shape.precision.name == "fp32" else []
    return " ".join(flags), strongest


def fit_message(needed: StepMemory, available: tuple[int, str], shape: StepShape, estimate=None,
                headroom: float = 0.9) -> str | None:
    """None if the step fits in `headroom` of the available memory, else one line: what it needs, what there
    is, and the flags that help (with what each would need, where `estimate(shape) -> StepMemory` is given)."""
    free, where = available
    if needed.total <= headroom * free:
        return None
    options = []
    fits = (lambda s: estimate(s).total <= headroom * free) if estimate else None  # --sharding fsdp: only if it fits
    for flags, new_shape in remedies(shape, fits):
        options.append(f"{flags} (~{_gib(estimate(new_shape).total)})" if estimate else flags)
    together = all_remedies(shape)
    if estimate and together and len([f for f, _ in remedies(shape) if not f.startswith("--sharding")]) > 1:
        options.append(f"all of them, {together[0]} (~{_gib(estimate(together[1]).total)})")
    options.append("a smaller --vae_resolution")
    sharded = (f" in {shape.shards} shards, whole units {_gib(needed.gathered)}" if shape.shards > 1 else "")
    return (f"a training step at batch {shape.batch_size} x {shape.resolution} px needs about {_gib(needed.total)} "
            f"(activations {_gib(needed.activations)}, weights {_gib(needed.weights)}, gradients/AdamW/EMA "
            f"{_gib(needed.training_state)}{sharded}) but {_gib(free)} is {where}; these help: " + ", ".join(options))


def shape_words(shape: StepShape) -> str:
    """'batch 2 x 256 px', with the clip length and the shards where there are."""
    clips = f" clips of {shape.frames} frames" if shape.frames else ""
    return f"batch {shape.batch_size}{clips} x {shape.resolution} px"


def summary_line(verdict: "Verdict") -> str:
    """The line the run prints at its start whether or not the step fits: what the step needs, by part, the peak the
    device will measure (a CPU's resident memory adds the process itself), and what the device has."""
    needed, (free, where) = verdict.needed, verdict.available
    parts = (f"activations {_gib(needed.activations)}, weights {_gib(needed.weights)}, gradients/AdamW/EMA "
             f"{_gib(needed.training_state)}" + (f", copies {_gib(needed.copies)}" if needed.copies else "")
             + (f", gathered units {_gib(needed.gathered)} ({verdict.shape.shards} shards)"
                if verdict.shape.shards > 1 else ""))
    if verdict.device == "cpu":
        peak = (f" + this process {_gib(needed.process)} (interpreter, libraries, allocator): a peak RSS of about "
                f"{_gib(needed.peak)}")
    else:
        peak = " of tensors (torch.cuda.max_memory_allocated; the CUDA context and the allocator's cache come on top)"
    return (f"memory check: a training step at {shape_words(verdict.shape)} needs about {_gib(needed.total)} "
            f"({parts}){peak}; {_gib(free)} {where}")


def out_of_memory_message(error: BaseException, shape: StepShape, step: int) -> str:
    """The one line for a CUDA out-of-memory error met at `step` (torch.cuda.OutOfMemoryError)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    held = f" ({_gib(torch.cuda.max_memory_allocated(device))} at peak in this process)" if device is not None else ""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    flags = ", ".join(f for f, _ in remedies(shape)) or "a smaller --vae_resolution"
    return (f"out of GPU memory at step {step} with batch {shape.batch_size} x {shape.resolution} px{held}: "
            f"{first_line(first)}; these help: {flags}")


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class WontFit(Exception):
    """A training step clearly needs more memory than there is; the message is one line for the user."""


# The estimate is within 25% of a real step's memory (tests/test_memory.py): a step estimated above the available
# memory by more than that would die; one estimated between 90% and 125% of it may fit, so it is only warned about.
REFUSE_ABOVE = 1.25


@contextlib.contextmanager
def _training_state_untouched(vae: nn.Module, objective):
    """The probes run real forwards: a critic's BatchNorm statistics, LeCam's pending anchors and the RNG would
    move. Put them back, so a run with the check trains exactly as one without it."""
    buffers = [b for m in _networks(vae, objective) for b in m.buffers()]
    saved = [b.clone() for b in buffers]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in zip(buffers, saved):
                    b.copy_(value)
            if objective.adversary is not None and objective.adversary.lecam is not None:
                objective.adversary.lecam.abandon()
            if cuda:
                torch.cuda.empty_cache()  # the probes' blocks, before the real step allocates its own


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The check on one rank: the step judged (the costliest of the shapes) and what it needs, what the device has,
    the warning line (None: it fits) and whether the run would die (refuse)."""
    line: str | None
    refuse: bool
    needed: StepMemory
    shape: StepShape
    available: tuple[int, str]
    device: str = "cpu"  # the device's type


def check_before_training(vae: nn.Module, objective, shape: StepShape | list[StepShape], device, ema: bool = True,
                          **features) -> Verdict:
    """The Verdict before the first step: its line None if the step fits; else fit_message's line, and whether the
    estimate exceeds the available memory by more than its own error (REFUSE_ABOVE: the run would die).
    `shape`: a step's, or several (StepShape.to_check: the sizes of --train_resolutions), of which the one that
    needs the most is judged. `features`: estimate_step_memory's model, regularisers, eval_copy and probe_copy."""
    probes: dict = {}

    def estimate(s: StepShape) -> StepMemory:
        return estimate_step_memory(vae, objective, s, ema, probes=probes, **features)

    def remedy_estimate(s: StepShape) -> StepMemory:
        """What a remedy would need, for the message only: probed at a quarter of the pixels (32 and 64 px), so
        that naming the flags that help costs less than judging the step (a remedy that only halves the batch
        reuses the step's probes)."""
        if (s.precision, s.grad_checkpointing, s.time_chunks) == (judged.precision, judged.grad_checkpointing,
                                                                  judged.time_chunks):
            return estimate(s)
        sizes = (min(REMEDY_PROBES[0], s.resolution), min(REMEDY_PROBES[1], s.resolution))
        return estimate_step_memory(vae, objective, s, ema, probe_resolutions=sizes, probes=probes, **features)
    shapes = shape if isinstance(shape, list) else [shape]
    # (a remedy: --train_time_chunks, which config refuses with sharding and with the adaptive weight)
    chunk_factor = vae.time_chunk_factor()
    if getattr(getattr(objective, "loss_cfg", None), "loss_balance", "gradnorm") == "adaptive":
        chunk_factor = 0
    shapes = [dataclasses.replace(s, chunk_factor=chunk_factor) if s.frames else s for s in shapes]
    with _training_state_untouched(vae, objective):
        needed, judged = max(((estimate(s), s) for s in shapes), key=lambda pair: pair[0].total)
        available = available_memory(device)
        line = fit_message(needed, available, judged, remedy_estimate)
    if torch.device(device).type == "cpu":
        needed = dataclasses.replace(needed, process=process_bytes(vae, needed, ema))
    return Verdict(line, line is not None and needed.total > REFUSE_ABOVE * available[0], needed, judged, available,
                   torch.device(device).type)


def process_bytes(vae: nn.Module, needed: StepMemory, ema: bool) -> int:
    """On a CPU, what this process holds now besides the tensors `needed` counts that are already built: its
    resident memory less the networks' weights and (`ema`: the trainer builds it before the check) the EMA's fp32
    shadow of the VAE's trained parameters. The interpreter and its libraries (0.6-0.9 GiB with torch, diffusers and
    torchvision), and the heap that glibc keeps of freed blocks (the init source's weights read, the probes'
    activations: the step reuses it, so it adds to the peak once). Measured after the probes."""
    shadow = sum(p.numel() * 4 for p in vae.parameters() if p.requires_grad) if ema else 0
    return max(0, rss_bytes() - needed.weights - shadow)


REMEDY_PROBES = (32, 64)  # the probe sizes of a remedy's estimate (check_before_training)


def check_every_rank(vae: nn.Module, objective, shape: StepShape | list[StepShape], device, ema: bool, group=None,
                     template: nn.Module | None = None, **features) -> "Checked":
    """Before the first step and before anything is written: raises WontFit if the step clearly will not fit
    (REFUSE_ABOVE) on any rank, else returns the lines to print (Checked): this rank's estimate (summary_line),
    and a warning line if the step may not fit on some rank. Every rank estimates for its own
    device; under torchrun the verdicts are gathered (every rank takes part, once: the only collective here).
    `template`: sharded (--sharding fsdp|hsdp), the VAE's whole CPU copy from before sharding, which the probes run
    a copy of (whole_for_probes; the shapes say the shard count)."""
    # the probes run the modules eagerly: compiled (--compile), each probe size would be one more compilation (and
    # the estimate is of the eager step, which holds more than a compiled one)
    whole = (whole_for_probes(template, vae, features.get("model") or TrainingForward(vae), device)
             if template is not None else contextlib.nullcontext((vae, features.get("model"))))
    with torch.compiler.set_stance("force_eager"), whole as (probe_vae, probe_model):
        mine = check_before_training(probe_vae, objective, shape, device, ema=ema,
                                     **{**features, "model": probe_model})
    del probe_vae, probe_model
    if template is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the whole copy's blocks
    verdicts = [(mine.line, mine.refuse)]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        verdicts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(verdicts, (mine.line, mine.refuse), group=group)
    refused = [line for line, refuse in verdicts if refuse]
    if refused:
        raise WontFit(f"{refused[0]}; --memory_check false skips this check")
    warned = [line for line, _ in verdicts if line]
    return Checked([summary_line(mine)] + ([f"warning: {warned[0]}"] if warned else []), mine)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What check_every_rank found: the lines the run prints (this rank's estimate, whether or not the step fits,
    then the warning of a rank whose step may not fit) and this rank's Verdict."""
    lines: list[str]
    verdict: Verdict
