"""What a run reports: per-step metrics summed on the device and reduced across ranks only on logging steps,
warnings on posterior collapse / exploding latents / a critic that has won, the one-line stdout summary,
metrics.jsonl, and wandb (which must never stop or block a run)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import data as data_lib
import plots
from common import DistInfo, atomic_write, console_lost, first_line
from config import DataConfig, RunConfig


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
    a discriminator that has won. `encoder_trains` False (--train_parts decoder): the latent is the frozen
    source's, which no KL weight moves, so its collapse is not warned about."""

    def __init__(self, log, encoder_trains: bool = True):
        self.log, self.active, self.encoder_trains = log, set(), encoder_trains

    def check(self, m: dict, step: int, gan_active: bool = True) -> None:
        conditions = {
            "posterior_collapse": (self.encoder_trains and m.get("latent/collapsed_fraction", 0) >= 0.5,
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


# How the stdout line shows the loss terms it knows; any other loss/<name> (a new term) appears as <name>.
TERM_LABELS = {"loss/perceptual": "lpips", "loss/pooled_mse": "pmse", "loss/lowpass_mse": "lpmse", "loss/kl": "kl"}
GAN_LABELS = {"loss/gan_g": "g", "loss/disc": "d"}
NOT_TERMS = ("loss/total", "loss/adaptive_weight")


def speed_text(metrics: dict) -> str:
    """The line's speed: img/s and its average, below 1 img/s to three significant digits (never 0.0 img/s); where
    a step takes a second or more (a large video model), the seconds per step first."""
    def rate(value: float) -> str:
        return f"{value:.1f}" if value >= 1 else f"{value:.3g}"
    avg = metrics.get("img_per_s_avg")
    step_s = metrics.get("s_per_step", 0.0)
    if step_s >= 1:
        return f"{step_s:.1f} s/step ({rate(metrics['img_per_s'])} img/s" + (f", avg {rate(avg)})" if avg else ")")
    return f"{rate(metrics['img_per_s'])} img/s" + (f" (avg {rate(avg)})" if avg is not None else "")


def log_line(metrics: dict, step: int, max_steps: int, gan: bool) -> str:
    """The stdout line of a logging step: the total, then every loss term in the metrics (known ones first)."""
    terms = [k for k in TERM_LABELS if k in metrics]
    terms += sorted(k for k in metrics if k.startswith("loss/") and k not in TERM_LABELS and k not in GAN_LABELS
                    and k not in NOT_TERMS)
    line = [f"step {step}/{max_steps}", f"loss {metrics.get('loss/total', float('nan')):.4f}"]
    line += [f"{TERM_LABELS.get(k, k[len('loss/'):])} {metrics[k]:{'.5f' if k.endswith('mse') else '.4f'}}"
             for k in terms]
    if gan:
        line += [f"{label} {metrics.get(k, 0):.4f}" for k, label in GAN_LABELS.items()]
        line.append(f"dacc {metrics.get('gan/disc_acc', 0):.2f}")
    line += [f"z mean {metrics.get('latent/mean', 0):+.3f} std {metrics.get('latent/std', 0):.3f}",
             speed_text(metrics), f"eta {fmt_duration(metrics['eta_s'])}"]
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


def logged_keys(path: str, step: int) -> set[str]:
    """The keys metrics.jsonl holds for `step` (every record of that step together)."""
    if not os.path.isfile(path):
        return set()
    keys = set()
    with open(path) as f:
        for line in f:
            record = json.loads(line) if line.strip() else {}
            if record.get("step") == step:
                keys.update(record)
    return keys


def truncate_jsonl(path: str, step: int) -> None:
    """After a resume, drop log lines of steps the crashed run did after its last checkpoint."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write(path, lambda f: f.write("".join(kept).encode()))


def init_wandb(run: RunConfig, config: dict, log=print):
    """A wandb run resumed under the run directory's stored id, or None (disabled, no key, or wandb failing)."""
    mode, project, name, run_dir = run.wandb_mode, run.project_name, run.run_name, run.run_dir
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
        log(f"warning: wandb unavailable ({type(e).__name__}: {first_line(e)}); "
            "logging to stdout and metrics.jsonl only")
        return None


def skipped_counts(loader, info: DistInfo) -> dict[str, int]:
    """The data stream's counters (data.DATA_COUNTS: skip events, distinct bad files, outage waits), summed over
    the ranks."""
    skipped = loader.skipped()
    counts = torch.tensor(list(skipped.values()), dtype=torch.float64)
    if info.distributed:
        dist.all_reduce(counts, group=info.ctrl_group)
    return dict(zip(skipped, (int(c) for c in counts.tolist())))


@torch.no_grad()
def latent_metrics(metrics: Metrics, mean: torch.Tensor, logvar: torch.Tensor | None, accum: int,
                   posterior_var: float) -> None:
    """A micro-batch's latent statistics into `metrics` (averaged over the step's micro-batches)."""
    mean = mean.float()
    channel_std = mean.std(dim=(0, 2, 3))
    noise_std = (torch.exp(0.5 * logvar.float()).mean(dim=(0, 2, 3)) if logvar is not None
                 else torch.full_like(channel_std, math.sqrt(posterior_var)))
    collapsed = (channel_std / noise_std < 0.1).float().mean()
    metrics.add(**{"latent/mean": mean.mean() / accum, "latent/std": mean.std() / accum,
                   "latent/channel_mean": mean.mean(dim=(0, 2, 3)) / accum,
                   "latent/channel_std": channel_std / accum,
                   "latent/collapsed_fraction": collapsed / accum})
    metrics.max(**{"latent/abs_max": mean.abs().amax(),
                   "latent/channel_abs_max": mean.abs().amax(dim=(0, 2, 3))})
    if logvar is not None:
        metrics.add(**{"latent/logvar_mean": logvar.float().mean() / accum})


CURVES_EVERY_S = 60.0


def fixed_sample_images(data: DataConfig, count: int) -> torch.Tensor:
    """The first `count` images of the test set (or the training set): the same in every grid of a run. With
    --video_frames, the first count / 4 clips (at least one): a grid row is a clip's frames."""
    frames = data.video_frames
    count = max(1, count // 4) if frames else count
    batches = data_lib.iter_eval_batches(data.test_dataset_url or data.dataset_url, data.vae_resolution, count,
                                         max_images=count, max_pixels=data.max_image_pixels, frames=frames,
                                         frame_stride=data.video_frame_stride)
    empty = torch.zeros(0, 3, *((frames,) if frames else ()), data.vae_resolution, data.vae_resolution,
                        dtype=torch.uint8)
    return next(iter(batches), (None, empty))[1]


def grid_tiles(x: torch.Tensor, recon: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tiles, per row) of a grid of inputs over reconstructions: images in one row over theirs; clips a row each
    (their frames), each over its reconstruction's."""
    if x.dim() == 4:
        return torch.cat([x, recon]), len(x)
    rows = [clip.transpose(0, 1) for pair in zip(x, recon) for clip in pair]
    return torch.cat(rows), x.shape[2]


class Reporter:
    """Everything a run shows its user, behind one object (torchtitan's metrics processor): the start-up lines,
    the stdout lines, metrics.jsonl, wandb, the sample grids and the evaluation's printout and grids. Rank 0
    writes; the others call the same methods and write nothing (the warnings' tracker prints through `log`)."""

    def __init__(self, run: RunConfig, data: DataConfig, info: DistInfo, *, max_steps: int, grad_accum: int = 1,
                 gan: bool = False, channels_last: bool = True, wandb_run=None, encoder_trains: bool = True):
        """`run`: where and how often; `data`: the images of the sample grids (the first --num_samples of the test
        set, else the training set), their size, and the batch (with `grad_accum` and the ranks: img/s)."""
        self.run, self.info, self.is_main, self.run_dir = run, info, info.is_main, run.run_dir
        self.max_steps, self.gan, self.channels_last = max_steps, gan, channels_last
        self.resolution = data.vae_resolution
        self.images_per_step = data.batch_size * grad_accum * info.world_size
        self.sample_dir = os.path.join(self.run_dir, "samples")
        self.wandb = wandb_run
        self.tracker = CollapseTracker(self.log, encoder_trains)
        self.sample_images = fixed_sample_images(data, run.num_samples) if info.is_main else None
        self.curves_failed = False  # said once; the run goes on without curves.png
        # the first plot a minute into the run, not at its first checkpoint: a short run (a test, a smoke run)
        # draws once, at its end
        self.curves_drawn_at, self.curves_due = time.monotonic(), False
        self.timed_images, self.timed_seconds = 0, 0.0  # every logged window of this process, for img_per_s_avg
        self.progress = None  # tqdm's bar on an interactive terminal (rank 0); plain lines otherwise
        # train.log, the run's own copy of every line printed here (rank 0): held until the run directory exists
        self.transcript: list[str] = []
        self.transcript_path: str | None = None
        self.console_loss_said = False

    # A run that logs every 50 steps would be silent for minutes at the start: it also logs at steps 1 and 10.
    EARLY_LOG_STEPS = (1, 10)

    def log_due(self, step: int) -> bool:
        every = self.run.log_every_n_steps
        return step % every == 0 or (every > max(self.EARLY_LOG_STEPS) and step in self.EARLY_LOG_STEPS)

    def step_done(self, step: int) -> None:
        """Moves the progress bar, on an interactive terminal only: under SLURM, in a pipe or a file, stdout
        keeps its plain lines."""
        if not self.is_main or not sys.stdout.isatty():
            return
        if self.progress is None:
            from tqdm import tqdm
            self.progress = tqdm(total=self.max_steps, initial=step - 1, unit="step", dynamic_ncols=True,
                                 smoothing=0.05)
        self.progress.update(step - self.progress.n)

    def _save_grid(self, grid: torch.Tensor, path: str) -> None:
        """A grid (floats in [0, 1]) as a PNG for people: its tiles enlarged by a whole factor, nearest neighbour
        (plots.enlarge_for_viewing: every k-th pixel is the reconstruction exactly)."""
        import torchvision
        grid = plots.enlarge_for_viewing(grid, self.resolution)
        atomic_write(path, lambda f: torchvision.utils.save_image(grid, f, format="png"))

    def plot_curves(self, final: bool = False) -> None:
        """curves.png in the run directory, from metrics.jsonl: at a checkpoint or an evaluation, at most once
        every CURVES_EVERY_S from the run's start (matplotlib takes about a second, which every rank waits for),
        and at the run's end
        (`final`, from close) if a plot was skipped since. A plot that fails (matplotlib missing or broken) is said
        once and never stops the run."""
        if not self.is_main or self.curves_failed:
            return
        now = time.monotonic()
        if not final and now - self.curves_drawn_at < CURVES_EVERY_S:
            self.curves_due = True
            return
        if final and not self.curves_due:
            return
        self.curves_drawn_at, self.curves_due = now, False
        try:
            plots.plot_metrics(self.run_dir)
        except Exception as e:
            self.curves_failed = True
            self.log(f"warning: curves.png not written ({type(e).__name__}: {first_line(e)}); "
                     "training goes on")

    def log(self, msg: str) -> None:
        if self.is_main:
            self.print(msg)

    def print(self, line: str, file=None) -> None:
        """A line to stdout (or `file`), above the progress bar when there is one, and to train.log. A console that
        is gone (common.Console: a dead `tee`, a closed ssh session, a full disk) costs nothing but the console: the
        line still reaches train.log, which says once that the console was lost."""
        if self.progress is not None:
            self.progress.write(line, file=file or sys.stdout)
        else:
            print(line, file=file or sys.stdout, flush=True)
        self.transcribe(line)
        lost = console_lost()
        if lost is not None and not self.console_loss_said and self.is_main:
            self.console_loss_said = True
            self.transcribe(f"warning: the console ({lost[0]}) was lost ({type(lost[1]).__name__}: {lost[1]}); the "
                            "run goes on, its lines continue here and in metrics.jsonl")

    def transcribe(self, line: str) -> None:
        if not self.is_main:
            return
        if self.transcript_path is None:
            self.transcript.append(line)
            return
        try:
            with open(self.transcript_path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass  # a full disk: the checkpoint's own write says so

    def start_transcript(self) -> None:
        """train.log from here on (the run directory exists): the lines held so far first; a resumed run appends."""
        if not self.is_main:
            return
        self.transcript_path = os.path.join(self.run_dir, "train.log")
        held, self.transcript = self.transcript, []
        self.transcribe(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}")
        for line in held:
            self.transcribe(line)

    def metrics(self, metrics: dict, step: int, elapsed: float, steps_done: int, lr_vae: float,
                skipped: dict[str, int]) -> None:
        """A logging step (the metrics reduced over the `steps_done` steps of the last `elapsed` seconds, the
        learning rate, the data stream's skip counts): the warnings, the stdout line, metrics.jsonl, wandb."""
        elapsed = max(1e-9, elapsed)
        images_per_step = self.images_per_step
        self.timed_images += steps_done * images_per_step
        self.timed_seconds += elapsed
        # img/s over the steps since the last line (what the run does now), img/s averaged over every step of this
        # process (steady: one slow window moves it little), and the ETA from that average
        metrics["img_per_s"] = steps_done * images_per_step / elapsed
        metrics["s_per_step"] = elapsed / max(1, steps_done)  # (the line shows it where a step takes seconds)
        metrics["img_per_s_avg"] = self.timed_images / self.timed_seconds
        metrics["eta_s"] = (self.max_steps - step) * images_per_step / metrics["img_per_s_avg"]
        metrics["lr/vae"] = lr_vae
        metrics.update({f"data/skipped_{k}": v for k, v in skipped.items()})
        # the critic winning matters once the generator fights back: a window with generator GAN steps
        self.tracker.check(metrics, step, gan_active="loss/gan_g" in metrics)
        if not self.is_main:
            return
        self.print(log_line(metrics, step, self.max_steps, self.gan))
        append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), {"step": step, **metrics})
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=step)

    def probe(self, step: int, probe_loss: float, seconds: float) -> None:
        """The in-loop diffusability probe's held-out loss: a line, a metrics.jsonl record, wandb."""
        if not self.is_main:
            return
        self.print(f"probe step {step} | eval/probe_loss {probe_loss:.5f} (diffusability: lower is better; "
                   f"{seconds:.1f} s)")
        append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), {"step": step, "eval/probe_loss": probe_loss})
        if self.wandb is not None:
            self.wandb.log({"eval/probe_loss": probe_loss}, step=step)

    @torch.no_grad()
    def sample_grid(self, vae, autocast, step: int) -> str | None:
        """The fixed images over their reconstructions as samples/step_<step>.png (and on wandb)."""
        import torchvision
        if not self.is_main or len(self.sample_images) == 0:
            return None
        x = data_lib.to_model_input(self.sample_images, self.info.device, self.channels_last)
        training = vae.training  # decoded as at inference: eval mode (a BatchNorm's statistics stay), no graph
        vae.eval()
        try:
            with torch.no_grad(), autocast():
                recon = vae.decode(vae.encode(x)).float()
        finally:
            vae.train(training)
        tiles, per_row = grid_tiles(x, recon.clamp(-1, 1))
        grid = torchvision.utils.make_grid(tiles.float().cpu() * 0.5 + 0.5, nrow=per_row, padding=2)
        path = os.path.join(self.sample_dir, f"step_{step:08d}.png")
        self._save_grid(grid, path)
        self.plot_curves()
        if self.wandb is not None:
            import wandb
            self.wandb.log({"samples": wandb.Image(path, caption="top: input, bottom: reconstruction")}, step=step)
        return path

    def evaluation(self, results: dict, grids: dict[str, torch.Tensor], step: int, best: dict | None = None) -> None:
        """An evaluation's results ({prefix/metric: value}, prefixes eval and eval_ema) and its uint8 grids
        ({prefix: grid}): the grids as PNGs, two stdout lines, a metrics.jsonl record, wandb with spectra. `best`:
        the best evaluated step's record so far (checkpoint.BestCheckpoint), at the end of the first line and as
        best/step and best/<metric> in the record."""
        if not self.is_main:
            return
        for prefix, grid in grids.items():
            path = os.path.join(self.sample_dir, f"{prefix}_step_{step:08d}.png")
            self._save_grid(grid.float() / 255, path)
            if self.wandb is not None:
                import wandb
                self.wandb.log({f"{prefix}/grid": wandb.Image(path)}, step=step)

        def fmt(prefix, suffix):
            vals = [f"{k} {results[f'{prefix}/{k}{suffix}']:.4f}"
                    for k in ("psnr", "ssim", "lpips", "rfid", "temporal_psnr", "tlp")
                    if results.get(f"{prefix}/{k}{suffix}") is not None]
            clips = results.get(f"{prefix}/n_clips{suffix}")
            return " ".join(vals) + (f" ({clips} clips, {results[f'{prefix}/n_images{suffix}']} frames)" if clips
                                     else f" ({results[f'{prefix}/n_images{suffix}']} images)")
        # the training size's line, then one per other size of --eval_resolutions (its keys end in @SIZE)
        for suffix in [""] + [k[len("eval/n_images"):] for k in results if k.startswith("eval/n_images@")]:
            line = f"eval{' ' + suffix if suffix else ''} step {step} | {fmt('eval', suffix)}"
            if "eval_ema" in grids:
                line += f" | ema {fmt('eval_ema', suffix)}"
            if best is not None and not suffix:
                line += f" | best {best['metric']} {best['value']:.4f} at step {best['step']}"
            self.print(line)
        self.print(f"latents step {step} | high-frequency energy {results['eval/latent_hf_fraction']:.3f} "
                   f"(image at latent size {results['eval/image_hf_fraction']:.3f}) | channel std spread "
                   f"{results['eval/latent_channel_std_spread']:.2f}")
        if best is not None:
            results = {**results, "best/step": best["step"], f"best/{best['metric']}": best["value"]}
        append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), {"step": step, **results})
        self.plot_curves()
        if self.wandb is not None:
            import wandb

            import latents as latents_lib
            plots = {f"{p}/latent_spectrum_plot": latents_lib.wandb_spectrum_plot(
                wandb, results[f"{p}/latent_spectrum"], results[f"{p}/image_spectrum"],
                f"{p} power spectrum, step {step}") for p in grids}
            self.wandb.log({**{k: v for k, v in results.items() if not isinstance(v, list)}, **plots}, step=step)

    def close(self) -> None:
        self.plot_curves(final=True)
        if self.progress is not None:
            self.progress.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass
