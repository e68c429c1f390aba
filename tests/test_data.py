"""Unit tests of data.py: decoding every image kind a crawl holds, skipping and counting the broken ones,
the endless sharded stream and its exact resume, evaluation reading and the make-shards command.
CPU only; tiny images and resolutions; every loader use is bounded by a deadline."""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import random
import re
import signal
import struct
import sys
import tarfile
import time
import zlib
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

import data
import sources
import shards
from conftest import free_port, run_cli, run_in_process

# data workers are processes and the CLI tests start one: a hang (a stuck worker) fails one test
pytestmark = pytest.mark.timeout(180)

R = 32  # crop resolution used throughout


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def noise_image(seed: int, size=(48, 40), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": 1}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def solid_png(value: int, size=(40, 40)) -> bytes:
    return encode(Image.new("RGB", size, (value, 255 - value, 7)), "PNG")


def write_tar(path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tf:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(payload), 0
            tf.addfile(info, io.BytesIO(payload))
    return str(path)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels and holds none: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


class PipelineHangs(BaseException):
    """Raised by deadline(). Not an OSError (as TimeoutError is) nor an Exception: the shard reader counts
    OSErrors as shard errors and skips on, which would swallow the alarm of a hang inside a read."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging: SIGALRM raises in the main thread after `seconds`."""
    def on_alarm(signum, frame):
        raise PipelineHangs(f"no result within {seconds} s (the data pipeline hangs)")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def train_loader(url: str, **kwargs):
    """A TrainLoader whose worker processes are shut down on exit (so later forks do not inherit them)."""
    args = dict(resolution=R, batch_size=2, seed=0, rank=0, world_size=1, num_workers=0, shuffle_buffer=4,
                resize_prob=0.5)
    args.update(kwargs)
    loader = data.TrainLoader(url, **args)
    try:
        yield loader
    finally:
        loader.close()
        del loader
        gc.collect()


def take(loader, n: int, seconds: float = 60) -> list[torch.Tensor]:
    with deadline(seconds):
        return [next(loader) for _ in range(n)]


def round_trip(state: dict) -> dict:
    """As a checkpoint stores it (the trainer loads checkpoints with weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def sample_ids(batch: torch.Tensor) -> list[int]:
    """The id of each image of a batch of solid_png images (its red value)."""
    flat = batch.reshape(batch.shape[0], 3, -1)
    assert (flat == flat[:, :, :1]).all(), "solid images stay solid through crop, resize and flip"
    return flat[:, 0, 0].tolist()


# --------------------------------------------------------------------------------------------
# the zoo of image kinds and broken members
# --------------------------------------------------------------------------------------------
def good_members() -> list[tuple[str, bytes]]:
    a16 = np.zeros((40, 48), np.uint16)
    a16[:, :24], a16[:, 24:] = 65535, 32896
    palette = Image.new("P", (40, 40), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    return [
        ("rgb_png.png", encode(noise_image(1), "PNG")),
        ("rgb_jpg.jpg", encode(noise_image(2), "JPEG", quality=90)),
        ("gray.png", encode(noise_image(3, mode="L"), "PNG")),
        ("rgba.png", encode(Image.new("RGBA", (40, 40), (10, 20, 30, 0)), "PNG")),
        ("la.png", encode(Image.new("LA", (40, 40), (10, 0)), "PNG")),
        ("palette.png", encode(palette, "PNG")),
        ("palette_t.png", encode(palette, "PNG", transparency=1)),
        ("gray16.png", encode(Image.fromarray(a16), "PNG")),
        ("cmyk.jpg", encode(Image.new("CMYK", (40, 40), (0, 255, 255, 0)), "JPEG")),
        ("image.webp", encode(noise_image(4), "WEBP", lossless=True)),
        ("small.png", encode(noise_image(5, size=(10, 20)), "PNG")),
        ("upper.JPEG", encode(noise_image(6), "JPEG")),
    ]


def broken_members() -> list[tuple[str, bytes]]:
    jpeg = encode(noise_image(7, size=(64, 64)), "JPEG")
    return [
        ("ok0.png", encode(noise_image(10), "PNG")),
        ("corrupt.jpg", b"this is not an image at all"),
        ("ok1.png", encode(noise_image(11), "PNG")),
        ("empty.png", b""),
        ("truncated.jpg", jpeg[: len(jpeg) // 2]),
        ("notes.txt", b"a caption without an image"),
        ("notes.json", b"{}"),
        ("bomb.png", encode(Image.new("L", (1000, 1000)), "PNG")),  # 1e6 px > max_pixels, 1 kB on disk
        ("bomb_header.png", png_header_only(100_000, 100_000)),  # beyond PIL's own bomb limit
        ("ok2.png", encode(noise_image(12), "PNG")),
    ]


MAX_PIXELS = 200_000


def truncated_tar(path, n: int = 6) -> str:
    """A tar of n good PNGs cut in the middle of member 3's data (members 0, 1 and 2 are whole)."""
    write_tar(path, [(f"t{i}.png", encode(noise_image(20 + i), "PNG")) for i in range(n)])
    with tarfile.open(path) as tf:
        member = tf.getmembers()[3]
    cut = member.offset_data + member.size // 2
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw[:cut])
    return str(path)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    write_tar(root / "00000.tar", good_members())
    write_tar(root / "00001.tar", broken_members())
    truncated_tar(root / "00002.tar")
    return str(root / "{00000..00002}.tar")


@pytest.fixture(scope="module")
def solid_shards(tmp_path_factory):
    """3 shards of 3 solid-colour images each; image (shard s, index i) has red value 10 * (s + 1) + i."""
    root = tmp_path_factory.mktemp("solid")
    for s in range(3):
        write_tar(root / f"{s:05d}.tar", [(f"s{s}_{i}.png", solid_png(10 * (s + 1) + i)) for i in range(3)])
    return str(root / "{00000..00002}.tar")


def shard_ids(shard: int) -> set[int]:
    return {10 * (shard + 1) + i for i in range(3)}


# --------------------------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------------------------
def eval_decode(payload: bytes, resolution: int = R) -> np.ndarray:
    out = data.decode_crop(payload, resolution, None)
    assert out.dtype == np.uint8 and out.shape == (resolution, resolution, 3)
    return out


def test_decode_alpha_composited_over_white():
    transparent = Image.new("RGBA", (32, 32), (10, 20, 30, 0))
    assert (eval_decode(encode(transparent, "PNG")) == 255).all()
    half = Image.new("RGBA", (32, 32), (0, 100, 255, 128))
    # colour * a + 255 * (1 - a), a = 128 / 255
    expected = [round(c * 128 / 255 + 255 * 127 / 255) for c in (0, 100, 255)]
    assert np.abs(eval_decode(encode(half, "PNG"))[5, 5].astype(int) - expected).max() <= 1
    opaque = Image.new("RGBA", (32, 32), (10, 20, 30, 255))
    assert (eval_decode(encode(opaque, "PNG")) == (10, 20, 30)).all()
    la = Image.new("LA", (32, 32), (10, 0))
    assert (eval_decode(encode(la, "PNG")) == 255).all()
    la_opaque = Image.new("LA", (32, 32), (10, 255))
    assert (eval_decode(encode(la_opaque, "PNG")) == 10).all()


def test_decode_palette_with_and_without_transparency():
    img = Image.new("P", (32, 32), 1)
    img.putpixel((0, 0), 0)
    img.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    plain = eval_decode(encode(img, "PNG"))
    assert tuple(plain[5, 5]) == (200, 100, 50) and tuple(plain[0, 0]) == (0, 0, 0)
    with_t = eval_decode(encode(img, "PNG", transparency=0))  # index 0 transparent
    assert tuple(with_t[0, 0]) == (255, 255, 255) and tuple(with_t[5, 5]) == (200, 100, 50)


def test_decode_16bit_grayscale():
    a16 = np.zeros((32, 32), np.uint16)
    a16[:, :16], a16[:, 16:] = 65535, 32896
    payload = encode(Image.fromarray(a16), "PNG")
    assert Image.open(io.BytesIO(payload)).mode in ("I;16", "I")
    out = eval_decode(payload)
    assert (out[:, :16] == 255).all()
    assert (np.abs(out[:, 16:].astype(int) - 128) <= 1).all()
    # and through a resize (training crop of a larger 16-bit image)
    big = np.full((80, 64), 32896, np.uint16)
    crop = data.decode_crop(encode(Image.fromarray(big), "PNG"), R, random.Random(0), resize_prob=1.0)
    assert crop.dtype == np.uint8 and (np.abs(crop.astype(int) - 128) <= 1).all()


def test_decode_gray_cmyk_webp():
    gray = eval_decode(encode(Image.new("L", (32, 32), 77), "PNG"))
    assert (gray == 77).all()
    cmyk_red = eval_decode(encode(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95))
    assert np.abs(cmyk_red[10, 10].astype(int) - (255, 0, 0)).max() <= 3
    webp = eval_decode(encode(Image.new("RGB", (32, 32), (200, 10, 60)), "WEBP", lossless=True))
    assert (webp == (200, 10, 60)).all()


def test_decode_exif_orientation():
    img = Image.new("RGB", (64, 32), (0, 0, 0))
    img.paste((255, 255, 255), (32, 0, 64, 32))  # right half white as stored
    exif = Image.Exif()
    exif[0x0112] = 3  # rotate 180 for display
    out = eval_decode(encode(img, "JPEG", quality=95, exif=exif.tobytes()))
    # displayed: left half white; the center crop covers stored columns 16..48
    assert out[:, :12].min() > 200 and out[:, 20:].max() < 50


def test_decode_small_image_is_resized_up():
    payload = encode(noise_image(5, size=(10, 20)), "PNG")
    for seed in range(3):
        crop = data.decode_crop(payload, R, random.Random(seed), resize_prob=0.0)
        assert crop.shape == (R, R, 3) and crop.dtype == np.uint8
    assert eval_decode(payload).shape == (R, R, 3)


@pytest.mark.parametrize("name,payload,reason", [
    ("garbage", b"definitely not an image", "corrupt"),
    ("empty", b"", "corrupt"),
    ("truncated jpeg", encode(noise_image(7, size=(64, 64)), "JPEG")[:700], "corrupt"),
    ("bomb", encode(Image.new("L", (1000, 1000)), "PNG"), "too_large"),
    ("bomb header", png_header_only(100_000, 100_000), "too_large"),
])
def test_decode_rejects(name, payload, reason):
    with pytest.raises(data.SkipSample) as info:
        data.decode_crop(payload, R, random.Random(0), max_pixels=MAX_PIXELS)
    assert info.value.reason == reason


def test_training_crops_vary_and_flip():
    # a horizontal ramp: an unflipped crop increases left to right, a flipped one decreases
    ramp = np.tile(np.linspace(0, 255, 96).astype(np.uint8)[None, :, None], (80, 1, 3))
    payload = encode(Image.fromarray(ramp), "PNG")
    crops = [data.decode_crop(payload, R, random.Random(seed), resize_prob=0.0) for seed in range(24)]
    for c in crops:
        assert c.dtype == np.uint8 and c.shape == (R, R, 3)
    increasing = [int(c[0, -1, 0]) > int(c[0, 0, 0]) for c in crops]
    assert any(increasing) and not all(increasing)  # flips happen, not always
    assert len({c[0, :, 0].tobytes() for c in crops}) > 5  # random positions
    # seeded: the same rng state gives the same crop
    again = data.decode_crop(payload, R, random.Random(3), resize_prob=0.0)
    assert np.array_equal(again, crops[3])


def test_eval_center_crop_matches_manual(photos_dir):
    for name, resolution in (("chelsea.png", 64), ("coffee.png", 48), ("astronaut.png", 40)):
        with open(os.path.join(photos_dir, name), "rb") as f:
            payload = f.read()
        out = data.decode_crop(payload, resolution, None)
        assert np.array_equal(out, data.decode_crop(payload, resolution, None))  # deterministic
        img = Image.open(io.BytesIO(payload)).convert("RGB")
        w, h = img.size
        scale = resolution / min(w, h)
        size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
        resized = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
        x0, y0 = (size[0] - resolution) // 2, (size[1] - resolution) // 2
        manual = np.asarray(resized.crop((x0, y0, x0 + resolution, y0 + resolution)))
        assert np.abs(out.astype(int) - manual.astype(int)).max() <= 1, name


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_large_jpeg_draft_mode(mode):
    yy, xx = np.mgrid[0:1200, 0:1600]
    smooth = ((np.sin(xx / 90.0) + np.cos(yy / 70.0)) * 60 + 128).astype(np.uint8)
    img = Image.fromarray(smooth, "L")
    if mode != "L":
        img = Image.merge("RGB", (img, img.transpose(Image.Transpose.FLIP_LEFT_RIGHT), img)).convert(mode)
    payload = encode(img, "JPEG", quality=90)
    out = data.decode_crop(payload, 64, None)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    train = data.decode_crop(payload, 64, random.Random(0), resize_prob=1.0)
    assert train.shape == (64, 64, 3)
    # close to a full-resolution decode + resize (DCT-domain downscaling is not bit-exact)
    full = Image.open(io.BytesIO(payload)).convert("RGB").resize((85, 64), Image.Resampling.BICUBIC)
    reference = np.asarray(full.crop((10, 0, 74, 64))).astype(int)
    assert np.abs(out.astype(int) - reference).mean() < 4


def test_to_model_input_range():
    batch = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8).view(1, 1, 2, 3).expand(2, 3, 2, 3)
    x = data.to_model_input(batch, torch.device("cpu"))
    assert x.dtype == torch.float32 and x.shape == (2, 3, 2, 3)
    assert x.min().item() == -1.0 and x.max().item() == 1.0
    torch.testing.assert_close(x[0, 0].flatten(), torch.tensor([0, 1, 127, 128, 254, 255]) / 127.5 - 1)
    assert x.is_contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------
# skipping and counting the broken ones
# --------------------------------------------------------------------------------------------
def test_eval_reading_counts_each_kind_once(zoo):
    counters = Counter()
    good_url = zoo.replace("{00000..00002}", "{00000..00001}")
    with deadline(60):
        batches = list(data.iter_eval_batches(good_url, R, 4, max_pixels=MAX_PIXELS, counters=counters))
    images = torch.cat([b for _, b in batches])
    indices = [i for idx, _ in batches for i in idx]
    assert images.dtype == torch.uint8 and images.shape == (len(good_members()) + 3, 3, R, R)
    assert dict(counters) == {"corrupt": 3, "non_image": 1, "too_large": 2}
    # the samples that carry an image are numbered 0.. in shard order; the broken ones lose their slot
    assert indices == list(range(12)) + [12, 14, 19]  # ok0, ok1, ok2 of shard 1

    counters = Counter()
    with deadline(60):
        batches = list(data.iter_eval_batches(zoo.replace("{00000..00002}", "00002"), R, 4, counters=counters))
    assert counters["shard_errors"] == 1 and counters["non_image"] == counters["too_large"] == 0
    assert sum(len(idx) for idx, _ in batches) >= 2  # what was read before the cut stands


def test_truncated_tar_keeps_every_whole_sample(tmp_path):
    path = truncated_tar(tmp_path / "cut.tar")
    counters = Counter()
    keys = [s["__key__"] for _, s in sources.iter_shard(path, counters)]
    assert counters["shard_errors"] == 1
    assert keys == ["t0", "t1", "t2"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_train_loader_survives_the_zoo(zoo, num_workers):
    with train_loader(zoo, batch_size=4, num_workers=num_workers, max_pixels=MAX_PIXELS) as loader:
        batches = take(loader, 48)  # 4 lanes: each reads every shard (few), 48 images
        for b in batches:
            assert b.dtype == torch.uint8 and b.shape == (4, 3, R, R)
            x = data.to_model_input(b, torch.device("cpu"))
            assert x.dtype == torch.float32 and x.min().item() >= -1.0 and x.max().item() <= 1.0
        skipped = loader.skipped()
        assert set(skipped) == set(data.DATA_COUNTS)
        # (a clip stream's own reasons, non_video and too_short: tests/test_video.py)
        assert all(skipped[k] > 0 for k in data.SKIP_REASONS
                   if k not in ("non_video", "too_short", "variable_frame_rate")), skipped
        # several epochs went by (each counts its broken members again)
        state = loader.state_dict()
        assert sum(st["epoch"] for st in state["lanes"].values()) >= 2
        # and it keeps going
        assert take(loader, 4)[-1].shape == (4, 3, R, R)


def test_skips_are_reported_as_events_and_distinct_files_naming_each_once(zoo, capfd, monkeypatch):
    """Bad files are met again at every epoch: the log line says how often (events) and how many files that is,
    and each bad file is named once, not at every meeting."""
    import run_log
    sources._warned.add("skipped a corrupt sample (corrupt)")  # an earlier stream in this process named it: this one must too
    with train_loader(zoo, batch_size=4, max_pixels=MAX_PIXELS) as loader:
        take(loader, 48)
        epochs = sum(st["epoch"] for st in loader.state_dict()["lanes"].values())
        skipped = loader.skipped()
    assert epochs >= 3
    events = sum(skipped[reason] for reason in data.SKIP_REASONS)
    # shard 1: corrupt, empty, truncated, notes (no image), bomb, bomb_header; shard 2: cut short
    assert skipped["files"] == 7 and events >= 2 * 7, skipped
    metrics = {"img_per_s": 1.0, "eta_s": 0.0, **{f"data/skipped_{k}": v for k, v in skipped.items()}}
    assert f"| skipped {events} (7 files)" in run_log.log_line(metrics, 10, 100, gan=False)
    assert "outage" not in run_log.log_line(metrics, 10, 100, gan=False)
    metrics["data/skipped_outage_waits"] = 3  # not a bad file: shown apart, and not in the events
    assert f"| skipped {events} (7 files) | outage waits 3" in run_log.log_line(metrics, 10, 100, gan=False)
    err = capfd.readouterr().err
    for name in ("corrupt", "empty", "truncated", "notes", "bomb", "bomb_header"):
        assert len(re.findall(rf"warning: skipped an? [a-z-]+ sample \({name}\)", err)) == 1, (name, err)
    assert len(re.findall(r"warning: shard .*00002.tar: .*skipping the rest of it", err)) == 1, err


def test_train_loader_clean_data_counts_nothing(solid_shards):
    with train_loader(solid_shards) as loader:
        take(loader, 12)
        assert loader.skipped() == {"corrupt": 0, "non_image": 0, "too_large": 0, "shard_errors": 0, "non_video": 0,
                                    "too_short": 0, "variable_frame_rate": 0, "files": 0, "outage_waits": 0}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_nothing_decodable_raises_dataset_error(tmp_path, num_workers):
    url = write_tar(tmp_path / "bad.tar", [(f"k{i}.jpg", b"garbage %d" % i) for i in range(5)]
                    + [("caption.txt", b"text")])
    # the stream gives up after 10 * buffer + 1000 failures in a row: well under a second here
    with train_loader(url, num_workers=num_workers, shuffle_buffer=2) as loader:
        with deadline(60), pytest.raises(data.DatasetError):
            next(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unreadable_shards_raise_dataset_error(tmp_path, num_workers):
    write_tar(tmp_path / "a.tar", [])  # a valid but empty tar
    with open(tmp_path / "b.tar", "wb") as f:
        f.write(b"\x00garbage" * 100)
    with train_loader(str(tmp_path / "{a,b}.tar"), num_workers=num_workers) as loader:
        with deadline(60), pytest.raises(data.DatasetError):
            next(loader)


def test_dataset_error_from_worker_is_one_line(tmp_path):
    url = write_tar(tmp_path / "bad.tar", [(f"k{i}.jpg", b"garbage") for i in range(3)])
    with train_loader(url, num_workers=2, shuffle_buffer=2) as loader:
        with deadline(60), pytest.raises(data.DatasetError) as info:
            next(loader)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# remote shards (loopback only)
# --------------------------------------------------------------------------------------------
HANG_HOLD_S = 40


def serve_directory(directory: str, port: int = 0):
    """A loopback http server of `directory` in a thread (port 0: any free one); stop it with stop_serving."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Quiet, directory=directory))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop_serving(server) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def remote(solid_shards):
    """An http server of the solid shards, a port with nothing listening ('dead') and a server that accepts
    connections and never answers ('hang'; it drops each one after HANG_HOLD_S, so that even a reader without
    a timeout of its own gets free). All closed at the end of the module."""
    import socket
    import threading

    server = serve_directory(os.path.dirname(solid_shards))
    dead_port = free_port()
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(64)

    def hold_connections():
        while True:
            try:
                conn, _ = hang.accept()
            except OSError:  # the listening socket was closed: the module is done
                return
            timer = threading.Timer(HANG_HOLD_S, conn.close)
            timer.daemon = True
            timer.start()

    threading.Thread(target=hold_connections, daemon=True).start()
    try:
        yield {"good": f"http://127.0.0.1:{server.server_address[1]}/{{00000..00002}}.tar",
               "dead": f"http://127.0.0.1:{dead_port}/00003.tar",
               "hang": f"http://127.0.0.1:{hang.getsockname()[1]}/00004.tar"}
    finally:
        stop_serving(server)
        hang.close()


@pytest.fixture()
def short_timeouts(monkeypatch):
    """Seconds instead of the production half-minutes, so that the stalls below are quick."""
    monkeypatch.setattr(sources, "STALL_TIMEOUT_S", 2)
    monkeypatch.setattr(sources, "PROBE_TIMEOUT_S", 3)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_remote_shards_stream_like_local_ones(remote, solid_shards):
    """The curl path reads exactly what the local path reads."""
    local, http = Counter(), Counter()
    for shard_url, local_path in zip(sources.list_shards(remote["good"]), sources.list_shards(solid_shards)):
        with deadline(30):
            ours = [(i, s["png"]) for i, s in sources.iter_shard(shard_url, http)]
        assert ours == [(i, s["png"]) for i, s in sources.iter_shard(local_path, local)] and len(ours) == 3
    assert http == local == Counter()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_dead_or_hung_remote_shards_are_skipped_and_counted(remote, short_timeouts):
    """Mid-run, a refused connection and a server that never answers cost a skipped shard each (counted in
    data/skipped_shard_errors), not a hung run; the good shards keep the batches coming, epoch after epoch."""
    url = "::".join([remote["good"], remote["dead"], remote["hang"]])
    with train_loader(url, shuffle_buffer=2, batch_size=1) as loader:  # one lane reads all 3 shards
        # measured rather than deadline(): the elapsed time is the assertion
        start = time.monotonic()
        seen = {v for _ in range(20) for v in sample_ids(next(loader))}
        elapsed = time.monotonic() - start
        assert seen == shard_ids(0) | shard_ids(1) | shard_ids(2)
        # the hung shard costs STALL_TIMEOUT_S (2 s) per visit; a reader that waits for the server to give up
        # would need HANG_HOLD_S per visit
        assert elapsed < HANG_HOLD_S - 5, elapsed
        state = loader.state_dict()["lanes"][0]
        assert state["epoch"] >= 1  # every shard was visited at least once
        assert loader.skipped()["shard_errors"] >= 2 * state["epoch"], (state, loader.skipped())


OUTAGE_S = 4


@contextlib.contextmanager
def shard_server_process(directory: str, port: int):
    """`python -m http.server` in its own process, so that stopping it closes its port for sure: data worker
    processes forked from this one would inherit the listening socket of a server thread here and keep it
    open (connections then hang instead of being refused)."""
    import socket
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.process
@pytest.mark.timeout(90)
def test_a_shard_server_outage_is_ridden_out(solid_shards, capfd):
    """Serve 3 shards, read a few batches, stop the server for OUTAGE_S seconds, start it again: the stream waits
    (with back-off, counted and said on stderr) and goes on with every shard, instead of ending the run."""
    import threading
    directory, port = os.path.dirname(solid_shards), free_port()
    url = f"http://127.0.0.1:{port}/{{00000..00002}}.tar"
    with contextlib.ExitStack() as servers, train_loader(url, shuffle_buffer=2, num_workers=1, batch_size=1,
                                                         shard_retry_minutes=1) as loader:  # one lane: all 3 shards
        with shard_server_process(directory, port):
            take(loader, 6)
        back = threading.Timer(OUTAGE_S, lambda: servers.enter_context(shard_server_process(directory, port)))
        back.start()
        start = time.monotonic()
        # 24 images need 8 more shard reads (3 samples each): the outage is met and outlived
        seen = {v for b in take(loader, 24, seconds=60) for v in sample_ids(b)}
        waited = time.monotonic() - start
        back.join()
        assert seen == shard_ids(0) | shard_ids(1) | shard_ids(2)
        assert waited >= OUTAGE_S - 1, waited  # the stream had nothing to give while the server was down
        skipped = loader.skipped()
        assert skipped["outage_waits"] >= 2 and skipped["shard_errors"] >= 3, skipped
        assert skipped["files"] == 3  # each shard failed, each counted once among the distinct bad ones
        assert skipped["corrupt"] == skipped["non_image"] == skipped["too_large"] == 0
    err = capfd.readouterr().err
    assert re.search(r"warning: data lane 0: no shard could be read \(.*127\.0\.0\.1.*\); retrying for up "
                     r"to 1 min \(--shard_retry_minutes\)", err), err
    assert re.search(r"warning: data lane 0: shards readable again after \d+ s", err), err


@pytest.mark.process
@pytest.mark.timeout(90)
def test_a_shard_server_that_stays_down_ends_the_run_in_one_line_after_the_budget(solid_shards):
    """The budget spent without a readable shard: one line, from the data worker process, naming the URL's
    failure and the flag; not before the budget."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/{{00000..00002}}.tar"
    budget_s = 2.4
    with train_loader(url, shuffle_buffer=2, num_workers=1, shard_retry_minutes=budget_s / 60) as loader:
        with shard_server_process(os.path.dirname(solid_shards), port):
            take(loader, 3)
        start = time.monotonic()
        with deadline(60), pytest.raises(data.DatasetError) as info:
            take(loader, 20)
        waited = time.monotonic() - start
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("no shard of the dataset could be read for ") and "127.0.0.1" in message, message
    assert "--shard_retry_minutes" in message and "last checkpoint" in message, message
    assert budget_s <= waited < budget_s + 20, waited


def test_outage_backs_off_exponentially_up_to_a_cap_within_the_budget(monkeypatch):
    """The waits between passes double from RETRY_FIRST_WAIT_S up to RETRY_MAX_WAIT_S, the last one ends with the
    budget, and the next gives up. (The clock and the sleep are replaced: ten minutes of waits in no time.)"""
    clock, waits = [1000.0], []

    def fake_sleep(seconds, should_stop=None):
        waits.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(data, "sleep_unless_stopped", fake_sleep)
    outage = data.Outage(lane=0, budget_s=600, first_error="x: refused")
    with pytest.raises(data.DatasetError, match="could be read for 600 s"):
        for _ in range(100):
            outage.wait("http://h/0.tar: Connection refused")
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60, 60, 60, 600 - 543], waits


def logged_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def trainer_through_an_outage(solid_shards, tmp_path, retry_minutes: float, num_workers: int = 1, nproc: int = 0):
    """A trainer (CLI, `num_workers` data workers: 0 reads in the trainer's own process; `nproc` ranks under
    torchrun) reading 3 shards over HTTP, logging every step, no periodic checkpoint; the server goes away once 2
    steps are logged. Yields (process, run directory, paths of its stdout and stderr)."""
    import subprocess
    from conftest import PLUMBING, cli_command, cli_env, kill_tree
    port, run_dir = free_port(), tmp_path / "runs" / "outage"
    args = ["--dataset_url", f"http://127.0.0.1:{port}/{{00000..00002}}.tar", "--output_dir", str(tmp_path / "runs"),
            "--run_name", "outage", "--max_steps", "100000", "--save_every_n_steps", "100000",
            "--log_every_n_steps", "1", "--evaluate_every_n_steps", "0", "--shard_retry_minutes", str(retry_minutes),
            *PLUMBING, "--num_workers", str(num_workers)]
    # stdout and stderr to files: a pipe nobody reads while the run goes on could fill up and stall it
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        trainer = subprocess.Popen(cli_command("vae_trainer.py", args, nproc), stdout=out, stderr=err, env=cli_env())
    try:
        with shard_server_process(os.path.dirname(solid_shards), port):
            end = time.monotonic() + 100
            while len(logged_steps(run_dir)) < 2 and trainer.poll() is None and time.monotonic() < end:
                time.sleep(0.2)
            assert len(logged_steps(run_dir)) >= 2, (trainer.poll(), err_path.read_text()[-3000:])
        yield trainer, run_dir, out_path, err_path
    finally:
        kill_tree(trainer)
        trainer.wait()


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the trainer process of `rank` under a torchrun (its environment says RANK)."""
    todo, tree = [torchrun_pid], process_tree()
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            env = []
        if f"RANK={rank}".encode() in env and pid != torchrun_pid:
            return pid
        todo += tree.get(pid, [])
    raise AssertionError(f"no process of rank {rank} under {torchrun_pid}")


def newest_checkpoint_step(run_dir) -> int | None:
    from checkpoint import checkpoint_files, load_checkpoint
    files = checkpoint_files(str(run_dir / "checkpoints"))
    return load_checkpoint(files[0])["run"]["step"] if files else None


@pytest.mark.process
@pytest.mark.timeout(150)
def test_a_run_whose_shard_server_stays_down_stops_in_one_line_with_a_checkpoint_of_its_last_step(solid_shards,
                                                                                                   tmp_path):
    """The trainer's side: the server goes away and stays away past --shard_retry_minutes. The run ends with exit
    code 1 and one `error:` line (no traceback), after writing a checkpoint at its last completed step (no
    periodic one was due), whose data position is that of the end of that step: the work is not lost."""
    from checkpoint import checkpoint_files, load_checkpoint
    with trainer_through_an_outage(solid_shards, tmp_path, retry_minutes=0.05) as (trainer, run_dir, out, err):
        trainer.wait(timeout=100)
        out, err = out.read_text(), err.read_text()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert trainer.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], out[-2000:] + err[-3000:]
    assert errors[0].startswith("error: no shard of the dataset could be read for ") and "--shard_retry_minutes" \
        in errors[0], errors
    assert "no shard could be read" in err and "retrying for up to 0.05 min" in err, err[-3000:]
    last_step = logged_steps(run_dir)[-1]
    assert errors[0].endswith(f"(checkpoint written at step {last_step})"), errors
    assert newest_checkpoint_step(run_dir) == last_step
    ckpt = load_checkpoint(checkpoint_files(str(run_dir / "checkpoints"))[0])
    assert ckpt["run"]["ranks"][0]["data"]["step"] == last_step  # the stream's position at the end of that step


@pytest.mark.process
@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_workers", [1, 0])
def test_a_stop_signal_during_an_outage_is_honoured_at_once_with_a_checkpoint(solid_shards, tmp_path, num_workers):
    """SIGTERM while the trainer waits for data through an outage (its data worker backing off, the main process
    in its wait for the next batch; or, --num_workers 0, the trainer's own process backing off) stops the run
    within seconds, not after --shard_retry_minutes: exit 0 and a checkpoint at the last completed step."""
    with trainer_through_an_outage(solid_shards, tmp_path, retry_minutes=10, num_workers=num_workers) as (
            trainer, run_dir, out, err):
        end = time.monotonic() + 100
        while "no shard could be read" not in err.read_text() and time.monotonic() < end:
            time.sleep(0.2)
        steps = None
        while steps != logged_steps(run_dir) and time.monotonic() < end:  # the prefetched batches are used up
            steps = logged_steps(run_dir)
            time.sleep(3)
        assert trainer.poll() is None, err.read_text()[-3000:]
        trainer.send_signal(signal.SIGTERM)
        start = time.monotonic()
        trainer.wait(timeout=60)  # the old wait lasted the whole budget (10 min)
        stopped_in = time.monotonic() - start
        out, err = out.read_text(), err.read_text()
    assert trainer.returncode == 0 and "Traceback" not in err and "error:" not in err, err[-3000:]
    last_step = logged_steps(run_dir)[-1]
    assert f"stop request received while waiting for data: checkpoint written at step {last_step}, exiting" in out, \
        out[-2000:]
    assert newest_checkpoint_step(run_dir) == last_step
    assert stopped_in < 45, stopped_in  # ~1 s to see the flag, then the save and the workers' shutdown (5 s)


@pytest.mark.process
@pytest.mark.timeout(240)
def test_a_stop_on_one_rank_during_an_outage_stops_every_rank(solid_shards, tmp_path):
    """Issue 31 item 1: torchrun, 2 ranks, --num_workers 0; the shard server goes away and the ranks wait, each in
    its back-off or in the ranks' agreement behind the other. SIGTERM to rank 1 only (one node of several preempted):
    before, rank 1 sat inside the gloo all_reduce and never acted on it, rank 0 never learnt of it, and the run ended
    as an outage failure after the whole --shard_retry_minutes. Now rank 1 sets the store's stop key from the
    signal itself, rank 0's wait reads it within a second: every rank saves and exits 0 within seconds."""
    with trainer_through_an_outage(solid_shards, tmp_path, retry_minutes=10, num_workers=0, nproc=2) as (
            trainer, run_dir, out, err):
        end = time.monotonic() + 100
        while "no shard could be read" not in err.read_text() and time.monotonic() < end:
            time.sleep(0.2)
        steps = None
        while steps != logged_steps(run_dir) and time.monotonic() < end:  # no step has come for 3 s: both wait
            steps = logged_steps(run_dir)
            time.sleep(3)
        assert trainer.poll() is None, err.read_text()[-3000:]
        os.kill(rank_pid(trainer.pid, 1), signal.SIGTERM)
        start = time.monotonic()
        trainer.wait(timeout=90)  # the old wait lasted the whole budget (10 min)
        stopped_in = time.monotonic() - start
        out, err = out.read_text(), err.read_text()
    assert trainer.returncode == 0 and "Traceback" not in err and "error:" not in err, err[-3000:]
    last_step = logged_steps(run_dir)[-1]
    assert f"stop request received while waiting for data: checkpoint written at step {last_step}, exiting" in out, \
        out[-2000:] + err[-2000:]
    assert newest_checkpoint_step(run_dir) == last_step
    assert stopped_in < 60, stopped_in


def test_unreadable_local_shards_are_not_waited_for(tmp_path):
    """Only remote shards have outages to ride out: unreadable local files still end the stream at once."""
    with open(tmp_path / "a.tar", "wb") as f:
        f.write(b"\x00garbage" * 100)
    with train_loader(str(tmp_path / "a.tar"), shard_retry_minutes=10) as loader:
        start = time.monotonic()
        with deadline(60), pytest.raises(data.DatasetError, match="no readable sample"):
            next(loader)
        assert time.monotonic() - start < 5


def process_tree() -> dict[int, list[int]]:
    """parent pid -> child pids, for every process alive (zombies left out: they hold nothing)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


START_METHODS = ("fork", "forkserver", "spawn")  # Linux's default before Python 3.14, its default since, macOS's


def trainer_command(args: list[str], start_method: str) -> list[str]:
    """The trainer's CLI run with `start_method` as multiprocessing's default (what a Python whose default it is
    gives the DataLoader)."""
    from conftest import ROOT
    path = os.path.join(ROOT, "vae_trainer.py")
    code = (f"import multiprocessing, runpy, sys; multiprocessing.set_start_method({start_method!r}); "
            f"sys.argv = [{path!r}] + sys.argv[1:]; sys.path.insert(0, {ROOT!r}); runpy.run_path({path!r}, run_name='__main__')")
    return [sys.executable, "-c", code, *args]


def data_workers(trainer_pid: int) -> list[int]:
    """The trainer's data workers: its python descendants but the multiprocessing helpers (the fork server, a
    direct child under forkserver whose children the workers are, and the resource tracker)."""
    tree, workers = process_tree(), []

    def python_cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return None
        return argv if os.path.basename(argv[0]).startswith(b"python") else None

    for child in tree.get(trainer_pid, []):
        argv = python_cmdline(child)
        if argv is None or any(b"resource_tracker" in a for a in argv):
            continue
        if any(b"forkserver" in a for a in argv):
            workers += [w for w in tree.get(child, []) if python_cmdline(w) is not None]
        else:
            workers.append(child)
    return workers


@pytest.mark.parametrize("start_method", [pytest.param(m, marks=[pytest.mark.process] if m != "fork" else [])
                                          for m in START_METHODS])  # spawn and forkserver start interpreters
def test_train_loader_reads_under_every_start_method(solid_shards, start_method):
    """Python 3.14 made forkserver Linux's default start method, and spawn is macOS's: the workers must live as long
    as the trainer under each (they watch the trainer's pid: under forkserver their parent is the fork server, and
    a worker that checked its parent died at once, 'DataLoader worker exited unexpectedly')."""
    import multiprocessing
    default = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(start_method, force=True)
    try:
        with train_loader(solid_shards, num_workers=2, shuffle_buffer=2) as loader:
            assert loader.loader.multiprocessing_context is None  # the default context, whichever it is
            batches = take(loader, 6)
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert len(batches) == 6 and all(b.shape == (2, 3, 32, 32) for b in batches)


IGNORE_STOP_SIGNALS = data.ignore_stop_signals


def abort_at_exit(worker_id: int = 0) -> None:
    """A data worker that aborts as it exits: what a spawn or forkserver worker does when its interpreter finalizes
    while the queue's feeder thread is inside torch's C++ (seen in CI: 'terminate called without an active
    exception' while the workers were being shut down; TrainLoader.close)."""
    import faulthandler
    import multiprocessing.util
    IGNORE_STOP_SIGNALS(worker_id)
    faulthandler.disable()  # (pytest's traceback dump of an abort asked for)
    multiprocessing.util.Finalize(None, os.abort, exitpriority=100)


def test_closing_the_loader_survives_a_worker_that_dies_on_its_way_out(solid_shards, monkeypatch):
    """Closing the loader ends its workers; one that dies on its way out (it was leaving anyway) must not turn the
    close into 'RuntimeError: DataLoader worker ... is killed by signal: Aborted' after a run's last checkpoint."""
    import multiprocessing
    monkeypatch.setattr(data, "ignore_stop_signals", abort_at_exit)
    default = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("fork", force=True)  # the patched init reaches the workers
    try:
        loader = data.TrainLoader(solid_shards, resolution=R, batch_size=2, seed=0, rank=0, world_size=1,
                                  num_workers=2, shuffle_buffer=2)
        take(loader, 4)
        workers = list(loader._iter._workers)
        loader.close()
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert all(not w.is_alive() for w in workers)
    assert sorted(w.exitcode for w in workers) == [-signal.SIGABRT] * 2  # they did die as asked


@pytest.mark.process
@pytest.mark.timeout(150)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_data_workers_die_with_a_killed_trainer(solid_shards, tmp_path, start_method):
    """kill -9 of a training run's main process (what the OOM killer does) while its data workers are blocked
    reading from a shard server that stopped answering: no worker may stay behind, orphaned, whatever the start
    method. Without the parent-death signal a worker waits out curl's 30 s stall timeout, and one blocked writing
    to a full pipe stays for good."""
    import subprocess
    from conftest import PLUMBING, cli_env
    port = free_port()
    url = f"http://127.0.0.1:{port}/{{00000..00002}}.tar"
    args = ["--dataset_url", url, "--output_dir", str(tmp_path / "runs"), "--max_steps", "100000", *PLUMBING,
            "--num_workers", "2"]
    leftovers: list[int] = []
    with shard_server_process(os.path.dirname(solid_shards), port) as server, \
            subprocess.Popen(trainer_command(args, start_method), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=cli_env()) as trainer:
        try:
            workers: list[int] = []
            end = time.monotonic() + 100
            while len(workers) < 2 and trainer.poll() is None and time.monotonic() < end:
                time.sleep(0.2)
                workers = data_workers(trainer.pid)
            assert len(workers) == 2, (workers, trainer.poll())
            while not logged_steps(tmp_path / "runs" / "vae") and trainer.poll() is None and time.monotonic() < end:
                time.sleep(0.2)  # a first step trained: the workers have started (spawn imports torch first)
            time.sleep(2)  # the workers read shards and fill their prefetch queue
            assert trainer.poll() is None and all(map(is_running, workers)), "a data worker died, or its trainer"
            os.kill(server.pid, signal.SIGSTOP)  # connections are accepted by the kernel and never answered
            time.sleep(3)  # the workers are now blocked in reads that will not end
            tree = process_tree()
            leftovers = [p for w in workers for p in [w, *tree.get(w, [])]]  # the workers and their curl reads
            trainer.kill()
            trainer.wait()
            end = time.monotonic() + 5
            while any(map(is_running, workers)) and time.monotonic() < end:
                time.sleep(0.1)
            assert not [w for w in workers if is_running(w)], "data workers outlived their killed trainer"
        finally:
            os.kill(server.pid, signal.SIGCONT)
            trainer.kill()
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    if is_running(pid):
                        os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_a_worker_sees_its_trainer_end_also_as_an_unreaped_zombie():
    """The check behind every start method: the watch on the trainer's pid returns as soon as the trainer has
    ended, also while it is an unreaped zombie (it has died; its parent has not waited for it yet), and a worker
    starting after its trainer has gone sees it gone."""
    import subprocess
    import threading
    trainer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        watch = data.TrainerWatch(trainer.pid)
        waiter = threading.Thread(target=watch.wait, daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert watch.alive() and waiter.is_alive()  # its trainer is alive: it waits
        trainer.stdin.close()
        end = time.monotonic() + 30
        while is_running(trainer.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{trainer.pid}")  # ended, not reaped
        waiter.join(5)
        assert not waiter.is_alive() and not watch.alive()
    finally:
        trainer.kill()
        trainer.wait()
    assert not data.TrainerWatch(trainer.pid).alive()  # reaped: exit_with_trainer then exits at once


@pytest.mark.process
@pytest.mark.timeout(60)
def test_unreadable_remote_dataset_fails_at_start(remote, short_timeouts):
    """The start-up probe: no readable shard among those tried is one line within the probe time; one readable
    shard is enough."""
    for url in (remote["dead"], f"{remote['hang']}::{remote['dead']}"):
        with deadline(15), pytest.raises(data.DatasetError) as info:
            sources.probe_remote_shards(sources.list_shards(url))
        message = str(info.value)
        assert "\n" not in message and "cannot read" in message and "127.0.0.1" in message, message
    with deadline(15):
        sources.probe_remote_shards(sources.list_shards(f"{remote['hang']}::{remote['good']}::{remote['dead']}"))


@pytest.mark.process
@pytest.mark.timeout(60)
def test_unreachable_dataset_url_is_one_line_before_anything_starts(remote, tmp_path, capfd):
    """The command with the default timeouts (its main, in this process): a refused URL is one `error:` line at
    once, no run directory."""
    import vae_trainer
    from conftest import TINY, run_in_process
    proc = run_in_process(vae_trainer.main, ["--dataset_url", remote["dead"].replace("00003", "{00000..00003}"),
                                             "--output_dir", str(tmp_path / "runs"), *TINY], capfd)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert lines[0].startswith("error: --dataset_url: cannot read") and "Failed to connect" in lines[0], lines
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------
# shard lists
# --------------------------------------------------------------------------------------------
def test_list_shards_brace_expansion(solid_shards):
    shards = sources.list_shards(solid_shards)
    root = os.path.dirname(solid_shards)
    assert shards == [os.path.join(root, f"{i:05d}.tar") for i in range(3)]
    assert sources.list_shards(os.path.join(root, "00001.tar")) == [os.path.join(root, "00001.tar")]
    two_lists = f"{os.path.join(root, '00000.tar')}::{os.path.join(root, '{00001..00002}.tar')}"
    assert sources.list_shards(two_lists) == shards


def test_list_shards_directory_pseudo_shards(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    for name in ("b.png", "a.JPG", "sub/c.webp", ".hidden.png", "readme.txt"):
        (tmp_path / name).write_bytes(b"x")
    shards = sources.list_shards(str(tmp_path))
    assert shards == [(str(tmp_path / "a.JPG"), str(tmp_path / "b.png"), str(tmp_path / "sub" / "c.webp"))]
    monkeypatch.setattr(sources, "DIR_SHARD_SIZE", 2)
    assert [len(s) for s in sources.list_shards(str(tmp_path))] == [2, 1]


def test_directory_dataset_trains(photos_dir):
    with train_loader(photos_dir, batch_size=3) as loader:
        batches = take(loader, 4)
    assert all(b.shape == (3, 3, R, R) and b.dtype == torch.uint8 for b in batches)


@pytest.mark.parametrize("url_kind", ["missing_shard", "missing_in_range", "empty_dir", "empty_url"])
def test_list_shards_errors_are_one_line(tmp_path, solid_shards, url_kind):
    root = os.path.dirname(solid_shards)
    url = {"missing_shard": str(tmp_path / "nope.tar"),
           "missing_in_range": os.path.join(root, "{00000..00004}.tar"),
           "empty_dir": str(tmp_path),
           "empty_url": ""}[url_kind]
    with pytest.raises(data.DatasetError) as info:
        sources.list_shards(url)
    msg = str(info.value)
    assert msg and "\n" not in msg
    if url_kind == "missing_in_range":
        assert "00003.tar" in msg and "1 more" in msg
    if url_kind in ("missing_shard", "empty_dir"):
        assert str(tmp_path) in msg


def test_a_folder_of_shards_points_to_the_brace_url(solid_shards):
    """Issue 23 item 10: the folder that holds the shards is not a dataset url (it was 'holds no image files');
    the line names the url that reads them."""
    root = os.path.dirname(solid_shards)
    with pytest.raises(data.DatasetError) as info:
        sources.list_shards(root)
    assert str(info.value) == (f"{root}: directory holds 3 .tar shards and no image files: give the shards "
                               f"themselves, e.g. '{solid_shards}' (quoted)")
    assert len(sources.list_shards(solid_shards)) == 3  # the url it names reads them


# --------------------------------------------------------------------------------------------
# sharding across ranks and workers; the endless stream
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_lanes_read_every_image_equally_often_and_a_step_from_different_shards(solid_shards, num_workers):
    """2 ranks of one image per micro-batch: 2 lanes over 3 shards of 3 images, a buffer of one sample (a shard's
    order within). The lanes go round one order of the shards from different places: each step's images come from
    2 shards, and in 9 steps every image is read twice (lanes owning shards[g::2] read shard 1's images 3 times
    and the others 1.5 times: lane 1 owned one shard, lane 0 two)."""
    per_rank = []
    for rank in range(2):
        with train_loader(solid_shards, rank=rank, world_size=2, num_workers=num_workers, batch_size=1,
                          shuffle_buffer=1) as loader:
            per_rank.append([sample_ids(b)[0] for b in take(loader, 9)])
    steps = list(zip(*per_rank))
    assert all(len({i // 10 for i in step}) == 2 for step in steps), steps  # red = 10 * (shard + 1) + index
    counts = Counter(i for step in steps for i in step)
    assert set(counts) == {i for s in range(3) for i in shard_ids(s)} and set(counts.values()) == {2}, counts


def uneven_shards(root, sizes: tuple[int, ...]) -> str:
    """Shards of the given sizes whose images have the distinct ids 1, 2, 3, ... (the red value), in shard order."""
    ids = iter(range(1, 256))
    for s, size in enumerate(sizes):
        write_tar(root / f"{s:05d}.tar", [(f"u{s}_{i}.png", solid_png(next(ids), (8, 8))) for i in range(size)])
    return str(root / f"{{00000..{len(sizes) - 1:05d}}}.tar")


# (shard sizes, ranks, lanes per rank): equal and uneven shards, more and fewer shards than lanes, ratios at which
# whole-shard starts (or starts bunched into the first shards) read some images twice and skip others in a pass
COVERAGE = [((4, 4, 4), 1, 2), ((5, 1, 3, 7), 1, 3), ((3, 1, 4, 1, 5, 9, 2, 6, 5, 3), 1, 4),
            ((2, 2, 2, 2, 2, 2, 2), 2, 3), ((6,), 1, 4), ((2, 9), 1, 5), ((7, 7, 7, 7, 7), 2, 2)]


@pytest.mark.parametrize("sizes,ranks,per_rank", COVERAGE)
def test_a_pass_over_the_data_reads_each_image_once(tmp_path, sizes, ranks, per_rank):
    """One pass (N images over L lanes: N / L steps) reads each image once however the shards' sizes divide among
    the lanes: in its first floor(N / L) steps no image twice, by ceil(N / L) steps every one; and a lane-epoch (N
    steps) reads each exactly L times (docs/data.md). A buffer of one sample per lane, so that a lane's draws are
    its reads, in order."""
    url, n, lanes = uneven_shards(tmp_path, sizes), sum(sizes), ranks * per_rank
    per_rank_ids = []
    for rank in range(ranks):
        with train_loader(url, rank=rank, world_size=ranks, batch_size=per_rank, shuffle_buffer=per_rank) as loader:
            per_rank_ids.append([sample_ids(b) for b in take(loader, n)])
    steps = [[i for rank in per_rank_ids for i in rank[step]] for step in range(n)]
    first = [i for step in steps[:n // lanes] for i in step]
    assert len(first) == len(set(first)), Counter(first).most_common(3)
    assert {i for step in steps[:-(-n // lanes)] for i in step} == set(range(1, n + 1))
    assert Counter(i for step in steps for i in step) == {i: lanes for i in range(1, n + 1)}


def test_a_stream_saved_by_an_earlier_release_resumes_exactly_with_its_whole_shard_starts(tmp_path, monkeypatch):
    """Earlier releases started lanes at whole shards and saved neither the shards' sizes nor how lanes start: a
    resume of such a run goes on as that release would have (its lanes keep their starts), and a new run's state
    carries the sizes it counted, so that its resume does not count them again."""
    url = uneven_shards(tmp_path, (5, 1, 3, 7))
    kwargs = dict(batch_size=3, shuffle_buffer=3, seed=4)
    with monkeypatch.context() as m:
        m.setattr(sources, "shard_sizes", lambda shards: None)  # the earlier release's starts
        with train_loader(url, **kwargs) as old:
            take(old, 5)
            state = round_trip(old.state_dict())
            expected = take(old, 9)
    state.pop("sizes")
    for lane in state["lanes"].values():
        assert lane.pop("starts") == "shard"
    with train_loader(url, state=state, **kwargs) as resumed:
        assert torch.equal(torch.stack(take(resumed, 9)), torch.stack(expected))
    with train_loader(url, **kwargs) as new:
        take(new, 2)
        state = round_trip(new.state_dict())
        expected = take(new, 9)
    assert state["sizes"] == [5, 1, 3, 7]
    monkeypatch.setattr(sources, "shard_sizes", lambda shards: pytest.fail("counted again on resume"))
    with train_loader(url, state=state, **kwargs) as resumed:
        assert torch.equal(torch.stack(take(resumed, 9)), torch.stack(expected))


def test_shard_size_counts_what_the_stream_reads(zoo, tmp_path, monkeypatch):
    """The lanes' starts are counted from the tar headers alone: the count is the samples iter_shard yields, for
    bad members, metadata, a member without an extension, a directory member and a truncated tar alike."""
    import webdataset as wds
    extra = write_tar(tmp_path / "meta.tar", [("__meta__.json", b"{}"), ("a.png", solid_png(1)), ("a.json", b"{}"),
                                              ("noext", b"x"), ("b.png", solid_png(2)), ("b.png", solid_png(3))])
    with wds.TarWriter(str(tmp_path / "written.tar")) as sink:  # a pax header before every member (make-shards')
        for i in range(7):
            sink.write({"__key__": f"dir/{'long' * 40 * (i % 2)}é{i}", "png": solid_png(i), "json": b"{}"})
    for fmt, name in ((tarfile.GNU_FORMAT, "gnu.tar"), (tarfile.PAX_FORMAT, "pax.tar"), (tarfile.GNU_FORMAT, "z.tgz")):
        with tarfile.open(tmp_path / name, "w:gz" if name.endswith("tgz") else "w", format=fmt) as tf:
            folder = tarfile.TarInfo("photos.d")  # a directory member whose name looks like a sample's: no sample
            folder.type = tarfile.DIRTYPE
            tf.addfile(folder)
            for i in range(5):
                for ext in ("png", "txt"):
                    info = tarfile.TarInfo(f"{'x' * 120}{i}.{ext}")
                    info.size = 1
                    tf.addfile(info, io.BytesIO(b"1"))
    shards = list(wds.shardlists.expand_urls(zoo)) + [extra, str(tmp_path / "missing.tar")] + [
        str(tmp_path / name) for name in ("written.tar", "gnu.tar", "pax.tar", "z.tgz")]
    for shard in shards:
        assert sources.shard_size(shard) == len(list(sources.iter_shard(shard, Counter()))), shard
    # the header reader's names are tarfile's (it reads webdataset's, GNU and pax tars itself)
    for name in ("written.tar", "gnu.tar", "pax.tar"):
        with tarfile.open(tmp_path / name) as tf:
            # (a directory's name as stored: tarfile drops its trailing slash)
            assert [(n.rstrip("/"), regular) for n, regular in sources._tar_members(str(tmp_path / name))] == [
                (m.name, m.isreg()) for m in tf]
    assert sources.shard_sizes(["https://host/a.tar"] + shards) is None  # remote: lanes start at whole shards
    assert sources.shard_sizes(shards, budget_s=0) is None  # counting past its budget: whole-shard starts, said
    with monkeypatch.context() as m:
        m.setattr(sources, "COUNT_BUDGET_S", 0.0)
        with train_loader(str(tmp_path / "written.tar")) as loader:
            assert loader.sizes is None and any("took over 0 s" in note for note in loader.notes)


def test_fewer_shards_than_workers(tmp_path):
    url = write_tar(tmp_path / "only.tar", [(f"k{i}.png", solid_png(100 + i)) for i in range(3)])
    with train_loader(url, num_workers=2) as loader:
        batches = take(loader, 8)
        state = loader.state_dict()
    assert set(state["lanes"]) == {0, 1} and all(st["drawn"] > 0 for st in state["lanes"].values())  # both lanes
    ids = [i for b in batches for i in sample_ids(b)]
    assert set(ids) == {100, 101, 102}
    # 2 ranks x 2 workers over 2 shards: every (rank, worker) still yields batches
    for s in range(2):
        write_tar(tmp_path / f"two{s}.tar", [(f"k{i}.png", solid_png(150 + 10 * s + i)) for i in range(2)])
    for rank in (0, 1):
        with train_loader(str(tmp_path / "two{0,1}.tar"), rank=rank, world_size=2, num_workers=2) as loader:
            take(loader, 6)
            lanes = loader.state_dict()["lanes"]
            assert set(lanes) == {2 * rank, 2 * rank + 1} and all(st["drawn"] > 0 for st in lanes.values())


def test_stream_is_seeded(solid_shards):
    with train_loader(solid_shards, seed=5) as a, train_loader(solid_shards, seed=5) as b:
        first, second = take(a, 6), take(b, 6)
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    with train_loader(solid_shards, seed=6) as c:
        other = take(c, 6)
    assert not all(torch.equal(x, y) for x, y in zip(first, other))


# --------------------------------------------------------------------------------------------
# exact resume
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers,k,n", [(0, 3, 5), (2, 1, 4), (2, 3, 5), (2, 4, 4)])
def test_exact_resume(shard_url, num_workers, k, n):
    kwargs = dict(batch_size=2, num_workers=num_workers, shuffle_buffer=3, seed=11)
    with train_loader(shard_url, **kwargs) as loader:
        take(loader, k)
        state = round_trip(loader.state_dict())
        expected = take(loader, n)
    assert state["step"] == k
    # mid-epoch, with samples waiting in a shuffle buffer
    buffers = [st["buffer"] for st in state["lanes"].values()]
    assert any(len(b) > 0 for b in buffers)
    with train_loader(shard_url, state=state, **kwargs) as resumed:
        got = take(resumed, n)
        assert resumed.state_dict()["step"] == k + n
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"batch {k + i} differs after resume"
    # the comparison has teeth: a fresh stream (no state) gives other batches at that point
    with train_loader(shard_url, **kwargs) as fresh:
        restart = take(fresh, n)
    assert not all(torch.equal(a, b) for a, b in zip(expected, restart))


def test_resume_with_another_worker_count_is_exact(shard_url, capfd):
    """The lanes' states move to whichever worker deals them (issue 34: it restarted from a new seed)."""
    kwargs = dict(batch_size=3, shuffle_buffer=3, seed=11)
    with train_loader(shard_url, num_workers=0, **kwargs) as loader:
        take(loader, 3)
        state = round_trip(loader.state_dict())
        expected = take(loader, 4)
    for workers in (2, 1):
        with train_loader(shard_url, num_workers=workers, state=state, **kwargs) as other:
            assert torch.equal(torch.stack(take(other, 4)), torch.stack(expected)), workers
    assert "warning" not in capfd.readouterr().err


# --------------------------------------------------------------------------------------------
# evaluation reading
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def five_images(tmp_path_factory):
    root = tmp_path_factory.mktemp("five")
    write_tar(root / "00000.tar", [(f"k{i}.png", solid_png(50 + i)) for i in range(3)])
    write_tar(root / "00001.tar", [(f"k{i}.png", solid_png(53 + i)) for i in range(2)])
    return str(root / "{00000..00001}.tar")


def eval_ids(url: str, **kwargs) -> tuple[list[int], list[int]]:
    indices, ids = [], []
    with deadline(60):
        for idx, batch in data.iter_eval_batches(url, R, 2, **kwargs):
            assert batch.dtype == torch.uint8 and batch.shape[1:] == (3, R, R) and len(idx) == batch.shape[0]
            indices += idx
            ids += sample_ids(batch)
    return indices, ids


def test_iter_eval_batches_split_across_ranks(five_images):
    single = eval_ids(five_images)
    assert single == ([0, 1, 2, 3, 4], [50, 51, 52, 53, 54])  # shard order, deterministic
    assert eval_ids(five_images) == single
    rank0, rank1 = eval_ids(five_images, rank=0, world_size=2), eval_ids(five_images, rank=1, world_size=2)
    assert rank0 == ([0, 2, 4], [50, 52, 54])
    assert rank1 == ([1, 3], [51, 53])
    assert sorted(rank0[0] + rank1[0]) == list(range(5))


def test_iter_eval_batches_max_images(five_images):
    assert eval_ids(five_images, max_images=3) == ([0, 1, 2], [50, 51, 52])
    r0 = eval_ids(five_images, rank=0, world_size=2, max_images=3)
    r1 = eval_ids(five_images, rank=1, world_size=2, max_images=3)
    assert sorted(r0[0] + r1[0]) == [0, 1, 2]
    assert eval_ids(five_images, max_images=0) == ([], [])


# --------------------------------------------------------------------------------------------
# make-shards
# --------------------------------------------------------------------------------------------
@pytest.fixture()
def image_folder(tmp_path):
    src = tmp_path / "src"
    (src / "sub1").mkdir(parents=True)
    (src / "sub2").mkdir()
    files = {
        "a.b.png": encode(noise_image(30), "PNG"),
        "a_b.png": encode(noise_image(31), "PNG"),  # the same key as a.b.png once dots go
        "sub1/x.png": encode(noise_image(32), "PNG"),
        "sub2/x.png": encode(noise_image(33), "PNG"),  # the same basename in another folder
        "photo.jpeg": encode(noise_image(34), "JPEG"),
    }
    for name, payload in files.items():
        (src / name).write_bytes(payload)
    (src / "broken.jpg").write_bytes(b"not a jpeg")
    return src, files


def read_tar_members(paths: list[str]) -> dict[str, bytes]:
    members = {}
    for path in paths:
        with tarfile.open(path) as tf:
            for m in tf.getmembers():
                assert m.name not in members
                members[m.name] = tf.extractfile(m).read()
    return members


@pytest.mark.process
def test_make_shards_cli(image_folder, tmp_path):
    src, files = image_folder
    dst = tmp_path / "dst"
    proc = run_cli("data.py", ["make-shards", str(src), str(dst), "--shard_size", "2"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"wrote 5 images into 3 shards \(1 unreadable skipped: broken.jpg\)", proc.stdout), proc.stdout
    m = re.search(r"--dataset_url '([^']+)'", proc.stdout)
    assert m, proc.stdout
    url = m.group(1)
    assert url == str(dst / "{00000..00002}.tar")
    shards = sources.list_shards(url)
    assert len(shards) == 3
    members = read_tar_members(shards)
    assert len(members) == 5
    keys = {name.split(".", 1)[0] for name in members}
    assert len(keys) == 5  # every image its own sample, duplicates included
    assert all("." not in name.rsplit(".", 1)[0] for name in members)  # keys hold no dot
    assert sorted(members.values()) == sorted(files.values())  # original bytes, no re-encode
    assert {"sub1/x.png", "sub2/x.png"} <= set(members)
    assert any(name.endswith(".jpg") for name in members)  # .jpeg is stored as jpg
    # and the shards read back through the training stream
    with train_loader(url, batch_size=5) as loader:
        assert take(loader, 2)[1].shape == (5, 3, R, R)
        assert loader.skipped()["corrupt"] == 0


@pytest.mark.parametrize("args", [["make-shards", "/nonexistent/src", "/tmp/whatever"],
                                  ["make-shards", "{src}", "{dst}", "--shard_size", "0"]])
def test_make_shards_bad_input(tmp_path, args, capfd):
    """(shards.main, what `python data.py make-shards` runs: test_make_shards_cli starts that command)"""
    args = [a.format(src=tmp_path, dst=tmp_path / "dst") for a in args]
    proc = run_in_process(shards.main, args, capfd)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert not (tmp_path / "dst").exists()


def test_make_shards_in_process(image_folder, tmp_path, capsys):
    src, files = image_folder
    assert shards.main(["make-shards", str(src), str(tmp_path / "one"), "--shard_size", "100"]) == 0
    out = capsys.readouterr().out
    assert f"--dataset_url '{tmp_path / 'one' / '00000.tar'}' to train on them, or --test_dataset_url " \
           f"'{tmp_path / 'one' / '00000.tar'}' to evaluate on them" in out  # a held-out set is read by the second
    assert len(read_tar_members([str(tmp_path / "one" / "00000.tar")])) == 5
    empty = tmp_path / "empty"
    empty.mkdir()
    assert shards.main(["make-shards", str(empty), str(tmp_path / "two")]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_make_shards_decodes_and_names_what_it_skips(tmp_path, capsys):
    """A truncated JPEG opens (its header is whole) but does not decode: make-shards must leave it out, as it does
    a file that is no image at all, and name both."""
    src = tmp_path / "src"
    src.mkdir()
    whole = encode(noise_image(40, size=(64, 64)), "JPEG", quality=90)
    (src / "good.jpg").write_bytes(whole)
    (src / "cut.jpg").write_bytes(whole[:len(whole) // 2])
    (src / "notes.png").write_bytes(b"plain text, not a png")
    with Image.open(io.BytesIO(whole[:len(whole) // 2])) as im:
        assert im.size == (64, 64)  # it opens: only decoding finds the damage
    assert shards.main(["make-shards", str(src), str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 images into 1 shards (2 unreadable skipped: cut.jpg, notes.png)" in out, out
    assert list(read_tar_members([str(tmp_path / "dst" / "00000.tar")]).values()) == [whole]


def test_make_shards_names_a_few_of_many(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.png").write_bytes(solid_png(1))
    for i in range(8):
        (src / f"bad{i}.jpg").write_bytes(b"junk")
    assert shards.main(["make-shards", str(src), str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    assert "(8 unreadable skipped: bad0.jpg, bad1.jpg, bad2.jpg, bad3.jpg, bad4.jpg and 3 more)" in out, out


def test_make_shards_nothing_readable(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(b"junk")
    (src / "b.png").write_bytes(b"")
    rc = shards.main(["make-shards", str(src), str(tmp_path / "dst")])
    captured = capsys.readouterr()
    assert rc != 0
    assert "--dataset_url" not in captured.out
    assert captured.err.strip().startswith("error:") and len(captured.err.strip().splitlines()) == 1


def _thumbnail(path: str) -> np.ndarray:
    """16 px grayscale, standardised: two views of one scene correlate far above two different photos."""
    with Image.open(path) as im:
        t = np.asarray(im.convert("L").resize((16, 16), Image.BOX), dtype=np.float64).ravel()
    return (t - t.mean()) / (t.std() + 1e-8)


def test_no_demo_held_out_photo_is_a_view_of_a_training_photo(tmp_path):
    """The demo's held-out PSNR measures photos the model has not seen: none may be another view of a training
    photo. The split trained on motorcycle_left.png and held out motorcycle_right.png, a stereo pair (their
    thumbnails correlate 0.86; no other pair above 0.42). A demo folder built with another split is rebuilt."""
    root = tmp_path / "demo_data"
    root.mkdir()
    (root / "READY").write_text("ok\n")  # a folder from the version with the leaking split
    (root / "00003.tar").write_bytes(b"stale")
    train_url, test_url = shards.ensure_demo_shards(str(root))
    assert not (root / "00003.tar").exists()

    def photos(url):
        names = []
        for path in sources.list_shards(url):
            with tarfile.open(path) as tar:
                names += [m.name for m in tar.getmembers() if m.isfile()]
        return names
    train, test = photos(train_url), photos(test_url)
    assert len(test) == 4 and not set(train) & set(test)
    src = os.path.join(os.path.dirname(__import__("skimage").__file__), "data")
    thumbs = {p: _thumbnail(os.path.join(src, p)) for p in shards.DEMO_PHOTOS}
    for held_out in shards.DEMO_TEST:
        closest = max(float((thumbs[held_out] * thumbs[p]).mean()) for p in shards.DEMO_PHOTOS
                      if p not in shards.DEMO_TEST)
        assert closest < 0.6, held_out
