#!/usr/bin/env python
"""Peak memory and time of one pixel-loss step through the VAE decoder: forward and backward of
``loss(decode(z))`` with respect to the latents ``z``, the VAE frozen.

Variants, each in a fresh process (on CPU the peak resident set only grows within one):

* plain: ``module.decode(z).sample`` under autograd, what a trainer writes first;
* chunked: ``PixelDecoder(checkpoint=False)``: the decoder run a latent frame at a time with the causal cache
  carried, every activation kept for the backward;
* checkpointed: ``PixelDecoder(checkpoint=True, chunk_frames=1)``: the same, every decoder stage of every latent
  frame a checkpoint region (the causal cache kept at every frame);
* checkpointed-whole: ``PixelDecoder(checkpoint=True, chunk_frames=all)``: one region per stage over every frame
  (the cache kept only at its start; the backward recomputes a stage over every frame at once).

The VAE is the published Wan 2.1 config with random weights (``--model wan2.1``: real compute and memory) or a tiny
one (``--model tiny``). Memory is what the step adds on top of the loaded model and its input: CUDA
``max_memory_allocated`` minus the memory before; CPU the peak resident set (VmHWM, reset after a warm-up step)
minus the resident set before, with glibc's mmap threshold fixed so freed tensors leave at once. Each process runs
one warm-up step and ``--repeats`` timed steps (median). Gradients of every variant are compared with plain's
(max |difference| / max |gradient|). Prints a table on stderr and the JSON on stdout.

    python scripts/bench_pixel_loss.py --model wan2.1 --size 240x416 --frames 17 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

VARIANTS = ("plain", "chunked", "checkpointed", "checkpointed-whole")
MODELS = {
    "tiny": {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
             "temperal_downsample": [False, True, True]},
    # The published Wan 2.1 VAE (Wan-AI/Wan2.1-T2V-14B-Diffusers, vae/config.json), random weights.
    "wan2.1": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
               "temperal_downsample": [False, True, True], "dropout": 0.0},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--size", default="64x64", help="HxW of the decoded frames")
    p.add_argument("--frames", type=int, default=9, help="decoded frames (1 + 4k)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as handle:
        return int(next(line for line in handle if line.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    from vaecache.distributed.context import resolve_device
    from vaecache.vae.pixel_decoder import PixelDecoder

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    with torch.device(device):
        module = AutoencoderKLWan(**MODELS[args.model])
    module = module.to(dtype).eval().requires_grad_(False)
    height, width = (int(v) for v in args.size.split("x"))
    factor = module.spatial_compression_ratio
    latent_frames = 1 + (args.frames - 1) // 4
    z0 = torch.randn(1, module.config.z_dim, latent_frames, height // factor, width // factor,
                     generator=torch.Generator().manual_seed(1)).to(device, dtype)
    weights = None
    if args.worker == "plain":
        decode = lambda z: module.decode(z).sample  # noqa: E731
    else:
        decoder = PixelDecoder(module, checkpoint=args.worker.startswith("checkpointed"),
                               chunk_frames=latent_frames if args.worker == "checkpointed-whole" else 1)
        decode = decoder

    def step() -> Any:
        nonlocal weights
        z = z0.clone().requires_grad_(True)
        frames = decode(z)
        if weights is None:
            weights = torch.randn(frames.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        (frames.float() * weights.float()).mean().backward()
        return z.grad

    step()  # warm-up: kernels, allocator growth
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before = _rss()
        _reset_peak_rss()
    times, grad = [], None
    for _ in range(args.repeats):
        started = time.perf_counter()
        grad = step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated(device) if cuda else _peak_rss()) - before
    save_file({"grad": grad.float().cpu().contiguous()}, str(Path(args.out) / f"{args.worker}.safetensors"))
    return {"variant": args.worker, "peak_added_bytes": int(peak), "seconds_per_step": bl.median(times),
            "device": str(device), "latent_shape": list(z0.shape)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        result = worker(args)
        (Path(args.out) / f"{args.worker}.json").write_text(json.dumps(result))
        return result
    import torch
    from safetensors.torch import load_file

    folder = Path(tempfile.mkdtemp(prefix="bench-pixel-loss-"))
    rows = []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        bl.progress(f"{variant} ...")
        command = [sys.executable, __file__, "--worker", variant, "--out", str(folder), "--model", args.model,
                   "--size", args.size, "--frames", str(args.frames), "--repeats", str(args.repeats),
                   "--device", args.device, "--dtype", args.dtype]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        rows.append(json.loads((folder / f"{variant}.json").read_text()))
    measured = [row for row in rows if "error" not in row]
    base = next((row for row in measured if row["variant"] == "plain"), measured[0] if measured else None)
    reference = load_file(str(folder / f"{base['variant']}.safetensors"))["grad"] if base else None
    for row in measured:
        grad = load_file(str(folder / f"{row['variant']}.safetensors"))["grad"]
        row["memory_vs_plain"] = bl.rnd(row["peak_added_bytes"] / base["peak_added_bytes"], 4)
        row["time_vs_plain"] = bl.rnd(row["seconds_per_step"] / base["seconds_per_step"], 4)
        row["grad_max_diff_rel"] = float((grad - reference).abs().max() / reference.abs().max())
        row["seconds_per_step"] = bl.rnd(row["seconds_per_step"], 4)
    result = {"machine": bl.machine_info(args.device), "torch": torch.__version__,
              "config": {"model": args.model, "size": args.size, "frames": args.frames, "repeats": args.repeats,
                         "dtype": args.dtype, "device": args.device}, "rows": rows}
    human = bl.table(f"bench_pixel_loss.py: {args.model}, {args.frames} frames at {args.size}, forward + backward "
                     f"of one step, median of {args.repeats}, each variant in a fresh process",
                     ("variant", "peak added MiB", "x plain", "s/step", "x plain", "grad max diff / max"),
                     [(r["variant"], bl.rnd(r["peak_added_bytes"] / 2**20, 4), r["memory_vs_plain"],
                       r["seconds_per_step"], r["time_vs_plain"], f"{r['grad_max_diff_rel']:.1e}") if "error" not in r
                      else (r["variant"], "error: " + r["error"], "", "", "", "") for r in rows])
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
