"""alignment.py, VA-VAE's vision-foundation alignment: the loss's value on constructed features, the gradient
only into the latent and the projection (at GradNorm's norm), the frozen foundation encoder, the resize to the
latent grid, and how its weights are loaded."""
from __future__ import annotations

import pytest
import torch

import alignment
from weights import WeightsUnavailable
import config
import flags
import run_setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def vf():
    """The smallest DINOv2 (ViT-S/14) on random weights, at 28 px: 2 x 2 tokens."""
    torch.manual_seed(0)
    return alignment.AlignmentLoss(z_channels=4, model="dinov2_vits14", weights="random", image_size=28)


def test_identical_or_nearly_identical_features_cost_nothing():
    features = torch.randn(2, 8, 4, 4, generator=torch.Generator().manual_seed(0))
    assert [t.item() for t in alignment.vf_loss_terms(features, features)] == [0.0, 0.0]
    nearby = features + 0.05 * torch.randn(features.shape, generator=torch.Generator().manual_seed(1))
    assert [t.item() for t in alignment.vf_loss_terms(nearby, features)] == [0.0, 0.0]  # within the margins


def test_known_cosines_give_the_known_value():
    """Two tokens on a 1 x 2 grid. Features e1, e1; projected latent e2, e1: per-token cosines 0 and 1 ->
    mean(relu(0.5 - 0), relu(0.5 - 1)) = 0.25; token-pair cosines z: [[1, 0], [0, 1]], f: all 1 ->
    |difference| [[0, 1], [1, 0]] -> mean(relu(. - 0.25)) = 1.5 / 4 = 0.375."""
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])  # lengths do not matter: cosines
    features = torch.stack([e1, e1], dim=-1).view(1, 2, 1, 2)
    z = torch.stack([e2, e1], dim=-1).view(1, 2, 1, 2)
    cosine, distmat = alignment.vf_loss_terms(z, features)
    assert cosine.item() == pytest.approx(0.25) and distmat.item() == pytest.approx(0.375)
    cosine, distmat = alignment.vf_loss_terms(z, features, cos_margin=0.0, distmat_margin=0.0)
    assert cosine.item() == pytest.approx(0.5) and distmat.item() == pytest.approx(0.5)


def test_gradient_reaches_only_the_latent_and_the_projection(vf):
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    z = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    vf.zero_grad(set_to_none=True)
    loss, terms = vf(z, images * 2 - 1, weight=0.3)
    assert loss.dtype == torch.float32 and loss.item() > 0 and set(terms) == {"vf_cosine", "vf_distmat"}
    loss.backward()
    assert images.grad is None  # the features are constants: nothing flows into the images or the encoder
    assert all(p.grad is None for p in vf.foundation.parameters())
    assert vf.projection.weight.grad is not None and vf.projection.weight.grad.abs().sum() > 0
    assert torch.linalg.vector_norm(z.grad).item() == pytest.approx(0.3, rel=1e-5)  # GradNorm: the weight


def test_the_projection_has_no_bias_so_a_shared_feature_component_still_pulls_the_latent(vf):
    """Issue 23 item 5, VA-VAE's projection has no bias. Features whose tokens share one strong component and a latent
    that carries nothing about them: a projection with a bias (the old one, built beside ours) learns the shared
    vector as its bias, the term reaches ~0 and the latent gets next to no gradient; ours cannot, so the term stays
    and keeps pulling the latent."""
    assert vf.projection.bias is None
    gen = torch.Generator().manual_seed(0)
    features = 5 * torch.randn(32, 1, 1, generator=gen) + 0.1 * torch.randn(4, 32, 8, 8, generator=gen)
    latent = torch.randn(4, 4, 8, 8, generator=gen)

    def fitted(projection):
        optimizer = torch.optim.Adam(projection.parameters(), lr=0.05)
        for _ in range(300):
            optimizer.zero_grad()
            sum(alignment.vf_loss_terms(projection(latent), features)).backward()
            optimizer.step()
        z = latent.clone().requires_grad_(True)
        loss = sum(alignment.vf_loss_terms(projection(z), features))
        loss.backward()
        return loss.item(), torch.linalg.vector_norm(z.grad).item()

    torch.manual_seed(0)
    with_bias = torch.nn.Conv2d(4, 32, kernel_size=1)
    torch.manual_seed(0)
    ours = alignment.latent_projection(4, 32)
    assert torch.equal(ours.weight, with_bias.weight)  # the same start, but for the bias
    biased_loss, biased_grad = fitted(with_bias)
    loss, grad = fitted(ours)
    assert biased_loss < 0.01 and loss > 0.1, (biased_loss, loss)
    assert grad > 10 * biased_grad, (grad, biased_grad)


def test_a_checkpoint_whose_projection_has_a_bias_resumes_without_it(capsys):
    """Runs saved before the bias went keep their projection's weight; the bias is dropped with a note, and the
    projection's optimizer (whose state holds the bias) starts afresh."""
    from train_state import ProjectionTraining
    old = torch.nn.Conv2d(4, 8, kernel_size=1)
    old_training = ProjectionTraining(old, _optim_cfg(), _adamw)
    old(torch.randn(1, 4, 2, 2)).square().sum().backward()
    old_training.optimizer.step()  # AdamW's moments for the weight and the bias
    ckpt = old_training.state_dict()
    assert len(ckpt["optimizer"]["state"]) == 2
    new = ProjectionTraining(alignment.latent_projection(4, 8), _optim_cfg(), _adamw)
    new.load_state_dict(ckpt, path="old.pt", log=print)
    assert torch.equal(new.projection.weight, old.weight) and new.projection.bias is None
    assert "old.pt's alignment projection has a bias" in capsys.readouterr().out
    assert new.optimizer.state_dict()["state"] == {}


def _optim_cfg():
    import config
    return run_setup.parse_config(["--dataset_url", "x"]).optim


def _adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr)


def test_foundation_encoder_is_frozen_and_stays_in_eval_mode(vf):
    vf.train()
    assert not vf.foundation.training and not vf.foundation.net.training
    assert not any(m.training for m in vf.foundation.modules())
    assert not any(p.requires_grad for p in vf.foundation.parameters())
    assert all(p.requires_grad for p in vf.projection.parameters())
    features = vf.foundation(torch.zeros(1, 3, 32, 32), (4, 4))
    assert features.shape == (1, vf.foundation.feature_dim, 4, 4) and vf.foundation.feature_dim == 384


def test_features_are_resized_to_the_latent_grid():
    features = torch.randn(2, 6, 16, 16, generator=torch.Generator().manual_seed(0))
    assert alignment.resize_to_grid(features, (16, 16)) is features
    assert alignment.resize_to_grid(features, (8, 8)).shape == (2, 6, 8, 8)
    assert alignment.resize_to_grid(features, (32, 24)).shape == (2, 6, 32, 24)
    constant = torch.full((1, 3, 16, 16), 2.5)
    assert torch.allclose(alignment.resize_to_grid(constant, (4, 4)), torch.full((1, 3, 4, 4), 2.5))
    # a 2x2 block average when shrinking by 2 (antialiased), not a pick of every other token
    ramp = torch.arange(16.0).view(1, 1, 4, 4)
    assert torch.allclose(alignment.resize_to_grid(ramp, (2, 2)), ramp.view(1, 1, 2, 2, 2, 2).mean(dim=(3, 5)))


def test_weights_random_is_announced_a_path_loads_exactly_and_a_bad_one_is_one_line(vf, tmp_path, capfd):
    torch.manual_seed(1)
    alignment.FoundationEncoder("dinov2_vits14", "random", 28)
    assert "RANDOMLY INITIALISED dinov2_vits14" in capfd.readouterr().err
    path = tmp_path / "dinov2_vits14.pth"
    torch.save(vf.foundation.net.state_dict(), path)
    loaded = alignment.FoundationEncoder("dinov2_vits14", str(path), 28)
    images = torch.rand(1, 3, 28, 28) * 2 - 1
    assert torch.equal(loaded(images, (2, 2)), vf.foundation(images, (2, 2)))
    with pytest.raises(WeightsUnavailable, match=r"^--vf_weights /no/such.pth: no such file$"):
        alignment.FoundationEncoder("dinov2_vits14", "/no/such.pth", 28)
    with pytest.raises(WeightsUnavailable, match="is not a dinov2_vitb14 state dict"):
        alignment.FoundationEncoder("dinov2_vitb14", str(path), 28)
    with pytest.raises(WeightsUnavailable, match="--vf_model vit_h: not one of"):
        alignment.FoundationEncoder("vit_h", "random", 28)


# ------------------------------------------------------------------------------------------ wired into the trainer
VF_FLAGS = ["--vf_weight", "0.5", "--vf_model", "dinov2_vits14", "--vf_weights", "random", "--vf_image_size", "28"]


def test_alignment_term_through_the_objective():
    """The objective's vf Term: loss/vf is VA-VAE's two terms on the projected latent, loss/total counts it with
    its weight, and its gradient at the latent has GradNorm's norm vf_weight (a branch, like the pixel one)."""
    from conftest import TINY, objective_of
    from objective import MicroBatch
    cfg = run_setup.parse_config(["--dataset_url", "x", *TINY, *VF_FLAGS, "--perceptual_weight", "0",
                                    "--kl_weight", "0"])
    torch.manual_seed(0)
    obj = objective_of(cfg, None, with_lpips=False, z_channels=4)
    vf = obj.alignment
    assert vf.foundation.feature_dim == 384  # ViT-S/14, as --vf_model says
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 64, 64, generator=gen) * 2 - 1
    recon = (torch.rand(2, 3, 64, 64, generator=gen) * 2 - 1).requires_grad_()
    latent = torch.randn(2, 4, 16, 16, generator=gen).requires_grad_()
    loss, logs = obj(MicroBatch(x, recon, latent, None, 0, latent=latent, images=x))
    cosine, distmat = alignment.vf_loss_terms(vf.projection(latent), vf.foundation(x, (16, 16)))
    assert logs["loss/vf"].item() == pytest.approx((cosine + distmat).item(), rel=1e-6) and logs["loss/vf"] > 0
    assert logs["loss/vf_cosine"].item() == pytest.approx(cosine.item(), rel=1e-6)
    pixel = logs["loss/pooled_mse"] + logs["loss/lowpass_mse"]
    assert logs["loss/total"].item() == pytest.approx((pixel + 0.5 * logs["loss/vf"]).item(), rel=1e-6)
    loss.backward()
    assert latent.grad.norm().item() == pytest.approx(0.5, rel=1e-4)  # kl_weight 0: the vf branch alone
    assert vf.projection.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in vf.foundation.parameters())


def test_an_unreachable_hub_is_one_line_at_once(monkeypatch, tmp_path):
    """Issue 23 item 10: --vf_weights timm without a reachable hub spent ~28 s in the hub client's retries before
    its error; one connection attempt decides (a closed port on this machine stands in for the hub)."""
    import time

    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    start = time.monotonic()
    with pytest.raises(WeightsUnavailable, match=r"^dinov2_vits14 weights unavailable .*127\.0\.0\.1:9 unreachable"):
        alignment.fetch_foundation_weights("dinov2_vits14", "timm")
    assert time.monotonic() - start < 5


def test_timm_weights_are_fetched_by_local_rank_0_before_the_others_build(monkeypatch):
    """--vf_weights timm: the trainer brings DINOv2's weights into the Hugging Face cache through fetch_weights
    (local rank 0 downloads, the other ranks wait at a barrier and then build from the cache), so a node's ranks
    never write one cache entry at once; a failed download is one line naming the way out."""
    import huggingface_hub
    import vae_trainer
    from common import DistInfo
    from conftest import TINY
    downloads, fetches = [], []
    monkeypatch.setattr(alignment, "hub_unreachable", lambda: None)  # a hub that answers (these tests fake it)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: downloads.append((repo, name)))
    alignment.fetch_foundation_weights("dinov2_vits14", "timm", download=True)
    assert downloads == [("timm/vit_small_patch14_dinov2.lvd142m", "model.safetensors")]
    alignment.fetch_foundation_weights("dinov2_vits14", "timm", download=False)  # a waiting rank
    alignment.fetch_foundation_weights("dinov2_vits14", "random", download=True)
    assert len(downloads) == 1

    def offline(repo, name):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(WeightsUnavailable, match=r"^dinov2_vits14 weights unavailable .*--vf_weights PATH") as e:
        alignment.fetch_foundation_weights("dinov2_vits14", "timm")
    assert "\n" not in str(e.value)

    def fetch_weights(ensure, spec, local_rank, group):
        fetches.append((spec, local_rank))
        return ensure(spec, download=local_rank == 0)
    monkeypatch.setattr(vae_trainer, "fetch_weights", fetch_weights)
    cfg = run_setup.parse_config(["--dataset_url", "x", *TINY, *VF_FLAGS, "--perceptual_weight", "0"])
    vae_trainer.vgg16_for_run(cfg, DistInfo(local_rank=1), False, print)
    assert fetches == [("random", 1)]  # the alignment's weights went through the rank-ordered fetch


def test_decoder_only_says_the_alignment_is_off_and_other_balances_are_refused():
    import vae_trainer
    from conftest import TINY
    cfg, given = flags.parse_flags(["--dataset_url", "x", *TINY, *VF_FLAGS, "--train_parts", "decoder",
                                          "--load_path", "w.pt"])
    lines = [line for line in run_setup.config_warnings(cfg, given) if "vf_weight" in line]
    assert lines == ["warning: --vf_weight, --vf_model, --vf_weights, --vf_image_size have no effect with "
                     "--train_parts decoder (the encoder is frozen: there is no latent to align)"]
    with pytest.raises(config.ConfigError, match="--loss_balance gradnorm"):
        run_setup.parse_config(["--dataset_url", "x", *TINY, *VF_FLAGS,
                                                       "--loss_balance", "none"]).validate()


def _run_args(url, out, run, steps, save, *extra):
    from conftest import TINY
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", str(save), "--log_every_n_steps", "2", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "20", *TINY, "--perceptual_weight", "0", *VF_FLAGS, "--probe_every_n_steps", "3",
            "--probe_images", "6", "--probe_heldout", "2", "--probe_steps", "2", "--probe_batch_size", "4", *extra]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_resume_with_alignment_and_probe_on_is_bitwise(shard_url, tmp_path, capfd, monkeypatch, one_torch_thread):
    """Stopped at step 3 (before that step's probe, which the uninterrupted run does) and resumed: the VAE, the
    projection and both optimizers end bitwise equal, and the probe curve is the same numbers. (In-process: the
    runs' own main, a stop as SIGTERM gives it.)"""
    import json
    import vae_trainer
    from conftest import faults_in_process, run_in_process
    ref = run_in_process(vae_trainer.main, _run_args(shard_url, tmp_path, "ref", 6, 6), capfd)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert any("loss/vf" in json.loads(line) for line in open(tmp_path / "ref" / "metrics.jsonl"))
    with monkeypatch.context() as faulty:
        faults_in_process(faulty, VAE_TRAINER_SIGTERM_AT="2")
        first = run_in_process(vae_trainer.main, _run_args(shard_url, tmp_path, "cut", 6, 100), capfd)
    assert first.returncode == 0 and "checkpoint written at step 3" in first.stdout, first.stderr[-2000:]
    again = run_in_process(vae_trainer.main, _run_args(shard_url, tmp_path, "cut", 6, 6), capfd)
    assert again.returncode == 0 and "at step 3" in again.stdout, again.stderr[-2000:]
    a, b = (torch.load(tmp_path / run / "checkpoints" / "step_00000006.pt", weights_only=True) for run in ("ref", "cut"))
    for entry, key in (("training", "vae"), ("vf_projection", "projection")):
        for name in a[entry][key]:
            assert torch.equal(a[entry][key][name], b[entry][key][name]), (key, name)
    for entry in ("training", "vf_projection"):
        for pid, state in a[entry]["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, b[entry]["optimizer"]["state"][pid][name]), (entry, pid, name)

    def curve(run):
        rows = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
        return {r["step"]: r["eval/probe_loss"] for r in rows if "eval/probe_loss" in r}
    ref_curve, cut_curve = curve("ref"), curve("cut")
    # the probe due at step 3 was not run by the stopped run: the resumed one runs it first (issue 23 item 10)
    assert sorted(ref_curve) == [0, 3, 6] and cut_curve == ref_curve

    # the export is the VAE alone: the projection is a training aid, not part of the autoencoder
    import export
    from safetensors.torch import load_file
    assert export.main(["--ckpt", str(tmp_path / "ref"), "--out", str(tmp_path / "st"), "--format", "safetensors"]) == 0
    exported = load_file(next(str(p) for p in (tmp_path / "st").glob("*.safetensors")))
    assert exported.keys() == a["training"]["vae"].keys()
    assert all(torch.equal(exported[k], a["training"]["vae"][k]) for k in exported)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_two_ranks_train_the_projection_in_sync_and_probe_like_one(shard_url, tmp_path, capfd, one_torch_thread):
    """2 gloo ranks with the alignment (accumulation, bf16, checkpointing): the VAE and the projection stay equal on
    every rank (checked at the save), every rank takes part in the probe (no hang), and its first point, the same
    initial VAE, is the number one rank gets (this process)."""
    import json
    import vae_trainer
    from conftest import run_cli, run_in_process
    extra = ["--grad_accum", "2", "--precision", "bf16", "--grad_checkpointing", "decoder"]
    two = run_cli("vae_trainer.py", _run_args(shard_url, tmp_path, "two", 2, 2, *extra), nproc=2)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "(weights identical on all ranks)" in two.stdout
    saved = torch.load(tmp_path / "two" / "checkpoints" / "step_00000002.pt", weights_only=True)
    assert saved["run"]["ranks_in_sync"] is True  # the VAE and the projection: each tensor's fingerprint on both ranks
    one = run_in_process(vae_trainer.main, _run_args(shard_url, tmp_path, "one", 1, 1, *extra), capfd)
    assert one.returncode == 0, one.stderr[-2000:]

    def first_probe(run):
        rows = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
        return next(r["eval/probe_loss"] for r in rows if "eval/probe_loss" in r and r["step"] == 0)
    assert first_probe("two") == pytest.approx(first_probe("one"), rel=1e-5)
    assert "probe step 0 | eval/probe_loss" in two.stdout
