"""`vaecache plan` shows, per DP group, exactly the clips a real multi-rank encode commits per writer rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vaecache.demodata import DemoDataSpec, write_demo_dataset

pytestmark = pytest.mark.slow

CLIP_ARGS = ["--vae", "builtin:tiny", "--num-frames", "5", "--size", "32x32"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    # 5 scenes x 2 clips = 10 clips: round-robin and contiguous blocks give different shares.
    root = tmp_path_factory.mktemp("plan-vs-encode")
    write_demo_dataset(root, DemoDataSpec(scenes=5, cameras=2, frames=10, height=32, width=32, seed=11))
    return root


def _written_per_writer(out: Path) -> dict[int, list[str]]:
    """Writer rank -> the clip ids it committed, in commit order (from OUT/progress/rank-XXXXX.jsonl)."""
    written = {}
    for log in sorted((out / "progress").glob("rank-*.jsonl")):
        rank = int(log.stem.split("-")[1])
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        written[rank] = [clip["id"] for line in lines for clip in line["clips"]]
    return written


@pytest.mark.parametrize(("world", "sp", "batch"), [(4, 2, 3)], ids=["dp2xsp2-b3"])  # two DP groups of two SP ranks
def test_plan_clip_ids_per_dp_group_equal_what_each_writer_rank_commits(procs, data, tmp_path, world, sp, batch):
    shape = ["--sp-size", str(sp), "--batch-size", str(batch)]
    plan = procs.vaecache("plan", data, *CLIP_ARGS, "--world-size", world, *shape, "--no-measure", "--json", "-")
    assert plan.returncode == 0, plan.stderr
    groups = json.loads(plan.stdout)["ranks"]["dp_groups"]
    planned = {group["ranks"][0]: group["clip_ids"] for group in groups}

    out = tmp_path / "out"
    encode = procs.torchrun(world, "encode", data, "--out", out, *CLIP_ARGS, *shape, "--workers", "0", "--no-progress")
    assert encode.returncode == 0, encode.stderr[-3000:]
    written = _written_per_writer(out)

    assert sorted(written) == sorted(planned) == list(range(0, world, sp))  # one writer per SP group
    assert written == planned
    assert sum(len(ids) for ids in planned.values()) == 10 and all(planned.values())
