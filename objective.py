"""The training objective: everything that turns (images, reconstructions, latent) into the loss the VAE
backpropagates, and the critic's own loss. One nn.Module, like LDM/taming's LPIPSWithDiscriminator: the trainer
calls it and does not know how the loss is composed.

    objective = VAEObjective(cfg, vgg_features)                # LPIPS, low-pass filters, critic, LeCam
    d_loss, real_logits, fake_logits, logs = objective.critic_loss(x, recon)     # the critic's step
    with objective.critic_frozen():
        loss, logs = objective(x, recon, mean, logvar, step, real_logits, fake_logits)  # the VAE's step
        loss.backward()

Adding a loss branch: a weight field in vae_trainer.Config (the flag), and one block in `forward` below that
computes the term, adds it to `backward` (through `branch(weight)` to put it under GradNorm) and to `logs`.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

from ae import kl_divergence
from utils import (LeCam, LowpassMSE, NLayerDiscriminator, VGG16Discriminator, adaptive_gan_weight, build_lpips,
                   discriminator_accuracy, discriminator_loss, generator_active_fraction, generator_loss, gradnorm,
                   pooled_mse)


class VAEObjective(nn.Module):
    """LPIPS + pooled MSE + low-pass MSE (each a GradNorm branch by default), the latent penalty, the generator
    term against the critic, and the critic's hinge/BCE loss with LeCam. Reads its weights from `cfg` (a
    vae_trainer.Config) at every call, so a changed weight takes effect at once.

    lpips: built when `with_lpips` (a random VGG16 that no loss uses is not built at all); the critic with
    cfg.do_ganloss. `vgg_features`: VGG16 `features` weights for both (None: random, tests only)."""

    def __init__(self, cfg, vgg_features: dict[str, Tensor] | None = None, with_lpips: bool = True,
                 device: torch.device | str = "cpu", memory_format=torch.contiguous_format):
        super().__init__()
        self.cfg = cfg
        self.device = torch.device(device)
        self.memory_format = memory_format
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
        # built in this order: with random weights the construction draws from the global RNG
        self.lpips = build_lpips(vgg_features).to(device, memory_format=memory_format) if with_lpips else None
        self.lowpass_mse = LowpassMSE(cfg.lowpass_threshold).to(device)  # its filters live on the device
        self.critic = None
        if cfg.do_ganloss:
            self.critic = (VGG16Discriminator(vgg_features) if cfg.discriminator == "vgg16"
                           else NLayerDiscriminator(norm=cfg.disc_norm))
            self.critic.to(device, memory_format=memory_format)
        self.lecam = LeCam().to(device) if cfg.do_ganloss and cfg.lecam_weight > 0 else None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    # ------------------------------------------------------------------ the critic's own loss
    def critic_loss(self, x: Tensor, recon: Tensor, critic: nn.Module | None = None):
        """The critic's loss on real `x` vs the detached `recon` (LeCam included), its logits (detached, for the
        generator term) and logs. `critic`: the module to run, e.g. the DDP wrapper of self.critic."""
        critic = critic if critic is not None else self.critic
        with self.autocast():
            logits = critic(torch.cat([x, recon.detach()]).contiguous(memory_format=self.memory_format))
        real_logits, fake_logits = logits.float().chunk(2)
        d_loss = discriminator_loss(real_logits, fake_logits, self.cfg.disc_type)
        if self.lecam is not None:
            self.lecam.update(real_logits, fake_logits)
            d_loss = d_loss + self.cfg.lecam_weight * self.lecam.penalty(real_logits, fake_logits)
        logs = {"loss/disc": d_loss, "gan/disc_acc": discriminator_accuracy(real_logits, fake_logits),
                "gan/real_logits": real_logits.mean(), "gan/fake_logits": fake_logits.mean()}
        return d_loss, real_logits.detach(), fake_logits.detach(), logs

    @contextlib.contextmanager
    def critic_frozen(self):
        """The critic's weights take no gradient inside (the generator's pass and its backward): its weight
        gradients are then neither computed (time) nor added to the ones of its own loss."""
        if self.critic is not None:
            self.critic.requires_grad_(False)
        try:
            yield
        finally:
            if self.critic is not None:
                self.critic.requires_grad_(True)

    def gan_active(self, step: int) -> bool:
        """Whether the generator gets the adversarial term at `step` (the critic itself trains from step 0)."""
        return self.critic is not None and step >= self.cfg.disc_start

    # ------------------------------------------------------------------ the VAE's loss
    def forward(self, x: Tensor, recon: Tensor, mean: Tensor, logvar: Tensor | None, step: int,
                real_logits: Tensor | None = None, critic_fake_logits: Tensor | None = None, accum: int = 1,
                loss_scale: Tensor | None = None, last_layer: Tensor | None = None) -> tuple[Tensor, dict]:
        """(the tensor to backpropagate, {metric name: term} for logging, per micro-batch). `recon` in fp32; `mean`,
        `logvar` the posterior; `real_logits`, `critic_fake_logits` the critic's logits on this micro-batch's
        images and detached reconstructions (critic_loss), needed from cfg.disc_start on; `accum` micro-batches
        per step; `loss_scale` the fp16 GradScaler's scale (None: 1); `last_layer` the decoder's last weight
        (for --loss_balance adaptive)."""
        cfg = self.cfg
        kl = kl_divergence(mean, logvar)  # per latent element, over the micro-batch's mean.numel() elements
        latent_elements = mean.numel()
        gan_on = self.gan_active(step)
        scale = loss_scale if loss_scale is not None else torch.ones((), device=self.device)
        if cfg.loss_balance == "gradnorm":
            # GradNorm fixes each branch's gradient norm, so a loss scale and 1/accum enter as weights
            def branch(weight):
                return gradnorm(recon, scale * (weight / accum))
        else:
            def branch(weight):
                return recon
        terms = {}
        perceptual = torch.zeros((), device=self.device)
        if cfg.perceptual_weight > 0:  # weight 0: no VGG16 pass at all (pixel-only steps are ~6x cheaper)
            with self.autocast():
                perceptual = self.lpips(branch(cfg.perceptual_weight).contiguous(memory_format=self.memory_format),
                                        x).float().mean()
            terms["loss/perceptual"] = perceptual
        pixel_in = branch(cfg.mse_weight)
        pooled = pooled_mse(pixel_in, x, cfg.mse_pool_factor)
        lowpass = self.lowpass_mse(pixel_in, x)
        pixel = cfg.pooled_mse_weight * pooled + cfg.lowpass_mse_weight * lowpass
        terms.update({"loss/pooled_mse": pooled, "loss/lowpass_mse": lowpass, "loss/kl": kl})
        g_loss = torch.zeros((), device=self.device)
        if gan_on:
            # GradNorm would give the GAN branch norm gan_weight however few patches the thresholded loss still
            # pushes, i.e. hand the last active patch the whole push. Scaled by sqrt(active fraction), the target
            # gives each active patch the push it gets when all are active (patch gradients are near-orthogonal).
            # Measured on the critic's pass over the detached reconstructions: the same critic, the same images.
            active = generator_active_fraction(real_logits, critic_fake_logits, cfg.gen_loss, cfg.gan_margin)
            terms["gan/active_fraction"] = active
            with self.autocast():
                fake_logits = self.critic(branch(cfg.gan_weight * active.sqrt()).contiguous(
                    memory_format=self.memory_format))
            g_loss = generator_loss(fake_logits.float(), real_logits, cfg.gen_loss, cfg.gan_margin)
            terms["loss/gan_g"] = g_loss
        if cfg.loss_balance == "gradnorm":
            # A GradNorm branch's gradient has norm `weight` over all the reconstruction's elements, so its
            # per-element size falls as 1/sqrt(their count); a mean KL's would fall as 1/count. Summed and divided
            # by sqrt(count), the KL scales like the branches: kl_weight means the same at any batch and resolution.
            kl_branch = cfg.kl_weight * kl * math.sqrt(latent_elements)
            # The whole sum is scaled, so LPIPS' and the critic's fp16 backward passes run at the loss scale
            # (unscaled, their small gradients underflow). Each GradNorm renormalises what reaches it to its
            # weight, which carries the scale once: the VAE's gradient does not depend on this factor.
            backward = scale * (perceptual + pixel + g_loss + kl_branch / accum)
        else:
            rec = cfg.perceptual_weight * perceptual + cfg.mse_weight * pixel
            gan_w = torch.full((), cfg.gan_weight, device=self.device)
            if gan_on and cfg.loss_balance == "adaptive":
                gan_w = cfg.gan_weight * adaptive_gan_weight(scale * rec, scale * g_loss, last_layer,
                                                             cfg.adaptive_weight_max)
                terms["loss/adaptive_weight"] = gan_w
            backward = scale * ((rec + gan_w * g_loss + cfg.kl_weight * kl) / accum)
        terms["loss/total"] = (cfg.perceptual_weight * perceptual + cfg.mse_weight * pixel
                          + cfg.gan_weight * g_loss + cfg.kl_weight * kl).detach()
        return backward, terms
