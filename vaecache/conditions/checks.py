"""verify's checks of a cache's image-to-video condition sets (vaecache.conditions.sets): for each set, its files as
the manifest lists them (bytes and sha256), every clip of the clip table in its clip table once and its tensor in the
shard that table names (a missing one named by clip, whatever the recorded hashes say), each tensor of the clip's
latent shape and the set's dtype, finite values, and nothing in the set's folder the manifest does not list. With
--reencode, K clips' conditions computed again and compared."""

from __future__ import annotations

import io
import json
from typing import Any

from vaecache.cache.layout import CONDITIONS_DIR
from vaecache.cache.sets import Recomputed, check_set_files, unlisted_set_checks
from vaecache.errors import VaecacheError
from vaecache.settings.dtypes import SAFETENSORS_NAMES


def check_condition_sets(cache: Any, quick: bool, check_type: type) -> list[Any]:
    """One report row per set (`check_type` is integrity.Check)."""
    sets = cache.manifest.get(CONDITIONS_DIR) or {}
    rows = unlisted_set_checks(cache, CONDITIONS_DIR, "condition set", sets, check_type)
    records: list[dict[str, Any]] | None = None
    for kind in sorted(sets):
        if records is None:
            records = list(cache.clip_records())
        check = check_type(f"condition set {kind}" + (" (size only, --quick)" if quick else ""))
        try:
            _check_stale(cache.manifest, kind, sets[kind], records, check)
            _check_set(cache, kind, sets[kind], records, quick, check)
        except (KeyError, TypeError, ValueError, OSError, VaecacheError) as exc:
            check.fail(f"condition set {kind}: {type(exc).__name__}: {exc}")
        rows.append(check)
    return rows


def _check_stale(manifest: dict[str, Any], kind: str, entry: Any, records: list[dict[str, Any]], check: Any) -> None:
    """The set against the cache as it is now: made with the cache's VAE (for the VAE's kinds) and from its clips
    as they are (the generation recomputed from the clip records and the recorded shard size)."""
    from vaecache.conditions.sets import condition_fingerprint, set_generation

    if not isinstance(entry, dict) or not isinstance(entry.get("fingerprint"), dict):
        return
    fingerprint = entry["fingerprint"]
    if kind != "image-features":
        now = condition_fingerprint(manifest, kind, torch_dtype_of(fingerprint.get("stored_dtype")),
                                    fingerprint.get("pipeline"))
        if json.loads(json.dumps(now)) != fingerprint:
            check.fail(f"condition set {kind}: made with another VAE or frame rule than the cache's now (stale: "
                       f"vaecache embed OUT --condition {kind} --replace)")
            return
    if isinstance(entry.get("shard_bytes"), int) and \
            set_generation(fingerprint, entry["shard_bytes"], records) != entry.get("generation"):
        check.fail(f"condition set {kind}: made from other clips than the cache holds now (a clip's sources, frames "
                   f"or bucket changed; stale: vaecache embed OUT --condition {kind} --replace)")


def torch_dtype_of(name: Any) -> Any:
    import torch

    return getattr(torch, str(name or "float32"), torch.float32)


def _check_set(cache: Any, kind: str, entry: Any, records: list[dict[str, Any]], quick: bool, check: Any) -> None:
    import math

    import pyarrow.parquet as pq
    from safetensors.torch import load as safetensors_load

    from vaecache.cache.reader import shard_header
    from vaecache.cache.writer import STATS_RTOL, tensor_stats
    from vaecache.conditions.sets import clip_inputs, latent_shape

    shapes = {record["id"]: latent_shape(record) for record in records}
    frame_counts = {record["id"]: len(record["frames"]) for record in records}
    inputs = dict(clip_inputs(records))

    store = cache.store
    if not isinstance(entry, dict) or not isinstance(entry.get("generation"), str):
        check.fail(f"condition set {kind}: its manifest entry is not a set record")
        return
    fingerprint = entry.get("fingerprint") or {}
    stored = SAFETENSORS_NAMES.get(fingerprint.get("stored_dtype", ""))
    view_shape = list((fingerprint.get("image_encoder") or {}).get("view_shape") or [])

    from vaecache.conditions.kinds import BY_NAME

    pipeline = BY_NAME.get(str(fingerprint.get("pipeline")))
    first_frame_alone = pipeline is not None and pipeline.first_frame_alone

    def expected(clip: str) -> list[int]:
        latent = shapes[clip]
        if kind == "image-features":
            return latent[:1] + view_shape
        return latent[:2] + [1] + latent[3:] if first_frame_alone else latent
    contents = check_set_files(store, f"condition set {kind}", f"{CONDITIONS_DIR}/{kind}/", entry, quick, check)
    table_file = ((entry.get("tables") or {}).get("clips") or {}).get("file")
    if table_file not in contents:
        return
    table = pq.read_table(io.BytesIO(contents[table_file]))
    shard_of: dict[str, str] = {}
    stats_of: dict[str, dict[str, float]] = {}
    rows = table.to_pylist()
    for row in rows:
        clip = row["id"]
        if clip in shard_of:
            check.fail(f"condition set {kind}: clip {clip} is listed twice")
        shard_of[clip] = row["shard"]
        stats_of[clip] = {stat: row.get(stat) for stat in ("min", "max", "mean", "std")}
        if clip in frame_counts and row.get("frames") != frame_counts[clip]:
            check.fail(f"condition set {kind}: clip {clip} is listed with {row.get('frames')} frames, the clip has "
                       f"{frame_counts[clip]}")
        elif clip in inputs and "inputs" in row and row["inputs"] != inputs[clip]:
            check.fail(f"condition set {kind}: clip {clip}'s condition was made from other frames than the clip's "
                       "(its inputs hash differs: another clip's row, or the clip changed)")
    missing = [clip for clip in shapes if clip not in shard_of]
    for clip in missing[:5]:
        check.fail(f"condition set {kind}: clip {clip} has no condition")
    if len(missing) > 5:
        check.fail(f"condition set {kind}: {len(missing) - 5} more clips have no condition")
    for clip in [clip for clip in shard_of if clip not in shapes][:5]:
        check.fail(f"condition set {kind}: holds clip {clip}, which the cache does not hold")
    listed = {item.get("file") for item in entry.get("shards") or [] if isinstance(item, dict)}
    held: dict[str, set[str]] = {}
    for file in sorted(listed):
        if not isinstance(file, str) or file not in store.listing(f"{CONDITIONS_DIR}/{kind}"):
            continue  # named by the file checks
        header = shard_header(store, store.checked_name(file, f"condition set {kind}"))
        held[file] = set(header)
        tensors = safetensors_load(contents[file]) if file in contents else {}
        for clip, info in header.items():
            if shard_of.get(clip) != file:
                check.fail(f"{store.where(file)}: holds clip {clip}, which the set's clip table places elsewhere")
            elif clip in shapes and list(info.shape) != expected(clip):
                check.fail(f"{store.where(file)}: clip {clip}'s condition has shape {tuple(info.shape)}, expected "
                           f"{tuple(expected(clip))}")
            elif stored and info.dtype != stored:
                check.fail(f"{store.where(file)}: clip {clip}'s condition is {info.dtype}, the set stores {stored}")
            elif clip in tensors and not tensors[clip].isfinite().all():
                check.fail(f"{store.where(file)}: clip {clip}'s condition holds non-finite values")
            elif clip in tensors:
                found, want = tensor_stats(tensors[clip]), stats_of.get(clip) or {}
                if any(want.get(stat) is None or not math.isclose(found[stat], want[stat], rel_tol=STATS_RTOL,
                                                                  abs_tol=1e-9) for stat in found):
                    check.fail(f"{store.where(file)}: clip {clip}'s condition does not match the stats its clip "
                               "table records (another clip's tensor, or altered)")
    absent = [clip for clip, file in shard_of.items() if file in held and clip not in held[file]]
    for clip in absent[:5]:
        check.fail(f"condition set {kind}: clip {clip} has no condition ({store.where(shard_of[clip])} does not hold "
                   "it)")
    if len(absent) > 5:
        check.fail(f"condition set {kind}: {len(absent) - 5} more clips have no condition")
    for clip, file in sorted(shard_of.items()):
        if file not in listed:
            check.fail(f"condition set {kind}: clip {clip} names shard {file!r}, which the manifest does not list")
            break


def check_condition_reencode(cache: Any, count: int, seed: int, device: Any, tolerance: float | None,
                             tolerances: dict[str, float], check_type: type, vae_spec: str | None = None,
                             allow_pickle_weights: bool = False) -> list[Any]:
    """`verify --reencode K`: for each condition set, K clips (chosen by `seed`) computed again from their sources
    with the cache's VAE, compared with the stored tensors."""
    import random

    from vaecache.conditions.reader import ConditionSet
    from vaecache.training import LatentCache

    sets = cache.manifest.get("conditions") or {}
    if not sets:
        return []
    rows = []
    latents = LatentCache(cache.store, verify="none")
    spec = vae_spec
    loaded: dict[str, Any] = {}  # the cache's VAE, loaded once for every latent kind
    for kind in sorted(sets):
        check = check_type(f"re-encode {count} clip(s) of condition set {kind}")
        rows.append(check)
        try:
            encode = _encoder(kind, sets[kind], cache, spec, device, allow_pickle_weights, loaded)
        except (VaecacheError, OSError, ValueError, ImportError, RuntimeError) as exc:
            check.fail(f"condition set {kind}: cannot load its encoder ({exc})")
            continue
        stored_dtype = (sets[kind].get("fingerprint") or {}).get("stored_dtype", "")
        limit = tolerance if tolerance is not None else tolerances.get(stored_dtype, 0.0)
        conditions = ConditionSet(cache.store, cache.manifest, kind)
        clips = sorted(conditions.clips())
        recomputed = Recomputed(check, limit)
        for clip in random.Random(seed).sample(clips, min(count, len(clips))):
            try:
                frames = latents.source_frames(clip, indexed=False)  # not by the index verify checks
            except VaecacheError as exc:
                check.fail(f"condition set {kind}: clip {clip}: its sources do not decode as recorded ({exc})")
                continue
            recomputed.compare(f"condition set {kind}: clip {clip}", "re-encodes", encode(frames, clip).cpu(),
                               conditions.stored(clip))
        recomputed.finish()
    return rows


def _encoder(kind: str, entry: dict[str, Any], cache: Any, spec: str | None, device: Any,
             allow_pickle_weights: bool, loaded: dict[str, Any]) -> Any:
    """(frames, clip) -> the condition computed again: by the image encoder recorded with the set (its fingerprint
    must be the recorded one), or by the cache's VAE (kept in `loaded`)."""
    from vaecache.conditions.kinds import condition_pipeline, condition_video

    if kind == "image-features":
        from vaecache.conditions.images import ImageEncoder
        from vaecache.differences import describe_differences

        recorded = (entry.get("fingerprint") or {}).get("image_encoder") or {}
        image = ImageEncoder(str(entry.get("image_encoder")), str(recorded.get("convention")), device)
        differs = describe_differences(recorded, json.loads(json.dumps(image.fingerprint())))
        if differs:
            raise VaecacheError(f"the image encoder at {image.spec} is not the recorded one ({'; '.join(differs[:3])})")
        return lambda frames, clip: image.features(frames)
    if "vae" not in loaded:
        from vaecache.vae.recorded import load_recorded_vae, recorded_spec

        spec = recorded_spec(cache.manifest, spec, cache.store.where("manifest.json"))
        loaded["vae"] = load_recorded_vae(cache.store.location, cache.manifest, spec, device,
                                          allow_pickle_weights=allow_pickle_weights).pipeline_encode()
    runner = loaded["vae"]
    pipeline = condition_pipeline(cache.manifest.get("vae") or {}, (entry.get("fingerprint") or {}).get("pipeline"))
    return lambda frames, clip: runner.encode_views(condition_video(frames, kind, clip, pipeline)).mean
