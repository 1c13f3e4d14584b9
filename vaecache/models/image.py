"""SD-style image VAEs (Stable Diffusion 1.x, SDXL, SD3, Flux): diffusers' AutoencoderKL applied to every frame,
untiled."""

from __future__ import annotations

from typing import Any, Mapping

from vaecache.models.base import Family, ReferenceEncode, SingleFileLayout, VaeClass, scale_normalization
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKL"


def frame_rule(config: Mapping[str, Any]) -> FrameRule:
    # Encoder (2D): every block but the last halves space. Frames are encoded one by one: any count.
    return FrameRule(1, 2 ** (len(config.get("block_out_channels", (64,))) - 1), label="AutoencoderKL")


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization, per_frame=True, fp16="upcast",
               fp16_reason="the SD/SDXL VAEs overflow in fp16, and diffusers' pipelines run them in fp32 when "
                           "config.force_upcast is set")
UNTILED = ReferenceEncode("untiled", "diffusers' encode with its tiling off",
                          'diffusers 0.42.1 autoencoder_kl.py _encode (use_tiling False)')

def ldm_vae_keys(keys: list[str]) -> list[str]:
    """The keys of an LDM checkpoint's VAE, as diffusers' convert_ldm_vae_checkpoint takes them: the last prefix of
    LDM_VAE_KEYS any key has, else none."""
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS

    prefix = next((p for p in reversed(LDM_VAE_KEYS) if any(key.startswith(p) for key in keys)), "")
    return [key for key in keys if key.startswith(prefix)]


SINGLE_FILES = (
    # the LDM/SD first-stage model (ldm/modules/diffusionmodules/model.py)
    SingleFileLayout(
        "an SD-style VAE",
        lambda found, keys, shapes: ("encoder.down.0.block.0.norm1.weight" in found
                                     and "decoder.up.0.block.0.norm1.weight" in found),
        VAE_CLASS, no_config="SD 1.x, SD 2.x and SDXL VAEs have the same shapes but other scaling factors, and a "
                             "latent scaled wrongly trains wrongly",
        vae_keys=ldm_vae_keys, leftovers=("loss.", "model_ema.")),
)
"""Its leftovers: the LDM autoencoder's training loss (LPIPS, its discriminator, logvar) and its LitEma copies
(`model_ema.decay`, `model_ema.num_updates` and the shadow weights: ldm's `instantiate_from_config` loading and
diffusers' `convert_ldm_vae_checkpoint` read the model's own weights)."""

FAMILY = Family("image", "SD-style image VAE", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,),
                single_files=SINGLE_FILES)

__all__ = ["FAMILY", "SINGLE_FILES", "UNTILED", "VAE", "VAE_CLASS", "frame_rule", "ldm_vae_keys"]
