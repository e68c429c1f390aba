"""Runs written by earlier releases, continued by today's code (issue 31 item 2). Each folder of tests/fixtures/releases/
is a run directory as the trainer of that commit wrote it (tests/fixtures/make_release_run.py; refresh it at each
release): a fine-tune --init_from a tiny diffusers VAE, automatic warm-up and --disc_start, stopped at step 10. The
same command with a larger --max_steps must continue it with its whole recipe: a config.json that lacks fields added
since must not make it "another architecture" whose automatic values are derived again (2ca9f3c's run lost its
--disc_start 2 -> 6 and its warm-up 1 -> 3, silently, through --vae_latent_bn_eps)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import config
import vae_trainer
from conftest import ROOT

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "releases")
RELEASES = sorted(os.listdir(FIXTURES))


def continued(release: str, tmp_path, monkeypatch, capsys, *, steps: int, drop: tuple[str, ...] = ()):
    """Copy the release's folder, run its own command from inside it with --max_steps `steps` (and without the
    flags in `drop`); returns (config.json before, after, stdout, the command's exit code)."""
    folder = tmp_path / release
    shutil.copytree(os.path.join(FIXTURES, release), folder)
    monkeypatch.chdir(folder)
    with open("command.json") as f:
        argv = json.load(f)["argv"]
    for flag in drop:
        i = argv.index(flag)
        del argv[i:i + 2]
    argv[argv.index("--max_steps") + 1] = str(steps)
    with open("runs/ft/config.json") as f:
        before = json.load(f)
    code = vae_trainer.main(argv)
    with open("runs/ft/config.json") as f:
        after = json.load(f)
    return before, after, capsys.readouterr().out, code


@pytest.mark.parametrize("release", RELEASES)
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
    changed = {k: (v, after.get(k)) for k, v in before.items() if k in config.FIELD_SECTION
               and k not in ("max_steps", "resume", "force") and config.as_written_now(k, v) != after.get(k)}
    if not with_init_from:
        changed.pop("init_from", None)  # a flag not given again keeps its value; dropped here on purpose
    assert changed == {}, changed  # the warm-up and disc_start of step 10 among them
    assert (after["warmup_steps"], after["disc_start"]) == (before["warmup_steps"], before["disc_start"]) == (1, 2)
    with open("runs/ft/metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    assert steps[-1] == 14 and steps == sorted(steps)


def test_every_release_fixture_holds_what_the_test_reads():
    """A refreshed fixture (make_release_run.py) holds the command, the source, the data and a checkpoint at step
    10, nothing that a run writes besides (curves, samples, wandb)."""
    assert "2ca9f3c" in RELEASES  # the release issue 31 item 2 was found with
    for release in RELEASES:
        folder = os.path.join(FIXTURES, release)
        assert sorted(os.listdir(folder)) == ["command.json", "data", "runs", "source"]
        assert sorted(os.listdir(os.path.join(folder, "runs", "ft"))) == ["checkpoints", "config.json",
                                                                           "metrics.jsonl"]
        with open(os.path.join(folder, "command.json")) as f:
            assert json.load(f)["commit"].startswith(release)
        assert os.path.isfile(os.path.join(folder, "runs", "ft", "checkpoints", "step_00000010.pt"))
