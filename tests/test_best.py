"""The best checkpoint (--best_metric, checkpoint.BestCheckpoint): after each in-loop evaluation the step with the best
held-out value so far is kept as checkpoints/best, whose checkpoint rotation never removes, a resumed run remembers,
and evaluate.py and export.py --best read. The evaluations report scripted values (tests/scripted_eval.py), so which
step is best is known whatever this machine computes; the weights each evaluation measured are compared with the
best checkpoint's."""
from __future__ import annotations

import json
import os

import pytest
import torch

import checkpoint
import evaluate
import export
import vae_trainer
from common import DistInfo
from conftest import TINY, cli_env, run_cli
from scripted_eval import scripted

pytestmark = pytest.mark.timeout(300)

EVERY_STEP = ("--num_workers", "0", "--evaluate_every_n_steps", "1", "--eval_max_images", "2", "--inception_weights",
              "none", "--log_every_n_steps", "1", "--keep_last_k", "1", "--num_threads", "1")


def train(shard_url, out, monkeypatch, key: str, values: list[float], *flags) -> tuple[int, list[dict]]:
    """(exit code, the weights each evaluation measured) of a run whose evaluations report `values` as `key`."""
    run, measured = scripted(key, values)
    monkeypatch.setattr(evaluate.Validator, "run", run)
    code = vae_trainer.main(["--dataset_url", shard_url, "--test_dataset_url", shard_url, "--output_dir", str(out),
                             *TINY, *EVERY_STEP, *flags])
    return code, measured


def best_record(run_dir) -> dict:
    with open(os.path.join(run_dir, "checkpoints", "best")) as f:
        return json.load(f)


def assert_same_weights(ckpt: dict, measured: dict) -> None:
    for part in ("vae", "ema"):
        saved = ckpt["training"][part]
        assert saved.keys() == measured[part].keys()
        assert all(torch.equal(saved[k], measured[part][k]) for k in saved), part


def saved_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("saved ")]


@pytest.mark.process
def test_the_best_step_is_kept_through_rotation_and_export_and_evaluate_take_it(shard_url, tmp_path, monkeypatch,
                                                                               capsys, one_torch_thread):
    """Evaluations at steps 0-6 report PSNRs whose best is step 3's, a step no periodic save falls on (every 4, one
    kept): step 3's checkpoint is written when it is crowned, holds the weights and EMA that evaluation measured, and
    outlives the saves of steps 4 and 6; the eval lines, metrics.jsonl and the last line name it. export.py and
    evaluate.py --best read it, with the EMA weights its metric measured."""
    psnr = [10.0, 12.0, 11.0, 14.0, 13.0, 9.0, 13.9]
    code, measured = train(shard_url, tmp_path, monkeypatch, "eval_ema/psnr", psnr, "--max_steps", "6",
                           "--save_every_n_steps", "4", "--perceptual_weight", "0")
    out = capsys.readouterr().out
    assert code == 0, out
    run_dir = tmp_path / "vae"
    assert best_record(run_dir) == {"metric": "ema_psnr", "value": 14.0, "step": 3, "checkpoint": "step_00000003.pt"}
    ckpt_dir = run_dir / "checkpoints"
    assert sorted(os.path.basename(p) for p in checkpoint.checkpoint_files(str(ckpt_dir))) == [
        "step_00000003.pt", "step_00000006.pt"]  # step 1 (crowned, then beaten) and step 4 rotated out
    assert [line.split("/")[-1] for line in saved_lines(out)] == [
        "step_00000001.pt", "step_00000003.pt", "step_00000004.pt", "step_00000006.pt"]
    assert_same_weights(torch.load(ckpt_dir / "step_00000003.pt", weights_only=True), measured[3])
    assert not torch.equal(*(measured[i]["ema"]["decoder.conv_out.weight"] for i in (3, 6)))  # (it trained on)
    evals = [line for line in out.splitlines() if line.startswith("eval step")]
    assert [line.rsplit(" | ", 1)[1] for line in evals] == [f"best ema_psnr {v:.4f} at step {s}" for s, v in (
        (0, 10), (1, 12), (1, 12), (3, 14), (3, 14), (3, 14), (3, 14))]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"eval/psnr"' in line]
    assert [(r["best/step"], r["best/ema_psnr"]) for r in records][-1] == (3, 14.0)
    assert "; best ema_psnr 14.0000 at step 3 (evaluate.py and export.py --best)" in out.splitlines()[-1]

    assert export.main(["--ckpt", str(run_dir), "--best", "--out", str(tmp_path / "exported"), "--format",
                        "safetensors"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["step"] == 3 and json.loads(out.splitlines()[-1])["ema"] is True
    assert f"note: --best: {ckpt_dir / 'step_00000003.pt'}, the best ema_psnr 14.0000 at step 3, its EMA weights" in err
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "exported" / checkpoint.SAFETENSORS_WEIGHTS))
    assert all(torch.equal(exported[k], measured[3]["ema"][k]) for k in measured[3]["ema"])
    assert evaluate.main(["--ckpt", str(run_dir), "--best", "--dataset_url", shard_url, "--max_images", "2",
                          "--vgg16_weights", "none", "--inception_weights", "none"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (result["checkpoint"], result["step"], result["ema"]) == (str(ckpt_dir / "step_00000003.pt"), 3, True)


@pytest.mark.process
def test_lpips_is_better_lower_and_a_best_at_a_periodic_save_is_written_once(shard_url, tmp_path, monkeypatch,
                                                                            capsys, one_torch_thread):
    """--best_metric lpips (the weights', without EMA): the lowest value wins; its step 4 is also a periodic save,
    which is not written twice."""
    lpips = [0.5, 0.4, 0.45, 0.3, 0.2, 0.6, 0.21]
    code, measured = train(shard_url, tmp_path, monkeypatch, "eval/lpips", lpips, "--max_steps", "6",
                           "--save_every_n_steps", "4", "--best_metric", "lpips", "--ema_decay", "0")
    out = capsys.readouterr().out
    assert code == 0, out
    assert best_record(tmp_path / "vae") == {"metric": "lpips", "value": 0.2, "step": 4,
                                             "checkpoint": "step_00000004.pt"}
    assert [line.split("/")[-1] for line in saved_lines(out)] == [
        "step_00000001.pt", "step_00000003.pt", "step_00000004.pt", "step_00000006.pt"]
    ckpt = torch.load(tmp_path / "vae" / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert ckpt["training"]["ema"] is None and measured[4]["ema"] is None
    assert all(torch.equal(v, measured[4]["vae"][k]) for k, v in ckpt["training"]["vae"].items())


@pytest.mark.process
def test_a_resumed_run_remembers_the_best_and_crowns_no_worse_step(shard_url, tmp_path, monkeypatch, capsys,
                                                                  one_torch_thread):
    """Stopped at step 4 with the best at step 2 (15 dB), the run continues to step 8 with evaluations below 15 dB:
    step 2 stays the best, its checkpoint kept."""
    flags = ("--save_every_n_steps", "2", "--perceptual_weight", "0")
    code, _ = train(shard_url, tmp_path, monkeypatch, "eval_ema/psnr", [10.0, 12.0, 15.0, 11.0, 11.0],
                    "--max_steps", "4", *flags)
    assert code == 0, capsys.readouterr().out
    capsys.readouterr()
    code, _ = train(shard_url, tmp_path, monkeypatch, "eval_ema/psnr", [14.0, 14.5, 13.0, 14.9],
                    "--max_steps", "8", *flags)  # steps 5-8 (step 4's evaluation is not owed)
    out = capsys.readouterr().out
    assert code == 0 and "resumed from" in out, out
    assert best_record(tmp_path / "vae")["step"] == 2
    assert out.splitlines()[-1].endswith("; best ema_psnr 15.0000 at step 2 (evaluate.py and export.py --best)")
    assert sorted(os.listdir(tmp_path / "vae" / "checkpoints")) == ["best", "latest", "step_00000002.pt",
                                                                    "step_00000008.pt"]


def test_a_run_resumed_from_another_runs_checkpoint_saves_its_best_in_its_own_folder(shard_url, tmp_path,
                                                                                    monkeypatch, capsys,
                                                                                    one_torch_thread):
    """--resume PATH of another run's step 2: the evaluation owed at step 2 is a new best, whose checkpoint this run
    writes into its own folder (the one it resumed from is not there)."""
    flags = ("--max_steps", "2", "--save_every_n_steps", "2", "--perceptual_weight", "0")
    assert train(shard_url, tmp_path, monkeypatch, "eval_ema/psnr", [10.0, 11.0, 12.0], *flags)[0] == 0
    other = tmp_path / "vae" / "checkpoints" / "step_00000002.pt"
    code, _ = train(shard_url, tmp_path, monkeypatch, "eval_ema/psnr", [13.0], *flags, "--run_name", "continued",
                    "--resume", str(other))
    assert code == 0, capsys.readouterr().out
    assert best_record(tmp_path / "continued")["checkpoint"] == "step_00000002.pt"
    assert os.path.isfile(tmp_path / "continued" / "checkpoints" / "step_00000002.pt")


def test_a_run_that_never_beats_its_start_has_no_best_checkpoint(shard_url, tmp_path, monkeypatch, capsys,
                                                                 one_torch_thread):
    """Step 0's evaluation (the weights a fine-tune starts from) is the first bar: evaluations below it crown nothing,
    write no extra checkpoint, and --best says why there is none."""
    code, _ = train(shard_url, tmp_path, monkeypatch, "eval_ema/psnr", [20.0, 12.0, 15.0], "--max_steps", "2",
                    "--save_every_n_steps", "2", "--perceptual_weight", "0")
    out = capsys.readouterr().out
    assert code == 0, out
    assert best_record(tmp_path / "vae") == {"metric": "ema_psnr", "value": 20.0, "step": 0, "checkpoint": None}
    assert [line.split("/")[-1] for line in saved_lines(out)] == ["step_00000002.pt"]
    assert "no evaluated step beat the weights the run started from" in out.splitlines()[-1]
    assert export.main(["--ckpt", str(tmp_path / "vae"), "--best", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "beat the weights it started from (best ema_psnr 20.0000 at step 0)" in err[0], err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags, message", [
    (["--best_metric", "psnr"], "--best_metric psnr needs evaluation during training"),
    (["--test_dataset_url", "URL", "--best_metric", "ema_ssim", "--ema_decay", "0"],
     "--best_metric ema_ssim is the EMA's metric and --ema_decay is 0"),
    (["--test_dataset_url", "URL", "--best_metric", "rfid", "--inception_weights", "none"],
     "--inception_weights none turns rFID off"),
    (["--test_dataset_url", "URL", "--best_metric", "lpips", "--perceptual_weight", "0"], "computes no LPIPS"),
    (["--test_dataset_url", "URL", "--best_metric", "fid"], "invalid choice"),
])
def test_a_best_metric_the_run_cannot_compute_is_refused_in_one_line(tmp_path, capsys, shard_url, flags, message):
    code = vae_trainer.main(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY, "--num_workers", "0",
                             "--max_steps", "2", *[shard_url if f == "URL" else f for f in flags]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert os.listdir(tmp_path) == []


def test_a_best_metric_whose_weights_are_missing_is_refused_before_anything_is_written(tmp_path, capsys, shard_url,
                                                                                     monkeypatch, one_torch_thread):
    """rFID without the Inception weights (none in this cache, no download): one line, no run directory."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_torch_cache"))
    real = evaluate.ensure_inception_weights
    monkeypatch.setattr(evaluate, "ensure_inception_weights", lambda spec, download=True: real(spec, False))
    out = tmp_path / "runs"
    code = vae_trainer.main(["--dataset_url", shard_url, "--test_dataset_url", shard_url, "--output_dir", str(out),
                             *TINY, "--num_workers", "0", "--best_metric", "rfid", "--perceptual_weight", "0",
                             "--max_steps", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: --best_metric rfid: evaluation cannot compute rfid on this run"), err
    assert not out.exists() or os.listdir(out) == []


@pytest.mark.parametrize("command", [export, evaluate])
@pytest.mark.parametrize("case, message", [
    ("no record", "has no best checkpoint"),
    ("missing file", "step_00000005.pt, the best psnr 30.0000 at step 5, is missing"),
    ("a file", "is not a run directory"),
])
def test_best_without_a_best_checkpoint_is_one_line(tmp_path, capsys, command, case, message):
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "step_00000004.pt").write_bytes(b"")
    if case == "missing file":
        (ckpt_dir / "best").write_text(json.dumps({"metric": "psnr", "value": 30.0, "step": 5,
                                                   "checkpoint": "step_00000005.pt"}))
    ckpt = str(ckpt_dir / "step_00000004.pt") if case == "a file" else str(tmp_path / "run")
    extra = ["--out", str(tmp_path / "out")] if command is export else ["--dataset_url", str(tmp_path)]
    assert command.main(["--ckpt", ckpt, "--best", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --best: ") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_rotation_keeps_the_best_and_a_resume_before_it_chooses_again(tmp_path):
    """write_checkpoint never removes the checkpoint `best` names; a run resumed at a step before the record's (from
    an earlier checkpoint: the later steps are trained again) drops it, one resumed at or after it keeps it, one
    with another metric starts afresh."""
    ckpt_dir = str(tmp_path)
    best = checkpoint.BestCheckpoint(ckpt_dir, "psnr", DistInfo())
    for step in (1, 2, 3, 4):
        checkpoint.write_checkpoint(ckpt_dir, step, {"step": step}, keep_last_k=1)
        if step == 2:
            best.crown(2, {"eval/psnr": 30.0}, sharded=False)
    assert sorted(os.listdir(ckpt_dir)) == ["best", "latest", "step_00000002.pt", "step_00000004.pt"]
    assert best.improves({"eval/psnr": 30.5}) and not best.improves({"eval/psnr": 30.0})
    assert not best.improves({"eval/psnr": float("nan")}) and not best.improves({"eval/psnr": None})

    lines = []
    again = checkpoint.BestCheckpoint(ckpt_dir, "psnr", DistInfo())
    again.resume(2, lines.append)
    assert again.record["step"] == 2 and lines == []
    other = checkpoint.BestCheckpoint(ckpt_dir, "lpips", DistInfo())
    other.resume(4, lines.append)
    assert other.record is None and "another --best_metric" in lines[0] and os.path.isfile(tmp_path / "best")
    earlier = checkpoint.BestCheckpoint(ckpt_dir, "psnr", DistInfo())
    earlier.resume(1, lines.append)
    assert earlier.record is None and "past step 1" in lines[1] and not os.path.exists(tmp_path / "best")


@pytest.mark.process
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_ranks_keep_the_best_step_ddp_and_sharded(shard_url, tmp_path, sharding):
    """Under torchrun (2 ranks, gloo): every rank agrees on the best and takes part in its save; rank 0 writes it
    (ddp), or every rank its shards of a DCP checkpoint (fsdp). The best (step 2, no periodic save) holds the weights
    that evaluation measured and export.py --best reads it."""
    (tmp_path / "weights").mkdir()
    env = {"VAE_TRAINER_EVAL_SCRIPT": "eval_ema/psnr:10,12,13,11",
           "VAE_TRAINER_EVAL_WEIGHTS": str(tmp_path / "weights")}
    # (fsdp with the recipe's LPIPS: the one sharded run here that trains it; test_sharding's runs train pixel losses)
    lpips = [] if sharding == "fsdp" else ["--perceptual_weight", "0"]
    args = ["--dataset_url", shard_url, "--test_dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
            *EVERY_STEP, "--max_steps", "3", "--save_every_n_steps", "3", *lpips, "--sharding",
            sharding, "--num_threads", "1", "--channels_last", "false", "--memory_check", "false"]
    proc = run_cli("tests/scripted_eval.py", args, nproc=2, env=cli_env(**env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = checkpoint.checkpoint_name(2, sharded=sharding == "fsdp")
    assert best_record(tmp_path / "vae") == {"metric": "ema_psnr", "value": 13.0, "step": 2, "checkpoint": name}
    ckpt_dir = tmp_path / "vae" / "checkpoints"
    assert sorted(os.path.basename(p) for p in checkpoint.checkpoint_files(str(ckpt_dir))) == [
        name, checkpoint.checkpoint_name(3, sharded=sharding == "fsdp")]
    assert_same_weights(checkpoint.load_checkpoint(str(ckpt_dir / name)),
                        torch.load(tmp_path / "weights" / "weights_2.pt", weights_only=True))
    assert export.main(["--ckpt", str(tmp_path / "vae"), "--best", "--out", str(tmp_path / "x"), "--format",
                        "safetensors"]) == 0
