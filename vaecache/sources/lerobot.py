"""The LeRobot layout: DATA is a LeRobot dataset root (`meta/info.json`), codebase_version v3.0, or v2.1/v2.0.

The contract is read from huggingface/lerobot's own source (the package is not imported):

* v3.0 (main at 7427f31, and tag v0.4.4): `src/lerobot/datasets/utils.py` names the files
  (`meta/episodes/chunk-XXX/file-XXX.parquet`, `data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet`,
  `videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4`, `meta/tasks.parquet`);
  `dataset_writer.py` and `dataset_metadata.py` write one row per episode with `episode_index`, `tasks`, `length`,
  `data/chunk_index`, `data/file_index` and per camera
  `videos/{key}/chunk_index`, `videos/{key}/file_index`, `videos/{key}/from_timestamp`, `videos/{key}/to_timestamp`:
  many episodes share one mp4 per camera, each `[from_timestamp, to_timestamp)` of it, the spans float sums of the
  episodes' durations, and a camera's file rolls over on its own size (so chunk, file and span differ between
  cameras). `meta/tasks.parquet` is a pandas frame whose index (`task`) is the task text and `task_index` its column.
* v2.1 (tag v0.3.3): one mp4 per episode and camera, `videos/chunk-{episode_chunk:03d}/{video_key}/
  episode_{episode_index:06d}.mp4` with `episode_chunk = episode_index // chunks_size`; `meta/episodes.jsonl`
  (`episode_index`, `tasks`, `length`) and `meta/tasks.jsonl` (`task_index`, `task`).

Frames are chosen as LeRobotDataset picks them (`lerobot_dataset.py`): frame i of an episode is, in each camera, the
file's frame nearest `from_timestamp + timestamp_i` within `tolerance_s` = 1e-4 s (vaecache.video.spans), the
data table's `timestamp` being `frame_index / fps` as LeRobot writes it (checked). A scene is an episode
(`episode_000042`), its cameras the features of dtype `video` in info.json's order, so clips never cross an episode
and frame i of a clip is row i of the episode's data. Each clip's record carries the tasks of its own frames
(`caption`: their text; an episode may hold several tasks) and, with --lerobot-state, every numeric per-frame
column of its frames (`observation.state`, `action`, ...).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from vaecache.errors import DatasetError
from vaecache.sources.scene import CameraProbe, LayoutScenes, Scene, Skipped, SourceOptions
from vaecache.storage import location_stat, open_location
from vaecache.urls import is_url
from vaecache.video.spans import EpisodeSpan

log = logging.getLogger("vaecache")

VERSIONS = ("v2.0", "v2.1", "v3.0")
DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")
"""Every LeRobot dataset's own columns (src/lerobot/utils/constants.py DEFAULT_FEATURES)."""
V3_EPISODES = "meta/episodes"
V3_TASKS = "meta/tasks.parquet"
V2_EPISODES = "meta/episodes.jsonl"
V2_TASKS = "meta/tasks.jsonl"
TIMESTAMP_SLACK_S = 1e-4
"""How far a data row's `timestamp` may lie from frame_index / fps (LeRobot's tolerance_s)."""


@dataclass(frozen=True)
class Episode:
    index: int
    length: int
    tasks: tuple[str, ...]
    data_file: str
    cameras: dict[str, tuple[str, float, float | None]]
    """Video key -> (file, from_timestamp, to_timestamp or None)."""


def as_location(root: str) -> Path | Any:
    """A dataset root as the layout walks it: a local Path, or a UrlPath (vaecache.sources.urlpath) for a URL."""
    if is_url(root):
        from vaecache.sources.urlpath import UrlPath

        return UrlPath(root)
    return Path(root)


def _readable(path: Any) -> Any:
    """What pyarrow reads: a local path, or an object at a URL opened for ranged reads."""
    return path if isinstance(path, Path) or not is_url(str(path)) else open_location(str(path))


def read_info(root: Path) -> dict[str, Any]:
    path = root / "meta" / "info.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path}: not a readable LeRobot info.json ({exc})") from None
    if not isinstance(info, dict) or not isinstance(info.get("features"), dict):
        raise DatasetError(f"{path}: a LeRobot info.json needs \"features\"")
    version = info.get("codebase_version")
    if version not in VERSIONS:
        raise DatasetError(f"{path}: codebase_version {version!r} is not one vaecache reads ({', '.join(VERSIONS)}); "
                           "convert it with lerobot's own converter")
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf:
        raise DatasetError(f"{path}: \"fps\" must be a positive number, got {fps!r}")
    for key in ("data_path", "video_path"):
        if not isinstance(info.get(key), str):
            raise DatasetError(f"{path}: \"{key}\" must be the path template (a dataset without videos has nothing "
                               "to encode)")
    return info


def video_keys(info: dict[str, Any]) -> list[str]:
    return [key for key, feature in info["features"].items()
            if isinstance(feature, dict) and feature.get("dtype") == "video"]


def _frame_size(feature: dict[str, Any]) -> tuple[int, int] | None:
    """(width, height) from a video feature's info, else its shape and names."""
    meta = feature.get("info") or {}
    if isinstance(meta.get("video.width"), int) and isinstance(meta.get("video.height"), int):
        return meta["video.width"], meta["video.height"]
    shape, names = feature.get("shape"), feature.get("names")
    if isinstance(shape, list) and isinstance(names, list) and "height" in names and "width" in names:
        return int(shape[names.index("width")]), int(shape[names.index("height")])
    return None


def _whole(value: Any, least: int = 0) -> int | None:
    """`value` as an int when it is a whole number >= `least` (an int, or a float column's 3.0), else None (None,
    NaN, a fraction, a negative, a bool, text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):  # never through math.isfinite: an int past a float's range overflows it
        return value if value >= least else None
    if not isinstance(value, float) or not math.isfinite(value):
        return None
    return int(value) if value == int(value) and value >= least else None


def _seconds(value: Any) -> float | None:
    """`value` as a time in seconds when it is a finite number >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        return None
    return float(value)


def _task_list(value: Any) -> tuple[str, ...] | None:
    """An episode's `tasks` (a list of task texts; null: none), else None."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and all(isinstance(task, str) for task in value):
        return tuple(value)
    return None


def _parquet_rows(path: Path, columns: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(_readable(path))
        names = parquet.schema_arrow.names
        wanted = [c for c in columns if c in names] if columns is not None else None
        for batch in parquet.iter_batches(batch_size=8192, columns=wanted):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet table ({exc})") from None


@functools.lru_cache(maxsize=4)
def tasks_of(root: str, version: str) -> dict[int, str]:
    """task_index -> task text of the dataset at `root` (read once per process)."""
    return read_tasks(as_location(root), version)


def read_tasks(root: Path, version: str) -> dict[int, str]:
    """task_index -> task text."""
    if version == "v3.0":
        path = root / V3_TASKS
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(_readable(path))
        except Exception as exc:  # noqa: BLE001  # pyarrow raises several kinds for one unreadable file
            raise DatasetError(f"{path}: not a readable Parquet table ({exc})") from None
        pandas = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}") or b"{}")
        text_column = next((c for c in pandas.get("index_columns", []) if isinstance(c, str)), None)
        text_column = text_column if text_column in table.column_names else "task"
        if text_column not in table.column_names or "task_index" not in table.column_names:
            raise DatasetError(f"{path}: needs the task text (the frame's index `task`) and `task_index`")
        rows = zip(table.column("task_index").to_pylist(), table.column(text_column).to_pylist())
        return _task_names((f"{path}: row {number}", index, text) for number, (index, text) in enumerate(rows))
    path = root / V2_TASKS
    return _task_names((f"{path}:{number}", record.get("task_index"), record.get("task"))
                       for number, record in _jsonl(path))


def _task_names(rows: Iterator[tuple[str, Any, Any]]) -> dict[int, str]:
    """task_index -> task text from (where, task_index, task) rows; a row that is not a whole task_index >= 0 and a
    text, or repeats an index, is refused naming the table and the row."""
    found: dict[int, str] = {}
    for where, raw, text in rows:
        index = _whole(raw)
        if index is None or not isinstance(text, str):
            raise DatasetError(f"{where}: a task needs a task_index (a whole number >= 0) and its text, got "
                               f"task_index {raw!r}, task {text!r}")
        if index in found:
            raise DatasetError(f"{where}: task_index {index} is listed twice ({found[index]!r} and {text!r})")
        found[index] = text
    return found


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line."""
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise DatasetError(f"{path}:{number}: each line must be an object")
                yield number, record


def _v3_episodes(root: Path, info: dict[str, Any], keys: Sequence[str]) -> Iterator[Episode | Skipped]:
    """Each row of meta/episodes/*/*.parquet as an Episode; a row whose episode_index is not one is refused (exit
    2), one with a bad length, file index or span is a Skipped episode naming the table, the row and the value."""
    files = sorted((root / V3_EPISODES).glob("*/*.parquet"))
    if not files:
        raise DatasetError(f"{root / V3_EPISODES}: no episode tables (chunk-XXX/file-XXX.parquet)")
    columns = ["episode_index", "tasks", "length", "data/chunk_index", "data/file_index"]
    for key in keys:
        columns += [f"videos/{key}/{name}" for name in ("chunk_index", "file_index", "from_timestamp",
                                                        "to_timestamp")]
    for path in files:
        for number, row in enumerate(_parquet_rows(path, columns)):
            missing = [c for c in columns if c not in row]
            if missing:
                raise DatasetError(f"{path}: episode rows lack {', '.join(missing[:4])} (not LeRobot v3.0)")
            index = _whole(row["episode_index"])
            if index is None:
                raise DatasetError(f"{path}: row {number}: episode_index must be a whole number >= 0, got "
                                   f"{row['episode_index']!r}")
            problem = _bad_episode_value(row, ["length", "tasks", "data/chunk_index", "data/file_index"])
            for key in keys:
                if problem is None:
                    problem = _bad_span(row, key)
            if problem is not None:
                yield Skipped(f"episode_{index:06d}", str(path), f"row {number}: {problem}")
                continue
            try:
                cameras = {}
                for key in keys:
                    file = root / info["video_path"].format(video_key=key,
                                                            chunk_index=int(row[f"videos/{key}/chunk_index"]),
                                                            file_index=int(row[f"videos/{key}/file_index"]))
                    cameras[key] = (str(file), float(row[f"videos/{key}/from_timestamp"]),
                                    float(row[f"videos/{key}/to_timestamp"]))
                data = root / info["data_path"].format(chunk_index=int(row["data/chunk_index"]),
                                                       file_index=int(row["data/file_index"]))
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                raise DatasetError(f"{path}: row {number}: episode {index} has a missing or malformed value "
                                   f"({exc})") from None
            yield Episode(index, int(row["length"]), _task_list(row["tasks"]) or (), str(data), cameras)


def _bad_episode_value(row: dict[str, Any], columns: Sequence[str]) -> str | None:
    """What is wrong with an episode row's length, tasks or file indices (None: nothing)."""
    for column in columns:
        value = row.get(column)
        if column == "tasks":
            if _task_list(value) is None:
                return f"tasks must be a list of task texts, got {value!r}"
        elif _whole(value, 1 if column == "length" else 0) is None:
            least = "a whole number of frames >= 1" if column == "length" else "a whole number >= 0"
            return f"{column} must be {least}, got {value!r}"
    return None


def _bad_span(row: dict[str, Any], key: str) -> str | None:
    """What is wrong with a v3.0 episode row's file indices and [from_timestamp, to_timestamp) for camera `key`."""
    problem = _bad_episode_value(row, [f"videos/{key}/chunk_index", f"videos/{key}/file_index"])
    if problem is not None:
        return problem
    start, end = row[f"videos/{key}/from_timestamp"], row[f"videos/{key}/to_timestamp"]
    if _seconds(start) is None:
        return f"videos/{key}/from_timestamp must be a finite time >= 0 s, got {start!r}"
    if _seconds(end) is None or end <= start:
        return f"videos/{key}/to_timestamp must be a finite time after from_timestamp ({start!r} s), got {end!r}"
    return None


def _v2_episodes(root: Path, info: dict[str, Any], keys: Sequence[str]) -> Iterator[Episode | Skipped]:
    """Each line of meta/episodes.jsonl as an Episode (or a Skipped one, as in _v3_episodes)."""
    chunks = _whole(info.get("chunks_size") or 1000, 1)
    if chunks is None:
        raise DatasetError(f"{root / 'meta' / 'info.json'}: \"chunks_size\" must be a whole number >= 1, got "
                           f"{info.get('chunks_size')!r}")
    path = root / V2_EPISODES
    for number, record in _jsonl(path):
        index = _whole(record.get("episode_index"))
        if index is None:
            raise DatasetError(f"{path}:{number}: \"episode_index\" must be a whole number >= 0, got "
                               f"{record.get('episode_index')!r}")
        problem = _bad_episode_value({"tasks": None, **record}, ["length", "tasks"])
        if problem is not None:
            yield Skipped(f"episode_{index:06d}", str(path), f"line {number}: {problem}")
            continue
        try:
            chunk = index // chunks
            cameras = {key: (str(root / info["video_path"].format(episode_chunk=chunk, video_key=key,
                                                                   episode_index=index)), 0.0, None) for key in keys}
            data = root / info["data_path"].format(episode_chunk=chunk, episode_index=index)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise DatasetError(f"{path}:{number}: episode {index} has a missing or malformed value ({exc})") from None
        yield Episode(index, int(record["length"]), _task_list(record.get("tasks")) or (), str(data), cameras)


@functools.lru_cache(maxsize=256)
def _file_identity(path: str) -> tuple[int, int] | None:
    try:
        return location_stat(path)
    except OSError:
        return None


def scenes_from_lerobot(root: Path, options: SourceOptions) -> LayoutScenes:
    info = read_info(root)
    version, fps = info["codebase_version"], float(info["fps"])
    keys = video_keys(info)
    if not keys:
        raise DatasetError(f"{root}: the dataset has no video features (dtype \"video\") to encode")
    chosen = tuple(options.cameras) if options.cameras else tuple(keys)
    unknown = [name for name in chosen if name not in keys]
    if unknown:
        raise DatasetError(f"{root}: camera(s) {', '.join(unknown)} from --cameras are not video features here "
                           f"({', '.join(keys)})")
    tasks_of.cache_clear()
    state_columns.cache_clear()
    tasks_of(str(root), version)  # a missing or unreadable task table is refused before any episode
    sizes = {key: _frame_size(info["features"][key]) for key in chosen}
    codecs = {key: str((info["features"][key].get("info") or {}).get("video.codec") or "unknown") for key in chosen}
    episodes = _v3_episodes(root, info, chosen) if version == "v3.0" else _v2_episodes(root, info, chosen)
    scenes: list[Scene] = []
    rejected: list[Skipped] = []
    _file_identity.cache_clear()
    for episode in episodes:
        if isinstance(episode, Skipped):
            rejected.append(episode)
            continue
        scene_id = f"episode_{episode.index:06d}"
        problem, paths, probes = None, [], []
        for key in chosen:
            file, start, end = episode.cameras[key]
            if end is not None and abs((end - start) - episode.length / fps) > 0.5 / fps:
                problem = (file, key, f"its span [{start:.6f}, {end:.6f}) s is {end - start:.6f} s, the episode's "
                                      f"{episode.length} frames at {fps:g} fps take {episode.length / fps:.6f} s")
                break
            span = EpisodeSpan(file, round(start * 1e9), episode.length, fps)
            paths.append(span.reference)
            identity, size = _file_identity(file), sizes[key]
            if identity is None or identity[0] < 1 or size is None or episode.length < 1:
                probes = None  # opened and probed like any video (a missing file is recorded there)
                continue
            if probes is not None:
                probes.append(CameraProbe(episode.length, fps, size[0], size[1], codecs[key], identity[0], identity[1],
                                          0, 0, round((episode.length - 1) * 1e9 / fps), episode=True))
        if problem is not None:
            rejected.append(Skipped(scene_id, problem[0], problem[2], problem[1]))
            continue
        metadata = {"lerobot": {"episode_index": episode.index, "tasks": list(episode.tasks),
                                "robot_type": info.get("robot_type"), "fps": fps}}
        if len(episode.tasks) == 1:
            metadata["caption"] = episode.tasks[0]
        listing = EpisodeRows(str(root), version, episode.data_file, episode.index, len(chosen), fps,
                              options.lerobot_state)
        scenes.append(Scene(scene_id, chosen, tuple(paths), probed=tuple(probes) if probes else None,
                            metadata=json.dumps(metadata, sort_keys=True, separators=(",", ":")), listing=listing))
    if not scenes and not rejected:
        raise DatasetError(f"{root}: the dataset lists no episodes")
    log.info("LeRobot %s (%s): %d episodes, cameras %s", root, version, len(scenes), ", ".join(chosen))
    return LayoutScenes(scenes, [set(keys)] * len(scenes), rejected)


@functools.lru_cache(maxsize=4)
def state_columns(root: str) -> tuple[str, ...]:
    """The numeric per-frame columns of the dataset at `root` besides LeRobot's own (observation.state, action,
    next.reward, ...)."""
    return _state_columns(read_info(as_location(root)))


def _state_columns(info: dict[str, Any]) -> tuple[str, ...]:
    return tuple(key for key, feature in info["features"].items()
                 if isinstance(feature, dict) and key not in DEFAULT_FEATURES
                 and feature.get("dtype") not in ("video", "image", "string")
                 and not str(feature.get("dtype", "")).startswith("audio"))


@dataclass(frozen=True, slots=True)
class EpisodeRows:
    """A Listing of an episode's data rows: read from its data file when a clip of the episode is built (the last few
    files cached per process), never while planning. `vaecache index` keeps it on the episode's line
    (`lerobot_rows`)."""

    root: str
    version: str
    data_file: str
    episode: int
    cameras: int
    fps: float
    with_state: bool
    """--lerobot-state: the numeric per-frame columns too (which ones: the dataset's info.json says)."""

    lists_frames = False
    frame_lists = None
    frame_metadata = None

    def clip_metadata(self, frames: Sequence[int]) -> dict[str, Any]:
        """The tasks of the clip's frames (`caption`: their text, joined by '; ' where they change) and, with
        --lerobot-state, each numeric column's values at those frames."""
        state = state_columns(self.root) if self.with_state else ()
        try:
            stamp = location_stat(self.data_file)[1]  # a rewritten data file is read again
        except OSError as exc:
            raise DatasetError(f"{self.data_file}: cannot read the episode's data rows "
                               f"({exc.strerror or exc})") from None
        rows = _episode_rows(self.data_file, stamp, self.episode, state, self.fps)
        if frames and frames[-1] >= len(rows["task_index"]):
            raise DatasetError(f"{self.data_file}: episode {self.episode} has {len(rows['task_index'])} data rows, a "
                               f"clip asks for frame {frames[-1]}")
        names = tasks_of(self.root, self.version)
        indices = [rows["task_index"][i] for i in frames]
        for frame, index in zip(frames, indices):
            if isinstance(index, bool) or index not in names:  # never a made-up caption
                table = as_location(self.root) / (V3_TASKS if self.version == "v3.0" else V2_TASKS)
                raise DatasetError(f"{self.data_file}: episode {self.episode} frame {frame}: task_index {index!r} is "
                                   f"not a task of {table}")
        seen = list(dict.fromkeys(names[i] for i in indices))
        found: dict[str, Any] = {"caption": "; ".join(seen), "tasks": seen,
                                 "lerobot_frames": {"frame_index": list(frames), "task_index": indices}}
        for column in state:
            found["lerobot_frames"][column] = [rows[column][i] for i in frames]
        return found


    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "version": self.version, "data_file": self.data_file, "episode": self.episode,
                "fps": self.fps}

    @classmethod
    def from_json(cls, raw: Any, cameras: int, with_state: bool, where: str) -> EpisodeRows:
        """An index line's "lerobot_rows" (what to_json wrote)."""
        try:
            episode, fps = _whole(raw["episode"]), raw["fps"]
            if episode is None or isinstance(fps, bool) or not 0 < fps < math.inf:
                raise ValueError("episode and fps out of range")
            return cls(str(raw["root"]), str(raw["version"]), str(raw["data_file"]), episode, cameras, float(fps),
                       with_state)
        except (KeyError, TypeError, ValueError):
            raise DatasetError(f"{where}: \"lerobot_rows\" must hold root, version, data_file, episode and fps, as "
                               "`vaecache index` writes them") from None


@functools.lru_cache(maxsize=4)
def _data_table(path: str, stamp: int, columns: tuple[str, ...]) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(_readable(path), columns=list(columns))
    except Exception as exc:  # noqa: BLE001
        raise DatasetError(f"{path}: cannot read the episode's data rows ({exc})") from None


@functools.lru_cache(maxsize=8)
def _episode_rows(path: str, stamp: int, episode: int, state: tuple[str, ...], fps: float) -> dict[str, list[Any]]:
    """Column -> values of one episode's rows, in frame_index order; its timestamps checked against frame_index/fps
    (the times its frames were picked at)."""
    import pyarrow.compute as pc

    table = _data_table(path, stamp, ("episode_index", "frame_index", "timestamp", "task_index", *state))
    rows = table.filter(pc.equal(table.column("episode_index"), episode))
    order = pc.sort_indices(rows, sort_keys=[("frame_index", "ascending")])
    rows = rows.take(order)
    found = {name: rows.column(name).to_pylist() for name in rows.column_names}
    if found["frame_index"] != list(range(len(found["frame_index"]))):  # a null or NaN one too
        raise DatasetError(f"{path}: episode {episode}'s frame_index is not 0, 1, 2, ...")
    for frame, stamp in zip(found["frame_index"], found["timestamp"]):
        if _seconds(stamp) is None or not abs(stamp - frame / fps) <= TIMESTAMP_SLACK_S:  # NaN compares false
            raise DatasetError(f"{path}: episode {episode} frame {frame} has timestamp {stamp}, not frame_index / fps "
                               f"= {frame / fps:.6f} (vaecache reads episodes recorded at an even rate)")
    return found


class LeRobotRoot:
    """A LeRobot dataset root: meta/info.json."""

    name = "lerobot"
    reference_camera = None

    def matches(self, data: Path) -> bool:
        return data.is_dir() and (data / "meta" / "info.json").is_file()

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        return scenes_from_lerobot(data, options)


LEROBOT = LeRobotRoot()
__all__ = ["LEROBOT", "EpisodeRows", "read_info", "video_keys"]
