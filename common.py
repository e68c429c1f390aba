"""Plumbing every command shares (vae_trainer, evaluate, export, probe, latents, bench), importable without
importing the trainer: the one-line user error and the flag parser that raises it, a console that a dead reader
cannot end a run through, process-group setup, what a stop signal asks of the ranks, atomic file writes, and
capturing/restoring the RNG states a checkpoint carries."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import difflib
import gc
import os
import random
import re
import signal
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


_SECRET_PATTERNS = [
    (re.compile(r"(?<=://)[^/@\s]+:[^/@\s]+@"), "***@"),  # user:password@host
    (re.compile(r"(?i)([?&](?:token|key|api_key|access_token|sig|signature|x-amz-signature|x-amz-credential|"
                r"x-goog-signature|secret|password)=)[^&\s']+"), r"\1***"),
]


def redact(text: str) -> str:
    """Strip credentials from URLs before they reach config.json, logs, checkpoints or wandb."""
    for pattern, repl in _SECRET_PATTERNS:
        text = pattern.sub(repl, text)
    return text


class ConfigError(Exception):
    """A user error in flags or paths: printed as one `error:` line, before any process group exists."""


def first_line(text, limit: int = 200) -> str:
    """The first line of `text` (an exception's message), at most about `limit` characters, cut between words
    with '...' where it is longer: for one-line errors that quote a library's message."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return (cut if len(cut) > limit // 2 else line[:limit]) + "..."


def torch_pair_problem() -> str | None:
    """None if torchvision imports; else one line: the torch and torchvision installed, what the torchvision asks
    for, and the pip command that installs a matching pair. (A torchvision built for another torch than the one
    installed fails inside its own import, e.g. "operator torchvision::nms does not exist": pip can leave such a
    pair when the CPU index has no torch for this Python and it falls back to another.)"""
    try:
        import torchvision  # noqa: F401
        return None
    except Exception as error:  # (RuntimeError from its operator registrations, or ImportError/OSError of _C)
        from importlib import metadata
        try:
            installed = metadata.version("torchvision")
            wants = next((r for r in metadata.requires("torchvision") or () if r.replace(" ", "").startswith(
                "torch") and r[5:6] in " =<>~!("), "")
        except metadata.PackageNotFoundError:
            installed, wants = "(not installed)", ""
        wants = f" (it asks for {wants.translate(str.maketrans('', '', ' ()'))})" if wants else ""
        index = " --index-url https://download.pytorch.org/whl/cpu" if torch.version.cuda is None else ""
        return (f"torchvision {installed}{wants} does not load with torch {torch.__version__}: "
                f"{first_line(error, 100)}; install a matching pair: "
                f"pip install --force-reinstall torch torchvision{index}")


def exit_if_torch_pair_broken() -> None:
    """A command's first act (vae_trainer.py, evaluate.py, export.py, probe.py, bench.py), before the modules
    that import torchvision: a torch/torchvision mismatch is one `error:` line and exit 2, not an import's
    traceback."""
    problem = torch_pair_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line, with a hint for the two typos people make: a misspelt
    flag ("did you mean --max_steps?") and a brace or glob pattern the shell expanded into extra paths.
    Abbreviations are off: an abbreviation silently taken for a flag is a typo that passes."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message += unrecognized_hint(message[len(prefix):].split(), self._option_string_actions)
        raise ConfigError(message)


def unrecognized_hint(extra: list[str], known: Any) -> str:
    """'; did you mean --x?' for each misspelt flag among `extra`; a quoting hint for stray positional words."""
    hints, stray = [], []
    for i, word in enumerate(extra):
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=")[0], list(known), n=1, cutoff=0.75)
            if close:
                hints.append(f"{word.split('=')[0]}: did you mean {close[0]}?")
        elif not (i > 0 and extra[i - 1].startswith("--") and "=" not in extra[i - 1]):  # not a stray flag's value
            stray.append(word)
    if stray:
        hints.append("several paths where one was expected: the shell expands an unquoted brace or glob pattern; "
                     "quote it, e.g. --dataset_url 'shards/{00000..00099}.tar'")
    return "".join(f"; {h}" for h in hints)


class Console:
    """stdout or stderr that a lost reader cannot end the run through. `./train.sh 2>&1 | tee log` and Ctrl-C: the
    terminal signals the whole foreground group, `tee` dies with it, and the trainer's next line, written while it
    saves its checkpoint, raised BrokenPipeError (and `> log` on a full disk ENOSPC, a closed ssh session EIO). The
    first such error here points the stream's file descriptor at /dev/null (so that neither a later write nor the
    interpreter's flush at exit fails again), is remembered in `lost`, and every later line goes nowhere: the run,
    its checkpoints, metrics.jsonl and train.log go on (run_log.Reporter notes the loss in train.log)."""

    def __init__(self, stream):
        self.stream, self.lost = stream, None

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as e:  # ValueError: the stream was closed
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                self._lose(e)

    def _lose(self, error: Exception) -> None:
        self.lost = error
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def isatty(self) -> bool:
        return self.lost is None and self.stream.isatty()

    def __getattr__(self, name: str):  # encoding, fileno, buffer, ...
        return getattr(self.stream, name)


def guard_console() -> None:
    """Put sys.stdout and sys.stderr behind Console (once per process: the trainer, evaluate, probe, data workers)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Console):
            setattr(sys, name, Console(stream))


def console_lost() -> tuple[str, Exception] | None:
    """('stdout' or 'stderr', the error) if a guarded stream has been lost, else None."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, Console) and stream.lost is not None:
            return name, stream.lost
    return None


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    ctrl_group: Any = None  # a gloo group for host-side agreement (stop flags, checkpoint gathering)
    store: Any = None  # this attempt's store (a PrefixStore): what a rank says to the others outside a collective

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistInfo:
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"vae_trainer/attempt_{agree_on_attempt(store, rank, world)}", store)
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
        ctrl = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        ctrl = dist.group.WORLD
    return DistInfo(rank, local, world, device, ctrl, store)


def close_distributed(info: DistInfo) -> None:
    """End the process groups before the interpreter does. destroy_process_group() only unregisters a group: the group,
    and its gloo worker threads, live on while anything references it (this DistInfo, a DDP module, a cycle of the
    trainer's objects), until the interpreter finalizes. A worker thread that is still releasing the tensors of a
    finished collective then cannot take the GIL and the process dies with SIGABRT, "terminate called without an
    active exception" (torch's gloo with Python < 3.14: 6 % of the ranks of a two-rank all_reduce that exited at once;
    pytorch issue 190489). Dropping the references and collecting the cycles destroys the groups here, and their
    destructor joins the threads while the interpreter can still hand them the GIL. Call it once nothing that holds a
    group (a trainer, a DDP model) is needed any more. A run of one process without a group has nothing to end (and
    a collection of a large heap takes a quarter of a second)."""
    had_groups = info.ctrl_group is not None or dist.is_initialized()
    info.ctrl_group = info.store = None
    if dist.is_initialized():
        dist.destroy_process_group()
    if had_groups:
        gc.collect()


@contextlib.contextmanager
def closing_distributed(info: DistInfo):
    """A command's body under torchrun: close_distributed when it ends, however it ends. An error that escapes has its
    frames' locals cleared first: its traceback holds them (and at the top level, sys.last_traceback keeps it to the
    end), and a trainer's `self` there would keep its DDP modules and process groups alive into the interpreter's
    exit, past close_distributed. The traceback still prints in full."""
    try:
        yield
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        close_distributed(info)


def agree_on_attempt(store: Any, rank: int, world: int, poll_s: float = 5.0) -> str:
    """A name for this attempt of the job that all its ranks agree on, for the namespace of its process group.

    torchrun's agents keep one store across restarts: without a namespace per attempt, restarted workers read the
    dead attempt's peer addresses and hang in the connect (seen with gloo). TORCHELASTIC_RESTART_COUNT is not that
    name on several nodes: an agent whose worker was still healthy when a failed node came back to the rendezvous
    restarts it without counting (a membership change), so the nodes' counts differ by one from then on and every
    later attempt hangs in init until its timeout. Instead rank 0 draws a fresh token and welcomes each rank by a
    nonce of that rank's own: a rank that read a token left by an earlier attempt (rank 0 had not yet written
    its own) gets no welcome for its new nonce within poll_s and reads the token again."""
    if rank == 0:
        token = uuid.uuid4().hex
        store.set("vae_trainer/token", token)
        for r in range(1, world):
            nonce = store.get(f"vae_trainer/{token}/hello/{r}").decode()  # waits (store timeout) for rank r
            store.set(f"vae_trainer/{token}/welcome/{nonce}", "1")
        return token
    nonce = uuid.uuid4().hex
    while True:
        token = store.get("vae_trainer/token").decode()
        store.set(f"vae_trainer/{token}/hello/{rank}", nonce)
        try:  # the store server answers when the key appears: no polling load on it from thousands of ranks
            store.wait([f"vae_trainer/{token}/welcome/{nonce}"], datetime.timedelta(seconds=poll_s))
            return token
        except dist.DistStoreError:  # not welcomed in time: the token was a dead attempt's, or rank 0 is slow
            continue


# ============================================================================================
# Stopping: what a signal asks for, and what the ranks agree on
# ============================================================================================
class StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current step; a second SIGINT aborts.
    Under torchrun a signalled rank also sets a stop key in the store (signal_watch: from a thread woken by
    the signal itself, because a rank blocked in a collective runs no Python handler), which a rank waiting through a
    shard outage reads (`anywhere`): a stop that reaches one node of several ends every rank's wait."""

    def __init__(self, info: DistInfo | None = None):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        self.store = info.store if info is not None and info.distributed else None
        if self.store is not None:
            signal_watch(lambda: self.store.set(STOP_KEY, "1"))

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __call__(self) -> bool:
        """Whether this rank was signalled."""
        return self.signum is not None

    def anywhere(self) -> bool:
        """Whether this rank or (the store's stop key) another was signalled: the data stream's waits ask this."""
        return self.signum is not None or (self.store is not None and self.store.check([STOP_KEY]))

    def agreed(self, info: DistInfo) -> bool:
        """Whether any rank was signalled."""
        return any_rank(self.signum is not None, info)


STOP_KEY = "vae_trainer/stop"


@contextlib.contextmanager
def signal_handlers_kept():
    """The handlers of SIGTERM and SIGINT, and the wakeup fd, as they are on entry, back on exit: what a run's
    StopFlag (and signal_watch) replaced comes back when vae_trainer.main returns to a program that ran it in its
    own process (a notebook, a test), whose Ctrl-C would otherwise ask the finished run to stop. Entered before the
    process groups and left after them: a signal during the close (torchrun forwards the one its group got) still
    finds the run's flag, not the default that ends the process."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # (None: a handler not set from Python, which cannot be set back from it)
                signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup)


def signal_watch(on_signal) -> None:
    """Call `on_signal()` from a daemon thread as soon as SIGTERM or SIGINT reaches this process, whatever its main
    thread is doing. Python runs a signal's handler only between bytecodes of the main thread, so a rank blocked in
    a collective (a gloo all_reduce waiting for a rank that waits through a shard outage) would not act on it until
    the others came; the C-level handler writes the signal's number to the wakeup fd at once, and the thread reading
    it runs while the main thread waits with the GIL released. Errors of `on_signal` (a store that is gone) are
    dropped: the signal's own handler still stops this rank."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    wanted = {signal.SIGTERM, signal.SIGINT}

    def watch():
        while True:
            received = os.read(read_fd, 64)
            if not received:
                return
            if wanted & set(received):
                with contextlib.suppress(Exception):
                    on_signal()
    threading.Thread(target=watch, name="signal-watch", daemon=True).start()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether `flag` is true on any rank; over the gloo control group, so no device sync."""
    if not info.distributed:
        return flag
    flags = torch.tensor([int(flag)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=info.ctrl_group)
    return bool(flags.item())


def all_reduce_sum(*tensors: torch.Tensor) -> None:
    """Sum across ranks, in place, on the tensors' device (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for t in tensors:
            dist.all_reduce(t)


def atomic_write(path: str, write) -> None:
    """Write via a temp file in the same directory, flush + fsync, rename, fsync the directory: a crash
    at any point leaves either the old file or the new one, never a torn one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """optimizer.load_state_dict(state), its moments then laid out as their parameters (moments_as_parameters)."""
    optimizer.load_state_dict(state)
    moments_as_parameters(optimizer)


def moments_as_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Each tensor of the optimizer's per-parameter state (AdamW's moments) laid out as its parameter, with the
    same strides (a DTensor: its local shard's). torch's load_state_dict keeps the strides a moment was saved with,
    and fused AdamW walks a parameter, its gradient and its moments in memory order: a moment saved from a parameter
    of another memory format (the VAE channels_last on a CPU under ddp, NCHW under --sharding fsdp or on CUDA;
    another --channels_last) would update the wrong elements."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731 (DTensor: no import here)
    for group in optimizer.param_groups:
        for param in group["params"]:
            per_param = optimizer.state.get(param, {})
            for key, value in per_param.items():
                if (torch.is_tensor(value) and value.shape == param.shape
                        and local(value).stride() != local(param).stride()):
                    per_param[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def capture_rng(device: torch.device) -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])}}
    if device.type == "cuda":
        # this rank's device only: get_rng_state_all() would create a CUDA context on every visible GPU
        # (8 ranks x 8 contexts on an 8-GPU node)
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    cuda = state.get("cuda")
    if device.type == "cuda" and cuda is not None:
        if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible device's state; ours is ours
            cuda = cuda[device.index] if device.index is not None and device.index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)  # never another device's generator


def honour_umask(path: str) -> None:
    """safetensors writes through a private temp file (mode 0600) that it renames: give the file the mode a
    plain open() would have (0666 minus the umask), like config.json next to it, so others on a shared file
    system can read the export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
