"""Video clips: a window of frames out of a video sample (what the training stream and the evaluation read when
--video_frames is set), encoding frames into a real video file, and the clips the demo and the tests make from
photos with a moving camera (pans, zooms, small rotations), so the whole path (container, decode, window, crop) runs
offline.

    python data.py make-clips SRC_DIR DST_DIR [--shard_size 100]        # a folder of videos -> shards, their bytes
    python data.py make-clips SRC_DIR DST_DIR --from_photos [--frames 33] # photos -> moving-camera mp4 clips

The decoder is PyAV: its wheels carry their own FFmpeg (with libx264, libvpx and dav1d), so `pip install av` is the
whole install on a fresh machine, CPU-only and at any torch version. torchcodec decodes faster on a GPU but loads the
system's FFmpeg libraries, which a fresh machine does not have, and its wheels follow torch's version.
Decoding happens in the data workers; a clip is decoded from its first frame up to the end of the window (video
codecs decode forward from a keyframe), so short clips (a few seconds each, as video VAE datasets are cut) keep it
cheap.
"""
from __future__ import annotations

import io
import math
import random

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


def _frames(data: bytes, first: int | None, count: int, max_pixels: int, rng: random.Random | None):
    """(frames as PIL images, the video's frame count): `count` consecutive frames from `first` (None: a random window
    drawn from rng, or the first frames without one). SkipSample for what cannot be read or is too short."""
    import av
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise SkipSample("non_video")
            stream = container.streams.video[0]
            if stream.codec_context.width * stream.codec_context.height > max_pixels:
                raise SkipSample("too_large")
            total = stream.frames  # from the container's index; 0 where it keeps none (some webm, raw streams)
            if total <= 0:
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if total < count:
                raise SkipSample("too_short")
            if first is None:
                first = rng.randint(0, total - count) if rng is not None else 0
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if i >= first:
                    frames.append(frame.to_image())
                    if len(frames) == count:
                        break
    except SkipSample:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError):
        raise SkipSample("corrupt") from None
    if len(frames) < count:  # the index promised more frames than the stream holds
        raise SkipSample("too_short")
    return frames, total


def decode_clip(data: bytes, frames: int, resolution: int, rng: random.Random | None, resize_prob: float = 0.0,
                max_pixels: int = 100_000_000, stride: int = 1) -> np.ndarray:
    """`frames` frames of a video, every `stride`-th of a window of consecutive ones (--video_frame_stride: a 32 fps
    video at stride 2 is 16 fps, Wan 2.1's rate), as uint8 (frames, resolution, resolution, 3): one crop and one flip
    for all of them, as data.decode_crop does for an image. Training (rng given): a random window, then, with
    probability `resize_prob`, the shorter side resized to the resolution (videos smaller than the crop always), a
    random crop and a random horizontal flip. Evaluation (rng None): the first frames, the shorter side resized to
    the resolution, the center crop."""
    clip, _ = _frames(data, None, (frames - 1) * stride + 1, max_pixels, rng)
    clip = clip[::stride]
    w, h = clip[0].size
    resize = rng is None or min(w, h) < resolution or (resize_prob > 0 and rng.random() < resize_prob)
    size = (w, h)
    if resize:
        scale = resolution / min(w, h)
        size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    if rng is None:
        x0, y0 = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    else:
        x0, y0 = rng.randint(0, size[0] - resolution), rng.randint(0, size[1] - resolution)
    out = np.empty((frames, resolution, resolution, 3), dtype=np.uint8)
    for t, img in enumerate(clip):
        if size != (w, h):
            img = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
        out[t] = np.asarray(img.convert("RGB").crop((x0, y0, x0 + resolution, y0 + resolution)))
    if rng is not None and rng.random() < 0.5:
        out = out[:, :, ::-1]
    return out


def verify_video(data: bytes) -> None:
    """Raises SkipSample unless the first frame of the video decodes (what make-clips verifies)."""
    _frames(data, 0, 1, 1 << 40, None)


def encode_clip(frames: np.ndarray, fps: int = 16, codec: str = "libx264", crf: int = 18) -> bytes:
    """uint8 (T, H, W, 3) frames -> the bytes of an mp4 file (H.264, yuv420p: even H and W)."""
    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


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
