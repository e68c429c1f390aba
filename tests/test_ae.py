"""Unit tests of ae.py: shapes, FLUX parameter layout, the posterior, KL, fp32 GroupNorm, clamping and
gradient checkpointing. CPU only, tiny configs (except the FLUX config, built on the meta device)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ae
import families
import layouts
from ae import AutoEncoder, AutoEncoderParams, GroupNorm32, kl_divergence
from conftest import record_ops


def tiny_params(**overrides) -> AutoEncoderParams:
    kwargs = dict(ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, use_attn=True, norm_groups=8)
    kwargs.update(overrides)
    return AutoEncoderParams(**kwargs)


def tiny_model(seed: int = 0, **overrides) -> AutoEncoder:
    torch.manual_seed(seed)
    return AutoEncoder(tiny_params(**overrides)).eval()


# --------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ch_mult,use_attn,posterior,hw", [
    ((1, 2), False, "constant", (16, 24)),
    ((1, 2, 2), True, "learned", (32, 20)),
    ((1, 1, 2, 2), True, "constant", (32, 48)),
    ((1, 2, 2, 2), False, "learned", (24, 40)),
])
def test_shapes(ch_mult, use_attn, posterior, hw):
    model = tiny_model(ch_mult=ch_mult, use_attn=use_attn, posterior=posterior, z_channels=6)
    factor = 2 ** (len(ch_mult) - 1)
    assert model.downsample_factor == factor == model.params.downsample_factor
    x = torch.randn(2, 3, *hw)
    with torch.no_grad():
        recon, mean, logvar = model(x)
        z = model.encode(x)
    h, w = hw[0] // factor, hw[1] // factor
    assert mean.shape == z.shape == (2, 6, h, w)
    assert recon.shape == x.shape
    if posterior == "learned":
        assert logvar.shape == mean.shape and logvar.dtype == torch.float32
    else:
        assert logvar is None
    with torch.no_grad():
        assert model.decode(torch.randn(1, 6, 3, 5)).shape == (1, 3, 3 * factor, 5 * factor)
    # attention present exactly when asked for
    assert isinstance(model.encoder.mid.attn_1, ae.AttnBlock) == use_attn
    assert isinstance(model.decoder.mid.attn_1, ae.AttnBlock) == use_attn


def test_params_round_trip_and_bad_posterior():
    p = AutoEncoderParams(ch=64, ch_mult=(1, 2, 4), posterior="learned", posterior_var=0.25, clamp_th=3.0)
    d = p.to_dict()
    assert d["ch_mult"] == [1, 2, 4]
    assert AutoEncoderParams.from_dict(d) == p
    with pytest.raises(ValueError):
        AutoEncoder(tiny_params(posterior="gaussian"))


# --------------------------------------------------------------------------------------------
# FLUX / LDM parameter layout
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_shapes() -> dict:
    with torch.device("meta"):  # 84M parameters: shapes only, no memory, no init time
        model = AutoEncoder(AutoEncoderParams(posterior="learned"))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_default_params_are_flux():
    p = AutoEncoderParams()
    assert (p.ch, p.ch_mult, p.num_res_blocks, p.z_channels, p.use_attn) == (128, (1, 2, 4, 4), 2, 16, True)
    assert p.downsample_factor == 8


def test_flux_parameter_count(flux_shapes):
    # The released FLUX.1 VAE (ae.safetensors) has 83,819,683 parameters.
    assert sum(math.prod(s) for s in flux_shapes.values()) == 83_819_683
    with torch.device("meta"):
        constant = AutoEncoder(AutoEncoderParams(posterior="constant"))
    # the constant posterior's encoder predicts 16 instead of 32 channels: 16 * 512 * 3 * 3 + 16 fewer
    assert sum(p.numel() for p in constant.parameters()) == 83_819_683 - (16 * 512 * 9 + 16)


def test_flux_parameter_names(flux_shapes):
    expected = {
        "encoder.conv_in.weight": (128, 3, 3, 3),
        "encoder.down.0.block.0.norm1.weight": (128,),
        "encoder.down.0.block.0.conv1.weight": (128, 128, 3, 3),
        "encoder.down.0.downsample.conv.weight": (128, 128, 3, 3),
        "encoder.down.1.block.0.nin_shortcut.weight": (256, 128, 1, 1),
        "encoder.down.2.downsample.conv.weight": (512, 512, 3, 3),
        "encoder.mid.block_1.norm1.weight": (512,),
        "encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        "encoder.mid.attn_1.k.weight": (512, 512, 1, 1),
        "encoder.mid.attn_1.v.weight": (512, 512, 1, 1),
        "encoder.mid.attn_1.proj_out.weight": (512, 512, 1, 1),
        "encoder.mid.attn_1.norm.weight": (512,),
        "encoder.norm_out.weight": (512,),
        "encoder.conv_out.weight": (32, 512, 3, 3),
        "decoder.conv_in.weight": (512, 16, 3, 3),
        "decoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        "decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
        "decoder.up.3.block.0.conv1.weight": (512, 512, 3, 3),
        "decoder.up.1.block.0.nin_shortcut.weight": (256, 512, 1, 1),
        "decoder.up.0.block.0.nin_shortcut.weight": (128, 256, 1, 1),
        "decoder.up.0.block.2.conv2.weight": (128, 128, 3, 3),
        "decoder.up.1.upsample.conv.weight": (256, 256, 3, 3),
        "decoder.norm_out.weight": (128,),
        "decoder.conv_out.weight": (3, 128, 3, 3),
    }
    for name, shape in expected.items():
        assert flux_shapes.get(name) == shape, name
    names = set(flux_shapes)
    # the highest-resolution decoder level has no upsample, the lowest encoder level no downsample
    assert not any(n.startswith("decoder.up.0.upsample") for n in names)
    assert not any(n.startswith("encoder.down.3.downsample") for n in names)
    # 2 res blocks per encoder level, 3 per decoder level
    assert not any(n.startswith("encoder.down.0.block.2.") for n in names)
    assert any(n.startswith("decoder.up.3.block.2.") for n in names)
    assert not any(n.startswith("decoder.up.3.block.3.") for n in names)
    # every parameter sits under encoder. or decoder. (no quant_conv or extras in the FLUX layout)
    assert all(n.split(".")[0] in ("encoder", "decoder") for n in names)


# --------------------------------------------------------------------------------------------
# posterior and sampling
# --------------------------------------------------------------------------------------------
def test_constant_variance_sampler_statistics():
    model = tiny_model(posterior="constant", posterior_var=0.1)
    torch.manual_seed(1)
    mean = torch.randn(1, 4, 3, 3) * 2
    n = 40_000
    z = model.sample(mean.expand(n, -1, -1, -1), None)
    assert z.dtype == torch.float32 and z.shape == (n, 4, 3, 3)
    std = math.sqrt(0.1)
    # standard error of the mean: std / sqrt(n) = 0.0016; of the std: std / sqrt(2n) = 0.0011
    torch.testing.assert_close(z.mean(0, keepdim=True), mean, rtol=0, atol=6 * std / math.sqrt(n))
    torch.testing.assert_close(z.std(0), torch.full((4, 3, 3), std), rtol=0, atol=6 * std / math.sqrt(2 * n))
    assert model.posterior_std(None) == pytest.approx(std)


def test_learned_variance_sampler_statistics():
    model = tiny_model(posterior="learned")
    torch.manual_seed(2)
    mean = torch.randn(1, 4, 2, 2)
    logvar = torch.linspace(-4, 1, 16).view(1, 4, 2, 2)
    n = 40_000
    z = model.sample(mean.expand(n, -1, -1, -1), logvar.expand(n, -1, -1, -1))
    expected_std = torch.exp(0.5 * logvar)[0]
    torch.testing.assert_close(z.mean(0, keepdim=True), mean, rtol=0,
                               atol=(6 * expected_std.max() / math.sqrt(n)).item())
    torch.testing.assert_close(z.std(0), expected_std, rtol=6 / math.sqrt(2 * n), atol=0)


def test_sample_is_fp32_for_bf16_mean():
    model = tiny_model()
    mean = torch.randn(2, 4, 3, 3).bfloat16()
    torch.manual_seed(0)
    z = model.sample(mean, None)
    assert z.dtype == torch.float32
    torch.manual_seed(0)
    noise = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(z, mean.float() + math.sqrt(0.1) * noise, rtol=0, atol=1e-6)


@pytest.mark.parametrize("posterior", ["constant", "learned"])
def test_encode_is_deterministic_and_forward_without_sample_uses_mean(posterior):
    model = tiny_model(posterior=posterior)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        z1 = model.encode(x)
        torch.manual_seed(123)
        z2 = model.encode(x)
        mean, logvar = model.encode_moments(x)
        assert torch.equal(z1, z2) and torch.equal(z1, mean)
        recon, mean_f, logvar_f = model(x, sample=False)
        assert torch.equal(mean_f, mean)
        assert torch.equal(recon, model.decode(mean))
        # forward(sample=True) decodes mean + std * noise with that exact noise
        torch.manual_seed(7)
        recon_s, _, _ = model(x, sample=True)
        torch.manual_seed(7)
        z = mean + model.posterior_std(logvar) * torch.randn(mean.shape)  # (drawn in NCHW order)
        assert torch.allclose(recon_s, model.decode(z), atol=1e-6)
        assert not torch.allclose(recon_s, recon, atol=1e-4)


# --------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------
def test_kl_constant_posterior():
    mean = torch.tensor([[0.0, 1.0], [-2.0, 3.0]])
    # mean(0.5 * m^2) = 0.5 * (0 + 1 + 4 + 9) / 4
    assert kl_divergence(mean, None).item() == pytest.approx(14 / 8, rel=1e-7)
    m = torch.randn(3, 4, 5, 6)
    assert kl_divergence(m, None).item() == pytest.approx((0.5 * m.double() ** 2).mean().item(), rel=1e-6)


def test_kl_learned_posterior_closed_form():
    torch.manual_seed(0)
    mu, logvar = torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5) * 2
    mu64, sigma64 = mu.double(), torch.exp(0.5 * logvar.double())
    # KL(N(mu, s^2) || N(0, 1)) = log(1/s) + (s^2 + mu^2) / 2 - 1/2, per element
    expected = (-torch.log(sigma64) + (sigma64 ** 2 + mu64 ** 2) / 2 - 0.5).mean().item()
    kl = kl_divergence(mu, logvar)
    assert kl.dtype == torch.float32 and kl.dim() == 0
    assert kl.item() == pytest.approx(expected, rel=1e-5)
    # zero exactly at the prior
    assert kl_divergence(torch.zeros(3, 3), torch.zeros(3, 3)).item() == 0.0


def test_kl_under_bf16_autocast_is_fp32():
    torch.manual_seed(0)
    mu, logvar = torch.randn(2, 4, 8, 8).bfloat16(), (torch.randn(2, 4, 8, 8) * 3).bfloat16()
    reference_learned = kl_divergence(mu.float(), logvar.float())
    reference_constant = kl_divergence(mu.float(), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        learned = kl_divergence(mu, logvar)
        constant = kl_divergence(mu, None)
    assert learned.dtype == constant.dtype == torch.float32
    assert learned.item() == pytest.approx(reference_learned.item(), rel=1e-6)
    assert constant.item() == pytest.approx(reference_constant.item(), rel=1e-6)


def _set_encoder_output_bias(model: AutoEncoder, bias: torch.Tensor) -> None:
    with torch.no_grad():
        model.encoder.conv_out.weight.zero_()
        model.encoder.conv_out.bias.copy_(bias)


def test_learned_logvar_is_clamped():
    model = tiny_model(posterior="learned", z_channels=2)
    # output channels: [mean (2), logvar (2)]
    _set_encoder_output_bias(model, torch.tensor([0.0, 0.0, 100.0, -100.0]))
    with torch.no_grad():
        mean, logvar = model.encode_moments(torch.randn(1, 3, 16, 16))
    assert logvar.dtype == torch.float32
    assert torch.all(logvar[:, 0] == 20.0) and torch.all(logvar[:, 1] == -30.0)
    assert ae.LOGVAR_RANGE == (-30.0, 20.0)


def test_clamp_th_bounds_posterior_mean():
    x = torch.randn(2, 3, 16, 16)
    bias = torch.tensor([50.0, -50.0, 0.2, -0.3])
    unclamped = tiny_model(clamp_th=0.0)
    _set_encoder_output_bias(unclamped, bias)
    clamped = tiny_model(clamp_th=0.5)
    _set_encoder_output_bias(clamped, bias)
    with torch.no_grad():
        m0 = unclamped.encode(x)
        m1 = clamped.encode(x)
        recon, mean, _ = clamped(x, sample=False)
    assert m0[:, 0].min().item() == 50.0  # clamp_th 0 disables the clamp
    assert torch.all(m1[:, 0] == 0.5) and torch.all(m1[:, 1] == -0.5)
    assert torch.allclose(m1[:, 2], torch.tensor(0.2)) and torch.allclose(m1[:, 3], torch.tensor(-0.3))
    assert torch.equal(mean, m1)
    # a random encoder also stays within the bound
    model = tiny_model(seed=3, clamp_th=0.03125)  # a power of two: exact in fp32
    with torch.no_grad():
        assert model.encode(x).abs().max().item() <= 0.03125
        assert tiny_model(seed=3).encode(x).abs().max().item() > 0.03125


# --------------------------------------------------------------------------------------------
# GroupNorm32
# --------------------------------------------------------------------------------------------
def test_groupnorm32_statistics_are_fp32_under_bf16_autocast():
    """Under bf16 autocast GroupNorm32 hands the bf16 activation to the CPU's kernel with gamma and beta fp32 (mixed
    dtypes: no fp32 copy of the activation, issue 30; no bf16 copy of the weights, issue 40); the kernel accumulates
    the statistics in fp32, so the result is the fp32 GroupNorm's within the output's bf16 rounding even where the
    mean is 8x the spread (tests/test_copies.py bounds it elementwise against fp64). An fp32 input is normalised in
    fp32."""
    torch.manual_seed(0)
    norm = GroupNorm32(num_groups=4, num_channels=16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    # an offset larger than the spread: the case where low-precision statistics lose digits
    x = (4.0 + 0.5 * torch.randn(2, 16, 8, 8)).bfloat16()
    x_fp32 = x.float()
    with torch.autocast("cpu", dtype=torch.bfloat16), record_ops() as ops:
        out = norm(x)
        out_fp32_input = norm(x_fp32)
    assert out.dtype == torch.bfloat16
    kernels = [dtypes for name, dtypes in ops.calls if name == "native_group_norm"]
    # the bf16 input as it is with fp32 gamma and beta; the fp32 one in fp32
    assert kernels == [[torch.bfloat16, torch.float32, torch.float32], [torch.float32] * 3]
    assert "_to_copy" not in [name for name, _ in ops.calls]  # nothing cast: neither the activation nor the weights
    assert out_fp32_input.dtype == torch.float32
    reference = F.group_norm(x.float(), 4, norm.weight, norm.bias, 1e-6)
    # within bf16 rounding of the fp32 result (bf16 keeps 8 significant bits: half an ulp is 2^-8 relative at most)
    torch.testing.assert_close(out.float(), reference, rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(out_fp32_input, reference, rtol=1e-5, atol=1e-5)


def _group_norm_grads(norm: GroupNorm32, x: torch.Tensor, grad_out: torch.Tensor, autocast_dtype=None):
    """(dx, dgamma, dbeta) of `norm` (or of an fp64 GroupNorm of its values, if x is fp64) at x for grad_out."""
    x = x.detach().requires_grad_(True)
    weight, bias = norm.weight, norm.bias
    if x.dtype == torch.float64:
        weight, bias = (p.detach().double().requires_grad_(True) for p in (norm.weight, norm.bias))
        out = F.group_norm(x, norm.num_groups, weight, bias, norm.eps)
    else:
        norm.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = norm(x)
        assert out.dtype == x.dtype
    out.backward(grad_out.to(x.dtype))
    return x.grad, weight.grad, bias.grad


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_groupnorm32_backward_is_fp32_accurate_under_autocast(memory_format, dtype):
    """Issue 40: the backward of GroupNorm32 on a bf16/fp16 activation under autocast (dx, dgamma, dbeta) against an
    fp64 GroupNorm of the same values, for activations whose mean is 0, 20 and 100 times their spread, in both memory
    formats. With gamma and beta fp32 the CPU's kernel saves fp32 statistics and reduces dgamma and dbeta in fp32, so
    each is as close to fp64 as an fp32 GroupNorm's backward on the same values (up to a factor 4 and 2^-16 of the
    largest value, for another order of the sums on another CPU or thread count), dx plus its own rounding to the
    input's dtype. The yardstick is measured here, never pinned: fp32's error grows with the mean/spread ratio, and in
    the channels_last kernel with its square. With gamma cast to the input's dtype (the old code; CUDA's only path)
    the kernel saved a bf16 mean and wrote a bf16 dgamma: at a mean 20x the spread dgamma was ~2.5% of its largest
    value off and dx twice its rounding, far outside these bounds at every mean."""
    rounding = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # half an ulp of the output, relative, at most
    generator = torch.Generator().manual_seed(0)
    norm = GroupNorm32(4, 32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(32, generator=generator))
        norm.bias.copy_(0.3 * torch.randn(32, generator=generator))
    for offset in (0.0, 20.0, 100.0):
        x = (torch.randn(2, 32, 16, 16, generator=generator) + offset).to(dtype).contiguous(memory_format=memory_format)
        grad_out = torch.randn(2, 32, 16, 16, generator=generator).to(dtype).contiguous(memory_format=memory_format)
        got = _group_norm_grads(norm, x, grad_out, autocast_dtype=dtype)
        assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
        fp32 = _group_norm_grads(norm, x.float(), grad_out)
        want = _group_norm_grads(norm, x.double(), grad_out)
        for name, g, f, w in zip(("dx", "dgamma", "dbeta"), got, fp32, want):
            largest = w.abs().max()
            allowance = 4 * (f.double() - w).abs().max() + 2.0 ** -16 * largest  # fp32's error, measured here
            error = (g.double() - w).abs()
            bound = allowance + (rounding * w.abs() if name == "dx" else 0.0)
            assert (error <= bound).all(), (name, offset, (error.max() / largest).item(), (allowance / largest).item())


def test_groupnorm32_calls_its_kernel_outside_autocast(monkeypatch):
    """Issue 40: CUDA's autocast lists group_norm among its fp32 ops, so a GroupNorm32 that let autocast in would hand
    CUDA's kernel an fp32 copy of every bf16 activation and cast the output back (the copies issue 30 removed). The
    CPU's lists leave group_norm alone, so on the CPU such a module computes the same; this test sees it by applying
    CUDA's policy to every call of F.group_norm: the dtype its kernel would get, fp32 where autocast is on at the
    call. Every norm of a model under bf16 autocast must hand the kernel its input's own dtype."""
    calls = []
    group_norm = F.group_norm

    def cuda_policy(input, num_groups, weight=None, bias=None, eps=1e-5):
        low_precision = input.dtype in (torch.bfloat16, torch.float16)
        kernel_dtype = torch.float32 if low_precision and torch.is_autocast_enabled(input.device.type) else input.dtype
        calls.append((input.dtype, kernel_dtype))
        return group_norm(input, num_groups, weight, bias, eps)

    monkeypatch.setattr(F, "group_norm", cuda_policy)
    model = tiny_model()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.decode(model.encode(torch.rand(1, 3, 16, 16) * 2 - 1))
    norms = sum(isinstance(m, GroupNorm32) for m in model.modules())
    assert len(calls) == norms  # each norm once
    assert (torch.bfloat16, torch.bfloat16) in calls  # the body's norms read bf16 activations
    assert all(kernel_dtype == input_dtype for input_dtype, kernel_dtype in calls), calls


def test_moments_head_runs_in_fp32_under_bf16_autocast():
    """The encoder's moments head (norm_out, conv_out) runs in fp32 under autocast: the posterior mean is
    fp32 and equals the fp32 head applied to the (bf16) output of the encoder's body. The body's bf16
    activations still make it differ from an all-fp32 encoder (~1e-2 here); the head no longer adds its
    own bf16 rounding on top (max 5e-3 before on this model)."""
    for posterior in ("constant", "learned"):
        model = tiny_model(posterior=posterior)
        x = torch.rand(2, 3, 32, 32) * 2 - 1
        body = {}
        model.encoder.mid.block_2.register_forward_hook(lambda module, args, out: body.update(h=out))
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mean, logvar = model.encode_moments(x)
            assert body["h"].dtype == torch.bfloat16
            enc = model.encoder
            head = enc.conv_out(F.silu(enc.norm_out(body["h"].float())))
        assert mean.dtype == torch.float32
        ref_mean = head.chunk(2, dim=1)[0] if posterior == "learned" else head
        torch.testing.assert_close(mean, ref_mean, rtol=1e-6, atol=1e-6)
        if posterior == "learned":
            torch.testing.assert_close(logvar, head.chunk(2, dim=1)[1], rtol=1e-6, atol=1e-6)


def test_model_normalisations_are_groupnorm32():
    model = tiny_model()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(isinstance(m, GroupNorm32) for m in norms)


# --------------------------------------------------------------------------------------------
# gradient checkpointing
# --------------------------------------------------------------------------------------------
CKPT_PARAMS = dict(ch=16, ch_mult=(1, 2, 2, 2), num_res_blocks=1, z_channels=4, use_attn=True, norm_groups=8)


def _grads(model: AutoEncoder, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # the same posterior noise for every mode
    recon, mean, _ = model(x, sample=True)
    loss = (recon - x).square().mean() + 0.1 * kl_divergence(mean, None)
    loss.backward()
    return recon.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ckpt_reference():
    """The model and its input; each test computes the reference gradients itself, at the thread count it runs
    with (a module-scoped reference was computed at another whenever tests of other modules ran in between: the
    oneDNN kernels differ, and the comparison is bitwise)."""
    torch.manual_seed(0)
    model = AutoEncoder(AutoEncoderParams(**CKPT_PARAMS)).train()
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    return model, x


@pytest.mark.parametrize("mode,decoder_levels,encoder_levels", [
    ("decoder_hr", {0, 1}, set()),
    ("hr", {0, 1}, {0, 1}),
    ("decoder", {0, 1, 2, 3}, set()),
    ("all", {0, 1, 2, 3}, {0, 1, 2, 3}),
])
def test_grad_checkpointing_is_exact(ckpt_reference, mode, decoder_levels, encoder_levels, monkeypatch):
    model, x = ckpt_reference
    recon_ref, grads_ref = _grads(model, x)
    segments = []  # one checkpoint segment per block / resampler (memory: one block re-materialised at a time)
    monkeypatch.setattr(ae, "checkpoint", lambda fn, *a, **k: segments.append(fn) or checkpoint(fn, *a, **k))
    model.set_grad_checkpointing(mode)
    try:
        assert model.decoder.checkpoint_levels == decoder_levels
        assert model.encoder.checkpoint_levels == encoder_levels
        # count entries into every block and resampler: each one of a checkpointed level runs twice (its
        # own segment: forward + recompute in backward), the others once. Pre-hooks, since non-reentrant
        # recomputation stops early, inside a block.
        calls = {}
        hooks = []
        for i in range(4):
            for name, coder in (("dec", model.decoder), ("enc", model.encoder)):
                for j, module in enumerate(coder._level(i)):
                    calls[(name, i, j)] = 0
                    hooks.append(module.register_forward_pre_hook(
                        lambda *_, key=(name, i, j): calls.__setitem__(key, calls[key] + 1)))
        recon, grads = _grads(model, x)
        for h in hooks:
            h.remove()
        assert segments == [m for i in sorted(encoder_levels) for m in model.encoder._level(i)] + \
            [m for i in sorted(decoder_levels, reverse=True) for m in model.decoder._level(i)]
        assert len(calls) == (4 * 2 + 3) + (4 * 1 + 3)  # decoder: 2 blocks a level + 3 upsamplers; encoder: 1 + 3
        for (name, i, j), n in calls.items():
            levels = decoder_levels if name == "dec" else encoder_levels
            assert n == (2 if i in levels else 1), (mode, name, i, j)
        assert torch.equal(recon, recon_ref)
        assert set(grads) == set(grads_ref)
        # exact up to float reassociation: |diff| <= 1e-6 * max|g| + 1e-5 * |g| (bitwise in practice)
        for name, g in grads.items():
            ref = grads_ref[name]
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item() + 1e-12,
                                       msg=lambda m, name=name: f"{mode}: {name}: {m}")
        # under no_grad the checkpoint is skipped: no error, the same output as without it
        with torch.no_grad():
            torch.manual_seed(5)
            out_ckpt = model(x, sample=False)[0]
            model.set_grad_checkpointing("none")
            out_plain = model(x, sample=False)[0]
        assert torch.equal(out_ckpt, out_plain)
    finally:
        model.set_grad_checkpointing("none")
    assert model.decoder.checkpoint_levels == set() and model.encoder.checkpoint_levels == set()


def test_grad_checkpointing_invalid_mode():
    model = tiny_model()
    with pytest.raises(ValueError, match="grad checkpointing"):
        model.set_grad_checkpointing("decoder_lr")
    assert model.decoder.checkpoint_levels == set()


def test_decoder_hr_with_two_levels():
    model = tiny_model(ch_mult=(1, 2))
    model.set_grad_checkpointing("decoder_hr")
    assert model.decoder.checkpoint_levels == {0, 1}
    model = tiny_model(ch_mult=(2,))
    model.set_grad_checkpointing("decoder_hr")
    assert model.decoder.checkpoint_levels == {0}


def test_one_line_errors_quote_a_message_up_to_a_whole_word():
    """Issue 31 item 7: an unreadable --init_from file's error was cut mid-word at 120 characters."""
    from common import first_line
    message = "Error while deserializing header: header too large: the file is truncated or not a safetensors " \
              "file at all, which happens when a download stops early\nsecond line"
    cut = first_line(message, 100)
    assert cut.endswith("...") and len(cut) <= 103 and message.startswith(cut[:-3])
    assert message[len(cut) - 3] == " "  # cut before a word, never inside one
    assert first_line("short\nmore") == "short" and first_line("") == ""


def test_init_from_errors_name_what_to_give(tmp_path):
    """An unreadable file's error ends on a whole word; a pipeline's root names its vae/ subfolder, also when the
    VAE was not downloaded with it."""
    import layouts
    bad = tmp_path / "ae.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(layouts.SourceError) as e:
        families.load_source(str(bad))
    assert "unreadable" in str(e.value) and "\n" not in str(e.value)
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")
    with pytest.raises(layouts.SourceError, match=r"its VAE is the vae/ subfolder, .*pipeline/vae"):
        families.load_source(str(pipeline))
    with pytest.raises(layouts.SourceError, match="a pipeline's VAE is its vae/ subfolder"):
        families.load_source(str(tmp_path))
