"""vaecache/weights.py: every model read from files is loaded strictly. A weight the file lacks, a tensor the model
has no place for, a tensor of another shape, a NaN or Inf weight or a damaged file is one line naming the file and
the first key (exit 2), never a model with random weights; a text encoder's or image encoder's refusal comes before
any row is written."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conditions.tiny_image import build_clip_pipeline_folder
from tests.text.tiny_text import build_wan_text_folder
from vaecache.errors import UsageError, VaeSpecError
from vaecache.weights import WeightsError, check_finite, weights_sha256

UMT5_KEY = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
CLIP_KEY = "encoder.layers.0.mlp.fc1.weight"


@pytest.fixture(scope="module")
def wan_text_built(tmp_path_factory):
    return build_wan_text_folder(tmp_path_factory.mktemp("text") / "wan")


@pytest.fixture
def wan_text(wan_text_built, tmp_path):
    return shutil.copytree(wan_text_built, tmp_path / "wan")


@pytest.fixture
def cache(caption_cache, tmp_path):
    return shutil.copytree(caption_cache, tmp_path / "cache")


def edit_weights(file, edit):
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})


def files_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(result):
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    return lines[-1]


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop(UMT5_KEY), f"model.safetensors: an incomplete UMT5EncoderModel checkpoint .*no tensor for "
                                f"{UMT5_KEY}, 1 missing"),
    (lambda s: s.update({"encoder.extra.weight": torch.zeros(3)}),
     "model.safetensors: tensors the UMT5EncoderModel has no place for: encoder.extra.weight"),
    (lambda s: s.update({UMT5_KEY: torch.zeros(32, 8)}), rf"model.safetensors: tensors of other shapes .*{UMT5_KEY} "
                                                         r"is \[32, 8\], not \[32, 64\]"),
    (lambda s: s[UMT5_KEY].__setitem__((0, 0), float("nan")), f"model.safetensors: weight {UMT5_KEY} holds NaN"),
    (lambda s: s[UMT5_KEY].__setitem__((0, 0), float("inf")), f"model.safetensors: weight {UMT5_KEY} holds Inf"),
])
def test_a_text_encoder_whose_weights_are_not_the_models_is_refused_before_any_row(cache, wan_text, run_cli, edit,
                                                                                     message):
    edit_weights(wan_text / "text_encoder" / "model.safetensors", edit)
    before = files_of(cache)
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"])
    assert result.exit_code == 2, result.output
    assert re.search(message, one_line(result)), result.output
    assert files_of(cache) == before  # no set, no manifest entry


def test_two_loads_of_a_text_encoder_are_the_same_model_and_the_fingerprint_hashes_its_weights(wan_text):
    from vaecache.text.encoder import load_text_encoder

    first, second = (load_text_encoder(f"diffusers:{wan_text}") for _ in range(2))
    assert first.fingerprint() == second.fingerprint()
    state = load_file(wan_text / "text_encoder" / "model.safetensors")
    assert torch.equal(first.model.state_dict()[UMT5_KEY], state[UMT5_KEY])


def test_a_truncated_or_damaged_encoder_file_is_one_line_naming_it(cache, wan_text, run_cli):
    weights = wan_text / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"])
    assert result.exit_code == 2 and f"{weights}: not a readable safetensors file" in one_line(result), result.output
    (wan_text / "text_encoder" / "config.json").write_text("{not json")
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"])
    assert result.exit_code == 2 and "config.json: the encoder's config does not parse" in one_line(result)


def test_a_tokenizer_of_another_model_is_refused_naming_it(cache, wan_text, run_cli):
    """A tokenizer with more ids than the encoder embeds: the first prompt using one would end in an IndexError."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(wan_text / "tokenizer")
    tokenizer.add_tokens([f"extra{i}" for i in range(60)])
    tokenizer.save_pretrained(wan_text / "tokenizer")
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{wan_text}"])
    assert result.exit_code == 2
    assert f"{wan_text / 'tokenizer'}: the tokenizer has 134 tokens, but the encoder in " in one_line(result)


@pytest.mark.parametrize("flags, message", [
    (["--text-length", "1000000000"], "a batch of 8 prompts of 1000000000 tokens needs about"),
    (["--text-length", "64", "--text-batch", "100000000"], "a batch of 100000000 prompts of 64 tokens needs about"),
])
def test_a_text_length_or_batch_beyond_the_machine_is_one_line(cache, wan_text, run_cli, flags, message):
    result = run_cli(["embed", cache, "--text-encoder", f"transformers:{wan_text / 'text_encoder'}", *flags])
    assert result.exit_code == 2 and message in one_line(result) and "lower --text-batch" in one_line(result)


def test_a_length_beyond_the_encoders_positions_is_refused(tmp_path):
    from transformers import CLIPTextConfig, CLIPTextModel

    from tests.text.tiny_text import train_tokenizer
    from vaecache.text.encoder import load_text_encoder

    folder = tmp_path / "clip"
    CLIPTextModel(CLIPTextConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=77)).save_pretrained(folder)
    train_tokenizer(folder)
    with pytest.raises(UsageError, match="78 tokens a prompt, but CLIPTextConfig holds 77 positions"):
        load_text_encoder(f"transformers:{folder}", length=78)
    assert load_text_encoder(f"transformers:{folder}", length=77).family.length == 77


@pytest.fixture
def clip_folder(tmp_path):
    return build_clip_pipeline_folder(tmp_path / "clip")


def test_an_image_encoder_missing_a_weight_or_with_damaged_settings_is_refused(clip_folder):
    from vaecache.conditions.images import ImageEncoder, image_encoder_folders

    spec = f"diffusers:{clip_folder}"
    ImageEncoder(spec, "wan-diffusers")
    weights = clip_folder / "image_encoder" / "model.safetensors"
    edit_weights(weights, lambda s: s.pop(CLIP_KEY))
    with pytest.raises(WeightsError, match=f"{weights}: an incomplete CLIPVisionModel checkpoint .*no tensor for "
                                           f"{CLIP_KEY}"):
        ImageEncoder(spec, "wan-diffusers")
    settings = clip_folder / "image_processor" / "preprocessor_config.json"
    settings.write_text('{"image_mean": [0.5,')
    with pytest.raises(WeightsError, match=f"{settings}: the image processor's settings does not parse"):
        image_encoder_folders(spec, "wan-diffusers")


def test_a_diffusers_vae_folder_missing_a_weight_is_refused(tmp_path):
    from diffusers import AutoencoderKLWan

    from vaecache.vae.load import load_vae

    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                     temperal_downsample=[False]).save_pretrained(tmp_path / "vae")
    weights = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    load_vae(f"diffusers:{tmp_path / 'vae'}")
    edit_weights(weights, lambda s: s.pop("decoder.conv_out.weight"))
    with pytest.raises(WeightsError, match=f"{weights}: an incomplete AutoencoderKLWan checkpoint .*"
                                           "decoder.conv_out.weight"):
        load_vae(f"diffusers:{tmp_path / 'vae'}")
    edit_weights(weights, lambda s: s.update({"decoder.conv_out.weight": torch.full((3, 8, 3, 3, 3), float("nan"))}))
    with pytest.raises(WeightsError, match="weight decoder.conv_out.weight holds NaN"):
        load_vae(f"diffusers:{tmp_path / 'vae'}")


def test_weights_errors_are_usage_errors_and_zero_dim_tensors_hash():
    assert issubclass(WeightsError, VaeSpecError) and WeightsError.exit_code == 2
    module = torch.nn.Module()
    module.register_parameter("scale", torch.nn.Parameter(torch.tensor(1000.0)))
    first = weights_sha256(module)
    module.scale.data.fill_(999.0)
    assert weights_sha256(module) != first and len(first) == 64
    check_finite({"scale": torch.tensor(1.0), "steps": torch.tensor(3)}, "here")
    with pytest.raises(WeightsError, match="here: weight scale holds Inf"):
        check_finite({"scale": torch.tensor(float("-inf"))}, "here")


def test_a_missing_text_encoder_is_refused_before_encode_reads_a_video(demo_data, run_cli, tmp_path):
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "5",
                      "--size", "32x32", "--text-encoder", f"diffusers:{tmp_path / 'missing'}"])
    assert result.exit_code == 2 and "no such folder" in one_line(result), result.output
    assert not (tmp_path / "out").exists()
    model_index = tmp_path / "pipe" / "model_index.json"
    model_index.parent.mkdir()
    model_index.write_text(json.dumps({"_class_name": "WanPipeline"}))
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "5",
                      "--size", "32x32", "--text-encoder", f"diffusers:{model_index.parent}"])
    assert result.exit_code == 2 and "no encoder folder" in one_line(result), result.output
    assert not (tmp_path / "out").exists()


def test_a_missing_image_encoder_is_refused_before_encode_loads_the_vae(demo_data, run_cli, tmp_path, loud_vae):
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", loud_vae, "--num-frames", "5",
                      "--size", "32x32", "--condition", "image-features", "--image-encoder",
                      f"diffusers:{tmp_path / 'missing'}"])
    assert result.exit_code == 2 and "is not a folder" in one_line(result), result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "vae-was-loaded").exists()


def test_a_base_model_read_from_a_checkpoint_with_a_task_head_loads_and_a_stray_tensor_of_its_own_does_not(tmp_path):
    """transformers:PATH with a causal LM's folder: AutoModel builds the base model, and the head (lm_head) is not
    its, as transformers' own loading has it; a tensor under the base model's own names is still refused."""
    from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llm")
    from vaecache.weights import load_pretrained

    assert type(load_pretrained(AutoModel, tmp_path / "llm")).__name__ == "LlamaModel"
    weights = tmp_path / "llm" / "model.safetensors"
    edit_weights(weights, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightsError, match=f"{weights}: tensors the LlamaModel has no place for: "
                                           "model.layers.0.extra.weight"):
        load_pretrained(AutoModel, tmp_path / "llm")
