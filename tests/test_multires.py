"""Multi-resolution training (issue 26 items 2-3): the --train_resolutions schedule, the batch scaling, the data
workers' per-step crop size (0 and 2 workers, resumed), the memory check at the largest size, a default run bitwise
today's, and the real CLI: the same size on both ranks of a torchrun run, and a stop/resume inside the schedule and
across its stage change bitwise the uninterrupted run."""
from __future__ import annotations

import json
import os

import pytest
import torch

import common
import config
import data
import memory
import vae_trainer
from conftest import PLUMBING, TINY, cli_env, cut_after, run_cli, run_in_process
import run_setup
from ae import AutoEncoderParams

pytestmark = pytest.mark.timeout(480)

SCHEDULE = "32,48,64;4:48,64"  # TINY's 64 px reference; a stage change at step 4


def schedule(spec=SCHEDULE, reference=64, batch=2, seed=42):
    return data.ResolutionSchedule.parse(spec, reference, batch, seed)


# ------------------------------------------------------------------------------------------ the schedule itself
def test_schedule_stages_and_seeded_per_step_draws():
    s = schedule()
    assert s.stages == [(0, (32, 48, 64)), (4, (48, 64))] and s.sizes == [32, 48, 64]
    sizes = [s.size_at(step) for step in range(200)]
    assert set(sizes[:4]) <= {32, 48, 64} and set(sizes[4:]) == {48, 64}
    assert set(sizes[:200]) == {32, 48, 64}  # every size of a stage is drawn
    # a pure function of (seed, step): another object, another order of calls, the same sizes; another seed others
    again = schedule()
    assert [again.size_at(step) for step in reversed(range(200))] == sizes[::-1]
    assert [schedule(seed=7).size_at(step) for step in range(200)] != sizes
    assert schedule("").stages == [(0, (64,))] and schedule("").size_at(5) == 64


def test_batch_scaling_keeps_the_pixels_per_step():
    """At size s a micro-batch holds max(1, round(batch_size * (reference / s)^2)) images."""
    s = schedule("192,256,320,512,1024", reference=256, batch=8)
    assert {size: s.batch_for(size) for size in s.sizes} == {192: 14, 256: 8, 320: 5, 512: 2, 1024: 1}
    for size in (192, 256, 320, 512):
        assert s.batch_for(size) * size ** 2 == pytest.approx(8 * 256 ** 2, rel=0.1)
    assert schedule().batch_for(32) == 8 and schedule().batch_for(48) == 4  # TINY's sizes, as the tests below use


@pytest.mark.parametrize("spec, message", [
    ("64;0:32", "greater than the previous"), ("5:64", "first stage starts at step 0"), ("64;x:32", "is not"),
    ("64;8:32;4:48", "greater than the previous"), ("64,0", "positive"), ("64,36", "not a multiple"),
    ("64,12", "not a multiple"),
])
def test_bad_schedules_are_one_line_config_errors(spec, message):
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", spec, "--mse_pool_factor", "8"])
    with pytest.raises(common.ConfigError, match=message):
        cfg.validate()


def test_sizes_the_losses_cannot_take_and_scale_equivariance_are_refused():
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", "8,64", "--mse_pool_factor", "4"])
    with pytest.raises(common.ConfigError, match="below LPIPS' smallest input"):
        cfg.validate()
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", "16,64", "--do_ganloss"])
    with pytest.raises(common.ConfigError, match="below the critic's smallest input"):
        cfg.validate()
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", "32,64", "--scale_equivariance_prob", "0.5"])
    with pytest.raises(common.ConfigError, match="assumes one training latent size"):
        cfg.validate()
    run_setup.parse_config([*TINY, "--train_resolutions", "64", "--scale_equivariance_prob", "0.5"]).validate()
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", "32,64", "--vf_weight", "0.1"])
    with pytest.raises(common.ConfigError, match="--vf_weight aligns the latent"):
        cfg.validate()
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", "64;100:64,128", "--last_stage_trains", "1",
                               "--max_steps", "100"])
    cfg.validate()
    assert any("last stage starts at step 100 >= --max_steps 100" in line and "--last_stage_trains" in line
               for line in run_setup.config_warnings(cfg, {"train_resolutions", "last_stage_trains", "max_steps"}))


# ------------------------------------------------------------------------------------------ the data workers
def _shapes(loader, count):
    out = [tuple(next(loader).shape) for _ in range(count)]
    return out


@pytest.mark.parametrize("accum", [1, 2])
def test_loader_with_0_and_2_workers_gives_the_schedules_sizes_and_resumes_exactly(shard_url, accum):
    """Each micro-batch has its step's size and batch (step = batch index // grad_accum), with the data in the
    trainer's process or in 2 worker processes; a loader restored from a state saved after an odd number of batches
    (the workers rotated) continues bitwise as the uninterrupted one."""
    s = schedule()
    expected = [(s.batch_for(s.size_at(b // accum)), 3, s.size_at(b // accum), s.size_at(b // accum))
                for b in range(12)]
    for workers in (0, 2):
        loader = data.TrainLoader(shard_url, 64, 2, 42, 0, 1, workers, 8, schedule=s, grad_accum=accum)
        try:
            head = [next(loader) for _ in range(5)]
            state = loader.state_dict()
            tail = [next(loader) for _ in range(7)]
        finally:
            loader.close()
        assert [tuple(b.shape) for b in head + tail] == expected, workers
        resumed = data.TrainLoader(shard_url, 64, 2, 42, 0, 1, workers, 8, state=state, schedule=s,
                                   grad_accum=accum)
        try:
            again = [next(resumed) for _ in range(7)]
        finally:
            resumed.close()
        assert all(torch.equal(a, b) for a, b in zip(tail, again)), workers


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_with_another_grad_accum_keeps_each_steps_micro_batches_at_one_size(shard_url, workers):
    """The stream's position counts micro-batches; a run resumed with another --grad_accum continues from the
    trainer's step, so every micro-batch of a step still has that step's size (counting steps as batches //
    grad_accum from the start put 4 micro-batches of step 3 at 64 px where 48 was drawn, and split step 4 in two)."""
    s = schedule()
    loader = data.TrainLoader(shard_url, 64, 2, 42, 0, 1, workers, 8, schedule=s, grad_accum=2)
    try:
        [next(loader) for _ in range(6)]  # steps 0-2 at --grad_accum 2
        state = loader.state_dict()
    finally:
        loader.close()
    resumed = data.TrainLoader(shard_url, 64, 2, 42, 0, 1, workers, 8, state=state, schedule=s, grad_accum=4, step=3)
    try:
        sizes = [next(resumed).shape[-1] for _ in range(12)]  # steps 3-5 at --grad_accum 4
    finally:
        resumed.close()
    assert sizes == [s.size_at(step) for step in (3, 4, 5) for _ in range(4)]


def test_one_size_schedule_reads_todays_batches(shard_url):
    """--train_resolutions equal to --vae_resolution draws nothing: the very batches of the loader without it."""
    batches = {}
    for name, s in (("none", None), ("same", schedule("64")), ("empty", schedule(""))):
        loader = data.TrainLoader(shard_url, 64, 2, 42, 0, 1, 0, 8, schedule=s, grad_accum=2)
        try:
            batches[name] = [next(loader) for _ in range(6)]
        finally:
            loader.close()
    for name in ("same", "empty"):
        assert all(torch.equal(a, b) for a, b in zip(batches["none"], batches[name])), name


@pytest.mark.process
def test_a_default_run_is_bitwise_one_with_the_reference_size_as_its_schedule(shard_url, tmp_path, one_torch_thread):
    """In process: 3 steps of the default trainer and of one with --train_resolutions 64 (TINY's --vae_resolution)
    end in the same weights, optimizer moments and EMA."""
    states = {}
    for name, extra in (("default", []), ("schedule", ["--train_resolutions", "64"])):
        cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--run_name", name,
                                   *TINY, "--num_workers", "0", "--evaluate_every_n_steps", "0", "--max_steps", "3",
                                   "--save_every_n_steps", "100", "--log_every_n_steps", "100", *extra])
        cfg.validate()
        trainer = vae_trainer.Trainer(cfg, common.DistInfo())
        try:
            assert trainer.train() == 0
            states[name] = trainer.training.state_dict()
        finally:
            trainer.close()
    a, b = states["default"], states["schedule"]
    for key in ("vae", "ema"):
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    for pid, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][pid][k]) for k, v in state.items())


# ------------------------------------------------------------------------------------------ the memory check
def test_the_memory_check_judges_the_largest_size(shard_url, tmp_path, monkeypatch, one_torch_thread):
    """StepShape.to_check: every size with its micro-batch, the largest first (a smaller size holds more images:
    what does not grow with the pixels grows with them; the floor of one image holds more pixels). With as much memory as the reference step comfortably needs, a schedule reaching 512 px is
    refused, naming 512 px; the reference alone fits."""
    cfg = run_setup.parse_config([*TINY, "--train_resolutions", "32,48,64"])
    fp32 = config.Precision.of("fp32")
    shapes = memory.StepShape.to_check(data.ResolutionSchedule.of(cfg.data, cfg.optim.seed), cfg.optim, cfg.speed, fp32)
    assert [(s.resolution, s.batch_size) for s in shapes] == [(64, 2), (48, 4), (32, 8)]
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY, "--num_workers",
                                  "0", "--evaluate_every_n_steps", "0", "--memory_check", "false",
                                  "--train_resolutions", "64;2:64,512"])
    cfg.validate()
    shapes = memory.StepShape.to_check(data.ResolutionSchedule.of(cfg.data, cfg.optim.seed), cfg.optim, cfg.speed, fp32)
    assert [(s.resolution, s.batch_size) for s in shapes] == [(512, 1), (64, 2)]
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    try:
        reference = memory.StepShape.of(data.ResolutionSchedule.of(cfg.data, cfg.optim.seed), cfg.optim, cfg.speed,
                                        trainer.precision)
        needed = memory.estimate_step_memory(trainer.vae, trainer.objective, reference).total
        monkeypatch.setattr(memory, "available_memory", lambda device: (2 * needed, "RAM available"))
        verdict = memory.check_before_training(trainer.vae, trainer.objective, [reference], "cpu")
        assert (verdict.line, verdict.refuse) == (None, False)
        verdict = memory.check_before_training(trainer.vae, trainer.objective, shapes, "cpu")
        line, refuse = verdict.line, verdict.refuse
    finally:
        trainer.close()
    assert refuse and "batch 1 x 512 px" in line


# ------------------------------------------------------------------------------------------ real runs
def _args(url, out, run, steps, save, *extra):
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", str(save), "--log_every_n_steps", "2", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "20", *PLUMBING, "--train_resolutions", SCHEDULE, *extra]


def _records(folder, rank):
    with open(os.path.join(folder, f"batches_rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _same_checkpoints(a: str, b: str) -> None:
    ca, cb = (torch.load(p, weights_only=True) for p in (a, b))
    for entry in ("training", "adversary") if ca["adversary"] is not None else ("training",):
        for key in ("vae", "ema", "critic", "lecam"):
            if key in ca[entry] and ca[entry][key] is not None:
                for name, value in ca[entry][key].items():
                    assert torch.equal(value, cb[entry][key][name]), f"{entry}.{key}.{name}"
        for pid, state in ca[entry]["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, cb[entry]["optimizer"]["state"][pid][name]), f"{entry}[{pid}].{name}"
    for mine, theirs in zip(ca["run"]["ranks"], cb["run"]["ranks"]):  # the data streams' positions, torch's RNG
        assert mine["data"] == theirs["data"] and torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])


@pytest.mark.process
def test_stop_inside_the_schedule_and_across_its_stage_change_resumes_bitwise(shard_url, tmp_path, capfd,
                                                                            one_torch_thread):
    """One process, 2 data workers, the critic on: the run's step-3 checkpoint (inside the first stage, an odd
    number of batches read: the workers rotated) continued (conftest.cut_after) crosses the stage change at step 4
    and finishes. Every tensor of the step-7 checkpoint equals the uninterrupted run's. (A stop inside the last
    stage: the two-rank test above.) In-process: the runs' own main."""
    gan = ["--do_ganloss", "--disc_start", "1", "--lecam_weight", "0.1", "--discriminator", "patchgan",
           "--num_workers", "2"]  # (the critic's size floor is any critic's; the VGG16 one doubles the time)
    ref = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "ref", 7, 3, *gan), capfd)
    assert ref.returncode == 0, ref.stderr[-2000:]
    cut_after(tmp_path / "ref", tmp_path / "cut", 3)
    last = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "cut", 7, 100, *gan), capfd)
    assert last.returncode == 0 and "at step 3" in last.stdout, last.stderr[-2000:]
    _same_checkpoints(os.path.join(tmp_path, "ref", "checkpoints", "step_00000007.pt"),
                      os.path.join(tmp_path, "cut", "checkpoints", "step_00000007.pt"))


@pytest.mark.process
def test_two_ranks_train_every_step_at_one_size_and_the_last_stage_resumes_inside_it_bitwise(shard_url, tmp_path):
    """torchrun, 2 gloo ranks, --grad_accum 2, --last_stage_trains 1. Every micro-batch of a step, on both ranks, has
    the size the schedule draws for that step and its scaled batch; metrics.jsonl's train/resolution is each window's
    mean size. From the last stage's first step (4) only decoder.up.0, norm_out and conv_out change, the frozen
    parameters keep their AdamW moments; the run's step-5 checkpoint (inside the last stage) continued
    (conftest.cut_after), built frozen from its start, ends bitwise equal to the uninterrupted run, whose DDP wrapper
    was rebuilt at the stage change."""
    freeze = ["--last_stage_trains", "1", "--grad_accum", "2"]
    record = tmp_path / "record"
    record.mkdir()
    ref = run_cli("tests/recording_trainer.py", _args(shard_url, tmp_path, "ref", 6, 1, *freeze), nproc=2,
                  env=cli_env(VAE_TRAINER_RECORD=str(record)))
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
    assert "step 4: the last stage trains the decoder's 1 highest levels" in ref.stdout
    s = schedule()
    expected = [{"step": step, "shapes": [[s.batch_for(s.size_at(step)), 3, s.size_at(step), s.size_at(step)]] * 2}
                for step in range(6)]
    shapes = [[{k: r[k] for k in ("step", "shapes")} for r in _records(record, rank)] for rank in (0, 1)]
    assert shapes[0] == shapes[1] == expected
    assert len({s.size_at(step) for step in range(6)}) > 1  # the run did change sizes
    with open(tmp_path / "ref" / "metrics.jsonl") as f:
        logged = [json.loads(line)["train/resolution"] for line in f]
    assert logged == [(s.size_at(i) + s.size_at(i + 1)) / 2 for i in (0, 2, 4)]
    cut_after(tmp_path / "ref", tmp_path / "cut", 5)
    again = run_cli("vae_trainer.py", _args(shard_url, tmp_path, "cut", 6, 100, *freeze), nproc=2)
    assert again.returncode == 0 and "at step 5" in again.stdout, again.stderr[-3000:]
    assert "step 5: the last stage trains" in again.stdout
    _same_checkpoints(os.path.join(tmp_path, "ref", "checkpoints", "step_00000006.pt"),
                      os.path.join(tmp_path, "cut", "checkpoints", "step_00000006.pt"))

    import ae
    names = [n for n, _ in ae.AutoEncoder(AutoEncoderParams.from_config(run_setup.parse_config(TINY).model)).named_parameters()]
    top = ("decoder.up.0.", "decoder.norm_out.", "decoder.conv_out.")
    at = {step: torch.load(os.path.join(tmp_path, "ref", "checkpoints", f"step_{step:08d}.pt"), weights_only=True)
          ["training"] for step in (2, 4, 6)}
    for i, name in enumerate(names):
        trains = name.startswith(top)
        assert not torch.equal(at[2]["vae"][name], at[4]["vae"][name]), name  # every parameter trained before
        assert torch.equal(at[4]["vae"][name], at[6]["vae"][name]) != trains, name
        moments = (at[4]["optimizer"]["state"][i]["exp_avg"], at[6]["optimizer"]["state"][i]["exp_avg"])
        assert torch.equal(*moments) != trains, name  # frozen: its moments kept as they were


def test_the_ema_keeps_averaging_what_the_last_stage_froze(shard_url, tmp_path, one_torch_thread):
    """Issue 31 item 8: from the last stage on (--last_stage_trains 0: only norm_out and conv_out train) a frozen
    parameter no longer changes, and its EMA keeps converging on that fixed value, one (1 - decay) step of the gap per
    optimizer step, as before the freeze; a trained one keeps training. (A mutant that averaged only what still
    trains left the frozen ones' averages where the freeze found them, no test looking.)"""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY, "--num_workers", "0",
                               "--train_resolutions", "64;2:64", "--last_stage_trains", "0", "--max_steps", "4",
                               "--evaluate_every_n_steps", "0", "--perceptual_weight", "0", "--ema_decay", "0.9"])
    cfg.validate()
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    try:
        ema = trainer.training.ema
        frozen, trained = "encoder.conv_in.weight", "decoder.conv_out.weight"
        shadow = dict(zip(ema.names, ema.shadow))
        for step in range(4):
            trainer.before_step()
            before = {n: shadow[n].clone() for n in (frozen, trained)}
            param = dict(trainer.vae.named_parameters())
            weights = {n: param[n].detach().clone() for n in (frozen, trained)}
            trainer.train_step()
            trainer.step += 1
            if step >= 2:  # the last stage: the freeze came at its first step
                assert not param[frozen].requires_grad and param[trained].requires_grad
                assert torch.equal(param[frozen], weights[frozen])
                decay = min(0.9, (1 + step) / (10 + step))
                expected = before[frozen] + (1 - decay) * (weights[frozen] - before[frozen])
                assert not torch.equal(shadow[frozen], before[frozen])
                torch.testing.assert_close(shadow[frozen], expected, rtol=1e-6, atol=1e-7)
                assert not torch.equal(param[trained], weights[trained])
    finally:
        trainer.close()
