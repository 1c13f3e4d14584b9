"""Shard writer: the only code that completes a clip record. Buffers clips, rolls a safetensors shard at a
size limit, commits atomically off-thread.

Every shard holds one bucket (one latent shape): the writer keeps an open shard per bucket, and each rolls
on its own at the size limit. A shard is committed by: serialize -> sha256 -> temp file -> fsync -> rename -> fsync
folder -> append its clip-table rows to this attempt's row log (fsynced; finalize merges them) -> append one fsynced
line (shard record, clip ids, clip records) to this rank's progress log. Only a shard named in a
progress log counts; anything else in shards/ is debris from a crash and is discarded on resume.

The writer goes through OUT's commit protocol (vaecache.cache.commits) and does not know which one it holds: on disk
the shard is written as above and committed by its progress line; in object storage it is PUT (atomic: whole or
absent) under its unique name, then the progress line is PUT as its commit record (vaecache.cache.objects), then the
row and progress logs are appended in the rank's local work folder, as on disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch
from safetensors.torch import save as safetensors_save

from vaecache import faults
from vaecache.cache.io import NON_FINITE_KEY, AppendLog, replace_non_finite
from vaecache.cache.layout import FORMAT_NAME, FORMAT_VERSION, SHARDS_DIR, rows_name, shard_name
from vaecache.cache.progress import progress_line
from vaecache.cache.provenance import IdentityMemo
from vaecache.cache.table import RowLog
from vaecache.errors import OutputError
from vaecache.settings.buckets import fit_geometry
from vaecache.settings.dtypes import recorded_name

if TYPE_CHECKING:
    from vaecache.cache.commits import CacheOut


class ClipLike(Protocol):
    """What the writer needs to know of a clip (vaecache.planning.clips.Clip)."""

    clip_id: str
    scene_id: str
    cameras: Sequence[str]
    paths: Sequence[str]
    frames: Sequence[int]
    fps: float
    bucket: Any
    """A buckets.Bucket or None (a one-size run)."""
    displayed: Sequence[tuple[int, int]]
    """Per camera, the displayed (width, height) of the source."""


def tensor_name(clip_id: str, key: str) -> str:
    """A stored tensor's name comes only from clip identity: `<clip id>/mean`."""
    return f"{clip_id}/{key}"


def encode_record(cameras: Sequence[str], view_settings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The clip record's `encode` field from each camera's encode settings (`EncodeResult.view_settings`)."""
    if len(view_settings) != len(cameras):
        raise ValueError(f"{len(view_settings)} view settings for {len(cameras)} cameras")
    return {"tiled": any(s["tiled"] for s in view_settings),
            "tiled_cameras": [cam for cam, s in zip(cameras, view_settings) if s["tiled"]],
            "units_per_forward": max(s["units_per_forward"] for s in view_settings)}


def geometry_record(clip: ClipLike, fit: str) -> dict[str, Any]:
    """The clip record's `bucket` and `crop` (one entry per camera: source size, the source box kept, the
    padding added in bucket pixels) for a bucketed run."""
    bucket = clip.bucket
    return {"bucket": bucket.to_record(),
            "crop": [fit_geometry(w, h, bucket.height, bucket.width, fit).to_record((w, h)) for w, h in clip.displayed]}


def failure_record(scene: str, reason: str, *, clip: str | None = None, camera: str | None = None,
                   path: str | None = None) -> dict[str, Any]:
    """A failure record (failures.parquet): an input that produced no clip. `path` is None for a missing camera."""
    return {"scene": scene, "clip": clip, "camera": camera, "path": path, "reason": reason}


_STATS_CHUNK = 1 << 18
"""Elements converted to float64 at a time: no full float64 copy of a large tensor."""


STATS_RTOL = 1e-6
"""The relative tolerance verify checks a recorded statistic to: the sums are float64 reductions, and recomputing
them may differ in the last bits with the order of summation (the thread count)."""


def tensor_stats(tensor: torch.Tensor) -> dict[str, float]:
    """Summary values recorded per tensor at encode time; verify recomputes them from the stored bytes.

    min/max are exact in the stored dtype; mean and population std are accumulated in float64. An empty tensor (a
    prompt of no tokens, with a tokenizer that adds none) has zeros."""
    flat = tensor.detach().to("cpu").reshape(-1)
    count = flat.numel()
    if count == 0:
        return {"min": 0.0, "max": 0.0, "mean": 0.0, "std": 0.0}
    low, high = (float(v) for v in torch.aminmax(flat))
    if not (math.isfinite(low) and math.isfinite(high)):
        return {"min": low, "max": high, "mean": float("nan"), "std": float("nan")}
    buffer = torch.empty(min(_STATS_CHUNK, count), dtype=torch.float64)

    def chunks():
        for start in range(0, count, _STATS_CHUNK):
            part = buffer[:min(_STATS_CHUNK, count - start)]
            part.copy_(flat[start:start + _STATS_CHUNK])
            yield part

    mean = sum(float(part.sum()) for part in chunks()) / count
    variance = sum(float(part.sub_(mean).square_().sum()) for part in chunks()) / count
    return {"min": low, "max": high, "mean": mean, "std": math.sqrt(variance)}


CHANNEL_AXIS = 1
"""The channel axis of a clip's stored tensors, (cameras, channels, latent frames, h, w)."""


def _channel_parts(tensor: torch.Tensor) -> list[dict[str, float]]:
    """tensor_stats of each channel (axis CHANNEL_AXIS) of a clip's tensor, a channel at a time."""
    tensor = tensor.detach().to("cpu")
    if tensor.dim() <= CHANNEL_AXIS:
        return []
    return [tensor_stats(channel) for channel in tensor.unbind(CHANNEL_AXIS)]


def _finite(stats: dict[str, float]) -> bool:
    return math.isfinite(stats["min"]) and math.isfinite(stats["max"])


def channel_stats(tensor: torch.Tensor) -> dict[str, list[float]]:
    """Per latent channel, the mean and population std of a clip's tensor over its cameras, frames and pixels
    (accumulated in float64, a channel at a time, as tensor_stats is): what `vaecache report` sums into the
    cache's per-channel scale without reading a shard; verify recomputes them. A channel holding a non-finite
    value has NaN for both (the writer then refuses the record, as for tensor_stats)."""
    parts = _channel_parts(tensor)
    return {"mean": [p["mean"] if _finite(p) else float("nan") for p in parts],
            "std": [p["std"] if _finite(p) else float("nan") for p in parts]}


def _merged(parts: list[dict[str, float]]) -> dict[str, float]:
    """The whole tensor's min, max, mean and population std from its channels' (equal counts): the two moments
    merged exactly (Chan et al.), equal to tensor_stats' up to the last bits of the float64 sums."""
    low, high = min(p["min"] for p in parts), max(p["max"] for p in parts)
    if not all(_finite(p) for p in parts):
        return {"min": low, "max": high, "mean": float("nan"), "std": float("nan")}
    mean = sum(p["mean"] for p in parts) / len(parts)
    variance = sum(p["std"] ** 2 + (p["mean"] - mean) ** 2 for p in parts) / len(parts)
    return {"min": low, "max": high, "mean": mean, "std": math.sqrt(variance)}


def stats_problem(tensor: torch.Tensor, recorded: dict[str, float] | None,
                  per_channel: dict[str, list[float]] | None = None) -> str | None:
    """Why a stored tensor does not hold what its record says: a non-finite value, or statistics (per tensor, and
    per channel where the record has them: caches written before them have none) other than recorded, each within
    STATS_RTOL. Where the record has channel statistics, the tensor's are merged from its channels' (one pass over
    the values for both)."""
    parts = _channel_parts(tensor) if per_channel is not None and tensor.numel() else []
    found = _merged(parts) if parts else tensor_stats(tensor)
    if not (math.isfinite(found["min"]) and math.isfinite(found["max"])):
        return f"has {int((~torch.isfinite(tensor)).sum())} non-finite value(s)"
    if not recorded:
        return "has no recorded stats"
    for key in ("min", "max", "mean", "std"):
        want, got = recorded.get(key), found[key]
        if want is None or not math.isclose(got, want, rel_tol=STATS_RTOL, abs_tol=1e-9):
            return f"{key} is {got:.6g}, recorded {want}"
    if per_channel is None:
        return None
    for key in ("mean", "std"):
        want_all, now = per_channel.get(key) or [], [p[key] for p in parts]
        if len(want_all) != len(now):
            return f"records {len(want_all)} channel {key}s, it has {len(now)} channels"
        for channel, (got, want) in enumerate(zip(now, want_all)):
            if want is None or not math.isclose(got, want, rel_tol=STATS_RTOL, abs_tol=1e-9):
                return f"channel {channel} {key} is {got:.6g}, recorded {want}"
    return None


class ShardWriter:
    """Context manager: `add()` clips, shards roll at `shard_size` bytes or `commit_every_s` seconds after the last
    commit (whichever comes first: a hard kill loses at most that long of finished work), `close()` commits the
    rest.

    At most `max_pending` shards wait for the disk; beyond that `add()` blocks, so a slow disk slows
    the encoder instead of growing memory.
    """

    def __init__(self, out: CacheOut, rank: int, attempt: int, shard_size: int, progress: AppendLog,
                 max_pending: int = 2, hash_sources: bool = False, fit: str | None = None,
                 commit_every_s: float = 0.0, clock: Any = time.monotonic) -> None:
        self.out = out
        """OUT's commit protocol (commits.CacheOut): the writer does not know which store it writes to."""
        self.folder = self.out.folder / SHARDS_DIR
        self._identities = IdentityMemo(hash_sources)
        self.rank, self.attempt, self.shard_size = rank, attempt, shard_size
        self.progress = progress
        self.fit = fit
        """With a fit mode, each record carries its `bucket` and `crop` (a bucketed run); None: neither."""
        self._seq = 0
        self._open: dict[Any, _OpenShard] = {}
        """Bucket -> its open shard (one key, None, in a one-size run)."""
        self._slots = threading.Semaphore(max_pending)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vaecache-writer-r{rank}")
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self.committed: list[dict[str, Any]] = []
        self.bytes_written = 0
        self._rows: RowLog | None = None
        """This attempt's clip-table rows, opened at the first commit (the commit thread alone touches it)."""
        self.commit_every_s, self._clock = commit_every_s, clock
        self._last_commit = clock()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, clip: ClipLike, tensors: dict[str, torch.Tensor], view_settings: Sequence[dict[str, Any]],
            reading: dict[str, Any] | None = None) -> None:
        """Buffer one clip: `tensors` by stored key (mean, logvar, sample), `view_settings` one per camera,
        `reading` how its cameras were read (vaecache.video.dataset.clip_reading, plus "times": the seconds of each
        frame from the camera's first frame, as decoded).

        The record is completed here and on the writer thread (`shard`, per-tensor `stats` and per-channel
        `channel_stats`) and nowhere else.
        `source_identity` is each source's size and mtime_ns (and sha256 with hash_sources) when its clip is
        committed, aligned with `sources` (an image-sequence camera's over the clip's frame files): `verify
        --dataset` tells from it which latents are stale."""
        self._raise_pending()
        reading = reading or {}
        identity = self._identities.of_clip(clip.paths, reading.get("identity"), reading.get("frame_files"),
                                            clip.cameras)
        times = reading.get("times")
        record = {
            "id": clip.clip_id,
            "scene": clip.scene_id,
            "cameras": list(clip.cameras),
            "sources": list(clip.paths),
            **({"source_identity": identity} if identity is not None else {}),
            **_source_timelines(clip, reading),
            "frames": list(clip.frames),
            "fps": clip.fps if clip.fps else None,  # an image sequence of unknown rate
            **({"times": [round(float(t), 6) for t in times]} if times is not None else {}),
            **{key: reading[key] for key in ("camera_frames", "camera_times", "frame_files") if key in reading},
            "tensors": {key: {"name": tensor_name(clip.clip_id, key), "shape": list(t.shape),
                              "dtype": recorded_name(t.dtype)} for key, t in tensors.items()},
            "encode": encode_record(clip.cameras, view_settings),
            **(geometry_record(clip, self.fit) if self.fit is not None and getattr(clip, "bucket", None) is not None
               else {}),
        }
        metadata = getattr(clip, "metadata", None)  # the index line's own keys, passed through uninterpreted
        if metadata is not None:
            record["metadata"] = json.loads(metadata)
        if reading.get("clip_metadata"):  # what the layout knows of this clip's own frames (LeRobot: their tasks)
            record.setdefault("metadata", {}).update(reading["clip_metadata"])
        per_frame = getattr(clip, "frame_metadata", None)
        if per_frame is not None:  # each camera frame's own entry (nuScenes: its ego pose), for the frames taken
            chosen = reading.get("camera_frames") or {}
            record.setdefault("metadata", {})["frames"] = {
                camera: per_frame.entries(index, chosen.get(camera, clip.frames))
                for index, camera in enumerate(clip.cameras)}
        if "metadata" in record:  # NaN and Infinity, which JSON cannot hold, are stored as null and named
            record["metadata"], replaced = replace_non_finite(record["metadata"], "metadata")
            noted = record["metadata"].pop(NON_FINITE_KEY, None)  # those `vaecache index` replaced in its line
            if isinstance(noted, list):
                replaced = [f"index line: {path}" for path in noted if isinstance(path, str)] + replaced
            elif noted is not None:
                record["metadata"][NON_FINITE_KEY] = noted
            if replaced:
                record[NON_FINITE_KEY] = replaced
        # one shard per latent shape: the bucket where there is one, else the shapes themselves
        key = clip.bucket if getattr(clip, "bucket", None) is not None else None
        shard = self._open.setdefault(key, _OpenShard())
        for key_name, tensor in tensors.items():
            name = tensor_name(clip.clip_id, key_name)
            if name in shard.tensors or any(name in other.tensors for other in self._open.values()):
                raise ValueError(f"tensor {name} added twice")
            tensor = tensor.detach().to("cpu").contiguous()
            shard.tensors[name] = tensor
            shard.bytes += tensor.numel() * tensor.element_size()
        shard.records.append(record)
        if shard.bytes >= self.shard_size:
            self._flush_one(key)
        elif self.commit_every_s and self._clock() - self._last_commit >= self.commit_every_s:
            self.flush()  # the time bound: every bucket's buffered clips, each as a (smaller) shard

    def flush(self) -> None:
        """Hand every bucket's buffered clips to the writer thread, one shard each (in the order opened)."""
        for key in list(self._open):
            self._flush_one(key)

    def _flush_one(self, key: Any) -> None:
        shard = self._open.pop(key, None)
        if shard is None or not shard.records:
            return
        tensors, records = shard.tensors, shard.records
        self._last_commit = self._clock()
        name = shard_name(self.attempt, self.rank, self._seq)
        self._seq += 1
        self._slots.acquire()
        self._futures.append(self._pool.submit(self._commit, name, tensors, records))

    def _commit(self, name: str, tensors: dict[str, torch.Tensor], records: list[dict[str, Any]]) -> None:
        try:
            for record in records:
                record["shard"] = name
                for entry in record["tensors"].values():
                    entry["stats"] = tensor_stats(tensors[entry["name"]])
                    entry["channel_stats"] = channel_stats(tensors[entry["name"]])
            # One metadata key: safetensors writes metadata in hash-map order, so two keys would make
            # identical shards differ in bytes and sha256 from run to run.
            data = safetensors_save(tensors, metadata={"format": f"{FORMAT_NAME}/{FORMAT_VERSION}"})
            shard = {
                "file": f"{SHARDS_DIR}/{name}",
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "clips": len(records),
                "tensors": len(tensors),
            }
            number = len(self.committed) + 1
            if faults.should_fail("crash-mid-write", number, self.rank):
                self.out.leave_torn_shard(shard["file"], data)
                faults.crash()
            if faults.should_fail("enospc", number, self.rank):
                raise OutputError(f"{self.folder / name}: cannot write ({faults.disk_full(name).strerror})")
            try:
                line = progress_line(shard, records)
            except (ValueError, RecursionError) as exc:  # metadata nested past the stack: the same refusal
                raise OutputError(f"{shard['file']}: a clip record JSON cannot write ({exc}); nothing of this shard "
                                  f"was written") from None
            self.out.write_shard(shard["file"], data)
            if faults.should_fail("crash-before-record", number, self.rank):
                faults.crash()
            self.out.commit(shard["file"], line)
            if self._rows is None:
                self._rows = RowLog(self.progress.path.parent / rows_name(self.rank, self.attempt))
            # rows of the records as the line gives them back (keys sorted, JSON types): the table is the same
            # whether finalize reads the row log or, for a cache without one, the progress lines
            self._rows.append(json.loads(line)["clips"])
            self.progress.append_line(line)
            if faults.should_fail("crash-after-commit", number, self.rank):
                self.out.settle()
                faults.crash()
            self.committed.append(shard)
            self.bytes_written += len(data)
        except BaseException as exc:
            if self._error is None:
                self._error = exc
            raise
        finally:
            self._slots.release()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error = self._error
            if isinstance(error, OutputError):
                raise OutputError(str(error)) from None
            raise OutputError(f"rank {self.rank}: writing a shard failed: {error}") from error

    def close(self, settle: bool = True) -> list[dict[str, Any]]:
        """Commit what is buffered and wait for the disk; raise the first write error. Without `settle`, the last
        commit may still be under way (CacheOut.settle): finalize settles it beside the tables."""
        try:
            self.flush()
            for future in self._futures:
                future.exception()
        finally:
            self._pool.shutdown(wait=True)
            self._close_rows()
        self._raise_pending()
        if settle:
            self.out.settle()
        return self.committed

    def _close_rows(self) -> None:
        if self._rows is not None:
            self._rows.close()
            self._rows = None

    def abort(self) -> None:
        """Drop buffered clips, let in-flight commits finish (each is atomic), keep what committed."""
        self._open = {}
        self._pool.shutdown(wait=True)
        self._close_rows()


class _OpenShard:
    """The clips buffered for one bucket's next shard."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.records: list[dict[str, Any]] = []
        self.bytes = 0


def _source_timelines(clip: ClipLike, reading: dict[str, Any]) -> dict[str, Any]:
    """{"source_timelines": per camera, its probe's frame index cut to the keyframes of the frames this clip took
    (vaecache.video.timeline.Timeline.for_frames; None for a camera without one, or whose frame times are a packed
    list, a variable-frame-rate video's, which a cut would repeat whole in every clip record)}, or nothing where no
    camera has one: what a re-read of the clip (verify --reencode, decode, LatentCache.source_frames) seeks by."""
    timelines = getattr(clip, "timelines", ())
    if not timelines:
        return {}
    per_camera = reading.get("camera_frames") or {}
    found: list[str | None] = []
    for camera, path, timeline in zip(clip.cameras, clip.paths, timelines):
        frames = per_camera.get(camera) or clip.frames
        cut = None
        if timeline is not None and timeline.pts_rule is not None:  # a packed frame list is kept whole: not per clip
            try:  # one episode of a file keeps the file's index cut to the episode (its file frames): kept as it is
                cut = (timeline.to_json() if isinstance(path, str) and "#from_ns=" in path
                       else timeline.for_frames(frames[0], frames[-1]).to_json())
            except ValueError:  # damaged: its decode failed already, naming it
                cut = None
        found.append(cut)
    return {"source_timelines": found} if any(found) else {}
