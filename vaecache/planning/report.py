"""The `plan` dry-run report as plain data: scenes, clips, bytes, the split over DP groups and SP ranks, the
bucket histogram, and what a measured clip says (rendered by cli/plan.py, written by --json)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, overload

from vaecache.distributed.mesh import make_mesh
from vaecache.planning.clips import PlannedClips
from vaecache.planning.jobs import JobPlan
from vaecache.settings.buckets import aspect_distance, fit_geometry, kept_share
from vaecache.sources.scene import Scene, SceneProbe

PLAN_FORMAT = "vaecache-plan/1"


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
    decode_seconds: float | None = None
    """Decoding and resizing the clip's views in this process, with the FFmpeg threads an encode's decode worker
    gets (what its DataLoader workers do beside the encode)."""
    torch_threads: int | None = None
    """Intra-op threads of the measured encode: on CPU what one rank of the planned launch gets."""


@dataclass(frozen=True)
class Eta:
    """How the ETA is made: start-up, then the busiest rank's views at the pipeline's pace per view."""

    startup_s: float
    """Measured here: discovery, probing and the VAE load (an encode splits probing over its ranks)."""
    views_busiest_rank: int
    encode_s_per_view: float
    decode_s_per_view: float
    workers: int
    seconds_per_view: float
    """With decode workers the decode overlaps the encode: max(encode, decode / workers); without, their sum."""

    @property
    def total_s(self) -> float:
        return self.startup_s + self.views_busiest_rank * self.seconds_per_view


def pipeline_eta(startup_s: float, views_busiest_rank: int, measurement: Measurement, workers: int) -> Eta:
    """The ETA of an encode from one measured clip (pure)."""
    encode = measurement.seconds_per_view
    decode = (measurement.decode_seconds or 0.0) / max(1, measurement.views)
    per_view = max(encode, decode / workers) if workers > 0 else encode + decode
    return Eta(startup_s, views_busiest_rank, encode, decode, workers, per_view)


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
    eta: Eta | None = None
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
            "eta": asdict(self.eta) if self.eta else None,
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
