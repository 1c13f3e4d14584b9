"""The settings of encode, plan and verify, frozen and validated (index's are sources/indexing.py:IndexConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vaecache.distributed.mesh import make_mesh
from vaecache.errors import UsageError
from vaecache.settings.clip import ClipSettings
from vaecache.settings.options import DEFAULT_PROBE_WORKERS
from vaecache.urls import Url

ON_ERROR_CHOICES = ("skip", "fail")


SP_MODE_CHOICES = ("views", "spatial")


@dataclass(frozen=True)
class EncodeConfig:
    """Everything `vaecache encode` needs: where from and to, the VAE, the clip settings, and run options
    (which do not change a stored byte)."""

    data: Path | Url
    """A local path, or an object-store URL (vaecache.sources.urlpath)."""
    out: Path | Url
    """A local folder, or an object-store URL (vaecache.cache.objects)."""
    vae: str
    clip: ClipSettings
    device: str = "auto"
    batch_size: int = 1
    """Clips per batch; a batch is folded into batch_size * cameras views."""
    workers: int = 2
    """DataLoader worker processes decoding video per rank (0 decodes in the main process)."""
    shard_size: int = 256 * 2**20
    """Roll a new safetensors shard once this many tensor bytes are buffered."""
    commit_every_s: float = 300.0
    """Also commit the buffered clips as a shard this many seconds after the last commit (0: only by size)."""
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
    probe_workers: int = DEFAULT_PROBE_WORKERS
    """Threads probing videos in each rank."""
    nuscenes_version: str | None = None
    """Which v1.0-* tables of a nuScenes root DATA (None: the only one there)."""
    columns: tuple[tuple[str, str], ...] = ()
    """--column ROLE=NAME: which column of a metadata table DATA plays which role (sources.tables)."""
    lerobot_state: bool = False
    """--lerobot-state: a LeRobot dataset's per-frame state/action columns in each clip record."""
    vae_config: str | None = None
    """--vae-config: the config of a single checkpoint file --vae (vaecache.vae.single_file)."""
    storage_options: tuple[tuple[str, Any], ...] = ()
    """--storage-option: fsspec options for DATA and OUT in object storage (never recorded: they may hold
    secrets)."""
    text_encoder: str | None = None
    """--text-encoder: once the cache is finished, embed the clips' captions into its text set "default"
    (vaecache embed's defaults: vaecache.text.sets)."""
    condition: str | None = None
    """--condition KIND[,KIND]: once the cache is finished, add its image-to-video condition sets
    (vaecache.conditions.sets)."""
    image_encoder: str | None = None
    image_convention: str = "wan-diffusers"

    def __post_init__(self) -> None:
        if isinstance(self.probe_workers, bool) or not isinstance(self.probe_workers, int) or self.probe_workers < 1:
            raise UsageError(f"--probe-workers must be an integer >= 1, got {self.probe_workers!r}")
        if self.image_encoder is not None and "image-features" not in (self.condition or ""):
            raise UsageError("--image-encoder applies to --condition image-features")
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
        if isinstance(self.commit_every_s, bool) or not 0 <= self.commit_every_s < float("inf"):
            raise UsageError(f"--commit-every must be seconds >= 0 (0: commit by size only), got "
                             f"{self.commit_every_s!r}")
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.liveness_timeout_s < 0:
            raise UsageError(f"--liveness-timeout must be >= 0 seconds (0 turns it off), got {self.liveness_timeout_s}")


@dataclass(frozen=True)
class VerifyOptions:
    """What `vaecache verify` checks beyond integrity."""

    quick: bool = False
    """Sizes and headers only: no hashing, no value checks."""
    threads: int | None = None
    dataset: Path | None = None
    """Re-plan clips from this source with the recorded settings and compare coverage."""
    reencode: int = 0
    """Re-encode this many clips (chosen by `seed`) and compare with what is stored."""
    vae: str | None = None
    """VAE for --reencode; default: the spec recorded in the manifest. Must match the fingerprint."""
    seed: int = 0
    device: str = "auto"
    allow_pickle_weights: bool = False
    tolerance: float | None = None
    """--reencode: max abs difference over max abs stored value; None: REENCODE_TOLERANCE of the stored dtype."""
    repair: bool = False
    """Delete stray shards (files or objects) first, under OUT's lock."""
    storage_options: tuple[tuple[str, Any], ...] = ()
    """fsspec options for a URL OUT (and a URL --dataset)."""

    def __post_init__(self) -> None:
        if self.reencode < 0:
            raise UsageError(f"--reencode must be >= 0, got {self.reencode}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {self.threads}")
        if self.tolerance is not None and not 0 <= self.tolerance < float("inf"):
            raise UsageError(f"--tolerance must be a fraction >= 0, got {self.tolerance}")


@dataclass(frozen=True)
class PlanConfig:
    """What `vaecache plan` is asked: the dataset, the VAE and clip settings an encode would use, and the
    cluster shape to plan for."""

    data: Path
    vae: str
    clip: ClipSettings
    world_size: int = 1
    sp_size: int = 1
    batch_size: int = 1
    sp_mode: str = "views"
    """As for encode: "spatial" plans one view per forward and checks the VAE can be split into bands."""
    workers: int = 2
    """Decode workers per rank the encode would run (the decoder backend is resolved for them)."""
    device: str = "auto"
    memory_budget: int | None = None
    """Bytes of device memory one rank may use; the report then gives the largest micro-batch that fits."""
    measure: bool = True
    """Encode one real clip to measure time and memory (off: planning only)."""
    probe_workers: int = DEFAULT_PROBE_WORKERS
    allow_pickle_weights: bool = False
    clip_ids: bool = True
    """List every DP group's clip ids in the report (--json); off, the groups are only counted (fast at 10M)."""
    nuscenes_version: str | None = None
    columns: tuple[tuple[str, str], ...] = ()
    lerobot_state: bool = False
    vae_config: str | None = None
    storage_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("world_size", "sp_size", "batch_size", "probe_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise UsageError(f"--memory-budget must be positive, got {self.memory_budget}")
        if self.sp_mode not in SP_MODE_CHOICES:
            raise UsageError(f"--sp-mode must be one of {', '.join(SP_MODE_CHOICES)}, got {self.sp_mode!r}")
        if self.workers < 0:
            raise UsageError(f"--workers must be >= 0, got {self.workers}")
        make_mesh(0, self.world_size, self.sp_size)  # sp_size must divide world_size


def reading_record(settings: EncodeConfig | PlanConfig) -> dict[str, Any]:
    """How DATA is read, as the run fingerprint and the manifest's settings record it: the nuScenes version, a
    table's --column roles and --lerobot-state, each only where given (so caches of other layouts keep their
    records)."""
    return {**({"nuscenes_version": settings.nuscenes_version} if settings.nuscenes_version else {}),
            **({"columns": [list(pair) for pair in settings.columns]} if settings.columns else {}),
            **({"lerobot_state": True} if settings.lerobot_state else {})}
