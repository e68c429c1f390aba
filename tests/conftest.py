"""Shared fixtures: real photos (scikit-image's bundled samples), shards built from them, and a
runner for the real CLI commands (plain python or torchrun on gloo)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sources  # noqa: E402
import shards  # noqa: E402

# matplotlib builds its font cache on first import, running fc-list: on a machine without the cache (a new user's,
# a fresh CI runner) that happened inside whichever test imported it first, which then failed for starting a
# program. Built here, once per process, before any test runs.
import matplotlib.font_manager  # noqa: E402,F401

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "camera.png",
          "logo.png", "hubble_deep_field.jpg")

# vae_trainer.py with the test faults of its VAE_TRAINER_* variables (NaN loss/reconstruction, SIGKILL, SIGTERM)
FAULTY = "tests/faulty_trainer.py"

# tiny architecture for CLI tests: f4, 64 px, < 1M parameters; one torch thread (the automatic count is 2 on a 2-core
# machine when a test sets --num_workers 0: on tensors this small the second thread costs more CPU than it saves,
# and with the other pytest worker busy it waits for a core)
TINY = ["--vae_ch", "32", "--vae_ch_mult", "1,2,2", "--vae_num_res_blocks", "1", "--vae_z_channels", "4",
        "--do_attn", "false", "--vae_resolution", "64", "--batch_size", "2", "--num_workers", "1", "--num_threads", "1",
        "--shuffle_buffer", "8", "--mse_pool_factor", "4", "--vgg16_weights", "random", "--wandb_mode", "disabled",
        "--warmup_steps", "2"]

# TINY without LPIPS, for the process tests whose point is plumbing (an exact resume, signals, ranks that agree,
# elastic jobs, outages): LPIPS on random VGG16 features is half of a CLI step's time on this CPU (a 10-step run:
# 11.5 s, 6.4 s without) and holds no state to resume or keep in sync. The recipe's LPIPS still runs under torchrun
# (test_trainer's two-rank run, test_best's fsdp run) and through an exact resume (test_fault_tolerance's single
# process).
# Sample grids of 2 images, not 8: a grid is drawn at every save, which these runs do every step or two (a 16-step
# run saving every step: 12.4 s against 8.2 s saving once, two thirds of it the grid's encode and decode); the
# default grid: test_trainer's two-rank run.
PLUMBING = [*TINY, "--perceptual_weight", "0", "--num_samples", "2"]


# The timeout marks exist to catch hangs, not to time: each is about twice its test's time on an idle 2-core
# machine, and every mark is stretched by this factor, so that a machine under a load of 3 (which made the suite
# take 80 minutes instead of 14) still finishes every test that does not hang. VAE_TEST_TIMEOUT_SCALE overrides it.
TIMEOUT_SCALE = float(os.environ.get("VAE_TEST_TIMEOUT_SCALE", "4"))


def started_programs(request, monkeypatch):
    """The programs a test starts (subprocess: a CLI command, torchrun, curl, wandb's service, a compiler), recorded
    as they start; every one still runs."""
    import multiprocessing.util
    started = []
    real_child, real_spawn = subprocess.Popen._execute_child, multiprocessing.util.spawnv_passfds

    def execute_child(self, args, *rest, **kwargs):
        started.append(args if isinstance(args, (str, bytes)) else " ".join(map(str, args)))
        return real_child(self, args, *rest, **kwargs)

    def spawnv_passfds(path, args, passfds):  # multiprocessing's spawn and forkserver: a new interpreter
        started.append(" ".join(map(str, args)))
        return real_spawn(path, args, passfds)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawnv_passfds)
    return started


@pytest.fixture(autouse=True)
def programs_only_where_marked(request, monkeypatch):
    """The edit-test loop (`-m "not process"`, docs/extending.md) leaves out the end-to-end tests: those that start
    programs, each of which costs seconds of imports, and those that train whole runs in-process to compare them
    (more than about 3 s each on 2 cores). Such a test carries @pytest.mark.process; an unmarked test that starts a
    program fails, naming it, so the loop stays fast without anyone keeping a list of those."""
    if request.node.get_closest_marker("process") is not None:
        yield
        return
    started = started_programs(request, monkeypatch)
    yield
    if os.environ.get("VAE_TEST_PROCESS_AUDIT"):  # list them instead (used once, to mark the suite)
        if started:
            with open(os.environ["VAE_TEST_PROCESS_AUDIT"], "a") as f:
                f.write(f"{request.node.nodeid}\t{started[0][:160]}\n")
        return
    assert not started, (f"this test started a program ({started[0][:160]}): mark it @pytest.mark.process, or keep "
                         f"it in-process")


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of the tests that share a fixture, and xdist's hook
def pytest_collection_modifyitems(config, items):
    """Stretches the timeout marks; then the end-to-end tests go first (stably, each file's in its order). They
    are the long ones (seconds to minutes each, a fifth of the tests and 85% of the suite's time): under xdist the
    many short in-process tests then fill the gaps at the end, instead of one worker starting a 2-minute torchrun
    test while the other has nothing left to do. On an xdist worker, the tests of one xdist_group are named so
    that they run on one worker (xdist_groups)."""
    for item in items:
        mark = item.get_closest_marker("timeout")
        if mark is not None and mark.args:
            item.add_marker(pytest.mark.timeout(mark.args[0] * TIMEOUT_SCALE), append=False)
    if getattr(config.option, "loadgroup", False):
        xdist_groups(items)
    items.sort(key=lambda item: item.get_closest_marker("process") is None)


def xdist_groups(items) -> None:
    """--dist loadgroup sends the tests whose ids end in `@GROUP` to one worker, where the expensive fixture they
    share (a reference torchrun job) is built once. xdist 3.8 appends the suffix by assigning `item._nodeid`, which
    pytest 9 no longer reads (its id is `item._id`): every group was split over both workers and its fixture built
    twice (the sharded runs: 2 x 100 s). Here the suffix is appended where this pytest keeps the id."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # a pytest before 9: xdist's own suffix took effect
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid and isinstance(getattr(item, "_id", None), NodeId):
            group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")  # (as xdist names it)
            item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.fixture(scope="session")
def photos_dir(tmp_path_factory) -> str:
    """A folder of real photos: RGB PNG/JPEG, grayscale, RGBA."""
    import skimage
    src = os.path.join(os.path.dirname(skimage.__file__), "data")
    dst = tmp_path_factory.mktemp("photos")
    for name in PHOTOS:
        shutil.copy(os.path.join(src, name), dst / name)
    return str(dst)


@pytest.fixture(scope="session")
def shard_url(photos_dir, tmp_path_factory) -> str:
    """The photos packed into 3 shards; returns the brace-expanded url."""
    dst = tmp_path_factory.mktemp("shards")
    files = sorted(os.path.join(photos_dir, f) for f in os.listdir(photos_dir))
    paths, skipped = shards.write_shards(files, str(dst), shard_size=3, root=photos_dir)
    assert len(paths) == 3 and skipped == []
    return sources.brace_url(paths)


@pytest.fixture(autouse=True)
def no_curves(request, monkeypatch):
    """A test's in-process runs end without curves.png, as the commands do (NO_CURVES below): matplotlib's plot
    (about half a second, and a second more for its first in a process) is not what they check. The tests that look
    at the picture carry @pytest.mark.curves. (A module or session fixture is set up before this one: its runs draw.)"""
    if request.node.get_closest_marker("curves") is None:
        import plots
        monkeypatch.setattr(plots, "plot_metrics", lambda run_dir, out_path=None: None)


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process tests run single-threaded like the CLI ones (cli_env sets OMP_NUM_THREADS=1): on a small
    shared machine two OpenMP threads waiting on each other are many times slower than one."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cut_after(run, dst, step: int) -> None:
    """A copy of the run directory `run` at `dst` as if stopped after `step`: its later checkpoints (a sharded run's
    directories, a ddp run's .pt files) gone and `latest` naming the checkpoint of `step`. An exact-resume test
    continues this copy instead of training a run of its own up to `step`: a stop writes its checkpoint with the
    save a periodic one goes through (the stop itself, by signal or by --max_steps: test_fault_tolerance)."""
    import pathlib
    shutil.copytree(run, dst)
    ckpts = pathlib.Path(dst) / "checkpoints"
    for name in os.listdir(ckpts):
        if name.startswith("step_") and int(name[5:13]) > step:
            (shutil.rmtree if (ckpts / name).is_dir() else os.remove)(ckpts / name)
    (ckpts / "latest").write_text(next(n for n in os.listdir(ckpts) if n.startswith(f"step_{step:08d}")))


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


# Every command runs through tests/no_curves.py: as `python SCRIPT`, without the trainer's curves.png at its end
NO_CURVES = os.path.join(ROOT, "tests", "no_curves.py")


def cli_command(script: str, args: list[str], nproc: int = 0, extra_torchrun: list[str] | None = None) -> list[str]:
    path = os.path.join(ROOT, script)
    if nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                *(extra_torchrun or []), NO_CURVES, path, *args]
    return [sys.executable, NO_CURVES, path, *args]


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a store, a rendezvous or a shard server)."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def agent_command(port: int, rdzv_id: str, script: str, args: list[str], nnodes: str = "2",
                  rdzv_conf: str | None = None) -> list[str]:
    """One torchrun agent of a job whose nodes are agents on this machine (loopback, c10d rendezvous, one rank
    each, the README's --max-restarts=3)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}", "--max-restarts=3",
            *([f"--rdzv_conf={rdzv_conf}"] if rdzv_conf else []), "--local-addr=127.0.0.1",
            NO_CURVES, os.path.join(ROOT, script), *args]


def agent_logs(folder, count: int = 2) -> list[tuple]:
    """(stdout, stderr) files per agent: files, not pipes (waiting on one agent while the other's unread pipe fills
    would block that agent, and with it the rendezvous of both)."""
    return [(open(os.path.join(folder, f"node{i}.out"), "w+"), open(os.path.join(folder, f"node{i}.err"), "w+"))
            for i in range(count)]


def read_agent_logs(logs: list[tuple]) -> list[tuple[str, str]]:
    """What each agent wrote, (stdout, stderr); closes the files."""
    outputs = []
    for out, err in logs:
        out.seek(0), err.seek(0)
        outputs.append((out.read(), err.read()))
        out.close(), err.close()
    return outputs


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a command and every process it started. Killing torchrun alone (or its process group) is
    not enough: its agent starts each rank in a session of its own, and a hung rank would outlive the test."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [proc.pid]
    while todo:  # the whole tree first: a killed parent's children are re-parented and lost to the walk
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_cli(script: str, args: list[str], nproc: int = 0, env: dict | None = None, timeout: float = 600,
            extra_torchrun: list[str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's commands as a user would. nproc > 0 runs it under torchrun (gloo).
    On a timeout (ours, or pytest-timeout's) every process of the command is killed."""
    cmd = cli_command(script, args, nproc, extra_torchrun)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or cli_env(),
                          cwd=cwd or ROOT) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            kill_tree(proc)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_in_process(main, args: list[str], capfd) -> subprocess.CompletedProcess:
    """A command's main(args) in this process, returned as run_cli returns the program's run: its exit code
    (SystemExit's as the interpreter maps it: None 0, a message 1) and what it printed (capfd: what a data worker
    prints is there too), with what a program would also print on stderr and pytest would otherwise keep: the
    warnings a fresh interpreter shows (its default filters), and log records of WARNING and above (Python's last-resort
    handler). For the tests whose point is what the command does with its arguments, not what only a process shows
    (signals, torchrun, a broken install): a program costs seconds of imports."""
    import logging
    import warnings
    capfd.readouterr()
    handler = logging.StreamHandler(sys.stderr)  # (written where and when the program would write it)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.simplefilter("default")  # then the categories a fresh interpreter hides outside __main__
            for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=hidden)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
            try:
                code = main(args)
            except SystemExit as e:
                code = e.code
    finally:
        logging.getLogger().removeHandler(handler)
    out, err = capfd.readouterr()
    if code is not None and not isinstance(code, int):
        err, code = err + f"{code}\n", 1
    return subprocess.CompletedProcess(args, code or 0, out, err)


def faults_in_process(monkeypatch, **faults) -> None:
    """tests/faulty_trainer.py's faults for this test's in-process runs: VAE_TRAINER_INJECT_NAN="3",
    VAE_TRAINER_INJECT_NAN_RECON, VAE_TRAINER_SIGTERM_AT="2" (a real SIGTERM as the step after 2 completed steps
    starts, which the run's own stop flag takes: it saves that step and returns 0). Not the SIGKILL, which would
    end this pytest process."""
    assert "VAE_TRAINER_KILL_AT" not in faults, "a SIGKILL needs a process of its own (run_cli)"
    for name, steps in faults.items():
        monkeypatch.setenv(name, steps)
    import faulty_trainer
    faulty_trainer.install(monkeypatch.setattr)


def record_ops():
    """A dispatch mode that records every aten op run inside it (after autocast's casts, so it sees the
    dtypes the kernels really compute in) as (op name, [dtypes of its floating-point tensor inputs])."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[str, list]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            dtypes = [t.dtype for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            self.calls.append((func.overloadpacket.__name__, dtypes))
            return func(*args, **kwargs)

        def low_precision(self) -> list[tuple[str, list]]:
            """Ops other than casts (`_to_copy`) that read a bf16/fp16 tensor."""
            return [(name, dtypes) for name, dtypes in self.calls if name != "_to_copy"
                    and any(d in (torch.bfloat16, torch.float16) for d in dtypes)]

    return RecordOps()


def objective_of(cfg, vgg_features=None, with_lpips: bool = True, z_channels: int | None = None, **kwargs):
    """objective.VAEObjective.from_config with a whole config's sections (the trainer's composition, without it)."""
    from objective import VAEObjective
    from config import Precision
    return VAEObjective.from_config(cfg.loss, cfg.latents, cfg.critic, Precision.of(cfg.speed.precision), vgg_features,
                                    with_lpips,
                                    z_channels=z_channels or cfg.model.vae_z_channels,
                                    encoder_trains=cfg.finetune.train_parts != "decoder", **kwargs)
