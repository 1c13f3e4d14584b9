"""The encode loop: plan -> decode (DataLoader workers) -> encode (SP group) -> gather -> write."""

from __future__ import annotations

import dataclasses
import errno
import logging
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

import vaecache
from vaecache.cache.commits import open_out
from vaecache.cache.manifest import manifest_header
from vaecache.cache.outdir import (
    PreparedOut,
    describe_differences,
)
from vaecache.cache.provenance import source_identities
from vaecache.cache.store import open_store
from vaecache.distributed.context import DistContext
from vaecache.distributed.liveness import set_doing
from vaecache.encode.encode_run import EncodeRun, Reporting
from vaecache.encode.fingerprint import run_fingerprint
from vaecache.encode.loop import DecodeFeed, encode_share, marking_done
from vaecache.encode.numerics import cpu_thread_budget, rank_decode_threads, run_numerics, torch_threads_kept
from vaecache.encode.startup import StartRequest, start_notes, start_up
from vaecache.encode.summary import EncodeSummary
from vaecache.errors import OutputError, UsageError
from vaecache.meter import Advance, MeterFactory, meter_phase
from vaecache.planning.clips import DoneMaskBuilder
from vaecache.settings.clip import STORED_KEYS
from vaecache.settings.commands import EncodeConfig, reading_record
from vaecache.settings.dtypes import recorded_name
from vaecache.sources.probing import write_probe_records
from vaecache.stop import StopRequest
from vaecache.urls import holding_objects
from vaecache.vae.load import CUDA_NUMERICS

log = logging.getLogger("vaecache")


def setup_logging(out: Any, rank: int, world: int) -> logging.Handler:
    """This rank's log file in OUT/logs (`out`: OUT's commit protocol); none (a handler that drops records) where
    OUT is read-only: a complete cache on a read-only mount is still confirmed complete."""
    try:
        handler: logging.Handler = logging.FileHandler(out.log_file(rank))
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise OutputError(f"{out.folder / 'logs'}: cannot write the rank log ({exc.strerror or exc})") from None
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank}/{world} %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def run_encode(cfg: EncodeConfig, ctx: DistContext, on_progress: Advance | None = None,
               meter: MeterFactory | None = None,
               on_failure: Callable[[dict[str, Any]], None] | None = None) -> EncodeSummary:
    """Encode the dataset into OUT on this rank; returns the job-wide summary.

    `on_progress(clips_done_now, clips_of_this_rank)` is called after each batch; `meter`, where given,
    shows the probing of this rank's scenes and then its clips; `on_failure(record)` gets each failure record
    (an input that produced no clip) this rank writes, as it writes it."""
    started = time.perf_counter()
    out = open_out(open_store(cfg.out, dict(cfg.storage_options)))  # a URL's work folder is removed at the end
    try:
        with torch_threads_kept():
            return _start_and_run(EncodeRun(cfg, ctx, out, started, Reporting(on_progress, meter, on_failure)))
    finally:
        out.close()


def _start_and_run(run: EncodeRun) -> EncodeSummary:
    # Start-up writes nothing, so a Ctrl-C in it ends the command at once (the CLI prints one line).
    ctx = run.ctx
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-out") as pool:
        # OUT usable as far as can be told before the fingerprint, and a URL's records fetched, while DATA is listed
        pulled = pool.submit(run.out.pull_start) if not run.out.store.local else None
        if pulled is None:
            run.out.pull_start()

        def out_ready() -> str | None:
            if pulled is not None:
                pulled.result()
            return None if run.cfg.overwrite else run.out.recorded_encoder_impl()

        with holding_objects():  # the small videos probing reads whole, for each decode worker's first batch
            start = start_up(StartRequest(run.cfg, ctx.device, ctx.info.world_size, ctx.mesh.sp_size,
                                          on_error=run.cfg.on_error, probe_cache=run.out.probes_folder(),
                                          out_ready=out_ready), ctx, run.reporting.meter)
    # From here on stop signals are caught, so one arriving while OUT is prepared or the manifest is
    # written cannot kill the rank between commits; the encode loop polls the flag.
    with StopRequest() as stop:
        summary = _run_encode(dataclasses.replace(run, start=start, stop=stop))
    summary.out = run.cfg.out
    return summary


def _run_encode(run: EncodeRun) -> EncodeSummary:
    cfg, ctx, start = run.cfg, run.ctx, run.start
    assert start is not None
    rank = ctx.info.rank
    mesh, vae = ctx.mesh, start.vae
    threads = cpu_thread_budget(ctx, cfg.workers, None if cfg.overwrite else run.out.recorded_cpu_threads())
    decoder = dataclasses.replace(start.backend, threads=rank_decode_threads(ctx, cfg.workers, threads))
    run = dataclasses.replace(run, decoder=decoder)
    for note in (start_notes(start.job, cfg.batch_size, mesh.sp_size, cfg.sp_mode, ctx.device, threads)
                 if rank == 0 else ()):
        log.warning("%s", note)
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
    fingerprint = run_fingerprint(cfg, run.clip, vae, decoder, numerics, start.images)
    sources = source_identities(start.sources(), cfg.hash_sources) if rank == 0 else None  # what OUT is made from
    # Into an OUT that held no run (or --overwrite) nothing is committed: the decode starts while OUT is prepared (a
    # lock and a run record, round trips in object storage). Prepare decides; a guess it refutes is dropped.
    feed = DecodeFeed(run, start.job) if cfg.overwrite or run.out.looked_empty() else None
    try:
        return _prepare_and_encode(run, fingerprint, sources, other_numerics, feed)
    finally:
        if feed is not None:
            feed.close()


def _prepare_and_encode(run: EncodeRun, fingerprint: dict[str, Any], sources: dict[str, dict[str, Any]] | None,
                        other_numerics: list[dict[str, Any]], feed: DecodeFeed | None) -> EncodeSummary:
    cfg, ctx, start = run.cfg, run.ctx, run.start
    assert start is not None
    rank, world, mesh = ctx.info.rank, ctx.info.world_size, ctx.mesh
    prepared, done = ctx.on_rank0(lambda: marking_done(start.job, lambda mark: run.out.prepare(
        fingerprint, cfg.overwrite, ctx.info.job_id, sources, mark, cfg.allow_other_numerics, other_numerics)))
    if feed is not None and (prepared.complete or done.count):
        feed.close()
        feed = None

    def begin_again(attempt: int, mark: DoneMaskBuilder) -> PreparedOut:
        return run.out.begin_again(attempt, fingerprint, sources, mark, other_numerics)

    job = dataclasses.replace(start.job, done=done)
    probes = run.out.probes_file(rank)
    write_probe_records(probes, start.probe_records)
    publish_probes = run.out.mirror(probes)
    # PUT while the encode starts (a round trip off the start-up); waited for before the summary
    probes_put = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-probes")
    probes_done = probes_put.submit(publish_probes) if publish_probes is not None and probes.is_file() else None
    handler = setup_logging(run.out, rank, world)
    try:
        log.info("vaecache %s: world %d = DP %d x SP %d, device %s (%d torch threads), %d decode workers "
                 "(%s, %d FFmpeg threads per video), attempt %d, %d clips already committed", vaecache.__version__,
                 world, mesh.dp_size, mesh.sp_size, ctx.device, torch.get_num_threads(), cfg.workers,
                 run.decoder.choice, run.decoder.threads, prepared.attempt,  # type: ignore[union-attr]
                 prepared.committed_clips)
        label = "encode" if mesh.dp_size == 1 else f"encode (rank 0's share of {mesh.dp_size} DP groups)"
        with meter_phase(run.reporting.meter, label, "clips") as advance:
            def report(done: int, total: int) -> None:
                advance(done, total)
                if run.reporting.on_progress is not None:
                    run.reporting.on_progress(done, total)

            summary = encode_share(run, job, prepared, begin_again, report, feed)
        if probes_done is not None:
            probes_done.result()
        summary.wall_s = time.perf_counter() - run.started
        summary.left_out_cameras = start.left_out_cameras
        summary.repaired = list(prepared.damaged)
        for name in summary.empty_buckets if rank == 0 else ():
            log.warning("bucket %s is empty: no scene was assigned to it", name)
        if summary.stopped:
            log.warning("stopped early (%s): committed work is kept; rerun the same command to resume", summary.stopped)
            return summary
        if summary.already_complete:
            if rank == 0:
                cache = run.out.finished()
                summary.skipped = cache.failure_records()
                summary.latent_shape = cache.manifest.get("latent", {}).get("shape") or {}
            log.info("%s is complete: all %d planned clips are cached; nothing was changed", run.out.where(),
                     summary.planned_clips)
            return summary
        set_doing("writing the manifest" if rank == 0 else "waiting for rank 0 to write the manifest")
        finalize_started = time.perf_counter()
        # every rank learns what finalize found, so every rank exits with the same code
        summary.skipped, summary.latent_shape = ctx.on_rank0(lambda: _finalize(run, summary, fingerprint))
        summary.finalize_s = time.perf_counter() - finalize_started
        summary.wall_s = time.perf_counter() - run.started
        log.info("done: %d clips, %d views in %.1f s", summary.clips, summary.views, summary.wall_s)
        return summary
    finally:
        probes_put.shutdown(wait=True)
        log.removeHandler(handler)
        handler.close()
        run.out.end_run(rank, prepared.attempt, run.out.log_file(rank), holds_lock=rank == 0)


def _finalize(run: EncodeRun, summary: EncodeSummary,
              fingerprint: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """Rank 0, after every rank finished: merge progress logs into the manifest, written last. Returns the
    failure records and the latent shape. With OUT in object storage, the work folder's logs are first rebuilt
    from every rank's commit records, and the tables and the manifest (last) then PUT (`run.out`)."""
    cfg, vae = run.cfg, run.start.vae  # type: ignore[union-attr]
    header = manifest_header(
        producer={"vaecache": vaecache.__version__, "torch": torch.__version__, "python": platform.python_version(),
                  "numerics": fingerprint.get("numerics"),
                  **({"numerics_history": history} if (history := run.out.numerics_history()) else {}),
                  **({"cuda_numerics": CUDA_NUMERICS} if vae.model.device.type == "cuda" else {})},  # set by load_vae
        vae=vae.model.fingerprint(), fingerprint=fingerprint, frame_rule=vae.model.rule.to_json(),
        settings={**run.clip.to_record(), "decoder": fingerprint["decoder"], "data": str(cfg.data),
                  "batch_size": cfg.batch_size,
                  "sp_size": cfg.sp_size, "sp_mode": cfg.sp_mode, "world_size": summary.world_size,
                  "shard_size": cfg.shard_size, "max_frame_pixels": run.clip.sampling.max_frame_pixels,
                  "vae_spec": cfg.vae,
                  # how DATA was read, for `verify --dataset` (recorded only when given: older caches stay equal)
                  **reading_record(cfg),
                  **({"vae_config": cfg.vae_config} if cfg.vae_config else {})},
        store=list(STORED_KEYS[run.clip.store]), dtype=recorded_name(vae.model.dtype),
        planned_clips=summary.planned_clips,
        oom_backoffs=len(summary.backoffs))
    if run.clip.bucketed:  # finalize counts the clips of each; the per-view shape comes from the VAE
        header["buckets"] = [{**bucket.to_record(),
                              "view_shape": list(vae.latent_shape(bucket.num_frames, bucket.height, bucket.width))}
                             for bucket in run.clip.buckets()]
    manifest, failures = run.out.finalize(header, only_writer=run.ctx.info.world_size == 1)
    return failures, manifest["latent"]["shape"] or {}
