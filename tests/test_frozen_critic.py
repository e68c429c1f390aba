"""Issue 19 wired in: --critic_trunk frozen through the objective and the trainer (one LPIPS VGG16 pass per image
serves LPIPS, the critic's step and the generator term; each GradNorm branch still normalised on its own), and
the stabiliser flags reaching the step. The pieces themselves: tests/test_critics.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from config import resolve_auto, unflatten, with_values
from conftest import cut_after, run_cli
from conftest import objective_of
from critics import FeatureCriticHeads, vgg16_features
from utils import generator_active_fraction, generator_loss, gradnorm
from objective import MicroBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(**changes):
    cfg = unflatten(dict(dataset_url="unused", vae_resolution=32, mse_pool_factor=4, vgg16_weights="random",
                         do_ganloss=True, critic_trunk="frozen", disc_start=2))
    return resolve_auto(with_values(cfg, **changes))


def use_config(objective, cfg) -> None:
    """The objective reads these sections from now on (it reads them at every call)."""
    objective.loss_cfg, objective.latents_cfg, objective.adversary.cfg = cfg.loss, cfg.latents, cfg.critic


def inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1
    recon = (x + 0.3 * torch.randn(x.shape, generator=gen)).clamp(-1, 1).requires_grad_()
    mean = torch.randn(2, 4, 8, 8, generator=gen).requires_grad_()
    return x, recon, mean


def past_neutral_start(heads: FeatureCriticHeads) -> None:
    torch.manual_seed(5)
    for head in heads.heads:
        torch.nn.init.normal_(head[-1].weight)


def test_shared_pass_gives_the_vae_the_gradient_of_separate_passes():
    """The objective with one shared trunk pass: the gradient at the reconstruction equals pixel + KL plus LPIPS
    and the generator term on their own trunk passes, each through its own GradNorm (loss scale 8, grad_accum 2,
    the thresholded target's sqrt(active fraction) with half the patches active)."""
    torch.manual_seed(0)
    objective = objective_of(config(), None)
    heads = objective.critic
    assert isinstance(heads, FeatureCriticHeads)
    past_neutral_start(heads)
    heads.eval().requires_grad_(False)  # eval: spectral norm's power iteration would move between the two passes
    x, recon, mean = inputs()
    scale, accum, step = torch.tensor(8.0), 2, 5
    with torch.no_grad():
        real_logits = heads(vgg16_features(objective.lpips, x))
        fake_logits = real_logits - torch.tensor([1.0, -1.0]).repeat(4).view_as(real_logits)  # half above margin
    cfg = config()
    active = generator_active_fraction(real_logits, fake_logits, cfg.loss.gen_loss, cfg.loss.gan_margin)
    assert 0 < active.item() < 1

    loss, logs = objective(MicroBatch(x, recon, mean, None, step, real_logits, fake_logits, accum, loss_scale=scale))
    shared = torch.autograd.grad(loss, recon)[0]

    use_config(objective, with_values(cfg, perceptual_weight=0.0, disc_start=10**6))  # pixel + KL only
    rest, _ = objective(MicroBatch(x, recon, mean, None, step, real_logits, fake_logits, accum, loss_scale=scale))
    use_config(objective, cfg)
    perceptual = objective.lpips(gradnorm(recon, scale * cfg.loss.perceptual_weight / accum), x).mean()
    g_in = gradnorm(recon, scale * cfg.loss.gan_weight * active.sqrt() / accum)
    g_loss = generator_loss(heads(vgg16_features(objective.lpips, g_in)), real_logits, cfg.loss.gen_loss,
                            cfg.loss.gan_margin)
    separate = torch.autograd.grad(rest + scale * (perceptual + g_loss), recon)[0]
    torch.testing.assert_close(shared, separate, rtol=1e-5, atol=1e-8)
    # the logged values are the separate passes' values
    torch.testing.assert_close(logs["loss/perceptual"], perceptual.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(logs["loss/gan_g"], g_loss.detach(), rtol=1e-6, atol=0)


@pytest.mark.process
def test_frozen_critic_in_the_trainer_one_trunk_pass_each_heads_train(shard_url, tmp_path, monkeypatch):
    """Through the real Trainer: two trunk passes per micro-batch (images, reconstructions), also with LPIPS off;
    the critic's optimizer holds the heads only; the heads move; a checkpoint holds them."""
    from test_trainer import in_process_trainer
    for extra in ([], ["--perceptual_weight", "0"]):
        trainer = in_process_trainer(shard_url, tmp_path / str(len(extra)), "--do_ganloss", "--critic_trunk",
                                     "frozen", "--disc_start", "1", "--max_steps", "2", "--grad_accum", "2",
                                     "--save_every_n_steps", "2", "--log_every_n_steps", "1", *extra)
        try:
            heads = trainer.adversary.critic
            assert isinstance(heads, FeatureCriticHeads)
            optimized = {id(p) for group in trainer.adversary.optimizer.param_groups for p in group["params"]}
            assert optimized == {id(p) for p in heads.parameters()}
            before = {n: p.detach().clone() for n, p in heads.named_parameters()}
            passes = []
            trainer.objective.lpips.net.register_forward_hook(lambda *a: passes.append(1))
            assert trainer.train() == 0
            assert len(passes) == 2 * 2 * 2  # 2 steps x 2 micro-batches x (images, reconstructions)
            assert all(not torch.equal(before[n], p) for n, p in heads.named_parameters() if n.endswith("weight_orig"))
        finally:
            trainer.close()
    ckpt = torch.load(next((tmp_path / "0").rglob("step_00000002.pt")), weights_only=True)
    assert ckpt["run"]["config"]["critic_trunk"] == "frozen" and "heads.0.0.weight_orig" in ckpt["adversary"]["critic"]


def test_frozen_critic_with_autocast_checkpointing_and_latent_regularisers(shard_url, tmp_path, one_torch_thread):
    """Issue 19 item 2: the frozen critic beside the rest of the step: bf16 autocast, gradient checkpointing of
    every level, accumulation, the additive scale-equivariance term, latent noise, R1 on the features and the GAN
    ramp. Both steps finite, the heads train, no step skipped. (fp16 passes too but takes a minute: CPU fp16
    convolutions through VGG16 are slow.)"""
    from test_trainer import in_process_trainer
    trainer = in_process_trainer(shard_url, tmp_path, "--do_ganloss", "--critic_trunk", "frozen", "--disc_start", "1",
                                 "--max_steps", "2", "--grad_accum", "2", "--save_every_n_steps", "100",
                                 "--log_every_n_steps", "1", "--precision", "bf16", "--grad_checkpointing", "all",
                                 "--scale_equivariance_prob", "1", "--scale_equivariance_form", "add",
                                 "--latent_noise_prob", "0.5", "--r1_weight", "1", "--gan_ramp_steps", "4")
    try:
        heads = trainer.adversary.critic
        before = {n: p.detach().clone() for n, p in heads.named_parameters()}
        assert trainer.train() == 0
        assert all(not torch.equal(before[n], p) for n, p in heads.named_parameters() if n.endswith("weight_orig"))
        assert all(torch.isfinite(p).all() for p in trainer.vae.parameters())
        records = [json.loads(line) for line in (tmp_path / "vae" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss/total" in r]
        assert [r["step"] for r in steps] == [1, 2]
        assert all(math.isfinite(r["loss/total"]) and math.isfinite(r["loss/disc"]) for r in steps), steps
        assert all(r["guard/bad_steps_total"] == 0 and r["guard/skipped_vae"] == 0 and r["guard/skipped_disc"] == 0
                   for r in steps), steps
    finally:
        trainer.close()


def test_stabiliser_flags_reach_the_step():
    """--gan_ramp_steps scales the generator term's weight; --r1_weight adds gamma/2 * R1 to the critic's loss (on
    the features when frozen); --diffaug changes what the trainable critic sees."""
    torch.manual_seed(0)
    objective = objective_of(config(), None)
    past_neutral_start(objective.critic)
    objective.critic.eval()  # spectral norm's power iteration would change the critic between the calls compared
    x, recon, mean = inputs()
    with torch.no_grad():
        real_logits = objective.critic(vgg16_features(objective.lpips, x))
    fake_logits = real_logits - 1

    def gan_logs(**changes):
        use_config(objective, config(**changes))
        return objective(MicroBatch(x, recon, mean, None, 3, real_logits, fake_logits))[1]
    full, ramped = gan_logs(), gan_logs(gan_ramp_steps=8)  # step 3 = disc_start + 1: 2/8 of the weight
    torch.testing.assert_close(ramped["loss/gan_g"], full["loss/gan_g"])
    torch.testing.assert_close(ramped["loss/total"] - full["loss/total"],
                               (0.25 - 1) * config().loss.gan_weight * full["loss/gan_g"], rtol=1e-5, atol=1e-7)

    adversary = objective.adversary
    shared = objective.shared_trunk_pass(x, recon, 3)
    d_plain = adversary.loss(shared.x_features, shared.recon_features)
    adversary.cfg = dataclasses.replace(adversary.cfg, r1_weight=10.0)  # (a CriticConfig)
    d_r1 = adversary.loss(shared.x_features, shared.recon_features)
    assert d_r1[3]["gan/r1"] > 0
    torch.testing.assert_close(d_r1[0], d_plain[0] + 5.0 * d_r1[3]["gan/r1"])

    trainable = objective_of(config(critic_trunk="trainable", diffaug="translation,cutout"), None)
    for head in trainable.critic.heads:  # past the neutral start
        torch.nn.init.normal_(head[-1].weight)
    plain_logits = trainable.critic(x)
    torch.manual_seed(1)
    augmented_logits = trainable.adversary.generator_logits(x)
    assert not torch.allclose(augmented_logits, plain_logits)


@pytest.mark.process
@pytest.mark.timeout(480)
def test_frozen_critic_two_ranks_stopped_and_resumed_equals_uninterrupted(shard_url, tmp_path):
    """2 gloo ranks, frozen critic, R1 and the ramp on: the heads stay equal on both ranks (the critic's DDP);
    its step-2 checkpoint (the heads have trained twice, the generator's term from --disc_start 1 once) continued by
    the same command (conftest.cut_after); the final checkpoint (VAE, EMA, heads, optimizers, LeCam) equals the
    uninterrupted run's bitwise."""
    from test_fault_tolerance import _args, _assert_same_state, _ckpt
    frozen = ["--do_ganloss", "--critic_trunk", "frozen", "--disc_start", "1", "--lecam_weight", "0.1",
              "--r1_weight", "1", "--gan_ramp_steps", "4"]
    ref = run_cli("vae_trainer.py", _args(shard_url, tmp_path, "ref", 3, 2, *frozen), nproc=2)
    assert ref.returncode == 0, ref.stderr[-2000:]
    cut_after(tmp_path / "ref", tmp_path / "cut", 2)
    again = run_cli("vae_trainer.py", _args(shard_url, tmp_path, "cut", 3, 100, *frozen), nproc=2)
    assert again.returncode == 0 and "at step 2" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    _assert_same_state(_ckpt(tmp_path, "ref", 3), _ckpt(tmp_path, "cut", 3))
    assert _ckpt(tmp_path, "ref", 3)["run"]["critic_in_sync"] is True  # DDP kept the heads equal on both ranks


@pytest.mark.parametrize("changes, message", [
    (dict(discriminator="patchgan"), "--critic_trunk frozen needs --discriminator vgg16"),
    (dict(diffaug="color"), "--diffaug needs --critic_trunk trainable"),
    (dict(critic_trunk="trainable", diffaug="color,flip"), "--diffaug color,flip: unknown flip"),
])
def test_critic_flags_a_user_can_get_wrong_are_refused_in_one_line(changes, message):
    from common import ConfigError
    with pytest.raises(ConfigError, match=message) as error:
        config(**changes).validate()
    assert "\n" not in str(error.value)


def reference_gan_step(vae, critic, lecam, lpips, x, noise_state, *, perceptual_weight, mse_weight, gan_weight,
                       kl_weight, lecam_weight, pool, posterior_var):
    """The gradients of one step of the reference trainer's GAN recipe, written out from its definitions and the
    loss networks alone (none of objective.py, train_state.py or vae_trainer.py): the critic (trainable VGG16) on
    real vs detached reconstructions with the hinge loss and LeCam; then, the critic frozen, each generator branch
    (LPIPS, pooled + low-pass MSE, -mean D(x_hat)) behind its own GradNorm at its weight, and the latent penalty
    summed over the latent and divided by the square root of its size. Returns ({name: grad} of the VAE, of the
    critic)."""
    import torch.nn.functional as F

    from utils import LowpassMSE, pooled_mse
    torch.set_rng_state(noise_state)  # the posterior noise the trainer's step drew
    mean = vae.encoder(x)
    recon = vae.decoder(mean.float() + math.sqrt(posterior_var) * torch.randn(mean.shape)).float()
    real, fake = critic(torch.cat([x, recon.detach()])).float().chunk(2)
    lecam.update(real, fake)
    d_loss = F.relu(1 - real).mean() + F.relu(1 + fake).mean() + lecam_weight * lecam.penalty(real, fake)
    d_loss.backward()
    critic.requires_grad_(False)
    perceptual = lpips(gradnorm(recon, perceptual_weight), x).float().mean()
    pixel_in = gradnorm(recon, mse_weight)
    pixel = pooled_mse(pixel_in, x, pool) + LowpassMSE()(pixel_in, x)
    adversarial = -critic(gradnorm(recon, gan_weight)).float().mean()
    latent_penalty = kl_weight * 0.5 * mean.float().square().sum() / math.sqrt(mean.numel())
    (perceptual + pixel + adversarial + latent_penalty).backward()
    critic.requires_grad_(True)
    grads = [{n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None} for net in (vae, critic)]
    return tuple(grads)


@pytest.mark.process
def test_the_trainable_critic_step_is_the_reference_recipe(shard_url, tmp_path):
    """Issue 19 (--critic_trunk trainable, the default, is the reference's critic, unchanged by the frozen trunk's
    arrival), as a comparison computed in this process (issue 23 item 8: numbers pinned on one CPU failed on
    another): the trainer's step 1 (the critic trains from step 0, moving its zero-initialised heads; the generator
    term from step 1) gives the VAE and the critic the gradients of the recipe written out from its definitions
    (reference_gan_step), on copies of the same weights, batch and noise. Bitwise on the machine it was written on;
    to 1e-5 of each gradient's norm elsewhere (another order of the same fp32 sums, channels-last convolutions).
    Seen red: --gan_weight 0.45 in the reference only (1.8e-2 of a norm), LeCam left out of it (6e-4)."""
    import copy

    import vae_trainer
    from test_trainer import in_process_trainer
    gan_weight, lecam_weight = 0.5, 1.0
    trainer = in_process_trainer(shard_url, tmp_path, "--do_ganloss", "--disc_start", "1", "--lecam_weight",
                                 str(lecam_weight), "--learning_rate_disc", "1e-4", "--gen_loss", "ldm",
                                 "--gan_weight", str(gan_weight), "--grad_clip", "0", "--max_steps", "4")
    cfg, captured = trainer.cfg, {}
    try:
        batches = [next(trainer.loader) for _ in range(2)]
        trainer.train_step([batches[0]])
        trainer.step = 1
        copies = [copy.deepcopy(m) for m in (trainer.vae, trainer.adversary.critic, trainer.adversary.lecam)]
        torch.manual_seed(vae_trainer.micro_seed(cfg.optim.seed, 1, 0))  # what the step seeds its noise with
        noise_state = torch.get_rng_state()
        step_optimizer = trainer.guarded_step

        def capture(optimizer, scaler, bad):  # the VAE's optimizer steps first, then the critic's
            net = trainer.vae if optimizer is trainer.training.optimizer else trainer.adversary.critic
            captured[net] = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            step_optimizer(optimizer, scaler, bad)
        trainer.guarded_step = capture
        trainer.train_step([batches[1]])
    finally:
        trainer.close()
    import data as data_lib
    x = data_lib.to_model_input(batches[1], torch.device("cpu"), channels_last=False)
    expected_vae, expected_critic = reference_gan_step(
        *copies, trainer.objective.lpips, x, noise_state, perceptual_weight=cfg.loss.perceptual_weight,
        mse_weight=cfg.loss.mse_weight, gan_weight=gan_weight, kl_weight=cfg.loss.kl_weight, lecam_weight=lecam_weight,
        pool=cfg.loss.mse_pool_factor, posterior_var=cfg.model.posterior_var)
    for got, expected in ((captured[trainer.vae], expected_vae), (captured[trainer.adversary.critic], expected_critic)):
        assert got.keys() == expected.keys()
        for name, grad in expected.items():
            scale = torch.linalg.vector_norm(grad).item()
            assert scale > 0, name  # every weight takes part: the trunk trains, the heads left zero
            difference = torch.linalg.vector_norm(got[name] - grad).item()
            assert difference <= 1e-5 * scale + 1e-12, (name, difference, scale)
