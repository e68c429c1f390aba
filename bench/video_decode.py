"""The video_decode section (issue 42, item 3): frames decoded per delivered clip and clips per second of one data worker
(in-process, one torch thread, one decoding thread), against PyAV's raw decode rate of the same files (every frame
decoded in order and converted to RGB: the limit, as clips/s = frames/s / frames per clip).

Videos: moving-camera clips of a photo (clips.camera_clip), 256x256, 30 fps, H.264 (libx264, crf 18, x264's keyframe
interval of 250: a seek alone can cost up to 249 frames), packed whole into one shard: --video_decode_short of 2 s
and --video_decode_long of 10 s. Each reader delivers --video_decode_clips clips of --video_decode_frames frames through
data.TrainLoader (num_workers 0, crop 256, no resize):
  before   the code before issue 42: frames counted from the container's index (or by decoding the whole video),
           then decoded from frame 0 up to the window's end (a copy of it below, old_decode_clip);
  seek     a seek to the keyframe before each window (--video_pass_frames 1: a pass per clip);
  after    the default: long videos read in passes of --video_pass_frames 512.
"""
from __future__ import annotations

import io
import os
import random
import time

import numpy as np
import torch

import clips
import data as data_lib
from bench.report import Report, median
from sources import SkipSample

OLD_COUNTS = {"frames": 0}


def old_decode_clip(data: bytes, frames: int, resolution: int, rng: random.Random, resize_prob: float = 0.0,
                    max_pixels: int = 100_000_000, stride: int = 1) -> np.ndarray:
    """clips.decode_clip as it was before issue 42 (its _frames): the frame count from the container's index, else
    by decoding the whole video; then every frame decoded from the first to the window's end (the crop: today's)."""
    import av
    count = (frames - 1) * stride + 1
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_count = 1  # as the new code: one thread per worker
        total = stream.frames
        if total <= 0:
            total = 0
            for _ in container.decode(stream):
                total += 1
                OLD_COUNTS["frames"] += 1
            container.seek(0)
        if total < count:
            raise SkipSample("too_short")
        first = rng.randint(0, total - count)
        out = []
        for i, frame in enumerate(container.decode(stream)):
            OLD_COUNTS["frames"] += 1
            if i >= first:
                out.append(frame.to_ndarray(format="rgb24", threads=1))
                if len(out) == count:
                    break
    return clips.crop_clip(out[::stride], resolution, rng, resize_prob)


def make_videos(dst: str, n: int, frames: int, seed: int, size: int = 256) -> tuple[str, list[bytes]]:
    import skimage.data
    import webdataset as wds
    rng = np.random.default_rng(seed)
    photos = [skimage.data.astronaut(), skimage.data.chelsea(), skimage.data.coffee(), skimage.data.rocket()]
    videos = [clips.encode_clip(clips.camera_clip(photos[i % len(photos)], frames, size, rng), fps=30, keyint=250)
              for i in range(n)]
    path = os.path.join(dst, f"videos_{frames}.tar")
    with wds.TarWriter(path) as sink:
        for i, video in enumerate(videos):
            sink.write({"__key__": f"v{i:03d}", "mp4": video})
    return path, videos


def raw_rate(videos: list[bytes]) -> float:
    """Frames per second of decoding every frame of the videos in order, converted to RGB, one thread."""
    import av
    t0, n = time.perf_counter(), 0
    for video in videos:
        with av.open(io.BytesIO(video)) as container:
            stream = container.streams.video[0]
            stream.thread_count = 1
            for frame in container.decode(stream):
                frame.to_ndarray(format="rgb24", threads=1)
                n += 1
    return n / (time.perf_counter() - t0)


def run_reader(url: str, reader: str, clip_count: int, frames: int, seed: int) -> tuple[float, float]:
    """(clips/s, frames decoded per clip) of `reader` delivering clip_count clips."""
    saved = data_lib.Lane._next_clip
    if reader == "before":
        def _next_clip(self, key, sample, opened, frames, resolution, rng):
            return old_decode_clip(data_lib.pick_video(sample), frames, resolution, rng, self.resize_prob,
                                   self.max_pixels, self.frame_stride)
        data_lib.Lane._next_clip = _next_clip
    clips.DECODE_COUNTS.clear()
    OLD_COUNTS["frames"] = 0
    loader = data_lib.TrainLoader(url, 256, 1, seed, 0, 1, num_workers=0, shuffle_buffer=8, resize_prob=0.0,
                                  frames=frames, pass_frames=1 if reader == "seek" else 512)
    try:
        next(loader)  # the buffer filled, the shard read: not what is measured
        decoded_before = clips.DECODE_COUNTS["frames"] + OLD_COUNTS["frames"]
        t0 = time.perf_counter()
        for _ in range(clip_count):
            batch = next(loader)
        elapsed = time.perf_counter() - t0
    finally:
        loader.close()
        data_lib.Lane._next_clip = saved
    assert batch.shape == (1, 3, frames, 256, 256)
    decoded = clips.DECODE_COUNTS["frames"] + OLD_COUNTS["frames"] - decoded_before
    return clip_count / elapsed, decoded / clip_count


def bench_video_decode(args, tmp, report: Report) -> dict:
    frames, clip_count = args.video_decode_frames, args.video_decode_clips
    datasets = {"2 s videos": make_videos(tmp, args.video_decode_short, 60, args.seed),
                "10 s videos": make_videos(tmp, args.video_decode_long, 300, args.seed + 1)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a DataLoader worker runs with
    readers = ("before", "seek", "after")
    rates = {(name, r): [] for name in datasets for r in ("raw",) + readers}
    per_clip = {(name, r): [] for name in datasets for r in readers}
    try:
        for name, (_, videos) in datasets.items():  # warm up PyAV's code paths
            raw_rate(videos[:1])
        for round_ in range(args.video_decode_rounds):
            for name, (url, videos) in datasets.items():
                order = ("raw",) + readers
                order = order[round_ % len(order):] + order[:round_ % len(order)]  # rotated each round
                for reader in order:
                    if reader == "raw":
                        rates[(name, reader)].append(raw_rate(videos))
                        continue
                    rate, cost = run_reader(url, reader, clip_count, frames, args.seed + round_)
                    rates[(name, reader)].append(rate)
                    per_clip[(name, reader)].append(cost)
    finally:
        torch.set_num_threads(threads)
    out, rows = {"frames_per_clip": frames, "clips": clip_count, "rounds": args.video_decode_rounds, "size": "256x256",
                 "fps": 30, "keyint": 250, "datasets": {}}, []
    for name in datasets:
        raw_fps = median(rates[(name, "raw")])
        limit = raw_fps / frames
        entry = {"raw_frames_per_s": raw_fps, "limit_clips_per_s": limit}
        rows.append([name, "raw decode (the limit)", float(frames), limit, "100%"])
        for reader in readers:
            rate, cost = median(rates[(name, reader)]), median(per_clip[(name, reader)])
            entry[reader] = {"clips_per_s": rate, "frames_decoded_per_clip": cost, "fraction_of_limit": rate / limit,
                             "runs_clips_per_s": [round(v, 2) for v in rates[(name, reader)]]}
            rows.append([name, reader, cost, rate, f"{rate / limit:.0%}"])
        out["datasets"][name] = entry
    report.table(f"Video decoding, one worker: clips of {frames} frames, 256x256 H.264 at 30 fps (keyframes <= 250 "
                 f"apart), {clip_count} clips per reader, medians of {args.video_decode_rounds} interleaved rounds",
                 ["videos", "reader", "frames decoded/clip", "clips/s", "of the limit"], rows)
    report.line("  raw decode: every frame in order, decoded and converted to RGB (PyAV, one thread), as clips/s = "
                "frames/s / frames per clip; before: decoded from frame 0 to the window's end; seek: to the keyframe "
                "before each window; after: passes of 512 frames (the default)")
    return out
