"""Run under torchrun (gloo, 2 ranks): every diffusers class tests/test_families.py trains (its tiny config), sharded
by sharding.shard_units through the trainer's own wrap_sharded, takes one forward and backward of a clip (or
image) and must give every parameter the gradient the unsharded model gives on one process, to 1e-5 of the largest
(both ranks see the same input, so their average is that gradient; rank 0 alone runs the unsharded model). Prints "ok <class> <units>" per class, or "refused
<class>: <the trainer's one line>"; a class whose units FSDP cannot gather fails loudly (a DTensor met outside a
unit's forward)."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import diffusers_ae  # noqa: E402
import families  # noqa: E402
import sharding  # noqa: E402
from common import ConfigError, DistInfo  # noqa: E402
from test_families import TINY  # noqa: E402
from train_state import TrainingForward, wrap_sharded  # noqa: E402
from wan_ae import WanParams  # noqa: E402


def main() -> None:
    # FSDP2 warns of blocks that return views (in-place ops on them would skip its hooks); the gradients are compared
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    dist.init_process_group("gloo")
    mesh = sharding.mesh_for("fsdp", DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size()))
    names = sorted(TINY) + ["wan_ae.WanVideo"] if len(sys.argv) < 2 else sys.argv[1:]
    main_rank = dist.get_rank() == 0
    for class_name in names:
        torch.manual_seed(0)
        if class_name == "wan_ae.WanVideo":  # the native Wan family's video model, its explicit temporal cache
            params = WanParams(ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, video=True,
                               temporal_downsample=(True, True))
            vae = families.named("wan").build(params)
        else:
            # measured once (its meta-device probes: about half a second a class), built from it on every rank
            measured = [diffusers_ae.DiffusersParams.of(class_name, TINY[class_name]).to_dict() if main_rank else None]
            dist.broadcast_object_list(measured, src=0)
            vae = diffusers_ae.DiffusersAutoEncoder(diffusers_ae.DiffusersParams.from_dict(measured[0]))
        reference = TrainingForward(copy.deepcopy(vae)) if main_rank else None
        t = vae.temporal_factor
        size = max(32, 2 * vae.downsample_factor)  # a latent at least 2 wide: the least that every padding takes
        shape = (1, 3, 1 + t, size, size) if t else (2, 3, size, size)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        try:
            sharded = wrap_sharded(TrainingForward(vae), mesh)
        except ConfigError as e:
            if main_rank:
                print(f"refused {class_name}: {e}", flush=True)
            continue
        grads = []
        for model in (sharded, reference) if main_rank else (sharded,):
            torch.manual_seed(2)
            recon, mean, *_ = model(x)
            (recon.float().square().mean() + mean.float().square().mean()).backward()
            grads.append({n: sharding.whole(p.grad) for n, p in model.vae.named_parameters() if p.grad is not None})
        if not main_rank:
            continue
        lost = sorted(grads[1].keys() - grads[0].keys())
        scale = max(g.abs().max().item() for g in grads[1].values())
        worst = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[1] if n in grads[0])
        verdict = "ok" if not lost and grads[0].keys() == grads[1].keys() and worst <= 1e-5 * scale else "wrong"
        print(f"{verdict} {class_name} {len(vae.shard_units())} lost={len(lost)} worst={worst / scale:.1e} {lost[:2]}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
