"""HunyuanVideo (Tencent): its 3D causal VAE is diffusers' AutoencoderKLHunyuanVideo, encoded whole.

Its trainers encode a clip in one pass, with no tiling in time or space: musubi-tuner's HunyuanVideo caching
(commit 30c658c, `cache_latents.py:265`, `vae.encode(contents).latent_dist.sample()`) through its copy of the authors'
AutoencoderKLCausal3D, whose temporal and spatial tiling are off unless asked (`hunyuan_model/
autoencoder_kl_causal_3d.py:118-119`; `--vae_tiling` turns spatial tiling on). diffusers' class encodes clips over 16
frames in overlapping time tiles by default (`use_framewise_encoding = True`, `tile_sample_min_num_frames = 16`:
`autoencoder_kl_hunyuan_video.py:711,717,767`), which `disable_tiling()` leaves on: every latent frame of such a clip
differs from the trainers'. The reference here runs the encoder and quant_conv over the whole clip, which is
diffusers' `_encode` with both kinds of tiling off."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models.base import (
    Family,
    ReferenceEncode,
    SingleFileLayout,
    TextEncoders,
    TextFamily,
    VaeClass,
    log2,
    scale_normalization,
)
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLHunyuanVideo"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # HunyuanVideoEncoder3D: block i halves space while i < log2(spatial ratio); time is halved by the
    # last log2(4) non-final blocks (ratio 4) or the first log2(8) blocks (ratio 8). Causal: 1 + tk frames.
    blocks = len(config.get("block_out_channels", (128, 256, 512, 512)))
    spatial_levels = log2(config.get("spatial_compression_ratio", 8), "spatial_compression_ratio")
    ratio = int(config.get("temporal_compression_ratio", 4))
    time_levels = log2(ratio, "temporal_compression_ratio")
    if ratio == 4:
        temporal = sum(1 for i in range(blocks) if blocks - 1 - time_levels <= i < blocks - 1)
    elif ratio == 8:
        temporal = sum(1 for i in range(blocks) if i < time_levels)
    else:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo temporal_compression_ratio {ratio} is not supported (4 or 8)")
    spatial = sum(1 for i in range(blocks) if i < spatial_levels)
    return FrameRule(2 ** temporal, 2 ** spatial, causal=True, label="AutoencoderKLHunyuanVideo")


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization)
SOURCE = ("musubi-tuner 30c658c cache_latents.py:265 and fpack_cache_latents.py:85 through "
          "hunyuan_model/autoencoder_kl_causal_3d.py (use_temporal_tiling and use_spatial_tiling False, :118-119); "
          "diffusers 0.42.1 autoencoder_kl_hunyuan_video.py:764-775 (_encode's untiled path)")


def encode_whole(module: Any, x: Any) -> Any:
    """The posterior of the whole clip: diffusers' `_encode` untiled (encoder, then quant_conv)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(module.quant_conv(module.encoder(x)))


WHOLE = ReferenceEncode("untiled", "the whole clip in one pass: no tiling in time or space", SOURCE, encode_whole)
DIFFUSERS_FRAMEWISE = ReferenceEncode(
    "diffusers-framewise", "diffusers' default encode: clips over 16 frames in 17-frame time tiles every 12 frames, "
    "blended", "diffusers autoencoder_kl_hunyuan_video.py:711-722 (use_framewise_encoding, the tile sizes)",
    params={"time_tile": 17, "time_stride": 12}, time_tiles_above=16)
"""What vaecache stored before it recorded the reference encode (0.6 and earlier): read back, never written."""

CHECKPOINT_FILE = SingleFileLayout(
    "HunyuanVideo's VAE checkpoint",
    lambda found, keys, shapes: "encoder.down_blocks.0.resnets.0.conv1.conv.weight" in found,
    refusal="a HunyuanVideo VAE checkpoint: diffusers has no single-file loader for it; convert it with diffusers' "
            "scripts/convert_hunyuan_video_to_diffusers.py and pass --vae diffusers:FOLDER")

PROMPT_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)
"""diffusers' pipeline_hunyuan_video.DEFAULT_PROMPT_TEMPLATE (0.42.1: lines 70-81, crop_start 95), the template
musubi-tuner calls "dit-llm-encode-video" (hunyuan_model/text_encoder.py)."""
PIPELINE_TEXT = TextFamily("hunyuanvideo", 256, "none", "diffusers HunyuanVideoPipeline._get_llama_prompt_embeds "
                           "(DEFAULT_PROMPT_TEMPLATE, crop_start 95, hidden_states[-3], max_sequence_length=256) and "
                           "_get_clip_prompt_embeds (CLIP-L pooler_output, 77 tokens)", masked=True, full_length=True,
                           template=PROMPT_TEMPLATE, crop_start=95, layer=-3, pooled_length=77)
MUSUBI_TEXT = replace(
    PIPELINE_TEXT, name="hunyuanvideo-musubi", pooled_tokenization="slow-clip",
    reference="musubi-tuner 30c658c HunyuanVideo and FramePack text caching (hunyuan_model/text_encoder.py, "
              "frame_pack/hunyuan.py encode_prompt_conds): the Llama rows as diffusers' HunyuanVideoPipeline computes "
              "them, CLIP-L's pooled output of the prompt tokenized by transformers 4.57's slow CLIPTokenizer "
              "(ftfy.fix_text first)")
"""musubi-tuner's HunyuanVideo and FramePack text conditioning (`--text-convention musubi`): diffusers' but for CLIP's
tokenization, which musubi's pinned transformers does with the slow class (vaecache.text.clip_slow)."""
TEXT = TextEncoders(("HunyuanVideoPipeline",), PIPELINE_TEXT, MUSUBI_TEXT, "HunyuanVideo (and FramePack)",
                    not_yet={"HunyuanVideoImageToVideoPipeline":
                             "hunyuanvideo image-to-video (a LLaVA template with the image)"})

FAMILY = Family("hunyuanvideo", "HunyuanVideo", (VAE_CLASS,), WHOLE, default_for=(VAE_CLASS,),
                legacy_references=(DIFFUSERS_FRAMEWISE,), vaes=(VAE,), single_files=(CHECKPOINT_FILE,),
                musubi_arch="hv", text=TEXT)

__all__ = ["DIFFUSERS_FRAMEWISE", "FAMILY", "VAE", "VAE_CLASS", "WHOLE", "encode_whole", "frame_rule"]
