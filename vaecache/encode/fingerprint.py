"""What identifies a run's latents: the run fingerprint (settings, VAE, decoder, numerics) and the VAE it
records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vaecache.cache.layout import FORMAT_VERSION
from vaecache.cache.outdir import describe_differences, upgraded_fingerprint
from vaecache.errors import UsageError
from vaecache.settings.clip import ClipSettings
from vaecache.settings.commands import EncodeConfig
from vaecache.vae.load import load_vae
from vaecache.vae.runner import VaeRunner
from vaecache.video.backends import Backend


def load_recorded_vae(out: Path, manifest: dict[str, Any], spec: str, device: Any,
                      allow_pickle_weights: bool = False) -> VaeRunner:
    """The VAE that encoded OUT, loaded with the recorded settings (dtype, tiling, views per forward) from `spec`
    (the recorded spec, or a --vae override); a UsageError unless its fingerprint is the recorded one.
    `verify --reencode` and `vaecache decode` load through here."""

    clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
    vae = load_vae(spec, device, clip_settings.dtype, tiling=clip_settings.tiling,
                   allow_pickle_weights=allow_pickle_weights, vae_config=manifest.get("settings", {}).get("vae_config"),
                   views_per_forward=(clip_settings.views_per_forward
                                      if isinstance(clip_settings.views_per_forward, int) else 1),
                   compiled=clip_settings.compiled, channels_last=clip_settings.channels_last,
                   encoder_impl=manifest.get("vae", {}).get("encoder_impl", "reference"))
    # encoder_variant depends on the device (compiled kernels on CUDA, eager on CPU): decode and --reencode on
    # another machine load the same VAE; the re-encode's tolerance covers the rounding
    machine = ("spec", "encoder_variant")
    recorded = upgraded_fingerprint({"vae": {k: v for k, v in manifest.get("vae", {}).items()
                                             if k not in machine}})["vae"]
    given = {k: v for k, v in run_fingerprint_vae_part(vae).items() if k not in machine}
    if recorded != given:
        diffs = describe_differences(recorded, given)
        raise UsageError(f"--vae {spec} does not match the VAE recorded in {out}/manifest.json "
                         f"({'; '.join(diffs[:3])})")
    return vae


def run_fingerprint_vae_part(vae: VaeRunner) -> dict[str, Any]:
    """The VAE's identity as recorded (JSON round-tripped, so it compares equal to a stored copy)."""
    return json.loads(json.dumps({k: v for k, v in vae.model.fingerprint().items() if k != "spec"}))


def run_fingerprint(cfg: EncodeConfig, vae: VaeRunner, decoder: Backend, numerics: dict[str, Any],
                    images: bool = False) -> dict[str, Any]:
    """Everything that determines stored bytes; a resume must match it exactly. `images`: some camera is an image
    sequence, so the image decoder (Pillow and its libjpeg-turbo) is part of it too."""
    # The decoder is part of it: a cache started by 0.1.0 (decord, mis-seeking on open-GOP streams) must not
    # be resumed with frame-exact decoding into one mixed cache; nor pyav with another --decoder.
    fingerprint = {"vae": run_fingerprint_vae_part(vae), "latents": cfg.clip.to_record(), "decoder": decoder.name,
                   "data": str(cfg.data), "format_version": FORMAT_VERSION, "numerics": numerics}
    if images:
        from vaecache.video.frames import image_decoder_name

        fingerprint["image_decoder"] = image_decoder_name()
    if cfg.sp_mode == "spatial":  # band edges depend on the group size, and so do the last bits of the latents
        fingerprint["parallel"] = {"mode": "spatial", "sp_size": cfg.sp_size}
    # how DATA is read decides the scenes (a table's --column ids) and what records carry: a resume must read it alike
    # (only when given, so caches of other layouts keep their fingerprint)
    reading = {**({"nuscenes_version": cfg.nuscenes_version} if cfg.nuscenes_version else {}),
               **({"columns": [list(pair) for pair in cfg.columns]} if cfg.columns else {}),
               **({"lerobot_state": True} if cfg.lerobot_state else {})}
    if reading:
        fingerprint["reading"] = reading
    return fingerprint
