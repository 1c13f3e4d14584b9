"""LTX-2 (Lightricks): diffusers' AutoencoderKLLTX2Video, untiled (use_tiling and use_framewise_encoding False), as its
trainer (ltx-trainer process_videos.py) encodes."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from vaecache.errors import VaeSpecError
from vaecache.models._ltx2_file import (
    AUDIO_PREFIX,
    VIDEO_PREFIX,
    convert_ltx2_video_vae,
    is_ltx2_checkpoint,
    video_config_name,
)
from vaecache.models.base import (
    AudioVaeClass,
    Family,
    ReferenceEncode,
    SingleFileLayout,
    TextEncoders,
    TextFamily,
    VaeClass,
)
from vaecache.models.ltx_video import buffer_normalization
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLLTX2Video"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # LTX2VideoEncoder3d: patchify by patch_size (space) and patch_size_t (time), then each LTX2VideoDownBlock3D with
    # spatio_temporal_scaling halves space and/or time by its downsample_type (conv and spatiotemporal both, spatial,
    # temporal): LTX-2's (spatial, temporal, spatiotemporal, spatiotemporal) give 32x space and 8x time.
    if int(config.get("patch_size_t", 1)) != 1:
        raise VaeSpecError("AutoencoderKLLTX2Video with patch_size_t != 1 is not supported")
    count = len(config.get("block_out_channels", (256, 512, 1024, 2048)))
    scaling = config.get("spatio_temporal_scaling", (True,) * count)
    scaling = [scaling] * count if isinstance(scaling, bool) else list(scaling)
    kinds = list(config.get("downsample_type", ("spatial", "temporal", "spatiotemporal", "spatiotemporal")))
    spatial = sum(1 for i in range(count) if scaling[i] and kinds[i] in ("conv", "spatiotemporal", "spatial"))
    temporal = sum(1 for i in range(count) if scaling[i] and kinds[i] in ("conv", "spatiotemporal", "temporal"))
    return FrameRule(2 ** temporal, int(config.get("patch_size", 4)) * 2 ** spatial, causal=True,
                     label="AutoencoderKLLTX2Video")


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", buffer_normalization, fp16="refuse",
               fp16_reason="LTX-2's video VAE runs in bf16 or fp32 (its pipeline's dtype); fp16 is untested there: "
                           "use --dtype bf16 or fp32")
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          ('diffusers 0.42.1 autoencoder_kl_ltx2.py:1169-1173; Lightricks/LTX-2 400fd31 ltx-trainer '
                          'scripts/process_videos.py'))

SINGLE_FILES = (
    # Lightricks/LTX-2 ltx_core/model/video_vae: a whole release file (vae.*, audio_vae.*, ...) or its video VAE alone
    SingleFileLayout(
        "LTX-2's release file or video VAE",
        lambda found, keys, shapes: (any(key.startswith("per_channel_statistics") for key in found)
                                     and is_ltx2_checkpoint(list(keys), dict(shapes))),
        VAE_CLASS, config_name=lambda shapes: video_config_name(dict(shapes)),
        no_config="its shapes are not those of a released LTX-2 video VAE (2.0, 2.3)",
        converter=lambda: convert_ltx2_video_vae,
        vae_keys=lambda keys: [key for key in keys if key.startswith(VIDEO_PREFIX)] or keys,
        leftovers=("per_channel_statistics.",)),
    SingleFileLayout("LTX-2's audio VAE alone",
                     lambda found, keys, shapes: bool(keys) and all(key.startswith(AUDIO_PREFIX) for key in keys),
                     refusal="LTX-2's audio VAE alone (audio_vae.*): pass it as --audio-vae, with the video VAE as "
                             "--vae"),
)

TEXT = TextEncoders(
    ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline"),
    TextFamily("ltx2", 1024, "strip", "LTX-2's trainer (Lightricks/LTX-2 400fd31, ltx-trainer "
               "scripts/process_captions.py): ltx-core's LTXGemmaTokenizer (strip, <bos> first, left padding to "
               "1024), every Gemma hidden state, the checkpoint's feature extractor (V1 or V2) before the "
               "connectors; diffusers LTX2Pipeline._get_gemma_prompt_embeds then LTX2TextConnectors' "
               "normalization and text_proj_in", masked=True, full_length=True, padding="left", features="ltx2"))
"""LTX-2 (diffusers' LTX2Pipeline folder: text_encoder/ a Gemma 3, tokenizer/, connectors/ the feature extractor's
weights); vaecache.text.ltx2 holds its arithmetic."""


def audio_mel(config: Mapping[str, Any], n_fft: int) -> dict[str, Any]:
    """ltx-core's AudioProcessor for an `AutoencoderKLLTX2Audio` config (diffusers' keys; `n_fft` is the checkpoint's
    `preprocessing.stft.filter_length`, 1024 in LTX-2's)."""
    return {"sample_rate": int(config.get("sample_rate", 16000)), "n_fft": n_fft,
            "hop_length": int(config.get("mel_hop_length", 160)), "mel_bins": int(config.get("mel_bins") or 64),
            "channels": int(config.get("in_channels", 2))}


AUDIO_VAE = AudioVaeClass("AutoencoderKLLTX2Audio", audio_mel,
                          lambda: importlib.import_module("vaecache.models._ltx2_audio"),
                          "channels x mel bins, packed (LTX-2: vaecache.audio.latents.normalize_audio_latents)",
                          checkpoint_prefix=AUDIO_PREFIX, checkpoint="an LTX-2 checkpoint")
"""LTX-2's audio VAE: the log-mel of ltx-core's AudioProcessor (vaecache.audio.mel), its latents normalized over the
packed channels x mel bins (models/_ltx2_audio.py); read from a diffusers folder or the release file's audio_vae.*
tensors (vaecache.audio.release_file)."""

FAMILY = Family("ltx-2", "LTX-2", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,),
                single_files=SINGLE_FILES, text=TEXT, audio_vaes=(AUDIO_VAE,))

__all__ = ["FAMILY", "SINGLE_FILES", "UNTILED", "VAE", "VAE_CLASS", "frame_rule"]
