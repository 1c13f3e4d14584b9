"""A small nuScenes dataset in the official schema (nuscenes-devkit 1.2.0: nuscenes/nuscenes.py loads these 13
tables; docs/schema_nuscenes.md gives their fields): real JPEG frames under samples/ (keyframes, 2 Hz) and sweeps/
(the rest, 12 Hz), each camera's sample_data chained by prev/next per scene, cameras triggered 8 ms apart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from PIL import Image

from tests.videos import frame_pixels

CHANNELS = ("CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_RIGHT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_FRONT_LEFT")
"""Listed as the sensor table lists them (not the surround order vaecache encodes them in)."""
PERIOD_US = 83_333
KEYFRAME_EVERY = 6


def _token(*parts: Any) -> str:
    import hashlib

    return hashlib.md5("/".join(map(str, parts)).encode()).hexdigest()


def write_nuscenes(root: Path, scenes: int = 2, frames: int = 14, drop: dict[tuple[int, str], int] | None = None,
                   version: str = "v1.0-mini", size: tuple[int, int] = (32, 48)) -> Path:
    """`scenes` scenes of `frames` frames per camera; `drop` {(scene, channel): frame} leaves that frame out."""
    drop = drop or {}
    tables: dict[str, list[dict[str, Any]]] = {name: [] for name in (
        "category", "attribute", "visibility", "instance", "sensor", "calibrated_sensor", "ego_pose", "log", "scene",
        "sample", "sample_data", "sample_annotation", "map")}
    (root / "maps").mkdir(parents=True, exist_ok=True)
    Image.new("L", (4, 4)).save(root / "maps" / "mask.png")
    tables["visibility"].append({"token": "1", "level": "v0-40", "description": "visibility of whole object"})
    for c, channel in enumerate(CHANNELS):
        tables["sensor"].append({"token": _token("sensor", channel), "channel": channel, "modality": "camera"})
    tables["sensor"].append({"token": _token("sensor", "LIDAR_TOP"), "channel": "LIDAR_TOP", "modality": "lidar"})
    for s in range(scenes):
        log = _token("log", s)
        logfile = f"n015-2018-07-2{s}-11-22-45+0800"
        tables["log"].append({"token": log, "logfile": logfile, "vehicle": "n015", "date_captured": f"2018-07-2{s}",
                              "location": "singapore-onenorth"})
        start = 1532402927_000000 + s * 100_000_000
        keyframes = list(range(0, frames, KEYFRAME_EVERY))
        samples = [_token("sample", s, k) for k in keyframes]
        for i, k in enumerate(keyframes):
            tables["sample"].append({"token": samples[i], "timestamp": start + k * PERIOD_US,
                                     "scene_token": _token("scene", s), "prev": samples[i - 1] if i else "",
                                     "next": samples[i + 1] if i + 1 < len(samples) else ""})
        tables["scene"].append({"token": _token("scene", s), "name": f"scene-{s + 1:04d}",
                                "description": f"rain, turn right {s}", "log_token": log,
                                "nbr_samples": len(samples), "first_sample_token": samples[0],
                                "last_sample_token": samples[-1]})
        for c, channel in enumerate(CHANNELS):
            calibrated = _token("cs", s, channel)
            tables["calibrated_sensor"].append({
                "token": calibrated, "sensor_token": _token("sensor", channel), "translation": [1.0 + c, 0.0, 1.5],
                "rotation": [0.5, -0.5, 0.5, -0.5], "camera_intrinsic": [[1266.4, 0.0, 816.3], [0.0, 1266.4, 491.5],
                                                                          [0.0, 0.0, 1.0]]})
            shown = [f for f in range(frames) if drop.get((s, channel)) != f]
            tokens = [_token("sd", s, channel, f) for f in shown]
            for i, f in enumerate(shown):
                stamp = start + f * PERIOD_US + 8_000 * CHANNELS_IN_SURROUND.index(channel) + (f % 3) * 1_000
                key = f % KEYFRAME_EVERY == 0
                folder = "samples" if key else "sweeps"
                filename = f"{folder}/{channel}/{logfile}__{channel}__{stamp}.jpg"
                (root / folder / channel).mkdir(parents=True, exist_ok=True)
                Image.fromarray(frame_pixels(f + 3 * c, *size)).save(root / filename, quality=92)
                pose = _token("pose", s, channel, f)
                tables["ego_pose"].append({"token": pose, "timestamp": stamp, "rotation": [1.0, 0.0, 0.0, 0.0],
                                           "translation": [round(0.5 * f, 3), float(s), 0.0]})
                tables["sample_data"].append({
                    "token": tokens[i], "sample_token": samples[min(math.ceil(f / KEYFRAME_EVERY),
                                                                    len(samples) - 1)] if not key
                    else samples[f // KEYFRAME_EVERY],
                    "ego_pose_token": pose, "calibrated_sensor_token": calibrated, "timestamp": stamp,
                    "fileformat": "jpg", "is_key_frame": key, "height": size[0], "width": size[1],
                    "filename": filename, "prev": tokens[i - 1] if i else "",
                    "next": tokens[i + 1] if i + 1 < len(tokens) else ""})
    tables["map"].append({"token": _token("map"), "log_tokens": [r["token"] for r in tables["log"]],
                          "category": "semantic_prior", "filename": "maps/mask.png"})
    (root / version).mkdir(parents=True, exist_ok=True)
    for name, records in tables.items():
        (root / version / f"{name}.json").write_text(json.dumps(records, indent=0))
    return root


CHANNELS_IN_SURROUND = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_RIGHT", "CAM_BACK",
                        "CAM_BACK_LEFT")
