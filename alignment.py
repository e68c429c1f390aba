"""Vision-foundation alignment of the latent (VA-VAE, Yao et al. 2025, "Reconstruction vs. Generation",
hustvl/LightningDiT `vavae`): a frozen pretrained encoder (DINOv2), a trainable 1x1 projection of the latent to its
feature width, and VA-VAE's "VF loss" between the two.

As in LightningDiT's `vf_loss` (ldm/modules/losses/contperceptual.py), both terms compare the *projected* latent z'
with the features f, token by token on the latent grid, within each image:
    marginal cosine similarity:   mean_ij relu(1 - m1 - cos(z'_ij, f_ij))                     m1 = 0.5
    marginal distance matrix:     mean_b,i,j relu(|cos(z'_i, z'_j) - cos(f_i, f_j)| - m2)     m2 = 0.25
(their config: cos_margin 0.5, distmat_margin 0.25, vf_weight 0.1; the features detached).

Weighting: VA-VAE scales the VF loss by LDM's adaptive weight, ||grad rec|| / ||grad vf|| at the encoder's last
layer, times 0.1. Here the branch goes through our GradNorm at the latent instead (`AlignmentLoss(z, images,
weight)`): the VF gradient reaching the encoder has norm `weight`, whatever the loss's raw scale, the same
mechanism that balances every other branch of our objective, with no extra autograd.grad pass, and exact under
accumulation and DDP (GradNorm normalises each micro-batch on its own). The weight is therefore a gradient norm at the latent, not
VA-VAE's 0.1 ratio: choose it by measurement.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common import first_line
from utils import gradnorm
from weights import WeightsUnavailable, warn_random_weights

# our --vf_model names -> timm's; timm builds each without a network
VF_MODELS = {"dinov2_vitl14": "vit_large_patch14_dinov2.lvd142m",  # VA-VAE's choice
             "dinov2_vitb14": "vit_base_patch14_dinov2.lvd142m",
             "dinov2_vits14": "vit_small_patch14_dinov2.lvd142m"}


def fetch_foundation_weights(model: str, weights: str, download: bool = True) -> None:
    """--vf_weights timm: bring timm's pretrained weights of `model` into the Hugging Face cache, where
    build_foundation_net's timm.create_model(pretrained=True) finds them. The trainer calls it through
    weights.fetch_weights: local rank 0 downloads while the other ranks wait, so eight ranks of a node never write the
    same cache entry at once. Other --vf_weights values, and the waiting ranks (download False), need nothing."""
    if weights != "timm" or not download or model not in VF_MODELS:
        return
    import timm
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    repo = timm.models.get_pretrained_cfg(VF_MODELS[model]).hf_hub_id
    if isinstance(try_to_load_from_cache(repo, "model.safetensors"), str):
        return  # cached: no network at all
    unreachable = hub_unreachable()
    if unreachable:  # the hub's client would retry for ~30 s before giving up: one attempt says as much
        raise WeightsUnavailable(f"{model} weights unavailable from {repo} ({unreachable}): fill the Hugging Face "
                                 "cache, or pass --vf_weights PATH; --vf_weights random is for tests only")
    try:
        hf_hub_download(repo, "model.safetensors")
    except Exception as e:  # offline clusters land here
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WeightsUnavailable(f"{model} weights unavailable from {repo} ({reason}): fill the Hugging Face cache, "
                                 f"or pass --vf_weights PATH; --vf_weights random is for tests only") from None


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached, from one connection attempt to its host; None if it takes the
    connection, or when a proxy is set (the proxy then decides, and the client's own error says so)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                        "all_proxy")):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{endpoint.hostname}:{port} unreachable: {e.strerror or type(e).__name__}"
    return None


def build_foundation_net(model: str, weights: str, image_size: int) -> nn.Module:
    """The timm network of `model` with `weights`: "timm" (timm's pretrained weights from its Hugging Face cache,
    downloaded once where a network exists), a local PATH (a timm state dict, .safetensors or torch), or "random"
    (tests only; loudly announced). WeightsUnavailable carries a one-line reason."""
    if model not in VF_MODELS:
        raise WeightsUnavailable(f"--vf_model {model}: not one of {', '.join(VF_MODELS)}")
    import timm  # here, not at the top: 0.7 s of every start-up (it imports wandb), for runs with --vf_weight only
    name, kwargs = VF_MODELS[model], dict(img_size=image_size, num_classes=0)
    if weights == "timm":
        try:
            return timm.create_model(name, pretrained=True, **kwargs)
        except Exception as e:  # offline clusters land here
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise WeightsUnavailable(f"{model} weights unavailable ({reason}): fill the Hugging Face cache, or pass "
                                     f"--vf_weights PATH; --vf_weights random is for tests only") from None
    net = timm.create_model(name, pretrained=False, **kwargs)
    if weights == "random":
        warn_random_weights(f"{model} (--vf_weights random)", "the vision-foundation alignment",
                            "The alignment loss aligns the latent with noise; use this for tests only.")
        return net
    if not os.path.isfile(weights):
        raise WeightsUnavailable(f"--vf_weights {weights}: no such file")
    try:
        timm.models.load_checkpoint(net, weights, strict=True)
    except RuntimeError as e:
        raise WeightsUnavailable(f"--vf_weights {weights} is not a {model} state dict "
                                 f"({first_line(e)})") from None
    return net


class FoundationEncoder(nn.Module):
    """Frozen patch features: images in [-1, 1], (B, 3, H, W) -> (B, D, h, w), resized to the latent grid."""

    def __init__(self, model: str = "dinov2_vitl14", weights: str = "timm", image_size: int = 224):
        super().__init__()
        self.net = build_foundation_net(model, weights, image_size)
        self.net.requires_grad_(False)
        self.image_size, self.feature_dim = image_size, self.net.num_features
        cfg = self.net.pretrained_cfg
        self.register_buffer("mean", torch.tensor(cfg["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg["std"]).view(1, 3, 1, 1), persistent=False)
        self.eval()

    def train(self, mode: bool = True) -> "FoundationEncoder":
        return super().train(False)  # frozen: the trainer's model.train() must not switch its dropout/norms

    @torch.no_grad()
    def forward(self, images: Tensor, grid: tuple[int, int]) -> Tensor:
        x = ((images.float() + 1) / 2 - self.mean) / self.std
        size = (self.image_size, self.image_size)  # DINOv2 at 224 px: 16 x 16 tokens, as VA-VAE for f16 at 256 px
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
        tokens = self.net.forward_features(x)[:, self.net.num_prefix_tokens:]
        h = w = self.image_size // self.net.patch_embed.patch_size[0]
        features = tokens.transpose(1, 2).reshape(len(x), -1, h, w).float()
        return resize_to_grid(features, grid)


def resize_to_grid(features: Tensor, grid: tuple[int, int]) -> Tensor:
    """Features (B, D, h, w) on the latent's grid: each latent cell the mean of the tokens it covers when the
    grid is coarser (area), bilinear when it is finer."""
    if tuple(features.shape[-2:]) == tuple(grid):
        return features
    if features.shape[-2] >= grid[0] and features.shape[-1] >= grid[1]:
        return F.adaptive_avg_pool2d(features, tuple(grid))
    return F.interpolate(features, size=tuple(grid), mode="bilinear", align_corners=False)


def vf_loss_terms(z_projected: Tensor, features: Tensor, cos_margin: float = 0.5,
                  distmat_margin: float = 0.25) -> tuple[Tensor, Tensor]:
    """(marginal cosine-similarity term, marginal distance-matrix term), both in fp32, of the projected latent
    (B, D, h, w) against the features (B, D, h, w), token pairs taken within each image."""
    z = F.normalize(z_projected.float().flatten(2), dim=1)  # (B, D, N): unit vectors per token
    f = F.normalize(features.detach().float().flatten(2), dim=1)
    cosine = F.relu(1 - cos_margin - (z * f).sum(dim=1)).mean()
    distance = (torch.einsum("bci,bcj->bij", z, z) - torch.einsum("bci,bcj->bij", f, f)).abs()
    return cosine, F.relu(distance - distmat_margin).mean()


def latent_projection(z_channels: int, feature_dim: int) -> nn.Conv2d:
    """The trainable 1x1 projection of the latent to the feature width, without a bias as in VA-VAE (LightningDiT's
    `Conv2d(embed_dim, vf_feature_dim, kernel_size=1, bias=False)`): with a bias the cosine term is met by a constant
    vector whatever the latent holds (features sharing a component, a latent carrying nothing about them: the term
    reaches 0 and the encoder gets no gradient)."""
    return nn.Conv2d(z_channels, feature_dim, kernel_size=1, bias=False)


class AlignmentLoss(nn.Module):
    """The VF branch: the frozen foundation encoder, the trainable projection (saved with the run, never exported)
    and VA-VAE's two terms. Only `projection` has trainable parameters: give them to the VAE's optimizer and save
    `projection.state_dict()` with the run (the foundation encoder is reloaded from its weights, never saved)."""

    def __init__(self, z_channels: int, model: str = "dinov2_vitl14", weights: str = "timm", image_size: int = 224,
                 cos_margin: float = 0.5, distmat_margin: float = 0.25):
        super().__init__()
        self.foundation = FoundationEncoder(model, weights, image_size)
        self.projection = latent_projection(z_channels, self.foundation.feature_dim)
        self.cos_margin, self.distmat_margin = cos_margin, distmat_margin

    def forward(self, z: Tensor, images: Tensor, weight: float | Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(the loss to add to the VAE's, its two terms detached for logging). `z`: the latent the decoder sees
        (B, C, h, w); `images`: the encoder's input in [-1, 1]; `weight`: the norm of the VF gradient into the
        encoder (GradNorm; divide by the accumulation steps as for the other branches)."""
        features = self.foundation(images, tuple(z.shape[-2:]))
        cosine, distmat = vf_loss_terms(self.projection(gradnorm(z, weight)), features, self.cos_margin,
                                        self.distmat_margin)
        return cosine + distmat, {"vf_cosine": cosine.detach(), "vf_distmat": distmat.detach()}
