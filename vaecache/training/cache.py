"""LatentCache: a finished cache read by a trainer, by position or clip id, each item's latents beside its sets,
its record and (for a pixel loss) the frames it was encoded from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.utils.data
from safetensors import SafetensorError

from vaecache.cache.kinds import cache_kinds, kind_hook
from vaecache.cache.layout import MANIFEST, SHARDS_DIR, VERIFY_MODES
from vaecache.cache.reader import CacheReader, record_problem
from vaecache.cache.table import CLIP_TABLE
from vaecache.errors import (
    IncompleteCacheError,
    OutputError,
    ShardChecksumError,
    ShardHeaderError,
    SourceChangedError,
    UnsafePathError,
)

if TYPE_CHECKING:
    from vaecache.audio.track import ClipAudio

MAX_OPEN_SHARDS = 64
"""Shard handles a LatentCache keeps open (memory-mapped); the least recently used closes beyond this."""


@dataclass(frozen=True)
class LatentItem:
    """One clip read back: its stored tensors by key (mean, logvar or sample; shape (cameras, C, F, H, W))
    and its clip record (as clips.parquet holds it)."""

    id: str
    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    @property
    def scene(self) -> str:
        return self.record["scene"]

    @property
    def cameras(self) -> list[str]:
        return list(self.record.get("cameras") or [])

    @property
    def frames(self) -> list[int]:
        return list(self.record.get("frames") or [])

    @property
    def fps(self) -> float | None:
        return self.record.get("fps")

    @property
    def sources(self) -> list[str]:
        return list(self.record.get("sources") or [])

    @property
    def bucket(self) -> Any:
        """The clip's size/frame bucket record, where the cache has buckets; None otherwise."""
        return self.record.get("bucket")

    @property
    def metadata(self) -> dict[str, Any]:
        """The extra keys of the clip's index line (caption, tags, ...), untouched; {} when it had none."""
        return dict(self.record.get("metadata") or {})

    @property
    def mean(self) -> torch.Tensor | None:
        return self.tensors.get("mean")

    @property
    def logvar(self) -> torch.Tensor | None:
        return self.tensors.get("logvar")


class LatentCache:
    """A finished cache opened for reading: `len`, `cache[i]` / `cache["clip id"]` -> LatentItem, iteration
    in clip-id order.

    Opening reads manifest.json (refusing unknown versions, and OUT without one: an incomplete cache) and the
    clip table's columns (Arrow, columnar: a million clips cost a few hundred MB at most). Shards open lazily,
    memory-mapped by safetensors (no pickle); the first open of each shard in a process checks it (`verify`)."""

    def __init__(self, out: str | Path, verify: str = "size", storage_options: dict[str, Any] | None = None) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.verify = verify
        self.storage_options = dict(storage_options or {})
        self._reader = CacheReader(out, self.storage_options)  # a folder, or a URL read by ranges
        self.out: Any = self._reader.out
        self.manifest = self._reader.manifest
        self._shards = self._reader.shard_files()
        self._rows = self._load_rows()
        self._ids: list[str] | None = None
        self._handles: dict[str, Any] = {}
        self._checked: set[str] = set()
        self._sets: dict[str, dict[str, Any]] | None = None
        self._kinds: list[Any] | None = None

    @property
    def text_sets(self) -> list[str]:
        """The names of the cache's text-embedding sets (vaecache embed); each item carries `text/<set>`
        (length, hidden) zero-padded as the pipeline returns it, and `text_mask/<set>` (length,) bool."""
        return sorted(self.sets().get("text") or {})

    def sets(self) -> dict[str, dict[str, Any]]:
        """Every set of the cache, by kind (vaecache.cache.kinds: text, conditions and any kind the manifest records)
        and name, each opened on first use: `sets()[kind][name].item(clip)` is what an item carries of it."""
        if self._sets is None:
            sets: dict[str, dict[str, Any]] = {}
            for kind in self.kinds():
                with kind_hook(kind, "readers"):
                    sets[kind.name] = {reader.name: reader
                                       for reader in kind.readers(self.store, self.manifest, self.verify)}
            self._sets = sets
        return self._sets

    def kinds(self) -> list[Any]:
        """The kinds of set the cache may hold (vaecache.cache.kinds): the built-in ones and those its manifest records,
        each found among the installed packages' entry points (what the manifest names is never imported); a
        KindNotInstalledError naming a kind no installed package declares."""
        if self._kinds is None:
            self._kinds = cache_kinds(self.manifest, str(self._reader.store.where(MANIFEST)))
        return self._kinds

    def text_embedding(self, clip_id: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A clip's embedding in set `name`: (the padded tensor, its mask)."""
        texts = self.sets()["text"]
        if name not in texts:
            raise KeyError(f"{self.out}: no text set {name!r} (sets: {', '.join(texts) or 'none'})")
        return texts[name].padded(clip_id)

    @property
    def condition_sets(self) -> list[str]:
        """The kinds of the cache's image-to-video condition sets (vaecache embed --condition); each item carries
        `condition/<kind>`: for first-frame and first-last (cameras, temporal_factor + C, latent frames, h, w)
        float32, the frame mask then the normalized condition latents, as WanImageToVideoPipeline.prepare_latents
        returns them per camera; for image-features (cameras, tokens, hidden) as stored."""
        return sorted(self.sets().get("conditions") or {})

    def condition(self, clip_id: str, kind: str, normalized: bool = True) -> torch.Tensor:
        """A clip's condition of `kind`: the pipeline's tensor (first-frame, first-last: the mask and the normalized
        latents; image-features: the features as stored), or with `normalized=False` the stored tensor (the
        posterior mean of the condition video, (cameras, C, F, h, w); the features)."""
        sets = self.sets()["conditions"]
        if kind not in sets:
            raise KeyError(f"{self.out}: no condition set {kind!r} (sets: {', '.join(sets) or 'none'})")
        conditions = sets[kind]
        return conditions.pipeline(clip_id) if normalized else conditions.stored(clip_id)

    def _load_rows(self) -> Any:
        import pyarrow as pa

        from vaecache.cache.table import open_table, present_columns, rows_table, schema_of, with_added_columns
        from vaecache.errors import ClipTableError

        reader, where = self._reader, self._clips_location
        if not reader.store.exists(reader.clips_name):
            raise IncompleteCacheError(f"{where}: missing (the cache is incomplete)")
        recorded = self.manifest.get("clips") or {}
        if self.verify == "sha256" and recorded.get("sha256"):
            if reader.store.sha256(reader.clips_name) != recorded["sha256"]:
                raise ShardChecksumError(f"{where}: sha256 differs from the one manifest.json records")
        if reader.version == 1:
            rows = rows_table(CLIP_TABLE, reader.clip_records())
        else:
            table = open_table(reader.table_source(reader.clips_name), CLIP_TABLE, where)
            try:
                rows = table.read(columns=present_columns(table, CLIP_TABLE))
            except (pa.ArrowException, OSError) as exc:
                raise ClipTableError(f"{where}: does not read "
                                     f"({str(exc).splitlines()[0] if str(exc) else exc})") from None
            rows = with_added_columns(rows, CLIP_TABLE).replace_schema_metadata(schema_of(CLIP_TABLE).metadata)
        if "count" in recorded and rows.num_rows != recorded["count"]:
            raise IncompleteCacheError(f"{where}: {rows.num_rows} clips, manifest.json records {recorded['count']}")
        return rows

    @property
    def store(self) -> Any:
        """The store the cache lies in (vaecache.cache.store)."""
        return self._reader.store

    @property
    def _clips_location(self) -> Any:
        return self._reader.clips_path

    # -- pickling: a DataLoader worker (spawn) reopens the cache; no handle or table crosses processes --
    def __getstate__(self) -> dict[str, Any]:
        return {"out": self.out if self._reader.store.local else str(self.out), "verify": self.verify,
                "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["out"], state["verify"], state.get("storage_options"))  # type: ignore[misc]

    def __len__(self) -> int:
        return self._rows.num_rows

    def __iter__(self) -> Iterator[LatentItem]:
        for position in range(len(self)):
            yield self[position]

    def ids(self) -> list[str]:
        """Clip ids in table order (sorted)."""
        if self._ids is None:
            self._ids = self._rows.column("id").to_pylist()
        return self._ids

    def position(self, clip_id: str) -> int:
        """The position of a clip id (the table is sorted by id: a binary search)."""
        import bisect

        ids = self.ids()
        position = bisect.bisect_left(ids, clip_id)
        if position == len(ids) or ids[position] != clip_id:
            raise KeyError(f"{self.out}: no clip {clip_id!r}")
        return position

    def record(self, key: int | str) -> dict[str, Any]:
        """A clip's record (no tensor is read)."""
        position = self.position(key) if isinstance(key, str) else self._index(key)
        return self._trusted(CLIP_TABLE.to_record(self._rows.slice(position, 1).to_pylist()[0]))

    def records(self) -> Iterator[dict[str, Any]]:
        """Every clip record in table order, batch by batch."""
        for batch in self._rows.to_batches(max_chunksize=4096):
            for row in batch.to_pylist():
                yield self._trusted(CLIP_TABLE.to_record(row))

    def _trusted(self, record: dict[str, Any]) -> dict[str, Any]:
        problem = record_problem(record)
        if problem:
            raise UnsafePathError(f"{self._clips_location}: {problem} (not a record encode writes)")
        return record

    def _index(self, position: int) -> int:
        if not isinstance(position, int) or isinstance(position, bool):
            raise TypeError(f"index a LatentCache by position (int) or clip id (str), not {type(position).__name__}")
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"clip position {position} out of range ({len(self)} clips)")
        return position

    def shapes(self) -> list[tuple[tuple[str, tuple[int, ...]], ...]]:
        """Per clip (table order), its latent shape key: ((stored key, shape), ...), from the records' tensor
        columns alone. Caches with size buckets hold several shapes; batches must not mix them."""
        keys = self._rows.column("tensor_keys").to_pylist()
        shapes = self._rows.column("tensor_shapes").to_pylist()
        return [tuple(sorted((k, tuple(s or ())) for k, s in zip(key or [], shape or [])))
                for key, shape in zip(keys, shapes)]

    def __getitem__(self, key: int | str) -> LatentItem:
        record = self.record(key)
        tensors = self.tensors_of(record)
        for kind in self.kinds():
            for name, reader in self.sets()[kind.name].items():
                with kind_hook(kind, "item", name, f"clip {record['id']}", passing=(KeyError,)):
                    if self.verify != "none" and hasattr(reader, "check_record"):
                        reader.check_record(record)  # the item is the clip's own (text: its caption's prompt)
                    tensors.update(reader.item(record["id"]))
        return LatentItem(record["id"], tensors, record)

    def source_frames(self, key: int | str | dict[str, Any], indexed: bool = True) -> torch.Tensor:
        """A clip's frames as encode saw them: (cameras, 3, T, H, W) float32 in [-1, 1], the same frame indices,
        resize and fit (its bucket's size), decoder backend and value range as the VAE's input and a decoder's
        output: the targets of a pixel loss. Read from the recorded sources; a source whose size, mtime (or sha256,
        where recorded) differs from what the record says raises SourceChangedError, as its latents are stale.
        `indexed`: seek by the frame index the record keeps (`source_timelines`, checked against the file where it
        decodes); False finds the frames by the video's own packets (what verify --reencode checks the index by)."""
        from vaecache.cache.provenance import changed_source
        from vaecache.settings.clip import ClipSettings
        from vaecache.video.backends import backend_for_record
        from vaecache.video.dataset import ViewDecoder, recorded_timelines, recorded_views

        record = key if isinstance(key, dict) else self.record(key)
        changed = changed_source(record)
        if changed is not None:
            path, camera, change = changed
            raise SourceChangedError(f"{path} ({camera} of clip {record['id']}): {change} since it was encoded; "
                                     "its latents no longer match it")
        settings = self.manifest.get("settings") or {}
        clip = ClipSettings.from_record(settings)
        bucket = record.get("bucket") if isinstance(record.get("bucket"), dict) else None
        size = (bucket["height"], bucket["width"]) if bucket else (clip.height, clip.width)
        decoder = ViewDecoder(*size, fit=clip.fit, backend=backend_for_record(settings.get("decoder")),
                              max_pixels=clip.sampling.max_frame_pixels)
        try:
            timelines = recorded_timelines(record) if indexed else [None] * len(record["cameras"])
            return torch.stack([decoder.decode(source, frames, size, timeline=timeline) for (source, frames), timeline
                                in zip(recorded_views(record), timelines)])
        finally:
            decoder.close()

    def source_audio(self, key: int | str | dict[str, Any], camera: str | None = None) -> ClipAudio:
        """The samples of a clip's sound, cut from its source video exactly to its frames (vaecache.audio.track): the
        window from the clip's first frame's presentation time for its frames over its frame rate (the source's
        over the frame stride), at the audio stream's own rate and channels, float32, as FFmpeg decodes the stream.
        `camera`: whose video's audio (default: the first camera whose video has an audio track). A source changed
        since the clip was encoded raises SourceChangedError; no audio track, or one that does not cover the window,
        AudioMissingError naming the file."""
        from vaecache.audio.track import record_audio
        from vaecache.settings.clip import ClipSettings

        record = key if isinstance(key, dict) else self.record(key)
        stride = ClipSettings.from_record(self.manifest.get("settings") or {}).sampling.frame_stride
        return record_audio(record, stride, camera)

    def tensors_of(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A clip's stored tensors, read from its (lazily opened, checked once) shard."""
        handle = self._open(self._trusted(record)["shard"])
        try:
            return {key: handle.get_tensor(entry["name"]) for key, entry in record["tensors"].items()}
        except (SafetensorError, OSError, KeyError, OutputError) as exc:
            raise ShardHeaderError(f"{self.out / SHARDS_DIR / record['shard']}: cannot read clip {record['id']} "
                                   f"({exc})") from None

    def _open(self, shard: str) -> Any:
        handle = self._handles.pop(shard, None)
        if handle is None:
            name = self._reader.shard_name(f"{SHARDS_DIR}/{shard}")
            if shard not in self._checked:
                self._check(name)
                self._checked.add(shard)
            handle = self._reader.store.shard(name)
            while len(self._handles) >= MAX_OPEN_SHARDS:
                self._handles.pop(next(iter(self._handles)))
        self._handles[shard] = handle  # most recently used last
        return handle

    def _check(self, name: str) -> None:
        store, where = self._reader.store, self._reader.store.where(name)
        entry = self._shards.get(name)
        if entry is None:
            raise ShardChecksumError(f"{where}: not listed in manifest.json")
        if self.verify == "none":
            return
        try:
            size = store.size(name)
        except OSError as exc:
            raise ShardChecksumError(f"{where}: unreadable ({exc.strerror or exc})") from None
        except OutputError as exc:
            raise ShardChecksumError(str(exc)) from None
        if size != entry["bytes"]:
            raise ShardChecksumError(f"{where}: {size} bytes, manifest.json records {entry['bytes']}")
        if self.verify == "sha256":
            found = store.sha256(name)
            if found != entry.get("sha256"):
                raise ShardChecksumError(f"{where}: sha256 {found[:16]}..., manifest.json records "
                                         f"{str(entry.get('sha256'))[:16]}...")

    def close(self) -> None:
        self._handles.clear()

    # -- latent space ------------------------------------------------------------------------------------
    @property
    def normalization(self) -> dict[str, Any]:
        """The VAE's latent normalization as recorded at encode time (manifest `vae.normalization`)."""
        return dict((self.manifest.get("vae") or {}).get("normalization") or {})

    def _constants(self, z: torch.Tensor) -> tuple[Any, Any, float]:
        """(shift, divisor, scale) such that normalize(z) = (z - shift) * scale / divisor, broadcast over the
        channel axis (dim -4 of (..., C, F, H, W)); vaecache.cache.normalization reads the recorded formula."""
        from vaecache.cache.normalization import normalization_constants

        channel_count = z.shape[-4] if z.dim() >= 4 else 1
        constants = normalization_constants(self.normalization, channel_count, self.out / "manifest.json")
        if not constants.per_channel:
            return constants.shift[0], 1.0, constants.scale
        if z.dim() < 4:
            raise ValueError(f"z {tuple(z.shape)} has no channel axis at dim -4")

        def channels(values: tuple[float, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1, 1).to(z.device)

        return channels(constants.shift), channels(constants.divisor), constants.scale

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """Latents as the diffusion model sees them, by the recorded formula (e.g. Wan: (z - mean) / std per
        channel; HunyuanVideo: z * scaling_factor). Computed in float32, returned in z's dtype, in the pipeline's
        own arithmetic: Wan's multiplies by the float32 reciprocal of latents_std (`latents_std = 1.0 /
        torch.tensor(...)`, pipeline_wan_i2v.py prepare_latents), which a division differs from by an ulp."""
        shift, divisor, scale = self._constants(z)
        if self._wan_reciprocal:
            return ((z.float() - shift) * (1.0 / divisor)).to(z.dtype)
        return ((z.float() - shift) * scale / divisor).to(z.dtype)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """The inverse of normalize: what the VAE's decoder takes (Wan: `latents / latents_std + latents_mean` with
        the reciprocal as latents_std, as pipeline_wan.py decodes)."""
        shift, divisor, scale = self._constants(z)
        if self._wan_reciprocal:
            return (z.float() / (1.0 / divisor) + shift).to(z.dtype)
        return (z.float() * divisor / scale + shift).to(z.dtype)

    @property
    def _wan_reciprocal(self) -> bool:
        return self.normalization.get("formula") == "(z - latents_mean) / latents_std"

    @staticmethod
    def sample(item: LatentItem | dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
        """A draw from the posterior: mean + exp(0.5 * logvar) * eps (float32 arithmetic, mean's dtype).
        A cache stored with --store sample returns its stored sample; --store mean returns the mean."""
        tensors = item.tensors if isinstance(item, LatentItem) else item
        if "mean" not in tensors:
            if "sample" in tensors:
                return tensors["sample"]
            raise KeyError("the item holds neither mean nor sample")
        mean = tensors["mean"]
        if "logvar" not in tensors:
            return mean
        eps = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device=mean.device)
        return (mean.float() + torch.exp(0.5 * tensors["logvar"].float()) * eps).to(mean.dtype)
