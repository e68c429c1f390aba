"""FLUX.2's VAE in and out, and a narrower decoder (issue "Fine-tune the VAEs of 2025-26"): diffusers'
AutoencoderKLFlux2 folder and BFL's single file load into ae.AutoEncoder computing bitwise what diffusers computes;
FLUX.2's bn statistics ride along as buffers (training state, DDP, EMA, checkpoints, both export layouts); their
re-estimation normalises held-out latents through the FLUX.2 pipeline's own code; a narrower decoder is built for
every family's latent space and exported as diffusers can hold it; contradicting families are refused in one line.

Random models of the released structures at a quarter of their width: FLUX.2's 128,256,512,512 encoder as
32,64,128,128, with the released 32 GroupNorm groups (a single file does not say its group count: 32 is read);
BFL's small decoder (96,192,384,384) as 32,64,96,96, its quarter 24,48,96,96 being no multiple of 32."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import export
import families
import layouts
import ldm_layouts
from ae import AutoEncoder, AutoEncoderParams, patchify_latents, unpatchify_latents
from conftest import run_cli

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

ENCODER = (32, 64, 128, 128)
SMALL_DECODER = (32, 64, 96, 96)
FLUX2 = dict(block_out_channels=ENCODER, layers_per_block=2, norm_num_groups=32, latent_channels=32,
             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
# The other families' structure and factors, at the same width and group size
from test_finetune import FAMILIES  # noqa: E402
# BFL's FLUX.2 single file (black-forest-labs/flux2, src/flux2/autoencoder.py) keeps the quant convs inside the
# encoder and decoder; diffusers' scripts/convert_flux2_to_diffusers.py (DIFFUSERS_VAE_TO_FLUX2_MAPPING) maps them,
# and the bn statistics, onto AutoencoderKLFlux2's names: diffusers' name -> BFL's
DIFFUSERS_TO_BFL = {"quant_conv.weight": "encoder.quant_conv.weight", "quant_conv.bias": "encoder.quant_conv.bias",
                    "post_quant_conv.weight": "decoder.post_quant_conv.weight",
                    "post_quant_conv.bias": "decoder.post_quant_conv.bias",
                    "bn.running_mean": "bn.running_mean", "bn.running_var": "bn.running_var"}


def perturb_norms(module: torch.nn.Module) -> None:
    """GroupNorm affines off (1, 0): a swapped or dropped norm would then show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))


def random_bn(bn: torch.nn.BatchNorm2d) -> None:
    """bn statistics away from BatchNorm's defaults (0, 1, 0), so that defaults written in their place would show."""
    with torch.no_grad():
        bn.running_mean.normal_(0.0, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.num_batches_tracked.fill_(1234)


def random_flux2(decoder: tuple[int, ...] | None = None, seed: int = 0):
    from diffusers import AutoencoderKLFlux2
    torch.manual_seed(seed)
    model = AutoencoderKLFlux2(**FLUX2, decoder_block_out_channels=decoder).eval()
    perturb_norms(model)
    random_bn(model.bn)
    return model


def random_family(family: str, seed: int = 0):
    """A random diffusers VAE of `family` (the four AutoencoderKL families, or FLUX.2's AutoencoderKLFlux2)."""
    if family == "flux2":
        return random_flux2(seed=seed)
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    structure = {k: v for k, v in FLUX2.items() if k != "latent_channels"}
    model = AutoencoderKL(**structure, **FAMILIES[family]).eval()
    perturb_norms(model)
    return model


def as_model(source: layouts.Source) -> AutoEncoder:
    vae = AutoEncoder(source.params)
    vae.load_state_dict(source.state)
    return vae.eval()


def images(n: int = 2, size: int = 32, seed: int = 5) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def assert_computes_like(ours: AutoEncoder, theirs) -> None:
    """Posterior mean and log-variance, and the decode of a random latent, bitwise diffusers' (the ops run in
    the same order on the same kernels, as for the other families)."""
    x = images()
    posterior = theirs.encode(x).latent_dist
    mean, logvar = ours.eval().encode_moments(x)
    assert torch.equal(mean, posterior.mean) and torch.equal(logvar, posterior.logvar)
    z = torch.randn(mean.shape, generator=torch.Generator().manual_seed(6))
    assert torch.equal(ours.decode(z), theirs.decode(z).sample)


def assert_same_bn(ours: AutoEncoder, theirs) -> None:
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(ours.bn, name), getattr(theirs.bn, name)), name


def flux2_pipeline(vae):
    """FLUX.2's pipeline around `vae` alone: its image-encoding path (_encode_vae_image: the posterior's mode,
    _patchify_latents, then the bn standardisation as the pipeline writes it) needs no other component."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                         transformer=None)


def load_flux2(path):
    from diffusers import AutoencoderKLFlux2
    return AutoencoderKLFlux2.from_pretrained(path, low_cpu_mem_usage=False).eval()


# ----------------------------------------------------------------------------------------------- FLUX.2 in and out
def test_patchify_is_the_flux2_pipelines():
    from diffusers import Flux2Pipeline
    z = torch.randn(2, 32, 6, 8)
    assert torch.equal(patchify_latents(z), Flux2Pipeline._patchify_latents(z))
    assert torch.equal(unpatchify_latents(patchify_latents(z)), z)
    assert torch.equal(unpatchify_latents(z[:, :, :3, :4].repeat(1, 4, 1, 1)),
                       Flux2Pipeline._unpatchify_latents(z[:, :, :3, :4].repeat(1, 4, 1, 1)))
    # the trainer's channels-last latents too (the pipeline's view() would refuse them)
    assert torch.equal(patchify_latents(z.to(memory_format=torch.channels_last)), patchify_latents(z))


@pytest.mark.parametrize("decoder", [None, SMALL_DECODER], ids=["wide_decoder", "small_decoder"])
def test_diffusers_folder_loads_and_exports_bitwise(tmp_path, decoder):
    """An AutoencoderKLFlux2 folder (FLUX.2-dev's VAE; with decoder_block_out_channels, FLUX.2-small-decoder's)
    loads as family flux2 with its bn statistics as buffers; encode, decode and the pipeline's normalised latents
    are bitwise diffusers'; the diffusers export loads with AutoencoderKLFlux2.from_pretrained computing the same
    (bn, decoder_block_out_channels and all), and BFL's single-file export loads back to the same weights."""
    reference = random_flux2(decoder)
    reference.save_pretrained(tmp_path / "folder")
    source = families.load_source(str(tmp_path / "folder"))
    params = source.params
    assert source.family == "flux2" and params.latent_bn and params.quant_conv and params.posterior == "learned"
    assert (params.z_channels, params.encoder_channels, params.decoder_widths) == (32, ENCODER, decoder or ENCODER)
    assert (params.latent_bn_eps, params.latent_bn_momentum) == (1e-4, 0.1)
    assert (source.factors["scaling_factor"], source.factors["shift_factor"]) == (1.0, 0.0)
    vae = as_model(source)
    assert_same_bn(vae, reference)
    assert_computes_like(vae, reference)
    x = images()
    with torch.no_grad():
        assert torch.equal(vae.normalize_latents(vae.encode(x)),
                           flux2_pipeline(reference)._encode_vae_image(x, torch.Generator().manual_seed(0)))

    ldm_layouts.export_diffusers(vae, str(tmp_path / "out"), 32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKLFlux2" and "scaling_factor" not in config
    assert config["decoder_block_out_channels"] == (list(decoder) if decoder else None)
    exported = load_flux2(tmp_path / "out")
    assert_same_bn(vae, exported)
    assert_computes_like(vae, exported)
    reloaded, _ = export.load_model(str(tmp_path / "out"))  # export.py / evaluate.py --ckpt of that folder
    assert reloaded.params == params and all(torch.equal(v, vae.state_dict()[k])
                                             for k, v in reloaded.state_dict().items())

    path = ldm_layouts.export_single_file(vae, str(tmp_path / "single"))
    from safetensors.torch import load_file
    keys = set(load_file(path))
    assert set(DIFFUSERS_TO_BFL.values()) | {"bn.num_batches_tracked"} <= keys
    assert not keys & {"quant_conv.weight", "post_quant_conv.weight"}  # BFL's strict load has them nested only
    again = families.load_source(path)
    assert again.family == "flux2" and again.params == params
    assert again.state.keys() == source.state.keys()
    assert all(torch.equal(again.state[k], v) for k, v in source.state.items())


def bfl_single_file(folder, decoder: tuple[int, ...] | None = None, seed: int = 1) -> str:
    """Random weights in BFL's FLUX.2 layout (FLUX.1's LDM names for the encoder and decoder, the quant convs
    inside them, bn.*), as BFL names its files: ae.safetensors, or full_encoder_small_decoder.safetensors."""
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    model = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=32,
                                          posterior="learned", quant_conv=True, latent_bn=True,
                                          decoder_channels=decoder or ()))
    perturb_norms(model)
    random_bn(model.bn)
    bfl = {DIFFUSERS_TO_BFL.get(k, k): v.detach().clone() for k, v in model.state_dict().items()}
    path = os.path.join(folder, "full_encoder_small_decoder.safetensors" if decoder else "ae.safetensors")
    save_file(bfl, path)
    return path


def diffusers_from_bfl_file(path: str, decoder: tuple[int, ...] | None):
    """The reference: the file converted as diffusers' convert_flux2_to_diffusers.py does (the LDM conversion of
    single_file_utils, and its FLUX.2 mapping for the quant convs and bn), loaded strictly."""
    from diffusers import AutoencoderKLFlux2
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    state = layouts.read_weights(path)
    model = AutoencoderKLFlux2(**FLUX2, decoder_block_out_channels=decoder).eval()
    converted = convert_ldm_vae_checkpoint({k: v for k, v in state.items() if not k.startswith("bn.")},
                                           model.config)
    for name, bfl in DIFFUSERS_TO_BFL.items():
        converted[name] = state[bfl]
    converted["bn.num_batches_tracked"] = state["bn.num_batches_tracked"]
    model.load_state_dict(converted, strict=True)
    return model


@pytest.mark.parametrize("decoder", [None, SMALL_DECODER], ids=["ae", "full_encoder_small_decoder"])
def test_bfl_single_file_loads_as_diffusers_converts_it(tmp_path, decoder):
    path = bfl_single_file(tmp_path, decoder)
    source = families.load_source(path)
    assert source.layout == "single_file" and source.family == "flux2" and source.params.latent_bn
    assert source.params.decoder_widths == (decoder or ENCODER) and source.params.quant_conv
    assert (source.factors["scaling_factor"], source.factors["shift_factor"]) == (1.0, 0.0)
    reference = diffusers_from_bfl_file(path, decoder)
    vae = as_model(source)
    assert_same_bn(vae, reference)
    assert_computes_like(vae, reference)
    # a file without num_batches_tracked (diffusers' conversion does not carry it) loads, the count at 0
    from safetensors.torch import save_file
    state = layouts.read_weights(path)
    del state["bn.num_batches_tracked"]
    save_file(state, tmp_path / "no_count.safetensors")
    assert families.load_source(str(tmp_path / "no_count.safetensors")).state["bn.num_batches_tracked"] == 0


def test_families_the_file_contradicts_are_refused_in_one_line(tmp_path, capsys):
    """--init_family must agree with the file's shapes: bn statistics only for flux2, and the family's latent
    channel count; auto detects FLUX.2 by its bn."""
    import vae_trainer
    from safetensors.torch import save_file
    flux2 = bfl_single_file(tmp_path)
    torch.manual_seed(2)
    flux1 = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16,
                                          posterior="learned"))
    save_file(ldm_layouts.single_file_state_dict(flux1), tmp_path / "flux1.safetensors")
    flux1_path = str(tmp_path / "flux1.safetensors")
    assert families.load_source(flux2).family == "flux2" and families.load_source(flux1_path).family == "flux"
    assert families.load_source(flux2, "flux2").family == "flux2"
    cases = [(flux2, family, "carries FLUX.2's bn statistics") for family in ("sd", "sdxl", "sd3", "flux")]
    cases += [(flux1_path, "flux2", "has no bn statistics"), (flux1_path, "sdxl", "latent has 4 channels")]
    for path, family, expected in cases:
        with pytest.raises(layouts.SourceError) as e:
            families.load_source(path, family)
        assert expected in str(e.value) and f"--init_family {family}" in str(e.value), (family, str(e.value))
        assert "\n" not in str(e.value)
    # what a user sees: one line from the trainer
    rc = vae_trainer.main(["--init_from", flux2, "--init_family", "sdxl", "--dataset_url", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --init_from") and "\n" not in err and "bn statistics" in err, err


def test_params_of_older_checkpoints_load_and_widths_are_checked():
    old = {k: v for k, v in AutoEncoderParams(ch=32, ch_mult=(1, 2), z_channels=4).to_dict().items()
           if k not in ("decoder_channels", "latent_bn", "latent_bn_eps", "latent_bn_momentum")}
    params = AutoEncoderParams.from_dict(old)
    assert params.decoder_channels == () and params.decoder_widths == (32, 64) and not params.latent_bn
    assert not any(k.startswith("bn.") for k in AutoEncoder(params).state_dict())
    narrow = AutoEncoderParams(ch=32, ch_mult=(1, 2), norm_groups=8, decoder_channels=(16, 24))
    assert AutoEncoderParams.from_dict(json.loads(json.dumps(narrow.to_dict()))) == narrow
    with pytest.raises(ValueError, match=r"the decoder's widths \[24, 48\] must be multiples of the 32 GroupNorm "
                                         r"groups \(norm_groups\): \[24, 48\] are not"):
        AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), decoder_channels=(24, 48)))
    with pytest.raises(ValueError, match="has 1 levels, the encoder 2"):
        AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2), decoder_channels=(32,)))


# ------------------------------------------------------------------------------------ through the trainer
def trainer_args(folder, shard_url, runs, name, *extra) -> list[str]:
    """vae_trainer.py's flags for a short fine-tune of the released model in `folder` (64 px: an 8 x 8 latent)."""
    return ["--init_from", str(folder), "--dataset_url", shard_url, "--output_dir", str(runs), "--run_name", name,
            "--vae_resolution", "64", "--batch_size", "2", "--num_workers", "1", "--shuffle_buffer", "8",
            "--max_steps", "2", "--warmup_steps", "1", "--perceptual_weight", "0", "--vgg16_weights", "random",
            "--wandb_mode", "disabled", "--evaluate_every_n_steps", "0", "--log_every_n_steps", "1", *extra]


def final_checkpoint(runs, name, step=2) -> dict:
    import checkpoint
    return checkpoint.load_checkpoint(str(runs / name / "checkpoints" / f"step_{step:08d}.pt"))


@pytest.mark.process
@pytest.mark.timeout(300)
def test_flux2_decoder_only_fine_tune_under_torchrun_keeps_its_latent_space_bitwise(tmp_path, shard_url, capsys):
    """`torchrun --nproc_per_node=2 vae_trainer.py --init_from <AutoencoderKLFlux2 folder> --train_parts decoder`:
    the encoder, quant_conv and the bn statistics stay bitwise the source's (weights and EMA; the two ranks
    verified equal), the decoder trains; the export is an AutoencoderKLFlux2 with the source's bn statistics
    (no re-estimation: the encoder was frozen) that computes what our model computes."""
    random_flux2().save_pretrained(tmp_path / "flux2")
    source = families.load_source(str(tmp_path / "flux2"))
    runs = tmp_path / "runs"
    proc = run_cli("vae_trainer.py", trainer_args(tmp_path / "flux2", shard_url, runs, "ft", "--train_parts",
                                                  "decoder"), nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(weights identical on all ranks)" in proc.stdout
    ckpt = final_checkpoint(runs, "ft")
    assert ckpt["run"]["ranks_in_sync"] is True and ckpt["run"]["model_params"]["latent_bn"] is True
    frozen = [k for k in source.state if k.startswith(("encoder.", "quant_conv.", "bn."))]
    assert any(k.startswith("bn.") for k in frozen) and any(k.startswith("quant_conv.") for k in frozen)
    for key in ("vae", "ema"):
        assert all(torch.equal(ckpt["training"][key][k], source.state[k]) for k in frozen), key
    assert not torch.equal(ckpt["training"]["vae"]["decoder.conv_out.weight"], source.state["decoder.conv_out.weight"])

    assert export.main(["--ckpt", str(runs / "ft"), "--out", str(tmp_path / "out"), "--ema"]) == 0
    assert json.loads(capsys.readouterr().out)["latent_norm"] == "bn"
    exported = load_flux2(tmp_path / "out")
    ours = AutoEncoder(source.params)
    ours.load_state_dict(ckpt["training"]["ema"])
    assert_same_bn(ours, exported)
    assert_computes_like(ours, exported)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_an_export_keeps_the_source_config_and_a_single_file_its_architecture(tmp_path, shard_url, capsys,
                                                                             monkeypatch):
    """Issue 31 items 4 and 6, on an AutoencoderKLFlux2 of unusual settings (8 GroupNorm groups, bn eps 1e-3 and
    momentum 0.05, sample_size 1024, and force_upcast in its config, which the class does not take), fine-tuned
    decoder-only. Its diffusers export starts from the source's config: sample_size stays 1024 (not the 64 px
    crop: diffusers' tiling reads it), force_upcast and the bn momentum stay, the bn eps and the groups are the
    model's. Its single file records the group count and the bn eps in its metadata, with a one-line warning that
    other loaders assume 32 and 1e-4; read back by --init_from it is the same model (before: 32 groups, without a
    word), and evaluate.py takes it. A file that does not record them says what was assumed."""
    import evaluate
    import vae_trainer
    from diffusers import AutoencoderKLFlux2
    torch.manual_seed(0)
    unusual = dict(FLUX2, norm_num_groups=8, batch_norm_eps=1e-3, batch_norm_momentum=0.05, sample_size=1024)
    source_model = AutoencoderKLFlux2(**unusual).eval()
    perturb_norms(source_model)
    random_bn(source_model.bn)
    source_model.register_to_config(force_upcast=False)
    source_model.save_pretrained(tmp_path / "flux2")
    source = families.load_source(str(tmp_path / "flux2"))
    assert (source.params.norm_groups, source.params.latent_bn_eps) == (8, 1e-3)
    runs = tmp_path / "runs"
    monkeypatch.chdir(tmp_path)
    assert vae_trainer.main(trainer_args(tmp_path / "flux2", shard_url, runs, "ft", "--train_parts", "decoder",
                                         "--num_workers", "0")) == 0
    ckpt = final_checkpoint(runs, "ft")
    assert ckpt["run"]["init_source"]["config"]["sample_size"] == 1024  # recorded: the folder may move

    assert export.main(["--ckpt", str(runs / "ft"), "--out", str(tmp_path / "diffusers")]) == 0
    with open(tmp_path / "diffusers" / "config.json") as f:
        written = json.load(f)
    assert written["sample_size"] == 1024 and written["force_upcast"] is False
    assert (written["norm_num_groups"], written["batch_norm_eps"], written["batch_norm_momentum"]) == (8, 1e-3, 0.05)
    ours = AutoEncoder(source.params)
    ours.load_state_dict(ckpt["training"]["vae"])
    assert_computes_like(ours, load_flux2(tmp_path / "diffusers"))

    capsys.readouterr()
    assert export.main(["--ckpt", str(runs / "ft"), "--out", str(tmp_path / "single"), "--format",
                        "single_file"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "norm_groups 8" in warnings[0] and "latent_bn_eps 0.001" in warnings[0], warnings
    path = str(tmp_path / "single" / "ae.safetensors")
    assert ldm_layouts.single_file_metadata(path)["norm_groups"] == "8"
    back = families.load_source(path)
    assert (back.params.norm_groups, back.params.latent_bn_eps) == (8, 1e-3) and back.notes == []
    again = AutoEncoder(back.params)
    again.load_state_dict(back.state)
    assert_computes_like(again, load_flux2(tmp_path / "diffusers"))
    assert evaluate.main(["--ckpt", path, "--dataset_url", shard_url, "--resolution", "64", "--vgg16_weights", "random",
                          "--inception_weights", "none", "--max_images", "2", "--batch_size", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["psnr"] > 0
    assert evaluate.main(["--ckpt", path, "--dataset_url", shard_url]) == 2  # no size recorded: one line
    assert "give --resolution" in capsys.readouterr().err

    bfl = bfl_single_file(tmp_path)  # BFL's own file: no metadata
    assert any("does not record norm_groups, latent_bn_eps, latent_bn_momentum: assumed norm_groups 32" in note
               for note in families.load_source(bfl).notes)


def test_the_teacher_decodes_the_transformed_latent_with_the_sources_own_decoder(tmp_path, shard_url):
    """Issue 31 item 8, the teacher's four mutants: its target must be the --init_from source's own decoder (its
    weights, not a random one's; behind the source's post_quant_conv) applied to the very latent the student
    decodes (after the latent regularisers' transform: --latent_noise_prob 1 moves every latent), and the distill
    term a GradNorm branch (its gradient at the reconstruction has norm --distill_weight, whatever the error's
    size). Checked in one real step of the trainer against the source model built here from its folder."""
    import common
    import data
    import vae_trainer
    random_flux2().save_pretrained(tmp_path / "flux2")
    source = families.load_source(str(tmp_path / "flux2"))
    reference = as_model(source).eval()
    args = trainer_args(tmp_path / "flux2", shard_url, tmp_path / "runs", "t", "--train_parts", "decoder",
                        "--vae_decoder_ch", ",".join(map(str, SMALL_DECODER)), "--distill_weight", "0.7",
                        "--latent_noise_prob", "1", "--num_workers", "0", "--memory_check", "false")
    cfg, given, loaded, _ = vae_trainer.prepare_run(args)
    trainer = vae_trainer.Trainer(cfg, common.DistInfo(), loaded)
    try:
        seen = {}
        student_decode, objective_forward = trainer.vae.decode, trainer.objective.forward

        def decode(z):
            seen["z"] = z.detach().clone()
            return student_decode(z)

        def forward(batch):
            seen["teacher"], seen["recon"] = batch.teacher, batch.recon
            terms = trainer.objective.terms(batch, torch.ones(()))
            seen["distill"] = next(t for t in terms if t.name == "distill")
            return objective_forward(batch)
        trainer.vae.decode, trainer.objective.forward = decode, forward
        batch = next(trainer.loader)
        trainer.loader.close()
        trainer.loader = data.FixedBatches([batch])
        trainer.train_step()
        with torch.no_grad():
            mean = reference.encode(data.to_model_input(batch, torch.device("cpu"), trainer.channels_last))
            expected = reference.decode(seen["z"])
        assert not torch.allclose(seen["z"], mean, atol=1e-3)  # the transform moved the latent
        assert torch.equal(seen["teacher"], expected.float())
        recon = seen["recon"]
        (grad,) = torch.autograd.grad(seen["distill"].value, recon, retain_graph=True)
        assert torch.linalg.vector_norm(grad).item() == pytest.approx(0.7, rel=1e-4)
        assert seen["distill"].balanced and seen["distill"].weight == 0.7
    finally:
        trainer.close()


@pytest.mark.process
def test_a_narrower_decoder_distilled_from_the_released_one_trains_and_exports(tmp_path, shard_url, capsys):
    """--vae_decoder_ch (BFL's small decoder, at this test's width) with --distill_weight: the decoder starts fresh
    behind the released encoder, the teacher term (loss/distill) is logged and counted, the encoder and bn stay the
    source's, and the export is an AutoencoderKLFlux2 with decoder_block_out_channels that decodes as ours does."""
    import vae_trainer
    random_flux2().save_pretrained(tmp_path / "flux2")
    source = families.load_source(str(tmp_path / "flux2"))
    runs = tmp_path / "runs"
    widths = ",".join(map(str, SMALL_DECODER))
    assert vae_trainer.main(trainer_args(tmp_path / "flux2", shard_url, runs, "small", "--train_parts", "decoder",
                                         "--vae_decoder_ch", widths, "--distill_weight", "1", "--num_workers",
                                         "0")) == 0
    out = capsys.readouterr().out
    assert f"a decoder of widths {widths} (fresh)" in out and "distilling from the decoder of" in out
    records = [json.loads(line) for line in open(runs / "small" / "metrics.jsonl")]
    assert all(r["loss/distill"] > 0 for r in records)
    assert records[-1]["loss/total"] == pytest.approx(sum(
        records[-1][f"loss/{k}"] * w for k, w in (("pooled_mse", 1), ("lowpass_mse", 1), ("kl", 0.003),
                                                  ("distill", 1))), rel=1e-5)
    ckpt = final_checkpoint(runs, "small")
    assert ckpt["training"]["vae"]["decoder.conv_in.weight"].shape[0] == SMALL_DECODER[-1]
    kept = [k for k in source.state if not k.startswith(("decoder.", "post_quant_conv."))]
    assert all(torch.equal(ckpt["training"]["vae"][k], source.state[k]) for k in kept)
    assert export.main(["--ckpt", str(runs / "small"), "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["decoder_block_out_channels"] == list(SMALL_DECODER)
    ours = AutoEncoder(AutoEncoderParams.from_dict(ckpt["run"]["model_params"]))
    ours.load_state_dict(ckpt["training"]["vae"])
    assert_computes_like(ours, load_flux2(tmp_path / "out"))


@pytest.mark.process
def test_a_narrow_decoder_for_a_run_of_the_wide_one_and_a_teacher_without_its_source_are_refused(tmp_path,
                                                                                                shard_url, capsys):
    """A run directory holding the wide decoder's checkpoints cannot be continued with a narrower decoder (its
    weights would not fit: one line naming the field); --distill_weight without a frozen encoder has no latent the
    teacher and the student share."""
    import vae_trainer
    random_flux2().save_pretrained(tmp_path / "flux2")
    runs = tmp_path / "runs"
    args = trainer_args(tmp_path / "flux2", shard_url, runs, "wide", "--train_parts", "decoder", "--num_workers", "0",
                        "--max_steps", "1")
    assert vae_trainer.main(args) == 0
    capsys.readouterr()
    assert vae_trainer.main(args + ["--max_steps", "2", "--vae_decoder_ch", ",".join(map(str, SMALL_DECODER))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was written with a different architecture (vae_decoder_ch: '' -> '32,64,96,96')" \
        in err[0], err
    assert vae_trainer.main(trainer_args(tmp_path / "flux2", shard_url, runs, "other", "--distill_weight", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --distill_weight needs --init_from (the teacher is its decoder) and --train_parts decoder "
                   "(the teacher decodes the same latent as the decoder that trains)"]


def photo_folders(root) -> tuple[str, str]:
    """scikit-image's photos split as the demo splits them: whole photos held out, none a crop of a training one."""
    import skimage

    import shards
    src = os.path.join(os.path.dirname(skimage.__file__), "data")
    folders = []
    for name, photos in (("train", [p for p in shards.DEMO_PHOTOS if p not in shards.DEMO_TEST]),
                         ("heldout", shards.DEMO_TEST)):
        os.makedirs(os.path.join(root, name))
        for photo in photos:
            shutil.copy(os.path.join(src, photo), os.path.join(root, name, photo))
        folders.append(os.path.join(root, name))
    return folders[0], folders[1]


def offset_latent_model(seed: int = 3) -> AutoEncoder:
    """A FLUX.2-structured model whose posterior means are far from standard (per channel offsets and scales), as a
    trained encoder's may be after its bn statistics were estimated for another: identity statistics, or mean and
    variance swapped, then leave the pipeline's latents far from zero mean and unit variance."""
    torch.manual_seed(seed)
    vae = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2, 4, 4), num_res_blocks=1, z_channels=32, norm_groups=8,
                                        use_attn=False, posterior="learned", quant_conv=True, latent_bn=True))
    with torch.no_grad():
        scale = torch.linspace(0.5, 4.0, 32)
        vae.quant_conv.weight[:32].mul_(scale.view(-1, 1, 1, 1))
        vae.quant_conv.bias[:32] = scale[torch.randperm(32)] * 2 - 3
    return vae.eval()


@pytest.mark.process
@pytest.mark.timeout(180)
def test_reestimated_statistics_normalise_held_out_latents_in_the_flux2_pipeline(tmp_path, capsys):
    import data as data_lib
    import evaluate
    train, heldout = photo_folders(tmp_path)
    vae = offset_latent_model()
    torch.save({"vae": vae.state_dict(), "model_params": vae.params.to_dict(), "config": {"vae_resolution": 128},
                "step": 7}, tmp_path / "ckpt.pt")
    assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out"), "--dataset_url", train,
                        "--batch_size", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["latent_norm"] == "bn" and summary["latent_bn_images"] == 11
    exported = load_flux2(tmp_path / "out")
    pipe = flux2_pipeline(exported)

    def pipeline_latents(folder: str) -> torch.Tensor:
        x = torch.cat([data_lib.to_model_input(batch, torch.device("cpu"), channels_last=False)
                       for _, batch in data_lib.iter_eval_batches(folder, 128, 4)])
        with torch.no_grad():
            return pipe._encode_vae_image(x, torch.Generator().manual_seed(0)).double()

    seen, unseen = pipeline_latents(train), pipeline_latents(heldout)
    # on the images they were estimated from: zero mean and unit variance per channel, up to float32 and the
    # pipeline's eps (a variance v becomes v / (v + eps))
    running_var = exported.bn.running_var.double()
    assert seen.mean(dim=(0, 2, 3)).abs().max() < 1e-4
    torch.testing.assert_close(seen.var(dim=(0, 2, 3), unbiased=False), running_var / (running_var + 1e-4),
                               rtol=1e-4, atol=0)
    # held-out photos: each channel near zero mean and unit variance (4 photos, 64 positions each)
    channel_mean, channel_std = unseen.mean(dim=(0, 2, 3)), unseen.std(dim=(0, 2, 3))
    with capsys.disabled():
        print(f"\nheld-out per-channel |mean| max {channel_mean.abs().max():.3f}, std {channel_std.min():.3f}.."
              f"{channel_std.max():.3f}; all channels: mean {unseen.mean():.3f}, std {unseen.std():.3f}")
    assert channel_mean.abs().max() < 0.6 and 0.6 < channel_std.min() and channel_std.max() < 1.6
    assert unseen.mean().abs() < 0.2 and 0.8 < unseen.std() < 1.25
    # what the statistics are: BatchNorm's own batch statistics of all the patchified latents at once (its
    # running_var is the unbiased variance, ours the population one)
    stats = evaluate.latent_bn_stats(vae, train, 128, batch_size=4, device=torch.device("cpu"))
    from diffusers import Flux2Pipeline
    x = torch.cat([data_lib.to_model_input(batch, torch.device("cpu"), channels_last=False)
                   for _, batch in data_lib.iter_eval_batches(train, 128, 4)])
    with torch.no_grad():
        patches = Flux2Pipeline._patchify_latents(vae.encode(x))
        batchnorm = torch.nn.BatchNorm2d(128, momentum=1.0, affine=False).train()
        batchnorm(patches)
    n = patches[:, 0].numel()
    torch.testing.assert_close(torch.tensor(stats["running_mean"], dtype=torch.float64), batchnorm.running_mean.double(), rtol=0,
                               atol=1e-5)
    torch.testing.assert_close(torch.tensor(stats["running_var"], dtype=torch.float64) * n / (n - 1), batchnorm.running_var.double(),
                               rtol=1e-4, atol=1e-6)

    # factors do not apply to a model normalised by bn: one line
    for flags in (["--scaling_factor", "0.5"], ["--latent_norm", "per_channel", "--dataset_url", train]):
        assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "o"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "bn statistics" in err and "\n" not in err, err
    # without --dataset_url the statistics go out as the checkpoint holds them, with a note
    assert export.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "as_is")]) == 0
    assert "give --dataset_url to re-estimate them" in capsys.readouterr().err
    assert_same_bn(vae, load_flux2(tmp_path / "as_is"))


# ---------------------------------------------------------------------------------------------- a narrower decoder
@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3", "flux", "flux2"])
def test_narrow_decoder_keeps_the_latent_space_and_exports(tmp_path, family):
    """narrow_decoder_model: the encoder, quant convs and bn bitwise the source's (the same latents as the
    source's diffusers model), the decoder of the given widths; the diffusers export is an AutoencoderKLFlux2
    with decoder_block_out_channels (AutoencoderKL has no decoder widths of its own), carrying the family's factors
    where the family has them, which the family's pipeline reads; both exports load back to the same model."""
    reference = random_family(family)
    reference.save_pretrained(tmp_path / "source")
    source = families.load_source(str(tmp_path / "source"))
    vae = ldm_layouts.narrow_decoder_model(source, SMALL_DECODER)
    assert vae.params.decoder_widths == SMALL_DECODER and vae.params.encoder_channels == ENCODER
    assert vae.decoder.conv_in.weight.shape[0] == SMALL_DECODER[-1]
    assert vae.decoder.conv_out.weight.shape[1] == SMALL_DECODER[0]
    kept = [k for k in source.state if not k.startswith("decoder.")]
    assert any(k.startswith("encoder.") for k in kept) and ("bn.running_var" in kept) == (family == "flux2")
    assert all(torch.equal(vae.state_dict()[k], source.state[k]) for k in kept)
    x = images()
    with torch.no_grad():
        assert torch.equal(vae.encode(x), reference.encode(x).latent_dist.mean)

    ldm_layouts.export_diffusers(vae, str(tmp_path / "out"), 32, source.factors["scaling_factor"],
                            source.factors["shift_factor"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKLFlux2"
    assert config["decoder_block_out_channels"] == list(SMALL_DECODER) and config["block_out_channels"] == list(ENCODER)
    exported = load_flux2(tmp_path / "out")
    assert_computes_like(vae, exported)
    if family == "flux2":
        assert "scaling_factor" not in config
        assert_same_bn(vae, exported)
    else:
        assert (exported.config.scaling_factor, exported.config.shift_factor) == \
            (source.factors["scaling_factor"], source.factors["shift_factor"])
    again = families.load_source(str(tmp_path / "out"))
    assert again.params == vae.params and again.factors == source.factors
    assert all(torch.equal(again.state[k], v) for k, v in vae.state_dict().items())
    path = ldm_layouts.export_single_file(vae, str(tmp_path / "single"))
    single = families.load_source(path, family)
    assert single.params == vae.params and all(torch.equal(single.state[k], v) for k, v in vae.state_dict().items())

    if family == "flux":  # FLUX.1's own pipeline takes the AutoencoderKLFlux2 and encodes with the factors
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxImg2ImgPipeline
        pipe = FluxImg2ImgPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=exported, text_encoder=None,
                                   tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=None)
        with torch.no_grad():
            latents = pipe._encode_vae_image(x, torch.Generator().manual_seed(0))
            sample = exported.encode(x).latent_dist.sample(torch.Generator().manual_seed(0))
        assert torch.equal(latents, (sample - 0.1159) * 0.3611)


def test_narrow_decoder_starts_fresh_or_sliced_from_the_wide_one(tmp_path):
    random_family("flux2").save_pretrained(tmp_path / "source")
    source = families.load_source(str(tmp_path / "source"))
    rng = torch.get_rng_state()
    fresh = ldm_layouts.narrow_decoder_model(source, SMALL_DECODER, "fresh", seed=4)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is untouched
    again = ldm_layouts.narrow_decoder_model(source, SMALL_DECODER, "fresh", seed=4)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in fresh.state_dict().items())
    sliced = ldm_layouts.narrow_decoder_model(source, SMALL_DECODER, "slice")
    decoder = {k: v for k, v in sliced.state_dict().items() if k.startswith("decoder.")}
    for name, narrow in decoder.items():  # every tensor the leading entries of the wide one's
        assert torch.equal(narrow, source.state[name][tuple(slice(0, n) for n in narrow.shape)]), name
    assert torch.equal(decoder["decoder.conv_in.weight"], source.state["decoder.conv_in.weight"][:96])
    assert torch.equal(decoder["decoder.conv_out.weight"], source.state["decoder.conv_out.weight"][:, :32])
    assert all(torch.equal(sliced.state_dict()[k], v) for k, v in source.state.items() if not k.startswith("decoder."))
    with pytest.raises(ValueError, match="needs every decoder width <= the source's"):
        ldm_layouts.narrow_decoder_model(source, (64, 64, 128, 256), "slice")
    with pytest.raises(ValueError, match="must be multiples of the 32 GroupNorm groups"):
        ldm_layouts.narrow_decoder_model(source, (24, 48, 96, 96))
