"""How well the training stream mixes its shards, and what its data workers cost: `python bench/mixing.py [--code DIR]
[--cpu]` (DIR: a checkout whose data.py to measure, e.g. a worktree of an earlier commit; default this one).

Mixing (the default). Shards of solid-colour images whose
colour names (shard, index) go through data.TrainLoader as a job of --world ranks x --accum micro-batches of
--batch images would read them (every rank's loader in this process, no data workers), and three numbers come out:

    same_shard_in_step   the fraction of image pairs of one optimizer step (all its micro-batches) that come from
                         the same shard: 1 / shards for a perfect shuffle; a stream that reads one shard at a time
                         per worker gives far more (the images of a shard are often alike: one source, one day)
    same_shard_in_micro  the same within one micro-batch (what a batch statistic or the critic sees together)
    steps_apart          for consecutive images of one shard (index k and k + 1), how many steps apart they land:
                         the mean of |step(k + 1) - step(k)| (0: always together)

--cpu: the CPU time of every process (the rank and its --workers data workers) per image, from generated
photo-like JPEGs (bench/images.py, 768x1024) cropped to 256 px in micro-batches of --batch, --rounds times, each
a fresh loader reading --micro_batches micro-batches (a loader's start and its prefetch included), each made the
model's input as the trainer makes it (data.to_model_input: the rank reads every pixel once). The rate a CPU-bound
input pipeline delivers is the inverse.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile


def solid_shards(folder: str, shards: int, per_shard: int) -> str:
    """`shards` tar shards of `per_shard` 24 px PNGs; image (s, i) has red = s % 256, green = i % 256 and blue =
    (i // 256) * 16 + s // 256 (up to 4,096 shards of 4,096 images)."""
    import io
    import tarfile

    from PIL import Image
    for s in range(shards):
        with tarfile.open(os.path.join(folder, f"{s:05d}.tar"), "w") as tar:
            for i in range(per_shard):
                buf = io.BytesIO()
                Image.new("RGB", (24, 24), (s % 256, i % 256, (i // 256) * 16 + s // 256)).save(buf, format="PNG")
                info = tarfile.TarInfo(f"s{s}_{i}.png")
                info.size = buf.tell()
                buf.seek(0)
                tar.addfile(info, buf)
    return os.path.join(folder, f"{{00000..{shards - 1:05d}}}.tar")


def image_key(image) -> tuple[int, int]:
    """(shard, index) of a crop of one of solid_shards' images."""
    r, g, b = (int(image[c, 0, 0]) for c in range(3))
    return r + 256 * (b % 16), g + 256 * (b // 16)


def measure(url: str, world: int, accum: int, batch: int, steps: int, shuffle_buffer: int, seed: int = 0) -> dict:
    import data
    loaders = [data.TrainLoader(url, 16, batch, seed, r, world, num_workers=0, shuffle_buffer=shuffle_buffer,
                                resize_prob=0.0, grad_accum=accum) for r in range(world)]
    try:
        where: dict[tuple[int, int], list[int]] = {}  # (shard, index) -> the steps it was trained in
        in_step = in_micro = pairs_step = pairs_micro = 0
        for step in range(steps):
            micro_batches = [[image_key(p) for p in next(loaders[r])]
                             for r in range(world) for _ in range(accum)]
            everything = [key for mb in micro_batches for key in mb]
            for key in everything:
                where.setdefault(key, []).append(step)
            for a, b in itertools.combinations(everything, 2):
                in_step, pairs_step = in_step + (a[0] == b[0]), pairs_step + 1
            for mb in micro_batches:
                for a, b in itertools.combinations(mb, 2):
                    in_micro, pairs_micro = in_micro + (a[0] == b[0]), pairs_micro + 1
    finally:
        for loader in loaders:
            loader.close()
    gaps = [abs(where[(s, i + 1)][0] - where[(s, i)][0]) for (s, i) in where if (s, i + 1) in where]
    return {"same_shard_in_step": in_step / pairs_step, "same_shard_in_micro": in_micro / pairs_micro,
            "steps_apart": sum(gaps) / len(gaps), "images": steps * world * accum * batch}


def cpu_per_image(url: str, batch: int, workers: int, micro_batches: int, rounds: int) -> list[float]:
    """CPU ms per image of this process and its children (the data workers, reaped by close())."""
    import resource

    import torch

    import data

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    torch.set_num_threads(1)
    cpu_device, out = torch.device("cpu"), []
    for r in range(rounds):
        start = cpu()
        loader = data.TrainLoader(url, 256, batch, r, 0, 1, num_workers=workers, shuffle_buffer=64, resize_prob=0.5)
        images = sum(data.to_model_input(next(loader), cpu_device).shape[0] for _ in range(micro_batches))
        loader.close()
        out.append((cpu() - start) / images * 1000)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--per_shard", type=int, default=200)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shuffle_buffer", type=int, default=1000)
    p.add_argument("--cpu", action="store_true", help="measure the CPU time per image instead")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--micro_batches", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sys.path[:0] = [os.path.abspath(args.code), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    with tempfile.TemporaryDirectory() as folder:
        if args.cpu:
            from bench.images import make_datasets
            url = make_datasets(folder, 32, 768, 1024, seed=0)["jpeg"]["url"]
            ms = cpu_per_image(url, args.batch, args.workers, args.micro_batches, args.rounds)
            print(json.dumps({"code": args.code, "cpu_ms_per_image": [round(m, 3) for m in ms]}))
            return
        url = solid_shards(folder, args.shards, args.per_shard)
        result = measure(url, args.world, args.accum, args.batch, args.steps, args.shuffle_buffer)
    print(json.dumps({**vars(args), **result, "perfect": 1 / args.shards}))


if __name__ == "__main__":
    main()
