"""ltx-core's own text path as LTX-2's trainer runs it (github Lightricks/LTX-2 at 400fd31, the commit vaecache
cites): `LTXGemmaTokenizer.tokenize_with_weights` (`packages/ltx-core/src/ltx_core/text_encoders/gemma/tokenizer.py`),
`LTXGemmaTextEncoder.encode` (`encoders/base_encoder.py`, the base model's hidden states) and `FeatureExtractorV1` /
`FeatureExtractorV2` with their normalizations (`feature_extractor.py`), copied; the only change is einops'
`rearrange` written as the `view` it is (einops is not a vaecache dependency). ltx-core itself is not imported: its
package pulls torchaudio, whose extension is built for another torch. The reference vaecache's LTX-2 text set is held
against, beside diffusers' LTX2Pipeline."""

from __future__ import annotations

import math

import torch
from torch import nn


def tokenize_with_weights(tokenizer, text: str, max_length: int = 1024) -> dict[str, list[tuple[int, int]]]:
    """LTXGemmaTokenizer(tokenizer, max_length, PaddingSide.LEFT).tokenize_with_weights(text)."""
    tokenizer.model_max_length = max_length
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    text = text.strip()
    bos_id = tokenizer.bos_token_id
    if bos_id is None:
        raise ValueError("Tokenizer is missing bos_token_id; encode path requires a leading BOS.")
    encoded = tokenizer(text, padding=False, truncation=True, max_length=max_length, return_tensors="pt")
    input_ids = encoded.input_ids[0].tolist()
    if not input_ids or input_ids[0] != bos_id:
        input_ids = [bos_id, *input_ids][:max_length]
    padded = tokenizer.pad({"input_ids": [input_ids]}, padding="max_length", max_length=max_length,
                           return_tensors="pt", return_attention_mask=True)
    input_ids = padded.input_ids
    attention_mask = padded.attention_mask
    return {"gemma": [(t, w) for t, w in zip(input_ids[0], attention_mask[0], strict=True)]}


def encode(model, tokenizer, prompts: list[str]) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """LTXGemmaTextEncoder.encode: `model` is the base model (its `self.model.model`)."""
    tokenized = [tokenize_with_weights(tokenizer, t)["gemma"] for t in prompts]
    input_ids = torch.tensor([[tok for tok, _ in pairs] for pairs in tokenized])
    attention_mask = torch.tensor([[w for _, w in pairs] for pairs in tokenized])
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hidden_states = outputs.hidden_states
    return [(tuple(h[i: i + 1] for h in hidden_states), attention_mask[i: i + 1]) for i in range(len(prompts))]


def _norm_and_concat_padded_batch(encoded_text: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    b, _, d, l = encoded_text.shape  # noqa: E741
    eps = 1e-6

    sequence_lengths = attention_mask.sum(dim=-1)
    mask = attention_mask.bool()[:, :, None, None]  # rearrange(attention_mask.bool(), "b t -> b t 1 1")

    masked = encoded_text.masked_fill(~mask, 0.0)
    denom = (sequence_lengths * d).view(b, 1, 1, 1)
    mean = masked.sum(dim=(1, 2), keepdim=True) / (denom + eps)

    x_min = encoded_text.masked_fill(~mask, float("inf")).amin(dim=(1, 2), keepdim=True)
    x_max = encoded_text.masked_fill(~mask, float("-inf")).amax(dim=(1, 2), keepdim=True)
    range_ = x_max - x_min

    normed = 8 * (encoded_text - mean) / (range_ + eps)
    normed = normed.reshape(b, -1, d * l)

    mask_flattened = mask[:, :, :, 0].expand(-1, -1, d * l)  # rearrange(mask, "b t 1 1 -> b t 1").expand(...)
    return normed.masked_fill(~mask_flattened, 0.0)


def norm_and_concat_per_token_rms(encoded_text: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    B, T, D, L = encoded_text.shape  # noqa: N806
    variance = torch.mean(encoded_text**2, dim=2, keepdim=True)  # [B,T,1,L]
    normed = encoded_text * torch.rsqrt(variance + 1e-6)
    normed = normed.reshape(B, T, D * L)
    mask_3d = attention_mask.bool().unsqueeze(-1)  # [B, T, 1]
    return torch.where(mask_3d, normed, torch.zeros_like(normed))


def _rescale_norm(x: torch.Tensor, target_dim: int, source_dim: int) -> torch.Tensor:
    return x * math.sqrt(target_dim / source_dim)


class FeatureExtractorV1(nn.Module):
    def __init__(self, aggregate_embed: nn.Module, is_av: bool = False):
        super().__init__()
        self.aggregate_embed = aggregate_embed
        self.is_av = is_av

    def forward(self, hidden_states, attention_mask, padding_side="left"):  # noqa: ARG002
        encoded = torch.stack(hidden_states, dim=-1) if isinstance(hidden_states, (list, tuple)) else hidden_states
        dtype = encoded.dtype
        normed = _norm_and_concat_padded_batch(encoded, attention_mask)
        features = self.aggregate_embed(normed.to(dtype))
        if self.is_av:
            return features, features
        return features, None


class FeatureExtractorV2(nn.Module):
    def __init__(self, video_aggregate_embed: nn.Linear, embedding_dim: int,
                 audio_aggregate_embed: nn.Linear | None = None):
        super().__init__()
        self.video_aggregate_embed = video_aggregate_embed
        self.audio_aggregate_embed = audio_aggregate_embed
        self.embedding_dim = embedding_dim

    def forward(self, hidden_states, attention_mask, padding_side="left"):  # noqa: ARG002
        encoded = torch.stack(hidden_states, dim=-1) if isinstance(hidden_states, (list, tuple)) else hidden_states
        normed = norm_and_concat_per_token_rms(encoded, attention_mask)
        normed = normed.to(encoded.dtype)
        v_dim = self.video_aggregate_embed.out_features
        video = self.video_aggregate_embed(_rescale_norm(normed, v_dim, self.embedding_dim))
        audio = None
        if self.audio_aggregate_embed is not None:
            a_dim = self.audio_aggregate_embed.out_features
            audio = self.audio_aggregate_embed(_rescale_norm(normed, a_dim, self.embedding_dim))
        return video, audio


def feature_extractor(connectors) -> nn.Module:
    """The extractor ltx-core builds for a checkpoint, over the LTX2TextConnectors' own Linear layers (the same weights
    ltx-core loads as `aggregate_embed` / `video_aggregate_embed` / `audio_aggregate_embed`)."""
    if connectors.config.per_modality_projections:
        return FeatureExtractorV2(connectors.video_text_proj_in, connectors.config.caption_channels,
                                  connectors.audio_text_proj_in)
    return FeatureExtractorV1(connectors.text_proj_in, is_av=True)


def process_captions_item(model, tokenizer, extractor, prompt: str) -> dict[str, torch.Tensor]:
    """What scripts/process_captions.py saves for one caption (`embedding_data`), in fp32."""
    hidden_states, prompt_attention_mask = encode(model, tokenizer, [prompt])[0]
    video_prompt_embeds, audio_prompt_embeds = extractor(hidden_states, prompt_attention_mask, "left")
    data = {"video_prompt_embeds": video_prompt_embeds[0].cpu().contiguous(),
            "prompt_attention_mask": prompt_attention_mask[0].cpu().contiguous()}
    if audio_prompt_embeds is not None:
        data["audio_prompt_embeds"] = audio_prompt_embeds[0].cpu().contiguous()
    return data
