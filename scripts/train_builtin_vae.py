"""Train the `builtin:small` VAE: a small AutoencoderKLWan fitted to demo-style footage, shipped in the package.

Training clips are rendered in memory with ``vaecache.demodata.render_clip`` from seeds >= 1 (--pool clips,
clip k is seed 1 + k // 6, scene k % 3, camera (k // 3) % 2); the held-out evaluation set is the footage
``vaecache demo`` writes, seed 0 (3 scenes x 2 cameras x 17 frames at 64x64), which no training step sees.
Each step takes a random window of --frames frames, a random --crop square and random flips.

Loss: L1 + MSE on [-1, 1] pixels. For the first --sample-after of the steps the decoder sees the posterior
mean (a plain autoencoder); after that it sees a sample and --kl-weight times the mean KL to N(0, 1) is
added, so the logvar the cache stores is trained and kept sane. During the first --aux-until of the steps a
fading guide term pulls 3 latent channels towards the pooled input (see TrainArgs.aux_until). Adam, linear
warm-up, cosine decay, gradient clipping at 1; one CPU thread and fixed seeds, so a run is reproducible on
one machine.

The weights are stored in fp16 (``--out``, safetensors, metadata: config, args, held-out PSNR); the final
evaluation runs the fp16-rounded weights in fp32, exactly what ``builtin:small`` loads from that file. PSNR is
measured on uint8 frames (decoder output rounded to 0..255) over the 9-frame windows starting at frames 0 and 8
of every held-out video, encoding to the posterior mean, as the cache does; also per frame of the window (frame 0
is encoded alone, frames 1-4 and 5-8 share a latent frame each). Prints a table and one JSON line.

    python scripts/train_builtin_vae.py            # the shipped weights (see docs/vaes.md)
    python scripts/train_builtin_vae.py --steps 2 --out /tmp/x.safetensors   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vaecache.demodata import DemoDataSpec, render_clip  # noqa: E402

DEFAULT_OUT = ROOT / "vaecache" / "vae" / "weights" / "builtin_small.safetensors"
EVAL_SPEC = DemoDataSpec(scenes=3, cameras=2, frames=17, height=64, width=64, fps=10, seed=0)
"""What `vaecache demo` writes: held out, never trained on."""
EVAL_WINDOWS = (0, 8)
EVAL_FRAMES = 9
TRAIN_SIZE = 64
TRAIN_CLIP_FRAMES = 17
MAX_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class TrainArgs:
    """Everything that decides the weights (recorded in the file's metadata)."""

    steps: int = 13000
    pool: int = 960
    """Training clips rendered up front (rendering one costs ~60 ms, more than a step's share)."""
    batch: int = 4
    lr: float = 1e-3
    """Peak learning rate. 2e-3 kept the output a flat grey for ~1600 steps, 5e-4 learned slower after step 2000."""
    warmup: int = 100
    frames: int = 9
    """Frames per training window: 9 covers what the cache encodes, the first frame and two 4-frame latent steps.
    With 5 (one latent step after the first frame) the second latent step, which the causal feature cache
    carries over from the first, was never trained and lost ~3 dB."""
    crop: int = 32
    kl_weight: float = 1e-4
    mse_weight: float = 1.0
    base_dim: int = 8
    dim_mult: str = "1,2,4,4"
    """Channel multipliers of the four encoder stages (base_dim x each), comma-separated. Wider low-resolution
    stages add parameters where they cost little compute (1,2,4,4: 668k parameters, 1.3 MB in fp16)."""
    z_dim: int = 16
    logvar_init: float = -6.0
    aux_weight: float = 1.0
    aux_until: float = 0.3
    """A warm-up guide, fading out linearly by --aux-until of the steps: the first 3 latent channels of the mean
    are pulled towards the input averaged onto the latent grid. Without it the model settles on a constant grey
    output (13 dB) and stays there for thousands of steps; with it the decoder learns early to use z."""
    sample_after: float = 0.7
    """Fraction of the steps trained as a plain autoencoder (decode the mean, no KL) before sampling + KL start:
    sampling and KL from step 0 let Adam push the posterior to the prior before the decoder learns to use z."""
    seed: int = 0


def model_config(args: TrainArgs) -> dict[str, Any]:
    """The AutoencoderKLWan config: builtin:tiny's layout (one residual block per stage, temporal downsampling in
    the last two), with --base-dim, --dim-mult and --z-dim."""
    return {"base_dim": args.base_dim, "z_dim": args.z_dim, "dim_mult": [int(m) for m in args.dim_mult.split(",")],
            "num_res_blocks": 1, "temperal_downsample": [False, True, True]}


def to_model(frames: np.ndarray) -> torch.Tensor:
    """uint8 (N, T, H, W, 3) -> float (N, 3, T, H, W) in [-1, 1]."""
    return torch.from_numpy(frames).permute(0, 4, 1, 2, 3).float().div_(127.5).sub_(1.0)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    return ((x.clamp(-1, 1) + 1.0) * 127.5).round_()


def render_pool(count: int) -> np.ndarray:
    """The training clips, uint8 (count, 17, 64, 64, 3): clip k is seed 1 + k // 6, scene k % 3, camera (k // 3) % 2."""
    clips = []
    for k in range(count):
        spec = DemoDataSpec(scenes=3, cameras=2, frames=TRAIN_CLIP_FRAMES, height=TRAIN_SIZE, width=TRAIN_SIZE,
                            fps=10, seed=1 + k // 6)
        clips.append(render_clip(spec, k % 3, (k // 3) % 2))
    return np.stack(clips)


def train_batch(args: TrainArgs, pool: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """One step's clips from the pool: random clip, window, crop and flips."""
    clips = []
    for _ in range(args.batch):
        clip = pool[int(rng.integers(0, len(pool)))]
        t0 = int(rng.integers(0, TRAIN_CLIP_FRAMES - args.frames + 1))
        y0, x0 = (int(v) for v in rng.integers(0, TRAIN_SIZE - args.crop + 1, size=2))
        clip = clip[t0:t0 + args.frames, y0:y0 + args.crop, x0:x0 + args.crop]
        if rng.random() < 0.5:
            clip = clip[:, :, ::-1]
        if rng.random() < 0.5:
            clip = clip[:, ::-1]
        clips.append(np.ascontiguousarray(clip))
    return to_model(np.stack(clips))


def pooled_target(x: torch.Tensor) -> torch.Tensor:
    """x (N, 3, 1 + 4k, H, W) averaged onto the latent grid (first frame alone, then groups of 4; 8x8 pixels)."""
    n, c, t, h, w = x.shape
    rest = x[:, :, 1:].reshape(n, c, (t - 1) // 4, 4, h, w).mean(3)
    frames = torch.cat([x[:, :, :1], rest], 2)
    return torch.nn.functional.avg_pool3d(frames, (1, 8, 8))


def lr_at(args: TrainArgs, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(module: torch.nn.Module, scenes: int = EVAL_SPEC.scenes) -> dict[str, Any]:
    """PSNR (dB, uint8) per held-out scene/camera and the mean over all windows; logvar stats of the posterior."""
    module.eval()
    rows, logvars, frame_mse = [], [], torch.zeros(EVAL_FRAMES, dtype=torch.float64)
    for scene in range(scenes):
        for camera in range(EVAL_SPEC.cameras):
            clip = render_clip(EVAL_SPEC, scene, camera)
            windows = np.stack([clip[s:s + EVAL_FRAMES] for s in EVAL_WINDOWS])
            x = to_model(windows)
            dist = module.encode(x).latent_dist
            out = module.decode(dist.mean).sample
            squared = (to_uint8(out) - torch.from_numpy(windows).permute(0, 4, 1, 2, 3).float()).pow(2)
            mse = squared.mean()
            frame_mse += squared.mean((0, 1, 3, 4)).double() / (scenes * EVAL_SPEC.cameras)
            rows.append({"scene": scene, "camera": camera, "mse": float(mse),
                         "psnr": float(10 * torch.log10(255.0 ** 2 / mse))})
            logvars.append(dist.logvar.flatten())
    lv = torch.cat(logvars)
    mean_mse = sum(r["mse"] for r in rows) / len(rows)
    return {"per_view": rows, "psnr_mean": float(10 * math.log10(255.0 ** 2 / mean_mse)),
            "psnr_mean_of_views": sum(r["psnr"] for r in rows) / len(rows),
            "psnr_by_frame": [round(float(10 * torch.log10(255.0 ** 2 / m)), 2) for m in frame_mse],
            "logvar": {"min": float(lv.min()), "mean": float(lv.mean()), "max": float(lv.max())}}


def build(config: dict[str, Any], seed: int) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**config)


def save(module: torch.nn.Module, config: dict[str, Any], args: TrainArgs, path: Path,
         extra: dict[str, str]) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}
    metadata = {"format": "vaecache-builtin-vae/1", "class": "AutoencoderKLWan", "config": json.dumps(config),
                "train_args": json.dumps(asdict(args)), "script": "scripts/train_builtin_vae.py", **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata=metadata)
    tmp.replace(path)


def load(path: Path) -> torch.nn.Module:
    """The saved weights back in fp32 (the fp16-rounded values), as builtin:small loads them."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        config = json.loads(handle.metadata()["config"])
    module = build(config, 0)
    module.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()}, strict=True)
    return module


def train(args: TrainArgs, out: Path, log_every: int, eval_every: int = 0, heldout_scenes: int = 3) -> dict[str, Any]:
    torch.set_num_threads(1)
    pool = render_pool(args.pool)
    config = model_config(args)
    module = build(config, args.seed)
    with torch.no_grad():  # start the posterior narrow: at logvar 0 the sampling noise drowns the mean
        module.quant_conv.bias[args.z_dim:].fill_(args.logvar_init)
    rng = np.random.default_rng(args.seed)
    opt = torch.optim.Adam(module.parameters(), lr=args.lr)
    start = time.monotonic()
    module.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        x = train_batch(args, pool, rng)
        sampling = step >= args.sample_after * args.steps
        dist = module.encode(x).latent_dist
        out_x = module.decode(dist.sample() if sampling else dist.mean).sample
        diff = out_x - x
        l1, mse = diff.abs().mean(), diff.pow(2).mean()
        kl = 0.5 * (dist.mean.pow(2) + dist.var - 1.0 - dist.logvar).mean()
        loss = l1 + args.mse_weight * mse + (args.kl_weight * kl if sampling else 0.0)
        aux_w = args.aux_weight * max(0.0, 1.0 - step / max(1.0, args.aux_until * args.steps))
        if aux_w > 0:
            loss = loss + aux_w * (dist.mean[:, :3] - pooled_target(x)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        if log_every and (step % log_every == 0 or step == args.steps - 1):
            l1, mse, kl = l1.detach(), mse.detach(), kl.detach()
            print(json.dumps({"step": step, "lr": round(lr_at(args, step), 6), "l1": round(float(l1), 5),
                              "mse": round(float(mse), 6), "kl": round(float(kl), 4),
                              "train_psnr": round(float(10 * torch.log10(4.0 / mse)), 2),
                              "elapsed_s": round(time.monotonic() - start, 1)}), flush=True)
        if eval_every and step % eval_every == eval_every - 1:  # monitoring only: nothing is selected by it
            psnr = evaluate(module, heldout_scenes)["psnr_mean"]
            print(json.dumps({"step": step, "heldout_psnr": round(psnr, 2)}), flush=True)
        module.train()
    train_s = time.monotonic() - start
    with torch.no_grad():  # what is stored: fp16-rounded weights, evaluated in fp32 (as builtin:small runs)
        for tensor in module.state_dict().values():
            tensor.copy_(tensor.to(torch.float16).to(tensor.dtype))
    metrics = evaluate(module, heldout_scenes)
    save(module, config, args, out, {"heldout_psnr_db": f"{metrics['psnr_mean']:.2f}",
                                     "heldout": "vaecache demo footage, seed 0, never trained on"})
    reloaded = load(out).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in module.state_dict().items()), "reloaded weights differ"
    metrics["statistics"] = measure_statistics(out)
    return {"config": config, "args": asdict(args), "out": str(out), "bytes": out.stat().st_size,
            "params": sum(p.numel() for p in module.parameters()), "train_seconds": round(train_s, 1),
            "torch": torch.__version__, "heldout": metrics}


STATISTICS_CLIPS = 240
"""Training clips whose posterior means give builtin:small's latents_mean and latents_std."""


def measure_statistics(path: Path, clips: int = STATISTICS_CLIPS) -> dict[str, Any]:
    """Per-channel mean and std of the posterior mean of the first `clips` training clips (17 frames at 64x64, the
    pool the weights were trained on; the held-out demo footage is not used), written into the file's config as
    latents_mean and latents_std (AutoencoderKLWan's normalization: `(z - latents_mean) / latents_std`), the
    weights untouched. Without them the config took AutoencoderKLWan's defaults, Wan 2.1's statistics, which are
    not this model's: its latents normalized to a std near 0.25."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    module = load(path).eval()
    pool = render_pool(clips)
    with torch.no_grad():
        means = torch.cat([module.encode(to_model(pool[i:i + 8])).latent_dist.mean for i in range(0, clips, 8)])
    flat = means.transpose(0, 1).reshape(means.shape[1], -1).double()
    mean = [round(float(v), 4) for v in flat.mean(1)]
    std = [round(float(v), 4) for v in flat.std(1)]
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    config = {**json.loads(metadata["config"]), "latents_mean": mean, "latents_std": std}
    metadata.update(config=json.dumps(config), statistics=f"posterior mean of training clips 1..{clips} "
                    "(render_pool), per channel")
    tmp = path.with_name(path.name + ".tmp")
    save_file(load_file(str(path)), str(tmp), metadata=metadata)
    tmp.replace(path)
    return {"latents_mean": mean, "latents_std": std, "clips": clips}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = TrainArgs()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--heldout-scenes", type=int, choices=(1, 2, 3), default=3,
                        help="evaluate on the first N held-out demo scenes (fewer only for smoke runs)")
    parser.add_argument("--eval-every", type=int, default=0, help="print the held-out PSNR every N steps (monitoring)")
    parser.add_argument("--statistics-only", action="store_true",
                        help="measure the latents' per-channel statistics of the weights in --out and record them "
                             "(no training)")
    ns = parser.parse_args(argv)
    if ns.statistics_only:
        print(json.dumps(measure_statistics(ns.out)))
        return 0
    args = TrainArgs(**{k: getattr(ns, k) for k in asdict(defaults)})
    if (args.steps < 1 or args.batch < 1 or args.pool < 1 or not 1 <= args.frames <= TRAIN_CLIP_FRAMES
            or (args.frames - 1) % 4 or not 8 <= args.crop <= 64 or args.crop % 8
            or not re.fullmatch(r"[1-9]\d*(,[1-9]\d*){3}", args.dim_mult)):
        parser.error("need --steps >= 1, --batch >= 1, --pool >= 1, --frames 1 + 4k <= 17, --crop a multiple of 8 "
                     "in 8..64, --dim-mult four positive integers (1,2,4,4)")
    result = train(args, ns.out, ns.log_every, ns.eval_every, ns.heldout_scenes)
    print(f"{'scene':>5} {'camera':>6} {'PSNR dB':>8}")
    for row in result["heldout"]["per_view"]:
        print(f"{row['scene']:>5} {row['camera']:>6} {row['psnr']:>8.2f}")
    print(f"{'mean':>12} {result['heldout']['psnr_mean']:>8.2f}  ({result['bytes']} bytes, "
          f"{result['train_seconds']} s training)")
    print(json.dumps(result))
    if result["bytes"] > MAX_BYTES:
        print(f"error: {ns.out} is {result['bytes']} bytes, over {MAX_BYTES}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
