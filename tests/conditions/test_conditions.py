"""Image-to-video conditions: `vaecache embed --condition` adds them to a finished cache, bit for bit what diffusers'
own WanImageToVideoPipeline.prepare_latents builds from the frames the cache says encode saw, one per camera;
verified, resumable after a kill, the same bytes in S3 and through a rerun."""

from __future__ import annotations

import hashlib
import json
import shutil
import types

import pytest
import torch

from vaecache.training import LatentCache, LatentDataset, collate_latents


@pytest.fixture
def cache(good_cache, tmp_path):
    return shutil.copytree(good_cache, tmp_path / "cache")


def files_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def diffusers_condition(vae_module, frames, kind):
    """diffusers' own prepare_latents (its unbound function, with the attributes it reads) on one camera's frames
    (3, T, H, W): returns the (1, 4 + C, F, h, w) tensor the pipeline concatenates to the noise."""
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline

    pipeline = types.SimpleNamespace(vae=vae_module, config=types.SimpleNamespace(expand_timesteps=False),
                                     vae_scale_factor_temporal=4, vae_scale_factor_spatial=8)
    _, count, height, width = frames.shape
    noise = torch.zeros(1, 16, (count - 1) // 4 + 1, height // 8, width // 8)
    last = frames[:, -1][None] if kind == "first-last" else None
    with torch.no_grad():
        _, condition = WanImageToVideoPipeline.prepare_latents(pipeline, frames[:, 0][None], 1, 16, height, width,
                                                               count, torch.float32, torch.device("cpu"), None, noise,
                                                               last)
    return condition


def test_conditions_equal_diffusers_prepare_latents_per_camera_and_rerun_to_the_same_bytes(cache, run_cli):
    from vaecache.vae.load import load_vae

    before = files_of(cache)
    result = run_cli(["embed", cache, "--condition", "first-last,first-frame"])
    assert result.exit_code == 0, result.output
    assert "added condition set 'first-frame'" in result.output and "added condition set 'first-last'" in result.output
    after = files_of(cache)
    assert {k: v for k, v in after.items() if k in before and k != "manifest.json"} == \
        {k: v for k, v in before.items() if k != "manifest.json"}  # latents and tables untouched
    latents = LatentCache(cache)
    assert latents.condition_sets == ["first-frame", "first-last"]
    module = load_vae("builtin:tiny").model.module
    for item in latents:
        frames = latents.source_frames(item.id)
        assert frames.shape[0] == len(item.cameras) == 2
        for kind in ("first-frame", "first-last"):
            condition = item[f"condition/{kind}"]
            assert condition.shape == (2, 20, *item.mean.shape[2:]) and condition.dtype == torch.float32
            for view in range(2):  # one condition per camera, each the pipeline's own
                assert torch.equal(condition[view], diffusers_condition(module, frames[view], kind)[0])
    batch = collate_latents([LatentDataset(cache)[i] for i in range(2)])
    assert batch["condition/first-frame"].shape == (2, 2, 20, 3, 8, 8)

    again = run_cli(["embed", cache, "--condition", "first-frame"])
    assert again.exit_code == 0 and "up to date" in again.output and files_of(cache) == after
    shutil.rmtree(cache / "conditions")  # the same inputs write the same bytes
    (cache / "manifest.json").write_bytes(before["manifest.json"])
    assert run_cli(["embed", cache, "--condition", "first-frame,first-last"]).exit_code == 0
    assert files_of(cache) == after
    assert run_cli(["verify", cache]).exit_code == 0


def test_verify_names_a_removed_condition_with_every_hash_recomputed(cache, run_cli, tmp_path):
    from safetensors.torch import load, save

    assert run_cli(["embed", cache, "--condition", "first-frame", "--shard-size", "1KiB"]).exit_code == 0
    report_file = tmp_path / "report.json"
    ok = run_cli(["verify", cache, "--json", report_file])
    assert ok.exit_code == 0, ok.output
    (row,) = [c for c in json.loads(report_file.read_text())["checks"] if c["name"] == "condition set first-frame"]
    assert row["failed"] == 0 and row["passed"] == 4  # three shards (one clip each: 1 KiB) and the clip table
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["conditions"]["first-frame"]
    shard = cache / entry["shards"][1]["file"]
    (clip,) = load(shard.read_bytes())
    shard.write_bytes(save({}, metadata={"vaecache_condition": "first-frame"}))  # its tensor removed ...
    entry["shards"][1].update(bytes=shard.stat().st_size,  # ... and the manifest's hashes recomputed
                              sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    assert bad.exit_code == 1 and f"condition set first-frame: clip {clip} has no condition" in bad.output
    quick = run_cli(["verify", cache, "--quick"])  # the headers are read even then
    assert quick.exit_code == 1 and f"clip {clip} has no condition" in quick.output
    with pytest.raises(Exception, match=f"holds no condition for clip {clip}"):
        LatentCache(cache)[clip]


def test_verify_proves_each_conditions_link_to_its_clips_frames_with_every_hash_recomputed(cache, run_cli):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["conditions"]["first-frame"]
    table_file = cache / entry["tables"]["clips"]["file"]
    table = pq.read_table(table_file)
    assert table.column_names[-1] == "inputs"
    inputs = table.column("inputs").to_pylist()
    forged = table.set_column(table.column_names.index("inputs"), "inputs",
                              pa.array([inputs[1], inputs[0], *inputs[2:]], pa.string()))
    buffer = io.BytesIO()
    pq.write_table(forged, buffer)
    table_file.write_bytes(buffer.getvalue())
    entry["tables"]["clips"].update(bytes=len(buffer.getvalue()), sha256=hashlib.sha256(buffer.getvalue()).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    first = table.column("id").to_pylist()[0]
    assert bad.exit_code == 1
    assert f"clip {first}'s condition was made from other frames than the clip's" in bad.output


def test_verify_reencode_recomputes_conditions_and_names_a_changed_one(cache, run_cli, tmp_path):
    import pyarrow.parquet as pq
    from safetensors.torch import load, save

    from vaecache.cache.writer import tensor_stats

    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    report_file = tmp_path / "report.json"
    ok = run_cli(["verify", cache, "--reencode", "3", "--json", report_file])
    assert ok.exit_code == 0, ok.output
    (row,) = [c for c in json.loads(report_file.read_text())["checks"]
              if c["name"] == "re-encode 3 clip(s) of condition set first-frame"]
    assert row["passed"] == 3
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["conditions"]["first-frame"]
    shard = cache / entry["shards"][0]["file"]
    tensors = load(shard.read_bytes())
    first, second = sorted(tensors)[:2]
    swapped = {**tensors, first: tensors[second], second: tensors[first]}  # two clips' conditions swapped ...
    shard.write_bytes(save(swapped, metadata={"vaecache_condition": "first-frame"}))
    entry["shards"][0].update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])  # ... and the shard's hashes recomputed: the recorded stats tell
    assert bad.exit_code == 1 and f"clip {first}'s condition does not match the stats its clip table records" in \
        " ".join(bad.output.split())

    tensors[first] = tensors[first] + 0.5  # a wrong but finite tensor, with its stats and every hash recomputed
    shard.write_bytes(save(tensors, metadata={"vaecache_condition": "first-frame"}))
    entry["shards"][0].update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    table_file = cache / entry["tables"]["clips"]["file"]
    rows = pq.read_table(table_file).to_pylist()
    for row in rows:
        if row["id"] == first:
            row.update(tensor_stats(tensors[first]))
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(table_file)), table_file)
    entry["tables"]["clips"].update(bytes=table_file.stat().st_size,
                                    sha256=hashlib.sha256(table_file.read_bytes()).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert run_cli(["verify", cache]).exit_code == 0  # integrity alone cannot tell ...
    bad = run_cli(["verify", cache, "--reencode", "3"])
    assert bad.exit_code == 1 and f"condition set first-frame: clip {first} re-encodes" in bad.output  # ... this can


@pytest.mark.parametrize("crash_at", [1, 3])  # after the first shard; after the last, before the manifest
def test_a_killed_condition_embed_leaves_nothing_verify_accepts_and_a_rerun_equals_an_uninterrupted_one(
        good_cache, run_cli, tmp_path, crash_at):
    from tests.conftest import run_vaecache

    args = ["--condition", "first-frame", "--shard-size", "1KiB"]
    whole, killed = (shutil.copytree(good_cache, tmp_path / name) for name in ("whole", "killed"))
    assert run_cli(["embed", whole, *args]).exit_code == 0
    crashed = run_vaecache("embed", killed, *args,
                           env={"VAECACHE_FAULT": f"crash-after-set-shard:conditions:{crash_at}"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert "conditions" not in json.loads((killed / "manifest.json").read_text())  # the cache as it was ...
    assert run_cli(["verify", killed]).exit_code == 1  # ... with files verify names
    resumed = run_cli(["embed", killed, *args])  # the dead process's lock is taken over
    assert resumed.exit_code == 0 and f"{crash_at} shard(s) an interrupted run committed kept" in resumed.output
    assert files_of(killed / "conditions") == files_of(whole / "conditions")
    assert (killed / "manifest.json").read_bytes() == (whole / "manifest.json").read_bytes()
    assert run_cli(["verify", killed]).exit_code == 0


def test_embed_conditions_into_a_cache_in_s3_writes_what_it_writes_on_disk(s3, cache, run_cli, tmp_path):
    from tests.s3 import download, upload

    url = upload(s3, cache, "condition-sets")
    result = run_cli(["embed", url, "--condition", "first-frame"])
    assert result.exit_code == 0, result.output
    verified = run_cli(["verify", url])
    assert verified.exit_code == 0 and "condition set first-frame" in verified.output, verified.output
    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    assert torch.equal(LatentCache(url)[0]["condition/first-frame"], LatentCache(cache)[0]["condition/first-frame"])
    fetched = download(s3, url, tmp_path / "fetched")
    assert {k: v for k, v in files_of(fetched).items() if k.startswith("conditions/")} == \
        {k: v for k, v in files_of(cache).items() if k.startswith("conditions/")}


def test_what_embed_refuses_in_one_line_before_writing(cache, run_cli):
    before = files_of(cache)
    for args, message in (
            (["--condition", "last-frame"], "unknown kind last-frame; the kinds are first-frame, first-last, "
                                            "image-features"),
            (["--vae", "builtin:tiny"], "--vae applies to --condition first-frame or first-last"),
            (["--condition", "first-frame", "--dtype", "bf16", "--set", "x"],
             "--set, --dtype apply to --text-encoder (the text set)"),
            (["--condition", "first-frame", "--image-convention", "wan-musubi"],
             "--image-convention applies to --condition image-features"),
            ([], "embed needs --text-encoder SPEC (caption embeddings) and/or --condition KIND"),
            (["--condition", "first-frame", "--vae", "builtin:small"], "does not match the VAE recorded")):
        result = run_cli(["embed", cache, *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["vae"]["family"] = "AutoencoderKLLTXVideo"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    other = run_cli(["embed", cache, "--condition", "first-frame"])
    refusal = " ".join(other.output.split())
    assert other.exit_code == 2 and "image-to-video conditions follow" in refusal
    assert "diffusers WanImageToVideoPipeline.prepare_latents" in refusal
    (cache / "manifest.json").write_bytes(before["manifest.json"])
    assert files_of(cache) == before


def test_the_mask_and_normalization_are_the_pipelines_for_every_frame_count():
    from vaecache.conditions.kinds import condition_video
    from vaecache.models._wan_conditions import condition_mask

    for count in (1, 5, 9, 81):
        mask = condition_mask("first-frame", count, 4, 2, 3)
        assert mask.shape == (4, (count - 1) // 4 + 1, 2, 3)
        assert mask[:, 0].all() and not mask[:, 1:].any()
    last = condition_mask("first-last", 9, 4, 1, 1)[:, :, 0, 0]
    assert last.tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 1]]  # the last frame is the last latent's 4th
    frames = torch.arange(2 * 3 * 5 * 2 * 2, dtype=torch.float32).view(2, 3, 5, 2, 2)
    video = condition_video(frames, "first-last")
    assert torch.equal(video[:, :, 0], frames[:, :, 0]) and torch.equal(video[:, :, -1], frames[:, :, -1])
    assert not video[:, :, 1:-1].any()


def test_the_musubi_export_writes_musubis_i2v_latents_image_and_refuses_first_last(cache, run_cli, tmp_path):
    """musubi-tuner's Wan I2V caching (wan_cache_latents.py:48-79, commit 30c658c): a 4-channel frame mask in the VAE's
    dtype (ones on the first latent frame), then the condition video's latent normalized by its WanVAE as the latents
    are, under latents_image_{F}x{H}x{W}_{dtype}. scripts/check_musubi_export.py runs musubi's own code on it."""
    from safetensors import safe_open

    from tests.export.test_export import musubi_wan_normalized

    assert run_cli(["embed", cache, "--condition", "first-frame,first-last"]).exit_code == 0
    refused = run_cli(["export", cache, "--format", "musubi", "--out", tmp_path / "no", "--condition", "first-last"])
    assert refused.exit_code == 2 and "musubi-tuner caches no first-last (FLF2V) condition" in \
        " ".join(refused.output.split())
    assert not (tmp_path / "no").exists()
    target = tmp_path / "musubi"
    result = run_cli(["export", cache, "--format", "musubi", "--out", target])
    assert result.exit_code == 0 and "I2V latents_image of condition set 'first-frame'" in result.output
    latents = LatentCache(cache)
    index = [json.loads(line) for line in (target / "index.jsonl").read_text().splitlines()]
    assert len(index) == 6
    for entry in index:
        view = latents.record(entry["clip"])["cameras"].index(entry["camera"])
        condition = latents.condition(entry["clip"], "first-frame", normalized=False)[view]
        with safe_open(str(target / entry["file"]), "pt") as handle:
            image = handle.get_tensor("latents_image_3x8x8_float32")
        assert image.shape == (20, 3, 8, 8)
        assert image[:4, 0].eq(1).all() and not image[:4, 1:].any()
        assert torch.equal(image[4:], musubi_wan_normalized(condition, latents.normalization))
    plain = run_cli(["export", cache, "--format", "musubi", "--out", tmp_path / "t2v", "--condition", "none"])
    assert plain.exit_code == 0
    with safe_open(str(tmp_path / "t2v" / index[0]["file"]), "pt") as handle:
        assert list(handle.keys()) == ["latents_3x8x8_float32"]


def test_the_webdataset_export_carries_each_condition_set_read_back_as_latentcache_gives_it(cache, run_cli, tmp_path):
    import webdataset

    from vaecache.export.webdataset import decode_sample

    assert run_cli(["embed", cache, "--condition", "first-frame,first-last"]).exit_code == 0
    dest = tmp_path / "wds"
    assert run_cli(["export", cache, "--format", "webdataset", "--out", dest, "--energon", "off"]).exit_code == 0
    latents = LatentCache(cache)
    samples = [decode_sample(s) for s in webdataset.WebDataset(sorted(str(p) for p in dest.glob("*.tar")),
                                                               shardshuffle=False)]
    assert len(samples) == len(latents)
    for sample in samples:
        item = latents[sample["record"]["id"]]
        for kind in ("first-frame", "first-last"):
            assert torch.equal(sample[f"condition/{kind}"], item[f"condition/{kind}"])


def test_encode_with_condition_adds_the_set_embed_adds_afterwards(demo_data, cache, run_cli, tmp_path):
    from tests.conftest import ENCODE_ARGS

    out = tmp_path / "together"
    result = run_cli(["encode", demo_data, "--out", out, *ENCODE_ARGS, "--condition", "first-frame"])
    assert result.exit_code == 0, result.output
    assert "condition set 'first-frame' added: 3 clips, 6 views" in result.output
    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    assert files_of(out / "conditions") == files_of(cache / "conditions")
    bad = run_cli(["encode", demo_data, "--out", tmp_path / "never", *ENCODE_ARGS, "--condition", "clip"])
    assert bad.exit_code == 2 and "unknown kind clip" in bad.output
    assert not (tmp_path / "never").exists()
    missing = run_cli(["encode", demo_data, "--out", tmp_path / "never", *ENCODE_ARGS, "--condition", "image-features",
                       "--image-encoder", f"diffusers:{tmp_path / 'no-such-folder'}"])
    assert missing.exit_code == 2 and "no-such-folder is not a folder" in " ".join(missing.output.split())
    assert not (tmp_path / "never" / "shards").exists()  # refused at start-up, before any clip was encoded


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    from tests.conditions.tiny_image import build_clip_pipeline_folder

    return build_clip_pipeline_folder(tmp_path_factory.mktemp("clip") / "wan-i2v")


def test_image_features_equal_diffusers_encode_image_per_camera(cache, clip_folder, run_cli, tmp_path):
    """wan-diffusers: WanImageToVideoPipeline.encode_image (its unbound function) on the first frame as an 8-bit
    image; framepack-diffusers: HunyuanVideoFramepackPipeline.encode_image on the [-1, 1] frame. Bitwise."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_framepack import HunyuanVideoFramepackPipeline
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
    from PIL import Image
    from transformers import AutoImageProcessor, CLIPVisionModel, SiglipVisionModel

    from tests.conditions.tiny_image import build_siglip_folder

    result = run_cli(["embed", cache, "--condition", "image-features", "--image-encoder", f"diffusers:{clip_folder}"])
    assert result.exit_code == 0, result.output
    latents = LatentCache(cache)
    encoder = CLIPVisionModel.from_pretrained(clip_folder / "image_encoder").eval()
    processor = AutoImageProcessor.from_pretrained(clip_folder / "image_processor")
    pipeline = types.SimpleNamespace(image_encoder=encoder, _execution_device=torch.device("cpu"),
                                     image_processor=processor)
    for item in latents:
        features = item["condition/image-features"]
        assert features.shape == (2, 5, 32) and features.dtype == torch.float32
        frames = latents.source_frames(item.id)
        for view in range(2):
            image = Image.fromarray(((frames[view, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
                                    .permute(1, 2, 0).numpy())
            with torch.no_grad():
                expected = WanImageToVideoPipeline.encode_image(pipeline, image, torch.device("cpu"))
            assert torch.equal(features[view], expected[0])
    assert run_cli(["verify", cache, "--reencode", "2"]).exit_code == 0

    siglip = build_siglip_folder(tmp_path / "siglip")
    other = run_cli(["embed", cache, "--condition", "image-features", "--image-encoder", f"transformers:{siglip}",
                     "--image-convention", "framepack-diffusers"])
    assert other.exit_code == 2 and "--replace replaces it" in " ".join(other.output.split())
    assert run_cli(["embed", cache, "--condition", "image-features", "--image-encoder", f"transformers:{siglip}",
                    "--image-convention", "framepack-diffusers", "--replace"]).exit_code == 0
    latents = LatentCache(cache)
    framepack = types.SimpleNamespace(image_encoder=SiglipVisionModel.from_pretrained(siglip).eval(),
                                      _execution_device=torch.device("cpu"),
                                      feature_extractor=AutoImageProcessor.from_pretrained(siglip))
    item = latents[0]
    frames = latents.source_frames(item.id)
    with torch.no_grad():
        expected = HunyuanVideoFramepackPipeline.encode_image(framepack, frames[:, :, 0], torch.device("cpu"),
                                                              torch.float32)
    assert item["condition/image-features"].shape == (2, 4, 32)
    assert torch.equal(item["condition/image-features"], expected)
    assert run_cli(["verify", cache]).exit_code == 0


def test_musubi_convention_features_go_into_the_musubi_export_and_the_diffusers_ones_are_left_out(
        cache, clip_folder, run_cli, tmp_path):
    """wan-musubi: wan_cache_latents.py:48-57 and wan/modules/clip.py:537-546 (commit 30c658c) squash the [-1, 1]
    frame to the image size with bicubic F.interpolate, map it to [0, 1], normalize, and keep the output of all blocks
    but the last; musubi stores it as float16 under clip_<the latent's dtype>."""
    from safetensors import safe_open
    from transformers import CLIPVisionModel

    spec = ["--image-encoder", f"diffusers:{clip_folder}"]
    assert run_cli(["embed", cache, "--condition", "first-frame,image-features", *spec]).exit_code == 0
    other = run_cli(["export", cache, "--format", "musubi", "--out", tmp_path / "diffusers-features"])
    assert other.exit_code == 0 and "--image-convention wan-musubi" in " ".join(other.output.split())
    for path in (tmp_path / "diffusers-features" / "cache").glob("*_wan.safetensors"):
        with safe_open(str(path), "pt") as handle:  # latents_image written, the other convention's features not
            assert sorted(handle.keys()) == ["latents_3x8x8_float32", "latents_image_3x8x8_float32"]
    assert run_cli(["embed", cache, "--condition", "image-features", *spec, "--image-convention", "wan-musubi",
                    "--replace"]).exit_code == 0
    latents = LatentCache(cache)
    encoder = CLIPVisionModel.from_pretrained(clip_folder / "image_encoder").eval()
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    target = tmp_path / "musubi"
    assert run_cli(["export", cache, "--format", "musubi", "--out", target]).exit_code == 0
    for entry in (json.loads(line) for line in (target / "index.jsonl").read_text().splitlines()):
        frames = latents.source_frames(entry["clip"])
        view = latents.record(entry["clip"])["cameras"].index(entry["camera"])
        x = torch.nn.functional.interpolate(frames[view:view + 1, :, 0], size=(28, 28), mode="bicubic",
                                            align_corners=False).mul_(0.5).add_(0.5)
        with torch.no_grad():
            expected = encoder(pixel_values=(x - mean) / std, output_hidden_states=True).hidden_states[-2][0]
        with safe_open(str(target / entry["file"]), "pt") as handle:
            assert sorted(handle.keys()) == ["clip_float32", "latents_3x8x8_float32", "latents_image_3x8x8_float32"]
            assert torch.equal(handle.get_tensor("clip_float32"), expected.half())


def test_image_feature_options_are_refused_in_one_line(cache, clip_folder, run_cli, tmp_path):
    for args, message in (
            (["--condition", "image-features"], "--condition image-features needs --image-encoder SPEC"),
            (["--condition", "image-features", "--image-encoder", str(clip_folder)],
             "--image-encoder must be diffusers:PATH or transformers:PATH"),
            (["--condition", "image-features", "--image-encoder", f"diffusers:{clip_folder}", "--image-convention",
              "hunyuan"], "--image-convention must be one of wan-diffusers, wan-musubi, wan-flf2v-diffusers, "
                          "framepack-diffusers"),
            (["--condition", "image-features", "--image-encoder", f"diffusers:{clip_folder}", "--image-convention",
              "framepack-diffusers"], "needs a SigLIP vision model, this is clip_vision_model"),
            (["--condition", "first-frame", "--image-encoder", f"diffusers:{clip_folder}"],
             "--image-encoder applies to --condition image-features"),
            (["--condition", "image-features", "--image-encoder", f"diffusers:{tmp_path}"],
             "image_encoder/ and image_processor/")):
        result = run_cli(["embed", cache, *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (args, result.output)
    assert not (cache / "conditions").exists()


def test_latentcache_checks_a_set_shard_when_it_first_opens_it_as_it_checks_latent_shards(cache, run_cli):
    from vaecache.errors import ShardChecksumError

    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    entry = json.loads((cache / "manifest.json").read_text())["conditions"]["first-frame"]["shards"][0]
    shard = cache / entry["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data: the same size
    shard.write_bytes(bytes(data))
    LatentCache(cache)[0]  # "size" (the default) cannot tell
    with pytest.raises(ShardChecksumError, match="sha256 differs from the one manifest.json records"):
        LatentCache(cache, verify="sha256")[0]
    shard.write_bytes(bytes(data[:-4]))
    with pytest.raises(ShardChecksumError, match=f"{entry['bytes'] - 4} bytes, manifest.json records"):
        LatentCache(cache)[0]


def test_verify_names_a_set_made_with_another_vae_than_the_caches_as_stale(cache, run_cli):
    assert run_cli(["embed", cache, "--condition", "first-frame"]).exit_code == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["conditions"]["first-frame"]["fingerprint"]["vae"]["weights_sha256"] = "0" * 64
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    assert bad.exit_code == 1 and "made with another VAE or frame rule than the cache's now" in \
        " ".join(bad.output.split())
    manifest["conditions"]["first-frame"]["fingerprint"]["vae"] = {
        k: v for k, v in manifest["vae"].items() if k not in ("spec", "encoder_variant")}
    manifest["conditions"]["first-frame"]["shard_bytes"] += 1  # as if cut otherwise: the generation is not this one
    (cache / "manifest.json").write_text(json.dumps(manifest))
    stale = run_cli(["verify", cache])
    assert stale.exit_code == 1 and "made from other clips than the cache holds now" in " ".join(stale.output.split())
