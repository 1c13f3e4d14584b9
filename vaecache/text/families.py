"""Text-encoder families: which pipeline's prompt embedding each reproduces, and how it is stored. Pure data and
text cleaning; no torch.

Wan (diffusers `pipelines/wan/pipeline_wan.py`, 0.42): `WanPipeline._get_t5_prompt_embeds` cleans each prompt with
`prompt_clean` (ftfy's `fix_text` where ftfy is installed, `html.unescape` twice, strip, runs of whitespace to one
space), tokenizes to `max_sequence_length` with padding and truncation, runs the UMT5 encoder with the attention
mask, and keeps each prompt's first `mask.sum()` rows followed by zero rows; `__call__` passes 512 (its
`encode_prompt` default is 226). The I2V, V2V and VACE pipelines share that function. vaecache stores the unpadded
rows (the zero rows are zeros by construction) and pads again on read.

LTX-Video (`pipelines/ltx/pipeline_ltx.py`, `LTXPipeline._get_t5_prompt_embeds`, shared by the image-to-video
pipeline) and CogVideoX (`pipelines/cogvideo/pipeline_cogvideox.py`, `CogVideoXPipeline._get_t5_prompt_embeds`,
copied into its I2V, V2V and Fun pipelines) tokenize the prompt as given (no cleaning) to 128 and 226 tokens with
padding and truncation and run T5 on the ids alone, without the attention mask: every row, the padding's too,
depends on the padding, so the full length is stored (LTX also returns the mask; vaecache stores the token count
and rebuilds it).

A generic spec (`transformers:PATH`) serves any transformers encoder with its tokenizer at a given length and
hidden layer, with the attention mask, rows trimmed to the mask (world models that condition on scene
descriptions: MagicDriveDiT's T5).
"""

from __future__ import annotations

import dataclasses
import html
import re
from dataclasses import dataclass

WAN_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline", "WanVACEPipeline")
LTX_PIPELINES = ("LTXPipeline", "LTXImageToVideoPipeline")
COGVIDEOX_PIPELINES = ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline",
                       "CogVideoXFunControlPipeline")
HUNYUAN_PIPELINES = ("HunyuanVideoPipeline",)
LTX2_PIPELINES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline")
HUNYUAN15_PIPELINES = ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")
KANDINSKY5_PIPELINES = ("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline")
NOT_YET = {
    "LTXConditionPipeline": "ltx-video (its own prompt embedding)",
    "HunyuanVideoImageToVideoPipeline": "hunyuanvideo image-to-video (a LLaVA template with the image)",
}
"""Pipelines whose prompt embedding is not reproduced yet (named in the refusal)."""


@dataclass(frozen=True)
class TextFamily:
    name: str
    length: int
    """Tokens the encoder runs at (the pipeline's padded length)."""
    cleaning: str
    """"wan": diffusers' prompt_clean; "strip": leading and trailing whitespace only; "none": as given."""
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
    glyph_order: str = "diffusers"
    """How the quoted texts are gathered: "diffusers" (extract_glyph_texts: in order, deduplicated where several) or
    "musubi" (straight-quoted ones, then curly-quoted ones, none dropped; nothing for an empty prompt)."""
    alone: bool = False
    """Each prompt runs by itself, unpadded (Kandinsky 5: its encoder sees no attention mask, so a batch's padding
    would change a prompt's rows; the issue's "as one prompt alone gives it"), its text cut as the pipeline cuts it
    (`_encode_prompt_qwen`: the decoded tokens past the length removed from the text's end)."""
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

    def clean(self, text: str) -> str:
        return CLEANINGS[self.cleaning](text)


def wan_prompt_clean(text: str) -> str:
    """diffusers' pipeline_wan.prompt_clean, with ftfy required (diffusers skips it where ftfy is missing)."""
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def as_given(text: str) -> str:
    return text


CLEANINGS = {"wan": wan_prompt_clean, "strip": str.strip, "none": as_given}

WAN = TextFamily("wan", 512, "wan", "diffusers WanPipeline._get_t5_prompt_embeds, max_sequence_length=512")
LTX = TextFamily("ltx-video", 128, "none", "diffusers LTXPipeline._get_t5_prompt_embeds, max_sequence_length=128",
                 masked=False, full_length=True)
COGVIDEOX = TextFamily("cogvideox", 226, "none", "diffusers CogVideoXPipeline._get_t5_prompt_embeds, "
                       "max_sequence_length=226", masked=False, full_length=True)


HUNYUAN_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)
"""diffusers' pipeline_hunyuan_video.DEFAULT_PROMPT_TEMPLATE (0.42.1: lines 70-81, crop_start 95), the template
musubi-tuner calls "dit-llm-encode-video" (hunyuan_model/text_encoder.py)."""
HUNYUAN = TextFamily("hunyuanvideo", 256, "none", "diffusers HunyuanVideoPipeline._get_llama_prompt_embeds "
                     "(DEFAULT_PROMPT_TEMPLATE, crop_start 95, hidden_states[-3], max_sequence_length=256) and "
                     "_get_clip_prompt_embeds (CLIP-L pooler_output, 77 tokens)", masked=True, full_length=True,
                     template=HUNYUAN_TEMPLATE, crop_start=95, layer=-3, pooled_length=77)
HUNYUAN_MUSUBI = dataclasses.replace(
    HUNYUAN, name="hunyuanvideo-musubi", pooled_tokenization="slow-clip",
    reference="musubi-tuner 30c658c HunyuanVideo and FramePack text caching (hunyuan_model/text_encoder.py, "
              "frame_pack/hunyuan.py encode_prompt_conds): the Llama rows as diffusers' HunyuanVideoPipeline computes "
              "them, CLIP-L's pooled output of the prompt tokenized by transformers 4.57's slow CLIPTokenizer "
              "(ftfy.fix_text first)")
"""musubi-tuner's HunyuanVideo and FramePack text conditioning (`--text-convention musubi`): diffusers' but for CLIP's
tokenization, which musubi's pinned transformers does with the slow class (vaecache.text.clip_slow)."""


LTX2 = TextFamily("ltx2", 1024, "strip", "LTX-2's trainer (Lightricks/LTX-2 400fd31, ltx-trainer "
                   "scripts/process_captions.py): ltx-core's LTXGemmaTokenizer (strip, <bos> first, left padding to "
                   "1024), every Gemma hidden state, the checkpoint's feature extractor (V1 or V2) before the "
                   "connectors; diffusers LTX2Pipeline._get_gemma_prompt_embeds then LTX2TextConnectors' "
                   "normalization and text_proj_in", masked=True, full_length=True, padding="left", features="ltx2")
"""LTX-2 (diffusers' LTX2Pipeline folder: text_encoder/ a Gemma 3, tokenizer/, connectors/ the feature extractor's
weights); vaecache.text.ltx2 holds its arithmetic."""


HUNYUAN15_SYSTEM = ("You are a helpful assistant. Describe the video by detailing the following aspects: \
        1. The main content and theme of the video. \
        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \
        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \
        4. background environment, light, style and atmosphere. \
        5. camera angles, movements, and transitions used in the video.")
"""diffusers' HunyuanVideo15Pipeline.system_message (0.42.1, `pipeline_hunyuan_video1_5.py`: its `__init__`), the
eight spaces of each continued line included, as the pipeline's backslash continuations write them."""
HUNYUAN15 = TextFamily("hunyuanvideo-1.5", 1000, "none", "diffusers HunyuanVideo15Pipeline.encode_prompt: "
                       "_get_mllm_prompt_embeds (the system message and the prompt through the tokenizer's chat "
                       "template, 1000 + 108 tokens, hidden_states[-3], the first 108 rows cropped) and "
                       "_get_byt5_prompt_embeds (the quoted glyph text, extract_glyph_texts, through ByT5 at 256 "
                       "tokens)", masked=True, crop_start=108, layer=-3, chat_system=HUNYUAN15_SYSTEM,
                       glyph_length=256)
"""HunyuanVideo 1.5: Qwen2.5-VL's rows trimmed to the mask (the transformer zeroes the padded ones before they are
used: `transformer_hunyuan_video15.py`, its text reordering) and ByT5's rows of the glyph text trimmed to its mask
(none where the prompt quotes no text: the pipeline's zero rows and zero mask)."""


MUSUBI_HUNYUAN15_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant. Describe the video by detailing the following aspects: \n"
    "1. The main content and theme of the video. \n"
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \n"
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \n"
    "4. background environment, light, style and atmosphere. \n"
    "5. camera angles, movements, and transitions used in the video.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n")
"""musubi-tuner's PROMPT_TEMPLATE_VIDEO (hunyuan_video_1_5/hunyuan_video_1_5_text_encoder.py, commit 30c658c)."""
HUNYUAN15_MUSUBI = TextFamily("hunyuanvideo-1.5-musubi", 1024, "none", "musubi-tuner "
                              "hv_1_5_cache_text_encoder_outputs.py encode_and_save_batch (30c658c): "
                              "hunyuan_video_1_5_text_encoder.get_qwen_prompt_embeds "
                              "(PROMPT_TEMPLATE_VIDEO, cropped after <|im_start|>user\n, 1024 tokens, "
                              "hidden_states[-3]) and get_glyph_prompt_embeds (ByT5 at 128 tokens)", masked=True,
                              template=MUSUBI_HUNYUAN15_TEMPLATE, layer=-3, glyph_length=128, glyph_order="musubi",
                              crop_marker="<|im_start|>user\n")
"""musubi-tuner's HunyuanVideo 1.5 text conditioning, what its hv15 text caches hold (`--text-convention musubi`):
not diffusers' (another system-message layout, a crop found from the template, ByT5 at 128 tokens, another glyph
order)."""


def musubi_glyph_texts(prompt: str) -> str | None:
    """musubi's get_byt5_text_tokens' glyph text: the straight-quoted texts, then the curly-quoted ones, each as
    `Text "x". `; None for an empty prompt or one that quotes nothing."""
    if not prompt:
        return None
    texts = re.findall(r"\"(.*?)\"", prompt) + re.findall(r"“(.*?)”", prompt)
    return "".join(f'Text "{text}". ' for text in texts) if texts else None


KANDINSKY5_TEMPLATE = "\n".join([
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
KANDINSKY5 = TextFamily("kandinsky5", 512, "wan", "diffusers Kandinsky5T2VPipeline.encode_prompt: prompt_clean, "
                        "_encode_prompt_qwen (prompt_template, its text truncation at 512 tokens, no attention mask, "
                        "hidden_states[-1], the first 128 rows cropped; one prompt alone) and _encode_prompt_clip "
                        "(CLIP pooler_output at 77 tokens)", masked=False, template=KANDINSKY5_TEMPLATE, crop_start=128,
                        layer=-1, pooled_length=77, alone=True, pooled_masked=True)
"""Kandinsky 5 (T2V, I2V): Qwen2.5-VL's rows of the prompt alone (every row is the prompt's: no padding), its length
the pipeline's cu_seqlens, and CLIP-L's pooled output."""
MUSUBI_KANDINSKY5_TEMPLATE = "\n".join([
    "<|im_start|>system\nYou are a promt engineer. Describe the video in detail.",
    *KANDINSKY5_TEMPLATE.split("\n")[2:]])
"""musubi-tuner's Qwen2_5_VLTextEmbedder.PROMPT_TEMPLATE["template"]["video"] (kandinsky5/models/text_embedders.py,
commit 30c658c: the Kandinsky 5 authors' own, "promt" as they spell it)."""
KANDINSKY5_MUSUBI = TextFamily("kandinsky5-musubi", 512, "none", "musubi-tuner kandinsky5_cache_text_encoder_outputs"
                               ".py encode_and_save_batch (30c658c): Qwen2_5_VLTextEmbedder (its video template, "
                               "crop 129, padded to 512 + 129 without an attention mask, hidden_states[-1], rows "
                               "trimmed to the mask) and ClipTextEmbedder (pooler_output at 77 tokens)", masked=False,
                               template=MUSUBI_KANDINSKY5_TEMPLATE, crop_start=129, layer=-1, pooled_length=77,
                               pooled_masked=True, pooled_tokenization="slow-clip")
"""musubi-tuner's Kandinsky 5 text conditioning (`--text-convention musubi`), what its k5 text caches hold: the
authors' template and crop, the prompt as given, CLIP tokenized by musubi's pinned transformers (the slow class)."""
MUSUBI_KANDINSKY5_IMAGE_TEMPLATE = "\n".join([
    "<|im_start|>system\nYou are a promt engineer. Describe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>",
    "<|im_start|>user\n{}<|im_end|>"])
"""musubi-tuner's Qwen2_5_VLTextEmbedder.PROMPT_TEMPLATE["template"]["image"] (kandinsky5/models/text_embedders.py,
commit 30c658c), crop 41: what `kandinsky5_cache_text_encoder_outputs.py` embeds a batch with when no item in it has a
frame count above 1 (:44-45), which is every batch its caching builds (`image_video_dataset.py:231`)."""
KANDINSKY5_MUSUBI_IMAGE = dataclasses.replace(
    KANDINSKY5_MUSUBI, template=MUSUBI_KANDINSKY5_IMAGE_TEMPLATE, crop_start=41,
    reference="musubi-tuner kandinsky5_cache_text_encoder_outputs.py encode_and_save_batch (30c658c) as its caching "
              "runs it: Qwen2_5_VLTextEmbedder with its image template (crop 41, padded to 512 + 41 without an "
              "attention mask, hidden_states[-1], rows trimmed to the mask) and ClipTextEmbedder (pooler_output at 77 "
              "tokens)")
K5_TEMPLATES = ("video", "image")
"""--k5-template: the Kandinsky 5 template musubi's convention embeds with (video: its sampling's; image: its caching
script's, see KANDINSKY5_MUSUBI_IMAGE)."""


def extract_glyph_texts(prompt: str) -> str | None:
    """diffusers' pipeline_hunyuan_video1_5.extract_glyph_texts: the texts quoted with "…" or “…”, deduplicated in
    order where there are several, formatted `Text "x". Text "y". `; None where there are none."""
    matches = re.findall(r"\"(.*?)\"|“(.*?)”", prompt)
    result = [match[0] or match[1] for match in matches]
    result = list(dict.fromkeys(result)) if len(result) > 1 else result
    return ". ".join(f'Text "{text}"' for text in result) + ". " if result else None


TEXT_CONVENTIONS = ("pipeline", "musubi")
"""--text-convention: the pipeline's own embedding (diffusers'), or musubi-tuner's where its trainer embeds otherwise
(HunyuanVideo's and FramePack's CLIP tokenization, HunyuanVideo 1.5, Kandinsky 5)."""
MUSUBI_FAMILIES = {"hunyuanvideo": HUNYUAN_MUSUBI, "hunyuanvideo-1.5": HUNYUAN15_MUSUBI,
                   "kandinsky5": KANDINSKY5_MUSUBI}


def family_for_pipeline(class_name: str, where: str, convention: str = "pipeline",
                        k5_template: str | None = None) -> TextFamily:
    """The family of a diffusers pipeline folder's model_index.json `_class_name` in a --text-convention (and, for
    Kandinsky 5 in musubi's, a --k5-template); a ValueError naming what is supported otherwise."""
    family = _pipeline_family(class_name, where)
    if k5_template is not None and k5_template not in K5_TEMPLATES:
        raise ValueError(f"--k5-template must be one of {', '.join(K5_TEMPLATES)}, got {k5_template!r}")
    if k5_template is not None and (family.name != "kandinsky5" or convention != "musubi"):
        raise ValueError(f"{where}: --k5-template applies to a Kandinsky 5 pipeline with --text-convention musubi "
                         "(diffusers' Kandinsky5T2VPipeline embeds with its video template)")
    if convention == "pipeline":
        return family
    if convention != "musubi":
        raise ValueError(f"--text-convention must be one of {', '.join(TEXT_CONVENTIONS)}, got {convention!r}")
    if family.name not in MUSUBI_FAMILIES:
        raise ValueError(f"{where}: --text-convention musubi applies to HunyuanVideo (and FramePack), HunyuanVideo 1.5 "
                         "and Kandinsky 5 (musubi-tuner embeds the other architectures' prompts as the pipelines do), "
                         f"not {class_name}")
    if family.name == "kandinsky5" and k5_template == "image":
        return KANDINSKY5_MUSUBI_IMAGE
    return MUSUBI_FAMILIES[family.name]


def family_named(name: str) -> str:
    """The --text-convention a recorded family name was embedded in."""
    return "musubi" if name.endswith("-musubi") else "pipeline"


def _pipeline_family(class_name: str, where: str) -> TextFamily:
    for names, family in ((WAN_PIPELINES, WAN), (LTX_PIPELINES, LTX), (COGVIDEOX_PIPELINES, COGVIDEOX),
                          (HUNYUAN_PIPELINES, HUNYUAN), (LTX2_PIPELINES, LTX2), (HUNYUAN15_PIPELINES, HUNYUAN15),
                          (KANDINSKY5_PIPELINES, KANDINSKY5)):
        if class_name in names:
            return family
    every = WAN_PIPELINES + LTX_PIPELINES + COGVIDEOX_PIPELINES + HUNYUAN_PIPELINES + LTX2_PIPELINES + \
        HUNYUAN15_PIPELINES + KANDINSKY5_PIPELINES
    supported = (f"supported: {', '.join(every)}; "
                 "any other encoder as transformers:PATH with --text-length")
    if class_name in NOT_YET:
        raise ValueError(f"{where}: {class_name} ({NOT_YET[class_name]}) text embeddings are not reproduced yet "
                         f"({supported})")
    raise ValueError(f"{where}: no text-encoder family for pipeline {class_name!r} ({supported})")


def installed_version(name: str) -> str | None:
    """The installed version of package `name`, or None (ftfy's is recorded with a Wan set: its cleaning is ftfy's)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


TEXT_PACKAGES = ("transformers", "tokenizers", "ftfy")


def check_text_spec(spec: str) -> str:
    """A --text-encoder SPEC's form, and the packages it needs, checked before anything runs (an encode with
    --text-encoder must not find out after hours of video that it cannot embed): a UsageError otherwise."""
    from importlib.util import find_spec

    from vaecache.errors import UsageError

    if not isinstance(spec, str) or spec.partition(":")[0] not in ("diffusers", "transformers") or not \
            spec.partition(":")[2]:
        raise UsageError(f"--text-encoder must be diffusers:PATH[#SUBFOLDER] or transformers:PATH, got {spec!r}")
    missing = [name for name in TEXT_PACKAGES if find_spec(name) is None]
    if missing:
        raise UsageError(f"--text-encoder needs {', '.join(missing)}: pip install 'vaecache[text]'")
    return spec


def generic_family(length: int, cleaning: str = "strip") -> TextFamily:
    return TextFamily("generic", length, cleaning, "the encoder's last_hidden_state (or hidden_states[layer]) with "
                      "the attention mask, rows trimmed to the mask")
