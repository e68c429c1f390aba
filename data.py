"""Input pipeline: webdataset shards (or a folder of images) -> batches of uint8 crops for training, and every image
once for evaluation. Writing shards, the demo's data and the `make-shards` command: shards.py.

Training stream
  * `--dataset_url` is what webdataset accepts (brace-expanded local paths, http(s)://, pipe:...,
    several lists joined by '::') or a plain directory of images.
  * The stream is global: step s has M = ranks x --grad_accum micro-batches, and image i of micro-batch j comes
    from lane j * P + i % P (P: --batch_size at the run's start). Every lane reads every shard, epoch after epoch,
    through its own shuffle buffer of raw bytes (--shuffle_buffer / P samples): the lanes go round one seeded
    order of the shards per epoch, each starting at its own place (lane g of L at sample g N / L of the N the
    shards hold, counted from their tar headers), so one pass of the data reads each image once; remote shards
    cannot be counted, and there lanes start at whole shards (with fewer shards than lanes, each lane has an
    order of its own). Its randomness is counter-based (seed, lane, counter). So a step's images depend on the
    seed and the step alone, not on which rank or data worker computes them: a rank's lanes are dealt to its workers, and a run resumed on
    another number of ranks (--grad_accum following, so that M stays) or workers continues the same stream.
  * The stream is endless (epoch after epoch, each in a fresh shard order) and the trainer runs a
    step budget, so every rank runs the same number of steps whatever the shard count.
  * Samples are decoded, converted to RGB, cropped in uint8 and flipped. Batches stay uint8 until the device
    ([-1, 1] floats are made there).
  * A lane's whole state is a few integers plus the keys of the samples in its buffer: checkpoints store every
    lane's, and a resumed run sees exactly the batches the uninterrupted run would have seen. This is why the
    shuffling is ours and not webdataset's (whose buffer cannot be saved); reading, key grouping and URL
    handling are webdataset's, except that http(s) shards are fetched by our own curl call, whose
    waits are bounded (see "Remote shards").
  * Corrupt, empty, non-image, oversized and unreadable members are skipped and counted, and so
    are shards that cannot be fetched.

CLI: python data.py make-shards SRC_DIR DST_DIR [--shard_size 1000]  (shards.py's)
"""
from __future__ import annotations

import collections
import bisect
import ctypes
import functools
import io
import itertools
import math
import os
import random
import signal
import select
import sys
import threading
import time
import warnings
from collections import Counter
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import sources
from clips import VIDEO_EXTS, Video, crop_clip, decode_clip, pick_video, window_length
from common import guard_console, redact
from config import parse_schedule
from sources import IMAGE_EXTS, DatasetError, SkipSample, is_remote, iter_shard, list_shards, warn, warn_once

# events: each time a bad item is met (non_video and too_short: a clip stream's samples without a video, or with fewer
# frames than --video_frames; variable_frame_rate: a window whose frames are not one frame apart, clips.Video)
SKIP_REASONS = ("corrupt", "non_image", "too_large", "shard_errors", "non_video", "too_short", "variable_frame_rate")
# TrainLoader.skipped(): the events, plus "files": the distinct bad samples and shards among them (counted up to
# MAX_BAD_TRACKED per lane), and "outage_waits": the back-off waits while no shard could be read
DATA_COUNTS = SKIP_REASONS + ("files", "outage_waits")
MAX_BAD_TRACKED = 1000
# what a window of a long video can fail by while its other windows still read (Lane._drop)
WINDOW_REASONS = ("variable_frame_rate", "too_short")
# a clip lane's videos open at once (Lane's passes: each a live decoder, its reference frames in memory); with this
# many open, the lane draws from them alone until one is done
OPEN_PASSES = 4


class WaitInterrupted(Exception):
    """A stop request (the trainer's SIGTERM/SIGINT) came while the training stream was waiting for a batch."""


# --------------------------------------------------------------------------------------------
# Decoding: any PIL image -> uint8 RGB crop
# --------------------------------------------------------------------------------------------
def _pick_image(sample: dict) -> bytes:
    for ext in IMAGE_EXTS:
        if ext in sample:
            return sample[ext]
    raise SkipSample("non_image")


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Open (header only) and check the pixel count before anything is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise SkipSample("too_large") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise SkipSample("corrupt") from None
    if img.width * img.height > max_pixels or img.width <= 0 or img.height <= 0:
        raise SkipSample("too_large")
    return img


def _normalise_mode(img: Image.Image) -> Image.Image:
    """Bring exotic modes to one that PIL can resize and crop: RGB, RGBA, L, LA, I, F or CMYK."""
    mode = img.mode
    if mode == "P":
        return img.convert("RGBA" if "transparency" in img.info else "RGB")
    if mode == "PA":
        return img.convert("RGBA")
    if mode == "1":
        return img.convert("L")
    if mode.startswith("I;16"):
        return img.convert("I")
    if mode in ("RGB", "RGBA", "L", "LA", "I", "F", "CMYK"):
        return img
    return img.convert("RGB")  # YCbCr, LAB, HSV, RGBX, ...


def _to_rgb_array(img: Image.Image) -> np.ndarray:
    """uint8 (H, W, 3). Alpha is composited over white; 16-bit values are scaled to 8 bits."""
    mode = img.mode
    if mode == "RGB":
        return np.asarray(img)
    if mode == "L":
        return np.repeat(np.asarray(img)[:, :, None], 3, axis=2)
    if mode in ("RGBA", "LA"):
        a = np.asarray(img).astype(np.uint32)
        color, alpha = (a[..., :3], a[..., 3:]) if mode == "RGBA" else (a[..., :1], a[..., 1:])
        out = (color * alpha + 255 * (255 - alpha) + 127) // 255
        return np.broadcast_to(out, out.shape[:2] + (3,)).astype(np.uint8)
    if mode == "I":  # 16-bit sources (PNG, TIFF) arrive as 32-bit ints
        a = np.asarray(img, dtype=np.float64) / 257.0
        return np.repeat(np.clip(np.rint(a), 0, 255).astype(np.uint8)[:, :, None], 3, axis=2)
    if mode == "F":
        a = np.asarray(img, dtype=np.float64)
        return np.repeat(np.clip(np.rint(a), 0, 255).astype(np.uint8)[:, :, None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


def load_rgb(data: bytes, max_pixels: int = 100_000_000) -> np.ndarray:
    """A whole image as uint8 (H, W, 3) with the training conversions (EXIF rotation, alpha over white,
    16 bit to 8 bit); raises SkipSample."""
    img = open_image(data, max_pixels)
    try:
        if img.getexif().get(0x0112, 1) != 1:
            img = ImageOps.exif_transpose(img)
        return _to_rgb_array(_normalise_mode(img))
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError):
        raise SkipSample("corrupt") from None


def decode_crop(data: bytes, resolution: int, rng: random.Random | None, resize_prob: float = 0.0,
                max_pixels: int = 100_000_000) -> np.ndarray:
    """Decode one image to a uint8 (resolution, resolution, 3) RGB crop.

    Training (rng given): with probability `resize_prob` the shorter side is first resized to the
    resolution (a whole-image view); images smaller than the crop are always resized up; then a
    random crop and a random horizontal flip. Evaluation (rng None): resize the shorter side to
    the resolution and take the center crop. The crop happens in uint8, before any float
    conversion, and JPEGs that will be downscaled are decoded at reduced size (draft mode).
    """
    img = open_image(data, max_pixels)
    try:
        w, h = img.size
        resize = rng is None or min(w, h) < resolution or (resize_prob > 0 and rng.random() < resize_prob)
        if resize and img.format == "JPEG" and min(w, h) > 2 * resolution:
            scale = resolution / min(w, h)
            img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))  # DCT-domain downscale, >= target
        if img.getexif().get(0x0112, 1) != 1:
            img = ImageOps.exif_transpose(img)
        img = _normalise_mode(img)
        w, h = img.size
        if resize:
            scale = resolution / min(w, h)
            size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
            if size != (w, h):
                img = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
            w, h = size
        if rng is None:
            x0, y0 = (w - resolution) // 2, (h - resolution) // 2
        else:
            x0, y0 = rng.randint(0, w - resolution), rng.randint(0, h - resolution)
        arr = _to_rgb_array(img.crop((x0, y0, x0 + resolution, y0 + resolution)))
    except SkipSample:
        raise
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError, MemoryError):
        raise SkipSample("corrupt") from None
    if rng is not None and rng.random() < 0.5:
        arr = arr[:, ::-1]
    return arr


def to_model_input(batch: torch.Tensor, device: torch.device, channels_last: bool = True) -> torch.Tensor:
    """uint8 (B, 3, H, W) images or (B, 3, T, H, W) clips -> float32 in [-1, 1] on the device (the 4x smaller uint8
    crosses the bus); clips contiguous (the video model's Conv3d layout)."""
    x = batch.to(device, non_blocking=True).float().div_(127.5).sub_(1.0)
    if x.dim() == 5:
        return x.contiguous()
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# Multi-resolution training: which crop size (and how many images) each optimizer step takes
# --------------------------------------------------------------------------------------------
class ResolutionSchedule:
    """--train_resolutions: stages separated by ';', each `[STEP:]SIZE[,SIZE...]` (the first starts at step 0), e.g.
    `256`, `192,256,320`, `256;20000:384,448,512`. Each optimizer step draws its crop size uniformly from its stage's
    sizes with a generator seeded by (seed, step) only: every rank, every data worker and a resumed run compute the
    same size for a step, and all micro-batches of a step share it. At size s a micro-batch holds
    max(1, round(batch_size * (reference / s)^2)) images (reference: --vae_resolution, where it holds --batch_size),
    so the pixels per step stay about constant. Pure: no state, no global RNG."""

    def __init__(self, stages: list[tuple[int, tuple[int, ...]]], reference: int, batch_size: int, seed: int):
        self.stages, self.reference, self.batch_size, self.seed = stages, reference, batch_size, seed

    @classmethod
    def parse(cls, spec: str, reference: int, batch_size: int, seed: int = 0) -> "ResolutionSchedule":
        """The schedule of `spec` ('': the reference size alone), parsed by config.parse_schedule (ConfigError: one
        line for a malformed one)."""
        return cls(parse_schedule(spec) or [(0, (reference,))], reference, batch_size, seed)

    @classmethod
    def of(cls, data, seed: int) -> "ResolutionSchedule":
        """The schedule of a run's data section (config.DataConfig): built once by the trainer and handed to the
        data stream and the memory check."""
        return cls(data.stages or [(0, (data.vae_resolution,))], data.vae_resolution, data.batch_size, seed)

    @property
    def sizes(self) -> list[int]:
        """Every size of every stage, ascending."""
        return sorted({s for _, sizes in self.stages for s in sizes})

    def stage_at(self, step: int) -> int:
        """The index of the stage `step` belongs to."""
        return max(i for i, (begin, _) in enumerate(self.stages) if begin <= step)

    def size_at(self, step: int) -> int:
        """The crop size of optimizer step `step`: a stage of one size draws nothing."""
        sizes = self.stages[self.stage_at(step)][1]
        if len(sizes) == 1:
            return sizes[0]
        return sizes[_rng(self.seed, "resolution", step).randrange(len(sizes))]

    def batch_for(self, size: int) -> int:
        """Images per micro-batch at `size`: about the reference's pixels."""
        if size == self.reference:
            return self.batch_size
        return max(1, round(self.batch_size * (self.reference / size) ** 2))


# --------------------------------------------------------------------------------------------
# The resumable training stream
# --------------------------------------------------------------------------------------------
def _rng(*parts) -> random.Random:
    return random.Random(":".join(str(p) for p in parts))


RETRY_FIRST_WAIT_S = 1.0  # the back-off while no shard can be fetched: 1, 2, 4, ... s
RETRY_MAX_WAIT_S = 60.0
WAIT_POLL_S = 1.0  # how often the trainer's wait for a batch checks for a stop request


class Outage:
    """A time when none of a lane's remote shards could be read: waits with exponential back-off (capped)
    between passes over the shards, and gives up with one line once `budget_s` has gone by. `should_stop`: asked
    through the waits when the stream runs in the trainer's own process (--num_workers 0), where no DataLoader
    timeout returns to the trainer while it waits: a stop request raises WaitInterrupted at once."""

    def __init__(self, lane: int, budget_s: float, first_error: str, should_stop: Callable[[], bool] | None = None):
        self.lane, self.budget_s, self.should_stop = lane, budget_s, should_stop
        self.start, self.next_wait = time.monotonic(), RETRY_FIRST_WAIT_S
        warn(f"data lane {lane}: no shard could be read ({first_error}); retrying for up to "
             f"{budget_s / 60:g} min (--shard_retry_minutes)")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def wait(self, last_error: str) -> None:
        left = self.budget_s - self.elapsed()
        if left <= 0:
            raise DatasetError(f"no shard of the dataset could be read for {self.elapsed():.0f} s (last: "
                               f"{redact(last_error)}): stopping; the run resumes from its last checkpoint, and "
                               f"--shard_retry_minutes sets how long to wait")
        sleep_unless_stopped(min(self.next_wait, left), self.should_stop)
        self.next_wait = min(2 * self.next_wait, RETRY_MAX_WAIT_S)


class Lane:
    """One lane of the run's global stream: epochs of its shards in seeded order, a shuffle buffer of raw samples,
    decoding. Lane g supplies images g % P, g % P + P, ... of micro-batch g // P of every step (P: lanes per
    micro-batch), whichever rank and data worker compute it: its randomness is keyed to (seed, lane, counter), so
    its images depend on neither. `state_dict()` is small and exact, and moves with the lane to any worker."""

    def __init__(self, shards: list, lane: int, n_lanes: int, seed, resolution: int,
                 buffer_size: int, resize_prob: float, max_pixels: int, state: dict | None = None,
                 retry_s: float = 1800.0, should_stop: Callable[[], bool] | None = None, frames: int = 0,
                 keep_images: bool = False, frame_stride: int = 1, sizes: list[int] | None = None,
                 pass_frames: int = 512):
        state = state or {}
        self.frames = frames  # > 0: the lane reads videos, and a sample is a clip of that many frames
        self.frame_stride = frame_stride  # every frame_stride-th frame of the video
        # a clip stream with image steps (--video_image_prob): its images wait (in self.images) for those steps
        self.keep_images = keep_images
        self.shards, self.lane, self.retry_s = shards, lane, retry_s
        self.seed = state.get("seed", seed)  # a lane made after the run's start keeps the seed it was made with
        self.should_stop = should_stop
        self.resolution, self.buffer_size = resolution, max(1, buffer_size)
        self.resize_prob, self.max_pixels = resize_prob, max_pixels
        # every lane reads every shard: all lanes go round one seeded order of the shards per epoch, lane g starting
        # g / n_lanes of the way round, counted in samples (`sizes`: every shard's sample count), so that one pass of
        # the data (samples / lanes per lane) reads each sample once however the samples divide among the shards and
        # the lanes, and the lanes read different shards at any time where there are enough of about equal size.
        # Without the sizes (remote shards) lanes start at whole shards, floor(g * shards / n_lanes), and with fewer
        # shards than lanes each has an order of its own. A lane resumed from an earlier release's state (no
        # "starts") keeps its whole-shard starts, so that its run resumes exactly.
        self.n_lanes = n_lanes
        by_sample = state.get("starts", "sample" if "epoch" not in state else "shard") == "sample"
        self.sizes = sizes if by_sample and sizes is not None and sum(sizes) > 0 else None
        self.epoch = state.get("epoch", 0)
        self.pos = state.get("pos", 0)  # index into this epoch's shard order
        self.sample = state.get("sample", 0)  # next sample index within the current shard
        self.drawn = state.get("drawn", 0)  # samples taken out of the buffer so far
        self.counters = Counter(state.get("counters", {}))
        self.bad = {tuple(k) for k in state.get("bad", [])}  # distinct (shard, sample) keys; sample -1: the shard
        self.buffer: list[tuple[tuple[int, int], dict]] = self._reload(state.get("buffer", []))
        # keep_images: the images, apart (a clip step draws from the videos alone), at most buffer_size of them
        self.images: list[tuple[tuple[int, int], dict]] = self._reload(state.get("images", []))
        # clips of long videos (--video_pass_frames): a video of W >= 2 windows is read in passes of about
        # pass_frames consecutive frames, K windows each, so that the seek to a keyframe before a pass is paid once
        # for K clips. `videos`: the videos of the buffer met before {key: [the draw that first met it, passes
        # done]} (their windows' offset and the order of their passes are drawn from the first); `passes`: the
        # open ones [key, sample, next window's first frame, windows left, live clips.Video or None], drawn like
        # buffer samples. Both are in the state (keys and ints): a resume reopens a pass with one seek.
        self.pass_frames = max(1, pass_frames)
        self.videos = {(s, i): [first, done] for s, i, first, done in state.get("videos", [])}
        found = dict(self._reload([[s, i] for s, i, _, _ in state.get("passes", [])]))
        self.passes = [[(s, i), found[(s, i)], start, left, None] for s, i, start, left in state.get("passes", [])
                       if (s, i) in found]
        self.failures = 0
        self.raw = self._raw()

    def _order(self, epoch: int) -> list[tuple[int, int, int | None]]:
        """This lane's reading of epoch `epoch`: (shard, first sample, end sample or None for the shard's end)."""
        order, n_shards = list(range(len(self.shards))), len(self.shards)
        if self.sizes is None and n_shards < self.n_lanes:
            _rng(self.seed, self.lane, "epoch", epoch).shuffle(order)
            return [(shard, 0, None) for shard in order]
        _rng(self.seed, "epoch", epoch).shuffle(order)
        if self.sizes is None:
            start = self.lane * n_shards // self.n_lanes
            return [(shard, 0, None) for shard in order[start:] + order[:start]]
        ends = list(itertools.accumulate(self.sizes[shard] for shard in order))
        first = self.lane * ends[-1] // self.n_lanes  # this lane's first sample, counted along the order
        k = bisect.bisect_right(ends, first)  # the shard it falls in
        offset = first - (ends[k - 1] if k else 0)
        rest = [(shard, 0, None) for shard in order[k + 1:] + order[:k]]
        return [(order[k], offset, None)] + rest + ([(order[k], 0, offset)] if offset else [])

    def _note_bad(self, key: tuple[int, int]) -> None:
        if len(self.bad) < MAX_BAD_TRACKED:
            self.bad.add(key)

    def _raw(self) -> Iterator[tuple[tuple[int, int], dict]]:
        empty_epochs, outage = 0, None
        # a remote shard that cannot be fetched may be back in a minute: a pass that fetched nothing starts an
        # outage, ridden out with back-off; local files that do not read will not get better by waiting
        remote = any(isinstance(shard, str) and is_remote(shard) for shard in self.shards)
        while True:
            order, got_any, errors = self._order(self.epoch), False, []
            while self.pos < len(order):
                shard_idx, first, end = order[self.pos]
                errors_before = len(errors)
                samples = iter_shard(self.shards[shard_idx], self.counters, errors)
                for idx, sample in samples:
                    if end is not None and idx >= end:
                        samples.close()
                        break
                    if idx < max(self.sample, first):
                        continue
                    self.sample, got_any = idx + 1, True
                    yield (shard_idx, idx), sample
                if len(errors) > errors_before:
                    self._note_bad((shard_idx, -1))
                self.pos, self.sample = self.pos + 1, 0
            self.epoch, self.pos = self.epoch + 1, 0
            if got_any:
                if outage is not None:
                    warn(f"data lane {self.lane}: shards readable again after {outage.elapsed():.0f} s")
                empty_epochs, outage = 0, None
            elif remote and (fetch_errors := [reason for kind, reason in errors if kind == "shard"]):
                outage = outage or Outage(self.lane, self.retry_s, fetch_errors[-1], self.should_stop)
                outage.wait(fetch_errors[-1])
                self.counters["outage_waits"] += 1
            else:
                empty_epochs += 1
                if empty_epochs >= 2:
                    raise DatasetError("no readable sample in any shard of the dataset")

    def _reload(self, keys: list) -> list:
        """Re-read the samples a saved buffer held, by (shard, index) key."""
        wanted: dict[int, set[int]] = {}
        for shard_idx, idx in keys:
            wanted.setdefault(shard_idx, set()).add(idx)
        found = {}
        for shard_idx, idxs in wanted.items():
            for idx, sample in iter_shard(self.shards[shard_idx], Counter()):
                if idx in idxs:
                    found[(shard_idx, idx)] = sample
        return [((s, i), found[(s, i)]) for s, i in keys if (s, i) in found]

    def _fill(self) -> None:
        """Fill the shuffle buffer. Keeping images (keep_images), they wait apart, at most buffer_size of them (more,
        when image steps are rarer than images, are skipped and counted as non_video), and the buffer holds videos."""
        images_read = 0
        while len(self.buffer) < self.buffer_size:
            key, sample = next(self.raw)
            if self.keep_images and not any(ext in sample for ext in VIDEO_EXTS):
                images_read += 1
                if images_read > 10 * self.buffer_size + 1000:
                    raise DatasetError(f"no video among {images_read} samples in a row: clips (--video_frames) need "
                                       "videos (--video_image_prob adds images to them)")
                if len(self.images) < self.buffer_size:
                    self.images.append((key, sample))
                else:
                    self.counters["non_video"] += 1
                continue
            self.buffer.append((key, sample))

    def next_image(self, resolution: int | None = None, frames: int | None = None) -> np.ndarray:
        """The next training crop, `resolution` px square (default: the stream's): uint8 (R, R, 3), or a clip's
        (frames, R, R, 3); `frames` 1 on an image step of a clip stream (an image, or a random frame of a video).
        A clip step draws from the buffer and the open passes of long videos (all of them while OPEN_PASSES are
        open)."""
        resolution = resolution or self.resolution
        frames = self.frames if frames is None else frames
        clip_step = bool(self.frames) and frames == self.frames
        while True:
            self._fill()
            rng = _rng(self.seed, self.lane, "draw", self.drawn)
            pool = self.buffer
            passes = len(self.passes) if clip_step else 0
            if passes >= OPEN_PASSES:
                j = len(self.buffer) + rng.randrange(passes)
            else:
                j = rng.randrange(len(self.buffer) + (len(self.images) if frames == 1 else 0) + passes)
            self.drawn += 1
            if j >= len(self.buffer) and clip_step:  # the next window of an open pass
                opened = self.passes[j - len(self.buffer)]
                key, sample = opened[0], opened[1]
            else:
                if j >= len(self.buffer):  # an image step drew an image
                    pool, j = self.images, j - len(self.buffer)
                key, sample = pool[j]
                pool[j] = pool[-1]
                pool.pop()
                opened = None
            try:
                if self.keep_images and frames == 1 and not any(ext in sample for ext in VIDEO_EXTS):
                    image = decode_crop(_pick_image(sample), resolution, rng, self.resize_prob, self.max_pixels)[None]
                elif self.frames:
                    image = self._next_clip(key, sample, opened, frames, resolution, rng)
                else:
                    image = decode_crop(_pick_image(sample), resolution, rng, self.resize_prob, self.max_pixels)
                self.failures = 0
                return image
            except SkipSample as skip:
                # a window of a long video that cannot be read (a variable frame rate there, frames the count
                # promised and the stream lacks) loses its pass, not the video's next passes (it is in the plan) nor
                # its open ones (its last pass opening); anything else, the whole video
                window = skip.reason in WINDOW_REASONS and (opened is not None or key in self.videos
                                                            or any(p[0] == key for p in self.passes))
                self._drop(key, (opened or True) if window else None)
                self.counters[skip.reason] += 1
                self._note_bad(key)
                self.failures += 1
                warn_once(f"skipped a {skip.reason.replace('_', '-')} sample ({sample.get('__key__')})")
                if self.failures > 10 * self.buffer_size + 1000:
                    kind = "a video dataset of clips of --video_frames frames" if self.frames else "an image dataset"
                    raise DatasetError(f"{self.failures} samples in a row could not be decoded: is this {kind}?"
                                       ) from None

    def _count_key(self, key: tuple[int, int], sample: dict) -> tuple:
        shard = self.shards[key[0]]
        return (shard if isinstance(shard, str) else key[0], key[1], len(pick_video(sample)))

    def _next_clip(self, key: tuple[int, int], sample: dict, opened: list | None, frames: int, resolution: int,
                   rng: random.Random) -> np.ndarray:
        """A clip (or, on an image step, one frame) of a video sample: the next window of an open pass, or a
        window of a video just drawn (the first of a new pass where the video holds two windows or more)."""
        span = window_length(frames, self.frame_stride)
        if opened is not None:
            if opened[4] is None:  # reopened after a resume, or by another worker: one seek
                opened[4] = Video(pick_video(sample), self.max_pixels, self._count_key(key, sample))
            video, start = opened[4], opened[2]
            clip = video.read(start, span)
            opened[2], opened[3] = start + span, opened[3] - 1
            if opened[3] == 0:
                self.passes = [p for p in self.passes if p is not opened]
                video.close()
            return crop_clip(clip[::self.frame_stride], resolution, rng, self.resize_prob)
        video = Video(pick_video(sample), self.max_pixels, self._count_key(key, sample))
        keep = False
        try:
            if video.frames < span:
                raise SkipSample("too_short")
            windows = video.frames // (window_length(self.frames, self.frame_stride))
            if windows < 2:  # one window anywhere (an image step: one frame)
                start = rng.randint(0, video.frames - span)
                return crop_clip(video.read(start, span)[::self.frame_stride], resolution, rng, self.resize_prob)
            if frames != self.frames:  # an image step: one frame anywhere; the video's windows stay for clip steps
                self.buffer.append((key, sample))  # (its passes untouched: it is drawn by its windows as before)
                return crop_clip(video.read(rng.randint(0, video.frames - 1), 1), resolution, rng, self.resize_prob)
            # a pass: K consecutive windows, the video's W windows laid end to end from a random offset and cut into
            # passes of K, read in a random order, one pass per draw of the video: a video is drawn in proportion
            # to its windows, and each pass costs about one seek plus its own frames (an image step that draws it
            # spends a pass on one frame)
            span = window_length(self.frames, self.frame_stride)
            per_pass = min(windows, -(-self.pass_frames // span))
            n_passes = -(-windows // per_pass)
            first_draw, done = self.videos.get(key, [self.drawn - 1, 0])
            plan = _rng(self.seed, self.lane, "video", first_draw)
            offset = plan.randint(0, video.frames - windows * span)
            order = list(range(n_passes))
            plan.shuffle(order)
            first_window = order[done] * per_pass
            count = min(per_pass, windows - first_window)
            start = offset + first_window * span
            if done + 1 < n_passes:  # the video goes back into the buffer for its next pass
                self.videos[key] = [first_draw, done + 1]
                self.buffer.append((key, sample))
            else:
                self.videos.pop(key, None)
            clip = video.read(start, span)
            if count > 1:
                self.passes.append([key, sample, start + span, count - 1, video])
                keep = True
            return crop_clip(clip[::self.frame_stride], resolution, rng, self.resize_prob)
        finally:
            if not keep:
                video.close()

    def close(self) -> None:
        """Close the open passes' videos (their state stays: a resume reopens them)."""
        for opened in self.passes:
            if opened[4] is not None:
                opened[4].close()
                opened[4] = None

    def _drop(self, key: tuple[int, int], only=None) -> None:
        """A video that failed: its passes closed, out of the buffer (it would fail again). `only`: a pass (or
        True: the pass being opened) whose window failed; the video's other passes go on."""
        if only is not None:
            if only is not True:
                if only[4] is not None:
                    only[4].close()
                self.passes = [p for p in self.passes if p is not only]
            return
        for opened in self.passes:
            if opened[0] == key and opened[4] is not None:
                opened[4].close()
        self.passes = [p for p in self.passes if p[0] != key]
        if self.videos.pop(key, None) is not None:
            self.buffer = [(k, s) for k, s in self.buffer if k != key]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "starts": "shard" if self.sizes is None else "sample", "epoch": self.epoch,
                "pos": self.pos, "sample": self.sample, "drawn": self.drawn,
                "counters": dict(self.counters), "buffer": [list(k) for k, _ in self.buffer],
                **({"images": [list(k) for k, _ in self.images]} if self.keep_images else {}),
                **({"videos": [[*k, *v] for k, v in self.videos.items()],
                    "passes": [[*p[0], p[2], p[3]] for p in self.passes]} if self.frames else {}),
                "bad": [list(k) for k in sorted(self.bad)]}


class TrainStream(IterableDataset):
    """One rank's part of the global stream, as items of the DataLoader. Step s has M = world_size x grad_accum
    micro-batches; this rank computes micro-batches rank * grad_accum ... + grad_accum - 1 of every step, and
    micro-batch j is made of lanes j * P ... j * P + P - 1 (image i from lane j * P + i % P). The rank's lanes are
    dealt to its data workers (local lane l to worker l % workers); every worker yields one item per `workers`
    micro-batches, {parts: per micro-batch {index: the places of its images in it, size, count, states: {lane:
    state}}, pixels: those images, flat uint8 in one tensor (one shared-memory transfer per item: about a
    micro-batch's worth of images, as when a worker made whole micro-batches)}, so the DataLoader's round robin
    hands the rank each group of micro-batches' parts in worker order. With a `schedule`
    (ResolutionSchedule), R and the micro-batch's images are those of its step, which the worker computes itself
    (the schedule is pure)."""

    def __init__(self, shards: list, resolution: int, batch_size: int, seed, rank: int, world_size: int,
                 num_workers: int, lane_buffer: int, resize_prob: float, max_pixels: int, lanes_per_micro: int,
                 lane_states: dict | None = None, first: tuple[int, int] = (0, 0), retry_s: float = 1800.0,
                 schedule: ResolutionSchedule | None = None, grad_accum: int = 1, frames: int = 0,
                 image_prob: float = 0.0, frame_stride: int = 1, sizes: list[int] | None = None,
                 pass_frames: int = 512):
        super().__init__()
        self.pass_frames = pass_frames
        self.sizes = sizes  # every shard's sample count (None: unknown, remote shards): where each lane starts
        self.frames, self.image_prob, self.frame_stride = frames, image_prob, frame_stride
        self.retry_s = retry_s
        # the trainer's stop check, set on the copy the trainer's own process iterates (--num_workers 0); None in
        # data workers, whose waits the trainer interrupts from outside (TrainLoader._next_item)
        self.should_stop: Callable[[], bool] | None = None
        self.shards, self.resolution, self.batch_size, self.seed = shards, resolution, batch_size, seed
        self.rank, self.world_size, self.num_workers = rank, world_size, max(1, num_workers)
        self.lane_buffer, self.resize_prob, self.max_pixels = lane_buffer, resize_prob, max_pixels
        self.lanes_per_micro, self.grad_accum = lanes_per_micro, max(1, grad_accum)
        self.lane_states = lane_states or {}
        self.first, self.schedule = first, schedule

    @property
    def n_lanes(self) -> int:
        return self.world_size * self.grad_accum * self.lanes_per_micro

    def step_shape(self, step: int) -> tuple[int, int]:
        """(crop size, images) of a micro-batch of step `step`."""
        if self.schedule is None:
            return self.resolution, self.batch_size
        size = self.schedule.size_at(step)
        return size, self.schedule.batch_for(size)

    def frames_at(self, step: int) -> int:
        """The frames of step `step`'s samples: --video_frames, or 1 on an image step (--video_image_prob, drawn from
        the seed and the step: the same on every rank, worker and resume)."""
        if self.image_prob and _rng(self.seed, "image_step", step).random() < self.image_prob:
            return 1
        return self.frames

    def __iter__(self):
        sources.forget_warnings()  # each stream names each bad file once: a new stream (a new run, a resume) does again
        info = get_worker_info()
        worker = info.id if info is not None else 0
        per_rank = self.grad_accum * self.lanes_per_micro
        first_lane = self.rank * per_rank
        lanes = {g: Lane(self.shards, g, self.n_lanes, self.seed, self.resolution, self.lane_buffer,
                         self.resize_prob, self.max_pixels, self.lane_states.get(g), self.retry_s,
                         self.should_stop if info is None else None, self.frames, self.image_prob > 0,
                         self.frame_stride, self.sizes, self.pass_frames)
                 for g in range(first_lane + worker, first_lane + per_rank, self.num_workers)}
        try:
            yield from self._items(lanes, first_lane)
        finally:  # the lanes' open videos closed here, not freed later in a process forked from this one
            for lane in lanes.values():
                lane.close()

    def _items(self, lanes: dict, first_lane: int):
        step, micro = self.first
        while True:
            parts, pixels = [], []
            for _ in range(self.num_workers):  # an item: as many images as a whole micro-batch (one shared tensor)
                size, count = self.step_shape(step)
                frames = self.frames_at(step)
                base = first_lane + micro * self.lanes_per_micro
                index = [i for i in range(count) if base + i % self.lanes_per_micro in lanes]
                try:
                    pixels += [lanes[base + i % self.lanes_per_micro].next_image(size, frames).reshape(-1)
                               for i in index]
                except DatasetError as e:  # crosses the worker boundary as data: one line, not a traceback
                    yield {"error": str(e)}
                    return
                touched = {base + i % self.lanes_per_micro for i in index}
                parts.append({"index": index, "size": size, "count": count, "frames": frames,
                              "states": {g: lanes[g].state_dict() for g in touched}})
                step, micro = (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)
            yield {"parts": parts, "pixels": torch.from_numpy(np.concatenate(pixels)) if pixels else None}


class TrainerWatch:
    """In a data worker: the trainer that started it, watched by its pid. The trainer is what counts, not the
    worker's parent: under the forkserver start method (Python 3.14's default on Linux) a worker's parent is the
    fork server, which lives as long as any worker does (each holds its 'alive' pipe), so neither the parent-death
    signal nor a parent check ever fires there. On Linux a pidfd names that one process (it turns readable when the
    process ends, also while it is an unreaped zombie, and never names a later process that reuses the pid);
    elsewhere os.kill(pid, 0) is asked once a second."""

    def __init__(self, trainer_pid: int):
        self.pid, self.pidfd = trainer_pid, None
        if hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(trainer_pid)
            except ProcessLookupError:  # gone before the worker started watching
                self.pid = None
            except OSError:  # a kernel without pidfds (before 5.3): the pid is asked instead
                pass

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self.pidfd is not None:
            return not select.select([self.pidfd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user holds the pid: it exists
            return True
        return True

    def wait(self) -> None:
        """Return once the trainer has ended."""
        if self.pidfd is not None:
            select.select([self.pidfd], [], [])
        while self.alive():
            time.sleep(WAIT_POLL_S)


def exit_with_trainer(trainer_pid: int) -> None:
    """A data worker whose trainer died (OOM killer, kill -9) must not live on: orphaned, it can block for good
    writing to a pipe that its siblings still hold open, holding its memory. A daemon thread waits for the trainer
    to end and ends the worker then, whatever the worker's main thread is blocked in; on Linux the kernel also kills
    it when its parent dies (prctl PR_SET_PDEATHSIG: the trainer itself under fork and spawn)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    watch = TrainerWatch(trainer_pid)
    if not watch.alive():  # the trainer died before this worker started watching it
        os._exit(1)
    threading.Thread(target=exit_when_ended, args=(watch,), name="trainer-watch", daemon=True).start()


def exit_when_ended(watch: TrainerWatch) -> None:
    watch.wait()
    os._exit(1)  # no one is left to read what this worker would produce


def sleep_unless_stopped(seconds: float, should_stop: Callable[[], bool] | None = None) -> None:
    """Sleep in slices of at most WAIT_POLL_S; in the trainer's own process a stop request (`should_stop`) ends
    the wait with WaitInterrupted."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if should_stop is not None and should_stop():
            raise WaitInterrupted("a stop request came while waiting for data")
        time.sleep(min(left, WAIT_POLL_S))


def init_data_worker(worker_id: int, trainer_pid: int) -> None:
    """DataLoader worker_init_fn."""
    exit_with_trainer(trainer_pid)
    ignore_stop_signals()
    guard_console()  # its warnings share the trainer's console, which may be gone (common.Console)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn. SLURM (preemption, time limit), `timeout`, Ctrl-C and torchrun's agent
    signal the whole process group, data workers included: a worker killed by SIGTERM makes the main
    process die with "DataLoader worker ... is killed by signal" before it can save. The main process
    decides: it finishes its step, saves, and stops the workers (TrainLoader.close)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class TrainLoader:
    """The training batches of one rank, and the state that resumes them exactly, on any number of ranks and data
    workers: the position is the step (and micro-batch) and every lane's state (TrainStream)."""

    def __init__(self, url: str, resolution: int, batch_size: int, seed: int, rank: int, world_size: int,
                 num_workers: int = 4, shuffle_buffer: int = 1000, resize_prob: float = 0.5,
                 max_pixels: int = 100_000_000, pin_memory: bool = False, state: dict | None = None,
                 shard_retry_minutes: float = 30.0, schedule: ResolutionSchedule | None = None, grad_accum: int = 1,
                 step: int | None = None, frames: int = 0, image_prob: float = 0.0, frame_stride: int = 1,
                 pass_frames: int = 512):
        """`schedule`: each step's crop size and images (--train_resolutions; None: `resolution` and `batch_size`
        throughout); `grad_accum` micro-batches per step on each of `world_size` ranks; `step`: the trainer's step
        at the stream's position, a step's start (default: the state's, else 0). `state`: a position of this
        run's stream, from any rank count (merge_positions joins the ranks' own). `frames` > 0: the samples are
        videos, and each image a clip of that many frames (B, 3, T, R, R); `image_prob`: the probability that a
        step's are one frame instead (an image of the shards, or a random frame of a video)."""
        state = state or {}
        shards = list_shards(url)
        # every shard's sample count, where the lanes start: counted once per run (a resume reads the saved ones)
        saved_sizes, counting = state.get("sizes"), time.monotonic()
        self.sizes = (saved_sizes if isinstance(saved_sizes, list) and len(saved_sizes) == len(shards)
                      else sources.shard_sizes(shards))
        self.grad_accum, self.pin_memory = max(1, grad_accum), pin_memory
        self.notes = []
        if self.sizes is None and not any(isinstance(s, str) and is_remote(s) for s in shards):
            self.notes.append(f"counting the samples of {len(shards)} shards took over {sources.COUNT_BUDGET_S:.0f} s: "
                              "the lanes start at whole shards (a pass over the data reads some images twice and "
                              "skips as many, docs/data.md)")
        elif self.sizes is not None and self.sizes is not saved_sizes and time.monotonic() - counting > 10:
            self.notes.append(f"counted the {sum(self.sizes)} samples of {len(shards)} shards in "
                              f"{time.monotonic() - counting:.0f} s, where each lane starts (a resume reads the counts "
                              "saved)")
        self.lanes_per_micro = int(state.get("lanes_per_micro", batch_size))
        self.micro_batches = world_size * self.grad_accum
        first = (int(state.get("step", 0)), int(state.get("micro", 0)))
        self.position = first if step is None or step == first[0] else (step, 0)
        per_rank = self.grad_accum * self.lanes_per_micro
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        saved = {int(k): v for k, v in state.get("lanes", {}).items()}
        if state.get("worker_states") and not saved:
            self.notes.append(f"the data stream was saved by an earlier release (per data worker): it starts afresh "
                              f"at step {self.position[0]}")
        if saved and state.get("micro_batches") != self.micro_batches:  # lanes would own other shards: anew
            self.notes.append(f"the data stream was saved with {state.get('micro_batches')} micro-batches per step, "
                              f"this run has {self.micro_batches}: it starts afresh at step {self.position[0]}")
            saved = {}
        # lanes of a new stream start from the seed; of one started anew during a run, from the seed and the step
        fresh = {"seed": seed if self.position == (0, 0) else f"{seed}+{self.position[0]}"}
        self.lane_states = {g: saved.get(g, fresh) for g in mine}
        self.num_workers = min(max(0, num_workers), per_rank)  # a worker per lane at most
        if num_workers > per_rank:
            self.notes.append(f"--num_workers {num_workers}: {per_rank} data workers, one per lane of this rank "
                              f"(--grad_accum x the lanes of a micro-batch)")
        self.parts = max(1, self.num_workers)
        lane_buffer = max(1, -(-shuffle_buffer // self.lanes_per_micro))
        dataset = TrainStream(shards, resolution, batch_size, seed, rank, world_size, self.parts, lane_buffer,
                              resize_prob, max_pixels, self.lanes_per_micro, self.lane_states, self.position,
                              retry_s=60.0 * shard_retry_minutes, schedule=schedule, grad_accum=self.grad_accum,
                              frames=frames, image_prob=image_prob, frame_stride=frame_stride,
                              sizes=self.sizes, pass_frames=pass_frames)
        # with workers, the wait for a batch is cut into WAIT_POLL_S slices (DataLoader's timeout), so that a stop
        # request is seen while the workers back off through an outage (should_stop, set by the trainer)
        kwargs = (dict(prefetch_factor=4, persistent_workers=True, timeout=WAIT_POLL_S) if self.num_workers > 0
                  else {})
        self.should_stop: Callable[[], bool] = lambda: False
        if self.num_workers == 0:  # the stream runs in this process: its outage waits ask the trainer themselves
            dataset.should_stop = lambda: self.should_stop()
        # its own generator: creating the iterator must not draw from the global torch RNG
        # pinned once: by the DataLoader when one worker sends whole micro-batches, else where the parts meet
        self.loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                 pin_memory=pin_memory and self.parts == 1,
                                 generator=torch.Generator().manual_seed(0),
                                 worker_init_fn=functools.partial(init_data_worker, trainer_pid=os.getpid()),
                                 **kwargs)
        self._iter = None
        self.ready: collections.deque = collections.deque()  # micro-batches received, not yet returned: (batch, states)

    @classmethod
    def of(cls, data, seed: int, rank: int, world_size: int, pin_memory: bool = False,
           state: dict | None = None, grad_accum: int = 1, step: int | None = None,
           schedule: ResolutionSchedule | None = None) -> "TrainLoader":
        """The loader of a run's data section (config.DataConfig); with --train_resolutions each step's size and
        batch follow `schedule` (the run's, seeded by `seed` and the step; None: --vae_resolution alone)."""
        schedule = schedule if data.train_resolutions else None
        return cls(data.dataset_url, data.vae_resolution, data.batch_size, seed, rank, world_size, data.num_workers,
                   data.shuffle_buffer, data.resize_prob, data.max_image_pixels, pin_memory=pin_memory, state=state,
                   shard_retry_minutes=data.shard_retry_minutes, schedule=schedule, grad_accum=grad_accum, step=step,
                   frames=data.video_frames, image_prob=data.video_image_prob,
                   frame_stride=data.video_frame_stride, pass_frames=data.video_pass_frames)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        """The next micro-batch: the data workers' parts of it (TrainStream's items), put together."""
        if self._iter is None:
            self._iter = iter(self.loader)
        if not self.ready:
            items = []
            for _ in range(self.parts):
                items.append(self._next_item())
                if "error" in items[-1]:
                    raise DatasetError(items[-1]["error"])
            self.ready.extend(assemble(items, self.pin_memory and self.parts > 1))
        batch, states = self.ready.popleft()
        self.lane_states.update(states)
        step, micro = self.position
        self.position = (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)
        return batch

    def _next_item(self) -> dict:
        """The next item, waiting in WAIT_POLL_S slices; WaitInterrupted when should_stop() says so meanwhile."""
        while True:
            try:
                return next(self._iter)
            except RuntimeError as e:  # the DataLoader's timeout leaves its iterator as it was: wait again
                if not str(e).startswith("DataLoader timed out"):
                    raise
            if self.should_stop():
                raise WaitInterrupted("a stop request came while waiting for data")

    def close(self) -> None:
        """Stop the worker processes. They ignore SIGTERM, so the DataLoader's own fallback (terminate)
        cannot stop one that does not exit when asked: kill it."""
        if self._iter is not None and hasattr(self._iter, "_shutdown_workers"):
            try:
                self._iter._shutdown_workers()
            except RuntimeError as e:
                # a worker that died on its way out: it was leaving anyway, and the shutdown's own cleanup has run (a
                # finally). Under spawn and forkserver (not fork) a worker's interpreter finalizes as it exits, and
                # torch's worker does not wait for its queue's feeder thread: one still pickling a prefetched batch
                # (inside torch's C++ share_fd) is ended by Python < 3.14 with pthread_exit, which aborts the process,
                # 'terminate called without an active exception' (3 of 30 workers here; seen in CI)
                if not str(e).startswith("DataLoader worker"):
                    raise
            for worker in getattr(self._iter, "_workers", []):
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=5)
        self._iter = None

    def skipped(self) -> dict[str, int]:
        """DATA_COUNTS of this rank's lanes since the run's start: the skip events by reason, the distinct bad files,
        the outage waits."""
        total, bad = Counter(), set()
        for st in self.lane_states.values():
            total.update(st.get("counters", {}))
            bad.update(tuple(k) for k in st.get("bad", []))  # lanes share shards when they are few
        total["files"] = len(bad)
        return {k: int(total.get(k, 0)) for k in DATA_COUNTS}

    def state_dict(self) -> dict:
        return {"step": self.position[0], "micro": self.position[1], "micro_batches": self.micro_batches,
                "lanes_per_micro": self.lanes_per_micro, "lanes": dict(self.lane_states), "sizes": self.sizes}


def assemble(items: list[dict], pin_memory: bool = False) -> list[tuple[torch.Tensor, dict]]:
    """The micro-batches of one item from each data worker (TrainStream): [(uint8 (B, 3, R, R) in channels-last
    memory, as one worker's crops are, or clips (B, 3, T, R, R) where the part says T frames, {lane: state})];
    `pin_memory`: put the parts together in pinned memory."""
    out, offsets = [], [0] * len(items)
    for k, first in enumerate(items[0]["parts"]):
        size, count = first["size"], first["count"]
        frames = first["frames"]  # 0: images; 1 on an image step of a clip stream
        sample = (frames,) if frames else ()
        parts = []
        for w, item in enumerate(items):
            part, n = item["parts"][k], len(item["parts"][k]["index"]) * max(1, frames) * size * size * 3
            parts.append((part, item["pixels"][offsets[w]:offsets[w] + n].view(-1, *sample, size, size, 3)
                          if n else None))
            offsets[w] += n
        if len(parts) == 1:  # the whole micro-batch from one worker: no copy
            batch = parts[0][1]
        else:
            batch = torch.empty((count, *sample, size, size, 3), dtype=torch.uint8, pin_memory=pin_memory)
            for part, pixels in parts:
                if pixels is not None:
                    batch[part["index"]] = pixels
        batch = batch.permute(0, 4, 1, 2, 3) if frames else batch.permute(0, 3, 1, 2)
        out.append((batch, {g: st for part, _ in parts for g, st in part["states"].items()}))
    return out


def merge_positions(positions: list[dict]) -> dict:
    """One position of the global stream from the ranks' own (each holds its lanes): what a run resumed on any
    number of ranks and workers starts from. An earlier release's (per data worker, no lanes) is passed on as it is:
    the loader says that its stream starts afresh."""
    if not positions:
        return {}
    if any("lanes" not in p for p in positions):
        return positions[0]
    merged = {**positions[0], "lanes": {}}
    for p in positions:
        merged["lanes"].update(p["lanes"])
    return merged


# --------------------------------------------------------------------------------------------
# Evaluation reading: every image exactly once, sharded across ranks
# --------------------------------------------------------------------------------------------
class FixedBatches:
    """Stands in for TrainLoader (trainer.loader): cycles through batches held in memory (benchmarks time only
    the step; tests feed every trainer the same batches)."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches, self.i = batches, 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch

    def close(self) -> None:
        pass

    def skipped(self) -> dict[str, int]:
        return {k: 0 for k in DATA_COUNTS}

    def state_dict(self) -> dict:
        return {}


def iter_eval_batches(url: str, resolution: int, batch_size: int, rank: int = 0, world_size: int = 1,
                      max_images: int | None = None, max_pixels: int = 100_000_000,
                      counters: Counter | None = None, frames: int = 0,
                      frame_stride: int = 1) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Deterministic center crops of a dataset, in shard order. Image i (counting every sample
    that carries an image, up to `max_images`) belongs to rank i % world_size, so every image is
    seen exactly once across ranks, whatever the count. Yields (global indices, uint8 batch). `frames` > 0: the
    samples are videos, and each image the clip of their first `frames` frames, (B, 3, T, R, R)."""
    counters = counters if counters is not None else Counter()
    indices, images, i = [], [], 0

    def batch() -> torch.Tensor:
        stacked = torch.from_numpy(np.stack(images))
        return stacked.permute(0, 4, 1, 2, 3) if frames else stacked.permute(0, 3, 1, 2)
    for shard in list_shards(url):
        for _, sample in iter_shard(shard, counters):
            if max_images is not None and i >= max_images:
                if images:
                    yield indices, batch()
                return
            try:
                data = pick_video(sample) if frames else _pick_image(sample)
            except SkipSample as skip:
                counters[skip.reason] += 1
                continue
            mine, i = i % world_size == rank, i + 1
            if not mine:
                continue
            try:
                images.append(decode_clip(data, frames, resolution, None, max_pixels=max_pixels, stride=frame_stride)
                              if frames else
                              decode_crop(data, resolution, None, max_pixels=max_pixels))
                indices.append(i - 1)
            except SkipSample as skip:
                counters[skip.reason] += 1
                continue
            if len(images) == batch_size:
                yield indices, batch()
                indices, images = [], []
    if images:
        yield indices, batch()


if __name__ == "__main__":  # `python data.py make-shards ...`, the documented command: shards.py's CLI
    import runpy
    runpy.run_module("shards", run_name="__main__")
