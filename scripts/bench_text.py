#!/usr/bin/env python
"""Text embeddings: vaecache's prompt embedding against a plain loop over diffusers' own, side by side in one run.

A multi-camera dataset's captions: --scenes scenes x --cameras cameras x --clips clips per scene, every clip of a
scene sharing the scene's caption (as a rig's sidecar or an index line gives it), a --empty fraction of scenes
without a caption. Two ways to embed them with the same UMT5 encoder (random weights, --d-model/--layers; the
published umT5-XXL is 4096/24), the same batch size and length 512:

- reference: what a trainer's caching loop does, one embedding per item (clip x camera), through diffusers'
  `WanPipeline._get_t5_prompt_embeds`, stored as the pipeline returns it (512 rows);
- vaecache: `vaecache.text` as `vaecache embed` runs it: cleaned, deduplicated, the distinct prompts in fixed-shape
  batches, rows trimmed to the prompt.

Prints JSON and a table: items and prompts per second, the dedupe ratio, bytes per clip stored, the bytes a
padded store would take, and the process's peak RSS (the encoder's memory on CPU; CUDA peak on a GPU).

    python scripts/bench_text.py                     # CPU, a mid-size UMT5
    python scripts/bench_text.py --device cuda --d-model 4096 --layers 24 --heads 64 --d-ff 10240 --dtype bf16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _benchlib as bl  # noqa: E402

WORDS = ("a red car drives down a wet street at night the robot arm picks up blue cube places it in bowl front "
         "camera view of highway with trucks rain pedestrians cross crosswalk while bus waits dog runs on beach "
         "sunset waves background close-up hands folding towel wooden table").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--scenes", type=int, default=24)
    p.add_argument("--cameras", type=int, default=6)
    p.add_argument("--clips", type=int, default=4, help="clips per scene")
    p.add_argument("--empty", type=float, default=0.25, help="fraction of scenes without a caption")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--smoke", action="store_true", help="tiny model and dataset (the same code paths)")
    p.add_argument("--plan-clips", type=int, default=0, help="instead: plan this many clips' captions (cleaned, "
                   "keyed, deduplicated by vaecache.text.sets.plan_prompts, what rank 0 of an embed does before "
                   "embedding), one caption per scene of 6 clips, --plan-distinct distinct; seconds and peak RSS")
    p.add_argument("--plan-distinct", type=int, default=20000)
    return p.parse_args(argv)


def plan_memory(args: argparse.Namespace) -> dict[str, Any]:
    """The planning of --plan-clips clips in this process: seconds and the peak RSS it added."""
    from vaecache.models.base import wan_prompt_clean
    from vaecache.text.sets import clip_captions, plan_prompts

    def records():
        for i in range(args.plan_clips):
            scene = i // 6
            yield {"id": f"scene_{scene:07d}/cam_{i % 6}/000000-000080",
                   "metadata": {"caption": f"a red car, number {scene % args.plan_distinct}, drives down a wet street "
                                           "at night while the camera pans left"}}

    before = bl.maxrss_mb()
    started = time.perf_counter()
    clip_keys: list[tuple[str, str]] = []
    cleaned = plan_prompts(clip_captions(records(), "caption", None), wan_prompt_clean, clip_keys)
    seconds = time.perf_counter() - started
    added = bl.maxrss_mb() - before
    result = {"benchmark": "bench_text planning", "env": {"machine": bl.machine_info("cpu")},
              "clips": len(clip_keys), "distinct_prompts": len(cleaned), "seconds": bl.rnd(seconds, 3),
              "clips_per_s": bl.rnd(len(clip_keys) / seconds, 1), "peak_rss_added_mb": bl.rnd(added, 1),
              "bytes_per_clip": bl.rnd(added * 2**20 / max(1, len(clip_keys)), 1)}
    bl.emit(result, bl.table("planning (rank 0 of vaecache embed)", ["clips", "distinct", "s", "RSS added MB"],
                             [(result["clips"], result["distinct_prompts"], result["seconds"],
                               result["peak_rss_added_mb"])]))
    return result


def captions(args: argparse.Namespace) -> list[str]:
    """One caption per item (scene x camera x clip), in item order."""
    import random

    rng = random.Random(7)
    per_scene = ["" if rng.random() < args.empty else " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
                 for _ in range(args.scenes)]
    return [per_scene[s] for s in range(args.scenes) for _ in range(args.cameras * args.clips)]


def build(folder: Path, args: argparse.Namespace) -> str:
    import json

    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.text.tiny_text import train_tokenizer

    train_tokenizer(folder / "tokenizer")
    torch.manual_seed(0)
    config = UMT5Config(vocab_size=128, d_model=args.d_model, d_kv=args.d_model // args.heads, d_ff=args.d_ff,
                        num_layers=args.layers, num_heads=args.heads, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0)
    UMT5EncoderModel(config).save_pretrained(folder / "text_encoder", safe_serialization=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return f"diffusers:{folder}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.plan_clips:
        return plan_memory(args)
    if args.smoke:
        args.scenes, args.cameras, args.clips, args.d_model, args.layers, args.d_ff = 4, 2, 2, 32, 1, 64
    import torch
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    from vaecache.text.encoder import load_text_encoder
    from vaecache.text.sets import prompt_key

    items = captions(args)
    with tempfile.TemporaryDirectory() as tmp:
        spec = build(Path(tmp) / "wan", args)
        encoder = load_text_encoder(spec, args.device, compute_dtype=args.dtype, dtype=args.dtype, batch=args.batch)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    pipe = types.SimpleNamespace(tokenizer=encoder.tokenizer, text_encoder=encoder.model, _execution_device=device)

    encoder.embed(["warm up"])
    sync()
    started = time.perf_counter()
    reference_bytes = 0
    for start in range(0, len(items), args.batch):
        with torch.no_grad():
            embeds = WanPipeline._get_t5_prompt_embeds(pipe, prompt=items[start:start + args.batch],
                                                       max_sequence_length=512, device=device)
        reference_bytes += embeds.numel() * embeds.element_size()
    sync()
    reference_s = time.perf_counter() - started

    started = time.perf_counter()
    cleaned = {}
    for text in items:
        clean = encoder.clean(text)
        cleaned.setdefault(prompt_key(clean), clean)
    keys = sorted(cleaned)
    rows = encoder.embed([cleaned[key] for key in keys])
    sync()
    vaecache_s = time.perf_counter() - started
    stored = sum(r.rows.numel() * r.rows.element_size() for r in rows)
    clips = args.scenes * args.clips
    result = {
        "env": {"machine": bl.machine_info(args.device), "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items()},
        "items": len(items), "clips": clips, "distinct_prompts": len(keys),
        "dedupe_ratio": bl.rnd(len(items) / len(keys), 4),
        "reference": {"s": bl.rnd(reference_s, 4), "items_per_s": bl.rnd(len(items) / reference_s, 4),
                      "bytes_per_clip": int(reference_bytes / clips)},
        "vaecache": {"s": bl.rnd(vaecache_s, 4), "items_per_s": bl.rnd(len(items) / vaecache_s, 4),
                     "prompts_per_s": bl.rnd(len(keys) / vaecache_s, 4), "bytes_per_clip": int(stored / clips)},
        "speedup_items": bl.rnd(reference_s / vaecache_s, 4),
        "bytes_ratio": bl.rnd(stored / reference_bytes, 5),
        "peak_rss_mb": bl.rnd(bl.maxrss_mb(), 1),
    }
    if device.type == "cuda":
        result["cuda_peak_gib"] = bl.rnd(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    human = bl.table("text embeddings: reference loop vs vaecache (same encoder, batch, length)",
                     ["", "seconds", "items/s", "bytes per clip"],
                     [["reference (per item, padded 512)", result["reference"]["s"],
                       result["reference"]["items_per_s"], result["reference"]["bytes_per_clip"]],
                      ["vaecache (distinct prompts, trimmed)", result["vaecache"]["s"],
                       result["vaecache"]["items_per_s"], result["vaecache"]["bytes_per_clip"]]])
    human += (f"\n{len(items)} items, {len(keys)} distinct prompts (dedupe {result['dedupe_ratio']}x); "
              f"{result['speedup_items']}x the items/s; {result['bytes_ratio']} of the bytes")
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
