"""The encode loop: plan -> decode (DataLoader workers) -> encode (SP group) -> write (background thread)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

import vaecache
from vaecache.config import EncodeConfig
from vaecache.dataset import Clip, assign, assign_contiguous, batch_views, batched, plan_clips
from vaecache.decode import ViewBatchDataset
from vaecache.sources import SceneProbe, discover_scenes, probe_scene
from vaecache.dist import DistContext
from vaecache.errors import EXIT_OK, EXIT_PARTIAL, EXIT_STOPPED, InputError, UsageError, VaecacheError
from vaecache.manifest import AppendLog, failures_path, progress_path, read_failures, read_progress, write_manifest
from vaecache.outdir import PreparedOut, prepare_out, release_lock
from vaecache.parallel import gather_views, plan_sp
from vaecache.stop import StopRequest, ignore_stop_signals
from vaecache.vae import LoadedVae, load_vae
from vaecache.writer import ShardWriter

log = logging.getLogger("vaecache")
T = TypeVar("T")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    world_size: int = 1
    sp_size: int = 1
    untrained_vae: bool = False
    backoffs: list[str] = field(default_factory=list)
    stopped: str | None = None
    """The signal that stopped this rank early (the cache is resumable, not complete)."""

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


def run_fingerprint(cfg: EncodeConfig, vae: LoadedVae) -> dict[str, Any]:
    """Everything that determines stored bytes; a resume must match it exactly."""
    return {"vae": run_fingerprint_vae_part(vae), "latents": cfg.latent_settings(), "format_version": 1}


def _cpu_thread_budget(ctx: DistContext, workers: int) -> int:
    """On CPU, give the VAE the cores this rank can use minus its decode workers (OMP_NUM_THREADS wins).

    torch's default (every core) plus decode workers oversubscribes the machine, and busy-waiting
    OpenMP threads then slow the encode several-fold as soon as anything else runs."""
    if ctx.device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) // max(1, ctx.info.local_world_size)
    threads = max(1, cores - workers)
    torch.set_num_threads(threads)
    return threads


def on_rank0(ctx: DistContext, fn: Callable[[], T]) -> T:
    """Run fn on rank 0 and hand its result, or its error, to every rank (so no rank waits forever)."""
    payload: Any = None
    if ctx.info.rank == 0:
        try:
            payload = ("ok", fn())
        except Exception as exc:  # every rank must hear of it, or they would wait in the broadcast
            payload = ("error", exc if isinstance(exc, VaecacheError)
                       else VaecacheError(f"rank 0: {type(exc).__name__}: {exc}"))
    payload = ctx.broadcast_object(payload)
    if payload[0] == "error":
        raise payload[1]
    return payload[1]


def setup_logging(out: Path, rank: int, world: int) -> logging.Handler:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "logs" / f"rank-{rank:05d}.log")
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


def clip_record(clip: Clip, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "id": clip.clip_id,
        "scene": clip.scene_id,
        "cameras": list(clip.cameras),
        "sources": list(clip.paths),
        "frames": list(clip.frames),
        "fps": clip.fps,
        "tensors": {key: {"name": f"{clip.clip_id}/{key}", "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype]}
                    for key, t in tensors.items()},
    }


def failure_record(scene: str, path: str | None, reason: str, clip_id: str | None = None) -> dict[str, Any]:
    return {"key": f"{scene}|{clip_id or ''}|{path or ''}", "scene": scene, "clip": clip_id, "path": path,
            "reason": reason}


def _probe_all(ctx: DistContext, scenes: list) -> dict[str, SceneProbe]:
    """Every rank opens its share of the scenes; the results are exchanged so all ranks plan alike."""
    mine = [probe_scene(scene) for scene in assign(scenes, ctx.info.rank, ctx.info.world_size)]
    return {probe.scene_id: probe for part in ctx.all_gather_object(mine) for probe in part}


def run_encode(cfg: EncodeConfig, ctx: DistContext, on_progress: Callable[[int, int], None] | None = None) -> EncodeSummary:
    """Encode the dataset into OUT on this rank; returns the job-wide summary."""
    # Stop signals are caught from here on, so one arriving while the VAE loads or the manifest is
    # written cannot kill the rank between commits; the encode loop polls the flag.
    with StopRequest() as stop:
        return _run_encode(cfg, ctx, stop, on_progress)


def _run_encode(cfg: EncodeConfig, ctx: DistContext, stop: StopRequest,
                on_progress: Callable[[int, int], None] | None) -> EncodeSummary:
    started = time.perf_counter()
    rank, world = ctx.info.rank, ctx.info.world_size
    mesh = ctx.mesh
    threads = _cpu_thread_budget(ctx, cfg.workers)
    vae = load_vae(cfg.vae, ctx.device, cfg.dtype, tiling=cfg.tiling, max_views_per_forward=cfg.max_views_per_forward)
    vae.rule.check(cfg.sampling.num_frames, cfg.height, cfg.width)
    if cfg.store != "mean" and not vae.has_logvar:
        raise UsageError(f"--store {cfg.store} needs the posterior log-variance, and {cfg.vae} gives only a mean; use --store mean")
    scenes = discover_scenes(cfg.data, cfg.cameras)
    fingerprint = run_fingerprint(cfg, vae)
    prepared: PreparedOut = on_rank0(ctx, lambda: prepare_out(cfg.out, fingerprint, cfg.overwrite, ctx.info.job_id))
    handler = setup_logging(cfg.out, rank, world)
    try:
        log.info("vaecache %s: world %d = DP %d x SP %d, device %s (%d torch threads), attempt %d, "
                 "%d clips already committed", vaecache.__version__, world, mesh.dp_size, mesh.sp_size, ctx.device,
                 threads, prepared.attempt, len(prepared.done_clip_ids))
        summary = _encode(cfg, ctx, vae, scenes, prepared, stop, on_progress)
        summary.wall_s = time.perf_counter() - started
        if summary.stopped:
            log.warning("stopped early (%s): committed work is kept; rerun the same command to resume", summary.stopped)
            return summary
        if rank == 0:
            _finalize(cfg, vae, summary, fingerprint)
        ctx.barrier()
        log.info("done: %d clips, %d views in %.1f s", summary.clips, summary.views, summary.wall_s)
        return summary
    finally:
        if rank == 0:
            release_lock(cfg.out)
        log.removeHandler(handler)
        handler.close()


def _encode(cfg: EncodeConfig, ctx: DistContext, vae: LoadedVae, scenes: list, prepared: PreparedOut,
            stop: StopRequest, on_progress: Callable[[int, int], None] | None) -> EncodeSummary:
    rank, mesh = ctx.info.rank, ctx.mesh
    probes = _probe_all(ctx, scenes)
    clips, skipped = plan_clips(scenes, probes, cfg.sampling)
    todo = [clip for clip in clips if clip.clip_id not in prepared.done_clip_ids]
    mine = assign_contiguous(todo, mesh.dp_rank, mesh.dp_size)
    batches = batched(mine, cfg.batch_size)
    plans = [plan_sp(len(batch_views(batch)), mesh.sp_size) for batch in batches]
    view_indices = [plan.view_indices(mesh.sp_rank) for plan in plans]
    if skipped and cfg.on_error == "fail":
        first = skipped[0]
        raise InputError(f"{first.path or first.scene_id}: {first.reason} (scene {first.scene_id}; --on-error fail)")
    failures = AppendLog(failures_path(cfg.out, rank))
    if rank == 0:
        for skip in skipped:
            failures.append(failure_record(skip.scene_id, skip.path, skip.reason))
            log.warning("skipped scene %s: %s%s", skip.scene_id, skip.reason, f" ({skip.path})" if skip.path else "")
    local: dict[str, Any] = {"clips": 0, "views": 0, "frames": 0, "failed": 0, "backoffs": [], "stopped": None}
    loader = torch.utils.data.DataLoader(
        ViewBatchDataset(batches, view_indices, cfg.height, cfg.width),
        batch_size=None, shuffle=False, num_workers=cfg.workers, pin_memory=ctx.device.type == "cuda",
        prefetch_factor=4 if cfg.workers else None, worker_init_fn=ignore_stop_signals,
    )
    progress_log = AppendLog(progress_path(cfg.out, rank)) if mesh.is_writer else None
    writer = ShardWriter(cfg.out, rank, prepared.attempt, cfg.shard_size, progress_log) if progress_log else None
    try:
        for item in loader:
            batch, plan = batches[item["index"]], plans[item["index"]]
            # Ranks of one SP group must stop at the same batch, or the all_gather below would hang.
            if _sp_any(ctx, stop.requested):
                local["stopped"] = stop.signal_name or "a peer's signal"
                break
            result = vae.encode_views(item["views"])
            moments = result.mean if result.logvar is None else torch.cat([result.mean, result.logvar], dim=1)
            moments = gather_views(moments, plan, ctx.sp_group)
            errors, settings = _batch_outcome(ctx, plan, batch, item["errors"], result)
            local["backoffs"].extend(result.backoffs)
            _write_batch(cfg, ctx, vae, batch, moments, result.mean.shape[1], errors, settings, writer, failures,
                         local)
            if on_progress is not None:
                on_progress(len(batch), len(mine))
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        failures.close()
        if progress_log is not None:
            progress_log.close()
    local["bytes"] = writer.bytes_written if writer else 0
    local["shards"] = len(writer.committed) if writer else 0
    summary = EncodeSummary(cfg.out, world_size=ctx.info.world_size, sp_size=mesh.sp_size,
                            untrained_vae=vae.untrained, resumed_clips=len(prepared.done_clip_ids),
                            planned_clips=len(clips), scenes=len(scenes))
    if local["stopped"]:
        # Committed shards are durable; skip the job-wide exchange (peers may be gone) and let a rerun resume.
        summary.stopped = local["stopped"]
        summary.clips, summary.views, summary.frames = local["clips"], local["views"], local["frames"]
        summary.bytes_written, summary.shards = local["bytes"], local["shards"]
        return summary
    for part in ctx.all_gather_object(local):
        summary.clips += part["clips"]
        summary.views += part["views"]
        summary.frames += part["frames"]
        summary.bytes_written += part["bytes"]
        summary.shards += part["shards"]
        summary.backoffs.extend(part["backoffs"])
        if part["stopped"] and not summary.stopped:
            summary.stopped = part["stopped"]
    return summary


def _sp_any(ctx: DistContext, flag: bool) -> bool:
    """True on every SP rank if any SP rank has the flag set."""
    if ctx.mesh.sp_size == 1:
        return flag
    return any(ctx.sp_all_gather_object(flag))


def _real_views(plan: Any, sp_rank: int, count: int) -> list[int | None]:
    """For each row this rank encoded: the batch view it is, or None for a padding copy."""
    if plan.is_local:
        return list(range(count))
    start = sp_rank * plan.per_rank
    return [p if p < plan.num_views else None for p in range(start, start + count)]


def _batch_outcome(ctx: DistContext, plan: Any, batch: list[Clip], decode_errors: dict[int, tuple[str, str]],
                   result: Any) -> tuple[dict[int, tuple[str, str]], dict[int, dict[str, Any]]]:
    """Clip index -> (path, reason) for clips any SP rank could not decode or encode, and view -> settings."""
    views = batch_views(batch)
    errors = dict(decode_errors)
    settings: dict[int, dict[str, Any]] = {}
    for row, view in enumerate(_real_views(plan, ctx.mesh.sp_rank, result.mean.shape[0])):
        if view is None:
            continue
        settings[view] = result.view_settings(row)
        if row in result.failed:
            ref = views[view]
            clip = batch[ref.clip_index]
            errors.setdefault(ref.clip_index, (clip.paths[ref.camera_index],
                                               f"camera {clip.cameras[ref.camera_index]}: {result.failed[row]}"))
    if ctx.mesh.sp_size > 1 and not plan.is_local:
        for part_errors, part_settings in ctx.sp_all_gather_object((errors, settings)):
            for clip_index, error in part_errors.items():
                errors.setdefault(clip_index, error)
            settings.update(part_settings)
    return errors, settings


def _write_batch(cfg: EncodeConfig, ctx: DistContext, vae: LoadedVae, batch: list[Clip], moments: torch.Tensor,
                 channels: int, errors: dict[int, tuple[str, str]], settings: dict[int, dict[str, Any]],
                 writer: ShardWriter | None, failures: AppendLog, local: dict[str, Any]) -> None:
    view_start = 0
    for clip_index, clip in enumerate(batch):
        clip_moments = moments[view_start:view_start + clip.num_views]
        view_start += clip.num_views
        if clip_index in errors:
            path, reason = errors[clip_index]
            if ctx.mesh.is_writer:
                failures.append(failure_record(clip.scene_id, path, reason, clip.clip_id))
                log.warning("clip %s failed: %s: %s", clip.clip_id, path, reason)
                local["failed"] += 1
            if cfg.on_error == "fail":
                raise InputError(f"{path}: {reason}")
            continue
        if writer is not None:
            tensors = clip_tensors(clip, clip_moments, channels, cfg.store, cfg.seed, vae.dtype)
            used = [settings[view_start - clip.num_views + c] for c in range(clip.num_views)]
            record = clip_record(clip, tensors)
            record["encode"] = {"tiled": any(u["tiled"] for u in used),
                                "tiled_cameras": [cam for cam, u in zip(clip.cameras, used) if u["tiled"]],
                                "units_per_forward": max(u["units_per_forward"] for u in used)}
            writer.add(record, {f"{clip.clip_id}/{k}": t for k, t in tensors.items()})
            local["clips"] += 1
            local["views"] += clip.num_views
            local["frames"] += clip.num_views * len(clip.frames)


def _finalize(cfg: EncodeConfig, vae: LoadedVae, summary: EncodeSummary, fingerprint: dict[str, Any]) -> None:
    """Rank 0, after every rank finished: merge progress logs into the manifest, written last."""
    shards, clips = read_progress(cfg.out)
    failures = read_failures(cfg.out)
    summary.skipped = failures
    views = sum(len(c["cameras"]) for c in clips)
    if clips:
        summary.latent_shape = {key: entry["shape"] for key, entry in clips[0]["tensors"].items()}
    header = {
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "producer": {"vaecache": vaecache.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "vae": vae.fingerprint(),
        "fingerprint_sha256": hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest(),
        "frame_rule": vae.rule.to_json(),
        "settings": {**cfg.latent_settings(), "data": str(cfg.data), "batch_size": cfg.batch_size,
                     "sp_size": cfg.sp_size, "world_size": summary.world_size, "shard_size": cfg.shard_size,
                     "vae_spec": cfg.vae},
        "latent": {"store": _stored_keys(cfg.store), "dtype": DTYPE_NAMES[vae.dtype],
                   "layout": "(cameras, channels, latent_frames, height/spatial_factor, width/spatial_factor)",
                   "shape": summary.latent_shape},
        "counts": {"clips": len(clips), "views": views, "frames": sum(len(c["cameras"]) * len(c["frames"]) for c in clips),
                   "shards": len(shards), "bytes": sum(s["bytes"] for s in shards), "failures": len(failures),
                   "oom_backoffs": len(summary.backoffs)},
    }
    write_manifest(cfg.out, header, shards, clips, failures)


def _stored_keys(store: str) -> list[str]:
    return {"mean-logvar": ["mean", "logvar"], "mean": ["mean"], "sample": ["sample"]}[store]

