"""Spatial-parallel encode: band planning (pure), and real gloo ranks against diffusers' own encode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vaecache.errors import UsageError
from vaecache.spatial import halo_memory_format, plan_bands

WORKER = Path(__file__).with_name("_spatial_worker.py")
REPO = Path(__file__).resolve().parents[2]
RELATIVE_TOLERANCE = 2e-6
"""Max |split - unsplit| as a fraction of max |unsplit|. Not 0: on CPU oneDNN picks the kernel of the
stride-2 Conv2d in WanResample by input height, so a band and the whole frame are summed in another order
(a few float32 ulps; measured up to ~8e-7 of the scale, see README)."""


@pytest.mark.parametrize(("latent_height", "group"), [(8, 2), (5, 2), (7, 3), (9, 4), (4, 4)])
def test_bands_cover_every_row_once_and_differ_by_at_most_one(latent_height: int, group: int) -> None:
    plan = plan_bands(latent_height * 8, 8, group)
    rows = [plan.latent_rows(r) for r in range(group)]
    assert rows[0][0] == 0 and rows[-1][1] == latent_height
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    sizes = [stop - start for start, stop in rows]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert all(start % 8 == 0 for start, _ in map(plan.pixel_rows, range(group)))


def test_more_ranks_than_latent_rows_is_refused() -> None:
    with pytest.raises(UsageError, match="cannot be cut into 4 bands"):
        plan_bands(24, 8, 4)
    with pytest.raises(UsageError, match="not a multiple of the spatial factor"):
        plan_bands(30, 8, 2)


def test_buffers_follow_the_input_memory_format() -> None:
    x = torch.empty(1, 4, 2, 6, 5).contiguous(memory_format=torch.channels_last_3d)
    assert halo_memory_format(x) == torch.channels_last_3d
    assert halo_memory_format(torch.empty(2, 4, 6, 5).contiguous(memory_format=torch.channels_last)) == torch.channels_last
    assert halo_memory_format(torch.empty(1, 4, 2, 6, 5)) == torch.contiguous_format


def test_spatial_mode_refuses_other_families() -> None:
    from diffusers import AutoencoderKLCogVideoX

    from vaecache.spatial import HaloExchanger, banded

    module = AutoencoderKLCogVideoX(block_out_channels=(8,), down_block_types=("CogVideoXDownBlock3D",),
                                    up_block_types=("CogVideoXUpBlock3D",), latent_channels=4, layers_per_block=1,
                                    norm_num_groups=4)
    with pytest.raises(UsageError, match="supports AutoencoderKLWan"):
        with banded(module, HaloExchanger(None), plan_bands(16, 8, 1)):
            pass


CASES = [
    {"model": "wan2.1", "seed": 1, "frames": 5, "height": 64, "width": 48},   # 8 latent rows
    {"model": "wan2.1", "seed": 2, "frames": 9, "height": 56, "width": 40},   # 7 latent rows: uneven bands
    {"model": "wan2.2", "seed": 3, "frames": 5, "height": 96, "width": 32},   # patchified, 16x: 6 latent rows
]


@pytest.mark.slow
@pytest.mark.parametrize("group", [2, 3])
def test_spatial_encode_matches_diffusers_encode(tmp_path: Path, group: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={group}",
                           str(WORKER), str(tmp_path), json.dumps(CASES)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(group):
        for result in json.loads((tmp_path / f"rank-{rank}.json").read_text()):
            assert result["shape"] == result["expected_shape"], result
            assert result["max_abs"] <= RELATIVE_TOLERANCE * result["scale"], result
