"""The loss functions the objective composes and the training math beside them: GradNorm (and its form for branches
that share one trunk pass), pooled and low-pass MSE, the GAN losses and LDM's adaptive weight, the generator term's
ramp, LeCam regularisation, the learning-rate schedule.

Every loss reduction here runs in fp32, whatever the autocast around it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from config import DISC_TYPES

def _dist_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --------------------------------------------------------------------------------------------
# GradNorm
# --------------------------------------------------------------------------------------------
class GradNormFunction(torch.autograd.Function):
    """Identity forward; backward rescales the incoming gradient to `weight / ||grad||`.

    One loss branch then contributes a gradient of norm `weight` to the reconstruction, whatever
    its raw scale, which balances LPIPS, MSE and GAN without hand-tuned loss weights. The norm is the
    micro-batch's own (accumulated in fp32), with no collective: a step's gradient is the mean of its
    micro-batches' normalised gradients whichever ranks and accumulation compute them, so a run resumed on
    another number of GPUs continues the same math (the reference trainer averaged the norm over the ranks
    computing at the same time, which ties the step to the world size).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (weight,) = ctx.saved_tensors
        norm = torch.linalg.vector_norm(grad_output, dtype=torch.float32)
        scale = weight.float() / (norm + 1e-12)
        return (grad_output.float() * scale).to(grad_output.dtype), None


def gradnorm(x: Tensor, weight: float | Tensor = 1.0) -> Tensor:
    if not torch.is_tensor(weight):  # a fill on the device, not torch.tensor (a host->device copy)
        weight = torch.full((), float(weight), device=x.device)
    return GradNormFunction.apply(x, weight)


def gradnorm_branches_through_one_pass(recon: Tensor, leaf: Tensor, branches: list[tuple[Tensor, float | Tensor]]
                                       ) -> Tensor:
    """GradNorm per branch when several losses share one trunk pass over the reconstruction.

    `leaf` is recon.detach().requires_grad_() and every loss in `branches` ((loss, weight) pairs) was computed
    from it (e.g. LPIPS and the generator term from one vgg16_features(lpips_model, leaf)). Each branch's
    gradient at the reconstruction is taken on its own (one input-only backward through the trunk each:
    GradNorm needs each branch's norm), then re-enters the VAE's graph through gradnorm(recon, weight), which
    normalises it to `weight` (DDP all-reduce included) exactly as if the branch had its own trunk pass.
    Returns the surrogate scalar to add to the VAE's backward sum; its value is meaningless, its gradient
    with respect to `recon` is the sum of the normalised branch gradients."""
    surrogate = torch.zeros((), device=recon.device)
    for i, (loss, weight) in enumerate(branches):
        (grad,) = torch.autograd.grad(loss, leaf, retain_graph=i < len(branches) - 1)
        surrogate = surrogate + (gradnorm(recon, weight).float() * grad.float()).sum()
    return surrogate


# --------------------------------------------------------------------------------------------
# Reconstruction losses
# --------------------------------------------------------------------------------------------
def pooled_mse(recon: Tensor, target: Tensor, pool: int) -> Tensor:
    """MSE between area-downsampled images: colour and low frequencies only, blind to the
    high-frequency detail that LPIPS and the GAN take care of."""
    recon, target = recon.float(), target.float()
    if pool > 1:
        recon, target = F.avg_pool2d(recon, pool), F.avg_pool2d(target, pool)
    return F.mse_loss(recon, target)


# the 5x5 Laplacian-like edge filter of the low-pass mask
LAPLACIAN_5X5 = ((0, 1, 1, 1, 0),
                 (1, 1, 1, 1, 1),
                 (1, 1, -20, 1, 1),
                 (1, 1, 1, 1, 1),
                 (0, 1, 1, 1, 0))


def gaussian_kernel2d(size: int, sigma: float) -> Tensor:
    """(1, 1, size, size) normalised fp32 Gaussian, computed as torchvision's gaussian_blur does."""
    x = torch.linspace(-(size - 1) / 2, (size - 1) / 2, steps=size)
    pdf = torch.exp(-0.5 * (x / sigma).pow(2))
    kernel1d = pdf / pdf.sum()
    return (kernel1d[:, None] * kernel1d[None, :]).view(1, 1, size, size)  # not mm: fp32 under autocast too


class LowpassMSE(nn.Module):
    """MSE restricted to the low-frequency regions of the target (mask-weighted mean), so that the
    pixel loss calibrates colour and flat areas without fighting LPIPS over textures.

    The filters are buffers: moved to the device once with the module, never copied from the host
    in a training step (a blocking copy on CUDA)."""

    def __init__(self, threshold: float = 0.8, blur_kernel: int = 13, blur_sigma: float = 2.0):
        super().__init__()
        self.threshold = threshold
        self.register_buffer("laplacian", torch.tensor(LAPLACIAN_5X5, dtype=torch.float32).view(1, 1, 5, 5),
                             persistent=False)
        self.register_buffer("gaussian", gaussian_kernel2d(blur_kernel, blur_sigma), persistent=False)

    def mask(self, image: Tensor) -> Tensor:
        """Mask (B, 1, H, W) in [0, 1] that is non-zero only in low-frequency (blurry) regions.

        Grayscale -> Laplacian-like 5x5 filter -> magnitude -> Gaussian blur -> per-image min-max
        normalisation -> blurriness = 1 - edge strength -> zero where blurriness < threshold.
        Normalised per image, so an image's mask does not depend on the rest of its batch. fp32.
        """
        with torch.autocast(image.device.type, enabled=False):
            gray = image.float().mean(dim=1, keepdim=True)
            # replicate padding: zero padding would make the image frame look like an edge
            edges = F.conv2d(F.pad(gray, (2, 2, 2, 2), mode="replicate"), self.laplacian).abs()
            pad = self.gaussian.shape[-1] // 2  # reflect padding, as torchvision's gaussian_blur
            edges = F.conv2d(F.pad(edges, (pad, pad, pad, pad), mode="reflect"), self.gaussian)
            lo = edges.amin(dim=(1, 2, 3), keepdim=True)
            hi = edges.amax(dim=(1, 2, 3), keepdim=True)
            blurriness = 1.0 - (edges - lo) / (hi - lo + 1e-8)
            return torch.where(blurriness < self.threshold, torch.zeros_like(blurriness), blurriness)

    def forward(self, recon: Tensor, target: Tensor) -> Tensor:
        mask = self.mask(target).detach()
        err = (recon.float() - target.float()).square().mean(dim=1, keepdim=True)
        return (err * mask).sum() / mask.sum().clamp_min(1e-8)


def lowpass_mask(image: Tensor, threshold: float = 0.8) -> Tensor:
    """LowpassMSE.mask, for one-off use (tests, analysis): builds the filters on each call."""
    return LowpassMSE(threshold).to(image.device).mask(image)


def lowpass_mse(recon: Tensor, target: Tensor, threshold: float = 0.8) -> Tensor:
    """LowpassMSE, for one-off use (tests, analysis): builds the filters on each call; a training loop
    holds a LowpassMSE on its device instead."""
    return LowpassMSE(threshold).to(target.device)(recon, target)


# --------------------------------------------------------------------------------------------
# GAN losses
# --------------------------------------------------------------------------------------------
def discriminator_loss(real_logits: Tensor, fake_logits: Tensor, kind: str) -> Tensor:
    real_logits, fake_logits = real_logits.float(), fake_logits.float()
    if kind == "hinge":
        return F.relu(1.0 - real_logits).mean() + F.relu(1.0 + fake_logits).mean()
    if kind == "bce":
        return F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()
    raise ValueError(f"disc_type must be one of {DISC_TYPES}, got {kind!r}")


def generator_loss(fake_logits: Tensor, real_logits: Tensor | None, kind: str, margin: float = 0.1) -> Tensor:
    """`thresholded`: the reference trainer's relativistic hinge, relu(D(x) - D(x_hat) - margin):
    the generator is pushed only where a fake patch scores clearly below its real counterpart,
    which stops it from chasing a critic it already matches. `ldm`: -mean(D(x_hat)) as in LDM.
    `nonsaturating`: softplus(-D(x_hat)) = BCE against "real", the classic GAN generator (the reference's
    with --disc_type bce)."""
    fake_logits = fake_logits.float()
    if kind == "thresholded":
        return F.relu(real_logits.detach().float() - fake_logits - margin).mean()
    if kind == "ldm":
        return -fake_logits.mean()
    if kind == "nonsaturating":
        return F.softplus(-fake_logits).mean()
    raise ValueError(f"unknown generator loss {kind!r}")


def generator_active_fraction(real_logits: Tensor, fake_logits: Tensor, kind: str, margin: float = 0.1) -> Tensor:
    """Fraction of the fake patches that the generator loss still pushes: `thresholded`, those that score
    more than `margin` below their real counterpart; `ldm`, all. Behind GradNorm the GAN branch's target
    is scaled by its square root (see Trainer.vae_losses)."""
    if kind == "thresholded":
        return (real_logits.detach().float() - fake_logits.detach().float() > margin).float().mean()
    if kind in ("ldm", "nonsaturating"):
        return torch.ones((), device=fake_logits.device)
    raise ValueError(f"unknown generator loss {kind!r}")


def discriminator_accuracy(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    return 0.5 * ((real_logits > 0).float().mean() + (fake_logits < 0).float().mean())


def gan_ramp(step: int, disc_start: int, ramp_steps: int) -> float:
    """The generator term's factor at `step`: 0 before disc_start, then linear up to 1 over ramp_steps
    (0: the step function of LDM/taming, whose sudden loss jump users report, latent-diffusion #350)."""
    if step < disc_start:
        return 0.0
    if ramp_steps <= 0:
        return 1.0
    return min(1.0, (step - disc_start + 1) / ramp_steps)


def adaptive_gan_weight(rec_loss: Tensor, gan_loss: Tensor, last_layer: Tensor, max_weight: float = 1e4) -> Tensor:
    """LDM's generator weight ||d rec / d w_last|| / ||d gan / d w_last|| at the decoder's last layer,
    in fp32, clamped to [0, max_weight] and detached."""
    rec_grad = torch.autograd.grad(rec_loss, last_layer, retain_graph=True)[0]
    gan_grad = torch.autograd.grad(gan_loss, last_layer, retain_graph=True)[0]
    ratio = torch.linalg.vector_norm(rec_grad, dtype=torch.float32) / (
        torch.linalg.vector_norm(gan_grad, dtype=torch.float32) + 1e-4)
    return ratio.clamp(0.0, max_weight).detach()


class LeCam(nn.Module):
    """LeCam regularisation (Tseng et al. 2021): keeps the critic's logits near EMA anchors of its own
    past real/fake logits, saved in checkpoints (buffers).

    A micro-batch's penalty uses the anchors of the step's start moved by its own logits' means (`update`);
    `commit` moves the anchors once per step by the mean over all its micro-batches (one all-reduce), once the
    non-finite guard has judged the step: a skipped step (a NaN reconstruction, an fp16 overflow) leaves them as
    they were. Neither depends on how the micro-batches are spread over ranks and accumulation."""

    def __init__(self, decay: float = 0.99):
        super().__init__()
        self.decay = decay
        self.register_buffer("ema_real", torch.zeros(()))
        self.register_buffer("ema_fake", torch.zeros(()))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.pending: tuple[Tensor, Tensor] | None = None  # (real, fake) anchors of the micro-batch in progress
        self.sums: Tensor | None = None  # this rank's (real, fake, micro-batches) sums over the step so far

    def _moved(self, means: Tensor) -> tuple[Tensor, Tensor]:
        decay = self.decay * self.initialized.float()  # the first step sets the anchors
        return decay * self.ema_real + (1 - decay) * means[0], decay * self.ema_fake + (1 - decay) * means[1]

    @torch.no_grad()
    def update(self, real_logits: Tensor, fake_logits: Tensor) -> None:
        means = torch.stack([real_logits.float().mean(), fake_logits.float().mean()])
        self.pending = self._moved(means)
        sums = torch.cat([means, means.new_ones(1)])
        self.sums = sums if self.sums is None else self.sums + sums

    @torch.no_grad()
    def commit(self, skip: Tensor) -> None:
        """Move the anchors by the step's mean logits unless `skip` (a device flag, no host sync); every rank
        calls it."""
        if self.sums is None:
            return
        sums = self.sums
        if _dist_world() > 1:
            dist.all_reduce(sums)
        real, fake = self._moved(sums[:2] / sums[2])
        keep = skip.bool()
        self.ema_real.copy_(torch.where(keep, self.ema_real, real))
        self.ema_fake.copy_(torch.where(keep, self.ema_fake, fake))
        self.initialized.copy_(self.initialized | ~keep)
        self.abandon()

    def abandon(self) -> None:
        """Forget the step in progress (an abandoned step: out of memory)."""
        self.pending = self.sums = None

    def penalty(self, real_logits: Tensor, fake_logits: Tensor) -> Tensor:
        real, fake = self.pending if self.pending is not None else (self.ema_real, self.ema_fake)
        return (F.relu(real_logits.float() - fake).square().mean()
                + F.relu(real - fake_logits.float()).square().mean())


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------
def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
    """LR multiplier: linear warm-up from 1/warmup to 1, then cosine decay to `min_ratio`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor
