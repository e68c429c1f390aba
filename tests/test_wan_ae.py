"""wan_ae.py: Qwen-Image's / Wan 2.1's (and Wan 2.2's) VAE as a 2D image autoencoder. Against diffusers' own
AutoencoderKLQwenImage and AutoencoderKLWan (tiny random configs, saved with save_pretrained) on one frame: the causal
Conv3d is a Conv2d with the kernel's last temporal slice; loading computes what diffusers computes; export writes a
folder diffusers loads and decodes as we do; checkpointing is exact; bad sources are one line. References are computed
in the same process."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ae
import export
import families
import layouts
import train_state
import wan_ae
import wan_layouts
from wan_ae import WanAutoEncoder, WanParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen-Image's structure made small (base 16 for 96, z 4 for 16, 3 levels: f4, one block a level), a temporal level
TINY = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 2.0, 2.5, 3.0])
CLASSES = {"qwen": ("AutoencoderKLQwenImage", {}),
           # Wan's own option: a decoder of another base width
           "wan": ("AutoencoderKLWan", {"decoder_base_dim": 24}),
           # Wan 2.2's structure (TI2V-5B: base 160, decoder 256, z 48, dim_mult 1,2,4,4, f16): 2x2 patches, residual
           # levels. Time halves at the first level: the encoder's shortcut there averages with a zero frame, and the
           # decoder's, which narrows there (2 input channels per output channel), shows which frame a first frame keeps
           "wan22": ("AutoencoderKLWan", {"decoder_base_dim": 24, "is_residual": True, "patch_size": 2,
                                          "in_channels": 12, "out_channels": 12, "dim_mult": [1, 1, 2, 2],
                                          "temperal_downsample": [True, False, False]})}
# what each loads as (beside ch 16, one block a level, z 4)
EXPECTED = {"qwen": {"ch_mult": (1, 2, 2)}, "wan": {"ch_mult": (1, 2, 2), "decoder_ch": 24},
            "wan22": {"ch_mult": (1, 1, 2, 2), "decoder_ch": 24, "patch_size": 2, "level_shortcuts": True,
                      "temporal_downsample": (True, False, False)}}
# float32 rounding: a Conv2d and the single-frame Conv3d are different kernels, which may sum in another order
# (wan_ae.py's docstring); a wrong slice or block is off by O(1)
TOL = 1e-5


def diffusers_vae(kind: str = "qwen", seed: int = 0, **overrides):
    import diffusers
    class_name, extra = CLASSES[kind]
    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**{**TINY, **extra, **overrides}).eval()
    with torch.no_grad():  # every weight random, the RMS norms' gammas off 1 and every temporal slice its own
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p) if name.endswith("gamma") else 0.05 * torch.randn_like(p))
    return model


def saved(model, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)


def as_model(source: layouts.Source) -> WanAutoEncoder:
    vae = WanAutoEncoder(source.params)
    vae.load_state_dict(source.state)
    return vae.eval()


def assert_matches(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape, what
    scale = max(1.0, theirs.abs().max().item())
    diff = (ours - theirs).abs().max().item()
    print(f"{what}: max |diff| {diff:.3g} ({'bitwise' if torch.equal(ours, theirs) else 'not bitwise'})")
    assert diff <= TOL * scale, (what, diff)


@torch.no_grad()
def compare_with_diffusers(vae: WanAutoEncoder, reference, x: torch.Tensor, what: str) -> None:
    """Posterior mean and log-variance and the (clamped) decode, one frame through diffusers."""
    dist = reference.encode(x[:, :, None]).latent_dist
    mean, logvar = vae.eval().encode_moments(x)
    assert_matches(mean, dist.mean[:, :, 0], f"{what} mean")
    assert_matches(logvar, dist.logvar[:, :, 0], f"{what} logvar")
    z = dist.mean[:, :, 0]
    assert_matches(vae.decode(z), reference.decode(z[:, :, None]).sample[:, :, 0], f"{what} decode")


def images(n: int = 2, size: int = 32, seed: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(n, 3, size, size) * 2 - 1


# ------------------------------------------------------------------------------------------------ the collapse to 2D
@pytest.mark.parametrize("kernel", [3, 1])
def test_causal_conv3d_on_one_frame_is_conv2d_with_its_last_temporal_slice(kernel):
    """diffusers' causal Conv3d pads time with 2 * padding zero frames in front: one frame sees the last temporal
    slice of the kernel only (exactly: changing the other slices changes nothing), and equals a Conv2d with it."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
    torch.manual_seed(0)
    conv3d = QwenImageCausalConv3d(8, 16, kernel, padding=kernel // 2)
    x = torch.randn(2, 8, 1, 12, 10)
    with torch.no_grad():
        out = conv3d(x, None)  # what the encoder and decoder pass on the first frame: no cached frames
        assert out.shape == (2, 16, 1, 12, 10)
        conv3d.weight[:, :, :-1] = torch.randn_like(conv3d.weight[:, :, :-1])
        assert torch.equal(conv3d(x, None), out)
        as_2d = F.conv2d(x[:, :, 0], conv3d.weight[:, :, -1], conv3d.bias, padding=kernel // 2)
        assert_matches(as_2d, out[:, :, 0], f"{kernel}x{kernel} conv")
        if kernel == 3:
            first = F.conv2d(x[:, :, 0], conv3d.weight[:, :, 0], conv3d.bias, padding=1)
            assert (first - out[:, :, 0]).abs().max() > 0.1


def test_rms_norm_and_attention_are_diffusers_op_for_op():
    """The blocks without a causal convolution run diffusers' ops in diffusers' order: bitwise on any machine."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageAttentionBlock, QwenImageRMS_norm
    torch.manual_seed(0)
    theirs_norm = QwenImageRMS_norm(16, images=False)
    theirs_attn = QwenImageAttentionBlock(16)
    with torch.no_grad():
        theirs_norm.gamma.add_(torch.randn_like(theirs_norm.gamma))
        theirs_attn.norm.gamma.add_(torch.randn_like(theirs_attn.norm.gamma))
    norm, attn = wan_ae.RMSNorm32(16), wan_ae.AttentionBlock(16)
    norm.gamma.data = theirs_norm.gamma.data.reshape(16, 1, 1)
    attn.load_state_dict(theirs_attn.state_dict())
    x = torch.randn(2, 16, 1, 8, 6)
    with torch.no_grad():
        assert torch.equal(norm(x[:, :, 0]), theirs_norm(x)[:, :, 0])
        ours, theirs = attn(x[:, :, 0]), theirs_attn(x)[:, :, 0]
    assert torch.equal(ours, theirs)
    # the attention's output keeps diffusers' (channels-last) layout: the next RMS norm reduces in its order
    assert ours.stride() == theirs.stride()


def test_frame_conv_runs_in_the_layout_of_its_weights():
    """A channels-last input (the mid attention's output) is convolved as a contiguous one, as diffusers' F.pad hands
    its Conv3d; after model.to(channels_last) the convolution stays channels-last."""
    torch.manual_seed(0)
    conv = wan_ae.FrameConv2d(16, 32)
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        out = conv(x)
        assert out.is_contiguous() and torch.equal(out, F.conv2d(x.contiguous(), conv.weight, conv.bias, padding=1))
        conv.to(memory_format=torch.channels_last)
        assert conv(x.contiguous()).is_contiguous(memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------------ loading, like diffusers
@pytest.mark.parametrize("kind", list(CLASSES))
def test_diffusers_folder_loads_and_computes_what_diffusers_computes(kind, tmp_path):
    reference = diffusers_vae(kind)
    source = families.load_source(saved(reference, tmp_path / kind))
    assert isinstance(source.params, WanParams) and source.layout == "diffusers"
    expected = WanParams(ch=16, num_res_blocks=1, z_channels=4, **EXPECTED[kind])
    assert source.params == expected and source.params.downsample_factor == (16 if kind == "wan22" else 4)
    assert source.factors == {"scaling_factor": 1.0, "shift_factor": 0.0, "latents_mean": TINY["latents_mean"],
                              "latents_std": TINY["latents_std"]}
    # the Wan video VAE says what image training leaves to its later frames
    assert any("later video frames" in note for note in source.notes) == kind.startswith("wan")
    vae = as_model(source)
    compare_with_diffusers(vae, reference, images(), kind)
    compare_with_diffusers(vae, reference, images(1, 48, seed=6), f"{kind} 48px, batch 1")


def test_released_structures_convert():
    """At release size, on the meta device: Qwen-Image's VAE (diffusers' defaults) is WanParams' defaults, and a
    Wan 2.2 TI2V-5B structure (base 160, decoder 256, z 48, f16) converts; every weight fits."""
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan
    wan22 = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2, in_channels=12,
                 out_channels=12, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    for cls, config, factor in ((AutoencoderKLQwenImage, {}, 8), (AutoencoderKLWan, wan22, 16)):
        with torch.device("meta"):
            reference = cls(**config)
        params = wan_layouts.wan_params_from_diffusers_config({**reference.config, "_class_name": cls.__name__},
                                                              cls.__name__)
        assert params.downsample_factor == factor and params.z_channels == reference.config.z_dim
        if cls is AutoencoderKLQwenImage:
            assert params == WanParams()
        state = wan_layouts.wan_from_diffusers_state_dict(reference.state_dict(), params, cls.__name__)
        assert set(state) == {k for k in reference.state_dict() if ".time_conv." not in k}


def test_channels_last_model_computes_the_same():
    """The trainer's --channels_last: a model moved to channels-last runs its convolutions so (FrameConv2d follows
    its weights) and agrees with the contiguous model to float32 rounding."""
    torch.manual_seed(0)
    vae = WanAutoEncoder(WanParams(ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4)).eval()
    channels_last = WanAutoEncoder(vae.params).eval()
    channels_last.load_state_dict(vae.state_dict())
    channels_last.to(memory_format=torch.channels_last)
    x = images()
    with torch.no_grad():
        ours = channels_last(x.contiguous(memory_format=torch.channels_last), sample=False)[0]
        assert ours.is_contiguous(memory_format=torch.channels_last)
        assert_matches(ours, vae(x, sample=False)[0], "channels-last")


def test_decode_clamps_in_eval_only(tmp_path):
    """diffusers clamps the decoded image to [-1, 1] inside the model: so does decode in eval mode. In training the
    output is raw, so a pixel beyond the range still has a gradient."""
    reference = diffusers_vae()
    with torch.no_grad():  # push channels 0 and 1 past the range
        reference.decoder.conv_out.bias.copy_(torch.tensor([1.0, -1.0, 0.0]))
    vae = as_model(families.load_source(saved(reference, tmp_path / "qwen")))
    z = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        clamped = vae.decode(z)
        assert_matches(clamped, reference.decode(z[:, :, None]).sample[:, :, 0], "decode past the range")
    vae.train()
    raw = vae.decode(z.requires_grad_())
    outside = raw.detach().abs() > 1
    assert outside.float().mean() > 0.05 and torch.equal(raw.detach().clamp(-1, 1), clamped)
    raw[outside].sum().backward()
    assert z.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ the trainer's interface
def test_interface_of_ae_autoencoder():
    torch.manual_seed(0)
    vae = WanAutoEncoder(WanParams(ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4)).train()
    assert vae.downsample_factor == 4 and vae.params.z_channels == 4
    assert vae.params.posterior == "learned" and vae.params.quant_conv  # frozen with the encoder by --train_parts
    x = images(2, 16)
    recon, mean, logvar, added, _, _ = train_state.TrainingForward(vae)(x, latent_transform=lambda z: 0 * z,
                                                                        also_decode=lambda z: z.flip(-1))
    assert recon.shape == x.shape and mean.shape == logvar.shape == (2, 4, 4, 4)
    assert mean.dtype == logvar.dtype == torch.float32 and added.shape == x.shape
    with torch.no_grad():
        assert torch.equal(recon, vae.decode(torch.zeros_like(mean)))  # the latent_transform's latent
        assert torch.equal(vae.encode(x), mean) and torch.equal(vae(x, sample=False)[0], vae.decode(mean))
    with torch.no_grad():  # the log-variance is clamped to LDM's range, as diffusers' DiagonalGaussianDistribution
        vae.quant_conv.bias[4:] = -100.0
        assert torch.equal(vae.encode_moments(x)[1], torch.full_like(mean, ae.LOGVAR_RANGE[0]))
    # decoder.conv_out.weight is the decoder's last weight (the adaptive GAN weight's reference)
    order = []
    hooks = [m.register_forward_hook(lambda m, i, o: order.append(m)) for m in vae.decoder.modules()
             if isinstance(m, torch.nn.Conv2d)]
    vae.decode(mean)
    for h in hooks:
        h.remove()
    assert order[-1] is vae.decoder.conv_out
    params = WanParams(ch=32, ch_mult=(1, 2), z_channels=8, decoder_ch=48, dropout=0.1)
    assert params.to_dict()["family"] == "wan" and WanParams.from_dict(params.to_dict()) == params
    assert json.loads(json.dumps(params.to_dict())) == params.to_dict()
    with pytest.raises(ValueError, match="family"):
        WanParams.from_dict({**params.to_dict(), "family": "ldm"})


def test_fp32_islands_under_bf16_autocast():
    """The RMS norms, the moments head and the posterior stay fp32 under bf16 autocast (ae.py's islands)."""
    torch.manual_seed(0)
    vae = WanAutoEncoder(WanParams(ch=16, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)).eval()
    x = images(1, 16)
    norm = vae.encoder.down_blocks[0].norm1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = vae.encoder.conv_in(x)
        assert h.dtype == torch.bfloat16
        assert torch.equal(norm(h), (F.normalize(h.float(), dim=1) * 4.0 * norm.gamma).to(torch.bfloat16))
        moments = vae.encoder(x)  # the moments head (norm_out, conv_out) in fp32 after a bf16 body
        mean, logvar = vae.encode_moments(x)
        z = vae.sample(mean, logvar)
    assert moments.dtype == mean.dtype == logvar.dtype == z.dtype == torch.float32


@pytest.fixture(scope="module", params=["wan2.1", "wan2.2"])
def checkpoint_reference(request):
    torch.manual_seed(0)
    structure = {"wan2.1": {}, "wan2.2": dict(patch_size=2, level_shortcuts=True, temporal_downsample=(True, False))
                 }[request.param]
    # dropout on: the checkpointed recomputation must draw the same masks
    vae = WanAutoEncoder(WanParams(ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, dropout=0.1,
                                             **structure)).train()
    return vae, images(2, 16)  # the reference gradients: each test's own, at its thread count (test_ae.py's note)


def _gradients(vae, x):
    vae.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # the same posterior noise and dropout masks for every mode
    recon, mean, logvar = vae(x)
    loss = (recon - x).square().mean() + 0.1 * ae.kl_divergence(mean, logvar)
    loss.backward()
    return recon.detach(), {n: p.grad.clone() for n, p in vae.named_parameters()}


@pytest.mark.parametrize("mode,decoder_levels,encoder_levels", [
    ("decoder_hr", {0, 1}, set()), ("hr", {0, 1}, {0, 1}), ("decoder", {0, 1, 2}, set()),
    ("all", {0, 1, 2}, {0, 1, 2})])
def test_grad_checkpointing_is_exact(checkpoint_reference, mode, decoder_levels, encoder_levels, monkeypatch):
    vae, x = checkpoint_reference
    recon_ref, grads_ref = _gradients(vae, x)
    segments = []  # ae._run_level checkpoints each block and resampler of a level on its own
    monkeypatch.setattr(ae, "checkpoint", lambda fn, *a, **k: segments.append(fn) or checkpoint(fn, *a, **k))
    vae.set_grad_checkpointing(mode)
    try:
        assert (vae.decoder.checkpoint_levels, vae.encoder.checkpoint_levels) == (decoder_levels, encoder_levels)
        recon, grads = _gradients(vae, x)
        assert segments == [m for i in sorted(encoder_levels) for m in vae.encoder._level(i)] + \
            [m for i in sorted(decoder_levels, reverse=True) for m in vae.decoder._level(i)]
        assert torch.equal(recon, recon_ref)
        # exact up to float reassociation (bitwise in practice), as tests/test_ae.py's
        for name, g in grads.items():
            torch.testing.assert_close(g, grads_ref[name], rtol=1e-5, atol=1e-6 * grads_ref[name].abs().max().item())
    finally:
        vae.set_grad_checkpointing("none")
    # level 0 is the highest resolution in both, as in ae.py: the decoder's last up block, the encoder's first level;
    # Wan 2.2's level is one segment (its shortcut spans it), Wan 2.1's a segment per block and resampler
    residual = vae.params.level_shortcuts
    highest = vae.decoder.up_blocks[-1]
    assert vae.decoder._level(0) == ([highest] if residual else list(highest.resnets))
    assert vae.encoder._level(0)[0] is vae.encoder.down_blocks[0]
    assert len(vae.encoder._level(0)) == (1 if residual else 2)


# ------------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("kind", list(CLASSES))
def test_export_writes_the_source_layout_back(kind, tmp_path):
    """A 'trained' model exported into its source's layout: diffusers loads it and decodes (one frame) what our model
    decodes; each 3D kernel's other temporal slices and the time_convs are the source's; the statistics are kept, or
    replaced when given; the export loads back into the same 2D weights."""
    import diffusers
    source_dir = saved(diffusers_vae(kind), tmp_path / "source")
    vae = as_model(families.load_source(source_dir))
    torch.manual_seed(1)
    with torch.no_grad():  # training moved every weight
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    wan_layouts.export_wan_diffusers(vae, source_dir, str(tmp_path / "out"))
    class_name = CLASSES[kind][0]
    exported = getattr(diffusers, class_name).from_pretrained(tmp_path / "out", low_cpu_mem_usage=False).eval()
    assert type(exported).__name__ == class_name
    assert exported.config.latents_mean == TINY["latents_mean"] and exported.config.latents_std == TINY["latents_std"]
    compare_with_diffusers(vae, exported, images(), f"{kind} export")

    source_state = layouts.read_weights(os.path.join(source_dir, layouts.DIFFUSERS_WEIGHTS))
    exported_state = exported.state_dict()
    assert set(exported_state) == set(source_state)
    assert any(".time_conv." in k for k in source_state)
    for name, value in source_state.items():
        if ".time_conv." in name:
            assert torch.equal(exported_state[name], value), name
        elif value.dim() == 5:
            assert torch.equal(exported_state[name][:, :, :-1], value[:, :, :-1]), name
    again = families.load_source(str(tmp_path / "out"))
    assert all(torch.equal(again.state[k], v) for k, v in vae.state_dict().items())

    mean, std = [0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]
    wan_layouts.export_wan_diffusers(vae, source_dir, str(tmp_path / "restat"), latents_mean=mean, latents_std=std)
    config = json.loads((tmp_path / "restat" / "config.json").read_text())
    assert (config["latents_mean"], config["latents_std"]) == (mean, std)


def test_export_refuses_another_source(tmp_path):
    vae = as_model(families.load_source(saved(diffusers_vae(), tmp_path / "source")))
    other = saved(diffusers_vae(base_dim=8), tmp_path / "other")
    with pytest.raises(ValueError, match="is not the model's"):
        wan_layouts.export_wan_diffusers(vae, other, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="3 entries for 4 latent channels"):
        wan_layouts.export_wan_diffusers(vae, str(tmp_path / "source"), str(tmp_path / "out"), latents_mean=[0.0] * 3)


# ------------------------------------------------------------------------------------------------- bad sources
def _edited(folder, tmp_path, name: str, **config_changes) -> str:
    """A copy of a saved folder with its config.json edited."""
    import shutil
    out = tmp_path / name
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.timeout(60)
def test_bad_sources_are_one_line(tmp_path):
    from safetensors.torch import save_file
    good = saved(diffusers_vae(), tmp_path / "good")
    wan22 = saved(diffusers_vae("wan22"), tmp_path / "wan22")
    original = {"decoder.middle.0.residual.0.gamma": torch.ones(4, 1, 1, 1), "encoder.conv1.weight": torch.zeros(1)}
    save_file(original, tmp_path / "qwen_image_vae.safetensors")
    extra = _edited(good, tmp_path, "extra")  # a weight no block of this config has
    weights = layouts.read_weights(os.path.join(extra, layouts.DIFFUSERS_WEIGHTS))
    save_file({**weights, "decoder.up_blocks.2.upsamplers.0.resample.1.weight": torch.zeros(8, 16, 3, 3)},
              os.path.join(extra, layouts.DIFFUSERS_WEIGHTS))
    weights_alone = os.path.join(good, layouts.DIFFUSERS_WEIGHTS)  # the weights file given for the folder
    os.makedirs(tmp_path / "pipeline")
    os.symlink(good, tmp_path / "pipeline" / "vae")
    cases = {
        _edited(wan22, tmp_path, "patches", in_channels=10): "in_channels 10 / out_channels 12 are not the channels "
                                                              "of 2x2 patches",
        _edited(good, tmp_path, "levels", temperal_downsample=[False, True, True]): "temperal_downsample has 3 entries",
        _edited(good, tmp_path, "attention", attn_scales=[1.0]): "attn_scales",
        _edited(good, tmp_path, "stats", latents_mean=[0.0] * 16): "latents_mean has 16 entries for z_dim 4",
        _edited(good, tmp_path, "z8", z_dim=8, latents_mean=None, latents_std=None): "keys do not fit",
        extra: "1 unexpected (e.g. decoder.up_blocks.2.upsamplers.0.resample.1.weight)",
        # a class the generic family trains (diffusers' own module), whose weights this folder does not hold
        _edited(good, tmp_path, "hunyuan", _class_name="AutoencoderKLHunyuanVideo"): "its weights do not load into a "
                                                                                     "AutoencoderKLHunyuanVideo",
        _edited(good, tmp_path, "allegro", _class_name="AutoencoderKLAllegro"): "encodes and decodes only in tiles",
        _edited(good, tmp_path, "unknown", _class_name="UNet2DModel"): "loadable are AutoencoderKL, ",
        str(tmp_path / "qwen_image_vae.safetensors"): "original single-file layout",
        weights_alone: "diffusers-named weights without their config",
        str(tmp_path / "pipeline"): f"give its VAE, {tmp_path / 'pipeline' / 'vae'}",
    }
    for path, expected in cases.items():
        with pytest.raises(layouts.SourceError) as error:
            families.load_source(path)
        message = str(error.value)
        assert expected in message and "\n" not in message and message.startswith(path), (path, message)


# ------------------------------------------------------------------------------------ through the trainer
def trainer_args(folder, shard_url, runs, name, *extra) -> list[str]:
    """vae_trainer.py's flags for a short fine-tune of the Qwen-Image-structured model in `folder` (64 px)."""
    return ["--init_from", str(folder), "--dataset_url", shard_url, "--output_dir", str(runs), "--run_name", name,
            "--vae_resolution", "64", "--batch_size", "2", "--num_workers", "1", "--shuffle_buffer", "8",
            "--max_steps", "2", "--warmup_steps", "1", "--perceptual_weight", "0", "--vgg16_weights", "random",
            "--wandb_mode", "disabled", "--evaluate_every_n_steps", "0", "--mse_pool_factor", "4", *extra]


def test_qwen_image_decoder_only_fine_tune_keeps_the_encoder_and_exports_back(tmp_path, shard_url, capsys):
    """`vae_trainer.py --init_from <AutoencoderKLQwenImage folder> --train_parts decoder` (the image model): the
    encoder and quant_conv stay bitwise the source's (weights and EMA), the decoder trains; the export is the
    source's diffusers layout with the source's latents_mean/latents_std, loads in
    AutoencoderKLQwenImage.from_pretrained and decodes one frame as our model decodes it. (The same under torchrun
    with two ranks, for the family's video model: tests/test_video.py.)"""
    import checkpoint
    import vae_trainer
    from diffusers import AutoencoderKLQwenImage
    folder = saved(diffusers_vae("qwen"), tmp_path / "qwen")
    source = families.load_source(folder)
    runs = tmp_path / "runs"
    assert vae_trainer.main(trainer_args(folder, shard_url, runs, "ft", "--train_parts", "decoder", "--num_workers",
                                         "0")) == 0
    capsys.readouterr()
    ckpt = checkpoint.load_checkpoint(str(runs / "ft" / "checkpoints" / "step_00000002.pt"))
    assert ckpt["run"]["model_params"]["family"] == "wan" and ckpt["run"]["model_params"]["video"] is False
    assert ckpt["run"]["config"]["vae_family"] == "wan"
    frozen = [k for k in source.state if k.startswith(("encoder.", "quant_conv."))]
    for key in ("vae", "ema"):
        assert all(torch.equal(ckpt["training"][key][k], source.state[k]) for k in frozen), key
    assert not torch.equal(ckpt["training"]["vae"]["decoder.conv_out.weight"], source.state["decoder.conv_out.weight"])

    assert export.main(["--ckpt", str(runs / "ft"), "--out", str(tmp_path / "out"), "--ema"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["latent_norm"] == "per_channel" and "Qwen-Image" in summary["serves"]
    exported = AutoencoderKLQwenImage.from_pretrained(tmp_path / "out").eval()
    assert (exported.config.latents_mean, exported.config.latents_std) == (TINY["latents_mean"], TINY["latents_std"])
    ours = WanAutoEncoder(source.params)
    ours.load_state_dict(ckpt["training"]["ema"])
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert_matches(ours.eval().decode(z), exported.decode(z[:, :, None]).sample[:, :, 0], "decode")


@pytest.mark.process
def test_qwen_image_statistics_re_estimated_after_a_full_fine_tune_normalise_in_its_pipeline(tmp_path, shard_url,
                                                                                             photos_dir, capsys):
    """After a run that trained the encoder, export --dataset_url re-estimates latents_mean/latents_std, and the
    latents Qwen-Image's own img2img pipeline makes of those images (its _encode_vae_image: a posterior sample,
    then (z - latents_mean) / latents_std per channel) have zero mean and unit variance per channel. The source's
    posterior is made nearly deterministic (log-variance -20, as a trained VAE's nearly is), so the pipeline's
    sample is its mean."""
    import vae_trainer
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageImg2ImgPipeline

    import data as data_lib
    reference = diffusers_vae("qwen")
    with torch.no_grad():
        reference.quant_conv.bias[TINY["z_dim"]:] = -20.0
    folder = saved(reference, tmp_path / "qwen")
    runs = tmp_path / "runs"
    assert vae_trainer.main(trainer_args(folder, shard_url, runs, "full", "--num_workers", "0")) == 0
    capsys.readouterr()
    assert export.main(["--ckpt", str(runs / "full"), "--out", str(tmp_path / "out"), "--dataset_url", photos_dir,
                        "--resolution", "32", "--latent_stats_images", "8", "--batch_size", "4"]) == 0
    stats = json.loads(capsys.readouterr().out)["latent_stats"]
    assert stats["channel_mean"] != TINY["latents_mean"]
    vae = AutoencoderKLQwenImage.from_pretrained(tmp_path / "out").eval()
    pipe = QwenImageImg2ImgPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                    tokenizer=None, transformer=None)
    images = torch.cat([data_lib.to_model_input(b, torch.device("cpu"), channels_last=False)
                        for _, b in data_lib.iter_eval_batches(photos_dir, 32, 4)])
    with torch.no_grad():
        z = pipe._encode_vae_image(images[:, :, None], torch.Generator().manual_seed(0))[:, :, 0].double()
    assert z.mean(dim=(0, 2, 3)).abs().max() < 1e-3
    assert z.std(dim=(0, 2, 3), unbiased=False).tolist() == pytest.approx([1.0] * TINY["z_dim"], abs=1e-3)


def test_the_wan_family_refuses_what_it_cannot_do_in_one_line(tmp_path, shard_url, capsys):
    """A narrower decoder and its teacher are the LDM family's; a Wan-family run needs its source's architecture;
    its export has no single-file layout."""
    import vae_trainer
    folder = saved(diffusers_vae("qwen"), tmp_path / "qwen")
    runs = tmp_path / "runs"
    for extra, message in ((["--vae_decoder_ch", "8,16,16"], "--vae_decoder_ch: a decoder of other widths is for "
                                                               "the LDM family's latent spaces"),
                           (["--train_parts", "decoder", "--distill_weight", "1"], "--distill_weight: a "
                                                                                    "narrower decoder is the LDM "
                                                                                    "family's")):
        assert vae_trainer.main(trainer_args(folder, shard_url, runs, "x", *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert vae_trainer.main(["--vae_family", "wan", "--dataset_url", shard_url, "--output_dir", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its architecture is read from --init_from" in err[0], err
    assert vae_trainer.main(trainer_args(folder, shard_url, runs, "one", "--num_workers", "0", "--max_steps",
                                         "1")) == 0
    capsys.readouterr()
    assert export.main(["--ckpt", str(runs / "one"), "--out", str(tmp_path / "o"), "--format", "single_file"]) == 2
    assert "this trainer writes no single file of it" in capsys.readouterr().err
