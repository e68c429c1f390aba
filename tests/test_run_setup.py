"""run_setup.py, in-process: what a continued run keeps of its start (its whole recipe, its automatic values, the
ones derived again when their basis changed, runs recorded by earlier code), the CPU split between data workers
and torch threads, --demo's values as defaults under the flags given, a dataset of the wrong kind refused at
start-up, and the shuffle buffer by what a sample is."""
from __future__ import annotations

import json
import os

import pytest

import config
import run_setup
from common import ConfigError
from conftest import TINY


# the tiny model without its warm-up and worker count: these tests follow the automatic values
TINY_AUTO = [f for i, f in enumerate(TINY[:-2]) if not {"--num_workers", "--num_threads"} & set(TINY[i - 1:i + 1])]


def finished(tmp_path, shard_url, *flags):
    return run_setup.prepare_run(["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--run_name", "r",
                                 *TINY_AUTO, *flags])


def test_a_continued_run_keeps_the_automatic_values_of_its_start(tmp_path, shard_url):
    """Issue 16 item 4: a 5000-step run resolved warm-up 500 and disc_start 1000; continued with --max_steps
    50000 it keeps them (re-derived they would be 1000 and 10000: the GAN term off for 9000 steps), says what
    changed, and a flag given again wins."""
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "5000", "--do_ganloss")
    assert (cfg.optim.warmup_steps, cfg.loss.disc_start) == (500, 1000) and not notes
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config.public_config(cfg)))
    (run_dir / "checkpoints" / "step_00003000.pt").write_bytes(b"")  # a run that has saved (read by the trainer)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss")
    assert (cfg.optim.warmup_steps, cfg.loss.disc_start, cfg.optim.max_steps) == (500, 1000, 50000)
    assert notes == [f"note: continuing {run_dir} with flags changed since its start: --max_steps 5000 -> 50000"]
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss", "--disc_start", "-1")
    assert cfg.loss.disc_start == 10000 and "--disc_start 1000 -> 10000" in notes[0]  # given again: derived anew
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "50000", "--do_ganloss", "--resume", "never",
                            "--run_name", "r")
    assert cfg.loss.disc_start == 10000  # --resume never: a new run, its own automatic values


def started(tmp_path, shard_url, *flags):
    """A run of these flags that has saved (the config.json and the derivation record the trainer writes)."""
    first = finished(tmp_path, shard_url, *flags)
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**config.public_config(first.cfg), "derived": first.derived}))
    (run_dir / "checkpoints" / "step_00000150.pt").write_bytes(b"")
    return first


def test_a_continued_run_keeps_its_whole_recipe_and_names_every_change(tmp_path, shard_url, photos_dir):
    """Issue 23 item 9: a finished run continued with only --dataset_url and --max_steps keeps every other value it
    was started with (it used to put do_ganloss, critic_trunk and save_every_n_steps back to their defaults, and
    name only the typed flags), and one line names each value that changes."""
    first = started(tmp_path, shard_url, "--do_ganloss", "--critic_trunk", "frozen", "--save_every_n_steps", "50",
                    "--max_steps", "150", "--kl_weight", "0.01")
    cfg, given, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--dataset_url", photos_dir)
    kept = ("do_ganloss", "critic_trunk", "save_every_n_steps", "kl_weight", "learning_rate_vae",
            "learning_rate_disc", "warmup_steps", "disc_start", "num_workers", "num_threads")
    assert {k: run_setup.value(cfg, k) for k in kept} == {k: run_setup.value(first.cfg, k) for k in kept}
    assert (cfg.critic.do_ganloss, cfg.critic.critic_trunk, cfg.run.save_every_n_steps) == (True, "frozen", 50)
    assert notes == [f"note: continuing {tmp_path / 'r'} with flags changed since its start: --dataset_url "
                     f"{shard_url} -> {photos_dir}, --max_steps 150 -> 300"]
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--critic_trunk", "trainable")
    assert cfg.critic.critic_trunk == "trainable" and "--critic_trunk frozen -> trainable" in notes[0]


@pytest.mark.parametrize("critic_flags", [["--critic_trunk", "frozen"], ["--discriminator", "patchgan"]])
def test_an_automatic_value_is_derived_again_when_its_basis_changes(tmp_path, shard_url, critic_flags):
    """Issue 23 item 3: a pixel-only start resolves the critic's learning rate for the trainable VGG16 critic (1e-5);
    continued with --do_ganloss and another critic it is the rate a new run of those flags gets (the VAE's), and the
    line says why. A rate the user gives wins; values that are history (warm-up, disc_start) stay."""
    first = started(tmp_path, shard_url, "--max_steps", "150")
    assert first.cfg.critic.learning_rate_disc == 1e-5 and first.derived["learning_rate_disc"] == \
        "the vgg16 critic with a trainable trunk"
    fresh = run_setup.prepare_run(["--dataset_url", shard_url, "--output_dir", str(tmp_path / "new"), *TINY_AUTO,
                                  "--max_steps", "300", "--do_ganloss", *critic_flags]).cfg
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss", *critic_flags)
    assert cfg.critic.learning_rate_disc == fresh.critic.learning_rate_disc == cfg.optim.learning_rate_vae != 1e-5
    assert f"derived again: --learning_rate_disc 1e-05 -> {cfg.optim.learning_rate_vae} " \
           f"({cfg.critic.describe()}, not the vgg16 critic with a trainable trunk)" in notes[0], notes
    history = (cfg.optim.warmup_steps, cfg.loss.disc_start)
    assert history == (first.cfg.optim.warmup_steps, first.cfg.loss.disc_start) != \
           (fresh.optim.warmup_steps, fresh.loss.disc_start)
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss", *critic_flags,
                            "--learning_rate_disc", "3e-5")
    assert cfg.critic.learning_rate_disc == 3e-5
    same_critic, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss")
    assert same_critic.critic.learning_rate_disc == 1e-5 and "derived again" not in notes[0]


def test_worker_and_thread_counts_are_derived_again_on_a_machine_with_other_cores(tmp_path, shard_url, monkeypatch):
    """Issue 23 item 3: the data stream's position is saved per worker, so the same machine keeps the worker count
    (an exact resume); a machine with other cores derives both counts again and says so."""
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 16)
    first = started(tmp_path, shard_url, "--max_steps", "150")
    assert (first.cfg.data.num_workers, first.cfg.speed.num_threads) == (4, 12)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300")
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (4, 12) and "derived again" not in notes[0]
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 2)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300")
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (1, 1)
    assert "derived again: --num_workers 4 -> 1 (2 cores per rank, not 16 cores per rank), --num_threads 12 -> 1 " \
           "(2 cores per rank, not 16 cores per rank)" in notes[0], notes
    cfg, _, _, _ = finished(tmp_path, shard_url, "--max_steps", "300", "--num_workers", "3")
    assert cfg.data.num_workers == 3  # given: kept as given


def test_a_run_recorded_before_the_derivation_record_continues_as_it_did(tmp_path, shard_url, monkeypatch):
    """config.json without "derived" (written by earlier code): the values that code kept stay, the thread count is
    chosen for this machine, and the critic's rate is derived again for a new critic when it was the automatic one."""
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 16)
    first = started(tmp_path, shard_url, "--max_steps", "150")
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    del saved["derived"]
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    monkeypatch.setattr(run_setup, "cores_per_rank", lambda: 2)
    cfg, _, _, notes = finished(tmp_path, shard_url, "--max_steps", "300", "--do_ganloss", "--critic_trunk", "frozen")
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (first.cfg.data.num_workers, 1) == (4, 1)
    assert (cfg.optim.warmup_steps, cfg.loss.disc_start) == (first.cfg.optim.warmup_steps,
                                                               first.cfg.loss.disc_start)
    assert cfg.critic.learning_rate_disc == cfg.optim.learning_rate_vae and "--learning_rate_disc 1e-05 -> " in notes[0]


@pytest.mark.parametrize("workers, threads, cores, expected", [
    (-1, 0, 2, (1, 1)),  # the 2-core machine: 1 worker (PyTorch warns above the cores), the other core computes
    (-1, 0, 1, (1, 1)),
    (-1, 0, 16, (4, 12)),  # one GPU on a 16-core node
    (-1, 0, 6, (3, 3)),
    (0, 0, 8, (0, 8)),  # given values win: 0 workers (load in the main process) is a choice
    (6, 3, 2, (6, 3)),
])
def test_cpu_use_from_the_cores(workers, threads, cores, expected):
    assert run_setup.cpu_use(workers, threads, cores) == expected


def test_cores_per_rank_divides_the_affinity_by_local_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert run_setup.cores_per_rank() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert run_setup.cores_per_rank() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert run_setup.cores_per_rank() == 16
    cfg = run_setup.parse_config(["--dataset_url", "x"])
    assert (cfg.data.num_workers, cfg.speed.num_threads) == (4, 12)
    line = run_setup.cpu_use_line(cfg, {"dataset_url"})
    assert line == ("cpu: 16 cores per rank: 4 data workers, 12 torch threads (--num_workers and --num_threads "
                    "chosen from the cores; give them to override)")


# ==============================================================================================================
# Issue 40 items 9-11: --demo's values are defaults, the samples' kind at start-up, the shuffle buffer's default
# ==============================================================================================================
def test_the_demo_on_ones_own_shards_keeps_every_flag_given_or_refuses_it_in_one_line(tmp_path, shard_url,
                                                                                     monkeypatch):
    """Issue 40 item 9: `--demo --dataset_url mine --do_ganloss --discriminator patchgan` without VGG16 weights
    trained on the user's shards without the --do_ganloss they typed, then warned that --discriminator had no effect.
    The demo's values are defaults: a PatchGAN (no VGG16) is kept; a flag that needs VGG16 is refused in one line
    before anything starts; the demo's size on the user's data is its own run (not runs/demo, which it would
    continue)."""
    monkeypatch.setattr(run_setup, "vgg16_cache_path", lambda: str(tmp_path / "absent" / "vgg16.pth"))
    demo = ["--demo", "--output_dir", str(tmp_path), "--dataset_url", shard_url]
    for critic in (["--do_ganloss", "--discriminator", "patchgan"], ["--discriminator", "patchgan"]):
        setup = run_setup.prepare_run(demo + critic)
        cfg = setup.cfg
        assert (cfg.data.dataset_url, cfg.critic.do_ganloss, cfg.critic.discriminator) == (shard_url, True, "patchgan")
        assert (cfg.model.vae_ch, cfg.data.vae_resolution, cfg.optim.max_steps) == (32, 64, 900)  # the demo's size
        assert cfg.run.run_name == "demo_own_data" and cfg.data.test_dataset_url.endswith("test-00000.tar")
        assert run_setup.config_warnings(cfg, setup.given) == []
        assert setup.notes == [f"demo: no pretrained VGG16 in the torchvision cache ({tmp_path}/absent/vgg16.pth): "
                               "LPIPS is OFF (on random features it would train on noise); pixel + patchgan critic "
                               "from step 50 losses"]
    plain = run_setup.prepare_run(demo + ["--run_name", "mine"]).cfg  # the demo's own critic needs VGG16: off
    assert (plain.critic.do_ganloss, plain.loss.perceptual_weight, plain.run.run_name) == (False, 0.0, "mine")
    for flags, named in ((["--do_ganloss"], "--do_ganloss (the vgg16 critic)"),
                         (["--gan_weight", "0.5"], "--gan_weight (the vgg16 critic)"),
                         (["--perceptual_weight", "0.5"], "--perceptual_weight 0.5 (LPIPS)")):
        with pytest.raises(ConfigError) as refused:  # (vae_trainer.main prints it as one "error: " line, exit 2)
            run_setup.prepare_run(demo + flags)
        assert f"--demo: {named} would train on the features of a random VGG16" in str(refused.value)
        assert "\n" not in str(refused.value)
    assert not (tmp_path / "demo_own_data").exists()


def a_tar(path, members: dict[str, bytes]) -> str:
    import io
    import tarfile
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_a_dataset_of_the_wrong_kind_is_one_line_before_any_sample_is_decoded(tmp_path, shard_url, photos_dir):
    """Issue 40 item 10: a clip run (--video_frames) on image shards took 19 warnings and 76 s to fail. The first
    samples' names say their kind at start-up: images for a clip run, videos for an image run, one line; a local
    tar's headers, a folder's names, or the remote probe's first header (no wait added; a pipe: is not read)."""
    import diffusers
    videos = a_tar(tmp_path / "videos.tar", {"a.mp4": b"not decoded", "a.json": b"{}", "b.webm": b"x"})

    def refusal(argv: list[str]) -> str:  # (vae_trainer.main prints it as one "error: " line and exits 2)
        with pytest.raises(ConfigError) as refused:
            run_setup.prepare_run(argv)
        assert "\n" not in str(refused.value)
        return str(refused.value)
    assert refusal(["--dataset_url", videos, "--output_dir", str(tmp_path)]) == (
        f"--dataset_url: the first samples of {videos} are videos (mp4, webm), not images: give --video_frames N to "
        "train on clips of them (docs/finetuning.md), or shards of images (python data.py make-shards)")
    wan = tmp_path / "wan"  # a tiny Wan 2.1 VAE: a clip run takes its model from --init_from
    diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                               temperal_downsample=[True, True], latents_mean=[0.0] * 4,
                               latents_std=[1.0] * 4).save_pretrained(wan)
    clip_run = ["--init_from", str(wan), "--video_frames", "5", "--output_dir", str(tmp_path), "--vae_resolution",
                "32", "--batch_size", "1", "--wandb_mode", "disabled"]
    first_shard = shard_url.replace("{00000..00002}", "00000")
    for data, flag, where in ((["--dataset_url", shard_url], "--dataset_url", first_shard),
                              (["--dataset_url", photos_dir], "--dataset_url", photos_dir),
                              (["--dataset_url", videos, "--test_dataset_url", shard_url], "--test_dataset_url",
                               first_shard)):
        line = refusal(clip_run + data)
        assert line.startswith(f"{flag}: the first samples of {where} are images (") and line.endswith(
            "not videos: --video_frames 5 trains on clips of videos (packed by python data.py make-clips); leave it "
            "out to train on images"), line
    # images beside the clips (--video_image_prob) may come first; a clip run on videos starts
    assert run_setup.prepare_run(clip_run + ["--dataset_url", shard_url, "--video_image_prob", "0.5"])
    assert run_setup.prepare_run(clip_run + ["--dataset_url", videos]).cfg.data.video_frames == 5
    assert run_setup.first_samples("pipe:curl -s https://data.example/0.tar", None)[0] == []  # not read: a wait
    # a video's sample may carry a thumbnail before its video; lists joined by :: may hold images and clips: the run
    # is refused only when every shard looked at (first, middle, last) shows whole samples of the wrong kind
    thumbs = a_tar(tmp_path / "thumbs.tar", {"a.jpg": b"x", "a.mp4": b"x", "b.jpg": b"x", "b.mp4": b"x"})
    assert run_setup.prepare_run(clip_run + ["--dataset_url", thumbs]).cfg.data.video_frames == 5
    assert run_setup.prepare_run(clip_run + ["--dataset_url", f"{first_shard}::{videos}"])
    assert run_setup.prepare_run(["--dataset_url", f"{videos}::{first_shard}", "--output_dir", str(tmp_path)])


@pytest.mark.process
@pytest.mark.timeout(60)
def test_remote_shards_of_the_wrong_kind_are_told_from_the_start_up_probe(tmp_path):
    """Issue 40 item 10, remote shards: the start-up probe's first bytes (the first member's tar header, after the
    pax header webdataset's writer puts first) say the first member's kind; nothing else is read. One member is not
    a whole sample (a thumbnail may come before its video), so it is a warning, not a refusal."""
    import functools
    import http.server
    import threading
    import webdataset as wds
    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        for key in ("a", "b"):
            sink.write({"__key__": key, "mp4": b"\0" * 100_000})
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/00000.tar"
        notes = run_setup.prepare_run(["--dataset_url", url, "--output_dir", str(tmp_path / "runs")]).notes
        assert [n for n in notes if n.startswith("warning:")] == [
            f"warning: --dataset_url: the first member of {url} is one of videos (mp4), not images: give "
            "--video_frames N to train on clips of them (docs/finetuning.md), or shards of images (python data.py "
            "make-shards) (the start-up probe reads one member of a remote shard; a run on shards without usable "
            "samples stops when its stream has found none in thousands)"]
    finally:
        server.shutdown()
        server.server_close()


def wan_recipe() -> list[str]:
    """The flags of docs/finetuning.md's "Fine-tune Wan's VAE on your videos" command, as written there."""
    import shlex
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "finetuning.md")).read().replace("\\\n", " ")
    line, = [ln for ln in text.splitlines() if ln.startswith("torchrun") and "--video_frames 17" in ln
             and "Wan2.1" in ln]
    tokens = shlex.split(line)
    return tokens[tokens.index("vae_trainer.py") + 1:]


def test_the_shuffle_buffer_follows_what_a_sample_is_and_old_runs_keep_theirs(tmp_path, shard_url):
    """Issue 40 item 11: the Wan recipe as written warned about its own --shuffle_buffer (1000 whole videos). Its
    automatic value is 128 for clips, 1000 for images; a value given is kept (and warned about for clips); a run
    recorded before the value was automatic keeps the 1000 it recorded."""
    from flags import parse_flags
    cfg, given = parse_flags(wan_recipe())
    resolved = config.resolve_auto(cfg)
    assert "shuffle_buffer" not in given and resolved.data.shuffle_buffer == config.SHUFFLE_BUFFER_CLIPS == 128
    assert not [w for w in run_setup.config_warnings(resolved, given) if "shuffle_buffer" in w]
    cfg, given = parse_flags(wan_recipe() + ["--shuffle_buffer", "1000"])
    assert [w for w in run_setup.config_warnings(config.resolve_auto(cfg), given) if "--shuffle_buffer 1000" in w]
    images = [f for i, f in enumerate(TINY_AUTO) if "--shuffle_buffer" not in TINY_AUTO[i - 1:i + 1]]
    first = run_setup.prepare_run(["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--run_name", "r",
                                   *images, "--max_steps", "150"])
    assert first.cfg.data.shuffle_buffer == 1000 and first.derived["shuffle_buffer"] == "images"
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000150.pt").write_bytes(b"")
    derived = {k: v for k, v in first.derived.items() if k != "shuffle_buffer"}  # as earlier code recorded it
    for old in (50, 1000):
        (run_dir / "config.json").write_text(json.dumps({**config.public_config(first.cfg), "shuffle_buffer": old,
                                                         "derived": derived}))
        again = run_setup.prepare_run(["--dataset_url", shard_url, "--output_dir", str(tmp_path), "--run_name", "r",
                                       *images, "--max_steps", "300"])
        assert again.cfg.data.shuffle_buffer == old and "--shuffle_buffer" not in again.notes[0]


def test_a_new_users_refusals_are_one_error_line_and_exit_2_from_the_cli(tmp_path, shard_url, monkeypatch, capsys):
    """Issue 40 items 9 and 10 as the user ran them, through vae_trainer.main: a --demo flag that needs VGG16 and a
    dataset of the wrong kind are each one `error:` line, exit 2, and nothing written."""
    import time
    import vae_trainer
    monkeypatch.setattr(run_setup, "vgg16_cache_path", lambda: str(tmp_path / "absent" / "vgg16.pth"))
    videos = a_tar(tmp_path / "videos.tar", {"a.mp4": b"x", "b.mp4": b"x"})
    for argv, start, run in ((["--demo", "--dataset_url", shard_url, "--do_ganloss"], "error: --demo: --do_ganloss",
                              "demo_own_data"),
                             (["--dataset_url", videos, *TINY, "--run_name", "v"], "error: --dataset_url: the first "
                              "samples of", "v")):
        began = time.monotonic()
        assert vae_trainer.main([*argv, "--output_dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
        assert time.monotonic() - began < 30 and not (tmp_path / "runs" / run).exists()  # before anything starts
