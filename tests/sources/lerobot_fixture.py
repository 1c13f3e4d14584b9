"""Small LeRobot datasets written the way LeRobot writes them (the `lerobot` package itself is not installed here: its
pins need torch < 2.8). What is followed, from huggingface/lerobot main (7427f31) and tags v0.4.4 / v0.3.3:

* each episode's camera frames encoded with LeRobot's defaults (src/lerobot/configs/video.py VideoEncoderConfig:
  libsvtav1, yuv420p, g=2, crf=30, preset 12) into an episode file;
* v3.0: episodes appended to one file per camera by remuxing through FFmpeg's concat demuxer, as
  dataset_writer.py `_save_episode_video` / video_utils.py `concatenate_video_files` do; `from_timestamp` is the
  previous episode's `to_timestamp`, `to_timestamp` adds the episode file's stream duration
  (`get_video_duration_in_s`); a camera may start a new file (`file_index + 1`) at an episode of its own;
* the data table (`timestamp = frame_index / fps` as float32, `frame_index`, `episode_index`, global `index`,
  `task_index`, fixed-size float32 lists for `observation.state` and `action`), the episodes table (columns as
  `dataset_metadata.py` writes them), `meta/tasks.parquet` as pandas writes `DataFrame({"task_index": ...},
  index=Index(tasks, name="task"))`, and info.json;
* v2.1: one mp4 and one parquet per episode, `meta/episodes.jsonl` and `meta/tasks.jsonl`.

The episode files (before concatenation) are kept under `cuts/`: the episodes cut out losslessly.
"""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.videos import frame_pixels

CAMERAS = ("observation.images.top", "observation.images.wrist")
V3_VIDEO = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V3_DATA = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V2_VIDEO = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
V2_DATA = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
STATE = 3


def encode_episode(path: Path, frames: list[np.ndarray], fps: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libsvtav1", rate=fps, options={"g": "2", "crf": "30", "preset": "12",
                                                                      "svtav1-params": "fast-decode=0:lp=1"})
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def duration_s(path: Path) -> float:
    """video_utils.get_video_duration_in_s: the stream's duration, else the container's."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.duration is not None:
            return float(stream.duration * stream.time_base)
        return float(container.duration / av.time_base)


def concatenate(inputs: list[Path], output: Path) -> None:
    """video_utils.concatenate_video_files: FFmpeg's concat demuxer, packets copied (no re-encode), faststart."""
    listing = output.with_suffix(".txt")
    listing.write_text("".join(f"file '{p.resolve()}'\n" for p in inputs))
    scratch = output.with_name(output.stem + ".tmp.mp4")
    with av.open(str(listing), format="concat", options={"safe": "0"}) as source, \
            av.open(str(scratch), "w", options={"movflags": "faststart"}) as sink:
        stream = source.streams.video[0]
        out = sink.add_stream_from_template(stream, opaque=True)
        for packet in source.demux(stream):
            if packet.dts is None:
                continue
            packet.stream = out
            sink.mux(packet)
    listing.unlink()
    shutil.move(scratch, output)


def episode_frames(episode: int, camera: int, length: int, height: int, width: int) -> list[np.ndarray]:
    return [frame_pixels(7 * episode + 3 * camera + index, height, width, seed=camera) for index in range(length)]


def feature_info(height: int, width: int, fps: int) -> dict[str, Any]:
    return {"video.height": height, "video.width": width, "video.codec": "av1", "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False}


def info_json(version: str, episodes: list[list[str]], tasks: list[str], fps: int, height: int,
              width: int) -> dict[str, Any]:
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": [STATE], "names": ["x", "y", "z"]},
        "action": {"dtype": "float32", "shape": [STATE], "names": ["x", "y", "z"]},
    }
    for camera in CAMERAS:
        features[camera] = {"dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channels"],
                            "info": feature_info(height, width, fps)}
    features.update({"timestamp": {"dtype": "float32", "shape": [1], "names": None},
                     "frame_index": {"dtype": "int64", "shape": [1], "names": None},
                     "episode_index": {"dtype": "int64", "shape": [1], "names": None},
                     "index": {"dtype": "int64", "shape": [1], "names": None},
                     "task_index": {"dtype": "int64", "shape": [1], "names": None}})
    total = sum(map(len, episodes))
    info = {"codebase_version": version, "robot_type": "so100", "total_episodes": len(episodes),
            "total_frames": total, "total_tasks": len(tasks), "chunks_size": 1000, "fps": fps,
            "splits": {"train": f"0:{len(episodes)}"}, "features": features}
    if version == "v3.0":
        info.update(data_files_size_in_mb=100, video_files_size_in_mb=200, data_path=V3_DATA, video_path=V3_VIDEO)
    else:
        info.update(total_videos=len(episodes) * len(CAMERAS), total_chunks=1, data_path=V2_DATA,
                    video_path=V2_VIDEO)
    return info


def data_table(episodes: list[list[str]], tasks: list[str], fps: int, only: int | None = None) -> pa.Table:
    columns: dict[str, list[Any]] = {k: [] for k in ("observation.state", "action", "timestamp", "frame_index",
                                                     "episode_index", "index", "task_index")}
    index = 0
    for episode, frame_tasks in enumerate(episodes):
        for frame, task in enumerate(frame_tasks):
            if only is None or only == episode:
                columns["observation.state"].append([float(episode), float(frame), 0.5])
                columns["action"].append([float(frame) / 10, -1.0, float(episode)])
                columns["timestamp"].append(frame / fps)
                columns["frame_index"].append(frame)
                columns["episode_index"].append(episode)
                columns["index"].append(index)
                columns["task_index"].append(tasks.index(task))
            index += 1
    vector = pa.list_(pa.float32(), STATE)
    return pa.table({"observation.state": pa.array(columns["observation.state"], vector),
                     "action": pa.array(columns["action"], vector),
                     "timestamp": pa.array(columns["timestamp"], pa.float32()),
                     **{k: pa.array(columns[k], pa.int64()) for k in ("frame_index", "episode_index", "index",
                                                                        "task_index")}})


def tasks_parquet(path: Path, tasks: list[str]) -> None:
    """What `pd.DataFrame({"task_index": ...}, index=pd.Index(tasks, name="task")).to_parquet(path)` writes."""
    pandas = {"index_columns": ["task"], "column_indexes": [{"name": None, "field_name": None,
                                                             "pandas_type": "unicode", "numpy_type": "object",
                                                             "metadata": {"encoding": "UTF-8"}}],
              "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                           "numpy_type": "int64", "metadata": None},
                          {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
                           "metadata": None}],
              "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas).encode()}), path)


def write_lerobot(root: Path, episodes: list[list[str]], version: str = "v3.0", fps: int = 10,
                  size: tuple[int, int] = (48, 64), new_file_at: dict[str, set[int]] | None = None) -> Path:
    """A dataset of len(episodes) episodes (each a list of per-frame task texts) and the two CAMERAS. v3.0:
    `new_file_at` {camera: {episode, ...}}: that camera starts a new file at those episodes."""
    height, width = size
    tasks = list(dict.fromkeys(task for frames in episodes for task in frames))
    root.mkdir(parents=True)
    cuts = root.parent / f"{root.name}-cuts"
    for episode, frames in enumerate(episodes):
        for camera_index, camera in enumerate(CAMERAS):
            encode_episode(cuts / f"episode_{episode:06d}" / f"{camera}.mp4",
                           episode_frames(episode, camera_index, len(frames), height, width), fps)
    (root / "meta").mkdir()
    (root / "meta" / "info.json").write_text(json.dumps(info_json(version, episodes, tasks, fps, height, width),
                                                        indent=4))
    if version != "v3.0":
        for episode, frames in enumerate(episodes):
            for camera in CAMERAS:
                target = root / V2_VIDEO.format(episode_chunk=0, video_key=camera, episode_index=episode)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(cuts / f"episode_{episode:06d}" / f"{camera}.mp4", target)
            target = root / V2_DATA.format(episode_chunk=0, episode_index=episode)
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(data_table(episodes, tasks, fps, only=episode), target)
        (root / "meta" / "episodes.jsonl").write_text("".join(
            json.dumps({"episode_index": e, "tasks": list(dict.fromkeys(f)), "length": len(f)}) + "\n"
            for e, f in enumerate(episodes)))
        (root / "meta" / "tasks.jsonl").write_text("".join(
            json.dumps({"task_index": i, "task": t}) + "\n" for i, t in enumerate(tasks)))
        return root
    rows: dict[str, list[Any]] = {}
    spans = {camera: (0, 0.0) for camera in CAMERAS}  # camera -> (file index, end of the last episode there)
    start = 0
    for episode, frames in enumerate(episodes):
        row: dict[str, Any] = {"episode_index": episode, "tasks": list(dict.fromkeys(frames)), "length": len(frames),
                               "data/chunk_index": 0, "data/file_index": 0, "dataset_from_index": start,
                               "dataset_to_index": start + len(frames)}
        for camera in CAMERAS:
            file_index, end = spans[camera]
            if episode and episode in (new_file_at or {}).get(camera, set()):
                file_index, end = file_index + 1, 0.0
            cut = cuts / f"episode_{episode:06d}" / f"{camera}.mp4"
            target = root / V3_VIDEO.format(video_key=camera, chunk_index=0, file_index=file_index)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                concatenate([target, cut], target)
            else:
                shutil.copy(cut, target)
            row.update({f"videos/{camera}/chunk_index": 0, f"videos/{camera}/file_index": file_index,
                        f"videos/{camera}/from_timestamp": end,
                        f"videos/{camera}/to_timestamp": end + duration_s(cut)})
            spans[camera] = (file_index, end + duration_s(cut))
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
                    "stats/action/mean": [0.0] * STATE})
        for key, value in row.items():
            rows.setdefault(key, []).append(value)
        start += len(frames)
    target = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    target.parent.mkdir(parents=True)
    pq.write_table(pa.table(rows), target)
    target = root / V3_DATA.format(chunk_index=0, file_index=0)
    target.parent.mkdir(parents=True)
    pq.write_table(data_table(episodes, tasks, fps), target)
    tasks_parquet(root / "meta" / "tasks.parquet", tasks)
    return root
