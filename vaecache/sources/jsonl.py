"""The JSONL index layout: one scene per line, `{"id", "cameras": {camera: source}}` or `{"id", "path"}`, with
an optional `frames` range ([start, stop) in frames) or `seconds` range ([start, end) from the first frame), `fps`
(of image sequences without frame times), `probe` and `frame_metadata` (as `vaecache index` writes them) and any
other keys as metadata. A camera's source is a path (a video, a folder of frames, a glob of frames) or
`{"files": [...], "times_ns": [...] | "timestamps": [seconds...]}`."""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from vaecache.cache.io import STRICT_JSON, NonFiniteNumber, loads
from vaecache.errors import DatasetError
from vaecache.sources.folders import check_cameras_exist, resolved_path
from vaecache.sources.lerobot import EpisodeRows
from vaecache.sources.scene import (
    SINGLE_CAMERA,
    CameraProbe,
    FrameMetadata,
    HeldListing,
    LayoutScenes,
    Listing,
    Scene,
    SourceOptions,
)
from vaecache.storage import open_url
from vaecache.urls import folder_of, is_url, url_join
from vaecache.video.frames import FrameList
from vaecache.video.members import TarMember, member_of


def resolved_in(base: str, relative: str, parents: dict[str, str], trusted: bool = False) -> str:
    """`resolved_path(base / relative)`, with `parents` caching resolved folders: a file that is not itself a
    symlink costs one lstat, so an index of a million scenes in a few folders is not resolved component by
    component a million times. `trusted`: the file name is taken as resolved (no lstat). A video inside a tar
    (`TAR#NAME@OFFSET+SIZE`) has its tar's path resolved."""
    if is_url(base) or is_url(relative):  # an index at a URL (or naming URLs): no links to resolve there
        return relative if is_url(relative) or relative.startswith("/") else url_join(base, relative)
    if "#" in relative and (member := member_of(relative)) is not None:
        tar = member.tar if trusted and member.tar.startswith("/") else resolved_path(Path(base, member.tar))
        return TarMember(tar, member.name, member.offset, member.size).reference
    head, _, name = relative.rpartition("/")
    folder = head if relative.startswith("/") else f"{base}/{head}" if head else base
    if not name or name in (".", ".."):
        return resolved_path(Path(base, relative))
    parent = parents.get(folder)
    if parent is None:
        parent = parents[folder] = resolved_path(Path(folder or "/"))
    path = f"{parent}/{name}" if parent != "/" else f"/{name}"
    if trusted:
        return path
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return path
    except OSError:
        return path  # missing (or unreadable): the probe says so, naming this path
    return resolved_path(Path(path))


def _check_form(record: dict[str, Any], kind: str | None, form: tuple[str, str] | None, where: str,
                order: Sequence[str] | None) -> tuple[str, str]:
    """The index's form ("cameras" or "path", and where first seen) after this line, or the line's error."""
    if "cameras" in record and "path" in record:
        raise DatasetError(f"{where}: has both \"cameras\" and \"path\"; give one")
    if kind is None:
        raise DatasetError(f"{where}: needs \"cameras\" (camera -> path) or \"path\"")
    if form is not None and form[0] != kind:
        raise DatasetError(f"{where}: uses \"{kind}\" but {form[1]} uses \"{form[0]}\"; an index lists "
                           f"every scene one way (all \"cameras\" or all \"path\")")
    if kind == "path" and order and len(order) != 1:
        raise DatasetError(f"{where}: a \"path\" scene has one camera, but {len(order)} cameras were "
                           f"configured (--cameras)")
    return form or (kind, where)


def frame_list(raw: dict[str, Any], key: str, base: str, parents: dict[str, str], where: str) -> FrameList:
    """A camera given file by file: {"files": [paths], "times_ns": [int] or "timestamps": [seconds]} (paths
    relative to the index's folder)."""
    files, times = frame_list_fields(raw, where)
    return FrameList(key, tuple(resolved_in(base, f, parents, True) for f in files),
                     tuple(times) if times is not None else None)


def frame_list_fields(raw: dict[str, Any], where: str) -> tuple[list[str], list[int] | None]:
    """A frame list's files and times (ns), checked; a mistake is a DatasetError naming `where`."""
    files = raw.get("files")
    unknown = sorted(set(raw) - {"files", "times_ns", "timestamps"})
    if unknown:
        raise DatasetError(f"{where}: a camera's frame list has unknown key(s) {', '.join(map(repr, unknown))} "
                           "(known: files, times_ns, timestamps)")
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise DatasetError(f"{where}: a camera's \"files\" must be a non-empty list of paths")
    times = None
    if "times_ns" in raw:
        times = raw["times_ns"]
        if not isinstance(times, list) or not all(type(t) is int for t in times):
            raise DatasetError(f"{where}: \"times_ns\" must be a list of integers (nanoseconds)")
    elif "timestamps" in raw:
        seconds = raw["timestamps"]
        if not isinstance(seconds, list) or not all(type(t) in (int, float) for t in seconds):
            raise DatasetError(f"{where}: \"timestamps\" must be a list of numbers (seconds)")
        times = [round(t * 10**9) for t in seconds]
    if times is not None and len(times) != len(files):
        raise DatasetError(f"{where}: {len(times)} timestamps for {len(files)} files")
    return files, times


def scenes_from_index(index: Path, options: SourceOptions) -> LayoutScenes:
    """One scene per line. Every line uses the same form: all "cameras" (a mapping) or all "path" (one
    camera, named by --cameras or `video`); a mix is refused, because a single video has no camera name
    to file it under among the others."""
    order = options.cameras
    base = folder_of(index)
    name_of_index = str(index)
    scenes = []
    mapped: list[set[str]] = []  # camera names of the records that name their cameras
    name_sets: dict[frozenset[str], frozenset[str]] = {}  # equal sets stored once (a million lines, few sets)
    form: tuple[str, str] | None = None  # ("cameras" | "path", where first seen)
    camera_sets: dict[tuple[str, ...], tuple[str, ...]] = {}
    parents: dict[str, str] = {}
    frame_lists: tuple[FrameList | None, ...] | None = None
    listing: Listing | None = None
    offset = 0  # of the line in the file
    resolved_index = str(index.resolve())  # a UrlPath resolves to itself
    reference: str | None = None  # a line's "sync_reference" (an index of a nuScenes root: CAM_FRONT)
    scan, new_scene, metadata_keys = STRICT_JSON.scan_once, Scene, INDEX_KEYS
    single_name = (order[0] if order else SINGLE_CAMERA,)
    with index.open("rb") as handle:
        peek = _line_peeker(handle)
        lineno = 0
        while True:
            lineno += 1
            line_at = offset
            raw = peek(_HEAD_PEEK)
            if not raw:
                break
            head = _line_head(raw, handle, line_at) if raw.startswith(HEAD_MARK) else None
            if head is not None:  # a split line (index_line_text): its head alone, the per-frame keys skipped
                raw, record = head
                offset = line_at + record["per_frame"]["at"] + record["per_frame"]["bytes"]
            else:
                if raw.startswith(HEAD_MARK):  # not the head it claims to be: read whole
                    handle.seek(line_at)
                    raw = handle.readline()
                elif not raw.endswith(b"\n") and len(raw) == _HEAD_PEEK:
                    raw += handle.readline()
                offset = line_at + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{name_of_index}:{lineno}: not UTF-8 text (byte {exc.start} of the line)") from None
            if head is not None:
                record = _from_head(record)
            else:
                try:  # json.loads without its two Python layers: a line is one value, then only whitespace
                    record, end = scan(line, 0)
                    if not line.endswith("\n", end, end + 1) and line[end:].strip():
                        raise ValueError
                except NonFiniteNumber as exc:
                    raise DatasetError(f"{name_of_index}:{lineno}: {exc.msg}") from None
                except (StopIteration, ValueError):
                    try:
                        record = loads(line)
                    except json.JSONDecodeError as exc:
                        if not line.strip():
                            continue
                        raise DatasetError(f"{name_of_index}:{lineno}: not valid JSON ({exc.msg})") from None
            if type(record) is not dict or "id" not in record:
                raise DatasetError(f"{name_of_index}:{lineno}: each line needs an \"id\" and \"cameras\" "
                                   "(camera -> path) or \"path\"")
            kind = "cameras" if "cameras" in record else "path" if "path" in record else None
            if form is None or form[0] != kind or (kind == "cameras" and "path" in record):
                form = _check_form(record, kind, form, f"{name_of_index}:{lineno}", order)
            probed_line = "probe" in record  # written by `vaecache index` with resolved paths: no lstat
            if kind == "path":
                raw = record["path"]
                if type(raw) is not str or not raw:
                    raise DatasetError(f"{name_of_index}:{lineno}: the path of camera {single_name[0]!r} must be "
                                       "a non-empty string")
                names, mapping = single_name, None
                paths: tuple[str | None, ...] = (resolved_in(base, raw, parents, probed_line),)
            else:
                mapping = record["cameras"]
                where = f"{name_of_index}:{lineno}"
                if not isinstance(mapping, dict) or not mapping:
                    raise DatasetError(f"{where}: \"cameras\" must map camera names to paths")
                camera_names = frozenset(mapping)
                mapped.append(name_sets.setdefault(camera_names, camera_names))  # type: ignore[arg-type]
                lists = None
                for name, raw in mapping.items():
                    if isinstance(raw, dict):
                        lists = {} if lists is None else lists
                        if probed_line:  # checked now, built when a clip of the scene is (IndexLineListing)
                            if head is None:  # a split line's lists are checked when they are read back
                                frame_list_fields(raw, f"{where}: camera {name!r}")
                            lists[name] = None
                        else:
                            lists[name] = frame_list(raw, list_key(resolved_index, record["id"], name), base,
                                                     parents, f"{where}: camera {name!r}")
                    elif not isinstance(raw, str) or not raw:
                        raise DatasetError(f"{where}: the source of camera {name!r} must be a path or "
                                           "{\"files\": [...]}")
                given = record.get("camera_order")  # `vaecache index` keeps a layout's own order (nuScenes')
                if order:
                    names = tuple(order)
                elif isinstance(given, list) and sorted(given) == sorted(mapping):
                    names = tuple(given)
                else:
                    names = tuple(sorted(mapping))
                if reference is None and isinstance(record.get("sync_reference"), str):
                    reference = record["sync_reference"]
                names = camera_sets.setdefault(names, names)  # one tuple per camera set, not one per scene
                if lists is None:
                    paths = tuple((resolved_in(base, mapping[name], parents, probed_line) if name in mapping
                                   else None) for name in names)
                else:
                    frame_lists = tuple(lists.get(name) for name in names)
                    paths = tuple(list_key(resolved_index, record["id"], name) if name in lists else
                                  resolved_in(base, mapping[name], parents, probed_line) if name in mapping else None
                                  for name in names)
            frame_range = _parse_range(record["frames"], f"{name_of_index}:{lineno}") if "frames" in record else None
            time_range = (_parse_seconds_range(record["seconds"], f"{name_of_index}:{lineno}") if "seconds" in record
                          else None)
            probed = None
            if probed_line:
                if mapping is None:
                    probed = (CameraProbe.from_json(record["probe"], f"{name_of_index}:{lineno}", paths[0]),)
                else:
                    probed = _parse_probe(record["probe"], names, mapping, f"{name_of_index}:{lineno}")
            metadata = None if metadata_keys.issuperset(record) else metadata_text(record)
            rate = _frame_rate(record, options, f"{name_of_index}:{lineno}")
            if "frame_metadata" in record and head is None:
                check_frame_metadata(record["frame_metadata"], names, f"{name_of_index}:{lineno}")
            if probed_line and (frame_lists is not None or "frame_metadata" in record):
                # written by `vaecache index`: read back only when a clip of this scene is built
                listing = IndexLineListing(resolved_index, line_at, str(record["id"]), names,
                                           frame_lists is not None)
            elif frame_lists is not None or "frame_metadata" in record:
                listing = HeldListing(frame_lists, _frame_metadata(record["frame_metadata"], names,
                                                                   f"{name_of_index}:{lineno}")
                                      if "frame_metadata" in record else None)
            if "lerobot_rows" in record:  # a LeRobot episode's data rows (sources.lerobot.EpisodeRows)
                listing = EpisodeRows.from_json(record["lerobot_rows"], len(names), options.lerobot_state,
                                                f"{name_of_index}:{lineno}")
            scenes.append(new_scene(str(record["id"]), names, paths, frame_range, probed, metadata, listing, rate,
                                    time_range))
            frame_lists = listing = None
    if not scenes:
        raise DatasetError(f"{index}: index holds no scenes")
    if order and mapped:
        check_cameras_exist(index, order, mapped)
    if not order:
        camera_sets = {scene.cameras for scene in scenes}
        if len(camera_sets) > 1:
            raise DatasetError(f"{index}: scenes list different camera sets {sorted(map(list, camera_sets))[:2]}; "
                               "pass --cameras to choose")
    # An index is written by hand or by a script: a bad id there is refused naming its line (Scene checks it).
    return LayoutScenes(scenes, mapped, [], reference)


def list_key(index: str, scene_id: Any, camera: str) -> str:
    """The path a camera given file by file goes by (its FrameList's key): `INDEX#scene/camera`."""
    return f"{index}#{scene_id}/{camera}"


@dataclass(frozen=True, slots=True)
class IndexLineListing:
    """A Listing kept in its index line (one that `vaecache index` wrote, probe included): the line is read again
    when a clip of the scene is built (a worker decoding it, the writer recording its frames), the last few lines
    cached per process. Planning a hundred thousand such scenes holds no per-frame object."""

    index: str
    offset: int
    """Where the line starts in the index file."""
    scene_id: str
    names: tuple[str, ...]
    """The scene's cameras, in its order."""
    lists_frames: bool

    @property
    def cameras(self) -> int:
        return len(self.names)

    @property
    def frame_lists(self) -> tuple[FrameList | None, ...] | None:
        return _read_listing(self).frame_lists

    @property
    def frame_metadata(self) -> FrameMetadata | None:
        return _read_listing(self).frame_metadata


@functools.lru_cache(maxsize=8)
def _read_listing(ref: IndexLineListing) -> HeldListing:
    """The frame lists and per-frame metadata of the index line `ref` points at (a line is one scene's clips'
    worth of work: the cache keeps a scene's clips from reading it again)."""
    where = f"{ref.index}: line at byte {ref.offset}"
    try:
        with (open_url(ref.index) if is_url(ref.index) else open(ref.index, "rb")) as handle:
            handle.seek(ref.offset)
            record = loads(handle.readline().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, NonFiniteNumber) as exc:
        raise DatasetError(f"{where}: cannot read scene {ref.scene_id!r} back ({exc}); the index changed since it "
                           "was read") from None
    if type(record) is not dict or str(record.get("id")) != ref.scene_id or not isinstance(record.get("cameras"),
                                                                                          dict):
        raise DatasetError(f"{where}: is no longer scene {ref.scene_id!r}; the index changed since it was read")
    mapping, base = record["cameras"], os.path.dirname(ref.index)
    lists = None
    if ref.lists_frames:
        lists = tuple(frame_list(mapping[name], list_key(ref.index, ref.scene_id, name), base, {},
                                 f"{where}: camera {name!r}") if isinstance(mapping.get(name), dict) else None
                      for name in ref.names)
    per_frame = (_frame_metadata(record["frame_metadata"], ref.names, where) if "frame_metadata" in record
                 else None)
    return HeldListing(lists, per_frame)


INDEX_KEYS = frozenset({"id", "path", "cameras", "frames", "seconds", "probe", "fps", "frame_metadata",
                        "camera_order", "sync_reference", "lerobot_rows", "per_frame"})
"""The keys of an index line vaecache reads; every other key is metadata, passed through to the clip records."""


PER_FRAME_KEYS = ("cameras", "frame_metadata")
"""The keys of a line that `vaecache index` writes last, after the head planning reads (see index_line_text)."""
HEAD_MARK = b'{"per_frame":{"at":'
_HEAD_FIELDS = re.compile(rb'\{"per_frame":\{"at":(\d{1,15}),"bytes":(\d{1,15})[,}]')
_HEAD_PEEK = 4096
"""Bytes of a line read first: an ordinary line is whole in them, a split line's marker always is."""


def _line_peeker(handle: Any) -> Any:
    """readline(limit) of `handle`: a local file's own; an fsspec file (an index at a URL) takes no limit, so its
    next `limit` bytes are read up to the first newline and the position set just after it (its read-ahead buffer
    keeps the bytes past it)."""
    if not hasattr(handle, "fs"):
        return handle.readline

    def peek(limit: int) -> bytes:
        start = handle.tell()
        chunk = handle.read(limit)
        cut = chunk.find(b"\n")
        if cut >= 0:
            chunk = chunk[:cut + 1]
            handle.seek(start + len(chunk))
        return chunk

    return peek


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def index_line_text(record: dict[str, Any]) -> str:
    """An index line as `vaecache index` writes it, newline included. A line that lists frames file by file or
    carries per-frame metadata (a nuScenes scene: ~0.5 MB) is split in two: a head (every key but PER_FRAME_KEYS,
    led by `"per_frame": {"at": HEAD_BYTES, "bytes": TAIL_BYTES, "cameras": {camera: path | null}, ...}`), then
    the per-frame keys. A planner reads only the head and seeks past the rest; the line is still one JSON object,
    read whole when a clip of the scene is built (and by any JSON reader)."""
    cameras = record.get("cameras")
    listed = isinstance(cameras, dict) and any(isinstance(value, dict) for value in cameras.values())
    if not listed and "frame_metadata" not in record:
        return _dumps(record) + "\n"
    body = _dumps({key: value for key, value in record.items() if key not in PER_FRAME_KEYS and key != "per_frame"})
    tail = "," + _dumps({key: record[key] for key in PER_FRAME_KEYS if key in record})[1:] + "\n"
    marker: dict[str, Any] = {"at": 0, "bytes": len(tail.encode("utf-8"))}
    if isinstance(cameras, dict):
        marker["cameras"] = {name: None if isinstance(value, dict) else value for name, value in cameras.items()}
    if "frame_metadata" in record:
        marker["frame_metadata"] = True
    while True:  # the head's length includes the digits of its own length: a fixed point, reached in a step or two
        head = '{"per_frame":' + _dumps(marker) + ("," + body[1:-1] if body != "{}" else "")
        size = len(head.encode("utf-8"))
        if size == marker["at"]:
            return head + tail
        marker["at"] = size


def _line_head(raw: bytes, handle: Any, line_at: int) -> tuple[bytes, dict[str, Any]] | None:
    """A split line's head (index_line_text) as (its bytes, its keys), the handle left at the next line; None
    (the handle wherever) when `raw`, a line's first bytes, is not such a head or the line does not end where the
    head says: the caller then reads the line whole."""
    fields = _HEAD_FIELDS.match(raw)
    if fields is None:
        return None
    at, size = int(fields[1]), int(fields[2])
    if size < 2 or at < len(HEAD_MARK):
        return None
    if len(raw) < at:
        raw += handle.read(at - len(raw))
    handle.seek(line_at + at + size - 1)
    if handle.read(1) != b"\n" or len(raw) < at or raw[at:at + 1] not in (b"", b","):
        return None
    try:
        record = loads(raw[:at] + b"}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    marker = record.get("per_frame") if type(record) is dict else None
    if (type(marker) is not dict or marker.get("at") != at or marker.get("bytes") != size or "probe" not in record
            or not isinstance(marker.get("cameras", {}), dict)):
        return None
    return raw[:at], record


def _from_head(record: dict[str, Any]) -> dict[str, Any]:
    """A split line's head as the line's keys planning reads: each camera listed file by file an empty frame list
    (read back with the line when a clip is built), the per-frame metadata a placeholder."""
    marker = record.pop("per_frame")
    if "cameras" in marker:
        record["cameras"] = {name: {} if path is None else path for name, path in marker["cameras"].items()}
    if marker.get("frame_metadata"):
        record["frame_metadata"] = None
    return record


def metadata_text(record: dict[str, Any]) -> str | None:
    """An index line's metadata (its keys other than INDEX_KEYS) as canonical JSON text, or None."""
    extra = {key: value for key, value in record.items() if key not in INDEX_KEYS}
    return json.dumps(extra, sort_keys=True, ensure_ascii=False, separators=(",", ":")) if extra else None


def _parse_probe(raw: Any, names: tuple[str, ...], mapping: dict[str, Any],
                 where: str) -> tuple[CameraProbe, ...] | None:
    """A "cameras" line's "probe": camera -> fields (a "path" line's "probe" is the fields themselves).

    A camera the scene lacks has no probe (the scene is then skipped as missing that camera): None."""
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: \"probe\" must map camera names to probe fields")
    extra = sorted(set(raw) - set(mapping))
    if extra:
        raise DatasetError(f"{where}: \"probe\" names camera(s) {', '.join(map(repr, extra))} that \"cameras\" lacks")
    probes = []
    for name in names:
        if name not in mapping:
            return None
        if name not in raw:
            raise DatasetError(f"{where}: \"probe\" lacks camera {name!r}")
        probes.append(CameraProbe.from_json(raw[name], f"{where}: camera {name!r}", mapping.get(name)))
    return tuple(probes)


def _frame_rate(record: dict[str, Any], options: SourceOptions, where: str) -> float | None:
    """A line's "fps" (of its image sequences without frame times), else --fps."""
    if "fps" not in record:
        return options.frame_rate
    value = record["fps"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise DatasetError(f"{where}: \"fps\" must be a positive number, got {value!r:.40}")
    return float(value)


def _frame_metadata(raw: Any, names: tuple[str, ...], where: str) -> FrameMetadata:
    """"frame_metadata": {camera: [one JSON value per frame]}, kept as text per camera."""
    check_frame_metadata(raw, names, where)
    return FrameMetadata(tuple(json.dumps(raw[name], separators=(",", ":"), ensure_ascii=False) for name in names))


def check_frame_metadata(raw: Any, names: tuple[str, ...], where: str) -> None:
    if not isinstance(raw, dict) or any(not isinstance(raw.get(name), list) for name in names):
        raise DatasetError(f"{where}: \"frame_metadata\" must map every camera to a list (one entry per frame)")


def _parse_seconds_range(value: Any, where: str) -> tuple[int, int]:
    """"seconds": [start, end) from the first frame -> ns."""
    if (isinstance(value, list) and len(value) == 2 and all(type(v) in (int, float) for v in value)
            and 0 <= value[0] < value[1] < float("inf")):
        return round(value[0] * 1e9), round(value[1] * 1e9)
    raise DatasetError(f"{where}: \"seconds\" must be [start, end) in seconds with 0 <= start < end, got {value!r}")


def _parse_range(value: Any, where: str) -> tuple[int, int]:
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
            and 0 <= value[0] < value[1]):
        return value[0], value[1]
    raise DatasetError(f"{where}: \"frames\" must be [start, stop) with 0 <= start < stop, got {value!r}")


class JsonlIndex:
    """A .jsonl (or .json) file of scene lines."""

    name = "jsonl"

    def matches(self, data: Path) -> bool:
        return data.is_file() and data.suffix.lower() in (".jsonl", ".json")

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        return scenes_from_index(data, options)

    reference_camera = None
    """The lines' own "sync_reference" (LayoutScenes.reference_camera) when they give one."""


JSONL_INDEX = JsonlIndex()
