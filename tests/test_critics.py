"""critics.py: the VGG16 discriminator and the PatchGAN; the frozen-trunk critic's building blocks (issue 19): LPIPS'
VGG16 features shared with the critic, LPIPS from those features, the feature heads, DiffAugment, R1 and the
generator term's ramp; LPIPS itself (its backbone's weights, its frozen pass). VGG16 networks are random (no
internet here)."""
from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import critics
from critics import (DISC_NORMS, FeatureCriticHeads, NLayerDiscriminator, VGG16Discriminator, VGG16_SLICES,
                     build_lpips, diff_augment, lpips_from_features, r1_penalty, vgg16_features)
from utils import gan_ramp, generator_loss, gradnorm, gradnorm_branches_through_one_pass


@pytest.fixture(scope="module")
def vgg_weights() -> dict:
    """A VGG16 `features` state dict that is not LPIPS' own random init: both networks must load it."""
    generator = torch.Generator().manual_seed(7)
    features = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["D"]).state_dict()
    return {key: torch.randn(value.shape, generator=generator) * (2 / value[0].numel()) ** 0.5
            for key, value in features.items()}


@pytest.fixture(scope="module")
def lpips_model(vgg_weights):
    return build_lpips(vgg_weights)


def images(n=2, size=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=generator) * 2 - 1


def test_lpips_features_are_the_critic_trunks_features(lpips_model, vgg_weights):
    """The same VGG16 cut at the same five relus: with LPIPS' scaling constants (its rounded -.030/.088/.188
    differ from ImageNetScaling's 2 * mean - 1 by up to 3e-8) the critic's trunk gives the same tensors, bitwise.
    With its own constants, close: the inputs differ by at most 3e-8 / 0.45 (7e-8, ~5e-8 of their norm); a
    Kaiming-initialised conv-ReLU stack carries a perturbation's relative size through about unchanged, and the
    different inputs round differently in each of the 13 convolutions (fp32, fan-in up to 4608: ~1e-6 of the norm
    each at worst, 4e-6 over 13 as independent errors). So each feature map is within 1e-4 of LPIPS' in norm, 25x
    that worst case (6e-7 measured): a bound on the arithmetic, not one CPU's kernels (an elementwise 1e-5 failed
    on an AMD EPYC, at 2.6e-5 on features of size 20)."""
    critic = VGG16Discriminator(vgg_weights)
    x = images()
    with torch.no_grad():
        lpips_feats = vgg16_features(lpips_model, x)
        h = critic.scaling(x)
        close_feats = []
        for block in critic.slices:
            h = block(h)
            close_feats.append(h)
        critic.scaling.shift.copy_(lpips_model.scaling_layer.shift)
        h = critic.scaling(x)
        same_feats = []
        for block in critic.slices:
            h = block(h)
            same_feats.append(h)
    assert [f.shape[1] for f in lpips_feats] == [64, 128, 256, 512, 512]
    assert [f.shape[-1] for f in lpips_feats] == [64, 32, 16, 8, 4]
    for ours, theirs, near in zip(lpips_feats, same_feats, close_feats):
        assert torch.equal(ours, theirs)
        assert (near - ours).norm() <= 1e-4 * ours.norm(), ((near - ours).norm() / ours.norm()).item()
    assert len(VGG16_SLICES) == len(lpips_feats)


def test_lpips_from_one_trunk_pass_per_image_equals_lpips(lpips_model):
    x, recon = images(seed=1), images(seed=2).requires_grad_(True)
    expected = lpips_model(recon, x)
    (grad_expected,) = torch.autograd.grad(expected.sum(), recon)
    with torch.no_grad():
        x_feats = vgg16_features(lpips_model, x)
    recon_feats = vgg16_features(lpips_model, recon)
    value = lpips_from_features(lpips_model, recon_feats, x_feats)
    (grad,) = torch.autograd.grad(value.sum(), recon)
    assert value.shape == expected.shape == (2, 1, 1, 1)
    assert torch.equal(value, expected)
    assert torch.equal(grad, grad_expected)
    assert (value > 0).all()


def test_gradnorm_per_branch_through_one_shared_pass_equals_separate_passes(lpips_model):
    """Issue 19's exactness: LPIPS and the generator term from one trunk pass over the reconstruction give the
    VAE (here a conv standing in for the decoder) the gradient of the two branches on separate passes, each
    normalised to its own weight; the two branches' raw gradients differ in size by orders of magnitude."""
    torch.manual_seed(0)
    decoder = torch.nn.Conv2d(3, 3, 3, padding=1)
    heads = FeatureCriticHeads(width=16).eval().requires_grad_(False)
    for head in heads.heads:
        torch.nn.init.normal_(head[-1].weight)
    x, z = images(seed=8, size=32), images(seed=9, size=32)
    with torch.no_grad():
        x_feats = vgg16_features(lpips_model, x)
        real_logits = heads(x_feats)
    w_lpips, w_gan = 1.0, 0.35

    def branches(recon_lpips, recon_gan):
        perceptual = lpips_from_features(lpips_model, vgg16_features(lpips_model, recon_lpips), x_feats).mean()
        g_loss = generator_loss(heads(vgg16_features(lpips_model, recon_gan)), real_logits, "ldm")
        return perceptual, g_loss

    recon = decoder(z)
    separate = sum(branches(gradnorm(recon, w_lpips), gradnorm(recon, w_gan)))
    expected = torch.autograd.grad(separate, decoder.weight)[0]

    recon = decoder(z)
    leaf = recon.detach().requires_grad_(True)
    recon_feats = vgg16_features(lpips_model, leaf)
    perceptual = lpips_from_features(lpips_model, recon_feats, x_feats).mean()
    g_loss = generator_loss(heads(recon_feats), real_logits, "ldm")
    surrogate = gradnorm_branches_through_one_pass(recon, leaf, [(perceptual, w_lpips), (g_loss, w_gan)])
    shared = torch.autograd.grad(surrogate, decoder.weight)[0]
    torch.testing.assert_close(shared, expected, rtol=1e-5, atol=1e-7)
    assert decoder.weight.grad is None and not any(p.grad is not None for p in heads.parameters())


def test_feature_heads_shape_neutral_start_and_what_trains(lpips_model):
    heads = FeatureCriticHeads(width=32)
    feats = vgg16_features(lpips_model, images(size=64))
    logits = heads(feats)
    assert logits.shape == (2, 1, 4, 4)  # one logit per 16x16 patch, as VGG16Discriminator's
    assert torch.equal(logits, torch.zeros_like(logits))
    # the random channel projections are fixed (buffers, saved with the critic), the heads train
    assert len(heads.projections()) == 4 and all(not p.requires_grad for p in heads.projections())
    assert {name.split(".")[0] for name, _ in heads.named_parameters()} == {"heads"}
    assert all(f"projection{i}" in heads.state_dict() for i in range(4))
    torch.testing.assert_close(FeatureCriticHeads(width=32).projection0, heads.projection0, rtol=0, atol=0)


def test_feature_heads_see_every_depth_but_relu1_2(lpips_model):
    heads = FeatureCriticHeads(width=16)
    for head in heads.heads:  # past the neutral start
        torch.nn.init.normal_(head[-1].weight)
    feats = [f.detach().requires_grad_(True) for f in vgg16_features(lpips_model, images(size=32))]
    heads(feats).sum().backward()
    assert feats[0].grad is None
    assert all(f.grad is not None and f.grad.abs().sum() > 0 for f in feats[1:])
    # cross-scale mixing: relu2_2's head alone still feels relu5_3 (through the upsampled projection)
    heads.zero_grad()
    feats = [f.detach().requires_grad_(True) for f in feats]
    heads.heads[0](heads.mix(feats)[0]).sum().backward()
    assert feats[4].grad.abs().sum() > 0


def test_feature_heads_cost_little_next_to_the_trunk(lpips_model):
    from torch.utils.flop_counter import FlopCounterMode
    x = images(n=1, size=128)
    with FlopCounterMode(display=False) as trunk:
        feats = vgg16_features(lpips_model, x)
    with FlopCounterMode(display=False) as head:
        FeatureCriticHeads()(feats)
    assert head.get_total_flops() < 0.1 * trunk.get_total_flops()


def test_diff_augment_translation_is_a_shift_with_zero_fill():
    torch.manual_seed(0)
    x = images(n=8, size=16, seed=3)
    out = diff_augment(x, "translation")
    for image, shifted in zip(x, out):
        matches = []
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                expected = torch.zeros_like(image)
                src = image[:, max(0, -dy):16 - max(0, dy), max(0, -dx):16 - max(0, dx)]
                expected[:, max(0, dy):16 - max(0, -dy), max(0, dx):16 - max(0, -dx)] = src
                matches.append(torch.equal(shifted, expected))
        assert sum(matches) == 1
    assert not torch.equal(out, x)


def test_diff_augment_cutout_zeros_a_half_size_square():
    torch.manual_seed(0)
    x = images(n=16, size=16, seed=4).abs() + 0.1  # no zeros of its own
    out = diff_augment(x, "cutout")
    zeroed = (out == 0).all(dim=1)
    kept = ~zeroed
    assert torch.equal(out * kept.unsqueeze(1), x * kept.unsqueeze(1))
    counts = zeroed.flatten(1).sum(1)
    assert (counts <= 64).all() and (counts > 0).all() and (counts == 64).any()  # 8x8, clipped at borders


def test_diff_augment_colour_is_per_image_and_differentiable():
    torch.manual_seed(0)
    same = images(n=1, size=16, seed=5).repeat(4, 1, 1, 1).requires_grad_(True)
    out = diff_augment(same, "color")
    means = out.detach().mean(dim=[1, 2, 3])
    assert len(set(means.tolist())) == 4  # every image draws its own brightness / saturation / contrast
    (out * torch.randn_like(out)).sum().backward()
    assert same.grad.abs().sum() > 0
    full = diff_augment(same)
    full.sum().backward()
    assert torch.isfinite(same.grad).all()


def test_diff_augment_unknown_policy_is_one_line():
    with pytest.raises(ValueError) as info:
        diff_augment(images(), "color,zoom")
    assert "zoom" in str(info.value) and "\n" not in str(info.value)


def test_r1_penalty_on_a_linear_critic_and_its_gradient():
    """logits = <w, f>: the gradient at f is w, so R1 = ||w||^2 and its gradient with respect to w is 2w."""
    w = torch.randn(3, 4, 4, requires_grad=True)
    features = torch.randn(5, 3, 4, 4, requires_grad=True)
    logits = (features * w).flatten(1).sum(1, keepdim=True)
    penalty = r1_penalty(logits, [features])
    torch.testing.assert_close(penalty, w.detach().pow(2).sum())
    (grad_w,) = torch.autograd.grad(penalty, w)
    torch.testing.assert_close(grad_w, 2 * w.detach())


def test_r1_penalty_on_the_feature_heads_trains_them(lpips_model):
    heads = FeatureCriticHeads(width=16).eval()  # eval: spectral norm's power iteration holds still
    for head in heads.heads:
        torch.nn.init.normal_(head[-1].weight)
    feats = [f.detach().requires_grad_(True) for f in vgg16_features(lpips_model, images(size=32))]
    penalty = r1_penalty(heads(feats), feats)
    penalty.backward()
    assert penalty > 0 and penalty.dtype == torch.float32
    assert heads.heads[0][-1].weight.grad.abs().sum() > 0
    # per image: doubling the batch with the same images leaves the mean unchanged
    feats2 = [torch.cat([f, f]).detach().requires_grad_(True) for f in feats]
    torch.testing.assert_close(r1_penalty(heads(feats2), feats2), penalty.detach())


@pytest.mark.parametrize("step, start, ramp, factor", [
    (0, 100, 50, 0.0), (99, 100, 50, 0.0), (100, 100, 50, 1 / 50), (124, 100, 50, 0.5), (149, 100, 50, 1.0),
    (500, 100, 50, 1.0), (99, 100, 0, 0.0), (100, 100, 0, 1.0)])
def test_gan_ramp(step, start, ramp, factor):
    assert gan_ramp(step, start, ramp) == pytest.approx(factor)


def test_bench_counts_the_frozen_step_with_both_branches_backward(lpips_model):
    """bench.train.frozen_gan_step_flops: two trunk forwards (x, recon) and, for GradNorm's two branches, two
    input-only backward passes through the trunk on top of the heads' work."""
    import types

    from torch.utils.flop_counter import FlopCounterMode

    from bench.train import frozen_gan_step_flops
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(data=types.SimpleNamespace(vae_resolution=32,
                                                                                         batch_size=2)),
                                    objective=types.SimpleNamespace(lpips=lpips_model), device=torch.device("cpu"))
    flops = frozen_gan_step_flops(trainer, vae_flops=1e9)
    with FlopCounterMode(display=False) as one_pass, torch.no_grad():
        vgg16_features(lpips_model, images(n=2, size=32))
    trunk = one_pass.get_total_flops()
    parts = [flops[f"frozen_{k}"] for k in ("trunk_forward", "lpips_heads", "critic_heads_step",
                                             "generator_and_backward")]
    assert flops["frozen"] == 1e9 + sum(parts) == 1e9 + flops["frozen_critic_and_lpips"]
    assert flops["frozen_trunk_forward"] == 2 * trunk
    assert 2 * trunk < flops["frozen_generator_and_backward"] < 2.5 * trunk


# --------------------------------------------------------------------------------------------
# discriminators
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vgg_disc():
    torch.manual_seed(0)
    return VGG16Discriminator(None)


def test_imagenet_scaling_of_minus_one_to_one_images():
    """The critic's VGG16 sees ImageNet-normalised inputs: [-1, 1] -> [0, 1] -> (x - mean) / std."""
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    x = torch.rand(2, 3, 4, 4) * 2 - 1
    expected = ((x + 1) / 2 - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    torch.testing.assert_close(critics.ImageNetScaling()(x), expected, rtol=1e-6, atol=1e-6)


def test_vgg16_discriminator_shape_and_neutral_start(vgg_disc):
    x = (torch.rand(2, 3, 64, 48) * 2 - 1).requires_grad_(True)
    logits = vgg_disc(x)
    assert logits.shape == (2, 1, 4, 3)
    assert torch.count_nonzero(logits).item() == 0  # zero-initialised final head convs
    logits.sum().backward()
    head_grads = [h[-1].weight.grad for h in vgg_disc.heads]
    assert all(g is not None and g.abs().sum().item() > 0 for g in head_grads)  # it can learn


def test_vgg16_discriminator_gradients_reach_input(vgg_disc):
    disc = copy.deepcopy(vgg_disc)
    torch.manual_seed(1)
    for head in disc.heads:
        torch.nn.init.normal_(head[-1].weight, std=0.1)
    x = (torch.rand(1, 3, 32, 32) * 2 - 1).requires_grad_(True)
    disc(x).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum().item() > 0


@pytest.mark.parametrize("norm", DISC_NORMS)
def test_nlayer_discriminator_norms(norm):
    torch.manual_seed(0)
    disc = NLayerDiscriminator(ndf=8, norm=norm)
    x = (torch.rand(2, 3, 64, 64) * 2 - 1).requires_grad_(True)
    out = disc(x)
    # 64 -> 32 -> 16 -> 8 (stride 2) -> 7 -> 6 (stride 1, kernel 4, padding 1)
    assert out.shape == (2, 1, 6, 6)
    out.mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum().item() > 0
    with pytest.raises(ValueError):
        NLayerDiscriminator(norm="layer")


# --------------------------------------------------------------------------------------------
# adaptive GAN weight
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# LPIPS
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vgg16_state() -> dict:
    torch.manual_seed(1234)
    return torchvision.models.vgg16(weights=None).state_dict()


@pytest.fixture(scope="module")
def lpips_with_features(vgg16_state):
    feats = {k[len("features."):]: v for k, v in vgg16_state.items() if k.startswith("features.")}
    return build_lpips(feats), feats


def test_build_lpips_loads_backbone(lpips_with_features):
    model, feats = lpips_with_features
    state = model.net.state_dict()
    assert torch.equal(state["slice1.0.weight"], feats["0.weight"])
    assert torch.equal(state["slice2.5.weight"], feats["5.weight"])
    assert torch.equal(state["slice3.14.bias"], feats["14.bias"])
    assert torch.equal(state["slice5.28.weight"], feats["28.weight"])


def test_random_lpips_backbone_is_torchvisions_vgg16_at_seed_0():
    """--vgg16_weights random: LPIPS' trunk is torchvision's VGG16 drawn at seed 0 in every process (build_lpips
    skips drawing the classifier it drops; the convolutions' draws come first and must not change), and the
    caller's random stream is left where it was."""
    torch.manual_seed(0)
    reference = torchvision.models.vgg16(weights=None).features.state_dict()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    state = build_lpips(None).net.state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    for key, value in reference.items():
        idx = int(key.split(".")[0])
        slice_no = next(s for s, (a, b) in enumerate(critics.VGG16_SLICES) if a <= idx < b) + 1
        assert torch.equal(state[f"slice{slice_no}.{key}"], value), key


def test_lpips_frozen_eval_and_zero_on_identical(lpips_with_features):
    model, _ = lpips_with_features
    assert not model.training and not any(m.training for m in model.modules())
    assert not any(p.requires_grad for p in model.parameters())
    torch.manual_seed(0)
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    y = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        same = model(x, x)
        diff = model(x, y)
    assert same.abs().max().item() == 0.0
    assert diff.shape[0] == 2 and (diff > 0).all()
    # gradients still flow to the input (the perceptual loss trains the decoder)
    xr = x.clone().requires_grad_(True)
    model(xr, y).sum().backward()
    assert xr.grad.abs().sum().item() > 0


def test_lpips_backpropagates_through_the_reconstruction_only():
    """The step differentiates LPIPS with respect to the reconstruction; the target's VGG16 features are
    computed without a graph (frozen network, target without grad): the backward graph holds one VGG16
    trunk (13 convolutions) and the 5 linear heads, not two trunks."""
    model = build_lpips(None)
    target = torch.rand(1, 3, 32, 32) * 2 - 1
    recon = (torch.rand(1, 3, 32, 32) * 2 - 1).requires_grad_(True)
    loss = model(recon, target).mean()
    seen, todo, convs = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        convs += "Convolution" in type(node).__name__
        todo += [next_node for next_node, _ in node.next_functions]
    assert convs == 13 + 5
    assert all(not p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------------------------
# the spatio-temporal critic (--discriminator patchgan3d, issue 42)
# --------------------------------------------------------------------------------------------
def clip_batch(n=2, frames=5, size=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, frames, size, size, generator=generator) * 2 - 1


@pytest.mark.parametrize("norm", DISC_NORMS)
def test_patchgan3d_takes_each_norm_and_gives_a_patch_grid_in_time(norm):
    """--disc_norm is the 2D PatchGAN's (BatchNorm3d for batch; GroupNorm and/or spectral norm), with its
    initialisation; time is halved twice, so 17 frames give 5 temporal patches, 9 give 3, and a one-frame clip
    (--video_image_prob's image steps) gives 1; gradients reach every frame."""
    torch.manual_seed(0)
    disc, flat = critics.PatchGAN3D(ndf=8, norm=norm), NLayerDiscriminator(ndf=8, norm=norm)
    assert [type(m).__name__ for m in disc.main] == [type(m).__name__.replace("2d", "3d") for m in flat.main]
    spectral = sum(hasattr(m, "weight_orig") for m in disc.modules())
    assert spectral == sum(hasattr(m, "weight_orig") for m in flat.modules())
    assert spectral == (5 if norm in ("spectral", "group_spectral") else 0)
    for frames, grid in ((17, 5), (9, 3), (1, 1)):
        x = clip_batch(frames=frames, size=64).requires_grad_(True)
        out = disc(x)
        assert out.shape == (2, 1, grid, 6, 6), frames
        out.mean().backward()
        assert torch.isfinite(x.grad).all() and (x.grad.abs().sum(dim=(0, 1, 3, 4)) > 0).all()
    with pytest.raises(ValueError):
        critics.PatchGAN3D(norm="layer")


def test_patchgan3d_sees_the_order_of_frames():
    """A spatio-temporal critic: reversing a clip's frames changes its logits (a frame critic's mean logit would
    not move); its first and last temporal patches are told apart by the padding at the clip's ends."""
    torch.manual_seed(0)
    disc = critics.PatchGAN3D(ndf=8, norm="none")
    x = clip_batch(frames=9)
    assert not torch.allclose(disc(x), disc(x.flip(2)).flip(2))
    still = x[:, :, :1].expand(-1, -1, 9, -1, -1)  # a still clip: every frame the same
    logits = disc(still)
    assert not torch.allclose(logits[:, :, 0], logits[:, :, 1])
