"""Decoding real videos into (views, C, T, H, W): frame-exact against a sequential decode, resize and crop."""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch

from tests.videos import LAYOUTS, cut_with_edit_list, random_windows, remux_to_raw_h264, sequential_frames, write_video
from vaecache.demodata import DemoDataSpec, render_clip, write_demo_dataset
from vaecache.errors import VideoDecodeError
from vaecache.planning.clips import Clip, plan_clips
from vaecache.settings.clip import SamplingConfig
from vaecache.sources.discover import discover_scenes
from vaecache.sources.probing import probe_scene
from vaecache.sources.scene import Scene
from vaecache.video.backends import Backend, open_video
from vaecache.video.dataset import ViewBatchDataset, ViewDecoder
from vaecache.video.planned_reads import PlannedReads
from vaecache.video.reader import DECODER
from vaecache.video.resize import resize_cover_crop, to_model_range

H264_MEAN_ERROR = 0.075
"""Mean |decoded - source| in [-1, 1] units that the demo videos stay under (4:2:0 chroma and colour conversion
only)."""


def _to_model(frames: np.ndarray) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (C, T, H, W) in [-1, 1], the layout ViewDecoder returns."""
    return torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)


def _mean_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


WIDE = DemoDataSpec(scenes=1, cameras=1, frames=9, height=48, width=96, fps=10, seed=1)


@pytest.fixture(scope="module")
def wide_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 48x96 (H x W) video: non-square, so a 48x48 crop must come from the middle of each row."""
    (path,) = write_demo_dataset(tmp_path_factory.mktemp("wide"), WIDE)
    return path


def test_resize_cover_crop_takes_the_center() -> None:
    columns = torch.arange(8, dtype=torch.uint8).repeat(1, 3, 4, 1)  # (T=1, C=3, H=4, W=8): value = column
    cropped = resize_cover_crop(columns, 4, 4)
    assert cropped.dtype == torch.float32 and cropped.shape == (1, 3, 4, 4)
    assert cropped[0, 0, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    rows = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1).repeat(1, 3, 1, 4)  # H=8, W=4: value = row
    assert resize_cover_crop(rows, 2, 4)[0, 0, :, 0].tolist() == [3.0, 4.0]


def test_resize_cover_crop_scales_to_cover_then_crops() -> None:
    frames = torch.full((2, 3, 8, 16), 200, dtype=torch.uint8)
    frames[:, :, :, :2] = 0  # dark edge columns: outside the centered 4x4 crop of the 4x8 downscale,
    frames[:, :, :, -2:] = 0  # even counting the antialiasing filter's reach
    out = resize_cover_crop(frames, 4, 4)
    assert out.shape == (2, 3, 4, 4)
    assert torch.allclose(out, torch.full_like(out, 200.0))
    small = torch.full((1, 3, 5, 10), 100, dtype=torch.uint8)
    up = resize_cover_crop(small, 16, 16)  # upscale so that both sides cover
    assert up.shape == (1, 3, 16, 16) and torch.allclose(up, torch.full_like(up, 100.0), atol=1e-3)


def test_model_range_is_minus_one_to_one() -> None:
    out = to_model_range(torch.tensor([0.0, 127.5, 255.0, 300.0, -4.0]))
    assert out.tolist() == [-1.0, 0.0, 1.0, 1.0, -1.0]


def test_decoded_frames_match_the_source_rgb_and_centered(wide_video: Path) -> None:
    frames = (1, 3, 6)
    decoded = ViewDecoder(48, 48).decode(str(wide_video), frames)
    assert decoded.shape == (3, 3, 48, 48) and decoded.dtype == torch.float32
    assert decoded.min() >= -1.0 and decoded.max() <= 1.0
    source = _to_model(render_clip(WIDE, 0, 0))  # (C, T, 48, 96), the exact frames that were encoded

    centered = source[:, list(frames), :, 24:72]
    assert _mean_error(decoded, centered) < H264_MEAN_ERROR
    # The best-matching horizontal offset is the centered one (24 of 0..48).
    errors = [_mean_error(decoded, source[:, list(frames), :, left:left + 48]) for left in range(0, 49, 4)]
    assert int(np.argmin(errors)) * 4 == 24
    # RGB, not BGR.
    assert _mean_error(decoded, centered.flip(0)) > 3 * _mean_error(decoded, centered)
    # Each decoded frame is closest to the source frame it was asked for.
    for position, index in enumerate(frames):
        per_frame = [_mean_error(decoded[:, position], source[:, t, :, 24:72]) for t in range(WIDE.frames)]
        assert int(np.argmin(per_frame)) == index


def test_decoder_reports_unreadable_and_out_of_range(tmp_path: Path, wide_video: Path) -> None:
    from vaecache.errors import VideoDecodeError

    decoder = ViewDecoder(48, 48)
    with pytest.raises(VideoDecodeError, match="frame 9 requested, the camera has 9"):
        decoder.decode(str(wide_video), (5, 9))
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00" * 1000)
    with pytest.raises(VideoDecodeError, match="garbage.mp4: not a readable video"):
        decoder.decode(str(garbage), (0,))
    with pytest.raises(VideoDecodeError, match="file not found"):
        decoder.decode(str(tmp_path / "none.mp4"), (0,))


def test_view_batch_dataset_lays_out_views_c_t_h_w(demo_data: Path, demo_spec: DemoDataSpec) -> None:
    scenes = discover_scenes(demo_data)[:2]
    probes = {s.scene_id: probe_scene(s) for s in scenes}
    assert {(p.num_frames, p.fps) for p in probes.values()} == {(17, 10.0)}
    clips, skipped = plan_clips(scenes, probes, SamplingConfig(num_frames=4, frame_stride=2, max_clips_per_scene=1))
    assert not skipped and [c.frames for c in clips] == [(0, 2, 4, 6)] * 2
    item = ViewBatchDataset([clips], [list(range(4))], 64, 64)[0]
    assert item["index"] == 0 and item["errors"] == {}
    views = item["views"]
    assert views.shape == (4, 3, 4, 64, 64)  # (B * cameras, C, T, H, W), clip-major, camera-minor
    decoder = ViewDecoder(64, 64)
    candidates = {}  # (scene, camera, frame shift) -> the source frames
    for scene in range(2):
        for camera in range(2):
            source = _to_model(render_clip(demo_spec, scene, camera))
            for shift in (0, 1):
                candidates[scene, camera, shift] = source[:, [f + shift for f in (0, 2, 4, 6)]]
    for view, expected in zip(views, [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]):
        scene, camera, _ = expected
        assert torch.equal(view, decoder.decode(clips[scene].paths[camera], clips[scene].frames))
        errors = {key: _mean_error(view, source) for key, source in candidates.items()}
        assert min(errors, key=errors.get) == expected  # this camera, these frame indices
        assert errors[expected] < H264_MEAN_ERROR


def test_view_batch_dataset_reports_a_broken_view_without_raising(demo_data: Path, tmp_path: Path) -> None:
    good = str(demo_data / "scene_000" / "cam_0.mp4")
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"junk" * 100)
    clips = [Clip("a/000000-000002", "a", ("c0", "c1"), (good, str(broken)), (0, 1, 2), 12.0),
             Clip("b/000000-000002", "b", ("c0", "c1"), (good, good), (0, 1, 2), 12.0)]
    item = ViewBatchDataset([clips], [[0, 1, 2, 3]], 32, 32)[0]
    assert set(item["errors"]) == {0}
    path, reason, whole_file = item["errors"][0]
    assert path == str(broken) and "not a readable video" in reason and whole_file
    assert item["views"].shape == (4, 3, 3, 32, 32)
    assert torch.count_nonzero(item["views"][1]) == 0  # the failed view is a zero placeholder
    assert torch.equal(item["views"][2], item["views"][0])


def test_a_frame_budget_refuses_a_video_before_decoding_it(wide_video: Path) -> None:
    """48x96 = 4608 pixels: under a budget of 4607 the reader refuses at open, before any frame is decoded;
    the refusal condemns the file, so the next clip of it fails at once without opening it again."""
    from vaecache.video.reader import VideoReader

    with pytest.raises(VideoDecodeError, match=r"frames of 96x48 \(4,608 pixels\) exceed the decode budget of "
                                               r"4,607 pixels \(--max-frame-pixels"):
        VideoReader(str(wide_video), max_pixels=4607)
    assert len(VideoReader(str(wide_video), max_pixels=4608)) == 9
    assert len(open_video(str(wide_video))) == 9  # probing reads packets, never pixels: no budget applies
    clips = [Clip(f"w/00000{i}-00000{i + 2}", "w", ("c",), (str(wide_video),), (i, i + 1, i + 2), 10.0) for i in (0, 3)]
    dataset = ViewBatchDataset([[clip] for clip in clips], [[0], [0]], 32, 32, max_pixels=4607)
    first = dataset[0]["errors"][0]
    opened: list[str] = []
    real = dataset._decoder._reader
    dataset._decoder._reader = lambda path: opened.append(path) or real(path)
    second = dataset[1]["errors"][0]
    assert first == second and first[2] and "exceed the decode budget" in first[1]
    assert opened == []  # the second clip did not open the file again


def test_a_file_changed_since_its_index_probed_it_is_refused_naming_both(wide_video: Path, tmp_path: Path) -> None:
    import os
    import shutil

    video = Path(shutil.copy(wide_video, tmp_path / "v.mp4"))
    stat = video.stat()
    clip = Clip("v/000000-000002", "v", ("c",), (str(video),), (0, 1, 2), 10.0, expect=((9, 96, 48),),
                identity=((stat.st_size, stat.st_mtime_ns),))
    assert ViewBatchDataset([[clip]], [[0]], 32, 32)[0]["errors"] == {}
    os.utime(video, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: same bytes, other mtime
    path, reason, whole_file = ViewBatchDataset([[clip]], [[0]], 32, 32)[0]["errors"][0]
    assert (whole_file and reason.startswith("changed since it was probed (modified ")
            and "run `vaecache index` again" in reason)
    with open(video, "ab") as handle:
        handle.write(b"\0" * 7)
    _, reason, _ = ViewBatchDataset([[clip]], [[0]], 32, 32)[0]["errors"][0]
    assert f"size {stat.st_size} -> {stat.st_size + 7} bytes" in reason


def test_widths_decord_misreads_fall_back_to_pyav(tmp_path):
    import av
    import numpy as np

    from vaecache.video.dataset import ViewDecoder

    path = tmp_path / "w48.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 48, 64, "yuv420p"
        for i in range(9):
            frame = np.full((64, 48, 3), i * 20, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    views = ViewDecoder(64, 48).decode(str(path), [0, 4, 8])
    assert views.shape == (3, 3, 64, 48)
    expected = torch.tensor([0, 80, 160]) / 127.5 - 1
    assert torch.allclose(views[:, :, 32, 24].mean(0), expected, atol=0.03)


# --------------------------------------------------------------------------- frame-exact against a sequential decode


@pytest.fixture(scope="module")
def layout_videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 96x64, 72-frame video per stream layout (open-GOP h264, HEVC with B-frames, MPEG-4 AVI, mkv, webm)."""
    root = tmp_path_factory.mktemp("layouts")
    return {name: write_video(root / f"{name}{layout.suffix}", layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def references(layout_videos: dict[str, Path]) -> dict[str, list[np.ndarray]]:
    return {name: sequential_frames(path) for name, path in layout_videos.items()}


def _assert_frames(name: str, got: np.ndarray, reference: list[np.ndarray], frames: Sequence[int]) -> None:
    assert got.shape[0] == len(frames)
    for array, index in zip(got, frames):
        if not np.array_equal(array, reference[index]):
            diff = [int(np.abs(array.astype(int) - ref.astype(int)).max()) for ref in reference]
            raise AssertionError(f"{name}: frame {index} differs from the sequential decode; closest is frame "
                                 f"{int(np.argmin(diff))} (max diff there {min(diff)})")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_frame_count_is_that_of_a_sequential_decode(name: str, layout_videos: dict, references: dict) -> None:
    with open_video(str(layout_videos[name])) as reader:
        assert len(reader) == len(references[name]) == 72
        assert not reader.sequential  # these files all have usable timestamps: read by pts, seeking
        assert reader.fps() == pytest.approx(24.0, rel=1e-3)


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_random_windows_and_backward_jumps_are_frame_exact(name: str, stride: int, layout_videos: dict,
                                                           references: dict) -> None:
    """One reader, windows in random order: every frame equals the n-th frame of a straight decode."""
    rng = random.Random(f"{name}-{stride}")
    with open_video(str(layout_videos[name])) as reader:
        for frames in random_windows(72, stride, rng, 12):
            _assert_frames(name, reader.read(frames), references[name], frames)


@pytest.mark.parametrize("name", ["h264-open-gop", "hevc-bframes", "mpeg4-avi-bframes"])
def test_fresh_reader_per_clip_equals_one_reader_in_order(name: str, layout_videos: dict) -> None:
    """A DataLoader worker opens a fresh reader (which seeks); in-process decoding continues forward."""
    clips = [list(range(start, start + 16, 2)) for start in range(0, 72 - 15, 8)]
    path = str(layout_videos[name])
    with open_video(path) as reader:
        in_order = [reader.read(frames) for frames in clips]
    for frames, expected in zip(clips, in_order):
        with open_video(path) as fresh:
            assert np.array_equal(fresh.read(frames), expected)


def test_consecutive_clips_continue_without_reopening(layout_videos: dict, references: dict) -> None:
    name = "h264-open-gop"
    with open_video(str(layout_videos[name])) as reader:
        for start in range(0, 72 - 8, 9):
            frames = list(range(start, start + 9, 1))[:8]
            _assert_frames(name, reader.read(frames), references[name], frames)


def test_a_reader_bounded_to_one_ffmpeg_thread_gives_the_same_frames(layout_videos: dict, references: dict) -> None:
    """Decode workers open videos with few FFmpeg threads (vaecache.encode.numerics.decode_thread_budget): same
    pixels."""
    name = "h264-open-gop"
    with open_video(str(layout_videos[name]), Backend("pyav", DECODER, threads=1)) as reader:
        assert reader._stream.codec_context.thread_count == 1
        for frames in random_windows(72, 4, random.Random(7), 8):
            _assert_frames(name, reader.read(frames), references[name], frames)
        reader._restart()
        assert reader._stream.codec_context.thread_count == 1
    with pytest.raises(ValueError, match="decode threads must be >= 0"):
        Backend("pyav", DECODER, threads=-1)


def test_a_stream_without_timestamps_is_read_by_counting_from_the_start(layout_videos: dict, tmp_path: Path) -> None:
    """Raw h264 (open GOP, B-frames) has no pts at all: the reader counts frames of a straight decode."""
    path = remux_to_raw_h264(layout_videos["h264-open-gop"], tmp_path / "raw.h264")
    reference = sequential_frames(path)
    with open_video(str(path)) as reader:
        assert reader.sequential and len(reader) == len(reference) == 72
        for frames in random_windows(72, 3, random.Random(3), 8):
            _assert_frames("raw h264", reader.read(frames), reference, frames)


def test_edit_list_mp4_counts_only_shown_frames(tmp_path: Path) -> None:
    """An mp4 cut with `-c copy` at a non-keyframe: the edit list hides the leading frames (flagged discard)."""
    source = write_video(tmp_path / "full.mp4", LAYOUTS["h264-open-gop"], frames=60)
    cut = tmp_path / "cut.mp4"
    if not cut_with_edit_list(source, cut, start_frame=5):
        pytest.skip("this FFmpeg build's mov muxer wrote no edit list for the cut")
    reference = sequential_frames(cut)
    with open_video(str(cut)) as reader:
        assert len(reader) == len(reference)
        assert len(reference) < 60
        for frames in random_windows(len(reference), 2, random.Random(5), 10):
            _assert_frames("edit list", reader.read(frames), reference, frames)


def test_rotation_metadata_is_applied(tmp_path: Path) -> None:
    """A display matrix of 90 degrees counter-clockwise: frames come out rotated, as a player shows them."""
    path = write_video(tmp_path / "rotated.mp4", LAYOUTS["h264-open-gop"], frames=24, rotate=90)
    reference = sequential_frames(path)  # stored orientation, 64 high x 96 wide
    scene = Scene("rotated", ("video",), (str(path),))
    assert probe_scene(scene).rotations == (90,)
    with open_video(str(path)) as reader:
        got = reader.read([0, 5, 17])
        timeline = reader.timeline
    assert got.shape == (3, 96, 64, 3)
    assert timeline.rotation == 90
    with open_video(str(path), timeline=timeline) as recorded:  # the rotation comes from the timeline: no frame read
        assert recorded.rotation == 90 and np.array_equal(recorded.read([0, 5, 17]), got)
    for array, index in zip(got, (0, 5, 17)):
        assert np.array_equal(array, np.rot90(reference[index], k=1))
    try:
        import decord
    except ImportError:
        decord = None
    if decord is not None:  # decord applies the display matrix too: same direction, same pixels
        assert np.array_equal(decord.VideoReader(str(path), num_threads=1).get_batch([0, 5, 17]).asnumpy(), got)
    with open_video(str(write_video(tmp_path / "plain.mp4", LAYOUTS["h264-open-gop"], frames=4))) as plain:
        assert plain.rotation == 0 and plain.read([1]).shape == (1, 64, 96, 3)


def test_variable_frame_rate_clip_is_refused(tmp_path: Path) -> None:
    """24 fps with a 2 s gap after frame 30: a clip across the gap is a decode failure, clips around it decode."""
    milliseconds = [round(i * 1000 / 24) + (2000 if i > 30 else 0) for i in range(60)]
    path = write_video(tmp_path / "vfr.mkv", LAYOUTS["h264-mkv"], frames=60, pts=milliseconds,
                       time_base=Fraction(1, 1000))
    reference = sequential_frames(path)
    with open_video(str(path)) as reader:
        assert len(reader) == 60 and reader.fps() == pytest.approx(24.0, rel=0.02)
        times = reader.timestamps([29, 30, 31, 32])
        assert times[1] - times[0] == pytest.approx(1 / 24, abs=2e-3)
        assert times[2] - times[1] == pytest.approx(2 + 1 / 24, abs=2e-3)
        with pytest.raises(VideoDecodeError, match=r"vfr.mkv: frames 26..34 are not evenly spaced in time: 2.083 s "
                                                   r"between frames 30 and 32, 0.08\d s at the video's frame rate"):
            reader.read(list(range(26, 35, 2)))
        _assert_frames("vfr", reader.read(list(range(0, 30, 2))), reference, list(range(0, 30, 2)))
        _assert_frames("vfr", reader.read(list(range(31, 60, 3))), reference, list(range(31, 60, 3)))
    decoder = ViewDecoder(32, 32)
    clip = Clip("vfr/000026-000034", "vfr", ("video",), (str(path),), tuple(range(26, 35, 2)), 24.0)
    item = ViewBatchDataset([[clip]], [[0]], 32, 32)[0]
    assert list(item["errors"]) == [0] and "not evenly spaced" in item["errors"][0][1] and item["readings"] == {}
    after_gap = Clip("vfr/000031-000039", "vfr", ("video",), (str(path),), tuple(range(31, 40, 2)), 24.0)
    item = ViewBatchDataset([[after_gap]], [[0]], 32, 32)[0]
    assert item["errors"] == {}
    expected = [(round(i * 1000 / 24) + 2000) / 1000 for i in range(31, 40, 2)]
    assert item["readings"][0]["times"] == pytest.approx(expected)
    assert decoder.decode(str(path), (0, 1, 2)).shape == (3, 3, 32, 32)


def test_everything_runs_without_decord(wide_video: Path, tmp_path: Path) -> None:
    """decord has no aarch64 wheels: with it unimportable, probing and decoding give the same frames."""
    import json
    import subprocess
    import sys

    script = (
        "import sys, json, numpy as np\n"
        "sys.modules['decord'] = None  # any 'import decord' now raises ImportError\n"
        "from vaecache.sources.scene import Scene\nfrom vaecache.sources.probing import probe_scene\n"
        "from vaecache.video.dataset import ViewDecoder\n"
        "import vaecache.encode.command, vaecache.encode.dry_run, vaecache.verify.integrity\n"
        f"path = {str(wide_video)!r}\n"
        "probe = probe_scene(Scene('w', ('video',), (path,)))\n"
        "views = ViewDecoder(48, 48).decode(path, (1, 3, 6))\n"
        "np.save(sys.argv[1], views.numpy())\n"
        "print(json.dumps([probe.num_frames, probe.fps]))\n"
    )
    out = tmp_path / "views.npy"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [WIDE.frames, float(WIDE.fps)]
    assert torch.equal(torch.from_numpy(np.load(out)), ViewDecoder(48, 48).decode(str(wide_video), (1, 3, 6)))


def test_encode_with_and_without_workers_stores_equal_tensors(layout_videos: dict, tmp_path: Path, encode_cli,
                                                              cache_io) -> None:
    """Worker processes open fresh readers that seek; --workers 0 continues one reader forward (once
    27 of 78 clips differed between the two on open-GOP h264). Both must store the same latents, bit for bit."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("h264-open-gop", "hevc-bframes"):
        (data / layout_videos[name].name).symlink_to(layout_videos[name])
    flags = ("--num-frames", "5", "--frame-stride", "2", "--window-stride", "7", "--max-clips-per-scene", "6",
             "--batch-size", "2")
    encode_cli(data, tmp_path / "w0", *flags, "--workers", "0")
    encode_cli(data, tmp_path / "w2", *flags, "--workers", "2")
    assert len(cache_io.clips(tmp_path / "w0")) == 2 * 6
    cache_io.same_tensors(cache_io.tensors(tmp_path / "w0"), cache_io.tensors(tmp_path / "w2"))


def test_a_seek_that_lands_after_its_target_still_gives_exact_frames(layout_videos: dict, references: dict) -> None:
    """Demuxers seek by their own index and can overshoot (AVI seeking by pts landed 3 frames late): the reader
    checks the first packet after a seek and goes back further, or decodes from the start."""
    from dataclasses import replace

    name = "mpeg4-avi-bframes"
    with open_video(str(layout_videos[name])) as reader:
        reader._keyframes = [replace(key, seek_ts=key.pts + 4) for key in reader._keyframes]  # aim too late
        for frames in random_windows(72, 2, random.Random(11), 12):
            _assert_frames(name, reader.read(frames), references[name], frames)


@pytest.mark.parametrize("prefetch", [3, 0])
def test_a_video_at_a_url_over_many_blocks_is_read_frame_exactly_with_the_next_block_fetched_behind(
        prefetch: int, s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A video larger than one read block is read with the next block's GET under way while this one is decoded,
    its blocks kept (or, with BLOCKS_KEPT = 0, ahead in the foreground): the frames are the same, in any order of
    windows, and an object replaced while open is refused as before."""
    import fsspec.caching

    import vaecache.storage as storage
    from tests.s3 import make_bucket

    path = write_video(tmp_path / "video.mp4", LAYOUTS["h264-open-gop"], frames=72, height=192, width=288)
    make_bucket(s3, "blocks")
    s3.put(str(path), "blocks/video.mp4")
    monkeypatch.setattr(storage, "READ_BLOCK", 64 << 10)  # PyAV reads 32 KiB at a time: blocks larger than that
    monkeypatch.setattr(storage, "BLOCKS_KEPT", prefetch)
    assert path.stat().st_size > 3 * storage.READ_BLOCK
    reference = sequential_frames(path)
    storage.set_data_storage_options({})
    try:
        with open_video("s3://blocks/video.mp4") as reader:
            cache = reader._url_file.cache
            assert isinstance(cache, fsspec.caching.BackgroundBlockCache if prefetch else fsspec.caching.ReadAheadCache)
            for frames in random_windows(72, 2, random.Random(11), 8):
                _assert_frames("h264 at a URL", reader.read(frames), reference, frames)
            s3.pipe("blocks/video.mp4", path.read_bytes()[::-1])  # replaced while open: a block fetched now fails
            with pytest.raises(VideoDecodeError, match="changed since it was listed"):
                reader.read(list(range(0, 72, 8)))  # the whole object: more blocks than are kept, so one is fetched
    finally:
        storage.set_data_storage_options({})


def test_an_fsspec_that_does_not_close_the_background_cache_reads_ahead_in_the_foreground(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before fsspec 2026.7 a file's close left the background cache's thread and blocks to the garbage collector:
    there a large object is read as before."""
    import fsspec.caching

    import vaecache.storage as storage
    from tests.s3 import make_bucket

    make_bucket(s3, "old-fsspec")
    s3.pipe("old-fsspec/object", bytes(range(256)) * 1024)
    storage.set_data_storage_options({})
    try:
        with storage.open_url("s3://old-fsspec/object", 64 << 10, sequential=True) as handle:
            assert isinstance(handle.cache, fsspec.caching.BackgroundBlockCache)
        monkeypatch.setattr(storage, "_background_closes", lambda: False)
        with storage.open_url("s3://old-fsspec/object", 64 << 10, sequential=True) as handle:
            assert isinstance(handle.cache, fsspec.caching.ReadAheadCache)
            assert handle.read() == bytes(range(256)) * 1024
    finally:
        storage.set_data_storage_options({})


# --------------------------------------------------------------------------- the frame index from the probe


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_reader_given_its_probes_timeline_demuxes_nothing_and_reads_every_frame_exactly(
        name: str, layout_videos: dict, references: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stream layout (open-GOP h264, HEVC and MPEG-4 with B-frames, mkv, webm, LeRobot's AV1): the timeline
    as an index stores it (JSON) gives the same frame numbering, times and pixels as the packet index it came from,
    read in random windows by one reader and by a fresh reader per clip (with the whole timeline, and with a clip
    record's cut of it), and no packet is demuxed to find them."""
    import json

    from vaecache.video.reader import VideoReader
    from vaecache.video.timeline import Timeline

    path = str(layout_videos[name])
    with open_video(path) as reader:
        indexed = (len(reader), reader.times_ns(), reader.fps(), reader.rotation)
        stored = Timeline.from_json(json.loads(json.dumps(reader.timeline.to_json())), "index.jsonl:1")

    def no_index(self: VideoReader) -> None:
        raise AssertionError(f"{self.path} was demuxed to index it")

    monkeypatch.setattr(VideoReader, "_index", no_index)
    monkeypatch.setattr(VideoReader, "_read_rotation", no_index)
    rng = random.Random(name)
    with open_video(path, timeline=stored) as reader:
        assert (len(reader), reader.times_ns(), reader.fps(), reader.rotation) == indexed
        for frames in random_windows(72, 2, rng, 10):
            _assert_frames(name, reader.read(frames), references[name], frames)
    for frames in random_windows(72, 1, rng, 5):
        with open_video(path, timeline=stored) as fresh:
            _assert_frames(name, fresh.read(frames), references[name], frames)
        # a clip record's cut of it (the keyframes its frames are decoded from) reads them as exactly
        with open_video(path, timeline=stored.for_frames(frames[0], frames[-1])) as fresh:
            _assert_frames(name, fresh.read(frames), references[name], frames)


def test_a_damaged_timeline_is_a_decode_error_naming_the_video(layout_videos: dict) -> None:
    from vaecache.video.timeline import Timeline

    path = str(layout_videos["h264-mkv"])
    with open_video(path) as reader:
        good = reader.timeline
    damaged = Timeline(None, good.pts_packed[:-4] + "AAAA", good.keys_packed)
    with pytest.raises(VideoDecodeError, match="recorded frame index is damaged .*run `vaecache index` again"):
        open_video(path, timeline=damaged)


def _long_video(tmp_path: Path) -> Path:
    """480 frames (20 s at 24 fps), open-GOP h264 with a keyframe every 12: 40 GOPs, 30 clips of 16 frames."""
    return write_video(tmp_path / "long.mp4", LAYOUTS["h264-open-gop"], frames=480, height=96, width=128)


def test_one_clip_of_a_long_object_reads_its_header_index_and_gops_not_the_object(
        s3: Any, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A video at a URL holding 30 clips, its probe's timeline given: a worker decoding one clip GETs the container's
    header and index (ftyp, moov), the GOPs the clip's frames are decoded from (from the keyframe the demuxer seeks
    to) and at most one read-ahead block past them; the object's other bytes are never asked for, and the frames are
    those of a straight decode of the file."""
    import vaecache.storage as storage
    from tests.s3 import StoreProxy, make_bucket
    from vaecache.video.timeline import gop_bytes

    path = _long_video(tmp_path)
    make_bucket(s3, "long")
    s3.put(str(path), "long/long.mp4")
    reference = sequential_frames(path)
    size = path.stat().st_size
    storage.set_data_storage_options({})
    with open_video("s3://long/long.mp4") as probing:
        timeline = probing.timeline
    moov = max(end - start for start, end in timeline.head)
    assert timeline.head[-1][1] == size and moov < size / 20  # this file keeps its index at its end
    keys = timeline.keyframes()
    counting = StoreProxy(s3_endpoint, {})
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
    try:
        for clip in ([*range(100, 116)], [*range(300, 332, 2)], [*range(464, 480)]):
            storage.set_data_storage_options({})  # a fresh worker
            counting.paths.clear()
            with open_video("s3://long/long.mp4", timeline=timeline, clip=(clip[0], clip[-1])) as reader:
                _assert_frames("one clip at a URL", reader.read(clip), reference, clip)
                cache = reader._url_file.cache
                fetched, read_ahead = cache.fetched_bytes, cache.read_ahead
            # mov seeks to the sync sample before an open GOP's keyframe: from at most one GOP earlier
            first_gop = max(i for i, key in enumerate(keys) if key.frame <= clip[0])
            span = gop_bytes(keys, clip[0], clip[-1])
            head = sum(end - start for start, end in timeline.head)
            budget = head + span[1] - keys[max(0, first_gop - 1)].byte_start + read_ahead
            assert fetched <= budget, (clip, fetched, budget)
            assert fetched < size / 4, (clip, fetched, size)
            gets = [p for method, p in counting.paths if method == "GET"]
            assert len(gets) == cache.fetches <= 6, gets
    finally:
        counting.close()
        storage.set_data_storage_options({})


def test_a_small_object_with_few_clips_is_read_whole_by_one_get(s3: Any, s3_endpoint: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeline does not split a small object holding fewer than 8 clips into ranged GETs: its first GET reads it
    whole, as without one (one round trip, not one per range)."""
    import fsspec.caching

    import vaecache.storage as storage
    from tests.s3 import make_bucket

    path = _long_video(tmp_path)
    make_bucket(s3, "few")
    s3.put(str(path), "few/long.mp4")
    storage.set_data_storage_options({})
    try:
        with open_video("s3://few/long.mp4") as probing:
            timeline = probing.timeline
        with open_video("s3://few/long.mp4", timeline=timeline, clip=(0, 119)) as reader:  # 4 clips of 120
            assert isinstance(reader._url_file.cache, fsspec.caching.ReadAheadCache)
            assert np.array_equal(reader.read([0, 119])[1], sequential_frames(path)[119])
        with open_video("s3://few/long.mp4", timeline=timeline, clip=(0, 59)) as reader:  # 8 clips of 60
            assert isinstance(reader._url_file.cache, PlannedReads)
    finally:
        storage.set_data_storage_options({})


def test_a_run_probed_without_an_index_refuses_a_file_rewritten_before_it_is_decoded(tmp_path: Path) -> None:
    """With a timeline the reader takes the frame count from the probe, not the file: the probe's size and mtime are
    what catches a file rewritten between probing and decoding (the same frame count and size of frames)."""
    import os

    path = write_video(tmp_path / "v.mp4", LAYOUTS["h264-open-gop"], frames=24)
    scene = Scene("v", ("video",), (str(path),))
    planned, _ = plan_clips([scene], {"v": probe_scene(scene)}, SamplingConfig(num_frames=9))
    clip = planned[0]
    assert clip.timelines and clip.identity == ((path.stat().st_size, path.stat().st_mtime_ns),)
    assert ViewBatchDataset([[clip]], [[0]], 32, 32)[0]["errors"] == {}
    write_video(tmp_path / "other.mp4", LAYOUTS["hevc-bframes"], frames=24)
    os.replace(tmp_path / "other.mp4", path)  # other bytes, the same frame count and size
    _, reason, whole_file = ViewBatchDataset([[clip]], [[0]], 32, 32)[0]["errors"][0]
    assert whole_file and reason.startswith("changed since it was probed")


def test_a_decoder_reopens_a_video_given_another_clips_cut_of_its_timeline(layout_videos: dict,
                                                                         references: dict) -> None:
    """verify --reencode and decode read clip after clip with one ViewDecoder, each clip with its record's cut of
    the timeline (its own keyframes): a reader opened with another clip's cut is not reused for it."""
    name = "h264-open-gop"
    path = str(layout_videos[name])
    with open_video(path) as reader:
        timeline = reader.timeline
    decoder = ViewDecoder(32, 32)
    try:
        late, early = list(range(60, 68)), list(range(2, 10))
        _assert_frames(name, decoder.frames(path, late, timeline=timeline.for_frames(60, 67)), references[name], late)
        first = decoder.opened(path)
        _assert_frames(name, decoder.frames(path, early, timeline=timeline.for_frames(2, 9)), references[name], early)
        again = decoder.opened(path)
        assert again is not first and again.given_timeline == timeline.for_frames(2, 9)
        decoder.frames(path, [3, 4], timeline=timeline.for_frames(2, 9))
        assert decoder.opened(path) is again  # the same cut: the same reader, continuing
    finally:
        decoder.close()


def test_a_clip_records_damaged_or_missing_cut_is_read_by_demuxing(layout_videos: dict) -> None:
    from vaecache.video.dataset import recorded_timelines

    with open_video(str(layout_videos["h264-open-gop"])) as reader:
        cut = reader.timeline.for_frames(0, 8).to_json()
    damaged = cut.replace("|", "|*", 1)  # a packed frame list that is not one
    record = {"cameras": ["a", "b", "c", "d"], "source_timelines": [cut, damaged, None, "v9|x"]}
    assert [t is not None for t in recorded_timelines(record)] == [True, False, False, False]
    assert recorded_timelines({"cameras": ["a"]}) == [None]  # a record written before timelines
