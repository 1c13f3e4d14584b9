"""--decoder backends against the reference: frame n of a straight PyAV decode from the start.

Every available backend must return that frame for random and strided windows on streams with B-frames
(open-GOP h264, HEVC, MPEG-4 AVI); the backends vaecache calls byte-identical (IDENTICAL_TO_PYAV, the only ones
--decoder auto may pick) must return it byte for byte. Rotated and variable-frame-rate files are handled the
way the PyAV reader handles them, or refused naming the file. A backend that cannot be imported here
(torchcodec without FFmpeg shared libraries) is skipped with the reason.
"""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests.videos import LAYOUTS, cut_with_edit_list, random_windows, sequential_frames, write_video
from vaecache.cli.encode import build_config
from vaecache.errors import UsageError, VideoDecodeError
from vaecache.settings.parts import DecodeConfig
from vaecache.video.backends import (
    AUTO_ORDER,
    DECORD_DECODER,
    IDENTICAL_TO_PYAV,
    PYAV,
    backend_for_record,
    backend_unavailable,
    open_video,
    resolve_decoder,
)
from vaecache.video.dataset import ViewDecoder
from vaecache.video.reader import DECODER

BACKENDS = ("pyav", "decord", "torchcodec")
STREAMS = ("h264-open-gop", "hevc-bframes", "mpeg4-avi-bframes")
"""h264 with B-frames and open GOP, and the two layouts decord's seeking got most wrong."""
FRAMES = 48
COLOUR_TOLERANCE = 3.0
"""Mean |backend - reference| in 0..255 levels allowed to a backend not claimed byte-identical (another
yuv->rgb conversion); neighbouring test frames differ by more than 20 (tests/videos.py)."""


def _backend(choice: str):
    reason = backend_unavailable(choice)
    if reason is not None:
        pytest.skip(reason)
    return resolve_decoder(choice)


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[np.ndarray]]]:
    root = tmp_path_factory.mktemp("decoders")
    out = {}
    for name in STREAMS:
        path = write_video(root / f"{name}{LAYOUTS[name].suffix}", LAYOUTS[name], frames=FRAMES)
        out[name] = (path, sequential_frames(path))
    return out


def _check(choice: str, got: np.ndarray, reference: list[np.ndarray], frames: list[int]) -> None:
    """Frame identity (nearest reference frame by mean abs difference is frame n), and bytes where claimed."""
    assert got.shape[0] == len(frames)
    for array, index in zip(got, frames):
        errors = [float(np.abs(array.astype(np.int16) - ref).mean()) for ref in reference]
        nearest = int(np.argmin(errors))
        assert nearest == index, f"{choice}: frame {index} came back as frame {nearest}"
        assert errors[index] <= COLOUR_TOLERANCE, f"{choice}: frame {index} is {errors[index]:.2f} levels off"
        if choice in IDENTICAL_TO_PYAV:
            assert np.array_equal(array, reference[index]), f"{choice}: frame {index} is not byte-identical"


@pytest.mark.parametrize("choice", BACKENDS)
@pytest.mark.parametrize("name", STREAMS)
def test_random_and_strided_windows_are_frame_n_of_a_sequential_decode(choice: str, name: str, streams: dict) -> None:
    """One reader, windows in random order (so reads jump backwards), strides 1-3; then fresh readers per clip."""
    backend = _backend(choice)
    path, reference = streams[name]
    rng = random.Random(f"{choice}-{name}")
    with open_video(str(path), backend) as reader:
        assert len(reader) == FRAMES
        for stride in (1, 2, 3):
            for frames in random_windows(FRAMES, stride, rng, 4, longest=6):
                _check(choice, reader.read(frames), reference, frames)
    for start in (0, 17, 30):
        frames = list(range(start, start + 16, 2))
        with open_video(str(path), backend) as fresh:  # a new reader for each clip, as a DataLoader worker opens
            _check(choice, fresh.read(frames), reference, frames)
            timeline = getattr(fresh, "index", fresh).timeline
        with open_video(str(path), backend, timeline=timeline) as recorded:  # the probe's frame index given
            _check(choice, recorded.read(frames), reference, frames)


def test_decords_own_seeking_returns_neighbouring_frames(streams: dict) -> None:
    """Why DecordReader never seeks: decord's get_batch gives other frames than asked on these streams."""
    decord = pytest.importorskip("decord")
    path, reference = streams["hevc-bframes"]
    frames = [5, 20, 33, 41]
    got = decord.VideoReader(str(path), num_threads=1).get_batch(frames).asnumpy()
    assert any(not np.array_equal(array, reference[index]) for array, index in zip(got, frames))


def test_auto_picks_only_byte_identical_backends() -> None:
    assert set(AUTO_ORDER) <= IDENTICAL_TO_PYAV
    assert "torchcodec" not in IDENTICAL_TO_PYAV  # never measured: no FFmpeg shared libraries where it was written
    picked = resolve_decoder("auto")
    assert picked == PYAV and picked.name == DECODER  # the fastest identical one, and always available


def test_recorded_names_map_back_to_their_backend() -> None:
    assert backend_for_record(None) == PYAV and backend_for_record(DECODER) == PYAV  # caches from before --decoder
    if backend_unavailable("decord") is None:
        assert backend_for_record(DECORD_DECODER) == resolve_decoder("decord")
    with pytest.raises(UsageError, match="decoded with 'opencv/9'"):
        backend_for_record("opencv/9")


def test_an_unimportable_backend_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "decord", None)  # import decord now raises ImportError
    with pytest.raises(UsageError, match="--decoder decord: decord cannot be imported"):
        resolve_decoder("decord")
    assert resolve_decoder("auto") == PYAV
    with pytest.raises(UsageError, match="--decoder must be one of"):
        resolve_decoder("opencv")


@pytest.mark.parametrize("choice", BACKENDS)
def test_rotation_is_applied_as_pyav_does(choice: str, tmp_path: Path) -> None:
    backend = _backend(choice)
    for degrees in (90, 180, 270):
        path = write_video(tmp_path / f"rot{degrees}.mp4", LAYOUTS["h264-open-gop"], frames=12, rotate=degrees)
        upright = [np.rot90(frame, k=degrees // 90) for frame in sequential_frames(path)]  # as a player shows it
        with open_video(str(path), backend) as reader:
            _check(choice, reader.read([0, 5, 11]), upright, [0, 5, 11])


@pytest.mark.parametrize("choice", BACKENDS)
def test_variable_frame_rate_clip_is_refused_by_every_backend(choice: str, tmp_path: Path) -> None:
    backend = _backend(choice)
    milliseconds = [round(i * 1000 / 24) + (2000 if i > 20 else 0) for i in range(40)]
    path = write_video(tmp_path / "vfr.mkv", LAYOUTS["h264-mkv"], frames=40, pts=milliseconds,
                       time_base=Fraction(1, 1000))
    reference = sequential_frames(path)
    with open_video(str(path), backend) as reader:
        with pytest.raises(VideoDecodeError, match="vfr.mkv: frames 16..24 are not evenly spaced in time"):
            reader.read(list(range(16, 25, 2)))
        assert reader.timestamps([20, 21])[1] == pytest.approx(milliseconds[21] / 1000)
        for frames in (list(range(0, 20, 3)), list(range(21, 40, 2))):
            _check(choice, reader.read(frames), reference, frames)


def test_view_decoder_uses_its_backend(streams: dict) -> None:
    """The DataLoader's decoder: decord's views equal pyav's bit for bit (hence equal latents)."""
    backend = _backend("decord")
    path = str(streams["h264-open-gop"][0])
    clip = (3, 7, 11, 15, 19)
    pyav = ViewDecoder(32, 48).decode(path, clip)
    other = ViewDecoder(32, 48, backend=backend)
    assert isinstance(other._reader(path), type(open_video(path, backend)))
    assert np.array_equal(other.decode(path, clip).numpy(), pyav.numpy())


def test_decoder_setting_is_validated_and_kept_out_of_the_latents_record(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--decoder must be one of auto, pyav, decord, torchcodec, got 'nvdec'"):
        DecodeConfig(decoder="nvdec")
    flags = {"out": tmp_path / "o", "vae": "builtin:tiny", "num_frames": 5, "size": "32x32"}
    decord = build_config(tmp_path, {**flags, "decoder": "decord"}, None)
    assert decord.decode.decoder == "decord"
    # the clip settings' record is the latents' record: the decoder is recorded as "decoder" instead
    assert decord.clip.to_record() == build_config(tmp_path, flags, None).clip.to_record()


def test_encode_with_decord_stores_pyavs_latents_under_its_own_fingerprint(demo_data: Path, tmp_path: Path,
                                                                           encode_cli: Callable, run_cli: Callable,
                                                                           cache_io) -> None:
    """Identical frames, hence identical latents; yet a cache never mixes decoders (resume is refused)."""
    _backend("decord")
    encode_cli(demo_data, tmp_path / "pyav", "--decoder", "pyav")
    encode_cli(demo_data, tmp_path / "decord", "--decoder", "decord")
    assert cache_io.manifest(tmp_path / "pyav")["settings"]["decoder"] == DECODER
    assert cache_io.manifest(tmp_path / "decord")["settings"]["decoder"] == DECORD_DECODER
    cache_io.same_tensors(cache_io.tensors(tmp_path / "pyav"), cache_io.tensors(tmp_path / "decord"))
    result = run_cli(["encode", demo_data, "--out", tmp_path / "pyav", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x64", "--workers", "0", "--no-progress", "--decoder", "decord"])
    assert result.exit_code == 2 and "decoder" in result.output, result.output
    verify = run_cli(["verify", tmp_path / "decord", "--reencode", "2", "--device", "cpu"])
    assert verify.exit_code == 0, verify.output


@pytest.mark.parametrize("width", [16, 24, 48, 72])
def test_widths_decord_pads_are_unpadded_byte_identical(width: int, tmp_path: Path) -> None:
    """decord returns padded rows at widths that are not a multiple of 32; DecordReader cuts the padding off."""
    backend = _backend("decord")
    path = write_video(tmp_path / f"w{width}.mp4", LAYOUTS["h264-open-gop"], frames=8, height=32, width=width)
    reference = sequential_frames(path)
    with open_video(str(path), backend) as reader:
        _check("decord", reader.read([1, 4, 7]), reference, [1, 4, 7])


def test_decord_refuses_an_edit_list_mp4_it_counts_differently(tmp_path: Path) -> None:
    """decord shows the frames an edit list hides: its count disagrees with a straight decode, so it is refused."""
    backend = _backend("decord")
    source = write_video(tmp_path / "full.mp4", LAYOUTS["h264-open-gop"], frames=36)
    if not cut_with_edit_list(source, tmp_path / "cut.mp4", start_frame=5):
        pytest.skip("this FFmpeg build's mov muxer wrote no edit list for the cut")
    count = len(sequential_frames(tmp_path / "cut.mp4"))
    with pytest.raises(VideoDecodeError, match=rf"cut.mp4: decord counts \d+ frames, a straight decode gives {count}"):
        open_video(str(tmp_path / "cut.mp4"), backend)


def test_decoder_comes_from_the_toml_config_and_the_flag_wins(tmp_path: Path) -> None:
    from vaecache.cli.encode import build_config

    config = tmp_path / "encode.toml"
    config.write_text('vae = "builtin:tiny"\nnum-frames = 5\nsize = "32x32"\ndecoder = "decord"\n')
    assert build_config(tmp_path, {"out": tmp_path / "out"}, config).decode.decoder == "decord"
    assert build_config(tmp_path, {"out": tmp_path / "out", "decoder": "pyav"}, config).decode.decoder == "pyav"
    config.write_text('vae = "builtin:tiny"\nnum-frames = 5\nsize = "32x32"\ndecoder = "ffmpeg"\n')
    with pytest.raises(UsageError, match="--decoder must be one of"):
        build_config(tmp_path, {"out": tmp_path / "out"}, config)


def test_decord_refuses_10_bit_420_whose_colours_differ(tmp_path: Path) -> None:
    """yuv420p10le (10-bit phone HEVC): decord's frames are the right ones, 0.67 levels off pyav's on average."""
    from dataclasses import replace

    backend = _backend("decord")
    path = write_video(tmp_path / "ten.mp4", replace(LAYOUTS["h264-open-gop"], pix_fmt="yuv420p10le"), frames=6)
    with pytest.raises(VideoDecodeError, match="ten.mp4: pixel format yuv420p10le: decord's RGB is not known"):
        open_video(str(path), backend)


# --------------------------------------------------------------------------- torchcodec's checks, on a stand-in


class _StandInDecoder:
    """torchcodec.decoders.VideoDecoder's calls vaecache makes, answered from a straight PyAV decode: frames in
    presentation order, upright as torchcodec documents (unless `rotate` is off), `shift` frames late (a
    mis-seek), `tint` levels brighter (another colour conversion)."""

    shift = 0
    rotate = True
    tint = 0

    def __init__(self, path: str, device: str = "cpu", seek_mode: str = "exact", dimension_order: str = "NCHW") -> None:
        import av
        import torch

        assert (seek_mode, dimension_order) == ("exact", "NHWC")
        self._torch = torch
        with av.open(path) as container:
            decoded = [(float(f.pts * f.time_base), int(f.rotation or 0), f.to_ndarray(format="rgb24"))
                       for f in container.decode(video=0)]
        self._frames = [(t, (np.rot90(a, k=r // 90 if self.rotate else 0) + np.int16(self.tint)).clip(0, 255)
                         .astype(np.uint8)) for t, r, a in decoded]

    def get_frame_at(self, index: int):
        from types import SimpleNamespace

        seconds, array = self._frames[index]
        return SimpleNamespace(data=self._torch.from_numpy(array), pts_seconds=seconds)

    def get_frames_at(self, indices: list[int]):
        from types import SimpleNamespace

        picked = [self._frames[min(i + self.shift, len(self._frames) - 1)] for i in indices]
        return SimpleNamespace(data=self._torch.from_numpy(np.stack([a for _, a in picked])),
                               pts_seconds=self._torch.tensor([t for t, _ in picked], dtype=self._torch.float64))


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    """Install _StandInDecoder as torchcodec.decoders.VideoDecoder; yields a subclass whose knobs a test sets."""
    import sys
    import types

    decoder = type("VideoDecoder", (_StandInDecoder,), {})
    package, decoders = types.ModuleType("torchcodec"), types.ModuleType("torchcodec.decoders")
    decoders.VideoDecoder = decoder  # type: ignore[attr-defined]
    package.decoders = decoders  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchcodec", package)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)
    return decoder


def test_torchcodec_reader_is_frame_exact_and_catches_a_wrong_frame(stand_in, streams: dict) -> None:
    backend = resolve_decoder("torchcodec")
    assert backend.name == "torchcodec-cpu/1" and backend.choice not in IDENTICAL_TO_PYAV
    assert resolve_decoder("auto") == PYAV  # importable, yet never picked: not known to be byte-identical
    path, reference = streams["h264-open-gop"]
    stand_in.tint = 1  # a rounding difference: the right frames, not byte-identical, within tolerance
    with open_video(str(path), backend) as reader:
        for frames in ([0, 2, 4, 6], [40, 41, 42], [7, 10, 13, 16]):
            _check("torchcodec", reader.read(frames), reference, frames)
    stand_in.shift = 1
    with open_video(str(path), backend) as reader:
        with pytest.raises(VideoDecodeError, match=r"torchcodec returned the frame at 0.2\d+ s for frame 5 \(at 0.20"):
            reader.read([5, 9])


def test_torchcodec_reader_refuses_frames_that_are_not_upright(stand_in, tmp_path: Path) -> None:
    path = write_video(tmp_path / "rot90.mp4", LAYOUTS["h264-open-gop"], frames=6, rotate=90)
    with open_video(str(path), resolve_decoder("torchcodec")) as reader:  # upright: accepted
        assert reader.read([1]).shape == (1, 96, 64, 3)
    stand_in.rotate = False
    with pytest.raises(VideoDecodeError, match=r"rot90.mp4: torchcodec's frame 0 \(96x64\) is not PyAV's \(64x96, "
                                               r"display rotation 90\)"):
        open_video(str(path), resolve_decoder("torchcodec"))


def test_torchcodec_on_cuda_needs_workers_0(stand_in) -> None:
    backend = resolve_decoder("torchcodec", "cuda:1", workers=0)
    assert (backend.name, backend.device) == ("torchcodec-cuda/1", "cuda:1")
    with pytest.raises(UsageError, match="--workers 0"):
        resolve_decoder("torchcodec", "cuda", workers=2)


def test_plan_reports_the_resolved_decoder_and_refuses_an_unusable_one(demo_data: Path, run_cli: Callable,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import sys

    args = ["plan", demo_data, "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--no-measure"]
    if backend_unavailable("decord") is None:
        result = run_cli([*args, "--decoder", "decord", "--json", "-"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout[result.stdout.index("{"):])["config"]["decoder"] == DECORD_DECODER
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # as where it is not installed
    result = run_cli([*args, "--decoder", "torchcodec"])
    assert result.exit_code == 2 and "--decoder torchcodec: torchcodec cannot be imported" in result.output
