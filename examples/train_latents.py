"""A minimal training loop on a vaecache cache: python examples/train_latents.py OUT"""

import sys

import torch

from vaecache import LatentCache, LatentDataset, collate_latents

out = sys.argv[1] if len(sys.argv) > 1 else "latents"
cache = LatentCache(out)  # the recorded normalization constants and posterior sampling
dataset = LatentDataset(out, verify="sha256")  # each shard's sha256 checked once per worker, on first open
# One latent shape per batch; split across DDP ranks when torch.distributed is initialized.
sampler = dataset.batch_sampler(batch_size=2, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2, collate_fn=collate_latents)

channels = cache[0].mean.shape[1]  # items are (cameras, C, F, H, W)
model = torch.nn.Conv3d(channels, channels, 3, padding=1)  # stands in for a video diffusion transformer
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(0)

for epoch in range(2):
    sampler.set_epoch(epoch)  # a new batch order each epoch, the same on every rank
    for batch in loader:
        z = cache.sample(batch, generator)  # mean + exp(0.5 * logvar) * eps: (B, cameras, C, F, H, W)
        z = cache.normalize(z).flatten(0, 1)  # every camera view is a sample: (B * cameras, C, F, H, W)
        captions = [record.get("metadata", {}).get("caption", "") for record in batch["record"]]
        noise = torch.randn(z.shape, generator=generator)
        t = torch.rand(z.shape[0], 1, 1, 1, 1, generator=generator)
        noisy = (1 - t) * z + t * noise  # rectified flow: predict the velocity noise - z
        loss = torch.nn.functional.mse_loss(model(noisy), noise - z)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch}: {len(sampler)} batches, last loss {loss.item():.4f}, captions {captions}")
