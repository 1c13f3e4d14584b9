"""`vaecache index` on two torchrun ranks writes the same bytes as one process; rank 0 alone reads DATA."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.sources.nuscenes_fixture import CHANNELS_IN_SURROUND, write_nuscenes

pytestmark = pytest.mark.slow


def test_two_rank_index_is_byte_identical_to_a_one_process_index(procs, run_cli, demo_data: Path,
                                                                  tmp_path: Path) -> None:
    alone, ranks = tmp_path / "alone.jsonl", tmp_path / "ranks.jsonl"
    single = run_cli(["index", demo_data, "-o", alone, "--workers", "2", "--no-progress"])
    assert single.exit_code == 0, single.output
    both = procs.torchrun(2, "index", demo_data, "-o", ranks, "--workers", "1", "--no-progress")
    assert both.returncode == 0, both.stderr[-3000:]
    assert ranks.read_bytes() == alone.read_bytes() and alone.read_text().count("\n") == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone.jsonl", "ranks.jsonl"]  # nothing rejected: no file
    assert both.stderr.count("vaecache index ->") == 1  # rank 0 alone reports


def test_two_rank_index_of_a_nuscenes_root_reads_the_tables_on_rank_0_alone(procs, run_cli, tmp_path: Path) -> None:
    root = write_nuscenes(tmp_path / "nuscenes", scenes=3, drop={(1, "CAM_BACK"): 8})
    alone, ranks = tmp_path / "alone.jsonl", tmp_path / "ranks.jsonl"
    single = run_cli(["index", root, "-o", alone, "--no-progress"])
    assert single.exit_code == 0, single.output
    both = subprocess.run(procs.torchrun_cmd(2, "index", root, "-o", ranks, "--workers", "1", "--no-progress"),
                          capture_output=True, text=True, env=procs.env(COLUMNS="250"), timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    # the same bytes: frame lists (keys ROOT#scene/CAM in the probe cache of the partial files) and per-frame ego poses
    assert ranks.read_bytes() == alone.read_bytes() and alone.read_text().count("\n") == 3
    # rank 0 read the tables and sent rank 1 its one scene of three (round-robin); rank 1 never read DATA
    found = re.search(r"per rank\s*│\s*rank 0 read DATA \(3 scenes\) (\d+) MB, rank 1 got 1 scene (\d+) MB\s*│",
                      both.stderr)
    assert found is not None, both.stderr[-3000:]
    assert int(found[1]) > 0 and int(found[2]) > 0


def test_a_nuscenes_index_killed_on_rank_1_resumes_from_the_scenes_rank_1_got_as_json(procs, run_cli,
                                                                                       tmp_path: Path) -> None:
    root = write_nuscenes(tmp_path / "nuscenes", scenes=4, frames=7)
    alone, index = tmp_path / "alone.jsonl", tmp_path / "index.jsonl"
    assert run_cli(["index", root, "-o", alone, "--no-progress"]).exit_code == 0
    killed = subprocess.run(procs.torchrun_cmd(2, "index", root, "-o", index, "--workers", "1", "--no-progress"),
                            capture_output=True, text=True, env=procs.env(VAECACHE_FAULT="crash-after-probe:1@1"),
                            timeout=300)
    assert killed.returncode != 0 and not index.exists()
    # rank 1 probed the second scene (rank 0 sent it scenes 2 and 4) under its frame lists' keys, ROOT#scene/CAM
    records = (tmp_path / "index.jsonl.partial" / "rank-00001.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["path"] for line in records) == sorted(
        f"{root.resolve()}#scene-0002/{camera}" for camera in CHANNELS_IN_SURROUND)
    (tmp_path / "index.jsonl.partial" / "rank-00000.jsonl").unlink(missing_ok=True)  # rank 1's records alone
    resumed = run_cli(["index", root, "-o", index, "--workers", "1", "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert re.search(r"from an earlier run\s*│\s*1\s*│", resumed.output), resumed.output  # not opened again
    assert re.search(r"probed now\s*│\s*3\s*│", resumed.output), resumed.output
    assert index.read_bytes() == alone.read_bytes()
