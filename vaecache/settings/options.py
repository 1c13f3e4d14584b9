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

OPTIONS: tuple[Option, ...] = (
    Option("out", "--out", str, "Output folder for shards and manifest, or an object-store URL (s3://bucket/prefix)."
           + REQUIRED_NOTE, frozenset({ENCODE}), short="-o", required=True, parse=location),
    Option("storage_option", "--storage-option", list[str], "KEY=VALUE[,KEY=VALUE...], repeatable: passed to fsspec "
           "for an s3:// DATA or OUT (e.g. anon=true, endpoint_url=http://minio:9000); credentials come from the AWS "
           "environment and config files. Not recorded.", BOTH | CACHE_COMMANDS, field="storage_options",
           toml=(str, list, dict), toml_items=str, parse=parse_storage_options),
    Option("vae", "--vae", str, "builtin:tiny | builtin:small | diffusers:FOLDER\\[#subfolder] | FILE.safetensors | "
           "python:module:function." + REQUIRED_NOTE, required=True),
    Option("vae_config", "--vae-config", str, "The config.json (or diffusers folder) of a single checkpoint file whose "
           "model has no shipped config (Wan 2.1, Wan 2.2 TI2V-5B and LTX-Video 0.9.0-0.9.8 have one; SD-style "
           "AutoencoderKL and other sizes do not). Recorded."),
    Option("model", "--model", str, "The model the latents are for, where the VAE class serves several "
           "(AutoencoderKLHunyuanVideo: hunyuanvideo, the default, framepack or kandinsky5): each is encoded as its "
           "own trainers encode it. Recorded."),
    Option("num_frames", "--num-frames", str, "Frames per clip, or frame buckets 17,33,49 (see --frames-policy); "
           "checked against the VAE's rule." + REQUIRED_NOTE, toml=(int, str, list), toml_items=int, required=True),
    Option("size", "--size", str, "HxW, or size buckets 480x832,832x480,624x624 or a preset (wan-480p, wan-720p): "
           "each scene goes to the bucket nearest in aspect (see --fit)." + REQUIRED_NOTE, toml=(str, list),
           toml_items=str, required=True),
    Option("frame_stride", "--frame-stride", int, "Use every S-th source frame (default 1)."),
    Option("frames_policy", "--frames-policy", str, "With several --num-frames: longest (default: the longest that "
           "fits each scene) | all (clips at every length that fits)."),
    Option("fit", "--fit", str, "cover (default: resize to cover, centre-crop) | contain (resize to fit, pad mid "
           "grey) | stretch. Recorded per clip with the crop box."),
    Option("decoder", "--decoder", str, "auto (default: pyav here, the fastest byte-identical backend) | pyav | decord "
           "(forward-only, byte-identical to pyav on the tests, slower) | torchcodec (cpu, or NVDEC with a CUDA "
           "device; its pixels may differ from pyav's, so its latents do too). Recorded; a cache never mixes them."),
    Option("window_stride", "--window-stride", int, "Source frames between clip starts (default: no overlap)."),
    Option("max_clips_per_scene", "--max-clips-per-scene", int, "Keep the first K clips of each scene."),
    Option("max_frame_pixels", "--max-frame-pixels", int, "Refuse (a recorded failure, decided from the probe or an "
           "image's header before decoding) videos and image frames with more pixels than this (default 67108864 = "
           "8192x8192)."),
    Option("cameras", "--cameras", str, "Comma-separated camera order (default: names sorted; nuScenes: the surround "
           "order).", toml=(str, list), toml_items=str, parse=parse_cameras),
    Option("sync", "--sync", str, "frames (default: a clip takes the same frame indices of every camera; equal "
           "lengths and rates required) | timestamps (each camera's frame nearest each reference frame's time)."),
    Option("sync_reference", "--sync-reference", str, "With --sync timestamps: the camera whose frames give a clip's "
           "times (default: the layout's, CAM_FRONT for nuScenes, else the first camera)."),
    Option("sync_tolerance", "--sync-tolerance", float, "With --sync timestamps: seconds a camera's frame may lie "
           "from the reference time (default: half that camera's frame period); beyond it, a recorded failure."),
    Option("fps", "--fps", float, "Frame rate of image-sequence cameras whose frames carry no times (no "
           "timestamps.txt, no timestamped names, no index \"fps\"). Recorded.", field="frame_rate"),
    Option("nuscenes_version", "--nuscenes-version", str, "Which tables of a nuScenes root: v1.0-mini, "
           "v1.0-trainval, ... (default: the only v1.0-* folder there)."),
    Option("column", "--column", str, "ROLE=NAME[,ROLE=NAME...]: which column of a .csv/.tsv/.parquet table DATA "
           "plays a role (path, id, start, end, start_frame, end_frame, ranges), e.g. "
           "path=video_path,ranges=timestamp.",
           field="columns", toml=(str, list), toml_items=str, parse=parse_columns),
    Option("lerobot_state", "--lerobot-state/--no-lerobot-state", bool, "With a LeRobot dataset: each clip record "
           "also carries its frames' numeric columns (observation.state, action, ...) under "
           "metadata.lerobot_frames. Recorded."),
    Option("dtype", "--dtype", str, "fp32 | bf16 | fp16 (or torch's names bfloat16, float16, float32): VAE compute and "
           "stored dtype (default fp32)."),
    Option("device", "--device", str, "auto | cpu | cuda (auto: cuda:LOCAL_RANK when available).",
           help_by_command=((PLAN, "Where to measure: auto | cpu | cuda[:N] (default auto)."),)),
    Option("store", "--store", str, "mean-logvar (default) | mean | sample",
           help_by_command=((PLAN, "mean-logvar (default) | mean | sample: what is counted in bytes."),)),
    Option("seed", "--seed", int, "Seed for --store sample noise (per clip and camera).", frozenset({ENCODE})),
    Option("tiling", "--tiling/--no-tiling", bool, "Use the VAE's own tiling: less memory, different latents "
           "(recorded)."),
    Option("compile", "--compile/--no-compile", bool, "Run the encoder through torch.compile (compiled once per "
           "input shape; its kernels may round differently: recorded).", field="compiled",
           help_by_command=((PLAN, "Measure with the encoder compiled (torch.compile; the warm-up forward pays the "
                                   "compile)."),)),
    Option("channels_last", "--channels-last/--no-channels-last", bool, "Convolution weights and inputs in "
           "channels-last memory format (other kernels, other rounding: recorded)."),
    Option("encoder_impl", "--encoder-impl", str, "auto (default: fast where it is validated: Wan 2.1/2.2 in bf16 "
           "on a Hopper GPU; else reference; a resume takes the recorded one) | fast (Wan 2.1/2.2: vaecache's "
           "faster encoder over the same weights; latents within rounding of diffusers') | reference (diffusers' "
           "own encode). Recorded; a resume never mixes them."),
    Option("views_per_forward", "--views-per-forward", str, "auto | all | K: views of one clip per VAE forward "
           "(default auto: all on CUDA, 1 on CPU; K must divide the cameras). Latents depend on K only, never on "
           "batch, SP or world size (recorded); SP splits batches in units of K views.", toml=(int, str)),
    Option("batch_size", "--batch-size", int, "Clips per batch (B*cameras views; default 1)."),
    Option("workers", "--workers", int, "Decode worker processes per rank (default 2)."),
    Option("probe_workers", "--probe-workers", int,
           f"Threads probing videos in each rank (default {DEFAULT_PROBE_WORKERS})."),
    Option("world_size", "--world-size", int, "Ranks to plan for (default 1).", frozenset({PLAN})),
    Option("sp_size", "--sp-size", int, "Ranks per sequence-parallel group (world = DP x SP; default 1)."),
    Option("sp_mode", "--sp-mode", str, "views (default): split the views of a batch over the SP group | spatial: "
           "split every view's rows into bands (Wan VAEs; recorded)."),
    Option("shard_size", "--shard-size", str, "Roll shards at this many bytes (default 256MiB).", frozenset({ENCODE}),
           toml=(int, str), parse=parse_bytes),
    Option("commit_every", "--commit-every", float, "Also commit a shard this many seconds after the last commit "
           "(default 300; 0: by size only): a hard kill loses at most this long of finished work.", frozenset({ENCODE}),
           field="commit_every_s"),
    Option("on_error", "--on-error", str, "skip (default: record bad inputs, go on) | fail", frozenset({ENCODE})),
    Option("overwrite", "--overwrite", bool, "Discard what OUT holds and start over.", frozenset({ENCODE})),
    Option("text_encoder", "--text-encoder", str, "Once the cache is finished, embed the clips' captions with this "
           "text encoder into its text set \"default\", as `vaecache embed OUT --text-encoder SPEC` does (its "
           "defaults; embed itself takes the other choices).", frozenset({ENCODE})),
    Option("condition", "--condition", str, "KIND[,KIND]: once the cache is finished, add its image-to-video "
           "condition sets (first-frame | first-last) as `vaecache embed OUT --condition KIND` does: the cache's VAE "
           "over each clip's first (and last) frame then zeros, as WanImageToVideoPipeline.prepare_latents builds "
           "them (the frames are decoded again) | image-features (with --image-encoder).", frozenset({ENCODE})),
    Option("image_encoder", "--image-encoder", str, "--condition image-features: the image encoder, diffusers:PATH "
           "| transformers:PATH (as `vaecache embed` takes it).", frozenset({ENCODE})),
    Option("image_convention", "--image-convention", str, "--condition image-features: wan-diffusers (default) | "
           "wan-musubi | wan-flf2v-diffusers | framepack-diffusers | hunyuanvideo15-diffusers | hunyuanvideo15-musubi "
           "(as `vaecache embed` takes it).", frozenset({ENCODE})),
    Option("audio_vae", "--audio-vae", str, "Once the cache is finished, cut each clip's sound to its frames and "
           "encode it with this audio VAE (diffusers:PATH[#audio_vae], an AutoencoderKLLTX2Audio; or LTX-2's release "
           "file PATH.safetensors) into the audio set \"default\", as `vaecache embed OUT --audio-vae SPEC` does.",
           frozenset({ENCODE})),
    Option("audio_camera", "--audio-camera", str, "--audio-vae: whose video's sound (default: the first camera "
           "with an audio track).", frozenset({ENCODE})),
    Option("audio_missing", "--audio-missing", str, "--audio-vae: a clip without sound, skip (default) | silence "
           "(as `vaecache embed` takes it).", frozenset({ENCODE})),
    Option("hash_sources", "--hash-sources", bool, "Record each source video's sha256 (besides size and mtime): a "
           "resume then tells changed content from a touched file.", frozenset({ENCODE})),
    Option("allow_other_numerics", "--allow-other-numerics", bool, "Resume OUT on other numerics than it records "
           "(another GPU model, torch or CPU thread count; ranks too may differ): latents added may differ in the "
           "last bits; the manifest lists every numerics used.", frozenset({ENCODE})),
    Option("allow_pickle_weights", "--allow-pickle-weights", bool, "Let a diffusers VAE folder holding only pickled "
           ".bin weights load (pickle runs code: trust the folder)."),
    Option("timeout", "--timeout", float, "Seconds before a stuck collective fails the job (default 1800).",
           frozenset({ENCODE}), field="timeout_s"),
    Option("liveness_timeout", "--liveness-timeout", float, "Seconds without a heartbeat before a stopped rank fails "
           "the job, named with its host (default 60; 0: off).", frozenset({ENCODE}), field="liveness_timeout_s"),
    Option("memory_budget", "--memory-budget", str, "Device memory per rank, e.g. 8GiB: report the largest "
           "micro-batch that fits.", frozenset({PLAN}), toml=(int, str),
           parse=lambda value: parse_bytes(value, "--memory-budget")),
    Option("measure", "--measure/--no-measure", bool, "Encode one real clip to measure time and memory (default on).",
           frozenset({PLAN})),
    Option("progress", "--progress/--no-progress", bool, "Progress on rank 0: a bar in a terminal, a line every 30 s "
           "(VAECACHE_PROGRESS_INTERVAL) in a log (default on).", frozenset({ENCODE})),
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
