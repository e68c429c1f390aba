"""Fine-tuning released VAEs (issue 11): ldm_layouts.py loads each family's diffusers folder and single file and
computes what diffusers computes; --init_from / --train_parts decoder train the decoder only (torchrun, resume);
export keeps the source's latent space and factors; bad sources are one line."""
from __future__ import annotations

import json
import os

import pytest
import torch

import export
import families
import layouts
import ldm_layouts
import vae_trainer
from ae import AutoEncoder, AutoEncoderParams
from conftest import TINY, cut_after, run_cli, run_in_process
import train_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The released configs' structure (4 levels of 1,2,4,4 x the base width, 2 blocks per level, mid attention, 32
# GroupNorm groups) at a quarter of the width (SD/FLUX: 128,256,512,512). Factors as released.
FAMILIES = {
    "sd": dict(latent_channels=4, use_quant_conv=True, use_post_quant_conv=True, scaling_factor=0.18215),
    "sdxl": dict(latent_channels=4, use_quant_conv=True, use_post_quant_conv=True, scaling_factor=0.13025),
    "sd3": dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305,
                shift_factor=0.0609),
    "flux": dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                 shift_factor=0.1159),
}
STRUCTURE = dict(block_out_channels=(32, 64, 128, 128), layers_per_block=2, norm_num_groups=32,
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
# How each family's single file is laid out: (file name, key prefix, a key of its diffusion model or None)
SINGLE_FILES = {
    "sd": ("vae-ft-mse-840000-ema-pruned.safetensors", "", None),
    "sdxl": ("sd_xl_base_1.0.ckpt", "first_stage_model.",
             "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias"),
    "sd3": ("sd3_medium.safetensors", "first_stage_model.",
            "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"),
    "flux": ("ae.safetensors", "", None),
}
TOL = 1e-5


def perturb_norms(module: torch.nn.Module) -> None:
    """GroupNorm affines off (1, 0): a swapped or dropped norm would then show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))


def random_diffusers_vae(family: str, seed: int = 0, **overrides):
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    model = AutoencoderKL(**{**STRUCTURE, **FAMILIES[family], **overrides}).eval()
    perturb_norms(model)
    return model


def write_single_file(family: str, folder, seed: int = 1) -> tuple[str, dict]:
    """Random LDM/FLUX-named weights of the family's structure, written as its single file; returns the path and
    the diffusers AutoencoderKL config that diffusers' own LDM converter maps them into."""
    config = {**STRUCTURE, **FAMILIES[family]}
    quant = config["use_quant_conv"]
    torch.manual_seed(seed)
    params = AutoEncoderParams(ch=32, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=config["latent_channels"],
                               posterior="learned", quant_conv=quant)
    vae = AutoEncoder(params)
    perturb_norms(vae)
    name, prefix, marker = SINGLE_FILES[family]
    state = {prefix + k: v.detach().clone() for k, v in vae.state_dict().items()}
    if marker:
        state[marker] = torch.zeros(4)
    path = os.path.join(folder, name)
    if path.endswith(".ckpt"):
        torch.save({"state_dict": state, "global_step": 1}, path)
    else:
        from safetensors.torch import save_file
        save_file(state, path)
    return path, config


def diffusers_from_ldm_file(path: str, config: dict):
    """The reference for a single file: diffusers' own LDM -> AutoencoderKL conversion (single_file_utils)."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    state = layouts.read_weights(path)
    model = AutoencoderKL(**config).eval()
    model.load_state_dict(convert_ldm_vae_checkpoint(state, model.config), strict=True)
    return model


@torch.no_grad()
def max_errors(ours: AutoEncoder, theirs) -> dict[str, float]:
    torch.manual_seed(5)
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    dist = theirs.encode(x).latent_dist
    mean, logvar = ours.eval().encode_moments(x)
    return {"mean": (mean - dist.mean).abs().max().item(), "logvar": (logvar - dist.logvar).abs().max().item(),
            "decode": (ours.decode(dist.mean) - theirs.decode(dist.mean).sample).abs().max().item()}


def as_model(source: layouts.Source) -> AutoEncoder:
    vae = AutoEncoder(source.params)
    vae.load_state_dict(source.state)
    return vae.eval()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_loads_like_diffusers(family, tmp_path):
    """The family's diffusers folder and single file load into ae.AutoEncoder with the architecture and factors
    read from them; posterior mean, log-variance and decode match diffusers within 1e-5; exporting back (diffusers
    with quant convs where the source had them, and the single file) gives the same model and factors."""
    reference = random_diffusers_vae(family)
    reference.save_pretrained(tmp_path / "folder")
    folder = families.load_source(str(tmp_path / "folder"))
    quant = FAMILIES[family]["use_quant_conv"]
    assert folder.params.quant_conv == quant and folder.params.posterior == "learned"
    assert folder.params.z_channels == FAMILIES[family]["latent_channels"] and folder.params.ch_mult == (1, 2, 4, 4)
    assert folder.factors["scaling_factor"] == FAMILIES[family]["scaling_factor"]
    assert folder.factors["shift_factor"] == FAMILIES[family].get("shift_factor", 0.0)
    errors = {"folder": max_errors(as_model(folder), reference)}

    path, config = write_single_file(family, tmp_path)
    single = families.load_source(path, "sdxl" if family == "sdxl" and path.endswith(".safetensors") else "auto")
    assert single.layout == "single_file" and single.params.quant_conv == quant
    assert single.family == family  # sdxl and sd3 from the full checkpoint's diffusion-model keys
    assert single.factors["scaling_factor"] == FAMILIES[family]["scaling_factor"]
    errors["single_file"] = max_errors(as_model(single), diffusers_from_ldm_file(path, config))

    # back out: diffusers (from_pretrained, strict) and the family's single file
    vae = as_model(folder)
    ldm_layouts.export_diffusers(vae, str(tmp_path / "out"), 32, **{k: folder.factors[k] for k in
                                                                ("scaling_factor", "shift_factor")})
    from diffusers import AutoencoderKL
    exported = AutoencoderKL.from_pretrained(tmp_path / "out", low_cpu_mem_usage=False).eval()
    assert exported.config.use_quant_conv == quant and exported.config.scaling_factor == folder.factors["scaling_factor"]
    errors["export_diffusers"] = max_errors(vae, exported)
    file = ldm_layouts.export_single_file(vae, str(tmp_path / "single_out"))
    again = families.load_source(file, family if family in ("sdxl", "sd3") else "auto")
    assert all(torch.equal(again.state[k], v) for k, v in folder.state.items())
    print(f"\n{family} max abs diff vs diffusers: {json.dumps(errors)}")
    for where, errs in errors.items():
        assert max(errs.values()) < TOL, (where, errs)


def test_latents_mean_and_std_travel_from_the_source_to_the_export(tmp_path):
    """A diffusers config's latents_mean/latents_std (per-channel statistics some VAEs ship) are read with the
    factors and written back by the diffusers export."""
    mean, std = [0.1 * i for i in range(16)], [1.0 + 0.1 * i for i in range(16)]
    random_diffusers_vae("flux", latents_mean=mean, latents_std=std).save_pretrained(tmp_path / "src")
    source = families.load_source(str(tmp_path / "src"))
    assert source.factors["latents_mean"] == mean and source.factors["latents_std"] == std
    ldm_layouts.export_diffusers(as_model(source), str(tmp_path / "out"), 32, source.factors["scaling_factor"],
                            source.factors["shift_factor"], source.factors["latents_mean"],
                            source.factors["latents_std"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["latents_mean"] == mean and config["latents_std"] == std and config["shift_factor"] == 0.1159


def test_a_checkpoint_without_quant_conv_field_loads_as_before():
    """model_params of checkpoints written before quant_conv existed: no quant convs, same state-dict keys."""
    old = {k: v for k, v in AutoEncoderParams(ch=32, ch_mult=(1, 2), z_channels=4).to_dict().items()
           if k != "quant_conv"}
    params = AutoEncoderParams.from_dict(old)
    assert not params.quant_conv
    assert not any("quant_conv" in k for k in AutoEncoder(params).state_dict())


# ---------------------------------------------------------------------------------------------- bad sources
@pytest.mark.timeout(60)
def test_bad_sources_are_one_line(tmp_path, capsys):
    from safetensors.torch import save_file
    save_file({"fc.weight": torch.zeros(4, 4), "fc.bias": torch.zeros(4)}, tmp_path / "resnet.safetensors")
    path, _ = write_single_file("flux", tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    (tmp_path / "truncated.safetensors").write_bytes(data[:len(data) // 2])
    state = layouts.read_weights(path)
    del state["decoder.up.1.block.0.conv2.weight"]
    save_file(state, tmp_path / "missing_key.safetensors")
    state["decoder.up.0.block.3.conv1.weight"] = torch.zeros(1)  # a 4th block the encoder does not have
    save_file(state, tmp_path / "extra_key.safetensors")
    random_diffusers_vae("flux").save_pretrained(tmp_path / "no_weights")
    os.remove(tmp_path / "no_weights" / layouts.DIFFUSERS_WEIGHTS)
    cases = {"resnet.safetensors": "no VAE of the FLUX/SD family in it", "truncated.safetensors": "unreadable",
             "missing_key.safetensors": "decoder.up.1.block.0.conv2.weight", "no_weights": "no weights",
             "extra_key.safetensors": "decoder.up.0.block.3.conv1.weight",
             "nothing_here": "no such file"}
    for name, expected in cases.items():
        rc = vae_trainer.main(["--init_from", str(tmp_path / name), "--dataset_url", str(tmp_path)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("error: --init_from") and "\n" not in err and expected in err, (name, err)


# ------------------------------------------------------------------------------------ decoder-only training
def tiny_sd_source(folder) -> str:
    """A tiny SD-layout VAE (quant convs, learned posterior, f4) as a diffusers folder, for 64 px CLI runs."""
    model = random_diffusers_vae("sd", block_out_channels=(32, 64, 64), norm_num_groups=8,
                                 down_block_types=("DownEncoderBlock2D",) * 3, layers_per_block=1,
                                 up_block_types=("UpDecoderBlock2D",) * 3)
    model.save_pretrained(folder)
    return str(folder)


def finetune_args(url, source, out, run, steps, save, *extra):
    tiny = [a for a in TINY]  # keep TINY's data/runtime flags; the architecture comes from the source
    for flag in ("--vae_ch", "--vae_ch_mult", "--vae_num_res_blocks", "--vae_z_channels", "--do_attn"):
        i = tiny.index(flag)
        del tiny[i:i + 2]
    return ["--dataset_url", url, "--init_from", source, "--train_parts", "decoder", "--output_dir", str(out),
            "--run_name", run, "--max_steps", str(steps), "--save_every_n_steps", str(save),
            "--log_every_n_steps", "2", "--evaluate_every_n_steps", "0", "--keep_last_k", "20",
            "--perceptual_weight", "0", *tiny, *extra]


def _ckpt(out, run, step):
    return torch.load(os.path.join(out, run, "checkpoints", f"step_{step:08d}.pt"), weights_only=True)


@pytest.mark.process
@pytest.mark.timeout(150)
def test_decoder_only_under_torchrun_keeps_the_encoder_and_exports_the_source_latent_space(shard_url, tmp_path,
                                                                                              capsys):
    source_dir = tiny_sd_source(tmp_path / "sd")
    source = families.load_source(source_dir)
    proc = run_cli("vae_trainer.py", finetune_args(shard_url, source_dir, tmp_path, "ft", 4, 4, "--ema_decay", "0.9",
                                                   "--vae_ch", "64"), nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "--vae_ch has no effect with --init_from" in proc.stderr
    ckpt = _ckpt(tmp_path, "ft", 4)
    assert ckpt["run"]["ranks_in_sync"] is True  # every tensor's fingerprint equal across the 2 ranks
    frozen = [k for k in source.state if k.startswith(("encoder.", "quant_conv."))]
    trained = [k for k in source.state if k not in frozen]
    for k in frozen:  # bitwise the loaded weights, in the weights and in the EMA
        assert torch.equal(ckpt["training"]["vae"][k], source.state[k]), k
        assert torch.equal(ckpt["training"]["ema"][k], source.state[k]), k
    assert all(not torch.equal(ckpt["training"]["vae"][k], source.state[k]) for k in trained
               if k.endswith("weight") and "norm" not in k)
    # the encoder is not in the optimizer (AdamW would skip it for want of gradients, but it should not hold it)
    assert len(ckpt["training"]["optimizer"]["param_groups"][0]["params"]) == len(trained)
    assert ckpt["run"]["init_source"]["path"] == source_dir and ckpt["run"]["config"]["train_parts"] == "decoder"
    config = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert config["init_from"] == source_dir and config["init_source"]["scaling_factor"] == 0.18215
    assert config["vae_quant_conv"] is True and config["vae_ch"] == 32  # from the source, not --vae_ch 64

    assert export.main(["--ckpt", str(tmp_path / "ft"), "--out", str(tmp_path / "export")]) == 0
    assert "keeping its latent factors" in capsys.readouterr().err
    from diffusers import AutoencoderKL
    exported = AutoencoderKL.from_pretrained(tmp_path / "export", low_cpu_mem_usage=False).eval()
    original = AutoencoderKL.from_pretrained(source_dir, low_cpu_mem_usage=False).eval()
    assert exported.config.scaling_factor == 0.18215 and exported.config.use_quant_conv
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():  # the same latent space: the exported encoder is the source's
        assert torch.equal(exported.encode(x).latent_dist.mean, original.encode(x).latent_dist.mean)
    # a factor given as a flag wins; the other stays the source's
    assert export.main(["--ckpt", str(tmp_path / "ft"), "--out", str(tmp_path / "shifted"), "--shift_factor",
                        "0.25"]) == 0
    config = json.loads((tmp_path / "shifted" / "config.json").read_text())
    assert (config["scaling_factor"], config["shift_factor"]) == (0.18215, 0.25)
    assert export.main(["--ckpt", str(tmp_path / "ft"), "--out", str(tmp_path / "single"),
                        "--format", "single_file"]) == 0
    back = families.load_source(str(tmp_path / "single" / "ae.safetensors"), "sd")
    assert all(torch.equal(back.state[k], ckpt["training"]["vae"][k]) for k in ckpt["training"]["vae"])


@pytest.mark.process
@pytest.mark.timeout(150)
def test_decoder_only_resume_equals_uninterrupted(shard_url, tmp_path, capfd, one_torch_thread):
    """The uninterrupted run's step-2 checkpoint continued (conftest.cut_after; in-process: the runs' own main)."""
    import vae_trainer
    source_dir = tiny_sd_source(tmp_path / "sd")
    ref = run_in_process(vae_trainer.main, finetune_args(shard_url, source_dir, tmp_path, "ref", 4, 2), capfd)
    assert ref.returncode == 0, ref.stderr[-2000:]
    cut_after(tmp_path / "ref", tmp_path / "cut", 2)
    os.rename(source_dir, tmp_path / "moved")  # a resume needs the run's architecture, not the source
    again = run_in_process(vae_trainer.main, finetune_args(shard_url, source_dir, tmp_path, "cut", 4, 2), capfd)
    assert again.returncode == 0 and "at step 2" in again.stdout, again.stderr[-2000:]
    a, b = _ckpt(tmp_path, "ref", 4), _ckpt(tmp_path, "cut", 4)
    for key in ("vae", "ema"):
        assert a["training"][key].keys() == b["training"][key].keys()
        assert all(torch.equal(a["training"][key][k], b["training"][key][k]) for k in a["training"][key]), key
    for pid, state in a["training"]["optimizer"]["state"].items():
        assert all(torch.equal(v, b["training"]["optimizer"]["state"][pid][n]) for n, v in state.items())
    assert b["run"]["init_source"] == a["run"]["init_source"] and b["run"]["init_source"]["path"] == source_dir
    # the optimizer holds the decoder only: a resume that would train the whole VAE is refused, in one line
    switch = run_in_process(vae_trainer.main, finetune_args(shard_url, source_dir, tmp_path, "cut", 6, 2,
                                                            "--train_parts", "all"), capfd)
    assert switch.returncode != 0 and "trained with --train_parts decoder" in switch.stderr, switch.stderr[-2000:]
    assert "Traceback" not in switch.stderr


def test_decoder_only_with_checkpointing_and_bf16_gives_the_same_decoder_gradients():
    """--train_parts decoder with --grad_checkpointing decoder under bf16: exact (the same gradients as without
    checkpointing), no gradient for any frozen parameter, and the frozen parts stay in eval mode."""
    torch.manual_seed(0)
    params = AutoEncoderParams(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, norm_groups=8,
                               posterior="learned", quant_conv=True)
    grads = []
    for mode in ("none", "decoder"):
        vae = AutoEncoder(params)
        vae.load_state_dict(AutoEncoder(params).state_dict() if not grads else first)
        first = vae.state_dict()
        vae.set_grad_checkpointing(mode)
        model = train_state.TrainingForward(vae, frozen_encoder=True)
        vae.train()
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            recon, mean, logvar, _, _, _ = model(torch.rand(2, 3, 32, 32))
        recon.float().square().mean().backward()
        assert not mean.requires_grad and not vae.encoder.training and not vae.quant_conv.training
        assert all(p.grad is None for p in list(vae.encoder.parameters()) + list(vae.quant_conv.parameters()))
        grads.append({n: p.grad for n, p in vae.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("form", ["checkpoint", "export_safetensors", "bare_state_dict"])
def test_load_path_refuses_weights_of_another_group_count(tmp_path, form):
    """Weights of a 32-group model fit a 16-group one tensor for tensor, yet compute something else: where the
    file says its group count, --load_path refuses in one line naming both counts and the flag; a bare state dict
    says nothing and loads (its shapes fit)."""
    from checkpoint import load_vae_weights_into
    from common import ConfigError
    params = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_attn=False)
    trained = AutoEncoder(AutoEncoderParams(**params, norm_groups=32))
    if form == "checkpoint":  # what the trainer writes (checkpoint_state)
        path = str(tmp_path / "step_00000010.pt")
        torch.save({"vae": trained.state_dict(), "model_params": trained.params.to_dict()}, path)
    elif form == "export_safetensors":
        export.export_safetensors(trained, str(tmp_path / "st"), 64, 1.0, 0.0, 10)
        path = str(tmp_path / "st" / export.SAFETENSORS_WEIGHTS)
    else:
        path = str(tmp_path / "vae.pt")
        torch.save(trained.state_dict(), path)
    fine_tune = AutoEncoder(AutoEncoderParams(**params, norm_groups=16))
    if form == "bare_state_dict":
        load_vae_weights_into(fine_tune, path)
        assert all(torch.equal(a, b) for a, b in zip(fine_tune.state_dict().values(), trained.state_dict().values()))
        return
    with pytest.raises(ConfigError) as e:
        load_vae_weights_into(fine_tune, path)
    assert str(e.value) == (f"--load_path {path} was trained with 32 GroupNorm groups, this model has 16: "
                            "add --vae_norm_groups 32")
    same = AutoEncoder(AutoEncoderParams(**params, norm_groups=32))
    load_vae_weights_into(same, path)  # the flag the message names makes it load
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), trained.state_dict().values()))
