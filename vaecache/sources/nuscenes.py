"""The nuScenes layout: DATA is a nuScenes root (the `v1.0-*` JSON tables beside `samples/` and `sweeps/`).

A scene is a nuScenes scene; its cameras are the six CAM_* channels in the surround order multi-camera driving
models train on (MagicDriveDiT's `view_order`, configs/dataset/Nuscenes.yaml: front-left, front, front-right,
back-right, back, back-left); a camera's frames are every camera sample_data of the scene (keyframes and sweeps,
~12 Hz), as nuscenes-devkit walks them (nuscenes/nuscenes.py, NuScenesExplorer.render_scene_channel: from the
scene's first sample's keyframe of the channel along `next` until it is empty), with their `timestamp`
(microseconds) as frame times: clips are synchronized by time with CAM_FRONT as the reference (--sync timestamps).

Each clip's metadata carries per camera its intrinsics and sensor-to-ego transform (calibrated_sensor), per camera
frame its own ego pose (its sample_data's ego_pose) and token, and the scene's description, log and location.

The tables are read as streams of records (a trainval sample_data.json is ~1 GB): only camera records are kept.
The table schema followed is nuscenes-devkit 1.2.0's (nuscenes/nuscenes.py, docs/schema_nuscenes.md).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from array import array
from pathlib import Path
from typing import Any, Iterator

from vaecache.errors import DatasetError
from vaecache.sources.scene import FrameMetadata, HeldListing, LayoutScenes, Scene, Skipped, SourceOptions
from vaecache.video.frames import FrameList

log = logging.getLogger("vaecache")

VIEW_ORDER = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_RIGHT", "CAM_BACK", "CAM_BACK_LEFT")
REFERENCE_CAMERA = "CAM_FRONT"
TABLES = ("sensor", "calibrated_sensor", "log", "scene", "sample", "sample_data", "ego_pose")
"""The tables read (of the 13 nuscenes-devkit loads)."""
_CHUNK = 1 << 20


def iter_json_array(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON file holding one array of objects, read a megabyte at a time (never the whole file)."""
    try:
        handle = path.open("r", encoding="utf-8")  # a local file, or a UrlPath's object
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the nuScenes table ({exc.strerror or exc})") from None
    token = None  # the last record's, to say where a table stops being readable
    try:
        with handle:
            for record in _records(path, handle):
                token = record.get("token")
                yield record
    except UnicodeDecodeError as exc:
        where = f" (after token {token!r})" if token is not None else ""
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason}){where}") from None


def _records(path: Path, handle: Any) -> Iterator[dict[str, Any]]:
    """iter_json_array's records from an open table."""
    decoder = json.JSONDecoder()
    buffer = handle.read(_CHUNK).lstrip()
    if not buffer.startswith("["):
        raise DatasetError(f"{path}: a nuScenes table must be a JSON array")
    position, done = 1, False
    while True:
        while position < len(buffer) and buffer[position] in " \t\r\n,":
            position += 1
        if position < len(buffer) and buffer[position] == "]":
            return
        try:
            record, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError as exc:
            more = handle.read(_CHUNK)
            if not more:
                if done or position >= len(buffer):
                    raise DatasetError(f"{path}: truncated nuScenes table (no closing ']')") from None
                raise DatasetError(f"{path}: not valid JSON ({exc.msg} at byte {exc.pos})") from None
            buffer, position = buffer[position:] + more, 0
            continue
        if end == len(buffer):  # a number or a record that may go on in the next chunk
            more = handle.read(_CHUNK)
            if more:
                buffer, position = buffer[position:] + more, 0
                continue
            done = True
        if not isinstance(record, dict):
            raise DatasetError(f"{path}: a nuScenes table holds objects, found {record!r:.60}")
        yield record
        position = end


def _need(record: dict[str, Any], keys: tuple[str, ...], table: Path) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        raise DatasetError(f"{table}: a record lacks {', '.join(missing)} (token {record.get('token')!r}); not the "
                           "nuScenes schema")


def _timestamp(record: dict[str, Any], table: Path) -> int:
    """A record's `timestamp`: an integer, in microseconds (the devkit's schema; a string or NaN is refused)."""
    value = record["timestamp"]
    if type(value) is not int or value < 0:
        raise DatasetError(f"{table}: token {record['token']!r} has timestamp {value!r:.40}; it must be an integer "
                           "(microseconds)")
    return value


def _inside(record: dict[str, Any], table: Path) -> str:
    """A record's `filename`, relative to the nuScenes root and inside it (no absolute path, no `..`)."""
    name = record["filename"]
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\")) or "\\" in name
            or any(part in ("", ".", "..") for part in name.split("/")) or ":" in name.split("/")[0]):
        raise DatasetError(f"{table}: token {record['token']!r} has filename {name!r:.80}; it must be a relative path "
                           "inside the nuScenes root (no absolute path, no '..')")
    return name


def table_folder(root: Path, version: str | None) -> Path:
    """ROOT/v1.0-*: the one named by --nuscenes-version, else the only one there."""
    if version is not None:
        folder = root / version
        if not (folder / "scene.json").is_file():
            raise DatasetError(f"{folder}: no nuScenes tables (scene.json) for --nuscenes-version {version}")
        return folder
    found = sorted(p for p in root.glob("v1.0-*") if (p / "scene.json").is_file())
    if len(found) != 1:
        raise DatasetError(f"{root}: holds nuScenes tables {', '.join(p.name for p in found)}; pass "
                           "--nuscenes-version to choose one")
    return found[0]


def read_nuscenes(root: Path, options: SourceOptions) -> LayoutScenes:
    """The scenes of a nuScenes root, each camera a FrameList with its frame times (see the module docstring)."""
    tables = table_folder(root, options.nuscenes_version)
    path = {name: tables / f"{name}.json" for name in TABLES}
    channels: dict[str, str] = {}  # camera sensor token -> channel
    for record in iter_json_array(path["sensor"]):
        _need(record, ("token", "channel", "modality"), path["sensor"])
        if record["modality"] == "camera":
            channels[record["token"]] = record["channel"]
    if not channels:
        raise DatasetError(f"{path['sensor']}: no camera sensor (a record of modality \"camera\"); not a nuScenes "
                           "sensor table")
    calibration: dict[str, tuple[str, dict[str, Any]]] = {}  # calibrated_sensor token -> (channel, parameters)
    for record in iter_json_array(path["calibrated_sensor"]):
        _need(record, ("token", "sensor_token", "translation", "rotation", "camera_intrinsic"),
              path["calibrated_sensor"])
        if record["sensor_token"] in channels:
            calibration[record["token"]] = (channels[record["sensor_token"]], {
                "intrinsic": record["camera_intrinsic"],
                "sensor2ego": {"translation": record["translation"], "rotation": record["rotation"]}})
    if not calibration:
        raise DatasetError(f"{path['calibrated_sensor']}: no calibrated_sensor of a camera sensor (sensor_token of "
                           f"{', '.join(sorted(channels.values()))})")
    logs = {record["token"]: record for record in iter_json_array(path["log"])}
    scenes = list(iter_json_array(path["scene"]))
    for record in scenes:
        _need(record, ("token", "name", "description", "log_token", "first_sample_token"), path["scene"])
    if not scenes:
        raise DatasetError(f"{path['scene']}: no scenes")
    # sample_data: camera records only, and the keyframe of each (sample, channel)
    frames: dict[str, tuple[str, int, str, str, str, bool]] = {}  # token -> next, timestamp, file, pose, cs, key
    keyframes: dict[tuple[str, str], str] = {}
    for record in iter_json_array(path["sample_data"]):
        _need(record, ("token", "sample_token", "ego_pose_token", "calibrated_sensor_token", "timestamp", "filename",
                       "is_key_frame", "next"), path["sample_data"])
        sensor = calibration.get(record["calibrated_sensor_token"])
        if sensor is None:
            continue
        frames[record["token"]] = (record["next"], _timestamp(record, path["sample_data"]),
                                   _inside(record, path["sample_data"]), record["ego_pose_token"],
                                   sys.intern(record["calibrated_sensor_token"]), bool(record["is_key_frame"]))
        if record["is_key_frame"]:
            keyframes[(record["sample_token"], sensor[0])] = record["token"]
    wanted_poses = {entry[3] for entry in frames.values()}
    poses: dict[str, int] = {}  # ego_pose token -> where its translation (3) and rotation (4) start in `values`
    values = array("d")  # a pose as 7 floats, not a dict of two lists (a trainval table has 1.2M camera poses)
    for record in iter_json_array(path["ego_pose"]):
        if record.get("token") in wanted_poses:
            _need(record, ("token", "translation", "rotation"), path["ego_pose"])
            translation, rotation = record["translation"], record["rotation"]
            if (not isinstance(translation, list) or len(translation) != 3 or not isinstance(rotation, list)
                    or len(rotation) != 4):
                raise DatasetError(f"{path['ego_pose']}: ego_pose {record['token']} needs a translation of 3 and a "
                                   "rotation (quaternion) of 4 numbers")
            poses[record["token"]] = len(values)
            if not all(type(v) in (int, float) and math.isfinite(v) for v in (*translation, *rotation)):
                raise DatasetError(f"{path['ego_pose']}: ego_pose {record['token']} has a translation or rotation "
                                   "that is not finite numbers")
            values.extend(translation)
            values.extend(rotation)
    del wanted_poses

    def pose(token: str, frame: str) -> dict[str, list[float]]:
        at = poses.get(token)
        if at is None:  # the devkit's nusc.get('ego_pose', ...) fails on it too
            raise DatasetError(f"{path['ego_pose']}: ego_pose {token!r} (of sample_data {frame}) is not in the table")
        return {"translation": values[at:at + 3].tolist(), "rotation": values[at + 3:at + 7].tolist()}
    camera_frames = len(frames)
    present = sorted({channel for channel, _ in calibration.values()})
    order = tuple(options.cameras) if options.cameras else tuple(c for c in VIEW_ORDER if c in present)
    unknown = [name for name in order if name not in present]
    if unknown:
        raise DatasetError(f"{tables}: camera(s) {', '.join(unknown)} from --cameras are not nuScenes camera channels "
                           f"here ({', '.join(present)})")
    found: list[Scene] = []
    rejected: list[Skipped] = []
    base = str(root.resolve())
    for record in scenes:
        name = record["name"]
        lists: list[FrameList | None] = []
        per_frame: list[str] = []
        cameras_meta: dict[str, Any] = {}
        for channel in order:
            token = keyframes.get((record["first_sample_token"], channel), "")
            files, times, entries = [], [], []
            while token:
                entry = frames.pop(token, None)  # a chain is walked once: its entries are freed as the scene is built
                if entry is None:
                    raise DatasetError(f"{path['sample_data']}: sample_data {token} ({channel} of {name}) is named by "
                                       "`next` but not in the table, or twice")
                files.append(f"{base}/{entry[2]}")
                times.append(entry[1] * 1000)
                entries.append({"sample_data_token": token, "timestamp_us": entry[1], "is_key_frame": entry[5],
                                "ego_pose": pose(entry[3], token)})
                cameras_meta.setdefault(channel, calibration[entry[4]][1])
                token = entry[0]
            lists.append(FrameList(f"{base}#{name}/{channel}", tuple(files), tuple(times)) if files else None)
            per_frame.append(json.dumps(entries, separators=(",", ":")))
        log_record = logs.get(record["log_token"], {})
        metadata = {"nuscenes": {"scene": name, "scene_token": record["token"], "description": record["description"],
                                 "log": log_record.get("logfile"), "location": log_record.get("location"),
                                 "date_captured": log_record.get("date_captured"),
                                 "vehicle": log_record.get("vehicle")},
                    "calibration": cameras_meta}
        paths = tuple(listed.key if listed is not None else None for listed in lists)
        try:
            found.append(Scene(name, order, paths, metadata=json.dumps(metadata, sort_keys=True, separators=(",", ":")),
                               listing=HeldListing(tuple(lists), FrameMetadata(tuple(per_frame)))))
        except DatasetError as exc:
            rejected.append(Skipped(name, None, str(exc)))
    log.info("nuScenes %s: %d scenes, %d camera frames", tables.name, len(found), camera_frames)
    return LayoutScenes(found, [set(order)] if found else [], rejected)


class NuScenesRoot:
    """A nuScenes root: v1.0-*/scene.json beside samples/ and sweeps/."""

    name = "nuscenes"
    reference_camera = REFERENCE_CAMERA

    def matches(self, data: Path) -> bool:
        return data.is_dir() and any((folder / "scene.json").is_file() for folder in data.glob("v1.0-*"))

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        return read_nuscenes(data, options)


NUSCENES = NuScenesRoot()
