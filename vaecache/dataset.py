"""Scene discovery and decord decoding into (views, C, T, H, W) float tensors (clip planning: planning.py)."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from vaecache.errors import DatasetError, VideoDecodeError
from vaecache.planning import Clip, batch_views

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
    """Open every camera's video; all must be readable and hold the same number of frames."""
    counts, fps_values = [], []
    for camera, path in zip(scene.cameras, scene.paths):
        if path.endswith(MISSING_SUFFIX):
            return SceneProbe(scene.scene_id, error=f"camera {camera!r} is missing", error_path=path)
        try:
            reader = open_video(path)
            counts.append(len(reader))
            fps_values.append(float(reader.get_avg_fps()))
            del reader
        except VideoDecodeError as exc:
            return SceneProbe(scene.scene_id, error=exc.reason, error_path=path)
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


def open_video(path: str):
    """A decord VideoReader, with decord's failures turned into VideoDecodeError naming the file."""
    import decord

    file = Path(path)
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise VideoDecodeError(path, "file not found") from None
    except PermissionError:
        raise VideoDecodeError(path, "permission denied") from None
    if size == 0:
        raise VideoDecodeError(path, "empty file (0 bytes)")
    if not file.is_file():
        raise VideoDecodeError(path, "not a regular file")
    try:
        with open(file, "rb"):
            pass
        reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1)
    except PermissionError:
        raise VideoDecodeError(path, "permission denied") from None
    except Exception as exc:  # decord raises its own DECORDError / RuntimeError
        raise VideoDecodeError(path, f"not a readable video ({_short(exc)})") from None
    if len(reader) == 0:
        raise VideoDecodeError(path, "video has no frames")
    return reader


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


# --------------------------------------------------------------------------- decoding


def resize_cover_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(T, C, h, w) uint8 -> (T, C, height, width) float: scale to cover, then center-crop."""
    _, _, src_h, src_w = frames.shape
    frames = frames.float()
    if (src_h, src_w) != (height, width):
        scale = max(height / src_h, width / src_w)
        new_h, new_w = max(height, round(src_h * scale)), max(width, round(src_w * scale))
        if (new_h, new_w) != (src_h, src_w):
            frames = torch.nn.functional.interpolate(frames, size=(new_h, new_w), mode="bilinear",
                                                     align_corners=False, antialias=True)
        top, left = (new_h - height) // 2, (new_w - width) // 2
        frames = frames[:, :, top:top + height, left:left + width]
    return frames


def to_model_range(frames: torch.Tensor) -> torch.Tensor:
    """[0, 255] -> [-1, 1], clamped (resampling can overshoot)."""
    return (frames / 127.5 - 1.0).clamp_(-1.0, 1.0)


class ViewDecoder:
    """Decodes one camera of one clip. Keeps a few readers open, because a batch often reads one file twice."""

    def __init__(self, height: int, width: int, cache_size: int = 8) -> None:
        self.height, self.width = height, width
        self._readers: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size

    def _reader(self, path: str):
        reader = self._readers.pop(path, None)
        if reader is None:
            reader = open_video(path)
        self._readers[path] = reader
        while len(self._readers) > self._cache_size:
            self._readers.popitem(last=False)
        return reader

    def decode(self, path: str, frames: Sequence[int]) -> torch.Tensor:
        """(C, T, H, W) float in [-1, 1]."""
        reader = self._reader(path)
        if frames[-1] >= len(reader):
            raise VideoDecodeError(path, f"frame {frames[-1]} requested, video has {len(reader)}")
        try:
            array = reader.get_batch(list(frames)).asnumpy()
        except Exception as exc:
            self._readers.pop(path, None)
            if "size must exactly match" not in str(exc):
                raise VideoDecodeError(path, f"decoding frames {frames[0]}..{frames[-1]} failed ({_short(exc)})") from None
            # decord 0.6 misreads frames of a few widths (16, 24, 48, 72: dmlc/decord#93): PyAV decodes them.
            array = decode_frames_pyav(path, frames)
        if array.shape[0] != len(frames) or array.ndim != 4:
            raise VideoDecodeError(path, f"decoder returned {array.shape[0]} of {len(frames)} frames")
        tensor = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)
        tensor = to_model_range(resize_cover_crop(tensor, self.height, self.width))
        return tensor.permute(1, 0, 2, 3).contiguous()


def decode_frames_pyav(path: str, frames: Sequence[int]) -> np.ndarray:
    """(T, H, W, 3) uint8 RGB of the given frame indices, decoding from the start (slow, exact)."""
    import av

    wanted = {index: position for position, index in enumerate(frames)}
    out: list[np.ndarray | None] = [None] * len(frames)
    try:
        with av.open(path) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    out[wanted[index]] = frame.to_ndarray(format="rgb24")
                if index >= frames[-1]:
                    break
    except av.FFmpegError as exc:
        raise VideoDecodeError(path, f"decoding frames {frames[0]}..{frames[-1]} failed ({_short(exc)})") from None
    if any(frame is None for frame in out):
        raise VideoDecodeError(path, f"video ended before frame {frames[-1]}")
    return np.stack(out)


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
