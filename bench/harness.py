"""The real trainer as the sections run it: the benchmark's model configurations and flags, vae_trainer.Trainer
built by its own flag parser around in-memory batches, the reference trainer's habits (the baseline), and timed,
interleaved and FLOP-counted steps."""
from __future__ import annotations

import contextlib
import io
import os
import time

import torch

import data as data_lib
import run_setup
import vae_trainer
from bench.machine import synchronize
from common import DistInfo


TRAIN_CONFIGS = {  # --config: the model of the train section
    "tiny": dict(vae_ch=32, vae_ch_mult="1,2,4,4", vae_num_res_blocks=1, vae_resolution=128, batch_size=2),
    "small": dict(vae_ch=64, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, vae_resolution=128, batch_size=2),
    "flux": dict(vae_ch=128, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, vae_resolution=256, batch_size=2),
}
# The memory section: the FLUX layout (its decoder's two highest-resolution levels hold the largest share of
# the activations) at batch 1; --memory_ch 128 is the real FLUX width.
MEMORY_CONFIG = dict(vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, batch_size=1)
FLUX_CONFIG = dict(vae_ch=128, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2)
# Flags every benchmark trainer gets: in-memory batches, no evaluation, no wandb, VGG16 without downloads.
# The quality section (issue 9's configuration): a small f8 VAE trained with the GAN on real photos.
QUALITY_CONFIG = dict(vae_ch=32, vae_ch_mult="1,2,4,4", vae_num_res_blocks=2, vae_z_channels=16,
                      vae_resolution=128, batch_size=4, do_ganloss=True)
TRAIN_CONFIGS["quality"] = {k: v for k, v in QUALITY_CONFIG.items() if k != "do_ganloss"}  # with --gan: its step
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root: the commands' folder
LAUNCHER = os.path.join(HERE, "bench.py")  # what a fresh process of a section runs (--_memory_case and the like)
BENCH_FLAGS = dict(num_workers=0, shuffle_buffer=2, vgg16_weights="random", wandb_mode="disabled",
                   evaluate_every_n_steps=0, inception_weights="none", num_samples=1, disc_start=0,
                   save_every_n_steps=10**9, log_every_n_steps=10**9, max_steps=10**9)


def trainer_argv(values: dict) -> list[str]:
    """vae_trainer.py's command line for these flag values."""
    argv = []
    for key, value in values.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def build_trainer(url: str, output_dir: str, run_name: str, device: torch.device, **overrides):
    """vae_trainer.Trainer from its own flag parser, with the benchmark flags, fed from memory."""
    values = {**BENCH_FLAGS, **overrides, "dataset_url": url, "output_dir": output_dir, "run_name": run_name}
    source = derived = None
    if values.get("init_from"):  # a released VAE's folder: read as the command line reads it
        setup = run_setup.prepare_run(trainer_argv(values))
        cfg, source, derived = setup.cfg, setup.source, setup.derived
    else:
        cfg = run_setup.parse_config(trainer_argv(values))
        cfg.validate()
    with contextlib.redirect_stderr(io.StringIO()):  # the random-VGG16 banner; the report states it once
        trainer = vae_trainer.Trainer(cfg, DistInfo(device=device), source, derived)
    del source
    batches = [next(trainer.loader) for _ in range(2)]
    trainer.loader.close()
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    trainer.loader = data_lib.FixedBatches(batches)
    return trainer


def add_reference_habits(trainer) -> None:
    """The reference trainer's habits, for the baseline: .item() on every scalar the step logs (each loss,
    grad norm, logit mean, latent statistic) as soon as it exists. Wraps trainer.metrics.add/max on the
    instance; set trainer.metrics.host_sync to switch it on."""
    metrics = trainer.metrics
    metrics.host_sync = False
    for name in ("add", "max"):
        original = getattr(metrics, name)

        def wrapped(_original=original, **values):
            if metrics.host_sync:
                for value in values.values():
                    if value.dim() == 0:
                        value.item()
            _original(**values)
        setattr(metrics, name, wrapped)
    if trainer.adversary is not None:
        # and, with the GAN, the critic's weight gradients in the generator's pass: the reference computes them
        # (and zeroes them after the VAE's step); train_step runs that pass under objective.critic_frozen()
        frozen = trainer.objective.critic_frozen

        def critic_frozen(_frozen=frozen):
            return contextlib.nullcontext() if metrics.host_sync else _frozen()
        trainer.objective.critic_frozen = critic_frozen


def timed_step(trainer) -> float:
    synchronize(trainer.device)
    t0 = time.perf_counter()
    trainer.train_step()
    trainer.step += 1  # as Trainer.train() does
    synchronize(trainer.device)
    return time.perf_counter() - t0


def interleave_steps(variants: dict[str, tuple], rounds: int, steps: int) -> dict[str, list[float]]:
    """variants: name -> (trainer, host_sync). Each round runs `steps` steps of every variant, in an order
    rotated each round, so a burst of load on a shared machine hits all variants alike."""
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            trainer, host_sync = variants[name]
            trainer.metrics.host_sync = host_sync
            times[name] += [timed_step(trainer) for _ in range(steps)]
    return times


def train_step_flops(trainer) -> float:
    """FLOPs of one step of the trainer as it is (host syncs off)."""
    from torch.utils.flop_counter import FlopCounterMode
    trainer.metrics.host_sync = False
    with FlopCounterMode(display=False) as counter:
        trainer.train_step()
    return float(counter.get_total_flops())
