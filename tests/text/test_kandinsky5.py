"""The Kandinsky 5 family: Qwen2.5-VL's rows of one prompt alone (the template, the pipeline's own text truncation,
no attention mask, hidden_states[-1] from row 128) and CLIP-L's pooled output, bit for bit diffusers'
Kandinsky5T2VPipeline.encode_prompt; musubi's convention (the authors' template, crop 129); stored, verified,
re-embedded, exported as musubi's k5 text caches."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from tests.text.tiny_text import build_kandinsky5_text_folder
from vaecache.errors import UsageError
from vaecache.models.kandinsky5 import MUSUBI_IMAGE_TEMPLATE as MUSUBI_KANDINSKY5_IMAGE_TEMPLATE
from vaecache.models.kandinsky5 import MUSUBI_TEMPLATE as MUSUBI_KANDINSKY5_TEMPLATE
from vaecache.models.kandinsky5 import PROMPT_TEMPLATE as KANDINSKY5_TEMPLATE
from vaecache.text.clip_slow import SlowClipTokenizer
from vaecache.text.encoder import load_text_encoder
from vaecache.training import LatentCache

PROMPTS = ["a red car drives down a wet street at night", "", "  the robot &amp; arm   picks it up  ",
           "pedestrians cross at a crosswalk " * 60]


@pytest.fixture(scope="module")
def kandinsky5_text(tmp_path_factory):
    return build_kandinsky5_text_folder(tmp_path_factory.mktemp("text") / "k5")


def parts(folder):
    from transformers import AutoTokenizer, CLIPTextModel, Qwen2_5_VLForConditionalGeneration

    return (AutoTokenizer.from_pretrained(folder / "tokenizer"),
            Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder").eval(),
            AutoTokenizer.from_pretrained(folder / "tokenizer_2"),
            CLIPTextModel.from_pretrained(folder / "text_encoder_2").eval())


def diffusers_kandinsky5(folder, prompt):
    """diffusers' own encode_prompt on one prompt (unbound, with the attributes it reads): (rows, pooled,
    cu_seqlens)."""
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky import Kandinsky5T2VPipeline

    tokenizer, model, tokenizer_2, model_2 = parts(folder)
    pipeline = types.SimpleNamespace(tokenizer=tokenizer, text_encoder=model, tokenizer_2=tokenizer_2,
                                     text_encoder_2=model_2, _execution_device=torch.device("cpu"),
                                     prompt_template=KANDINSKY5_TEMPLATE, prompt_template_encode_start_idx=128)
    pipeline._encode_prompt_qwen = lambda **kw: Kandinsky5T2VPipeline._encode_prompt_qwen(pipeline, **kw)
    pipeline._encode_prompt_clip = lambda **kw: Kandinsky5T2VPipeline._encode_prompt_clip(pipeline, **kw)
    with torch.no_grad():
        rows, pooled, cu_seqlens = Kandinsky5T2VPipeline.encode_prompt(pipeline, prompt, max_sequence_length=512,
                                                                       dtype=torch.float32)
    return rows[0], pooled[0], cu_seqlens


def test_the_template_is_the_pipelines():
    import inspect

    from diffusers.pipelines.kandinsky5.pipeline_kandinsky import Kandinsky5T2VPipeline

    source = inspect.getsource(Kandinsky5T2VPipeline.__init__)
    assert all(line.split("\n")[-1] in source for line in KANDINSKY5_TEMPLATE.split("\n")[1:7])
    assert "self.prompt_template_encode_start_idx = 128" in source


def test_each_prompt_equals_diffusers_encode_prompt_bit_for_bit(kandinsky5_text):
    encoder = load_text_encoder(f"diffusers:{kandinsky5_text}")
    for prompt, embedding in zip(PROMPTS, encoder.embed([encoder.clean(p) for p in PROMPTS])):
        rows, pooled, cu_seqlens = diffusers_kandinsky5(kandinsky5_text, prompt)
        assert torch.equal(embedding.rows, rows) and torch.equal(embedding.pooled, pooled), prompt
        assert cu_seqlens.tolist() == [0, embedding.tokens]  # the length the pipeline's cu_seqlens keeps
    assert [e.truncated for e in encoder.embed([encoder.clean(p) for p in PROMPTS])] == [False, False, False, True]
    fingerprint = encoder.fingerprint()
    assert fingerprint["family"] == "kandinsky5" and fingerprint["batch_shape"] == ["each prompt alone, unpadded"]
    assert fingerprint["pooled"] == {"length": 77, "hidden_size": 24, "masked": True}


def musubi_kandinsky5(folder, prompt, template=MUSUBI_KANDINSKY5_TEMPLATE, crop=129):
    """musubi's Kandinsky5TextEmbedder.encode for one video caption as its text_embedders.py (30c658c) writes it:
    the authors' video template, crop 129, the processor at max_length 512 + 129 padded to it, the model without an
    attention mask, hidden_states[-1][:, 129:], rows where the mask is set; CLIP pooler_output at 77 with the mask.
    scripts/check_musubi_export.py runs musubi's own code."""
    tokenizer, model, tokenizer_2, model_2 = parts(folder)
    inputs = tokenizer([template.format(prompt)], max_length=512 + crop, truncation=True,
                       return_tensors="pt", padding="max_length")
    with torch.no_grad():
        hidden = model(input_ids=inputs["input_ids"], return_dict=True, output_hidden_states=True)["hidden_states"]
        rows = hidden[-1][0, crop:][inputs["attention_mask"][0, crop:].bool()]
        # musubi's pinned transformers tokenizes CLIP with the slow class (test_clip_slow.py holds vaecache's copy of
        # it against transformers 4.57's own): "&amp;" is "&" there
        clip = SlowClipTokenizer.like(tokenizer_2)([prompt], max_length=77, truncation=True, padding="max_length",
                                                   return_tensors="pt")
        pooled = model_2(**clip)["pooler_output"][0]
    return rows, pooled


def test_the_musubi_convention_is_musubis_own_embedding(kandinsky5_text):
    encoder = load_text_encoder(f"diffusers:{kandinsky5_text}", batch=2, convention="musubi")
    assert encoder.fingerprint()["family"] == "kandinsky5-musubi"
    for prompt, embedding in zip(PROMPTS, encoder.embed(PROMPTS)):
        rows, pooled = musubi_kandinsky5(kandinsky5_text, prompt)
        # the same arithmetic on the same padded length; a batch of 2 against musubi's batch of 1 may round apart
        for ours, theirs in ((embedding.rows, rows), (embedding.pooled, pooled)):
            assert ours.shape == theirs.shape
            assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_the_image_template_is_what_musubis_caching_script_embeds_with(kandinsky5_text):
    """musubi's kandinsky5_cache_text_encoder_outputs.py picks the image template (crop 41) for batches without a
    frame count, which its caching builds: --k5-template image stores that; the pipeline convention refuses it."""
    encoder = load_text_encoder(f"diffusers:{kandinsky5_text}", batch=2, convention="musubi", k5_template="image")
    fingerprint = encoder.fingerprint()
    assert fingerprint["template"] == MUSUBI_KANDINSKY5_IMAGE_TEMPLATE and fingerprint["crop_start"] == 41
    for prompt, embedding in zip(PROMPTS, encoder.embed(PROMPTS)):
        rows, pooled = musubi_kandinsky5(kandinsky5_text, prompt, MUSUBI_KANDINSKY5_IMAGE_TEMPLATE, 41)
        for ours, theirs in ((embedding.rows, rows), (embedding.pooled, pooled)):
            assert ours.shape == theirs.shape
            assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    video = load_text_encoder(f"diffusers:{kandinsky5_text}", batch=2, convention="musubi", k5_template="video")
    assert video.fingerprint()["crop_start"] == 129
    with pytest.raises(UsageError, match="--k5-template applies to a Kandinsky 5 pipeline with --text-convention"):
        load_text_encoder(f"diffusers:{kandinsky5_text}", k5_template="image")


def test_a_set_reads_back_verifies_reembeds_and_exports_as_musubis_k5_text_caches(demo_data, kandinsky5_text,
                                                                                  run_cli, tmp_path):
    from diffusers import AutoencoderKLHunyuanVideo
    from safetensors import safe_open

    from tests.conftest import caption_metadata
    from tests.export.test_export import HUNYUAN_TINY

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(tmp_path / "vae")  # Kandinsky 5 trains on its latents
    index = tmp_path / "index.jsonl"
    index.write_text("".join(json.dumps({"id": scene.name, **caption_metadata(scene.name),
                                         "cameras": {v.stem: str(v) for v in sorted(scene.glob("*.mp4"))}}) + "\n"
                             for scene in sorted(demo_data.iterdir())))
    cache = tmp_path / "cache"
    result = run_cli(["encode", index, "--out", cache, "--vae", f"diffusers:{tmp_path / 'vae'}", "--model",
                      "kandinsky5", "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    for name, convention in (("pipeline", "pipeline"), ("musubi", "musubi")):
        result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{kandinsky5_text}", "--set", name,
                          "--text-convention", convention])
        assert result.exit_code == 0, result.output
    latents = LatentCache(cache)
    from tests.conftest import CAPTIONS

    for item in latents:
        rows, pooled, _ = diffusers_kandinsky5(kandinsky5_text, CAPTIONS[item.scene])
        stored = item["text/pipeline"]
        assert torch.equal(stored[:rows.shape[0]], rows) and not stored[rows.shape[0]:].any()
        assert int(item["text_mask/pipeline"].sum()) == rows.shape[0]
        assert torch.equal(item["text_pooled/pipeline"], pooled)
    assert run_cli(["verify", cache, "--reencode", "2"]).exit_code == 0
    refused = run_cli(["export", cache, "--format", "musubi", "--arch", "k5", "--text-set", "pipeline", "-o",
                       tmp_path / "no"])
    assert refused.exit_code == 2 and "--text-convention musubi" in refused.output
    result = run_cli(["export", cache, "--format", "musubi", "--arch", "k5", "--text-set", "musubi", "-o",
                      tmp_path / "k5"])
    assert result.exit_code == 0, result.output
    texts = latents.sets()["text"]["musubi"]
    index_lines = [json.loads(line) for line in (tmp_path / "k5" / "index.jsonl").read_text().splitlines()]
    for entry in index_lines:
        with safe_open(str(tmp_path / "k5" / "cache" / f"{entry['item']}_k5_te.safetensors"), "pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        rows = texts.rows(entry["clip"])
        assert sorted(tensors) == ["attention_mask", "pooled_embed_float32", "text_embeds_float32"]
        assert torch.equal(tensors["text_embeds_float32"], rows)
        assert torch.equal(tensors["pooled_embed_float32"], texts.pooled(entry["clip"]))
        assert tensors["attention_mask"].dtype == torch.bool and tensors["attention_mask"].shape == (rows.shape[0],)
    shutil.rmtree(tmp_path / "k5")
