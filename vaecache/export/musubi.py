"""musubi-tuner's latent cache, each architecture in the exact convention of its own caching script.

musubi-tuner (github.com/kohya-ss/musubi-tuner, read at commit 30c658c) trains on latent files written by
its `*_cache_latents.py` scripts, and what those files hold differs per architecture: some store the VAE's
latent normalized or scaled, and the trainer then uses them as they are. An export that loads but holds
another scale trains silently wrong, so each architecture here computes the latent as musubi's own caching
would have stored it for vaecache's posterior mean, with musubi's arithmetic (order of operations,
reciprocal, dtype), and refuses a cache of another VAE family, channel count or normalization.

File and key naming follow `dataset/cache_io.py` and `dataset/image_video_dataset.py` (see docs/exports.md,
"Export to musubi-tuner").
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from vaecache.errors import ExportError
from vaecache.export.common import (
    EXPORT_INDEX,
    ExportIndex,
    ExportSummary,
    finish,
    safe_name,
    safetensors_bytes,
    source_of,
    staging,
    write_new_file,
)
from vaecache.export.musubi_text import MUSUBI_FORMAT_VERSION, musubi_text_set, write_text_cache
from vaecache.models import FAMILIES, encode_problem, families_of_class, recorded_family

if TYPE_CHECKING:
    import torch


WAN_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                   3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
"""The Wan 2.1 VAE's per-channel statistics musubi-tuner hard-codes (wan/modules/vae.py:663-698, WanVAE.__init__);
its Wan caching normalizes with these whatever the weights, so a cache recording others is refused."""
HUNYUAN15_SCALING_FACTOR = 1.03682
"""HunyuanVideo 1.5's VAE scaling factor, musubi-tuner's hunyuan_video_1_5/hunyuan_video_1_5_vae.py:835
(VAE_SCALING_FACTOR), which its hv15 trainer multiplies the cached latents by (hv_1_5_train_network.py:369-371)."""
HUNYUAN_SCALING_FACTOR = 0.476986
"""HunyuanVideo's scaling factor, musubi-tuner's hunyuan_model/vae.py:21 (SCALING_FACTOR) and the default of
kandinsky5/models/vae.py's AutoencoderKLHunyuanVideo config."""
MUSUBI_RESOLUTION_STEP = 16
"""musubi-tuner's BucketSelector steps (every architecture): with bucket_no_upscale a size is floored to it."""


def _wan_latents(mean: torch.Tensor, normalization: dict[str, Any]) -> dict[str, torch.Tensor]:
    # wan/modules/vae.py:663-701: self.mean = torch.tensor(mean, dtype=dtype), self.std likewise,
    # self.scale = [self.mean, 1.0 / self.std]: the reciprocal is taken in the VAE's dtype.
    # wan/modules/vae.py:563-564 (WanVAE_.encode): mu = (mu - scale[0].view(1, z_dim, 1, 1, 1)) * scale[1].view(...)
    # wan/modules/vae.py:756 (WanVAE.encode): .float(); wan_cache_latents.py:45-46: stacked, .to(vae.dtype).
    import torch

    dtype = mean.dtype
    channels = mean.shape[0]
    shift = torch.tensor(normalization["latents_mean"], dtype=dtype)
    reciprocal = 1.0 / torch.tensor(normalization["latents_std"], dtype=dtype)
    mu = mean.unsqueeze(0)
    latent = (mu - shift.view(1, channels, 1, 1, 1)) * reciprocal.view(1, channels, 1, 1, 1)
    return {"latents": latent.float().squeeze(0).to(dtype)}


def _raw_latents(mean: torch.Tensor, normalization: dict[str, Any]) -> dict[str, torch.Tensor]:
    # cache_latents.py:265 (encode_and_save_batch): latent = vae.encode(contents).latent_dist.sample(), unscaled;
    # hv_train_network.py:399-401 (scale_shift_latents) multiplies by SCALING_FACTOR at training time.
    return {"latents": mean}


def _scaled_latents(mean: torch.Tensor, normalization: dict[str, Any]) -> dict[str, torch.Tensor]:
    """FramePack's `hunyuan.vae_encode`: the latent times the VAE's scaling_factor, in the stored dtype."""
    return {"latents": mean * float(normalization["scaling_factor"])}


def _kandinsky5_latents(mean: torch.Tensor, normalization: dict[str, Any]) -> dict[str, torch.Tensor]:
    # kandinsky5_cache_latents.py:60: scaling_factor = getattr(vae.config, "scaling_factor", 1.0) (a Python float);
    # :70: latents = latents * scaling_factor, in the VAE's dtype; kandinsky5_train_network.py:717-719
    # (scale_shift_latents) returns them unchanged. :76-80: the first and last latent frames are cached as the
    # image latent (cache_io.py:197-229, save_latent_cache_kandinsky5: "latents_image_{F}x{H}x{W}").
    import torch

    latent = mean * float(normalization["scaling_factor"])
    first = latent[:, :1, :, :]
    last = latent[:, -1:, :, :] if latent.shape[1] > 1 else first
    return {"latents": latent, "latents_image": torch.cat([first, last], dim=1).clone()}


@dataclass(frozen=True)
class MusubiArch:
    """One musubi-tuner architecture: what its caching stores, from which VAE, or why vaecache cannot export it."""

    short: str
    """Its short name (file names, `--arch`; dataset/architectures.py)."""
    full: str
    """Its full name (the `architecture` metadata of each file)."""
    channels: int | None = None
    convention: str = ""
    """What the exported latent is, in words (export.json `convention`)."""
    latents: Callable[[torch.Tensor, dict[str, Any]], dict[str, torch.Tensor]] | None = None
    """(posterior mean (C, F, H, W), recorded normalization) -> tensors by key stem, as musubi would cache them."""
    samples: bool = False
    """musubi's caching stores a posterior sample; the export stores the mean (recorded in export.json)."""
    refused: str = ""
    """Why this architecture cannot be exported completely (then nothing is written)."""
    models: tuple[str, ...] = ()
    """The model families (vaecache.models) whose encode its trainers make: a cache encoded for another is refused."""
    scaling_factor: float | None = None
    """The VAE scaling factor its training assumes (a VAE recording another is refused); None: not checked here."""

    @property
    def family(self) -> str | None:
        """The diffusers VAE class whose latents it trains on: its first model family's."""
        return FAMILIES[self.models[0]].vae_classes[0] if self.models else None


MUSUBI_ARCHITECTURES: dict[str, MusubiArch] = {arch.short: arch for arch in (
    MusubiArch("wan", "wan", 16, latents=_wan_latents, models=("wan",),
               convention="(mean - latents_mean) * (1 / latents_std) per channel in the stored dtype, as "
                          "musubi-tuner's WanVAE caches it (wan/modules/vae.py); its Wan trainer does not rescale"),
    MusubiArch("hv", "hunyuan_video", 16, latents=_raw_latents, samples=True, models=("hunyuanvideo", "framepack"),
               scaling_factor=HUNYUAN_SCALING_FACTOR,
               convention="the raw latent (export.json `tensor` says mean or sample): musubi-tuner's HunyuanVideo "
                          "caching stores the unscaled latent (cache_latents.py) and its trainer multiplies by the "
                          "scaling factor (hv_train_network.py)"),
    MusubiArch("k5", "kandinsky5", 16, latents=_kandinsky5_latents, samples=True, models=("kandinsky5",),
               scaling_factor=HUNYUAN_SCALING_FACTOR,
               convention="latent * scaling_factor (the mean, or the sample export.json `tensor` names), plus the "
                          "first and last latent frames as latents_image, as kandinsky5_cache_latents.py caches them; "
                          "its trainer does not rescale"),
    MusubiArch("fp", "framepack", 16, latents=_scaled_latents, samples=True, models=("framepack", "hunyuanvideo"),
               scaling_factor=HUNYUAN_SCALING_FACTOR,
               convention="FramePack's sections (vaecache.export.framepack): latent * scaling_factor cut into "
                          "--fp-latent-window-size sections as fpack_cache_latents.py cuts them (--fp-mode inverted "
                          "or f1), each with its clean latents and indices and the first frame's SigLIP "
                          "image_embeddings; its trainer does not rescale"),
    MusubiArch("hv15", "hunyuan_video_1_5", 32, latents=_raw_latents, models=("hunyuanvideo-1.5",),
               scaling_factor=HUNYUAN15_SCALING_FACTOR,
               convention="the raw posterior mean in the stored dtype: musubi-tuner's HunyuanVideo 1.5 caching stores "
                          "vae.encode(...)[0].mode() unscaled (hv_1_5_cache_latents.py:41-44) and its trainer "
                          "multiplies by VAE_SCALING_FACTOR (hv_1_5_train_network.py:369-371); with a first-frame set "
                          "its I2V latents_image (the first frame's raw latent at latent frame 0, zeros after, and a "
                          "mask channel, float32) and with hunyuanvideo15-musubi image features its siglip_float16, "
                          "as hv_1_5_cache_latents.py caches them"),
    MusubiArch("qi", "qwen_image", refused="Qwen-Image is an image architecture: musubi-tuner reads its latents as an "
               "image dataset (one frame per item), not a video dataset"),
)}
"""musubi-tuner's architectures by short name (dataset/architectures.py); the exportable ones name their VAE."""


def musubi_arch(vae: dict[str, Any], channels: int, arch: str | None, where: Path | str) -> MusubiArch:
    """The musubi architecture to export a cache with this manifest `vae` record and latent channel count as, or
    an ExportError saying why it cannot be: an unknown or refused architecture, another VAE family, channel count
    or normalization."""
    family = str(vae.get("family"))
    model, _ = recorded_family(vae)
    short = arch or (model.musubi_arch if model is not None else None)
    if short is None:
        trained = sorted(name for name, known in FAMILIES.items() if known.musubi_arch)
        raise ExportError(f"{where}: a {model.label if model is not None else family} cache has no musubi-tuner "
                          f"architecture (musubi trains on {', '.join(trained)} latents)")
    spec = MUSUBI_ARCHITECTURES.get(short)
    if spec is None:
        raise ExportError(f"--arch {short!r} is not a musubi-tuner architecture this export knows "
                          f"({', '.join(MUSUBI_ARCHITECTURES)})")
    if spec.refused:
        raise ExportError(f"--arch {short} ({spec.full}) cannot be exported: {spec.refused}")
    if family != spec.family:
        raise ExportError(f"{where}: --arch {short} trains on {spec.family} latents, this cache holds {family} latents")
    if channels != spec.channels:
        raise ExportError(f"{where}: --arch {short} needs {spec.channels}-channel latents, this {family} cache has "
                          f"{channels}")
    if model is not None and model.name not in spec.models:
        wanted = FAMILIES[spec.models[0]]
        raise ExportError(f"{where}: --arch {short} trains on latents encoded as {wanted.label}'s trainers encode them "
                          f"({wanted.reference.description}); this cache was encoded for {model.label} "
                          f"({model.reference.description}): encode it with --model {wanted.name}")
    normalization = vae.get("normalization") or {}
    if short == "wan" and (tuple(normalization.get("latents_mean") or ()) != WAN_LATENTS_MEAN
                           or tuple(normalization.get("latents_std") or ()) != WAN_LATENTS_STD):
        raise ExportError(f"{where}: the VAE records latents_mean/latents_std other than the Wan 2.1 statistics "
                          "musubi-tuner normalizes Wan latents with (wan/modules/vae.py); it is not the VAE musubi's "
                          "Wan models were trained on")
    if spec.scaling_factor is not None and normalization.get("scaling_factor") != spec.scaling_factor:
        owner = families_of_class(family)[0].label  # the model whose VAE it is
        raise ExportError(f"{where}: the VAE records scaling_factor {normalization.get('scaling_factor')}, not "
                          f"{owner}'s {spec.scaling_factor} that musubi-tuner's {spec.full} training assumes")
    return spec


def refuse_other_encodes(cache: Any, trainer: str, where: Path | str) -> None:
    """An ExportError naming the clips whose latents `trainer` would not have made (vaecache.models.encode_problem:
    the VAE's own tiling, or an older vaecache's time tiles), before anything is written."""
    vae, settings = cache.manifest.get("vae") or {}, cache.manifest.get("settings") or {}
    found = [(record["id"], why) for record in cache.records() if (why := encode_problem(vae, settings, record))]
    if found:
        clip, why = found[0]
        raise ExportError(f"{where}: {len(found)} of {len(cache)} clips are not latents {trainer} makes (clip {clip}: "
                          f"{why}); encode the cache again (vaecache encode ... --overwrite, on a device where every "
                          "clip fits untiled)")


def musubi_tensors(spec: MusubiArch, latent: torch.Tensor, normalization: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One camera's latent file content: musubi's key (`latents_{F}x{H}x{W}_{dtype}` for latents, dtype as torch
    names it: cache_io.py save_latent_cache_*) -> tensor, from the posterior mean (C, F, H, W)."""
    assert spec.latents is not None
    tensors = {}
    for stem, tensor in spec.latents(latent, normalization).items():
        _, frames, height, width = tensor.shape
        tensors[f"{stem}_{frames}x{height}x{width}_{str(tensor.dtype).removeprefix('torch.')}"] = tensor.contiguous()
    return tensors


def musubi_image_latent(spec: MusubiArch, condition: torch.Tensor, num_frames: int, temporal_factor: int,
                        normalization: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """One camera's `latents_image` as musubi-tuner's Wan I2V caching stores it (wan_cache_latents.py:48-79,
    encode_and_save_batch with i2v): the frame mask in the VAE's dtype, then the condition video's latent normalized
    by musubi's WanVAE (as the latents are: _wan_latents), concatenated on channels: (4 + C, F, H, W). HunyuanVideo
    1.5's (hv_1_5_cache_latents.py:48-76): the first frame's raw one-frame latent at latent frame 0 of a float32 zero
    tensor of the clip's latent frames, then a float32 mask channel, 1 on latent frame 0: (C + 1, F, H, W)."""
    import torch

    from vaecache.models._wan_conditions import condition_mask

    if spec.short == "hv15":
        channels, _, height, width = condition.shape
        frames = (num_frames - 1) // temporal_factor + 1
        latent = torch.zeros(channels, frames, height, width, dtype=torch.float32)
        latent[:, 0:1] = condition[:, :1]
        mask = torch.zeros(1, frames, height, width)
        mask[:, 0:1] = 1.0
        return torch.concat([latent, mask], dim=0).contiguous()

    latent = spec.latents(condition.to(dtype), normalization)["latents"]  # type: ignore[misc]
    _, _, height, width = latent.shape
    mask = condition_mask("first-frame", num_frames, temporal_factor, height, width).to(dtype)
    return torch.concat([mask, latent], dim=0).contiguous()


def musubi_condition_set(cache: Any, spec: MusubiArch, condition: str, where: Path | str) -> Any:
    """The ConditionSet whose first-frame latents the export writes as musubi's `latents_image`, or None ("none",
    or "auto" without a first-frame set or for an architecture whose caching reads none: left out, as everything
    musubi does not read is); an ExportError where musubi has no convention for what is asked."""
    kinds = [kind for kind in cache.condition_sets if kind != "image-features"]
    if condition == "none" or (condition == "auto" and ("first-frame" not in kinds
                                                        or spec.short not in FIRST_FRAME_ARCHS)):
        return None
    kind = "first-frame" if condition == "auto" else condition
    if kind == "first-last":
        raise ExportError(f"{where}: musubi-tuner caches no first-last (FLF2V) condition (its Wan I2V caching stores "
                          "the first frame's only, as latents_image): pass --condition first-frame or none")
    if kind != "first-frame":
        raise ExportError(f"--condition must be auto, none, first-frame or first-last, got {condition!r}")
    if kind not in kinds:
        raise ExportError(f"{where}: no condition set {kind!r} (sets: {', '.join(kinds) or 'none'}): vaecache embed "
                          f"{where} --condition {kind} adds it")
    if spec.short not in FIRST_FRAME_ARCHS:
        raise ExportError(f"{where}: musubi-tuner's {spec.full} caching stores no first-frame latents_image vaecache "
                          "writes (its Wan and HunyuanVideo 1.5 I2V ones are); pass --condition none")
    return cache.sets()["conditions"][kind]  # the kind's reader, as LatentCache's items read it


FIRST_FRAME_ARCHS = ("wan", "hv15")
"""The architectures whose I2V `latents_image` is a first-frame condition set's latent (Kandinsky 5's is cut from the
video latents: `_kandinsky5_latents`)."""


def musubi_image_features(cache: Any, spec: MusubiArch, condition: str, where: Path | str) -> tuple[Any, str]:
    """The image-features ConditionSet written as musubi's Wan I2V `clip_<dtype>` or HunyuanVideo 1.5 I2V
    `siglip_<dtype>` (or None), and a note for the summary: features are written under "auto" only, and only in
    musubi's own convention (in another they are another computation than musubi's, so they are left out, saying
    how to add them)."""
    ours = {"wan": ("wan-musubi", "CLIP", "clip", "Wan 2.1"), "hv15": ("hunyuanvideo15-musubi", "SigLIP", "siglip",
                                                                       "HunyuanVideo 1.5")}
    if condition != "auto" or "image-features" not in cache.condition_sets or spec.short not in ours:
        return None, ""
    wanted, encoder, key, model = ours[spec.short]
    features = cache.sets()["conditions"]["image-features"]
    convention = ((features.entry.get("fingerprint") or {}).get("image_encoder") or {}).get("convention")
    if convention != wanted:
        return None, (f"the cache's image-features ({convention} convention) are not written: musubi-tuner reads "
                      f"{encoder} features as its own caching makes them (vaecache embed OUT --condition "
                      f"image-features --image-convention {wanted} --replace adds those)")
    if "first-frame" not in cache.condition_sets:
        return features, (f"{encoder} features ({key}_<dtype>) written without latents_image: musubi-tuner's {model} "
                          "I2V training needs both (vaecache embed OUT --condition first-frame adds them)")
    return features, ""


FRAMEPACK_CONVENTIONS = ("hunyuanvideo15-musubi", "framepack-diffusers")
"""Image-features conventions FramePack's image_embeddings are taken from: musubi's own computation (the SigLIP
processor on the 8-bit first frame, fp16: hf_clip_vision_encode), or diffusers' FramePack pipeline's (float frame, fp32:
within rounding of musubi's)."""


def framepack_inputs(cache: Any, window: int, mode: str, where: Path | str) -> Any:
    """The image-features set FramePack's image_embeddings come from, every clip's frame count checked against the
    sections (an ExportError naming the first clip that cannot be cut, and the counts that can)."""
    from vaecache.export.framepack import FP_MODES, aligned_frames, framepack_sections_of

    if mode not in FP_MODES:
        raise ExportError(f"--fp-mode must be one of {', '.join(FP_MODES)} (musubi's --one_frame reads control images "
                          f"from its own dataset configuration: not exported), got {mode!r}")
    if window < 1:
        raise ExportError(f"--fp-latent-window-size must be >= 1, got {window}")
    for record in cache.records():
        count = len(record["frames"])
        sections = framepack_sections_of(count, window)
        if sections < 1 or aligned_frames(sections, window) != count:
            near = aligned_frames(max(sections, 1), window)
            raise ExportError(f"{where}: clip {record['id']} has {count} frames; FramePack with window {window} cuts "
                              f"clips of {window * 4 + 1}, {window * 8 + 1}, ... frames (sections * {window * 4} + 1; "
                              f"musubi trims a longer clip before encoding, which latents already encoded cannot be): "
                              f"encode with --num-frames {near}")
    if "image-features" not in cache.condition_sets:
        raise ExportError(f"{where}: FramePack's sections carry the first frame's SigLIP image_embeddings: vaecache "
                          "embed OUT --condition image-features --image-encoder SIGLIP --image-convention "
                          "hunyuanvideo15-musubi adds them (musubi's own computation)")
    features = cache.sets()["conditions"]["image-features"]
    convention = ((features.entry.get("fingerprint") or {}).get("image_encoder") or {}).get("convention")
    if convention not in FRAMEPACK_CONVENTIONS:
        raise ExportError(f"{where}: the cache's image-features are {convention}'s, not SigLIP's in a FramePack "
                          f"convention ({', '.join(FRAMEPACK_CONVENTIONS)})")
    return features


def _write_latent_file(folder: Path, name: str, spec: MusubiArch, latent: torch.Tensor,
                       normalization: dict[str, Any], metadata: dict[str, str], image_latents: Any,
                       clip_features: Any, view: int, count: int, temporal: int, files: int,
                       size: int) -> tuple[int, int]:
    """One camera's latent file (musubi_tensors, and the I2V latents_image and image features where the cache has
    them, under the architecture's keys); returns the files and bytes written so far."""
    _, _, height_l, width_l = latent.shape
    tensors = musubi_tensors(spec, latent, normalization)
    if image_latents is not None:
        image = musubi_image_latent(spec, image_latents[view], count, temporal, normalization, latent.dtype)
        _, frames_l, _, _ = image.shape
        tensors[f"latents_image_{frames_l}x{height_l}x{width_l}_{str(image.dtype).removeprefix('torch.')}"] = image
    if clip_features is not None and spec.short == "hv15":  # save_latent_cache_hunyuan_video_1_5
        tensors[f"siglip_{str(clip_features.dtype).removeprefix('torch.')}"] = clip_features[view].contiguous()
    elif clip_features is not None:  # cache_io.py save_latent_cache_wan: named by the latent's dtype
        tensors[f"clip_{str(latent.dtype).removeprefix('torch.')}"] = clip_features[view].contiguous()
    data = safetensors_bytes(tensors, metadata)
    write_new_file(folder / "cache" / name, data)
    return files + 1, size + len(data)


def musubi_item(scene: str, camera: str) -> str:
    """The musubi item name of one camera of a scene: musubi-tuner names latent and text-encoder caches after
    the basename of the video (item_key), so DIR/videos/<item>.<ext> links to that camera's source."""
    return safe_name(f"{scene}-{camera}")


def export_musubi(cache_dir: Path | str, target: Path, arch: str | None = None, verify: str = "size",
                  on_clip: Callable[[int, int], None] | None = None,
                  storage_options: dict[str, Any] | None = None, text_set: str = "auto",
                  condition: str = "auto", fp_window: int = 9, fp_mode: str = "inverted") -> ExportSummary:
    """Write musubi-tuner's latent cache for every clip and camera (see docs/exports.md, "Export to musubi-tuner").
    Everything is checked before the first file is written: the architecture against the cache's VAE, the
    stored tensor, the sizes musubi's buckets would stack together. With a text set (`text_set`: its name, "auto":
    the cache's only set, "none") its embeddings are written as musubi's text-encoder caches too. With a first-frame
    condition set (`condition`: "auto" exports it where the cache has one, "first-frame", "none") each Wan latent
    file carries musubi's I2V `latents_image` too."""
    from vaecache.training import LatentCache

    cache = LatentCache(cache_dir, verify=verify, storage_options=storage_options)  # a folder or a URL
    cache.kinds()  # a kind of set no installed package declares is refused before anything is written
    vae = cache.manifest.get("vae") or {}
    stored = (cache.manifest.get("latent") or {}).get("store") or []
    first = cache.record(0) if len(cache) else {}
    channels = next(iter((first.get("tensors") or {}).values()), {}).get("shape", [None, None])[1]
    spec = musubi_arch(vae, channels, arch, cache_dir)
    refuse_other_encodes(cache, f"musubi-tuner's {spec.full} caching", cache_dir)
    key = "mean" if "mean" in stored else "sample" if spec.samples and "sample" in stored else None
    if key is None:
        raise ExportError(f"{cache_dir}: stores no posterior mean ({'/'.join(stored) or 'nothing'}); musubi-tuner's "
                          f"{spec.full} caching stores the mean")
    spatial = int((cache.manifest.get("frame_rule") or {}).get("spatial_factor") or 0)
    if spatial < 1:
        raise ExportError(f"{cache_dir}: manifest.json records no frame_rule.spatial_factor (pixel size unknown)")
    normalization = vae.get("normalization") or {}
    texts = musubi_text_set(cache, spec, text_set, cache_dir)
    if spec.short == "fp":
        conditions, image_features, features_note = None, framepack_inputs(cache, fp_window, fp_mode, cache_dir), ""
    else:
        conditions = musubi_condition_set(cache, spec, condition, cache_dir)
        image_features, features_note = musubi_image_features(cache, spec, condition, cache_dir)
    temporal = int((cache.manifest.get("frame_rule") or {}).get("temporal_factor") or 1)
    te_items: dict[str, tuple[str, str]] = {}  # item -> (prompt key, first clip) of the text caches written
    buckets = [b for b in cache.manifest.get("buckets") or [] if b.get("clips")]
    musubi_buckets({(int(b["width"]), int(b["height"])) for b in buckets}, cache_dir)
    files = size = captions = 0
    sizes: set[tuple[int, int]] = set()
    counts: set[int] = set()
    with staging(target) as folder:
        (folder / "cache").mkdir()
        (folder / "videos").mkdir()
        index = ExportIndex(folder / EXPORT_INDEX)
        videos = open(folder / "videos.jsonl", "x", encoding="utf-8")
        linked: set[str] = set()  # items of the current scene (clips of a scene are contiguous: sorted ids)
        scene_now = None
        for number, record in enumerate(cache.records(), 1):
            latents = cache.tensors_of(record)[key]
            image_latents = conditions.stored(record["id"]) if conditions is not None else None
            clip_features = image_features.stored(record["id"]) if image_features is not None else None
            captions += bool(_caption(record))
            if record["scene"] != scene_now:
                scene_now, linked = record["scene"], set()
            for view, camera in enumerate(record["cameras"]):
                latent = latents[view]  # (C, F, H, W)
                _, _, height_l, width_l = latent.shape
                width, height, count = width_l * spatial, height_l * spatial, len(record["frames"])
                sizes.add((width, height))
                counts.add(count)
                item = musubi_item(record["scene"], camera)
                metadata = {"architecture": spec.full, "width": str(width), "height": str(height),
                            "frame_count": str(count), "format_version": MUSUBI_FORMAT_VERSION}
                if spec.short == "fp":  # one file per section (fpack_cache_latents.py)
                    from vaecache.export.framepack import framepack_file_tensors, framepack_sections

                    scaled = spec.latents(latent, normalization)["latents"]  # type: ignore[misc]
                    for section, stems in framepack_sections(scaled, fp_window, fp_mode):
                        name = (f"{item}_{record['frames'][0]:05d}-{count:03d}-{section:04d}_{width:04d}x{height:04d}_"
                                "fp.safetensors")
                        data = safetensors_bytes(framepack_file_tensors(stems, clip_features[view]), metadata)
                        write_new_file(folder / "cache" / name, data)
                        files, size = files + 1, size + len(data)
                        index.add(clip=record["id"], scene=record["scene"], camera=camera, file=f"cache/{name}",
                                  item=item, renamed=item != f"{record['scene']}-{camera}", section=section)
                else:
                    name = (f"{item}_{record['frames'][0]:05d}-{count:03d}_{width:04d}x{height:04d}_"
                            f"{spec.short}.safetensors")
                    files, size = _write_latent_file(folder, name, spec, latent, normalization, metadata,
                                                     image_latents, clip_features, view, count, temporal,
                                                     files, size)
                    index.add(clip=record["id"], scene=record["scene"], camera=camera, file=f"cache/{name}",
                              item=item, renamed=item != f"{record['scene']}-{camera}")
                if texts is not None:
                    written = write_text_cache(folder, texts, spec, item, record["id"], te_items)
                    files, size = files + bool(written), size + written
                if item not in linked:
                    linked.add(item)
                    # The one path of an export that leaves DIR, on purpose: musubi's text-encoder caching reads
                    # captions through videos.jsonl, whose entries name videos; these link to the sources.
                    source = record["sources"][view]
                    video = folder / "videos" / f"{item}{safe_suffix(source)}"
                    os.symlink(source, video)
                    final = Path(target).absolute() / "videos" / video.name
                    videos.write(json.dumps({"video_path": str(final), "caption": _caption(record)},
                                            ensure_ascii=False) + "\n")
            if on_clip is not None:
                on_clip(number, len(cache))
        videos.flush()
        os.fsync(videos.fileno())
        videos.close()
        (folder / "dataset.toml").write_text(musubi_dataset_toml(Path(target).absolute(), sizes, counts,
                                                                 fp_window if spec.short == "fp" else None))
        finish(folder, index, {
            "format": "vaecache-export", "kind": "musubi", "architecture": spec.short, "architecture_full": spec.full,
            "vae_family": spec.family, "convention": spec.convention, "tensor": f"posterior {key}, (C, F, H, W)",
            **({"note": f"musubi-tuner's {spec.full} caching stores a posterior sample; this export stores the "
                        f"{key}"} if spec.samples else {}),
            "normalization": {k: v for k, v in normalization.items() if k != "formula"},
            **({"fp_latent_window_size": fp_window, "fp_mode": fp_mode} if spec.short == "fp" else {}),
            "source": source_of(cache), "clips": len(cache), "files": files, "bytes": size,
            "renamed": index.renamed, "captioned_clips": captions,
            **({"text_set": texts.name, "text_caches": len(te_items)} if texts is not None else {}),
            **({"condition_set": conditions.kind, "image_latents": (
                "latents_image: the first frame's raw one-frame latent at latent frame 0, zeros after, then a mask "
                "channel 1 on latent frame 0, float32, as musubi-tuner's HunyuanVideo 1.5 I2V caching stores them "
                "(hv_1_5_cache_latents.py)" if spec.short == "hv15" else
                "latents_image: the first-frame mask (4 channels) then the condition latents normalized as the "
                "latents are, as musubi-tuner's Wan I2V caching stores them (wan_cache_latents.py)")}
               if conditions is not None else {}),
            **({"image_features": "siglip_<dtype>: SigLIP features of the first frame in musubi's convention, float16"
                if spec.short == "hv15" else
                "clip_<dtype>: CLIP features of the first frame in musubi's convention, float16"}
               if image_features is not None else {})})
    notes = [f"latents as musubi-tuner's {spec.full} caching stores them: {spec.convention}"]
    if conditions is not None:
        encoder, key, convention, model = (("SigLIP", "siglip", "hunyuanvideo15-musubi", "HunyuanVideo 1.5")
                                           if spec.short == "hv15" else ("CLIP", "clip", "wan-musubi", "Wan 2.1"))
        notes.append("I2V latents_image of condition set 'first-frame' in every latent file" +
                     (f" with the first frame's {encoder} features ({key}_<dtype>): musubi's {model} I2V caching step "
                      "is not needed" if image_features is not None else f" (no {encoder} features: add them with "
                      f"vaecache embed --condition image-features --image-convention {convention} for {model} I2V)"))
    if features_note:
        notes.append(features_note)
    if texts is not None:
        notes.append(f"text-encoder caches of text set {texts.name!r} for {len(te_items)} items "
                     f"(<item>_{spec.short}_te.safetensors): musubi's text-encoder caching step is not needed")
    if not captions and texts is None:
        notes.append("no clip has a caption (metadata key 'caption'): musubi-tuner's text-encoder caching would "
                     "encode empty prompts; add captions (an index's \"caption\", a <video>.txt beside each video, "
                     "or <scene>/caption.txt) and encode again")
    return ExportSummary(str(target), "musubi", len(cache), files, size, index.renamed, tuple(notes))


def _caption(record: dict[str, Any]) -> str:
    caption = (record.get("metadata") or {}).get("caption")
    return caption if isinstance(caption, str) else ""


def safe_suffix(path: str) -> str:
    suffix = Path(path).suffix.lower()
    return suffix if re.fullmatch(r"\.[a-z0-9]{1,8}", suffix) else ".mp4"


def musubi_buckets(sizes: set[tuple[int, int]], cache_dir: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """Pure: size (W, H) -> the bucket musubi-tuner's training puts its latents in, for a cache of several sizes
    (one size: its own). With `enable_bucket` and `bucket_no_upscale`, musubi floors a cached file's size to
    multiples of 16 when its area is at most `resolution`'s; two sizes flooring alike would be stacked into one
    batch, so they are refused, naming both."""
    step = MUSUBI_RESOLUTION_STEP
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for width, height in sorted(sizes):
        bucket = (width // step * step, height // step * step)
        if bucket in seen.values() and len(sizes) > 1:
            other = next(s for s, b in seen.items() if b == bucket)
            raise ExportError(f"{cache_dir}: sizes {other[0]}x{other[1]} and {width}x{height} fall into one "
                              f"musubi-tuner bucket ({bucket[0]}x{bucket[1]}: it floors sizes to multiples of {step}) "
                              "and would be stacked into one batch; export a cache whose sizes differ after that")
        seen[(width, height)] = bucket
    return seen


def musubi_dataset_toml(target: Path, sizes: set[tuple[int, int]], frames: set[int],
                        fp_window: int | None = None) -> str:
    """A musubi-tuner dataset config over the export: captions from videos.jsonl, latents in cache/.

    musubi's training groups cached latents by the bucket its BucketSelector gives their file's size: one
    size is one bucket (enable_bucket off, resolution that size); several sizes need enable_bucket with
    bucket_no_upscale and the largest area as resolution, so that each size is its own bucket (musubi_buckets,
    checked before the export writes anything)."""
    width, height = max(sorted(sizes), key=lambda s: s[0] * s[1]) if sizes else (0, 0)
    several = len(sizes) > 1
    return (f"# Written by vaecache export: musubi-tuner's text-encoder caching and training read this.\n"
            f"[general]\nresolution = [{width}, {height}]\nbatch_size = 1\n"
            f"enable_bucket = {'true' if several else 'false'}\n"
            + ("bucket_no_upscale = true\n" if several else "")
            + f"\n[[datasets]]\nvideo_jsonl_file = {json.dumps(str(target / 'videos.jsonl'))}\n"
            f"cache_directory = {json.dumps(str(target / 'cache'))}\n"
            f"target_frames = [{', '.join(str(f) for f in sorted(frames))}]\nframe_extraction = \"head\"\n"
            + (f"fp_latent_window_size = {fp_window}\n" if fp_window is not None else ""))
