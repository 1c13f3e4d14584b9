#!/usr/bin/env python
"""Wan encoder speed: diffusers' own encode against vaecache's fast Wan encoder (vaecache/models/_wan_fast.py), side
by side in one process under vaecache's CUDA settings (cuDNN heuristics, deterministic algorithms, no TF32).

For each shape: the FLOP count of one encode (torch.utils.flop_counter), the reference encode in bf16 and fp32,
then each fast variant (temporal chunk, eager or compiled norm + SiLU) in bf16: seconds per view (median of
--repeats after a warm-up), peak memory above the weights, achieved TFLOP/s and fraction of the measured bf16
matrix-product peak, the distance of each bf16 encode to the fp32 reference (max |diff| / max |ref| and relative
L2; accuracy_ok: the fast one's no larger than 1.1x the reference bf16's), and whether repeats are bitwise equal.
A torch.profiler table of one reference and one fast encode shows where the time goes; --second-process encodes
again in a fresh process and compares bits.

The VAE is the published Wan 2.1 config with seeded random weights (real compute and memory); the input is
the smooth random video of scripts/_vae_shapes.py. The JSON is written to --out after every step; a table goes
to stderr.

    python scripts/bench_wan_encoder.py --device cuda --out wan_encoder.json --shapes 33x480x832,81x480x832
    python scripts/bench_wan_encoder.py --smoke --device cpu        # tiny config, the same code paths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402
from _vae_shapes import PUBLISHED, TINY, smooth_clip  # noqa: E402

SEED = 20261126


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="wan_encoder.json")
    p.add_argument("--smoke", action="store_true", help="tiny config and shapes")
    p.add_argument("--family", default="wan2.1", choices=("wan2.1", "wan2.2-ti2v"))
    p.add_argument("--shapes", default="33x480x832", help="FRAMESxHEIGHTxWIDTH, comma-separated")
    p.add_argument("--variants", default="c4-rows-pad96,c4-rows,c4-eager,c8-rows-pad96",
                   help="cN-eager|cN-rows[-contiguous][-padC+C]: temporal chunk N, the pointwise kernels (eager, or "
                        "compiled over rows with the convolution biases folded), NCDHW instead of NDHWC, "
                        "activations of C channels padded to a multiple of 128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference (no accuracy figures)")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of one reference, one fast encode")
    p.add_argument("--second-process", action="store_true", help="a variant again in a fresh process")
    p.add_argument("--second-process-variant", default=None, help="which (default: the first of --variants)")
    p.add_argument("--conv-microbench", action="store_true",
                   help="time each stage-0 convolution shape with cuDNN's heuristic, padded channels and autotuning")
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "SHAPE", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_vae(family: str, smoke: bool, device: Any) -> Any:
    import torch
    from diffusers import AutoencoderKLWan

    _, config = (TINY if smoke else PUBLISHED)[family]
    torch.manual_seed(SEED)
    with torch.device(device):
        vae = AutoencoderKLWan(**config)
    return vae.eval().requires_grad_(False)


def fast_encoder(vae: Any, variant: str) -> Any:
    """A WanFastEncoder for a variant name: c<chunk>-<eager|rows>[-contiguous][-padC[+C]]: temporal chunk, the
    pointwise kernels (eager, or compiled over rows with the convolution biases folded), NCDHW instead of NDHWC,
    activations of C channels padded to the next multiple of 128."""
    from vaecache.models._wan_fast import EAGER, CompiledRowKernels, WanFastEncoder

    chunk_text, impl, *rest = variant.split("-")
    kernels = {"eager": lambda: EAGER, "rows": lambda: CompiledRowKernels().kernels()}[impl]()
    pads = {int(c): -(-int(c) // 128) * 128 for r in rest if r.startswith("pad") for c in r[3:].split("+")}
    return WanFastEncoder(vae, chunk_frames=int(chunk_text[1:]), kernels=kernels,
                          channels_last="contiguous" not in rest, pad_channels=pads)


def parse_shape(text: str) -> tuple[int, int, int]:
    frames, height, width = (int(v) for v in text.lower().split("x"))
    return frames, height, width


def rel_diff(a: Any, b: Any) -> dict[str, float]:
    a, b = a.double().cpu(), b.double().cpu()
    return {"max_abs_rel": float((a - b).abs().max() / b.abs().max()), "l2_rel": float((a - b).norm() / b.norm())}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from vaecache.distributed.context import resolve_device
        from vaecache.vae.load import exact_cuda_numerics

        self.torch = torch
        self.args = args
        self.device = resolve_device(args.device)
        self.cuda = self.device.type == "cuda"
        exact_cuda_numerics(self.device)
        self.out = Path(args.out)
        self.results: dict[str, Any] = {}

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(partial, self.out)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
        """Warm-up, then `repeats` timed calls, the peak of the first timed one. Returns seconds, peak and outputs."""
        torch = self.torch
        first = fn()
        self.sync()
        outs, times = [], []
        peak = float("nan")
        for i in range(repeats):
            if self.cuda and i == 0:
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
            start = time.perf_counter()
            outs.append(fn())
            self.sync()
            times.append(time.perf_counter() - start)
            if self.cuda and i == 0:
                peak = float(torch.cuda.max_memory_allocated(self.device) - before)
        return {"times": times, "peak": peak, "first": first, "outs": outs}

    def matmul_peak(self) -> float | None:
        """bf16 TFLOP/s of an 8192^3 matrix product on this device (the ceiling the fraction is taken of)."""
        if not self.cuda:
            return None
        torch = self.torch
        a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        self.sync()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        self.sync()
        return 2 * 8192**3 * 10 / (time.perf_counter() - start) / 1e12


def flops_of(fn: Callable[[], Any]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def profile_of(bench: Bench, fn: Callable[[], Any], top: int = 25) -> dict[str, Any]:
    """The ops and kernels with the most device time (self time) in one call, and the total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    fn()
    bench.sync()
    with profile(activities=activities) as prof:
        fn()
        bench.sync()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if not bench.cuda:
            device_us = event.self_cpu_time_total
        kernel = bench.cuda and getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        rows.append({"name": event.key[:140], "kernel": bool(kernel), "count": event.count,
                     "self_ms": round(device_us / 1000, 3)})
    kernels = [r for r in rows if r["kernel"]] if bench.cuda else rows
    total = sum(r["self_ms"] for r in kernels)
    ops = sorted((r for r in rows if not r["kernel"] and r["name"].startswith("aten::") and r["self_ms"] > 0),
                 key=lambda r: -r["self_ms"])
    return {"device_ms_total": round(total, 2),
            "top_kernels": sorted(kernels, key=lambda r: -r["self_ms"])[:top],
            "top_aten_ops": ops[:top]}


def conv_microbench(bench: Bench) -> dict[str, Any]:
    """Per convolution shape of the Wan 2.1 encoder's first stages (NDHWC, bf16, causal input of chunk + 2 frames):
    milliseconds with cuDNN's heuristic choice, with the output channels (and the input's) zero-padded to 128, and
    with cudnn.benchmark autotuning; TFLOP/s of the unpadded arithmetic."""
    import torch
    import torch.nn.functional as F

    from vaecache.vae.load import exact_cuda_numerics

    cl = torch.channels_last_3d
    dev, dt = bench.device, torch.bfloat16
    specs = [("stage0 96->96", 96, 96, 480, 832), ("stage0 3->96 conv_in", 3, 96, 480, 832),
             ("stage1 96->192", 96, 192, 240, 416), ("stage1 192->192", 192, 192, 240, 416),
             ("stage2 384->384", 384, 384, 120, 208)]
    if bench.args.smoke:
        specs = [(n, ci, co, 16, 16) for n, ci, co, _, _ in specs]
    rows = []
    for name, cin, cout, h, w in specs:
        for chunk in (4, 8):
            x = torch.randn(1, cin, chunk + 2, h, w, device=dev, dtype=dt).contiguous(memory_format=cl)
            wt = torch.randn(cout, cin, 3, 3, 3, device=dev, dtype=dt).contiguous(memory_format=cl) * 0.05
            flops = 2 * cin * cout * 27 * chunk * h * w
            row: dict[str, Any] = {"conv": name, "chunk": chunk}

            def ms(fn: Callable[[], Any]) -> float:
                for _ in range(2):
                    fn()
                bench.sync()
                start = time.perf_counter()
                for _ in range(5):
                    fn()
                bench.sync()
                return (time.perf_counter() - start) / 5 * 1000

            row["heuristic_ms"] = bl.rnd(ms(lambda x=x, wt=wt: F.conv3d(x, wt, None, 1, (0, 1, 1))), 4)
            up = -(-cout // 128) * 128
            if up != cout:
                wp = torch.zeros(up, cin, 3, 3, 3, device=dev, dtype=dt).contiguous(memory_format=cl)
                wp[:cout] = wt
                row["pad_out_ms"] = bl.rnd(ms(lambda x=x, wp=wp: F.conv3d(x, wp, None, 1, (0, 1, 1))), 4)
                if cin >= 64 and cin % 128:
                    cin_up = -(-cin // 128) * 128
                    xp = torch.zeros(1, cin_up, chunk + 2, h, w, device=dev, dtype=dt).contiguous(memory_format=cl)
                    xp[:, :cin] = x
                    wpp = torch.zeros(up, cin_up, 3, 3, 3, device=dev, dtype=dt).contiguous(memory_format=cl)
                    wpp[:cout, :cin] = wt
                    row["pad_in_out_ms"] = bl.rnd(ms(lambda xp=xp, wpp=wpp: F.conv3d(xp, wpp, None, 1, (0, 1, 1))), 4)
            if bench.cuda:
                torch.backends.cudnn.benchmark = True
                try:
                    row["autotuned_ms"] = bl.rnd(ms(lambda x=x, wt=wt: F.conv3d(x, wt, None, 1, (0, 1, 1))), 4)
                finally:
                    exact_cuda_numerics(bench.device)
            row["heuristic_tflops"] = bl.rnd(flops / row["heuristic_ms"] / 1e9, 4)
            rows.append(row)
            bl.progress(f"conv {row}")
    return {"rows": rows}


def measure_shape(bench: Bench, vae: Any, shape: tuple[int, int, int]) -> dict[str, Any]:
    import torch

    args = bench.args
    frames, height, width = shape
    x32 = smooth_clip(1, frames, height, width).to(bench.device)
    result: dict[str, Any] = {"shape": [1, 3, frames, height, width]}
    key = f"{frames}x{height}x{width}"
    bench.results.setdefault("fast_encode", {}).setdefault(args.family, {})[key] = result

    fp32_ref = None
    if not args.no_fp32:
        vae.to(torch.float32)
        run = bench.run(lambda: vae._encode(x32), 1)
        fp32_ref = run["outs"][0].cpu()
        result["fp32"] = {"reference_s_per_view": bl.rnd(run["times"][0], 4), "peak_gib": gib(run["peak"])}
        del run
        release(bench)
        bench.write()

    vae.to(torch.bfloat16)
    x = x32.to(torch.bfloat16)
    flops = flops_of(lambda: vae._encode(x))
    peak_tflops = bench.results.get("env", {}).get("bf16_matmul_tflops")
    bf16: dict[str, Any] = {"flops": flops, "tflop": bl.rnd(flops / 1e12, 4)}
    result["bf16"] = bf16
    run = bench.run(lambda: vae._encode(x), args.repeats)
    ref_s = bl.median(run["times"])
    ref_out = run["outs"][0]
    bf16["reference_s_per_view"] = bl.rnd(ref_s, 4)
    ref_peak = run["peak"]  # nan off CUDA
    bf16["reference_peak_gib"] = gib(ref_peak)
    bf16["reference_tflops"] = bl.rnd(flops / ref_s / 1e12, 4)
    if peak_tflops:
        bf16["reference_fraction_of_peak"] = bl.rnd(flops / ref_s / 1e12 / peak_tflops, 3)
    bf16["reference_bitwise_repeat"] = all(torch.equal(o, run["first"]) for o in run["outs"])
    if fp32_ref is not None:
        bf16["reference_vs_fp32"] = rel_diff(ref_out.float(), fp32_ref)
    del run
    release(bench)
    bench.write()
    if args.profile:
        bf16["reference_profile"] = profile_of(bench, lambda: vae._encode(x))
        bench.write()

    variants: dict[str, Any] = {}
    bf16["variants"] = variants
    for name in [v for v in args.variants.split(",") if v]:
        try:
            encoder = fast_encoder(vae, name)
            started = time.perf_counter()
            encoder.moments(x)
            bench.sync()
            first_call_s = time.perf_counter() - started
            run = bench.run(lambda e=encoder: e.moments(x), args.repeats)
            seconds = bl.median(run["times"])
            row: dict[str, Any] = {
                "fast_s_per_view": bl.rnd(seconds, 4), "first_call_s": bl.rnd(first_call_s, 4),
                "speedup_vs_reference": bl.rnd(ref_s / seconds, 4), "peak_gib": gib(run["peak"]),
                "peak_vs_reference": bl.rnd(run["peak"] / ref_peak, 4) if ref_peak else float("nan"),
                "tflops": bl.rnd(flops / seconds / 1e12, 4),
                "bitwise_repeat": all(torch.equal(o, run["first"]) for o in run["outs"]),
                "vs_reference_bf16": rel_diff(run["outs"][0].float(), ref_out.float()),
            }
            if peak_tflops:
                row["fraction_of_peak"] = bl.rnd(flops / seconds / 1e12 / peak_tflops, 3)
            if fp32_ref is not None:
                mine = rel_diff(run["outs"][0].float(), fp32_ref)
                theirs = bf16["reference_vs_fp32"]
                row["vs_fp32"] = mine
                row["accuracy_ok"] = (mine["max_abs_rel"] <= 1.1 * theirs["max_abs_rel"]
                                      and mine["l2_rel"] <= 1.1 * theirs["l2_rel"])
            variants[name] = row
            del run
            if args.profile and name == args.variants.split(",")[0]:
                row["profile"] = profile_of(bench, lambda e=encoder: e.moments(x))
        except Exception as exc:  # one variant's failure must not lose the others' figures
            traceback.print_exc()
            variants[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        release(bench)
        bench.write()
    if args.second_process:
        first = args.second_process_variant or [v for v in args.variants.split(",") if v][0]
        encoder = fast_encoder(vae, first)
        mine = encoder.moments(x).cpu()
        other = bench.out.with_name(f"child-{key}.safetensors")
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="inductor-child-") as cache:
            # a fresh compile cache, and another shape encoded first: the child's kernels owe nothing to ours
            subprocess.run([sys.executable, __file__, "--device", str(bench.device), "--family", args.family,
                            "--child", first, key, str(other)] + (["--smoke"] if args.smoke else []), check=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                                "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")})
        from safetensors.torch import load_file

        theirs = load_file(other)["moments"]
        bf16["variants"][first]["bitwise_other_process"] = torch.equal(mine, theirs)
        bf16["variants"][first]["other_process_s"] = bl.rnd(time.perf_counter() - started, 3)
        other.unlink()
        bench.write()
    return result


def gib(value: float) -> float:
    return bl.rnd(value / 2**30, 4) if value == value else value


def release(bench: Bench) -> None:
    import gc

    gc.collect()
    if bench.cuda:
        bench.torch.cuda.empty_cache()


def child(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    from vaecache.distributed.context import resolve_device
    from vaecache.vae.load import exact_cuda_numerics

    variant, shape, out = args.child
    device = resolve_device(args.device)
    exact_cuda_numerics(device)
    vae = build_vae(args.family, args.smoke, device).to(torch.bfloat16)
    frames, height, width = parse_shape(shape)
    x = smooth_clip(1, frames, height, width).to(device).to(torch.bfloat16)
    encoder = fast_encoder(vae, variant)
    encoder.moments(smooth_clip(2, 9, height // 2, width // 2).to(device).to(torch.bfloat16))
    save_file({"moments": encoder.moments(x).cpu().contiguous()}, out)


def summary(results: dict[str, Any]) -> str:
    lines = [f"{'shape':<14} {'variant':<22} {'s/view':>8} {'x ref':>6} {'TFLOP/s':>8} {'peak GiB':>9} "
             f"{'vs fp32 max':>11} {'ok':>5} {'repeat':>6}"]
    for family, shapes in results.get("fast_encode", {}).items():
        for key, r in shapes.items():
            b = r.get("bf16", {})
            if "reference_s_per_view" in b:
                lines.append(f"{key:<14} {family + ' reference':<22} {b['reference_s_per_view']:>8} {1:>6} "
                             f"{b['reference_tflops']:>8} {b['reference_peak_gib']:>9} "
                             f"{b.get('reference_vs_fp32', {}).get('max_abs_rel', float('nan')):>11.2e} {'-':>5} "
                             f"{str(b['reference_bitwise_repeat']):>6}")
            for name, v in b.get("variants", {}).items():
                if "error" in v:
                    lines.append(f"{key:<14} {name:<22} {v['error']}")
                    continue
                lines.append(f"{key:<14} {name:<22} {v['fast_s_per_view']:>8} {v['speedup_vs_reference']:>6} "
                             f"{v['tflops']:>8} {v['peak_gib']:>9} "
                             f"{v.get('vs_fp32', {}).get('max_abs_rel', float('nan')):>11.2e} "
                             f"{str(v.get('accuracy_ok', '-')):>5} {str(v['bitwise_repeat']):>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    bench = Bench(args)
    import torch

    env: dict[str, Any] = {"machine": bl.machine_info(str(bench.device)), "torch": torch.__version__,
                           "cuda_runtime": torch.version.cuda, "smoke": args.smoke,
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "settings": "cudnn.benchmark=False, cudnn.deterministic=True, TF32 off"}
    if bench.cuda:
        props = torch.cuda.get_device_properties(bench.device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count)
        env["bf16_matmul_tflops"] = bl.rnd(bench.matmul_peak() or 0.0, 4)
    bench.results["env"] = env
    bench.write()
    if args.conv_microbench:
        bench.results["conv_microbench"] = conv_microbench(bench)
        bench.write()
    vae = build_vae(args.family, args.smoke, bench.device)
    shapes = ["9x32x32"] if args.smoke else [s for s in args.shapes.split(",") if s]
    for text in shapes:
        bl.progress(f"{args.family} {text} ...")
        measure_shape(bench, vae, parse_shape(text))
    bl.emit(bench.results, summary(bench.results))
    return bench.results


if __name__ == "__main__":
    main()
