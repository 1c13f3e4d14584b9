"""One rank of test_spatial.py (run under torchrun): spatial-parallel encode vs diffusers' own encode.

    python -m torch.distributed.run --standalone --nproc-per-node G _spatial_worker.py OUTDIR CASES_JSON

Every rank builds the same random-weight VAE, encodes each case split and unsplit, and writes
OUTDIR/rank-<r>.json with the max abs difference, the latent scale and whether they are bitwise equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from vaecache.parallel.spatial import spatial_encode

WAN21 = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
         "temperal_downsample": [False, True, True]}
WAN22 = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
         "temperal_downsample": [False, True, True], "is_residual": True, "patch_size": 2, "in_channels": 12,
         "out_channels": 12, "decoder_base_dim": 8, "scale_factor_spatial": 16, "scale_factor_temporal": 4}


def build(config: dict) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**config).eval()


def main() -> None:
    out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    tdist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = tdist.get_rank()
    results = []
    models = {"wan2.1": build(WAN21), "wan2.2": build(WAN22)}
    for case in cases:
        module = models[case["model"]]
        generator = torch.Generator().manual_seed(case["seed"])
        x = torch.rand(1, 3, case["frames"], case["height"], case["width"], generator=generator) * 2 - 1
        with torch.no_grad():
            split = spatial_encode(module, x, tdist.group.WORLD)
            posterior = module.encode(x).latent_dist
        whole = torch.cat([posterior.mean, posterior.logvar], dim=1)
        results.append({**case, "shape": list(split.shape), "expected_shape": list(whole.shape),
                        "max_abs": float((split - whole).abs().max()) if split.shape == whole.shape else None,
                        "scale": float(whole.abs().max()), "bitwise": bool(torch.equal(split, whole))})
    (out / f"rank-{rank}.json").write_text(json.dumps(results))
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
