"""Training, evaluating and exporting the Wan family's video VAE on clips (--video_frames): clips.py's decoding
(window, one crop for every frame, skips), `data.py make-clips`, the clip stream and its exact resume, the trainer
on clips (stop and resume bitwise; a decoder-only fine-tune under torchrun that keeps the encoder and exports a
folder diffusers decodes as we do), evaluation's per-frame and temporal measures, the memory estimate's frames, and
the refusals. The model itself against diffusers: test_wan_video.py. Clips are real H.264 mp4 files made from
photos with a moving camera (clips.camera_clip)."""
from __future__ import annotations

import json
import os
import random
from collections import Counter

import numpy as np
import pytest
import torch

import clips
import data as data_lib
import evaluate
import export
import families
import shards
import sources
from conftest import cli_env, cut_after, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMES = 9  # the clips' length in the shards: windows of 5 out of 9
# Wan 2.1's structure made small: time halves at both levels (clips of 1 + 4k frames), f4 in space
TINY_WAN = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 2.0, 2.5, 3.0])


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory) -> str:
    import diffusers
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLWan(**TINY_WAN)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p) if name.endswith("gamma") else 0.05 * torch.randn_like(p))
    folder = str(tmp_path_factory.mktemp("wan"))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def clip_url(photos_dir, tmp_path_factory) -> tuple[str, str]:
    """(training shards, held-out shard): moving-camera clips of the photos, 9 frames of 48 px, mp4."""
    dst = str(tmp_path_factory.mktemp("clips"))
    photos = sorted(os.path.join(photos_dir, f) for f in os.listdir(photos_dir))
    train = shards.write_photo_clips(photos[:-2], dst, FRAMES, 48, 2, 16, 0, shard_size=3)
    test = shards.write_photo_clips(photos[-2:], dst, FRAMES, 48, 1, 16, 99, shard_size=8, prefix="test-")
    return sources.brace_url(train), test[0]


def an_mp4(frames: int = FRAMES, size: int = 64, seed: int = 0) -> tuple[bytes, np.ndarray]:
    import skimage.data
    raw = clips.camera_clip(skimage.data.astronaut(), frames, size, np.random.default_rng(seed))
    return clips.encode_clip(raw), raw


# ------------------------------------------------------------------------------------------ clips and shards
@pytest.mark.process
def test_a_training_clip_is_a_window_of_consecutive_frames_with_one_crop_and_flip():
    """decode_clip's training draw is frames s .. s+4 of the video, each cropped at the same place and flipped (or
    not) together: it is found, bitwise, inside the whole decoded video. The codec is real: the decoded video is
    the moving-camera frames to H.264's error (and a pan moves the picture between frames)."""
    mp4, raw = an_mp4()
    whole = clips.decode_clip(mp4, FRAMES, 64, None)  # evaluation: the first frames, centre (= whole) crop
    assert whole.shape == (FRAMES, 64, 64, 3) and whole.dtype == np.uint8
    assert 10 * np.log10(255 ** 2 / ((whole.astype(float) - raw) ** 2).mean()) > 25
    assert np.abs(whole[0].astype(float) - whole[-1]).mean() > 5  # the camera moved
    seen = set()
    for seed in range(12):
        clip = clips.decode_clip(mp4, 5, 40, random.Random(seed))
        assert clip.shape == (5, 40, 40, 3)
        found = [(s, y, x, flip) for s in range(FRAMES - 4) for y in range(25) for x in range(25) for flip in (0, 1)
                 if np.array_equal(clip, (whole[s:s + 5, y:y + 40, x:x + 40])[:, :, ::-1 if flip else 1])]
        assert found, seed
        seen.add((found[0][0], found[0][3]))
    assert len({s for s, _ in seen}) > 1 and len({f for _, f in seen}) == 2  # windows and flips vary
    strided = clips.decode_clip(mp4, 3, 64, random.Random(0), stride=3)  # --video_frame_stride 3: every third frame
    assert any(np.array_equal(strided, whole[s:s + 7:3][:, :, ::flip]) for s in range(FRAMES - 6) for flip in (1, -1))


def test_what_cannot_be_a_clip_is_skipped_with_its_reason():
    mp4, _ = an_mp4()
    for data, frames, reason in ((mp4, FRAMES + 4, "too_short"), (b"\x00not a video" * 50, 5, "corrupt"),
                                 (mp4[: len(mp4) // 3], FRAMES, None)):
        try:
            clips.decode_clip(data, frames, 32, None)
            assert reason is None
        except sources.SkipSample as skip:
            assert skip.reason in ((reason,) if reason else ("corrupt", "too_short")), skip.reason
    with pytest.raises(sources.SkipSample, match="non_video"):
        clips.pick_video({"jpg": b""})


def test_make_clips_packs_videos_and_makes_clips_of_photos(photos_dir, tmp_path, capsys):
    """`python data.py make-clips` (shards.main): --from_photos writes moving-camera mp4 clips; a folder of videos
    is packed with each file's bytes, an unreadable one skipped and named."""
    assert shards.main(["make-clips", photos_dir, str(tmp_path / "made"), "--from_photos", "--frames", "5",
                        "--size", "32", "--per_photo", "1", "--shard_size", "4"]) == 0
    assert "--video_frames" in capsys.readouterr().out
    made = sorted(str(p) for p in (tmp_path / "made").iterdir())
    samples = [s for shard in made for _, s in sources.iter_shard(shard, Counter())]
    assert len(samples) == len(os.listdir(photos_dir)) and all(set(s) >= {"mp4"} for s in samples)
    videos = tmp_path / "videos"
    videos.mkdir()
    for i, sample in enumerate(samples[:3]):
        (videos / f"v{i}.mp4").write_bytes(sample["mp4"])
    (videos / "broken.webm").write_bytes(b"\x1a\x45\xdf\xa3 not really")
    assert shards.main(["make-clips", str(videos), str(tmp_path / "packed")]) == 0
    out = capsys.readouterr().out
    assert "wrote 3 videos into 1 shards (1 unreadable skipped: broken.webm)" in out
    packed = [s for _, s in sources.iter_shard(str(tmp_path / "packed" / "00000.tar"),
                                               Counter())]
    assert sorted(s["mp4"] for s in packed) == sorted(s["mp4"] for s in samples[:3])


def uninterrupted(loader, count: int) -> tuple[list[torch.Tensor], dict]:
    """The first `count` micro-batches of `loader(0)` and what it skipped."""
    ref = loader(0)
    try:
        return [next(ref) for _ in range(count)], ref.skipped()
    finally:
        ref.close()


def assert_resumes(loader, batches: list[torch.Tensor], cut: int) -> None:
    """`loader(workers, state)` stopped after `cut` micro-batches (no data workers) and resumed from its state with
    2 workers gives the rest of `batches`, bitwise."""
    first = loader(0)
    try:
        assert all(torch.equal(next(first), b) for b in batches[:cut])
        state = first.state_dict()
    finally:
        first.close()
    resumed = loader(2, state)
    try:
        assert all(torch.equal(next(resumed), b) for b in batches[cut:])
    finally:
        resumed.close()


def test_the_clip_stream_resumes_exactly_and_counts_what_it_skips(clip_url, tmp_path):
    """TrainLoader with clips: uint8 (B, 3, T, R, R) micro-batches; stopped after 3 and resumed from its state
    (with 2 data workers instead of none) it gives the uninterrupted stream's next micro-batches, bitwise. A shard
    with an image and a too-short video among the clips: both skipped and counted, the stream goes on."""
    import webdataset as wds
    train, _ = clip_url
    mp4, _ = an_mp4(frames=3, size=48)
    odd = str(tmp_path / "odd.tar")
    with wds.TarWriter(odd) as sink:
        sink.write({"__key__": "short", "mp4": mp4})
        sink.write({"__key__": "photo", "png": b"\x89PNG not used"})
    url = f"{train}::{odd}"

    def loader(workers, state=None):
        return data_lib.TrainLoader(url, 32, 2, 0, 0, 1, num_workers=workers, shuffle_buffer=4, state=state,
                                    frames=5)
    batches, skipped = uninterrupted(loader, 6)
    assert batches[0].shape == (2, 3, 5, 32, 32) and batches[0].dtype == torch.uint8
    assert_resumes(loader, batches, 3)
    assert skipped["too_short"] >= 1 and skipped["non_video"] >= 1, skipped


def test_image_steps_take_single_frames_of_images_and_videos_and_resume_exactly(clip_url, shard_url, monkeypatch):
    """--video_image_prob: a step is, by the seed and the step, one of clips or one of single frames; on a frame
    step a lane's sample is an image of the shards (images wait apart from the videos for these steps) or one frame
    of a video. Mixed shards (clips and photos): both kinds of micro-batch come, resumed with other workers they are
    the uninterrupted stream's. A lane uses the photos on frame steps and keeps its buffer of videos full
    whatever the images (clip steps stay shuffled) and at most as many images; images alone are one error."""
    url = f"{clip_url[0]}::{shard_url}"
    decoded_images = []
    monkeypatch.setattr(data_lib, "decode_crop", lambda *a, **k: decoded_images.append(1) or
                        np.zeros((a[1], a[1], 3), np.uint8))
    lane = data_lib.Lane(sources.list_shards(url), 0, 1, 0, 32, 4, 0.0, 1 << 30, frames=5, keep_images=True)
    for _ in range(12):
        assert lane.next_image(32, 5).shape == (5, 32, 32, 3)
        assert len(lane.buffer) == 3 and all("mp4" in s for _, s in lane.buffer) and len(lane.images) <= 4
    assert len(lane.images) == 4 and not decoded_images
    assert all(lane.next_image(32, 1).shape == (1, 32, 32, 3) for _ in range(8)) and decoded_images
    photos_only = data_lib.Lane(sources.list_shards(shard_url), 0, 1, 0, 32, 1, 0.0, 1 << 30, frames=5,
                                keep_images=True)
    with pytest.raises(sources.DatasetError, match="clips .--video_frames. need videos"):
        photos_only.next_image(32, 5)
    monkeypatch.undo()

    def loader(workers, state=None):
        return data_lib.TrainLoader(url, 32, 2, 0, 0, 1, num_workers=workers, shuffle_buffer=8, state=state,
                                    frames=5, image_prob=0.5)
    batches, skipped = uninterrupted(loader, 10)
    kinds = [b.shape[2] for b in batches]
    assert set(kinds) == {1, 5} and all(b.shape[:2] == (2, 3) for b in batches), kinds
    stream = data_lib.TrainStream([], 32, 2, 0, 0, 1, 1, 4, 0.5, 1 << 30, 2, frames=5, image_prob=0.5)
    assert kinds == [stream.frames_at(step) for step in range(10)]
    assert skipped["non_image"] == 0, skipped  # (photos beyond a lane's image buffer are non_video skips)
    assert_resumes(loader, batches, 4)


def test_every_rank_and_micro_batch_of_a_step_takes_the_same_kind_and_size(clip_url, shard_url):
    """--video_image_prob with --train_resolutions on 2 ranks x --grad_accum 2: the 4 micro-batches of a step (2 on
    each rank, each rank's own TrainLoader) are all clips or all single frames, at the same crop size and count.
    Ranks that disagreed would train a frame step and a clip step in one optimizer step, which DDP (with
    find_unused_parameters) averages without a word."""
    url = f"{clip_url[0]}::{shard_url}"
    steps = 8
    schedule = data_lib.ResolutionSchedule.parse("32,40", 32, 2, seed=0)
    per_rank = []
    for rank in (0, 1):
        loader = data_lib.TrainLoader(url, 32, 2, 0, rank, 2, num_workers=0, shuffle_buffer=4, frames=5,
                                      image_prob=0.5, schedule=schedule, grad_accum=2)
        try:
            per_rank.append([[tuple(next(loader).shape) for _ in range(2)] for _ in range(steps)])
        finally:
            loader.close()
    for step in range(steps):
        size = schedule.size_at(step)
        shapes = per_rank[0][step] + per_rank[1][step]
        assert len(set(shapes)) == 1, (step, shapes)
        assert shapes[0][:2] == (schedule.batch_for(size), 3) and shapes[0][3:] == (size, size), (step, shapes)
    kinds = {(s[0][0][2], s[0][0][3]) for s in zip(*per_rank)}
    assert {frames for frames, _ in kinds} == {1, 5} and {size for _, size in kinds} == {32, 40}, kinds


# ------------------------------------------------------------------------------------------------- training
def trainer_args(folder, url, test_url, runs, name, *extra) -> list[str]:
    """vae_trainer.py's flags for a short fine-tune of the tiny Wan video VAE on 5-frame clips of 32 px."""
    return ["--init_from", folder, "--video_frames", "5", "--dataset_url", url, "--test_dataset_url", test_url,
            "--output_dir", str(runs), "--run_name", name, "--vae_resolution", "32", "--batch_size", "2",
            "--shuffle_buffer", "4", "--warmup_steps", "1", "--vgg16_weights", "random",
            "--wandb_mode", "disabled", "--evaluate_every_n_steps", "0",
            "--mse_pool_factor", "4", "--num_samples", "4", "--min_lr_ratio", "1", *extra]


@pytest.mark.parametrize("critic", [["patchgan"], ["patchgan3d", "--disc_norm", "batch", "--r1_weight", "0.5",
                                                   "--lecam_weight", "0.1"]], ids=["frames", "clips"])
@pytest.mark.process
def test_a_run_on_clips_stopped_and_resumed_is_the_uninterrupted_run(wan_folder, clip_url, tmp_path, capsys, critic):
    """A full fine-tune on clips with the critic (PatchGAN on frames; or the 3D PatchGAN on whole clips, with
    BatchNorm's running statistics, R1 and LeCam: all that a resume must carry) and decoder checkpointing: 3 steps
    at once, or 1 more resumed from its step-2 checkpoint (conftest.cut_after); every tensor of the step-3
    checkpoint (VAE, EMA, critic) and the stream's position are equal. Its sample grid is a clip's frames over
    their reconstruction."""
    import vae_trainer
    flags = ["--do_ganloss", "--discriminator", *critic, "--disc_start", "1", "--save_every_n_steps", "2",
             "--num_workers", "0", "--grad_checkpointing", "decoder"]
    train, test = clip_url
    assert vae_trainer.main(trainer_args(wan_folder, train, test, tmp_path, "ref", *flags, "--max_steps", "3")) == 0
    out = capsys.readouterr().out
    assert "batch 2 clips of 5 frames x 1 accum" in out and "VAE NCHW" in out
    cut_after(tmp_path / "ref", tmp_path / "cut", 2)
    assert vae_trainer.main(trainer_args(wan_folder, train, test, tmp_path, "cut", *flags, "--max_steps", "3")) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out, out[-2000:]
    a, b = (torch.load(tmp_path / run / "checkpoints" / "step_00000003.pt", weights_only=True)
            for run in ("ref", "cut"))
    for part in ("vae", "ema"):
        for name, value in a["training"][part].items():
            assert torch.equal(value, b["training"][part][name]), f"{part}.{name}"
    assert all(torch.equal(v, b["adversary"]["critic"][k]) for k, v in a["adversary"]["critic"].items())
    assert a["adversary"]["lecam"] == b["adversary"]["lecam"] or critic == ["patchgan"]
    if critic[0] == "patchgan3d":  # it judged clips: its weights are Conv3d's, and they trained
        assert a["adversary"]["critic"]["main.0.weight"].dim() == 5
        # BatchNorm counts the critic's 3 steps and the generator term's 2 passes (from --disc_start 1)
        assert int(a["adversary"]["critic"]["main.3.num_batches_tracked"]) == 3 + 2
    assert a["run"]["ranks"][0]["data"] == b["run"]["ranks"][0]["data"]
    assert a["run"]["model_params"]["video"] is True
    # a full fine-tune's export re-estimates latents_mean / latents_std over clips of the run's length: every
    # latent frame of the held-out clips (2 clips of 5 frames: 2 latent frames each)
    assert export.main(["--ckpt", str(tmp_path / "ref"), "--out", str(tmp_path / "exported"), "--dataset_url", test,
                        "--resolution", "32", "--latent_stats_images", "2", "--batch_size", "2"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["latent_stats"]
    assert stats["n_images"] == 4
    with open(tmp_path / "exported" / "config.json") as f:
        assert json.load(f)["latents_mean"] == pytest.approx(stats["channel_mean"])
    source = families.load_source(wan_folder, video=True)
    assert not torch.equal(a["training"]["vae"]["encoder.conv_in.weight"], source.state["encoder.conv_in.weight"])
    from PIL import Image
    grid = Image.open(tmp_path / "ref" / "samples" / "step_00000003.png")
    width, height = grid.size  # (enlarged for viewing) one clip: its 5 frames over their reconstruction
    assert width * (2 + 2 * 34) == height * (2 + 5 * 34)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_decoder_only_fine_tune_on_clips_under_torchrun_keeps_the_encoder_and_exports_back(
        wan_folder, clip_url, tmp_path, capsys):
    """`torchrun --nproc_per_node=2 vae_trainer.py --init_from <AutoencoderKLWan folder> --video_frames 5
    --train_parts decoder --video_image_prob 0.5` with the 3D critic (--discriminator patchgan3d, DDP-wrapped like
    every critic, on both kinds of step) and the decoder trained in chunks of one latent frame (--train_time_chunks
    0,1: each chunk checkpointed under DDP, the time_convs unused on the frame step), seeded so that a step of single frames (where the time_convs do
    not run: DDP must not wait for their gradients) comes before a step of clips: the encoder and quant_conv (every
    temporal kernel and time_conv) stay bitwise the source's, on both ranks; the decoder's time_convs train; the
    in-loop evaluation reports the temporal measures; the export is an AutoencoderKLWan folder that diffusers loads
    and that decodes a latent clip as our model does, with the source's latents_mean/latents_std kept (the latent
    space did not move)."""
    import checkpoint
    from diffusers import AutoencoderKLWan
    train, test = clip_url
    runs, record = tmp_path / "runs", tmp_path / "record"
    record.mkdir()
    # the draw TrainStream.frames_at documents (the seed and the step, nothing else), made here: a draw that also
    # took the rank would give some rank another kind of step
    seed = next(s for s in range(100) if [data_lib._rng(s, "image_step", i).random() < 0.5 for i in (0, 1)]
                == [True, False])
    # tests/recording_trainer.py: vae_trainer.py that records each rank's micro-batch shapes per step
    proc = run_cli("tests/recording_trainer.py",
                   trainer_args(wan_folder, train, test, runs, "ft", "--train_parts", "decoder",
                                "--do_ganloss", "--discriminator", "patchgan3d", "--disc_start", "0",
                                "--train_time_chunks", "0,1", "--perceptual_weight", "0",  # (LPIPS: the test above)
                                "--video_image_prob", "0.5", "--seed", str(seed), "--num_workers", "1",
                                "--max_steps", "2", "--evaluate_every_n_steps", "2", "--eval_max_images", "2",
                                "--inception_weights", "none"),
                   nproc=2, timeout=240, env=cli_env(VAE_TRAINER_RECORD=str(record)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(weights identical on all ranks)" in proc.stdout
    for rank in (0, 1):  # each rank trains the step's kind: a frame step, then a clip step
        with open(record / f"batches_rank{rank}.jsonl") as f:
            assert [r["shapes"] for r in map(json.loads, f)] == [[[2, 3, 1, 32, 32]], [[2, 3, 5, 32, 32]]], rank
    assert "temporal_psnr" in proc.stdout and "(2 clips, 10 frames)" in proc.stdout
    ckpt = checkpoint.load_checkpoint(str(runs / "ft" / "checkpoints" / "step_00000002.pt"))
    assert ckpt["run"]["ranks_in_sync"] is True
    assert ckpt["run"]["critic_in_sync"] is True  # the 3D critic under DDP, on one-frame clips and on clips
    assert ckpt["adversary"]["critic"]["main.0.weight_orig"].dim() == 5
    source = families.load_source(wan_folder, video=True)
    frozen = [k for k in source.state if k.startswith(("encoder.", "quant_conv."))]
    assert any(".time_conv." in k for k in frozen)
    for part in ("vae", "ema"):
        assert all(torch.equal(ckpt["training"][part][k], source.state[k]) for k in frozen), part
    time_conv = "decoder.up_blocks.0.upsamplers.0.time_conv.weight"
    assert not torch.equal(ckpt["training"]["vae"][time_conv], source.state[time_conv])

    assert export.main(["--ckpt", str(runs / "ft"), "--out", str(tmp_path / "out"), "--ema"]) == 0
    assert json.loads(capsys.readouterr().out)["latent_norm"] == "per_channel"
    exported = AutoencoderKLWan.from_pretrained(tmp_path / "out").eval()
    assert (exported.config.latents_mean, exported.config.latents_std) == (TINY_WAN["latents_mean"],
                                                                           TINY_WAN["latents_std"])
    import wan_ae
    ours = wan_ae.WanAutoEncoder(source.params)
    ours.load_state_dict(ckpt["training"]["ema"])
    ours.eval().time_chunks = (4, 1)  # diffusers' plan: bitwise
    z = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(ours.decode(z), exported.decode(z).sample)


# ----------------------------------------------------------------------------------------------- evaluation
def test_the_temporal_measures_see_flicker_and_not_a_steady_error():
    """temporal_psnr: a constant colour shift (the same error in every frame) costs nothing (the 100 dB cap), an
    error that changes from frame to frame does; tLP is 0 for a perfect reconstruction and grows with flicker."""
    from critics import build_lpips
    torch.manual_seed(0)
    x = torch.rand(2, 3, 5, 32, 32)
    shifted = x + 0.1
    assert evaluate.temporal_psnr_per_clip(shifted, x).min() > 99
    flicker = x + 0.05 * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]).view(1, 1, 5, 1, 1)
    assert evaluate.temporal_psnr_per_clip(flicker, x).max() < 30
    lpips_model = build_lpips(None).eval()
    with torch.no_grad():
        assert evaluate.tlp_per_clip(x * 2 - 1, x * 2 - 1, lpips_model).abs().max() == 0
        assert (evaluate.tlp_per_clip(flicker * 2 - 1, x * 2 - 1, lpips_model) > 0).all()


@pytest.mark.process
def test_evaluate_on_clips_reports_per_frame_and_temporal_metrics(wan_folder, clip_url, tmp_path, capsys):
    """`python evaluate.py --ckpt <Wan folder> --video_frames 9`: the folder loads as the video model, the held-out
    videos as clips of their first 9 frames; per-frame PSNR (the same as evaluating the decoded frames as images)
    and the temporal measures over the clips. An image VAE, or a frame count the model cannot take, is refused in
    one line."""
    _, test = clip_url
    assert evaluate.main(["--ckpt", wan_folder, "--dataset_url", test, "--resolution", "32", "--video_frames", "9",
                          "--vgg16_weights", "random", "--inception_weights", "none", "--batch_size", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["n_clips"], result["n_images"]) == (2, 18)
    assert result["temporal_psnr"] > 0 and result["tlp"] >= 0
    vae = families.build_model(families.load_source(wan_folder, video=True).params)
    vae.load_state_dict(families.load_source(wan_folder, video=True).state)
    vae.eval()
    psnrs = []
    for _, batch in data_lib.iter_eval_batches(test, 32, 2, frames=9):
        x = data_lib.to_model_input(batch, torch.device("cpu"))
        with torch.no_grad():
            recon = vae.decode(vae.encode(x)).clamp(-1, 1)
        psnrs.append(evaluate.psnr_per_image(clips.frames_of(recon) * 0.5 + 0.5, clips.frames_of(x) * 0.5 + 0.5))
    assert result["psnr"] == pytest.approx(torch.cat(psnrs).mean().item(), rel=1e-9)
    for args, message in ((["--video_frames", "6"], "takes clips of 1 + 4k frames"),
                          (["--video_frames", "5", "--tile_size", "16"], "--images and --tile_size take images")):
        assert evaluate.main(["--ckpt", wan_folder, "--dataset_url", test, "--resolution", "32", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


@pytest.mark.process
def test_evaluate_takes_a_clip_runs_clip_length_from_its_checkpoint(wan_folder, clip_url, tmp_path, capsys):
    """`python evaluate.py --ckpt RUN` of a run trained on clips, without --video_frames: the checkpoint records the
    run's --video_frames and --video_frame_stride, and the held-out videos are evaluated as the run's clips (issue
    48 item 7: it read them as images and found "no readable image to evaluate"); one line says so. --video_frames 0
    asks for images."""
    train, test = clip_url
    assert vae_trainer_main(trainer_args(wan_folder, train, test, tmp_path, "clips", "--max_steps", "1",
                                         "--num_workers", "0", "--perceptual_weight", "0", "--memory_check", "false",
                                         "--video_frame_stride", "2")) == 0
    capsys.readouterr()
    flags = ["--ckpt", str(tmp_path / "clips"), "--dataset_url", test, "--vgg16_weights", "random",
             "--inception_weights", "none", "--batch_size", "2"]
    assert evaluate.main(flags) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert (result["n_clips"], result["n_images"], result["resolution"]) == (2, 10, 32), result
    assert "clips of 5 frames (--video_frame_stride 2), as the run trained: its --video_frames" in err, err
    assert evaluate.main(flags + ["--video_frames", "0"]) == 2  # images asked for, of a set of videos
    assert "no readable image to evaluate" in capsys.readouterr().err


def vae_trainer_main(argv: list[str]) -> int:
    import vae_trainer
    return vae_trainer.main(argv)


# -------------------------------------------------------------------------------------------- refusals, memory
@pytest.mark.process
def test_what_clips_cannot_do_is_refused_in_one_line(wan_folder, clip_url, shard_url, tmp_path, capsys):
    import vae_trainer
    train, test = clip_url
    cases = ((["--video_frames", "8"], "this VAE takes clips of 1 + 4k frames: the nearest are 5 and 9"),
             (["--scale_equivariance_prob", "0.5"], "--scale_equivariance_prob takes images, not clips"),
             (["--eval_tile_size", "16", "--eval_tile_overlap", "8"], "--eval_tile_size takes images, not clips"),
             (["--compile"], "--compile is not tested with the video VAEs' temporal caches"))
    for extra, message in cases:
        assert vae_trainer.main(trainer_args(wan_folder, train, test, tmp_path, "x", *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    no_source = [a for a in trainer_args(wan_folder, train, test, tmp_path, "x") if a not in ("--init_from",
                                                                                              wan_folder)]
    assert vae_trainer.main(no_source) == 2
    assert "clips train a video VAE, loaded with --init_from from its diffusers folder" in capsys.readouterr().err
    # a run of the image model continued with clips (its source gone: the architecture comes from its checkpoint)
    images = [a for a in trainer_args(wan_folder, train, test, tmp_path, "img", "--max_steps", "1", "--num_workers",
                                      "0", "--dataset_url", shard_url, "--test_dataset_url", shard_url)
              if a != "--video_frames"]  # (its test set of images: one of clips is refused for an image run)
    images.remove("5")
    assert vae_trainer.main(images) == 0
    capsys.readouterr()
    assert vae_trainer.main(trainer_args(wan_folder, train, test, tmp_path, "img", "--max_steps", "2")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different architecture (vae_temporal_factor: 0 -> 4)" in err[0], err


def test_the_memory_estimate_counts_the_frames(wan_folder):
    """The memory check probes a clip of the run's length: more frames, more activation memory (about in
    proportion to the frames)."""
    import memory
    from conftest import objective_of
    import run_setup
    vae = families.build_model(families.load_source(wan_folder, video=True).params)
    cfg = run_setup.parse_config(["--perceptual_weight", "0", "--mse_pool_factor", "4"])
    objective = objective_of(cfg, with_lpips=False, z_channels=4)
    need = {t: memory.estimate_step_memory(vae, objective, memory.StepShape(1, 32, frames=t),
                                           probe_resolutions=(16, 32)).activations for t in (1, 5, 9)}
    assert need[1] < need[5] < need[9]
    assert 1.5 < need[9] / need[5] < 2.2


def test_the_temporal_term_is_the_frame_difference_error_as_a_gradnorm_branch():
    """--temporal_weight: the mean squared error of the reconstruction's frame differences against the input's,
    within each clip of the micro-batch's frames (never across two clips), as a GradNorm branch: alone, its
    gradient on the reconstruction has the norm weight * loss scale / accum. Images (clip_frames 0) have none;
    without --video_frames the flag is refused."""
    import run_setup
    from conftest import objective_of
    from objective import MicroBatch
    cfg = run_setup.parse_config(["--perceptual_weight", "0", "--mse_weight", "0", "--kl_weight", "0",
                                  "--temporal_weight", "0.7", "--mse_pool_factor", "4"])
    objective = objective_of(cfg, with_lpips=False, z_channels=4)
    torch.manual_seed(0)
    x = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    recon = (x + 0.1 * torch.randn_like(x)).requires_grad_()
    mean = torch.randn(2, 4, 2, 4, 4)
    loss, logs = objective(MicroBatch(clips.frames_of(x), clips.frames_of(recon), clips.frames_of(mean), None,
                                      step=0, accum=2, loss_scale=torch.tensor(4.0), clip_frames=5))
    diff = (recon[:, :, 1:] - recon[:, :, :-1]) - (x[:, :, 1:] - x[:, :, :-1])
    assert logs["loss/temporal"].item() == pytest.approx(diff.square().mean().item(), rel=1e-6)
    grad = torch.autograd.grad(loss, recon)[0]
    assert grad.norm().item() == pytest.approx(0.7 * 4.0 / 2, rel=1e-4)
    _, logs = objective(MicroBatch(clips.frames_of(x), clips.frames_of(recon), clips.frames_of(mean), None, step=0))
    assert "loss/temporal" not in logs
    with pytest.raises(Exception, match="--temporal_weight is for clips: it needs --video_frames"):
        run_setup.parse_config(["--temporal_weight", "1", "--dataset_url", "x"]).validate()


def test_the_kl_of_a_clip_is_summed_over_its_latent_clip_and_divided_by_the_root_of_its_count():
    """The KL on clips, through objective.micro_step as the trainer runs it (a stand-in model whose posterior is its
    own parameters): logged as the mean KL per latent element of the latent clips, and under GradNorm it enters the
    backward as kl_weight x the KL summed over every latent element of the micro-batch's clips / sqrt(their count)
    (x loss scale / accum), the count being B x C x T' x h x w: a latent frame of a clip counts as a latent image
    does, no more. Checked against the KL of the 5-D posterior computed here by hand."""
    import latents as latents_lib
    import run_setup
    from conftest import objective_of
    from objective import micro_step
    cfg = run_setup.parse_config(["--perceptual_weight", "0", "--kl_weight", "0.3", "--mse_pool_factor", "4"])
    objective = objective_of(cfg, with_lpips=False, z_channels=4)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 5, 16, 16, generator=gen) * 2 - 1

    class Posterior(torch.nn.Module):  # (B, C, T', h, w): Wan's 5 frames are 2 latent frames
        def __init__(self):
            super().__init__()
            self.mean = torch.nn.Parameter(torch.randn(2, 4, 2, 4, 4, generator=gen))
            self.logvar = torch.nn.Parameter(torch.randn(2, 4, 2, 4, 4, generator=gen) - 1)
            self.recon = torch.nn.Parameter(x + 0.1 * torch.randn(x.shape, generator=gen))

        def forward(self, x, latent_transform=None, also_decode=None):
            return self.recon, self.mean, self.logvar, None, None

    model = Posterior()
    scale, accum = 4.0, 2
    out = micro_step(objective, model, x, 0, 0, accum, True, latents_lib.LatentRegularisers(0),
                     torch.tensor(scale), None)
    mean, logvar = model.mean.detach().double().requires_grad_(), model.logvar.detach().double().requires_grad_()
    kl = 0.5 * (mean.square() + logvar.exp() - 1 - logvar)
    assert out.logs["loss/kl"].item() == pytest.approx(kl.mean().item(), rel=1e-6)
    (scale * 0.3 * kl.sum() / kl.numel() ** 0.5 / accum).backward()
    assert torch.allclose(model.mean.grad.double(), mean.grad, rtol=1e-5, atol=1e-9)
    assert torch.allclose(model.logvar.grad.double(), logvar.grad, rtol=1e-5, atol=1e-9)
