"""Read a finished latent cache: manifest (version checked), clip records, shard headers and tensors.

`verify` and the tests read caches through this module; shard headers are read by safetensors itself.
Format version 2 keeps records in Parquet tables (clips.parquet, failures.parquet), version 1 in JSON
Lines (clips.jsonl, failures.jsonl); both read the same records here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from vaecache.cache.layout import (
    CLIPS,
    FAILURES,
    MANIFEST,
    SHARD_SUFFIX,
    SHARDS_DIR,
    clip_id_problem,
    inside,
    shard_name_problem,
)
from vaecache.cache.manifest import read_manifest
from vaecache.cache.table import CLIP_TABLE, FAILURE_TABLE, iter_column, iter_table
from vaecache.cache.v1 import CLIPS_V1, FAILURES_V1, v1_records
from vaecache.errors import ManifestError, ShardHeaderError, UnsafePathError


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a shard's safetensors header describes it."""

    dtype: str
    """safetensors dtype code: F32, BF16, F16."""
    shape: list[int]


def shard_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names -> dtype and shape, from the shard's header only (no tensor data is read)."""
    try:
        with safe_open(str(path), "pt") as handle:
            return {name: TensorInfo(handle.get_slice(name).get_dtype(), list(handle.get_slice(name).get_shape()))
                    for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise ShardHeaderError(f"{path}: safetensors header does not parse ({exc})") from None


def record_problem(record: dict[str, Any]) -> str | None:
    """Why a clip record cannot be trusted to name files: an id, scene or shard encode would never write."""
    return clip_id_problem(record.get("id"), record.get("scene")) or shard_name_problem(record.get("shard"))


class CacheReader:
    """A finished cache in OUT. Opening it reads manifest.json and refuses unknown formats and versions, and a
    clip or failure table named outside OUT (UnsafePathError)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.manifest: dict[str, Any] = read_manifest(self.out)
        where = self.out / MANIFEST
        clips_default, failures_default = (CLIPS_V1, FAILURES_V1) if self.version == 1 else (CLIPS, FAILURES)
        self.clips_path = inside(self.out, (self.manifest.get("clips") or {}).get("file", clips_default),
                                 f"{where}: clips.file")
        self.failures_path = inside(self.out, (self.manifest.get("failures") or {}).get("file", failures_default),
                                    f"{where}: failures.file")

    @property
    def version(self) -> int:
        return int(self.manifest["format_version"])

    def shard_files(self) -> dict[str, dict[str, Any]]:
        """Shard records listed in the manifest, by file (relative to OUT; not checked: see `shard_file_path`)."""
        return {shard["file"]: shard for shard in self.manifest.get("shards", [])}

    def shard_entry_problem(self, file: object) -> str | None:
        """Why a manifest's shard entry is not `shards/<plain name>` (so could name a file outside OUT)."""
        if (not isinstance(file, str) or not file.startswith(f"{SHARDS_DIR}/")
                or shard_name_problem(file[len(SHARDS_DIR) + 1:])):
            return f"{self.out / MANIFEST}: shards[].file: {file!r} is not a shard file in {self.out / SHARDS_DIR}"
        return None

    def shard_file_path(self, file: object) -> Path:
        """OUT/file for a manifest's shard entry, refused (UnsafePathError) unless it is shards/<plain name> and
        stays in OUT (no symlink out)."""
        problem = self.shard_entry_problem(file)
        if problem:
            raise UnsafePathError(problem)
        return inside(self.out, str(file), f"{self.out / MANIFEST}: shards[].file")

    def shard_files_on_disk(self) -> set[str]:
        folder = self.out / SHARDS_DIR
        return {f"{SHARDS_DIR}/{p.name}" for p in folder.glob(f"*{SHARD_SUFFIX}")} if folder.is_dir() else set()

    def clip_records(self) -> Iterator[dict[str, Any]]:
        """Clip records in id order, one record batch (or JSON line, version 1) at a time: millions stream."""
        if self.version == 1:
            yield from v1_records(self.clips_path)
        else:
            yield from iter_table(self.clips_path, CLIP_TABLE)

    def clip_ids(self) -> Iterator[str]:
        """Clip ids in table order; version 2 reads the id column alone."""
        if self.version == 1:
            yield from (record.get("id") for record in v1_records(self.clips_path))
        else:
            yield from iter_column(self.clips_path, CLIP_TABLE, "id")

    def failure_records(self) -> list[dict[str, Any]]:
        if self.version == 1:
            return list(v1_records(self.failures_path))
        return list(iter_table(self.failures_path, FAILURE_TABLE))

    def shard_path(self, record: dict[str, Any]) -> Path:
        """The shard a clip record names, refused (UnsafePathError) when the record could name a file elsewhere."""
        problem = record_problem(record)
        if problem:
            raise UnsafePathError(f"{self.clips_path}: {problem}")
        return self.shard_file_path(f"{SHARDS_DIR}/{record['shard']}")

    def clip_tensors(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One clip's stored tensors by key (mean, logvar, sample), read from its shard."""
        with safe_open(str(self.shard_path(record)), "pt") as handle:
            return {key: handle.get_tensor(entry["name"]) for key, entry in record["tensors"].items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of every shard, by name (small caches: tests and examples). Refuses a cache whose
        shards/ folder differs from the manifest's list."""
        listed, on_disk = set(self.shard_files()), self.shard_files_on_disk()
        if listed != on_disk:
            raise ManifestError(f"{self.out}: shards on disk {sorted(on_disk - listed)} are not listed, "
                                f"listed {sorted(listed - on_disk)} are missing")
        found: dict[str, torch.Tensor] = {}
        for file in sorted(listed):
            with safe_open(str(self.shard_file_path(file)), "pt") as handle:
                for name in handle.keys():
                    if name in found:
                        raise ManifestError(f"{self.out / file}: repeats tensor {name}")
                    found[name] = handle.get_tensor(name)
        return found
