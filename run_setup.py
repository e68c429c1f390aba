"""From argv to a run that can start: the disk and network work of finishing a config (config.py holds only
values). In order: the flags and --demo's values, the demo's bundled data and its VGG16 choice, the architecture
of an --init_from source, the recipe of the run this one continues (every value not given again; the automatic
values derived again where their basis changed), the remaining automatic values, the checks of values
(Config.validate), then those of paths and remote data.

    setup = prepare_run(sys.argv[1:])     # RunSetup: cfg, given, source, notes, derived; ConfigError: one line
"""
from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from typing import Any

import data as data_lib
import families
import layouts
import shards
import sharding
import sources
from checkpoint import RunRecord, checkpoint_files, read_run
from clips import VIDEO_EXTS
from common import ConfigError, redact
from sources import IMAGE_EXTS
from flags import DEMO_OWN_DATA_RUN, parse_flags
from config import (FIELD_SECTION, SOURCE_FIELDS, Config, DataConfig, as_released, as_written_now,
                    downsample_factor_of, eval_sizes, is_plain_local_path, min_loss_image_size,
                    resolve_auto, unflatten, uses_vgg16, with_legacy_arch, with_values)
from latents import equivariance_sizes_of
from weights import vgg16_cache_path


@dataclass
class RunSetup:
    """A finished run config and what was learned on the way to it: the flags the user gave, the --init_from
    source read (None if none: its weights go into the model), notes for the user, `derived`: {automatic
    field: what it was derived from} (config.json's record, read back when the run continues), and the
    --distill_from teacher read (None if none), and `record`: what was read of the run this one may continue
    (checkpoint.read_run: config.json and --resume's checkpoint, each read once), which the trainer's start
    (vae_trainer.Start.settle) decides from instead of reading them again."""
    cfg: Config
    given: set[str]
    source: layouts.Source | None
    notes: list[str]
    derived: dict[str, str | None]
    teacher: layouts.Source | None = None
    record: RunRecord | None = None

    def __iter__(self):  # cfg, given, source, notes = prepare_run(...)
        return iter((self.cfg, self.given, self.source, self.notes))


def prepare_run(argv: list[str] | None = None, builds_demo_data: bool = True) -> RunSetup:
    """argv -> the run's finished, validated config (RunSetup). `builds_demo_data`: this process builds the demo's
    shards (local rank 0); the others wait for them. Raises ConfigError (one line) for anything the user can fix."""
    cfg, given = parse_flags(argv)
    if cfg.run.demo:
        if not builds_demo_data:
            shards.wait_for_demo_shards(os.path.join(cfg.run.output_dir, "demo_data"))
        cfg = prepare_demo(cfg, given)
    record = read_run(cfg.run)  # (the demo may have named the run: read after it)
    cfg, source = apply_init_source(cfg, given, record)
    cfg, teacher, student = apply_teacher(cfg, given, source)
    saved = saved_run_config(cfg, given | (set(SOURCE_FIELDS) if source is not None else student), record)
    derived, again = {}, []
    if saved is not None:
        cfg, derived, again = continue_run(cfg, given, saved)
    if families.named(cfg.model.vae_family).needs_source and source is None and saved is None:
        raise ConfigError(f"--vae_family {cfg.model.vae_family}: its architecture is read from --init_from (a "
                          "diffusers folder of the family) or the run being continued")
    derived.update(automatic_values(cfg, given))
    cfg = with_values(cfg, **families.named(cfg.model.vae_family).settled(cfg.model, given))
    cfg = resolve_cpu(resolve_auto(cfg))
    check_config(cfg)
    notes = check_paths(cfg) + ([demo_summary(cfg)] if cfg.run.demo else [])
    if saved is not None:
        note = continuing_note(cfg.run.run_dir, given, saved, cfg, again)
        notes += [note] if note else []
    return RunSetup(cfg, given, source, notes, derived, teacher, record)


def parse_config(argv: list[str] | None = None) -> Config:
    """The config of these flags with every automatic value resolved, the CPU split from this machine's cores
    (nothing read from disk: no --init_from source, no run being continued)."""
    return resolve_cpu(resolve_auto(parse_flags(argv)[0]))


def check_config(cfg: Config) -> None:
    """Config.validate (each section's values and the checks across sections), then the checks that need an owner's
    rule: one line for the first value the run cannot use."""
    family = families.named(cfg.model.vae_family)
    # first: a family's refusal says why in its own words
    family.check(cfg.model, cfg.finetune, cfg.loss, cfg.speed, cfg.data, cfg.run)
    cfg.validate()
    data, loss, latents = cfg.data, cfg.loss, cfg.latents
    factor = downsample_factor_of(cfg.model)
    smallest = min_loss_image_size(cfg)
    if latents.scale_equivariance_prob > 0 and not equivariance_sizes_of(
            factor, data.vae_resolution, latents.scale_equivariance_mode, loss.mse_pool_factor, smallest):
        critic_text = (f" and at least {smallest} px (the smallest input of the critic or LPIPS)" if smallest > 1
                       else "")
        raise ConfigError(f"--scale_equivariance_mode {latents.scale_equivariance_mode}: no smaller size of the "
                          f"{data.vae_resolution // factor}-pixel latent gives an image divisible by --mse_pool_factor "
                          f"{loss.mse_pool_factor}{critic_text}")


def prepare_demo(cfg: Config, given: set[str] = frozenset()) -> Config:
    """Point the demo at its bundled shards (built once) where the user gave no data of their own, and pick VGG
    weights it can use offline. The demo's values (flags.DEMO) are defaults: a flag the user gave is kept, or,
    where it cannot work without VGG16 weights, refused in one line."""
    train_url, test_url = shards.ensure_demo_shards(os.path.join(cfg.run.output_dir, "demo_data"))
    changes = {}
    if not cfg.data.dataset_url:
        changes["dataset_url"] = train_url
    elif "run_name" not in given:  # the demo's settings on the user's images: not the demo's run to continue
        changes["run_name"] = DEMO_OWN_DATA_RUN
    if not cfg.data.test_dataset_url:
        changes["test_dataset_url"] = test_url
    if "vgg16_weights" not in given and cfg.critic.vgg16_weights == "torchvision" and \
            not os.path.isfile(vgg16_cache_path()):
        # LPIPS and the VGG16 critic on a random VGG16 would train on noise gradients: the demo's own choice of
        # them is switched off (demo_summary says so), a PatchGAN (no VGG16) kept; what the user asked for is refused
        vgg_critic = cfg.critic.do_ganloss and cfg.critic.discriminator == "vgg16"
        lpips_given = "perceptual_weight" in given and cfg.loss.perceptual_weight > 0
        gan_given = [f"--{f}" for f in ("do_ganloss",) + GAN_FLAGS if f in given] if vgg_critic else []
        if lpips_given or gan_given:
            needs = ([f"--perceptual_weight {cfg.loss.perceptual_weight} (LPIPS)"] if lpips_given else []) + \
                ([f"{', '.join(gan_given)} (the vgg16 critic)"] if gan_given else [])
            fixes = (["--perceptual_weight 0"] if lpips_given else []) + \
                (["--discriminator patchgan (no VGG16)"] if gan_given else [])
            raise ConfigError(f"--demo: {' and '.join(needs)} would train on the features of a random VGG16: no "
                              f"pretrained one in the torchvision cache ({vgg16_cache_path()}); put it there "
                              f"(docs/training.md#offline-weights), give --vgg16_weights PATH, or "
                              f"{' and '.join(fixes)}")
        changes.update(vgg16_weights="random", perceptual_weight=0.0,
                       do_ganloss=cfg.critic.do_ganloss and not vgg_critic)
    return with_values(cfg, **changes)


def read_init_source(init_from: str, init_family: str, video: bool = False,
                     vae_family: str | None = None) -> layouts.Source:
    """The --init_from source (`video`: the run takes clips; `vae_family`: the family the user asked for)."""
    try:
        return families.load_source(init_from, init_family, video, vae_family)
    except layouts.SourceError as e:
        raise ConfigError(f"--init_from {e}") from None


def apply_init_source(cfg: Config, given: set[str] = frozenset(), record: RunRecord | None = None
                      ) -> tuple[Config, layouts.Source | None]:
    """--init_from: load the source and take the run's architecture from it (one ConfigError line if it does not
    load; its family may change more, families.Family.apply_source). Runs before the checks, on every rank, before
    any process group exists. `record`: the run's config.json as read_run read it (None: read here)."""
    init_from = cfg.finetune.init_from
    if not init_from:
        return cfg, None
    record = record if record is not None else read_run(cfg.run)
    if cfg.run.resume != "never" and record.config is not None and has_checkpoints(cfg.run.run_dir):
        # a run being resumed needs its architecture, not the source's weights (which may be GBs, or have moved):
        # its config.json has it, and its checkpoint the weights and the model's params
        saved = record.config
        same_kind = bool(saved.get("video_frames")) == bool(cfg.data.video_frames)
        if same_kind and saved.get("init_from") == init_from:  # (clips for images: the source says which model)
            then = as_released(saved)  # (an architecture flag given again is the user's: the checks compare it)
            return with_values(cfg, **{k: then[k] for k in SOURCE_FIELDS if k not in given}), None
    source = read_init_source(init_from, cfg.finetune.init_family, cfg.data.video_frames > 0,
                              cfg.model.vae_family if "vae_family" in given else None)
    family = families.of_params(source.params)
    cfg = with_values(cfg, **family.apply_source(cfg.model, cfg.finetune, given, source))
    channels = family.image_channels(source.params)
    if channels != (3, 3):
        raise ConfigError(f"--init_from {init_from}: a VAE of {channels[0]} input / {channels[1]} output "
                          "channels; this trainer reads RGB images")
    return cfg, source


def apply_teacher(cfg: Config, given: set[str], source: layouts.Source | None
                  ) -> tuple[Config, layouts.Source | None, set[str]]:
    """--distill_from: the teacher read (every rank, before any process group) and the student made a tiny
    autoencoder (--vae_family tae unless given) of the teacher's latent: its channels, spatial and temporal factors
    (families.TAE.student_of), unless --init_from gave a released one (which must fit that latent). Returns the config,
    the teacher and the fields the teacher set."""
    path = cfg.finetune.distill_from
    if not path:
        return cfg, None, set()
    teacher = read_teacher(cfg)
    if "vae_family" not in given and source is None:
        cfg = with_values(cfg, vae_family=families.TAE_FAMILY.name)
    student = families.named(cfg.model.vae_family)
    arch = student.student_of(teacher, cfg.model)  # (ConfigError: a family that distils no student, a latent no
    if source is not None:                          # student layout has)
        student.check_student(source.params, arch, path)
        return cfg, teacher, set()
    arch = {k: v for k, v in arch.items() if k not in given}
    return with_values(cfg, **arch), teacher, set(arch)


def read_teacher(cfg: Config) -> layouts.Source:
    """The --distill_from teacher (a single file's release: --init_family, where --init_from does not take it)."""
    try:
        return families.load_source(cfg.finetune.distill_from,
                                    "auto" if cfg.finetune.init_from else cfg.finetune.init_family,
                                    cfg.data.video_frames > 0)
    except layouts.SourceError as e:
        raise ConfigError(f"--distill_from {e}") from None


def has_checkpoints(run_dir: str) -> bool:
    return bool(checkpoint_files(os.path.join(run_dir, "checkpoints")))


def saved_run_config(cfg: Config, explicit: set[str], record: RunRecord | None = None) -> dict | None:
    """The flat finished config of the run this one continues (config.json of a run directory holding checkpoints,
    or --resume's checkpoint, as `record` holds them: read_run, read here when None), or None: a new run, --resume
    never, or another architecture given (`explicit`: the fields the user or the --init_from source set; the
    trainer refuses it or, with --force, starts from scratch)."""
    run = cfg.run
    if run.resume == "never":
        return None
    record = record if record is not None else read_run(run)
    try:
        if run.resume != "auto":
            if record.resume is None:
                return None  # unreadable: the trainer's resume logic says why
            ckpt = record.resume[1]["run"]
            saved = {**ckpt.get("config", {}), **({"derived": ckpt["derived"]} if "derived" in ckpt else {})}
        elif record.config is not None and has_checkpoints(run.run_dir):
            saved = record.config
        else:
            return None
    except Exception:  # not a trainer's checkpoint: the trainer's resume logic says which
        return None
    if not isinstance(saved, dict):
        return None
    then = as_released(saved)  # a field the release that wrote it lacked: what that release did
    model = cfg.model
    same_arch = all(then[k] == getattr(model, k) for k in explicit
                    if hasattr(model, k) and getattr(model, k) != AUTO_FIELDS.get(k))  # (0 groups: automatic)
    return with_legacy_arch(saved) if same_arch else None


def check_paths(cfg: Config) -> list[str]:
    """The files the flags name exist, and the datasets can be read (remote shards probed) and are of the run's
    kind: one line each, before any process group or worker starts; returns warnings for the user."""
    critic, ev, latents, run = cfg.critic, cfg.eval, cfg.latents, cfg.run
    warnings: list[str] = []
    if critic.vgg16_weights not in ("torchvision", "random") and not os.path.isfile(critic.vgg16_weights):
        raise ConfigError(f"--vgg16_weights {critic.vgg16_weights}: no such file (or use torchvision / random)")
    if ev.inception_weights not in ("torchvision", "random", "none") and not os.path.isfile(ev.inception_weights):
        raise ConfigError(f"--inception_weights {ev.inception_weights}: no such file (or torchvision / random / "
                          "none)")
    if latents.vf_weights not in ("timm", "random") and not os.path.isfile(latents.vf_weights):
        raise ConfigError(f"--vf_weights {latents.vf_weights}: no such file (or use timm / random)")
    if run.resume not in ("auto", "never") and not (os.path.isfile(run.resume) or sharding.is_dcp_dir(run.resume)):
        raise ConfigError(f"--resume {run.resume}: no such checkpoint file or complete sharded checkpoint directory "
                          "(or use auto / never)")
    if run.load_path and not (os.path.isfile(run.load_path) or sharding.is_dcp_dir(run.load_path)):
        raise ConfigError(f"--load_path {run.load_path}: no such file or sharded checkpoint directory")
    for name in ("dataset_url", "test_dataset_url"):
        url = getattr(cfg.data, name)
        if url and is_plain_local_path(url) and not os.path.exists(url):
            raise ConfigError(f"--{name} {url}: no such directory or file")
        if name == "dataset_url" or url:
            try:
                shard_list = sources.list_shards(url)
                probed = sources.probe_remote_shards(shard_list)
            except data_lib.DatasetError as e:
                raise ConfigError(f"--{name}: {e}") from None
            warnings += check_sample_kind(name, shard_list, probed, cfg.data)
    return warnings


# The samples read to tell a dataset's kind (images or videos) at start-up: a few, by their names alone.
KIND_SAMPLES = 4


def first_samples(shard, probed: tuple[str, bytes] | None) -> tuple[list[set[str]], bool]:
    """(the extensions of each of a shard's first samples, as the stream groups them; whether they are whole
    samples), read cheaply at start-up: a local tar's first member headers (their data skipped; the last group read
    is left out, as its sample may go on), a folder's file names, a remote shard's first tar header (`probed`: what
    the start-up probe read: one member, maybe not its whole sample); none where it would cost a wait (a pipe:
    command, a remote shard not probed) or where the shard does not open (the stream says why)."""
    from webdataset.tariterators import base_plus_ext
    if isinstance(shard, tuple):
        return [{p.rsplit(".", 1)[-1].lower()} for p in shard[:KIND_SAMPLES]], True
    names, whole = [], True
    try:
        if probed is not None and probed[0] == shard:
            with tarfile.open(fileobj=io.BytesIO(probed[1]), mode="r|") as tar:
                info = tar.next()  # (a pax or long-name header first: tarfile reads the member's after it)
                names, whole = ([info.name] if info is not None and info.isreg() else []), False
        elif not sources.is_remote(shard):
            with tarfile.open(shard, "r:*") as tar:
                for info in tar:
                    names += [info.name] if info.isreg() and not info.name.startswith("__") else []
                    if len({base_plus_ext(n)[0] for n in names}) > KIND_SAMPLES:
                        names.pop()  # the first name of a sample past those looked at: every one before is whole
                        break
                    if len(names) >= 16 * KIND_SAMPLES:
                        names = [n for n in names if base_plus_ext(n)[0] != base_plus_ext(names[-1])[0]]
                        break
    except (tarfile.TarError, OSError, EOFError, ValueError):
        names = []
    samples: dict[str, set[str]] = {}
    for name in names:
        key, ext = base_plus_ext(name)
        if key is not None:
            samples.setdefault(key, set()).add(ext.lower())
    return list(samples.values())[:KIND_SAMPLES], whole


def check_sample_kind(flag: str, shard_list: list, probed: tuple[str, bytes] | None, data: DataConfig) -> list[str]:
    """One line, within seconds, when a dataset's first samples are not the kind the run reads: images for a clip
    run (--video_frames; where --video_image_prob adds images to the training clips, not checked), videos for an
    image run. The first, middle and last shards are looked at (several lists joined by :: may hold other kinds), and
    the run is refused only when every one of them that shows whole samples holds the wrong kind; a remote shard
    shows one member (the probe's), which is said as a warning (returned), not refused. What cannot be told cheaply
    (first_samples) is left to the stream."""
    if flag == "dataset_url" and data.video_frames and data.video_image_prob > 0:
        return []
    looked = list(dict.fromkeys(shard_list[i] for i in (0, len(shard_list) // 2, len(shard_list) - 1)))
    wrong, whole_seen, where = [], False, None
    for shard in looked:
        samples, whole = first_samples(shard, probed)
        exts = set().union(*samples) if samples else set()
        videos, images = exts & set(VIDEO_EXTS), exts & set(IMAGE_EXTS)
        kind = sorted(images) if data.video_frames and images and not videos else \
            sorted(videos) if not data.video_frames and videos and not images else None
        if samples and kind is None:
            return []  # a shard of the run's kind
        if kind:
            wrong.append(kind)
            whole_seen = whole_seen or whole
            where = where or (os.path.dirname(shard[0]) if isinstance(shard, tuple) else redact(shard))
    if not wrong:
        return []
    exts = ", ".join(sorted(set().union(*wrong)))
    found = f"the first samples of {where} are" if whole_seen else f"the first member of {where} is one of"
    if data.video_frames:
        line = (f"--{flag}: {found} images ({exts}), not videos: --video_frames {data.video_frames} trains on clips "
                "of videos (packed by python data.py make-clips); leave it out to train on images")
    else:
        line = (f"--{flag}: {found} videos ({exts}), not images: give --video_frames N to train on clips of them "
                "(docs/finetuning.md), or shards of images (python data.py make-shards)")
    if whole_seen:
        raise ConfigError(line)
    return [f"warning: {line} (the start-up probe reads one member of a remote shard; a run on shards without "
            "usable samples stops when its stream has found none in thousands)"]


# ==============================================================================================================
# The CPU split: data workers and torch threads from the cores this rank has
# ==============================================================================================================
def cores_per_rank() -> int:
    """The CPU cores this process may run on (its affinity: a SLURM or container limit shows there, not in
    os.cpu_count()), shared by the LOCAL_WORLD_SIZE ranks torchrun starts on this machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def cpu_use(num_workers: int, num_threads: int, cores: int) -> tuple[int, int]:
    """(data workers, torch threads) of one rank with `cores` CPU cores; a given value (>= 0 workers, > 0
    threads) is kept. Auto: half the cores decode images (at most 4: more rarely helps a GPU), at least 1, and
    the remaining cores compute; never more workers than cores (PyTorch warns about that)."""
    workers = min(4, max(1, cores // 2)) if num_workers < 0 else num_workers
    threads = max(1, cores - workers) if num_threads <= 0 else num_threads
    return workers, threads


def cpu_use_line(cfg: Config, given: set[str]) -> str:
    """The one line a run starts with: what each rank runs on, and which of it was chosen automatically."""
    chosen = [f"--{k}" for k in ("num_workers", "num_threads") if k not in given]
    return (f"cpu: {cores_per_rank()} cores per rank: {cfg.data.num_workers} data workers, {cfg.speed.num_threads} "
            f"torch threads" + (f" ({' and '.join(chosen)} chosen from the cores; give them to override)"
                                if chosen else ""))


def resolve_cpu(cfg: Config) -> Config:
    """--num_workers and --num_threads made concrete from this rank's cores (cpu_use), where they are automatic."""
    workers, threads = cpu_use(cfg.data.num_workers, cfg.speed.num_threads, cores_per_rank())
    return with_values(cfg, num_workers=workers, num_threads=threads)


# ==============================================================================================================
# Continuing a run: its recorded recipe, and the automatic values whose basis changed
# ==============================================================================================================
# The flags whose 0 / -1 means "automatic" (resolve_auto), with that sentinel. A continued run keeps the values its
# start resolved: a warm-up or a disc_start already in effect must not move when --max_steps grows (re-derived from
# a larger budget, the GAN term would switch off again), the VAE's learning rate is the schedule's history, the
# group count its architecture, and the data stream's position is saved per worker (an exact resume needs the same
# count). A value whose basis changed in kind is derived again (auto_basis): the critic's learning rate when the
# critic changes, the worker and thread counts on a machine with other cores, the shuffle buffer when the samples
# change kind (images, clips). A run recorded before a value was automatic keeps the value it recorded.
AUTO_FIELDS = {"learning_rate_vae": 0.0, "learning_rate_disc": 0.0, "warmup_steps": -1, "disc_start": -1,
               "vae_norm_groups": 0, "num_workers": -1, "num_threads": 0, "shuffle_buffer": 0}
# Never carried over from the run being continued: they say how to start this invocation, not what the run is.
PER_INVOCATION_FIELDS = ("resume", "force")


def auto_basis(cfg: Config) -> dict[str, str | None]:
    """What each automatic value is derived from, in words; None: the run's history, never derived again."""
    cores = f"{cores_per_rank()} cores per rank"
    return {"learning_rate_vae": None, "learning_rate_disc": cfg.critic.describe(), "warmup_steps": None,
            "disc_start": None, "vae_norm_groups": None, "num_workers": cores, "num_threads": cores,
            "shuffle_buffer": "clips" if cfg.data.video_frames else "images"}


def value(cfg: Config, name: str):
    """A value by flag name."""
    return getattr(getattr(cfg, FIELD_SECTION[name]), name)


def automatic_values(cfg: Config, given: set[str]) -> dict[str, str | None]:
    """{field: its basis} of the values left automatic in `cfg` (before resolve_auto), for config.json's
    "derived" record."""
    basis = auto_basis(cfg)
    return {k: basis[k] for k, sentinel in AUTO_FIELDS.items() if k not in given and value(cfg, k) == sentinel}


def continue_run(cfg: Config, given: set[str], saved: dict) -> tuple[Config, dict, list[tuple[str, Any, str, str]]]:
    """The config of a run that continues `saved` (the flat config its start recorded): every value not given
    again is the saved one (the whole recipe, not only the automatic values), and an automatic value whose basis
    changed in kind is set back to automatic. Returns (cfg, the "derived" record of the values kept automatic,
    [(name, value then, basis then, basis now)] of those derived again)."""
    saved = with_legacy_arch(saved)
    cfg = unflatten({k: v for k, v in saved.items() if k not in given and k not in PER_INVOCATION_FIELDS}, cfg)
    record = saved.get("derived")
    if not isinstance(record, dict):  # written before the record existed: what that code kept, and the thread
        # count it derived anew on every start (basis unknown); the critic's rate was automatic if it is the one
        # its critic derives
        record = {k: None for k in ("learning_rate_vae", "warmup_steps", "disc_start", "vae_norm_groups",
                                    "num_workers")}
        record["num_threads"] = "an earlier machine"
        then = unflatten({k: saved[k] for k in ("discriminator", "critic_trunk", "learning_rate_vae")
                          if k in saved}, with_values(cfg, learning_rate_disc=0.0))
        if saved.get("learning_rate_disc") == resolve_auto(then).critic.learning_rate_disc:
            record["learning_rate_disc"] = then.critic.describe()
    now, kept, again = auto_basis(cfg), {}, []
    for name, basis in record.items():
        if name in given or name not in AUTO_FIELDS:
            continue
        if basis is not None and now[name] != basis:
            cfg = with_values(cfg, **{name: AUTO_FIELDS[name]})
            again.append((name, saved.get(name), basis, now[name]))
        else:
            kept[name] = basis
    return cfg, kept, again


def continuing_note(run_dir: str, given: set[str], saved: dict, cfg: Config,
                    again: list[tuple[str, Any, str, str]]) -> str | None:
    """The one line that names every value a continued run changes: the flags given again with another value, and
    the automatic values derived again (with why)."""
    changed = [f"--{k} {saved[k]} -> {value(cfg, k)}" for k in sorted(given)
               if k in saved and as_written_now(k, saved[k]) != value(cfg, k) and k not in PER_INVOCATION_FIELDS]
    derived = [f"--{k} {then} -> {value(cfg, k)} ({basis_now}, not {basis_then})"
               for k, then, basis_then, basis_now in again if then != value(cfg, k)]
    parts = ([f"flags changed since its start: {', '.join(changed)}"] if changed else []) + \
        ([f"derived again: {', '.join(derived)}"] if derived else [])
    return f"note: continuing {run_dir} with {'; '.join(parts)}" if parts else None


# ==============================================================================================================
# What the user is told about a valid config
# ==============================================================================================================
# Flags that only matter with --do_ganloss.
GAN_FLAGS = ("discriminator", "disc_type", "disc_norm", "gen_loss", "gan_weight", "gan_margin", "disc_start",
             "learning_rate_disc", "lecam_weight", "adaptive_weight_max")


# Flags that only matter when evaluation runs.
EVAL_FLAGS = ("eval_max_images", "inception_weights", "eval_resolutions", "eval_tile_size", "eval_tile_overlap")


def config_warnings(cfg: Config, given: set[str]) -> list[str]:
    """One-line warnings for a valid but probably unintended config: flags the user gave that the chosen
    configuration ignores (one line per cause; defaults and --demo's values are never named), and schedules
    that cannot play out within --max_steps."""
    model, loss, critic, optim, latents, ev = cfg.model, cfg.loss, cfg.critic, cfg.optim, cfg.latents, cfg.eval
    ignored_when = [  # (flags, ignored in this config, why)
        (GAN_FLAGS, not critic.do_ganloss, "without --do_ganloss"),
        (("disc_norm",), critic.discriminator == "vgg16", "with --discriminator vgg16 (it normalises the "
                                                          "PatchGANs only)"),
        (("gan_margin",), loss.gen_loss != "thresholded", f"with --gen_loss {loss.gen_loss} (it is the margin of "
                                                            "the thresholded loss)"),
        (("adaptive_weight_max",), loss.loss_balance != "adaptive", f"with --loss_balance {loss.loss_balance} (it "
                                                                    "clamps the adaptive weight)"),
        (("clamp_th",), not model.do_clamp, "without --do_clamp"),
        (("posterior_var",), model.posterior != "constant", f"with --posterior {model.posterior} (the encoder "
                                                            "predicts the variance)"),
        # --evaluate_every_n_steps 0 is the off switch: consistent with no test set, never "ignored"
        (("evaluate_every_n_steps",) * (ev.evaluate_every_n_steps > 0) + EVAL_FLAGS,
         not cfg.data.test_dataset_url, "without --test_dataset_url"),
        (EVAL_FLAGS, ev.evaluate_every_n_steps == 0, "with --evaluate_every_n_steps 0"),
        (("eval_tile_overlap",), ev.eval_tile_size == 0, "without --eval_tile_size"),
        (("eval_tile_size", "eval_tile_overlap"), ev.eval_tile_size >= max(eval_sizes(ev, cfg.data.vae_resolution)),
         "when no evaluated size (--vae_resolution, --eval_resolutions) is above --eval_tile_size"),
        (("project_name",), cfg.run.wandb_mode == "disabled", "with --wandb_mode disabled"),
        (("scale_equivariance_mode", "scale_equivariance_rotate", "scale_equivariance_form",
          "scale_equivariance_weight"), latents.scale_equivariance_prob == 0, "with --scale_equivariance_prob 0"),
        (("scale_equivariance_weight",), latents.scale_equivariance_form != "add", "with --scale_equivariance_form "
                                                                                  "replace"),
        (("latent_noise_max",), latents.latent_noise_prob == 0, "with --latent_noise_prob 0"),
        (("vf_weight", "vf_model", "vf_weights", "vf_image_size"), cfg.finetune.train_parts == "decoder",
         "with --train_parts decoder (the encoder is frozen: there is no latent to align)"),
        (("vf_model", "vf_weights", "vf_image_size"), latents.vf_weight == 0, "with --vf_weight 0"),
        (("probe_images", "probe_heldout", "probe_steps", "probe_batch_size"), latents.probe_every_n_steps == 0,
         "with --probe_every_n_steps 0"),
        (tuple(f for f in SOURCE_FIELDS if f != "vae_decoder_ch"), bool(cfg.finetune.init_from),
         "with --init_from (the architecture is read from the source)"),
        (("init_family",), not cfg.finetune.init_from, "without --init_from"),
        (("decoder_init",), not (cfg.finetune.init_from and "vae_decoder_ch" in given), "without --init_from and "
                                                                                          "--vae_decoder_ch"),
        (("video_frame_stride", "video_image_prob", "video_pass_frames"), not cfg.data.video_frames,
         "without --video_frames"),
    ]
    lines, named = [], set()
    for flags, ignored, why in ignored_when:
        hit = [f for f in flags if f in given and f not in named] if ignored else []
        if hit:
            named.update(hit)
            verb = "has" if len(hit) == 1 else "have"
            lines.append(f"warning: {', '.join('--' + f for f in hit)} {verb} no effect {why}")
    if cfg.data.video_frames and cfg.data.shuffle_buffer > 256:
        lines.append(f"warning: --shuffle_buffer {cfg.data.shuffle_buffer} holds that many videos' raw bytes per "
                     "micro-batch's lanes (x --grad_accum per rank): with clips of a few MB that is GBs of memory; "
                     "64-256 is plenty for clips")
    if optim.warmup_steps > optim.max_steps:
        lines.append(f"warning: --warmup_steps {optim.warmup_steps} > --max_steps {optim.max_steps}: the learning "
                     f"rate peaks at {optim.max_steps / optim.warmup_steps:.0%} of its set value and never decays")
    if cfg.finetune.train_parts == "decoder" and not (cfg.finetune.init_from or cfg.run.load_path or
                                                      cfg.finetune.distill_from):
        lines.append("warning: --train_parts decoder without --init_from or --load_path: the encoder stays random "
                     "(unless resumed)")
    stages = cfg.data.stages
    if len(stages) > 1 and stages[-1][0] >= optim.max_steps:
        lines.append(f"warning: --train_resolutions' last stage starts at step {stages[-1][0]} >= --max_steps "
                     f"{optim.max_steps}: it never trains" + (" (nor does --last_stage_trains freeze anything)"
                                                              if cfg.finetune.last_stage_trains != "all" else ""))
    if critic.do_ganloss and loss.disc_start >= optim.max_steps:
        lines.append(f"warning: --disc_start {loss.disc_start} >= --max_steps {optim.max_steps}: the generator "
                     "never gets the adversarial term (the critic still trains)")
    return lines


def demo_summary(cfg: Config) -> str:
    """The demo's one start-up line: which loss branches it trains and why."""
    branches = (["LPIPS"] if cfg.loss.perceptual_weight > 0 else []) + ["pixel"]
    if cfg.critic.do_ganloss:
        branches.append(f"{cfg.critic.discriminator} critic from step {cfg.loss.disc_start}")
    if cfg.critic.vgg16_weights == "random" and not uses_vgg16(cfg):
        trains = "pixel losses only" if len(branches) == 1 else f"{' + '.join(branches)} losses"
        off, they = (("LPIPS and the VGG16 critic are", "they") if cfg.critic.discriminator == "vgg16" else
                     ("LPIPS is", "it"))
        return (f"demo: no pretrained VGG16 in the torchvision cache ({vgg16_cache_path()}): {off} OFF (on random "
                f"features {they} would train on noise); {trains}")
    weights = "a RANDOM VGG16" if cfg.critic.vgg16_weights == "random" else "pretrained VGG16"
    return f"demo: {' + '.join(branches)} losses, with {weights}"
