"""What identifies a run's latents: the run fingerprint (settings, VAE, decoder, numerics); the VAE's part and the
loading of a recorded VAE are vaecache.vae.recorded's."""

from __future__ import annotations

from typing import Any

from vaecache.cache.layout import FORMAT_VERSION
from vaecache.settings.clip import ClipSettings
from vaecache.settings.commands import EncodeConfig, reading_record
from vaecache.vae.recorded import run_fingerprint_vae_part
from vaecache.vae.runner import VaeRunner
from vaecache.video.backends import Backend


def run_fingerprint(cfg: EncodeConfig, clip: ClipSettings, vae: VaeRunner, decoder: Backend,
                    numerics: dict[str, Any], images: bool = False) -> dict[str, Any]:
    """Everything that determines stored bytes; a resume must match it exactly. `images`: some camera is an image
    sequence, so the image decoder (Pillow and its libjpeg-turbo) is part of it too."""
    # The decoder is part of it: a cache started by 0.1.0 (decord, mis-seeking on open-GOP streams) must not
    # be resumed with frame-exact decoding into one mixed cache; nor pyav with another --decoder.
    fingerprint = {"vae": run_fingerprint_vae_part(vae), "latents": clip.to_record(), "decoder": decoder.name,
                   "data": str(cfg.data), "format_version": FORMAT_VERSION, "numerics": numerics}
    if images:
        from vaecache.video.frames import image_decoder_name

        fingerprint["image_decoder"] = image_decoder_name()
    if cfg.sp_mode == "spatial":  # band edges depend on the group size, and so do the last bits of the latents
        fingerprint["parallel"] = {"mode": "spatial", "sp_size": cfg.sp_size}
    # how DATA is read decides the scenes (a table's --column ids) and what records carry: a resume must read it alike
    # (only when given, so caches of other layouts keep their fingerprint)
    reading = reading_record(cfg)
    if reading:
        fingerprint["reading"] = reading
    return fingerprint
