"""--sharding fsdp|hsdp: the VAE's training state sharded across ranks with PyTorch's own FSDP2 (`fully_shard`,
DTensor), and its checkpoints written by every rank with torch.distributed.checkpoint (DCP), which reshards them
on load. No framework: the trainer's step is the same; only the VAE's wrapper, its state's tensors and the way a
checkpoint is written change.

What is sharded, and what is not:
- The VAE's trained parameters, their gradients, both AdamW moments and the EMA: each rank holds 1/N of each
  (N: the ranks a shard is spread over: all of them under fsdp, those of one node under hsdp).
- Units (the all-gather granularity): the blocks the encoder and decoder call, each at most 1/8 of the model
  where it allows (families.Family.shard_units, shard_units here); the rest (conv_in/out, norms, quant convs) is
  the root's one group.
- Frozen parameters (--train_parts decoder's encoder side, a --distill_weight teacher) stay whole, plain tensors
  outside every group (`ignored_params`): they take no gradient, so sharding them would only add all-gathers.
- The critic stays under DDP: a VGG16-sized critic is under 2 % of the state of the VAEs that need sharding, and
  its passes (an input-only backward for GradNorm, a backward with it frozen for the generator's term) are the
  ones DDP is proven on here.

Numerics (the same math as DDP, tests/test_sharding.py): parameters and gradient reductions stay fp32
(MixedPrecisionPolicy with no param_dtype: the all-gathered weights are fp32, the compute dtype is decided by
autocast as under DDP, so the fp32 islands, GroupNorm32 and the losses, stay where they are); the reduce-scatter
averages over ranks as DDP's all-reduce does. Under --grad_accum every micro-batch reduce-scatters (no
set_requires_gradient_sync(False)): skipping it would hold whole unsharded gradients between micro-batches, the
memory sharding is for; the sum of per-micro-batch averages is the average of sums up to fp32 rounding.

reshard_after_forward: True for the units (ZeRO-3: each unit's weights are gathered again in backward, so at most
a unit or two is whole at a time and the parameters' memory is 1/N; the extra all-gather is one unit's weights
against a VAE level's convolutions over full-resolution activations), False for the root (its small group is
needed again first in backward)."""
from __future__ import annotations

import copy
import os
import shutil
import warnings

import torch
import torch.distributed as dist
from torch import nn

from common import ConfigError, DistInfo, load_optimizer_state, moments_as_parameters

SHARDINGS = ("ddp", "fsdp", "hsdp")
# below this many trained parameters sharding saves under 1 GiB per rank and mostly adds communication: a note
USEFUL_PARAMS = 50_000_000


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage: in-place work on it moves the DTensor), a tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into the whole tensor (a collective: every rank calls it), a tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def is_sharded(module: nn.Module) -> bool:
    return any(is_dtensor(p) for p in module.parameters())


def mesh_for(kind: str, info: DistInfo):
    """The device mesh of --sharding: fsdp, one dimension over every rank; hsdp, (nodes, ranks per node): shards
    within a node (its fast links), replicas across nodes. torchrun's LOCAL_WORLD_SIZE is the ranks per node."""
    from torch.distributed.device_mesh import init_device_mesh
    if kind == "fsdp":
        return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    counts = [per_node] * info.world_size
    dist.all_gather_object(counts, per_node, group=info.ctrl_group)  # every rank refuses, or none: no hang
    if len(set(counts)) > 1 or info.world_size % per_node:
        raise ConfigError(f"--sharding hsdp needs the same ranks on every node: {info.world_size} ranks, "
                          f"{sorted(set(counts))} per node")
    return init_device_mesh(info.device.type, (info.world_size // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))


def shard_units(vae: nn.Module, largest: float = 0.125, smallest: float = 0.005) -> list[nn.Module]:
    """The all-gather units of a VAE: the blocks its encoder and decoder call, each at most `largest` of the
    parameters where the model allows (so that the whole weights of a unit or two, not of a whole decoder, are
    gathered at a time). FSDP gathers a unit in the hooks of its forward, so a unit must be a module that is called:
    from the model's children down, a container (no forward of its own: ae.py's levels and mid, a ModuleList) is
    looked into, and so is a called module larger than `largest` (an encoder, a decoder, a diffusers model inside
    its wrapper, a large down block): their forwards call their children. Modules under `smallest` (conv_in,
    norm_out, conv_out) and a large module's own direct parameters stay in the root's group."""
    total = sum(p.numel() for p in vae.parameters())
    units: list[nn.Module] = []

    def descend(module: nn.Module) -> None:
        size = sum(p.numel() for p in module.parameters())
        container = type(module).forward is nn.Module.forward  # a ModuleList, a plain nn.Module
        if container or (size > largest * total and any(True for _ in module.children())):
            for child in module.children():
                descend(child)
        elif size >= smallest * total:
            units.append(module)

    for child in vae.children():
        descend(child)
    return units


def shard(module: nn.Module, units: list[nn.Module], mesh) -> nn.Module:
    """fully_shard each unit that trains, then `module` (the root: the training forward, whose own group gets what
    no unit holds), with every frozen parameter left whole and outside the groups. In place; returns `module`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    frozen = {p for p in module.parameters() if not p.requires_grad}
    scalars = [name for name, p in module.named_parameters() if p.requires_grad and p.dim() == 0]
    if scalars:  # (LTX-Video's timestep-conditioned decoder: timestep_scale_multiplier)
        raise ConfigError(f"--sharding: {scalars[0].removeprefix('vae.')} is a trained scalar parameter, which FSDP2 "
                          "cannot shard: train this model with --sharding ddp")
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy,
                        ignored_params={p for p in unit.parameters() if p in frozen} or None)
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=frozen or None)
    return module


# ------------------------------------------------------------------------------------- state across layouts
def full_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each DTensor gathered whole on its device (every rank calls it); tensors as they are."""
    return {name: whole(t.detach()) for name, t in state.items()}


def distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` (a whole tensor every rank holds) as `like` is laid out: this rank's shard of it as a DTensor of
    like's mesh and placements (no communication), or `full` on like's device."""
    full = full.to(device=like.device, dtype=like.dtype)
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def load_model(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` (whole tensors, or DTensors laid out as the module's) into `module`, sharded or not (strict)."""
    if is_sharded(module):
        own = module.state_dict()
        state = {k: distribute_like(v, own[k]) if k in own and not is_dtensor(v) else v for k, v in state.items()}
    module.load_state_dict(state)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name (DCP's layout), its moments as the parameters are laid out."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(module, optimizer)


def load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an optimizer state of either layout: torch's (integer ids in the optimizer's parameter order, whole
    tensors: a DDP run's .pt checkpoint) or by parameter name (optimizer_state's, from a sharded checkpoint, whole
    or laid out as this run's), into this run's optimizer, sharded or not."""
    if not is_sharded(module) and all(isinstance(k, int) for k in state["state"]):
        load_optimizer_state(optimizer, state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = lambda k: order[k] if isinstance(k, int) else k  # noqa: E731
    params = dict(module.named_parameters())
    moments = {}
    for key, per_param in state["state"].items():
        name = by_name(key)
        moments[name] = {k: distribute_like(v, params[name]) if torch.is_tensor(v) and v.dim() else v
                         for k, v in per_param.items()}
    groups = [{**g, "params": [by_name(k) for k in g["params"]]} for g in state["param_groups"]]
    # not strict: a parameter that never had a gradient has no moments (as in the run that wrote them)
    set_optimizer_state_dict(module, optimizer, {"state": moments, "param_groups": groups},
                             options=StateDictOptions(strict=False))
    moments_as_parameters(optimizer)  # (a DCP checkpoint's moments are NCHW, a ddp run's VAE on a CPU is not)


def copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """In-place copies of `src` (whole tensors or DTensors of dst's layout) into `dst` (tensors or DTensors)."""
    for d, s in zip(dst, src):
        d.copy_(s if is_dtensor(s) or not is_dtensor(d) else distribute_like(s, d))


def whole_copy(template: nn.Module, vae: nn.Module, device, keep: bool = True) -> nn.Module | None:
    """A copy of `template` (the VAE's architecture, kept on the CPU) on `device` with the sharded `vae`'s weights,
    gathered one tensor at a time, so the copy is the peak (every rank calls it; `keep` False: this rank only takes
    part in the gathers and gets None)."""
    model = copy.deepcopy(template).to(device) if keep else None
    into = model.state_dict() if keep else {}
    with torch.no_grad():
        for name, tensor in vae.state_dict().items():
            gathered = whole(tensor.detach())
            if keep:
                into[name].copy_(gathered)
    return model.train(vae.training) if keep else None


def sync_buffers(vae: nn.Module) -> None:
    """The VAE's buffers (a BatchNorm's running statistics) as rank 0's, before a save or an evaluation, as DDP makes
    them at every forward: FSDP leaves each rank's own."""
    for buffer in vae.buffers():
        dist.broadcast(buffer, src=0)


class Averaged:
    """An EMA's whole state dict where an EMA object is expected (probe.InLoopProbe's model_state_dict)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.state


# ------------------------------------------------------------------------------------- DCP checkpoints
SHARDED_ENTRIES = ("vae", "ema", "optimizer")  # what of the "training" entry a sharded checkpoint writes with DCP
REST = "rest.pt"  # the rest of the checkpoint, written by rank 0 beside DCP's files


def save_dcp(state: dict, tmp: str, final: str, info: DistInfo) -> None:
    """Write `state` (the Registry's, whose training entry holds DTensors) as the directory `final`: DCP's files
    from every rank (each its own shards) and rank 0's REST with everything else, into `tmp`, renamed to `final`
    once complete (a directory rename is atomic: a kill at any point leaves `final` absent or whole)."""
    import torch.distributed.checkpoint as dcp

    from common import atomic_write
    training = state["training"]
    sharded = {k: training[k] for k in SHARDED_ENTRIES if training.get(k) is not None}
    rest = {**state, "training": {**{k: v for k, v in training.items() if k not in SHARDED_ENTRIES},
                                  "dcp": sorted(sharded)}}
    with warnings.catch_warnings():  # one process: DCP's "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save({"training": sharded}, checkpoint_id=tmp)
    missing = []
    if info.is_main:  # every rank's files in rank 0's folder: a checkpoint folder the ranks do not share has not
        from torch.distributed.checkpoint import FileSystemReader
        written = FileSystemReader(tmp).read_metadata().storage_data.values()
        missing = sorted({w.relative_path for w in written} - set(os.listdir(tmp)))
    if info.distributed:
        box = [missing]
        dist.broadcast_object_list(box, src=0, group=info.ctrl_group)
        missing = box[0]
    if missing:
        raise ConfigError(f"the sharded checkpoint {final} lacks {missing[0]}, which another rank wrote: "
                          "--output_dir must be on a file system every rank shares")
    if info.is_main:
        atomic_write(os.path.join(tmp, REST), lambda f: torch.save(rest, f))
        aside = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.deleting")
        if os.path.isdir(final):  # the same step saved again: the good copy goes only once replaced
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    if info.distributed:
        dist.barrier(group=info.ctrl_group)


def is_dcp_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, REST)) and os.path.isfile(os.path.join(path, ".metadata"))


def load_rest(path: str) -> dict:
    """A sharded checkpoint's REST: the whole checkpoint but the training entry's DCP parts, which it names
    (`training["dcp"]`) and which load_sharded or load_whole reads."""
    return torch.load(os.path.join(path, REST), map_location="cpu", weights_only=True)


def load_whole(path: str, rest: dict | None = None, weights_only: bool = False) -> dict:
    """A sharded checkpoint read whole by this process alone (export, evaluate, a DDP run's or one process's resume):
    the same layout as a .pt checkpoint, its optimizer state keyed by parameter name. No collective, under torchrun
    or not (DCP's own _load_state_dict_from_keys would make it one of the default group, which a rank reading alone,
    as evaluate.py's may, would wait on forever). `weights_only`: the VAE's weights and EMA, not AdamW's moments
    (twice the weights again), for export and evaluation."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    rest = rest if rest is not None else load_rest(path)
    loaded: dict = {}
    keys = {"training.vae", "training.ema"} if weights_only else None
    _load_state_dict(loaded, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    training = {k: v for k, v in rest["training"].items() if k != "dcp"}
    return {**rest, "training": {**training, **loaded["training"]}}


def load_sharded(path: str, template: dict) -> dict:
    """The DCP parts of a sharded checkpoint read into `template` ({name: state laid out as this run's, DTensors}),
    each rank reading only its shards of them (resharded from whatever world size wrote them). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    held = FileSystemReader(path).read_metadata().state_dict_metadata
    # AdamW has no state for a parameter that never had a gradient (a time_conv before the first clip step): the
    # template (optimizer_state initialises every parameter's) keeps only the moments the checkpoint holds
    optimizer = template.get("optimizer")
    if optimizer is not None:
        optimizer["state"] = {name: moments for name, moments in optimizer["state"].items()
                              if all(f"training.optimizer.state.{name}.{k}" in held for k in moments)}
    box = {"training": template}
    dcp.load(box, checkpoint_id=path)
    return box["training"]


STATE_BYTES = 20  # per trained parameter: fp32 weight, gradient, AdamW's two moments, EMA


def describe(sharding: str, world_size: int, trained: int, ema: bool) -> list[str]:
    """The start's line about --sharding (which, what it holds per rank, and why not another), and its notes."""
    per_param = STATE_BYTES - (0 if ema else 4)
    state = trained * per_param / 2**30
    if world_size <= 1:
        return ([f"note: --sharding {sharding} on one process shards nothing: it trains as ddp would"]
                if sharding != "ddp" else [])
    if sharding == "ddp":
        return [f"sharding: ddp, the trained state whole on each of {world_size} ranks ({state:.2f} GiB each: "
                f"weights, gradients, AdamW, EMA); --sharding fsdp would hold {state / world_size:.2f} GiB per rank"]
    over = world_size if sharding == "fsdp" else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    lines = [f"sharding: {sharding}, the trained state in {over} shards ({state / over:.2f} GiB per rank of "
             f"{state:.2f} GiB; ddp would hold all of it on each)" +
             (", replicated across nodes" if sharding == "hsdp" else "")]
    if sharding == "hsdp" and over == world_size:
        lines.append(f"note: --sharding hsdp on one node of {world_size} ranks replicates nothing: it trains as "
                     "--sharding fsdp would")
    if trained < USEFUL_PARAMS:
        lines.append(f"note: --sharding {sharding} of {trained / 1e6:.1f}M trained parameters saves under "
                     f"{USEFUL_PARAMS * STATE_BYTES / 2**30:.0f} GiB per rank and adds its all-gathers: ddp is faster")
    return lines
