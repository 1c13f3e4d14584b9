"""`vaecache embed`: a set of caption embeddings added to a finished cache, deduplicated, byte-identical on a
rerun, replaced only when asked, read back by LatentCache in the pipeline's shape, on disk and in S3."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import CAPTIONS
from tests.text.tiny_text import build_wan_text_folder
from vaecache.text.encoder import load_text_encoder
from vaecache.training import LatentCache, LatentDataset, collate_latents


@pytest.fixture(scope="module")
def wan_text(tmp_path_factory):
    return build_wan_text_folder(tmp_path_factory.mktemp("text") / "wan")


@pytest.fixture
def cache(caption_cache, tmp_path):
    return shutil.copytree(caption_cache, tmp_path / "cache")


def files_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_embed_adds_a_deduplicated_set_that_reads_back_as_the_pipeline_tensor(cache, wan_text, run_cli, tmp_path):
    before = files_of(cache)
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--text-batch", "2"])
    assert result.exit_code == 0, result.output
    assert "added text set 'default'" in result.output and "3 distinct prompts" in result.output
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]
    assert entry["clips"] == manifest["counts"]["clips"] and entry["prompts"] == 3  # one prompt per scene
    assert entry["fingerprint"]["family"] == "wan" and entry["captions"] == {"kind": "clip metadata",
                                                                              "field": "caption"}
    after = files_of(cache)
    assert {k: v for k, v in after.items() if k in before and k != "manifest.json"} == \
        {k: v for k, v in before.items() if k != "manifest.json"}  # latents and tables untouched

    encoder = load_text_encoder(f"diffusers:{wan_text}", batch=1)
    latents = LatentCache(cache)
    assert latents.text_sets == ["default"]
    for item in latents:
        embeds, mask = item["text/default"], item["text_mask/default"]
        (expected,) = encoder.embed([encoder.clean(CAPTIONS[item.scene])])
        assert embeds.shape == (512, 32) and int(mask.sum()) == expected.tokens
        assert torch.equal(embeds[:expected.tokens], expected.rows) and not embeds[expected.tokens:].any()
    batch = collate_latents([LatentDataset(cache)[i] for i in range(2)])
    assert batch["text/default"].shape == (2, 512, 32) and batch["text_mask/default"].dtype == torch.bool

    again = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--text-batch", "2"])
    assert again.exit_code == 0 and "up to date" in again.output and files_of(cache) == after
    shutil.rmtree(cache / "text")  # the same inputs write the same bytes
    (cache / "manifest.json").write_bytes(before["manifest.json"])
    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--text-batch", "2"]).exit_code == 0
    assert files_of(cache) == after


def test_other_captions_replace_a_set_only_when_asked_and_clips_must_all_be_named(cache, wan_text, run_cli,
                                                                                  tmp_path):
    spec = ["--text-encoder", f"diffusers:{wan_text}"]
    assert run_cli(["embed", cache, *spec]).exit_code == 0
    ids = LatentCache(cache).ids()
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps({"id": clip, "caption": "the same words"}) + "\n" for clip in ids[1:]))
    partial = run_cli(["embed", cache, *spec, "--captions", captions])
    assert partial.exit_code == 2 and f"no caption for 1 clip(s) of the cache: {ids[0]}" in partial.output
    captions.write_text("".join(json.dumps({"id": clip, "caption": "the same words"}) + "\n" for clip in ids))
    refused = run_cli(["embed", cache, *spec, "--captions", captions])
    assert refused.exit_code == 2 and "--replace replaces it" in refused.output
    old = sorted(p.parent.name for p in (cache / "text" / "default").rglob("clips.parquet"))
    replaced = run_cli(["embed", cache, *spec, "--captions", captions, "--replace"])
    assert replaced.exit_code == 0 and "replaced text set 'default'" in replaced.output
    assert "1 distinct prompts" in replaced.output
    now = sorted(p.parent.name for p in (cache / "text" / "default").rglob("clips.parquet"))
    assert len(now) == 1 and now != old  # the old generation is gone
    entry = json.loads((cache / "manifest.json").read_text())["text"]["default"]
    assert entry["captions"]["kind"] == "file" and len(entry["captions"]["sha256"]) == 64
    second = run_cli(["embed", cache, *spec, "--set", "metadata"])  # several named sets side by side
    assert second.exit_code == 0 and LatentCache(cache).text_sets == ["default", "metadata"]


def test_embed_into_a_cache_in_s3_writes_what_it_writes_on_disk(s3, cache, wan_text, run_cli, tmp_path):
    from tests.s3 import download, upload

    url = upload(s3, cache, "text-sets")
    spec = ["--text-encoder", f"diffusers:{wan_text}"]
    result = run_cli(["embed", url, *spec])
    assert result.exit_code == 0, result.output
    assert not s3.exists("text-sets/cache/.lock")  # the lock was taken and given back
    verified = run_cli(["verify", url])
    assert verified.exit_code == 0 and "text set default" in verified.output, verified.output
    assert run_cli(["embed", cache, *spec]).exit_code == 0
    remote = LatentCache(url)
    assert remote.text_sets == ["default"] and torch.equal(remote[0]["text/default"],
                                                          LatentCache(cache)[0]["text/default"])
    fetched = download(s3, url, tmp_path / "fetched")
    assert {k: v for k, v in files_of(fetched).items() if k.startswith("text/")} == \
        {k: v for k, v in files_of(cache).items() if k.startswith("text/")}


def test_verify_checks_every_set_and_names_a_missing_embedding_by_clip(cache, wan_text, run_cli):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"]).exit_code == 0
    report_file = cache.parent / "report.json"
    ok = run_cli(["verify", cache, "--json", report_file])
    assert ok.exit_code == 0, ok.output
    report = json.loads(report_file.read_text())
    (row,) = [check for check in report["checks"] if check["name"] == "text set default"]
    assert row["failed"] == 0 and row["passed"] == 3
    # a clip's row removed and every hash recomputed, as a careless tool would: still named
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]
    table_file = cache / entry["tables"]["clips"]["file"]
    clips = pq.read_table(table_file)
    first = clips.column("id")[0].as_py()
    pq.write_table(clips.slice(1), table_file)
    data = table_file.read_bytes()
    import hashlib

    entry["tables"]["clips"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest))
    stray = cache / "text" / "default" / "0123456789abcdef" / "embeddings-00000.safetensors"
    stray.parent.mkdir()
    stray.write_bytes(b"left by a crash")
    shard = cache / entry["shards"][0]["file"]
    from safetensors.torch import load, save

    tensors = load(shard.read_bytes())
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    shard.write_bytes(save(tensors, metadata={"vaecache_text_set": "default"}))
    entry["shards"][0].update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest(), bytes=shard.stat().st_size)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    assert bad.exit_code == 1
    assert f"clip {first} has no embedding" in bad.output
    assert "0123456789abcdef" in bad.output and "not listed in the manifest" in bad.output
    assert f"prompt {key[:12]} holds non-finite values" in bad.output
    pa  # noqa: B018 (pyarrow imported for pq's tables)


def test_the_musubi_export_writes_musubis_wan_text_caches_and_never_pairs_a_clip_with_another_caption(
        cache, wan_text, run_cli, tmp_path, demo_data):
    from safetensors import safe_open

    from vaecache.text.sets import TextSet

    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"]).exit_code == 0
    dest = tmp_path / "musubi"
    exported = run_cli(["export", cache, "--format", "musubi", "--out", dest])
    assert exported.exit_code == 0, exported.output
    assert "text-encoder caches of text set 'default' for 6 items" in exported.output  # 3 scenes x 2 cameras
    latents = LatentCache(cache)
    texts = TextSet(latents.store, latents.manifest, "default")
    index = [json.loads(line) for line in (dest / "index.jsonl").read_text().splitlines()]
    for row in index:
        with safe_open(dest / "cache" / f"{row['item']}_wan_te.safetensors", "pt") as handle:
            assert handle.keys() == ["varlen_t5_float32"]
            assert torch.equal(handle.get_tensor("varlen_t5_float32"), texts.rows(row["clip"]))
            assert handle.metadata() == {"architecture": "wan", "caption1": CAPTIONS[row["scene"]].replace("\n", " "),
                                         "format_version": "1.0.1"}
    assert run_cli(["export", cache, "--format", "musubi", "--out", tmp_path / "plain", "--text-set",
                    "none"]).exit_code == 0
    assert not list((tmp_path / "plain" / "cache").glob("*_te.safetensors"))

    two = tmp_path / "two-clips"  # two clips of one scene: one musubi item, one caption only
    assert run_cli(["encode", demo_data, "--out", two, "--vae", "builtin:tiny", "--num-frames", "5", "--size",
                    "32x32", "--workers", "0", "--no-progress", "--max-clips-per-scene", "2"]).exit_code == 0
    ids = LatentCache(two).ids()
    captions = tmp_path / "per-clip.json"
    captions.write_text(json.dumps({clip: f"caption number {n}" for n, clip in enumerate(ids)}))
    assert run_cli(["embed", two, "--text-encoder", f"diffusers:{wan_text}", "--captions", captions]).exit_code == 0
    refused = run_cli(["export", two, "--format", "musubi", "--out", tmp_path / "refused"])
    assert refused.exit_code != 0 and f"clips {ids[0]} and {ids[1]} have different captions" in refused.output
    assert not (tmp_path / "refused").exists()


def test_shards_are_whole_batches_cut_by_bytes_whatever_the_world_size():
    from vaecache.text.sets import pack_shards

    keys = list("abcdef")
    assert pack_shards(keys, [5] * 6, 2, 10) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert pack_shards(keys, [5] * 6, 2, 25) == [["a", "b", "c", "d"], ["e", "f"]]
    assert pack_shards(keys, [50] * 6, 3, 10) == [["a", "b", "c"], ["d", "e", "f"]]  # a batch is never split
    assert pack_shards([], [], 2, 10) == []


def test_a_full_length_family_reads_back_every_row_and_verifies(cache, run_cli, tmp_path):
    ltx = build_wan_text_folder(tmp_path / "ltx", pipeline="LTXPipeline")
    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{ltx}", "--set", "ltx"]).exit_code == 0
    encoder = load_text_encoder(f"diffusers:{ltx}")
    item = LatentCache(cache)[0]
    (expected,) = encoder.embed([CAPTIONS[item.scene]])
    assert torch.equal(item["text/ltx"], expected.rows) and item["text/ltx"].shape == (128, 32)
    assert int(item["text_mask/ltx"].sum()) == expected.tokens < 128
    assert run_cli(["verify", cache]).exit_code == 0
    refused = run_cli(["export", cache, "--format", "musubi", "--out", tmp_path / "x"])
    assert refused.exit_code != 0 and "ltx-video family" in refused.output and "--text-set none" in refused.output


def test_verify_reencode_re_embeds_prompts_with_the_recorded_encoder(cache, run_cli, tmp_path):
    wan = build_wan_text_folder(tmp_path / "wan")
    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan}"]).exit_code == 0
    report_file = tmp_path / "report.json"
    ok = run_cli(["verify", cache, "--reencode", "2", "--json", report_file])
    assert ok.exit_code == 0, ok.output
    (row,) = [c for c in json.loads(report_file.read_text())["checks"] if c["name"].startswith("re-embed")]
    assert row["passed"] == 2 and row["failed"] == 0
    build_wan_text_folder(wan, seed=1)  # other weights at the recorded path
    changed = run_cli(["verify", cache, "--reencode", "2", "--json", report_file])
    (row,) = [c for c in json.loads(report_file.read_text())["checks"] if c["name"].startswith("re-embed")]
    assert changed.exit_code == 1 and "is not the recorded one" in row["problems"][0]
    assert "weights_sha256" in row["problems"][0]


def test_a_set_folder_the_manifest_does_not_list_is_named(cache, run_cli, tmp_path):
    stray = cache / "text" / "lost" / "0123456789abcdef" / "clips.parquet"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"x")
    result = run_cli(["verify", cache, "--json", tmp_path / "r.json"])
    (row,) = [c for c in json.loads((tmp_path / "r.json").read_text())["checks"] if c["name"] == "text sets"]
    assert result.exit_code == 1 and "a text set the manifest does not list" in row["problems"][0]


def test_encode_with_a_text_encoder_embeds_in_the_same_run_as_embed_afterwards(demo_data, caption_cache, run_cli,
                                                                               tmp_path):
    import tests.conftest as shared

    wan = build_wan_text_folder(tmp_path / "wan")
    index = caption_cache.parent / "index.jsonl"
    out = tmp_path / "together"
    result = run_cli(["encode", index, "--out", out, *shared.ENCODE_ARGS, "--text-encoder", f"diffusers:{wan}"])
    assert result.exit_code == 0, result.output
    assert "text set 'default' added: 3 clips, 3 distinct prompts" in result.output
    after = shutil.copytree(caption_cache, tmp_path / "after")
    assert run_cli(["embed", after, "--text-encoder", f"diffusers:{wan}"]).exit_code == 0
    assert files_of(out / "text") == files_of(after / "text")
    bad = run_cli(["encode", index, "--out", tmp_path / "never", *shared.ENCODE_ARGS, "--text-encoder", str(wan)])
    assert bad.exit_code == 2 and "--text-encoder must be diffusers:PATH" in bad.output
    assert not (tmp_path / "never").exists()


def test_an_encode_that_adds_clips_keeps_the_set_listed_and_the_next_embed_adds_them(caption_cache, wan_text,
                                                                                      run_cli, tmp_path):
    import tests.conftest as shared

    lines = (caption_cache.parent / "index.jsonl").read_text().splitlines(keepends=True)
    index = tmp_path / "index.jsonl"
    index.write_text("".join(lines[:2]))
    out = tmp_path / "growing"
    assert run_cli(["encode", index, "--out", out, *shared.ENCODE_ARGS]).exit_code == 0
    embed = ["embed", out, "--text-encoder", f"diffusers:{wan_text}", "--condition", "first-frame"]
    assert run_cli(embed).exit_code == 0
    before = json.loads((out / "manifest.json").read_text())
    index.write_text("".join(lines))  # a third scene
    grown = run_cli(["encode", index, "--out", out, *shared.ENCODE_ARGS])
    assert grown.exit_code == 0, grown.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["clips"] == 3  # the sets still listed, as they were
    assert manifest["text"] == before["text"] and manifest["conditions"] == before["conditions"]
    report = " ".join(run_cli(["verify", out]).output.split())
    assert "text set default: clip scene_002/000000-000008 has no embedding" in report
    assert "made from other clips than the cache holds now" in report and "does not list" not in report
    with pytest.raises(KeyError, match="clip scene_002/000000-000008 has no embedding in text set 'default'"):
        LatentCache(out)["scene_002/000000-000008"]
    again = run_cli(embed)
    assert again.exit_code == 0, again.output  # the same encoder and VAE: no --replace needed
    assert "updated text set 'default'" in again.output and "updated condition set 'first-frame'" in again.output
    assert run_cli(["verify", out]).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["text"]["default"]["clips"] == manifest["conditions"]["first-frame"]["clips"] == 3


@pytest.mark.parametrize("crash_at", [1, 3])  # after the first shard; after the last, before the manifest
def test_a_killed_embed_leaves_nothing_verify_accepts_and_a_rerun_equals_an_uninterrupted_one(
        caption_cache, wan_text, run_cli, tmp_path, crash_at):
    from tests.conftest import run_vaecache

    args = ["--text-encoder", f"diffusers:{wan_text}", "--text-batch", "1", "--shard-size", "1KiB"]
    whole, killed = (shutil.copytree(caption_cache, tmp_path / name) for name in ("whole", "killed"))
    assert run_cli(["embed", whole, *args]).exit_code == 0
    crashed = run_vaecache("embed", killed, *args, env={"VAECACHE_FAULT": f"crash-after-set-shard:text:{crash_at}"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert "text" not in json.loads((killed / "manifest.json").read_text())  # the cache as it was ...
    assert run_cli(["verify", killed]).exit_code == 1  # ... with files verify names
    resumed = run_cli(["embed", killed, *args])  # the dead process's lock is taken over
    assert resumed.exit_code == 0 and f"{crash_at} shard(s) an interrupted run committed kept" in resumed.output
    assert files_of(killed / "text") == files_of(whole / "text")
    assert (killed / "manifest.json").read_bytes() == (whole / "manifest.json").read_bytes()
    assert run_cli(["verify", killed]).exit_code == 0


def test_a_crash_between_the_manifest_and_the_old_generations_removal_is_mended_by_the_next_embed(
        cache, wan_text, run_cli):
    spec = ["--text-encoder", f"diffusers:{wan_text}"]
    assert run_cli(["embed", cache, *spec]).exit_code == 0
    stale = cache / "text" / "default" / "0000000000000000" / "clips.parquet"  # what the old generation left
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    assert run_cli(["verify", cache]).exit_code == 1
    again = run_cli(["embed", cache, *spec])
    assert again.exit_code == 0 and "up to date" in again.output and not stale.exists()
    assert run_cli(["verify", cache]).exit_code == 0


def test_verify_dataset_names_a_changed_captions_file(cache, wan_text, run_cli, tmp_path, demo_data):
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({clip: "a caption" for clip in LatentCache(cache).ids()}))
    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--captions", captions]).exit_code == 0
    report = tmp_path / "r.json"
    assert run_cli(["verify", cache, "--dataset", demo_data, "--json", report]).exit_code == 0
    captions.write_text(json.dumps({clip: "another caption" for clip in LatentCache(cache).ids()}))
    assert run_cli(["verify", cache, "--dataset", demo_data, "--json", report]).exit_code == 1
    (row,) = [c for c in json.loads(report.read_text())["checks"] if c["name"].startswith("captions of text set")]
    assert "changed since text set default was embedded" in row["problems"][0]


def test_the_webdataset_export_carries_each_set_read_back_as_latentcache_gives_it(cache, wan_text, run_cli,
                                                                                 tmp_path):
    import webdataset

    from vaecache.export.webdataset import decode_sample

    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"]).exit_code == 0
    dest = tmp_path / "wds"
    assert run_cli(["export", cache, "--format", "webdataset", "--out", dest, "--energon", "off"]).exit_code == 0
    latents = LatentCache(cache)
    tars = sorted(str(p) for p in dest.glob("*.tar"))
    samples = [decode_sample(s) for s in webdataset.WebDataset(tars, shardshuffle=False)]
    assert len(samples) == len(latents)
    for sample in samples:
        item = latents[sample["record"]["id"]]
        assert torch.equal(sample["text/default"], item["text/default"])
        assert torch.equal(sample["text_mask/default"], item["text_mask/default"])


def test_ranks_that_loaded_different_encoders_are_refused_before_anything_is_written():
    import types

    from vaecache.distributed.agreement import same_on_every_rank
    from vaecache.errors import UsageError

    def ctx(*prints):
        return types.SimpleNamespace(info=types.SimpleNamespace(world_size=len(prints)),
                                     all_gather_object=lambda mine: list(prints))

    same_on_every_rank(ctx({"weights_sha256": "a"}, {"weights_sha256": "a"}), {"weights_sha256": "a"}, "text encoder")
    with pytest.raises(UsageError, match="rank 1 loaded another text encoder than rank 0 .*weights_sha256"):
        same_on_every_rank(ctx({"weights_sha256": "a"}, {"weights_sha256": "b"}), {"weights_sha256": "a"},
                           "text encoder")


def test_a_captions_file_naming_a_clip_twice_or_a_line_without_a_caption_is_refused(cache, wan_text, run_cli,
                                                                                    tmp_path):
    spec = ["--text-encoder", f"diffusers:{wan_text}"]
    ids = LatentCache(cache).ids()
    pairs = ", ".join(f'"{clip}": "words"' for clip in ids)
    mapping = tmp_path / "captions.json"
    mapping.write_text("{" + pairs + f', "{ids[1]}": "other words"' + "}")
    result = run_cli(["embed", cache, *spec, "--captions", mapping])
    assert result.exit_code == 2 and f"{mapping}: clip {ids[1]} is captioned twice" in result.output
    lines = tmp_path / "captions.jsonl"
    lines.write_text(json.dumps({"id": ids[0], "caption": "words"}) + "\n" + json.dumps({"id": ids[1]}) + "\n")
    result = run_cli(["embed", cache, *spec, "--captions", lines])
    assert result.exit_code == 2 and f'{lines}:2: clip {ids[1]} has no "caption"' in result.output
    assert not (cache / "text").exists()


def test_null_or_empty_captions_are_the_empty_prompt_and_the_summary_names_their_clips(cache, wan_text, run_cli,
                                                                                       tmp_path):
    ids = LatentCache(cache).ids()
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({ids[0]: None, ids[1]: "", **{clip: "words" for clip in ids[2:]}}))
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--captions", captions])
    assert result.exit_code == 0, result.output
    assert f"2 clip(s) have no caption (missing, null or empty) and the empty prompt, e.g. {ids[0]}, {ids[1]}" \
        in result.output.replace("\n", " ")
    latents = LatentCache(cache)
    _, empty_mask = latents.text_embedding(ids[0], "default")
    assert torch.equal(latents.text_embedding(ids[1], "default")[0], latents.text_embedding(ids[0], "default")[0])
    assert int(empty_mask.sum()) == 1  # the empty prompt: </s> alone


def test_a_caption_field_no_clip_has_is_refused_naming_it(cache, wan_text, run_cli):
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--caption-field", "captoin"])
    assert result.exit_code == 2
    assert "--caption-field 'captoin': no clip's metadata has it (the first clip's has: caption, nested, score, tags" \
        in result.output.replace("\n", " ")
    assert not (cache / "text").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_captions_path_that_is_not_a_regular_file_is_one_line_not_a_hang(cache, wan_text, run_cli, tmp_path, kind):
    import os

    path = tmp_path / "captions.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path = "/dev/zero"
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--captions", path])
    assert result.exit_code == 2 and f"{path}: --captions is not a regular file" in result.output.replace("\n", " ")


def _rewrite_table(cache, entry, table, edit):
    """The set's `table` (clips or prompts) rewritten by `edit` and its hash in the manifest recomputed, as a forger
    (or a careless tool) would."""
    import hashlib

    import pyarrow.parquet as pq

    file = cache / entry["tables"][table]["file"]
    pq.write_table(edit(pq.read_table(file)), file)
    data = file.read_bytes()
    entry["tables"][table].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_verify_proves_each_clip_is_linked_to_its_own_caption_and_each_prompt_to_its_text(cache, wan_text, run_cli,
                                                                                           tmp_path):
    """Round 5's forgeries with every hash recomputed: a clip pointed at another caption's prompt, and a prompt's stored
    text edited, are named by verify (the links are recomputed from the clips' own metadata, not the hashes)."""
    import pyarrow as pa

    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"]).exit_code == 0
    assert run_cli(["verify", cache]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]

    def remap(table):
        keys = table.column("key").to_pylist()
        other = next(key for key in keys if key != keys[0])
        return table.set_column(1, "key", pa.array([other] + keys[1:], pa.string()))

    _rewrite_table(cache, entry, "clips", remap)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    first = LatentCache(cache).ids()[0]
    bad = run_cli(["verify", cache])
    assert bad.exit_code == 1 and f"clip {first} is linked to prompt" in bad.output.replace("\n", " ")
    assert "but its own caption is prompt" in bad.output.replace("\n", " ")
    # and the readers refuse the remapped item as they read it (one hash of the clip's own caption per item)
    from vaecache.errors import ManifestError
    from vaecache.training import LatentDataset

    for reader in (LatentCache(cache), LatentDataset(cache, verify="sha256")):
        with pytest.raises(ManifestError, match=f"text set 'default': clip {first} is linked to prompt .* but its own "
                                                "caption is prompt"):
            reader[0]
    assert "text/default" in LatentCache(cache)[1].tensors  # a clip still linked to its own caption reads

    def edit_text(table):
        texts = table.column("text").to_pylist()
        return table.set_column(table.schema.get_field_index("text"), "text",
                                pa.array([texts[0].upper()] + texts[1:], pa.string()))

    _rewrite_table(cache, entry, "prompts", edit_text)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    assert bad.exit_code == 1 and "stored text does not hash to its key" in bad.output.replace("\n", " ")


def test_a_captions_file_set_proves_its_links_from_the_captions_it_keeps_even_once_the_file_is_gone(
        cache, wan_text, run_cli, tmp_path):
    import pyarrow as pa

    ids = LatentCache(cache).ids()
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({clip: f"caption {i % 2}" for i, clip in enumerate(ids)}))
    spec = ["--text-encoder", f"diffusers:{wan_text}", "--captions", captions]
    assert run_cli(["embed", cache, *spec]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]
    import pyarrow.parquet as pq

    kept = pq.read_table(cache / entry["tables"]["clips"]["file"])
    assert kept.column("caption").to_pylist() == [f"caption {i % 2}" for i in range(len(ids))]
    captions.rename(tmp_path / "moved.json")  # the links are proven without it

    def swap(table):
        keys = table.column("key").to_pylist()
        return table.set_column(1, "key", pa.array([keys[1], keys[0]] + keys[2:], pa.string()))

    _rewrite_table(cache, entry, "clips", swap)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    report_file = tmp_path / "report.json"
    bad = run_cli(["verify", cache, "--json", report_file])
    assert bad.exit_code == 1 and f"clip {ids[0]} is linked to prompt" in bad.output.replace("\n", " ")
    from vaecache.errors import ManifestError

    with pytest.raises(ManifestError, match=f"clip {ids[1]} is linked to prompt"):  # from the captions it keeps
        LatentCache(cache)[ids[1]]
    # a set embedded before the clip table kept captions, its file gone: a note, not a pass in silence
    _rewrite_table(cache, entry, "clips", lambda table: table.drop(["caption"]))
    (cache / "manifest.json").write_text(json.dumps(manifest))
    run_cli(["verify", cache, "--json", report_file])
    (row,) = [c for c in json.loads(report_file.read_text())["checks"] if c["name"] == "text set default"]
    assert "clip-to-caption links not proven: its captions file" in row["note"]


def test_an_edited_fingerprint_length_fails_verify_before_a_reader_trips_on_it(cache, wan_text, run_cli):
    import hashlib

    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]
    entry["fingerprint"]["length"] = 2
    entry["fingerprint_sha256"] = hashlib.sha256(json.dumps(entry["fingerprint"], sort_keys=True).encode()).hexdigest()
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    output = bad.output.replace("\n", " ")
    assert bad.exit_code == 1 and "its fingerprint's length 2 differs from its batch shape [8, 512]" in output
    assert "tokens, more than the set's length 2" in output


def test_rows_altered_or_swapped_between_prompts_fail_verify_by_their_recorded_stats(cache, run_cli, tmp_path):
    """Two prompts' rows swapped in the shard (LTX-Video's family stores every row of its length, so both have one
    shape), every hash recomputed: shapes, dtype and finiteness all hold, and the per-prompt stats the prompt table
    records name both."""
    import hashlib

    import pyarrow.parquet as pq
    from safetensors.torch import load, save

    ids = LatentCache(cache).ids()
    captions = cache.parent / "captions.json"
    captions.write_text(json.dumps({clip: ["red car", "blue car"][i % 2] for i, clip in enumerate(ids)}))
    ltx = build_wan_text_folder(tmp_path / "ltx", pipeline="LTXPipeline")
    spec = ["--text-encoder", f"diffusers:{ltx}", "--captions", captions, "--text-batch", "2"]
    assert run_cli(["embed", cache, *spec]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]
    prompts = pq.read_table(cache / entry["tables"]["prompts"]["file"])
    assert {"min", "max", "mean", "std"} <= set(prompts.column_names)
    (shard_entry,) = entry["shards"]
    shard = cache / shard_entry["file"]
    tensors = load(shard.read_bytes())
    first, second = sorted(tensors)
    assert tensors[first].shape == tensors[second].shape == (128, 32)
    tensors[first], tensors[second] = tensors[second], tensors[first]
    shard.write_bytes(save(tensors, metadata={"vaecache_text_set": "default"}))
    shard_entry.update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest(), bytes=shard.stat().st_size)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    output = bad.output.replace("\n", " ")
    assert bad.exit_code == 1
    for key in (first, second):
        assert f"prompt {key[:12]}'s rows do not match the stats its prompt table records" in output


def test_a_prompt_of_no_tokens_embeds_and_verifies(cache, run_cli, tmp_path):
    """An encoder whose tokenizer adds no special token stores the empty prompt as 0 rows: its stats are zeros."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    wan = build_wan_text_folder(tmp_path / "plain")
    raw = Tokenizer.from_file(str(wan / "tokenizer" / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>").save_pretrained(
        wan / "text_encoder")
    ids = LatentCache(cache).ids()
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({clip: "" if i == 0 else "red car" for i, clip in enumerate(ids)}))
    result = run_cli(["embed", cache, "--text-encoder", f"transformers:{wan / 'text_encoder'}", "--text-length", "16",
                      "--captions", captions])
    assert result.exit_code == 0, result.output
    rows, mask = LatentCache(cache).text_embedding(ids[0], "default")
    assert not mask.any() and not rows.any()
    assert run_cli(["verify", cache]).exit_code == 0


def test_verify_of_a_set_behind_its_cache_still_proves_the_links_of_the_clips_it_holds(cache, wan_text, run_cli,
                                                                                       tmp_path):
    """A set missing a clip (as after an encode added one) and with another clip remapped: both are named; the
    missing one does not stop the link check of the rest."""
    import pyarrow as pa

    ids = LatentCache(cache).ids()
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({clip: f"caption {i}" for i, clip in enumerate(ids)}))
    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}", "--captions", captions]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]

    def drop_first_and_remap_second(table):
        keys = table.column("key").to_pylist()
        rest = table.slice(1)
        return rest.set_column(1, "key", pa.array([keys[2]] + keys[2:], pa.string()))

    _rewrite_table(cache, entry, "clips", drop_first_and_remap_second)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    output = run_cli(["verify", cache]).output.replace("\n", " ")
    assert f"clip {ids[0]} has no embedding" in output
    assert f"clip {ids[1]} is linked to prompt" in output


def test_encode_with_a_text_encoder_over_a_dataset_without_captions_embeds_the_empty_prompt(demo_data, wan_text,
                                                                                           run_cli, tmp_path):
    """encode has no --caption-field: a dataset without captions is embedded as the empty prompt, as before, while
    `vaecache embed` names a field no clip has."""
    import tests.conftest as shared

    out = tmp_path / "out"
    result = run_cli(["encode", demo_data, "--out", out, *shared.ENCODE_ARGS, "--text-encoder",
                      f"diffusers:{wan_text}"])
    assert result.exit_code == 0, result.output
    assert "text set 'default' added: 3 clips, 1 distinct prompts" in result.output
    refused = run_cli(["embed", out, "--text-encoder", f"diffusers:{wan_text}", "--set", "other"])
    assert refused.exit_code == 2 and "--caption-field 'caption': no clip's metadata has it" in refused.output
