"""Decoder-only training of a model with FLUX.2's bn statistics under torchrun (gloo), through train_state's own
pieces: VAETraining (DecoderOnly in DDP, fused AdamW, the EMA), the non-finite guard and its step. Each rank trains
on images of its own and writes what a checkpoint holds (VAETraining.state_dict, model_params, the decoder-only
config) to OUT/rank<r>.pt. Test-only (tests/test_flux2.py): the trainer's flags cannot build such a model yet.

    torchrun --nproc_per_node=2 tests/latent_bn_ddp.py OUT SOURCE.pt
SOURCE.pt: {"model_params": ..., "vae": state dict}, the model every rank starts from."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import train_state  # noqa: E402
import vae_trainer  # noqa: E402
from ae import AutoEncoder, AutoEncoderParams  # noqa: E402
from common import init_distributed  # noqa: E402
from conftest import TINY  # noqa: E402
from run_log import Metrics  # noqa: E402

STEPS = 3


def main(out: str, source_path: str) -> None:
    info = init_distributed()
    source = torch.load(source_path, weights_only=True)
    vae = AutoEncoder(AutoEncoderParams.from_dict(source["model_params"]))
    vae.load_state_dict(source["vae"])
    cfg = vae_trainer.parse_config(["--dataset_url", "x", *TINY, "--train_parts", "decoder", "--ema_decay", "0.9",
                                    "--learning_rate_vae", "1e-3"])
    training = train_state.VAETraining(vae, cfg, lambda params, lr: train_state.adamw(cfg, params, lr),
                                       lambda module: train_state.wrap_ddp(module, info), info.device)
    guard, metrics = train_state.NonFiniteGuard(info.device, cfg.grad_clip), Metrics()
    vae.train()
    generator = torch.Generator().manual_seed(100 + info.rank)  # each rank its own images, as under DDP
    for step in range(STEPS):
        x = torch.rand(2, 3, 32, 32, generator=generator) * 2 - 1
        recon, mean, logvar = training.ddp(x)
        (recon - x).square().mean().backward()
        bad = training.nonfinite(guard, metrics).float()  # the trainer's flag, as a float like its all-reduced one
        training.step(bad, step, train_state.NonFiniteGuard.step_optimizer)
    torch.save({**training.state_dict(), "model_params": vae.params.to_dict(), "step": STEPS,
                "config": {"train_parts": "decoder", "vae_resolution": 32}},
               os.path.join(out, f"rank{info.rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
