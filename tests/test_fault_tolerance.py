"""Fault injection on CPU: exact resume (1 and 2 ranks), SIGKILL under torchrun restarts, SIGTERM,
truncated checkpoints, non-finite steps, hostile data, unsafe checkpoints, incompatible run dirs, secrets."""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
import torch
from PIL import Image

import run_log
import vae_trainer
from conftest import (FAULTY, PLUMBING, ROOT, agent_command, agent_logs, cli_command, cli_env, faults_in_process,
                      free_port, kill_tree, read_agent_logs, run_cli, run_in_process)
import ae
import common
import config
import run_setup
from ae import AutoEncoderParams

# the tests here run the real CLI, most under torchrun, 20 s to 2 minutes each (with a module fixture's
# reference run): a hang fails that test
pytestmark = pytest.mark.timeout(480)

GAN = ["--do_ganloss", "--disc_start", "1", "--lecam_weight", "0.1"]
# the fault tests' GAN: the small PatchGAN critic. Their point is the ranks' agreement and an exact resume of whatever
# the state holds; the VGG16 critic (the default: 4.5 s a step here instead of 2.7, and a 190 MB checkpoint instead of
# 46) keeps its exact resume in test_sigterm_then_resume_equals_uninterrupted_single_process (RECIPE)
GAN_2 = [*GAN, "--discriminator", "patchgan"]
# the whole recipe (LPIPS, the VGG16 critic): _args trains pixel losses only (conftest.PLUMBING)
RECIPE = [*GAN, "--perceptual_weight", "1"]


def _args(url, out, run="r", steps=8, save=2, *extra):
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", str(save), "--log_every_n_steps", "2", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "20", *PLUMBING, *extra]


def _ckpt(out, run, step):
    return torch.load(os.path.join(out, run, "checkpoints", f"step_{step:08d}.pt"), weights_only=True)


def _assert_same_state(a: dict, b: dict) -> None:
    """Bitwise: weights, EMA, critic, LeCam anchors, optimizer moments and step counts."""
    for entry, key in (("training", "vae"), ("training", "ema"), ("adversary", "critic"), ("adversary", "lecam")):
        assert a[entry][key].keys() == b[entry][key].keys()
        for name in a[entry][key]:
            assert torch.equal(a[entry][key][name], b[entry][key][name]), f"{entry}.{key}.{name} differs"
    for entry in ("training", "adversary"):
        for pid, state in a[entry]["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, b[entry]["optimizer"]["state"][pid][name]), f"{entry}[{pid}].{name} differs"
    assert a["run"]["step"] == b["run"]["step"] and a["training"]["scheduler"] == b["training"]["scheduler"]


def _metrics(out, run) -> list[dict]:
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------ exact resume
@pytest.mark.process
def test_sigterm_then_resume_equals_uninterrupted_single_process(shard_url, tmp_path, capfd, one_torch_thread):
    """The stopped run is a process that gets a real SIGTERM; the uninterrupted run and the same command run again
    (which resumes) are vae_trainer.main in this process, bitwise the same computation."""
    ref = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "ref", 4, 4, *RECIPE), capfd)
    assert ref.returncode == 0, ref.stderr[-2000:]

    # SIGTERM arrives during step 2 (from 0): the step finishes, a checkpoint is written, exit 0
    first = run_cli(FAULTY, _args(shard_url, tmp_path, "cut", 4, 100, *RECIPE),
                    env=cli_env(VAE_TRAINER_SIGTERM_AT="2"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "received signal 15: checkpoint written at step 3" in first.stdout
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["latest", "step_00000003.pt"]

    again = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "cut", 4, 2, *RECIPE), capfd)  # auto-resume
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout and "at step 3" in again.stdout
    _assert_same_state(_ckpt(tmp_path, "ref", 4), _ckpt(tmp_path, "cut", 4))
    # the resumed run's metrics continue the file: one record per logged step (the stopped run's step 3 logged
    # nothing), none duplicated
    assert [r["step"] for r in _metrics(tmp_path, "cut")] == [2, 4]


@pytest.fixture(scope="session")  # not per module: xdist interleaves modules, which rebuilt it 3 times
def two_rank_reference(shard_url, tmp_path_factory):
    """6 steps on 2 ranks, saved at steps 3 (what a stop after step 3 must save) and 6."""
    out = tmp_path_factory.mktemp("ref2")
    proc = run_cli("vae_trainer.py", _args(shard_url, out, "ref", 6, 3, *GAN_2), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.xdist_group("two_rank_reference")  # shares the two_rank_reference fixture: built once
@pytest.mark.process
def test_sigkill_of_one_rank_restarts_and_matches_uninterrupted(shard_url, tmp_path, two_rank_reference):
    """kill -9 of rank 1 at step 3 under torchrun --max-restarts=1: the group restarts, resumes from the
    step-2 checkpoint, finishes, and ends bitwise equal to the uninterrupted run."""
    proc = run_cli(FAULTY, _args(shard_url, tmp_path, "killed", 6, 2, *GAN_2), nproc=2,
                   extra_torchrun=["--max-restarts=1"], env=cli_env(VAE_TRAINER_KILL_AT="3@1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # the agent saw the SIGKILL
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    _assert_same_state(_ckpt(two_rank_reference, "ref", 6), _ckpt(tmp_path, "killed", 6))


@pytest.mark.xdist_group("two_rank_reference")  # shares the two_rank_reference fixture: built once
@pytest.mark.process
@pytest.mark.timeout(300)
def test_two_nodes_one_killed_worker_re_form_resume_and_match_uninterrupted(shard_url, tmp_path, two_rank_reference):
    """The README's multi-node recipe on loopback: two torchrun agents as two nodes (--nnodes=2, one process
    each, c10d rendezvous on 127.0.0.1, the README's --max-restarts=3). kill -9 of rank 1's worker at step 3: both
    agents re-form the job, it resumes from the step-2 checkpoint and ends bitwise equal to the uninterrupted
    two-rank run (world size 2 either way). The agent of the surviving node may restart its worker for the
    membership change without counting it, so the nodes' TORCHELASTIC_RESTART_COUNT can differ from then on: the
    workers must meet all the same (test_workers_meet_when_the_nodes_restart_counts_differ; a namespace named by
    that count hung this test in a loaded CI run)."""
    port = free_port()
    node = agent_command(port, "two_nodes", FAULTY, _args(shard_url, tmp_path, "nodes", 6, 2, *GAN_2))
    env = cli_env(VAE_TRAINER_KILL_AT="3@1")
    logs = agent_logs(tmp_path)  # the agents' tracebacks of the killed attempt would fill a pipe
    nodes = [subprocess.Popen(node, stdout=o, stderr=e, text=True, env=env, cwd=ROOT) for o, e in logs]
    deadline, timed_out = time.monotonic() + 240, False
    try:
        for proc in nodes:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for proc in nodes:
            if proc.poll() is None:
                kill_tree(proc)
    outputs = read_agent_logs(logs)
    out, err = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
    assert not timed_out, "the agents were still running after 240 s:\n" + out[-2000:] + err[-4000:]
    assert [proc.returncode for proc in nodes] == [0, 0], out[-2000:] + err[-4000:]
    assert "exitcode: -9" in err  # an agent saw its worker killed
    assert "resumed from" in out and "at step 2" in out
    _assert_same_state(_ckpt(two_rank_reference, "ref", 6), _ckpt(tmp_path, "nodes", 6))


WORKER = ("import common, torch, torch.distributed as dist\n"
          "info = common.init_distributed()\n"
          "t = torch.tensor([info.rank + 1.0])\n"
          "dist.all_reduce(t)\n"
          "print('sum', int(t.item()), flush=True)\n"
          "common.close_distributed(info)\n")


def test_a_run_in_process_gives_back_the_signal_handlers_it_took(shard_url, tmp_path, one_torch_thread):
    """vae_trainer.main in a program's own process (a notebook, a test): the handlers of SIGINT and SIGTERM it
    replaced with its stop flag's are back when it returns. Before, the finished run's flag kept them: the first
    Ctrl-C afterwards asked that run to stop, and the program went on."""
    def mine(signum, frame):
        pass
    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert vae_trainer.main(_args(shard_url, tmp_path, "r", 1, 1)) == 0
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_the_kept_handlers_include_the_wakeup_fd_a_ranks_stop_watch_takes():
    """Under torchrun a rank's stop flag also watches the signals through the wakeup fd (common.signal_watch): the
    program's own wakeup fd is back too when the run returns."""
    class Store:
        def set(self, key, value):
            pass
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with common.signal_handlers_kept():
            common.StopFlag(common.DistInfo(rank=0, world_size=2, store=Store()))
            watch = signal.set_wakeup_fd(-1)  # (read by setting it: put back at once)
            signal.set_wakeup_fd(watch)
            assert watch not in (-1, write_fd)  # the watch's, until the run returns
        assert signal.set_wakeup_fd(previous) == write_fd
        assert {sig: signal.getsignal(sig) for sig in before} == before
    finally:
        signal.set_wakeup_fd(previous)
        for sig, handler in before.items():
            signal.signal(sig, handler)
        os.close(read_fd), os.close(write_fd)


@pytest.mark.process
def test_workers_meet_when_the_nodes_restart_counts_differ(tmp_path):
    """Two attempts of a two-rank job on one store kept across them, as torchrun's agents keep theirs. In the
    second the ranks' TORCHELASTIC_RESTART_COUNT differ (0 and 1: the surviving node's agent restarted its worker
    for a membership change without counting it, the failed node's agent counted) and rank 1 starts first, with
    the first attempt's keys still in the store. The ranks must still form the group. With a namespace named by the
    restart count, rank 0 read rank 1's address from the first attempt and failed to connect (and rank 1, in the
    other namespace, waited for a rank 0 that never came)."""
    from datetime import timedelta

    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)

    def attempt(counts, rank0_delay_s):
        procs = {}
        for rank in (1, 0):
            env = cli_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=server.port, TORCHELASTIC_USE_AGENT_STORE="True",
                          TORCHELASTIC_RESTART_COUNT=counts[rank])
            if rank == 0:
                time.sleep(rank0_delay_s)
            procs[rank] = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        procs = [procs[0], procs[1]]
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=60))
            except subprocess.TimeoutExpired:
                for p in procs:
                    kill_tree(p)
                pytest.fail(f"the ranks did not meet within 60 s (restart counts {counts})")
            assert proc.returncode == 0, outs[-1][1][-2000:]
        assert [out.strip() for out, _ in outs] == ["sum 3", "sum 3"]

    attempt([0, 0], 0.0)
    attempt([0, 1], 3.0)  # rank 0 starts 3 s after rank 1, which meanwhile reads the first attempt's keys


def gloo_threads() -> int:
    """The worker threads of the live gloo process groups in this process (torch names them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def one_rank_job(monkeypatch) -> None:
    """The environment torchrun gives a job of one rank: the entry points form a real gloo group of one."""
    env = dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))


def test_closing_the_process_groups_ends_their_threads(monkeypatch):
    """destroy_process_group() left a group referenced by the DistInfo alive, and its gloo threads ran on into the
    interpreter's exit: a thread still releasing a finished all_reduce's tensors then aborted the process
    ("terminate called without an active exception", exit -6: CI's failure in the test above)."""
    import torch.distributed as dist
    one_rank_job(monkeypatch)
    before = gloo_threads()
    info = common.init_distributed()
    t = torch.ones(1)
    dist.all_reduce(t, group=info.ctrl_group)
    assert gloo_threads() > before  # the group runs its threads
    common.close_distributed(info)
    assert gloo_threads() == before and not dist.is_initialized()


@pytest.mark.parametrize("ending", ["finished", "a bug"])
def test_the_trainer_ends_its_process_groups_before_it_returns(shard_url, tmp_path, monkeypatch, ending):
    """The trainer's DDP modules hold the group too, and an escaping error's traceback holds the trainer's frames
    (and at the top level to the interpreter's exit): when main() returns or raises, no group may be left running.
    (A job of one rank runs the code of many: DDP, the stop agreement, the gathers.)"""
    one_rank_job(monkeypatch)
    monkeypatch.setattr(common.DistInfo, "distributed", property(lambda self: True))
    before = gloo_threads()
    if ending == "finished":
        assert vae_trainer.main(_args(shard_url, tmp_path, "r", 1, 1, *GAN_2)) == 0
        assert (tmp_path / "r" / "checkpoints" / "step_00000001.pt").exists()
    else:
        def a_bug(self):
            raise RuntimeError("a bug")
        monkeypatch.setattr(vae_trainer.Trainer, "train", a_bug)
        with pytest.raises(RuntimeError, match="a bug"):
            vae_trainer.main(_args(shard_url, tmp_path, "r", 1, 1, *GAN_2))
    assert gloo_threads() == before


@pytest.mark.xdist_group("two_rank_reference")  # shares the two_rank_reference fixture: built once
@pytest.mark.process
def test_sigterm_on_one_rank_stops_all_after_the_same_step_and_saves_it(shard_url, tmp_path, two_rank_reference):
    """Preemption seen by rank 1 only: the ranks agree to stop after the same step, save, exit 0. What they saved is
    the uninterrupted run's step-3 checkpoint bitwise: the state, each rank's data position and torch RNG (what a
    resume continues from; resumes from such a checkpoint: the SIGKILL tests, test_elastic). (Python's and NumPy's
    global generators, also saved, nothing in the trainer draws from or seeds: any two processes differ there.)"""
    first = run_cli(FAULTY, _args(shard_url, tmp_path, "pre", 6, 100, *GAN_2), nproc=2,
                    env=cli_env(VAE_TRAINER_SIGTERM_AT="2@1"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "checkpoint written at step 3" in first.stdout
    ref, stopped = _ckpt(two_rank_reference, "ref", 3), _ckpt(tmp_path, "pre", 3)
    _assert_same_state(ref, stopped)
    assert len(ref["run"]["ranks"]) == len(stopped["run"]["ranks"]) == 2
    for ours, theirs in zip(ref["run"]["ranks"], stopped["run"]["ranks"]):
        assert ours["data"] == theirs["data"] and torch.equal(ours["rng"]["torch"], theirs["rng"]["torch"])


@pytest.mark.process
def test_external_sigterm_writes_checkpoint_and_exits_0(shard_url, tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "vae_trainer.py"), *_args(shard_url, tmp_path, "term", 100000, 100000)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)
    for line in proc.stdout:  # wait until it trains
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "received signal 15" in out
    ckpts = [f for f in os.listdir(tmp_path / "term" / "checkpoints") if f.endswith(".pt")]
    assert len(ckpts) == 1
    state = torch.load(tmp_path / "term" / "checkpoints" / ckpts[0], weights_only=True)
    assert 2 <= state["run"]["step"] < 100000


def _sigterm_process_group(cmd: list[str], after_line: str) -> tuple[int, str, str]:
    """Start `cmd` in a process group of its own, wait for a stdout line starting with `after_line`, then
    SIGTERM the whole group, as SLURM (preemption, time limit) and `timeout` do: data workers included."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith(after_line):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    except BaseException:
        kill_tree(proc)
        raise
    return proc.returncode, out, err


@pytest.mark.process
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [0, 2], ids=["python", "torchrun"])
def test_sigterm_to_the_process_group_saves_and_the_same_command_resumes(shard_url, tmp_path, nproc, capfd,
                                                                         one_torch_thread):
    """Before: the data workers died of the SIGTERM and the main process with "DataLoader worker (pid N)
    is killed by signal: Terminated", without a checkpoint. Under torchrun the signal reaches the agent,
    which forwards it to each rank's process group (data workers included) and gives the ranks 30 s."""
    args = _args(shard_url, tmp_path, "pre", 8, 100)
    code, out, err = _sigterm_process_group(cli_command("vae_trainer.py", args, nproc), "step 2/8")
    assert "DataLoader worker" not in err and "RuntimeError" not in err, err[-3000:]
    stopped = re.search(r"received signal 15: checkpoint written at step (\d+), exiting", out)
    assert stopped, out[-2000:] + err[-2000:]
    step = int(stopped.group(1))
    assert 2 <= step < 8  # the step it was at: the one after "step 2/8" was printed, or the next
    assert [f for f in os.listdir(tmp_path / "pre" / "checkpoints") if f.endswith(".pt")] == [f"step_{step:08d}.pt"]
    if nproc:
        # torchrun's agent itself exits with code 1 and its own SignalException traceback (README: Fault
        # tolerance); the ranks exited on their own within its grace period (no SIGKILL)
        assert code == 1 and "got signal: 15" in err, err[-3000:]
        assert "forcefully exiting" not in err, err[-3000:]
    else:
        assert code == 0, err[-3000:]
    # the same command, as a requeued job runs it (one process: its main, in this process)
    again = run_cli("vae_trainer.py", args, nproc=nproc) if nproc else run_in_process(vae_trainer.main, args, capfd)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step_{step:08d}.pt at step {step}" in again.stdout
    assert _ckpt(tmp_path, "pre", 8)["run"]["step"] == 8


@pytest.mark.process
@pytest.mark.timeout(240)
def test_ctrl_c_behind_a_dead_pipe_saves_exits_0_and_resumes(shard_url, tmp_path, capfd, one_torch_thread):
    """`./train.sh 2>&1 | tee log` and Ctrl-C (issue 31 item 0): the terminal signals the whole foreground group, `tee`
    dies too, and the trainer's next lines meet a closed pipe. Before, its print raised BrokenPipeError: after the
    checkpoint (exit 1), or in a step's log line before it (no checkpoint, the steps since the last one lost). Here
    the reader goes first, the trainer notices at its next line (train.log says so), then SIGINT reaches the group:
    checkpoint, exit 0, and the same command resumes from it (its main, in this process)."""
    args = _args(shard_url, tmp_path, "piped", 100000, 100000) + ["--log_every_n_steps", "1"]
    proc = subprocess.Popen(cli_command("vae_trainer.py", args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=cli_env(), cwd=ROOT, start_new_session=True)
    log = tmp_path / "piped" / "train.log"
    try:
        for line in proc.stdout:
            if line.startswith(b"step 2/"):
                break
        proc.stdout.close()  # the reader dies; the trainer's next line meets the closed pipe
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None and "the console (stdout) was lost" not in (
                log.read_text() if log.exists() else ""):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole group, data workers included
        code = proc.wait(timeout=120)
    except BaseException:
        kill_tree(proc)
        raise
    text = log.read_text()
    assert "warning: the console (stdout) was lost (BrokenPipeError" in text, text[-2000:]
    stopped = re.search(r"received signal 2: checkpoint written at step (\d+), exiting", text)
    assert code == 0 and stopped, text[-2000:]
    step = int(stopped.group(1))
    assert _ckpt(tmp_path, "piped", step)["run"]["step"] == step
    assert [r["step"] for r in _metrics(tmp_path, "piped") if "loss/total" in r] == list(range(1, step + 1))
    again = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "piped", step + 1, 100000), capfd)
    assert again.returncode == 0 and f"at step {step}" in again.stdout, again.stderr[-2000:]
    assert _ckpt(tmp_path, "piped", step + 1)["run"]["step"] == step + 1


def test_console_survives_a_dead_pipe_and_a_full_disk():
    """common.Console on its own: a write or flush that fails (a dead pipe, EIO, a full disk) points the descriptor
    at /dev/null, is remembered, and never raises; isatty() is then False (no progress bar)."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    stream = os.fdopen(write_fd, "w")
    console = common.Console(stream)
    console.write("x" * 100)
    console.flush()  # EPIPE here (buffered), or at the write
    assert isinstance(console.lost, BrokenPipeError) and not console.isatty()
    assert console.write("more") == 4
    console.flush()
    stream.close()  # flushes to /dev/null now: no error at exit either
    full = common.Console(open("/dev/full", "w")) if os.path.exists("/dev/full") else None
    if full is not None:
        print("a line", file=full, flush=True)
        assert isinstance(full.lost, OSError) and full.lost.errno == 28  # ENOSPC


@pytest.mark.process
def test_truncated_newest_checkpoint_falls_back_to_previous(shard_url, tmp_path, capsys):
    assert vae_trainer.main(_args(shard_url, tmp_path, "t", 4, 2)) == 0
    newest = tmp_path / "t" / "checkpoints" / "step_00000004.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a crash mid-write of a non-atomic writer
    capsys.readouterr()
    assert vae_trainer.main(_args(shard_url, tmp_path, "t", 6, 2)) == 0
    out = capsys.readouterr().out
    assert "step_00000004.pt is unreadable" in out
    assert "step_00000002.pt at step 2" in out
    assert _ckpt(tmp_path, "t", 6)["run"]["step"] == 6
    assert _ckpt(tmp_path, "t", 4)["run"]["step"] == 4  # rewritten whole


# ------------------------------------------------------------------------------------------ numerical guard
@pytest.mark.process
def test_injected_nan_skips_the_step_on_every_rank(shard_url, tmp_path, capfd, one_torch_thread):
    """A NaN loss on rank 1 only at step index 3: both ranks skip that update (weights, EMA, critic with its spectral
    norm's vectors, and optimizer state unchanged) and count it. A stop request right after it still saves (the
    weights are the last good ones), and the resumed run (the same command on one process, its main here) trains on
    with the guard's counts."""
    args = _args(shard_url, tmp_path, "nan", 6, 1, *GAN_2)
    proc = run_cli(FAULTY, args, nproc=2, env=cli_env(VAE_TRAINER_INJECT_NAN="3@1",
                                                               VAE_TRAINER_SIGTERM_AT="3@0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint written at step 4" in proc.stdout
    before, skipped = _ckpt(tmp_path, "nan", 3), _ckpt(tmp_path, "nan", 4)
    for entry, key in (("training", "vae"), ("training", "ema"), ("adversary", "critic")):
        assert all(torch.equal(before[entry][key][k], skipped[entry][key][k]) for k in before[entry][key]), key
    for entry in ("training", "adversary"):
        for pid, st in before[entry]["optimizer"]["state"].items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(st[name], skipped[entry]["optimizer"]["state"][pid][name]), (entry, name)
    assert skipped["run"]["ranks_in_sync"] is True
    assert skipped["guard"] == {"bad_steps_total": 1, "bad_streak": 1}

    again = run_in_process(vae_trainer.main, args, capfd)
    assert again.returncode == 0 and "at step 4" in again.stdout, again.stderr[-3000:]
    after = _ckpt(tmp_path, "nan", 6)
    assert not all(torch.equal(skipped["training"]["vae"][k], v) for k, v in after["training"]["vae"].items())
    assert after["guard"] == {"bad_steps_total": 1, "bad_streak": 0}
    assert [r["guard/bad_steps_total"] for r in _metrics(tmp_path, "nan")] == [0, 1, 1]


@pytest.mark.process
@pytest.mark.timeout(240)
def test_nan_reconstruction_reaching_the_critic_is_skipped_and_training_recovers(shard_url, tmp_path, capfd,
                                                                                 monkeypatch, one_torch_thread):
    """A NaN reconstruction at step index 3 (what an fp16 overflow in the decoder gives) reaches the critic
    and LeCam's pending anchors. The guard skips the step for both networks and the anchors stay as they
    were: a stop request right then saves finite anchors, and the resumed run has finite losses and
    finishes. Before the fix the anchors turned NaN for good: every later step was skipped and the run
    stopped at --max_bad_steps. (In-process: the runs' own main, the faults of tests/faulty_trainer.py.)"""
    args = _args(shard_url, tmp_path, "nanrec", 7, 1, *GAN_2, "--max_bad_steps", "2")
    args[args.index("--log_every_n_steps") + 1] = "1"
    with monkeypatch.context() as faulty:
        faults_in_process(faulty, VAE_TRAINER_INJECT_NAN_RECON="3", VAE_TRAINER_SIGTERM_AT="3")
        first = run_in_process(vae_trainer.main, args, capfd)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    before, skipped = _ckpt(tmp_path, "nanrec", 3), _ckpt(tmp_path, "nanrec", 4)
    assert skipped["guard"] == {"bad_steps_total": 1, "bad_streak": 1}
    for name in ("ema_real", "ema_fake"):
        assert torch.isfinite(before["adversary"]["lecam"][name]), name
        # the bad step left them
        assert torch.equal(before["adversary"]["lecam"][name], skipped["adversary"]["lecam"][name]), name

    again = run_in_process(vae_trainer.main, args, capfd)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    records = {r["step"]: r for r in _metrics(tmp_path, "nanrec")}
    assert records[4]["guard/skipped_disc"] == 1.0 and records[4]["guard/skipped_vae"] == 1.0
    for step in (5, 6, 7):
        assert math.isfinite(records[step]["loss/disc"]) and math.isfinite(records[step]["loss/total"]), step
        assert records[step]["guard/skipped_disc"] == 0.0 and records[step]["guard/skipped_vae"] == 0.0, step
    last = _ckpt(tmp_path, "nanrec", 7)
    assert last["guard"] == {"bad_steps_total": 1, "bad_streak": 0}
    for name in ("ema_real", "ema_fake"):
        anchor = last["adversary"]["lecam"][name]
        assert torch.isfinite(anchor) and not torch.equal(anchor, skipped["adversary"]["lecam"][name])


@pytest.mark.process
def test_repeated_nans_stop_cleanly_with_last_good_checkpoint(shard_url, tmp_path, capfd, monkeypatch,
                                                             one_torch_thread):
    """(In-process: the run's own main, the faults of tests/faulty_trainer.py.)"""
    args = _args(shard_url, tmp_path, "nans", 20, 2, "--max_bad_steps", "3")
    args[args.index("--log_every_n_steps") + 1] = "1"
    faults_in_process(monkeypatch, VAE_TRAINER_INJECT_NAN="2,3,4,5,6,7,8,9")
    proc = run_in_process(vae_trainer.main, args, capfd)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "3 consecutive steps had non-finite losses" in proc.stdout
    assert "not saving at step 4: inside a streak of skipped steps" in proc.stdout
    ckpts = sorted(f for f in os.listdir(tmp_path / "nans" / "checkpoints") if f.endswith(".pt"))
    assert ckpts == ["step_00000002.pt"]
    assert _ckpt(tmp_path, "nans", 2)["guard"]["bad_steps_total"] == 0
    assert f"Last good checkpoint: {tmp_path / 'nans' / 'checkpoints' / 'step_00000002.pt'}" in proc.stdout


# ------------------------------------------------------------------------------------------ hostile data
def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _tar(path, members):
    with tarfile.open(path, "w") as tf:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
    return str(path)


@pytest.fixture(scope="module")
def hostile_shards(photos_dir, tmp_path_factory):
    """One shard with every kind of bad member next to good ones of every colour mode; one truncated tar."""
    d = tmp_path_factory.mktemp("hostile")
    photo = Image.open(os.path.join(photos_dir, "astronaut.png")).convert("RGB").resize((96, 96))
    gray16 = Image.fromarray((np.asarray(photo.convert("L"), dtype=np.uint16) * 257))
    members = [
        ("rgb.png", _png(photo)), ("rgb.jpg", _jpeg(photo)), ("gray.png", _png(photo.convert("L"))),
        ("rgba.png", _png(photo.convert("RGBA"))), ("pal.png", _png(photo.convert("P"))),
        ("cmyk.jpg", _jpeg(photo.convert("CMYK"))), ("g16.png", _png(gray16)),
        ("tiny.png", _png(photo.resize((9, 7)))),
        ("corrupt.jpg", b"\xff\xd8\xff\xe0 definitely not a jpeg"), ("empty.png", b""),
        ("truncated.jpg", _jpeg(photo)[:300]), ("notes.txt", b"no image here"),
        ("bomb.png", _png(Image.new("1", (6000, 6000)))),
    ]
    good = _tar(d / "hostile.tar", members)
    full = _tar(d / "whole.tar", [(f"img{i}.png", _png(photo.rotate(30 * i))) for i in range(6)])
    cut = d / "cut.tar"
    cut.write_bytes(open(full, "rb").read()[: os.path.getsize(full) * 2 // 3])
    return good, str(cut)


@pytest.mark.process
def test_hostile_shards_train_to_completion_and_count_skips(hostile_shards, tmp_path):
    good, cut = hostile_shards
    # 2 lanes, a buffer of one sample: the lanes start in different shards and read in order, so the one that
    # starts in the zoo meets all its bad members (after its 8 good ones) within the 12 steps
    args = _args(f"{good}::{cut}", tmp_path, "hostile", 12, 12, "--max_image_pixels", "10000000",
                 "--shuffle_buffer", "1", "--batch_size", "1")
    proc = run_cli("vae_trainer.py", args, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = _metrics(tmp_path, "hostile")[-1]
    assert last["step"] == 12
    assert last["data/skipped_corrupt"] >= 3 and last["data/skipped_non_image"] >= 1
    assert last["data/skipped_too_large"] >= 1 and last["data/skipped_shard_errors"] >= 1
    assert "skipped" in proc.stdout.splitlines()[-3] or "skipped" in proc.stdout


@pytest.mark.process
@pytest.mark.timeout(120)
def test_data_without_an_image_is_one_line_and_leaves_no_run_dir(tmp_path, capfd, one_torch_thread):
    """The run stops at its first batch; before, its run directory stayed behind with config.json only. (The
    command's main, in this process.)"""
    shard = _tar(tmp_path / "text.tar", [(f"note{i}.txt", b"no image here") for i in range(4)])
    proc = run_in_process(vae_trainer.main, _args(shard, tmp_path / "runs", "nodata", 2, 2), capfd)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path / "runs") == []


@pytest.mark.process
def test_one_shard_for_two_ranks_does_not_hang(hostile_shards, tmp_path):
    good, _ = hostile_shards
    proc = run_cli("vae_trainer.py", _args(good, tmp_path, "one", 4, 4, "--max_image_pixels", "10000000"),
                   nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 4 steps" in proc.stdout  # 4 lanes (2 ranks x 2 images) read the one shard, each in its own order


# ------------------------------------------------------------------------------------------ safety
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_with_pickled_code_is_refused_not_executed(shard_url, tmp_path, capfd, one_torch_thread):
    """A checkpoint whose pickle runs a command when loaded (--resume, --load_path, evaluate.py --ckpt): refused in
    one line, the command never run (the commands' own functions, in this process: what they load is the point)."""
    import evaluate
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"vae": _RunsCode(marker), "step": 1}, f)
    for command, args in [(vae_trainer.main, _args(shard_url, tmp_path, "a", 2, 2, "--resume", str(evil))),
                          (vae_trainer.main, _args(shard_url, tmp_path, "b", 2, 2, "--load_path", str(evil))),
                          (evaluate.main, ["--ckpt", str(evil), "--dataset_url", shard_url])]:
        proc = run_in_process(command, args, capfd)
        code, err = proc.returncode, proc.stderr
        assert code != 0, (command.__module__, err[-1000:])
        assert err.strip().splitlines()[-1].startswith("error: "), err
        assert "Traceback" not in err
        assert not marker.exists(), "loading a checkpoint ran code"


def _run_dir_at_step_2(run, args: list[str]) -> None:
    """What a run of `args` leaves after step 2, as far as the choice to resume reads it (its config.json and a
    checkpoint's recipe): the start-up decisions are tested without training the run first."""
    cfg = run_setup.parse_config(args)
    os.makedirs(run / "checkpoints")
    (run / "config.json").write_text(json.dumps(config.public_config(cfg)))
    torch.save({"format_version": 2, "run": {"step": 2, "config": config.public_config(cfg)}},
               run / "checkpoints" / "step_00000002.pt")


@pytest.mark.process
def test_run_dir_of_another_architecture_is_refused_unless_forced(shard_url, tmp_path, capsys):
    _run_dir_at_step_2(tmp_path / "arch", _args(shard_url, tmp_path, "arch"))
    other = _args(shard_url, tmp_path, "arch", 2, 2, "--vae_z_channels", "8")
    capsys.readouterr()
    assert vae_trainer.main(other) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "different architecture" in lines[0] and "vae_z_channels: 4 -> 8" in lines[0]
    assert vae_trainer.main(other + ["--force"]) == 0
    aside = [d for d in os.listdir(tmp_path / "arch") if d.startswith("checkpoints.incompatible-")]
    assert len(aside) == 1 and os.listdir(tmp_path / "arch" / aside[0]) == ["step_00000002.pt"]  # nothing lost
    assert _ckpt(tmp_path, "arch", 2)["run"]["config"]["vae_z_channels"] == 8
    # switching the GAN on later is not an architecture change: it resumes
    capsys.readouterr()
    assert vae_trainer.main(_args(shard_url, tmp_path, "arch", 4, 2, "--vae_z_channels", "8", *GAN_2)) == 0
    assert "at step 2" in capsys.readouterr().out


@pytest.mark.process
@pytest.mark.timeout(150)
def test_force_over_another_architecture_with_two_ranks_and_a_late_rank(shard_url, tmp_path):
    """Rank 1 reaches the run directory 3 s after rank 0. Before: every rank listed the checkpoints; rank 1
    listed them after rank 0 had set them aside, skipped the barrier rank 0 waited at, and the collectives
    paired up wrongly: a hang. Now rank 0 alone decides and acts, and broadcasts the decision."""
    run = tmp_path / "arch2"
    _run_dir_at_step_2(run, _args(shard_url, tmp_path, "arch2"))
    proc = run_cli("tests/trainer_with_slow_rank1.py",
                   _args(shard_url, tmp_path, "arch2", 2, 2, "--vae_z_channels", "8", "--force"), nproc=2,
                   env=cli_env(VAE_TEST_RANK1_DELAY_S=3), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("the checkpoints of the other architecture were moved to") == 1
    aside = [d for d in os.listdir(run) if d.startswith("checkpoints.incompatible-")]
    assert len(aside) == 1 and os.listdir(run / aside[0]) == ["step_00000002.pt"]
    assert _ckpt(tmp_path, "arch2", 2)["run"]["config"]["vae_z_channels"] == 8
    assert json.loads((run / "config.json").read_text())["vae_z_channels"] == 8


def test_load_path_of_another_shape_is_one_line_and_leaves_no_run_dir(shard_url, tmp_path, capsys):
    """Before: a 139-line `size mismatch` traceback, and a run directory holding only config.json."""
    cfg = run_setup.parse_config(_args(shard_url, tmp_path))
    weights = tmp_path / "ch32.pt"
    torch.save(ae.AutoEncoder(AutoEncoderParams.from_config(cfg.model)).state_dict(), weights)
    code = vae_trainer.main(_args(shard_url, tmp_path / "runs", "wide", 2, 2, "--vae_ch", "64",
                                  "--load_path", str(weights)))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith(f"error: --load_path {weights} does not fit this architecture"), err
    assert "[64, 3, 3, 3]" in err[0] or "[64]" in err[0], err  # says which shape differs
    assert not (tmp_path / "runs" / "wide").exists()  # a failed start leaves nothing behind


@pytest.mark.process
@pytest.mark.timeout(300)
def test_precision_can_change_on_resume(shard_url, tmp_path, capfd, monkeypatch, one_torch_thread):
    """fp32 -> fp16 crashed (a disabled GradScaler saves {}, an enabled one refuses to load it); fp16 ->
    fp32 goes back. GAN on: the critic's scaler too. fp16 convolutions are slow on CPUs: a small model. The
    first fp16 steps overflow and are skipped (the scaler backs off), so the fp16 leg saves on a stop
    request, which is honoured inside a streak of skipped steps. (In-process: the runs' own main.)"""
    small = [*GAN_2, "--vae_ch", "16", "--vae_ch_mult", "1,2", "--vae_resolution", "32", "--batch_size", "1"]
    legs = [(1, "fp32", {}), (3, "fp16", {"VAE_TRAINER_SIGTERM_AT": "1"}), (3, "fp32", {})]
    for steps, precision, faults in legs:
        with monkeypatch.context() as faulty:
            faults_in_process(faulty, **faults)
            proc = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "prec", steps, 1, *small,
                                                          "--precision", precision), capfd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if precision == "fp16":
            assert "at step 1" in proc.stdout and "checkpoint written at step 2" in proc.stdout, proc.stdout
        if steps == 3:
            assert f"written with --precision {'fp32' if precision == 'fp16' else 'fp16'}; continuing in " \
                   f"{precision}" in proc.stdout, proc.stdout
    fp16 = _ckpt(tmp_path, "prec", 2)
    assert fp16["run"]["config"]["precision"] == "fp16"
    # it really ran with loss scaling
    assert fp16["training"]["scaler"]["scale"] > 0 and fp16["adversary"]["scaler"]["scale"] > 0
    assert _ckpt(tmp_path, "prec", 3)["training"]["scaler"] == {} and _ckpt(tmp_path, "prec", 3)["run"]["step"] == 3


@pytest.mark.process
@pytest.mark.timeout(300)
def test_fp16_stopped_and_resumed_equals_uninterrupted(shard_url, tmp_path, capfd, monkeypatch, one_torch_thread):
    """fp16 into fp16: the VAE's GradScaler (its loss scale and growth tracker) is part of the state. Steps 1 and 2
    have a NaN loss (what an overflow gives), so the scale backs off from 2^16 whatever this CPU's own fp16 overflows
    do; a resume that restarted the scale would go on at another scale (and skip or underflow other steps). Both
    runs meet this machine's overflows at the same steps, wherever those fall, so the stop lands wherever the run
    honours it and the two runs agree bitwise: weights, optimizer, scaler and the count of skipped steps. (fp16
    autocast runs on CPU; fp16 convolutions are slow there, their backward 100x fp32's: a small model, no critic.
    In-process: the runs' own main, the faults of tests/faulty_trainer.py.)"""
    small = ["--vae_ch", "16", "--vae_ch_mult", "1,2", "--vae_resolution", "16", "--batch_size", "1",
             "--precision", "fp16"]  # (1 image of 16 px: the scaler's state is the point, not the images)
    nan = {"VAE_TRAINER_INJECT_NAN": "1,2"}
    for run, faults in (("ref", nan), ("cut", {**nan, "VAE_TRAINER_SIGTERM_AT": "5"})):
        with monkeypatch.context() as faulty:
            faults_in_process(faulty, **faults)
            proc = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, run, 10, 10 if run == "ref" else 100,
                                                          *small), capfd)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    first = proc
    written = re.findall(r"checkpoint written at step (\d+)", first.stdout)
    assert first.returncode == 0 and written, first.stdout[-2000:] + first.stderr[-2000:]
    stop = int(written[-1])
    assert 3 <= stop < 10, first.stdout[-2000:]  # after the injected overflows, before the end
    assert _ckpt(tmp_path, "cut", stop)["training"]["scaler"]["scale"] <= 2.0 ** 14  # backed off twice at least
    again = run_in_process(vae_trainer.main, _args(shard_url, tmp_path, "cut", 10, 10, *small), capfd)
    assert again.returncode == 0 and f"at step {stop}" in again.stdout, again.stderr[-2000:]
    # (a scale restarted at 2^16 overflows again: the resumed run skips steps the uninterrupted one took, and its
    # last steps may be a streak that writes no checkpoint)
    assert (tmp_path / "cut" / "checkpoints" / "step_00000010.pt").exists(), again.stdout[-1500:]
    a, b = _ckpt(tmp_path, "ref", 10), _ckpt(tmp_path, "cut", 10)
    assert a["training"]["scaler"] == b["training"]["scaler"]
    assert a["guard"] == b["guard"] and a["guard"]["bad_steps_total"] >= 2  # the same steps skipped
    for name in a["training"]["vae"]:
        assert torch.equal(a["training"]["vae"][name], b["training"]["vae"][name]), name
    for pid, state in a["training"]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["training"]["optimizer"]["state"][pid][key]), (pid, key)


def test_resume_never_refuses_a_run_dir_with_checkpoints(shard_url, tmp_path, capsys):
    _run_dir_at_step_2(tmp_path / "n", _args(shard_url, tmp_path, "n"))
    assert vae_trainer.main(_args(shard_url, tmp_path, "n", 4, 2, "--resume", "never")) == 1
    assert "--resume never" in capsys.readouterr().err
    assert os.listdir(tmp_path / "n" / "checkpoints") == ["step_00000002.pt"]  # nothing written, nothing moved


@pytest.mark.process
def test_secrets_never_land_in_outputs(shard_url, tmp_path, capfd, monkeypatch, one_torch_thread):
    """Credentials in the dataset url and secrets in the environment reach no log, config or checkpoint. (The
    command's main, in this process.)"""
    secrets = {"password": "pw-7f3a9c1e5b2d", "token": "tok-4e8b2a6c9d1f", "wandb": "wk-1c5e9a3f7b2d",
               "hf": "hf-9b3d7f1a5c2e"}
    first_shard = shard_url.replace("{00000..00002}", "00000")
    url = (f"pipe:cat {first_shard} # https://alice:{secrets['password']}@data.example.com/x.tar"
           f"?token={secrets['token']}")
    monkeypatch.setenv("WANDB_API_KEY", secrets["wandb"])
    monkeypatch.setenv("HF_TOKEN", secrets["hf"])
    proc = run_in_process(vae_trainer.main, _args(url, tmp_path, "s", 2, 2), capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "s"
    texts = [proc.stdout, proc.stderr, (run / "config.json").read_text(), (run / "metrics.jsonl").read_text(),
             open(run / "checkpoints" / "step_00000002.pt", "rb").read().decode("latin-1")]
    for name, secret in secrets.items():
        assert not any(secret in t for t in texts), name
    config = json.loads((run / "config.json").read_text())
    assert "https://***@data.example.com/x.tar?token=***" in config["dataset_url"]


# ------------------------------------------------------------------------------------------ collapse tracker
def test_collapse_tracker_warns_once_per_episode():
    said = []
    tracker = run_log.CollapseTracker(said.append)
    calm = {"latent/collapsed_fraction": 0.0, "latent/abs_max": 3.0, "latent/std": 1.0, "gan/disc_acc": 0.6}
    collapsed = dict(calm, **{"latent/collapsed_fraction": 0.75})
    for step, m in enumerate([calm, collapsed, collapsed, collapsed, calm, collapsed]):
        tracker.check(m, step)
    assert len([s for s in said if "posterior collapse" in s]) == 2  # two episodes, one warning each
    tracker.check(dict(calm, **{"latent/abs_max": 5e3}), 10)
    tracker.check(dict(calm, **{"gan/disc_acc": 0.99}), 11, gan_active=False)  # G not trained against it yet
    assert not any("critic has won" in s for s in said)
    tracker.check(dict(calm, **{"gan/disc_acc": 0.99}), 12)
    assert any("exploding latents" in s for s in said) and any("critic has won" in s for s in said)


# ------------------------------------------------------------------------------------------ GPU-only paths
def test_rng_state_touches_only_the_ranks_own_cuda_device(monkeypatch):
    """Before: torch.cuda.get_rng_state_all()/set_rng_state_all(): every rank created a CUDA context on
    every GPU of its node at the first checkpoint, and a resumed rank overwrote the other devices'
    generators. No GPU here: torch.cuda's RNG functions are replaced by recorders."""
    calls = []
    ours = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: calls.append("get_all") or [ours] * 4)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: calls.append("set_all"))
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": calls.append(("get", torch.device(device))) or ours.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": calls.append(("set", torch.device(device), state.tolist())))
    device = torch.device("cuda", 2)
    state = common.capture_rng(device)
    common.restore_rng(state, device)
    assert calls == [("get", device), ("set", device, ours.tolist())]
    # checkpoints written before this fix hold every device's state: a rank restores only its own
    calls.clear()
    common.restore_rng(dict(state, cuda=[torch.full((16,), i, dtype=torch.uint8) for i in range(4)]), device)
    assert calls == [("set", device, [2] * 16)]
    # a CPU run never touches CUDA, even where a GPU is visible
    calls.clear()
    common.restore_rng(common.capture_rng(torch.device("cpu")), torch.device("cpu"))
    assert calls == []
