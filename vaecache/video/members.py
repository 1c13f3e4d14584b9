"""A video stored inside an uncompressed tar (a WebDataset shard), read in place: a byte window of the tar file.

A member is named by one string, `TAR#NAME@OFFSET+SIZE` (the tar's path, the member's name in it, where its data
starts and how many bytes it has), so every stage that carries a camera's path (plans, index lines, clip records,
`verify --dataset`) carries a member as it is; only opening it (PyAV reads a seekable file object) and its identity
(the member's size and the tar's mtime) differ from a file. Nothing is extracted to disk.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass

from vaecache.errors import VideoDecodeError
from vaecache.storage import location_stat, open_location

_REFERENCE = re.compile(r"^(?P<tar>.+\.[tT][aA][rR])#(?P<name>.+)@(?P<offset>\d+)\+(?P<size>\d+)$", re.DOTALL)
READ_BUFFER = 1 << 20


@dataclass(frozen=True, slots=True)
class TarMember:
    """One member of a tar: where its bytes are."""

    tar: str
    name: str
    offset: int
    """Of the member's data (after its header), in bytes from the start of the tar."""
    size: int

    @property
    def reference(self) -> str:
        return f"{self.tar}#{self.name}@{self.offset}+{self.size}"


def member_of(source: object) -> TarMember | None:
    """The TarMember a camera source names (`TAR#NAME@OFFSET+SIZE`), or None for any other source."""
    if not isinstance(source, str) or "#" not in source:
        return None
    found = _REFERENCE.match(source)
    if found is None:
        return None
    return TarMember(found["tar"], found["name"], int(found["offset"]), int(found["size"]))


def member_identity(member: TarMember) -> tuple[int, int]:
    """(size, mtime_ns): the member's size and its tar's mtime (a rewritten shard is a changed source)."""
    return member.size, _tar_stat(member.tar)[1]


def _tar_stat(tar: str) -> tuple[int, int]:
    """(size, mtime_ns) of a tar file, or of a tar object at a URL."""
    return location_stat(tar)


def member_sha256(member: TarMember) -> str:
    """sha256 of the member's own bytes."""
    digest = hashlib.sha256()
    with open_member(member) as handle:
        while chunk := handle.read(READ_BUFFER):
            digest.update(chunk)
    return digest.hexdigest()


class MemberFile(io.RawIOBase):
    """A read-only, seekable window [offset, offset + size) of a tar file: the member as if it were a file."""

    def __init__(self, member: TarMember) -> None:
        super().__init__()
        self.member = member
        # at a URL: ranged GETs of the member's window (a block at a time), never the whole tar
        self._file = open_location(member.tar, min(4 << 20, max(1 << 16, member.size)))
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.member.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        left = self.member.size - self._position
        if left <= 0:
            return 0
        view = memoryview(buffer).cast("B")[:left]
        self._file.seek(self.member.offset + self._position)
        count = self._file.readinto(view)
        self._position += count or 0
        return count or 0

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_member(member: TarMember) -> io.BufferedReader:
    """The member as a buffered, seekable binary file (what av.open takes). VideoDecodeError naming the member when
    its tar cannot be read or is shorter than the member's bytes (a truncated or rewritten shard)."""
    reference = member.reference
    try:
        tar_size = _tar_stat(member.tar)[0]
        raw = MemberFile(member)
    except FileNotFoundError:
        raise VideoDecodeError(reference, f"tar {member.tar} not found") from None
    except PermissionError:
        raise VideoDecodeError(reference, f"tar {member.tar}: permission denied") from None
    except OSError as exc:
        raise VideoDecodeError(reference, f"tar {member.tar}: cannot read ({exc.strerror or exc})") from None
    if member.offset + member.size > tar_size:
        raw.close()
        raise VideoDecodeError(reference, f"the tar is {tar_size} bytes, the member ends at byte "
                                          f"{member.offset + member.size} (truncated or rewritten since it was listed)")
    if member.size == 0:
        raw.close()
        raise VideoDecodeError(reference, "empty member (0 bytes)")
    return io.BufferedReader(raw, buffer_size=READ_BUFFER)
