"""Probing: what opening each source tells (frame count, fps, size, rotation), judged per scene, cached per
file, and one driver that probes a rank's share of scenes in a thread pool for index, encode and plan."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence

from vaecache.cache.io import cut_torn_tail, loads, whole_lines
from vaecache.errors import DatasetError, FrameBudgetError, OutputError, VideoDecodeError
from vaecache.meter import Advance
from vaecache.settings.commands import DEFAULT_PROBE_WORKERS
from vaecache.sources.scene import CameraProbe, Scene, SceneProbe

log = logging.getLogger("vaecache")


def probe_file(path: str) -> CameraProbe:
    """Open one video and read what planning needs. Raises VideoDecodeError (naming the file) when it cannot.

    The frame count is that of a straight decode from the start (see vaecache.video.reader.VideoReader); size and
    mtime are read before the file is opened, so a file changed while it is probed looks changed later."""
    from vaecache.video.backends import open_video

    try:
        stat = os.stat(path)
    except OSError:
        stat = None  # open_video names the problem (missing, a loop, permission)
    with open_video(path) as reader:
        if stat is None:
            stat = os.stat(path)
        width, height = reader.frame_size
        fps = reader.fps()
        if width < 1 or height < 1 or not 0 < fps < math.inf or stat.st_size < 1:
            raise VideoDecodeError(path, f"the stream reports a {width}x{height} frame size at {fps:g} fps "
                                         "(damaged or truncated?)")
        return CameraProbe(len(reader), fps, width, height, reader.codec, stat.st_size, stat.st_mtime_ns,
                           reader.rotation)


def probe_scene(scene: Scene) -> SceneProbe:
    """Every camera's probe, then the checks of `judge_scene`. A scene whose index gives its probes (see
    Scene.probed) opens no video; any other opens every camera's video in turn, stopping at the first error."""
    if scene.probed is not None:
        return judge_scene(scene, scene.probed)
    return judge_scene(scene, open_scene(scene))


def open_scene(scene: Scene) -> list[CameraProbe | VideoDecodeError]:
    """Probe each camera's video in camera order, up to the first missing camera or unreadable file."""
    found: list[CameraProbe | VideoDecodeError] = []
    for path in scene.paths:
        if path is None:
            break
        try:
            found.append(probe_file(path))
        except VideoDecodeError as exc:
            found.append(exc)
            break
    return found


def judge_scene(scene: Scene, found: Sequence[CameraProbe | VideoDecodeError]) -> SceneProbe:
    """Pure: whether a scene is usable from its cameras' probes (in camera order; a probe may be the error
    opening that camera gave). All cameras must be present and readable, with the same number of frames at
    the same fps, and the frame range must lie inside the video."""
    if len(found) == 1 == len(scene.paths) and isinstance(found[0], CameraProbe) and scene.frame_range is None:
        only = found[0]  # one camera, whole video: nothing to compare (the common case of a big index)
        return SceneProbe(scene.scene_id, num_frames=only.frames, fps=only.fps,
                          rotations=_shared((only.rotation,)), cameras=(only,))
    counts, fps_values = [], []
    for index, (camera, path) in enumerate(zip(scene.cameras, scene.paths)):
        if path is None:
            return SceneProbe(scene.scene_id, error=f"camera {camera!r} is missing", error_camera=camera)
        probe = found[index]
        if isinstance(probe, VideoDecodeError):
            return SceneProbe(scene.scene_id, error=probe.reason, error_path=path, error_camera=camera)
        counts.append(probe.frames)
        fps_values.append(probe.fps)
    if len(set(counts)) > 1:
        shortest = min(range(len(counts)), key=counts.__getitem__)
        return SceneProbe(
            scene.scene_id,
            error=f"camera {scene.cameras[shortest]!r} has {counts[shortest]} frames, others have up to {max(counts)}",
            error_path=scene.paths[shortest], error_camera=scene.cameras[shortest],
        )
    odd = next((i for i, fps in enumerate(fps_values) if abs(fps - fps_values[0]) > 0.01 * fps_values[0]), None)
    if odd is not None:
        return SceneProbe(
            scene.scene_id,
            error=f"camera {scene.cameras[odd]!r} runs at {fps_values[odd]:g} fps, camera {scene.cameras[0]!r} at "
                  f"{fps_values[0]:g} fps (the same frame index would not be the same moment)",
            error_path=scene.paths[odd], error_camera=scene.cameras[odd],
        )
    total = counts[0]
    if scene.frame_range is not None:
        start, stop = scene.frame_range
        if stop > total:
            return SceneProbe(scene.scene_id, error=f"frame range [{start}, {stop}) exceeds the video's {total} frames",
                              error_path=scene.paths[0], error_camera=scene.cameras[0])
    probes = tuple(found)  # type: ignore[arg-type]  # every entry is a CameraProbe here
    return SceneProbe(scene.scene_id, num_frames=total, fps=fps_values[0],
                      rotations=_shared(tuple(p.rotation for p in probes)), cameras=probes)


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
    for path, result in zip(scene.paths, found):
        if isinstance(result, CameraProbe):
            records.append({"path": path, "probe": result.to_json()})
            continue
        if result.reason.startswith(ENVIRONMENT_REASONS) or isinstance(result, FrameBudgetError):
            continue  # a chmod, a remount or another --max-frame-pixels changes these, not size or mtime: look again
        try:
            stat = os.stat(result.path)
        except OSError:
            continue
        records.append({"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "error": result.reason})
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
                    cache[record["path"]] = CameraProbe.from_json(record["probe"], str(file))
                else:
                    cache[record["path"]] = (int(record["size"]), int(record["mtime_ns"]), str(record["error"]))
            except (ValueError, KeyError, TypeError, DatasetError):  # UnicodeDecodeError is a ValueError
                continue
    return cache


def probe_from_cache(scene: Scene, cache: ProbeCache) -> SceneProbe | None:
    """The scene judged from cached probes of files that did not change since (size and mtime), or None when
    one of its files must be opened again."""
    found: list[CameraProbe | VideoDecodeError] = []
    for path in scene.paths:
        if path is None:
            break
        entry = cache.get(path)
        if entry is None:
            return None
        try:
            stat = os.stat(path)
        except OSError:
            return None
        if isinstance(entry, CameraProbe):
            if not entry.matches(stat):
                return None
            found.append(entry)
            continue
        if (stat.st_size, stat.st_mtime_ns) != entry[:2]:
            return None
        found.append(VideoDecodeError(path, entry[2]))
        break
    return judge_scene(scene, found)


# --------------------------------------------------------------------------- the probing driver


def probe_in_pool(scenes: Sequence[Scene],
                  workers: int) -> Iterator[tuple[Scene, list[CameraProbe | VideoDecodeError]]]:
    """Each scene with what opening its cameras found (open_scene), in the order given; `workers` threads, at
    most 4 x workers scenes in flight."""
    if workers <= 1:
        yield from ((scene, open_scene(scene)) for scene in scenes)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vaecache-probe") as pool:
        pending: deque[tuple[Scene, Future[list[CameraProbe | VideoDecodeError]]]] = deque()
        queue = iter(scenes)
        for scene in queue:
            pending.append((scene, pool.submit(open_scene, scene)))
            if len(pending) >= 4 * workers:
                break
        while pending:
            scene, future = pending.popleft()
            following = next(queue, None)
            if following is not None:
                pending.append((following, pool.submit(open_scene, following)))
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


def probe_dataset(scenes: Sequence[Scene], ctx: Any = None, *, workers: int = DEFAULT_PROBE_WORKERS,
                  cache_paths: Callable[[], Iterable[Path]] = tuple, gather: bool = True,
                  trust_index_probes: bool = True,
                  on_scene: Callable[[Scene, list[dict[str, Any]]], None] | None = None,
                  advance: Advance | None = None) -> Probed:
    """Probe the scenes that need it, across ranks: `vaecache index`, `encode` and `plan` all probe through here.

    Scenes whose index line gives their probe are skipped (no video opened) unless not `trust_index_probes`
    (`vaecache index` of an index probes every file again). The probe cache (`cache_paths()`:
    OUT/probes, or an index run's partial files) answers for every file that kept its size and mtime; rank 0
    alone reads it and stats the files, and every rank gets its verdict (ranks that judged apart, a cache file one
    node cannot read, an mtime another sees late, would plan differently). Each rank then opens its round-robin
    share of the rest in a pool of `workers` threads, in order; `on_scene(scene, records)` sees each scene's new
    probe-cache records as it is done (an index run appends them to its partial file). With `gather`, every rank
    ends with every probe (encode and plan plan from them); without, each holds its own share's."""
    rank, world = (ctx.info.rank, ctx.info.world_size) if ctx is not None else (0, 1)

    def from_cache() -> tuple[dict[str, SceneProbe], list[int]]:
        cache = read_probe_cache(sorted(cache_paths()))
        cached: dict[str, SceneProbe] = {}
        unknown = []
        for position, scene in enumerate(scenes):
            if scene.probed is not None and trust_index_probes:
                continue
            known = probe_from_cache(scene, cache) if cache else None
            if known is None:
                unknown.append(position)
            else:
                cached[scene.scene_id] = known
        return cached, unknown

    known, unknown = ctx.on_rank0(from_cache) if ctx is not None else from_cache()
    result = Probed(probes=known, cached=len(known))
    share = [scenes[position] for position in unknown[rank::world]]
    mine: list[SceneProbe] = []
    for scene, found in probe_in_pool(share, workers):
        probe = judge_scene(scene, found)
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
