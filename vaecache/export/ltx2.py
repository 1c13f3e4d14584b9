"""`vaecache export OUT --format ltx2 --out DIR`: a cache of LTX-2's video VAE (and an audio set of its audio VAE)
as LTX-2's trainer reads it (github Lightricks/LTX-2, `packages/ltx-trainer`): `DIR/.precomputed/latents/<name>.pt`
and `DIR/.precomputed/audio_latents/<name>.pt`, the files `scripts/process_videos.py` writes and
`src/ltx_trainer/datasets.py:PrecomputedDataset` loads (`torch.load(..., weights_only=True)`).

- **latents**: `{"latents": (C, F, H, W), "num_frames", "height", "width", "fps"}`, the latents normalized as
  ltx-core's video encoder returns them (`ltx_normalized`: per channel, in its arithmetic and the cache's stored
  dtype, bf16 for a cache encoded in bf16 as the trainer encodes), `fps` the clip's own rate (the source's over the
  frame stride: process_videos' `effective_fps`). Audio latents are float32, as the trainer's audio VAE computes.
- **audio_latents**: `{"latents": (C, T, F), "num_time_steps", "frequency_bins", "duration"}`, normalized as
  ltx-core's audio encoder returns them (over the packed channels x mel bins), `duration` the clip's sound in seconds.
  A clip without sound (skipped by the audio set) gets no audio file, as process_videos writes none for a video
  without an audio track; PrecomputedDataset then leaves the sample out where audio latents are asked for.
- **conditions** (from a text set of the ltx2 family, `vaecache embed --text-encoder diffusers:LTX2-FOLDER`):
  `{"video_prompt_embeds": (1024, D), "audio_prompt_embeds": (1024, D'), "prompt_attention_mask": (1024,) int64}`,
  what `scripts/process_captions.py` saves (`embedding_data`), in the set's stored dtype (LTX-2's trainer computes
  and saves bf16: `embed --text-dtype bf16 --compute-dtype bf16` for its numbers), left-padded.
- **the captions**: `DIR/dataset.jsonl` lists each sample as `{"media_path": "<name>.mp4", "caption"}` (the clip's
  metadata caption), so that LTX-2's own `scripts/process_captions.py DIR/dataset.jsonl --output-dir
  DIR/.precomputed/conditions` can write the Gemma conditions under the same names (its `_embedding_output_path`)
  where the cache holds no LTX-2 text set.

A multi-camera cache gives one sample per camera (LTX-2 is a single-view model), named `<clip>/<camera>`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from vaecache.errors import ExportError
from vaecache.export.common import (
    EXPORT_INDEX,
    ExportIndex,
    ExportSummary,
    finish,
    safe_name,
    source_of,
    staging,
    write_new_file,
)

PRECOMPUTED = ".precomputed"
MODEL = "ltx-2"
"""The model family whose trainer reads this export (vaecache.models.ltx2): its VAE class's latents are exported."""


def ltx_normalized(stored: torch.Tensor, normalization: dict[str, Any]) -> torch.Tensor:
    """(cameras, C, F, H, W) stored means -> what ltx-core's video encoder returns, in its arithmetic and the stored
    dtype (bf16 where the cache was encoded in bf16, as LTX-2's trainer encodes): `(z - mean-of-means) /
    std-of-means` per channel (`PerChannelStatistics.normalize`), times the config's scaling_factor where it is not
    1 (diffusers' `(z - latents_mean) * scaling_factor / latents_std`)."""
    mean = torch.tensor(normalization["latents_mean"]).view(1, -1, 1, 1, 1).to(stored)
    std = torch.tensor(normalization["latents_std"]).view(1, -1, 1, 1, 1).to(stored)
    scale = float(normalization.get("scaling_factor", 1.0))
    if scale == 1.0:
        return (stored - mean) / std
    return (stored - mean) * scale / std


def _pt_bytes(data: dict[str, Any]) -> bytes:
    """torch.save's bytes of a dict of tensors and numbers (what the trainer's weights_only load takes)."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def ltx2_text_set(cache: Any, text_set: str) -> Any:
    """The TextSet written as conditions: `text_set` NAME, "auto" (the cache's only set of the ltx2 family) or
    "none"; an ExportError naming the sets otherwise."""
    texts = cache.sets().get("text") or {}
    ltx2 = sorted(name for name, reader in texts.items() if reader.family == "ltx2")
    if text_set == "none" or (text_set == "auto" and not ltx2):
        return None
    if text_set == "auto":
        if len(ltx2) > 1:
            raise ExportError(f"{cache.out}: holds LTX-2 text sets {', '.join(ltx2)}; name one with --text-set "
                              "(or none)")
        return texts[ltx2[0]]
    if text_set not in texts:
        raise ExportError(f"{cache.out}: has no text set {text_set!r} (sets: {', '.join(sorted(texts)) or 'none'})")
    if texts[text_set].family != "ltx2":
        raise ExportError(f"{cache.out}: text set {text_set!r} is of the {texts[text_set].family or 'unknown'} "
                          "family; LTX-2's trainer takes Gemma features of an LTX-2 set (vaecache embed "
                          "--text-encoder diffusers:LTX2-PIPELINE-FOLDER)")
    return texts[text_set]


def ltx2_conditions(texts: Any, clip: str) -> dict[str, torch.Tensor]:
    """A clip's conditions file as scripts/process_captions.py saves it: its prompt's video and audio features and
    the left-padded attention mask (int64, as the tokenizer returns it)."""
    item = texts.item(clip)
    return {"video_prompt_embeds": item[f"text/{texts.name}"].contiguous(),
            "prompt_attention_mask": item[f"text_mask/{texts.name}"].long(),
            "audio_prompt_embeds": item[f"text_audio/{texts.name}"].contiguous()}


def export_ltx2(cache_dir: Any, target: Path, audio_set: str = "auto", verify: str = "sha256",
                storage_options: dict[str, Any] | None = None, text_set: str = "auto") -> ExportSummary:
    """Write the LTX-2 trainer's precomputed folder for the cache at `cache_dir` into the new folder `target`."""
    from vaecache.models._ltx2_audio import normalize as normalize_audio_latents
    from vaecache.settings.clip import ClipSettings
    from vaecache.training import LatentCache

    cache = LatentCache(cache_dir, verify=verify, storage_options=storage_options)
    cache.kinds()  # a kind of set no installed package declares is refused before anything is written
    from vaecache.models import FAMILIES

    family = (cache.manifest.get("vae") or {}).get("family")
    video_class = FAMILIES[MODEL].vae_classes[0]
    if family != video_class:
        raise ExportError(f"{cache.out}: its VAE is {family or 'unrecorded'}; LTX-2's trainer trains on the latents "
                          f"of its video VAE ({video_class})")
    normalization = (cache.manifest.get("vae") or {}).get("normalization") or {}
    if not normalization.get("latents_mean") or not normalization.get("latents_std"):
        raise ExportError(f"{cache.out}: records no latents_mean/latents_std for its VAE (LTX-2's trainer trains on "
                          "normalized latents)")
    audio_sets = cache.sets().get("audio") or {}
    if audio_set == "auto":
        chosen = next(iter(audio_sets)) if len(audio_sets) == 1 else None
        if len(audio_sets) > 1:
            raise ExportError(f"{cache.out}: holds audio sets {', '.join(sorted(audio_sets))}; name one with "
                              "--audio-set (or none)")
    elif audio_set == "none":
        chosen = None
    elif audio_set not in audio_sets:
        held = ", ".join(sorted(audio_sets)) or "none"
        raise ExportError(f"{cache.out}: has no audio set {audio_set!r} (sets: {held})")
    else:
        chosen = audio_set
    audio = audio_sets.get(chosen) if chosen is not None else None
    texts = ltx2_text_set(cache, text_set)
    constants = ((cache.manifest.get("audio") or {}).get(chosen) or {}).get("normalization") if chosen else None
    stride = ClipSettings.from_record(cache.manifest.get("settings") or {}).sampling.frame_stride
    audio_mean = torch.tensor(constants["latents_mean"]) if constants else None
    audio_std = torch.tensor(constants["latents_std"]) if constants else None
    files = size = clips = 0
    with staging(target) as folder:
        latents_dir, audio_dir = folder / PRECOMPUTED / "latents", folder / PRECOMPUTED / "audio_latents"
        latents_dir.mkdir(parents=True)
        conditions_dir = folder / PRECOMPUTED / "conditions"
        if audio is not None:
            audio_dir.mkdir(parents=True)
        if texts is not None:
            conditions_dir.mkdir(parents=True)
        index = ExportIndex(folder / EXPORT_INDEX)
        lines = []
        for position, clip in enumerate(cache.ids()):
            record = cache.record(clip)
            item = cache[position]
            stored = item.tensors.get("mean", item.tensors.get("sample"))
            if stored is None:
                raise ExportError(f"{cache.out}: clip {clip} stores neither mean nor sample")
            latents = ltx_normalized(stored, normalization)
            sound = item.tensors.get(f"audio/{chosen}") if audio is not None else None  # none: a clip it skipped
            audio_bytes = None
            if sound is not None and audio_mean is not None and audio_std is not None:
                try:
                    normalized = normalize_audio_latents(sound.float()[None], audio_mean, audio_std)[0].contiguous()
                except ValueError as exc:
                    raise ExportError(f"{cache.out}: audio set {chosen!r}: {exc}") from None
                facts = audio.export_facts(clip)  # type: ignore[union-attr]
                audio_bytes = _pt_bytes({"latents": normalized, "num_time_steps": int(normalized.shape[1]),
                                         "frequency_bins": int(normalized.shape[2]),
                                         "duration": int(facts["samples"]) / int(facts["rate"])})
            text_bytes = _pt_bytes(ltx2_conditions(texts, clip)) if texts is not None else None
            metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
            caption = metadata.get("caption")
            cameras = list(record["cameras"])
            for view, camera in enumerate(cameras):
                parts = [safe_name(part) for part in clip.split("/")]
                if len(cameras) > 1:
                    parts.append(safe_name(camera))
                name = "/".join(parts)
                renamed = name != "/".join([*clip.split("/"), *([camera] if len(cameras) > 1 else [])])
                video = latents[view].contiguous()
                data = _pt_bytes({"latents": video, "num_frames": int(video.shape[1]), "height": int(video.shape[2]),
                                  "width": int(video.shape[3]), "fps": float(record["fps"]) / stride})
                path = latents_dir / f"{name}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                write_new_file(path, data)
                files, size = files + 1, size + len(data)
                if audio_bytes is not None:  # the clip's sound, the same for each of its cameras
                    audio_path = audio_dir / f"{name}.pt"
                    audio_path.parent.mkdir(parents=True, exist_ok=True)
                    write_new_file(audio_path, audio_bytes)
                    files, size = files + 1, size + len(audio_bytes)
                if text_bytes is not None:  # the clip's prompt, the same for each of its cameras
                    text_path = conditions_dir / f"{name}.pt"
                    text_path.parent.mkdir(parents=True, exist_ok=True)
                    write_new_file(text_path, text_bytes)
                    files, size = files + 1, size + len(text_bytes)
                index.add(renamed=renamed, clip=clip, camera=camera, name=name,
                          audio=sound is not None)
                lines.append({"media_path": f"{name}.mp4", "caption": caption if isinstance(caption, str) else ""})
            clips += 1
        write_new_file(folder / "dataset.jsonl", "".join(json.dumps(line, ensure_ascii=False) + "\n"
                                                         for line in lines).encode())
        if texts is not None:
            notes = [f"LTX-2's trainer: PrecomputedDataset(DIR, [\"latents\", \"audio_latents\", \"conditions\"]); "
                     f"conditions from text set {texts.name!r}"]
        else:
            notes = ["LTX-2's trainer: PrecomputedDataset(DIR, [\"latents\", \"audio_latents\", \"conditions\"]) "
                     "after its scripts/process_captions.py DIR/dataset.jsonl --output-dir DIR/.precomputed/conditions "
                     "(Gemma text conditions, under the same names), or vaecache embed OUT --text-encoder "
                     "diffusers:LTX2-FOLDER and export again"]
        if audio is None:
            notes.append("no audio set: latents only (vaecache embed OUT --audio-vae SPEC adds one)")
        finish(folder, index, {"format": "ltx2", "source": source_of(cache), "clips": clips, "samples": len(lines),
                               "audio_set": chosen, "text_set": texts.name if texts is not None else None,
                               "notes": notes})
    return ExportSummary(str(target), "ltx2", clips, files, size, index.renamed, tuple(notes))
