"""config.py on its own, in-process: the sections and their flags, docs/flags.md's tables generated from them, the
checks that need two flags together (LPIPS' smallest input), the speed switches decided per device, and the
one-line answers to typos. What a continued run keeps is run_setup's (tests/test_run_setup.py)."""
from __future__ import annotations

import dataclasses
import os

import pytest

import common
import config
import flags
import vae_trainer
from conftest import ROOT
import run_setup
import latents
from ae import AutoEncoderParams


def test_every_field_is_in_one_section_and_the_config_is_flat_on_disk():
    """Issue 24: the sections nest (cfg.loss.kl_weight), each typed, with one flag name per field across all of
    them; on disk the config is flat, one key per flag (one flatten/unflatten pair), so a config.json written
    before the sections nested reads back into the same Config."""
    names = [f.name for kind in config.SECTIONS.values() for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) == len(config.FIELD_SECTION)
    cfg = run_setup.parse_config(["--kl_weight", "0.5", "--gan_weight", "0.2", "--dataset_url", "x"])
    assert type(cfg.loss) is config.LossConfig and cfg.loss.kl_weight == 0.5 and cfg.loss.gan_weight == 0.2
    # every loss weight in the loss section (issue 32 item 3), the critic's own settings in the critic's
    assert type(cfg.critic) is config.CriticConfig and not hasattr(cfg.critic, "gan_weight")
    weights = [f.name for kind in config.SECTIONS.values() for f in dataclasses.fields(kind)
               if f.name.endswith("_weight") and kind is not config.LossConfig]
    assert weights == ["lecam_weight", "r1_weight", "scale_equivariance_weight", "vf_weight"]  # the critic's own,
    # and the latent regularisers' (their section says where they act)
    flat = config.flatten(cfg)
    assert list(flat) == names and flat["kl_weight"] == 0.5 and flat["gan_weight"] == 0.2
    assert config.unflatten({**flat, "derived": {}, "init_source": None}) == cfg  # config.json's other keys ignored
    assert config.with_values(cfg, lecam_weight=0.1).critic.lecam_weight == 0.1
    with pytest.raises(TypeError, match="no_such"):
        config.with_values(cfg, no_such=1)
    assert config.ARCH_FIELDS == ("vae_family", "vae_class", "tae_variant", "vae_ch", "vae_ch_mult", "vae_num_res_blocks",
                                  "vae_z_channels", "vae_norm_groups", "do_attn", "posterior", "vae_quant_conv",
                                  "vae_decoder_ch", "vae_latent_bn", "vae_patch_size", "vae_spatial_factor",
                                  "vae_temporal_factor")


def test_docs_flag_tables_are_the_generated_ones():
    """docs/flags.md's tables are flags.flag_tables() verbatim: a new field is a new row (regenerate with
    `python -c "import flags; print(flags.flag_tables())"`), a changed default or help shows here."""
    flags_page = open(os.path.join(ROOT, "docs", "flags.md")).read()
    assert flags.flag_tables() in flags_page


def test_lpips_smallest_input_restricts_the_scale_equivariance_sizes(shard_url):
    """Issue 16 item 5: with LPIPS on and the GAN off, random scale equivariance at 32 px used to decode at 8 and
    12 px, where LPIPS fails mid-run ("Output size is too small"); those sizes are left out, and a config with
    no size left (or a crop below LPIPS' 16 px) is refused in one line."""
    flags = ["--dataset_url", shard_url, "--vae_ch_mult", "1,2,2", "--vae_resolution", "32", "--mse_pool_factor", "1",
             "--scale_equivariance_mode", "random", "--scale_equivariance_prob", "0.5"]
    cfg = run_setup.parse_config(flags)
    cfg.validate()
    factor = AutoEncoderParams.from_config(cfg.model).downsample_factor
    sizes = latents.equivariance_sizes_of(factor, 32, "random", 1, config.min_loss_image_size(cfg))
    assert [s * factor for s in sizes] == [16, 20, 24, 28]
    import torch
    from critics import build_lpips
    lpips = build_lpips(None)
    for size in (16, 12):
        image = torch.zeros(1, 3, size, size)
        if size >= config.LPIPS_MIN_SIZE:
            lpips(image, image)
        else:
            with pytest.raises(RuntimeError, match="too small"):
                lpips(image, image)
    pixel_only = run_setup.parse_config(flags + ["--perceptual_weight", "0"])
    assert [s * factor for s in latents.equivariance_sizes_of(
        factor, 32, "random", 1, config.min_loss_image_size(pixel_only))] == [8, 12, 16, 20, 24, 28]
    with pytest.raises(config.ConfigError, match="at least 16 for LPIPS"):
        run_setup.parse_config(["--dataset_url", shard_url, "--vae_ch_mult", "1,2", "--vae_resolution", "8",
                                "--mse_pool_factor", "1"]).validate()
    with pytest.raises(config.ConfigError, match="at least 16 px"):
        run_setup.check_config(run_setup.parse_config(["--dataset_url", shard_url, "--vae_ch_mult", "1,2",
                                                       "--vae_resolution", "16", "--mse_pool_factor", "1",
                                                       "--scale_equivariance_prob", "0.5"]))


@pytest.mark.parametrize("argv, message", [
    (["--max_step", "10"], "unrecognized arguments: --max_step 10; --max_step: did you mean --max_steps?"),
    (["--max_setps=10"], "--max_setps: did you mean --max_steps?"),
    (["--dataset_url", "shards/00000.tar", "shards/00001.tar", "shards/00002.tar"],
     "unrecognized arguments: shards/00001.tar shards/00002.tar; several paths where one was expected: the shell "
     "expands an unquoted brace or glob pattern; quote it, e.g. --dataset_url 'shards/{00000..00099}.tar'"),
    (["--dataset_url", "no/such/folder"], "--dataset_url no/such/folder: no such directory or file"),
])
def test_typos_get_one_line_that_says_what_to_do(tmp_path, capsys, argv, message):
    """Issue 18 item 5: abbreviations are not flags (argparse took --max_step for --max_steps), a misspelt flag
    gets its likely name, the shell's expansion of an unquoted brace url gets the quoting hint, and a mistyped
    directory is not called a shard."""
    code = vae_trainer.main(["--output_dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert "did you mean" not in err[0] or "--max_st" in err[0]
    assert "quote it" not in err[0] or "00001" in err[0]


@pytest.mark.parametrize("module, argv", [
    ("evaluate", ["--ckpt", "run", "--max_im", "4"]),  # --max_images
    ("export", ["--ckpt", "run", "--out", "x", "--shift", "0.1"]),  # --shift_factor
    ("probe", ["--vae", "a", "--dataset_url", "x", "--test_dataset_url", "y", "--out", "o", "--ste", "3"]),  # --steps
    ("shards", ["make-shards", "src", "dst", "--shard", "5"]),  # --shard_size (python data.py make-shards)
])
def test_every_command_refuses_abbreviated_flags(module, argv, capsys):
    """Not only the trainer: evaluate.py, export.py, probe.py and data.py took an abbreviation for the flag it
    begins, so a typo ran with a value the user did not mean."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    with pytest.raises((common.ConfigError, SystemExit)) as refused:
        parser.parse_args(argv)
    assert f"unrecognized arguments: {argv[-2]}" in str(refused.value) + capsys.readouterr().err
    long_flag = {"evaluate": "--max_images", "export": "--shift_factor", "probe": "--steps", "shards": "--shard_size"}
    full = [long_flag[module] if a == argv[-2] else a for a in argv]
    parser.parse_args(full)  # the whole flag is taken


def test_speed_switches_decide_per_device_and_read_old_runs():
    """--allow_tf32 and --channels_last default to auto, decided per device at start (issue 30): TF32 on with CUDA
    (fp32 storage and accumulation), the VAE NCHW with CUDA (PyTorch's CUDA GroupNorm copies channels_last inputs)
    and channels_last on a CPU, the loss networks channels_last unless false. `--allow_tf32` alone is true, as when
    it was a plain bool, and a config.json written then (JSON true/false) reads back, without a 'changed' note."""
    import torch
    speed = run_setup.parse_config(["--dataset_url", "x"]).speed
    assert (speed.allow_tf32, speed.channels_last) == ("auto", "auto")
    assert speed.on("cuda").tf32 and not speed.on("cpu").tf32
    formats = lambda s, device, frames=0: (s.on(device, frames).memory_format,  # noqa: E731
                                           s.on(device, frames).loss_memory_format)
    assert formats(speed, "cuda") == (torch.contiguous_format, torch.channels_last)
    assert formats(speed, "cpu") == (torch.channels_last, torch.channels_last)
    assert formats(speed, "cpu", 5) == (torch.contiguous_format, torch.channels_last)  # the video VAE's Conv3d
    assert speed.on("cuda").describe() == "fp32 (TF32 on), eager, VAE NCHW"
    assert speed.on("cpu").describe() == "fp32, eager, VAE channels_last"
    given = run_setup.parse_config(["--dataset_url", "x", "--allow_tf32", "--channels_last", "false",
                                 "--precision", "bf16", "--compile"]).speed
    assert (given.allow_tf32, given.channels_last) == ("true", "false")
    assert formats(given, "cpu") == (torch.contiguous_format, torch.contiguous_format)
    assert given.on("cuda").describe() == "bf16 autocast, compiled, VAE NCHW"
    assert not run_setup.parse_config(["--dataset_url", "x", "--allow_tf32", "off"]).speed.on("cuda").tf32
    with pytest.raises(common.ConfigError, match="--channels_last"):
        run_setup.parse_config(["--dataset_url", "x", "--channels_last", "sometimes"])
    old = config.unflatten({"allow_tf32": True, "channels_last": False})
    assert (old.speed.allow_tf32, old.speed.channels_last) == ("true", "false")
    cfg, given_flags = flags.parse_flags(["--dataset_url", "x", "--channels_last", "false"])
    assert run_setup.continuing_note("runs/x", given_flags, {"channels_last": False}, cfg, []) is None


def test_the_config_is_read_once_and_one_precision_is_held_by_every_owner(shard_url, tmp_path, monkeypatch,
                                                                          one_torch_thread):
    """Issue 40 item 13: --vae_ch_mult and --train_resolutions are parsed once per section (ModelConfig.ch_mult,
    DataConfig.stages), not again by each use while a Trainer is built; --precision becomes one config.Precision,
    built at the root and held by every owner (the objective, the critic's owner, what trains the VAE, the memory
    check's shapes), of which no module keeps a second mapping; the flags stay the strings config.json holds, and
    the typed views survive copies (dataclasses.replace parses its own) and pickling (DataLoader workers)."""
    import pickle
    from conftest import TINY
    from objective import Adversary
    calls = {"ch_mult": 0, "schedule": 0}

    def counted(name, parse):
        def parse_counted(text):
            calls[name] += 1
            return parse(text)
        return parse_counted
    import sys
    parsers = (("ch_mult", config.parse_ch_mult), ("schedule", config.parse_schedule))
    for module in list(sys.modules.values()):  # config's, and any module's own import of the parsers
        for name, parser in parsers:
            if getattr(module, parser.__name__, None) is parser:
                monkeypatch.setattr(module, parser.__name__, counted(name, parser))
    cfg = run_setup.parse_config(["--dataset_url", shard_url, "--output_dir", str(tmp_path), *TINY,
                                  "--num_workers", "0", "--evaluate_every_n_steps", "0", "--train_resolutions",
                                  "32;2:32,64", "--do_ganloss", "--discriminator", "patchgan", "--precision", "bf16"])
    run_setup.check_config(cfg)
    assert cfg.model.ch_mult == (1, 2, 2) and cfg.data.stages == [(0, (32,)), (2, (32, 64))]
    assert (cfg.model.vae_ch_mult, cfg.data.train_resolutions) == ("1,2,2", "32;2:32,64")  # the flags, as given
    assert config.flatten(cfg)["vae_ch_mult"] == "1,2,2" and "ch_mult" not in config.flatten(cfg)
    copied = pickle.loads(pickle.dumps(cfg))
    assert copied == cfg and copied.model.ch_mult == (1, 2, 2) and copied.data.stages == cfg.data.stages
    other = config.with_values(cfg, vae_ch_mult="1,2", train_resolutions="")
    assert other.model.ch_mult == (1, 2) and other.data.stages == [] and cfg.model.ch_mult == (1, 2, 2)
    before = dict(calls)
    shapes = []
    monkeypatch.setattr(vae_trainer.memory, "check_every_rank", lambda vae, objective, shape, *a, **k: shapes.extend(
        shape))
    trainer = vae_trainer.Trainer(cfg, common.DistInfo())
    try:
        assert calls == before, (calls, before)  # the Trainer parsed neither string again
        precision = trainer.precision
        assert precision == config.Precision.of("bf16") and not precision.scaled
        assert isinstance(trainer.adversary, Adversary) and shapes
        held = [trainer.speed.precision, trainer.objective.precision, trainer.adversary.precision,
                trainer.training.precision] + [shape.precision for shape in shapes]
        assert all(p is precision for p in held), held
        assert not trainer.training.scaler.is_enabled() and not trainer.adversary.scaler.is_enabled()
    finally:
        trainer.close()
    assert config.Precision.of("fp16").scaled and config.Precision.of("fp16").grad_scaler("cpu").is_enabled()
    with pytest.raises(common.ConfigError, match="--precision"):
        config.Precision.of("fp8")
    # one --precision -> dtype mapping in the code: config.Precision.of's
    for folder in (ROOT, os.path.join(ROOT, "bench")):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and name != "config.py":
                with open(os.path.join(folder, name)) as f:
                    lines = [line for line in f if "bfloat16" in line and "bf16" in line]
                assert not lines, (name, lines)


@pytest.mark.parametrize("extra, message", [
    ([], "--discriminator patchgan3d judges clips: a 3D critic with images only needs --video_frames"),
    (["--critic_trunk", "frozen"], "--critic_trunk frozen needs --discriminator vgg16"),
    (["--diffaug", "color"], "--diffaug draws per image, not per clip: leave it off with --discriminator patchgan3d"),
], ids=["images_only", "frozen_trunk", "diffaug"])
def test_what_the_3d_critic_cannot_take_is_refused_in_one_line_before_any_worker(shard_url, tmp_path, capsys, extra,
                                                                                message):
    """Issue 42 item 4: the 3D critic on an image run, on the frozen trunk (it has none), with DiffAugment (its
    draws are per image: a clip's frames would each get their own): exit 2, one line, no run directory."""
    argv = ["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--do_ganloss", "--discriminator",
            "patchgan3d", "--vgg16_weights", "random", *extra]
    assert vae_trainer.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert os.listdir(tmp_path) == []

def test_a_chunk_plan_is_refused_in_one_line_where_a_clip_cannot_take_it():
    """Issue 42 item 4: --train_time_chunks the clip does not split into, or on what cannot take it, is one line
    before any worker starts (run_setup.check_config: the family's refusal, then the config's)."""
    wan = ["--dataset_url", "x", "--vae_family", "wan", "--vae_temporal_factor", "4", "--video_frames", "17"]
    for plan in ("8,2", "4,1", "0,2", "16,4", "", "0,0"):  # every plan of equal chunks of the 4 latent frames
        run_setup.check_config(run_setup.parse_config(wan + ["--train_time_chunks", plan]))
    assert run_setup.parse_config(wan + ["--train_time_chunks", "8,2"]).speed.time_chunks == (8, 2)
    cases = ((wan + ["--train_time_chunks", "8,3"], "the decoder's chunks of 3 latent frames do not divide the 4 "
                                                    "latent frames after the first of --video_frames 17"),
             (wan + ["--train_time_chunks", "12,1"], "the encoder's chunks of 12 frames do not divide the 4 latent "
                                                     "frames"),
             (wan + ["--train_time_chunks", "6,1"], "the encoder's chunk of 6 frames must be a multiple of the VAE's "
                                                    "temporal factor 4"),
             (wan + ["--train_time_chunks", "8"], "--train_time_chunks must be E,D"),
             (wan + ["--train_time_chunks", "8,2", "--sharding", "fsdp"], "is not tested with --sharding fsdp"),
             (wan + ["--train_time_chunks", "8,2", "--loss_balance", "adaptive"],
              "does not compose with --loss_balance adaptive"),
             (["--dataset_url", "x", "--vae_family", "wan", "--train_time_chunks", "8,2"],
              "chunks are a clip's: it needs --video_frames"),
             (["--dataset_url", "x", "--train_time_chunks", "8,2"], "--vae_family ldm (its model): it takes images"),
             (["--dataset_url", "x", "--vae_family", "diffusers", "--vae_class", "AutoencoderKLWan",
               "--vae_temporal_factor", "4", "--video_frames", "17", "--train_time_chunks", "8,2"],
              "--vae_family diffusers (AutoencoderKLWan): its chunked paths"))
    for args, message in cases:
        with pytest.raises(common.ConfigError, match=None) as refused:
            run_setup.check_config(run_setup.parse_config(args))
        line = str(refused.value)
        assert message in line and "\n" not in line, (args, line)
