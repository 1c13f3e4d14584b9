"""What identifies a run's latents and what its manifest records of the settings, each part of the settings
writing its own record once: the run fingerprint (settings, VAE, decoder, numerics) and the manifest's settings. The
VAE's part and the loading of a recorded VAE are vaecache.vae.recorded's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vaecache.cache.layout import FORMAT_VERSION
from vaecache.encode.startup import StartUp
from vaecache.settings.commands import EncodeConfig
from vaecache.vae.recorded import run_fingerprint_vae_part


@dataclass(frozen=True)
class RunRecords:
    """What a run records of itself: the fingerprint a resume must match exactly, and the manifest's settings."""

    fingerprint: dict[str, Any]
    settings: dict[str, Any]


def run_records(cfg: EncodeConfig, start: StartUp, world_size: int) -> RunRecords:
    """The run fingerprint (everything that determines stored bytes) and the manifest's settings, from each part's
    record and what start-up resolved (the clip settings, the decoder, the VAE, the numerics)."""
    source = cfg.source.to_record()
    clip = start.clip.to_record()
    # The decoder is part of it: a cache started by 0.1.0 (decord, mis-seeking on open-GOP streams) must not
    # be resumed with frame-exact decoding into one mixed cache; nor pyav with another --decoder.
    fingerprint = {"vae": run_fingerprint_vae_part(start.vae), "latents": clip, "decoder": start.backend.name,
                   "data": source["data"], "format_version": FORMAT_VERSION, "numerics": start.numerics}
    if start.images:  # some camera is an image sequence: the image decoder (Pillow, its libjpeg-turbo) decides too
        from vaecache.video.frames import image_decoder_name

        fingerprint["image_decoder"] = image_decoder_name()
    parallel = cfg.parallel.fingerprint_record()
    if parallel is not None:
        fingerprint["parallel"] = parallel
    # how DATA is read decides the scenes (a table's --column ids) and what records carry: a resume must read it alike
    # (only when given, so caches of other layouts keep their fingerprint)
    reading = source.get("reading") or {}
    if reading:
        fingerprint["reading"] = reading
    vae = cfg.vae.to_record()
    # in the order caches have always recorded them (a manifest's bytes do not change with the code's layout)
    settings = {**clip, "decoder": start.backend.name, "data": source["data"], **cfg.parallel.to_record(),
                "world_size": world_size, **cfg.out.to_record(),
                "max_frame_pixels": start.clip.sampling.max_frame_pixels, "vae_spec": vae.pop("vae_spec"),
                **reading, **vae}
    return RunRecords(fingerprint, settings)
