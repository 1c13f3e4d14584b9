"""Every setting of `vaecache encode` and `vaecache plan`, declared once: its flag, the TOML key that may give it
instead, the value types TOML may hold, the settings field it sets, and which commands take it.

The CLI builds both commands' flags from this table (vaecache.cli.options) and the loader (vaecache.settings.loader)
reads a TOML file and the flags through it, so a flag cannot exist on one side only or drift between encode and plan.
A key of one command in a TOML file the other reads (a shared file) is accepted and does not apply there.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vaecache.errors import UsageError
from vaecache.urls import location, parse_storage_options

ENCODE, PLAN = "encode", "plan"
BOTH = frozenset({ENCODE, PLAN})
CACHE_COMMANDS = frozenset({"verify", "inspect", "export", "index"})
"""The other commands: they take their own flags, and from this table the ones they share (--storage-option)."""
DEFAULT_PROBE_WORKERS = 8
"""Threads probing videos in each rank (PyAV releases the GIL while FFmpeg demuxes): the default of encode's and
plan's --probe-workers and of index's --workers. Here, in the table the CLI loads to build its flags, so that
`vaecache index --help` shows it without loading the settings classes (vaecache.settings.commands re-exports it)."""


def parse_bytes(text: str | int, option: str = "--shard-size") -> int:
    """'256MiB', '1GB', '5000' -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT]i?)B?|B)?\s*", str(text), flags=re.IGNORECASE)
        if not match:
            raise UsageError(f"{option} must be a byte count like 256MiB or 1GB, got {text!r}")
        unit = (match.group(2) or "").upper()
        scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                 "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
        value = int(float(match.group(1)) * scale)
    if value < 1:
        raise UsageError(f"{option} must be at least 1 byte, got {text!r}")
    return value


def parse_cameras(value: str | list[str]) -> tuple[str, ...]:
    """'c, a ,b' or ["c", "a", "b"] -> ("c", "a", "b")."""
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    return tuple(value)


COLUMN_ROLES = ("path", "id", "start", "end", "start_frame", "end_frame", "ranges")
"""The roles --column gives a metadata table's columns (vaecache.sources.tables reads them)."""


def parse_columns(values: str | list[str] | tuple[str, ...] | None) -> tuple[tuple[str, str], ...]:
    """--column ROLE=NAME (repeatable, or comma-separated) -> ((role, column), ...), checked."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else list(values)
    found: dict[str, str] = {}
    for item in (part.strip() for value in items for part in str(value).split(",")):
        if not item:
            continue
        role, sep, column = (piece.strip() for piece in item.partition("="))
        if not sep or not role or not column:
            raise UsageError(f"--column takes ROLE=COLUMN (e.g. path=video_path), got {item!r}")
        if role not in COLUMN_ROLES:
            raise UsageError(f"--column: unknown role {role!r} (roles: {', '.join(COLUMN_ROLES)})")
        if role in found and found[role] != column:
            raise UsageError(f"--column: role {role!r} given twice ({found[role]!r} and {column!r})")
        found[role] = column
    return tuple(sorted(found.items()))


@dataclass(frozen=True)
class Option:
    """One setting of encode and/or plan."""

    name: str
    """Its name: the flag without dashes, underscores for dashes; the TOML key (either spelling)."""
    flag: str
    """The flag as Typer declares it ("--tiling/--no-tiling" for a boolean with both forms)."""
    kind: type
    """The flag's value type (str for values parsed later: sizes, lists, byte counts)."""
    help: str
    commands: frozenset[str] = BOTH
    field: str | None = None
    """The settings field it sets (default: `name`), e.g. --timeout sets timeout_s."""
    toml: tuple[type, ...] = ()
    """The TOML value types it takes (default: from `kind`)."""
    toml_items: type | None = None
    """The item type where a TOML list is allowed (size = ["480x832", "wan-480p"])."""
    short: str | None = None
    required: bool = False
    parse: Callable[[Any], Any] | None = None
    """Flag or TOML value -> the field's value."""
    help_by_command: tuple[tuple[str, str], ...] = ()
    """Another help text for one command ((command, text), ...), where the setting means something else there."""
    panel: str | None = None
    """The --help panel it is listed in, by topic (None: the first, "Options", with what a first run needs)."""
    metavar: str | None = None
    """What --help shows for its value (default: from `kind`; a flag shows none)."""

    @property
    def value_name(self) -> str:
        if self.metavar is not None:
            return self.metavar
        return {int: "N", float: "X", bool: ""}.get(self.kind, "TEXT")

    @property
    def setting(self) -> str:
        return self.field or self.name

    @property
    def toml_types(self) -> tuple[type, ...]:
        if self.toml:
            return self.toml
        return {int: (int,), float: (int, float), str: (str,), bool: (bool,), Path: (str,)}[self.kind]

    def help_for(self, command: str) -> str:
        return dict(self.help_by_command).get(command, self.help)


REQUIRED_NOTE = " \\[required, or in --config]"
"""Said of a required option in --help: the flag or a --config file gives it."""

INPUT, CLIPS, MODEL, SPEED, OUTPUT, SETS, PLANNING = (
    "Input", "Clips", "VAE and numerics", "Parallel and speed", "Output", "Sets added once the cache is finished",
    "Planning")
PANELS = (None, INPUT, CLIPS, MODEL, SPEED, PLANNING, OUTPUT, SETS)
"""The --help panels of encode's and plan's options, by topic, in --help order (None: the first, with what a first
run needs); docs/commands.md says each option in full."""

OPTIONS: tuple[Option, ...] = (
    Option("out", "--out", str, "Cache folder, or an s3:// URL." + REQUIRED_NOTE, frozenset({ENCODE}), short="-o",
           required=True, parse=location, metavar="OUT"),
    Option("vae", "--vae", str, "builtin:small, diffusers:DIR, FILE.safetensors, ..." + REQUIRED_NOTE,
           required=True, metavar="SPEC"),
    Option("num_frames", "--num-frames", str, "Frames per clip (or buckets 17,33,49)." + REQUIRED_NOTE,
           toml=(int, str, list), toml_items=int, required=True, metavar="N"),
    Option("size", "--size", str, "HxW (or buckets, or a preset: wan-480p)." + REQUIRED_NOTE, toml=(str, list),
           toml_items=str, required=True, metavar="HxW"),
    Option("storage_option", "--storage-option", list[str], "KEY=VALUE for fsspec (s3://); repeatable.",
           BOTH | CACHE_COMMANDS, field="storage_options", toml=(str, list, dict), toml_items=str,
           parse=parse_storage_options, panel=INPUT, metavar="KEY=VALUE"),
    Option("vae_config", "--vae-config", str, "config.json of a checkpoint file without one.", panel=MODEL,
           metavar="FILE"),
    Option("model", "--model", str, "The model the latents are for (e.g. framepack).", panel=MODEL, metavar="NAME"),
    Option("frame_stride", "--frame-stride", int, "Every S-th source frame (default 1).", panel=CLIPS, metavar="S"),
    Option("frames_policy", "--frames-policy", str, "longest (default) | all: lengths per scene.", panel=CLIPS),
    Option("fit", "--fit", str, "cover (default) | contain | stretch.", panel=CLIPS),
    Option("decoder", "--decoder", str, "auto (default) | pyav | decord | torchcodec.", panel=INPUT),
    Option("window_stride", "--window-stride", int, "Source frames between clip starts.", panel=CLIPS),
    Option("max_clips_per_scene", "--max-clips-per-scene", int, "Keep the first K clips of each scene.",
           panel=CLIPS, metavar="K"),
    Option("max_frame_pixels", "--max-frame-pixels", int, "Refuse larger frames (default 8192x8192).",
           panel=INPUT),
    Option("cameras", "--cameras", str, "Camera order and selection: a,b,c.", toml=(str, list), toml_items=str,
           parse=parse_cameras, panel=INPUT, metavar="A,B"),
    Option("sync", "--sync", str, "frames (default) | timestamps: pair cameras.", panel=INPUT),
    Option("sync_reference", "--sync-reference", str, "--sync timestamps: the camera giving times.", panel=INPUT,
           metavar="CAM"),
    Option("sync_tolerance", "--sync-tolerance", float, "--sync timestamps: seconds a frame may lie.", panel=INPUT,
           metavar="S"),
    Option("fps", "--fps", float, "Frame rate of image sequences without times.", field="frame_rate",
           panel=INPUT),
    Option("nuscenes_version", "--nuscenes-version", str, "Which nuScenes tables (v1.0-mini, ...).", panel=INPUT,
           metavar="V"),
    Option("column", "--column", str, "ROLE=NAME: a table's column for a role.", field="columns", toml=(str, list),
           toml_items=str, parse=parse_columns, panel=INPUT, metavar="ROLE=NAME"),
    Option("lerobot_state", "--lerobot-state/--no-lerobot-state", bool, "LeRobot: records keep frames' numbers.",
           panel=OUTPUT),
    Option("dtype", "--dtype", str, "fp32 (default) | bf16 | fp16.", panel=MODEL),
    Option("device", "--device", str, "auto (default) | cpu | cuda[:N].", panel=MODEL),
    Option("store", "--store", str, "mean-logvar (default) | mean | sample.", panel=MODEL,
           help_by_command=((PLAN, "mean-logvar (default) | mean | sample: counted."),)),
    Option("seed", "--seed", int, "Seed of --store sample's noise.", frozenset({ENCODE}), panel=MODEL),
    Option("tiling", "--tiling/--no-tiling", bool, "The VAE's own tiling (other latents).", panel=MODEL),
    Option("compile", "--compile/--no-compile", bool, "Encode through torch.compile.", field="compiled",
           panel=MODEL, help_by_command=((PLAN, "Measure with torch.compile."),)),
    Option("channels_last", "--channels-last/--no-channels-last", bool, "Channels-last convolutions.",
           panel=MODEL),
    Option("encoder_impl", "--encoder-impl", str, "auto (default) | fast | reference.", panel=MODEL),
    Option("views_per_forward", "--views-per-forward", str, "auto (default) | all | K views per forward.",
           toml=(int, str), panel=MODEL),
    Option("allow_pickle_weights", "--allow-pickle-weights", bool, "Let pickled .bin weights load (runs code).",
           panel=MODEL),
    Option("allow_other_numerics", "--allow-other-numerics", bool, "Resume on other GPU, torch or threads.",
           frozenset({ENCODE}), panel=MODEL),
    Option("batch_size", "--batch-size", int, "Clips per batch (default 1).", panel=SPEED),
    Option("workers", "--workers", int, "Decode processes per rank (default 2).", panel=SPEED),
    Option("probe_workers", "--probe-workers", int, f"Probe threads per rank (default {DEFAULT_PROBE_WORKERS}).",
           panel=SPEED),
    Option("world_size", "--world-size", int, "Ranks to plan for (default 1).", frozenset({PLAN}), panel=PLANNING),
    Option("sp_size", "--sp-size", int, "Ranks per sequence-parallel group.", panel=SPEED),
    Option("sp_mode", "--sp-mode", str, "views (default) | spatial (Wan VAEs).", panel=SPEED),
    Option("timeout", "--timeout", float, "Seconds a collective waits (default 1800).", frozenset({ENCODE}),
           field="timeout_s", panel=SPEED, metavar="S"),
    Option("liveness_timeout", "--liveness-timeout", float, "Seconds without a heartbeat (default 60).",
           frozenset({ENCODE}), field="liveness_timeout_s", panel=SPEED, metavar="S"),
    Option("memory_budget", "--memory-budget", str, "Device memory per rank, e.g. 8GiB.", frozenset({PLAN}),
           toml=(int, str), parse=lambda value: parse_bytes(value, "--memory-budget"), panel=PLANNING,
           metavar="BYTES"),
    Option("measure", "--measure/--no-measure", bool, "Encode one clip to measure (default on).",
           frozenset({PLAN}), panel=PLANNING),
    Option("shard_size", "--shard-size", str, "Roll shards at this size (default 256MiB).", frozenset({ENCODE}),
           toml=(int, str), parse=parse_bytes, panel=OUTPUT, metavar="BYTES"),
    Option("commit_every", "--commit-every", float, "Commit every S seconds too (default 300).",
           frozenset({ENCODE}), field="commit_every_s", panel=OUTPUT, metavar="S"),
    Option("on_error", "--on-error", str, "skip (default: record, go on) | fail.", frozenset({ENCODE}),
           panel=OUTPUT),
    Option("overwrite", "--overwrite", bool, "Discard what OUT holds; start over.", frozenset({ENCODE}),
           panel=OUTPUT),
    Option("hash_sources", "--hash-sources", bool, "Record each source video's sha256.", frozenset({ENCODE}),
           panel=OUTPUT),
    Option("progress", "--progress/--no-progress", bool, "Progress on stderr (default on).", frozenset({ENCODE}),
           panel=OUTPUT),
    Option("text_encoder", "--text-encoder", str, "Embed the captions: text set \"default\".", frozenset({ENCODE}),
           panel=SETS, metavar="SPEC"),
    Option("condition", "--condition", str, "first-frame | first-last | image-features.", frozenset({ENCODE}),
           panel=SETS, metavar="KIND"),
    Option("image_encoder", "--image-encoder", str, "--condition image-features: its encoder.",
           frozenset({ENCODE}), panel=SETS, metavar="SPEC"),
    Option("image_convention", "--image-convention", str, "--condition image-features: whose convention.",
           frozenset({ENCODE}), panel=SETS, metavar="NAME"),
    Option("audio_vae", "--audio-vae", str, "Encode each clip's sound: audio set \"default\".", frozenset({ENCODE}),
           panel=SETS, metavar="SPEC"),
    Option("audio_camera", "--audio-camera", str, "--audio-vae: whose sound (default: the first).",
           frozenset({ENCODE}), panel=SETS, metavar="CAM"),
    Option("audio_missing", "--audio-missing", str, "--audio-vae: skip (default) | silence.", frozenset({ENCODE}),
           panel=SETS),
)
"""In --help order."""

BY_NAME = {option.name: option for option in OPTIONS}
BY_SETTING = {option.setting: option for option in OPTIONS}


def options_of(command: str) -> tuple[Option, ...]:
    return tuple(option for option in OPTIONS if command in option.commands)


def option_named(key: str) -> Option | None:
    """The option a TOML key or flag name names (dashes or underscores; its field name too, e.g. timeout_s)."""
    name = key.replace("-", "_")
    return BY_NAME.get(name) or BY_SETTING.get(name)


def unknown_keys_message(keys: list[str], where: str) -> str:
    """`where: unknown setting(s) a, b (did you mean ...?)`, with the nearest known names."""
    close = sorted({match for key in keys
                    for match in difflib.get_close_matches(key.replace("-", "_"), sorted(BY_NAME), n=1, cutoff=0.6)})
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"{where}: unknown setting(s) {', '.join(keys)}{hint}"


def check_toml_value(option: Option, value: Any, where: str) -> None:
    """A TOML value of the type the option takes (a bool is never a number, a list holds its item type)."""
    allowed = option.toml_types
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        kinds = " or ".join(t.__name__ for t in allowed)
        raise UsageError(f"{where}: {option.setting} = {value!r:.80} must be {kinds}")
    if (isinstance(value, list) and option.toml_items is not None
            and not all(type(v) is option.toml_items for v in value)):
        item = option.toml_items.__name__
        raise UsageError(f"{where}: {option.setting} = {value!r:.80} must be {item} or a list of {item}")
