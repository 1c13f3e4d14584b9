#!/usr/bin/env python
"""DP-only against sequence parallel (SP=2, SP=4) on the same ranks and data, in one torchrun launch.

One ``torchrun --nproc-per-node N`` launch runs every configuration, repeats interleaved (the order
rotates between repeats), on the same clips:

* encoder stage (per-clip latency): each rank decodes its views of every batch first, then, per batch,
  times ``encode_views(its views)`` + ``vaecache.parallel.gather_views`` (the pipeline's encoder stage)
  from the batch entering the encoder to all of its latents gathered on this rank;
* end to end (throughput): ``vaecache.encode.command.run_encode`` with ``--sp-size`` S (decode workers, writer,
  manifest) between two world barriers.

DP-only is SP=1: every rank encodes all cameras of its own clips, no collectives per batch.
JSON goes to stdout, a table to stderr.

    python scripts/bench_sp.py --nproc 4 --sp-sizes 1,2,4 --scenes 8 --cameras 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _benchlib as bl  # noqa: E402

NOTES = [
    "latency_ms: per batch (one clip at --batch-size 1), on every rank, from the batch entering the encoder "
    "(encode_views of this rank's views) to the batch's latents gathered on this rank (gather_views, an "
    "all_gather in the SP group); median over ranks, batches and repeats. Views were decoded beforehand, so "
    "decode is not in it. The vaecache per-rank logs carry no per-batch timestamps, hence this direct measure.",
    "encoder_views_per_s: all views / the slowest rank's time for its whole encoder-stage loop (median of repeats).",
    "e2e_views_per_s: views / wall time of run_encode on all ranks between two world barriers (VAE load, probing, "
    "decode workers, encode, all_gather, writer thread, manifest): what a precompute job gets.",
    "e2e_batch_interval_ms: median time between two batches finishing on a rank inside run_encode (decode "
    "overlapped by workers, encode, gather, handing the clip to the writer).",
    "peak_rss_mb_per_rank: sampled RSS of each rank (and its decode workers) during the encoder-stage loop; max "
    "over ranks. input_mb_per_rank: the decoded views one rank holds for one batch.",
    "Both stages run --views-per-forward 1 (one camera per forward; the default, all cameras of a clip in one "
    "forward, leaves SP nothing to split in a one-clip batch). "
    "A rank then never runs more than one view per forward, so SP "
    "lowers per-rank memory only by the input views it holds (and the per-batch buffers), not by the VAE's "
    "activations: SP here splits the cameras of a clip over ranks, not the frames or pixels of one view. A view "
    "too big for one device needs --tiling, not SP.",
    "padding_waste: share of encoded views that are repeats, added so every SP rank encodes the same number of "
    "views ((padded - N) / padded per batch); zero when the cameras per batch divide by the SP size.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae", default="builtin:tiny")
    p.add_argument("--nproc", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--sp-sizes", default="1,2,4", help="comma-separated SP sizes; 1 is DP-only")
    p.add_argument("--scenes", type=int, default=8)
    p.add_argument("--cameras", type=int, default=4)
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--num-frames", type=int, default=17)
    p.add_argument("--size", default="64x64")
    p.add_argument("--source-size", default="96x128")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--workers", type=int, default=0, help="decode workers per rank in the end-to-end run")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--store", default="mean-logvar", choices=("mean-logvar", "mean"),
                   help="what the end-to-end run stores (mean for VAEs without a log-variance)")
    p.add_argument("--no-e2e", action="store_true", help="encoder-stage latency only (no run_encode)")
    p.add_argument("--tmp", default=None)
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- worker (one per rank)


def worker(args: argparse.Namespace) -> None:
    import torch

    from vaecache.distributed.context import distributed
    from vaecache.distributed.mesh import make_mesh
    from vaecache.encode.command import run_encode
    from vaecache.parallel import gather_views, plan_sp
    from vaecache.planning.clips import plan_clips
    from vaecache.planning.jobs import assign, batch_views, batched
    from vaecache.settings.buckets import parse_size
    from vaecache.settings.clip import ClipSettings, SamplingConfig
    from vaecache.settings.commands import EncodeConfig
    from vaecache.settings.parts import DecodeConfig, OutConfig, ParallelConfig, SourceConfig, VaeConfig
    from vaecache.sources.discover import discover_scenes
    from vaecache.sources.probing import probe_scene
    from vaecache.vae import load_vae
    from vaecache.video.dataset import ViewBatchDataset

    if not args.vae.startswith("python:"):
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()  # diffusers warns on every module.to(dtype)
    data, result_file = Path(args._data), Path(args._result)
    height, width = parse_size(args.size)
    sp_sizes = [int(x) for x in args.sp_sizes.split(",")]
    with distributed(sp_size=1, device=args.device, timeout_s=900) as world:
        rank, size = world.info.rank, world.info.world_size
        vae = load_vae(args.vae, world.device, args.dtype)
        scenes = discover_scenes(data)
        clips, _ = plan_clips(scenes, {s.scene_id: probe_scene(s) for s in scenes}, SamplingConfig(args.num_frames))

        # Per SP size: this rank's batches, plans and pre-decoded views (decode is not part of the latency).
        setups: dict[int, dict[str, Any]] = {}
        for sp in sp_sizes:
            mesh = make_mesh(rank, size, sp)
            batches = batched(assign(clips, mesh.dp_rank, mesh.dp_size), args.batch_size)
            plans = [plan_sp(len(batch_views(b)), sp) for b in batches]
            indices = [plan.view_indices(mesh.sp_rank) for plan in plans]
            dataset = ViewBatchDataset(batches, indices, height, width)
            views = [dataset[i]["views"] for i in range(len(batches))]
            setups[sp] = {"plans": plans, "views": views, "batches": batches}
        mean = vae.encode_views(setups[sp_sizes[0]]["views"][0])  # warm-up
        del mean

        records: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            shift = repeat % len(sp_sizes)
            for sp in sp_sizes[shift:] + sp_sizes[:shift]:
                setup = setups[sp]
                with distributed(sp_size=sp, device=args.device, timeout_s=900) as ctx:
                    world.barrier()
                    latencies = []
                    with bl.RssSampler() as rss:
                        loop_start = time.perf_counter()
                        for views, plan in zip(setup["views"], setup["plans"]):
                            start = time.perf_counter()
                            out = vae.encode_views(views)
                            m, lv = (out[0], out[1]) if isinstance(out, tuple) else (out.mean, out.logvar)
                            moments = m if lv is None else torch.cat([m, lv], dim=1)
                            gather_views(moments, plan, ctx.sp_group)
                            if world.device.type == "cuda":
                                torch.cuda.synchronize(world.device)
                            latencies.append(time.perf_counter() - start)
                        loop_s = time.perf_counter() - loop_start
                    world.barrier()
                    record = {"sp": sp, "repeat": repeat, "rank": rank, "latency_s": latencies, "loop_s": loop_s,
                              "views": sum(p.num_views for p in setup["plans"]),
                              "encoded_views": sum(v.shape[0] for v in setup["views"]),
                              "padded_views": sum(p.padded if not p.is_local else p.num_views for p in setup["plans"]),
                              "input_mb_per_batch": max((v.numel() * v.element_size() for v in setup["views"]),
                                                        default=0) / 2**20,
                              "peak_rss_mb": rss.peak_mb, "peak_pss_mb": rss.peak_pss_mb}
                    if not args.no_e2e:
                        out_dir = data.parent / f"out-sp{sp}-r{repeat}"
                        clip = ClipSettings(SamplingConfig(num_frames=args.num_frames), height, width,
                                            dtype=args.dtype, store=args.store, views_per_forward=1)
                        cfg = EncodeConfig(SourceConfig(data), VaeConfig(args.vae), clip,
                                           OutConfig(out_dir, overwrite=True),
                                           decode=DecodeConfig(workers=args.workers),
                                           parallel=ParallelConfig(device=args.device, batch_size=args.batch_size,
                                                                   sp_size=sp), progress=False)
                        marks: list[float] = []
                        world.barrier()
                        start = time.perf_counter()
                        summary = run_encode(cfg, ctx, lambda done, total: marks.append(time.perf_counter()))  # noqa: B023
                        world.barrier()
                        record["e2e_s"] = time.perf_counter() - start
                        record["e2e_views"] = summary.views
                        record["e2e_intervals_s"] = [b - a for a, b in zip(marks, marks[1:])]
                        if rank == 0:
                            shutil.rmtree(out_dir, ignore_errors=True)
                    records.append(record)
        gathered = world.all_gather_object(records)
        if rank == 0:
            result_file.write_text(json.dumps([r for part in gathered for r in part]))


# --------------------------------------------------------------------------- parent


def summarize(records: list[dict[str, Any]], sp_sizes: list[int], nproc: int, repeats: int) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for sp in sp_sizes:
        mine = [r for r in records if r["sp"] == sp]
        latencies = [x for r in mine for x in r["latency_s"]]
        per_repeat_loop = [max(r["loop_s"] for r in mine if r["repeat"] == k) for k in range(repeats)]
        by_rank0 = [r for r in mine if r["rank"] == 0]
        views = sum(r["views"] for r in mine if r["repeat"] == 0 and r["rank"] % sp == 0)  # one SP member per group
        encoded = sum(r["encoded_views"] for r in mine if r["repeat"] == 0)
        padded = sum(r["padded_views"] for r in mine if r["repeat"] == 0 and r["rank"] % sp == 0)
        row: dict[str, Any] = {
            "sp": sp, "dp": nproc // sp, "label": "DP only" if sp == 1 else f"SP={sp}",
            "views": views,
            "latency_ms": {"median": bl.rnd(1000 * bl.median(latencies), 4),
                           "p90": bl.rnd(1000 * bl.quantile(latencies, 0.9), 4),
                           "min": bl.rnd(1000 * min(latencies), 4)},
            "encoder_views_per_s": bl.rnd(views / bl.median(per_repeat_loop), 4),
            "encoded_views_total": encoded,
            "padding_waste": bl.rnd((padded - views) / padded if padded else 0.0, 3),
            "input_mb_per_rank": bl.rnd(max(r["input_mb_per_batch"] for r in mine), 3),
            "peak_rss_mb_per_rank": bl.rnd(max(r["peak_rss_mb"] for r in mine), 4),
            "peak_pss_mb_per_rank": bl.rnd(max(r["peak_pss_mb"] for r in mine), 4),
        }
        if "e2e_s" in by_rank0[0]:
            e2e = [r["e2e_s"] for r in by_rank0]
            intervals = [x for r in mine for x in r["e2e_intervals_s"]]
            row["e2e_views_per_s"] = bl.rnd(by_rank0[0]["e2e_views"] / bl.median(e2e), 4)
            row["e2e_wall_s"] = bl.rnd(bl.median(e2e), 4)
            row["e2e_batch_interval_ms"] = bl.rnd(1000 * bl.median(intervals), 4) if intervals else None
        configs[row["label"]] = row
    return configs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args._worker:
        worker(args)
        return {}
    from vaecache.demodata import DemoDataSpec, write_demo_dataset
    from vaecache.settings.buckets import parse_size

    sp_sizes = [int(x) for x in args.sp_sizes.split(",") if x.strip()]
    bad = [sp for sp in sp_sizes if args.nproc % sp]
    if bad:
        raise SystemExit(f"--sp-sizes {bad} do not divide --nproc {args.nproc}")
    machine = bl.machine_info(args.device)
    own_tmp = args.tmp is None
    tmp = Path(tempfile.mkdtemp(prefix="vaecache-bench-sp-")) if own_tmp else Path(args.tmp)
    try:
        src_h, src_w = parse_size(args.source_size)
        data = tmp / "data"
        write_demo_dataset(data, DemoDataSpec(scenes=args.scenes, cameras=args.cameras, frames=args.frames,
                                              height=src_h, width=src_w, seed=0))
        result_file = tmp / "records.json"
        passthrough = ["--vae", args.vae, "--sp-sizes", args.sp_sizes, "--num-frames", str(args.num_frames),
                       "--size", args.size, "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                       "--repeats", str(args.repeats), "--device", args.device, "--dtype", args.dtype,
                       "--store", args.store]
        if args.no_e2e:
            passthrough.append("--no-e2e")
        bl.progress(f"torchrun --nproc-per-node {args.nproc}: SP sizes {sp_sizes}, {args.repeats} repeats interleaved")
        with bl.RssSampler(interval=0.2) as rss:
            run = bl.run_timed(bl.torchrun_cmd(args.nproc, str(Path(__file__).resolve()), "--_worker",
                                               "--_data", str(data), "--_result", str(result_file), *passthrough),
                               env=bl.child_env(threads=args.threads))
        bl.check(run, "bench_sp worker launch")
        records = json.loads(result_file.read_text())
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    configs = summarize(records, sp_sizes, args.nproc, args.repeats)
    base = configs.get("DP only")
    if base:
        for row in configs.values():
            row["latency_vs_dp"] = bl.rnd(row["latency_ms"]["median"] / base["latency_ms"]["median"], 3)
            row["encoder_throughput_vs_dp"] = bl.rnd(row["encoder_views_per_s"] / base["encoder_views_per_s"], 3)
            if "e2e_views_per_s" in row:
                row["e2e_throughput_vs_dp"] = bl.rnd(row["e2e_views_per_s"] / base["e2e_views_per_s"], 3)
    result = {
        "configs": configs,
        "launch": {"wall_s": bl.rnd(run.wall_s, 4), "cpu_s": bl.rnd(run.cpu_s, 4),
                   "peak_rss_mb_all_ranks": bl.rnd(rss.peak_mb, 4)},
        "machine": {**machine, "load_avg_at_end": bl.load_avg()},
        "config": {"vae": args.vae, "nproc": args.nproc, "sp_sizes": sp_sizes, "scenes": args.scenes,
                   "cameras": args.cameras, "frames": args.frames, "num_frames": args.num_frames, "size": args.size,
                   "source_size": args.source_size, "batch_size": args.batch_size, "workers": args.workers,
                   "omp_threads_per_rank": args.threads, "repeats": args.repeats, "device": args.device,
                   "dtype": args.dtype, "store": args.store, "e2e": not args.no_e2e},
        "notes": NOTES + ([f"{args.nproc} ranks x {args.threads} thread(s) on {machine['cores_usable']} usable cores: "
                           "ranks share cores, so per-rank compute is slower than on a device of its own."]
                          if args.nproc * args.threads > (machine["cores_usable"] or 1) else []),
    }
    cols = ("config", "lat ms (med)", "lat vs DP", "enc views/s", "e2e views/s", "e2e vs DP", "pad waste",
            "RSS MB/rank")
    rows = [(label, r["latency_ms"]["median"], r.get("latency_vs_dp", "-"), r["encoder_views_per_s"],
             r.get("e2e_views_per_s", "-"), r.get("e2e_throughput_vs_dp", "-"), r["padding_waste"],
             r["peak_rss_mb_per_rank"]) for label, r in configs.items()]
    human = bl.table(f"bench_sp.py: {args.nproc} ranks, {args.scenes} scenes x {args.cameras} cameras, medians of "
                     f"{args.repeats} (load avg {machine['load_avg_at_start']} -> {bl.load_avg()})", cols, rows)
    bl.emit(result, human)
    return result


if __name__ == "__main__":
    main()
