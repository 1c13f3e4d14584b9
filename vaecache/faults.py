"""Deterministic fault injection for tests, driven by one environment variable and one grammar.

``VAECACHE_FAULT`` holds one or more faults separated by ``,``:

Shard faults, ``<point>:<k>[@<rank>]``: rank <rank> (default: every rank) fails at its k-th shard:
  crash-after-commit   os._exit(137) right after shard k and its progress line are durable
  crash-mid-write      os._exit(137) with half of shard k's temp file written (no rename)
  crash-before-record  os._exit(137) after shard k was renamed into place but before its progress line
  enospc               shard k's write fails with OSError(ENOSPC), as on a full disk
  crash-after-probe    `vaecache index`: os._exit(137) once the k-th scene this rank probed is durable
  crash-after-set-shard:<kind>  `vaecache embed` (and any embed of a set kind, vaecache.cache.kinds): os._exit(137)
                       once this rank's k-th shard of that kind (of every set it writes) is written and committed,
                       e.g. ``crash-after-set-shard:text:2``, ``crash-after-set-shard:conditions:1@0``
  crash-after-text-shard, crash-after-condition-shard  the same for the kinds text and conditions (older names)
os._exit skips every cleanup handler, like a SIGKILL or a node failure.

Out-of-memory faults, ``oom:COUNT[>K][:untiled]`` (every rank): the VAE runner raises
``torch.cuda.OutOfMemoryError`` before chosen forwards, so its backoff can be tested on any machine.
COUNT is a number or ``*`` (every matching forward); ``>K`` matches only forwards of more than K units
(views, or frames for per-frame VAEs); ``:untiled`` only forwards without tiling. ``oom:2``: the first
two forwards; ``oom:*>1``: every forward of 2+ views; ``oom:*:untiled``: every untiled forward (the
tiling fallback then succeeds); ``oom:*``: every forward.

Example: ``VAECACHE_FAULT="oom:*>1,crash-after-commit:3@1"``.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

from vaecache.errors import UsageError

FAULT_ENV = "VAECACHE_FAULT"
POINTS = ("crash-after-commit", "crash-mid-write", "crash-before-record", "enospc", "crash-after-probe",
          "crash-after-text-shard", "crash-after-condition-shard")
OOM = "oom"
_GRAMMAR = (f"<point>:<k>[@<rank>] (point: {', '.join(POINTS)}, crash-after-set-shard:<kind>) or "
            "oom:COUNT[>K][:untiled], separated by ','")


@dataclass(frozen=True)
class ShardFault:
    """Fail at `point` on the `shard_number`-th shard (1-based) of rank `rank` (None: every rank)."""

    point: str
    shard_number: int
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.point not in POINTS and not self.point.startswith(SET_SHARD + ":"):
            raise UsageError(f"{FAULT_ENV}: unknown fault point {self.point!r}; expected {_GRAMMAR}")
        if self.shard_number < 1 or (self.rank is not None and self.rank < 0):
            raise UsageError(f"{FAULT_ENV}: shard number must be >= 1 and rank >= 0 in {self}")


@dataclass(frozen=True)
class OomFault:
    """Which forwards run out of memory: up to `count` (None: all) of more than `more_than` units."""

    count: int | None = None
    more_than: int = 0
    untiled_only: bool = False

    def __post_init__(self) -> None:
        if (self.count is not None and self.count < 0) or self.more_than < 0:
            raise UsageError(f"{FAULT_ENV}: oom count and >K must be >= 0 in {self}")


class OomInjector:
    """A running OomFault: ``injector(units, tiled)`` says whether this forward runs out of memory."""

    def __init__(self, fault: OomFault) -> None:
        self.fault = fault
        self.remaining = fault.count
        self.injected = 0

    def __call__(self, units: int, tiled: bool) -> bool:
        if units <= self.fault.more_than or (self.fault.untiled_only and tiled):
            return False
        if self.remaining is not None:
            if self.remaining <= 0:
                return False
            self.remaining -= 1
        self.injected += 1
        return True


_SHARD = re.compile(r"([a-z-]+):(\d+)(?:@(\d+))?")
SET_SHARD = "crash-after-set-shard"
_SET_SHARD = re.compile(SET_SHARD + r":([A-Za-z0-9][A-Za-z0-9._-]*):(\d+)(?:@(\d+))?")
_SET_ALIASES = {"crash-after-text-shard": "text", "crash-after-condition-shard": "conditions"}
_OOM = re.compile(r"oom:(\*|\d+)(?:>(\d+))?(:untiled)?")


def parse(text: str) -> tuple[ShardFault | OomFault, ...]:
    """Every fault in a VAECACHE_FAULT value (empty: none). UsageError on anything it does not know."""
    faults: list[ShardFault | OomFault] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.startswith(OOM + ":"):
            match = _OOM.fullmatch(item.replace(" ", ""))
            if not match:
                raise UsageError(f"{FAULT_ENV}={text!r}: {item!r}: expected oom:COUNT[>K][:untiled], "
                                 "e.g. 'oom:2', 'oom:*>1' or 'oom:*:untiled'")
            count = None if match.group(1) == "*" else int(match.group(1))
            faults.append(OomFault(count, int(match.group(2) or 0), bool(match.group(3))))
            continue
        match = _SET_SHARD.fullmatch(item)
        if match:
            rank = match.group(3)
            faults.append(ShardFault(f"{SET_SHARD}:{match.group(1)}", int(match.group(2)), int(rank) if rank else None))
            continue
        match = _SHARD.fullmatch(item)
        if not match or match.group(1) not in POINTS:
            raise UsageError(f"{FAULT_ENV}={text!r}: {item!r}: expected {_GRAMMAR}")
        rank = match.group(3)
        faults.append(ShardFault(match.group(1), int(match.group(2)), int(rank) if rank else None))
    return tuple(faults)


def from_env() -> tuple[ShardFault | OomFault, ...]:
    return parse(os.environ.get(FAULT_ENV, ""))


def should_fail(point: str, shard_number: int, rank: int) -> bool:
    """True when the environment asks for `point` at this rank's shard number `shard_number` (1-based)."""
    return any(isinstance(fault, ShardFault) and fault.point == point and fault.shard_number == shard_number
               and (fault.rank is None or fault.rank == rank) for fault in from_env())


def should_fail_set(kind: str, shard_number: int, rank: int) -> bool:
    """`crash-after-set-shard:<kind>` (or its older name for text and conditions) at this rank's shard number."""
    return any(should_fail(point, shard_number, rank) for point in
               (f"{SET_SHARD}:{kind}", *(old for old, named in _SET_ALIASES.items() if named == kind)))


def oom_injector() -> OomInjector | None:
    """The out-of-memory injector the environment asks for (at most one oom fault), or None."""
    ooms = [fault for fault in from_env() if isinstance(fault, OomFault)]
    if len(ooms) > 1:
        raise UsageError(f"{FAULT_ENV}: at most one oom fault, got {len(ooms)}")
    return OomInjector(ooms[0]) if ooms else None


def crash() -> None:
    os._exit(137)


def disk_full(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


__all__ = ["FAULT_ENV", "OOM", "POINTS", "OomFault", "OomInjector", "ShardFault", "crash", "disk_full",
           "from_env", "oom_injector", "parse", "should_fail", "should_fail_set"]
