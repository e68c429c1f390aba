"""weights.py: VGG16 weights without internet (torchvision's cache, a local file, random for tests), their
formats, and the one-line errors that say how to supply them."""
from __future__ import annotations

import os
import urllib.error

import pytest
import torch
import torchvision

import weights
from weights import WeightsUnavailable, ensure_vgg16_weights, load_vgg16_features

VGG16_CONV_INDICES = (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28)


# --------------------------------------------------------------------------------------------
# VGG16 weights without internet
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vgg16_state() -> dict:
    torch.manual_seed(1234)
    return torchvision.models.vgg16(weights=None).state_dict()


def test_ensure_vgg16_weights_random_and_paths(tmp_path):
    assert ensure_vgg16_weights("random") is None
    assert load_vgg16_features(None) is None
    missing = tmp_path / "nope.pth"
    with pytest.raises(WeightsUnavailable) as info:
        ensure_vgg16_weights(str(missing))
    assert "\n" not in str(info.value) and str(missing) in str(info.value)
    existing = tmp_path / "vgg.pth"
    existing.write_bytes(b"x")
    assert ensure_vgg16_weights(str(existing)) == str(existing)


def test_ensure_vgg16_weights_torchvision_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    with pytest.raises(WeightsUnavailable) as info:
        ensure_vgg16_weights("torchvision", download=False)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(tmp_path / "torch_home") in msg and "--vgg16_weights" in msg
    assert "--perceptual_weight 0" in msg  # the offline path that works, as the demo takes it
    assert "--discriminator patchgan" in msg  # and the critic that needs no pretrained weights (issue 31 item 7)

    # downloading fails offline: one line, same advice
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(WeightsUnavailable) as info:
        ensure_vgg16_weights("torchvision", download=True)
    assert "\n" not in str(info.value) and "--vgg16_weights" in str(info.value)

    # once torchvision's cache holds the file it is used
    path = weights.vgg16_cache_path()
    assert path.startswith(str(tmp_path / "torch_home"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()
    assert ensure_vgg16_weights("torchvision", download=False) == path


def _assert_features_equal(feats: dict, state: dict, prefix: str = "features.") -> None:
    expected = {f"{i}.{p}" for i in VGG16_CONV_INDICES for p in ("weight", "bias")}
    assert set(feats) == expected
    for key, value in feats.items():
        assert torch.equal(value, state[prefix + key]), key


@pytest.mark.process
def test_load_vgg16_features_formats(tmp_path, vgg16_state):
    full = tmp_path / "vgg16-torchvision.pth"
    torch.save(vgg16_state, full)
    _assert_features_equal(load_vgg16_features(str(full)), vgg16_state)

    features_only = {k[len("features."):]: v for k, v in vgg16_state.items() if k.startswith("features.")}
    fpath = tmp_path / "features.pt"
    torch.save(features_only, fpath)
    _assert_features_equal(load_vgg16_features(str(fpath)), vgg16_state)

    wrapped = tmp_path / "wrapped.pt"
    torch.save({"state_dict": features_only}, wrapped)
    _assert_features_equal(load_vgg16_features(str(wrapped)), vgg16_state)

    from safetensors.torch import save_file
    spath = tmp_path / "features.safetensors"
    save_file({k: v.contiguous() for k, v in features_only.items()}, str(spath))
    _assert_features_equal(load_vgg16_features(str(spath)), vgg16_state)


def test_load_vgg16_features_rejects_other_dicts(tmp_path, vgg16_state):
    other = tmp_path / "resnet.pt"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7), "fc.bias": torch.zeros(10)}, other)
    with pytest.raises(WeightsUnavailable) as info:
        load_vgg16_features(str(other))
    assert "\n" not in str(info.value) and "VGG16" in str(info.value)
    # a VGG16 with a layer missing is not accepted either
    partial = {k: v for k, v in vgg16_state.items() if k.startswith("features.") and not k.startswith("features.28.")}
    ppath = tmp_path / "partial.pt"
    torch.save(partial, ppath)
    with pytest.raises(WeightsUnavailable):
        load_vgg16_features(str(ppath))


@pytest.mark.parametrize("kind", ["garbage.pth", "tensor.pth", "garbage.safetensors"])
def test_load_vgg16_features_unreadable_file_is_one_line_error(tmp_path, kind):
    path = tmp_path / kind
    if kind == "tensor.pth":
        torch.save(torch.zeros(3), path)
    else:
        path.write_bytes(b"this is not a checkpoint")
    with pytest.raises(WeightsUnavailable) as info:
        load_vgg16_features(str(path))
    assert "\n" not in str(info.value)
