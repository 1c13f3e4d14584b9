"""The batch loop of one rank: decoded views (DataLoader workers) -> the VAE on its SP group -> gathered
latents -> the shard writer, failures to the failure log."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vaecache.cache.io import AppendLog
from vaecache.cache.outdir import PreparedOut
from vaecache.cache.writer import ShardWriter, failure_record
from vaecache.distributed.context import DistContext
from vaecache.distributed.liveness import set_doing
from vaecache.encode.run import EncodeRun
from vaecache.encode.summary import EncodeSummary, RankCounters
from vaecache.encode.transfer import views_on_device_ahead
from vaecache.errors import InputError
from vaecache.parallel.encoders import encoder_for
from vaecache.parallel.views import SPPlan, gather_views
from vaecache.planning.clips import Clip, DoneMask, DoneMaskBuilder
from vaecache.planning.jobs import JobPlan, batch_views
from vaecache.settings.clip import ClipSettings
from vaecache.settings.dtypes import recorded_name
from vaecache.stop import ignore_stop_signals
from vaecache.vae import VaeRunner
from vaecache.video.dataset import ViewBatchDataset

log = logging.getLogger("vaecache")


def sample_noise(seed: int, clip_id: str, camera: str, shape: torch.Size) -> torch.Tensor:
    """Posterior noise for --store sample, from (seed, clip id, camera) only: independent of rank and batch."""
    key = hashlib.sha256(f"{seed}|{clip_id}|{camera}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def clip_tensors(clip: Clip, moments: torch.Tensor, channels: int, store: str, seed: int,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Split the (NC, 2c|c, t, h, w) moments of one clip into what --store asks for."""
    mean = moments[:, :channels]
    logvar = moments[:, channels:] if moments.shape[1] > channels else None
    if store == "mean":
        return {"mean": mean}
    if store == "mean-logvar":
        return {"mean": mean, "logvar": logvar}
    std = torch.exp(0.5 * logvar.float())
    noise = torch.stack([sample_noise(seed, clip.clip_id, cam, mean.shape[1:]) for cam in clip.cameras])
    return {"sample": (mean.float() + std * noise.to(std.device)).to(dtype)}


def overflowing_cameras(clip: Clip, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The cameras whose stored sample is not finite: a huge logvar makes mean + std * noise overflow its dtype
    even where mean and logvar are finite (those two are checked where they are encoded)."""
    sample = tensors.get("sample")
    if sample is None:
        return []
    return [camera for camera, view in zip(clip.cameras, sample) if not torch.isfinite(view).all()]


def _camera_of(cameras: Any, paths: Any, path: str | None) -> str | None:
    """The camera whose video is `path` (a decode or encode error names the file)."""
    return cameras[list(paths).index(path)] if path in paths else None


class FailureLog:
    """This rank's failure records (fsynced JSON lines), each handed to `on_failure` as soon as it is written; with
    OUT in object storage, `mirror` PUTs the log once, when the rank's share is done (`publish`): finalize reads it
    then, and a rerun records failures afresh, so a crash before loses nothing a resume needs."""

    def __init__(self, path: Path, on_failure: Callable[[dict[str, Any]], None] | None,
                 mirror: Callable[[], None] | None = None) -> None:
        self._log = AppendLog(path)
        self._on_failure = on_failure
        self._mirror = mirror
        self._count = 0

    def append(self, record: dict[str, Any]) -> None:
        self._log.append(record)
        self._count += 1
        if self._on_failure is not None:
            self._on_failure(record)

    def publish(self) -> None:
        """With OUT in object storage, PUT the log (where this rank recorded any failure)."""
        if self._mirror is not None and self._count:
            self._mirror()

    def close(self) -> None:
        self._log.close()


def encode_share(run: EncodeRun, job: JobPlan, prepared: PreparedOut,
                 begin_again: Callable[[int, DoneMaskBuilder], PreparedOut],
                 on_progress: Callable[[int, int], None] | None, feed: DecodeFeed | None = None) -> EncodeSummary:
    """This rank's share of the encode: its logs in `run.out.folder`, its shards, commits and failure logs through OUT's
    commit protocol (`run.out`). `feed`: the decode of this rank's share of `job`, started while OUT was prepared
    (given only where prepare found nothing committed, so the share is the one it would be now); None: started
    here. Either is closed here."""
    ctx, stop, writing = run.ctx, run.stop, run.writing
    vae, num_scenes = run.start.vae, run.start.scenes
    rank, mesh = ctx.info.rank, ctx.mesh
    todo = job.todo
    if prepared.complete and not todo:
        return EncodeSummary(run.out.store.location, world_size=ctx.info.world_size, sp_size=mesh.sp_size,
                             untrained_vae=vae.model.untrained, resumed_clips=prepared.committed_clips,
                             planned_clips=len(job.clips), scenes=num_scenes, already_complete=True)
    if prepared.complete:  # the dataset grew: the finished cache is about to change
        attempt = prepared.attempt
        prepared, done = ctx.on_rank0(lambda: marking_done(job, lambda mark: begin_again(attempt, mark)))
        # begin_changes repairs the progress logs: a shard it dropped must be encoded again
        job = dataclasses.replace(job, done=done)
    feed = feed if feed is not None else DecodeFeed(run, job)
    work, sp_plans, encoder = feed.work, feed.sp_plans, feed.encoder
    failures = FailureLog(run.out.failure_log_file(rank), run.reporting.on_failure,
                          run.out.mirror(run.out.failure_log_file(rank)))
    if rank == 0:
        for skip in job.skipped:
            failures.append(failure_record(skip.scene_id, skip.reason, path=skip.path, camera=skip.camera))
            log.warning("skipped scene %s: %s%s", skip.scene_id, skip.reason, f" ({skip.path})" if skip.path else "")
    counters = RankCounters()
    progress_log = run.out.progress_log(rank) if mesh.is_writer else None
    writer = (ShardWriter(run.out, rank, prepared.attempt, writing.shard_size, progress_log,
                          hash_sources=writing.hash_sources, fit=run.clip.fit if run.clip.bucketed else None,
                          commit_every_s=writing.commit_every_s)
              if progress_log else None)
    sink = _BatchSink(run.on_error, run.clip, ctx, vae, writer, failures, counters)
    loop_started = time.perf_counter()
    taken = 0
    try:
        for taken, item in enumerate(views_on_device_ahead(feed.take(), ctx.device, len(work.batches)), start=1):
            batch, sp_plan = work.batches[item["index"]], sp_plans[item["index"]]
            # Ranks of one SP group must stop at the same batch, or the all_gather below would hang.
            if ctx.sp_any(stop.requested):
                counters.stopped = stop.signal_name or "a peer's signal"
                break
            if mesh.sp_size == 1 and len(item["errors"]) == len(batch):  # nothing decoded: no forward to run
                sink.commit(batch, None, 0, BatchOutcome(dict(item["errors"]), {}, {}))
            else:
                set_doing(f"encoding clip {batch[0].clip_id} (batch {item['index'] + 1} of {len(work.batches)})")
                result = encoder.encode(vae, item["views"], ctx.sp_group)
                moments = result.mean if result.logvar is None else torch.cat([result.mean, result.logvar], dim=1)
                moments = gather_views(moments, sp_plan, ctx.sp_group)
                outcome = _batch_outcome(ctx, sp_plan, batch, item["errors"], item["readings"], result)
                counters.backoffs.extend(result.backoffs)
                sink.commit(batch, moments, result.mean.shape[1], outcome)
            if on_progress is not None:
                on_progress(len(batch), len(work.clips))
            if taken == len(work.batches) and writer is not None:
                # the last shards written while the decode workers end (the loader's next step), not after
                writer.flush()
        if counters.stopped is None and taken != len(work.batches):  # the last one is not asked for more
            raise RuntimeError(f"rank {rank}: the decode gave {taken} of the share's {len(work.batches)} batches")
        if writer is not None:
            # A lone rank's finalize waits for its last commit record beside the tables; other ranks' commit records
            # are there before rank 0 lists them, and a stopped run's before it ends.
            writer.close(settle=ctx.info.world_size > 1 or counters.stopped is not None)
        failures.publish()
        loop_s = time.perf_counter() - loop_started
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        feed.close()
        failures.close()
        if progress_log is not None:
            progress_log.close()
    counters.bytes_written = writer.bytes_written if writer else 0
    counters.shards = len(writer.committed) if writer else 0
    summary = EncodeSummary(run.out.store.location, world_size=ctx.info.world_size, sp_size=mesh.sp_size,
                            untrained_vae=vae.model.untrained, resumed_clips=prepared.committed_clips,
                            planned_clips=len(job.clips), scenes=num_scenes,
                            startup_s=loop_started - run.started, encode_s=loop_s,
                            buckets=planned_buckets(run.clip, job))
    set_doing("waiting for the other ranks to finish their shares")
    # Every rank gathers, stopped or not: a DP group that finished waits here for one that stopped, and all
    # of them learn that the job stopped (no finalize, exit 75) instead of waiting in finalize for it.
    for part in ctx.all_gather_object(counters):
        part.add_to(summary)
    return summary


class DecodeFeed:
    """A rank's share and the decode of it, under way: the DataLoader's workers are forked when it is made, so a run
    can start them while OUT is prepared. `take()` hands the batches over once; `close()` ends the workers."""

    def __init__(self, run: EncodeRun, job: JobPlan) -> None:
        ctx, workers = run.ctx, run.workers
        self.work = job.rank_work(ctx.info.rank)
        self.encoder = encoder_for(run.sp_mode)
        view_indices, self.sp_plans = self.encoder.layout(self.work,
                                                          [len(batch_views(batch)) for batch in self.work.batches])
        self._dataset = ViewBatchDataset(self.work.batches, view_indices, run.clip.height, run.clip.width,
                                         run.clip.fit, run.start.backend, run.clip.sampling.max_frame_pixels,
                                         run.held)
        loader = torch.utils.data.DataLoader(
            self._dataset,
            batch_size=None, shuffle=False, num_workers=workers, pin_memory=ctx.device.type == "cuda",
            prefetch_factor=4 if workers else None, worker_init_fn=ignore_stop_signals,
        )
        self._dataset.hold_first(max(workers, 1))  # the first batch of each decode worker
        self._batches: Iterator[Any] | None = workers_started(loader)
        if workers:
            self._dataset.hold_first(0)  # the workers were forked holding them: this process lets them go

    def take(self) -> Iterator[Any]:
        batches, self._batches = self._batches, None
        if batches is None:
            raise RuntimeError("a DecodeFeed's batches are taken once")
        return batches

    def close(self) -> None:
        """The workers ended (where the batches were never taken; else with the last reference to them)."""
        self._batches = None
        self._dataset.close()


def workers_started(loader: torch.utils.data.DataLoader) -> Iterator[Any]:
    """The loader's iterator, its decode workers forked with every object this process holds out of the children's
    garbage collector. A decoder left here as cyclic garbage (FFmpeg frame threads and all) would otherwise be freed
    by a child's collector, which then waits forever to join threads that do not exist there. This process collects
    it as before once the workers are forked; unlike a gc.collect() before the fork it costs nothing."""
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


def planned_buckets(clip: ClipSettings, job: JobPlan) -> list[dict[str, Any]]:
    """A bucketed run's buckets with the clips and views planned in each (committed ones included)."""
    if not clip.bucketed or not hasattr(job.clips, "bucket_counts"):
        return []
    return [{**bucket.to_record(), "clips": clips, "views": views}
            for bucket, clips, views in job.clips.bucket_counts()]


def _real_views(plan: SPPlan, sp_rank: int, count: int) -> list[int | None]:
    """For each row this rank encoded: the batch view it is, or None for a padding copy."""
    if plan.is_local:
        return list(range(count))
    start = sp_rank * plan.per_rank
    return [p if p < plan.num_views else None for p in range(start, start + count)]


@dataclass
class BatchOutcome:
    """What the SP group learnt about one batch, the same on every rank of the group."""

    errors: dict[int, tuple[str, str, bool]]
    """Clip index -> (path, reason, whole_file) for clips some rank could not decode or encode; whole_file: the
    source itself failed (ViewBatchDataset), not these frames."""
    settings: dict[int, dict[str, Any]]
    """Batch view -> what produced it (tiling, units per forward)."""
    readings: dict[int, dict[str, Any]]
    """Clip index -> how its cameras were read (vaecache.video.dataset.clip_reading, and "times": seconds of each of
    its frames from the camera's first frame)."""


def _batch_outcome(ctx: DistContext, plan: SPPlan, batch: tuple[Clip, ...],
                   decode_errors: dict[int, tuple[str, str, bool]],
                   readings: dict[int, dict[str, Any]], result: Any) -> BatchOutcome:
    """Merge this rank's decode and encode results for `batch` with its SP peers'."""
    views = batch_views(batch)
    errors = dict(decode_errors)
    readings = dict(readings)
    settings: dict[int, dict[str, Any]] = {}
    for row, view in enumerate(_real_views(plan, ctx.mesh.sp_rank, result.mean.shape[0])):
        if view is None:
            continue
        settings[view] = result.view_settings(row)
        if row in result.failed:
            ref = views[view]
            clip = batch[ref.clip_index]
            errors.setdefault(ref.clip_index, (clip.paths[ref.camera_index],
                                               f"camera {clip.cameras[ref.camera_index]}: {result.failed[row]}", False))
    if ctx.mesh.sp_size > 1 and not plan.is_local:
        for part_errors, part_settings, part_readings in ctx.sp_all_gather_object((errors, settings, readings)):
            for clip_index, error in part_errors.items():
                errors.setdefault(clip_index, error)
            settings.update(part_settings)
            for clip_index, reading in part_readings.items():
                readings.setdefault(clip_index, reading)
    return BatchOutcome(errors, settings, readings)


@dataclass
class _BatchSink:
    """Where a gathered batch goes: its clips to the shard writer (writer ranks), its failures to the failure log."""

    on_error: str
    """--on-error: "fail" raises at the first clip that cannot be stored."""
    clip: ClipSettings
    """The clip settings the run encodes with (EncodeRun.clip)."""
    ctx: DistContext
    vae: VaeRunner
    writer: ShardWriter | None
    failures: FailureLog
    counters: RankCounters
    condemned: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """(scene, path) whose source failed as a whole: recorded once, as the scene's failure, not per clip."""

    def commit(self, batch: tuple[Clip, ...], moments: torch.Tensor | None, channels: int,
               outcome: BatchOutcome) -> None:
        errors, settings = outcome.errors, outcome.settings
        writer, counters = self.writer, self.counters
        view_start = 0
        for clip_index, clip in enumerate(batch):
            view_start += clip.num_views
            if clip_index in errors:
                path, reason, whole_file = errors[clip_index]
                if self.ctx.mesh.is_writer:
                    camera = _camera_of(clip.cameras, clip.paths, path)
                    if not whole_file:
                        self.failures.append(failure_record(clip.scene_id, reason, clip=clip.clip_id, path=path,
                                                            camera=camera))
                        log.warning("clip %s failed: %s: %s", clip.clip_id, path, reason)
                    elif (clip.scene_id, path) not in self.condemned:
                        self.condemned.add((clip.scene_id, path))
                        self.failures.append(failure_record(clip.scene_id, reason, path=path, camera=camera))
                        log.warning("scene %s failed: %s: %s (none of its clips is encoded)", clip.scene_id, path,
                                    reason)
                if self.on_error == "fail":
                    raise InputError(f"{path}: {reason}")
                continue
            if writer is not None:
                assert moments is not None  # a batch with a clip to store was encoded
                clip_moments = moments[view_start - clip.num_views:view_start]
                tensors = clip_tensors(clip, clip_moments, channels, self.clip.store, self.clip.seed,
                                       self.vae.model.dtype)
                overflowing = overflowing_cameras(clip, tensors)
                if overflowing:
                    reason = (f"camera {', '.join(overflowing)}: the sampled latent is not finite in "
                              f"{recorded_name(tensors['sample'].dtype)} (mean + exp(logvar / 2) * noise overflows)")
                    self.failures.append(failure_record(clip.scene_id, reason, clip=clip.clip_id,
                                                        camera=overflowing[0]))
                    log.warning("clip %s failed: %s", clip.clip_id, reason)
                    if self.on_error == "fail":
                        raise InputError(f"clip {clip.clip_id}: {reason}")
                    continue
                used = [settings[view_start - clip.num_views + c] for c in range(clip.num_views)]
                writer.add(clip, tensors, used, outcome.readings.get(clip_index))
                counters.clips += 1
                counters.views += clip.num_views
                counters.frames += clip.num_views * len(clip.frames)


def marking_done(job: JobPlan, prepare: Callable[[DoneMaskBuilder], PreparedOut]) -> tuple[PreparedOut, DoneMask]:
    """Rank 0: prepare OUT, marking the committed clips it keeps in the plan. Every rank gets the mask (a bit per
    planned clip), never the ids: a resume over ten million committed clips sends ~1.25 MB."""
    marks = DoneMaskBuilder(job.clips)
    prepared = prepare(marks)
    return prepared, marks.mask()
