"""Frame-exact decoding: what the decode path returns equals a straight sequential PyAV decode (frame n =
the n-th decoded frame) on streams that seeking decoders get wrong, at strides 1-3, random windows and
backward jumps in one reader; rotation is applied; unevenly spaced clips are refused."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests import videos
from vaecache.decode import FrameReader, ViewDecoder, build_index, check_even_spacing, decode_sequential
from vaecache.errors import VideoDecodeError

STREAMS: dict[str, Callable[[Path], Path]] = {
    "open-gop-h264.mp4": videos.open_gop_h264,
    "hevc-bframes.mp4": videos.hevc_bframes,
    "mpeg4-bframes.avi": videos.mpeg4_avi_bframes,
    "vp9.webm": videos.vp9_webm,
}


@pytest.fixture(scope="module")
def stream_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("streams")
    files = {name: make(folder / name) for name, make in STREAMS.items()}
    files["edit-list.mp4"] = videos.edit_list_cut(files["open-gop-h264.mp4"], folder / "edit-list.mp4", 40)
    return files


def _windows(total: int, seed: int) -> list[list[int]]:
    """Clip windows at strides 1-3 in order, then random ones (backward jumps included)."""
    rng = random.Random(seed)
    windows = []
    for stride in (1, 2, 3):
        span = 8 * stride + 1
        windows += [list(range(start, start + span, stride)) for start in range(0, total - span + 1, 9)]
        windows += [list(range(s, s + span, stride)) for s in (rng.randrange(total - span + 1) for _ in range(8))]
    return windows


@pytest.mark.parametrize("name", [*STREAMS, "edit-list.mp4"])
def test_one_reader_returns_exactly_the_sequentially_decoded_frames(stream_files: dict[str, Path], name: str) -> None:
    path = str(stream_files[name])
    reference = decode_sequential(path)
    reader = FrameReader(path)
    assert len(reader) == len(reference)
    for frames in _windows(len(reference), seed=len(name)):
        got = reader.read(frames)
        for position, index in enumerate(frames):
            assert np.array_equal(got[position], reference[index]), f"{name}: frame {index} (window {frames[:3]}...)"


@pytest.mark.parametrize("name", ["open-gop-h264.mp4", "hevc-bframes.mp4", "mpeg4-bframes.avi", "edit-list.mp4"])
def test_a_fresh_reader_per_clip_equals_one_reader_for_all(stream_files: dict[str, Path], name: str) -> None:
    """What a DataLoader worker sees (a new reader, a seek) equals what --workers 0 sees (one reader)."""
    path = str(stream_files[name])
    shared = FrameReader(path)
    for frames in _windows(build_index(path).num_frames, seed=7):
        assert np.array_equal(FrameReader(path).read(frames), shared.read(frames)), frames


def test_an_edit_list_counts_only_the_frames_that_are_shown(stream_files: dict[str, Path]) -> None:
    """The cut file keeps 16 frames before its start point behind an edit list; they are not frames."""
    index = build_index(str(stream_files["edit-list.mp4"]))
    assert index.num_frames == 80 == len(decode_sequential(str(stream_files["edit-list.mp4"])))


def test_rotation_metadata_is_applied(tmp_path: Path) -> None:
    path = str(videos.rotated_h264(tmp_path / "phone.mp4", rotation=90))
    index = build_index(path)
    assert index.rotation == 90 and index.upright_size == (videos.WIDTH, videos.HEIGHT)
    import av

    with av.open(path) as container:
        stored = next(container.decode(video=0)).to_ndarray(format="rgb24")
    got = FrameReader(path).read([0])[0]
    assert got.shape == (videos.WIDTH, videos.HEIGHT, 3)
    assert np.array_equal(got, np.rot90(stored, k=1))  # counter-clockwise, as the display matrix says
    decoded = ViewDecoder(32, 48).decode(path, [0, 1, 2])
    assert decoded.shape == (3, 3, 32, 48)


def test_unevenly_spaced_frames_are_refused(tmp_path: Path) -> None:
    path = str(videos.variable_rate_h264(tmp_path / "vfr.mp4", frames=40, gap_after=20, gap_s=2.0))
    index = build_index(path)
    assert check_even_spacing(index, list(range(0, 10))) is None
    reason = check_even_spacing(index, list(range(15, 25)))
    assert reason is not None and "not evenly spaced" in reason and "frames 20 and 21" in reason
    with pytest.raises(VideoDecodeError, match="variable frame rate"):
        ViewDecoder(32, 32).decode(path, list(range(15, 25)))
    assert ViewDecoder(32, 32).decode(path, list(range(25, 35))).shape == (3, 10, 32, 32)


def test_not_a_video_is_one_decode_error_naming_the_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.mp4"
    text.write_text("hello")
    with pytest.raises(VideoDecodeError, match="not a readable video") as caught:
        build_index(str(text))
    assert caught.value.path == str(text)
    empty = tmp_path / "empty.mp4"
    empty.touch()
    with pytest.raises(VideoDecodeError, match="empty file"):
        build_index(str(empty))


def test_a_frame_past_the_end_is_a_decode_error(stream_files: dict[str, Path]) -> None:
    reader = FrameReader(str(stream_files["vp9.webm"]))
    with pytest.raises(VideoDecodeError, match="frame 60 requested, video has 60"):
        reader.read([58, 59, 60])


def test_decoding_never_needs_decord(stream_files: dict[str, Path]) -> None:
    """decord has no aarch64 wheels: the decode path must give the same frames where it is missing."""
    path = str(stream_files["open-gop-h264.mp4"])
    code = (
        "import sys, numpy as np; sys.modules['decord'] = None\n"
        "from vaecache.decode import ViewDecoder\n"
        f"np.save(sys.argv[1], ViewDecoder(64, 96).decode({path!r}, list(range(3, 30, 3))).numpy())\n"
    )
    out = Path(path).with_suffix(".npy")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, timeout=120)
    here = ViewDecoder(64, 96).decode(path, list(range(3, 30, 3))).numpy()
    assert np.array_equal(np.load(out), here)


def test_encode_with_and_without_decode_workers_stores_equal_latents(tmp_path: Path, cache_io) -> None:
    """Open-GOP footage at --frame-stride 2: a fresh reader per worker used to mis-seek (27 of 78 clips)."""
    from tests.conftest import encode_ok

    data = tmp_path / "data"
    for scene in ("drive_a", "drive_b"):
        (data / scene).mkdir(parents=True)
        videos.open_gop_h264(data / scene / "front.mp4")
    common = ("--size", "64x96", "--frame-stride", "2", "--window-stride", "11", "--max-clips-per-scene", "4")
    encode_ok(data, tmp_path / "w0", *common, "--workers", "0")
    encode_ok(data, tmp_path / "w2", *common, "--workers", "2", "--batch-size", "2")
    tensors = cache_io.tensors(tmp_path / "w0")
    assert len(tensors) == 2 * 4 * 2  # scenes x clips x (mean, logvar)
    cache_io.same_tensors(tensors, cache_io.tensors(tmp_path / "w2"))
