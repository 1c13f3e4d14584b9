"""What probing one camera tells (CameraProbe): the planner needs nothing else of a video.

A planner of ten million clips holds a probe per camera of every scene (an index's probes, or this run's), so a
probe is one immutable bytes object: its numbers packed (PACKED), then its codec and its frame index's text, each field
read back on access. As a slotted dataclass with an int object per number, a float and a Timeline beside its text, a
probe took about 420 bytes; packed it takes about 160 (one rank's planning of the 10M-clip bench: see
docs/benchmarks.md, "Planning"). The Timeline is built when asked for (bounded by what the probe may claim)."""

from __future__ import annotations

import math
import struct
from typing import Any

from vaecache.errors import DatasetError
from vaecache.video.timeline import MAX_FRAMES, Timeline, checked_form

PROBE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "frames": int, "fps": (int, float), "width": int, "height": int, "codec": str, "size": int, "mtime_ns": int,
    "rotation": int, "start_ns": int, "end_ns": int, "timeline": str}
"""What `vaecache index` records per camera, and the JSON type of each (see CameraProbe)."""
_OPTIONAL_PROBE_FIELDS = {"rotation": 0, "start_ns": None, "end_ns": None, "timeline": None}

PACKED = struct.Struct("<qdqqqqqqqBB")
"""frames, fps, width, height, size, mtime_ns, rotation, start_ns, end_ns, flags (TIMED, EPISODE) and the codec name's
length; then the codec name and the timeline's text (UTF-8)."""
_FLAGS = 9
TIMED, EPISODE = 1, 2
"""The camera has frame times; the camera is one episode of a file (vaecache.video.spans), whose timeline is the
file's: bounded by the file's size, not the episode's frame count."""


class CameraProbe(bytes):
    """What opening one video told us (or what an index says it would), immutable:

    - frames: frames of a straight decode from the start (vaecache.video.reader.VideoReader's count);
    - fps: frames per second; 0.0 for an image sequence of unknown rate (no --fps, no frame times);
    - width, height: the stored frame size in pixels, before the display rotation is applied; codec;
    - size, mtime_ns: the file when probed (they tell whether it changed since);
    - rotation: counter-clockwise display rotation in degrees (a multiple of 90) that decoding applies;
    - start_ns, end_ns: the first and last frame's time in ns (video pts with the stream's start offset, an image
      timestamp), telling `--sync timestamps` where a scene's cameras overlap; None: no frame times;
    - timeline: the video's frame index (vaecache.video.timeline): a reader opened with it demuxes nothing to seek,
      and reads only a clip's bytes of an object at a URL. None: an image sequence, a video read by a straight
      decode, or a probe recorded before timelines were (its reader indexes the video by demuxing it, as then). It
      may claim at most `frames` frames, or for an `episode` of a file (its timeline the file's cut to the episode)
      as many as the file has bytes."""

    __slots__ = ()

    def __new__(cls, frames: int, fps: float, width: int, height: int, codec: str, size: int, mtime_ns: int,
                rotation: int = 0, start_ns: int | None = None, end_ns: int | None = None,
                timeline: Timeline | None = None, *, episode: bool = False) -> CameraProbe:
        if (frames < 1 or not 0 <= fps < math.inf or width < 1 or height < 1 or size < 1 or rotation % 90
                or (start_ns is None) != (end_ns is None) or (start_ns is not None and end_ns < start_ns)):  # type: ignore[operator]
            raise DatasetError(f"probe frames={frames}, fps={fps}, {width}x{height}, size={size}, rotation={rotation}, "
                               f"start_ns={start_ns}, end_ns={end_ns}: frames, width, height and size must be "
                               "positive, fps finite and >= 0, rotation a multiple of 90, start_ns and end_ns both "
                               "given (end >= start) or neither")
        return packed_probe(frames, float(fps), width, height, codec, size, mtime_ns, rotation, start_ns, end_ns,
                            timeline.text if timeline is not None else None, episode)

    @property
    def frames(self) -> int:
        return PACKED.unpack_from(self)[0]

    @property
    def fps(self) -> float:
        return PACKED.unpack_from(self)[1]

    @property
    def width(self) -> int:
        return PACKED.unpack_from(self)[2]

    @property
    def height(self) -> int:
        return PACKED.unpack_from(self)[3]

    @property
    def size(self) -> int:
        return PACKED.unpack_from(self)[4]

    @property
    def mtime_ns(self) -> int:
        return PACKED.unpack_from(self)[5]

    @property
    def rotation(self) -> int:
        return PACKED.unpack_from(self)[6]

    @property
    def start_ns(self) -> int | None:
        numbers = PACKED.unpack_from(self)
        return numbers[7] if numbers[_FLAGS] & TIMED else None

    @property
    def end_ns(self) -> int | None:
        numbers = PACKED.unpack_from(self)
        return numbers[8] if numbers[_FLAGS] & TIMED else None

    def geometry(self) -> tuple[int, float, int, int, int]:
        """(frames, fps, width, height, rotation), read at once (what planning asks of every scene)."""
        frames, fps, width, height, _, _, rotation = PACKED.unpack_from(self)[:7]
        return frames, fps, width, height, rotation

    @property
    def episode(self) -> bool:
        return bool(PACKED.unpack_from(self)[_FLAGS] & EPISODE)

    @property
    def codec(self) -> str:
        length = self[PACKED.size - 1]
        return self[PACKED.size:PACKED.size + length].decode("utf-8")

    @property
    def timeline_text(self) -> str | None:
        """The frame index's text (`v1|...`), read without building a Timeline; None where there is none."""
        start = PACKED.size + self[PACKED.size - 1]
        return self[start:].decode("utf-8") if len(self) > start else None

    @property
    def timeline(self) -> Timeline | None:
        text = self.timeline_text
        if text is None:
            return None
        numbers = PACKED.unpack_from(self)
        return Timeline._of_text(text, min(MAX_FRAMES, numbers[4] if numbers[_FLAGS] & EPISODE else numbers[0]))

    def to_json(self) -> dict[str, Any]:
        frames, fps, width, height, size, mtime_ns, rotation, start_ns, end_ns, flags, _ = PACKED.unpack_from(self)
        found = {"frames": frames, "fps": fps, "width": width, "height": height, "codec": self.codec, "size": size,
                 "mtime_ns": mtime_ns, "rotation": rotation}
        if flags & TIMED:
            found["start_ns"], found["end_ns"] = start_ns, end_ns
        timeline = self.timeline_text
        if timeline is not None:
            found["timeline"] = timeline
        return found

    @classmethod
    def from_json(cls, raw: Any, where: str, source: Any = None) -> CameraProbe:
        """Validate one index/cache record; a wrong or missing field is a DatasetError naming `where`. `source`: the
        camera's source, where known: one episode of a file (vaecache.video.spans) keeps the file's frame index,
        bounded by the file's size rather than the episode's frame count."""
        if not isinstance(raw, dict):
            raise DatasetError(f"{where}: a probe must be an object with {', '.join(PROBE_FIELDS)}, got {raw!r:.80}")
        try:  # the common case, checked fast: every field present with its type, nothing else
            frames, fps, width, height, codec, size, mtime_ns = (raw["frames"], raw["fps"], raw["width"],
                                                                 raw["height"], raw["codec"], raw["size"],
                                                                 raw["mtime_ns"])
            rotation = raw.get("rotation", 0)
            start_ns, end_ns = raw.get("start_ns"), raw.get("end_ns")
            timed = type(start_ns) is type(end_ns) is int
            timeline = raw.get("timeline")
            if (type(frames) is type(width) is type(height) is type(size) is type(mtime_ns) is type(rotation) is int
                    and type(fps) in (float, int) and type(codec) is str
                    and len(raw) == 7 + ("rotation" in raw) + 2 * timed + ("timeline" in raw)  # nothing unknown
                    and frames > 0 and 0 <= fps < math.inf and width > 0 and height > 0 and size > 0
                    and not rotation % 90 and (not timed or end_ns >= start_ns)):
                return packed_probe(frames, float(fps), width, height, codec, size, mtime_ns, rotation,
                                    start_ns if timed else None, end_ns if timed else None,
                                    checked_form(timeline, where) if timeline is not None else None,
                                    is_episode(source))
        except KeyError:
            pass
        for name, kind in PROBE_FIELDS.items():
            value = raw.get(name, _OPTIONAL_PROBE_FIELDS.get(name))
            if value is None and name in _OPTIONAL_PROBE_FIELDS:
                continue
            if value is None:
                raise DatasetError(f"{where}: probe lacks \"{name}\" (needs {', '.join(PROBE_FIELDS)})")
            if isinstance(value, bool) or not isinstance(value, kind):
                expected = "a number" if kind == (int, float) else "a string" if kind is str else "an integer"
                raise DatasetError(f"{where}: probe field \"{name}\" must be {expected}, got {value!r:.80}")
        unknown = sorted(set(raw) - set(PROBE_FIELDS))
        if unknown:
            raise DatasetError(f"{where}: unknown probe field(s) {', '.join(map(repr, unknown))} "
                               f"(known: {', '.join(PROBE_FIELDS)})")
        try:
            return cls(raw["frames"], float(raw["fps"]), raw["width"], raw["height"], raw["codec"], raw["size"],
                       raw["mtime_ns"], raw.get("rotation", 0), raw.get("start_ns"), raw.get("end_ns"),
                       Timeline.from_json(raw["timeline"], where) if "timeline" in raw else None,
                       episode=is_episode(source))
        except DatasetError:
            raise DatasetError(f"{where}: probe values out of range (frames, width, height and size must be "
                               f"positive, fps finite and >= 0, rotation a multiple of 90, start_ns <= end_ns, both "
                               f"or neither, every number within 64 bits): {raw!r:.200}") from None

    def claim_problem(self) -> str | None:
        """What this probe claims that its file cannot hold, read from the probe alone (an index line's, checked before
        anything is planned from it): more frames than the file has bytes (a frame takes at least one), more than a
        timeline may list, a frame rule of another count than the probe's (for one episode of a file, whose index is
        the file's: fewer than the episode's, or more than the file has bytes). None for a probe vaecache took."""
        numbers = PACKED.unpack_from(self)
        frames, size, episode = numbers[0], numbers[4], numbers[_FLAGS] & EPISODE
        if frames > size or frames > MAX_FRAMES:
            return (f"its probe claims {frames} frames in a file of {size} bytes (a frame takes at least one byte, "
                    f"and a video at most {MAX_FRAMES} frames): run `vaecache index` again")
        start = PACKED.size + numbers[-1]
        if len(self) <= start:
            return None
        rule = self[start:self.find(b"|", start + 3)].split(b"|")[-1]  # `v1|FIRST,STEP,COUNT|...`: its COUNT
        claimed = int(rule.rsplit(b",", 1)[-1]) if rule.count(b",") == 2 and rule.rsplit(b",", 1)[-1].isdigit() \
            else None
        if claimed is not None and (claimed < frames or claimed > size if episode else claimed != frames):
            return f"its frame index claims {claimed} frames, its probe {frames}: run `vaecache index` again"
        return None

    def matches(self, identity: tuple[int, int]) -> bool:
        """Whether a source of this (size, mtime_ns) (vaecache.video.identity.source_stat) is still the one
        probed."""
        return identity == (self.size, self.mtime_ns)

    def __repr__(self) -> str:
        return (f"CameraProbe(frames={self.frames}, fps={self.fps}, width={self.width}, height={self.height}, "
                f"codec={self.codec!r}, size={self.size}, mtime_ns={self.mtime_ns}, rotation={self.rotation}, "
                f"start_ns={self.start_ns}, end_ns={self.end_ns}, timeline={self.timeline!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return _unpickled_probe, (bytes(self),)


def is_episode(source: Any) -> bool:
    """Whether a camera's source is one episode of a file (vaecache.video.spans: `FILE#from_ns=...`)."""
    return isinstance(source, str) and "#from_ns=" in source


def _unpickled_probe(data: bytes) -> CameraProbe:
    return bytes.__new__(CameraProbe, data)


def packed_probe(frames: int, fps: float, width: int, height: int, codec: str, size: int, mtime_ns: int,
                 rotation: int, start_ns: int | None, end_ns: int | None, timeline: str | None,
                 episode: bool = False) -> CameraProbe:
    """A CameraProbe of values already checked (CameraProbe checks them; an index's from_json checks them once, for a
    million lines); a number past 64 bits is a DatasetError."""
    name = codec.encode("utf-8")
    if len(name) > 255:
        raise DatasetError(f"probe codec {codec[:40]!r}...: more than 255 bytes")
    try:
        numbers = PACKED.pack(frames, fps, width, height, size, mtime_ns, rotation, start_ns or 0, end_ns or 0,
                              (TIMED if start_ns is not None else 0) | (EPISODE if episode else 0), len(name))
    except struct.error:
        raise DatasetError(f"probe frames={frames}, size={size}, mtime_ns={mtime_ns}, start_ns={start_ns}, "
                           f"end_ns={end_ns}: a number past 64 bits") from None
    return bytes.__new__(CameraProbe, numbers + name + (timeline.encode("utf-8") if timeline is not None else b""))


__all__ = ["PROBE_FIELDS", "CameraProbe", "is_episode", "packed_probe"]
