"""Tiny VAE checkpoints in each family's original (non-diffusers) key layout, made from a diffusers module's
weights, so that a single-file load can be compared with the same weights loaded as a diffusers folder.

Wan 2.1 (Wan-Video/Wan2.1 `wan/modules/vae.py`, `WanVAE_`: `encoder.conv1`, `encoder.downsamples.N` (ResidualBlock
`residual.{0,2,3,6}` = RMS norm, conv, RMS norm, conv; `shortcut`; Resample `resample.1`, `time_conv`),
`encoder.middle.{0,1,2}` (block, attention, block), `encoder.head.{0,2}`, `conv1`/`conv2` (the quant convs), and the
decoder's `upsamples.N` (3 blocks then an upsampler per level)): the inverse of diffusers'
`convert_wan_vae_to_diffusers` (diffusers/loaders/single_file_utils.py), checked by running that function on it.

LTX-Video 0.9.0 (Lightricks/LTX-Video `ltx_video/models/autoencoders/causal_video_autoencoder.py`: the encoder's and
decoder's blocks numbered flat, `down_blocks.0..9` / `up_blocks.0..9`, `res_blocks`, `per_channel_statistics`, under
`vae.`): the inverse of `convert_ltx_vae_checkpoint_to_diffusers` (its 0.9.0 rename table).

SD-style AutoencoderKL (CompVis/stable-diffusion `ldm/modules/diffusionmodules/model.py`: `down.N.block.M`,
`down.N.downsample`, `mid.block_1`, `mid.attn_1` with 1x1-conv q/k/v/proj_out, `up.N` numbered from the lowest
resolution, `nin_shortcut`, `norm_out`): the inverse of `convert_ldm_vae_checkpoint`.
"""

from __future__ import annotations

import re
from typing import Any

_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
             "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
             "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


_WAN_QUANT = {"quant_conv.weight": "conv1.weight", "quant_conv.bias": "conv1.bias",
              "post_quant_conv.weight": "conv2.weight", "post_quant_conv.bias": "conv2.bias"}


def _wan_shared(key: str) -> str | None:
    """A diffusers AutoencoderKLWan key outside the down and up blocks in WanVAE_'s name (the same in Wan 2.1's and
    Wan 2.2's code), or None for a block's key."""
    if key in _WAN_QUANT:
        return _WAN_QUANT[key]
    if m := re.match(r"^(encoder|decoder)\.conv_in\.(weight|bias)$", key):
        return f"{m[1]}.conv1.{m[2]}"
    if m := re.match(r"^(encoder|decoder)\.norm_out\.gamma$", key):
        return f"{m[1]}.head.0.gamma"
    if m := re.match(r"^(encoder|decoder)\.conv_out\.(weight|bias)$", key):
        return f"{m[1]}.head.2.{m[2]}"
    if m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$", key):
        return f"{m[1]}.middle.{2 * int(m[2])}.{_RESIDUAL[m[3]]}"
    if m := re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)$", key):
        return f"{m[1]}.middle.1.{m[2]}"
    return None


def wan21_original(state: dict[str, Any]) -> dict[str, Any]:
    """A diffusers AutoencoderKLWan (Wan 2.1 layout: 4 levels, num_res_blocks 2) state dict in WanVAE_'s keys."""
    out = {}
    for key, value in state.items():
        new = _wan_shared(key) or key
        if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", key):
            new = f"encoder.downsamples.{m[1]}.{_RESIDUAL.get(m[2], m[2])}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(.+)$", key):
            new = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_RESIDUAL[m[3]]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.+)$", key):
            new = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        out[new] = value
    return out


# diffusers' convert_ltx_vae_checkpoint_to_diffusers, VAE_KEYS_RENAME_DICT (0.9.0), read backwards: a diffusers
# block -> the original flat block, most specific first.
_LTX090_BLOCKS = [
    ("encoder.down_blocks.0.downsamplers.0", "encoder.down_blocks.1"),
    ("encoder.down_blocks.0", "encoder.down_blocks.0"),
    ("encoder.down_blocks.1.downsamplers.0", "encoder.down_blocks.4"),
    ("encoder.down_blocks.1", "encoder.down_blocks.3"),
    ("encoder.down_blocks.2.downsamplers.0", "encoder.down_blocks.7"),
    ("encoder.down_blocks.2", "encoder.down_blocks.6"),
    ("encoder.down_blocks.3", "encoder.down_blocks.8"),
    ("encoder.mid_block", "encoder.down_blocks.9"),
    ("decoder.mid_block", "decoder.up_blocks.0"),
    ("decoder.up_blocks.0", "decoder.up_blocks.1"),
    ("decoder.up_blocks.1.upsamplers.0", "decoder.up_blocks.2"),
    ("decoder.up_blocks.1", "decoder.up_blocks.3"),
    ("decoder.up_blocks.2.conv_in", "decoder.up_blocks.4"),
    ("decoder.up_blocks.2.upsamplers.0", "decoder.up_blocks.5"),
    ("decoder.up_blocks.2", "decoder.up_blocks.6"),
    ("decoder.up_blocks.3.conv_in", "decoder.up_blocks.7"),
    ("decoder.up_blocks.3.upsamplers.0", "decoder.up_blocks.8"),
    ("decoder.up_blocks.3", "decoder.up_blocks.9"),
]


def ltx090_original(state: dict[str, Any]) -> dict[str, Any]:
    """A diffusers AutoencoderKLLTXVideo (0.9.0 layout: LTXVideoDownBlock3D, channels changing after levels 0 and 1)
    state dict in the original checkpoint's keys."""
    out = {}
    for key, value in state.items():
        if key == "latents_mean":
            new = "per_channel_statistics.mean-of-means"
        elif key == "latents_std":
            new = "per_channel_statistics.std-of-means"
        else:
            new = key
            for block, original in _LTX090_BLOCKS:
                if key.startswith(block + "."):
                    new = original + key[len(block):]
                    break
            new = (new.replace(".resnets.", ".res_blocks.").replace("conv_shortcut.conv.", "conv_shortcut.")
                   .replace(".norm3.", ".norm3.norm."))
        out[f"vae.{new}"] = value
    return out


_LDM_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def ldm_vae_original(state: dict[str, Any], levels: int) -> dict[str, Any]:
    """A diffusers AutoencoderKL state dict (`levels` down and up blocks) in the LDM first-stage model's keys."""
    out = {}
    for key, value in state.items():
        new = key.replace("conv_norm_out", "norm_out")
        if m := re.match(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", key):
            new = f"encoder.down.{m[1]}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)$", key):
            new = f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", key):
            new = f"decoder.up.{levels - 1 - int(m[1])}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)$", key):
            new = f"decoder.up.{levels - 1 - int(m[1])}.upsample.conv.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$", key):
            new = f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)"
                           r"\.(weight|bias)$", key):
            new = f"{m[1]}.mid.attn_1.{_LDM_ATTENTION[m[2]]}.{m[3]}"
            if m[3] == "weight" and m[2] != "group_norm":
                value = value[:, :, None, None]  # a 1x1 convolution in the original model
        out[new] = value
    return out


def wan22_original(state: dict[str, Any]) -> dict[str, Any]:
    """A diffusers AutoencoderKLWan with is_residual (Wan 2.2 TI2V's VAE) in Wan-Video/Wan2.2 wan/modules/vae2_2.py
    WanVAE_'s keys: each level a Down_ResidualBlock (`encoder.downsamples.L.downsamples.I`, its resample after its
    residual blocks) or Up_ResidualBlock. The inverse of diffusers' scripts/convert_wan_to_diffusers.py
    `convert_vae_22` (checked by running vaecache's copy of it, single_file.convert_wan22_vae)."""
    blocks: dict[str, int] = {}
    for key in state:
        if m := re.match(r"^(encoder\.down|decoder\.up)_blocks\.(\d+)\.resnets\.(\d+)\.", key):
            name = f"{m[1]}_blocks.{m[2]}"
            blocks[name] = max(blocks.get(name, 0), int(m[3]) + 1)
    out = {}
    for key, value in state.items():
        new = _wan_shared(key) or key
        if m := re.match(r"^(encoder\.down|decoder\.up)_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", key):
            kind = m[1].partition(".")[2]
            new = f"{m[1]}samples.{m[2]}.{kind}samples.{m[3]}.{_RESIDUAL[m[4]]}"
        elif m := re.match(r"^(encoder\.down|decoder\.up)_blocks\.(\d+)\.(?:down|up)sampler\.(.+)$", key):
            kind = m[1].partition(".")[2]
            new = f"{m[1]}samples.{m[2]}.{kind}samples.{blocks[f'{m[1]}_blocks.{m[2]}']}.{m[3]}"
        out[new] = value
    return out


# diffusers' convert_ltx_vae_checkpoint_to_diffusers (loaders/single_file_utils.py): VAE_KEYS_RENAME_DICT, updated by
# VAE_091_RENAME_DICT or VAE_095_RENAME_DICT, as original block -> diffusers block, per release.
_LTX_ENCODER_090 = {"down_blocks.0": "down_blocks.0", "down_blocks.1": "down_blocks.0.downsamplers.0",
                    "down_blocks.2": "down_blocks.0.conv_out", "down_blocks.3": "down_blocks.1",
                    "down_blocks.4": "down_blocks.1.downsamplers.0", "down_blocks.5": "down_blocks.1.conv_out",
                    "down_blocks.6": "down_blocks.2", "down_blocks.7": "down_blocks.2.downsamplers.0",
                    "down_blocks.8": "down_blocks.3", "down_blocks.9": "mid_block"}
_LTX_ENCODER_095 = {"down_blocks.0": "down_blocks.0", "down_blocks.1": "down_blocks.0.downsamplers.0",
                    "down_blocks.2": "down_blocks.1", "down_blocks.3": "down_blocks.1.downsamplers.0",
                    "down_blocks.4": "down_blocks.2", "down_blocks.5": "down_blocks.2.downsamplers.0",
                    "down_blocks.6": "down_blocks.3", "down_blocks.7": "down_blocks.3.downsamplers.0",
                    "down_blocks.8": "mid_block"}
_LTX_DECODER_090 = {"up_blocks.0": "mid_block", "up_blocks.1": "up_blocks.0", "up_blocks.2": "up_blocks.1.upsamplers.0",
                    "up_blocks.3": "up_blocks.1", "up_blocks.4": "up_blocks.2.conv_in",
                    "up_blocks.5": "up_blocks.2.upsamplers.0", "up_blocks.6": "up_blocks.2",
                    "up_blocks.7": "up_blocks.3.conv_in", "up_blocks.8": "up_blocks.3.upsamplers.0",
                    "up_blocks.9": "up_blocks.3"}
_LTX_DECODER_091 = {"up_blocks.0": "mid_block", "up_blocks.1": "up_blocks.0.upsamplers.0", "up_blocks.2": "up_blocks.0",
                    "up_blocks.3": "up_blocks.1.upsamplers.0", "up_blocks.4": "up_blocks.1",
                    "up_blocks.5": "up_blocks.2.upsamplers.0", "up_blocks.6": "up_blocks.2",
                    "up_blocks.7": "up_blocks.3.upsamplers.0", "up_blocks.8": "up_blocks.3"}
LTX_RELEASES = {"0.9.0": (_LTX_ENCODER_090, _LTX_DECODER_090), "0.9.1": (_LTX_ENCODER_090, _LTX_DECODER_091),
                "0.9.5": (_LTX_ENCODER_095, _LTX_DECODER_091)}


def ltx_original(state: dict[str, Any], release: str) -> dict[str, Any]:
    """A diffusers AutoencoderKLLTXVideo state dict in the original checkpoint's keys of an LTX-Video release (0.9.0,
    0.9.1, 0.9.5: 0.9.7 and 0.9.8 have 0.9.5's VAE), under `vae.`: the inverse of diffusers'
    convert_ltx_vae_checkpoint_to_diffusers for that release (checked by running it)."""
    encoder, decoder = LTX_RELEASES[release]
    inverse = {f"encoder.{new}": f"encoder.{old}" for old, new in encoder.items()}
    inverse.update({f"decoder.{new}": f"decoder.{old}" for old, new in decoder.items()})
    out = {}
    for key, value in state.items():
        if key == "latents_mean":
            new = "per_channel_statistics.mean-of-means"
        elif key == "latents_std":
            new = "per_channel_statistics.std-of-means"
        else:
            new = key
            for block in sorted(inverse, key=len, reverse=True):
                if key.startswith(block + "."):
                    new = inverse[block] + key[len(block):]
                    break
            new = (new.replace(".resnets.", ".res_blocks.").replace("conv_shortcut.conv.", "conv_shortcut.")
                   .replace(".norm3.", ".norm3.norm."))
            if re.match(r"^decoder\.(time_embedder|scale_shift_table)", new):
                new = "decoder.last_" + new.removeprefix("decoder.")
        out[f"vae.{new}"] = value
    return out


def ltx2_original(state: dict[str, Any]) -> dict[str, Any]:
    """A diffusers AutoencoderKLLTX2Video state dict in LTX-2's own checkpoint keys (ltx-core's video VAE: the
    encoder's and decoder's blocks numbered flat, each level's resnets then its resampler, the encoder's mid block
    last and the decoder's first, `res_blocks`, `per_channel_statistics`), under `vae.`: the inverse of diffusers'
    scripts/convert_ltx2_to_diffusers.py renaming (vaecache.models._ltx2_file.VIDEO_RENAMES; checked by running it)."""
    levels = 1 + max(int(m[1]) for key in state if (m := re.match(r"^encoder\.down_blocks\.(\d+)\.", key)))
    out = {}
    for key, value in state.items():
        new = {"latents_mean": "per_channel_statistics.mean-of-means",
               "latents_std": "per_channel_statistics.std-of-means"}.get(key, key)
        if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(resnets|downsamplers\.0)\.(.*)$", key):
            level = int(m[1])
            new = (f"encoder.down_blocks.{2 * level}.res_blocks.{m[3]}" if m[2] == "resnets"
                   else f"encoder.down_blocks.{2 * level + 1}.{m[3]}")
        elif m := re.match(r"^encoder\.mid_block\.resnets\.(.*)$", key):
            new = f"encoder.down_blocks.{2 * levels}.res_blocks.{m[1]}"
        elif m := re.match(r"^decoder\.mid_block\.resnets\.(.*)$", key):
            new = f"decoder.up_blocks.0.res_blocks.{m[1]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.(.*)$", key):
            level = int(m[1])
            new = (f"decoder.up_blocks.{2 * level + 2}.res_blocks.{m[3]}" if m[2] == "resnets"
                   else f"decoder.up_blocks.{2 * level + 1}.{m[3]}")
        out[f"vae.{new}"] = value
    return out


def ltx2_audio_original(state: dict[str, Any]) -> dict[str, Any]:
    """A diffusers AutoencoderKLLTX2Audio state dict in LTX-2's checkpoint keys: ltx-core's names are diffusers'
    (its layers were kept), the statistics `per_channel_statistics.*`, under `audio_vae.` (the inverse of diffusers'
    convert_ltx2_audio_vae_to_diffusers)."""
    names = {"latents_mean": "per_channel_statistics.mean-of-means",
             "latents_std": "per_channel_statistics.std-of-means"}
    return {f"audio_vae.{names.get(key, key)}": value for key, value in state.items()}
