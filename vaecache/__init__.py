"""vaecache: precompute video VAE latents at cluster scale, into verified safetensors shards."""

__version__ = "0.2.0"
