"""`vaecache plan`: a dry run. What a job would encode, how it splits over ranks, and how long it would take.

Planning is pure (the same functions the encode pipeline uses: discover_scenes, probe_scene,
plan_clips, assign, batched, plan_sp); the only model work is one real clip encoded to measure
seconds per view and peak memory, from which the ETA and the largest micro-batch that fits a memory
budget are estimated. The CLI renders the report (cli/plan.py); `--json` writes `PlanReport.to_json()`.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vaecache.config import DTYPE_CHOICES, STORE_CHOICES, SamplingConfig
from vaecache.dataset import Clip, assign, batch_views, batched, plan_clips
from vaecache.decode import ViewDecoder
from vaecache.sources import Scene, SceneProbe, discover_scenes, probe_scene
from vaecache.dist import make_mesh
from vaecache.errors import UsageError, VideoDecodeError
from vaecache.parallel import plan_sp
from vaecache.vae import DTYPE_LABELS, LoadedVae, load_vae

PLAN_FORMAT = "vaecache-plan/1"
MEASURE_TRIES = 5
STORED_KEYS = {"mean-logvar": ("mean", "logvar"), "mean": ("mean",), "sample": ("sample",)}


@dataclass(frozen=True)
class PlanConfig:
    """What `vaecache plan` is asked: the encode settings that shape the work, plus the cluster to plan for."""

    data: Path
    vae: str
    sampling: SamplingConfig
    height: int
    width: int
    world_size: int = 1
    sp_size: int = 1
    batch_size: int = 1
    dtype: str = "fp32"
    device: str = "auto"
    store: str = "mean-logvar"
    cameras: tuple[str, ...] | None = None
    tiling: bool = False
    max_views_per_forward: int = 1
    memory_budget: int | None = None
    """Bytes of device memory one rank may use; the report then gives the largest micro-batch that fits."""
    measure: bool = True
    """Encode one real clip to measure time and memory (off: planning only)."""
    probe_workers: int = 8

    def __post_init__(self) -> None:
        if self.height < 1 or self.width < 1:
            raise UsageError(f"--size must be positive, got {self.height}x{self.width}")
        for name in ("world_size", "sp_size", "batch_size", "max_views_per_forward", "probe_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.store not in STORE_CHOICES:
            raise UsageError(f"--store must be one of {', '.join(STORE_CHOICES)}, got {self.store!r}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise UsageError(f"--memory-budget must be positive, got {self.memory_budget}")
        make_mesh(0, self.world_size, self.sp_size)  # sp_size must divide world_size


@dataclass
class DpShare:
    """The work of one SP group (one data-parallel replica)."""

    dp_rank: int
    ranks: list[int]
    clips: int
    batches: int
    views: int
    """Real views of its clips."""
    views_per_rank: int
    """Views each rank of the group encodes, padding included: the group's critical path."""
    padded_views: int
    """Encodes spent on padding or on repeating views every rank already has."""


@dataclass
class Measurement:
    """One real clip encoded with the planned settings."""

    clip_id: str
    views: int
    seconds: float
    seconds_per_view: float
    device: str
    method: str
    """How peak memory was read: "cuda max_memory_allocated" or "peak RSS (getrusage)"."""
    baseline_bytes: int | None
    """Memory in use before encoding (weights, and on CPU the whole process)."""
    peak_bytes: int | None
    peak_per_view_bytes: int | None
    """(peak - baseline) / units per forward: what one more view per forward costs."""
    units_per_forward: int
    backoffs: list[str] = field(default_factory=list)


@dataclass
class PlanReport:
    """Everything `vaecache plan` found, as plain data (rendered by cli/plan.py, written by --json)."""

    config: dict[str, Any]
    vae: dict[str, Any]
    scenes: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    clips: int
    cameras: int
    views: int
    frames: int
    latent_shape: list[int]
    stored: list[str]
    dtype: str
    bytes_per_view: int
    total_bytes: int
    shares: list[DpShare]
    measurement: Measurement | None = None
    eta_s: float | None = None
    fits_views_per_forward: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def encoded_views(self) -> int:
        return sum(s.views + s.padded_views for s in self.shares)

    @property
    def padding_waste(self) -> float:
        """Fraction of all encodes (summed over ranks) spent on padding or repeats."""
        encoded = self.encoded_views
        return sum(s.padded_views for s in self.shares) / encoded if encoded else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "config": self.config,
            "vae": self.vae,
            "dataset": {"scenes": len(self.scenes) + len(self.skipped), "usable_scenes": len(self.scenes),
                        "skipped": self.skipped, "clips": self.clips, "cameras": self.cameras, "views": self.views,
                        "frames": self.frames, "per_scene": self.scenes},
            "latent": {"shape_per_view": self.latent_shape, "shape_per_clip": [self.cameras, *self.latent_shape],
                       "stored": self.stored, "dtype": self.dtype, "bytes_per_view": self.bytes_per_view,
                       "bytes_per_clip": self.bytes_per_view * self.cameras, "total_bytes": self.total_bytes},
            "ranks": {"dp_groups": [asdict(s) for s in self.shares],
                      "padding": {"real_views": self.views, "encoded_views": self.encoded_views,
                                  "padded_views": self.encoded_views - self.views,
                                  "waste_fraction": self.padding_waste}},
            "measurement": asdict(self.measurement) if self.measurement else None,
            "eta_s": self.eta_s,
            "memory": {"budget_bytes": self.config.get("memory_budget"),
                       "max_views_per_forward_that_fits": self.fits_views_per_forward},
            "notes": self.notes,
        }


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else as torch understands it."""
    spec = device.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} but CUDA is not available on this machine")
    try:
        return torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device (use auto, cpu, cuda or cuda:N)") from None


def _source_frames(scene: Scene, probe: SceneProbe) -> int:
    """Frames the clips are cut from: the JSONL "frames" range where given, else the whole video."""
    return scene.frame_range[1] - scene.frame_range[0] if scene.frame_range is not None else probe.num_frames


def probe_all(scenes: list[Scene], workers: int) -> dict[str, SceneProbe]:
    """Open every scene's videos (threads: the work is in FFmpeg's C code (PyAV releases the GIL) and file I/O)."""
    if workers <= 1 or len(scenes) <= 1:
        probes = [probe_scene(scene) for scene in scenes]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(scenes))) as pool:
            probes = list(pool.map(probe_scene, scenes))
    return {probe.scene_id: probe for probe in probes}


def dp_shares(clips: list[Clip], world_size: int, sp_size: int, batch_size: int) -> list[DpShare]:
    """Pure: how the encode pipeline splits `clips` over DP groups, batches and SP ranks."""
    mesh = make_mesh(0, world_size, sp_size)
    shares = []
    for dp in range(mesh.dp_size):
        mine = assign(clips, dp, mesh.dp_size)
        views = per_rank = padded = 0
        batches = batched(mine, batch_size)
        for batch in batches:
            n = len(batch_views(batch))
            local = len(plan_sp(n, sp_size).view_indices(0))
            views += n
            per_rank += local
            padded += local * sp_size - n
        shares.append(DpShare(dp, mesh.sp_group_ranks(dp), len(mine), len(batches), views, per_rank, padded))
    return shares


def build_plan(cfg: PlanConfig, vae: LoadedVae | None = None) -> PlanReport:
    """Plan the job described by `cfg`; with cfg.measure, encode one real clip to time it."""
    device = resolve_device(cfg.device)
    if vae is None:
        vae = load_vae(cfg.vae, device, cfg.dtype, tiling=cfg.tiling, max_views_per_forward=cfg.max_views_per_forward)
    vae.rule.check(cfg.sampling.num_frames, cfg.height, cfg.width)
    if cfg.store != "mean" and not vae.has_logvar:
        raise UsageError(f"--store {cfg.store} needs the posterior log-variance, and {cfg.vae} gives only a mean; "
                         "use --store mean")
    scenes = discover_scenes(cfg.data, cfg.cameras)
    probes = probe_all(scenes, cfg.probe_workers)
    clips, skipped = plan_clips(scenes, probes, cfg.sampling)
    per_scene: dict[str, int] = {}
    for clip in clips:
        per_scene[clip.scene_id] = per_scene.get(clip.scene_id, 0) + 1
    skipped_ids = {s.scene_id for s in skipped}
    scene_rows = [{"scene": s.scene_id, "cameras": len(s.cameras), "source_frames": _source_frames(s, probes[s.scene_id]),
                   "clips": per_scene.get(s.scene_id, 0)} for s in scenes if s.scene_id not in skipped_ids]

    shape = list(vae.latent_shape(cfg.sampling.num_frames, cfg.height, cfg.width))
    stored = list(STORED_KEYS[cfg.store])
    bytes_per_view = math.prod(shape) * torch.empty((), dtype=vae.dtype).element_size() * len(stored)
    views = sum(clip.num_views for clip in clips)
    fingerprint = vae.fingerprint()
    report = PlanReport(
        config=_config_json(cfg, device),
        vae={"spec": cfg.vae, "family": vae.family, "untrained": vae.untrained, "rule": vae.rule.to_json(),
             "latent_channels": vae.latent_channels, "normalization": vae.normalization,
             **{k: fingerprint[k] for k in ("precision", "tiling", "max_views_per_forward", "per_frame")}},
        scenes=scene_rows,
        skipped=[{"scene": s.scene_id, "path": s.path, "reason": s.reason} for s in skipped],
        clips=len(clips), cameras=clips[0].num_views if clips else len(scenes[0].cameras),
        views=views, frames=views * cfg.sampling.num_frames,
        latent_shape=shape, stored=stored, dtype=DTYPE_LABELS[vae.dtype],
        bytes_per_view=bytes_per_view, total_bytes=bytes_per_view * views,
        shares=dp_shares(clips, cfg.world_size, cfg.sp_size, cfg.batch_size),
    )
    if vae.untrained:
        report.notes.append(f"{cfg.vae} is an untrained VAE with random weights: timings only, latents mean nothing")
    if vae.dtype_note:
        report.notes.append(vae.dtype_note)
    idle = sum(1 for s in report.shares if s.clips == 0)
    if idle:
        report.notes.append(f"{idle} of {len(report.shares)} DP groups get no clips: fewer ranks would do")
    if not clips:
        report.notes.append("no clips: nothing to encode (see skipped scenes)")
        report.eta_s = 0.0
        return report
    if cfg.measure:
        for clip in clips[:MEASURE_TRIES]:
            try:
                report.measurement = measure_clip(vae, clip, cfg.height, cfg.width)
                break
            except VideoDecodeError as exc:
                report.notes.append(f"clip {clip.clip_id} does not decode ({exc}); measuring another")
        else:
            raise UsageError(f"cannot measure: none of the first {MEASURE_TRIES} clips decodes "
                             f"(last: {report.notes[-1]}); use --no-measure to plan without measuring")
        critical = max(s.views_per_rank for s in report.shares)
        report.eta_s = critical * report.measurement.seconds_per_view
        report.notes.append("ETA = the busiest rank's views x measured seconds per view; model loading, probing and "
                            "decoding (overlapped by --workers) are not included")
        if cfg.memory_budget is not None:
            report.fits_views_per_forward = fits_views_per_forward(report.measurement, cfg.memory_budget)
            if report.fits_views_per_forward == 0:
                report.notes.append("not even one view per forward fits --memory-budget: try --tiling, a smaller "
                                    "--size, or --dtype bf16")
    elif cfg.memory_budget is not None:
        report.notes.append("--memory-budget needs a measurement; drop --no-measure")
    return report


def fits_views_per_forward(measurement: Measurement, budget: int) -> int | None:
    """Largest K with baseline + K * peak_per_view <= budget (None when memory could not be measured)."""
    if measurement.peak_per_view_bytes is None or measurement.baseline_bytes is None:
        return None
    room = budget - measurement.baseline_bytes
    if room <= 0:
        return 0
    return int(room // max(1, measurement.peak_per_view_bytes))


def decode_clip(clip: Clip, height: int, width: int) -> torch.Tensor:
    """(views, 3, T, H, W) in [-1, 1], exactly as the encode pipeline feeds the VAE."""
    decoder = ViewDecoder(height, width)
    return torch.stack([decoder.decode(path, clip.frames) for path in clip.paths])


def measure_clip(vae: LoadedVae, clip: Clip, height: int, width: int) -> Measurement:
    """Encode one clip (after a one-view warm-up) and read the time and the peak memory it took.

    Raises VideoDecodeError when the clip does not decode."""
    views = decode_clip(clip, height, width)
    device = vae.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        method = "cuda max_memory_allocated"
    else:
        baseline = _current_rss()
        method = ("peak RSS (getrusage)" if _reset_peak_rss()
                  else "peak RSS (getrusage; not resettable here, may include model loading)")
    vae.encode_views(views[:1])  # warm-up: lazy init, kernel selection, allocator growth
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = vae.encode_views(views)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss()
    units = len(views) * (views.shape[2] if vae.per_frame else 1)
    per_forward = min(vae.max_views_per_forward, units)
    per_view = None
    if peak is not None and baseline is not None and peak > baseline:
        per_view = int(math.ceil((peak - baseline) / per_forward))
    return Measurement(clip.clip_id, len(views), seconds, seconds / len(views), str(device), method, baseline, peak,
                       per_view, per_forward, list(result.backoffs))


def _current_rss() -> int | None:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _reset_peak_rss() -> bool:
    """Linux >= 4.0: writing 5 to clear_refs resets the peak RSS that getrusage reports."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _config_json(cfg: PlanConfig, device: torch.device) -> dict[str, Any]:
    return {
        "data": str(cfg.data), "vae": cfg.vae, "num_frames": cfg.sampling.num_frames,
        "frame_stride": cfg.sampling.frame_stride, "window_stride": cfg.sampling.step,
        "max_clips_per_scene": cfg.sampling.max_clips_per_scene, "height": cfg.height, "width": cfg.width,
        "world_size": cfg.world_size, "sp_size": cfg.sp_size, "dp_size": cfg.world_size // cfg.sp_size,
        "batch_size": cfg.batch_size, "dtype": cfg.dtype, "device": str(device), "store": cfg.store,
        "cameras": list(cfg.cameras) if cfg.cameras else None, "tiling": cfg.tiling,
        "max_views_per_forward": cfg.max_views_per_forward, "memory_budget": cfg.memory_budget,
    }


__all__ = ["DpShare", "Measurement", "PlanConfig", "PlanReport", "build_plan", "dp_shares", "fits_views_per_forward",
           "measure_clip"]
