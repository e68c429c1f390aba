"""The tae section (issue 47): the released TAEF2 (tests/fixtures/taef2) as a fine-tune's start and as a teacher,
with real commands (vae_trainer.py, evaluate.py), on real photos split by photo.

Fine-tune. 128 px crops of one photo set (--tae_photos, e.g. mate-backgrounds' nature photos): 72 random crops of
its first 8 photos to train on, a 4x4 grid of crops of each of the next 2 to validate on (the run's in-loop
evaluation, which --best_metric keeps the best step by), and of the last 2 to test on; another kind: a 3x3 grid of
scikit-image's photos. Each case trains --tae_steps steps from TAEF2 and is measured on the test and other crops,
its final EMA weights and its best checkpoint, against the release's own numbers.

Student. A decoder trained from scratch for TAEF2's latent space (--distill_from TAEF2 --train_parts decoder: the
encoder is TAEF2's, frozen), held-out PSNR against steps, against TAEF2's own decoder.
"""
from __future__ import annotations

import glob
import json
import os
import random
import sys

from PIL import Image

from bench.harness import HERE, trainer_argv
from bench.report import Report
from bench.runs import run_logged, wait_logged

TAEF2 = os.path.join(HERE, "tests", "fixtures", "taef2")
SIZE = 128
# What every fine-tune case shares: 128 px, batch 4 (the plain loop), evaluation every 25 steps on the
# validation crops, pixel losses (no pretrained VGG16 here: LPIPS off, as the demo does without it; pooled MSE at
# full resolution)
COMMON = dict(vae_resolution=SIZE, batch_size=4, perceptual_weight=0.0, mse_pool_factor=1, shuffle_buffer=72,
              evaluate_every_n_steps=25, eval_max_images=32, save_every_n_steps=25, keep_last_k=2,
              log_every_n_steps=25, vgg16_weights="random", inception_weights="none", wandb_mode="disabled",
              num_workers=1, num_threads=1)
# The cases: the plain PyTorch loop (plain MSE, lr 1e-4, no EMA, no warm-up, the final weights); 5e-5, the
# general rule's rate for a fine-tune (a tenth of a new model's at the TAE's width 64); then 1e-5, the tae family's
# default for a fine-tune (families.TAE.FINETUNE_RATE, chosen from this table), decoder only and whole, with and
# without the PatchGAN critic (EMA 0.999 and the best checkpoint kept, as by default)
CASES = {
    "plain_mse_lr1e-4": dict(train_parts="decoder", learning_rate_vae=1e-4, ema_decay=0.0, warmup_steps=0,
                             loss_balance="none", lowpass_mse_weight=0.0),
    "lr5e-5_decoder": dict(train_parts="decoder", learning_rate_vae=5e-5),
    "lr1e-5_decoder": dict(train_parts="decoder", learning_rate_vae=1e-5),
    "lr1e-5_decoder_gan": dict(train_parts="decoder", learning_rate_vae=1e-5, do_ganloss=True,
                               discriminator="patchgan", disc_start=0),
    "lr1e-5_whole": dict(train_parts="all", learning_rate_vae=1e-5),
    "lr1e-5_whole_gan": dict(train_parts="all", learning_rate_vae=1e-5, do_ganloss=True, discriminator="patchgan",
                             disc_start=0),
}


# ------------------------------------------------------------------------------------------- data
def resized(path: str, short: int) -> Image.Image:
    image = Image.open(path).convert("RGB")
    scale = short / min(image.size)
    return image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC,
                        reducing_gap=3.0)


def grid_crops(image: Image.Image, n: int) -> list[Image.Image]:
    xs = [round(i * (image.width - SIZE) / (n - 1)) for i in range(n)]
    ys = [round(i * (image.height - SIZE) / (n - 1)) for i in range(n)]
    return [image.crop((x, y, x + SIZE, y + SIZE)) for y in ys for x in xs]


def make_crops(photos: str, root: str) -> dict[str, str]:
    """Folders of 128 px crops: train (72 random crops of the first 8 photos, sorted by name, each resized to 512 px on
    its shorter side), val and test (a 4x4 grid of the next 2 and the last 2), other (a 3x3 grid of scikit-image's
    colour photos at 384 px). Returns {part: folder}."""
    import numpy as np
    from skimage import data
    names = sorted(p for p in glob.glob(os.path.join(photos, "*")) if p.lower().endswith((".jpg", ".jpeg", ".png")))
    if len(names) < 12:
        raise SystemExit(f"--tae_photos {photos}: 12 photos needed (8 to train on, 2 to validate, 2 to test), found "
                         f"{len(names)}")
    split = {"train": names[:8], "val": names[8:10], "test": names[10:12]}
    rng, folders = random.Random(0), {}
    for part, paths in split.items():
        folders[part] = os.path.join(root, part)
        os.makedirs(folders[part], exist_ok=True)
        for path in paths:
            image = resized(path, 512)
            crops = ([image.crop((x, y, x + SIZE, y + SIZE)) for x, y in
                      [(rng.randint(0, image.width - SIZE), rng.randint(0, image.height - SIZE)) for _ in range(9)]]
                     if part == "train" else grid_crops(image, 4))
            for i, crop in enumerate(crops):
                crop.save(os.path.join(folders[part], f"{os.path.splitext(os.path.basename(path))[0]}_{i:02d}.png"))
    folders["other"] = os.path.join(root, "other")
    os.makedirs(folders["other"], exist_ok=True)
    for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina"):
        pixels = np.array(getattr(data, name)())[..., :3]
        whole = os.path.join(root, f"{name}.png")
        Image.fromarray(pixels).save(whole)
        for i, crop in enumerate(grid_crops(resized(whole, 384), 3)):
            crop.save(os.path.join(folders["other"], f"{name}_{i:02d}.png"))
    return folders


# ------------------------------------------------------------------------------------------- measuring
def evaluated(ckpt: str, folder: str, log: str, env: dict, *extra: str) -> dict:
    """evaluate.py's PSNR and SSIM of a checkpoint (or the release) on a folder of crops."""
    out = log[:-len(".log")]
    cmd = [sys.executable, "evaluate.py", "--ckpt", ckpt, "--dataset_url", folder, "--resolution", str(SIZE),
           "--vgg16_weights", "none", "--inception_weights", "none", "--out", out, *extra]
    wait_logged({f"evaluate {os.path.basename(out)}": run_logged(cmd, log, env)})
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    return {"psnr": metrics["psnr"], "ssim": metrics["ssim"]}


def curve(run_dir: str, key: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def best_record(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "checkpoints", "best")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def bench_tae(args, tmp, report: Report) -> dict:
    root = args.tae_runs_dir or os.path.join(tmp, "tae")
    os.makedirs(root, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    folders = make_crops(args.tae_photos, os.path.join(root, "crops"))
    parts = ("test", "other", "val", "train")
    report.line(f"  crops of {args.tae_photos}: " + ", ".join(f"{p} {len(os.listdir(folders[p]))}" for p in parts))
    release = {p: evaluated(TAEF2, folders[p], os.path.join(root, f"eval_release_{p}.log"), env) for p in parts}
    cases = {name: CASES[name] for name in args.tae_cases.split(",")}
    procs = {}
    for name, flags in cases.items():
        if os.path.isfile(os.path.join(root, name, "checkpoints", f"step_{args.tae_steps:08d}.pt")):
            continue  # a finished run of --tae_runs_dir
        argv = trainer_argv({**COMMON, **flags, "init_from": TAEF2, "dataset_url": folders["train"],
                             "test_dataset_url": folders["val"], "max_steps": args.tae_steps, "output_dir": root,
                             "run_name": name, "seed": args.seed})
        procs[name] = run_logged([sys.executable, "vae_trainer.py", *argv], os.path.join(root, f"{name}.log"), env)
    student = f"student_{args.tae_student_steps}"
    if args.tae_student_steps and not os.path.isfile(os.path.join(root, student, "checkpoints",
                                                                  f"step_{args.tae_student_steps:08d}.pt")):
        every = max(1, args.tae_student_steps // 8)
        argv = trainer_argv({**COMMON, "distill_from": TAEF2, "train_parts": "decoder", "dataset_url": folders["train"],
                             "test_dataset_url": folders["val"], "max_steps": args.tae_student_steps,
                             "evaluate_every_n_steps": every, "save_every_n_steps": every, "output_dir": root,
                             "run_name": student, "seed": args.seed})
        procs[student] = run_logged([sys.executable, "vae_trainer.py", *argv], os.path.join(root, f"{student}.log"),
                                    env)
    report.line(f"  training {len(procs)} runs concurrently (one thread each): {', '.join(procs)} ...")
    wall = wait_logged(procs)

    out = {"config": {"common": COMMON, "cases": cases, "steps": args.tae_steps, "photos": args.tae_photos,
                      "student_steps": args.tae_student_steps},
           "release": release, "runs": {}, "wall_s": wall}
    rows = [["release (TAEF2)", "-", "-", *[f"{release[p]['psnr']:.2f}" for p in ("test", "other")],
             *[f"{release[p]['ssim']:.4f}" for p in ("test", "other")], f"{release['val']['psnr']:.2f}"]]
    for name in cases:
        run_dir = os.path.join(root, name)
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        ema = config["ema_decay"] > 0
        entry = {"learning_rate_vae": config["learning_rate_vae"], "ema": ema,
                 "val_curve": curve(run_dir, "eval_ema/psnr" if ema else "eval/psnr"), "best": best_record(run_dir)}
        final = os.path.join(run_dir, "checkpoints", f"step_{args.tae_steps:08d}.pt")
        entry["final"] = {p: evaluated(final, folders[p], os.path.join(root, f"eval_{name}_final_{p}.log"), env,
                                       *(["--ema"] if ema else [])) for p in ("test", "other", "train")}
        best = entry["best"]
        if best and best.get("checkpoint"):
            entry["kept"] = {p: evaluated(run_dir, folders[p], os.path.join(root, f"eval_{name}_best_{p}.log"), env,
                                          "--best", *(["--ema"] if ema else [])) for p in ("test", "other")}
        else:  # no step beat the release on the validation crops: what the run keeps is the release
            entry["kept"] = {p: release[p] for p in ("test", "other")}
        out["runs"][name] = entry
        for which in ("final", "kept"):
            label = f"{name} ({'final EMA' if ema else 'final'})" if which == "final" else f"{name} (best)"
            kept_step = "-" if which == "final" else (best["step"] if best else "-")
            rows.append([label, f"{entry['learning_rate_vae']:g}", kept_step,
                         *[f"{entry[which][p]['psnr'] - release[p]['psnr']:+.2f}" for p in ("test", "other")],
                         *[f"{entry[which][p]['ssim'] - release[p]['ssim']:+.4f}" for p in ("test", "other")],
                         f"{max(entry['val_curve'].values()) - release['val']['psnr']:+.2f}" if which == "kept"
                         else f"{entry['val_curve'][args.tae_steps] - release['val']['psnr']:+.2f}"])
    report.table(f"TAEF2 fine-tuned {args.tae_steps} steps on 72 crops of 8 photos ({SIZE} px, batch 4); the release's "
                 "numbers, then each case's change: dB of PSNR, SSIM; val = the validation crops the run evaluates "
                 "on", ["case", "lr", "best step", "test PSNR", "other PSNR", "test SSIM", "other SSIM", "val PSNR"],
                 rows)
    if args.tae_student_steps:
        run_dir = os.path.join(root, student)
        val = curve(run_dir, "eval_ema/psnr")
        final = os.path.join(run_dir, "checkpoints", f"step_{args.tae_student_steps:08d}.pt")
        test = evaluated(final, folders["test"], os.path.join(root, f"eval_{student}_test.log"), env, "--ema")
        out["student"] = {"val_curve": val, "test": test, "release_val": release["val"],
                          "release_test": release["test"]}
        report.table(f"A decoder from scratch for TAEF2's latent space (--distill_from TAEF2 --train_parts decoder), "
                     f"validation PSNR (EMA) against steps; TAEF2's own decoder: {release['val']['psnr']:.2f} dB",
                     ["step", "PSNR dB", "minus TAEF2's decoder"],
                     [[step, f"{v:.2f}", f"{v - release['val']['psnr']:+.2f}"] for step, v in sorted(val.items())])
        report.line(f"  test crops after {args.tae_student_steps} steps: {test['psnr']:.2f} dB (TAEF2's decoder "
                    f"{release['test']['psnr']:.2f})")
    report.line("  wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    return out
