"""HunyuanVideo 1.5 (Tencent): diffusers' AutoencoderKLHunyuanVideo15, untiled as its trainers run it (musubi-tuner
hv_1_5_cache_latents.py:41-44, vae.encode(...)[0].mode(), tiling off by default)."""

from __future__ import annotations

import importlib
import re
from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models.base import (
    ConditionPipeline,
    Family,
    ReferenceEncode,
    SingleFileLayout,
    TextEncoders,
    TextFamily,
    VaeClass,
    scale_normalization,
)
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLHunyuanVideo15"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # HunyuanVideo15Encoder3D builds log2(spatial_compression_ratio) spatial downsamples, the last
    # log2(temporal_compression_ratio) of them temporal too (causal: 1 + tk frames map to 1 + k); HunyuanVideo 1.5:
    # 16x space, 4x time, read from the config as the encoder reads them.
    temporal = int(config.get("temporal_compression_ratio", 4))
    spatial = int(config.get("spatial_compression_ratio", 16))
    blocks = len(config.get("block_out_channels", (128, 256, 512, 1024, 1024)))
    if spatial < 1 or spatial & (spatial - 1) or temporal < 1 or temporal & (temporal - 1) or temporal > spatial:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo15 compression {spatial}x space, {temporal}x time: both must be "
                           "powers of 2, time at most space")
    widest, latent = int(config.get("block_out_channels", (1024,))[-1]), int(config.get("latent_channels", 32))
    if widest < 2 * latent:  # the encoder's output groups its last block's channels by 2 x latent_channels
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo15: its last block's {widest} channels cannot hold "
                           f"2 x {latent} latent channels (the encoder fails on every input)")
    if spatial.bit_length() - 1 > blocks:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo15 spatial_compression_ratio {spatial} needs "
                           f"{spatial.bit_length() - 1} encoder blocks, the config has {blocks}")
    return FrameRule(temporal, spatial, causal=True, label="AutoencoderKLHunyuanVideo15")


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization,
               one_view_per_forward="diffusers' HunyuanVideo15 causal attention (autoencoder_kl_hunyuanvideo15.py, "
                                    "0.42) builds its mask for a batch it cannot broadcast: a forward of 2 or more "
                                    "views fails")
RELEASE_FILE = SingleFileLayout(
    "HunyuanVideo 1.5's release VAE", lambda found, keys, shapes: "encoder.down.0.block.0.norm1.gamma" in found,
    refusal="a HunyuanVideo 1.5 VAE in its release layout (tencent/HunyuanVideo-1.5): diffusers has no single-file "
            "loader for it; convert it with diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py and pass --vae "
            "diffusers:FOLDER")
"""Its RMS norms' `gamma` tell it from an SD VAE's layout."""
I2V = ConditionPipeline("hunyuanvideo-1.5",
                        "diffusers HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask "
                        "(pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py)", ("first-frame",),
                        arithmetic=lambda: importlib.import_module("vaecache.models._hunyuanvideo15_conditions"),
                        needs="scaling_factor", first_frame_alone=True)
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('musubi-tuner 30c658c hv_1_5_cache_latents.py:41-44; diffusers 0.42.1 '
                          'autoencoder_kl_hunyuanvideo15.py _encode'))

SYSTEM_MESSAGE = ("You are a helpful assistant. Describe the video by detailing the following aspects: \
        1. The main content and theme of the video. \
        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \
        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \
        4. background environment, light, style and atmosphere. \
        5. camera angles, movements, and transitions used in the video.")
"""diffusers' HunyuanVideo15Pipeline.system_message (0.42.1, `pipeline_hunyuan_video1_5.py`: its `__init__`), the
eight spaces of each continued line included, as the pipeline's backslash continuations write them."""


def extract_glyph_texts(prompt: str) -> str | None:
    """diffusers' pipeline_hunyuan_video1_5.extract_glyph_texts: the texts quoted with "…" or “…”, deduplicated in
    order where there are several, formatted `Text "x". Text "y". `; None where there are none."""
    matches = re.findall(r"\"(.*?)\"|“(.*?)”", prompt)
    result = [match[0] or match[1] for match in matches]
    result = list(dict.fromkeys(result)) if len(result) > 1 else result
    return ". ".join(f'Text "{text}"' for text in result) + ". " if result else None


def musubi_glyph_texts(prompt: str) -> str | None:
    """musubi's get_byt5_text_tokens' glyph text: the straight-quoted texts, then the curly-quoted ones, each as
    `Text "x". `; None for an empty prompt or one that quotes nothing."""
    if not prompt:
        return None
    texts = re.findall(r"\"(.*?)\"", prompt) + re.findall(r"“(.*?)”", prompt)
    return "".join(f'Text "{text}". ' for text in texts) if texts else None


PIPELINE_TEXT = TextFamily("hunyuanvideo-1.5", 1000, "none", "diffusers HunyuanVideo15Pipeline.encode_prompt: "
                           "_get_mllm_prompt_embeds (the system message and the prompt through the tokenizer's chat "
                           "template, 1000 + 108 tokens, hidden_states[-3], the first 108 rows cropped) and "
                           "_get_byt5_prompt_embeds (the quoted glyph text, extract_glyph_texts, through ByT5 at 256 "
                           "tokens)", masked=True, crop_start=108, layer=-3, chat_system=SYSTEM_MESSAGE,
                           glyph_length=256, glyph_texts=extract_glyph_texts)
"""HunyuanVideo 1.5: Qwen2.5-VL's rows trimmed to the mask (the transformer zeroes the padded ones before they are
used: `transformer_hunyuan_video15.py`, its text reordering) and ByT5's rows of the glyph text trimmed to its mask
(none where the prompt quotes no text: the pipeline's zero rows and zero mask)."""

MUSUBI_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant. Describe the video by detailing the following aspects: \n"
    "1. The main content and theme of the video. \n"
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \n"
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \n"
    "4. background environment, light, style and atmosphere. \n"
    "5. camera angles, movements, and transitions used in the video.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n")
"""musubi-tuner's PROMPT_TEMPLATE_VIDEO (hunyuan_video_1_5/hunyuan_video_1_5_text_encoder.py, commit 30c658c)."""
MUSUBI_TEXT = TextFamily("hunyuanvideo-1.5-musubi", 1024, "none", "musubi-tuner "
                         "hv_1_5_cache_text_encoder_outputs.py encode_and_save_batch (30c658c): "
                         "hunyuan_video_1_5_text_encoder.get_qwen_prompt_embeds "
                         "(PROMPT_TEMPLATE_VIDEO, cropped after <|im_start|>user\n, 1024 tokens, "
                         "hidden_states[-3]) and get_glyph_prompt_embeds (ByT5 at 128 tokens)", masked=True,
                         template=MUSUBI_TEMPLATE, layer=-3, glyph_length=128, glyph_texts=musubi_glyph_texts,
                         glyph_order="musubi", crop_marker="<|im_start|>user\n")
"""musubi-tuner's HunyuanVideo 1.5 text conditioning, what its hv15 text caches hold (`--text-convention musubi`):
not diffusers' (another system-message layout, a crop found from the template, ByT5 at 128 tokens, another glyph
order)."""
TEXT = TextEncoders(("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"), PIPELINE_TEXT, MUSUBI_TEXT,
                    "HunyuanVideo 1.5")

FAMILY = Family("hunyuanvideo-1.5", "HunyuanVideo 1.5", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,),
                vaes=(VAE,), single_files=(RELEASE_FILE,), musubi_arch="hv15",
                conditions=(I2V,), text=TEXT)

__all__ = ["FAMILY", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
