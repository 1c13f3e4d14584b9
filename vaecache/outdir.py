"""Ownership of an output folder: the run fingerprint guard, the lock, and cleaning up after crashes."""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vaecache.errors import OutputError, UsageError
from vaecache.manifest import (
    CLIPS, FAILURES, LOGS_DIR, MANIFEST, PROGRESS_DIR, RUN, SHARD_SUFFIX, SHARDS_DIR,
    atomic_write_bytes, atomic_write_json, iter_jsonl, jsonl_bytes,
)

LOCK = ".lock"
OWNED_ENTRIES = (MANIFEST, CLIPS, FAILURES, RUN, SHARDS_DIR, PROGRESS_DIR, LOGS_DIR, LOCK)


@dataclass(frozen=True)
class PreparedOut:
    """What rank 0 found in OUT and tells every rank before encoding starts."""

    attempt: int
    done_clip_ids: frozenset[str]
    discarded_files: int


def describe_differences(recorded: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(recorded) | set(wanted)):
        old, new = recorded.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            diffs.extend(describe_differences(old, new, f"{prefix}{key}."))
        elif old != new:
            diffs.append(f"{prefix}{key}: {_short(old)} -> {_short(new)}")
    return diffs


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def acquire_lock(out: Path, job_id: str | None) -> None:
    """Refuse a second job on the same OUT. A lock left by a dead process on this host is cleared."""
    path = out / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id,
          "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                holder = {}
            if _is_stale(holder, me):
                path.unlink(missing_ok=True)
                continue
            raise OutputError(
                f"{out}: locked by another vaecache job (host {holder.get('host')}, pid {holder.get('pid')}, "
                f"job {holder.get('job_id')}); if that job is gone, delete {path} and rerun") from None
        except OSError as exc:
            raise OutputError(f"{path}: cannot create lock ({exc.strerror or exc})") from None
        with os.fdopen(fd, "w") as handle:
            json.dump(me, handle)
        return
    raise OutputError(f"{path}: could not take the lock")


def _is_stale(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """A lock is stale when its process is gone on this host, or when it is an earlier attempt of
    this same SLURM job (a requeued job restarts only after every task of the previous attempt ended)."""
    if holder.get("host") == me["host"] and not _pid_alive(holder.get("pid")):
        return True
    return (me["job_id"] is not None and holder.get("job_id") == me["job_id"]
            and int(holder.get("restart") or 0) < me["restart"])


def release_lock(out: Path) -> None:
    path = out / LOCK
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, json.JSONDecodeError):
        pass


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


def prepare_out(out: Path, fingerprint: dict[str, Any], overwrite: bool, job_id: str | None) -> PreparedOut:
    """Rank 0 only: take the lock, check or start the run record, repair what a crash left behind."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: --out exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{out}: cannot create output folder ({exc.strerror or exc})") from None
    acquire_lock(out, job_id)
    try:
        run_file = out / RUN
        if overwrite:
            for name in OWNED_ENTRIES:
                if name == LOCK:
                    continue
                target = out / name
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
        elif not run_file.exists():
            foreign = sorted(p.name for p in out.iterdir() if p.name not in OWNED_ENTRIES)
            if foreign:
                raise UsageError(f"{out}: not empty and not a vaecache output (holds {', '.join(foreign[:3])}); "
                                 "choose another --out")
        attempt = 0
        if run_file.exists():
            try:
                recorded = json.loads(run_file.read_text())
            except json.JSONDecodeError:
                raise OutputError(f"{run_file}: unreadable run record; rerun with --overwrite to start over") from None
            diffs = describe_differences(recorded.get("fingerprint", {}), fingerprint)
            if diffs:
                raise UsageError(f"{out} was made with other settings ({'; '.join(diffs[:4])}); "
                                 "use the same settings to resume, or --overwrite to start over")
            attempt = int(recorded.get("attempt", 0)) + 1
        for folder in (SHARDS_DIR, PROGRESS_DIR, LOGS_DIR):
            (out / folder).mkdir(exist_ok=True)
        atomic_write_json(run_file, {"fingerprint": fingerprint, "attempt": attempt})
        (out / MANIFEST).unlink(missing_ok=True)  # the cache is about to change: not complete until rewritten
        done, discarded = _repair(out)
        return PreparedOut(attempt, frozenset(done), discarded)
    except BaseException:
        release_lock(out)
        raise


def _repair(out: Path) -> tuple[set[str], int]:
    """Keep committed shards whose file is intact in size; drop torn log lines, orphans and temp files."""
    progress = out / PROGRESS_DIR
    claimed: set[str] = set()
    done: set[str] = set()
    for log in sorted(progress.glob("rank-*.jsonl")):
        kept = []
        for entry in iter_jsonl(log):
            shard = entry["shard"]
            path = out / shard["file"]
            if path.is_file() and path.stat().st_size == shard["bytes"]:
                kept.append(entry)
                claimed.add(path.name)
                done.update(clip["id"] for clip in entry["clips"])
        atomic_write_bytes(log, jsonl_bytes(kept))
    for log in progress.glob("failures-rank-*.jsonl"):
        log.unlink()
    discarded = 0
    for path in (out / SHARDS_DIR).iterdir():
        if path.name not in claimed:
            path.unlink()
            discarded += 1
    for path in out.glob(".*.tmp"):
        path.unlink()
        discarded += 1
    return done, discarded


__all__ = ["PreparedOut", "SHARD_SUFFIX", "acquire_lock", "prepare_out", "release_lock"]
