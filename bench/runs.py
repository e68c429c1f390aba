"""Real commands (vae_trainer.py, export.py, evaluate.py) as child processes: started with a log, waited for
together, and a finished run's last evaluation read back from its metrics.jsonl."""
from __future__ import annotations

import json
import os
import subprocess
import time

from bench.harness import HERE


def run_logged(cmd: list[str], log_path: str, env: dict) -> subprocess.Popen:
    log = open(log_path, "a")  # a run resumed in --decoder_runs_dir keeps its first log
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE)
    proc.log, proc.started = log, time.time()
    return proc


def wait_logged(procs: dict[str, subprocess.Popen]) -> dict[str, float]:
    """Wait for every process ({what it does: process}); each one's wall seconds, taken when it ended."""
    wall, running = {}, dict(procs)
    while running:
        for what, proc in list(running.items()):
            if proc.poll() is None:
                continue
            wall[what] = round(time.time() - proc.started, 1)
            proc.log.close()
            del running[what]
            if proc.returncode != 0:
                for other in running.values():
                    other.kill()
                with open(proc.log.name) as f:
                    raise RuntimeError(f"{what} failed (exit {proc.returncode}), log {proc.log.name}:\n"
                                       f"{f.read()[-3000:]}")
        time.sleep(0.5)
    return {what: wall[what] for what in procs}


def final_eval(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval/psnr" in r]
    return evals[-1]
