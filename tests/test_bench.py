"""bench.py's narrower-decoder sections (issue 25 item 3): what they count and how they read evaluate.py's output.
No timing is asserted (the GUIDE: speed is bench.py's, never a test's); these check the counting and the plumbing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ae import AutoEncoder, AutoEncoderParams
from bench import decoder_quality, decoders, gpu, precision

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

# a small model of FLUX.2's structure: quant convs, the learned posterior, bn, mid attention
SMALL = AutoEncoderParams(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=8, norm_groups=8,
                          posterior="learned", quant_conv=True, latent_bn=True)


def test_decode_flops_count_the_cpu_attention_kernel_and_match_a_real_decode():
    """On fake tensors the count is a real CPU decode's, plus the mid-block attention that torch's own table leaves
    out on a CPU (its _scaled_dot_product_flash_attention_for_cpu): 2 x 2 x tokens^2 x channels."""
    from torch.utils.flop_counter import FlopCounterMode
    latent = (1, SMALL.z_channels, 8, 8)
    counted = decoders.decode_flops(SMALL, latent)
    tokens, channels = 8 * 8, SMALL.decoder_widths[-1]
    assert counted["attention"] == 4 * tokens ** 2 * channels
    vae = AutoEncoder(SMALL).eval()
    z = torch.randn(latent)
    with FlopCounterMode(display=False) as plain, torch.no_grad():
        vae.decode(z)
    with decoders.flop_counter() as ours, torch.no_grad():
        vae.decode(z)
    assert ours.get_total_flops() == counted["total"] == plain.get_total_flops() + counted["attention"]


def test_a_narrower_decoder_costs_about_its_width_squared():
    narrow = dataclasses.replace(SMALL, decoder_channels=(24, 48, 48))
    latent = (1, SMALL.z_channels, 16, 16)
    ratio = decoders.decode_flops(narrow, latent)["total"] / decoders.decode_flops(SMALL, latent)["total"]
    assert 0.75 ** 2 < ratio < 0.75
    assert decoders.decoder_parameters(narrow) == sum(
        p.numel() for name, p in AutoEncoder(narrow).named_parameters() if name.startswith(("decoder.", "post_quant")))


def test_a_decode_case_reports_time_and_memory_of_the_decoder_alone():
    """run_decode_case (a fresh process's work, here in this one): the encoder dropped, the timed decodes and the
    memory (VmHWM on Linux) reported."""
    case = {"name": "small_fp32", "device": "cpu", "threads": 1, "params": SMALL.to_dict(), "resolution": 64,
            "batch": 1, "precision": "fp32", "reps": 2, "warmup": 0}
    result = decoders.run_decode_case(case)
    assert len(result["decode_s"]) == 2 and min(result["decode_s"]) > 0
    assert result["peak_mib"] >= result["before_mib"] > 0 and result["increase_mib"] >= 0
    decoder_only = decoders.decoder_parameters(SMALL) * 4 / 2 ** 20  # fp32 weights of what a decode runs
    assert result["weights_mib"] == pytest.approx(decoder_only)


def test_reconstruction_rows_read_evaluate_grids(tmp_path):
    """The rows of evaluate.py's reconstructions.png (make_grid: inputs, then reconstructions) come back as they
    were written, and the labelled grid stacks them enlarged."""
    import torchvision
    from PIL import Image

    from evaluate import to_uint8
    gen = torch.Generator().manual_seed(0)
    inputs, recons = (torch.rand(3, 3, 16, 16, generator=gen) * 2 - 1 for _ in range(2))
    grid = to_uint8(torchvision.utils.make_grid(torch.cat([inputs, recons]), nrow=3, padding=2, pad_value=-1.0))
    path = tmp_path / "reconstructions.png"
    Image.fromarray(grid.permute(1, 2, 0).numpy()).save(path)
    rows = decoder_quality.reconstruction_rows(str(path), tile=16)
    assert len(rows) == 2
    for row, images in zip(rows, (inputs, recons)):
        pixels = torch.from_numpy(np.array(row)).permute(2, 0, 1)
        for i in range(3):
            assert torch.equal(pixels[:, :, 2 + 18 * i: 2 + 18 * i + 16], to_uint8(images[i]))
    labelled = decoder_quality.labelled_grid([("input", rows[0]), ("recon", rows[1])], scale=2, label_width=40)
    assert labelled.size == (40 + rows[0].width * 2, 2 * 16 * 2 + 4)


def test_tf32_emulation_cuts_the_multiplicands_to_ten_bits():
    """bench.precision.TF32Emulation (the precision section's stand-in for a GPU's TF32): the fp32 operands of
    convolutions and matmuls, forward and backward, lose their 13 low mantissa bits; the products accumulate in fp32."""
    x = torch.randn(64, 64, dtype=torch.float64)
    cut = precision.to_tf32(x.float())
    assert (cut.view(torch.int32) & 0x1FFF == 0).all()
    rel = ((cut.double() - x) / x).abs()
    assert rel.max() < 2.0 ** -10 and rel.max() > 2.0 ** -12
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    with precision.TF32Emulation():
        emulated = a @ b
    assert torch.equal(emulated, precision.to_tf32(a) @ precision.to_tf32(b)) and not torch.equal(emulated, a @ b)
    conv = torch.nn.Conv2d(4, 4, 3)
    image = torch.randn(1, 4, 8, 8, requires_grad=True)
    with precision.TF32Emulation():
        conv(image).square().sum().backward()
    emulated_grad = image.grad.clone()
    image.grad = None
    conv(image).square().sum().backward()
    assert not torch.equal(emulated_grad, image.grad)
    assert torch.allclose(emulated_grad, image.grad, rtol=1e-2, atol=1e-3)


def test_gpu_cases_run_their_plumbing(shard_url, tmp_path, monkeypatch):
    """The gpu section's cases (issue 30's table) on a CPU at a tiny size: the reference's habits (GroupNorm left to
    autocast, loss networks in fp32, .item() calls) and ours build, step and report; the profiler's copy share is a
    fraction. (The figures themselves are a GPU's: BENCHMARKS.md section 10.)"""
    import ae
    monkeypatch.setattr(ae.GroupNorm32, "forward", ae.GroupNorm32.forward)  # the reference case replaces it
    tiny = (dict(vae_ch=16, vae_ch_mult="1,2", vae_num_res_blocks=1, do_attn=False, vgg16_weights="random"), 32, 2)
    results = {}
    for name in ("ours_bf16_frozen", "reference_eager"):
        results[name] = gpu.run_gpu_case({"case": name, "size": "tiny", "size_spec": tiny, "url": shard_url,
                                          "output_dir": str(tmp_path), "steps": 1, "warmup": 1, "gpu_batch": 8,
                                          "device": "cpu", "profile": name == "ours_bf16_frozen"})
    for result in results.values():
        assert result["batch_size"] == 2 and result["img_per_s"] > 0 and result["peak_gib"] > 0
    assert 0 <= results["ours_bf16_frozen"]["copy_fraction"] < 1
    assert ae.GroupNorm32.forward is torch.nn.GroupNorm.forward  # the reference's GroupNorm, in this process
