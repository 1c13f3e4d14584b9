"""DATA at a URL walked like a folder (vaecache.sources.urlpath) against a real S3-protocol server process: the
pathlib answers the layouts ask, from one listing, and an object read by name without any listing."""

from __future__ import annotations

import pytest

from tests.s3 import make_bucket
from vaecache.sources.urlpath import UrlPath


@pytest.fixture
def tree(s3) -> str:
    make_bucket(s3, "walked")
    for key, data in (("d/s1/c0.mp4", b"a"), ("d/s1/c1.mp4", b"bb"), ("d/s2/f/0001.jpg", b"ccc"),
                      ("d/s2/f/0002.jpg", b"dddd"), ("d/meta/info.json", b'{"x": 1}'), ("d/.hidden", b"")):
        s3.pipe_file(f"walked/{key}", data)
    return "s3://walked/d"


def test_a_prefix_answers_as_a_folder_would(tree: str) -> None:
    root = UrlPath(tree)
    assert root.exists() and root.is_dir() and not root.is_file() and str(root) == tree
    assert [p.name for p in root.iterdir()] == [".hidden", "meta", "s1", "s2"]
    scene = root / "s1"
    assert scene.is_dir() and [p.name for p in scene.iterdir()] == ["c0.mp4", "c1.mp4"]
    video = scene / "c1.mp4"
    assert video.is_file() and video.stat().st_size == 2 and video.suffix == ".mp4" and video.stem == "c1"
    assert str(video) == f"{tree}/s1/c1.mp4" and video.parent == scene and video.resolve() is video
    assert [str(p) for p in root.glob("*/f/*.jpg")] == [f"{tree}/s2/f/0001.jpg", f"{tree}/s2/f/0002.jpg"]
    assert (root / "meta" / "info.json").read_text() == '{"x": 1}'
    assert not (root / "nothing").exists() and not (root / "s1" / "c0").exists()
    with pytest.raises(NotADirectoryError):
        list(video.iterdir())
    with pytest.raises(FileNotFoundError):
        (root / "s1" / "gone.mp4").stat()


def test_an_object_is_read_by_name_without_a_listing(tree: str) -> None:
    info = UrlPath(tree) / "meta" / "info.json"
    assert info.read_bytes() == b'{"x": 1}' and info._listing._files is None  # nothing listed to read it
    with info.open("r", encoding="utf-8") as text:
        assert text.read() == '{"x": 1}'
    single = UrlPath(f"{tree}/meta/info.json")  # DATA naming one object (an index, a table)
    assert single.is_file() and not single.is_dir() and single.stat().st_size == 8 and single.suffix == ".json"
    assert not UrlPath("s3://walked/empty-prefix").exists()
