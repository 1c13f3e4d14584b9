"""The process's object-store clients and what it reads through them: the fsspec filesystem of a URL and its errors
in one line, the one client per process for DATA's objects, an object's size, mtime and bytes, the object as a
seekable file read by ranged GETs (read ahead, or by a read cache its opener gives: vaecache.video.planned_reads),
and the small objects a process read whole, held for their next open (`HeldObjects`). fsspec is imported only to
open a URL."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Collection

from vaecache.urls import is_url


def _endpoint_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """A non-AWS S3 endpoint from the environment, as AWS tools take it (s3fs's own `endpoint_url` option)."""
    if not url.startswith(("s3://", "s3a://")) or "endpoint_url" in options:
        return options
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {**options, "endpoint_url": endpoint} if endpoint else options


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, root path) for `url`: a filesystem of this process's own (`skip_instance_cache`), since
    fsspec instances must not cross a fork (DataLoader workers, spawned ranks). Transient S3 errors (throttling,
    timeouts, dropped connections) are retried with backoff by s3fs itself (s3fs/core.py `_error_wrapper`,
    `S3FileSystem.retries`, 5 tries) and below it by botocore."""
    import fsspec

    options = _endpoint_options(url, dict(storage_options or {}))
    try:
        if url.startswith(("s3://", "s3a://")) and "session" not in options:
            options["session"] = _s3_session(options)
        return fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    except (ImportError, ValueError) as exc:
        from vaecache.errors import UsageError

        missing = " (pip install 'vaecache[s3]')" if isinstance(exc, ImportError) else ""
        raise UsageError(f"{url}: cannot open this URL ({exc}){missing}") from None


_S3_SESSION_ARGS: set[str] | None = None
_BOTOCORE_LOADER: Any = None
"""botocore's loader of service models, shared by this process's S3 sessions and the processes it forks: a new
client parses the models (megabytes of JSON) once per loader, a tenth of a second of CPU on every filesystem and in
every DataLoader worker otherwise. It holds parsed data only, no connection or event loop."""


def _s3_session(options: dict[str, Any]) -> Any:
    """The session s3fs would make for `options` (the ones S3FileSystem does not take itself, e.g. ``profile``, go
    to the session, as s3fs passes them), made with the shared loader."""
    global _S3_SESSION_ARGS, _BOTOCORE_LOADER
    import inspect

    import s3fs
    from aiobotocore.session import AioSession

    if _S3_SESSION_ARGS is None:
        _S3_SESSION_ARGS = set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) | {
            "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    session = AioSession(**{key: value for key, value in options.items() if key not in _S3_SESSION_ARGS})
    if _BOTOCORE_LOADER is None:
        _BOTOCORE_LOADER = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _BOTOCORE_LOADER)
    return session


def storage_problem(exc: BaseException) -> str:
    """What a user should read of an object-store error: no credentials, access denied, no such bucket or object,
    or the error itself (one line)."""
    name = type(exc).__name__
    text = " ".join(str(exc).split())
    if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in text:
        return ("no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                "--storage-option key=... secret=...)")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"access denied ({text or name})"
    if isinstance(exc, FileNotFoundError):
        return f"not found ({text or name})"
    return f"{name}: {text}" if text else name


_DATA_OPTIONS: dict[str, Any] = {}
"""The fsspec options a client for DATA's objects is opened with where neither DATA's listing nor a parent process
opened one (set_data_storage_options: commands that read recorded sources without listing DATA)."""
_DATA_FILESYSTEMS: dict[tuple[int, str], tuple[Any, dict[str, Any]]] = {}
"""(pid, protocol) -> the filesystem this process reads DATA's objects with, and its options: one per process, since
fsspec instances must not cross a fork (DataLoader workers)."""
_DATA_FILESYSTEMS_LOCK = threading.Lock()


HELD_BYTES_BUDGET = 64 << 20
"""The most bytes of whole objects a HeldObjects holds for their next open."""


class HeldObjects:
    """Whole objects held for their next open (`open_url(url, held=...)`) in this process or one forked from it,
    which then makes no request: an encode's start-up probes a small video by reading it whole, and the decode
    worker that opens it for its first batch reads these bytes instead of the store. Each is held as its reader read
    it (its listed version: every read of an object is conditional on the ETag it was listed with), at most
    `budget` bytes in all. An encode makes one and hands it to its probing and its decode; plan, index and verify
    read nothing again and hold nothing."""

    _instances: weakref.WeakSet[HeldObjects] = weakref.WeakSet()

    def __init__(self, budget: int = HELD_BYTES_BUDGET) -> None:
        self.budget = budget
        self._objects: dict[str, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        HeldObjects._instances.add(self)

    def hold(self, url: str, data: bytes) -> bool:
        """Hold `data` as the object at `url`; False where it is held already or the budget is spent."""
        with self._lock:
            if url in self._objects or self._bytes + len(data) > self.budget:
                return False
            self._objects[url] = data
            self._bytes += len(data)
            return True

    def take(self, url: str) -> bytes | None:
        """The object at `url`, no longer held (None: not held)."""
        with self._lock:
            data = self._objects.pop(url, None)
            self._bytes -= len(data) if data is not None else 0
            return data

    def keep_only(self, urls: Collection[str]) -> None:
        """Hold no object but those at `urls` (none: every held object let go)."""
        with self._lock:
            for url in [url for url in self._objects if url not in urls]:
                self._bytes -= len(self._objects.pop(url))

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it as the parent forked


def _new_locks_after_fork() -> None:
    global _DATA_FILESYSTEMS_LOCK
    _DATA_FILESYSTEMS_LOCK = threading.Lock()  # a thread of the parent may have held it as the parent forked
    for held in list(HeldObjects._instances):
        held._after_fork()


os.register_at_fork(after_in_child=_new_locks_after_fork)


def set_data_storage_options(options: dict[str, Any]) -> None:
    """The fsspec options of the clients for DATA's objects this process (and the workers it forks) opens from now
    on without a listing of DATA: `verify` and `decode`, which read the sources a cache records, and `index`, whose
    ranks but rank 0 probe objects of a listing they did not take. Every rank of an encode and a plan lists DATA and
    passes its options with the listing instead (`data_filesystem(url, options)`)."""
    _DATA_OPTIONS.clear()
    _DATA_OPTIONS.update(options)
    _DATA_FILESYSTEMS.clear()


def data_filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(filesystem, path in it) for a source at `url`: one per process and protocol, however many threads ask at once
    (a client costs a tenth of a second of CPU to make). `options`, given where DATA is listed (a run's discovery:
    vaecache.sources.urlpath), opens this process's client afresh with them (and the AWS environment as it is now);
    every later read of DATA's objects here, and in the processes forked from here, goes through that client. A
    process forked after DATA was listed (a decode worker) opens its own with the same options and starts from that
    listing: the size and ETag an object is opened with come from it, as in the parent that planned from it, instead
    of a HEAD per object (a read of an object changed since still fails, on its ETag)."""
    protocol = url.split("://", 1)[0]
    key = (os.getpid(), protocol)
    entry = _DATA_FILESYSTEMS.get(key) if options is None else None
    if entry is None:
        with _DATA_FILESYSTEMS_LOCK:
            entry = _DATA_FILESYSTEMS.get(key) if options is None else None
            if entry is None:
                inherited = [other for other in _DATA_FILESYSTEMS if other[0] != key[0]]
                parent = next((_DATA_FILESYSTEMS[other] for other in inherited if other[1] == protocol), None)
                wanted = dict(options) if options is not None else (
                    parent[1] if parent is not None else dict(_DATA_OPTIONS))
                fs, _ = open_filesystem(url, wanted)
                if options is None and parent is not None:
                    fs.dircache.update(parent[0].dircache)
                for other in inherited:  # the parent's clients are not this process's to use
                    del _DATA_FILESYSTEMS[other]
                entry = _DATA_FILESYSTEMS[key] = (fs, wanted)
    fs = entry[0]
    return fs, fs._strip_protocol(url)


def mtime_ns(info: dict[str, Any]) -> int:
    """An object's modification time in ns since the epoch, from fsspec's info (s3fs: LastModified)."""
    when = info.get("LastModified") or info.get("last_modified") or info.get("mtime") or info.get("created")
    if isinstance(when, _dt.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=_dt.timezone.utc)
        return (when - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)) // _dt.timedelta(microseconds=1) * 1000
    if isinstance(when, (int, float)):
        return int(when * 1e9)
    return 0


def url_stat(url: str) -> tuple[int, int]:
    """(size, mtime_ns) of the object at `url` (FileNotFoundError when there is none; OSError when it cannot be
    read, naming why)."""
    fs, path = data_filesystem(url)
    try:
        # From this run's listing where DATA was listed (each discovery lists afresh, dropping what the process
        # cached before), else one request. An object changed after the listing is not read as the listed one:
        # s3fs reads with If-Match on the listed ETag, and a changed object fails its read, naming it.
        info = fs.info(path)
    except OSError:
        raise
    except Exception as exc:  # botocore's credential errors are no OSError
        raise OSError(storage_problem(exc)) from None
    if info.get("type") == "directory":
        raise IsADirectoryError(url)
    return int(info.get("size") or 0), mtime_ns(info)


def url_sha256(url: str, block: int = 8 << 20) -> str:
    """sha256 of the object at `url`, streamed."""
    import hashlib

    digest = hashlib.sha256()
    with open_url(url, block) as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


READ_BLOCK = 4 << 20
"""Bytes per ranged GET of an object opened for reading (`open_url`): a small video is read whole by one."""
BLOCKS_KEPT = 8
"""Blocks a sequential reader of an object larger than one block keeps (`open_url(..., sequential=True)`), the
least recently read dropped first; the next block's GET runs in the background while the reader works through this
one (fsspec's BackgroundBlockCache). A video's index pass only demuxes, faster than blocks arrive, so it still waits
for each; its decode goes through the same bytes again and finds them here, decoding one block while the next is
fetched where it does not. Each block of a video up to 8 blocks (32 MiB) is fetched once per open; that is also the
most an open video holds. Closing it waits for a GET still under way (one round trip at most). 0: read ahead in the
foreground, as for a smaller object (every block waits for its GET)."""


@functools.cache
def _background_closes() -> bool:
    """Whether fsspec closes a BackgroundBlockCache with its file (2026.7 on): its fetch thread and blocks end with
    the file. An older fsspec keeps both until a garbage collection: there, read ahead in the foreground."""
    import fsspec.caching

    return "close" in vars(fsspec.caching.BackgroundBlockCache)


def open_url(url: str, block_size: int | None = None, held: HeldObjects | None = None, sequential: bool = False,
             read_cache: Callable[[int, Any, int], Any] | None = None, whole_if_small: bool = True) -> Any:
    """The object at `url` as a seekable binary file (what av.open takes): ranged GETs of `block_size` bytes
    (READ_BLOCK where not given) with read-ahead, so a reader of a tar's headers reads those, not the whole object.
    An object `held` holds is read from those bytes, without a request, and no longer held. With `sequential` (a
    reader that goes through the object from front to back, seeking now and then: a video's index pass and its
    decode), an object larger than one block has its next block fetched while the current one is read
    (BLOCKS_KEPT). A reader that knows which bytes it will read gives `read_cache(block_size, fetcher, size)`, the
    fsspec read cache to read through (unless `whole_if_small` and the object fits one block: read whole)."""
    import fsspec.caching

    block_size = block_size or READ_BLOCK
    fs, path = data_filesystem(url)
    data = held.take(url) if held is not None else None
    try:
        if data is not None:
            handle = fs.open(path, "rb", block_size=block_size, cache_type="all", cache_options={"data": data})
            if handle.size == len(data):
                return handle
            handle.close()  # listed at another size: read it from the store, which refuses a changed object
        handle = fs.open(path, "rb", block_size=block_size, cache_type="readahead")
        if read_cache is not None and not (whole_if_small and handle.size <= block_size):  # nothing was read yet
            handle.cache = read_cache(block_size, handle._fetch_range, handle.size)
            return handle
        if (sequential and BLOCKS_KEPT and isinstance(getattr(handle, "cache", None), fsspec.caching.ReadAheadCache)
                and handle.size > block_size and _background_closes()):  # nothing was read yet: no request lost
            handle.cache = fsspec.caching.BackgroundBlockCache(block_size, handle._fetch_range, handle.size,
                                                               maxblocks=BLOCKS_KEPT)
        return handle
    except OSError:
        raise
    except Exception as exc:  # botocore's credential errors are no OSError
        raise OSError(storage_problem(exc)) from None


def whole_object(handle: Any) -> bytes | None:
    """The whole object an open file from `open_url` has read ahead (an object no bigger than one read-ahead block,
    read from its start), taken from its cache without a request; None where it holds less."""
    import fsspec.caching

    cache = getattr(handle, "cache", None)
    size = getattr(handle, "size", None)
    if not isinstance(cache, fsspec.caching.ReadAheadCache) or not size or cache.start != 0 or cache.end < size:
        return None
    return bytes(cache.cache[:size])


def open_location(location: Any, block_size: int = 4 << 20) -> Any:
    """A local file or an object at a URL, opened for binary reading."""
    return open_url(str(location), block_size) if is_url(str(location)) else open(location, "rb")


def location_stat(location: Any) -> tuple[int, int]:
    """(size, mtime_ns) of a local file or of an object at a URL (OSError when it cannot be read)."""
    if is_url(str(location)):
        return url_stat(str(location))
    found = os.stat(location)
    return found.st_size, found.st_mtime_ns


def url_children(url: str) -> dict[str, tuple[int, int]]:
    """URL -> (size, mtime_ns) of every object right under the prefix `url` (from the run's listing of DATA where
    it was listed, else one listing)."""
    fs, path = data_filesystem(url)
    try:
        found = fs.ls(path.rstrip("/"), detail=True)
    except FileNotFoundError:
        return {}
    except Exception as exc:
        raise OSError(storage_problem(exc)) from None
    scheme = url.split("://", 1)[0]
    return {f"{scheme}://{info['name']}": (int(info.get("size") or 0), mtime_ns(info)) for info in found
            if info.get("type", "file") != "directory"}


def url_glob(pattern: str) -> list[str]:
    """The URLs of the objects matching a glob pattern (``s3://b/cam/*.jpg``)."""
    fs, path = data_filesystem(pattern)
    scheme = pattern.split("://", 1)[0]
    try:
        fs.invalidate_cache()
        return [f"{scheme}://{found}" for found in fs.glob(path)]
    except Exception as exc:
        raise OSError(storage_problem(exc)) from None


def read_location(location: Any) -> bytes:
    """The whole bytes of a local file or of an object at a URL (one GET): a frame, a small table."""
    if not is_url(str(location)):
        return Path(location).read_bytes()
    fs, path = data_filesystem(str(location))
    try:
        return fs.cat_file(path)
    except OSError:
        raise
    except Exception as exc:
        raise OSError(storage_problem(exc)) from None

