"""What a model family declares: the model people train (HunyuanVideo, FramePack, Kandinsky 5, ...), not a VAE class.
One diffusers class can serve several families, each encoding with it as its own trainers do. Pure data and small
functions: importable without torch (the CLI reads a family before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from vaecache.vae.rules import FrameRule


@dataclass(frozen=True)
class ReferenceEncode:
    """How a family's trainers encode a clip with its VAE, which is what vaecache stores.

    `encode(module, x)` returns what the module's own encode would (a posterior, or the moments tensor its
    DiagonalGaussianDistribution is built from); None means the module's own `encode` with its tiling off is the
    reference (diffusers' encode tiles nothing there). The record (name and params) goes into the VAE fingerprint,
    so a cache says which encode made it and a resume never mixes two."""

    name: str
    """"untiled", or the tiling a family's trainers apply ("kandinsky5-tiles"); recorded."""
    description: str
    """In words, for messages and docs."""
    source: str
    """Where it was read: the authors' and the trainers' code, file and line."""
    encode: Callable[[Any, Any], Any] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    """What decides its bits beyond the weights (tile sizes and strides), recorded beside the name."""
    time_tiles_above: int | None = None
    """Clips longer than this many frames are tiled in time by it (None: never)."""
    spatial_bands: bool = True
    """Whether spatial SP (rows in bands with halo exchange) can reproduce it: not for an encode that tiles space."""

    def record(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.params)}


@dataclass(frozen=True)
class Family:
    """A model people train, as far as its VAE latents go: which class encodes them and how its trainers call it."""

    name: str
    """`--model NAME`, recorded in the manifest (`vae.model`)."""
    label: str
    """The model's name in messages ("Kandinsky 5")."""
    vae_classes: tuple[str, ...]
    """The diffusers VAE classes whose latents it trains on."""
    reference: ReferenceEncode
    default_for: tuple[str, ...] = ()
    """The classes for which it is the family when --model is not given (one family per class)."""
    legacy_references: tuple[ReferenceEncode, ...] = ()
    """Encodes caches made before the reference was recorded used, kept to read them back (decode, --reencode)."""
    frame_rule: Callable[[FrameRule], FrameRule] | None = None
    """The family's own frame rule from its VAE class's, where its reference encode accepts fewer frame counts."""

    def rule(self, vae_rule: FrameRule) -> FrameRule:
        return self.frame_rule(vae_rule) if self.frame_rule is not None else vae_rule

    def reference_recorded(self, record: Mapping[str, Any] | None) -> ReferenceEncode | None:
        """The encode a cache recorded (None: one this family does not know)."""
        if record is None:
            return self.reference
        for reference in (self.reference, *self.legacy_references):
            if reference.record() == dict(record):
                return reference
        return None


__all__ = ["Family", "ReferenceEncode"]
