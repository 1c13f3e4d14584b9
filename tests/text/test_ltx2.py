"""The LTX-2 family: LTX-2's trainer's text conditions (video and audio prompt features over every Gemma hidden
state, left-padded to 1024 tokens) bit for bit what ltx-core's tokenizer and feature extractor give (as its
scripts/process_captions.py runs them) and what diffusers' LTX2Pipeline computes before its connectors; stored as a
set, read back with the left-padded mask, verified."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.text import ltx_core_reference as ltx_core
from tests.text.tiny_text import build_ltx2_text_folder
from vaecache.errors import VaeSpecError
from vaecache.text.encoder import load_text_encoder
from vaecache.text.ltx2 import split_features
from vaecache.text.sets import pipeline_tensor

PROMPTS = ["a red car drives down a wet street at night", "", "  the robot arm picks up the blue cube  ",
           "pedestrians cross at a crosswalk " * 200]


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def ltx2_text(request, tmp_path_factory):
    return build_ltx2_text_folder(tmp_path_factory.mktemp("text") / f"ltx2-v{request.param}", version=request.param)


def reference_parts(folder):
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(folder / "text_encoder").eval()
    connectors = LTX2TextConnectors.from_pretrained(folder / "connectors").eval()
    return AutoTokenizer.from_pretrained(folder / "tokenizer"), model, connectors


def test_each_prompt_equals_what_ltx2s_process_captions_saves(ltx2_text):
    tokenizer, model, connectors = reference_parts(ltx2_text)
    encoder = load_text_encoder(f"diffusers:{ltx2_text}", batch=1)
    features = encoder.fingerprint()["features"]
    with torch.no_grad():
        expected = [ltx_core.process_captions_item(model.model, tokenizer, ltx_core.feature_extractor(connectors), p)
                    for p in PROMPTS]
    for prompt, embedding, saved in zip(PROMPTS, encoder.embed([encoder.clean(p) for p in PROMPTS]), expected):
        video, audio = split_features(embedding.rows, features["video_width"], features["audio_width"])
        assert torch.equal(video, saved["video_prompt_embeds"]), prompt
        assert torch.equal(audio, saved["audio_prompt_embeds"]), prompt
        _, mask = pipeline_tensor(embedding.rows, 1024, embedding.tokens, padding="left")
        assert torch.equal(mask.long(), saved["prompt_attention_mask"])
    assert [e.truncated for e in encoder.embed(PROMPTS)] == [False, False, False, True]
    assert features["extractor"] == ("V2" if connectors.config.per_modality_projections else "V1")


@pytest.mark.parametrize("batch", [1, 3])
def test_the_features_equal_diffusers_ltx2pipeline_before_its_connectors(ltx2_text, batch):
    """diffusers' own `_get_gemma_prompt_embeds` on the prompts, then `LTX2TextConnectors.forward`, whose feature
    extractor output (its text_proj_in Linear layers) is caught on the way in to its connector transformers."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    tokenizer, model, connectors = reference_parts(ltx2_text)
    pipeline = types.SimpleNamespace(tokenizer=tokenizer, text_encoder=model, _execution_device="cpu")
    caught: dict[str, torch.Tensor] = {}
    names = ("video_text_proj_in", "audio_text_proj_in") if connectors.config.per_modality_projections else \
        ("text_proj_in",)
    for name in names:
        getattr(connectors, name).register_forward_hook(lambda _m, _i, out, name=name: caught.__setitem__(name, out))
    prompts = PROMPTS[:3]
    with torch.no_grad():
        embeds, mask = LTX2Pipeline._get_gemma_prompt_embeds(pipeline, prompts, max_sequence_length=1024)
        connectors(embeds, mask, padding_side="left")
    encoder = load_text_encoder(f"diffusers:{ltx2_text}", batch=batch)
    features = encoder.fingerprint()["features"]
    for i, embedding in enumerate(encoder.embed([encoder.clean(p) for p in prompts])):
        video, audio = split_features(embedding.rows, features["video_width"], features["audio_width"])
        assert torch.equal(video, caught[names[0]][i])
        assert torch.equal(audio, caught[names[-1]][i])
        assert embedding.tokens == int(mask[i].sum())


def test_a_tokenizer_without_bos_gets_it_first_as_ltx_core_puts_it(tmp_path):
    """Gemma 4's tokenizer does not emit <bos>; ltx-core prepends it (diffusers' pipeline does not)."""
    folder = build_ltx2_text_folder(tmp_path / "no-bos", bos_from_tokenizer=False)
    tokenizer, model, connectors = reference_parts(folder)
    encoder = load_text_encoder(f"diffusers:{folder}", batch=2)
    with torch.no_grad():
        saved = ltx_core.process_captions_item(model.model, tokenizer, ltx_core.feature_extractor(connectors),
                                               PROMPTS[0])
    embedding = encoder.embed([PROMPTS[0]])[0]
    assert torch.equal(embedding.rows, saved["video_prompt_embeds"])
    assert embedding.tokens == int(saved["prompt_attention_mask"].sum()) == len(tokenizer(PROMPTS[0]).input_ids) + 1


def test_the_feature_extractor_is_loaded_strictly(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = build_ltx2_text_folder(tmp_path / "ltx2", version=2)
    weights = folder / "connectors" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if k != "audio_text_proj_in.bias"}, weights)
    with pytest.raises(VaeSpecError, match="audio_text_proj_in.bias is missing"):
        load_text_encoder(f"diffusers:{folder}")
    save_file({**state, "video_text_proj_in.weight": state["video_text_proj_in.weight"][:, :-1].contiguous()}, weights)
    with pytest.raises(VaeSpecError, match=r"video_text_proj_in.weight has shape \(32, 127\)"):
        load_text_encoder(f"diffusers:{folder}")
    save_file(state, weights)
    config = json.loads((folder / "connectors" / "config.json").read_text())
    (folder / "connectors" / "config.json").write_text(json.dumps({**config, "text_proj_in_factor": 5}))
    with pytest.raises(VaeSpecError, match="takes 5 hidden states of width 32, but the Gemma encoder gives 4"):
        load_text_encoder(f"diffusers:{folder}")
    (folder / "connectors" / "config.json").unlink()
    with pytest.raises(VaeSpecError, match="connectors/"):
        load_text_encoder(f"diffusers:{folder}")


def test_an_ltx2_set_reads_back_left_padded_exports_and_reembeds(caption_cache, run_cli, tmp_path):
    """LatentCache gives each clip its prompt's video and audio features and the left-padded mask, what ltx-core
    gives its caption; a WebDataset sample decodes to the same; verify --reencode re-embeds and agrees; verify names
    a prompt removed from a shard."""
    import shutil

    import webdataset
    from safetensors.torch import load_file, save_file

    from tests.conftest import CAPTIONS
    from vaecache.export.webdataset import decode_sample
    from vaecache.training import LatentCache

    folder = build_ltx2_text_folder(tmp_path / "text", version=1)
    cache = tmp_path / "cache"
    shutil.copytree(caption_cache, cache)
    assert run_cli(["embed", cache, "--text-encoder", f"diffusers:{folder}", "--text-batch", "2"]).exit_code == 0
    tokenizer, model, connectors = reference_parts(folder)
    latents = LatentCache(cache)
    with torch.no_grad():
        saved = {scene: ltx_core.process_captions_item(model.model, tokenizer, ltx_core.feature_extractor(connectors),
                                                       caption) for scene, caption in CAPTIONS.items()}
    for item in latents:
        expected = saved[item.scene]
        assert torch.equal(item["text/default"], expected["video_prompt_embeds"])
        assert torch.equal(item["text_audio/default"], expected["audio_prompt_embeds"])  # V1: the same features
        assert torch.equal(item["text_mask/default"].long(), expected["prompt_attention_mask"])
    dest = tmp_path / "wds"
    assert run_cli(["export", cache, "--format", "webdataset", "--out", dest, "--energon", "off"]).exit_code == 0
    for sample in webdataset.WebDataset(sorted(str(p) for p in dest.glob("*.tar")), shardshuffle=False):
        sample = decode_sample(sample)
        item = latents[sample["record"]["id"]]
        for key in ("text/default", "text_audio/default", "text_mask/default"):
            assert torch.equal(sample[key], item[key]), key
    assert run_cli(["verify", cache, "--reencode", "2"]).exit_code == 0
    shard = next((cache / "text" / "default").rglob("embeddings-*.safetensors"))
    state = load_file(shard)
    removed = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != removed}, shard)
    result = run_cli(["verify", cache])
    assert result.exit_code == 1 and removed[:12] in result.output
