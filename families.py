"""The families of autoencoders this trainer builds, loads, trains and exports: the one place that knows them.

    source = families.load_source("Lightricks/LTX-Video/vae")   # which family reads a folder or file, and how
    vae = families.build_model(source.params)                    # or families.named(cfg.model.vae_family).build
    vae.encoder_side(), vae.temporal_factor, families.export(vae, request)   # the model answers; its family writes

Three families:
- `ldm`: ae.py's LDM/FLUX autoencoder (FLUX.1, FLUX.2, SD 1.x/2.x, SDXL, SD3), from flags (a new model) or a source:
  a diffusers AutoencoderKL / AutoencoderKLFlux2 folder, a FLUX/SD single file or a full SD checkpoint (ldm_layouts.py).
- `wan`: wan_ae.py's Wan 2.1 family (Qwen-Image's VAE, Wan 2.1/2.2's): its image model, or with clips its causal video
  model with the explicit temporal cache (wan_layouts.py converts the diffusers folders both ways).
- `diffusers`: any other KL autoencoder diffusers ships, trained through diffusers' own module (diffusers_ae.py: the
  wrapper and the table of classes, each with what it takes and what it refuses).
The native families are reimplementations, bitwise against diffusers, where that buys something measured (an explicit
cache, checkpointing per level, a narrower decoder); every other class trains through the module diffusers keeps.

What the rest of the program asks a family, instead of branching on its name, is about sources: how a source is
read and the model built; the --vae_* flags that show its architecture (config.json, resume checks); how a model is
written back in its layouts (`export`, its writer, and what it refuses of export.py's flags: `check_export`); and
what a run's flags ask that it refuses, in one line (`check`).
What is about a built model (its encoder side, last layer, compression and clip rule, memory plan, shard units,
latent normalisation) the model answers itself (ae.Trainable). tests/test_families.py parses the other modules: no
family name or diffusers class is named outside this file, the native families' layouts (ldm_layouts.py,
wan_layouts.py) and the model modules.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

import diffusers_ae
import layouts
import ldm_layouts
import tae
import wan_ae
import wan_layouts
from ae import AutoEncoder, AutoEncoderParams, Trainable
from common import ConfigError, honour_umask
from config import (LR_TIMES_WIDTH, DataConfig, FinetuneConfig, LossConfig, ModelConfig, OptimConfig, RunConfig,
                    SpeedConfig, downsample_factor_of)
from layouts import ExportRequest, Source, SourceError, check_fields_export, export_by_fields, export_safetensors


class Family:
    """A family's answers; the defaults are the common ones. Subclasses: LDM, Wan, Diffusers (below)."""
    name = ""
    needs_source = True  # the architecture comes from --init_from (or the run's checkpoints), not from flags
    distils = False  # its model can be a --distill_from student

    def reads(self, class_name: str, config: dict | None = None) -> bool:
        """Whether a diffusers folder of `class_name` (and this config) loads into this family."""
        return False

    def load_folder(self, path: str, config: dict, weights: str, init_family: str, video: bool) -> Source:
        raise NotImplementedError

    def params_from_dict(self, d: dict):
        raise NotImplementedError

    model_class: type[Trainable]  # the family's model (ae.Trainable: it answers for itself once built)

    def build(self, params) -> nn.Module:
        return self.model_class(params)

    def architecture(self, model: ModelConfig, source: Source | None, saved):
        """The run's architecture: the checkpoint's (`saved`, a resumed run: what its weights were trained as, even if
        the source's folder changed since), else the source's (a new run)."""
        return saved if saved is not None else source.params

    def arch_flags(self, params) -> dict:
        """The --vae_* values that show the architecture (config.json, the resume checks)."""
        raise NotImplementedError

    def apply_source(self, model: ModelConfig, finetune: FinetuneConfig, given: set[str], source: Source) -> dict:
        """The flags --init_from's source sets once read (run_setup applies them): its architecture's."""
        flag = "--vae_decoder_ch"
        if flag[2:] in given:
            raise ConfigError(f"{flag}: a decoder of other widths is for the LDM family's latent spaces, not "
                              f"{source.path}'s ({self.describe(source.params)})")
        return self.arch_flags(source.params)

    @property
    def time_chunks_refusal(self) -> str:
        """What a chunk plan (--train_time_chunks) is refused with ("": the family's model takes one)."""
        return self.model_class.time_chunks_refusal

    def check_time_chunks(self, speed: SpeedConfig, model: ModelConfig) -> None:
        if self.time_chunks_refusal and any(speed.time_chunks):
            raise ConfigError(f"--train_time_chunks {speed.train_time_chunks}: a clip trained in chunks through "
                              f"an explicit temporal cache is the wan family's video model (wan_ae.py); --vae_family "
                              f"{self.name} ({model.vae_class or 'its model'}): {self.time_chunks_refusal}")

    def check(self, model: ModelConfig, finetune: FinetuneConfig, loss: LossConfig, speed: SpeedConfig,
              data: DataConfig, run: RunConfig) -> None:
        """ConfigError (one line) for what the family cannot do with this run's flags (the sections it reads)."""
        self.check_time_chunks(speed, model)
        if finetune.distill_from and not self.distils:
            raise ConfigError(f"--distill_from: the student is a tiny autoencoder (--vae_family tae), not --vae_family "
                              f"{self.name}'s model")
        refused = [(finetune.last_stage_trains != "all", "--last_stage_trains", "the decoder's levels are the "
                    "LDM family's (ae.py)"),
                   (loss.distill_weight > 0, "--distill_weight", "a narrower decoder is the LDM family's"),
                   (finetune.decoder_init != "fresh", "--decoder_init", "a narrower decoder is the LDM family's")]
        for bad, flag, why in refused:
            if bad:
                raise ConfigError(f"{flag}: {why}, not --vae_family {self.name}'s ({model.vae_class or 'its model'})")

    def settled(self, model: ModelConfig, given: set[str]) -> dict:
        """The flags its architecture implies, made consistent (a new model from flags; run_setup applies them), but
        for those the user gave (`given`: check() refuses what the family cannot take)."""
        return {}

    def student_of(self, teacher: Source, model: ModelConfig) -> dict:
        """--distill_from: the architecture flags of a student of this family for the teacher's latent."""
        raise ConfigError(f"--distill_from: the student is a tiny autoencoder (--vae_family tae), not --vae_family "
                          f"{self.name}'s model")

    def check_student(self, params, arch: dict, teacher_path: str) -> None:
        """--distill_from with --init_from: the released student must fit the teacher's latent (`arch`)."""

    def take_teacher_encoder(self, vae: nn.Module, teacher: Source) -> str:
        """A decoder-only student (--train_parts decoder) of a teacher of its own architecture starts from the
        teacher's encoder (frozen: the latent space is the teacher's). Returns the start line's words ("": none)."""
        return ""

    def describe(self, params) -> str:
        return params.describe()

    def image_channels(self, params) -> tuple[int, int]:
        """(input, output) channels of the images the model reads and writes."""
        return params.in_channels, params.out_ch

    def temporal_factor(self, params) -> int:
        """t of the clips of 1 + t k frames a source's model takes; 0: it takes images only (a built model's own:
        its temporal_factor)."""
        return 0

    def init_weights(self, vae: nn.Module, source: Source, finetune: FinetuneConfig, optim: OptimConfig) -> str:
        """Load the source's weights; returns what the start line says of them beyond the source."""
        vae.load_state_dict(source.state)
        return ""

    def teacher(self, source: Source) -> nn.Module:
        """The source's own model, whose decoder a narrower one is distilled from (--distill_weight)."""
        raise ConfigError(f"--distill_weight: a narrower decoder is the LDM family's, not {self.name}'s")

    # ----------------------------------------------------------------------------- export (the layouts written)
    def check_export(self, vae: nn.Module, request: ExportRequest) -> None:
        """ConfigError (one line) for what export.py's flags ask that this family's writer cannot do, before anything
        is measured or written."""
        if request.format == "released":
            raise ConfigError(f"--format released is the tiny autoencoders' layout (tae.py); "
                              f"{vae.describe()} exports as diffusers, safetensors or "
                              "single_file")

    def export(self, vae: nn.Module, request: ExportRequest) -> dict:
        """export.py's writer: the model written as --format asks, normalised as its pipelines read latents; returns
        the JSON line's fields. The default: the model's own config fields (layouts.export_by_fields)."""
        return export_by_fields(vae, request, self.write_diffusers)

    def write_diffusers(self, vae: nn.Module, out_dir: str, resolution: int, fields: dict,
                        source_config: dict | None, source_path: str | None) -> None:
        raise NotImplementedError


# ============================================================================================
# ldm: ae.py (FLUX.1, FLUX.2, SD, SDXL, SD3)
# ============================================================================================
class LDM(Family):
    name = "ldm"
    params_class = AutoEncoderParams
    needs_source = False
    CLASSES = ("AutoencoderKL", "AutoencoderKLFlux2")

    def reads(self, class_name, config=None):
        return class_name in self.CLASSES

    def load_folder(self, path, config, weights, init_family, video):
        if video:
            raise SourceError(f"{path}: a {config.get('_class_name', 'AutoencoderKL')}, an image VAE: clips "
                              f"(--video_frames) need a video VAE ({VIDEO_HINT})")
        return ldm_layouts.load_ldm_folder(path, config, weights, init_family)

    def params_from_dict(self, d):
        return AutoEncoderParams.from_dict({k: v for k, v in d.items() if k != "family"})

    model_class = AutoEncoder

    def architecture(self, model, source, saved):
        return AutoEncoderParams.from_config(model)  # the flags', which --init_from set from the source

    def arch_flags(self, p):
        return dict(vae_family="ldm", vae_class="", vae_patch_size=1, vae_spatial_factor=0, vae_temporal_factor=0,
                    vae_ch=p.ch, vae_ch_mult=",".join(str(m) for m in p.ch_mult),
                    vae_num_res_blocks=p.num_res_blocks, vae_z_channels=p.z_channels, vae_norm_groups=p.norm_groups,
                    do_attn=p.use_attn, posterior=p.posterior, posterior_var=p.posterior_var,
                    vae_quant_conv=p.quant_conv, do_clamp=False,
                    vae_decoder_ch=",".join(str(c) for c in p.decoder_channels), vae_latent_bn=p.latent_bn,
                    vae_latent_bn_eps=p.latent_bn_eps)

    def apply_source(self, model, finetune, given, source):
        """The source's architecture, but for a --vae_decoder_ch the user gave: a decoder of its own widths for the
        source's latent space, which then trains from the rate of a new decoder of its width when it starts fresh
        (--decoder_init) and no --learning_rate_vae is given (a tenth of that for a fine-tune)."""
        arch = self.arch_flags(source.params)
        if "vae_decoder_ch" in given:
            arch.pop("vae_decoder_ch")
        widths = AutoEncoderParams.from_config(dataclasses.replace(model, **arch)).decoder_widths
        if (widths != source.params.decoder_widths and finetune.decoder_init == "fresh"
                and "learning_rate_vae" not in given):
            arch["learning_rate_vae"] = LR_TIMES_WIDTH / widths[0]  # a new decoder, not a fine-tune
        return arch

    def check(self, model, finetune, loss, speed, data, run):
        self.check_time_chunks(speed, model)
        if model.posterior not in ("constant", "learned"):
            raise ConfigError(f"--posterior {model.posterior}: the LDM family's is constant or learned")
        if model.vae_patch_size != 1:
            raise ConfigError(f"--vae_patch_size {model.vae_patch_size}: the LDM family's encoder reads pixels (1); "
                              "patches are the Wan family's (Wan 2.2)")
        if model.vae_spatial_factor or model.vae_temporal_factor or model.vae_class:
            raise ConfigError("--vae_spatial_factor / --vae_temporal_factor / --vae_class: the LDM family's "
                              "compression is --vae_ch_mult's, and it takes images")

    def init_weights(self, vae, source, finetune, optim):
        """The source's weights; a decoder of other widths than the source's starts as --decoder_init says."""
        widths = vae.params.decoder_widths
        if widths == source.params.decoder_widths:
            vae.load_state_dict(source.state)
            return ""
        vae.load_state_dict(ldm_layouts.narrow_decoder_model(source, widths, finetune.decoder_init,
                                                            optim.seed).state_dict())
        return f"; a decoder of widths {','.join(map(str, widths))} ({finetune.decoder_init})"

    def teacher(self, source):
        wide = AutoEncoder(source.params)
        wide.load_state_dict(source.state)
        return wide

    def check_export(self, vae, request):
        super().check_export(vae, request)
        ldm_layouts.check_export(vae, request)

    def export(self, vae, request):  # (its own writer: the factors or FLUX.2's bn, the diffusers folder or single file)
        return ldm_layouts.export(vae, request)


# ============================================================================================
# wan: wan_ae.py (Qwen-Image's VAE, Wan 2.1/2.2's): the image model, or with clips the video model
# ============================================================================================
class Wan(Family):
    name = "wan"
    params_class = wan_ae.WanParams
    CLASSES = ("AutoencoderKLQwenImage", "AutoencoderKLWan")

    def reads(self, class_name, config=None):
        return class_name in self.CLASSES

    def load_folder(self, path, config, weights, init_family, video):
        return wan_layouts.load_wan_folder(path, config, weights, init_family, video)

    def params_from_dict(self, d):
        return wan_ae.WanParams.from_dict(d)

    model_class = wan_ae.WanAutoEncoder

    def arch_flags(self, p):
        # no GroupNorm (RMS norms: 1 group); the posterior always learned, quant convs always there
        decoder = "" if p.decoder_ch == p.ch else ",".join(str(p.decoder_ch * m) for m in p.ch_mult)
        return dict(vae_family="wan", vae_class="", vae_ch=p.ch, vae_ch_mult=",".join(str(m) for m in p.ch_mult),
                    vae_num_res_blocks=p.num_res_blocks, vae_z_channels=p.z_channels, vae_norm_groups=1,
                    do_attn=True, posterior="learned", vae_quant_conv=True, do_clamp=False, vae_decoder_ch=decoder,
                    vae_latent_bn=False, vae_patch_size=p.patch_size, vae_spatial_factor=0,
                    vae_temporal_factor=self.temporal_factor(p))

    def temporal_factor(self, params):
        return params.temporal_factor if params.video else 0

    def check_export(self, vae, request):
        super().check_export(vae, request)
        check_fields_export(vae, request)

    def write_diffusers(self, vae, out_dir, resolution, fields, source_config, source_path):
        if not os.path.isdir(source_path or ""):
            raise ConfigError(f"--format diffusers writes the source's layout back and keeps its earlier temporal "
                              f"slices: the run's --init_from folder {source_path} is needed and is not there")
        try:
            wan_layouts.export_wan_diffusers(vae, source_path, out_dir, **fields)
        except ValueError as e:
            raise ConfigError(str(e)) from None


# ============================================================================================
# diffusers: any other KL autoencoder, through diffusers' own module (diffusers_ae.py)
# ============================================================================================
class Diffusers(Family):
    name = "diffusers"
    params_class = diffusers_ae.DiffusersParams

    def reads(self, class_name, config=None):
        return class_name in diffusers_ae.CLASSES

    def load_folder(self, path, config, weights, init_family, video):
        source = self._load(path, config)
        if video and not self.temporal_factor(source.params):
            raise SourceError(f"{path}: a {source.params.class_name}, an image VAE: clips (--video_frames) need a "
                              f"video VAE ({VIDEO_HINT})")
        if init_family != "auto":
            source.notes.append(f"--init_family {init_family} ignored: the diffusers config carries the latent "
                                "normalisation")
        return source

    @staticmethod
    def _load(path: str, config: dict) -> Source:
        """A diffusers folder of a class in diffusers_ae.CLASSES: its params measured, its weights read by the class's
        own from_pretrained (in the model's names: "model." + diffusers')."""
        class_name = config.get("_class_name", "")
        try:
            params = diffusers_ae.DiffusersParams.of(class_name, config)
            with diffusers_ae.quiet_diffusers():
                model = diffusers_ae.diffusers_class(class_name).from_pretrained(path, torch_dtype=torch.float32)
        except diffusers_ae.Unfit as e:
            raise SourceError(f"{path}: {e}") from None
        except (OSError, ValueError, RuntimeError) as e:
            raise SourceError(f"{path}: its weights do not load into a {class_name} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]})") from None
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        factors = {"scaling_factor": float(config.get("scaling_factor") or 1.0),
                   "shift_factor": float(config.get("shift_factor") or 0.0),
                   "latents_mean": config.get("latents_mean"), "latents_std": config.get("latents_std")}
        notes = [params.spec.note] if params.spec.note else []
        return Source(path, "diffusers", "", params, state, factors, "", notes,
                      layouts.kept_config(config, class_name))

    def params_from_dict(self, d):
        return diffusers_ae.DiffusersParams.from_dict(d)

    model_class = diffusers_ae.DiffusersAutoEncoder

    def arch_flags(self, p):
        # the LDM flags that do not apply keep neutral values (one level, one group, no quant conv)
        return dict(vae_family="diffusers", vae_class=p.class_name, vae_ch=p.width, vae_ch_mult="1",
                    vae_num_res_blocks=1, vae_z_channels=p.z_channels, vae_norm_groups=1, do_attn=False,
                    posterior=p.posterior, vae_quant_conv=False, do_clamp=False, vae_decoder_ch="",
                    vae_latent_bn=False, vae_patch_size=1, vae_spatial_factor=p.spatial_factor,
                    vae_temporal_factor=p.temporal_factor)

    def check(self, model, finetune, loss, speed, data, run):
        super().check(model, finetune, loss, speed, data, run)
        spec = diffusers_ae.CLASSES[model.vae_class]
        if speed.grad_checkpointing != "none" and not spec.supports_checkpointing(model.vae_class):
            raise ConfigError(f"--grad_checkpointing {speed.grad_checkpointing}: diffusers' {model.vae_class} "
                              "has no gradient checkpointing (use none)")
        if speed.compile:
            raise ConfigError(f"--compile: not tested with diffusers' own modules ({model.vae_class}): leave it off")

    def temporal_factor(self, params):
        return params.temporal_factor

    def check_export(self, vae, request):
        super().check_export(vae, request)
        check_fields_export(vae, request)

    def write_diffusers(self, vae, out_dir, resolution, fields, source_config, source_path):
        vae.set_normalisation(fields)
        vae.save_pretrained(out_dir)
        for name in os.listdir(out_dir):
            if name.startswith(layouts.DIFFUSERS_WEIGHTS.split(".")[0]):
                honour_umask(os.path.join(out_dir, name))


# ============================================================================================
# tae: tae.py's tiny autoencoders (TAESD .. TAEF2, TAESANA, TAEHV), their released layouts and AutoencoderTiny folders
# ============================================================================================
class TAE(Family):
    name = "tae"
    params_class = tae.TAEParams
    distils = True
    needs_source = False  # a new one from flags (--tae_variant, --vae_z_channels), or a student sized by its teacher
    CLASSES = (tae.AUTOENCODER_TINY,)

    def reads(self, class_name, config=None):
        return class_name in self.CLASSES and not tae.tiny_differences(config or {})

    def load_folder(self, path, config, weights, init_family, video):
        return self.load_released(path, video)

    def load_released(self, path: str, video: bool = False) -> Source:
        """A tiny autoencoder in any layout tae.py reads (the released pair, a single file, an AutoencoderTiny
        folder). SourceError: one line."""
        try:
            loaded = tae.load(path)
        except tae.LayoutError as e:
            raise SourceError(str(e)) from None
        if video and not loaded.params.video:
            raise SourceError(f"{path}: {loaded.params.describe()}, an image model: clips (--video_frames) need a "
                              "video TAE (TAEHV's layout: taehv, taew2_1, taew2_2, taehv1_5, taeltx_2)")
        notes = [f"{len(loaded.files)} file{'s' if len(loaded.files) > 1 else ''} of the {loaded.layout} layout: "
                 + ", ".join(os.path.basename(f) for f in loaded.files)]
        return Source(path, loaded.layout, "", loaded.params, loaded.state, loaded.factors, "", notes)

    def params_from_dict(self, d):
        return tae.TAEParams.from_dict(d)

    model_class = tae.TinyAutoEncoder

    def architecture(self, model, source, saved):
        if saved is not None:
            return saved
        if source is not None:
            return source.params
        return self.from_flags(model)

    @staticmethod
    def from_flags(model: ModelConfig) -> tae.TAEParams:
        """A new tiny autoencoder of the --vae_* flags (--tae_variant; hv: --vae_temporal_factor 4 or 8)."""
        video = model.tae_variant == "hv"
        t = model.vae_temporal_factor or (4 if video else 0)
        down = {4: (True, True, False), 8: (True, True, True)}.get(t, ()) if video else ()
        up = {4: (False, True, True), 8: (True, True, True)}.get(t, ()) if video else ()
        try:
            return tae.TAEParams(model.vae_z_channels, model.tae_variant, model.vae_patch_size, down, up)
        except ValueError as e:
            raise ConfigError(f"--tae_variant {model.tae_variant}: {e}") from None

    # A trained tiny autoencoder's fine-tune rate: a fifth of the automatic one (a tenth of a new model's, 5e-5 at its
    # width 64), which on TAEF2 and 72 crops of 8 photos left held-out crops of the same photo set 0.16 dB worse after
    # 150 steps where 1e-5 left them 0.19 dB better (BENCHMARKS.md section 21)
    FINETUNE_RATE = 1e-5

    def apply_source(self, model, finetune, given, source):
        arch = super().apply_source(model, finetune, given, source)
        return arch if "learning_rate_vae" in given else {**arch, "learning_rate_vae": self.FINETUNE_RATE}

    def arch_flags(self, p):
        return dict(vae_family="tae", vae_class="", tae_variant=p.variant, vae_ch=64, vae_ch_mult="1",
                    vae_num_res_blocks=1, vae_z_channels=p.z_channels, vae_norm_groups=1, do_attn=False,
                    posterior="none", vae_quant_conv=False, do_clamp=False, vae_decoder_ch="", vae_latent_bn=False,
                    vae_patch_size=p.patch_size, vae_spatial_factor=p.downsample_factor,
                    vae_temporal_factor=p.temporal_factor)

    def check(self, model, finetune, loss, speed, data, run):
        super().check(model, finetune, loss, speed, data, run)
        ft = finetune
        if model.posterior != "none":
            raise ConfigError(f"--posterior {model.posterior}: a tiny autoencoder's encoder is deterministic (none)")
        if model.tae_variant == "hv" and model.vae_temporal_factor not in (0, 4, 8):
            raise ConfigError(f"--vae_temporal_factor {model.vae_temporal_factor}: a TAEHV pools time by 4 or 8")
        if model.vae_temporal_factor and model.tae_variant != "hv":
            raise ConfigError(f"--vae_temporal_factor {model.vae_temporal_factor}: the tiny autoencoder for clips is "
                              f"--tae_variant hv (TAEHV's layout), not {model.tae_variant}")
        if data.video_frames and model.tae_variant != "hv":
            raise ConfigError(f"--video_frames {data.video_frames}: a {model.tae_variant} tiny autoencoder takes "
                              "images; clips need TAEHV's layout (--tae_variant hv, or --init_from a taehv/taew2_1/... "
                              "file)")
        if ft.train_parts == "decoder" and not (ft.init_from or ft.distill_from or run.load_path):
            raise ConfigError("--train_parts decoder: a new tiny autoencoder's encoder is random, so its latents mean "
                              "nothing; give --init_from (a released TAE whose latent space the decoder learns) or "
                              "--distill_from (a teacher whose latents it learns)")
        if speed.sharding != "ddp":
            raise ConfigError(f"--sharding {speed.sharding}: {tae.TinyAutoEncoder.UNSHARDABLE}")
        self.from_flags(model)  # (an architecture it cannot build: one line)

    def settled(self, model, given):
        implied = self.arch_flags(self.from_flags(model))
        return {k: v for k, v in implied.items() if k not in given}

    def student_of(self, teacher, model):
        """The tiny autoencoder of the teacher's latent: its channels; f8 (flux_2 for FLUX.2's bn-normalised latent,
        as TAEF2), f32 or f8 behind 2x2 pixel patches for f16; hv for clips (patch f/8, time by 4 or 8); a released
        TAE as teacher: its own architecture."""
        if isinstance(teacher.params, tae.TAEParams):
            return self.arch_flags(teacher.params)
        family = of_params(teacher.params)
        flags = family.arch_flags(teacher.params)
        factor = flags["vae_spatial_factor"] or downsample_factor_of(
            dataclasses.replace(model, vae_ch_mult=flags["vae_ch_mult"], vae_patch_size=flags["vae_patch_size"],
                                vae_spatial_factor=0))
        t, z = flags["vae_temporal_factor"], flags["vae_z_channels"]
        where = f"--distill_from {teacher.path} ({family.describe(teacher.params)}: f{factor}"
        try:
            if t:
                if t not in (4, 8) or factor not in (8, 16, 32):
                    raise ValueError(f"t{t}): TAEHV's layout pools time by 4 or 8 at f8, f16 or f32")
                params = self.from_flags(dataclasses.replace(model, tae_variant="hv", vae_z_channels=z,
                                                             vae_patch_size=factor // 8, vae_temporal_factor=t))
            else:
                variant, patch = {8: ("flux_2" if flags.get("vae_latent_bn") else "f8", 1), 16: ("f8", 2),
                                  32: ("f32", 1)}.get(factor, (None, 0))
                if variant is None:
                    raise ValueError("): the tiny autoencoders' layouts are f8, f16 (f8 behind 2x2 patches) and f32")
                params = tae.TAEParams(z, variant, patch)
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"{where}{e}") from None
        return self.arch_flags(params)

    def check_student(self, params, arch, teacher_path):
        mine = self.arch_flags(params)
        keys = ("vae_z_channels", "vae_spatial_factor", "vae_temporal_factor")
        if any(mine[k] != arch[k] for k in keys):
            raise ConfigError(f"--init_from is {params.describe()}, which does not fit --distill_from {teacher_path}'s "
                              f"latent (z{arch['vae_z_channels']}, f{arch['vae_spatial_factor']}"
                              + (f", t{arch['vae_temporal_factor']})" if arch['vae_temporal_factor'] else ")"))

    def take_teacher_encoder(self, vae, teacher):
        if teacher.params != vae.params:
            return ""
        vae.encoder.load_state_dict({k[len("encoder."):]: v for k, v in teacher.state.items()
                                     if k.startswith("encoder.")})
        return f"; the encoder is {teacher.path}'s (frozen)"

    def temporal_factor(self, params):
        return params.temporal_factor

    def teacher(self, source):
        raise ConfigError("--distill_weight: a narrower decoder is the LDM family's; a tiny autoencoder learns from "
                          "a teacher's latents with --distill_from")

    # ----------------------------------------------------------------------------- export
    def check_export(self, vae, request):
        if request.factor_flags or request.statistics:
            raise ConfigError(f"{vae.describe()}: its latents are its diffusion model's already (the "
                              "teacher's pipeline normalisation), so --scaling_factor / --shift_factor / --latent_norm "
                              "/ --dataset_url do not apply")
        if request.format == "single_file":
            raise ConfigError("--format single_file is the LDM/FLUX file; a tiny autoencoder's released layout is "
                              "--format released")

    def export(self, vae, request):
        """Its latents are already those of the diffusion model it serves, so there is no normalisation to write or
        re-estimate. --format released writes the released layout, diffusers an AutoencoderTiny folder (where the
        architecture is one it has), safetensors ours."""
        summary = {**request.summary, "latent_norm": vae.norm_label()}
        source = request.source  # (an AutoencoderTiny folder's factors are kept)
        factors = {"scaling_factor": source.get("scaling_factor", 1.0), "shift_factor": source.get("shift_factor", 0.0)}
        if request.format == "released":
            name = request.name or os.path.basename(os.path.normpath(request.out))
            summary["files"] = self.write_released(vae, request.out, name)
        elif request.format == "diffusers":
            self.write_diffusers(vae, request.out, request.resolution, factors, None, None)
            summary["serves"] = vae.serves()
        else:
            export_safetensors(vae, request.out, request.resolution, step=request.info["step"], **factors)
        return summary

    def write_diffusers(self, vae, out_dir, resolution, fields, source_config, source_path):
        try:
            tae.write_diffusers(vae, out_dir, float(fields.get("scaling_factor") or 1.0),
                                float(fields.get("shift_factor") or 0.0))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in os.listdir(out_dir):
            if name.startswith(layouts.DIFFUSERS_WEIGHTS.split(".")[0]):
                honour_umask(os.path.join(out_dir, name))

    def write_released(self, vae, out_dir: str, name: str) -> list[str]:
        files = tae.write_released(vae, out_dir, name)
        for path in files:
            honour_umask(path)
        return files


LDM_FAMILY, WAN_FAMILY, DIFFUSERS_FAMILY, TAE_FAMILY = LDM(), Wan(), Diffusers(), TAE()
# (the order in which a diffusers folder's class is looked up: a native family before diffusers' own module)
FAMILIES = {f.name: f for f in (LDM_FAMILY, WAN_FAMILY, TAE_FAMILY, DIFFUSERS_FAMILY)}
VIDEO_HINT = "docs/families.md lists the video VAEs"


def named(name: str) -> Family:
    """The family of --vae_family `name`; ConfigError (one line) for an unknown one."""
    if name not in FAMILIES:
        raise ConfigError(f"--vae_family {name!r}: one of {', '.join(FAMILIES)} (set by --init_from)")
    return FAMILIES[name]


def of_params(params) -> Family:
    return FAMILIES[params.family]


def of(vae: nn.Module) -> Family:
    """The family of a built model: for its layout (the writers below); what the model itself is asked is its own
    (ae.Trainable)."""
    return of_params(vae.params)


def check_export(vae: nn.Module, request: ExportRequest) -> None:
    """export.py: ConfigError (one line) for what the flags ask that the model's family does not write."""
    of(vae).check_export(vae, request)


def export(vae: nn.Module, request: ExportRequest) -> dict:
    """export.py: the model written by its family's writer (the normalisation its pipelines read, the layout --format
    names); returns the JSON line's fields."""
    return of(vae).export(vae, request)


def params_from_dict(d: dict):
    """The architecture a checkpoint's or an export's model_params describe (their "family" key; none: ae.py's,
    every checkpoint written before the Wan family existed)."""
    return FAMILIES[d.get("family", "ldm")].params_from_dict(d)


def build_model(params) -> nn.Module:
    """The model of an architecture, of the family it is: the one place that chooses the model class."""
    return of_params(params).build(params)


def loadable() -> str:
    """The diffusers classes that load, in words (the end of a one-line error)."""
    native = [name for family in (LDM_FAMILY, WAN_FAMILY, TAE_FAMILY) for name in family.CLASSES]
    return (f"{', '.join(native)} (native), and through diffusers' own module "
            + ", ".join(c for c in diffusers_ae.CLASSES if c not in native))


def folder_family(path: str, config: dict, asked: str | None = None) -> Family:
    """The family that reads a diffusers folder of this config: the native one where there is one, unless
    --vae_family `asked` names another that reads it (diffusers: any class through its own module)."""
    class_name = config.get("_class_name", "AutoencoderKL")
    family = next((f for f in FAMILIES.values() if f.reads(class_name, config)), None)
    if family is None:
        raise SourceError(f"{path}: a {class_name}, {diffusers_ae.refusal(class_name)}; loadable are {loadable()}")
    if asked is not None and asked != family.name:
        if not named(asked).reads(class_name, config):  # a flag the user gave is never dropped
            raise SourceError(f"{path}: a {class_name}, which --vae_family {asked} does not read (its family: "
                              f"{family.name})")
        return named(asked)
    return family


def load_source(path: str, family: str = "auto", video: bool = False, vae_family: str | None = None) -> Source:
    """A released VAE: a diffusers folder of any family, or an LDM/FLUX single file. `family`: the release of a
    single file (its latent factors); `video`: the run takes clips (the Wan family loads its video model);
    `vae_family`: the family the user asked for (diffusers: a native class through diffusers' own module).
    SourceError: one line."""
    if tae.recognises(path) and vae_family in (None, TAE_FAMILY.name):  # (a folder of .pth files, not diffusers')
        return TAE_FAMILY.load_released(path, video)
    if os.path.isdir(path):
        config, weights = layouts.read_diffusers_folder(path)
        return folder_family(path, config, vae_family).load_folder(path, config, weights, family, video)
    if not os.path.isfile(path):
        raise SourceError(f"{path}: no such file or folder")
    if video:
        raise SourceError(f"{path}: a single file; clips (--video_frames) load a video VAE's diffusers folder "
                          f"({VIDEO_HINT})")
    if vae_family not in (None, LDM_FAMILY.name):  # a flag the user gave is never dropped
        raise SourceError(f"{path}: a single file, which only the LDM family reads: --vae_family {vae_family} "
                          "loads from a diffusers folder (config.json beside the weights)")
    return ldm_layouts.load_single_file(path, family)


def released_tiny(path: str) -> bool:
    """Whether a path holds a tiny autoencoder in a released layout (tae.py), which loads as a source."""
    return tae.recognises(path)


def load_exported_folder(path: str, video: bool = False) -> tuple[nn.Module, dict]:
    """(model in eval mode, its diffusers config) from a diffusers folder written by export.py (any family)."""
    config, _ = layouts.read_diffusers_folder(path)
    source = load_source(path, video=video)
    vae = build_model(source.params)
    vae.load_state_dict(source.state)
    return vae.eval(), config


def our_format_params(config: dict):
    """The params export.py --format safetensors recorded in its config.json (beside the format's own keys: the
    factors, resolution, step)."""
    family = FAMILIES[config.get("family", LDM_FAMILY.name)]
    fields = {f.name for f in dataclasses.fields(family.params_class)} | {"family"}
    return family.params_from_dict({k: v for k, v in config.items() if k in fields})


def frozen_in_words(vae: nn.Module) -> str:
    """What --train_parts decoder freezes, in words (the start line)."""
    names = [name for name, _ in vae.encoder_side()]
    return "the " + " and ".join(names) + (" are" if len(names) > 1 else " is")
