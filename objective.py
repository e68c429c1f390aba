"""The training objective: everything that turns (images, reconstructions, latent) into the loss the VAE
backpropagates (`VAEObjective`, like LDM/taming's LPIPSWithDiscriminator), the critic's owner (`Adversary`: the
critic network, its DDP wrapper, optimizer, schedule, scaler, LeCam and its own step), and the dataflow of one
micro-batch of a training step (`micro_step`: the forward, the critic's step, the VAE's loss and backward), which
the trainer runs and memory.py's estimate measures. The trainer does not know how the loss is composed.

    adversary = Adversary(cfg.critic, build_critic(cfg.critic, vgg_features), precision)  # None without --do_ganloss
    objective = VAEObjective(cfg.loss, cfg.latents, lpips, adversary, precision=precision)  # one config.Precision
    out = micro_step(objective, model, x, step, micro, accum, sync, regularisers, loss_scale, last_layer)

Adding a loss term: a weight field in config.LossConfig (that is the flag), and one block in
`VAEObjective.terms` that appends a `Term`. `compose` then backpropagates, totals and logs it for every
--loss_balance, and the log line shows it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ae import kl_divergence
from alignment import AlignmentLoss
from clips import frames_of
from common import load_optimizer_state
from config import FP32, CriticConfig, LatentsConfig, LossConfig, OptimConfig, Precision
from critics import (FeatureCriticHeads, NLayerDiscriminator, PatchGAN3D, VGG16Discriminator, build_lpips,
                     diff_augment, lpips_from_features, r1_penalty, vgg16_features)
from train_state import Decoded
from utils import (LeCam, LowpassMSE, adaptive_gan_weight, cosine_with_warmup, discriminator_accuracy,
                   discriminator_loss, gan_ramp, generator_active_fraction, generator_loss, gradnorm,
                   gradnorm_branches_through_one_pass, pooled_mse)


# ------------------------------------------------------------------------------------------ composing the terms
@dataclass
class Term:
    """One term of the VAE's loss, per micro-batch.

    balanced: a GradNorm branch. Its value was computed on `branch(weight)` (the reconstruction seen through
    GradNorm), so under --loss_balance gradnorm the weight sets its gradient's norm and it enters the sum
    unweighted; under adaptive/none it is weighted like any term. Unbalanced terms (the KL) are always weighted;
    under gradnorm also multiplied by `gradnorm_factor` (what makes them scale like the branches).
    adversarial: the generator's GAN term, which LDM's adaptive weight multiplies (--loss_balance adaptive).
    logs: further metrics of the term (its parts); `logged` False: only those are logged, not the value.
    shared_pass: under gradnorm its gradient reaches the VAE through the shared trunk's surrogate term
    (gradnorm_branches_through_one_pass), so the value itself stays out of the backward sum."""
    name: str  # logged as loss/<name>
    value: Tensor
    weight: float
    balanced: bool
    adversarial: bool = False
    gradnorm_factor: float = 1.0
    logged: bool = True
    logs: dict[str, Tensor] = field(default_factory=dict)
    shared_pass: bool = False


def _sum(tensors) -> Tensor:
    """A left fold (a + b) + c ...: the order of the additions is part of a bitwise-reproducible run."""
    tensors = list(tensors)
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def compose(terms: list[Term], balance: str, scale: Tensor, accum: int, last_layer: Tensor | None = None,
            adaptive_weight_max: float = 1e4) -> tuple[Tensor, dict[str, Tensor]]:
    """(the tensor to backpropagate, logs) from the terms, for --loss_balance `balance`. `scale`: the fp16 loss
    scale (1 otherwise); `accum`: micro-batches per step; `last_layer`: the decoder's last weight (adaptive).
    logs hold each term as loss/<name>, its parts, and loss/total = sum(weight * value), the same formula for
    every balance."""
    logs: dict[str, Tensor] = {}
    for t in terms:
        logs.update(t.logs)
        if t.logged:
            logs[f"loss/{t.name}"] = t.value
    if balance == "gradnorm":
        # The whole sum is scaled, so LPIPS' and the critic's fp16 backward passes run at the loss scale
        # (unscaled, their small gradients underflow). Each GradNorm renormalises what reaches it to its
        # weight, which carries the scale once: the VAE's gradient does not depend on this factor.
        backward = scale * _sum(t.value if t.balanced else t.weight * t.value * t.gradnorm_factor / accum
                                for t in terms if not t.shared_pass)
    else:
        rec = _sum(t.weight * t.value for t in terms if t.balanced and not t.adversarial)
        parts = [rec]
        for t in terms:
            if t.adversarial:
                weight = torch.full((), t.weight, device=scale.device)
                if balance == "adaptive":
                    weight = t.weight * adaptive_gan_weight(scale * rec, scale * t.value, last_layer,
                                                            adaptive_weight_max)
                    logs["loss/adaptive_weight"] = weight
                parts.append(weight * t.value)
            elif not t.balanced:
                parts.append(t.weight * t.value)
        backward = scale * (_sum(parts) / accum)
    logs["loss/total"] = _sum(t.weight * t.value for t in terms).detach()
    return backward, logs


@dataclass
class SharedTrunkPass:
    """--critic_trunk frozen: LPIPS' VGG16 run once on the images (no grad) and once on the reconstruction; LPIPS,
    the critic's step (detached) and the generator term all read these features. `leaf`: what recon_features
    were computed from: the reconstruction itself, or under gradnorm its detached copy, from which each branch's
    gradient is taken on its own (gradnorm_branches_through_one_pass)."""
    x_features: list[Tensor]
    recon_features: list[Tensor]
    leaf: Tensor


@dataclass
class MicroBatch:
    """What the objective computes one micro-batch's loss from (micro_step fills it from the forward and the critic's
    pass): the target images `x` (after a regulariser's transform) and their reconstruction `recon` (fp32); the
    posterior (`mean`, `logvar`: None for the constant one); the optimizer `step` and the micro-batches per step
    (`accum`); the critic's logits on these images and on the detached reconstructions (`real_logits`,
    `fake_logits`: Adversary.backward's, needed from --disc_start on); the fp16 GradScaler's `loss_scale` (None: 1);
    the decoder's last weight `last_layer` (--loss_balance adaptive); the encoder's output with its graph and its
    input (`latent`, `images`: for the alignment term, as they were before a regulariser transformed them; None:
    `mean`, `x`); `added` (downsampled image, its reconstruction in fp32) for the additive scale-equivariance term;
    `shared` the frozen trunk's features (shared_trunk_pass; --critic_trunk frozen); `teacher` a frozen decoder's
    reconstruction of the same latent, fp32 (--distill_weight); `clip_frames` the frames per clip when x and recon
    are clips' frames (clips.frames_of), and `recon_clips` the clips recon was folded from (a clip critic's input)."""
    x: Tensor
    recon: Tensor
    mean: Tensor
    logvar: Tensor | None
    step: int
    real_logits: Tensor | None = None
    fake_logits: Tensor | None = None
    accum: int = 1
    loss_scale: Tensor | None = None
    last_layer: Tensor | None = None
    latent: Tensor | None = None
    images: Tensor | None = None
    added: tuple[Tensor, Tensor] | None = None
    shared: SharedTrunkPass | None = None
    teacher: Tensor | None = None
    clip_frames: int = 0  # x and recon are clips' frames, clip by clip, this many per clip (0: images)
    recon_clips: Tensor | None = None  # recon as the (B, C, T, H, W) clips it was folded from: the 3D critic's input
    target_latent: Tensor | None = None  # --distill_from: the teacher's latent, the encoder's target (as `mean`)


# ------------------------------------------------------------------------------------------ the VAE's objective
class VAEObjective(nn.Module):
    """LPIPS + pooled MSE + low-pass MSE (each a GradNorm branch by default), the latent penalty, and the generator
    term against the adversary's critic, from the loss and latents sections (the generator term's settings are the
    adversary's own section, CriticConfig).

    lpips: LPIPS on VGG16 (critics.build_lpips), or None when no loss or metric uses it. `adversary`: the critic's
    owner (None: no GAN term). `alignment`: the VF branch (alignment.AlignmentLoss; None: off)."""

    def __init__(self, loss: LossConfig, latents: LatentsConfig, lpips: nn.Module | None = None,
                 adversary: Adversary | None = None, alignment: AlignmentLoss | None = None,
                 precision: Precision = FP32,
                 device: torch.device | str = "cpu", memory_format=torch.contiguous_format, with_kl: bool = True,
                 encoder_trains: bool = True):
        super().__init__()
        self.loss_cfg, self.latents_cfg = loss, latents
        self.with_kl = with_kl  # False: a deterministic encoder (--posterior none), whose latent has no KL term
        self.encoder_trains = encoder_trains  # False: --train_parts decoder (no latent term for a frozen encoder)
        self.device = torch.device(device)
        self.memory_format = memory_format
        self.precision = precision  # the run's (config.Precision, built once by the trainer)
        self.lpips = lpips
        self.lowpass_mse = LowpassMSE(loss.lowpass_threshold).to(device)  # its filters live on the device
        self.adversary = adversary
        self.alignment = alignment

    @classmethod
    def from_config(cls, loss: LossConfig, latents: LatentsConfig, critic: CriticConfig, precision: Precision = FP32,
                    vgg_features: dict | None = None, with_lpips: bool = True, device: torch.device | str = "cpu",
                    memory_format=torch.contiguous_format, z_channels: int = 16,
                    encoder_trains: bool = True, with_kl: bool = True) -> "VAEObjective":
        """The objective of a run's loss, latents and critic sections, with its loss networks built in this order
        (with random weights each draws from the global RNG): LPIPS (when `with_lpips`: a loss or the evaluation's
        metric wants it), the critic's owner (Adversary, with --do_ganloss), the alignment (--vf_weight, when the
        encoder trains: a frozen encoder's latent has no gradient; `z_channels`: the latent's channels).
        `vgg_features`: VGG16's `features` weights (None: random); `with_kl`: the posterior has a KL term (not a
        deterministic encoder's)."""
        lpips = build_lpips(vgg_features).to(device, memory_format=memory_format) if with_lpips else None
        adversary = (Adversary(critic, build_critic(critic, vgg_features), precision, device=device,
                               memory_format=memory_format) if critic.do_ganloss else None)
        alignment = (AlignmentLoss(z_channels, latents.vf_model, latents.vf_weights, latents.vf_image_size).to(device)
                     if latents.vf_weight > 0 and encoder_trains else None)
        return cls(loss, latents, lpips, adversary, alignment, precision, device, memory_format, with_kl,
                   encoder_trains)

    def autocast(self):
        return self.precision.autocast(self.device.type)

    def gan_active(self, step: int) -> bool:
        """Whether the generator gets the adversarial term at `step` (the critic itself trains from step 0)."""
        return self.adversary is not None and step >= self.loss_cfg.disc_start

    def shared_trunk_pass(self, x: Tensor, recon: Tensor, step: int) -> SharedTrunkPass | None:
        """The one VGG16 pass per image of the frozen-trunk critic (None with any other critic). The trainer hands
        its features to the critic's step (Adversary.backward) and to this objective (forward's `shared`)."""
        if self.adversary is None or not self.adversary.on_features:
            return None
        needs_grad = self.loss_cfg.perceptual_weight > 0 or self.gan_active(step)
        if self.loss_cfg.loss_balance == "gradnorm":
            leaf = recon.detach().requires_grad_(needs_grad)
        else:
            leaf = recon if needs_grad else recon.detach()
        with self.autocast():
            with torch.no_grad():
                x_features = vgg16_features(self.lpips, x.contiguous(memory_format=self.memory_format))
            with contextlib.nullcontext() if needs_grad else torch.no_grad():
                recon_features = vgg16_features(self.lpips, leaf.contiguous(memory_format=self.memory_format))
        return SharedTrunkPass(x_features, recon_features, leaf)

    def forward(self, batch: MicroBatch) -> tuple[Tensor, dict]:
        """(the tensor to backpropagate, {metric name: value} for logging) of one micro-batch (MicroBatch: what it
        holds). Without a regulariser in between, the alignment's latent is the posterior mean and its images x;
        with the frozen trunk and no `shared` pass given, the pass is made here."""
        scale = batch.loss_scale if batch.loss_scale is not None else torch.ones((), device=self.device)
        batch = dataclasses.replace(batch, latent=batch.mean if batch.latent is None else batch.latent,
                                    images=batch.x if batch.images is None else batch.images)
        if self.adversary is not None and self.adversary.on_features and batch.shared is None:
            batch = dataclasses.replace(batch, shared=self.shared_trunk_pass(batch.x, batch.recon, batch.step))
        return compose(self.terms(batch, scale), self.loss_cfg.loss_balance, scale, batch.accum, batch.last_layer,
                       self.loss_cfg.adaptive_weight_max)

    def terms(self, batch: MicroBatch, scale: Tensor) -> list[Term]:
        """The loss terms, one block each. Their order is the order of the sums (a fixed-seed run reproduces
        bitwise only with the same order). `scale`: the fp16 loss scale (1 otherwise)."""
        loss = self.loss_cfg
        x, recon, mean, logvar, step, accum = batch.x, batch.recon, batch.mean, batch.logvar, batch.step, batch.accum
        real_logits, critic_fake_logits = batch.real_logits, batch.fake_logits
        latent, images, added, shared, teacher = batch.latent, batch.images, batch.added, batch.shared, batch.teacher
        if loss.loss_balance == "gradnorm":
            # GradNorm fixes each branch's gradient norm, so a loss scale and 1/accum enter as weights
            def branch(weight, out=recon):
                return gradnorm(out, scale * (weight / accum))
        else:
            def branch(weight, out=recon):
                return out
        kl = kl_divergence(mean, logvar)  # per latent element, over the micro-batch's mean.numel() elements
        terms = []
        # the frozen trunk's features serve LPIPS and the generator term: under gradnorm each branch's gradient
        # is normalised on its own below, the others backpropagate through the one pass like any loss
        through_shared = shared is not None and loss.loss_balance == "gradnorm"
        shared_branches = []  # (loss, GradNorm weight) of the branches computed on shared.leaf

        if loss.perceptual_weight > 0:  # weight 0: no VGG16 pass at all (pixel-only steps are ~6x cheaper)
            with self.autocast():
                if shared is not None:
                    perceptual = lpips_from_features(self.lpips, shared.recon_features,
                                                     shared.x_features).float().mean()
                else:
                    perceptual = self.lpips(
                        branch(loss.perceptual_weight).contiguous(memory_format=self.memory_format), x).float().mean()
            terms.append(Term("perceptual", perceptual, loss.perceptual_weight, balanced=True,
                              shared_pass=through_shared))
            shared_branches.append((perceptual, loss.perceptual_weight))

        pixel_in = branch(loss.mse_weight)
        pooled = pooled_mse(pixel_in, x, loss.mse_pool_factor)
        lowpass = self.lowpass_mse(pixel_in, x)
        terms.append(Term("pixel", loss.pooled_mse_weight * pooled + loss.lowpass_mse_weight * lowpass,
                          loss.mse_weight, balanced=True, logged=False,
                          logs={"loss/pooled_mse": pooled, "loss/lowpass_mse": lowpass}))

        if loss.temporal_weight > 0 and batch.clip_frames > 1:
            # the frame-difference error of clips: a GradNorm branch like the pixel one (what it buys:
            # BENCHMARKS.md section 12)
            recon_clips = branch(loss.temporal_weight).unflatten(0, (-1, batch.clip_frames))
            x_clips = x.unflatten(0, (-1, batch.clip_frames))
            temporal = ((recon_clips[:, 1:] - recon_clips[:, :-1]) - (x_clips[:, 1:] - x_clips[:, :-1])).square()
            terms.append(Term("temporal", temporal.mean(), loss.temporal_weight, balanced=True))

        if teacher is not None:
            # distillation: the reconstruction pulled toward the teacher decoder's of the same latent, a GradNorm
            # branch like the pixel one (what the teacher adds: the detail a narrower decoder cannot find alone)
            distill = (branch(loss.distill_weight) - teacher).square().mean()
            terms.append(Term("distill", distill, loss.distill_weight, balanced=True))

        if added is not None:
            # Skorokhodov et al.'s alpha * L_rec(down(x), D(down(z))): the reconstruction losses (LPIPS and pixel)
            # of the downsampled latent's decode, each a branch of alpha x its full-resolution weight; the critic
            # judges full-resolution images only
            small_x, small_recon = added
            alpha = self.latents_cfg.scale_equivariance_weight
            if loss.perceptual_weight > 0:
                with self.autocast():
                    perceptual = self.lpips(branch(alpha * loss.perceptual_weight, small_recon).contiguous(
                        memory_format=self.memory_format), small_x).float().mean()
                terms.append(Term("se_perceptual", perceptual, alpha * loss.perceptual_weight, balanced=True))
            small_in = branch(alpha * loss.mse_weight, small_recon)
            pooled, lowpass = pooled_mse(small_in, small_x, loss.mse_pool_factor), self.lowpass_mse(small_in, small_x)
            terms.append(Term("se_pixel", loss.pooled_mse_weight * pooled + loss.lowpass_mse_weight * lowpass,
                              alpha * loss.mse_weight, balanced=True, logged=False,
                              logs={"loss/se_pooled_mse": pooled, "loss/se_lowpass_mse": lowpass}))

        if self.gan_active(step):
            # GradNorm would give the GAN branch norm gan_weight however few patches the thresholded loss still
            # pushes, i.e. hand the last active patch the whole push. Scaled by sqrt(active fraction), the target
            # gives each active patch the push it gets when all are active (patch gradients are near-orthogonal).
            # Measured on the critic's pass over the detached reconstructions: the same critic, the same images.
            active = generator_active_fraction(real_logits, critic_fake_logits, loss.gen_loss, loss.gan_margin)
            # --gan_ramp_steps: the weight grows linearly after disc_start (1.0 with the reference's step function)
            gan_weight = loss.gan_weight * gan_ramp(step, loss.disc_start, loss.gan_ramp_steps)
            with self.autocast():  # the objective's precision, like every loss network's pass here
                # a clip critic reads the clips the frames were folded from: the same values and gradient, and
                # no copy back into the (B, C, T, H, W) layout its Conv3d needs
                clips = batch.recon_clips if self.adversary.on_clips else None
                fake = (shared.recon_features if shared is not None else
                        branch(gan_weight * active.sqrt(), recon if clips is None else clips))
                fake_logits = self.adversary.generator_logits(fake, batch.clip_frames)
            g_loss = generator_loss(fake_logits, real_logits, loss.gen_loss, loss.gan_margin)
            terms.append(Term("gan_g", g_loss, gan_weight, balanced=True, adversarial=True, shared_pass=through_shared,
                              logs={"gan/active_fraction": active}))
            shared_branches.append((g_loss, gan_weight * active.sqrt()))

        if through_shared and shared_branches:
            # the scaled losses keep fp16's trunk backward above underflow; GradNorm removes the scale again
            surrogate = gradnorm_branches_through_one_pass(
                recon, shared.leaf, [(scale * value, scale * (weight / accum)) for value, weight in shared_branches])
            # value 0 (the total stays the sum of the real terms), gradient: the normalised branches
            terms.append(Term("vgg16_branches", surrogate - surrogate.detach(), 1.0, balanced=True, logged=False))

        if self.alignment is not None:
            # a GradNorm branch at the latent (AlignmentLoss applies it; --vf_weight requires gradnorm): its
            # gradient into the encoder has norm vf_weight, so it enters the sum unweighted like the others
            vf_weight = self.latents_cfg.vf_weight
            vf, parts = self.alignment(latent, images, scale * (vf_weight / accum))
            terms.append(Term("vf", vf, vf_weight, balanced=True, logs={f"loss/{k}": v for k, v in parts.items()}))

        if batch.target_latent is not None and self.encoder_trains:
            # --distill_from: the student encoder learns the teacher's latent (its only loss: the decoder decodes the
            # teacher's latent, so no reconstruction gradient reaches the encoder)
            latent_mse = (mean.float() - batch.target_latent).square().mean()
            terms.append(Term("latent", latent_mse, loss.distill_latent_weight, balanced=False))

        # A GradNorm branch's gradient has norm `weight` over all the reconstruction's elements, so its per-element
        # size falls as 1/sqrt(their count); a mean KL's would fall as 1/count. Summed and divided by sqrt(count)
        # (gradnorm_factor), the KL scales like the branches: kl_weight means the same at any batch and resolution.
        if self.with_kl:
            terms.append(Term("kl", kl, loss.kl_weight, balanced=False, gradnorm_factor=math.sqrt(mean.numel())))
        return terms

    # kept for callers that freeze the critic through the objective (bench.py)
    def critic_frozen(self):
        return self.adversary.frozen() if self.adversary is not None else contextlib.nullcontext()

    @property
    def critic(self) -> nn.Module | None:
        return self.adversary.critic if self.adversary is not None else None


# ------------------------------------------------------------------------------------------ the critic's owner
CRITICS = {  # --discriminator -> its network, from the CriticConfig and the VGG16 `features` weights
    # frozen: only the heads; their trunk is LPIPS' (VAEObjective.shared_trunk_pass)
    "vgg16": lambda cfg, vgg_features: (FeatureCriticHeads() if cfg.critic_trunk == "frozen"
                                        else VGG16Discriminator(vgg_features)),
    "patchgan": lambda cfg, vgg_features: NLayerDiscriminator(norm=cfg.disc_norm),
    # judges whole clips: the Adversary gives it micro_step's frames folded back into clips (clips_of)
    "patchgan3d": lambda cfg, vgg_features: PatchGAN3D(norm=cfg.disc_norm),
}
CLIP_CRITICS = ("patchgan3d",)


def clips_of(frames: Tensor, clip_frames: int) -> Tensor:
    """(B * T, C, H, W) frames, clip by clip (clips.frames_of) -> (B, C, T, H, W) clips: its inverse, a view (no
    copy). `clip_frames` 0 (images) reads each image as a one-frame clip."""
    return frames.unflatten(0, (-1, max(clip_frames, 1))).transpose(1, 2)


def build_critic(cfg: CriticConfig, vgg_features: dict[str, Tensor] | None) -> nn.Module:
    return CRITICS[cfg.discriminator](cfg, vgg_features)


class Adversary:
    """Everything about the critic: its network (any kind in CRITICS: the trainer only calls this class), the DDP
    wrapper, AdamW, the warm-up/cosine schedule, the (fp16) GradScaler, LeCam, its loss and backward, and its
    guarded optimizer step. A checkpoint entry ("adversary")."""

    def __init__(self, cfg: CriticConfig, critic: nn.Module, precision: Precision = FP32,
                 device: torch.device | str = "cpu", memory_format=torch.contiguous_format):
        self.cfg, self.device, self.memory_format = cfg, torch.device(device), memory_format
        self.precision = precision  # the run's (config.Precision), the objective's too
        # --critic_trunk frozen: the critic reads the shared trunk's feature lists instead of images
        self.on_features = cfg.discriminator == "vgg16" and cfg.critic_trunk == "frozen"
        self.on_clips = cfg.discriminator in CLIP_CRITICS  # reads (B, C, T, H, W) clips, not frames
        if self.on_clips:  # (channels_last is 4-D only; the video VAE's Conv3d is contiguous too)
            self.memory_format = memory_format = torch.contiguous_format
        self.critic = critic.to(device, memory_format=memory_format)
        self.critic_ddp = self.critic  # the module the critic's pass runs (its DDP wrapper under torchrun)
        self.lecam = LeCam().to(device) if cfg.lecam_weight > 0 else None
        self.optimizer = self.scheduler = None
        self.scaler = precision.grad_scaler(self.device.type)
        # the buffers a forward pass moves (spectral norm's power iteration, BatchNorm's statistics), and their
        # values at the start of the step (step_began), for a step abandoned before its end (abandon_step)
        self.moved_by_forward = moved_by_forward(self.critic)
        self.at_step_start = [b.clone() for b in self.moved_by_forward]
        # spectral norm's modules: their power iteration runs in the step's first forward only (one_iteration_done)
        self.spectral = [m for m in self.critic.modules() if hasattr(m, "weight_u") or is_spectral_parametrization(m)]

    def prepare_training(self, optim: OptimConfig, make_optimizer, wrap_ddp=lambda m: m) -> None:
        """The DDP wrapper, the optimizer (`make_optimizer(params, lr)`) and the schedule, for training."""
        self.critic_ddp = wrap_ddp(self.critic)
        self.optimizer = make_optimizer(self.critic.parameters(), self.cfg.learning_rate_disc)
        schedule = cosine_with_warmup(optim.warmup_steps, optim.max_steps, optim.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def autocast(self):
        return self.precision.autocast(self.device.type)

    def critic_input(self, images_or_features):
        """What the critic reads: the images (DiffAugment applied with --diffaug), or the frozen trunk's features."""
        if self.on_features:
            return images_or_features
        if self.cfg.diffaug:
            images_or_features = diff_augment(images_or_features, self.cfg.diffaug)
        return images_or_features.contiguous(memory_format=self.memory_format)

    def loss(self, x, recon, clip_frames: int = 0):
        """The critic's loss on real `x` vs the detached `recon` (LeCam and R1 included), its logits (detached, for
        the generator term) and logs. `x`, `recon`: images, or with the frozen trunk their feature lists; clips'
        frames, `clip_frames` per clip (0: images), which a clip critic reads folded back into clips (R1 per clip), or
        the (B, C, T, H, W) clips themselves (micro_step's, for a clip critic: no fold to copy)."""
        if self.on_clips and x.dim() == 4:  # (micro_step hands a clip critic the clips themselves)
            x, recon = clips_of(x, clip_frames), clips_of(recon, clip_frames)
        if self.on_features:
            real, fake = [f.detach() for f in x], [f.detach() for f in recon]
            if self.cfg.r1_weight > 0:  # R1 on the features: its double backward only crosses the heads
                real = [f.requires_grad_(True) for f in real]
            both = [torch.cat(pair) for pair in zip(real, fake)]
        else:
            real, fake = x, recon.detach()
            if self.cfg.r1_weight > 0:
                real = real.detach().requires_grad_(True)
            both = torch.cat([real, fake])
        with self.autocast():
            logits = self.critic_ddp(self.critic_input(both))
        self.one_iteration_done()
        real_logits, fake_logits = logits.float().chunk(2)
        d_loss = discriminator_loss(real_logits, fake_logits, self.cfg.disc_type)
        if self.lecam is not None:
            self.lecam.update(real_logits, fake_logits)
            d_loss = d_loss + self.cfg.lecam_weight * self.lecam.penalty(real_logits, fake_logits)
        logs = {"loss/disc": d_loss, "gan/disc_acc": discriminator_accuracy(real_logits, fake_logits),
                "gan/real_logits": real_logits.mean(), "gan/fake_logits": fake_logits.mean()}
        if self.cfg.r1_weight > 0:
            r1 = r1_penalty(real_logits, real)
            d_loss = d_loss + self.cfg.r1_weight / 2 * r1
            logs["gan/r1"] = r1.detach()
        return d_loss, real_logits.detach(), fake_logits.detach(), logs

    def backward(self, x: Tensor, recon: Tensor, sync: bool, accum: int, backward: bool = True,
                 clip_frames: int = 0):
        """The critic's loss and (unless not `backward`: memory.py's estimate) its backward on one micro-batch
        (DDP's all-reduce only when `sync`): its loss, its logits for the generator term, and logs (per
        micro-batch). `clip_frames`: Adversary.loss's."""
        with no_sync_unless(self.critic_ddp, sync):
            d_loss, real_logits, fake_logits, logs = self.loss(x, recon, clip_frames)
            if backward:
                self.scaler.scale(d_loss / accum).backward()
        return d_loss, real_logits, fake_logits, logs

    def generator_logits(self, fake, clip_frames: int = 0) -> Tensor:
        """The critic's logits on reconstructions (or, frozen trunk, their features) that keep their graph (the
        generator's term), in fp32; under the caller's autocast (the objective's). `clip_frames`: Adversary.loss's."""
        if self.on_clips and fake.dim() == 4:
            fake = clips_of(fake, clip_frames)
        logits = self.critic(self.critic_input(fake)).float()
        self.one_iteration_done()
        return logits

    def one_iteration_done(self) -> None:
        """Spectral norm's power iteration runs once per step, in its first forward, whatever the micro-batches:
        the later forwards normalise by the same u and v (its modules out of training mode, which only the
        iteration reads). A step of 2 micro-batches on one rank then moves the critic as 2 ranks of one do: a run
        resumed on fewer GPUs continues exactly (step_began arms the next step's iteration)."""
        for module in self.spectral:
            module.training = False

    @contextlib.contextmanager
    def frozen(self):
        """The critic's weights take no gradient inside (the generator's pass and its backward): its weight
        gradients are then neither computed (time) nor added to the ones of its own loss."""
        self.critic.requires_grad_(False)
        try:
            yield
        finally:
            self.critic.requires_grad_(True)

    def step_began(self) -> None:
        """Remember what the step's forward passes will move (one fused copy of a few KB; nothing when the critic
        has no such buffers, as the trainable VGG16 critic)."""
        if self.moved_by_forward:
            torch._foreach_copy_(self.at_step_start, self.moved_by_forward)
        for module in self.spectral:
            module.training = self.critic.training

    def abandon_step(self) -> None:
        """Undo what an abandoned step (an out-of-memory error in its middle) moved: the checkpoint of the last
        completed step then holds the critic as that step left it. LeCam's pending anchors and the gradients are
        never saved; the optimizer has not stepped."""
        if self.moved_by_forward:
            torch._foreach_copy_(self.moved_by_forward, self.at_step_start)
        if self.lecam is not None:
            self.lecam.abandon()

    def step(self, bad: Tensor, step_optimizer) -> None:
        """The guarded optimizer step (`step_optimizer(optimizer, scaler, bad)`), LeCam's anchors, the schedule. A
        skipped step (`bad`, a device flag: no host sync) also leaves what the step's forward passes moved as the
        step found it (spectral norm's vectors, BatchNorm's statistics: a NaN batch would poison them for good), so
        that the critic after a skipped step is the critic before it, whichever kind."""
        step_optimizer(self.optimizer, self.scaler, bad)
        if self.moved_by_forward:  # (one where per buffer of a few KB; nothing for the trainable VGG16 critic)
            skipped = bad > 0
            for now, start in zip(self.moved_by_forward, self.at_step_start):
                torch.where(skipped, start, now, out=now)
        if self.lecam is not None:
            self.lecam.commit(skip=bad)  # the anchors move only with a step the critic took
        self.scheduler.step()

    def kind(self) -> dict:
        """What must match for the critic to resume (config.CriticConfig.kind)."""
        return self.cfg.kind()

    def state_dict(self) -> dict:
        return {"critic": self.critic.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "lecam": self.lecam.state_dict() if self.lecam is not None else None, "kind": self.kind()}

    def load_state_dict(self, state: dict | None, path: str = "", log=print) -> None:
        """The critic resumes only from a checkpoint of the same kind; LeCam's anchors whenever saved. (None: a
        checkpoint without a critic; it starts afresh.)"""
        if state is None:
            return
        same_kind = state["kind"] == self.kind()
        if not same_kind:
            log("warning: the checkpoint's discriminator is of another kind; the critic starts from scratch")
        else:
            self.critic.load_state_dict(state["critic"])
            load_optimizer_state(self.optimizer, state["optimizer"])  # (its moments as the critic's layout)
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler.is_enabled() and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        if self.lecam is not None and state.get("lecam") is not None:
            self.lecam.load_state_dict(state["lecam"])


def is_spectral_parametrization(module: nn.Module) -> bool:
    """torch.nn.utils.parametrizations.spectral_norm's module (the newer API; critics.py uses the hook's)."""
    return type(module).__name__ == "_SpectralNorm"


def moved_by_forward(module: nn.Module) -> list[Tensor]:
    """The buffers of `module` that a training-mode forward pass changes: spectral norm's u and v vectors (updated
    by its power iteration before each forward) and BatchNorm's running statistics. Fixed buffers (the frozen
    critic's random projections) are left out."""
    moved = []
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            batch_norm = isinstance(sub, nn.modules.batchnorm._BatchNorm)
            spectral = name in ("_u", "_v") or (name.endswith(("_u", "_v")) and hasattr(sub, name[:-2] + "_orig"))
            if batch_norm or spectral:  # (the parametrizations API's spectral norm, or the older hook's)
                moved.append(buffer)
    return moved


def no_sync_unless(ddp_module, sync: bool):
    """DDP's no_sync (skip the gradient all-reduce) on the micro-batches before the last one."""
    if sync or not hasattr(ddp_module, "no_sync"):
        return contextlib.nullcontext()
    return ddp_module.no_sync()


# ------------------------------------------------------------------------------------------ one micro-batch
@dataclass
class MicroStep:
    """What one micro-batch of a step gave: its losses (detached: the critic's, then the VAE's, for the guard),
    the logs of the critic and of the objective (per micro-batch), and the posterior (for the latent metrics)."""
    critic_loss: Tensor | None
    loss: Tensor
    critic_logs: dict
    logs: dict
    mean: Tensor
    logvar: Tensor | None


def micro_step(objective: VAEObjective, model: nn.Module, x: Tensor, step: int, micro: int, accum: int, sync: bool,
               regularisers, loss_scale: Tensor, last_layer: Tensor, phase=None, backward: bool = True) -> MicroStep:
    """One micro-batch of a training step: the latent regularisers' draws, the forward of `model` (the module DDP
    wraps: train_state.TrainingForward, with the alignment's projection), the critic's loss and
    backward on real vs detached reconstructions (its frozen trunk's pass shared with LPIPS), then the VAE's loss
    and backward with the critic frozen. DDP all-reduces on the last micro-batch only (`sync`). The trainer runs it
    for every micro-batch; memory.py runs it at small sizes to measure what autograd keeps, with `phase(name)` a
    context around each part ("forward", "critic", "loss") and no backward."""
    phase = phase or (lambda name: contextlib.nullcontext())
    images = x
    with no_sync_unless(model, sync):
        # latents.py's regularisers: the losses below see the transformed image (x unchanged when off)
        target, to_decoder = regularisers.draw(x, step, micro)
        added = regularisers.draw_added(x, step, micro)  # (small image, latent transform) or None
        with phase("forward"), objective.autocast():
            out = Decoded(*model(x, latent_transform=to_decoder, also_decode=added and added[1]))
        mean, logvar, target_latent = out.mean, out.logvar, out.target_latent
        x, recon = target, out.recon.float()  # every loss reduces in fp32
        # clips: the losses (a loss per frame; the KL per latent element is the KL over the latent clip), the critic
        # and the latent statistics see their frames as images
        clip_frames = x.shape[2] if x.dim() == 5 else 0
        x_clips, recon_clips = (x, recon) if clip_frames else (None, None)  # (what a clip critic reads)
        if clip_frames:
            untransformed = images is x  # (no regulariser: one fold of the clips serves both)
            x = frames_of(x)
            images = x if untransformed else frames_of(images)
            recon, mean = frames_of(recon), frames_of(mean)
            logvar = frames_of(logvar) if logvar is not None else None
            target_latent = frames_of(target_latent) if target_latent is not None else None
        real_logits = fake_logits = d_loss = None
        critic_logs = {}
        with phase("critic"):
            shared = objective.shared_trunk_pass(x, recon, step)  # --critic_trunk frozen: one VGG16 pass
            if objective.adversary is not None:  # the critic learns real vs detached fakes, every step
                critic_x, critic_recon = (shared.x_features, shared.recon_features) if shared else (x, recon)
                if objective.adversary.on_clips and clip_frames:
                    critic_x, critic_recon = x_clips, recon_clips
                d_loss, real_logits, fake_logits, critic_logs = objective.adversary.backward(
                    critic_x, critic_recon, sync, accum, backward, clip_frames)
                d_loss = d_loss.detach()
        with phase("loss"), objective.critic_frozen():
            loss, logs = objective(MicroBatch(
                x, recon, mean, logvar, step, real_logits, fake_logits, accum, loss_scale, last_layer, latent=mean,
                images=images, added=(added[0], out.added.float()) if added else None, shared=shared,
                teacher=out.teacher.float() if out.teacher is not None else None, clip_frames=clip_frames,
                recon_clips=recon_clips, target_latent=target_latent))
            if backward:
                loss.backward()
    return MicroStep(d_loss, loss.detach(), critic_logs, logs, mean, logvar)
