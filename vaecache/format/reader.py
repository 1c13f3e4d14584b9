"""Read a finished latent cache: manifest (version checked), clip records, shard headers and tensors.

`verify` and the tests read caches through this module; shard headers are read by safetensors itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from vaecache.errors import ManifestError
from vaecache.format.index import read_manifest
from vaecache.format.io import iter_jsonl
from vaecache.format.layout import CLIPS, FAILURES, SHARD_SUFFIX, SHARDS_DIR


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
    def clips_path(self) -> Path:
        return self.out / str((self.manifest.get("clips") or {}).get("file", CLIPS))

    @property
    def failures_path(self) -> Path:
        return self.out / str((self.manifest.get("failures") or {}).get("file", FAILURES))

    def shard_files(self) -> dict[str, dict[str, Any]]:
        """Shard records listed in the manifest, by file (relative to OUT)."""
        return {shard["file"]: shard for shard in self.manifest.get("shards", [])}

    def shard_files_on_disk(self) -> set[str]:
        folder = self.out / SHARDS_DIR
        return {f"{SHARDS_DIR}/{p.name}" for p in folder.glob(f"*{SHARD_SUFFIX}")} if folder.is_dir() else set()

    def clip_records(self) -> Iterator[dict[str, Any]]:
        """Clip records one JSON line at a time (millions of clips stream)."""
        yield from iter_jsonl(self.clips_path)

    def failure_records(self) -> list[dict[str, Any]]:
        return list(iter_jsonl(self.failures_path))

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
