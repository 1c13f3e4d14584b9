"""Spatial-parallel encode: band planning (pure), and real gloo ranks against diffusers' own encode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import invoke
from vaecache.errors import UsageError
from vaecache.parallel.spatial import halo_memory_format, plan_bands

WORKER = Path(__file__).with_name("_spatial_worker.py")
REPO = Path(__file__).resolve().parents[2]
RELATIVE_TOLERANCE = 1e-6
"""Max |split - unsplit| as a fraction of max |unsplit| (the spatial split's accuracy target). Not 0 for these
tiny models: the CPU attention kernel blocks queries by their count, so a band's queries at the mid-block can differ
from the whole frame's in the last bit (measured up to 5.3e-7 of the scale); every convolution runs the whole
frame's kernel (UnsplitKernels). The first case is bitwise and is asserted so."""


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
    assert (halo_memory_format(torch.empty(2, 4, 6, 5).contiguous(memory_format=torch.channels_last))
            == torch.channels_last)
    assert halo_memory_format(torch.empty(1, 4, 2, 6, 5)) == torch.contiguous_format


def test_spatial_mode_refuses_other_families() -> None:
    from diffusers import AutoencoderKLCogVideoX

    from vaecache.parallel.spatial import HaloExchanger, banded

    module = AutoencoderKLCogVideoX(block_out_channels=(8,), down_block_types=("CogVideoXDownBlock3D",),
                                    up_block_types=("CogVideoXUpBlock3D",), latent_channels=4, layers_per_block=1,
                                    norm_num_groups=4)
    with pytest.raises(UsageError, match="supports AutoencoderKLWan"):
        with banded(module, HaloExchanger(None), plan_bands(16, 8, 1)):
            pass


def test_a_band_convolution_runs_the_kernel_the_whole_frame_gets() -> None:
    """A 3x3x3 conv over a 66-row band goes native where the 130-row frame goes to oneDNN (PyTorch picks by
    batch x channels x frames x height): run with the frame's kernel, the band's rows are the frame's, bitwise."""
    from vaecache.parallel.spatial import UnsplitKernels

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(96, 96, 3)
    frame = torch.randn(1, 96, 3, 130, 34)
    with torch.no_grad():
        whole = conv(frame)
        band_input = frame[..., 64:, :].contiguous()  # rows 64..127 of the output, with their halo rows
        plain = conv(band_input)
        kernels = UnsplitKernels(band_latent_rows=8, latent_height=16)  # the lower half of the frame
        banded = kernels.conv(conv, band_input, conv.weight, conv.bias, conv._conv_forward)
    if torch.backends.mkldnn.is_available():
        assert not torch.equal(plain, whole[..., 64:, :])  # why this exists: the band's own kernel differs
    assert torch.equal(banded, whole[..., 64:, :])


def test_every_convolution_of_the_encode_runs_the_frames_kernel_while_banded() -> None:
    """Encoder convs and quant_conv (a 1x1x1 conv on the band's latent rows: with 2 threads PyTorch runs it in
    oneDNN for 45 rows and natively for 22) are all redirected inside the context, and none after it."""
    from diffusers import AutoencoderKLWan

    from vaecache.parallel.spatial import HaloExchanger, banded

    module = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                              temperal_downsample=[False, True, True]).eval()
    convs = [m for m in [*module.encoder.modules(), module.quant_conv]
             if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    with banded(module, HaloExchanger(None), plan_bands(64, 8, 1)):
        assert all("_conv_forward" in conv.__dict__ for conv in convs)
    assert not any("_conv_forward" in conv.__dict__ for conv in convs)


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
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text())[0]["bitwise"]


ENCODE = ["--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--no-progress", "--workers", "0"]


def _split_against_one_process(procs, demo_data: Path, tmp_path: Path, cache_io, group: int,
                               args: list[str]) -> dict[str, torch.Tensor]:
    """Encode with one process and with `group` ranks in spatial mode; assert they agree; the reference tensors."""
    one = procs.vaecache("encode", demo_data, "--out", tmp_path / "one", *args)
    assert one.returncode == 0, one.stderr
    split = procs.torchrun(group, "encode", demo_data, "--out", tmp_path / "split", *args, "--sp-size", str(group),
                           "--sp-mode", "spatial")
    assert split.returncode == 0, split.stderr
    reference, banded = cache_io.tensors(tmp_path / "one"), cache_io.tensors(tmp_path / "split")
    assert sorted(reference) == sorted(banded)
    for name, tensor in reference.items():
        assert float((banded[name] - tensor).abs().max()) <= RELATIVE_TOLERANCE * float(tensor.abs().max()), name
    return reference


@pytest.mark.slow
def test_encode_in_spatial_mode_matches_a_one_process_encode(procs, demo_data: Path, tmp_path: Path, cache_io) -> None:
    _split_against_one_process(procs, demo_data, tmp_path, cache_io, 2, ENCODE)
    manifest = cache_io.manifest(tmp_path / "split")
    assert (manifest["settings"]["sp_mode"], manifest["settings"]["sp_size"]) == ("spatial", 2)
    verified = invoke(["verify", tmp_path / "split"])
    assert verified.exit_code == 0, verified.output
    resumed_as_views = procs.torchrun(2, "encode", demo_data, "--out", tmp_path / "split", *ENCODE, "--sp-size", "2")
    assert resumed_as_views.returncode != 0 and "made with other settings (parallel" in resumed_as_views.stderr


@pytest.mark.slow
def test_three_ranks_at_an_odd_size_match_one_process(procs, demo_data: Path, tmp_path: Path, cache_io) -> None:
    """56x40: 7 latent rows over 3 ranks (bands of 3, 2, 2 rows), the demo's 64x64 footage resized and cropped."""
    odd = [*ENCODE[:4], "--size", "56x40", *ENCODE[6:]]
    reference = _split_against_one_process(procs, demo_data, tmp_path, cache_io, 3, odd)
    assert {tuple(tensor.shape[-2:]) for tensor in reference.values()} == {(7, 5)}


def test_spatial_mode_in_one_process_is_the_plain_encode(demo_data: Path, tmp_path: Path, encode_cli, cache_io) -> None:
    encode_cli(demo_data, tmp_path / "views")
    encode_cli(demo_data, tmp_path / "spatial", "--sp-mode", "spatial")
    cache_io.same_tensors(cache_io.tensors(tmp_path / "views"), cache_io.tensors(tmp_path / "spatial"))


def test_spatial_mode_refuses_tiling_and_too_many_ranks(demo_data: Path, tmp_path: Path, run_cli) -> None:
    tiled = run_cli(["encode", demo_data, "--out", tmp_path / "a", *ENCODE, "--sp-mode", "spatial", "--tiling"])
    assert tiled.exit_code == 2 and "cannot be combined with --tiling" in tiled.output
    odd = run_cli(["encode", demo_data, "--out", tmp_path / "b", *ENCODE, "--sp-mode", "sideways"])
    assert odd.exit_code == 2 and "--sp-mode must be one of views, spatial" in odd.output
