"""vae/latent_decode.py on every family: Wan decodes in exact chunks, a 2D VAE one frame per forward, the rest whole."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.vae.tiny_vaes import RULES
from vaecache.vae import load_vae
from vaecache.vae.latent_decode import CHUNKED, PER_FRAME, WHOLE, decode_mode, iter_decoded

MODES = {"wan": CHUNKED, "kl": PER_FRAME, "hunyuan": WHOLE, "cogvideox": WHOLE, "ltx": WHOLE}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread (an earlier encode leaves torch at its budget; two spinning threads on a shared
    2-core runner made these small decodes several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", sorted(MODES))
def test_decoding_in_chunks_gives_the_decode_of_the_family(family: str, models: dict[str, Path],
                                                           views: torch.Tensor) -> None:
    vae = load_vae(f"diffusers:{models[family]}")
    frames = RULES[family][4]
    z = vae.encode_views(views[:1, :, :frames]).mean
    assert decode_mode(vae.model) == MODES[family]
    module = vae.model.module
    with torch.inference_mode():
        if family == "kl":  # a 2D VAE's latents are (c, t, h, w) like the video VAEs': frames decode alone
            whole = torch.stack([module.decode(z[:, :, t]).sample for t in range(z.shape[2])], dim=2)
        else:
            whole = module.decode(z).sample
    pieces = list(iter_decoded(vae.model, z, 2))
    if MODES[family] == WHOLE:
        assert len(pieces) == 1  # --chunk-frames does not apply
    else:
        assert len(pieces) == -(-z.shape[2] // 2)
    decoded = torch.cat(pieces, dim=2)
    assert decoded.shape[:2] == (1, 3) and decoded.shape[-2:] == views.shape[-2:]
    assert torch.equal(decoded, whole)
