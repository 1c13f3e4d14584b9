"""Dataset layouts (folders, JSONL index), discovery errors and probing of real mp4s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vaecache.cache.reader import CacheReader
from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.errors import DatasetError, UsageError
from vaecache.planning.clips import plan_clips
from vaecache.settings.clip import SamplingConfig
from vaecache.sources.discover import discover, discover_scenes
from vaecache.sources.folders import MAX_CAPTION_BYTES
from vaecache.sources.probing import probe_scene
from vaecache.sources.scene import Scene


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not decoded by discovery")
    return path


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
    assert skip.reason == "camera 'cam_1' is missing"
    assert (skip.camera, skip.path) == ("cam_1", None)  # a missing camera has no path, and is named


def test_cameras_with_different_frame_counts_are_reported(tmp_path: Path) -> None:
    write_demo_dataset(tmp_path / "a", DemoDataSpec(scenes=1, cameras=1, frames=9, height=32, width=32))
    write_demo_dataset(tmp_path / "b", DemoDataSpec(scenes=1, cameras=1, frames=5, height=32, width=32))
    scene = Scene("s", ("a", "b"), (str(tmp_path / "a/scene_000/cam_0.mp4"), str(tmp_path / "b/scene_000/cam_0.mp4")))
    probe = probe_scene(scene)
    assert probe.error is not None and "'b' has 5 frames" in probe.error
    assert probe.error_path == scene.paths[1]


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
    (json.dumps({"id": "a", "path": "x.mp4"}) + " {}", r"index.jsonl:1: not valid JSON \(Extra data\)"),
    ("[1, 2]", r"index.jsonl:1: each line needs an \"id\""),
    (json.dumps({"cameras": {"a": "x.mp4"}}), r"needs an \"id\""),
    (json.dumps({"id": "a"}), r"needs \"cameras\" .* or \"path\""),
    (json.dumps({"id": "a", "cameras": {}}), r"\"cameras\" must map camera names to paths"),
    (json.dumps({"id": "a", "path": "x.mp4", "frames": [5, 5]}), r"\"frames\" must be \[start, stop\)"),
    (json.dumps({"id": "a", "path": "x.mp4", "frames": [-1, 4]}), r"\"frames\" must be \[start, stop\)"),
    (json.dumps({"id": "a/b", "path": "x.mp4"}), r"scene id 'a/b' is not usable"),
    (json.dumps({"id": "a", "cameras": {"x": 5}}), r"index.jsonl:1: the source of camera 'x' must be a path or"),
    (json.dumps({"id": "a", "path": None}), r"the path of camera 'video' must be a non-empty string"),
    # JSON has no NaN or Infinity (Python writes and reads them): a probe's fps of NaN was once stored and verified
    ('{"id": "a", "path": "x.mp4", "probe": {"frames": 9, "fps": NaN, "width": 8, "height": 8, "codec": "h264", '
     '"size": 1, "mtime_ns": 1}}', r"index.jsonl:1: NaN is not a JSON number"),
    ('{"id": "a", "path": "x.mp4", "score": -Infinity}', r"index.jsonl:1: -Infinity is not a JSON number"),
    ('{"id": "a", "path": "x.mp4", "probe": {"frames": 9, "fps": 1e999, "width": 8, "height": 8, "codec": "h264", '
     '"size": 1, "mtime_ns": 1}}', r"probe values out of range .* fps finite"),  # a valid number, parsed as inf
])
def test_bad_index_lines_are_named(tmp_path: Path, line: str, match: str) -> None:
    index = tmp_path / "index.jsonl"
    index.write_text(line + "\n")
    with pytest.raises(DatasetError, match=match):
        discover_scenes(index)


def test_an_index_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    index.write_bytes(json.dumps({"id": "a", "path": "x.mp4"}).encode() + b"\n" + b'{"id": "b\xff"}\n')
    with pytest.raises(DatasetError, match=r"index.jsonl:2: not UTF-8 text"):
        discover_scenes(index)


def test_index_lines_may_carry_blank_lines_spaces_and_crlf(tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    lines = [json.dumps({"id": "a", "path": "a.mp4"}), "", "  " + json.dumps({"id": "b", "path": "b.mp4"}) + " \t",
             json.dumps({"id": "c", "path": "c.mp4"}) + "\r", "   "]
    index.write_bytes("\n".join(lines).encode())  # the last line has no newline
    assert [s.scene_id for s in discover_scenes(index)] == ["a", "b", "c"]


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


def test_missing_path_empty_folder_and_wrong_file_are_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        discover_scenes(tmp_path / "nope")
    with pytest.raises(DatasetError, match="no videos .* and no scene folders found"):
        discover_scenes(tmp_path)
    (tmp_path / "empty_scene").mkdir()
    with pytest.raises(DatasetError, match="scene folders hold no video files"):
        discover_scenes(tmp_path)
    with pytest.raises(DatasetError, match="expected a folder, a .jsonl index or a .csv/.tsv/.parquet table"):
        discover_scenes(_touch(tmp_path / "clip.mp4"))
    assert issubclass(DatasetError, UsageError)  # the CLI maps it to exit code 2


def test_missing_camera_in_an_index_has_no_path(demo_data: Path, tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "a", "cameras": {"left": str(demo_data / "scene_000/cam_0.mp4")}}) + "\n"
                     + json.dumps({"id": "b", "cameras": {"left": str(demo_data / "scene_001/cam_0.mp4"),
                                                          "right": str(demo_data / "scene_001/cam_1.mp4")}}) + "\n")
    a, b = discover_scenes(index, cameras=["left", "right"])
    assert a.paths[1] is None and b.paths[1] is not None
    probe = probe_scene(a)
    assert (probe.error, probe.error_camera, probe.error_path) == ("camera 'right' is missing", "right", None)


def test_an_index_mixing_cameras_and_path_lines_is_refused(tmp_path: Path) -> None:
    """A single video has no camera name to be filed under among named cameras, with or without --cameras."""
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "drive", "cameras": {"front": "f.mp4", "left": "l.mp4"}}) + "\n"
                     + json.dumps({"id": "robot", "path": "r.mp4"}) + "\n")
    for cameras in (None, ["front"], ["front", "left"]):
        with pytest.raises(DatasetError, match=r"index.jsonl:2: uses \"path\" but .*index.jsonl:1 uses \"cameras\"; "
                                               r"an index lists every scene one way"):
            discover_scenes(index, cameras=cameras)
    index.write_text(json.dumps({"id": "robot", "path": "r.mp4", "cameras": {"front": "f.mp4"}}) + "\n")
    with pytest.raises(DatasetError, match=r"index.jsonl:1: has both \"cameras\" and \"path\""):
        discover_scenes(index)


def test_path_lines_take_one_camera_name_from_cameras(tmp_path: Path) -> None:
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "robot", "path": "r.mp4"}) + "\n")
    (scene,) = discover_scenes(index, cameras=["wrist"])
    assert scene.cameras == ("wrist",)
    with pytest.raises(DatasetError,
                       match=r"index.jsonl:1: a \"path\" scene has one camera, but 2 cameras were configured"):
        discover_scenes(index, cameras=["wrist", "head"])


def test_cameras_left_out_of_the_chosen_set_are_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for scene in ("s1", "s2", "s3"):
        for camera in ("left", "right"):
            _touch(tmp_path / scene / f"{camera}.mp4")
    _touch(tmp_path / "s2" / "depth.mp4")
    with caplog.at_level("WARNING", logger="vaecache"):
        found = discover(tmp_path)
    assert [s.cameras for s in found.scenes] == [("left", "right")] * 3
    assert found.left_out_cameras == {"depth": 1}
    assert "camera depth (in 1 scene) is not in the chosen camera set (left, right)" in caplog.text
    assert discover(tmp_path, cameras=["right"]).left_out_cameras == {"left": 3, "depth": 1}
    assert discover(tmp_path, cameras=["depth", "left", "right"]).left_out_cameras == {}
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"id": "a", "cameras": {"front": "a.mp4", "back": "b.mp4"}}) + "\n")
    assert discover(index, cameras=["front"]).left_out_cameras == {"back": 1}


def test_probe_counts_frames_reads_fps_and_rotation(demo_data: Path) -> None:
    (scene,) = discover_scenes(demo_data)[:1]
    probe = probe_scene(scene)
    assert (probe.num_frames, probe.fps, probe.rotations, probe.error) == (17, 10.0, (0, 0), None)


def test_an_encode_names_the_cameras_it_leaves_out(demo_data: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x64", "--workers", "0", "--no-progress", "--cameras", "cam_0", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert "cam_1 (3 scenes)" in result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["left_out_cameras"] == {"cam_1": 3}


def test_hostile_names_and_links_are_recorded_failures_and_the_run_goes_on(demo_data: Path, tmp_path: Path,
                                                                            run_cli) -> None:
    """A self-referencing symlink, a folder named with a newline, a folder starting with '..' and an
    audio-only file each become one failure record with a plain reason; the good scenes are encoded."""
    import av
    import numpy as np

    data = Path(shutil.copytree(demo_data, tmp_path / "data"))
    loop = data / "looped"
    loop.mkdir()
    (loop / "cam_0.mp4").symlink_to("cam_0.mp4")
    shutil.copy(data / "scene_000" / "cam_1.mp4", loop / "cam_1.mp4")
    shutil.copytree(data / "scene_000", data / "bad\nname")
    shutil.copytree(data / "scene_001", data / "..sneaky")
    audio = data / "audio_only"
    shutil.copytree(data / "scene_002", audio)
    with av.open(str(audio / "cam_0.mp4"), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    out = tmp_path / "out"
    result = run_cli(["encode", data, "--out", out, "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64",
                      "--workers", "0", "--no-progress"])
    assert result.exit_code == 3, result.output
    assert "unexpected" not in result.output
    failures = {r["scene"]: r for r in CacheReader(out).failure_records()}
    assert set(failures) == {"looped", "bad\nname", "..sneaky", "audio_only"}
    assert failures["looped"]["reason"] == "symlink loop" and failures["looped"]["camera"] == "cam_0"
    assert "cannot be a scene id" in failures["bad\nname"]["reason"]
    assert "starting with '.'" in failures["..sneaky"]["reason"]
    assert (failures["audio_only"]["reason"].startswith("not a readable video")
            or "no video stream" in failures["audio_only"]["reason"])
    assert "DECORD" not in failures["audio_only"]["reason"].upper()
    clips = [c["id"] for c in list(CacheReader(out).clip_records())]
    assert clips == [f"scene_00{i}/000000-000008" for i in range(3)]


def test_probe_cache_keeps_file_verdicts_but_not_permission_or_io_errors(tmp_path):
    """A chmod fixes 'permission denied' without changing size or mtime: such a failure must be looked at
    again next time, while 'not a readable video' stays cached until the file changes."""
    from vaecache.errors import VideoDecodeError
    from vaecache.sources.probing import probe_records
    from vaecache.sources.scene import Scene

    paths = []
    for name in ("a.mp4", "b.mp4", "c.mp4"):
        (tmp_path / name).write_bytes(b"x")
        paths.append(str(tmp_path / name))
    scene = Scene("s", ("a", "b", "c"), tuple(paths))
    found = [VideoDecodeError(paths[0], "permission denied"), VideoDecodeError(paths[1], "cannot read (I/O error)"),
             VideoDecodeError(paths[2], "not a readable video (Invalid data)")]
    records = probe_records(scene, found)
    assert [record["path"] for record in records] == [paths[2]]
    assert records[0]["error"] == "not a readable video (Invalid data)"


def test_a_frame_budget_refusal_is_not_cached(tmp_path, monkeypatch):
    """A video without timestamps is counted by decoding it, under the default frame budget: a refusal by the
    budget is this run's, not the file's (a run with a larger --max-frame-pixels must look again)."""
    from tests.videos import LAYOUTS, remux_to_raw_h264, write_video
    from vaecache.errors import FrameBudgetError
    from vaecache.sources.probing import probe_file, probe_records
    from vaecache.sources.scene import Scene

    raw = remux_to_raw_h264(write_video(tmp_path / "v.mp4", LAYOUTS["h264-open-gop"], frames=12),
                            tmp_path / "v.h264")
    monkeypatch.setattr("vaecache.video.reader.DEFAULT_MAX_FRAME_PIXELS", 64 * 96 - 1)
    with pytest.raises(FrameBudgetError, match="exceed the decode budget") as refused:
        probe_file(str(raw))
    assert probe_records(Scene("s", ("video",), (str(raw),)), [refused.value]) == []


def test_sidecar_captions_of_videos_and_scene_folders(tmp_path, demo_data):
    single = tmp_path / "single"
    _touch(single / "clip_a.mp4")
    _touch(single / "clip_b.mp4")
    (single / "clip_a.txt").write_text("a dog runs on the beach\n")
    (single / "clip_b.txt").write_text("   \n")  # empty: no caption
    scenes = {s.scene_id: s for s in discover_scenes(single)}
    assert json.loads(scenes["clip_a"].metadata) == {"caption": "a dog runs on the beach"}
    assert scenes["clip_b"].metadata is None
    rig = tmp_path / "rig"
    shutil.copytree(demo_data, rig)
    (rig / "scene_000" / "caption.txt").write_text("two cameras on a rig")
    from tests.conftest import ENCODE_ARGS, invoke, read_clips

    assert invoke(["encode", rig, "--out", tmp_path / "out", *ENCODE_ARGS]).exit_code == 0
    captions = {r["scene"]: (r.get("metadata") or {}).get("caption") for r in read_clips(tmp_path / "out")}
    assert captions["scene_000"] == "two cameras on a rig" and captions["scene_001"] is None
    # a caption that cannot be one is a skipped scene naming the file (as a tar's txt member is); the rest goes on
    (single / "clip_a.txt").write_bytes(b"\xff\xfe bad")
    (rig / "scene_001" / "caption.txt").write_bytes(b"x" * (MAX_CAPTION_BYTES + 1))
    for data, left_out, caption, why in ((single, "clip_a", single / "clip_a.txt", "must be UTF-8 text (byte 0)"),
                                         (rig, "scene_001", rig / "scene_001" / "caption.txt", "of more than")):
        found = discover(data)
        named = {p.stem for p in data.iterdir() if p.suffix != ".txt"}
        assert [s.scene_id for s in found.scenes] == sorted(named - {left_out}) and len(named) > 1
        (skipped,) = found.rejected
        assert skipped.path == str(caption) and why in skipped.reason
