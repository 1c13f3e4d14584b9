"""Image-to-video conditions, as the pipelines build them: pure tensor arithmetic, no I/O.

The reference is diffusers' `WanImageToVideoPipeline.prepare_latents` (diffusers/pipelines/wan/pipeline_wan_i2v.py,
0.42: lines 396-484; Wan 2.1 I2V, Wan 2.2 I2V A14B and FLF2V share it):
- `video_condition`: the first frame followed by num_frames - 1 zero frames (`first-frame`), or the first frame,
  num_frames - 2 zero frames and the last frame (`first-last`, its `last_image` branch), in [-1, 1];
- `latent_condition`: the VAE's posterior mean of that video (`retrieve_latents(..., sample_mode="argmax")`), cast
  to float32 and normalized `(z - latents_mean) * (1.0 / latents_std)` with both as float32 tensors;
- the frame mask: 1 on the conditioned frames (the first repeated to the VAE's temporal factor, as the causal VAE's
  first latent frame stands for one frame), folded into `temporal_factor` channels of the latent frame count;
- the condition the transformer sees: `cat([mask, latent_condition], dim=1)`.

HunyuanVideo 1.5's is diffusers' `HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask`
(pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py, 0.42: `_get_image_latents` and lines 594-632):
the first frame encoded alone (one frame: `image_tensor.unsqueeze(2)`, `retrieve_latents(..., "argmax")`), times the
VAE's scaling_factor, at latent frame 0 of the clip's latent frames and zeros after (`latent_condition`), and a
one-channel mask, 1 on latent frame 0 (`latent_mask`); the transformer takes `cat([latents, latent_condition,
latent_mask], dim=1)`, so the condition is `cat([latent_condition, latent_mask], dim=1)`. first-frame only (the
pipeline takes no last image).

Wan 2.2 TI2V's (a Wan VAE with `patch_size`, the TI2V-5B one) is the same function's `expand_timesteps` branch
(lines 428-470): `video_condition` is the image alone (one frame), `latent_condition` its posterior mean normalized
as above, and the mask `first_frame_mask` is 1 everywhere but 0 on latent frame 0 (inverted from Wan 2.1's): the
pipeline writes the condition over the first latent frame, `(1 - mask) * condition + mask * latents`. `LatentCache`
gives `condition/<kind>` the normalized one-frame latent and `condition_mask/<kind>` that mask. first-frame only (the
branch takes no last image).

Kandinsky 5's (a HunyuanVideo VAE cache, asked with `--condition-pipeline kandinsky5`: the VAE is HunyuanVideo's too,
whose own I2V condition is another) is `Kandinsky5I2VPipeline.prepare_latents`'s image latent
(pipelines/kandinsky5/pipeline_kandinsky_i2v.py, 0.42: lines 695-703): the first frame encoded alone times the VAE's
scaling_factor, which the pipeline writes over the first latent frame. The pipeline draws a posterior sample; a cache
stores the mean, and `LatentCache` gives the mean times scaling_factor, (cameras, C, 1, h, w) float32, channels first
(the pipeline's latents are channels last).

A cache stores the posterior mean (the only input that depends on weights and frames); the mask and the
normalization are rebuilt from the recorded frame count, temporal factor and constants, bit for bit.
"""

from __future__ import annotations

import torch

from vaecache.errors import DatasetError, UsageError
from vaecache.models import registry

CONDITION_KINDS = ("first-frame", "first-last", "image-features")
LATENT_KINDS = ("first-frame", "first-last")
"""The kinds encoded with the cache's VAE; image-features come from an image encoder (vaecache.conditions.images)."""
WAN, WAN_TI2V, HUNYUAN15, KANDINSKY5 = "wan", "wan-ti2v", "hunyuanvideo-1.5", "kandinsky5"
"""The pipelines by the name their family declares (vaecache.models: ConditionPipeline) and records: the arithmetic
below is each one's."""


def declared_pipelines() -> tuple[dict[str, tuple[str, str, tuple[str, ...]]],
                                  dict[str, tuple[str, str, tuple[str, ...]]]]:
    """(VAE class -> (its own pipeline, reference, kinds), --condition-pipeline NAME -> (the VAE class it conditions
    with, reference, kinds)), as the model families declare them."""
    own: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    asked: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for family in registry().families.values():
        for pipeline in family.conditions:
            vae_class = family.vae_classes[0]
            if pipeline.asked:
                asked[pipeline.name] = (vae_class, pipeline.reference, pipeline.kinds)
            else:
                own[vae_class] = (pipeline.name, pipeline.reference, pipeline.kinds)
    return own, asked


PIPELINES, ASKED_PIPELINES = declared_pipelines()
"""VAE class -> (the image-to-video pipeline whose condition vaecache reproduces, its reference, the kinds it has);
--condition-pipeline NAME -> (the VAE class it conditions with, its reference, its kinds): pipelines a cache's VAE
does not tell, because another pipeline shares the VAE."""
REFERENCE = next(reference for name, reference, _ in PIPELINES.values() if name == WAN)
"""Wan's, which its condition sets record (vaecache.conditions.sets)."""
CONDITION_PIPELINES = ("auto", *ASKED_PIPELINES)
WAN_TI2V_REFERENCE = ("diffusers WanImageToVideoPipeline.prepare_latents with expand_timesteps "
                      "(pipelines/wan/pipeline_wan_i2v.py, Wan 2.2 TI2V)")
SUPPORTED_FAMILIES = (*PIPELINES, *(family for family, _, _ in ASKED_PIPELINES.values()))


def parse_condition_kinds(text: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--condition KIND[,KIND]` -> the kinds in the documented order; unknown kinds refused, naming the known."""
    if not text:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    kinds = {part.strip() for part in parts if part.strip()}
    unknown = sorted(kinds - set(CONDITION_KINDS))
    if unknown:
        raise UsageError(f"--condition: unknown kind {', '.join(unknown)}; the kinds are {', '.join(CONDITION_KINDS)}")
    return tuple(kind for kind in CONDITION_KINDS if kind in kinds)


def condition_pipeline(vae: dict, asked: str | None = "auto") -> str:
    """The image-to-video pipeline a cache's VAE record conditions for: the one `asked` (--condition-pipeline), else
    the VAE family's own ("wan" for any family without one: the refusal is check_condition_vae's; a Wan VAE with
    patch_size is Wan 2.2 TI2V's)."""
    asked = _model_pipeline(vae, asked)
    if asked not in (None, "auto"):
        return str(asked)
    pipeline = PIPELINES.get(str(vae.get("family")), (WAN,))[0]
    return WAN_TI2V if pipeline == WAN and (vae.get("config") or {}).get("patch_size") else pipeline


def _model_pipeline(vae: dict, asked: str | None) -> str | None:
    """--condition-pipeline auto on a cache encoded for a model whose pipeline is one of those asked by name (a
    Kandinsky 5 cache, `encode --model kandinsky5`): that pipeline."""
    model = vae.get("model")
    return model if asked in (None, "auto") and model in ASKED_PIPELINES else asked


def pipeline_reference(vae: dict, asked: str | None = "auto") -> tuple[str, tuple[str, ...]]:
    """(the reference, the latent kinds) of the pipeline a cache's VAE record conditions for."""
    pipeline = condition_pipeline(vae, asked)
    asked = _model_pipeline(vae, asked)
    if pipeline == WAN_TI2V:
        return WAN_TI2V_REFERENCE, ("first-frame",)
    if pipeline in ASKED_PIPELINES:
        return ASKED_PIPELINES[pipeline][1:]
    _, reference, kinds = PIPELINES[str(vae.get("family"))]
    return reference, kinds


def check_condition_vae(vae: dict, where: str, kinds: tuple[str, ...] = LATENT_KINDS,
                        asked: str | None = "auto") -> None:
    """Refuse a cache whose VAE has no image-to-video pipeline vaecache follows for `kinds` (or not the one `asked`
    with --condition-pipeline), naming the supported ones."""
    family = vae.get("family")
    asked = _model_pipeline(vae, asked)
    if asked not in (None, *CONDITION_PIPELINES):
        raise UsageError(f"--condition-pipeline must be one of {', '.join(CONDITION_PIPELINES)}, got {asked!r}")
    if asked in ASKED_PIPELINES and family != ASKED_PIPELINES[asked][0]:
        raise UsageError(f"{where}: --condition-pipeline {asked} conditions with a {ASKED_PIPELINES[asked][0]} "
                         f"cache; its VAE is {family or 'unrecorded'}")
    if family not in SUPPORTED_FAMILIES:
        references = " and ".join(reference for _, reference, _ in PIPELINES.values())
        raise UsageError(f"{where}: its VAE is {family or 'unrecorded'}; image-to-video conditions follow "
                         f"{references}, for the VAE families {', '.join(SUPPORTED_FAMILIES)}")
    if family not in PIPELINES and asked in (None, "auto"):
        choices = [name for name, (owner, _, _) in ASKED_PIPELINES.items() if owner == family]
        raise UsageError(f"{where}: its VAE is {family}, which more than one image-to-video pipeline uses: name the "
                         f"one with --condition-pipeline ({', '.join(choices)}; HunyuanVideo's own I2V condition is "
                         "not reproduced)")
    pipeline = condition_pipeline(vae, asked)
    reference, known = pipeline_reference(vae, asked)
    unknown = [kind for kind in kinds if kind in LATENT_KINDS and kind not in known]
    if unknown:
        raise UsageError(f"{where}: its VAE is {family}, whose image-to-video pipeline ({reference}) has no "
                         f"{', '.join(unknown)} condition; its kinds: {', '.join(known)}")
    if pipeline in (HUNYUAN15, KANDINSKY5):
        if not (vae.get("normalization") or {}).get("scaling_factor"):
            raise UsageError(f"{where}: records no scaling_factor for its VAE (the pipeline scales the image latent)")
        return
    if not (vae.get("normalization") or {}).get("latents_std"):
        raise UsageError(f"{where}: records no latents_mean/latents_std for its VAE (needed to normalize the "
                         "condition as the pipeline does)")


def condition_video(frames: torch.Tensor, kind: str, clip: str = "", pipeline: str = WAN) -> torch.Tensor:
    """(views, 3, T, H, W) frames as encode saw them -> what the pipeline encodes for each view: Wan's
    `video_condition`; HunyuanVideo 1.5's first frame alone."""
    views, channels, count, height, width = frames.shape
    first = frames[:, :, :1]
    if pipeline in (HUNYUAN15, WAN_TI2V, KANDINSKY5):
        if kind != "first-frame":
            raise UsageError(f"the {pipeline} image-to-video pipeline has no {kind} condition")
        return first
    if kind == "first-frame":
        return torch.cat([first, first.new_zeros(views, channels, count - 1, height, width)], dim=2)
    if kind == "first-last":
        if count < 2:
            raise DatasetError(f"clip {clip}: first-last needs at least 2 frames, it has {count}")
        return torch.cat([first, first.new_zeros(views, channels, count - 2, height, width), frames[:, :, -1:]],
                         dim=2)
    raise UsageError(f"unknown condition kind {kind!r}; the kinds are {', '.join(CONDITION_KINDS)}")


def condition_mask(kind: str, num_frames: int, temporal_factor: int, height: int, width: int) -> torch.Tensor:
    """The pipeline's frame mask for one view: (temporal_factor, latent frames, height, width) float32."""
    if kind not in LATENT_KINDS:
        raise UsageError(f"no frame mask for condition kind {kind!r}; the kinds with one are {', '.join(LATENT_KINDS)}")
    if (num_frames - 1) % temporal_factor:
        raise DatasetError(f"{num_frames} frames: the image-to-video mask needs 1 + {temporal_factor}k frames")
    mask = torch.ones(1, 1, num_frames, height, width)
    if kind == "first-frame":
        mask[:, :, list(range(1, num_frames))] = 0
    else:
        mask[:, :, list(range(1, num_frames - 1))] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal_factor)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    mask = mask.view(1, -1, temporal_factor, height, width).transpose(1, 2)
    return mask[0]


def ti2v_mask(num_frames: int, temporal_factor: int, height: int, width: int) -> torch.Tensor:
    """Wan 2.2 TI2V's `first_frame_mask` for one view: (1, latent frames, height, width) float32, 0 on latent frame 0
    and 1 elsewhere."""
    mask = torch.ones(1, (num_frames - 1) // temporal_factor + 1, height, width)
    mask[:, 0] = 0
    return mask


def pipeline_masks(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                   pipeline: str) -> dict[str, torch.Tensor]:
    """What the pipeline returns beside the condition, where it returns the mask apart (Wan 2.2 TI2V):
    `condition_mask/<kind>`, (views, 1, latent frames, h, w); else nothing (the mask is inside the condition)."""
    if pipeline != WAN_TI2V or kind not in LATENT_KINDS:
        return {}
    views, _, _, height, width = mean.shape
    mask = ti2v_mask(num_frames, temporal_factor, height, width).to(mean.device)
    return {f"condition_mask/{kind}": mask.unsqueeze(0).expand(views, -1, -1, -1, -1).contiguous()}


def normalized_condition(mean: torch.Tensor, latents_mean: list[float], latents_std: list[float]) -> torch.Tensor:
    """(views, C, F, H, W) stored posterior mean -> the pipeline's normalized `latent_condition`, float32."""
    channels = mean.shape[1]
    shift = torch.tensor(latents_mean).view(1, channels, 1, 1, 1).to(mean.device, torch.float32)
    reciprocal = 1.0 / torch.tensor(latents_std).view(1, channels, 1, 1, 1).to(mean.device, torch.float32)
    return (mean.to(torch.float32) - shift) * reciprocal


def hunyuan15_condition(mean: torch.Tensor, num_frames: int, temporal_factor: int,
                        scaling_factor: float) -> torch.Tensor:
    """(views, C, 1, h, w) stored posterior mean of the first frame -> `cat([latent_condition, latent_mask], dim=1)`,
    (views, C + 1, latent frames, h, w) float32: the image latent times scaling_factor (in the stored dtype, as the
    pipeline scales it in the VAE's) at latent frame 0 and zeros after, the mask 1 on latent frame 0."""
    views, channels, _, height, width = mean.shape
    frames = (num_frames - 1) // temporal_factor + 1
    condition = torch.zeros(views, channels, frames, height, width, dtype=torch.float32, device=mean.device)
    condition[:, :, :1] = (mean[:, :, :1] * scaling_factor).to(torch.float32)
    mask = torch.zeros(views, 1, frames, height, width, dtype=torch.float32, device=mean.device)
    mask[:, :, 0] = 1.0
    return torch.concat([condition, mask], dim=1)


def pipeline_condition(mean: torch.Tensor, kind: str, num_frames: int, temporal_factor: int,
                       latents_mean: list[float], latents_std: list[float], pipeline: str = WAN,
                       scaling_factor: float = 1.0) -> torch.Tensor:
    """(views, C, F, H, W) stored posterior mean -> Wan's `cat([mask, latent_condition], dim=1)`: (views,
    temporal_factor + C, F, H, W) float32, the tensor prepare_latents returns for each view; HunyuanVideo 1.5's
    `cat([latent_condition, latent_mask], dim=1)` (hunyuan15_condition). image-features are stored as the pipeline
    uses them and returned unchanged."""
    if kind not in LATENT_KINDS:
        return mean
    if pipeline == HUNYUAN15:
        return hunyuan15_condition(mean, num_frames, temporal_factor, scaling_factor)
    if pipeline == WAN_TI2V:
        return normalized_condition(mean, latents_mean, latents_std)
    if pipeline == KANDINSKY5:  # image_latents * scaling_factor, in the VAE's dtype, then the latents' (float32)
        return (mean * scaling_factor).to(torch.float32)
    latent = normalized_condition(mean, latents_mean, latents_std)
    views, _, _, height, width = latent.shape
    mask = condition_mask(kind, num_frames, temporal_factor, height, width).to(latent.device)
    return torch.concat([mask.unsqueeze(0).expand(views, -1, -1, -1, -1), latent], dim=1)


__all__ = ["ASKED_PIPELINES", "CONDITION_KINDS", "CONDITION_PIPELINES", "HUNYUAN15", "KANDINSKY5", "LATENT_KINDS",
           "PIPELINES", "REFERENCE", "SUPPORTED_FAMILIES", "WAN", "WAN_TI2V", "check_condition_vae", "condition_mask",
           "condition_pipeline", "condition_video", "hunyuan15_condition", "normalized_condition",
           "parse_condition_kinds", "pipeline_condition", "pipeline_masks", "pipeline_reference", "ti2v_mask"]
