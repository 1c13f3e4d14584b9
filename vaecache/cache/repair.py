"""Repairing what a crash or rot left in OUT: damaged committed shards, torn progress lines, orphans."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from vaecache.cache.io import atomic_write_bytes, atomic_write_json, cut_torn_tail, loads, sha256_file
from vaecache.cache.layout import MANIFEST, PROGRESS_DIR, SHARDS_DIR
from vaecache.cache.lock import acquire_lock, release_lock
from vaecache.cache.manifest import read_manifest
from vaecache.cache.progress import (
    CommittedIds,
    CommittedLine,
    progress_line_head,
    progress_logs,
    scan_committed,
)
from vaecache.errors import ManifestError, OutputError


def shard_problem(out: Path, shard: dict[str, Any], hashed: dict[str, list[Any]] | None = None) -> str | None:
    """Why a committed shard cannot be kept (missing, another size, another sha256), or None when intact.

    `hashed` (file -> [bytes, mtime_ns, sha256]) lists shards whose bytes an earlier check hashed: one whose
    size, mtime and recorded sha256 are still those is not hashed again; on return it holds this shard too."""
    path = Path(out) / shard["file"]
    try:
        if not path.is_file():
            return "missing"
        stat = path.stat()
        if stat.st_size != shard["bytes"]:
            return f"{stat.st_size} bytes, {shard['bytes']} recorded"
        seen = [stat.st_size, stat.st_mtime_ns, shard.get("sha256")]
        if hashed is not None and hashed.get(shard["file"]) == seen:
            return None
        if shard.get("sha256") and sha256_file(path) != shard["sha256"]:
            return "sha256 differs from the one recorded when it was committed"
        if hashed is not None:
            hashed[shard["file"]] = seen
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


POOLED_HASH_BYTES = 1 << 20
"""Shards at least this big are hashed in the thread pool; smaller ones inline (a pooled task costs ~10x a
small file's hashing in thread switches)."""


def damaged_shards(out: Path, shards: list[dict[str, Any]], threads: int = 8,
                   hashed: dict[str, list[Any]] | None = None) -> dict[str, str]:
    """Shard file -> problem, for the shards that are not intact (large ones hashed in parallel); `hashed` as
    for shard_problem."""
    large = [shard for shard in shards if shard.get("bytes", 0) >= POOLED_HASH_BYTES]
    problems = {shard["file"]: shard_problem(out, shard, hashed) for shard in shards
                if shard.get("bytes", 0) < POOLED_HASH_BYTES}
    if large:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(large)))) as pool:
            problems.update(zip((shard["file"] for shard in large),
                                pool.map(lambda shard: shard_problem(out, shard, hashed), large)))
    return {shard["file"]: problems[shard["file"]] for shard in shards if problems[shard["file"]] is not None}


HASHED_SHARDS = "hashed-shards.json"
"""In OUT/progress: the committed shards a resume hashed and found intact, with their size and mtime then."""


def forget_hashed_shards(out: Path) -> None:
    """Drop the record of hashed shards: the next repair hashes every committed shard (a shard can rot in place,
    keeping its size and mtime)."""
    (Path(out) / PROGRESS_DIR / HASHED_SHARDS).unlink(missing_ok=True)


def _read_hashed(progress: Path) -> dict[str, list[Any]]:
    try:
        record = loads((progress / HASHED_SHARDS).read_bytes())
    except (OSError, ValueError):
        return {}
    shards = record.get("shards") if isinstance(record, dict) and record.get("format") == 1 else None
    return {k: v for k, v in shards.items() if isinstance(v, list)} if isinstance(shards, dict) else {}


def repair_progress(out: Path, committed: CommittedIds | None = None,
                    shard_problems: Callable[[list[dict[str, Any]]], dict[str, str]] | None = None,
                    ) -> tuple[int, int, dict[str, str]]:
    """Keep committed shards whose file is intact (size and sha256); drop torn log lines, damaged shards,
    orphans, temp files and the failure logs (a rerun records failures afresh).

    Reads only each progress line's shard record and clip ids (see progress_line), once, and rewrites a log
    only when one of its shards is damaged: a resume over millions of committed clips costs seconds plus the
    hashing. `committed` gets the clip ids of every line as it is read, and then those of damaged shards
    taken back (discard).

    Returns (committed clips kept, files discarded, damaged shard file -> problem): the clips of a damaged
    shard are no longer committed, so the run encodes them again. `shard_problems` checks shards that do not lie
    in `out` (an OUT in object storage, objects.ObjectOut); the record of hashed shards is then not kept."""
    out = Path(out)
    progress = out / PROGRESS_DIR
    logs = progress_logs(out)
    lines: dict[Path, list[CommittedLine]] = {}
    for log in logs:
        cut_torn_tail(log)
        lines[log] = []
        for line, ids in scan_committed(log):
            lines[log].append(line)
            if committed is not None:
                committed.add(ids)
    # A requeued job resumes again and again: each resume hashes only the shards committed since the last one
    # (or changed since: another size or mtime). Damage that keeps both is verify's to find, and a rerun on
    # the complete cache then hashes every shard again (prepare_out).
    shards = [line.shard for found in lines.values() for line in found]
    if shard_problems is not None:
        damaged = shard_problems(shards)
    else:
        hashed = _read_hashed(progress)
        damaged = damaged_shards(out, shards, hashed=hashed)
        kept_files = {shard["file"] for shard in shards} - set(damaged)
        atomic_write_json(progress / HASHED_SHARDS, {"format": 1, "shards": {f: v for f, v in sorted(hashed.items())
                                                                             if f in kept_files}})
    claimed: set[str] = set()
    kept_clips = 0
    for log, found in lines.items():
        kept = [line for line in found if line.shard["file"] not in damaged]
        if len(kept) < len(found):
            if committed is not None:
                with open(log, "rb") as handle:
                    for line in found:
                        if line.shard["file"] in damaged:
                            handle.seek(line.offset)
                            committed.discard(progress_line_head(log, line.offset, handle.read(line.length))[1])
            _keep_lines(log, kept)
        claimed.update(Path(line.shard["file"]).name for line in kept)
        kept_clips += sum(line.clips for line in kept)
    del lines
    for log in progress.glob("failures-rank-*.jsonl"):
        log.unlink()
    discarded = 0
    for path in (out / SHARDS_DIR).iterdir():
        if path.name not in claimed and (path.is_file() or path.is_symlink()):
            path.unlink()
            discarded += 1
    for path in [*out.glob(".*.tmp"), *progress.glob(".*.tmp")]:
        path.unlink()
        discarded += 1
    return kept_clips, discarded, damaged


def _keep_lines(log: Path, kept: list[CommittedLine]) -> None:
    """Rewrite `log` (atomically) with only the lines `kept`, byte for byte."""
    with open(log, "rb") as source:
        def lines() -> Iterator[bytes]:
            for line in kept:
                source.seek(line.offset)
                yield source.read(line.length)
        atomic_write_bytes(log, b"".join(lines()))


def repair_strays(out: Path) -> list[str]:
    """`verify --repair` on disk: delete the shard files that no committed progress line claims, or, in a finished
    cache, that its manifest does not list, and temp files a crash left; under OUT's lock (refused while a job holds
    it: a shard it wrote is a stray until its progress line is appended). Returns the files deleted."""
    out = Path(out)
    acquire_lock(out, None)
    try:
        if (out / MANIFEST).exists():  # unreadable, it vouches for nothing: every shard would look like a stray
            try:
                claimed = {Path(shard["file"]).name for shard in read_manifest(out).get("shards", [])}
            except ManifestError as exc:
                raise OutputError(f"{exc}; --repair deletes nothing while the manifest cannot be read") from None
        else:
            logs = progress_logs(out)
            if not logs:
                raise OutputError(f"{out}: no manifest and no progress log says which shards are committed; "
                                  "--repair deletes nothing")
            claimed = {Path(line.shard["file"]).name for log in logs for line, _ in scan_committed(log)}
        deleted = []
        folder = out / SHARDS_DIR
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if path.name not in claimed and (path.is_file() or path.is_symlink()):
                path.unlink()
                deleted.append(f"{SHARDS_DIR}/{path.name}")
        for path in sorted([*out.glob(".*.tmp"), *(out / PROGRESS_DIR).glob(".*.tmp")]):
            path.unlink()
            deleted.append(path.relative_to(out).as_posix())
        return deleted
    finally:
        release_lock(out)

