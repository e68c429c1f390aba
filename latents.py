"""Latents for diffusion: measure how easy a VAE's latent space is for a diffusion model, and regularise it.

Diagnostics (cheap, on evaluation steps and in evaluate.py / export.py):
  - ChannelStats: per-channel mean and std of latents, float64 sums all-reduced across ranks (every element
    counts once, whatever the split);
  - SpectrumStats: the radially averaged power spectrum of a latent (and of the image area-downsampled to the
    latent's size) and the fraction of its energy in the upper half of the frequencies.
Regularisers (training flags, off by default), applied between the encoder and the decoder:
  - scale equivariance: the latent is downsampled (and optionally rotated/flipped) and decoded, and the losses
    compare the result with the equally transformed image. Two forms: `replace` (the default) decodes the
    transformed latent in place of the full one on the micro-batches it picks, as EQ-VAE does (Kouzelis et al.
    2025, "EQ-VAE: Equivariance Regularized Latent Space for Improved Generative Image Modeling", which applies
    its transform with a probability); `add` keeps the full-resolution reconstruction and adds the downsampled
    decode's loss as an extra term, L_rec(x, D(E(x))) + alpha * L_rec(down(x), D(down(E(x)))), as Skorokhodov et
    al. 2025 ("Improving the Diffusability of Autoencoders") define their scale-equivariance regulariser;
  - latent noise: the decoder sees z + Gaussian noise of a random level, like the imperfect latents a diffusion
    model produces.
Their randomness comes from generators seeded by (seed, step, micro-batch): the same on every rank where a
branch depends on it (so every rank runs the same collectives), and a resumed run draws what the uninterrupted
one drew. This module imports no trainer (vae_trainer imports it).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common import all_reduce_sum

HF_CUTOFF = 0.5  # "upper half of the frequencies": radius above half the Nyquist frequency



# ============================================================================================
# Diagnostics
# ============================================================================================
class ChannelStats:
    """Per-channel count, sum and sum of squares in float64; all_reduce() makes them global."""

    def __init__(self, channels: int, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(3, channels, dtype=torch.float64, device=device)  # count, sum, sum of squares

    def update(self, z: Tensor) -> None:
        z = z.detach().double()
        self.sums[0] += z[:, 0].numel()
        self.sums[1] += z.sum(dim=(0, 2, 3))
        self.sums[2] += z.square().sum(dim=(0, 2, 3))

    def all_reduce(self) -> None:
        all_reduce_sum(self.sums)

    def result(self) -> dict:
        """Per-channel and global mean/std (population std), and the spread max/min of the channel stds."""
        count, total, total_sq = self.sums
        channel_mean = total / count
        channel_std = (total_sq / count - channel_mean.square()).clamp_min(0).sqrt()
        mean = total.sum() / count.sum()
        std = (total_sq.sum() / count.sum() - mean.square()).clamp_min(0).sqrt()
        spread = (channel_std.max() / channel_std.min().clamp_min(1e-30)).item()
        return {"latent_mean": mean.item(), "latent_std": std.item(), "channel_mean": channel_mean.tolist(),
                "channel_std": channel_std.tolist(), "channel_std_spread": spread}


def per_channel(z: Tensor, mean, std, scale: float = 1.0) -> Tensor:
    """(z - mean) * scale / std with a value per channel (dim 1), for images and clips: how a pipeline that keeps
    latents_mean / latents_std normalises the latents its diffusion model sees."""
    shape = (1, -1) + (1,) * (z.dim() - 2)
    mean = torch.as_tensor(mean, dtype=torch.float32, device=z.device).view(shape)
    std = torch.as_tensor(std, dtype=torch.float32, device=z.device).view(shape)
    return (z - mean) * scale / std


def _radius(height: int, width: int, device) -> Tensor:
    """|frequency| of each FFT bin as a fraction of the Nyquist frequency (1 on the axes' Nyquist)."""
    fy = torch.fft.fftfreq(height, device=device, dtype=torch.float64).abs() * 2
    fx = torch.fft.fftfreq(width, device=device, dtype=torch.float64).abs() * 2
    return (fy[:, None].square() + fx[None, :].square()).sqrt()


def power_spectrum_2d(x: Tensor) -> Tensor:
    """|FFT|^2 of each (image, channel), summed over both: (2H, 2W), float64. The signal is mirrored first (the
    even extension of the DCT): a plain FFT treats the tensor as periodic, and the jump between opposite
    edges would add a high-frequency tail to every smooth latent."""
    x = x.detach().double()
    x = torch.cat([x, x.flip(-1)], dim=-1)
    x = torch.cat([x, x.flip(-2)], dim=-2)
    return torch.fft.fft2(x).abs().square().sum(dim=(0, 1))


class SpectrumStats:
    """Accumulates the power spectrum of (B, C, H, W) tensors of one size. `spectrum()`: the mean power in
    `bins` (= min(H, W) + 1) rings of radius 0..1 (fraction of Nyquist; the corners beyond 1 fall in the last ring), normalised
    to sum to 1; `hf_fraction()`: the energy above HF_CUTOFF over all energy except the mean (DC): 0 for a
    constant, 1 for a checkerboard, small for smooth signals."""

    def __init__(self, height: int, width: int, device: torch.device | str = "cpu"):
        self.power = torch.zeros(2 * height, 2 * width, dtype=torch.float64, device=device)  # mirrored

    def update(self, x: Tensor) -> None:
        self.power += power_spectrum_2d(x)

    def all_reduce(self) -> None:
        all_reduce_sum(self.power)

    @property
    def bins(self) -> int:
        return min(self.power.shape) // 2 + 1

    def spectrum(self) -> list[float]:
        radius = _radius(*self.power.shape, self.power.device)
        ring = (radius * (self.bins - 1)).round().long().clamp_max(self.bins - 1)
        total = torch.zeros(self.bins, dtype=torch.float64, device=self.power.device).index_add_(
            0, ring.flatten(), self.power.flatten())
        count = torch.bincount(ring.flatten(), minlength=self.bins).double()
        mean = total / count.clamp_min(1)
        return (mean / mean.sum().clamp_min(1e-300)).tolist()

    def hf_fraction(self) -> float:
        radius = _radius(*self.power.shape, self.power.device)
        ac = self.power.sum() - self.power[0, 0]
        hf = self.power[radius > HF_CUTOFF].sum()
        return (hf / ac).item() if ac.item() > 0 else 0.0


def hf_fraction(x: Tensor) -> float:
    """The high-frequency energy fraction of one tensor (B, C, H, W)."""
    stats = SpectrumStats(*x.shape[-2:], device=x.device)
    stats.update(x)
    return stats.hf_fraction()


class LatentDiagnostics:
    """Everything evaluate_model reports about the latents of a data set, in one pass: channel statistics,
    the latent's spectrum and that of the image area-downsampled to the latent's size."""

    def __init__(self):
        self.channels = self.latent = self.image = None

    def update(self, z: Tensor, x: Tensor) -> None:
        if self.channels is None:
            self.channels = ChannelStats(z.shape[1], z.device)
            self.latent = SpectrumStats(*z.shape[-2:], z.device)
            self.image = SpectrumStats(*z.shape[-2:], z.device)
        self.channels.update(z)
        self.latent.update(z)
        self.image.update(F.adaptive_avg_pool2d(x.float(), z.shape[-2:]))

    def result(self) -> dict:
        """Keys prefixed `latent_` (and `image_` for the downsampled image); every rank must call it."""
        for stats in (self.channels, self.latent, self.image):
            stats.all_reduce()
        ch = self.channels.result()
        return {"latent_channel_mean": ch["channel_mean"], "latent_channel_std": ch["channel_std"],
                "latent_channel_std_spread": ch["channel_std_spread"], "latent_global_std": ch["latent_std"],
                "latent_hf_fraction": self.latent.hf_fraction(), "image_hf_fraction": self.image.hf_fraction(),
                "latent_spectrum": self.latent.spectrum(), "image_spectrum": self.image.spectrum()}


def wandb_spectrum_plot(wandb, latent_spectrum: list[float], image_spectrum: list[float], title: str):
    """A wandb line plot of the two normalised spectra against the frequency (fraction of Nyquist)."""
    n = len(latent_spectrum)
    xs = [i / max(1, n - 1) for i in range(n)]
    return wandb.plot.line_series(xs=xs, ys=[latent_spectrum, image_spectrum], keys=["latent", "image (downsampled)"],
                                  title=title, xname="frequency / Nyquist")


# ============================================================================================
# Regularisers
# ============================================================================================
def _generator(device: torch.device | str, *keys: int) -> torch.Generator:
    """A generator seeded by the integers `keys` (a stable mix: Python's hash of an int tuple is not salted)."""
    return torch.Generator(device=device).manual_seed(hash(tuple(keys)) & 0x7FFF_FFFF_FFFF_FFFF)


def equivariance_sizes(latent_size: int, factor: int, mode: str, pool: int, min_image: int) -> list[int]:
    """Latent sizes the scale-equivariance step may downsample to: half (x0.5), or random (every size from a
    quarter up to one less than the latent's); the image at that size must divide by the pooled MSE's
    factor `pool` and be at least `min_image` pixels (the critics' and LPIPS' smallest input)."""
    if mode == "half":
        candidates = [latent_size // 2] if latent_size % 2 == 0 else []
    else:
        candidates = list(range(max(1, math.ceil(latent_size / 4)), latent_size))
    return [s for s in candidates if s >= 1 and (s * factor) % pool == 0 and s * factor >= min_image]


def equivariance_sizes_of(factor: int, training_size: int, mode: str, pool: int, min_image: int) -> list[int]:
    """The latent sizes a run's scale-equivariance steps may decode, from the model's downsample factor
    (config.downsample_factor_of), the training size (--vae_resolution), --scale_equivariance_mode, the pooled MSE's
    factor (--mse_pool_factor) and the losses' smallest image (config.min_loss_image_size)."""
    return equivariance_sizes(training_size // factor, factor, mode, pool, min_image)


class LatentRegularisers:
    """Scale equivariance and latent noise. `draw` returns the loss target and the transform the model
    applies to the latent before decoding ((x, None) when neither applies: the step is bitwise the one
    without the flags); `draw_added` the additive form's extra decode. The equivariance decision, size and
    rotation come from a CPU generator seeded by (seed, step) only, so every micro-batch of a step, on every
    rank, takes the same branch; the noise is drawn on the device from (seed, step, micro-batch), the
    micro-batch's index among the step's micro-batches of all ranks (`micro`), so it does not depend on which
    rank computes it."""

    def __init__(self, seed: int, *, equivariance_prob: float = 0.0, equivariance_sizes: list[int] = (),
                 equivariance_rotate: bool = False, noise_prob: float = 0.0, noise_max: float = 0.0,
                 downsample_factor: int = 8, equivariance_form: str = "replace", latent_size: int = 0):
        self.seed, self.eq_form = seed, equivariance_form
        self.eq_prob, self.eq_sizes, self.eq_rotate = equivariance_prob, list(equivariance_sizes), equivariance_rotate
        self.noise_prob, self.noise_max = noise_prob, noise_max
        self.factor = downsample_factor
        self.latent_size = latent_size  # the training latent's side, which equivariance_sizes are sizes of

    def costliest(self, latent_size: int, min_image: int = 1) -> "LatentRegularisers":
        """These regularisers drawn as their costliest micro-batch would be, for a step whose latent side is
        `latent_size` (memory.py's estimate at its small probe sizes): the additive form's extra decode on, at
        its largest size scaled to that latent (its image at least `min_image` px, what the losses take); the
        replace form off (its decode of a smaller latent replaces the full one, which costs more). The latent
        noise as it is."""
        added = self.eq_form == "add" and self.eq_prob > 0 and bool(self.eq_sizes)
        size = 0
        if added:
            fraction = max(self.eq_sizes) / (self.latent_size or 2 * max(self.eq_sizes))
            size = min(latent_size - 1, max(1, round(latent_size * fraction), -(-min_image // self.factor)))
        return LatentRegularisers(self.seed, equivariance_prob=1.0 if size > 0 else 0.0,
                                  equivariance_sizes=[size] if size > 0 else [], equivariance_rotate=self.eq_rotate,
                                  noise_prob=self.noise_prob, noise_max=self.noise_max,
                                  downsample_factor=self.factor, equivariance_form=self.eq_form,
                                  latent_size=latent_size)

    @property
    def active(self) -> bool:
        return (self.eq_prob > 0 and bool(self.eq_sizes)) or (self.noise_prob > 0 and self.noise_max > 0)

    def equivariance(self, step: int) -> tuple[int, int, bool] | None:
        """(latent size, quarter turns, flip) of this step, or None; the same for all its micro-batches."""
        if self.eq_prob <= 0 or not self.eq_sizes:
            return None
        gen = _generator("cpu", self.seed, step, 0, 1)
        draws = torch.rand(4, generator=gen, dtype=torch.float64).tolist()
        if draws[0] >= self.eq_prob:
            return None
        size = self.eq_sizes[min(int(draws[1] * len(self.eq_sizes)), len(self.eq_sizes) - 1)]
        turns, flip = (int(draws[2] * 4) % 4, draws[3] < 0.5) if self.eq_rotate else (0, False)
        return size, turns, flip

    def draw(self, x: Tensor, step: int, micro: int) -> tuple[Tensor, Callable[[Tensor], Tensor] | None]:
        if not self.active:
            return x, None
        eq = self.equivariance(step) if self.eq_form == "replace" else None
        noise = self.noise_prob > 0 and self.noise_max > 0
        if eq is None and not noise:
            return x, None
        if eq is not None:
            x = dihedral(F.interpolate(x, size=(eq[0] * self.factor,) * 2, mode="area"), *eq[1:])
        keys = (self.seed, step, micro, 2)

        def to_decoder(z: Tensor) -> Tensor:
            if eq is not None:
                z = dihedral(F.interpolate(z, size=(eq[0],) * 2, mode="area"), *eq[1:])
            if noise:
                z = add_latent_noise(z, self.noise_prob, self.noise_max, _generator(z.device, *keys))
            return z
        return x, to_decoder


    def draw_added(self, x: Tensor, step: int, micro: int) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
        """The additive form (`equivariance_form` "add"): on the micro-batches the draw picks (the same draw as
        the replace form's), the downsampled (rotated/flipped) image and the same transform of the latent, whose
        decode is the extra term's reconstruction; None otherwise. The latent noise is not applied to it."""
        eq = self.equivariance(step) if self.eq_form == "add" else None
        if eq is None:
            return None
        size, turns, flip = eq
        return (dihedral(F.interpolate(x, size=(size * self.factor,) * 2, mode="area"), turns, flip),
                lambda z: dihedral(F.interpolate(z, size=(size,) * 2, mode="area"), turns, flip))


def dihedral(t: Tensor, quarter_turns: int, flip: bool) -> Tensor:
    if quarter_turns:
        t = torch.rot90(t, quarter_turns, dims=(-2, -1))
    return t.flip(-1) if flip else t


def add_latent_noise(z: Tensor, prob: float, max_level: float, gen: torch.Generator) -> Tensor:
    """Each sample, with probability `prob`, gets Gaussian noise of std U(0, max_level) times the batch's
    latent std (detached: the noise level is relative and no gradient flows through it). All on the device."""
    b = z.shape[0]
    u = torch.rand(2, b, generator=gen, device=z.device, dtype=torch.float32)
    level = torch.where(u[0] < prob, u[1] * max_level, torch.zeros_like(u[1])).view(b, 1, 1, 1)
    eps = torch.randn(z.shape, generator=gen, device=z.device, dtype=torch.float32)
    return z + (level * z.detach().float().std()) * eps
