"""The report's clips section: for each sampled clip, every camera's source frames beside the VAE's reconstruction (a
strip of frames), PSNR and SSIM, its caption and text set rows, its first-frame condition decoded, and its sound (a
spectrogram and a WAV) where the cache has an audio set. A clip whose latents are not decoded here (the family's
decoder is not run, the VAE does not load, the decode budget is spent) shows its source frames and says why.

Memory: a clip is decoded a chunk at a time (vaecache.decode.preview.ClipDecoder); only the strip's frames are kept.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vaecache.cache.reader import CacheReader
from vaecache.errors import VaecacheError, first_line
from vaecache.report.decodable import DecodeBudget, family_refusal, measure_decoder
from vaecache.report.media import frames_uint8, write_strip, write_wav

IMAGES, SOUNDS = "images", "sounds"
"""Folders of the report beside index.html; every file in them is named by the clip's number in the sample (never by
user data)."""
DECODE_ERRORS = (VaecacheError, OSError, RuntimeError, ValueError, KeyError)
"""What decoding one clip may raise that the report shows on the clip's card instead of stopping."""


@dataclass(frozen=True)
class CameraView:
    camera: str
    strip: str | None
    """The strip's path relative to the report folder: source frames above, reconstruction below (or source alone)."""
    reconstructed: bool
    psnr_db: float | None = None
    ssim: float | None = None


@dataclass(frozen=True)
class ConditionView:
    kind: str
    image: str | None
    note: str


@dataclass(frozen=True)
class SoundView:
    set: str
    camera: str | None
    spectrogram: str | None = None
    audio: str | None = None
    seconds: float | None = None
    rate: int | None = None
    note: str = ""


@dataclass
class ClipCard:
    number: int
    id: str
    scene: str
    frames: int
    fps: float | None
    size: str
    shown_frames: list[int] = field(default_factory=list)
    """Positions in the clip of the frames a strip shows."""
    cameras: list[CameraView] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    caption: str | None = None
    prompts: list[dict[str, Any]] = field(default_factory=list)
    conditions: list[ConditionView] = field(default_factory=list)
    sounds: list[SoundView] = field(default_factory=list)
    decode_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Decoding:
    """The report's decoder: the recorded VAE loaded once and its budget, or why no clip is decoded."""

    decoder: Any = None
    budget: DecodeBudget | None = None
    reason: str | None = None
    loaded_s: float = 0.0


def open_decoding(reader: CacheReader, device: str, budget_s: float, channels: int | None) -> Decoding:
    """Load the recorded VAE (vaecache decode's ClipDecoder) and time it on one latent frame, or say why not."""
    refusal = family_refusal(reader.manifest)
    if refusal:
        return Decoding(reason=refusal)
    if budget_s <= 0:
        return Decoding(reason="not decoded: --decode-budget 0")
    from vaecache.decode.preview import ClipDecoder, PreviewSettings

    started = time.perf_counter()
    try:
        decoder = ClipDecoder(reader.store.location, reader.manifest, PreviewSettings(device=device))
        seconds_per_pixel = measure_decoder(decoder.model, int(channels or 0) or _channels(reader.manifest),
                                            decoder.model.compute_dtype)
    except DECODE_ERRORS as exc:
        return Decoding(reason=f"the recorded VAE is not decoded here: {first_line(exc)}")
    return Decoding(decoder, DecodeBudget(budget_s, seconds_per_pixel, str(decoder.device)),
                    loaded_s=time.perf_counter() - started)


def _channels(manifest: dict[str, Any]) -> int:
    shape = ((manifest.get("latent") or {}).get("shape") or {})
    for key in ("mean", "sample"):
        if key in shape:
            return int(shape[key][1])
    raise ValueError("the manifest records no latent shape (a bucketed cache: pass the channel count)")


def strip_positions(frames: int, wanted: int) -> list[int]:
    """At most `wanted` positions spread evenly over a clip of `frames` frames, first and last included. Pure."""
    if frames <= 0 or wanted <= 0:
        return []
    if wanted == 1 or frames == 1:
        return [0]
    return sorted({round(i * (frames - 1) / (min(wanted, frames) - 1)) for i in range(min(wanted, frames))})


def clip_card(number: int, record: dict[str, Any], reader: CacheReader, decoding: Decoding, folder: Path,
              strip_frames: int, set_rows: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> ClipCard:
    """One sampled clip's card, its files written under `folder` (IMAGES, SOUNDS); `set_rows` are the sample's rows
    of the cache's condition and audio sets (sample_set_rows)."""
    from vaecache.cache.provenance import changed_source
    from vaecache.decode.preview import clip_size
    from vaecache.settings.clip import ClipSettings

    frames = len(record.get("frames") or [])
    height, width = clip_size(record, ClipSettings.from_record(reader.manifest.get("settings") or {}))
    card = ClipCard(number, str(record["id"]), str(record.get("scene")), frames, record.get("fps"),
                    f"{height}x{width}", strip_positions(frames, strip_frames))
    pixels = len(record["cameras"]) * frames * height * width
    why = decoding.reason or (decoding.budget.refusal(pixels) if decoding.budget else None)
    changed = changed_source(record)
    try:
        if changed is not None:  # the frames there now are not the ones encoded: the reconstruction alone
            path, camera, change = changed
            card.notes.append(f"{camera}'s source {path} {change} since the clip was encoded: no source frames are "
                              "shown and no PSNR or SSIM measured (the latents no longer match them)")
            if why is None:
                _reconstruction_only(card, record, reader, decoding, folder)
            else:
                card.notes.append(why)
                card.cameras = [CameraView(str(name), None, False) for name in record["cameras"]]
        elif why is None:
            _reconstruct(card, record, reader, decoding, folder)
        else:
            card.notes.append(why)
            _sources_only(card, record, reader, folder)
    except DECODE_ERRORS as exc:
        card.notes.append(f"cannot show this clip: {first_line(exc)}")
    _conditions(card, record, reader, decoding, folder, set_rows.get("conditions") or {})
    _sounds(card, record, reader, folder, set_rows.get("audio") or {})
    return card


def _reconstruct(card: ClipCard, record: dict[str, Any], reader: CacheReader, decoding: Decoding,
                 folder: Path) -> None:
    from vaecache.decode.preview import ReconstructionScore, stored_latents

    stored = stored_latents(reader.clip_tensors(record))
    if stored is None:
        raise VaecacheError(f"clip {record['id']} stores neither mean nor sample")
    key, latents = stored
    cameras = list(record["cameras"])
    scores = [ReconstructionScore() for _ in cameras]
    kept: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{} for _ in cameras]
    wanted = set(card.shown_frames)
    started = time.perf_counter()
    done = 0
    try:
        for chunk in decoding.decoder.chunks(record, latents):
            count = chunk.decoded[0].shape[0]
            for view, (score, src, dec) in enumerate(zip(scores, chunk.sources, chunk.decoded)):
                score.add(src, dec)
                for position in range(chunk.start, chunk.start + count):
                    if position in wanted:
                        index = position - chunk.start
                        kept[view][position] = (frames_uint8(src[index:index + 1].numpy())[0],
                                                frames_uint8(dec[index:index + 1].numpy())[0])
            done += count
    finally:
        card.decode_s = round(time.perf_counter() - started, 3)
        decoding.budget.spend(card.decode_s)  # type: ignore[union-attr]
    if done < card.frames:
        card.notes.append(f"the VAE decoded {done} of the clip's {card.frames} frames")
    card.notes.append(f"decoded the stored {key} ({'posterior mean' if key == 'mean' else 'sample'}) in "
                      f"{card.decode_s:.1f} s")
    for view, camera in enumerate(cameras):
        shown = [kept[view][p] for p in card.shown_frames if p in kept[view]]
        strip = None
        if shown:
            strip = f"{IMAGES}/clip-{card.number:03d}-camera-{view}.png"
            write_strip(folder / strip, [[s for s, _ in shown], [d for _, d in shown]])
        metrics = scores[view].result(camera)
        card.cameras.append(CameraView(str(camera), strip, True, round(metrics.psnr_db, 2), round(metrics.ssim, 4)))


def _reconstruction_only(card: ClipCard, record: dict[str, Any], reader: CacheReader, decoding: Decoding,
                         folder: Path) -> None:
    """Each camera's reconstruction alone, where its sources cannot be read as they were encoded."""
    from vaecache.decode.preview import stored_latents
    from vaecache.vae.latent_decode import iter_decoded

    stored = stored_latents(reader.clip_tensors(record))
    if stored is None:
        raise VaecacheError(f"clip {record['id']} stores neither mean nor sample")
    wanted = set(card.shown_frames)
    started = time.perf_counter()
    try:
        for view, camera in enumerate(record["cameras"]):
            kept, done = [], 0
            for piece in iter_decoded(decoding.decoder.model, stored[1][view:view + 1],
                                      decoding.decoder.settings.chunk_frames):
                frames = piece[0].permute(1, 0, 2, 3).float().cpu().clamp(-1, 1).numpy()
                kept += [frames_uint8(frames[i:i + 1])[0] for i in range(len(frames)) if done + i in wanted]
                done += len(frames)
            strip = f"{IMAGES}/clip-{card.number:03d}-camera-{view}.png"
            write_strip(folder / strip, [kept])
            card.cameras.append(CameraView(str(camera), strip, True))
    finally:
        card.decode_s = round(time.perf_counter() - started, 3)
        decoding.budget.spend(card.decode_s)  # type: ignore[union-attr]


def _sources_only(card: ClipCard, record: dict[str, Any], reader: CacheReader, folder: Path) -> None:
    from vaecache.decode.preview import source_frames_at

    for view, (camera, frames) in enumerate(zip(record["cameras"], source_frames_at(record, reader.manifest,
                                                                                      card.shown_frames))):
        strip = f"{IMAGES}/clip-{card.number:03d}-camera-{view}.png"
        write_strip(folder / strip, [list(frames_uint8(frames.numpy()))])
        card.cameras.append(CameraView(str(camera), strip, False))


SHOWN_SET_KINDS = ("conditions", "audio")
"""The kinds of set whose item a clip's card shows: a condition decoded, a sound played."""


def sample_set_rows(reader: CacheReader, ids: list[str]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """kind -> set -> clip id -> its row in the set's clip table, for the sampled clips `ids` (each table read once,
    a batch at a time)."""
    found: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for kind in SHOWN_SET_KINDS:
        sets = reader.manifest.get(kind)
        if isinstance(sets, dict):
            found[kind] = {name: set_item_rows(reader, entry, ids) for name, entry in sorted(sets.items())}
    return found


def set_item_rows(reader: CacheReader, entry: dict[str, Any], ids: list[str]) -> dict[str, dict[str, Any]]:
    """The rows of a set's clip table (its manifest `entry`'s tables.clips) for clips `ids`, by clip id."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    file = ((entry.get("tables") or {}).get("clips") or {}).get("file")
    name = reader.store.checked_name(file, f"{reader.store.where('manifest.json')}: a set's clip table")
    found: dict[str, dict[str, Any]] = {}
    for batch in pq.ParquetFile(reader.store.table_source(name)).iter_batches(batch_size=65536):
        chosen = batch.filter(pc.is_in(batch.column("id"), pa.array(ids, pa.string())))
        found.update({row["id"]: row for row in chosen.to_pylist()})
    return found


def _conditions(card: ClipCard, record: dict[str, Any], reader: CacheReader, decoding: Decoding, folder: Path,
                rows: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Each image-to-video condition set's tensor for the clip, decoded by the recorded VAE: each camera's first
    frame (and last, for first-last), left to right."""
    from vaecache.cache.sets import SetShards
    from vaecache.vae.latent_decode import WHOLE

    for number, (kind, entry) in enumerate(sorted((reader.manifest.get("conditions") or {}).items())):
        fingerprint_kind = str((entry.get("fingerprint") or {}).get("kind") or kind)
        try:
            row = (rows.get(kind) or {}).get(card.id)
            if row is None:
                card.conditions.append(ConditionView(kind, None, "the set holds no condition for this clip"))
                continue
            if fingerprint_kind == "image-features":
                card.conditions.append(ConditionView(kind, None, "image-encoder features: no picture to show"))
                continue
            if decoding.decoder is None:
                card.conditions.append(ConditionView(kind, None, f"not decoded ({decoding.reason})"))
                continue
            last = fingerprint_kind == "first-last"
            whole = last or decoding.decoder.mode == WHOLE  # the first frame alone where the decode is by chunks
            height, width = (int(side) for side in card.size.split("x"))
            refusal = decoding.budget.refusal(len(card.cameras or record["cameras"]) * height * width
                                              * (card.frames if whole else 1))
            if refusal:
                card.conditions.append(ConditionView(kind, None, refusal))
                continue
            stored = SetShards(reader.store, entry, "size", f"condition set {kind!r}").open(
                row["shard"], f"clip {card.id}").get_tensor(card.id)
            frames = [frame for c in range(stored.shape[0]) for frame in _condition_frames(decoding, stored[c:c + 1],
                                                                                            last)]
            image = f"{IMAGES}/clip-{card.number:03d}-condition-{number}.png"
            write_strip(folder / image, [frames])
            card.conditions.append(ConditionView(kind, image, "decoded from the stored condition latents: each "
                                                 f"camera's first frame{' and last' if last else ''}, left to right"))
        except DECODE_ERRORS as exc:
            card.conditions.append(ConditionView(kind, None, f"cannot show it: {first_line(exc)}"))


def _condition_frames(decoding: Decoding, latents: Any, last: bool) -> list[np.ndarray]:
    """The first (and last) decoded frame of one camera's condition latents (1, C, F, h, w), uint8 (H, W, 3)."""
    from vaecache.vae.latent_decode import iter_decoded

    started = time.perf_counter()
    first = final = None
    try:
        for piece in iter_decoded(decoding.decoder.model, latents, 1):
            frames = piece[0].permute(1, 0, 2, 3).float().cpu().clamp(-1, 1).numpy()
            first = frames[:1] if first is None else first
            final = frames[-1:]
            if not last:
                break
    finally:
        decoding.budget.spend(time.perf_counter() - started)  # type: ignore[union-attr]
    chosen = [first] + ([final] if last else [])
    return [frames_uint8(f)[0] for f in chosen if f is not None]


def _sounds(card: ClipCard, record: dict[str, Any], reader: CacheReader, folder: Path,
            rows: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Each audio set's sound of the clip (the camera the set took it from), as a spectrogram and a WAV."""
    from vaecache.audio.track import record_audio
    from vaecache.report.plots import spectrogram
    from vaecache.settings.clip import ClipSettings

    stride = ClipSettings.from_record(reader.manifest.get("settings") or {}).sampling.frame_stride
    for number, (name, entry) in enumerate(sorted((reader.manifest.get("audio") or {}).items())):
        try:
            row = (rows.get(name) or {}).get(card.id) or {}
            camera = row.get("camera") or None
            if str(row.get("audio") or "").startswith("skipped"):
                card.sounds.append(SoundView(name, camera, note=f"no sound in the set: {row['audio']}"))
                continue
            sound = record_audio(record, stride, camera)
            samples = sound.samples.numpy()
            image = f"{IMAGES}/clip-{card.number:03d}-sound-{number}.png"
            audio = f"{SOUNDS}/clip-{card.number:03d}-sound-{number}.wav"
            spectrogram(folder / image, samples, sound.rate)
            write_wav(folder / audio, samples, sound.rate)
            note = "the set holds silence for it: " + str(row["audio"]) if row.get("audio") else ""
            card.sounds.append(SoundView(name, camera or _camera_of(record, sound.path), image, audio,
                                         round(sound.duration_s, 3), sound.rate, note))
        except DECODE_ERRORS as exc:
            card.sounds.append(SoundView(name, None, note=f"cannot play it: {first_line(exc)}"))


def _camera_of(record: dict[str, Any], path: str) -> str | None:
    for camera, source in zip(record["cameras"], record["sources"]):
        if source == path:
            return str(camera)
    return None


__all__ = ["CameraView", "ClipCard", "ConditionView", "Decoding", "SoundView", "clip_card", "open_decoding",
           "sample_set_rows", "set_item_rows", "strip_positions"]
