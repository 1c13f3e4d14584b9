"""LTX-Video (Lightricks): diffusers' AutoencoderKLLTXVideo, untiled (use_tiling and use_framewise_encoding False), as
its trainers run it."""

from __future__ import annotations

from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models._ltx2_file import is_ltx2_checkpoint
from vaecache.models.base import Family, ReferenceEncode, SingleFileLayout, TextEncoders, TextFamily, VaeClass
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLLTXVideo"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # LTXVideoEncoder3d: patchify by patch_size (space) and patch_size_t (time), then each scaling
    # block halves space and/or time: LTXVideoDownBlock3D both; LTXVideo095DownBlock3D per
    # downsample_type (conv/spatiotemporal both, spatial, temporal). Strided causal convs map 1 + 2k
    # frames to 1 + k, so the clip takes 1 + temporal_factor*k frames (LTX-Video: 32x spatial, 8x time).
    if int(config.get("patch_size_t", 1)) != 1:
        raise VaeSpecError("AutoencoderKLLTXVideo with patch_size_t != 1 is not supported")
    block_types = list(config.get("down_block_types", ["LTXVideoDownBlock3D"] * 4))
    is_095 = bool(block_types) and block_types[-1] == "LTXVideo095DownBlock3D"
    count = len(config.get("block_out_channels", (128, 256, 512, 512))) - (1 if is_095 else 0)
    scaling = list(config.get("spatio_temporal_scaling", (True, True, True, False)))
    kinds = list(config.get("downsample_type", ["conv"] * count))
    spatial = temporal = 0
    for i in range(count):
        if not scaling[i]:
            continue
        block = block_types[min(i, len(block_types) - 1)]
        kind = kinds[min(i, len(kinds) - 1)] if block == "LTXVideo095DownBlock3D" else "conv"
        spatial += kind in ("conv", "spatiotemporal", "spatial")
        temporal += kind in ("conv", "spatiotemporal", "temporal")
    patch = int(config.get("patch_size", 4))
    return FrameRule(2 ** temporal, patch * 2 ** spatial, causal=True, label="AutoencoderKLLTXVideo")


def buffer_normalization(config: Mapping[str, Any], module: Any) -> dict[str, Any]:
    """LTX's normalization: latents_mean/std are buffers in the weights, not in config.json (LTX-Video and LTX-2)."""
    import torch

    out: dict[str, Any] = {"scaling_factor": config.get("scaling_factor", 1.0)}
    for name in ("latents_mean", "latents_std"):
        buffer = getattr(module, name, None)
        if isinstance(buffer, torch.Tensor):
            out[name] = [float(x) for x in buffer.detach().float().cpu().tolist()]
    out["formula"] = "(z - latents_mean) * scaling_factor / latents_std"
    return out


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", buffer_normalization, fp16="refuse",
               fp16_reason="LTX-Video's VAE gives corrupted output in fp16 (Lightricks/LTX-Video#126); "
                           "use --dtype bf16 (the dtype it was trained in) or fp32")
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('diffusers 0.42.1 autoencoder_kl_ltx.py:1163-1167 (use_tiling, use_framewise_encoding '
                          'False)'))

def release_config(shapes: Mapping[str, Any]) -> str | None:
    """The LTX-Video release whose VAE the keys are, told as diffusers' `infer_diffusers_model_type` tells them
    (loaders/single_file_utils.py: the encoder's last width 2048 is 0.9.5 and later, a decoder time embedder 0.9.1,
    else 0.9.0), its config as diffusers' scripts/convert_ltx_to_diffusers.py `get_vae_config` gives that release
    (0.9.7 and 0.9.8 share 0.9.5's VAE)."""
    last = shapes.get("vae.encoder.conv_out.conv.weight")
    if last and len(last) > 1 and last[1] == 2048:
        return "ltx-video-0.9.5_vae.json"
    if "vae.decoder.last_time_embedder.timestep_embedder.linear_1.weight" in shapes:
        return "ltx-video-0.9.1_vae.json"
    if "vae.decoder.up_blocks.9.res_blocks.0.conv1.conv.weight" in shapes:
        return "ltx-video-0.9.0_vae.json"
    return None


SINGLE_FILES = (
    # Lightricks/LTX-Video ltx_video/models/autoencoders/causal_video_autoencoder.py, read by diffusers'
    # convert_ltx_vae_checkpoint_to_diffusers (which takes the keys holding "vae.")
    SingleFileLayout(
        "LTX-Video's VAE",
        lambda found, keys, shapes: (any(key.startswith("per_channel_statistics") for key in found)
                                     and not is_ltx2_checkpoint(list(keys), dict(shapes))),
        VAE_CLASS, config_name=release_config,
        no_config="its keys are not those of a released LTX-Video VAE (0.9.0, 0.9.1, 0.9.5 to 0.9.8)",
        vae_keys=lambda keys: [key for key in keys if "vae." in key], leftovers=("per_channel_statistics.",),
        siblings=("AutoencoderKLLTX2Video",)),
    # LTX-2's video VAE alone, at a size no release has, keeps LTX-Video's key layout: --vae-config's class says which
)

TEXT = TextEncoders(
    ("LTXPipeline", "LTXImageToVideoPipeline"),
    TextFamily("ltx-video", 128, "none", "diffusers LTXPipeline._get_t5_prompt_embeds, max_sequence_length=128",
               masked=False, full_length=True),
    not_yet={"LTXConditionPipeline": "ltx-video (its own prompt embedding)"})
"""diffusers `pipelines/ltx/pipeline_ltx.py`, `LTXPipeline._get_t5_prompt_embeds` (shared by the image-to-video
pipeline): the prompt as given (no cleaning) to 128 tokens with padding and truncation, T5 on the ids alone without
the attention mask: every row, the padding's too, depends on the padding, so the full length is stored (LTX also
returns the mask; vaecache stores the token count and rebuilds it)."""

FAMILY = Family("ltx-video", "LTX-Video", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,),
                single_files=SINGLE_FILES, text=TEXT)

__all__ = ["FAMILY", "SINGLE_FILES", "UNTILED", "VAE", "VAE_CLASS", "buffer_normalization", "frame_rule",
           "release_config"]
