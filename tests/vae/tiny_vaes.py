"""Tiny random VAE configs, one per supported diffusers family, and a python-plugin module's source.

Shared by tests/vae.
"""

from __future__ import annotations

from typing import Any

import torch

SIZE = 32

# Tiny random configs, one per family (shapes chosen so that 32x32 clips need no resize).
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "wan": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                     temperal_downsample=[False, True])),
    "hunyuan": ("AutoencoderKLHunyuanVideo", dict(
        block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4, scaling_factor=0.5)),
    "hunyuan15": ("AutoencoderKLHunyuanVideo15", dict(
        block_out_channels=(8, 8, 16), layers_per_block=1, latent_channels=4, spatial_compression_ratio=4,
        temporal_compression_ratio=2, scaling_factor=1.03682)),
    "cogvideox": ("AutoencoderKLCogVideoX", dict(
        block_out_channels=(8, 8, 8), down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
        temporal_compression_ratio=4, scaling_factor=0.7)),
    "ltx": ("AutoencoderKLLTXVideo", dict(
        latent_channels=8, block_out_channels=(8, 16, 32, 64), down_block_types=("LTXVideo095DownBlock3D",) * 4,
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        spatio_temporal_scaling=(True, True, True, False), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, patch_size=2, patch_size_t=1)),
    "ltx2": ("AutoencoderKLLTX2Video", dict(
        latent_channels=8, block_out_channels=(8, 8, 16, 16), downsample_type=("spatial", "temporal",
                                                                              "spatiotemporal", "spatiotemporal"),
        spatio_temporal_scaling=(True, True, True, False), layers_per_block=(1, 1, 1, 1, 1),
        decoder_block_out_channels=(8, 16, 16), decoder_layers_per_block=(1, 1, 1, 1), patch_size=2)),
    "kl": ("AutoencoderKL", dict(
        block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4, sample_size=16,
        shift_factor=0.1, scaling_factor=0.3)),
}
# family -> (temporal factor, spatial factor, frame step, causal, frames to encode, a bad count, its nearest valid)
RULES = {
    "wan": (2, 4, 4, True, 5, 10, "9 and 13"),
    "hunyuan": (4, 4, 4, True, 9, 7, "5 and 9"),
    "hunyuan15": (2, 4, 2, True, 5, 4, "3 and 5"),
    "cogvideox": (4, 4, 8, True, 9, 13, "9 and 17"),
    "ltx": (4, 8, 4, True, 9, 12, "9 and 13"),
    "ltx2": (4, 8, 4, True, 9, 12, "9 and 13"),
    "kl": (1, 2, 1, False, 3, None, None),
}
LTX_MEAN = torch.linspace(-1, 1, 8)
LTX_STD = torch.linspace(0.5, 2, 8)

TILES = {"tile_sample_min_height": 16, "tile_sample_min_width": 16,
         "tile_sample_stride_height": 12, "tile_sample_stride_width": 12}

PLUGIN_SOURCE = '''
import types
import torch


class RowwiseVae(torch.nn.Module):
    """Per-view exact by construction: one conv call per row, so K views per forward give the same bits."""

    vaecache_temporal_factor = 2
    vaecache_spatial_factor = 4

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv3d(3, 6, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.calls = []

    def encode(self, x):
        self.calls.append(x.shape[0])
        h = torch.cat([self.conv(torch.cat([row[:, :1], row], 1)[None]) for row in x])
        mean, logvar = h.chunk(2, dim=1)
        return types.SimpleNamespace(mean=mean, logvar=logvar)


class MeanOnly(torch.nn.Module):
    vaecache_spatial_factor = 2
    vaecache_has_logvar = False

    def __init__(self):
        super().__init__()
        self.pool = torch.nn.AvgPool3d((1, 2, 2))

    def encode(self, x):
        return self.pool(x)


class Overflowing(torch.nn.Module):
    """Like an fp16/bf16 overflow: the second row it ever encodes gets one NaN and two infs."""

    vaecache_spatial_factor = 2
    vaecache_latent_channels = 3
    bad_row = 1

    def __init__(self):
        super().__init__()
        self.pool = torch.nn.AvgPool3d((1, 2, 2))
        self.rows_seen = 0

    def encode(self, x):
        mean = self.pool(x).clone()
        for row in range(x.shape[0]):
            if self.rows_seen == self.bad_row:
                mean[row, 0, 0, 0, 0] = float("nan")
                mean[row, 1, 0, 0, :2] = float("inf")
            self.rows_seen += 1
        return types.SimpleNamespace(mean=mean, logvar=torch.zeros_like(mean))


class WidePosterior(torch.nn.Module):
    """Finite mean and logvar, but the second row it ever encodes has a logvar of 1000: exp(logvar / 2) is not
    finite even in fp32, so a stored sample of it is not either."""

    vaecache_spatial_factor = 2
    vaecache_latent_channels = 3

    def __init__(self):
        super().__init__()
        self.pool = torch.nn.AvgPool3d((1, 2, 2))
        self.rows_seen = 0

    def encode(self, x):
        mean = self.pool(x).clone()
        logvar = torch.zeros_like(mean)
        for row in range(x.shape[0]):
            if self.rows_seen == 1:
                logvar[row, 0, 0, 0, 0] = 1000.0
            self.rows_seen += 1
        return types.SimpleNamespace(mean=mean, logvar=logvar)


class Misshapen(torch.nn.Module):
    """Returns a latent of the wrong shape on its second call: one row short, one frame, or 3 channels."""

    vaecache_spatial_factor = 2
    vaecache_latent_channels = 4

    def __init__(self, flaw):
        super().__init__()
        self.pool = torch.nn.AvgPool3d((1, 2, 2))
        self.flaw = flaw
        self.calls = 0

    def encode(self, x):
        self.calls += 1
        mean = self.pool(torch.cat([x, x[:, :1]], 1))
        if self.calls == 2:
            mean = {"row": mean[:, :, :, :-1], "frames": mean[:, :, :1], "channels": mean[:, :3]}[self.flaw]
        return types.SimpleNamespace(mean=mean, logvar=torch.zeros_like(mean))


class Exploding(torch.nn.Module):
    """Raises on its third forward (a plugin bug that one input triggers), or on every forward."""

    vaecache_spatial_factor = 2
    vaecache_latent_channels = 4

    def __init__(self, always=False):
        super().__init__()
        self.pool = torch.nn.AvgPool3d((1, 2, 2))
        self.always = always
        self.calls = 0

    def encode(self, x):
        self.calls += 1
        if self.always or self.calls == 3:
            raise RuntimeError(f"plugin exploded on call {self.calls}")
        mean = self.pool(torch.cat([x, x[:, :1]], 1))
        return types.SimpleNamespace(mean=mean, logvar=torch.zeros_like(mean))


def exploding():
    return Exploding()


def always_exploding():
    return Exploding(always=True)


def short_row():
    return Misshapen("row")


def one_frame():
    return Misshapen("frames")


def three_channels():
    return Misshapen("channels")


def rowwise():
    return RowwiseVae()


def mean_only():
    return MeanOnly()


def overflowing():
    return Overflowing()


def wide_posterior():
    return WidePosterior()
'''
