"""`vaecache verify`: the integrity checks (vaecache.verify.integrity), then --dataset and --reencode: a cache
against its source, re-planned and re-encoded with the recorded settings."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from vaecache.cache.provenance import IdentityMemo, frames_identity, identity_change
from vaecache.cache.reader import CacheReader
from vaecache.cache.store import open_store
from vaecache.errors import ClipTableError, VaecacheError
from vaecache.settings.clip import ClipSettings
from vaecache.settings.commands import VerifyOptions
from vaecache.settings.dtypes import RECORDED_NAMES, REENCODE_TOLERANCE
from vaecache.vae.recorded import load_recorded_vae, recorded_spec
from vaecache.verify.integrity import Check, VerifyReport, verify_cache
from vaecache.verify.timelines import probe_files

"""Default --reencode tolerance: max abs difference over max abs stored value, per stored dtype. On the
machine and device that encoded, a deterministic VAE re-encodes to exactly 0 (a thread count other than the
encode's may move fp32 by a few ulps, hence not 0); a VAE that adds noise fails. Another GPU model, driver
or CPU may pick other kernels: pass a looser --tolerance there (~1e-5 for fp32, ~2e-2 for bf16)."""


def verify(out: Any, options: VerifyOptions, ctx: Any = None,
           on_progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """`vaecache verify`: the integrity checks of OUT (a folder or a URL; stray shards deleted first with
    --repair), then, where asked and OUT is complete, its coverage of the re-planned source and changed sources
    (--dataset) and K clips re-encoded (--reencode)."""
    store = open_store(out, dict(options.storage_options))
    report = verify_cache(store, options.quick, options.threads, ctx, on_progress, repair=options.repair)
    if not report.complete or not (options.dataset is not None or options.reencode):
        return report
    cache = CacheReader(store)
    if options.dataset is not None:
        try:
            failures = cache.failure_records()
        except ClipTableError:
            failures = []  # the integrity checks name the table that does not read
        report.checks.extend(check_dataset(cache.manifest, cache, failures, options.dataset, options.threads))
        from vaecache.text.checks import check_caption_files
        from vaecache.verify.integrity import Check

        report.checks.extend(check_caption_files(cache.manifest, Check))
    if options.reencode:
        report.checks.append(check_reencode(cache.out, cache.manifest, cache, int(report.summary["clips"]), options,
                                            ctx))
        if ctx is None or ctx.info.rank == 0:
            from vaecache.cache.kinds import cache_kinds, hook_problem
            from vaecache.errors import VaecacheError
            from vaecache.verify.integrity import Check

            try:
                kinds = cache_kinds(cache.manifest)
            except VaecacheError:
                kinds = []  # the integrity checks name the kind no installed package declares
            for kind in kinds:
                if not cache.manifest.get(kind.name):
                    continue
                try:
                    report.checks.extend(kind.reencode_sets(cache, options, ctx, Check))
                except VaecacheError:
                    raise
                except Exception as exc:  # noqa: BLE001  # a kind's own code: named, the rest of the report kept
                    failed = Check(f"{kind.what}s (re-encoded)")
                    failed.fail(hook_problem(kind, "reencode_sets", exc))
                    report.checks.append(failed)
    return report


def check_dataset(manifest: dict[str, Any], cache: CacheReader, failures: list[dict[str, Any]], dataset: Path,
                  threads: int | None = None) -> list[Check]:
    """--dataset: coverage of the re-planned source, then sources changed since their clips were encoded."""
    return [check_coverage(manifest, cache, failures, dataset, threads), check_sources(cache)]


def check_coverage(manifest: dict[str, Any], cache: CacheReader, failures: list[dict[str, Any]],
                   dataset: Path, threads: int | None = None) -> Check:
    """Re-plan clips from the source with the recorded settings: clips missing from the cache, and
    cached clips with no source any more. Clips recorded as failures count as accounted for."""
    import dataclasses

    from vaecache.planning.jobs import plan_job
    from vaecache.sources.discover import discover
    from vaecache.sources.probing import DEFAULT_PROBE_WORKERS, probe_dataset
    from vaecache.sources.scene import SourceOptions

    check = Check("coverage of " + str(dataset))
    clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
    sampling = clip_settings.sampling
    recorded = manifest.get("settings", {})
    found = discover(dataset, options=SourceOptions(
        clip_settings.cameras, sampling.frame_rate, recorded.get("nuscenes_version"),
        tuple(tuple(pair) for pair in recorded.get("columns") or ()), bool(recorded.get("lerobot_state"))))
    scenes = found.scenes
    sync = found.resolved_sync(sampling.sync)
    # the encode's own probing: its probe cache in OUT answers for every file that kept its size and mtime
    with tempfile.TemporaryDirectory(prefix="vaecache-probes-") as folder:
        probes = probe_dataset(scenes, workers=threads or DEFAULT_PROBE_WORKERS, sync=sync,
                               cache_paths=lambda: probe_files(cache.store, Path(folder))).probes
    job = plan_job(scenes, probes, dataclasses.replace(sampling, sync=sync), sizes=clip_settings.sizes)
    planned, skipped = job.clips, job.skipped
    failed_scenes = {f.get("scene") for f in failures if not f.get("clip")}  # a source that failed as a whole
    expected = {clip.clip_id for clip in planned}
    missing = set(expected)
    failed_clips = {f.get("clip") for f in failures if f.get("clip")}
    failed_clips |= {clip.clip_id for clip in planned if clip.scene_id in failed_scenes}
    for clip_id in cache.clip_ids():
        if clip_id in expected:
            missing.discard(clip_id)
            check.ok()
        else:
            check.fail(f"clip {clip_id}: in the cache, no longer in the source")
    for clip_id in sorted(missing - failed_clips):
        check.fail(f"clip {clip_id}: in the source, missing from the cache")
    for damaged in (skip for skip in found.rejected if skip.incomplete):  # its record accounts for no clip past it
        check.fail(f"{damaged.path}: {damaged.reason}; what lies past the damage is in no clip, and its failure record "
                   "accounts for none of it: repair or replace the input, then run the encode again")
    check.note = (f"{len(expected)} clips planned from {len(scenes)} scenes; {len(expected & failed_clips)} recorded "
                  f"as failed; {len(skipped)} scenes skipped")
    return check


def check_reencode(out: Any, manifest: dict[str, Any], cache: CacheReader, count: int, options: VerifyOptions,
                   ctx: Any = None) -> Check:
    """Decode and re-encode K clips chosen by a seed with the recorded VAE; compare with what is stored."""
    import random

    from vaecache.distributed.context import resolve_device
    from vaecache.encode.loop import clip_tensors
    from vaecache.planning.clips import Clip
    from vaecache.video.backends import backend_for_record
    from vaecache.video.dataset import ViewDecoder, recorded_views

    settings = manifest.get("settings", {})
    clip_settings = ClipSettings.from_record(settings)
    spec = recorded_spec(manifest, options.vae, f"{out}/manifest.json")
    check = Check(f"re-encode {options.reencode} clip(s) with {spec}")
    if not count:
        check.note = "no clips to re-encode"
        return check
    # The positions random.sample would pick from the id-sorted records, which the table holds in that order.
    positions = random.Random(options.seed).sample(range(count), min(options.reencode, count))
    wanted = set(positions)
    by_position = {i: record for i, record in enumerate(cache.clip_records()) if i in wanted}
    chosen = [by_position[i] for i in positions if i in by_position]
    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)
    mine = chosen[rank::world]
    device = ctx.device if ctx is not None else resolve_device(options.device)
    vae = load_recorded_vae(out, manifest, spec, device, allow_pickle_weights=options.allow_pickle_weights)
    # Frames come from the backend the cache was decoded with (recorded name; none recorded: pyav)
    decoder = ViewDecoder(clip_settings.height, clip_settings.width, fit=clip_settings.fit,
                          backend=backend_for_record(settings.get("decoder")),
                          max_pixels=clip_settings.sampling.max_frame_pixels)
    results = []
    for record in mine:
        clip = Clip(record["id"], record["scene"], tuple(record["cameras"]), tuple(record["sources"]),
                    tuple(record["frames"]), record.get("fps") or 0.0)
        bucket = record.get("bucket") if isinstance(record.get("bucket"), dict) else None
        size = (bucket["height"], bucket["width"]) if bucket else None
        try:  # the frames found by the video's own packets, not by the frame index this verify also checks
            views = torch.stack([decoder.decode(source, frames, size) for source, frames in recorded_views(record)])
        except VaecacheError as exc:
            results.append((record["id"], None, f"source does not decode any more ({exc})"))
            continue
        result = vae.encode_views(views)
        moments = result.mean if result.logvar is None else torch.cat([result.mean, result.logvar], dim=1)
        fresh = clip_tensors(clip, moments.cpu(), result.mean.shape[1], clip_settings.store, clip_settings.seed,
                             vae.model.dtype)
        worst = scale = 0.0
        for key, stored in cache.clip_tensors(record).items():
            worst = max(worst, float((stored.float() - fresh[key].float()).abs().max()))
            scale = max(scale, float(stored.float().abs().max()))
        results.append((record["id"], (worst, scale), None))
    if world > 1:
        results = [item for part in ctx.all_gather_object(results) for item in part]
    dtype_name = RECORDED_NAMES[clip_settings.dtype]
    tolerance = options.tolerance if options.tolerance is not None else REENCODE_TOLERANCE[dtype_name]
    worst_all = worst_relative = 0.0
    for clip_id, diff, problem in results:
        if problem:
            check.fail(f"clip {clip_id}: {problem}")
            continue
        absolute, scale = diff
        relative = absolute / scale if scale > 0 else (0.0 if absolute == 0 else float("inf"))
        worst_all, worst_relative = max(worst_all, absolute), max(worst_relative, relative)
        if relative > tolerance:
            check.fail(f"clip {clip_id}: re-encoded latents differ by {absolute:.3g} ({relative:.3g} of the stored "
                       f"max; tolerance {tolerance:g})")
        else:
            check.ok()
    check.note = (f"max abs difference {worst_all:.3g}, {worst_relative:.3g} of the stored max (tolerance "
                  f"{tolerance:g}{'' if options.tolerance is not None else ' for ' + dtype_name})")
    return check


def check_sources(cache: CacheReader) -> Check:
    """Stale latents: each clip record's sources (size, mtime_ns, sha256 where recorded) against the files now.
    One failure per changed file, naming its scene, what changed and how many clips were encoded from it."""
    check = Check("sources unchanged since encoded")
    memos = {False: IdentityMemo(False), True: IdentityMemo(True)}
    changed: dict[str, list[Any]] = {}
    unchanged: set[str] = set()
    stale_clips = unrecorded = 0
    for record in cache.clip_records():
        identity = record.get("source_identity")
        if not isinstance(identity, list):
            unrecorded += 1
            continue
        stale = False
        files = record.get("frame_files") if isinstance(record.get("frame_files"), dict) else {}
        for camera, path, recorded in zip(record.get("cameras") or [], record.get("sources") or [], identity):
            if files.get(camera):  # an image-sequence camera: its identity is that of the clip's own frame files
                change = identity_change(recorded, frames_identity(files[camera], bool(recorded.get("sha256"))))
                if change is not None:
                    changed.setdefault(f"{path} ({camera} of {record.get('id')})",
                                       [record.get("scene"), record.get("id"), 1, change])
                    stale = True
                else:
                    unchanged.add(f"{path} ({camera} of {record.get('id')})")
                continue
            if path in changed:
                changed[path][2] += 1
                stale = True
                continue
            if path in unchanged:
                continue
            change = identity_change(recorded, memos[bool(recorded.get("sha256"))].get(path))
            if change is None:
                unchanged.add(path)
            else:
                changed[path] = [record.get("scene"), record.get("id"), 1, change]
                stale = True
        stale_clips += stale
    check.ok(len(unchanged))
    for path, (scene, first, clips, change) in sorted(changed.items()):
        check.fail(f"scene {scene}: {path}: {change} since it was encoded; {clips} clip(s) stale (first {first})")
    check.note = (f"{len(changed)} of {len(changed) + len(unchanged)} source file(s) changed since encoding, "
                  f"{stale_clips} clip(s) with stale latents")
    if unrecorded:
        check.note += (f"; {unrecorded} clip record(s) carry no source identity (encoded before vaecache recorded "
                       "it), not checked")
    return check
