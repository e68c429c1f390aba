"""The data section: one data worker's img/s (in-process, one torch thread) on the generated shards: the raw PIL
decode of the tar members, data.TrainLoader, and the reference trainer's naive reader."""
from __future__ import annotations

import io
import itertools
import tarfile
import time

import torch
from PIL import Image

import data as data_lib
import sources
from bench.report import Report, median, percent


def tar_image_bytes(paths: list[str]):
    """The image members' bytes of tar shards, streamed as webdataset streams them."""
    for path in paths:
        with tarfile.open(path, mode="r|") as tar:
            for member in tar:
                if member.isfile() and member.name.rsplit(".", 1)[-1].lower() in sources.IMAGE_EXTS:
                    yield tar.extractfile(member).read()


def decode_rgb(blob: bytes) -> Image.Image:
    """The least work that yields RGB pixels: the decode ceiling of any pipeline."""
    img = Image.open(io.BytesIO(blob))
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def time_raw_decode(paths, n):
    t0 = time.perf_counter()
    count = sum(1 for blob in tar_image_bytes(paths) if decode_rgb(blob) is not None)
    assert count == n, (count, n)
    return time.perf_counter() - t0


def time_train_loader(url, n, batch_size, seed, resize_prob, shuffle_buffer):
    loader = data_lib.TrainLoader(url, 256, batch_size, seed, 0, 1, num_workers=0, shuffle_buffer=shuffle_buffer,
                                  resize_prob=resize_prob)
    try:
        t0 = time.perf_counter()
        for _ in range(n // batch_size):
            batch = next(loader)
        elapsed = time.perf_counter() - t0
    finally:
        loader.close()
    assert batch.dtype == torch.uint8 and tuple(batch.shape) == (batch_size, 3, 256, 256)
    return elapsed


def time_naive(paths, n, batch_size, seed):
    """The reference trainer's way: the whole decoded image becomes a normalised float tensor, then a crop."""
    from torchvision import transforms
    torch.manual_seed(seed)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3),
                                    transforms.RandomCrop(256)])
    t0 = time.perf_counter()
    batch = []
    for blob in itertools.islice(tar_image_bytes(paths), n):
        batch.append(transform(Image.open(io.BytesIO(blob)).convert("RGB")))
        if len(batch) == batch_size:
            torch.stack(batch)
            batch = []
    return time.perf_counter() - t0


def bench_data(args, datasets, report: Report) -> dict:
    n, bs = args.images, args.data_batch_size
    n_timed = n // bs * bs  # the loaders produce whole batches
    buffer = min(64, n // 2)
    methods = {}
    for fmt, ds in datasets.items():
        paths, url = ds["paths"], ds["url"]
        methods[(fmt, "decode")] = (n, lambda p=paths: time_raw_decode(p, n))
        methods[(fmt, "ours")] = (n_timed, lambda u=url: time_train_loader(u, n_timed, bs, args.seed, 0.0, buffer))
        if fmt == "jpeg":
            methods[(fmt, "ours_resize0.5")] = (n_timed, lambda u=url: time_train_loader(u, n_timed, bs, args.seed, 0.5, buffer))
        methods[(fmt, "naive")] = (n_timed, lambda p=paths: time_naive(p, n_timed, bs, args.seed))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a DataLoader worker runs with
    try:
        for fmt, ds in datasets.items():  # warm the page cache and PIL's code paths
            time_raw_decode(ds["paths"], n)
        rates = {key: [] for key in methods}
        keys = list(methods)
        for r in range(args.data_rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate the order each round
                count, run = methods[key]
                rates[key].append(count / run())
    finally:
        torch.set_num_threads(threads)

    out = {"images": n, "image_size": f"{args.height}x{args.width}", "batch_size": bs, "shuffle_buffer": buffer,
           "rounds": args.data_rounds, "torch_threads": 1, "formats": {}}
    rows = []
    for fmt, ds in datasets.items():
        decode = median(rates[(fmt, "decode")])
        entry = {"mean_file_kib": ds["mean_file_kib"]}
        for (f, method), values in rates.items():
            if f != fmt:
                continue
            entry[method] = {"img_per_s": median(values), "fraction_of_decode": median(values) / decode,
                             "runs_img_per_s": [round(v, 2) for v in values]}
            rows.append([f"{fmt} ({ds['mean_file_kib']:.0f} KiB/img)", method, median(values),
                         percent(median(values) / decode), f"{min(values):.1f}-{max(values):.1f}"])
        out["formats"][fmt] = entry
    report.table(f"Input pipeline, one worker: {n} images of {args.height}x{args.width} -> 256 crops, "
                 f"batch {bs}, medians of {args.data_rounds} interleaved rounds",
                 ["dataset", "reader", "img/s", "of decode", "range img/s"], rows)
    report.line("  decode: PIL open + load of the tar members' bytes; ours: data.TrainLoader (resize_prob 0 unless "
                "named); naive: ToTensor + Normalize on the whole image, then RandomCrop(256)")
    return out
