"""Decoding latents back to frames in bounded memory: temporal chunks, and the module's own spatial tiling.

AutoencoderKLWan's decoder is causal in time: diffusers' ``_decode`` feeds it one latent frame per call and
carries a feature cache (the last frames of every causal convolution's input) from call to call, then
concatenates every decoded frame on the device. ``iter_decoded`` runs the very same calls, in the same order,
with the same inputs, and hands the frames back a chunk of latent frames at a time instead of keeping them all;
the cache goes on from chunk to chunk, so the chunks put together are bitwise the frames of
``module.decode(z)`` (tested with ``torch.equal``, tiled and untiled). With tiling on, every spatial tile keeps
its own cache (diffusers' ``tiled_decode`` decodes each tile over all frames before blending; blending is
per frame, so blending a chunk's tiles gives the same pixels).

Other families: a 2D image VAE (``per_frame``) decodes one latent frame per forward, chunked or not; any other
module with ``decode(z)`` is decoded whole, in one call (its ``enable_tiling`` may tile in time itself).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from vaecache.errors import UsageError
from vaecache.vae.model import VaeModel

CHUNKED = "causal-chunks"
"""Wan: one latent frame per decoder call, the causal cache carried across chunks (exact)."""
PER_FRAME = "per-frame"
"""A 2D image VAE: each latent frame decoded alone (exact)."""
WHOLE = "whole"
"""Any other VAE: the whole clip in one module.decode call; --chunk-frames does not apply."""


def decode_mode(model: VaeModel) -> str:
    """How `iter_decoded` decodes this model's latents (CHUNKED, PER_FRAME or WHOLE)."""
    module = model.module
    if decodes_causal_chunks(module):
        return CHUNKED
    if not callable(getattr(module, "decode", None)):
        raise UsageError(f"{model.spec}: the module has no decode(z) method, so its latents cannot be decoded")
    return PER_FRAME if model.per_frame else WHOLE


def decodes_causal_chunks(module: torch.nn.Module) -> bool:
    """Whether the module's family declares a causal decoder fed one latent frame per call (VaeClass
    .causal_chunk_decode) and the module has the parts that decode runs."""
    from vaecache.models import vae_class

    vae = vae_class(type(module).__name__)
    return (vae is not None and vae.causal_chunk_decode and hasattr(module, "decoder")
            and hasattr(module, "post_quant_conv"))


@torch.inference_mode()
def iter_decoded(model: VaeModel, z: torch.Tensor, chunk_frames: int) -> Iterator[torch.Tensor]:
    """Decode `z` (B, c, t, h, w) and yield (B, 3, frames, H, W) pieces in [-1, 1], in order, on the model's
    device in its compute dtype. CHUNKED and PER_FRAME yield every `chunk_frames` latent frames (so at most
    that many latent frames' pixels are in flight); WHOLE yields once. Tiling follows the module's state
    (enable_tiling()/disable_tiling())."""
    if chunk_frames < 1:
        raise UsageError(f"--chunk-frames must be >= 1, got {chunk_frames}")
    module = model.module
    z = z.to(model.device, model.compute_dtype)
    mode = decode_mode(model)
    if mode == CHUNKED:
        yield from _wan_chunks(module, z, chunk_frames)
    elif mode == PER_FRAME:
        for start in range(0, z.shape[2], chunk_frames):
            frames = [decoded_sample(module.decode(z[:, :, t]))
                      for t in range(start, min(start + chunk_frames, z.shape[2]))]
            yield torch.stack(frames, dim=2)
    else:
        yield decoded_sample(module.decode(z))


def decoded_sample(output: Any) -> torch.Tensor:
    """A diffusers DecoderOutput, a 1-tuple, or a tensor -> the tensor."""
    if isinstance(output, tuple):
        output = output[0]
    return getattr(output, "sample", output)


def decoder_conv_count(module: torch.nn.Module) -> int:
    counts = getattr(module, "_cached_conv_counts", None)
    if isinstance(counts, dict) and "decoder" in counts:
        return int(counts["decoder"])
    return sum(type(m).__name__ == "WanCausalConv3d" for m in module.decoder.modules())


def wan_finish(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """What diffusers does to decoded frames after the decoder: unpatchify (Wan 2.2), clamp to [-1, 1]."""
    patch_size = module.config.patch_size
    if patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)


def _wan_chunks(module: torch.nn.Module, z: torch.Tensor, chunk_frames: int) -> Iterator[torch.Tensor]:
    """diffusers' AutoencoderKLWan._decode (and tiled_decode) a chunk at a time; see the module docstring."""
    _, _, frames, height, width = z.shape
    ratio = module.spatial_compression_ratio
    tile_h, tile_w = module.tile_sample_min_height // ratio, module.tile_sample_min_width // ratio
    if module.use_tiling and (width > tile_w or height > tile_h):
        yield from _wan_tiled_chunks(module, z, chunk_frames)
        return
    x = module.post_quant_conv(z)  # a 1x1x1 convolution over the whole latent, as _decode applies it
    cache: list[Any] = [None] * decoder_conv_count(module)
    for start in range(0, frames, chunk_frames):
        pieces = [module.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
                  for i in range(start, min(start + chunk_frames, frames))]
        yield wan_finish(module, torch.cat(pieces, 2))


def _wan_tiled_chunks(module: torch.nn.Module, z: torch.Tensor, chunk_frames: int) -> Iterator[torch.Tensor]:
    """diffusers' AutoencoderKLWan.tiled_decode with every tile's causal cache kept across chunks."""
    _, _, frames, height, width = z.shape
    ratio = module.spatial_compression_ratio
    sample_h, sample_w = height * ratio, width * ratio
    tile_h, tile_w = module.tile_sample_min_height // ratio, module.tile_sample_min_width // ratio
    step_h, step_w = module.tile_sample_stride_height // ratio, module.tile_sample_stride_width // ratio
    out_step_h, out_step_w = module.tile_sample_stride_height, module.tile_sample_stride_width
    patch_size = module.config.patch_size
    if patch_size is not None:
        sample_h, sample_w = sample_h // patch_size, sample_w // patch_size
        out_step_h, out_step_w = out_step_h // patch_size, out_step_w // patch_size
        blend_h = module.tile_sample_min_height // patch_size - out_step_h
        blend_w = module.tile_sample_min_width // patch_size - out_step_w
    else:
        blend_h = module.tile_sample_min_height - out_step_h
        blend_w = module.tile_sample_min_width - out_step_w
    conv_count = decoder_conv_count(module)
    caches = {(i, j): [None] * conv_count for i in range(0, height, step_h) for j in range(0, width, step_w)}
    for start in range(0, frames, chunk_frames):
        stop = min(start + chunk_frames, frames)
        rows = []
        for i in range(0, height, step_h):
            row = []
            for j in range(0, width, step_w):
                pieces = []
                for k in range(start, stop):
                    tile = module.post_quant_conv(z[:, :, k:k + 1, i:i + tile_h, j:j + tile_w])
                    pieces.append(module.decoder(tile, feat_cache=caches[(i, j)], feat_idx=[0], first_chunk=k == 0))
                row.append(torch.cat(pieces, dim=2))
            rows.append(row)
        result_rows = []
        for i, row in enumerate(rows):  # blending as tiled_decode does it (in place, above then left)
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = module.blend_v(rows[i - 1][j], tile, blend_h)
                if j > 0:
                    tile = module.blend_h(row[j - 1], tile, blend_w)
                result_row.append(tile[:, :, :, :out_step_h, :out_step_w])
            result_rows.append(torch.cat(result_row, dim=-1))
        yield wan_finish(module, torch.cat(result_rows, dim=3)[:, :, :, :sample_h, :sample_w])


__all__ = ["CHUNKED", "PER_FRAME", "WHOLE", "decode_mode", "decoded_sample", "decoder_conv_count",
           "decodes_causal_chunks", "iter_decoded", "wan_finish"]
