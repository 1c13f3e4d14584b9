"""The lock on OUT: one job writes a cache at a time. On disk an flock on OUT/.lock held for the run, which also
records who holds it; in object storage (ObjectLock) an object created only if absent, with the same record and
the same stale-lock rules. Each commit protocol takes the one of its store (outdir.DiskOut through prepare_out,
objects.ObjectOut)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from vaecache.cache.layout import LOCK
from vaecache.cache.store import ObjectStore
from vaecache.errors import OutputError

log = logging.getLogger("vaecache")

T = TypeVar("T")

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


class ObjectLock:
    """OUT/.lock in object storage: created with a conditional PUT (``If-None-Match: *``, which S3 and MinIO honour),
    so of jobs starting together exactly one creates it, recording who holds it (and a token of its own). A stale
    lock (the rules of `lock_is_stale`) is taken over by a PUT conditional on the ETag it was read with
    (``If-Match``), so that of jobs taking it over together exactly one replaces it, and is refused where the store
    cannot do that. A live lock is refused naming its holder. The lock is read back after it is taken: a store that
    ignored the condition and let another job's PUT win is caught then."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._token: str | None = None
        self._confirmed = False
        self._etag: str | None = None
        """The ETag of the lock as this process last read it holding its token: what its release deletes on."""

    def acquire(self, job_id: str | None, alongside: Callable[[], T] | None = None) -> T | None:
        """Take the lock; `alongside`, where given, runs while the lock is read back (a round trip saved) and its
        result is returned once the lock is known to be this process's."""
        me = {**lock_holder_record(job_id), "token": uuid.uuid4().hex}
        where = self.store.where(LOCK)
        for _ in range(8):
            try:
                self.store.create(LOCK, json.dumps(me).encode())
            except FileExistsError:
                found = self.store.read_tagged(LOCK)
                if found is None:  # released or replaced between our PUT and our read: try again
                    continue
                holder, etag = _holder(found[0]) or {}, found[1]
                if not lock_is_stale(holder, me):
                    raise locked_error(self.store.url, where, holder) from None
                if etag is None:
                    raise self._stale_lock_error(holder, "this store gives no ETag to replace it on") from None
                log.warning("%s: taking over a stale lock (host %s, pid %s, job %s)", where, holder.get("host"),
                            holder.get("pid"), holder.get("job_id"))
                try:
                    replaced = self.store.replace_if(LOCK, json.dumps(me).encode(), etag)
                except NotImplementedError:
                    raise self._stale_lock_error(holder, "this store does not replace an object conditionally "
                                                         "(If-Match)") from None
                if not replaced:
                    continue  # another job took it over (or it was deleted) first: look again
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-lock") as pool:
                beside = pool.submit(alongside) if alongside is not None else None
                found = self.store.read_tagged(LOCK)
                holder = _holder(found[0]) if found is not None else None
                if holder is None or holder.get("token") != me["token"]:
                    raise locked_error(self.store.url, where, holder or {})
                self._token, self._etag = me["token"], found[1] if found is not None else None
                try:
                    return beside.result() if beside is not None else None
                except BaseException:
                    self.release()
                    raise
        raise OutputError(f"{where}: could not take the lock")

    def _stale_lock_error(self, holder: dict[str, Any], why: str) -> OutputError:
        return OutputError(f"{self.store.url}: locked by a vaecache job that is gone (host {holder.get('host')}, pid "
                           f"{holder.get('pid')}, job {holder.get('job_id')}), but {why}, so two jobs could both "
                           f"take it over; delete {self.store.where(LOCK)} and rerun")

    def still_held(self) -> bool:
        """Whether OUT/.lock is still this process's (read now). Once it has said yes, `release` deletes the lock
        without reading it again: a live holder's lock is never stale (`lock_is_stale`), so nothing can take it over
        in between."""
        if self._token is None:
            return False
        found = self.store.read_tagged(LOCK)
        holder = _holder(found[0]) if found is not None else None
        self._confirmed = holder is not None and holder.get("token") == self._token
        if self._confirmed and found is not None:
            self._etag = found[1]
        return self._confirmed

    def release(self) -> None:
        """Delete OUT/.lock if this process holds it (and it is still ours): by a DELETE conditional on the ETag it was
        read with holding this process's token (If-Match), so a lock another job put there since is never deleted;
        where the store cannot ask that (or gave no ETag), deleted as read."""
        if self._token is None:
            return
        if self._confirmed or self.still_held():
            try:
                if self._etag is None:
                    raise NotImplementedError("no ETag")
                if not self.store.delete_if(LOCK, self._etag):
                    log.warning("%s: no longer this job's lock when released (replaced since): left in place",
                                self.store.where(LOCK))
            except NotImplementedError:
                self.store.delete([LOCK])
        self._token, self._confirmed, self._etag = None, False, None

    def holder(self) -> dict[str, Any] | None:
        """Who holds OUT/.lock now (None: nobody)."""
        return _holder(self.store.read_if_present(LOCK))


def _holder(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        holder = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}




@contextmanager
def held_lock(store: Any, job_id: str | None = None) -> Iterator[None]:
    """OUT's lock (the one of its store) held for the block: commands that change a finished cache (embed) take
    it as encode does, so that no two jobs write one cache."""
    if isinstance(store, ObjectStore):
        lock = ObjectLock(store)
        lock.acquire(job_id)
        try:
            yield
        finally:
            lock.release()
        return
    acquire_lock(store.folder, job_id)
    try:
        yield
    finally:
        release_lock(store.folder)


__all__ = ["ObjectLock", "acquire_lock", "held_lock", "lock_holder_record", "lock_is_stale", "locked_error",
           "release_lock"]
