"""Reading a finished cache's image-to-video condition sets (written by vaecache.conditions.sets): `ConditionSet`
gives a clip's stored tensor and the tensor the pipeline builds from it."""

from __future__ import annotations

import io
from typing import Any

import torch

from vaecache.cache.layout import CONDITIONS_DIR, MANIFEST
from vaecache.cache.sets import SetShards
from vaecache.conditions.kinds import UNNAMED, pipeline_condition, pipeline_masks
from vaecache.errors import ManifestError


def condition_set_names(manifest: dict[str, Any]) -> list[str]:
    return sorted((manifest.get("conditions") or {}))


class ConditionSet:
    """One condition set of a finished cache: `stored(clip)` the stored tensor (the posterior mean, or the image
    features), `pipeline(clip)` the tensor the pipeline builds from it (mask and normalized latents)."""

    def __init__(self, store: Any, manifest: dict[str, Any], kind: str, verify: str = "size") -> None:
        import pyarrow.parquet as pq

        entries = manifest.get("conditions") or {}
        if kind not in entries:
            raise KeyError(f"{store.location}: no condition set {kind!r} (sets: "
                           f"{', '.join(sorted(entries)) or 'none'})")
        self.kind, self.entry, self.store = kind, entries[kind], store
        fingerprint = self.entry.get("fingerprint") or {}
        normalization = (fingerprint.get("vae") or {}).get("normalization") or {}
        self.latents_mean = list(normalization.get("latents_mean") or [])
        self.latents_std = list(normalization.get("latents_std") or [])
        self.temporal_factor = int((fingerprint.get("frame_rule") or {}).get("temporal_factor") or 1)
        self.pipeline_name = str(fingerprint.get("pipeline") or UNNAMED.name)
        self.scaling_factor = float(normalization.get("scaling_factor") or 1.0)
        table = (self.entry.get("tables") or {}).get("clips")
        file = table.get("file") if isinstance(table, dict) else None
        if not isinstance(file, str) or not file.startswith(f"{CONDITIONS_DIR}/{kind}/"):
            raise ManifestError(f"{store.where(MANIFEST)}: condition set {kind!r}: its clip table entry {table!r} "
                                f"is not a file of {CONDITIONS_DIR}/{kind}/")
        try:
            clips = pq.read_table(io.BytesIO(store.read(store.checked_name(file, f"condition set {kind}"))))
        except FileNotFoundError as exc:
            raise ManifestError(f"{store.location}: condition set {kind!r}: its clip table is missing ({exc})") \
                from None
        ids = clips.column("id").to_pylist()
        self._shard_of = dict(zip(ids, clips.column("shard").to_pylist()))
        self._frames_of = dict(zip(ids, clips.column("frames").to_pylist()))
        self._shards = SetShards(store, self.entry, verify, f"condition set {kind!r}")

    def clips(self) -> list[str]:
        return list(self._shard_of)

    def stored(self, clip: str) -> torch.Tensor:
        """The stored tensor: the posterior mean (cameras, C, latent frames, h, w) in the VAE's dtype, or
        image-features (cameras, tokens, hidden)."""
        shard = self._shard_of.get(clip)
        if shard is None:
            raise KeyError(f"clip {clip} has no condition in set {self.kind!r}")
        handle = self._shards.open(shard, f"clip {clip}")
        try:
            return handle.get_tensor(clip)
        except Exception as exc:  # safetensors raises its own error type for a missing tensor
            raise ManifestError(f"{self.store.where(shard)}: holds no condition for clip {clip} ({exc})") from None

    @property
    def name(self) -> str:
        return self.kind

    def item(self, clip: str) -> dict[str, torch.Tensor]:
        """What LatentCache's item holds of this set: condition/<kind>, the pipeline's tensor (and, for Wan 2.2 TI2V,
        condition_mask/<kind>, the mask its pipeline returns apart)."""
        stored = self.stored(clip)
        frames = int(self._frames_of[clip])
        return {f"condition/{self.kind}": pipeline_condition(stored, self.kind, frames, self.temporal_factor,
                                                             self.latents_mean, self.latents_std, self.pipeline_name,
                                                             self.scaling_factor),
                **pipeline_masks(stored, self.kind, frames, self.temporal_factor, self.pipeline_name)}

    def export_tensors(self, clip: str) -> dict[str, torch.Tensor]:
        """The stored tensor a WebDataset sample carries; `decode` builds the pipeline's tensor from it."""
        return {f"condition/{self.kind}": self.stored(clip).contiguous()}

    def export_facts(self, clip: str) -> dict[str, Any]:
        return {"frames": int(self._frames_of[clip]), "temporal_factor": self.temporal_factor,
                "latents_mean": self.latents_mean, "latents_std": self.latents_std,
                **({"pipeline": self.pipeline_name, "scaling_factor": self.scaling_factor}
                   if self.pipeline_name != UNNAMED.name else {})}

    def pipeline(self, clip: str) -> torch.Tensor:
        """The tensor the pipeline uses: for first-frame and first-last, (cameras, temporal_factor + C, latent frames,
        h, w) float32, `cat([mask, latent_condition])` as WanImageToVideoPipeline.prepare_latents returns it for each
        camera (a HunyuanVideo 1.5 cache: (cameras, C + 1, latent frames, h, w), `cat([latent_condition,
        latent_mask])` of prepare_cond_latents_and_mask; a Wan 2.2 TI2V cache: (cameras, C, 1, h, w), the normalized
        latent_condition its expand_timesteps branch returns, whose mask `item` gives apart); for image-features the
        stored features (cameras, tokens, hidden) in the convention's dtype."""
        return pipeline_condition(self.stored(clip), self.kind, int(self._frames_of[clip]), self.temporal_factor,
                                  self.latents_mean, self.latents_std, self.pipeline_name, self.scaling_factor)


__all__ = ["ConditionSet", "condition_set_names"]
