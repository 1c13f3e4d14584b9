"""Locations that are URLs (object storage through fsspec) rather than local paths, and opening them: the
filesystem of a URL, its errors in one line, a source object's size and mtime, the object as a file, and the small
objects a process read whole held for their next open. Light (the CLI imports it): fsspec is imported only to open
a URL."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Collection


def is_url(location: object) -> bool:
    """A location fsspec must open (``s3://bucket/key``); local paths and ``file://`` are read as files."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


class Url(str):
    """A URL that joins like a path in messages (``url / "manifest.json"``)."""

    def __truediv__(self, other: object) -> Url:
        return Url(f"{self.rstrip('/')}/{other}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]


def url_join(base: str, relative: str) -> str:
    """`relative` (a path in an index or table at a URL) resolved against the URL of the folder `base`; a URL is
    kept as it is."""
    import posixpath

    if is_url(relative):
        return relative
    scheme, _, rest = base.partition("://")
    return f"{scheme}://{posixpath.normpath(posixpath.join(rest, relative))}"


def folder_of(location: Any) -> str:
    """The folder a file (an index, a table) lies in, resolved: a local path's, or a URL's prefix."""
    if is_url(str(location)):
        return str(location).rstrip("/").rsplit("/", 1)[0]
    return str(Path(location).resolve().parent)


def location(value: Any) -> Path | Url:
    """A --out (or a command's cache argument) as given: a Url for ``s3://...`` (never a Path, which would fold
    its '//'), a Path for a local path or a ``file:///path`` URL (RFC 8089: its path, %-escapes decoded)."""
    if isinstance(value, Path):
        return value
    text = str(value)
    if text.startswith("file://"):
        import urllib.parse

        parts = urllib.parse.urlsplit(text)
        if parts.netloc not in ("", "localhost") or not parts.path:
            from vaecache.errors import UsageError

            raise UsageError(f"{text}: a file:// URL names a path on this machine (file:///abs/path), not "
                             f"{parts.netloc or 'an empty path'}")
        return Path(urllib.parse.unquote(parts.path))
    return Url(text.rstrip("/")) if is_url(text) else Path(text)


def parse_storage_options(values: str | list[str] | dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """--storage-option KEY=VALUE[,KEY=VALUE...] (repeatable, or a TOML list or table) -> ((key, value), ...) for
    fsspec. A value that parses as JSON (true, 8, "x") is taken as that JSON value, any other as text."""
    import json

    from vaecache.errors import UsageError

    if values is None:
        return ()
    if isinstance(values, dict):
        return tuple(sorted(values.items()))
    items = [values] if isinstance(values, str) else list(values)
    found: dict[str, Any] = {}
    for item in (part.strip() for value in items for part in str(value).split(",")):
        if not item:
            continue
        key, sep, text = (piece.strip() for piece in item.partition("="))
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE (e.g. anon=true), got {item!r}")
        try:
            found[key] = json.loads(text)
        except ValueError:
            found[key] = text
    return tuple(sorted(found.items()))


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
             planned: list[tuple[int, int]] | None = None, whole_if_small: bool = True) -> Any:
    """The object at `url` as a seekable binary file (what av.open takes): ranged GETs of `block_size` bytes
    (READ_BLOCK where not given) with read-ahead, so a reader of a tar's headers reads those, not the whole object.
    An object `held` holds is read from those bytes, without a request, and no longer held. With `sequential` (a
    reader that goes through the object from front to back, seeking now and then: a video's index pass and its
    decode), an object larger than one block has its next block fetched while the current one is read
    (BLOCKS_KEPT)."""
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
        if planned is not None and not (whole_if_small and handle.size <= block_size):  # nothing was read yet
            handle.cache = PlannedReads(block_size, handle._fetch_range, handle.size, planned)
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


PLANNED_READ_AHEAD = 16 << 10
"""The least a PlannedReads fetches past a read outside its plan (the decoder's look-ahead past a clip's GOPs); more
where the object's frames are larger (PlannedReads.read_ahead)."""


class PlannedReads:
    """The read cache (fsspec's interface: `_fetch`) of an object whose reader knows which bytes it will read: the
    container's header and index (`planned` at open), then each clip's GOPs (`plan`, before the clip is decoded).

    A read inside a planned range fetches the rest of that range, up to `blocksize` bytes per GET; a read outside
    every planned range fetches `read_ahead` bytes past it. Fetched bytes are kept, at most BLOCKS_KEPT
    blocks' worth, the oldest dropped first, so a clip decoded again, or the container reopened, reads no byte twice
    while they last. `fetches` counts the GETs and `fetched_bytes` their bytes."""

    name = "vaecache-planned"

    def __init__(self, blocksize: int, fetcher: Any, size: int, planned: Collection[tuple[int, int]] = ()) -> None:
        self.blocksize, self.fetcher, self.size = blocksize, fetcher, size
        self.hit_count = self.miss_count = self.fetches = self.fetched_bytes = 0
        self.read_ahead = PLANNED_READ_AHEAD
        """Bytes fetched past a read outside the plan (at least)."""
        self._planned: list[tuple[int, int]] = []
        self._pieces: list[tuple[int, bytes]] = []  # (start, bytes), sorted by start, never overlapping
        self._order: list[int] = []  # piece starts, oldest first
        self._kept = 0
        for start, end in planned:
            self.plan(start, end)

    def plan(self, start: int, end: int) -> None:
        """Bytes [start, end) will be read."""
        from vaecache.video.timeline import merged

        self._planned = merged([*self._planned, (max(0, start), min(self.size, end))])

    def fetch_planned(self) -> None:
        """GET every planned range not kept yet (up to a block of each) side by side: one round trip, not one per
        range (a container's header at its start and its index at its end)."""
        from concurrent.futures import ThreadPoolExecutor

        wanted = [(start, min(end, start + self.blocksize, self._next_kept(start))) for start, end in self._planned
                  if not self._piece_at(start)[1]]
        if len(wanted) < 2:
            return
        with ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="vaecache-ranges") as pool:
            found = list(pool.map(lambda part: self.fetcher(*part), wanted))
        for (start, _), data in zip(wanted, found):
            if data:
                self.fetches += 1
                self.fetched_bytes += len(data)
                self._keep(start, data)

    def _piece_at(self, position: int) -> tuple[int, bool]:
        """(index of the last kept piece starting at or before `position`, -1 for none; whether it holds it)."""
        import bisect

        index = bisect.bisect_right(self._pieces, position, key=lambda piece: piece[0]) - 1
        return index, index >= 0 and position < self._pieces[index][0] + len(self._pieces[index][1])

    def _next_kept(self, position: int) -> int:
        """Where the first kept piece after `position` starts (the object's size: none)."""
        index = self._piece_at(position)[0] + 1
        return self._pieces[index][0] if index < len(self._pieces) else self.size

    def _fetch(self, start: int | None, stop: int | None) -> bytes:
        start = 0 if start is None else start
        stop = self.size if stop is None else min(stop, self.size)
        if start >= stop:
            return b""
        out = bytearray()
        position = start
        missed = False
        while position < stop:
            index, kept = self._piece_at(position)
            if kept:
                piece_start, data = self._pieces[index]
                take = data[position - piece_start: stop - piece_start]
                out += take
                position += len(take)
                continue
            missed = True
            following = self._pieces[index + 1][0] if index + 1 < len(self._pieces) else self.size
            end = self._fetch_end(position, stop, following)
            data = self.fetcher(position, end)
            if not data:
                break
            self.fetches += 1
            self.fetched_bytes += len(data)
            self._keep(position, data)
        self.miss_count += missed
        self.hit_count += not missed
        return bytes(out)

    def _fetch_end(self, position: int, stop: int, following: int) -> int:
        """Where a GET from `position` ends: the planned range's end (a block at most), or a read-ahead past `stop`
        (up to the next planned range); never past the next kept piece."""
        import bisect

        index = bisect.bisect_right(self._planned, position, key=lambda part: part[0]) - 1
        if index >= 0 and position < self._planned[index][1]:
            end = max(stop, min(self._planned[index][1], position + self.blocksize))
        else:  # up to the next planned range at most: that one is fetched whole by its own GET
            planned = self._planned[index + 1][0] if index + 1 < len(self._planned) else self.size
            end = max(stop, min(position + self.read_ahead, planned))
        return min(end, following, self.size)

    def _keep(self, start: int, data: bytes) -> None:
        import bisect

        bisect.insort(self._pieces, (start, data), key=lambda piece: piece[0])
        self._order.append(start)
        self._kept += len(data)
        while self._kept > BLOCKS_KEPT * self.blocksize and len(self._order) > 1:
            oldest = self._order.pop(0)
            index = bisect.bisect_left(self._pieces, oldest, key=lambda piece: piece[0])
            self._kept -= len(self._pieces.pop(index)[1])

    def _log_stats(self) -> str:
        return f" , {self.name}: {self.fetches} GETs, {self.fetched_bytes} bytes"


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

