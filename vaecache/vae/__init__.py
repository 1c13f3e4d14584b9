"""VAE backends (builtin, diffusers, python plugin), their frame/pixel rules, fingerprints, and encoding.

``--vae`` takes one of:

* ``builtin:tiny``: an untrained tiny Wan VAE with fixed random weights, for demos and tests.
* ``builtin:small``: a small Wan VAE trained on demo-style synthetic footage
  (``scripts/train_builtin_vae.py``), its fp16 weights shipped in the package (``vae/weights/``).
* ``diffusers:PATH[#subfolder]``: a diffusers model folder; ``config.json``'s ``_class_name`` picks the
  VAE class, one a model family declares (``vaecache.models``, listed in docs/vaes.md; a 2D image VAE is applied to
  every frame, its latents laid out (c, t, h, w) like the video VAEs', with t equal to the number of frames).
  Frame and pixel rules come from the config, read as the family module says.
* ``python:module.path:factory``: anything else, following the protocol below.

Python plugin protocol
----------------------
``factory()`` is called with no arguments and returns a ``torch.nn.Module`` with ``encode(x)``:

* ``x`` is ``(B, 3, T, H, W)`` RGB in ``[-1, 1]``, on the module's device and dtype. B is at most
  ``--views-per-forward`` K (``auto``: every camera of a clip on CUDA, 1 on CPU); each row must be encoded
  independently of the others.
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
``load_vae`` returns a ``VaeRunner`` (runner.py) around a ``VaeModel`` (model.py: the module and what
identifies its latents; ``fingerprint()``). ``VaeRunner.encode_views`` runs K = ``views_per_forward``
consecutive views per forward (for the per-frame 2D family: all frames of K views), and a forward never
crosses a multiple of K, so the rows encoded together are fixed by K alone. Convolution kernels may pick
other algorithms for other batch sizes, so this is what makes stored latents independent of batch size,
SP size and world size for a given K (recorded; the pipeline's SP split moves whole groups of K). On
out-of-memory it halves the forward and retries, then retries one view with the model's own tiling, then
records the view as failed (its rows zero-filled so shapes stay uniform for
all_gather). Every step is logged on the "vaecache" logger and counted in ``VaeRunner.backoff_counts``;
``EncodeResult`` says which views were tiled, which failed, and the forward size that produced each.
A view whose latent holds a NaN or an inf (fp16/bf16 overflow) is failed too, with the counts and the
VAE named in its reason, and zero-filled: it is never stored.

Testing the backoff: set ``VAECACHE_FAULT=oom:COUNT[>K][:untiled]`` before loading (grammar in
vaecache/faults.py), or assign ``runner.inject_oom = callable(units_in_forward, tiled) -> bool`` (True
raises ``torch.cuda.OutOfMemoryError`` before that forward runs). No diffusers internals are patched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {"load_vae": "load", "VaeModel": "model", "fingerprint": "model", "weights_sha256": "model",
         "EncodeResult": "runner", "VaeRunner": "runner"}
"""Imported on first use (PEP 562), so that a light module of this package (single_file's key inspection, used to
check --vae before any dataset is probed) does not pull in torch and diffusers."""

if TYPE_CHECKING:
    from vaecache.vae.load import load_vae
    from vaecache.vae.model import VaeModel, fingerprint, weights_sha256
    from vaecache.vae.runner import EncodeResult, VaeRunner


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"vaecache.vae.{_HOME[name]}"), name)
    raise AttributeError(f"module 'vaecache.vae' has no attribute {name!r}")


__all__ = [
    "EncodeResult", "VaeModel", "VaeRunner",
    "fingerprint", "load_vae", "weights_sha256",
]
