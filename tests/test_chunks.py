"""Long clips trained in temporal chunks (issue 42 item 2, --train_time_chunks): wan_ae.run_chunks checkpoints each
chunk and carries the gradient through the temporal cache. On tiny random models of Wan 2.1's and Wan 2.2's
structure (two temporal levels: 17 frames are 5 latent frames), the parameter gradients of a loss on the whole
reconstruction equal the whole clip's to float rounding for diffusers' plan (encoder chunks of 1, 4, 4, 4, 4 frames,
decoder one latent frame at a time) and for (8, 2), also nested with the per-level checkpoints and with the encoder
frozen (--train_parts decoder); what autograd keeps outside the checkpointed chunks barely grows with the clip, while
the whole clip's grows with it; and the memory check probes the plan and offers it. References are computed in the
same process."""
from __future__ import annotations

import pytest
import torch

import memory
import wan_ae
from wan_ae import WanAutoEncoder, WanParams
from test_video import clip_url, wan_folder  # noqa: F401 (fixtures: a tiny diffusers Wan folder, clip shards)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRUCTURES = {
    "wan2.1": dict(ch=8, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, decoder_ch=12,
                   temporal_downsample=(True, True)),
    # Wan 2.2's: 2x2 patches, residual levels whose shortcuts average and duplicate across time
    "wan2.2": dict(ch=8, ch_mult=(1, 1, 2, 2), num_res_blocks=1, z_channels=4, decoder_ch=12, patch_size=2,
                   level_shortcuts=True, temporal_downsample=(False, True, True)),
}


def tiny(structure: str, seed: int = 0) -> WanAutoEncoder:
    torch.manual_seed(seed)
    vae = WanAutoEncoder(WanParams(video=True, **STRUCTURES[structure]))
    with torch.no_grad():  # the RMS norms' gammas off 1, every weight moved: no layer is an identity
        for name, p in vae.named_parameters():
            p.add_(0.2 * torch.randn_like(p) if name.endswith("gamma") else 0.05 * torch.randn_like(p))
    return vae.train()


def clip(frames: int, size: int = 16, seed: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, size, size, generator=generator) * 2 - 1


def gradients(vae: WanAutoEncoder, x: torch.Tensor, plan: tuple[int, int], mode: str = "none",
              frozen_encoder: bool = False) -> dict[str, torch.Tensor]:
    """The parameter gradients of a loss on the whole reconstruction (and the posterior), trained with `plan`."""
    vae.train_chunks = plan
    vae.set_grad_checkpointing(mode)
    vae.zero_grad(set_to_none=True)
    target = clip(x.shape[2], x.shape[3], seed=7)
    if frozen_encoder:  # --train_parts decoder: the encoder under no_grad, only the decoder's chunks checkpointed
        with torch.no_grad():
            mean, logvar = vae.encode_moments(x)
        recon = vae.decode(mean)
    else:
        torch.manual_seed(11)
        recon, mean, logvar = vae(x)
    loss = (recon - target).square().mean() + 1e-2 * (mean.square() + logvar.exp() - logvar).mean()
    loss.backward()
    vae.set_grad_checkpointing("none")
    return {name: p.grad.clone() for name, p in vae.named_parameters() if p.grad is not None}


def assert_same_gradients(grads: dict, reference: dict, what: str) -> None:
    assert grads.keys() == reference.keys(), what
    worst = 0.0
    for name, g in grads.items():
        scale = reference[name].abs().max().item()
        assert scale > 0, (what, name)
        error = (g - reference[name]).abs().max().item() / scale
        worst = max(worst, error)
        # float32 rounding of convolutions over other frame counts: a weight's gradient sums n ~ 1e4 products here
        # (batch x frames x pixels), summed in another order a random walk of sqrt(n) x 2^-24 ~ 1e-5 of its
        # magnitude (measured: at most 5e-6); a lost gradient path is of the order of the gradient (the temporal
        # cache detached: 0.98)
        assert error <= 1e-4, (what, name, error)
    print(f"{what}: worst gradient error {worst:.2g} of the gradient's scale")


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_chunked_gradients_equal_the_whole_clips(structure):
    vae = tiny(structure)
    x = clip(17)
    whole = gradients(vae, x, (0, 0))
    # the temporal layers and both parts get gradients: the cache must carry them for chunks to equal this
    assert any(".time_conv." in n for n in whole) and any(n.startswith("encoder.") for n in whole)
    for plan in ((4, 1), (8, 2)):
        assert_same_gradients(gradients(vae, x, plan), whole, f"{structure} plan {plan}")
    # nested with the per-level checkpoints: each chunk's recomputation checkpoints its levels again
    assert_same_gradients(gradients(vae, x, (4, 1), mode="all"), whole, f"{structure} plan (4, 1), levels too")
    # the encoder frozen: its chunks run without a graph, the decoder's are checkpointed
    frozen_whole = gradients(vae, x, (0, 0), frozen_encoder=True)
    assert not any(n.startswith("encoder.") for n in frozen_whole)
    assert_same_gradients(gradients(vae, x, (8, 2), frozen_encoder=True), frozen_whole,
                          f"{structure} plan (8, 2), encoder frozen")


def test_a_chunk_recomputes_with_the_dropout_masks_it_drew():
    """Dropout inside a chunk: the checkpoint restores the RNG state, so the recomputation draws the masks the forward
    drew and the gradient is the forward's own (the same chunk plan without checkpointing is the reference: a chunk
    draws its masks per chunk, not per clip)."""
    vae = tiny("wan2.1")
    for m in vae.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.2
    x = clip(9)
    checkpointed = gradients(vae, x, (4, 1))
    original = wan_ae._checkpointed_chunk

    def unchecked(step, frames, prev, keep):  # the same chunks without the checkpoint
        chunk = wan_ae.Chunk(prev, keep=keep)
        return step(frames, chunk), chunk.next
    wan_ae._checkpointed_chunk = unchecked
    try:
        reference = gradients(vae, x, (4, 1))
    finally:
        wan_ae._checkpointed_chunk = original
    assert_same_gradients(checkpointed, reference, "dropout 0.2, plan (4, 1)")


def saved_bytes(vae: WanAutoEncoder, frames: int, plan: tuple[int, int]) -> int:
    """Bytes autograd saves for backward during the training forward and its loss (checkpointed regions excepted:
    the checkpoint saves nothing there, it recomputes), storages counted once, the parameters not at all."""
    params = {p.untyped_storage().data_ptr() for p in vae.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    vae.train_chunks = plan
    x = clip(frames, size=32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recon, mean, logvar = vae(x)
        loss = (recon - x).square().mean() + (mean.square() + logvar.exp()).mean()
    del loss
    return sum(seen.values())


def test_what_a_chunked_step_keeps_follows_the_chunk_not_the_clip():
    """The whole clip keeps every frame's activations for backward: twice the frames, about twice the bytes. Chunked,
    what is kept outside the checkpointed chunks is each chunk's input cache (what each causal layer reads of the
    chunk before: 2 frames of its input, the checkpoint keeps it for the recomputation), the chunks' inputs and the
    loss's operands on the output clip; backward adds one chunk's activations at a time (recomputed). So it still
    grows with the clip, by the cache, but several times slower: measured on this model at 32 px, 17 -> 33 -> 65
    frames, whole 34 -> 65 -> 126 MB, (4, 1) 4.3 -> 9.1 -> 18.8 MB, (8, 2) 2.1 -> 4.7 -> 10.0 MB (half the chunks,
    half the cache)."""
    vae = tiny("wan2.1")
    kept = {plan: {frames: saved_bytes(vae, frames, plan) for frames in (17, 33)} for plan in ((0, 0), (4, 1), (8, 2))}
    print(f"saved for backward at 17 and 33 frames: {kept}")
    whole, diffusers_plan, larger = kept[(0, 0)], kept[(4, 1)], kept[(8, 2)]

    def growth(bytes_at: dict) -> int:
        return bytes_at[33] - bytes_at[17]
    assert whole[33] > 1.8 * whole[17]
    assert diffusers_plan[17] < 0.2 * whole[17] and diffusers_plan[33] < 0.2 * whole[33]
    assert growth(diffusers_plan) < 0.25 * growth(whole)
    assert growth(larger) < 0.6 * growth(diffusers_plan)  # fewer chunks: fewer caches kept


def test_the_memory_check_probes_the_plan_and_offers_it():
    """The estimate of a chunked step is the probe with the plan (what stays outside the chunks) plus one chunk's
    recomputation, well under the whole clip's; a refusal of a clip that will not fit offers --train_time_chunks t,1
    with its estimate."""
    import config
    from conftest import objective_of
    vae = tiny("wan2.1")
    cfg = config.resolve_auto(config.unflatten(dict(dataset_url="unused", perceptual_weight=0.0,
                                                    vgg16_weights="random")))
    objective = objective_of(cfg, None, with_lpips=False, z_channels=4)
    shape = memory.StepShape(1, 64, frames=33)
    whole = memory.estimate_step_memory(vae, objective, shape, probe_resolutions=(16, 32))
    chunked = memory.estimate_step_memory(vae, objective, memory.dataclasses.replace(shape, time_chunks=(4, 1)),
                                          probe_resolutions=(16, 32))
    print(f"estimated activations at 33 frames: whole {whole.activations}, chunked {chunked.activations}")
    assert chunked.activations < 0.5 * whole.activations
    assert vae.train_chunks == (0, 0)  # the probe's plan is put back
    offered = memory.remedies(memory.dataclasses.replace(shape, chunk_factor=4))
    assert ("--train_time_chunks 4,1", memory.dataclasses.replace(shape, chunk_factor=4, time_chunks=(4, 1))) in offered
    assert "--train_time_chunks" not in " ".join(f for f, _ in memory.remedies(shape))  # a family without chunks
    sharded = memory.dataclasses.replace(shape, chunk_factor=4, shards=2, ranks=2)  # config refuses chunks sharded
    assert "--train_time_chunks" not in " ".join(f for f, _ in memory.remedies(sharded))
    assert "--train_time_chunks" not in memory.all_remedies(sharded)[0]
    line = memory.fit_message(whole, (whole.total // 2, "RAM available"), memory.dataclasses.replace(
        shape, chunk_factor=4), lambda s: memory.estimate_step_memory(vae, objective, s, probe_resolutions=(16, 32)))
    assert "--train_time_chunks 4,1 (~" in line, line


@pytest.mark.process
def test_the_trainer_trains_a_clip_in_the_chunks_of_its_flag(wan_folder, clip_url, tmp_path, monkeypatch):
    """--train_time_chunks reaches the model (families.Family.set_memory_plan): a step of a full fine-tune on 5-frame
    clips (one latent frame after the first) runs every clip through checkpointed chunks, and its gradient is the
    whole-clip step's, to float rounding.

    The gradient, not the weights after AdamW: Adam divides each gradient element by its own magnitude, so an element
    whose gradient is itself rounding noise (a sum that cancels) moves its weight by up to the learning rate in either
    run, whatever the tolerance on the gradient. That was issue 48's one weight of 6,912 off by 1.34e-5 after two
    steps (3% of --learning_rate_vae 4e-4) while every gradient agreed to 3e-5 of its tensor's scale. The step's
    gradient is read back exactly from the checkpoint: after one step AdamW's first moment is (1 - beta1) x gradient
    (a lerp from zeros, the same rounding in both runs), compared as this file compares gradients
    (assert_same_gradients)."""
    import vae_trainer
    from test_video import trainer_args
    chunks = []
    original = wan_ae._checkpointed_chunk

    def counted(*args):
        chunks.append(args[1].shape[2])
        return original(*args)
    monkeypatch.setattr(wan_ae, "_checkpointed_chunk", counted)
    train, test = clip_url
    flags = ["--num_workers", "0", "--max_steps", "1", "--save_every_n_steps", "1", "--perceptual_weight", "0",
             "--memory_check", "false"]
    assert vae_trainer.main(trainer_args(wan_folder, train, test, tmp_path, "whole", *flags)) == 0
    assert chunks == []
    assert vae_trainer.main(trainer_args(wan_folder, train, test, tmp_path, "chunked", *flags,
                                         "--train_time_chunks", "4,1")) == 0
    assert chunks and set(chunks) == {1, 4}  # the encoder's 1 + 4 frames, the decoder's 1 + 1 latent frames (1)
    whole, chunked = (torch.load(tmp_path / run / "checkpoints" / "step_00000001.pt", weights_only=True)
                      for run in ("whole", "chunked"))

    def first_gradient(ckpt) -> dict:
        optimizer = ckpt["training"]["optimizer"]
        assert len(optimizer["param_groups"]) == 1
        beta1 = optimizer["param_groups"][0]["betas"][0]
        return {str(i): state["exp_avg"] / (1 - beta1) for i, state in optimizer["state"].items()
                if state["exp_avg"].abs().max() > 0}  # (a parameter without a gradient: 0 in both, not compared)
    reference = first_gradient(whole)
    assert len(reference) >= len(whole["training"]["vae"]) - 2  # (all but the posterior's unused parts, if any)
    assert_same_gradients(first_gradient(chunked), reference, "the trainer's first step, --train_time_chunks 4,1")
