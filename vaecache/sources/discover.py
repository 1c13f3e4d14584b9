"""Finding the scenes of DATA: the layout that reads it, then the checks every layout shares (ids unique,
cameras left out of the chosen set reported)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from vaecache.errors import DatasetError
from vaecache.sources.braces import is_brace_pattern
from vaecache.sources.folders import FOLDERS
from vaecache.sources.jsonl import JSONL_INDEX
from vaecache.sources.lerobot import LEROBOT
from vaecache.sources.nuscenes import NUSCENES
from vaecache.sources.scene import Discovery, Layout, Scene, SourceOptions
from vaecache.sources.tables import TABLE
from vaecache.sources.tars import WEBDATASET
from vaecache.urls import is_url

LAYOUTS: tuple[Layout, ...] = (JSONL_INDEX, TABLE, NUSCENES, LEROBOT, WEBDATASET, FOLDERS)
"""Every input layout, asked in this order which one DATA is."""

log = logging.getLogger("vaecache")


def discover(data: Path, cameras: Sequence[str] | None = None, options: SourceOptions | None = None) -> Discovery:
    """Find scenes in DATA with the first layout of LAYOUTS that reads it. Sorted by id.
    `options` (SourceOptions) says more than `cameras`, which it replaces."""
    if options is None:
        options = SourceOptions(cameras=tuple(cameras) if cameras else None)
    if is_url(data):  # object storage: the layouts walk it through UrlPath, from one listing
        from vaecache.sources.urlpath import UrlPath

        data = UrlPath(str(data), storage_options=options.storage_options)  # type: ignore[assignment]
        if not data.exists() and not is_brace_pattern(str(data)):
            raise DatasetError(f"{data}: no objects under this URL")
    else:
        data = Path(data)
        if options.storage_options is not None:  # the objects at URLs a local index or table names: read with them,
            from vaecache.storage import set_data_storage_options  # by a client opened afresh

            set_data_storage_options(dict(options.storage_options))
        if not data.exists() and not is_brace_pattern(str(data)):
            raise DatasetError(f"{data}: dataset path does not exist")
    layout = next((layout for layout in LAYOUTS if layout.matches(data)), None)
    if layout is None:
        raise DatasetError(f"{data}: expected a folder, a .jsonl index or a .csv/.tsv/.parquet table, got a "
                           f"{data.suffix or 'suffix-less'} file")
    scenes, seen, rejected, reference = layout.scenes(data, options)
    form = "cameras" if seen else "path"  # single-camera layouts (a folder of videos, "path" lines) name no sets
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
    return Discovery(sorted(scenes, key=lambda scene: scene.scene_id), left_out, rejected, form,
                     reference or layout.reference_camera)


def discover_scenes(data: Path, cameras: Sequence[str] | None = None,
                    options: SourceOptions | None = None) -> list[Scene]:
    """The scenes of `discover` (cameras left out are logged there)."""
    return discover(data, cameras, options).scenes
