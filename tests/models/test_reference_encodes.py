"""Each model family's reference encode: the latents its trainers make, stored and recorded (vaecache/models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.models import FAMILIES, family_for, recorded_family
from vaecache.models.kandinsky5 import encode_tiled, space_tiles, uncovered_size
from vaecache.training import LatentCache
from vaecache.verify.integrity import verify_cache

HV_TINY = dict(block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
               up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=16, layers_per_block=1,
               norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4, scaling_factor=0.476986)
"""A tiny AutoencoderKLHunyuanVideo with HunyuanVideo's 16 latent channels and scaling factor (musubi exports it)."""


@pytest.fixture(scope="module")
def hunyuan_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hv") / "vae"
    AutoencoderKLHunyuanVideo(**HV_TINY).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def long_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One scene, one camera, 25 frames of 32x32 h264."""
    root = tmp_path_factory.mktemp("long") / "data"
    write_demo_dataset(root, DemoDataSpec(scenes=1, cameras=1, frames=25, height=32, width=32, fps=10, seed=3))
    return root


def _encode(run_cli, data: Path, out: Path, vae: Path, *extra: str) -> None:
    result = run_cli(["encode", data, "--out", out, "--vae", f"diffusers:{vae}", "--size", "32x32", "--workers", "0",
                      "--no-progress", *extra])
    assert result.exit_code == 0, result.output


def test_hunyuanvideo_clips_over_16_frames_are_encoded_whole(hunyuan_vae, long_data, tmp_path, run_cli) -> None:
    """HunyuanVideo's trainers encode a clip in one pass; diffusers' class tiles time above 16 frames unless
    use_framewise_encoding is off: the stored mean is diffusers' encode with it off, bitwise, and not the default."""
    from diffusers import AutoencoderKLHunyuanVideo

    _encode(run_cli, long_data, tmp_path / "cache", hunyuan_vae, "--num-frames", "21")
    cache = LatentCache(tmp_path / "cache")
    assert cache.manifest["vae"]["model"] == "hunyuanvideo"
    assert cache.manifest["vae"]["reference_encode"] == {"name": "untiled"}
    module = AutoencoderKLHunyuanVideo.from_pretrained(hunyuan_vae).eval()
    item = cache[0]
    frames = cache.source_frames(item.id)  # (cameras, 3, 21, 32, 32) in [-1, 1]
    with torch.no_grad():
        module.use_framewise_encoding = False
        whole = module.encode(frames).latent_dist.mean
        module.use_framewise_encoding = True
        tiled = module.encode(frames).latent_dist.mean
    assert item.mean.shape == (1, 16, 6, 8, 8)
    assert torch.equal(item.mean, whole)
    assert not torch.equal(item.mean, tiled)  # diffusers' default would have been another latent
    assert run_cli(["verify", tmp_path / "cache", "--reencode", "1"]).exit_code == 0


def test_kandinsky5_clips_are_encoded_in_its_own_time_tiles(hunyuan_vae, long_data, tmp_path, run_cli) -> None:
    """--model kandinsky5: 25 frames go through the authors' 17-frame tiles every 8 frames (two tiles: frames 0-16 and
    8-24), the second tile's first latent frame dropped and its next two blended linearly with the first tile's last
    two (weights 1 - k/2, k/2), each latent frame written out here from that rule."""
    from diffusers import AutoencoderKLHunyuanVideo

    _encode(run_cli, long_data, tmp_path / "cache", hunyuan_vae, "--num-frames", "25", "--model", "kandinsky5")
    cache = LatentCache(tmp_path / "cache")
    vae = cache.manifest["vae"]
    assert vae["model"] == "kandinsky5" and vae["reference_encode"]["name"] == "kandinsky5-tiles"
    assert cache.manifest["frame_rule"]["long_step"] == 8
    module = AutoencoderKLHunyuanVideo.from_pretrained(hunyuan_vae).eval()
    frames = cache.source_frames(cache[0].id)
    with torch.no_grad():
        first = module.quant_conv(module.encoder(frames[:, :, 0:17]))
        second = module.quant_conv(module.encoder(frames[:, :, 8:25]))[:, :, 1:]
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    blended = [first[:, :, 3 + k] * (1 - k / 2) + second[:, :, k] * (k / 2) for k in range(2)]
    moments = torch.stack([first[:, :, 0], first[:, :, 1], first[:, :, 2], *blended, second[:, :, 2],
                           second[:, :, 3]], dim=2)
    expected = DiagonalGaussianDistribution(moments).mean
    assert cache[0].mean.shape == (1, 16, 7, 8, 8) and torch.equal(cache[0].mean, expected)
    with torch.no_grad():
        assert not torch.equal(cache[0].mean, module.encode(frames).latent_dist.mean)  # not diffusers' own tiles
    assert run_cli(["verify", tmp_path / "cache", "--reencode", "1"]).exit_code == 0


def test_kandinsky5_refuses_frame_counts_its_tiles_do_not_cover(hunyuan_vae, long_data, tmp_path, run_cli) -> None:
    """21 frames would come out of the authors' tiles as 3 latent frames of the first 9: refused before any video is
    probed, naming the counts it covers whole."""
    result = run_cli(["encode", long_data, "--out", tmp_path / "cache", "--vae", f"diffusers:{hunyuan_vae}",
                      "--model", "kandinsky5", "--num-frames", "21", "--size", "32x32", "--workers", "0"])
    assert result.exit_code == 2
    assert "--num-frames 21 is not valid for Kandinsky 5" in result.output
    assert "nearest valid: 17 and 25" in result.output
    result = run_cli(["encode", long_data, "--out", tmp_path / "other", "--vae", f"diffusers:{hunyuan_vae}",
                      "--model", "wan", "--num-frames", "21", "--size", "32x32", "--workers", "0"])
    assert result.exit_code == 2 and "Wan trains on AutoencoderKLWan latents" in result.output
    result = run_cli(["encode", long_data, "--out", tmp_path / "other", "--vae", f"diffusers:{hunyuan_vae}",
                      "--model", "sd3", "--num-frames", "21", "--size", "32x32", "--workers", "0"])
    assert result.exit_code == 2 and "--model 'sd3' is not a model vaecache knows" in result.output


def test_kandinsky5_space_tiles_are_its_authors_geometry() -> None:
    """get_enc_optimal_tiling's tiles without its free-memory term (the same from 16 GiB free up): one tile below
    256 * 17 * (h + 32) * (w + 32) = 2**31 elements, else tiles of a multiple of 8 plus 16 overlapping by 32."""
    assert space_tiles(480, 832) == (480, 832, 480, 832)
    assert space_tiles(720, 1280) == (376, 656, 344, 624)
    assert space_tiles(1280, 720) == (656, 376, 624, 344)
    assert space_tiles(1080, 1920) == (560, 656, 528, 624)
    assert space_tiles(256, 2048) == (256, 528, 256, 496)
    for height, width in ((704, 672), (720, 1280), (1080, 1920), (2048, 2048)):
        tile_h, tile_w, _, _ = space_tiles(height, width)
        assert 256 * 17 * (tile_h + 32) * (tile_w + 32) < 2 ** 31 * 1.2  # each tile about one element budget


def test_kandinsky5_refuses_sizes_its_space_tiles_cut_short(hunyuan_vae, long_data, tmp_path, run_cli) -> None:
    """Its tiles start only while a whole tile fits: 1080x1920 would come out as the latents of its top 560 rows
    (the authors' code gives 140x476 latents). Such a size is refused, naming sizes it covers whole."""
    assert uncovered_size(720, 1280, 8) is None and uncovered_size(480, 832, 8) is None
    problem = uncovered_size(1080, 1920, 8)
    assert "560x656 tiles every 528x624 pixels, which reach 560x1904" in problem
    assert "nearest sizes it encodes whole: 1072x1928, 1088x1928, 1072x1904" in problem
    for size in ("1072x1928", "1088x1928", "1072x1904"):
        assert uncovered_size(*map(int, size.split("x")), 8) is None
    result = run_cli(["encode", long_data, "--out", tmp_path / "cache", "--vae", f"diffusers:{hunyuan_vae}",
                      "--model", "kandinsky5", "--num-frames", "17", "--size", "1080x1920", "--workers", "0"])
    assert result.exit_code == 2 and "--size 1080x1920 is not valid for Kandinsky 5" in " ".join(result.output.split())


def test_kandinsky5_space_tiles_blend_as_its_authors_code(hunyuan_vae) -> None:
    """A 704x672 frame is past the element bound: 2 x 2 tiles of 368x352 pixels every 336x320, latent tiles of 92x88
    every 84x80. Outside the overlaps each region is one tile's own latent; inside, the rows (columns) mix the two
    tiles linearly, row k of the overlap weighing the earlier tile 1 - k/8."""
    from diffusers import AutoencoderKLHunyuanVideo

    module = AutoencoderKLHunyuanVideo.from_pretrained(hunyuan_vae).eval()
    torch.manual_seed(1)
    x = torch.rand(1, 3, 1, 704, 672) * 2 - 1
    assert space_tiles(704, 672) == (368, 352, 336, 320)
    with torch.no_grad():
        moments = encode_tiled(module, x).parameters
        tile = {(i, j): module.quant_conv(module.encoder(x[..., 336 * i:336 * i + 368, 320 * j:320 * j + 352]))
                for i in (0, 1) for j in (0, 1)}
    assert moments.shape == (1, 32, 1, 176, 168)
    assert torch.equal(moments[..., :84, :80], tile[0, 0][..., :84, :80])
    assert torch.equal(moments[..., 92:, 88:], tile[1, 1][..., 8:, 8:])
    assert torch.equal(moments[..., 92:, :80], tile[1, 0][..., 8:, :80])
    for k in range(8):  # the overlap of the two left tiles, row by row (no column blend left of column 80)
        row = tile[0, 0][..., 84 + k, :80] * (1 - k / 8) + tile[1, 0][..., k, :80] * (k / 8)
        assert torch.equal(moments[..., 84 + k, :80], row)
    assert float((moments[..., 84:92, 80:88] - tile[0, 0][..., 84:92, 80:88]).abs().max()) > 0  # blended both ways


def test_the_family_is_the_class_default_or_named_and_checked() -> None:
    assert family_for("AutoencoderKLHunyuanVideo", None, "x").name == "hunyuanvideo"
    assert family_for("AutoencoderKLHunyuanVideo", "framepack", "x").name == "framepack"
    assert family_for("AutoencoderKLWan", None, "x").name == "wan"
    assert family_for("RowwiseVae", None, "x") is None  # a plugin: no family, nothing recorded
    rule = FAMILIES["kandinsky5"].rule(__import__("vaecache.models.rules", fromlist=["FrameRule"]).FrameRule(
        4, 8, causal=True, label="AutoencoderKLHunyuanVideo"))
    assert [n for n in range(1, 50) if rule.frames_ok(n)] == [1, 5, 9, 13, 17, 25, 33, 41, 49]
    assert rule.describe().startswith("1 + 4k frames up to 17, then 1 + 8k")


def test_a_cache_from_before_the_reference_was_recorded(hunyuan_vae, long_data, tmp_path, run_cli,
                                                        monkeypatch) -> None:
    """A HunyuanVideo cache of vaecache 0.6 records no model: it was diffusers' default encode, which tiled its
    21-frame clips in time. verify names them (a warning, exit 0), musubi's exports refuse them, a resume is refused
    (other settings), and --reencode loads the encode that made them."""
    from dataclasses import replace

    from diffusers import AutoencoderKLHunyuanVideo

    from vaecache.models.hunyuanvideo import DIFFUSERS_FRAMEWISE

    out = tmp_path / "cache"
    with monkeypatch.context() as patch:  # what 0.6 ran: the module's own encode, diffusers' defaults
        patch.setitem(FAMILIES, "hunyuanvideo", replace(FAMILIES["hunyuanvideo"], reference=DIFFUSERS_FRAMEWISE))
        _encode(run_cli, long_data, out, hunyuan_vae, "--num-frames", "21")
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("model", "reference_encode"):  # and recorded no model
        del manifest["vae"][key]
    (out / "manifest.json").write_text(json.dumps(manifest))
    for part in ("model", "reference_encode"):
        run = json.loads((out / "run.json").read_text())
        del run["fingerprint"]["vae"][part]
        (out / "run.json").write_text(json.dumps(run))
    family, reference = recorded_family(manifest["vae"])
    assert (family.name, reference.name) == ("hunyuanvideo", "diffusers-framewise")
    assert run_cli(["verify", out]).exit_code == 0
    check = next(c for c in verify_cache(out).checks if c.name == "reference encode")
    assert check.failed == 0 and check.note.startswith("warning: 1 clip(s) not encoded as HunyuanVideo's trainers")
    assert "its 21 frames were tiled in time" in check.note
    refused = run_cli(["export", out, "--format", "musubi", "-o", tmp_path / "hv"])
    assert refused.exit_code == 2 and "tiled in time" in refused.output and not (tmp_path / "hv").exists()
    module = AutoencoderKLHunyuanVideo.from_pretrained(hunyuan_vae).eval()
    cache = LatentCache(out)
    with torch.no_grad():
        default = module.encode(cache.source_frames(cache[0].id)).latent_dist.mean
    assert torch.equal(cache[0].mean, default)
    assert run_cli(["verify", out, "--reencode", "1"]).exit_code == 0  # the recorded (legacy) encode, loaded again
    resumed = run_cli(["encode", long_data, "--out", out, "--vae", f"diffusers:{hunyuan_vae}", "--size", "32x32",
                       "--workers", "0", "--no-progress", "--num-frames", "21"])
    assert resumed.exit_code == 2 and "made with other settings" in resumed.output
    assert "reference_encode" in resumed.output


def test_latents_of_the_vaes_own_tiling_are_not_exported(hunyuan_vae, demo_data, tmp_path, run_cli) -> None:
    out = tmp_path / "cache"
    _encode(run_cli, demo_data, out, hunyuan_vae, "--num-frames", "5", "--tiling")
    refused = run_cli(["export", out, "--format", "musubi", "-o", tmp_path / "hv"])
    assert refused.exit_code == 2 and "encoded with the VAE's own tiling (--tiling)" in refused.output
    assert "9 of 9 clips" in refused.output
    assert run_cli(["verify", out]).exit_code == 0
    check = next(c for c in verify_cache(out).checks if c.name == "reference encode")
    assert (check.passed, check.failed) == (0, 0) and check.note.startswith("warning: 9 clip(s) not encoded")


def test_plan_says_which_model_it_encodes_for(hunyuan_vae, demo_data, run_cli) -> None:
    result = run_cli(["plan", demo_data, "--vae", f"diffusers:{hunyuan_vae}", "--num-frames", "5", "--size", "32x32",
                      "--no-measure"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "serves hunyuanvideo, framepack, kandinsky5: encoding for HunyuanVideo" in said
    assert "--model framepack or --model kandinsky5" in said
