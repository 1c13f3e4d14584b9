"""`vaecache index` on two torchrun ranks writes the same bytes as one process."""

from __future__ import annotations

from pathlib import Path

import pytest

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
