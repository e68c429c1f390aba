"""One real training step (VAE forward, LPIPS + pixel losses, backward, AdamW step) in a fresh process; prints
memory.py's estimate and the growth of the process's peak resident memory over the step, in bytes, as JSON.
A fresh process, so the allocator holds nothing of other tests. The peak is VmHWM reset just before the step
(/proc/self/clear_refs), not getrusage's ru_maxrss: a child's ru_maxrss starts at its parent's peak, which under
a pytest worker that has run many tests is gigabytes above this step's. Args: BATCH RESOLUTION CHECKPOINTING."""
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import memory  # noqa: E402
from ae import AutoEncoder  # noqa: E402
from conftest import objective_of  # noqa: E402
from ae import AutoEncoderParams
from objective import MicroBatch

torch.set_num_threads(1)
batch, resolution, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = config.resolve_auto(config.unflatten(dict(
    dataset_url="unused", vae_ch=32, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4, do_attn=False,
    vgg16_weights="random", grad_checkpointing=mode)))
torch.manual_seed(0)
vae = AutoEncoder(AutoEncoderParams.from_config(cfg.model))
vae.set_grad_checkpointing(mode)
objective = objective_of(cfg, None, with_lpips=True)
# the estimate runs at 64 and 128 px, far below the step measured here, so its own peak stays under the base
estimate = memory.estimate_step_memory(vae, objective, memory.StepShape(batch, resolution, grad_checkpointing=mode),
                                       ema=False)
x = torch.rand(batch, 3, resolution, resolution) * 2 - 1
gc.collect()
base = memory.rss_bytes()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the resident memory now
optimizer = torch.optim.AdamW(vae.parameters())
recon, mean, logvar = vae(x)
loss, _ = objective(MicroBatch(x, recon.float(), mean, logvar, 0))
loss.backward()
optimizer.step()
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"estimate_without_weights": estimate.total - estimate.weights, "measured_growth": peak - base}))
