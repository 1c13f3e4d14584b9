"""What every kind of set gets from the one set machinery (vaecache.cache.embedding.embed_sets): a deleted or damaged
shard of a listed set is repaired by the next embed, and a cache that grew computes only its new items, copying the
rest, into the very files a run from scratch writes."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import caption_metadata, encode_ok
from tests.text.tiny_text import build_wan_text_folder


@pytest.fixture(scope="module")
def wan_text(tmp_path_factory):
    return build_wan_text_folder(tmp_path_factory.mktemp("text") / "wan")


def files_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def set_records(out):
    manifest = json.loads((out / "manifest.json").read_text())
    return {kind: manifest.get(kind) for kind in ("text", "conditions")}


TEXT = ["--text-batch", "1", "--shard-size", "1KiB"]
CONDITIONS = ["--condition", "first-frame", "--shard-size", "1KiB"]


@pytest.mark.parametrize("damage", ["deleted", "flipped"])
def test_a_listed_sets_missing_or_damaged_shard_is_repaired_by_the_next_embed(caption_cache, wan_text, run_cli,
                                                                              tmp_path, damage):
    cache = shutil.copytree(caption_cache, tmp_path / "cache")
    text = ["--text-encoder", f"diffusers:{wan_text}", *TEXT]
    assert run_cli(["embed", cache, *text]).exit_code == 0
    assert run_cli(["embed", cache, *CONDITIONS]).exit_code == 0
    whole = files_of(cache)
    for kind in ("text", "conditions"):
        shard = sorted((cache / kind).rglob("*-00001.safetensors"))[0]
        if damage == "deleted":
            shard.unlink()
        else:  # the same size, one byte other: only its sha256 tells
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF
            shard.write_bytes(bytes(data))
        assert run_cli(["verify", cache]).exit_code == 1
    repaired = run_cli(["embed", cache, *text])
    assert repaired.exit_code == 0, repaired.output
    assert "repaired text set 'default'" in repaired.output and "1 prompt(s) computed" in repaired.output
    assert "1 shard(s) missing or damaged, computed again" in repaired.output
    fixed = run_cli(["embed", cache, *CONDITIONS])
    assert fixed.exit_code == 0 and "repaired condition set 'first-frame'" in fixed.output
    assert "1 clip(s) computed" in fixed.output
    assert files_of(cache) == whole
    assert run_cli(["verify", cache]).exit_code == 0
    again = run_cli(["embed", cache, *text])
    assert again.exit_code == 0 and "up to date" in again.output and files_of(cache) == whole


def test_a_grown_cache_computes_only_its_new_items_into_the_files_a_run_from_scratch_writes(demo_data, wan_text,
                                                                                            run_cli, tmp_path):
    scenes = sorted(demo_data.iterdir())
    lines = [json.dumps({"id": scene.name, "cameras": {v.stem: str(v) for v in sorted(scene.glob("*.mp4"))},
                         **caption_metadata(scene.name)}) + "\n" for scene in scenes]
    text = ["--text-encoder", f"diffusers:{wan_text}", *TEXT]
    index = tmp_path / "index.jsonl"
    index.write_text("".join(lines[:2]))  # the dataset before it grew
    grown = tmp_path / "grown"
    encode_ok(index, grown)
    assert run_cli(["embed", grown, *text]).exit_code == 0
    assert run_cli(["embed", grown, *CONDITIONS]).exit_code == 0
    index.write_text("".join(lines))  # one more scene, at the same path
    encode_ok(index, grown)
    assert set_records(grown)["text"]["default"]["clips"] == 2  # listed, behind the cache until the next embed
    updated = run_cli(["embed", grown, *text])
    assert updated.exit_code == 0, updated.output
    assert "updated text set 'default'" in updated.output
    assert "1 prompt(s) computed, 2 copied from the set before" in updated.output
    conditioned = run_cli(["embed", grown, *CONDITIONS])
    assert conditioned.exit_code == 0, conditioned.output
    assert "1 clip(s) computed, 2 copied from the set before" in conditioned.output

    scratch = tmp_path / "scratch"
    encode_ok(index, scratch)
    assert run_cli(["embed", scratch, *text]).exit_code == 0
    assert run_cli(["embed", scratch, *CONDITIONS]).exit_code == 0
    for kind in ("text", "conditions"):
        assert files_of(grown / kind) == files_of(scratch / kind)
    assert set_records(grown) == set_records(scratch)
    assert run_cli(["verify", grown]).exit_code == 0


def test_in_s3_a_killed_embed_resumes_and_a_deleted_shard_object_is_repaired(s3, caption_cache, wan_text, run_cli,
                                                                            tmp_path):
    from tests.conftest import run_vaecache
    from tests.s3 import download, upload

    whole = shutil.copytree(caption_cache, tmp_path / "whole")
    text = ["--text-encoder", f"diffusers:{wan_text}", *TEXT]
    assert run_cli(["embed", whole, *text]).exit_code == 0
    url = upload(s3, caption_cache, "set-commits")
    crashed = run_vaecache("embed", url, *text, env={"VAECACHE_FAULT": "crash-after-set-shard:text:2"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    resumed = run_cli(["embed", url, *text])
    assert resumed.exit_code == 0 and "2 shard(s) an interrupted run committed kept" in resumed.output
    prefix = "set-commits/cache"
    (shard,) = [key for key in s3.find(f"{prefix}/text") if key.endswith("embeddings-00001.safetensors")]
    s3.rm(shard)
    assert run_cli(["verify", url]).exit_code == 1
    repaired = run_cli(["embed", url, *text])
    assert repaired.exit_code == 0 and "repaired text set 'default'" in repaired.output
    fetched = download(s3, url, tmp_path / "fetched")
    assert files_of(fetched / "text") == files_of(whole / "text")
    assert run_cli(["verify", url]).exit_code == 0


def test_a_grown_cache_computes_what_a_damaged_shard_of_the_set_before_held(demo_data, wan_text, run_cli, tmp_path):
    scenes = sorted(demo_data.iterdir())
    lines = [json.dumps({"id": scene.name, "cameras": {v.stem: str(v) for v in sorted(scene.glob("*.mp4"))},
                         **caption_metadata(scene.name)}) + "\n" for scene in scenes]
    text = ["--text-encoder", f"diffusers:{wan_text}", *TEXT]
    index = tmp_path / "index.jsonl"
    index.write_text("".join(lines[:2]))
    grown = tmp_path / "grown"
    encode_ok(index, grown)
    assert run_cli(["embed", grown, *text]).exit_code == 0
    shard = sorted((grown / "text").rglob("embeddings-00000.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the same size: only its sha256 tells
    shard.write_bytes(bytes(data))
    index.write_text("".join(lines))
    encode_ok(index, grown)
    updated = run_cli(["embed", grown, *text])
    assert updated.exit_code == 0, updated.output
    assert "2 prompt(s) computed, 1 copied from the set before" in updated.output
    scratch = tmp_path / "scratch"
    encode_ok(index, scratch)
    assert run_cli(["embed", scratch, *text]).exit_code == 0
    assert files_of(grown / "text") == files_of(scratch / "text")


def test_a_listed_sets_damaged_item_table_is_repaired_by_the_next_embed(caption_cache, wan_text, run_cli, tmp_path):
    cache = shutil.copytree(caption_cache, tmp_path / "cache")
    text = ["--text-encoder", f"diffusers:{wan_text}", *TEXT]
    assert run_cli(["embed", cache, *text]).exit_code == 0
    whole = files_of(cache)
    table = sorted((cache / "text").rglob("prompts.parquet"))[0]
    table.write_bytes(b"not parquet")
    assert run_cli(["verify", cache]).exit_code == 1
    repaired = run_cli(["embed", cache, *text])
    assert repaired.exit_code == 0 and "repaired text set 'default'" in repaired.output, repaired.output
    assert files_of(cache) == whole


def test_a_set_written_before_a_column_existed_stays_up_to_date_and_is_repaired_whole(good_cache, run_cli, tmp_path):
    import hashlib
    import io

    import pyarrow.parquet as pq

    fresh, old = (shutil.copytree(good_cache, tmp_path / name) for name in ("fresh", "old"))
    for cache in (fresh, old):
        assert run_cli(["embed", cache, *CONDITIONS]).exit_code == 0
    manifest = json.loads((old / "manifest.json").read_text())
    entry = manifest["conditions"]["first-frame"]["tables"]["clips"]
    table = pq.read_table(old / entry["file"]).drop(["inputs"])  # as vaecache wrote it before `inputs`
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd", write_page_checksum=True)
    (old / entry["file"]).write_bytes(buffer.getvalue())
    entry.update(bytes=len(buffer.getvalue()), sha256=hashlib.sha256(buffer.getvalue()).hexdigest())
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    before = files_of(old)
    again = run_cli(["embed", old, *CONDITIONS])
    assert again.exit_code == 0 and "up to date" in again.output and files_of(old) == before
    sorted((old / "conditions").rglob("conditions-00001.safetensors"))[0].unlink()
    repaired = run_cli(["embed", old, *CONDITIONS])
    assert repaired.exit_code == 0 and "repaired condition set 'first-frame'" in repaired.output, repaired.output
    assert "3 clip(s) computed" in repaired.output  # whole: its table is written again with every column
    assert files_of(old / "conditions") == files_of(fresh / "conditions")
    assert set_records(old) == set_records(fresh)
