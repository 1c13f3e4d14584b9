"""Locations that are URLs (object storage through fsspec) rather than local paths; light: the CLI imports it."""

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


def location(value: Any) -> Path | Url:
    """A --out (or a command's cache argument) as given: a Url for ``s3://...`` (never a Path, which would fold
    its '//'), else a Path."""
    text = str(value)
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
