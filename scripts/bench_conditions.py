#!/usr/bin/env python
"""Image-to-video conditions: what `vaecache embed --condition first-frame` costs beside the encode, in one run.

A multi-camera demo dataset (--scenes x --cameras, --frames per video) is encoded with --vae (a Wan VAE) by
`vaecache encode` and then given its first-frame condition set by `vaecache embed --condition first-frame`, each a
fresh process, timed end to end (--repeats, median). Then, in this process, each stage per clip on the same clips:
decoding its frames as encode saw them (LatentCache.source_frames), the VAE encode of its latents, and the VAE encode
of its condition video (the first frame then zeros: the same shape, so the same convolutions).

Prints JSON and a table: both commands' wall seconds and their ratio, and per view the decode, latent encode and
condition encode seconds, from which the two ways to get I2V caches are compared: vaecache's second pass (decode +
condition encode) against a trainer's caching run after it (musubi-tuner's wan_cache_latents.py --i2v decodes and
encodes the latents and the condition again: decode + latent encode + condition encode).

    python scripts/bench_conditions.py                                 # CPU, builtin:small
    python scripts/bench_conditions.py --vae diffusers:./wan21#vae --size 480x832 --frames 33 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _benchlib as bl  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", default="builtin:small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--scenes", type=int, default=4)
    p.add_argument("--cameras", type=int, default=2)
    p.add_argument("--frames", type=int, default=17, help="frames per video and per clip (1 + 4k)")
    p.add_argument("--size", default="128x128", help="HxW encoded (and the demo videos' size)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tmp", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from vaecache.conditions.kinds import condition_video
    from vaecache.demodata import DemoDataSpec, write_demo_dataset
    from vaecache.settings.buckets import parse_size
    from vaecache.training import LatentCache
    from vaecache.vae.recorded import load_recorded_vae

    args = parse_args(argv)
    height, width = parse_size(args.size)
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="vaecache-bench-cond-") as scratch_name:
        scratch = Path(scratch_name)
        data = scratch / "data"
        write_demo_dataset(data, DemoDataSpec(scenes=args.scenes, cameras=args.cameras, frames=args.frames,
                                              height=height, width=width, seed=0))
        encode_args = ["--vae", args.vae, "--num-frames", str(args.frames), "--size", args.size, "--dtype",
                       args.dtype, "--device", args.device, "--workers", "0", "--no-progress"]
        encode_s, embed_s = [], []
        env = bl.child_env()
        for repeat in range(args.repeats):
            out = scratch / f"cache{repeat}"
            bl.progress(f"repeat {repeat + 1}/{args.repeats}: encode")
            done = bl.run_timed([sys.executable, "-m", "vaecache", "encode", data, "--out", out, *encode_args],
                                env=env)
            bl.check(done, "vaecache encode")
            encode_s.append(done.wall_s)
            bl.progress(f"repeat {repeat + 1}/{args.repeats}: embed --condition first-frame")
            done = bl.run_timed([sys.executable, "-m", "vaecache", "embed", out, "--condition", "first-frame",
                                 "--device", args.device], env=env)
            bl.check(done, "vaecache embed --condition")
            embed_s.append(done.wall_s)

        bl.progress("stages per clip")
        cache = LatentCache(scratch / "cache0")
        device = torch.device(args.device)
        vae = load_recorded_vae(cache.out, cache.manifest, cache.manifest["settings"]["vae_spec"], device)
        decode, latent, condition, views = [], [], [], 0

        def timed(fn: Any, *args: Any) -> tuple[Any, float]:
            sync(device)
            start = time.perf_counter()
            value = fn(*args)
            sync(device)
            return value, time.perf_counter() - start

        for record in cache.records():
            frames, seconds = timed(cache.source_frames, record)
            decode.append(seconds)
            latent.append(timed(vae.encode_views, frames)[1])
            video = condition_video(frames, "first-frame")
            condition.append(timed(vae.encode_views, video)[1])
            views += frames.shape[0]
    per_view = {name: sum(values) / views for name, values in
                (("decode_s", decode), ("latent_encode_s", latent), ("condition_encode_s", condition))}
    second_pass = per_view["decode_s"] + per_view["condition_encode_s"]
    trainer = per_view["decode_s"] + per_view["latent_encode_s"] + per_view["condition_encode_s"]
    result = {
        "benchmark": "bench_conditions", "env": {"machine": bl.machine_info(args.device), "torch": torch.__version__},
        "workload": {"vae": args.vae, "dtype": args.dtype, "scenes": args.scenes, "cameras": args.cameras,
                     "frames": args.frames, "size": args.size, "views": views, "repeats": args.repeats},
        "encode_s": bl.rnd(bl.median(encode_s), 4), "embed_condition_s": bl.rnd(bl.median(embed_s), 4),
        "embed_over_encode": bl.rnd(bl.median(embed_s) / bl.median(encode_s), 4),
        "per_view": {name: bl.rnd(value, 5) for name, value in per_view.items()},
        "condition_over_latent_encode": bl.rnd(per_view["condition_encode_s"] / per_view["latent_encode_s"], 4),
        "second_pass_per_view_s": bl.rnd(second_pass, 5), "trainer_caching_per_view_s": bl.rnd(trainer, 5),
        "second_pass_over_trainer": bl.rnd(second_pass / trainer, 4),
    }
    human = bl.table(f"first-frame conditions, {views} views of {args.frames}x{args.size} ({args.vae}, {args.dtype}, "
                     f"{args.device})", ["measure", "value"], [
        ("vaecache encode, s (median)", result["encode_s"]),
        ("vaecache embed --condition first-frame, s", result["embed_condition_s"]),
        ("embed / encode", result["embed_over_encode"]),
        ("per view: decode, s", result["per_view"]["decode_s"]),
        ("per view: latent encode, s", result["per_view"]["latent_encode_s"]),
        ("per view: condition encode, s", result["per_view"]["condition_encode_s"]),
        ("vaecache's second pass / a trainer's I2V caching", result["second_pass_over_trainer"])])
    bl.emit(result, human)
    return result


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
