"""objective.VAEObjective on its own: built from a Config with random VGG16 weights, no Trainer, process group
or data set. Its loss equals the recomputation from utils' pieces (bitwise: the op order is part of the contract,
a fixed-seed run must not change when the code is reorganised), each GradNorm branch's gradient has its weight as
norm, the GAN target shrinks with sqrt(active fraction), and the critic's own loss carries LeCam."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import vae_trainer
from ae import kl_divergence
from objective import VAEObjective
from utils import discriminator_loss, generator_active_fraction, generator_loss, pooled_mse

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(**changes):
    cfg = vae_trainer.Config(dataset_url="unused", vae_resolution=32, mse_pool_factor=4, vgg16_weights="random",
                             do_ganloss=True, discriminator="patchgan", disc_norm="none", disc_start=2,
                             lecam_weight=0.1)  # disc_norm none: no power iteration, the same critic every call
    return vae_trainer.resolve_auto(dataclasses.replace(cfg, **changes))


@pytest.fixture(scope="module")
def objective():
    torch.manual_seed(0)
    return VAEObjective(config(), vgg_features=None)


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1
    recon = (x + 0.2 * torch.randn(x.shape, generator=gen)).clamp(-1, 1).requires_grad_()
    mean = torch.randn(2, 4, 8, 8, generator=gen).requires_grad_()
    return x, recon, mean


def test_loss_equals_its_recomputation_from_the_pieces(objective, inputs):
    """gradnorm balance, LPIPS + pixel + GAN + KL, grad_accum 2 and an fp16-style loss scale: the returned
    loss and every logged term equal the recomputation exactly (GradNorm is the identity forward)."""
    x, recon, mean = inputs
    cfg = objective.cfg
    real_logits, fake_logits = (objective.critic(t).float().detach() for t in (x, recon.detach()))
    scale = torch.tensor(8.0)
    loss, logs = objective(x, recon, mean, None, step=cfg.disc_start, real_logits=real_logits,
                           critic_fake_logits=fake_logits, accum=2, loss_scale=scale)
    with torch.no_grad():
        perceptual = objective.lpips(recon, x).float().mean()
        pooled, lowpass = pooled_mse(recon, x, cfg.mse_pool_factor), objective.lowpass_mse(recon, x)
        pixel = cfg.pooled_mse_weight * pooled + cfg.lowpass_mse_weight * lowpass
        g_loss = generator_loss(objective.critic(recon).float(), real_logits, cfg.gen_loss, cfg.gan_margin)
        kl = kl_divergence(mean, None)
        expected = scale * (perceptual + pixel + g_loss + cfg.kl_weight * kl * math.sqrt(mean.numel()) / 2)
    assert torch.equal(loss, expected), (loss, expected)
    for name, value in {"loss/perceptual": perceptual, "loss/pooled_mse": pooled, "loss/lowpass_mse": lowpass,
                        "loss/gan_g": g_loss, "loss/kl": kl}.items():
        assert torch.equal(logs[name], value), name
    active = generator_active_fraction(real_logits, fake_logits, cfg.gen_loss, cfg.gan_margin)
    assert torch.equal(logs["gan/active_fraction"], active)
    total = cfg.perceptual_weight * perceptual + cfg.mse_weight * pixel + cfg.gan_weight * g_loss + cfg.kl_weight * kl
    assert torch.equal(logs["loss/total"], total)


def test_plain_sum_without_gradnorm(inputs):
    """--loss_balance none: the weighted mean losses over accum, no GAN term before --disc_start."""
    torch.manual_seed(0)
    objective = VAEObjective(config(loss_balance="none", perceptual_weight=0.0, kl_weight=0.5), with_lpips=False)
    x, recon, mean = inputs
    loss, logs = objective(x, recon, mean, None, step=1, accum=4)
    cfg = objective.cfg
    pixel = cfg.pooled_mse_weight * pooled_mse(recon, x, 4) + cfg.lowpass_mse_weight * objective.lowpass_mse(recon, x)
    expected = torch.ones(()) * ((cfg.perceptual_weight * torch.zeros(()) + cfg.mse_weight * pixel
                                  + torch.full((), cfg.gan_weight) * torch.zeros(()) + 0.5 * kl_divergence(mean, None))
                                 / 4)
    assert torch.equal(loss, expected)
    assert "loss/gan_g" not in logs and "loss/perceptual" not in logs


@pytest.mark.parametrize("branch", ["perceptual_weight", "mse_weight"])
def test_each_gradnorm_branch_has_its_weight_as_gradient_norm(objective, inputs, branch):
    """Only one branch on: its gradient on the reconstruction has norm weight * loss scale / accum."""
    x, recon, mean = inputs
    cfg = dataclasses.replace(objective.cfg, **{**dict(perceptual_weight=0.0, mse_weight=0.0, kl_weight=0.0), branch: 0.7})
    saved, objective.cfg = objective.cfg, cfg
    try:
        loss, _ = objective(x, recon, mean.detach(), None, step=0, accum=2, loss_scale=torch.tensor(4.0))
        grad = torch.autograd.grad(loss, recon)[0]
    finally:
        objective.cfg = saved
    assert grad.norm().item() == pytest.approx(0.7 * 4.0 / 2, rel=1e-4)


@pytest.mark.parametrize("active_patches", [6, 2])  # of the 8 patches (2 images x 2 x 2)
def test_gan_target_is_its_weight_times_sqrt_active_fraction(objective, inputs, active_patches):
    """The GAN branch alone (thresholded loss): GradNorm sets its gradient norm to gan_weight * sqrt(active
    fraction of the critic's patches), the push per active patch that all patches active would get."""
    x, recon, mean = inputs
    cfg = dataclasses.replace(objective.cfg, perceptual_weight=0.0, mse_weight=0.0, kl_weight=0.0, gan_weight=0.5,
                              gen_loss="thresholded")
    fake = objective.critic(recon.detach()).float().detach()
    order = torch.randperm(fake.numel(), generator=torch.Generator().manual_seed(2))
    active = torch.zeros(fake.numel(), dtype=torch.bool)
    active[order[:active_patches]] = True
    real = torch.where(active.view_as(fake), fake + 1.0, fake - 1.0)  # active: the fake trails by more than the margin
    saved, objective.cfg = objective.cfg, cfg
    try:
        loss, logs = objective(x, recon, mean.detach(), None, step=cfg.disc_start, real_logits=real,
                               critic_fake_logits=fake)
        grad = torch.autograd.grad(loss, recon)[0]
    finally:
        objective.cfg = saved
    fraction = active_patches / fake.numel()
    assert logs["gan/active_fraction"].item() == pytest.approx(fraction)
    assert grad.norm().item() == pytest.approx(0.5 * math.sqrt(fraction), rel=1e-4)


def test_critic_loss_carries_lecam_and_the_frozen_critic_takes_no_gradient(objective, inputs):
    x, recon, mean = inputs
    d_loss, real_logits, fake_logits, logs = objective.critic_loss(x, recon)
    hinge = discriminator_loss(real_logits, fake_logits, "hinge")
    penalty = objective.lecam.penalty(real_logits, fake_logits)  # against the pending anchors of this step
    assert torch.equal(d_loss, hinge + 0.1 * penalty) and penalty > 0
    assert not real_logits.requires_grad and torch.equal(logs["loss/disc"], d_loss)
    objective.lecam.commit(skip=torch.zeros(()))
    with objective.critic_frozen():
        loss, _ = objective(x, recon, mean, None, step=objective.cfg.disc_start, real_logits=real_logits,
                            critic_fake_logits=fake_logits)
        loss.backward()
    assert all(p.grad is None for p in objective.critic.parameters())
    assert all(p.requires_grad for p in objective.critic.parameters())
    assert recon.grad is not None and mean.grad is not None
    assert not objective.gan_active(objective.cfg.disc_start - 1) and objective.gan_active(objective.cfg.disc_start)
