"""The parts encode's and plan's settings are built from, one per stage: where DATA is and how it is read (source),
the VAE, how it is decoded (decode), how the ranks compute (parallel), where the cache goes (out), and the sets an
encode adds once it is done (text, conditions). The clip settings are vaecache.settings.clip's. Each part validates
what it owns in __post_init__ and writes its own record (for the run fingerprint and the manifest), in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vaecache.errors import UsageError
from vaecache.settings.options import DEFAULT_PROBE_WORKERS
from vaecache.urls import Url

DECODER_CHOICES = ("auto", "pyav", "decord", "torchcodec")
"""--decoder values (vaecache.video.backends resolves them; kept here so config loads without torch or av)."""
ON_ERROR_CHOICES = ("skip", "fail")
SP_MODE_CHOICES = ("views", "spatial")


def _positive_integer(value: Any, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{flag} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class SourceConfig:
    """DATA and how it is read: which tables of a nuScenes root, a table's column roles, a LeRobot dataset's state
    columns, the threads probing it, what becomes of a scene that cannot be used, and the fsspec options of DATA at a
    URL."""

    location: Path | Url
    """A local path, or an object-store URL (vaecache.sources.urlpath)."""
    nuscenes_version: str | None = None
    """Which v1.0-* tables of a nuScenes root DATA (None: the only one there)."""
    columns: tuple[tuple[str, str], ...] = ()
    """--column ROLE=NAME: which column of a metadata table DATA plays which role (sources.tables)."""
    lerobot_state: bool = False
    """--lerobot-state: a LeRobot dataset's per-frame state/action columns in each clip record."""
    probe_workers: int = DEFAULT_PROBE_WORKERS
    """Threads probing videos in each rank."""
    on_error: str = "skip"
    """"fail": the first input that cannot be used stops the run; "skip": it is recorded and left out."""
    storage_options: tuple[tuple[str, Any], ...] = ()
    """--storage-option: fsspec options for DATA at a URL (never recorded: they may hold secrets)."""

    def __post_init__(self) -> None:
        _positive_integer(self.probe_workers, "--probe-workers")
        if self.on_error not in ON_ERROR_CHOICES:
            raise UsageError(f"--on-error must be one of {', '.join(ON_ERROR_CHOICES)}, got {self.on_error!r}")

    def reading(self) -> dict[str, Any]:
        """How DATA is read, each only where given (so caches of other layouts keep their records): the nuScenes
        version, a table's --column roles and --lerobot-state."""
        return {**({"nuscenes_version": self.nuscenes_version} if self.nuscenes_version else {}),
                **({"columns": [list(pair) for pair in self.columns]} if self.columns else {}),
                **({"lerobot_state": True} if self.lerobot_state else {})}

    def to_record(self) -> dict[str, Any]:
        """{"data": DATA, "reading": how it is read (where anything is given)}."""
        reading = self.reading()
        return {"data": str(self.location), **({"reading": reading} if reading else {})}


@dataclass(frozen=True)
class VaeConfig:
    """The VAE: its spec (absolute, as the loader resolves it), the config of a single checkpoint file, and whether
    pickled weights may load."""

    spec: str
    config: str | None = None
    """--vae-config: the config of a single checkpoint file --vae (vaecache.vae.single_file)."""
    allow_pickle_weights: bool = False
    """Let a diffusers folder with only pickled .bin weights load (unpickling can run code)."""
    model: str | None = None
    """--model: the model family the latents are for, where the VAE class serves several (vaecache.models checks it
    against the class at start-up; the VAE record holds the family resolved)."""

    def __post_init__(self) -> None:
        if not self.spec:
            raise UsageError("--vae is required (e.g. builtin:tiny, builtin:small, diffusers:/path/to/vae, "
                             "python:pkg.mod:factory)")
        if self.model is not None:
            from vaecache.models import FAMILIES

            if self.model not in FAMILIES:
                raise UsageError(f"--model {self.model!r} is not a model vaecache knows; models: "
                                 f"{', '.join(FAMILIES)}")

    def to_record(self) -> dict[str, Any]:
        return {"vae_spec": self.spec, **({"vae_config": self.config} if self.config else {}),
                **({"model": self.model} if self.model else {})}


@dataclass(frozen=True)
class DecodeConfig:
    """How video is decoded: the backend asked for and the decode worker processes per rank. The backend is
    resolved at start-up, and the FFmpeg threads per video with the rank's thread budget: the run fingerprint
    records what they came to."""

    decoder: str = "auto"
    """--decoder: auto | pyav | decord | torchcodec. Not recorded as asked: the run fingerprint records the resolved
    backend's own name (vaecache.video.backends.Backend.name), so caches decoded differently never mix."""
    workers: int = 2
    """DataLoader worker processes decoding video per rank (0 decodes in the main process)."""

    def __post_init__(self) -> None:
        if self.decoder not in DECODER_CHOICES:
            raise UsageError(f"--decoder must be one of {', '.join(DECODER_CHOICES)}, got {self.decoder!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise UsageError(f"--workers must be an integer >= 0, got {self.workers!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks compute: the device, the clips of a batch, the sequence-parallel group and how it splits the
    work, when a stuck or silent rank fails the job, and whether ranks (or a resume) may differ in numerics."""

    device: str = "auto"
    batch_size: int = 1
    """Clips per batch; a batch is folded into batch_size * cameras views."""
    sp_size: int = 1
    sp_mode: str = "views"
    """How an SP group splits the work: "views" (each rank encodes whole views of the batch) or "spatial"
    (every view's rows are cut into bands across the group, halos exchanged; Wan VAEs)."""
    timeout_s: float = 1800.0
    """Collective timeout: a dead or stuck rank ends the job after this long instead of hanging."""
    liveness_timeout_s: float = 60.0
    """A rank whose heartbeat stops for this long (SIGSTOP, a frozen node) fails the job naming its rank and
    host; a slow rank that still beats is waited for. 0 turns the heartbeats off."""
    allow_other_numerics: bool = False
    """Resume OUT (or run ranks) on other numerics than recorded (another GPU model, torch, CPU thread count):
    latents added then may differ from the committed ones in the last bits; the manifest lists every numerics."""

    def __post_init__(self) -> None:
        _positive_integer(self.batch_size, "--batch-size")
        _positive_integer(self.sp_size, "--sp-size")
        if self.sp_mode not in SP_MODE_CHOICES:
            raise UsageError(f"--sp-mode must be one of {', '.join(SP_MODE_CHOICES)}, got {self.sp_mode!r}")
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.liveness_timeout_s < 0:
            raise UsageError(f"--liveness-timeout must be >= 0 seconds (0 turns it off), got {self.liveness_timeout_s}")

    def to_record(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "sp_size": self.sp_size, "sp_mode": self.sp_mode}

    def fingerprint_record(self) -> dict[str, Any] | None:
        """What of the parallel layout determines stored bytes: in spatial mode band edges depend on the group size,
        and so do the last bits of the latents. None in views mode (latents do not depend on it)."""
        return {"mode": "spatial", "sp_size": self.sp_size} if self.sp_mode == "spatial" else None


@dataclass(frozen=True)
class OutConfig:
    """Where the cache goes and how it is committed."""

    location: Path | Url
    """A local folder, or an object-store URL (vaecache.cache.objects)."""
    shard_size: int = 256 * 2**20
    """Roll a new safetensors shard once this many tensor bytes are buffered."""
    commit_every_s: float = 300.0
    """Also commit the buffered clips as a shard this many seconds after the last commit (0: only by size)."""
    overwrite: bool = False
    hash_sources: bool = False
    """Record each source's sha256 (besides size and mtime) so a resume can tell changed content apart from
    a file that was only touched or copied."""
    storage_options: tuple[tuple[str, Any], ...] = ()
    """--storage-option: fsspec options for OUT at a URL (never recorded)."""

    def __post_init__(self) -> None:
        if self.shard_size < 1:
            raise UsageError(f"--shard-size must be >= 1 byte, got {self.shard_size}")
        if isinstance(self.commit_every_s, bool) or not 0 <= self.commit_every_s < float("inf"):
            raise UsageError(f"--commit-every must be seconds >= 0 (0: commit by size only), got "
                             f"{self.commit_every_s!r}")

    def to_record(self) -> dict[str, Any]:
        return {"shard_size": self.shard_size}


@dataclass(frozen=True)
class TextConfig:
    """encode --text-encoder: once the cache is finished, embed the clips' captions into its text set "default"
    (vaecache embed's defaults: vaecache.text.sets). The family checks the spec at start-up."""

    encoder: str | None = None


AUDIO_MISSING_CHOICES = ("skip", "silence")


@dataclass(frozen=True)
class AudioConfig:
    """encode --audio-vae: once the cache is finished, each clip's sound cut to its frames and encoded by the audio VAE
    into the audio set "default" (vaecache.audio.embed), from `camera`'s video, a clip without sound following
    `missing`. The VAE's folder is checked at start-up."""

    vae: str | None = None
    camera: str | None = None
    missing: str = "skip"

    def __post_init__(self) -> None:
        if self.missing not in AUDIO_MISSING_CHOICES:
            raise UsageError(f"--audio-missing must be one of {', '.join(AUDIO_MISSING_CHOICES)}, got {self.missing!r}")
        if self.vae is None and self.camera is not None:
            raise UsageError("--audio-camera applies to --audio-vae")


@dataclass(frozen=True)
class ConditionsConfig:
    """encode --condition KIND[,KIND]: once the cache is finished, add its image-to-video condition sets
    (vaecache.conditions.sets), image features with `image_encoder` in `image_convention`. The kinds and the
    encoder are checked by vaecache.conditions at start-up."""

    kinds: str | None = None
    image_encoder: str | None = None
    image_convention: str = "wan-diffusers"

    def __post_init__(self) -> None:
        if self.image_encoder is not None and "image-features" not in (self.kinds or ""):
            raise UsageError("--image-encoder applies to --condition image-features")
