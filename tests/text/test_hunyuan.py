"""The HunyuanVideo family: the LLM's hidden state through its prompt template (cropped) and CLIP-L's pooled output,
bit for bit what diffusers' HunyuanVideoPipeline computes, stored as a set, read back, verified and exported in
musubi-tuner's HunyuanVideo keys."""

from __future__ import annotations

import hashlib
import json
import types

import pytest
import torch

from tests.conftest import CAPTIONS
from tests.text.tiny_text import build_hunyuan_text_folder
from vaecache.text.encoder import load_text_encoder
from vaecache.training import LatentCache


@pytest.fixture(scope="module")
def hunyuan_text(tmp_path_factory):
    return build_hunyuan_text_folder(tmp_path_factory.mktemp("text") / "hunyuan")


def diffusers_hunyuan(folder, prompts):
    """diffusers' own _get_llama_prompt_embeds and _get_clip_prompt_embeds (unbound, with the attributes they read)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE, HunyuanVideoPipeline
    from transformers import AutoTokenizer, CLIPTextModel, LlamaModel

    pipeline = types.SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        text_encoder=LlamaModel.from_pretrained(folder / "text_encoder").eval(),
        tokenizer_2=AutoTokenizer.from_pretrained(folder / "tokenizer_2"),
        text_encoder_2=CLIPTextModel.from_pretrained(folder / "text_encoder_2").eval(), _execution_device="cpu")
    with torch.no_grad():
        embeds, mask = HunyuanVideoPipeline._get_llama_prompt_embeds(pipeline, prompts, DEFAULT_PROMPT_TEMPLATE)
        pooled = HunyuanVideoPipeline._get_clip_prompt_embeds(pipeline, prompts)
    return embeds, mask, pooled


@pytest.mark.parametrize("batch", [1, 3])
def test_llm_rows_and_clip_pooled_equal_diffusers_bit_for_bit(hunyuan_text, batch):
    prompts = ["a red car drives down a wet street at night", "", "the robot arm picks up the blue cube " * 12]
    encoder = load_text_encoder(f"diffusers:{hunyuan_text}", batch=batch)
    embeds, mask, pooled = diffusers_hunyuan(hunyuan_text, prompts)
    for i, embedding in enumerate(encoder.embed(prompts)):
        assert embedding.rows.shape == (256, 32) and torch.equal(embedding.rows, embeds[i])  # every row, as returned
        assert embedding.tokens == int(mask[i].sum()) and torch.equal(embedding.pooled, pooled[i])
    assert [e.pooled_truncated for e in encoder.embed(prompts)] == [False, False, True]  # CLIP-L's 77 tokens
    fingerprint = encoder.fingerprint()
    assert fingerprint["family"] == "hunyuanvideo" and fingerprint["layer"] == -3 and fingerprint["crop_start"] == 95
    assert fingerprint["pooled"] == {"length": 77, "hidden_size": 24}
    assert fingerprint["pooled_encoder"]["class"] == "CLIPTextModel"


def test_a_hunyuan_set_reads_back_verifies_and_exports_in_musubis_keys(demo_data, hunyuan_text, run_cli, tmp_path):
    from diffusers import AutoencoderKLHunyuanVideo
    from safetensors import safe_open
    from safetensors.torch import load, save

    from tests.conftest import caption_metadata
    from tests.export.test_export import HUNYUAN_TINY

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(tmp_path / "vae")  # musubi's hv trains on its latents
    index = tmp_path / "index.jsonl"
    index.write_text("".join(json.dumps({"id": scene.name, **caption_metadata(scene.name),
                                         "cameras": {v.stem: str(v) for v in sorted(scene.glob("*.mp4"))}}) + "\n"
                             for scene in sorted(demo_data.iterdir())))
    cache = tmp_path / "cache"
    encoded = run_cli(["encode", index, "--out", cache, "--vae", f"diffusers:{tmp_path / 'vae'}", "--num-frames", "5",
                       "--size", "32x32", "--workers", "0", "--no-progress"])
    assert encoded.exit_code == 0, encoded.output
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{hunyuan_text}"])
    assert result.exit_code == 0, result.output
    latents = LatentCache(cache)
    embeds, mask, pooled = diffusers_hunyuan(hunyuan_text, [CAPTIONS[item.scene] for item in latents])
    for i, item in enumerate(latents):
        assert torch.equal(item["text/default"], embeds[i]) and torch.equal(item["text_mask/default"], mask[i].bool())
        assert torch.equal(item["text_pooled/default"], pooled[i])
    assert run_cli(["verify", cache]).exit_code == 0

    target = tmp_path / "musubi"
    exported = run_cli(["export", cache, "--format", "musubi", "--out", target])
    assert exported.exit_code == 0, exported.output
    for entry in (json.loads(line) for line in (target / "index.jsonl").read_text().splitlines()):
        item = latents[entry["clip"]]
        with safe_open(str(target / "cache" / f"{entry['item']}_hv_te.safetensors"), "pt") as handle:
            assert sorted(handle.keys()) == ["clipL_float32", "clipL_mask", "llm_float32", "llm_mask"]
            assert handle.metadata()["architecture"] == "hunyuan_video"
            assert torch.equal(handle.get_tensor("llm_float32"), item["text/default"])
            assert torch.equal(handle.get_tensor("llm_mask"), item["text_mask/default"].long())
            assert torch.equal(handle.get_tensor("clipL_float32"), item["text_pooled/default"])
            clip_mask = handle.get_tensor("clipL_mask")
            assert clip_mask.shape == (77,) and clip_mask.dtype == torch.int64 and 0 < int(clip_mask.sum()) <= 77

    import webdataset

    from vaecache.export.webdataset import decode_sample

    wds = run_cli(["export", cache, "--format", "webdataset", "--out", tmp_path / "wds", "--energon", "off"])
    assert wds.exit_code == 0, wds.output
    for sample in webdataset.WebDataset(sorted(str(p) for p in (tmp_path / "wds").glob("*.tar")), shardshuffle=False):
        decoded = decode_sample(sample)
        item = latents[decoded["record"]["id"]]
        for key in ("text/default", "text_mask/default", "text_pooled/default"):
            assert torch.equal(decoded[key], item[key]), key

    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["text"]["default"]["shards"][0]
    shard = cache / entry["file"]
    tensors = load(shard.read_bytes())
    removed = sorted(key for key in tensors if key.endswith("/pooled"))[0]
    del tensors[removed]  # a pooled output removed, every hash recomputed
    shard.write_bytes(save(tensors, metadata={"vaecache_text_set": "default"}))
    entry.update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (cache / "manifest.json").write_text(json.dumps(manifest))
    bad = run_cli(["verify", cache])
    assert bad.exit_code == 1 and f"prompt {removed[:12]} has no pooled output" in bad.output


def test_musubis_convention_tokenizes_clip_as_its_pinned_transformers(demo_data, hunyuan_text, run_cli, tmp_path):
    """musubi's HunyuanVideo and FramePack caching tokenize CLIP prompts with transformers 4.57's slow class, which runs
    ftfy first: a caption with curly quotes gets other CLIP ids there. A set embedded in diffusers' convention is
    exported for hv only where no caption differs; --text-convention musubi stores musubi's pooled output."""
    from diffusers import AutoencoderKLHunyuanVideo
    from safetensors import safe_open
    from transformers import AutoTokenizer, CLIPTextModel

    from tests.export.test_export import HUNYUAN_TINY
    from vaecache.text.clip_slow import SlowClipTokenizer

    captions = {"scene_000": "a “SALE” sign &amp; a red car", "scene_001": "two cameras, one road",
                "scene_002": "night line two"}
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(tmp_path / "vae")
    index = tmp_path / "index.jsonl"
    index.write_text("".join(json.dumps({"id": scene.name, "caption": captions[scene.name],
                                         "cameras": {v.stem: str(v) for v in sorted(scene.glob("*.mp4"))}}) + "\n"
                             for scene in sorted(demo_data.iterdir())))
    cache = tmp_path / "cache"
    assert run_cli(["encode", index, "--out", cache, "--vae", f"diffusers:{tmp_path / 'vae'}", "--num-frames", "5",
                    "--size", "32x32", "--workers", "0", "--no-progress"]).exit_code == 0
    for name, convention in (("pipeline", "pipeline"), ("musubi", "musubi")):
        result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{hunyuan_text}", "--set", name,
                          "--text-convention", convention])
        assert result.exit_code == 0, result.output
    refused = run_cli(["export", cache, "--format", "musubi", "--text-set", "pipeline", "--out", tmp_path / "no"])
    assert refused.exit_code == 2 and "scene_000/000000-000004's prompt" in refused.output
    assert "--text-convention musubi --replace" in refused.output and not (tmp_path / "no").exists()
    latents = LatentCache(cache)
    tokenizer = SlowClipTokenizer.like(AutoTokenizer.from_pretrained(hunyuan_text / "tokenizer_2"))
    clip = CLIPTextModel.from_pretrained(hunyuan_text / "text_encoder_2").eval()
    texts = latents.sets()["text"]["musubi"]
    assert texts.entry["fingerprint"]["pooled_encoder"]["tokenization"]["name"] == "slow-clip"
    for item in latents:
        ids = tokenizer([captions[item.scene]], max_length=77, truncation=True, padding="max_length",
                        return_tensors="pt")["input_ids"]
        with torch.no_grad():
            pooled = clip(ids).pooler_output[0]
        assert torch.equal(item["text_pooled/musubi"], pooled)
        assert torch.equal(item["text/musubi"], item["text/pipeline"])  # the Llama rows are diffusers' in both
        differs = item.scene == "scene_000"
        assert torch.equal(item["text_pooled/musubi"], item["text_pooled/pipeline"]) != differs
    target = tmp_path / "hv"
    exported = run_cli(["export", cache, "--format", "musubi", "--text-set", "musubi", "--out", target])
    assert exported.exit_code == 0, exported.output
    for entry in (json.loads(line) for line in (target / "index.jsonl").read_text().splitlines()):
        with safe_open(str(target / "cache" / f"{entry['item']}_hv_te.safetensors"), "pt") as handle:
            assert torch.equal(handle.get_tensor("clipL_float32"), latents[entry["clip"]]["text_pooled/musubi"])
