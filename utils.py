"""Training-side networks and losses: GradNorm, LPIPS, discriminators, pooled and low-pass MSE,
GAN losses, LDM's adaptive weight, LeCam regularisation, the learning-rate schedule.

Every loss reduction here runs in fp32, whatever the autocast around it.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

VGG16_SLICES = ((0, 4), (4, 9), (9, 16), (16, 23), (23, 30))  # ends at relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
VGG16_CHANNELS = (64, 128, 256, 512, 512)
DISC_TYPES = ("hinge", "bce")
DISC_NORMS = ("batch", "group_spectral", "spectral", "none")


def _dist_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --------------------------------------------------------------------------------------------
# GradNorm
# --------------------------------------------------------------------------------------------
class GradNormFunction(torch.autograd.Function):
    """Identity forward; backward rescales the incoming gradient to `weight / ||grad||`.

    One loss branch then contributes a gradient of norm `weight` to the reconstruction, whatever
    its raw scale, which balances LPIPS, MSE and GAN without hand-tuned loss weights. Under DDP
    the norm and the weight are the means of the ranks' values, all-reduced as one device tensor (no
    host sync), so every rank applies the same scale (the GAN branch's weight differs per rank: it
    follows the rank's active patches). The norm is accumulated in fp32.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (weight,) = ctx.saved_tensors
        norm = torch.linalg.vector_norm(grad_output, dtype=torch.float32)
        weight = weight.float()
        world = _dist_world()
        if world > 1:
            stats = torch.stack([norm, weight])
            dist.all_reduce(stats)  # SUM then divide: ReduceOp.AVG is NCCL-only
            norm, weight = (stats / world).unbind()
        scale = weight / (norm + 1e-12)
        return (grad_output.float() * scale).to(grad_output.dtype), None


def gradnorm(x: Tensor, weight: float | Tensor = 1.0) -> Tensor:
    if not torch.is_tensor(weight):  # a fill on the device, not torch.tensor (a host->device copy)
        weight = torch.full((), float(weight), device=x.device)
    return GradNormFunction.apply(x, weight)


# --------------------------------------------------------------------------------------------
# VGG16 weights: torchvision's cache, a local file, or (tests and demo only) random
# --------------------------------------------------------------------------------------------
class WeightsUnavailable(RuntimeError):
    """Pretrained weights could not be had; the message is one line for the user."""


def hub_cache_path(url: str) -> str:
    """Where torch.hub (and torchvision, torch-fidelity) keep a downloaded file."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))


def ensure_weights(spec: str, *, flag: str, url: str, what: str, download: bool = True,
                   hash_prefix: str | None = None, without: str = "") -> str | None:
    """Resolve a weights flag to a local file: `random` -> None (random init), a PATH -> itself,
    `torchvision` -> torch hub's download cache, downloading `url` once if `download` (the other local
    ranks pass download=False after local rank 0 is done). WeightsUnavailable says how to supply them, and
    `without`: how to run without them."""
    if spec == "random":
        return None
    if spec != "torchvision":
        if not os.path.isfile(spec):
            raise WeightsUnavailable(f"{flag} {spec}: no such file")
        return spec
    path = hub_cache_path(url)
    if os.path.isfile(path):
        return path
    how = (f"put {os.path.basename(path)} at {path}, or pass {flag} PATH" + (f", or {without}" if without else "")
           + f"; {flag} random is for tests only")
    if not download:
        raise WeightsUnavailable(f"{what} weights not found at {path}: {how}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.redirect_stdout(sys.stderr):  # torch.hub announces downloads on stdout
            torch.hub.download_url_to_file(url, path, hash_prefix=hash_prefix, progress=False)
    except Exception as e:  # offline clusters land here
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WeightsUnavailable(f"{what} weights unavailable ({reason}): {how}") from None
    return path


VGG16_URL = torchvision.models.VGG16_Weights.IMAGENET1K_V1.url


def vgg16_cache_path() -> str:
    return hub_cache_path(VGG16_URL)


def ensure_vgg16_weights(spec: str, download: bool = True) -> str | None:
    """`--vgg16_weights`: torchvision's pretrained VGG16 (its cache), a local state dict, or random."""
    return ensure_weights(spec, flag="--vgg16_weights", url=VGG16_URL, what="pretrained VGG16", download=download,
                          hash_prefix="397923af",  # torchvision names its files by their sha256 prefix
                          without="train without them: --perceptual_weight 0 (LPIPS off, a fine-tune's too) and, "
                                  "with --do_ganloss, --discriminator patchgan (a critic that needs no pretrained "
                                  "weights), as --demo does without them")


def fetch_weights(ensure, spec: str, local_rank: int = 0, group=None) -> str | None:
    """`ensure(spec, download=...)` on every rank, local rank 0 first: it downloads into the cache and
    the other ranks then only look there (barriers over `group`, when a process group is up)."""
    first, distributed = local_rank == 0, dist.is_available() and dist.is_initialized()
    if distributed and not first:
        dist.barrier(group=group)
    try:
        return ensure(spec, download=first)
    finally:
        if distributed and first:
            dist.barrier(group=group)


def load_vgg16_features(path: str | None) -> dict[str, Tensor] | None:
    """VGG16 `features` state dict (keys '0.weight', ..., '28.bias') from a torchvision VGG16 state
    dict, a features-only one, or a safetensors file. None means random init."""
    if path is None:
        return None
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsUnavailable(f"{path}: cannot be read as a VGG16 state dict ({type(e).__name__})") from None
    if isinstance(sd, dict) and "state_dict" in sd:
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise WeightsUnavailable(f"{path}: holds a {type(sd).__name__}, not a VGG16 state dict")
    feats = {k[len("features."):]: v for k, v in sd.items() if k.startswith("features.")}
    if not feats:
        feats = {k: v for k, v in sd.items() if k.split(".")[0].isdigit()}
    expected = {f"{i}.{p}" for i in (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28) for p in ("weight", "bias")}
    if set(feats) != expected:
        raise WeightsUnavailable(f"{path} is not a VGG16 state dict (missing {sorted(expected - set(feats))[:3]}...)")
    return feats


def warn_random_weights(network: str, what: str, consequence: str) -> None:
    """The loud banner of every network run on random weights (tests, the demo): never silent."""
    bar = "!" * 78
    print(f"{bar}\nWARNING: a RANDOMLY INITIALISED {network} is used for {what}.\n{consequence}\n{bar}",
          file=sys.stderr, flush=True)


def warn_random_vgg(what: str) -> None:
    warn_random_weights("VGG16 (--vgg16_weights random)", what,
                        "Perceptual and adversarial losses are meaningless; use this for tests and the demo only.")


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
# GAN stabilisers: DiffAugment, R1, the generator term's ramp
# --------------------------------------------------------------------------------------------
DIFFAUG_POLICIES = ("color", "translation", "cutout")


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


def gan_ramp(step: int, disc_start: int, ramp_steps: int) -> float:
    """The generator term's factor at `step`: 0 before disc_start, then linear up to 1 over ramp_steps
    (0: the step function of LDM/taming, whose sudden loss jump users report, latent-diffusion #350)."""
    if step < disc_start:
        return 0.0
    if ramp_steps <= 0:
        return 1.0
    return min(1.0, (step - disc_start + 1) / ramp_steps)


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
    past real/fake logits. The anchors are averaged across ranks and saved in checkpoints (buffers).

    `update` moves only pending anchors (what `penalty` uses in this step); `commit` makes them the
    anchors once the non-finite guard has judged the step. A skipped step (a NaN reconstruction, an
    fp16 overflow) then leaves the anchors as they were, instead of poisoning them for good."""

    def __init__(self, decay: float = 0.99):
        super().__init__()
        self.decay = decay
        self.register_buffer("ema_real", torch.zeros(()))
        self.register_buffer("ema_fake", torch.zeros(()))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.pending: tuple[Tensor, Tensor] | None = None  # (real, fake) anchors of the step in progress

    @torch.no_grad()
    def update(self, real_logits: Tensor, fake_logits: Tensor) -> None:
        means = torch.stack([real_logits.float().mean(), fake_logits.float().mean()])
        world = _dist_world()
        if world > 1:
            dist.all_reduce(means)
            means /= world
        real, fake = self.pending if self.pending is not None else (self.ema_real, self.ema_fake)
        # the first update sets the anchors (grad accumulation: later micro-batches of that step average in)
        decay = self.decay * (self.initialized | (self.pending is not None)).float()
        self.pending = (decay * real + (1 - decay) * means[0], decay * fake + (1 - decay) * means[1])

    @torch.no_grad()
    def commit(self, skip: Tensor) -> None:
        """Adopt the pending anchors unless `skip` (a device flag, no host sync)."""
        if self.pending is None:
            return
        keep = skip.bool()
        self.ema_real.copy_(torch.where(keep, self.ema_real, self.pending[0]))
        self.ema_fake.copy_(torch.where(keep, self.ema_fake, self.pending[1]))
        self.initialized.copy_(self.initialized | ~keep)
        self.pending = None

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
