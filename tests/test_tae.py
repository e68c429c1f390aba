"""The tiny autoencoders (tae.py, the `tae` family; issue 47): the released TAEF2 read by the project scores what its
release does on real photos; every layout is written and read back bitwise (the released pair, TAEHV's single file,
diffusers' AutoencoderTiny, which computes what ours does); a TAEHV runs a clip in one pass as its released code runs
it frame by frame; a fine-tune of TAEF2 keeps a frozen encoder bitwise, resumes exactly and exports files that a
loader of the released layout reads; distillation from a teacher's latents; bad input is one line."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import evaluate
import export
import families
import tae
import vae_trainer
from conftest import TINY
from test_families import clip_url  # noqa: F401  (the clips fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TAEF2 = os.path.join(os.path.dirname(__file__), "fixtures", "taef2")
# What the release scores on scikit-image's photos (the centre square, area-resized to 256 px), as published with it
# (../shared/fixtures/taef2/SOURCE.md) to 0.1 dB: a loader that reads its layout wrongly scores far less.
RELEASED_PSNR = {"astronaut": 28.7, "coffee": 33.0, "chelsea": 34.8, "rocket": 34.2}


def photo(name: str, size: int = 256) -> torch.Tensor:
    """A scikit-image sample photo: its centre square, area-resized to `size`, in [-1, 1], (1, 3, size, size)."""
    from skimage import data
    image = np.array(getattr(data, name)())
    h, w = image.shape[:2]
    side = min(h, w)
    square = image[(h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side]
    x = torch.from_numpy(square).permute(2, 0, 1)[None].float() / 127.5 - 1
    return F.interpolate(x, size=(size, size), mode="area")


def psnr_of(model, x: torch.Tensor) -> float:
    with torch.no_grad():
        recon = model(x)[0].clamp(-1, 1)
    return float(evaluate.psnr_per_image((recon + 1) / 2, (x + 1) / 2).mean())


def the_release():
    source = families.load_source(TAEF2)  # what --init_from reads
    vae = families.build_model(source.params)
    vae.load_state_dict(source.state)
    return vae.eval(), source


# ------------------------------------------------------------------------------------------- a loader of the released
# layout, written from the published architecture (the taesd repository's README and code, in this file's words),
# independent of tae.py: what ComfyUI and madebyollin's code do with the files
class ReleasedBlock(nn.Module):
    def __init__(self, n, pooled=False):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(n, n, 3, padding=1), nn.ReLU(), nn.Conv2d(n, n, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(n, n, 3, padding=1))
        self.skip, self.fuse = nn.Identity(), nn.ReLU()
        self.pool = (nn.Sequential(nn.Conv2d(n, 4 * n, 1, bias=False), nn.GroupNorm(4, 4 * n), nn.ReLU(),
                                   nn.Conv2d(4 * n, n, 1, bias=False)) if pooled else None)

    def forward(self, x):
        x = x + self.pool(x) if self.pool is not None else x
        return self.fuse(self.conv(x) + self.skip(x))


class ReleasedClamp(nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3) * 3


def released_pair(z: int, pooled: bool) -> tuple[nn.Sequential, nn.Sequential]:
    def down():
        return nn.Conv2d(64, 64, 3, stride=2, padding=1, bias=False)

    def up():
        return [nn.Upsample(scale_factor=2), nn.Conv2d(64, 64, 3, padding=1, bias=False)]
    encoder = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), ReleasedBlock(64),
                            down(), *[ReleasedBlock(64) for _ in range(3)], down(), *[ReleasedBlock(64) for _ in range(3)],
                            down(), *[ReleasedBlock(64, pooled) for _ in range(3)], nn.Conv2d(64, z, 3, padding=1))
    decoder = nn.Sequential(ReleasedClamp(), nn.Conv2d(z, 64, 3, padding=1), nn.ReLU(),
                            *[ReleasedBlock(64, pooled) for _ in range(3)], *up(), *[ReleasedBlock(64) for _ in range(3)],
                            *up(), *[ReleasedBlock(64) for _ in range(3)], *up(), ReleasedBlock(64),
                            nn.Conv2d(64, 3, 3, padding=1))
    return encoder, decoder


def load_released_pair(prefix: str, z: int, pooled: bool):
    """The released code's way: two Sequentials, each half's state dict loaded strictly; images in [0, 1]."""
    encoder, decoder = released_pair(z, pooled)
    encoder.load_state_dict(torch.load(prefix + "_encoder.pth", weights_only=True))
    decoder.load_state_dict(torch.load(prefix + "_decoder.pth", weights_only=True))
    encoder, decoder = encoder.float().eval(), decoder.float().eval()
    return lambda x01: decoder(encoder(x01))


# ------------------------------------------------------------------------------------------- the release
@pytest.mark.process
def test_the_released_taef2_read_by_the_project_scores_what_its_release_does():
    """Loaded as --init_from loads it (families.load_source: the layout and variant from the state dict alone), TAEF2
    reconstructs the four photos at its published PSNR; the released-layout loader above agrees with it."""
    vae, source = the_release()
    assert source.params == tae.TAEParams(32, "flux_2") and source.layout == "pair"
    assert vae.downsample_factor == 8 and vae.params.posterior == "none"
    released = load_released_pair(os.path.join(TAEF2, "taef2"), 32, pooled=True)
    for name, published in RELEASED_PSNR.items():
        x = photo(name)
        assert abs(psnr_of(vae, x) - published) < 0.06, (name, psnr_of(vae, x), published)
        with torch.no_grad():
            theirs = released((x + 1) / 2) * 2 - 1
            ours = vae(x)[0]
        assert (theirs - ours).abs().max() <= 1e-5 * ours.abs().max(), name
    latent = vae.encode(photo("astronaut"))
    assert latent.shape == (1, 32, 32, 32) and latent.dtype == torch.float32


def test_the_release_through_evaluate_py_scores_the_same(tmp_path, capsys):
    """evaluate.py --ckpt takes a released TAE's folder (no run needed) and measures what the test above does."""
    from PIL import Image
    images = tmp_path / "photos"
    images.mkdir()
    published = {name: RELEASED_PSNR[name] for name in ("coffee", "rocket")}
    for name in published:
        pixels = ((photo(name)[0] + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(images / f"{name}.png")
    assert evaluate.main(["--ckpt", TAEF2, "--dataset_url", str(images), "--resolution", "256",
                          "--inception_weights", "none", "--vgg16_weights", "none", "--batch_size", "2"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    mean_published = sum(published.values()) / len(published)
    assert abs(result["psnr"] - mean_published) < 0.15, (result, out.err[-2000:])


# ------------------------------------------------------------------------------------------- layouts
def random_tae(params: tae.TAEParams, seed: int = 0) -> tae.TinyAutoEncoder:
    torch.manual_seed(seed)
    vae = tae.TinyAutoEncoder(params)
    with torch.no_grad():  # off the defaults, so that a swapped or dropped tensor shows
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return vae.eval()


LAYOUTS = {"f8": tae.TAEParams(4, "f8"), "flux_2": tae.TAEParams(32, "flux_2"), "f32": tae.TAEParams(32, "f32"),
           "f8_patch2": tae.TAEParams(48, "f8", 2), "hv": tae.TAEParams(16, "hv"),
           "hv_patch2": tae.TAEParams(48, "hv", 2), "hv_t8_patch4": tae.TAEParams(8, "hv", 4, (True,) * 3, (True,) * 3)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_is_written_and_read_back_bitwise(name, tmp_path):
    params = LAYOUTS[name]
    vae = random_tae(params)
    files = tae.write_released(vae, str(tmp_path / "out"), "mine")
    assert [os.path.basename(f) for f in files] == (["mine.pth"] if params.video else
                                                    ["mine_encoder.pth", "mine_decoder.pth"])
    for path in [str(tmp_path / "out"), files[0], str(tmp_path / "out" / "mine")]:  # the folder, a file, the prefix
        if params.video and path.endswith("mine"):
            continue
        loaded = tae.load(path)
        assert loaded.params == params, path
        assert loaded.state.keys() == vae.state_dict().keys()
        assert all(torch.equal(loaded.state[k], v) for k, v in vae.state_dict().items())
    if params.video:  # TAEHV's other published layout: the same keys as .safetensors
        from safetensors.torch import save_file
        save_file({k: v.half() for k, v in vae.state_dict().items()}, str(tmp_path / "mine.safetensors"))
        loaded = tae.load(str(tmp_path / "mine.safetensors"))
        assert loaded.params == params and loaded.layout == "single_file"
        assert all(torch.equal(loaded.state[k], v.half().float()) for k, v in vae.state_dict().items())
    size = 64 if params.downsample_factor <= 16 else 128
    frames = 1 + 2 * params.temporal_factor  # a clip of 1 + t k frames
    x = torch.rand(1, 3, frames, size, size) * 2 - 1 if params.video else torch.rand(2, 3, size, size) * 2 - 1
    with torch.no_grad():
        recon, z, logvar = vae(x)
    f, t = params.downsample_factor, params.temporal_factor
    assert logvar is None and recon.shape == x.shape
    assert z.shape[-2:] == (size // f, size // f) and z.shape[1] == params.z_channels
    if params.video:
        assert z.shape[2] == 3  # 1 + k latent frames


def test_taesd_layout_is_diffusers_autoencoder_tiny_both_ways(tmp_path):
    """f8 (TAESD's layout) exports as a diffusers AutoencoderTiny that computes what ours does, and such a folder
    loads natively (the tae family reads the class's standard layout)."""
    from diffusers import AutoencoderTiny
    vae = random_tae(LAYOUTS["f8"])
    tae.write_diffusers(vae, str(tmp_path / "tiny"))
    theirs = AutoencoderTiny.from_pretrained(tmp_path / "tiny").eval()
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x)
        assert torch.allclose(theirs.encode(x).latents, z, atol=1e-5 * z.abs().max().item(), rtol=0)
        ours = vae.decode(z)
        assert torch.allclose(theirs.decode(z).sample, ours, atol=1e-5 * ours.abs().max().item(), rtol=0)
    source = families.load_source(str(tmp_path / "tiny"))
    assert source.params == vae.params and families.of_params(source.params) is families.TAE_FAMILY
    assert all(torch.equal(source.state[k], v) for k, v in vae.state_dict().items())
    for other in ("flux_2", "f32", "hv"):
        with pytest.raises(ValueError, match="--format released"):
            tae.write_diffusers(random_tae(LAYOUTS[other]), str(tmp_path / other))


def frame_by_frame(vae: tae.TinyAutoEncoder, stack: nn.Sequential, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """A TAEHV stack run one frame at a time in causal order, as its released streaming code does: a MemBlock reads
    its own previous input (zeros at first), a TPool waits for `stride` frames and stacks them on the channels, a
    TGrow unstacks its output into `stride` frames. Written without tae.py's batched run."""
    queue = [(x, 0) for x in frames]
    memory: dict[int, object] = {}
    out = []
    while queue:
        x, i = queue.pop(0)
        if i == len(stack):
            out.append(x)
            continue
        block = stack[i]
        if isinstance(block, tae.MemBlock):
            y = block(x, memory.get(i, torch.zeros_like(x)))
            memory[i] = x
            queue.insert(0, (y, i + 1))
        elif isinstance(block, tae.TPool):
            waiting = memory.setdefault(i, [])
            waiting.append(x)
            if len(waiting) == block.stride:
                memory[i] = []
                queue.insert(0, (block.conv(torch.cat(waiting, 1)), i + 1))
        elif isinstance(block, tae.TGrow):
            for part in reversed(block.conv(x).chunk(block.stride, 1)):
                queue.insert(0, (part, i + 1))
        else:
            queue.insert(0, (block(x), i + 1))
    return out


@pytest.mark.parametrize("name", ["hv", "hv_t8_patch4"])
def test_a_taehv_clip_in_one_pass_is_its_frames_run_one_by_one(name):
    """The batched run (frames of the clip as a batch, MemBlocks reading a shifted copy) computes what the causal
    frame-by-frame run computes, encoder and decoder, with the end padding and the start trim of the released code."""
    vae = random_tae(LAYOUTS[name])
    p = vae.params
    t = p.temporal_factor
    x = torch.rand(1, 3, 1 + t, 32 * p.patch_size, 32 * p.patch_size) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x)
        frames = list(((x + 1) / 2).unbind(2))
        frames += [frames[-1]] * (t - 1)  # the end padded to a multiple of t with the last frame
        frames = [F.pixel_unshuffle(f, p.patch_size) if p.patch_size > 1 else f for f in frames]
        expected = torch.stack(frame_by_frame(vae, vae.encoder, frames), 2)
        assert torch.allclose(z, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
        y = vae.decode(z)
        decoded = frame_by_frame(vae, vae.decoder, list(z.unbind(2)))[t - 1:]  # the first t - 1 frames dropped
        decoded = [F.pixel_shuffle(f, p.patch_size) if p.patch_size > 1 else f for f in decoded]
        expected = torch.stack(decoded, 2) * 2 - 1
        assert y.shape == x.shape
        assert torch.allclose(y, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


# ------------------------------------------------------------------------------------------- training
ARCH_FLAGS = ("--vae_ch", "--vae_ch_mult", "--vae_num_res_blocks", "--vae_z_channels", "--do_attn")
FLAGS = [a for i, a in enumerate(TINY) if a not in ARCH_FLAGS and (i == 0 or TINY[i - 1] not in ARCH_FLAGS)]


def run_args(url, out, run, steps, *extra) -> list[str]:
    """A tiny run at 64 px (TINY's data and runtime flags; the architecture is the tiny autoencoder's)."""
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", "2", "--log_every_n_steps", "1", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "20", "--perceptual_weight", "0", "--num_workers", "0", "--min_lr_ratio", "1", *FLAGS,
            *extra]


def checkpoint_of(out, run, step) -> dict:
    return torch.load(os.path.join(out, run, "checkpoints", f"step_{step:08d}.pt"), weights_only=True)


@pytest.mark.process
def test_taef2_decoder_fine_tune_keeps_the_encoder_resumes_exactly_and_exports_the_released_layout(shard_url,
                                                                                                    tmp_path, capsys):
    """--init_from TAEF2 --train_parts decoder: the encoder stays the release's bitwise (weights and EMA); 2 steps
    and 2 more continued equal 4 uninterrupted (weights, EMA, AdamW); export --format released writes files that the
    released-layout loader reads strictly and that reconstruct as the checkpoint's model does; diffusers'
    AutoencoderTiny cannot hold flux_2's layout: one line."""
    release, source = the_release()
    flags = ("--init_from", TAEF2, "--train_parts", "decoder")
    assert vae_trainer.main(run_args(shard_url, tmp_path, "ref", 4, *flags)) == 0
    assert vae_trainer.main(run_args(shard_url, tmp_path, "cut", 2, *flags)) == 0
    assert vae_trainer.main(run_args(shard_url, tmp_path, "cut", 4, *flags)) == 0
    assert "resumed from" in capsys.readouterr().out
    a, b = checkpoint_of(tmp_path, "ref", 4), checkpoint_of(tmp_path, "cut", 4)
    for key in ("vae", "ema"):
        assert a["training"][key].keys() == b["training"][key].keys()
        for name, value in a["training"][key].items():
            assert torch.equal(value, b["training"][key][name]), (key, name)
            if name.startswith("encoder."):
                assert torch.equal(value, source.state[name]), (key, name)
    assert any(not torch.equal(v, source.state[k]) for k, v in a["training"]["vae"].items() if k.startswith("decoder"))
    for pid, state in a["training"]["optimizer"]["state"].items():
        assert all(torch.equal(v, b["training"]["optimizer"]["state"][pid][n]) for n, v in state.items())
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert (config["vae_family"], config["tae_variant"], config["posterior"]) == ("tae", "flux_2", "none")

    out = tmp_path / "released"
    assert export.main(["--ckpt", str(tmp_path / "ref"), "--out", str(out), "--format", "released"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(os.path.basename(f) for f in summary["files"]) == ["released_decoder.pth", "released_encoder.pth"]
    theirs = load_released_pair(str(out / "released"), 32, pooled=True)
    ours = families.build_model(source.params)
    ours.load_state_dict(a["training"]["vae"])
    x = photo("coffee", 64)
    with torch.no_grad():
        mine, other = ours.eval()(x)[0], theirs((x + 1) / 2) * 2 - 1
    assert (mine - other).abs().max() <= 1e-5 * mine.abs().max()
    assert export.main(["--ckpt", str(tmp_path / "ref"), "--out", str(tmp_path / "d"), "--format", "diffusers"]) == 2
    err = capsys.readouterr().err.strip()
    assert "AutoencoderTiny" in err and "--format released" in err and "\n" not in err
    assert not os.path.exists(tmp_path / "d")
    for extra in (["--scaling_factor", "0.5"], ["--format", "single_file"]):
        assert export.main(["--ckpt", str(tmp_path / "ref"), "--out", str(tmp_path / "bad"), *extra]) == 2
        assert "\n" not in capsys.readouterr().err.strip()


@pytest.mark.process
def test_a_whole_tiny_autoencoder_trains_and_its_autoencoder_tiny_export_loads_in_diffusers(shard_url, tmp_path,
                                                                                            capsys):
    """A new f8 TAE from flags (--vae_family tae) trains whole (encoder included) under bf16 with checkpointing and
    the PatchGAN critic; its diffusers export is an AutoencoderTiny that reconstructs as the checkpoint does."""
    from diffusers import AutoencoderTiny
    assert vae_trainer.main(run_args(shard_url, tmp_path, "new", 2, "--vae_family", "tae", "--vae_z_channels", "4",
                                     "--precision", "bf16", "--grad_checkpointing", "all", "--do_ganloss",
                                     "--discriminator", "patchgan", "--disc_start", "1")) == 0
    assert "a tiny autoencoder (f8, f8 z4)" in capsys.readouterr().out
    ckpt = checkpoint_of(tmp_path, "new", 2)
    assert ckpt["run"]["model_params"]["variant"] == "f8"
    assert export.main(["--ckpt", str(tmp_path / "new"), "--out", str(tmp_path / "tiny")]) == 0
    vae = families.build_model(families.params_from_dict(ckpt["run"]["model_params"]))
    vae.load_state_dict(ckpt["training"]["vae"])
    theirs = AutoencoderTiny.from_pretrained(tmp_path / "tiny").eval()
    x = photo("rocket", 64)
    with torch.no_grad():
        ours = vae.eval()(x)[0]
        other = theirs.decode(theirs.encode(x).latents).sample
    assert (ours - other).abs().max() <= 1e-5 * ours.abs().max()
    assert theirs.config.scaling_factor == 1.0 and theirs.config.shift_factor == 0.0


def photo_crops(folder, names: tuple[str, ...], count: int, seed: int) -> str:
    """64 px crops of scikit-image photos (each at 192 px on its shorter side), `count` per photo, as PNG files."""
    import random
    from PIL import Image
    from skimage import data
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    for name in names:
        image = Image.fromarray(np.array(getattr(data, name)())[..., :3])
        scale = 192 / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        for i in range(count):
            x, y = rng.randint(0, image.width - 64), rng.randint(0, image.height - 64)
            image.crop((x, y, x + 64, y + 64)).save(os.path.join(folder, f"{name}_{i}.png"))
    return str(folder)


@pytest.mark.process
def test_a_fine_tune_of_the_release_at_the_documented_recipe_keeps_nothing_worse_than_it(tmp_path, capsys):
    """docs/finetuning.md's recipe for a small set (decoder only, the defaults: lr 1e-5 for a released TAE, EMA, a
    held-out test set, the best step kept) on crops of four photos: what the run keeps (export.py --best's model, or the release where no step beat it)
    is no worse than the release on held-out crops of two other photos. At a rate that ruins the trained decoder in a
    step (1e-3, no warm-up) nothing is kept: the run says so and --best refuses in one line."""
    train = photo_crops(tmp_path / "train", ("astronaut", "coffee", "chelsea", "rocket"), 6, seed=0)
    held_out = photo_crops(tmp_path / "held_out", ("immunohistochemistry", "retina"), 4, seed=1)

    def psnr(*ckpt) -> float:
        assert evaluate.main([*ckpt, "--dataset_url", held_out, "--resolution", "64", "--vgg16_weights", "none",
                              "--inception_weights", "none"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["psnr"]
    release = psnr("--ckpt", TAEF2)
    recipe = ["--init_from", TAEF2, "--train_parts", "decoder", "--test_dataset_url", held_out,
              "--evaluate_every_n_steps", "2", "--eval_max_images", "8", "--batch_size", "4"]
    # (the ruinous rate: 2 steps, one evaluation after them, which its first step already loses)
    for name, steps, rate in (("recipe", 6, []),
                              ("ruinous", 2, ["--learning_rate_vae", "1e-3", "--warmup_steps", "0"])):
        assert vae_trainer.main(run_args(train, tmp_path, name, steps, *recipe, *rate)) == 0
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["learning_rate_vae"] == (1e-3 if rate else 1e-5), config["learning_rate_vae"]
        done = capsys.readouterr().out.strip().splitlines()[-1]
        best = json.loads((tmp_path / name / "checkpoints" / "best").read_text())
        if best["checkpoint"] is None:
            assert "no evaluated step beat the weights the run started from" in done, done
            assert export.main(["--ckpt", str(tmp_path / name), "--best", "--out", str(tmp_path / "x")]) == 2
            assert "\n" not in capsys.readouterr().err.strip()
            kept = release
        else:
            kept = psnr("--ckpt", str(tmp_path / name), "--best")
        assert kept >= release - 1e-3, (name, kept, release)
        if name == "ruinous":
            assert best["checkpoint"] is None and best["step"] == 0, best


# ------------------------------------------------------------------------------------------- distillation
def teacher_ldm(folder) -> str:
    """A tiny SD-style AutoencoderKL of f8 (4 levels) with SD's factor: a teacher whose latents are scaled."""
    from diffusers import AutoencoderKL
    torch.manual_seed(3)
    AutoencoderKL(block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8, latent_channels=4,
                  down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  scaling_factor=0.5, shift_factor=0.1).save_pretrained(folder)
    return str(folder)


def test_a_student_of_a_vae_learns_its_pipeline_latents(shard_url, tmp_path, capsys):
    """--distill_from a VAE: the student is a tiny autoencoder of the teacher's latent (f8, its channels); its
    decoder decodes the teacher's latents as the pipelines hand them to the diffusion model ((mean - shift) * scale),
    its encoder learns them (loss/latent), and both train."""
    teacher_dir = teacher_ldm(tmp_path / "teacher")
    assert vae_trainer.main(run_args(shard_url, tmp_path, "student", 2, "--distill_from", teacher_dir)) == 0
    assert f"distilling from {teacher_dir}" in capsys.readouterr().out
    config = json.loads((tmp_path / "student" / "config.json").read_text())
    assert (config["vae_family"], config["tae_variant"], config["vae_z_channels"]) == ("tae", "f8", 4)
    rows = [json.loads(line) for line in open(tmp_path / "student" / "metrics.jsonl")]
    assert all("loss/latent" in row for row in rows if "loss/total" in row)

    from run_setup import parse_config, read_teacher
    import train_state
    cfg = parse_config(run_args(shard_url, tmp_path, "x", 2, "--distill_from", teacher_dir, "--vae_family", "tae",
                                "--vae_z_channels", "4"))
    source = read_teacher(cfg)
    teacher = families.build_model(source.params)
    teacher.load_state_dict(source.state)
    student = families.build_model(families.TAE_FAMILY.from_flags(cfg.model))
    latents = train_state.TeacherLatents(teacher, teacher.diffusion_latents(source.factors))
    x = photo("chelsea", 64)
    out = train_state.Decoded(*train_state.TrainingForward(student, teacher_latents=latents)(x))
    expected = (teacher.eval().encode(x) - 0.1) * 0.5
    assert torch.allclose(out.target_latent, expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.equal(out.recon, student.decode(out.target_latent))


@pytest.mark.parametrize("kind", ["flux2", "wan"])
def test_a_student_of_flux2_or_wan_takes_their_layout_and_normalisation(kind, tmp_path):
    """FLUX.2's latent is standardised by its bn statistics over 2x2 patches and unpatchified (TAEF2's layout: a
    flux_2 student); Wan's video VAE per channel, on clips, for a TAEHV student (t4)."""
    import train_state
    from ae import unpatchify_latents
    from run_setup import apply_teacher, parse_config
    from test_flux2 import random_flux2
    if kind == "flux2":
        random_flux2().save_pretrained(tmp_path / "t")
        frames, variant = [], "flux_2"
    else:
        from diffusers import AutoencoderKLWan
        torch.manual_seed(0)
        AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                         temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, -0.4],
                         latents_std=[1.5, 2.0, 2.5, 3.0]).save_pretrained(tmp_path / "t")
        frames, variant = ["--video_frames", "5"], "hv"
    cfg = parse_config(["--distill_from", str(tmp_path / "t"), "--dataset_url", str(tmp_path), *frames])
    cfg, source, _ = apply_teacher(cfg, set(), None)
    assert (cfg.model.vae_family, cfg.model.tae_variant) == ("tae", variant)
    teacher = families.build_model(source.params)
    teacher.load_state_dict(source.state)
    latents = train_state.TeacherLatents(teacher, teacher.diffusion_latents(source.factors))
    x = torch.rand(1, 3, 5, 64, 64) * 2 - 1 if frames else photo("coffee", 64)
    with torch.no_grad():
        mean = teacher.eval().encode(x)
        if kind == "flux2":
            expected = unpatchify_latents(teacher.normalize_latents(mean))
        else:
            expected = (mean - torch.tensor([0.1, -0.2, 0.3, -0.4]).view(1, 4, 1, 1, 1)) / torch.tensor(
                [1.5, 2.0, 2.5, 3.0]).view(1, 4, 1, 1, 1)
        assert torch.allclose(latents(x), expected, atol=1e-6, rtol=0)
    student = families.build_model(families.TAE_FAMILY.from_flags(cfg.model))
    with torch.no_grad():
        assert student.encode(x).shape == expected.shape  # the student's latent is the teacher's grid
        assert student.decode(expected).shape == x.shape


@pytest.mark.process
def test_a_taehv_trains_on_clips_new_or_as_the_student_of_a_video_vae(clip_url, tmp_path, capsys):
    """Clips: a new TAEHV (--tae_variant hv) with the 3D critic and the temporal term, and a TAEHV student of a Wan
    video VAE (clips and single frames mixed), each trains; a deterministic latent is never called collapsed."""
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, -0.4],
                     latents_std=[1.5, 2.0, 2.5, 3.0]).save_pretrained(tmp_path / "wan")
    clips = ("--video_frames", "5", "--batch_size", "1")
    assert vae_trainer.main(run_args(clip_url, tmp_path, "new", 2, "--vae_family", "tae", "--tae_variant", "hv",
                                     "--vae_z_channels", "4", *clips, "--do_ganloss", "--discriminator",
                                     "patchgan3d", "--disc_start", "1", "--temporal_weight", "1")) == 0
    assert vae_trainer.main(run_args(clip_url, tmp_path, "student", 2, "--distill_from", str(tmp_path / "wan"),
                                     *clips, "--video_image_prob", "0.5")) == 0
    out = capsys.readouterr().out
    assert "clips of 1 + 4k frames" in out and "posterior collapse" not in out
    for run in ("new", "student"):
        ckpt = checkpoint_of(tmp_path, run, 2)
        assert ckpt["run"]["model_params"]["variant"] == "hv" and ckpt["run"]["model_params"]["z_channels"] == 4


# ------------------------------------------------------------------------------------------- bad input
def test_bad_tiny_autoencoder_input_is_one_line_and_writes_nothing(shard_url, tmp_path, capsys):
    lone = tmp_path / "lone"
    lone.mkdir()
    import shutil
    shutil.copy(os.path.join(TAEF2, "taef2_encoder.pth"), lone / "taef2_encoder.pth")
    lone_decoder = tmp_path / "lone_decoder"
    lone_decoder.mkdir()
    shutil.copy(os.path.join(TAEF2, "taef2_decoder.pth"), lone_decoder / "taef2_decoder.pth")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    torch.save({"0.weight": torch.zeros(8, 3, 5, 5), "1.bias": torch.zeros(8)}, foreign / "x_encoder.pth")
    torch.save({"0.weight": torch.zeros(8, 3, 5, 5)}, foreign / "x_decoder.pth")
    cases = [
        (["--init_from", str(lone / "taef2_encoder.pth")], "taef2_decoder.pth is not beside it"),
        (["--init_from", str(lone_decoder)], "taef2_encoder.pth is not beside it"),
        (["--init_from", str(foreign)], "not a tiny autoencoder of a layout read here (f8: taesd"),
        (["--init_from", TAEF2, "--video_frames", "5"], "an image model: clips (--video_frames) need a video TAE"),
        (["--vae_family", "tae", "--train_parts", "decoder"], "a new tiny autoencoder's encoder is random"),
        (["--vae_family", "tae", "--posterior", "learned"], "deterministic"),
        (["--init_from", TAEF2, "--last_stage_trains", "1", "--train_resolutions", "32;2:64"], "--last_stage_trains"),
        (["--init_from", TAEF2, "--train_time_chunks", "4,1"], "--train_time_chunks"),
        (["--init_from", TAEF2, "--sharding", "fsdp"], "DDP"),
        (["--distill_from", TAEF2, "--vae_family", "ldm"], "the student is a tiny autoencoder"),
        (["--distill_from", TAEF2, "--latent_noise_prob", "0.5"], "--latent_noise_prob 0.5"),
        (["--distill_from", str(tmp_path / "nothing")], "--distill_from"),
    ]
    for extra, expected in cases:
        rc = vae_trainer.main(run_args(shard_url, tmp_path, "bad", 2, *extra))
        err = capsys.readouterr().err.strip()
        assert rc in (1, 2) and expected in err and "\n" not in err and "Traceback" not in err, (extra, err)
        assert not os.path.exists(tmp_path / "bad"), extra
