"""What identifies a camera source on disk, whatever its kind: a video file, a video inside a tar
(vaecache.video.members), one episode of a shared file (vaecache.video.spans), or an image sequence
(vaecache.video.frames). Probing, the decode workers' changed-file check and the records' provenance all ask here."""

from __future__ import annotations

import os
from typing import Any

from vaecache.storage import url_stat
from vaecache.urls import is_url
from vaecache.video.frames import files_identity, frame_files, is_image_source
from vaecache.video.members import member_identity, member_of
from vaecache.video.spans import file_of, span_of


def source_stat(source: Any) -> tuple[int, int]:
    """(size, mtime_ns): a video file's; a tar member's own size and its tar's mtime; an episode's file's; an image
    sequence's total bytes and newest mtime. OSError (or VideoDecodeError naming a frame) when it cannot be read."""
    if is_image_source(source):
        return files_identity(frame_files(source))
    member = member_of(source)
    if member is not None:
        return member_identity(member)
    if is_url(source):  # an object in object storage (DATA at a URL)
        return url_stat(source)
    stat = os.stat(file_of(source))
    return stat.st_size, stat.st_mtime_ns


def identity_on_open(source: Any) -> bool:
    """Whether opening `source` tells its identity without a request of its own: a whole video object at a URL,
    whose reader learns it from the request that opens it (VideoReader.opened_identity)."""
    return (isinstance(source, str) and is_url(source) and not is_image_source(source) and member_of(source) is None
            and span_of(source) is None)


__all__ = ["identity_on_open", "source_stat"]
