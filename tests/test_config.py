"""config.py on its own, in-process: the sections and their flags, the README's tables generated from them,
finish_config's single pass (a continued run keeps what its start resolved), the checks that need two flags
together (LPIPS' smallest input), and the one-line answers to typos."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

import common
import config
import vae_trainer
from conftest import ROOT, TINY


def test_every_field_is_in_one_section_and_a_section_is_typed():
    names = [f.name for kind in config.SECTIONS for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == len(dataclasses.fields(config.Config))
    cfg = config.parse_config(["--kl_weight", "0.5", "--gan_weight", "0.2"])
    loss = config.section(cfg, config.LossConfig)
    assert type(loss) is config.LossConfig and loss.kl_weight == 0.5 and not hasattr(loss, "gan_weight")
    assert config.section(cfg, config.CriticConfig).gan_weight == 0.2
    assert config.ARCH_FIELDS == ("vae_ch", "vae_ch_mult", "vae_num_res_blocks", "vae_z_channels",
                                  "vae_norm_groups", "do_attn", "posterior", "vae_quant_conv")


def test_readme_flag_tables_are_the_generated_ones():
    """The README's tables are config.flag_tables() verbatim: a new field is a new row (regenerate with
    `python -c "import config; print(config.flag_tables())"`), a changed default or help shows here."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert config.flag_tables() in readme


def finished(tmp_path, shard_url, *flags):
    return config.finish_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--run_name", "r",
                                 *TINY[:-2], *flags])


def test_a_continued_run_keeps_the_automatic_values_of_its_start(tmp_path, shard_url):
    """Issue 16 item 4: a 5000-step run resolved warm-up 500 and disc_start 1000; continued with --max_steps
    50000 it keeps them (re-derived they would be 1000 and 10000: the GAN term off for 9000 steps), says what
    changed, and a flag given again wins."""
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "5000", "--do_ganloss")
    assert (cfg.warmup_steps, cfg.disc_start) == (500, 1000) and not notes
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config.public_config(cfg)))
    (run_dir / "checkpoints" / "step_00003000.pt").write_bytes(b"")  # a run that has saved (read by the trainer)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss")
    assert (cfg.warmup_steps, cfg.disc_start, cfg.max_steps) == (500, 1000, 50000)
    assert notes == [f"note: continuing {run_dir} with flags changed since its start: --max_steps 5000 -> 50000"]
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss", "--disc_start", "-1")
    assert cfg.disc_start == 10000 and "--disc_start 1000 -> 10000" in notes[0]  # given again: derived anew
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss", "--resume", "never",
                            "--run_name", "r")
    assert cfg.disc_start == 10000  # --resume never: a new run, its own automatic values


def test_lpips_smallest_input_restricts_the_scale_equivariance_sizes(shard_url):
    """Issue 16 item 5: with LPIPS on and the GAN off, random scale equivariance at 32 px used to decode at 8 and
    12 px, where LPIPS fails mid-run ("Output size is too small"); those sizes are left out, and a config with
    no size left (or a crop below LPIPS' 16 px) is refused in one line."""
    flags = ["--dataset_url", shard_url, "--vae_ch_mult", "1,2,2", "--vae_resolution", "32", "--mse_pool_factor", "1",
             "--scale_equivariance_mode", "random", "--scale_equivariance_prob", "0.5"]
    cfg = config.parse_config(flags)
    config.validate(cfg)
    factor = config.model_params(cfg).downsample_factor
    assert [s * factor for s in config.scale_equivariance_sizes(cfg)] == [16, 20, 24, 28]
    import torch
    from utils import build_lpips
    lpips = build_lpips(None)
    for size in (16, 12):
        image = torch.zeros(1, 3, size, size)
        if size >= config.LPIPS_MIN_SIZE:
            lpips(image, image)
        else:
            with pytest.raises(RuntimeError, match="too small"):
                lpips(image, image)
    pixel_only = config.parse_config(flags + ["--perceptual_weight", "0"])
    assert [s * factor for s in config.scale_equivariance_sizes(pixel_only)] == [8, 12, 16, 20, 24, 28]
    with pytest.raises(config.ConfigError, match="at least 16 for LPIPS"):
        config.validate(config.parse_config(["--dataset_url", shard_url, "--vae_ch_mult", "1,2", "--vae_resolution",
                                             "8", "--mse_pool_factor", "1"]))
    with pytest.raises(config.ConfigError, match="at least 16 px"):
        config.validate(config.parse_config(["--dataset_url", shard_url, "--vae_ch_mult", "1,2", "--vae_resolution",
                                             "16", "--mse_pool_factor", "1", "--scale_equivariance_prob", "0.5"]))


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
    ("data", ["make-shards", "src", "dst", "--shard", "5"]),  # --shard_size
])
def test_every_command_refuses_abbreviated_flags(module, argv, capsys):
    """Not only the trainer: evaluate.py, export.py, probe.py and data.py took an abbreviation for the flag it
    begins, so a typo ran with a value the user did not mean."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    with pytest.raises((common.ConfigError, SystemExit)) as refused:
        parser.parse_args(argv)
    assert f"unrecognized arguments: {argv[-2]}" in str(refused.value) + capsys.readouterr().err
    long_flag = {"evaluate": "--max_images", "export": "--shift_factor", "probe": "--steps", "data": "--shard_size"}
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
    assert config.cpu_use(workers, threads, cores) == expected


def test_cores_per_rank_divides_the_affinity_by_local_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert config.cores_per_rank() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert config.cores_per_rank() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert config.cores_per_rank() == 16
    cfg = config.parse_config(["--dataset_url", "x"])
    assert (cfg.num_workers, cfg.num_threads) == (4, 12)
    line = config.cpu_use_line(cfg, {"dataset_url"})
    assert line == ("cpu: 16 cores per rank: 4 data workers, 12 torch threads (--num_workers and --num_threads "
                    "chosen from the cores; give them to override)")
