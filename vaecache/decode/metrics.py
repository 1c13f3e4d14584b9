"""Reconstruction metrics for `vaecache decode`: PSNR and SSIM in torch (no new dependency).

Both take RGB in [0, 1]. PSNR is 10·log10(1 / MSE), capped at PSNR_CAP_DB. SSIM follows Wang et al. 2004 on
luma (BT.601 Y): an 11x11 Gaussian window with sigma 1.5, the valid region only (no padding), K1 0.01, K2 0.03.
"""

from __future__ import annotations

import math

import torch

PSNR_CAP_DB = 100.0
"""PSNR of frames that are equal (mean squared error 0, or below 1e-10 on [0, 1]) is reported as this, so the
number stays finite (JSON has no infinity)."""
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
_LUMA = (0.299, 0.587, 0.114)
"""ITU-R BT.601 luma weights: SSIM is measured on Y."""


def psnr_db(mse: float) -> float:
    """PSNR in dB of a mean squared error on [0, 1]; PSNR_CAP_DB for (near) equal frames."""
    if mse < 1e-10:
        return PSNR_CAP_DB
    return min(PSNR_CAP_DB, 10.0 * math.log10(1.0 / mse))


def _gaussian(size: int, sigma: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    coords = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    weights = torch.exp(-(coords ** 2) / (2 * sigma ** 2))
    return weights / weights.sum()


def luma(frames: torch.Tensor) -> torch.Tensor:
    """(T, 3, H, W) RGB -> (T, 1, H, W) BT.601 Y."""
    weights = torch.tensor(_LUMA, dtype=frames.dtype, device=frames.device).view(1, 3, 1, 1)
    return (frames * weights).sum(1, keepdim=True)


def ssim_per_frame(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SSIM of each frame pair: (T, 3, H, W) RGB in [0, 1] each -> (T,), on luma, float64.

    Wang et al. 2004: an 11x11 Gaussian window with sigma 1.5 (separable), the valid region only (no padding),
    C1 = (0.01 L)^2, C2 = (0.03 L)^2 with L = 1. A frame smaller than 11 pixels uses the largest odd window
    that fits. SSIM(x, x) is exactly 1."""
    x, y = luma(x.double()), luma(y.double())
    size = min(SSIM_WINDOW, x.shape[-2] - (1 - x.shape[-2] % 2), x.shape[-1] - (1 - x.shape[-1] % 2))
    g = _gaussian(size, SSIM_SIGMA, x.dtype, x.device)

    def blur(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.conv2d(t, g.view(1, 1, -1, 1))
        return torch.nn.functional.conv2d(t, g.view(1, 1, 1, -1))

    c1, c2 = SSIM_K1 ** 2, SSIM_K2 ** 2
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x * mu_x
    var_y = blur(y * y) - mu_y * mu_y
    cov = blur(x * y) - mu_x * mu_y
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2))
    return ssim_map.flatten(1).mean(1)


__all__ = ["PSNR_CAP_DB", "SSIM_SIGMA", "SSIM_WINDOW", "luma", "psnr_db", "ssim_per_frame"]
