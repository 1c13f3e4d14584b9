"""The synthetic demo dataset: layout, readability (vaecache's reader; decord where installed), motion, variety,
determinism."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch

from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.errors import UsageError
from vaecache.video.backends import open_video

SPEC = DemoDataSpec(scenes=2, cameras=2, frames=9, height=48, width=64, fps=12, seed=3)


def _decode(path: Path) -> np.ndarray:
    with open_video(str(path)) as reader:
        return reader.read(range(len(reader)))


def _mad(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean())


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("demo") / "data"  # missing root: must be created
    return root, write_demo_dataset(root, SPEC)


@pytest.fixture(scope="module")
def decoded(dataset: tuple[Path, list[Path]]) -> dict[str, np.ndarray]:
    root, paths = dataset
    return {p.relative_to(root).as_posix(): _decode(p) for p in paths}


def test_layout_is_scene_camera_mp4(dataset: tuple[Path, list[Path]]) -> None:
    root, paths = dataset
    expected = [root / f"scene_{s:03d}" / f"cam_{c}.mp4" for s in range(2) for c in range(2)]
    assert paths == expected
    on_disk = sorted(p for p in root.rglob("*") if p.is_file())
    assert on_disk == expected  # no temp files or extras left behind


def test_reader_gets_frames_size_fps(dataset: tuple[Path, list[Path]]) -> None:
    for path in dataset[1]:
        with open_video(str(path)) as reader:
            assert len(reader) == SPEC.frames
            assert reader.read([0]).shape == (1, SPEC.height, SPEC.width, 3)
            assert reader.fps() == pytest.approx(SPEC.fps)


def test_decord_where_installed_reads_the_same_frames(decoded: dict[str, np.ndarray],
                                                      dataset: tuple[Path, list[Path]]) -> None:
    """decord is optional (no aarch64 or macOS arm wheels); vaecache never needs it, but where it is installed a
    straight read of the demo data gives exactly the frames vaecache decodes."""
    decord = pytest.importorskip("decord")
    root, paths = dataset
    for path in paths:
        reader = decord.VideoReader(str(path), num_threads=1)
        assert len(reader) == SPEC.frames and reader.get_avg_fps() == pytest.approx(SPEC.fps)
        assert np.array_equal(reader.get_batch(list(range(len(reader)))).asnumpy(),
                              decoded[path.relative_to(root).as_posix()])


def test_content_moves_and_varies(decoded: dict[str, np.ndarray]) -> None:
    for frames in decoded.values():
        assert _mad(frames[0], frames[-1]) > 10.0
        assert _mad(frames[0], frames[1]) > 1.0  # motion between consecutive frames too
    assert _mad(decoded["scene_000/cam_0.mp4"], decoded["scene_000/cam_1.mp4"]) > 20.0
    assert _mad(decoded["scene_000/cam_0.mp4"], decoded["scene_001/cam_0.mp4"]) > 20.0
    assert _mad(decoded["scene_001/cam_0.mp4"], decoded["scene_001/cam_1.mp4"]) > 20.0


def test_same_spec_gives_identical_bytes(
    tmp_path: Path, dataset: tuple[Path, list[Path]], decoded: dict[str, np.ndarray]
) -> None:
    root, paths = dataset
    again = write_demo_dataset(tmp_path, SPEC)
    assert [p.relative_to(tmp_path) for p in again] == [p.relative_to(root) for p in paths]
    for first, second in zip(paths, again):
        assert np.array_equal(decoded[first.relative_to(root).as_posix()], _decode(second))
        assert first.read_bytes() == second.read_bytes()


def test_rewrite_overwrites_in_place(tmp_path: Path) -> None:
    spec = DemoDataSpec(scenes=1, cameras=1, frames=2, height=16, width=18)
    (path,) = write_demo_dataset(tmp_path, spec)
    path.write_bytes(b"garbage")
    assert write_demo_dataset(tmp_path, spec) == [path]
    assert len(_decode(path)) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["cam_0.mp4"]


def test_different_seed_gives_different_frames(
    tmp_path: Path, dataset: tuple[Path, list[Path]], decoded: dict[str, np.ndarray]
) -> None:
    spec = DemoDataSpec(scenes=1, cameras=1, frames=SPEC.frames, height=48, width=64, fps=12, seed=4)
    (other,) = write_demo_dataset(tmp_path, spec)
    assert _mad(decoded["scene_000/cam_0.mp4"], _decode(other)) > 20.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"height": 63}, "height must be even"),
        ({"width": 15}, "width must be even"),
        ({"width": 14}, "width must be even and >= 16"),
        ({"scenes": 0}, "scenes must be >= 1"),
        ({"cameras": 0}, "cameras must be >= 1"),
        ({"frames": 0}, "frames must be >= 1"),
        ({"fps": 0}, "fps must be >= 1"),
        ({"frames": 2.5}, "frames must be an integer"),
        ({"seed": -1}, "seed must be >= 0"),
    ],
)
def test_bad_spec_raises_usage_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        DemoDataSpec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("height", "width"), [(16, 18), (18, 20), (16, 96)])
def test_small_sizes_read_back(tmp_path: Path, height: int, width: int) -> None:
    spec = DemoDataSpec(scenes=1, cameras=1, frames=3, height=height, width=width)
    (path,) = write_demo_dataset(tmp_path, spec)
    assert _decode(path).shape == (3, height, width, 3)


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        write_demo_dataset(root, DemoDataSpec(scenes=1, cameras=1, frames=1))


@pytest.mark.parametrize("width", [16, 24, 48, 72])
def test_widths_decord_misreads_still_decode_through_vaecache(tmp_path: Path, width: int) -> None:
    from vaecache.video.dataset import ViewDecoder

    spec = DemoDataSpec(scenes=1, cameras=1, frames=3, height=32, width=width)
    (path,) = write_demo_dataset(tmp_path, spec)
    views = ViewDecoder(32, width).decode(str(path), [0, 2])
    with av.open(str(path)) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    expected = torch.from_numpy(frames[[0, 2]]).permute(3, 0, 1, 2).float() / 127.5 - 1
    assert views.shape == (3, 2, 32, width)
    assert torch.equal(views, expected)
