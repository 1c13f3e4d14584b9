"""The encode loop: plan -> decode (DataLoader workers) -> encode (SP group) -> gather -> write."""

from __future__ import annotations

import dataclasses
import errno
import gc
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator

import torch

import vaecache
from vaecache.settings.clip import STORED_KEYS
from vaecache.settings.commands import EncodeConfig
from vaecache.video.backends import Backend, resolve_decoder
from vaecache.video.dataset import ViewBatchDataset
from vaecache.sources.discover import discover
from vaecache.sources.probing import probe_dataset, write_probe_records
from vaecache.distributed import DistContext
from vaecache.distributed.liveness import set_doing
from vaecache.settings.dtypes import recorded_name
from vaecache.errors import EXIT_OK, EXIT_PARTIAL, EXIT_STOPPED, InputError, OutputError, UsageError
from vaecache.cache.finalize import finalize
from vaecache.cache.manifest import manifest_header
from vaecache.cache.io import AppendLog
from vaecache.cache.layout import PROBES_DIR, FORMAT_VERSION, failures_path, probes_path, progress_path
from vaecache.cache.outdir import PreparedOut, begin_changes, describe_differences, prepare_out, recorded_cpu_threads, recorded_numerics_history, release_lock
from vaecache.cache.provenance import source_identities
from vaecache.cache.reader import CacheReader
from vaecache.cache.writer import ShardWriter, failure_record
from vaecache.parallel import SPPlan, gather_views, plan_sp
from vaecache.planning import (Clip, DoneMask, DoneMaskBuilder, JobPlan, batch_views, plan_job,
                               sp_repeats_advice)
from vaecache.stop import StopRequest, ignore_stop_signals
from vaecache.transfer import views_on_device_ahead
from vaecache.vae import LoadedVae, load_vae
from vaecache.vae.load import CUDA_NUMERICS

log = logging.getLogger("vaecache")


@dataclass
class EncodeSummary:
    """What a finished encode did, summed over ranks (filled on every rank, printed by rank 0)."""

    out: Path
    clips: int = 0
    views: int = 0
    frames: int = 0
    resumed_clips: int = 0
    planned_clips: int = 0
    scenes: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    latent_shape: dict[str, list[int]] = field(default_factory=dict)
    bytes_written: int = 0
    shards: int = 0
    wall_s: float = 0.0
    startup_s: float = 0.0
    """This rank's time from the start to its first batch: discovery, probing, planning, VAE load, OUT."""
    encode_s: float = 0.0
    """This rank's encode loop: decoding, encoding and committing its clips (not the wait for other ranks)."""
    finalize_s: float = 0.0
    """Waiting for the other ranks, and rank 0 merging the progress logs into the manifest."""
    world_size: int = 1
    sp_size: int = 1
    untrained_vae: bool = False
    backoffs: list[str] = field(default_factory=list)
    stopped: str | None = None
    """The signal that stopped this rank early (the cache is resumable, not complete)."""
    repaired: list[str] = field(default_factory=list)
    """Committed shards found damaged at start-up ("file: problem"), dropped and their clips encoded again."""
    left_out_cameras: dict[str, int] = field(default_factory=dict)
    """Cameras some scenes have that the chosen camera set does not encode -> how many scenes have each."""
    already_complete: bool = False
    """OUT already held every planned clip: nothing was encoded and no file in OUT was rewritten."""
    buckets: list[dict[str, Any]] = field(default_factory=list)
    """A bucketed run's buckets as planned: name, height, width, num_frames, clips, views (empty ones too)."""

    @property
    def empty_buckets(self) -> list[str]:
        return [bucket["name"] for bucket in self.buckets if not bucket["clips"]]

    @property
    def views_per_s(self) -> float:
        return self.views / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if self.stopped:
            return EXIT_STOPPED
        return EXIT_PARTIAL if self.skipped else EXIT_OK


def run_fingerprint_vae_part(vae: LoadedVae) -> dict[str, Any]:
    """The VAE's identity as recorded (JSON round-tripped, so it compares equal to a stored copy)."""
    return json.loads(json.dumps({k: v for k, v in vae.fingerprint().items() if k != "spec"}))


def run_numerics(device: torch.device, threads: int) -> dict[str, Any]:
    """What decides the last bits of the latents besides the settings: torch, the device kind and, on CPU, the
    kernels' instruction set and the intra-op thread count (oneDNN splits a convolution's work by it).

    Part of the run fingerprint: a resume on another kind of GPU, another torch or (CPU) another thread count
    would otherwise add latents that differ from the committed ones in the last bits, unnoticed."""
    numerics: dict[str, Any] = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        numerics.update(gpu=torch.cuda.get_device_name(device), capability=f"{major}.{minor}",
                        cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    elif device.type == "cpu":
        numerics.update(cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=threads)
    return numerics


def run_fingerprint(cfg: EncodeConfig, vae: LoadedVae, decoder: Backend, numerics: dict[str, Any]) -> dict[str, Any]:
    """Everything that determines stored bytes; a resume must match it exactly."""
    # The decoder is part of it: a cache started by 0.1.0 (decord, mis-seeking on open-GOP streams) must not
    # be resumed with frame-exact decoding into one mixed cache; nor pyav with another --decoder.
    fingerprint = {"vae": run_fingerprint_vae_part(vae), "latents": cfg.clip.to_record(), "decoder": decoder.name,
                   "data": str(cfg.data), "format_version": FORMAT_VERSION, "numerics": numerics}
    if cfg.sp_mode == "spatial":  # band edges depend on the group size, and so do the last bits of the latents
        fingerprint["parallel"] = {"mode": "spatial", "sp_size": cfg.sp_size}
    return fingerprint


def _cpu_thread_budget(ctx: DistContext, workers: int, recorded: int | None = None) -> int:
    """On CPU, give the VAE the cores this rank can use minus its decode workers; OMP_NUM_THREADS wins, then
    the count `recorded` by the cache being resumed (another count would change the latents' last bits).

    torch's default (every core) plus decode workers oversubscribes the machine, and busy-waiting
    OpenMP threads then slow the encode several-fold as soon as anything else runs."""
    if ctx.device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    fitting = max(1, _cores_per_rank(ctx) - workers)
    if recorded and recorded != fitting and ctx.info.rank == 0:
        log.warning("resuming with %d torch threads per rank, as the cache records (this machine would give %d): "
                    "another count changes the latents' last bits", recorded, fitting)
    threads = recorded or fitting
    torch.set_num_threads(threads)
    return threads


def _cores_per_rank(ctx: DistContext) -> int:
    return len(os.sched_getaffinity(0)) // max(1, ctx.info.local_world_size)


def decode_thread_budget(cores: int, workers: int, main_threads: int) -> int:
    """FFmpeg threads per video a decode worker opens: the `cores` of a rank its main process leaves, shared by
    its `workers` (with none, the main process decodes between forwards and may use every core).

    FFmpeg's own default (a thread per core of the machine, in every worker) had decoding preempt the encode:
    on 2 cores with one worker the same forward ran 4-7% slower inside vaecache than alone (scripts/bench.py)."""
    if not workers:
        return max(1, cores)
    return max(1, (cores - main_threads) // workers)


def _decode_thread_budget(ctx: DistContext, workers: int, encode_threads: int) -> int:
    # On CUDA the main thread only launches kernels and copies: one core.
    return decode_thread_budget(_cores_per_rank(ctx), workers, encode_threads if ctx.device.type == "cpu" else 1)


def setup_logging(out: Path, rank: int, world: int) -> logging.Handler:
    """This rank's log file in OUT/logs; none (a handler that drops records) where OUT is read-only: a complete
    cache on a read-only mount is still confirmed complete."""
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(out / "logs" / f"rank-{rank:05d}.log")
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise OutputError(f"{out / 'logs'}: cannot write the rank log ({exc.strerror or exc})") from None
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank}/{world} %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


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


def _camera_of(cameras: Any, paths: Any, path: str | None) -> str | None:
    """The camera whose video is `path` (a decode or encode error names the file)."""
    return cameras[list(paths).index(path)] if path in paths else None


@dataclass
class RankCounters:
    """What one rank's encode loop did; the ranks' counters are summed into the EncodeSummary."""

    clips: int = 0
    views: int = 0
    frames: int = 0
    failed: int = 0
    bytes_written: int = 0
    shards: int = 0
    backoffs: list[str] = field(default_factory=list)
    stopped: str | None = None
    """The signal that ended this rank's loop early, if one did."""

    def add_to(self, summary: EncodeSummary) -> None:
        summary.clips += self.clips
        summary.views += self.views
        summary.frames += self.frames
        summary.bytes_written += self.bytes_written
        summary.shards += self.shards
        summary.backoffs.extend(self.backoffs)
        if self.stopped and not summary.stopped:
            summary.stopped = self.stopped


Advance = Callable[[int, int], None]
"""advance(steps_done_now, total)."""
ProgressFactory = Callable[[str, str], ContextManager[Advance]]
"""progress(label, unit) -> a context that yields an Advance (vaecache.progress.progress, bound to a console)."""


@contextmanager
def _phase(progress: ProgressFactory | None, label: str, unit: str) -> Iterator[Advance]:
    if progress is None:
        yield lambda steps, total: None
        return
    with progress(label, unit) as advance:
        yield advance


def _check_out_usable(out: Path) -> None:
    """What can be told about OUT without the run fingerprint (prepare_out checks the rest)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: --out exists and is not a folder")


@dataclass(frozen=True)
class StartUp:
    """What start-up found before OUT is touched: the job plan, the loaded VAE, the thread budgets."""

    job: JobPlan
    scenes: int
    probe_records: tuple[dict[str, Any], ...]
    """This rank's new probe-cache records, written to OUT/probes once OUT is prepared."""
    sources: tuple[str, ...]
    """Every source video the discovered scenes name (skipped scenes too)."""
    left_out_cameras: dict[str, int]
    vae: LoadedVae
    threads: int
    """torch intra-op threads of this rank."""
    decode_threads: int
    """FFmpeg threads per video a decode worker opens (pyav)."""


def run_encode(cfg: EncodeConfig, ctx: DistContext, on_progress: Advance | None = None,
               progress: ProgressFactory | None = None) -> EncodeSummary:
    """Encode the dataset into OUT on this rank; returns the job-wide summary.

    `on_progress(clips_done_now, clips_of_this_rank)` is called after each batch; `progress`, where given,
    shows the probing of this rank's scenes and then its clips."""
    started = time.perf_counter()
    # Start-up writes nothing, so a Ctrl-C in it ends the command at once (the CLI prints one line).
    start = _start_up(cfg, ctx, progress)
    # What --views-per-forward all came to for this dataset: recorded, and compared on resume.
    cfg = dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, views_per_forward=start.job.views_per_forward))
    # From here on stop signals are caught, so one arriving while OUT is prepared or the manifest is
    # written cannot kill the rank between commits; the encode loop polls the flag.
    with StopRequest() as stop:
        return _run_encode(cfg, ctx, start, stop, on_progress, progress, started)


def _start_up(cfg: EncodeConfig, ctx: DistContext, progress: ProgressFactory | None) -> StartUp:
    """Everything that can be checked without the VAE first (a typo in DATA or OUT fails at once), then the VAE."""
    found = discover(cfg.data, cfg.clip.cameras)
    scenes = found.scenes
    _check_out_usable(cfg.out)
    with _phase(progress, "probe", "scenes") as advance:
        probed = probe_dataset(scenes, ctx, cache_paths=lambda: (cfg.out / PROBES_DIR).glob("rank-*.jsonl"),
                               advance=advance)
    probes, records = probed.probes, probed.records
    requested = cfg.clip.views_per_forward
    if cfg.sp_mode == "spatial" and requested == "auto":
        requested = 1  # the group splits every view's rows: a forward is one view
    job = plan_job(scenes, probes, cfg.clip.sampling, ctx.info.world_size, ctx.mesh.sp_size,
                   cfg.batch_size, sizes=cfg.clip.sizes, views_per_forward=requested, device_type=ctx.device.type)
    del probes
    job = dataclasses.replace(job, skipped=(*found.rejected, *job.skipped))
    if job.skipped and cfg.on_error == "fail":
        first = job.skipped[0]
        raise InputError(f"{first.path or first.scene_id}: {first.reason} (scene {first.scene_id}; --on-error fail)")
    threads = _cpu_thread_budget(ctx, cfg.workers, None if cfg.overwrite else recorded_cpu_threads(cfg.out))
    decode_threads = _decode_thread_budget(ctx, cfg.workers, threads)
    advice = sp_repeats_advice(cfg.batch_size, job.clips.views_per_clip(), job.views_per_forward,
                               ctx.mesh.sp_size) if cfg.sp_mode == "views" else None
    if advice and ctx.info.rank == 0:
        log.warning("%s", advice)
    if job.views_per_forward > 1 and ctx.device.type == "cpu" and ctx.info.rank == 0:
        log.warning("%d views per forward on CPU: oneDNN gives a batched forward other bits for another intra-op "
                    "thread count (%d per rank here), so every run of this cache must give each rank the same "
                    "count (OMP_NUM_THREADS) to match bit for bit", job.views_per_forward, threads)
    set_doing(f"loading the VAE {cfg.vae}")
    vae = load_vae(cfg.vae, ctx.device, cfg.clip.dtype, tiling=cfg.clip.tiling,
                   views_per_forward=job.views_per_forward, allow_pickle_weights=cfg.allow_pickle_weights,
                   compiled=cfg.clip.compiled, channels_last=cfg.clip.channels_last)
    vae.rule.check_buckets(cfg.clip.sampling.lengths, cfg.clip.sizes)
    if cfg.clip.store != "mean" and not vae.has_logvar:
        raise UsageError(f"--store {cfg.clip.store} needs the posterior log-variance, and {cfg.vae} gives only a mean; use --store mean")
    if cfg.sp_mode == "spatial":
        _check_spatial(cfg, vae)
    sources = tuple(sorted({path for scene in scenes for path in scene.paths if path is not None}))
    return StartUp(job, len(scenes), tuple(records), sources, dict(found.left_out_cameras), vae, threads,
                   decode_threads)


def _check_spatial(cfg: EncodeConfig, vae: LoadedVae) -> None:
    """--sp-mode spatial needs a Wan VAE without tiling and at least one latent row per rank."""
    from vaecache.parallel.spatial import SUPPORTED_FAMILIES, plan_bands

    if vae.family not in SUPPORTED_FAMILIES:
        raise UsageError(f"--sp-mode spatial supports {', '.join(SUPPORTED_FAMILIES)}; {cfg.vae} is {vae.family} "
                         "(use --sp-mode views)")
    if cfg.clip.tiling:
        raise UsageError("--sp-mode spatial cannot be combined with --tiling")
    if cfg.clip.compiled or cfg.clip.channels_last:
        raise UsageError(f"--sp-mode spatial cannot be combined with --{'compile' if cfg.clip.compiled else 'channels-last'} "
                         "(it runs the encoder band by band, in the input's own memory format)")
    if vae.views_per_forward > 1:
        raise UsageError("--sp-mode spatial encodes one view per forward; drop --views-per-forward "
                         f"{vae.views_per_forward}")
    for height, _ in cfg.clip.sizes:
        plan_bands(height, vae.rule.spatial_factor, cfg.sp_size)


def _marking_done(job: JobPlan, prepare: Callable[[DoneMaskBuilder], PreparedOut]) -> tuple[PreparedOut, DoneMask]:
    """Rank 0: prepare OUT, marking the committed clips it keeps in the plan. Every rank gets the mask (a bit per
    planned clip), never the ids: a resume over ten million committed clips sends ~1.25 MB."""
    marks = DoneMaskBuilder(job.clips)
    prepared = prepare(marks)
    return prepared, marks.mask()


def _run_encode(cfg: EncodeConfig, ctx: DistContext, start: StartUp, stop: StopRequest,
                on_progress: Advance | None, progress: ProgressFactory | None, started: float) -> EncodeSummary:
    rank, world = ctx.info.rank, ctx.info.world_size
    mesh, vae, threads = ctx.mesh, start.vae, start.threads
    decoder = dataclasses.replace(resolve_decoder(cfg.clip.decoder, ctx.device, cfg.workers),
                                  threads=start.decode_threads)
    numerics = run_numerics(ctx.device, threads)
    other_numerics: list[dict[str, Any]] = []  # other ranks', where --allow-other-numerics lets them differ
    for peer, theirs in enumerate(ctx.all_gather_object(numerics)):
        if theirs == numerics or theirs in other_numerics:
            continue
        if not cfg.allow_other_numerics:
            differ = "; ".join(describe_differences(numerics, theirs))
            raise UsageError(f"rank {peer} computes with other numerics than rank {rank} ({differ}): its latents "
                             "would differ in the last bits; run every rank on the same kind of device and torch "
                             "(on CPU the same OMP_NUM_THREADS), or --allow-other-numerics to accept that (recorded)")
        other_numerics.append(theirs)
    fingerprint = run_fingerprint(cfg, vae, decoder, numerics)
    sources = source_identities(start.sources, cfg.hash_sources) if rank == 0 else None  # what OUT is made from
    prepared, done = ctx.on_rank0(lambda: _marking_done(start.job, lambda mark: prepare_out(
        cfg.out, fingerprint, cfg.overwrite, ctx.info.job_id, sources, mark, cfg.allow_other_numerics,
        other_numerics)))

    def begin_again(attempt: int, mark: DoneMaskBuilder) -> PreparedOut:
        return begin_changes(cfg.out, attempt, fingerprint, sources, mark, other_numerics)

    job = dataclasses.replace(start.job, done=done)
    write_probe_records(probes_path(cfg.out, rank), start.probe_records)
    handler = setup_logging(cfg.out, rank, world)
    try:
        log.info("vaecache %s: world %d = DP %d x SP %d, device %s (%d torch threads), %d decode workers "
                 "(%s, %d FFmpeg threads per video), attempt %d, %d clips already committed", vaecache.__version__,
                 world, mesh.dp_size, mesh.sp_size, ctx.device, threads, cfg.workers, decoder.choice,
                 decoder.threads, prepared.attempt, prepared.committed_clips)
        label = "encode" if mesh.dp_size == 1 else f"encode (rank 0's share of {mesh.dp_size} DP groups)"
        with _phase(progress, label, "clips") as advance:
            def report(done: int, total: int) -> None:
                advance(done, total)
                if on_progress is not None:
                    on_progress(done, total)

            summary = _encode(cfg, ctx, vae, decoder, job, start.scenes, prepared, begin_again, stop, report, started)
        summary.wall_s = time.perf_counter() - started
        summary.left_out_cameras = start.left_out_cameras
        summary.repaired = list(prepared.damaged)
        for name in summary.empty_buckets if rank == 0 else ():
            log.warning("bucket %s is empty: no scene was assigned to it", name)
        if summary.stopped:
            log.warning("stopped early (%s): committed work is kept; rerun the same command to resume", summary.stopped)
            return summary
        if summary.already_complete:
            if rank == 0:
                cache = CacheReader(cfg.out)
                summary.skipped = cache.failure_records()
                summary.latent_shape = cache.manifest.get("latent", {}).get("shape") or {}
            log.info("%s is complete: all %d planned clips are cached; nothing was changed", cfg.out,
                     summary.planned_clips)
            return summary
        set_doing("writing the manifest" if rank == 0 else "waiting for rank 0 to write the manifest")
        finalize_started = time.perf_counter()
        # every rank learns what finalize found, so every rank exits with the same code
        summary.skipped, summary.latent_shape = ctx.on_rank0(lambda: _finalize(cfg, vae, summary, fingerprint))
        summary.finalize_s = time.perf_counter() - finalize_started
        summary.wall_s = time.perf_counter() - started
        log.info("done: %d clips, %d views in %.1f s", summary.clips, summary.views, summary.wall_s)
        return summary
    finally:
        if rank == 0:
            release_lock(cfg.out)
        log.removeHandler(handler)
        handler.close()


def _encode(cfg: EncodeConfig, ctx: DistContext, vae: LoadedVae, decoder: Backend, job: JobPlan, num_scenes: int,
            prepared: PreparedOut, begin_again: Callable[[int, DoneMaskBuilder], PreparedOut], stop: StopRequest,
            on_progress: Callable[[int, int], None] | None, started: float) -> EncodeSummary:
    rank, mesh = ctx.info.rank, ctx.mesh
    todo = job.todo
    if prepared.complete and not todo:
        return EncodeSummary(cfg.out, world_size=ctx.info.world_size, sp_size=mesh.sp_size,
                             untrained_vae=vae.untrained, resumed_clips=prepared.committed_clips,
                             planned_clips=len(job.clips), scenes=num_scenes, already_complete=True)
    if prepared.complete:  # the dataset grew: the finished cache is about to change
        attempt = prepared.attempt
        prepared, done = ctx.on_rank0(lambda: _marking_done(job, lambda mark: begin_again(attempt, mark)))
        # begin_changes repairs the progress logs: a shard it dropped must be encoded again
        job = dataclasses.replace(job, done=done)
    work = job.rank_work(rank)
    failures = AppendLog(failures_path(cfg.out, rank))
    if rank == 0:
        for skip in job.skipped:
            failures.append(failure_record(skip.scene_id, skip.reason, path=skip.path, camera=skip.camera))
            log.warning("skipped scene %s: %s%s", skip.scene_id, skip.reason, f" ({skip.path})" if skip.path else "")
    spatial = cfg.sp_mode == "spatial"
    if spatial:  # every rank of the SP group decodes every view and encodes its band of each
        view_indices = tuple(tuple(range(len(batch_views(b)))) for b in work.batches)
        sp_plans = tuple(plan_sp(len(batch_views(b)), 1) for b in work.batches)
    else:
        view_indices, sp_plans = work.view_indices, work.sp_plans
    counters = RankCounters()
    dataset = ViewBatchDataset(work.batches, view_indices, cfg.clip.height, cfg.clip.width, cfg.clip.fit, decoder,
                               cfg.clip.sampling.max_frame_pixels)
    if cfg.workers:
        # Workers are forked. A decoder left as cyclic garbage here (FFmpeg frame threads and all) would be
        # freed by the child's collector, which then waits forever to join threads that do not exist there.
        gc.collect()
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None, shuffle=False, num_workers=cfg.workers, pin_memory=ctx.device.type == "cuda",
        prefetch_factor=4 if cfg.workers else None, worker_init_fn=ignore_stop_signals,
    )
    progress_log = AppendLog(progress_path(cfg.out, rank)) if mesh.is_writer else None
    writer = (ShardWriter(cfg.out, rank, prepared.attempt, cfg.shard_size, progress_log, hash_sources=cfg.hash_sources,
                          fit=cfg.clip.fit if cfg.clip.bucketed else None)
              if progress_log else None)
    sink = _BatchSink(cfg, ctx, vae, writer, failures, counters)
    loop_started = time.perf_counter()
    try:
        for item in views_on_device_ahead(loader, ctx.device):
            batch, sp_plan = work.batches[item["index"]], sp_plans[item["index"]]
            # Ranks of one SP group must stop at the same batch, or the all_gather below would hang.
            if ctx.sp_any(stop.requested):
                counters.stopped = stop.signal_name or "a peer's signal"
                break
            if mesh.sp_size == 1 and len(item["errors"]) == len(batch):  # nothing decoded: no forward to run
                sink.commit(batch, None, 0, BatchOutcome(dict(item["errors"]), {}, {}))
                if on_progress is not None:
                    on_progress(len(batch), len(work.clips))
                continue
            set_doing(f"encoding clip {batch[0].clip_id} (batch {item['index'] + 1} of {len(work.batches)})")
            result = vae.encode_spatial(item["views"], ctx.sp_group) if spatial else vae.encode_views(item["views"])
            moments = result.mean if result.logvar is None else torch.cat([result.mean, result.logvar], dim=1)
            moments = gather_views(moments, sp_plan, ctx.sp_group)
            outcome = _batch_outcome(ctx, sp_plan, batch, item["errors"], item["times"], result)
            counters.backoffs.extend(result.backoffs)
            sink.commit(batch, moments, result.mean.shape[1], outcome)
            if on_progress is not None:
                on_progress(len(batch), len(work.clips))
        if writer is not None:
            writer.close()
        loop_s = time.perf_counter() - loop_started
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        dataset.close()
        failures.close()
        if progress_log is not None:
            progress_log.close()
    counters.bytes_written = writer.bytes_written if writer else 0
    counters.shards = len(writer.committed) if writer else 0
    summary = EncodeSummary(cfg.out, world_size=ctx.info.world_size, sp_size=mesh.sp_size,
                            untrained_vae=vae.untrained, resumed_clips=prepared.committed_clips,
                            planned_clips=len(job.clips), scenes=num_scenes,
                            startup_s=loop_started - started, encode_s=loop_s, buckets=planned_buckets(cfg, job))
    set_doing("waiting for the other ranks to finish their shares")
    # Every rank gathers, stopped or not: a DP group that finished waits here for one that stopped, and all
    # of them learn that the job stopped (no finalize, exit 75) instead of waiting in finalize for it.
    for part in ctx.all_gather_object(counters):
        part.add_to(summary)
    return summary


def planned_buckets(cfg: EncodeConfig, job: JobPlan) -> list[dict[str, Any]]:
    """A bucketed run's buckets with the clips and views planned in each (committed ones included)."""
    if not cfg.clip.bucketed or not hasattr(job.clips, "bucket_counts"):
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
    times: dict[int, list[float]]
    """Clip index -> seconds of each of its frames from the video's first frame."""


def _batch_outcome(ctx: DistContext, plan: SPPlan, batch: tuple[Clip, ...],
                   decode_errors: dict[int, tuple[str, str, bool]],
                   times: dict[int, list[float]], result: Any) -> BatchOutcome:
    """Merge this rank's decode and encode results for `batch` with its SP peers'."""
    views = batch_views(batch)
    errors = dict(decode_errors)
    times = dict(times)
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
        for part_errors, part_settings, part_times in ctx.sp_all_gather_object((errors, settings, times)):
            for clip_index, error in part_errors.items():
                errors.setdefault(clip_index, error)
            settings.update(part_settings)
            for clip_index, stamps in part_times.items():
                times.setdefault(clip_index, stamps)
    return BatchOutcome(errors, settings, times)


@dataclass
class _BatchSink:
    """Where a gathered batch goes: its clips to the shard writer (writer ranks), its failures to the failure log."""

    cfg: EncodeConfig
    ctx: DistContext
    vae: LoadedVae
    writer: ShardWriter | None
    failures: AppendLog
    counters: RankCounters
    condemned: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """(scene, path) whose source failed as a whole: recorded once, as the scene's failure, not per clip."""

    def commit(self, batch: tuple[Clip, ...], moments: torch.Tensor | None, channels: int, outcome: BatchOutcome) -> None:
        errors, settings = outcome.errors, outcome.settings
        cfg, writer, counters = self.cfg, self.writer, self.counters
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
                    counters.failed += 1
                if cfg.on_error == "fail":
                    raise InputError(f"{path}: {reason}")
                continue
            if writer is not None:
                assert moments is not None  # a batch with a clip to store was encoded
                clip_moments = moments[view_start - clip.num_views:view_start]
                tensors = clip_tensors(clip, clip_moments, channels, cfg.clip.store, cfg.clip.seed, self.vae.dtype)
                used = [settings[view_start - clip.num_views + c] for c in range(clip.num_views)]
                writer.add(clip, tensors, used, outcome.times.get(clip_index))
                counters.clips += 1
                counters.views += clip.num_views
                counters.frames += clip.num_views * len(clip.frames)


def _finalize(cfg: EncodeConfig, vae: LoadedVae, summary: EncodeSummary, fingerprint: dict[str, Any],
              ) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """Rank 0, after every rank finished: merge progress logs into the manifest, written last. Returns the
    failure records and the latent shape."""
    header = manifest_header(
        producer={"vaecache": vaecache.__version__, "torch": torch.__version__, "python": platform.python_version(),
                  "numerics": fingerprint.get("numerics"),
                  **({"numerics_history": history} if (history := recorded_numerics_history(cfg.out)) else {}),
                  **({"cuda_numerics": CUDA_NUMERICS} if vae.device.type == "cuda" else {})},  # set by load_vae
        vae=vae.fingerprint(), fingerprint=fingerprint, frame_rule=vae.rule.to_json(),
        settings={**cfg.clip.to_record(), "decoder": fingerprint["decoder"], "data": str(cfg.data), "batch_size": cfg.batch_size,
                  "sp_size": cfg.sp_size, "sp_mode": cfg.sp_mode, "world_size": summary.world_size,
                  "shard_size": cfg.shard_size, "max_frame_pixels": cfg.clip.sampling.max_frame_pixels,
                  "vae_spec": cfg.vae},
        store=list(STORED_KEYS[cfg.clip.store]), dtype=recorded_name(vae.dtype), planned_clips=summary.planned_clips,
        oom_backoffs=len(summary.backoffs))
    if cfg.clip.bucketed:  # finalize counts the clips of each; the per-view shape comes from the VAE
        header["buckets"] = [{**bucket.to_record(),
                              "view_shape": list(vae.latent_shape(bucket.num_frames, bucket.height, bucket.width))}
                             for bucket in cfg.clip.buckets()]
    manifest = finalize(cfg.out, header)
    return CacheReader(cfg.out).failure_records(), manifest["latent"]["shape"] or {}
