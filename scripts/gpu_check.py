#!/usr/bin/env python
"""The GPU acceptance of vaecache in one command: exactness, a real out-of-memory backoff, bf16 against
fp32, the pipeline against the naive loop, memory per VAE family, decoding, the spatial split and the encoder's
formats, on whatever device it is given. Prints a table on stderr and the JSON on stdout.

    python scripts/gpu_check.py --device cuda --out gpu_check.json            # the whole matrix, in priority order
    python scripts/gpu_check.py --device cuda --out gpu_check.json --resume   # again from the first missing section
    python scripts/gpu_check.py --smoke --device cpu                          # the same code paths, tiny, < 1 min

Sections run in priority order (SECTIONS) and the JSON file is rewritten after each one, so a run cut off by a
device lease keeps what it measured; --resume skips the sections already in --out without an "error". A section
that raises is recorded with its error and the run goes on.

The VAEs are the published configs of each family with random weights (seeded): compute and memory are the real
ones, the latents are not meaningful images. Inputs are smooth random videos (a random field at 1/16 of the
resolution, upsampled), not white noise, so that activations have the spread of real footage. With --smoke, tiny
configs of the same classes and 32x32x9 clips; the out-of-memory backoff is then injected (VaeRunner's hook), as no
real CUDA out-of-memory error can happen on a CPU.

What needs two GPUs (NCCL collectives, sequence- and spatial-parallel equality across ranks) is listed under
"unmeasured" with that reason, as is torchcodec where it cannot be imported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402
from _vae_shapes import PUBLISHED, SEED, TINY, smooth_clip  # noqa: E402

SECTIONS = ("env", "fast_encode", "fast_encode_wan2.2-ti2v", "conditions", "exactness",
            "oom_backoff", "oom_backoff_expandable", "bf16_vs_fp32", "pipeline_bf16",
            "memory_wan2.1", "memory_wan2.1_720p", "memory_wan2.2-ti2v", "memory_hunyuanvideo", "memory_ltx-video",
            "memory_cogvideox", "decode", "spatial", "pixel_decoder", "formats", "pipeline_fp32")
UNMEASURED_ON_ONE_GPU = {
    "nccl_sp_equality": "sequence-parallel encode over NCCL equal to one rank: needs two GPUs",
    "nccl_spatial_equality": "spatial split G >= 2 over NCCL equal to the unsplit encode (cuDNN picks algorithms by "
                             "band shape on CUDA): needs two GPUs",
    "multi_rank_throughput": "throughput per rank under torchrun/SLURM with NCCL: needs two GPUs",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--smoke", action="store_true", help="tiny configs and shapes: the same code paths in < 1 min")
    p.add_argument("--out", default="gpu_check.json", help="the JSON file, rewritten after every section")
    p.add_argument("--resume", action="store_true", help="skip the sections --out already holds without an error")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, run in SECTIONS order")
    p.add_argument("--tmp", default=None, help="folder for VAE folders, videos and caches (default: a temp folder)")
    p.add_argument("--no-compile", action="store_true", help="formats: leave torch.compile out")
    p.add_argument("--child-encode", nargs=4, metavar=("SPEC", "DTYPE", "SHAPE", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- shared state


class Check:
    """The device, the shapes of this run (full or smoke), the VAE folders built so far and the results."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        import torch

        from vaecache.distributed.context import resolve_device

        self.args = args
        self.torch = torch
        self.device = resolve_device(args.device)
        self.cuda = self.device.type == "cuda"
        self.smoke = args.smoke
        self.tmp = tmp
        self.configs = TINY if args.smoke else PUBLISHED
        self.frames = 9 if args.smoke else 33
        self.size = (32, 32) if args.smoke else (480, 832)
        self.big_size = (32, 64) if args.smoke else (720, 1280)
        self.out = Path(args.out)
        self.results: dict[str, Any] = {}
        self.kept: dict[str, Any] = {}
        """Tensors one section leaves for a later one in the same process (fp32 reference latents)."""

    def folder(self, family: str) -> Path:
        """A diffusers folder of `family` with seeded random weights (built once per run)."""
        import diffusers

        path = self.tmp / "vae" / family
        if not (path / "config.json").exists():
            class_name, config = self.configs[family]
            self.torch.manual_seed(SEED)
            with self.torch.device(self.device):  # random init of 250M parameters is slow on a CPU
                module = getattr(diffusers, class_name)(**config)
            module.to("cpu").save_pretrained(path, safe_serialization=True)
            del module
        return path

    def spec(self, family: str) -> str:
        return f"diffusers:{self.folder(family)}"

    def clip(self, views: int, size: tuple[int, int] | None = None, frames: int | None = None) -> Any:
        return smooth_clip(views, frames or self.frames, *(size or self.size))

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def release(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(partial, self.out)


def timed(check: Check, fn: Callable[[], Any]) -> tuple[float, Any]:
    check.sync()
    start = time.perf_counter()
    out = fn()
    check.sync()
    return time.perf_counter() - start, out


def timed_runs(check: Check, fn: Callable[[], Any], count: int) -> tuple[list[float], list[Any]]:
    """`count` timed calls: (seconds of each, result of each)."""
    runs = [timed(check, fn) for _ in range(count)]
    return [seconds for seconds, _ in runs], [result for _, result in runs]


def peak_of(check: Check, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds, peak bytes the call added on top of what was allocated before (CUDA only, else nan), result)."""
    torch = check.torch
    if check.cuda:
        check.sync()
        torch.cuda.reset_peak_memory_stats(check.device)
        before = torch.cuda.memory_allocated(check.device)
    seconds, out = timed(check, fn)
    peak = float(torch.cuda.max_memory_allocated(check.device) - before) if check.cuda else float("nan")
    return seconds, peak, out


def rel_diff(a: Any, b: Any) -> dict[str, float]:
    """a against the reference b: max |a - b| / max |b| and ||a - b|| / ||b|| (in fp64)."""
    a, b = a.double().cpu(), b.double().cpu()
    return {"max_abs_rel": float((a - b).abs().max() / b.abs().max()),
            "l2_rel": float((a - b).norm() / b.norm())}


def gib(value: float) -> float:
    return bl.rnd(value / 2**30, 4) if value == value else value


# --------------------------------------------------------------------------- sections


def section_env(check: Check) -> dict[str, Any]:
    from importlib import metadata

    torch = check.torch
    info: dict[str, Any] = {"machine": bl.machine_info(str(check.device)), "smoke": check.smoke,
                            "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    for name in ("diffusers", "av", "decord", "torchcodec", "safetensors", "numpy"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, gpu_memory_gib=gib(props.total_memory))
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["driver"] = f"nvidia-smi failed: {exc}"
    return info


def child_encode(spec: str, dtype: str, shape: str, out: str) -> None:
    """The exactness section's second process: the same VAE folder and input, latents to a safetensors file."""
    import torch
    from safetensors.torch import save_file

    from vaecache.vae import load_vae

    device = "cuda" if torch.cuda.is_available() else "cpu"
    views, frames, height, width = (int(v) for v in shape.split(","))
    runner = load_vae(spec, device, dtype)
    result = runner.encode_views(smooth_clip(views, frames, height, width))
    save_file({"mean": result.mean.cpu().contiguous(), "logvar": result.logvar.cpu().contiguous()}, out)


def section_fast_encode(check: Check, family: str = "wan2.1") -> dict[str, Any]:
    """--encoder-impl fast against diffusers' encode of the same weights and input, side by side in this process
    (scripts/bench_wan_encoder.py's measurement: s/view, speedup, peak memory, TFLOP/s and fraction of the bf16
    matrix-product peak, distance to the fp32 encode, bitwise repeats, and bitwise in a second process with a
    fresh compile cache that compiled another shape first), at 33 and 81 x 480x832 (Wan 2.1) or 33 (others);
    then through load_vae's runner: what auto resolves to in bf16 and whether two views encoded together equal
    each encoded alone (K = 1), bit for bit."""
    import bench_wan_encoder as bw
    import torch

    from vaecache.models._wan_fast import production_variant
    from vaecache.vae import load_vae

    compiled, pads = production_variant(check.device)
    variant = "c4-" + ("rows" if compiled else "eager") + ("-pad" + "+".join(map(str, pads)) if pads else "")
    shapes = ["9x32x32"] if check.smoke else ["33x480x832", "81x480x832"] if family == "wan2.1" else ["33x480x832"]
    args = bw.parse_args(["--device", str(check.device), "--family", family, "--variants", variant,
                          "--second-process", "--out", str(check.tmp / f"fast_encode_{family}.json")]
                         + (["--smoke"] if check.smoke else []))
    bench = bw.Bench(args)
    if check.cuda:
        bench.results["env"] = {"bf16_matmul_tflops": bl.rnd(bench.matmul_peak() or 0.0, 4)}
    vae = bw.build_vae(family, check.smoke, check.device)
    for text in shapes:
        bw.measure_shape(bench, vae, bw.parse_shape(text))
        check.release()
    del vae
    check.release()
    result: dict[str, Any] = {"variant": variant, **bench.results["fast_encode"][family],
                              "bf16_matmul_tflops": bench.results.get("env", {}).get("bf16_matmul_tflops")}
    runner = load_vae(check.spec(family), check.device, "bf16", encoder_impl="auto")
    x = check.clip(2, frames=9 if check.smoke else 17)
    together = runner.encode_views(x)
    alone = [runner.encode_views(x[i:i + 1]) for i in range(2)]
    result["runner"] = {
        "auto_resolves_to": runner.model.encoder_impl, "encoder_variant": runner.model.encoder_variant,
        "views_together_equal_alone": all(torch.equal(a.mean, together.mean[i:i + 1])
                                          and torch.equal(a.logvar, together.logvar[i:i + 1])
                                          for i, a in enumerate(alone)),
    }
    return result


def section_conditions(check: Check) -> dict[str, Any]:
    """The first-frame image-to-video condition (vaecache.conditions): its VAE encode beside the latents' encode of
    the same views at the production settings (Wan 2.1, bf16, --encoder-impl auto), s/view; then, in fp32 with the
    reference encoder on a small clip, the pipeline tensor vaecache builds against diffusers' own
    WanImageToVideoPipeline.prepare_latents on the same frame and module, bit for bit."""
    import functools
    import types

    import torch
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline

    from vaecache.conditions.kinds import condition_video, pipeline_condition
    from vaecache.vae import load_vae

    spec = check.spec("wan2.1")
    if check.smoke:  # the pipeline's frame rule (4x temporal, 8x spatial, 16 channels), as small as it goes
        import diffusers

        folder = check.tmp / "vae" / "wan2.1-i2v-smoke"
        if not (folder / "config.json").exists():
            torch.manual_seed(SEED)
            diffusers.AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                       temperal_downsample=[False, True, True]).save_pretrained(folder)
        spec = f"diffusers:{folder}"
    runner = load_vae(spec, check.device, "bf16", encoder_impl="auto")
    x = check.clip(2)
    video = condition_video(x, "first-frame")
    runner.encode_views(x)  # warm-up (and the compile of the fast encoder's kernels, where it runs)
    latent_times, _ = timed_runs(check, functools.partial(runner.encode_views, x), 2)
    condition_times, conditions = timed_runs(check, functools.partial(runner.encode_views, video), 2)
    result: dict[str, Any] = {
        "shape": list(x.shape), "encoder_variant": runner.model.encoder_variant,
        "latent_s_per_view": bl.rnd(bl.median(latent_times) / 2, 4),
        "condition_s_per_view": bl.rnd(bl.median(condition_times) / 2, 4),
        "condition_bitwise_repeat": torch.equal(conditions[0].mean, conditions[1].mean)}
    result["condition_over_latent"] = bl.rnd(result["condition_s_per_view"] / result["latent_s_per_view"], 4)
    del runner, conditions
    check.release()

    reference = load_vae(spec, check.device, "fp32", encoder_impl="reference")
    frames, (height, width) = 9, (check.size if check.smoke else (96, 160))
    small = check.clip(1, size=(height, width), frames=frames)
    module = reference.model.module
    config, temporal, spatial = module.config, module.config.scale_factor_temporal, module.config.scale_factor_spatial
    ours = pipeline_condition(reference.encode_views(condition_video(small, "first-frame")).mean, "first-frame",
                              frames, temporal, config.latents_mean, config.latents_std)
    pipeline = types.SimpleNamespace(vae=module, config=types.SimpleNamespace(expand_timesteps=False),
                                     vae_scale_factor_temporal=temporal, vae_scale_factor_spatial=spatial)
    noise = torch.zeros(1, config.z_dim, (frames - 1) // temporal + 1, height // spatial, width // spatial,
                        device=check.device)
    with torch.no_grad():
        _, theirs = WanImageToVideoPipeline.prepare_latents(
            pipeline, small[:, :, 0].to(check.device), 1, config.z_dim, height, width, frames, torch.float32,
            check.device, None, noise, None)
    result.update(exact_shape=[1, 3, frames, height, width],
                  pipeline_tensor_bitwise_equal_diffusers=torch.equal(ours[0].to(check.device), theirs[0]),
                  pipeline_tensor_vs_diffusers=rel_diff(ours[0], theirs[0]))
    return result


def section_exactness(check: Check) -> dict[str, Any]:
    """Wan 2.1, fp32, one view: repeated encodes in this process and in a second one bitwise equal with the settings
    vaecache uses (cuDNN heuristics, deterministic algorithms, no TF32), and the cost of those settings against
    cudnn.benchmark=True."""
    import torch
    from safetensors.torch import load_file

    from vaecache.vae import load_vae
    from vaecache.vae.load import exact_cuda_numerics

    spec = check.spec("wan2.1")
    runner = load_vae(spec, check.device, "fp32")
    x = check.clip(1)
    encode = lambda: runner.encode_views(x)  # noqa: E731
    first_s, first = timed(check, encode)
    times, again = timed_runs(check, encode, 2)
    same_process = all(torch.equal(r.mean, first.mean) and torch.equal(r.logvar, first.logvar) for r in again)
    check.kept["wan2.1_fp32"] = first.mean.cpu()

    child_out = check.tmp / "exactness-child.safetensors"
    shape = ",".join(str(v) for v in x.shape[:1] + x.shape[2:])
    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child-encode", spec, "fp32", shape, str(child_out)], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child_s = time.perf_counter() - started
    other = load_file(child_out)
    other_process = (torch.equal(other["mean"], first.mean.cpu()) and torch.equal(other["logvar"], first.logvar.cpu()))

    result: dict[str, Any] = {
        "shape": list(x.shape), "bitwise_equal_same_process": same_process,
        "bitwise_equal_other_process": other_process, "first_encode_s": bl.rnd(first_s, 4),
        "deterministic_s_per_view": bl.rnd(bl.median(times), 4), "other_process_wall_s": bl.rnd(child_s, 3),
    }
    if check.cuda:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
        try:
            tune_s, tuned = timed(check, encode)
            bench_times, bench_runs = timed_runs(check, encode, 2)
        finally:
            exact_cuda_numerics(check.device)
        result.update(
            benchmark_autotune_first_s=bl.rnd(tune_s, 4), benchmark_s_per_view=bl.rnd(bl.median(bench_times), 4),
            deterministic_cost=bl.rnd(bl.median(times) / bl.median(bench_times), 4),
            benchmark_runs_bitwise_equal=all(torch.equal(r.mean, tuned.mean) for r in bench_runs),
            benchmark_vs_deterministic=rel_diff(tuned.mean, first.mean))
    return result


def section_oom_backoff(check: Check) -> dict[str, Any]:
    """Four views, K = 4 per forward. On CUDA the process's memory is capped (set_per_process_memory_fraction)
    between what one view and four views need, so the first forward fails for real; on CPU the error is injected.
    The backoff must finish every view, with latents equal to an uncapped run at K = 1."""
    import torch

    from vaecache.vae import load_vae
    from vaecache.vae.runner import VaeRunner

    views = 4
    dtype = "bf16"
    x = check.clip(views)
    spec = check.spec("wan2.1")
    one = load_vae(spec, check.device, dtype, views_per_forward=1)
    _, peak_one, ref_one = peak_of(check, lambda: one.encode_views(x[:1]))
    _, _, ref_k1 = peak_of(check, lambda: one.encode_views(x))
    one = None  # its weights off the device before the cap
    many = load_vae(spec, check.device, dtype, views_per_forward=views)
    _, peak_many, ref_many = peak_of(check, lambda: many.encode_views(x))
    result: dict[str, Any] = {"views": views, "dtype": dtype, "shape": list(x.shape),
                              "peak_gib_k1": gib(peak_one), "peak_gib_k4": gib(peak_many)}
    if check.cuda:
        check.release()
        total = torch.cuda.get_device_properties(check.device).total_memory
        allowed = torch.cuda.memory_allocated(check.device) + 1.5 * peak_one
        fraction = min(1.0, allowed / total)
        result.update(cap_gib=gib(allowed), cap_fraction=bl.rnd(fraction, 4),
                      cap_below_k4=allowed < torch.cuda.memory_allocated(check.device) + peak_many)
        torch.cuda.set_per_process_memory_fraction(fraction, check.device)
        capped = VaeRunner(many.model)
    else:
        capped = VaeRunner(many.model, inject_oom=lambda units, tiled: units > 1)
        result["injected"] = "out-of-memory error raised before every forward of more than one view"
    try:
        seconds, backed_off = timed(check, lambda: capped.encode_views(x))
    finally:
        if check.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, check.device)
            check.release()
    result.update(
        views_equal_to_uncapped_k1=[torch.equal(backed_off.mean[v], ref_k1.mean[v]) for v in range(views)],
        uncapped_k4_vs_k1=rel_diff(ref_many.mean.float(), ref_k1.mean.float()),
        backoff_events=backed_off.backoffs, failed_views=backed_off.failed, forward_sizes=backed_off.forward_sizes,
        tiled_views=sorted(backed_off.tiled), seconds=bl.rnd(seconds, 4),
        completed=not backed_off.failed and bool(backed_off.backoffs),
        bitwise_equal_to_uncapped_k1=torch.equal(backed_off.mean, ref_k1.mean),
        first_view_equal_alone=torch.equal(backed_off.mean[:1], ref_one.mean),
        bitwise_equal_to_uncapped_k4=torch.equal(backed_off.mean, ref_many.mean),
        vs_uncapped_k4=rel_diff(backed_off.mean.float(), ref_many.mean.float()))
    return result


def section_oom_backoff_expandable(check: Check) -> dict[str, Any]:
    """oom_backoff again in a fresh process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (it must be set
    before CUDA starts): whether the allocator's fragmentation, not the model, is what sends single views to the
    tiling fallback under a tight cap."""
    out = check.tmp / "oom-expandable.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    argv = [sys.executable, __file__, "--device", str(check.device), "--out", str(out), "--tmp", str(check.tmp),
            "--sections", "oom_backoff"] + (["--smoke"] if check.smoke else [])
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())["oom_backoff"]
    result["allocator"] = env["PYTORCH_CUDA_ALLOC_CONF"]
    return result


def section_bf16_vs_fp32(check: Check) -> dict[str, Any]:
    """Wan 2.1, one view: bf16 latents against fp32 ones, and the speed of each."""
    from vaecache.vae import load_vae

    x = check.clip(1)
    out: dict[str, Any] = {"shape": list(x.shape)}
    means = {}
    for dtype in ("fp32", "bf16"):
        if dtype == "fp32" and "wan2.1_fp32" in check.kept:
            means[dtype] = check.kept["wan2.1_fp32"]
            continue
        runner = load_vae(check.spec("wan2.1"), check.device, dtype)
        timed(check, lambda r=runner: r.encode_views(x))
        seconds, result = timed(check, lambda r=runner: r.encode_views(x))
        out[f"{dtype}_s_per_view"] = bl.rnd(seconds, 4)
        means[dtype] = result.mean.cpu()
        runner = None
        check.release()
    out["bf16_vs_fp32"] = rel_diff(means["bf16"].float(), means["fp32"].float())
    return out


def run_pipeline(check: Check, dtype: str) -> dict[str, Any]:
    """scripts/bench.py on Wan 2.1: encode-only ceiling, vaecache's pipeline and the naive loop, side by side."""
    import bench

    size = "x".join(map(str, check.size))
    argv = ["--vae", check.spec("wan2.1"), "--device", str(check.device), "--dtype", dtype,
            "--size", size, "--source-size", size, "--frames", str(check.frames), "--num-frames", str(check.frames),
            "--tmp", str(check.tmp / f"pipeline-{dtype}")]
    argv += (["--scenes", "2", "--cameras", "2", "--workers", "0", "--repeats", "1"] if check.smoke else
             ["--scenes", "4", "--cameras", "2", "--workers", "4", "--repeats", "2"])
    with contextlib.redirect_stdout(io.StringIO()):
        result = bench.main(argv)
    keep = ("views_per_s", "efficiency", "speedup_vs_naive", "wall_views_per_s", "vaecache_stages",
            "encode_slowdown_in_vaecache", "config")
    return {k: result[k] for k in keep if k in result}


def section_memory(check: Check, family: str, size: tuple[int, int] | None = None) -> dict[str, Any]:
    """One family, fp32 and bf16: peak memory and time of one view, two views (the per-view increment and the
    --views-per-forward that fits), one view with the model's tiling, and bf16 against fp32."""
    import torch

    from vaecache.vae import load_vae

    spec = check.spec(family)
    one = check.clip(1, size)
    two = check.clip(2, size)
    total = torch.cuda.get_device_properties(check.device).total_memory if check.cuda else float("nan")
    out: dict[str, Any] = {"shape": list(one.shape)}
    means = {}
    for dtype in ("fp32", "bf16"):
        runner = load_vae(spec, check.device, dtype, views_per_forward=2)
        weights = sum(p.numel() * p.element_size() for p in runner.model.module.parameters())
        s1, peak1, r1 = peak_of(check, lambda r=runner: r.encode_views(one))
        s2, peak2, _ = peak_of(check, lambda r=runner: r.encode_views(two))
        means[dtype] = r1.mean.cpu()
        row: dict[str, Any] = {"weights_gib": gib(weights), "peak_gib_1_view": gib(peak1),
                               "peak_gib_2_views": gib(peak2), "s_first_view": bl.rnd(s1, 4),
                               "s_per_view_at_2": bl.rnd(s2 / 2, 4)}
        per_view = peak2 - peak1
        if check.cuda and per_view > 0:
            fixed = max(0.0, peak1 - per_view)
            for card, memory in (("this_gpu", total), ("80GiB", 80 * 2**30)):
                budget = 0.9 * memory - weights - fixed
                row[f"views_per_forward_fits_{card}"] = max(0, math.floor(budget / per_view))
        runner = None
        check.release()
        tiled = load_vae(spec, check.device, dtype, tiling=True)
        st, peak_t, rt = peak_of(check, lambda r=tiled: r.encode_views(one))
        row.update(tiled_peak_gib_1_view=gib(peak_t), tiled_s_per_view=bl.rnd(st, 4),
                   tiled_vs_untiled=rel_diff(rt.mean.cpu().float(), means[dtype].float()),
                   tile_params=tiled.model.tile_params)
        tiled = None
        check.release()
        out[dtype] = row
    out["bf16_vs_fp32"] = rel_diff(means["bf16"].float(), means["fp32"].float())
    return out


def section_decode(check: Check) -> dict[str, Any]:
    """h264 and HEVC at 1080p, written with PyAV: frames/s of vaecache's PyAV reader, decord, and torchcodec on CPU
    and CUDA (NVDEC) where it imports, each with its PSNR against PyAV's frames."""
    import numpy as np

    from vaecache.video.backends import DecordReader, TorchcodecReader, backend_unavailable
    from vaecache.video.reader import VideoReader

    height, width = (64, 96) if check.smoke else (1080, 1920)
    frames = 9 if check.smoke else 60
    out: dict[str, Any] = {"size": f"{height}x{width}", "frames": frames, "unmeasured": {}}
    for codec in ("libx264", "libx265"):
        path = check.tmp / f"decode-{codec}.mp4"
        write_video(path, codec, frames, height, width)
        readers: dict[str, Callable[[], Any]] = {"pyav": lambda p=path: VideoReader(str(p))}
        if backend_unavailable("decord") is None:
            readers["decord"] = lambda p=path: DecordReader(str(p))
        else:
            out["unmeasured"]["decord"] = backend_unavailable("decord")
        reason = backend_unavailable("torchcodec")
        if reason is None:
            readers["torchcodec-cpu"] = lambda p=path: TorchcodecReader(str(p), "cpu")
            if check.cuda:
                readers["torchcodec-cuda"] = lambda p=path: TorchcodecReader(str(p), str(check.device))
        else:
            out["unmeasured"]["torchcodec"] = reason
        reference = None
        rows: dict[str, Any] = {}
        for name, make in readers.items():
            try:
                best, pixels = float("inf"), None
                for _ in range(2):
                    start = time.perf_counter()
                    with make() as reader:
                        pixels = reader.read(list(range(frames)))
                    best = min(best, time.perf_counter() - start)
            except Exception as exc:  # a backend that cannot read this file is a finding, not a crash
                rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            if reference is None:
                reference = pixels
            mse = float(np.mean((pixels.astype(np.float64) - reference.astype(np.float64)) ** 2))
            rows[name] = {"frames_per_s": bl.rnd(frames / best, 4),
                          "psnr_vs_pyav_db": float("inf") if mse == 0 else bl.rnd(10 * math.log10(255**2 / mse), 4)}
        out[codec] = rows
    return out


def write_video(path: Path, codec: str, frames: int, height: int, width: int) -> None:
    """A moving smooth pattern (not noise: encoders and their decoders behave as on footage)."""
    import av
    import numpy as np

    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx265":
            stream.options = {"x265-params": "log-level=error"}
        for t in range(frames):
            r = 127 + 120 * np.sin((xx + 7 * t) / 37.0)
            g = 127 + 120 * np.sin((yy - 5 * t) / 23.0)
            b = 127 + 120 * np.sin((xx + yy + 3 * t) / 51.0)
            rgb = np.stack([r, g, b], axis=-1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def section_spatial(check: Check) -> dict[str, Any]:
    """Wan 2.1 fp32 on one device: spatial_encode with no group (G = 1) against the runner's unsplit encode, and
    the peak memory of one rank's band at G = 2, 4, 8 (the band encoded alone: what each rank's activations need,
    halo rows aside)."""
    import torch

    from vaecache.parallel.spatial import plan_bands, spatial_encode
    from vaecache.vae import load_vae

    runner = load_vae(check.spec("wan2.1"), check.device, "fp32")
    module = runner.model.module
    x = check.clip(1)
    _, peak_runner, whole = peak_of(check, lambda: runner.encode_views(x))
    xd = x.to(check.device)
    with torch.inference_mode():
        s1, peak1, moments = peak_of(check, lambda: spatial_encode(module, xd, None))
    mean = moments.chunk(2, dim=1)[0]
    out: dict[str, Any] = {"shape": list(x.shape), "g1_bitwise_equal_to_unsplit": torch.equal(mean, whole.mean),
                           "g1_s": bl.rnd(s1, 4), "g1_peak_gib": gib(peak1), "bands": {}}
    factor = int(module.spatial_compression_ratio)
    for groups in (2, 4, 8):
        if x.shape[-2] // factor < groups:
            out["bands"][str(groups)] = {"skipped": f"{x.shape[-2] // factor} latent rows cannot make {groups} bands"}
            continue
        plan = plan_bands(x.shape[-2], factor, groups)
        start, stop = plan.pixel_rows(0)
        band = xd[..., start:stop, :]
        with torch.inference_mode():
            seconds, peak, _ = peak_of(check, lambda b=band: module.encode(b).latent_dist.mean)
        out["bands"][str(groups)] = {"rows": stop - start, "peak_gib": gib(peak), "s": bl.rnd(seconds, 4),
                                     "peak_vs_g1": bl.rnd(peak / peak1, 4) if peak1 == peak1 and peak1 else None}
    return out


def section_pixel_decoder(check: Check) -> dict[str, Any]:
    """scripts/bench_pixel_loss.py: peak memory and time of one pixel-loss step (forward + backward through the
    decoder) per PixelDecoder variant against the plain autograd decode, Wan 2.1, each variant in a fresh process."""
    import bench_pixel_loss

    argv = (["--model", "tiny", "--size", "32x32", "--frames", "5", "--repeats", "1"] if check.smoke else
            ["--model", "wan2.1", "--size", "x".join(map(str, check.size)), "--frames", "17", "--repeats", "2"])
    argv += ["--device", str(check.device)]
    with contextlib.redirect_stdout(io.StringIO()):
        result = bench_pixel_loss.main(argv)
    return {"rows": result["rows"], "config": result["config"]}


def section_formats(check: Check) -> dict[str, Any]:
    """scripts/bench_formats.py: fp32/bf16 x contiguous/channels_last_3d, and torch.compile, on Wan 2.1."""
    import bench_formats

    argv = (["--model", "tiny", "--views", "1", "--frames", str(check.frames), "--size", "32x32", "--repeats", "1"]
            if check.smoke else
            ["--model", "wan2.1", "--views", "1", "--frames", str(check.frames),
             "--size", "x".join(map(str, check.size)), "--repeats", "3"])
    argv += ["--device", str(check.device)]
    if not check.args.no_compile and not check.smoke:
        argv.append("--compile")
    with contextlib.redirect_stdout(io.StringIO()):
        result = bench_formats.main(argv)
    return {"modes": result["modes"], "compile_s": result["compile_s"], "config": result["config"]}


RUNNERS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "env": section_env,
    "fast_encode": section_fast_encode,
    "fast_encode_wan2.2-ti2v": lambda c: section_fast_encode(c, "wan2.2-ti2v"),
    "conditions": section_conditions,
    "exactness": section_exactness,
    "oom_backoff": section_oom_backoff,
    "oom_backoff_expandable": section_oom_backoff_expandable,
    "bf16_vs_fp32": section_bf16_vs_fp32,
    "pipeline_bf16": lambda c: run_pipeline(c, "bf16"),
    "memory_wan2.1": lambda c: section_memory(c, "wan2.1"),
    "memory_wan2.1_720p": lambda c: section_memory(c, "wan2.1", c.big_size),
    "memory_wan2.2-ti2v": lambda c: section_memory(c, "wan2.2-ti2v"),
    "memory_hunyuanvideo": lambda c: section_memory(c, "hunyuanvideo"),
    "memory_ltx-video": lambda c: section_memory(c, "ltx-video"),
    "memory_cogvideox": lambda c: section_memory(c, "cogvideox"),
    "decode": section_decode,
    "spatial": section_spatial,
    "pixel_decoder": section_pixel_decoder,
    "formats": section_formats,
    "pipeline_fp32": lambda c: run_pipeline(c, "fp32"),
}


# --------------------------------------------------------------------------- table


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    """One line per section: the figures a reader looks for first."""
    rows = []
    for name in SECTIONS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            rows.append((name, f"ERROR {r['error']}"))
        elif name == "env":
            rows.append((name, f"{r.get('gpu') or r['machine']['cpu_model']}, driver {r.get('driver', '-')}, "
                               f"torch {r['torch']}, CUDA {r['cuda_runtime']}, cuDNN {r['cudnn']}"))
        elif name.startswith("fast_encode"):
            parts = []
            for key, shape in r.items():
                b = shape.get("bf16") if isinstance(shape, dict) else None
                v = (b or {}).get("variants", {}).get(r["variant"])
                if v and "error" not in v:
                    parts.append(f"{key} {v['speedup_vs_reference']}x ({v['fast_s_per_view']} s/view, "
                                 f"{v.get('fraction_of_peak', '-')} of peak), accuracy ok {v.get('accuracy_ok')}, "
                                 f"repeat {v['bitwise_repeat']}, other process {v.get('bitwise_other_process')}")
                elif v:
                    parts.append(f"{key} {v['error']}")
            runner = r.get("runner", {})
            rows.append((name, "; ".join(parts) + f"; auto -> {runner.get('auto_resolves_to')}, views together = "
                                                  f"alone {runner.get('views_together_equal_alone')}"))
        elif name == "conditions":
            rows.append((name, f"condition {r['condition_s_per_view']} s/view vs latents {r['latent_s_per_view']} "
                               f"({r['condition_over_latent']}x, {r['encoder_variant']}), repeat "
                               f"{r['condition_bitwise_repeat']}; prepare_latents bitwise "
                               f"{r['pipeline_tensor_bitwise_equal_diffusers']}"))
        elif name == "exactness":
            line = (f"same process {r['bitwise_equal_same_process']}, other process "
                    f"{r['bitwise_equal_other_process']}, {r['deterministic_s_per_view']} s/view")
            if "deterministic_cost" in r:
                line += (f"; cudnn.benchmark {r['benchmark_s_per_view']} s/view (deterministic costs "
                         f"{r['deterministic_cost']}x), its latents vs ours "
                         f"{r['benchmark_vs_deterministic']['max_abs_rel']:.1e}")
            rows.append((name, line))
        elif name.startswith("oom_backoff"):
            rows.append((name, f"completed {r['completed']}, forwards {r['forward_sizes']}, equal to K=1 "
                               f"{r['bitwise_equal_to_uncapped_k1']} (per view {r.get('views_equal_to_uncapped_k1')}), "
                               f"tiled {r['tiled_views']}, failed {len(r['failed_views'])}"))
        elif name == "bf16_vs_fp32":
            rows.append((name, f"max |diff| / max |fp32| {r['bf16_vs_fp32']['max_abs_rel']:.2e}, "
                               f"relative L2 {r['bf16_vs_fp32']['l2_rel']:.2e}"))
        elif name.startswith("pipeline"):
            v = r["views_per_s"]
            rows.append((name, f"views/s encode-only {v['encode_only']}, vaecache {v['vaecache']}, naive {v['naive']}; "
                               f"efficiency {r['efficiency']}, speedup vs naive {r['speedup_vs_naive']}, encoder busy "
                               f"{r.get('vaecache_stages', {}).get('encoder_busy')}"))
        elif name.startswith("memory"):
            parts = []
            for dtype in ("fp32", "bf16"):
                d = r[dtype]
                parts.append(f"{dtype} {d['peak_gib_1_view']} GiB/view ({d['tiled_peak_gib_1_view']} tiled), "
                             f"{d['s_per_view_at_2']} s/view, K fits {d.get('views_per_forward_fits_this_gpu', '-')}")
            rows.append((name, "; ".join(parts) + f"; bf16 vs fp32 {r['bf16_vs_fp32']['max_abs_rel']:.1e}"))
        elif name == "decode":
            parts = [f"{codec[3:]}: " + ", ".join(f"{k} {v.get('frames_per_s', v.get('error'))} fps"
                                                 for k, v in r[codec].items()) for codec in ("libx264", "libx265")]
            rows.append((name, "; ".join(parts)))
        elif name == "spatial":
            bands = ", ".join(f"G={g} {b['peak_gib']} GiB" for g, b in r["bands"].items() if "peak_gib" in b)
            rows.append((name, f"G=1 equal {r['g1_bitwise_equal_to_unsplit']}, {r['g1_peak_gib']} GiB; "
                               f"band peaks {bands}"))
        elif name == "pixel_decoder":
            rows.append((name, ", ".join(f"{row['variant']} " + (f"x{row['memory_vs_plain']} memory, "
                                                                     f"x{row['time_vs_plain']} time"
                                                                     if "error" not in row else row["error"])
                                         for row in r["rows"])))
        elif name == "formats":
            modes = ", ".join(f"{k} x{v['speed_vs_fp32_contiguous']}" for k, v in r["modes"].items())
            rows.append((name, modes + (f"; compile {r['compile_s']} s" if r.get("compile_s") else "")))
    return rows


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child_encode:
        child_encode(*args.child_encode)
        return {}
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    own_tmp = args.tmp is None
    tmp = Path(tempfile.mkdtemp(prefix="vaecache-gpu-check-")) if own_tmp else Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    check = Check(args, tmp)
    if args.resume and check.out.exists():
        check.results = json.loads(check.out.read_text())
    try:
        for name in SECTIONS:
            if name not in wanted:
                continue
            if args.resume and name in check.results and "error" not in check.results[name]:
                bl.progress(f"{name}: already in {check.out}")
                continue
            bl.progress(f"{name} ...")
            started = time.perf_counter()
            try:
                result = RUNNERS[name](check)
            except Exception as exc:
                traceback.print_exc()
                result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                check.release()
                if check.cuda:
                    check.torch.cuda.set_per_process_memory_fraction(1.0, check.device)
            result["section_s"] = bl.rnd(time.perf_counter() - started, 4)
            check.results[name] = result
            check.write()
            bl.progress(f"{name}: {result['section_s']} s")
        check.results["unmeasured"] = dict(UNMEASURED_ON_ONE_GPU)
        decode = check.results.get("decode", {})
        check.results["unmeasured"].update({f"decode_{k}": v for k, v in decode.get("unmeasured", {}).items()})
        check.write()
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = summary_rows(check.results)
    width = max((len(name) for name, _ in rows), default=0)
    human = "\n".join([f"gpu_check.py on {check.device}" + (" (smoke: tiny configs and shapes)" if args.smoke else "")]
                      + [f"{name.ljust(width)}  {line}" for name, line in rows])
    bl.emit(check.results, human)
    return check.results


if __name__ == "__main__":
    main()
