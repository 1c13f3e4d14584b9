"""What identifies a run's latents: the run fingerprint (settings, VAE, decoder, numerics) and the VAE it
records."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from vaecache.settings.clip import ClipSettings
from vaecache.errors import UsageError


def load_recorded_vae(out: Path, manifest: dict[str, Any], spec: str, device: Any,
                      allow_pickle_weights: bool = False) -> Any:
    """The VAE that encoded OUT, loaded with the recorded settings (dtype, tiling, views per forward) from `spec`
    (the recorded spec, or a --vae override); a UsageError unless its fingerprint is the recorded one.
    `verify --reencode` and `vaecache decode` load through here."""
    from vaecache.cache.outdir import describe_differences, upgraded_fingerprint
    from vaecache.pipeline import run_fingerprint_vae_part
    from vaecache.vae import load_vae

    clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
    vae = load_vae(spec, device, clip_settings.dtype, tiling=clip_settings.tiling,
                   allow_pickle_weights=allow_pickle_weights,
                   views_per_forward=clip_settings.views_per_forward if isinstance(clip_settings.views_per_forward, int) else 1,
                   compiled=clip_settings.compiled, channels_last=clip_settings.channels_last)
    recorded = upgraded_fingerprint({"vae": {k: v for k, v in manifest.get("vae", {}).items() if k != "spec"}})["vae"]
    given = run_fingerprint_vae_part(vae)
    if recorded != given:
        diffs = describe_differences(recorded, given)
        raise UsageError(f"--vae {spec} does not match the VAE recorded in {out}/manifest.json "
                         f"({'; '.join(diffs[:3])})")
    return vae
