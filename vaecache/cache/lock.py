"""The lock on an output folder: one job writes OUT at a time. On disk an flock on OUT/.lock held for the run, which
also records who holds it; the same record and stale-lock rules serve object storage (vaecache.cache.objects),
where the lock is an object created only if absent."""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from vaecache.cache.layout import LOCK
from vaecache.errors import OutputError

_HELD_LOCKS: dict[Path, int] = {}
"""OUT/.lock -> the open descriptor whose flock this process holds for the run."""


def acquire_lock(out: Path, job_id: str | None) -> None:
    """Refuse a second job on the same OUT.

    The lock is an flock held on OUT/.lock for the whole run, so taking it is atomic: of any number of
    processes starting together exactly one gets it. The file also records who holds it (host, pid, SLURM
    job): a record left by a process that is gone (same host, or an earlier attempt of the same SLURM job)
    is taken over; a record of a live job elsewhere, whose filesystem may not share flocks, is refused."""
    path = out / LOCK
    me = lock_holder_record(job_id)
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"{path}: cannot create lock ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise locked_error(out, path, holder) from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # the holder released (unlinked) it between our open and our flock: start again
            os.close(fd)
            continue
        holder = _read_holder(fd)
        if holder and holder.get("pid") != me["pid"] and not lock_is_stale(holder, me):
            os.close(fd)
            raise locked_error(out, path, holder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        _HELD_LOCKS[path] = fd
        return
    raise OutputError(f"{path}: could not take the lock")


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def lock_holder_record(job_id: str | None) -> dict[str, Any]:
    """What a lock records of its holder: host, pid, SLURM job id and restart count (the stale-lock rules read them)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id,
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}


def locked_error(out: Any, path: Any, holder: dict[str, Any]) -> OutputError:
    return OutputError(f"{out}: locked by another vaecache job (host {holder.get('host')}, pid {holder.get('pid')}, "
                       f"job {holder.get('job_id')}); if that job is gone, delete {path} and rerun")


def lock_is_stale(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """A lock is stale when its process is gone on this host, or when it is an earlier attempt of
    this same SLURM job (a requeued job restarts only after every task of the previous attempt ended)."""
    if holder.get("host") == me["host"] and not _pid_alive(holder.get("pid")):
        return True
    return (me["job_id"] is not None and holder.get("job_id") == me["job_id"]
            and int(holder.get("restart") or 0) < me["restart"])


def release_lock(out: Path) -> None:
    """Remove OUT/.lock and drop the flock, if this process holds it (unlinked while still held, so no other
    process can take the old file in between)."""
    path = out / LOCK
    fd = _HELD_LOCKS.pop(path, None)
    if fd is None:
        return
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["acquire_lock", "lock_holder_record", "lock_is_stale", "locked_error", "release_lock"]
