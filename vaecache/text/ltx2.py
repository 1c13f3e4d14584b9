"""LTX-2's text features as LTX-2's trainer stores them (github Lightricks/LTX-2 at 400fd31,
`packages/ltx-trainer/scripts/process_captions.py`): the Gemma encoder's every hidden state (the embeddings' and each
layer's) for a prompt left-padded to 1024 tokens, through the checkpoint's feature extractor, before the connectors
(which run during training).

- **Tokens** as ltx-core's `LTXGemmaTokenizer.tokenize_with_weights` gives them
  (`ltx_core/text_encoders/gemma/tokenizer.py`): the prompt stripped, truncated to 1024 tokens, a `<bos>` put first
  where the tokenizer did not (Gemma 4's does not), then left-padded with the pad token (the eos token where there is
  none). For Gemma 3, whose tokenizer emits `<bos>`, these are the ids diffusers'
  `LTX2Pipeline._get_gemma_prompt_embeds` tokenizes.
- **Hidden states** of the base model (`LTXGemmaTextEncoder.encode` runs `model.model`, skipping the LM head;
  diffusers' pipeline runs the whole model, whose hidden states are the same), stacked on a last axis: (B, T, D, L).
- **The feature extractor** (`ltx_core/text_encoders/gemma/feature_extractor.py`), whose weights diffusers keeps in
  the pipeline's `connectors/` (`LTX2TextConnectors`, `pipelines/ltx2/connectors.py`):
  V1 (LTX-2.0, `per_modality_projections` false): each prompt's hidden states normalized over its tokens and width
  per layer (masked mean, min-max range, times 8), flattened, padded rows zeroed, through `text_proj_in`; the audio
  features are the video features (`FeatureExtractorV1(is_av=True)` returns them twice).
  V2 (LTX-2.3, `per_modality_projections` true): each token's hidden state RMS-normalized per layer, flattened, padded
  rows zeroed, scaled by sqrt(out / width) and through `video_text_proj_in` and `audio_text_proj_in` (a Linear with
  a bias where `proj_bias`: its padded rows are the bias, stored as computed).

A set stores each prompt's 1024 rows of video features, followed in the same row by the audio features where they
differ (V2): (1024, video_width + audio_width); the token count rebuilds the left-padded mask.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vaecache.errors import VaeSpecError
from vaecache.weights import WeightsError, check_finite, read_json_file, safetensors_header, weights_sha256

LTX2_LENGTH = 1024
"""ltx-core's TOKENIZER_MAX_LENGTH (`gemma_assets.py`), diffusers' max_sequence_length default."""
V1_SCALE = 8
"""The V1 normalization's factor (`_norm_and_concat_padded_batch`'s `8 *`, diffusers' `scale_factor=8`)."""
EPS = 1e-6


@dataclass(frozen=True)
class Ltx2Projection:
    """The feature extractor's weights read from an LTX2Pipeline folder's connectors/ (nothing else of the connectors
    is loaded: their transformer runs during training, not here)."""

    version: int
    """1: one text_proj_in shared by video and audio; 2: video_text_proj_in and audio_text_proj_in."""
    width: int
    """The Gemma hidden size (caption_channels)."""
    layers: int
    """Hidden states stacked (text_proj_in_factor: the Gemma layers + 1)."""
    video: torch.nn.Linear
    audio: torch.nn.Linear | None
    record: dict[str, Any]

    @property
    def video_width(self) -> int:
        return int(self.video.out_features)

    @property
    def audio_width(self) -> int:
        """The stored audio columns (0 for V1, whose audio features are its video features)."""
        return int(self.audio.out_features) if self.audio is not None else 0

    @property
    def stored_width(self) -> int:
        return self.video_width + self.audio_width

    def to(self, device: torch.device, dtype: torch.dtype) -> Ltx2Projection:
        for linear in (self.video, self.audio):
            if linear is not None:
                linear.to(device=device, dtype=dtype).eval().requires_grad_(False)
        return self


CONFIG_KEYS = ("caption_channels", "text_proj_in_factor", "per_modality_projections", "video_hidden_dim",
               "audio_hidden_dim", "proj_bias")
DEFAULTS = {"caption_channels": 3840, "text_proj_in_factor": 49, "per_modality_projections": False,
            "video_hidden_dim": 4096, "audio_hidden_dim": 2048, "proj_bias": False}
"""LTX2TextConnectors' defaults (diffusers 0.42, `connectors.py`), for a config that leaves a key out."""


def load_projection(folder: Path, spec: str, text_config: Any) -> Ltx2Projection:
    """The feature extractor of the LTX2Pipeline folder's connectors/ `folder`, strictly: each weight it needs present
    with the shape its config gives, finite, and its width and layer count the Gemma encoder's. A VaeSpecError or
    WeightsError (one line naming the file) otherwise."""
    from safetensors import safe_open

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise VaeSpecError(f"--text-encoder {spec}: no {config_path} (an LTX2Pipeline folder keeps LTX-2's text "
                           "feature extractor in connectors/)")
    raw = read_json_file(config_path, "the connectors' config")
    if not isinstance(raw, dict) or raw.get("_class_name") not in (None, "LTX2TextConnectors"):
        raise VaeSpecError(f"{config_path}: not an LTX2TextConnectors config")
    config = {key: raw.get(key, DEFAULTS[key]) for key in CONFIG_KEYS}
    width, factor = int(config["caption_channels"]), int(config["text_proj_in_factor"])
    hidden = int(getattr(text_config, "hidden_size", 0) or 0)
    layers = int(getattr(text_config, "num_hidden_layers", 0) or 0) + 1
    if (width, factor) != (hidden, layers):
        raise VaeSpecError(f"{config_path}: the feature extractor takes {factor} hidden states of width {width}, but "
                           f"the Gemma encoder gives {layers} of width {hidden}: they are not one model's")
    bias = bool(config["proj_bias"])
    if config["per_modality_projections"]:
        wanted = {"video_text_proj_in": int(config["video_hidden_dim"]),
                  "audio_text_proj_in": int(config["audio_hidden_dim"])}
    else:
        wanted = {"text_proj_in": width}
    shapes = {f"{name}.weight": (out, width * factor) for name, out in wanted.items()}
    shapes.update({f"{name}.bias": (out,) for name, out in wanted.items() if bias})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VaeSpecError(f"--text-encoder {spec}: {folder} holds no .safetensors weights")
    holder: dict[str, Path] = {}
    for path in files:
        for key in safetensors_header(path):
            if key in shapes or key.endswith(".bias") and key.removesuffix(".bias") in wanted:
                holder[key] = path
    for key, shape in shapes.items():
        if key not in holder:
            raise WeightsError(f"{folder}: weight {key} is missing (the feature extractor's {shape})")
    extra = sorted(key for key in holder if key not in shapes)
    if extra:
        raise WeightsError(f"{folder}: weight {extra[0]} is in the file, but the config says proj_bias is false")
    state: dict[str, torch.Tensor] = {}
    for key, path in holder.items():
        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(key)
        if tuple(tensor.shape) != shapes[key]:
            raise WeightsError(f"{path}: weight {key} has shape {tuple(tensor.shape)}, the config gives "
                               f"{shapes[key]}")
        state[key] = tensor
    check_finite(state, str(folder))

    def linear(name: str) -> torch.nn.Linear:
        out, inputs = shapes[f"{name}.weight"]
        module = torch.nn.Linear(inputs, out, bias=bias)
        module.load_state_dict({key.removeprefix(f"{name}."): value for key, value in state.items()
                                if key.startswith(f"{name}.")}, strict=True)
        return module

    version = 2 if config["per_modality_projections"] else 1
    video = linear("video_text_proj_in" if version == 2 else "text_proj_in")
    audio = linear("audio_text_proj_in") if version == 2 else None
    modules = torch.nn.ModuleDict({"video": video, **({"audio": audio} if audio is not None else {})})
    record = {"class": "LTX2TextConnectors", "config": json.loads(json.dumps(config, sort_keys=True)),
              "feature_extractor": f"V{version}", "weights_sha256": weights_sha256(modules)}
    return Ltx2Projection(version, width, factor, video, audio, record)


def ltx2_token_ids(tokenizer: Any, prompts: list[str], length: int = LTX2_LENGTH) -> tuple[torch.Tensor, torch.Tensor,
                                                                                           list[bool]]:
    """(ids, attention mask) of shape (len(prompts), length), left-padded, and whether each prompt was truncated:
    ltx-core's `LTXGemmaTokenizer.tokenize_with_weights`, one prompt at a time as it tokenizes."""
    bos = tokenizer.bos_token_id
    if bos is None:
        raise VaeSpecError("the Gemma tokenizer has no bos_token_id (LTX-2's encoding puts <bos> first)")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows, masks, truncated = [], [], []
    for prompt in prompts:
        text = prompt.strip()
        whole = tokenizer(text, padding=False, truncation=False)["input_ids"]
        if not whole or whole[0] != bos:
            whole = [bos, *whole]
        truncated.append(len(whole) > length)
        ids = tokenizer(text, padding=False, truncation=True, max_length=length)["input_ids"]
        if not ids or ids[0] != bos:
            ids = [bos, *ids][:length]
        padded = tokenizer.pad({"input_ids": [ids]}, padding="max_length", max_length=length, return_tensors="pt",
                               return_attention_mask=True)
        rows.append(padded["input_ids"][0])
        masks.append(padded["attention_mask"][0])
    return torch.stack(rows), torch.stack(masks), truncated


def ltx2_features(hidden_states: tuple[torch.Tensor, ...], mask: torch.Tensor,
                  projection: Ltx2Projection) -> torch.Tensor:
    """(B, T, video_width + audio_width): the feature extractor's video (and, V2, audio) features of the stacked
    hidden states, ltx-core's arithmetic (FeatureExtractorV1 / V2)."""
    encoded = torch.stack(hidden_states, dim=-1)
    batch, tokens, width, layers = encoded.shape
    dtype = encoded.dtype
    if projection.version == 1:
        lengths = mask.sum(dim=-1)
        valid = mask.bool().view(batch, tokens, 1, 1)
        masked = encoded.masked_fill(~valid, 0.0)
        mean = masked.sum(dim=(1, 2), keepdim=True) / ((lengths * width).view(batch, 1, 1, 1) + EPS)
        low = encoded.masked_fill(~valid, float("inf")).amin(dim=(1, 2), keepdim=True)
        high = encoded.masked_fill(~valid, float("-inf")).amax(dim=(1, 2), keepdim=True)
        normed = (V1_SCALE * (encoded - mean) / (high - low + EPS)).reshape(batch, -1, width * layers)
        normed = normed.masked_fill(~valid.view(batch, tokens, 1).expand(-1, -1, width * layers), 0.0)
        return projection.video(normed.to(dtype))
    variance = torch.mean(encoded ** 2, dim=2, keepdim=True)
    normed = (encoded * torch.rsqrt(variance + EPS)).reshape(batch, tokens, width * layers)
    normed = torch.where(mask.bool().unsqueeze(-1), normed, torch.zeros_like(normed)).to(dtype)
    video = projection.video(normed * math.sqrt(projection.video_width / width))
    audio = projection.audio(normed * math.sqrt(projection.audio_width / width))  # type: ignore[misc]
    return torch.cat([video, audio], dim=-1)


def split_features(rows: torch.Tensor, video_width: int, audio_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, audio) features of stored rows: the audio columns after the video's, or (V1, audio_width 0) the video
    features themselves."""
    video = rows[..., :video_width]
    return video, (rows[..., video_width:video_width + audio_width] if audio_width else video)


__all__ = ["LTX2_LENGTH", "Ltx2Projection", "load_projection", "ltx2_features", "ltx2_token_ids", "split_features"]
