"""The command line of vae_trainer.py, generated from config.py's sections: one flag per field (its help the
field's), grouped by section, never abbreviated; --demo's values; and the flag tables of docs/flags.md
(tests/test_config.py checks that the page holds them: regenerate with `python -c "import flags;
print(flags.flag_tables())"`).

    cfg, given = parse_flags(sys.argv[1:])   # the config as given (automatic values still 0 / -1), the flags given
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from common import OneLineParser, parse_bool
from config import SECTIONS, Config, unflatten


def parse_auto_bool(text: str) -> str:
    return text.lower() if text.lower() == "auto" else str(parse_bool(text)).lower()


# ==============================================================================================================
# The command line: one flag per field, grouped by section
# ==============================================================================================================
# The demo: a tiny f4 model at 64 px that visibly learns in about 5 CPU minutes. Its latent (4 x 4 x 16 x 16
# = 4096 elements per step) takes kl_weight 1/64 = 1/sqrt(4096): the KL strength it was tuned with.
# Without pretrained VGG16 (run_setup.prepare_demo) it trains on pixels only, and a pixel-only step costs about a
# sixth of one with LPIPS and the VGG16 critic (10.2 vs 1.7 img/s, one CPU thread): 900 steps fit where 300 did.
# With VGG16 weights cached the full recipe runs these 900 steps at that cost (a GPU, or --max_steps 300).
# Held-out PSNR (the 4 photos at 64 px): the former demo (300 steps, LPIPS and critic on a random VGG16,
# 32 groups, lr 5e-4, 4x-pooled MSE) 16.4 dB, colours lost; this config 15.9 / 20.1 / 20.7 dB at steps
# 300 / 600 / 900 (EMA 16.5 / 20.1 / 20.7). --vae_norm_groups 8: 32 groups at --vae_ch 32 are one channel
# each, so every norm removes each image's per-channel means (its colour): this config with 32 groups
# reaches 16.9 / 17.4 / 17.6 dB at 300 / 600 / 900, every reconstruction still grey; 8 groups gave the
# colours back (4 groups: 19.0 dB at 600). --mse_pool_factor 1: full-resolution MSE (the pooled one leaves
# detail to LPIPS, which is off here); lr 1e-3 (3e-3: 15.5 dB at 300, pixel-only); --posterior_var 0.01.
DEMO = dict(vae_ch=32, vae_ch_mult="1,2,2", vae_num_res_blocks=1, vae_z_channels=4, vae_norm_groups=8,
            do_attn=False, vae_resolution=64, batch_size=4, shuffle_buffer=64, max_steps=900,
            learning_rate_vae=1e-3, warmup_steps=30, mse_pool_factor=1, posterior_var=0.01,
            do_ganloss=True, disc_start=50, mse_weight=1.0, perceptual_weight=0.5, gan_weight=0.3, kl_weight=1 / 64,
            log_every_n_steps=50, save_every_n_steps=300, evaluate_every_n_steps=300, eval_max_images=16,
            run_name="demo", ema_decay=0.99)
# --demo with the user's --dataset_url (the demo's settings on their images: a small run on a CPU or a small GPU)
# is another run than the demo's: its default run name (run_setup.prepare_demo), so it never continues runs/demo
DEMO_OWN_DATA_RUN = "demo_own_data"


TRAINER_USAGE = """Train a latent-diffusion autoencoder (FLUX-style, constant-variance latent) with torchrun.

    torchrun --nproc_per_node=8 vae_trainer.py --dataset_url 'shards/{00000..01023}.tar' --do_ganloss
    python vae_trainer.py --demo                      # no data of your own needed

Every hyperparameter is a flag; the run directory <output_dir>/<run_name>/ holds config.json, metrics.jsonl,
checkpoints/ and samples/, and a run started again in it resumes where it stopped."""


def build_parser() -> argparse.ArgumentParser:
    """One flag per field, grouped by section; no abbreviations (`--max_step` is not `--max_steps`)."""
    parser = OneLineParser(description=TRAINER_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                           argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for kind in SECTIONS.values():
        group = parser.add_argument_group(kind.GROUP)
        for f in dataclasses.fields(kind):
            meta = f.metadata
            # argparse formats help with %: a literal one (e.g. "25%") must be doubled
            kwargs: dict[str, Any] = dict(help=f"{meta['help']} (default: {f.default})".replace("%", "%%"))
            if f.type in ("bool", bool):
                kwargs.update(nargs="?", const=True, type=parse_bool, metavar="BOOL")
            elif meta.get("auto_bool"):
                kwargs.update(nargs="?", const="true", type=parse_auto_bool, metavar="auto|BOOL")
            else:
                kwargs["type"] = {"int": int, "float": float, "str": str}.get(f.type, f.type)
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_flags(argv: list[str] | None = None) -> tuple[Config, set[str]]:
    """The config as given (automatic values still 0 / -1) and the names of the flags the user gave (argparse
    leaves the others out: SUPPRESS). run_setup.prepare_run turns it into the run's config."""
    given = vars(build_parser().parse_args(argv))
    values = dict(DEMO) if given.get("demo") else {}
    values.update(given)
    return unflatten(values), set(given)


def flag_tables() -> str:
    """The flag tables of docs/flags.md, one per section, from the fields' defaults and help."""
    out = []
    for kind in SECTIONS.values():
        out += [f"#### {kind.TITLE}", "", "| flag | default | what it does |", "| --- | --- | --- |"]
        for f in dataclasses.fields(kind):
            default = '""' if f.default == "" else f.default
            choices = " (" + r" \| ".join(f.metadata["choices"]) + ")" if f.metadata["choices"] else ""
            out.append(f"| `--{f.name}` | `{default}` | {f.metadata['help']}{choices} |")
        out.append("")
    return "\n".join(out)
