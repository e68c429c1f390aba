"""evaluate.py: the metric math against direct computations, the one-pass evaluation, latent statistics,
tiled reconstruction, and the real command (plain python and torchrun on gloo)."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from conftest import TINY, cli_env, run_cli, run_in_process

import data as data_lib
import evaluate as ev
from ae import AutoEncoder, AutoEncoderParams

TINY_PARAMS = dict(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, use_attn=False)


# the CLI tests (and the session fixture's training run) take seconds to a minute: a hang fails one test
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def run_dir(shard_url, tmp_path_factory) -> str:
    """A real 2-step training run of the tiny model (with EMA), in this process: the commands under test read its
    files."""
    import vae_trainer
    out = tmp_path_factory.mktemp("eval_runs")
    threads = torch.get_num_threads()
    try:  # (TINY's --num_threads 1 is set for the whole process: given back after)
        assert vae_trainer.main(["--dataset_url", shard_url, "--output_dir", str(out), "--run_name", "t",
                                 "--max_steps", "2", "--save_every_n_steps", "2", "--log_every_n_steps", "1",
                                 *TINY]) == 0
    finally:
        torch.set_num_threads(threads)
    return str(out / "t")


def parse_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, stdout  # one JSON object, nothing else on stdout
    return json.loads(lines[0])


def assert_one_line_error(r) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------
# metric math
# --------------------------------------------------------------------------------------------
def test_psnr_per_image_matches_formula():
    torch.manual_seed(0)
    target = torch.rand(3, 3, 16, 20)
    recon = (target + 0.05 * torch.randn_like(target)).clamp(0, 1)
    got = ev.psnr_per_image(recon, target)
    for i in range(3):
        mse = np.mean((recon[i].double().numpy() - target[i].double().numpy()) ** 2)
        assert got[i].item() == pytest.approx(10 * math.log10(1.0 / mse), abs=1e-10)
    assert ev.psnr_per_image(target, target).tolist() == [100.0] * 3  # perfect: capped, finite


def test_ssim_per_image_matches_skimage():
    """Reference: skimage with Wang et al.'s settings. Tolerance 1e-10 (both float64, same definition)."""
    from skimage.metrics import structural_similarity
    torch.manual_seed(0)
    target = torch.rand(3, 3, 40, 33, dtype=torch.float64)
    recon = (target + 0.1 * torch.randn_like(target)).clamp(0, 1)
    got = ev.ssim_per_image(recon, target)
    for i in range(3):
        ref = structural_similarity(target[i].permute(1, 2, 0).numpy(), recon[i].permute(1, 2, 0).numpy(),
                                    gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1,
                                    channel_axis=2)
        assert got[i].item() == pytest.approx(ref, abs=1e-10)
    assert torch.allclose(ev.ssim_per_image(target, target), torch.ones(3, dtype=torch.float64))


def test_frechet_distance_closed_forms():
    d = 16
    rng = np.random.default_rng(0)
    mu = rng.normal(size=d)
    # N(0, I) vs N(mu, s^2 I): |mu|^2 + d (1 - s)^2
    for s in (0.5, 1.0, 3.0):
        got = ev.frechet_distance(np.zeros(d), np.eye(d), mu, s * s * np.eye(d))
        assert got == pytest.approx(mu @ mu + d * (1 - s) ** 2, rel=1e-12)
    # commuting (diagonal) covariances: sum (sqrt(a) - sqrt(b))^2
    a, b = rng.uniform(0.1, 4, d), rng.uniform(0.1, 4, d)
    got = ev.frechet_distance(mu, np.diag(a), mu, np.diag(b))
    assert got == pytest.approx(np.sum((np.sqrt(a) - np.sqrt(b)) ** 2), rel=1e-10)


def test_frechet_distance_matches_scipy_sqrtm():
    """The textbook computation: tr(C1 + C2 - 2 sqrtm(C1 C2)) with scipy, real part. Tolerance 1e-8 relative."""
    from scipy import linalg
    rng = np.random.default_rng(1)
    d = 64
    x1, x2 = rng.normal(size=(500, d)), rng.normal(size=(500, d)) @ rng.normal(size=(d, d)) * 0.3 + 0.2
    mu1, mu2 = x1.mean(0), x2.mean(0)
    c1, c2 = np.cov(x1, rowvar=False), np.cov(x2, rowvar=False)
    covmean = linalg.sqrtm(c1 @ c2).real
    ref = np.sum((mu1 - mu2) ** 2) + np.trace(c1) + np.trace(c2) - 2 * np.trace(covmean)
    assert ev.frechet_distance(mu1, c1, mu2, c2) == pytest.approx(ref, rel=1e-8)


def test_feature_stats_match_numpy_and_split_exactly():
    rng = np.random.default_rng(2)
    feats = torch.from_numpy(rng.normal(size=(37, 48)).astype(np.float32)) * 3 + 1
    whole = ev.FeatureStats(48)
    whole.update(feats)
    mu, cov = whole.mean_cov()
    ref = feats.double().numpy()
    np.testing.assert_allclose(mu, ref.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(cov, np.cov(ref, rowvar=False), rtol=0, atol=1e-11)
    # two "ranks" with interleaved images, summed as all_reduce does
    parts = [ev.FeatureStats(48), ev.FeatureStats(48)]
    for i in range(0, 37, 5):
        parts[(i // 5) % 2].update(feats[i:i + 5])
    total = ev.FeatureStats(48)
    for name in ("count", "sum", "outer"):
        setattr(total, name, getattr(parts[0], name) + getattr(parts[1], name))
    mu2, cov2 = total.mean_cov()
    np.testing.assert_allclose(mu2, mu, rtol=0, atol=1e-12)
    np.testing.assert_allclose(cov2, cov, rtol=0, atol=1e-11)


def test_fid_of_identical_features_is_zero():
    """Also with fewer images than dimensions (rank-deficient covariance, the small-test case). Tolerance:
    1e-9 relative to tr(C), i.e. float64 rounding."""
    rng = np.random.default_rng(3)
    for n, d in ((400, 32), (20, 256)):
        stats = ev.FeatureStats(d)
        stats.update(torch.from_numpy(rng.normal(size=(n, d))).abs())
        mu, cov = stats.mean_cov()
        assert ev.frechet_distance(mu, cov, mu, cov) <= 1e-9 * np.trace(cov)


# --------------------------------------------------------------------------------------------
# evaluation and latent statistics in-process
# --------------------------------------------------------------------------------------------
class MeanAbsError(nn.Module):
    """A stand-in for LPIPS with its interface (B, 1, 1, 1); the real one runs in the CLI tests."""

    def forward(self, a, b):
        return (a - b).abs().mean(dim=(1, 2, 3), keepdim=True)


@pytest.mark.process
@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
def test_evaluate_model_matches_direct_computation(run_dir, shard_url):
    vae, info = ev.load_model(run_dir)
    assert info["step"] == 2 and info["resolution"] == 64
    lpips_model = MeanAbsError()
    out = ev.evaluate_model(vae, shard_url, 64, batch_size=2, device=torch.device("cpu"), max_images=5,
                            lpips_model=lpips_model)
    assert out["n_images"] == 5 and out["rfid"] is None and "rfid_missing" in out
    # the same images in one batch, metrics by hand
    _, images = next(data_lib.iter_eval_batches(shard_url, 64, 5, max_images=5))
    x = data_lib.to_model_input(images, torch.device("cpu"), channels_last=False)
    with torch.no_grad():
        recon = vae.decode(vae.encode(x)).clamp(-1, 1)
        lpips_ref = lpips_model(recon, x).mean().item()
    mse = ((recon * 0.5 + 0.5).double() - (x * 0.5 + 0.5).double()).square().flatten(1).mean(1)
    assert out["psnr"] == pytest.approx((10 * torch.log10(1 / mse)).mean().item(), abs=1e-4)
    assert out["lpips"] == pytest.approx(lpips_ref, abs=1e-5)
    assert 0 < out["ssim"] < 1
    grid = out["grid"]
    assert grid.dtype == torch.uint8 and grid.shape == (3, 2 + 2 * 66, 2 + 5 * 66)  # inputs over reconstructions


def test_latent_stats_predictable_model(photos_dir):
    """An encoder whose output is its conv_out bias: the latents are known constants per channel."""
    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(**TINY_PARAMS))
    bias = torch.tensor([0.5, -1.0, 2.0, 0.25])
    with torch.no_grad():
        vae.encoder.conv_out.weight.zero_()
        vae.encoder.conv_out.bias.copy_(bias)
    stats = ev.latent_stats(vae, photos_dir, 32, batch_size=3, device=torch.device("cpu"), max_images=5)
    assert stats["n_images"] == 5
    assert stats["shift_factor"] == pytest.approx(bias.mean().item(), abs=1e-6)
    population_std = bias.double().std(unbiased=False).item()
    assert stats["scaling_factor"] == pytest.approx(1 / population_std, rel=1e-6)
    np.testing.assert_allclose(stats["channel_mean"], bias.tolist(), atol=1e-6)
    np.testing.assert_allclose(stats["channel_std"], [0.0] * 4, atol=1e-6)


def test_latent_stats_match_numpy(photos_dir):
    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(**TINY_PARAMS)).eval()
    stats = ev.latent_stats(vae, photos_dir, 32, batch_size=2, device=torch.device("cpu"), max_images=5)
    _, images = next(data_lib.iter_eval_batches(photos_dir, 32, 5, max_images=5))
    with torch.no_grad():
        z = vae.encode(data_lib.to_model_input(images, torch.device("cpu"), channels_last=False)).double().numpy()
    assert stats["shift_factor"] == pytest.approx(z.mean(), abs=1e-6)
    assert stats["latent_std"] == pytest.approx(z.std(), rel=1e-5)
    assert stats["scaling_factor"] == pytest.approx(1 / z.std(), rel=1e-5)
    np.testing.assert_allclose(stats["channel_mean"], z.mean(axis=(0, 2, 3)), atol=1e-6)
    np.testing.assert_allclose(stats["channel_std"], z.std(axis=(0, 2, 3)), rtol=1e-5)


# --------------------------------------------------------------------------------------------
# tiling
# --------------------------------------------------------------------------------------------
def test_tile_starts_cover_and_overlap():
    assert ev.tile_starts(10, 16, 4) == [0]
    for size, tile, overlap in ((40, 16, 4), (30, 16, 4), (64, 40, 16), (17, 16, 4)):
        starts = ev.tile_starts(size, tile, overlap)
        assert starts[0] == 0 and starts[-1] == size - tile
        assert all(b - a <= tile - overlap for a, b in zip(starts, starts[1:]))


def test_tiled_blending_is_exact_for_a_local_op():
    """Nearest upsampling sees no context: any error would be the blend weights' (they must sum to 1)."""
    x = torch.randn(2, 3, 37, 29)
    upsample = lambda t: torch.nn.functional.interpolate(t, scale_factor=4)  # noqa: E731
    tiled = ev.tiled_apply(upsample, x, (37, 29), 12, 4, 1, 4)
    torch.testing.assert_close(tiled, upsample(x), atol=1e-6, rtol=0)


def _decoder_without_groupnorm(vae: AutoEncoder) -> AutoEncoder:
    vae = copy.deepcopy(vae)
    for module in list(vae.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.GroupNorm):
                setattr(module, name, nn.Identity())
    return vae


def test_tiled_decode_exact_away_from_seams_without_groupnorm():
    """Without GroupNorm the decoder is a plain conv net with a finite receptive field: pixels outside the
    overlaps, further from every tile edge than that field, must match the full decode exactly."""
    torch.manual_seed(0)
    vae = _decoder_without_groupnorm(AutoEncoder(AutoEncoderParams(**TINY_PARAMS)).eval())
    z = torch.randn(1, 4, 48, 48)  # 192 px; tiles of 128 px overlapping by 64 px: [0, 128) and [64, 192)
    with torch.no_grad():
        full = vae.decode(z)
        bumped = z.clone()
        bumped[..., 24, 24] += 1.0
        reach = (vae.decode(bumped) - full).abs()[0].amax(0).amax(1).nonzero().flatten()
        radius = int(max(96 - reach.min(), reach.max() - 96))
        tiled = ev.tiled_decode(vae, z, 128, 64)
    assert radius <= 64, radius  # the overlap hides the receptive field of a tile edge
    away = torch.ones(192, dtype=torch.bool)
    away[64:128] = False
    mask = away[:, None] & away[None, :]
    diff = (full - tiled).abs()[0].amax(0)
    assert diff[mask].max().item() < 1e-5


def test_tiled_decode_with_groupnorm_is_close_and_seamless():
    """With GroupNorm each tile normalises with its own statistics, so tiled != full everywhere. On this
    random-init tiny model the mean |difference| is ~8% of the output's std (0.029 vs 0.34); we assert
    < 15%, and that the overlaps are no worse than the rest (the linear blend leaves no seam)."""
    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(**TINY_PARAMS)).eval()
    z = torch.randn(1, 4, 48, 48)
    with torch.no_grad():
        full = vae.decode(z)
        tiled = ev.tiled_decode(vae, z, 128, 64)
        torch.testing.assert_close(ev.tiled_decode(vae, z, 192, 64), full, atol=1e-6, rtol=0)  # one tile: exact
    diff = (full - tiled).abs()[0].mean(0)
    away = torch.ones(192, dtype=torch.bool)
    away[64:128] = False
    mask = away[:, None] & away[None, :]
    print(f"mean |tiled - full|: {diff[mask].mean():.4f} away from seams, {diff[~mask].mean():.4f} in the overlaps, "
          f"output std {full.std():.4f}")
    assert diff[mask].mean() < 0.15 * full.std()
    assert diff[~mask].mean() < 1.5 * diff[mask].mean()


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------
EVAL_ARGS = ["--max_images", "3", "--batch_size", "1", "--vgg16_weights", "random", "--inception_weights", "random"]


@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
@pytest.mark.process
def test_cli_metrics_out_and_torchrun_agree(run_dir, shard_url, tmp_path, capfd):
    """3 images on 2 ranks (2 + 1, the command under torchrun): the same numbers as one process (its main, here). batch_size 1 makes every image's
    forward pass identical in both runs, so only the float64 summation order differs (rel 1e-9)."""
    out = tmp_path / "eval"
    r = run_in_process(ev.main, ["--ckpt", run_dir, "--dataset_url", shard_url, "--out", str(out), *EVAL_ARGS], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    single = parse_json(r.stdout)
    assert single["n_images"] == 3 and single["resolution"] == 64 and single["world_size"] == 1
    for key in ("psnr", "ssim", "lpips", "rfid"):
        assert isinstance(single[key], float) and math.isfinite(single[key]), single
    assert "RANDOMLY INITIALISED" in r.stderr  # random networks are never silent
    assert json.loads((out / "metrics.json").read_text())["psnr"] == single["psnr"]
    with Image.open(out / "reconstructions.png") as grid:
        assert grid.size == (2 + 3 * 66, 2 + 2 * 66)

    r = run_cli("evaluate.py", ["--ckpt", run_dir, "--dataset_url", shard_url, *EVAL_ARGS], nproc=2)
    assert r.returncode == 0, r.stderr[-2000:]
    multi = parse_json(r.stdout)
    assert multi["n_images"] == 3 and multi["world_size"] == 2
    for key in ("psnr", "ssim", "lpips", "rfid"):
        assert multi[key] == pytest.approx(single[key], rel=1e-9), key


@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
@pytest.mark.process
def test_cli_missing_weights_give_null_not_fake(run_dir, shard_url, tmp_path):
    """Default weights that cannot be downloaded (an empty cache, a dead proxy): lpips and rfid are null with
    a reason; PSNR/SSIM are still computed."""
    env = cli_env(TORCH_HOME=tmp_path / "torch_home", HTTPS_PROXY="http://127.0.0.1:9",
                  https_proxy="http://127.0.0.1:9")
    r = run_cli("evaluate.py", ["--ckpt", run_dir, "--dataset_url", shard_url, "--max_images", "2"], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    result = parse_json(r.stdout)
    assert result["rfid"] is None and "Inception" in result["rfid_missing"]
    assert result["lpips"] is None and "VGG16" in result["lpips_missing"]
    assert result["psnr"] > 0 and result["n_images"] == 2


@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
def test_cli_latent_stats_with_ema(run_dir, shard_url, capfd):
    r = run_in_process(ev.main, ["--ckpt", run_dir, "--dataset_url", shard_url, "--latent_stats", "--ema",
                                 "--max_images", "4", "--batch_size", "2"], capfd)
    assert r.returncode == 0, r.stderr[-2000:]
    stats = parse_json(r.stdout)
    assert stats["ema"] is True and stats["n_images"] == 4 and len(stats["channel_std"]) == 4
    vae, _ = ev.load_model(run_dir, ema=True)
    ref = ev.latent_stats(vae, shard_url, 64, batch_size=2, device=torch.device("cpu"), max_images=4)
    assert stats["shift_factor"] == pytest.approx(ref["shift_factor"], abs=1e-6)
    assert stats["scaling_factor"] == pytest.approx(ref["scaling_factor"], rel=1e-5)


@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
def test_cli_reconstructs_any_size(run_dir, photos_dir, tmp_path, capfd):
    """Sizes that are not multiples of the downsample factor (4) come back at their size and name, tiled
    (tile 32 px) or not."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    with Image.open(os.path.join(photos_dir, "astronaut.png")) as im:
        im.convert("RGB").crop((100, 50, 137, 100)).save(src / "a.png")  # 37 x 50
    with Image.open(os.path.join(photos_dir, "camera.png")) as im:
        im.crop((0, 0, 45, 31)).save(src / "sub" / "b.jpg")  # grayscale JPEG, 45 x 31
    for tile in ("0", "32"):
        dst = tmp_path / f"dst{tile}"
        r = run_in_process(ev.main, ["--ckpt", run_dir, "--images", str(src), "--reconstruct_to", str(dst),
                                     "--tile_size", tile, "--tile_overlap", "8"], capfd)
        assert r.returncode == 0, r.stderr[-2000:]
        assert parse_json(r.stdout)["reconstructed"] == 2
        with Image.open(dst / "a.png.png") as a, Image.open(dst / "sub" / "b.jpg.png") as b:
            assert (a.size, a.mode, b.size, b.mode) == ((37, 50), "RGB", (45, 31), "RGB")


@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_cli_reconstructs_under_torchrun_on_two_gpus(run_dir, photos_dir, tmp_path):
    """The reconstructed-image count was all-reduced as a CPU tensor, which NCCL refuses (gloo, as on the
    CPU runs above, takes it). Runs only where 2 GPUs are visible."""
    r = run_cli("evaluate.py", ["--ckpt", run_dir, "--images", photos_dir, "--reconstruct_to", str(tmp_path / "rec")],
                nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert parse_json(r.stdout)["reconstructed"] == len(os.listdir(photos_dir))


def test_reconstructions_keep_the_full_source_name(photos_dir, tmp_path):
    """x.jpg and x.png side by side: each reconstruction lands in its own file, named after its source."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "sub").mkdir(parents=True)
    with Image.open(os.path.join(photos_dir, "astronaut.png")) as im:
        im.convert("RGB").crop((0, 0, 40, 36)).save(src / "x.png")
    with Image.open(os.path.join(photos_dir, "rocket.jpg")) as im:
        im.crop((0, 0, 36, 40)).save(src / "x.jpg")
        im.crop((50, 50, 70, 70)).save(src / "sub" / "x.png")
    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(**TINY_PARAMS)).eval()
    assert ev.reconstruct_folder(vae, str(src), str(dst), torch.device("cpu"), 0, 0) == 3
    written = sorted(os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs)
    assert written == ["sub/x.png.png", "x.jpg.png", "x.png.png"]
    for name in ("x.png", "x.jpg", "sub/x.png"):
        expected = ev.reconstruct(vae, ev.load_rgb_file(str(src / name)), torch.device("cpu"))
        with Image.open(dst / f"{name}.png") as out:
            assert np.array_equal(np.asarray(out), expected), name


@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
def test_cli_user_errors_are_one_line(run_dir, shard_url, tmp_path, capfd):
    r = run_in_process(ev.main, ["--ckpt", str(tmp_path / "nope"), "--dataset_url", shard_url], capfd)
    assert_one_line_error(r)
    assert "nope" in r.stderr
    r = run_in_process(ev.main, ["--ckpt", run_dir, "--dataset_url", str(tmp_path / "missing" / "{0..3}.tar")],
                       capfd)
    assert_one_line_error(r)


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp8"], "invalid choice"),
    (["--resolution", "30"], "multiple of the downsample factor"),
    (["--ema"], "no EMA weights"),
    (["--vgg16_weights", "/no/such/vgg.pth"], "no such file"),
    (["--images", "/no/such/dir", "--reconstruct_to", "/tmp/x"], "not a directory"),
])
@pytest.mark.xdist_group("eval_run_dir")  # shares the run_dir fixture: built once
def test_user_errors_in_process(run_dir, shard_url, tmp_path, capsys, args, message):
    ckpt = os.path.join(run_dir, "checkpoints", "step_00000002.pt")
    if "--ema" in args:  # a checkpoint trained without EMA
        state = torch.load(ckpt, weights_only=True)
        state["training"]["ema"] = None
        ckpt = str(tmp_path / "no_ema.pt")
        torch.save(state, ckpt)
    assert ev.main(["--ckpt", ckpt, "--dataset_url", shard_url, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.process
def test_the_standalone_commands_do_not_import_the_trainer():
    """evaluate, export and probe take their plumbing from common.py and checkpoint.py: none imports vae_trainer
    (which imports evaluate for evaluate_model), at import time or in their commands' functions."""
    code = ("import sys, evaluate, export, probe; assert 'vae_trainer' not in sys.modules\n"
            "import inspect; assert not any('vae_trainer' in inspect.getsource(m) for m in (evaluate, export, probe))")
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True, env=cli_env())
    assert r.returncode == 0, r.stderr[-2000:]
