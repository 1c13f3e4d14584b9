"""Kandinsky 5 (Kandinsky Lab): trains on HunyuanVideo's VAE latents, encoded in the tiles its authors' VAE code cuts.

The authors' `kandinsky/models/vae.py` (github.com/kandinskylab/kandinsky-5; musubi-tuner's copy at commit 30c658c,
`kandinsky5/models/vae.py`, loaded by its Kandinsky 5 caching from a diffusers folder: `build_vae`, :1058-1068)
encodes every clip through `get_enc_optimal_tiling` (:683-700, :1013-1055): time in 17-frame tiles every 8 frames
above 17 frames (`_temporal_tiled_encode`, :898-933), the overlapping latent frames blended linearly, and space in
tiles sized from the GPU's free memory and a 2**31-element bound (`tiled_encode`, :782-826). The reference here is
that encode, with one difference made on purpose: the free-memory term is left out, which gives the same tiles
wherever at least 16 GiB are free when a clip is encoded (then the element bound alone decides; see `space_tiles`),
so the latents do not depend on the card.

Its time tiles start every 8 frames while a 17-frame tile still fits (`range(0, frames - 16, 8)`, :904-908), and the
first tile keeps 3 latent frames: a clip of 1 + 8k frames (25, 33, ...) is covered whole, but one of 21, 29, ...
frames is not (21 frames give 3 latent frames of the first 9). Kandinsky 5's frame rule therefore takes 1 + 4k frames
up to 17, then 1 + 8k, and refuses the rest naming the nearest counts it encodes whole (its own videos are 121 and
241 frames: 5 s and 10 s at 24 fps).

musubi-tuner loads a single `--vae FILE` through HunyuanVideo's AutoencoderKLCausal3D instead (:1061-1065), with that
class's own tiling forced on (:1090-1100: 25-frame time tiles above 24 frames, 192-pixel spatial tiles): other latents
again. docs/vaes.md says which to give it."""

from __future__ import annotations

import importlib
from dataclasses import replace
from math import ceil, sqrt
from typing import Any

from vaecache.models.base import ConditionPipeline, Family, ReferenceEncode, TextEncoders, TextFamily
from vaecache.models.hunyuanvideo import VAE_CLASS
from vaecache.models.rules import FrameRule

TIME_TILE = 17
"""Frames per time tile (`get_enc_optimal_tiling`'s (1, 17, h, w), `apply_tiling`'s ft - 1 = 16 plus the causal
first frame)."""
TIME_STRIDE = 8
"""Frames between time tiles."""
ELEMENT_BOUND = 2 ** 31
"""`num_vals = 256 * 17 * (h + 32) * (w + 32)` must stay below this for a frame to be encoded in one spatial tile."""
MEMORY_FREE_FOR_SAME_TILES = 16 * 2 ** 30
"""With at least this much free GPU memory, `get_enc_optimal_tiling`'s memory term never decides: its
h * w / (free / (256 * 17 * 8)) is then below (h + 32)(w + 32) * 256 * 17 / 2**31."""
SOURCE = ("kandinsky-5 kandinsky/models/vae.py (musubi-tuner 30c658c kandinsky5/models/vae.py: encode :683-700, "
          "_encode :669-680, tiled_encode :782-826, _temporal_tiled_encode :898-933, get_enc_optimal_tiling "
          ":1013-1055; kandinsky5_cache_latents.py:62-63 calls vae.encode)")


def space_tiles(height: int, width: int) -> tuple[int, int, int, int]:
    """(tile height, tile width, stride height, stride width) of `get_enc_optimal_tiling` for a frame of this size,
    its free-memory term left out: one tile where 256 * 17 * (h + 32) * (w + 32) < 2**31, else N = ceil(that / 2**31)
    tiles split by the aspect ratio, each a multiple of 8 plus 16 pixels, overlapping by 32."""
    if 256 * 17 * (height + 32) * (width + 32) < ELEMENT_BOUND:
        return height, width, height, width
    ratio = max(height / width, width / height)
    count = ceil(256 * 17 * (height + 32) * (width + 32) / ELEMENT_BOUND)
    fewer, more = ceil(sqrt(count / ratio)), ceil(sqrt(count * ratio))
    across, down = (fewer, more) if height >= width else (more, fewer)
    tile_w = ceil(width / across / 8) * 8 + 16 if across > 1 else width
    tile_h = ceil(height / down / 8) * 8 + 16 if down > 1 else height
    return tile_h, tile_w, (tile_h - 32 if down > 1 else height), (tile_w - 32 if across > 1 else width)


def _covered(size: int, tile: int, stride: int) -> int:
    """Pixels of one side the authors' tile loop reaches: tiles start every `stride` while a whole tile fits."""
    return (size - tile) // stride * stride + tile


def uncovered_size(height: int, width: int, factor: int) -> str | None:
    """Why Kandinsky 5's space tiles leave part of a frame of this size out, naming the nearest sizes (multiples of
    `factor`, within 256 pixels) they cover whole; None where they cover it. Its tiles of a multiple of 8 plus 16
    start every tile - 32 pixels only while a whole tile fits (`tiled_encode`, :782-826), so a frame whose last tile
    would overhang is cut short: 1080x1920 comes out as 140x476 latents of its top 560 rows."""
    tile_h, tile_w, stride_h, stride_w = space_tiles(height, width)
    rows, columns = _covered(height, tile_h, stride_h), _covered(width, tile_w, stride_w)
    if rows >= height and columns >= width:
        return None
    reach = 256 // factor * factor
    near = sorted((abs(h - height) + abs(w - width), h, w)
                  for h in range(max(factor, height - reach), height + reach + 1, factor)
                  for w in range(max(factor, width - reach), width + reach + 1, factor)
                  if _covered(h, *space_tiles(h, w)[::2]) >= h and _covered(w, *space_tiles(h, w)[1::2]) >= w)
    sizes = ", ".join(f"{h}x{w}" for _, h, w in near[:3]) or "none within 256 pixels"
    return (f"its trainers' encode cuts it into {tile_h}x{tile_w} tiles every {stride_h}x{stride_w} pixels, which "
            f"reach {min(rows, height)}x{min(columns, width)} of it (kandinsky5/models/vae.py tiled_encode leaves the "
            f"rest out); nearest sizes it encodes whole: {sizes}")


def encode_tiled(module: Any, x: Any) -> Any:
    """The posterior Kandinsky 5's VAE code gives `x` (B, 3, F, H, W): time tiles above 17 frames, space tiles where
    the frame is too large for one (`space_tiles`), the overlaps blended as its `blend_t`, `blend_v`, `blend_h` do."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    frames, height, width = x.shape[2:]
    tiles = space_tiles(height, width)
    if frames > TIME_TILE:
        return DiagonalGaussianDistribution(_time_tiled(module, x, tiles))
    return DiagonalGaussianDistribution(_space_tiled_or_whole(module, x, tiles))


def _whole(module: Any, x: Any) -> Any:
    return module.quant_conv(module.encoder(x).clone())


def _space_tiled_or_whole(module: Any, x: Any, tiles: tuple[int, int, int, int]) -> Any:
    height, width = x.shape[-2:]
    if width > tiles[1] or height > tiles[0]:
        return _space_tiled(module, x, tiles)
    return _whole(module, x)


def _space_tiled(module: Any, x: Any, tiles: tuple[int, int, int, int]) -> Any:
    import torch

    tile_h, tile_w, stride_h, stride_w = tiles
    height, width = x.shape[-2:]
    factor = int(module.spatial_compression_ratio)
    latent_tile_h, latent_tile_w = tile_h // factor, tile_w // factor
    latent_stride_h, latent_stride_w = stride_h // factor, stride_w // factor
    rows = [[_whole(module, x[:, :, :, top:top + tile_h, left:left + tile_w])
             for left in range(0, width - tile_w + 1, stride_w)]
            for top in range(0, height - tile_h + 1, stride_h)]
    joined = []
    for i, row in enumerate(rows):
        pieces = []
        for j, tile in enumerate(row):
            # blended in place: the next row blends with this tile as blended, as the authors' loop does
            if i > 0:
                tile = _blend(rows[i - 1][j], tile, latent_tile_h - latent_stride_h, dim=3)
            if j > 0:
                tile = _blend(row[j - 1], tile, latent_tile_w - latent_stride_w, dim=4)
            keep_h = latent_tile_h if i == len(rows) - 1 else latent_stride_h
            keep_w = latent_tile_w if j == len(row) - 1 else latent_stride_w
            pieces.append(tile[:, :, :, :keep_h, :keep_w])
        joined.append(torch.cat(pieces, dim=4))
    return torch.cat(joined, dim=3)[:, :, :, :height // factor, :width // factor]


def _time_tiled(module: Any, x: Any, tiles: tuple[int, int, int, int]) -> Any:
    import torch

    frames = x.shape[2]
    factor = int(module.temporal_compression_ratio)
    latent_frames = (frames - 1) // factor + 1
    latent_tile, latent_stride = (TIME_TILE - 1) // factor, TIME_STRIDE // factor
    row = []
    for start in range(0, frames - (TIME_TILE - 1) + 1, TIME_STRIDE):
        tile = _space_tiled_or_whole(module, x[:, :, start:start + TIME_TILE], tiles)
        row.append(tile[:, :, 1:] if start > 0 else tile)
    kept = []
    for i, tile in enumerate(row):
        if i == 0:
            kept.append(tile[:, :, :latent_stride + 1])
            continue
        tile = _blend(row[i - 1], tile, latent_tile - latent_stride, dim=2)
        kept.append(tile[:, :, :latent_tile if i == len(row) - 1 else latent_stride])
    return torch.cat(kept, dim=2)[:, :, :latent_frames]


def _blend(before: Any, after: Any, extent: int, dim: int) -> Any:
    """`after`'s first `extent` entries along `dim` mixed with `before`'s last ones, linearly, in place."""
    extent = min(before.shape[dim], after.shape[dim], extent)
    for k in range(extent):
        target = after.select(dim, k)
        target.copy_(before.select(dim, before.shape[dim] - extent + k) * (1 - k / extent) + target * (k / extent))
    return after


def whole_clip_rule(rule: FrameRule) -> FrameRule:
    """HunyuanVideo's 1 + 4k frames up to 17, then only the counts Kandinsky 5's time tiles cover whole (1 + 8k), and
    only the frame sizes its space tiles cover whole."""
    if rule.temporal_factor != 4:
        from vaecache.errors import VaeSpecError

        raise VaeSpecError(f"Kandinsky 5 trains on HunyuanVideo's VAE, which compresses time 4x; this "
                           f"{rule.label} compresses it {rule.temporal_factor}x")
    return replace(rule, long_above=TIME_TILE, long_step=TIME_STRIDE, label="Kandinsky 5", size_problem=uncovered_size,
                   long_reason=f"above {TIME_TILE} frames its trainers' encode (17-frame time tiles every 8 frames, "
                               "kandinsky5/models/vae.py) covers only 1 + 8k frames whole")


TILES = ReferenceEncode(
    "kandinsky5-tiles", "Kandinsky 5's own tiles: 17-frame time tiles every 8 frames above 17 frames, space tiles "
    "where 256 * 17 * (h + 32) * (w + 32) >= 2**31 (its free-memory term left out)", SOURCE, encode_tiled,
    params={"time_tile": TIME_TILE, "time_stride": TIME_STRIDE, "space": "element bound 2**31, no memory term"},
    time_tiles_above=TIME_TILE, spatial_bands=False)

I2V = ConditionPipeline("kandinsky5", "diffusers Kandinsky5I2VPipeline.prepare_latents's image latent "
                        "(pipelines/kandinsky5/pipeline_kandinsky_i2v.py), its posterior mean", ("first-frame",),
                        asked=True, needs="scaling_factor", first_frame_alone=True,
                        arithmetic=lambda: importlib.import_module("vaecache.models._kandinsky5_conditions"))
"""Asked by name: HunyuanVideo's VAE serves other image-to-video pipelines too."""

PROMPT_TEMPLATE = "\n".join([
    "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
    "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
    "Describe the location of the video, main characters or objects and their action.",
    "Describe the dynamism of the video and presented actions.",
    "Name the visual style of the video: whether it is a professional footage, user generated content, some kind of "
    "animation, video game or scren content.",
    "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
    "Pay attention to the order of key actions shown in the scene.<|im_end|>",
    "<|im_start|>user\n{}<|im_end|>",
])
"""diffusers' Kandinsky5T2VPipeline.prompt_template (0.42.1, `pipeline_kandinsky.py`: its `__init__`; the I2V
pipeline's is the same)."""


def one_prompt_encode() -> Any:
    from vaecache.models._kandinsky5_text import encode_one_prompt

    return encode_one_prompt


PIPELINE_TEXT = TextFamily("kandinsky5", 512, "wan", "diffusers Kandinsky5T2VPipeline.encode_prompt: prompt_clean, "
                           "_encode_prompt_qwen (prompt_template, its text truncation at 512 tokens, no attention "
                           "mask, hidden_states[-1], the first 128 rows cropped; one prompt alone) and "
                           "_encode_prompt_clip (CLIP pooler_output at 77 tokens)", masked=False,
                           template=PROMPT_TEMPLATE, crop_start=128, layer=-1, pooled_length=77,
                           one_prompt=one_prompt_encode, pooled_masked=True)
"""Kandinsky 5 (T2V, I2V): Qwen2.5-VL's rows of the prompt alone (every row is the prompt's: no padding), its length
the pipeline's cu_seqlens, and CLIP-L's pooled output."""
MUSUBI_TEMPLATE = "\n".join([
    "<|im_start|>system\nYou are a promt engineer. Describe the video in detail.",
    *PROMPT_TEMPLATE.split("\n")[2:]])
"""musubi-tuner's Qwen2_5_VLTextEmbedder.PROMPT_TEMPLATE["template"]["video"] (kandinsky5/models/text_embedders.py,
commit 30c658c: the Kandinsky 5 authors' own, "promt" as they spell it)."""
MUSUBI_TEXT = TextFamily("kandinsky5-musubi", 512, "none", "musubi-tuner kandinsky5_cache_text_encoder_outputs"
                         ".py encode_and_save_batch (30c658c): Qwen2_5_VLTextEmbedder (its video template, "
                         "crop 129, padded to 512 + 129 without an attention mask, hidden_states[-1], rows "
                         "trimmed to the mask) and ClipTextEmbedder (pooler_output at 77 tokens)", masked=False,
                         template=MUSUBI_TEMPLATE, crop_start=129, layer=-1, pooled_length=77,
                         pooled_masked=True, pooled_tokenization="slow-clip")
"""musubi-tuner's Kandinsky 5 text conditioning (`--text-convention musubi`), what its k5 text caches hold: the
authors' template and crop, the prompt as given, CLIP tokenized by musubi's pinned transformers (the slow class)."""
MUSUBI_IMAGE_TEMPLATE = "\n".join([
    "<|im_start|>system\nYou are a promt engineer. Describe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>",
    "<|im_start|>user\n{}<|im_end|>"])
"""musubi-tuner's Qwen2_5_VLTextEmbedder.PROMPT_TEMPLATE["template"]["image"] (kandinsky5/models/text_embedders.py,
commit 30c658c), crop 41: what `kandinsky5_cache_text_encoder_outputs.py` embeds a batch with when no item in it has a
frame count above 1 (:44-45), which is every batch its caching builds (`image_video_dataset.py:231`)."""
MUSUBI_IMAGE_TEXT = replace(
    MUSUBI_TEXT, template=MUSUBI_IMAGE_TEMPLATE, crop_start=41,
    reference="musubi-tuner kandinsky5_cache_text_encoder_outputs.py encode_and_save_batch (30c658c) as its caching "
              "runs it: Qwen2_5_VLTextEmbedder with its image template (crop 41, padded to 512 + 41 without an "
              "attention mask, hidden_states[-1], rows trimmed to the mask) and ClipTextEmbedder (pooler_output at 77 "
              "tokens)")
TEXT = TextEncoders(("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline"), PIPELINE_TEXT, MUSUBI_TEXT, "Kandinsky 5",
                    musubi_templates={"video": MUSUBI_TEXT, "image": MUSUBI_IMAGE_TEXT})
"""--k5-template: the template musubi's convention embeds with (video: its sampling's; image: its caching script's,
see MUSUBI_IMAGE_TEXT)."""

FAMILY = Family("kandinsky5", "Kandinsky 5", (VAE_CLASS,), TILES, frame_rule=whole_clip_rule,
                musubi_arch="k5", conditions=(I2V,), text=TEXT)

__all__ = ["FAMILY", "MEMORY_FREE_FOR_SAME_TILES", "TILES", "encode_tiled", "space_tiles", "uncovered_size",
           "whole_clip_rule"]
