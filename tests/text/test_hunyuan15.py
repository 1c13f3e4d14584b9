"""The HunyuanVideo 1.5 family: Qwen2.5-VL's rows of the prompt in the pipeline's chat template (hidden_states[-3],
108 rows cropped) and ByT5's rows of its quoted glyph text, bit for bit what diffusers' HunyuanVideo15Pipeline
computes; stored trimmed to their masks, read back padded with the masks, verified, re-embedded."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.text.tiny_text import build_hunyuan15_text_folder, build_wan_text_folder
from vaecache.errors import UsageError
from vaecache.models.hunyuanvideo15 import SYSTEM_MESSAGE as HUNYUAN15_SYSTEM
from vaecache.text.encoder import load_text_encoder

PROMPTS = ["a red car drives down a wet street at night", "",
           'a sign that reads "OPEN" and a poster saying “SALE”, then "OPEN" again',
           "pedestrians cross at a crosswalk " * 120, 'one word: "x"']


@pytest.fixture(scope="module")
def hunyuan15_text(tmp_path_factory):
    return build_hunyuan15_text_folder(tmp_path_factory.mktemp("text") / "hv15")


def diffusers_hunyuan15(folder, prompts):
    """diffusers' own _get_mllm_prompt_embeds and _get_byt5_prompt_embeds with encode_prompt's arguments."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline
    from transformers import AutoTokenizer, ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

    with torch.no_grad():
        embeds, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(
            Qwen2_5_VLTextModel.from_pretrained(folder / "text_encoder").eval(),
            AutoTokenizer.from_pretrained(folder / "tokenizer"), prompts, "cpu", tokenizer_max_length=1000,
            system_message=HUNYUAN15_SYSTEM, crop_start=108)
        glyph, glyph_mask = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
            ByT5Tokenizer.from_pretrained(folder / "tokenizer_2"),
            T5EncoderModel.from_pretrained(folder / "text_encoder_2").eval(), prompts, "cpu", tokenizer_max_length=256)
    return embeds, mask, glyph, glyph_mask


def test_the_system_message_is_the_pipelines():
    import inspect

    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline

    signature = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    assert signature.parameters["system_message"].default == HUNYUAN15_SYSTEM
    assert signature.parameters["crop_start"].default == 108


@pytest.mark.parametrize("batch", [1, 3])
def test_qwen_and_byt5_rows_equal_diffusers_bit_for_bit(hunyuan15_text, batch):
    encoder = load_text_encoder(f"diffusers:{hunyuan15_text}", batch=batch)
    embeds, mask, glyph, glyph_mask = diffusers_hunyuan15(hunyuan15_text, PROMPTS)
    for i, embedding in enumerate(encoder.embed(PROMPTS)):
        tokens, glyph_tokens = int(mask[i].sum()), int(glyph_mask[i].sum())
        assert embedding.tokens == tokens and torch.equal(embedding.rows, embeds[i, :tokens])
        assert embedding.glyph_tokens == glyph_tokens and torch.equal(embedding.glyph, glyph[i, :glyph_tokens])
        assert bool(mask[i, tokens:].any()) is False  # trimmed rows: the mask's are the first ones
    assert [e.glyph_tokens > 0 for e in encoder.embed(PROMPTS)] == [False, False, True, False, True]
    assert [e.truncated for e in encoder.embed(PROMPTS)] == [False, False, False, True, False]
    fingerprint = encoder.fingerprint()
    assert fingerprint["family"] == "hunyuanvideo-1.5" and fingerprint["crop_start"] == 108
    assert fingerprint["glyph"] == {"length": 256, "hidden_size": 24}
    assert fingerprint["glyph_encoder"]["class"] == "T5EncoderModel" and fingerprint["chat_system"] == HUNYUAN15_SYSTEM


def test_a_set_reads_back_padded_verifies_and_reembeds(caption_cache, hunyuan15_text, run_cli, tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.conftest import CAPTIONS
    from vaecache.training import LatentCache

    cache = tmp_path / "cache"
    shutil.copytree(caption_cache, cache)
    captions = tmp_path / "captions.json"
    latents = LatentCache(cache)
    quoted = {clip: f'{CAPTIONS[latents.record(clip)["scene"]]} with a sign reading "STOP"' if n % 2 else
              CAPTIONS[latents.record(clip)["scene"]] for n, clip in enumerate(latents.ids())}
    import json

    captions.write_text(json.dumps(quoted))
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{hunyuan15_text}", "--captions", captions])
    assert result.exit_code == 0, result.output
    latents = LatentCache(cache)
    prompts = [quoted[clip] for clip in latents.ids()]
    embeds, mask, glyph, glyph_mask = diffusers_hunyuan15(hunyuan15_text, prompts)
    for i, item in enumerate(latents):
        tokens = int(mask[i].sum())
        assert torch.equal(item["text/default"][:tokens], embeds[i, :tokens])
        assert torch.equal(item["text_mask/default"], mask[i].bool())
        assert not item["text/default"][tokens:].any()  # zeros where the transformer zeroes the padding
        glyph_tokens = int(glyph_mask[i].sum())
        assert item["text_glyph/default"].shape == (256, 24)
        assert torch.equal(item["text_glyph/default"][:glyph_tokens], glyph[i, :glyph_tokens])
        assert torch.equal(item["text_glyph_mask/default"], glyph_mask[i].bool())
    assert run_cli(["verify", cache, "--reencode", "3"]).exit_code == 0
    import webdataset

    from vaecache.export.webdataset import decode_sample

    exported = run_cli(["export", cache, "--format", "webdataset", "--out", tmp_path / "wds", "--energon", "off"])
    assert exported.exit_code == 0, exported.output
    for sample in webdataset.WebDataset(sorted(str(p) for p in (tmp_path / "wds").glob("*.tar")), shardshuffle=False):
        sample = decode_sample(sample)
        item = latents[sample["record"]["id"]]
        for key in ("text/default", "text_mask/default", "text_glyph/default", "text_glyph_mask/default"):
            assert torch.equal(sample[key], item[key]), key
    shard = next((cache / "text" / "default").rglob("embeddings-*.safetensors"))
    state = load_file(shard)
    removed = next(key for key in sorted(state) if key.endswith("/glyph"))
    save_file({k: v for k, v in state.items() if k != removed}, shard)
    result = run_cli(["verify", cache])
    assert result.exit_code == 1 and removed[:12] in result.output


def musubi_hv15_reference(folder, prompt):
    """musubi-tuner's hv_1_5_cache_text_encoder_outputs.encode_and_save_batch for one prompt, as its
    hunyuan_video_1_5_text_encoder.py (30c658c) writes it: get_qwen_tokens (PROMPT_TEMPLATE_VIDEO.format(prompt),
    the crop found after the tokens of "<|im_start|>user\\n" in the template filled with "a photo of a cat",
    max_length 1024 + crop, padding to the longest), hidden_states[-3] cropped, rows [:mask.sum()];
    get_byt5_text_tokens (straight-quoted then curly-quoted texts, `Text "x". ` each, 128 tokens; nothing for an
    empty prompt) and the rows [:mask.sum()]. scripts/check_musubi_export.py runs musubi's own code."""
    import re

    from transformers import AutoTokenizer, ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

    from vaecache.models.hunyuanvideo15 import MUSUBI_TEMPLATE as MUSUBI_HUNYUAN15_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    example = tokenizer(MUSUBI_HUNYUAN15_TEMPLATE.format("a photo of a cat"), max_length=1024 + 256, padding=True,
                        truncation=True, return_tensors="pt").input_ids[0].tolist()
    marker = tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    drop = next(i + len(marker) for i in range(len(example) - len(marker) + 1) if example[i:i + len(marker)] == marker)
    tokens = tokenizer([MUSUBI_HUNYUAN15_TEMPLATE.format(prompt)], max_length=1024 + drop, padding=True,
                       truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = Qwen2_5_VLTextModel.from_pretrained(folder / "text_encoder").eval()(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        ).hidden_states[-3][:, drop:]
    rows = hidden[0, :int(tokens.attention_mask[0, drop:].sum())]
    texts = (re.findall(r"\"(.*?)\"", prompt) + re.findall(r"“(.*?)”", prompt)) if prompt else []
    if not texts:
        return rows, None
    glyph = ByT5Tokenizer.from_pretrained(folder / "tokenizer_2")(
        "".join(f'Text "{text}". ' for text in texts), padding="max_length", max_length=128, truncation=True,
        add_special_tokens=True, return_tensors="pt")
    with torch.no_grad():
        byt5 = T5EncoderModel.from_pretrained(folder / "text_encoder_2").eval()(
            glyph.input_ids, attention_mask=glyph.attention_mask.float())[0]
    return rows, byt5[0, :int(glyph.attention_mask.sum())]


def test_the_musubi_convention_is_musubis_own_embedding(hunyuan15_text):
    """--text-convention musubi: rows within float rounding of musubi's (it pads to the longest prompt, vaecache to
    the fixed length: the causal model's rows are the same arithmetic over another sequence length)."""
    encoder = load_text_encoder(f"diffusers:{hunyuan15_text}", batch=2, convention="musubi")
    assert encoder.fingerprint()["family"] == "hunyuanvideo-1.5-musubi"
    assert encoder.fingerprint()["glyph"] == {"length": 128, "hidden_size": 24, "order": "musubi"}
    prompts = PROMPTS[:3] + ['first “curly” then "straight"']
    for prompt, embedding in zip(prompts, encoder.embed(prompts)):
        rows, glyph = musubi_hv15_reference(hunyuan15_text, prompt)
        assert embedding.rows.shape == rows.shape
        assert float((embedding.rows - rows).abs().max()) <= 1e-5 * float(rows.abs().max())
        if glyph is None:
            assert embedding.glyph.shape[0] == 0
        else:
            assert embedding.glyph.shape == glyph.shape
            assert float((embedding.glyph - glyph).abs().max()) <= 1e-5 * float(glyph.abs().max())
    wan = build_wan_text_folder(hunyuan15_text.parent / "wan")
    with pytest.raises(UsageError,
                       match=r"--text-convention musubi applies to HunyuanVideo \(and FramePack\), HunyuanVideo 1.5"):
        load_text_encoder(f"diffusers:{wan}", convention="musubi")
