"""export.py: the diffusers AutoencoderKL export computes what our model computes (encode mean, decode,
log-variance), our safetensors format round-trips, and the command sets the latent factors."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import ROOT, run_cli, run_in_process

pytestmark = pytest.mark.timeout(180)  # the CLI tests take 10-20 s: a hang fails one test

import evaluate as ev
import export
import ldm_layouts
from ae import AutoEncoder, AutoEncoderParams

CONFIGS = {
    "constant_attn_3_levels": AutoEncoderParams(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4,
                                                use_attn=True),
    "constant_no_attn_2_levels": AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=2, z_channels=4,
                                                   use_attn=False, posterior_var=0.25),
    "constant_8_groups": AutoEncoderParams(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4,
                                           use_attn=False, norm_groups=8),  # --vae_norm_groups 8 (the demo)
    "learned_attn_3_levels": AutoEncoderParams(ch=32, ch_mult=(1, 1, 2), num_res_blocks=1, z_channels=4,
                                               use_attn=True, posterior="learned"),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_vae(params: AutoEncoderParams, seed: int = 0) -> AutoEncoder:
    """Random weights, with GroupNorm affines moved off (1, 0) so that a swapped norm would show."""
    torch.manual_seed(seed)
    vae = AutoEncoder(params).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return vae


def load_diffusers(path):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_pretrained(path, low_cpu_mem_usage=False).eval()


def save_checkpoint(path, params: AutoEncoderParams, resolution: int = 32) -> AutoEncoder:
    """A checkpoint in the trainer's format (the keys export/evaluate read), EMA weights different from `vae`."""
    vae = make_vae(params)
    ema = {k: v + 0.01 * torch.randn_like(v) for k, v in vae.state_dict().items()}
    torch.save({"vae": vae.state_dict(), "ema": ema, "model_params": params.to_dict(),
                "config": {"vae_resolution": resolution}, "step": 7}, path)
    return vae


def assert_one_line_error(r, message: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("name", list(CONFIGS))
def test_diffusers_export_matches_our_model(name, tmp_path):
    params = CONFIGS[name]
    vae = make_vae(params)
    ldm_layouts.export_diffusers(vae, str(tmp_path), resolution=32, scaling_factor=0.7, shift_factor=-0.1)
    theirs = load_diffusers(tmp_path)
    torch.manual_seed(1)
    x = torch.rand(2, 3, 32, 40) * 2 - 1
    with torch.no_grad():
        mean, logvar = vae.encode_moments(x)
        posterior = theirs.encode(x).latent_dist
        z = torch.randn_like(mean)
        ours_decoded, theirs_decoded = vae.decode(z), theirs.decode(z).sample
    torch.testing.assert_close(posterior.mean, mean, atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs_decoded, ours_decoded, atol=1e-5, rtol=0)
    if params.posterior == "constant":
        torch.testing.assert_close(posterior.logvar, torch.full_like(mean, math.log(params.posterior_var)),
                                   atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(posterior.logvar, logvar, atol=1e-5, rtol=0)
    config = theirs.config
    assert (config.scaling_factor, config.shift_factor, config.sample_size) == (0.7, -0.1, 32)
    assert not config.use_quant_conv and not config.use_post_quant_conv and config.force_upcast
    assert config.mid_block_add_attention == params.use_attn
    assert list(config.block_out_channels) == [params.ch * m for m in params.ch_mult]


def test_safetensors_round_trip_is_identical(tmp_path):
    vae = make_vae(CONFIGS["learned_attn_3_levels"])
    export.export_safetensors(vae, str(tmp_path), resolution=32, scaling_factor=0.5, shift_factor=0.25)
    loaded, config = export.load_autoencoder(str(tmp_path))
    assert (config["scaling_factor"], config["shift_factor"], config["resolution"]) == (0.5, 0.25, 32)
    assert loaded.params == vae.params
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        for ours, theirs in zip(vae(x, sample=False), loaded(x, sample=False)):
            assert torch.equal(ours, theirs)
    reloaded, info = ev.load_model(str(tmp_path))  # evaluate.py takes the folder as --ckpt
    assert info["resolution"] == 32 and torch.equal(reloaded.encode(x), loaded.encode(x))


@pytest.mark.parametrize("name", ["constant_attn_3_levels", "learned_attn_3_levels"])
def test_diffusers_export_loads_back_exactly(name, tmp_path):
    """evaluate.py/export.py take a diffusers export as --ckpt: the inverse conversion gives back the same
    architecture (the posterior kind and variance included) and bitwise the same outputs."""
    params = CONFIGS[name]
    vae = make_vae(params)
    ldm_layouts.export_diffusers(vae, str(tmp_path), resolution=32)
    loaded, info = ev.load_model(str(tmp_path))
    ours, theirs = params.to_dict(), loaded.params.to_dict()
    assert ours.keys() == theirs.keys() and info["resolution"] == 32
    for key, value in ours.items():  # the variance goes through diffusers' config as a float: approx there only
        assert theirs[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    x = torch.rand(2, 3, 32, 40) * 2 - 1
    with torch.no_grad():
        for ours, theirs in zip(vae.encode_moments(x), loaded.encode_moments(x)):
            assert (ours is None and theirs is None) or torch.equal(ours, theirs)
        z = torch.randn(2, params.z_channels, 8, 10)
        assert torch.equal(vae.decode(z), loaded.decode(z))


@pytest.mark.timeout(120)
def test_evaluate_cli_takes_a_diffusers_export(tmp_path, photos_dir, capfd):
    """docs/evaluation.md's path: a checkpoint -> its diffusers export -> evaluate.py --ckpt <that folder>."""
    params = CONFIGS["constant_no_attn_2_levels"]
    save_checkpoint(tmp_path / "ckpt.pt", params)
    ema_vae, _ = ev.load_model(str(tmp_path / "ckpt.pt"), ema=True)
    out = tmp_path / "vae-diffusers"
    ldm_layouts.export_diffusers(ema_vae, str(out), resolution=32)  # what `export.py --ema` writes (tested above)
    r = run_in_process(ev.main, ["--ckpt", str(out), "--dataset_url", photos_dir, "--max_images", "2",
                                 "--vgg16_weights", "none", "--inception_weights", "none"], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert (result["checkpoint"], result["resolution"], result["n_images"]) == (str(out), 32, 2)
    ref = ev.evaluate_model(ema_vae, photos_dir, 32, batch_size=16, device=torch.device("cpu"), max_images=2)
    assert result["psnr"] == pytest.approx(ref["psnr"], rel=1e-12)
    assert result["ssim"] == pytest.approx(ref["ssim"], rel=1e-12)


def test_a_foreign_autoencoderkl_is_one_line(tmp_path, capsys):
    """An AutoencoderKL that ae.py cannot hold (level widths not multiples of the first) is one line, no
    traceback. (The SD layout with quant_conv, this test's example before, now loads: ldm_layouts.py.)"""
    from diffusers import AutoencoderKL
    AutoencoderKL(block_out_channels=(32, 48), down_block_types=("DownEncoderBlock2D",) * 2, norm_num_groups=16,
                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4).save_pretrained(tmp_path / "sd")
    assert ev.main(["--ckpt", str(tmp_path / "sd"), "--images", str(tmp_path), "--reconstruct_to",
                    str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "block_out_channels" in err and "\n" not in err, err


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_honour_the_umask(tmp_path, umask):
    """safetensors writes through a 0600 temp file: the export must be as readable as config.json next to it."""
    vae = make_vae(CONFIGS["constant_no_attn_2_levels"])
    old = os.umask(umask)
    try:
        ldm_layouts.export_diffusers(vae, str(tmp_path / "d"), resolution=32)
        export.export_safetensors(vae, str(tmp_path / "s"), resolution=32)
    finally:
        os.umask(old)
    modes = {f"{d}/{f}": oct(os.stat(tmp_path / d / f).st_mode & 0o777)
             for d in ("d", "s") for f in os.listdir(tmp_path / d)}
    assert set(modes) == {"d/config.json", "d/diffusion_pytorch_model.safetensors", "s/config.json",
                          "s/model.safetensors"}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_the_readme_loads_an_export_without_a_warning(tmp_path, capfd):
    """Issue 40 item 12: the README's `AutoencoderKL.from_pretrained("export/...")` warned that `accelerate` was
    missing (diffusers then loads with low_cpu_mem_usage=False: a second copy of the weights in memory).
    requirements.txt installs it (a 0.4 MB wheel and psutil; its other dependencies are ours already): the
    README's export and load, with diffusers' default logging, print nothing and give our model's latent."""
    from diffusers import AutoencoderKL
    from diffusers.utils import logging as diffusers_logging
    assert any(line.split("#")[0].split(">=")[0].strip() == "accelerate"
               for line in open(os.path.join(ROOT, "requirements.txt")))
    save_checkpoint(tmp_path / "ckpt.pt", CONFIGS["constant_no_attn_2_levels"])
    out = str(tmp_path / "export" / "flux_f8c16")
    assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--ema", "--out", out, "--format", "diffusers"]) == 0
    capfd.readouterr()
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_warning()  # diffusers' default: what a user's script shows
    try:
        vae = AutoencoderKL.from_pretrained(out)
    finally:
        diffusers_logging.set_verbosity(level)
    assert capfd.readouterr().err == ""
    ema_vae, _ = ev.load_model(str(tmp_path / "ckpt.pt"), ema=True)
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(vae.encode(x).latent_dist.mean, ema_vae.encode(x), atol=1e-5, rtol=0)


@pytest.mark.process
def test_cli_diffusers_with_factors_and_ema(tmp_path):
    params = CONFIGS["constant_attn_3_levels"]
    save_checkpoint(tmp_path / "ckpt.pt", params)
    out = tmp_path / "vae-diffusers"
    r = run_cli("export.py", ["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out), "--format", "diffusers",
                              "--ema", "--scaling_factor", "0.3611", "--shift_factor", "0.1159"])
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert (summary["scaling_factor"], summary["shift_factor"], summary["ema"]) == (0.3611, 0.1159, True)
    config = json.loads((out / "config.json").read_text())
    assert (config["scaling_factor"], config["shift_factor"]) == (0.3611, 0.1159)
    assert (out / "diffusion_pytorch_model.safetensors").is_file()
    # the EMA weights were exported, not the raw ones
    ema_vae, _ = ev.load_model(str(tmp_path / "ckpt.pt"), ema=True)
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(load_diffusers(out).encode(x).latent_dist.mean, ema_vae.encode(x), atol=1e-5, rtol=0)


def test_cli_factors_from_latent_stats(tmp_path, photos_dir, capfd):
    params = CONFIGS["constant_no_attn_2_levels"]
    vae = save_checkpoint(tmp_path / "ckpt.pt", params)
    out = tmp_path / "vae-st"
    r = run_in_process(export.main, ["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out), "--format",
                                     "safetensors", "--dataset_url", photos_dir, "--latent_stats_images", "4",
                                     "--batch_size", "2"], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = ev.latent_stats(vae, photos_dir, 32, batch_size=2, device=torch.device("cpu"), max_images=4)
    config = json.loads((out / "config.json").read_text())
    assert config["shift_factor"] == pytest.approx(ref["shift_factor"], abs=1e-6)
    assert config["scaling_factor"] == pytest.approx(ref["scaling_factor"], rel=1e-5)
    assert json.loads(r.stdout)["latent_stats"]["n_images"] == 4


def test_cli_defaults_and_clamp_warning(tmp_path, capfd):
    params = AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_attn=False, clamp_th=4.0)
    save_checkpoint(tmp_path / "ckpt.pt", params)
    out = tmp_path / "vae-diffusers"
    r = run_in_process(export.main, ["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out)], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "scaling_factor 1.0 and shift_factor 0.0" in r.stderr and "does not clamp" in r.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["scaling_factor"], config["shift_factor"], config["sample_size"]) == (1.0, 0.0, 32)


def test_cli_user_errors(tmp_path, photos_dir, capfd):
    r = run_in_process(export.main, ["--ckpt", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "o")], capfd)
    assert_one_line_error(r, "missing.pt")
    save_checkpoint(tmp_path / "ckpt.pt", CONFIGS["constant_no_attn_2_levels"])
    r = run_in_process(export.main, ["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "o"),
                                     "--scaling_factor", "0.5", "--dataset_url", photos_dir], capfd)
    assert_one_line_error(r, "not both")


@pytest.mark.parametrize("args, message", [
    (["--format", "onnx"], "invalid choice"),
    (["--scaling_factor", "-1"], "positive"),
    (["--dataset_url", "/no/such/shards/{0..3}.tar"], "not found"),
])
def test_user_errors_in_process(tmp_path, capsys, args, message):
    params = CONFIGS["constant_no_attn_2_levels"]
    save_checkpoint(tmp_path / "ckpt.pt", params)
    assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


# ------------------------------------------------------------------------------------------ latent normalisation
def pipeline_latents(family: str, vae, images: torch.Tensor) -> torch.Tensor:
    """The latents a diffusion model of `family` is trained on, as diffusers' own pipelines make them from images
    (their img2img encode paths, the exact inverse of the decode paths of their text-to-image pipelines:
    SDXL's latents * latents_std / scaling_factor + latents_mean, FLUX's and SD3's latents / scaling_factor +
    shift_factor). Only the VAE is loaded; the other components are not needed by these paths."""
    generator = torch.Generator().manual_seed(0)
    if family == "sdxl":
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline
        pipe = StableDiffusionXLImg2ImgPipeline(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                                tokenizer_2=None, unet=None, scheduler=EulerDiscreteScheduler())
        return pipe.prepare_latents(images, None, len(images), 1, torch.float32, torch.device("cpu"), generator,
                                    add_noise=False)
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxImg2ImgPipeline
    pipe = FluxImg2ImgPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                               tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=None)
    return pipe._encode_vae_image(images, generator)


@pytest.mark.parametrize("latent_norm, family", [("scalar", "flux"), ("per_channel", "sdxl")])
def test_exported_latents_have_unit_variance_in_the_pipeline_family_they_are_for(tmp_path, photos_dir, capsys,
                                                                                  latent_norm, family):
    """Each --latent_norm gives the latents of its pipeline family zero mean and unit variance, through the
    pipelines' own code: scalar (scaling/shift) for FLUX/SD3, per_channel (latents_mean/std) for SDXL. Writing
    both (scaling_factor 1/sigma and latents_std) gave an SDXL pipeline latents of std 1/sigma. A tiny posterior
    variance: the pipelines encode with a posterior sample, the statistics are of the posterior mean."""
    import data as data_lib
    params = AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_attn=False,
                               posterior_var=1e-8)
    save_checkpoint(tmp_path / "ckpt.pt", params)
    out = tmp_path / "hf"
    assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out), "--dataset_url", photos_dir,
                        "--latent_stats_images", "8", "--batch_size", "4", "--latent_norm", latent_norm]) == 0
    stats = json.loads(capsys.readouterr().out)["latent_stats"]
    assert not 0.5 < stats["latent_std"] < 2  # far from unit variance as it comes out of the encoder
    images = torch.cat([data_lib.to_model_input(batch, torch.device("cpu"), channels_last=False)
                        for _, batch in data_lib.iter_eval_batches(photos_dir, 32, 4)])
    vae = load_diffusers(str(out))
    with torch.no_grad():
        z = pipeline_latents(family, vae, images).double()
    if latent_norm == "per_channel":
        assert z.mean(dim=(0, 2, 3)).abs().max() < 1e-3
        assert z.std(dim=(0, 2, 3), unbiased=False).tolist() == pytest.approx([1.0] * 4, abs=1e-3)
        assert (vae.config.scaling_factor, vae.config.shift_factor) == (1.0, 0.0)
    else:
        assert abs(z.mean().item()) < 1e-3 and z.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
        assert vae.config.latents_mean is None and vae.config.latents_std is None


def test_each_pipeline_family_the_export_names_reads_its_config_and_the_others_do_not(tmp_path, photos_dir,
                                                                                      capsys):
    """Issue 23 item 6, each claim of export.pipelines_served through that family's own code: a 16-channel
    per_channel config fails in SDXL's path (it reads 4 values) and is ignored by FLUX's; a scalar config with a
    shift is applied by FLUX's path and not by SDXL's scale-only one (SD 1.x/2.x's rule: latents * scaling_factor);
    and GLM-Image's pipeline reads latent_channels values."""
    import inspect

    import data as data_lib
    from diffusers import GlmImagePipeline
    images = torch.cat([data_lib.to_model_input(batch, torch.device("cpu"), channels_last=False)
                        for _, batch in data_lib.iter_eval_batches(photos_dir, 32, 4)])
    params = AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16, use_attn=False,
                               posterior_var=1e-8)
    save_checkpoint(tmp_path / "ckpt.pt", params)
    common = ["--ckpt", str(tmp_path / "ckpt.pt"), "--dataset_url", photos_dir, "--latent_stats_images", "8",
              "--batch_size", "4"]
    assert export.main([*common, "--out", str(tmp_path / "pc"), "--latent_norm", "per_channel"]) == 0
    served = json.loads(capsys.readouterr().out)["serves"]
    assert "GLM-Image" in served and "NOT SDXL-family pipelines" in served
    vae = load_diffusers(str(tmp_path / "pc"))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"shape '\[1, 4, 1, 1\]' is invalid"):
        pipeline_latents("sdxl", vae, images)
    with torch.no_grad():
        flux = pipeline_latents("flux", vae, images).double()
    assert flux.std(dim=(0, 2, 3), unbiased=False).sub(1).abs().max() > 0.1  # the statistics are not applied
    glm = inspect.getsource(GlmImagePipeline.__call__)
    assert ".view(1, self.vae.config.latent_channels, 1, 1)" in glm and "latents * latents_std + latents_mean" in glm

    assert export.main([*common, "--out", str(tmp_path / "sc")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shift_factor"] != 0 and "ignore shift_factor" in summary["serves"]
    vae = load_diffusers(str(tmp_path / "sc"))
    with torch.no_grad():
        flux, scale_only = (pipeline_latents(f, vae, images).double() for f in ("flux", "sdxl"))
    assert abs(flux.mean().item()) < 1e-3  # (z - shift) * scale: zero mean
    assert scale_only.mean().item() == pytest.approx(summary["shift_factor"] * summary["scaling_factor"], rel=1e-3)


def test_per_channel_normalisation_needs_the_statistics_and_a_config(tmp_path, capsys, photos_dir):
    save_checkpoint(tmp_path / "ckpt.pt", CONFIGS["constant_no_attn_2_levels"])
    for extra, message in ((["--latent_norm", "per_channel"], "--latent_norm per_channel needs --dataset_url"),
                           (["--latent_norm", "per_channel", "--dataset_url", photos_dir, "--format", "single_file"],
                            "--format diffusers or safetensors")):
        assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err


def test_a_diffusers_export_starts_from_its_source_config(tmp_path):
    """Issue 31 item 4 for AutoencoderKL: an export of a run from a diffusers folder keeps what training does not
    change (sample_size, which diffusers' tiling reads; force_upcast; options this trainer does not write) and
    writes what it may change (the factors, the architecture) as the model has them."""
    params = CONFIGS["learned_attn_3_levels"]
    vae = make_vae(params)
    source_config = {"_class_name": "AutoencoderKL", "sample_size": 512, "force_upcast": False,
                     "scaling_factor": 0.5, "shift_factor": 0.1, "norm_num_groups": 16, "block_out_channels": [1]}
    ldm_layouts.export_diffusers(vae, str(tmp_path / "out"), 32, scaling_factor=0.25, shift_factor=0.0,
                            source_config=source_config)
    with open(tmp_path / "out" / "config.json") as f:
        written = json.load(f)
    assert (written["sample_size"], written["force_upcast"]) == (512, False)
    assert (written["scaling_factor"], written["shift_factor"]) == (0.25, 0.0)
    assert written["norm_num_groups"] == params.norm_groups and written["block_out_channels"] == [32, 32, 64]
    ldm_layouts.export_diffusers(vae, str(tmp_path / "plain"), 32)  # no source: what this trainer writes
    with open(tmp_path / "plain" / "config.json") as f:
        assert json.load(f)["sample_size"] == 32
