"""LeRobot datasets as DATA (v3.0 and v2.1, AV1 as LeRobot writes it): an episode is a scene, each camera read at its
episode's span of a shared file by time, latents equal to those of the episodes cut out losslessly, tasks as
captions clip by clip, state and action rows of the clip's frames with --lerobot-state."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_same_tensors, invoke, load_tensors, read_clips, read_failures
from tests.sources.lerobot_fixture import CAMERAS, write_lerobot
from vaecache.sources.discover import discover
from vaecache.video.spans import span_of

ENCODE = ("--vae", "builtin:tiny", "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress")
EPISODES = [["pick the cube"] * 12, ["pick the cube"] * 6 + ["place it in the bowl"] * 6, ["open the drawer"] * 10,
            ["pick the cube"] * 8]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    # the wrist camera starts a new file at episode 2, the top camera keeps one file: their spans differ
    return write_lerobot(tmp_path_factory.mktemp("lerobot") / "v3", EPISODES,
                         new_file_at={"observation.images.wrist": {2}})


def test_episodes_are_scenes_and_cameras_their_spans_of_shared_files(v3):
    scenes = discover(v3).scenes
    assert [s.scene_id for s in scenes] == [f"episode_{e:06d}" for e in range(4)]
    assert scenes[0].cameras == CAMERAS
    spans = [[span_of(path) for path in scene.paths] for scene in scenes]
    assert {span.path.rsplit("/", 1)[1] for row in spans for span in row} == {"file-000.mp4", "file-001.mp4"}
    assert spans[2][1].from_ns == 0 and spans[2][0].from_ns > 0  # wrist rolled over, top did not
    assert all(scene.probed is not None for scene in scenes)  # planned from the tables: no video opened
    assert json.loads(scenes[2].metadata)["caption"] == "open the drawer"
    assert "caption" not in json.loads(scenes[1].metadata)  # two tasks: each clip says its own


def test_latents_equal_those_of_the_episodes_cut_out_losslessly(v3, tmp_path):
    cuts = v3.parent / "v3-cuts"
    for data, out, extra in ((v3, "lerobot", ("--lerobot-state",)), (cuts, "cuts", ())):
        result = invoke(["encode", data, "--out", tmp_path / out, *ENCODE, *extra])
        assert result.exit_code == 0, result.output
    from_lerobot = load_tensors(tmp_path / "lerobot")
    assert len(from_lerobot) == 2 * (2 + 2 + 2 + 1)  # mean and logvar of 5-frame clips, none across an episode
    assert_same_tensors(from_lerobot, load_tensors(tmp_path / "cuts"))
    records = {r["id"]: r for r in read_clips(tmp_path / "lerobot")}
    mixed = records["episode_000001/000005-000009"]["metadata"]
    assert mixed["caption"] == "pick the cube; place it in the bowl"
    assert mixed["lerobot_frames"]["task_index"] == [0, 1, 1, 1, 1]
    assert mixed["lerobot_frames"]["observation.state"][0] == pytest.approx([1.0, 5.0, 0.5])
    assert mixed["lerobot_frames"]["action"][4] == pytest.approx([0.9, -1.0, 1.0])
    assert records["episode_000001/000000-000004"]["metadata"]["caption"] == "pick the cube"
    assert records["episode_000002/000005-000009"]["metadata"]["lerobot"]["tasks"] == ["open the drawer"]
    checked = invoke(["verify", tmp_path / "lerobot", "--dataset", v3])
    assert checked.exit_code == 0, checked.output


def test_v2_1_gives_the_same_latents(v3, tmp_path):
    v2 = write_lerobot(tmp_path / "v2", EPISODES, version="v2.1")
    for data, out in ((v3, "out-v3"), (v2, "out-v2")):
        assert invoke(["encode", data, "--out", tmp_path / out, *ENCODE]).exit_code == 0
    assert_same_tensors(load_tensors(tmp_path / "out-v3"), load_tensors(tmp_path / "out-v2"))
    assert [r["metadata"]["caption"] for r in read_clips(tmp_path / "out-v2")][:1] == ["pick the cube"]


def test_a_span_that_disagrees_with_the_episode_or_a_frame_off_time_is_a_recorded_failure(tmp_path):
    import pyarrow.parquet as pq

    root = write_lerobot(tmp_path / "bad", EPISODES[:3])
    table = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    rows = pq.read_table(table).to_pylist()
    rows[1]["videos/observation.images.top/to_timestamp"] += 0.3  # 3 frames too long a span
    rows[2]["videos/observation.images.wrist/from_timestamp"] += 0.04  # between two frames of the file
    rows[2]["videos/observation.images.wrist/to_timestamp"] += 0.04
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(table)), table)
    result = invoke(["encode", root, "--out", tmp_path / "out", *ENCODE])
    assert result.exit_code == 3, result.output
    reasons = {f["scene"]: f["reason"] for f in read_failures(tmp_path / "out")}
    assert "the episode's 12 frames at 10 fps take 1.200000 s" in reasons["episode_000001"]
    assert "has no frame within 0.0001 s" in reasons["episode_000002"]
    assert {r["scene"] for r in read_clips(tmp_path / "out")} == {"episode_000000"}


def test_cameras_choose_and_a_wrong_name_is_refused(v3, tmp_path):
    scenes = discover(v3, ["observation.images.wrist"]).scenes
    assert scenes[0].cameras == ("observation.images.wrist",)
    refused = invoke(["encode", v3, "--out", tmp_path / "o", *ENCODE, "--cameras", "observation.images.side"])
    assert refused.exit_code == 2 and "not video features here" in refused.output


def test_an_index_of_a_lerobot_dataset_keeps_each_clip_s_tasks_and_state(v3, tmp_path, monkeypatch):
    """...and each episode's frame index: its camera file's timeline cut to the episode, so a decode worker opens the
    shared file demuxing nothing (and, at a URL, reads the episode's ranges, not the file)."""
    from vaecache.video.reader import VideoReader
    from vaecache.video.timeline import Timeline

    index = tmp_path / "index.jsonl"
    assert invoke(["index", v3, "-o", index, "--no-progress"]).exit_code == 0
    line = json.loads(index.read_text().splitlines()[1])
    assert line["lerobot_rows"]["episode"] == 1 and span_of(line["cameras"]["observation.images.top"]) is not None
    top = line["probe"]["observation.images.top"]
    cut = Timeline.from_json(top["timeline"], "line 2", 10**6)
    assert cut.pts_rule is not None and cut.pts_rule[2] > top["frames"]  # the file's, cut to the episode
    assert invoke(["encode", v3, "--out", tmp_path / "direct", *ENCODE, "--lerobot-state"]).exit_code == 0

    def demuxed(self):
        raise AssertionError(f"{self.path} was demuxed to index it")

    with monkeypatch.context() as patched:
        patched.setattr(VideoReader, "_index", demuxed)
        indexed = invoke(["encode", index, "--out", tmp_path / "indexed", *ENCODE, "--lerobot-state"])
    assert indexed.exit_code == 0, indexed.output
    assert_same_tensors(load_tensors(tmp_path / "direct"), load_tensors(tmp_path / "indexed"))
    assert invoke(["verify", tmp_path / "indexed"]).exit_code == 0
    direct = {r["id"]: r["metadata"] for r in read_clips(tmp_path / "direct")}
    assert direct == {r["id"]: r["metadata"] for r in read_clips(tmp_path / "indexed")}


def _rewrite(table, change) -> None:
    """Rewrite a Parquet table with `change(rows)` applied to its rows, keeping its schema (and pandas metadata)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(table).to_pylist()
    change(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(table)), table)


def test_bad_numbers_in_the_episode_tables_skip_their_episode_or_clip_naming_the_table_and_row(v3, tmp_path):
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(v3, root)
    top = "videos/observation.images.top"

    def episodes(rows):
        rows[1][f"{top}/from_timestamp"] = float("nan")
        rows[2]["length"] = -1

    def data(rows):
        rows[6]["task_index"] = 7  # episode 0 frame 6: no such task
        rows[12 + 6 + 6 + 10 + 1]["timestamp"] = float("nan")  # episode 3 frame 1

    _rewrite(root / "meta" / "episodes" / "chunk-000" / "file-000.parquet", episodes)
    _rewrite(root / "data" / "chunk-000" / "file-000.parquet", data)
    result = invoke(["encode", root, "--out", tmp_path / "out", *ENCODE])
    assert result.exit_code == 3, result.output
    failures = {f["clip"] or f["scene"]: f for f in read_failures(tmp_path / "out")}
    assert set(failures) == {"episode_000000/000005-000009", "episode_000001", "episode_000002",
                             "episode_000003/000000-000004"}
    assert failures["episode_000001"]["path"].endswith("meta/episodes/chunk-000/file-000.parquet")
    assert failures["episode_000001"]["reason"] == f"row 1: {top}/from_timestamp must be a finite time >= 0 s, got nan"
    assert failures["episode_000002"]["reason"] == "row 2: length must be a whole number of frames >= 1, got -1"
    assert ("episode 0 frame 6: task_index 7 is not a task of " in failures["episode_000000/000005-000009"]["reason"]
            and "meta/tasks.parquet" in failures["episode_000000/000005-000009"]["reason"])  # never "task 7"
    assert "episode 3 frame 1 has timestamp nan" in failures["episode_000003/000000-000004"]["reason"]
    assert [r["id"] for r in read_clips(tmp_path / "out")] == ["episode_000000/000000-000004"]


def test_a_task_table_or_episode_line_that_names_no_index_is_refused_naming_its_row(v3, tmp_path):
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(v3, root)
    _rewrite(root / "meta" / "tasks.parquet", lambda rows: rows[1].update(task_index=None))
    result = invoke(["encode", root, "--out", tmp_path / "out", *ENCODE])
    assert result.exit_code == 2, result.output
    assert "tasks.parquet: row 1: a task needs a task_index (a whole number >= 0)" in result.output
    v2 = write_lerobot(tmp_path / "v2", EPISODES[:2], version="v2.1")
    lines = (v2 / "meta" / "episodes.jsonl").read_text().splitlines()
    (v2 / "meta" / "episodes.jsonl").write_text(lines[0].replace('"length": 12', '"length": 12.5') + "\n"
                                                + lines[1] + '\n{"episode_index": -2, "length": 3}\n')
    result = invoke(["encode", v2, "--out", tmp_path / "out2", *ENCODE])
    assert result.exit_code == 2, result.output
    assert 'episodes.jsonl:3: "episode_index" must be a whole number >= 0, got -2' in result.output
    (v2 / "meta" / "episodes.jsonl").write_text(lines[0].replace('"length": 12', '"length": 12.5') + "\n"
                                                + lines[1] + "\n")
    result = invoke(["encode", v2, "--out", tmp_path / "out3", *ENCODE])
    assert result.exit_code == 3, result.output
    (failure,) = read_failures(tmp_path / "out3")
    assert failure["scene"] == "episode_000000" and failure["path"].endswith("meta/episodes.jsonl")
    assert failure["reason"] == "line 1: length must be a whole number of frames >= 1, got 12.5"


def test_whole_numbers_from_the_tables_never_overflow_a_float_check():
    from vaecache.sources.lerobot import _whole

    assert _whole(10**400) == 10**400 and _whole(3.0) == 3 and _whole(-1) is None
    assert _whole(float("nan")) is None and _whole(2.5) is None and _whole(True) is None and _whole("3") is None
