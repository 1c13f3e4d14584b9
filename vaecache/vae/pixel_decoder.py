"""A differentiable decoder for pixel-space losses on cached latents, in bounded memory.

A trainer that predicts latents and wants a loss on pixels needs the gradient to flow back through the frozen VAE
decoder. Under autograd every decoder activation is kept for the backward pass, so the decode, not the model, runs
out of memory; chunking alone does not help (every chunk's activations are kept just the same). Gradient
checkpointing per resolution level fixes this for a 2D image VAE. ``PixelDecoder`` does it for vaecache's
families:

* **Wan 2.1 / 2.2** (causal in time): the decoder runs one latent frame per call, exactly as diffusers'
  ``AutoencoderKLWan._decode`` does, with the causal feature cache (each causal convolution's last input frames)
  carried from frame to frame. With ``checkpoint=True`` each decoder stage (``conv_in``, the mid block, each up
  block, the head) over ``chunk_frames`` latent frames is a non-reentrant checkpoint whose inputs are the frames'
  stage inputs and the cache entries at its start, and whose outputs are its outputs and the entries at its end.
  The backward recomputes a stage from exactly the cache its frames saw, so the gradient path through the cache to
  earlier frames is kept, not cut; only the stage inputs, the cache at region boundaries (two frames per causal
  convolution) and the output frames stay in memory. Decoded untiled.
* **2D image VAEs** (``AutoencoderKL``, per frame): each frame decoded alone, checkpointed per stage (``conv_in``,
  mid block, each up block, head) over ``chunk_frames`` frames, the per-level checkpointing above.
* **Other families** (HunyuanVideo, LTX-Video, CogVideoX): decoded whole by ``module.decode``; ``checkpoint=True``
  turns on the module's own diffusers gradient checkpointing where its class supports it, and leaves it on (a
  backward must recompute through the same code path as the forward).

Output: ``(B, 3, T, H, W)`` in the decoder's range ([-1, 1], clamped as diffusers clamps Wan's output), the same
values ``module.decode(z).sample`` gives. The VAE's parameters stay frozen (``requires_grad`` off); ``z`` is the raw
latent the decoder takes: a diffusion model's prediction goes through ``LatentCache.denormalize`` first. The targets
of a pixel loss come from ``LatentCache.source_frames(clip)``: the clip's frames as encode saw them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from vaecache.errors import UsageError
from vaecache.vae.latent_decode import decoded_sample, decoder_conv_count, decodes_causal_chunks, wan_finish

WAN_CACHE_FRAMES = 2
"""diffusers' CACHE_T: the input frames a causal convolution keeps for the next call."""

Stage = Callable[[torch.Tensor, list[Any], bool], torch.Tensor]
"""(input, the stage's cache entries (updated in place), first frame?) -> output."""


class PixelDecoder(torch.nn.Module):
    """``decoder(z)`` -> frames ``(B, 3, T, H, W)``, differentiable with respect to ``z``; the VAE stays frozen.

    ``vae``: a diffusers VAE module, a ``--vae`` spec (``builtin:small``, ``diffusers:FOLDER``, a checkpoint file),
    a ``VaeRunner``, or use ``PixelDecoder.from_cache(OUT)`` for the VAE a cache records (fingerprint-checked, as
    ``verify --reencode``). ``chunk_frames``: latent frames in one checkpoint region of a stage (Wan: the causal cache
    is kept for the backward only at region boundaries; 1 keeps the least memory, measured) and per region of a 2D
    image VAE; other families decode whole. ``checkpoint``: gradient checkpointing per decoder stage (see the module
    docstring). ``dtype``: the compute dtype (default: the VAE's); ``z`` is cast to it. The VAE is a submodule
    (``.to()`` moves it; its parameters are frozen, so an optimizer gives them no step).
    """

    def __init__(self, vae: Any, *, chunk_frames: int = 1, checkpoint: bool = True, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, allow_pickle_weights: bool = False) -> None:
        super().__init__()
        if chunk_frames < 1:
            raise UsageError(f"chunk_frames must be >= 1, got {chunk_frames}")
        module, per_frame = _resolve(vae, device, allow_pickle_weights)
        if dtype is not None:
            module.to(dtype)
        module.eval().requires_grad_(False)
        self.vae = module
        self.per_frame = per_frame
        self.chunk_frames = chunk_frames
        self.checkpoint = checkpoint
        self.mode = "causal-frames" if decodes_causal_chunks(module) else "per-frame" if per_frame else "whole"
        if self.mode == "whole" and checkpoint and getattr(module, "_supports_gradient_checkpointing", False):
            # The module's own checkpointing, left on: a backward recomputes through the same code path.
            module.enable_gradient_checkpointing()

    @classmethod
    def from_cache(cls, out: str | Path, *, vae: str | None = None, device: str | torch.device = "cpu",
                   allow_pickle_weights: bool = False, storage_options: dict[str, Any] | None = None,
                   **options: Any) -> PixelDecoder:
        """The VAE recorded in cache ``out`` (a folder or a URL; or ``vae``, which must match the recorded
        fingerprint), loaded with the recorded dtype; ``options`` are the constructor's (chunk_frames, checkpoint)."""
        from vaecache.cache.reader import CacheReader
        from vaecache.distributed.context import resolve_device
        from vaecache.vae.recorded import load_recorded_vae, recorded_spec

        cache = CacheReader(out, storage_options)
        spec = recorded_spec(cache.manifest, vae, cache.store.where("manifest.json"))
        runner = load_recorded_vae(cache.out, cache.manifest, spec, resolve_device(str(device)),
                                   allow_pickle_weights=allow_pickle_weights)
        return cls(runner, **options)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() != 5:
            raise UsageError(f"PixelDecoder takes latents (batch, channels, frames, height, width), got "
                             f"{tuple(z.shape)}")
        z = z.to(self.device, self.dtype)
        if self.mode == "causal-frames":
            return self._wan(z)
        if self.mode == "per-frame":
            return self._per_frame(z)
        return self._whole(z)

    # ------------------------------------------------------------------ stages

    def _run(self, stage: Stage, inputs: list[torch.Tensor], cache: list[Any],
             first: int) -> tuple[list[torch.Tensor], list[Any]]:
        """One stage over consecutive frames (frame index `first` onwards), its cache carried from frame to frame;
        checkpointed (non-reentrant) when asked and gradients are on. The region's inputs are the frames' inputs and
        the cache entries at its start, its outputs the frames' outputs and the entries at its end: a recompute sees
        the cache of its own frames, and only the cache at region boundaries is kept for the backward."""

        def call(entries: tuple[Any, ...], start: int, *xs: torch.Tensor) -> tuple[tuple[torch.Tensor, ...],
                                                                                   tuple[Any, ...]]:
            local = list(entries)
            return tuple(stage(x, local, start + i == 0) for i, x in enumerate(xs)), tuple(local)

        if self.checkpoint and torch.is_grad_enabled():
            outs, entries = _checkpoint(call, tuple(cache), first, *inputs, use_reentrant=False)
        else:
            outs, entries = call(tuple(cache), first, *inputs)
        return list(outs), list(entries)

    def _wan(self, z: torch.Tensor) -> torch.Tensor:
        module = self.vae
        decoder = module.decoder
        stages: list[tuple[Stage, int]] = [(_wan_causal_conv(decoder.conv_in), 1),
                                          (_wan_mid(decoder.mid_block), _conv_slots(decoder.mid_block))]
        stages += [(_wan_up(block), _conv_slots(block)) for block in decoder.up_blocks]
        stages.append((_wan_head(decoder), 1))
        if sum(slots for _, slots in stages) != decoder_conv_count(module):
            raise UsageError(f"{type(module).__name__}: its decoder has causal convolutions outside the stages "
                             "PixelDecoder knows (conv_in, mid_block, up_blocks, conv_out)")
        x = module.post_quant_conv(z)  # a 1x1x1 convolution over the whole latent, as diffusers' _decode applies it
        frames = [x[:, :, t:t + 1] for t in range(x.shape[2])]
        # Stage by stage over every frame (a frame's stage needs only the previous stage of the same frame and its
        # own cache from the frame before): the same operations on the same inputs as diffusers' frame-by-frame
        # loop, in another order.
        for stage, slots in stages:
            cache: list[Any] = [None] * slots
            outputs: list[torch.Tensor] = []
            for start in range(0, len(frames), self.chunk_frames):
                done, cache = self._run(stage, frames[start:start + self.chunk_frames], cache, start)
                outputs.extend(done)
            frames = outputs
        return wan_finish(module, torch.cat(frames, 2))

    def _per_frame(self, z: torch.Tensor) -> torch.Tensor:
        module = self.vae
        decoder = getattr(module, "decoder", None)
        staged = (decoder is not None and not getattr(module, "use_tiling", False)
                  and all(hasattr(decoder, name) for name in ("conv_in", "mid_block", "up_blocks", "conv_out")))
        if staged:
            stages = _image_stages(decoder)
            frames = [z[:, :, t] for t in range(z.shape[2])]
            if getattr(module, "post_quant_conv", None) is not None:
                frames = [module.post_quant_conv(frame) for frame in frames]
        else:
            stages = [lambda x, _cache, _first: decoded_sample(module.decode(x))]
            frames = [z[:, :, t] for t in range(z.shape[2])]
        for stage in stages:
            outputs: list[torch.Tensor] = []
            for start in range(0, len(frames), self.chunk_frames):
                outputs.extend(self._run(stage, frames[start:start + self.chunk_frames], [], start)[0])
            frames = outputs
        return torch.stack(frames, dim=2)

    def _whole(self, z: torch.Tensor) -> torch.Tensor:
        return decoded_sample(self.vae.decode(z))


# ---------------------------------------------------------------------- Wan stages (diffusers' WanDecoder3d.forward)


def _wan_causal_conv(conv: torch.nn.Module) -> Stage:
    def stage(x: torch.Tensor, cache: list[Any], first: bool) -> torch.Tensor:
        return _cached_conv(conv, x, cache)

    return stage


def _cached_conv(conv: torch.nn.Module, x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
    """WanDecoder3d's conv_in / conv_out with the cache: the last frames of the input (joined to the previous one's
    last frame when the input is one frame) are kept for the next call."""
    cache_x = x[:, :, -WAN_CACHE_FRAMES:].clone()
    if cache_x.shape[2] < 2 and cache[0] is not None:
        cache_x = torch.cat([cache[0][:, :, -1].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    out = conv(x, cache[0])
    cache[0] = cache_x
    return out


def _wan_mid(block: torch.nn.Module) -> Stage:
    def stage(x: torch.Tensor, cache: list[Any], first: bool) -> torch.Tensor:
        return block(x, feat_cache=cache, feat_idx=[0])

    return stage


def _wan_up(block: torch.nn.Module) -> Stage:
    def stage(x: torch.Tensor, cache: list[Any], first: bool) -> torch.Tensor:
        return block(x, feat_cache=cache, feat_idx=[0], first_chunk=first)

    return stage


def _wan_head(decoder: torch.nn.Module) -> Stage:
    def stage(x: torch.Tensor, cache: list[Any], first: bool) -> torch.Tensor:
        return _cached_conv(decoder.conv_out, decoder.nonlinearity(decoder.norm_out(x)), cache)

    return stage


def _conv_slots(module: torch.nn.Module) -> int:
    """Cache entries a Wan block may use: one per causal convolution in it (its 1x1 shortcuts take none; a spare
    entry stays None)."""
    return sum(type(m).__name__ == "WanCausalConv3d" for m in module.modules())


# ---------------------------------------------------------------------- 2D stages (diffusers' vae.Decoder.forward)


def _image_stages(decoder: torch.nn.Module) -> list[Stage]:
    def conv_in(x: torch.Tensor, _cache: list[Any], _first: bool) -> torch.Tensor:
        return decoder.conv_in(x)

    def mid(x: torch.Tensor, _cache: list[Any], _first: bool) -> torch.Tensor:
        return decoder.mid_block(x, None)

    def up(block: torch.nn.Module) -> Stage:
        return lambda x, _cache, _first: block(x, None)

    def head(x: torch.Tensor, _cache: list[Any], _first: bool) -> torch.Tensor:
        return decoder.conv_out(decoder.conv_act(decoder.conv_norm_out(x)))

    return [conv_in, mid, *(up(block) for block in decoder.up_blocks), head]


# ---------------------------------------------------------------------- resolving the VAE


def _resolve(vae: Any, device: str | torch.device | None, allow_pickle_weights: bool) -> tuple[torch.nn.Module, bool]:
    """(the module, decoded per frame?) from a module, a --vae spec or a VaeRunner."""
    from vaecache.vae import VaeRunner, load_vae

    if isinstance(vae, (str, Path)):
        vae = load_vae(str(vae), device or "cpu", allow_pickle_weights=allow_pickle_weights)
    if isinstance(vae, VaeRunner):
        return vae.model.module, vae.model.per_frame
    if isinstance(vae, torch.nn.Module):
        if device is not None:
            vae.to(device)
        from vaecache.models import vae_class

        declared = vae_class(type(vae).__name__)
        per_frame = declared is not None and declared.per_frame  # a 2D image VAE: one frame per forward
        if not callable(getattr(vae, "decode", None)):
            raise UsageError(f"{type(vae).__name__} has no decode(z) method")
        return vae, per_frame
    raise UsageError(f"PixelDecoder needs a VAE module, a --vae spec or a VaeRunner, got {type(vae).__name__}")


__all__ = ["PixelDecoder"]
