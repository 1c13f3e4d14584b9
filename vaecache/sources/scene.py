"""What every input layout gives: scenes (id, cameras, a path per camera, metadata), what probing a camera
tells (CameraProbe) and judging a scene (SceneProbe), the scenes it refuses (Skipped); and the interface a layout
implements (Layout)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, Sequence

from vaecache.cache.layout import id_problem
from vaecache.errors import DatasetError, UsageError
from vaecache.settings.clip import SyncConfig
from vaecache.sources.probe import CameraProbe
from vaecache.video.frames import FrameList

SINGLE_CAMERA = "video"
"""The camera name of a scene that is one video (a folder of videos, a "path" index line) unless --cameras names it."""


@dataclass(frozen=True, slots=True)
class Scene:
    """One recording: the same moment seen by every camera. Paths are absolute, in camera order; a camera
    the scene lacks has no path (None), and the probe records the scene as skipped."""

    scene_id: str
    cameras: tuple[str, ...]
    paths: tuple[str | None, ...]
    frame_range: tuple[int, int] | None = None
    """[start, stop) of source frames to use; None means the whole video."""
    probed: tuple[CameraProbe, ...] | None = None
    """Per camera, what an index written by `vaecache index` says: the scene is then planned without opening
    a video (decoding checks the frame count and size of what it opens)."""
    metadata: str | None = None
    """The index line's other keys (caption, tags, any JSON) as canonical JSON text, passed through untouched
    into every clip record's `metadata`; None when the line has none. Text keeps a Scene hashable and small."""
    listing: Listing | None = None
    """What the layout lists frame by frame (frame lists, per-frame metadata), held or read back on demand; None:
    nothing (every camera's path is its source)."""
    frame_rate: float | None = None
    """Frames per second of this scene's image-sequence cameras whose frames carry no times (--fps, an index's
    "fps"); None: unknown (videos have their own)."""
    time_range: tuple[int, int] | None = None
    """[start, end) in ns from the first frame (a table's clip boundaries in seconds): the frames whose times fall
    in it are used (sources.probing.frames_in_time), within frame_range where both are given."""

    def __post_init__(self) -> None:
        problem = id_problem(self.scene_id)
        if problem:
            raise DatasetError(f"scene id {self.scene_id!r} is not usable: {problem}")
        if len(self.cameras) != len(self.paths) or not self.cameras:
            raise DatasetError(f"scene {self.scene_id}: needs one path per camera")
        if self.probed is not None and len(self.probed) != len(self.cameras):
            raise DatasetError(f"scene {self.scene_id}: needs one probe per camera")
        if self.time_range is not None and not 0 <= self.time_range[0] < self.time_range[1]:
            raise DatasetError(f"scene {self.scene_id}: a time range needs 0 <= start < end, got "
                               f"[{self.time_range[0] / 1e9:g}, {self.time_range[1] / 1e9:g}) s")
        if self.listing is not None and self.listing.cameras != len(self.cameras):
            raise DatasetError(f"scene {self.scene_id}: needs one frame list (or None) per camera")

    @property
    def frame_lists(self) -> tuple[FrameList | None, ...] | None:
        """Per camera, its frames file by file where the layout lists them (an index's "files", nuScenes); the
        camera's path is then the FrameList's key. None (or a None entry): the path is a video, a frame folder or a
        glob."""
        return self.listing.frame_lists if self.listing is not None else None

    @property
    def frame_metadata(self) -> FrameMetadata | None:
        """Per camera and frame, what a layout knows of each frame (nuScenes: its ego pose): each clip's record
        carries its own frames' entries."""
        return self.listing.frame_metadata if self.listing is not None else None

    def source(self, camera: int) -> str | FrameList | None:
        """What camera `camera` is read from: its FrameList, else its path (None: the scene lacks it)."""
        return source_of(self.listing, self.paths, camera)


def source_of(listing: Listing | None, paths: Sequence[str | None], camera: int) -> str | FrameList | None:
    """Camera `camera`'s FrameList where `listing` lists its frames, else its path."""
    listed = listing.frame_lists if listing is not None and listing.lists_frames else None
    found = listed[camera] if listed is not None else None
    return found if found is not None else paths[camera]


class Listing(Protocol):
    """What a layout lists frame by frame for one scene: held in memory (HeldListing) or read back from where the
    layout keeps it when a clip of the scene is built (an index line: sources.jsonl.IndexLineListing), so that
    planning a dataset of a hundred thousand such scenes holds no per-frame object."""

    @property
    def cameras(self) -> int:
        """How many cameras the scene has."""

    @property
    def lists_frames(self) -> bool:
        """Whether some camera is a FrameList (known without reading the frames)."""

    @property
    def frame_lists(self) -> tuple[FrameList | None, ...] | None: ...

    @property
    def frame_metadata(self) -> FrameMetadata | None: ...

    # A Listing may also have `clip_metadata(frames) -> dict`: what a clip of these reference frames adds to its
    # record's metadata (a LeRobot episode: its frames' tasks and state), computed in the decode worker.


@dataclass(frozen=True, slots=True)
class HeldListing:
    """A Listing held in memory (a layout that reads it anyway: an index line without a probe, nuScenes' tables)."""

    frame_lists: tuple[FrameList | None, ...] | None
    frame_metadata: FrameMetadata | None = None

    @property
    def cameras(self) -> int:
        sizes = {len(self.frame_lists)} if self.frame_lists is not None else set()
        if self.frame_metadata is not None:
            sizes.add(len(self.frame_metadata.per_camera))
        return sizes.pop() if len(sizes) == 1 else -1

    @property
    def lists_frames(self) -> bool:
        return self.frame_lists is not None and any(listed is not None for listed in self.frame_lists)


@dataclass(frozen=True, slots=True)
class FrameMetadata:
    """Per-frame metadata of a scene's cameras, as JSON text per camera (one object per frame): text keeps a Scene
    hashable, and one string per camera costs one object, not one per frame."""

    per_camera: tuple[str, ...]

    def entries(self, camera: int, frames: Sequence[int]) -> list[Any]:
        found = json.loads(self.per_camera[camera])
        return [found[index] for index in frames]


@dataclass(frozen=True, slots=True)
class SceneProbe:
    """What opening a scene's videos told us: usable frames, fps and rotation, or why it is unusable."""

    scene_id: str
    num_frames: int = 0
    fps: float = 0.0
    error: str | None = None
    error_path: str | None = None
    error_camera: str | None = None
    """The camera the error is about (a missing camera has a camera but no path)."""
    rotations: tuple[int, ...] = ()
    """Per camera, the counter-clockwise display rotation (degrees) that decoding applies."""
    cameras: tuple[CameraProbe, ...] = ()
    """Per camera, what was probed (empty for an unusable scene): decoding checks frames and size against it."""
    first: int = 0
    """The first usable frame (of the reference camera with --sync timestamps: where every camera has begun)."""


@dataclass(frozen=True)
class Skipped:
    """A scene (or one of its files) that produced no clip, and why."""

    scene_id: str
    path: str | None
    reason: str
    camera: str | None = None
    incomplete: bool = False
    """The input is damaged part-way (a WebDataset shard whose members stop before its end): what lies past the damage
    is listed nowhere, so no failure record accounts for it (verify --dataset names it)."""


@dataclass(frozen=True)
class Discovery:
    """The scenes found, and the cameras some scenes have that the chosen camera set leaves out."""

    scenes: list[Scene]
    left_out_cameras: dict[str, int] = field(default_factory=dict)
    """Camera name -> number of scenes that have it although it is not encoded."""
    rejected: list[Skipped] = field(default_factory=list)
    """Scenes whose name cannot be a scene id (control characters, '/', a leading '..'): recorded as
    failures, the rest of the dataset goes on."""
    form: str = "cameras"
    """"path" for a single-camera folder or an index of "path" lines, else "cameras" (how `vaecache index`
    writes the scenes back)."""
    reference_camera: str | None = None
    """The layout's reference camera for --sync timestamps (Layout.reference_camera)."""

    def resolved_sync(self, sync: SyncConfig) -> SyncConfig:
        """--sync timestamps with its reference camera named: --sync-reference, else the layout's, else the first of
        the chosen cameras. A --sync-reference that is not one of them, or frame sync of cameras the layout pairs by
        time, is a UsageError."""
        if sync.mode != "timestamps":
            if self.reference_camera is not None and self.scenes:
                raise UsageError(f"the cameras of this dataset are paired by time (reference {self.reference_camera}); "
                                 "pass --sync timestamps")
            return sync
        cameras = self.scenes[0].cameras if self.scenes else ()
        if sync.reference is not None:
            if cameras and sync.reference not in cameras:
                raise UsageError(f"--sync-reference {sync.reference} is not one of the cameras encoded "
                                 f"({', '.join(cameras)})")
            return sync
        reference = self.reference_camera if self.reference_camera in cameras else (cameras[0] if cameras else None)
        return dataclasses.replace(sync, reference=reference)


class LayoutScenes(NamedTuple):
    """What a layout finds in DATA."""

    scenes: list[Scene]
    camera_sets: list[set[str]]
    """Per scene that names its cameras (a multi-camera folder, a "cameras" index line), the names it has:
    `discover` reports cameras left out of the chosen set. Empty for single-camera layouts."""
    rejected: list[Skipped]
    """Scenes whose name cannot be an id: recorded failures, the rest of DATA goes on."""
    reference_camera: str | None = None
    """The camera --sync timestamps takes clip times from by default, where DATA says (else Layout's)."""


@dataclass(frozen=True)
class SourceOptions:
    """What the user says about DATA beyond its path: camera choice and order, the rate of image sequences without
    frame times, the nuScenes version."""

    cameras: tuple[str, ...] | None = None
    """--cameras: which cameras, in which order (None: the layout's own choice and order)."""
    frame_rate: float | None = None
    """--fps: frames per second of image-sequence cameras whose frames carry no times."""
    nuscenes_version: str | None = None
    """--nuscenes-version: which v1.0-* tables of a nuScenes root (None: the only one there)."""
    columns: tuple[tuple[str, str], ...] = ()
    """--column ROLE=NAME: which column of a metadata table plays which role (settings.options.parse_columns)."""
    lerobot_state: bool = False
    """--lerobot-state: each clip record of a LeRobot dataset carries its frames' state/action columns."""
    storage_options: tuple[tuple[str, Any], ...] | None = None
    """--storage-option: the fsspec options DATA at a URL is listed and read with (None: those the process was given
    before, storage.set_data_storage_options)."""

    def __post_init__(self) -> None:
        if self.frame_rate is not None and not 0 < self.frame_rate < math.inf:
            raise UsageError(f"--fps must be a positive number, got {self.frame_rate!r}")


class Layout(Protocol):
    """One way a dataset ships (a folder of scene folders, of videos or of frame folders, a JSONL index, a nuScenes
    root): a module of vaecache.sources, listed in vaecache.sources.discover.LAYOUTS. A layout finds the scenes (id,
    cameras, metadata) and names each camera's source: a video file, a folder or glob of frames, or a FrameList.
    vaecache.sources.probing gives each source its timeline (CameraProbe: frames, rate, size, first and last frame
    time) and vaecache.video.backends.open_camera opens it for reading frames by index in a worker."""

    name: str
    reference_camera: str | None
    """The camera `--sync timestamps` takes its clip times from unless --sync-reference names one (None: the
    first of the chosen cameras)."""

    def matches(self, data: Path) -> bool:
        """Whether DATA (a path that exists) is in this layout."""

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        """DATA's scenes, cameras in options.cameras order where given, else as the layout orders them."""
