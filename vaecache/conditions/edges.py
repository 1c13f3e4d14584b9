"""The condition kind at vaecache's edges, importable without torch: `vaecache embed --condition` and its flags, the
request they make, encode's --condition (checked at start-up, embedded once the cache is finished) and the lines a
run prints of a condition set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vaecache.edges import EmbedShared, KindEdges, KindOption
from vaecache.errors import UsageError

if TYPE_CHECKING:
    from vaecache.cache.kinds import SetOutcome

VAE_ENCODED = {"first-frame", "first-last"}
"""The condition kinds the cache's own VAE encodes."""


class ConditionEdges(KindEdges):
    kind = "conditions"
    panel = "Image-to-video conditions (--condition)"
    asked_by = "condition"
    items = "clip(s)"
    options = (
        KindOption("condition", "--condition", str, "first-frame | first-last | image-features.", metavar="KIND"),
        KindOption("image_encoder", "--image-encoder", str, "image-features: diffusers:DIR | transformers:DIR.",
                   metavar="SPEC"),
        KindOption("image_convention", "--image-convention", str, "image-features: e.g. wan-diffusers (default).",
                   metavar="NAME"),
        KindOption("condition_pipeline", "--condition-pipeline", str, "first-frame/-last: auto | kandinsky5.",
                   metavar="NAME"),
        KindOption("vae", "--vae", str, "first-frame/-last: the cache's VAE elsewhere.", metavar="SPEC"),
    )

    def check_given(self, given: dict[str, Any], shared: EmbedShared) -> None:
        kinds = {part.strip() for part in (given.get("condition") or "").split(",")}
        if "image-features" not in kinds and (given["image_encoder"] is not None
                                               or given["image_convention"] is not None):
            flag = "--image-encoder" if given["image_encoder"] is not None else "--image-convention"
            raise UsageError(f"{flag} applies to --condition image-features")
        if given["vae"] is not None and not VAE_ENCODED & kinds:
            raise UsageError("--vae applies to --condition first-frame or first-last (the kinds the cache's VAE "
                             "encodes)")
        if given["condition_pipeline"] is not None and not VAE_ENCODED & kinds:
            raise UsageError("--condition-pipeline applies to --condition first-frame or first-last")

    def request(self, given: dict[str, Any], shared: EmbedShared) -> Any:
        from vaecache.conditions.sets import ConditionRequest

        return ConditionRequest(
            out=shared.out, kinds=given["condition"], replace=shared.replace, shard_bytes=shared.shard_bytes,
            device=shared.device, vae=given["vae"], allow_pickle_weights=shared.allow_pickle_weights,
            storage_options=shared.storage_options, image_encoder=given["image_encoder"],
            image_convention=given["image_convention"] or "wan-diffusers",
            pipeline=given["condition_pipeline"] or "auto")

    def encode_request(self, cfg: Any) -> Any | None:
        if not cfg.conditions.kinds:
            return None
        from vaecache.conditions.sets import ConditionRequest

        return ConditionRequest(
            out=str(cfg.out.location), kinds=cfg.conditions.kinds, device=cfg.parallel.device, vae=cfg.vae.spec,
            allow_pickle_weights=cfg.vae.allow_pickle_weights, storage_options=cfg.out.storage_options,
            image_encoder=cfg.conditions.image_encoder, image_convention=cfg.conditions.image_convention)

    def check_at_start(self, request: Any) -> None:
        from vaecache.conditions.sets import check_condition_request

        check_condition_request(request.conditions)

    def check_vae(self, request: Any, fingerprint: dict[str, Any]) -> None:
        from vaecache.conditions.kinds import LATENT_KINDS, check_condition_vae, parse_condition_kinds

        kinds = parse_condition_kinds(request.conditions.kinds)
        if any(kind in LATENT_KINDS for kind in kinds):  # the VAE must have the pipeline the latent kinds follow
            check_condition_vae(fingerprint, f"--vae {request.vae.spec}", kinds)

    def counts(self, outcome: SetOutcome) -> str:
        return f"{outcome.extra['clips']} clips, {outcome.extra['views']} views"

    def notes(self, outcome: SetOutcome) -> list[str]:
        tiled = list((outcome.record or {}).get("tiled_clips") or [])
        lines = list(outcome.events[:3])
        if tiled:
            lines.append(f"{len(tiled)} clip(s) needed the VAE's tiling for their {outcome.name} condition (out of "
                         f"memory untiled; recorded per camera), e.g. {', '.join(tiled[:3])}")
        return lines


EDGES = ConditionEdges()
