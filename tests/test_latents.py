"""latents.py: the spectrum diagnostics on constructed signals, per-channel statistics exact across 2 ranks, the
regularisers (change the step only when on, exactly off at p=0, resume bitwise, 2 DDP ranks) and the
statistics that travel with an export."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import data
import latents
import vae_trainer
from conftest import TINY, cut_after, free_port, run_cli, run_in_process
import common
import config
import run_setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------ diagnostics
def checkerboard(n: int) -> torch.Tensor:
    return ((torch.arange(n)[:, None] + torch.arange(n)[None, :]) % 2).float() * 2 - 1


def test_spectrum_and_hf_fraction_of_constructed_signals():
    n = 32
    constant = torch.full((2, 4, n, n), 3.0)
    stats = latents.SpectrumStats(n, n)
    stats.update(constant)
    assert stats.hf_fraction() == 0.0
    assert stats.spectrum()[0] == pytest.approx(1.0) and sum(stats.spectrum()[1:]) == pytest.approx(0.0, abs=1e-12)

    board = checkerboard(n).expand(2, 4, n, n)  # the energy at the Nyquist corner (radius sqrt 2: the last ring)
    stats = latents.SpectrumStats(n, n)
    stats.update(board)
    assert stats.hf_fraction() == pytest.approx(1.0, abs=1e-3)
    assert stats.spectrum()[-1] > 0.9 and len(stats.spectrum()) == n + 1

    # smooth: nearly all energy in the lowest rings. Mirrored before the FFT: periodically, the ramp's jump
    # between opposite edges would put 5% of its energy above half Nyquist
    ramp = (torch.linspace(0, 1, n)[None, :] + torch.linspace(0, 1, n)[:, None]).expand(1, 1, n, n)
    assert latents.hf_fraction(ramp) < 1e-3
    spectrum = latents.SpectrumStats(n, n)
    spectrum.update(ramp)
    assert spectrum.spectrum()[1] > 10 * spectrum.spectrum()[n // 4]

    noise = torch.randn(8, 4, n, n, generator=torch.Generator().manual_seed(0))
    # white noise: the fraction is the share of frequencies beyond half Nyquist (1 - pi/16 of the square)
    assert latents.hf_fraction(noise) == pytest.approx(1 - torch.pi / 16, abs=0.03)
    # mixing: a smooth signal plus a little checkerboard lands in between, in proportion to the energies
    mixed = latents.hf_fraction(ramp - ramp.mean() + 0.1 * checkerboard(n))
    assert 0.01 < mixed < 0.5


def _channel_stats_worker(rank, world, port, z, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        channels, spectrum = latents.ChannelStats(z.shape[1]), latents.SpectrumStats(*z.shape[-2:])
        for i in range(rank, len(z), world):  # uneven split: rank 0 gets 3 images, rank 1 gets 2
            channels.update(z[i:i + 1])
            spectrum.update(z[i:i + 1])
        channels.all_reduce()
        spectrum.all_reduce()
        out[rank] = {**channels.result(), "hf": spectrum.hf_fraction(), "spectrum": spectrum.spectrum()}
    finally:
        dist.destroy_process_group()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_channel_statistics_are_exact_under_two_ranks():
    """float64 sums all-reduced: 2 ranks over an uneven split give what one process gives over all images,
    which is numpy's float64 mean/std per channel."""
    z = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * torch.tensor([1., 5., .1])[:, None, None] \
        + torch.tensor([0.5, -2., 7.])[:, None, None]
    single = latents.ChannelStats(3)
    single.update(z)
    ref = single.result()
    expected = z.double()
    assert ref["channel_mean"] == pytest.approx(expected.mean(dim=(0, 2, 3)).tolist(), rel=1e-12)
    assert ref["channel_std"] == pytest.approx(expected.std(dim=(0, 2, 3), unbiased=False).tolist(), rel=1e-10)
    assert ref["channel_std_spread"] == pytest.approx(max(ref["channel_std"]) / min(ref["channel_std"]))
    out = mp.Manager().dict()
    mp.spawn(_channel_stats_worker, args=(2, free_port(), z, out), nprocs=2)
    spec = latents.SpectrumStats(8, 8)
    spec.update(z)
    for rank in (0, 1):
        assert out[rank]["channel_mean"] == pytest.approx(ref["channel_mean"], rel=1e-12, abs=1e-15)
        assert out[rank]["channel_std"] == pytest.approx(ref["channel_std"], rel=1e-12)
        assert out[rank]["hf"] == pytest.approx(spec.hf_fraction(), rel=1e-12)
        assert out[rank]["spectrum"] == pytest.approx(spec.spectrum(), rel=1e-12)


# ------------------------------------------------------------------------------------------ regularisers
@pytest.fixture(scope="module")
def batches(shard_url):
    loader = data.TrainLoader(shard_url, 64, 2, seed=0, rank=0, world_size=1, num_workers=0, shuffle_buffer=8)
    out = [next(loader) for _ in range(3)]
    loader.close()
    return out


class NoRegularisers:
    """The step as it was before latents.py: the trainer's call site returns the batch untouched."""

    def draw(self, x, step, micro):
        return x, None

    def draw_added(self, x, step, micro):
        return None


def weights_after_steps(shard_url, tmp_path, batches, steps, *flags) -> dict:
    """The VAE's weights after `steps` real train_steps from the same init on the same photos; no flags: the
    step without any regulariser code (NoRegularisers)."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                    "--num_workers", "0", "--perceptual_weight", "0", "--ema_decay", "0",
                                    "--max_steps", "10", *flags])
    cfg.validate()
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    trainer.loader.close()
    trainer.loader = data.FixedBatches(batches)
    if not flags:
        trainer.regularisers = NoRegularisers()
    for _ in range(steps):
        trainer.train_step()
        trainer.step += 1
    state = {k: v.clone() for k, v in trainer.vae.state_dict().items()}
    trainer.close()
    return state


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag,extra", [("--scale_equivariance_prob", ["--scale_equivariance_rotate"]),
                                        ("--latent_noise_prob", ["--latent_noise_max", "1.0"])])
def test_regulariser_changes_the_step_only_when_on_and_is_exactly_off_at_p0(shard_url, tmp_path, batches, flag,
                                                                             extra):
    base = weights_after_steps(shard_url, tmp_path, batches, 1)
    assert same(base, weights_after_steps(shard_url, tmp_path, batches, 1, flag, "0", *extra))  # bitwise off
    assert not same(base, weights_after_steps(shard_url, tmp_path, batches, 1, flag, "1", *extra))
    if flag == "--scale_equivariance_prob":
        # at p = 0.5 a step the draw leaves alone is bitwise the plain step; one it picks is not
        regs = latents.LatentRegularisers(42, equivariance_prob=0.5, equivariance_sizes=[8])
        draws = [regs.equivariance(step) for step in range(20)]
        off, on = draws.index(None), next(i for i, d in enumerate(draws) if d is not None)
        assert regs.equivariance(off) is None  # a pure function of (seed, step): what every rank draws
        for step, expect_same in ((off, True), (on, False)):
            plain = _one_step_at(shard_url, tmp_path, batches[0], step)
            trainer_state = _one_step_at(shard_url, tmp_path, batches[0], step, flag, "0.5", *extra)
            assert same(plain, trainer_state) == expect_same, (step, draws[step])


def _one_step_at(shard_url, tmp_path, batch, step, *flags) -> dict:
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                    "--num_workers", "0", "--perceptual_weight", "0", "--ema_decay", "0",
                                    "--max_steps", "10", *flags])
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    trainer.loader.close()
    trainer.loader = data.FixedBatches([batch])
    trainer.step = step
    if not flags:
        trainer.regularisers = NoRegularisers()
    trainer.train_step()
    state = {k: v.clone() for k, v in trainer.vae.state_dict().items()}
    trainer.close()
    return state


@pytest.mark.parametrize("form", ["replace", "add"])
def test_equivariance_transform_matches_the_image_side(form):
    """The decoder input is the latent downsampled and rotated like the target image, in both forms (the added
    term's small image included: issue 23, its rotation/flip dropped from the image side left this file green):
    for a 'VAE' that is area pooling by f, transform(encode(x)) == encode(transform(x)) (exactly so for whole
    factors)."""
    regs = latents.LatentRegularisers(0, equivariance_prob=1.0, equivariance_sizes=[2, 4],
                                      equivariance_rotate=True, downsample_factor=4, equivariance_form=form)
    x = torch.randn(2, 3, 32, 32)
    seen = set()
    for step in range(12):
        if form == "replace":
            target, to_decoder = regs.draw(x, step, 0)
        else:
            assert regs.draw(x, step, 0) == (x, None)  # the full-resolution pass is untouched
            target, to_decoder = regs.draw_added(x, step, 0)
        z = to_decoder(torch.nn.functional.avg_pool2d(x, 4))
        torch.testing.assert_close(z, torch.nn.functional.avg_pool2d(target, 4))
        seen.add(regs.equivariance(step))
    assert {s[0] for s in seen} == {2, 4} and len({s[1:] for s in seen}) > 2


class HalfSizeInPlace(NoRegularisers):
    """EQ-VAE's form written out by hand: the latent area-downsampled x0.5 is decoded in place of the full one, and
    every loss compares with the image downsampled the same way; nothing else."""

    def draw(self, x, step, micro):
        half = x.shape[-1] // 2
        return (torch.nn.functional.interpolate(x, size=(half, half), mode="area"),
                lambda z: torch.nn.functional.interpolate(z, size=(z.shape[-1] // 2,) * 2, mode="area"))


@pytest.mark.process
@pytest.mark.timeout(60)
def test_the_replace_form_is_the_latent_decoded_in_place_and_is_the_default(shard_url, tmp_path, batches):
    """--scale_equivariance_form replace (and the default) is bitwise the step of HalfSizeInPlace: no added term,
    no full-resolution loss on the micro-batches it picks."""
    def one_step(*flags, regularisers=None):
        cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                        "--num_workers", "0", "--ema_decay", "0", "--max_steps", "10", *flags])
        trainer = vae_trainer.Trainer(cfg, common.DistInfo())
        trainer.loader.close()
        trainer.regularisers = regularisers or trainer.regularisers
        trainer.train_step(batches[:1])
        state = {k: v.clone() for k, v in trainer.vae.state_dict().items()}
        trainer.close()
        return state

    by_hand = one_step(regularisers=HalfSizeInPlace())
    assert same(by_hand, one_step("--scale_equivariance_prob", "1"))
    assert same(by_hand, one_step("--scale_equivariance_prob", "1", "--scale_equivariance_form", "replace"))
    assert not same(by_hand, one_step("--scale_equivariance_prob", "1", "--scale_equivariance_form", "add"))


def test_the_added_scale_equivariance_term_on_a_constructed_case():
    """--scale_equivariance_form add: the extra decode's pixel losses against the downsampled image, weighted by
    alpha x --mse_weight, added to the full-resolution terms, which stay as they are. A reconstruction off by a
    constant c has pooled and low-pass MSE c^2; LPIPS of an image against itself is 0."""
    from conftest import objective_of
    from objective import MicroBatch
    alpha, c = 0.5, 0.1
    args = ["--dataset_url", "x", *TINY, "--scale_equivariance_prob", "1", "--scale_equivariance_form", "add",
            "--scale_equivariance_weight", str(alpha), "--loss_balance", "none"]
    torch.manual_seed(0)
    x, recon = torch.rand(2, 3, 64, 64) * 2 - 1, torch.rand(2, 3, 64, 64) * 2 - 1
    small_x = torch.nn.functional.interpolate(x, size=(32, 32), mode="area")
    mean = torch.randn(2, 4, 16, 16)
    cfg = run_setup.parse_config(args + ["--perceptual_weight", "0"])
    objective = objective_of(cfg, None, with_lpips=False)
    _, plain = objective(MicroBatch(x, recon, mean, None, 0))
    _, logs = objective(MicroBatch(x, recon, mean, None, 0, added=(small_x, small_x + c)))
    assert logs["loss/se_pooled_mse"].item() == pytest.approx(c ** 2, rel=1e-5)
    assert logs["loss/se_lowpass_mse"].item() == pytest.approx(c ** 2, rel=1e-5)
    for name in ("loss/pooled_mse", "loss/lowpass_mse", "loss/kl"):  # the full-resolution terms, unchanged
        assert torch.equal(logs[name], plain[name]), name
    added = alpha * cfg.loss.mse_weight * (cfg.loss.pooled_mse_weight + cfg.loss.lowpass_mse_weight) * c ** 2
    assert (logs["loss/total"] - plain["loss/total"]).item() == pytest.approx(added, rel=1e-4)

    cfg = run_setup.parse_config(args + ["--perceptual_weight", "1"])
    objective = objective_of(cfg, None)  # random LPIPS: 0 for identical images whatever its weights
    _, same_image = objective(MicroBatch(x, recon, mean, None, 0, added=(small_x, small_x.clone())))
    _, off = objective(MicroBatch(x, recon, mean, None, 0, added=(small_x, small_x + c)))
    assert same_image["loss/se_perceptual"].item() == 0 and off["loss/se_perceptual"].item() > 0
    assert torch.equal(same_image["loss/perceptual"], off["loss/perceptual"])


@pytest.mark.timeout(60)
def test_the_added_form_keeps_the_full_resolution_losses_on_the_micro_batch_it_picks(shard_url, tmp_path, batches):
    """In a real train_step with --scale_equivariance_form add at probability 1, the objective gets the
    full-resolution image and reconstruction and, beside them, the downsampled image and the decode of the
    downsampled latent; the step's logs hold both the full-resolution and the added terms."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                    "--num_workers", "0", "--ema_decay", "0", "--max_steps", "10",
                                    "--scale_equivariance_prob", "1", "--scale_equivariance_form", "add"])
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    trainer.loader.close()
    seen, forward = [], trainer.objective.forward

    def spy(batch):
        loss, logs = forward(batch)
        seen.append((batch.x.shape, batch.recon.shape, batch.added[0].shape, batch.added[1].shape, set(logs)))
        return loss, logs

    trainer.objective.forward = spy
    trainer.train_step(batches[:1])
    trainer.close()
    [(x_shape, recon_shape, small_x_shape, small_recon_shape, logged)] = seen
    assert x_shape == recon_shape == (2, 3, 64, 64) and small_x_shape == small_recon_shape == (2, 3, 32, 32)
    assert {"loss/perceptual", "loss/pooled_mse", "loss/lowpass_mse", "loss/se_perceptual", "loss/se_pooled_mse",
            "loss/se_lowpass_mse"} <= logged, logged


def test_scale_equivariance_flags_are_checked():
    args = ["--dataset_url", "x", *TINY, "--scale_equivariance_prob", "1", "--mse_pool_factor", "64"]
    with pytest.raises(config.ConfigError, match="no smaller size"):
        run_setup.check_config(run_setup.parse_config(args))  # the sizes are latents.py's rule, checked at setup
    with pytest.raises(config.ConfigError, match="latent_noise_prob must be in"):
        run_setup.parse_config(["--dataset_url", "x", "--latent_noise_prob", "2"]).validate()


REGS = ["--scale_equivariance_prob", "0.5", "--scale_equivariance_mode", "random", "--scale_equivariance_rotate",
        "--latent_noise_prob", "0.5", "--perceptual_weight", "0"]


def _args(url, out, run, steps, save, *extra):
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", str(save), "--log_every_n_steps", "2", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "20", *TINY, *REGS, *extra]


@pytest.mark.process
@pytest.mark.timeout(90)
def test_resume_with_regularisers_on_is_bitwise(shard_url, tmp_path, capfd, one_torch_thread):
    """The uninterrupted run's step-3 checkpoint continued (conftest.cut_after; in-process: the runs' own main)."""
    ref = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "ref", 6, 3), capfd)
    assert ref.returncode == 0, ref.stderr[-2000:]
    cut_after(tmp_path / "ref", tmp_path / "cut", 3)
    again = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "cut", 6, 6), capfd)
    assert again.returncode == 0 and "at step 3" in again.stdout, again.stderr[-2000:]
    a, b = (torch.load(tmp_path / run / "checkpoints" / "step_00000006.pt", weights_only=True) for run in ("ref", "cut"))
    for name in a["training"]["vae"]:
        assert torch.equal(a["training"]["vae"][name], b["training"]["vae"][name]), name
    for pid, state in a["training"]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["training"]["optimizer"]["state"][pid][key]), (pid, key)


@pytest.mark.process
@pytest.mark.timeout(90)
def test_two_ranks_with_regularisers_accumulation_checkpointing_bf16_and_eval_diagnostics(shard_url, tmp_path):
    """DDP with both regularisers, --grad_accum 2, checkpointing and bf16: every rank runs the same collectives
    (no hang, no unused parameter), the replicas stay identical; evaluation logs the latent diagnostics."""
    args = _args(shard_url, tmp_path, "ddp", 4, 4, "--grad_accum", "2", "--grad_checkpointing", "decoder",
                 "--precision", "bf16", "--test_dataset_url", shard_url, "--evaluate_every_n_steps", "4",
                 "--eval_max_images", "4")
    proc = run_cli("vae_trainer.py", args, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(weights identical on all ranks)" in proc.stdout
    assert "latents step 4 | high-frequency energy" in proc.stdout
    records = [json.loads(line) for line in open(tmp_path / "ddp" / "metrics.jsonl")]
    final_eval = [r for r in records if "eval/latent_hf_fraction" in r][-1]
    assert final_eval["step"] == 4 and 0 <= final_eval["eval/latent_hf_fraction"] <= 1
    assert len(final_eval["eval/latent_channel_std"]) == 4 and final_eval["eval/latent_channel_std_spread"] >= 1
    assert len(final_eval["eval/latent_spectrum"]) == len(final_eval["eval/image_spectrum"]) == 16 + 1


def test_latent_noise_passes_the_gradient_through_unchanged():
    """The noise level is relative to the batch's latent std, detached: the decoder's gradient reaches the
    encoder as it is (d out / d z = identity). Through the std, every step would also push the latent scale
    down (smaller latents, less noise), a shortcut around the augmentation."""
    z = (3 * torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))).requires_grad_()
    upstream = torch.randn(z.shape, generator=torch.Generator().manual_seed(1))  # any gradient from the decoder
    noisy = latents.add_latent_noise(z, prob=1.0, max_level=0.5, gen=torch.Generator().manual_seed(2))
    assert (noisy - z).abs().mean() > 0.1  # the noise is there
    noisy.backward(upstream)
    assert torch.equal(z.grad, upstream)


# ------------------------------------------------------------------------------------------ export
@pytest.mark.process
@pytest.mark.timeout(60)
def test_export_writes_per_channel_latents_mean_and_std(tmp_path, photos_dir, capfd, one_torch_thread):
    """(export.py's main in this process: test_export runs the command.)"""
    import evaluate as ev
    from diffusers import AutoencoderKL
    import export
    from ae import AutoEncoder, AutoEncoderParams
    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_attn=False))
    export.export_safetensors(vae, str(tmp_path / "st"), 32)
    r = run_in_process(export.main, ["--ckpt", str(tmp_path / "st"), "--out", str(tmp_path / "hf"), "--dataset_url",
                                     photos_dir, "--latent_stats_images", "4", "--batch_size", "2",
                                     "--latent_norm", "per_channel"], capfd)
    assert r.returncode == 0, r.stderr
    ref = ev.latent_stats(vae, photos_dir, 32, batch_size=2, device=torch.device("cpu"), max_images=4)
    model = AutoencoderKL.from_pretrained(str(tmp_path / "hf"))
    assert list(model.config.latents_mean) == pytest.approx(ref["channel_mean"], rel=1e-9)
    assert list(model.config.latents_std) == pytest.approx(ref["channel_std"], rel=1e-9)
    r = run_in_process(export.main, ["--ckpt", str(tmp_path / "st"), "--out", str(tmp_path / "st2"), "--format",
                                     "safetensors", "--dataset_url", photos_dir, "--latent_stats_images", "4",
                                     "--latent_norm", "per_channel"], capfd)
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "st2" / "config.json").read_text())
    assert config["latents_std"] == pytest.approx(ref["channel_std"], rel=1e-9)
