"""bench.py's narrower-decoder sections (issue 25 item 3): what they count and how they read evaluate.py's output.
No timing is asserted (the GUIDE: speed is bench.py's, never a test's); these check the counting and the plumbing."""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile

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


@pytest.mark.process
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


# ------------------------------------------------------------------------------------------------ the cuda section
def test_the_cuda_section_skips_every_row_with_its_reason_without_a_gpu(capsys):
    """`python bench.py --sections cuda --json` on a machine without CUDA (issue 48): one table with a row per check
    it would run (every family's 3 bf16 steps, every diffusers class that trains at its tiny config, the two memory
    estimates, the four GAN steps, the 2-rank fsdp run), each skipped with its reason, and the same rows as JSON;
    no other table (the Targets table is left out for this section alone), in a few seconds."""
    import json
    from bench import cli, cuda
    import diffusers_ae
    assert cli.main(["--sections", "cuda", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    rows = result["cuda"]["rows"]
    expected = cuda.planned_rows()
    assert [(r["part"], r["case"]) for r in rows] == expected
    trained = {case.split(":", 1)[1] for part, case in expected if case.startswith("diffusers:")}
    assert trained == set(diffusers_ae.CLASSES) & set(cuda.tiny_classes()) and len(trained) >= 16
    assert {part for part, _ in expected} == {"train", "memory", "gan_step", "fsdp"}
    assert {"ldm", "wan_17f", "wan_17f_chunks", "critic3d"} <= {case for _, case in expected}
    assert all(r["status"] == "skipped" and r["detail"] == cuda.NO_CUDA for r in rows)
    assert result["cuda_rows_skipped"] == len(rows) and result["cuda_rows_ok"] == result["cuda_rows_failed"] == 0
    assert err.count("\n  part ") == 1 and "Targets" not in err  # one table
    assert f"0 ok, 0 FAILED, {len(rows)} skipped" in err


def test_the_cuda_sections_rows_follow_the_budget_and_the_gpu_count(monkeypatch, tmp_path):
    """The parent's control flow with CUDA faked (each row's runner stubbed): the rows run in the order train,
    memory, gan_step, and every row no time is left for is skipped saying so; with one GPU the fsdp row says it
    needs two; each runner's result lands in its own row."""
    from bench import cuda
    from bench.report import Report
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a fake GPU")
    clock = [0.0]
    monkeypatch.setattr(cuda.time, "monotonic", lambda: clock[0])
    ran = []

    def train_rows(names, budget):
        ran.append("train")
        clock[0] += 100  # the families took 100 s
        return {n: {"status": "ok", "figure": 0.1, "detail": ""} for n in names}

    def memory_row(name, budget):
        ran.append(name)
        clock[0] += 200
        return {"status": "ok", "figure": 1.0, "detail": ""}
    monkeypatch.setattr(cuda, "_train_rows", train_rows)
    monkeypatch.setattr(cuda, "_memory_row", memory_row)
    monkeypatch.setattr(cuda, "_gan_row", lambda *a: ran.append("gan") or {"status": "ok", "detail": ""})

    class Args:
        cuda_budget_s, seed, gpu_steps, gpu_batch = 450.0, 0, 10, 8
    result = cuda.bench_cuda(Args(), str(tmp_path), Report(open(os.devnull, "w")))
    rows = {(r["part"], r["case"]): r for r in result["rows"]}
    # 100 s of families and 200 s of LTX-2's estimate leave 150 s: HunyuanVideo's runs (it needs 60), and after it
    # (500 s in) nothing is left for the GAN steps
    assert ran == ["train", "ltx2_17f_256", "hunyuanvideo15_17f_256"]
    assert all(rows[("train", c)]["status"] == "ok" for p, c in cuda.planned_rows() if p == "train")
    assert rows[("memory", "hunyuanvideo15_17f_256")]["status"] == "ok"
    for name in cuda.GAN_CASES:
        assert rows[("gan_step", name)] == {"part": "gan_step", "case": name, "status": "skipped",
                                            "detail": "the section's --cuda_budget_s 450 spent"}
    assert rows[("fsdp", "2 ranks, nccl")]["detail"] == "1 GPU: the run needs 2"
    assert result["counts"] == {"ok": len(rows) - 5, "FAILED": 0, "skipped": 5}


def test_a_train_row_fails_on_a_non_finite_step(monkeypatch):
    """The train rows' check itself, on a CPU (the sync detector is CUDA's: off here): a small ldm run's 3 steps are
    ok; with its loss made NaN from the second step, the guard skips those steps and the row FAILS saying so."""
    from bench import cuda
    import objective
    monkeypatch.setitem(cuda.FAMILY_CASES, "ldm", dict(cuda.FAMILY_CASES["ldm"], vae_ch=8, vae_resolution=32,
                                                       do_ganloss=False, perceptual_weight=0.0, precision="fp32"))
    with tempfile.TemporaryDirectory() as root:
        data = {"images": cuda._data(root)["images"], "clips": None}
        ok = cuda.train_case("ldm", root, data, torch.device("cpu"))
        assert ok["status"] == "ok" and math.isfinite(ok["loss"]), ok
        real = objective.VAEObjective.forward
        calls = []

        def nan_after_the_first(self, *args, **kwargs):
            loss, logs = real(self, *args, **kwargs)
            calls.append(1)
            return (loss * float("nan") if len(calls) > 1 else loss), logs
        monkeypatch.setattr(objective.VAEObjective, "forward", nan_after_the_first)
        bad = cuda.train_case("ldm", root, data, torch.device("cpu"))
    assert bad["status"] == "FAILED" and "steps skipped by the guard" in bad["detail"], bad


@pytest.mark.process
def test_the_cuda_sections_train_rows_come_back_from_their_child_process_one_line_each():
    """The train rows' protocol (a child process for them all, one JSON line per row as each ends, the parent
    reading them back): a row that fails is its row's, the next one still runs."""
    from bench import cuda
    results = cuda._train_rows(["no_such_case", "diffusers:NoSuchClass"], cuda.Budget(300))
    assert list(results) == ["no_such_case", "diffusers:NoSuchClass"]
    assert results["no_such_case"] == {"status": "FAILED", "detail": "KeyError: 'no_such_case'"}
    assert results["diffusers:NoSuchClass"]["status"] == "FAILED"
    assert cuda._train_rows(["no_such_case"], cuda.Budget(10)) == {
        "no_such_case": {"status": "skipped", "detail": "the section's --cuda_budget_s 10 spent"}}
