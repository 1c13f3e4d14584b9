"""The one loader of encode's and plan's settings: a TOML file (optional) under the flags, read through the
option table (vaecache.settings.options), into the command's frozen settings (vaecache.settings.commands).

Flags win over the file. A file's keys are the long flag names (dashes or underscores), at the top level or in
`[encode]` / `[plan]` tables, layered: top level, then `[encode]`, then `[plan]` for plan. A key of the other command
is accepted (one file may serve both) and does not apply; an unknown key or a value of the wrong type is refused
naming the file and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vaecache.errors import UsageError
from vaecache.settings.buckets import parse_lengths, parse_sizes
from vaecache.settings.clip import ClipSettings, SamplingConfig, SyncConfig, parse_views_per_forward
from vaecache.settings.commands import EncodeConfig, PlanConfig
from vaecache.settings.dtypes import canonical_dtype_name
from vaecache.settings.options import BY_SETTING, ENCODE, PLAN, check_toml_value, option_named, unknown_keys_message
from vaecache.settings.parts import (
    AudioConfig,
    ConditionsConfig,
    DecodeConfig,
    OutConfig,
    ParallelConfig,
    SourceConfig,
    TextConfig,
    VaeConfig,
)
from vaecache.settings.vae_specs import resolve_vae_spec
from vaecache.urls import location

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

COMMANDS = {ENCODE: EncodeConfig, PLAN: PlanConfig}
PARTS = {"source": SourceConfig, "vae": VaeConfig, "decode": DecodeConfig, "parallel": ParallelConfig,
         "out": OutConfig, "text": TextConfig, "conditions": ConditionsConfig, "audio": AudioConfig}
"""The parts of encode's and plan's settings (vaecache.settings.parts) besides the clip settings."""
ROUTES: dict[str, tuple[tuple[str, str], ...]] = {
    "out": (("out", "location"),),
    "storage_options": (("source", "storage_options"), ("out", "storage_options")),
    "vae": (("vae", "spec"),), "vae_config": (("vae", "config"),), "model": (("vae", "model"),),
    "allow_pickle_weights": (("vae", "allow_pickle_weights"),),
    "nuscenes_version": (("source", "nuscenes_version"),), "columns": (("source", "columns"),),
    "lerobot_state": (("source", "lerobot_state"),), "probe_workers": (("source", "probe_workers"),),
    "on_error": (("source", "on_error"),),
    "decoder": (("decode", "decoder"),), "workers": (("decode", "workers"),),
    "device": (("parallel", "device"),), "batch_size": (("parallel", "batch_size"),),
    "sp_size": (("parallel", "sp_size"),), "sp_mode": (("parallel", "sp_mode"),),
    "timeout_s": (("parallel", "timeout_s"),), "liveness_timeout_s": (("parallel", "liveness_timeout_s"),),
    "allow_other_numerics": (("parallel", "allow_other_numerics"),),
    "shard_size": (("out", "shard_size"),), "commit_every_s": (("out", "commit_every_s"),),
    "overwrite": (("out", "overwrite"),), "hash_sources": (("out", "hash_sources"),),
    "text_encoder": (("text", "encoder"),),
    "condition": (("conditions", "kinds"),), "image_encoder": (("conditions", "image_encoder"),),
    "image_convention": (("conditions", "image_convention"),),
    "audio_vae": (("audio", "vae"),), "audio_camera": (("audio", "camera"),), "audio_missing": (("audio", "missing"),),
}
"""A setting -> the (part, field)s it sets; the clip settings go to ClipSettings by field name, and a setting of
neither kind (world_size, memory_budget, measure, progress) is the command's own field."""
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingConfig)) - {"num_frames", "frame_buckets",
                                                                                   "sync"}
CLIP_FIELDS = frozenset(f.name for f in dataclasses.fields(ClipSettings)) - {
    "sampling", "height", "width", "size_buckets", "cameras"}


MAX_CONFIG_BYTES = 1 << 20
"""The largest --config file read: settings, not data (a larger file is refused before it is read)."""


def read_config(path: Path) -> dict[str, Any]:
    """A --config file's TOML, read with the care a captions file gets: a regular file (a FIFO would block, /dev/zero
    never end, a folder not read), at most MAX_CONFIG_BYTES, UTF-8, nested no deeper than the parser can go. Anything
    else is a UsageError naming the file and the problem."""
    import stat

    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path}: --config is not a regular file (a folder, a pipe or a device)")
        if info.st_size > MAX_CONFIG_BYTES:
            raise UsageError(f"{path}: --config is {info.st_size} bytes, more than {MAX_CONFIG_BYTES} (a settings file "
                             "is small: is it the right file?)")
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UsageError(f"{path}: --config grew past {MAX_CONFIG_BYTES} bytes while it was read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise UsageError(f"{path}: not valid TOML for settings: arrays or tables nested too deep") from None


def load_toml(path: Path, command: str = ENCODE) -> dict[str, Any]:
    """A config file's settings by field name, in layers: the top level, then `[encode]`, then `[plan]` when the
    command is plan (a later layer wins), each key checked against the option table; one setting given twice in one
    table (`num-frames` and `num_frames`) is refused."""
    raw = read_config(path)
    for name in COMMANDS:
        if name in raw and not isinstance(raw[name], dict):
            raise UsageError(f"{path}: {name} must be a table ([{name}]) of settings, got {raw[name]!r:.80}")
    layers = {None: {key: value for key, value in raw.items() if key not in COMMANDS}}
    layers.update((name, raw[name]) for name in COMMANDS if name in raw)
    values: dict[str, Any] = {}
    for name, layer in layers.items():  # every table is checked, one file serving both commands
        unknown = sorted(key for key in layer if option_named(key) is None)
        if unknown:
            raise UsageError(unknown_keys_message(unknown, str(path)))
        spelled: dict[str, str] = {}
        for key, value in layer.items():
            option = option_named(key)
            assert option is not None
            if option.setting in spelled:
                table = f"[{name}]" if name else "the top level"
                raise UsageError(f"{path}: {spelled[option.setting]!r} and {key!r} in {table} are one setting "
                                 f"({option.setting}) given twice: keep one")
            spelled[option.setting] = key
            check_toml_value(option, value, str(path))
            if name in (None, ENCODE, command):
                values[option.setting] = value
    return values


REQUIRED = (
    ("out", "--out", ": the folder the latent cache is written to", "--out OUT"),
    ("vae", "--vae", " (builtin:tiny, builtin:small, diffusers:PATH[#subfolder] or python:module:function); there is "
                     "no default, so a forgotten flag cannot produce silent garbage", "--vae builtin:small"),
    ("num_frames", "--num-frames", " (frames per clip, e.g. 17 for Wan-style 1+4k VAEs)", "--num-frames 17"),
    ("size", "--size HxW", " (e.g. 480x832)", "--size 480x832"),
)
"""The settings encode and plan need (plan: all but --out), with what each is; every one missing is named at once."""


def load_settings(command: str, data: Path, flags: dict[str, Any], config_file: Path | None = None,
                  extra: dict[str, Any] | None = None) -> EncodeConfig | PlanConfig:
    """`command`'s settings from the flags (option name -> value; None: not given) over the TOML file, plus
    `extra` fields the CLI decides itself (plan's clip_ids)."""
    values: dict[str, Any] = load_toml(config_file, command) if config_file else {}
    values.update({option_named(name).setting: value for name, value in flags.items()  # type: ignore[union-attr]
                   if value is not None})
    for setting in ("size", "num_frames"):  # a malformed list is refused before a missing option is named
        if setting in values:
            (parse_sizes if setting == "size" else parse_lengths)(values[setting])
    values = {setting: value for setting, value in values.items() if command in BY_SETTING[setting].commands}
    missing = [(flag, why, example) for setting, flag, why, example in REQUIRED
               if (setting != "out" or command == ENCODE) and values.get(setting) in (None, "")]
    if len(missing) == 1:
        raise UsageError(f"{missing[0][0]} is required{missing[0][1]}")
    if missing:
        flags = [flag.split()[0] for flag, _, _ in missing]
        raise UsageError(f"{', '.join(flags[:-1])} and {flags[-1]} are required (as flags or in --config), e.g. "
                         + " ".join(example for _, _, example in missing))
    clip = clip_settings(values)
    rest = {setting: BY_SETTING[setting].parse(value) if BY_SETTING[setting].parse else value
            for setting, value in values.items()}
    if rest.get("vae"):  # recorded absolute: decode and verify --reencode work from anywhere (start-up checks it)
        rest["vae"] = resolve_vae_spec(rest["vae"])
    if rest.get("vae_config"):
        rest["vae_config"] = str(Path(rest["vae_config"]).expanduser().absolute())
    parts: dict[str, dict[str, Any]] = {"source": {"location": location(data)}}
    own: dict[str, Any] = {}
    for setting, value in rest.items():
        for part, name in ROUTES.get(setting, ()):
            parts.setdefault(part, {})[name] = value
        if setting not in ROUTES:
            own[setting] = value
    fields = {f.name for f in dataclasses.fields(COMMANDS[command])}
    built = {part: PARTS[part](**given) for part, given in parts.items() if part in fields}
    return COMMANDS[command](clip=clip, **built, **own, **(extra or {}))

def clip_settings(values: dict[str, Any]) -> ClipSettings:
    """Take the clip settings (what changes the stored latents) out of `values`, by field name."""
    if "num_frames" not in values:
        raise UsageError("--num-frames is required (frames per clip, e.g. 17 for Wan-style 1+4k VAEs)")
    if "size" not in values:
        raise UsageError("--size HxW is required (e.g. 480x832)")
    sizes = parse_sizes(values.pop("size"))
    lengths = parse_lengths(values.pop("num_frames"))
    sync = SyncConfig(values.pop("sync", None) or "frames", values.pop("sync_reference", None),
                      values.pop("sync_tolerance", None))
    sampling = SamplingConfig(num_frames=lengths[0], frame_buckets=lengths if len(lengths) > 1 else (), sync=sync,
                              **{name: values.pop(name) for name in SAMPLING_FIELDS if name in values})
    clip = {name: values.pop(name) for name in CLIP_FIELDS if name in values}
    if "dtype" in clip:  # torch's names (bfloat16, float16) are the short ones
        clip["dtype"] = canonical_dtype_name(clip["dtype"])
    if "views_per_forward" in clip:
        clip["views_per_forward"] = parse_views_per_forward(clip["views_per_forward"])
    cameras = values.pop("cameras", None)
    height, width = sizes[0]
    return ClipSettings(sampling=sampling, height=height, width=width,
                        cameras=BY_SETTING["cameras"].parse(cameras) if cameras is not None else None,  # type: ignore[misc]
                        size_buckets=sizes if len(sizes) > 1 else (), **clip)
