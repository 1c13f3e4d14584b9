"""A minimal training loop on a vaecache cache.

    python examples/train_latents.py OUT
    torchrun --nproc-per-node 2 examples/train_latents.py OUT    # DDP: each rank trains on its share of the batches
"""

import os
import sys

import torch
import torch.distributed as dist

from vaecache import LatentCache, LatentDataset, collate_latents

if len(sys.argv) != 2:
    print("usage: python examples/train_latents.py OUT   (OUT: a cache written by vaecache encode)", file=sys.stderr)
    sys.exit(2)
out = sys.argv[1]
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one process group, so the sampler splits batches
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank() if dist.is_initialized() else 0

cache = LatentCache(out)  # the recorded normalization constants and posterior sampling
dataset = LatentDataset(out, verify="sha256")  # each shard's sha256 checked once per worker, on first open
# One latent shape per batch; split across DDP ranks when torch.distributed is initialized.
sampler = dataset.batch_sampler(batch_size=2, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2, collate_fn=collate_latents)

channels = cache[0].mean.shape[1]  # items are (cameras, C, F, H, W)
model = torch.nn.Conv3d(channels, channels, 3, padding=1)  # stands in for a video diffusion transformer
if dist.is_initialized():
    model = torch.nn.parallel.DistributedDataParallel(model)  # gradients averaged over the ranks
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(rank)

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
    # one write per line: under torchrun the ranks share a pipe, and print's two writes (text, then newline) interleave
    sys.stdout.write(f"rank {rank} epoch {epoch}: {len(sampler)} batches, last loss {loss.item():.4f}, "
                     f"captions {captions}\n")
    sys.stdout.flush()

if dist.is_initialized():
    dist.destroy_process_group()
