"""The VAE a cache records: its identity as the run fingerprint and the manifest hold it, and the VAE loaded again
with the recorded settings and checked against that identity (decode, verify --reencode, conditions, the pixel
decoder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vaecache.cache.outdir import upgraded_fingerprint
from vaecache.differences import describe_differences
from vaecache.errors import UsageError
from vaecache.settings.clip import ClipSettings
from vaecache.vae.load import load_vae
from vaecache.vae.runner import VaeRunner


def recorded_spec(manifest: dict[str, Any], given: str | None, where: Any) -> str:
    """The --vae spec to load the cache's VAE from: `given` (the user's --vae), else the one the manifest records. A
    recorded `python:module:function` is code the cache names, never loaded from the record alone (a cache never
    decides what a reader imports): a UsageError naming it, to be given as --vae by whoever vouches for it."""
    if given:
        return given
    spec = (manifest.get("settings") or {}).get("vae_spec")
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"{where}: records no VAE spec (settings.vae_spec): give --vae")
    if spec.startswith("python:"):
        raise UsageError(f"{where}: the VAE is recorded as {spec[:200]!r}, a Python factory: a cache never names code "
                         "to run, so it is loaded only when you give it on the command line (--vae SPEC)")
    return spec


def load_recorded_vae(out: Path, manifest: dict[str, Any], spec: str, device: Any,
                      allow_pickle_weights: bool = False) -> VaeRunner:
    """The VAE that encoded OUT, loaded with the recorded settings (dtype, tiling, views per forward) from `spec`
    (the recorded spec, or a --vae override); a UsageError unless its fingerprint is the recorded one.
    `verify --reencode` and `vaecache decode` load through here."""

    clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
    # encoder_variant depends on the device (compiled kernels on CUDA, eager on CPU): decode and --reencode on
    # another machine load the same VAE; the re-encode's tolerance covers the rounding
    machine = ("spec", "encoder_variant")
    recorded = upgraded_fingerprint({"vae": {k: v for k, v in manifest.get("vae", {}).items()
                                             if k not in machine}})["vae"]
    vae = load_vae(spec, device, clip_settings.dtype, tiling=clip_settings.tiling,
                   model=recorded.get("model"), reference=recorded.get("reference_encode"),
                   allow_pickle_weights=allow_pickle_weights, vae_config=manifest.get("settings", {}).get("vae_config"),
                   views_per_forward=(clip_settings.views_per_forward
                                      if isinstance(clip_settings.views_per_forward, int) else 1),
                   compiled=clip_settings.compiled, channels_last=clip_settings.channels_last,
                   encoder_impl=manifest.get("vae", {}).get("encoder_impl", "reference"))
    given = {k: v for k, v in run_fingerprint_vae_part(vae).items() if k not in machine}
    if recorded != given:
        diffs = describe_differences(recorded, given)
        raise UsageError(f"--vae {spec} does not match the VAE recorded in {out}/manifest.json "
                         f"({'; '.join(diffs[:3])})")
    return vae


def run_fingerprint_vae_part(vae: VaeRunner) -> dict[str, Any]:
    """The VAE's identity as recorded (JSON round-tripped, so it compares equal to a stored copy)."""
    return json.loads(json.dumps({k: v for k, v in vae.model.fingerprint().items() if k != "spec"}))
