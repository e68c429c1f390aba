"""Evaluate a trained autoencoder: PSNR, SSIM, LPIPS and rFID on a held-out set, the latent
scale/shift factors, and reconstructions of any images.

    python evaluate.py --ckpt runs/vae --dataset_url 'test/{00000..00009}.tar' --max_images 5000 --out eval/
    torchrun --nproc_per_node=8 evaluate.py --ckpt runs/vae --dataset_url 'test/{00000..00009}.tar'
    python evaluate.py --ckpt runs/vae --dataset_url 'train/{00000..00099}.tar' --latent_stats --max_images 10000
    python evaluate.py --ckpt runs/vae --images photos/ --reconstruct_to recon/ --tile_size 1024

Metrics: deterministic center crops (data.iter_eval_batches), the posterior mean (no noise), images in
[0, 1]; PSNR and SSIM per image, then averaged; LPIPS (VGG); rFID between the Inception-v3 pool
features of inputs and reconstructions (the standard FID network, via torch-fidelity). Under torchrun
image i belongs to rank i % world and the ranks all-reduce float64 sums, so every image counts once.
One JSON object goes to stdout. `evaluate_model` and `latent_stats` are what the trainer and export.py call.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from functools import partial
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import exit_if_torch_pair_broken
if __name__ == "__main__":  # first: a torch/torchvision mismatch is one line, not an import's traceback
    exit_if_torch_pair_broken()
import torchvision  # noqa: E402 (after the check above; so are the imports below)
from torch import Tensor, nn

import data as data_lib
import latents as latents_lib
import sources
from ae import AutoEncoder, patchify_latents
from clips import frames_of
from checkpoint import best_checkpoint, load_model  # noqa: F401  (evaluate.load_model: this command's and probe.py's)
from common import (ConfigError, DistInfo, OneLineParser, all_reduce_sum, closing_distributed, first_line,
                    guard_console, init_distributed)
from config import DataConfig, EvalConfig, Precision, eval_size_problem, eval_sizes, parse_sizes
from critics import build_lpips
from weights import (WeightsUnavailable, ensure_vgg16_weights, ensure_weights, fetch_weights, hub_cache_path,
                     load_vgg16_features, warn_random_vgg, warn_random_weights)

FID_DIM = 2048  # Inception-v3 pool3 features
GRID_IMAGES = 8


# ============================================================================================
# Metric math: small functions on tensors, called by the tests directly
# ============================================================================================
def psnr_per_image(recon: Tensor, target: Tensor) -> Tensor:
    """PSNR in dB of images in [0, 1], one value per image (float64). A perfect reconstruction is
    capped at 100 dB (MSE floor 1e-10) so that an average stays finite."""
    mse = (recon.double() - target.double()).square().flatten(1).mean(1)
    return 10.0 * torch.log10(1.0 / mse.clamp_min(1e-10))


def temporal_psnr_per_clip(recon: Tensor, target: Tensor) -> Tensor:
    """PSNR in dB of the reconstruction's frame differences against the input's, for clips (B, C, T, H, W) in
    [0, 1], one value per clip (float64): 10 log10(1 / mean(((r[t+1] - r[t]) - (x[t+1] - x[t]))^2)). It sees what a
    per-frame PSNR does not: an error that changes from frame to frame (flicker), while one that stays put (a
    constant colour shift) costs nothing; it is the frame-difference error of the video-compression literature
    (the "temporal" term of TCVAE-style and VSR evaluations). Capped at 100 dB as psnr_per_image."""
    recon, target = recon.double(), target.double()
    diff = (recon[:, :, 1:] - recon[:, :, :-1]) - (target[:, :, 1:] - target[:, :, :-1])
    return 10.0 * torch.log10(1.0 / diff.square().flatten(1).mean(1).clamp_min(1e-10))


def tlp_per_clip(recon: Tensor, target: Tensor, lpips_model: nn.Module) -> Tensor:
    """tLP (Chu et al. 2020, "Learning temporal coherence via self-supervision for GAN-based video generation",
    TecoGAN): the mean over t of |LPIPS(x[t], x[t-1]) - LPIPS(r[t], r[t-1])| for clips (B, C, T, H, W) in [-1, 1],
    one value per clip (float64; the paper reports it x100). Lower is better: the reconstruction changes from frame
    to frame as perceptibly as the input does."""
    b, t = target.shape[0], target.shape[2]
    moved = [lpips_model(frames_of(v[:, :, 1:]).contiguous(), frames_of(v[:, :, :-1]).contiguous()).double()
             for v in (target, recon)]
    return (moved[0] - moved[1]).abs().reshape(b, t - 1).mean(1)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> Tensor:
    g = torch.exp(-0.5 * ((torch.arange(size, dtype=torch.float64) - (size - 1) / 2) / sigma) ** 2)
    return g / g.sum()


def ssim_per_image(recon: Tensor, target: Tensor, data_range: float = 1.0) -> Tensor:
    """SSIM (Wang et al. 2004) of images in [0, 1], one value per image (float64): 11x11 Gaussian window,
    sigma 1.5, K1 0.01, K2 0.03, population statistics, averaged over channels and over the windows that
    lie inside the image (as the reference MATLAB code and skimage; torchmetrics 1.9 also averages the
    reflect-padded border windows, which moves the value by ~1e-3)."""
    x, y = recon.double(), target.double()
    channels = x.shape[1]
    g = _gaussian_window().to(x.device)
    window_h, window_w = g.view(1, 1, -1, 1).repeat(channels, 1, 1, 1), g.view(1, 1, 1, -1).repeat(channels, 1, 1, 1)

    def blur(t: Tensor) -> Tensor:  # separable, 'valid' windows only
        return F.conv2d(F.conv2d(t, window_h, groups=channels), window_w, groups=channels)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x.square()
    var_y = blur(y * y) - mu_y.square()
    cov_xy = blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    luminance = (2 * mu_x * mu_y + c1) / (mu_x.square() + mu_y.square() + c1)
    contrast_structure = (2 * cov_xy + c2) / (var_x + var_y + c2)
    ssim_map = luminance * contrast_structure
    return ssim_map.flatten(1).mean(1)



class FeatureStats:
    """Sufficient statistics of a feature distribution, in float64: count, sum and sum of outer products.
    Sums add up over batches and over ranks (all_reduce), so mean and covariance do not depend on how
    the images were split."""

    def __init__(self, dim: int = FID_DIM, device: torch.device | str = "cpu"):
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.sum = torch.zeros(dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    def update(self, features: Tensor) -> None:
        f = features.double()
        self.count += f.shape[0]
        self.sum += f.sum(0)
        self.outer += f.T @ f

    def all_reduce(self) -> None:
        all_reduce_sum(self.count, self.sum, self.outer)

    def mean_cov(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and unbiased covariance (as numpy.cov), float64."""
        n = self.count.item()
        mean = self.sum / n
        cov = (self.outer - n * torch.outer(mean, mean)) / (n - 1)
        return mean.cpu().numpy(), cov.cpu().numpy()


def _drop_rounding_noise(eigenvalues: np.ndarray) -> np.ndarray:
    """Zero the eigenvalues of a PSD matrix that are below its float64 rounding level. With fewer images
    than feature dimensions most eigenvalues are exactly 0 in theory and +-1e-16 * max in practice; their
    square roots (1e-8 * sqrt(max) each, times ~2000) would otherwise add noise to the trace."""
    cutoff = eigenvalues.max(initial=0.0) * len(eigenvalues) * np.finfo(np.float64).eps
    return np.where(eigenvalues > cutoff, eigenvalues, 0.0)


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + tr(C1 + C2 - 2 (C1 C2)^(1/2)), in float64.

    tr (C1 C2)^(1/2) is computed as tr (S C2 S)^(1/2) with S = C1^(1/2) (both products have the same
    eigenvalues): S C2 S is symmetric positive semi-definite, so `eigvalsh` gives real eigenvalues and
    there is no complex sqrtm whose tiny imaginary parts would have to be discarded. Eigenvalues at the
    rounding level (rank-deficient covariances of few images) count as zero.
    """
    mu1, mu2, cov1, cov2 = (np.asarray(a, dtype=np.float64) for a in (mu1, mu2, cov1, cov2))
    w, v = np.linalg.eigh(cov1)
    sqrt_cov1 = (v * np.sqrt(_drop_rounding_noise(w))) @ v.T
    middle = sqrt_cov1 @ cov2 @ sqrt_cov1
    tr_covmean = np.sqrt(_drop_rounding_noise(np.linalg.eigvalsh((middle + middle.T) / 2))).sum()
    diff = mu1 - mu2
    return float(max(0.0, diff @ diff + np.trace(cov1) + np.trace(cov2) - 2.0 * tr_covmean))


def to_uint8(images: Tensor) -> Tensor:
    """[-1, 1] floats -> uint8 (the inverse of data.to_model_input)."""
    return ((images.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)


# ============================================================================================
# Metric networks: LPIPS (VGG16) and the FID Inception-v3
# ============================================================================================
def inception_url() -> str:
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3
    return URL_INCEPTION_V3


def inception_cache_path() -> str:
    return hub_cache_path(inception_url())


def ensure_inception_weights(spec: str, download: bool = True) -> str | None:
    """`--inception_weights`: the FID network's weights from torch hub's cache (where torch-fidelity keeps
    them), a local file, or random (tests)."""
    return ensure_weights(spec, flag="--inception_weights", url=inception_url(), what="FID Inception",
                          download=download)


def _random_inception_state_dict() -> dict[str, Tensor]:
    """A fixed random init of the FID network (torchvision's Inception-v3 has the same parameter names;
    the TF port's classifier has 1008 outputs). He-normal convs keep the features O(1)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False)
        net.fc = nn.Linear(2048, 1008)
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return net.state_dict()


def load_inception(path: str | None) -> nn.Module:
    """torch-fidelity's FID Inception-v3 ("pt_inception-2015-12-05", the TF weights of pytorch-fid and
    torchmetrics) returning 2048-d pool features: `inception(uint8 NCHW)[0]`, any input size (it resizes
    to 299 as TF did). `path` None: random init, for tests only (warned about)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            path = os.path.join(tmp, "random_inception.pth")
            torch.save(_random_inception_state_dict(), path)
        else:  # torch-fidelity loads with weights_only=False; refuse anything that is not plain tensors first
            try:
                torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                raise WeightsUnavailable(f"{path}: not a loadable Inception state dict ({type(e).__name__})") from None
        try:
            return FeatureExtractorInceptionV3("inception-v3-compat", [str(FID_DIM)],
                                               feature_extractor_weights_path=path)
        except RuntimeError as e:  # load_state_dict: missing/unexpected keys
            raise WeightsUnavailable(f"{path}: not the FID Inception-v3 ({first_line(e)})") from None


def metric_networks(vgg16_spec: str, inception_spec: str, device: torch.device, local_rank: int = 0,
                    log=print, group=None) -> tuple[nn.Module | None, nn.Module | None, dict]:
    """(lpips_model, inception, missing) for the CLI and the trainer. A spec of `none` skips the metric;
    weights that cannot be had are reported in `missing` (metric -> reason), never replaced by random ones.
    Local rank 0 downloads first; the other ranks then only look in the cache (barriers over `group`)."""
    def resolve(ensure, spec):
        try:
            return fetch_weights(ensure, spec, local_rank, group), None
        except WeightsUnavailable as e:
            if spec not in ("torchvision", "random"):
                raise  # the user named a file: that is an error, not a missing metric
            return None, str(e)

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    missing = {}

    def load(metric, flag, spec, ensure, warn, build):
        if spec == "none":
            missing[metric] = f"disabled (--{flag} none)"
            return None
        path, reason = resolve(ensure, spec)
        if reason:
            missing[metric] = reason
            return None
        if path is None and is_main:
            warn()
        return build(path).to(device)  # a random network is seeded where it is built: the same on every rank

    lpips_model = load("lpips", "vgg16_weights", vgg16_spec, ensure_vgg16_weights, lambda: warn_random_vgg("LPIPS"),
                       lambda path: build_lpips(load_vgg16_features(path)))
    inception = load("rfid", "inception_weights", inception_spec, ensure_inception_weights,
                     lambda: warn_random_weights("Inception-v3 (--inception_weights random)", "rFID",
                                                 "Its value is meaningless; use this for tests only."), load_inception)
    for metric, reason in missing.items():
        if not reason.startswith("disabled"):
            log(f"warning: {dict(lpips='LPIPS', rfid='rFID')[metric]} will not be computed: {reason}")
    return lpips_model, inception, missing


# ============================================================================================
# Evaluation: one pass over the held-out set
# ============================================================================================
@torch.no_grad()
def evaluate_model(vae: AutoEncoder, url: str, resolution: int, *, batch_size: int, device: torch.device,
                   rank: int = 0, world_size: int = 1, max_images: int | None = None,
                   lpips_model: nn.Module | None = None, inception: nn.Module | None = None,
                   autocast: Callable | None = None, channels_last: bool = False, grid_images: int = GRID_IMAGES,
                   max_pixels: int = 100_000_000, log: Callable | None = None,
                   latent_diagnostics: bool = False, tile_size: int = 0, tile_overlap: int = 0,
                   frames: int = 0, frame_stride: int = 1) -> dict:
    """PSNR, SSIM, LPIPS and rFID of `vae` on the center crops of `url`, in one pass.

    Every rank must call this (it all-reduces on the default process group, on `device`). The result,
    the same on every rank, holds `psnr`, `ssim`, `lpips`, `rfid` (None, with `<name>_missing`, when its
    network is not given or there are fewer than 2 images), `n_images`, and `grid`: uint8 (3, H, W), this
    rank's first inputs (top row) over their reconstructions. `autocast` is a context-manager factory for the VAE only (e.g. the trainer's
    `self.autocast`); every metric is computed in fp32/fp64. Reconstructions are clamped to [-1, 1];
    PSNR/SSIM/LPIPS use them unquantised, the Inception sees them as uint8 like the inputs.
    `latent_diagnostics` adds latents.LatentDiagnostics' keys (`latent_*`, `image_*`) from the same pass.
    `tile_size` > 0 and below `resolution`: encode and decode in tiles of that many pixels overlapping by
    `tile_overlap` (tiled_encode / tiled_decode, as `reconstruct`), for crops too large to pass whole.
    `frames` > 0: the test set's videos as clips of their first `frames` frames (a video VAE's evaluation): the
    metrics above are per frame (n_images counts frames, the grid shows the first clip's), and `temporal_psnr` and
    `tlp` (temporal_psnr_per_clip, tlp_per_clip) are averaged over the clips, `n_clips` of them.
    """
    autocast = autocast or contextlib.nullcontext
    # psnr, ssim, lpips, images; over clips: temporal psnr, tLP, clips
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    real_stats = FeatureStats(FID_DIM, device) if inception is not None else None
    recon_stats = FeatureStats(FID_DIM, device) if inception is not None else None
    grid_inputs, grid_recons = [], []
    diagnostics = latents_lib.LatentDiagnostics() if latent_diagnostics else None
    was_training = vae.training
    vae.eval()
    for n_batches, (_, batch) in enumerate(data_lib.iter_eval_batches(
            url, resolution, batch_size, rank, world_size, max_images, max_pixels, frames=frames,
            frame_stride=frame_stride), start=1):
        x = data_lib.to_model_input(batch, device, channels_last)
        with autocast():
            if 0 < tile_size < resolution:
                z = tiled_encode(vae, x, tile_size, tile_overlap)
                recon = tiled_decode(vae, z, tile_size, tile_overlap)
            else:
                z = vae.encode(x)
                recon = vae.decode(z)
        recon = recon.float().clamp(-1.0, 1.0)
        x = x.float()
        if x.dim() == 5:  # clips: the temporal measures, then every frame as an image
            if x.shape[2] > 1:
                sums[4] += temporal_psnr_per_clip(recon * 0.5 + 0.5, x * 0.5 + 0.5).sum()
                if lpips_model is not None:
                    sums[5] += tlp_per_clip(recon, x, lpips_model).sum()
                sums[6] += x.shape[0]
            x, recon, z, batch = frames_of(x), frames_of(recon), frames_of(z), frames_of(batch)
        if diagnostics is not None:
            diagnostics.update(z.float(), x.float())
        target01, recon01 = x * 0.5 + 0.5, recon * 0.5 + 0.5
        sums[0] += psnr_per_image(recon01, target01).sum()
        sums[1] += ssim_per_image(recon01, target01).sum()
        if lpips_model is not None:
            sums[2] += lpips_model(recon, x).double().sum()
        sums[3] += x.shape[0]
        if inception is not None:
            real_stats.update(inception(batch.to(device))[0])
            recon_stats.update(inception(to_uint8(recon))[0])
        if sum(len(g) for g in grid_inputs) < grid_images:
            grid_inputs.append(x[:grid_images].cpu())
            grid_recons.append(recon[:grid_images].cpu())
        if log is not None and n_batches % 20 == 0:
            log(f"evaluated ~{int(sums[3].item()) * world_size} images")
    vae.train(was_training)

    all_reduce_sum(sums)
    if inception is not None:
        real_stats.all_reduce()
        recon_stats.all_reduce()
    n = int(sums[3].item())
    mean = (sums[:3] / max(n, 1)).tolist()
    out = {"psnr": mean[0] if n else None, "ssim": mean[1] if n else None,
           "lpips": mean[2] if n and lpips_model is not None else None, "rfid": None, "n_images": n}
    if lpips_model is None:
        out["lpips_missing"] = "no LPIPS network"
    if inception is None:
        out["rfid_missing"] = "no Inception network"
    elif n < 2:
        out["rfid_missing"] = f"FID needs at least 2 images, got {n}"
    else:
        out["rfid"] = frechet_distance(*real_stats.mean_cov(), *recon_stats.mean_cov())
    if frames:
        clips = int(sums[6].item())
        out.update(temporal_psnr=(sums[4] / clips).item() if clips else None,
                   tlp=(sums[5] / clips).item() if clips and lpips_model is not None else None, n_clips=clips)
        if not clips:
            out["temporal_missing"] = "no clip of 2 frames or more"
    if diagnostics is not None:
        if diagnostics.channels is None:  # this rank had no image: still take part in the all-reduces
            diagnostics.update(*_empty_latent_batch(vae, resolution, device))
        out.update(diagnostics.result())
    grid = torch.zeros(3, 2, 2, dtype=torch.uint8)
    if grid_inputs:
        inputs, recons = torch.cat(grid_inputs)[:grid_images], torch.cat(grid_recons)[:grid_images]
        grid = to_uint8(torchvision.utils.make_grid(torch.cat([inputs, recons]), nrow=len(inputs), padding=2,
                                                    pad_value=-1.0))
    out["grid"] = grid
    return out


def size_suffix(size: int, primary: int) -> str:
    """The key suffix of an evaluation at `size` when `primary` is the size whose keys go un-suffixed:
    '' or '@512' (eval/psnr@512, psnr@512)."""
    return "" if size == primary else f"@{size}"


def eval_batch_size(batch_size: int, size: int, primary: int) -> int:
    """Images per evaluation batch at `size`: above the primary size, fewer, so that a batch holds about the
    pixels of a primary-size batch (at least one image); at or below it, `batch_size`."""
    return batch_size if size <= primary else max(1, batch_size * primary * primary // (size * size))


class Validator:
    """Evaluation during training (torchtitan's validator): PSNR, SSIM, LPIPS and rFID on the fixed test subset,
    for the weights and (given) their EMA, with the FID network loaded once. Every rank takes part (the images are
    sharded); what it returns is shown by run_log.Reporter.evaluation. From the evaluation section and the data's
    (the test set, its crop size, the batch). Each size of --eval_resolutions other than the training size is
    evaluated too, its keys suffixed `@SIZE` (size_suffix); latent diagnostics and grids are the training size's."""

    def __init__(self, ev: EvalConfig, data: DataConfig, lpips_model: nn.Module | None, device: torch.device,
                 info: DistInfo, memory_format=torch.contiguous_format, log=print, channels_last: bool = True,
                 grid_images: int = 8):
        self.ev, self.data, self.lpips, self.device, self.memory_format = ev, data, lpips_model, device, memory_format
        self.rank, self.world_size = info.rank, info.world_size
        self.channels_last, self.grid_images = channels_last, grid_images
        # the FID network, or None (rFID then reported missing, never faked)
        _, self.inception, missing = metric_networks("none", ev.inception_weights, device, info.local_rank, log=log,
                                                     group=info.ctrl_group)
        # what it cannot compute on this run, {metric: why} (checkpoint.BestCheckpoint refuses those)
        self.missing = {"rfid": missing["rfid"]} if "rfid" in missing else {}
        if lpips_model is None:
            self.missing["lpips"] = "no VGG16 weights for LPIPS (see the note above)"
        self.ema_model: AutoEncoder | None = None  # holds the EMA weights, built at the first evaluation
        self.sizes = eval_sizes(ev, data.vae_resolution)  # the training size first

    def run(self, vae: AutoEncoder, ema_state: dict[str, Tensor] | None, autocast) -> tuple[dict, dict]:
        """({eval/<metric>, eval_ema/<metric>: value}, {eval, eval_ema: uint8 grid of inputs over reconstructions})."""
        data, results, grids = self.data, {}, {}
        models = [("eval", vae)]
        if ema_state is not None:
            if self.ema_model is None:
                self.ema_model = type(vae)(vae.params).to(self.device, memory_format=self.memory_format)
            self.ema_model.load_state_dict(ema_state)
            models.append(("eval_ema", self.ema_model))
        for prefix, model in models:
            for size in self.sizes:
                training_size = size == data.vae_resolution
                res = evaluate_model(
                    model, data.test_dataset_url, size, device=self.device, rank=self.rank,
                    batch_size=eval_batch_size(data.batch_size, size, data.vae_resolution),
                    world_size=self.world_size, max_images=self.ev.eval_max_images, lpips_model=self.lpips,
                    inception=self.inception, autocast=autocast, channels_last=self.channels_last,
                    grid_images=self.grid_images, max_pixels=data.max_image_pixels,
                    latent_diagnostics=training_size, tile_size=self.ev.eval_tile_size,
                    tile_overlap=self.ev.eval_tile_overlap, frames=data.video_frames,
                    frame_stride=data.video_frame_stride)
                grid = res.pop("grid")
                if training_size:
                    grids[prefix] = grid
                suffix = size_suffix(size, data.vae_resolution)
                results.update({f"{prefix}/{k}{suffix}": v for k, v in res.items() if not k.endswith("_missing")})
        return results, grids


def _empty_latent_batch(vae: AutoEncoder, resolution: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Zero-image latent and image batches of the right shapes: adds nothing to any sum."""
    f, c = vae.downsample_factor, vae.params.z_channels
    return (torch.zeros(0, c, resolution // f, resolution // f, device=device),
            torch.zeros(0, 3, resolution, resolution, device=device))


@torch.no_grad()
def latent_stats(vae: AutoEncoder, url: str, resolution: int, *, batch_size: int, device: torch.device,
                 rank: int = 0, world_size: int = 1, max_images: int | None = None,
                 autocast: Callable | None = None, max_pixels: int = 100_000_000, frames: int = 0,
                 frame_stride: int = 1) -> dict:
    """Mean and std of the latents (posterior means of center crops), global and per channel, from
    float64 sums all-reduced across ranks. FLUX convention: z' = (z - shift_factor) * scaling_factor,
    with shift_factor = mean and scaling_factor = 1 / std, so z' has zero mean and unit variance.
    These are statistics of the posterior mean; a diffusion model trained on sampled latents sees a
    variance larger by the posterior variance. `frames` > 0: over clips of the videos' first `frames` frames, every
    latent frame counted (n_images counts them)."""
    autocast = autocast or contextlib.nullcontext
    stats = latents_lib.ChannelStats(vae.params.z_channels, device)
    images = torch.zeros((), dtype=torch.float64, device=device)
    for _, batch in data_lib.iter_eval_batches(url, resolution, batch_size, rank, world_size, max_images, max_pixels,
                                               frames=frames, frame_stride=frame_stride):
        with autocast():
            z = vae.encode(data_lib.to_model_input(batch, device, channels_last=False))
        z = frames_of(z) if z.dim() == 5 else z
        stats.update(z)
        images += z.shape[0]
    stats.all_reduce()
    all_reduce_sum(images)
    if images.item() == 0:
        raise data_lib.DatasetError(f"{url}: no readable image for the latent statistics")
    res = stats.result()
    return {"shift_factor": res["latent_mean"], "scaling_factor": 1.0 / res["latent_std"], **res,
            "n_images": int(images.item())}


@torch.no_grad()
def latent_bn_stats(vae: AutoEncoder, url: str, resolution: int, *, batch_size: int, device: torch.device,
                    rank: int = 0, world_size: int = 1, max_images: int | None = None,
                    autocast: Callable | None = None, max_pixels: int = 100_000_000) -> dict:
    """FLUX.2's bn statistics re-estimated for this encoder (after a run that trained it): the mean and variance,
    per channel of the 2x2-patchified latent (ae.patchify_latents, the layout of FLUX.2's pipeline), of the
    posterior means (the pipeline encodes with the posterior's mode) of center crops, from float64 sums all-reduced
    across ranks. They are the population statistics that BatchNorm's running averages estimate, without their
    dependence on batch order and momentum; the variance is the population one (BatchNorm averages unbiased batch
    variances: a factor 1 + 1/(elements per batch) apart). Apply with vae.set_latent_bn(mean, var)."""
    if resolution % (2 * vae.downsample_factor):
        raise ValueError(f"resolution {resolution} must be a multiple of {2 * vae.downsample_factor}: the latent "
                         "is cut into 2x2 patches")
    autocast = autocast or contextlib.nullcontext
    stats = latents_lib.ChannelStats(4 * vae.params.z_channels, device)
    images = torch.zeros((), dtype=torch.float64, device=device)
    for _, batch in data_lib.iter_eval_batches(url, resolution, batch_size, rank, world_size, max_images, max_pixels):
        with autocast():
            z = vae.encode(data_lib.to_model_input(batch, device, channels_last=False))
        stats.update(patchify_latents(z.float()))
        images += z.shape[0]
    stats.all_reduce()
    all_reduce_sum(images)
    if images.item() == 0:
        raise data_lib.DatasetError(f"{url}: no readable image for the latent bn statistics")
    count, total, total_sq = stats.sums
    mean = total / count
    var = (total_sq / count - mean.square()).clamp_min(0)
    return {"running_mean": mean.tolist(), "running_var": var.tolist(), "n_images": int(images.item())}


# ============================================================================================
# Reconstructing images of any size: padding and tiling
# ============================================================================================
def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Evenly spaced tile starts covering [0, size), neighbours overlapping by at least `overlap`."""
    if size <= tile:
        return [0]
    n = math.ceil((size - tile) / (tile - overlap)) + 1
    return [round(i * (size - tile) / (n - 1)) for i in range(n)]


def _ramp(length: int, before: int, after: int) -> Tensor:
    """Blend weights along one axis of a tile: rising over the `before` pixels shared with the previous
    tile, falling over the `after` pixels shared with the next; the two ramps of an overlap sum to 1."""
    w = torch.ones(length)
    if before > 0:
        w[:before] = (torch.arange(before) + 0.5) / before
    if after > 0:  # (a tile overlapping both neighbours by more than half keeps the lower weight)
        w[length - after:] = torch.minimum(w[length - after:], ((torch.arange(after) + 0.5) / after).flip(0))
    return w


def tiled_apply(fn: Callable[[Tensor], Tensor], x: Tensor, grid_hw: tuple[int, int], tile: int, overlap: int,
                in_scale: int, out_scale: int) -> Tensor:
    """Apply `fn` to overlapping tiles of `x` and blend the outputs linearly across the overlaps
    (as diffusers' tiled VAE), so that only one tile's activations are alive at a time.

    Tiles are laid out on the latent grid: `grid_hw`, `tile` and `overlap` count latent pixels; one latent
    pixel is `in_scale` pixels of `x` and `out_scale` pixels of the output (decode: 1 and f; encode: f and 1).
    Each tile is normalised on its own (GroupNorm, attention), so the result differs from a single pass.
    """
    h, w = grid_hw
    th, tw = min(tile, h), min(tile, w)
    ys, xs = tile_starts(h, tile, overlap), tile_starts(w, tile, overlap)
    out = weight_sum = None
    for iy, y in enumerate(ys):
        for ix, x0 in enumerate(xs):
            piece = fn(x[..., y * in_scale:(y + th) * in_scale, x0 * in_scale:(x0 + tw) * in_scale]).float()
            if out is None:
                out = piece.new_zeros(*piece.shape[:2], h * out_scale, w * out_scale)
                weight_sum = piece.new_zeros(h * out_scale, w * out_scale)
            up = (ys[iy - 1] + th - y) if iy > 0 else 0  # overlaps with the neighbours, in latent pixels
            down = (y + th - ys[iy + 1]) if iy + 1 < len(ys) else 0
            left = (xs[ix - 1] + tw - x0) if ix > 0 else 0
            right = (x0 + tw - xs[ix + 1]) if ix + 1 < len(xs) else 0
            weight = torch.outer(_ramp(th * out_scale, up * out_scale, down * out_scale),
                                 _ramp(tw * out_scale, left * out_scale, right * out_scale)).to(piece.device)
            rows, cols = slice(y * out_scale, (y + th) * out_scale), slice(x0 * out_scale, (x0 + tw) * out_scale)
            out[..., rows, cols] += piece * weight
            weight_sum[rows, cols] += weight
    return out / weight_sum


def tiled_encode(vae: AutoEncoder, x: Tensor, tile_size: int, tile_overlap: int) -> Tensor:
    """Posterior mean of x (sides multiples of the downsample factor), in pixel tiles of `tile_size`."""
    f = vae.downsample_factor
    return tiled_apply(vae.encode, x, (x.shape[-2] // f, x.shape[-1] // f), tile_size // f, tile_overlap // f, f, 1)


def tiled_decode(vae: AutoEncoder, z: Tensor, tile_size: int, tile_overlap: int) -> Tensor:
    """Decode z in latent tiles of tile_size / f (pixel sizes, as the encoder's)."""
    f = vae.downsample_factor
    return tiled_apply(vae.decode, z, tuple(z.shape[-2:]), tile_size // f, tile_overlap // f, 1, f)


@torch.no_grad()
def reconstruct(vae: AutoEncoder, image: np.ndarray, device: torch.device, tile_size: int = 0,
                tile_overlap: int = 0, autocast: Callable | None = None) -> np.ndarray:
    """uint8 (H, W, 3) of any size -> its reconstruction, uint8 (H, W, 3). The image is reflect-padded to
    a multiple of the downsample factor and cropped back. `tile_size` > 0: encode and decode in tiles
    of that many pixels (a no-op for images that fit in one tile)."""
    autocast = autocast or contextlib.nullcontext
    f = vae.downsample_factor
    h, w = image.shape[:2]
    x = data_lib.to_model_input(torch.from_numpy(np.array(image)).permute(2, 0, 1)[None], device,
                                channels_last=False)
    pad_h, pad_w = -h % f, -w % f
    mode = "reflect" if pad_h < h and pad_w < w else "replicate"  # reflect needs a pad smaller than the side
    x = F.pad(x, (0, pad_w, 0, pad_h), mode=mode)
    with autocast():
        if tile_size > 0:
            recon = tiled_decode(vae, tiled_encode(vae, x, tile_size, tile_overlap), tile_size, tile_overlap)
        else:
            recon = vae.decode(vae.encode(x))
    return to_uint8(recon[0, :, :h, :w].clamp(-1, 1)).permute(1, 2, 0).cpu().numpy()


def load_rgb_file(path: str, max_pixels: int = 100_000_000) -> np.ndarray:
    """An image file as uint8 (H, W, 3), with data.py's conversions (EXIF rotation, alpha over white, 16 bit)."""
    with open(path, "rb") as f:
        return data_lib.load_rgb(f.read(), max_pixels)


def reconstruct_folder(vae: AutoEncoder, src: str, dst: str, device: torch.device, tile_size: int,
                       tile_overlap: int, rank: int = 0, world_size: int = 1, autocast=None, log=print) -> int:
    """Reconstruct every image under `src` into `dst` as PNG: the same relative path and full file name with
    `.png` appended (`a.jpg` -> `a.jpg.png`, `a.png` -> `a.png.png`), so names never collide and each one
    says which file it came from. Files are split across ranks. Returns this rank's count."""
    from PIL import Image
    files = sources.image_files(src)
    done = 0
    for path in files[rank::world_size]:
        try:
            image = load_rgb_file(path)
        except (data_lib.SkipSample, OSError, ValueError) as e:
            log(f"warning: skipped {path} ({getattr(e, 'reason', type(e).__name__)})")
            continue
        out = reconstruct(vae, image, device, tile_size, tile_overlap, autocast)
        target = os.path.join(dst, os.path.relpath(path, src) + ".png")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        Image.fromarray(out).save(target)
        done += 1
    return done


# ============================================================================================
# The command
# ============================================================================================
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="run directory (its latest readable checkpoint), checkpoint "
                                                 "file, an export.py folder (--format diffusers or safetensors), or a "
                                                 "single file (--format single_file's ae.safetensors; with "
                                                 "--resolution)")
    p.add_argument("--dataset_url", default="", help="held-out shards or image folder (metrics, --latent_stats)")
    p.add_argument("--resolution", default="", help="crop size, or comma-separated sizes (256,512,1024): the first's "
                                                    "metrics are psnr, ssim, ...; each other's psnr@SIZE, ssim@SIZE, "
                                                    "... (default: the checkpoint's vae_resolution)")
    p.add_argument("--max_images", type=int, default=0, help="use the first N images (default: all)")
    p.add_argument("--batch_size", type=int, default=16, help="images per batch per process (at a --resolution "
                                                              "larger than the first, fewer: about the pixels of one "
                                                              "batch at the first, at least one image)")
    p.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
    p.add_argument("--best", action="store_true", help="with --ckpt RUN: the run's best checkpoint by its "
                                                       "--best_metric (checkpoints/best), and the EMA weights if "
                                                       "that metric was the EMA's")
    p.add_argument("--out", default="", help="also write metrics.json and reconstructions.png here")
    p.add_argument("--vgg16_weights", default="torchvision",
                   help="LPIPS backbone: torchvision (its download cache), a state-dict PATH, random (tests), none")
    p.add_argument("--inception_weights", default="torchvision",
                   help="FID Inception: torchvision (torch hub's cache, torch-fidelity's weights), PATH, random "
                        "(tests), none")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="autocast of the VAE")
    p.add_argument("--latent_stats", action="store_true",
                   help="print the latent shift_factor / scaling_factor (FLUX: z' = (z - shift) * scale) instead")
    p.add_argument("--images", default="", help="reconstruct every image in this folder (any size) ...")
    p.add_argument("--reconstruct_to", default="", help="... into this folder, as PNG: NAME.EXT -> NAME.EXT.png")
    p.add_argument("--tile_size", type=int, default=None, help="encode/decode larger images (--images) or crops "
                                                             "(metrics) in tiles of this many pixels (0: never tile; "
                                                             "default: 1024 for --images, 0 for metrics: the numbers "
                                                             "of training's evaluation without --eval_tile_size)")
    p.add_argument("--tile_overlap", type=int, default=128, help="overlap of neighbouring tiles, pixels")
    p.add_argument("--video_frames", type=int, default=None,
                   help="clips: the videos of --dataset_url as clips of their first N frames (1 + t k for the video "
                        "VAE's temporal factor t: a video run's checkpoint, or a video VAE's diffusers folder, a Wan "
                        "one loaded as the video model): per-frame metrics with temporal_psnr and tlp "
                        "(docs/evaluation.md). 0: images. Default: a run's checkpoint's own (its --video_frames), "
                        "else images")
    p.add_argument("--video_frame_stride", type=int, default=None,
                   help="with --video_frames: every k-th frame of the videos (default: a run's checkpoint's "
                        "--video_frame_stride, else 1)")
    return p


def clips_of_checkpoint(args, info: dict) -> str | None:
    """--video_frames and --video_frame_stride made concrete: as given, else a run's checkpoint's own (a clip run
    is evaluated on clips of its length without the flag: its checkpoint records them), else images (0) and every
    frame (1). --images reconstructs images: 0. The line that says so where the checkpoint's were taken, else None."""
    recorded = 0 if args.images else info.get("video_frames") or 0
    taken = args.video_frames is None and recorded > 0
    if args.video_frames is None:
        args.video_frames = recorded
    if args.video_frame_stride is None:
        args.video_frame_stride = (info.get("video_frame_stride") or 1) if args.video_frames == recorded else 1
    if not taken:
        return None
    return (f"clips of {args.video_frames} frames (--video_frame_stride {args.video_frame_stride}), as the run "
            "trained: its --video_frames (--video_frames 0 evaluates images)")


def tile_size_of(args) -> int:
    """--tile_size, its default made concrete: 1024 for --images, 0 (whole crops) for metrics."""
    return args.tile_size if args.tile_size is not None else (1024 if args.images else 0)


def validate(args, vae: nn.Module, resolutions: tuple[int, ...]) -> None:
    f, tile_size = vae.downsample_factor, tile_size_of(args)
    if bool(args.images) != bool(args.reconstruct_to):
        raise ConfigError("--images and --reconstruct_to go together")
    if args.images and args.latent_stats:
        raise ConfigError("--latent_stats works on --dataset_url, not on --images")
    if args.video_frames:
        temporal = vae.temporal_factor
        if not temporal:
            raise ConfigError(f"--video_frames {args.video_frames}: {args.ckpt} holds an image VAE; clips take a video "
                              "VAE (a run trained with --video_frames, or a video VAE's diffusers folder)")
        if args.video_frames < 0 or (args.video_frames - 1) % temporal:
            raise ConfigError(f"--video_frames {args.video_frames}: the video VAE takes clips of 1 + {temporal}k "
                              "frames")
        if args.images or tile_size:
            raise ConfigError(f"--video_frames {args.video_frames}: --images and --tile_size take images, not clips")
        if args.video_frame_stride < 1:
            raise ConfigError(f"--video_frame_stride must be positive, got {args.video_frame_stride}")
    elif not vae.takes_images():
        raise ConfigError(f"{args.ckpt} holds {vae.describe()}, which takes clips: give --video_frames "
                          f"(1 + {vae.temporal_factor}k)")
    if tile_size < 0 or (tile_size and (tile_size % f or args.tile_overlap % f)):
        raise ConfigError(f"--tile_size and --tile_overlap must be multiples of the downsample factor {f}")
    if tile_size and not 0 <= args.tile_overlap < tile_size:
        raise ConfigError("--tile_overlap must be >= 0 and smaller than --tile_size")
    if args.images:
        if not os.path.isdir(args.images):
            raise ConfigError(f"--images {args.images}: not a directory")
        return
    if not args.dataset_url:
        raise ConfigError("give --dataset_url (metrics, --latent_stats) or --images with --reconstruct_to")
    sources.probe_remote_shards(sources.list_shards(args.dataset_url))  # DatasetError: one line
    for resolution in resolutions or (None,):
        if not resolution or resolution <= 0 or resolution % f:
            raise ConfigError(f"--resolution must be a positive multiple of the downsample factor {f}, got "
                              f"{resolution}")
        problem = eval_size_problem(resolution, f)
        if problem:
            raise ConfigError(f"--resolution {resolution}: {problem}")
    if args.latent_stats and len(resolutions) > 1:
        raise ConfigError(f"--latent_stats takes one --resolution, got {args.resolution}")
    if args.batch_size <= 0 or args.max_images < 0:
        raise ConfigError("--batch_size must be positive and --max_images >= 0")
    for flag in ("vgg16_weights", "inception_weights"):
        spec = getattr(args, flag)
        if spec not in ("torchvision", "random", "none") and not os.path.isfile(spec):
            raise ConfigError(f"--{flag} {spec}: no such file (or use torchvision / random / none)")


def main(argv: list[str] | None = None) -> int:
    guard_console()  # a lost console must not end the command (common.Console)
    is_rank0 = os.environ.get("RANK", "0") == "0"

    def log(msg: str) -> None:
        if is_rank0:
            print(msg, file=sys.stderr, flush=True)

    try:
        args = build_parser().parse_args(argv)
        if args.best:  # the run's best checkpoint, and the weights its --best_metric measured
            args.ckpt, args.ema = best_checkpoint(args.ckpt, args.ema)
        vae, info = load_model(args.ckpt, args.ema, video=bool(args.video_frames))
        clip_note = clips_of_checkpoint(args, info)
        resolutions = parse_sizes(args.resolution, "resolution") or (info["resolution"],)
        if resolutions == (None,):
            raise ConfigError(f"--ckpt {args.ckpt} does not record the size it was trained at: give --resolution")
        validate(args, vae, resolutions)
        resolution, tile_size = resolutions[0], tile_size_of(args)
    except (ConfigError, data_lib.DatasetError) as e:
        log(f"error: {e}")
        return 2
    if clip_note:
        log(clip_note)
    dist_info = init_distributed()
    vae.to(dist_info.device)
    autocast = None
    if args.precision == "bf16":  # the VAE only; every metric stays in fp32/fp64
        autocast = partial(Precision.of(args.precision).autocast, dist_info.device.type)
    common = dict(batch_size=args.batch_size, device=dist_info.device, rank=dist_info.rank,
                  world_size=dist_info.world_size, max_images=args.max_images or None, autocast=autocast,
                  frames=args.video_frames, frame_stride=args.video_frame_stride)
    with closing_distributed(dist_info):  # however the command ends
        try:
            if args.images:
                n = reconstruct_folder(vae, args.images, args.reconstruct_to, dist_info.device, tile_size,
                                       args.tile_overlap, dist_info.rank, dist_info.world_size, autocast, log)
                # NCCL reduces device tensors only
                count = torch.tensor(n, dtype=torch.float64, device=dist_info.device)
                all_reduce_sum(count)
                result = {"reconstructed": int(count.item()), "reconstruct_to": args.reconstruct_to}
            elif args.latent_stats:
                result = latent_stats(vae, args.dataset_url, resolution, **common)
            else:
                lpips_model, inception, missing = metric_networks(args.vgg16_weights, args.inception_weights,
                                                                  dist_info.device, dist_info.local_rank, log)
                result = {}
                for size in resolutions:  # the first size's keys un-suffixed, the others' @SIZE (as the trainer's)
                    res = evaluate_model(vae, args.dataset_url, size, lpips_model=lpips_model, inception=inception,
                                         log=log, tile_size=tile_size, tile_overlap=args.tile_overlap,
                                         **{**common, "batch_size": eval_batch_size(args.batch_size, size, resolution)})
                    if res["n_images"] == 0:
                        raise data_lib.DatasetError(f"{args.dataset_url}: no readable image to evaluate")
                    if size == resolution:
                        result.update(res)
                        result.update({f"{k}_missing": v for k, v in missing.items()})
                    else:
                        suffix = size_suffix(size, resolution)
                        result.update({f"{k}{suffix}": v for k, v in res.items() if k != "grid"
                                       and not k.endswith("_missing")})
            result.update(checkpoint=info["checkpoint"], step=info["step"], ema=args.ema,
                          world_size=dist_info.world_size)
            if not args.images:
                result["resolution"] = resolution
                if len(resolutions) > 1:
                    result["resolutions"] = list(resolutions)
            if not args.images and not args.latent_stats:
                result.update(vgg16_weights=args.vgg16_weights, inception_weights=args.inception_weights)
            grid = result.pop("grid", None)
            if dist_info.is_main:
                if args.out:
                    write_outputs(args.out, result, grid)
                print(json.dumps(result), flush=True)
            return 0
        except (ConfigError, WeightsUnavailable, data_lib.DatasetError) as e:
            log(f"error: {e}")
            return 2


def write_outputs(out_dir: str, result: dict, grid: Tensor | None) -> None:
    from PIL import Image
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(result, f, indent=2)
    if grid is not None:
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(os.path.join(out_dir, "reconstructions.png"))


if __name__ == "__main__":
    sys.exit(main())
