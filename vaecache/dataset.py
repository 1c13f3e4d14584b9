"""Scene discovery, probing, clip planning (pure), and the DataLoader dataset of views (decoding: decode.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from vaecache.config import SamplingConfig
from vaecache.decode import ViewDecoder, build_index
from vaecache.errors import DatasetError, VideoDecodeError

VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v")
MISSING_SUFFIX = ".<missing>"
_BAD_ID = re.compile(r"[/\\\x00-\x1f]")


@dataclass(frozen=True)
class Scene:
    """One recording: the same moment seen by every camera. Paths are absolute, in camera order."""

    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str, ...]
    frame_range: tuple[int, int] | None = None
    """[start, stop) of source frames to use; None means the whole video."""

    def __post_init__(self) -> None:
        if not self.scene_id or _BAD_ID.search(self.scene_id) or self.scene_id.startswith("."):
            raise DatasetError(f"scene id {self.scene_id!r} is not usable (empty, starts with '.', or has '/' or control characters)")
        if len(self.cameras) != len(self.paths) or not self.cameras:
            raise DatasetError(f"scene {self.scene_id}: needs one path per camera")


@dataclass(frozen=True)
class SceneProbe:
    """What opening a scene's videos told us: usable frames and fps, or why it is unusable."""

    scene_id: str
    num_frames: int = 0
    fps: float = 0.0
    error: str | None = None
    error_path: str | None = None


@dataclass(frozen=True)
class Clip:
    """One training sample: the same frame indices of every camera of a scene."""

    clip_id: str
    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str, ...]
    frames: tuple[int, ...]
    fps: float

    @property
    def num_views(self) -> int:
        return len(self.cameras)


@dataclass(frozen=True)
class Skipped:
    """A scene (or one of its files) that produced no clip, and why."""

    scene_id: str
    path: str | None
    reason: str


def clip_id_for(scene_id: str, frames: Sequence[int]) -> str:
    """Identity of a clip, from its source only: scene id and first/last source frame."""
    return f"{scene_id}/{frames[0]:06d}-{frames[-1]:06d}"


# --------------------------------------------------------------------------- discovery


def discover_scenes(data: Path, cameras: Sequence[str] | None = None) -> list[Scene]:
    """Find scenes in a multi-camera folder, a single-camera folder, or a JSONL index. Sorted by id."""
    data = Path(data)
    if not data.exists():
        raise DatasetError(f"{data}: dataset path does not exist")
    if data.is_file():
        if data.suffix.lower() not in (".jsonl", ".json"):
            raise DatasetError(f"{data}: expected a folder or a .jsonl index, got a {data.suffix or 'suffix-less'} file")
        scenes = _scenes_from_index(data, cameras)
    else:
        scenes = _scenes_from_folder(data, cameras)
    ids = [scene.scene_id for scene in scenes]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise DatasetError(f"{data}: scene id(s) appear twice: {', '.join(duplicates[:5])}")
    return sorted(scenes, key=lambda scene: scene.scene_id)


def _has_video_name(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS and not path.name.startswith(".")


def _is_video(path: Path) -> bool:
    return path.is_file() and _has_video_name(path)


def _scenes_from_folder(root: Path, order: Sequence[str] | None) -> list[Scene]:
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    videos = [p for p in entries if _is_video(p)]
    folders = [p for p in entries if p.is_dir()]
    if videos and folders:
        raise DatasetError(f"{root}: mixes video files and scene folders; use one layout (DATA/<scene>/<camera>.mp4 or DATA/<video>.mp4)")
    if videos:
        if order and len(order) != 1:
            raise DatasetError(f"{root}: single-camera folder, but {len(order)} cameras were configured")
        camera = order[0] if order else "video"
        return [Scene(p.stem, (camera,), (str(p.resolve()),)) for p in videos]
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
        # A scene missing a camera stays in the list with a placeholder path, so the probe records
        # it as a skipped input instead of failing the whole dataset.
        paths = tuple(str(videos_by_camera[name].resolve()) if name in videos_by_camera
                      else str(folder.resolve() / f"{name}{MISSING_SUFFIX}") for name in names)
        scenes.append(Scene(folder.name, names, paths))
    return scenes


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


def _scenes_from_index(index: Path, order: Sequence[str] | None) -> list[Scene]:
    base = index.resolve().parent
    scenes = []
    mapped: list[set[str]] = []  # camera names of the records that name their cameras
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
            if "cameras" in record:
                mapping = record["cameras"]
                if not isinstance(mapping, dict) or not mapping:
                    raise DatasetError(f"{where}: \"cameras\" must map camera names to paths")
                mapped.append(set(mapping))
            elif "path" in record:
                mapping = {(order[0] if order else "video"): record["path"]}
            else:
                raise DatasetError(f"{where}: needs \"cameras\" (camera -> path) or \"path\"")
            bad = sorted(str(name) for name, raw in mapping.items() if not isinstance(raw, str) or not raw)
            if bad:
                raise DatasetError(f"{where}: the path of camera {bad[0]!r} must be a non-empty string")
            names = tuple(order) if order else tuple(sorted(mapping))
            paths = []
            for name in names:
                raw = mapping.get(name)
                if raw is None:
                    paths.append(str(base / f"{record['id']}.{name}{MISSING_SUFFIX}"))
                else:
                    paths.append(str((base / raw).resolve()))
            frame_range = None
            if "frames" in record:
                frame_range = _parse_range(record["frames"], where)
            scenes.append(Scene(str(record["id"]), names, tuple(paths), frame_range))
    if not scenes:
        raise DatasetError(f"{index}: index holds no scenes")
    if order and mapped:
        _check_cameras_exist(index, order, mapped)
    if not order:
        camera_sets = {scene.cameras for scene in scenes}
        if len(camera_sets) > 1:
            raise DatasetError(f"{index}: scenes list different camera sets {sorted(map(list, camera_sets))[:2]}; pass --cameras to choose")
    return scenes


def _parse_range(value: Any, where: str) -> tuple[int, int]:
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
            and 0 <= value[0] < value[1]):
        return value[0], value[1]
    raise DatasetError(f"{where}: \"frames\" must be [start, stop) with 0 <= start < stop, got {value!r}")


# --------------------------------------------------------------------------- probing


def probe_scene(scene: Scene) -> SceneProbe:
    """Index every camera's video; all must be readable and hold the same number of frames."""
    counts, fps_values = [], []
    for camera, path in zip(scene.cameras, scene.paths):
        if path.endswith(MISSING_SUFFIX):
            return SceneProbe(scene.scene_id, error=f"camera {camera!r} is missing", error_path=path)
        try:
            index = build_index(path)
        except VideoDecodeError as exc:
            return SceneProbe(scene.scene_id, error=exc.reason, error_path=path)
        counts.append(index.num_frames)
        fps_values.append(index.fps)
    if len(set(counts)) > 1:
        shortest = min(range(len(counts)), key=counts.__getitem__)
        return SceneProbe(
            scene.scene_id,
            error=f"camera {scene.cameras[shortest]!r} has {counts[shortest]} frames, others have up to {max(counts)}",
            error_path=scene.paths[shortest],
        )
    odd = next((i for i, fps in enumerate(fps_values) if abs(fps - fps_values[0]) > 0.01 * fps_values[0]), None)
    if odd is not None:
        return SceneProbe(
            scene.scene_id,
            error=f"camera {scene.cameras[odd]!r} runs at {fps_values[odd]:g} fps, camera {scene.cameras[0]!r} at "
                  f"{fps_values[0]:g} fps (the same frame index would not be the same moment)",
            error_path=scene.paths[odd],
        )
    total = counts[0]
    if scene.frame_range is not None:
        start, stop = scene.frame_range
        if stop > total:
            return SceneProbe(scene.scene_id, error=f"frame range [{start}, {stop}) exceeds the video's {total} frames",
                              error_path=scene.paths[0])
    return SceneProbe(scene.scene_id, num_frames=total, fps=fps_values[0])


# --------------------------------------------------------------------------- planning (pure)


def plan_clips(scenes: Sequence[Scene], probes: dict[str, SceneProbe], sampling: SamplingConfig) -> tuple[list[Clip], list[Skipped]]:
    """Cut every usable scene into windows of `sampling.num_frames` frames. Pure: no I/O."""
    clips: list[Clip] = []
    skipped: list[Skipped] = []
    for scene in scenes:
        probe = probes[scene.scene_id]
        if probe.error is not None:
            skipped.append(Skipped(scene.scene_id, probe.error_path, probe.error))
            continue
        start, stop = scene.frame_range if scene.frame_range is not None else (0, probe.num_frames)
        windows = plan_windows(start, stop, sampling)
        if not windows:
            skipped.append(Skipped(scene.scene_id, None,
                                   f"too short: {stop - start} usable frames, one clip needs {sampling.span}"))
            continue
        for frames in windows:
            clips.append(Clip(clip_id_for(scene.scene_id, frames), scene.scene_id, scene.cameras, scene.paths,
                              frames, probe.fps))
    return clips, skipped


def plan_windows(start: int, stop: int, sampling: SamplingConfig) -> list[tuple[int, ...]]:
    """Frame indices of each clip in [start, stop)."""
    windows = []
    first = start
    while first + sampling.span <= stop:
        windows.append(tuple(range(first, first + sampling.span, sampling.frame_stride)))
        if sampling.max_clips_per_scene is not None and len(windows) >= sampling.max_clips_per_scene:
            break
        first += sampling.step
    return windows


def assign(items: Sequence[Any], rank: int, world: int) -> list[Any]:
    """The deterministic share of `items` that worker `rank` of `world` takes (round-robin)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    return list(items[rank::world])


def assign_contiguous(items: Sequence[Any], rank: int, world: int) -> list[Any]:
    """Worker `rank`'s contiguous, balanced block of `items` (sizes differ by at most one).

    A scene's consecutive clips stay together, so an open video reader carries on instead of
    seeking back to a keyframe on another rank."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    count = len(items)
    return list(items[rank * count // world:(rank + 1) * count // world])


def batched(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


# --------------------------------------------------------------------------- views


@dataclass(frozen=True)
class ViewRef:
    """One camera of one clip, addressed by its position in a batch."""

    clip_index: int
    camera_index: int


def batch_views(batch: Sequence[Clip]) -> list[ViewRef]:
    """The batch folded into views: clip-major, camera-minor (B*NC entries)."""
    return [ViewRef(i, c) for i, clip in enumerate(batch) for c in range(clip.num_views)]


class ViewBatchDataset(torch.utils.data.Dataset):
    """Item i decodes the views this rank encodes for batch i; failures are reported, not raised."""

    def __init__(self, batches: Sequence[Sequence[Clip]], view_indices: Sequence[Sequence[int]], height: int, width: int) -> None:
        self.batches = [list(b) for b in batches]
        self.view_indices = [list(v) for v in view_indices]
        self.height, self.width = height, width
        self._decoder: ViewDecoder | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._decoder is None:
            self._decoder = ViewDecoder(self.height, self.width)
        batch = self.batches[index]
        views = batch_views(batch)
        decoded: dict[int, torch.Tensor] = {}
        errors: dict[int, tuple[str, str]] = {}
        out = []
        for view_index in self.view_indices[index]:
            ref = views[view_index]
            clip = batch[ref.clip_index]
            if ref.clip_index in errors:
                tensor = None
            elif view_index in decoded:
                tensor = decoded[view_index]
            else:
                try:
                    tensor = self._decoder.decode(clip.paths[ref.camera_index], clip.frames)
                    decoded[view_index] = tensor
                except VideoDecodeError as exc:
                    errors[ref.clip_index] = (exc.path, exc.reason)
                    tensor = None
            out.append(tensor)
        template = next((t for t in out if t is not None), None)
        if template is None:
            template = torch.zeros(3, len(batch[0].frames), self.height, self.width)
        stacked = torch.stack([t if t is not None else torch.zeros_like(template) for t in out])
        return {"index": index, "views": stacked, "errors": errors}
