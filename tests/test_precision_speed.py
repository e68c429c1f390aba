"""Precision policy, gradient checkpointing, accumulation, host syncs and the speed switches, exercised on
the real Trainer in-process (CPU)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import config
import data
import objective
import vae_trainer
from conftest import TINY, record_ops
import common
import run_log
import run_setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_trainer(shard_url, tmp_path, *extra) -> vae_trainer.Trainer:
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                    "--num_workers", "0", "--evaluate_every_n_steps", "0", "--max_steps", "100",
                                    *extra])
    cfg.validate()
    return vae_trainer.Trainer(cfg, common.DistInfo())


@pytest.fixture
def fixed_batches(shard_url):
    """Real photo crops, the same for every trainer a test builds: the centres of the first 8 photos and their
    mirror images, in 4 batches (fixed content, whatever the training stream's order)."""
    crops = torch.cat([batch for _, batch in data.iter_eval_batches(shard_url, 64, 4, max_images=8)])
    both = torch.cat([crops, crops.flip(-1)])
    return list(both.split(4)) + list(both[::2].split(4))


def feed(trainer, batches):
    trainer.loader.close()
    trainer.loader = data.FixedBatches(batches)


def run_steps(trainer, n) -> list[dict]:
    out = []
    for _ in range(n):
        trainer.train_step()
        trainer.step += 1
        out.append(trainer.metrics.reduce(trainer.info))
    return out


@pytest.mark.process
def test_bf16_tracks_fp32(shard_url, tmp_path, fixed_batches):
    """Same weights, data and noise: bf16 autocast losses stay finite over three steps and within 5% of fp32 over
    the first two, GAN included (the islands - GroupNorm, posterior, KL, low-pass filter, loss reductions - are
    fp32). Measured here: step 1 within 0.2%, step 2 within 1.3%; from step 3 the two trajectories part (up to 5%
    at step 3, 15% at step 5 on these crops, which order and content move; a 1-level change of one input pixel
    moves fp32 by 0.05%), so the third step is only checked finite."""
    results = {}
    for prec in ("fp32", "bf16"):
        trainer = make_trainer(shard_url, tmp_path / prec, "--precision", prec, "--do_ganloss", "--disc_start", "0")
        feed(trainer, fixed_batches[:3])
        torch.manual_seed(0)
        results[prec] = run_steps(trainer, 3)
        assert not trainer.training.scaler.is_enabled()
        trainer.close()
    for step, (ref, low) in enumerate(zip(results["fp32"], results["bf16"])):
        for key in ("loss/perceptual", "loss/pooled_mse", "loss/lowpass_mse", "loss/kl", "loss/disc"):
            assert torch.isfinite(torch.tensor(low[key])), key
            if step < 2:
                assert low[key] == pytest.approx(ref[key], rel=0.05, abs=1e-3), (step, key, ref[key], low[key])
        assert low["guard/skipped_vae"] == 0.0


@pytest.mark.process
def test_fp16_uses_loss_scaling_and_tracks_fp32(shard_url, tmp_path, fixed_batches):
    """fp16: one GradScaler per optimizer; GradNorm's branches receive the loss scale as a weight (its
    normalisation would otherwise erase it). The first steps overflow at the default scale of 2^16 and are
    skipped while the scaler backs off (standard dynamic loss scaling); losses track fp32; the scaled,
    unscaled and guarded steps make no host syncs. fp16 convolutions are slow on CPUs, their backward 100x fp32's: a
    small model, one image."""
    small = ["--vae_ch", "16", "--vae_ch_mult", "1,2", "--vae_resolution", "32", "--batch_size", "1", "--do_ganloss",
             "--disc_start", "0"]
    batches = [b[:1, :, :32, :32] for b in fixed_batches[:2]]
    results, scalers = {}, {}
    for prec in ("fp32", "fp16"):
        trainer = make_trainer(shard_url, tmp_path / prec, "--precision", prec, *small)
        feed(trainer, batches)
        torch.manual_seed(0)
        results[prec] = run_steps(trainer, 1)
        if prec == "fp16":
            with count_host_syncs() as counts:
                trainer.train_step()
            assert counts == {name: 0 for name in HOST_SYNCS}, counts
            results[prec].append(trainer.metrics.reduce(trainer.info))
        scalers[prec] = (trainer.training.scaler, trainer.adversary.scaler)
        trainer.close()
    assert all(s.is_enabled() for s in scalers["fp16"]) and not any(s.is_enabled() for s in scalers["fp32"])
    ref, low = results["fp32"][0], results["fp16"][0]  # the first forward: same weights
    for key in ("loss/perceptual", "loss/pooled_mse", "loss/lowpass_mse", "loss/kl", "loss/disc"):
        assert low[key] == pytest.approx(ref[key], rel=0.05, abs=1e-3), (key, ref[key], low[key])
    skipped = results["fp16"][0]["guard/skipped_vae"] + results["fp16"][1]["guard/skipped_vae"]
    assert skipped > 0 and scalers["fp16"][0].get_scale() == 65536.0 / 2 ** round(skipped)  # each overflow halved it
    assert all(torch.isfinite(torch.tensor(r["loss/total"])) for r in results["fp16"])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def test_fp16_backward_through_lpips_and_the_critic_runs_at_the_loss_scale(shard_url, tmp_path, fixed_batches,
                                                                           monkeypatch):
    """fp16: the gradient that LPIPS' and the critic's fp16 backward passes deliver to the reconstruction
    (before GradNorm rescales it) matches fp32's. Backpropagated unscaled, 0.13% (LPIPS) and 0.7% (critic)
    of its elements were exactly zero here (fp16 underflow; more at higher resolution and batch size,
    where these gradients are smaller): the whole loss sum is now scaled by the loss scale."""
    trainer = make_trainer(shard_url, tmp_path, "--precision", "fp16", "--vae_ch_mult", "1,2", "--vae_resolution",
                           "32", "--do_ganloss", "--gen_loss", "ldm")
    torch.manual_seed(1)
    # zero-initialised final convs pass no gradient to the input: a trained critic
    for head in trainer.adversary.critic.heads:
        torch.nn.init.normal_(head[-1].weight, std=0.02)
    trainer.adversary.critic.requires_grad_(False)  # as train_step has it during the generator's pass
    # a loss scale at which this backward does not overflow (what dynamic loss scaling settles on)
    trainer.training.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = data.to_model_input(fixed_batches[0][:1, :, :32, :32], trainer.device, True)
    recon0 = (x + 0.1 * torch.randn_like(x)).clamp(-1, 1)
    real_logits, fake_logits = trainer.adversary.critic(x).float(), trainer.adversary.critic(recon0).float()

    upstream = {}  # precision -> the gradients arriving at each GradNorm: perceptual, pixel, GAN
    real_gradnorm = objective.gradnorm

    def spy(t, weight):
        out = real_gradnorm(t, weight)
        grads = upstream.setdefault(trainer.objective.precision.amp_dtype, {})
        branch = ("perceptual", "pixel", "gan")[len(grads)]  # the order the objective builds them in
        grads[branch] = None
        out.register_hook(lambda g: grads.update({branch: g}))  # the gradient arriving at this GradNorm
        return out
    monkeypatch.setattr(objective, "gradnorm", spy)
    for name in ("fp16", "fp32"):  # fp32: no autocast, the reference (same networks, same inputs)
        trainer.objective.precision = config.Precision.of(name)
        recon = recon0.clone().requires_grad_(True)
        batch = objective.MicroBatch(x, recon, torch.zeros(1, 1, 1, 1), None, trainer.cfg.loss.disc_start,
                                     real_logits, fake_logits, loss_scale=trainer.training.scaler.scale(torch.ones(())))
        loss, _ = trainer.objective(batch)
        loss.backward()
    trainer.close()
    for name in ("perceptual", "pixel", "gan"):
        g16, g32 = upstream[torch.float16][name], upstream[None][name]
        assert (g32 == 0).float().mean().item() == 0.0, name
        zeros = (g16 == 0).float().mean().item()
        assert torch.isfinite(g16).all() and zeros < 5e-4, (name, zeros)
        assert _cosine(g16, g32) > 0.995, (name, _cosine(g16, g32))


def test_fp16_vae_gradient_matches_fp32(shard_url, tmp_path, fixed_batches, monkeypatch):
    """The VAE's gradient after unscaling, fp16 vs fp32, same weights, batch and latent: the same direction
    and norm. A loss scale applied twice or not at all (GradNorm's weights, the scaled backward) shows here
    as a norm off by 2^10; fp16 rounding alone leaves the cosine near 1."""
    from ae import AutoEncoder
    monkeypatch.setattr(AutoEncoder, "sample", lambda self, mean, logvar: mean.float())  # same z in both
    grads = {}
    for prec in ("fp32", "fp16"):
        trainer = make_trainer(shard_url, tmp_path / prec, "--precision", prec, "--vae_ch_mult", "1,2",
                               "--vae_resolution", "32", "--grad_clip", "0")
        # a scale that does not overflow at the first step (the default 2^16 does, and the step is skipped)
        trainer.training.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=prec == "fp16")
        feed(trainer, [fixed_batches[0][:2, :, :32, :32]])
        real_step = trainer.guarded_step

        def capture(optimizer, scaler, bad, trainer=trainer, real_step=real_step):
            if optimizer is trainer.training.optimizer:
                assert bad.item() == 0.0
                grads[prec] = torch.cat([p.grad.flatten() for p in trainer.vae.parameters()])
            real_step(optimizer, scaler, bad)
        monkeypatch.setattr(trainer, "guarded_step", capture)
        trainer.train_step()
        trainer.close()
    ratio = (grads["fp16"].norm() / grads["fp32"].norm()).item()
    assert ratio == pytest.approx(1.0, rel=0.02), ratio
    assert _cosine(grads["fp16"], grads["fp32"]) > 0.995, _cosine(grads["fp16"], grads["fp32"])


def test_fp32_islands_under_autocast():
    """What the policy promises: under bf16 autocast the KL and the pixel losses compute in fp32: every op of
    theirs other than the casts reads fp32 tensors only (the recorder sees the ops after autocast's casts), and the
    results are fp32. GroupNorm reads the bf16 activation itself, one native_group_norm whose statistics are fp32
    inside the kernel (tests/test_copies.py bounds its error): no fp32 copy of the activation, and on the CPU no bf16
    copy of gamma and beta either (its kernel takes them fp32; tests/test_ae.py bounds the backward)."""
    from ae import GroupNorm32, kl_divergence
    from utils import LowpassMSE, pooled_mse
    x = torch.randn(2, 32, 8, 8)
    lowpass_mse = LowpassMSE()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.Conv2d(32, 32, 1)(x)
        assert h.dtype == torch.bfloat16
        img = torch.rand(2, 3, 32, 32, dtype=torch.bfloat16) * 2 - 1
        darker = img * 0.9
        norm = GroupNorm32(32, 32)
        with record_ops() as norm_ops:
            out = norm(h)
        with record_ops() as ops:
            values = (kl_divergence(h, None), kl_divergence(h, h), pooled_mse(img, darker, 4),
                      lowpass_mse(img, darker))
    assert not ops.low_precision(), ops.low_precision()
    assert {"avg_pool2d", "convolution"} <= {name for name, _ in ops.calls}
    assert [name for name, _ in norm_ops.calls if name != "detach"] == ["native_group_norm"]
    assert [dtypes for name, dtypes in norm_ops.calls if name == "native_group_norm"] == [
        [torch.bfloat16, torch.float32, torch.float32]]  # the activation as it is, gamma and beta fp32: nothing cast
    ref = torch.nn.functional.group_norm(h.float(), 32, eps=1e-5)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 0.02
    assert all(value.dtype == torch.float32 for value in values)


@pytest.mark.process
def test_grad_checkpointing_gives_the_same_training(shard_url, tmp_path, fixed_batches):
    """decoder_hr / all recompute activations in backward: the trained weights are the same as without."""
    weights = {}
    for mode in ("none", "decoder_hr", "all"):
        trainer = make_trainer(shard_url, tmp_path / mode, "--grad_checkpointing", mode)
        assert trainer.vae.decoder.checkpoint_levels == {"none": set(), "decoder_hr": {0, 1},
                                                         "all": {0, 1, 2}}[mode]
        feed(trainer, fixed_batches[:3])
        torch.manual_seed(0)
        run_steps(trainer, 3)
        weights[mode] = {k: v.clone() for k, v in trainer.vae.state_dict().items()}
        trainer.close()
    for mode in ("decoder_hr", "all"):
        for k, v in weights["none"].items():
            torch.testing.assert_close(weights[mode][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.process
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # the optimizer step is captured
def test_grad_accum_averages_the_per_micro_batch_gradients(shard_url, tmp_path, fixed_batches, monkeypatch):
    """docs/precision.md's claim: with --grad_accum N, GradNorm normalises each micro-batch's branch gradient to
    weight / N, so the accumulated gradient is the mean of the N single-micro-batch gradients (not the
    gradient of one big batch, whose branch norm would be set once)."""
    from ae import AutoEncoder
    monkeypatch.setattr(AutoEncoder, "sample", lambda self, mean, logvar: mean.float())  # same z everywhere

    def grads_of(accum, batches):
        trainer = make_trainer(shard_url, tmp_path / f"acc{accum}", "--grad_accum", str(accum), "--grad_clip", "0")
        feed(trainer, batches)
        captured = {}

        def capture(optimizer, scaler, bad):
            if optimizer is trainer.training.optimizer:
                captured.update({n: p.grad.clone() for n, p in trainer.vae.named_parameters()})
            optimizer.zero_grad(set_to_none=True)
        monkeypatch.setattr(trainer, "guarded_step", capture)
        trainer.train_step()
        trainer.close()
        return captured

    both = grads_of(2, fixed_batches[:2])
    first, second = grads_of(1, fixed_batches[:1]), grads_of(1, fixed_batches[1:2])
    for name, g in both.items():
        torch.testing.assert_close(g, (first[name] + second[name]) / 2, rtol=1e-4, atol=1e-7)
    # and it is not the gradient of the concatenated batch
    big = grads_of(1, [torch.cat(fixed_batches[:2])])
    assert any(not torch.allclose(g, big[n], rtol=1e-2, atol=1e-6) for n, g in both.items())


HOST_SYNCS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def count_host_syncs():
    """Count every tensor->host read (the calls that block on a GPU) while the block runs."""
    counts = {name: 0 for name in HOST_SYNCS}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_SYNCS}

    def wrap(name):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return counted
    for name in HOST_SYNCS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _state_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes and containers: a trainer's weights, buffers,
    gradients, optimizer, scaler, EMA, LeCam and metrics state."""
    import types
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, types.FunctionType, types.MethodType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


def host_tensors_read(step, known: list[torch.Tensor]) -> list[str]:
    """Runs `step()` and lists what it reads from the host: tensors made from Python data (torch.tensor),
    and tensors that neither an op of this step nor `known` (the trainer's state, the batch) made, such as
    a module-level constant. On a GPU each of these is a host->device copy, a blocking one unless pinned;
    on this CPU-only machine they are the same tensors, so the check is on where they come from. 0-dim
    tensors are left out: CUDA kernels take a CPU scalar as an argument, without a copy."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    made = {id(t): t for t in known}  # keeps them alive: ids stay unique

    class Check(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in ("lift_fresh", "lift_fresh_copy"):
                self.found.append(f"{name}: a tensor made from Python data (torch.tensor)")
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.dim() > 0 and id(t) not in made:
                    self.found.append(f"{name} reads a {tuple(t.shape)} {t.dtype} tensor from outside the step")
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    made[id(t)] = t
            return out
    with Check() as check:
        step()
    return check.found


# (the adaptive balance with the PatchGAN critic: what it adds to a step is the generator's side; the VGG16 critic's
# steps are the second case's)
@pytest.mark.parametrize("extra", [[], ["--do_ganloss", "--disc_start", "0", "--lecam_weight", "0.1",
                                        "--grad_accum", "2"],
                                   ["--do_ganloss", "--disc_start", "0", "--loss_balance", "adaptive",
                                    "--discriminator", "patchgan"]])
@pytest.mark.process
def test_training_step_has_no_host_syncs(shard_url, tmp_path, fixed_batches, extra):
    """Losses, GradNorm norms, the non-finite guard, EMA and the schedule stay on the device: a training
    step reads nothing back to the host. Only logging steps do (one reduce, one copy). Nor does it copy
    anything but the batch to the device: it reads only tensors it computes and the trainer's state
    (weights, buffers such as the low-pass filters, optimizer/scaler/EMA/LeCam state)."""
    trainer = make_trainer(shard_url, tmp_path, *extra)
    feed(trainer, fixed_batches)
    trainer.train_step()  # warm-up (lazy initialisations)
    stop = common.StopFlag()
    with count_host_syncs() as counts:
        for _ in range(2):
            trainer.train_step()
            trainer.step += 1
            stop.agreed(trainer.info)
    assert counts == {name: 0 for name in HOST_SYNCS}, counts
    with count_host_syncs() as counts:
        trainer.metrics.reduce(trainer.info)
    assert counts["cpu"] == 1 and counts["item"] == 0
    batch = fixed_batches[3]
    feed(trainer, [batch, batch])  # --grad_accum 2 takes two
    found = host_tensors_read(trainer.train_step, _state_tensors(trainer) + [batch])
    assert not found, found
    trainer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [["--do_ganloss", "--disc_start", "0", "--lecam_weight", "0.1", "--grad_accum", "2"],
                                   ["--do_ganloss", "--disc_start", "0", "--loss_balance", "adaptive"],
                                   ["--do_ganloss", "--disc_start", "0", "--precision", "bf16"],
                                   ["--do_ganloss", "--disc_start", "0", "--precision", "fp16"]])
def test_cuda_training_step_never_waits_for_the_gpu(shard_url, tmp_path, fixed_batches, extra):
    """On a GPU, CUDA's own sync detector: after warm-up steps (lazy state, cuDNN autotuning), a training
    step with pinned batches raises on any operation that synchronises the host with the device: reads,
    blocking copies (including host->device ones), ops with data-dependent output shapes."""
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                    "--num_workers", "0", "--evaluate_every_n_steps", "0", "--max_steps", "100",
                                    *extra])
    trainer = vae_trainer.Trainer(cfg, common.DistInfo(device=torch.device("cuda", 0)))
    feed(trainer, [b.pin_memory() for b in fixed_batches] * 2)
    for _ in range(2):
        trainer.train_step()
        trainer.step += 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            trainer.train_step()
            trainer.step += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    metrics = trainer.metrics.reduce(trainer.info)
    assert metrics["guard/skipped_vae"] == 0.0 or "fp16" in extra
    trainer.close()


def test_speed_switches_are_in_effect(shard_url, tmp_path):
    trainer = make_trainer(shard_url, tmp_path, "--do_ganloss")
    assert trainer.training.optimizer.defaults["fused"] and trainer.adversary.optimizer.defaults["fused"]
    conv = trainer.vae.decoder.conv_out.weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    x = next(trainer.loader)
    import data
    assert data.to_model_input(x, trainer.device, True).is_contiguous(memory_format=torch.channels_last)
    trainer.close()
    off = make_trainer(shard_url, tmp_path / "off", "--channels_last", "false")
    assert off.vae.decoder.conv_out.weight.is_contiguous()
    off.close()


@pytest.mark.process
def test_compile_keeps_checkpoint_keys_clean(shard_url, tmp_path, fixed_batches, monkeypatch):
    """--compile compiles the inner modules (never the DDP wrapper) in place: same parameter names, and a
    compiled step gives the eager step's losses. Dynamo traces our modules and AOT autograd their backward as in
    a real run; the backend is aot_eager, not inductor, whose C++ code generation on CPU is most of a minute per
    model here and is PyTorch's to test, not ours."""
    compile_in_place = torch.nn.Module.compile
    compiled_with = []

    def aot_eager(module, *args, **kwargs):
        compiled_with.append(type(module).__name__)
        return compile_in_place(module, *args, **{**kwargs, "backend": "aot_eager"})
    monkeypatch.setattr(torch.nn.Module, "compile", aot_eager)
    small = ["--vae_ch_mult", "1,2", "--vae_resolution", "32"]
    batches = [b[:, :, :32, :32] for b in fixed_batches[:2]]
    losses = {}
    for flag in ("false", "true"):
        trainer = make_trainer(shard_url, tmp_path / flag, *small, "--compile", flag)
        feed(trainer, batches)
        torch.manual_seed(0)
        losses[flag] = run_steps(trainer, 2)
        keys = list(trainer.state.state_dict()["training"]["vae"])
        assert not any("_orig_mod" in k for k in keys)
        trainer.close()
    assert compiled_with == ["Encoder", "Decoder"]
    for eager, compiled in zip(losses["false"], losses["true"]):
        assert compiled["loss/total"] == pytest.approx(eager["loss/total"], rel=1e-3)


def test_critic_gradient_is_that_of_its_own_loss(shard_url, tmp_path, fixed_batches, monkeypatch):
    """The critic is frozen before the generator's pass through it: at each of its optimizer steps its
    gradient equals the gradient of the critic loss alone (recomputed here on the same inputs), and the
    generator's backward computes no critic weight gradient at all (each critic parameter receives one
    gradient per step). Two steps: the critic must be unfrozen again for its second one. `ldm` generator
    loss: its gradient w.r.t. the critic's zero-initialised last convs is not zero at the first step."""
    from utils import discriminator_loss
    trainer = make_trainer(shard_url, tmp_path, "--vae_ch_mult", "1,2", "--vae_resolution", "32", "--do_ganloss",
                           "--disc_start", "0", "--gen_loss", "ldm")
    feed(trainer, [b[:2, :, :32, :32] for b in fixed_batches[:2]])
    params = list(trainer.adversary.critic.parameters())
    gradients_received = [0] * len(params)
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: gradients_received.__setitem__(i, gradients_received[i] + 1))
    critic_inputs = []
    real_backward = trainer.adversary.backward

    def record_inputs(x, recon, sync, accum, backward=True, clip_frames=0):
        critic_inputs.append(torch.cat([x, recon.detach()]).contiguous(memory_format=trainer.memory_format))
        return real_backward(x, recon, sync, accum, backward, clip_frames)
    monkeypatch.setattr(trainer.adversary, "backward", record_inputs)
    real_step = trainer.guarded_step
    checked = []

    def check_then_step(optimizer, scaler, bad):
        if optimizer is trainer.adversary.optimizer:
            assert all(p.grad is not None for p in params)
            received = list(gradients_received)
            real_logits, fake_logits = trainer.adversary.critic(critic_inputs[-1]).float().chunk(2)
            alone = torch.autograd.grad(discriminator_loss(real_logits, fake_logits, "hinge"), params)
            gradients_received[:] = received  # the hooks count the training step's gradients only
            for p, g in zip(params, alone):
                torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-8)
            checked.append(trainer.step)
        real_step(optimizer, scaler, bad)
    monkeypatch.setattr(trainer, "guarded_step", check_then_step)
    for _ in range(2):
        trainer.train_step()
        trainer.step += 1
    trainer.close()
    assert checked == [0, 1]
    assert gradients_received == [2] * len(params)  # one per step: none from the generator's pass


def test_metrics_average_each_key_over_the_steps_that_logged_it():
    metrics = run_log.Metrics()
    for step in range(4):
        metrics.add(**{"loss/total": torch.tensor(float(step))})
        if step >= 2:  # the generator's GAN term from --disc_start 2
            metrics.add(**{"loss/gan_g": torch.tensor(10.0 * step)})
        metrics.end_step()
    out = metrics.reduce(common.DistInfo())
    assert out["loss/total"] == 1.5 and out["loss/gan_g"] == 25.0
    metrics.add(**{"loss/total": torch.tensor(7.0)})  # a new window
    metrics.end_step()
    assert metrics.reduce(common.DistInfo()) == {"loss/total": 7.0}


def test_gan_log_window_around_disc_start(shard_url, tmp_path, fixed_batches, monkeypatch, capsys):
    """--disc_start 2: a log window of steps 0-1 (before the generator's GAN term) has no `loss/gan_g` and
    never warns that the critic has won; a window of steps 1-2 reports step 2's generator loss (not diluted
    by step 1) and warns when the critic's accuracy is above 0.95."""
    trainer = make_trainer(shard_url, tmp_path, "--vae_ch_mult", "1,2", "--vae_resolution", "32", "--do_ganloss",
                           "--disc_start", "2", "--gen_loss", "ldm")  # ldm: not 0 at the start, as thresholded is
    feed(trainer, [b[:2, :, :32, :32] for b in fixed_batches[:4]])
    gan_g = {}
    real_forward = trainer.objective.forward

    def record(*args, **kwargs):
        loss, logs = real_forward(*args, **kwargs)
        if "loss/gan_g" in logs:
            gan_g[trainer.step] = logs["loss/gan_g"].item()
        return loss, logs
    monkeypatch.setattr(trainer.objective, "forward", record)

    def log_window(first_step, last_step):
        trainer.step = first_step
        while trainer.step <= last_step:
            trainer.train_step()
            trainer.step += 1
        metrics = trainer.metrics.reduce(trainer.info)
        metrics["gan/disc_acc"] = 0.99  # a critic that has won
        trainer.log_window(0.0, last_step - first_step + 1, metrics)
        return metrics, capsys.readouterr().out

    metrics, out = log_window(0, 1)
    assert "loss/gan_g" not in metrics and "critic has won" not in out
    metrics, out = log_window(1, 2)
    assert list(gan_g) == [2] and gan_g[2] != 0.0
    assert metrics["loss/gan_g"] == pytest.approx(gan_g[2], rel=1e-6)
    assert "warning: step 3: discriminator accuracy 0.99: the critic has won" in out
    trainer.close()
