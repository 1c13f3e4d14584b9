#!/usr/bin/env python
"""What a clip's sound costs beside its picture: per clip, the audio cut (the stream decoded from its start and the
window taken), LTX-2's log-mel (channels folded, resampled to 16 kHz), the audio VAE's encode, and the video VAE's
encode of the same clip's frames, measured in one process, the stages interleaved (median of --repeats).

The VAEs are diffusers' own classes with random weights at --config: `production` is LTX-2's (diffusers'
defaults: AutoencoderKLLTX2Video with 128 latent channels and blocks of 256-2048, AutoencoderKLLTX2Audio with 128
base channels), `small` a scaled-down pair for a quick look. The clip is --frames frames at --size of a video with
an AAC stereo 48 kHz track, --seconds long (the cut decodes the track from its start, so a clip late in a long
video costs more: --offset places it).

    python scripts/bench_audio.py                          # CPU: small models, 33 frames at 128x128
    python scripts/bench_audio.py --config production      # LTX-2's sizes (slow on CPU)
    python scripts/bench_audio.py --smoke                  # tiny, the same code paths

Prints a table (stderr) and JSON (stdout), the machine named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _benchlib as bl  # noqa: E402

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "production": ({}, {}),
    "small": ({"block_out_channels": (32, 64, 128, 128), "decoder_block_out_channels": (32, 64, 128),
               "layers_per_block": (1, 1, 1, 1, 1), "decoder_layers_per_block": (1, 1, 1, 1), "latent_channels": 32},
              {"base_channels": 128, "ch_mult": (1, 1, 2), "num_res_blocks": 1}),
    "tiny": ({"block_out_channels": (8, 8, 16, 16), "decoder_block_out_channels": (8, 16, 16),
              "layers_per_block": (1, 1, 1, 1, 1), "decoder_layers_per_block": (1, 1, 1, 1), "latent_channels": 8},
             {"base_channels": 128, "ch_mult": (1, 1, 1), "num_res_blocks": 1}),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--frames", type=int, default=33, help="frames per clip (1 + 8k)")
    p.add_argument("--size", default="128x128", help="HxW (multiples of 32)")
    p.add_argument("--fps", type=int, default=25)
    p.add_argument("--seconds", type=float, default=10.0, help="length of the video")
    p.add_argument("--offset", type=float, default=5.0, help="seconds into the video the clip starts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny models, 9 frames at 64x64 of a 2 s video")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.frames, args.size, args.seconds, args.offset, args.repeats = "tiny", 9, "64x64", 2.0, 0.5, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

    from tests.audio.sound import write_video_with_sound
    from vaecache.audio.latents import audio_posterior_mean
    from vaecache.audio.mel import MelSpec, clip_mel
    from vaecache.audio.track import AudioWindow, cut_audio

    height, width = map(int, args.size.split("x"))
    video_config, audio_config = CONFIGS[args.config]
    torch.manual_seed(0)
    video_vae = AutoencoderKLLTX2Video(**video_config).eval()
    audio_vae = AutoencoderKLLTX2Audio(**audio_config).eval()
    spec = MelSpec.ltx2(dict(audio_vae.config))
    frames = torch.rand(1, 3, args.frames, height, width) * 2 - 1
    stages: dict[str, list[float]] = {"audio_cut": [], "mel": [], "audio_encode": [], "video_encode": []}
    with tempfile.TemporaryDirectory(prefix="bench-audio-") as tmp:
        video = write_video_with_sound(Path(tmp) / "clip.mp4", rate=48000, seconds=args.seconds, fps=args.fps)
        window = AudioWindow.of_clip(Fraction(round(args.offset * args.fps), args.fps), args.frames, args.fps)
        with torch.inference_mode():
            video_vae.encode(frames[:, :, :9, :min(height, 64), :min(width, 64)])  # first-call costs out of the way
            for _ in range(args.repeats):
                started = time.perf_counter()
                sound = cut_audio(str(video), window)
                stages["audio_cut"].append(time.perf_counter() - started)
                started = time.perf_counter()
                mel = clip_mel(sound.samples, sound.rate, spec)
                stages["mel"].append(time.perf_counter() - started)
                started = time.perf_counter()
                latents = audio_posterior_mean(audio_vae, mel)
                stages["audio_encode"].append(time.perf_counter() - started)
                started = time.perf_counter()
                video_latents = video_vae.encode(frames).latent_dist.mode()
                stages["video_encode"].append(time.perf_counter() - started)
    medians = {stage: statistics.median(times) for stage, times in stages.items()}
    sound_total = medians["audio_cut"] + medians["mel"] + medians["audio_encode"]
    result = {"machine": bl.machine_info("cpu"), "config": args.config, "frames": args.frames, "size": args.size,
              "video_seconds": args.seconds, "clip_offset_s": args.offset, "repeats": args.repeats,
              "seconds_per_clip": medians, "sound_over_video": sound_total / medians["video_encode"],
              "mel_shape": list(mel.shape), "audio_latent_shape": list(latents.shape),
              "video_latent_shape": list(video_latents.shape)}
    bl.emit(result, bl.table(f"LTX-2 ({args.config}), {args.frames} frames at {args.size}: seconds per clip "
                             f"(median of {args.repeats})", ["stage", "s"],
                             [*[[stage, value] for stage, value in medians.items()],
                              ["sound / video", result["sound_over_video"]]]))
    return result


if __name__ == "__main__":
    main()
