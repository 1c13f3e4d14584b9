#!/usr/bin/env python
"""Same bits: held-out tiny data encoded, embedded (text, conditions, audio) and exported by two checkouts of
vaecache, and every file they write compared: tensors, tables and manifests byte-equal, JSON compared with its
`created_at` values left out (the only field that names when a run happened). Logs are listed, not compared (they
hold times and durations).

    git worktree add /tmp/pre70 ea7a86f
    python scripts/same_bits.py --old /tmp/pre70 [--new .] [--work DIR]

Each checkout runs as `python -m vaecache` with PYTHONPATH set to it (the child prints which vaecache it imported),
writing to the same folder, moved aside after (exports record absolute paths);
the inputs (videos with sound and captions, a tiny text encoder, a tiny audio VAE, a tiny HunyuanVideo VAE) are made
once, by the new checkout's test helpers, with fixed seeds. Prints one JSON object; exit 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SKIPPED_DIRS = ("logs",)
"""Per-rank log files: times and durations, never the same twice."""


def make_inputs(root: Path) -> dict[str, Path]:
    """Videos with sound in two scenes (captions in a JSONL index), a text encoder, an audio VAE, a HunyuanVideo
    VAE folder: everything a run reads, made once."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLLTX2Audio

    from tests.audio.sound import write_video_with_sound
    from tests.text.tiny_text import build_wan_text_folder

    lines = []
    for number, scene in enumerate(("scene_000", "scene_001")):
        folder = root / "data" / scene
        folder.mkdir(parents=True)
        cameras = {}
        for camera in ("cam_0", "cam_1"):
            path = write_video_with_sound(folder / f"{camera}.mp4", rate=48000, seconds=1.2, fps=25,
                                          seed=7 * number + len(camera) + int(camera[-1]))
            cameras[camera] = str(path)
        lines.append({"id": scene, "cameras": cameras, "caption": f"held-out scene {number}: a red car at night"})
    index = root / "data" / "index.jsonl"
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    torch.manual_seed(0)
    audio = root / "audio_vae"
    vae = AutoencoderKLLTX2Audio(base_channels=16, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=8,
                                 mel_bins=64, output_channels=2)
    vae.latents_mean.copy_(torch.randn(16) * 0.1)
    vae.latents_std.copy_(torch.rand(16) + 0.5)
    vae.save_pretrained(audio)
    hunyuan = root / "hunyuan_vae"
    AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                              up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=16, layers_per_block=1,
                              norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4,
                              scaling_factor=0.476986).save_pretrained(hunyuan)
    return {"index": index, "text": build_wan_text_folder(root / "text"), "audio": audio, "hunyuan": hunyuan}


def steps(inputs: dict[str, Path], out: Path) -> list[list[str]]:
    """The commands a checkout runs, in order (their outputs under `out`)."""
    wan, hv = out / "wan", out / "hv"
    clip = ["--num-frames", "9", "--size", "32x32", "--workers", "0", "--no-progress"]
    return [
        ["encode", str(inputs["index"]), "--out", str(wan), "--vae", "builtin:tiny", *clip],
        ["embed", str(wan), "--text-encoder", f"diffusers:{inputs['text']}", "--text-batch", "2"],
        ["embed", str(wan), "--condition", "first-frame,first-last"],
        ["embed", str(wan), "--audio-vae", f"diffusers:{inputs['audio']}"],
        ["export", str(wan), "--format", "webdataset", "--out", str(out / "wan-wds"), "--energon", "off"],
        ["export", str(wan), "--format", "musubi", "--out", str(out / "wan-musubi"), "--arch", "wan"],
        ["encode", str(inputs["index"]), "--out", str(hv), "--vae", f"diffusers:{inputs['hunyuan']}", *clip],
        ["export", str(hv), "--format", "musubi", "--out", str(out / "hv-musubi"), "--arch", "hv"],
        ["verify", str(wan)],
        ["verify", str(hv)],
    ]


def run_checkout(checkout: Path, inputs: dict[str, Path], out: Path) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VAECACHE_", "SLURM_"))}
    env.update(PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    which = subprocess.run([sys.executable, "-c", "import vaecache; print(vaecache.__file__, vaecache.__version__)"],
                           capture_output=True, text=True, env=env, cwd=checkout, check=True).stdout.strip()
    failed = []
    for args in steps(inputs, out):
        done = subprocess.run([sys.executable, "-m", "vaecache", *args], capture_output=True, text=True, env=env,
                              cwd=checkout)
        if done.returncode != 0:
            failed.append({"args": args[:2], "rc": done.returncode, "stderr": done.stderr[-2000:]})
            break
    return {"vaecache": which, "failed": failed}


def without_created_at(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: without_created_at(item) for key, item in value.items() if key != "created_at"}
    if isinstance(value, list):
        return [without_created_at(item) for item in value]
    return value


def same_json(a: bytes, b: bytes, lines: bool) -> bool:
    if lines:
        left, right = a.decode().splitlines(), b.decode().splitlines()
        return len(left) == len(right) and all(
            without_created_at(json.loads(x)) == without_created_at(json.loads(y)) for x, y in zip(left, right))
    return without_created_at(json.loads(a)) == without_created_at(json.loads(b))


def compare(old: Path, new: Path) -> dict[str, Any]:
    """Every file under both trees: byte-equal, or equal JSON but created_at; symlinks by target."""
    def files(root: Path) -> set[str]:
        return {str(path.relative_to(root)) for path in root.rglob("*")
                if (path.is_file() or path.is_symlink())
                and not any(part in SKIPPED_DIRS for part in path.relative_to(root).parts)}

    left, right = files(old), files(new)
    differ, equal_bytes, equal_json = [], 0, 0
    for name in sorted(left & right):
        a, b = old / name, new / name
        if a.is_symlink() or b.is_symlink():
            target_a = os.readlink(a) if a.is_symlink() else None
            target_b = os.readlink(b) if b.is_symlink() else None
            equal_bytes += target_a == target_b
            if target_a != target_b:
                differ.append(name)
            continue
        data_a, data_b = a.read_bytes(), b.read_bytes()
        if data_a == data_b:
            equal_bytes += 1
        elif name.endswith((".json", ".jsonl")) and same_json(data_a, data_b, name.endswith(".jsonl")):
            equal_json += 1
        else:
            differ.append(name)
    skipped = sorted({str(path.relative_to(old)) for path in old.rglob("*") if path.is_file()
                      and any(part in SKIPPED_DIRS for part in path.relative_to(old).parts)})
    return {"compared": len(left & right), "byte_equal": equal_bytes, "equal_but_created_at": equal_json,
            "differ": differ, "only_old": sorted(left - right), "only_new": sorted(right - left),
            "logs_not_compared": len(skipped)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="the checkout to compare against (pre-70 main)")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--work", type=Path, default=None, help="where inputs and outputs go (default: a temp dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="same-bits-"))
    sys.path.insert(0, str(args.new))
    inputs = make_inputs(work / "inputs")
    runs = {}
    for name, checkout in (("old", args.old), ("new", args.new)):
        # both write to the same folder (moved aside after), so the absolute paths an export records are the same
        runs[name] = run_checkout(checkout.resolve(), inputs, work / "out")
        (work / "out").rename(work / name)
    result = {"work": str(work), "runs": runs, **compare(work / "old", work / "new")}
    print(json.dumps(result, indent=2))
    ok = not result["differ"] and not result["only_old"] and not result["only_new"] and \
        not any(run["failed"] for run in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
