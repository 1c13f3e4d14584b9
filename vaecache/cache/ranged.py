"""A shard read by byte ranges (an object at a URL: `ObjectStore.shard`, and the reader's ranged reads of a shard):
its safetensors header once, then each tensor's bytes on request, no more of the object than that."""

from __future__ import annotations

import json
from typing import Any

from vaecache.errors import ShardHeaderError

SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
"""safetensors' dtype names (its format spec) that `RangedShard` reads (as torch dtypes of the same names)."""

MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header (its format spec)."""


class RangedShard:
    """One shard read by byte ranges: its safetensors header once (8-byte length, then the JSON), then each tensor's
    bytes on request. The subset of safetensors' handle the readers use (``get_tensor``, ``keys``), plus the parsed
    ``header``."""

    def __init__(self, store: Any, name: str) -> None:
        self.store, self.name, self.where = store, name, str(store.where(name))
        try:
            size = int.from_bytes(store.read_range(name, 0, 8), "little")
            if not 2 <= size <= MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(store.read_range(name, 8, 8 + size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError) as exc:
            raise ShardHeaderError(f"{self.where}: safetensors header does not read ({exc})") from None
        self.header: dict[str, Any] = header
        self.base = 8 + size

    def keys(self) -> list[str]:
        return [name for name, info in self.header.items() if name != "__metadata__" and isinstance(info, dict)]

    def get_tensor(self, name: str) -> Any:
        import torch

        info = self.header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise KeyError(name)
        start, end = info["data_offsets"]
        data = self.store.read_range(self.name, self.base + start, self.base + end)
        dtype = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}[info["dtype"]]
        if len(data) != end - start:
            raise ShardHeaderError(f"{self.where}: {name} is cut short ({len(data)} of {end - start} bytes)")
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(info["shape"]) if data else \
            torch.empty(info["shape"], dtype=dtype)


__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "RangedShard"]
