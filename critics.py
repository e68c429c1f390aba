"""The networks that judge reconstructions: LPIPS on VGG16 (the `lpips` package's learned heads), the critics (the
VGG16 discriminator, the PatchGAN and its 3D twin for clips, the frozen trunk's feature heads), the one VGG16 pass the frozen-trunk critic
shares with LPIPS, and the critic's stabilisers (DiffAugment, R1). The objective (objective.py) composes them."""
from __future__ import annotations

import math
import warnings
from unittest import mock

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

from config import DIFFAUG_POLICIES, DISC_NORMS

VGG16_SLICES = ((0, 4), (4, 9), (9, 16), (16, 23), (23, 30))  # ends at relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
VGG16_CHANNELS = (64, 128, 256, 512, 512)

# --------------------------------------------------------------------------------------------
# LPIPS
# --------------------------------------------------------------------------------------------
def build_lpips(vgg_features: dict[str, Tensor] | None) -> nn.Module:
    """LPIPS (VGG) from the `lpips` package: its learned linear heads ship with the package; the
    VGG16 backbone comes from `vgg_features` (None: random init, tests only). Frozen, eval mode;
    inputs in [-1, 1]."""
    import lpips
    # lpips builds a whole torchvision VGG16 and keeps its convolutions: drawing the 120M classifier weights it
    # drops (nn.init.normal_, VGG's only use of it; drawn after the convolutions') is half of the build's second
    with warnings.catch_warnings(), torch.random.fork_rng(), mock.patch("torch.nn.init.normal_", lambda t, *a, **k: t):
        warnings.simplefilter("ignore")  # lpips calls torchvision's deprecated `pretrained=` API
        torch.manual_seed(0)  # a random backbone (tests) is then the same in every process
        model = lpips.LPIPS(net="vgg", pnet_rand=True, verbose=False)
    if vgg_features is not None:
        remapped = {}
        for key, value in vgg_features.items():
            idx = int(key.split(".")[0])
            slice_no = next(s for s, (a, b) in enumerate(VGG16_SLICES) if a <= idx < b) + 1
            remapped[f"slice{slice_no}.{key}"] = value
        model.net.load_state_dict(remapped, strict=True)
    model.eval().requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------
# Discriminators
# --------------------------------------------------------------------------------------------
class ImageNetScaling(nn.Module):
    """[-1, 1] images -> ImageNet-normalised inputs for a torchvision VGG."""

    def __init__(self):
        super().__init__()
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        self.register_buffer("shift", 2 * mean - 1, persistent=False)
        self.register_buffer("scale", 2 * std, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.shift) / self.scale


class VGG16Discriminator(nn.Module):
    """Patch discriminator on a (trainable) VGG16 backbone.

    Each feature slice (relu1_2 .. relu5_3) gets a small conv head producing a logit map; the maps
    are area-pooled to the coarsest slice's grid (1/16 of the input) and summed, so every output
    logit judges one 16x16 patch with evidence from all depths. Final head convs start at zero:
    the critic starts neutral (logits 0).
    """

    def __init__(self, vgg_features: dict[str, Tensor] | None = None, head_channels: int = 64):
        super().__init__()
        self.scaling = ImageNetScaling()
        # only the convolutional part: building the whole VGG16 would initialise a 120M-parameter classifier
        features = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["D"])
        if vgg_features is not None:
            features.load_state_dict(vgg_features, strict=True)
        self.slices = nn.ModuleList(nn.Sequential(*features[a:b]) for a, b in VGG16_SLICES)
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, head_channels, 3, padding=1), nn.LeakyReLU(0.2),
                          nn.Conv2d(head_channels, 1, 1))
            for c in VGG16_CHANNELS)
        for head in self.heads:
            nn.init.zeros_(head[-1].weight)
            nn.init.zeros_(head[-1].bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.scaling(x)
        maps = []
        for block, head in zip(self.slices, self.heads):
            h = block(h)
            maps.append(head(h))
        size = maps[-1].shape[-2:]
        return sum(F.adaptive_avg_pool2d(m, size) for m in maps)


class NLayerDiscriminator(nn.Module):
    """PatchGAN (pix2pix / taming) with a choice of normalisation. `group_spectral` (GroupNorm +
    spectral norm) does not depend on the batch statistics, which suits the small per-GPU batches
    of VAE training (seed note 002)."""

    def __init__(self, input_nc: int = 3, ndf: int = 64, n_layers: int = 3, norm: str = "batch"):
        super().__init__()
        if norm not in DISC_NORMS:
            raise ValueError(f"disc_norm must be one of {DISC_NORMS}")
        spectral = norm in ("spectral", "group_spectral")

        def conv(cin, cout, stride, bias):
            layer = nn.Conv2d(cin, cout, kernel_size=4, stride=stride, padding=1, bias=bias)
            return nn.utils.spectral_norm(layer) if spectral else layer

        def normalization(c):
            if norm == "batch":
                return nn.BatchNorm2d(c)
            if norm == "group_spectral":
                return nn.GroupNorm(min(32, c), c)
            return nn.Identity()

        layers = [conv(input_nc, ndf, 2, True), nn.LeakyReLU(0.2)]
        mult = 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2 ** n, 8)
            stride = 2 if n < n_layers else 1
            layers += [conv(ndf * prev, ndf * mult, stride, norm in ("none", "spectral")), normalization(ndf * mult),
                       nn.LeakyReLU(0.2)]
        layers += [conv(ndf * mult, 1, 1, True)]
        self.main = nn.Sequential(*layers)
        if not spectral:
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.normal_(m.weight, 0.0, 0.02)
                elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                    nn.init.normal_(m.weight, 1.0, 0.02)
                    nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.main(x)


class PatchGAN3D(nn.Module):
    """The spatio-temporal PatchGAN (--discriminator patchgan3d): NLayerDiscriminator with Conv3d, the same
    normalisations (--disc_norm; BatchNorm3d for batch), widths and initialisation, judging (N, C, T, H, W) clips.
    Its first two convolutions halve time as well as space (kernel 3 in time, padding 1), so a 17-frame clip gives
    a grid of 5 temporal patches (9 frames: 3), each seeing the whole clip (temporal receptive field 31 frames),
    and a one-frame clip (--video_image_prob's image steps) gives one.

    Not causal in time: the critic judges whole clips in training and never runs chunk by chunk, so nothing is
    gained by hiding the frames after a patch from it, and flicker is a difference in both directions. The causal
    VAE's first frame (encoded alone) is still told apart: the zero padding in time marks the clip's ends, so the
    patches at the start of the clip learn the first frame's own statistics."""

    def __init__(self, input_nc: int = 3, ndf: int = 64, n_layers: int = 3, norm: str = "batch"):
        super().__init__()
        if norm not in DISC_NORMS:
            raise ValueError(f"disc_norm must be one of {DISC_NORMS}")
        spectral = norm in ("spectral", "group_spectral")

        def conv(cin, cout, stride, time_stride, bias):
            layer = nn.Conv3d(cin, cout, kernel_size=(3, 4, 4), stride=(time_stride, stride, stride),
                              padding=1, bias=bias)
            return nn.utils.spectral_norm(layer) if spectral else layer

        def normalization(c):
            if norm == "batch":
                return nn.BatchNorm3d(c)
            if norm == "group_spectral":
                return nn.GroupNorm(min(32, c), c)
            return nn.Identity()

        layers = [conv(input_nc, ndf, 2, 2, True), nn.LeakyReLU(0.2)]
        mult = 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2 ** n, 8)
            stride = 2 if n < n_layers else 1
            layers += [conv(ndf * prev, ndf * mult, stride, 2 if n == 1 else 1, norm in ("none", "spectral")),
                       normalization(ndf * mult), nn.LeakyReLU(0.2)]
        layers += [conv(ndf * mult, 1, 1, 1, True)]
        self.main = nn.Sequential(*layers)
        if not spectral:
            for m in self.modules():
                if isinstance(m, nn.Conv3d):
                    nn.init.normal_(m.weight, 0.0, 0.02)
                elif isinstance(m, (nn.BatchNorm3d, nn.GroupNorm)):
                    nn.init.normal_(m.weight, 1.0, 0.02)
                    nn.init.zeros_(m.bias)

    def forward(self, clips: Tensor) -> Tensor:
        return self.main(clips)


# --------------------------------------------------------------------------------------------
# The frozen critic: heads on LPIPS' VGG16 features (--critic_trunk frozen)
# --------------------------------------------------------------------------------------------
def vgg16_features(lpips_model: nn.Module, images: Tensor) -> list[Tensor]:
    """The five relu features (relu1_2 .. relu5_3) of [-1, 1] `images`, from LPIPS' own scaling layer and
    VGG16: one trunk pass that serves LPIPS (lpips_from_features), the critic's step (detached) and the
    generator term (FeatureCriticHeads). Differentiable with respect to `images`; the trunk is frozen."""
    return list(lpips_model.net(lpips_model.scaling_layer(images)))


def lpips_from_features(lpips_model: nn.Module, features_0: list[Tensor], features_1: list[Tensor]) -> Tensor:
    """LPIPS between the two images whose vgg16_features are given: lpips.LPIPS.forward's arithmetic after
    its trunk (unit-normalised channels, squared difference, learned 1x1 heads, spatial mean, summed over
    the five depths), so the value equals lpips_model(image_0, image_1). Shape (N, 1, 1, 1)."""
    import lpips
    total = 0
    for f0, f1, lin in zip(features_0, features_1, lpips_model.lins):
        diff = (lpips.normalize_tensor(f0) - lpips.normalize_tensor(f1)) ** 2
        total = total + lin(diff).mean([2, 3], keepdim=True)
    return total


class FeatureCriticHeads(nn.Module):
    """The trainable part of the frozen-trunk critic: logit heads on VGG16's relu2_2 .. relu5_3.

    After Projected GAN (Sauer et al. 2021, pg_modules/projector.py and discriminator.py): each depth's
    features are first mixed across channels by a FIXED random 1x1 projection to `width` channels (CCM;
    it spreads the signal of a few dominant channels, so the heads cannot latch onto one) and across
    depths by adding the upsampled coarser projection (CSM, top-down, as a feature pyramid). Each depth
    then gets its own small discriminator (multi-scale heads, as Projected GAN and StyleGAN-T): two
    spectral-norm 3x3 convs (no batch statistics: small per-GPU batches, DDP) and a 1x1 logit conv that
    starts at zero (a neutral critic, logits 0, as VGG16Discriminator). The logit maps are area-pooled
    to relu5_3's grid (1/16 of the image) and summed: one logit per 16x16 patch, the same output as
    VGG16Discriminator, so the hinge losses, the thresholded generator term and LeCam read it unchanged.
    relu1_2 (full resolution, near-linear in the pixels the MSE terms already match) is left out: its
    head would cost as much as the others together.

    forward(features) takes vgg16_features' list of five tensors (the first is ignored) and returns
    logits (N, 1, H/16, W/16).
    """

    def __init__(self, width: int = 64, channels: tuple[int, ...] = VGG16_CHANNELS[1:], seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)  # the projection is part of the critic's definition
        for i, c in enumerate(channels):
            # Kaiming-uniform like nn.Conv2d's default init, but fixed: a buffer, so no optimizer or DDP sees it
            bound = 1 / math.sqrt(c)
            projection = (torch.rand(width, c, 1, 1, generator=generator) * 2 - 1) * bound * math.sqrt(3)
            self.register_buffer(f"projection{i}", projection)
        sn = nn.utils.spectral_norm
        self.heads = nn.ModuleList(
            nn.Sequential(sn(nn.Conv2d(width, width, 3, padding=1)), nn.LeakyReLU(0.2),
                          sn(nn.Conv2d(width, width, 3, padding=1)), nn.LeakyReLU(0.2),
                          nn.Conv2d(width, 1, 1))
            for _ in channels)
        for head in self.heads:
            nn.init.zeros_(head[-1].weight)
            nn.init.zeros_(head[-1].bias)

    def projections(self) -> list[Tensor]:
        return [getattr(self, f"projection{i}") for i in range(len(self.heads))]

    def mix(self, features: list[Tensor]) -> list[Tensor]:
        """The fixed cross-channel and cross-scale mixing: one `width`-channel map per head, fine to coarse."""
        used = features[len(features) - len(self.heads):]
        mixed = [F.conv2d(f, p) for f, p in zip(used, self.projections())]
        for i in range(len(mixed) - 2, -1, -1):  # coarse to fine: each depth also sees the coarser context
            mixed[i] = mixed[i] + F.interpolate(mixed[i + 1], size=mixed[i].shape[-2:], mode="bilinear",
                                                align_corners=False)
        return mixed

    def forward(self, features: list[Tensor]) -> Tensor:
        maps = [head(m) for head, m in zip(self.heads, self.mix(features))]
        size = maps[-1].shape[-2:]
        return sum(F.adaptive_avg_pool2d(m, size) for m in maps)


# --------------------------------------------------------------------------------------------
# The critic's stabilisers: DiffAugment, R1
# --------------------------------------------------------------------------------------------
def diff_augment(images: Tensor, policy: str = "color,translation,cutout", translation_ratio: float = 0.125,
                 cutout_ratio: float = 0.5) -> Tensor:
    """DiffAugment (Zhao et al. 2020, mit-han-lab/data-efficient-gans DiffAugment_pytorch.py) of [-1, 1]
    images: per image, random brightness (+-0.5), saturation (x0..2) and contrast (x0.5..1.5); a translation
    by up to 1/8 of the size with zero fill; a cutout of half the size with zeros. Every operation is
    differentiable with respect to the images, and every image draws its own parameters, so calling it on
    real and fake (together or apart) augments both with the same distribution, as the critic must see."""
    ops = [op for op in policy.split(",") if op]
    unknown = sorted(set(ops) - set(DIFFAUG_POLICIES))
    if unknown:
        raise ValueError(f"diffaug policy: unknown {unknown}; choose from {','.join(DIFFAUG_POLICIES)}")
    n, _, h, w = images.shape
    x = images

    def per_image(*shape):
        return torch.rand(n, *shape, dtype=x.dtype, device=x.device)

    if "color" in ops:
        x = x + (per_image(1, 1, 1) - 0.5)
        mean = x.mean(dim=1, keepdim=True)
        x = (x - mean) * (per_image(1, 1, 1) * 2) + mean
        mean = x.mean(dim=[1, 2, 3], keepdim=True)
        x = (x - mean) * (per_image(1, 1, 1) + 0.5) + mean
    if "translation" in ops:
        shift_h, shift_w = int(h * translation_ratio + 0.5), int(w * translation_ratio + 0.5)
        dy = torch.randint(-shift_h, shift_h + 1, (n, 1, 1), device=x.device)
        dx = torch.randint(-shift_w, shift_w + 1, (n, 1, 1), device=x.device)
        rows = torch.arange(h, device=x.device).view(1, h, 1) - dy  # the source row of each output row
        cols = torch.arange(w, device=x.device).view(1, 1, w) - dx
        inside = ((rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)).unsqueeze(1)
        index = (rows.clamp(0, h - 1) * w + cols.clamp(0, w - 1)).view(n, 1, h * w).expand(-1, x.shape[1], -1)
        x = torch.gather(x.flatten(2), 2, index).view_as(x) * inside
    if "cutout" in ops:
        cut_h, cut_w = int(h * cutout_ratio + 0.5), int(w * cutout_ratio + 0.5)
        top = torch.randint(0, h + (1 - cut_h % 2), (n, 1, 1), device=x.device) - cut_h // 2
        left = torch.randint(0, w + (1 - cut_w % 2), (n, 1, 1), device=x.device) - cut_w // 2
        rows = torch.arange(h, device=x.device).view(1, h, 1)
        cols = torch.arange(w, device=x.device).view(1, 1, w)
        cut = (rows >= top) & (rows < top + cut_h) & (cols >= left) & (cols < left + cut_w)
        x = x * (~cut).unsqueeze(1)
    return x


def r1_penalty(real_logits: Tensor, real_inputs: Tensor | list[Tensor]) -> Tensor:
    """R1 (Mescheder et al. 2018): the mean over images of the squared norm of the critic's gradient at
    real inputs, E ||d sum(logits) / d input||^2, in fp32; the caller weights it by gamma / 2. `real_inputs`
    are the images (trainable trunk) or the frozen trunk's features (frozen: the gradient then only
    crosses the small heads, which is what makes it cheap), made to require grad before the critic's
    forward. The graph is kept, so the penalty trains the critic."""
    inputs = [real_inputs] if torch.is_tensor(real_inputs) else list(real_inputs)
    grads = torch.autograd.grad(real_logits.float().sum(), inputs, create_graph=True, allow_unused=True)
    per_image = sum(g.float().pow(2).flatten(1).sum(1) for g in grads if g is not None)
    return per_image.mean()
