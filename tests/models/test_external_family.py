"""A family from outside: an installed package whose `vaecache.families` entry point declares a family (and the VAE
class it owns) is found by the registry, and `vaecache encode --vae` uses it with no change under vaecache/."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import subprocess_env
from tests.models import family_checks

PLUGIN = '''
"""Stable Video Diffusion's image VAE (diffusers' AutoencoderKLTemporalDecoder) as a family vaecache does not ship:
its encoder is 2D, so frames are encoded one by one."""

from vaecache.models import Family, ReferenceEncode, VaeClass
from vaecache.models.base import scale_normalization
from vaecache.models.rules import FrameRule

VAE_CLASS = "AutoencoderKLTemporalDecoder"


def frame_rule(config):
    return FrameRule(1, 2 ** (len(config.get("block_out_channels", (64,))) - 1), label=VAE_CLASS)


VAE = VaeClass(VAE_CLASS, frame_rule, "latent_channels", scale_normalization, per_frame=True)
UNTILED = ReferenceEncode("untiled", "diffusers' encode", "diffusers 0.42.1 autoencoder_kl_temporal_decoder.py")
FAMILY = Family("acme-svd", "ACME SVD", (VAE_CLASS,), UNTILED, default_for=(VAE_CLASS,), vaes=(VAE,))
'''


def install_plugin(root: Path) -> Path:
    """The package as pip installs it: its module and a dist-info whose entry_points.txt declares the family."""
    root.mkdir(parents=True)
    (root / "acme_svd_family.py").write_text(textwrap.dedent(PLUGIN))
    dist = root / "acme_svd_family-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-svd-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vaecache.families]\nacme-svd = acme_svd_family:FAMILY\n")
    (dist / "RECORD").write_text("")
    return root


@pytest.mark.slow
def test_an_installed_family_is_encoded_with_no_change_under_vaecache(tmp_path: Path) -> None:
    from diffusers import AutoencoderKLTemporalDecoder

    torch.manual_seed(0)
    vae = tmp_path / "vae"
    AutoencoderKLTemporalDecoder(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                                 latent_channels=4, layers_per_block=1, scaling_factor=0.3).save_pretrained(vae)
    data = family_checks.write_data(tmp_path / "data", frames=3, size=16)
    site = install_plugin(tmp_path / "site")
    out = tmp_path / "cache"
    env = subprocess_env(PYTHONPATH=str(site))
    listed = subprocess.run([sys.executable, "-c", "import vaecache.models as m; print(list(m.FAMILIES))"],
                            capture_output=True, text=True, env=env, check=True).stdout
    assert "acme-svd" in listed
    run = subprocess.run([sys.executable, "-m", "vaecache", *family_checks.encode_args(data, out, vae, 3, 16)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["vae"]["family"], manifest["vae"]["model"]) == ("AutoencoderKLTemporalDecoder", "acme-svd")
    assert manifest["vae"]["normalization"] == {"scaling_factor": 0.3, "formula": "z * scaling_factor"}
    cache = family_checks.LatentCache(out)
    module = AutoencoderKLTemporalDecoder.from_pretrained(vae).eval().requires_grad_(False)
    for item in cache:
        frames = cache.source_frames(item.id)  # (1, 3, 3, 16, 16): encoded frame by frame
        with torch.no_grad():
            posterior = module.encode(frames[0].transpose(0, 1)).latent_dist
        assert torch.equal(item.mean[0], posterior.mean.transpose(0, 1))
    without = subprocess.run([sys.executable, "-m", "vaecache", *family_checks.encode_args(data, tmp_path / "other",
                                                                                          vae, 3, 16)],
                             capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert without.returncode == 2 and "'AutoencoderKLTemporalDecoder' is not supported" in without.stderr
