"""vaecache/text/encoder.py against diffusers' own Wan prompt embedding, with a tiny UMT5 and a tokenizer trained in
the fixture: bit for bit in fp32, in any batch, the truncation counted; the refusals name what is supported."""

from __future__ import annotations

import json
import re
import types

import pytest
import torch

from tests.text.tiny_text import build_wan_text_folder
from vaecache.errors import UsageError, VaeSpecError
from vaecache.models.base import wan_prompt_clean
from vaecache.text.encoder import load_text_encoder

PROMPTS = ["a red car  drives &amp;amp; down\tthe street", "", "the robot arm picks up the blue cube " * 60, "dog",
           "caf\u00c3\u00a9 at night"]


@pytest.fixture(scope="module")
def wan_text(tmp_path_factory):
    return build_wan_text_folder(tmp_path_factory.mktemp("text") / "wan")


def reference(encoder, prompts):
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    pipe = types.SimpleNamespace(tokenizer=encoder.tokenizer, text_encoder=encoder.model,
                                 _execution_device=torch.device("cpu"))
    return WanPipeline._get_t5_prompt_embeds(pipe, prompt=prompts, max_sequence_length=512, device=torch.device("cpu"))


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_wan_rows_equal_diffusers_pipeline_embeds_bit_for_bit(wan_text, batch):
    encoder = load_text_encoder(f"diffusers:{wan_text}", batch=batch)
    ours = encoder.embed([encoder.clean(p) for p in PROMPTS])
    expected = reference(encoder, PROMPTS)
    assert [e.truncated for e in ours] == [False, False, True, False, False]
    for row, embedding in zip(expected, ours):
        assert torch.equal(row[:embedding.tokens], embedding.rows)
        assert not row[embedding.tokens:].any()  # the pipeline's padding rows are zeros: nothing stored is lost
    assert ours[2].tokens == 512


def test_cleaning_is_the_pipelines_with_ftfy():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    for text in PROMPTS:
        assert wan_prompt_clean(text) == prompt_clean(text)
    assert wan_prompt_clean("caf\u00c3\u00a9  &amp;amp; x") == "caf\u00e9 & x"


def test_musubis_cleaning_differs_from_diffusers_only_where_ftfy_has_already_removed_the_character():
    """musubi-tuner cleans Wan prompts with the `regex` module (wan/modules/tokenizers.py, commit 30c658c:
    basic_clean = ftfy.fix_text, html.unescape twice, strip; whitespace_clean = regex.sub(r"\\s+", " ")), whose \\s does
    not match U+001C-U+001F where Python's re (diffusers' prompt_clean) does. Both run ftfy.fix_text first, which
    removes those control characters, and html.unescape drops them as invalid character references: the two
    cleanings give the same prompt for every character below U+3000, the ones that differ included."""
    import html

    import ftfy
    import regex

    def musubi_clean(text: str) -> str:
        text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
        return regex.sub(r"\s+", " ", text).strip()

    assert not regex.match(r"\s", "\x1c") and re.match(r"\s", "\x1c")  # the difference itself
    captions = [f"a{chr(code)}b" for code in range(0x3000)] + ["front\x1ccamera\x1d \x1e view\x1f", "a&#28;b",
                                                                  "a&amp;#29;b c"]
    assert [wan_prompt_clean(caption) for caption in captions] == [musubi_clean(caption) for caption in captions]
    assert wan_prompt_clean("front\x1ccamera\x1d \x1e view\x1f") == "frontcamera view"


def test_the_fingerprint_names_what_decides_the_rows(wan_text):
    encoder = load_text_encoder(f"diffusers:{wan_text}", dtype="bf16")
    fingerprint = encoder.fingerprint()
    assert fingerprint["class"] == "UMT5EncoderModel" and fingerprint["family"] == "wan"
    assert fingerprint["length"] == 512 and fingerprint["stored_dtype"] == "bfloat16"
    assert fingerprint["compute_dtype"] == "float32" and fingerprint["ftfy"]
    assert set(fingerprint["tokenizer_sha256"]) >= {"tokenizer.json"} and len(fingerprint["weights_sha256"]) == 64
    assert encoder.embed(["dog"])[0].rows.dtype == torch.bfloat16


def test_a_generic_encoder_takes_a_length_and_a_layer(wan_text, tmp_path):
    import shutil

    folder = shutil.copytree(wan_text / "text_encoder", tmp_path / "t5")
    with pytest.raises(VaeSpecError, match="no tokenizer files in"):
        load_text_encoder(f"transformers:{folder}", length=16)
    shutil.copytree(wan_text / "tokenizer", folder / "tokenizer")
    encoder = load_text_encoder(f"transformers:{folder}", length=16, layer=1)
    (hidden,) = encoder.embed(["dog"])
    states = encoder.model(**encoder.tokenizer(["dog"], padding="max_length", max_length=16, return_tensors="pt"),
                           output_hidden_states=True).hidden_states[1]
    assert torch.equal(hidden.rows, states[0, :hidden.tokens])


def test_what_cannot_be_loaded_is_one_line_naming_the_spec(wan_text, tmp_path):
    with pytest.raises(VaeSpecError, match="no such folder .*hf download"):
        load_text_encoder("diffusers:Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    with pytest.raises(UsageError, match="needs --text-length"):
        load_text_encoder(f"transformers:{wan_text / 'text_encoder'}")
    with pytest.raises(UsageError, match="diffusers:PATH"):
        load_text_encoder(f"hub:{wan_text}")
    ltx = build_wan_text_folder(tmp_path / "ltx", pipeline="HunyuanVideoImageToVideoPipeline")
    with pytest.raises(UsageError, match="HunyuanVideoImageToVideoPipeline.*not reproduced yet.*supported: .*"
                                         "HunyuanVideoPipeline.*LTXPipeline.*WanPipeline"):
        load_text_encoder(f"diffusers:{ltx}")
    index = json.loads((ltx / "model_index.json").read_text())
    (ltx / "model_index.json").write_text(json.dumps({**index, "_class_name": "HunyuanVideoPipeline"}))
    with pytest.raises(VaeSpecError, match="no text_encoder_2 folder .* holds the CLIP-L encoder there"):
        load_text_encoder(f"diffusers:{ltx}")
    index = json.loads((ltx / "model_index.json").read_text())
    (ltx / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(UsageError, match="no text-encoder family for pipeline 'FluxPipeline'"):
        load_text_encoder(f"diffusers:{ltx}")
    for weights in (ltx / "text_encoder").glob("*.safetensors"):
        weights.unlink()
    (ltx / "model_index.json").write_text(json.dumps(index | {"_class_name": "WanPipeline"}))
    with pytest.raises(VaeSpecError, match="no .safetensors weights .*--allow-pickle-weights"):
        load_text_encoder(f"diffusers:{ltx}")


@pytest.mark.parametrize("pipeline, length", [("LTXPipeline", 128), ("CogVideoXPipeline", 226)])
def test_ltx_and_cogvideox_rows_equal_their_pipelines_every_row_bit_for_bit(tmp_path, pipeline, length):
    import diffusers

    folder = build_wan_text_folder(tmp_path / pipeline, pipeline=pipeline)
    encoder = load_text_encoder(f"diffusers:{folder}", batch=2)
    prompts = [" a red car  drives &amp; down ", "", "the robot arm picks up the blue cube " * 60]
    ours = encoder.embed([encoder.clean(p) for p in prompts])  # as given: these pipelines do not clean
    pipe = types.SimpleNamespace(tokenizer=encoder.tokenizer, text_encoder=encoder.model,
                                 _execution_device=torch.device("cpu"))
    found = getattr(diffusers, pipeline)._get_t5_prompt_embeds(pipe, prompt=prompts, max_sequence_length=length,
                                                                device=torch.device("cpu"))
    expected, mask = found if isinstance(found, tuple) else (found, None)
    for i, embedding in enumerate(ours):
        assert embedding.rows.shape == (length, 32) and torch.equal(embedding.rows, expected[i])
        if mask is not None:
            assert int(mask[i].sum()) == embedding.tokens
    assert [e.truncated for e in ours] == [False, False, True]
    assert encoder.fingerprint()["storage"] == "every row of the length"
    assert not encoder.fingerprint()["attention_mask_into_encoder"]


def test_the_batch_bound_is_the_gpus_memory_on_a_cuda_device(monkeypatch):
    """The real GPU is not here: its properties are injected (an 8 GiB card)."""
    from types import SimpleNamespace

    from transformers import T5Config

    from vaecache.errors import UsageError
    from vaecache.text.encoder import check_text_shape, device_memory, machine_memory
    from vaecache.text.families import generic_family

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=8 << 30))
    assert device_memory("cuda:0") == (8 << 30, "the GPU's (cuda:0)")
    config = T5Config(d_model=4096, d_ff=10240, num_heads=64)
    assert device_memory("cpu") == (machine_memory(), "this machine's")
    with pytest.raises(UsageError, match=r"more than half the GPU's \(cuda:0\) 8.0 GiB"):
        check_text_shape(config, generic_family(512), 64, "transformers:x", "cuda:0")
