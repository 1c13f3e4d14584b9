"""verify's check of the frame index each clip record keeps (`source_timelines`: its source's timeline cut to the
keyframes its frames are decoded from, vaecache.video.timeline.Timeline.for_frames) against the probe OUT keeps of
that source (OUT/probes/rank-*.jsonl): a cut that is not the probe's, cut to the clip's frames, would make every
re-read of the clip (LatentCache.source_frames, decode) seek by another index and take other frames. Plain verify
checks it from OUT alone; `verify --reencode` reads its frames without it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vaecache.cache.layout import PROBES_DIR
from vaecache.cache.store import Store


def probe_files(store: Store, folder: Path) -> list[Path]:
    """The probe records OUT holds (probes/rank-*.jsonl) as local files: in place in a folder, copied into `folder`
    from a URL."""
    pattern = re.compile(rf"{PROBES_DIR}/rank-[0-9]+\.jsonl")
    names = sorted(name for name in store.listing(PROBES_DIR) if pattern.fullmatch(name))
    if store.local:
        return [store.path(name) for name in names]
    copies = []
    for name in names:
        copy = folder / name.rsplit("/", 1)[-1]
        copy.write_bytes(store.read(name))
        copies.append(copy)
    return copies


def probed_timelines(store: Store) -> dict[str, tuple[str, int, int, int]]:
    """Source -> (its probe's timeline text, frame count, size, mtime_ns), for every source OUT's probe records give
    one (a later record wins, as in the probe cache); a line that does not parse is passed over (the cache only saves
    work)."""
    import tempfile

    from vaecache.cache.io import whole_lines

    found: dict[str, tuple[str, int, int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="vaecache-verify-probes-") as folder:
        for file in probe_files(store, Path(folder)):
            try:
                lines = [line for _, line in whole_lines(file)]
            except OSError:
                continue
            for line in lines:
                try:
                    record = json.loads(line)
                    probe = record.get("probe") if isinstance(record, dict) else None
                    if isinstance(probe, dict) and isinstance(probe.get("timeline"), str) \
                            and type(probe.get("frames")) is int and isinstance(record.get("path"), str):
                        found[record["path"]] = (probe["timeline"], probe["frames"], probe.get("size"),
                                                 probe.get("mtime_ns"))
                except ValueError:
                    continue
    return found


class RecordedCuts:
    """Fed each clip record by verify's pass over the clip table (`add`); `finish` fills the check: each camera's cut
    the same as its source's probe cut to the clip's frames, a source OUT keeps no probe of (a run from an index)
    counted as not checked."""

    def __init__(self, store: Store, check: Any) -> None:
        self.store, self.check = store, check
        self._probes: dict[str, tuple[str, int, int, int]] | None = None
        self._unprobed = 0
        self._held: tuple[str, Any] | None = None
        """The last source's probe timeline: a scene's clips come together in the table."""

    def add(self, record: dict[str, Any]) -> None:
        cuts = record.get("source_timelines")
        if not isinstance(cuts, list):
            return
        if self._probes is None:
            self._probes = probed_timelines(self.store)
        cameras, sources = record.get("cameras") or [], record.get("sources") or []
        per_camera = record.get("camera_frames") if isinstance(record.get("camera_frames"), dict) else {}
        identities = record.get("source_identity") if isinstance(record.get("source_identity"), list) else []
        for position, (camera, source, cut) in enumerate(zip(cameras, sources, cuts)):
            if cut is None:
                continue
            probed = self._probes.get(source) if isinstance(source, str) else None
            identity = identities[position] if position < len(identities) else None
            if probed is None or not isinstance(identity, dict) or \
                    (identity.get("size"), identity.get("mtime_ns")) != probed[2:]:
                self._unprobed += 1  # no probe of the file the clip was encoded from (stale: verify --dataset's)
                continue
            frames = per_camera.get(camera) or record.get("frames") or []
            problem = self._problem(source, probed, cut, frames)
            if problem:
                self.check.fail(f"clip {record.get('id')}: camera {camera}: {problem}")
            else:
                self.check.ok()

    def _problem(self, source: str, probed: tuple[str, int, int, int], cut: Any, frames: list[Any]) -> str | None:
        from vaecache.errors import DatasetError
        from vaecache.video.timeline import Timeline

        if "#from_ns=" in source:  # one episode of a file keeps its probe's cut of the file's index as it is
            return None if cut == probed[0] else ("its recorded frame index (source_timelines) is not its source's, "
                                                  "as OUT's probe gives it (the clip table was altered)")
        if self._held is None or self._held[0] != source:
            self._held = (source, Timeline.from_json(probed[0], source, probed[1]))
        try:
            expected = self._held[1].for_frames(int(frames[0]), int(frames[-1])).to_json()
        except (ValueError, TypeError, IndexError, DatasetError):
            return None  # the probe's own timeline is damaged: its reader indexes the video (no cut was kept)
        if cut != expected:
            return ("its recorded frame index (source_timelines) is not its source's, as OUT's probe gives it: a "
                    "re-read of the clip would seek by it and take other frames (the clip table was altered)")
        return None

    def finish(self) -> None:
        if self._unprobed:
            self.check.note = (f"{self._unprobed} recorded cut(s) of sources OUT keeps no probe of (an encode from "
                               "an index) not checked here; verify --reencode reads those clips by their videos")


__all__ = ["RecordedCuts", "probe_files", "probed_timelines"]
