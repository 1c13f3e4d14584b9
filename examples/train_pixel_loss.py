"""Training on cached latents with a pixel-space loss through the frozen VAE decoder (vaecache.PixelDecoder).

    python examples/train_pixel_loss.py OUT

The model predicts clean latents from noisy ones; the loss is the latent MSE plus an L1 loss between the decoded
prediction and the clip's real frames (LatentCache.source_frames: the frames encode saw). The decoder keeps the
gradient path to the prediction and checkpoints every decoder stage, so its memory stays bounded.
"""

import sys

import torch

from vaecache import LatentCache, LatentDataset, PixelDecoder, collate_latents

if len(sys.argv) != 2:
    print("usage: python examples/train_pixel_loss.py OUT   (OUT: a cache written by vaecache encode)", file=sys.stderr)
    sys.exit(2)
out = sys.argv[1]

cache = LatentCache(out)
dataset = LatentDataset(out)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=dataset.batch_sampler(batch_size=1, seed=0),
                                     collate_fn=collate_latents)
decoder = PixelDecoder.from_cache(out, checkpoint=True)  # the recorded VAE, fingerprint-checked, frozen

channels = cache[0].mean.shape[1]
model = torch.nn.Conv3d(channels, channels, 3, padding=1)  # stands in for a video diffusion transformer
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(0)
pixel_weight = 0.1

for step, batch in enumerate(loader):
    z = cache.normalize(batch["mean"].flatten(0, 1).float())  # (B * cameras, C, t, h, w), as the model sees them
    noisy = z + 0.5 * torch.randn(z.shape, generator=generator)
    predicted = model(noisy)
    latent_loss = torch.nn.functional.mse_loss(predicted, z)
    frames = decoder(cache.denormalize(predicted))  # (B * cameras, 3, T, H, W) in [-1, 1], differentiable
    targets = torch.cat([cache.source_frames(record) for record in batch["record"]])  # the frames encode saw
    pixel_loss = torch.nn.functional.l1_loss(frames.float(), targets)
    loss = latent_loss + pixel_weight * pixel_loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: latent {latent_loss.item():.4f}, pixel {pixel_loss.item():.4f}, "
          f"weight grad norm {model.weight.grad.norm().item():.4f}", flush=True)
