"""The on-disk contract of a latent cache: layout, versioned manifest, streaming clip records.

OUT/
  manifest.json        written last, once; its presence means "complete"
  clips.jsonl          one record per clip, sorted by clip id (sha256 recorded in manifest.json)
  failures.jsonl       inputs that produced no clip, with the reason
  run.json             settings + VAE fingerprint of the run that owns OUT (checked on resume)
  shards/*.safetensors latent shards
  progress/rank-*.jsonl  per-rank commit log: one line per committed shard (merged into the manifest)
  logs/rank-*.log      per-rank logs
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from vaecache.errors import ManifestError, OutputError

FORMAT_NAME = "vaecache"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)

MANIFEST = "manifest.json"
CLIPS = "clips.jsonl"
FAILURES = "failures.jsonl"
RUN = "run.json"
SHARDS_DIR = "shards"
PROGRESS_DIR = "progress"
LOGS_DIR = "logs"
SHARD_SUFFIX = ".safetensors"

_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
"""mkstemp creates 0600 files; caches are shared with training jobs, so use the usual umask-based mode."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Make `path` appear complete or not at all: temp file, write, fsync, rename, fsync the folder."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def jsonl_bytes(records: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n" for r in records)


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON Lines file. A torn last line (a crash mid-append) is ignored."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                return
            if line.strip():
                yield json.loads(line)


class AppendLog:
    """An fsynced append-only JSON Lines file (per-rank progress and failure records)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._handle = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot open for append ({exc.strerror or exc})") from None

    def append(self, record: dict[str, Any]) -> None:
        try:
            self._handle.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot append ({exc.strerror or exc})") from None

    def close(self) -> None:
        self._handle.close()


def progress_path(out: Path, rank: int) -> Path:
    return Path(out) / PROGRESS_DIR / f"rank-{rank:05d}.jsonl"


def failures_path(out: Path, rank: int) -> Path:
    return Path(out) / PROGRESS_DIR / f"failures-rank-{rank:05d}.jsonl"


def read_progress(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Committed shards and their clip records from every rank's progress log, whatever the world size."""
    shards, clips = [], []
    folder = Path(out) / PROGRESS_DIR
    if not folder.is_dir():
        return shards, clips
    for log in sorted(folder.glob("rank-*.jsonl")):
        for entry in iter_jsonl(log):
            shards.append(entry["shard"])
            clips.extend(entry["clips"])
    return shards, clips


def read_failures(out: Path) -> list[dict[str, Any]]:
    failures: dict[str, dict[str, Any]] = {}
    folder = Path(out) / PROGRESS_DIR
    for log in sorted(folder.glob("failures-rank-*.jsonl")) if folder.is_dir() else []:
        for entry in iter_jsonl(log):
            failures[entry["key"]] = entry
    return [failures[key] for key in sorted(failures)]


def sha256_file(path: Path, chunk: int = 8 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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


def iter_clip_records(out: Path, manifest: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Stream clip records (millions fit: one JSON line at a time)."""
    yield from iter_jsonl(Path(out) / manifest["clips"]["file"])
