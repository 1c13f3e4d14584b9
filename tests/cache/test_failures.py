"""Failure logs read back strictly (vaecache/cache/failures.py over cache/io.py's JSON Lines reader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vaecache.cache.failures import read_failures
from vaecache.errors import ClipTableError


def _log(out: Path, data: bytes) -> Path:
    (out / "progress").mkdir()
    path = out / "progress" / "failures-rank-00000.jsonl"
    path.write_bytes(data)
    return path


def test_a_torn_last_line_is_ignored_whatever_bytes_it_ends_in(tmp_path: Path) -> None:
    _log(tmp_path, b'{"scene": "a", "reason": "too short"}\n{"scene": "b", "reason": "caf\xc3')
    assert read_failures(tmp_path) == [{"scene": "a", "reason": "too short"}]


@pytest.mark.parametrize("line", [b'{"scene": "b", "reason": "\xff"}', b'{"scene": "b", "fps": NaN}', b"{"])
def test_a_whole_line_that_does_not_parse_is_named_never_dropped(tmp_path: Path, line: bytes) -> None:
    path = _log(tmp_path, b'{"scene": "a", "reason": "too short"}\n' + line + b'\n{"scene": "c", "reason": "x"}\n')
    with pytest.raises(ClipTableError, match=rf"{path}: line at byte 38 does not parse"):
        read_failures(tmp_path)
