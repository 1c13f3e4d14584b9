"""How two records differ, named key by key (a fingerprint a resume would change, another rank's numerics, a set's
recorded encoder against the one given): one line per difference, nested keys dotted."""

from __future__ import annotations

import json
from typing import Any


def describe_differences(recorded: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """`key: old -> new` for each key whose value differs (recursing into dicts), sorted by key."""
    diffs = []
    for key in sorted(set(recorded) | set(wanted)):
        old, new = recorded.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            diffs.extend(describe_differences(old, new, f"{prefix}{key}."))
        elif old != new:
            diffs.append(f"{prefix}{key}: {_short(old)} -> {_short(new)}")
    return diffs


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
