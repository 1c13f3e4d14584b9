"""`vaecache decode`: chunked decoding is the whole decode, the metrics, the mp4 grid, and the CLI's refusals."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import av
import pytest
import torch

from vaecache.decode.metrics import PSNR_CAP_DB, psnr_db, ssim_per_frame
from vaecache.decode.preview import PreviewSettings, decode_preview, default_output, grid_frames, grid_size
from vaecache.errors import UsageError
from vaecache.training import LatentCache
from vaecache.vae import load_vae
from vaecache.vae.latent_decode import CHUNKED, iter_decoded

CLIP = "scene_000/000000-000008"

IDENTITY_VAE = '''
import torch


class Identity(torch.nn.Module):
    """Its latent is its input: decoding gives back exactly the frames encode read."""

    vaecache_has_logvar = False
    vaecache_latent_channels = 3

    def __init__(self):
        super().__init__()
        self.register_buffer("one", torch.ones(1))

    def encode(self, x):
        return x * self.one

    def decode(self, z):
        return z * self.one


def make():
    return Identity()
'''


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread, as conftest starts with: an encode fixture leaves torch at the cores it budgeted, and
    on a shared 2-core runner two spinning OpenMP threads made one small decode take 10 s instead of 0.6 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _read_mp4(path: Path) -> dict[str, Any]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return {"codec": stream.codec_context.name, "pix_fmt": stream.codec_context.pix_fmt,
                "rate": stream.average_rate, "frames": frames}


@pytest.fixture(scope="module")
def identity_vae(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A python: VAE spec whose latents are its input frames (importable for this module's tests)."""
    folder = tmp_path_factory.mktemp("identity_vae")
    (folder / "identity_vae.py").write_text(textwrap.dedent(IDENTITY_VAE))
    sys.path.insert(0, str(folder))
    try:
        yield "python:identity_vae:make"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("identity_vae", None)


@pytest.fixture(scope="module")
def identity_cache(demo_data: Path, tmp_path_factory: pytest.TempPathFactory, encode_cli: Any,
                   identity_vae: str) -> Path:
    """The demo data encoded with the identity VAE (resized to cover 32x48 and cropped), --store mean. Decoding
    it must give back the frames encode read, pixel for pixel."""
    out = tmp_path_factory.mktemp("identity") / "cache"
    encode_cli(demo_data, out, "--vae", identity_vae, "--size", "32x48", "--store", "mean")
    return out


# --------------------------------------------------------------------------- chunked decoding


@pytest.mark.parametrize("tiled", [False, True], ids=["whole-frames", "tiled"])
def test_chunked_decode_is_the_whole_decode(tiled: bool) -> None:
    model = load_vae("builtin:tiny").model
    if tiled:  # 48x48 frames in 32-pixel tiles every 16: 9 tiles, each with its own causal cache
        model.module.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                                   tile_sample_stride_height=16, tile_sample_stride_width=16)
    z = torch.randn(1, 16, 4, 6, 6, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = model.module.decode(z).sample
    for chunk in ((1, 3) if tiled else (1, 3, 4)):
        pieces = list(iter_decoded(model, z, chunk))
        assert len(pieces) == math.ceil(4 / chunk)
        assert torch.equal(torch.cat(pieces, dim=2), whole), f"chunk {chunk}"


def test_chunk_sizes_bound_the_frames_in_flight() -> None:
    model = load_vae("builtin:tiny").model
    z = torch.randn(1, 16, 5, 2, 2, generator=torch.Generator().manual_seed(1))
    # Wan: latent frame 0 is one frame, each later one four.
    assert [p.shape[2] for p in iter_decoded(model, z, 2)] == [5, 8, 4]
    with pytest.raises(UsageError, match="--chunk-frames must be >= 1"):
        next(iter_decoded(model, z, 0))


# --------------------------------------------------------------------------- metrics and grid


def test_psnr_and_ssim_of_equal_and_of_noisy_frames() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(3, 3, 40, 36, generator=generator, dtype=torch.float64)
    assert torch.equal(ssim_per_frame(x, x), torch.ones(3, dtype=torch.float64))
    assert psnr_db(0.0) == PSNR_CAP_DB
    assert psnr_db(0.01) == pytest.approx(20.0)
    noisy = (x + 0.05 * torch.randn(x.shape, generator=generator, dtype=torch.float64)).clamp(0, 1)
    ssim = ssim_per_frame(x, noisy)
    assert torch.isfinite(ssim).all() and (ssim < 1).all() and (ssim > 0).all()
    assert ssim_per_frame(x, 1 - x).mean() < ssim.mean()
    tiny = torch.rand(2, 3, 6, 9, generator=generator)  # smaller than the 11x11 window: the window shrinks
    assert torch.equal(ssim_per_frame(tiny, tiny), torch.ones(2, dtype=torch.float64))


def test_grid_puts_sources_above_reconstructions_padded_to_even() -> None:
    sources = [torch.full((2, 3, 5, 7), -1.0), torch.full((2, 3, 5, 7), 1.0)]
    decoded = [torch.zeros(2, 3, 5, 7), torch.full((2, 3, 5, 7), 1.0)]
    grid = grid_frames(sources, decoded)
    assert grid.shape == (2, 10, 14, 3) and grid.dtype == torch.uint8
    assert (grid[:, :5, :7] == 0).all() and (grid[:, :5, 7:14] == 255).all()
    assert (grid[:, 5:10, :7] == 128).all() and (grid[:, 5:10, 7:14] == 255).all()
    one = grid_frames(sources[:1], decoded[:1])
    assert one.shape == (2, 10, 8, 3) and (one[:, :, 7] == 0).all()  # 7 wide -> one black column
    assert grid_size(5, 7, 1) == (10, 8)


def test_settings_are_checked() -> None:
    with pytest.raises(UsageError, match="--chunk-frames"):
        PreviewSettings(chunk_frames=0)
    with pytest.raises(UsageError, match="crf"):
        PreviewSettings(crf=60)
    assert default_output("scene_000/000000-000008") == Path("scene_000_000000-000008.mp4")


# --------------------------------------------------------------------------- end to end


def test_decode_of_a_cache_writes_a_playable_grid_and_a_finite_table(good_cache: Path, tmp_path: Path,
                                                                       run_cli: Any) -> None:
    output, report = tmp_path / "preview.mp4", tmp_path / "report.json"
    result = run_cli(["decode", good_cache, "--clip", CLIP, "-o", output, "--chunk-frames", "1", "--json", report])
    assert result.exit_code == 0, result.output
    assert "PSNR dB" in result.output and f"wrote {output}" in result.output
    info = json.loads(report.read_text())
    assert info["latent_key"] == "mean" and info["decode_mode"] == CHUNKED and info["chunks"] == 3
    assert info["max_frames_in_flight"] == 4 and info["frames"] == 9
    assert [c["camera"] for c in info["cameras"]] == ["cam_0", "cam_1"]
    for camera in info["cameras"]:  # an untrained VAE: a poor reconstruction, but a finite one
        assert math.isfinite(camera["psnr_db"]) and 0 < camera["psnr_db"] < PSNR_CAP_DB
        assert -1 <= camera["ssim"] < 1
    video = _read_mp4(output)
    assert video["codec"] == "h264" and video["pix_fmt"] == "yuv420p" and video["rate"] == 10
    assert len(video["frames"]) == 9 and video["frames"][0].shape == (128, 128, 3)
    assert not list(tmp_path.glob(".*tmp*"))


def test_decode_gives_back_the_frames_encode_read(identity_cache: Path, identity_vae: str, tmp_path: Path) -> None:
    report = decode_preview(identity_cache, CLIP, tmp_path / "same.mp4", chunk_frames=2, vae=identity_vae)
    assert report.latent_key == "mean" and report.size == (32, 48) and report.grid == (64, 96)
    assert [(c.psnr_db, c.ssim) for c in report.cameras] == [(PSNR_CAP_DB, 1.0)] * 2
    frames = _read_mp4(tmp_path / "same.mp4")["frames"]
    assert len(frames) == 9 and frames[0].shape == (64, 96, 3)
    top, bottom = frames[4][:32].astype(int), frames[4][32:].astype(int)
    assert abs(top - bottom).mean() < 8  # the same picture twice, up to h264 (crf 18, 4:2:0 chroma)


def test_a_bucketed_contain_clip_is_read_at_its_bucket_size(demo_data: Path, tmp_path: Path, encode_cli: Any,
                                                            identity_vae: str) -> None:
    out = tmp_path / "cache"
    encode_cli(demo_data, out, "--vae", identity_vae, "--size", "32x48,48x32", "--fit", "contain", "--store", "mean")
    report = decode_preview(out, CLIP, tmp_path / "bucket.mp4", vae=identity_vae)
    record = LatentCache(out).record(CLIP)
    assert report.size == (record["bucket"]["height"], record["bucket"]["width"])
    assert [(c.psnr_db, c.ssim) for c in report.cameras] == [(PSNR_CAP_DB, 1.0)] * 2  # padding included


def test_an_existing_output_is_kept_without_overwrite(identity_cache: Path, identity_vae: str, tmp_path: Path,
                                                     run_cli: Any) -> None:
    output = tmp_path / "kept.mp4"
    output.write_bytes(b"mine")
    result = run_cli(["decode", identity_cache, "--clip", CLIP, "-o", output, "--vae", identity_vae])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {output}: exists; pass --overwrite to replace it"
    assert output.read_bytes() == b"mine"
    result = run_cli(["decode", identity_cache, "--clip", CLIP, "-o", output, "--overwrite", "--vae", identity_vae])
    assert result.exit_code == 0, result.output
    assert len(_read_mp4(output)["frames"]) == 9


def test_an_unknown_clip_is_one_line_and_exit_2(identity_cache: Path, tmp_path: Path, run_cli: Any) -> None:
    result = run_cli(["decode", identity_cache, "--clip", "scene_000/000000-00008", "-o", tmp_path / "x.mp4"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {identity_cache}: no clip 'scene_000/000000-00008'")
    assert f"'{CLIP}'" in lines[0]  # the nearest id, to spot the typo
    assert not (tmp_path / "x.mp4").exists()


def test_a_vae_other_than_the_recorded_one_is_refused(identity_cache: Path, tmp_path: Path, run_cli: Any) -> None:
    result = run_cli(["decode", identity_cache, "--clip", CLIP, "-o", tmp_path / "x.mp4", "--vae", "builtin:tiny"])
    assert result.exit_code == 2
    assert "does not match the VAE recorded in" in result.output
    assert not list(tmp_path.iterdir())


def test_decode_without_a_clip_takes_the_first_and_inspect_lists_the_ids(good_cache: Path, tmp_path: Path) -> None:
    from tests.conftest import invoke

    listed = invoke(["inspect", good_cache, "--clips", "--json", tmp_path / "info.json"])
    assert listed.exit_code == 0, listed.output
    ids = json.loads((tmp_path / "info.json").read_text())["clip_ids"]
    assert ids == sorted(ids) and all(clip_id in listed.output for clip_id in ids)
    result = invoke(["decode", good_cache, "-o", tmp_path / "first.mp4"])
    assert result.exit_code == 0, result.output
    assert f"no --clip: decoding the first clip, {ids[0]}" in result.output and (tmp_path / "first.mp4").is_file()
    assert "builtin:tiny is an untrained VAE" in result.output
