"""The folder layouts: DATA/<scene>/<camera>.mp4 or DATA/<scene>/<camera>/<frames>.jpg (a scene per folder, a
camera per video or per folder of frames), a folder of videos, or a folder of frame folders (a single-camera scene
per video or frame folder, camera `video`)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from vaecache.cache.layout import id_problem
from vaecache.errors import CaptionError, DatasetError
from vaecache.sources.scene import SINGLE_CAMERA, LayoutScenes, Scene, Skipped, SourceOptions
from vaecache.video.frames import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS


def resolved_path(path: Path) -> str:
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


def holds_frames(folder: Path) -> bool:
    """Whether a folder holds image frames (it is an image-sequence camera); stops at the first one."""
    if not isinstance(folder, Path):  # a prefix in object storage (vaecache.sources.urlpath)
        return any(child.name.lower().endswith(IMAGE_EXTENSIONS) and not child.name.startswith(".")
                   for child in folder.iterdir())
    try:
        with os.scandir(folder) as entries:
            return any(entry.name.lower().endswith(IMAGE_EXTENSIONS) and not entry.name.startswith(".")
                       for entry in entries)
    except OSError:
        return False


def _cameras_in(folder: Path) -> dict[str, Path]:
    """A scene folder's cameras: each video (by stem) and each subfolder of frames (by name)."""
    found: dict[str, Path] = {}
    for entry in sorted(folder.iterdir()):
        if _has_video_name(entry):
            found[entry.stem] = entry
        elif entry.is_dir() and not entry.name.startswith(".") and holds_frames(entry):
            found[entry.name] = entry
    return found


def scenes_from_folder(root: Path, options: SourceOptions) -> LayoutScenes:
    order = options.cameras
    # Hidden entries (".name") are not scenes; "..name" is not hidden by convention, so it is reported.
    entries = sorted(p for p in root.iterdir() if not p.name.startswith(".") or p.name.startswith(".."))
    rejected: list[Skipped] = []
    for entry in list(entries):
        name = entry.stem if _is_video(entry) else entry.name
        why = id_problem(name) if (entry.is_dir() or _is_video(entry)) else None
        if why is not None:
            rejected.append(Skipped(name, str(entry.absolute()), f"{why} cannot be a scene id; rename it"))
            entries.remove(entry)
    videos = [p for p in entries if _is_video(p)]
    folders = [p for p in entries if p.is_dir()]
    if videos and folders:
        raise DatasetError(f"{root}: mixes video files and scene folders; use one layout "
                           "(DATA/<scene>/<camera>.mp4 or DATA/<video>.mp4)")
    if videos:
        if order and len(order) != 1:
            raise DatasetError(f"{root}: single-camera folder, but {len(order)} cameras were configured")
        camera = order[0] if order else SINGLE_CAMERA
        return LayoutScenes(_captioned([(Scene(p.stem, (camera,), (resolved_path(p),)), p.with_suffix(".txt"))
                                        for p in videos], rejected), [], rejected)
    if not folders and rejected:
        return LayoutScenes([], [], rejected)
    if not folders:
        raise DatasetError(f"{root}: no videos ({', '.join(VIDEO_EXTENSIONS)}) and no scene folders found")
    # Inside a scene folder anything named like a video is that camera's file: a directory or a socket
    # called cam_0.mp4 is then reported by the probe as "not a regular file" instead of as a missing camera.
    found = {folder: _cameras_in(folder) for folder in folders}
    if not any(found.values()):
        if all(holds_frames(folder) for folder in folders):  # DATA/<clip>/<frames>: single-camera image scenes
            if order and len(order) != 1:
                raise DatasetError(f"{root}: folders of frames are single-camera scenes, but {len(order)} cameras "
                                   "were configured")
            camera = order[0] if order else SINGLE_CAMERA
            return LayoutScenes(_captioned([(Scene(folder.name, (camera,), (resolved_path(folder),),
                                                   frame_rate=options.frame_rate), folder / CAPTION_FILE)
                                            for folder in folders], rejected), [], rejected)
        raise DatasetError(f"{root}: scene folders hold no video files ({', '.join(VIDEO_EXTENSIONS)}) and no "
                           f"folders of frames ({', '.join(IMAGE_EXTENSIONS)})")
    if order:
        check_cameras_exist(root, order, [set(videos) for videos in found.values()])
    names = tuple(order) if order else _common_camera_set(found.values())
    scenes: list[tuple[Scene, Path]] = []
    for folder, videos_by_camera in found.items():
        # A scene missing a camera stays in the list with no path for it, so the probe records it as a
        # skipped input instead of failing the whole dataset.
        paths = tuple(resolved_path(videos_by_camera[name]) if name in videos_by_camera else None for name in names)
        scenes.append((Scene(folder.name, names, paths, frame_rate=options.frame_rate), folder / CAPTION_FILE))
    return LayoutScenes(_captioned(scenes, rejected), [set(videos) for videos in found.values()], rejected)


CAPTION_FILE = "caption.txt"
"""A scene folder's caption (a rig's, or a folder of frames'); a single video's is `<video>.txt` beside it, as
musubi-tuner and diffusion-pipe datasets keep them."""
MAX_CAPTION_BYTES = 1 << 20


def caption_of(path: Path) -> str | None:
    """A sidecar caption as scene metadata JSON ({"caption": text}), or None when there is none (or it is empty);
    CaptionError naming the file when it cannot be one (too large, not UTF-8, unreadable)."""
    try:
        if path.stat().st_size > MAX_CAPTION_BYTES:
            raise CaptionError(str(path), f"a caption file of more than {MAX_CAPTION_BYTES} bytes (not a caption?)")
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise CaptionError(str(path), f"a caption file must be UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise CaptionError(str(path), f"cannot read the caption ({exc.strerror or exc})") from None
    return json.dumps({"caption": text}, ensure_ascii=False, separators=(",", ":")) if text else None


def _captioned(scenes: Iterable[tuple[Scene, Path]], rejected: list[Skipped]) -> list[Scene]:
    """Each scene with its sidecar caption (scene, caption file) as metadata; a scene whose caption cannot be read
    as one is a recorded skip naming the file (as a tar sample's txt member is), and the rest goes on."""
    kept = []
    for scene, path in scenes:
        try:
            metadata = caption_of(path)
        except CaptionError as exc:
            rejected.append(Skipped(scene.scene_id, exc.path, exc.reason))
            continue
        kept.append(dataclasses.replace(scene, metadata=metadata) if metadata else scene)
    return kept


def check_cameras_exist(where: Path, order: Sequence[str], per_scene: Sequence[set[str]]) -> None:
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


class SceneFolders:
    """DATA/<scene>/<camera>.mp4, or a folder of videos (one single-camera scene each)."""

    name = "folders"
    reference_camera = None

    def matches(self, data: Path) -> bool:
        return data.is_dir()

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        return scenes_from_folder(data, options)


FOLDERS = SceneFolders()
