"""The decode worker's reader cache: a batch's videos at a URL opened side by side, and a changed one still refused
by name when it is read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.s3 import make_bucket, upload
from vaecache.errors import VideoDecodeError
from vaecache.storage import url_stat
from vaecache.video.dataset import ViewDecoder


def test_videos_at_a_url_open_ahead_together_and_a_changed_one_is_still_refused(s3: Any, demo_data: Path) -> None:
    make_bucket(s3, "ahead")
    url = upload(s3, demo_data, "ahead", "data")
    good, changed, local = f"{url}/scene_000/cam_0.mp4", f"{url}/scene_000/cam_1.mp4", demo_data / "scene_001"
    size, mtime = url_stat(changed)
    decoder = ViewDecoder(64, 64)
    try:
        decoder.open_ahead([(good, url_stat(good), None, None, None), (changed, (size + 1, mtime), None, None, None),
                            (str(local / "cam_0.mp4"), None, None, None, None)])
        assert list(decoder._readers) == [good]  # the local file opens when read; the changed one is not kept
        decoder.check(good, identity=url_stat(good))
        with pytest.raises(VideoDecodeError, match=r"cam_1\.mp4.*size"):
            decoder.check(changed, identity=(size + 1, mtime))
        assert decoder.decode(good, [0, 1]).shape == (3, 2, 64, 64)
    finally:
        decoder.close()


def test_a_changed_file_check_of_an_object_costs_no_request_of_its_own(s3: Any, s3_endpoint: str, demo_data: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.s3 import StoreProxy
    from vaecache.storage import set_data_storage_options

    make_bucket(s3, "one-head")
    url = upload(s3, demo_data, "one-head", "data")
    videos = [f"{url}/scene_000/cam_0.mp4", f"{url}/scene_000/cam_1.mp4", f"{url}/scene_001/cam_0.mp4"]
    identities = [url_stat(video) for video in videos]
    counting = StoreProxy(s3_endpoint, {})
    decoder = ViewDecoder(64, 64)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
        set_data_storage_options({})  # a decode worker's own client: nothing listed, nothing cached
        decoder.open_ahead([(video, identity, None, None, None) for video, identity in zip(videos[:2], identities)])
        decoder.check(videos[2], identity=identities[2])
        for video, identity in zip(videos, identities):
            decoder.check(video, identity=identity)
        assert counting.seen["HEAD"] == 3  # the HEAD each open makes is the check
        with pytest.raises(VideoDecodeError, match=r"cam_0\.mp4: changed since it was probed \(size"):
            ViewDecoder(64, 64).check(videos[0], identity=(identities[0][0] + 1, identities[0][1]))
    finally:
        decoder.close()
        counting.close()
        set_data_storage_options({})


def _open_and_read(video: str, identity: tuple[int, int]) -> str:
    decoder = ViewDecoder(64, 64)
    try:
        decoder.check(video, identity=identity)
        return f"read {decoder.decode(video, [0, 1]).shape[1]} frames"
    except VideoDecodeError as exc:
        return str(exc)
    finally:
        decoder.close()


def test_a_decode_worker_opens_objects_as_listed_without_a_head_and_refuses_a_changed_one(
        s3: Any, s3_endpoint: str, demo_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    from tests.s3 import StoreProxy
    from vaecache.sources.urlpath import UrlPath
    from vaecache.storage import set_data_storage_options

    make_bucket(s3, "as-listed")
    url = upload(s3, demo_data, "as-listed", "data")
    counting = StoreProxy(s3_endpoint, {})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
        set_data_storage_options({})
        assert UrlPath(url).exists()  # the run's listing, as discovery makes it before the workers start
        same, changed = f"{url}/scene_000/cam_0.mp4", f"{url}/scene_000/cam_1.mp4"
        identities = {video: url_stat(video) for video in (same, changed)}
        s3.pipe_file("as-listed/data/scene_000/cam_1.mp4", (demo_data / "scene_001" / "cam_0.mp4").read_bytes())
        before = dict(counting.seen)
        with multiprocessing.get_context("fork").Pool(1) as worker:  # a DataLoader worker is forked so
            assert worker.apply(_open_and_read, (same, identities[same])) == "read 2 frames"
            refused = worker.apply(_open_and_read, (changed, identities[changed]))
            assert refused.endswith("scene_000/cam_1.mp4: changed since it was listed (the store no longer has the "
                                    "version it was planned from): its frames may not be the ones planned; run again")
        assert counting.seen.get("HEAD", 0) == before.get("HEAD", 0)  # size and ETag as listed
        assert counting.seen["GET"] > before.get("GET", 0)
    finally:
        counting.close()
        set_data_storage_options({})


def test_a_held_object_opens_once_without_a_request_and_holding_keeps_to_its_budget(
        s3: Any, s3_endpoint: str, demo_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vaecache.storage as storage
    from tests.s3 import StoreProxy
    from vaecache.sources.probing import probe_file
    from vaecache.sources.urlpath import UrlPath

    make_bucket(s3, "held-once")
    url = upload(s3, demo_data, "held-once", "data")
    video, other = f"{url}/scene_000/cam_0.mp4", f"{url}/scene_001/cam_0.mp4"
    counting = StoreProxy(s3_endpoint, {})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
        storage.set_data_storage_options({})
        assert UrlPath(url).exists()  # the run's listing
        probe_file(video)  # with nothing to hold in (plan, index, verify): nothing is held
        held = storage.HeldObjects()
        probe_file(video, held=held)  # a small video: read whole, and held
        size = held.held_bytes
        assert size == (demo_data / "scene_000" / "cam_0.mp4").stat().st_size
        before = counting.seen.get("GET", 0)
        with storage.open_url(video, held=held) as handle:
            assert handle.read() == (demo_data / "scene_000" / "cam_0.mp4").read_bytes()
        assert counting.seen.get("GET", 0) == before and held.held_bytes == 0  # no request; held once
        with storage.open_url(video, held=held) as handle:
            handle.read()
        assert counting.seen["GET"] == before + 1

        budgeted = storage.HeldObjects(budget=size)
        assert budgeted.hold(video, b"v" * size)
        assert not budgeted.hold(other, b"o")  # over the budget
        budgeted.keep_only([other])
        assert budgeted.held_bytes == 0 and budgeted.hold(other, b"o" * size)  # letting go gives the budget back
    finally:
        storage.set_data_storage_options({})
        counting.close()


def test_episodes_opened_ahead_are_read_on_by_the_thread_that_asked(s3: Any, tmp_path: Path) -> None:
    """Episodes (one file holding many, LeRobot v3.0) at URLs are opened side by side in a pool; each episode's
    reader is its file's shared one, kept per thread. The pool's threads end: their readers become this thread's,
    which reads on with them, instead of staying open where nobody reads them."""
    import threading

    from tests.videos import LAYOUTS, write_video
    from vaecache.storage import set_data_storage_options
    from vaecache.video import spans

    for name in ("a", "b"):
        write_video(tmp_path / "episodes" / f"{name}.mp4", LAYOUTS["h264-open-gop"], frames=24)
    url = upload(s3, tmp_path / "episodes", "episodes", "files")
    episodes = [f"{url}/{name}.mp4#from_ns=0&frames=8&fps=24.0" for name in ("a", "b")]
    set_data_storage_options({})
    decoder = ViewDecoder(64, 64)
    mine = (os.getpid(), threading.get_ident())
    before = set(spans._readers)  # what earlier tests in this process left
    try:
        decoder.open_ahead([(episode, None, None, None, None) for episode in episodes])
        assert list(decoder._readers) == episodes
        assert set(spans._readers) - before <= {mine}  # no pool thread's readers left behind
        assert {f"{url}/a.mp4", f"{url}/b.mp4"} <= set(spans._readers[mine])
        held = dict(spans._readers[mine])
        assert decoder.decode(episodes[0], [0, 1]).shape == (3, 2, 64, 64)
        assert spans._readers[mine][f"{url}/a.mp4"] is held[f"{url}/a.mp4"]  # read on, not opened again
    finally:
        decoder.close()
        set_data_storage_options({})
