"""The manifest: what only the encoding run knows (header), written once and last; read with its version checked."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path
from typing import Any

from vaecache.cache.io import atomic_write_bytes, read_json
from vaecache.cache.layout import CLIPS, FAILURES, FORMAT_NAME, FORMAT_VERSION, MANIFEST, SUPPORTED_VERSIONS
from vaecache.cache.table import WrittenTable
from vaecache.errors import ManifestError, OutputError


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


def write_manifest_last(out: Path, header: dict[str, Any], shards: list[dict[str, Any]], clips: WrittenTable,
                         failures: WrittenTable) -> dict[str, Any]:
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header,
        "shards": sorted(shards, key=lambda s: s["file"]),
        "clips": {"file": CLIPS, "count": clips.count, "sha256": clips.sha256},
        "failures": {"file": FAILURES, "count": failures.count, "sha256": failures.sha256},
    }
    write_manifest(out, manifest)
    return manifest


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode()


def write_manifest(out: Any, manifest: dict[str, Any]) -> None:
    """The one writer of manifest.json, whole or not at all, whatever wrote the tensors it lists: an encode's
    finalize (OUT's folder, or the work folder an object store's OUT publishes from) and every set's embed (OUT's
    store). Its caller holds OUT's lock."""
    from vaecache.cache.store import Store

    if isinstance(out, Store):
        out.write(MANIFEST, manifest_bytes(manifest))
    else:
        atomic_write_bytes(Path(out) / MANIFEST, manifest_bytes(manifest))


def read_manifest(out: Any) -> dict[str, Any]:
    """Parse manifest.json of OUT (a folder or a store, vaecache.cache.store) and refuse unknown formats and
    versions."""
    from vaecache.cache.io import loads
    from vaecache.cache.store import Store

    if not isinstance(out, Store):
        path = Path(out) / MANIFEST
        if not path.exists():
            raise ManifestError(f"{path}: no manifest (the run is incomplete or OUT is not a vaecache output)")
        return check_manifest(read_json(path, "manifest"), str(path))
    where = out.where(MANIFEST)
    if out.local:
        return read_manifest(out.folder)
    try:
        data = out.read(MANIFEST)
    except FileNotFoundError:
        if not out.bucket_exists():
            raise ManifestError(f"{out.location}: no such bucket ({out.bucket})") from None
        raise ManifestError(f"{where}: no manifest (the run is incomplete or this is not a vaecache output)") from None
    except OutputError as exc:
        raise ManifestError(str(exc)) from None
    try:
        return check_manifest(loads(data), str(where))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: the manifest does not parse ({exc})") from None


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """`manifest` (parsed JSON), refused unless it is a vaecache manifest of a version this vaecache reads."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ManifestError(f"{where}: not a vaecache manifest")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise ManifestError(f"{where}: format version {version!r} is not supported "
                            f"(this vaecache reads {list(SUPPORTED_VERSIONS)})")
    return manifest
