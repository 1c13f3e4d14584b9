"""Deterministic fault injection for durability tests, driven by one environment variable.

VAECACHE_FAULT="<point>:<k>[@<rank>]" makes rank <rank> (default: every rank) fail at its k-th shard:
  crash-after-commit   os._exit(137) right after shard k and its progress line are durable
  crash-mid-write      os._exit(137) with half of shard k's temp file written (no rename)
  crash-before-record  os._exit(137) after shard k was renamed into place but before its progress line
  enospc               shard k's write fails with OSError(ENOSPC), as on a full disk
os._exit skips every cleanup handler, like a SIGKILL or a node failure.
"""

from __future__ import annotations

import errno
import os

FAULT_ENV = "VAECACHE_FAULT"
POINTS = ("crash-after-commit", "crash-mid-write", "crash-before-record", "enospc")


def _parse(value: str) -> tuple[str, int, int | None] | None:
    if not value:
        return None
    spec, _, rank = value.partition("@")
    point, _, count = spec.partition(":")
    if point not in POINTS or not count.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r}: expected <point>:<k>[@<rank>] with point in {', '.join(POINTS)}")
    return point, int(count), int(rank) if rank else None


def should_fail(point: str, shard_number: int, rank: int) -> bool:
    """True when the environment asks for `point` at this rank's shard number `shard_number` (1-based)."""
    parsed = _parse(os.environ.get(FAULT_ENV, ""))
    if parsed is None:
        return False
    want_point, count, want_rank = parsed
    return want_point == point and count == shard_number and (want_rank is None or want_rank == rank)


def crash() -> None:
    os._exit(137)


def disk_full(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
