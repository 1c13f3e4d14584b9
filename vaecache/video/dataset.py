"""The views of a batch, decoded in DataLoader workers: ViewDecoder (one camera of one clip, readers kept
open) and ViewBatchDataset (item i: the views this rank encodes for batch i; failures reported, not raised)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import torch

from vaecache.errors import VideoDecodeError
from vaecache.settings.clip import DEFAULT_MAX_FRAME_PIXELS
from vaecache.video.backends import PYAV, Backend, ForeignReader, open_video
from vaecache.video.reader import VideoReader
from vaecache.video.resize import resize_fit, to_model_range


class ViewDecoder:
    """Decodes one camera of one clip. Keeps a few readers open: a batch often reads one file twice, and
    the next clip of a file continues where the last one stopped."""

    def __init__(self, height: int, width: int, cache_size: int = 8, fit: str = "cover",
                 backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS) -> None:
        self.height, self.width, self.fit, self.backend, self.max_pixels = height, width, fit, backend, max_pixels
        self._readers: OrderedDict[str, VideoReader | ForeignReader] = OrderedDict()
        self._cache_size = cache_size

    def _reader(self, path: str) -> VideoReader | ForeignReader:
        reader = self._readers.pop(path, None)
        if reader is None:
            reader = open_video(path, self.backend, self.max_pixels)
        self._readers[path] = reader
        while len(self._readers) > self._cache_size:
            self._readers.popitem(last=False)[1].close()
        return reader

    def close(self) -> None:
        while self._readers:
            self._readers.popitem()[1].close()

    def timestamps(self, path: str, frames: Sequence[int]) -> list[float]:
        """Presentation time (seconds from the first frame) of each frame of `path`."""
        return self._reader(path).timestamps(frames)

    def frames(self, path: str, frames: Sequence[int]) -> np.ndarray:
        """(T, H, W, 3) uint8 RGB, upright, exactly the frames asked for."""
        try:
            return self._reader(path).read(frames)
        except VideoDecodeError:
            stale = self._readers.pop(path, None)
            if stale is not None:
                stale.close()
            raise

    def check(self, path: str, expect: tuple[int, int, int] | None = None,
              identity: tuple[int, int] | None = None) -> None:
        """Open `path` (VideoDecodeError when it cannot be, or its frames exceed the budget), and refuse it unless
        it has `expect` = (frames, width, height) as planned and, where an index recorded it, `identity` =
        (size, mtime_ns): a file rewritten since it was probed is refused before it is opened, even with the same
        frame count and size."""
        if identity is not None and path not in self._readers:
            check_identity(path, *identity)
        try:
            reader = self._reader(path)
            if expect is not None:
                reader.check_probe(*expect)
        except VideoDecodeError:
            stale = self._readers.pop(path, None)
            if stale is not None:
                stale.close()
            raise

    def decode(self, path: str, frames: Sequence[int], size: tuple[int, int] | None = None) -> torch.Tensor:
        """(C, T, H, W) float in [-1, 1], at `size` (H, W; default the decoder's own)."""
        height, width = size or (self.height, self.width)
        array = self.frames(path, frames)
        tensor = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)
        tensor = to_model_range(resize_fit(tensor, height, width, self.fit))
        return tensor.permute(1, 0, 2, 3).contiguous()


def check_identity(path: str, size: int, mtime_ns: int) -> None:
    """VideoDecodeError naming both values unless `path` still has the size and mtime its probe recorded."""
    import datetime as _dt

    try:
        stat = os.stat(path)
    except OSError:
        return  # opening it names the problem
    if (stat.st_size, stat.st_mtime_ns) == (size, mtime_ns):
        return

    def when(ns: int) -> str:
        return _dt.datetime.fromtimestamp(ns / 1e9, _dt.timezone.utc).isoformat(timespec="microseconds")

    changes = []
    if stat.st_size != size:
        changes.append(f"size {size} -> {stat.st_size} bytes")
    if stat.st_mtime_ns != mtime_ns:
        changes.append(f"modified {when(mtime_ns)} -> {when(stat.st_mtime_ns)}")
    raise VideoDecodeError(path, f"changed since it was probed ({', '.join(changes)}): its frames may not be the "
                                 "ones indexed; run `vaecache index` again")


class ViewBatchDataset(torch.utils.data.Dataset):
    """Item i decodes the views this rank encodes for batch i; failures are reported, not raised.

    An item is {"index", "views" (V, C, T, H, W), "errors": {clip: (path, reason, whole_file)}, "times": {clip:
    seconds of each frame in its first decoded camera, from that video's first frame}} (times: for the clip
    record). `whole_file`: the file itself failed (it does not open, its frames exceed the budget, it is not what
    its probe says: ViewDecoder.check), whatever frames a clip asks for; every later clip of it then fails at once,
    without opening it again, and the caller records its scene once."""

    def __init__(self, batches: Sequence[Sequence[Any]], view_indices: Sequence[Sequence[int]], height: int, width: int,
                 fit: str = "cover", backend: Backend = PYAV, max_pixels: int = DEFAULT_MAX_FRAME_PIXELS) -> None:
        self.batches = [list(b) for b in batches]
        self.view_indices = [list(v) for v in view_indices]
        self.height, self.width, self.fit, self.backend, self.max_pixels = height, width, fit, backend, max_pixels
        self._decoder: ViewDecoder | None = None
        self._condemned: dict[str, str] = {}
        """Path -> why the whole file failed (in this process)."""

    def __len__(self) -> int:
        return len(self.batches)

    def close(self) -> None:
        """Close the videos this process keeps open (decoding with workers 0 opens them here)."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._decoder is None:
            self._decoder = ViewDecoder(self.height, self.width, fit=self.fit, backend=self.backend,
                                        max_pixels=self.max_pixels)
        batch = self.batches[index]
        bucket = getattr(batch[0], "bucket", None)  # a batch never mixes buckets (planning.jobs.batched)
        size = (bucket.height, bucket.width) if bucket is not None else (self.height, self.width)
        # clip-major, camera-minor, as planning.jobs.batch_views lays a batch out (not imported: planning imports
        # sources, which imports this module)
        views = [(clip_index, camera) for clip_index, clip in enumerate(batch) for camera in range(len(clip.cameras))]
        decoded: dict[int, torch.Tensor] = {}
        errors: dict[int, tuple[str, str, bool]] = {}
        times: dict[int, list[float]] = {}
        out = []
        for view_index in self.view_indices[index]:
            clip_index, camera = views[view_index]
            clip = batch[clip_index]
            path = clip.paths[camera]
            if clip_index in errors:
                tensor = None
            elif view_index in decoded:
                tensor = decoded[view_index]
            elif path in self._condemned:
                errors[clip_index] = (path, self._condemned[path], True)
                tensor = None
            else:
                expect, identity = getattr(clip, "expect", ()), getattr(clip, "identity", ())
                tensor = None
                try:
                    self._decoder.check(path, expect[camera] if expect else None,
                                        identity[camera] if identity else None)
                except VideoDecodeError as exc:
                    self._condemned[path] = exc.reason
                    errors[clip_index] = (exc.path, exc.reason, True)
                else:
                    try:
                        tensor = self._decoder.decode(path, clip.frames, size)
                        decoded[view_index] = tensor
                        if clip_index not in times:
                            times[clip_index] = self._decoder.timestamps(path, clip.frames)
                    except VideoDecodeError as exc:
                        errors[clip_index] = (exc.path, exc.reason, False)
                        tensor = None
            out.append(tensor)
        template = next((t for t in out if t is not None), None)
        if template is None:
            template = torch.zeros(3, len(batch[0].frames), *size)
        stacked = torch.stack([t if t is not None else torch.zeros_like(template) for t in out])
        for clip_index in errors:
            times.pop(clip_index, None)
        return {"index": index, "views": stacked, "errors": errors, "times": times}
