"""checkpoint.py in-process: the registry saves and restores every entry under its own keys, the compatibility
rule reads the model section, and the run directory is created and removed as a failed start needs."""
from __future__ import annotations

import json
import os

import pytest
import torch

import checkpoint
import config


class Counter:
    """A stateful entry as the registry wants it: its top-level keys out, its own keys back in."""

    def __init__(self, key: str):
        self.key, self.value = key, torch.zeros(2)

    def state_dict(self) -> dict:
        return {self.key: self.value.clone()}

    def load_state_dict(self, ckpt: dict, path: str = "", log=print) -> str:
        self.value = ckpt[self.key].clone()
        return f"{self.key} from {path}"


def test_the_registry_saves_each_entry_under_its_keys_and_restores_it(tmp_path):
    first, second = Counter("a"), Counter("b")
    first.value += 1
    second.value += 2
    registry = checkpoint.Registry(first=first, second=second, critic=checkpoint.ABSENT_ADVERSARY)
    state = registry.state_dict()
    assert set(state) == {"a", "b", "discriminator", "optimizer_disc", "scheduler_disc", "scaler_disc", "lecam"}
    path = checkpoint.write_checkpoint(str(tmp_path), 7, state, keep_last_k=1)
    restored = checkpoint.Registry(first=Counter("a"), second=Counter("b"), critic=checkpoint.ABSENT_ADVERSARY)
    loaded = restored.load_state_dict(path, checkpoint.load_checkpoint(path))
    assert loaded == {"first": f"a from {path}", "second": f"b from {path}", "critic": None}
    assert torch.equal(restored.entries["first"].value, first.value)
    assert torch.equal(restored.entries["second"].value, second.value)


def test_compatibility_reads_the_model_section():
    model = config.section(config.parse_config(["--vae_ch", "32"]), config.ModelConfig)
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
