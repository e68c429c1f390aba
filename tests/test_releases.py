"""Runs written by earlier releases, continued by today's code (issue 31 item 2). Each folder of tests/fixtures/releases/
is a run directory as the trainer of that commit wrote it (tests/fixtures/make_release_run.py; refresh it at each
release): a fine-tune --init_from a tiny diffusers VAE, automatic warm-up and --disc_start, stopped at step 10. The
same command with a larger --max_steps must continue it with its whole recipe: a config.json that lacks fields added
since must not make it "another architecture" whose automatic values are derived again (2ca9f3c's run lost its
--disc_start 2 -> 6 and its warm-up 1 -> 3, silently, through --vae_latent_bn_eps)."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

import config
import vae_trainer
from conftest import ROOT

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "releases")
RELEASES = sorted(os.listdir(FIXTURES))


def fixture_json(release: str, *path: str) -> dict:
    with open(os.path.join(FIXTURES, release, *path)) as f:
        return json.load(f)


# fine-tunes --init_from a diffusers folder (releases since --init_from), and runs of releases before
# --vae_norm_groups and --vae_quant_conv (their config.json lacks both: config.LEGACY_ARCH says what they had)
FINE_TUNES = [r for r in RELEASES if "--init_from" in fixture_json(r, "command.json")["argv"]]
BEFORE_ARCH_FLAGS = [r for r in RELEASES if "vae_norm_groups" not in fixture_json(r, "runs", "ft", "config.json")]


def continued(release: str, tmp_path, monkeypatch, capsys, *, steps: int, drop: tuple[str, ...] = (),
              add: tuple[str, ...] = ()):
    """Copy the release's folder, run its own command from inside it with --max_steps `steps` (without the flags
    in `drop`, with the flags in `add`); returns (config.json before, after, stdout, the command's exit code)."""
    folder = tmp_path / release
    shutil.copytree(os.path.join(FIXTURES, release), folder)
    monkeypatch.chdir(folder)
    with open("command.json") as f:
        argv = json.load(f)["argv"]
    for flag in drop:
        i = argv.index(flag)
        del argv[i:i + 2]
    argv[argv.index("--max_steps") + 1] = str(steps)
    argv += list(add)
    with open("runs/ft/config.json") as f:
        before = json.load(f)
    code = vae_trainer.main(argv)
    with open("runs/ft/config.json") as f:
        after = json.load(f)
    return before, after, capsys.readouterr().out, code


def changed_flags(before: dict, after: dict) -> dict:
    """{flag: (value in the release's config.json, value after the continued run)} of the flags whose value the
    continued run changed (the ones it is given anew, --max_steps, aside)."""
    return {k: (v, after.get(k)) for k, v in before.items() if k in config.FIELD_SECTION
            and k not in ("max_steps", "resume", "force") and config.as_written_now(k, v) != after.get(k)}


@pytest.mark.process
@pytest.mark.parametrize("release", FINE_TUNES)
@pytest.mark.parametrize("with_init_from", [True, False], ids=["its_command", "without_init_from"])
def test_a_run_of_an_earlier_release_continues_with_its_recipe(release, with_init_from, tmp_path, monkeypatch,
                                                               capsys):
    before, after, out, code = continued(release, tmp_path, monkeypatch, capsys, steps=14,
                                         drop=() if with_init_from else ("--init_from",))
    assert code == 0, out[-3000:]
    assert "resumed from runs/ft/checkpoints/step_00000010.pt at step 10" in out, out[-3000:]
    note = next((line for line in out.splitlines() if line.startswith("note: continuing")), "")
    assert note == "note: continuing runs/ft with flags changed since its start: --max_steps 10 -> 14", out[-3000:]
    assert "derived again" not in out
    changed = changed_flags(before, after)
    if not with_init_from:
        changed.pop("init_from", None)  # a flag not given again keeps its value; dropped here on purpose
    assert changed == {}, changed  # the warm-up and disc_start of step 10 among them
    assert (after["warmup_steps"], after["disc_start"]) == (before["warmup_steps"], before["disc_start"]) == (1, 2)
    with open("runs/ft/metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    assert steps[-1] == 14 and steps == sorted(steps)


@pytest.mark.parametrize("release", BEFORE_ARCH_FLAGS)
def test_a_run_from_before_the_norm_groups_and_quant_conv_flags_continues_as_the_model_it_was(
        release, tmp_path, monkeypatch, capsys):
    """A run of a release before --vae_norm_groups and --vae_quant_conv (a model from scratch: that release had no
    --init_from): its config.json has neither, and its model had 32 GroupNorm groups and no quant convs. Continued
    with its command and that architecture stated in today's flags (as a script written for today's trainer
    states it), it is the same run: resumed at step 10 with its whole recipe (its learning rate, warm-up and loss
    weights, not today's defaults and automatic values), and what it saves is that model."""
    import torch
    before, after, out, code = continued(release, tmp_path, monkeypatch, capsys, steps=11,
                                         add=("--vae_norm_groups", "32", "--vae_quant_conv", "false"))
    assert code == 0, out[-3000:]
    assert "resumed from runs/ft/checkpoints/step_00000010.pt at step 10" in out, out[-3000:]
    note = next((line for line in out.splitlines() if line.startswith("note: continuing")), "")
    # (the thread count is derived on every start of a run from before its record: it is this machine's)
    assert re.fullmatch(r"note: continuing runs/ft with flags changed since its start: --max_steps 10 -> 11"
                        r"(; derived again: --num_threads None -> \d+ \([^)]*\))?", note), out[-3000:]
    assert changed_flags(before, after) == {}
    assert (after["vae_norm_groups"], after["vae_quant_conv"]) == (32, False)
    ckpt = torch.load("runs/ft/checkpoints/step_00000011.pt", map_location="cpu", weights_only=True)
    assert ckpt["run"]["model_params"]["norm_groups"] == 32
    assert not any("quant_conv" in k for k in ckpt["training"]["vae"])


def test_every_release_fixture_holds_what_the_test_reads():
    """A refreshed fixture (make_release_run.py) holds the command, the source (a fine-tune's), the data and a
    checkpoint at step 10, nothing that a run writes besides (curves, samples, wandb)."""
    assert "2ca9f3c" in FINE_TUNES  # the release issue 31 item 2 was found with
    assert "693b34c" in BEFORE_ARCH_FLAGS  # the last before --vae_norm_groups (b51bee8) and --vae_quant_conv
    for release in RELEASES:
        folder = os.path.join(FIXTURES, release)
        assert sorted(os.listdir(folder)) == ["command.json", "data", "runs"] + ["source"] * (release in FINE_TUNES)
        assert sorted(os.listdir(os.path.join(folder, "runs", "ft"))) == ["checkpoints", "config.json",
                                                                           "metrics.jsonl"]
        with open(os.path.join(folder, "command.json")) as f:
            assert json.load(f)["commit"].startswith(release)
        assert os.path.isfile(os.path.join(folder, "runs", "ft", "checkpoints", "step_00000010.pt"))
