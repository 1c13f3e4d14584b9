"""The views of a batch, decoded in DataLoader workers: ViewDecoder (one camera of one clip, readers kept
open) and ViewBatchDataset (item i: the views this rank encodes for batch i, and what the clip records need to
know of how they were read; failures reported, not raised)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, Sequence

import numpy as np
import torch

from vaecache.errors import DatasetError, VideoDecodeError
from vaecache.settings.clip import DEFAULT_MAX_FRAME_PIXELS
from vaecache.storage import HeldObjects
from vaecache.urls import is_url
from vaecache.video.backends import PYAV, Backend, ForeignReader, open_camera
from vaecache.video.frames import FrameList, FrameSequence, files_identity, is_image_source
from vaecache.video.identity import identity_on_open, source_stat
from vaecache.video.reader import VideoReader
from vaecache.video.resize import resize_fit, to_model_range
from vaecache.video.spans import adopt_readers
from vaecache.video.sync import synchronized_frames
from vaecache.video.timeline import MAX_FRAMES, Timeline

Reader = VideoReader | ForeignReader | FrameSequence


class ViewDecoder:
    """Decodes one camera of one clip. Keeps a few readers open: a batch often reads one file twice, and
    the next clip of a file continues where the last one stopped."""

    def __init__(self, height: int, width: int, cache_size: int = 8, fit: str = "cover",
                 backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS,
                 held: HeldObjects | None = None) -> None:
        self.height, self.width, self.fit, self.backend, self.max_pixels = height, width, fit, backend, max_pixels
        self.held = held
        """The small objects probing read whole, for their first open (storage.HeldObjects)."""
        self._readers: OrderedDict[str, Reader] = OrderedDict()
        self._cache_size = cache_size

    def _reader(self, path: str | FrameList, fps: float | None = None, timeline: Timeline | None = None,
                clip: tuple[int, int] | None = None) -> Reader:
        """The open reader of a camera source (a path, or a FrameList named by its key); one opened here gets the
        source's `timeline` and the first and last frame of the `clip` it is opened for (open_camera)."""
        key = path.key if isinstance(path, FrameList) else path
        reader = self._readers.pop(key, None)
        if reader is not None and timeline is not None and getattr(reader, "given_timeline", timeline) != timeline:
            reader.close()  # opened with another clip's cut of the timeline (a clip record's): its keyframes only
            reader = None
        if reader is None:
            reader = open_camera(path, self.backend, self.max_pixels, fps, self.held, timeline, clip)
        self._readers[key] = reader
        while len(self._readers) > self._cache_size:
            self._readers.popitem(last=False)[1].close()
        return reader

    def close(self) -> None:
        while self._readers:
            self._readers.popitem()[1].close()

    def timestamps(self, path: str | FrameList, frames: Sequence[int], fps: float | None = None) -> list[float] | None:
        """Presentation time (seconds from the first frame) of each frame of `path` (None: an image sequence of
        unknown rate)."""
        return self._reader(path, fps).timestamps(frames)

    def opened(self, path: str | FrameList, fps: float | None = None) -> Reader:
        """The reader of a camera source, opened once and kept among the last few."""
        return self._reader(path, fps)

    def open_ahead(self, sources: Sequence[tuple[Any, tuple[int, int] | None, float | None, Timeline | None,
                                                 tuple[int, int] | None]]) -> None:
        """Open the videos at URLs among `sources` ((source, identity or None, fps, timeline or None, the clip's first
        and last frame or None)) side by side, then keep them as `opened` does: each costs a store's round trips (a HEAD
        for its changed-file check, ranged GETs for its header), which one camera after another would add up. A
        source whose check or open fails here is left for `check` to refuse, naming the problem, exactly as without
        this."""
        todo: dict[str, tuple[tuple[int, int] | None, float | None, Timeline | None, tuple[int, int] | None]] = {}
        for source, *opening in sources:
            if isinstance(source, str) and is_url(source) and source not in self._readers and source not in todo:
                todo[source] = tuple(opening)  # type: ignore[assignment]
        todo = dict(list(todo.items())[: self._cache_size])
        if len(todo) < 2:
            return

        openers: set[int] = set()

        def open_one(source: str) -> Reader | None:
            openers.add(threading.get_ident())
            try:
                return open_camera(source, self.backend, self.max_pixels, todo[source][1], self.held, *todo[source][2:])
            except Exception:  # refused again, by name, when `check` opens it
                return None

        def unchanged(source: str) -> bool:
            identity = todo[source][0]
            if identity is None or identity_on_open(source):
                return True  # judged from the reader below
            try:
                check_identity(source, *identity)
                return True
            except Exception:
                return False

        # a tar member's or an episode's changed-file check (a HEAD of its file) and the open (ranged GETs) side by
        # side; a whole object is judged from the request that opened it. A reader of a changed object is closed
        # unused, and `check` refuses the object by name.
        with ThreadPoolExecutor(max_workers=2 * len(todo), thread_name_prefix="vaecache-open") as pool:
            checks = [pool.submit(unchanged, source) for source in todo]
            readers = list(pool.map(open_one, todo))
            for index, (check, source) in enumerate(zip(checks, todo)):
                reader = readers[index]
                if reader is not None and (not check.result() or _changed(todo[source][0], reader)):
                    reader.close()
                    readers[index] = None
        adopt_readers(sorted(openers))  # an episode's reader is its file's, shared per thread: this one's now
        for source, reader in zip(todo, readers):
            if reader is not None:
                self._readers[source] = reader
                while len(self._readers) > self._cache_size:
                    self._readers.popitem(last=False)[1].close()

    def frames(self, path: str | FrameList, frames: Sequence[int], fps: float | None = None,
               timeline: Timeline | None = None) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB, upright, exactly the frames asked for; a reader opened here gets `timeline` (the
        source's frame index: a clip record's, vaecache.video.timeline)."""
        try:
            clip = (frames[0], frames[-1]) if timeline is not None and len(frames) else None
            return self._reader(path, fps, timeline, clip).read(frames)
        except VideoDecodeError:
            stale = self._readers.pop(path.key if isinstance(path, FrameList) else path, None)
            if stale is not None:
                stale.close()
            raise

    def check(self, path: str | FrameList, expect: tuple[int, int, int] | None = None,
              identity: tuple[int, int] | None = None, fps: float | None = None, timeline: Timeline | None = None,
              clip: tuple[int, int] | None = None) -> None:
        """Open `path` (VideoDecodeError when it cannot be, or its frames exceed the budget), and refuse it unless
        it has `expect` = (frames, width, height) as planned and, where an index recorded it, `identity` =
        (size, mtime_ns): a file rewritten since it was probed is refused, even with the same frame count and size:
        before it is opened, or, for a whole object at a URL, by the request that opens it, before a frame is decoded
        (so that its check costs no request of its own). A reader opened here gets `timeline` and `clip`
        (open_camera)."""
        key = path.key if isinstance(path, FrameList) else path
        judge = identity if key not in self._readers and not isinstance(path, FrameList) else None
        if judge is not None and not identity_on_open(path):
            check_identity(path, *judge)  # type: ignore[arg-type]  # not a FrameList here
        try:
            reader = self._reader(path, fps, timeline, clip)
            if _changed(judge, reader):
                raise_changed(path, judge, reader.opened_identity)  # type: ignore[arg-type,union-attr]
            if expect is not None:
                reader.check_probe(*expect)
        except VideoDecodeError:
            stale = self._readers.pop(key, None)
            if stale is not None:
                stale.close()
            raise

    def decode(self, path: str | FrameList, frames: Sequence[int], size: tuple[int, int] | None = None,
               fps: float | None = None, timeline: Timeline | None = None) -> torch.Tensor:
        """(C, T, H, W) float in [-1, 1], at `size` (H, W; default the decoder's own); see `frames`."""
        height, width = size or (self.height, self.width)
        array = self.frames(path, frames, fps, timeline)
        tensor = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)
        tensor = to_model_range(resize_fit(tensor, height, width, self.fit))
        return tensor.permute(1, 0, 2, 3).contiguous()


def check_identity(path: str, size: int, mtime_ns: int) -> None:
    """VideoDecodeError naming both values unless `path` (a video, a frame folder or glob) still has the size and
    mtime its probe recorded."""
    try:
        found = source_stat(path)
    except (OSError, VideoDecodeError):
        return  # opening it names the problem
    if found != (size, mtime_ns):
        raise_changed(path, (size, mtime_ns), found)


def _changed(identity: tuple[int, int] | None, reader: Any) -> bool:
    """Whether the reader of an object opened at a URL found another version than the probe recorded."""
    found = getattr(reader, "opened_identity", None)
    return identity is not None and found is not None and tuple(found) != tuple(identity)


def raise_changed(path: str, recorded: tuple[int, int], found: tuple[int, int]) -> NoReturn:
    """VideoDecodeError naming what changed between the probe's (size, mtime_ns) and the one found."""
    import datetime as _dt

    size, mtime_ns = recorded
    found_size, found_mtime = found

    def when(ns: int) -> str:
        return _dt.datetime.fromtimestamp(ns / 1e9, _dt.timezone.utc).isoformat(timespec="microseconds")

    changes = []
    if found_size != size:
        changes.append(f"size {size} -> {found_size} bytes")
    if found_mtime != mtime_ns:
        changes.append(f"modified {when(mtime_ns)} -> {when(found_mtime)}")
    raise VideoDecodeError(path, f"changed since it was probed ({', '.join(changes)}): its frames may not be the "
                                 "ones indexed; run `vaecache index` again")


class ViewBatchDataset(torch.utils.data.Dataset):
    """Item i decodes the views this rank encodes for batch i; failures are reported, not raised.

    An item is {"index", "views" (V, C, T, H, W), "errors": {clip: (path, reason, whole_file)}, "readings": {clip:
    ClipReading fields (see `reading`)}}. `whole_file`: the source itself failed (it does not open, its frames
    exceed the budget, it is not what its probe says: ViewDecoder.check), whatever frames a clip asks for; every
    later clip of it then fails at once, without opening it again, and the caller records its scene once."""

    def __init__(self, batches: Sequence[Sequence[Any]], view_indices: Sequence[Sequence[int]], height: int, width: int,
                 fit: str = "cover", backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS,
                 held: HeldObjects | None = None) -> None:
        self.batches = [list(b) for b in batches]
        self.view_indices = [list(v) for v in view_indices]
        self.height, self.width, self.fit, self.backend, self.max_pixels = height, width, fit, backend, max_pixels
        self.held = held
        """The small videos at URLs probing read whole, for the first batches' opens (storage.HeldObjects)."""
        self._decoder: ViewDecoder | None = None
        self._condemned: dict[str, str] = {}
        """Path -> why the whole file failed (in this process)."""

    def __len__(self) -> int:
        return len(self.batches)

    def close(self) -> None:
        """Close the videos this process keeps open (decoding with workers 0 opens them here)."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None

    def sources(self, index: int) -> list[Any]:
        """The sources of the views this rank decodes of batch `index`."""
        views = [(clip, camera) for clip in self.batches[index] for camera in range(len(clip.cameras))]
        return [views[view][0].source(views[view][1]) for view in self.view_indices[index]]

    def hold_first(self, batches: int) -> None:
        """Of the small videos at URLs that probing read whole (`held`), keep held only those the first
        `batches` batches read: a decode worker's first batch then opens them without a request. Each batch lets go
        of what its process held once it is decoded."""
        if self.held is None:
            return
        self.held.keep_only({source for index in range(min(batches, len(self.batches)))
                             for source in self.sources(index) if isinstance(source, str)})

    def _opened(self, clip: Any, camera: int) -> Reader:
        """Camera `camera` of `clip`, checked against its probe (ViewDecoder.check; a failure condemns the source)."""
        assert self._decoder is not None
        path = clip.paths[camera]
        if path in self._condemned:
            raise _Condemned(path, self._condemned[path])
        try:
            self._decoder.check(clip.source(camera), clip.expect[camera] if clip.expect else None,
                                clip.identity[camera] if clip.identity else None, clip.frame_rate,
                                *_timeline_of(clip, camera))
        except VideoDecodeError as exc:
            self._condemned[path] = exc.reason
            raise _Condemned(exc.path, exc.reason) from None
        return self._decoder.opened(clip.source(camera), clip.frame_rate)

    def reading(self, clip: Any) -> tuple[list[list[int]], dict[str, Any]]:
        """Which frames of each camera the clip takes (`frames` for all, or by time with --sync timestamps), and
        what its record says of them (clip_reading)."""
        cameras = range(len(clip.cameras))
        if clip.sync is None:
            per_camera = [list(clip.frames) for _ in cameras]
            readers: list[Reader | None] = [self._opened(clip, camera) if is_image_source(clip.source(camera))
                                            else None for camera in cameras]
            return per_camera, with_clip_metadata(clip, clip_reading(clip, per_camera, readers, None))
        readers = [self._opened(clip, camera) for camera in cameras]
        timelines = [reader.times_ns() or [] for reader in readers]  # type: ignore[union-attr]
        per_camera = synchronized_frames(clip.reference, clip.frames, timelines, clip.cameras, clip.paths,
                                         clip.sync.tolerance)
        found = clip_reading(clip, per_camera, readers, timelines)
        found["times"] = readers[clip.reference].timestamps(clip.frames)  # type: ignore[union-attr]  # the reference's
        return per_camera, with_clip_metadata(clip, found)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._decoder is None:
            self._decoder = ViewDecoder(self.height, self.width, fit=self.fit, backend=self.backend,
                                        max_pixels=self.max_pixels, held=self.held)
        batch = self.batches[index]
        bucket = getattr(batch[0], "bucket", None)  # a batch never mixes buckets (planning.jobs.batched)
        size = (bucket.height, bucket.width) if bucket is not None else (self.height, self.width)
        # clip-major, camera-minor, as planning.jobs.batch_views lays a batch out (not imported: planning imports
        # sources, which imports this module)
        views = [(clip_index, camera) for clip_index, clip in enumerate(batch) for camera in range(len(clip.cameras))]
        self._decoder.open_ahead([(batch[clip].source(camera), batch[clip].identity[camera] if batch[clip].identity
                                   else None, batch[clip].frame_rate, *_timeline_of(batch[clip], camera))
                                  for clip, camera in (views[view] for view in self.view_indices[index])
                                  if batch[clip].paths[camera] not in self._condemned])
        decoded: dict[int, torch.Tensor] = {}  # a view listed twice (SP padding) is decoded once
        errors: dict[int, tuple[str, str, bool]] = {}
        readings: dict[int, dict[str, Any]] = {}
        chosen: dict[int, list[list[int]]] = {}
        out: list[torch.Tensor | None] = []
        for view_index in self.view_indices[index]:
            clip_index, camera = views[view_index]
            clip = batch[clip_index]
            tensor = decoded.get(view_index)
            if clip_index not in errors and tensor is None:
                try:
                    if clip_index not in chosen:
                        chosen[clip_index], readings[clip_index] = self.reading(clip)
                    frames = chosen[clip_index][camera]
                    reader = self._opened(clip, camera)
                    tensor = decoded[view_index] = self._decoder.decode(clip.source(camera), frames, size,
                                                                        clip.frame_rate)
                    if "times" not in readings[clip_index]:
                        readings[clip_index]["times"] = reader.timestamps(frames)
                except _Condemned as exc:
                    errors[clip_index] = (exc.path, exc.reason, True)
                except VideoDecodeError as exc:
                    errors[clip_index] = (exc.path, exc.reason, False)
            out.append(tensor if clip_index not in errors else None)
        template = next((t for t in out if t is not None), None)
        if template is None:
            template = torch.zeros(3, len(batch[0].frames), *size)
        stacked = torch.stack([t if t is not None else torch.zeros_like(template) for t in out])
        for clip_index in errors:
            readings.pop(clip_index, None)
        if self.held is not None:
            self.held.keep_only(())  # what this process was held for its first batch, used or not, let go
        return {"index": index, "views": stacked, "errors": errors, "readings": readings}


def _timeline_of(clip: Any, camera: int) -> tuple[Timeline | None, tuple[int, int]]:
    """A clip's camera's timeline (None where its probe recorded none) and the clip's first and last frame (the
    reference camera's: with --sync timestamps another camera's are near them)."""
    timelines = getattr(clip, "timelines", ())
    return (timelines[camera] if timelines else None), (clip.frames[0], clip.frames[-1])


def with_clip_metadata(clip: Any, found: dict[str, Any]) -> dict[str, Any]:
    """`found` with "clip_metadata", what the scene's listing adds to this clip's record (a LeRobot episode's rows
    at the clip's frames); a listing that cannot be read makes the clip a recorded failure naming its file."""
    hook = getattr(getattr(clip, "listing", None), "clip_metadata", None)
    if hook is not None:
        try:
            found["clip_metadata"] = hook(clip.frames)
        except DatasetError as exc:
            raise VideoDecodeError(clip.paths[clip.reference], str(exc)) from None
    return found


def clip_reading(clip: Any, per_camera: Sequence[Sequence[int]], readers: Sequence[Reader | None],
                 timelines: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    """What a clip's record says of how its cameras were read: with --sync timestamps "camera_frames" and
    "camera_times" (seconds on each camera's own clock); for image-sequence cameras "frame_files" and "identity"
    (camera index -> {size, mtime_ns} over the clip's frame files)."""
    found: dict[str, Any] = {}
    if timelines is not None:
        found["camera_frames"] = {name: list(frames) for name, frames in zip(clip.cameras, per_camera)}
        found["camera_times"] = {name: [round(timelines[c][i] / 1e9, 6) for i in per_camera[c]]
                                 for c, name in enumerate(clip.cameras)}
    files = {camera: reader.frame_names(per_camera[camera]) for camera, reader in enumerate(readers)
             if isinstance(reader, FrameSequence)}
    if files:
        found["frame_files"] = {clip.cameras[camera]: names for camera, names in files.items()}
        found["identity"] = {camera: dict(zip(("size", "mtime_ns"), files_identity(names)))
                             for camera, names in files.items()}
    return found


def recorded_views(record: dict[str, Any]) -> list[tuple[Any, list[int]]]:
    """Per camera of a clip record, what to read again and which frames: its recorded frame files (an image
    sequence, all of them in order), else its source at its own frames (`camera_frames` with --sync timestamps)."""
    files = record.get("frame_files") or {}
    frames = record.get("camera_frames") or {}
    views = []
    for camera, path in zip(record["cameras"], record["sources"]):
        if files.get(camera):
            views.append((FrameList(path, tuple(files[camera])), list(range(len(files[camera])))))
        else:
            views.append((path, list(frames.get(camera, record["frames"]))))
    return views


def recorded_timelines(record: dict[str, Any]) -> list[Timeline | None]:
    """Per camera of a clip record, the frame index of its source around the clip's frames (`source_timelines`, what
    encode recorded from the probe; None where it recorded none: an image sequence, a cache written before them, a
    value that is not one or is damaged, whose reader then indexes the video as before)."""
    found = record.get("source_timelines")
    if not isinstance(found, list) or len(found) != len(record["cameras"]):
        return [None] * len(record["cameras"])
    timelines: list[Timeline | None] = []
    identities = record.get("source_identity") if isinstance(record.get("source_identity"), list) else []
    for camera, text in enumerate(found):
        identity = identities[camera] if camera < len(identities) and isinstance(identities[camera], dict) else {}
        size = identity.get("size") if type(identity.get("size")) is int else MAX_FRAMES  # a frame takes a byte
        try:
            timeline = Timeline.from_json(text, "", size) if text is not None else None
            if timeline is not None:
                timeline.check()  # a damaged one is left out: its reader indexes the video, as before
            timelines.append(timeline)
        except (DatasetError, ValueError):
            timelines.append(None)
    return timelines


class _Condemned(VideoDecodeError):
    """A source that failed as a whole (it does not open, or is not what its probe says)."""

