"""What a run reports: per-step metrics summed on the device and reduced across ranks only on logging steps,
warnings on posterior collapse / exploding latents / a critic that has won, the one-line stdout summary,
metrics.jsonl, and wandb (which must never stop or block a run)."""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.distributed as dist

import data as data_lib
from common import DistInfo, atomic_write


class Metrics:
    """Running sums of device tensors; reduced across ranks and fetched only on logging steps. Each key is
    averaged over the steps that logged it: a term that is off for part of the window (the generator's
    GAN loss before --disc_start) is not diluted by the steps without it."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}  # per key: steps of this window that logged it
        self.in_step: set[str] = set()

    def add(self, **values: torch.Tensor) -> None:
        for k, v in values.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
            self.in_step.add(k)

    def end_step(self) -> None:
        for k in self.in_step:
            self.steps[k] = self.steps.get(k, 0) + 1
        self.in_step = set()

    def max(self, **values: torch.Tensor) -> None:
        for k, v in values.items():
            v = v.detach().float()
            self.maxes[k] = torch.maximum(self.maxes[k], v) if k in self.maxes else v.clone()

    def reduce(self, info: DistInfo) -> dict[str, Any]:
        """One all-reduce and one device->host copy for everything."""
        if not self.sums:
            return {}
        keys, max_keys = sorted(self.sums), sorted(self.maxes)
        flat = torch.cat([self.sums[k].reshape(-1) / max(1, self.steps.get(k, 0)) for k in keys])
        flat_max = torch.cat([self.maxes[k].reshape(-1) for k in max_keys]) if max_keys else None
        if info.distributed:
            dist.all_reduce(flat)
            flat /= info.world_size
            if flat_max is not None:
                dist.all_reduce(flat_max, op=dist.ReduceOp.MAX)
        out: dict[str, Any] = {}
        values = (torch.cat([flat, flat_max]) if flat_max is not None else flat).cpu().tolist()  # one copy
        offset = 0
        for names, table in ((keys, self.sums), (max_keys, self.maxes)):
            for k in names:
                n = table[k].numel()
                out[k] = values[offset] if table[k].dim() == 0 else values[offset:offset + n]
                offset += n
        self.sums, self.maxes, self.steps, self.in_step = {}, {}, {}, set()
        return out


class CollapseTracker:
    """Warns once per episode (until the condition clears) on posterior collapse, exploding latents and
    a discriminator that has won."""

    def __init__(self, log):
        self.log, self.active = log, set()

    def check(self, m: dict, step: int, gan_active: bool = True) -> None:
        conditions = {
            "posterior_collapse": (m.get("latent/collapsed_fraction", 0) >= 0.5,
                                   f"{m.get('latent/collapsed_fraction', 0):.0%} of latent channels carry no signal "
                                   "above the posterior noise (posterior collapse): lower --kl_weight"),
            "exploding_latents": (m.get("latent/abs_max", 0) > 1e3 or not math.isfinite(m.get("latent/std", 0)),
                                  f"latent abs max {m.get('latent/abs_max', 0):.3g}: exploding latents"),
            "discriminator_won": (gan_active and m.get("gan/disc_acc", 0) > 0.95,
                                  f"discriminator accuracy {m.get('gan/disc_acc', 0):.2f}: the critic has won; "
                                  "consider --lecam_weight, a lower --learning_rate_disc or a later --disc_start"),
        }
        for name, (bad, msg) in conditions.items():
            if bad and name not in self.active:
                self.log(f"warning: step {step}: {msg}")
                self.active.add(name)
            elif not bad:
                self.active.discard(name)


def new_wandb_run_id() -> str:
    """8 random lower-case letters and digits, the form of wandb's own ids (wandb >= 0.2x no longer exports
    wandb.util.generate_id)."""
    import secrets
    import string
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def log_line(metrics: dict, step: int, max_steps: int, gan: bool) -> str:
    """The stdout line of a logging step."""
    line = [f"step {step}/{max_steps}", f"loss {metrics.get('loss/total', float('nan')):.4f}",
            f"lpips {metrics['loss/perceptual']:.4f}" if "loss/perceptual" in metrics else "",
            f"pmse {metrics.get('loss/pooled_mse', 0):.5f}", f"lpmse {metrics.get('loss/lowpass_mse', 0):.5f}",
            f"kl {metrics.get('loss/kl', 0):.4f}"]
    line = [part for part in line if part]
    if gan:
        line += [f"g {metrics.get('loss/gan_g', 0):.4f}", f"d {metrics.get('loss/disc', 0):.4f}",
                 f"dacc {metrics.get('gan/disc_acc', 0):.2f}"]
    line += [f"z mean {metrics.get('latent/mean', 0):+.3f} std {metrics.get('latent/std', 0):.3f}",
             f"{metrics['img_per_s']:.1f} img/s", f"eta {fmt_duration(metrics['eta_s'])}"]
    # events (each time a bad file or shard is met, again at every epoch) and the distinct files among them
    skipped = sum(metrics.get(f"data/skipped_{reason}", 0) for reason in data_lib.SKIP_REASONS)
    if skipped:
        line.append(f"skipped {skipped} ({metrics.get('data/skipped_files', 0)} files)")
    if metrics.get("data/skipped_outage_waits", 0):
        line.append(f"outage waits {metrics['data/skipped_outage_waits']}")
    if metrics.get("guard/bad_steps_total", 0):
        line.append(f"bad steps {int(metrics['guard/bad_steps_total'])}")
    return " | ".join(line)


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_jsonl(path: str, step: int) -> None:
    """After a resume, drop log lines of steps the crashed run did after its last checkpoint."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write(path, lambda f: f.write("".join(kept).encode()))


def init_wandb(mode: str, project: str, name: str, run_dir: str, config: dict, log=print):
    """A wandb run resumed under the run directory's stored id, or None (disabled, no key, or wandb failing)."""
    if mode == "disabled":
        return None
    if mode == "online" and not wandb_key_configured():
        log("warning: --wandb_mode online but no wandb API key (WANDB_API_KEY or ~/.netrc): wandb off; "
            "logging to stdout and metrics.jsonl only")
        return None
    try:
        import wandb
        id_path = os.path.join(run_dir, "wandb_id")
        run_id = open(id_path).read().strip() if os.path.isfile(id_path) else new_wandb_run_id()
        atomic_write(id_path, lambda f: f.write(run_id.encode()))
        if mode == "online":
            log("wandb: connecting (online); without a network this waits up to 60 s, then the run goes "
                "on without wandb")
        return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir, mode=mode,
                          config=config, settings=wandb.Settings(init_timeout=60, silent=True))
    except Exception as e:  # wandb must never stop or block a run
        log(f"warning: wandb unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
            "logging to stdout and metrics.jsonl only")
        return None
