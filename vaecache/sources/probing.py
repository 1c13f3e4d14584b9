"""Probing: what opening each source tells (frame count, fps, size, rotation), judged per scene, cached per
file, and one driver that probes a rank's share of scenes in a thread pool for index, encode and plan."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence

from vaecache.cache.io import cut_torn_tail, loads, whole_lines
from vaecache.errors import DatasetError, FrameBudgetError, OutputError, VideoDecodeError
from vaecache.meter import Advance
from vaecache.settings.clip import FRAME_SYNC, SyncConfig
from vaecache.settings.options import DEFAULT_PROBE_WORKERS
from vaecache.sources.scene import CameraProbe, Scene, SceneProbe
from vaecache.storage import HeldObjects
from vaecache.urls import is_url
from vaecache.video.frames import FrameList
from vaecache.video.identity import source_stat

log = logging.getLogger("vaecache")


def probe_file(path: str | FrameList, frame_rate: float | None = None, held: HeldObjects | None = None) -> CameraProbe:
    """Open one camera (a video, or an image sequence at `frame_rate` where its frames carry no times) and read
    what planning needs. Raises VideoDecodeError (naming the file) when it cannot.

    The frame count is that of a straight decode from the start (see vaecache.video.reader.VideoReader); size and
    mtime are read before the file is opened, so a file changed while it is probed looks changed later. A small
    video at a URL the probe read whole is held in `held` (an encode's decode worker opens it again)."""
    from vaecache.video.backends import open_camera
    from vaecache.video.reader import VideoReader
    from vaecache.video.spans import SpanReader

    name = path.key if isinstance(path, FrameList) else path
    try:
        identity: tuple[int, int] | None = source_stat(path)
    except OSError:
        identity = None  # open_camera names the problem (missing, a loop, permission)
    with open_camera(path, fps=frame_rate) as reader:
        if identity is None:
            identity = source_stat(path)
        read_whole = reader.whole_object() if isinstance(reader, VideoReader) else None
        if read_whole is not None and held is not None:  # a decode worker's first batch reads these bytes
            held.hold(name, read_whole)
        width, height = reader.frame_size
        fps = reader.fps()
        times = reader.times_ns()
        if width < 1 or height < 1 or not 0 <= fps < math.inf or identity[0] < 1:
            raise VideoDecodeError(name, f"the stream reports a {width}x{height} frame size at {fps:g} fps "
                                         "(damaged or truncated?)")
        return CameraProbe(len(reader), fps, width, height, reader.codec, identity[0], identity[1], reader.rotation,
                           times[0] if times else None, times[-1] if times else None,
                           reader.timeline if isinstance(reader, (VideoReader, SpanReader)) else None,
                           episode=isinstance(reader, SpanReader))


def probe_scene(scene: Scene, sync: SyncConfig = FRAME_SYNC) -> SceneProbe:
    """Every camera's probe, then the checks of `judge_scene`. A scene whose index gives its probes (see
    Scene.probed) opens no video; any other opens every camera's video in turn, stopping at the first error."""
    if scene.probed is not None:
        return judge_scene(scene, scene.probed, sync)
    return judge_scene(scene, open_scene(scene), sync)


def open_scene(scene: Scene, recent: RecentProbes | None = None,
               held: HeldObjects | None = None) -> list[CameraProbe | VideoDecodeError]:
    """Probe each camera in camera order, up to the first missing camera or unreadable source. `recent`: the last
    sources probed, so that the scenes of one video (a table's clip ranges) open it once."""
    sources = []
    for camera in range(len(scene.cameras)):
        source = scene.source(camera)
        if source is None:
            break
        sources.append(source)

    def probe(source: str | FrameList) -> CameraProbe | VideoDecodeError:
        key = (getattr(source, "key", source), scene.frame_rate)
        result = recent.get(key) if recent is not None else None
        if result is None:
            try:
                result = probe_file(source, scene.frame_rate, held)
            except VideoDecodeError as exc:
                result = exc
            if recent is not None:
                recent.put(key, result)
        return result

    results: Iterable[CameraProbe | VideoDecodeError]
    if sum(isinstance(source, str) and is_url(source) for source in sources) > 1:
        # each object costs a store's round trips, which one camera after another would add up: opened side by side
        with ThreadPoolExecutor(max_workers=len(sources), thread_name_prefix="vaecache-probe-camera") as pool:
            results = list(pool.map(probe, sources))
    else:
        results = map(probe, sources)  # lazily: no camera past the first unreadable one is opened
    found: list[CameraProbe | VideoDecodeError] = []
    for result in results:
        found.append(result)
        if isinstance(result, VideoDecodeError):
            break
    return found


class RecentProbes:
    """The last `size` sources' probes (or the error opening them), shared by a pool's threads."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._known: OrderedDict[Any, CameraProbe | VideoDecodeError] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> CameraProbe | VideoDecodeError | None:
        with self._lock:
            found = self._known.get(key)
            if found is not None:
                self._known.move_to_end(key)
            return found

    def put(self, key: Any, result: CameraProbe | VideoDecodeError) -> None:
        with self._lock:
            self._known[key] = result
            while len(self._known) > self._size:
                self._known.popitem(last=False)


def judge_scene(scene: Scene, found: Sequence[CameraProbe | VideoDecodeError],
                sync: SyncConfig | None = FRAME_SYNC) -> SceneProbe:
    """Pure: whether a scene is usable from its cameras' probes (in camera order; a probe may be the error
    opening that camera gave). All cameras must be present and readable. With `--sync frames` they must have the
    same number of frames at the same fps, and the frame range must lie inside the video; with `--sync timestamps`
    every camera needs frame times, and the usable frames are the reference camera's that lie where every camera
    has frames (SceneProbe.first and num_frames). `sync` None: only whether every camera is there and readable
    (`vaecache index`, whose index serves either rule)."""
    for index, probe in enumerate(found):  # what an index claims is checked before anything is planned from it
        claimed = probe.claim_problem() if isinstance(probe, CameraProbe) else None
        if claimed is not None:
            return SceneProbe(scene.scene_id, error=claimed, error_path=scene.paths[index],
                              error_camera=scene.cameras[index])
    if (len(found) == 1 == len(scene.paths) and isinstance(found[0], CameraProbe) and scene.frame_range is None
            and scene.time_range is None and (sync is None or sync.mode == "frames")):
        only = found[0]  # one camera, whole video: nothing to compare (the common case of a big index)
        return SceneProbe(scene.scene_id, num_frames=only.frames, fps=only.fps,
                          rotations=_shared((only.rotation,)), cameras=(only,))
    counts, fps_values = [], []
    for index, (camera, path) in enumerate(zip(scene.cameras, scene.paths)):
        if path is None:
            return SceneProbe(scene.scene_id, error=f"camera {camera!r} is missing", error_camera=camera)
        probe = found[index]
        if isinstance(probe, VideoDecodeError):
            return SceneProbe(scene.scene_id, error=probe.reason, error_path=probe.path, error_camera=camera)
        counts.append(probe.frames)
        fps_values.append(probe.fps)
    probes = tuple(found)  # type: ignore[arg-type]  # every entry is a CameraProbe here
    if sync is None:
        return SceneProbe(scene.scene_id, num_frames=counts[0], fps=fps_values[0],
                          rotations=_shared(tuple(p.rotation for p in probes)), cameras=probes)
    if sync.mode == "timestamps":
        return _judge_by_time(scene, probes, sync)
    if len(set(counts)) > 1:
        shortest = min(range(len(counts)), key=counts.__getitem__)
        return SceneProbe(
            scene.scene_id,
            error=f"camera {scene.cameras[shortest]!r} has {counts[shortest]} frames, others have up to {max(counts)} "
                  "(cameras that start at different times: --sync timestamps)",
            error_path=scene.paths[shortest], error_camera=scene.cameras[shortest],
        )
    known = [(i, fps) for i, fps in enumerate(fps_values) if fps > 0]  # an image sequence's rate may be unknown
    odd = next((i for i, fps in known if abs(fps - known[0][1]) > 0.01 * known[0][1]), None)
    if odd is not None:
        first = known[0][0]
        return SceneProbe(
            scene.scene_id,
            error=f"camera {scene.cameras[odd]!r} runs at {fps_values[odd]:g} fps, camera {scene.cameras[first]!r} at "
                  f"{fps_values[first]:g} fps (the same frame index would not be the same moment; --sync timestamps "
                  "pairs frames by time)",
            error_path=scene.paths[odd], error_camera=scene.cameras[odd],
        )
    total, first = counts[0], 0
    if scene.frame_range is not None:
        start, stop = scene.frame_range
        if stop > total:
            return SceneProbe(scene.scene_id, error=f"frame range [{start}, {stop}) exceeds the video's {total} frames",
                              error_path=scene.paths[0], error_camera=scene.cameras[0])
    if scene.time_range is not None:  # the usable frames are then [first, total)
        found_range = frames_in_time(scene.time_range, probes[0])
        if isinstance(found_range, str):
            return SceneProbe(scene.scene_id, error=found_range, error_path=scene.paths[0],
                              error_camera=scene.cameras[0])
        first, total = found_range
        if scene.frame_range is not None:
            first, total = max(first, scene.frame_range[0]), min(total, scene.frame_range[1])
        if total <= first:
            return SceneProbe(scene.scene_id, error=_empty_time_range(scene.time_range, probes[0]),
                              error_path=scene.paths[0], error_camera=scene.cameras[0])
    return SceneProbe(scene.scene_id, num_frames=total, fps=known[0][1] if known else 0.0,
                      rotations=_shared(tuple(p.rotation for p in probes)), cameras=probes, first=first)


TIME_RANGE_SLACK_NS = 500_000
"""Clip tables give times to the millisecond (Panda-70M's H:MM:SS.mmm, a frame's time rounded): a boundary stands for
the frames from 0.5 ms before it, so a frame at 7.3407 s starts the range written 7.341 and ends the one before."""


def frames_in_time(time_range: tuple[int, int], probe: CameraProbe) -> tuple[int, int] | str:
    """Pure: [first, stop) of the frames whose times fall in `time_range` (ns from the first frame, end excluded),
    both ends moved TIME_RANGE_SLACK_NS earlier. A frame's time is its place on the camera's even timeline,
    round(index x the mean frame period), the period from the first and last frame times where probed, else 1/fps
    (vaecache decodes only evenly spaced stretches, so this is the presentation time up to the container's timestamp
    rounding, well under the slack). A str: why there is none."""
    period = (_period(probe) if probe.start_ns is not None and probe.frames > 1
              else 1e9 / probe.fps if probe.fps > 0 else 0.0)
    if period <= 0:
        return "a time range needs the video's frame rate, and it has none (one frame, or image frames without times)"

    def first_at(moment: int) -> int:  # the first frame at or after `moment`
        index = min(max(0, math.ceil(moment / period) - 1), probe.frames)
        while index < probe.frames and round(index * period) < moment:
            index += 1
        return index

    return first_at(time_range[0] - TIME_RANGE_SLACK_NS), first_at(time_range[1] - TIME_RANGE_SLACK_NS)


def _empty_time_range(time_range: tuple[int, int], probe: CameraProbe) -> str:
    span = (probe.end_ns - probe.start_ns) / 1e9 if probe.start_ns is not None else probe.frames / (probe.fps or 1)
    return (f"time range [{time_range[0] / 1e9:.3f}, {time_range[1] / 1e9:.3f}) s holds no frame of the video "
            f"({probe.frames} frames over {span:.3f} s)")


def _period(probe: CameraProbe) -> float:
    """A camera's mean frame period in ns from its first and last frame times (0 for one frame)."""
    return (probe.end_ns - probe.start_ns) / (probe.frames - 1) if probe.frames > 1 else 0.0  # type: ignore[operator]


def _judge_by_time(scene: Scene, probes: tuple[CameraProbe, ...], sync: SyncConfig) -> SceneProbe:
    """--sync timestamps: the reference camera's frames inside the span every camera covers (first/last frame
    times); the frame range, where the index gives one, counts in the reference camera's frames."""
    reference = scene.cameras.index(sync.reference) if sync.reference in scene.cameras else 0
    for camera, probe, path in zip(scene.cameras, probes, scene.paths):
        if probe.start_ns is None:
            return SceneProbe(scene.scene_id, error=f"camera {camera!r} has no frame times (--sync timestamps needs "
                                                    "them: a timestamps.txt, timestamped file names, --fps, or a "
                                                    "probe written by this vaecache's `index`)",
                              error_path=path, error_camera=camera)
    ref = probes[reference]
    # a reference frame is usable where every other camera has a frame within its tolerance (half its period)
    reach = [0.0 if i == reference else (sync.tolerance * 1e9 if sync.tolerance is not None else _period(p) / 2)
             for i, p in enumerate(probes)]
    lo = max(p.start_ns - r for p, r in zip(probes, reach))  # type: ignore[operator]
    hi = min(p.end_ns + r for p, r in zip(probes, reach))  # type: ignore[operator]
    period = _period(ref)
    first, stop = 0, ref.frames
    if period > 0:
        first = max(0, math.ceil((lo - ref.start_ns) / period - 1e-6))  # type: ignore[operator]
        stop = min(ref.frames, math.floor((hi - ref.start_ns) / period + 1e-6) + 1)  # type: ignore[operator]
    if scene.time_range is not None:
        found_range = frames_in_time(scene.time_range, ref)
        if isinstance(found_range, str):
            return SceneProbe(scene.scene_id, error=found_range, error_path=scene.paths[reference],
                              error_camera=scene.cameras[reference])
        first, stop = max(first, found_range[0]), min(stop, found_range[1])
        if stop <= first:
            return SceneProbe(scene.scene_id, error=_empty_time_range(scene.time_range, ref),
                              error_path=scene.paths[reference], error_camera=scene.cameras[reference])
    if scene.frame_range is not None:
        if scene.frame_range[1] > ref.frames:
            start, stop = scene.frame_range
            return SceneProbe(scene.scene_id, error=f"frame range [{start}, {stop}) exceeds camera "
                                                    f"{scene.cameras[reference]!r}'s {ref.frames} frames",
                              error_path=scene.paths[reference], error_camera=scene.cameras[reference])
        first, stop = max(first, scene.frame_range[0]), min(stop, scene.frame_range[1])
    if stop <= first:
        late = max(range(len(probes)), key=lambda i: probes[i].start_ns)  # type: ignore[arg-type,return-value]
        begins = probes[late].start_ns / 1e9  # type: ignore[operator]
        return SceneProbe(scene.scene_id, error=f"the cameras never all have frames at once: camera "
                                                f"{scene.cameras[late]!r} starts at {begins:.3f} s, after another ends "
                                                f"at {hi / 1e9:.3f} s",
                          error_path=scene.paths[late], error_camera=scene.cameras[late])
    return SceneProbe(scene.scene_id, num_frames=stop, fps=ref.fps or (1e9 / period if period else 0.0),
                      rotations=_shared(tuple(p.rotation for p in probes)), cameras=probes, first=first)


_SHARED: dict[tuple[int, ...], tuple[int, ...]] = {}


def _shared(value: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple object per distinct value (a million scenes have a handful of rotation tuples)."""
    return _SHARED.setdefault(value, value)


ProbeCache = dict[str, "CameraProbe | tuple[int, int, str]"]
"""Source path -> its probe, or (size, mtime_ns, reason) for a file that could not be read."""


ENVIRONMENT_REASONS = ("permission denied", "cannot read (")
"""Decode failures that say more about the file system than the file: never cached."""


def probe_records(scene: Scene, found: Sequence[CameraProbe | VideoDecodeError]) -> list[dict[str, Any]]:
    """Cache records (one per file opened, see open_scene) for the probe cache: a readable file's probe, or
    the reason an unreadable one failed with its size and mtime. A file that cannot be stat'ed is not cached."""
    records = []
    for camera, (path, result) in enumerate(zip(scene.paths, found)):
        if isinstance(result, CameraProbe):
            records.append({"path": path, "probe": result.to_json()})
            continue
        if result.reason.startswith(ENVIRONMENT_REASONS) or isinstance(result, FrameBudgetError):
            continue  # a chmod, a remount or another --max-frame-pixels changes these, not size or mtime: look again
        try:
            size, mtime_ns = source_stat(scene.source(camera))  # type: ignore[arg-type]
        except (OSError, VideoDecodeError):
            continue
        records.append({"path": path, "size": size, "mtime_ns": mtime_ns, "error": result.reason})
    return records


def read_probe_cache(paths: Iterable[Path]) -> ProbeCache:
    """The probe cache files `paths` merged (a later record wins). A torn or unparsable line is ignored:
    the cache only saves work, the file it describes is probed again."""
    cache: ProbeCache = {}
    for file in paths:
        try:
            lines = [line for _, line in whole_lines(file)]  # a tail torn inside a UTF-8 character is cut
        except OSError:
            continue
        for line in lines:
            try:
                record = loads(line)
                if "probe" in record:
                    cache[record["path"]] = CameraProbe.from_json(record["probe"], str(file), record["path"])
                else:
                    cache[record["path"]] = (int(record["size"]), int(record["mtime_ns"]), str(record["error"]))
            except (ValueError, KeyError, TypeError, DatasetError):  # UnicodeDecodeError is a ValueError
                continue
    return cache


def probe_from_cache(scene: Scene, cache: ProbeCache, sync: SyncConfig | None = FRAME_SYNC) -> SceneProbe | None:
    """The scene judged from cached probes of files that did not change since (size and mtime), or None when
    one of its files must be opened again."""
    found: list[CameraProbe | VideoDecodeError] = []
    for camera, path in enumerate(scene.paths):
        if path is None:
            break
        entry = cache.get(path)
        if entry is None:
            return None
        try:
            identity = source_stat(scene.source(camera))  # type: ignore[arg-type]
        except (OSError, VideoDecodeError):
            return None
        if isinstance(entry, CameraProbe):
            if not entry.matches(identity):
                return None
            found.append(entry)
            continue
        if identity != entry[:2]:
            return None
        found.append(VideoDecodeError(path, entry[2]))
        break
    return judge_scene(scene, found, sync)


# --------------------------------------------------------------------------- the probing driver


def probe_in_pool(scenes: Sequence[Scene], workers: int,
                  held: HeldObjects | None = None) -> Iterator[tuple[Scene, list[CameraProbe | VideoDecodeError]]]:
    """Each scene with what opening its cameras found (open_scene, holding in `held` the small videos it reads
    whole), in the order given; `workers` threads, at most 4 x workers scenes in flight."""
    recent = RecentProbes()
    if workers <= 1:
        yield from ((scene, open_scene(scene, recent, held)) for scene in scenes)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vaecache-probe") as pool:
        pending: deque[tuple[Scene, Future[list[CameraProbe | VideoDecodeError]]]] = deque()
        queue = iter(scenes)
        for scene in queue:
            pending.append((scene, pool.submit(open_scene, scene, recent, held)))
            if len(pending) >= 4 * workers:
                break
        while pending:
            scene, future = pending.popleft()
            following = next(queue, None)
            if following is not None:
                pending.append((following, pool.submit(open_scene, following, recent, held)))
            yield scene, future.result()


@dataclass
class Probed:
    """What probe_dataset learnt."""

    probes: dict[str, SceneProbe] = field(default_factory=dict)
    """Scene id -> its judged probe: from the probe cache, or opened (by this rank, or by every rank when gathered).
    Scenes whose index line carries its probe have none here: planning judges them from the line."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """This rank's new probe-cache records (probe_records), for a ProbeLog; empty when `on_scene` took them."""
    opened: int = 0
    """Scenes this rank opened."""
    cached: int = 0
    """Scenes the probe cache answered for."""


def cache_verdicts(scenes: Sequence[Scene], cache_paths: Callable[[], Iterable[Path]] = tuple,
                   trust_index_probes: bool = True,
                   sync: SyncConfig | None = FRAME_SYNC) -> tuple[dict[str, SceneProbe], list[int]]:
    """What the probe cache (`cache_paths()`) says of `scenes`: scene id -> its judged probe, and the positions in
    `scenes` of those whose files must be opened (none whose index line gives its probe, if `trust_index_probes`)."""
    cache = read_probe_cache(sorted(cache_paths()))
    cached: dict[str, SceneProbe] = {}
    unknown = []
    for position, scene in enumerate(scenes):
        if scene.probed is not None and trust_index_probes:
            continue
        known = probe_from_cache(scene, cache, sync) if cache else None
        if known is None:
            unknown.append(position)
        else:
            cached[scene.scene_id] = known
    return cached, unknown


def probe_dataset(scenes: Sequence[Scene], ctx: Any = None, *, workers: int = DEFAULT_PROBE_WORKERS,
                  cache_paths: Callable[[], Iterable[Path]] = tuple, gather: bool = True,
                  trust_index_probes: bool = True,
                  on_scene: Callable[[Scene, list[dict[str, Any]]], None] | None = None,
                  advance: Advance | None = None, sync: SyncConfig = FRAME_SYNC,
                  held: HeldObjects | None = None) -> Probed:
    """Probe the scenes that need it, across ranks: `vaecache index`, `encode` and `plan` all probe through here.

    Scenes whose index line gives their probe are skipped (no video opened) unless not `trust_index_probes`
    (`vaecache index` of an index probes every file again). The probe cache (`cache_paths()`:
    OUT/probes, or an index run's partial files) answers for every file that kept its size and mtime; rank 0
    alone reads it and stats the files, and every rank gets its verdict (ranks that judged apart, a cache file one
    node cannot read, an mtime another sees late, would plan differently). Each rank then opens its round-robin
    share of the rest in a pool of `workers` threads, in order; `on_scene(scene, records)` sees each scene's new
    probe-cache records as it is done (an index run appends them to its partial file). With `gather`, every rank
    ends with every probe (encode and plan plan from them); without, each holds its own share's. `held` (an
    encode's) holds the small videos at URLs probing reads whole, for the decode workers' first batches."""
    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)

    def from_cache() -> tuple[dict[str, SceneProbe], list[int]]:
        return cache_verdicts(scenes, cache_paths, trust_index_probes, sync)

    known, unknown = ctx.on_rank0(from_cache) if ctx is not None else from_cache()
    result = Probed(probes=known, cached=len(known))
    share = [scenes[position] for position in unknown[rank::world]]
    mine: list[SceneProbe] = []
    for scene, found in probe_in_pool(share, workers, held):
        probe = judge_scene(scene, found, sync)
        mine.append(probe)
        records = probe_records(scene, found)
        if on_scene is not None:
            on_scene(scene, records)  # it keeps them (an index run's partial file): not held here too
        else:
            result.records.extend(records)
        if advance is not None:
            advance(1, len(share))
    result.opened = len(share)
    if gather and ctx is not None and unknown:  # rank 0's verdict, so every rank takes part or none does
        for part in ctx.all_gather_object(mine):
            result.probes.update((probe.scene_id, probe) for probe in part)
    else:
        result.probes.update((probe.scene_id, probe) for probe in mine)
    if unknown:
        log.info("probed %d of %d scenes (%d from the probe cache or the index)", len(unknown), len(scenes),
                 len(scenes) - len(unknown))
    return result


class ProbeLog:
    """A per-rank probe-cache file (OUT/probes/rank-N.jsonl, an index run's partial file), appended to: cut back to
    its last whole line when opened (a crash mid-write), fsynced every `sync_every_scenes` scenes or
    `sync_every_s` seconds and on close."""

    def __init__(self, path: Path, sync_every_scenes: int = 256, sync_every_s: float = 5.0) -> None:
        self.path = Path(path)
        self.sync_every_scenes, self.sync_every_s = sync_every_scenes, sync_every_s
        try:
            self.path.parent.mkdir(exist_ok=True)
            cut_torn_tail(self.path)
            self._handle: IO[str] = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot open the probe cache ({exc.strerror or exc})") from None
        self._unsynced, self._last_sync = 0, time.monotonic()

    def add(self, records: Sequence[dict[str, Any]]) -> None:
        """Append one scene's records (synced now and then: a crash loses the scenes since the last sync)."""
        try:
            self._handle.write("".join(json.dumps(r, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n"
                                       for r in records))
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write the probe cache ({exc.strerror or exc})") from None
        self._unsynced += 1
        if self._unsynced >= self.sync_every_scenes or time.monotonic() - self._last_sync >= self.sync_every_s:
            self.sync()

    def sync(self) -> None:
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write the probe cache ({exc.strerror or exc})") from None
        self._unsynced, self._last_sync = 0, time.monotonic()

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self._handle.close()


def write_probe_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append records to a probe-cache file at once (one fsync): a restart opens none of these videos again."""
    if not records:
        return
    probe_log = ProbeLog(path, sync_every_scenes=len(records) + 1)
    try:
        probe_log.add(records)
    finally:
        probe_log.close()
