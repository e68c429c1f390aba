"""train_state.py, in-process: the training forward that DDP wraps (what it decodes, from which latent, and what it
freezes) and the EMA of the trained weights."""
from __future__ import annotations

import pytest
import torch

import train_state
from ae import AutoEncoder, AutoEncoderParams

PARAMS = dict(ch=16, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, norm_groups=8, use_attn=False)


def tiny(seed: int, **kw) -> AutoEncoder:
    torch.manual_seed(seed)
    return AutoEncoder(AutoEncoderParams(**{**PARAMS, **kw}))


@pytest.mark.parametrize("posterior", ["constant", "learned"])
def test_the_training_forward_decodes_the_transformed_sample_and_names_each_output(posterior):
    """Issue 32 item 2: the model computes (image -> reconstruction, mean, logvar), training composes: the
    reconstruction is the decode of latent_transform(sample), the added decode is of also_decode(sample) (before the
    transform), the teacher decodes the very latent the reconstruction came from, without gradient; each output
    named (Decoded), none recognised by its position."""
    vae = tiny(0, posterior=posterior, quant_conv=posterior == "learned").train()
    teacher = train_state.TeacherDecoder(tiny(1, posterior=posterior, quant_conv=posterior == "learned"))
    forward = train_state.TrainingForward(vae, teacher)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    shift = torch.randn(1, 4, 1, 1)
    torch.manual_seed(5)
    out = train_state.Decoded(*forward(x, latent_transform=lambda z: z.flip(-1) + shift,
                                       also_decode=lambda z: z[..., ::2, ::2]))
    with torch.no_grad():
        mean, logvar = vae.encode_moments(x)
        torch.manual_seed(5)
        z = vae.sample(mean, logvar)
        assert torch.equal(out.mean, mean) and (out.logvar is None) == (posterior == "constant")
        assert torch.equal(out.recon, vae.decode(z.flip(-1) + shift))
        assert torch.equal(out.added, vae.decode(z[..., ::2, ::2]))
        assert torch.equal(out.teacher, teacher.decode(z.flip(-1) + shift))
    assert out.recon.requires_grad and out.mean.requires_grad and not out.teacher.requires_grad
    assert not any(p.requires_grad for p in teacher.parameters())
    plain = train_state.Decoded(*train_state.TrainingForward(vae)(x))
    assert plain.added is None and plain.teacher is None
    # the model's own forward is the plain one: image -> (reconstruction, mean, logvar)
    torch.manual_seed(5)
    recon, model_mean, _ = vae(x)
    torch.manual_seed(5)
    assert torch.equal(recon, train_state.TrainingForward(vae)(x)[0]) and torch.equal(model_mean, mean)


def test_a_frozen_encoder_stays_frozen_and_in_eval_mode():
    """--train_parts decoder: the encoder and quant_conv take no gradient and stay in eval mode even after the
    trainer's train() (evaluation switches modes on its way out); the decoder trains."""
    vae = tiny(0, posterior="learned", quant_conv=True)
    forward = train_state.TrainingForward(vae, frozen_encoder=True).train()
    recon, mean, logvar, _, _, _ = forward(torch.rand(2, 3, 16, 16))
    recon.square().mean().backward()
    assert not vae.encoder.training and not vae.quant_conv.training and vae.decoder.training
    assert not mean.requires_grad and not logvar.requires_grad
    assert all(p.grad is None for p in [*vae.encoder.parameters(), *vae.quant_conv.parameters()])
    assert all(p.grad is not None for p in vae.decoder.parameters())


def test_ema_averages_the_trained_weights_and_skips_the_frozen_ones():
    """The EMA holds the weights that train (a frozen encoder's average is itself), leaves a rejected step out
    without a host sync (`skip` a tensor), and gives a whole state dict for export."""
    vae = tiny(0)
    vae.encoder.requires_grad_(False)
    ema = train_state.EMA(vae, 0.9)
    before = {n: t.clone() for n, t in ema.state_dict().items()}
    assert not any(n.startswith("encoder.") for n in before) and before
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(1.0)
    ema.update(vae, 1000, torch.ones(()))  # a step the guard rejected: no change
    assert all(torch.equal(ema.state_dict()[n], before[n]) for n in before)
    ema.update(vae, 1000, torch.zeros(()))  # decay min(0.9, 1001 / 1010)
    after = ema.state_dict()
    assert all(torch.allclose(after[n], before[n] + 0.1, atol=1e-6) for n in before)
    whole = ema.model_state_dict(vae)
    assert torch.equal(whole["encoder.conv_in.weight"], vae.encoder.conv_in.weight)  # frozen: as it is
