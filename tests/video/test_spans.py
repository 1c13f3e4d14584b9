"""One episode of a shared file read by time (vaecache.video.spans): the frames LeRobot picks, and readers shared by
the episodes of a file that are never used closed."""

from __future__ import annotations

import numpy as np

from tests.videos import LAYOUTS, sequential_frames, write_video
from vaecache.video.spans import _SHARED_READERS, EpisodeSpan, SpanReader, span_of


def test_spans_read_their_frames_even_after_their_file_s_reader_was_pushed_out(tmp_path):
    files = [write_video(tmp_path / f"v{i}.mp4", LAYOUTS["h264-open-gop"], frames=12, height=32, width=48)
             for i in range(_SHARED_READERS + 2)]
    spans = [SpanReader(EpisodeSpan(str(path), round(4 * 1e9 / 24), 6, 24.0)) for path in files]
    reference = sequential_frames(files[0])
    got = spans[0].read([0, 1, 5])  # its file's reader was closed when the later ones opened theirs
    assert all(np.array_equal(frame, reference[4 + index]) for frame, index in zip(got, (0, 1, 5)))
    assert span_of(spans[0].path) == spans[0].span and len(spans[0]) == 6


def test_a_rate_is_written_exactly():
    span = EpisodeSpan("/d/file-000.mp4", 5, 3, 30000 / 1001)
    assert span_of(span.reference) == span
    assert span_of("/d/f.mp4#from_ns=1&frames=2&fps=0") is None and span_of("/d/f.mp4") is None
