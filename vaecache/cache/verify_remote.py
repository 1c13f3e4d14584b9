"""`vaecache verify` of a cache in object storage: the checks run on disk (vaecache.cache.verify) over the manifest
and tables fetched into a work folder and the shard objects read by URL, plus what only the commit protocol of
vaecache.cache.objects can leave: stray objects (a shard without a commit record, or one the manifest does not
list; a commit record of a shard the manifest does not list). `repair` deletes them under OUT's lock (refused
while a live job holds it). A shard the finished manifest lists whose commit record is gone is named too: the next
encode would take it for a stray, delete it and encode its clips again (`repair` cannot rewrite a commit record).
"""

from __future__ import annotations

from typing import Any, Callable

from vaecache.cache.layout import MANIFEST, PROGRESS_DIR, SHARDS_DIR
from vaecache.cache.objects import COMMITS_DIR, ObjectOut, commit_name, committed_shard, disk_progress_logs
from vaecache.cache.progress import progress_counts
from vaecache.cache.reader import CacheReader, TensorInfo
from vaecache.cache.remote import RemoteShard
from vaecache.cache.verify import Check, VerifyReport, verify_cache
from vaecache.errors import ShardHeaderError, VaecacheError


class ObjectShards:
    """Shard objects as the shard checks read them (verify.LocalShards on disk): sizes from one listing, bytes and
    headers by GET."""

    def __init__(self, objects: ObjectOut, listing: dict[str, int]) -> None:
        self.objects, self.listing = objects, listing

    def present(self, cache: CacheReader) -> set[str]:
        return {name for name in self.listing if name.startswith(f"{SHARDS_DIR}/")}

    def size(self, file: str) -> int:
        if file not in self.listing:
            raise FileNotFoundError(file)
        return self.listing[file]

    def read(self, file: str) -> bytes:
        data = self.objects.get(file)
        if data is None:
            raise FileNotFoundError(file)
        return data

    def header(self, file: str) -> dict[str, Any]:
        try:
            shard = RemoteShard(self.objects.fs, self.objects.key(file), str(self.objects.where(file)))
        except ShardHeaderError as exc:
            raise ShardHeaderError(f"{file}: {str(exc).split(': ', 1)[-1]}") from None
        return {name: TensorInfo(info["dtype"], list(info["shape"])) for name, info in shard.header.items()
                if name != "__metadata__" and isinstance(info, dict)}


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


def verify_url(url: str, quick: bool = False, threads: int | None = None,
               storage_options: dict[str, Any] | None = None, repair: bool = False,
               on_progress: Callable[[int, int], None] | None = None, ctx: Any = None) -> VerifyReport:
    """Every integrity check of the cache at `url`, and its stray objects named. With `repair` the strays are
    deleted first (under the lock; never while the manifest cannot be read, which would make every shard look like
    one) and the cache is checked as repaired, as on disk. Under torchrun (`ctx`) the shards are split across ranks
    and every rank returns the whole report."""
    objects = ObjectOut(url, storage_options)
    try:
        objects.check_usable()
        finished = objects.fetch_tables()
        listed: set[str] | None = None
        if finished:
            try:
                listed = set(CacheReader(objects.work).shard_files())
            except VaecacheError:  # the checks below name the manifest's problem; nothing is repaired then
                repair = False
        progress = objects.sizes(PROGRESS_DIR)
        listing = {**objects.sizes(SHARDS_DIR), **{name: size for name, size in progress.items()
                                                    if name.startswith(f"{COMMITS_DIR}/")}}
        stray_check = Check("no stray objects")
        deleted: list[str] = []
        if repair and (listed is not None or not finished):
            deleted = stray_objects(listing, listed)
            _repair(objects, deleted)
            listing = {name: size for name, size in listing.items() if name not in deleted}
        if not finished:
            objects.pull_records(finished=False)
            clips, shards = progress_counts(objects.work)
            check = Check("manifest")
            check.fail(f"{objects.where(MANIFEST)}: no manifest")
            check.note = (f"incomplete: no final manifest; {clips} clips in {shards} shards are committed (rerun the "
                          "same encode command to finish)")
            _report_strays(stray_check, stray_objects(listing, None), listing, None, deleted)
            return VerifyReport(str(objects.url), complete=False, checks=[check, stray_check], repaired=deleted)
        report = verify_cache(objects.work, quick, threads, ctx=ctx, on_progress=on_progress,
                              shards=ObjectShards(objects, listing))
        report.out, report.repaired = str(objects.url), deleted
        for check in report.checks:
            check.problems = [problem.replace(str(objects.work), str(objects.url)) for problem in check.problems]
            check.note = check.note.replace(str(objects.work), str(objects.url))
        if report.complete and listed is not None:  # shard objects the manifest does not list: the orphan check's
            strays = [name for name in stray_objects(listing, listed) if name.startswith(f"{COMMITS_DIR}/")]
            _report_strays(stray_check, strays, listing, listed, deleted)
            if not disk_progress_logs(progress):  # a cache copied from disk commits in its progress logs instead
                _report_uncommitted(stray_check, sorted(listed), listing)
            report.checks.append(stray_check)
        return report
    finally:
        objects.close()


def _report_strays(check: Check, strays: list[str], listing: dict[str, int], listed: set[str] | None,
                   deleted: list[str]) -> None:
    for name in strays:
        check.fail(_why_stray(name, listed))
    check.ok(max(0, len(listing) - len(strays)))
    if deleted:
        check.note = f"--repair deleted {len(deleted)} object(s): {', '.join(deleted[:3])}" + \
            (" ..." if len(deleted) > 3 else "")
    elif strays:
        check.note = "vaecache verify --repair (or the next encode) deletes them"


def _report_uncommitted(check: Check, listed: list[str], listing: dict[str, int]) -> None:
    """The listed shards whose commit record is gone: the cache reads, but a resume or a grown dataset (which count
    a shard by its commit record alone) would drop them and encode their clips again."""
    claimed = {committed_shard(name) for name in listing}
    gone = [shard for shard in listed if shard not in claimed]
    for shard in gone:
        commit = commit_name(shard.removeprefix(f"{SHARDS_DIR}/"))
        check.fail(f"{shard}: shard object without its commit record {commit} (listed in the manifest; the next "
                   "encode would delete it and encode its clips again)")
    if gone:
        check.note = "; ".join(part for part in (check.note, f"{len(gone)} listed shard(s) lost their commit record: "
                               "rerun the same encode command to encode their clips again") if part)


def _repair(objects: ObjectOut, names: list[str]) -> None:
    if not names:
        return
    objects.acquire_lock(None)  # refused while a live job holds it: its next commit would look like a stray now
    try:
        objects.delete(names)
    finally:
        objects.release_lock()


__all__ = ["ObjectShards", "stray_objects", "verify_url"]
