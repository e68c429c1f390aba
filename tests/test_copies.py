"""The copy, cast and layout traffic of a training step (issue 30): what a GPU step spends moving and casting
activations instead of computing. Counted at the dispatcher on the CPU (bench.copies.CopyCensus), with the copies
CUDA's GroupNorm and cuDNN make inside themselves added by their documented layout rules: a count of ops and bytes,
never a time. The budget is in units of the batch's images: what the losses must cast (the image, the reconstruction)
is a few of them; one copy of one VAE activation at full resolution is more than ten (32 channels over 3)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ae
import common
import config
import data
import vae_trainer
from ae import AutoEncoder, GroupNorm32
from bench.copies import CopyCensus, parameter_shapes, step_census
from conftest import TINY
import run_setup
from ae import AutoEncoderParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the FLUX layout (4 levels, f8) at a width a CPU steps through quickly; LPIPS and the frozen VGG16 critic, as the
# profile of issue 30
STEP = ["--vae_ch", "32", "--vae_ch_mult", "1,2,4,4", "--vae_z_channels", "16", "--do_ganloss", "--disc_start", "0",
        "--critic_trunk", "frozen", "--memory_check", "false", "--num_workers", "0", "--evaluate_every_n_steps", "0",
        "--max_steps", "100"]
IMAGE_BUDGET = 24  # activation bytes copied or cast per step, in fp32 copies of the micro-batch's images


@pytest.fixture(scope="module")
def batches(shard_url):
    loader = data.TrainLoader(shard_url, 64, 2, seed=0, rank=0, world_size=1, num_workers=0, shuffle_buffer=8)
    out = [next(loader) for _ in range(2)]
    loader.close()
    return out


def census_of_a_step(shard_url, tmp_path, batches, *flags) -> tuple[dict, int]:
    """(the census summary of the second step, the bytes of the micro-batch's images in fp32)."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY, *STEP, *flags])
    cfg.validate()
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    trainer.loader.close()
    trainer.loader = data.FixedBatches(batches)
    trainer.train_step()  # the first step makes the optimizer's state
    trainer.step += 1
    summary = step_census(trainer).summary()
    trainer.close()
    image_bytes = batches[0].numel() * 4
    return summary, image_bytes


def activation_mib(summary: dict, *kinds) -> float:
    return sum(v["mib"] for k, v in summary.items() if k.endswith("/activation") and k.split("/")[0] in kinds)


@pytest.mark.process
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_step_moves_no_activation_it_does_not_compute(shard_url, tmp_path, batches, precision):
    """With the memory format --channels_last auto gives the VAE on a GPU, a step's copies and casts of activations,
    those CUDA's kernels would add included, stay within a few images' worth: no GroupNorm input is cast to fp32
    and back (the old GroupNorm32 cast every one: 250 MiB per step at 64 px for the FLUX width), and no layout is
    changed at a norm or a convolution. What remains are the image-sized casts of the losses (fp32 reductions).
    Parameter-sized casts (autocast's bf16 copy of each weight) are fixed per step and not in the budget; this CPU
    step has 4 fewer per GroupNorm than a CUDA step, whose kernel needs gamma and beta in bf16 (forward) and their
    gradients cast back (backward): test_group_norm_casts_only_its_weights_and_only_where_the_kernel_needs_it."""
    assert config.SpeedConfig().on("cuda").memory_format == torch.contiguous_format
    summary, image_bytes = census_of_a_step(shard_url, tmp_path, batches, "--precision", precision,
                                            "--channels_last", "false")
    assert "cuda_copy/activation" not in summary, summary
    moved = activation_mib(summary, "cast", "copy")
    assert moved <= IMAGE_BUDGET * image_bytes / 2 ** 20, summary


def test_channels_last_on_cuda_would_copy_at_every_norm(shard_url, tmp_path, batches):
    """Why --channels_last auto keeps the VAE NCHW with CUDA: channels_last there makes GroupNorm copy its input to
    NCHW, and the convolution copy the result back, at every norm, forward and backward (the census' CUDA rules;
    issue 30's profile: aten::contiguous 106 ms of 3 steps' 444). The bf16 casts are gone either way."""
    summary, image_bytes = census_of_a_step(shard_url, tmp_path, batches, "--precision", "bf16",
                                            "--channels_last", "true")
    assert activation_mib(summary, "cast", "copy") <= IMAGE_BUDGET * image_bytes / 2 ** 20, summary
    cfg = run_setup.parse_config(["--dataset_url", shard_url, *TINY, *STEP])
    norms = sum(isinstance(m, GroupNorm32) for m in AutoEncoder(AutoEncoderParams.from_config(cfg.model)).modules())
    copies = summary["cuda_copy/activation"]
    assert copies["ops"] >= 2 * norms  # the input of each norm in forward, and its gradient's way back
    assert copies["mib"] > 10 * IMAGE_BUDGET * image_bytes / 2 ** 20


def test_census_sees_casts_and_cuda_layout_copies():
    """The census itself: a cast of an activation, a parameter's cast, and the copies CUDA's GroupNorm (an NCHW copy
    of a channels_last input) and cuDNN (the input brought to the weight's channels_last format) make."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).to(memory_format=torch.channels_last)
    norm = torch.nn.GroupNorm(2, 8)
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    census = CopyCensus(parameter_shapes(conv, norm))
    with census:
        h = norm(x)  # CUDA: X.contiguous(), and an NCHW output (given to h here)
        assert h.is_contiguous()
        conv(h)  # cuDNN: h to channels_last, for the channels_last weight
        x.to(torch.bfloat16)
        conv.weight.to(torch.bfloat16)
    summary = census.summary()
    assert summary["cuda_copy/activation"]["ops"] == 2
    assert summary["cast/activation"] == {"ops": 1, "mib": x.numel() * 2 / 2 ** 20}
    assert summary["cast/parameter"]["ops"] == 1
    plain = CopyCensus(cuda_layouts=False)
    with plain:
        assert norm(x).is_contiguous(memory_format=torch.channels_last)  # the CPU kernel keeps the format
    assert "cuda_copy/activation" not in plain.summary()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_group_norm_has_fp32_statistics(dtype):
    """GroupNorm32 on a bf16/fp16 activation (under autocast) reads it as it is, and its error against an fp64
    GroupNorm of the same values is the output's rounding: the statistics are accumulated and applied in fp32 (a
    low-precision mean of activations whose mean is 20x their spread would be off by 20 x 2^-9 = 4% of it). Bound per
    element: half an ulp of the output plus fp32 arithmetic, and where the kernel needs gamma and beta in the input's
    dtype (CUDA: ae.GROUP_NORM_MIXED_DTYPES) half an ulp of gamma times the normalised value and half an ulp of beta;
    on the CPU they stay fp32. The old fp32 copy of the input met the same bound. The backward: tests/test_ae.py."""
    torch.manual_seed(0)
    norm = GroupNorm32(4, 32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
    for offset in (0.0, 20.0):
        x = (torch.randn(2, 32, 8, 8) + offset).to(dtype)
        with torch.autocast("cpu", dtype=dtype):
            out = norm(x)
        assert out.dtype == dtype
        ref64 = F.group_norm(x.double(), 4, norm.weight.double(), norm.bias.double(), 1e-6)
        normalised = F.group_norm(x.double(), 4, None, None, 1e-6)
        ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # half an ulp, relative
        weights_rounded = x.device.type not in ae.GROUP_NORM_MIXED_DTYPES
        bound = ulp * ref64.abs() + 1e-5 * (1 + normalised.abs())
        if weights_rounded:
            bound = bound + ulp * (normalised.abs() * norm.weight.double().abs().view(1, -1, 1, 1)
                                   + norm.bias.double().abs().view(1, -1, 1, 1))
        error = (out.double() - ref64).abs()
        assert (error <= bound).all(), (offset, (error - bound).max().item())


def test_group_norm_casts_only_its_weights_and_only_where_the_kernel_needs_it(monkeypatch):
    """The census of one GroupNorm32 forward and backward on a bf16 activation under autocast: on the CPU nothing is
    cast (the kernel takes fp32 gamma and beta, and returns fp32 dgamma and dbeta). Under CUDA's rule (its kernel
    reads gamma and beta in the input's dtype) gamma and beta are cast to bf16 in forward and their gradients back
    to fp32 in backward: 4 parameter-sized casts per norm per step, and still none of the activation."""
    norm = GroupNorm32(4, 32, eps=1e-6)
    x = torch.randn(2, 32, 8, 8).bfloat16().requires_grad_(True)
    counts = {}
    for rule, mixed in (("cpu", ae.GROUP_NORM_MIXED_DTYPES), ("cuda", ())):
        monkeypatch.setattr(ae, "GROUP_NORM_MIXED_DTYPES", mixed)
        census = CopyCensus(parameter_shapes(norm), cuda_layouts=False)
        with census:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = norm(x)
            out.backward(torch.ones_like(out))
        counts[rule] = census.summary()
    assert "cast/parameter" not in counts["cpu"] and counts["cpu"]["activation_total"]["ops"] == 0, counts["cpu"]
    assert counts["cuda"]["cast/parameter"]["ops"] == 4, counts["cuda"]
    assert counts["cuda"]["activation_total"]["ops"] == 0, counts["cuda"]


def test_fp32_group_norm_is_plain_group_norm():
    """In fp32 GroupNorm32 is F.group_norm, bitwise (the released VAEs decode as in diffusers)."""
    torch.manual_seed(0)
    norm = GroupNorm32(4, 32, eps=1e-6)
    x = torch.randn(2, 32, 8, 8)
    assert torch.equal(norm(x), F.group_norm(x, 4, norm.weight, norm.bias, 1e-6))
