"""Loading a text encoder from a --text-encoder SPEC and embedding prompts the way its pipeline does.

SPEC:
  diffusers:PATH[#SUBFOLDER]  a diffusers pipeline folder: model_index.json names the pipeline (its family,
                              vaecache.text.families), SUBFOLDER (default text_encoder) holds the encoder and
                              PATH/tokenizer the tokenizer
                              (LTX2Pipeline: also PATH/connectors, LTX-2's feature extractor)
  transformers:PATH           any transformers encoder folder with its tokenizer files (in PATH, or PATH/tokenizer),
                              at --text-length tokens, hidden layer --text-layer (default: the last hidden state)

Local files only, safetensors unless pickled weights are allowed. Prompts are embedded in batches of a fixed shape
(`batch` prompts, padded with empty ones, each padded to the family's length), so a prompt's rows do not depend on
which other prompts share its batch's run, how many ranks there are, or a resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vaecache.errors import UsageError, VaeSpecError, first_line
from vaecache.settings.dtypes import recorded_name, torch_dtype
from vaecache.text import clip_slow
from vaecache.text.families import (
    TextFamily,
    check_text_spec,
    family_for_pipeline,
    generic_family,
    installed_version,
)
from vaecache.text.ltx2 import Ltx2Projection, load_projection, ltx2_features, ltx2_token_ids
from vaecache.weights import load_pretrained, read_json_file, weights_sha256

ENCODER_ONLY = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
"""transformers model types whose checkpoints hold an encoder-decoder: their encoder-only class."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt")
"""The files a tokenizer is read from (a transformers:PATH model folder holds the weights too: not hashed twice)."""
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")


@dataclass(frozen=True)
class TextEmbedding:
    rows: torch.Tensor
    """(tokens, hidden) in the stored dtype, on the CPU."""
    tokens: int
    truncated: bool
    """The prompt had more tokens than the family's length."""
    pooled: torch.Tensor | None = None
    """(hidden,) the second encoder's pooled output in the stored dtype (HunyuanVideo's CLIP-L), else None."""
    pooled_tokens: int = 0
    pooled_truncated: bool = False
    glyph: torch.Tensor | None = None
    """(glyph tokens, hidden) the glyph encoder's rows of the prompt's quoted text, trimmed to its mask, in the stored
    dtype (HunyuanVideo 1.5's ByT5; no rows where the prompt quotes nothing), else None."""
    glyph_tokens: int = 0
    glyph_truncated: bool = False


class TextEncoder:
    """A loaded text encoder: `embed(prompts)` gives each cleaned prompt's rows, `fingerprint()` what decides them."""

    def __init__(self, *, spec: str, family: TextFamily, tokenizer: Any, model: torch.nn.Module, device: torch.device,
                 compute_dtype: torch.dtype, dtype: torch.dtype, layer: int | None, batch: int,
                 identity: dict[str, Any], pooled: tuple[Any, torch.nn.Module] | None = None,
                 projection: Ltx2Projection | None = None, glyph: tuple[Any, torch.nn.Module] | None = None) -> None:
        self.spec, self.family, self.tokenizer, self.model = spec, family, tokenizer, model
        self.projection = projection
        self.glyph_tokenizer, self.glyph_model = glyph or (None, None)
        self.device, self.compute_dtype, self.dtype = device, compute_dtype, dtype
        self.layer, self.batch = (family.layer if layer is None else layer), batch
        self.pooled_tokenizer, self.pooled_model = pooled or (None, None)
        self._identity = identity

    @property
    def hidden_size(self) -> int:
        """The width of a stored row (LTX-2: its video and audio features side by side)."""
        if self.projection is not None:
            return self.projection.stored_width
        config = self.model.config
        config = text_config(config)
        return int(getattr(config, "d_model", None) or getattr(config, "hidden_size"))

    def clean(self, text: str) -> str:
        return self.family.clean(text)

    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides the stored rows (the manifest's set fingerprint)."""
        return {**self._identity, "family": self.family.name, "reference": self.family.reference,
                "length": self.family.length, "layer": self.layer, "cleaning": self.family.cleaning,
                "ftfy": installed_version("ftfy") if self.family.cleaning == "wan" else None,
                "compute_dtype": recorded_name(self.compute_dtype), "stored_dtype": recorded_name(self.dtype),
                "batch_shape": (["each prompt alone, unpadded"] if self.family.alone
                                else [self.batch, self.family.length]),
                "hidden_size": self.hidden_size,
                "attention_mask_into_encoder": self.family.masked,
                "storage": "every row of the length" if self.family.full_length
                else "rows trimmed to the attention mask",
                **({"template": self.family.template, "crop_start": self.family.crop_start}
                   if self.family.template else {}),
                **({"pooled": {"length": self.family.pooled_length, "hidden_size": self.pooled_hidden_size,
                              **({"masked": True} if self.family.pooled_masked else {})}}
                   if self.pooled_model is not None else {}),
                **({"padding": self.family.padding} if self.family.padding != "right" else {}),
                **({"chat_system": self.family.chat_system, "crop_start": self.family.crop_start}
                   if self.family.chat_system else {}),
                **({"glyph": {"length": self.family.glyph_length, "hidden_size": self.glyph_hidden_size,
                             **({"order": self.family.glyph_order} if self.family.glyph_order != "diffusers" else {})}}
                   if self.glyph_model is not None else {}),
                **({"features": {"extractor": f"V{self.projection.version}", "layers": self.projection.layers,
                                 "video_width": self.projection.video_width,
                                 "audio_width": self.projection.audio_width}}
                   if self.projection is not None else {})}

    @property
    def glyph_hidden_size(self) -> int:
        return int(self.glyph_model.config.d_model) if self.glyph_model is not None else 0

    @property
    def pooled_hidden_size(self) -> int:
        return int(self.pooled_model.config.hidden_size) if self.pooled_model is not None else 0

    def token_counts(self, prompts: list[str]) -> list[int]:
        """The rows each (already cleaned) prompt will have stored: its tokens, special ones included, up to the
        length (the length itself where the family stores every row)."""
        if self.family.full_length:
            return [self.family.length] * len(prompts)
        counts: list[int] = []
        for start in range(0, len(prompts), 4096):
            ids = self.tokenizer(prompts[start:start + 4096], add_special_tokens=True, truncation=True,
                                 max_length=self.family.length)["input_ids"]
            counts.extend(len(row) for row in ids)
        return counts

    @torch.no_grad()
    def embed(self, prompts: list[str]) -> list[TextEmbedding]:
        """The rows of each (already cleaned) prompt, computed in batches of `batch` prompts (each prompt alone where
        the family embeds it so)."""
        found: list[TextEmbedding] = []
        if self.family.alone:
            return [self._alone(prompt) for prompt in prompts]
        for start in range(0, len(prompts), self.batch):
            chunk = prompts[start:start + self.batch]
            found.extend(self._embed_batch(chunk + [""] * (self.batch - len(chunk)))[:len(chunk)])
        return found

    def _alone(self, prompt: str) -> TextEmbedding:
        """One prompt by itself, by the family's own encode of it, with its pooled output."""
        rows, count, truncated = self.family.one_prompt()(self, prompt)
        pooled = self._pooled_batch([prompt])[0]
        return TextEmbedding(rows.to(self.dtype).cpu().clone(), count, truncated, *pooled)

    def _embed_batch(self, prompts: list[str]) -> list[TextEmbedding]:
        if self.projection is not None:
            return self._ltx2_batch(prompts)
        family = self.family
        length, crop = family.length, family.crop_start
        if family.chat_system is not None:
            inputs, full = self._chat_tokens(prompts)
        else:
            texts = [family.template.format(p) for p in prompts] if family.template else prompts
            inputs = self.tokenizer(texts, padding="max_length", max_length=length + crop, truncation=True,
                                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
            full = self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        output = self.model(input_ids=ids, attention_mask=mask if family.masked else None,
                            output_hidden_states=self.layer is not None)
        hidden = output.last_hidden_state if self.layer is None else output.hidden_states[self.layer]
        hidden = hidden.to(self.compute_dtype)
        if crop:  # the template's rows
            hidden, mask = hidden[:, crop:], mask[:, crop:]
        counts = mask.gt(0).sum(dim=1).tolist()
        pooled = self._pooled_batch(prompts)
        glyphs = [self._glyph_rows(prompt) for prompt in prompts] if self.glyph_model is not None else \
            [(None, 0, False)] * len(prompts)
        return [TextEmbedding(hidden[i, :length if family.full_length else n].to(self.dtype).cpu().clone(),
                              int(n), len(full[i]) > length + crop, *pooled[i], *glyphs[i])
                for i, n in enumerate(counts)]

    def _chat_tokens(self, prompts: list[str]) -> tuple[Any, list[list[int]]]:
        """The prompts in the tokenizer's chat template after the family's system message, tokenized at length +
        crop_start (and untruncated, to tell truncation): diffusers' HunyuanVideo15Pipeline._get_mllm_prompt_embeds
        with format_text_input (an empty prompt as one space)."""
        family = self.family
        conversations = [[{"role": "system", "content": family.chat_system},
                          {"role": "user", "content": p if p else " "}] for p in prompts]
        inputs = self.tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, return_dict=True, padding="max_length",
            max_length=family.length + family.crop_start, truncation=True, return_tensors="pt")
        full = self.tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, truncation=False)["input_ids"]
        return inputs, full

    def _glyph_rows(self, prompt: str) -> tuple[torch.Tensor, int, bool]:
        """The glyph encoder's rows of the prompt's quoted text (diffusers' _get_byt5_prompt_embeds, one prompt at
        a time as it runs them), trimmed to its mask, its token count and truncation; no rows where it quotes none."""
        length = self.family.glyph_length
        glyph_text = self.family.glyph_texts(prompt)
        if glyph_text is None:
            return torch.zeros((0, self.glyph_hidden_size), dtype=self.dtype), 0, False
        inputs = self.glyph_tokenizer(glyph_text, padding="max_length", max_length=length, truncation=True,
                                      add_special_tokens=True, return_tensors="pt")
        whole = len(self.glyph_tokenizer(glyph_text, add_special_tokens=True, truncation=False)["input_ids"])
        rows = self.glyph_model(input_ids=inputs.input_ids.to(self.device),
                                attention_mask=inputs.attention_mask.float().to(self.device))[0]
        count = int(inputs.attention_mask.sum())
        return rows[0, :count].to(self.compute_dtype).to(self.dtype).cpu().clone(), count, whole > length

    def _ltx2_batch(self, prompts: list[str]) -> list[TextEmbedding]:
        """LTX-2's features of each prompt (vaecache.text.ltx2): every row of the 1024, left-padded."""
        ids, mask, truncated = ltx2_token_ids(self.tokenizer, prompts, self.family.length)
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        features = ltx2_features(tuple(h.to(self.compute_dtype) for h in hidden), mask, self.projection)
        counts = mask.gt(0).sum(dim=1).tolist()
        return [TextEmbedding(features[i].to(self.dtype).cpu().clone(), int(n), truncated[i])
                for i, n in enumerate(counts)]

    def _pooled_batch(self, prompts: list[str]) -> list[tuple[torch.Tensor | None, int, bool]]:
        """The second encoder's pooled output of each prompt, its token count and truncation (HunyuanVideo's CLIP-L:
        `_get_clip_prompt_embeds`, max_length 77), or (None, 0, False) for the families without one."""
        if self.pooled_model is None:
            return [(None, 0, False)] * len(prompts)
        length = self.family.pooled_length
        inputs = self.pooled_tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                                       return_tensors="pt")
        full = self.pooled_tokenizer(prompts, truncation=False)["input_ids"]
        ids, attention = inputs["input_ids"], inputs["attention_mask"]
        mask = {"attention_mask": attention.to(self.device)} if self.family.pooled_masked else {}
        pooled = self.pooled_model(ids.to(self.device), output_hidden_states=False, **mask).pooler_output
        counts = attention.gt(0).sum(dim=1).tolist()
        return [(pooled[i].to(self.dtype).cpu().clone(), int(n), len(full[i]) > length)
                for i, n in enumerate(counts)]


def load_text_encoder(spec: str, device: torch.device | str = "cpu", *, compute_dtype: str = "fp32",
                      dtype: str = "fp32", length: int | None = None, layer: int | None = None, batch: int = 8,
                      allow_pickle_weights: bool = False, convention: str = "pipeline",
                      k5_template: str | None = None) -> TextEncoder:
    """The encoder of a --text-encoder SPEC on `device`, computing in `compute_dtype`, storing `dtype`. A
    UsageError or VaeSpecError (one line, naming the spec) for what cannot be loaded."""
    if batch < 1:
        raise UsageError(f"--text-batch must be >= 1, got {batch}")
    check_text_spec(spec)
    if compute_dtype == "fp16":
        raise UsageError("--compute-dtype fp16 is not supported: T5 overflows in fp16 unless some layers stay in fp32, "
                         "as transformers' own loading keeps them; compute in fp32 or bf16 (and store fp16 if wanted)")
    folders = text_encoder_folders(spec, length, layer, convention, k5_template)
    family = folders.family
    model_config = _read_config(folders.model, spec)
    check_text_shape(model_config, family, batch, spec, device)
    check_layer(model_config, layer, spec)
    pooled_config = None
    if folders.pooled is not None:
        pooled_config = _read_config(folders.pooled[0], spec)
        check_text_shape(pooled_config, generic_family(family.pooled_length), batch, spec, device)
    glyph_config = None
    if folders.glyph is not None:
        glyph_config = _read_config(folders.glyph[0], spec)
        check_text_shape(glyph_config, generic_family(family.glyph_length), 1, spec, device)
    model, identity = _load_model(folders.model, model_config, spec, allow_pickle_weights)
    tokenizer = _load_tokenizer(folders.tokenizer, spec)
    check_vocabulary(tokenizer, model, folders.tokenizer, folders.model)
    if family.crop_marker is not None:  # musubi's HunyuanVideo 1.5: the crop found in the template tokenized
        family = dataclasses.replace(family, crop_start=marker_crop(tokenizer, family, spec))
        check_text_shape(model_config, family, batch, spec, device)
    identity["tokenizer_sha256"] = _tokenizer_hashes(folders.tokenizer)
    compute = torch_dtype(compute_dtype)
    device = torch.device(device)
    model.to(device=device, dtype=compute).eval().requires_grad_(False)
    pooled = glyph = None
    if folders.pooled is not None:  # HunyuanVideo, Kandinsky 5: text_encoder_2 (CLIP-L) beside the LLM
        pooled, identity["pooled_encoder"] = _load_second_encoder(folders.pooled, pooled_config, spec,
                                                                  allow_pickle_weights, device, compute)
        if family.pooled_tokenization == clip_slow.NAME:  # musubi's pinned transformers: the slow CLIPTokenizer
            pooled = (_slow_clip(pooled[0], folders.pooled[1], spec), pooled[1])
            identity["pooled_encoder"]["tokenization"] = {"name": clip_slow.NAME, "reference": clip_slow.REFERENCE,
                                                          "ftfy": installed_version("ftfy")}
    if folders.glyph is not None:  # HunyuanVideo 1.5: text_encoder_2 (ByT5) beside Qwen2.5-VL
        glyph, identity["glyph_encoder"] = _load_second_encoder(folders.glyph, glyph_config, spec,
                                                                allow_pickle_weights, device, compute)
    projection = None
    if folders.features is not None:  # LTX-2: the feature extractor's weights in connectors/
        projection = load_projection(folders.features, spec, text_config(model_config)).to(device, compute)
        identity["feature_extractor"] = projection.record
    return TextEncoder(spec=folders.resolved, family=family, tokenizer=tokenizer, model=model, device=device,
                       compute_dtype=compute, dtype=torch_dtype(dtype), layer=layer, batch=batch, identity=identity,
                       pooled=pooled, projection=projection, glyph=glyph)


@dataclass(frozen=True)
class TextFolders:
    """Where a --text-encoder SPEC's parts are, checked to exist (nothing loaded)."""

    family: TextFamily
    model: Path
    tokenizer: Path
    resolved: str
    """The spec with its folder made absolute (what the set records)."""
    pooled: tuple[Path, Path] | None = None
    """(encoder, tokenizer) of the second encoder (HunyuanVideo's text_encoder_2, tokenizer_2)."""
    features: Path | None = None
    """LTX-2's connectors/ folder, which holds its text feature extractor."""
    glyph: tuple[Path, Path] | None = None
    """(encoder, tokenizer) of the glyph encoder (HunyuanVideo 1.5's text_encoder_2 ByT5, tokenizer_2)."""


def _load_second_encoder(folders: tuple[Path, Path], config: Any, spec: str, allow_pickle_weights: bool,
                         device: torch.device, compute: torch.dtype) -> tuple[tuple[Any, torch.nn.Module],
                                                                              dict[str, Any]]:
    """A second encoder beside the first ((encoder folder, tokenizer folder): HunyuanVideo's and Kandinsky 5's CLIP-L,
    HunyuanVideo 1.5's ByT5), loaded strictly onto the device: ((tokenizer, model), its identity)."""
    model_dir, tokenizer_dir = folders
    model, identity = _load_model(model_dir, config, spec, allow_pickle_weights)
    tokenizer = _load_tokenizer(tokenizer_dir, spec)
    check_vocabulary(tokenizer, model, tokenizer_dir, model_dir)
    model.to(device=device, dtype=compute).eval().requires_grad_(False)
    return (tokenizer, model), {**identity, "tokenizer_sha256": _tokenizer_hashes(tokenizer_dir)}


def _slow_clip(tokenizer: Any, folder: Path, spec: str) -> clip_slow.SlowClipTokenizer:
    try:
        return clip_slow.SlowClipTokenizer.like(tokenizer)
    except (ValueError, KeyError, TypeError) as exc:
        raise VaeSpecError(f"--text-encoder {spec}: {folder} is not CLIP's byte-level BPE tokenizer, which musubi's "
                           f"convention tokenizes as its slow CLIPTokenizer does ({first_line(exc)})") from None


def marker_crop(tokenizer: Any, family: TextFamily, spec: str) -> int:
    """musubi's get_qwen_tokens crop: the tokens of the template filled with "a photo of a cat", up to and including
    the first run of the marker's own tokens."""
    ids = tokenizer(family.template.format("a photo of a cat"))["input_ids"]
    marker = tokenizer(family.crop_marker, add_special_tokens=False)["input_ids"]
    for start in range(len(ids) - len(marker) + 1):
        if ids[start:start + len(marker)] == marker:
            return start + len(marker)
    raise VaeSpecError(f"--text-encoder {spec}: the tokenizer does not find {family.crop_marker!r} in the template "
                       "tokenized (musubi's crop)")


def text_encoder_folders(spec: str, length: int | None = None, layer: int | None = None,
                         convention: str = "pipeline", k5_template: str | None = None) -> TextFolders:
    """The folders a --text-encoder SPEC names, checked without loading a weight (encode checks them before the first
    video is read): the pipeline's model_index.json and family, the encoder's and tokenizer's folders. A UsageError
    or VaeSpecError (one line, naming the spec and the path) otherwise."""
    check_text_spec(spec)
    kind, _, rest = spec.partition(":")
    if kind == "diffusers":
        location, _, sub = rest.partition("#")
        root = _local_folder(location, spec)
        index = root / "model_index.json"
        if not index.is_file():
            raise VaeSpecError(f"--text-encoder {spec}: {root} has no model_index.json (a diffusers pipeline folder "
                               "names its pipeline there); use transformers:PATH for a bare encoder folder")
        contents = read_json_file(index, "the pipeline's model_index.json")
        class_name = contents.get("_class_name", "") if isinstance(contents, dict) else ""
        try:
            family = family_for_pipeline(str(class_name), f"--text-encoder {spec}", convention, k5_template)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if length is not None or layer is not None:
            raise UsageError(f"--text-length/--text-layer apply to transformers:PATH; {spec} is a {class_name}, "
                             f"whose length is {family.length}")
        model_dir, tokenizer_dir = root / (sub or "text_encoder"), root / "tokenizer"
        resolved = f"diffusers:{root.resolve()}" + (f"#{sub}" if sub else "")
    else:
        model_dir = _local_folder(rest, spec)
        if length is None:
            raise UsageError(f"--text-encoder {spec}: a transformers:PATH encoder needs --text-length N (the tokens "
                             "each prompt is padded or truncated to)")
        if convention != "pipeline" or k5_template is not None:
            raise UsageError(f"--{'text-convention' if convention != 'pipeline' else 'k5-template'} applies to a "
                             "pipeline folder (diffusers:PATH)")
        family = generic_family(length)
        tokenizer_dir = model_dir / "tokenizer" if (model_dir / "tokenizer").is_dir() else model_dir
        resolved = f"transformers:{model_dir.resolve()}"
    for folder, what in ((model_dir, "encoder"), (tokenizer_dir, "tokenizer")):
        if not folder.is_dir():
            raise VaeSpecError(f"--text-encoder {spec}: no {what} folder {folder}")
    pooled = glyph = None
    if family.pooled_length or family.glyph_length:
        second = (root / "text_encoder_2", root / "tokenizer_2")
        for folder in second:
            if not folder.is_dir():
                raise VaeSpecError(f"--text-encoder {spec}: no {folder.name} folder {folder} (a {class_name} folder "
                                   f"holds the {'CLIP-L' if family.pooled_length else 'ByT5'} encoder there)")
        pooled, glyph = (second, None) if family.pooled_length else (None, second)
    for folder in (model_dir,) + tuple(pair[0] for pair in (pooled, glyph) if pair):
        if not (folder / "config.json").is_file():
            raise VaeSpecError(f"--text-encoder {spec}: {folder} has no config.json (not a transformers model folder)")
    features = None
    if family.features == "ltx2":
        features = root / "connectors"
        if not (features / "config.json").is_file():
            raise VaeSpecError(f"--text-encoder {spec}: no {features / 'config.json'} (a {class_name} folder holds "
                               "LTX-2's text feature extractor in connectors/)")
    return TextFolders(family, model_dir, tokenizer_dir, resolved, pooled, features, glyph)


MEMORY_SHARE = 0.5
"""The largest share of the device's memory one batch's activations may be estimated to take (check_text_shape)."""


def check_text_encoder(spec: str | None) -> None:
    """encode --text-encoder: the spec's family and its folders, config and weights files present, checked at
    start-up before any video is probed (nothing to check where none is given)."""
    if spec:
        text_encoder_folders(spec)


def device_memory(device: torch.device | str = "cpu") -> tuple[int, str]:
    """(bytes, what they are) of the memory a batch computes in: a CUDA device's own, else the machine's."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory), f"the GPU's (cuda:{index})"
    return machine_memory(), "this machine's"


def check_text_shape(config: Any, family: TextFamily, batch: int, spec: str,
                     device: torch.device | str = "cpu") -> None:
    """--text-length and --text-batch within what the encoder can run: no more tokens than its position embeddings
    hold (where it has them: CLIP, Llama; T5's relative positions have no such limit), and one batch's activations
    (every layer's widest output and its attention scores, in fp32) within half the memory of the device it runs on
    (a GPU's own, else the machine's), so that a typo (--text-length 1000000000) is one line, not a native abort in
    the tokenizer or an out-of-memory kill."""
    tokens = family.length + family.crop_start
    config = text_config(config)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0 and tokens > positions:
        raise UsageError(f"--text-encoder {spec}: {tokens} tokens a prompt, but {type(config).__name__} holds "
                         f"{positions} positions (--text-length at most {positions - family.crop_start})")
    width = max(int(getattr(config, name, 0) or 0) for name in ("d_model", "hidden_size", "d_ff", "intermediate_size"))
    heads = int(getattr(config, "num_heads", 0) or getattr(config, "num_attention_heads", 0) or 1)
    stacked = int(getattr(config, "num_hidden_layers", 0) or 0) + 1 if family.features else 1  # LTX-2 stacks them all
    estimate = batch * (tokens * max(width, 1) * stacked + heads * tokens * tokens) * 4
    memory, whose = device_memory(device)
    if memory and estimate > memory * MEMORY_SHARE:
        raise UsageError(f"--text-encoder {spec}: a batch of {batch} prompts of {tokens} tokens needs about "
                         f"{estimate / 2**30:.1f} GiB for one layer's activations, more than half {whose} "
                         f"{memory / 2**30:.1f} GiB: lower --text-batch (or --text-length)")


def machine_memory() -> int:
    """Physical memory in bytes (0 where the platform does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 0


def text_config(config: Any) -> Any:
    """The language model's config of a multimodal one (Gemma 3's text_config), else the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def check_layer(config: Any, layer: int | None, spec: str) -> None:
    if layer is None:
        return
    layers = getattr(config, "num_layers", None) or getattr(config, "num_hidden_layers", None)
    if layers is not None and not -(layers + 1) <= layer <= layers:
        raise UsageError(f"--text-layer {layer}: {spec} has hidden states 0..{layers}")


def check_vocabulary(tokenizer: Any, model: torch.nn.Module, tokenizer_dir: Path, model_dir: Path) -> None:
    """Every id the tokenizer can give has a row in the encoder's embedding: a tokenizer of another model would
    otherwise fail with an IndexError on the first prompt that uses such a token (or, on CUDA, a device assert)."""
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    rows = getattr(embeddings, "num_embeddings", None)
    size = len(tokenizer)
    if isinstance(rows, int) and size > rows:
        raise VaeSpecError(f"{tokenizer_dir}: the tokenizer has {size} tokens, but the encoder in {model_dir} embeds "
                           f"{rows}: they are not one model's")


def _tokenizer_hashes(folder: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name in TOKENIZER_FILES}


def _local_folder(location: str, spec: str) -> Path:
    path = Path(location).expanduser()
    if path.is_dir():
        return path
    hint = (" (vaecache reads local files only; a Hub id is downloaded first, e.g. `hf download "
            f"{location} --local-dir DIR`, then --text-encoder with DIR)") if location.count("/") == 1 else ""
    raise VaeSpecError(f"--text-encoder {spec}: no such folder {path}{hint}")


def _read_config(folder: Path, spec: str) -> Any:
    from transformers import AutoConfig

    read_json_file(folder / "config.json", "the encoder's config")  # a damaged file: one line, before transformers
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001  # transformers raises many kinds for a config it cannot use
        raise VaeSpecError(f"--text-encoder {spec}: {folder / 'config.json'}: not a transformers config it can use "
                           f"({first_line(exc, 200)})") from None


def _load_model(folder: Path, config: Any, spec: str,
                allow_pickle_weights: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    class_name = ENCODER_ONLY.get(config.model_type, "AutoModel")
    cls = getattr(transformers, class_name)
    if not allow_pickle_weights and not any(folder.glob("*.safetensors")):
        raise VaeSpecError(f"--text-encoder {spec}: {folder} holds no .safetensors weights (pickled weights load "
                           "only with --allow-pickle-weights)")
    model = load_pretrained(cls, folder, allow_pickle_weights=allow_pickle_weights, config=config,
                            use_safetensors=None if allow_pickle_weights else True)
    settings = {k: v for k, v in model.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    identity = {"class": type(model).__name__, "config": json.loads(json.dumps(settings, sort_keys=True, default=str)),
                "weights_sha256": weights_sha256(model), "transformers": transformers.__version__}
    return model, identity


def _load_tokenizer(folder: Path, spec: str) -> Any:
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "spiece.model")):
        raise VaeSpecError(f"--text-encoder {spec}: no tokenizer files in {folder} (tokenizer.json, "
                           "tokenizer_config.json or spiece.model)")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001  # tokenizers raises its own kinds for a damaged file
        raise VaeSpecError(f"--text-encoder {spec}: cannot load the tokenizer in {folder} "
                           f"({first_line(exc, 200)})") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


__all__ = ["TextEmbedding", "TextEncoder", "TextFolders", "load_text_encoder", "text_encoder_folders"]
