"""The family registry (families.py) and the generic diffusers family (diffusers_ae.py): every autoencoder class
of the installed diffusers either fine-tunes through its own module or is refused in one line; for each class that
trains, a tiny random model (diffusers' own test configs where they have one) goes through the whole path: a
decoder-only fine-tune of 2 steps that keeps the encoder side bitwise and moves the decoder, a resume from step 1
that ends bitwise where the uninterrupted run did, an export that diffusers loads and that decodes bitwise as our
checkpoint does, and the clip rule (a wrong length named with its nearest, clips refused for an image class). Also:
no module outside the registry and the model modules names a family, and the classes whose encode/decode carry a
cache train with the gradients of a reference."""
from __future__ import annotations

import ast
import json
import os
import shutil

import pytest
import torch

import diffusers_ae
import export
import families
import layouts
import shards
import sources
from common import ConfigError
from conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The tiny configs, one per class that trains here (diffusers' tests' where they have one: widths shrunk, the
# structure that decides compression and causality the released one's).
TINY = {
    # LTX-Video 0.9.1 and later: a timestep-conditioned decoder with noise injection (0.9.0's is the simpler case)
    "AutoencoderKLLTXVideo": dict(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(True, True, True, False),
        upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4,
        patch_size_t=1, encoder_causal=True, decoder_causal=False),
    "AutoencoderKLLTX2Video": dict(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1)),
    "AutoencoderKLHunyuanVideo": dict(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                      norm_num_groups=4),
    "AutoencoderKLHunyuanVideo15": dict(latent_channels=8, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1),
    "AutoencoderKLCogVideoX": dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                   norm_num_groups=2),
    "AutoencoderKLMochi": dict(latent_channels=4, encoder_block_out_channels=(32, 32, 32, 32),
                               decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                               latents_mean=(0.1, -0.2, 0.3, -0.4), latents_std=(1.5, 2.0, 2.5, 3.0)),
    "AutoencoderKLCosmos": dict(latent_channels=4, encoder_block_out_channels=(8, 8, 8, 8),
                                decode_block_out_channels=(8, 8, 8, 8), attention_resolutions=(8,), resolution=64,
                                num_layers=1, latents_mean=None, latents_std=None),
    "AutoencoderKLQwenImage21": dict(base_dim=8, decoder_base_dim=12, z_dim=8, dim_mult=[1, 2, 2, 2, 2],
                                     num_res_blocks=1, latents_mean=[0.0] * 8, latents_std=[1.0] * 8),
    "AutoencoderKLMagvit": dict(latent_channels=4, block_out_channels=[8, 8, 8, 8], layers_per_block=1,
                                norm_num_groups=8),
    "AutoencoderKLHunyuanImageRefiner": dict(latent_channels=8, block_out_channels=(8, 8, 16, 16, 16),
                                             layers_per_block=1),
    "Kandinsky6SRVAE": dict(latent_channels=8, encoder_block_out_channels=(8, 8, 16, 16, 16),
                            decoder_block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1),
    "AutoencoderKLTemporalDecoder": dict(block_out_channels=[32, 32, 32, 32], down_block_types=["DownEncoderBlock2D"] * 4,
                                         latent_channels=4, layers_per_block=1),
    "AutoencoderKLHunyuanImage": dict(in_channels=3, out_channels=3, latent_channels=8,
                                      block_out_channels=(32, 32, 32, 32, 32, 32), layers_per_block=1,
                                      spatial_compression_ratio=32, sample_size=256),
    "AutoencoderKLKVAE": dict(channels=32, num_enc_blocks=1, num_dec_blocks=1, z_channels=4, ch_mult=(1, 1, 1, 1),
                              sample_size=32),
    # DC-AE f32c32's released layout: EfficientViT blocks, BatchNorm in the decoder's first stages
    "AutoencoderDC": dict(latent_channels=8, attention_head_dim=8,
                          encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
                          decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
                          encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
                          decoder_block_out_channels=(8, 8, 16, 16, 32, 32), encoder_layers_per_block=(1,) * 6,
                          decoder_layers_per_block=(1,) * 6,
                          decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3,
                          decoder_act_fns=("relu",) * 3 + ("silu",) * 3),
    "AutoencoderTiny": dict(encoder_block_out_channels=(16, 16, 16, 16), decoder_block_out_channels=(16, 16, 16, 16),
                            num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1)),
    # a native family's class through diffusers' own module (--vae_family diffusers)
    "AutoencoderKLWan": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                             temperal_downsample=[True, True], latents_mean=[0.1, -0.2, 0.3, -0.4],
                             latents_std=[1.5, 2.0, 2.5, 3.0]),
}
CLIP_FRAMES, CLIP_SIZE = 9, 64


def tiny_folder(class_name: str, folder) -> str:
    """A diffusers folder of the class's tiny config, its weights perturbed (seeded) so that no layer starts at a
    degenerate value (a zero-initialised scale would pass no gradient)."""
    torch.manual_seed(0)
    with diffusers_ae.quiet_diffusers():
        model = diffusers_ae.diffusers_class(class_name)(**TINY[class_name])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def clip_url(photos_dir, tmp_path_factory) -> str:
    """Moving-camera clips of the photos: 9 frames of 64 px (clips of every class's 1 + t frames fit)."""
    dst = str(tmp_path_factory.mktemp("family_clips"))
    photos = sorted(os.path.join(photos_dir, f) for f in os.listdir(photos_dir))[:4]
    return sources.brace_url(shards.write_photo_clips(photos, dst, CLIP_FRAMES, CLIP_SIZE, 1, 16, 0, shard_size=2))


def run_args(folder, url, runs, name, resolution, frames, *extra) -> list[str]:
    return ["--init_from", folder, "--dataset_url", url, "--output_dir", str(runs), "--run_name", name,
            "--vae_resolution", str(resolution), "--batch_size", "2", "--shuffle_buffer", "4", "--warmup_steps", "1",
            "--perceptual_weight", "0", "--vgg16_weights", "random", "--wandb_mode", "disabled",
            "--mse_pool_factor", "4", "--num_samples", "2", "--num_workers", "0", "--min_lr_ratio", "1",
            "--train_parts", "decoder", "--save_every_n_steps", "1", "--max_steps", "2", "--seed", "3",
            "--learning_rate_vae", "1e-3", "--memory_check", "false",
            *(["--video_frames", str(frames)] if frames else []), *extra]


def step_state(run_dir, step: int) -> dict:
    return torch.load(os.path.join(run_dir, "checkpoints", f"step_{step:08d}.pt"), weights_only=True)["training"]


def diffusers_decode(model, spec: diffusers_ae.ClassSpec, z: torch.Tensor) -> torch.Tensor:
    """What the class itself decodes of a latent clip (B, C, T, h, w), called as its pipelines call it."""
    kwargs = spec.decode_kwargs(dict(model.config), z) if spec.decode_kwargs else {}
    if spec.frames_in_batch:
        frames = z.shape[2]
        out = model.decode(z.transpose(1, 2).flatten(0, 1), num_frames=frames, **kwargs).sample
        return out.unflatten(0, (-1, frames)).transpose(1, 2)
    return model.decode(z, **kwargs).sample[:, :3]


# ------------------------------------------------------------------------------------------ each class that trains
@pytest.mark.process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("class_name", list(TINY))
def test_each_class_fine_tunes_resumes_and_exports_through_its_own_module(class_name, clip_url, shard_url, tmp_path,
                                                                         capsys):
    """--init_from a tiny folder of the class, --train_parts decoder, 2 steps on clips of 1 + t frames (t measured;
    images for an image class): every encoder-side tensor stays the source's bitwise (in the weights and the EMA),
    the decoder moves; resumed from step 1 the run ends with the uninterrupted run's step-2 weights (and buffers:
    DC-AE's BatchNorm statistics) bitwise; the export is the class's own folder (every config field kept), which
    diffusers loads with the checkpoint's weights bitwise and decodes as the checkpoint does; a clip length the class
    cannot take is refused in one line naming the nearest it can (an image class refuses clips)."""
    import vae_trainer
    folder = tiny_folder(class_name, tmp_path / "source")
    params = diffusers_ae.DiffusersParams.of(class_name, json.load(open(os.path.join(folder, "config.json"))))
    spec, t = params.spec, params.temporal_factor
    frames = 1 + t if t else 0
    resolution = max(32, 2 * params.spatial_factor)
    url = clip_url if frames else shard_url
    runs = tmp_path / "runs"
    family = ["--vae_family", "diffusers"] if class_name in families.WAN_FAMILY.CLASSES else []
    assert vae_trainer.main(run_args(folder, url, runs, "ref", resolution, frames, *family)) == 0
    out = capsys.readouterr().out
    assert f"diffusers' {class_name}" in out and "training the decoder only" in out

    # the encoder side bitwise, the decoder moved
    source = families.load_source(folder, vae_family="diffusers")
    ref = step_state(runs / "ref", 2)
    # (named here, not read from spec.encoder_side: the posterior is the encoder's and quant_conv's where it has one)
    side = ("model.encoder.", "model.quant_conv.")
    frozen = [k for k in source.state if k.startswith(side)]
    # (the frozen side's encode runs without a graph, so a quant_conv left out of it would not move here; its
    # requires_grad would stay, and a DDP run would fail on a parameter without a gradient: the start line says it)
    quant_conv = any(k.startswith("model.quant_conv.") for k in source.state)
    assert ("the encoder and quant_conv are frozen" if quant_conv else "the encoder is frozen") in out
    assert frozen and all(torch.equal(ref[part][k], source.state[k]) for part in ("vae", "ema") for k in frozen)
    decoder = [k for k in source.state if k.startswith("model.decoder.") and source.state[k].is_floating_point()]
    assert any(not torch.equal(ref["vae"][k], source.state[k]) for k in decoder)

    # resumed from step 1: bitwise the uninterrupted run
    shutil.copytree(runs / "ref", runs / "cut")
    os.remove(runs / "cut" / "checkpoints" / "step_00000002.pt")
    assert vae_trainer.main(run_args(folder, url, runs, "cut", resolution, frames, *family)) == 0
    assert "resumed from" in capsys.readouterr().out
    cut = step_state(runs / "cut", 2)
    for part in ("vae", "ema"):
        differ = [k for k, value in ref[part].items() if not torch.equal(value, cut[part][k])]
        assert differ == [], (part, differ[:5])

    # the export: the class's own folder, decoded by diffusers as by the checkpoint
    assert export.main(["--ckpt", str(runs / "ref"), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    exported = json.load(open(tmp_path / "out" / "config.json"))
    assert exported["_class_name"] == class_name
    assert {k: v for k, v in exported.items() if not k.startswith("_")} == json.loads(
        json.dumps({k: v for k, v in json.load(open(os.path.join(folder, "config.json"))).items()
                    if not k.startswith("_")}))  # every field kept (the normalisation: the source's, decoder-only)
    with diffusers_ae.quiet_diffusers():
        theirs = diffusers_ae.diffusers_class(class_name).from_pretrained(tmp_path / "out").eval()
    assert {k: v for k, v in theirs.state_dict().items()}.keys() == {k[6:] for k in ref["vae"]}
    assert all(torch.equal(v, ref["vae"]["model." + k]) for k, v in theirs.state_dict().items())  # our weights
    import checkpoint
    ours, _ = checkpoint.load_model(str(runs / "ref"))
    latent = resolution // params.spatial_factor
    z = torch.randn(1, params.z_channels, (frames - 1) // t + 1 if frames else 1, latent, latent,
                    generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.manual_seed(9)  # (an LTX decoder's injected noise)
        a = ours.decode(z if spec.clip_input or spec.frames_in_batch else z[:, :, 0])
        torch.manual_seed(9)
        b = diffusers_decode(theirs, spec, z if spec.clip_input or spec.frames_in_batch else z[:, :, 0])
    # the same weights and ops: equal, but for the rounding of CPU kernels that oneDNN picks by the weights' memory
    # alignment (seen: 9e-7 on LTX's decoder between a from_pretrained module and one loaded by load_state_dict)
    assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), (a - b).abs().max()
    assert summary["latent_norm"] and "serves" in summary

    # the clip rule
    from run_setup import prepare_run
    base = run_args(folder, url, runs, "rule", resolution, 0, *family)
    if t > 1:
        with pytest.raises(ConfigError, match=rf"takes clips of 1 \+ {t}k frames: the nearest are {1 + t} and "
                                              rf"{1 + 2 * t}"):
            prepare_run(base + ["--video_frames", str(2 + t)])
    elif not t:
        with pytest.raises(ConfigError, match=f"a {class_name}, an image VAE: clips \\(--video_frames\\) need a video"):
            prepare_run(base + ["--video_frames", "5"])


def test_training_runs_the_training_plan_and_evaluation_the_inference_plan():
    """HunyuanVideo's inference encodes and decodes clips of more than 16 frames frame-wise in tiles (a different
    result); training runs the whole clip (its training plan). A clip of 21 frames reaches the tiles: in training
    mode encode and decode equal the class's own module with frame-wise coding off, in evaluation mode they differ
    (a swap of the two plans is red here; the tiny runs above never reach a tile)."""
    class_name = "AutoencoderKLHunyuanVideo"
    params = diffusers_ae.DiffusersParams.of(class_name, TINY[class_name])
    torch.manual_seed(0)
    model = diffusers_ae.DiffusersAutoEncoder(params)
    reference = diffusers_ae._module(class_name, TINY[class_name])
    reference.load_state_dict(model.model.state_dict())
    reference.use_framewise_encoding = reference.use_framewise_decoding = False
    x = torch.rand(1, 3, 1 + 5 * params.temporal_factor, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    assert x.shape[2] > model.model.tile_sample_min_num_frames
    with torch.no_grad():
        mean = model.encode(x)
        decoded = model.decode(mean)
        # (the same ops on the same weights, but for the rounding of CPU kernels that oneDNN may pick by the weights'
        # memory alignment: see the fine-tune test; the tiles move the result by ~0.4)
        def close(a, b):
            return (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
        assert close(mean, reference.encode(x).latent_dist.mean)
        assert close(decoded, reference.decode(mean).sample)
        model.eval()
        assert not close(model.encode(x), mean) and not close(model.decode(mean), decoded)


def test_a_scale_class_reestimates_its_factor_from_latents_with_a_mean():
    """A class whose pipelines scale latents without a shift (scaling_factor only) re-estimates the factor that gives
    the scaled latents a unit RMS: latents with a mean of 1.5 and a std of 0.5 get 1 / sqrt(1.5^2 + 0.5^2), not
    1 / 0.5 (a factor from the std alone survived before); a scale-and-shift class gets unit std about zero."""
    z = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.5 + 1.5
    stats = {"latent_mean": z.mean().item(), "latent_std": z.std().item()}
    for class_name, pipeline in (("AutoencoderKLHunyuanImage", lambda z, f: z * f["scaling_factor"]),
                                 ("AutoencoderTiny", lambda z, f: (z - f["shift_factor"]) * f["scaling_factor"])):
        with torch.device("meta"):
            model = diffusers_ae.DiffusersAutoEncoder(diffusers_ae.DiffusersParams.of(class_name, TINY[class_name]))
        seen = pipeline(z, model.normalisation_from_stats(stats))
        assert abs(seen.square().mean().sqrt().item() - 1) < 1e-3, class_name
        assert class_name == "AutoencoderKLHunyuanImage" or abs(seen.mean().item()) < 1e-4


# ------------------------------------------------------------------------------------------ the registry
def test_every_diffusers_autoencoder_trains_here_or_is_refused_in_one_line(tmp_path):
    """Every autoencoder class the installed diffusers exports is read by a family (natively, or through its own
    module with a tiny config tested above) or refused with its reason, in one line that names what loads."""
    import diffusers.models.autoencoders as autoencoders
    from diffusers import ModelMixin
    classes = {name for name in dir(autoencoders) if isinstance(getattr(autoencoders, name), type)
               and issubclass(getattr(autoencoders, name), ModelMixin)}
    native = set(families.LDM_FAMILY.CLASSES) | set(families.WAN_FAMILY.CLASSES)
    assert classes - native - set(diffusers_ae.CLASSES) - set(diffusers_ae.REFUSED) == set()
    assert set(diffusers_ae.CLASSES) - native == set(TINY) - native  # each class that trains is tested above
    for name, reason in diffusers_ae.REFUSED.items():
        folder = tmp_path / name
        os.makedirs(folder)
        json.dump({"_class_name": name}, open(folder / "config.json", "w"))
        open(folder / layouts.DIFFUSERS_WEIGHTS, "w").close()
        with pytest.raises(layouts.SourceError) as error:
            families.load_source(str(folder))
        message = str(error.value)
        assert reason in message and "loadable are" in message and "\n" not in message, message


@pytest.mark.process
def test_the_adaptive_weights_last_layer_is_the_last_layer_the_decoder_runs():
    """LDM's adaptive GAN weight reads each loss's gradient at the decoder's last layer: the last one it *runs* (hooks
    on a real decode of every class here record it), which for Mochi is a Linear registered after convolutions it runs
    earlier. Every other class's is its last registered convolution, as before."""
    for class_name, config in TINY.items():
        params = diffusers_ae.DiffusersParams.of(class_name, config)
        with diffusers_ae.quiet_diffusers():
            model = diffusers_ae.DiffusersAutoEncoder(params)
        ran = []
        for module in model.modules():
            if isinstance(getattr(module, "weight", None), torch.nn.Parameter) and module.weight.dim() > 1:
                module.register_forward_hook(lambda m, *_: ran.append(m))
        z = torch.randn(1, params.z_channels, *((2,) if not params.takes_images else ()), 2, 2)
        with torch.no_grad():
            model.decode(z)
        assert model.last_layer() is ran[-1].weight, class_name
        convs = [m for m in model.model.decoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
        if class_name == "AutoencoderKLMochi":
            assert isinstance(ran[-1], torch.nn.Linear) and ran[-1] is model.model.decoder.proj_out
        else:
            assert ran[-1] is convs[-1], class_name


# the registry, the native families' layouts and the model modules
NAMING_MODULES = ("families", "ldm_layouts", "wan_layouts", "diffusers_ae", "ae", "wan_ae", "tae")
MODEL_CLASSES = ("AutoEncoder", "WanAutoEncoder", "DiffusersAutoEncoder", "WanParams", "DiffusersParams",
                 "TinyAutoEncoder", "TAEParams")


def test_no_module_outside_the_registry_names_a_family():
    """Only families.py, the native families' layouts (ldm_layouts.py, wan_layouts.py) and the model modules know a
    family: no other module branches on a family (its name, --vae_family, the class of its model or params), or names
    a diffusers autoencoder class (in code: docstrings and comments may)."""
    import diffusers.models.autoencoders as autoencoders
    class_names = {name for name in dir(autoencoders) if name[0].isupper()}
    found = []
    for file in sorted(os.listdir(ROOT)):
        module = file[:-3]
        if not file.endswith(".py") or module in NAMING_MODULES:
            continue
        tree = ast.parse(open(os.path.join(ROOT, file)).read())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named = [c for c in class_names if c in node.value]
                if named:
                    found.append((file, node.lineno, named[0]))
            if isinstance(node, ast.Compare):  # (a family's name: --vae_family's value, a model's params.family)
                operands = [node.left, *node.comparators]
                if any(isinstance(o, (ast.Attribute, ast.Name)) and getattr(o, "attr", getattr(o, "id", None)) in
                       ("vae_family", "family") for o in operands):
                    found.append((file, node.lineno, "a branch on a family's name"))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = ast.unparse(node.args[1])
                if any(kind in kinds for kind in MODEL_CLASSES):
                    found.append((file, node.lineno, f"isinstance(..., {kinds})"))
            if isinstance(node, ast.Attribute) and node.attr in class_names:
                found.append((file, node.lineno, node.attr))
    assert found == []


def test_every_family_s_model_answers_for_itself():
    """Each family's model class is an ae.Trainable (issue 49): built tiny, it answers what the trainer, the memory
    check, evaluation and export ask of it (its encoder side, last layer, compression, memory plan, shard units,
    latent normalisation), as the registry's entries no longer do."""
    from ae import AutoEncoderParams, Trainable
    from tae import TAEParams
    from wan_ae import WanParams
    tiny = {"ldm": AutoEncoderParams(ch=8, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, norm_groups=4),
            "wan": WanParams(ch=8, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, video=True,
                             temporal_downsample=(True,)),
            "tae": TAEParams(4, "f8", 1),
            "diffusers": diffusers_ae.DiffusersParams.of("AutoencoderKLCogVideoX", TINY["AutoencoderKLCogVideoX"])}
    assert set(tiny) == set(families.FAMILIES)
    for name, family in families.FAMILIES.items():
        assert issubclass(family.model_class, Trainable) and issubclass(family.model_class, torch.nn.Module), name
        vae = family.build(tiny[name])
        assert isinstance(vae, family.model_class)
        names = {n for n, p in vae.named_parameters()}
        side = {p for _, module in vae.encoder_side() for p in module.parameters()}
        assert side and all(p.requires_grad for p in side), name
        assert isinstance(vae.last_layer(), torch.nn.Parameter) and vae.last_layer() not in side, name
        assert isinstance(vae.temporal_factor, int) and isinstance(vae.takes_images(), bool), name
        assert vae.time_chunk_factor() in (0, vae.temporal_factor), name
        assert family.time_chunks_refusal == vae.time_chunks_refusal and bool(vae.time_chunk_factor()) == (
            name == "wan"), name
        plan = (1, 1) if vae.time_chunk_factor() else (0, 0)  # (the memory check sets and restores a plan)
        vae.set_memory_plan("none", plan)
        assert vae.memory_plan() == ("none", plan), name
        if not vae.time_chunk_factor():
            with pytest.raises(ConfigError, match="--train_time_chunks"):
                vae.set_memory_plan("none", (1, 1))
        assert (vae.norm_groups is not None) == (name == "ldm") and isinstance(vae.unshardable(), str), name
        assert vae.unshardable() or all(isinstance(u, torch.nn.Module) for u in vae.shard_units()), name
        assert vae.latent_norm() in ("fields", "factors", "bn", "released") and vae.norm_label() and vae.serves()
        assert vae.describe() == family.describe(vae.params) and names, name


def test_callers_ask_the_model_not_the_registry():
    """Issue 49: a caller holding a model asks it (ae.Trainable); `families.of(` stays for at most two callers that hold
    a source, and no capability is probed with getattr (norm_groups, train_chunks)."""
    import re
    files = [os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py") and f != "families.py"]
    files += [os.path.join(ROOT, "bench", f) for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")]
    text = {f: open(f).read() for f in files}
    assert sum(t.count("families.of(") for t in text.values()) <= 2
    probes = [f for f, t in text.items() if re.search(r"getattr\([^)]*[\"'](norm_groups|train_chunks)[\"']", t)]
    assert probes == []


def test_the_registry_reads_sections_not_the_whole_config():
    """Issue 49: only the composition roots (run_setup.py, vae_trainer.py) hold the whole config; the registry's
    entries and the model modules take the sections they read (apply_source, check, settled, init_weights)."""
    readers = []
    for module in NAMING_MODULES:
        tree = ast.parse(open(os.path.join(ROOT, f"{module}.py")).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "cfg" or (a.annotation is not None and ast.unparse(a.annotation) == "Config")
                       for a in args):
                    readers.append(f"{module}.{node.name}")
    assert readers == []


def test_the_compression_is_measured_from_what_the_class_computes():
    """LTX-2's module reports spatial/temporal compression 64/16 at diffusers' default config while it computes 32/8
    (the survey's finding); the measurement reads what it computes, and for an image class finds no clips."""
    with torch.device("meta"):
        model = diffusers_ae.diffusers_class("AutoencoderKLLTX2Video")()
    assert (model.spatial_compression_ratio, model.temporal_compression_ratio) == (64, 16)
    params = diffusers_ae.DiffusersParams.of("AutoencoderKLLTX2Video", dict(model.config))
    assert (params.spatial_factor, params.temporal_factor, params.z_channels) == (32, 8, 128)
    image = diffusers_ae.DiffusersParams.of("AutoencoderDC", TINY["AutoencoderDC"])
    assert (image.spatial_factor, image.temporal_factor, image.posterior) == (32, 0, "none")


# ------------------------------------------------------------------------------------------ caches and gradients
def clip(frames: int, size: int = 32, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return (torch.rand(1, 3, frames, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1).to(dtype)


def test_wan_through_diffusers_has_the_gradients_of_the_whole_clip(tmp_path):
    """diffusers' AutoencoderKLWan keeps a feature cache across its chunks (1, 4, 4 frames in, a latent frame at a
    time out), reset at each call: the gradients of every weight through it equal those of wan_ae.py's video model
    on the whole clip at once (the same function: its own tests hold it bitwise on diffusers' plan), to float
    rounding. Both clamp the decoded clip (wan_ae.py in eval mode), so the function compared is the same."""
    folder = tiny_folder("AutoencoderKLWan", tmp_path / "wan")
    generic = families.build_model(families.load_source(folder, video=True, vae_family="diffusers").params)
    generic.load_state_dict(families.load_source(folder, video=True, vae_family="diffusers").state)
    native_source = families.load_source(folder, video=True)
    native = families.build_model(native_source.params)
    native.load_state_dict(native_source.state)
    x = clip(9)
    grads = []
    for vae in (generic.eval(), native.eval()):  # eval: diffusers' chunk plan for the generic, with grad: the whole
        vae.zero_grad()                           # clip at once for wan_ae.py
        recon, mean, _ = vae(x, sample=False)
        (recon.square().mean() + mean.square().mean()).backward()
        grads.append({k.removeprefix("model."): p.grad.reshape(-1) for k, p in vae.named_parameters()})
    theirs, ours = grads
    assert theirs.keys() == ours.keys()
    scale = max(g.abs().max().item() for g in ours.values())
    assert [name for name, g in ours.items() if (theirs[name] - g).abs().max() > 1e-5 * scale] == []


def test_magvit_frame_batches_carry_the_gradient_of_the_whole_clip():
    """Magvit encodes 4 frames and decodes 1 latent frame at a time, its previous features cached across the
    batches: its gradients equal those of the whole clip in one batch, to float rounding."""
    params = diffusers_ae.DiffusersParams.of("AutoencoderKLMagvit", TINY["AutoencoderKLMagvit"])
    torch.manual_seed(0)
    vae = diffusers_ae.DiffusersAutoEncoder(params)
    x = clip(13)
    grads = []
    for frames, latent_frames in ((4, 1), (13, 4)):  # its own batches, then the whole clip in one
        vae.model.num_sample_frames_batch_size, vae.model.num_latent_frames_batch_size = frames, latent_frames
        vae.zero_grad()
        recon, mean, _ = vae(x, sample=False)
        (recon.square().mean() + mean.square().mean()).backward()
        grads.append([p.grad.clone() for p in vae.parameters()])
    scale = max(g.abs().max().item() for g in grads[1])
    assert all((a - b).abs().max() <= 1e-5 * scale for a, b in zip(*grads))


def test_cogvideox_trains_through_its_frame_batches_with_the_cache_carrying_the_gradient():
    """CogVideoX encodes a clip 8 frames at a time (its frame batching cannot be turned off: it is what its
    pipelines run), each batch reading the convolution cache of the one before. The autograd gradient of the last
    latent frames with respect to the first batch's frames equals a finite difference of the forward (float64): the
    cache passes the gradient on (a detached cache would give autograd 0 there)."""
    params = diffusers_ae.DiffusersParams.of("AutoencoderKLCogVideoX", TINY["AutoencoderKLCogVideoX"])
    torch.manual_seed(0)
    vae = diffusers_ae.DiffusersAutoEncoder(params).double()
    x = clip(17, dtype=torch.float64).requires_grad_(True)
    probe = torch.randn(1, params.z_channels, 2, 4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def late(x):  # the latent frames of the second batch of 8 frames, seen through a fixed direction
        return (vae.encode(x)[:, :, -2:] * probe).sum()
    late(x).backward()
    direction = torch.zeros_like(x)
    direction[:, :, :9] = torch.randn(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        eps = 1e-6
        finite = (late(x + eps * direction) - late(x - eps * direction)) / (2 * eps)
    autograd = (x.grad * direction).sum()
    assert abs(finite.item()) > 1e-3  # the first batch does reach the last latent frames
    assert autograd.item() == pytest.approx(finite.item(), rel=1e-5)


def test_the_memory_check_probes_clips_of_the_runs_length_in_a_diffusers_class():
    """The memory check runs a diffusers class's own module on clips of the run's length: more frames, more
    activation memory; checkpointing the decoder (the class's own) holds less."""
    import memory
    import run_setup
    from conftest import objective_of
    vae = diffusers_ae.DiffusersAutoEncoder(diffusers_ae.DiffusersParams.of("AutoencoderKLHunyuanVideo",
                                                                            TINY["AutoencoderKLHunyuanVideo"]))
    cfg = run_setup.parse_config(["--perceptual_weight", "0", "--mse_pool_factor", "4"])
    objective = objective_of(cfg, with_lpips=False, z_channels=4)

    def need(frames, checkpointing="none"):
        shape = memory.StepShape(1, 32, frames=frames, grad_checkpointing=checkpointing)
        return memory.estimate_step_memory(vae, objective, shape, probe_resolutions=(16, 32)).activations
    assert need(1) < need(5) < need(9)
    assert need(9, "decoder") < need(9)
    assert vae.grad_checkpointing == "none"  # the probes set their mode and this one back


# ------------------------------------------------------------------------------------------ under torchrun
@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_video_class_fine_tunes_under_torchrun_with_identical_ranks(clip_url, tmp_path, capsys):
    """`torchrun --nproc_per_node=2 vae_trainer.py --init_from <AutoencoderKLLTXVideo folder> --video_frames 9
    --train_parts decoder --video_image_prob 0.5`, seeded so that a step of single frames comes before a step of
    clips: the LTX decoder (timestep-conditioned, with noise injection drawn from each micro-batch's seed) trains
    through DDP with identical weights on both ranks, the encoder stays the source's bitwise, and the export loads
    in diffusers."""
    import checkpoint
    import data as data_lib
    from conftest import run_cli
    folder = tiny_folder("AutoencoderKLLTXVideo", tmp_path / "ltx")
    seed = next(s for s in range(100) if [data_lib.TrainStream([], 64, 2, s, 0, 1, 1, 1, 0.5, 1, 2, frames=9,
                                                               image_prob=0.5).frames_at(i) for i in (0, 1)] == [1, 9])
    args = run_args(folder, clip_url, tmp_path / "runs", "ddp", 64, 9, "--video_image_prob", "0.5", "--seed",
                    str(seed), "--num_workers", "1")
    proc = run_cli("vae_trainer.py", args, nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(weights identical on all ranks)" in proc.stdout
    ckpt = checkpoint.load_checkpoint(str(tmp_path / "runs" / "ddp" / "checkpoints" / "step_00000002.pt"))
    assert ckpt["run"]["ranks_in_sync"] is True
    source = families.load_source(folder)
    frozen = [k for k in source.state if k.startswith("model.encoder.")]
    assert all(torch.equal(ckpt["training"]["vae"][k], source.state[k]) for k in frozen)
    assert export.main(["--ckpt", str(tmp_path / "runs" / "ddp"), "--out", str(tmp_path / "out")]) == 0
    with diffusers_ae.quiet_diffusers():
        exported = diffusers_ae.diffusers_class("AutoencoderKLLTXVideo").from_pretrained(tmp_path / "out")
    assert all(torch.equal(v, ckpt["training"]["vae"]["model." + k]) for k, v in exported.state_dict().items())


# ------------------------------------------------------------------------------------------ bad input
def test_what_a_family_cannot_do_is_one_line_and_writes_nothing(shard_url, tmp_path, capsys):
    """Each refusal is one `error:` line before anything is written: a family the user names that does not read the
    folder's class (a flag given is never dropped), checkpointing a class without it, --compile through diffusers'
    module, a single file of a family that loads from its folder, a size off a class's own spatial factor (named as
    the class's, not as --vae_ch_mult's, a flag the class does not read: issue 48 item 12)."""
    import vae_trainer
    from safetensors.torch import save_file
    hv = tiny_folder("AutoencoderKLHunyuanVideo", tmp_path / "hv")
    qwen2 = tiny_folder("AutoencoderKLQwenImage21", tmp_path / "qwen2")
    ltx2 = tiny_folder("AutoencoderKLLTX2Video", tmp_path / "ltx2")
    save_file({"vae.encoder.conv_in.conv.weight": torch.zeros(8, 3, 3, 3, 3)}, tmp_path / "ltx-video-2b.safetensors")
    runs = tmp_path / "runs"
    cases = [([hv, "--vae_family", "wan"], "a AutoencoderKLHunyuanVideo, which --vae_family wan does not read (its "
                                           "family: diffusers)"),
             ([qwen2, "--grad_checkpointing", "decoder"], "diffusers' AutoencoderKLQwenImage21 has no gradient "
                                                          "checkpointing"),
             ([qwen2, "--compile"], "--compile: not tested with diffusers' own modules"),
             ([str(tmp_path / "ltx-video-2b.safetensors")], "the other families load from their diffusers folder"),
             ([ltx2, "--video_frames", "9", "--vae_resolution", "48"],
              "--vae_resolution 48 is not divisible by the spatial factor 32 of AutoencoderKLLTX2Video")]
    for extra, message in cases:
        args = ["--init_from", extra[0], "--dataset_url", shard_url, "--output_dir", str(runs), "--run_name", "x",
                "--vae_resolution", "32", "--wandb_mode", "disabled", *extra[1:]]
        assert vae_trainer.main(args) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "--vae_ch_mult" not in err[0], err
    assert not os.path.exists(runs)


def test_the_memory_check_offers_only_what_a_class_can_do():
    """A class without gradient checkpointing (Qwen-Image 2 in diffusers) is estimated and told what helps in one
    line, which never offers --grad_checkpointing (estimating that remedy used to raise out of the check)."""
    import memory
    import run_setup
    from conftest import objective_of
    vae = diffusers_ae.DiffusersAutoEncoder(diffusers_ae.DiffusersParams.of("AutoencoderKLQwenImage21",
                                                                            TINY["AutoencoderKLQwenImage21"]))
    cfg = run_setup.parse_config(["--perceptual_weight", "0", "--mse_pool_factor", "4"])
    objective = objective_of(cfg, with_lpips=False, z_channels=8)
    shape = memory.StepShape(64, 4096, can_checkpoint=vae.can_checkpoint())
    verdict = memory.check_before_training(vae, objective, shape, torch.device("cpu"), ema=True)
    line, refuse = verdict.line, verdict.refuse
    assert refuse and "\n" not in line and "--batch_size 32 --grad_accum 2" in line and "--precision bf16" in line
    assert "--grad_checkpointing" not in line
    assert memory.all_remedies(shape)[1].grad_checkpointing == "none"
