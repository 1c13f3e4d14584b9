"""A clip's sound, cut exactly: the audio stream of a camera's video decoded at its own rate, as FFmpeg decodes it
(the encoder's priming skipped and the container's edit list applied, as `ffmpeg -i X -map 0:a -c:a pcm_f32le`
writes it), and the samples of the clip's window taken by sample index.

The window of a clip is its first frame's presentation time `t_first` (on the container's clock, the video
stream's start and edit list honoured as frame-exact decode honours them) and its duration, the clip's frames over
its frame rate (the rate of its latents: the source's rate over the frame stride). Its first sample is
round((t_first - t_audio_start) * rate), on the audio stream's own clock at its source rate; its length is
int(duration * rate) samples, as LTX-2's trainer counts them (`process_videos.py:_extract_audio`). A window the
track does not cover, and a video without an audio track, raise AudioMissingError naming the file: never silent
zeros."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from vaecache.errors import AudioMissingError
from vaecache.urls import is_url


@dataclass(frozen=True)
class ClipAudio:
    """The samples of one clip's window: (channels, count) float32 at the stream's own rate, in FFmpeg's channel
    order for `layout`."""

    samples: torch.Tensor
    rate: int
    layout: str
    first_sample: int
    """Index of the window's first sample in the decoded track (0: the stream's first sample after priming)."""
    start_s: float
    """The clip's first frame time the window starts at, in seconds on the container's clock."""
    path: str
    camera: str = ""
    """The camera of the clip whose video it is cut from (record_audio), where known."""

    @property
    def duration_s(self) -> float:
        return self.samples.shape[1] / self.rate


@dataclass(frozen=True)
class AudioWindow:
    """Where a clip's sound lies: its first frame's presentation time (exact, on the container's clock) and how many
    seconds it lasts (the clip's frames over the clip's frame rate)."""

    start: Fraction
    duration_s: float

    @classmethod
    def of_clip(cls, start: Fraction, frames: int, clip_rate: float) -> AudioWindow:
        if frames < 1 or not 0 < clip_rate < math.inf:
            raise ValueError(f"a clip window needs frames >= 1 and a positive rate, got {frames} at {clip_rate}")
        return cls(start, frames / clip_rate)


def _open_container(path: str) -> tuple[Any, Any]:
    """(container, the file object it reads or None) for a local video, an object at a URL or a video in a tar."""
    import av

    from vaecache.video.members import member_of, open_member

    member = member_of(path)
    if member is not None:
        handle = open_member(member)
    elif is_url(path):
        from vaecache.storage import open_url

        handle = open_url(path, sequential=True)
    else:
        handle = None
    try:
        return (av.open(handle) if handle is not None else av.open(path)), handle
    except Exception:
        if handle is not None:
            handle.close()
        raise


def has_audio(path: str) -> bool:
    """Whether the video at `path` holds an audio stream (AudioMissingError naming it where it does not open)."""
    import av

    try:
        container, handle = _open_container(path)
    except (av.error.FFmpegError, OSError) as exc:
        raise AudioMissingError(f"{path}: cannot be opened for its audio ({exc})") from None
    try:
        return bool(container.streams.audio)
    finally:
        container.close()
        if handle is not None:
            handle.close()


def cut_audio(path: str, window: AudioWindow) -> ClipAudio:
    """The samples of `window` from the first audio stream of the video at `path`, decoded from its start (each
    sample's index is its count from the stream's first decoded sample, as FFmpeg writes them out) and converted to
    float32 by FFmpeg's own resampler (an integer format gives what `-c:a pcm_f32le` gives). AudioMissingError
    where the video has no audio stream, or its stream does not cover the window: it starts later, ends earlier
    (at the stream's stated duration where the container states one, so an encoder's trailing padding is never
    taken for sound) or decodes to nothing."""
    import av

    try:
        container, handle = _open_container(path)
    except (av.error.FFmpegError, OSError) as exc:
        raise AudioMissingError(f"{path}: cannot be opened for its audio ({exc})") from None
    try:
        if not container.streams.audio:
            raise AudioMissingError(f"{path}: has no audio track")
        stream = container.streams.audio[0]
        rate = int(stream.rate)
        layout = stream.layout.name
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
        count = int(window.duration_s * rate)
        first: int | None = None
        track_start: Fraction | None = None
        taken: list[torch.Tensor] = []
        decoded = 0
        stated = (Fraction(stream.duration) * stream.time_base) if stream.duration else None
        try:
            for frame in _decoded(container, stream, resampler):
                if track_start is None:
                    track_start = Fraction(frame.pts) * frame.time_base if frame.pts is not None else Fraction(0)
                    first = round((window.start - track_start) * rate)
                    if first < 0:
                        raise AudioMissingError(
                            f"{path}: its audio starts at {float(track_start):.6f} s, after the clip's window "
                            f"[{float(window.start):.6f}, {float(window.start) + window.duration_s:.6f}) s")
                assert first is not None
                block = torch.from_numpy(frame.to_ndarray())
                lo, hi = max(first - decoded, 0), min(first + count - decoded, block.shape[1])
                if lo < hi:
                    taken.append(block[:, lo:hi])
                decoded += block.shape[1]
                if decoded >= first + count:
                    break
        except av.error.FFmpegError as exc:
            raise AudioMissingError(f"{path}: its audio does not decode ({exc})") from None
        if track_start is None or first is None:
            raise AudioMissingError(f"{path}: its audio track decodes to no samples")
        available = decoded
        if stated is not None:
            available = min(available, round(stated * rate))
        if first + count > available:
            end = float(track_start) + available / rate
            raise AudioMissingError(
                f"{path}: its audio ends at {end:.6f} s, before the end of the clip's window "
                f"[{float(window.start):.6f}, {float(window.start) + window.duration_s:.6f}) s")
        samples = torch.cat(taken, dim=1) if taken else torch.zeros(len(stream.layout.channels), 0)
        return ClipAudio(samples.contiguous(), rate, layout, first, float(window.start), path)
    finally:
        container.close()
        if handle is not None:
            handle.close()


def _decoded(container: Any, stream: Any, resampler: Any) -> Any:
    """The stream's frames in float32 planar, FFmpeg's conversion, in decode order."""
    for frame in container.decode(stream):
        yield from resampler.resample(frame)
    yield from resampler.resample(None)


class AudioSources:
    """What the clips of one video ask of it again and again, asked once: whether it holds an audio stream, and its
    frames' presentation times (an index of its packets). An audio embed keeps one for its clips; the last
    `videos` videos are kept."""

    def __init__(self, videos: int = 8) -> None:
        from collections import OrderedDict

        self.videos = videos
        self._sound: dict[str, bool] = {}
        self._times: OrderedDict[str, list[Fraction]] = OrderedDict()
        self._episodes: OrderedDict[str, list[int]] = OrderedDict()

    def has_audio(self, path: str) -> bool:
        if path not in self._sound:
            self._sound[path] = has_audio(path)
        return self._sound[path]

    def file_frame(self, span: Any, index: int) -> int:
        """The frame of the file that frame `index` of a LeRobot episode (vaecache.video.spans.EpisodeSpan) is: the
        one of nearest time, as the episode's reader picks it."""
        from vaecache.video.spans import SpanReader

        frames = self._episodes.pop(span.reference, None)
        if frames is None:
            frames = SpanReader(span).file_frames()
        self._episodes[span.reference] = frames
        while len(self._episodes) > self.videos:
            self._episodes.popitem(last=False)
        return frames[index]

    def frame_time(self, path: str, index: int) -> Fraction:
        times = self._times.pop(path, None)
        if times is None:
            from vaecache.video.reader import VideoReader

            with VideoReader(path) as video:
                times = [video.frame_time(frame) for frame in range(len(video))]
        self._times[path] = times
        while len(self._times) > self.videos:
            self._times.popitem(last=False)
        return times[index]


def record_audio(record: dict[str, Any], frame_stride: int = 1, camera: str | None = None,
                 sources: AudioSources | None = None) -> ClipAudio:
    """The sound of the clip a cache's record describes (what LatentCache.source_audio gives): from `camera`'s video
    (default: the first camera whose video has an audio track), the window of its own frames (`camera_frames` with
    --sync timestamps) at the clip's rate (the record's fps over `frame_stride`). A source changed since the clip was
    encoded raises SourceChangedError; an image sequence, no track or one that does not cover the window,
    AudioMissingError naming the file. One episode of a file (a LeRobot v3 camera file) is cut from the file's track
    from the time of the file frame its first frame is. `sources`: what earlier clips of the same videos found (a new
    one where not given)."""
    from vaecache.cache.provenance import identity_change, source_identity
    from vaecache.errors import SourceChangedError
    from vaecache.video.frames import is_image_source
    from vaecache.video.spans import file_of, span_of

    sources = sources if sources is not None else AudioSources()
    cameras, paths = list(record["cameras"]), list(record["sources"])
    if camera is not None and camera not in cameras:
        raise KeyError(f"clip {record['id']} has no camera {camera!r} (cameras: {', '.join(cameras)})")
    files = record.get("frame_files") if isinstance(record.get("frame_files"), dict) else {}
    chosen = [cameras.index(camera)] if camera is not None else list(range(len(cameras)))
    videos = [c for c in chosen if not files.get(cameras[c]) and not is_image_source(paths[c])]
    position = next((c for c in videos if sources.has_audio(file_of(paths[c]))), None)
    if position is None:
        raise AudioMissingError(f"{', '.join(str(paths[c]) for c in chosen)}: no audio track "
                                f"(clip {record['id']}{', an image sequence' if not videos else ''})")
    path = paths[position]
    recorded = (record.get("source_identity") or [None] * len(cameras))[position]
    if recorded:
        change = identity_change(recorded, source_identity(path, bool(recorded.get("sha256"))))
        if change is not None:
            raise SourceChangedError(f"{path} ({cameras[position]} of clip {record['id']}): {change} since it was "
                                     "encoded; its latents no longer match it")
    frames = (record.get("camera_frames") or {}).get(cameras[position]) or record["frames"]
    span = span_of(path)
    if span is not None:  # an episode of a file: its first frame's time in the file, on the file's track
        start = sources.frame_time(span.path, sources.file_frame(span, frames[0]))
    else:
        start = sources.frame_time(path, frames[0])
    sound = cut_audio(file_of(path), AudioWindow.of_clip(start, len(frames), float(record["fps"]) / frame_stride))
    return dataclasses.replace(sound, camera=cameras[position])

