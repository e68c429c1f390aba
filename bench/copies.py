"""The copies section (issue 30): the copy, cast and layout traffic of one step, counted at the dispatcher
(CopyCensus), and the CPU's bf16 step with today's GroupNorm and the fp32-copy one."""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import FLUX_CONFIG, TRAIN_CONFIGS, build_trainer, timed_step
from bench.machine import mib
from bench.report import Report, median


COPY_OPS = ("_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", "contiguous")


class CopyCensus(TorchDispatchMode):
    """The copies, casts and layout changes of the aten ops run inside it: their count and the bytes they write,
    each sorted as a "cast" (another dtype) or a "copy" (the same dtype: a clone, a layout change), of a parameter's
    shape (autocast's per-step bf16 copy of each weight, its gradient's cast back: a fixed cost, not per pixel) or of
    an activation (what grows with the batch and the resolution, and what a step on a GPU must not move).

    `cuda_layouts`: also the copies that CUDA's kernels make inside themselves, which the same step on a CPU does not
    show (PyTorch 2.x sources): native_group_norm and its backward work on NCHW-contiguous copies of their inputs off
    the CPU and return NCHW (aten/src/ATen/native/group_norm.cpp), and cuDNN convolves input, weight and gradient in
    one memory format, channels_last if the input or the weight is (cudnn_conv_suggest_memory_format), copying the
    others. The census counts those as copies, and gives group_norm's outputs CUDA's NCHW layout, so that the ops
    after it meet the layouts they meet on a GPU. Autocast's op lists differ between CPU and CUDA (CUDA's casts the
    inputs of pow, sum and a few others to fp32): those casts, in LPIPS' feature normalisation, are not counted."""

    def __init__(self, parameter_shapes=(), cuda_layouts: bool = True):
        super().__init__()
        self.parameter_shapes = {tuple(s) for s in parameter_shapes}
        self.cuda_layouts = cuda_layouts
        self.counts: Counter = Counter()  # (kind, what) -> ops; kind: cast / copy / cuda_copy; what: parameter / activation
        self.bytes: Counter = Counter()

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        what = "parameter" if tuple(tensor.shape) in self.parameter_shapes else "activation"
        self.counts[kind, what] += 1
        self.bytes[kind, what] += tensor.numel() * tensor.element_size()

    def _implied(self, tensors, memory_format) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous(memory_format=memory_format):
                self._record("cuda_copy", t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.cuda_layouts and name in ("native_group_norm", "native_group_norm_backward"):
            # forward: X; backward: dY, X (mean and rstd are (N, G))
            self._implied(args[:1] if name == "native_group_norm" else args[:2], torch.contiguous_format)
        elif self.cuda_layouts and name in ("convolution", "convolution_backward"):
            inputs = args[:2] if name == "convolution" else args[:3]  # (input, weight) / (grad, input, weight)
            image, weight = inputs[-2], inputs[-1]
            channels_last = any(t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                                and not t.is_contiguous() for t in (image, weight))
            self._implied(inputs, torch.channels_last if channels_last else torch.contiguous_format)
        out = func(*args, **kwargs)
        if name in COPY_OPS:
            source = next((a for a in args if isinstance(a, torch.Tensor)), None)
            written = args[0] if name == "copy_" else out
            if name == "copy_":
                source = args[1]
            if isinstance(written, torch.Tensor) and source is not None:
                self._record("cast" if written.dtype != source.dtype else "copy", written)
        if self.cuda_layouts and name in ("native_group_norm", "native_group_norm_backward"):
            out = tuple(o.contiguous() if isinstance(o, torch.Tensor) and o.dim() == 4 else o for o in out)
        return out

    def summary(self) -> dict:
        """{kind/what: {"ops": n, "mib": MiB}} and the totals of activation traffic."""
        rows = {f"{kind}/{what}": {"ops": self.counts[kind, what], "mib": mib(self.bytes[kind, what])}
                for kind, what in sorted(self.counts)}
        activation = [key for key in self.counts if key[1] == "activation"]
        rows["activation_total"] = {"ops": sum(self.counts[k] for k in activation),
                                    "mib": mib(sum(self.bytes[k] for k in activation))}
        return rows


def parameter_shapes(*modules) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for module in modules if module is not None for p in module.parameters()]


def step_census(trainer, cuda_layouts: bool = True) -> CopyCensus:
    """The copy census of one Trainer.train_step() (after one step outside it: the optimizer's state exists)."""
    census = CopyCensus(parameter_shapes(trainer.vae, trainer.objective), cuda_layouts)
    with census:  # (train_step takes the critic's few KB of buffers first: Adversary.step_began)
        trainer.train_step()
    trainer.step += 1
    return census


def bench_copies(args, url, tmp, device, report: Report) -> dict:
    """The census of one step of the FLUX-width VAE (no attention, as issue 30's profile) with LPIPS and the frozen
    VGG16 critic, for each precision and memory format, at 128 px (activation bytes scale with the pixels)."""
    out, rows = {}, []
    for precision in ("fp32", "bf16"):
        for layout in ("false", "true"):
            trainer = build_trainer(url, tmp, f"copies_{precision}_{layout}", torch.device("cpu"), **FLUX_CONFIG,
                                    do_attn=False, vae_resolution=128, batch_size=2, precision=precision,
                                    channels_last=layout, do_ganloss=True, critic_trunk="frozen", memory_check=False)
            trainer.train_step()
            trainer.step += 1
            summary = step_census(trainer).summary()
            trainer.close()
            name = f"{precision}_{'channels_last' if layout == 'true' else 'nchw'}"
            out[name] = summary
            total = summary["activation_total"]
            params = {k: v for k, v in summary.items() if k.endswith("/parameter")}
            rows.append([precision, "channels_last" if layout == "true" else "NCHW", total["ops"], total["mib"],
                         sum(v["ops"] for v in params.values()), sum(v["mib"] for v in params.values())])
    report.table("Copies and casts of one step, FLUX width at 128 px, batch 2, LPIPS + frozen VGG16 critic "
                 "(CPU dispatch count, with the copies CUDA's GroupNorm and cuDNN add)",
                 ["precision", "VAE layout", "activation ops", "activation MiB", "parameter ops", "parameter MiB"],
                 rows)
    out["cpu_bf16_step_s"] = group_norm_step_times(url, tmp, report)
    return out


def fp32_copy_group_norm(self, x):
    """GroupNorm32 before issue 30: an fp32 copy of the input normalised, the output cast back."""
    with torch.autocast(x.device.type, enabled=False):
        out = torch.nn.functional.group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(),
                                             self.eps)
    return out.to(x.dtype)


def group_norm_step_times(url, tmp, report: Report, rounds: int = 8) -> dict:
    """The CPU's bf16 step (the train section's small config, channels_last: a CPU's default) with GroupNorm32 as
    it is and as it was (fp32_copy_group_norm), interleaved in one process: does the CPU path get slower?"""
    import ae
    trainer = build_trainer(url, tmp, "gn_times", torch.device("cpu"), **TRAIN_CONFIGS["small"], precision="bf16",
                            channels_last="true", memory_check=False)
    variants, times = {"bf16 statistics in the kernel": ae.GroupNorm32.forward,
                       "fp32 copy (before)": fp32_copy_group_norm}, {}
    timed_step(trainer)
    try:
        for r in range(rounds):
            for name in list(variants)[r % 2:] + list(variants)[:r % 2]:
                ae.GroupNorm32.forward = variants[name]
                times.setdefault(name, []).append(timed_step(trainer))
    finally:
        ae.GroupNorm32.forward = variants["bf16 statistics in the kernel"]
    trainer.close()
    out = {name: median(t) for name, t in times.items()}
    report.table("The CPU's bf16 step by GroupNorm (small config, channels_last, interleaved)", ["GroupNorm", "s/step"],
                 [[name, value] for name, value in out.items()])
    return out
