"""Tiny VAE checkpoints in each family's original (non-diffusers) key layout, made from a diffusers module's
weights, so that a single-file load can be compared with the same weights loaded as a diffusers folder.

Wan 2.1 (Wan-Video/Wan2.1 `wan/modules/vae.py`, `WanVAE_`: `encoder.conv1`, `encoder.downsamples.N` (ResidualBlock
`residual.{0,2,3,6}` = RMS norm, conv, RMS norm, conv; `shortcut`; Resample `resample.1`, `time_conv`),
`encoder.middle.{0,1,2}` (block, attention, block), `encoder.head.{0,2}`, `conv1`/`conv2` (the quant convs), and the
decoder's `upsamples.N` (3 blocks then an upsampler per level)): the inverse of diffusers'
`convert_wan_vae_to_diffusers` (diffusers/loaders/single_file_utils.py), checked by running that function on it.
"""

from __future__ import annotations

import re
from typing import Any

_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
             "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
             "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


def wan21_original(state: dict[str, Any]) -> dict[str, Any]:
    """A diffusers AutoencoderKLWan (Wan 2.1 layout: 4 levels, num_res_blocks 2) state dict in WanVAE_'s keys."""
    out = {}
    for key, value in state.items():
        new = key
        fixed = {"quant_conv.weight": "conv1.weight", "quant_conv.bias": "conv1.bias",
                 "post_quant_conv.weight": "conv2.weight", "post_quant_conv.bias": "conv2.bias"}
        if key in fixed:
            new = fixed[key]
        elif m := re.match(r"^(encoder|decoder)\.conv_in\.(weight|bias)$", key):
            new = f"{m[1]}.conv1.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.norm_out\.gamma$", key):
            new = f"{m[1]}.head.0.gamma"
        elif m := re.match(r"^(encoder|decoder)\.conv_out\.(weight|bias)$", key):
            new = f"{m[1]}.head.2.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$", key):
            new = f"{m[1]}.middle.{2 * int(m[2])}.{_RESIDUAL[m[3]]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)$", key):
            new = f"{m[1]}.middle.1.{m[2]}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", key):
            new = f"encoder.downsamples.{m[1]}.{_RESIDUAL.get(m[2], m[2])}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(.+)$", key):
            new = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_RESIDUAL[m[3]]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.+)$", key):
            new = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        out[new] = value
    return out
