"""objective.VAEObjective and the Adversary on their own: built from a Config with random VGG16 weights, no
Trainer, process group or data set. Its loss equals the recomputation from utils' pieces (bitwise: the op order is part of the contract,
a fixed-seed run must not change when the code is reorganised), each GradNorm branch's gradient has its weight as
norm, the GAN target shrinks with sqrt(active fraction), and the critic's own loss carries LeCam."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from ae import kl_divergence
from config import resolve_auto, unflatten, with_values
from objective import Term, compose, MicroBatch
from conftest import objective_of
from utils import discriminator_loss, generator_active_fraction, generator_loss, pooled_mse

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(**changes):
    cfg = unflatten(dict(dataset_url="unused", vae_resolution=32, mse_pool_factor=4, vgg16_weights="random",
                         do_ganloss=True, discriminator="patchgan", disc_norm="none", disc_start=2,
                         lecam_weight=0.1))  # disc_norm none: no power iteration, the same critic every call
    return resolve_auto(with_values(cfg, **changes))


@contextlib.contextmanager
def configured(objective, **changes):
    """The objective with some config values changed (it reads its sections at every call) for the block."""
    saved = objective.loss_cfg, objective.latents_cfg, objective.adversary.cfg
    changed = config(**changes)
    objective.loss_cfg, objective.latents_cfg, objective.adversary.cfg = changed.loss, changed.latents, changed.critic
    try:
        yield objective
    finally:
        objective.loss_cfg, objective.latents_cfg, objective.adversary.cfg = saved


@pytest.fixture(scope="module")
def objective():
    torch.manual_seed(0)
    return objective_of(config(), None)


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
    cfg = config()
    real_logits, fake_logits = (objective.critic(t).float().detach() for t in (x, recon.detach()))
    scale = torch.tensor(8.0)
    loss, logs = objective(MicroBatch(x, recon, mean, None, step=cfg.loss.disc_start, real_logits=real_logits,
                           fake_logits=fake_logits, accum=2, loss_scale=scale))
    with torch.no_grad():
        perceptual = objective.lpips(recon, x).float().mean()
        pooled, lowpass = pooled_mse(recon, x, cfg.loss.mse_pool_factor), objective.lowpass_mse(recon, x)
        pixel = cfg.loss.pooled_mse_weight * pooled + cfg.loss.lowpass_mse_weight * lowpass
        g_loss = generator_loss(objective.critic(recon).float(), real_logits, cfg.loss.gen_loss,
                                cfg.loss.gan_margin)
        kl = kl_divergence(mean, None)
        expected = scale * (perceptual + pixel + g_loss + cfg.loss.kl_weight * kl * math.sqrt(mean.numel()) / 2)
    assert torch.equal(loss, expected), (loss, expected)
    for name, value in {"loss/perceptual": perceptual, "loss/pooled_mse": pooled, "loss/lowpass_mse": lowpass,
                        "loss/gan_g": g_loss, "loss/kl": kl}.items():
        assert torch.equal(logs[name], value), name
    active = generator_active_fraction(real_logits, fake_logits, cfg.loss.gen_loss, cfg.loss.gan_margin)
    assert torch.equal(logs["gan/active_fraction"], active)
    total = (cfg.loss.perceptual_weight * perceptual + cfg.loss.mse_weight * pixel + cfg.loss.gan_weight * g_loss
             + cfg.loss.kl_weight * kl)
    assert torch.equal(logs["loss/total"], total)


def test_plain_sum_without_gradnorm(inputs):
    """--loss_balance none: the weighted mean losses over accum, no GAN term before --disc_start."""
    torch.manual_seed(0)
    objective = objective_of(config(loss_balance="none", perceptual_weight=0.0, kl_weight=0.5), with_lpips=False)
    x, recon, mean = inputs
    loss, logs = objective(MicroBatch(x, recon, mean, None, step=1, accum=4))
    cfg = config(loss_balance="none", perceptual_weight=0.0, kl_weight=0.5)
    pixel = (cfg.loss.pooled_mse_weight * pooled_mse(recon, x, 4)
             + cfg.loss.lowpass_mse_weight * objective.lowpass_mse(recon, x))
    expected = torch.ones(()) * ((cfg.loss.perceptual_weight * torch.zeros(()) + cfg.loss.mse_weight * pixel
                                  + torch.full((), cfg.loss.gan_weight) * torch.zeros(())
                                  + 0.5 * kl_divergence(mean, None))
                                 / 4)
    assert torch.equal(loss, expected)
    assert "loss/gan_g" not in logs and "loss/perceptual" not in logs


@pytest.mark.parametrize("branch", ["perceptual_weight", "mse_weight"])
def test_each_gradnorm_branch_has_its_weight_as_gradient_norm(objective, inputs, branch):
    """Only one branch on: its gradient on the reconstruction has norm weight * loss scale / accum."""
    x, recon, mean = inputs
    with configured(objective, **{**dict(perceptual_weight=0.0, mse_weight=0.0, kl_weight=0.0), branch: 0.7}):
        loss, _ = objective(MicroBatch(x, recon, mean.detach(), None, step=0, accum=2, loss_scale=torch.tensor(4.0)))
        grad = torch.autograd.grad(loss, recon)[0]
    assert grad.norm().item() == pytest.approx(0.7 * 4.0 / 2, rel=1e-4)


@pytest.mark.parametrize("active_patches", [6, 2])  # of the 8 patches (2 images x 2 x 2)
def test_gan_target_is_its_weight_times_sqrt_active_fraction(objective, inputs, active_patches):
    """The GAN branch alone (thresholded loss): GradNorm sets its gradient norm to gan_weight * sqrt(active
    fraction of the critic's patches), the push per active patch that all patches active would get."""
    x, recon, mean = inputs
    fake = objective.critic(recon.detach()).float().detach()
    order = torch.randperm(fake.numel(), generator=torch.Generator().manual_seed(2))
    active = torch.zeros(fake.numel(), dtype=torch.bool)
    active[order[:active_patches]] = True
    real = torch.where(active.view_as(fake), fake + 1.0, fake - 1.0)  # active: the fake trails by more than the margin
    with configured(objective, perceptual_weight=0.0, mse_weight=0.0, kl_weight=0.0, gan_weight=0.5,
                    gen_loss="thresholded"):
        loss, logs = objective(MicroBatch(x, recon, mean.detach(), None, step=config().loss.disc_start, real_logits=real,
                               fake_logits=fake))
        grad = torch.autograd.grad(loss, recon)[0]
    fraction = active_patches / fake.numel()
    assert logs["gan/active_fraction"].item() == pytest.approx(fraction)
    assert grad.norm().item() == pytest.approx(0.5 * math.sqrt(fraction), rel=1e-4)


def test_critic_loss_carries_lecam_and_the_frozen_critic_takes_no_gradient(objective, inputs):
    x, recon, mean = inputs
    adversary, disc_start = objective.adversary, config().loss.disc_start
    d_loss, real_logits, fake_logits, logs = adversary.loss(x, recon)
    hinge = discriminator_loss(real_logits, fake_logits, "hinge")
    penalty = adversary.lecam.penalty(real_logits, fake_logits)  # against the pending anchors of this step
    assert torch.equal(d_loss, hinge + 0.1 * penalty) and penalty > 0
    assert not real_logits.requires_grad and torch.equal(logs["loss/disc"], d_loss)
    adversary.lecam.commit(skip=torch.zeros(()))
    with adversary.frozen():
        loss, _ = objective(MicroBatch(x, recon, mean, None, step=disc_start, real_logits=real_logits,
                            fake_logits=fake_logits))
        loss.backward()
    assert all(p.grad is None for p in adversary.critic.parameters())
    assert all(p.requires_grad for p in adversary.critic.parameters())
    assert recon.grad is not None and mean.grad is not None
    assert not objective.gan_active(disc_start - 1) and objective.gan_active(disc_start)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # the skipped step takes no optimizer step
def test_the_adversary_trains_and_checkpoints_on_its_own(objective, inputs):
    """The critic's owner without a trainer: its backward and guarded step move the critic, the schedule and
    LeCam's anchors; a skipped step moves none of them; state_dict/load_state_dict round-trip under the
    checkpoint's keys, and a checkpoint of another critic kind is not loaded."""
    x, recon, _ = inputs
    recon = recon.detach() * 0.5  # logits other than the earlier tests': LeCam's anchors would move
    adversary = objective.adversary
    adversary.prepare_training(config().optim, lambda params, lr: torch.optim.AdamW(params, lr=lr))

    def step_optimizer(optimizer, scaler, bad):
        if not bad:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    before = {k: v.clone() for k, v in adversary.critic.state_dict().items()}
    anchor = adversary.lecam.ema_fake.clone()
    adversary.backward(x, recon, sync=True, accum=1)
    adversary.step(torch.ones(()), step_optimizer)  # skipped: nothing moves but the schedule
    assert all(torch.equal(v, adversary.critic.state_dict()[k]) for k, v in before.items())
    assert torch.equal(adversary.lecam.ema_fake, anchor)
    adversary.backward(x, recon, sync=True, accum=1)
    adversary.step(torch.zeros(()), step_optimizer)
    assert not all(torch.equal(v, adversary.critic.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(adversary.lecam.ema_fake, anchor)
    state = adversary.state_dict()
    assert set(state) == {"critic", "optimizer", "scheduler", "scaler", "lecam", "kind"}
    assert state["scheduler"]["last_epoch"] == 2
    assert state["kind"] == {"discriminator": "patchgan", "disc_norm": "none", "critic_trunk": "trainable"}
    fresh = objective_of(config(), with_lpips=False).adversary
    fresh.prepare_training(config().optim, lambda params, lr: torch.optim.AdamW(params, lr=lr))
    other_kind = {**state["kind"], "disc_norm": "group_spectral"}
    fresh.load_state_dict({**state, "kind": other_kind}, log=lambda m: None)
    assert not torch.equal(fresh.critic.state_dict()["main.0.weight"], state["critic"]["main.0.weight"])
    fresh.load_state_dict(state)
    assert all(torch.equal(v, state["critic"][k]) for k, v in fresh.critic.state_dict().items())
    assert torch.equal(fresh.lecam.ema_real, adversary.lecam.ema_real)


def term(name, value, weight, **kwargs):
    return Term(name, torch.tensor(value, requires_grad=True), weight, **kwargs)


@pytest.mark.parametrize("balance", ["gradnorm", "adaptive", "none"])
def test_compose_logs_every_term_and_one_total_formula_for_every_balance(balance):
    """loss/total = sum(weight * value) whatever the balance; each term logged under its name (a term that is
    not `logged` contributes its parts); what is backpropagated follows the balance."""
    last_layer = torch.ones(3, requires_grad=True)
    rec = (last_layer * torch.tensor([1.0, 2.0, 3.0])).sum()  # a reconstruction term with a path to the last layer
    terms = [Term("pixel", rec, 2.0, balanced=True, logged=False, logs={"loss/part": rec.detach()}),
             term("gan_g", 0.5, 0.25, balanced=True, adversarial=True), term("kl", 3.0, 0.1, balanced=False,
                                                                                gradnorm_factor=4.0)]
    terms[1].value = terms[1].value * last_layer.sum() / 3  # the GAN term also reaches the last layer
    backward, logs = compose(terms, balance, scale=torch.tensor(2.0), accum=2, last_layer=last_layer)
    assert logs["loss/total"].item() == pytest.approx(2.0 * 6.0 + 0.25 * 0.5 + 0.1 * 3.0)
    assert set(logs) >= {"loss/part", "loss/gan_g", "loss/kl", "loss/total"} and "loss/pixel" not in logs
    if balance == "gradnorm":  # branches unweighted (GradNorm carries their weight), the KL weighted and scaled
        expected = 2.0 * (6.0 + 0.5 + 0.1 * 3.0 * 4.0 / 2)
    else:
        gan_weight = 0.25
        if balance == "adaptive":  # ||d rec / d w|| / (||d gan / d w|| + 1e-4) at the last layer, both scaled
            rec_grad_norm = 2.0 * 2.0 * torch.tensor([1.0, 2.0, 3.0]).norm()
            gan_weight = 0.25 * rec_grad_norm / (2.0 * 0.5 / 3 * math.sqrt(3) + 1e-4)
            assert logs["loss/adaptive_weight"].item() == pytest.approx(float(gan_weight), rel=1e-5)
        expected = 2.0 * (2.0 * 6.0 + gan_weight * 0.5 + 0.1 * 3.0) / 2
    assert backward.item() == pytest.approx(float(expected), rel=1e-5)


# ------------------------------------------------------------------------------------------ the 3D critic
def clip_critic(**changes):
    torch.manual_seed(0)
    return objective_of(config(discriminator="patchgan3d", video_frames=5, **changes), with_lpips=False).adversary


def frames_and_clips(batch=2, frames=5, size=32, seed=3):
    from clips import frames_of
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, 3, frames, size, size, generator=gen) * 2 - 1
    recon = (x + 0.2 * torch.randn(x.shape, generator=gen)).clamp(-1, 1)
    return frames_of(x), frames_of(recon), x, recon


def test_the_3d_critic_judges_whole_clips_folded_back_from_the_frames():
    """micro_step hands the critic the clips' frames, clip by clip (clips.frames_of); the Adversary folds them back
    (objective.clips_of, a view of the same memory) so that the 3D critic's own loss, R1 (per clip: the squared
    norm of the gradient over the whole clip, averaged over clips), LeCam and the generator's logits are those of
    the critic run on the clips themselves."""
    from objective import clips_of
    from critics import r1_penalty
    x_frames, recon_frames, x, recon = frames_and_clips()
    assert torch.equal(clips_of(x_frames, 5), x) and clips_of(x_frames, 5).data_ptr() == x_frames.data_ptr()
    adversary = clip_critic(r1_weight=2.0)
    d_loss, real_logits, fake_logits, logs = adversary.loss(x_frames, recon_frames, clip_frames=5)
    real = x.clone().requires_grad_(True)
    logits = adversary.critic(torch.cat([real, recon])).float()
    assert logits.shape[:3] == (4, 1, 2)  # clips of 5 frames: 2 temporal patches
    expected_real, expected_fake = logits.chunk(2)
    assert torch.equal(real_logits, expected_real.detach()) and torch.equal(fake_logits, expected_fake.detach())
    r1 = r1_penalty(expected_real, real)
    assert torch.equal(logs["gan/r1"], r1.detach())
    per_clip = torch.autograd.grad(expected_real.sum(), real)[0].pow(2).flatten(1).sum(1)
    assert torch.allclose(r1, per_clip.mean())
    hinge = discriminator_loss(expected_real, expected_fake, "hinge")
    lecam = 0.1 * adversary.lecam.penalty(expected_real, expected_fake)
    assert torch.allclose(d_loss, hinge + lecam + 1.0 * r1)
    assert torch.equal(adversary.generator_logits(recon_frames, 5), expected_fake.detach())


def test_the_3d_critic_takes_the_one_frame_clips_of_image_steps():
    """--video_image_prob's image steps: micro_step's clips of one frame (clip_frames 1), or images (0), are clips
    of one frame to the 3D critic, with its loss, R1 and generator term."""
    x_frames, recon_frames, _, _ = frames_and_clips(frames=1)
    adversary = clip_critic(r1_weight=1.0)
    for clip_frames in (1, 0):
        d_loss, real_logits, _, _ = adversary.loss(x_frames, recon_frames, clip_frames)
        assert real_logits.shape[:3] == (2, 1, 1) and torch.isfinite(d_loss)
        assert adversary.generator_logits(recon_frames, clip_frames).shape == real_logits.shape


@pytest.mark.parametrize("norm", ["batch", "group_spectral", "spectral", "none"])
def test_an_abandoned_step_restores_what_the_3d_critics_forward_moved(norm):
    """The out-of-memory rule (Adversary.step_began / abandon_step): the buffers a training-mode pass of the 3D
    critic moves (BatchNorm3d's statistics, spectral norm's power iteration) are all in moved_by_forward, and an
    abandoned step puts the critic's state back bitwise."""
    x_frames, recon_frames, _, _ = frames_and_clips()
    adversary = clip_critic(disc_norm=norm)
    before = {k: v.clone() for k, v in adversary.critic.state_dict().items()}
    adversary.step_began()
    adversary.loss(x_frames, recon_frames, clip_frames=5)
    adversary.generator_logits(recon_frames, 5)
    moved = {k for k, v in adversary.critic.state_dict().items() if not torch.equal(v, before[k])}
    tracked = {id(b) for b in adversary.moved_by_forward}
    buffers = dict(adversary.critic.named_buffers())
    assert moved <= set(buffers) and all(id(buffers[k]) in tracked for k in moved)
    assert bool(moved) == (norm != "none")
    adversary.abandon_step()
    assert all(torch.equal(v, before[k]) for k, v in adversary.critic.state_dict().items())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # the skipped step takes no optimizer step
@pytest.mark.parametrize("discriminator,norm", [("patchgan", "spectral"), ("patchgan", "batch"),
                                                ("patchgan3d", "group_spectral")])
def test_a_skipped_step_leaves_the_critic_as_it_found_it(discriminator, norm):
    """A non-finite step is skipped on every rank (the guard's device flag): the critic after it is the critic
    before it, bitwise, its buffers included: spectral norm's power iteration and BatchNorm's statistics, which the
    step's forward passes moved (before: they kept the move, and a NaN batch left BatchNorm's statistics NaN for
    good). A step taken moves them."""
    x_frames, recon_frames, _, _ = frames_and_clips()
    torch.manual_seed(0)
    adversary = objective_of(config(discriminator=discriminator, disc_norm=norm, video_frames=5),
                             with_lpips=False).adversary
    adversary.prepare_training(config().optim, lambda params, lr: torch.optim.AdamW(params, lr=lr))

    def step_optimizer(optimizer, scaler, bad):
        if not bad:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def a_step(bad: float) -> None:
        adversary.step_began()
        adversary.backward(x_frames, recon_frames, sync=True, accum=1, clip_frames=5)
        adversary.step(torch.full((), bad), step_optimizer)

    before = {k: v.clone() for k, v in adversary.critic.state_dict().items()}
    buffers = set(dict(adversary.critic.named_buffers()))
    a_step(1.0)
    assert [k for k, v in adversary.critic.state_dict().items() if not torch.equal(v, before[k])] == []
    a_step(0.0)
    moved = {k for k, v in adversary.critic.state_dict().items() if not torch.equal(v, before[k])}
    assert moved & buffers and moved - buffers  # the step's buffers and its weights


@pytest.mark.parametrize("r1", [0.0, 1.0])
def test_the_3d_critic_copies_no_activation_the_frame_critic_does_not(r1):
    """The copy census (bench.copies.CopyCensus, CPU kernels) of one micro-batch of clips through micro_step, the
    critic's step and the generator's term included: the 3D critic reads the clips micro_step folded its frames
    from, so it copies no more activation bytes than the frame critic (folding the frames back would copy the
    reconstruction into the (B, C, T, H, W) layout); its gradient reaches the reconstruction."""
    import latents as latents_lib
    from bench.copies import CopyCensus, parameter_shapes
    from objective import micro_step
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 5, 32, 32, generator=gen) * 2 - 1

    class Clips(torch.nn.Module):  # a stand-in VAE: its reconstruction and posterior are its parameters
        def __init__(self):
            super().__init__()
            self.recon = torch.nn.Parameter(x + 0.1 * torch.randn(x.shape, generator=gen))
            self.mean = torch.nn.Parameter(torch.randn(2, 4, 2, 8, 8, generator=gen))

        def forward(self, x, latent_transform=None, also_decode=None):
            return self.recon * 1, self.mean * 1, None, None, None

    copied = {}
    for critic in ("patchgan", "patchgan3d"):
        torch.manual_seed(0)
        objective = objective_of(config(discriminator=critic, video_frames=5, disc_start=0, r1_weight=r1,
                                        perceptual_weight=0, mse_pool_factor=4),
                                 with_lpips=False, z_channels=4)
        model = Clips()
        census = CopyCensus(parameter_shapes(objective.adversary.critic, model), cuda_layouts=False)
        with census:
            out = micro_step(objective, model, x, 0, 0, 1, True, latents_lib.LatentRegularisers(0), torch.ones(()),
                             None)
        assert "loss/gan_g" in out.logs and model.recon.grad.abs().sum() > 0
        copied[critic] = census.summary().get("copy/activation", {"mib": 0.0})["mib"]
    assert copied["patchgan3d"] <= copied["patchgan"], copied


@pytest.mark.parametrize("discriminator", ["patchgan", "patchgan3d"])
def test_spectral_norm_iterates_once_per_step_whatever_the_micro_batches(discriminator):
    """One rank carrying two ranks' share (two micro-batches: a run resumed on fewer GPUs) runs the step's critic as
    each of the two ranks does: one power iteration of spectral norm per step (not one per forward: the critic's
    pass and the generator's of every micro-batch), so the second micro-batch's logits and the u, v the step leaves
    equal those of the rank that held that micro-batch alone, bitwise."""
    import copy
    from config import CriticConfig
    from objective import Adversary, build_critic
    torch.manual_seed(0)
    cfg = CriticConfig(discriminator=discriminator, disc_norm="group_spectral")
    one_rank = Adversary(cfg, build_critic(cfg, None))
    second_rank = Adversary(cfg, copy.deepcopy(one_rank.critic))
    assert one_rank.spectral and len(one_rank.spectral) == len(second_rank.spectral)
    shape = (2, 3, 5, 32, 32) if discriminator == "patchgan3d" else (2, 3, 32, 32)
    x1, r1, x2, r2 = (torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in range(4))
    for step in range(2):  # (the second step: the iteration armed again)
        one_rank.step_began()
        one_rank.backward(x1, r1, sync=False, accum=2)
        one_rank.generator_logits(r1)
        _, real_logits, fake_logits, _ = one_rank.backward(x2, r2, sync=True, accum=2)
        one_rank.generator_logits(r2)
        second_rank.step_began()
        _, real_alone, fake_alone, _ = second_rank.backward(x2, r2, sync=True, accum=1)
        second_rank.generator_logits(r2)
        assert torch.equal(real_logits, real_alone) and torch.equal(fake_logits, fake_alone), step
        for a, b in zip(one_rank.moved_by_forward, second_rank.moved_by_forward):
            assert torch.equal(a, b), step
        assert not torch.equal(one_rank.moved_by_forward[0], one_rank.at_step_start[0])  # it did iterate
