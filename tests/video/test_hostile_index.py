"""A frame index is checked against its file where that costs nothing and bounded in what it may claim: an index line
whose frame rule is shifted by a frame, claims 10^12 frames, more frames than its file has bytes, or holds a packed
list that inflates past its probe's frame count fails that scene by name (run `vaecache index` again) while the run
goes on, and nothing of the claimed size is allocated. A clip record's frame index altered after encode is named by
plain verify; `verify --reencode` reads its frames without it."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ENCODE_ARGS, read_failures
from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, write_table
from vaecache.errors import VideoDecodeError
from vaecache.training import LatentCache
from vaecache.video.timeline import Timeline, pack


@pytest.fixture(scope="module")
def demo_index(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import invoke

    index = tmp_path_factory.mktemp("index") / "index.jsonl"
    result = invoke(["index", demo_data, "-o", index, "--no-progress"])
    assert result.exit_code == 0, result.output
    return index


def _edited(demo_index: Path, tmp_path: Path, edit) -> Path:
    """The index with scene_001's cam_0 probe edited by `edit(probe)`."""
    lines = [json.loads(line) for line in demo_index.read_text().splitlines()]
    for line in lines:
        if line["id"] == "scene_001":
            edit(line["probe"]["cam_0"])
    index = tmp_path / "index.jsonl"
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return index


def _rule(probe: dict, first: int | None = None, count: int | None = None) -> None:
    version, pts, rest = probe["timeline"].split("|", 2)
    start, step, frames = map(int, pts.split(","))
    probe["timeline"] = f"{version}|{start if first is None else first(start, step)},{step},{count or frames}|{rest}"


def _packed_zeros(probe: dict) -> None:
    """A packed frame list of ten million times: 80 MB inflated, about 80 KB as base64."""
    version, _, rest = probe["timeline"].split("|", 2)
    probe["timeline"] = f"{version}|*{pack(np.zeros(10_000_000, dtype=np.int64))}|{rest}"


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda probe: _rule(probe, first=lambda start, step: start + step), "does not match the file"),
    (lambda probe: _rule(probe, count=10**12), "its frame index claims 1000000000000 frames, its probe 17"),
    (lambda probe: probe.update(frames=10**12), "its probe claims 1000000000000 frames in a file of"),
    (_packed_zeros, "holds more than 17 rows"),
], ids=["shifted-rule", "rule-of-1e12-frames", "probe-of-1e12-frames", "list-inflating-to-80MB"])
def test_a_hostile_index_line_fails_its_scene_by_name_and_the_run_goes_on(demo_index: Path, tmp_path: Path, run_cli,
                                                                         edit, reason: str) -> None:
    index = _edited(demo_index, tmp_path, edit)
    out = tmp_path / "out"
    result = run_cli(["encode", index, "--out", out, *ENCODE_ARGS])
    assert result.exit_code == 3, result.output  # done, one scene's clips recorded as failed
    assert {record["scene"] for record in CacheReader(out).clip_records()} == {"scene_000", "scene_002"}
    failures = read_failures(out)
    assert failures and {failure["scene"] for failure in failures} == {"scene_001"}
    assert all(reason in failure["reason"] and "vaecache index" in failure["reason"] for failure in failures), failures
    assert all(failure["path"].endswith("scene_001/cam_0.mp4") for failure in failures), failures
    assert run_cli(["verify", out]).exit_code == 0


def test_a_one_camera_line_claiming_what_its_file_cannot_hold_is_skipped_by_name(demo_index: Path, tmp_path: Path,
                                                                                  run_cli) -> None:
    """A "path" line (one camera, planned without judging its scene: nothing to compare) is checked alike."""
    lines = []
    for line in map(json.loads, demo_index.read_text().splitlines()):
        probe = line["probe"]["cam_0"]
        if line["id"] == "scene_001":
            _rule(probe, count=10**12)
        lines.append({"id": line["id"], "path": line["cameras"]["cam_0"], "probe": probe})
    index = tmp_path / "paths.jsonl"
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    result = run_cli(["encode", index, "--out", out, *ENCODE_ARGS])
    assert result.exit_code == 3, result.output
    (failure,) = read_failures(out)
    assert failure["scene"] == "scene_001" and failure["path"].endswith("scene_001/cam_0.mp4")
    assert failure["reason"] == "its frame index claims 1000000000000 frames, its probe 17: run `vaecache index` again"


def test_a_frame_rule_past_its_bound_is_damage_found_before_anything_is_listed() -> None:
    text = "v1|0,1024,1000000000000|" + pack(np.array([[0, 0, -1, -1]])) + "||0"
    timeline = Timeline.from_json(text, "here", frames=17)
    tracemalloc.start()
    with pytest.raises(ValueError, match="its frame rule claims 1000000000000 frames, more than the video can have"):
        timeline.pts()
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()
    assert Timeline.from_json(text.replace("1000000000000", "17"), "here", frames=17).frame_count() == 17


def test_a_packed_list_stops_inflating_at_its_bound() -> None:
    # 256 MiB of zeros deflate to 255 KB (2 GiB to 2 MB, a 2.7 MB base64 line): inflated with a bound, nothing near
    # the inflated size is allocated
    deflater = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    packed = b"".join([deflater.compress(bytes(1 << 24)) for _ in range(16)]) + deflater.flush()
    text = f"v1|*{base64.b64encode(packed).decode()}|{pack(np.array([[0, 0, -1, -1]]))}||0"
    tracemalloc.start()
    with pytest.raises(ValueError, match="holds more than 17 rows"):
        Timeline.from_json(text, "here", frames=17).pts()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # the base64 text decoded, not the 256 MiB it inflates to


# --------------------------------------------------------------------------- a clip record's cut, after encode


def _shift_cut(good_cache: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the cache with one clip's recorded cut shifted by a frame, the table's hash recomputed."""
    cache = Path(shutil.copytree(good_cache, tmp_path / "cache"))
    records = list(CacheReader(cache).clip_records())
    target = records[1]
    cut = target["source_timelines"][0]
    version, pts, rest = cut.split("|", 2)
    start, step, count = map(int, pts.split(","))
    target["source_timelines"][0] = f"{version}|{start + step},{step},{count}|{rest}"
    write_table(cache / "clips.parquet", CLIP_TABLE, records)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["clips"]["sha256"] = hashlib.sha256((cache / "clips.parquet").read_bytes()).hexdigest()
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return cache, target["id"]


def test_plain_verify_names_a_clip_records_altered_frame_index(good_cache: Path, tmp_path: Path, run_cli) -> None:
    assert (good_cache / "probes").is_dir()
    cache, clip = _shift_cut(good_cache, tmp_path)
    report = tmp_path / "report.json"
    result = run_cli(["verify", cache, "--json", report])
    assert result.exit_code == 1, result.output
    (check,) = [check for check in json.loads(report.read_text())["checks"]
                if check["name"] == "recorded frame indexes"]
    assert check["failed"] == 1 and check["problems"][0].startswith(f"clip {clip}: camera cam_0: its recorded frame "
                                                                    "index (source_timelines) is not its source's")
    with pytest.raises(VideoDecodeError, match="its recorded frame index does not match the file"):
        LatentCache(cache).source_frames(clip)  # never the shifted frames
    unindexed = LatentCache(cache).source_frames(clip, indexed=False)
    assert torch.equal(unindexed, LatentCache(good_cache).source_frames(clip))
    reencoded = run_cli(["verify", cache, "--reencode", "3", "--json", report])
    (check,) = [check for check in json.loads(report.read_text())["checks"] if check["name"].startswith("re-encode")]
    assert check["failed"] == 0 and check["passed"] == 3, check  # its frames read by the video's own packets
    assert reencoded.exit_code == 1  # the altered index is still named


def test_verify_passes_the_cuts_encode_recorded(good_cache: Path, tmp_path: Path, run_cli) -> None:
    report = tmp_path / "report.json"
    assert run_cli(["verify", good_cache, "--json", report]).exit_code == 0
    (check,) = [check for check in json.loads(report.read_text())["checks"]
                if check["name"] == "recorded frame indexes"]
    assert check["failed"] == 0 and check["passed"] == 6  # three clips of two cameras
