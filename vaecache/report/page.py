"""The report's index.html, rendered from templates/report.html.j2 by Jinja2 with autoescaping on: every value a
section holds (captions, file names, reasons, camera names: user data) is HTML-escaped unless the template marks it
otherwise, and it marks nothing so. No script, no style sheet, font or image from elsewhere: the page's one
Content-Security-Policy allows none (`default-src 'none'`), so it opens from disk and from static hosting alike.

Why Jinja2 (a declared dependency of the `report` extra) and not `string.Template` + `html.escape`: escaping is the
default of every substitution, loops and conditions stay in the template instead of HTML assembled in Python, and
StrictUndefined turns a misspelt field into an error rather than an empty cell."""

from __future__ import annotations

import math
from typing import Any

from vaecache.errors import MissingExtraError

TEMPLATE = "report.html.j2"


def require_jinja2() -> None:
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise MissingExtraError("vaecache report renders its page with Jinja2, which is not installed: "
                                "pip install 'vaecache[report]'") from None


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


def number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render_page(summary: dict[str, Any], **sections: Any) -> str:
    """index.html for the report `summary` (what report.json holds) and its `sections` (the objects the builders
    returned)."""
    import jinja2

    environment = jinja2.Environment(loader=jinja2.PackageLoader("vaecache.report", "templates"), autoescape=True,
                                     undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    environment.filters["bytes"] = human_bytes
    environment.filters["number"] = number
    return environment.get_template(TEMPLATE).render(summary=summary, **sections)


__all__ = ["human_bytes", "number", "render_page", "require_jinja2"]
