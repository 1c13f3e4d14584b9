"""A tiny Wan-style text encoder folder: a UMT5 encoder with random weights and a tokenizer whose vocabulary is
trained here (tokenizers' Unigram, as T5's sentencepiece model is), saved as a diffusers pipeline folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "a red car drives down a wet street at night",
    "the robot arm picks up the blue cube and places it in the bowl",
    "front camera view of a highway with trucks in the rain",
    "pedestrians cross at a crosswalk while a bus waits",
    "a dog runs on the beach at sunset, waves in the background",
    "close-up of hands folding a towel on a wooden table",
] * 4


def train_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", tok.token_to_id("</s>"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)


def build_wan_text_folder(root: Path, seed: int = 0, pipeline: str = "WanPipeline") -> Path:
    """root/{model_index.json, text_encoder/, tokenizer/}: what --text-encoder diffusers:root loads (a UMT5 encoder,
    as Wan's; a T5 one for the LTX-Video and CogVideoX pipelines)."""
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    train_tokenizer(root / "tokenizer")
    torch.manual_seed(seed)
    kind = "T5" if pipeline.startswith(("LTX", "CogVideoX")) else "UMT5"
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    getattr(transformers, f"{kind}EncoderModel")(config).eval().save_pretrained(root / "text_encoder",
                                                                               safe_serialization=True)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline, "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", f"{kind}EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
    }))
    return root


def _train_tokenizer(folder: Path, special: list[str], template: str, pad: str, **tokens: str) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=special, unk_token="<unk>")
    tok.train_from_iterator(CORPUS + ["Describe the video by detailing the following aspects main content theme "
                                      "color shape size texture quantity text spatial relationships objects"], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, tok.token_to_id(t)) for t in special if t in template])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token="<unk>", **tokens).save_pretrained(folder)


CLIP_CORPUS = CORPUS + ["“SALE” sign in the shop window, don’t stop", "full-width ＡＢＣ text &amp; more",
                        "the robot's arm, it's raining"] * 4
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def train_clip_tokenizer(folder: Path) -> None:
    """CLIP's tokenizer as its model folders hold it (tokenizer.json beside vocab.json and merges.txt): a byte-level BPE
    with CLIP's normalizer, pattern and `</w>` word ends, trained here; <|startoftext|> 0, <|endoftext|> 1 (also the
    pad token, as CLIP-L's)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.train_from_iterator(CLIP_CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>",
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in model["merges"]]
    CLIPTokenizer(vocab=model["vocab"], merges=merges).save_pretrained(folder)
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                       encoding="utf-8")


def save_clip_text(folder: Path) -> None:
    """A tiny CLIP text model (CLIP-L's layout, width 24), as HunyuanVideo's and Kandinsky 5's text_encoder_2, for
    train_clip_tokenizer's ids (its pooled output is the first <|endoftext|>'s row)."""
    import transformers

    transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=400, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, pad_token_id=1, bos_token_id=0, eos_token_id=1)).eval().save_pretrained(
        folder, safe_serialization=True)


def build_hunyuan_text_folder(root: Path, seed: int = 0) -> Path:
    """root/{model_index.json, text_encoder/ (a Llama), tokenizer/ (with Llama 3's header tokens), text_encoder_2/
    (a CLIP text model), tokenizer_2/}: HunyuanVideoPipeline's layout, tiny and random."""
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    llama_special = ["<pad>", "<unk>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    _train_tokenizer(root / "tokenizer", llama_special, "<|begin_of_text|> $A", "<pad>", bos_token="<|begin_of_text|>")
    train_clip_tokenizer(root / "tokenizer_2")
    torch.manual_seed(seed)
    transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=150, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)).eval().save_pretrained(
        root / "text_encoder", safe_serialization=True)
    save_clip_text(root / "text_encoder_2")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "HunyuanVideoPipeline", "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "LlamaModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "text_encoder_2": ["transformers", "CLIPTextModel"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
    }))
    return root


def build_ltx2_text_folder(root: Path, seed: int = 0, version: int = 1, bos_from_tokenizer: bool = True,
                           pipeline: str = "LTX2Pipeline") -> Path:
    """root/{model_index.json, text_encoder/ (a Gemma 3 with its vision tower), tokenizer/, connectors/ (an
    LTX2TextConnectors)}: LTX2Pipeline's text parts, tiny and random. `version` 1: LTX-2.0's one text_proj_in without
    a bias; 2: LTX-2.3's per-modality projections with biases. `bos_from_tokenizer` False: a tokenizer that does not
    put <bos> first (as Gemma 4's), which ltx-core's tokenizer then prepends."""
    import transformers
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    root.mkdir(parents=True, exist_ok=True)
    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    _train_tokenizer(root / "tokenizer", special, "<bos> $A" if bos_from_tokenizer else "$A", "<pad>",
                     bos_token="<bos>", eos_token="<eos>")
    torch.manual_seed(seed)
    transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                         sliding_window=16, pad_token_id=0, bos_token_id=2, eos_token_id=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4)).eval().save_pretrained(root / "text_encoder", safe_serialization=True)
    audio_width = 16 if version == 2 else 32  # V1's connectors both take its one projection's 32 features
    LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=4, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16, video_connector_num_layers=1, video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=audio_width // 2,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=8,
        per_modality_projections=version == 2, video_hidden_dim=32, audio_hidden_dim=audio_width,
        proj_bias=version == 2).eval().save_pretrained(root / "connectors")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline, "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"], "connectors": ["ltx2", "LTX2TextConnectors"],
    }))
    return root


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Qwen2.5's chat template for messages of text (Qwen2.5-VL's adds image and video parts, which prompts have
none of)."""


def build_hunyuan15_text_folder(root: Path, seed: int = 0) -> Path:
    """root/{model_index.json, text_encoder/ (a Qwen2_5_VLTextModel), tokenizer/ (a byte-level BPE trained here, with
    Qwen's chat tokens and template), text_encoder_2/ (a T5 encoder of ByT5's vocabulary), tokenizer_2/ (ByT5's, which
    needs no files but its config)}: HunyuanVideo15Pipeline's text parts, tiny and random."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS + ["system user assistant helpful Describe the video detailing aspects",
                                      'a sign that reads "OPEN" and a poster saying “SALE”'],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                         chat_template=QWEN_CHAT_TEMPLATE).save_pretrained(root / "tokenizer")
    transformers.ByT5Tokenizer().save_pretrained(root / "tokenizer_2")
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        pad_token_id=0, bos_token_id=None, eos_token_id=2)).eval().save_pretrained(root / "text_encoder",
                                                                             safe_serialization=True)
    transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=384, d_model=24, d_kv=8, d_ff=48, num_layers=2, num_heads=3, relative_attention_num_buckets=8,
        relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval() \
        .save_pretrained(root / "text_encoder_2", safe_serialization=True)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "HunyuanVideo15Pipeline", "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer_2": ["transformers", "ByT5Tokenizer"],
    }))
    return root


def build_kandinsky5_text_folder(root: Path, seed: int = 0, pipeline: str = "Kandinsky5T2VPipeline") -> Path:
    """root/{model_index.json, text_encoder/ (a Qwen2_5_VLForConditionalGeneration with a tiny vision tower),
    tokenizer/ (the byte-level BPE of build_hunyuan15_text_folder), text_encoder_2/ (a CLIP text model), tokenizer_2/}:
    Kandinsky 5's text parts, tiny and random."""
    import transformers

    hv15 = build_hunyuan15_text_folder(root / "hv15-parts", seed)
    root.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(hv15 / "tokenizer", root / "tokenizer")
    train_clip_tokenizer(root / "tokenizer_2")
    shutil.rmtree(hv15)
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=0,
                         bos_token_id=None, eos_token_id=2),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        image_token_id=301, video_token_id=302, vision_start_token_id=303)).eval().save_pretrained(
        root / "text_encoder", safe_serialization=True)
    save_clip_text(root / "text_encoder_2")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline, "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2VLProcessor"], "text_encoder_2": ["transformers", "CLIPTextModel"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
    }))
    return root
