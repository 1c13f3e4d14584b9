"""Running a loaded VAE: micro-batching, out-of-memory backoff, tiling fallback, the non-finite check,
and the ``EncodeResult`` that says what happened to every view."""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vaecache import faults
from vaecache.errors import UsageError, VaecacheError, VaeSpecError, first_line
from vaecache.vae.model import CHANNELS_LAST, VaeModel

log = logging.getLogger("vaecache")

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)

OomHook = Callable[[int, bool], bool]
"""``hook(units_in_forward, tiled) -> bool``: True raises an out-of-memory error before that forward."""


@dataclass
class EncodeResult:
    """The posterior of V views plus what the memory backoff did. Rows of failed views are zeros."""

    mean: torch.Tensor
    """(V, c, t, h, w) in the storage dtype, on the VAE's device."""
    logvar: torch.Tensor | None
    failed: dict[int, str] = field(default_factory=dict)
    """View index -> reason (out of memory even with one view per forward and tiling; a NaN or inf latent)."""
    tiled: set[int] = field(default_factory=set)
    """Views encoded with the model's tiling on (--tiling, or the out-of-memory fallback)."""
    backoffs: list[str] = field(default_factory=list)
    """Human-readable backoff events, in order."""
    forward_sizes: list[int] = field(default_factory=list)
    """Per view: the most units (views, or frames for per-frame VAEs) in one forward that produced it."""

    def view_settings(self, index: int) -> dict[str, Any]:
        """What produced view `index`, for the clip record."""
        return {"tiled": index in self.tiled, "units_per_forward": self.forward_sizes[index]}


class VaeRunner:
    """Encodes views with a VaeModel: ``views_per_forward`` (K) consecutive views per forward (all their
    frames for a per-frame VAE), halving the forward on out-of-memory, then one view (frame) with the
    model's tiling, then a failed view.

    The reduced micro-batch and ``backoff_counts`` last for the runner's life (one run). The model's
    description fields (rule, dtype, family, ...) and ``fingerprint()`` read through the runner, so a
    caller holds one object.
    """

    def __init__(self, model: VaeModel, inject_oom: OomHook | None = None) -> None:
        self.model = model
        self.inject_oom = inject_oom
        """Testing only: see ``OomHook``; set from VAECACHE_FAULT="oom:..." by load_vae."""
        self.backoff_counts: Counter[str] = Counter()
        self._units_per_forward = 0
        self._latent_channels = model.latent_channels
        self._errors_in_a_row = 0
        # Compiled on first use, once per input shape (and again when tiling is switched for a retry).
        self._encode = torch.compile(model.module.encode) if model.compiled else model.module.encode
        self._reference = self._encode
        """What an untiled forward runs: the model family's trainers' encode (vaecache.models), where it is not the
        module's own encode with tiling off (HunyuanVideo's whole-clip encode, Kandinsky 5's own tiles)."""
        if model.reference is not None and model.reference.encode is not None:
            reference = functools.partial(model.reference.encode, model.module)
            self._reference = torch.compile(reference) if model.compiled else reference
        self._fast = fast_encoder(model) if model.encoder_impl == "fast" else None
        """The untiled forward's encoder where --encoder-impl fast (a tiled retry runs diffusers' own)."""

    def pipeline_encode(self) -> VaeRunner:
        """This runner with the module's own encode for untiled forwards, as a diffusers pipeline calls `vae.encode`
        (image-to-video conditions follow their pipeline, not the latents' trainers: Kandinsky5I2VPipeline encodes
        its image untiled where Kandinsky 5's trainers tile a large frame). Shares the model and the backoff state."""
        runner = copy.copy(self)
        runner._reference = self._encode
        return runner

    # ----------------------------------------------------------------- shapes

    @property
    def latent_channels(self) -> int:
        if not self._latent_channels:
            self._latent_channels = self._probe_channels()
        return self._latent_channels

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(c, t, h, w) of one view's latent, without encoding (a plugin without
        vaecache_latent_channels is probed once with a tiny dummy input)."""
        return self.model.rule.latent_shape(self.latent_channels, num_frames, height, width)

    @torch.inference_mode()
    def _probe_channels(self) -> int:
        model = self.model
        side = model.rule.spatial_factor * max(1, math.ceil(16 / model.rule.spatial_factor))
        frames = model.rule.min_frames
        x = torch.zeros(1, 3, frames, side, side, device=model.device, dtype=model.compute_dtype)
        try:
            mean, _ = _posterior(model.module.encode(x))
        except VaeSpecError:
            raise
        except Exception as exc:
            raise VaeSpecError(f"{model.spec}: encoding a (1, 3, {frames}, {side}, {side}) dummy input to find the "
                               f"latent channels failed ({first_line(exc)}); set vaecache_latent_channels on the "
                               "module") from None
        expected = model.rule.latent_shape(mean.shape[1], frames, side, side)[1:]
        if mean.dim() != 5 or tuple(mean.shape[2:]) != expected:
            raise VaeSpecError(f"{model.spec}: encode of a (1, 3, {frames}, {side}, {side}) input returned "
                               f"{tuple(mean.shape)}; its declared rule ({model.rule.describe()}) predicts "
                               f"(1, c, {', '.join(map(str, expected))})")
        return int(mean.shape[1])

    # ----------------------------------------------------------------- encoding

    @torch.inference_mode()
    def encode_views(self, views: torch.Tensor) -> EncodeResult:
        """(V, C, T, H, W) in [-1, 1] -> EncodeResult with (V, c, t, h, w) mean/logvar in the storage dtype."""
        model = self.model
        if views.dim() != 5:
            raise UsageError(f"encode_views needs (views, channels, frames, height, width), got {tuple(views.shape)}")
        num_views, _, num_frames, height, width = views.shape
        if model.per_frame:
            units = [(v, t) for v in range(num_views) for t in range(num_frames)]
        else:
            units = [(v, -1) for v in range(num_views)]
        # A forward never crosses a boundary between K-view groups (rows 0..K-1, K..2K-1, ...): the rows one
        # forward encodes together are fixed by K, whatever else is in the batch.
        group = model.views_per_forward * (num_frames if model.per_frame else 1)
        outputs, failed_units, tiled_units, sizes, events = self._run_units(views, units, group)
        expected = self.latent_shape(num_frames, height, width)
        if model.per_frame:
            expected = (expected[0], *expected[2:])
        for index, (m, lv) in list(outputs.items()):
            wrong = next((tuple(t.shape) for t in (m, lv) if t is not None and tuple(t.shape) != expected), None)
            if wrong is not None:
                del outputs[index]
                failed_units[index] = (f"{model.spec} returned a latent of shape {wrong}, expected {expected} "
                                       f"(c, {'h, w' if model.per_frame else 't, h, w'})")
                log.error("%s failed: %s", self._unit_label(units[index]), failed_units[index])

        shape = self.latent_shape(num_frames, height, width)
        with_logvar = any(lv is not None for _, lv in outputs.values()) or (not outputs and model.has_logvar)
        if model.has_logvar and outputs and not with_logvar:
            raise VaeSpecError(f"{model.spec}: declares a log-variance (vaecache_has_logvar) but encode returned "
                               "a mean only")
        mean = torch.zeros((num_views, *shape), dtype=model.dtype, device=model.device)
        logvar = torch.zeros_like(mean) if with_logvar else None
        for index, (m, lv) in outputs.items():
            v, t = units[index]
            target = (v, slice(None), t) if model.per_frame else (v,)
            mean[target] = m
            if logvar is not None and lv is not None:
                logvar[target] = lv

        failed: dict[int, str] = {}
        for index, reason in failed_units.items():
            v, t = units[index]
            failed.setdefault(v, reason if t < 0 else f"frame {t}: {reason}")
        for v, reason in self.non_finite_views(mean, logvar).items():
            if v not in failed:
                failed[v] = reason
                log.error("view %d failed: %s", v, reason)
        for v in failed:  # a view with one failed frame is failed as a whole: zero all its rows
            mean[v].zero_()
            if logvar is not None:
                logvar[v].zero_()
        forward_sizes = [0] * num_views
        for index, size in sizes.items():
            v = units[index][0]
            forward_sizes[v] = max(forward_sizes[v], size)
        return EncodeResult(mean, logvar, failed, {units[i][0] for i in tiled_units}, events, forward_sizes)

    def non_finite_views(self, mean: torch.Tensor, logvar: torch.Tensor | None) -> dict[int, str]:
        """View index -> reason, for views whose stored latent holds a NaN or an inf (fp16/bf16 overflow)."""
        stored = [mean] if logvar is None else [mean, logvar]
        finite = torch.stack([torch.isfinite(t).flatten(1).all(1) for t in stored]).all(0)
        if bool(finite.all()):  # one device sync per batch in the common case
            return {}
        reasons = {}
        for v in (~finite).nonzero().flatten().tolist():
            nans = sum(int(torch.isnan(t[v]).sum()) for t in stored)
            infs = sum(int(torch.isinf(t[v]).sum()) for t in stored)
            reasons[v] = f"non-finite latent ({nans} NaN, {infs} inf) from {self.model.spec}"
        return reasons

    def _run_units(self, views: torch.Tensor, units: list[tuple[int, int]], group: int):
        """Encode every unit in forwards of at most `group` units that never cross a multiple of `group`,
        backing off on out-of-memory. Returns per-unit outputs and what happened."""
        model = self.model
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        failed: dict[int, str] = {}
        tiled: set[int] = set()
        sizes: dict[int, int] = {}
        events: list[str] = []
        what = "frames" if model.per_frame else "views"
        position = 0
        while position < len(units):
            size = min(group, self._units_per_forward or group)
            group_end = (position // group + 1) * group
            chunk = list(range(position, min(position + size, group_end, len(units))))
            try:
                error = self._try_forward(views, units, chunk, model.tiling, outputs, sizes)
            except _ForwardError as exc:
                self._units_alone(views, units, chunk, exc, outputs, sizes, failed)
                position += len(chunk)
                continue
            if error is None:
                self._errors_in_a_row = 0
                if model.tiling:
                    tiled.update(chunk)
                position += len(chunk)
                continue
            if len(chunk) > 1:
                new_size = max(1, len(chunk) // 2)
                self._units_per_forward = new_size
                self._note(events, "halved", f"out of memory encoding {len(chunk)} {what} in one forward ({error}); "
                                             f"micro-batch {len(chunk)} -> {new_size} for the rest of this run")
                continue
            index = chunk[0]
            label = self._unit_label(units[index])
            if not model.tiling and model.can_tile:
                self._note(events, "tiling", f"out of memory on {label} with one {what[:-1]} per forward ({error}); "
                                             "retrying it with the model's tiling")
                error = self._try_forward(views, units, chunk, True, outputs, sizes)
                if error is None:
                    tiled.add(index)
                    position += 1
                    continue
            tried = "one per forward" + (" and tiling" if model.can_tile else " (this VAE has no tiling)")
            reason = f"out of memory ({tried}): {error}"
            failed[index] = reason
            self._note(events, "failed", f"{label} failed: {reason}", level=logging.ERROR)
            position += 1
        return outputs, failed, tiled, sizes, events

    def _units_alone(self, views: torch.Tensor, units: list[tuple[int, int]], chunk: list[int],
                     error: _ForwardError, outputs: dict, sizes: dict, failed: dict[int, str]) -> None:
        """After `error` (not out of memory) in a forward of `chunk`: each unit alone; one that still fails is a
        failed view, the others are kept. Too many failures in a row stop the run: the VAE is broken."""
        for index in chunk:
            reason: str | None = str(error) if len(chunk) == 1 else None
            if reason is None:
                try:
                    oom = self._try_forward(views, units, [index], self.model.tiling, outputs, sizes)
                    reason = None if oom is None else f"out of memory: {oom}"
                except _ForwardError as alone:
                    reason = str(alone)
            if reason is None:
                self._errors_in_a_row = 0
                continue
            failed[index] = reason
            log.error("%s failed: %s", self._unit_label(units[index]), reason)
            self._errors_in_a_row += 1
            if self._errors_in_a_row >= ERRORS_IN_A_ROW_LIMIT:
                raise VaecacheError(f"{self.model.spec} failed on {self._errors_in_a_row} inputs in a row (last: "
                                    f"{reason}); that is not about one clip, so the run stops")

    def _try_forward(self, views: torch.Tensor, units: list[tuple[int, int]], chunk: list[int], tiled: bool,
                     outputs: dict, sizes: dict) -> str | None:
        """Run one forward over `chunk`; store its rows and return None, or return the OOM message."""
        if self.model.per_frame:
            batch = torch.stack([views[units[i][0], :, units[i][1]] for i in chunk])
        else:
            first = units[chunk[0]][0]
            batch = views[first:first + len(chunk)]
        batch = batch.to(self.model.device, self.model.compute_dtype, non_blocking=True)
        if self.model.channels_last:
            batch = batch.contiguous(memory_format=CHANNELS_LAST[batch.dim()])
        try:
            mean, logvar = self._forward(batch, tiled)
        except OOM_ERRORS as exc:
            message = first_line(exc)
        except VaecacheError:
            raise
        except Exception as exc:  # a plugin or model error on this input
            raise _ForwardError(f"{self.model.spec} raised {type(exc).__name__}: {first_line(exc)}") from None
        else:
            for row, index in enumerate(chunk):
                outputs[index] = (mean[row], None if logvar is None else logvar[row])
                sizes[index] = len(chunk)
            return None
        # Out of the except block, so the failed forward's tensors (held by the traceback) are released.
        _release_failed_forward(self.model.module, self.model.device)
        return message

    def _forward(self, batch: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.model
        if self.inject_oom is not None and self.inject_oom(batch.shape[0], tiled):
            raise torch.cuda.OutOfMemoryError(f"injected out of memory ({batch.shape[0]} units, tiled={tiled})")
        switch = tiled and not model.tiling
        if switch:
            model.module.enable_tiling()
        try:
            if self._fast is not None and not tiled:
                mean, logvar = _posterior(self._fast.posterior(batch))
            elif tiled:
                mean, logvar = _posterior(self._encode(batch))
            else:
                mean, logvar = _posterior(self._reference(batch))
        finally:
            if switch:
                model.module.disable_tiling()
        return mean.to(model.dtype), (None if logvar is None else logvar.to(model.dtype))

    def _unit_label(self, unit: tuple[int, int]) -> str:
        return f"view {unit[0]} frame {unit[1]}" if self.model.per_frame else f"view {unit[0]}"

    def _note(self, events: list[str], kind: str, message: str, level: int = logging.WARNING) -> None:
        self.backoff_counts[kind] += 1
        events.append(message)
        log.log(level, "OOM backoff: %s", message)


ERRORS_IN_A_ROW_LIMIT = 8
"""A VAE that raises on this many inputs in a row is broken, not fed a bad clip: the run stops."""


class _ForwardError(Exception):
    """A forward raised something other than out-of-memory; the message names the VAE and the error."""


def oom_hook_from_env() -> OomHook | None:
    """The out-of-memory injection VAECACHE_FAULT asks for (``oom:...``), logged loudly, or None."""
    injector = faults.oom_injector()
    if injector is not None:
        log.warning("%s: out-of-memory errors will be injected (%s; testing only)", faults.FAULT_ENV, injector.fault)
    return injector


def _release_failed_forward(module: torch.nn.Module, device: torch.device) -> None:
    """After an out-of-memory error mid-forward: drop what the module still holds of the failed batch, then return
    the allocator's free blocks to the device.

    Wan's causal encoder keeps every convolution's last frames in ``_enc_feat_map`` and clears it only at the start
    and the end of a successful encode, so a forward that failed halfway leaves the failed batch's caches alive
    until the next forward starts; ``empty_cache`` cannot return them, and the retry allocates beside them. On an
    H200 under a memory cap, single views went to the tiling fallback with 2.2-2.4 GiB reserved but unallocated
    (docs/gpu.md)."""
    clear = getattr(module, "clear_cache", None)
    if callable(clear) and hasattr(module, "_enc_feat_map"):  # diffusers' causal Wan-style VAEs (a plugin's own
        clear()                                                # clear_cache may mean something else)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def fast_encoder(model: VaeModel) -> Any:
    """The fast encoder its family declares (vaecache.models.FastEncoder) for the module on its device
    (production_encoder: what model.encoder_variant records)."""
    from vaecache.models import vae_class

    declared = vae_class(type(model.module).__name__)
    if declared is None or declared.fast_encoder is None:
        raise UsageError(f"{model.spec}: no fast encoder is declared for {type(model.module).__name__}")
    return declared.fast_encoder.implementation().production_encoder(model.module, model.device)


def _posterior(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accept diffusers outputs, a distribution with mean/logvar, or a plain tensor (mean only)."""
    if isinstance(output, tuple) and len(output) == 1:
        output = output[0]
    dist = getattr(output, "latent_dist", output)
    if isinstance(dist, torch.Tensor):
        return dist, None
    mean = getattr(dist, "mean", None)
    if not isinstance(mean, torch.Tensor):
        raise VaeSpecError(f"encode() returned {type(output).__name__}; expected a tensor, or an object with "
                           "latent_dist or mean/logvar tensors")
    logvar = getattr(dist, "logvar", None)
    return mean, logvar if isinstance(logvar, torch.Tensor) else None


__all__ = ["OOM_ERRORS", "EncodeResult", "OomHook", "VaeRunner", "oom_hook_from_env"]
