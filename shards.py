"""Writing webdataset shards, the demo's shards, and the data command: everything that makes the data the training
stream (data.py) reads.

    python data.py make-shards SRC_DIR DST_DIR [--shard_size 1000]     # (data.py runs this module's CLI)
    python data.py make-clips SRC_DIR DST_DIR [--shard_size 100]       # videos (or --from_photos) for --video_frames
    python data.py make-clips SRC_DIR DST_DIR --segment_seconds 4      # long videos cut into re-encoded segments
    paths, skipped = write_shards(files, "shards/", shard_size=1000)   # the images' own bytes, decoded to check
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import numpy as np
from PIL import Image

import clips
from data import SkipSample, load_rgb
from sources import IMAGE_EXTS, DatasetError, brace_url, image_files

# --------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------
def write_shards(files: list[str], dst: str, shard_size: int = 1000, verify: bool = True,
                 root: str | None = None, prefix: str = "", check=load_rgb,
                 reasons: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Pack image files into `dst/{prefix}{00000..}.tar` with their original bytes (no re-encode).
    With `verify` each image is decoded in full first (a truncated JPEG opens but does not decode: training
    would skip it at every epoch): `check(bytes)` raises SkipSample (videos: clips.verify_video). Returns (shard
    paths, the files skipped as unreadable); `reasons`, if given, gets each skipped file's (SkipSample's reason,
    "unreadable" for a file that cannot be opened)."""
    import webdataset as wds
    os.makedirs(dst, exist_ok=True)
    if root is None:
        root = os.path.commonpath([os.path.dirname(f) for f in files]) if files else ""
    skipped, seen = [], set()
    pattern = os.path.join(dst, f"{prefix}%05d.tar")
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
        for path in files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
                if verify:
                    check(data)
            except (OSError, SkipSample) as e:
                skipped.append(path)
                if reasons is not None:
                    reasons[path] = getattr(e, "reason", "unreadable")
                continue
            ext = path.rsplit(".", 1)[-1].lower()
            ext = {"jpeg": "jpg", "tif": "tiff"}.get(ext, ext)
            # webdataset groups members by the name up to the first dot: keys must hold none
            key = re.sub(r"[^A-Za-z0-9_/-]", "_", os.path.splitext(os.path.relpath(path, root))[0])
            while key in seen:
                key += "_"
            seen.add(key)
            sink.write({"__key__": key, ext: data})
        n = sink.shard
    paths = [pattern % i for i in range(n) if os.path.exists(pattern % i)]
    return paths, skipped


def name_a_few(names: list[str], few: int = 5) -> str:
    """'a, b, c and 4 more'"""
    more = f" and {len(names) - few} more" if len(names) > few else ""
    return ", ".join(names[:few]) + more


# --------------------------------------------------------------------------------------------
# Demo data: sample photos bundled with scikit-image, or generated ones
# --------------------------------------------------------------------------------------------
# not motorcycle_left.png: the left view of the held-out motorcycle_right.png (a stereo pair; its 16 px thumbnail
# correlates 0.86 with it, no other photo above 0.42): trained on, it made a quarter of the held-out set a
# training image seen from a few centimetres away
DEMO_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg", "retina.jpg",
               "motorcycle_right.png", "ihc.png", "camera.png", "coins.png", "grass.png", "gravel.png", "brick.png",
               "logo.png", "page.png")
DEMO_TEST = ("chelsea.png", "motorcycle_right.png", "coffee.png", "rocket.jpg")  # held out for evaluation


def _generated_photos(dst: str, n: int = 16) -> list[str]:
    """Procedural stand-ins when scikit-image is absent: smooth gradients, discs, stripes and noise."""
    rng = np.random.default_rng(0)
    paths = []
    yy, xx = np.mgrid[0:384, 0:512] / 384.0
    for i in range(n):
        img = np.stack([np.sin(xx * rng.uniform(1, 9) + rng.uniform(0, 6)) * 0.5 + 0.5,
                        yy * rng.uniform(0.3, 1), np.cos((xx + yy) * rng.uniform(1, 12)) * 0.5 + 0.5], -1)
        for _ in range(6):
            cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1.33), rng.uniform(0.05, 0.3)
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.uniform(0, 1, 3)
        img = np.clip(img + rng.normal(0, 0.02, img.shape), 0, 1)
        path = os.path.join(dst, f"generated_{i:02d}.png")
        Image.fromarray((img * 255).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def _demo_split() -> str:
    return f"train {' '.join(p for p in DEMO_PHOTOS if p not in DEMO_TEST)}\ntest {' '.join(DEMO_TEST)}\n"


def _demo_ready(root: str) -> bool:
    try:
        with open(os.path.join(root, "READY")) as f:
            return f.read() == _demo_split()
    except OSError:
        return False


def ensure_demo_shards(root: str) -> tuple[str, str]:
    """Build the demo's train and test shards once under `root` (again when READY names other photos: a demo
    folder from a version with another split); returns their dataset urls."""
    done, split = os.path.join(root, "READY"), _demo_split()
    if not _demo_ready(root):
        if os.path.isdir(root):
            for f in os.listdir(root):
                if re.fullmatch(r"(test-)?\d{5}\.tar", f):
                    os.remove(os.path.join(root, f))
        os.makedirs(root, exist_ok=True)
        try:
            import skimage
            src = os.path.join(os.path.dirname(skimage.__file__), "data")
            photos = [os.path.join(src, p) for p in DEMO_PHOTOS if os.path.isfile(os.path.join(src, p))]
        except ImportError:
            photos = []
        if len(photos) < 6:
            gen = os.path.join(root, "generated")
            os.makedirs(gen, exist_ok=True)
            photos = _generated_photos(gen)
        test = [p for p in photos if os.path.basename(p) in DEMO_TEST] or photos[-2:]
        train = [p for p in photos if p not in test]
        write_shards(train, root, shard_size=max(1, math.ceil(len(train) / 3)), root=os.path.dirname(train[0]))
        write_shards(test, root, shard_size=len(test), root=os.path.dirname(test[0]), prefix="test-")
        with open(done, "w") as f:
            f.write(split)
    train = sorted(f for f in os.listdir(root) if re.fullmatch(r"\d{5}\.tar", f))
    return brace_url([os.path.join(root, f) for f in train]), os.path.join(root, "test-00000.tar")


def wait_for_demo_shards(root: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not _demo_ready(root):
        if time.time() > deadline:
            raise DatasetError(f"timed out waiting for the demo shards in {root}")
        time.sleep(0.5)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="data.py", description="Dataset tools for the VAE trainer.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    ms = sub.add_parser("make-shards", help="pack a folder of images into webdataset tar shards", allow_abbrev=False)
    ms.add_argument("src", help="folder of images (searched recursively)")
    ms.add_argument("dst", help="output folder for NNNNN.tar shards")
    ms.add_argument("--shard_size", type=int, default=1000, help="images per shard (default 1000)")
    ms.add_argument("--no_verify", action="store_true",
                    help="do not decode each image to check it (faster; broken files are then skipped at every "
                         "epoch of training)")
    mc = sub.add_parser("make-clips", help="pack a folder of videos into webdataset tar shards (--video_frames), or "
                                           "make moving-camera clips of a folder of photos", allow_abbrev=False)
    mc.add_argument("src", help=f"folder of videos ({', '.join(clips.VIDEO_EXTS)}; searched recursively), or of "
                                "photos with --from_photos")
    mc.add_argument("dst", help="output folder for NNNNN.tar shards")
    mc.add_argument("--shard_size", type=int, default=100, help="clips per shard (default 100)")
    mc.add_argument("--no_verify", action="store_true", help="do not decode each video's first frame to check it")
    mc.add_argument("--segment_seconds", type=float, default=0.0,
                    help="cut each video into segments of this many seconds (the last, if shorter than half a "
                         "segment, dropped), each its own sample, re-encoded as H.264 mp4 (--segment_crf) with a "
                         "keyframe at its start and the frames turned as the rotation metadata says (0: each file "
                         "packed whole, its own bytes)")
    mc.add_argument("--segment_crf", type=int, default=18, help="--segment_seconds: x264's quality, 0-51 (default 18, "
                                                                "visually lossless)")
    mc.add_argument("--from_photos", action="store_true",
                    help="each photo seen by a moving camera (pans, zooms, small rotations), encoded as H.264 mp4: "
                         "clips to try the video path on without videos")
    mc.add_argument("--frames", type=int, default=33, help="--from_photos: frames per clip (default 33)")
    mc.add_argument("--size", type=int, default=256, help="--from_photos: frame size in pixels, even (default 256)")
    mc.add_argument("--per_photo", type=int, default=4, help="--from_photos: clips per photo (default 4)")
    mc.add_argument("--fps", type=int, default=16, help="--from_photos: frame rate (default 16, Wan 2.1's)")
    mc.add_argument("--seed", type=int, default=0, help="--from_photos: the camera paths' seed")
    return parser


def write_photo_clips(photos: list[str], dst: str, frames: int, size: int, per_photo: int, fps: int, seed: int,
                      shard_size: int, prefix: str = "") -> list[str]:
    """Moving-camera clips of each photo (clips.photo_clips) as mp4 samples of `dst/{prefix}NNNNN.tar` shards;
    their paths."""
    import webdataset as wds
    os.makedirs(dst, exist_ok=True)
    pattern = os.path.join(dst, f"{prefix}%05d.tar")
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
        for i, path in enumerate(photos):
            with open(path, "rb") as f:
                photo = load_rgb(f.read())
            videos = clips.photo_clips([photo], frames, size, per_photo, seed + i, fps)
            name = re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(path))[0])
            for j, video in enumerate(videos):
                sink.write({"__key__": f"{name}_{j:03d}", "mp4": video})
        n = sink.shard
    return [pattern % i for i in range(n) if os.path.exists(pattern % i)]


def make_clips(args) -> int:
    """`python data.py make-clips`: a folder of videos, or of photos (--from_photos), into clip shards."""
    if args.segment_seconds < 0 or not math.isfinite(args.segment_seconds) or not 0 <= args.segment_crf <= 51:
        print("error: --segment_seconds must be a positive number of seconds (0: whole files) and --segment_crf in "
              "0-51", file=sys.stderr)
        return 2
    if args.segment_seconds and args.from_photos:
        print("error: --segment_seconds cuts videos: --from_photos makes clips of --frames frames", file=sys.stderr)
        return 2
    if args.from_photos:
        if args.frames < 1 or args.size < 2 or args.size % 2 or args.per_photo < 1 or args.fps < 1:
            print("error: --frames, --per_photo and --fps must be positive, --size even", file=sys.stderr)
            return 2
        photos = image_files(args.src)
        if not photos:
            print(f"error: {args.src}: no image files found", file=sys.stderr)
            return 2
        paths = write_photo_clips(photos, args.dst, args.frames, args.size, args.per_photo, args.fps, args.seed,
                                  args.shard_size)
        print(f"wrote {len(photos) * args.per_photo} clips of {args.frames} frames ({args.size} px, {args.fps} fps) "
              f"into {len(paths)} shards")
    elif args.segment_seconds:
        paths = write_segments(args)
        if paths is None:
            return 2
    else:
        paths = pack_folder(args, clips.VIDEO_EXTS, "video files", "videos", clips.verify_video)
        if paths is None:
            return 2
    url = brace_url(paths)
    print(f"--dataset_url '{url}' --video_frames N to train on clips of them (or --test_dataset_url to evaluate)")
    return 0


def write_segments(args) -> list[str] | None:
    """make-clips --segment_seconds: every video of args.src cut into segments (clips.cut_video), each a sample
    `<file's key>_NNNNN` of the shards; what was written and skipped said on stdout; None (the error said on stderr)
    when nothing could be."""
    import webdataset as wds
    files = image_files(args.src, clips.VIDEO_EXTS)
    if not files:
        print(f"error: {args.src}: no video files found", file=sys.stderr)
        return None
    os.makedirs(args.dst, exist_ok=True)
    pattern = os.path.join(args.dst, "%05d.tar")
    skipped, segments, seen = [], 0, set()
    with wds.ShardWriter(pattern, maxcount=args.shard_size, verbose=0) as sink:
        for path in files:
            try:
                with open(path, "rb") as f:
                    parts = list(clips.cut_video(f.read(), args.segment_seconds, crf=args.segment_crf))
            except (OSError, SkipSample):
                skipped.append(os.path.relpath(path, args.src))
                continue
            key = re.sub(r"[^A-Za-z0-9_/-]", "_", os.path.splitext(os.path.relpath(path, args.src))[0])
            while key in seen:
                key += "_"
            seen.add(key)
            for i, part in enumerate(parts):
                sink.write({"__key__": f"{key}_{i:05d}", "mp4": part})
            segments += len(parts)
        n = sink.shard
    paths = [pattern % i for i in range(n) if os.path.exists(pattern % i)]
    if none_read(args.src, paths, len(files), skipped, "video files"):
        return None
    print(f"wrote {segments} segments of {args.segment_seconds:g} s of {len(files) - len(skipped)} videos into "
          f"{len(paths)} shards ({len(skipped)} unreadable skipped" + (f": {name_a_few(skipped)})" if skipped else ")"))
    return paths


def none_read(src: str, paths: list[str], n_files: int, skipped: list[str], files_noun: str,
              variable: list[str] = ()) -> bool:
    """True, the shards written removed and the error said on stderr, when none of the `n_files` could be packed:
    `skipped` unreadable, `variable` with a variable frame rate (variable_rate_hint)."""
    if len(skipped) + len(variable) < n_files:
        return False
    for p in paths:
        os.remove(p)
    why = ([f"{len(skipped)} unreadable: {name_a_few(skipped)}"] if skipped else []) + (
        [variable_rate_hint(variable)] if variable else [])
    print(f"error: {src}: none of the {n_files} {files_noun} could be packed ({'; '.join(why)})", file=sys.stderr)
    return True


def variable_rate_hint(names: list[str]) -> str:
    """Videos whose frames are not evenly spaced from their start (SkipSample variable_frame_rate): readable, but
    no clip of consecutive frames can be cut from them as they are; --segment_seconds re-encodes them at a constant
    rate, every frame kept."""
    return (f"{len(names)} with a variable frame rate skipped: {name_a_few(names)}; clips need evenly spaced frames: "
            "make-clips --segment_seconds S re-encodes them at a constant rate")


def pack_folder(args, exts: tuple[str, ...], files_noun: str, noun: str, check) -> list[str] | None:
    """The files of `exts` under args.src into shards (write_shards, `check` verifying each), what was written and
    skipped said on stdout; None (the error said on stderr) when there is nothing to write."""
    files = image_files(args.src, exts)
    if not files:
        print(f"error: {args.src}: no {files_noun} found", file=sys.stderr)
        return None
    reasons: dict[str, str] = {}
    paths, skipped = write_shards(files, args.dst, args.shard_size, verify=not args.no_verify, root=args.src,
                                  check=check, reasons=reasons)
    names = [os.path.relpath(p, args.src) for p in skipped if reasons.get(p) != "variable_frame_rate"]
    variable = [os.path.relpath(p, args.src) for p in skipped if reasons.get(p) == "variable_frame_rate"]
    if none_read(args.src, paths, len(files), names, files_noun, variable):
        return None
    print(f"wrote {len(files) - len(skipped)} {noun} into {len(paths)} shards ({len(names)} unreadable skipped"
          + (f": {name_a_few(names)}" if names else "") + (f"; {variable_rate_hint(variable)}" if variable else "")
          + ")")
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.src):
        print(f"error: {args.src}: not a directory", file=sys.stderr)
        return 2
    if args.shard_size <= 0:
        print("error: --shard_size must be positive", file=sys.stderr)
        return 2
    if args.command == "make-clips":
        return make_clips(args)
    paths = pack_folder(args, IMAGE_EXTS, "image files", "images", load_rgb)
    if paths is None:
        return 2
    url = brace_url(paths)  # training data or a held-out set: the same shards, another flag
    print(f"--dataset_url '{url}' to train on them, or --test_dataset_url '{url}' to evaluate on them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
