"""Unit tests of utils.py: GradNorm (single process and 2 gloo ranks), pooled and low-pass MSE, the GAN losses,
LDM's adaptive weight, LeCam and the LR schedule. The critics and LPIPS: test_critics.py; weights: test_weights.py."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision

import utils
from conftest import record_ops
from utils import (GradNormFunction, LeCam, adaptive_gan_weight, cosine_with_warmup, discriminator_accuracy,
                   discriminator_loss, generator_active_fraction, generator_loss, gradnorm, lowpass_mask, lowpass_mse,
                   pooled_mse)

VGG16_CONV_INDICES = (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28)


# --------------------------------------------------------------------------------------------
# GradNorm
# --------------------------------------------------------------------------------------------
def test_gradnorm_forward_is_identity():
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    y = gradnorm(x, 0.3)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, x)


@pytest.mark.parametrize("weight", [0.1, 1.0, 2.5])
@pytest.mark.parametrize("upstream_scale", [1e-6, 1.0, 1e4])
def test_gradnorm_gradient_has_norm_weight(weight, upstream_scale):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    upstream = torch.randn(2, 3, 8, 8) * upstream_scale
    (gradnorm(x, weight) * upstream).sum().backward()
    g = x.grad
    assert torch.linalg.vector_norm(g).item() == pytest.approx(weight, rel=1e-5)
    assert F.cosine_similarity(g.flatten(), upstream.flatten(), dim=0).item() == pytest.approx(1.0, abs=1e-6)
    expected = weight * upstream.double() / torch.linalg.vector_norm(upstream.double())
    torch.testing.assert_close(g.double(), expected, rtol=1e-5, atol=1e-7 * weight)


def test_gradnorm_tensor_weight_and_bf16():
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    upstream = (torch.randn(4, 16) * 300).bfloat16()
    (gradnorm(x, torch.tensor(0.5)) * upstream).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert torch.linalg.vector_norm(x.grad.float()).item() == pytest.approx(0.5, rel=1e-2)
    # the weight is not a learnable input: no gradient flows to it
    w = torch.tensor(2.0, requires_grad=True)
    x2 = torch.randn(3, requires_grad=True)
    GradNormFunction.apply(x2, w).sum().backward()
    assert w.grad is None
    assert torch.linalg.vector_norm(x2.grad).item() == pytest.approx(2.0, rel=1e-6)


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # rank r's upstream gradient: the same direction pattern, very different norms
        upstream = torch.arange(1.0, 13.0).view(3, 4) * (1.0 if rank == 0 else 7.0) + rank
        x = torch.zeros(3, 4, requires_grad=True)
        (gradnorm(x, 0.8) * upstream).sum().backward()
        # LeCam anchors are averaged across ranks
        lecam = LeCam(decay=0.5)
        lecam.update(torch.full((4,), float(rank + 1)), torch.full((4,), -2.0 * (rank + 1)))
        lecam.commit(skip=torch.tensor(False))
        torch.save({"upstream": upstream, "grad": x.grad, "ema_real": lecam.ema_real.clone(),
                    "ema_fake": lecam.ema_fake.clone()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.process
@pytest.mark.timeout(180)  # two spawned gloo ranks: ~10-25 s
def test_gradnorm_and_lecam_on_two_gloo_ranks(tmp_path):
    """Under DDP each rank's micro-batch is normalised by its own norm (issue 34: a mean over the ranks computing at
    the same time tied a step's math to the world size), and LeCam's anchors move by the mean over the ranks."""
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    results = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    norms = [torch.linalg.vector_norm(r["upstream"].double()) for r in results]
    assert abs(norms[0] - norms[1]) > 50  # the ranks really differ
    for r, norm in zip(results, norms):
        torch.testing.assert_close(r["grad"].double(), 0.8 * r["upstream"].double() / norm, rtol=1e-6, atol=1e-9)
    for r in results:  # means over ranks: real (1 + 2) / 2, fake (-2 - 4) / 2
        assert r["ema_real"].item() == pytest.approx(1.5)
        assert r["ema_fake"].item() == pytest.approx(-3.0)


# --------------------------------------------------------------------------------------------
# pooled MSE
# --------------------------------------------------------------------------------------------
def test_pooled_mse_blind_to_zero_mean_pattern_at_pool_period():
    torch.manual_seed(0)
    image = torch.rand(2, 3, 16, 24) * 2 - 1
    tile = torch.randn(3, 4, 4)
    tile = tile - tile.mean(dim=(1, 2), keepdim=True)  # zero mean over each 4x4 pooling window
    pattern = tile.repeat(1, 4, 6)
    noisy = image + pattern
    assert pooled_mse(noisy, image, 4).item() == pytest.approx(0.0, abs=1e-10)
    plain = F.mse_loss(noisy, image).item()
    assert plain == pytest.approx(pattern.square().mean().item(), rel=1e-5) and plain > 0.1
    assert pooled_mse(noisy, image, 1).item() == pytest.approx(plain, rel=1e-6)
    # a pooling window smaller than the pattern's period sees it
    assert pooled_mse(noisy, image, 2).item() > 1e-3


@pytest.mark.parametrize("shift", [0.25, -0.5])
def test_pooled_mse_constant_shift(shift):
    image = torch.rand(1, 3, 16, 16)
    assert pooled_mse(image + shift, image, 4).item() == pytest.approx(shift ** 2, rel=1e-5)
    assert pooled_mse(image + shift, image, 8).item() == pytest.approx(shift ** 2, rel=1e-5)


def test_pooled_mse_fp32_under_autocast():
    """bf16 inputs (bf16-representable values): the pooling itself must run in fp32. Colours near 0.9 that
    differ by ~1e-2 have pooled means whose bf16 rounding (half an ulp: 2e-3) is of the size of the
    difference the loss measures."""
    torch.manual_seed(0)
    a = (0.9 + 0.05 * torch.rand(2, 3, 16, 16)).bfloat16()
    b = (a.float() + 0.01 * torch.randn(2, 3, 16, 16)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), record_ops() as ops:
        loss = pooled_mse(a, b, 4)
    assert loss.dtype == torch.float32
    assert not ops.low_precision(), ops.low_precision()
    reference = F.mse_loss(F.avg_pool2d(a.double(), 4), F.avg_pool2d(b.double(), 4)).item()
    assert loss.item() == pytest.approx(reference, rel=1e-5)


# --------------------------------------------------------------------------------------------
# low-pass mask and MSE
# --------------------------------------------------------------------------------------------
def half_flat_half_checker(h: int = 64, w: int = 64, flat_value: float = 0.0) -> torch.Tensor:
    """(1, 3, H, W): left half flat, right half a +-1 checkerboard (the highest frequency)."""
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    checker = ((yy + xx) % 2 * 2 - 1).float()
    img = torch.full((1, 3, h, w), flat_value)
    img[..., w // 2:] = checker[:, w // 2:]
    return img


@pytest.mark.parametrize("flat_value", [0.0, 0.8])
def test_lowpass_mask_flat_vs_checkerboard(flat_value):
    img = half_flat_half_checker(flat_value=flat_value)
    mask = lowpass_mask(img)
    assert mask.shape == (1, 1, 64, 64) and mask.dtype == torch.float32
    # away from the boundary (Laplacian radius 2 + blur radius 6) and from the image frame
    assert mask[..., 4:-4, 4:20].min().item() > 0.95
    assert mask[..., 40:].max().item() == 0.0
    assert ((mask == 0) | (mask >= 0.8)).all()
    assert mask.min().item() >= 0.0 and mask.max().item() <= 1.0


@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.95])
def test_lowpass_mask_range_and_threshold(threshold):
    torch.manual_seed(0)
    img = F.interpolate(torch.rand(2, 3, 8, 8) * 2 - 1, size=48, mode="bilinear") + 0.1 * torch.randn(2, 3, 48, 48)
    mask = lowpass_mask(img, threshold)
    assert mask.min().item() >= 0.0 and mask.max().item() <= 1.0 + 1e-6
    nonzero = mask[mask > 0]
    assert nonzero.numel() > 0 and (mask == 0).any()
    assert nonzero.min().item() >= threshold


def test_lowpass_mask_is_normalised_per_image():
    torch.manual_seed(1)
    # `a`: faint texture everywhere (its weakest edge is not 0); `b`: 4x stronger edges and a flat half
    a = half_flat_half_checker() + 0.05 * torch.randn(1, 1, 64, 64)
    b = 4.0 * half_flat_half_checker()
    alone = lowpass_mask(a)
    assert 0 < alone[..., :32].count_nonzero() < 64 * 32  # a non-trivial mask to compare
    batched = lowpass_mask(torch.cat([b, a]))
    torch.testing.assert_close(batched[1:], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(batched[:1], lowpass_mask(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [0.5, -1.0])
def test_lowpass_mask_flat_image_is_all_low_frequency(value):
    mask = lowpass_mask(torch.full((1, 3, 32, 32), value))
    assert mask.min().item() == pytest.approx(1.0)


def test_lowpass_mse_ignores_high_frequency_region_errors():
    target = half_flat_half_checker()
    mask = lowpass_mask(target)
    assert mask[..., 32:].sum().item() == 0.0  # nothing of the checkerboard half counts
    torch.manual_seed(0)
    error_hf = torch.zeros_like(target)
    error_hf[..., 32:] = torch.randn(1, 3, 64, 32)
    assert lowpass_mse(target + error_hf, target).item() == 0.0
    assert F.mse_loss(target + error_hf, target).item() > 0.4
    # a constant error d over the flat half: the mask-weighted mean is d^2
    error_flat = torch.zeros_like(target)
    error_flat[..., :32] = 0.3
    assert lowpass_mse(target + error_flat, target).item() == pytest.approx(0.09, rel=1e-5)
    # identical images: zero
    assert lowpass_mse(target, target).item() == 0.0


def test_lowpass_filters_are_buffers_and_the_blur_is_torchvisions():
    """The filters are non-persistent buffers (they move with .to(device) once, never per step, and stay out
    of checkpoints); the blur is torchvision's gaussian_blur (13x13, sigma 2, reflect padding) exactly."""
    module = utils.LowpassMSE()
    assert dict(module.named_buffers()).keys() == {"laplacian", "gaussian"} and not module.state_dict()
    torch.manual_seed(0)
    edges = torch.rand(2, 1, 40, 37)
    ours = F.conv2d(F.pad(edges, (6,) * 4, mode="reflect"), module.gaussian)
    torch.testing.assert_close(ours, torchvision.transforms.functional.gaussian_blur(edges, [13, 13], [2.0, 2.0]),
                               rtol=0, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # built under autocast (a one-off lowpass_mse call)
        assert utils.gaussian_kernel2d(13, 2.0).dtype == torch.float32


def test_lowpass_fp32_under_bf16_autocast():
    target = half_flat_half_checker().bfloat16()
    recon = (target.float() + 0.1).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mask = lowpass_mask(target)
        loss = lowpass_mse(recon, target)
    assert mask.dtype == torch.float32 and loss.dtype == torch.float32
    torch.testing.assert_close(mask, lowpass_mask(target.float()), rtol=0, atol=1e-6)
    assert loss.item() == pytest.approx(lowpass_mse(recon.float(), target.float()).item(), rel=1e-6)


# --------------------------------------------------------------------------------------------
# GAN losses
# --------------------------------------------------------------------------------------------
REAL = torch.tensor([2.0, 0.5, -1.0, 0.0])
FAKE = torch.tensor([-2.0, 0.0, 0.5, 3.0])


def _softplus(v: float) -> float:
    return math.log1p(math.exp(v))


def test_discriminator_loss_hinge():
    # relu(1 - real): [0, .5, 2, 1] -> 3.5 / 4;  relu(1 + fake): [0, 1, 1.5, 4] -> 6.5 / 4
    assert discriminator_loss(REAL, FAKE, "hinge").item() == pytest.approx(3.5 / 4 + 6.5 / 4, rel=1e-6)


def test_discriminator_loss_bce():
    expected = (sum(_softplus(-r) for r in REAL.tolist()) / 4 + sum(_softplus(f) for f in FAKE.tolist()) / 4)
    assert discriminator_loss(REAL, FAKE, "bce").item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError):
        discriminator_loss(REAL, FAKE, "wasserstein")


def test_discriminator_loss_fp32_for_bf16_logits():
    loss = discriminator_loss(REAL.bfloat16(), FAKE.bfloat16(), "hinge")
    assert loss.dtype == torch.float32


def test_generator_loss_thresholded_and_ldm():
    fake = FAKE.clone().requires_grad_(True)
    real = REAL.clone().requires_grad_(True)
    loss = generator_loss(fake, real, "thresholded", margin=0.1)
    # real - fake - 0.1 = [3.9, 0.4, -1.6, -3.1] -> relu -> 4.3 / 4
    assert loss.item() == pytest.approx(4.3 / 4, rel=1e-6)
    loss.backward()
    assert real.grad is None  # the real logits are a fixed target
    assert torch.equal(fake.grad, torch.tensor([-0.25, -0.25, 0.0, 0.0]))
    assert generator_loss(FAKE, REAL, "thresholded", margin=1.0).item() == pytest.approx((3.0 + 0.0) / 4)
    assert generator_loss(FAKE, None, "ldm").item() == pytest.approx(-1.5 / 4)
    # the classic GAN generator (BCE against "real"): log(1 + exp(-D(x_hat)))
    expected = sum(math.log1p(math.exp(-f)) for f in FAKE.tolist()) / 4
    assert generator_loss(FAKE, None, "nonsaturating").item() == pytest.approx(expected, rel=1e-6)
    assert generator_active_fraction(REAL, FAKE, "nonsaturating").item() == 1.0
    with pytest.raises(ValueError):
        generator_loss(FAKE, REAL, "wgan")


def test_discriminator_accuracy():
    # real > 0: 2 of 4 ; fake < 0: 1 of 4 -> 0.5 * (0.5 + 0.25)
    assert discriminator_accuracy(REAL, FAKE).item() == pytest.approx(0.375)
    assert discriminator_accuracy(torch.ones(3), -torch.ones(3)).item() == 1.0


def _tiny_generator():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, target = torch.randn(5, 4), torch.randn(5, 3)
    out = net(x)
    rec = F.mse_loss(out, target)
    return net, out, rec


def test_adaptive_gan_weight_formula():
    net, out, rec = _tiny_generator()
    gan = -(out * torch.tensor([0.3, -0.2, 0.5])).mean()
    w = net[2].weight
    g_rec = torch.autograd.grad(rec, w, retain_graph=True)[0]
    g_gan = torch.autograd.grad(gan, w, retain_graph=True)[0]
    expected = g_rec.norm().item() / (g_gan.norm().item() + 1e-4)
    weight = adaptive_gan_weight(rec, gan, w)
    assert weight.item() == pytest.approx(expected, rel=1e-5)
    assert not weight.requires_grad and weight.grad_fn is None
    assert weight.dtype == torch.float32
    # the graph was retained: the losses can still be backpropagated
    (rec + weight * gan).backward()
    assert w.grad is not None


def test_adaptive_gan_weight_clamped():
    net, out, rec = _tiny_generator()
    tiny_gan = -out.mean() * 1e-12
    assert adaptive_gan_weight(rec, tiny_gan, net[2].weight, max_weight=10.0).item() == 10.0
    assert adaptive_gan_weight(rec, tiny_gan, net[2].weight).item() <= 1e4
    # a gan loss that ignores the layer (zero gradient): rec / 1e-4, then the clamp
    zero_gan = (out * 0).sum()
    g_rec = torch.autograd.grad(rec, net[2].weight, retain_graph=True)[0]
    expected = min(g_rec.norm().item() / 1e-4, 1e4)
    assert adaptive_gan_weight(rec, zero_gan, net[2].weight).item() == pytest.approx(expected, rel=1e-5)


# --------------------------------------------------------------------------------------------
# LeCam
# --------------------------------------------------------------------------------------------
def test_lecam_penalty_on_hand_values():
    lecam = LeCam()
    lecam.ema_real.fill_(0.5)
    lecam.ema_fake.fill_(-0.5)
    real = torch.tensor([1.0, -1.0, 0.0])
    fake = torch.tensor([0.0, 1.0, -2.0])
    # relu(real - ema_fake)^2: [1.5, 0, 0.5]^2 -> 2.5 / 3 ; relu(ema_real - fake)^2: [0.5, 0, 2.5]^2 -> 6.5 / 3
    assert lecam.penalty(real, fake).item() == pytest.approx(2.5 / 3 + 6.5 / 3, rel=1e-6)


GOOD = torch.tensor(0.0)  # the guard's per-step flag: 0 = the step is taken


def test_lecam_update_ema():
    lecam = LeCam(decay=0.9)
    assert not bool(lecam.initialized)
    lecam.update(torch.tensor([1.0, 3.0]), torch.tensor([-4.0, 0.0]))
    lecam.commit(skip=GOOD)
    assert bool(lecam.initialized)
    assert lecam.ema_real.item() == pytest.approx(2.0) and lecam.ema_fake.item() == pytest.approx(-2.0)
    lecam.update(torch.tensor([12.0]), torch.tensor([8.0]))
    lecam.commit(skip=GOOD)
    assert lecam.ema_real.item() == pytest.approx(0.9 * 2.0 + 0.1 * 12.0)
    assert lecam.ema_fake.item() == pytest.approx(0.9 * -2.0 + 0.1 * 8.0)


def test_lecam_penalty_uses_this_steps_anchors_and_a_skipped_step_keeps_the_old_ones():
    """The penalty of a step sees the anchors updated with its own logits (as LeCam's reference code);
    they become the saved anchors only when the guard takes the step. A NaN step (an fp16 overflow in the
    reconstruction) is skipped and leaves them as they were, finite: the next steps train normally."""
    lecam = LeCam(decay=0.9)
    lecam.update(torch.tensor([1.0]), torch.tensor([-1.0]))
    lecam.commit(skip=GOOD)
    real, fake = torch.tensor([0.0]), torch.tensor([0.0])
    lecam.update(torch.tensor([11.0]), torch.tensor([-11.0]))
    # pending anchors: real 0.9 * 1 + 0.1 * 11 = 2, fake -2 -> relu(0 + 2)^2 + relu(2 - 0)^2
    assert lecam.penalty(real, fake).item() == pytest.approx(8.0)
    lecam.commit(skip=torch.tensor(1.0))  # the guard rejected the step
    assert (lecam.ema_real.item(), lecam.ema_fake.item()) == (1.0, -1.0)
    assert lecam.penalty(real, fake).item() == pytest.approx(2.0)

    lecam.update(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert math.isnan(lecam.penalty(real, fake).item())  # this step's critic loss: non-finite, skipped
    lecam.commit(skip=torch.tensor(1.0))
    assert (lecam.ema_real.item(), lecam.ema_fake.item()) == (1.0, -1.0)
    lecam.update(torch.tensor([11.0]), torch.tensor([-11.0]))
    lecam.commit(skip=GOOD)
    assert lecam.ema_real.item() == pytest.approx(2.0) and lecam.ema_fake.item() == pytest.approx(-2.0)


def test_lecam_micro_batches_of_the_first_step_set_the_anchors_to_their_mean():
    """With --grad_accum the first step's anchors are the mean of its micro-batches' logits (in any order and on any
    number of ranks: issue 34), committed with the step."""
    lecam = LeCam(decay=0.9)
    lecam.update(torch.tensor([1.0]), torch.tensor([-1.0]))
    lecam.update(torch.tensor([11.0]), torch.tensor([9.0]))
    lecam.commit(skip=GOOD)
    assert lecam.ema_real.item() == pytest.approx(6.0) and lecam.ema_fake.item() == pytest.approx(4.0)


def test_lecam_first_step_skipped_leaves_anchors_unset():
    lecam = LeCam(decay=0.9)
    lecam.update(torch.tensor([float("inf")]), torch.tensor([5.0]))
    lecam.commit(skip=torch.tensor(1.0))
    assert not bool(lecam.initialized)
    lecam.update(torch.tensor([3.0]), torch.tensor([-3.0]))  # the first good step sets the anchors
    lecam.commit(skip=GOOD)
    assert (lecam.ema_real.item(), lecam.ema_fake.item()) == (3.0, -3.0) and bool(lecam.initialized)


def test_lecam_state_dict_round_trip():
    lecam = LeCam(decay=0.9)
    for real, fake in ((1.0, -1.0), (3.0, 1.0)):
        lecam.update(torch.tensor([real]), torch.tensor([fake]))
        lecam.commit(skip=GOOD)
    state = lecam.state_dict()
    assert set(state) == {"ema_real", "ema_fake", "initialized"}
    fresh = LeCam(decay=0.9)
    fresh.load_state_dict(state)
    for name in ("ema_real", "ema_fake", "initialized"):
        assert torch.equal(getattr(fresh, name), getattr(lecam, name)), name
    # the restored one continues the EMA rather than re-seeding its anchors
    for m in (lecam, fresh):
        m.update(torch.tensor([5.0]), torch.tensor([5.0]))
        m.commit(skip=GOOD)
    assert fresh.ema_real.item() == pytest.approx(lecam.ema_real.item())
    assert fresh.ema_real.item() == pytest.approx(0.9 * (0.9 * 1 + 0.1 * 3) + 0.1 * 5)


# --------------------------------------------------------------------------------------------
# schedule
# --------------------------------------------------------------------------------------------
def test_cosine_with_warmup():
    f = cosine_with_warmup(warmup_steps=10, total_steps=110, min_ratio=0.1)
    warm = [f(s) for s in range(10)]
    assert warm == pytest.approx([(s + 1) / 10 for s in range(10)])  # linear
    assert f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert f(110) == pytest.approx(0.1)
    assert f(111) == pytest.approx(0.1) and f(10_000) == pytest.approx(0.1)
    decay = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    no_warmup = cosine_with_warmup(0, 100)
    assert no_warmup(0) == pytest.approx(1.0) and no_warmup(100) == pytest.approx(0.0, abs=1e-12)
