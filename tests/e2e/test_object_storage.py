"""DATA and OUT in object storage, end to end against a real S3-protocol server process: videos read from s3://
encode to the same latents as the same videos on disk, the sources are recorded by URL, a changed object is caught
on resume, and a bad object is a skipped input naming its URL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ENCODE_ARGS, assert_same_tensors, invoke, load_tensors, read_clips, read_failures
from tests.s3 import download, make_bucket, upload


def _without_provenance(records: list[dict]) -> list[dict]:
    provenance = ("sources", "source_identity", "source_timelines", "shard")
    return [{k: v for k, v in record.items() if k not in provenance} for record in records]


def test_an_encode_from_s3_to_s3_equals_the_encode_on_disk(s3, demo_data: Path, good_cache: Path,
                                                             tmp_path: Path) -> None:
    data = upload(s3, demo_data, "s3-to-s3", "videos")
    out = "s3://s3-to-s3/cache"
    result = invoke(["encode", data, "--out", out, *ENCODE_ARGS, "--workers", "1"])
    assert result.exit_code == 0, result.output
    copy = download(s3, out, tmp_path / "copy")
    assert_same_tensors(load_tensors(copy), load_tensors(good_cache))
    records = read_clips(copy)
    assert _without_provenance(records) == _without_provenance(read_clips(good_cache))
    assert records[0]["sources"] == [f"{data}/scene_000/cam_0.mp4", f"{data}/scene_000/cam_1.mp4"]
    info = s3.info("s3-to-s3/videos/scene_000/cam_0.mp4")
    assert records[0]["source_identity"][0]["size"] == info["size"]
    assert invoke(["verify", out]).exit_code == 0

    again = invoke(["encode", data, "--out", out, *ENCODE_ARGS])
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    s3.pipe_file("s3-to-s3/videos/scene_001/cam_1.mp4", s3.cat_file("s3-to-s3/videos/scene_002/cam_1.mp4") + b"x")
    changed = invoke(["encode", data, "--out", out, *ENCODE_ARGS])
    assert changed.exit_code == 2
    assert f"{data}/scene_001/cam_1.mp4: size" in changed.output


def test_the_first_batch_decodes_the_videos_probing_read_whole_without_reading_them_again(
        s3, s3_endpoint: str, demo_data: Path, good_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import Counter

    from tests.s3 import StoreProxy

    data = upload(s3, demo_data, "held", "videos")
    counting = StoreProxy(s3_endpoint, {})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
        result = invoke(["encode", data, "--out", tmp_path / "out", *ENCODE_ARGS, "--workers", "1"])
    finally:
        counting.close()
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(tmp_path / "out"), load_tensors(good_cache))
    reads = Counter(path.split("?")[0].removeprefix("/held/videos/") for method, path in counting.paths
                    if method == "GET" and path.endswith(".mp4"))
    assert reads == {"scene_000/cam_0.mp4": 1, "scene_000/cam_1.mp4": 1,  # probed; the worker's first batch
                     "scene_001/cam_0.mp4": 2, "scene_001/cam_1.mp4": 2, "scene_002/cam_0.mp4": 2,
                     "scene_002/cam_1.mp4": 2}


def test_a_bad_object_is_a_skipped_input_naming_its_url(s3, demo_data: Path, tmp_path: Path) -> None:
    data = upload(s3, demo_data, "bad-object", "videos")
    s3.pipe_file("bad-object/videos/scene_001/cam_0.mp4", b"not a video at all")
    out = tmp_path / "out"
    result = invoke(["encode", data, "--out", out, *ENCODE_ARGS])
    assert result.exit_code == 3, result.output
    failures = read_failures(out)
    assert [(f["scene"], f["path"]) for f in failures] == [("scene_001", f"{data}/scene_001/cam_0.mp4")]
    assert "not a readable video" in failures[0]["reason"]
    assert len(read_clips(out)) == 2
    into_s3 = invoke(["encode", data, "--out", "s3://bad-object/cache", *ENCODE_ARGS])  # the failure log as an object
    assert into_s3.exit_code == 3, into_s3.output
    listed = invoke(["inspect", "s3://bad-object/cache", "--failures"])
    assert listed.exit_code == 0 and f"skipped {data}/scene_001/cam_0.mp4 (cam_0): not a readable video" in \
        listed.output, listed.output


def test_what_data_at_a_url_cannot_be_is_one_line(s3, demo_data: Path, tmp_path: Path) -> None:
    make_bucket(s3, "empty-data")
    nothing = invoke(["encode", "s3://empty-data/none", "--out", tmp_path / "a", *ENCODE_ARGS])
    assert nothing.exit_code == 2 and "s3://empty-data/none: no objects under this URL" in nothing.output
    data = upload(s3, demo_data, "decoders", "videos")
    decord = invoke(["encode", data, "--out", tmp_path / "b", *ENCODE_ARGS, "--decoder", "decord"])
    if "decord" in decord.output and "not installed" in decord.output:
        pytest.skip("decord is not installed here")
    assert decord.exit_code == 1, decord.output
    assert "cannot read a video inside a tar, one episode of a file or an object at a URL" in decord.output


@pytest.mark.parametrize("form", ["jsonl", "csv", "parquet"])
def test_an_index_or_table_at_a_url_resolves_its_paths_against_its_own_url(s3, demo_data: Path, good_cache: Path,
                                                                            tmp_path: Path, form: str) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = f"index-{form}"
    videos = upload(s3, demo_data, bucket, "set/videos")
    scenes = sorted(p.name for p in demo_data.iterdir())
    if form == "jsonl":
        lines = [{"id": scene, "cameras": {cam: f"videos/{scene}/{cam}.mp4" for cam in ("cam_0", "cam_1")}}
                 for scene in scenes]
        s3.pipe_file(f"{bucket}/set/index.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode())
        data, cameras = f"s3://{bucket}/set/index.jsonl", []
    else:
        rows = {"path": [f"videos/{scene}/cam_0.mp4" for scene in scenes], "id": scenes}
        if form == "csv":
            text = "path,id\n" + "".join(f"{p},{i}\n" for p, i in zip(rows["path"], rows["id"]))
            s3.pipe_file(f"{bucket}/set/clips.csv", text.encode())
        else:
            local = tmp_path / "clips.parquet"
            pq.write_table(pa.table(rows), local)
            s3.put_file(str(local), f"{bucket}/set/clips.parquet")
        data, cameras = f"s3://{bucket}/set/clips.{form}", ["--cameras", "cam_0"]
    out = tmp_path / "out"
    result = invoke(["encode", data, "--out", out, *ENCODE_ARGS, *cameras])
    assert result.exit_code == 0, result.output
    records = read_clips(out)
    assert records[0]["sources"][0] == f"{videos}/scene_000/cam_0.mp4"
    mine, reference = load_tensors(out), load_tensors(good_cache)
    if form == "jsonl":
        assert_same_tensors(mine, reference)
    else:  # one camera: the first view of the two-camera cache's clips
        import torch

        assert sorted(mine) == sorted(reference)
        for name in mine:
            assert torch.equal(mine[name][0], reference[name][0]), name


def test_inspect_and_export_read_a_cache_at_a_url_as_they_read_it_on_disk(s3, good_cache: Path,
                                                                          tmp_path: Path) -> None:
    import json

    url = upload(s3, good_cache, "inspected")
    for where, target in ((good_cache, tmp_path / "local.json"), (url, tmp_path / "remote.json")):
        result = invoke(["inspect", where, "--json", target, "--clips"])
        assert result.exit_code == 0, result.output
    local, remote = (json.loads((tmp_path / name).read_text()) for name in ("local.json", "remote.json"))
    assert remote["out"] == url and remote.pop("out") and local.pop("out")
    assert remote == local
    one = invoke(["inspect", url, "--clip", local["clip_ids"][0]])
    assert one.exit_code == 0 and f"clip {local['clip_ids'][0]}" in one.output
    for where, name in ((good_cache, "local"), (url, "remote")):  # decode: the same clip, the same scores
        result = invoke(["decode", where, "--clip", local["clip_ids"][0], "-o", tmp_path / f"{name}.mp4",
                         "--json", tmp_path / f"{name}-decode.json"])
        assert result.exit_code == 0, result.output
    local_decode, remote_decode = (json.loads((tmp_path / f"{name}-decode.json").read_text())
                                   for name in ("local", "remote"))
    assert remote_decode["out"] == url and remote_decode["cameras"] == local_decode["cameras"]

    for form in ("webdataset", "musubi"):
        mine, theirs = tmp_path / f"{form}-remote", tmp_path / f"{form}-local"
        for cache, target in ((url, mine), (good_cache, theirs)):
            result = invoke(["export", cache, "--format", form, "--out", target, "--verify", "sha256",
                             *(["--energon", "off"] if form == "webdataset" else [])])
            assert result.exit_code == 0, result.output
        files = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(mine) for p in mine.rglob("*") if p.is_file())
        for name in files:
            if name.name not in ("export.json", "videos.jsonl") and name.suffix != ".toml":  # name the target
                assert (mine / name).read_bytes() == (theirs / name).read_bytes(), name
        assert json.loads((mine / "export.json").read_text())["source"]["cache"] == url


@pytest.mark.parametrize("form", ["folder", "braces"])
def test_webdataset_shards_at_a_url_are_read_in_place(s3, demo_data: Path, good_cache: Path, tmp_path: Path,
                                                      form: str) -> None:
    import webdataset as wds

    shards = tmp_path / "shards"
    shards.mkdir()
    scenes = sorted(p.name for p in demo_data.iterdir())
    for number, scene in enumerate(scenes):
        with wds.TarWriter(str(shards / f"data-{number:06d}.tar")) as sink:
            sink.write({"__key__": scene, **{f"{cam}.mp4": (demo_data / scene / f"{cam}.mp4").read_bytes()
                                              for cam in ("cam_0", "cam_1")}})
    bucket = f"tars-{form}"
    url = upload(s3, shards, bucket, "shards")
    data = url if form == "folder" else f"{url}/data-{{000000..{len(scenes) - 1:06d}}}.tar"
    out = tmp_path / "out"
    result = invoke(["encode", data, "--out", out, *ENCODE_ARGS])
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(out), load_tensors(good_cache))
    source = read_clips(out)[0]["sources"][0]
    assert source.startswith(f"{url}/data-000000.tar#scene_000.cam_0.mp4@")


def test_an_index_of_data_at_a_url_names_the_objects_and_encodes_like_the_url(s3, s3_endpoint: str, demo_data: Path,
                                                                               good_cache: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    data = upload(s3, demo_data, "indexed", "videos")
    index = tmp_path / "data.jsonl"
    made = invoke(["index", data, "-o", index, "--no-progress"])
    assert made.exit_code == 0, made.output
    lines = [json.loads(line) for line in index.read_text().splitlines()]
    assert lines[0]["cameras"]["cam_0"] == f"{data}/scene_000/cam_0.mp4" and "probe" in lines[0]
    out = tmp_path / "out"
    encoded = invoke(["encode", index, "--out", out, *ENCODE_ARGS])
    assert encoded.exit_code == 0, encoded.output
    assert_same_tensors(load_tensors(out), load_tensors(good_cache))

    # --storage-option reaches the objects a local index names (here the endpoint, the environment's is elsewhere),
    # by a client opened afresh: not the one this process opened before for another endpoint
    from vaecache.storage import set_data_storage_options

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    set_data_storage_options({})  # as a new process starts: no client for DATA's objects yet
    elsewhere = invoke(["encode", index, "--out", tmp_path / "with-options", *ENCODE_ARGS,
                        "--storage-option", f"endpoint_url={s3_endpoint}"])
    assert elsewhere.exit_code == 0, elsewhere.output
    assert_same_tensors(load_tensors(tmp_path / "with-options"), load_tensors(good_cache))


def test_hash_sources_streams_each_object_for_its_sha256(s3, demo_data: Path, tmp_path: Path) -> None:
    import hashlib

    data = upload(s3, demo_data, "hashed", "videos")
    out = tmp_path / "out"
    result = invoke(["encode", data, "--out", out, *ENCODE_ARGS, "--hash-sources"])
    assert result.exit_code == 0, result.output
    record = read_clips(out)[0]
    expected = hashlib.sha256((demo_data / "scene_000" / "cam_0.mp4").read_bytes()).hexdigest()
    assert record["source_identity"][0]["sha256"] == expected


def test_pixel_loss_targets_and_decoder_come_from_a_cache_at_a_url(s3, demo_data: Path, good_cache: Path) -> None:
    import torch

    from vaecache import LatentCache, PixelDecoder

    data = upload(s3, demo_data, "pixels", "videos")
    out = "s3://pixels/cache"
    assert invoke(["encode", data, "--out", out, *ENCODE_ARGS]).exit_code == 0
    remote, local = LatentCache(out), LatentCache(good_cache)
    assert torch.equal(remote.source_frames(0), local.source_frames(0))  # the frames read back from the objects
    decoder = PixelDecoder.from_cache(out, checkpoint=False)
    with torch.no_grad():
        frames = decoder(remote[0].mean[:1])
        reference = PixelDecoder.from_cache(good_cache, checkpoint=False)(local[0].mean[:1])
    assert torch.equal(frames, reference)


def test_a_lerobot_dataset_at_a_url_encodes_like_the_same_dataset_on_disk(s3, tmp_path: Path) -> None:
    from tests.sources.lerobot_fixture import write_lerobot
    from tests.sources.test_lerobot import ENCODE, EPISODES

    local = write_lerobot(tmp_path / "v3", EPISODES, new_file_at={"observation.images.wrist": {2}})
    url = upload(s3, local, "robot-fleet", "datasets/v3")
    for data, out in ((local, tmp_path / "from-disk"), (url, tmp_path / "from-s3")):
        result = invoke(["encode", data, "--out", out, *ENCODE, "--lerobot-state"])
        assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(tmp_path / "from-s3"), load_tensors(tmp_path / "from-disk"))
    mine, theirs = read_clips(tmp_path / "from-s3"), read_clips(tmp_path / "from-disk")
    assert _without_provenance(mine) == _without_provenance(theirs)  # tasks, state and action rows included
    assert mine[0]["sources"][0].startswith(f"{url}/videos/observation.images.top/chunk-000/file-000.mp4#from_ns=")


def test_verify_dataset_re_plans_data_at_a_url_and_names_a_changed_object(s3, demo_data: Path,
                                                                          tmp_path: Path) -> None:
    data = upload(s3, demo_data, "replanned", "videos")
    out = tmp_path / "out"
    assert invoke(["encode", data, "--out", out, *ENCODE_ARGS]).exit_code == 0
    same = invoke(["verify", out, "--dataset", data])
    assert same.exit_code == 0, same.output
    s3.pipe_file("replanned/videos/scene_002/cam_0.mp4", s3.cat_file("replanned/videos/scene_002/cam_0.mp4") + b"x")
    changed = invoke(["verify", out, "--dataset", data])
    assert changed.exit_code == 1
    assert f"{data}/scene_002/cam_0.mp4" in changed.output and "size" in changed.output


def test_image_sequence_cameras_at_a_url_give_the_latents_of_the_same_frames_on_disk(s3, tmp_path: Path) -> None:
    from tests.e2e.test_image_sequences import RIG, _rig

    images, _ = _rig(tmp_path)
    url = upload(s3, images, "frames", "rig")
    common = ("--vae", "builtin:tiny", *RIG, "--fps", "10", "--workers", "1", "--no-progress")
    for data, out in ((images, tmp_path / "from-disk"), (url, tmp_path / "from-s3")):
        result = invoke(["encode", data, "--out", out, *common, "--hash-sources"])
        assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(tmp_path / "from-s3"), load_tensors(tmp_path / "from-disk"))
    mine, theirs = read_clips(tmp_path / "from-s3")[0], read_clips(tmp_path / "from-disk")[0]
    assert mine["frame_files"]["cam_0"][0] == f"{url}/s0/cam_0/0000.png"
    assert mine["source_identity"][0]["size"] == theirs["source_identity"][0]["size"]
    assert mine["source_identity"][0]["sha256"] == theirs["source_identity"][0]["sha256"]
    assert invoke(["verify", tmp_path / "from-s3", "--dataset", url]).exit_code == 0


def test_a_nuscenes_root_at_a_url_encodes_like_the_root_on_disk(s3, tmp_path: Path) -> None:
    from tests.sources.nuscenes_fixture import write_nuscenes
    from tests.sources.test_nuscenes import ENCODE as NUSCENES

    root = write_nuscenes(tmp_path / "nuscenes", drop={(1, "CAM_BACK"): 8})
    url = upload(s3, root, "nuscenes", "v1")
    for data, out in ((root, tmp_path / "from-disk"), (url, tmp_path / "from-s3")):
        result = invoke(["encode", data, "--out", out, "--vae", "builtin:tiny", *NUSCENES, "--workers", "0",
                         "--no-progress"])
        assert result.exit_code == 3, result.output  # one clip crosses the dropped frame, on disk as at the URL
    assert_same_tensors(load_tensors(tmp_path / "from-s3"), load_tensors(tmp_path / "from-disk"))
    mine, theirs = read_clips(tmp_path / "from-s3"), read_clips(tmp_path / "from-disk")
    assert [r["metadata"] for r in mine] == [r["metadata"] for r in theirs]  # calibration and ego poses


def test_plan_reads_data_at_a_url_as_encode_does(s3, demo_data: Path) -> None:
    import json

    data = upload(s3, demo_data, "planned", "videos")
    result = invoke(["plan", data, "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--no-measure",
                     "--json", "-"])
    assert result.exit_code == 0, result.output
    groups = json.loads(result.stdout)["ranks"]["dp_groups"]
    assert [group["clip_ids"] for group in groups] == [[f"scene_00{i}/000000-000008" for i in range(3)]]


def test_an_object_changed_after_the_listing_is_not_read_as_the_listed_one(s3, demo_data: Path) -> None:
    from vaecache.errors import VideoDecodeError
    from vaecache.sources.urlpath import UrlPath
    from vaecache.storage import url_stat
    from vaecache.video.reader import VideoReader

    data = upload(s3, demo_data, "changed-later", "videos")
    video = f"{data}/scene_000/cam_0.mp4"
    assert UrlPath(data).exists()  # this run's listing: sizes, mtimes and ETags
    listed = url_stat(video)
    s3.pipe_file("changed-later/videos/scene_000/cam_0.mp4", (demo_data / "scene_001" / "cam_1.mp4").read_bytes())
    assert url_stat(video) == listed  # identity as listed: the run plans from one consistent view
    with pytest.raises(VideoDecodeError, match="scene_000/cam_0.mp4: changed since it was listed"):
        VideoReader(video)  # S3 answers the read on the listed ETag with 412: never the other bytes


def test_a_long_video_at_a_url_is_read_in_ranges_and_encodes_like_the_file_on_disk(s3, s3_endpoint: str,
                                                                                    tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch
                                                                                    ) -> None:
    """One 480-frame video holding 53 clips of 9 frames, indexed (`vaecache index` records its timeline: the bytes
    opening it reads, its keyframes and their GOPs' bytes): the encode of the index opens nothing to probe, its decode
    worker reads ranges of the object (its header and index, then each batch's GOPs), and the latents are those of
    the same file on disk, bit for bit."""
    from tests.s3 import StoreProxy
    from tests.videos import LAYOUTS, write_video

    local = tmp_path / "data"
    local.mkdir()
    write_video(local / "long.mp4", LAYOUTS["h264-open-gop"], frames=480, height=64, width=64)
    args = (*ENCODE_ARGS, "--workers", "1", "--batch-size", "4")
    on_disk = invoke(["encode", local, "--out", tmp_path / "disk", *args])
    assert on_disk.exit_code == 0, on_disk.output
    data = upload(s3, local, "ranged", "videos")
    index = tmp_path / "index.jsonl"
    assert invoke(["index", data, "-o", index, "--no-progress"]).exit_code == 0
    from vaecache.video.timeline import Timeline

    timeline = Timeline.from_json(json.loads(index.read_text())["probe"]["timeline"], "index")
    assert timeline.head and timeline.pts_rule == (0, 512, 480)
    counting = StoreProxy(s3_endpoint, {})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", counting.endpoint)
        result = invoke(["encode", index, "--out", tmp_path / "url", *args])
    finally:
        counting.close()
    assert result.exit_code == 0, result.output
    assert len(read_clips(tmp_path / "url")) == 53
    assert_same_tensors(load_tensors(tmp_path / "url"), load_tensors(tmp_path / "disk"))
    ranges = [path for method, path in counting.paths if method == "GET" and path.split("?")[0].endswith("long.mp4")]
    assert len(ranges) > 3  # a header, an index and the GOPs, not one GET of the whole object

    # each clip record keeps its source's frame index around its frames: a re-read of the clip (a pixel loss's
    # targets, decode) seeks by it, demuxing nothing, and reads the clip's ranges of the object; verify --reencode
    # reads its frames by the video's own packets, never by the index it checks
    from vaecache.storage import set_data_storage_options
    from vaecache.training import LatentCache
    from vaecache.video.reader import VideoReader

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)  # the counting proxy is gone
    set_data_storage_options({})
    records = read_clips(tmp_path / "url")
    kept = [Timeline.from_json(record["source_timelines"][0], "record") for record in records]
    assert all(t.head == timeline.head and t.pts_rule == timeline.pts_rule for t in kept)
    assert all(len(t.keyframes()) <= 4 for t in kept)  # the clip's keyframes, not the video's 40
    on_disk = LatentCache(tmp_path / "disk").source_frames(records[30]["id"])

    def no_index(self: VideoReader) -> None:
        raise AssertionError(f"{self.path} was demuxed to index it")

    with monkeypatch.context() as patched:
        patched.setattr(VideoReader, "_index", no_index)
        assert torch.equal(LatentCache(tmp_path / "url").source_frames(records[30]["id"]), on_disk)
    checked = invoke(["verify", tmp_path / "url", "--reencode", "3", "--seed", "2"])
    assert checked.exit_code == 0, checked.output
