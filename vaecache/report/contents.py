"""The report's contents section: what the cache holds, from the manifest and the clip table's summary (no shard is
read): counts, cameras, buckets and clip lengths, bytes, the VAE and its fingerprint, the settings, and every set
with its coverage of the clips."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vaecache.cache.inspect import set_summaries
from vaecache.cache.reader import CacheReader
from vaecache.report.tables import ClipTableSummary

SET_COUNTS_SHOWN = ("prompts", "empty_prompt_clips", "truncated_prompts", "views", "skipped", "silenced")
"""A set record's counts the page shows beside its clips, where the record has them (text, conditions, audio)."""
MODEL_SPECS = ("spec", "audio_vae", "image_encoder")
"""A set record's keys naming the model that made it (text, audio, image-features sets)."""


@dataclass
class SetRow:
    kind: str
    name: str
    clips: int | None
    coverage: str
    bytes: int
    shards: int
    made_with: str
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class ContentsSection:
    facts: list[tuple[str, str]]
    """(what, value) rows of the glance table."""
    vae: list[tuple[str, str]]
    settings: list[tuple[str, str]]
    buckets: list[dict[str, Any]]
    lengths: list[dict[str, Any]]
    cameras: list[tuple[str, int]]
    sets: list[SetRow]
    bytes: dict[str, int]

    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "facts": dict(self.facts), "vae": dict(self.vae),
                "settings": dict(self.settings), "buckets": self.buckets, "lengths": self.lengths,
                "cameras": dict(self.cameras), "bytes": self.bytes, "sets": [vars(row) for row in self.sets]}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def contents_section(reader: CacheReader, summary: ClipTableSummary, failures: int) -> ContentsSection:
    manifest = reader.manifest
    vae = manifest.get("vae") or {}
    counts = manifest.get("counts") or {}
    shards = manifest.get("shards") or []
    sets = set_summaries(manifest)
    table_bytes = {}
    for kind, name in (("clip table", reader.clips_name), ("failure table", reader.failures_name)):
        try:
            table_bytes[kind] = int(reader.store.size(name))
        except (FileNotFoundError, OSError):
            continue
    size_bytes = {"shards": sum(int(s.get("bytes") or 0) for s in shards), **table_bytes,
                  "sets": sum(entry["bytes"] for named in sets.values() for entry in named.values())}
    planned = counts.get("planned_clips")
    facts = [("clips", f"{summary.clips:,}" + (f" of {planned:,} planned" if planned else "")),
             ("scenes", f"{summary.scenes:,}"),
             ("cameras", ", ".join(f"{name} ({count:,})" for name, count in summary.cameras.most_common(12))
              + (f", and {len(summary.cameras.counts) - 12} more" if len(summary.cameras.counts) > 12 else "")),
             ("cameras per clip", ", ".join(f"{n} ({count:,} clips)" for n, count in
                                            sorted(summary.cameras_per_clip.counts.items()))),
             ("views (clips x cameras)", f"{summary.views:,}"), ("frames (all cameras)", f"{summary.frames:,}"),
             ("skipped inputs", f"{failures:,}"), ("shards", f"{len(shards):,}"),
             ("format", f"{manifest.get('format')} version {manifest.get('format_version')}, written "
                        f"{manifest.get('created_at')} by vaecache {(manifest.get('producer') or {}).get('vaecache')}")]
    vae_rows = [("family", str(vae.get("family"))), ("spec", str(vae.get("spec"))),
                ("weights sha256", str(vae.get("weights_sha256"))),
                ("fingerprint sha256", str(manifest.get("fingerprint_sha256"))),
                ("trained", "no: random weights (its latents mean nothing)" if vae.get("untrained") else "yes"),
                ("precision", _text(vae.get("precision"))), ("frame rule", _text(manifest.get("frame_rule"))),
                ("normalization", _text(vae.get("normalization"))), ("latent", _text(manifest.get("latent")))]
    settings = [(str(key), _text(value)) for key, value in sorted((manifest.get("settings") or {}).items())]
    buckets = [{"name": b.get("name"), "clips": b.get("clips", 0), "views": b.get("views", 0),
                "shape": b.get("shape")} for b in manifest.get("buckets") or []]
    if not buckets:
        settings_record = manifest.get("settings") or {}
        buckets = [{"name": f"{settings_record.get('height')}x{settings_record.get('width')}x"
                            f"{settings_record.get('num_frames')}", "clips": summary.clips, "views": summary.views,
                    "shape": (manifest.get("latent") or {}).get("shape")}]
    by_length = sorted(summary.lengths.counts.items(), key=lambda item: (item[0][0], item[0][1] or 0))
    lengths = [{"frames": frames, "fps": fps, "seconds": round(frames / fps, 3) if fps else None, "clips": count}
               for (frames, fps), count in by_length]
    rows = []
    for kind, named in sets.items():
        for name, entry in named.items():
            record = (manifest.get(kind) or {}).get(name) or {}
            clips = entry.get("clips") if isinstance(entry.get("clips"), int) else None
            held = (clips or 0) - int(record.get("skipped") or 0)
            coverage = (f"{held:,} of {summary.clips:,} clips ({100 * held / summary.clips:.1f} %)"
                        if clips is not None and summary.clips else "?")
            counts = {key: int(record[key]) for key in SET_COUNTS_SHOWN if isinstance(record.get(key), int)}
            rows.append(SetRow(kind, name, clips, coverage, int(entry["bytes"]), int(entry["shards"]),
                               _made_with(record), counts))
    return ContentsSection(facts, vae_rows, settings, buckets, lengths, summary.cameras.most_common(64), rows,
                           size_bytes, {"clips": summary.clips, "scenes": summary.scenes, "views": summary.views,
                                        "frames": summary.frames, "failures": failures})


def _made_with(record: dict[str, Any]) -> str:
    """What made a set, in a few words: its spec or its fingerprint's class and reference."""
    fingerprint = record.get("fingerprint") if isinstance(record.get("fingerprint"), dict) else {}
    model = fingerprint.get("vae") if isinstance(fingerprint.get("vae"), dict) else {}
    parts = [*(record.get(key) for key in MODEL_SPECS), fingerprint.get("class"), model.get("class"),
             model.get("family"), fingerprint.get("reference"), fingerprint.get("stored")]
    return "; ".join(dict.fromkeys(str(part) for part in parts if isinstance(part, str) and part)) or "?"


__all__ = ["ContentsSection", "SetRow", "contents_section"]
