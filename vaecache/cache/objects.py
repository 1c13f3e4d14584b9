"""OUT in object storage (``s3://`` and any fsspec URL): the commit protocol for stores without rename or append.

An object store has neither rename nor append, but one PUT is atomic: an object is there whole or not at all (an
interrupted multipart upload leaves no object). So, under OUT's URL:

- a shard is PUT under a name no other attempt uses (``shards/aAAA-rRRRRR-SSSSSS.safetensors``), then its commit
  record, ``progress/commits/aAAA-rRRRRR-SSSSSS.json``: the progress line the writer appends on disk (the shard
  record with its size and sha256, the clip ids, the clip records). A shard counts only once its commit record
  exists. The commit record's PUT runs while the writer goes on (one at a time); finalize waits for the last one
  before the manifest. A resume lists the commit records; every other shard object (a crash between the two PUTs)
  is a stray, deleted by the next encode or ``vaecache verify --repair``;
- commit records are also gathered into *compacted* objects, so that a resume reads one object per COMPACT_EVERY
  shards rather than one per shard: each process PUTs ``progress/compacted/aAAA-rRRRRR-SSSSSS.jsonl`` (the records it
  committed since its previous one, in commit order; named by the last) every COMPACT_EVERY commits, and finalize
  PUTs ``progress/compacted/final.jsonl`` (every committed record) and deletes the others. The records stay the truth: a
  line of a compacted object counts only where its commit record is listed (a repair or a resume that dropped a
  record leaves its line behind, unused), and a compacted object that does not read is skipped, its records then
  fetched one by one;
- each rank's failure records and probe records are one object per rank, PUT whole (the failures once, when the
  rank's share is done: a rerun records them afresh);
- ``run.json`` is PUT by rank 0 as it prepares OUT; ``clips.parquet``, ``failures.parquet`` and then
  ``manifest.json`` once, at finalize, the manifest last: a reader never sees a half-written one;
- ``.lock`` is created with a conditional PUT (``If-None-Match: *``, which S3 and MinIO honour): of jobs starting
  together exactly one creates it, and the stale-lock rules are the ones on disk; a stale lock is taken over by a
  PUT conditional on the ETag it was read with (``If-Match``), refused where the store cannot do that
  (vaecache.cache.lock.ObjectLock).

The objects are read and written through the object store (vaecache.cache.store.ObjectStore); ObjectOut offers the
same operations as outdir.DiskOut, so the writer, the encode and verify do not know which protocol they hold.

Planning the resume and merging the clip table is the code that runs on disk: each rank works in a local *work
folder* holding what it needs of OUT's records (run.json and the probes; on rank 0 every commit record, as per-rank
progress logs), rebuilt from the objects, which are the truth, when the run starts and before finalize, and
deleted at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from vaecache.cache.io import whole_lines
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
    recorded_kinds,
)
from vaecache.cache.lock import ObjectLock
from vaecache.cache.outdir import FolderOut, PreparedOut, StrayFindings, begin_changes, prepare_out
from vaecache.cache.progress import CommittedIds, committed_shards, progress_counts, progress_line_head
from vaecache.cache.store import ObjectStore
from vaecache.errors import ManifestError, OutputError, UsageError, VaecacheError
from vaecache.urls import Url

log = logging.getLogger("vaecache")

COMMITS_DIR = f"{PROGRESS_DIR}/commits"
COMMIT_SUFFIX = ".json"
COMPACTED_DIR = f"{PROGRESS_DIR}/compacted"
FINAL_COMPACTED = f"{COMPACTED_DIR}/final.jsonl"
COMPACT_EVERY = 256
"""Commit records in one of a process's compacted objects: a resume GETs one object per this many of them, and at most
this many - 1 records per process one by one."""
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


class ObjectOut(FolderOut):
    """OUT at a URL: its objects (an ObjectStore) written under the commit protocol, and this process's work
    folder."""

    def __init__(self, url: Any, storage_options: dict[str, Any] | None = None, work: Path | None = None) -> None:
        self.store = url if isinstance(url, ObjectStore) else ObjectStore(str(url), storage_options)
        self.url, self.fs, self.root = self.store.url, self.store.fs, self.store.root
        self.work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="vaecache-work-"))
        self.folder = self.work
        """Where the disk code runs: this process's work folder."""
        self.lock = ObjectLock(self.store)
        self._held_a_run: bool | None = None
        """Whether OUT held a run record, a manifest or commit records when `pull_start` listed it."""
        self._commit_puts: ThreadPoolExecutor | None = None
        self._commit_put: Future[None] | None = None
        """The last commit record's PUT, under way (`commit`) until `settle`."""
        self.compact_every = COMPACT_EVERY
        self._chunk: list[bytes] = []
        """This process's commit records (their lines) since its last compacted object, in commit order."""
        self.compaction_problems: list[str] = []
        """What `pull_records` found wrong with the compacted objects (a line that is not its record's bytes, an object
        that does not read): the records were used instead, and a rerun of the finished cache rewrites them."""

    def where(self, name: str = "") -> Url:
        return self.store.where(name)

    def put_file(self, name: str) -> None:
        """PUT the work folder's file `name` as object `name`."""
        self.store.write(name, (self.work / name).read_bytes())

    # --- before a run ---------------------------------------------------------------------------------------------

    def pull_start(self) -> None:
        """Every rank, before start-up: OUT usable, then run.json (the CPU threads a resume computes with) and every
        rank's probe records (no video is probed twice)."""
        found = check_object_out(self.store)  # one listing of OUT's top level says what there is to fetch
        self._held_a_run = bool({RUN, MANIFEST, PROGRESS_DIR} & found)
        for folder in (PROGRESS_DIR, LOGS_DIR, PROBES_DIR):  # what every rank appends to, as in OUT on disk
            (self.work / folder).mkdir(parents=True, exist_ok=True)
        names = ([RUN] if RUN in found else []) + (list(self.store.listing(PROBES_DIR)) if PROBES_DIR in found else [])
        for name, data in self.store.read_many(names).items():
            self._write_local(name, data)

    def looked_empty(self) -> bool:
        """OUT held no run when `pull_start` listed it (False before that)."""
        return self._held_a_run is False

    # --- the lock ------------------------------------------------------------------------------------------------

    def acquire_lock(self, job_id: str | None) -> None:
        self.lock.acquire(job_id)

    def release_lock(self) -> None:
        self.lock.release()

    # --- a run: the disk code in the work folder, the objects made to say what it decided ---------------------------

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool, job_id: str | None,
                sources: dict[str, dict[str, Any]] | None, committed: CommittedIds | None,
                allow_other_numerics: bool = False, extra_numerics: Sequence[dict[str, Any]] = ()) -> PreparedOut:
        """Rank 0: take the lock (held until `release_lock`), rebuild the work folder's records from the objects, run
        prepare_out there and make the objects say what it decided (`reconcile`)."""
        # OUT listed while the lock is read back: no other job writes OUT now, so one listing answers every question
        listed = self.lock.acquire(job_id, alongside=self.store.list_all)
        try:
            with self.store.one_listing(listed):
                if overwrite:
                    self.clear()
                self.pull_records(finished=True)
                prepared = prepare_out(self.work, fingerprint, overwrite, job_id, sources, committed,
                                       allow_other_numerics, extra_numerics, self.shard_problems, lock=False)
                if not prepared.complete:
                    return self.reconcile(prepared)
                if self.compaction_problems:  # the records are the truth: the compacted object is made of them again
                    self.compact_all()
                    return dataclasses.replace(prepared, rewritten=(
                        f"{self.where(FINAL_COMPACTED)}: rewritten from the commit records "
                        f"({self.compaction_problems[0]})",))
                return prepared
        except BaseException:
            self.release_lock()
            raise

    def begin_again(self, attempt: int, fingerprint: dict[str, Any], sources: dict[str, dict[str, Any]] | None,
                    committed: CommittedIds | None, extra_numerics: Sequence[dict[str, Any]] = ()) -> PreparedOut:
        """Rank 0, still under the lock: a finished cache is about to change (the dataset grew)."""
        with self.store.one_listing():
            return self.reconcile(begin_changes(self.work, attempt, fingerprint, sources, committed, extra_numerics,
                                                self.shard_problems))

    def write_shard(self, file: str, data: bytes) -> None:
        """PUT the shard under its unique name (atomic: whole or absent)."""
        self.store.write(file, data)

    def commit(self, file: str, line: str) -> None:
        """PUT the shard's commit record (its progress line), one at a time: the previous one's PUT is waited for
        first, this one's is under way when this returns. The shard counts once it is there: `settle` waits for it,
        and so does `publish`, beside the tables, before the manifest. A crash before it is there leaves the shard a
        stray, as a crash between the shard's PUT and its commit record's always has."""
        self.settle()
        if self._commit_puts is None:
            self._commit_puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-commit")
        record, data = commit_name(file.rsplit("/", 1)[-1]), (line + "\n").encode()
        self._chunk.append(data)
        chunk = None
        if len(self._chunk) >= self.compact_every:
            chunk, self._chunk = self._chunk, []
        self._commit_put = self._commit_puts.submit(self._put_commit, record, data, chunk)

    def _put_commit(self, record: str, data: bytes, chunk: list[bytes] | None) -> None:
        """The commit record's PUT; with `chunk`, then the compacted object of the records since the previous one
        (after the record: it never holds a line whose record is not there), named by this record."""
        self.store.write(record, data)
        if chunk:
            self.store.write(f"{COMPACTED_DIR}/{record.rsplit('/', 1)[-1].removesuffix(COMMIT_SUFFIX)}.jsonl",
                             b"".join(chunk))

    def settle(self) -> None:
        """Every commit record `commit` put under way is there (its PUT's error raised)."""
        pending, self._commit_put = self._commit_put, None
        if pending is not None:
            pending.result()

    def leave_torn_shard(self, file: str, data: bytes) -> None:
        """A crash mid-write (fault injection): a store without atomic PUTs would leave a cut object."""
        self.store.write(file, data[: len(data) // 2])

    def before_finalize(self, only_writer: bool) -> None:
        """Rank 0: the work folder's logs rebuilt from every rank's commit records. Its work folder holds most of
        them already: the records found when OUT was prepared, under the lock this job still holds, and the lines it
        appended beside each commit record it PUT. Where this process was the only writer that is all of them, and
        no request is made; else one listing, and a GET for each record of another rank's this attempt."""
        if not only_writer:
            self.settle()
            self.pull_records(finished=False, held=self._held_records())
        self.compact_all()

    def compact_all(self) -> None:
        """Rank 0 before finalize: every committed record (the work folder's progress logs, rebuilt from the objects)
        in one compacted object, and the processes' own compacted objects deleted: the next run reads one object."""
        progress = self.work / PROGRESS_DIR
        lines = b"".join(path.read_bytes() for path in sorted(progress.glob("rank-*.jsonl")))
        self.store.write(FINAL_COMPACTED, lines)
        self.store.delete([name for name in self.store.listing(COMPACTED_DIR) if name != FINAL_COMPACTED])

    def _held_records(self) -> dict[str, bytes]:
        """Commit record name -> its line, for each line of the work folder's progress logs."""
        held = {}
        for log in (self.work / PROGRESS_DIR).glob("rank-*.jsonl"):
            for offset, line in whole_lines(log):
                shard, _ = progress_line_head(log, offset, line)
                held[commit_name(shard["file"].rsplit("/", 1)[-1])] = line
        return held

    # --- verify: the commits counted, the stray objects named and repaired -----------------------------------------
    # Stray: a shard object without a commit record, or one the manifest does not list; a commit record of a shard
    # the manifest does not list. A shard the finished manifest lists whose commit record is gone is named too: the
    # next encode would take it for a stray, delete it and encode its clips again (repair cannot rewrite a record).

    check_name = "no stray objects"

    def _listing(self) -> tuple[dict[str, int], dict[str, int]]:
        """(shard objects and commit records, everything under progress/), from one listing of each folder."""
        progress = self.store.listing(PROGRESS_DIR)
        return ({**self.store.listing(SHARDS_DIR),
                 **{name: size for name, size in progress.items() if name.startswith(f"{COMMITS_DIR}/")}}, progress)

    def counts(self) -> tuple[int, int]:
        """(committed clips, committed shards) of a run without a manifest."""
        check_object_out(self.store)
        self.pull_records(finished=False)
        return progress_counts(self.work)

    def repair(self, listed: set[str] | None) -> list[str]:
        """Delete the stray objects under OUT's lock (refused while a live job holds it: its next commit would look
        like a stray now). `listed`: the finished manifest's shard files; None without a manifest."""
        strays = stray_objects(self._listing()[0], listed)
        if strays:
            self.acquire_lock(None)
            try:
                self.store.delete(strays)
            finally:
                self.release_lock()
        return strays

    def problems(self, listed: set[str] | None) -> StrayFindings:
        """What is wrong and how many objects were fine. With a manifest (`listed`) the shard objects it does not
        list are the orphan check's; named here are commit records of unlisted shards and listed shards without a
        commit record."""
        listing, progress = self._listing()
        strays = stray_objects(listing, listed)
        if listed is not None:
            strays = [name for name in strays if name.startswith(f"{COMMITS_DIR}/")]
        problems = [_why_stray(name, listed) for name in strays]
        compacted = Compacted.read(self.store, progress)
        vouched = compacted.vouched_for(self.store)
        records = self.store.read_many([name for name in compacted.lines if name in listing and name not in vouched])
        disagreeing = compacted.disagreements(records)
        problems += disagreeing
        lost = []
        if listed is not None and not disk_progress_logs(progress):  # a copied disk cache commits in its logs
            claimed = {committed_shard(name) for name in listing}
            lost = [f"{shard}: shard object without its commit record "
                    f"{commit_name(shard.removeprefix(f'{SHARDS_DIR}/'))} (listed in the manifest; the next encode "
                    "would delete it and encode its clips again)" for shard in sorted(listed) if shard not in claimed]
        if lost:
            note: str | None = ("listed shard(s) lost their commit record: rerun the same encode command to encode "
                                "their clips again")
        elif disagreeing:
            note = ("the commit records are the truth (a resume reads them instead of such lines): rerun the same "
                    "encode command to write the compacted object again from them")
        else:
            note = "vaecache verify --repair (or the next encode) deletes them" if problems else None
        return StrayFindings(problems + lost, max(0, len(listing) - len(strays)), note)

    # --- the work folder -----------------------------------------------------------------------------------------

    def _write_local(self, name: str, data: bytes) -> None:
        path = self.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def pull_records(self, *, finished: bool, held: dict[str, bytes] | None = None) -> None:
        """Rank 0: rebuild the work folder's progress logs (one per rank, lines in commit order) and failure logs
        from the objects; with `finished`, also the manifest and the failure table of a finished cache. `held`: the
        bytes of commit records this process has (named as listed), not fetched again; only a listed one is kept."""
        progress = self.work / PROGRESS_DIR
        progress.mkdir(parents=True, exist_ok=True)
        for old in [*progress.glob("rank-*.jsonl"), *progress.glob("failures-rank-*.jsonl")]:
            old.unlink()
        listed = sorted(self.store.listing(PROGRESS_DIR))
        copied = disk_progress_logs(listed)
        if copied:  # its commits are lines of those logs, which objects cannot append to or cut
            raise UsageError(f"{self.where(copied[0])}: this cache was written on disk and copied here; resume or "
                             "grow it on disk and copy it again, or --overwrite to start over here")
        commits = [name for name in listed if committed_shard(name) is not None]
        failures = [name for name in listed if _FAILURE_LOG.fullmatch(name)]
        compacted = Compacted.read(self.store, listed)
        trusted = {**compacted.vouched_for(self.store), **(held or {})}  # this process's own lines, and those whose
        contents = self.store.read_many([name for name in commits if name not in trusted] + failures)  # ETag agrees
        self.compaction_problems = compacted.disagreements(contents)
        contents.update((name, trusted[name]) for name in commits if name in trusted)
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
            found = self.store.read_many([RUN, MANIFEST, FAILURES])
            for name in (RUN, MANIFEST, FAILURES):
                if name in found:
                    self._write_local(name, found[name])
                else:
                    (self.work / name).unlink(missing_ok=True)

    def shard_problems(self, shards: list[dict[str, Any]]) -> dict[str, str]:
        """Shard file -> problem for committed shards whose object is missing or of another size (one listing).
        Their sha256 is `verify`'s to check: hashing here would download the whole cache on every resume."""
        found = self.store.listing(SHARDS_DIR)
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
            self.store.delete([MANIFEST])
        kept = {shard["file"] for shard in committed_shards(self.work)}
        listed = self.store.listing(PROGRESS_DIR)
        dropped = [name for name in listed if committed_shard(name) is not None and committed_shard(name) not in kept]
        self.store.delete(dropped + [name for name in listed if _FAILURE_LOG.fullmatch(name)])
        strays = [name for name in self.store.listing(SHARDS_DIR) if name not in kept]
        self.store.delete(strays)
        return dataclasses.replace(prepared, discarded_files=prepared.discarded_files + len(dropped) + len(strays))

    def clear(self) -> None:
        """--overwrite: delete every object vaecache owns under OUT but the lock."""
        try:
            found = self.store.entries()
        except FileNotFoundError:
            return
        declared = set()
        try:
            manifest = json.loads(self.store.read_if_present(MANIFEST) or b"{}")
            declared = set(recorded_kinds(manifest if isinstance(manifest, dict) else {}))
        except (ValueError, AttributeError, OutputError, ManifestError):
            pass  # a manifest that does not read records no kind: their folders stay, as anything foreign does
        for name in found:
            if (name in OWNED_ENTRIES or name in declared) and name != LOCK:
                self.store.delete_tree(name)

    def publish(self) -> None:
        """Finalize, rank 0: the clip table and the failure table (together, while the lock is read back: a lock that
        is no longer this job's is refused before the manifest, and while the last commit record's PUT ends), then
        the manifest last."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-lock") as pool:
            held = pool.submit(self.lock.still_held)
            self.store.write_many({name: (self.work / name).read_bytes() for name in (CLIPS, FAILURES)})
            self.settle()
            if not held.result():
                holder = self.lock.holder() or {}
                raise OutputError(f"{self.where(LOCK)}: the lock is no longer this job's (now host "
                                  f"{holder.get('host')}, pid {holder.get('pid')}, job {holder.get('job_id')}); "
                                  "the manifest was not written: rerun once that job has ended")
        self.put_file(MANIFEST)

    def push_log(self, rank: int, attempt: int, path: Path) -> None:
        """This rank's log of this attempt, best effort (a log is not part of the cache)."""
        try:
            if path.is_file():
                self.store.write(f"{LOGS_DIR}/rank-{rank:05d}-a{attempt:03d}.log", path.read_bytes())
        except OutputError as exc:
            log.warning("%s", exc)

    def end_run(self, rank: int, attempt: int, log_file: Path, holds_lock: bool) -> None:
        """The end of a rank's run: its log PUT and, on rank 0, the lock released, side by side; a commit record
        still under way (a run that failed before finalize) first ends, so no write of this job follows the lock's
        release."""
        try:
            self.settle()
        except OutputError as exc:  # the run failed already; that shard is a stray for the next encode
            log.warning("%s", exc)
        if not holds_lock:
            self.push_log(rank, attempt, log_file)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-log") as pool:
            pushed = pool.submit(self.push_log, rank, attempt, log_file)
            try:
                self.release_lock()
            finally:
                pushed.result()

    def mirror(self, path: Path) -> Callable[[], None]:
        """A function that PUTs the work folder's file `path` as the object of the same name."""
        name = Path(path).relative_to(self.work).as_posix()
        return lambda: self.put_file(name)

    def close(self) -> None:
        if self._commit_puts is not None:
            self._commit_puts.shutdown(wait=True)
        shutil.rmtree(self.work, ignore_errors=True)


@dataclasses.dataclass
class Compacted:
    """What OUT's compacted objects hold: commit record name -> (its line, the compacted object holding it), and the
    objects that do not read as progress lines (skipped: their records are read one by one)."""

    lines: dict[str, tuple[bytes, str]]
    unreadable: list[str]

    @classmethod
    def read(cls, store: ObjectStore, listed: Iterable[str]) -> Compacted:
        """The compacted objects among the names `listed`, read side by side."""
        names = [name for name in listed if name.startswith(f"{COMPACTED_DIR}/")]
        found: dict[str, tuple[bytes, str]] = {}
        unreadable = []
        for name, data in store.read_many(names).items():
            lines: dict[str, tuple[bytes, str]] = {}
            try:
                for line in data.splitlines(keepends=True):
                    if not line.startswith(_LINE_HEAD) or not line.endswith(b"\n"):
                        raise OutputError("not a progress line")
                    shard, _ = progress_line_head(store.where(name), 0, line)  # type: ignore[arg-type]
                    lines[commit_name(str(shard["file"]).rsplit("/", 1)[-1])] = (line, name)
            except (VaecacheError, ValueError, KeyError, TypeError) as exc:
                log.warning("%s: not a compacted object of commit records (%s); its records are read one by one",
                            store.where(name), exc)
                unreadable.append(f"{store.where(name)}: not a compacted object of commit records ({exc})")
                continue
            found.update(lines)
        return cls(found, unreadable)

    def vouched_for(self, store: ObjectStore) -> dict[str, bytes]:
        """The lines whose record's listed ETag is their MD5 (the record's bytes, known without a GET); every other
        record is read itself, the records being the truth."""
        return {name: line for name, (line, _) in self.lines.items()
                if store.listed_etag(name) == hashlib.md5(line, usedforsecurity=False).hexdigest()}

    def disagreements(self, records: dict[str, bytes]) -> list[str]:
        """Each compacted line that is not the bytes of its record (`records`: those read), and each compacted object
        that does not read."""
        return [*self.unreadable, *(f"{name}: its line in {self.lines[name][1]} is not the record's (the record is "
                                    "the truth: the line is not used)" for name, data in sorted(records.items())
                                    if name in self.lines and self.lines[name][0] != data)]


def compacted_records(store: ObjectStore, names: list[str]) -> dict[str, bytes]:
    """Commit record name -> its line, from the compacted objects `names` (read side by side). One that does not
    read as progress lines is skipped with a warning: its records are then fetched one by one."""
    return {name: line for name, (line, _) in Compacted.read(store, names).lines.items()}


def check_object_out(store: ObjectStore) -> set[str]:
    """The bucket exists and OUT's prefix can be listed (one listing of OUT's top level; whether the bucket exists is
    asked side by side and its answer read only when that listing is empty), and OUT's URL holds a vaecache output
    or nothing. Returns the names at OUT's top level."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-bucket") as pool:
        bucket = pool.submit(store.bucket_exists)  # asked side by side: it matters only when OUT holds nothing
        try:
            found = store.entries()
        except FileNotFoundError:  # an empty prefix, or no bucket (credentials and access fail before this)
            found = set()
            if not bucket.result():
                raise OutputError(f"{store.url}: no such bucket ({store.bucket}); create it first") from None
    foreign = sorted(name for name in found if name not in OWNED_ENTRIES)
    if RUN not in found and foreign:
        raise UsageError(f"{store.url}: not empty and not a vaecache output (holds {', '.join(foreign[:3])}); "
                         "choose another --out")
    return found


def stray_objects(listing: dict[str, int], listed: set[str] | None) -> list[str]:
    """Objects no finished cache or resume would use: shard objects without a commit record, and with a manifest
    (`listed`: its shard files), shard objects and commit records of shards it does not list."""
    claimed = listed if listed is not None else {committed_shard(name) for name in listing}
    strays = []
    for name in sorted(listing):
        if name.startswith(f"{SHARDS_DIR}/") and name not in claimed:
            strays.append(name)
        elif name.startswith(f"{COMMITS_DIR}/") and listed is not None and committed_shard(name) not in listed:
            strays.append(name)
    return strays


def _why_stray(name: str, listed: set[str] | None) -> str:
    if name.startswith(f"{COMMITS_DIR}/"):
        return f"{name}: commit record of a shard the manifest does not list"
    if listed is not None:
        return f"{name}: shard object not listed in the manifest"
    return f"{name}: shard object without a commit record (a crash between the shard and its commit)"


__all__ = ["COMMITS_DIR", "COMPACTED_DIR", "COMPACT_EVERY", "Compacted", "ObjectOut", "check_object_out", "commit_name",
           "compacted_records", "committed_shard", "disk_progress_logs", "stray_objects"]
