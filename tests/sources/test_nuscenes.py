"""The nuScenes layout: scenes and cameras from the official tables (read as streams), frames walked as the devkit
walks them, per-frame ego poses and per-camera calibration in the records, dropped frames as recorded failures."""

from __future__ import annotations

import json

import pytest

from tests.conftest import invoke, read_clips, read_failures
from tests.sources.nuscenes_fixture import CHANNELS_IN_SURROUND, write_nuscenes
from vaecache.errors import DatasetError
from vaecache.sources.discover import discover
from vaecache.sources.nuscenes import iter_json_array
from vaecache.sources.scene import SourceOptions

ENCODE = ("--num-frames", "5", "--size", "32x48", "--sync", "timestamps")


@pytest.fixture(scope="module")
def nuscenes_root(tmp_path_factory):
    return write_nuscenes(tmp_path_factory.mktemp("nuscenes") / "nuscenes", drop={(1, "CAM_BACK"): 8})


def test_scenes_cameras_in_surround_order_and_frames_along_the_chain(nuscenes_root):
    found = discover(nuscenes_root)
    assert [s.scene_id for s in found.scenes] == ["scene-0001", "scene-0002"]
    assert found.reference_camera == "CAM_FRONT"
    scene = found.scenes[1]
    assert scene.cameras == CHANNELS_IN_SURROUND
    back = scene.frame_lists[scene.cameras.index("CAM_BACK")]
    assert len(back.files) == 13 and len(scene.frame_lists[0].files) == 14  # CAM_BACK dropped one frame
    assert "samples/CAM_BACK/" in back.files[0] and "sweeps/CAM_BACK/" in back.files[1]
    assert all(b > a for a, b in zip(back.times_ns, back.times_ns[1:]))
    chosen = discover(nuscenes_root, options=SourceOptions(cameras=("CAM_BACK", "CAM_FRONT")))
    assert chosen.scenes[0].cameras == ("CAM_BACK", "CAM_FRONT")
    with pytest.raises(DatasetError, match="CAM_SIDE"):
        discover(nuscenes_root, options=SourceOptions(cameras=("CAM_SIDE",)))


def test_encoded_end_to_end_with_calibration_and_ego_poses(nuscenes_root, tmp_path):
    out = tmp_path / "out"
    result = invoke(["encode", nuscenes_root, "--out", out, "--vae", "builtin:tiny", *ENCODE, "--workers", "0",
                     "--no-progress"])
    assert result.exit_code == 3, result.output  # one clip crosses the dropped frame
    records = {r["id"]: r for r in read_clips(out)}
    assert sorted(records) == ["scene-0001/000000-000004", "scene-0001/000005-000009", "scene-0002/000000-000004"]
    record = records["scene-0001/000005-000009"]
    assert record["cameras"] == list(CHANNELS_IN_SURROUND)
    metadata = record["metadata"]
    assert metadata["nuscenes"]["description"] == "rain, turn right 0"
    assert metadata["calibration"]["CAM_BACK"]["sensor2ego"]["translation"] == [4.0, 0.0, 1.5]
    assert metadata["calibration"]["CAM_FRONT"]["intrinsic"][0][0] == 1266.4
    tables = nuscenes_root / "v1.0-mini"
    poses = {p["token"]: p for p in iter_json_array(tables / "ego_pose.json")}
    frames = {d["token"]: d for d in iter_json_array(tables / "sample_data.json")}
    for camera in CHANNELS_IN_SURROUND:
        entries = metadata["frames"][camera]
        assert len(entries) == 5
        for entry, file in zip(entries, record["frame_files"][camera]):  # each camera frame's own pose
            data = frames[entry["sample_data_token"]]
            assert file.endswith(data["filename"])
            assert entry["ego_pose"]["translation"] == poses[data["ego_pose_token"]]["translation"]
    assert record["camera_frames"]["CAM_FRONT"] == record["frames"] == [5, 6, 7, 8, 9]
    (failure,) = read_failures(out)
    assert failure["clip"] == "scene-0002/000005-000009" and failure["camera"] == "CAM_BACK"
    assert "camera CAM_BACK: no frame within" in failure["reason"]
    assert invoke(["verify", out]).exit_code == 0
    assert invoke(["verify", out, "--dataset", nuscenes_root]).exit_code == 0


def test_a_nuscenes_root_needs_time_sync_and_the_index_carries_it_all(nuscenes_root, tmp_path):
    refused = invoke(["encode", nuscenes_root, "--out", tmp_path / "x", "--vae", "builtin:tiny", "--num-frames", "5",
                      "--size", "32x48", "--workers", "0", "--no-progress"])
    assert refused.exit_code == 2 and "--sync timestamps" in refused.output
    index = tmp_path / "index.jsonl"
    assert invoke(["index", nuscenes_root, "-o", index, "--no-progress"]).exit_code == 0
    line = json.loads(index.read_text().splitlines()[0])
    assert set(line["cameras"]["CAM_FRONT"]) == {"files", "times_ns"}
    assert line["probe"]["CAM_FRONT"]["start_ns"] == line["cameras"]["CAM_FRONT"]["times_ns"][0]
    for data, out in ((index, "from-index"), (nuscenes_root, "direct")):
        result = invoke(["encode", data, "--out", tmp_path / out, "--vae", "builtin:tiny", *ENCODE, "--workers", "0",
                         "--no-progress"])
        assert result.exit_code == 3, result.output
    direct = {r["id"]: r for r in read_clips(tmp_path / "direct")}
    indexed = {r["id"]: r for r in read_clips(tmp_path / "from-index")}
    assert sorted(direct) == sorted(indexed)
    for clip_id, record in direct.items():
        assert indexed[clip_id]["metadata"] == record["metadata"]
        assert indexed[clip_id]["frame_files"] == record["frame_files"]


def test_a_truncated_table_is_refused_naming_it(tmp_path):
    table = tmp_path / "scene.json"
    table.write_text('[{"token": "a"}, {"token": ')
    with pytest.raises(DatasetError, match="truncated"):
        list(iter_json_array(table))
    table.write_text('[' + ','.join(json.dumps({"token": str(i), "pad": "x" * 5000}) for i in range(600)) + ']')
    assert [r["token"] for r in iter_json_array(table)] == [str(i) for i in range(600)]


def test_an_index_line_s_frames_are_read_back_only_for_the_clips_built(nuscenes_root, tmp_path):
    from vaecache.planning.clips import plan_clips
    from vaecache.settings.clip import SamplingConfig, SyncConfig
    from vaecache.sources.jsonl import IndexLineListing, _read_listing

    index = tmp_path / "index.jsonl"
    assert invoke(["index", nuscenes_root, "-o", index, "--no-progress"]).exit_code == 0
    _read_listing.cache_clear()
    indexed = discover(index).scenes
    sampling = SamplingConfig(num_frames=5, sync=SyncConfig("timestamps", "CAM_FRONT"))
    planned, _ = plan_clips(indexed, {}, sampling)
    assert all(isinstance(scene.listing, IndexLineListing) for scene in indexed)
    assert _read_listing.cache_info().currsize == 0  # planning held no frame list and no per-frame metadata
    clip = planned.block(0, 1)[0]  # a clip built reads its scene's line once, for all its cameras
    assert clip.source(0).files and clip.frame_metadata is not None
    assert _read_listing.cache_info().currsize == 1
    direct = {scene.scene_id: scene for scene in discover(nuscenes_root).scenes}
    for scene in indexed:
        assert [(listed.files, listed.times_ns) for listed in scene.frame_lists] == [
            (listed.files, listed.times_ns) for listed in direct[scene.scene_id].frame_lists]
        assert [json.loads(text) for text in scene.frame_metadata.per_camera] == [
            json.loads(text) for text in direct[scene.scene_id].frame_metadata.per_camera]
    lines = index.read_text().splitlines()
    index.write_text("\n".join(reversed(lines)) + "\n")  # another scene where the first one was
    _read_listing.cache_clear()
    with pytest.raises(DatasetError, match="the index changed since it was read"):
        indexed[0].frame_lists


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return write_nuscenes(tmp_path_factory.mktemp("tiny") / "nuscenes", scenes=1, frames=2)


def _tables(root):
    return {name: json.loads((root / "v1.0-mini" / f"{name}.json").read_text())
            for name in ("sensor", "calibrated_sensor", "scene", "sample_data", "ego_pose")}


def _first_camera_frame(tables):
    return next(d for d in tables["sample_data"] if d["fileformat"] == "jpg")


def _dangling_pose(tables):
    _first_camera_frame(tables)["ego_pose_token"] = "no-such-pose"


def _missing_pose(tables):
    token = _first_camera_frame(tables)["ego_pose_token"]
    tables["ego_pose"] = [p for p in tables["ego_pose"] if p["token"] != token]


def _set(field, value):
    def change(tables):
        _first_camera_frame(tables)[field] = value
    return change


def _empty(name):
    def change(tables):
        tables[name] = []
    return change


@pytest.mark.parametrize("change, match", [
    (_dangling_pose, r"ego_pose.json: ego_pose 'no-such-pose' \(of sample_data \w+\) is not in the table"),
    (_missing_pose, r"ego_pose.json: ego_pose '\w+' \(of sample_data \w+\) is not in the table"),
    (_set("filename", "../outside.jpg"), r"sample_data.json: token '\w+' has filename '../outside.jpg'; it must be"),
    (_set("filename", "samples/../../outside.jpg"), r"sample_data.json: token '\w+' has filename"),
    (_set("filename", "/etc/outside.jpg"), r"sample_data.json: token '\w+' has filename '/etc/outside.jpg'"),
    (_set("timestamp", "1532402927000000"), r"sample_data.json: token '\w+' has timestamp '1532402927000000'"),
    (_set("timestamp", float("nan")), r"sample_data.json: token '\w+' has timestamp nan; it must be an integer"),
    (_empty("sensor"), r"sensor.json: no camera sensor"),
    (_empty("calibrated_sensor"), r"calibrated_sensor.json: no calibrated_sensor of a camera sensor"),
    (_empty("scene"), r"scene.json: no scenes"),
])
def test_bad_tables_are_refused_naming_the_table_and_token(tiny_root, tmp_path, change, match):
    tables = _tables(tiny_root)
    change(tables)
    for name, records in tables.items():
        (tiny_root / "v1.0-mini" / f"{name}.json").write_text(json.dumps(records))  # NaN written as Python does
    try:
        with pytest.raises(DatasetError, match=match):
            discover(tiny_root)
        result = invoke(["index", tiny_root, "-o", tmp_path / "index.jsonl", "--no-progress"])
        assert result.exit_code == 2 and not (tmp_path / "index.jsonl").exists(), result.output
    finally:
        write_nuscenes(tiny_root, scenes=1, frames=2)


def test_a_table_that_is_not_utf8_is_refused_naming_it(tmp_path):
    table = tmp_path / "scene.json"
    table.write_bytes(b'[{"token": "a"}, {"token": "b\xff"}]')
    with pytest.raises(DatasetError, match=r"scene.json: not UTF-8 text \(invalid start byte\)$"):
        list(iter_json_array(table))
    records = ",".join(json.dumps({"token": str(i), "pad": "x" * 1000}) for i in range(1500))
    table.write_bytes(b"[" + records.encode() + b',{"token": "b\xff"}]')  # past the first megabyte read
    with pytest.raises(DatasetError, match=r"scene.json: not UTF-8 text \(.*\) \(after token '\d+'\)"):
        list(iter_json_array(table))


def test_planning_reads_an_index_line_s_head_only(nuscenes_root, tmp_path):
    """A line listing frames is written head first (id, probe, metadata), frames after; planning reads the head and
    seeks past the rest, which is read (and checked) when a clip of the scene is built."""
    from vaecache.planning.clips import plan_clips
    from vaecache.settings.clip import SamplingConfig, SyncConfig
    from vaecache.sources.jsonl import HEAD_MARK, _read_listing, index_line_text

    index = tmp_path / "index.jsonl"
    assert invoke(["index", nuscenes_root, "-o", index, "--no-progress"]).exit_code == 0
    raw = index.read_bytes().splitlines(keepends=True)
    assert all(line.startswith(HEAD_MARK) for line in raw)
    sampling = SamplingConfig(num_frames=5, sync=SyncConfig("timestamps", "CAM_FRONT"))

    def plan(path):
        _read_listing.cache_clear()
        scenes = discover(path).scenes
        planned, _ = plan_clips(scenes, {}, sampling)
        return scenes, [(clip.clip_id, [clip.source(i).files for i in range(len(clip.cameras))],
                         clip.frame_metadata.per_camera) for clip in planned.block(0, 1)]

    scenes, clips = plan(index)
    # the same index written as one plain JSON object per line (an index of an earlier version) plans the same
    plain = tmp_path / "plain.jsonl"
    records = [json.loads(line) for line in raw]
    plain.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "per_frame"}) + "\n" for r in records))
    plain_scenes, plain_clips = plan(plain)
    assert [(s.scene_id, s.probed, s.metadata) for s in plain_scenes] == [
        (s.scene_id, s.probed, s.metadata) for s in scenes]
    assert [c[1:] for c in plain_clips] == [c[1:] for c in clips]
    # a head whose byte counts no longer hold (a line edited by hand) is read whole
    records[0]["description"] = "Straße, edited"
    stale = tmp_path / "stale.jsonl"
    stale.write_text("".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records))
    assert json.loads(plan(stale)[0][0].metadata)["description"] == "Straße, edited"
    # index_line_text counts bytes, not characters
    text = index_line_text(records[0])
    again = json.loads(text)
    marker = again.pop("per_frame")
    assert again == {k: v for k, v in records[0].items() if k != "per_frame"}
    assert len(text.encode()) == marker["at"] + marker["bytes"] and text.encode()[marker["at"]:].startswith(b",")
    # the frames past the head are not parsed while planning: garbled there, the plan holds; the clip built fails
    at = json.loads(raw[0])["per_frame"]["at"]
    garbled = tmp_path / "garbled.jsonl"
    broken = raw[0].index(b'"files":[', at) + len(b'"files":')  # the same length, no longer JSON
    garbled.write_bytes(raw[0][:broken] + b"#" + raw[0][broken + 1:] + b"".join(raw[1:]))
    _read_listing.cache_clear()
    found = discover(garbled).scenes
    assert [s.scene_id for s in found] == [s.scene_id for s in scenes]
    with pytest.raises(DatasetError, match="cannot read scene 'scene-0001' back"):
        found[0].frame_lists
