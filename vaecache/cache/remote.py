"""Reading a finished cache from object storage (any fsspec URL; S3 is the one tested, against a real S3-protocol
server) with ranged reads: the manifest and the clip table whole, a shard's safetensors header once, then only the
bytes of the tensors asked for. Checks are the local reader's: the shard's size, or its sha256 (streamed once per
shard per process), against the manifest.

Credentials and endpoint come the way every S3 tool takes them (the standard AWS environment and config files;
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for a non-AWS store); ``storage_options`` go to fsspec for the rest.
Writing a cache to a URL is vaecache.cache.objects.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from vaecache.cache.io import loads
from vaecache.cache.layout import CLIPS, MANIFEST, relative_inside
from vaecache.cache.manifest import check_manifest
from vaecache.errors import ManifestError, ShardChecksumError, ShardHeaderError
from vaecache.urls import Url, is_url, open_filesystem, storage_problem

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
"""safetensors' dtype names (its format spec) -> torch dtypes."""


class RemoteShard:
    """One shard read by ranges: its safetensors header once (8-byte length, then the JSON), then each tensor's
    bytes on request. Same interface as safetensors' handle for what the reader uses (``get_tensor``)."""

    def __init__(self, fs: Any, path: str, where: str) -> None:
        self.fs, self.path, self.where = fs, path, where
        try:
            size = int.from_bytes(fs.cat_file(path, start=0, end=8), "little")
            if not 2 <= size <= 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            self.header = json.loads(fs.cat_file(path, start=8, end=8 + size))
        except (OSError, ValueError) as exc:
            raise ShardHeaderError(f"{where}: safetensors header does not read ({exc})") from None
        self.base = 8 + size

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self.header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise KeyError(name)
        start, end = info["data_offsets"]
        data = self.fs.cat_file(self.path, start=self.base + start, end=self.base + end)
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        if len(data) != end - start:
            raise ShardHeaderError(f"{self.where}: {name} is cut short ({len(data)} of {end - start} bytes)")
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(info["shape"]) if data else \
            torch.empty(info["shape"], dtype=dtype)


class RemoteCache:
    """A finished cache at a URL: the manifest (checked as on disk), the clip table, shards by ranges."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = Url(url.rstrip("/"))
        self.fs, self.root = open_filesystem(self.url, storage_options)
        where = self.url / MANIFEST
        try:
            manifest = loads(self.read(MANIFEST))
        except FileNotFoundError:
            bucket = self.root.split("/", 1)[0]
            if not self._exists(bucket):
                raise ManifestError(f"{self.url}: no such bucket ({bucket})") from None
            raise ManifestError(f"{where}: no manifest (the run is incomplete or this is not a vaecache output)") \
                from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{where}: the manifest does not parse ({exc})") from None
        self.manifest = check_manifest(manifest, str(where))
        if int(self.manifest["format_version"]) == 1:
            raise ManifestError(f"{where}: a format 1 cache is read from a local path only")
        self.clips_file = relative_inside(self.url, (self.manifest.get("clips") or {}).get("file", CLIPS),
                                          f"{where}: clips.file")

    def _exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(path))
        except OSError:
            return False

    def object(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read(self, name: str) -> bytes:
        try:
            return self.fs.cat_file(self.object(name))
        except FileNotFoundError:
            raise
        except Exception as exc:  # botocore's credential errors are no OSError
            raise ManifestError(f"{self.url / name}: cannot read ({storage_problem(exc)})") from None

    def size(self, name: str) -> int:
        return int(self.fs.size(self.object(name)))

    def sha256(self, name: str, block: int = 8 << 20) -> str:
        digest = hashlib.sha256()
        with self.fs.open(self.object(name), "rb", block_size=block) as handle:
            while chunk := handle.read(block):
                digest.update(chunk)
        return digest.hexdigest()

    def has(self, name: str) -> bool:
        return self._exists(self.object(name))

    def clip_table(self, columns: list[str]) -> Any:
        import pyarrow.parquet as pq

        return pq.read_table(self.object(self.clips_file), columns=columns, filesystem=self.fs)

    def shard(self, file: str, entry: dict[str, Any] | None, verify: str) -> RemoteShard:
        """Shard `file` (``shards/<name>``, as the manifest lists it), checked against its entry once: its size,
        or its sha256 with verify="sha256"."""
        name = relative_inside(self.url, file, f"{self.url / MANIFEST}: shards[].file")
        where = str(self.url / name)
        if entry is None:
            raise ShardChecksumError(f"{where}: not listed in manifest.json")
        if verify != "none":
            try:
                size = self.size(name)
            except OSError as exc:
                raise ShardChecksumError(f"{where}: unreadable ({exc})") from None
            if size != entry["bytes"]:
                raise ShardChecksumError(f"{where}: {size} bytes, manifest.json records {entry['bytes']}")
            if verify == "sha256":
                found = self.sha256(name)
                if found != entry.get("sha256"):
                    raise ShardChecksumError(f"{where}: sha256 {found[:16]}..., manifest.json records "
                                             f"{str(entry.get('sha256'))[:16]}...")
        return RemoteShard(self.fs, self.object(name), where)


__all__ = ["RemoteCache", "RemoteShard", "Url", "is_url", "open_filesystem", "storage_problem"]
