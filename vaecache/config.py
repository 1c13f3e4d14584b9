"""Frozen, validated settings for every command. Loaded from CLI flags, optionally on top of a TOML file."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from vaecache.buckets import FIT_CHOICES, FRAMES_POLICY_CHOICES, Bucket, parse_lengths, parse_sizes
from vaecache.dtypes import DTYPE_CHOICES
from vaecache.errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

STORED_KEYS: dict[str, tuple[str, ...]] = {"mean-logvar": ("mean", "logvar"), "mean": ("mean",), "sample": ("sample",)}
"""--store -> the tensors stored per clip."""
STORE_CHOICES = tuple(STORED_KEYS)
ON_ERROR_CHOICES = ("skip", "fail")
SP_MODE_CHOICES = ("views", "spatial")
DECODER_CHOICES = ("auto", "pyav", "decord", "torchcodec")
"""--decoder values (vaecache.decode resolves them; kept here so config loads without torch or av)."""
DEFAULT_MAX_FRAME_PIXELS = 8192 * 8192
"""--max-frame-pixels default: 67 MP, twice 8K UHD (7680x4320 = 33 MP); decoding one frame costs a few bytes per
pixel per decoder thread and buffer, so a larger frame can take GBs."""


def frame_budget_problem(width: int, height: int, max_pixels: int) -> str | None:
    """The reason a video of `width`x`height` frames is not decoded under a budget of `max_pixels` (None: it is)."""
    if width * height <= max_pixels:
        return None
    return (f"frames of {width}x{height} ({width * height:,} pixels) exceed the decode budget of {max_pixels:,} "
            "pixels (--max-frame-pixels; decoding frames this large can take GBs of memory)")


def parse_size(text: str) -> tuple[int, int]:
    """'64x96' -> (64, 96) as (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise UsageError(f"--size must look like HxW (e.g. 480x832), got {text!r}")
    height, width = int(match.group(1)), int(match.group(2))
    if height < 1 or width < 1:
        raise UsageError(f"--size must be positive, got {text!r}")
    return height, width


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


@dataclass(frozen=True)
class SamplingConfig:
    """How clips are cut from a scene. Every camera of a clip uses the same frame indices."""

    num_frames: int
    """Frames per clip (after striding)."""
    frame_stride: int = 1
    """Take every S-th source frame inside a clip."""
    window_stride: int | None = None
    """Source frames between the starts of consecutive clips; default num_frames*frame_stride (no overlap)."""
    max_clips_per_scene: int | None = None
    """Keep at most this many clips per scene (the first ones; per frame bucket with --frames-policy all)."""
    frame_buckets: tuple[int, ...] = ()
    """Every --num-frames value in the order given when there are several (num_frames is the first); empty: one."""
    frames_policy: str = "longest"
    """With several frame buckets: "longest" cuts a scene at the longest bucket that fits its usable frames,
    "all" at every bucket that fits."""
    max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS
    """A scene whose probe reports a camera with more pixels per frame than this yields no clip: a recorded
    failure, decided before anything is decoded (a 12000x12000 h264 frame takes GBs to decode). Not part of the
    run fingerprint (it changes no latent); the manifest's settings record it for verify --dataset."""

    def __post_init__(self) -> None:
        for value in self.frame_buckets or (self.num_frames,):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--num-frames must be >= 1, got {value}")
        if self.frame_buckets and (self.frame_buckets[0] != self.num_frames or len(set(self.frame_buckets)) != len(self.frame_buckets)):
            raise UsageError(f"frame buckets {list(self.frame_buckets)} must be distinct and start with num_frames {self.num_frames}")
        if self.frames_policy not in FRAMES_POLICY_CHOICES:
            raise UsageError(f"--frames-policy must be one of {', '.join(FRAMES_POLICY_CHOICES)}, got {self.frames_policy!r}")
        if self.frame_stride < 1:
            raise UsageError(f"--frame-stride must be >= 1, got {self.frame_stride}")
        if self.window_stride is not None and self.window_stride < 1:
            raise UsageError(f"--window-stride must be >= 1, got {self.window_stride}")
        if self.max_clips_per_scene is not None and self.max_clips_per_scene < 1:
            raise UsageError(f"--max-clips-per-scene must be >= 1, got {self.max_clips_per_scene}")
        if isinstance(self.max_frame_pixels, bool) or not isinstance(self.max_frame_pixels, int) or self.max_frame_pixels < 1:
            raise UsageError(f"--max-frame-pixels must be a pixel count >= 1, got {self.max_frame_pixels!r}")

    @property
    def span(self) -> int:
        """Source frames covered by one clip, first to last inclusive."""
        return (self.num_frames - 1) * self.frame_stride + 1

    @property
    def step(self) -> int:
        return self.window_stride if self.window_stride is not None else self.num_frames * self.frame_stride

    @property
    def lengths(self) -> tuple[int, ...]:
        """The frame buckets, in the order given (one: num_frames)."""
        return self.frame_buckets or (self.num_frames,)

    def for_length(self, num_frames: int) -> SamplingConfig:
        """The one-length sampling that cuts windows of `num_frames` (the window stride, where given, is shared)."""
        if not self.frame_buckets and num_frames == self.num_frames:
            return self  # planning asks this once per scene: a one-length sampling is its own
        return _one_length(num_frames, self.frame_stride, self.window_stride, self.max_clips_per_scene)


@functools.lru_cache(maxsize=64)
def _one_length(num_frames: int, frame_stride: int, window_stride: int | None,
                max_clips_per_scene: int | None) -> SamplingConfig:
    """for_length's answers, built once each (a few per run: one per frame bucket)."""
    return SamplingConfig(num_frames, frame_stride, window_stride, max_clips_per_scene)


@dataclass(frozen=True)
class ClipSettings:
    """What changes the stored latents: the run fingerprint and the manifest record exactly these.

    Encode, plan and verify --dataset/--reencode all describe a clip with this one type; `to_record()`
    and `from_record()` are its only conversions to and from the recorded (JSON) form."""

    sampling: SamplingConfig
    height: int
    width: int
    dtype: str = "fp32"
    """VAE compute and stored dtype: fp32, bf16 or fp16."""
    store: str = "mean-logvar"
    seed: int = 0
    """Seeds the per-(clip, camera) noise generator used by --store sample (recorded only then)."""
    cameras: tuple[str, ...] | None = None
    """Camera order for folder layouts; default: sorted by name."""
    tiling: bool = False
    """Run the VAE with its own spatial/temporal tiling (enable_tiling()): less memory, different latents."""
    compiled: bool = False
    """--compile: run the encoder through torch.compile (its generated kernels may round differently from
    eager PyTorch, so it is recorded; a resume must use the same)."""
    channels_last: bool = False
    """--channels-last: convolution weights and inputs in channels-last memory format (other kernels, other
    rounding: recorded)."""
    views_per_forward: int | str = "auto"
    """K: the views of one clip one VAE forward encodes together (a unit; SP splits batches in whole units).
    "all": every camera of a clip; "auto": all on CUDA, 1 on CPU (where oneDNN's batched convolutions give
    other bits for another thread count). Resolved to a number per dataset and device
    (planning.resolve_views_per_forward) before it is recorded. Latents depend on K (kernels can differ by
    batch size) and never on batch, SP or world size. A unit is split only on out-of-memory, which the clip
    record says."""
    size_buckets: tuple[tuple[int, int], ...] = ()
    """Every --size (H, W) in the order given when there are several ((height, width) is the first); empty: one."""
    fit: str = "cover"
    """How a frame is made the bucket's size: cover (resize to cover, centre-crop), contain (resize to fit,
    pad with mid grey), stretch (resize, aspect not kept)."""
    decoder: str = "auto"
    """--decoder: auto | pyav | decord | torchcodec. Not in to_record(): the run fingerprint records the resolved
    backend's own name (vaecache.decode.Backend.name), so caches decoded differently never mix."""

    def __post_init__(self) -> None:
        for height, width in self.size_buckets or ((self.height, self.width),):
            if height < 1 or width < 1:
                raise UsageError(f"--size must be positive, got {height}x{width}")
        if self.size_buckets and (self.size_buckets[0] != (self.height, self.width)
                                  or len(set(self.size_buckets)) != len(self.size_buckets)):
            raise UsageError(f"size buckets {list(self.size_buckets)} must be distinct and start with "
                             f"{self.height}x{self.width}")
        if self.fit not in FIT_CHOICES:
            raise UsageError(f"--fit must be one of {', '.join(FIT_CHOICES)}, got {self.fit!r}")
        if self.decoder not in DECODER_CHOICES:
            raise UsageError(f"--decoder must be one of {', '.join(DECODER_CHOICES)}, got {self.decoder!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.store not in STORE_CHOICES:
            raise UsageError(f"--store must be one of {', '.join(STORE_CHOICES)}, got {self.store!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"--seed must be an integer, got {self.seed!r}")
        if self.cameras is not None and len(set(self.cameras)) != len(self.cameras):
            raise UsageError(f"camera order lists a camera twice: {list(self.cameras)}")
        if not isinstance(self.tiling, bool):
            raise UsageError(f"--tiling must be true or false, got {self.tiling!r}")
        if not isinstance(self.compiled, bool):
            raise UsageError(f"--compile must be true or false, got {self.compiled!r}")
        if not isinstance(self.channels_last, bool):
            raise UsageError(f"--channels-last must be true or false, got {self.channels_last!r}")
        parse_views_per_forward(self.views_per_forward)

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """The size buckets (H, W), in the order given (one: height x width)."""
        return self.size_buckets or ((self.height, self.width),)

    @property
    def bucketed(self) -> bool:
        """Whether clips record their bucket and crop: several sizes or frame counts, or a fit other than cover.
        A one-size cover run writes exactly the records (and fingerprint) it always did."""
        return len(self.sizes) > 1 or len(self.sampling.lengths) > 1 or self.fit != "cover"

    def buckets(self) -> list[Bucket]:
        """Every bucket: each size with each frame count, sizes first (the manifest's order)."""
        return [Bucket(h, w, n) for h, w in self.sizes for n in self.sampling.lengths]

    def to_record(self) -> dict[str, Any]:
        """The recorded form (run fingerprint, manifest settings): compared on resume, read back by verify.
        Bucket keys appear only for a bucketed run, so a one-size cover cache keeps its fingerprint."""
        if not self.bucketed:
            return self._plain_record()
        # window_stride as given: None means each frame bucket's own length (the first one's step would be wrong)
        return {**self._plain_record(), "window_stride": self.sampling.window_stride,
                "sizes": [list(size) for size in self.sizes], "frame_buckets": list(self.sampling.lengths),
                "frames_policy": self.sampling.frames_policy, "fit": self.fit}

    def _plain_record(self) -> dict[str, Any]:
        return {
            "num_frames": self.sampling.num_frames,
            "frame_stride": self.sampling.frame_stride,
            "window_stride": self.sampling.step,
            "max_clips_per_scene": self.sampling.max_clips_per_scene,
            "height": self.height,
            "width": self.width,
            "dtype": self.dtype,
            "store": self.store,
            "seed": self.seed if self.store == "sample" else None,
            "cameras": list(self.cameras) if self.cameras is not None else None,
            "tiling": self.tiling,
            **({"compile": True} if self.compiled else {}),  # absent when off: older caches keep their fingerprint
            **({"channels_last": True} if self.channels_last else {}),
            "views_per_forward": self.views_per_forward,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ClipSettings:
        """The settings a recorded run used (caches written before tiling was recorded did not tile)."""
        try:
            lengths = tuple(record.get("frame_buckets") or ())
            sampling = SamplingConfig(num_frames=record["num_frames"], frame_stride=record["frame_stride"],
                                      window_stride=record["window_stride"],
                                      max_clips_per_scene=record["max_clips_per_scene"],
                                      frame_buckets=lengths if len(lengths) > 1 else (),
                                      frames_policy=record.get("frames_policy", "longest"),
                                      max_frame_pixels=record.get("max_frame_pixels", DEFAULT_MAX_FRAME_PIXELS))
            sizes = tuple(tuple(size) for size in record.get("sizes") or ())
            cameras = record.get("cameras")
            return cls(sampling=sampling, height=record["height"], width=record["width"], dtype=record["dtype"],
                       store=record["store"], seed=record.get("seed") or 0,
                       cameras=tuple(cameras) if cameras is not None else None,
                       tiling=record.get("tiling", False), compiled=record.get("compile", False),
                       channels_last=record.get("channels_last", False),
                       views_per_forward=record.get("views_per_forward", record.get("max_views_per_forward", 1)),
                       size_buckets=sizes if len(sizes) > 1 else (), fit=record.get("fit", "cover"))  # type: ignore[arg-type]
        except KeyError as exc:
            raise UsageError(f"recorded settings lack {exc.args[0]!r}") from None


@dataclass(frozen=True)
class EncodeConfig:
    """Everything `vaecache encode` needs: where from and to, the VAE, the clip settings, and run options
    (which do not change a stored byte)."""

    data: Path
    out: Path
    vae: str
    clip: ClipSettings
    device: str = "auto"
    batch_size: int = 1
    """Clips per batch; a batch is folded into batch_size * cameras views."""
    workers: int = 2
    """DataLoader worker processes decoding video per rank (0 decodes in the main process)."""
    shard_size: int = 256 * 2**20
    """Roll a new safetensors shard once this many tensor bytes are buffered."""
    sp_size: int = 1
    sp_mode: str = "views"
    """How an SP group splits the work: "views" (each rank encodes whole views of the batch) or "spatial"
    (every view's rows are cut into bands across the group, halos exchanged; Wan VAEs)."""
    on_error: str = "skip"
    overwrite: bool = False
    timeout_s: float = 1800.0
    """Collective timeout: a dead or stuck rank ends the job after this long instead of hanging."""
    liveness_timeout_s: float = 60.0
    """A rank whose heartbeat stops for this long (SIGSTOP, a frozen node) fails the job naming its rank and
    host; a slow rank that still beats is waited for. 0 turns the heartbeats off."""
    progress: bool = True
    allow_pickle_weights: bool = False
    """Let a diffusers folder with only pickled .bin weights load (unpickling can run code)."""
    hash_sources: bool = False
    """Record each source's sha256 (besides size and mtime) so a resume can tell changed content apart from
    a file that was only touched or copied."""
    allow_other_numerics: bool = False
    """Resume OUT (or run ranks) on other numerics than recorded (another GPU model, torch, CPU thread count):
    latents added then may differ from the committed ones in the last bits; the manifest lists every numerics."""

    def __post_init__(self) -> None:
        if not self.vae:
            raise UsageError("--vae is required (e.g. builtin:tiny, builtin:small, diffusers:/path/to/vae, "
                             "python:pkg.mod:factory)")
        if self.on_error not in ON_ERROR_CHOICES:
            raise UsageError(f"--on-error must be one of {', '.join(ON_ERROR_CHOICES)}, got {self.on_error!r}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.workers < 0:
            raise UsageError(f"--workers must be >= 0, got {self.workers}")
        if self.sp_size < 1:
            raise UsageError(f"--sp-size must be >= 1, got {self.sp_size}")
        if self.sp_mode not in SP_MODE_CHOICES:
            raise UsageError(f"--sp-mode must be one of {', '.join(SP_MODE_CHOICES)}, got {self.sp_mode!r}")
        if self.shard_size < 1:
            raise UsageError(f"--shard-size must be >= 1 byte, got {self.shard_size}")
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.liveness_timeout_s < 0:
            raise UsageError(f"--liveness-timeout must be >= 0 seconds (0 turns it off), got {self.liveness_timeout_s}")


_CLIP_KEYS = ("dtype", "store", "seed", "tiling", "compiled", "channels_last", "views_per_forward", "fit", "decoder")
"""ClipSettings fields given as options of their own (the rest come from size, cameras and the sampling keys)."""


def check_option_syntax(merged: dict[str, Any]) -> None:
    """Refuse a malformed --size or --num-frames list first, as a typed option's parser would (before the
    checks of missing options)."""
    if "size" in merged:
        parse_sizes(merged["size"])
    if "num_frames" in merged:
        parse_lengths(merged["num_frames"])


VIEWS_PER_FORWARD_WORDS = ("auto", "all")


def parse_views_per_forward(value: Any) -> int | str:
    """--views-per-forward: "auto", "all" or an integer K >= 1 (see ClipSettings.views_per_forward)."""
    if value in VIEWS_PER_FORWARD_WORDS:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--views-per-forward must be an integer >= 1, 'all' or 'auto', got {value!r}")
    return value


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


__all__ = [
    "DECODER_CHOICES", "DEFAULT_MAX_FRAME_PIXELS", "DTYPE_CHOICES", "ON_ERROR_CHOICES", "STORE_CHOICES", "ClipSettings", "EncodeConfig", "SamplingConfig",
    "check_option_syntax", "frame_budget_problem", "load_toml", "parse_bytes", "parse_size", "pop_clip_options",
]
