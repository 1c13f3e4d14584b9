"""`vaecache decode`: a clip's latents decoded back to pixels as a preview video, scored against its source (PSNR,
SSIM)."""
