"""The description of a loaded VAE (module, family, rule, identity, precision, tiling) and its fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vaecache.models.base import ReferenceEncode
from vaecache.models.rules import FrameRule
from vaecache.settings.dtypes import recorded_name
from vaecache.weights import weights_sha256

CHANNELS_LAST = {5: torch.channels_last_3d, 4: torch.channels_last}
"""The channels-last memory format of a tensor of this many dimensions (Conv3d and Conv2d weights, inputs)."""


@dataclass(frozen=True)
class VaeModel:
    """A VAE ready to run: the module on its device and dtype, and every fact that identifies its latents.

    Built once by ``load_vae``; nothing here changes while encoding (``VaeRunner`` holds the run state).
    """

    module: torch.nn.Module
    spec: str
    """The --vae spec it was loaded from; names the VAE in messages."""
    family: str
    """The diffusers class (the manifest's historical name for it); the model family is `model`."""
    rule: FrameRule
    config: dict[str, Any]
    weights_sha256: str
    latent_channels: int = 0
    """0 when a plugin does not declare them: the runner then finds them with one dummy encode."""
    untrained: bool = False
    has_logvar: bool = True
    normalization: dict[str, Any] = field(default_factory=dict)
    per_frame: bool = False
    """A 2D image VAE: every frame is encoded on its own and the results stacked along t."""
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    """Storage dtype (what --dtype asked for); latents come back in it."""
    compute_dtype: torch.dtype = torch.float32
    """What the module runs in; differs from dtype only where a family is upcast (families.Family.fp16)."""
    dtype_note: str | None = None
    tiling: bool = False
    can_tile: bool = False
    """The module has enable_tiling()/disable_tiling() (used by --tiling and the out-of-memory fallback)."""
    tile_params: dict[str, Any] = field(default_factory=dict)
    views_per_forward: int = 1
    """K: consecutive views one forward encodes together (all their frames for a per-frame VAE)."""
    compiled: bool = False
    """The encoder runs through torch.compile (VaeRunner compiles it)."""
    channels_last: bool = False
    """Convolution weights (load_vae) and every forward's input (VaeRunner) are in channels-last format."""
    encoder_impl: str = "reference"
    """"fast": VaeRunner encodes with vaecache.models._wan_fast (Wan), "reference": with the module's own encode."""
    encoder_variant: str | None = None
    """With "fast": what decides its bits beyond the weights (wan_fast.production_description: memory format,
    chunk, kernels, padded channels), which depends on the device."""
    model: str | None = None
    """The model family the latents are for (vaecache.models; --model), None for a plugin no family declares."""
    reference: ReferenceEncode | None = None
    """How that family's trainers encode a clip: what every untiled forward runs."""

    def __post_init__(self) -> None:
        if self.views_per_forward < 1 or self.latent_channels < 0:
            raise ValueError(f"views_per_forward must be >= 1 and latent_channels >= 0 ({self.spec})")
        if self.tiling and not self.can_tile:
            raise ValueError(f"{self.spec}: tiling asked for a module without enable_tiling()")

    def fingerprint(self) -> dict[str, Any]:
        return fingerprint(self)


def fingerprint(model: VaeModel) -> dict[str, Any]:
    """What identifies these latents' producer: class, config, a hash of every parameter and buffer,
    and the run settings that change latents (compute dtype, tiling and its tile sizes, views per forward)."""
    return {
        "family": model.family,
        **({"model": model.model, "reference_encode": model.reference.record()}
           if model.model is not None and model.reference is not None else {}),
        "config": model.config,
        "weights_sha256": model.weights_sha256,
        "spec": model.spec,
        "untrained": model.untrained,
        "normalization": model.normalization,
        "per_frame": model.per_frame,
        "precision": {"compute": recorded_name(model.compute_dtype), "stored": recorded_name(model.dtype),
                      "note": model.dtype_note},
        "tiling": {"enabled": model.tiling, "available": model.can_tile, "params": model.tile_params},
        "views_per_forward": model.views_per_forward,
        **({"compile": True} if model.compiled else {}),
        **({"channels_last": True} if model.channels_last else {}),
        **({"encoder_impl": model.encoder_impl} if model.encoder_impl != "reference" else {}),
        **({"encoder_variant": model.encoder_variant} if model.encoder_variant else {}),
    }


__all__ = ["VaeModel", "fingerprint", "weights_sha256"]
