"""Generated photo-like images and their PNG and JPEG shards: the data the data, train, memory, finetune, latents,
copies and gpu sections read."""
from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

import sources
import shards


def photo_like(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A uint8 (H, W, 3) stand-in for a photo: a smooth sky gradient, a textured ground (mid and high
    frequencies), a few sharp-edged shapes, a slight blur and sensor noise. Pure noise would decode
    unrealistically slowly as PNG, flat colour unrealistically fast."""
    def smooth_field(grid_h, grid_w, amplitude):
        small = rng.normal(0.0, 1.0, (grid_h, grid_w, 3))
        small = ((small - small.min()) / (np.ptp(small) + 1e-9) * 255).astype(np.uint8)
        field = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
        return (np.asarray(field, dtype=np.float32) / 255.0 - 0.5) * amplitude

    sky = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None] * rng.uniform(-80, 80, 3).astype(np.float32)
    image = rng.uniform(60, 190, 3).astype(np.float32) + sky + smooth_field(4, 5, 120)
    horizon = int(height * rng.uniform(0.4, 0.7))
    texture = smooth_field(max(2, height // 12), max(2, width // 12), 60) + smooth_field(height // 3, width // 3, 25)
    image[horizon:] += texture[horizon:]
    img = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 9))):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        w, h = rng.uniform(30, width / 3), rng.uniform(30, height / 3)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + w, y0 + h], fill=color)
        else:
            draw.polygon([(x0 + rng.uniform(-w, w), y0 + rng.uniform(-h, h)) for _ in range(5)], fill=color)
    img = img.filter(ImageFilter.GaussianBlur(1.2))
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0.0, 2.0, (height, width, 3)).astype(np.float32)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def make_datasets(root: str, n: int, height: int, width: int, seed: int) -> dict[str, dict]:
    """PNG and JPEG (quality 90) shards of the same n generated images, written with data.write_shards."""
    rng = np.random.default_rng(seed)
    arrays = [photo_like(rng, height, width) for _ in range(n)]
    datasets = {}
    for fmt, ext, save_kwargs in (("png", "png", {}), ("jpeg", "jpg", {"quality": 90})):
        src = os.path.join(root, f"{fmt}_images")
        os.makedirs(src)
        files = []
        for i, array in enumerate(arrays):
            files.append(os.path.join(src, f"img_{i:05d}.{ext}"))
            Image.fromarray(array).save(files[-1], **save_kwargs)
        paths, _ = shards.write_shards(files, os.path.join(root, f"{fmt}_shards"), shard_size=max(1, n // 4),
                                         verify=False, root=src)
        datasets[fmt] = {"url": sources.brace_url(paths), "paths": paths,
                         "mean_file_kib": round(sum(os.path.getsize(f) for f in files) / n / 1024, 1)}
    return datasets
