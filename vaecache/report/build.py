"""`vaecache report OUT`: the page a person reads before training on a cache, written as a folder (index.html, its
images and sounds, failures.csv, report.json) that opens from disk or from an object store's static hosting.

Bounded time and memory at any cache size: the clip, failure and set tables are streamed a column at a time
(tables.py, failures.py, text.py); only the sampled clips are read from their shards and decoded (clips.py), within
a decode budget (decodable.py). The folder is written beside its destination and renamed into place, replacing a
report written there before, never another folder."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vaecache.errors import NormalizationError, UsageError, VaecacheError, first_line

REPORT_FORMAT = "vaecache-report"
"""report.json's `format`: what marks a folder as a report this command may replace."""
REPORT_VERSION = 1
PAGE, SUMMARY, FAILURES_CSV = "index.html", "report.json", "failures.csv"


@dataclass(frozen=True)
class ReportSettings:
    """What `write_report` samples, decodes and shows."""

    clips: int = 12
    """Clips sampled, decoded and shown (0: the tables alone)."""
    seed: int = 0
    """Seed of the sample: the same cache, clips and seed show the same clips."""
    device: str = "auto"
    """Where the sampled clips are decoded: auto (cuda when there is one), cpu, cuda, cuda:N."""
    decode_budget_s: float = 300.0
    """Seconds the decoding of the sample may take (estimated per clip before it starts, vaecache.report.decodable)."""
    strip_frames: int = 8
    """Frames of each clip a strip shows, spread evenly over it."""
    scale_sample_clips: int = 64
    """Clips whose tensors are read for the scale section of a cache written before per-channel statistics."""

    def __post_init__(self) -> None:
        for name in ("clips", "seed", "strip_frames", "scale_sample_clips"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.strip_frames < 1 or self.scale_sample_clips < 1:
            raise UsageError("strip_frames and scale_sample_clips must be at least 1")
        if not isinstance(self.decode_budget_s, (int, float)) or not self.decode_budget_s >= 0:
            raise UsageError(f"--decode-budget must be a number of seconds >= 0, got {self.decode_budget_s!r}")


@dataclass(frozen=True)
class WrittenReport:
    """Where the report went and what it found (report.json holds the same)."""

    folder: Path
    page: Path
    summary: dict[str, Any]
    seconds: float


def default_report_dir(out: Any) -> Path:
    """`<OUT's last name>-report` in the current folder (s3://bucket/runs/drive -> drive-report)."""
    name = str(out).rstrip("/").rsplit("/", 1)[-1] or "cache"
    return Path(f"{name}-report")


def check_report_dir(folder: Path) -> None:
    """Refuse a destination that is a file, lies in a missing folder, or is a folder other than a report (UsageError):
    a report replaces only a report."""
    parent = folder.parent if str(folder.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{folder}: folder {parent} does not exist")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder}: is a file; --out names the report's folder")
    if folder.is_dir() and any(folder.iterdir()) and not _is_report(folder):
        raise UsageError(f"{folder}: a folder that holds something other than a vaecache report; name a new or "
                         "empty folder (a report is replaced, nothing else is)")


def _is_report(folder: Path) -> bool:
    try:
        return json.loads((folder / SUMMARY).read_text()).get("format") == REPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write_report(out: Any, report_dir: Path | None = None, settings: ReportSettings | None = None,
                 storage_options: dict[str, Any] | None = None,
                 on_step: Callable[[str], None] | None = None) -> WrittenReport:
    """Write the report of cache `out` (a folder or a URL) into `report_dir` (default: default_report_dir(out))."""
    from vaecache.cache.reader import CacheReader
    from vaecache.cache.store import open_store
    from vaecache.report.page import require_jinja2
    from vaecache.report.plots import require_matplotlib
    from vaecache.storage import set_data_storage_options

    require_matplotlib()
    require_jinja2()
    started = time.perf_counter()
    settings = settings or ReportSettings()
    say = on_step or (lambda message: None)
    storage_options = dict(storage_options or {})
    store = open_store(out, storage_options)
    store.check_present()
    folder = Path(report_dir) if report_dir is not None else default_report_dir(store.location)
    check_report_dir(folder)
    if settings.clips:
        from vaecache.distributed.context import resolve_device

        resolve_device(settings.device)  # a --device typo is a usage error before any work
    reader = CacheReader(store)
    set_data_storage_options(storage_options)  # the recorded sources at URLs are read as encode read them
    staging = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "images").mkdir(parents=True)
    (staging / "sounds").mkdir()
    try:
        summary = _build(reader, staging, settings, say)
        for media in ("images", "sounds"):
            if not any((staging / media).iterdir()):
                (staging / media).rmdir()
        summary["seconds"] = round(time.perf_counter() - started, 3)
        (staging / SUMMARY).write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        _replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return WrittenReport(folder, folder / PAGE, summary, summary["seconds"])


def _build(reader: Any, folder: Path, settings: ReportSettings, say: Callable[[str], None]) -> dict[str, Any]:
    from vaecache import __version__
    from vaecache.report.clips import clip_card, open_decoding, sample_set_rows
    from vaecache.report.contents import contents_section
    from vaecache.report.failures import failures_section
    from vaecache.report.page import render_page
    from vaecache.report.tables import records_at, sample_positions, summarize_clip_table
    from vaecache.report.text import caption_section, clip_prompts, text_set_section

    say("reading the clip table")
    table = summarize_clip_table(reader)
    say(f"{table.clips:,} clips in {table.scenes:,} scenes; reading the failures")
    failures = failures_section(reader, folder / FAILURES_CSV)
    contents = contents_section(reader, table, failures.count)
    say("counting prompts")
    text_sets = sorted(reader.manifest.get("text") or {})
    texts = [text_set_section(reader, name) for name in text_sets] or [caption_section(reader)]
    say("measuring the scale of the latents")
    scale, scale_problem = _scale(reader, table, settings)
    records = records_at(reader, sample_positions(table.clips, settings.clips, settings.seed))
    decoding = None
    cards = []
    if records:
        say(f"loading the VAE to decode {len(records)} sampled clip(s)")
        channels = next((shape[1] for shape in table.shapes.counts if len(shape) > 1), None)
        decoding = open_decoding(reader, settings.device, settings.decode_budget_s, channels)
        if decoding.reason:
            say(decoding.reason)
        prompts = clip_prompts(reader, records)
        set_rows = sample_set_rows(reader, [record["id"] for record in records])
        for number, record in enumerate(records, 1):
            say(f"clip {number}/{len(records)}: {record['id']}")
            card = clip_card(number, record, reader, decoding, folder, settings.strip_frames, set_rows)
            card.caption, card.prompts = prompts[record["id"]].caption, prompts[record["id"]].sets
            cards.append(card)
    say("drawing the charts and the page")
    charts = _charts(folder, contents, failures, scale)
    psnrs = [view.psnr_db for card in cards for view in card.cameras if view.psnr_db is not None]
    summary = {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "cache": str(reader.out), "vaecache": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sample": {"clips": len(cards),
                   "decoded": sum(1 for card in cards if any(view.reconstructed for view in card.cameras)),
                   "mean_psnr_db": round(sum(psnrs) / len(psnrs), 2) if psnrs else None},
        "settings": {"clips": settings.clips, "seed": settings.seed, "device": settings.device,
                     "decode_budget_s": settings.decode_budget_s},
        "contents": contents.to_json(), "failures": failures.to_json(),
        "scale": scale.to_json() if scale is not None else {"problem": scale_problem},
        "decoder": {"reason": decoding.reason if decoding else "no clip sampled",
                    "load_s": round(decoding.loaded_s, 3) if decoding else 0.0,
                    "decode_s": round(sum(card.decode_s for card in cards), 3),
                    "seconds_per_megapixel": (round(decoding.budget.seconds_per_pixel * 1e6, 4)
                                              if decoding and decoding.budget else None)},
        "clips": [card.to_json() for card in cards], "text": [section.to_json() for section in texts],
        "charts": charts,
    }
    (folder / PAGE).write_text(render_page(summary, contents=contents, failures=failures, scale=scale,
                                           scale_problem=scale_problem, cards=cards, texts=texts, charts=charts,
                                           decoding=decoding), encoding="utf-8")
    return summary


def _scale(reader: Any, table: Any, settings: ReportSettings) -> tuple[Any, str | None]:
    """The scale section, from every clip's recorded channel statistics, or (a cache written before them) from a
    sample of clips' tensors; and why there is none."""
    from vaecache.cache.normalization import normalization_constants
    from vaecache.report.scale import judge_scale, tensor_moments
    from vaecache.report.tables import records_at, sample_positions

    key = table.scale_key
    if key is None:
        return None, "the cache stores neither a posterior mean nor a sample"
    if table.moments is not None and table.with_channel_stats == table.clips:
        mean, std = table.moments.moments()
        source = f"every clip's recorded per-channel statistics ({table.clips:,} clips, exact)"
        exact = True
    else:
        records = records_at(reader, sample_positions(table.clips, settings.scale_sample_clips, settings.seed))
        tensors = (reader.store.shard(reader.shard_of(record)).get_tensor(record["tensors"][key]["name"])
                   for record in records if key in record.get("tensors", {}))
        try:
            mean, std = tensor_moments(tensors)
        except (VaecacheError, OSError, ValueError, KeyError) as exc:
            return None, f"the sampled clips' tensors do not read ({first_line(exc)})"
        source = (f"a sample of {len(records):,} of the {table.clips:,} clips' stored tensors: "
                  f"{table.with_channel_stats:,} clip records hold per-channel statistics (records written before "
                  "vaecache recorded them have none), so the figures are an estimate from that sample")
        exact = False
    where = reader.store.where("manifest.json")
    try:
        constants = normalization_constants((reader.manifest.get("vae") or {}).get("normalization") or {}, len(mean),
                                            where)
    except (NormalizationError, ValueError) as exc:
        return None, f"the normalization cannot be applied: {first_line(exc)}"
    return judge_scale(mean, std, constants, source=source, exact=exact, latent_key=key), None


def _charts(folder: Path, contents: Any, failures: Any, scale: Any) -> dict[str, str]:
    """Draw the page's charts; their paths relative to the report folder, by name."""
    from vaecache.report.plots import bar_chart, histogram, scale_chart

    charts: dict[str, str] = {}

    def path(name: str) -> Path:
        charts[name] = f"images/{name}.png"
        return folder / charts[name]

    buckets = [b for b in contents.buckets if b["clips"]]
    bar_chart(path("buckets"), [b["name"] for b in buckets] or ["none"], [b["clips"] for b in buckets] or [0],
              title="clips per bucket (height x width x frames)", xlabel="clips", horizontal=len(buckets) > 8)
    lengths = contents.lengths
    seconds = [row for row in lengths if row["seconds"] is not None]
    if len({row["seconds"] for row in seconds}) > 1:  # one duration: the table says it
        histogram(path("durations"), [row["seconds"] for row in seconds], [row["clips"] for row in seconds],
                  title="clip durations (frames / fps)", xlabel="seconds")
    if len(contents.cameras) > 1:
        bar_chart(path("cameras"), [name for name, _ in contents.cameras], [n for _, n in contents.cameras],
                  title="clips per camera", xlabel="clips", horizontal=True)
    if failures.groups:
        bar_chart(path("failures"), [g.kind for g in failures.groups[:20]], [g.count for g in failures.groups[:20]],
                  title="skipped inputs by reason", xlabel="inputs", horizontal=True)
    if scale is not None:
        from vaecache.report.scale import BAND

        scale_chart(path("scale"), scale.channels, BAND)
    return charts


def _replace(staging: Path, folder: Path) -> None:
    """Put the staged report at `folder`: its files fsynced, renamed into place, a report there before renamed aside
    and removed."""
    from vaecache.cache.io import fsync_dir

    for path in sorted(staging.rglob("*")):  # whole on disk before the folder is renamed into place
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for path in [*sorted(p for p in staging.rglob("*") if p.is_dir()), staging]:
        fsync_dir(path)
    aside = folder.parent / f".{folder.name}.old-{os.getpid()}"
    had = folder.exists()
    if had:
        os.replace(folder, aside)
    os.replace(staging, folder)
    fsync_dir(folder.parent)
    if had:
        shutil.rmtree(aside, ignore_errors=True)


__all__ = ["ReportSettings", "WrittenReport", "check_report_dir", "default_report_dir", "write_report"]
