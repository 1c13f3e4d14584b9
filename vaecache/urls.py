"""Locations that are URLs (object storage) rather than local paths, as values: telling one from a path, joining
and naming them, a --out as given, --storage-option parsed. Pure and light (the CLI imports it); opening a URL is
vaecache.storage's."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
