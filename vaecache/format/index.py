"""The cache's index: the per-rank progress logs (one parser, used by resume-repair and by finalize),
failure records, and manifest.json (built, written last, read back with a version check)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vaecache.errors import EmptyCacheError, ManifestError
from vaecache.format.io import atomic_write_bytes, atomic_write_json, iter_jsonl, jsonl_bytes, sha256_file
from vaecache.format.layout import (
    CLIPS, FAILURES, FORMAT_NAME, FORMAT_VERSION, MANIFEST, PROGRESS_DIR, SHARDS_DIR, SUPPORTED_VERSIONS,
)


@dataclass(frozen=True)
class ProgressEntry:
    """One committed shard, as its rank's progress log recorded it: the shard record and its clip records."""

    log: Path
    shard: dict[str, Any]
    clips: list[dict[str, Any]]

    def __post_init__(self) -> None:
        if not isinstance(self.shard, dict) or "file" not in self.shard or not isinstance(self.clips, list):
            raise ManifestError(f"{self.log}: progress entry without a shard record or clip list")


def iter_progress(out: Path) -> list[ProgressEntry]:
    """Every committed shard in every rank's progress log, whatever the world size (torn last lines ignored)."""
    folder = Path(out) / PROGRESS_DIR
    if not folder.is_dir():
        return []
    return [ProgressEntry(log, entry.get("shard"), entry.get("clips"))
            for log in sorted(folder.glob("rank-*.jsonl")) for entry in iter_jsonl(log)]


def read_progress(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Committed shards and their clip records from every rank's progress log."""
    entries = iter_progress(out)
    return [e.shard for e in entries], [clip for e in entries for clip in e.clips]


def failure_identity(record: dict[str, Any]) -> tuple[str, str, str, str]:
    """What makes two failure records the same failure (a rerun records a skipped scene again)."""
    return tuple(str(record.get(k) or "") for k in ("scene", "clip", "camera", "path"))  # type: ignore[return-value]


def read_failures(out: Path) -> list[dict[str, Any]]:
    """Failure records of every rank, deduplicated by (scene, clip, camera, path), in that order."""
    failures: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    folder = Path(out) / PROGRESS_DIR
    for log in sorted(folder.glob("failures-rank-*.jsonl")) if folder.is_dir() else []:
        for entry in iter_jsonl(log):
            failures[failure_identity(entry)] = entry
    return [failures[key] for key in sorted(failures)]


def shard_problem(out: Path, shard: dict[str, Any]) -> str | None:
    """Why a committed shard cannot be kept (missing, another size, another sha256), or None when intact."""
    path = Path(out) / shard["file"]
    try:
        if not path.is_file():
            return "missing"
        if path.stat().st_size != shard["bytes"]:
            return f"{path.stat().st_size} bytes, {shard['bytes']} recorded"
        if shard.get("sha256") and sha256_file(path) != shard["sha256"]:
            return "sha256 differs from the one recorded when it was committed"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None


def damaged_shards(out: Path, shards: list[dict[str, Any]], threads: int = 8) -> dict[str, str]:
    """Shard file -> problem, for the shards that are not intact (hashed in parallel)."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(shards)))) as pool:
        problems = pool.map(lambda shard: shard_problem(out, shard), shards)
    return {shard["file"]: problem for shard, problem in zip(shards, problems) if problem is not None}


def repair_progress(out: Path) -> tuple[set[str], int, dict[str, str]]:
    """Keep committed shards whose file is intact (size and sha256); drop torn log lines, damaged shards,
    orphans, temp files and the failure logs (a rerun records failures afresh).

    Returns (committed clip ids, files discarded, damaged shard file -> problem): the clips of a damaged
    shard are no longer committed, so the run encodes them again."""
    out = Path(out)
    progress = out / PROGRESS_DIR
    kept: dict[Path, list[ProgressEntry]] = {log: [] for log in sorted(progress.glob("rank-*.jsonl"))}
    claimed: set[str] = set()
    done: set[str] = set()
    entries = iter_progress(out)
    damaged = damaged_shards(out, [entry.shard for entry in entries])
    for entry in entries:
        if entry.shard["file"] not in damaged:
            path = out / entry.shard["file"]
            kept[entry.log].append(entry)
            claimed.add(path.name)
            done.update(clip["id"] for clip in entry.clips)
    for log, entries in kept.items():
        atomic_write_bytes(log, jsonl_bytes({"shard": e.shard, "clips": e.clips} for e in entries))
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
    return done, discarded, damaged


def reason_kind(reason: str) -> str:
    """The kind of a failure reason without its particulars: 'too short: 8 usable frames, ...' -> 'too short'."""
    return str(reason).split(" (")[0].split(":")[0].strip() or "?"


def describe_failures(failures: list[dict[str, Any]]) -> str:
    """'3 scenes too short, 1 clip not a readable video': failure counts by unit and kind, most first."""
    kinds: dict[tuple[str, str], int] = {}
    for failure in failures:
        key = ("clip" if failure.get("clip") else "scene", reason_kind(failure.get("reason", "?")))
        kinds[key] = kinds.get(key, 0) + 1
    parts = [f"{n} {unit}{'s' if n != 1 else ''} {kind}"
             for (unit, kind), n in sorted(kinds.items(), key=lambda item: (-item[1], item[0]))]
    return ", ".join(parts) or "nothing was planned"


def reason_counts(failures: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for failure in failures:
        reason = str(failure.get("reason", "?")).split(" (")[0]
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def manifest_header(*, producer: dict[str, str], vae: dict[str, Any], fingerprint: dict[str, Any],
                    frame_rule: dict[str, Any], settings: dict[str, Any], store: list[str], dtype: str,
                    planned_clips: int, oom_backoffs: int) -> dict[str, Any]:
    """The manifest fields only the encoding run knows; `finalize` adds counts, shards, clips and failures."""
    return {
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "producer": producer,
        "vae": vae,
        "fingerprint_sha256": hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest(),
        "frame_rule": frame_rule,
        "settings": settings,
        "latent": {"store": store, "dtype": dtype,
                   "layout": "(cameras, channels, latent_frames, height/spatial_factor, width/spatial_factor)"},
        "planned_clips": planned_clips,
        "oom_backoffs": oom_backoffs,
    }


def finalize(out: Path, header: dict[str, Any]) -> dict[str, Any]:
    """Merge every rank's progress log into clips.jsonl/failures.jsonl and write manifest.json last.

    Refuses (EmptyCacheError, no manifest written) when no clip at all was committed."""
    shards, clips = read_progress(out)
    failures = read_failures(out)
    if not clips:
        raise EmptyCacheError(f"{out}: no clips encoded: {describe_failures(failures)} (no manifest written)")
    header = dict(header)
    planned, backoffs = header.pop("planned_clips"), header.pop("oom_backoffs")
    header["latent"] = {**header["latent"],
                        "shape": {key: entry["shape"] for key, entry in clips[0]["tensors"].items()}}
    header["counts"] = {
        "clips": len(clips), "views": sum(len(c["cameras"]) for c in clips),
        "frames": sum(len(c["cameras"]) * len(c["frames"]) for c in clips),
        "shards": len(shards), "bytes": sum(s["bytes"] for s in shards), "failures": len(failures),
        "oom_backoffs": backoffs, "planned_clips": planned,
    }
    return write_manifest(out, header, shards, clips, failures)


def write_manifest(out: Path, header: dict[str, Any], shards: list[dict[str, Any]], clips: list[dict[str, Any]],
                   failures: list[dict[str, Any]]) -> dict[str, Any]:
    """Write clips.jsonl and failures.jsonl, then manifest.json last (its presence means complete)."""
    out = Path(out)
    clips = sorted(clips, key=lambda c: c["id"])
    clip_bytes = jsonl_bytes(clips)
    atomic_write_bytes(out / CLIPS, clip_bytes)
    failure_bytes = jsonl_bytes(failures)
    atomic_write_bytes(out / FAILURES, failure_bytes)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header,
        "shards": sorted(shards, key=lambda s: s["file"]),
        "clips": {"file": CLIPS, "count": len(clips), "sha256": hashlib.sha256(clip_bytes).hexdigest()},
        "failures": {"file": FAILURES, "count": len(failures), "sha256": hashlib.sha256(failure_bytes).hexdigest()},
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def read_manifest(out: Path) -> dict[str, Any]:
    """Parse manifest.json and refuse unknown formats and versions."""
    path = Path(out) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (the run is incomplete or OUT is not a vaecache output)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: manifest does not parse ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ManifestError(f"{path}: not a vaecache manifest")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise ManifestError(f"{path}: format version {version!r} is not supported (this vaecache reads {list(SUPPORTED_VERSIONS)})")
    return manifest
