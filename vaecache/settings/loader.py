"""Settings from flags over a TOML file."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints
from vaecache.settings.buckets import parse_lengths, parse_sizes
from vaecache.errors import UsageError
from vaecache.settings.clip import ClipSettings, DEFAULT_MAX_FRAME_PIXELS, SamplingConfig, parse_views_per_forward
from vaecache.settings.commands import EncodeConfig
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def parse_bytes(text: str | int) -> int:
    """'256MiB', '1GB', '5000' -> bytes."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT]i?)B?|B)?\s*", text, flags=re.IGNORECASE)
        if not match:
            raise UsageError(f"--shard-size must be a byte count like 256MiB or 1GB, got {text!r}")
        unit = (match.group(2) or "").upper()
        scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                 "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
        value = int(float(match.group(1)) * scale)
    if value < 1:
        raise UsageError(f"--shard-size must be at least 1 byte, got {text!r}")
    return value


_CLIP_KEYS = ("dtype", "store", "seed", "tiling", "compiled", "channels_last", "views_per_forward", "fit", "decoder")
"""ClipSettings fields given as options of their own (the rest come from size, cameras and the sampling keys)."""


def check_option_syntax(merged: dict[str, Any]) -> None:
    """Refuse a malformed --size or --num-frames list first, as a typed option's parser would (before the
    checks of missing options)."""
    if "size" in merged:
        parse_sizes(merged["size"])
    if "num_frames" in merged:
        parse_lengths(merged["num_frames"])


def pop_clip_options(merged: dict[str, Any]) -> ClipSettings:
    """Take the clip settings shared by encode and plan out of merged CLI/TOML settings."""
    if "num_frames" not in merged:
        raise UsageError("--num-frames is required (frames per clip, e.g. 17 for Wan-style 1+4k VAEs)")
    if "size" not in merged:
        raise UsageError("--size HxW is required (e.g. 480x832)")
    sizes = parse_sizes(merged.pop("size"))
    lengths = parse_lengths(merged.pop("num_frames"))
    sampling = SamplingConfig(
        num_frames=lengths[0],
        frame_stride=int(merged.pop("frame_stride", 1)),
        window_stride=merged.pop("window_stride", None),
        max_clips_per_scene=merged.pop("max_clips_per_scene", None),
        frame_buckets=lengths if len(lengths) > 1 else (),
        frames_policy=merged.pop("frames_policy", "longest"),
        max_frame_pixels=merged.pop("max_frame_pixels", DEFAULT_MAX_FRAME_PIXELS),
    )
    (height, width) = sizes[0]
    cameras = merged.pop("cameras", None)
    if isinstance(cameras, str):
        cameras = tuple(c.strip() for c in cameras.split(",") if c.strip())
    elif cameras is not None:
        cameras = tuple(cameras)
    options = {key: merged.pop(key) for key in _CLIP_KEYS if key in merged}
    if "views_per_forward" in options:
        options["views_per_forward"] = parse_views_per_forward(options["views_per_forward"])
    return ClipSettings(sampling=sampling, height=height, width=width, cameras=cameras,
                        size_buckets=sizes if len(sizes) > 1 else (), **options)


def load_toml(path: Path) -> dict[str, Any]:
    """Read a config file whose keys are the long CLI option names (dashes or underscores)."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    section = raw.get("encode", raw)
    # height and width come from "size", the sampling fields from their own keys
    known = ({f.name for f in fields(EncodeConfig)} - {"clip"} | {f.name for f in fields(ClipSettings)}
             - {"sampling", "height", "width", "size_buckets"} | {f.name for f in fields(SamplingConfig)}
             - {"frame_buckets"} | {"size"})
    normalized = {_TOML_ALIASES.get(key.replace("-", "_"), key.replace("-", "_")): value for key, value in section.items()}
    unknown = sorted(set(normalized) - known)
    if unknown:
        raise UsageError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    for key, value in normalized.items():
        allowed = _toml_types(key)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise UsageError(f"{path}: {key} = {value!r} must be {' or '.join(t.__name__ for t in allowed)}")
        item = _TOML_LIST_ITEMS.get(key)
        if item is not None and isinstance(value, list) and not all(type(v) is item for v in value):
            raise UsageError(f"{path}: {key} = {value!r} must be {item.__name__} or a list of {item.__name__}")
    return normalized


_TOML_LIST_ITEMS = {"size": str, "num_frames": int, "cameras": str}
"""Settings that take a TOML list, and the type of its items (size = ["480x832", "wan-480p"], num_frames = [17, 33])."""


_TOML_ALIASES = {"timeout": "timeout_s", "liveness_timeout": "liveness_timeout_s", "compile": "compiled"}
"""Option names whose config field is spelled differently (--timeout sets timeout_s)."""


def _toml_types(key: str) -> tuple[type, ...]:
    """The TOML value types a setting accepts, from the config dataclasses' annotations."""
    special = {"size": (str, list), "num_frames": (int, str, list), "data": (str,), "out": (str,),
               "shard_size": (int, str), "cameras": (str, list), "views_per_forward": (int, str)}
    if key in special:
        return special[key]
    hint = {**get_type_hints(SamplingConfig), **get_type_hints(ClipSettings), **get_type_hints(EncodeConfig)}[key]
    allowed: list[type] = []
    for arg in get_args(hint) or (hint,):
        arg = get_origin(arg) or arg
        allowed += {float: [int, float], Path: [str], tuple: [list], type(None): []}.get(arg, [arg])
    return tuple(allowed)
