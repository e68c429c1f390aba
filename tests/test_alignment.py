"""alignment.py, VA-VAE's vision-foundation alignment: the loss's value on constructed features, the gradient
only into the latent and the projection (at GradNorm's norm), the frozen foundation encoder, the resize to the
latent grid, and how its weights are loaded."""
from __future__ import annotations

import pytest
import torch

import alignment
from utils import WeightsUnavailable

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def vf():
    """The smallest DINOv2 (ViT-S/14) on random weights, at 28 px: 2 x 2 tokens."""
    torch.manual_seed(0)
    return alignment.AlignmentLoss(z_channels=4, model="dinov2_vits14", weights="random", image_size=28)


def test_identical_or_nearly_identical_features_cost_nothing():
    features = torch.randn(2, 8, 4, 4, generator=torch.Generator().manual_seed(0))
    assert [t.item() for t in alignment.vf_loss_terms(features, features)] == [0.0, 0.0]
    nearby = features + 0.05 * torch.randn(features.shape, generator=torch.Generator().manual_seed(1))
    assert [t.item() for t in alignment.vf_loss_terms(nearby, features)] == [0.0, 0.0]  # within the margins


def test_known_cosines_give_the_known_value():
    """Two tokens on a 1 x 2 grid. Features e1, e1; projected latent e2, e1: per-token cosines 0 and 1 ->
    mean(relu(0.5 - 0), relu(0.5 - 1)) = 0.25; token-pair cosines z: [[1, 0], [0, 1]], f: all 1 ->
    |difference| [[0, 1], [1, 0]] -> mean(relu(. - 0.25)) = 1.5 / 4 = 0.375."""
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])  # lengths do not matter: cosines
    features = torch.stack([e1, e1], dim=-1).view(1, 2, 1, 2)
    z = torch.stack([e2, e1], dim=-1).view(1, 2, 1, 2)
    cosine, distmat = alignment.vf_loss_terms(z, features)
    assert cosine.item() == pytest.approx(0.25) and distmat.item() == pytest.approx(0.375)
    cosine, distmat = alignment.vf_loss_terms(z, features, cos_margin=0.0, distmat_margin=0.0)
    assert cosine.item() == pytest.approx(0.5) and distmat.item() == pytest.approx(0.5)


def test_gradient_reaches_only_the_latent_and_the_projection(vf):
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    z = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    vf.zero_grad(set_to_none=True)
    loss, terms = vf(z, images * 2 - 1, weight=0.3)
    assert loss.dtype == torch.float32 and loss.item() > 0 and set(terms) == {"vf_cosine", "vf_distmat"}
    loss.backward()
    assert images.grad is None  # the features are constants: nothing flows into the images or the encoder
    assert all(p.grad is None for p in vf.foundation.parameters())
    assert vf.projection.weight.grad is not None and vf.projection.weight.grad.abs().sum() > 0
    assert torch.linalg.vector_norm(z.grad).item() == pytest.approx(0.3, rel=1e-5)  # GradNorm: the weight


def test_foundation_encoder_is_frozen_and_stays_in_eval_mode(vf):
    vf.train()
    assert not vf.foundation.training and not vf.foundation.net.training
    assert not any(m.training for m in vf.foundation.modules())
    assert not any(p.requires_grad for p in vf.foundation.parameters())
    assert all(p.requires_grad for p in vf.projection.parameters())
    features = vf.foundation(torch.zeros(1, 3, 32, 32), (4, 4))
    assert features.shape == (1, vf.foundation.feature_dim, 4, 4) and vf.foundation.feature_dim == 384


def test_features_are_resized_to_the_latent_grid():
    features = torch.randn(2, 6, 16, 16, generator=torch.Generator().manual_seed(0))
    assert alignment.resize_to_grid(features, (16, 16)) is features
    assert alignment.resize_to_grid(features, (8, 8)).shape == (2, 6, 8, 8)
    assert alignment.resize_to_grid(features, (32, 24)).shape == (2, 6, 32, 24)
    constant = torch.full((1, 3, 16, 16), 2.5)
    assert torch.allclose(alignment.resize_to_grid(constant, (4, 4)), torch.full((1, 3, 4, 4), 2.5))
    # a 2x2 block average when shrinking by 2 (antialiased), not a pick of every other token
    ramp = torch.arange(16.0).view(1, 1, 4, 4)
    assert torch.allclose(alignment.resize_to_grid(ramp, (2, 2)), ramp.view(1, 1, 2, 2, 2, 2).mean(dim=(3, 5)))


def test_weights_random_is_announced_a_path_loads_exactly_and_a_bad_one_is_one_line(vf, tmp_path, capfd):
    torch.manual_seed(1)
    alignment.FoundationEncoder("dinov2_vits14", "random", 28)
    assert "RANDOMLY INITIALISED dinov2_vits14" in capfd.readouterr().err
    path = tmp_path / "dinov2_vits14.pth"
    torch.save(vf.foundation.net.state_dict(), path)
    loaded = alignment.FoundationEncoder("dinov2_vits14", str(path), 28)
    images = torch.rand(1, 3, 28, 28) * 2 - 1
    assert torch.equal(loaded(images, (2, 2)), vf.foundation(images, (2, 2)))
    with pytest.raises(WeightsUnavailable, match=r"^--vf_weights /no/such.pth: no such file$"):
        alignment.FoundationEncoder("dinov2_vits14", "/no/such.pth", 28)
    with pytest.raises(WeightsUnavailable, match="is not a dinov2_vitb14 state dict"):
        alignment.FoundationEncoder("dinov2_vitb14", str(path), 28)
    with pytest.raises(WeightsUnavailable, match="--vf_model vit_h: not one of"):
        alignment.FoundationEncoder("vit_h", "random", 28)
