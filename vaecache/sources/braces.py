"""Brace patterns as WebDataset names its shards (`shards/data-{000000..000999}.tar`, expanded by the `braceexpand`
package webdataset depends on): `{a..b}` is a range of integers (zero-padded to the width of the wider end when either
end is written with a leading zero), `{x,y,z}` alternatives; several groups multiply, left to right. Pure, and light
enough for the CLI to import."""

from __future__ import annotations

import re

_GROUP = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
MAX_EXPANSION = 10_000_000


def is_brace_pattern(text: str) -> bool:
    """Whether `text` holds a group to expand ({a..b} or {x,y})."""
    return any(_RANGE.match(group) or "," in group for group in _GROUP.findall(text))


def _choices(group: str) -> list[str]:
    found = _RANGE.match(group)
    if found is None:
        return group.split(",") if "," in group else ["{" + group + "}"]
    low_text, high_text = found.groups()
    low, high = int(low_text), int(high_text)
    padded = any(len(t.lstrip("-")) > 1 and t.lstrip("-").startswith("0") for t in (low_text, high_text))
    width = max(len(low_text), len(high_text)) if padded else 0
    step = 1 if high >= low else -1
    if abs(high - low) + 1 > MAX_EXPANSION:
        raise ValueError(f"{{{group}}} expands to more than {MAX_EXPANSION} names")
    return [str(n).zfill(width) for n in range(low, high + step, step)]


def expand_braces(pattern: str) -> list[str]:
    """Every name `pattern` stands for, in order (a pattern without groups: itself)."""
    found = next((m for m in _GROUP.finditer(pattern) if _RANGE.match(m.group(1)) or "," in m.group(1)), None)
    if found is None:
        return [pattern]
    head, tail = pattern[:found.start()], pattern[found.end():]
    rests = expand_braces(tail)
    names = [head + choice + rest for choice in _choices(found.group(1)) for rest in rests]
    if len(names) > MAX_EXPANSION:
        raise ValueError(f"{pattern} expands to more than {MAX_EXPANSION} names")
    return names
