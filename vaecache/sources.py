"""Scene discovery (multi-camera folder, single-camera folder, JSONL index) and probing of the videos."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from vaecache.errors import DatasetError, VideoDecodeError

log = logging.getLogger("vaecache")

VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v")
_BAD_ID = re.compile(r"[/\\\x00-\x1f]")


@dataclass(frozen=True)
class Scene:
    """One recording: the same moment seen by every camera. Paths are absolute, in camera order; a camera
    the scene lacks has no path (None), and the probe records the scene as skipped."""

    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str | None, ...]
    frame_range: tuple[int, int] | None = None
    """[start, stop) of source frames to use; None means the whole video."""

    def __post_init__(self) -> None:
        if not self.scene_id or _BAD_ID.search(self.scene_id) or self.scene_id.startswith("."):
            raise DatasetError(f"scene id {self.scene_id!r} is not usable (empty, starts with '.', or has '/' or control characters)")
        if len(self.cameras) != len(self.paths) or not self.cameras:
            raise DatasetError(f"scene {self.scene_id}: needs one path per camera")


@dataclass(frozen=True)
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
    else:
        scenes, seen, rejected = _scenes_from_folder(data, cameras)
    for skip in rejected:
        log.warning("skipped %s: %s", skip.path or skip.scene_id, skip.reason)
    ids = [scene.scene_id for scene in scenes]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
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
    return Discovery(sorted(scenes, key=lambda scene: scene.scene_id), left_out, rejected)


def discover_scenes(data: Path, cameras: Sequence[str] | None = None) -> list[Scene]:
    """The scenes of `discover` (cameras left out are logged there)."""
    return discover(data, cameras).scenes


def unusable_id(name: str) -> str | None:
    """Why `name` cannot be a scene id (ids name files and tensors: no '/', no control characters, no leading '.')."""
    if not name:
        return "an empty name"
    if _BAD_ID.search(name):
        return "a name with '/', '\\' or control characters"
    if name.startswith("."):
        return "a name starting with '.'"
    return None


def _resolved(path: Path) -> str:
    """The absolute path with symlinks resolved; as given (absolute) when they cannot be (a loop): the probe
    then records why the file cannot be read."""
    try:
        return str(path.resolve())
    except (OSError, RuntimeError):
        return str(path.absolute())


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
        camera = order[0] if order else "video"
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


def _scenes_from_index(index: Path, order: Sequence[str] | None) -> tuple[list[Scene], list[set[str]], list[Skipped]]:
    """One scene per line. Every line uses the same form: all "cameras" (a mapping) or all "path" (one
    camera, named by --cameras or `video`); a mix is refused, because a single video has no camera name
    to file it under among the others."""
    base = index.resolve().parent
    scenes = []
    mapped: list[set[str]] = []  # camera names of the records that name their cameras
    form: tuple[str, str] | None = None  # ("cameras" | "path", where first seen)
    with open(index, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{index}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or "id" not in record:
                raise DatasetError(f"{where}: each line needs an \"id\" and \"cameras\" (camera -> path) or \"path\"")
            if "cameras" in record and "path" in record:
                raise DatasetError(f"{where}: has both \"cameras\" and \"path\"; give one")
            kind = "cameras" if "cameras" in record else "path" if "path" in record else None
            if kind is None:
                raise DatasetError(f"{where}: needs \"cameras\" (camera -> path) or \"path\"")
            if form is None:
                form = (kind, where)
            elif form[0] != kind:
                raise DatasetError(f"{where}: uses \"{kind}\" but {form[1]} uses \"{form[0]}\"; an index lists "
                                   f"every scene one way (all \"cameras\" or all \"path\")")
            if kind == "cameras":
                mapping = record["cameras"]
                if not isinstance(mapping, dict) or not mapping:
                    raise DatasetError(f"{where}: \"cameras\" must map camera names to paths")
                mapped.append(set(mapping))
            else:
                if order and len(order) != 1:
                    raise DatasetError(f"{where}: a \"path\" scene has one camera, but {len(order)} cameras were "
                                       f"configured (--cameras)")
                mapping = {(order[0] if order else "video"): record["path"]}
            bad = sorted(str(name) for name, raw in mapping.items() if not isinstance(raw, str) or not raw)
            if bad:
                raise DatasetError(f"{where}: the path of camera {bad[0]!r} must be a non-empty string")
            names = tuple(order) if order else tuple(sorted(mapping))
            paths = tuple(_resolved(base / mapping[name]) if name in mapping else None for name in names)
            frame_range = None
            if "frames" in record:
                frame_range = _parse_range(record["frames"], where)
            scenes.append(Scene(str(record["id"]), names, paths, frame_range))
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


def _parse_range(value: Any, where: str) -> tuple[int, int]:
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
            and 0 <= value[0] < value[1]):
        return value[0], value[1]
    raise DatasetError(f"{where}: \"frames\" must be [start, stop) with 0 <= start < stop, got {value!r}")


# --------------------------------------------------------------------------- probing


def probe_scene(scene: Scene) -> SceneProbe:
    """Open every camera's video; all must be readable and hold the same number of frames at the same fps.

    The frame count is that of a straight decode from the start (see vaecache.decode.VideoReader)."""
    from vaecache.decode import open_video

    counts, fps_values, rotations = [], [], []
    for camera, path in zip(scene.cameras, scene.paths):
        if path is None:
            return SceneProbe(scene.scene_id, error=f"camera {camera!r} is missing", error_camera=camera)
        try:
            with open_video(path) as reader:
                counts.append(len(reader))
                fps_values.append(reader.fps())
                rotations.append(reader.rotation)
        except VideoDecodeError as exc:
            return SceneProbe(scene.scene_id, error=exc.reason, error_path=path, error_camera=camera)
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
    return SceneProbe(scene.scene_id, num_frames=total, fps=fps_values[0], rotations=tuple(rotations))
