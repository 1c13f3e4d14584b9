"""`vaecache plan`: a dry run. What a job would encode, how it splits over ranks, and how long it would take.

Planning is pure and shared with the encode pipeline (discover_scenes, probe_scene, then
planning.plan_job: the same clips per DP group as an encode); the only model work is one real clip encoded to measure
seconds per view and peak memory, from which the ETA and the largest micro-batch that fits a memory
budget are estimated. The CLI renders the report (cli/plan.py); `--json` writes `PlanReport.to_json()`.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, overload

import torch

from vaecache.settings.buckets import aspect_distance, fit_geometry, kept_share
from vaecache.settings.clip import STORED_KEYS, ClipSettings
from vaecache.video.backends import PYAV, Backend, resolve_decoder
from vaecache.video.dataset import ViewDecoder
from vaecache.distributed import make_mesh, resolve_device
from vaecache.sources.scene import Scene, SceneProbe
from vaecache.sources.discover import discover_scenes
from vaecache.sources.probing import probe_dataset
from vaecache.errors import UsageError, VideoDecodeError
from vaecache.planning import Clip, JobPlan, PlannedClips, plan_job, sp_repeats_advice
from vaecache.settings.dtypes import recorded_name
from vaecache.vae import LoadedVae, load_vae

PLAN_FORMAT = "vaecache-plan/1"
MEASURE_TRIES = 5


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
    device: str = "auto"
    memory_budget: int | None = None
    """Bytes of device memory one rank may use; the report then gives the largest micro-batch that fits."""
    measure: bool = True
    """Encode one real clip to measure time and memory (off: planning only)."""
    probe_workers: int = 8
    allow_pickle_weights: bool = False
    clip_ids: bool = True
    """List every DP group's clip ids in the report (--json); off, the groups are only counted (fast at 10M)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "sp_size", "batch_size", "probe_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
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
    clip_ids: list[str] = field(default_factory=list)
    """The clips this group's writer commits, in encode order."""


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
    scenes: Sequence[dict[str, Any]]
    """Per usable scene: {"scene", "cameras", "source_frames", "clips"} (SceneRows: built as read)."""
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
    buckets: list[dict[str, Any]] = field(default_factory=list)
    """A bucketed plan's histogram (bucket_histogram), empty buckets included."""

    @property
    def empty_buckets(self) -> list[str]:
        return [bucket["name"] for bucket in self.buckets if not bucket["clips"]]

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
                        "frames": self.frames, "per_scene": list(self.scenes)},
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
            "buckets": self.buckets,
            "notes": self.notes,
        }


class SceneRows(Sequence[dict[str, Any]]):
    """The report's row per usable scene, built when read: a million-scene plan prints a few of them and
    lists them all only for --json."""

    def __init__(self, clips: PlannedClips, probes: dict[str, SceneProbe]) -> None:
        self._clips, self._probes = clips, probes

    def __len__(self) -> int:
        return self._clips.scene_total

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        scene, count = self._clips.scene_at(index % len(self))
        return {"scene": scene.scene_id, "cameras": len(scene.cameras),
                "source_frames": _source_frames(scene, self._probes.get(scene.scene_id)), "clips": count}


def _source_frames(scene: Scene, probe: SceneProbe | None) -> int:
    """Frames the clips are cut from: the JSONL "frames" range where given, else the whole video (from the
    probe, or the index line's own probe)."""
    if scene.frame_range is not None:
        return scene.frame_range[1] - scene.frame_range[0]
    return probe.num_frames if probe is not None else scene.probed[0].frames  # type: ignore[index]


def dp_shares(job: JobPlan, clip_ids: bool = True) -> list[DpShare]:
    """Pure: how the encode pipeline splits the job's clips over DP groups, batches and SP ranks (counted
    without building the clips; with `clip_ids`, each group's clip ids too, which builds them)."""
    mesh = make_mesh(0, job.world_size, job.sp_size)
    shares = []
    for dp in range(mesh.dp_size):
        counts = job.dp_counts(dp)
        padded = counts.views_per_rank * job.sp_size - counts.views
        ids = [clip.clip_id for clip in job.dp_clips(dp)] if clip_ids else []
        shares.append(DpShare(dp, mesh.sp_group_ranks(dp), counts.clips, counts.batches, counts.views,
                              counts.views_per_rank, padded, ids))
    return shares


def build_plan(cfg: PlanConfig, vae: LoadedVae | None = None) -> PlanReport:
    """Plan the job described by `cfg`; with cfg.measure, encode one real clip to time it."""
    device = resolve_device(cfg.device)
    backend = resolve_decoder(cfg.clip.decoder, device)  # an unusable --decoder fails before anything is read
    # DATA first: a typo there fails before the VAE is loaded.
    scenes = discover_scenes(cfg.data, cfg.clip.cameras)
    probes = probe_dataset(scenes, workers=cfg.probe_workers).probes
    job = plan_job(scenes, probes, cfg.clip.sampling, cfg.world_size, cfg.sp_size, cfg.batch_size,
                   sizes=cfg.clip.sizes, views_per_forward=cfg.clip.views_per_forward, device_type=device.type)
    cfg = replace(cfg, clip=replace(cfg.clip, views_per_forward=job.views_per_forward))  # "auto" resolved
    if vae is None:
        vae = load_vae(cfg.vae, device, cfg.clip.dtype, tiling=cfg.clip.tiling, allow_pickle_weights=cfg.allow_pickle_weights,
                       views_per_forward=cfg.clip.views_per_forward, compiled=cfg.clip.compiled,
                       channels_last=cfg.clip.channels_last)
    vae.rule.check_buckets(cfg.clip.sampling.lengths, cfg.clip.sizes)
    if cfg.clip.store != "mean" and not vae.has_logvar:
        raise UsageError(f"--store {cfg.clip.store} needs the posterior log-variance, and {cfg.vae} gives only a mean; "
                         "use --store mean")
    clips, skipped = job.clips, list(job.skipped)

    shape = list(vae.latent_shape(cfg.clip.sampling.num_frames, cfg.clip.height, cfg.clip.width))
    stored = list(STORED_KEYS[cfg.clip.store])
    element = torch.empty((), dtype=vae.dtype).element_size() * len(stored)
    bytes_per_view = math.prod(shape) * element
    views = clips.views()
    histogram = bucket_histogram(clips, cfg.clip.fit, lambda b: list(vae.latent_shape(b.num_frames, b.height, b.width)),
                                 element) if cfg.clip.bucketed else []
    fingerprint = vae.fingerprint()
    report = PlanReport(
        config={**_config_json(cfg, device), "decoder": backend.name},
        vae={"spec": cfg.vae, "family": vae.family, "untrained": vae.untrained, "rule": vae.rule.to_json(),
             "latent_channels": vae.latent_channels, "normalization": vae.normalization,
             **{k: fingerprint[k] for k in ("precision", "tiling", "views_per_forward", "per_frame")}},
        scenes=SceneRows(clips, probes),
        skipped=[{"scene": s.scene_id, "path": s.path, "reason": s.reason} for s in skipped],
        clips=len(clips), cameras=clips[0].num_views if clips else len(scenes[0].cameras),
        views=views, frames=views * cfg.clip.sampling.num_frames,
        latent_shape=shape, stored=stored, dtype=recorded_name(vae.dtype),
        bytes_per_view=bytes_per_view, total_bytes=bytes_per_view * views,
        shares=dp_shares(job, cfg.clip_ids), buckets=histogram,
    )
    if histogram:
        report.frames = sum(b["views"] * b["num_frames"] for b in histogram)
        report.total_bytes = sum(b["bytes"] for b in histogram)
        for name in report.empty_buckets:
            report.notes.append(f"bucket {name} is empty: no scene was assigned to it")
    if job.views_per_forward > 1 and device.type == "cpu":
        report.notes.append(f"{job.views_per_forward} views per forward on CPU: oneDNN gives a batched forward other "
                            "bits for another intra-op thread count, so every run of one cache needs the same "
                            "threads per rank (OMP_NUM_THREADS) to match bit for bit")
    if vae.untrained:
        report.notes.append(f"{cfg.vae} is an untrained VAE with random weights: timings only, latents mean nothing")
    if vae.dtype_note:
        report.notes.append(vae.dtype_note)
    advice = sp_repeats_advice(cfg.batch_size, clips.views_per_clip(), job.views_per_forward, cfg.sp_size)
    if advice:
        report.notes.append(advice)
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
                size = (clip.bucket.height, clip.bucket.width) if clip.bucket is not None else (cfg.clip.height, cfg.clip.width)
                report.measurement = measure_clip(vae, clip, *size, fit=cfg.clip.fit, backend=backend)
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
            fits = report.fits_views_per_forward
            if fits == 0:
                report.notes.append("not even one view per forward fits --memory-budget: try --tiling, a smaller "
                                    "--size, or --dtype bf16")
            elif fits is not None and fits < job.views_per_forward:
                divisor = max(k for k in range(1, fits + 1) if job.views_per_forward % k == 0)
                report.notes.append(f"a forward of {job.views_per_forward} views does not fit --memory-budget (about "
                                    f"{fits} do): pass --views-per-forward {divisor}, or out-of-memory errors will "
                                    "halve the forwards (slower, and recorded)")
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


def bucket_histogram(clips: Any, fit: str, view_shape: Callable[[Any], list[int]], element_bytes: int,
                     ) -> list[dict[str, Any]]:
    """Pure: per bucket, one view's latent shape, the clips, views and bytes planned (`element_bytes` per latent
    element, all stored keys), and what --fit does to the sources in it: the mean
    share of source pixels kept (cover crops), the mean share of bucket pixels that are padding (contain),
    and the largest aspect distortion as a ratio >= 1 (stretch; 1.0 for the others). Empty buckets included."""
    sums = {bucket: [0.0, 0.0, 0.0, 1.0] for bucket, _, _ in clips.bucket_counts()}  # kept, padded, weight, distortion
    for bucket, position, clip_count in clips.bucket_parts():  # one pass, nothing kept per scene
        _, displayed = clips.scene_geometry(position)
        entry = sums[bucket]
        for width, height in displayed:
            geometry = fit_geometry(width, height, bucket.height, bucket.width, fit)
            left, top, right, bottom = geometry.pad
            inner = (bucket.width - left - right) * (bucket.height - top - bottom)
            entry[0] += clip_count * kept_share(geometry, width, height)
            entry[1] += clip_count * (1 - inner / (bucket.width * bucket.height))
            entry[2] += clip_count
            if fit == "stretch":
                entry[3] = max(entry[3], math.exp(aspect_distance(width, height, (bucket.height, bucket.width))))
    rows = []
    for bucket, count, views in clips.bucket_counts():
        kept, padded, weight, distortion = sums[bucket]
        shape = view_shape(bucket)
        rows.append({**bucket.to_record(), "view_shape": shape, "clips": count, "views": views,
                     "bytes": views * math.prod(shape) * element_bytes,
                     "mean_kept": round(kept / weight, 4) if weight else None,
                     "mean_padded": round(padded / weight, 4) if weight else None,
                     "max_distortion": round(distortion, 4) if weight else None})
    return rows


def decode_clip(clip: Clip, height: int, width: int, fit: str = "cover", backend: Backend = PYAV) -> torch.Tensor:
    """(views, 3, T, H, W) in [-1, 1], exactly as the encode pipeline feeds the VAE."""
    decoder = ViewDecoder(height, width, fit=fit, backend=backend)
    return torch.stack([decoder.decode(path, clip.frames) for path in clip.paths])


def measure_clip(vae: LoadedVae, clip: Clip, height: int, width: int, fit: str = "cover",
                 backend: Backend = PYAV) -> Measurement:
    """Encode one clip (after a warm-up forward) and read the time and the peak memory it took.

    Raises VideoDecodeError when the clip does not decode."""
    views = decode_clip(clip, height, width, fit, backend)
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
    vae.encode_views(views[:vae.views_per_forward])  # warm-up, one forward of the measured shape: lazy init,
    # kernel selection, allocator growth (and with --compile, the compile)
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = vae.encode_views(views)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss()
    frames_per_view = views.shape[2] if vae.per_frame else 1
    per_forward = min(vae.views_per_forward * frames_per_view, len(views) * frames_per_view)
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
        "data": str(cfg.data), "vae": cfg.vae, **cfg.clip.to_record(), "world_size": cfg.world_size,
        "sp_size": cfg.sp_size, "dp_size": cfg.world_size // cfg.sp_size, "batch_size": cfg.batch_size,
        "device": str(device), "memory_budget": cfg.memory_budget,
    }


__all__ = ["DpShare", "Measurement", "PlanConfig", "PlanReport", "bucket_histogram", "build_plan", "dp_shares",
           "fits_views_per_forward",
           "measure_clip"]
