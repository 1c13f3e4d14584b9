"""Spatial-parallel encode: per-rank peak memory, latency per view and exactness at G = 1, 2, 4.

    python scripts/bench_spatial.py [--model wan2.1|tiny] [--size 128x128] [--frames 9] [--groups 1,2,4]

Each G is one torchrun launch (gloo on CPU, NCCL on CUDA). Every rank encodes the same random clip with
spatial_encode on the same random-weight VAE (the published Wan 2.1 VAE config for --model wan2.1: real
compute and memory). Memory is what the encode adds on top of the loaded model: on CUDA
torch.cuda.max_memory_allocated minus memory before; on CPU the peak resident set (VmHWM, reset after a warm-up
encode) minus the resident set before, with glibc's mmap threshold fixed so that freed tensors are returned at once.
G=1 is the unsplit diffusers encode; later G are compared with it (max abs difference). Prints a table (stderr) and
one JSON object (stdout), the machine named.
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

import _benchlib as bl

MODELS = {
    "tiny": {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
             "temperal_downsample": [False, True, True]},
    # The published Wan 2.1 VAE (Wan-AI/Wan2.1-T2V-14B-Diffusers, vae/config.json), random weights.
    "wan2.1": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
               "temperal_downsample": [False, True, True], "dropout": 0.0},
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    from diffusers import AutoencoderKLWan

    from vaecache.parallel.spatial import spatial_encode

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        tdist.init_process_group("nccl" if cuda else "gloo")
    group = tdist.group.WORLD if world > 1 else None
    if args.no_mkldnn:
        torch.backends.mkldnn.enabled = False
    torch.manual_seed(0)
    module = AutoencoderKLWan(**MODELS[args.model]).eval().to(device)
    height, width = (int(v) for v in args.size.split("x"))
    x = (torch.rand(1, 3, args.frames, height, width, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(device)
    with torch.no_grad():  # warm-up: kernel selection, lazy initialisation, allocator growth
        spatial_encode(module, x, group)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
        before = _rss_bytes()
    started = time.perf_counter()
    with torch.no_grad():
        out = spatial_encode(module, x, group)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()
    rank = tdist.get_rank() if world > 1 else 0
    result = {"rank": rank, "added_bytes": peak - before, "seconds": seconds, "device": str(device)}
    if rank == 0:
        from safetensors.torch import save_file

        save_file({"latent": out.cpu().contiguous()}, str(Path(args.out) / f"latent-g{world}.safetensors"))
    (Path(args.out) / f"g{world}-rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        tdist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="wan2.1")
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--groups", default="1,2,4")
    parser.add_argument("--no-mkldnn", action="store_true",
                        help="CPU: use PyTorch's native convolutions. oneDNN's transient weight reorders add a "
                             "fixed few hundred MiB per forward that hides how activation memory scales.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    from safetensors.torch import load_file

    folder = Path(tempfile.mkdtemp(prefix="bench-spatial-"))
    rows = []
    reference = None
    for group in (int(g) for g in args.groups.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={group}",
               __file__, "--worker", "--out", str(folder), "--model", args.model, "--size", args.size,
               "--frames", str(args.frames)] + (["--no-mkldnn"] if args.no_mkldnn else [])
        # A fixed mmap threshold stops glibc from raising it after frees, so freed tensors leave the resident
        # set and the peak resident set tracks the peak of live tensors.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "MALLOC_MMAP_THRESHOLD_": "65536"}
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
        ranks = [json.loads((folder / f"g{group}-rank{r}.json").read_text()) for r in range(group)]
        latent = load_file(str(folder / f"latent-g{group}.safetensors"))["latent"]
        if reference is None:
            reference = latent
        rows.append({"group": group, "peak_added_bytes_max_rank": max(r["added_bytes"] for r in ranks),
                     "seconds_per_view": max(r["seconds"] for r in ranks), "device": ranks[0]["device"],
                     "max_abs_vs_g1": float((latent - reference).abs().max()),
                     "latent_scale": float(reference.abs().max()),
                     "bitwise_vs_g1": bool(torch.equal(latent, reference))})
    base = rows[0]
    for row in rows:
        row["memory_vs_g1"] = row["peak_added_bytes_max_rank"] / base["peak_added_bytes_max_rank"]
        row["latency_vs_g1"] = row["seconds_per_view"] / base["seconds_per_view"]
    report = {"machine": bl.machine_info(rows[0]["device"]), "model": args.model, "size": args.size,
              "frames": args.frames, "mkldnn": not args.no_mkldnn, "rows": rows}
    bl.emit(report, bl.table(f"{args.model} {args.size}x{args.frames}: one view split into bands over G ranks",
                             ["G", "peak added MiB", "x G=1", "s/view", "x G=1", "max|diff|/scale"],
                             [[row["group"], row["peak_added_bytes_max_rank"] / 2**20, row["memory_vs_g1"],
                               row["seconds_per_view"], row["latency_vs_g1"],
                               row["max_abs_vs_g1"] / row["latent_scale"]] for row in rows]))


if __name__ == "__main__":
    main()
