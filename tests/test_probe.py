"""probe.py, the diffusability probe: its flow matching learns, the CLI compares every VAE given fairly under
2 ranks, resumes exactly after a kill, and refuses latents of other shapes with one line."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import export
import probe
from ae import AutoEncoder, AutoEncoderParams
from common import DistInfo, close_distributed
from conftest import cli_env, run_cli, run_in_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_flow_matching_loss_decreases_on_a_toy_latent_set():
    """Latents drawn from 4 fixed patterns: the tiny transformer's held-out rectified-flow loss falls well
    below its start (2: the velocity noise - x of unit-variance data, predicted as 0)."""
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randn(4, 4, 8, 8, generator=gen)
    data = patterns[torch.randint(4, (256,), generator=gen)]
    torch.manual_seed(0)
    model = probe.DiT(4, 8, 2, **probe.PRESETS["tiny"])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    held_noise, held_t = torch.randn(64, 4, 8, 8, generator=gen), torch.rand(64, generator=gen)

    def heldout():
        with torch.no_grad():
            return probe.flow_matching_loss(model, data[:64], held_noise, held_t).mean().item()
    start = heldout()
    for _ in range(120):
        pick = torch.randint(256, (32,), generator=gen)
        loss = probe.flow_matching_loss(model, data[pick], torch.randn(32, 4, 8, 8, generator=gen),
                                        torch.rand(32, generator=gen)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert start == pytest.approx(2.0, rel=0.15)
    assert heldout() < 0.6 * start


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    """Three tiny export folders: a and b of one latent shape (4 x 16 x 16 at 32 px), c of another (8 channels)."""
    root = tmp_path_factory.mktemp("vaes")
    for name, z, seed in (("a", 4, 0), ("b", 4, 1), ("c", 8, 0)):
        torch.manual_seed(seed)
        vae = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=z, use_attn=False))
        export.export_safetensors(vae, str(root / name), 32)
    return {name: str(root / name) for name in "abc"}


def _args(vaes, names, url, out, steps=6, *extra):
    return [*(a for n in names for a in ("--vae", vaes[n])), "--dataset_url", url, "--test_dataset_url", url,
            "--out", str(out), "--steps", str(steps), "--eval_every", "3", "--save_every", "2", "--batch_size", "4",
            "--patch_size", "4", "--warmup_steps", "1", "--max_test_images", "4", "--inception_weights", "none", *extra]


@pytest.mark.process
@pytest.mark.timeout(90)
def test_two_ranks_table_holds_every_vae_and_is_fair(vaes, shard_url, tmp_path):
    """a, b, a under 2 gloo ranks: one row each; a's two rows are identical (same seed, init, batches and noise
    for every VAE), b's differ; the FID is null with its reason when Inception is off."""
    proc = run_cli("probe.py", _args(vaes, "aba", shard_url, tmp_path), nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = json.loads((tmp_path / "probe.json").read_text())
    assert table["world_size"] == 2 and [r["vae"] for r in table["vaes"]] == [vaes["a"], vaes["b"], vaes["a"]]
    first, other, again = table["vaes"]
    assert [s for s, _ in first["heldout_loss"]] == [0, 3, 6]
    assert first["heldout_loss"] == again["heldout_loss"] and first["heldout_loss"] != other["heldout_loss"]
    assert first["latent_shape"] == [4, 16, 16]
    assert first["fid"] is None and "inception_weights none" in first["fid_missing"]
    lines = proc.stdout.strip().splitlines()[-5:-1]  # the table: a header and one row per VAE, then the FID note
    assert lines[0].startswith("vae") and all(vaes[n] in line for n, line in zip("aba", lines[1:]))


@pytest.mark.process
@pytest.mark.timeout(90)
def test_resume_after_a_kill_is_exact(vaes, shard_url, tmp_path, capfd):
    """The killed run is a process (SIGKILL); the others run probe.main in this process."""
    ref = run_in_process(probe.main, _args(vaes, "a", shard_url, tmp_path / "ref"), capfd)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = run_cli("probe.py", _args(vaes, "a", shard_url, tmp_path / "cut"), env=cli_env(PROBE_KILL_AT="3"))
    assert killed.returncode != 0 and not (tmp_path / "cut" / "probe.json").exists()
    again = run_in_process(probe.main, _args(vaes, "a", shard_url, tmp_path / "cut"), capfd)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed the probe at step 2" in again.stdout
    ref_row, cut_row = (json.loads((tmp_path / d / "probe.json").read_text())["vaes"][0] for d in ("ref", "cut"))
    assert cut_row["heldout_loss"] == ref_row["heldout_loss"]  # bitwise: the same floats
    ref_state, cut_state = (torch.load(*(tmp_path / d).glob("probe_state_*.pt"), weights_only=True)
                            for d in ("ref", "cut"))
    assert all(torch.equal(ref_state["model"][k], cut_state["model"][k]) for k in ref_state["model"])
    # other settings in the same --out: refused, not silently mixed
    other = run_in_process(probe.main, _args(vaes, "a", shard_url, tmp_path / "cut", 8), capfd)
    assert other.returncode == 2 and other.stderr.strip().startswith("error:") and "other settings" in other.stderr


@pytest.mark.timeout(40)
def test_latents_of_other_shapes_are_refused_with_one_line(vaes, shard_url, tmp_path, capfd):
    proc = run_in_process(probe.main, _args(vaes, "ac", shard_url, tmp_path), capfd)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: latents of other shapes cannot be compared in one probe: {vaes['a']} "
                                   f"gives 4x16x16, {vaes['c']} gives 8x16x16 at 32 px")
    assert not (tmp_path / "probe.json").exists()


# --------------------------------------------------------------------------------------------
# Keyed by the VAE's weights (issue 16 item 2)
# --------------------------------------------------------------------------------------------
def _heldout(path):
    return [row["heldout_loss"] for row in json.loads(path.read_text())["vaes"]]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_state_and_latents_belong_to_the_vae_not_its_position_or_path(vaes, shard_url, tmp_path, capsys):
    """b probed after a into the same --out gives b's own numbers; a run folder rewritten with other weights and
    probed again gives the new weights' numbers (no stale latents, no stale result); a's probe killed mid-run is
    not resumed by b."""
    assert probe.main(_args(vaes, "b", shard_url, tmp_path / "b_clean")) == 0
    b_clean = _heldout(tmp_path / "b_clean" / "probe.json")[0]
    assert probe.main(_args(vaes, "a", shard_url, tmp_path / "shared")) == 0
    a_row = _heldout(tmp_path / "shared" / "probe.json")[0]
    assert probe.main(_args(vaes, "b", shard_url, tmp_path / "shared")) == 0
    assert _heldout(tmp_path / "shared" / "probe.json")[0] == b_clean != a_row

    retrained = tmp_path / "run"  # the same path, first a's weights, then b's
    shutil.copytree(vaes["a"], retrained)
    assert probe.main(_args({"r": str(retrained)}, "r", shard_url, tmp_path / "again")) == 0
    shutil.rmtree(retrained)
    shutil.copytree(vaes["b"], retrained)
    assert probe.main(_args({"r": str(retrained)}, "r", shard_url, tmp_path / "again")) == 0
    assert _heldout(tmp_path / "again" / "probe.json")[0] == b_clean

    killed = run_cli("probe.py", _args(vaes, "a", shard_url, tmp_path / "cut"), env=cli_env(PROBE_KILL_AT="3"))
    assert killed.returncode != 0
    capsys.readouterr()
    assert probe.main(_args(vaes, "b", shard_url, tmp_path / "cut")) == 0
    assert "resumed" not in capsys.readouterr().out
    assert _heldout(tmp_path / "cut" / "probe.json")[0] == b_clean


def test_table_gives_the_fid_reason_once_under_it():
    rows = [{"vae": v, "heldout_loss": [[0, 2.0], [3, 1.5]], "fid": None, "fid_missing": "no Inception weights",
             "train_latents_per_s": 10.0} for v in ("a", "b")]
    lines = probe.format_table(rows).splitlines()
    assert len(lines) == 4 and lines[-1] == "* FID null: no Inception weights"
    assert all("no Inception" not in line for line in lines[:-1]) and "null*" in lines[1]


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        probe.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "held-out images (default: 1000)" in out and "(default: tiny)" in out


# --------------------------------------------------------------------------------------------
# Numbers equal across world sizes (the held-out loss's all_reduce) and the in-loop probe
# --------------------------------------------------------------------------------------------
def _tiny_vae():
    torch.manual_seed(0)
    return AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_attn=False)).eval()


def _probe_images():
    return torch.rand(10, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1


def _heldout_and_in_loop(rank, world):
    """(probe.heldout_loss on this rank's strided share of 6 latents, in_loop_probe_loss) under `world` ranks."""
    torch.manual_seed(0)
    model = probe.DiT(4, 8, 2, **probe.PRESETS["tiny"])
    for p in model.parameters():  # a non-trivial prediction: adaLN-Zero starts at 0
        torch.nn.init.normal_(p, std=0.05)
    latents = torch.randn(6, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    lat = {"test": latents[rank::world], "test_index": torch.arange(6)[rank::world]}
    args = argparse.Namespace(batch_size=2, seed=0)
    heldout = probe.heldout_loss(model, lat, args, torch.device("cpu"))
    in_loop = probe.in_loop_probe_loss(_tiny_vae(), _probe_images(), heldout_images=3, steps=3, batch_size=4,
                                       patch_size=4, warmup_steps=1)
    return heldout, in_loop


def _rank_worker(rank, world, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_heldout_and_in_loop(rank, world), f"{out}.{rank}")
    finally:
        close_distributed(DistInfo())  # the probe's DDP may hold the group until the interpreter exits: end it now


@pytest.mark.process
@pytest.mark.timeout(90)
def test_probe_numbers_are_equal_under_one_and_two_ranks(tmp_path):
    one = _heldout_and_in_loop(0, 1)
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2)
    two = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    assert two[0] == two[1]  # every rank reports the same numbers
    assert two[0][0] == pytest.approx(one[0], rel=1e-6)  # the held-out loss over all 6 latents, not rank 0's 3
    assert two[0][1] == pytest.approx(one[1], rel=1e-6)  # equal here; 1e-6 leaves room for summation order


def test_in_loop_probe_is_repeatable_and_leaves_the_callers_rng_alone():
    vae, images = _tiny_vae(), _probe_images()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = probe.in_loop_probe_loss(vae, images, heldout_images=3, steps=3, batch_size=4, patch_size=4)
    assert torch.equal(torch.get_rng_state(), before)
    second = probe.in_loop_probe_loss(vae, images, heldout_images=3, steps=3, batch_size=4, patch_size=4)
    assert first == second and math.isfinite(first) and first > 0
    other = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_attn=False))
    assert probe.in_loop_probe_loss(other.eval(), images, heldout_images=3, steps=3, batch_size=4,
                                    patch_size=4) != first
