"""Dataset layouts, pure clip planning and sharding, and decoding real mp4s into (views, C, T, H, W)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vaecache.config import SamplingConfig
from vaecache.dataset import (
    Scene, ViewBatchDataset, ViewDecoder, discover_scenes, probe_scene, resize_cover_crop, to_model_range,
)
from vaecache.demodata import DemoDataSpec, render_clip, write_demo_dataset
from vaecache.errors import DatasetError, UsageError
from vaecache.planning import Clip, plan_clips

H264_MEAN_ERROR = 0.075
"""Mean |decoded - source| in [-1, 1] units that the demo videos stay under (4:2:0 chroma and colour conversion only)."""


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not decoded by discovery")
    return path


def _to_model(frames: np.ndarray) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (C, T, H, W) in [-1, 1], the layout ViewDecoder returns."""
    return torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)


def _mean_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


# --------------------------------------------------------------------------- real videos


WIDE = DemoDataSpec(scenes=1, cameras=1, frames=9, height=48, width=96, fps=10, seed=1)


@pytest.fixture(scope="module")
def wide_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 48x96 (H x W) video: non-square, so a 48x48 crop must come from the middle of each row."""
    (path,) = write_demo_dataset(tmp_path_factory.mktemp("wide"), WIDE)
    return path


# --------------------------------------------------------------------------- discovery: multi-camera folder


def test_multicamera_folder_orders_cameras_by_name(tmp_path: Path) -> None:
    for scene in ("s2", "s1"):
        for camera in ("right", "left", "center"):
            _touch(tmp_path / scene / f"{camera}.mp4")
    scenes = discover_scenes(tmp_path)
    assert [s.scene_id for s in scenes] == ["s1", "s2"]
    for scene in scenes:
        assert scene.cameras == ("center", "left", "right")
        assert scene.paths == tuple(str((tmp_path / scene.scene_id / f"{c}.mp4").resolve()) for c in scene.cameras)
        assert scene.frame_range is None


def test_multicamera_folder_uses_the_given_camera_order(tmp_path: Path) -> None:
    for camera in ("a", "b", "c"):
        _touch(tmp_path / "scene" / f"{camera}.mp4")
    (scene,) = discover_scenes(tmp_path, cameras=["c", "a", "b"])
    assert scene.cameras == ("c", "a", "b")
    assert [Path(p).stem for p in scene.paths] == ["c", "a", "b"]


def test_camera_flag_also_selects_cameras(demo_data: Path) -> None:
    scenes = discover_scenes(demo_data, cameras=["cam_1"])
    assert [s.cameras for s in scenes] == [("cam_1",)] * 3
    assert all(s.paths[0].endswith("/cam_1.mp4") for s in scenes)


def test_a_camera_no_scene_has_is_a_typo_not_a_skip(demo_data: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"camera\(s\) cam_9 from --cameras are in no scene \(cameras found: cam_0"):
        discover_scenes(demo_data, cameras=["cam_0", "cam_9"])
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "a", "cameras": {"front": "a.mp4"}}) + "\n")
    with pytest.raises(DatasetError, match=r"camera\(s\) back from --cameras are in no scene"):
        discover_scenes(index, cameras=["front", "back"])


def test_a_folder_named_like_a_video_is_reported_not_ignored(demo_data: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(demo_data / "scene_000", data / "scene_000")
    (data / "scene_000" / "cam_1.mp4").unlink()
    (data / "scene_000" / "cam_1.mp4").mkdir()
    (scene,) = discover_scenes(data)
    assert scene.cameras == ("cam_0", "cam_1")
    probe = probe_scene(scene)
    assert probe.error == "not a regular file" and probe.error_path == str((data / "scene_000" / "cam_1.mp4").resolve())


def test_multicamera_folder_ignores_hidden_and_non_video_files(tmp_path: Path) -> None:
    _touch(tmp_path / "scene" / "cam_0.mp4")
    _touch(tmp_path / "scene" / "notes.txt")
    _touch(tmp_path / "scene" / ".cam_1.mp4")
    _touch(tmp_path / ".cache" / "cam_0.mp4")
    (scene,) = discover_scenes(tmp_path)
    assert (scene.scene_id, scene.cameras) == ("scene", ("cam_0",))


def test_scene_missing_a_camera_is_skipped_and_reported(demo_data: Path, tmp_path: Path) -> None:
    data = Path(shutil.copytree(demo_data, tmp_path / "data"))
    (data / "scene_001" / "cam_1.mp4").unlink()
    scenes = discover_scenes(data)
    assert [s.cameras for s in scenes] == [("cam_0", "cam_1")] * 3
    probes = {s.scene_id: probe_scene(s) for s in scenes}
    clips, skipped = plan_clips(scenes, probes, SamplingConfig(num_frames=9))
    assert [c.clip_id for c in clips] == ["scene_000/000000-000008", "scene_002/000000-000008"]
    (skip,) = skipped
    assert skip.scene_id == "scene_001"
    assert "cam_1" in skip.reason and "missing" in skip.reason


def test_cameras_with_different_frame_counts_are_reported(tmp_path: Path) -> None:
    write_demo_dataset(tmp_path / "a", DemoDataSpec(scenes=1, cameras=1, frames=9, height=32, width=32))
    write_demo_dataset(tmp_path / "b", DemoDataSpec(scenes=1, cameras=1, frames=5, height=32, width=32))
    scene = Scene("s", ("a", "b"), (str(tmp_path / "a/scene_000/cam_0.mp4"), str(tmp_path / "b/scene_000/cam_0.mp4")))
    probe = probe_scene(scene)
    assert probe.error is not None and "'b' has 5 frames" in probe.error
    assert probe.error_path == scene.paths[1]


# --------------------------------------------------------------------------- discovery: single-camera folder


def test_folder_of_videos_is_one_camera_per_scene(tmp_path: Path) -> None:
    for name in ("b.mp4", "a.MOV", "c.mkv", "readme.md"):
        _touch(tmp_path / name)
    scenes = discover_scenes(tmp_path)
    assert [s.scene_id for s in scenes] == ["a", "b", "c"]
    assert all(s.cameras == ("video",) for s in scenes)
    assert scenes[0].paths == (str((tmp_path / "a.MOV").resolve()),)
    (named,) = {s.cameras for s in discover_scenes(tmp_path, cameras=["front"])}
    assert named == ("front",)


def test_folder_mixing_videos_and_scene_folders_is_refused(tmp_path: Path) -> None:
    _touch(tmp_path / "a.mp4")
    _touch(tmp_path / "scene" / "cam.mp4")
    with pytest.raises(DatasetError, match="mixes video files and scene folders"):
        discover_scenes(tmp_path)


def test_single_camera_folder_refuses_several_cameras(tmp_path: Path) -> None:
    _touch(tmp_path / "a.mp4")
    with pytest.raises(DatasetError, match="single-camera folder, but 2 cameras"):
        discover_scenes(tmp_path, cameras=["x", "y"])


# --------------------------------------------------------------------------- discovery: JSONL index


def test_jsonl_index_resolves_paths_against_the_index_file(tmp_path: Path) -> None:
    _touch(tmp_path / "videos" / "r1_front.mp4")
    _touch(tmp_path / "videos" / "r1_back.mp4")
    absolute = _touch(tmp_path / "elsewhere" / "x.mp4").resolve()
    index = tmp_path / "lists" / "index.jsonl"
    index.parent.mkdir()
    index.write_text("\n".join([
        json.dumps({"id": "r1", "cameras": {"front": "../videos/r1_front.mp4", "back": "../videos/r1_back.mp4"},
                    "frames": [2, 11]}),
        "",
        json.dumps({"id": "r0", "cameras": {"back": str(absolute), "front": "../videos/r1_front.mp4"}}),
    ]) + "\n")
    r0, r1 = discover_scenes(index)
    assert (r0.scene_id, r1.scene_id) == ("r0", "r1")
    assert r1.cameras == ("back", "front")  # sorted by name
    assert r1.paths == tuple(str((tmp_path / f"videos/r1_{c}.mp4").resolve()) for c in ("back", "front"))
    assert r1.frame_range == (2, 11)
    assert r0.paths[0] == str(absolute) and r0.frame_range is None
    (front_first, _) = discover_scenes(index, cameras=["front", "back"])
    assert front_first.cameras == ("front", "back")


def test_jsonl_index_with_single_paths(tmp_path: Path) -> None:
    _touch(tmp_path / "v" / "a.mp4")
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "a", "path": "v/a.mp4"}) + "\n")
    (scene,) = discover_scenes(index)
    assert (scene.cameras, scene.paths) == (("video",), (str((tmp_path / "v/a.mp4").resolve()),))


@pytest.mark.parametrize(("line", "match"), [
    ("{not json", r"index.jsonl:1: not valid JSON"),
    (json.dumps({"cameras": {"a": "x.mp4"}}), r"needs an \"id\""),
    (json.dumps({"id": "a"}), r"needs \"cameras\" .* or \"path\""),
    (json.dumps({"id": "a", "cameras": {}}), r"\"cameras\" must map camera names to paths"),
    (json.dumps({"id": "a", "path": "x.mp4", "frames": [5, 5]}), r"\"frames\" must be \[start, stop\)"),
    (json.dumps({"id": "a", "path": "x.mp4", "frames": [-1, 4]}), r"\"frames\" must be \[start, stop\)"),
    (json.dumps({"id": "a/b", "path": "x.mp4"}), r"scene id 'a/b' is not usable"),
    (json.dumps({"id": "a", "cameras": {"x": 5}}), r"index.jsonl:1: the path of camera 'x' must be a non-empty string"),
    (json.dumps({"id": "a", "path": None}), r"the path of camera 'video' must be a non-empty string"),
])
def test_bad_index_lines_are_named(tmp_path: Path, line: str, match: str) -> None:
    index = tmp_path / "index.jsonl"
    index.write_text(line + "\n")
    with pytest.raises(DatasetError, match=match):
        discover_scenes(index)


def test_index_problems_across_lines(tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    index.write_text("\n\n")
    with pytest.raises(DatasetError, match="holds no scenes"):
        discover_scenes(index)
    index.write_text(json.dumps({"id": "a", "path": "x.mp4"}) + "\n" + json.dumps({"id": "a", "path": "y.mp4"}) + "\n")
    with pytest.raises(DatasetError, match="appear twice: a"):
        discover_scenes(index)
    index.write_text(json.dumps({"id": "a", "cameras": {"x": "1.mp4"}}) + "\n"
                     + json.dumps({"id": "b", "cameras": {"y": "2.mp4"}}) + "\n")
    with pytest.raises(DatasetError, match="different camera sets"):
        discover_scenes(index)


def test_jsonl_frame_range_is_planned_and_checked(demo_data: Path, tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    cams = {"cam_0": str(demo_data / "scene_000/cam_0.mp4"), "cam_1": str(demo_data / "scene_000/cam_1.mp4")}
    index.write_text(json.dumps({"id": "inside", "cameras": cams, "frames": [3, 8]}) + "\n"
                     + json.dumps({"id": "beyond", "cameras": cams, "frames": [3, 18]}) + "\n")
    scenes = discover_scenes(index)
    probes = {s.scene_id: probe_scene(s) for s in scenes}
    assert "exceeds the video's 17 frames" in probes["beyond"].error
    clips, skipped = plan_clips(scenes, probes, SamplingConfig(num_frames=5))
    assert [(c.clip_id, c.frames) for c in clips] == [("inside/000003-000007", (3, 4, 5, 6, 7))]
    assert [s.scene_id for s in skipped] == ["beyond"]


# --------------------------------------------------------------------------- discovery: bad paths


def test_missing_path_empty_folder_and_wrong_file_are_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        discover_scenes(tmp_path / "nope")
    with pytest.raises(DatasetError, match="no videos .* and no scene folders found"):
        discover_scenes(tmp_path)
    (tmp_path / "empty_scene").mkdir()
    with pytest.raises(DatasetError, match="scene folders hold no video files"):
        discover_scenes(tmp_path)
    with pytest.raises(DatasetError, match="expected a folder or a .jsonl index"):
        discover_scenes(_touch(tmp_path / "clip.mp4"))
    assert issubclass(DatasetError, UsageError)  # the CLI maps it to exit code 2


# --------------------------------------------------------------------------- planning (pure)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_frames": 0}, "--num-frames must be >= 1"),
    ({"num_frames": 9, "frame_stride": 0}, "--frame-stride must be >= 1"),
    ({"num_frames": 9, "window_stride": 0}, "--window-stride must be >= 1"),
    ({"num_frames": 9, "max_clips_per_scene": 0}, "--max-clips-per-scene must be >= 1"),
])
def test_sampling_is_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        SamplingConfig(**kwargs)


# --------------------------------------------------------------------------- resize and crop (pure)


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


# --------------------------------------------------------------------------- decoding real mp4s


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
    with pytest.raises(VideoDecodeError, match="frame 9 requested, video has 9"):
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
    path, reason = item["errors"][0]
    assert path == str(broken) and "not a readable video" in reason
    assert item["views"].shape == (4, 3, 3, 32, 32)
    assert torch.count_nonzero(item["views"][1]) == 0  # the failed view is a zero placeholder
    assert torch.equal(item["views"][2], item["views"][0])


def test_widths_decord_misreads_fall_back_to_pyav(tmp_path):
    import av
    import numpy as np

    from vaecache.dataset import ViewDecoder

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
