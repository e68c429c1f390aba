"""The diffusability probe: how fast a small diffusion transformer learns each VAE's latent space.

    torchrun --nproc_per_node=8 probe.py --vae runs/a --vae runs/b --dataset_url 'train/{00000..00099}.tar' \\
        --test_dataset_url 'test/{00000..00009}.tar' --preset small --steps 20000 --out probe/
    python probe.py --vae runs/demo --vae vae-diffusers/ --dataset_url ... --preset tiny --steps 300 --out probe/

For each VAE (a run directory, checkpoint, or export.py folder): encode the center crops of both data sets once
(posterior means, sharded across ranks, cached under --out), normalise them per channel (statistics of the
training latents), then train a DiT-like transformer on them with rectified flow (unconditional; x_t = (1 - t) x
+ t noise, the model predicts noise - x) for --steps steps. Seed, model init, data order, noise and budget are
the same for every VAE, so the table compares the latent spaces alone. Reported per VAE: the held-out
flow-matching loss along the budget (fixed noise and t per held-out image: comparable across steps, VAEs and
world sizes) and the FID of decoded samples against the held-out images where Inception weights exist (null
with the reason where not). A stopped probe started again with the same command resumes (state under --out).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import exit_if_torch_pair_broken
if __name__ == "__main__":  # first: a torch/torchvision mismatch is one line, not an import's traceback
    exit_if_torch_pair_broken()
import data as data_lib  # noqa: E402 (after the check above; so are the imports below)
import sources
import evaluate
import latents as latents_lib
from common import ConfigError, OneLineParser, closing_distributed, guard_console, init_distributed, redact
from config import DataConfig, LatentsConfig

PRESETS = {"tiny": dict(dim=64, depth=2, heads=2), "small": dict(dim=192, depth=6, heads=3),
           "dit-s": dict(dim=384, depth=12, heads=6)}  # dit-s: DiT-S's width, depth and heads


# ============================================================================================
# The model: DiT blocks with adaLN-Zero, conditioned on the time only
# ============================================================================================
def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)  # adaLN-Zero: each block starts as the identity
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class DiT(nn.Module):
    def __init__(self, channels: int, size: int, patch: int, dim: int, depth: int, heads: int):
        super().__init__()
        self.channels, self.patch, self.grid = channels, patch, size // patch
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, self.grid ** 2, dim) * 0.02)
        self.time = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, patch * patch * channels)
        for layer in (self.final_modulation, self.out):  # the prediction starts at zero
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        b, p, g = x.shape[0], self.patch, self.grid
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        c = F.silu(self.time(timestep_embedding(t, h.shape[-1])))
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        h = self.out(self.norm(h) * (1 + scale) + shift)  # (b, g*g, p*p*C)
        return h.view(b, g, g, self.channels, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, self.channels, g * p, g * p)


def flow_matching_loss(model: nn.Module, x: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """Rectified flow: per-sample mean squared error of the predicted velocity noise - x at x_t."""
    tt = t.view(-1, 1, 1, 1)
    x_t = (1 - tt) * x + tt * noise
    return (model(x_t, t) - (noise - x)).square().mean(dim=(1, 2, 3))


@torch.no_grad()
def sample(model: nn.Module, noise: Tensor, steps: int) -> Tensor:
    """Euler from t = 1 (noise) to t = 0 (data)."""
    x = noise
    for i in range(steps, 0, -1):
        t = torch.full((x.shape[0],), i / steps, device=x.device)
        x = x - model(x, t) / steps
    return x


def generator(device, *keys: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(hash(tuple(keys)) & 0x7FFF_FFFF_FFFF_FFFF)


# ============================================================================================
# Latents: encoded once per VAE and rank, cached
# ============================================================================================
@torch.no_grad()
def encode_set(vae, url, args, rank, world, device, max_images) -> tuple[Tensor, Tensor]:
    """(latents, global image indices) of this rank's share of `url`."""
    zs, idx = [], []
    for indices, batch in data_lib.iter_eval_batches(url, args.resolution, args.batch_size, rank, world, max_images):
        zs.append(vae.encode(data_lib.to_model_input(batch, device, channels_last=False)).float().cpu())
        idx += indices
    shape = latent_shape(vae, args.resolution)
    return (torch.cat(zs) if zs else torch.zeros(0, *shape)), torch.tensor(idx, dtype=torch.long)


def latent_shape(vae, resolution: int) -> tuple[int, int, int]:
    f = vae.downsample_factor
    return vae.params.z_channels, resolution // f, resolution // f


def vae_digest(vae: nn.Module) -> str:
    """sha256 of the VAE's weights (names and bytes): what identifies it. A path, step or mtime would miss a run
    directory retrained in place or a checkpoint overwritten; hashing the weights already in memory costs well under
    a second for a FLUX-size VAE (~330 MB), small beside encoding the probe's images."""
    h = hashlib.sha256()
    for name, tensor in sorted(vae.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def cached_latents(digest, spec, vae, args, info) -> dict:
    key = {"vae_digest": digest, "dataset_url": args.dataset_url, "test_dataset_url": args.test_dataset_url,
           "resolution": args.resolution, "max_images": args.max_images, "world_size": info.world_size}
    path = os.path.join(args.out, "cache", f"vae_{digest[:16]}.rank{info.rank}.pt")
    if os.path.isfile(path):
        cached = torch.load(path, weights_only=True)
        if cached["key"] == key:
            return cached
    train, _ = encode_set(vae, args.dataset_url, args, info.rank, info.world_size, info.device, args.max_images)
    test, test_index = encode_set(vae, args.test_dataset_url, args, info.rank, info.world_size, info.device,
                                  args.max_test_images)
    stats = latents_lib.ChannelStats(train.shape[1], info.device)
    stats.update(train.to(info.device))
    stats.all_reduce()  # the normalisation of the whole training set, the same on every rank
    res = stats.result()
    mean, std = (torch.tensor(res[k]).view(-1, 1, 1) for k in ("channel_mean", "channel_std"))
    cached = {"key": key, "train": (train - mean) / std, "test": (test - mean) / std, "test_index": test_index,
              "mean": mean, "std": std}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(cached, path)
    return cached


# ============================================================================================
# Training one probe
# ============================================================================================
@torch.no_grad()
def heldout_loss(model, lat, args, device) -> float:
    """Mean flow-matching loss over every held-out latent, with noise and t fixed per image index."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, index in zip(lat["test"].split(args.batch_size), lat["test_index"].split(args.batch_size)):
        gens = [generator("cpu", args.seed, 7, int(i)) for i in index]
        noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
        t = torch.stack([torch.rand((), generator=g) for g in gens])
        total[0] += flow_matching_loss(model, x.to(device), noise.to(device), t.to(device)).double().sum()
        total[1] += len(x)
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def state_path_of(args, digest: str) -> str:
    """The resume state of one VAE's probe, named by its weights: another VAE never resumes it."""
    return os.path.join(args.out, f"probe_state_{digest[:16]}.pt")


def train_probe(digest, spec, vae, lat, args, info, log) -> dict:
    device, shape = info.device, tuple(lat["train"].shape[1:])
    state_path = state_path_of(args, digest)
    torch.manual_seed(args.seed)  # the same initial transformer for every VAE
    model = DiT(shape[0], shape[1], args.patch_size, **PRESETS[args.preset]).to(device)
    model_ddp = DDP(model) if info.world_size > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    step, curve, train_time = 0, [], 0.0
    if os.path.isfile(state_path):
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, curve, train_time = state["step"], [list(c) for c in state["curve"]], state["train_time"]
        log(f"{spec}: resumed the probe at step {step}")
    train = lat["train"].to(device)
    kill_at = {int(s) for s in os.environ.get("PROBE_KILL_AT", "").split(",") if s}  # test hook
    while step < args.steps:
        if step == 0 and not curve:
            curve.append([0, heldout_loss(model, lat, args, device)])
        t0 = time.time()
        g = generator("cpu", args.seed, step, info.rank)  # the same batch for every VAE; resumable from the step
        pick = torch.randint(len(train), (args.batch_size,), generator=g)
        noise = torch.randn(args.batch_size, *shape, generator=g)
        t = torch.rand(args.batch_size, generator=g)
        lr_scale = min(1.0, (step + 1) / max(1, args.warmup_steps))
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_scale
        loss = flow_matching_loss(model_ddp, train[pick], noise.to(device), t.to(device)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        train_time += time.time() - t0
        if step % args.eval_every == 0 or step == args.steps:
            curve.append([step, heldout_loss(model, lat, args, device)])
            log(f"{spec}: step {step}/{args.steps} held-out flow-matching loss {curve[-1][1]:.4f}")
        if step % args.save_every == 0 and step < args.steps and info.rank == 0:
            save(state_path, digest, model, opt, step, curve, train_time, settings(args, info))
        if step in kill_at:
            if dist.is_initialized():
                dist.barrier()  # the checkpoint above is on disk
            os.kill(os.getpid(), signal.SIGKILL)
    images_per_s = (args.steps * args.batch_size * info.world_size) / max(train_time, 1e-9)
    result = {"vae": spec, "latent_shape": list(shape), "heldout_loss": curve, "final_heldout_loss": curve[-1][1],
              "train_latents_per_s": images_per_s, "steps_per_s": args.steps / max(train_time, 1e-9)}
    result.update(fid_of_samples(model, vae, lat, args, info))
    if info.rank == 0:
        save(state_path, digest, model, opt, step, curve, train_time, settings(args, info), result)
    return result


def settings(args, info) -> str:
    """What a resumed probe must share with the stopped one."""
    keys = ("dataset_url", "test_dataset_url", "resolution", "max_images", "max_test_images", "preset", "patch_size",
            "steps", "batch_size", "lr", "warmup_steps", "eval_every", "seed")
    return json.dumps({**{k: getattr(args, k) for k in keys}, "world_size": info.world_size})


def save(path, digest, model, opt, step, curve, train_time, settings_json, result=None) -> None:
    tmp = f"{path}.tmp"
    torch.save({"vae_digest": digest, "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "curve": curve,
                "train_time": train_time, "settings": settings_json,
                "result": json.dumps(result) if result else None}, tmp)
    os.replace(tmp, path)


INCEPTION = {}  # (the network, why it is missing, the held-out images' feature statistics): loaded once


@torch.no_grad()
def fid_of_samples(model, vae, lat, args, info) -> dict:
    inception, missing, real = INCEPTION["net"], INCEPTION["missing"], INCEPTION.get("real")
    if inception is None:
        return {"fid": None, "fid_missing": missing}
    device, shape = info.device, tuple(lat["train"].shape[1:])
    fake = evaluate.FeatureStats(evaluate.FID_DIM, device)
    mine = list(range(info.rank, args.fid_samples, info.world_size))
    for chunk in [mine[k:k + args.batch_size] for k in range(0, len(mine), args.batch_size)]:
        noise = torch.stack([torch.randn(shape, generator=generator("cpu", args.seed, 11, i)) for i in chunk])
        z = sample(model, noise.to(device), args.sample_steps) * lat["std"].to(device) + lat["mean"].to(device)
        fake.update(inception(evaluate.to_uint8(vae.decode(z).float().clamp(-1, 1)))[0])
    fake.all_reduce()
    if real.count.item() < 2 or fake.count.item() < 2:
        return {"fid": None, "fid_missing": "FID needs at least 2 held-out images and 2 samples"}
    return {"fid": evaluate.frechet_distance(*real.mean_cov(), *fake.mean_cov()), "fid_samples": args.fid_samples}


@torch.no_grad()
def real_features(args, info):
    stats = evaluate.FeatureStats(evaluate.FID_DIM, info.device)
    for _, batch in data_lib.iter_eval_batches(args.test_dataset_url, args.resolution, args.batch_size, info.rank,
                                               info.world_size, args.max_test_images):
        stats.update(INCEPTION["net"](batch.to(info.device))[0])
    stats.all_reduce()
    return stats


# ============================================================================================
# The probe inside the training loop: one number per call, the same recipe every time
# ============================================================================================
def in_loop_probe_loss(vae: nn.Module, images: Tensor, *, heldout_images: int, steps: int = 100,
                       batch_size: int = 32, preset: str = "tiny", patch_size: int = 2, lr: float = 3e-4,
                       warmup_steps: int = 10, seed: int = 0, group=None) -> float:
    """The held-out flow-matching loss of the probe's DiT trained for `steps` on `vae`'s latents of `images`.

    `images`: the fixed probe set, float in [-1, 1], (N, 3, H, W), the same on every rank; its last
    `heldout_images` are held out. Every rank of `group` (the default group when distributed) must call it:
    the encoding, each training step's batch and the held-out loss are split across ranks and summed with one
    all_reduce each, so the number is the same under any world size (up to float summation order). The DiT's
    initialisation, the batches, noise and t come from `seed` alone, so successive calls compare the VAE with
    itself; the caller's RNG streams (torch CPU and CUDA; numpy and python's are never used) are left as they were.
    """
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    device = images.device
    n_train = len(images) - heldout_images
    if heldout_images < 1 or n_train < 1:
        raise ValueError(f"the probe set needs training and held-out images: {len(images)} images, "
                         f"{heldout_images} held out")

    def all_reduce(t: Tensor) -> Tensor:
        if distributed:
            dist.all_reduce(t, group=group)
        return t

    with torch.no_grad():  # each rank encodes a strided share; the sum of zero-padded shares is every latent, exactly
        shares = vae.encode(images[rank::world]).float()
        latents = torch.zeros(len(images), *shares.shape[1:], device=device)
        latents[rank::world] = shares
        latents = all_reduce(latents)
        mean = latents[:n_train].mean(dim=(0, 2, 3), keepdim=True)
        std = latents[:n_train].std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        latents = (latents - mean) / std
    train, heldout = latents[:n_train], latents[n_train:]
    shape = tuple(latents.shape[1:])

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # the same initial transformer at every call
        model = DiT(shape[0], shape[1], patch_size, **PRESETS[preset]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    params = list(model.parameters())
    for step in range(steps):
        g = generator("cpu", seed, step)  # the global batch, identical on every rank; each takes a strided share
        pick = torch.randint(n_train, (batch_size,), generator=g)
        noise = torch.randn(batch_size, *shape, generator=g)
        t = torch.rand(batch_size, generator=g)
        mine = slice(rank, batch_size, world)
        loss_sum = flow_matching_loss(model, train[pick[mine]], noise[mine].to(device), t[mine].to(device)).sum()
        opt.zero_grad(set_to_none=False)
        (loss_sum / batch_size).backward()
        flat = all_reduce(torch.cat([p.grad.flatten() for p in params]))  # one collective per step
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group_ in opt.param_groups:
            group_["lr"] = lr * min(1.0, (step + 1) / max(1, warmup_steps))
        opt.step()

    with torch.no_grad():  # fixed noise and t per held-out image: comparable across calls
        total = torch.zeros(2, dtype=torch.float64, device=device)
        index = torch.arange(len(heldout))[rank::world]
        if len(index):
            gens = [generator("cpu", seed, 7, int(i)) for i in index]
            noise = torch.stack([torch.randn(shape, generator=gen) for gen in gens]).to(device)
            t = torch.stack([torch.rand((), generator=gen) for gen in gens]).to(device)
            total[0] = flow_matching_loss(model, heldout[index.to(device)], noise, t).double().sum()
            total[1] = len(index)
        total = all_reduce(total)
    return (total[0] / total[1]).item()


class InLoopProbe:
    """The trainer's --probe_every_n_steps: the fixed probe set (the first --probe_images center crops of
    --test_dataset_url, else --dataset_url; the same on every rank and at every call) and in_loop_probe_loss's
    settings from the latents section (its seed the run's --seed)."""

    def __init__(self, latents: LatentsConfig, data: DataConfig, seed: int, device: torch.device):
        self.latents, self.seed = latents, seed
        url = data.test_dataset_url or data.dataset_url
        batches = [b for _, b in data_lib.iter_eval_batches(url, data.vae_resolution, latents.probe_images,
                                                             max_images=latents.probe_images)]
        images = torch.cat(batches) if batches else torch.empty(0)
        if len(images) <= latents.probe_heldout:
            raise ConfigError(f"the probe set {redact(url)} has {len(images)} images; --probe_heldout "
                              f"{latents.probe_heldout} needs more (--probe_images {latents.probe_images})")
        self.images = data_lib.to_model_input(images, device, channels_last=False)

    def __call__(self, vae: nn.Module, ema=None) -> tuple[float, float]:
        """(the held-out loss, seconds taken) of `vae`, or of its average when `ema` (the trainer's EMA) is given:
        a copy of `vae` with the averaged weights. The caller's RNG is left as it was (in_loop_probe_loss)."""
        start = time.time()
        if ema is not None:
            ema_state = ema.model_state_dict(vae)
            vae = copy.deepcopy(vae)
            vae.load_state_dict(ema_state)
        was_training = vae.training
        latents = self.latents
        try:
            loss = in_loop_probe_loss(vae.eval(), self.images, heldout_images=latents.probe_heldout,
                                      steps=latents.probe_steps, batch_size=latents.probe_batch_size, seed=self.seed)
        finally:
            vae.train(was_training)
        return loss, time.time() - start


# ============================================================================================
# The command
# ============================================================================================
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default in its help line."""


def build_parser():
    p = OneLineParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--vae", action="append", required=True, help="a VAE to probe (repeat): run dir, checkpoint, or "
                                                                 "export.py folder")
    p.add_argument("--dataset_url", required=True, help="images the probe trains on (shards or a folder)")
    p.add_argument("--test_dataset_url", required=True, help="held-out images: the loss curve and the FID")
    p.add_argument("--out", required=True, help="folder for probe.json, the latent cache and the resume state")
    p.add_argument("--resolution", type=int, default=0, help="crop size (default: the first VAE's training size)")
    p.add_argument("--max_images", type=int, default=10000, help="training images encoded")
    p.add_argument("--max_test_images", type=int, default=1000, help="held-out images")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="transformer size")
    p.add_argument("--patch_size", type=int, default=2, help="latent pixels per token side")
    p.add_argument("--steps", type=int, default=1000, help="training steps per VAE (the budget)")
    p.add_argument("--batch_size", type=int, default=32, help="latents per rank per step")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--warmup_steps", type=int, default=50, help="linear learning-rate warm-up")
    p.add_argument("--eval_every", type=int, default=100, help="held-out loss every N steps")
    p.add_argument("--save_every", type=int, default=500, help="resume state every N steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, batches, noise and samples")
    p.add_argument("--fid_samples", type=int, default=0, help="decoded samples for the FID (0: as many as held-out "
                                                              "images)")
    p.add_argument("--sample_steps", type=int, default=25, help="Euler steps per sample")
    p.add_argument("--inception_weights", default="torchvision", help="FID Inception: torchvision (torch hub's "
                                                                      "cache), PATH, random (tests), none")
    return p


def check(args) -> list:
    """Load every VAE and refuse what cannot be compared, before any process group: one line each."""
    vaes, infos = zip(*(evaluate.load_model(spec) for spec in args.vae))
    args.resolution = args.resolution or infos[0]["resolution"]
    for name in ("steps", "batch_size", "eval_every", "save_every", "max_images", "max_test_images", "patch_size",
                 "sample_steps", "resolution"):
        if not getattr(args, name) or getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(args, name)}")
    shapes = {spec: latent_shape(vae, args.resolution) for spec, vae in zip(args.vae, vaes)}
    if len(set(shapes.values())) > 1:
        raise ConfigError("latents of other shapes cannot be compared in one probe: " + ", ".join(
            f"{spec} gives {'x'.join(map(str, s))}" for spec, s in shapes.items()) + f" at {args.resolution} px")
    for spec, vae in zip(args.vae, vaes):
        if args.resolution % vae.downsample_factor:
            raise ConfigError(f"--resolution {args.resolution} is not a multiple of {spec}'s factor "
                              f"{vae.downsample_factor}")
    size = next(iter(shapes.values()))[1]
    if size % args.patch_size:
        raise ConfigError(f"--patch_size {args.patch_size} does not divide the {size}x{size} latent")
    for name in ("dataset_url", "test_dataset_url"):
        sources.probe_remote_shards(sources.list_shards(getattr(args, name)))
    if os.path.isfile(args.out):
        raise ConfigError(f"--out {args.out} is a file")
    return list(vaes)


def main(argv=None) -> int:
    guard_console()  # a lost console must not end the command (common.Console)
    is_rank0 = os.environ.get("RANK", "0") == "0"
    log = (lambda m: print(m, flush=True)) if is_rank0 else (lambda m: None)
    try:
        args = build_parser().parse_args(argv)
        vaes = check(args)
    except (ConfigError, data_lib.DatasetError) as e:
        if is_rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    info = init_distributed()
    with closing_distributed(info):  # however the command ends
        try:
            os.makedirs(args.out, exist_ok=True)
            _, INCEPTION["net"], missing = evaluate.metric_networks("none", args.inception_weights, info.device,
                                                                    info.local_rank, log=log, group=info.ctrl_group)
            INCEPTION["missing"] = missing.get("rfid")
            results = []
            for spec, vae in zip(args.vae, vaes):
                digest = vae_digest(vae)
                vae.to(info.device)
                lat = cached_latents(digest, spec, vae, args, info)
                counts = torch.tensor([len(lat["train"]), len(lat["test"])], device=info.device)
                if dist.is_initialized():
                    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
                if counts.min().item() == 0:
                    raise data_lib.DatasetError("every rank needs at least one training and one held-out image: "
                                                "more images or fewer ranks")
                if INCEPTION["net"] is not None and "real" not in INCEPTION:
                    INCEPTION["real"] = real_features(args, info)
                    args.fid_samples = args.fid_samples or int(INCEPTION["real"].count.item())
                state_path = state_path_of(args, digest)
                state = torch.load(state_path, weights_only=True) if os.path.isfile(state_path) else {}
                if state and state.get("vae_digest") != digest:
                    raise ConfigError(f"{state_path} belongs to another VAE than {spec}: use another --out")
                if state and state["settings"] != settings(args, info):
                    raise ConfigError(f"{args.out} holds a probe of other settings: use another --out, or the same "
                                      "flags")
                results.append({**json.loads(state["result"]), "vae": spec} if state.get("result")
                               else train_probe(digest, spec, vae, lat, args, info, log))
                vae.cpu()
            if info.is_main:
                table = {"vaes": results, "settings": {k: v for k, v in vars(args).items() if k != "vae"},
                         "world_size": info.world_size}
                with open(os.path.join(args.out, "probe.json"), "w") as f:
                    json.dump(table, f, indent=2)
                print(format_table(results), flush=True)
            return 0
        except (ConfigError, data_lib.DatasetError) as e:
            if info.is_main:
                print(f"error: {e}", file=sys.stderr)
            return 2


def format_table(results: list[dict]) -> str:
    steps = [s for s, _ in results[0]["heldout_loss"]]
    head = ["vae", *(f"loss@{s}" for s in steps), "FID", "latents/s"]
    rows = [[r["vae"], *(f"{v:.4f}" for _, v in r["heldout_loss"]),
             f"{r['fid']:.2f}" if r.get("fid") is not None else "null*", f"{r['train_latents_per_s']:.0f}"]
            for r in results]
    widths = [max(len(str(row[k])) for row in [head, *rows]) for k in range(len(head))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [head, *rows]]
    reasons = dict.fromkeys(r.get("fid_missing") for r in results if r.get("fid") is None)  # one note per reason
    return "\n".join(lines + [f"* FID null: {reason}" for reason in reasons])


if __name__ == "__main__":
    sys.exit(main())
