"""Pretrained weights a run needs and this machine may not have: torchvision's cache (downloaded once, local rank 0
first), a local file, or random (tests and the demo only, never silently), and the one-line error that says how to
supply them. VGG16 for LPIPS and the critics here; the FID Inception (evaluate.py) and DINOv2 (alignment.py) use
the same calls."""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torchvision
from torch import Tensor

# --------------------------------------------------------------------------------------------
# VGG16 weights: torchvision's cache, a local file, or (tests and demo only) random
# --------------------------------------------------------------------------------------------
class WeightsUnavailable(RuntimeError):
    """Pretrained weights could not be had; the message is one line for the user."""


def hub_cache_path(url: str) -> str:
    """Where torch.hub (and torchvision, torch-fidelity) keep a downloaded file."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))


def ensure_weights(spec: str, *, flag: str, url: str, what: str, download: bool = True,
                   hash_prefix: str | None = None, without: str = "") -> str | None:
    """Resolve a weights flag to a local file: `random` -> None (random init), a PATH -> itself,
    `torchvision` -> torch hub's download cache, downloading `url` once if `download` (the other local
    ranks pass download=False after local rank 0 is done). WeightsUnavailable says how to supply them, and
    `without`: how to run without them."""
    if spec == "random":
        return None
    if spec != "torchvision":
        if not os.path.isfile(spec):
            raise WeightsUnavailable(f"{flag} {spec}: no such file")
        return spec
    path = hub_cache_path(url)
    if os.path.isfile(path):
        return path
    how = (f"put {os.path.basename(path)} at {path}, or pass {flag} PATH" + (f", or {without}" if without else "")
           + f"; {flag} random is for tests only")
    if not download:
        raise WeightsUnavailable(f"{what} weights not found at {path}: {how}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.redirect_stdout(sys.stderr):  # torch.hub announces downloads on stdout
            torch.hub.download_url_to_file(url, path, hash_prefix=hash_prefix, progress=False)
    except Exception as e:  # offline clusters land here
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WeightsUnavailable(f"{what} weights unavailable ({reason}): {how}") from None
    return path


VGG16_URL = torchvision.models.VGG16_Weights.IMAGENET1K_V1.url


def vgg16_cache_path() -> str:
    return hub_cache_path(VGG16_URL)


def ensure_vgg16_weights(spec: str, download: bool = True) -> str | None:
    """`--vgg16_weights`: torchvision's pretrained VGG16 (its cache), a local state dict, or random."""
    return ensure_weights(spec, flag="--vgg16_weights", url=VGG16_URL, what="pretrained VGG16", download=download,
                          hash_prefix="397923af",  # torchvision names its files by their sha256 prefix
                          without="train without them: --perceptual_weight 0 (LPIPS off, a fine-tune's too) and, "
                                  "with --do_ganloss, --discriminator patchgan (a critic that needs no pretrained "
                                  "weights), as --demo does without them")


def fetch_weights(ensure, spec: str, local_rank: int = 0, group=None) -> str | None:
    """`ensure(spec, download=...)` on every rank, local rank 0 first: it downloads into the cache and
    the other ranks then only look there (barriers over `group`, when a process group is up)."""
    first, distributed = local_rank == 0, dist.is_available() and dist.is_initialized()
    if distributed and not first:
        dist.barrier(group=group)
    try:
        return ensure(spec, download=first)
    finally:
        if distributed and first:
            dist.barrier(group=group)


def load_vgg16_features(path: str | None) -> dict[str, Tensor] | None:
    """VGG16 `features` state dict (keys '0.weight', ..., '28.bias') from a torchvision VGG16 state
    dict, a features-only one, or a safetensors file. None means random init."""
    if path is None:
        return None
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsUnavailable(f"{path}: cannot be read as a VGG16 state dict ({type(e).__name__})") from None
    if isinstance(sd, dict) and "state_dict" in sd:
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise WeightsUnavailable(f"{path}: holds a {type(sd).__name__}, not a VGG16 state dict")
    feats = {k[len("features."):]: v for k, v in sd.items() if k.startswith("features.")}
    if not feats:
        feats = {k: v for k, v in sd.items() if k.split(".")[0].isdigit()}
    expected = {f"{i}.{p}" for i in (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28) for p in ("weight", "bias")}
    if set(feats) != expected:
        raise WeightsUnavailable(f"{path} is not a VGG16 state dict (missing {sorted(expected - set(feats))[:3]}...)")
    return feats


def warn_random_weights(network: str, what: str, consequence: str) -> None:
    """The loud banner of every network run on random weights (tests, the demo): never silent."""
    bar = "!" * 78
    print(f"{bar}\nWARNING: a RANDOMLY INITIALISED {network} is used for {what}.\n{consequence}\n{bar}",
          file=sys.stderr, flush=True)


def warn_random_vgg(what: str) -> None:
    warn_random_weights("VGG16 (--vgg16_weights random)", what,
                        "Perceptual and adversarial losses are meaningless; use this for tests and the demo only.")
