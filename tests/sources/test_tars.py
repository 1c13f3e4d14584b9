"""WebDataset tar shards of videos as DATA: samples grouped as webdataset groups them (shards written by webdataset's
own TarWriter and read back by its own WebDataset), videos decoded in place from the tar, latents equal to those of the
same files in a folder, metadata from key.json and key.txt."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from tests.conftest import ENCODE_ARGS, assert_same_tensors, invoke, load_tensors, read_clips, read_failures
from tests.videos import LAYOUTS, write_video
from vaecache.errors import DatasetError
from vaecache.sources.braces import expand_braces, is_brace_pattern
from vaecache.sources.discover import discover
from vaecache.sources.tars import read_samples
from vaecache.video.members import member_of, open_member
from vaecache.video.reader import VideoReader


def test_brace_patterns_expand_as_webdataset_names_shards():
    assert expand_braces("data-{000..002}.tar") == ["data-000.tar", "data-001.tar", "data-002.tar"]
    assert expand_braces("{a,b}/s-{8..10}.tar") == ["a/s-8.tar", "a/s-9.tar", "a/s-10.tar", "b/s-8.tar",
                                                   "b/s-9.tar", "b/s-10.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"] and expand_braces("{x}.tar") == ["{x}.tar"]
    assert is_brace_pattern("s-{0..9}.tar") and not is_brace_pattern("s-{x}.tar")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Four short videos, as a folder of files (two scenes of two cameras, and as single videos)."""
    root = tmp_path_factory.mktemp("tar-videos")
    for scene in ("s000", "s001"):
        for camera, layout in (("front", "h264-open-gop"), ("left", "h264-mkv")):
            suffix = LAYOUTS[layout].suffix
            write_video(root / "rig" / scene / f"{camera}{suffix}", LAYOUTS[layout], frames=18, height=48, width=64)
    return root


def write_shards(clips: Path, out: Path, multi: bool) -> list[Path]:
    """The same videos as WebDataset shards written by webdataset's TarWriter, one sample per shard and scene."""
    out.mkdir(parents=True)
    shards = []
    for number, scene in enumerate(("s000", "s001")):
        shard = out / f"data-{number:06d}.tar"
        with wds.TarWriter(str(shard)) as sink:
            sample = {"__key__": scene, "json": {"caption": f"from json {scene}", "url": f"https://x/{scene}"},
                      "txt": f"a rig drives ({scene})\n"}
            for video in sorted((clips / "rig" / scene).iterdir()):
                if multi:
                    sample[f"{video.stem}{video.suffix}"] = video.read_bytes()
                elif video.stem == "front":
                    sample[video.suffix.lstrip(".")] = video.read_bytes()
            sink.write(sample)
        shards.append(shard)
    return shards


def test_samples_are_grouped_as_webdataset_groups_them(clips, tmp_path):
    shards = write_shards(clips, tmp_path / "shards", multi=True)
    ours = [(s.key, sorted(s.members)) for shard in shards for s in read_samples(shard)]
    theirs = [(sample["__key__"], sorted(k for k in sample if not k.startswith("__")))
              for sample in wds.WebDataset([str(s) for s in shards], shardshuffle=False)]
    assert ours == theirs == [("s000", ["front.mp4", "json", "left.mkv", "txt"]),
                              ("s001", ["front.mp4", "json", "left.mkv", "txt"])]
    member = next(read_samples(shards[0])).members["front.mp4"]
    with open_member(member) as handle:
        assert handle.read() == (clips / "rig" / "s000" / "front.mp4").read_bytes()
    with VideoReader(member.reference) as inside, VideoReader(str(clips / "rig" / "s000" / "front.mp4")) as plain:
        assert len(inside) == len(plain) == 18 and (inside.read(range(18)) == plain.read(range(18))).all()


def test_multi_camera_shards_give_the_latents_of_the_same_files_in_a_folder(clips, tmp_path):
    write_shards(clips, tmp_path / "shards", multi=True)
    pattern = str(tmp_path / "shards" / "data-{000000..000001}.tar")
    for data, out in ((clips / "rig", "folder"), (tmp_path / "shards", "tars"), (pattern, "pattern")):
        result = invoke(["encode", data, "--out", tmp_path / out, *ENCODE_ARGS])
        assert result.exit_code == 0, result.output
    folder = load_tensors(tmp_path / "folder")
    assert len(folder) > 0
    assert_same_tensors(folder, load_tensors(tmp_path / "tars"))
    assert_same_tensors(folder, load_tensors(tmp_path / "pattern"))
    records = read_clips(tmp_path / "tars")
    assert {r["metadata"]["caption"] for r in records} == {"a rig drives (s000)", "a rig drives (s001)"}
    assert records[0]["metadata"]["url"].startswith("https://x/") and records[0]["cameras"] == ["front", "left"]
    assert all(member_of(source) is not None for r in records for source in r["sources"])
    checked = invoke(["verify", tmp_path / "tars", "--dataset", tmp_path / "shards"])
    assert checked.exit_code == 0, checked.output
    os.utime(tmp_path / "shards" / "data-000001.tar", ns=(1, 1))  # a rewritten shard: its clips are stale
    stale = invoke(["verify", tmp_path / "tars", "--dataset", tmp_path / "shards"])
    assert stale.exit_code != 0 and "data-000001.tar#s001.front.mp4" in stale.output


def test_single_video_samples_and_an_index_of_them(clips, tmp_path):
    shards = write_shards(clips, tmp_path / "shards", multi=False)
    scenes = discover(shards[0]).scenes
    assert [(s.scene_id, s.cameras) for s in scenes] == [("s000", ("video",))]
    index = tmp_path / "index.jsonl"
    assert invoke(["index", tmp_path / "shards", "-o", index, "--no-progress"]).exit_code == 0
    lines = [json.loads(line) for line in index.read_text().splitlines()]
    assert [member_of(line["path"]).name for line in lines] == ["s000.mp4", "s001.mp4"]
    assert all(line["probe"]["frames"] == 18 and line["caption"].startswith("a rig drives") for line in lines)
    for data, out in ((tmp_path / "shards", "tars"), (index, "index")):
        assert invoke(["encode", data, "--out", tmp_path / out, *ENCODE_ARGS]).exit_code == 0
    assert_same_tensors(load_tensors(tmp_path / "tars"), load_tensors(tmp_path / "index"))


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_bad_samples_are_recorded_and_the_rest_goes_on(clips, tmp_path):
    video = (clips / "rig" / "s000" / "front.mp4").read_bytes()
    shards = tmp_path / "shards"
    shards.mkdir()
    _tar(shards / "a.tar", {"good.mp4": video, "good.txt": b"fine", "nothing.json": b"{}", "both.mp4": video,
                            "both.cam.mp4": video, "broken.mp4": b"not a video at all", "__meta__": b"x",
                            "bad.mp4": video, "bad.json": b"{not json"})
    result = invoke(["encode", shards, "--out", tmp_path / "out", *ENCODE_ARGS])
    assert result.exit_code == 3, result.output
    assert {r["scene"] for r in read_clips(tmp_path / "out")} == {"good"}
    reasons = {f["scene"]: f["reason"] for f in read_failures(tmp_path / "out")}
    assert "no video member" in reasons["nothing"] and "both a plain video" in reasons["both"]
    assert "not a readable video" in reasons["broken"] and "not valid JSON" in reasons["bad"]
    # the terminal names each skipped input; inspect --failures lists them all, in its JSON too
    assert f"skipped {shards / 'a.tar'}#nothing: the sample holds no video member (json)" in result.output
    listed = invoke(["inspect", tmp_path / "out", "--failures", "--json", tmp_path / "info.json"])
    assert listed.exit_code == 0 and "a.tar#broken.mp4@" in listed.output
    records = json.loads((tmp_path / "info.json").read_text())["failures"]["records"]
    assert sorted(r["scene"] for r in records) == ["bad", "both", "broken", "nothing"]


def test_shard_mistakes_are_one_line_errors(clips, tmp_path):
    write_shards(clips, tmp_path / "shards", multi=True)
    missing = invoke(["encode", str(tmp_path / "shards" / "data-{000000..000003}.tar"), "--out", tmp_path / "o",
                      *ENCODE_ARGS])
    assert missing.exit_code == 2 and "shard" in missing.output and "data-000002.tar does not exist" in missing.output
    (tmp_path / "gz").mkdir()
    gz = tmp_path / "gz" / "x.tar"
    gz.write_bytes(b"\x1f\x8b" + b"\0" * 600)
    with pytest.raises(DatasetError, match="not a readable uncompressed tar"):
        discover(gz)
    truncated = tmp_path / "cut" / "data-000000.tar"
    truncated.parent.mkdir()
    whole = (tmp_path / "shards" / "data-000000.tar").read_bytes()
    scenes = discover(tmp_path / "shards" / "data-000000.tar").scenes
    truncated.write_bytes(whole)
    index = tmp_path / "index.jsonl"
    assert invoke(["index", truncated, "-o", index, "--no-progress"]).exit_code == 0
    stamp = truncated.stat().st_mtime_ns
    truncated.write_bytes(whole[: len(whole) // 3])
    os.utime(truncated, ns=(stamp, stamp))  # the same mtime: only the tar's length gives the damage away
    result = invoke(["encode", index, "--out", tmp_path / "out", *ENCODE_ARGS])
    assert result.exit_code == 1 and scenes  # every clip failed, each naming its member
    assert "the member ends at byte" in result.output


def test_upper_case_shards_keys_with_folders_and_a_pattern_for_verify(clips, tmp_path):
    video = (clips / "rig" / "s000" / "front.mp4").read_bytes()
    shards = tmp_path / "shards"
    shards.mkdir()
    _tar(shards / "A-0.TAR", {"./videos/k1.mp4": video, "./videos/k1.txt": b"one"})
    _tar(shards / "A-1.TAR", {"videos/k2.FRONT.mp4": video})
    assert [s.scene_id for s in discover(shards / "A-0.TAR").scenes] == ["videos~k1"]
    front = discover(shards / "A-1.TAR", ["FRONT"]).scenes[0]
    assert front.cameras == ("FRONT",) and member_of(front.paths[0]).name == "videos/k2.FRONT.mp4"
    result = invoke(["encode", shards / "A-0.TAR", "--out", tmp_path / "out", *ENCODE_ARGS])
    assert result.exit_code == 0, result.output
    pattern = str(shards / "A-{0..0}.TAR")
    checked = invoke(["verify", tmp_path / "out", "--dataset", pattern])
    assert checked.exit_code == 0, checked.output


def _shrink_header(tar: Path, name: str, size: int) -> int:
    """Rewrite member `name`'s header with a smaller size field (a valid checksum): the members after it no longer
    line up with their headers. Returns where the listing now stops (the end of the shrunk member's blocks)."""
    with tarfile.open(tar) as archive:
        info = archive.getmember(name)
    info.size = size
    data = bytearray(tar.read_bytes())
    data[info.offset:info.offset + tarfile.BLOCKSIZE] = info.tobuf(tarfile.USTAR_FORMAT)
    tar.write_bytes(bytes(data))
    return info.offset_data + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def test_a_shard_whose_members_do_not_account_for_its_bytes_is_a_recorded_failure(clips, tmp_path):
    video = (clips / "rig" / "s000" / "front.mp4").read_bytes()
    shards = tmp_path / "shards"
    shards.mkdir()
    members = {"a.mp4": video, "b.mp4": video, "b.txt": b"lost", "c.mp4": video}
    damaged = _tar(shards / "d-0.tar", members)
    stop = _shrink_header(damaged, "b.mp4", 100)  # its listing used to end there, c with it, without a word
    _tar(shards / "d-1.tar", {"e.mp4": video})
    result = invoke(["encode", shards, "--out", tmp_path / "out", *ENCODE_ARGS])
    assert result.exit_code == 3, result.output
    assert {r["scene"] for r in read_clips(tmp_path / "out")} == {"a", "e"}  # the samples before it and other shards
    (failure,) = read_failures(tmp_path / "out")
    assert failure["path"] == str(damaged) and failure["scene"] == "d-0.tar"
    assert f"its members end at byte {stop}" in failure["reason"] and "'b' and any after it" in failure["reason"]
    coverage = invoke(["verify", tmp_path / "out", "--dataset", shards])  # its record accounts for nothing past it
    assert coverage.exit_code == 1, coverage.output
    said = " ".join(coverage.output.split())
    assert f"{damaged}: its members end at byte {stop}" in said and "what lies past the damage is in no clip" in said
    # cut short inside a member, or bytes after the end-of-archive marker: the same record
    cut = _tar(tmp_path / "cut.tar", members)
    cut.write_bytes(cut.read_bytes()[:len(video) + 1536])
    tail = _tar(tmp_path / "tail.tar", members)
    tail.write_bytes(tail.read_bytes() + b"more")
    for shard, why in ((cut, "cut short"), (tail, f"byte {tail.stat().st_size - 4} is neither")):
        found = discover(shard)
        assert [s.scene_id for s in found.scenes] == (["a"] if shard == cut else ["a", "b"])
        assert [(r.scene_id, r.path) for r in found.rejected] == [(shard.name, str(shard))]
        assert why in found.rejected[0].reason


def test_a_damaged_shard_at_a_url_is_found_by_ranged_reads(s3, clips, tmp_path):
    from tests.s3 import make_bucket

    video = (clips / "rig" / "s000" / "front.mp4").read_bytes()
    damaged = _tar(tmp_path / "d.tar", {"a.mp4": video, "b.mp4": video, "c.mp4": video})
    stop = _shrink_header(damaged, "b.mp4", 100)
    make_bucket(s3, "shards")
    s3.pipe_file("shards/d.tar", damaged.read_bytes())
    s3.pipe_file("shards/whole.tar", _tar(tmp_path / "whole.tar", {"e.mp4": video}).read_bytes())
    found = discover("s3://shards/d.tar")
    assert [s.scene_id for s in found.scenes] == ["a"]
    assert [r.path for r in found.rejected] == ["s3://shards/d.tar"]
    assert f"its members end at byte {stop}" in found.rejected[0].reason
    assert not discover("s3://shards/whole.tar").rejected


def test_unusable_captions_and_metadata_are_skipped_samples_naming_the_member(clips, tmp_path, monkeypatch):
    video = (clips / "rig" / "s000" / "front.mp4").read_bytes()
    shard = _tar(tmp_path / "a.tar", {"good.mp4": video, "good.txt": "ünï\n".encode(), "good.json": b'{"n": 1}',
                                      "latin.mp4": video, "latin.txt": "caf\xe9".encode("latin-1"),
                                      "bytes.mp4": video, "bytes.json": b'{"caption": "\xff"}',
                                      "large.mp4": video, "large.txt": b"x" * 4097,
                                      "deep.mp4": video, "deep.json": b"[" * 1500 + b"]" * 1500})
    monkeypatch.setattr("vaecache.sources.tars.MAX_TEXT_MEMBER", 4096)
    found = discover(shard)
    assert [(s.scene_id, json.loads(s.metadata)) for s in found.scenes] == [("good", {"caption": "ünï", "n": 1})]
    reasons = {r.scene_id: (r.path, r.reason) for r in found.rejected}
    assert reasons == {
        "latin": (f"{shard}#latin", "its member latin.txt is not UTF-8 text (byte 3)"),
        "bytes": (f"{shard}#bytes", "its member bytes.json is not UTF-8 text (byte 13)"),
        "large": (f"{shard}#large", "its member large.txt is 4097 bytes, more than a json or txt member may have "
                                    "(4096)"),
        "deep": (f"{shard}#deep", "its json member deep.json is nested too deeply")}


def test_keys_repeated_across_shards_are_qualified_by_their_shard(clips, tmp_path):
    video = (clips / "rig" / "s000" / "front.mp4").read_bytes()
    shards = tmp_path / "shards"
    shards.mkdir()
    for number in range(2):  # a writer that numbers each shard's samples from 0
        _tar(shards / f"part-{number}.tar", {"000000.mp4": video, "000001.json": b"{}", f"only{number}.mp4": video,
                                             "videos/k.mp4": video})
    expected = ["only0", "only1", "part-0.tar~000000", "part-0.tar~videos~k", "part-1.tar~000000",
                "part-1.tar~videos~k"]
    for data in (shards, str(shards / "part-{0..1}.tar"), shards):  # stable across runs and ways of naming DATA
        found = discover(data)
        assert [s.scene_id for s in found.scenes] == expected
        assert sorted(r.scene_id for r in found.rejected) == ["part-0.tar~000001", "part-1.tar~000001"]
    assert [s.scene_id for s in discover(shards / "part-0.tar").scenes] == ["000000", "only0", "videos~k"]
