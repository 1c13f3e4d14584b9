"""CogVideoX (Zhipu AI): diffusers' AutoencoderKLCogVideoX, whose encode runs frames in batches of 8 through its causal
cache (that is the model, not a tiling), untiled as diffusers' CogVideoX pipelines and finetrainers run it."""

from __future__ import annotations

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

VAE_CLASS = "AutoencoderKLCogVideoX"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # CogVideoXEncoder3D: block i < log2(temporal_compression_ratio) also halves time, and only
    # blocks that downsample at all (every block but the last) can. _encode runs frames in batches of
    # 8 with the odd first frame kept alone: 1 + 8k frames (CogVideoX trains on 49 = 1 + 8*6).
    blocks = len(config.get("block_out_channels", (128, 256, 256, 512)))
    levels = min(log2(config.get("temporal_compression_ratio", 4), "temporal_compression_ratio"), blocks - 1)
    temporal = 2 ** levels
    if 8 % temporal:
        raise VaeSpecError(f"AutoencoderKLCogVideoX with temporal compression {temporal} is not supported "
                           "(diffusers encodes batches of 8 frames)")
    return FrameRule(temporal, 2 ** (blocks - 1), causal=True, frame_step=8, label="AutoencoderKLCogVideoX")


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization, fp16="upcast",
               fp16_reason="CogVideoX models other than 2B were trained in bf16 and give NaNs in fp16 "
                           "(zai-org/CogVideo#559, #637); its config sets force_upcast")
SAT_FILE = SingleFileLayout(
    "CogVideoX's SAT VAE",
    lambda found, keys, shapes: ("encoder.down.0.block.0.conv1.conv.weight" in found
                                 and "encoder.down.0.block.0.norm1.gamma" not in found),  # that is HunyuanVideo 1.5's
    refusal="a CogVideoX VAE in its original (SAT) layout: diffusers has no single-file loader for it; convert it with "
            "diffusers' scripts/convert_cogvideox_to_diffusers.py and pass --vae diffusers:FOLDER")
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('diffusers 0.42.1 autoencoder_kl_cogvideox.py _encode (num_sample_frames_batch_size 8, '
                          'use_tiling False)'))

TEXT = TextEncoders(
    ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline",
     "CogVideoXFunControlPipeline"),
    TextFamily("cogvideox", 226, "none", "diffusers CogVideoXPipeline._get_t5_prompt_embeds, "
               "max_sequence_length=226", masked=False, full_length=True))
"""diffusers `pipelines/cogvideo/pipeline_cogvideox.py`, `CogVideoXPipeline._get_t5_prompt_embeds` (copied into its
I2V, V2V and Fun pipelines): as LTX-Video's, at 226 tokens, every row stored."""

FAMILY = Family("cogvideox", "CogVideoX", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,),
                single_files=(SAT_FILE,), text=TEXT)

__all__ = ["FAMILY", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
