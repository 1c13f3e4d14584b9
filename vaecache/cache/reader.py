"""Read a finished latent cache from its store (a folder or a URL, vaecache.cache.store): manifest (version
checked), clip records, shard headers and tensors.

The one reader: `LatentCache`, `verify`, `inspect` and the exports read caches through it, and do not know which
store holds the cache. Format version 2 keeps records in Parquet tables (clips.parquet, failures.parquet), version
1 in JSON Lines (clips.jsonl, failures.jsonl; read from a folder only); both read the same records here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from safetensors import SafetensorError, safe_open

from vaecache.cache.layout import (
    CLIPS,
    FAILURES,
    MANIFEST,
    SHARD_SUFFIX,
    SHARDS_DIR,
    clip_id_problem,
    shard_name_problem,
)
from vaecache.cache.manifest import read_manifest
from vaecache.cache.store import RangedShard, Store, open_store
from vaecache.cache.table import CLIP_TABLE, FAILURE_TABLE, iter_column, iter_table
from vaecache.cache.v1 import CLIPS_V1, FAILURES_V1, v1_records
from vaecache.errors import ClipTableError, ManifestError, ShardHeaderError, UnsafePathError

if TYPE_CHECKING:  # the tensors are read by safetensors, which imports torch when a shard is first read
    import torch


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a shard's safetensors header describes it."""

    dtype: str
    """safetensors dtype code: F32, BF16, F16."""
    shape: list[int]


def shard_header(path: Path | Store, name: str | None = None) -> dict[str, TensorInfo]:
    """Tensor names -> dtype and shape, from the shard's header only (no tensor data is read): a shard file, or
    the shard `name` of a store."""
    if isinstance(path, Store) and not path.local:
        shard = RangedShard(path, str(name))
        return {key: TensorInfo(shard.header[key]["dtype"], list(shard.header[key]["shape"])) for key in shard.keys()}
    if isinstance(path, Store):
        path = path.path(str(name))
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
    """A finished cache in OUT (a folder, a URL or a Store). Opening it reads manifest.json and refuses unknown
    formats and versions, and a clip or failure table named outside OUT (UnsafePathError)."""

    def __init__(self, out: Path | str | Store, storage_options: dict[str, Any] | None = None) -> None:
        self.store = open_store(out, storage_options)
        self.out: Any = self.store.location
        self.manifest: dict[str, Any] = read_manifest(self.store)
        where = self.store.where(MANIFEST)
        if self.version == 1 and not self.store.local:
            raise ManifestError(f"{where}: a format 1 cache is read from a local path only")
        clips_default, failures_default = (CLIPS_V1, FAILURES_V1) if self.version == 1 else (CLIPS, FAILURES)
        self.clips_name = self.store.checked_name((self.manifest.get("clips") or {}).get("file", clips_default),
                                                  f"{where}: clips.file")
        self.failures_name = self.store.checked_name(
            (self.manifest.get("failures") or {}).get("file", failures_default), f"{where}: failures.file")

    @property
    def version(self) -> int:
        return int(self.manifest["format_version"])

    @property
    def clips_path(self) -> Any:
        """The clip table (a Path or a Url), for messages."""
        return self.store.where(self.clips_name)

    @property
    def failures_path(self) -> Any:
        return self.store.where(self.failures_name)

    def table_source(self, name: str, where: Any = None) -> Any:
        """What the table readers take for table `name` (Store.table_source); a missing object is the table readers'
        "missing" (ClipTableError naming `where`, default the store's name for it), on either store."""
        try:
            return self.store.table_source(name)
        except FileNotFoundError:
            raise ClipTableError(f"{where if where is not None else self.store.where(name)}: missing") from None

    def shard_files(self) -> dict[str, dict[str, Any]]:
        """Shard records listed in the manifest, by file (relative to OUT; not checked: see `shard_name`)."""
        return {shard["file"]: shard for shard in self.manifest.get("shards", [])}

    def shard_entry_problem(self, file: object) -> str | None:
        """Why a manifest's shard entry is not `shards/<plain name>` (so could name a file outside OUT)."""
        if (not isinstance(file, str) or not file.startswith(f"{SHARDS_DIR}/")
                or shard_name_problem(file[len(SHARDS_DIR) + 1:])):
            return f"{self.store.where(MANIFEST)}: shards[].file: {file!r} is not a shard file in " \
                   f"{self.store.where(SHARDS_DIR)}"
        return None

    def shard_name(self, file: object) -> str:
        """A manifest's shard entry, refused (UnsafePathError) unless it is shards/<plain name> and stays in OUT (no
        symlink out)."""
        problem = self.shard_entry_problem(file)
        if problem:
            raise UnsafePathError(problem)
        return self.store.checked_name(file, f"{self.store.where(MANIFEST)}: shards[].file")

    def shard_files_present(self) -> dict[str, int]:
        """Every shard file in OUT's shards/ (listed in the manifest or not), with its byte count: one listing."""
        prefix = f"{SHARDS_DIR}/"
        return {name: size for name, size in self.store.listing(SHARDS_DIR).items()
                if name.endswith(SHARD_SUFFIX) and "/" not in name[len(prefix):]}

    def clip_records(self) -> Iterator[dict[str, Any]]:
        """Clip records in id order, one record batch (or JSON line, version 1) at a time: millions stream."""
        if self.version == 1:
            yield from v1_records(self.clips_path)
        else:
            yield from iter_table(self.table_source(self.clips_name, self.clips_path), CLIP_TABLE,
                                  where=self.clips_path)

    def clip_ids(self) -> Iterator[str]:
        """Clip ids in table order; version 2 reads the id column alone."""
        if self.version == 1:
            yield from (record.get("id") for record in v1_records(self.clips_path))
        else:
            yield from iter_column(self.table_source(self.clips_name, self.clips_path), CLIP_TABLE, "id",
                                   where=self.clips_path)

    def failure_records(self) -> list[dict[str, Any]]:
        if self.version == 1:
            return list(v1_records(self.failures_path))
        return list(iter_table(self.table_source(self.failures_name, self.failures_path), FAILURE_TABLE,
                               where=self.failures_path))

    def shard_of(self, record: dict[str, Any]) -> str:
        """The shard a clip record names, refused (UnsafePathError) when the record could name a file elsewhere."""
        problem = record_problem(record)
        if problem:
            raise UnsafePathError(f"{self.clips_path}: {problem}")
        return self.shard_name(f"{SHARDS_DIR}/{record['shard']}")

    def clip_tensors(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One clip's stored tensors by key (mean, logvar, sample), read from its shard."""
        handle = self.store.shard(self.shard_of(record))
        return {key: handle.get_tensor(entry["name"]) for key, entry in record["tensors"].items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of every shard, by name (small caches: tests and examples). Refuses a cache whose
        shards/ folder differs from the manifest's list."""
        listed, present = set(self.shard_files()), set(self.shard_files_present())
        if listed != present:
            raise ManifestError(f"{self.out}: shards present {sorted(present - listed)} are not listed, "
                                f"listed {sorted(listed - present)} are missing")
        found: dict[str, torch.Tensor] = {}
        for file in sorted(listed):
            handle = self.store.shard(self.shard_name(file))
            for name in handle.keys():
                if name in found:
                    raise ManifestError(f"{self.store.where(file)}: repeats tensor {name}")
                found[name] = handle.get_tensor(name)
        return found
