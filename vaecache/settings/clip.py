"""What decides the stored latents of a clip, frozen and validated: frame sampling (SamplingConfig) and the clip
settings (ClipSettings: sizes, fit, dtype, what is stored). Every field here is in the run fingerprint except
those documented as not."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from vaecache.errors import UsageError
from vaecache.settings.buckets import FIT_CHOICES, FRAMES_POLICY_CHOICES, Bucket
from vaecache.settings.dtypes import DTYPE_CHOICES

STORED_KEYS: dict[str, tuple[str, ...]] = {"mean-logvar": ("mean", "logvar"), "mean": ("mean",), "sample": ("sample",)}
"""--store -> the tensors stored per clip."""
STORE_CHOICES = tuple(STORED_KEYS)
ENCODER_IMPL_CHOICES = ("auto", "fast", "reference")
"""--encoder-impl values (vaecache.vae.load.resolve_encoder_impl resolves them for the loaded VAE)."""
DEFAULT_MAX_FRAME_PIXELS = 8192 * 8192
"""--max-frame-pixels default: 67 MP, twice 8K UHD (7680x4320 = 33 MP); decoding one frame costs a few bytes per
pixel per decoder thread and buffer, so a larger frame can take GBs."""


def frame_budget_problem(width: int, height: int, max_pixels: int) -> str | None:
    """The reason a video of `width`x`height` frames is not decoded under a budget of `max_pixels` (None: it is)."""
    if width * height <= max_pixels:
        return None
    return (f"frames of {width}x{height} ({width * height:,} pixels) exceed the decode budget of {max_pixels:,} "
            "pixels (--max-frame-pixels; decoding frames this large can take GBs of memory)")


SYNC_CHOICES = ("frames", "timestamps")


@dataclass(frozen=True)
class SyncConfig:
    """How the cameras of a clip are paired: by frame index (`frames`: equal lengths and rates required) or by
    time (`timestamps`: each camera's frame nearest each reference frame's time, within a tolerance)."""

    mode: str = "frames"
    reference: str | None = None
    """--sync-reference: the camera whose frames give a clip's times (None: the layout's, else the first camera)."""
    tolerance: float | None = None
    """--sync-tolerance in seconds: how far a camera's frame may be from the reference time (None: half of that
    camera's own frame period, so a frame it dropped is noticed)."""

    def __post_init__(self) -> None:
        if self.mode not in SYNC_CHOICES:
            raise UsageError(f"--sync must be one of {', '.join(SYNC_CHOICES)}, got {self.mode!r}")
        if self.tolerance is not None and (isinstance(self.tolerance, bool) or not 0 < self.tolerance < math.inf):
            raise UsageError(f"--sync-tolerance must be a positive number of seconds, got {self.tolerance!r}")
        if self.mode == "frames" and (self.reference is not None or self.tolerance is not None):
            raise UsageError("--sync-reference and --sync-tolerance need --sync timestamps")

    def to_record(self) -> dict[str, Any]:
        return {"mode": self.mode, "reference": self.reference, "tolerance": self.tolerance}


FRAME_SYNC = SyncConfig()


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
    sync: SyncConfig = FRAME_SYNC
    """How the cameras of a clip are paired (--sync, --sync-reference, --sync-tolerance)."""
    frame_rate: float | None = None
    """--fps: the rate of image-sequence cameras whose frames carry no times (recorded when given: it sets the
    frame times --sync timestamps pairs by)."""

    def __post_init__(self) -> None:
        for value in self.frame_buckets or (self.num_frames,):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--num-frames must be >= 1, got {value}")
        if self.frame_buckets and (self.frame_buckets[0] != self.num_frames
                                   or len(set(self.frame_buckets)) != len(self.frame_buckets)):
            raise UsageError(f"frame buckets {list(self.frame_buckets)} must be distinct and start with "
                             f"num_frames {self.num_frames}")
        if self.frames_policy not in FRAMES_POLICY_CHOICES:
            raise UsageError(f"--frames-policy must be one of {', '.join(FRAMES_POLICY_CHOICES)}, "
                             f"got {self.frames_policy!r}")
        if self.frame_stride < 1:
            raise UsageError(f"--frame-stride must be >= 1, got {self.frame_stride}")
        if self.window_stride is not None and self.window_stride < 1:
            raise UsageError(f"--window-stride must be >= 1, got {self.window_stride}")
        if self.max_clips_per_scene is not None and self.max_clips_per_scene < 1:
            raise UsageError(f"--max-clips-per-scene must be >= 1, got {self.max_clips_per_scene}")
        if (isinstance(self.max_frame_pixels, bool) or not isinstance(self.max_frame_pixels, int)
                or self.max_frame_pixels < 1):
            raise UsageError(f"--max-frame-pixels must be a pixel count >= 1, got {self.max_frame_pixels!r}")
        if self.frame_rate is not None and (isinstance(self.frame_rate, bool)
                                            or not 0 < self.frame_rate < math.inf):
            raise UsageError(f"--fps must be a positive number, got {self.frame_rate!r}")

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
    encoder_impl: str = "auto"
    """--encoder-impl: auto | fast | reference. Not in to_record(): the VAE fingerprint records the implementation
    it resolved to (vaecache.vae.load.resolve_encoder_impl), so a resume never mixes the two."""

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
        if self.encoder_impl not in ENCODER_IMPL_CHOICES:
            raise UsageError(f"--encoder-impl must be one of {', '.join(ENCODER_IMPL_CHOICES)}, "
                             f"got {self.encoder_impl!r}")
        if self.encoder_impl == "fast" and (self.tiling or self.compiled):
            raise UsageError(f"--encoder-impl fast cannot be combined with --{'tiling' if self.tiling else 'compile'} "
                             "(it would run diffusers' own encode)")
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
            # absent at their defaults: caches from before image sequences and time sync keep their fingerprint
            **({"sync": self.sampling.sync.to_record()} if self.sampling.sync != FRAME_SYNC else {}),
            **({"fps": self.sampling.frame_rate} if self.sampling.frame_rate is not None else {}),
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
                                      max_frame_pixels=record.get("max_frame_pixels", DEFAULT_MAX_FRAME_PIXELS),
                                      sync=SyncConfig(**record["sync"]) if record.get("sync") else FRAME_SYNC,
                                      frame_rate=record.get("fps"))
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
