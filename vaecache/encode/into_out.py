"""One rank's encode into OUT once start-up is done: OUT prepared (rank 0: its lock, the run record, what is committed
already), the rank's share encoded and committed (vaecache.encode.loop), and the manifest written last (rank 0)."""

from __future__ import annotations

import errno
import logging
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

import vaecache
from vaecache.cache.manifest import manifest_header
from vaecache.cache.outdir import PreparedOut
from vaecache.distributed.liveness import set_doing
from vaecache.encode.fingerprint import RunRecords
from vaecache.encode.loop import DecodeFeed, encode_share, marking_done
from vaecache.encode.run import EncodeRun
from vaecache.encode.summary import EncodeSummary
from vaecache.errors import OutputError
from vaecache.meter import meter_phase
from vaecache.planning.clips import DoneMaskBuilder
from vaecache.settings.clip import STORED_KEYS
from vaecache.settings.dtypes import recorded_name
from vaecache.sources.probing import write_probe_records
from vaecache.vae.load import CUDA_NUMERICS

log = logging.getLogger("vaecache")


@dataclass(frozen=True)
class Preparation:
    """What OUT is prepared with: the run's records, what it is made from (rank 0), whether to start over, and
    whether numerics other than recorded are accepted (the other ranks' are start-up's)."""

    records: RunRecords
    sources: dict[str, dict[str, Any]] | None
    overwrite: bool
    allow_other_numerics: bool


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


def encode_into(run: EncodeRun, preparation: Preparation) -> EncodeSummary:
    """Prepare OUT, encode this rank's share and finalize; returns the job-wide summary."""
    # Into an OUT that held no run (or --overwrite) nothing is committed: the decode starts while OUT is prepared (a
    # lock and a run record, round trips in object storage). Prepare decides; a guess it refutes is dropped.
    feed = DecodeFeed(run, run.start.job) if preparation.overwrite or run.out.looked_empty() else None
    try:
        return _prepare_and_encode(run, preparation, feed)
    finally:
        if feed is not None:
            feed.close()


def _prepare_and_encode(run: EncodeRun, preparation: Preparation, feed: DecodeFeed | None) -> EncodeSummary:
    ctx, start = run.ctx, run.start
    fingerprint, sources = preparation.records.fingerprint, preparation.sources
    other_numerics = start.other_numerics
    rank, world, mesh = ctx.info.rank, ctx.info.world_size, ctx.mesh
    prepared, done = ctx.on_rank0(lambda: marking_done(start.job, lambda mark: run.out.prepare(
        fingerprint, preparation.overwrite, ctx.info.job_id, sources, mark, preparation.allow_other_numerics,
        other_numerics)))
    if feed is not None and (prepared.complete or done.count):
        feed.close()
        feed = None

    def begin_again(attempt: int, mark: DoneMaskBuilder) -> PreparedOut:
        return run.out.begin_again(attempt, fingerprint, sources, mark, other_numerics)

    job = replace(start.job, done=done)
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
                 world, mesh.dp_size, mesh.sp_size, ctx.device, torch.get_num_threads(), run.workers,
                 start.backend.choice, start.backend.threads, prepared.attempt,
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
        summary.rewritten = list(prepared.rewritten)
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
        summary.skipped, summary.latent_shape = ctx.on_rank0(lambda: _finalize(run, summary, preparation.records))
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
              records: RunRecords) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """Rank 0, after every rank finished: merge progress logs into the manifest, written last. Returns the
    failure records and the latent shape. With OUT in object storage, the work folder's logs are first rebuilt
    from every rank's commit records, and the tables and the manifest (last) then PUT (`run.out`)."""
    vae, fingerprint = run.start.vae, records.fingerprint
    header = manifest_header(
        producer={"vaecache": vaecache.__version__, "torch": torch.__version__, "python": platform.python_version(),
                  "numerics": fingerprint.get("numerics"),
                  **({"numerics_history": history} if (history := run.out.numerics_history()) else {}),
                  **({"cuda_numerics": CUDA_NUMERICS} if vae.model.device.type == "cuda" else {})},  # set by load_vae
        vae=vae.model.fingerprint(), fingerprint=fingerprint, frame_rule=vae.model.rule.to_json(),
        settings=records.settings, store=list(STORED_KEYS[run.clip.store]), dtype=recorded_name(vae.model.dtype),
        planned_clips=summary.planned_clips,
        oom_backoffs=len(summary.backoffs))
    if run.clip.bucketed:  # finalize counts the clips of each; the per-view shape comes from the VAE
        header["buckets"] = [{**bucket.to_record(),
                              "view_shape": list(vae.latent_shape(bucket.num_frames, bucket.height, bucket.width))}
                             for bucket in run.clip.buckets()]
    manifest, failures = run.out.finalize(header, only_writer=run.ctx.info.world_size == 1)
    return failures, manifest["latent"]["shape"] or {}
