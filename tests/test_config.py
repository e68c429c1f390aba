"""config.py on its own, in-process: the sections and their flags, docs/flags.md's tables generated from them,
finish_config's single pass (a continued run keeps what its start resolved), the checks that need two flags
together (LPIPS' smallest input), and the one-line answers to typos."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

import common
import config
import flags
import vae_trainer
from conftest import ROOT, TINY
import run_setup
import latents
from ae import AutoEncoderParams


def test_every_field_is_in_one_section_and_the_config_is_flat_on_disk():
    """Issue 24: the sections nest (cfg.loss.kl_weight), each typed, with one flag name per field across all of
    them; on disk the config is flat, one key per flag (one flatten/unflatten pair), so a config.json written
    before the sections nested reads back into the same Config."""
    names = [f.name for kind in config.SECTIONS.values() for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == len(config.FIELD_SECTION)
    cfg = run_setup.parse_config(["--kl_weight", "0.5", "--gan_weight", "0.2", "--dataset_url", "x"])
    assert type(cfg.loss) is config.LossConfig and cfg.loss.kl_weight == 0.5 and cfg.loss.gan_weight == 0.2
    # every loss weight in the loss section (issue 32 item 3), the critic's own settings in the critic's
    assert type(cfg.critic) is config.CriticConfig and not hasattr(cfg.critic, "gan_weight")
    weights = [f.name for kind in config.SECTIONS.values() for f in dataclasses.fields(kind)
               if f.name.endswith("_weight") and kind is not config.LossConfig]
    assert weights == ["lecam_weight", "r1_weight", "scale_equivariance_weight", "vf_weight"]  # the critic's own,
    # and the latent regularisers' (their section says where they act)
    flat = config.flatten(cfg)
    assert list(flat) == names and flat["kl_weight"] == 0.5 and flat["gan_weight"] == 0.2
    assert config.unflatten({**flat, "derived": {}, "init_source": None}) == cfg  # config.json's other keys ignored
    assert config.with_values(cfg, lecam_weight=0.1).critic.lecam_weight == 0.1
    with pytest.raises(TypeError, match="no_such"):
        config.with_values(cfg, no_such=1)
    assert config.ARCH_FIELDS == ("vae_family", "vae_ch", "vae_ch_mult", "vae_num_res_blocks", "vae_z_channels",
                                  "vae_norm_groups", "do_attn", "posterior", "vae_quant_conv", "vae_decoder_ch",
                                  "vae_latent_bn", "vae_patch_size")


def test_docs_flag_tables_are_the_generated_ones():
    """docs/flags.md's tables are flags.flag_tables() verbatim: a new field is a new row (regenerate with
    `python -c "import flags; print(flags.flag_tables())"`), a changed default or help shows here."""
    flags_page = open(os.path.join(ROOT, "docs", "flags.md")).read()
    assert flags.flag_tables() in flags_page


# the tiny model without its warm-up and worker count: these tests follow the automatic values
TINY_AUTO = [f for i, f in enumerate(TINY[:-2]) if "--num_workers" not in TINY[i - 1:i + 1]]


def finished(tmp_path, shard_url, *flags):
    return run_setup.prepare_run(["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--run_name", "r",
                                 *TINY_AUTO, *flags])


def test_a_continued_run_keeps_the_automatic_values_of_its_start(tmp_path, shard_url):
    """Issue 16 item 4: a 5000-step run resolved warm-up 500 and disc_start 1000; continued with --max_steps
    50000 it keeps them (re-derived they would be 1000 and 10000: the GAN term off for 9000 steps), says what
    changed, and a flag given again wins."""
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "5000", "--do_ganloss")
    assert (cfg.optim.warmup_steps, cfg.loss.disc_start) == (500, 1000) and not notes
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config.public_config(cfg)))
    (run_dir / "checkpoints" / "step_00003000.pt").write_bytes(b"")  # a run that has saved (read by the trainer)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss")
    assert (cfg.optim.warmup_steps, cfg.loss.disc_start, cfg.optim.max_steps) == (500, 1000, 50000)
    assert notes == [f"note: continuing {run_dir} with flags changed since its start: --max_steps 5000 -> 50000"]
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss", "--disc_start", "-1")
    assert cfg.loss.disc_start == 10000 and "--disc_start 1000 -> 10000" in notes[0]  # given again: derived anew
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss", "--resume", "never",
                            "--run_name", "r")
    assert cfg.loss.disc_start == 10000  # --resume never: a new run, its own automatic values


def started(tmp_path, shard_url, *flags):
    """A run of these flags that has saved (the config.json and the derivation record the trainer writes)."""
    first = finished(tmp_path, shard_url, *flags)
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**config.public_config(first.cfg), "derived": first.derived}))
    (run_dir / "checkpoints" / "step_00000150.pt").write_bytes(b"")
    return first


def test_a_continued_run_keeps_its_whole_recipe_and_names_every_change(tmp_path, shard_url, photos_dir):
    """Issue 23 item 9: a finished run continued with only --dataset_url and --max_steps keeps every other value it
    was started with (it used to put do_ganloss, critic_trunk and save_every_n_steps back to their defaults, and
    name only the typed flags), and one line names each value that changes."""
    first = started(tmp_path, shard_url, "--do_ganloss", "--critic_trunk", "frozen", "--save_every_n_steps", "50",
                    "--max_steps", "150", "--kl_weight", "0.01")
    cfg, given, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--dataset_url", photos_dir)
    kept = ("do_ganloss", "critic_trunk", "save_every_n_steps", "kl_weight", "learning_rate_vae",
            "learning_rate_disc", "warmup_steps", "disc_start", "num_workers", "num_threads")
    assert {k: run_setup.value(cfg, k) for k in kept} == {k: run_setup.value(first.cfg, k) for k in kept}
    assert (cfg.critic.do_ganloss, cfg.critic.critic_trunk, cfg.run.save_every_n_steps) == (True, "frozen", 50)
    assert notes == [f"note: continuing {tmp_path / 'r'} with flags changed since its start: --dataset_url "
                     f"{shard_url} -> {photos_dir}, --max_steps 150 -> 300"]
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--critic_trunk", "trainable")
    assert cfg.critic.critic_trunk == "trainable" and "--critic_trunk frozen -> trainable" in notes[0]


@pytest.mark.parametrize("critic_flags", [["--critic_trunk", "frozen"], ["--discriminator", "patchgan"]])
def test_an_automatic_value_is_derived_again_when_its_basis_changes(tmp_path, shard_url, critic_flags):
    """Issue 23 item 3: a pixel-only start resolves the critic's learning rate for the trainable VGG16 critic (1e-5);
    continued with --do_ganloss and another critic it is the rate a new run of those flags gets (the VAE's), and the
    line says why. A rate the user gives wins; values that are history (warm-up, disc_start) stay."""
    first = started(tmp_path, shard_url, "--max_steps", "150")
    assert first.cfg.critic.learning_rate_disc == 1e-5 and first.derived["learning_rate_disc"] == \
        "the vgg16 critic with a trainable trunk"
    fresh = run_setup.prepare_run(["--dataset_url", shard_url, "--output_dir", str(tmp_path / "new"), *TINY_AUTO,
                                  "--max_steps", "300", "--do_ganloss", *critic_flags]).cfg
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss", *critic_flags)
    assert cfg.critic.learning_rate_disc == fresh.critic.learning_rate_disc == cfg.optim.learning_rate_vae != 1e-5
    assert f"derived again: --learning_rate_disc 1e-05 -> {cfg.optim.learning_rate_vae} " \
           f"({cfg.critic.describe()}, not the vgg16 critic with a trainable trunk)" in notes[0], notes
    history = (cfg.optim.warmup_steps, cfg.loss.disc_start)
    assert history == (first.cfg.optim.warmup_steps, first.cfg.loss.disc_start) != \
           (fresh.optim.warmup_steps, fresh.loss.disc_start)
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss", *critic_flags,
                            "--learning_rate_disc", "3e-5")
    assert cfg.critic.learning_rate_disc == 3e-5
    same_critic, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss")
    assert same_critic.critic.learning_rate_disc == 1e-5 and "derived again" not in notes[0]


def test_worker_and_thread_counts_are_derived_again_on_a_machine_with_other_cores(tmp_path, shard_url, monkeypatch):
    """Issue 23 item 3: the data stream's position is saved per worker, so the same machine keeps the worker count
    (an exact resume); a machine with other cores derives both counts again and says so."""
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 16)
    first = started(tmp_path, shard_url, "--max_steps", "150")
    assert (first.cfg.data.num_workers, first.cfg.speed.num_threads) == (4, 12)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300")
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (4, 12) and "derived again" not in notes[0]
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 2)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300")
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (1, 1)
    assert "derived again: --num_workers 4 -> 1 (2 cores per rank, not 16 cores per rank), --num_threads 12 -> 1 " \
           "(2 cores per rank, not 16 cores per rank)" in notes[0], notes
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "300", "--num_workers", "3")
    assert cfg.data.num_workers == 3  # given: kept as given


def test_a_run_recorded_before_the_derivation_record_continues_as_it_did(tmp_path, shard_url, monkeypatch):
    """config.json without "derived" (written by earlier code): the values that code kept stay, the thread count is
    chosen for this machine, and the critic's rate is derived again for a new critic when it was the automatic one."""
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 16)
    first = started(tmp_path, shard_url, "--max_steps", "150")
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    del saved["derived"]
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 2)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss", "--critic_trunk", "frozen")
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (first.cfg.data.num_workers, 1) == (4, 1)
    assert (cfg.optim.warmup_steps, cfg.loss.disc_start) == (first.cfg.optim.warmup_steps,
                                                               first.cfg.loss.disc_start)
    assert cfg.critic.learning_rate_disc == cfg.optim.learning_rate_vae and "--learning_rate_disc 1e-05 -> " in notes[0]


def test_lpips_smallest_input_restricts_the_scale_equivariance_sizes(shard_url):
    """Issue 16 item 5: with LPIPS on and the GAN off, random scale equivariance at 32 px used to decode at 8 and
    12 px, where LPIPS fails mid-run ("Output size is too small"); those sizes are left out, and a config with
    no size left (or a crop below LPIPS' 16 px) is refused in one line."""
    flags = ["--dataset_url", shard_url, "--vae_ch_mult", "1,2,2", "--vae_resolution", "32", "--mse_pool_factor", "1",
             "--scale_equivariance_mode", "random", "--scale_equivariance_prob", "0.5"]
    cfg = run_setup.parse_config(flags)
    cfg.validate()
    factor = AutoEncoderParams.from_config(cfg.model).downsample_factor
    assert [s * factor for s in latents.equivariance_sizes_of(cfg)] == [16, 20, 24, 28]
    import torch
    from critics import build_lpips
    lpips = build_lpips(None)
    for size in (16, 12):
        image = torch.zeros(1, 3, size, size)
        if size >= config.LPIPS_MIN_SIZE:
            lpips(image, image)
        else:
            with pytest.raises(RuntimeError, match="too small"):
                lpips(image, image)
    pixel_only = run_setup.parse_config(flags + ["--perceptual_weight", "0"])
    assert [s * factor for s in latents.equivariance_sizes_of(pixel_only)] == [8, 12, 16, 20, 24, 28]
    with pytest.raises(config.ConfigError, match="at least 16 for LPIPS"):
        run_setup.parse_config(["--dataset_url", shard_url, "--vae_ch_mult", "1,2", "--vae_resolution", "8",
                                "--mse_pool_factor", "1"]).validate()
    with pytest.raises(config.ConfigError, match="at least 16 px"):
        run_setup.check_config(run_setup.parse_config(["--dataset_url", shard_url, "--vae_ch_mult", "1,2",
                                                       "--vae_resolution", "16", "--mse_pool_factor", "1",
                                                       "--scale_equivariance_prob", "0.5"]))


@pytest.mark.parametrize("argv, message", [
    (["--max_step", "10"], "unrecognized arguments: --max_step 10; --max_step: did you mean --max_steps?"),
    (["--max_setps=10"], "--max_setps: did you mean --max_steps?"),
    (["--dataset_url", "shards/00000.tar", "shards/00001.tar", "shards/00002.tar"],
     "unrecognized arguments: shards/00001.tar shards/00002.tar; several paths where one was expected: the shell "
     "expands an unquoted brace or glob pattern; quote it, e.g. --dataset_url 'shards/{00000..00099}.tar'"),
    (["--dataset_url", "no/such/folder"], "--dataset_url no/such/folder: no such directory or file"),
])
def test_typos_get_one_line_that_says_what_to_do(tmp_path, capsys, argv, message):
    """Issue 18 item 5: abbreviations are not flags (argparse took --max_step for --max_steps), a misspelt flag
    gets its likely name, the shell's expansion of an unquoted brace url gets the quoting hint, and a mistyped
    directory is not called a shard."""
    code = vae_trainer.main(["--output_dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert "did you mean" not in err[0] or "--max_st" in err[0]
    assert "quote it" not in err[0] or "00001" in err[0]


@pytest.mark.parametrize("module, argv", [
    ("evaluate", ["--ckpt", "run", "--max_im", "4"]),  # --max_images
    ("export", ["--ckpt", "run", "--out", "x", "--shift", "0.1"]),  # --shift_factor
    ("probe", ["--vae", "a", "--dataset_url", "x", "--test_dataset_url", "y", "--out", "o", "--ste", "3"]),  # --steps
    ("shards", ["make-shards", "src", "dst", "--shard", "5"]),  # --shard_size (python data.py make-shards)
])
def test_every_command_refuses_abbreviated_flags(module, argv, capsys):
    """Not only the trainer: evaluate.py, export.py, probe.py and data.py took an abbreviation for the flag it
    begins, so a typo ran with a value the user did not mean."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    with pytest.raises((common.ConfigError, SystemExit)) as refused:
        parser.parse_args(argv)
    assert f"unrecognized arguments: {argv[-2]}" in str(refused.value) + capsys.readouterr().err
    long_flag = {"evaluate": "--max_images", "export": "--shift_factor", "probe": "--steps", "shards": "--shard_size"}
    full = [long_flag[module] if a == argv[-2] else a for a in argv]
    parser.parse_args(full)  # the whole flag is taken


@pytest.mark.parametrize("workers, threads, cores, expected", [
    (-1, 0, 2, (1, 1)),  # the 2-core machine: 1 worker (PyTorch warns above the cores), the other core computes
    (-1, 0, 1, (1, 1)),
    (-1, 0, 16, (4, 12)),  # one GPU on a 16-core node
    (-1, 0, 6, (3, 3)),
    (0, 0, 8, (0, 8)),  # given values win: 0 workers (load in the main process) is a choice
    (6, 3, 2, (6, 3)),
])
def test_cpu_use_from_the_cores(workers, threads, cores, expected):
    assert run_setup.cpu_use(workers, threads, cores) == expected


def test_cores_per_rank_divides_the_affinity_by_local_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert run_setup.cores_per_rank() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert run_setup.cores_per_rank() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert run_setup.cores_per_rank() == 16
    cfg = run_setup.parse_config(["--dataset_url", "x"])
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (4, 12)
    line = run_setup.cpu_use_line(cfg, {"dataset_url"})
    assert line == ("cpu: 16 cores per rank: 4 data workers, 12 torch threads (--num_workers and --num_threads "
                    "chosen from the cores; give them to override)")


def test_speed_switches_decide_per_device_and_read_old_runs():
    """--allow_tf32 and --channels_last default to auto, decided per device at start (issue 30): TF32 on with CUDA
    (fp32 storage and accumulation), the VAE NCHW with CUDA (PyTorch's CUDA GroupNorm copies channels_last inputs)
    and channels_last on a CPU, the loss networks channels_last unless false. `--allow_tf32` alone is true, as when
    it was a plain bool, and a config.json written then (JSON true/false) reads back, without a 'changed' note."""
    import torch
    speed = run_setup.parse_config(["--dataset_url", "x"]).speed
    assert (speed.allow_tf32, speed.channels_last) == ("auto", "auto")
    assert speed.tf32("cuda") and not speed.tf32("cpu")
    assert speed.memory_formats("cuda") == (torch.contiguous_format, torch.channels_last)
    assert speed.memory_formats("cpu") == (torch.channels_last, torch.channels_last)
    assert speed.describe("cuda") == "fp32 (TF32 on), eager, VAE NCHW"
    assert speed.describe("cpu") == "fp32, eager, VAE channels_last"
    given = run_setup.parse_config(["--dataset_url", "x", "--allow_tf32", "--channels_last", "false",
                                 "--precision", "bf16", "--compile"]).speed
    assert (given.allow_tf32, given.channels_last) == ("true", "false")
    assert given.memory_formats("cpu") == (torch.contiguous_format, torch.contiguous_format)
    assert given.describe("cuda") == "bf16 autocast, compiled, VAE NCHW"
    assert not run_setup.parse_config(["--dataset_url", "x", "--allow_tf32", "off"]).speed.tf32("cuda")
    with pytest.raises(common.ConfigError, match="--channels_last"):
        run_setup.parse_config(["--dataset_url", "x", "--channels_last", "sometimes"])
    old = config.unflatten({"allow_tf32": True, "channels_last": False})
    assert (old.speed.allow_tf32, old.speed.channels_last) == ("true", "false")
    cfg, given_flags = flags.parse_flags(["--dataset_url", "x", "--channels_last", "false"])
    assert run_setup.continuing_note("runs/x", given_flags, {"channels_last": False}, cfg, []) is None
