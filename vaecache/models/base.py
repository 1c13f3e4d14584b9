"""What a model family declares: the model people train (HunyuanVideo, FramePack, Kandinsky 5, ...), not a VAE class.
One diffusers class can serve several families, each encoding with it as its own trainers do. Pure data and small
functions: importable without torch (the CLI reads a family before torch loads)."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from vaecache.errors import VaeSpecError
from vaecache.models.rules import FrameRule

FP16_POLICIES = ("ok", "upcast", "refuse")


def log2(value: Any, what: str) -> int:
    """log2 of a config's power-of-two compression ratio, or a VaeSpecError naming the key."""
    number = int(value)
    if number < 1 or number & (number - 1):
        raise VaeSpecError(f"{what} must be a power of two, got {value!r}")
    return number.bit_length() - 1


def config_constants(config: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The keys of `config` that are set (not None), for a normalization record."""
    return {key: config[key] for key in keys if config.get(key) is not None}


def scale_normalization(config: Mapping[str, Any], module: Any) -> dict[str, Any]:
    """The normalization of a VAE whose config holds its constants (scaling_factor, shift_factor, latents_mean/std):
    diffusers' pipelines apply whichever the config sets."""
    out = config_constants(config, ("scaling_factor", "shift_factor", "latents_mean", "latents_std"))
    if config.get("invert_scale_latents"):
        out["invert_scale_latents"] = True  # CogVideoX 1.5 I2V: image latents are divided by scaling_factor
    if "shift_factor" in out:
        out["formula"] = "(z - shift_factor) * scaling_factor"
    elif "latents_mean" in out and "latents_std" in out:
        out["formula"] = "(z - latents_mean) * scaling_factor / latents_std"
    else:
        out["formula"] = "z * scaling_factor"
    return out


@dataclass(frozen=True)
class FastEncoder:
    """A faster encoder vaecache runs over a VAE class's own weights (`--encoder-impl fast`), owned by its family."""

    describes: str
    """The models it encodes, in words ("Wan 2.1, Wan 2.2"), for messages."""
    implementation: Callable[[], ModuleType]
    """Imports its module (torch and triton) on first use: `production_encoder(module, device)`,
    `production_description(module, device)`, `triton_available()`."""
    validated: frozenset[tuple[str, str, tuple[int, int], int]] = frozenset()
    """Where `--encoder-impl auto` picks it: (device kind, compute dtype, CUDA capability, the encoder's first
    width), each measured faster than diffusers' encode and bitwise reproducible across processes."""


CONFIGS = Path(__file__).resolve().parent / "configs"
"""The published configs of the VAEs read from single files, as diffusers builds them (shipped in the package)."""


def no_shipped_config(shapes: Mapping[str, Any]) -> str | None:
    return None


@dataclass(frozen=True)
class SingleFileLayout:
    """A family's VAE as one checkpoint file in its original code's layout: how vaecache tells it from its keys, which
    published config builds it, and how its tensors become the diffusers class's (diffusers keeps these facts in one
    table, `loaders/single_file_model.py` SINGLE_FILE_LOADABLE_CLASSES). vaecache.vae.single_file reads it."""

    name: str
    """What the file is, in words ("Wan 2.2's VAE"), for messages."""
    detects: Callable[[frozenset[str], Sequence[str], Mapping[str, Any]], bool]
    """(its keys without a "vae." or "first_stage_model." prefix, its keys, its shapes by key) -> laid out so."""
    vae_class: str | None = None
    """The diffusers class it loads into; None: recognized, and refused with `refusal`."""
    refusal: str = ""
    config_name: Callable[[Mapping[str, Any]], str | None] = no_shipped_config
    """(shapes) -> the file under CONFIGS of the release with these shapes, or None (then --vae-config)."""
    no_config: str = ""
    """Why no shipped config fits, where config_name finds none."""
    converter: Callable[[], Callable[..., dict[str, Any]]] | None = None
    """Imports the conversion `(config=, checkpoint=) -> state dict`; None: diffusers' own for the class
    (SINGLE_FILE_LOADABLE_CLASSES[class]["checkpoint_mapping_fn"])."""
    vae_keys: Callable[[list[str]], list[str]] | None = None
    """The keys of the file's VAE part, by its converter's rule (a whole-model file holds others); None: every key."""
    leftovers: tuple[str, ...] = ()
    """Key prefixes (after the vae. prefix) of tensors its model does not use, dropped on purpose."""
    siblings: tuple[str, ...] = ()
    """Other classes a --vae-config may name for a file laid out so (the same keys at a size no release has)."""

    def __post_init__(self) -> None:
        if (self.vae_class is None) == (not self.refusal):
            raise ValueError(f"SingleFileLayout {self.name}: either a VAE class it loads into or why it is refused")


@dataclass(frozen=True)
class ConditionPipeline:
    """An image-to-video pipeline whose condition latents vaecache rebuilds from a cache's posterior means
    (`vaecache embed --condition`, vaecache.conditions), for the VAE class of the family declaring it."""

    name: str
    """Recorded in a condition set's fingerprint (`pipeline`), `--condition-pipeline NAME` where `asked`."""
    reference: str
    """The pipeline code it reproduces, recorded beside the set."""
    kinds: tuple[str, ...]
    """The latent kinds it has (first-frame, first-last)."""
    asked: bool = False
    """Only when named with --condition-pipeline (or the cache was encoded for its family): another pipeline shares
    the VAE class."""
    arithmetic: Callable[[], Any] | None = None
    """Imports its tensor arithmetic (torch), an object with `condition_video(frames, kind, clip)` (what is encoded
    of each view's frames), `condition(mean, kind, num_frames, temporal_factor, normalization)` (the condition the
    pipeline builds from the stored posterior mean; normalization: the VAE's recorded constants) and
    `masks(mean, kind, num_frames, temporal_factor)` (the tensors it returns apart, by key)."""
    needs: str = "latents_std"
    """The normalization constant its arithmetic reads, which a cache's VAE record must hold: "latents_std"
    (latents_mean too) or "scaling_factor"."""
    selects: Callable[[Mapping[str, Any]], bool] | None = None
    """(the VAE's config) -> whether a cache of this config conditions for it rather than for its class's other
    pipeline (Wan 2.2 TI2V: a Wan VAE with patch_size); None: the class's pipeline otherwise."""
    unnamed_record: bool = False
    """Its sets record no pipeline name (they were made before it was recorded): a record without one is its."""
    first_frame_alone: bool = False
    """It encodes the first frame by itself: its sets store (cameras, C, 1, h, w), whatever the clip's length."""

    def __post_init__(self) -> None:
        if not self.name or not self.kinds:
            raise ValueError(f"ConditionPipeline needs a name and its kinds, got {self.name!r}, {self.kinds!r}")
        if self.arithmetic is None:
            raise ValueError(f"ConditionPipeline {self.name}: its arithmetic is missing")
        if self.needs not in ("latents_std", "scaling_factor"):
            raise ValueError(f"ConditionPipeline {self.name}: needs latents_std or scaling_factor, got {self.needs!r}")


@dataclass(frozen=True)
class VaeClass:
    """What vaecache knows of one diffusers VAE class, declared once by the family module that is its default."""

    name: str
    """diffusers' class name, as a config.json's `_class_name` gives it."""
    rule: Callable[[Mapping[str, Any]], FrameRule]
    """The frame and pixel rule read from a config, as the class's encoder reads it."""
    channels_key: str
    """The config key holding its latent channels."""
    normalization: Callable[[Mapping[str, Any], Any], dict[str, Any]]
    """(config, module or None) -> the constants and formula its pipelines normalize latents by (recorded)."""
    per_frame: bool = False
    """A 2D image VAE applied to every frame (one frame per forward)."""
    fp16: str = "ok"
    """"ok"; "upcast": compute in fp32 when config.force_upcast is set; "refuse"."""
    fp16_reason: str = ""
    one_view_per_forward: str = ""
    """Why the class encodes one view per forward whatever --views-per-forward asks (empty: it batches views)."""
    spatial_bands: bool = False
    """Whether `--sp-mode spatial` (vaecache.parallel.spatial: rows in bands with halo exchange) runs its encoder."""
    causal_chunk_decode: bool = False
    """Whether its decoder is causal in time, fed one latent frame per call through a feature cache
    (vaecache.vae.latent_decode decodes long clips a chunk at a time that way)."""
    fast_encoder: FastEncoder | None = None
    not_decoded_here: str = ""
    """Why `vaecache report` shows its clips' sources without a reconstruction (a decoder that is not a plain
    `decode(z)` in bounded time: a diffusion decoder); empty: the report decodes it within its time budget."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"VaeClass name must be a diffusers class name, got {self.name!r}")
        if self.fp16 not in FP16_POLICIES:
            raise ValueError(f"VaeClass {self.name}: fp16 must be one of {FP16_POLICIES}, got {self.fp16!r}")
        if self.fp16 != "ok" and not self.fp16_reason:
            raise ValueError(f"VaeClass {self.name}: fp16 {self.fp16!r} needs its reason")


@dataclass(frozen=True)
class ReferenceEncode:
    """How a family's trainers encode a clip with its VAE, which is what vaecache stores.

    `encode(module, x)` returns what the module's own encode would (a posterior, or the moments tensor its
    DiagonalGaussianDistribution is built from); None means the module's own `encode` with its tiling off is the
    reference (diffusers' encode tiles nothing there). The record (name and params) goes into the VAE fingerprint,
    so a cache says which encode made it and a resume never mixes two."""

    name: str
    """"untiled", or the tiling a family's trainers apply ("kandinsky5-tiles"); recorded."""
    description: str
    """In words, for messages and docs."""
    source: str
    """Where it was read: the authors' and the trainers' code, file and line."""
    encode: Callable[[Any, Any], Any] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    """What decides its bits beyond the weights (tile sizes and strides), recorded beside the name."""
    time_tiles_above: int | None = None
    """Clips longer than this many frames are tiled in time by it (None: never)."""
    spatial_bands: bool = True
    """Whether spatial SP (rows in bands with halo exchange) can reproduce it: not for an encode that tiles space."""

    def record(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.params)}


def wan_prompt_clean(text: str) -> str:
    """diffusers' pipeline_wan.prompt_clean, with ftfy required (diffusers skips it where ftfy is missing)."""
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def as_given(text: str) -> str:
    return text


CLEANINGS = {"wan": wan_prompt_clean, "strip": str.strip, "none": as_given}
"""A prompt's cleaning by its recorded name: "wan" diffusers' prompt_clean (Wan, Kandinsky 5), "strip" leading and
trailing whitespace only, "none" as given."""


@dataclass(frozen=True)
class TextFamily:
    """How one pipeline (in one convention) embeds a prompt, recorded in a text set's fingerprint."""

    name: str
    length: int
    """Tokens the encoder runs at (the pipeline's padded length)."""
    cleaning: str
    """A key of CLEANINGS."""
    reference: str
    masked: bool = True
    """The attention mask goes into the encoder (else the ids alone)."""
    full_length: bool = False
    """Every row of the padded length is stored (the padding rows depend on the padding); else the prompt's rows."""
    template: str | None = None
    """The prompt goes into this template ({} marks it) before tokenizing (HunyuanVideo's LLM)."""
    crop_start: int = 0
    """Tokens the encoder runs at `crop_start + length`, and the first `crop_start` rows (the template's) are
    dropped."""
    layer: int | None = None
    """The hidden state stored (an index into hidden_states), else the last hidden state."""
    pooled_length: int = 0
    """A second encoder's pooled output is stored too (HunyuanVideo's CLIP-L), at this many tokens; 0: none."""
    padding: str = "right"
    """Where the padding tokens go ("left": LTX-2's Gemma; the mask marks the last `tokens` rows)."""
    features: str = ""
    """"ltx2": the stored rows are LTX-2's feature extractor output of every hidden state (vaecache.text.ltx2), not
    one hidden state."""
    chat_system: str | None = None
    """The prompt goes into the tokenizer's chat template after this system message (HunyuanVideo 1.5's Qwen2.5-VL:
    `apply_chat_template` with the generation prompt) before tokenizing; `crop_start` rows are then dropped."""
    glyph_length: int = 0
    """A second encoder's rows of the prompt's quoted glyph text are stored too (HunyuanVideo 1.5's ByT5), at this many
    tokens; 0: none."""
    glyph_texts: Callable[[str], str | None] | None = None
    """(prompt) -> the glyph text the second encoder embeds, or None where the prompt quotes none."""
    glyph_order: str = "diffusers"
    """How glyph_texts gathers the quoted texts, recorded: "diffusers" or "musubi"."""
    one_prompt: Callable[[], Callable[[Any, str], tuple[Any, int, bool]]] | None = None
    """Imports the family's embedding of one prompt by itself, unpadded, where its encoder would see a batch's
    padding (Kandinsky 5): `(text encoder, prompt) -> (rows in the compute dtype, tokens, truncated)`; None: batches
    of the engine's fixed shape."""
    pooled_masked: bool = False
    """The pooled encoder gets the attention mask too (Kandinsky 5's `text_encoder_2(**inputs)`)."""
    crop_marker: str | None = None
    """The template's rows are cropped up to and including these tokens, found in the template tokenized (musubi's
    HunyuanVideo 1.5 `<|im_start|>user\n`); `crop_start` is then that count, set when the tokenizer is loaded."""
    pooled_tokenization: str = "tokenizer"
    """How the pooled encoder's prompt is tokenized: "tokenizer" (the folder's tokenizer as transformers loads it) or
    "slow-clip" (vaecache.text.clip_slow: the slow CLIPTokenizer of musubi-tuner's pinned transformers 4.57)."""

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"text family {self.name}: length must be >= 1, got {self.length}")
        if self.cleaning not in CLEANINGS:
            raise ValueError(f"text family {self.name}: unknown cleaning {self.cleaning!r}")
        if self.padding not in ("left", "right"):
            raise ValueError(f"text family {self.name}: padding must be left or right, got {self.padding!r}")
        if bool(self.glyph_length) != (self.glyph_texts is not None):
            raise ValueError(f"text family {self.name}: a glyph length needs its glyph_texts, and only it")
        if self.one_prompt is not None and self.template is None:
            raise ValueError(f"text family {self.name}: one_prompt embeds a template filled with the prompt")

    @property
    def alone(self) -> bool:
        """Each prompt runs by itself, unpadded (`one_prompt`)."""
        return self.one_prompt is not None

    def clean(self, text: str) -> str:
        return CLEANINGS[self.cleaning](text)


@dataclass(frozen=True)
class TextEncoders:
    """The prompt embeddings a family's pipelines make (`--text-encoder diffusers:PATH` of one of its pipelines)."""

    pipelines: tuple[str, ...]
    """The diffusers pipelines (model_index.json `_class_name`) whose embedding `pipeline` is."""
    pipeline: TextFamily
    """The pipelines' own embedding (`--text-convention pipeline`)."""
    musubi: TextFamily | None = None
    """musubi-tuner's, where its trainer embeds otherwise (`--text-convention musubi`); None: as the pipeline."""
    musubi_label: str = ""
    """The model, in the message that lists where musubi's convention applies."""
    musubi_templates: Mapping[str, TextFamily] = field(default_factory=dict)
    """musubi's embedding by --k5-template (its video template is `musubi`'s)."""
    not_yet: Mapping[str, str] = field(default_factory=dict)
    """The family's pipelines whose embedding is not reproduced yet, and what it is (named in the refusal)."""

    def __post_init__(self) -> None:
        if not self.pipelines:
            raise ValueError(f"TextEncoders {self.pipeline.name}: no pipelines")
        if (self.musubi is None) != (not self.musubi_label):
            raise ValueError(f"TextEncoders {self.pipeline.name}: musubi's embedding and its label go together")
        if self.musubi_templates and self.musubi is None:
            raise ValueError(f"TextEncoders {self.pipeline.name}: musubi templates without musubi's embedding")


@dataclass(frozen=True)
class AudioVaeClass:
    """An audio VAE whose latents a family's model trains on (`vaecache embed --audio-vae`), declared by that family;
    vaecache.audio reads it."""

    name: str
    """diffusers' class name, as a config.json's `_class_name` gives it."""
    mel: Callable[[Mapping[str, Any], int], dict[str, Any]]
    """(its config, the STFT size) -> the log-mel its trainer feeds it, as vaecache.audio.mel.MelSpec's fields."""
    normalization: Callable[[], Any]
    """Imports its latents' normalization (torch): `normalize(mean, latents_mean, latents_std)` and `denormalize`."""
    normalization_over: str
    """What the normalization runs over, recorded in an audio set's normalization (`over`)."""
    checkpoint_prefix: str = ""
    """The key prefix of its tensors in its family's checkpoint file (`--audio-vae PATH.safetensors`); empty: read
    from a diffusers folder only."""
    checkpoint: str = ""
    """What such a checkpoint file is, in words, for messages."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"AudioVaeClass name must be a diffusers class name, got {self.name!r}")
        if bool(self.checkpoint_prefix) != bool(self.checkpoint):
            raise ValueError(f"AudioVaeClass {self.name}: a checkpoint prefix and its file's description go together")


@dataclass(frozen=True)
class Family:
    """A model people train, as far as its VAE latents go: which class encodes them and how its trainers call it."""

    name: str
    """`--model NAME`, recorded in the manifest (`vae.model`)."""
    label: str
    """The model's name in messages ("Kandinsky 5")."""
    vae_classes: tuple[str, ...]
    """The diffusers VAE classes whose latents it trains on."""
    reference: ReferenceEncode
    default_for: tuple[str, ...] = ()
    """The classes for which it is the family when --model is not given (one family per class)."""
    legacy_references: tuple[ReferenceEncode, ...] = ()
    """Encodes caches made before the reference was recorded used, kept to read them back (decode, --reencode)."""
    frame_rule: Callable[[FrameRule], FrameRule] | None = None
    """The family's own frame rule from its VAE class's, where its reference encode accepts fewer frame counts."""
    vaes: tuple[VaeClass, ...] = ()
    """The VAE classes this family declares (the family whose module owns their facts: their default)."""
    single_files: tuple[SingleFileLayout, ...] = ()
    """The checkpoint-file layouts of its VAE that vaecache reads (or recognizes and refuses, saying why)."""
    conditions: tuple[ConditionPipeline, ...] = ()
    """The image-to-video pipelines whose conditions vaecache rebuilds for its VAE class."""
    musubi_arch: str | None = None
    """musubi-tuner's architecture (its short name, `export --format musubi --arch`) a cache for it exports as by
    default; None: musubi-tuner does not train it."""
    text: TextEncoders | None = None
    """Its pipelines' prompt embeddings that vaecache reproduces (vaecache.text); None: none."""
    audio_vaes: tuple[AudioVaeClass, ...] = ()
    """The audio VAEs whose latents its model trains on beside the video's (vaecache.audio)."""

    def __post_init__(self) -> None:
        if not self.name or not self.vae_classes:
            raise ValueError(f"Family needs a name and at least one VAE class, got {self.name!r}")
        stray = [vae.name for vae in self.vaes if vae.name not in self.vae_classes]
        stray += [name for name in self.default_for if name not in self.vae_classes]
        if stray:
            raise ValueError(f"Family {self.name}: {', '.join(stray)} not among its vae_classes")

    def rule(self, vae_rule: FrameRule) -> FrameRule:
        return self.frame_rule(vae_rule) if self.frame_rule is not None else vae_rule

    def reference_recorded(self, record: Mapping[str, Any] | None) -> ReferenceEncode | None:
        """The encode a cache recorded (None: one this family does not know)."""
        if record is None:
            return self.reference
        for reference in (self.reference, *self.legacy_references):
            if reference.record() == dict(record):
                return reference
        return None


__all__ = ["CLEANINGS", "CONFIGS", "FP16_POLICIES", "AudioVaeClass", "ConditionPipeline", "Family", "FastEncoder",
           "ReferenceEncode", "SingleFileLayout", "TextEncoders", "TextFamily", "VaeClass", "as_given",
           "config_constants", "log2", "no_shipped_config", "scale_normalization", "wan_prompt_clean"]
