"""wan_ae.py's video model: Wan 2.1's (and Wan 2.2's) causal 3D VAE on clips, against diffusers' own AutoencoderKLWan
(tiny random models of the family's structure, saved with save_pretrained, each with two temporal levels: clips of
1 + 4k frames). Equal to diffusers on 1, 5 and 9 frames; every chunk plan computes the same clip; frame counts that
are not 1 + 4k are refused; one frame is what the image model computes; checkpointed gradients equal the unchecked
ones, chunked or not; the export is a folder diffusers decodes as we do. References are computed in the same
process."""
from __future__ import annotations

import pytest
import torch

import export
import families
import wan_ae
import wan_layouts
from wan_ae import WanAutoEncoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Wan 2.1's structure made small (base 16 for 96, z 4 for 16): time halves at both downsampling levels, f4 in space
TINY = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
            latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 2.0, 2.5, 3.0])
STRUCTURES = {"wan2.1": {"decoder_base_dim": 24},
              # Wan 2.2's (TI2V-5B's temperal_downsample [False, True, True]): 2x2 patches, residual levels whose
              # shortcuts average and duplicate across time
              "wan2.2": {"decoder_base_dim": 24, "is_residual": True, "patch_size": 2, "in_channels": 12,
                         "out_channels": 12, "dim_mult": [1, 1, 2, 2], "temperal_downsample": [False, True, True]}}
# float32 rounding where the computation is not diffusers' op for op (another chunk plan, the image model's Conv2d)
TOL = 1e-5


def diffusers_wan(structure: str, seed: int = 0):
    import diffusers
    torch.manual_seed(seed)
    model = diffusers.AutoencoderKLWan(**{**TINY, **STRUCTURES[structure]}).eval()
    with torch.no_grad():  # every weight random, the RMS norms' gammas off 1 and every temporal slice its own
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p) if name.endswith("gamma") else 0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(STRUCTURES))
def source(request, tmp_path_factory):
    reference = diffusers_wan(request.param)
    folder = str(tmp_path_factory.mktemp(request.param))
    reference.save_pretrained(folder)
    return request.param, reference, folder


def loaded(folder: str, video: bool = True) -> WanAutoEncoder:
    src = families.load_source(folder, video=video)
    vae = WanAutoEncoder(src.params)
    vae.load_state_dict(src.state)
    return vae.eval()


def clip(frames: int, size: int = 32, batch: int = 2, seed: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(batch, 3, frames, size, size) * 2 - 1


def assert_matches(ours: torch.Tensor, theirs: torch.Tensor, what: str, exact: bool = False) -> None:
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    diff = (ours - theirs).abs().max().item()
    print(f"{what}: max |diff| {diff:.3g} ({'bitwise' if torch.equal(ours, theirs) else 'not bitwise'})")
    assert torch.equal(ours, theirs) if exact else diff <= TOL * max(1.0, theirs.abs().max().item()), (what, diff)


@pytest.mark.parametrize("frames", [1, 5, 9])
@torch.no_grad()
def test_clips_compute_what_diffusers_computes(source, frames):
    """On diffusers' chunk plan (1, 4, 4, ... frames in, one latent frame at a time out) the video model runs
    diffusers' ops in diffusers' order: the posterior and the decoded clip are bitwise diffusers'."""
    structure, reference, folder = source
    vae = loaded(folder)
    assert vae.params.video and vae.params.temporal_factor == 4
    vae.time_chunks = (4, 1)
    x = clip(frames)
    dist = reference.encode(x).latent_dist
    mean, logvar = vae.encode_moments(x)
    assert mean.shape[2] == 1 + (frames - 1) // 4
    assert_matches(mean, dist.mean, f"{structure} {frames} frames: mean", exact=True)
    assert_matches(logvar, dist.logvar, f"{structure} {frames} frames: logvar", exact=True)
    assert_matches(vae.decode(dist.mean), reference.decode(dist.mean).sample, f"{structure} {frames} frames: decode",
                   exact=True)


@torch.no_grad()
def test_every_chunk_plan_computes_the_same_clip(source):
    """The whole clip at once, diffusers' plan, and others, on 17 frames (several multi-frame chunks after the
    first): the same causal windows, the same clip (to float32 rounding: a convolution over more frames may sum in
    another order). Evaluation (eval mode, no gradient) takes diffusers' plan by default. The temporal layers
    matter: with their weights changed the clip changes."""
    structure, _, folder = source
    vae = loaded(folder)
    x = clip(17, batch=1, size=16)
    outputs = {}
    for plan in ((0, 0), (4, 1), (8, 2), (4, 3), (12, 2), None):
        vae.time_chunks = plan
        mean, logvar = vae.encode_moments(x)
        outputs[plan] = mean, logvar, vae.decode(mean)
    for plan, tensors in outputs.items():
        for what, ours, whole in zip(("mean", "logvar", "decode"), tensors, outputs[(0, 0)]):
            assert_matches(ours, whole, f"{structure} plan {plan}: {what}")
    assert all(torch.equal(a, b) for a, b in zip(outputs[None], outputs[(4, 1)]))
    time_convs = [m for m in vae.modules() if isinstance(m, wan_ae.CausalConv3d) and m.kernel_size == (3, 1, 1)]
    assert len(time_convs) == 4  # two temporal levels, each in the encoder and the decoder
    vae.time_chunks = (0, 0)
    time_convs[0].weight.data.add_(0.1)
    assert (vae.encode_moments(x)[0] - outputs[(0, 0)][0]).abs().max() > 1e-3


def test_frame_counts_that_are_not_1_plus_4k_are_refused(source):
    _, _, folder = source
    vae = loaded(folder)
    for frames in (2, 4, 6, 8):
        with pytest.raises(ValueError, match=rf"a clip of {frames} frames: the video model takes 1 \+ 4k frames"):
            vae.encode_moments(clip(frames, batch=1))
    vae.time_chunks = (2, 1)
    with pytest.raises(ValueError, match="encoder chunks of 2 frames: a multiple of 4"):
        vae.encode_moments(clip(5, batch=1))
    image_model = loaded(folder, video=False)
    with pytest.raises(ValueError, match="a clip given to the image model"):
        image_model.encode_moments(clip(5, batch=1))


@torch.no_grad()
def test_one_frame_is_what_the_image_model_computes(source):
    """The image model is the video model's T = 1 with what a first frame never reads left out: the same posterior
    and image (a Conv2d and the one-frame Conv3d are different kernels: float32 rounding), an image given to the
    video model is a one-frame clip, and the image model holds the last temporal slice of each kernel."""
    structure, _, folder = source
    video, image = loaded(folder), loaded(folder, video=False)
    x = clip(1)
    mean_v, logvar_v = video.encode_moments(x)
    mean_i, logvar_i = image.encode_moments(x[:, :, 0])
    assert_matches(mean_i, mean_v[:, :, 0], f"{structure} one frame: mean")
    assert_matches(logvar_i, logvar_v[:, :, 0], f"{structure} one frame: logvar")
    assert_matches(image.decode(mean_i), video.decode(mean_v)[:, :, 0], f"{structure} one frame: decode")
    assert torch.equal(video.encode(x[:, :, 0]), mean_v[:, :, 0])  # (B, C, H, W) in, one-frame clip inside
    assert torch.equal(image.decoder.conv_out.weight, video.decoder.conv_out.weight[:, :, -1])
    assert sum(p.numel() for p in image.parameters()) < 0.5 * sum(p.numel() for p in video.parameters())


@pytest.mark.parametrize("plan", [None, (4, 1)])
def test_checkpointed_gradients_equal_the_unchecked_ones(source, plan):
    """Gradient checkpointing with the temporal cache (what diffusers could not add): in training mode with dropout,
    chunked or whole, every level checkpointed gives the unchecked run's reconstruction and gradients; and the
    chunked run's gradients are the whole clip's."""
    structure, _, folder = source
    vae = loaded(folder).train()
    for m in vae.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1  # the recomputation must draw the same masks
    x = clip(5, size=16, batch=1)

    def gradients(mode: str, chunks):
        vae.set_grad_checkpointing(mode)
        vae.time_chunks = chunks
        vae.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        recon, mean, logvar = vae(x)
        ((recon - x).square().mean() + 1e-3 * (mean.square() + logvar.exp() - logvar).mean()).backward()
        return recon.detach(), {n: p.grad.clone() for n, p in vae.named_parameters()}

    recon_ref, grads_ref = gradients("none", plan)
    recon, grads = gradients("all", plan)
    assert torch.equal(recon, recon_ref)
    assert all(g.abs().max() > 0 for n, g in grads_ref.items() if ".time_conv." in n)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-5, atol=1e-6 * grads_ref[name].abs().max().item())
    if plan is not None:  # without dropout (a chunk draws its own masks): the chunks' gradients are the clip's
        for m in vae.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        _, grads_chunked = gradients("all", plan)
        _, grads_whole = gradients("none", None)
        for name, g in grads_chunked.items():
            torch.testing.assert_close(g, grads_whole[name], rtol=1e-4,
                                       atol=1e-5 * grads_whole[name].abs().max().item())
    vae.set_grad_checkpointing("none")


@torch.no_grad()
def test_export_is_a_folder_diffusers_decodes_as_we_do(source, tmp_path):
    """A 'trained' video model (every tensor moved, the time_convs included) exported into its source's layout:
    diffusers loads it and encodes and decodes a clip as our model does; the statistics are kept or replaced."""
    import diffusers
    structure, _, folder = source
    vae = loaded(folder)
    for p in vae.parameters():
        p.add_(0.01 * torch.randn_like(p))
    wan_layouts.export_wan_diffusers(vae, folder, str(tmp_path / "out"), latents_std=[1.0, 2.0, 3.0, 4.0])
    theirs = diffusers.AutoencoderKLWan.from_pretrained(str(tmp_path / "out")).eval()
    assert theirs.config.latents_std == [1.0, 2.0, 3.0, 4.0] and theirs.config.latents_mean == TINY["latents_mean"]
    vae.time_chunks = (4, 1)
    x = clip(5)
    mean = vae.encode(x)
    assert_matches(mean, theirs.encode(x).latent_dist.mean, f"{structure} export: mean", exact=True)
    assert_matches(vae.decode(mean), theirs.decode(mean).sample, f"{structure} export: decode", exact=True)
    back = loaded(str(tmp_path / "out"))
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), vae.state_dict().values()))
