"""Where a cache lies: one small set of operations over OUT, on a local folder or in object storage (``s3://`` and
any fsspec URL), chosen once from OUT by `open_store` (light: no torch until a tensor is read). Everything that
reads a cache (the reader, verify, inspect, the exports) goes through a store and does not know which one it holds.

Names are paths relative to OUT with ``/`` separators (``manifest.json``, ``shards/a000-r00000-000000.safetensors``).
A name that is not there raises FileNotFoundError; any other failure is an OutputError naming the object and the
problem. What the two stores do differently is what each is good at: a local store writes through a temp file,
fsync and rename, refuses a name that leads out of OUT through a symlink, and opens shards memory-mapped; an object
store PUTs whole objects (one PUT is atomic), creates write-once with ``If-None-Match: *`` and reads shards by byte
ranges. How a writer commits on each (an fsynced append-only progress log on disk, one commit record per shard in
object storage) is the commit protocol's (vaecache.cache.commits), not the store's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from vaecache.cache import io as cache_io
from vaecache.cache.io import atomic_write_bytes
from vaecache.cache.layout import inside, relative_inside
from vaecache.cache.ranged import SAFETENSORS_DTYPES, RangedShard
from vaecache.errors import OutputError, ShardHeaderError, UsageError
from vaecache.storage import open_filesystem, storage_problem
from vaecache.urls import Url, location


class Store:
    """OUT's objects. `location` is OUT as the user named it (a Path or a Url), for messages."""

    location: Any
    local: bool
    """Whether OUT is a folder on this machine (`folder` is then that folder)."""

    def where(self, name: str = "") -> Any:
        """OUT/name, for messages (a Path or a Url)."""
        return self.location / name if name else self.location

    def __str__(self) -> str:
        return str(self.location)

    # The operations each store implements.
    def read(self, name: str) -> bytes: raise NotImplementedError
    def read_range(self, name: str, start: int, end: int) -> bytes: raise NotImplementedError
    def open(self, name: str) -> BinaryIO: raise NotImplementedError
    def size(self, name: str) -> int: raise NotImplementedError
    def listing(self, folder: str) -> dict[str, int]: raise NotImplementedError
    def write(self, name: str, data: bytes) -> None: raise NotImplementedError
    def create(self, name: str, data: bytes) -> None: raise NotImplementedError
    def delete(self, names: Iterable[str]) -> None: raise NotImplementedError
    def shard(self, name: str) -> Any: raise NotImplementedError

    def check_present(self) -> None:
        """Refuse (UsageError) an OUT that cannot be a cache at all: a local path that is not a folder. A URL's
        bucket and prefix are checked by what reads them."""

    def read_if_present(self, name: str) -> bytes | None:
        """An object's bytes; None when there is none."""
        try:
            return self.read(name)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except FileNotFoundError:
            return False
        return True

    def sha256(self, name: str, block: int = 8 << 20) -> str:
        digest = hashlib.sha256()
        with self.open(name) as handle:
            while chunk := handle.read(block):
                digest.update(chunk)
        return digest.hexdigest()

    def checked_name(self, name: object, what: str) -> str:
        """`name` as a manifest or clip table names an object, refused (UnsafePathError naming `what`) unless it
        stays in OUT."""
        return relative_inside(self.location, name, what)

    def table_source(self, name: str) -> Any:
        """What pyarrow reads table `name` from: an open object (a folder's store gives its path)."""
        return self.open(name)


class LocalStore(Store):
    """OUT as a folder: atomic writes by temp file, fsync and rename; names refused that lead out through a
    symlink; shards memory-mapped by safetensors."""

    local = True

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        self.location = self.folder

    def check_present(self) -> None:
        if not self.folder.exists():
            raise UsageError(f"{self.folder}: no such folder")
        if not self.folder.is_dir():
            raise UsageError(f"{self.folder}: not a folder")

    def path(self, name: str) -> Path:
        """OUT/name, refused (UnsafePathError) when it would lie outside OUT."""
        return inside(self.folder, name, str(self.folder / name))

    def checked_name(self, name: object, what: str) -> str:
        """As Store.checked_name, and not leading out of OUT through a symlink either."""
        inside(self.folder, name, what)
        return str(name)

    def table_source(self, name: str) -> Any:
        return self.path(name)

    def _error(self, name: str, what: str, exc: OSError) -> OutputError:
        return OutputError(f"{self.folder / name}: cannot {what} ({exc.strerror or exc})")

    def read(self, name: str) -> bytes:
        try:
            return self.path(name).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(str(self.folder / name)) from None
        except OSError as exc:
            raise self._error(name, "read", exc) from None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with self.open(name) as handle:
            handle.seek(start)
            return handle.read(max(0, end - start))

    def open(self, name: str) -> BinaryIO:
        try:
            return open(self.path(name), "rb")
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._error(name, "read", exc) from None

    def size(self, name: str) -> int:
        path = self.path(name)
        try:
            if not path.is_file():
                raise FileNotFoundError(str(path))
            return path.stat().st_size
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._error(name, "stat", exc) from None

    def listing(self, folder: str) -> dict[str, int]:
        """Every file under OUT/folder (recursively), by name, with its byte count."""
        root = self.folder / folder
        found: dict[str, int] = {}
        if not root.is_dir():
            return found
        for parent, _, files in os.walk(root):
            for file in files:
                path = Path(parent) / file
                try:
                    found[path.relative_to(self.folder).as_posix()] = path.stat().st_size
                except FileNotFoundError:  # deleted while listed
                    continue
        return found

    def write(self, name: str, data: bytes) -> None:
        self._write(name, data, exclusive=False)

    def create(self, name: str, data: bytes) -> None:
        """Write `name` whole, only where no such file exists (FileExistsError otherwise)."""
        self._write(name, data, exclusive=True)

    def _write(self, name: str, data: bytes, exclusive: bool) -> None:
        path = self.folder / relative_inside(self.folder, name, str(self.folder / name))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error(name, "write", exc) from None
        atomic_write_bytes(path, data, exclusive=exclusive)

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                (self.folder / relative_inside(self.folder, name, str(self.folder / name))).unlink(missing_ok=True)
            except OSError as exc:
                raise self._error(name, "delete", exc) from None

    def sha256(self, name: str, block: int = 8 << 20) -> str:
        return cache_io.sha256_file(self.path(name), block)

    def shard(self, name: str) -> Any:
        """safetensors' own handle on the shard, memory-mapped (``get_tensor``, ``keys``, ``get_slice``)."""
        from safetensors import SafetensorError, safe_open

        path = self.path(name)
        try:
            return safe_open(str(path), "pt")
        except (SafetensorError, OSError) as exc:
            raise ShardHeaderError(f"{path}: safetensors header does not parse ({exc})") from None


class ObjectStore(Store):
    """OUT at a URL (fsspec; S3 is the one tested, against a real S3-protocol server). Credentials and endpoint come
    the way every S3 tool takes them (the standard AWS environment and config files; ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL`` for a non-AWS store); ``storage_options`` go to fsspec for the rest. Every listing is made
    afresh (other ranks and jobs write here too)."""

    local = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = Url(str(url).rstrip("/"))
        self.location = self.url
        self.storage_options = dict(storage_options or {})
        self.fs, root = open_filesystem(self.url, self.storage_options)
        self.root = root.rstrip("/")
        self._listed: dict[str, int] | None = None
        """Inside `one_listing`: every object under OUT by name, from one listing, kept up to date with this
        process's own writes and deletes."""
        self._etags: dict[str, str] = {}
        """The ETag each object had when last listed, where the store gives one (`listed_etag`)."""

    @contextlib.contextmanager
    def one_listing(self, listed: dict[str, int] | None = None) -> Iterator[None]:
        """While the block runs, `listing`, `exists`, `entries` and the absence of an object are answered from one
        listing of OUT (one request per 1000 objects: `listed`, made by `list_all` since the last write by another
        process, or taken now) instead of a request each; this process's own writes and deletes update it. Only for
        a phase in which no other process writes OUT (rank 0 preparing OUT under its lock)."""
        self._listed = dict(listed) if listed is not None else self.list_all()
        try:
            yield
        finally:
            self._listed = None

    def list_all(self) -> dict[str, int]:
        """Every object under OUT by name, with its size (one request per 1000 objects)."""
        try:
            self.fs.invalidate_cache()
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._error("", "list", exc) from None
        return self._sizes(found)

    def _sizes(self, found: dict[str, dict[str, Any]]) -> dict[str, int]:
        """A detailed listing's objects by name with their sizes; the ETags it gives are kept (`listed_etag`)."""
        start = len(self.root) + 1
        sizes = {}
        for path, info in found.items():
            if info.get("type", "file") == "directory":
                continue
            name = path[start:]
            sizes[name] = int(info.get("size") or 0)
            etag = info.get("ETag") or info.get("etag")
            if isinstance(etag, str):
                self._etags[name] = etag.strip('"')
            else:
                self._etags.pop(name, None)
        return sizes

    def listed_etag(self, name: str) -> str | None:
        """The ETag object `name` had when OUT (or its folder) was last listed; None where the listing gave none or
        this process wrote or deleted it since. S3 makes it the MD5 of an object's bytes where one PUT wrote them and
        no KMS key encrypts them: then a copy of the bytes is known to be the object's without a GET."""
        return self._etags.get(name)

    def key(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    @property
    def bucket(self) -> str:
        return self.root.split("/", 1)[0]

    def _error(self, name: str, what: str, exc: BaseException) -> OutputError:
        return OutputError(f"{self.where(name)}: cannot {what} ({storage_problem(exc)})")

    def read(self, name: str) -> bytes:
        """One GET (a GET of bytes 0- : s3fs's whole-object read asks HEAD first, and a missing object costs a HEAD
        and a LIST)."""
        if self._listed is not None and name not in self._listed:
            raise FileNotFoundError(str(self.where(name)))
        try:
            return self.fs.cat_file(self.key(name), start=0)
        except FileNotFoundError:
            raise FileNotFoundError(str(self.where(name))) from None
        except Exception as exc:  # botocore's credential errors are no OSError
            if _empty_range(exc):
                return self._read_whole(name)
            raise self._error(name, "read", exc) from None

    def _read_whole(self, name: str) -> bytes:
        """An empty object (S3 answers a range of it with 416)."""
        try:
            return self.fs.cat_file(self.key(name))
        except FileNotFoundError:
            raise FileNotFoundError(str(self.where(name))) from None
        except Exception as exc:
            raise self._error(name, "read", exc) from None

    def read_many(self, names: Iterable[str]) -> dict[str, bytes]:
        """Objects' bytes, fetched concurrently (one GET each); a name whose object is gone is left out, any other
        error raised (a commit record that could not be read must never pass for one that is not there)."""
        names = [name for name in names if self._listed is None or name in self._listed]
        if not names:
            return {}
        try:
            found = self.fs.cat_ranges([self.key(name) for name in names], [0] * len(names), [None] * len(names),
                                       on_error="return")
        except Exception as exc:
            raise self._error(names[0], "read", exc) from None
        result = {}
        for name, data in zip(names, found):
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, BaseException):
                if not _empty_range(data):
                    raise self._error(name, "read", data)
                data = self._read_whole(name)
            result[name] = data
        return result

    def read_range(self, name: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self.key(name), start=start, end=end)
        except FileNotFoundError:
            raise FileNotFoundError(str(self.where(name))) from None
        except Exception as exc:
            raise self._error(name, "read", exc) from None

    def open(self, name: str, block_size: int = 8 << 20) -> BinaryIO:
        try:
            return self.fs.open(self.key(name), "rb", block_size=block_size)
        except FileNotFoundError:
            raise FileNotFoundError(str(self.where(name))) from None
        except Exception as exc:
            raise self._error(name, "read", exc) from None

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self.key(name)))
        except FileNotFoundError:
            raise FileNotFoundError(str(self.where(name))) from None
        except Exception as exc:
            raise self._error(name, "stat", exc) from None

    def exists(self, name: str) -> bool:
        if self._listed is not None:
            return name in self._listed
        try:
            return bool(self.fs.exists(self.key(name)))
        except Exception as exc:
            raise self._error(name, "stat", exc) from None

    def listing(self, folder: str) -> dict[str, int]:
        if self._listed is not None:
            prefix = f"{folder.rstrip('/')}/"
            return {name: size for name, size in self._listed.items() if name.startswith(prefix)}
        try:
            self.fs.invalidate_cache()
            found = self.fs.find(self.key(folder), detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._error(folder, "list", exc) from None
        return self._sizes(found)

    def entries(self) -> set[str]:
        """The names right under OUT's URL (objects and prefixes); FileNotFoundError when neither OUT's prefix nor
        its bucket holds anything."""
        if self._listed is not None:
            if not self._listed:
                raise FileNotFoundError(str(self.url))
            return {name.split("/", 1)[0] for name in self._listed}
        try:
            self.fs.invalidate_cache()
            return {path.rstrip("/").rsplit("/", 1)[-1] for path in self._top_level()}
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._error("", "list", exc) from None

    def _top_level(self) -> list[str]:
        """The paths right under OUT (FileNotFoundError where there are none). s3fs's `ls` of an empty prefix lists
        its parent too, to tell a missing prefix from an object of that name: a round trip more at the start of
        every run into a new OUT, which here would only be taken for an empty one. So the one-level listing that
        `ls` makes first (s3fs's `_lsdir`, s3fs/core.py) is asked alone where the filesystem has one."""
        lsdir = getattr(self.fs, "_lsdir", None)
        if lsdir is None or not getattr(self.fs, "async_impl", False):
            return self.fs.ls(self.root, detail=False)
        from fsspec.asyn import sync

        found = sync(self.fs.loop, lsdir, self.root, refresh=True)
        if not found:
            raise FileNotFoundError(str(self.url))
        return [info["name"] for info in found]

    def bucket_exists(self) -> bool:
        try:
            return bool(self.fs.exists(self.bucket))
        except Exception:
            return False

    def write(self, name: str, data: bytes) -> None:
        """PUT `data` as object `name` (a multipart upload past 100 MB, by s3fs)."""
        try:
            self.fs.pipe_file(self.key(name), data)
        except Exception as exc:
            raise self._error(name, "write", exc) from None
        self._note_written(name, data)

    def write_many(self, objects: dict[str, bytes]) -> None:
        """PUT several objects concurrently (each atomic; their order not)."""
        if not objects:
            return
        try:
            self.fs.pipe({self.key(name): data for name, data in objects.items()})
        except Exception as exc:
            raise self._error(next(iter(objects)), "write", exc) from None
        for name, data in objects.items():
            self._note_written(name, data)

    def _note_written(self, name: str, data: bytes) -> None:
        self._etags.pop(name, None)
        if self._listed is not None:
            self._listed[name] = len(data)

    def create(self, name: str, data: bytes) -> None:
        """PUT only where no such object exists (If-None-Match: *), else FileExistsError."""
        try:
            self.fs.pipe_file(self.key(name), data, mode="create")
        except FileExistsError:
            raise
        except Exception as exc:
            raise self._error(name, "write", exc) from None
        self._note_written(name, data)

    def delete(self, names: Iterable[str]) -> None:
        names = [name for name in names if self._listed is None or name in self._listed]
        if not names:
            return
        try:
            self.fs.rm([self.key(name) for name in names])
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(names[0], "delete", exc) from None
        for name in names:
            self._etags.pop(name, None)
        for name in names if self._listed is not None else ():
            self._listed.pop(name, None)

    def delete_tree(self, name: str) -> None:
        """Every object under `name`/ (and `name` itself)."""
        try:
            self.fs.rm(self.key(name), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(name, "delete", exc) from None
        self.fs.invalidate_cache()
        if self._listed is not None:
            for gone in [found for found in self._listed if found == name or found.startswith(f"{name}/")]:
                del self._listed[gone]

    def shard(self, name: str) -> RangedShard:
        return RangedShard(self, name)

    def read_tagged(self, name: str) -> tuple[bytes, str | None] | None:
        """An object's bytes and the ETag of exactly those bytes (s3fs reads them with If-Match on the ETag it opened
        the object with); None when the object is gone or changed while being read. The ETag is None on a store
        that gives none."""
        key = self.key(name)
        try:
            self.fs.invalidate_cache(key)
            with self.fs.open(key, "rb") as file:
                etag = (getattr(file, "details", None) or {}).get("ETag")
                return file.read(), etag
        except FileNotFoundError:
            return None
        except Exception as exc:
            if precondition_failed(exc):
                return None
            raise self._error(name, "read", exc) from None

    def replace_if(self, name: str, data: bytes, etag: str) -> bool:
        """PUT `data` only if the object is still the one read with `etag` (If-Match); False when it is not (replaced
        or deleted since). NotImplementedError where the store (or the client) cannot ask it."""
        try:
            self.fs.pipe_file(self.key(name), data, IfMatch=etag)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if precondition_failed(exc):
                return False
            if not_implemented(exc):
                raise NotImplementedError(storage_problem(exc)) from None
            raise self._error(name, "write", exc) from None
        return True


    def delete_if(self, name: str, etag: str) -> bool:
        """DELETE object `name` only if it is still the one read with `etag` (S3's DeleteObject If-Match); False when
        it is not (replaced or gone). NotImplementedError where the client cannot ask it (a filesystem without
        s3fs's request call)."""
        call = getattr(self.fs, "_call_s3", None)
        if call is None:
            raise NotImplementedError(f"{type(self.fs).__name__} cannot delete conditionally")
        from fsspec.asyn import sync

        bucket, _, key = self.key(name).partition("/")
        try:
            sync(self.fs.loop, call, "delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if precondition_failed(exc):
                return False
            if not_implemented(exc):
                raise NotImplementedError(storage_problem(exc)) from None
            raise self._error(name, "delete", exc) from None
        finally:
            self.fs.invalidate_cache(self.key(name))
        self._etags.pop(name, None)
        if self._listed is not None:
            self._listed.pop(name, None)
        return True


def _empty_range(exc: BaseException) -> bool:
    """Whether a read of bytes 0- failed only because the object is empty (416 Range Not Satisfiable)."""
    return isinstance(exc, OSError) and (exc.errno == errno.EINVAL or "not satisfiable" in str(exc).lower())


def precondition_failed(exc: BaseException) -> bool:
    """Whether a store refused a conditional request because the object changed: 412 PreconditionFailed, 409
    ConditionalRequestConflict (S3, for conditional writes racing), or s3fs's own ETag check (FileExpired)."""
    if type(exc).__name__ == "FileExpired":
        return True
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None) or {}
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def not_implemented(exc: BaseException) -> bool:
    """Whether a store answered that it does not implement a request (501 NotImplemented: s3fs raises ENOSYS), or the
    client cannot send it."""
    if type(exc).__name__ == "ParamValidationError" or type(exc.__cause__).__name__ == "ParamValidationError":
        return True  # a botocore from before PutObject took IfMatch: this client cannot ask it
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None) or {}
    return (getattr(exc, "errno", None) == errno.ENOSYS or (response.get("Error") or {}).get("Code") == "NotImplemented"
            or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 501)


def open_store(out: Any, storage_options: dict[str, Any] | None = None) -> Store:
    """The store OUT names: an object store for a URL (``s3://bucket/cache``), a local one for a path. The one place
    that asks which."""
    if isinstance(out, Store):
        return out
    where = store_location(out)
    return ObjectStore(where, storage_options) if isinstance(where, Url) else LocalStore(where)


def store_location(out: Any) -> Path | Url:
    """OUT as a Path or a Url, without opening anything (for objects that must cross processes as plain data)."""
    return location(out)


__all__ = ["LocalStore", "ObjectStore", "RangedShard", "SAFETENSORS_DTYPES", "Store", "open_store", "store_location"]
