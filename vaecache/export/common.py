"""What every export shares: names that cannot collide, deterministic safetensors bytes, an atomic staging
folder, the export's index and manifest.

Exports stream (one clip's tensors in memory at a time), are atomic (everything is written into a hidden
`.DIR.tmp-PID` beside DIR, fsynced, and renamed to DIR last: a crash leaves nothing that looks like an
export) and deterministic (the same cache exported to the same DIR gives the same bytes: safetensors files
are serialized here with sorted keys, tar members carry a fixed mtime, owner and mode).

A file or sample name derived from a scene id, camera or clip id never escapes DIR and never collides with
another, on any filesystem: `safe_name` keeps a name made of [a-z0-9_-] (and '.', where allowed) as it is
and maps any other (upper case included, so that `Scene` and `scene` stay two names on a case-insensitive
filesystem, and in musubi-tuner's text-encoder cache named after them) to a cleaned prefix and a hash of
the exact text after a '~', a character kept names never hold. Every name written is listed in
DIR/index.jsonl next to the clip and camera it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from vaecache.cache.io import fsync_dir
from vaecache.errors import ExportError, OutputError

EXPORT_MANIFEST = "export.json"
EXPORT_INDEX = "index.jsonl"

_SAFE = re.compile(r"[a-z0-9][a-z0-9_-]{0,99}")
_SAFE_DOTS = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
_WINDOWS_DEVICES = re.compile(r"(con|prn|aux|nul|com[0-9]|lpt[0-9])([._-].*)?")
"""Names Windows reserves for devices, with or without an extension (`nul.mp4` too)."""


def safe_name(text: str, dots: bool = False) -> str:
    """`text` when it is a plain lower-case name ([a-z0-9] then [a-z0-9_-], '.' too with `dots` but never
    '..', at most 100 characters, not a Windows device name); otherwise a cleaned prefix, '~' and 12 hex
    digits of the exact text's sha256. A pure function of `text`, injective even after case folding: a kept
    name is already folded and holds no '~', and a mapped one is fixed by the hash of the case-sensitive
    text (so `Scene` and `scene` never meet, whichever comes first)."""
    pattern = _SAFE_DOTS if dots else _SAFE
    if pattern.fullmatch(text) and ".." not in text and not _WINDOWS_DEVICES.fullmatch(text):
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-_")[:48] or "x"
    return f"{cleaned}~{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int32": "I32", "int64": "I64",
               "bool": "BOOL"}


def safetensors_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file with its header keys sorted: the same tensors give the same bytes in every process
    (safetensors' own writer orders metadata by hash map). Read back by safetensors itself."""
    import torch

    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    blobs, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype} is not exported")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote."""

    out: str
    format: str
    clips: int
    files: int
    bytes: int
    renamed: int
    """Names mapped by safe_name (see DIR/index.jsonl)."""
    notes: tuple[str, ...] = ()
    """Lines for the user: the convention applied, what was prepared or left to do."""

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "notes": list(self.notes)}


def write_new_file(path: Path, data: bytes) -> None:
    """Write and fsync a file that must not exist yet ("x": a name can never silently overwrite another)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A hidden sibling folder to write into; renamed to `target` when the block ends without error, removed
    when it raises. `target` must not exist."""
    target = Path(target)
    if target.exists() or target.is_symlink():
        raise ExportError(f"{target}: already exists; export writes a new folder (remove it or choose another --out)")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"{target}: folder {parent} does not exist")
    folder = parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir()
        yield folder
        for path, _, _ in os.walk(folder):
            fsync_dir(Path(path))
        os.rename(folder, target)
        fsync_dir(parent)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise OutputError(f"{target}: cannot write the export ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


class ExportIndex:
    """DIR/index.jsonl, streamed: one line per written name, with the clip (and camera) it holds."""

    def __init__(self, path: Path) -> None:
        self.handle = open(path, "x", encoding="utf-8")
        self.renamed = 0

    def add(self, *, renamed: bool, **entry: Any) -> None:
        self.renamed += renamed
        if renamed:
            entry["renamed"] = True
        self.handle.write(json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()


def source_of(cache: Any) -> dict[str, Any]:
    """export.json's record of the cache an export was made from."""
    manifest = cache.manifest
    where = str(Path(cache.out).absolute()) if cache.store.local else str(cache.out)
    return {"cache": where, "fingerprint_sha256": manifest.get("fingerprint_sha256"),
            "clips_sha256": (manifest.get("clips") or {}).get("sha256"),
            "format_version": manifest.get("format_version")}


def finish(folder: Path, index: ExportIndex, payload: dict[str, Any]) -> None:
    """Close the index and write export.json, the last file of an export."""
    index.close()
    write_new_file(folder / EXPORT_MANIFEST,
                   json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n")
