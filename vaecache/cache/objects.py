"""OUT in object storage (``s3://`` and any fsspec URL): the commit protocol for stores without rename or append.

An object store has neither rename nor append, but one PUT is atomic: an object is there whole or not at all (an
interrupted multipart upload leaves no object). So, under OUT's URL:

- a shard is PUT under a name no other attempt uses (``shards/aAAA-rRRRRR-SSSSSS.safetensors``), then its commit
  record, ``progress/commits/aAAA-rRRRRR-SSSSSS.json``: the progress line the writer appends on disk (the shard
  record with its size and sha256, the clip ids, the clip records). A shard counts only once its commit record
  exists. A resume lists the commit records; every other shard object (a crash between the two PUTs) is a stray,
  deleted by the next encode or ``vaecache verify --repair``;
- each rank's failure records and probe records are one object per rank, PUT whole (the failures once, when the
  rank's share is done: a rerun records them afresh);
- ``run.json`` is PUT by rank 0 as it prepares OUT; ``clips.parquet``, ``failures.parquet`` and then
  ``manifest.json`` once, at finalize, the manifest last: a reader never sees a half-written one;
- ``.lock`` is created with a conditional PUT (``If-None-Match: *``, which S3 and MinIO honour): of jobs starting
  together exactly one creates it, and the stale-lock rules are the ones on disk (vaecache.cache.outdir); a stale
  lock is taken over by a PUT conditional on the ETag it was read with (``If-Match``), refused where the store
  cannot do that.

Planning the resume and merging the clip table is the code that runs on disk: each rank works in a local *work
folder* holding what it needs of OUT's records (run.json and the probes; on rank 0 every commit record, as per-rank
progress logs), rebuilt from the objects, which are the truth, when the run starts and before finalize, and
deleted at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from vaecache.cache.layout import (
    CLIPS,
    FAILURES,
    LOCK,
    LOGS_DIR,
    MANIFEST,
    OWNED_ENTRIES,
    PROBES_DIR,
    PROGRESS_DIR,
    RUN,
    SHARD_SUFFIX,
    SHARDS_DIR,
)
from vaecache.cache.lock import lock_holder_record, lock_is_stale, locked_error
from vaecache.cache.outdir import PreparedOut
from vaecache.cache.progress import committed_shards, progress_line_head
from vaecache.cache.reader import CacheReader
from vaecache.cache.remote import open_filesystem, storage_problem
from vaecache.errors import OutputError, UsageError, VaecacheError
from vaecache.urls import Url

log = logging.getLogger("vaecache")

COMMITS_DIR = f"{PROGRESS_DIR}/commits"
COMMIT_SUFFIX = ".json"
_COMMIT_NAME = re.compile(r"a([0-9]{3,})-r([0-9]{5,})-([0-9]{6,})\.json")
_FAILURE_LOG = re.compile(rf"{PROGRESS_DIR}/failures-rank-[0-9]{{5,}}\.jsonl")
_DISK_LOG = re.compile(rf"{PROGRESS_DIR}/rank-[0-9]{{5,}}\.jsonl")
_LINE_HEAD = b'{"shard":'


def commit_name(shard: str) -> str:
    """The commit record of shard file `shard` (its name in shards/)."""
    return f"{COMMITS_DIR}/{shard[:-len(SHARD_SUFFIX)]}{COMMIT_SUFFIX}"


def disk_progress_logs(names: Iterable[str]) -> list[str]:
    """The progress logs (``progress/rank-NNNNN.jsonl``) among object names: a cache written on disk and copied here
    commits in those, not in commit records."""
    return [name for name in names if _DISK_LOG.fullmatch(name)]


def committed_shard(commit: str) -> str | None:
    """The shard file (``shards/<name>``) a commit record's object name claims; None for another name."""
    base = commit.rsplit("/", 1)[-1]
    if not commit.startswith(f"{COMMITS_DIR}/") or not _COMMIT_NAME.fullmatch(base):
        return None
    return f"{SHARDS_DIR}/{base[:-len(COMMIT_SUFFIX)]}{SHARD_SUFFIX}"


class ObjectOut:
    """OUT at a URL: its objects read and written under the commit protocol, and this process's work folder."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, work: Path | None = None) -> None:
        self.url = Url(str(url).rstrip("/"))
        self.fs, self.root = open_filesystem(self.url, storage_options)
        self.root = self.root.rstrip("/")
        self.work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="vaecache-work-"))
        self._lock_token: str | None = None

    # --- objects ---------------------------------------------------------------------------------------------

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str = "") -> Url:
        return self.url / name if name else self.url

    def _error(self, name: str, what: str, exc: BaseException) -> OutputError:
        return OutputError(f"{self.where(name)}: cannot {what} ({storage_problem(exc)})")

    def get(self, name: str) -> bytes | None:
        """An object's bytes; None when there is no such object."""
        try:
            return self.fs.cat_file(self.key(name))
        except FileNotFoundError:
            return None
        except Exception as exc:  # botocore's credential errors are no OSError
            raise self._error(name, "read", exc) from None

    def get_many(self, names: Iterable[str]) -> dict[str, bytes]:
        """Objects' bytes, fetched concurrently; a name whose object is gone is left out, any other error raised (a
        commit record that could not be read must never pass for one that is not there)."""
        names = list(names)
        if not names:
            return {}
        try:
            found = self.fs.cat([self.key(name) for name in names], on_error="return")
        except Exception as exc:
            raise self._error(names[0], "read", exc) from None
        result = {}
        for name in names:
            data = found.get(self.key(name), FileNotFoundError(name))
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, BaseException):
                raise self._error(name, "read", data)
            result[name] = data
        return result

    def put(self, name: str, data: bytes, *, create: bool = False) -> None:
        """PUT `data` as object `name` (a multipart upload past 100 MB, by s3fs); with `create`, only where no such
        object exists (If-None-Match: *), else FileExistsError."""
        try:
            self.fs.pipe_file(self.key(name), data, **({"mode": "create"} if create else {}))
        except FileExistsError:
            if create:
                raise
            raise self._error(name, "write", FileExistsError(name)) from None
        except Exception as exc:
            raise self._error(name, "write", exc) from None

    def put_file(self, name: str) -> None:
        """PUT the work folder's file `name` as object `name`."""
        self.put(name, (self.work / name).read_bytes())

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        if not names:
            return
        try:
            self.fs.rm([self.key(name) for name in names])
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(names[0], "delete", exc) from None

    def sizes(self, folder: str) -> dict[str, int]:
        """Object name (relative to OUT) -> bytes, for every object under `folder`/, listed now (never a cached
        listing: other ranks and jobs write here too)."""
        try:
            self.fs.invalidate_cache()
            found = self.fs.find(self.key(folder), detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._error(folder, "list", exc) from None
        start = len(self.root) + 1
        return {path[start:]: int(info.get("size") or 0) for path, info in found.items()
                if info.get("type", "file") != "directory"}

    def entries(self) -> set[str]:
        """The names right under OUT's URL (objects and prefixes)."""
        try:
            self.fs.invalidate_cache()
            return {path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)}
        except FileNotFoundError:
            return set()
        except Exception as exc:
            raise self._error("", "list", exc) from None

    # --- checks before a run -------------------------------------------------------------------------------------

    def check_usable(self) -> None:
        """The bucket exists and OUT's prefix can be listed (one listing of OUT alone, never of the bucket), and OUT's
        URL holds a vaecache output or nothing."""
        try:
            self.fs.invalidate_cache()
            found = {path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)}
        except FileNotFoundError:  # an empty prefix, or no bucket (credentials and access fail before this)
            found = set()
            bucket = self.root.split("/", 1)[0]
            if not self.fs.exists(bucket):
                raise OutputError(f"{self.url}: no such bucket ({bucket}); create it first") from None
        except Exception as exc:
            raise self._error("", "list", exc) from None
        foreign = sorted(name for name in found if name not in OWNED_ENTRIES)
        if RUN not in found and foreign:
            raise UsageError(f"{self.url}: not empty and not a vaecache output (holds {', '.join(foreign[:3])}); "
                             "choose another --out")

    # --- the lock ------------------------------------------------------------------------------------------------

    def acquire_lock(self, job_id: str | None) -> None:
        """Create OUT/.lock with a conditional PUT, recording who holds it; take over a stale one (outdir's rules) by a
        PUT conditional on the ETag it was read with (If-Match), so that of jobs taking it over together exactly one
        replaces it; refuse a live one naming its holder, and a stale one where the store cannot replace it
        conditionally. The lock is read back: a store that ignored the condition and let another job's PUT win is
        caught then."""
        me = {**lock_holder_record(job_id), "token": uuid.uuid4().hex}
        for _ in range(8):
            try:
                self.put(LOCK, json.dumps(me).encode(), create=True)
            except FileExistsError:
                found = self._read_lock()
                if found is None:  # released or replaced between our PUT and our read: try again
                    continue
                holder, etag = _holder(found[0]) or {}, found[1]
                if not lock_is_stale(holder, me):
                    raise locked_error(self.url, self.where(LOCK), holder) from None
                if etag is None:
                    raise self._stale_lock_error(holder, "this store gives no ETag to replace it on") from None
                log.warning("%s: taking over a stale lock (host %s, pid %s, job %s)", self.where(LOCK),
                            holder.get("host"), holder.get("pid"), holder.get("job_id"))
                if not self._replace_lock(json.dumps(me).encode(), etag, holder):
                    continue  # another job took it over (or it was deleted) first: look again
            holder = _holder(self.get(LOCK))
            if holder is None or holder.get("token") != me["token"]:
                raise locked_error(self.url, self.where(LOCK), holder or {})
            self._lock_token = me["token"]
            return
        raise OutputError(f"{self.where(LOCK)}: could not take the lock")

    def _read_lock(self) -> tuple[bytes, str | None] | None:
        """The lock's bytes and the ETag of exactly those bytes (s3fs reads them with If-Match on the ETag it
        opened the object with); None when the lock is gone or changed while being read. The ETag is None on a
        store that gives none."""
        key = self.key(LOCK)
        try:
            self.fs.invalidate_cache(key)
            with self.fs.open(key, "rb") as file:
                etag = (getattr(file, "details", None) or {}).get("ETag")
                return file.read(), etag
        except FileNotFoundError:
            return None
        except Exception as exc:
            if _precondition_failed(exc):
                return None
            raise self._error(LOCK, "read", exc) from None

    def _replace_lock(self, data: bytes, etag: str, holder: dict[str, Any]) -> bool:
        """PUT the lock only if it is still the one read with `etag` (If-Match); False when it is not (another job
        replaced or deleted it first)."""
        try:
            self.fs.pipe_file(self.key(LOCK), data, IfMatch=etag)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if _precondition_failed(exc):
                return False
            if _not_implemented(exc):
                raise self._stale_lock_error(holder, "this store does not replace an object conditionally "
                                                     "(If-Match)") from None
            raise self._error(LOCK, "write", exc) from None
        return True

    def _stale_lock_error(self, holder: dict[str, Any], why: str) -> OutputError:
        return OutputError(f"{self.url}: locked by a vaecache job that is gone (host {holder.get('host')}, pid "
                           f"{holder.get('pid')}, job {holder.get('job_id')}), but {why}, so two jobs could both "
                           f"take it over; delete {self.where(LOCK)} and rerun")

    def release_lock(self) -> None:
        """Delete OUT/.lock if this process holds it (and it is still ours)."""
        token, self._lock_token = self._lock_token, None
        if token is None:
            return
        holder = _holder(self.get(LOCK))
        if holder is not None and holder.get("token") == token:
            self.delete([LOCK])

    def locked_by(self) -> dict[str, Any] | None:
        """Who holds OUT/.lock now (None: nobody)."""
        return _holder(self.get(LOCK))

    # --- the work folder -----------------------------------------------------------------------------------------

    def _write_local(self, name: str, data: bytes) -> None:
        path = self.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def pull_start(self) -> None:
        """Every rank, before start-up: run.json (the CPU threads a resume computes with) and every rank's probe
        records (no video is probed twice)."""
        for folder in (PROGRESS_DIR, LOGS_DIR, PROBES_DIR):  # what every rank appends to, as in OUT on disk
            (self.work / folder).mkdir(parents=True, exist_ok=True)
        for name, data in self.get_many([RUN, *self.sizes(PROBES_DIR)]).items():
            self._write_local(name, data)

    def pull_records(self, *, finished: bool) -> None:
        """Rank 0: rebuild the work folder's progress logs (one per rank, lines in commit order) and failure logs
        from the objects; with `finished`, also the manifest and the failure table of a finished cache."""
        progress = self.work / PROGRESS_DIR
        progress.mkdir(parents=True, exist_ok=True)
        for old in [*progress.glob("rank-*.jsonl"), *progress.glob("failures-rank-*.jsonl")]:
            old.unlink()
        listed = sorted(self.sizes(PROGRESS_DIR))
        copied = disk_progress_logs(listed)
        if copied:  # its commits are lines of those logs, which objects cannot append to or cut
            raise UsageError(f"{self.where(copied[0])}: this cache was written on disk and copied here; resume or "
                             "grow it on disk and copy it again, or --overwrite to start over here")
        commits = [name for name in listed if committed_shard(name) is not None]
        failures = [name for name in listed if _FAILURE_LOG.fullmatch(name)]
        contents = self.get_many(commits + failures)
        logs: dict[int, list[bytes]] = {}
        for name in commits:  # a rank's commits sort in its commit order: attempt, then sequence
            data = contents.get(name)
            if data is None:
                continue  # deleted since it was listed (a repair): not committed
            if not data.startswith(_LINE_HEAD) or not data.endswith(b"\n") or data.count(b"\n") != 1:
                raise OutputError(f"{self.where(name)}: not a commit record (one progress line)")
            shard, _ = progress_line_head(self.where(name), 0, data)  # type: ignore[arg-type]  # named in errors
            if shard.get("file") != committed_shard(name):
                raise OutputError(f"{self.where(name)}: the commit record names another shard ({shard!r:.80})")
            rank = int(_COMMIT_NAME.fullmatch(name.rsplit("/", 1)[-1]).group(2))  # type: ignore[union-attr]
            logs.setdefault(rank, []).append(data)
        for rank, lines in sorted(logs.items()):
            (progress / f"rank-{rank:05d}.jsonl").write_bytes(b"".join(lines))
        for name in failures:
            if name in contents:
                self._write_local(name, contents[name])
        if finished:
            for name in (RUN, MANIFEST, FAILURES):
                data = self.get(name)
                if data is not None:
                    self._write_local(name, data)
                else:
                    (self.work / name).unlink(missing_ok=True)

    def shard_problems(self, shards: list[dict[str, Any]]) -> dict[str, str]:
        """Shard file -> problem for committed shards whose object is missing or of another size (one listing).
        Their sha256 is `verify`'s to check: hashing here would download the whole cache on every resume."""
        found = self.sizes(SHARDS_DIR)
        problems = {}
        for shard in shards:
            size = found.get(shard["file"])
            if size is None:
                problems[shard["file"]] = "missing"
            elif size != shard["bytes"]:
                problems[shard["file"]] = f"{size} bytes, {shard['bytes']} recorded"
        return problems

    def reconcile(self, prepared: PreparedOut) -> PreparedOut:
        """Rank 0, after prepare_out ran in the work folder and before anything is committed: make the objects say
        what it decided. run.json, then the manifest gone (OUT is not complete until finalize), then the commit
        records of shards it dropped, the failure logs (a rerun records failures afresh) and every shard object
        no kept commit claims (strays from a crash, damaged shards). Returns `prepared` with those counted."""
        self.put_file(RUN)
        if not (self.work / MANIFEST).exists():
            self.delete([MANIFEST])
        kept = {shard["file"] for shard in committed_shards(self.work)}
        listed = self.sizes(PROGRESS_DIR)
        dropped = [name for name in listed if committed_shard(name) is not None and committed_shard(name) not in kept]
        self.delete(dropped + [name for name in listed if _FAILURE_LOG.fullmatch(name)])
        strays = [name for name in self.sizes(SHARDS_DIR) if name not in kept]
        self.delete(strays)
        return dataclasses.replace(prepared, discarded_files=prepared.discarded_files + len(dropped) + len(strays))

    def clear(self) -> None:
        """--overwrite: delete every object vaecache owns under OUT but the lock."""
        for name in self.entries():
            if name in OWNED_ENTRIES and name != LOCK:
                try:
                    self.fs.rm(self.key(name), recursive=True)
                except FileNotFoundError:
                    pass
                except Exception as exc:
                    raise self._error(name, "delete", exc) from None
        self.fs.invalidate_cache()

    def fetch_tables(self) -> bool:
        """A finished cache's manifest and its clip and failure tables (as the manifest names them) into the work
        folder, for the readers that run on disk; False when there is no manifest."""
        manifest = self.get(MANIFEST)
        if manifest is None:
            return False
        self._write_local(MANIFEST, manifest)
        try:
            reader = CacheReader(self.work)
            names = [path.relative_to(self.work).as_posix() for path in (reader.clips_path, reader.failures_path)]
        except VaecacheError:  # the readers name the manifest's problem
            names = [CLIPS, FAILURES]
        for name, data in self.get_many(names).items():
            self._write_local(name, data)
        return True

    def publish(self) -> None:
        """Finalize, rank 0: the clip table and the failure table, then the manifest last."""
        for name in (CLIPS, FAILURES, MANIFEST):
            self.put_file(name)

    def push_log(self, rank: int, attempt: int, path: Path) -> None:
        """This rank's log of this attempt, best effort (a log is not part of the cache)."""
        try:
            if path.is_file():
                self.put(f"{LOGS_DIR}/rank-{rank:05d}-a{attempt:03d}.log", path.read_bytes())
        except OutputError as exc:
            log.warning("%s", exc)

    def mirror(self, local: Path) -> Callable[[], None]:
        """A function that PUTs the work folder's file `local` as the object of the same name."""
        name = Path(local).relative_to(self.work).as_posix()
        return lambda: self.put_file(name)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


@contextlib.contextmanager
def fetched_tables(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """A local folder holding the manifest and the clip and failure tables of the finished cache at `url` (what
    inspect reads; its shards stay at the URL), removed after the block. ManifestError when there is no manifest."""
    from vaecache.errors import ManifestError

    objects = ObjectOut(url, storage_options)
    try:
        if not objects.fetch_tables():
            objects.check_usable()
            raise ManifestError(f"{objects.where(MANIFEST)}: no manifest (the run is incomplete or this is not a "
                                "vaecache output)")
        yield objects.work
    finally:
        objects.close()


def _precondition_failed(exc: BaseException) -> bool:
    """Whether a store refused a conditional request because the object changed: 412 PreconditionFailed, 409
    ConditionalRequestConflict (S3, for conditional writes racing), or s3fs's own ETag check (FileExpired)."""
    if type(exc).__name__ == "FileExpired":
        return True
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None) or {}
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def _not_implemented(exc: BaseException) -> bool:
    """Whether a store answered that it does not implement a request (501 NotImplemented: s3fs raises ENOSYS), or the
    client cannot send it."""
    if type(exc).__name__ == "ParamValidationError" or type(exc.__cause__).__name__ == "ParamValidationError":
        return True  # a botocore from before PutObject took IfMatch: this client cannot ask it
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None) or {}
    return (getattr(exc, "errno", None) == errno.ENOSYS or (response.get("Error") or {}).get("Code") == "NotImplemented"
            or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 501)


def _holder(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        holder = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


__all__ = ["COMMITS_DIR", "ObjectOut", "commit_name", "committed_shard", "disk_progress_logs"]
