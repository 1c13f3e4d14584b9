"""The clips a dataset yields: windows of each scene's usable frames, their ids, and PlannedClips, the whole
plan held as one count per scene (ten million clips never become ten million objects), with the resume mask
(DoneMask) it is filtered by.

Everything here is pure (no I/O, no processes): the same inputs give the same clips on every rank, in
`vaecache encode`, `vaecache plan` and `vaecache verify --dataset`. Which rank encodes which clip is
planning/jobs.py. Past 400 lines because PlannedClips' lazy indexing, slicing and filtering belong together.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, overload

import numpy as np

from vaecache.settings.buckets import Bucket, displayed_size, nearest_size
from vaecache.settings.clip import SamplingConfig, frame_budget_problem
from vaecache.sources.probing import judge_scene
from vaecache.sources.scene import Skipped, source_of

if TYPE_CHECKING:
    from vaecache.settings.clip import SyncConfig
    from vaecache.sources.scene import CameraProbe, FrameMetadata, Listing, Scene, SceneProbe
    from vaecache.video.frames import FrameList
    from vaecache.video.timeline import Timeline


@dataclass(frozen=True)
class Clip:
    """One training sample: the same frame indices of every camera of a scene."""

    clip_id: str
    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str, ...]
    frames: tuple[int, ...]
    fps: float
    expect: tuple[tuple[int, int, int], ...] = ()
    """Per camera, (frames, width, height) the probe found: decoding refuses a video that differs (it
    changed since it was probed). Empty: nothing to check."""
    bucket: Bucket | None = None
    """The size and length this clip is encoded at (None: the run's one --size, planned without sizes)."""
    displayed: tuple[tuple[int, int], ...] = ()
    """Per camera, (width, height) of the upright decoded frame (after the display rotation), as probed."""
    metadata: str | None = None
    """The scene's index metadata as JSON text (Scene.metadata); the writer stores it as the record's `metadata`."""
    identity: tuple[tuple[int, int], ...] = ()
    """Per camera, (size, mtime_ns) an index recorded when it probed the file: decoding refuses a file whose size
    or mtime differ (other content with the same frame count and size). Empty: nothing to check."""
    listing: Listing | None = None
    """The scene's frame lists and per-frame metadata (Scene.listing); None: every camera's path is its source."""
    frame_rate: float | None = None
    """The rate of image-sequence cameras without frame times (Scene.frame_rate)."""
    sync: SyncConfig | None = None
    """With --sync timestamps (reference resolved): `frames` are the reference camera's, and every other camera
    takes its frames nearest their times (vaecache.video.sync). None: every camera uses `frames`."""
    timelines: tuple[Timeline | None, ...] = ()
    """Per camera, the frame index its probe recorded (vaecache.video.timeline): its reader demuxes nothing to
    seek, and reads only the clip's bytes of an object at a URL. Empty: none recorded."""

    @property
    def frame_metadata(self) -> FrameMetadata | None:
        """Per camera and frame, the layout's metadata (Scene.frame_metadata): the record keeps the clip's frames'."""
        return self.listing.frame_metadata if self.listing is not None else None

    def source(self, camera: int) -> str | FrameList:
        """What camera `camera` is read from (its FrameList, else its path)."""
        return source_of(self.listing, self.paths, camera)  # type: ignore[return-value]

    @property
    def reference(self) -> int:
        """The camera whose frames `frames` are (the first, unless --sync timestamps names another)."""
        if self.sync is None or self.sync.reference not in self.cameras:
            return 0
        return self.cameras.index(self.sync.reference)

    @property
    def num_views(self) -> int:
        return len(self.cameras)


def clip_id_for(scene_id: str, frames: Sequence[int]) -> str:
    """Identity of a clip, from its source only: scene id and first/last source frame."""
    return f"{scene_id}/{frames[0]:06d}-{frames[-1]:06d}"


def scene_lengths(usable: int, sampling: SamplingConfig) -> tuple[tuple[int, int], ...]:
    """Pure: which frame buckets a scene of `usable` frames is cut at, as (index into sampling.lengths, window
    count) in the order given. "longest": only the longest bucket with a window; "all": every one with one."""
    found = [(index, window_count(0, usable, sampling.for_length(length)))
             for index, length in enumerate(sampling.lengths)]
    found = [(index, count) for index, count in found if count]
    if sampling.frames_policy == "longest" and len(found) > 1:
        found = [max(found, key=lambda part: sampling.lengths[part[0]])]
    return tuple(found)


def window_count(start: int, stop: int, sampling: SamplingConfig) -> int:
    """How many windows of `sampling` fit in source frames [start, stop), without listing them."""
    if stop - start < sampling.span:
        return 0
    count = (stop - start - sampling.span) // sampling.step + 1
    return count if sampling.max_clips_per_scene is None else min(count, sampling.max_clips_per_scene)


def window(start: int, index: int, sampling: SamplingConfig) -> tuple[int, ...]:
    """The frame indices of window `index` of a scene whose usable frames start at `start`."""
    first = start + index * sampling.step
    return tuple(range(first, first + sampling.span, sampling.frame_stride))


def plan_clips(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig,
               sizes: Sequence[tuple[int, int]] | None = None) -> tuple[PlannedClips, list[Skipped]]:
    """The clips of every usable scene as a PlannedClips (a clip count per scene: no Clip is built until
    a block of them is asked for), and the scenes that give none. Pure: no I/O. A scene whose index gives
    its probe (Scene.probed) needs no entry in `probes`.

    With `sizes` ((H, W) buckets) every clip carries its Bucket: the scene's size is the one nearest in log
    aspect to its cameras' displayed sizes (buckets.nearest_size), its lengths those scene_lengths gives."""
    usable = PlannedScenes()
    counts, stops, size_index = array("q"), array("q"), array("H")
    skipped: list[Skipped] = []
    shared: dict[Any, Any] = {}  # per camera geometry: (expect, displayed, size index)
    clips_of: dict[int, int] = {}  # usable frames -> clips (a million scenes have few distinct lengths)
    by_time = sampling.sync.mode == "timestamps"
    for scene in scenes:
        probe = probes.get(scene.scene_id)
        if probe is None and scene.probed is not None:
            if len(scene.probed) == 1 and scene.frame_range is None and scene.time_range is None and not by_time:
                cameras = scene.probed  # judge_scene has nothing to compare: skip building its SceneProbe
                claimed = cameras[0].claim_problem()  # but what the index claims is checked, as judge_scene does
                if claimed is not None:
                    skipped.append(Skipped(scene.scene_id, scene.paths[0], claimed, scene.cameras[0]))
                    continue
                start, (stop, fps, *_) = 0, cameras[0].geometry()
            else:
                probe = judge_scene(scene, scene.probed, sampling.sync)  # pure: the index gave the probe
        elif probe is None:
            raise KeyError(f"scene {scene.scene_id} was not probed")
        if probe is not None:
            if probe.error is not None:
                skipped.append(Skipped(scene.scene_id, probe.error_path, probe.error, probe.error_camera))
                continue
            cameras, fps = probe.cameras, probe.fps
            if by_time or scene.time_range is not None:  # the frames judge_scene found usable
                start, stop = probe.first, probe.num_frames
            else:
                start, stop = scene.frame_range if scene.frame_range is not None else (0, probe.num_frames)
        count = clips_of.get(stop - start)
        if count is None:
            count = clips_of[stop - start] = sum(count for _, count in scene_lengths(stop - start, sampling))
        if not count:
            shortest = min(sampling.for_length(length).span for length in sampling.lengths)
            skipped.append(Skipped(scene.scene_id, None,
                                   f"too short: {stop - start} usable frames, one clip needs {shortest}"))
            continue
        if len(cameras) == 1:
            key: Any = cameras[0].geometry()
        else:
            key = tuple(camera.geometry() for camera in cameras)
        geometry = shared.get(key)  # equal tuples stored once, and the size bucket found once per geometry
        if geometry is None:
            expect = tuple((c.frames, c.width, c.height) for c in cameras)
            displayed = tuple(displayed_size(c.width, c.height, c.rotation) for c in cameras)
            oversized = next((i for i, c in enumerate(cameras) if c.width * c.height > sampling.max_frame_pixels), None)
            geometry = shared[key] = (expect, displayed, nearest_size(displayed, sizes) if sizes and displayed else 0,
                                      oversized)
        if geometry[3] is not None:  # checked from the probe: nothing of this scene is ever decoded
            camera = cameras[geometry[3]]
            skipped.append(Skipped(scene.scene_id, scene.paths[geometry[3]],
                                   frame_budget_problem(camera.width, camera.height, sampling.max_frame_pixels),
                                   scene.cameras[geometry[3]]))
            continue
        usable.add(scene, start, fps, geometry, cameras)  # the probes: a reference, no copy
        counts.append(count)
        stops.append(stop)
        size_index.append(geometry[2])
    return PlannedClips(usable, counts, sampling, sizes=tuple(sizes) if sizes else None, stops=stops,
                        size_index=size_index), skipped


class PlannedScenes(Sequence[tuple[Any, ...]]):
    """The usable scenes of a plan, column by column: entry `position` is (scene, first usable frame, fps, each
    camera's (frames, width, height), each camera's displayed (width, height), the cameras' probes), built when
    asked for. A plan of a million scenes holds a reference, two numbers and a geometry number per scene (about 30
    bytes) where a tuple per scene took about 100."""

    def __init__(self) -> None:
        self._scenes: list[Scene] = []
        self._starts, self._fps, self._geometry = array("q"), array("d"), array("I")
        self._geometries: list[tuple[Any, Any]] = []
        self._geometry_of: dict[int, int] = {}  # id of a shared geometry tuple -> its number
        self._cameras: list[Sequence[CameraProbe] | None] = []
        """The probes judge_scene kept, where they are not the scene's own `probed` (None: they are)."""

    def add(self, scene: Scene, start: int, fps: float, geometry: tuple[Any, ...],
            cameras: Sequence[CameraProbe]) -> None:
        number = self._geometry_of.get(id(geometry))
        if number is None:  # plan_clips shares one geometry tuple per camera geometry: stored once
            number = self._geometry_of[id(geometry)] = len(self._geometries)
            self._geometries.append((geometry[0], geometry[1], geometry))  # the tuple kept: its id stays its own
        self._scenes.append(scene)
        self._starts.append(start)
        self._fps.append(fps)
        self._geometry.append(number)
        self._cameras.append(None if cameras is scene.probed else cameras)

    def __len__(self) -> int:
        return len(self._scenes)

    @overload
    def __getitem__(self, position: int) -> tuple[Any, ...]: ...

    @overload
    def __getitem__(self, position: slice) -> Sequence[tuple[Any, ...]]: ...

    def __getitem__(self, position: int | slice) -> Any:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        scene = self._scenes[position]
        expect, displayed, _ = self._geometries[self._geometry[position]]
        cameras = self._cameras[position]
        return (scene, self._starts[position], self._fps[position], expect, displayed,
                scene.probed if cameras is None else cameras)

    def scene(self, position: int) -> Scene:
        return self._scenes[position]

    def start(self, position: int) -> int:
        return self._starts[position]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        for position in range(len(self)):
            yield self[position]


@dataclass(frozen=True)
class DoneMask:
    """Which clips of a plan an earlier attempt committed: one bit per clip of the whole plan (committed ones
    included), in plan order. Ten million clips cost 1.25 MB, so rank 0 can tell every rank at once."""

    bits: bytes
    """numpy.packbits(..., bitorder="little") of one flag per planned clip."""
    size: int
    """Clips in the plan the mask was made for (its bit count)."""
    count: int
    """Flags set: committed clips that are in this plan."""

    def __post_init__(self) -> None:
        if self.size < 0 or not 0 <= self.count <= self.size or len(self.bits) != (self.size + 7) // 8:
            raise ValueError(f"DoneMask of {self.size} clips with {len(self.bits)} bytes and {self.count} set")

    def flags(self) -> np.ndarray:
        """One bool per planned clip."""
        return np.unpackbits(np.frombuffer(self.bits, np.uint8), count=self.size, bitorder="little").view(bool)


class DoneMaskBuilder:
    """Rank 0 on resume: marks committed clip ids in a plan as they are read from the progress logs."""

    def __init__(self, plan: PlannedClips) -> None:
        self._locate, self._flags = plan.locator(), np.zeros(plan.planned, bool)
        self.committed = 0
        """Every id given, in the plan or not (a clip of a scene that left the dataset stays in the cache)."""

    def add(self, clip_ids: Iterable[str]) -> None:
        for clip_id in clip_ids:
            self.committed += 1
            position = self._locate(clip_id)
            if position is not None:
                self._flags[position] = True

    def discard(self, clip_ids: Iterable[str]) -> None:
        """Take back ids given to add (their shard was found damaged)."""
        for clip_id in clip_ids:
            self.committed -= 1
            position = self._locate(clip_id)
            if position is not None:
                self._flags[position] = False

    def mask(self) -> DoneMask:
        return DoneMask(np.packbits(self._flags, bitorder="little").tobytes(), len(self._flags),
                        int(np.count_nonzero(self._flags)))


_UNKNOWN = object()


class PlannedClips(Sequence[Clip]):
    """The clips of a plan, in plan order, held as one clip count per scene.

    Indexing and slicing build only the clips asked for, found through prefix sums of the counts: a DP
    group's contiguous block of ten million clips costs the memory of its own clips (and a few bytes per
    scene), never the whole list. `with_done(mask)` is the same sequence less the clips already committed
    (one bit per planned clip); `without(ids)` the same from clip ids."""

    def __init__(self, scenes: PlannedScenes, counts: array, sampling: SamplingConfig,
                 sizes: tuple[tuple[int, int], ...] | None = None, stops: array | None = None,
                 size_index: array | None = None, done: DoneMask | None = None) -> None:
        self._scenes, self._sampling = scenes, sampling
        self._window_counts = counts
        self._sizes = sizes
        if (stops is None or size_index is None) and (sizes or len(sampling.lengths) > 1):
            raise ValueError("PlannedClips with buckets needs each scene's stop and size index")
        self._stops = stops if stops is not None else array("q")
        """Per scene, the end of its usable frames (the frame buckets it is cut at follow from it)."""
        self._size_index = size_index if size_index is not None else array("H")
        """Per scene, its size bucket (index into sizes)."""
        self._buckets = ([[Bucket(h, w, n) for n in sampling.lengths] for h, w in sizes] if sizes else None)
        self._uniform_views: object = _UNKNOWN
        self._planned_ends = array("q", itertools.accumulate(counts))
        """Running total of planned clips (committed ones included) up to and including each scene."""
        self._done_flags: np.ndarray | None = None
        if done is None or not done.count:
            self._ends = self._planned_ends
        else:
            if done.size != self.planned:
                raise ValueError(f"a DoneMask of {done.size} clips for a plan of {self.planned}")
            flags = self._done_flags = done.flags()
            ends = np.frombuffer(self._planned_ends, np.int64)
            # every scene here has a clip, so ends >= 1; int32 counts keep the transient at 4 bytes a clip
            committed = np.cumsum(flags, dtype=np.int32 if len(flags) < 2**31 else np.int64)[ends - 1]
            self._ends = array("q", (ends - committed).tobytes())
        """Running total of clips still to encode up to and including each scene."""

    @property
    def planned(self) -> int:
        """Clips in the plan, committed ones included."""
        return self._planned_ends[-1] if self._planned_ends else 0

    def with_done(self, done: DoneMask | None) -> PlannedClips:
        """The plan's clips less those `done` flags (a mask made for this plan, see DoneMaskBuilder)."""
        less = PlannedClips(self._scenes, self._window_counts, self._sampling, self._sizes, self._stops,
                            self._size_index, done)
        less._uniform_views = self._uniform_views  # the same scenes: no second pass over them
        return less

    def without(self, done: Iterable[str]) -> PlannedClips:
        """These clips less those whose id is in `done` (ids of clips not in the plan are ignored)."""
        builder = DoneMaskBuilder(self)
        builder.add(done)
        return self.with_done(builder.mask())

    def locator(self) -> Callable[[str], int | None]:
        """A function giving the position of a clip id in the whole plan (committed clips included), None for
        a clip not planned. It holds a scene id -> position table: drop it when done."""
        positions = {self._scenes.scene(position).scene_id: position for position in range(len(self._scenes))}
        # the span (last - first + 1) tells the frame bucket: spans of distinct lengths differ
        by_span = {self._sampling.for_length(n).span: i for i, n in enumerate(self._sampling.lengths)}
        steps = [self._sampling.for_length(n).step for n in self._sampling.lengths]

        last: list[Any] = [None, None]  # the scene of the previous id and its parts: ids come scene by scene

        def scene_parts(scene_id: str) -> Any:
            if last[0] != scene_id:
                position = positions.get(scene_id)
                parts = None
                if position is not None:
                    at = self._planned_ends[position] - self._window_counts[position]
                    parts = {}
                    for part, count in self._parts(position):
                        parts[part] = (at, count)
                        at += count
                last[0], last[1] = scene_id, (self._scenes.start(position), parts) if parts is not None else None
            return last[1]

        def locate(clip_id: str) -> int | None:
            scene_id, _, frames = clip_id.rpartition("/")
            found = scene_parts(scene_id)
            first_text, _, last_text = frames.partition("-")
            if found is None or not (first_text.isdigit() and last_text.isdigit()):
                return None
            first, final = int(first_text), int(last_text)
            length = by_span.get(final - first + 1)
            part = found[1].get(length)
            if part is None:
                return None
            index, offset = divmod(first - found[0], steps[length])
            if offset or not 0 <= index < part[1] or frames != f"{first:06d}-{final:06d}":
                return None  # not a window of the plan, or not the id clip_id_for gives it
            return part[0] + index

        return locate

    def _parts(self, position: int) -> tuple[tuple[int, int], ...]:
        """(frame bucket index, window count) of the scene at `position` (recomputed: nothing stored per clip)."""
        if len(self._sampling.lengths) == 1:
            return ((0, self._window_counts[position]),)
        return scene_lengths(self._stops[position] - self._scenes.start(position), self._sampling)

    def views_per_clip(self) -> int | None:
        """The camera count of every scene when they all have the same (a discovered dataset's do), else None."""
        if self._uniform_views is _UNKNOWN:
            counts = {len(self._scenes.scene(position).cameras) for position in range(len(self._scenes))}
            self._uniform_views = counts.pop() if len(counts) == 1 else None
        return self._uniform_views  # type: ignore[return-value]

    def _committed(self, first: int, count: int) -> int:
        """Committed clips among planned positions first..first+count-1."""
        flags = self._done_flags
        return 0 if flags is None else int(np.count_nonzero(flags[first:first + count]))

    def bucket_of(self, position: int, length_index: int) -> Bucket | None:
        """The bucket of the scene at `position` cut at frame bucket `length_index` (None: planned without sizes)."""
        return self._buckets[self._size_index[position]][length_index] if self._buckets is not None else None

    def bucket_parts(self) -> Iterator[tuple[Bucket, int, int]]:
        """(bucket, scene position, clips of that scene in it) for every scene and bucket with clips, committed
        clips left out, in plan order. Nothing is kept: a caller sums what it needs (bounded memory)."""
        if self._buckets is None:
            return
        for position in range(len(self._scenes)):
            at = self._planned_ends[position] - self._window_counts[position]
            for length, count in self._parts(position):
                left = count - self._committed(at, count)
                at += count
                if left > 0:
                    yield self.bucket_of(position, length), position, left  # type: ignore[misc]

    def bucket_counts(self) -> list[tuple[Bucket, int, int]]:
        """Per bucket (sizes x lengths, in that order; empty ones too): (bucket, clips, views)."""
        if self._buckets is None:
            return []
        table = {bucket: [0, 0] for row in self._buckets for bucket in row}
        for bucket, position, count in self.bucket_parts():
            table[bucket][0] += count
            table[bucket][1] += count * len(self._scenes.scene(position).cameras)
        return [(bucket, clips, views) for bucket, (clips, views) in table.items()]

    def scene_geometry(self, position: int) -> tuple[Scene, tuple[tuple[int, int], ...]]:
        """The scene at `position` and its cameras' displayed (width, height)."""
        return self._scenes[position][0], self._scenes[position][4]

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def scene_total(self) -> int:
        """Scenes in the plan (each gives at least one planned clip)."""
        return len(self._scenes)

    def scene_at(self, position: int) -> tuple[Scene, int]:
        """The scene at `position` in plan order and the clips it gives here (committed clips left out)."""
        return self._scenes.scene(position), self._ends[position] - (self._ends[position - 1] if position else 0)

    def views(self) -> int:
        """Views of the clips still to encode (a clip has one per camera)."""
        uniform = self.views_per_clip()
        if uniform is not None:
            return len(self) * uniform
        return sum(count * len(scene.cameras) for scene, count in map(self.scene_at, range(len(self._scenes))))

    def _scene_clips(self, position: int) -> list[Clip]:
        scene, start, fps, expect, displayed, cameras = self._scenes[position]
        timelines = tuple(probe.timeline for probe in cameras)
        if not any(timelines):
            timelines = ()
        # a reader given a timeline takes the frame count from it, not from the file: the file's size and mtime, as
        # probed, are what tells a file rewritten since (an index's, or this run's probes where it has timelines)
        identity = (tuple((probe.size, probe.mtime_ns) for probe in scene.probed) if scene.probed
                    else tuple((probe.size, probe.mtime_ns) for probe in cameras) if timelines else ())
        flags = self._done_flags
        at = self._planned_ends[position] - self._window_counts[position]
        clips = []
        sync = self._sampling.sync if self._sampling.sync.mode == "timestamps" else None
        for length, count in self._parts(position):
            sampling = self._sampling.for_length(self._sampling.lengths[length])
            bucket = self.bucket_of(position, length)
            for index in range(count):
                if flags is not None and flags[at + index]:
                    continue
                frames = window(start, index, sampling)
                clips.append(Clip(clip_id_for(scene.scene_id, frames), scene.scene_id, scene.cameras,
                                  scene.paths, frames, fps, expect, bucket,  # type: ignore[arg-type]  # no None path
                                  displayed if bucket is not None else (), scene.metadata, identity,
                                  scene.listing, scene.frame_rate, sync, timelines))
            at += count
        return clips

    def block_runs(self, lo: int, hi: int) -> list[tuple[Bucket | None, int, int]]:
        """Clips lo..hi-1 as runs of (bucket, views per clip, clips), in plan order, without building them: what
        batching and the SP split depend on (a dry run's counts for every DP group)."""
        lo, hi = max(0, lo), min(len(self), hi)
        runs: list[tuple[Bucket | None, int, int]] = []
        if lo >= hi:
            return runs
        if self._buckets is None and self.views_per_clip() is not None:
            return [(None, self.views_per_clip(), hi - lo)]  # one run: nothing in the block differs
        position = bisect.bisect_right(self._ends, lo)
        at_clip = self._ends[position - 1] if position else 0  # todo index of the scene's first clip
        while at_clip < hi:
            views = len(self._scenes.scene(position).cameras)
            at = self._planned_ends[position] - self._window_counts[position]
            for length, count in self._parts(position):
                left = count - self._committed(at, count)
                at += count
                first, last = max(lo, at_clip), min(hi, at_clip + left)
                if last > first:
                    bucket = self.bucket_of(position, length)
                    if runs and runs[-1][0] == bucket and runs[-1][1] == views:
                        runs[-1] = (bucket, views, runs[-1][2] + last - first)
                    else:
                        runs.append((bucket, views, last - first))
                at_clip += left
            position += 1
        return runs

    def block(self, lo: int, hi: int) -> list[Clip]:
        """Clips lo..hi-1 (plan order), building only the scenes they come from."""
        lo, hi = max(0, lo), min(len(self), hi)
        if lo >= hi:
            return []
        position = bisect.bisect_right(self._ends, lo)
        before = self._ends[position - 1] if position else 0
        out: list[Clip] = []
        while len(out) < hi - lo + (lo - before):
            out.extend(self._scene_clips(position))
            position += 1
        return out[lo - before:hi - before]

    @overload
    def __getitem__(self, index: int) -> Clip: ...

    @overload
    def __getitem__(self, index: slice) -> list[Clip]: ...

    def __getitem__(self, index: int | slice) -> Clip | list[Clip]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stride != 1:
                return self.block(0, len(self))[index]
            return self.block(start, stop)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"clip {index} of {len(self)}")
        return self.block(index, index + 1)[0]

    def __iter__(self) -> Iterator[Clip]:
        for position in range(len(self._scenes)):
            yield from self._scene_clips(position)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return NotImplemented if not isinstance(other, Sequence) else False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PlannedClips({len(self)} clips of {len(self._scenes)} scenes)"
