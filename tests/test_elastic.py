"""Resuming on another number of ranks, accumulation or data workers (issue 34): the images of step s depend on the
seed and s alone (data.TrainStream's lanes), so do a micro-batch's noise (vae_trainer.micro_seed) and the math that
combines micro-batches (GradNorm per micro-batch, LeCam's anchors once per step); --grad_accum follows the world
size so that a step keeps its micro-batches. The trainer under torchrun: the last tests."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import numpy as np
import pytest
import torch
from PIL import Image

import common
import config
import data
import shards
import sources
import utils
import vae_trainer
from conftest import (PLUMBING, ROOT, agent_command, agent_logs, cli_env, cut_after, free_port, kill_tree,
                      read_agent_logs, run_cli, run_in_process)

SLOTS = 4  # micro-batches per step
BATCH = 2  # images per micro-batch


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> str:
    """12 shards of 4 noise images each: more shards than the lanes (SLOTS x BATCH), so lanes own their shards."""
    src, dst = tmp_path_factory.mktemp("noise"), tmp_path_factory.mktemp("noise_shards")
    rng = np.random.default_rng(0)
    files = []
    for i in range(48):
        path = src / f"{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(path)
        files.append(str(path))
    paths, skipped = shards.write_shards(files, str(dst), shard_size=4, root=str(src))
    assert len(paths) == 12 and not skipped
    return sources.brace_url(paths)


def loader(url, rank, world, accum, workers, state=None, step=None, schedule=None):
    return data.TrainLoader(url, 32, BATCH, 7, rank, world, num_workers=workers, shuffle_buffer=6, state=state,
                            grad_accum=accum, step=step, schedule=schedule)


def steps_of(url, world, accum, workers, steps, state=None, schedule=None):
    """`steps` steps of a job of `world` ranks: per step its SLOTS micro-batches in index order (rank r holds
    r * accum ... r * accum + accum - 1), and the ranks' positions after them, merged."""
    ranks = [loader(url, r, world, accum, workers, state=state, schedule=schedule) for r in range(world)]
    try:
        out = [[next(ranks[j // accum]) for j in range(world * accum)] for _ in range(steps)]
        return out, data.merge_positions([r.state_dict() for r in ranks])
    finally:
        for r in ranks:
            r.close()


def same(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("url", ["many_shards", "shard_url"])  # lanes owning shards; fewer shards than lanes
def test_a_steps_images_depend_on_neither_the_ranks_nor_the_accumulation_nor_the_workers(url, request):
    url = request.getfixturevalue(url)
    reference, _ = steps_of(url, 1, SLOTS, 0, 3)
    flat = [b for step in reference for b in step]
    assert len({b.numpy().tobytes() for b in flat}) == len(flat)  # a stream, not one batch again and again
    for world, accum, workers in ((2, 2, 0), (4, 1, 0), (1, 4, 3), (2, 2, 2)):
        got, _ = steps_of(url, world, accum, workers, 3)
        assert same(got, reference), (world, accum, workers)


def test_a_stream_stopped_on_2_ranks_resumes_on_1_then_on_4_with_other_workers(many_shards):
    reference, _ = steps_of(many_shards, 2, 2, 0, 6)
    first, position = steps_of(many_shards, 2, 2, 2, 2)  # 2 ranks x accumulation 2, 2 workers each
    assert position["step"] == 2 and len(position["lanes"]) == SLOTS * BATCH
    second, position = steps_of(many_shards, 1, 4, 0, 2, state=position)  # 1 rank x 4, in the trainer's process
    third, _ = steps_of(many_shards, 4, 1, 1, 2, state=position)  # 4 ranks x 1, 1 worker each
    assert same(first + second + third, reference)


def test_the_schedules_sizes_and_batches_carry_over_too(shard_url):
    schedule = data.ResolutionSchedule.parse("24,32,40", 32, BATCH, seed=3)
    reference, _ = steps_of(shard_url, 1, SLOTS, 0, 5, schedule=schedule)
    assert len({step[0].shape for step in reference}) > 1
    first, position = steps_of(shard_url, 2, 2, 0, 2, schedule=schedule)
    rest, _ = steps_of(shard_url, 4, 1, 2, 3, state=position, schedule=schedule)
    assert same(first + rest, reference)


def test_another_number_of_micro_batches_per_step_starts_the_stream_afresh_and_says_so(many_shards):
    """--grad_accum given anew at the same world size changes the step (the user's choice): the lanes would own
    other shards, so the stream starts afresh from the seed and the step, which a later resume keeps exactly."""
    _, position = steps_of(many_shards, 1, 2, 0, 2)
    wider = loader(many_shards, 0, 1, 4, 0, state=position)
    try:
        assert wider.notes == ["the data stream was saved with 2 micro-batches per step, this run has 4: it starts "
                               "afresh at step 2"]
        head = [next(wider) for _ in range(4)]
        middle = wider.state_dict()
        tail = [next(wider) for _ in range(8)]
    finally:
        wider.close()
    assert all(b.shape[0] == BATCH for b in head + tail)
    again, _ = steps_of(many_shards, 2, 2, 1, 2, state=middle)
    assert same(again, [tail[:4], tail[4:]])


def run_entry(world: int, accum: int) -> tuple[str, dict]:
    return "run/checkpoints/step_00000010.pt", {"run": {"world_size": world, "config": {"grad_accum": accum}}}


def test_grad_accum_follows_the_world_size_so_that_a_step_keeps_its_micro_batches():
    cfg = config.with_values(config.Config(), grad_accum=2)
    lines = []
    for world, expect in ((1, 4), (4, 1), (2, 2)):
        info = common.DistInfo(world_size=world)
        assert vae_trainer.micro_batches_kept(cfg, run_entry(2, 2), info, lines.append).optim.grad_accum == expect
    assert lines[0].startswith("note: run/checkpoints/step_00000010.pt was written by 2 ranks x --grad_accum 2; "
                               "on 1 ranks --grad_accum 4 keeps its 4 micro-batches")
    assert len(lines) == 2  # nothing to say on the same world size
    with pytest.raises(common.ConfigError, match="4 micro-batches per step, which 3 ranks cannot share"):
        vae_trainer.micro_batches_kept(cfg, run_entry(2, 2), common.DistInfo(world_size=3), print)
    # an elastic relaunch repeats the first command: its --grad_accum (2) after a run that went on at 1 x 4 is set
    # aside on 4 ranks; on the same world size a --grad_accum given anew is the user's (the continuing note says)
    lines.clear()
    kept = vae_trainer.micro_batches_kept(cfg, run_entry(1, 4), common.DistInfo(world_size=4), lines.append)
    assert kept.optim.grad_accum == 1 and lines[0].endswith("(--grad_accum 2 set aside: another step is chosen on "
                                                            "the same number of ranks)")
    given = config.with_values(cfg, grad_accum=3)
    assert vae_trainer.micro_batches_kept(given, run_entry(2, 2), common.DistInfo(world_size=2), print) is given
    assert vae_trainer.micro_batches_kept(cfg, None, common.DistInfo(world_size=3), print) is cfg


def test_a_micro_batchs_noise_seed_is_its_index_in_the_step_not_its_rank():
    seeds = {vae_trainer.micro_seed(0, step, index) for step in range(50) for index in range(8)}
    assert len(seeds) == 400  # distinct per (step, index)
    assert vae_trainer.micro_seed(0, 3, 5) == vae_trainer.micro_seed(0, 3, 5) != vae_trainer.micro_seed(1, 3, 5)


def test_gradnorm_normalises_each_micro_batch_by_its_own_norm():
    """No collective: the scale is the micro-batch's own, which is what makes a step's gradient the same on any
    number of ranks (a mean over ranks computing at the same time would tie it to the world size)."""
    x = torch.randn(3, 5, requires_grad=True)
    grad = torch.randn(3, 5)
    utils.gradnorm(x, 2.0).backward(grad)
    torch.testing.assert_close(x.grad, grad * 2.0 / grad.norm())


def test_lecams_anchors_move_once_per_step_by_the_mean_of_its_micro_batches():
    lecam = utils.LeCam(decay=0.9)
    logits = [(torch.full((4,), r), torch.full((4,), f)) for r, f in ((1.0, -1.0), (3.0, -3.0))]
    lecam.update(*logits[0])
    lecam.commit(torch.zeros((), dtype=torch.bool))  # the first step sets the anchors
    assert (lecam.ema_real.item(), lecam.ema_fake.item()) == (1.0, -1.0)
    for real, fake in logits:  # a step of two micro-batches: each penalty sees the step's start moved by its own
        lecam.update(real, fake)
        assert lecam.pending[0].item() == pytest.approx(0.9 * 1.0 + 0.1 * real[0].item())
    lecam.commit(torch.zeros((), dtype=torch.bool))
    assert lecam.ema_real.item() == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)  # by the mean of 1 and 3, in any order
    assert lecam.ema_fake.item() == pytest.approx(0.9 * -1.0 + 0.1 * -2.0)
    lecam.update(*logits[1])
    lecam.commit(torch.ones((), dtype=torch.bool))  # a skipped step leaves them
    assert lecam.ema_real.item() == pytest.approx(1.1) and lecam.pending is None and lecam.sums is None


# --------------------------------------------------------------------------------------------
# the trainer under torchrun: 2 ranks -> 1 -> 4
# --------------------------------------------------------------------------------------------
def elastic_args(url, out, run, steps, *extra):
    """Checkpoints every step, the last 2 kept; pixel losses (conftest.PLUMBING) and the PatchGAN critic: what
    resumes and what the ranks agree on is the same with LPIPS and the VGG16 critic, at half the time. NCHW (a
    sharded VAE's layout: the hsdp job below draws the latent noise of the ddp reference, which on a CPU would
    otherwise be channels_last)."""
    critic = ["--do_ganloss", "--disc_start", "1", "--lecam_weight", "0.1", "--discriminator", "patchgan"]
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", "1", "--log_every_n_steps", "1", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "2", *PLUMBING, *critic, "--latent_noise_prob", "0.5", "--latent_noise_max", "0.2",
            "--num_threads", "1", "--channels_last", "false", *extra]
            # one torch thread everywhere: the automatic count follows the ranks per node, and with it the sums' order


@pytest.fixture(scope="module")
def reference(shard_url, tmp_path_factory):
    """The uninterrupted run the torchrun tests continue or repeat: 2 ranks x --grad_accum 2, 6 steps, every step
    recorded (tests/recording_trainer.py), logged and saved. Returns (its output folder, its record folder). (Its
    tests are one xdist group: built once.)"""
    out = tmp_path_factory.mktemp("elastic_reference")
    (out / "record").mkdir()
    ref = run_cli("tests/recording_trainer.py", elastic_args(shard_url, out, "ref", 6, "--grad_accum", "2",
                                                            "--num_workers", "0", "--keep_last_k", "20"),
                  nproc=2, env=cli_env(VAE_TRAINER_RECORD=str(out / "record")))
    assert ref.returncode == 0, ref.stderr[-3000:]
    for name in os.listdir(out / "ref" / "checkpoints"):  # the step the 2 -> 1 -> 4 test continues: 2; those
        # same_step compares with: 3 and 5
        if name.startswith("step_") and name not in ("step_00000002.pt", "step_00000003.pt", "step_00000005.pt"):
            os.remove(out / "ref" / "checkpoints" / name)
    return out, out / "record"


def step_images(folder) -> dict[int, list[str]]:
    """{step: the digests of its micro-batches in index order}, from every rank's record."""
    steps: dict[int, dict[int, str]] = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                r = json.loads(line)
                steps.setdefault(r["step"], {}).update({r["first"] + i: d for i, d in enumerate(r["digests"])})
    return {step: [slots[j] for j in sorted(slots)] for step, slots in steps.items()}


def logged(run_dir) -> dict[int, dict]:
    """{step index: its logged losses} (metrics.jsonl counts steps done)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"] - 1: {k: v for k, v in r.items() if k.startswith("loss/")} for r in rows}


def same_step(run_dir, other_dir, index: int) -> None:
    """Step `index` of two runs that start it from the same weights on different topologies: the same losses and
    the same gradients (the AdamW moments it leaves, in norm) up to the order of the fp32 sums. (The weights are
    not compared: Adam moves a weight whose gradient is about 0 by about lr either way, so any two orders of the
    same sums part there, as two uninterrupted runs on 2 and 4 ranks do.)"""
    for key, value in logged(other_dir)[index].items():
        assert logged(run_dir)[index][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (index, key)
    a, b = (torch.load(os.path.join(d, "checkpoints", f"step_{index + 1:08d}.pt"), weights_only=True)
            for d in (run_dir, other_dir))
    for entry in ("training", "adversary"):
        for pid, state in a[entry]["optimizer"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                ours, theirs = state[name], b[entry]["optimizer"]["state"][pid][name]
                assert (ours - theirs).norm() <= 1e-5 * theirs.norm() + 1e-12, (index, entry, pid, name)


@pytest.mark.xdist_group("elastic_reference")  # shares the reference fixture: built once
@pytest.mark.process
@pytest.mark.timeout(600)
def test_a_run_stopped_on_2_ranks_continues_on_1_then_on_4_with_the_same_steps(shard_url, tmp_path, reference, capfd,
                                                                             one_torch_thread):
    """torchrun, gloo: the uninterrupted 2 ranks x --grad_accum 2 run stopped after step 2 (its own checkpoint and
    record, conftest.cut_after), continued on 1 rank (--grad_accum follows: 4) with 2 data workers for 2 steps, then
    on 4 ranks (--grad_accum 1) without workers; the GAN with LeCam from step 1 and the latent noise on. Every step
    trains on the images of the uninterrupted 2-rank run's step, micro-batch by micro-batch, and the first step on
    each new topology computes what the old one computes from the same checkpoint (the uninterrupted run; a 1-rank
    control, in this process: one rank is the same computation without torchrun), up to the order of the fp32 sums
    (same_step)."""
    import shutil
    ref_dir, ref_record = reference[0] / "ref", reference[1]
    cut_after(ref_dir, tmp_path / "cut", 2)
    cut_record = tmp_path / "cut_record"
    cut_record.mkdir()
    for name in os.listdir(ref_record):  # the record of its steps 0 and 1
        with open(ref_record / name) as f:
            (cut_record / name).write_text("".join(line for line in f if json.loads(line)["step"] < 2))
    env = cli_env(VAE_TRAINER_RECORD=str(cut_record))
    # every relaunch repeats the first command (elastic_args, --grad_accum 2 included), as an elastic restart does
    one = run_cli("tests/recording_trainer.py", elastic_args(shard_url, tmp_path, "cut", 4, "--grad_accum", "2",
                                                            "--num_workers", "2"), nproc=1, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    assert ("was written by 2 ranks x --grad_accum 2; on 1 ranks --grad_accum 4 keeps its 4 micro-batches per step"
            in one.stdout), one.stdout[-3000:]
    same_step(tmp_path / "cut", ref_dir, 2)  # 1 rank x 4 from the 2 x 2 run's checkpoint (its steps 3-4 kept)
    shutil.copytree(tmp_path / "cut", tmp_path / "control")
    control = run_in_process(vae_trainer.main, elastic_args(shard_url, tmp_path, "control", 5), capfd)
    assert control.returncode == 0 and "was written by" not in control.stdout, control.stderr[-3000:]
    four = run_cli("tests/recording_trainer.py", elastic_args(shard_url, tmp_path, "cut", 6, "--grad_accum", "2",
                                                             "--num_workers", "0"), nproc=4, env=env)
    assert four.returncode == 0, four.stderr[-3000:]
    assert ("on 4 ranks --grad_accum 1 keeps its 4 micro-batches per step (the same images and noise) (--grad_accum 2 "
            "set aside" in four.stdout), four.stdout[-3000:]
    assert "warning" not in one.stderr + four.stderr, one.stderr + four.stderr
    images = step_images(ref_record)
    assert len(images) == 6 and all(len(set(step)) == 4 for step in images.values())
    assert step_images(cut_record) == images
    with open(tmp_path / "cut" / "metrics.jsonl") as f:  # the reference's rows after step 2 gone, each step once
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]
    same_step(tmp_path / "cut", tmp_path / "control", 4)  # 4 ranks x 1 from the 1 x 4 run's checkpoint


@pytest.mark.process
def test_the_trainer_resumes_bitwise_across_data_worker_counts(shard_url, tmp_path, one_torch_thread):
    """One rank, --grad_accum 2, the latent noise on: 2 steps with the data in the trainer's process (the
    uninterrupted run's, conftest.cut_after), 2 more with 2 data workers, 2 more with 1; every tensor of the step-6
    checkpoint equals the uninterrupted run's (before issue 34 another worker count restarted the stream from a new
    seed). The critic: the torchrun tests below."""
    from test_trainer import in_process_trainer
    flags = ["--grad_accum", "2", "--save_every_n_steps", "2", "--latent_noise_prob", "0.5",
             "--latent_noise_max", "0.2", "--perceptual_weight", "0",  # (no state of LPIPS's to resume)
             "--min_lr_ratio", "1"]  # no decay: each part's --max_steps leaves the schedule as the whole run's

    def run(out, steps, workers):
        trainer = in_process_trainer(shard_url, out, *flags, "--max_steps", str(steps), "--num_workers", str(workers))
        try:
            assert trainer.train() == 0
        finally:
            trainer.close()

    run(tmp_path / "ref", 6, 0)
    cut_after(tmp_path / "ref" / "vae", tmp_path / "cut" / "vae", 2)
    for steps, workers in ((4, 2), (6, 1)):
        run(tmp_path / "cut", steps, workers)
    a, b = (torch.load(tmp_path / run_dir / "vae" / "checkpoints" / "step_00000006.pt", weights_only=True)
            for run_dir in ("ref", "cut"))
    for key in ("vae", "ema"):
        for name, value in a["training"][key].items():
            assert torch.equal(value, b["training"][key][name]), f"{key}.{name}"
    assert a["run"]["ranks"][0]["data"] == b["run"]["ranks"][0]["data"]


@pytest.mark.process
@pytest.mark.timeout(300)
# hsdp only: DDP's single-file checkpoint read by another world size is the test above's, and an agent restarting
# a DDP job the kill tests' (test_fault_tolerance); a ddp variant of this one added a minute and no failure of its own
@pytest.mark.parametrize("sharding", ["hsdp"])
@pytest.mark.xdist_group("elastic_reference")  # shares the reference fixture: built once
def test_an_elastic_job_that_loses_a_node_continues_on_the_other_with_the_same_steps(shard_url, tmp_path, sharding,
                                                                                     reference):
    """Two torchrun agents as two nodes on loopback, `--nnodes=1:2` (the README's multi-node recipe made elastic),
    one rank each, --grad_accum 2, the latent noise and the critic on. Once the step-2 checkpoint is written, node 1
    goes away (its agent and worker killed); node 0's agent restarts its worker, the job re-forms with one node,
    --grad_accum becomes 4, and the run finishes with every step's images those of the uninterrupted two-rank run
    (the reference), and the first step after the loss equal to that run's step up to the order of the fp32 sums
    (losses to 1e-5). hsdp: shards within a node (one rank here), replicas across the two: the step-2 checkpoint is
    the directory both nodes wrote (DCP), which the one remaining process reads whole."""
    import shutil
    ref_dir, ref_record = reference[0] / "ref", reference[1]
    record = tmp_path / "record"
    record.mkdir()
    args = elastic_args(shard_url, tmp_path, "nodes", 6, "--grad_accum", "2", "--num_workers", "0",
                        "--save_every_n_steps", "2", "--sharding", sharding)
    port = free_port()
    node = agent_command(port, "elastic", "tests/recording_trainer.py", args, nnodes="1:2",
                         rdzv_conf="last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5")
    env = cli_env(VAE_TRAINER_RECORD=str(record))
    logs = agent_logs(tmp_path)
    # node 0 first: the agent that binds the endpoint hosts the rendezvous store (on a cluster, the head node's),
    # which must outlive node 1
    nodes = [subprocess.Popen(node, stdout=logs[0][0], stderr=logs[0][1], text=True, env=env, cwd=ROOT)]
    checkpoint = tmp_path / "nodes" / "checkpoints" / ("step_00000002.pt" if sharding == "ddp" else
                                                      "step_00000002/rest.pt")
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and nodes[0].poll() is None:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        nodes.append(subprocess.Popen(node, stdout=logs[1][0], stderr=logs[1][1], text=True, env=env, cwd=ROOT))
        while not checkpoint.exists() and time.monotonic() < deadline and nodes[0].poll() is None:
            time.sleep(0.2)
        assert checkpoint.exists(), "no step-2 checkpoint"
        kill_tree(nodes[1])  # the node goes away: its agent and its worker
        nodes[0].wait(timeout=max(1.0, deadline + 90 - time.monotonic()))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                kill_tree(proc)
    outputs = [out + err for out, err in read_agent_logs(logs)]
    assert nodes[0].returncode == 0, outputs[0][-4000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", outputs[0])
    assert resumed and "on 1 ranks --grad_accum 4 keeps its 4 micro-batches per step" in outputs[0], outputs[0][-4000:]
    assert step_images(record) == step_images(ref_record)
    at = int(resumed.group(1))
    # the two nodes' sums (an all-reduce of 2 replicas) round as the reference's two ddp ranks' do: 2e-7 seen
    for key, value in logged(ref_dir)[at].items():
        assert logged(tmp_path / "nodes")[at][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    shutil.rmtree(tmp_path / "nodes" / "checkpoints")  # free the disk early
