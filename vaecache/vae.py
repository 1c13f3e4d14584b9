"""VAE backends (builtin, diffusers, python plugin), their frame/pixel rules, fingerprints, and encoding.

``--vae`` takes one of:

* ``builtin:tiny``: an untrained tiny AutoencoderKLWan with fixed random weights, for demos and tests.
* ``diffusers:PATH[#subfolder]``: a diffusers model folder; ``config.json``'s ``_class_name`` picks the
  family: AutoencoderKLWan, AutoencoderKLHunyuanVideo, AutoencoderKLCogVideoX, AutoencoderKLLTXVideo,
  or AutoencoderKL (a 2D image VAE applied to every frame; its latents are laid out (c, t, h, w) like
  the video VAEs', with t equal to the number of frames). Frame and pixel rules come from the config.
* ``python:module.path:factory``: anything else, following the protocol below.

Python plugin protocol
----------------------
``factory()`` is called with no arguments and returns a ``torch.nn.Module`` with ``encode(x)``:

* ``x`` is ``(B, 3, T, H, W)`` RGB in ``[-1, 1]``, on the module's device and dtype. B is 1 by default
  and at most ``--max-views-per-forward``; each row must be encoded independently of the others.
* It returns a diffusers output (``.latent_dist`` with ``.mean`` and ``.logvar``), an object with
  ``.mean`` (and optionally ``.logvar``) tensors, a plain tensor (taken as the mean), or a 1-tuple of
  one of these; every tensor is ``(B, c, t, h, w)``.

Optional attributes on the module:

* ``vaecache_temporal_factor`` (int, default 1) and ``vaecache_spatial_factor`` (int, default 1);
* ``vaecache_causal`` (bool, default temporal_factor > 1): the clip takes 1 + k*temporal_factor frames;
* ``vaecache_has_logvar`` (bool, default True): False when encode returns a mean only (then only
  ``--store mean`` works);
* ``vaecache_latent_channels`` (int): otherwise found by encoding one tiny dummy input, once;
* ``config`` (dict): recorded in the fingerprint; ``enable_tiling()`` / ``disable_tiling()``: used by
  ``--tiling`` and by the out-of-memory fallback.

Encoding and memory
-------------------
``LoadedVae.encode_views`` runs at most ``max_views_per_forward`` views per forward (default 1; for
the per-frame 2D family the unit is one frame). Convolution kernels may pick other algorithms for
other batch sizes, so one unit per forward is what makes stored latents independent of batch size,
SP size and world size; K > 1 is allowed and recorded. On out-of-memory it halves the micro-batch
and retries, then retries one view with the model's own tiling, then records the view as failed
(its rows zero-filled so shapes stay uniform for all_gather). Every step is logged on the
"vaecache" logger and counted in ``LoadedVae.backoff_counts``; ``EncodeResult`` says which views
were tiled, which failed, and the micro-batch that produced each.

Testing the backoff: set ``VAECACHE_INJECT_OOM`` before loading (grammar in ``OomInjector.parse``),
or assign ``loaded._oom_injector = callable(units_in_forward, tiled) -> bool`` (True raises
``torch.cuda.OutOfMemoryError`` before that forward runs). No diffusers internals are patched.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vaecache.errors import FrameRuleError, UsageError, VaeSpecError

log = logging.getLogger("vaecache")

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_LABELS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
INJECT_OOM_ENV = "VAECACHE_INJECT_OOM"
OOM_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)

BUILTIN_TINY_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
BUILTIN_TINY_SEED = 20240601


# --------------------------------------------------------------------------- frame rules


@dataclass(frozen=True)
class FrameRule:
    """How a VAE compresses time and space, and which input sizes it accepts."""

    temporal_factor: int = 1
    spatial_factor: int = 1
    causal: bool = False
    """Causal video VAEs take 1 + k*frame_step frames (the first frame is encoded alone)."""
    frame_step: int = 0
    """Granularity of valid frame counts; 0 means temporal_factor. CogVideoX encodes frames in batches
    of 8, so it takes 1 + 8k frames although it compresses time by 4."""
    label: str = "this VAE"
    """Names the VAE in error messages."""

    @property
    def step(self) -> int:
        return self.frame_step or self.temporal_factor

    @property
    def min_frames(self) -> int:
        return 1 if self.causal else self.step

    def frames_ok(self, num_frames: int) -> bool:
        if num_frames < self.min_frames:
            return False
        return (num_frames - 1) % self.step == 0 if self.causal else num_frames % self.step == 0

    def nearest_frames(self, num_frames: int) -> list[int]:
        """The valid frame counts just below and above num_frames (one value when below the minimum)."""
        if num_frames <= self.min_frames:
            return [self.min_frames]
        base = 1 if self.causal else 0
        low = base + (num_frames - base) // self.step * self.step
        return [low, low + self.step] if low >= self.min_frames else [low + self.step]

    def latent_frames(self, num_frames: int) -> int:
        if self.causal:
            return 1 + (num_frames - 1) // self.temporal_factor
        return num_frames // self.temporal_factor

    def describe(self) -> str:
        frames = (f"1 + {self.step}k frames" if self.causal else
                  "any number of frames" if self.step == 1 else f"a multiple of {self.step} frames")
        return f"{frames}, height and width multiples of {self.spatial_factor}"

    def check(self, num_frames: int, height: int, width: int) -> None:
        """Raise FrameRuleError naming the nearest valid values when the clip shape is not accepted."""
        if not self.frames_ok(num_frames):
            near = " and ".join(map(str, self.nearest_frames(num_frames)))
            why = (f"it takes 1 + {self.step}k frames (the first frame is encoded alone, then groups of {self.step})"
                   if self.causal else f"it takes a multiple of {self.step} frames")
            raise FrameRuleError(f"--num-frames {num_frames} is not valid for {self.label}: {why}; nearest valid: {near}")
        sf = self.spatial_factor
        for name, value in (("height", height), ("width", width)):
            if value % sf:
                low = value // sf * sf
                options = f"{low} and {low + sf}" if low else f"{sf}"
                raise FrameRuleError(
                    f"--size {height}x{width}: {name} {value} is not a multiple of {sf} (the spatial factor of "
                    f"{self.label}); nearest valid {name}: {options}")

    def latent_shape(self, channels: int, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return channels, self.latent_frames(num_frames), height // self.spatial_factor, width // self.spatial_factor

    def to_json(self) -> dict[str, Any]:
        return {"temporal_factor": self.temporal_factor, "spatial_factor": self.spatial_factor,
                "causal": self.causal, "frame_step": self.step}


# --------------------------------------------------------------------------- OOM injection


@dataclass
class OomInjector:
    """Raises torch.cuda.OutOfMemoryError before chosen forwards, for testing the backoff on any machine.

    ``parse("COUNT[>K][:untiled]")``: COUNT is a number or ``*`` (every matching forward); ``>K`` matches
    only forwards of more than K units (views, or frames for per-frame VAEs); ``:untiled`` only forwards
    without tiling. ``"2"``: the first two forwards; ``"*>1"``: every forward of 2+ views;
    ``"*:untiled"``: every untiled forward (the tiling fallback then succeeds); ``"*"``: every forward.
    """

    remaining: int | None = None
    """Forwards still to fail; None: unlimited."""
    more_than: int = 0
    untiled_only: bool = False
    injected: int = 0

    @classmethod
    def parse(cls, text: str) -> OomInjector:
        match = re.fullmatch(r"\s*(\*|\d+)\s*(?:>\s*(\d+))?\s*(:untiled)?\s*", text)
        if not match:
            raise UsageError(f"{INJECT_OOM_ENV}={text!r}: expected COUNT[>K][:untiled], e.g. '2', '*>1' or '*:untiled'")
        count = None if match.group(1) == "*" else int(match.group(1))
        return cls(count, int(match.group(2) or 0), bool(match.group(3)))

    def __call__(self, units: int, tiled: bool) -> bool:
        if units <= self.more_than or (self.untiled_only and tiled):
            return False
        if self.remaining is not None:
            if self.remaining <= 0:
                return False
            self.remaining -= 1
        self.injected += 1
        return True


# --------------------------------------------------------------------------- encode result


@dataclass
class EncodeResult:
    """The posterior of V views plus what the memory backoff did. Rows of failed views are zeros."""

    mean: torch.Tensor
    """(V, c, t, h, w) in the storage dtype, on the VAE's device."""
    logvar: torch.Tensor | None
    failed: dict[int, str] = field(default_factory=dict)
    """View index -> reason (out of memory even with one view per forward and tiling)."""
    tiled: set[int] = field(default_factory=set)
    """Views encoded with the model's tiling on (--tiling, or the out-of-memory fallback)."""
    backoffs: list[str] = field(default_factory=list)
    """Human-readable backoff events, in order."""
    forward_sizes: list[int] = field(default_factory=list)
    """Per view: the most units (views, or frames for per-frame VAEs) in one forward that produced it."""

    def view_settings(self, index: int) -> dict[str, Any]:
        """What produced view `index`, for the clip record."""
        return {"tiled": index in self.tiled, "units_per_forward": self.forward_sizes[index]}


# --------------------------------------------------------------------------- the loaded VAE


@dataclass
class LoadedVae:
    """A ready-to-run VAE: the module, its rule, what identifies it, and how it is run."""

    module: torch.nn.Module
    spec: str
    family: str
    rule: FrameRule
    latent_channels: int
    config: dict[str, Any]
    weights_sha256: str
    untrained: bool = False
    has_logvar: bool = True
    normalization: dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    """Storage dtype (what --dtype asked for); latents come back in it."""
    compute_dtype: torch.dtype | None = None
    """What the module runs in; differs from dtype only where a family is upcast (see DTYPE_POLICY)."""
    dtype_note: str | None = None
    per_frame: bool = False
    """A 2D image VAE: every frame is encoded on its own and the results stacked along t."""
    tiling: bool = False
    tile_params: dict[str, Any] = field(default_factory=dict)
    max_views_per_forward: int = 1
    backoff_counts: Counter = field(default_factory=Counter)
    _oom_injector: Callable[[int, bool], bool] | None = field(default=None, repr=False)
    _units_per_forward: int = field(default=0, repr=False)

    @property
    def can_tile(self) -> bool:
        return callable(getattr(self.module, "enable_tiling", None)) and callable(getattr(self.module, "disable_tiling", None))

    def fingerprint(self) -> dict[str, Any]:
        """What identifies these latents' producer: class, config, a hash of every parameter and buffer,
        and the run settings that change latents (compute dtype, tiling and its tile sizes, micro-batch)."""
        return {
            "family": self.family,
            "config": self.config,
            "weights_sha256": self.weights_sha256,
            "spec": self.spec,
            "untrained": self.untrained,
            "normalization": self.normalization,
            "per_frame": self.per_frame,
            "precision": {"compute": DTYPE_LABELS[self.compute_dtype or self.dtype], "stored": DTYPE_LABELS[self.dtype],
                          "note": self.dtype_note},
            "tiling": {"enabled": self.tiling, "available": self.can_tile, "params": self.tile_params},
            "max_views_per_forward": self.max_views_per_forward,
        }

    # ----------------------------------------------------------------- shapes

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(c, t, h, w) of one view's latent, without encoding (a plugin without
        vaecache_latent_channels is probed once with a tiny dummy input)."""
        if not self.latent_channels:
            self.latent_channels = self._probe_channels()
        return self.rule.latent_shape(self.latent_channels, num_frames, height, width)

    @torch.inference_mode()
    def _probe_channels(self) -> int:
        side = self.rule.spatial_factor * max(1, math.ceil(16 / self.rule.spatial_factor))
        frames = self.rule.min_frames
        x = torch.zeros(1, 3, frames, side, side, device=self.device, dtype=self.compute_dtype or self.dtype)
        try:
            mean, _ = _posterior(self.module.encode(x))
        except VaeSpecError:
            raise
        except Exception as exc:
            raise VaeSpecError(f"{self.spec}: encoding a (1, 3, {frames}, {side}, {side}) dummy input to find the latent "
                               f"channels failed ({_first_line(exc)}); set vaecache_latent_channels on the module") from None
        expected = self.rule.latent_shape(mean.shape[1], frames, side, side)[1:]
        if mean.dim() != 5 or tuple(mean.shape[2:]) != expected:
            raise VaeSpecError(f"{self.spec}: encode of a (1, 3, {frames}, {side}, {side}) input returned {tuple(mean.shape)}; "
                               f"its declared rule ({self.rule.describe()}) predicts (1, c, {', '.join(map(str, expected))})")
        return int(mean.shape[1])

    # ----------------------------------------------------------------- encoding

    @torch.inference_mode()
    def encode_views(self, views: torch.Tensor) -> EncodeResult:
        """(V, C, T, H, W) in [-1, 1] -> EncodeResult with (V, c, t, h, w) mean/logvar in the storage dtype."""
        if views.dim() != 5:
            raise UsageError(f"encode_views needs (views, channels, frames, height, width), got {tuple(views.shape)}")
        num_views, _, num_frames, height, width = views.shape
        if self.per_frame:
            units = [(v, t) for v in range(num_views) for t in range(num_frames)]
        else:
            units = [(v, -1) for v in range(num_views)]
        outputs, failed_units, tiled_units, sizes, events = self._run_units(views, units)

        template = next((m for m, _ in outputs.values()), None)
        if template is not None:
            shape = ((template.shape[0], num_frames, *template.shape[1:]) if self.per_frame else tuple(template.shape))
        else:
            shape = self.latent_shape(num_frames, height, width)
        with_logvar = any(lv is not None for _, lv in outputs.values()) or (not outputs and self.has_logvar)
        if self.has_logvar and outputs and not with_logvar:
            raise VaeSpecError(f"{self.spec}: declares a log-variance (vaecache_has_logvar) but encode returned a mean only")
        mean = torch.zeros((num_views, *shape), dtype=self.dtype, device=self.device)
        logvar = torch.zeros_like(mean) if with_logvar else None
        for index, (m, lv) in outputs.items():
            v, t = units[index]
            target = (v, slice(None), t) if self.per_frame else (v,)
            mean[target] = m
            if logvar is not None and lv is not None:
                logvar[target] = lv

        failed: dict[int, str] = {}
        for index, reason in failed_units.items():
            v, t = units[index]
            failed.setdefault(v, reason if t < 0 else f"frame {t}: {reason}")
        for v in failed:  # a view with one failed frame is failed as a whole: zero all its rows
            mean[v].zero_()
            if logvar is not None:
                logvar[v].zero_()
        forward_sizes = [0] * num_views
        for index, size in sizes.items():
            v = units[index][0]
            forward_sizes[v] = max(forward_sizes[v], size)
        return EncodeResult(mean, logvar, failed, {units[i][0] for i in tiled_units}, events, forward_sizes)

    def _run_units(self, views: torch.Tensor, units: list[tuple[int, int]]):
        """Encode every unit, backing off on out-of-memory. Returns per-unit outputs and what happened."""
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        failed: dict[int, str] = {}
        tiled: set[int] = set()
        sizes: dict[int, int] = {}
        events: list[str] = []
        what = "frames" if self.per_frame else "views"
        position = 0
        while position < len(units):
            size = min(self.max_views_per_forward, self._units_per_forward or self.max_views_per_forward)
            chunk = list(range(position, min(position + size, len(units))))
            error = self._try_forward(views, units, chunk, self.tiling, outputs, sizes)
            if error is None:
                if self.tiling:
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
            if not self.tiling and self.can_tile:
                self._note(events, "tiling", f"out of memory on {label} with one {what[:-1]} per forward ({error}); "
                                             "retrying it with the model's tiling")
                error = self._try_forward(views, units, chunk, True, outputs, sizes)
                if error is None:
                    tiled.add(index)
                    position += 1
                    continue
            tried = "one per forward" + (" and tiling" if self.can_tile else " (this VAE has no tiling)")
            reason = f"out of memory ({tried}): {error}"
            failed[index] = reason
            self._note(events, "failed", f"{label} failed: {reason}", level=logging.ERROR)
            position += 1
        return outputs, failed, tiled, sizes, events

    def _try_forward(self, views: torch.Tensor, units: list[tuple[int, int]], chunk: list[int], tiled: bool,
                     outputs: dict, sizes: dict) -> str | None:
        """Run one forward over `chunk`; store its rows and return None, or return the OOM message."""
        if self.per_frame:
            batch = torch.stack([views[units[i][0], :, units[i][1]] for i in chunk])
        else:
            first = units[chunk[0]][0]
            batch = views[first:first + len(chunk)]
        try:
            mean, logvar = self._forward(batch.to(self.device, self.compute_dtype or self.dtype, non_blocking=True), tiled)
        except OOM_ERRORS as exc:
            message = _first_line(exc)
        else:
            for row, index in enumerate(chunk):
                outputs[index] = (mean[row], None if logvar is None else logvar[row])
                sizes[index] = len(chunk)
            return None
        # Out of the except block, so the failed forward's tensors (held by the traceback) are released.
        _release_cached_memory(self.device)
        return message

    def reset_backoff(self) -> None:
        """Forget the micro-batch reduced by earlier out-of-memory errors, and the counts."""
        self._units_per_forward = 0
        self.backoff_counts.clear()

    def _forward(self, batch: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        injector = self._oom_injector
        if injector is not None and injector(batch.shape[0], tiled):
            raise torch.cuda.OutOfMemoryError(f"injected out of memory ({batch.shape[0]} units, tiled={tiled})")
        switch = tiled and not self.tiling
        if switch:
            self.module.enable_tiling()
        try:
            mean, logvar = _posterior(self.module.encode(batch))
        finally:
            if switch:
                self.module.disable_tiling()
        return mean.to(self.dtype), (None if logvar is None else logvar.to(self.dtype))

    def _unit_label(self, unit: tuple[int, int]) -> str:
        return f"view {unit[0]} frame {unit[1]}" if self.per_frame else f"view {unit[0]}"

    def _note(self, events: list[str], kind: str, message: str, level: int = logging.WARNING) -> None:
        self.backoff_counts[kind] += 1
        events.append(message)
        log.log(level, "OOM backoff: %s", message)


def _release_cached_memory(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


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


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order."""
    digest = hashlib.sha256()
    state = module.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# --------------------------------------------------------------------------- families
#
# Each rule mirrors the family's encoder in diffusers (models/autoencoders/autoencoder_kl_*.py), so a
# config with fewer or other down blocks than the released model still gets the right factors.


def _log2(value: Any, what: str) -> int:
    number = int(value)
    if number < 1 or number & (number - 1):
        raise VaeSpecError(f"{what} must be a power of two, got {value!r}")
    return number.bit_length() - 1


def _wan_rule(config: dict[str, Any]) -> FrameRule:
    # WanEncoder3d downsamples once per dim_mult step; temperal_downsample says which steps also halve
    # time. _encode feeds the first frame alone, then chunks of 4 frames: 1 + 4k frames.
    levels = len(config.get("dim_mult", [1, 2, 4, 4])) - 1
    temporal = 2 ** sum(bool(x) for x in config.get("temperal_downsample", [False, True, True])[:levels])
    if temporal > 4:
        raise VaeSpecError(f"AutoencoderKLWan with temporal compression {temporal} is not supported "
                           "(diffusers encodes chunks of 4 frames)")
    spatial = 2 ** levels * int(config.get("patch_size") or 1)
    return FrameRule(temporal, spatial, causal=True, frame_step=4, label="AutoencoderKLWan")


def _cogvideox_rule(config: dict[str, Any]) -> FrameRule:
    # CogVideoXEncoder3D: block i < log2(temporal_compression_ratio) also halves time, and only
    # blocks that downsample at all (every block but the last) can. _encode runs frames in batches of
    # 8 with the odd first frame kept alone: 1 + 8k frames (CogVideoX trains on 49 = 1 + 8*6).
    blocks = len(config.get("block_out_channels", (128, 256, 256, 512)))
    levels = min(_log2(config.get("temporal_compression_ratio", 4), "temporal_compression_ratio"), blocks - 1)
    temporal = 2 ** levels
    if 8 % temporal:
        raise VaeSpecError(f"AutoencoderKLCogVideoX with temporal compression {temporal} is not supported "
                           "(diffusers encodes batches of 8 frames)")
    return FrameRule(temporal, 2 ** (blocks - 1), causal=True, frame_step=8, label="AutoencoderKLCogVideoX")


def _hunyuan_rule(config: dict[str, Any]) -> FrameRule:
    # HunyuanVideoEncoder3D: block i halves space while i < log2(spatial ratio); time is halved by the
    # last log2(4) non-final blocks (ratio 4) or the first log2(8) blocks (ratio 8). Causal: 1 + tk frames.
    blocks = len(config.get("block_out_channels", (128, 256, 512, 512)))
    spatial_levels = _log2(config.get("spatial_compression_ratio", 8), "spatial_compression_ratio")
    ratio = int(config.get("temporal_compression_ratio", 4))
    time_levels = _log2(ratio, "temporal_compression_ratio")
    if ratio == 4:
        temporal = sum(1 for i in range(blocks) if blocks - 1 - time_levels <= i < blocks - 1)
    elif ratio == 8:
        temporal = sum(1 for i in range(blocks) if i < time_levels)
    else:
        raise VaeSpecError(f"AutoencoderKLHunyuanVideo temporal_compression_ratio {ratio} is not supported (4 or 8)")
    spatial = sum(1 for i in range(blocks) if i < spatial_levels)
    return FrameRule(2 ** temporal, 2 ** spatial, causal=True, label="AutoencoderKLHunyuanVideo")


def _ltx_rule(config: dict[str, Any]) -> FrameRule:
    # LTXVideoEncoder3d: patchify by patch_size (space) and patch_size_t (time), then each scaling
    # block halves space and/or time: LTXVideoDownBlock3D both; LTXVideo095DownBlock3D per
    # downsample_type (conv/spatiotemporal both, spatial, temporal). Strided causal convs map 1 + 2k
    # frames to 1 + k, so the clip takes 1 + temporal_factor*k frames (LTX-Video: 32x spatial, 8x time).
    if int(config.get("patch_size_t", 1)) != 1:
        raise VaeSpecError("AutoencoderKLLTXVideo with patch_size_t != 1 is not supported")
    block_types = list(config.get("down_block_types", ["LTXVideoDownBlock3D"] * 4))
    is_095 = bool(block_types) and block_types[-1] == "LTXVideo095DownBlock3D"
    count = len(config.get("block_out_channels", (128, 256, 512, 512))) - (1 if is_095 else 0)
    scaling = list(config.get("spatio_temporal_scaling", (True, True, True, False)))
    kinds = list(config.get("downsample_type", ["conv"] * count))
    spatial = temporal = 0
    for i in range(count):
        if not scaling[i]:
            continue
        block = block_types[min(i, len(block_types) - 1)]
        kind = kinds[min(i, len(kinds) - 1)] if block == "LTXVideo095DownBlock3D" else "conv"
        spatial += kind in ("conv", "spatiotemporal", "spatial")
        temporal += kind in ("conv", "spatiotemporal", "temporal")
    patch = int(config.get("patch_size", 4))
    return FrameRule(2 ** temporal, patch * 2 ** spatial, causal=True, label="AutoencoderKLLTXVideo")


def _image_rule(config: dict[str, Any]) -> FrameRule:
    # Encoder (2D): every block but the last halves space. Frames are encoded one by one: any count.
    return FrameRule(1, 2 ** (len(config.get("block_out_channels", (64,))) - 1), label="AutoencoderKL")


def _config_constants(config: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: config[key] for key in keys if config.get(key) is not None}


def _wan_normalization(config: dict[str, Any], module: torch.nn.Module | None) -> dict[str, Any]:
    out = _config_constants(config, ("latents_mean", "latents_std"))
    out["formula"] = "(z - latents_mean) / latents_std"
    return out


def _ltx_normalization(config: dict[str, Any], module: torch.nn.Module | None) -> dict[str, Any]:
    # LTX keeps latents_mean/std as buffers in the weights, not in config.json.
    out: dict[str, Any] = {"scaling_factor": config.get("scaling_factor", 1.0)}
    for name in ("latents_mean", "latents_std"):
        buffer = getattr(module, name, None)
        if isinstance(buffer, torch.Tensor):
            out[name] = [float(x) for x in buffer.detach().float().cpu().tolist()]
    out["formula"] = "(z - latents_mean) * scaling_factor / latents_std"
    return out


def _scale_normalization(config: dict[str, Any], module: torch.nn.Module | None) -> dict[str, Any]:
    out = _config_constants(config, ("scaling_factor", "shift_factor", "latents_mean", "latents_std"))
    if config.get("invert_scale_latents"):
        out["invert_scale_latents"] = True  # CogVideoX 1.5 I2V: image latents are divided by scaling_factor
    if "shift_factor" in out:
        out["formula"] = "(z - shift_factor) * scaling_factor"
    elif "latents_mean" in out and "latents_std" in out:
        out["formula"] = "(z - latents_mean) * scaling_factor / latents_std"
    else:
        out["formula"] = "z * scaling_factor"
    return out


@dataclass(frozen=True)
class Family:
    """What vaecache knows about one diffusers VAE class."""

    name: str
    rule: Callable[[dict[str, Any]], FrameRule]
    channels_key: str
    normalization: Callable[[dict[str, Any], torch.nn.Module | None], dict[str, Any]]
    per_frame: bool = False
    fp16: str = "ok"
    """"ok"; "upcast": compute in fp32 when config.force_upcast is set; "refuse"."""
    fp16_reason: str = ""


FAMILIES: dict[str, Family] = {
    family.name: family for family in (
        Family("AutoencoderKLWan", _wan_rule, "z_dim", _wan_normalization),
        Family("AutoencoderKLHunyuanVideo", _hunyuan_rule, "latent_channels", _scale_normalization),
        Family("AutoencoderKLCogVideoX", _cogvideox_rule, "latent_channels", _scale_normalization, fp16="upcast",
               fp16_reason="CogVideoX models other than 2B were trained in bf16 and give NaNs in fp16 "
                           "(zai-org/CogVideo#559, #637); its config sets force_upcast"),
        Family("AutoencoderKLLTXVideo", _ltx_rule, "latent_channels", _ltx_normalization, fp16="refuse",
               fp16_reason="LTX-Video's VAE gives corrupted output in fp16 (Lightricks/LTX-Video#126); "
                           "use --dtype bf16 (the dtype it was trained in) or fp32"),
        Family("AutoencoderKL", _image_rule, "latent_channels", _scale_normalization, per_frame=True, fp16="upcast",
               fp16_reason="the SD/SDXL VAEs overflow in fp16, and diffusers' pipelines run them in fp32 when "
                           "config.force_upcast is set"),
    )
}
SUPPORTED = ", ".join(FAMILIES)


def _clean_config(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps({k: v for k, v in dict(config).items() if not k.startswith("_")}, default=str))


def _tile_params(module: torch.nn.Module) -> dict[str, Any]:
    """The module's tiling knobs (tile sizes, strides, overlaps, framewise encoding): they change latents."""
    keep = ("use_framewise_encoding", "num_sample_frames_batch_size")
    params = {k: v for k, v in vars(module).items()
              if (k.startswith("tile_") or k in keep) and isinstance(v, (bool, int, float, str, list, tuple))}
    return json.loads(json.dumps(params, sort_keys=True))


# --------------------------------------------------------------------------- loading


def load_vae(spec: str, device: torch.device | str = "cpu", dtype: str = "fp32", *, tiling: bool = False,
             max_views_per_forward: int = 1, tile_options: dict[str, Any] | None = None) -> LoadedVae:
    """Resolve a --vae SPEC (builtin:tiny, diffusers:PATH[#subfolder], python:module:function) and get it ready.

    `tile_options` go to the module's enable_tiling() (e.g. tile_sample_min_height); they are recorded
    in the fingerprint whether or not tiling ends up used.
    """
    if not spec:
        raise VaeSpecError("--vae is required (builtin:tiny, diffusers:PATH or python:module:function)")
    if dtype not in TORCH_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    if isinstance(max_views_per_forward, bool) or not isinstance(max_views_per_forward, int) or max_views_per_forward < 1:
        raise UsageError(f"--max-views-per-forward must be an integer >= 1, got {max_views_per_forward!r}")
    kind, _, rest = spec.partition(":")
    if kind == "builtin":
        vae = _load_builtin(rest, spec)
    elif kind == "diffusers":
        vae = _load_diffusers(rest, spec)
    elif kind == "python":
        vae = _load_python(rest, spec)
    else:
        raise VaeSpecError(f"unknown VAE spec {spec!r}: use builtin:tiny, diffusers:PATH or python:module:function")
    vae.device = torch.device(device)
    vae.dtype = TORCH_DTYPES[dtype]
    vae.compute_dtype, vae.dtype_note = _compute_dtype(vae, dtype)
    vae.max_views_per_forward = max_views_per_forward
    vae.module.to(vae.device).eval().requires_grad_(False)
    if vae.compute_dtype != torch.float32:  # weights load as fp32; casting to fp32 again only makes diffusers warn
        vae.module.to(vae.compute_dtype)
    _setup_tiling(vae, tiling, tile_options or {})
    injection = os.environ.get(INJECT_OOM_ENV, "").strip()
    if injection:
        vae._oom_injector = OomInjector.parse(injection)
        log.warning("%s=%s: out-of-memory errors will be injected (testing only)", INJECT_OOM_ENV, injection)
    return vae


def _compute_dtype(vae: LoadedVae, dtype: str) -> tuple[torch.dtype, str | None]:
    """The dtype the module runs in: refuse or upcast fp16 where a family is known to misbehave."""
    requested = TORCH_DTYPES[dtype]
    family = FAMILIES.get(vae.family)
    if requested != torch.float16 or family is None or family.fp16 == "ok":
        return requested, None
    if family.fp16 == "refuse":
        raise UsageError(f"--dtype fp16 is refused for {vae.family}: {family.fp16_reason}")
    if vae.config.get("force_upcast", True):
        note = (f"--dtype fp16: {vae.family} runs in fp32 and its latents are stored as fp16, "
                f"because {family.fp16_reason}")
        log.warning(note)
        return torch.float32, note
    return requested, None


def _setup_tiling(vae: LoadedVae, tiling: bool, options: dict[str, Any]) -> None:
    module = vae.module
    if (tiling or options) and not vae.can_tile:
        raise UsageError(f"--tiling: {vae.spec} ({vae.family}) has no enable_tiling()/disable_tiling()")
    if vae.can_tile:
        try:
            module.enable_tiling(**options)
        except TypeError:  # AutoencoderKL's enable_tiling() takes no sizes: set the attributes it reads
            module.enable_tiling()
            unknown = [k for k in options if not hasattr(module, k)]
            if unknown:
                raise UsageError(f"tile options {unknown} are not known to {vae.family}") from None
            for key, value in options.items():
                setattr(module, key, value)
            if "tile_sample_min_size" in options and hasattr(module, "tile_latent_min_size"):
                module.tile_latent_min_size = int(options["tile_sample_min_size"] / vae.rule.spatial_factor)
        if not tiling:
            module.disable_tiling()
        vae.tile_params = _tile_params(module) or dict(options)
    vae.tiling = tiling


def _family_loaded(module: torch.nn.Module, family: Family, spec: str, untrained: bool = False) -> LoadedVae:
    config = _clean_config(module.config)
    return LoadedVae(module, spec, family.name, family.rule(config), int(config.get(family.channels_key) or 0), config,
                     weights_sha256(module), untrained=untrained, normalization=family.normalization(config, module),
                     per_frame=family.per_frame)


def _load_builtin(name: str, spec: str) -> LoadedVae:
    if name != "tiny":
        raise VaeSpecError(f"unknown builtin VAE {name!r} in {spec!r}: the only builtin is builtin:tiny")
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_TINY_SEED)
        module = AutoencoderKLWan(**BUILTIN_TINY_CONFIG)
    return _family_loaded(module, FAMILIES["AutoencoderKLWan"], spec, untrained=True)


def _load_diffusers(location: str, spec: str) -> LoadedVae:
    path_text, _, subfolder = location.partition("#")
    if not path_text:
        raise VaeSpecError(f"{spec!r}: expected diffusers:PATH[#subfolder]")
    path = Path(path_text).expanduser()
    if subfolder:
        path = path / subfolder
    config_file = path / "config.json"
    if not path.is_dir():
        raise VaeSpecError(f"{path}: diffusers VAE folder not found")
    if not config_file.is_file():
        hint = " (a pipeline folder? add #vae)" if (path / "vae" / "config.json").is_file() else ""
        raise VaeSpecError(f"{path}: no config.json (not a diffusers-format model folder){hint}")
    try:
        family_name = json.loads(config_file.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        raise VaeSpecError(f"{config_file}: not valid JSON") from None
    if family_name not in FAMILIES:
        raise VaeSpecError(f"{config_file}: VAE class {family_name!r} is not supported; supported: {SUPPORTED} "
                           "(anything else: --vae python:module:function)")
    import diffusers

    try:
        module = getattr(diffusers, family_name).from_pretrained(str(path), torch_dtype=torch.float32, low_cpu_mem_usage=False)
    except Exception as exc:  # diffusers raises many types for broken folders
        raise VaeSpecError(f"{path}: could not load {family_name} ({_first_line(exc)[:200]})") from None
    return _family_loaded(module, FAMILIES[family_name], spec)


def _load_python(target: str, spec: str) -> LoadedVae:
    module_name, _, function_name = target.rpartition(":")
    if not module_name or not function_name:
        raise VaeSpecError(f"{spec!r}: expected python:module.path:function")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except ImportError as exc:
        raise VaeSpecError(f"{spec!r}: cannot import {module_name} ({exc})") from None
    except AttributeError:
        raise VaeSpecError(f"{spec!r}: {module_name} has no attribute {function_name}") from None
    module = factory()
    if not isinstance(module, torch.nn.Module) or not callable(getattr(module, "encode", None)):
        raise VaeSpecError(f"{spec!r}: factory must return a torch.nn.Module with an encode(x) method, got {type(module).__name__}")
    temporal = int(getattr(module, "vaecache_temporal_factor", 1))
    spatial = int(getattr(module, "vaecache_spatial_factor", 1))
    if temporal < 1 or spatial < 1:
        raise VaeSpecError(f"{spec!r}: vaecache_temporal_factor and vaecache_spatial_factor must be >= 1")
    rule = FrameRule(temporal, spatial, causal=bool(getattr(module, "vaecache_causal", temporal > 1)),
                     label=type(module).__qualname__)
    config = getattr(module, "config", None)
    config = _clean_config(config) if isinstance(config, dict) else {}
    config["factory"] = target
    channels = int(getattr(module, "vaecache_latent_channels", 0))
    return LoadedVae(module, spec, type(module).__qualname__, rule, channels, config, weights_sha256(module),
                     has_logvar=bool(getattr(module, "vaecache_has_logvar", True)))


__all__ = [
    "DTYPE_LABELS", "FAMILIES", "INJECT_OOM_ENV", "EncodeResult", "Family", "FrameRule", "LoadedVae", "OomInjector",
    "TORCH_DTYPES", "load_vae", "weights_sha256",
]
