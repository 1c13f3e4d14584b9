"""A Scene as JSON and back (how rank 0 of `vaecache index` hands each rank its scenes): every layout's scenes come
back equal, field for field, frame-list keys and per-frame metadata included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sources.lerobot_fixture import write_lerobot
from tests.sources.nuscenes_fixture import write_nuscenes
from vaecache.sources.discover import discover
from vaecache.sources.jsonl import IndexLineListing
from vaecache.sources.lerobot import EpisodeRows
from vaecache.sources.scene import HeldListing, Scene
from vaecache.sources.scene_json import scene_from_json, scene_to_json, scenes_from_bytes, scenes_to_bytes


def _round_trip(scenes: list[Scene]) -> list[Scene]:
    assert [scene_from_json(json.loads(json.dumps(scene_to_json(s)))) for s in scenes] == scenes
    back = list(scenes_from_bytes(scenes_to_bytes(scenes)))
    assert back == scenes
    return back


def test_nuscenes_scenes_keep_their_frame_list_keys_times_and_ego_poses(tmp_path: Path) -> None:
    root = write_nuscenes(tmp_path / "nuscenes", drop={(1, "CAM_BACK"): 8})
    scenes = discover(root).scenes
    back = _round_trip(scenes)
    for scene, again in zip(scenes, back):
        assert isinstance(again.listing, HeldListing)
        assert [listed.key for listed in again.frame_lists] == list(again.paths)  # ROOT#scene/CAM, the cache's key
        assert again.paths[1] == f"{root.resolve()}#{scene.scene_id}/CAM_FRONT"
        assert again.frame_metadata.per_camera == scene.frame_metadata.per_camera  # the same text, byte for byte
        assert again.metadata == scene.metadata


def test_folder_table_and_index_scenes_come_back_equal(demo_data: Path, tmp_path: Path, run_cli) -> None:
    _round_trip(discover(demo_data).scenes)
    video = demo_data / "scene_000" / "cam_0.mp4"
    lines = [{"id": "frames", "path": str(video), "frames": [2, 9], "caption": "a caption"},
             {"id": "seconds", "path": str(video), "seconds": [0.1, 0.7], "fps": 7.5},
             {"id": "listed", "cameras": {"cam_0": {"files": ["a.jpg", "b.jpg"], "times_ns": [0, 40_000_000]}},
              "frame_metadata": {"cam_0": [{"pose": 0.1}, {"pose": 1e-7}]}}]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    scenes = discover(mixed).scenes
    assert scenes[0].frame_range == (2, 9) and scenes[1].time_range is not None and scenes[1].frame_rate == 7.5
    _round_trip(scenes)
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps(lines[2]) + "\n")
    (scene,) = _round_trip(discover(listed).scenes)
    assert isinstance(scene.listing, HeldListing) and scene.frame_metadata is not None
    table = tmp_path / "clips.csv"
    table.write_text(f"path,start,end,caption\n{video},0.5,1.0,a red car\n{video},,,whole\n")
    _round_trip(discover(table).scenes)
    # an index `vaecache index` wrote: its frame lists stay in the line (IndexLineListing), read back from there
    root = write_nuscenes(tmp_path / "nuscenes", scenes=1, frames=7)
    index = tmp_path / "index.jsonl"
    assert run_cli(["index", root, "-o", index, "--no-progress"]).exit_code == 0
    (scene,) = _round_trip(discover(index).scenes)
    assert isinstance(scene.listing, IndexLineListing) and scene.probed is not None
    assert scene.frame_lists == discover(index).scenes[0].frame_lists


def test_lerobot_episodes_come_back_equal(tmp_path: Path) -> None:
    root = write_lerobot(tmp_path / "lerobot", [["pick the cube"] * 6, ["open the drawer"] * 5])
    scenes = _round_trip(discover(root).scenes)
    assert all(isinstance(scene.listing, EpisodeRows) for scene in scenes)


def test_a_listing_of_an_unknown_kind_is_refused_not_dropped(demo_data: Path) -> None:
    scene = discover(demo_data).scenes[0]

    class Odd:
        cameras, lists_frames, frame_lists, frame_metadata = len(scene.cameras), False, None, None

    odd = Scene(scene.scene_id, scene.cameras, scene.paths, listing=Odd())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Odd"):
        scenes_to_bytes([odd])
