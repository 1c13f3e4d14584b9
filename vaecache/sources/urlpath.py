"""DATA at a URL (``s3://bucket/videos``), walked by the layouts like a local folder: a `UrlPath` answers the
pathlib questions they ask (is_dir, iterdir, stat, read_text, ...) from one listing of DATA taken at start, and
reads an object only when its bytes are asked for. Sources found this way are named by their URLs; the readers
open them with ranged reads (vaecache.storage.open_url)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Iterator

from vaecache.errors import DatasetError
from vaecache.storage import data_filesystem, mtime_ns, storage_problem
from vaecache.urls import Url


@dataclass(frozen=True)
class ObjectStat:
    """What a layout reads of os.stat_result: size and modification time."""

    st_size: int
    st_mtime_ns: int


class UrlListing:
    """Every object under DATA's URL (keys relative to it) with its size and mtime, and the folders their keys
    imply; listed once, when first asked (reading an object by name lists nothing)."""

    def __init__(self, url: Url, storage_options: tuple[tuple[str, Any], ...] | None = None) -> None:
        """`storage_options`: the fsspec options DATA is listed and read with, in this process and the ones forked
        from it (None: those it was given before: storage.data_filesystem)."""
        self.url = url
        self.fs, self.root = data_filesystem(url, dict(storage_options) if storage_options is not None else None)
        self.root = self.root.rstrip("/")
        self._files: dict[str, ObjectStat] | None = None
        self._folders: set[str] = {""}
        self._children: dict[str, set[str]] = {}
        """Folder key -> the keys right under it (a million objects are walked without rescanning them)."""

    @property
    def files(self) -> dict[str, ObjectStat]:
        if self._files is None:
            self._list()
        return self._files  # type: ignore[return-value]

    @property
    def folders(self) -> set[str]:
        if self._files is None:
            self._list()
        return self._folders

    def _list(self) -> None:
        url = self.url
        try:
            self.fs.invalidate_cache()  # what this process listed or opened before may have changed since
            found = self.fs.find(self.root, detail=True, withdirs=False)
            if not found and self.fs.isfile(self.root):  # DATA names one object (an index, a table)
                found = {self.root: self.fs.info(self.root)}
        except FileNotFoundError:
            found = {}
        except Exception as exc:
            raise DatasetError(f"{url}: cannot list ({storage_problem(exc)})") from None
        self._files = {}
        start = len(self.root) + 1
        for path, info in found.items():
            if info.get("type", "file") == "directory":
                continue
            key = "" if path == self.root else path[start:]
            self._files[key] = ObjectStat(int(info.get("size") or 0), mtime_ns(info))
            parts = key.split("/") if key else []  # "": DATA names this one object
            for depth in range(1, len(parts) + 1):
                child, parent = "/".join(parts[:depth]), "/".join(parts[:depth - 1])
                if depth < len(parts):
                    self._folders.add(child)
                self._children.setdefault(parent, set()).add(child)

    def children(self, key: str) -> list[str]:
        if self._files is None:
            self._list()
        return sorted(self._children.get(key, ()))


class UrlPath:
    """A path under DATA's URL with the pathlib interface the layouts use. Never a local path: it has no
    __fspath__, so a layout that would open it as a file fails loudly instead of reading something else."""

    def __init__(self, url: str, listing: UrlListing | None = None, key: str = "",
                 storage_options: tuple[tuple[str, Any], ...] | None = None) -> None:
        self._listing = (listing if listing is not None
                         else UrlListing(Url(str(url).rstrip("/")), storage_options))
        self._key = key.strip("/")

    # --- naming ------------------------------------------------------------------------------------------------

    def __str__(self) -> str:
        return str(self._listing.url / self._key) if self._key else str(self._listing.url)

    def __repr__(self) -> str:
        return f"UrlPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UrlPath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: UrlPath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str) -> UrlPath:
        return UrlPath("", self._listing, posixpath.join(self._key, str(name)) if self._key else str(name))

    @property
    def name(self) -> str:
        return self._key.rsplit("/", 1)[-1] if self._key else self._listing.url.name

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def suffixes(self) -> list[str]:
        name = self.name.lstrip(".")
        return ["." + part for part in name.split(".")[1:]]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> UrlPath:
        if not self._key:
            raise DatasetError(f"{self}: the parent of DATA's URL is not read")
        return UrlPath("", self._listing, self._key.rpartition("/")[0])

    def with_suffix(self, suffix: str) -> UrlPath:
        return self.parent / (self.stem + suffix) if self._key else UrlPath(str(self)[: -len(self.suffix)] + suffix)

    def resolve(self) -> UrlPath:
        return self

    def absolute(self) -> UrlPath:
        return self

    def expanduser(self) -> UrlPath:
        return self

    # --- what is there -------------------------------------------------------------------------------------------

    def exists(self) -> bool:
        if not self._key:  # DATA itself: a prefix is there when some object is under it
            return bool(self._listing.files)
        return self._key in self._listing.files or self._key in self._listing.folders

    def is_file(self) -> bool:
        return self._key in self._listing.files

    def is_dir(self) -> bool:
        return self.exists() and self._key in self._listing.folders and self._key not in self._listing.files

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[UrlPath]:
        if not self.is_dir():
            raise NotADirectoryError(str(self))
        return iter([UrlPath("", self._listing, key) for key in self._listing.children(self._key)])

    def glob(self, pattern: str) -> Iterator[UrlPath]:
        """The paths under this one matching `pattern`, one name pattern per level (``*/*.parquet``)."""
        import fnmatch

        head, _, rest = pattern.partition("/")
        found = [child for child in self.iterdir() if fnmatch.fnmatchcase(child.name, head)]
        if not rest:
            return iter(found)
        return iter([deeper for child in found if child.is_dir() for deeper in child.glob(rest)])

    def stat(self) -> ObjectStat:
        found = self._listing.files.get(self._key)
        if found is None:
            raise FileNotFoundError(str(self))
        return found

    # --- bytes -----------------------------------------------------------------------------------------------------

    def read_bytes(self) -> bytes:
        try:
            return self._listing.fs.cat_file(self._object())
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise OSError(storage_problem(exc)) from None

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def open(self, mode: str = "rb", **kwargs: Any) -> Any:
        """The object as a binary file read by ranged GETs ("rb"), or as text ("r", `encoding`)."""
        if mode not in ("r", "rb"):
            raise ValueError(f"{self}: objects are opened for reading only")
        import io

        handle = self._listing.fs.open(self._object(), "rb", block_size=4 << 20, cache_type="readahead")
        return handle if mode == "rb" else io.TextIOWrapper(handle, encoding=kwargs.get("encoding", "utf-8"))

    def _object(self) -> str:
        return f"{self._listing.root}/{self._key}" if self._key else self._listing.root


__all__ = ["UrlListing", "ObjectStat", "UrlPath"]
