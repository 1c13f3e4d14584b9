"""A faster encode for diffusers' `AutoencoderKLWan` (Wan 2.1, Wan 2.2): the module's own weights, the same
arithmetic up to rounding, fewer bytes moved.

diffusers' `_encode` runs the encoder over the clip as frame 0, then chunks of 4 frames, and every causal
convolution concatenates the last 2 frames of its previous input in front of the chunk (`torch.cat`, a copy of
the whole chunk) and pads it (`F.pad`, a second copy), in NCDHW memory order. This encoder walks the same modules
(autoencoder_kl_wan.py of diffusers 0.42: `WanEncoder3d.forward`, `WanResidualBlock`, `WanResample`,
`WanResidualDownBlock`, `AvgDown3D`) with:

* channels_last_3d (NDHWC) activations end to end, where cuDNN's convolutions run fastest on tensor cores;
* a causal convolution's input written once: the RMS norm + SiLU writes straight into a buffer whose first frames
  are the carried ones (copied in, 2 frames), the spatial padding done by the convolution itself;
* the RMS norm and the SiLU in one pass in fp32 (compiled with torch.compile where asked: one kernel);
* temporal chunks of `chunk_frames` input frames (a multiple of 4; the default is diffusers' 4, so that the peak
  memory stays the reference's; larger chunks are a choice within a memory budget). A causal convolution over
  more frames computes the same values: what a chunk boundary changes is only which frames are carried.

What stays the same: every weight, the frame rule (frames beyond 1 + 4k are dropped, as diffusers does), frame 0
alone through each temporal downsample (its first-chunk rule), zero frames before frame 0. What differs: rounding.
The reference rounds the normalized activation to the compute dtype before scaling it; this one does not (one
rounding fewer, so in bf16 it is at least as close to an fp32 encode), and the convolution algorithms cuDNN picks
for other memory formats and shapes sum in another order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

CHANNELS_LAST_3D = torch.channels_last_3d
TEMPORAL_FACTOR = 4
"""Wan's encoders halve the frame count twice: a chunk after frame 0 must hold a multiple of 4 frames."""


def norm_silu_eager(x: torch.Tensor, pre_bias: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = silu(normalize(x + pre_bias, dim=1) * weight + bias), computed in fp32, written into `out` (any
    strides). `pre_bias` is the bias of the convolution that produced x where the kernels fold it."""
    xf = x.float()
    if pre_bias is not None:
        xf = xf + pre_bias
    y = F.normalize(xf, dim=1).mul_(weight)
    if bias is not None:
        y.add_(bias)
    out.copy_(F.silu(y, inplace=True))


def add_eager(y: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y += h (+ bias): the residual sum into its first operand."""
    y.add_(h)
    return y if bias is None else y.add_(bias.to(y.dtype))


NormSilu = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, "torch.Tensor | None", torch.Tensor], None]
Add = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class Kernels:
    """The pointwise work between convolutions. With `fold_bias`, the convolutions of a residual block run
    without their bias and the kernel that next reads the output adds it (the norm, or the residual sum): one
    pass over the activation fewer per convolution, one rounding fewer."""

    name: str
    norm_silu: NormSilu
    add: Add
    fold_bias: bool = False
    rows: bool = False
    """Works on NDHWC activations as (positions, channels) rows: channels_last only."""


EAGER = Kernels("eager", norm_silu_eager, add_eager)


def _norm_silu_rows(x: torch.Tensor, pre_bias: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None, out: torch.Tensor) -> None:
    xf = x.float()
    if pre_bias is not None:
        xf = xf + pre_bias
    y = F.normalize(xf, dim=1) * weight
    if bias is not None:
        y = y + bias
    out.copy_(F.silu(y))


def _add_rows(y: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None) -> None:
    total = y.float() + h.float()
    if bias is not None:
        total = total + bias
    y.copy_(total)


COMPILE_OPTIONS = {"batch_invariant": True, "deterministic": True}
"""Inductor's modes in which a reduction's configuration (block sizes, warps: the order of its sums) does not
depend on the number of rows it was first compiled for, nor on on-device benchmarking (where this torch has
them: compile_options)."""


def compile_options() -> dict[str, bool]:
    """COMPILE_OPTIONS this torch's inductor knows (batch_invariant is newer than deterministic). Without
    batch_invariant a persistent reduction's configuration still does not depend on the row count above
    ROW_INVARIANT_ROWS rows; CompiledRowKernels runs smaller activations eagerly then."""
    import torch._inductor.config as inductor

    return {key: value for key, value in COMPILE_OPTIONS.items() if hasattr(inductor, key)}

RECOMPILE_LIMIT = 64
"""One graph per (channels, dtype, bias present): more than dynamo's default cache of 8 for one function."""


class CompiledRowKernels:
    """The norm + SiLU and the residual sum as torch.compile'd kernels over rows: an NDHWC view is a (frames x
    height x width, channels) matrix per view, compiled once per channel count with the row count dynamic, so
    that which kernel a shape gets depends neither on the shapes compiled before it in the process nor on a
    benchmark (COMPILE_OPTIONS)."""

    def __init__(self) -> None:
        self.options = compile_options()
        self.row_invariant = bool(self.options.get("batch_invariant"))
        """Inductor's batch_invariant mode is there: a reduction's configuration does not depend on the row count
        for any count; without it only above ROW_INVARIANT_ROWS, and smaller activations run the eager kernels (the
        same arithmetic up to rounding, and the same in every process)."""
        self._norm = torch.compile(_norm_silu_rows, fullgraph=True, options=self.options)
        self._add = torch.compile(_add_rows, fullgraph=True, options=self.options)

    def kernels(self) -> Kernels:
        return Kernels("inductor-rows", self.norm_silu, self.add, fold_bias=True, rows=True)

    def norm_silu(self, x: torch.Tensor, pre_bias: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None, out: torch.Tensor) -> None:
        if _few_rows(x) and not self.row_invariant:
            norm_silu_eager(x, pre_bias, weight, bias, out)
            return
        weight, pre_bias, bias = _flat(weight), _flat(pre_bias), _flat(bias)
        with _recompile_limit():
            for view in range(x.shape[0]):
                self._norm(_rows(x[view]), pre_bias, weight, bias, _rows(out[view], writable=True))

    def add(self, y: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _few_rows(y) and not self.row_invariant:
            return add_eager(y, h, bias)
        bias = _flat(bias)
        with _recompile_limit():
            for view in range(y.shape[0]):
                self._add(_rows(y[view], writable=True), _rows(h[view]), bias)
        return y


ROW_INVARIANT_ROWS = 4096
"""torch/_inductor/runtime/triton_heuristics.py, _persistent_reduction_configs: above this many rows the
candidate configurations do not depend on the row count."""


def _few_rows(x: torch.Tensor) -> bool:
    return x[0].numel() // x.shape[1] <= ROW_INVARIANT_ROWS


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    flat = t.reshape(-1)
    torch._dynamo.mark_static(flat, 0)
    return flat


def _rows(view: torch.Tensor, writable: bool = False) -> torch.Tensor:
    """(C, T, H, W) in channels-last order as a row-major (T * H * W, C) matrix, the row count marked dynamic.

    The matrix is a new tensor over the same storage, not a view: dynamo guards a view on its base's sizes and
    strides, which differ from chunk to chunk and would compile a graph for each."""
    channels = view.shape[0]
    moved = view.permute(1, 2, 3, 0)
    if not writable:
        moved = moved.contiguous()
    elif not moved.is_contiguous():
        raise ValueError(f"WanFastEncoder: a row kernel writes into a {tuple(view.shape)} view that is not "
                         "channels-last")
    rows = moved.numel() // channels
    matrix = torch.empty((0,), dtype=view.dtype, device=view.device).set_(
        moved.untyped_storage(), moved.storage_offset(), (rows, channels), (channels, 1))
    if rows > 1:  # one row is specialized (dynamo's 0/1 rule): its own graph, the same in every process
        torch._dynamo.mark_dynamic(matrix, 0)
    torch._dynamo.mark_static(matrix, 1)
    return matrix


def _recompile_limit() -> Any:
    import torch._dynamo

    # past the limit dynamo would run the function eagerly (other rounding, silently): fail instead. Older torch
    # names these cache_size_limit, accumulated_cache_size_limit, fail_on_cache_limit_hit.
    config = torch._dynamo.config
    wanted = {("recompile_limit", "cache_size_limit"): RECOMPILE_LIMIT,
              ("accumulated_recompile_limit", "accumulated_cache_size_limit"): 4096,
              ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"): True}
    patch = {next(name for name in names if hasattr(config, name)): value for names, value in wanted.items()
             if any(hasattr(config, name) for name in names)}
    return config.patch(**patch)


class WanFastEncoder:
    """`moments(x)` is `AutoencoderKLWan._encode(x)` (the mean and log-variance, before the posterior) computed
    faster. Holds the module (never modified) and its weights rearranged once per device and dtype."""

    def __init__(self, vae: Any, *, chunk_frames: int = TEMPORAL_FACTOR, kernels: Kernels = EAGER,
                 channels_last: bool = True, pad_channels: dict[int, int] | None = None) -> None:
        if chunk_frames < TEMPORAL_FACTOR or chunk_frames % TEMPORAL_FACTOR:
            raise ValueError(f"chunk_frames must be a positive multiple of {TEMPORAL_FACTOR}, got {chunk_frames}")
        temporal = sum(getattr(m, "mode", None) == "downsample3d" for m in vae.encoder.modules())
        if temporal > 2:
            raise ValueError(f"WanFastEncoder: {temporal} temporal downsamples; diffusers' 4-frame chunks allow 2")
        self.vae = vae
        self.encoder = vae.encoder
        self.chunk_frames = chunk_frames
        if kernels.rows and not channels_last:
            raise ValueError(f"WanFastEncoder: the {kernels.name} kernels need channels_last activations")
        self.kernels = kernels
        self.memory_format = CHANNELS_LAST_3D if channels_last else torch.contiguous_format
        self.pad_channels = {c: p for c, p in (pad_channels or {}).items() if p > c}
        """{channels: padded channels}: every activation of that width carries zero channels up to the padded
        width, every convolution reading or writing it has zero filters to match (cuDNN's heuristics pick a slow
        kernel for some channel counts, 96 on Hopper). Zeros stay zeros: a zero filter without bias gives 0, the
        RMS norm's sum of squares is unchanged by them and its zero-padded scale keeps them 0."""
        attention = {m.dim for m in vae.encoder.modules() if type(m).__name__ == "WanAttentionBlock"}
        if attention & set(self.pad_channels):
            raise ValueError(f"WanFastEncoder: the attention block's {sorted(attention)} channels cannot be padded")
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._norms: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._key: tuple[Any, ...] | None = None

    @property
    def description(self) -> str:
        """What decides this encoder's bits beyond the weights (recorded with --encoder-impl fast)."""
        widths = {m.out_channels for m in self.encoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))}
        pads = ",".join(f"{c}to{p}" for c, p in sorted(self.pad_channels.items()) if c in widths)
        layout = "ndhwc" if self.memory_format == CHANNELS_LAST_3D else "ncdhw"
        return f"{layout}-chunk{self.chunk_frames}-{self.kernels.name}" + (f"-pad{pads}" if pads else "")

    # ------------------------------------------------------------------ public

    def moments(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 2 * z_dim, 1 + (T - 1) // 4, H / s, W / s): what diffusers' `_encode` returns for `x` (B, C, T, H, W)."""
        self._prepare(x)
        frames = 1 + (x.shape[2] - 1) // TEMPORAL_FACTOR * TEMPORAL_FACTOR
        x = x[:, :, :frames]
        patch = self.vae.config.patch_size
        if patch is not None and patch != 1:
            from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

            x = patchify(x, patch_size=patch)
        states: dict[int, torch.Tensor] = {}
        outs = []
        for start, stop in chunk_bounds(frames, self.chunk_frames):
            outs.append(self._encoder(x[:, :, start:stop].contiguous(memory_format=self.memory_format), states))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        enc = self._conv(self.vae.quant_conv, out)
        return enc[:, :self.vae.quant_conv.out_channels].contiguous()

    def posterior(self, x: torch.Tensor) -> Any:
        """diffusers' DiagonalGaussianDistribution of the moments, as `AutoencoderKLWan.encode` returns it."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        return DiagonalGaussianDistribution(self.moments(x))

    # ------------------------------------------------------------------ weights

    def _width(self, channels: int) -> int:
        return self.pad_channels.get(channels, channels)

    def _prepare(self, x: torch.Tensor) -> None:
        """Rearrange every convolution weight once for the module's current device and dtype (a 2-d convolution's
        weight gets a time axis of 1, so that it runs on NDHWC activations without a permute; padded channels
        get zero filters)."""
        param = next(self.encoder.parameters())
        key = (param.device, param.dtype, self.memory_format, id(self.vae))
        if key == self._key:
            return
        self._weights.clear()
        self._norms.clear()
        modules = list(self.encoder.modules()) + [self.vae.quant_conv]
        for module in modules:
            if isinstance(module, (torch.nn.Conv3d, torch.nn.Conv2d)):
                weight = module.weight if isinstance(module, torch.nn.Conv3d) else module.weight.unsqueeze(2)
                out_c, in_c = weight.shape[:2]
                weight = F.pad(weight, (0, 0, 0, 0, 0, 0, 0, self._width(in_c) - in_c, 0, self._width(out_c) - out_c))
                bias = module.bias
                if bias is not None:
                    bias = F.pad(bias, (0, self._width(out_c) - out_c))
                self._weights[id(module)] = (weight.contiguous(memory_format=self.memory_format), bias)
            elif type(module).__name__ == "WanRMS_norm":
                channels = module.gamma.shape[0]
                weight = F.pad((module.gamma.float() * module.scale).reshape(-1), (0, self._width(channels) - channels))
                extra = self._width(channels) - channels
                bias = module.bias
                bias = F.pad(bias.float().reshape(-1), (0, extra)).reshape(1, -1, 1, 1, 1) \
                    if isinstance(bias, torch.Tensor) else None
                self._norms[id(module)] = (weight.reshape(1, -1, 1, 1, 1), bias)
        self._key = key

    # ------------------------------------------------------------------ layers

    def _conv(self, conv: torch.nn.Module, x: torch.Tensor, stride: tuple[int, int, int] = (1, 1, 1),
              padding: tuple[int, int, int] = (0, 0, 0), *, with_bias: bool = True) -> torch.Tensor:
        weight, bias = self._weights[id(conv)]
        out = F.conv3d(x, weight, bias if with_bias else None, stride, padding)
        # (some CPU convolutions answer in NCDHW for NDHWC input; on CUDA this returns `out` itself)
        return out.contiguous(memory_format=self.memory_format)

    def _bias(self, conv: torch.nn.Module) -> torch.Tensor | None:
        """The bias a folded convolution leaves to the next kernel, in fp32."""
        bias = self._weights[id(conv)][1]
        return None if bias is None else bias.float().reshape(1, -1, 1, 1, 1)

    def _causal(self, conv: torch.nn.Module, x: torch.Tensor, states: dict[int, torch.Tensor],
                norm: torch.nn.Module | None = None, pre_bias: torch.Tensor | None = None, *,
                with_bias: bool = True) -> torch.Tensor:
        """A `WanCausalConv3d` over this chunk: its input (silu(norm(x + pre_bias)) where `norm` is given) written
        once into a buffer after the frames carried from the previous chunk (zeros before frame 0)."""
        carry = conv._padding[4]
        spatial = (0, conv._padding[2], conv._padding[0])
        if carry == 0:
            if norm is not None:
                buf = torch.empty_like(x, memory_format=self.memory_format)
                self._activate(norm, x, pre_bias, buf)
                x = buf
            return self._conv(conv, x, conv.stride, spatial, with_bias=with_bias)
        b, c, t, h, w = x.shape
        buf = torch.empty((b, c, carry + t, h, w), dtype=x.dtype, device=x.device, memory_format=self.memory_format)
        previous = states.get(id(conv))
        if previous is None:
            buf[:, :, :carry].zero_()
        else:
            buf[:, :, :carry].copy_(previous)
        if norm is None:
            buf[:, :, carry:].copy_(x)
        else:
            self._activate(norm, x, pre_bias, buf[:, :, carry:])
        states[id(conv)] = buf[:, :, -carry:].clone(memory_format=self.memory_format)
        return self._conv(conv, buf, conv.stride, spatial, with_bias=with_bias)

    def _activate(self, norm: torch.nn.Module, x: torch.Tensor, pre_bias: torch.Tensor | None,
                  out: torch.Tensor) -> None:
        weight, bias = self._norms[id(norm)]
        self.kernels.norm_silu(x, pre_bias, weight, bias, out)

    def _residual(self, block: torch.nn.Module, x: torch.Tensor, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """`WanResidualBlock`: shortcut, norm1 + SiLU, conv1, norm2 + SiLU, (dropout: identity in eval), conv2, sum.
        With folded biases conv1's goes into norm2, conv2's and the shortcut's into the sum."""
        fold = self.kernels.fold_bias
        shortcut = block.conv_shortcut
        has_shortcut = not isinstance(shortcut, torch.nn.Identity)
        h = self._conv(shortcut, x, with_bias=not fold) if has_shortcut else x
        y = self._causal(block.conv1, x, states, block.norm1, with_bias=not fold)
        y = self._causal(block.conv2, y, states, block.norm2, self._bias(block.conv1) if fold else None,
                         with_bias=not fold)
        if not fold:
            return self.kernels.add(y, h, None)
        bias = self._bias(block.conv2)
        if has_shortcut and (extra := self._bias(shortcut)) is not None:
            bias = extra if bias is None else bias + extra
        return self.kernels.add(y, h, bias)

    def _resample(self, block: torch.nn.Module, x: torch.Tensor, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """`WanResample` down: zero-pad right and bottom, 3x3 stride-2 convolution per frame; for `downsample3d`
        then the (3, 1, 1) stride-2 time convolution over [last frame before, chunk], frame 0 passed alone."""
        if block.mode not in ("downsample2d", "downsample3d"):
            raise ValueError(f"WanFastEncoder: resample mode {block.mode!r} is not an encoder's")
        x = F.pad(x, (0, 1, 0, 1)).contiguous(memory_format=self.memory_format)
        x = self._conv(block.resample[1], x, stride=(1, 2, 2))
        if block.mode == "downsample2d":
            return x
        parts = []
        previous = states.get(id(block))
        if previous is None:
            parts.append(x[:, :, :1])
            previous, rest = x[:, :, :1], x[:, :, 1:]
        else:
            rest = x
        if rest.shape[2]:
            b, c, t, h, w = rest.shape
            buf = torch.empty((b, c, 1 + t, h, w), dtype=x.dtype, device=x.device, memory_format=self.memory_format)
            buf[:, :, :1].copy_(previous)
            buf[:, :, 1:].copy_(rest)
            parts.append(self._conv(block.time_conv, buf, stride=block.time_conv.stride))
        states[id(block)] = x[:, :, -1:].clone(memory_format=self.memory_format)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _avg_down(self, pool: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`AvgDown3D` (Wan 2.2's shortcut) in any memory format: zero frames in front to a multiple of factor_t,
        then the mean of each group of factor channels (over the true channels; the result padded as its width
        is)."""
        x = x[:, :pool.in_channels]
        ft, fs = pool.factor_t, pool.factor_s
        pad_t = (ft - x.shape[2] % ft) % ft
        if pad_t:
            x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        x = x.reshape(b, pool.out_channels, pool.group_size, t // ft, h // fs, w // fs).mean(dim=2)
        extra = self._width(pool.out_channels) - pool.out_channels
        if extra:
            x = F.pad(x, (0, 0, 0, 0, 0, 0, 0, extra))
        return x.contiguous(memory_format=self.memory_format)

    def _layer(self, layer: torch.nn.Module, x: torch.Tensor, states: dict[int, torch.Tensor]) -> torch.Tensor:
        kind = type(layer).__name__
        if kind == "WanResidualBlock":
            return self._residual(layer, x, states)
        if kind == "WanResample":
            return self._resample(layer, x, states)
        if kind == "WanAttentionBlock":
            return layer(x.contiguous()).contiguous(memory_format=self.memory_format)
        if kind == "WanResidualDownBlock":
            shortcut = self._avg_down(layer.avg_shortcut, x)
            for resnet in layer.resnets:
                x = self._residual(resnet, x, states)
            if layer.downsampler is not None:
                x = self._resample(layer.downsampler, x, states)
            return self.kernels.add(x, shortcut, None)
        raise ValueError(f"WanFastEncoder: no fast path for encoder layer {kind}")

    def _encoder(self, x: torch.Tensor, states: dict[int, torch.Tensor]) -> torch.Tensor:
        enc = self.encoder
        x = self._causal(enc.conv_in, x, states)
        for layer in enc.down_blocks:
            x = self._layer(layer, x, states)
        mid = enc.mid_block
        x = self._residual(mid.resnets[0], x, states)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:]):
            if attn is not None:
                x = self._layer(attn, x, states)
            x = self._residual(resnet, x, states)
        return self._causal(enc.conv_out, x, states, enc.norm_out)


def chunk_bounds(frames: int, chunk_frames: int) -> list[tuple[int, int]]:
    """[start, stop) of each temporal chunk of a 1 + 4k frame clip: frame 0 with the first `chunk_frames`, then
    `chunk_frames` at a time (the last one shorter, still a multiple of 4)."""
    bounds = [(0, min(frames, 1 + chunk_frames))]
    while bounds[-1][1] < frames:
        start = bounds[-1][1]
        bounds.append((start, min(frames, start + chunk_frames)))
    return bounds


PADDED_CHANNELS = {96: 128}
"""Wan 2.1's 96-channel stage: on an H200 its 3x3x3 convolutions ran at 296 TFLOP/s with cuDNN's heuristic choice
and as 128 channels in and out in 0.74 of the time (docs/gpu.md)."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def production_variant(device: torch.device | str) -> tuple[bool, dict[int, int]]:
    """What --encoder-impl fast runs on `device`: (compiled row kernels, padded channels). On CUDA with Triton the
    pointwise work is compiled (inductor, COMPILE_OPTIONS) with the convolution biases folded into it and the
    96-channel stage padded to 128 (2.1x diffusers' encode on an H200, bitwise across processes); elsewhere the
    eager kernels, unpadded (compiling them for a CPU buys little and costs a compile per process)."""
    compiled = torch.device(device).type == "cuda" and triton_available()
    return compiled, dict(PADDED_CHANNELS) if compiled else {}


def production_encoder(vae: Any, device: torch.device | str) -> WanFastEncoder:
    compiled, pads = production_variant(device)
    kernels = CompiledRowKernels().kernels() if compiled else EAGER
    return WanFastEncoder(vae, kernels=kernels, pad_channels=_paddable(vae, pads))


def production_description(vae: Any, device: torch.device | str) -> str:
    """production_encoder(vae, device).description without compiling anything (recorded in the fingerprint)."""
    compiled, pads = production_variant(device)
    kernels = Kernels("inductor-rows", norm_silu_eager, add_eager, fold_bias=True, rows=True) if compiled else EAGER
    return WanFastEncoder(vae, kernels=kernels, pad_channels=_paddable(vae, pads)).description


def _paddable(vae: Any, pads: dict[int, int]) -> dict[int, int]:
    """`pads` without the widths an attention block sees (a custom config may put one there)."""
    attention = {m.dim for m in vae.encoder.modules() if type(m).__name__ == "WanAttentionBlock"}
    return {c: p for c, p in pads.items() if c not in attention}
