"""FramePack's sections (musubi-tuner `--arch fp`), as its `fpack_cache_latents.py` caches them (commit 30c658c:
`encode_and_save_batch`), from a HunyuanVideo VAE cache: pure tensor arithmetic over one camera's latent.

- The latent is FramePack's `hunyuan.vae_encode` of the clip: the posterior (mean here, a sample there) times the
  VAE's scaling_factor.
- A clip of L latent frames holds floor((L - 1) / window) sections (`--fp-latent-window-size`, 9 by default); musubi
  trims a longer clip to sections * window * 4 + 1 frames before encoding, which vaecache cannot do to latents already
  encoded, so a clip must have exactly that many frames (refused otherwise, naming the counts), and at least
  window * 4 + 1.
- `inverted` (musubi's default): sections in inference order, from the last in time, the padding trick (`[3] + [2] *
  (n - 3) + [1, 0]` above four sections), clean latents the first frame and history (zeros, then what was
  "generated": the true latents), indices as inference builds them; `f1` (`--f1`, vanilla sampling): sections in
  time order, history the frames before the section. One-frame training (`--one_frame`) reads control images from
  musubi's own dataset configuration and is not exported.
- Each section file holds `latents_{F}x{H}x{W}_<dtype>` (the section's target latents), `latents_clean_…`,
  `latents_clean_2x_…`, `latents_clean_4x_…` (all named with the target's F, as save_latent_cache_framepack names
  them), their int64 indices, and `image_embeddings_<latent dtype>` (the first frame's SigLIP features).
"""

from __future__ import annotations

from typing import Any

import torch

FP_MODES = ("inverted", "f1")
HISTORY = (1, 2, 16)
"""The clean latents' 1x, 2x and 4x history lengths FramePack conditions on."""


def framepack_sections_of(frames: int, window: int) -> int:
    """The sections a clip of `frames` frames holds, or 0 where it holds none (fewer than window * 4 + 1 frames)."""
    latent_frames = (frames - 1) // 4 + 1
    return max((latent_frames - 1) // window, 0)


def aligned_frames(sections: int, window: int) -> int:
    return sections * window * 4 + 1


def framepack_sections(latent: torch.Tensor, window: int, mode: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(section index, {name stem: tensor}) of every section of one camera's scaled latent (C, L, H, W), L aligned:
    stems `latents`, `latent_indices`, `latents_clean`, `clean_latent_indices`, `latents_clean_2x`,
    `clean_latent_2x_indices`, `latents_clean_4x`, `clean_latent_4x_indices`."""
    video = latent[None]
    channels, total_frames, height, width = latent.shape
    sections = (total_frames - 1) // window
    found: list[tuple[int, dict[str, torch.Tensor]]] = []
    if mode == "inverted":
        paddings = list(reversed(range(sections)))
        if sections > 4:
            paddings = [3] + [2] * (sections - 3) + [1, 0]
        history = torch.zeros((1, channels, sum(HISTORY), height, width), dtype=video.dtype)
        start, section = total_frames - window, sections - 1
        for padding in paddings:
            last = section == 0
            pad = padding * window
            pre, _, latent_indices, post, indices_2x, indices_4x = torch.arange(
                0, sum([1, pad, window, *HISTORY])).unsqueeze(0).split([1, pad, window, *HISTORY], dim=1)
            post_latents, latents_2x, latents_4x = history[:, :, :sum(HISTORY)].split(list(HISTORY), dim=2)
            target = video[:, :, start:start + window]
            found.append((section, {
                "latents": target[0], "latent_indices": latent_indices[0],
                "latents_clean": torch.cat([video[:, :, 0:1], post_latents], dim=2)[0],
                "clean_latent_indices": torch.cat([pre, post], dim=1)[0],
                "latents_clean_2x": latents_2x[0], "clean_latent_2x_indices": indices_2x[0],
                "latents_clean_4x": latents_4x[0], "clean_latent_4x_indices": indices_4x[0]}))
            generated = video[:, :, :window + 1] if last else target
            history = torch.cat([generated, history], dim=2)
            section, start = section - 1, start - window
        return found
    if mode != "f1":
        raise ValueError(f"FramePack mode must be one of {', '.join(FP_MODES)}, got {mode!r}")
    count = sum(HISTORY)
    for section in range(sections):
        first = section * window + 1
        target = video[:, :, first:first + window]
        history = torch.zeros((1, 16, count, height, width), dtype=video.dtype)  # musubi's 16: HunyuanVideo's C
        history_start, video_start, copied = 0, first - count, count
        if video_start < 0:
            history_start, copied, video_start = -video_start, count + video_start, 0
        if copied > 0:
            history[:, :, history_start:] = video[:, :, video_start:video_start + copied]
        start_index, indices_4x, indices_2x, indices_1x, latent_indices = torch.arange(
            0, sum([1, 16, 2, 1, window])).unsqueeze(0).split([1, 16, 2, 1, window], dim=1)
        latents_4x, latents_2x, latents_1x = history.split([16, 2, 1], dim=2)
        found.append((section, {
            "latents": target[0], "latent_indices": latent_indices[0],
            "latents_clean": torch.cat([video[:, :, 0:1], latents_1x], dim=2)[0],
            "clean_latent_indices": torch.cat([start_index, indices_1x], dim=1)[0],
            "latents_clean_2x": latents_2x[0], "clean_latent_2x_indices": indices_2x[0],
            "latents_clean_4x": latents_4x[0], "clean_latent_4x_indices": indices_4x[0]}))
    return found


def framepack_file_tensors(stems: dict[str, torch.Tensor], image_embeddings: torch.Tensor) -> dict[str, torch.Tensor]:
    """One section's tensors under save_latent_cache_framepack's keys (cache_io.py: the latents' `{F}x{H}x{W}` of the
    target section on every latent key, the latent dtype on every latent key and on `image_embeddings`)."""
    target = stems["latents"]
    _, frames, height, width = target.shape
    shape, dtype = f"{frames}x{height}x{width}", str(target.dtype).removeprefix("torch.")
    tensors: dict[str, torch.Tensor] = {f"image_embeddings_{dtype}": image_embeddings.contiguous()}
    for stem, tensor in stems.items():
        if stem.startswith("latents"):
            tensors[f"{stem}_{shape}_{dtype}"] = tensor.contiguous()
        else:
            tensors[f"{stem}_{str(tensor.dtype).removeprefix('torch.')}"] = tensor.contiguous()
    return tensors


def framepack_text_tensors(texts: Any, clip: str) -> dict[str, torch.Tensor]:
    """A clip's `<item>_fp_te.safetensors` as fpack_cache_text_encoder_outputs.py writes it from a HunyuanVideo text
    set: `llama_vec_<dtype>` the prompt's rows zero-padded to 512 (crop_or_pad_yield_mask), `llama_attention_mask`
    (bool, the prompt's rows), `clip_l_pooler_<dtype>` (CLIP-L's pooled output)."""
    rows, tokens, pooled = texts.rows(clip), texts.tokens(clip), texts.pooled(clip)
    llama = rows.new_zeros((512, rows.shape[1]))
    llama[:min(tokens, 512)] = rows[:min(tokens, 512)]
    mask = torch.zeros(512, dtype=torch.bool)
    mask[:tokens] = True
    return {f"llama_vec_{str(llama.dtype).removeprefix('torch.')}": llama, "llama_attention_mask": mask,
            f"clip_l_pooler_{str(pooled.dtype).removeprefix('torch.')}": pooled.contiguous()}


__all__ = ["FP_MODES", "aligned_frames", "framepack_file_tensors", "framepack_sections", "framepack_sections_of",
           "framepack_text_tensors"]
