"""A Scene as JSON and back, exactly: how rank 0 of `vaecache index` hands each rank the scenes it probes, so that
only rank 0 reads DATA's tables (a nuScenes root's 1.3 GB of them).

Not the index line (sources.indexing.index_line): that is the scene as a user reads it back (paths resolved again
relative to the index, a frame list keyed `INDEX#scene/camera`, seconds as floats, a probe required), while a
receiving rank needs the very Scene rank 0 holds: its FrameList keys (`ROOT#scene/CAM`) key the probe cache the
partial files hold, and every field comes back equal (tests/sources/test_scene_json.py). JSON, not pickle: the bytes
cross a process boundary, and this project unpickles nothing it did not make in the same process.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from vaecache.sources.jsonl import IndexLineListing
from vaecache.sources.lerobot import EpisodeRows
from vaecache.sources.scene import CameraProbe, FrameMetadata, HeldListing, Listing, Scene
from vaecache.video.frames import FrameList


def scene_to_json(scene: Scene) -> dict[str, Any]:
    """Every field of `scene` as JSON values (scene_from_json reads it back equal)."""
    return {"id": scene.scene_id, "cameras": list(scene.cameras), "paths": list(scene.paths),
            "frame_range": list(scene.frame_range) if scene.frame_range is not None else None,
            "probed": [probe.to_json() for probe in scene.probed] if scene.probed is not None else None,
            "metadata": scene.metadata, "listing": _listing_json(scene.listing), "frame_rate": scene.frame_rate,
            "time_range": list(scene.time_range) if scene.time_range is not None else None}


def scene_from_json(raw: dict[str, Any]) -> Scene:
    """The Scene scene_to_json wrote."""
    where = f"scene {raw['id']!r} from rank 0"
    return Scene(raw["id"], tuple(raw["cameras"]), tuple(raw["paths"]),
                 tuple(raw["frame_range"]) if raw["frame_range"] is not None else None,  # type: ignore[arg-type]
                 tuple(CameraProbe.from_json(probe, where, path) for probe, path in zip(raw["probed"], raw["paths"]))
                 if raw["probed"] is not None else None,
                 raw["metadata"], _listing_from_json(raw["listing"]), raw["frame_rate"],
                 tuple(raw["time_range"]) if raw["time_range"] is not None else None)  # type: ignore[arg-type]


def scenes_to_bytes(scenes: Iterable[Scene]) -> bytearray:
    """Scenes as JSON Lines (UTF-8), one scene a line (a bytearray: a tensor can be made over it without a copy)."""
    out = bytearray()
    for scene in scenes:
        out += json.dumps(scene_to_json(scene), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        out += b"\n"
    return out


def scenes_from_bytes(data: bytes | bytearray) -> Iterator[Scene]:
    """The scenes scenes_to_bytes wrote, one line decoded at a time."""
    start = 0
    while start < len(data):
        end = data.index(b"\n", start)
        yield scene_from_json(json.loads(data[start:end]))
        start = end + 1


def _listing_json(listing: Listing | None) -> dict[str, Any] | None:
    """A Listing by its kind; one this module does not know is a TypeError (teach it here, with a test)."""
    if listing is None:
        return None
    if isinstance(listing, HeldListing):
        lists = listing.frame_lists
        return {"held": {
            "frame_lists": [None if listed is None else
                            {"key": listed.key, "files": list(listed.files),
                             "times_ns": list(listed.times_ns) if listed.times_ns is not None else None}
                            for listed in lists] if lists is not None else None,
            # each camera's text as it is (not parsed and dumped again: the bytes, number formatting included, stay)
            "frame_metadata": list(listing.frame_metadata.per_camera) if listing.frame_metadata is not None else None}}
    if isinstance(listing, IndexLineListing):
        return {"index_line": {"index": listing.index, "offset": listing.offset, "scene_id": listing.scene_id,
                               "names": list(listing.names), "lists_frames": listing.lists_frames}}
    if isinstance(listing, EpisodeRows):
        return {"lerobot_rows": {"root": listing.root, "version": listing.version, "data_file": listing.data_file,
                                 "episode": listing.episode, "cameras": listing.cameras, "fps": listing.fps,
                                 "with_state": listing.with_state}}
    raise TypeError(f"no JSON form for a scene listing of type {type(listing).__name__}")


def _listing_from_json(raw: dict[str, Any] | None) -> Listing | None:
    if raw is None:
        return None
    if "held" in raw:
        held = raw["held"]
        lists = held["frame_lists"]
        metadata = held["frame_metadata"]
        return HeldListing(tuple(None if listed is None else
                                 FrameList(listed["key"], tuple(listed["files"]),
                                           tuple(listed["times_ns"]) if listed["times_ns"] is not None else None)
                                 for listed in lists) if lists is not None else None,
                           FrameMetadata(tuple(metadata)) if metadata is not None else None)
    if "index_line" in raw:
        line = raw["index_line"]
        return IndexLineListing(line["index"], line["offset"], line["scene_id"], tuple(line["names"]),
                                line["lists_frames"])
    rows = raw["lerobot_rows"]
    return EpisodeRows(rows["root"], rows["version"], rows["data_file"], rows["episode"], rows["cameras"],
                       rows["fps"], rows["with_state"])


__all__ = ["scene_from_json", "scene_to_json", "scenes_from_bytes", "scenes_to_bytes"]
