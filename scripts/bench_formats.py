#!/usr/bin/env python
"""Encoder speed by dtype, memory format and torch.compile, side by side.

One VAE (builtin:tiny's architecture, or the published Wan 2.1 VAE config with random weights:
--model wan2.1), one random clip of --views views, every mode timed on the same input with the modes
interleaved over --repeats rounds (median seconds per forward after one warm-up forward each):

* fp32 / bf16 (weights and input cast), contiguous / channels_last_3d (weights and input converted);
* with --compile, fp32 contiguous through torch.compile as well (its first forward, the compile, is
  reported apart and not in the median).

Each mode's latents are compared with fp32 contiguous eager: max |difference| / max |latent|.
Prints a table on stderr and JSON on stdout; the machine is named.

    python scripts/bench_formats.py --views 4 --frames 17 --size 64x64 --repeats 5 --compile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

MODELS = {
    "tiny": None,  # builtin:tiny's own config
    "wan2.1": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
               "temperal_downsample": [False, True, True], "dropout": 0.0},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--views", type=int, default=4, help="views per forward")
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--size", default="64x64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of fp32 and bf16")
    p.add_argument("--compile", action="store_true", help="also time fp32 contiguous through torch.compile")
    return p.parse_args(argv)


def build(model: str, device: Any):
    import torch
    from diffusers import AutoencoderKLWan

    if MODELS[model] is None:
        from vaecache.vae import load_vae

        return load_vae("builtin:tiny", device).model.module
    torch.manual_seed(0)
    return AutoencoderKLWan(**MODELS[model]).to(device).eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import copy

    import torch

    from vaecache.distributed.context import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    height, width = (int(v) for v in args.size.split("x"))
    base = build(args.model, device)
    torch.manual_seed(1)
    clip = torch.rand(args.views, 3, args.frames, height, width, device=device) * 2 - 1
    modes: dict[str, tuple[Any, Any]] = {}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for dtype_name in ["fp32", *(name for name in args.dtypes.split(",") if name.strip() != "fp32")]:
        dtype = dtypes[dtype_name.strip()]
        for layout_name, layout in (("contiguous", torch.contiguous_format),
                                    ("channels_last_3d", torch.channels_last_3d)):
            module = copy.deepcopy(base).to(dtype=dtype)
            for param in module.parameters():  # only the 5-d (Conv3d) weights have a 3-d channels-last form
                if param.dim() == 5:
                    param.data = param.data.contiguous(memory_format=layout)
            modes[f"{dtype_name.strip()} {layout_name}"] = (module.encode,
                                                            clip.to(dtype).contiguous(memory_format=layout))
    compile_s = None
    if args.compile:
        compiled = torch.compile(copy.deepcopy(base).encode)
        started = time.perf_counter()
        with torch.inference_mode():
            compiled(clip)
        compile_s = time.perf_counter() - started
        modes["fp32 contiguous compiled"] = (compiled, clip)

    def forward(encode: Any, x: Any) -> Any:
        with torch.inference_mode():
            mean = encode(x).latent_dist.mean
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return mean

    latents = {name: forward(*mode) for name, mode in modes.items()}  # warm-up, and the latents compared
    times: dict[str, list[float]] = {name: [] for name in modes}
    for repeat in range(args.repeats):
        bl.progress(f"round {repeat + 1}/{args.repeats}")
        for name in list(modes)[repeat % len(modes):] + list(modes)[:repeat % len(modes)]:
            started = time.perf_counter()
            forward(*modes[name])
            times[name].append(time.perf_counter() - started)
    reference = latents["fp32 contiguous"].float()
    scale = float(reference.abs().max())
    baseline = bl.median(times["fp32 contiguous"])
    rows = {name: {"s_per_forward": bl.rnd(bl.median(t), 4), "views_per_s": bl.rnd(args.views / bl.median(t), 4),
                   "speed_vs_fp32_contiguous": bl.rnd(baseline / bl.median(t), 3),
                   "max_abs_diff_rel": float((latents[name].float() - reference).abs().max()) / scale}
            for name, t in times.items()}
    result = {"machine": bl.machine_info(str(device)),
              "config": {"model": args.model, "views": args.views, "frames": args.frames, "size": args.size,
                         "repeats": args.repeats, "threads": torch.get_num_threads(), "device": str(device)},
              "modes": rows, "compile_s": None if compile_s is None else bl.rnd(compile_s, 3)}
    human = bl.table(f"bench_formats.py: {args.model}, {args.views} x {args.frames} x {args.size} per forward on "
                     f"{device} ({torch.get_num_threads()} threads), median of {args.repeats}",
                     ["mode", "s/forward", "views/s", "x fp32 contiguous", "max diff / max latent"],
                     [[name, r["s_per_forward"], r["views_per_s"], r["speed_vs_fp32_contiguous"],
                       f"{r['max_abs_diff_rel']:.1e}"] for name, r in rows.items()])
    if compile_s is not None:
        human += f"\ntorch.compile: first forward (the compile) {compile_s:.1f} s"
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
