"""Checks that a latent cache is complete and intact, in a folder or at a URL alike (read through its store,
vaecache.cache.store). Produces a report (pure data); the CLI renders it.

One module past 400 lines: every check reads the same manifest, clip table and shard headers, in one pass, and
the report is what the verify table of docs/commands.md documents line by line. The checks of every kind's sets are
vaecache.verify.sets; source and re-encode checks are vaecache.verify.recheck (they need a VAE and a decoder).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from safetensors.torch import load as safetensors_load

from vaecache.cache.commits import open_out
from vaecache.cache.failures import reason_counts
from vaecache.cache.layout import MANIFEST, SHARDS_DIR
from vaecache.cache.outdir import StrayFindings
from vaecache.cache.reader import CacheReader, record_problem, shard_header
from vaecache.cache.store import open_store
from vaecache.cache.v1 import iter_v1_clip_records
from vaecache.cache.writer import stats_problem
from vaecache.errors import ClipTableError, ManifestError, OutputError, ShardHeaderError, UnsafePathError
from vaecache.models import encode_problem, recorded_family
from vaecache.settings.dtypes import SAFETENSORS_NAMES
from vaecache.verify.report import Check, VerifyReport


class StoreShards:
    """The shard files of a cache as the shard checks read them: sizes from one listing of shards/ (in a folder each
    is also checked not to lead out of OUT through a symlink), bytes and headers from the store."""

    def __init__(self, cache: CacheReader) -> None:
        self.store = cache.store
        self.listing = cache.shard_files_present()

    def present(self) -> set[str]:
        """Every shard file there (`shards/<name>`), listed or not."""
        return set(self.listing)

    def size(self, file: str) -> int:
        """Its byte count (FileNotFoundError when missing; UnsafePathError for a symlink out of OUT)."""
        self.store.checked_name(file, file)
        if file not in self.listing:
            raise FileNotFoundError(file)
        return self.listing[file]

    def read(self, file: str) -> bytes:
        return self.store.read(file)

    def header(self, file: str) -> dict[str, Any]:
        try:
            return shard_header(self.store, file)
        except ShardHeaderError as exc:
            raise ShardHeaderError(f"{file}: {str(exc).split(': ', 1)[-1]}") from None


def verify_cache(out: Any, quick: bool = False, threads: int | None = None, ctx: Any = None,
                 on_progress: Callable[[int, int], None] | None = None, *,
                 storage_options: dict[str, Any] | None = None, repair: bool = False) -> VerifyReport:
    """Every integrity check of OUT (a folder, a URL or a store; the cache alone: vaecache.verify.recheck adds the
    checks against its source). With `repair` the stray shards (files or objects no commit claims, or that the
    finished manifest does not list) are deleted first, by rank 0 under OUT's lock, and the cache is checked as
    repaired. Under torchrun (`ctx` from vaecache.distributed.distributed) the shards are split across ranks and every
    rank returns the whole report. `on_progress(1, shards_of_this_rank)` is called as each of this rank's shards is
    checked."""
    store = open_store(out, storage_options)
    commits = open_out(store)
    try:
        return _verify(store, commits, quick, threads, ctx, on_progress, repair)
    finally:
        commits.close()


def _verify(store: Any, commits: Any, quick: bool, threads: int | None, ctx: Any,
            on_progress: Callable[[int, int], None] | None, repair: bool) -> VerifyReport:
    from vaecache.verify.sets import check_sets  # it imports Check from here
    from vaecache.verify.timelines import RecordedCuts

    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)
    manifest_check = Check("manifest")
    try:
        cache = CacheReader(store)
        manifest = cache.manifest
        manifest_check.ok()
    except ManifestError as exc:
        cache, problem = None, exc
    if repair:  # rank 0 repairs before any rank lists the shards; every rank hears its error
        if cache is None and store.exists(MANIFEST):  # unreadable, it vouches for nothing: all would look stray
            raise OutputError(f"{problem}; --repair deletes nothing while the manifest cannot be read")
        listed = set(cache.shard_files()) if cache is not None else None
        deleted = ctx.on_rank0(lambda: commits.repair(listed)) if ctx is not None else commits.repair(listed)
    else:
        deleted = []
    stray_check = Check(commits.check_name or "")
    if cache is None:
        manifest_check.fail(str(problem))
        checks = [manifest_check]
        if not store.exists(MANIFEST):
            clips, shards = commits.counts()
            manifest_check.note = (f"incomplete: no final manifest; {clips} clips in {shards} shards are "
                                   "committed (rerun the same encode command to finish)")
            found = commits.problems(None) if commits.check_name else None
            if found is not None:
                checks.append(_stray_check(stray_check, found, deleted))
        return VerifyReport(str(store.location), complete=False, checks=checks, repaired=deleted)

    clips_check = Check("clip records")
    shard_check = Check("shard files" + (" (size only, --quick)" if quick else ""))
    orphan_check = Check("no orphan shards")
    tensor_check = Check("tensors match records")
    value_check = Check("values finite and match stats", skipped=quick)
    failures_check = Check("failures file")
    cuts_check = Check("recorded frame indexes")

    listed = cache.shard_files()
    listed_bytes = sum(int(s.get("bytes") or 0) for s in listed.values())
    listed_count = len(listed)
    for file in sorted(listed, key=str):  # never opened: a named failure, its clips claim no known shard
        problem = cache.shard_entry_problem(file)
        if problem:
            shard_check.fail(problem)
            del listed[file]
    shards = StoreShards(cache)
    on_disk = shards.present()
    for orphan in sorted(on_disk - set(listed)):
        orphan_check.fail(f"{orphan}: shard file not listed in the manifest")
    orphan_check.ok(len(on_disk & set(listed)))

    mine = dict(sorted(listed.items())[rank::world])
    workers = threads or min(8, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        checks = _ShardChecks(shards, mine, pool, 2 * workers, quick, on_progress)
        cuts = RecordedCuts(store, cuts_check) if rank == 0 else None
        seen = scan_records(cache, clips_check, tensor_check, listed, checks.add, cuts.add if cuts else None)
        results = checks.finish(all_records_read=seen.readable)
    if cuts is not None:
        cuts.finish()
    if world > 1:
        results = [result for part in ctx.all_gather_object(results) for result in part]
    for result in sorted(results, key=lambda r: r["file"]):
        for check, problems, passed in ((shard_check, result["shard"], 1),
                                        (tensor_check, result["tensors"], result["tensors_ok"]),
                                        (value_check, result["values"], result["values_ok"])):
            for problem in problems:
                check.fail(problem)
            if not problems:
                check.ok(passed)
            elif check is not shard_check:
                check.ok(max(0, passed))

    failures = _read_failures(cache, failures_check)
    clip_count = manifest.get("clips", {}).get("count")
    if clip_count is not None and clip_count != seen.clips:
        clips_check.fail(f"manifest says {clip_count} clips, {cache.clips_path.name} holds {seen.clips}")
    if not seen.clips:
        clips_check.fail(f"{cache.clips_path.name}: the cache holds no clips (an empty cache is not a result)")
    planned = manifest.get("counts", {}).get("planned_clips")
    if planned and seen.clips * 2 < planned:
        clips_check.note = (f"warning: only {seen.clips} of {planned} planned clips were encoded; "
                            f"see {cache.failures_path.name}")
    summary = {
        "clips": seen.clips,
        "views": seen.views,
        "shards": len(listed),
        "bytes": sum(int(s.get("bytes", 0)) for s in listed.values()),
        "failures": len(failures),
        "failure_reasons": reason_counts(failures),
        "planned_clips": planned,
        "vae": manifest.get("vae", {}).get("family"),
        "untrained_vae": manifest.get("vae", {}).get("untrained", False),
        "latent_shape": manifest.get("latent", {}).get("shape"),
    }
    declared_check = check_declarations(manifest, seen, listed_count, listed_bytes, len(failures))
    checks = [manifest_check, clips_check, shard_check, orphan_check, tensor_check, value_check, failures_check,
              declared_check, encodes_check(manifest, seen),
              *([cuts_check] if cuts_check.passed or cuts_check.failed or cuts_check.note else []),
              *check_sets(cache, quick, summary)]
    found = commits.problems(set(cache.shard_files())) if commits.check_name else None
    if found is not None:
        checks.append(_stray_check(stray_check, found, deleted))
    return VerifyReport(str(store.location), complete=True, checks=checks, summary=summary, repaired=deleted)


def _stray_check(check: Check, found: StrayFindings, deleted: list[str]) -> Check:
    """The commit protocol's own stray check: what it found wrong, what it deleted."""
    for problem in found.problems:
        check.fail(problem)
    check.ok(found.passed)
    if deleted:
        check.note = f"--repair deleted {len(deleted)} object(s): {', '.join(deleted[:3])}" + \
            (" ..." if len(deleted) > 3 else "")
    elif found.note:
        check.note = found.note
    return check


@dataclass
class _Seen:
    """What the streaming pass over the clip records counted."""

    clips: int = 0
    views: int = 0
    frames: int = 0
    buckets: dict[str, list[int]] = field(default_factory=dict)
    """Bucket name -> [clips, views] of the records that name it."""
    readable: bool = True
    """False when the clip table stopped reading part-way (then no shard's records are known complete)."""
    other_encodes: int = 0
    """Clips whose latents are not the ones their model's trainers make (vaecache.models.encode_problem)."""
    encode_examples: list[str] = field(default_factory=list)
    """The first few of them, with why."""


def scan_records(cache: CacheReader, check: Check, tensor_check: Check, listed: dict[str, dict[str, Any]],
                  to_shard: Callable[[str, dict[str, Any]], None],
                  observe: Callable[[dict[str, Any]], None] | None = None) -> _Seen:
    """One streaming pass over the clip records: the table's sha256, order (by id, so a repeated id is the
    previous one), each record against the manifest; each record is handed to its shard's checks (and to
    `observe`, which checks what the record says of its sources)."""
    seen = _Seen()
    info = cache.manifest.get("clips") or {}
    path = cache.clips_path
    if not cache.store.exists(cache.clips_name):
        check.fail(f"{path.name}: missing")
        seen.readable = False
        return seen
    if info.get("sha256") and cache.store.sha256(cache.clips_name) != info["sha256"]:
        check.fail(f"{path.name}: sha256 differs from the manifest (records were edited or truncated)")
    previous: Any = None
    out_of_order = False
    vae, settings = cache.manifest.get("vae") or {}, cache.manifest.get("settings") or {}
    try:
        bad_line = lambda lineno: check.fail(f"{path.name}:{lineno}: does not parse")  # noqa: E731
        for record in (iter_v1_clip_records(path, bad_line) if cache.version == 1 else cache.clip_records()):
            clip_id = record.get("id")
            if previous is not None and clip_id == previous:
                check.fail(f"clip {clip_id}: recorded twice")
                continue
            if not out_of_order and isinstance(clip_id, str) and isinstance(previous, str) and clip_id < previous:
                out_of_order = True
                check.fail(f"{path.name}: clip {clip_id} comes after {previous} (records must be sorted by id)")
            previous = clip_id
            seen.clips += 1
            cameras = len(record.get("cameras") or [])
            seen.views += cameras
            seen.frames += cameras * len(record.get("frames") or [])
            bucket = record.get("bucket")
            if isinstance(bucket, dict):
                counted = seen.buckets.setdefault(str(bucket.get("name")), [0, 0])
                counted[0] += 1
                counted[1] += cameras
            problem = manifest_record_problem(record, cache.manifest)
            if problem:
                check.fail(f"clip {clip_id}: {problem}")
            else:
                check.ok()
                if observe is not None:
                    observe(record)
            other = encode_problem(vae, settings, record)
            if other is not None:
                seen.other_encodes += 1
                if len(seen.encode_examples) < 3:
                    seen.encode_examples.append(f"clip {clip_id}: {other}")
            file = f"{SHARDS_DIR}/{record.get('shard')}"
            if problem and record_problem(record):
                continue  # an id or shard name that could name another file: never followed
            if file not in listed:
                tensor_check.fail(f"clip {clip_id}: its shard {file} is not in the manifest")
            else:
                to_shard(file, record)
    except ClipTableError as exc:
        message = str(exc)
        check.fail(f"{path.name}: {message[len(str(path)) + 2:] if message.startswith(str(path)) else message}")
        seen.readable = False
    return seen


class _ShardChecks:
    """Per-shard checks fed by the record stream: a shard's records are gathered until the manifest's clip
    count for it is reached (the records of one shard are neighbours in id order: a writer commits a run of
    its block; in a bucketed cache each bucket's shard takes every clip of that bucket in the block, so several
    shards gather at once, one per bucket), then the shard is checked in the pool and its records dropped. At most 2x
    pool-size checks wait at once, so memory holds the records of the shards being gathered or checked, not of the
    cache."""

    def __init__(self, shards: Any, mine: dict[str, dict[str, Any]], pool: ThreadPoolExecutor, limit: int, quick: bool,
                 on_progress: Callable[[int, int], None] | None) -> None:
        self.shards, self.mine, self.pool, self.limit = shards, mine, pool, limit
        self.quick, self.on_progress = quick, on_progress
        self.pending: dict[str, list[dict[str, Any]]] = {}
        self.submitted: set[str] = set()
        self.late: dict[str, list[str]] = {}
        self.in_flight: deque[Future] = deque()
        self.results: list[dict[str, Any]] = []
        self.shapes: dict[str, Any] = {}
        """Shard file -> the tensor shapes of its first record: every shard holds one latent shape."""

    def add(self, file: str, record: dict[str, Any]) -> None:
        if file not in self.mine:
            return
        shapes = sorted((key, (entry.get("shape") or [None])[1:])
                        for key, entry in (record.get("tensors") or {}).items()
                        if isinstance(entry, dict))  # per view: a shard may hold scenes of different camera counts
        first = self.shapes.setdefault(file, shapes)
        if shapes != first:
            self.late.setdefault(file, []).append(
                f"clip {record.get('id')}: {file} mixes latent shapes ({dict(shapes)} after {dict(first)})")
        if file in self.submitted:  # more records claim it than the manifest says it holds
            self.late.setdefault(file, []).append(
                f"clip {record.get('id')}: claims {file}, whose {self.mine[file].get('clips')} clip(s) are all "
                "recorded already")
            return
        records = self.pending.setdefault(file, [])
        records.append(record)
        if len(records) == self.mine[file].get("clips"):
            self._submit(file)

    def _submit(self, file: str, claims_known: bool = True) -> None:
        self.submitted.add(file)
        records = self.pending.pop(file, [])
        while len(self.in_flight) >= self.limit:
            self._collect()
        self.in_flight.append(self.pool.submit(_check_shard, self.shards, file, self.mine[file], records, self.quick,
                                               claims_known))

    def _collect(self) -> None:
        self.results.append(self.in_flight.popleft().result())
        if self.on_progress is not None:
            self.on_progress(1, len(self.mine))

    def finish(self, all_records_read: bool = True) -> list[dict[str, Any]]:
        """Check the shards not checked yet (fewer records than the manifest says, or none) and wait. When the
        clip table could not be read to its end, their unclaimed tensors are not reported: the clip records
        check already names the table, and every tensor would look unclaimed."""
        for file in sorted(self.mine):
            if file not in self.submitted:
                self._submit(file, claims_known=all_records_read)
        while self.in_flight:
            self._collect()
        for result in self.results:
            result["tensors"].extend(self.late.get(result["file"], []))
        return self.results


def check_declarations(manifest: dict[str, Any], seen: _Seen, shards: int, shard_bytes: int, failures: int) -> Check:
    """What the manifest declares beyond its clip count (the clip records check) against what the records and
    files hold: the counts, a bucketed cache's per-bucket counts, and that latent.shape is declared exactly when
    there is one shape (each record's shapes and dtype are checked against the declared ones record by record)."""
    check = Check("manifest declarations")
    counts = manifest.get("counts") or {}
    from_records = (("views", seen.views), ("frames", seen.frames)) if seen.readable else ()
    for key, found in (*from_records, ("shards", shards), ("bytes", shard_bytes), ("failures", failures)):
        if key in counts and counts[key] != found:
            check.fail(f"counts.{key} is {counts[key]!r}, the cache holds {found}")
        elif key in counts:
            check.ok()
    if (manifest.get("failures") or {}).get("count", failures) != failures:
        check.fail(f"failures.count is {manifest['failures']['count']!r}, the failure table holds {failures}")
    if not seen.readable:
        check.note = "the clip table does not read: counts and shapes from its records not compared"
        return check
    latent = manifest.get("latent") or {}
    buckets = manifest.get("buckets")
    if isinstance(buckets, list):
        for bucket in buckets:
            name = str(bucket.get("name"))
            clips, views = seen.buckets.pop(name, [0, 0])
            if (bucket.get("clips"), bucket.get("views")) != (clips, views):
                check.fail(f"bucket {name} declares {bucket.get('clips')} clips and {bucket.get('views')} views, "
                           f"its records are {clips} clips and {views} views")
            elif clips and not isinstance(bucket.get("shape"), dict):
                check.fail(f"bucket {name} holds {clips} clips but declares no latent shape")
            else:
                check.ok()
        for name in sorted(seen.buckets):
            check.fail(f"bucket {name}: {seen.buckets[name][0]} clip record(s) name it, the manifest does not list it")
        several = sum(1 for bucket in buckets if bucket.get("clips")) > 1
    else:
        several = False
    if "shape" in latent and (latent["shape"] is None) != several:
        check.fail(f"latent.shape is {latent['shape']!r}, but the cache holds "
                   f"{'several latent shapes (see buckets)' if several else 'one latent shape'}")
    return check


def encodes_check(manifest: dict[str, Any], seen: _Seen) -> Check:
    """Which clips hold latents their model's trainers would not have made (the VAE's own tiling, an older
    vaecache's time tiles): a warning, not a failure (the cache is what it says), which trainer exports refuse."""
    family, _ = recorded_family(manifest.get("vae") or {})
    check = Check("reference encode")
    check.ok(seen.clips - seen.other_encodes)
    if seen.other_encodes:
        model = f"{family.label}'s trainers" if family is not None else "the reference encode"
        check.note = (f"warning: {seen.other_encodes} clip(s) not encoded as {model} encode "
                      f"({'; '.join(seen.encode_examples)}); musubi exports refuse them: encode again with --overwrite "
                      "where every clip fits untiled")
    return check


def manifest_record_problem(record: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """Why a clip record disagrees with the manifest: its id, scene or shard (ids encode would refuse), its stored
    keys, their shapes, their tensor names."""
    unsafe = record_problem(record)
    if unsafe:
        return unsafe
    numbers = [record.get("fps"), *(record.get("times") or [])]
    if any(isinstance(n, float) and not math.isfinite(n) for n in numbers):
        return f"fps or frame times hold a non-finite number (fps {record.get('fps')!r})"
    latent = manifest.get("latent") or {}
    tensors = record.get("tensors")
    if not isinstance(tensors, dict):
        return "record has no tensors"
    keys = latent.get("store")
    if keys is not None and sorted(tensors) != sorted(keys):
        return f"stores {sorted(tensors)}, the manifest says {sorted(keys)}"
    cameras = len(record.get("cameras") or [])
    buckets = {bucket.get("name"): bucket for bucket in manifest.get("buckets") or []}
    bucket = None
    if buckets:  # a bucketed cache: each clip against its own bucket's latent shape
        name = (record.get("bucket") or {}).get("name") if isinstance(record.get("bucket"), dict) else None
        bucket = buckets.get(name)
        if bucket is None:
            return f"bucket {name!r} is not one of the manifest's buckets ({', '.join(map(str, buckets))})"
    for key, entry in sorted(tensors.items()):
        name = f"{record.get('id')}/{key}"
        if entry.get("name") != name:
            return f"{key} is stored as tensor {entry.get('name')!r}, expected {name!r}"
        if "dtype" in latent and entry.get("dtype") != latent["dtype"]:
            return f"{key} is stored as {entry.get('dtype')}, the manifest's latent.dtype is {latent['dtype']}"
        if bucket is not None:
            expected = [cameras, *bucket.get("view_shape", [])]
            if entry.get("shape") != expected:
                return f"{key} has shape {entry.get('shape')}, bucket {bucket['name']}'s latent shape is {expected}"
            declared = (bucket.get("shape") or {}).get(key) if isinstance(bucket.get("shape"), dict) else None
            if declared is not None and declared != expected:
                return f"{key} has shape {expected}, bucket {bucket['name']} declares shape {declared}"
            continue
        shape = latent.get("shape")
        expected = shape.get(key) if isinstance(shape, dict) else None
        if isinstance(shape, dict) and expected is None:
            return f"stores {key}, the manifest's latent.shape declares {sorted(shape)}"
        if expected is not None and entry.get("shape") != expected:
            return f"{key} has shape {entry.get('shape')}, the manifest's latent.shape declares {expected}"
    return None


def _read_failures(cache: CacheReader, check: Check) -> list[dict[str, Any]]:
    info = cache.manifest.get("failures") or {}
    path = cache.failures_path
    if not cache.store.exists(cache.failures_name):
        check.fail(f"{path.name}: missing")
        return []
    if info.get("sha256") and cache.store.sha256(cache.failures_name) != info["sha256"]:
        check.fail(f"{path.name}: sha256 differs from the manifest")
    try:
        failures = cache.failure_records()
    except ClipTableError as exc:
        check.fail(f"{path.name}: does not read ({str(exc).split(': ', 1)[-1]})")
        return []
    check.ok()
    check.note = f"{len(failures)} skipped input(s)" + (
        ": " + ", ".join(f"{n}x {r}" for r, n in reason_counts(failures).items()) if failures else "")
    return failures


def _check_shard(shards: Any, file: str, shard: dict[str, Any], records: list[dict[str, Any]], quick: bool,
                 claims_known: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {"file": file, "shard": [], "tensors": [], "values": [], "tensors_ok": 0, "values_ok": 0}
    try:
        size = shards.size(file)
    except UnsafePathError as exc:  # a symlink out of OUT: named, never opened or hashed
        result["shard"].append(str(exc))
        return result
    except FileNotFoundError:
        result["shard"].append(f"{file}: missing")
        result["tensors"].extend(f"clip {r['id']}: its shard {file} is missing" for r in records)
        return result
    if size != shard.get("bytes"):
        result["shard"].append(f"{file}: {size} bytes, manifest says {shard.get('bytes')}")
    data = b""
    if not quick:
        data = shards.read(file)
        digest = hashlib.sha256(data).hexdigest()
        if digest != shard.get("sha256"):
            result["shard"].append(f"{file}: sha256 {digest[:12]}..., manifest says {str(shard.get('sha256'))[:12]}...")
    try:
        header = shards.header(file)
    except ShardHeaderError as exc:
        result["shard"].append(f"{file}: {str(exc).split(': ', 1)[1]}")
        return result
    claimed = set()
    for record in records:
        for key, entry in record.get("tensors", {}).items():
            name = entry.get("name")
            claimed.add(name)
            found = header.get(name)
            if found is None:
                result["tensors"].append(f"clip {record['id']}: tensor {name} not in {file}")
            elif found.shape != entry.get("shape") or found.dtype != SAFETENSORS_NAMES.get(entry.get("dtype")):
                result["tensors"].append(
                    f"clip {record['id']}: {key} is {found.dtype} {found.shape} in {file}, "
                    f"record says {entry.get('dtype')} {entry.get('shape')}")
            else:
                result["tensors_ok"] += 1
    for name in sorted(set(header) - claimed) if claims_known else ():
        result["tensors"].append(f"{file}: tensor {name} is claimed by no clip record")
    if quick or result["shard"]:
        return result
    try:
        tensors = safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed payloads
        result["values"].append(f"{file}: tensors do not load ({exc})")
        return result
    for record in records:
        for key, entry in record.get("tensors", {}).items():
            tensor = tensors.get(entry.get("name"))
            if tensor is None:
                continue
            problem = stats_problem(tensor, entry.get("stats"), entry.get("channel_stats"))
            if problem:
                result["values"].append(f"clip {record['id']}: {key} in {file} {problem}")
            else:
                result["values_ok"] += 1
    return result
