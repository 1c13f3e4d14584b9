"""Every supported diffusers family from a tiny random config saved to disk: rule from the config,
normalization constants, and latents equal to the family's own encode.

Latents are compared with `torch.equal` against the family's own `vae.encode(x).latent_dist` on the
same decoded frames, one view per forward, in fp32: vaecache calls the same module on the same input,
so anything but bit equality would be a bug.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vae.tiny_vaes import FAMILY_CONFIGS, LTX_MEAN, LTX_STD, RULES, SIZE
from vaecache.errors import FrameRuleError, VaeSpecError
from vaecache.models import VAE_CLASSES
from vaecache.vae import VaeRunner, load_vae


def _load(models: dict[str, Path], key: str, **kwargs: Any) -> VaeRunner:
    return load_vae(f"diffusers:{models[key]}", **kwargs)


def _reference(vae: VaeRunner, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's own encode, one view per call (a 2D VAE: the view's frames as one batch)."""
    means, logvars = zip(*(_reference_together(vae, view[None]) for view in x))
    return torch.cat(means), torch.cat(logvars)


def _reference_together(vae: VaeRunner, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's own encode of all views of `x` in one call (a 2D VAE: all their frames in one batch)."""
    with torch.no_grad():
        if vae.model.per_frame:
            views, _, frames = x.shape[:3]
            dist = vae.model.module.encode(x.transpose(1, 2).flatten(0, 1)).latent_dist  # (views * frames, c, h, w)
            return tuple(t.unflatten(0, (views, frames)).transpose(1, 2) for t in (dist.mean, dist.logvar))
        dist = vae.model.module.encode(x).latent_dist
        return dist.mean, dist.logvar


@pytest.mark.parametrize("key", list(FAMILY_CONFIGS))
def test_family_loads_with_rule_from_config_and_encodes_like_diffusers(
        models: dict[str, Path], views: torch.Tensor, key: str) -> None:
    vae = _load(models, key)
    temporal, spatial, step, causal, frames, bad, nearest = RULES[key]
    assert vae.model.family == FAMILY_CONFIGS[key][0]
    rule = vae.model.rule
    assert (rule.temporal_factor, rule.spatial_factor, rule.step, rule.causal) == (temporal, spatial, step, causal)
    vae.model.rule.check(frames, SIZE, SIZE)
    if bad is not None:
        with pytest.raises(FrameRuleError, match=f"--num-frames {bad} .*{vae.model.family}.*nearest valid: {nearest}$"):
            vae.model.rule.check(bad, SIZE, SIZE)
    with pytest.raises(FrameRuleError, match=f"height {SIZE + 1} is not a multiple of {spatial}"):
        vae.model.rule.check(frames, SIZE + 1, SIZE)

    x = views[:, :, :frames]
    result = vae.encode_views(x)
    mean, logvar = _reference(vae, x)
    assert tuple(result.mean.shape) == (2, *vae.latent_shape(frames, SIZE, SIZE))
    assert torch.equal(result.mean, mean)
    assert result.logvar is not None and torch.equal(result.logvar, logvar)
    units = frames if vae.model.per_frame else 1  # a forward: one view (a 2D VAE: all its frames)
    assert (result.failed == {} and result.tiled == set() and result.backoffs == []
            and result.forward_sizes == [units] * 2)


@pytest.mark.parametrize("key", list(FAMILY_CONFIGS))
def test_encode_cli_stores_the_family_latents(models: dict[str, Path], data_root: Path, views: torch.Tensor,
                                              tmp_path: Path, run_cli: Any, cache_io: Any, key: str) -> None:
    """Through the CLI on real mp4 clips that need no resize: equal to the family's own encode of the clip's
    cameras in one forward (--views-per-forward all), fp32, exact."""
    frames = RULES[key][4]
    out = tmp_path / "cache"
    result = run_cli(["encode", data_root, "--out", out, "--vae", f"diffusers:{models[key]}", "--num-frames", frames,
                      "--size", f"{SIZE}x{SIZE}", "--max-clips-per-scene", "1", "--workers", "0", "--no-progress",
                      "--views-per-forward", "all"])
    assert result.exit_code == 0, result.output
    manifest = cache_io.manifest(out)
    assert manifest["vae"]["family"] == FAMILY_CONFIGS[key][0]
    if key == "hunyuan":
        assert manifest["vae"]["normalization"] == {"scaling_factor": 0.5, "formula": "z * scaling_factor"}
    (clip,) = cache_io.clips(out)
    tensors = cache_io.tensors(out)
    vae = _load(models, key)
    if VAE_CLASSES[vae.model.family].one_view_per_forward:  # --views-per-forward all comes to 1, as recorded
        assert manifest["settings"]["views_per_forward"] == 1
        mean, logvar = _reference(vae, views[:, :, :frames])
    else:
        mean, logvar = _reference_together(vae, views[:, :, :frames])
    assert torch.equal(tensors[clip["tensors"]["mean"]["name"]], mean)
    assert torch.equal(tensors[clip["tensors"]["logvar"]["name"]], logvar)


def test_per_frame_image_vae_takes_any_frame_count(models: dict[str, Path]) -> None:
    vae = _load(models, "kl")
    assert vae.model.per_frame and vae.latent_shape(5, SIZE, SIZE) == (4, 5, 16, 16)
    vae.model.rule.check(5, SIZE, SIZE)


def test_normalization_constants_per_family(models: dict[str, Path]) -> None:
    wan = _load(models, "wan").model.normalization
    assert wan["formula"] == "(z - latents_mean) / latents_std" and len(wan["latents_mean"]) == 16  # config defaults
    ltx = _load(models, "ltx").model.normalization
    assert (ltx["latents_mean"] == pytest.approx(LTX_MEAN.tolist())
            and ltx["latents_std"] == pytest.approx(LTX_STD.tolist()))
    assert ltx["scaling_factor"] == 1.0 and ltx["formula"] == "(z - latents_mean) * scaling_factor / latents_std"
    assert _load(models, "ltx2").model.normalization == ltx  # LTX-2's video VAE: the same per-channel constants
    assert _load(models, "cogvideox").model.normalization == {"scaling_factor": 0.7, "formula": "z * scaling_factor"}
    assert _load(models, "hunyuan").model.normalization == {"scaling_factor": 0.5, "formula": "z * scaling_factor"}
    assert _load(models, "hunyuan15").model.normalization == {"scaling_factor": 1.03682,
                                                              "formula": "z * scaling_factor"}
    assert _load(models, "kl").model.normalization == {"scaling_factor": 0.3, "shift_factor": 0.1,
                                                 "formula": "(z - shift_factor) * scaling_factor"}


def test_unsupported_class_lists_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLAllegro"}))
    supported = ", ".join(VAE_CLASSES)
    with pytest.raises(VaeSpecError, match="'AutoencoderKLAllegro' is not supported; supported: " + supported):
        load_vae(f"diffusers:{tmp_path}")


def test_a_family_that_encodes_one_view_per_forward_refuses_more_by_name(models: dict[str, Path], data_root: Path,
                                                                         tmp_path: Path, run_cli: Any) -> None:
    result = run_cli(["encode", data_root, "--out", tmp_path / "cache", "--vae", f"diffusers:{models['hunyuan15']}",
                      "--num-frames", "5", "--size", f"{SIZE}x{SIZE}", "--workers", "0", "--no-progress",
                      "--views-per-forward", "2"])
    assert result.exit_code == 2
    assert "--views-per-forward 2: AutoencoderKLHunyuanVideo15 encodes one view per forward" in result.output
    assert not (tmp_path / "cache" / "manifest.json").exists()



def test_a_hunyuan15_config_its_encoder_cannot_run_is_refused_by_name() -> None:
    from vaecache.errors import VaeSpecError

    with pytest.raises(VaeSpecError, match="last block's 16 channels cannot hold 2 x 32 latent channels"):
        VAE_CLASSES["AutoencoderKLHunyuanVideo15"].rule({"block_out_channels": (8, 8, 16), "latent_channels": 32,
                                                      "spatial_compression_ratio": 4, "temporal_compression_ratio": 2})
    rule = VAE_CLASSES["AutoencoderKLHunyuanVideo15"].rule({})  # the release's: 16x space, 4x time
    assert (rule.temporal_factor, rule.spatial_factor, rule.causal) == (4, 16, True)
