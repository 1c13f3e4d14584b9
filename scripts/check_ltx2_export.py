"""Check a `vaecache export --format ltx2` with LTX-2's own trainer code, from a checkout you point at.

    python scripts/check_ltx2_export.py --ltx-src path/to/LTX-2 EXPORT [--cache OUT] [--json FILE]

LTX-2's trainer (github Lightricks/LTX-2, packages/ltx-trainer) is not a dependency of vaecache and none of its
code is copied here: this script imports `ltx_trainer.datasets` from CHECKOUT/packages/ltx-trainer/src (it needs
rich and einops) and:

1. builds its `PrecomputedDataset(EXPORT, ["latents", "audio_latents"])`, as a training run with audio does, and
   `PrecomputedDataset(EXPORT, ["latents"])`, as a video-only run does; where the export holds conditions (an LTX-2
   text set), also `PrecomputedDataset(EXPORT, {"latents": "latent_conditions", "conditions": "text_conditions",
   "audio_latents": "audio_latents"})` read through a torch DataLoader, as its training strategies read it;
2. reads every sample through its `__getitem__` and checks each against the cache the export came from: the video
   latents equal ltx-core's encoder's normalization of the clip's stored mean (`vaecache.export.ltx2.ltx_normalized`),
   `num_frames`/`height`/`width` their shape, `fps` the clip's rate; the audio latents equal LTX-2's normalization
   of the clip's audio set item over the packed features; a clip the audio set skipped is left out by the trainer
   where audio latents are asked for, and kept where they are not; the text conditions equal the text set's video and
   audio features and left-padded mask of the sample's own clip (`vaecache.export.ltx2.ltx2_conditions`).

It prints a table and JSON (`--json FILE`) and exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vaecache import LatentCache  # noqa: E402
from vaecache.export.ltx2 import ltx2_conditions, ltx_normalized  # noqa: E402
from vaecache.models._ltx2_audio import normalize as normalize_audio_latents  # noqa: E402
from vaecache.settings.clip import ClipSettings  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="A folder written by vaecache export --format ltx2.")
    parser.add_argument("--ltx-src", type=Path, required=True, help="An LTX-2 checkout (packages/ltx-trainer/src).")
    parser.add_argument("--cache", type=Path, help="The cache exported (default: export.json's source).")
    parser.add_argument("--json", type=Path, help="Also write the result here.")
    return parser.parse_args(argv)


def check(export: Path, ltx_src: Path, cache_dir: Path | None = None) -> dict[str, Any]:
    sys.path.insert(0, str(ltx_src / "packages" / "ltx-trainer" / "src"))
    from ltx_trainer.datasets import PrecomputedDataset

    record = json.loads((export / "export.json").read_text())
    cache = LatentCache(cache_dir or record["source"]["cache"])
    audio_name = record.get("audio_set")
    constants = (cache.manifest.get("audio") or {}).get(audio_name, {}).get("normalization") if audio_name else None
    stride = ClipSettings.from_record(cache.manifest.get("settings") or {}).sampling.frame_stride
    names = {json.loads(line)["name"]: json.loads(line) for line in (export / "index.jsonl").read_text().splitlines()}
    problems: list[str] = []
    result: dict[str, Any] = {"export": str(export), "samples": len(names), "checked": {}}
    text_name = record.get("text_set")
    texts = cache.sets()["text"][text_name] if text_name else None
    sources: dict[str, Any] = {"video+audio": ["latents", "audio_latents"], "video": ["latents"]} if audio_name else {
        "video": ["latents"]}
    if text_name:
        sources["video+audio+text"] = {"latents": "latent_conditions", "conditions": "text_conditions",
                                       **({"audio_latents": "audio_latents"} if audio_name else {})}
    for label, wanted in sources.items():
        dataset = PrecomputedDataset(str(export), wanted)
        keys = wanted if isinstance(wanted, dict) else {source: source for source in wanted}
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, shuffle=False,
                                             collate_fn=lambda batch: batch[0])  # the strategies' per-sample view
        seen = 0
        for index, sample in enumerate(loader):
            sample = {source: sample[key] for source, key in keys.items()}
            name = str(dataset.sample_files[keys["latents"]][index].with_suffix(""))
            entry = names[name]
            position = cache.ids().index(entry["clip"])
            item = cache[position].tensors
            view = list(cache.record(entry["clip"])["cameras"]).index(entry["camera"])
            video = sample["latents"]
            expected = ltx_normalized(item["mean"], cache.normalization)[view]
            if not torch.equal(video["latents"], expected):
                problems.append(f"{name}: video latents differ from the cache's normalized mean")
            if (video["num_frames"], video["height"], video["width"]) != tuple(expected.shape[1:]):
                problems.append(f"{name}: recorded shape {video['num_frames'], video['height'], video['width']}")
            if video["fps"] != float(cache.record(entry["clip"])["fps"]) / stride:
                problems.append(f"{name}: fps {video['fps']}")
            if "audio_latents" in wanted:
                sound = item.get(f"audio/{audio_name}")
                if sound is None:
                    problems.append(f"{name}: the trainer read a sample the audio set skipped")
                else:
                    normalized = normalize_audio_latents(sound.float()[None], torch.tensor(constants["latents_mean"]),
                                                         torch.tensor(constants["latents_std"]))[0]
                    if not torch.equal(sample["audio_latents"]["latents"], normalized):
                        problems.append(f"{name}: audio latents differ from the audio set's normalized mean")
            if "conditions" in wanted:
                expected_text = ltx2_conditions(texts, entry["clip"])
                read = sample["conditions"]
                if read.keys() != expected_text.keys() or any(
                        read[key].dtype != tensor.dtype or not torch.equal(read[key], tensor)
                        for key, tensor in expected_text.items()):
                    problems.append(f"{name}: text conditions differ from text set {text_name!r}'s for its clip")
            seen += 1
        expected_count = sum(1 for entry in names.values() if entry.get("audio")) if "audio_latents" in wanted else len(
            names)
        if seen != expected_count:
            problems.append(f"{label}: the trainer reads {seen} samples, {expected_count} expected")
        result["checked"][label] = seen
    result["problems"] = problems
    result["ok"] = not problems
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = check(args.export, args.ltx_src, args.cache)
    print(f"{'sources':<14} samples read by LTX-2's PrecomputedDataset and checked", file=sys.stderr)
    for label, count in result["checked"].items():
        print(f"{label:<14} {count}", file=sys.stderr)
    for problem in result["problems"][:20]:
        print(f"DIFFERS: {problem}", file=sys.stderr)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
