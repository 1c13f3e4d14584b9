"""Spatial-parallel VAE encode: one view's frames cut into horizontal bands across a group.

Every rank of the group runs the unchanged diffusers encoder on its band of rows. The layers that look
past a band's edge are swapped, for the duration of the call, for versions that fetch what they need
from the neighbouring ranks:

* every causal 3D convolution with a spatial kernel (3x3): ``p`` halo rows from each neighbour
  (``isend``/``irecv`` batched); the first and last rank use zero rows, which is exactly the zero
  padding the unsplit model applies there, so the result matches;
* the strided downsample (``ZeroPad2d((0, 1, 0, 1))`` then a 3x3 stride-2 conv): the one row below the
  band from the next rank (zeros on the last rank, as the model's bottom padding). Band edges lie on
  multiples of the spatial factor, so every band starts on an even row at every level and the stride
  grid of each band is the unsplit grid;
* the mid-block attention (one head over every position of a frame): each rank gathers the keys and
  values of the whole frame and computes only its own queries;
* RMS norms, 1x1 convs, the residual average-pool shortcut of Wan 2.2 and the temporal convs are local
  (their kernel is still the whole frame's, as for every convolution).

The causal temporal cache stays per band (each layer caches its own band's last frames; a halo is always
exchanged after the cache frames are joined, so neighbours exchange the same frames).

Receive buffers are allocated in the input's memory format (channels_last_3d,
channels_last or contiguous) and reused across calls; a rank with no neighbour on a side makes no send
copy for it; a send slice is made contiguous in the receiving buffer's memory format.

Every convolution of the encoder runs, on CPU, with the kernel PyTorch picks for the whole frame rather
than the one it would pick for the shorter band (:class:`UnsplitKernels`): with that, the published Wan 2.1
config gives bitwise the unsplit latents at G = 2, 3, 4, divisible or not. What can still differ is the
mid-block attention on CPU, whose kernel blocks the queries by their count: with tiny models, the last bit
of a few values (measured up to 5.3e-7 of the latent's scale). On CUDA, cuDNN picks its algorithms by shape
for band and frame alike; whether that gives the same bits over NCCL needs two GPUs (unmeasured). Figures in
docs/parallel.md (Spatial-parallel encode) and docs/gpu.md (one rank's band memory on an H200).

Library use, beside :func:`vaecache.parallel.sp_encode`::

    import torch, torch.distributed as dist
    from vaecache.parallel.spatial import spatial_encode

    # every rank of `group` holds the same (B, 3, T, H, W) clip and the same Wan VAE
    with torch.no_grad():
        moments = spatial_encode(vae, x, group)   # (B, 2*z_dim, t, H/8, W/8) on every rank
        mean, logvar = moments.chunk(2, dim=1)    # equal to vae.encode(x).latent_dist.mean/logvar
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from vaecache.distributed.context import collective_errors
from vaecache.errors import DistributedError, UsageError
from vaecache.models import VaeClass, registry


def banded_classes() -> list[VaeClass]:
    """The VAE classes whose family declares `spatial_bands`: their encoders this module runs band by band."""
    return [vae for vae in registry().vae_classes.values() if vae.spatial_bands]


def check_banded(class_name: str, where: str) -> None:
    """A UsageError unless --sp-mode spatial runs this VAE class's encoder."""
    supported = banded_classes()
    if class_name not in {vae.name for vae in supported}:
        raise UsageError(f"--sp-mode spatial supports {', '.join(vae.name for vae in supported)}; {where} is "
                         f"{class_name} (use --sp-mode views)")


# --------------------------------------------------------------------------- bands (pure)


@dataclass(frozen=True)
class BandPlan:
    """How the rows of one view are cut over a group: band r is latent rows [start(r), stop(r))."""

    latent_height: int
    group_size: int
    spatial_factor: int

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.spatial_factor < 1:
            raise UsageError(f"BandPlan needs group_size and spatial_factor >= 1, got {self.group_size}, "
                             f"{self.spatial_factor}")
        if self.latent_height < self.group_size:
            raise UsageError(f"--sp-mode spatial: a latent height of {self.latent_height} rows cannot be cut into "
                             f"{self.group_size} bands (one latent row per rank at least); use a smaller --sp-size")

    def latent_rows(self, rank: int) -> tuple[int, int]:
        """[start, stop) latent rows of band `rank`: sizes differ by at most one, larger bands first."""
        base, extra = divmod(self.latent_height, self.group_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    def pixel_rows(self, rank: int) -> tuple[int, int]:
        start, stop = self.latent_rows(rank)
        return start * self.spatial_factor, stop * self.spatial_factor


def plan_bands(height: int, spatial_factor: int, group_size: int) -> BandPlan:
    """Pure: the bands of a view `height` pixels tall; `height` must be a multiple of the spatial factor."""
    if height % spatial_factor:
        raise UsageError(f"height {height} is not a multiple of the spatial factor {spatial_factor}")
    return BandPlan(height // spatial_factor, group_size, spatial_factor)


# --------------------------------------------------------------------------- halo exchange


def halo_memory_format(reference: Tensor) -> torch.memory_format:
    """The memory format to allocate a buffer like `reference` in: channels_last_3d, channels_last or contiguous, as
    `reference` is laid out."""
    if reference.dim() == 5 and reference.is_contiguous(memory_format=torch.channels_last_3d) \
            and not reference.is_contiguous():
        return torch.channels_last_3d
    if reference.dim() == 4 and reference.is_contiguous(memory_format=torch.channels_last) \
            and not reference.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


class HaloExchanger:
    """Exchanges rows along dim -2 with the previous and next rank of a group; keeps its buffers."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else tdist.get_world_size(group)
        self.rank = 0 if group is None else tdist.get_rank(group)
        self.ranks = list(range(self.size)) if group is None else tdist.get_process_group_ranks(group)
        self._buffers: dict[tuple[str, str], Tensor] = {}
        self.exchanges = 0

    def _buffer(self, key: tuple[str, str], shape: torch.Size, like: Tensor,
                memory_format: torch.memory_format) -> Tensor:
        buffer = self._buffers.get(key)
        if (buffer is None or buffer.shape != shape or buffer.dtype != like.dtype or buffer.device != like.device
                or not buffer.is_contiguous(memory_format=memory_format)):
            buffer = torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=memory_format)
            self._buffers[key] = buffer
        return buffer

    def extend(self, x: Tensor, above: int, below: int, layer: str) -> Tensor:
        """`x` with `above` rows of the previous rank's band on top and `below` rows of the next rank's
        band underneath; zero rows where there is no such rank (the unsplit model's zero padding)."""
        memory_format = halo_memory_format(x)
        has_prev, has_next = self.rank > 0, self.rank < self.size - 1
        recv_top = self._buffer((layer, "top"), x[..., :above, :].shape, x, memory_format) if above else None
        recv_bottom = self._buffer((layer, "bottom"), x[..., :below, :].shape, x, memory_format) if below else None
        ops = []
        # Slices are taken lazily: a side with no neighbour costs no send copy.
        if has_prev:
            if above:
                ops.append(tdist.P2POp(tdist.irecv, recv_top, self.ranks[self.rank - 1], self.group))
            if below:  # the previous rank needs my first `below` rows
                send = x[..., :below, :].contiguous(memory_format=memory_format)
                ops.append(tdist.P2POp(tdist.isend, send, self.ranks[self.rank - 1], self.group))
        if has_next:
            if above:  # the next rank needs my last `above` rows
                send = x[..., x.shape[-2] - above:, :].contiguous(memory_format=memory_format)
                ops.append(tdist.P2POp(tdist.isend, send, self.ranks[self.rank + 1], self.group))
            if below:
                ops.append(tdist.P2POp(tdist.irecv, recv_bottom, self.ranks[self.rank + 1], self.group))
        if ops:
            with collective_errors(f"halo exchange ({layer})", self.group):
                for request in tdist.batch_isend_irecv(ops):
                    request.wait()
            self.exchanges += 1
        parts = []
        if recv_top is not None:
            if not has_prev:
                recv_top.zero_()
            parts.append(recv_top)
        parts.append(x)
        if recv_bottom is not None:
            if not has_next:
                recv_bottom.zero_()
            parts.append(recv_bottom)
        return torch.cat(parts, dim=-2) if len(parts) > 1 else x

    def gather_rows(self, x: Tensor, rows: list[int], layer: str) -> Tensor:
        """Concatenate every rank's `x` along dim -2 (rank r holds rows[r] rows; padded for the gather)."""
        if self.size == 1:
            return x
        tallest = max(rows)
        pad = tallest - x.shape[-2]
        local = F.pad(x, (0, 0, 0, pad)) if pad else x
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        with collective_errors(f"all_gather ({layer})", self.group):
            tdist.all_gather(parts, local, group=self.group)
        return torch.cat([part[..., :count, :] for part, count in zip(parts, rows)], dim=-2)


# --------------------------------------------------------------------------- the unsplit frame's kernels


class UnsplitKernels:
    """Runs a band's convolutions with the kernel PyTorch would pick for the whole frame.

    On CPU, PyTorch chooses a convolution's implementation by the input's size: a 3x3x3 conv over a batch of
    one runs in oneDNN when batch x channels x frames x height exceeds 20480 and in its native im2col + GEMM
    otherwise (and a 1x1 conv depends on the thread count too). A band is shorter than the frame, so without
    this a band of a Wan 2.1 frame at 128x128 ran native where the whole frame ran oneDNN: 3.4e-6 of the
    latent's scale apart. With the same kernel a band's rows are bitwise the whole frame's (oneDNN's direct
    convolution and the native GEMM sum each output in an order that does not depend on the height; only
    bands of one or two rows of a tiny model have shown a last-bit difference in the native GEMM).

    A conv's output rows scale with the level it runs at exactly as the band does: a band of `b` latent rows
    out of `h` has `o * h / b` output rows in the whole frame where it has `o`. On CUDA the choice is
    cuDNN's for both and is left alone."""

    def __init__(self, band_latent_rows: int, latent_height: int) -> None:
        self.band_latent_rows, self.latent_height = band_latent_rows, latent_height
        self._forced: dict[tuple, object] = {}
        """Band input key -> the whole frame's backend where it differs from the band's own, else None."""

    def whole_input_shape(self, x: Tensor, out_rows: int, stride: int) -> list[int]:
        whole_out, rest = divmod(out_rows * self.latent_height, self.band_latent_rows)
        if rest:
            raise DistributedError(f"a band convolution gave {out_rows} rows, not a multiple of the band's "
                                   f"{self.band_latent_rows} latent rows")
        return [*x.shape[:-2], x.shape[-2] + (whole_out - out_rows) * stride, x.shape[-1]]

    def _forced_backend(self, conv: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> object:
        memory_format = halo_memory_format(x)
        key = (tuple(x.shape), x.dtype, memory_format, tuple(weight.shape), conv.stride, conv.padding, conv.dilation,
               conv.groups, bias is not None, torch.get_num_threads())
        if key not in self._forced:
            kernel_rows = weight.shape[-2]
            out_rows = (x.shape[-2] + 2 * conv.padding[-2] - conv.dilation[-2] * (kernel_rows - 1) - 1) \
                // conv.stride[-2] + 1
            args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0] * len(conv.stride),
                    conv.groups, None)
            # Never written: a large empty tensor is address space, not memory.
            like = torch.empty(self.whole_input_shape(x, out_rows, conv.stride[-2]), dtype=x.dtype,
                               memory_format=memory_format)
            whole = torch._C._select_conv_backend(like, weight, bias, *args)
            self._forced[key] = None if whole == torch._C._select_conv_backend(x, weight, bias, *args) else whole
        return self._forced[key]

    def conv(self, conv: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None, default) -> Tensor:
        if (x.device.type != "cpu" or conv.padding_mode != "zeros" or isinstance(conv.padding, str)
                or not hasattr(torch._C, "_select_conv_backend")):  # private: a later torch may not have it
            return default(x, weight, bias)
        whole = self._forced_backend(conv, x, weight, bias)
        backends = torch._C._ConvBackend
        kernel = list(weight.shape[2:])
        if whole == backends.Mkldnn:
            return torch.mkldnn_convolution(x.contiguous(memory_format=halo_memory_format(x)), weight, bias,
                                            list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups)
        if whole == backends.Slow3d:
            return torch._C._nn.slow_conv3d(x.contiguous(), weight, kernel, bias, list(conv.stride), list(conv.padding))
        if whole == backends.Slow2d:
            return torch._C._nn.thnn_conv2d(x.contiguous(), weight, kernel, bias, list(conv.stride), list(conv.padding))
        return default(x, weight, bias)  # the band's own kernel is the frame's (or one this cannot call directly)


def _unsplit_conv_forward(kernels: UnsplitKernels, conv: nn.Module):
    default = type(conv)._conv_forward.__get__(conv)

    def _conv_forward(self: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return kernels.conv(self, x, weight, bias, default)

    return _conv_forward


# --------------------------------------------------------------------------- layer replacements


def _causal_conv_forward(exchanger: HaloExchanger, name: str):
    def forward(self: nn.Module, x: Tensor, cache_x: Tensor | None = None) -> Tensor:
        padding = list(self._padding)
        if cache_x is not None and self._padding[4] > 0:
            cache_x = cache_x.to(x.device)
            x = torch.cat([cache_x, x], dim=2)
            padding[4] -= cache_x.shape[2]
        rows = padding[2]
        x = exchanger.extend(x, rows, rows, name)
        padding[2] = padding[3] = 0
        x = F.pad(x, padding)
        return nn.Conv3d.forward(self, x)

    return forward


def _downsample_forward(exchanger: HaloExchanger, name: str):
    def forward(self: nn.Sequential, x: Tensor) -> Tensor:
        pad, conv = self[0], self[1]
        left, right, top, bottom = pad.padding
        x = F.pad(x, (left, right, 0, 0))
        x = exchanger.extend(x, top, bottom, name)
        return conv(x)

    return forward


def _attention_forward(exchanger: HaloExchanger, name: str, rows_per_rank: list[int]):
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        identity = x
        batch, channels, time, height, width = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, height, width)
        x = self.norm(x)
        qkv = self.to_qkv(x)
        # The unsplit block lays out (bt, 1, h*w, 3c) tokens and chunks q, k, v out of them; keys and values
        # of the whole frame are gathered, queries stay local.
        local = qkv.reshape(batch * time, 1, channels * 3, -1).permute(0, 1, 3, 2).contiguous()
        q = local.chunk(3, dim=-1)[0]
        kv = exchanger.gather_rows(qkv[:, channels:], rows_per_rank, f"{name}.keys_values")
        kv = kv.reshape(batch * time, 1, channels * 2, -1).permute(0, 1, 3, 2).contiguous()
        k, v = kv.chunk(2, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).permute(0, 2, 1).reshape(batch * time, channels, height, width)
        x = self.proj(x)
        x = x.view(batch, time, channels, height, width).permute(0, 2, 1, 3, 4)
        return x + identity

    return forward


def _encoder_levels(module: nn.Module) -> int:
    return sum(1 for m in module.encoder.modules() if type(m).__name__ == "WanResample"
               and getattr(m, "mode", "").startswith("downsample"))


@contextmanager
def banded(module: nn.Module, exchanger: HaloExchanger, plan: BandPlan) -> Iterator[UnsplitKernels]:
    """Swap the encoder's boundary-crossing layers for halo-exchanging ones, and run every convolution with the
    whole frame's kernel (UnsplitKernels), while the block runs."""
    check_banded(type(module).__name__, "the module")
    if getattr(module, "use_tiling", False):
        raise UsageError("--sp-mode spatial cannot be combined with --tiling")
    patched: list[nn.Module] = []
    # rows per rank at the mid-block (the deepest level) are the latent rows of each band
    mid_rows = [plan.latent_rows(r)[1] - plan.latent_rows(r)[0] for r in range(plan.group_size)]
    patch = int(getattr(module.config, "patch_size", None) or 1)
    encoder_factor = plan.spatial_factor // patch
    levels = _encoder_levels(module)
    if 2 ** levels != encoder_factor:
        raise UsageError(f"{type(module).__name__}: {levels} spatial downsamples do not give the spatial factor "
                         f"{plan.spatial_factor}; this configuration is not supported in spatial mode")
    start, stop = plan.latent_rows(exchanger.rank)
    kernels = UnsplitKernels(stop - start, plan.latent_height)
    convs: list[nn.Module] = []
    try:
        quant = getattr(module, "quant_conv", None)  # runs on the band's latent rows after the encoder
        for layer in [*module.encoder.modules(), *(quant.modules() if isinstance(quant, nn.Module) else ())]:
            if isinstance(layer, (nn.Conv2d, nn.Conv3d)):
                layer._conv_forward = types.MethodType(_unsplit_conv_forward(kernels, layer), layer)
                convs.append(layer)
        for name, layer in module.encoder.named_modules():
            kind = type(layer).__name__
            if kind == "WanCausalConv3d" and layer._padding[2] > 0:
                layer.forward = types.MethodType(_causal_conv_forward(exchanger, name), layer)
            elif kind == "WanResample" and layer.mode.startswith("downsample"):
                layer.resample.forward = types.MethodType(_downsample_forward(exchanger, name), layer.resample)
                patched.append(layer.resample)
                continue
            elif kind == "WanAttentionBlock":
                layer.forward = types.MethodType(_attention_forward(exchanger, name, mid_rows), layer)
            else:
                continue
            patched.append(layer)
        yield kernels
    finally:
        for layer in patched:
            layer.__dict__.pop("forward", None)
        for layer in convs:
            layer.__dict__.pop("_conv_forward", None)


def spatial_encode(module: nn.Module, x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``cat([mean, logvar], 1)`` of ``module.encode(x).latent_dist``, shape ``(B, 2*z, t, H/f, W/f)``, computed by
    the ranks of ``group`` together, each encoding a horizontal band of every frame; the full result on every rank.

    ``module`` is a diffusers AutoencoderKLWan (2.1 or 2.2 layout) in eval mode, the same on every
    rank, and ``x`` the same on every rank. ``group`` None or of size 1 runs ``module`` unsplit."""
    if x.dim() != 5:
        raise UsageError(f"spatial_encode needs (batch, channels, frames, height, width), got {tuple(x.shape)}")
    exchanger = HaloExchanger(group)
    spatial_factor = int(getattr(module, "spatial_compression_ratio", 0) or 0)
    if not spatial_factor:
        raise UsageError(f"{type(module).__name__} does not state its spatial compression ratio")
    plan = plan_bands(x.shape[-2], spatial_factor, exchanger.size)
    if exchanger.size == 1:
        posterior = module.encode(x).latent_dist
        return torch.cat([posterior.mean, posterior.logvar], dim=1)
    start, stop = plan.pixel_rows(exchanger.rank)
    with banded(module, exchanger, plan):
        posterior = module.encode(x[..., start:stop, :]).latent_dist
    local = torch.cat([posterior.mean, posterior.logvar], dim=1)
    rows = [plan.latent_rows(r)[1] - plan.latent_rows(r)[0] for r in range(plan.group_size)]
    if local.shape[-2] != rows[exchanger.rank]:
        raise DistributedError(f"rank {exchanger.ranks[exchanger.rank]}: band encoded to {local.shape[-2]} latent "
                               f"rows, expected {rows[exchanger.rank]}")
    return exchanger.gather_rows(local, rows, "latent bands")


__all__ = ["BandPlan", "HaloExchanger", "UnsplitKernels", "banded", "banded_classes", "check_banded",
           "halo_memory_format", "plan_bands", "spatial_encode"]
