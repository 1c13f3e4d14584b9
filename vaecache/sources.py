"""Scene discovery (multi-camera folder, single-camera folder, JSONL index) and probing of the videos."""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from vaecache.errors import DatasetError, VideoDecodeError
from vaecache.cache.io import STRICT_JSON, NonFiniteNumber, iter_lines, loads
from vaecache.cache.layout import id_problem

log = logging.getLogger("vaecache")

VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v")


PROBE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "frames": int, "fps": (int, float), "width": int, "height": int, "codec": str, "size": int, "mtime_ns": int,
    "rotation": int}
"""What `vaecache index` records per camera, and the JSON type of each (see CameraProbe)."""

SINGLE_CAMERA = "video"
"""The camera name of a scene that is one video (a folder of videos, a "path" index line) unless --cameras names it."""


@dataclass(frozen=True, slots=True)
class CameraProbe:
    """What opening one video told us (or what an index says it would): the planner needs nothing else."""

    frames: int
    """Frames of a straight decode from the start (vaecache.decode.VideoReader's count)."""
    fps: float
    width: int
    """Stored frame width in pixels, before the display rotation is applied."""
    height: int
    codec: str
    size: int
    """File size in bytes when probed; with mtime_ns it tells whether the file changed since."""
    mtime_ns: int
    rotation: int = 0
    """Counter-clockwise display rotation in degrees (a multiple of 90) that decoding applies."""

    def __post_init__(self) -> None:
        if (self.frames < 1 or not 0 < self.fps < math.inf or self.width < 1 or self.height < 1 or self.size < 1
                or self.rotation % 90):
            raise DatasetError(f"probe {self}: frames, fps, width, height and size must be positive (fps finite) and "
                               "rotation a multiple of 90")

    def to_json(self) -> dict[str, Any]:
        return {"frames": self.frames, "fps": self.fps, "width": self.width, "height": self.height, "codec": self.codec,
                "size": self.size, "mtime_ns": self.mtime_ns, "rotation": self.rotation}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> CameraProbe:
        """Validate one index/cache record; a wrong or missing field is a DatasetError naming `where`."""
        if not isinstance(raw, dict):
            raise DatasetError(f"{where}: a probe must be an object with {', '.join(PROBE_FIELDS)}, got {raw!r:.80}")
        try:  # the common case, checked fast: every field present with its type, nothing else
            frames, fps, width, height, codec, size, mtime_ns = (raw["frames"], raw["fps"], raw["width"],
                                                                 raw["height"], raw["codec"], raw["size"],
                                                                 raw["mtime_ns"])
            rotation = raw.get("rotation", 0)
            if (type(frames) is type(width) is type(height) is type(size) is type(mtime_ns) is type(rotation) is int
                    and type(fps) in (float, int) and type(codec) is str and len(raw) <= len(PROBE_FIELDS)
                    and frames > 0 and 0 < fps < math.inf and width > 0 and height > 0 and size > 0
                    and not rotation % 90):
                return _new_camera_probe(frames, float(fps), width, height, sys.intern(codec), size, mtime_ns, rotation)
        except KeyError:
            pass
        for name, kind in PROBE_FIELDS.items():
            value = raw.get(name, 0 if name == "rotation" else None)
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
                       raw["mtime_ns"], raw.get("rotation", 0))
        except DatasetError:
            raise DatasetError(f"{where}: probe values out of range (frames, fps, width, height and size must be "
                               f"positive, fps finite, rotation a multiple of 90): {raw!r:.200}") from None

    def matches(self, stat: os.stat_result) -> bool:
        """Whether a file with this stat is still the file that was probed."""
        return stat.st_size == self.size and stat.st_mtime_ns == self.mtime_ns


_PROBE_SLOT_SETTERS = tuple(CameraProbe.__dict__[name].__set__ for name in PROBE_FIELDS)


def _new_camera_probe(*values: Any) -> CameraProbe:
    """CameraProbe(*values) for values from_json has just checked: set through the slots, skipping the frozen
    dataclass's per-field __setattr__ and the repeated check (a million index lines each build one)."""
    probe = object.__new__(CameraProbe)
    for set_slot, value in zip(_PROBE_SLOT_SETTERS, values):
        set_slot(probe, value)
    return probe


@dataclass(frozen=True, slots=True)
class Scene:
    """One recording: the same moment seen by every camera. Paths are absolute, in camera order; a camera
    the scene lacks has no path (None), and the probe records the scene as skipped."""

    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str | None, ...]
    frame_range: tuple[int, int] | None = None
    """[start, stop) of source frames to use; None means the whole video."""
    probed: tuple[CameraProbe, ...] | None = None
    """Per camera, what an index written by `vaecache index` says: the scene is then planned without opening
    a video (decoding checks the frame count and size of what it opens)."""
    metadata: str | None = None
    """The index line's other keys (caption, tags, any JSON) as canonical JSON text, passed through untouched
    into every clip record's `metadata`; None when the line has none. Text keeps a Scene hashable and small."""

    def __post_init__(self) -> None:
        if id_problem(self.scene_id):
            raise DatasetError(f"scene id {self.scene_id!r} is not usable (empty, starts with '.', or has '/' or control characters)")
        if len(self.cameras) != len(self.paths) or not self.cameras:
            raise DatasetError(f"scene {self.scene_id}: needs one path per camera")
        if self.probed is not None and len(self.probed) != len(self.cameras):
            raise DatasetError(f"scene {self.scene_id}: needs one probe per camera")


@dataclass(frozen=True, slots=True)
class SceneProbe:
    """What opening a scene's videos told us: usable frames, fps and rotation, or why it is unusable."""

    scene_id: str
    num_frames: int = 0
    fps: float = 0.0
    error: str | None = None
    error_path: str | None = None
    error_camera: str | None = None
    """The camera the error is about (a missing camera has a camera but no path)."""
    rotations: tuple[int, ...] = ()
    """Per camera, the counter-clockwise display rotation (degrees) that decoding applies."""
    cameras: tuple[CameraProbe, ...] = ()
    """Per camera, what was probed (empty for an unusable scene): decoding checks frames and size against it."""


@dataclass(frozen=True)
class Skipped:
    """A scene (or one of its files) that produced no clip, and why."""

    scene_id: str
    path: str | None
    reason: str
    camera: str | None = None


@dataclass(frozen=True)
class Discovery:
    """The scenes found, and the cameras some scenes have that the chosen camera set leaves out."""

    scenes: list[Scene]
    left_out_cameras: dict[str, int] = field(default_factory=dict)
    """Camera name -> number of scenes that have it although it is not encoded."""
    rejected: list[Skipped] = field(default_factory=list)
    """Scenes whose name cannot be a scene id (control characters, '/', a leading '..'): recorded as
    failures, the rest of the dataset goes on."""
    form: str = "cameras"
    """"path" for a single-camera folder or an index of "path" lines, else "cameras" (how `vaecache index`
    writes the scenes back)."""


# --------------------------------------------------------------------------- discovery


def discover(data: Path, cameras: Sequence[str] | None = None) -> Discovery:
    """Find scenes in a multi-camera folder, a single-camera folder, or a JSONL index. Sorted by id."""
    data = Path(data)
    if not data.exists():
        raise DatasetError(f"{data}: dataset path does not exist")
    if data.is_file():
        if data.suffix.lower() not in (".jsonl", ".json"):
            raise DatasetError(f"{data}: expected a folder or a .jsonl index, got a {data.suffix or 'suffix-less'} file")
        scenes, seen, rejected = _scenes_from_index(data, cameras)
        form = "cameras" if seen else "path"  # only "cameras" lines name their camera sets
    else:
        scenes, seen, rejected = _scenes_from_folder(data, cameras)
        form = "cameras" if seen else "path"  # a single-camera folder has no camera sets
    for skip in rejected:
        log.warning("skipped %s: %s", skip.path or skip.scene_id, skip.reason)
    seen_ids: set[str] = set()
    duplicates = sorted({scene.scene_id for scene in scenes
                         if scene.scene_id in seen_ids or seen_ids.add(scene.scene_id)})  # type: ignore[func-returns-value]
    if duplicates:
        raise DatasetError(f"{data}: scene id(s) appear twice: {', '.join(duplicates[:5])}")
    chosen = set(scenes[0].cameras) if scenes else set()
    left_out: dict[str, int] = {}
    for names in seen:
        for name in sorted(names - chosen):
            left_out[name] = left_out.get(name, 0) + 1
    for name, count in sorted(left_out.items()):
        log.warning("camera %s (in %d scene%s) is not in the chosen camera set (%s) and is not encoded",
                    name, count, "" if count == 1 else "s", ", ".join(scenes[0].cameras))
    return Discovery(sorted(scenes, key=lambda scene: scene.scene_id), left_out, rejected, form)


def discover_scenes(data: Path, cameras: Sequence[str] | None = None) -> list[Scene]:
    """The scenes of `discover` (cameras left out are logged there)."""
    return discover(data, cameras).scenes


def unusable_id(name: str) -> str | None:
    """Why `name` cannot be a scene id (the cache's rule, format.layout.id_problem); None when it can."""
    return id_problem(name)


def _resolved(path: Path) -> str:
    """The absolute path with symlinks resolved; as given (absolute) when they cannot be (a loop): the probe
    then records why the file cannot be read."""
    try:
        return str(path.resolve())
    except (OSError, RuntimeError):
        return str(path.absolute())


def _resolved_in(base: str, relative: str, parents: dict[str, str], trusted: bool = False) -> str:
    """`_resolved(base / relative)`, with `parents` caching resolved folders: a file that is not itself a
    symlink costs one lstat, so an index of a million scenes in a few folders is not resolved component by
    component a million times. `trusted`: the file name is taken as resolved (no lstat)."""
    head, _, name = relative.rpartition("/")
    folder = head if relative.startswith("/") else f"{base}/{head}" if head else base
    if not name or name in (".", ".."):
        return _resolved(Path(base, relative))
    parent = parents.get(folder)
    if parent is None:
        parent = parents[folder] = _resolved(Path(folder or "/"))
    path = f"{parent}/{name}" if parent != "/" else f"/{name}"
    if trusted:
        return path
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return path
    except OSError:
        return path  # missing (or unreadable): the probe says so, naming this path
    return _resolved(Path(path))


def _has_video_name(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS and not path.name.startswith(".")


def _is_video(path: Path) -> bool:
    return path.is_file() and _has_video_name(path)


def _scenes_from_folder(root: Path, order: Sequence[str] | None) -> tuple[list[Scene], list[set[str]], list[Skipped]]:
    # Hidden entries (".name") are not scenes; "..name" is not hidden by convention, so it is reported.
    entries = sorted(p for p in root.iterdir() if not p.name.startswith(".") or p.name.startswith(".."))
    rejected: list[Skipped] = []
    for entry in list(entries):
        name = entry.stem if _is_video(entry) else entry.name
        why = unusable_id(name) if (entry.is_dir() or _is_video(entry)) else None
        if why is not None:
            rejected.append(Skipped(name, str(entry.absolute()), f"{why} cannot be a scene id; rename it"))
            entries.remove(entry)
    videos = [p for p in entries if _is_video(p)]
    folders = [p for p in entries if p.is_dir()]
    if videos and folders:
        raise DatasetError(f"{root}: mixes video files and scene folders; use one layout (DATA/<scene>/<camera>.mp4 or DATA/<video>.mp4)")
    if videos:
        if order and len(order) != 1:
            raise DatasetError(f"{root}: single-camera folder, but {len(order)} cameras were configured")
        camera = order[0] if order else SINGLE_CAMERA
        return [Scene(p.stem, (camera,), (_resolved(p),)) for p in videos], [], rejected
    if not folders and rejected:
        return [], [], rejected
    if not folders:
        raise DatasetError(f"{root}: no videos ({', '.join(VIDEO_EXTENSIONS)}) and no scene folders found")
    # Inside a scene folder anything named like a video is that camera's file: a directory or a socket
    # called cam_0.mp4 is then reported by the probe as "not a regular file" instead of as a missing camera.
    found = {folder: {p.stem: p for p in sorted(folder.iterdir()) if _has_video_name(p)} for folder in folders}
    if not any(found.values()):
        raise DatasetError(f"{root}: scene folders hold no video files ({', '.join(VIDEO_EXTENSIONS)})")
    if order:
        _check_cameras_exist(root, order, [set(videos) for videos in found.values()])
    names = tuple(order) if order else _common_camera_set(found.values())
    scenes = []
    for folder, videos_by_camera in found.items():
        # A scene missing a camera stays in the list with no path for it, so the probe records it as a
        # skipped input instead of failing the whole dataset.
        paths = tuple(_resolved(videos_by_camera[name]) if name in videos_by_camera else None for name in names)
        scenes.append(Scene(folder.name, names, paths))
    return scenes, [set(videos) for videos in found.values()], rejected


def _check_cameras_exist(where: Path, order: Sequence[str], per_scene: Sequence[set[str]]) -> None:
    """A --cameras name that no scene has is a typo, not a dataset where every scene lacks a camera."""
    seen = set().union(*per_scene)
    unknown = [name for name in order if name not in seen]
    if unknown:
        raise DatasetError(f"{where}: camera(s) {', '.join(unknown)} from --cameras are in no scene "
                           f"(cameras found: {', '.join(sorted(seen)[:10])})")


def _common_camera_set(per_scene: Iterable[dict[str, Path]]) -> tuple[str, ...]:
    """The camera set most scenes have (ties: more cameras first), in name order."""
    counts: dict[tuple[str, ...], int] = {}
    for cameras in per_scene:
        if cameras:
            key = tuple(sorted(cameras))
            counts[key] = counts.get(key, 0) + 1
    return max(sorted(counts), key=lambda key: (counts[key], len(key)))


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


def _scenes_from_index(index: Path, order: Sequence[str] | None) -> tuple[list[Scene], list[set[str]], list[Skipped]]:
    """One scene per line. Every line uses the same form: all "cameras" (a mapping) or all "path" (one
    camera, named by --cameras or `video`); a mix is refused, because a single video has no camera name
    to file it under among the others."""
    base = str(index.resolve().parent)
    name_of_index = str(index)
    scenes = []
    mapped: list[set[str]] = []  # camera names of the records that name their cameras
    name_sets: dict[frozenset[str], frozenset[str]] = {}  # equal sets stored once (a million lines, few sets)
    form: tuple[str, str] | None = None  # ("cameras" | "path", where first seen)
    camera_sets: dict[tuple[str, ...], tuple[str, ...]] = {}
    parents: dict[str, str] = {}
    scan, new_scene, metadata_keys = STRICT_JSON.scan_once, Scene, INDEX_KEYS
    single_name = (order[0] if order else SINGLE_CAMERA,)
    with open(index, "rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{name_of_index}:{lineno}: not UTF-8 text (byte {exc.start} of the line)") from None
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
                paths: tuple[str | None, ...] = (_resolved_in(base, raw, parents, probed_line),)
            else:
                mapping = record["cameras"]
                where = f"{name_of_index}:{lineno}"
                if not isinstance(mapping, dict) or not mapping:
                    raise DatasetError(f"{where}: \"cameras\" must map camera names to paths")
                camera_names = frozenset(mapping)
                mapped.append(name_sets.setdefault(camera_names, camera_names))  # type: ignore[arg-type]
                for name, raw in mapping.items():
                    if not isinstance(raw, str) or not raw:
                        raise DatasetError(f"{where}: the path of camera {name!r} must be a non-empty string")
                names = tuple(order) if order else tuple(sorted(mapping))
                names = camera_sets.setdefault(names, names)  # one tuple per camera set, not one per scene
                paths = tuple((_resolved_in(base, mapping[name], parents, probed_line) if name in mapping else None)
                              for name in names)
            frame_range = _parse_range(record["frames"], f"{name_of_index}:{lineno}") if "frames" in record else None
            probed = None
            if probed_line:
                if mapping is None:
                    probed = (CameraProbe.from_json(record["probe"], f"{name_of_index}:{lineno}"),)
                else:
                    probed = _parse_probe(record["probe"], names, mapping, f"{name_of_index}:{lineno}")
            metadata = None if metadata_keys.issuperset(record) else metadata_text(record)
            scenes.append(new_scene(str(record["id"]), names, paths, frame_range, probed, metadata))
    if not scenes:
        raise DatasetError(f"{index}: index holds no scenes")
    if order and mapped:
        _check_cameras_exist(index, order, mapped)
    if not order:
        camera_sets = {scene.cameras for scene in scenes}
        if len(camera_sets) > 1:
            raise DatasetError(f"{index}: scenes list different camera sets {sorted(map(list, camera_sets))[:2]}; pass --cameras to choose")
    # An index is written by hand or by a script: a bad id there is refused naming its line (Scene checks it).
    return scenes, mapped, []


INDEX_KEYS = frozenset({"id", "path", "cameras", "frames", "probe"})
"""The keys of an index line vaecache reads; every other key is metadata, passed through to the clip records."""


def metadata_text(record: dict[str, Any]) -> str | None:
    """An index line's metadata (its keys other than INDEX_KEYS) as canonical JSON text, or None."""
    extra = {key: value for key, value in record.items() if key not in INDEX_KEYS}
    return json.dumps(extra, sort_keys=True, ensure_ascii=False, separators=(",", ":")) if extra else None


def _parse_probe(raw: Any, names: tuple[str, ...], mapping: dict[str, Any], where: str) -> tuple[CameraProbe, ...] | None:
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
        probes.append(CameraProbe.from_json(raw[name], f"{where}: camera {name!r}"))
    return tuple(probes)


def _parse_range(value: Any, where: str) -> tuple[int, int]:
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
            and 0 <= value[0] < value[1]):
        return value[0], value[1]
    raise DatasetError(f"{where}: \"frames\" must be [start, stop) with 0 <= start < stop, got {value!r}")


# --------------------------------------------------------------------------- probing


def probe_file(path: str) -> CameraProbe:
    """Open one video and read what planning needs. Raises VideoDecodeError (naming the file) when it cannot.

    The frame count is that of a straight decode from the start (see vaecache.decode.VideoReader); size and
    mtime are read before the file is opened, so a file changed while it is probed looks changed later."""
    from vaecache.decode import open_video

    try:
        stat = os.stat(path)
    except OSError:
        stat = None  # open_video names the problem (missing, a loop, permission)
    with open_video(path) as reader:
        if stat is None:
            stat = os.stat(path)
        width, height = reader.frame_size
        fps = reader.fps()
        if width < 1 or height < 1 or not fps > 0 or stat.st_size < 1:
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


# --------------------------------------------------------------------------- probe cache

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
        if result.reason.startswith(ENVIRONMENT_REASONS):
            continue  # a chmod or a remount fixes these without touching size or mtime: look again next time
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
            lines = [line for _, line in iter_lines(file)]  # bytes: a tail torn inside a UTF-8 character is cut
        except OSError:
            continue
        for line in lines:
            try:
                record = loads(line)
                if "probe" in record:
                    cache[record["path"]] = CameraProbe.from_json(record["probe"], str(file))
                else:
                    cache[record["path"]] = (int(record["size"]), int(record["mtime_ns"]), str(record["error"]))
            except (ValueError, KeyError, TypeError, DatasetError):
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
