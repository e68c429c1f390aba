"""run_setup.py, in-process: what a continued run keeps of its start (its whole recipe, its automatic values, the
ones derived again when their basis changed, runs recorded by earlier code) and the CPU split between data workers
and torch threads."""
from __future__ import annotations

import json
import os

import pytest

import config
import run_setup
from conftest import TINY


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
