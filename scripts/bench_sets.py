#!/usr/bin/env python
"""Sets over a growing cache: what `vaecache embed` costs once the cache grew, against embedding from scratch, side
by side in one run.

A dataset of --scenes scenes (one camera, 9 frames each, every scene its own caption in an index line) is encoded
with builtin:tiny. A text set (a UMT5 of --d-model/--layers/--d-ff, random weights, one prompt per shard) and a
first-frame condition set (the cache's VAE) are embedded three ways:

- grown: encode the first --before scenes, embed both sets, then add the other scenes to the same DATA and OUT
  (encode again) and embed again: only the new prompts and clips run the encoder, the rest are copied;
- scratch: encode every scene into a new OUT and embed both sets;
- rerun: embed again into the grown cache, where nothing is to be done but to check every shard's sha256.

Prints JSON and a table: the seconds of each embed (a `python -m vaecache` child process each, start-up included),
what ran the encoder and what was copied, and whether the grown cache's set files equal the scratch run's.

    python scripts/bench_sets.py                    # CPU: 48 scenes, 40 before the growth
    python scripts/bench_sets.py --smoke            # tiny (the same code paths)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _benchlib as bl  # noqa: E402

WORK = re.compile(r"(\d+) (?:prompt|clip)\(s\) computed(?:, (\d+) copied from the set before)?")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenes", type=int, default=48)
    p.add_argument("--before", type=int, default=40, help="scenes encoded and embedded before the cache grows")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="4 scenes, 2 before, a tiny encoder")
    args = p.parse_args(argv)
    if args.smoke:
        args.scenes, args.before, args.d_model, args.layers, args.heads, args.d_ff = 4, 2, 32, 1, 4, 64
    if not 0 < args.before < args.scenes:
        p.error("--before must be between 1 and --scenes - 1")
    return args


def _vaecache(*args: Any) -> tuple[float, str]:
    """`python -m vaecache ARGS` in a child process: its seconds and output."""
    timed = bl.run_timed([sys.executable, "-m", "vaecache", *map(str, args)],
                         env=bl.child_env(threads=1, pythonpath=[Path(__file__).resolve().parent.parent]))
    bl.check(timed, " ".join(map(str, args[:2])))
    return timed.wall_s, timed.stdout + timed.stderr


ENCODE = ("--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress")


def _embed_both(out: Path, text: list[str]) -> dict[str, Any]:
    """Embed the text set, then the first-frame set: seconds and work of each."""
    found: dict[str, Any] = {}
    for name, args in (("text", text), ("condition", ["--condition", "first-frame", "--shard-size", "1"])):
        seconds, printed = _vaecache("embed", out, *args)
        work = WORK.search(printed)
        found[name] = {"s": bl.rnd(seconds, 3), "computed": int(work.group(1)) if work else 0,
                       "copied": int(work.group(2) or 0) if work else 0, "up_to_date": "up to date" in printed}
    return found


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    from bench_text import build

    from vaecache.demodata import DemoDataSpec, write_demo_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_demo_dataset(root / "data", DemoDataSpec(scenes=args.scenes, cameras=1, frames=9, height=64, width=64,
                                                       fps=10, seed=0))
        scenes = sorted((root / "data").iterdir())
        lines = [json.dumps({"id": scene.name, "cameras": {v.stem: str(v) for v in sorted(scene.glob("*.mp4"))},
                             "caption": f"scene {number}: a car turns left at the crossing"}) + "\n"
                 for number, scene in enumerate(scenes)]
        build_args = argparse.Namespace(d_model=args.d_model, heads=args.heads, d_ff=args.d_ff, layers=args.layers)
        spec = build(root / "wan", build_args)
        text = ["--text-encoder", spec, "--text-batch", "1", "--shard-size", "1"]
        index = root / "index.jsonl"

        bl.progress(f"grown: {args.before} scenes, then {args.scenes}")
        index.write_text("".join(lines[:args.before]))
        _vaecache("encode", index, "--out", root / "grown", *ENCODE)
        first = _embed_both(root / "grown", text)
        index.write_text("".join(lines))
        _vaecache("encode", index, "--out", root / "grown", *ENCODE)
        grown = _embed_both(root / "grown", text)
        bl.progress("rerun")
        rerun = _embed_both(root / "grown", text)
        bl.progress("scratch")
        _vaecache("encode", index, "--out", root / "scratch", *ENCODE)
        scratch = _embed_both(root / "scratch", text)
        equal = all(_files(root / "grown" / kind) == _files(root / "scratch" / kind) for kind in ("text", "conditions"))

    result = {"env": {"machine": bl.machine_info("cpu"), "torch": torch.__version__},
              "settings": {k: v for k, v in vars(args).items()},
              "first_embed": first, "grown": grown, "scratch": scratch, "rerun": rerun,
              "grown_vs_scratch": {name: bl.rnd(grown[name]["s"] / scratch[name]["s"], 3) for name in grown},
              "equal_to_scratch": equal}
    rows = [[f"{way} {name}", part[name]["s"], part[name]["computed"], part[name]["copied"]]
            for way, part in (("grown", grown), ("scratch", scratch), ("rerun", rerun))
            for name in ("text", "condition")]
    human = bl.table(f"embed after the cache grew from {args.before} to {args.scenes} scenes, against from scratch",
                     ["", "seconds", "computed", "copied"], rows)
    human += (f"\ngrown / scratch seconds: text {result['grown_vs_scratch']['text']}, condition "
              f"{result['grown_vs_scratch']['condition']}; the grown cache's sets equal the scratch run's: {equal}")
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
