"""`vaecache plan`: a dry run. What a job would encode, how it splits over ranks, and how long it would take.

Start-up and planning are an encode's own (encode/startup.py: discovery, the probing driver, then
planning.jobs.plan_job: the same clips per DP group as an encode); the only model work is one real clip encoded
to measure seconds per view and peak memory, from which the ETA and the largest micro-batch that fits a memory
budget are estimated. The CLI renders the report (cli/plan.py); `--json` writes `PlanReport.to_json()`.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from vaecache.distributed.context import resolve_device
from vaecache.encode.numerics import torch_threads_kept
from vaecache.encode.startup import StartRequest, start_up
from vaecache.errors import UsageError, VideoDecodeError
from vaecache.planning.clips import Clip
from vaecache.planning.report import (
    Measurement,
    PlanReport,
    SceneRows,
    bucket_histogram,
    dp_shares,
    fits_views_per_forward,
    pipeline_eta,
)
from vaecache.settings.clip import DEFAULT_MAX_FRAME_PIXELS, STORED_KEYS, ClipSettings
from vaecache.settings.commands import PlanConfig
from vaecache.settings.dtypes import recorded_name
from vaecache.vae import VaeRunner
from vaecache.video.backends import PYAV, Backend
from vaecache.video.dataset import ViewBatchDataset

MEASURE_TRIES = 5


def build_plan(cfg: PlanConfig) -> PlanReport:
    """Plan the job described by `cfg` through the start-up encode runs; with cfg.measure, encode one real clip to
    time it."""
    with torch_threads_kept():
        return _build_plan(cfg)


def _build_plan(cfg: PlanConfig) -> PlanReport:
    device = resolve_device(cfg.parallel.device)
    started = time.perf_counter()
    # each rank's share of this machine's cores when the planned ranks share it, as an encode gives them
    start = start_up(StartRequest(cfg.source, cfg.vae, cfg.clip, cfg.decode, cfg.parallel, device, cfg.world_size,
                                  ranks_on_node=min(cfg.world_size, len(os.sched_getaffinity(0))), keep_probes=True))
    startup_s = time.perf_counter() - started
    job, vae, backend, probes = start.job, start.vae, start.backend, start.probes
    model = vae.model
    clip_settings = start.clip  # what start-up resolved ("auto" views per forward)
    clips, skipped = job.clips, list(job.skipped)

    shape = list(vae.latent_shape(clip_settings.sampling.num_frames, clip_settings.height, clip_settings.width))
    stored = list(STORED_KEYS[clip_settings.store])
    element = torch.empty((), dtype=model.dtype).element_size() * len(stored)
    bytes_per_view = math.prod(shape) * element
    views = clips.views()
    histogram = bucket_histogram(clips, clip_settings.fit,
                                 lambda b: list(vae.latent_shape(b.num_frames, b.height, b.width)),
                                 element) if clip_settings.bucketed else []
    fingerprint = model.fingerprint()
    report = PlanReport(
        config={**_config_json(cfg, clip_settings, device), "decoder": backend.name},
        vae={"spec": cfg.vae.spec, "family": model.family, "untrained": model.untrained, "rule": model.rule.to_json(),
             "latent_channels": vae.latent_channels, "normalization": model.normalization,
             **{k: fingerprint[k] for k in ("precision", "tiling", "views_per_forward", "per_frame")}},
        scenes=SceneRows(clips, probes),
        skipped=[{"scene": s.scene_id, "path": s.path, "reason": s.reason} for s in skipped],
        clips=len(clips), cameras=clips[0].num_views if clips else len(start.cameras),
        views=views, frames=views * clip_settings.sampling.num_frames,
        latent_shape=shape, stored=stored, dtype=recorded_name(model.dtype),
        bytes_per_view=bytes_per_view, total_bytes=bytes_per_view * views,
        shares=dp_shares(job, cfg.clip_ids), buckets=histogram,
    )
    if histogram:
        report.frames = sum(b["views"] * b["num_frames"] for b in histogram)
        report.total_bytes = sum(b["bytes"] for b in histogram)
        for name in report.empty_buckets:
            report.notes.append(f"bucket {name} is empty: no scene was assigned to it")
    report.notes.extend(start.notes)
    if model.untrained:
        report.notes.append(f"{cfg.vae.spec} is an untrained VAE with random weights: timings only, latents mean "
                            "nothing")
    if model.dtype_note:
        report.notes.append(model.dtype_note)
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
                size = ((clip.bucket.height, clip.bucket.width) if clip.bucket is not None
                        else (clip_settings.height, clip_settings.width))
                report.measurement = measure_clip(vae, clip, *size, fit=clip_settings.fit, backend=backend,
                                                  max_pixels=clip_settings.sampling.max_frame_pixels)
                break
            except VideoDecodeError as exc:
                report.notes.append(f"clip {clip.clip_id} does not decode ({exc}); measuring another")
        else:
            raise UsageError(f"cannot measure: none of the first {MEASURE_TRIES} clips decodes "
                             f"(last: {report.notes[-1]}); use --no-measure to plan without measuring")
        critical = max(s.views_per_rank for s in report.shares)
        report.measurement = replace(report.measurement, torch_threads=torch.get_num_threads())
        report.eta = pipeline_eta(startup_s, critical, report.measurement, cfg.decode.workers)
        report.eta_s = report.eta.total_s
        eta = report.eta
        pace = (f"max(encode {eta.encode_s_per_view:.3g} s, decode {eta.decode_s_per_view:.3g} s / {eta.workers} "
                "workers)" if eta.workers else
                f"encode {eta.encode_s_per_view:.3g} s + decode {eta.decode_s_per_view:.3g} s (no decode workers)")
        report.notes.append(f"ETA = start-up {eta.startup_s:.1f} s (discovery, probing, VAE load, as here) + the "
                            f"busiest rank's {eta.views_busiest_rank} views x {eta.seconds_per_view:.3g} s per view "
                            f"= {pace}; "
                            f"measured on one clip with {torch.get_num_threads()} torch threads"
                            + (" (what each rank gets when the planned ranks share this machine)"
                               if device.type == "cpu" else "")
                            + "; not included: finalize and writing shards (small), other jobs on the machine")
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


def decode_clip(clip: Clip, height: int, width: int, fit: str = "cover", backend: Backend = PYAV,
                max_pixels: int = DEFAULT_MAX_FRAME_PIXELS) -> torch.Tensor:
    """(views, 3, T, H, W) in [-1, 1], exactly as the encode pipeline feeds the VAE (the run's frame budget too)."""
    dataset = ViewBatchDataset([[clip]], [list(range(clip.num_views))], height, width, fit, backend, max_pixels)
    try:
        item = dataset[0]
    finally:
        dataset.close()
    for path, reason, _ in item["errors"].values():
        raise VideoDecodeError(path, reason)
    return item["views"]


def measure_clip(vae: VaeRunner, clip: Clip, height: int, width: int, fit: str = "cover",
                 backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS) -> Measurement:
    """Encode one clip (after a warm-up forward) and read the time and the peak memory it took.

    Raises VideoDecodeError when the clip does not decode."""
    decode_started = time.perf_counter()
    views = decode_clip(clip, height, width, fit, backend, max_pixels)
    decode_seconds = time.perf_counter() - decode_started
    model = vae.model
    device = model.device
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
    vae.encode_views(views[:model.views_per_forward])  # warm-up, one forward of the measured shape: lazy init,
    # kernel selection, allocator growth (and with --compile, the compile)
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = vae.encode_views(views)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss()
    frames_per_view = views.shape[2] if model.per_frame else 1
    per_forward = min(model.views_per_forward * frames_per_view, len(views) * frames_per_view)
    per_view = None
    if peak is not None and baseline is not None and peak > baseline:
        per_view = int(math.ceil((peak - baseline) / per_forward))
    return Measurement(clip.clip_id, len(views), seconds, seconds / len(views), str(device), method, baseline, peak,
                       per_view, per_forward, list(result.backoffs), decode_seconds, torch.get_num_threads())


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


def _config_json(cfg: PlanConfig, clip: ClipSettings, device: torch.device) -> dict[str, Any]:
    return {
        "data": str(cfg.source.location), "vae": cfg.vae.spec, **clip.to_record(), "world_size": cfg.world_size,
        "sp_size": cfg.parallel.sp_size, "dp_size": cfg.world_size // cfg.parallel.sp_size,
        "batch_size": cfg.parallel.batch_size,
        "device": str(device), "memory_budget": cfg.memory_budget,
    }
