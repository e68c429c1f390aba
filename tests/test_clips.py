"""Decoding only what a clip needs (issue 42, item 3): frame counts from the container (counted once otherwise, and
cached), a seek to the keyframe before the window, long videos read in passes (frames decoded per delivered clip
counted), rotation metadata, a variable frame rate refused and counted, make-clips --segment_seconds, exact resume
with passes open. Real PyAV on small videos made here (64 px, 30 fps, x264's keyframe interval of 250)."""
from __future__ import annotations

import io
import random
from collections import Counter

import numpy as np
import pytest
import torch

import clips
import data as data_lib
import shards
import sources
from config import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FPS, SIZE, KEYINT = 30, 64, 250


def camera_frames(frames: int, seed: int = 0, size: int = SIZE) -> np.ndarray:
    import skimage.data
    return clips.camera_clip(skimage.data.astronaut(), frames, size, np.random.default_rng(seed))


def long_mp4(frames: int, seed: int = 0, **kw) -> bytes:
    """A video of `frames` frames at 30 fps whose keyframes are x264's: 250 frames apart at most (a smooth camera
    move: no scene cut adds one)."""
    return clips.encode_clip(camera_frames(frames, seed), fps=FPS, keyint=KEYINT, **kw)


def reference(data: bytes) -> list[np.ndarray]:
    """Every frame, decoded from the first: what a window must equal."""
    import av
    with av.open(io.BytesIO(data)) as container:
        return [np.asarray(f.to_image()) for f in container.decode(container.streams.video[0])]


def mp4_with_pts(frames: int, pts_of) -> bytes:
    """`frames` camera frames as H.264 at 30 fps, frame i stamped `pts_of(i)` (in 1/30 s): a stream that starts late,
    or one whose frames are not evenly spaced."""
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        for i, frame in enumerate(camera_frames(frames)):
            f = av.VideoFrame.from_ndarray(frame, format="rgb24")
            f.pts = pts_of(i)
            for packet in stream.encode(f):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def ten_seconds() -> tuple[bytes, list[np.ndarray]]:
    mp4 = long_mp4(300)
    return mp4, reference(mp4)


def test_windows_are_the_reference_frames_found_by_their_timestamps(ten_seconds):
    """Video.read(first, T) seeks to the keyframe before the window and keeps the frames from `first` on by their
    timestamps: pixel-equal to decoding everything and indexing, wherever the window is, in any order."""
    mp4, ref = ten_seconds
    video = clips.Video(mp4)
    assert video.frames == len(ref) == 300
    for first in (251, 0, 17, 283, 140, 157):
        out = video.read(first, 17)
        assert all(np.array_equal(np.asarray(img), ref[first + i]) for i, img in enumerate(out)), first
    video.close()


def test_a_stream_that_starts_late_is_read_by_its_own_clock():
    """Frames whose timestamps start at 0.5 s (start_time != 0): frame i is still the i-th frame."""
    mp4 = mp4_with_pts(40, lambda i: i + 15)
    ref = reference(mp4)
    video = clips.Video(mp4)
    assert video.start > 0 and video.frames == 40
    assert all(np.array_equal(np.asarray(img), ref[20 + i]) for i, img in enumerate(video.read(20, 9)))


def test_frame_counts_come_from_the_container_else_are_counted_once_and_cached(ten_seconds):
    """mp4: the index's count; webm: its duration x its constant rate; a webm with an audio stream (the container's
    duration may be the audio's): counted by demuxing, once per key. Each equals the frames decoded."""
    import av
    mp4, _ = ten_seconds
    raw = camera_frames(45)
    webm = io.BytesIO()
    with av.open(webm, "w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=FPS)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        audio = container.add_stream("libopus", rate=48000)
        for frame in raw:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 960 * 80), np.float32), format="flt", layout="mono")
        samples.sample_rate = 48000
        for packet in [*audio.encode(samples), *audio.encode()]:
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with_audio = webm.getvalue()
    video_only = io.BytesIO()  # 30 of the frames in webm, video alone
    with av.open(video_only, "w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=FPS)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        for frame in raw[:30]:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clips.DECODE_COUNTS.clear()
    clips._count_cache.clear()
    assert clips.Video(mp4, key="a").frames == 300 and clips.DECODE_COUNTS["counted"] == 0  # stream.frames
    assert clips.Video(video_only.getvalue(), key="b").frames == 30 == len(reference(video_only.getvalue()))
    assert clips.DECODE_COUNTS["counted"] == 0  # duration x rate
    assert clips.Video(with_audio, key="c").frames == 45 == len(reference(with_audio))
    assert clips.DECODE_COUNTS["counted"] == 1  # demuxed: the container's duration is not the video's alone
    assert clips.Video(with_audio, key="c").frames == 45 and clips.DECODE_COUNTS["counted"] == 1  # cached
    assert clips.DECODE_COUNTS["frames"] == 0  # counting decodes nothing


def stream(url: str, workers: int = 0, state=None, frames: int = 17, **kw) -> data_lib.TrainLoader:
    return data_lib.TrainLoader(url, SIZE, 1, 0, 0, 1, num_workers=workers, shuffle_buffer=kw.pop("buffer", 2),
                                state=state, frames=frames, resize_prob=0.0, **kw)


@pytest.fixture(scope="module")
def long_url(tmp_path_factory) -> tuple[str, list[list[np.ndarray]]]:
    """Two videos of 20 s and 10 s (600 and 300 frames, 35 and 17 windows of 17) in one shard."""
    import webdataset as wds
    path = str(tmp_path_factory.mktemp("long") / "00000.tar")
    videos = [long_mp4(600, seed=1), long_mp4(300, seed=2)]
    with wds.TarWriter(path) as sink:
        for i, mp4 in enumerate(videos):
            sink.write({"__key__": f"v{i}", "mp4": mp4})
    return path, [reference(v) for v in videos]


def where(clip: np.ndarray, refs: list[list[np.ndarray]]) -> tuple[int, int]:
    """(video, first frame) of a delivered (T, H, W, 3) clip, flipped or not, in the reference decodes."""
    for v, ref in enumerate(refs):
        for first in range(len(ref) - len(clip) + 1):
            if any(np.array_equal(clip[0], ref[first][:, ::flip]) for flip in (1, -1)):
                if all(np.array_equal(clip, np.stack(ref[first:first + len(clip)])[:, :, ::flip]) for flip in (1, -1)
                       if np.array_equal(clip[0], ref[first][:, ::flip])):
                    return v, first
    raise AssertionError("a delivered clip is no window of the videos")


def test_long_videos_cost_under_one_and_a_half_clips_of_decoding_and_give_every_window(long_url):
    """The stream over a 20 s and a 10 s video (keyframes up to 250 frames apart) delivers clips of 17 frames at
    <= 1.5 x 17 frames decoded each, counted: the videos are read in passes (one seek per pass of ~512 frames), not
    from frame 0 nor from a far keyframe for every clip. Each delivered clip equals the reference decode's window
    (pixel-equal), and a reading of a video gives its disjoint windows, each once: a video weighs as its windows
    (35 and 17), not as one sample."""
    url, refs = long_url
    clips.DECODE_COUNTS.clear()
    loader = stream(url)
    try:
        delivered = [next(loader)[0].permute(1, 2, 3, 0).numpy() for _ in range(52)]
    finally:
        loader.close()
    decoded, clip_count = clips.DECODE_COUNTS["frames"], clips.DECODE_COUNTS["clips"]
    assert clip_count == 52
    assert decoded / clip_count <= 1.5 * 17, (decoded, clip_count)
    found = [where(c, refs) for c in delivered]
    for v in (0, 1):  # a reading (a residue of the window grid) never gives a window twice
        for residue in range(17):
            starts = [s for w, s in found if w == v and s % 17 == residue]
            assert len(starts) == len(set(starts)), (v, residue, starts)
    # drawn by windows, 35 : 17 (as one sample each it would be 26 : 26)
    per_video = Counter(v for v, _ in found)
    assert per_video[0] >= 1.7 * per_video[1], per_video
    # also where a video takes several passes (--video_pass_frames 128: passes of 8 windows, 5 and 3 of them): a
    # reading of a video (a residue of its window grid) gives all its windows, pass after pass, not one pass's
    loader = stream(url, pass_frames=128)
    try:
        found = [where(next(loader)[0].permute(1, 2, 3, 0).numpy(), refs) for _ in range(52)]
    finally:
        loader.close()
    readings = [Counter(s % 17 for w, s in found if w == v) for v in (0, 1)]
    assert max(readings[1].values()) == 17 and max(readings[0].values()) > 2 * 8, readings


def test_a_stream_stopped_inside_a_pass_resumes_exactly(long_url):
    """Stopped with passes open (their videos' keys, next windows and the passes done are in the state) and resumed
    with 2 data workers, the stream gives the uninterrupted one's clips, bitwise: the passes reopen with one seek."""
    url, _ = long_url
    ref = stream(url)
    try:
        batches = [next(ref) for _ in range(14)]
    finally:
        ref.close()
    first = stream(url)
    try:
        assert all(torch.equal(next(first), b) for b in batches[:6])
        state = first.state_dict()
    finally:
        first.close()
    lane = state["lanes"][0]
    assert lane["passes"] and lane["videos"], lane  # a pass is open at the cut
    resumed = stream(url, workers=2, state=state)
    try:
        assert all(torch.equal(next(resumed), b) for b in batches[6:])
    finally:
        resumed.close()


def lane_of(url: str, **kw) -> data_lib.Lane:
    return data_lib.Lane(data_lib.list_shards(url), 0, 1, 0, SIZE, 2, 0.0, 1 << 40, frames=17, **kw)


def test_an_image_step_spends_no_pass_of_a_long_video(long_url):
    """An image step (--video_image_prob) that draws a long video reads one frame and leaves the video's windows
    to the clip steps: no pass begun, the video back in the buffer (a pass spent on one frame would lose its ~30
    windows for the epoch, and long videos would weigh less than their windows)."""
    url, refs = long_url
    lane = lane_of(url)
    try:
        for _ in range(6):
            frame = lane.next_image(frames=1)
            assert frame.shape == (1, SIZE, SIZE, 3)
            assert any(np.array_equal(frame[0], ref[:, ::flip]) for video in refs for ref in video for flip in (1, -1))
        assert lane.videos == {} and lane.passes == []
        assert len(lane.buffer) == 2
    finally:
        lane.close()


def test_a_window_that_fails_loses_its_pass_not_the_video(long_url, monkeypatch):
    """A window of an open pass that cannot be read (a variable frame rate there, a count that over-states the
    frames) is skipped and counted, and only its pass is lost: the video's other passes are still to come."""
    url, _ = long_url
    lane = lane_of(url, pass_frames=128)  # passes of 8 windows: 5 and 3 of them
    real, failed = data_lib.Lane._next_clip, []

    def flaky(self, key, sample, opened, *args):
        if opened is not None and not failed:
            failed.append((key, opened, list(self.videos[key])))  # (the video's plan: its first draw, passes done)
            raise sources.SkipSample("variable_frame_rate")
        return real(self, key, sample, opened, *args)
    monkeypatch.setattr(data_lib.Lane, "_next_clip", flaky)
    try:
        for _ in range(40):
            lane.next_image()
            if failed:
                break
        key, opened, plan = failed[0]
        assert lane.counters["variable_frame_rate"] == 1
        assert all(p is not opened for p in lane.passes)
        # the same plan goes on (not a new one from the next epoch's copy of the sample): its next passes to come
        assert lane.videos.get(key, [None])[0] == plan[0] and key in [k for k, _ in lane.buffer]
    finally:
        lane.close()


def test_the_last_pass_of_a_video_failing_to_open_keeps_its_other_open_passes(long_url, monkeypatch):
    """The last pass of a video opens (the video leaves the plan) while another of its passes is open, and its
    first window cannot be read: that pass is lost, counted; the open ones go on to their unread windows."""
    url, _ = long_url
    lane = lane_of(url, pass_frames=128)  # passes of 8 windows: 5 and 3 of them
    real_read, kept = clips.Video.read, []

    def flaky(video, first, count):  # a pass being opened reads its video's first window before it is in lane.passes
        opening = [p for p in lane.passes if p[4] is video] == []
        others = [p for p in lane.passes if p[4] is not None and p[4] is not video and p[0] == video_key[0]]
        if not kept and opening and video_key[0] not in lane.videos and others:
            kept.extend((p, p[3]) for p in others)
            raise sources.SkipSample("variable_frame_rate")
        return real_read(video, first, count)
    real_next, video_key = data_lib.Lane._next_clip, [None]

    def next_clip(self, key, *args):
        video_key[0] = key
        return real_next(self, key, *args)
    monkeypatch.setattr(clips.Video, "read", flaky)
    monkeypatch.setattr(data_lib.Lane, "_next_clip", next_clip)
    try:
        for _ in range(200):
            lane.next_image()
            if kept:
                break
        assert kept and lane.counters["variable_frame_rate"] == 1
        assert all(any(p is opened for p in lane.passes) for opened, _ in kept), "its open passes were closed"
        for _ in range(60):  # their unread windows are still delivered
            lane.next_image()
        assert all(opened[3] < left for opened, left in kept)
    finally:
        lane.close()


def test_a_long_videos_passes_are_read_in_a_random_order(long_url):
    """A video's passes are opened in a shuffled order (seeded by the lane), not from its start: a run stopped every
    epoch at the same place would otherwise never see its videos' ends."""
    url, _ = long_url
    lane = lane_of(url, pass_frames=128)  # passes of 8 windows: 5 and 3 of them
    seen, starts = set(), {}
    try:
        for _ in range(52):  # one epoch: every window once
            lane.next_image()
            for p in lane.passes:
                if id(p) not in seen:
                    seen.add(id(p))
                    starts.setdefault(p[0], []).append(p[2])
    finally:
        lane.close()
    first = max(starts.values(), key=len)[:5]  # the long video's 5 passes of its first epoch (then the next's)
    assert len(first) == 5 and first != sorted(first), starts


def test_a_frame_size_change_within_a_window_is_skipped_as_corrupt():
    """No one crop fits frames of two sizes: the window is skipped (counted as corrupt), not a crash of the worker."""
    with pytest.raises(sources.SkipSample, match="corrupt"):
        clips.crop_clip([np.zeros((64, 96, 3), np.uint8), np.zeros((48, 64, 3), np.uint8)], 48, random.Random(3))


def test_portrait_videos_are_turned_as_their_metadata_says():
    """A display matrix of 90 (PyAV's frame.rotation: counterclockwise, what a phone writes for a portrait video
    stored landscape) or -90: the frames come turned, as images follow EXIF; the stored frames are wider than
    high, the delivered ones higher than wide."""
    import av
    raw = camera_frames(9, size=SIZE)[:, :32]  # 32 high, 64 wide
    for rotation, turns in ((90, 1), (-90, 3), (180, 2)):
        data = clips.encode_clip(raw, fps=FPS, rotation=rotation)
        with av.open(io.BytesIO(data)) as container:  # the stored frames of this very file, as stored (one encode:
            # two encodes of the same frames need not give the same bits, and the test is about the turn)
            stored = [f.to_ndarray(format="rgb24", threads=1) for f in container.decode(container.streams.video[0])]
        assert len(stored) == 9 and stored[0].shape == (32, 64, 3)
        got = [np.asarray(img) for img in clips.Video(data).read(0, 9)]
        assert all(np.array_equal(g, np.rot90(p, turns)) for g, p in zip(got, stored)), rotation
        clip = clips.decode_clip(data, 5, 16, None)
        assert clip.shape == (5, 16, 16, 3)
    assert clips.rotated(np.zeros((2, 4, 3), np.uint8), 90).shape == (4, 2, 3)


def vfr_mp4(frames: int = 40) -> bytes:
    """Frames 0-19 one frame apart, then two apart: a variable frame rate (the container's average is not its
    frames' spacing)."""
    return mp4_with_pts(frames, lambda i: i if i < 20 else 2 * i - 20)


def test_a_variable_frame_rate_is_refused_and_counted(tmp_path):
    """A window whose frames are not one frame apart is refused (SkipSample variable_frame_rate), and the stream
    counts it and goes on."""
    import webdataset as wds
    with pytest.raises(sources.SkipSample, match="variable_frame_rate"):
        clips.decode_clip(vfr_mp4(), 5, 32, random.Random(0))
    path = str(tmp_path / "00000.tar")
    with wds.TarWriter(path) as sink:
        sink.write({"__key__": "vfr", "mp4": vfr_mp4()})
        sink.write({"__key__": "ok", "mp4": long_mp4(20)})
    loader = stream(path, frames=5)
    try:
        for _ in range(4):
            assert next(loader).shape == (1, 3, 5, SIZE, SIZE)
        assert loader.skipped()["variable_frame_rate"] >= 1
    finally:
        loader.close()


def test_make_clips_names_variable_frame_rate_videos_and_the_flag_that_makes_them_clips(tmp_path, capsys):
    """make-clips checks the spacing of a video's first frames: one whose frames are not evenly spaced from its start
    (as 3 of opencv-doc's 4 AVIs: a first frame stamped 1, B-frames without timestamps, a rate the frames do not
    keep) is skipped for its variable frame rate, not called "unreadable", with the hint that --segment_seconds
    re-encodes it at a constant rate (issue 48 item 8); and --segment_seconds does: every frame then reads as a
    window of consecutive frames."""
    src = tmp_path / "videos"
    src.mkdir()
    (src / "steady.mp4").write_bytes(long_mp4(20))
    (src / "jumpy.mp4").write_bytes(mp4_with_pts(40, lambda i: 0 if i == 0 else i + 1))  # a frame missing after 0
    (src / "broken.mkv").write_bytes(b"\x1a\x45\xdf\xa3 no")
    with pytest.raises(sources.SkipSample, match="variable_frame_rate"):
        clips.verify_video((src / "jumpy.mp4").read_bytes())
    assert shards.main(["make-clips", str(src), str(tmp_path / "packed")]) == 0
    out = capsys.readouterr().out
    assert ("wrote 1 videos into 1 shards (1 unreadable skipped: broken.mkv; 1 with a variable frame rate skipped: "
            "jumpy.mp4; clips need evenly spaced frames: make-clips --segment_seconds S re-encodes them at a "
            "constant rate)") in out, out
    only = tmp_path / "only"
    only.mkdir()
    (only / "jumpy.mp4").write_bytes((src / "jumpy.mp4").read_bytes())
    assert shards.main(["make-clips", str(only), str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of the 1 video files could be packed (1 with a variable frame rate skipped: " \
        "jumpy.mp4; clips need evenly spaced frames: make-clips --segment_seconds S" in err[0], err
    assert shards.main(["make-clips", str(only), str(tmp_path / "cut"), "--segment_seconds", "1"]) == 0
    capsys.readouterr()
    segments = [s["mp4"] for _, s in sources.iter_shard(str(tmp_path / "cut" / "00000.tar"), Counter())]
    assert segments
    for mp4 in segments:
        clips.verify_video(mp4)
        video = clips.Video(mp4)
        assert len(video.read(0, video.frames)) == video.frames


def test_make_clips_cuts_long_videos_into_segments_that_start_at_a_keyframe(tmp_path, capsys):
    """make-clips --segment_seconds 2: a 10 s and a 4.7 s video at 30 fps -> 5 + 2 segments of 60 frames (the
    second one's last 20 frames dropped: shorter than half a segment), each its own sample, decodable, its first frame a
    keyframe, its frames the source's (to the re-encode's error); a portrait video comes out upright."""
    import av
    src = tmp_path / "videos"
    (src / "sub").mkdir(parents=True)
    (src / "ten.mp4").write_bytes(long_mp4(300))
    (src / "sub" / "five.mp4").write_bytes(clips.encode_clip(camera_frames(140, seed=3)[:, :32], fps=FPS,
                                                             rotation=90))
    (src / "broken.mkv").write_bytes(b"\x1a\x45\xdf\xa3 no")
    assert shards.main(["make-clips", str(src), str(tmp_path / "cut"), "--segment_seconds", "2"]) == 0
    out = capsys.readouterr().out
    assert "wrote 7 segments of 2 s of 2 videos into 1 shards (1 unreadable skipped: broken.mkv)" in out, out
    samples = {s["__key__"]: s["mp4"] for _, s in sources.iter_shard(str(tmp_path / "cut" / "00000.tar"), Counter())}
    assert sorted(samples) == [f"sub/five_{i:05d}" for i in range(2)] + [f"ten_{i:05d}" for i in range(5)]
    ten = reference(long_mp4(300))
    for key, mp4 in samples.items():
        with av.open(io.BytesIO(mp4)) as container:
            packets = [p for p in container.demux(container.streams.video[0]) if p.size]
        assert packets[0].is_keyframe and len(packets) == 60
        frames = reference(mp4)
        assert len(frames) == 60
        if key.startswith("ten_"):
            i = int(key[-5:])
            err = np.mean([(f.astype(float) - ten[60 * i + t]) ** 2 for t, f in enumerate(frames)])
            assert 10 * np.log10(255 ** 2 / err) > 30, key
        else:
            assert frames[0].shape == (64, 32, 3)  # turned upright: higher than wide


@pytest.mark.parametrize("argv, message", [
    (["--segment_seconds", "-1"], "--segment_seconds must be a positive"),
    (["--segment_seconds", "nan"], "--segment_seconds must be a positive"),
    (["--segment_crf", "60", "--segment_seconds", "2"], "--segment_crf in 0-51"),
    (["--segment_seconds", "2", "--from_photos"], "--segment_seconds cuts videos"),
])
def test_bad_make_clips_flags_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "src").mkdir()
    assert shards.main(["make-clips", str(tmp_path / "src"), str(tmp_path / "dst"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "dst").exists()


def test_a_bad_pass_length_is_one_line():
    import run_setup
    cfg = run_setup.parse_config(["--video_pass_frames", "0"])
    with pytest.raises(ConfigError, match="^--video_pass_frames must be positive, got 0$"):
        cfg.validate()
