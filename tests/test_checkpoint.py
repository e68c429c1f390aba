"""checkpoint.py in-process: the registry saves and restores every entry under its own keys, the compatibility
rule reads the model section, and the run directory is created and removed as a failed start needs."""
from __future__ import annotations

import json
import os

import pytest
import torch

import checkpoint
import config
import run_setup


class Counter:
    """A stateful entry as the registry wants it: its state out, its own sub-dict back in."""

    def __init__(self):
        self.value = torch.zeros(2)

    def state_dict(self) -> dict:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict, path: str = "", log=print) -> str:
        self.value = state["value"].clone()
        return f"loaded from {path}"


def test_the_registry_saves_each_entry_under_its_own_name_and_restores_it(tmp_path):
    """Issue 24: each entry is its own sub-dict (torchtitan's CheckpointManager), and an entry reads only its own;
    an absent piece (a run without a critic) is None in the file and not loaded."""
    first, second = Counter(), Counter()
    first.value += 1
    second.value += 2
    registry = checkpoint.Registry(first=first, second=second, critic=None)
    state = registry.state_dict()
    assert set(state) == {"format_version", "first", "second", "critic"} and state["critic"] is None
    assert state["format_version"] == checkpoint.FORMAT_VERSION == 2
    path = checkpoint.write_checkpoint(str(tmp_path), 7, state, keep_last_k=1)
    restored = checkpoint.Registry(first=Counter(), second=Counter(), critic=None)
    loaded = restored.load_state_dict(path, checkpoint.load_checkpoint(path))
    assert loaded == {"first": f"loaded from {path}", "second": f"loaded from {path}"}
    assert torch.equal(restored.entries["first"].value, first.value)
    assert torch.equal(restored.entries["second"].value, second.value)


def test_a_flat_checkpoint_of_earlier_code_is_migrated_entry_by_entry():
    """format_version 1 (every owner's keys at the top level, the compatibility facts in the flat config) reads as
    the namespaced layout: the VAE's entry keeps its --train_parts, the critic's its kind, the run's entry the
    rest; a bare state dict is not a checkpoint and stays as it is."""
    vae, ema = {"w": torch.ones(1)}, {"w": torch.zeros(1)}
    flat = {"format_version": 1, "step": 5, "config": {"train_parts": "decoder", "discriminator": "patchgan",
                                                      "disc_norm": "group_spectral", "critic_trunk": "trainable"},
            "model_params": {"ch": 32}, "init_source": None, "ranks": [{"data": {}}], "world_size": 1,
            "vae": vae, "ema": ema, "optimizer_vae": {"o": 1}, "scheduler_vae": {"s": 1}, "scaler_vae": {},
            "discriminator": {"d": torch.ones(1)}, "optimizer_disc": {"o": 2}, "scheduler_disc": {"s": 2},
            "scaler_disc": {}, "lecam": {"ema_real": torch.zeros(())}, "guard": {"bad_steps_total": 3, "bad_streak": 0},
            "ranks_in_sync": True, "critic_in_sync": True}
    new = checkpoint.migrate(flat)
    assert new["format_version"] == 2
    assert new["training"] == {"vae": vae, "ema": ema, "optimizer": {"o": 1}, "scheduler": {"s": 1}, "scaler": {},
                               "train_parts": "decoder"}
    assert new["adversary"]["kind"] == {"discriminator": "patchgan", "disc_norm": "group_spectral",
                                        "critic_trunk": "trainable"}
    assert new["adversary"]["optimizer"] == {"o": 2} and new["adversary"]["lecam"] is flat["lecam"]
    assert new["guard"] == {"bad_steps_total": 3, "bad_streak": 0} and new["vf_projection"] is None
    assert new["run"]["step"] == 5 and new["run"]["ranks_in_sync"] and new["run"]["model_params"] == {"ch": 32}
    assert checkpoint.migrate(new) is new
    assert checkpoint.migrate(vae) is vae  # a bare state dict
    assert checkpoint.trained_weights(flat) is vae and checkpoint.trained_weights(new, ema=True) is ema


def test_compatibility_reads_the_model_section():
    model = run_setup.parse_config(["--vae_ch", "32"]).model
    same = {k: getattr(model, k) for k in config.ARCH_FIELDS}
    assert checkpoint.check_compatible(model, False, {**same, "kl_weight": 9.0}, "run")  # not architecture
    with pytest.raises(checkpoint.ConfigError, match="vae_ch: 64 -> 32"):
        checkpoint.check_compatible(model, False, {**same, "vae_ch": 64}, "run")
    assert not checkpoint.check_compatible(model, True, {**same, "vae_ch": 64}, "run")  # --force
    legacy = {k: v for k, v in same.items() if k != "vae_norm_groups"}  # before the flag: 32 groups
    with pytest.raises(checkpoint.ConfigError, match="vae_norm_groups: 32 -> 8"):
        checkpoint.check_compatible(model, False, legacy, "run")


def test_a_run_directory_is_created_with_its_config_and_removed_only_without_checkpoints(tmp_path):
    run_dir = str(tmp_path / "run")
    assert checkpoint.start_run_dir(run_dir, {"max_steps": 3}, set_aside=False, log=lambda m: None)
    assert json.load(open(os.path.join(run_dir, "config.json"))) == {"max_steps": 3}
    assert os.path.isdir(os.path.join(run_dir, "samples"))
    assert not checkpoint.start_run_dir(run_dir, {"max_steps": 4}, set_aside=False, log=lambda m: None)
    checkpoint.write_checkpoint(os.path.join(run_dir, "checkpoints"), 1, {"step": 1}, keep_last_k=1)
    checkpoint.remove_run_dir_if_unused(run_dir)
    assert os.path.isdir(run_dir)  # it holds a checkpoint
    os.remove(os.path.join(run_dir, "checkpoints", "step_00000001.pt"))
    checkpoint.remove_run_dir_if_unused(run_dir)
    assert not os.path.exists(run_dir)


def test_the_run_lock_never_holds_a_file_its_holder_removed(tmp_path, monkeypatch):
    """The race the inode re-check closes (issue 31 item 8): a taker opens the lock file, its holder releases
    (unlinks it, then unlocks) and a third job creates and locks a new file at the path; the taker's flock then
    succeeds on the removed file. Without the re-check both jobs would hold the run; with it the taker looks at the
    file now at the path, finds it held, and is refused."""
    import fcntl
    lock = checkpoint.RunLock(str(tmp_path / "run"))
    with open(lock.path, "w") as f:
        f.write("the old holder")
    real_flock, third = fcntl.flock, []

    def flock_after_a_release_and_a_new_taker(fd, operation):
        if not third:  # between the taker's open and its flock
            os.unlink(lock.path)
            third.append(open(lock.path, "a+"))
            third[0].write("pid 1 on elsewhere")
            third[0].flush()
            real_flock(third[0].fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real_flock(fd, operation)
    monkeypatch.setattr(fcntl, "flock", flock_after_a_release_and_a_new_taker)
    try:
        with pytest.raises(config.ConfigError, match=r"in use by another job \(pid 1 on elsewhere\)"):
            lock.acquire(wait_s=0.5)
        assert not lock.holding
    finally:
        third[0].close()


@pytest.mark.process
def test_the_run_lock_waits_for_a_holder_that_is_exiting(tmp_path):
    """An elastic restart's new rank 0 may start while the old one is still exiting: the lock is waited for (up to
    wait_s), not refused at once (issue 31 item 8)."""
    import subprocess
    import sys
    from conftest import ROOT
    run_dir = tmp_path / "run"
    code = (f"import sys, time; sys.path.insert(0, {ROOT!r}); import checkpoint; "
            f"lock = checkpoint.RunLock({str(run_dir)!r}); lock.acquire(); print('held', flush=True); "
            "time.sleep(1.0); lock.release()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = checkpoint.RunLock(str(run_dir))
        lock.acquire(wait_s=30)
        assert lock.holding
        lock.release()
    finally:
        holder.kill()
        holder.wait()
