"""Run under torchrun (gloo): the VAE's training state as sharding.py lays it out on this rank, after one real step
of tests/test_sharding.py's tiny model (a random batch through the training forward, AdamW, the EMA): the bytes of
its local parameters, gradients, optimizer state and EMA, and of its frozen parameters, written as
<out>/<train_parts>/rank<R>.json. argv: out folder, --sharding value, --train_parts values (comma-separated: one
launch measures each in turn)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sharding  # noqa: E402
from ae import AutoEncoder, AutoEncoderParams  # noqa: E402
from common import DistInfo  # noqa: E402
from config import OptimConfig  # noqa: E402
from train_state import VAETraining, adamw, wrap_ddp, wrap_sharded  # noqa: E402
from functools import partial  # noqa: E402


def local_bytes(tensors) -> int:
    return sum(sharding.local(t).numel() * t.element_size() for t in tensors if t is not None)


def main(out: str, kind: str, parts: str) -> None:
    dist.init_process_group("gloo")
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size())
    for train_parts in parts.split(","):
        os.makedirs(os.path.join(out, train_parts), exist_ok=True)
        measure(os.path.join(out, train_parts), kind, train_parts, info)
    dist.destroy_process_group()


def measure(out: str, kind: str, train_parts: str, info: DistInfo) -> None:
    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2, 2), norm_groups=8,
                                        num_res_blocks=1, z_channels=4, use_attn=False))
    optim = OptimConfig(ema_decay=0.99, learning_rate_vae=1e-3)
    wrap = partial(wrap_ddp, info=info) if kind == "ddp" else partial(wrap_sharded, mesh=sharding.mesh_for(kind, info))
    training = VAETraining(vae, optim, partial(adamw, optim), wrap, torch.device("cpu"), train_parts)
    recon, *_ = training.ddp(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(info.rank)))
    recon.square().mean().backward()
    trained = [p for p in vae.parameters() if p.requires_grad]
    frozen = [p for p in vae.parameters() if not p.requires_grad]
    grads = [p.grad for p in trained]
    training.optimizer.step()
    training.ema.update(vae, 1, torch.zeros(()))
    moments = [t for s in training.optimizer.state.values() for t in s.values() if t.dim()]
    record = {"params": local_bytes(trained), "grads": local_bytes(grads), "optimizer": local_bytes(moments),
              "ema": local_bytes(training.ema.shadow), "frozen": local_bytes(frozen),
              "frozen_dtensors": sum(sharding.is_dtensor(p) for p in frozen),
              "whole_trained": sum(p.numel() * p.element_size() for p in trained)}
    with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
