"""Checks that a latent cache is complete and intact. Produces a report (pure data); the CLI renders it."""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load as safetensors_load

from vaecache.config import ClipSettings
from vaecache.dtypes import RECORDED_NAMES, SAFETENSORS_NAMES
from vaecache.errors import ManifestError, UsageError, VaecacheError
from vaecache.format.index import read_progress, reason_counts
from vaecache.format.io import iter_jsonl
from vaecache.format.layout import MANIFEST, SHARDS_DIR
from vaecache.format.reader import CacheReader, ShardHeaderError, shard_header
from vaecache.format.writer import tensor_stats

MAX_EXAMPLES = 5
STATS_RTOL = 1e-6
"""Recorded stats are float64 reductions; recomputing them may differ in the last bits with thread count."""


@dataclass
class Check:
    """One row of the report: how many items passed and failed, and the first failures named."""

    name: str
    passed: int = 0
    failed: int = 0
    problems: list[str] = field(default_factory=list)
    note: str = ""
    skipped: bool = False

    def ok(self, count: int = 1) -> None:
        self.passed += count

    def fail(self, problem: str) -> None:
        self.failed += 1
        if len(self.problems) < MAX_EXAMPLES:
            self.problems.append(problem)


@dataclass
class VerifyReport:
    out: str
    complete: bool
    checks: list[Check]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.complete and all(check.failed == 0 for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"out": self.out, "ok": self.ok, "complete": self.complete, "summary": self.summary,
                "checks": [asdict(check) for check in self.checks]}


REENCODE_TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
"""Default --reencode tolerance: max abs difference over max abs stored value, per stored dtype. On the
machine and device that encoded, a deterministic VAE re-encodes to exactly 0 (a thread count other than the
encode's may move fp32 by a few ulps, hence not 0); a VAE that adds noise fails. Another GPU model, driver
or CPU may pick other kernels: pass a looser --tolerance there (~1e-5 for fp32, ~2e-2 for bf16)."""


@dataclass(frozen=True)
class VerifyOptions:
    """What `vaecache verify` checks beyond integrity."""

    quick: bool = False
    """Sizes and headers only: no hashing, no value checks."""
    threads: int | None = None
    dataset: Path | None = None
    """Re-plan clips from this source with the recorded settings and compare coverage."""
    reencode: int = 0
    """Re-encode this many clips (chosen by `seed`) and compare with what is stored."""
    vae: str | None = None
    """VAE for --reencode; default: the spec recorded in the manifest. Must match the fingerprint."""
    seed: int = 0
    device: str = "auto"
    allow_pickle_weights: bool = False
    tolerance: float | None = None
    """--reencode: max abs difference over max abs stored value; None: REENCODE_TOLERANCE of the stored dtype."""

    def __post_init__(self) -> None:
        if self.reencode < 0:
            raise UsageError(f"--reencode must be >= 0, got {self.reencode}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {self.threads}")
        if self.tolerance is not None and not 0 <= self.tolerance < float("inf"):
            raise UsageError(f"--tolerance must be a fraction >= 0, got {self.tolerance}")


def verify_cache(out: Path, quick: bool = False, threads: int | None = None, ctx: Any = None,
                 options: VerifyOptions | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Run every check on OUT. Under torchrun (`ctx` from vaecache.dist.distributed) shards and
    re-encodes are split across ranks and every rank returns the whole report.
    `on_progress(1, shards_of_this_rank)` is called as each of this rank's shards is checked."""
    options = options or VerifyOptions(quick=quick, threads=threads)
    quick, threads = options.quick, options.threads
    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)
    out = Path(out)
    manifest_check = Check("manifest")
    try:
        cache = CacheReader(out)
        manifest = cache.manifest
        manifest_check.ok()
    except ManifestError as exc:
        manifest_check.fail(str(exc))
        if not (out / MANIFEST).exists():
            shards, clips = read_progress(out) if out.is_dir() else ([], [])
            manifest_check.note = (f"incomplete: no final manifest; {len(clips)} clips in {len(shards)} shards are "
                                   "committed (rerun the same encode command to finish)")
        return VerifyReport(str(out), complete=False, checks=[manifest_check])

    clips_check = Check("clip records")
    records = _read_records(cache, clips_check)
    shard_check = Check("shard files" + (" (size only, --quick)" if quick else ""))
    orphan_check = Check("no orphan shards")
    tensor_check = Check("tensors match records")
    value_check = Check("values finite and match stats", skipped=quick)
    failures_check = Check("failures file")

    listed = cache.shard_files()
    on_disk = cache.shard_files_on_disk()
    for orphan in sorted(on_disk - set(listed)):
        orphan_check.fail(f"{orphan}: shard file not listed in the manifest")
    orphan_check.ok(len(on_disk & set(listed)))

    by_shard: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_shard.setdefault(f"{SHARDS_DIR}/{record.get('shard')}", []).append(record)
    for file in sorted(set(by_shard) - set(listed)):
        for record in by_shard[file]:
            tensor_check.fail(f"clip {record.get('id')}: its shard {file} is not in the manifest")

    mine = sorted(listed.items())[rank::world]
    with ThreadPoolExecutor(max_workers=threads or min(8, len(os.sched_getaffinity(0)))) as pool:
        results = []
        for result in pool.map(lambda item: _check_shard(out, item[0], item[1], by_shard.get(item[0], []), quick),
                               mine):
            results.append(result)
            if on_progress is not None:
                on_progress(1, len(mine))
    if world > 1:
        results = [result for part in ctx.all_gather_object(results) for result in part]
    for result in results:
        for check, problems, passed in ((shard_check, result["shard"], 1),
                                        (tensor_check, result["tensors"], result["tensors_ok"]),
                                        (value_check, result["values"], result["values_ok"])):
            for problem in problems:
                check.fail(problem)
            if not problems:
                check.ok(passed)
            elif check is not shard_check:
                check.ok(max(0, passed))

    failures = _read_failures(cache, failures_check)
    clip_count = manifest.get("clips", {}).get("count")
    if clip_count is not None and clip_count != len(records):
        clips_check.fail(f"manifest says {clip_count} clips, {manifest['clips']['file']} holds {len(records)}")
    if not records:
        clips_check.fail(f"{cache.clips_path.name}: the cache holds no clips (an empty cache is not a result)")
    planned = manifest.get("counts", {}).get("planned_clips")
    if planned and len(records) * 2 < planned:
        clips_check.note = (f"warning: only {len(records)} of {planned} planned clips were encoded; "
                            f"see {cache.failures_path.name}")
    summary = {
        "clips": len(records),
        "views": sum(len(r.get("cameras", [])) for r in records),
        "shards": len(listed),
        "bytes": sum(int(s.get("bytes", 0)) for s in listed.values()),
        "failures": len(failures),
        "failure_reasons": reason_counts(failures),
        "planned_clips": planned,
        "vae": manifest.get("vae", {}).get("family"),
        "untrained_vae": manifest.get("vae", {}).get("untrained", False),
        "latent_shape": manifest.get("latent", {}).get("shape"),
    }
    checks = [manifest_check, clips_check, shard_check, orphan_check, tensor_check, value_check, failures_check]
    if options.dataset is not None:
        checks.append(check_coverage(manifest, records, failures, options.dataset, threads))
    if options.reencode:
        checks.append(check_reencode(out, manifest, records, options, ctx))
    return VerifyReport(str(out), complete=True, checks=checks, summary=summary)


def check_coverage(manifest: dict[str, Any], records: list[dict[str, Any]], failures: list[dict[str, Any]],
                   dataset: Path, threads: int | None = None) -> Check:
    """Re-plan clips from the source with the recorded settings: clips missing from the cache, and
    cached clips with no source any more. Clips recorded as failures count as accounted for."""
    from vaecache.planning import plan_job
    from vaecache.sources import discover_scenes, probe_scene

    check = Check("coverage of " + str(dataset))
    clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
    scenes = discover_scenes(Path(dataset), clip_settings.cameras)
    with ThreadPoolExecutor(max_workers=threads or min(8, len(os.sched_getaffinity(0)))) as pool:
        probes = {probe.scene_id: probe for probe in pool.map(probe_scene, scenes)}
    job = plan_job(scenes, probes, clip_settings.sampling)
    planned, skipped = job.clips, job.skipped
    expected = {clip.clip_id for clip in planned}
    cached = {record.get("id") for record in records}
    failed_clips = {f.get("clip") for f in failures if f.get("clip")}
    for clip_id in sorted(expected - cached - failed_clips):
        check.fail(f"clip {clip_id}: in the source, missing from the cache")
    for clip_id in sorted(cached - expected):
        check.fail(f"clip {clip_id}: in the cache, no longer in the source")
    check.ok(len(expected & cached))
    check.note = (f"{len(expected)} clips planned from {len(scenes)} scenes; {len(expected & failed_clips)} recorded "
                  f"as failed; {len(skipped)} scenes skipped")
    return check


def check_reencode(out: Path, manifest: dict[str, Any], records: list[dict[str, Any]], options: VerifyOptions,
                   ctx: Any = None) -> Check:
    """Decode and re-encode K clips chosen by a seed with the recorded VAE; compare with what is stored."""
    import random

    from vaecache.decode import ViewDecoder
    from vaecache.dist import resolve_device
    from vaecache.planning import Clip
    from vaecache.pipeline import clip_tensors, run_fingerprint_vae_part
    from vaecache.vae import load_vae

    settings = manifest.get("settings", {})
    clip_settings = ClipSettings.from_record(settings)
    spec = options.vae or settings.get("vae_spec")
    check = Check(f"re-encode {options.reencode} clip(s) with {spec}")
    if not records:
        check.note = "no clips to re-encode"
        return check
    chosen = random.Random(options.seed).sample(sorted(records, key=lambda r: r["id"]), min(options.reencode, len(records)))
    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)
    mine = chosen[rank::world]
    device = ctx.device if ctx is not None else resolve_device(options.device)
    vae = load_vae(spec, device, clip_settings.dtype, tiling=clip_settings.tiling,
                   allow_pickle_weights=options.allow_pickle_weights,
                   max_views_per_forward=clip_settings.max_views_per_forward)
    recorded = {k: v for k, v in manifest.get("vae", {}).items() if k != "spec"}
    given = run_fingerprint_vae_part(vae)
    if recorded != given:
        from vaecache.format.outdir import describe_differences

        diffs = describe_differences(recorded, given)
        raise UsageError(f"--vae {spec} does not match the VAE recorded in {out}/manifest.json "
                         f"({'; '.join(diffs[:3])})")
    decoder = ViewDecoder(clip_settings.height, clip_settings.width)
    cache = CacheReader(out)
    results = []
    for record in mine:
        clip = Clip(record["id"], record["scene"], tuple(record["cameras"]), tuple(record["sources"]),
                    tuple(record["frames"]), record.get("fps", 0.0))
        try:
            views = torch.stack([decoder.decode(path, clip.frames) for path in clip.paths])
        except VaecacheError as exc:
            results.append((record["id"], None, f"source does not decode any more ({exc})"))
            continue
        result = vae.encode_views(views)
        moments = result.mean if result.logvar is None else torch.cat([result.mean, result.logvar], dim=1)
        fresh = clip_tensors(clip, moments.cpu(), result.mean.shape[1], clip_settings.store, clip_settings.seed,
                             vae.dtype)
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


def _read_records(cache: CacheReader, check: Check) -> list[dict[str, Any]]:
    info = cache.manifest.get("clips") or {}
    path = cache.clips_path
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        check.fail(f"{path.name}: missing")
        return []
    if info.get("sha256") and hashlib.sha256(data).hexdigest() != info["sha256"]:
        check.fail(f"{path.name}: sha256 differs from the manifest (records were edited or truncated)")
    records, seen = [], set()
    for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            check.fail(f"{path.name}:{lineno}: does not parse")
            continue
        clip_id = record.get("id")
        if clip_id in seen:
            check.fail(f"clip {clip_id}: recorded twice")
            continue
        seen.add(clip_id)
        problem = _record_problem(record, cache.manifest)
        if problem:
            check.fail(f"clip {clip_id}: {problem}")
        else:
            check.ok()
        records.append(record)
    return records


def _record_problem(record: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """Why a clip record disagrees with the manifest: its stored keys, their shapes, their tensor names."""
    latent = manifest.get("latent") or {}
    tensors = record.get("tensors")
    if not isinstance(tensors, dict):
        return "record has no tensors"
    keys = latent.get("store")
    if keys is not None and sorted(tensors) != sorted(keys):
        return f"stores {sorted(tensors)}, the manifest says {sorted(keys)}"
    cameras = len(record.get("cameras") or [])
    for key, entry in sorted(tensors.items()):
        name = f"{record.get('id')}/{key}"
        if entry.get("name") != name:
            return f"{key} is stored as tensor {entry.get('name')!r}, expected {name!r}"
        expected = (latent.get("shape") or {}).get(key)
        if expected is not None and entry.get("shape") != [cameras, *expected[1:]]:
            return f"{key} has shape {entry.get('shape')}, the manifest's latent shape is {[cameras, *expected[1:]]}"
    return None


def _read_failures(cache: CacheReader, check: Check) -> list[dict[str, Any]]:
    info = cache.manifest.get("failures") or {}
    path = cache.failures_path
    if not path.exists():
        check.fail(f"{path.name}: missing")
        return []
    if info.get("sha256") and hashlib.sha256(path.read_bytes()).hexdigest() != info["sha256"]:
        check.fail(f"{path.name}: sha256 differs from the manifest")
    failures = list(iter_jsonl(path))
    check.ok()
    check.note = f"{len(failures)} skipped input(s)" + (
        ": " + ", ".join(f"{n}x {r}" for r, n in reason_counts(failures).items()) if failures else "")
    return failures


def _check_shard(out: Path, file: str, shard: dict[str, Any], records: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"shard": [], "tensors": [], "values": [], "tensors_ok": 0, "values_ok": 0}
    path = out / file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        result["shard"].append(f"{file}: missing")
        result["tensors"].extend(f"clip {r['id']}: its shard {file} is missing" for r in records)
        return result
    if size != shard.get("bytes"):
        result["shard"].append(f"{file}: {size} bytes, manifest says {shard.get('bytes')}")
    data = b""
    if not quick:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != shard.get("sha256"):
            result["shard"].append(f"{file}: sha256 {digest[:12]}..., manifest says {str(shard.get('sha256'))[:12]}...")
    try:
        header = shard_header(path)
    except ShardHeaderError as exc:
        result["shard"].append(f"{file}: {str(exc).split(': ', 1)[1]}")
        return result
    claimed = set()
    for record in records:
        for key, entry in record.get("tensors", {}).items():
            name = entry.get("name")
            claimed.add(name)
            found = header.get(name)
            if found is None:
                result["tensors"].append(f"clip {record['id']}: tensor {name} not in {file}")
            elif found.shape != entry.get("shape") or found.dtype != SAFETENSORS_NAMES.get(entry.get("dtype")):
                result["tensors"].append(
                    f"clip {record['id']}: {key} is {found.dtype} {found.shape} in {file}, "
                    f"record says {entry.get('dtype')} {entry.get('shape')}")
            else:
                result["tensors_ok"] += 1
    for name in sorted(set(header) - claimed):
        result["tensors"].append(f"{file}: tensor {name} is claimed by no clip record")
    if quick or result["shard"]:
        return result
    try:
        tensors = safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed payloads
        result["values"].append(f"{file}: tensors do not load ({exc})")
        return result
    for record in records:
        for key, entry in record.get("tensors", {}).items():
            tensor = tensors.get(entry.get("name"))
            if tensor is None:
                continue
            problem = _value_problem(tensor, entry.get("stats"))
            if problem:
                result["values"].append(f"clip {record['id']}: {key} in {file} {problem}")
            else:
                result["values_ok"] += 1
    return result


def _value_problem(tensor: torch.Tensor, recorded: dict[str, float] | None) -> str | None:
    found = tensor_stats(tensor)
    if not (math.isfinite(found["min"]) and math.isfinite(found["max"])):
        return f"has {int((~torch.isfinite(tensor)).sum())} non-finite value(s)"
    if not recorded:
        return "has no recorded stats"
    for key in ("min", "max", "mean", "std"):
        want, got = recorded.get(key), found[key]
        if want is None or not math.isclose(got, want, rel_tol=STATS_RTOL, abs_tol=1e-9):
            return f"{key} is {got:.6g}, recorded {want}"
    return None
