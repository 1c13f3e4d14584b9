"""Wan (Wan 2.1, and Wan 2.2: its A14B models on Wan 2.1's VAE, TI2V-5B on its own): diffusers' AutoencoderKLWan.
Its encode is causal in time by construction (the first frame alone, then 4-frame chunks through a feature cache);
its trainers run it untiled (musubi-tuner wan/modules/vae.py WanVAE.encode; diffusers' pipelines)."""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import Any, Iterable, Mapping, Sequence

from vaecache.errors import VaeSpecError
from vaecache.models.base import (
    ConditionPipeline,
    Family,
    FastEncoder,
    ReferenceEncode,
    SingleFileLayout,
    TextEncoders,
    TextFamily,
    VaeClass,
    config_constants,
)
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLWan"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # WanEncoder3d downsamples once per dim_mult step; temperal_downsample says which steps also halve
    # time. _encode feeds the first frame alone, then chunks of 4 frames: 1 + 4k frames.
    levels = len(config.get("dim_mult", [1, 2, 4, 4])) - 1
    temporal = 2 ** sum(bool(x) for x in config.get("temperal_downsample", [False, True, True])[:levels])
    if temporal > 4:
        raise VaeSpecError(f"AutoencoderKLWan with temporal compression {temporal} is not supported "
                           "(diffusers encodes chunks of 4 frames)")
    spatial = 2 ** levels * int(config.get("patch_size") or 1)
    return FrameRule(temporal, spatial, causal=True, frame_step=4, label="AutoencoderKLWan")


def normalization(config: Mapping[str, Any], module: Any) -> dict[str, Any]:
    out = config_constants(config, ("latents_mean", "latents_std"))
    out["formula"] = "(z - latents_mean) / latents_std"
    return out


def fast_encoder_module() -> ModuleType:
    return importlib.import_module("vaecache.models._wan_fast")


FAST = FastEncoder(
    "Wan 2.1, Wan 2.2", fast_encoder_module,
    frozenset({("cuda", "bfloat16", (9, 0), 96), ("cuda", "bfloat16", (9, 0), 160)}))
"""Validated where measured on an H200 at 2.16x (Wan 2.1: first width 96) and 1.72x (Wan 2.2 TI2V: 160) diffusers'
encode, closer to an fp32 encode than diffusers' bf16 one, at no more memory, and bitwise equal across repeats and
in a second process (docs/gpu.md)."""

VAE = VaeClass(VAE_CLASS, frame_rule, "z_dim", normalization, spatial_bands=True, causal_chunk_decode=True,
               fast_encoder=FAST)


def is_wan22_layout(keys: Iterable[str]) -> bool:
    """Wan 2.2's VAE (the TI2V-5B one, `Wan2.2_VAE.pth`): each level a Down_ResidualBlock / Up_ResidualBlock whose
    blocks sit one level deeper than Wan 2.1's (`encoder.downsamples.0.downsamples.0.residual.0.gamma`)."""
    found = {key.removeprefix("vae.") for key in keys}
    return ("encoder.downsamples.0.downsamples.0.residual.0.gamma" in found
            and "decoder.upsamples.0.upsamples.0.residual.0.gamma" in found)


def _shape(shapes: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    found = shapes.get(key) or shapes.get(f"vae.{key}")
    return tuple(found) if found else None


def _is_wan21_layout(found: frozenset[str], keys: Sequence[str], shapes: Mapping[str, Any]) -> bool:
    return "encoder.downsamples.0.residual.0.gamma" in found and "decoder.upsamples.0.residual.0.gamma" in found


def _wan21_config(shapes: Mapping[str, Any]) -> str | None:
    conv, first = _shape(shapes, "conv1.weight"), _shape(shapes, "encoder.conv1.weight")
    return "wan2.1_vae.json" if conv and first and conv[0] == 32 and first[0] == 96 else None


def _wan22_config(shapes: Mapping[str, Any]) -> str | None:
    """Wan 2.2's TI2V-5B VAE: z_dim 48, base_dim 160 (diffusers' scripts/convert_wan_to_diffusers.py
    `vae22_diffusers_config`)."""
    conv, first = _shape(shapes, "conv1.weight"), _shape(shapes, "encoder.conv1.weight")
    return "wan2.2_vae.json" if conv and first and conv[0] == 96 and first[0] == 160 else None


_WAN22_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight",
                   "residual.2.bias": "conv1.bias", "residual.3.gamma": "norm2.gamma",
                   "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
                   "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_WAN22_TOP = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
              "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}


def wan22_key(key: str) -> str:
    """One tensor name of Wan 2.2's VAE (Wan-Video/Wan2.2 wan/modules/vae2_2.py WanVAE_) in diffusers' (is_residual):
    the renaming of diffusers' scripts/convert_wan_to_diffusers.py `convert_vae_22`, which is nothing but a renaming
    (diffusers' single-file loading has no Wan 2.2 VAE conversion)."""
    if key in _WAN22_TOP:
        return _WAN22_TOP[key]
    if m := re.fullmatch(r"(encoder|decoder)\.conv1\.(weight|bias)", key):
        return f"{m[1]}.conv_in.{m[2]}"
    if m := re.fullmatch(r"(encoder|decoder)\.head\.0\.gamma", key):
        return f"{m[1]}.norm_out.gamma"
    if m := re.fullmatch(r"(encoder|decoder)\.head\.2\.(weight|bias)", key):
        return f"{m[1]}.conv_out.{m[2]}"
    if (m := re.fullmatch(r"(encoder|decoder)\.middle\.([02])\.(.+)", key)) and m[3] in _WAN22_RESIDUAL:
        return f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_WAN22_RESIDUAL[m[3]]}"
    if m := re.fullmatch(r"(encoder|decoder)\.middle\.1\.(.+)", key):
        return f"{m[1]}.mid_block.attentions.0.{m[2]}"
    if m := re.fullmatch(r"(encoder\.down|decoder\.up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.+)", key):
        side, level, index, rest = m[1], m[2], m[3], m[4]
        blocks = f"{side}_blocks.{level}"
        if rest in _WAN22_RESIDUAL:
            return f"{blocks}.resnets.{index}.{_WAN22_RESIDUAL[rest]}"
        if rest.startswith(("resample.", "time_conv.")):
            return f"{blocks}.{side.partition('.')[2]}sampler.{rest}"
    return key


def convert_wan22_vae(config: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Wan 2.2's VAE checkpoint in diffusers' names (wan22_key); a "vae." prefix, as some tools save it, is dropped
    first. `config` is unused: the renaming does not depend on it (the signature of diffusers' converters)."""
    del config
    return {wan22_key(key.removeprefix("vae.")): value for key, value in checkpoint.items()}


NO_CONFIG = ("the configs shipped are Wan 2.1's (z_dim 16, base_dim 96) and Wan 2.2 TI2V-5B's (z_dim 48, "
             "base_dim 160); this file has other shapes")
SINGLE_FILES = (
    SingleFileLayout("Wan 2.1's VAE", _is_wan21_layout, VAE_CLASS, config_name=_wan21_config, no_config=NO_CONFIG),
    # Wan-Video/Wan2.1 wan/modules/vae.py WanVAE_, read by diffusers' convert_wan_vae_to_diffusers
    SingleFileLayout("Wan 2.2's VAE", lambda found, keys, shapes: is_wan22_layout(found), VAE_CLASS,
                     config_name=_wan22_config, no_config=NO_CONFIG, converter=lambda: convert_wan22_vae),
    # Wan-Video/Wan2.2 wan/modules/vae2_2.py WanVAE_ (Down_/Up_ResidualBlock)
)
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          "musubi-tuner 30c658c wan_cache_latents.py and wan/modules/vae.py (WanVAE.encode, no "
                          "tiling); diffusers 0.42.1 autoencoder_kl_wan.py _encode")



def condition_arithmetic() -> ModuleType:
    return importlib.import_module("vaecache.models._wan_conditions")


I2V = ConditionPipeline("wan", "diffusers WanImageToVideoPipeline.prepare_latents (pipelines/wan/pipeline_wan_i2v.py)",
                        ("first-frame", "first-last"), arithmetic=lambda: condition_arithmetic().I2V,
                        unnamed_record=True)
"""Wan 2.1 I2V, Wan 2.2 I2V A14B and FLF2V."""
TI2V = ConditionPipeline("wan-ti2v", "diffusers WanImageToVideoPipeline.prepare_latents with expand_timesteps "
                         "(pipelines/wan/pipeline_wan_i2v.py, Wan 2.2 TI2V)", ("first-frame",),
                         arithmetic=lambda: condition_arithmetic().TI2V,
                         selects=lambda config: bool(config.get("patch_size")), first_frame_alone=True)
"""Wan 2.2 TI2V-5B (its VAE has patch_size): the first frame alone, its mask apart."""

TEXT = TextEncoders(
    ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline", "WanVACEPipeline"),
    TextFamily("wan", 512, "wan", "diffusers WanPipeline._get_t5_prompt_embeds, max_sequence_length=512"))
"""diffusers `pipelines/wan/pipeline_wan.py` (0.42): `WanPipeline._get_t5_prompt_embeds` cleans each prompt with
`prompt_clean` (ftfy's `fix_text` where ftfy is installed, `html.unescape` twice, strip, runs of whitespace to one
space), tokenizes to `max_sequence_length` with padding and truncation, runs the UMT5 encoder with the attention
mask, and keeps each prompt's first `mask.sum()` rows followed by zero rows; `__call__` passes 512 (its
`encode_prompt` default is 226). The I2V, V2V and VACE pipelines share that function. vaecache stores the unpadded
rows (the zero rows are zeros by construction) and pads again on read."""

FAMILY = Family("wan", "Wan", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,),
                single_files=SINGLE_FILES, conditions=(TI2V, I2V), musubi_arch="wan", text=TEXT)

__all__ = ["FAMILY", "FAST", "I2V", "SINGLE_FILES", "TEXT", "TI2V", "UNTILED", "VAE", "VAE_CLASS",
           "condition_arithmetic", "convert_wan22_vae", "fast_encoder_module", "frame_rule", "is_wan22_layout",
           "normalization", "wan22_key"]
