"""Video clips: a window of frames out of a video sample (what the training stream and the evaluation read when
--video_frames is set), encoding frames into a real video file, and the clips the demo and the tests make from
photos with a moving camera (pans, zooms, small rotations), so the whole path (container, decode, window, crop) runs
offline.

    python data.py make-clips SRC_DIR DST_DIR [--shard_size 100]        # a folder of videos -> shards, their bytes
    python data.py make-clips SRC_DIR DST_DIR --from_photos [--frames 33] # photos -> moving-camera mp4 clips
    python data.py make-clips SRC_DIR DST_DIR --segment_seconds 4          # long videos -> 4 s segments

The decoder is PyAV: its wheels carry their own FFmpeg (with libx264, libvpx and dav1d), so `pip install av` is the
whole install on a fresh machine, CPU-only and at any torch version. torchcodec decodes faster on a GPU but loads the
system's FFmpeg libraries, which a fresh machine does not have, and its wheels follow torch's version.
Decoding happens in the data workers (Video): the frame count from the container's metadata, a seek to the keyframe
before a window, frames picked by their timestamps, rotated as the metadata says; data.Lane reads long videos in
passes, several windows per seek (docs/data.md, "Long videos"). `make-clips --segment_seconds` cuts long videos into
re-encoded segments (cut_video).
"""
from __future__ import annotations

import io
import math
import random
from collections import Counter, OrderedDict

import numpy as np
import torch
from PIL import Image

from sources import SkipSample

VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi", "m4v")


def frames_of(clips: torch.Tensor) -> torch.Tensor:
    """(B, C, T, H, W) clips -> (B * T, C, H, W) frames, clip by clip: what the losses, the critic and the metrics
    of images see of clips."""
    b, c, t, height, width = clips.shape
    return clips.transpose(1, 2).reshape(b * t, c, height, width)


def pick_video(sample: dict) -> bytes:
    for ext in VIDEO_EXTS:
        if ext in sample:
            return sample[ext]
    raise SkipSample("non_video")


# what this process decoded (tests and the bench read it): "frames" decoded, "clips" delivered, "seeks", "counted"
# (videos whose frames were counted by demuxing their packets, the container giving no count)
DECODE_COUNTS: Counter = Counter()
# frame counts made by demuxing, per sample key (the lane's (shard, sample, bytes)): a second draw of the same sample
# never counts again. One per data worker process, least recently used dropped past COUNT_CACHE_SIZE (a key and an
# int each: a few MB at most)
COUNT_CACHE_SIZE = 65536
_count_cache: OrderedDict = OrderedDict()


def rotated(frame: np.ndarray, rotation: float) -> np.ndarray:
    """A decoded frame as it is meant to be seen: `rotation` is FFmpeg's display matrix angle (PyAV's frame.rotation,
    degrees counterclockwise; a portrait phone video stored landscape says 90 or -90), as images follow EXIF.
    Multiples of 90 degrees only (what cameras write); other angles are left alone."""
    quarter = round(rotation / 90) % 4
    if not quarter or abs(rotation - 90 * round(rotation / 90)) > 1:
        return frame
    return np.ascontiguousarray(np.rot90(frame, quarter))


class Video:
    """An open video: its frame count (the container's where it is trustworthy, else counted once by demuxing and
    cached), and windows of consecutive frames decoded forward from the keyframe before them. The decoder stays
    open between windows: a window after the last one read continues the same forward pass (no seek), which is how
    a lane reads several windows of a long video at the cost of about one decode of their frames
    (data.Lane's passes). Frames are found by their timestamps (a stream's start_time need not be 0); a window whose
    timestamps are not one frame apart (a variable frame rate) is refused, SkipSample("variable_frame_rate").
    Raises SkipSample for what cannot be read."""

    def __init__(self, data: bytes, max_pixels: int = 1 << 40, key=None):
        import av
        self.av = av
        try:
            self.container = av.open(io.BytesIO(data))
        except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError):
            raise SkipSample("corrupt") from None
        if not self.container.streams.video:
            self.close()
            raise SkipSample("non_video")
        self.stream = stream = self.container.streams.video[0]
        if stream.codec_context.width * stream.codec_context.height > max_pixels:
            self.close()
            raise SkipSample("too_large")
        # one decoding thread (and one converting thread, to_ndarray): a data worker is one of several processes, and
        # threads of FFmpeg's in objects that a fork copies (a DataLoader's workers started where a stream was read
        # in-process) hang the child that frees them
        stream.thread_count = 1
        self.data, self.key = data, key
        self.rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        self.start = stream.start_time if stream.start_time is not None else 0
        self.decoded = None  # the live decoder (a generator of frames) and the index of the last frame it gave
        self.last, self.order, self.from_start = -1, 0, False
        try:
            self.frames = self._count()
        except SkipSample:
            self.close()
            raise
        except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError):
            self.close()
            raise SkipSample("corrupt") from None

    def _count(self) -> int:
        """The frame count: the container's index (mp4, mov); else the duration times a constant rate when the
        duration is the video's own (the stream's, or the container's with no other stream: webm, mkv); else
        counted by demuxing the packets once (no decoding), cached per key."""
        stream = self.stream
        if stream.frames > 0:
            return stream.frames
        constant = self.rate and stream.base_rate and abs(float(self.rate) / float(stream.base_rate) - 1) < 1e-3
        if constant:
            if stream.duration:
                return int(stream.duration * stream.time_base * self.rate + 1e-6)
            if self.container.duration and len(self.container.streams) == 1:
                return int(self.container.duration / 1_000_000 * self.rate + 1e-6)
        if self.key is not None and self.key in _count_cache:
            _count_cache.move_to_end(self.key)
            return _count_cache[self.key]
        DECODE_COUNTS["counted"] += 1
        with self.av.open(io.BytesIO(self.data)) as again:
            count = sum(1 for packet in again.demux(again.streams.video[0]) if packet.size)
        if self.key is not None:
            _count_cache[self.key] = count
            while len(_count_cache) > COUNT_CACHE_SIZE:
                _count_cache.popitem(last=False)
        return count

    def _index(self, frame) -> int | None:
        if frame.pts is None or not self.rate:
            return None
        return round((frame.pts - self.start) * frame.time_base * self.rate)

    def _seek(self, first: int) -> None:
        """Position the decoder at the keyframe at or before frame `first` (at the stream's start where the frames
        carry no timestamps, or a seek went past its target)."""
        DECODE_COUNTS["seeks"] += 1
        target = self.start if self.from_start or not self.rate else \
            self.start + int(first / (self.rate * self.stream.time_base))
        self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
        self.decoded, self.last, self.order = self.container.decode(self.stream), -1, 0

    def read(self, first: int, count: int) -> list[np.ndarray]:
        """Frames first .. first + count - 1, uint8 (H, W, 3) RGB, rotated as the metadata says. The decoder goes on from where the last
        read stopped when the window starts a little after it, else it seeks."""
        try:
            if self.decoded is None or not self.last < first <= self.last + 1 + count:
                self._seek(first)
            out = []
            for frame in self.decoded:
                DECODE_COUNTS["frames"] += 1
                index = self._index(frame)
                if index is None:  # no timestamps: frames are counted from the stream's start
                    if not self.from_start:
                        self.from_start = True
                        return self._restart(first, count)
                    index, self.order = self.order, self.order + 1
                elif self.last == -1 and index > first and not self.from_start:
                    self.from_start = True  # the seek landed past the window (a wrong index): from the start
                    return self._restart(first, count)
                if index >= first and index != (self.last + 1 if out else first):
                    raise SkipSample("variable_frame_rate")  # frames not one frame apart where the window is
                self.last = index
                if index < first:
                    continue
                out.append(rotated(frame.to_ndarray(format="rgb24", threads=1), frame.rotation))
                if len(out) == count:
                    DECODE_COUNTS["clips"] += 1
                    return out
        except SkipSample:
            raise
        except (self.av.error.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError):
            raise SkipSample("corrupt") from None
        raise SkipSample("too_short")  # the stream ended before the window did: the count promised more

    def _restart(self, first: int, count: int) -> list[np.ndarray]:
        self.decoded = None
        return self.read(first, count)

    def close(self) -> None:
        self.decoded = None
        self.container.close()


def window_length(frames: int, stride: int) -> int:
    """Consecutive frames a clip of `frames` frames at `stride` spans."""
    return (frames - 1) * stride + 1


def decode_clip(data: bytes, frames: int, resolution: int, rng: random.Random | None, resize_prob: float = 0.0,
                max_pixels: int = 100_000_000, stride: int = 1, key=None) -> np.ndarray:
    """`frames` frames of a video, every `stride`-th of a window of consecutive ones (--video_frame_stride: a 32 fps
    video at stride 2 is 16 fps, Wan 2.1's rate), as uint8 (frames, resolution, resolution, 3): one crop and one flip
    for all of them, as data.decode_crop does for an image. Training (rng given): a random window, then crop_clip's
    draws. Evaluation (rng None): the first frames, the shorter side resized to the resolution, the center crop.
    `key`: the sample's, under which a frame count made by demuxing is cached."""
    video = Video(data, max_pixels, key)
    try:
        span = window_length(frames, stride)
        if video.frames < span:
            raise SkipSample("too_short")
        first = rng.randint(0, video.frames - span) if rng is not None else 0
        return crop_clip(video.read(first, span)[::stride], resolution, rng, resize_prob)
    finally:
        video.close()


def crop_clip(clip: list[np.ndarray], resolution: int, rng: random.Random | None,
              resize_prob: float = 0.0) -> np.ndarray:
    """Frames (uint8 (H, W, 3)) -> uint8 (frames, resolution, resolution, 3). Training (rng given): with probability
    `resize_prob` the shorter side resized to the resolution (videos smaller than the crop always), a random crop and
    a random horizontal flip, the same for every frame. Evaluation (rng None): resized, the center crop. A crop at
    native scale is a slice of the decoded array (no PIL round trip)."""
    h, w = clip[0].shape[:2]
    resize = rng is None or min(w, h) < resolution or (resize_prob > 0 and rng.random() < resize_prob)
    size = (w, h)
    if resize:
        scale = resolution / min(w, h)
        size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    if rng is None:
        x0, y0 = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    else:
        x0, y0 = rng.randint(0, size[0] - resolution), rng.randint(0, size[1] - resolution)
    flip = rng is not None and rng.random() < 0.5
    out = np.empty((len(clip), resolution, resolution, 3), dtype=np.uint8)
    for t, frame in enumerate(clip):
        if frame.shape[:2] != (h, w):  # the frame size changes within the window: no one crop fits every frame
            raise SkipSample("corrupt")
        if size != (w, h):
            frame = np.asarray(Image.fromarray(frame).resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0))
        out[t] = frame[y0:y0 + resolution, x0:x0 + resolution]
    return out[:, :, ::-1] if flip else out


def verify_video(data: bytes) -> None:
    """Raises SkipSample unless the first two frames of the video decode one frame apart (what make-clips verifies:
    a video whose frames are not evenly spaced from its start, variable_frame_rate, would have every window refused
    in training)."""
    video = Video(data)
    try:
        if video.frames < 1:
            raise SkipSample("too_short")
        video.read(0, min(2, video.frames))
    finally:
        video.close()


def encode_clip(frames, fps: int = 16, codec: str = "libx264", crf: int = 18, keyint: int | None = None,
                rotation: int = 0) -> bytes:
    """uint8 (T, H, W, 3) frames (an array, or any iterable of (H, W, 3) arrays) -> the bytes of an mp4 file (H.264,
    yuv420p: even H and W). `keyint`: the largest keyframe interval (None: PyAV's default, 12; x264's own is 250);
    `rotation`: a display matrix saying the frames are to be turned that many degrees counterclockwise (as a phone
    writes a portrait video)."""
    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = None
        for frame in frames:
            if stream is None:
                stream = container.add_stream(codec, rate=fps)
                stream.width, stream.height, stream.pix_fmt = frame.shape[1], frame.shape[0], "yuv420p"
                stream.options = {"crf": str(crf)}
                if keyint is not None:
                    stream.codec_context.gop_size = keyint
                if rotation:
                    stream.set_display_rotation(rotation)
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode() if stream is not None else ():
            container.mux(packet)
    return buf.getvalue()


def cut_video(data: bytes, segment_seconds: float, max_pixels: int = 1 << 40, crf: int = 18):
    """A video's frames in fixed segments of round(segment_seconds x its frame rate) frames, each re-encoded as its
    own mp4 (H.264, keyframe at its first frame, the frames turned as the rotation metadata says; a variable frame
    rate becomes a constant one, every frame kept), yielded one at a time; a last part shorter than half a segment
    is dropped. Re-encoded rather than stream-copied: a copy can cut only at the source's keyframes (segments up to
    a keyframe interval off, 8 s and more for some cameras) and keeps the source's keyframe spacing, while a segment
    that starts at a keyframe is decoded from its first frame: a clip of it costs its own frames. SkipSample for what
    cannot be read."""
    import av
    video = Video(data, max_pixels)
    rate = video.rate or 30
    per_segment = max(1, round(segment_seconds * rate))
    try:
        frames = []
        for frame in video.container.decode(video.stream):
            img = rotated(frame.to_ndarray(format="rgb24", threads=1), frame.rotation)
            frames.append(img[: img.shape[0] // 2 * 2, : img.shape[1] // 2 * 2])
            if len(frames) == per_segment:
                yield encode_clip(frames, fps=rate, crf=crf, keyint=max(per_segment, 250))
                frames = []
        if frames and len(frames) * 2 >= per_segment:
            yield encode_clip(frames, fps=rate, crf=crf, keyint=max(per_segment, 250))
    except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError):
        raise SkipSample("corrupt") from None
    finally:
        video.close()


def camera_clip(photo: np.ndarray, frames: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """A photo seen by a moving camera: `frames` frames of size x size, the view's centre panning along a line, its
    scale zooming and its angle turning a little, each frame resampled from the photo (bicubic). uint8
    (frames, size, size, 3)."""
    img = Image.fromarray(photo).convert("RGB")
    w, h = img.size
    view = min(w, h) * rng.uniform(0.45, 0.7)  # the first frame's field of view, in photo pixels
    zoom = rng.uniform(0.8, 1.25)  # the last frame's field of view over the first's
    angle = rng.uniform(-0.08, 0.08)  # radians turned over the clip
    pan = rng.uniform(0.15, 0.35) * min(w, h)
    heading = rng.uniform(0, 2 * math.pi)
    margin = view * max(1.0, zoom) * 0.75  # a turned view's corners stay inside the photo
    start = np.array([rng.uniform(margin, max(margin, w - margin)), rng.uniform(margin, max(margin, h - margin))])
    end = np.clip(start + pan * np.array([math.cos(heading), math.sin(heading)]), [margin, margin],
                  [max(margin, w - margin), max(margin, h - margin)])
    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        s = t / max(1, frames - 1)
        cx, cy = start + s * (end - start)
        scale = view * (1 + s * (zoom - 1)) / size  # photo pixels per output pixel
        cos, sin = math.cos(angle * s) * scale, math.sin(angle * s) * scale
        # output (u, v) -> photo (cos u - sin v + a, sin u + cos v + b), about the output's centre
        a = cx - cos * size / 2 + sin * size / 2
        b = cy - sin * size / 2 - cos * size / 2
        out[t] = np.asarray(img.transform((size, size), Image.Transform.AFFINE, (cos, -sin, a, sin, cos, b),
                                          resample=Image.Resampling.BICUBIC))
    return out


def photo_clips(photos: list[np.ndarray], frames: int, size: int, per_photo: int, seed: int = 0,
                fps: int = 16) -> list[bytes]:
    """`per_photo` moving-camera clips of each photo, encoded as mp4 (the demo's and the tests' video data)."""
    rng = np.random.default_rng(seed)
    return [encode_clip(camera_clip(photo, frames, size, rng), fps=fps) for photo in photos for _ in range(per_photo)]
