"""Durable-write primitives: atomic file write, fsynced append log, folder fsync, JSON Lines."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from vaecache.errors import ClipTableError, ManifestError, OutputError

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


def atomic_write_bytes(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Make `path` appear complete or not at all: temp file, write, fsync, rename, fsync the folder. With
    `exclusive`, only where `path` does not exist yet (FileExistsError otherwise): the temp file is hard-linked to
    the name instead of renamed over it."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            if exclusive:
                os.link(tmp, path)
                Path(tmp).unlink()
            else:
                os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    except OSError as exc:
        if exclusive and isinstance(exc, FileExistsError):
            raise
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


class NonFiniteNumber(json.JSONDecodeError):
    """JSON text holding NaN or Infinity: Python writes and reads them, JSON has no such numbers, and a frame rate
    or a statistic that is not finite is never a value vaecache can use."""


def _refuse_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a JSON number (non-finite values are refused)", name, 0)


STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant)
"""json.loads without NaN, Infinity and -Infinity: every JSON file vaecache reads goes through it."""


NON_FINITE_KEY = "non_finite"
"""A clip record's (and a written index line's) list of the JSON paths whose values were NaN or +-Infinity in the
source and are stored as null."""


def replace_non_finite(value: Any, path: str = "") -> tuple[Any, list[str]]:
    """`value` (parsed JSON: dicts, lists, scalars) with every float that is not finite (NaN, Infinity, -Infinity,
    and 1e999, which Python reads as Infinity) replaced by None, and the JSON paths of the values replaced
    (`path` + ".key", "[index]"). JSON has no such numbers, so pass-through metadata that holds them is stored
    as null, never written as a token no strict reader accepts. The common case, nothing to replace, is one
    C-speed json.dumps check and returns `value` itself."""
    try:
        json.dumps(value, allow_nan=False)
        return value, []
    except (ValueError, RecursionError):
        pass
    replaced: list[str] = []
    root = [value]
    stack: list[tuple[Any, Any, str]] = [(root, 0, path)]  # iterative: metadata may nest deeper than the stack
    while stack:
        parent, key, where = stack.pop()
        item = parent[key]
        if isinstance(item, float) and not math.isfinite(item):
            parent[key] = None
            replaced.append(where)
        elif isinstance(item, dict):
            parent[key] = item = dict(item)
            stack.extend((item, name, f"{where}.{name}" if where else str(name)) for name in reversed(list(item)))
        elif isinstance(item, (list, tuple)):
            parent[key] = item = list(item)
            stack.extend((item, index, f"{where}[{index}]") for index in reversed(range(len(item))))
    return root[0], replaced


def loads(text: str | bytes) -> Any:
    """json.loads, refusing NaN and Infinity (NonFiniteNumber, a json.JSONDecodeError)."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    return STRICT_JSON.decode(text)


def read_json(path: Path, what: str = "file") -> Any:
    """A JSON file's value; a file that cannot be read, is not UTF-8 or not JSON (NaN and Infinity included) is a
    ManifestError naming it."""
    try:
        return loads(Path(path).read_bytes())
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: the {what} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: the {what} does not parse ({exc.msg})") from None


def whole_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of every complete, non-blank line of a JSON Lines file, read as bytes: a torn last line
    (a crash mid-append, whatever bytes it ends in, a UTF-8 character cut in two included) is not one."""
    offset = 0
    with open(path, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                return
            if line.strip():
                yield offset, line
            offset += len(line)


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON Lines file, strictly: a whole line that is not UTF-8 or not JSON (NaN and Infinity
    included) is a ClipTableError naming the file and the line's byte offset. A torn last line is ignored."""
    for offset, line in whole_lines(path):
        try:
            yield loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ClipTableError(f"{path}: line at byte {offset} does not parse ({exc})") from None


def cut_torn_tail(path: Path, chunk: int = 1 << 16) -> None:
    """Cut a JSON Lines file back to its last whole line (a crash mid-append), so the next append starts a line."""
    try:
        with open(path, "r+b") as handle:
            end = handle.seek(0, os.SEEK_END)
            position = end
            while position > 0:
                start = max(0, position - chunk)
                handle.seek(start)
                block = handle.read(position - start)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    if start + newline + 1 != end:
                        handle.truncate(start + newline + 1)
                    return
                position = start
            if end:
                handle.truncate(0)
    except FileNotFoundError:
        return


class AppendLog:
    """An fsynced append-only JSON Lines file (per-rank progress and failure records)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._handle = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot open for append ({exc.strerror or exc})") from None

    def append(self, record: dict[str, Any]) -> None:
        self.append_line(json.dumps(record, sort_keys=True, separators=(",", ":")))

    def append_line(self, line: str) -> None:
        """Append one line of JSON text (no newline in it), flushed and fsynced."""
        try:
            self._handle.write(line + "\n")
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot append ({exc.strerror or exc})") from None

    def close(self) -> None:
        self._handle.close()


def sha256_file(path: Path, chunk: int = 8 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
