"""The two ways an SP group encodes a batch, behind one interface: `encoder_for(mode)`.

- views (views.py): the group splits the batch's views; each rank encodes whole views of its own and
  the latents are gathered (pad, local encode, all_gather, trim).
- spatial (spatial.py): every rank decodes every view and encodes a band of its rows, exchanging halos
  with its neighbours; every rank ends with every view's latent.

The encode loop asks the encoder which views a rank decodes and how a batch is split, and hands it the decoded
views; it never asks which mode it runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vaecache.errors import UsageError
from vaecache.parallel.views import SPPlan, plan_sp
from vaecache.settings.parts import SP_MODE_CHOICES

if TYPE_CHECKING:
    from vaecache.vae.model import VaeModel

log = logging.getLogger("vaecache")


class SPEncoder(Protocol):
    mode: str

    def views_per_forward(self, requested: int | str) -> int | str:
        """The --views-per-forward this mode runs for a request (spatial: one view per forward)."""

    def check(self, clip: Any, vae: VaeModel, sp_size: int, spec: str) -> None:
        """Refuse (UsageError) settings this mode cannot encode, before anything runs."""

    def layout(self, work: Any, view_counts: list[int]) -> tuple[tuple[tuple[int, ...], ...], tuple[SPPlan, ...]]:
        """Per batch of `work` (a RankWork; `view_counts[i]`: views of batch i): the views this rank decodes
        and the SP plan that gathers them."""

    def encode(self, vae: Any, views: torch.Tensor, group: Any) -> Any:
        """This rank's part of the batch encoded (an EncodeResult)."""


@dataclass(frozen=True)
class ViewsEncoder:
    """The SP group splits a batch's views in whole units of K views (planning.jobs decided which rank has which)."""

    mode: str = "views"

    def views_per_forward(self, requested: int | str) -> int | str:
        return requested

    def check(self, clip: Any, vae: VaeModel, sp_size: int, spec: str) -> None:
        return None

    def layout(self, work: Any, view_counts: list[int]) -> tuple[tuple[tuple[int, ...], ...], tuple[SPPlan, ...]]:
        return work.view_indices, work.sp_plans

    def encode(self, vae: Any, views: torch.Tensor, group: Any) -> Any:
        return vae.encode_views(views)


@dataclass(frozen=True)
class SpatialEncoder:
    """Every rank of the group decodes every view and encodes its band of each view's rows (Wan VAEs)."""

    mode: str = "spatial"

    def views_per_forward(self, requested: int | str) -> int | str:
        return 1 if requested == "auto" else requested  # the group splits every view's rows: a forward is one view

    def check(self, clip: Any, vae: VaeModel, sp_size: int, spec: str) -> None:
        """--sp-mode spatial needs a Wan VAE without tiling and at least one latent row per rank."""
        from vaecache.parallel.spatial import check_banded, plan_bands

        check_banded(vae.family, spec)
        if clip.tiling:
            raise UsageError("--sp-mode spatial cannot be combined with --tiling")
        if clip.compiled or clip.channels_last:
            raise UsageError(f"--sp-mode spatial cannot be combined with "
                             f"--{'compile' if clip.compiled else 'channels-last'} "
                             "(it runs the encoder band by band, in the input's own memory format)")
        if vae.encoder_impl == "fast":
            raise UsageError("--sp-mode spatial cannot be combined with --encoder-impl fast (it runs diffusers' "
                             "encoder band by band)")
        if vae.views_per_forward > 1:
            raise UsageError("--sp-mode spatial encodes one view per forward; drop --views-per-forward "
                             f"{vae.views_per_forward}")
        for height, _ in clip.sizes:
            plan_bands(height, vae.rule.spatial_factor, sp_size)

    def layout(self, work: Any, view_counts: list[int]) -> tuple[tuple[tuple[int, ...], ...], tuple[SPPlan, ...]]:
        return (tuple(tuple(range(count)) for count in view_counts),
                tuple(plan_sp(count, 1) for count in view_counts))

    @torch.inference_mode()
    def encode(self, vae: Any, views: torch.Tensor, group: Any) -> Any:
        """Every view encoded by the ranks of `group` together, each rank on a band of rows of every frame; all
        views come back on every rank. One view per forward; no out-of-memory backoff (a band that does not fit
        needs a larger group, not a smaller batch)."""
        from vaecache.parallel.spatial import spatial_encode
        from vaecache.vae.runner import EncodeResult

        model = vae.model
        if views.dim() != 5:
            raise UsageError(f"spatial encode needs (views, channels, frames, height, width), got {tuple(views.shape)}")
        means, logvars = [], []
        for view in views.split(1):
            moments = spatial_encode(model.module, view.to(model.device, model.compute_dtype), group)
            channels = moments.shape[1] // 2
            means.append(moments[:, :channels].to(model.dtype))
            logvars.append(moments[:, channels:].to(model.dtype))
        mean, logvar = torch.cat(means), torch.cat(logvars)
        failed = vae.non_finite_views(mean, logvar)
        for v, reason in failed.items():
            log.error("view %d failed: %s", v, reason)
            mean[v].zero_()
            logvar[v].zero_()
        return EncodeResult(mean, logvar, failed, set(), [], [1] * views.shape[0])


ENCODERS: dict[str, SPEncoder] = {"views": ViewsEncoder(), "spatial": SpatialEncoder()}


def encoder_for(mode: str) -> SPEncoder:
    """The SP encoder of --sp-mode `mode`."""
    if mode not in ENCODERS:
        raise UsageError(f"--sp-mode must be one of {', '.join(SP_MODE_CHOICES)}, got {mode!r}")
    return ENCODERS[mode]
