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

from typing import Any, Callable

import torch
import torch.nn.functional as F

CHANNELS_LAST_3D = torch.channels_last_3d
TEMPORAL_FACTOR = 4
"""Wan's encoders halve the frame count twice: a chunk after frame 0 must hold a multiple of 4 frames."""


def norm_silu_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = silu(normalize(x, dim=1) * weight + bias), computed in fp32, written into `out` (any strides)."""
    xf = x.float()
    y = F.normalize(xf, dim=1).mul_(weight)
    if bias is not None:
        y.add_(bias)
    out.copy_(F.silu(y, inplace=True))


NormSilu = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def _norm_silu_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    y = F.normalize(x.float(), dim=1) * weight
    if bias is not None:
        y = y + bias
    out.copy_(F.silu(y))


def _add_into(y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return y.add_(h)


def compiled_add(dynamic: bool = True) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return torch.compile(_add_into, dynamic=dynamic, fullgraph=True)


def compiled_norm_silu(dynamic: bool = True) -> NormSilu:
    """norm_silu_eager's arithmetic as one kernel (torch.compile). dynamic: one compile serves every chunk length
    and resolution of a layer width, but which kernel a shape gets depends on what was compiled before in the
    process; static: one kernel per shape and strides, whatever came before."""
    return torch.compile(_norm_silu_math, dynamic=dynamic, fullgraph=True)


class WanFastEncoder:
    """`moments(x)` is `AutoencoderKLWan._encode(x)` (the mean and log-variance, before the posterior) computed
    faster. Holds the module (never modified) and its weights rearranged once per device and dtype."""

    def __init__(self, vae: Any, *, chunk_frames: int = TEMPORAL_FACTOR, norm_silu: NormSilu | None = None,
                 channels_last: bool = True, pad_channels: dict[int, int] | None = None,
                 add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        if chunk_frames < TEMPORAL_FACTOR or chunk_frames % TEMPORAL_FACTOR:
            raise ValueError(f"chunk_frames must be a positive multiple of {TEMPORAL_FACTOR}, got {chunk_frames}")
        temporal = sum(getattr(m, "mode", None) == "downsample3d" for m in vae.encoder.modules())
        if temporal > 2:
            raise ValueError(f"WanFastEncoder: {temporal} temporal downsamples; diffusers' 4-frame chunks allow 2")
        self.vae = vae
        self.encoder = vae.encoder
        self.chunk_frames = chunk_frames
        self.norm_silu = norm_silu or norm_silu_eager
        self.memory_format = CHANNELS_LAST_3D if channels_last else torch.contiguous_format
        self.add = add or torch.Tensor.add_
        """The residual sum into its first operand (torch.compile'd where asked: one strided pointwise kernel)."""
        self.pad_channels = dict(pad_channels or {})
        """{out channels: padded out channels} of the 3x3x3 convolutions whose output is computed with zero filters
        appended (cuDNN's heuristics pick a slow kernel for some channel counts) and then sliced back."""
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._slices: dict[int, int] = {}
        self._norms: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._key: tuple[Any, ...] | None = None

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
        return enc.contiguous()

    def posterior(self, x: torch.Tensor) -> Any:
        """diffusers' DiagonalGaussianDistribution of the moments, as `AutoencoderKLWan.encode` returns it."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        return DiagonalGaussianDistribution(self.moments(x))

    # ------------------------------------------------------------------ weights

    def _prepare(self, x: torch.Tensor) -> None:
        """Rearrange every convolution weight once for the module's current device and dtype (a 2-d convolution's
        weight gets a time axis of 1, so that it runs on NDHWC activations without a permute)."""
        param = next(self.encoder.parameters())
        key = (param.device, param.dtype, self.memory_format, id(self.vae))
        if key == self._key:
            return
        self._weights.clear()
        self._norms.clear()
        self._slices.clear()
        modules = list(self.encoder.modules()) + [self.vae.quant_conv]
        for module in modules:
            if isinstance(module, torch.nn.Conv3d):
                weight, bias = module.weight, module.bias
                padded = self.pad_channels.get(module.out_channels)
                if padded and tuple(module.kernel_size) == (3, 3, 3):
                    weight = torch.cat([weight, weight.new_zeros((padded - weight.shape[0], *weight.shape[1:]))])
                    if bias is not None:
                        bias = torch.cat([bias, bias.new_zeros(padded - bias.shape[0])])
                    self._slices[id(module)] = module.out_channels
                self._weights[id(module)] = (weight.contiguous(memory_format=self.memory_format), bias)
            elif isinstance(module, torch.nn.Conv2d):
                weight = module.weight.unsqueeze(2).contiguous(memory_format=self.memory_format)
                self._weights[id(module)] = (weight, module.bias)
            elif type(module).__name__ == "WanRMS_norm":
                weight = (module.gamma.float() * module.scale).reshape(1, -1, 1, 1, 1)
                bias = module.bias
                bias = bias.float().reshape(1, -1, 1, 1, 1) if isinstance(bias, torch.Tensor) else None
                self._norms[id(module)] = (weight, bias)
        self._key = key

    # ------------------------------------------------------------------ layers

    def _conv(self, conv: torch.nn.Module, x: torch.Tensor, stride: tuple[int, int, int] = (1, 1, 1),
              padding: tuple[int, int, int] = (0, 0, 0)) -> torch.Tensor:
        weight, bias = self._weights[id(conv)]
        out = F.conv3d(x, weight, bias, stride, padding)
        keep = self._slices.get(id(conv))
        return out if keep is None else out[:, :keep]

    def _activate(self, norm: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        weight, bias = self._norms[id(norm)]
        self.norm_silu(x, weight, bias, out)

    def _causal(self, conv: torch.nn.Module, x: torch.Tensor, states: dict[int, torch.Tensor],
                norm: torch.nn.Module | None = None) -> torch.Tensor:
        """A `WanCausalConv3d` over this chunk: its input (silu(norm(x)) where `norm` is given) written once into a
        buffer after the frames carried from the previous chunk (zeros before frame 0)."""
        carry = conv._padding[4]
        spatial = (0, conv._padding[2], conv._padding[0])
        if carry == 0:
            if norm is not None:
                buf = torch.empty_like(x, memory_format=self.memory_format)
                self._activate(norm, x, buf)
                x = buf
            return self._conv(conv, x, conv.stride, spatial)
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
            self._activate(norm, x, buf[:, :, carry:])
        states[id(conv)] = buf[:, :, -carry:].clone(memory_format=self.memory_format)
        return self._conv(conv, buf, conv.stride, spatial)

    def _residual(self, block: torch.nn.Module, x: torch.Tensor, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """`WanResidualBlock`: shortcut, norm1 + SiLU, conv1, norm2 + SiLU, (dropout: identity in eval), conv2, sum."""
        shortcut = block.conv_shortcut
        h = x if isinstance(shortcut, torch.nn.Identity) else self._conv(shortcut, x)
        y = self._causal(block.conv1, x, states, block.norm1)
        y = self._causal(block.conv2, y, states, block.norm2)
        return self.add(y, h)

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
        then the mean of each group of factor channels."""
        ft, fs = pool.factor_t, pool.factor_s
        pad_t = (ft - x.shape[2] % ft) % ft
        if pad_t:
            x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        x = x.reshape(b, pool.out_channels, pool.group_size, t // ft, h // fs, w // fs)
        return x.mean(dim=2).contiguous(memory_format=self.memory_format)

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
            return self.add(x, shortcut)
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
