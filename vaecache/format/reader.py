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

from vaecache.errors import ManifestError
from vaecache.format.index import read_manifest
from vaecache.format.io import iter_jsonl
from vaecache.format.layout import CLIPS, CLIPS_V1, FAILURES, FAILURES_V1, SHARD_SUFFIX, SHARDS_DIR
from vaecache.format.table import CLIP_TABLE, FAILURE_TABLE, iter_column, iter_table


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a shard's safetensors header describes it."""

    dtype: str
    """safetensors dtype code: F32, BF16, F16."""
    shape: list[int]


class ShardHeaderError(ManifestError):
    """A shard's safetensors header cannot be read (truncated, overwritten, not a safetensors file)."""


def shard_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names -> dtype and shape, from the shard's header only (no tensor data is read)."""
    try:
        with safe_open(str(path), "pt") as handle:
            return {name: TensorInfo(handle.get_slice(name).get_dtype(), list(handle.get_slice(name).get_shape()))
                    for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise ShardHeaderError(f"{path}: safetensors header does not parse ({exc})") from None


class CacheReader:
    """A finished cache in OUT. Opening it reads manifest.json and refuses unknown formats and versions."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.manifest: dict[str, Any] = read_manifest(self.out)

    @property
    def version(self) -> int:
        return int(self.manifest["format_version"])

    @property
    def clips_path(self) -> Path:
        default = CLIPS_V1 if self.version == 1 else CLIPS
        return self.out / str((self.manifest.get("clips") or {}).get("file", default))

    @property
    def failures_path(self) -> Path:
        default = FAILURES_V1 if self.version == 1 else FAILURES
        return self.out / str((self.manifest.get("failures") or {}).get("file", default))

    def shard_files(self) -> dict[str, dict[str, Any]]:
        """Shard records listed in the manifest, by file (relative to OUT)."""
        return {shard["file"]: shard for shard in self.manifest.get("shards", [])}

    def shard_files_on_disk(self) -> set[str]:
        folder = self.out / SHARDS_DIR
        return {f"{SHARDS_DIR}/{p.name}" for p in folder.glob(f"*{SHARD_SUFFIX}")} if folder.is_dir() else set()

    def clip_records(self) -> Iterator[dict[str, Any]]:
        """Clip records in id order, one record batch (or JSON line, version 1) at a time: millions stream."""
        if self.version == 1:
            yield from iter_jsonl(self.clips_path)
        else:
            yield from iter_table(self.clips_path, CLIP_TABLE)

    def clip_ids(self) -> Iterator[str]:
        """Clip ids in table order; version 2 reads the id column alone."""
        if self.version == 1:
            yield from (record.get("id") for record in iter_jsonl(self.clips_path))
        else:
            yield from iter_column(self.clips_path, CLIP_TABLE, "id")

    def failure_records(self) -> list[dict[str, Any]]:
        if self.version == 1:
            return list(iter_jsonl(self.failures_path))
        return list(iter_table(self.failures_path, FAILURE_TABLE))

    def shard_path(self, record: dict[str, Any]) -> Path:
        return self.out / SHARDS_DIR / record["shard"]

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
            with safe_open(str(self.out / file), "pt") as handle:
                for name in handle.keys():
                    if name in found:
                        raise ManifestError(f"{self.out / file}: repeats tensor {name}")
                    found[name] = handle.get_tensor(name)
        return found
