"""`vaecache index` and what reads its index: probes recorded once, planning without opening a video,
decoding that refuses a video its index misdescribes, and OUT's probe cache."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ENCODE_ARGS
from vaecache.cache.reader import CacheReader
from vaecache.errors import DatasetError
from vaecache.sources import probing as sources
from vaecache.sources.discover import discover_scenes
from vaecache.sources.probing import probe_scene
from vaecache.video.reader import VideoReader

PLAN_ARGS = ("--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--no-measure")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def data(demo_data: Path, tmp_path: Path) -> Path:
    """A private copy of the demo data (3 scenes x 2 cameras x 17 frames of 64x64), mtimes kept."""
    return Path(shutil.copytree(demo_data, tmp_path / "data"))


@pytest.fixture(scope="module")
def demo_index(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`vaecache index` of the read-only demo data, made once. Read-only."""
    from tests.conftest import invoke

    index = tmp_path_factory.mktemp("index") / "index.jsonl"
    result = invoke(["index", demo_data, "-o", index, "--no-progress"])
    assert result.exit_code == 0, result.output
    return index


def test_index_records_what_probing_finds_per_camera_sorted_by_scene(demo_data: Path, demo_index: Path) -> None:
    lines = _lines(demo_index)
    assert [line["id"] for line in lines] == ["scene_000", "scene_001", "scene_002"]
    for line, scene in zip(lines, discover_scenes(demo_data)):
        assert line["cameras"] == dict(zip(scene.cameras, scene.paths))
        probe = probe_scene(scene)
        for camera, path, rotation in zip(scene.cameras, scene.paths, probe.rotations):
            stat = os.stat(path)
            with VideoReader(path) as reader:
                timeline = reader.timeline.to_json()  # the frame index a decode worker seeks by without demuxing
            assert timeline.startswith("v1|0,1024,17|")  # constant frame rate: an affine rule, not a list
            assert line["probe"][camera] == {"frames": 17, "fps": 10.0, "width": 64, "height": 64, "codec": "h264",
                                             "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "rotation": rotation,
                                             "start_ns": 0, "end_ns": 1_600_000_000, "timeline": timeline}
    assert sorted(p.name for p in demo_index.parent.iterdir()) == ["index.jsonl"]  # nothing rejected: no file


@pytest.mark.parametrize("cameras", [None, "front"])
def test_a_folder_of_single_videos_indexed_keeps_its_camera_name(demo_data: Path, tmp_path: Path, run_cli,
                                                                 cameras: str | None) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for scene in ("scene_000", "scene_001"):
        os.symlink(demo_data / scene / "cam_0.mp4", flat / f"{scene}.mp4")
    index = tmp_path / "index.jsonl"
    result = run_cli(["index", flat, "-o", index, "--no-progress", *(["--cameras", cameras] if cameras else [])])
    assert result.exit_code == 0, result.output
    lines = _lines(index)
    assert [("path" in line, sorted(line.get("cameras", {}))) for line in lines] == (
        [(True, [])] * 2 if cameras is None else [(False, [cameras])] * 2)
    assert {scene.cameras for scene in discover_scenes(index)} == {(cameras or "video",)}  # read back without --cameras


def test_an_indexed_dataset_plans_like_the_folder_it_indexes(demo_data: Path, demo_index: Path, run_cli) -> None:
    from_folder = run_cli(["plan", demo_data, *PLAN_ARGS, "--world-size", "2", "--json", "-"])
    from_index = run_cli(["plan", demo_index, *PLAN_ARGS, "--world-size", "2", "--json", "-"])
    assert from_folder.exit_code == from_index.exit_code == 0, from_index.output
    folder, index = json.loads(from_folder.stdout), json.loads(from_index.stdout)
    assert folder["ranks"] == index["ranks"] and folder["dataset"] == index["dataset"]


def test_unusable_scenes_go_to_the_side_file_with_their_reason(data: Path, tmp_path: Path, run_cli) -> None:
    (data / "scene_001" / "cam_1.mp4").write_bytes(b"")
    (data / "scene_002" / "cam_0.mp4").unlink()
    index = tmp_path / "index.jsonl"
    result = run_cli(["index", data, "-o", index, "--no-progress"])
    assert result.exit_code == 3, result.output  # done, some inputs rejected
    assert [line["id"] for line in _lines(index)] == ["scene_000"]
    assert _lines(tmp_path / "index.rejected.jsonl") == [
        {"id": "scene_001", "camera": "cam_1", "path": str(data / "scene_001" / "cam_1.mp4"),
         "reason": "empty file (0 bytes)"},
        {"id": "scene_002", "camera": "cam_0", "path": None, "reason": "camera 'cam_0' is missing"},
    ]


@pytest.mark.parametrize(("args", "message"), [
    (["-o", "{tmp}/nowhere/index.jsonl"], "folder {tmp}/nowhere does not exist"),
    (["-o", "{tmp}/index.txt"], "the index must be a .jsonl file"),
    (["-o", "{tmp}/i.jsonl", "--workers", "0"], "--workers must be an integer >= 1"),
])
def test_bad_arguments_are_one_line_usage_errors(demo_data: Path, tmp_path: Path, run_cli, args, message) -> None:
    result = run_cli(["index", demo_data, *[a.format(tmp=tmp_path) for a in args]])
    assert result.exit_code == 2
    assert message.format(tmp=tmp_path) in result.output and len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
    missing = run_cli(["index", tmp_path / "no-data", "-o", tmp_path / "i.jsonl"])
    assert missing.exit_code == 2 and f"{tmp_path / 'no-data'}: dataset path does not exist" in missing.output


def _rewrite(index: Path, target: Path, edit: Any) -> Path:
    target.write_text("".join(json.dumps(edit(line)) + "\n" for line in _lines(index)))
    return target


@pytest.mark.parametrize(("field", "value", "message"), [
    ("frames", "17", 'probe field "frames" must be an integer'),
    ("fps", None, 'probe lacks "fps"'),
    ("width", 64.0, 'probe field "width" must be an integer'),
    ("codec", 264, 'probe field "codec" must be a string'),
    ("frames", 0, "probe values out of range"),
])
def test_a_wrongly_typed_probe_field_names_the_index_line(demo_index: Path, tmp_path: Path, field, value,
                                                          message) -> None:
    def edit(line: dict[str, Any]) -> dict[str, Any]:
        if line["id"] == "scene_001":
            if value is None:
                del line["probe"]["cam_1"][field]
            else:
                line["probe"]["cam_1"][field] = value
        return line

    bad = _rewrite(demo_index, tmp_path / "bad.jsonl", edit)
    with pytest.raises(DatasetError, match=f"^{bad}:2: camera 'cam_1': {message}"):
        discover_scenes(bad)


def test_a_probed_index_is_planned_without_opening_a_video_and_decoding_refuses_one_that_differs(
        demo_index: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    def claim_more_frames(line: dict[str, Any]) -> dict[str, Any]:
        if line["id"] == "scene_002":
            for probe in line["probe"].values():
                probe["frames"] = 27  # 3 clips of 9, where the video has 17 frames: 1 clip
                del probe["timeline"]  # whose rule of 17 frames would refuse the line at once (test_hostile_index)
        return line

    def no_probing(path: str) -> None:
        raise AssertionError(f"{path} was opened to probe it")

    monkeypatch.setattr(sources, "probe_file", no_probing)
    index = _rewrite(demo_index, tmp_path / "claims.jsonl", claim_more_frames)
    plan = run_cli(["plan", index, *PLAN_ARGS, "--json", "-"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.stdout)["dataset"]["clips"] == 5  # 1 + 1 + 3: what the index says

    out = tmp_path / "out"
    result = run_cli(["encode", index, "--out", out, *ENCODE_ARGS])
    assert result.exit_code == 3, result.output  # planned from the index, the mismatch recorded as failures
    assert [clip["id"] for clip in CacheReader(out).clip_records()] == ["scene_000/000000-000008",
                                                                    "scene_001/000000-000008"]
    failures = CacheReader(out).failure_records()
    # the file itself contradicts its probe: its scene fails once (no clip named), not once per planned clip
    assert [(f["scene"], f.get("clip")) for f in failures] == [("scene_002", None)]
    path = json.loads(index.read_text().splitlines()[2])["cameras"]["cam_0"]
    assert failures[0]["path"] == path and failures[0]["reason"] == (
        "the index says 27 frames of 64x64, the video has 17 frames of 64x64 (it changed since it was probed; "
        "run `vaecache index` again)")
    assert not (out / "probes").exists()  # nothing was probed, so nothing was cached


def test_an_index_written_before_timelines_encodes_as_one_with_them(demo_index: Path, tmp_path: Path, run_cli,
                                                                   good_cache: Path) -> None:
    """Probes without a `timeline` (an index or probe cache of an older vaecache) still plan and encode: their readers
    index the videos by demuxing them, as then, and the latents are the same."""
    from tests.conftest import assert_same_tensors, load_tensors

    def older(line: dict[str, Any]) -> dict[str, Any]:
        for probe in line["probe"].values():
            del probe["timeline"]
        return line

    for name, index in (("with", demo_index), ("without", _rewrite(demo_index, tmp_path / "older.jsonl", older))):
        result = run_cli(["encode", index, "--out", tmp_path / name, *ENCODE_ARGS])
        assert result.exit_code == 0, result.output
        assert_same_tensors(load_tensors(tmp_path / name), load_tensors(good_cache))


def test_a_killed_index_run_resumes_without_probing_the_finished_scenes_again(data: Path, tmp_path: Path, procs,
                                                                              run_cli) -> None:
    index = tmp_path / "index.jsonl"
    killed = procs.vaecache("index", data, "-o", index, "--workers", "1", "--no-progress",
                            env={"VAECACHE_FAULT": "crash-after-probe:2"})
    assert killed.returncode == 137, killed.stderr
    assert not index.exists()
    partial = tmp_path / "index.jsonl.partial" / "rank-00000.jsonl"
    assert {line["path"] for line in _lines(partial)} == {
        str(data / scene / f"cam_{c}.mp4") for scene in ("scene_000", "scene_001") for c in (0, 1)}
    # Break a finished scene's video without changing its size or mtime: probing it again would reject it.
    video = data / "scene_001" / "cam_0.mp4"
    stat = video.stat()
    video.write_bytes(b"\0" * stat.st_size)
    os.utime(video, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    resumed = run_cli(["index", data, "-o", index, "--workers", "1", "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert re.search(r"probed now\s*│\s*1\s*│", resumed.output), resumed.output
    assert re.search(r"from an earlier run\s*│\s*2\s*│", resumed.output), resumed.output
    assert [line["id"] for line in _lines(index)] == ["scene_000", "scene_001", "scene_002"]
    assert _lines(index)[1]["probe"]["cam_0"]["frames"] == 17  # the probe of the run that was killed
    assert not (tmp_path / "index.jsonl.partial").exists()


def test_a_file_changed_since_its_partial_record_is_probed_again(data: Path, tmp_path: Path, run_cli) -> None:
    index = tmp_path / "index.jsonl"
    partial = tmp_path / "index.jsonl.partial"
    partial.mkdir()
    path = str(data / "scene_000" / "cam_0.mp4")
    stale = {"path": path, "probe": {"frames": 99, "fps": 10.0, "width": 64, "height": 64, "codec": "h264",
                                     "size": 1, "mtime_ns": 1, "rotation": 0}}
    (partial / "rank-00003.jsonl").write_text(json.dumps(stale) + "\n" + '{"path": "torn')
    # a crash while writing a non-ASCII path tears the line inside a UTF-8 character: cut, not a blocked resume
    (partial / "rank-00004.jsonl").write_bytes(b'{"path": "/data/sc\xc3')
    result = run_cli(["index", data, "-o", index, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert _lines(index)[0]["probe"]["cam_0"]["frames"] == 17


def test_an_encode_caches_its_probes_in_out_and_a_later_run_opens_none_of_them_again(
        data: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    first = run_cli(["encode", data, "--out", out, *ENCODE_ARGS, "--size", "32x32"])
    assert first.exit_code == 0, first.output
    cached = _lines(out / "probes" / "rank-00000.jsonl")
    assert sorted(r["path"] for r in cached) == sorted(str(p) for p in data.glob("*/*.mp4"))
    # The dataset grows by a scene: only its videos are opened.
    shutil.copytree(data / "scene_000", data / "scene_003")
    opened: list[str] = []
    real_probe_file = sources.probe_file

    def counting(path: str, *rest: Any) -> Any:
        opened.append(path)
        return real_probe_file(path, *rest)

    monkeypatch.setattr(sources, "probe_file", counting)
    second = run_cli(["encode", data, "--out", out, *ENCODE_ARGS, "--size", "32x32"])
    assert second.exit_code == 0, second.output
    assert sorted(opened) == [str(data / "scene_003" / "cam_0.mp4"), str(data / "scene_003" / "cam_1.mp4")]
    assert len(list(CacheReader(out).clip_records())) == 4


def test_a_cached_probe_stands_only_while_the_file_keeps_its_size_and_mtime(data: Path, tmp_path: Path) -> None:
    scene = discover_scenes(data)[0]
    found = sources.open_scene(scene)
    cache_file = tmp_path / "rank-00000.jsonl"
    cache_file.write_text("".join(json.dumps(r) + "\n" for r in sources.probe_records(scene, found)))
    cache = sources.read_probe_cache([cache_file])
    assert sources.probe_from_cache(scene, cache) == probe_scene(scene)
    video = Path(scene.paths[1])
    os.utime(video, ns=(0, video.stat().st_mtime_ns + 1))
    assert sources.probe_from_cache(scene, cache) is None


def test_index_keeps_the_metadata_keys_of_its_input_lines(demo_index: Path, tmp_path: Path, run_cli) -> None:
    """Captions and other extra keys on an input index line stay on the line `vaecache index` writes."""
    lines = [{**line, "caption": f"scene {n} ☃", "tags": ["a", n]} for n, line in enumerate(_lines(demo_index))]
    source = tmp_path / "captioned.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_cli(["index", source, "-o", tmp_path / "out.jsonl", "--no-progress"])
    assert result.exit_code == 0, result.output
    written = _lines(tmp_path / "out.jsonl")
    assert [(line["caption"], line["tags"]) for line in written] == [(f"scene {n} ☃", ["a", n]) for n in range(3)]
    assert [line["probe"] for line in written] == [line["probe"] for line in lines]
