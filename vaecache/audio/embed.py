"""Audio latent sets as a kind of set on the one set machinery (vaecache.cache.kinds, vaecache.cache.embedding): what
`vaecache embed OUT --audio-vae SPEC` computes for each clip of a finished cache, and how verify and the readers see
it. Everything else (the lock, shards across ranks, commits, resume and repair, copying into a grown cache, the
tables, the one manifest write) is the machinery's.

Each clip's item is the posterior mean of the audio VAE over the clip's sound (vaecache.audio.track: cut exactly to
its frames; vaecache.audio.mel: folded, resampled and turned into the log-mel the VAE takes), (C, T, F) in the VAE's
dtype. The set's record holds the VAE's normalization constants and what its family's normalization runs over
(`AudioVaeClass`, declared with the VAE's family in vaecache.models: LTX-2's over the packed C x F features). A
clip whose video has no sound, or whose sound does not cover its window, follows `--audio-missing`: `skip` (its row
records why and it holds no tensor) or `silence` (the latents of silence of the window's length, its row saying
why)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vaecache.cache.kinds import ComputedItem, SetKind, SetPlan, register
from vaecache.cache.layout import AUDIO_DIR
from vaecache.cache.sets import Recomputed, generation_of, pack_shards
from vaecache.distributed.agreement import loaded_on_every_rank, same_on_every_rank
from vaecache.errors import AudioMissingError, UsageError, VaecacheError, VaeSpecError
from vaecache.models import registry
from vaecache.models.base import AudioVaeClass

MISSING_CHOICES = ("skip", "silence")
NAMED_WITHOUT_SOUND = 10
"""The clips without sound an audio embed's summary names, with why (`vaecache inspect` lists every one)."""


def audio_vae_classes() -> dict[str, AudioVaeClass]:
    """The audio VAEs vaecache loads (diffusers' classes), as the model families declare them."""
    return {vae.name: vae for family in registry().families.values() for vae in family.audio_vaes}


AUDIO_VAE_CLASSES = tuple(audio_vae_classes())
CHECKPOINT_FILES = " or ".join(f"{vae.checkpoint} file PATH.safetensors" for vae in audio_vae_classes().values()
                               if vae.checkpoint)
"""How --audio-vae names a checkpoint file, for messages."""


@dataclass(frozen=True)
class AudioRequest:
    """`vaecache embed OUT --audio-vae SPEC`: an audio latent set of the clips of a finished cache."""

    out: str
    audio_vae: str
    """diffusers:PATH[#SUBFOLDER]: a folder holding an AutoencoderKLLTX2Audio (an LTX-2 pipeline's audio_vae); or
    PATH.safetensors: an LTX-2 checkpoint file holding its audio VAE (vaecache.models._ltx2_file)."""
    camera: str | None = None
    """Whose video's sound (default: the first camera whose video has an audio track)."""
    missing: str = "skip"
    set_name: str = "default"
    replace: bool = False
    shard_bytes: int = 256 << 20
    device: str = "auto"
    n_fft: int = 1024
    """The STFT size of the mel (LTX-2's checkpoint: preprocessing.stft.filter_length; a checkpoint file's own
    metadata overrides it)."""
    allow_pickle_weights: bool = False
    storage_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.missing not in MISSING_CHOICES:
            raise UsageError(f"--audio-missing must be one of {', '.join(MISSING_CHOICES)}, got {self.missing!r}")
        if self.shard_bytes < 1:
            raise UsageError(f"--shard-size must be at least 1 byte, got {self.shard_bytes}")
        check_audio_spec_form(self.audio_vae)


FILE_SUFFIXES = (".safetensors", ".sft")


def check_audio_spec_form(spec: str) -> None:
    if not spec.startswith("diffusers:") and not spec.lower().endswith(FILE_SUFFIXES):
        raise UsageError(f"--audio-vae must be diffusers:PATH[#SUBFOLDER] (a folder holding an "
                         f"{' or '.join(AUDIO_VAE_CLASSES)}) or {CHECKPOINT_FILES}, got "
                         f"{spec!r}")


def check_audio_vae(spec: str) -> None:
    """What can be known of a --audio-vae before any video is read: a folder's config class, or a checkpoint file's
    header holding `audio_vae.*` tensors (a VaeSpecError naming it otherwise)."""
    check_audio_spec_form(spec)
    if spec.startswith("diffusers:"):
        audio_vae_folder(spec)
        return
    from vaecache.weights import safetensors_header

    path = Path(spec).expanduser()
    if not path.is_file():
        raise VaeSpecError(f"--audio-vae {spec}: no such file")
    keys = safetensors_header(path)
    if not any(key.startswith(vae.checkpoint_prefix) for vae in audio_vae_classes().values() if vae.checkpoint_prefix
               for key in keys):
        prefixes = " or ".join(f"{vae.checkpoint_prefix}* tensors: not {vae.checkpoint} holding its audio VAE"
                               for vae in audio_vae_classes().values() if vae.checkpoint_prefix)
        raise VaeSpecError(f"--audio-vae {path}: no {prefixes}")


def audio_vae_folder(spec: str) -> Path:
    """The folder a --audio-vae spec names, its config's class one vaecache loads (VaeSpecError naming it otherwise)."""
    location, _, sub = spec.removeprefix("diffusers:").partition("#")
    folder = Path(location).expanduser().absolute() / sub if sub else Path(location).expanduser().absolute()
    config = folder / "config.json"
    if not config.is_file():
        raise VaeSpecError(f"--audio-vae {spec}: {folder} has no config.json (give the folder of the audio VAE, "
                           "or the pipeline's folder with #audio_vae)")
    try:
        name = json.loads(config.read_text()).get("_class_name")
    except (OSError, ValueError) as exc:
        raise VaeSpecError(f"--audio-vae {spec}: {config} cannot be read ({exc})") from None
    if name not in AUDIO_VAE_CLASSES:
        raise VaeSpecError(f"--audio-vae {spec}: {config} is a {name or 'classless config'}; the audio VAEs are "
                           f"{', '.join(AUDIO_VAE_CLASSES)}")
    return folder


class AudioVae(NamedTuple):
    module: Any
    """The diffusers module, in eval mode, on the device."""
    n_fft: int | None
    """The STFT size a checkpoint file's metadata gives (None: a diffusers folder, whose config has none)."""


def load_audio_vae(spec: str, device: torch.device, allow_pickle_weights: bool = False) -> AudioVae:
    """The audio VAE a spec names, loaded strictly (a missing or misshapen weight is an error), in eval mode."""
    import diffusers

    from vaecache.weights import load_pretrained

    check_audio_spec_form(spec)
    if not spec.startswith("diffusers:"):
        from vaecache.audio.release_file import load_audio_single_file

        loaded = load_audio_single_file(Path(spec).expanduser())
        return AudioVae(loaded.module.to(device).eval(), loaded.n_fft)
    folder = audio_vae_folder(spec)
    cls = getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])
    return AudioVae(load_pretrained(cls, folder, allow_pickle_weights=allow_pickle_weights).to(device).eval(), None)


def absolute_audio_spec(spec: str) -> str:
    """The spec with its folder (or file) made absolute: what the set records, so verify --reencode finds the VAE
    again."""
    if not spec.startswith("diffusers:"):
        return str(Path(spec).expanduser().absolute())
    location, sep, sub = spec.removeprefix("diffusers:").partition("#")
    return f"diffusers:{Path(location).expanduser().absolute()}{sep}{sub}"


def audio_vae_fingerprint(vae: Any) -> dict[str, Any]:
    from vaecache.weights import weights_sha256

    config = {key: value for key, value in dict(vae.config).items() if not key.startswith("_") or key == "_class_name"}
    return {"class": type(vae).__name__, "config": json.loads(json.dumps(config, default=str)),
            "weights_sha256": weights_sha256(vae), "dtype": str(next(vae.parameters()).dtype).removeprefix("torch.")}


def audio_inputs(record: dict[str, Any], camera: str | None) -> str:
    """What links an item to its clip: the clip's sources, their recorded identity, its frames and rate, and the
    camera asked for."""
    return hashlib.sha256(json.dumps(
        [record.get("sources"), record.get("source_identity"), record.get("frames"), record.get("camera_frames"),
         record.get("fps"), record.get("cameras"), camera], sort_keys=True, default=str).encode()).hexdigest()


def check_audio_camera(camera: str | None, records: Any, out: Any) -> None:
    """--audio-camera names a camera of the cache's clips (a UsageError naming it and the cameras there are, before
    the audio VAE loads and anything is computed)."""
    if camera is None:
        return
    cameras: set[str] = set()
    for record in records:
        cameras.update(record.get("cameras") or ())
        if camera in cameras:
            return
    raise UsageError(f"--audio-camera {camera}: no clip of {out} has that camera (cameras: "
                     f"{', '.join(sorted(cameras)) or 'none'})")


class AudioKind(SetKind):
    """Audio latent sets (vaecache.cache.kinds): one item per clip (its tensor named by its clip id), linked to the
    clip by the hash of its sources, frames and rate; a clip left out under `--audio-missing skip` holds none."""

    name = AUDIO_DIR
    what = "audio set"
    shard_prefix = "audio-"
    item_table = "clips"
    item_column = "id"
    metadata_key = "vaecache_audio"
    export_member = "audio.safetensors"
    export_description = ("each audio set's posterior mean of the audio VAE over the clip's sound (audio/<set>, "
                          "(C, T, F)); the set's record holds LTX-2's normalization constants")

    def job(self, request: AudioRequest, store: Any, manifest: dict[str, Any], ctx: Any, device: Any,
            given: Any) -> AudioJob:
        return AudioJob(request, store, manifest, ctx, device)

    def refusal(self, where: str, name: str) -> str:
        return (f"{where}: the cache already holds audio set {name!r}, made with another audio VAE, mel or camera; "
                "--replace replaces it")

    def left_out(self, row: dict[str, Any]) -> str | None:
        note = row.get("audio") or ""
        return note if note.startswith("skipped") else None

    def reencode_sets(self, cache: Any, options: Any, ctx: Any, check_type: type) -> list[Any]:
        from vaecache.distributed.context import resolve_device

        device = ctx.device if ctx is not None else resolve_device(options.device)
        return check_audio_reencode(cache, options.reencode, options.seed, device, options.tolerance, check_type,
                                    options.allow_pickle_weights)

    def check_item(self, cache: Any, clip: str, tensors: dict[str, Any], row: dict[str, Any]) -> str | None:
        records = getattr(cache, "_audio_records", None)
        if records is None:
            records = cache._audio_records = {record["id"]: record for record in cache.clip_records()}
        if row.get("inputs") != audio_inputs(records[clip], row.get("camera_asked") or None):
            return "made from other sources, frames or rate than the clip's"
        if tensors[clip].dim() != 3:
            return f"a tensor of shape {tuple(tensors[clip].shape)}, not (C, T, F)"
        return None


class AudioJob:
    """One `vaecache embed --audio-vae`: the audio VAE loaded on every rank, which all read the clip records (each
    cuts and encodes its shards' clips)."""

    def __init__(self, request: AudioRequest, store: Any, manifest: dict[str, Any], ctx: Any, device: Any) -> None:
        from vaecache.audio.mel import MelSpec
        from vaecache.audio.track import AudioSources
        from vaecache.cache.reader import CacheReader
        from vaecache.settings.clip import ClipSettings

        self.request, self.device = request, device
        self.records = {record["id"]: record for record in CacheReader(store).clip_records()}
        check_audio_camera(request.camera, self.records.values(), store.location)
        loaded = loaded_on_every_rank(ctx, lambda: load_audio_vae(request.audio_vae, device,
                                                                  request.allow_pickle_weights), "audio VAE")
        self.vae = loaded.module
        self.declared = audio_vae_classes()[type(self.vae).__name__]
        self.mel = MelSpec(**self.declared.mel(dict(self.vae.config), loaded.n_fft or request.n_fft))
        self.fingerprint = {"kind": AUDIO_DIR, "vae": audio_vae_fingerprint(self.vae), "mel": self.mel.to_record(),
                            "camera": request.camera, "missing": request.missing,
                            "stored": "posterior mean (C, T, F) in the VAE's dtype"}
        same_on_every_rank(ctx, self.fingerprint, "audio VAE")
        self.stride = ClipSettings.from_record(manifest.get("settings") or {}).sampling.frame_stride
        self.sources = AudioSources()  # each video's track and frame times, asked once for all its clips

    def plans(self) -> list[SetPlan]:
        ids = list(self.records)
        sizes = [self._bytes(self.records[clip]) for clip in ids]
        pairs = [(clip, audio_inputs(self.records[clip], self.request.camera)) for clip in ids]
        generation = generation_of({"fingerprint": self.fingerprint, "shard_bytes": self.request.shard_bytes}, pairs)
        columns = (("id", "string"), ("shard", "string"),
                   *((stat, "float64") for stat in ("min", "max", "mean", "std")),
                   ("camera", "string"), ("camera_asked", "string"), ("rate", "int32"), ("first_sample", "int64"),
                   ("samples", "int64"), ("audio", "string"), ("inputs", "string"))
        return [SetPlan(self.request.set_name, self.fingerprint, generation,
                        pack_shards(ids, sizes, 1, self.request.shard_bytes), columns, summary={"clips": len(ids)})]

    def _bytes(self, record: dict[str, Any]) -> int:
        """A clip's latents' bytes, estimated from its duration (what shards are cut by)."""
        seconds = len(record["frames"]) * self.stride / float(record.get("fps") or 1.0)
        frames = seconds * self.mel.sample_rate / self.mel.hop_length / 4
        return int(frames * int(self.vae.config.latent_channels) * self.mel.mel_bins / 4 * 4) + 1

    def follows(self, prior: dict[str, Any], plan: SetPlan) -> bool:
        return prior.get("fingerprint") == plan.fingerprint

    def reusable(self, prior: dict[str, Any], plan: SetPlan, item: str, facts: dict[str, Any]) -> bool:
        return facts.get("inputs") == audio_inputs(self.records[item], self.request.camera)

    def compute(self, number: int, todo: dict[str, list[str]]) -> tuple[dict[str, dict[str, ComputedItem]],
                                                                        list[str]]:
        found: dict[str, dict[str, ComputedItem]] = {}
        for name, clips in todo.items():
            found[name] = {clip: self._item(clip) for clip in clips}
        return found, []

    def _item(self, clip: str) -> ComputedItem:
        from vaecache.audio.latents import audio_posterior_mean
        from vaecache.audio.mel import clip_mel
        from vaecache.audio.track import record_audio
        from vaecache.cache.writer import tensor_stats

        record = self.records[clip]
        facts: dict[str, Any] = {"camera_asked": self.request.camera or "", "inputs": audio_inputs(
            record, self.request.camera)}
        try:
            if self.request.camera is not None and self.request.camera not in record["cameras"]:
                raise AudioMissingError(f"clip {clip} has no camera {self.request.camera!r} (cameras: "
                                        f"{', '.join(record['cameras'])})")
            sound = record_audio(record, self.stride, self.request.camera, self.sources)
        except AudioMissingError as exc:
            if self.request.missing == "skip":
                return ComputedItem({}, {**facts, "min": None, "max": None, "mean": None, "std": None, "camera": "",
                                         "rate": 0, "first_sample": 0, "samples": 0, "audio": f"skipped: {exc}"})
            seconds = len(record["frames"]) * self.stride / float(record["fps"])
            count = int(seconds * self.mel.sample_rate)
            mel = clip_mel(torch.zeros(self.mel.channels, count), self.mel.sample_rate, self.mel)
            mean = audio_posterior_mean(self.vae, mel)[0].contiguous().cpu()
            return ComputedItem({clip: mean}, {**facts, **tensor_stats(mean), "camera": "",
                                               "rate": self.mel.sample_rate, "first_sample": 0, "samples": count,
                                               "audio": f"silence: {exc}"})
        mean = audio_posterior_mean(self.vae, clip_mel(sound.samples, sound.rate, self.mel))[0].contiguous().cpu()
        return ComputedItem({clip: mean}, {**facts, **tensor_stats(mean), "camera": sound.camera, "rate": sound.rate,
                                           "first_sample": sound.first_sample, "samples": sound.samples.shape[1],
                                           "audio": ""})

    def extra_tables(self, plan: SetPlan, facts: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        return []

    def record(self, plan: SetPlan, facts: dict[str, dict[str, Any]],
               files: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        skipped = sum(1 for row in facts.values() if (row.get("audio") or "").startswith("skipped"))
        silenced = sum(1 for row in facts.values() if (row.get("audio") or "").startswith("silence"))
        normalization = {"latents_mean": self.vae.latents_mean.float().tolist(),
                         "latents_std": self.vae.latents_std.float().tolist(),
                         "over": self.declared.normalization_over}
        record = {"generation": plan.generation, "fingerprint": plan.fingerprint, "clips": len(facts),
                  "skipped": skipped, "silenced": silenced, "normalization": normalization,
                  "audio_vae": absolute_audio_spec(self.request.audio_vae), **files}
        named = sorted((clip, row["audio"]) for clip, row in facts.items() if row.get("audio"))[:NAMED_WITHOUT_SOUND]
        return record, {"clips": len(facts), "skipped": skipped, "silenced": silenced, "without_sound": named}


def check_audio_reencode(cache: Any, count: int, seed: int, device: Any, tolerance: float | None, check_type: type,
                         allow_pickle_weights: bool = False) -> list[Any]:
    """`verify --reencode K`: for each audio set, K of its clips with sound (chosen by `seed`) cut and encoded again
    with the audio VAE the set records (its fingerprint must be the recorded one), compared with the stored tensors:
    exact unless `tolerance` (a fraction of the stored max) is given, as the same machine computes the same bits."""
    import random

    from vaecache.audio.latents import audio_posterior_mean
    from vaecache.audio.mel import clip_mel
    from vaecache.audio.track import AudioSources, record_audio
    from vaecache.differences import describe_differences
    from vaecache.settings.clip import ClipSettings

    sets = cache.manifest.get(AUDIO_DIR) or {}
    rows = []
    records = {record["id"]: record for record in cache.clip_records()} if sets else {}
    stride = ClipSettings.from_record(cache.manifest.get("settings") or {}).sampling.frame_stride
    for name in sorted(sets):
        entry = sets[name]
        check = check_type(f"re-encode {count} clip(s) of audio set {name}")
        rows.append(check)
        fingerprint = entry.get("fingerprint") or {}
        try:
            vae = load_audio_vae(str(entry.get("audio_vae")), device, allow_pickle_weights).module
            differs = describe_differences(fingerprint.get("vae") or {}, audio_vae_fingerprint(vae))
            if differs:
                raise VaecacheError(f"the audio VAE at {entry.get('audio_vae')} is not the recorded one "
                                    f"({'; '.join(differs[:3])})")
        except (VaecacheError, OSError, ValueError, ImportError, RuntimeError) as exc:
            check.fail(f"audio set {name}: cannot load its audio VAE ({exc})")
            continue
        from vaecache.audio.mel import MelSpec

        spec = MelSpec(**{key: value for key, value in (fingerprint.get("mel") or {}).items()})
        reader = next(r for r in AUDIO.readers(cache.store, cache.manifest, "size") if r.name == name)
        clips = sorted(clip for clip in reader.clips() if not AUDIO.left_out(reader.export_facts(clip)))
        recomputed = Recomputed(check, tolerance if tolerance is not None else 0.0)
        sources = AudioSources()
        for clip in random.Random(seed).sample(clips, min(count, len(clips))):
            try:
                sound = record_audio(records[clip], stride, fingerprint.get("camera"), sources)
            except VaecacheError as exc:
                check.fail(f"audio set {name}: clip {clip}: its sound does not cut as recorded ({exc})")
                continue
            fresh = audio_posterior_mean(vae, clip_mel(sound.samples, sound.rate, spec))[0].cpu()
            recomputed.compare(f"audio set {name}: clip {clip}", "re-encodes", fresh,
                               next(iter(reader.item(clip).values())))
        recomputed.finish()
    return rows


AUDIO = register(AudioKind())


def embed_audio(request: AudioRequest, ctx: Any = None) -> list[Any]:
    """Add (or with `replace`, replace) the audio set `request.set_name` to the finished cache at `request.out`:
    each clip's sound cut to its frames, encoded by the audio VAE (vaecache.cache.embedding.embed_sets: shards split
    across ranks, committed, resumed, repaired, copied into a grown cache). Every rank returns the same outcomes."""
    from vaecache.cache.embedding import embed_sets

    return embed_sets(AUDIO, request, ctx)
