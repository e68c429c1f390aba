"""The machine and this process: the CPU's model and flags, this process's resident memory (now and at its peak),
a device's synchronize, bytes in MiB."""
from __future__ import annotations

import platform
import resource
import sys

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(wanted=("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")) -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [w for w in wanted if w in flags]


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    rss = _proc_status("VmRSS")
    if rss is None:  # not Linux: the peak so far is the best available bound
        rss = peak_rss()
    return rss


def peak_rss() -> int:
    """Peak RSS of this process image in bytes. Linux: VmHWM, not getrusage's ru_maxrss, which a child
    inherits from its parent across fork + exec (it would report the benchmark parent's peak)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mib(n_bytes) -> float:
    return n_bytes / 2**20
