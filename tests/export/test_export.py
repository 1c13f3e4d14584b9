"""`vaecache export`: musubi-tuner's latent cache (parsed with musubi-tuner's own naming and key rules),
WebDataset tars (read back by webdataset), safe names for hostile ids, atomicity, determinism; `inspect`."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import tomllib
import torch
import webdataset
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file

from vaecache import LatentCache
from vaecache.cache.table import CLIP_TABLE, write_table
from vaecache.cache.writer import tensor_stats
from vaecache.export import safe_name

# musubi-tuner's contract (dataset/image_video_dataset.py, dataset/cache_io.py): latent cache files are
# "{item}_{frame_pos:05d}-{frames:03d}_{W:04d}x{H:04d}_{arch}.safetensors"; training splits the name on "_",
# the item is "_".join(tokens[:-3]) and its text-encoder cache "{item}_{arch}_te.safetensors"; the latent is
# stored under "latents_{F}x{H}x{W}_{dtype}" as (C, F, H, W), dtype as torch names it without "torch.".
MUSUBI_FILE = re.compile(r"^(?P<item>.+)_(?P<pos>\d{5})-(?P<count>\d{3})_(?P<w>\d{4})x(?P<h>\d{4})"
                         r"_(?P<arch>[a-z0-9]+)\.safetensors$")
MUSUBI_KEY = re.compile(r"^latents_(?P<f>\d+)x(?P<h>\d+)x(?P<w>\d+)_(?P<dtype>float32|bfloat16|float16)$")


def musubi_wan_normalized(mean: torch.Tensor, normalization: dict) -> torch.Tensor:
    """What musubi-tuner's Wan caching stores for a posterior mean (C, F, H, W), written from its source (commit
    30c658c): WanVAE.__init__ (wan/modules/vae.py:699-701) holds mean and std as tensors of the VAE's dtype and
    scale = [mean, 1.0 / std]; WanVAE_.encode (:563-564) computes (mu - scale[0].view(1, C, 1, 1, 1)) *
    scale[1].view(1, C, 1, 1, 1); WanVAE.encode (:756) .float(); wan_cache_latents.py:46 .to(vae.dtype)."""
    dtype, channels = mean.dtype, mean.shape[0]
    scale = [torch.tensor(normalization["latents_mean"], dtype=dtype),
             1.0 / torch.tensor(normalization["latents_std"], dtype=dtype)]
    mu = mean.unsqueeze(0)
    return ((mu - scale[0].view(1, channels, 1, 1, 1))
            * scale[1].view(1, channels, 1, 1, 1)).float().squeeze(0).to(dtype)


def test_musubi_export_follows_musubi_tuners_naming_and_keys(caption_cache: Path, tmp_path: Path, run_cli) -> None:
    target = tmp_path / "musubi"
    result = run_cli(["export", caption_cache, "--format", "musubi", "--out", target])
    assert result.exit_code == 0, result.output
    assert "exported 3 clips as musubi" in result.output
    cache = LatentCache(caption_cache)
    videos = {json.loads(line)["video_path"]: json.loads(line)["caption"]
              for line in (target / "videos.jsonl").read_text().splitlines()}
    files = sorted((target / "cache").iterdir())
    assert len(files) == 6  # one per clip and camera
    for path in files:
        match = MUSUBI_FILE.match(path.name)
        assert match and match["arch"] == "wan", path.name
        tokens = path.name.split("_")
        item_key = "_".join(tokens[:-3])  # how musubi-tuner finds the item (and its text-encoder cache)
        scene, camera = item_key.rsplit("-", 1)[0], "cam_" + item_key.rsplit("_", 1)[1]
        video = target / "videos" / f"{item_key}.mp4"
        assert video.is_symlink() and os.readlink(video).endswith(f"{scene}/{camera}.mp4")
        assert videos[str(video)] == cache[f"{scene}/000000-000008"].metadata["caption"]
        assert (match["pos"], match["count"], match["w"], match["h"]) == ("00000", "009", "0064", "0064")
        with safe_open(str(path), "pt") as handle:
            (key,) = handle.keys()
            meta = handle.metadata()
            latent = handle.get_tensor(key)
        found = MUSUBI_KEY.match(key)
        assert found and latent.shape[1:] == (int(found["f"]), int(found["h"]), int(found["w"])) == (3, 8, 8)
        assert found["dtype"] == str(latent.dtype).removeprefix("torch.") == "float32"
        assert meta == {"architecture": "wan", "width": "64", "height": "64", "frame_count": "9",
                        "format_version": "1.0.1"}
        view = ["cam_0", "cam_1"].index(camera)
        mean = cache[f"{scene}/000000-000008"].mean[view]  # the posterior mean, (C, F, H, W)
        # musubi-tuner's Wan caching stores the normalized mean and its trainer does not rescale: bitwise its
        # arithmetic, and the same latent as vaecache's own normalize() up to float rounding (never the raw mean).
        assert torch.equal(latent, musubi_wan_normalized(mean, cache.normalization))
        assert torch.allclose(latent, cache.normalize(mean[None])[0], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(latent, mean, atol=1e-2)
    manifest = json.loads((target / "export.json").read_text())
    assert (manifest["kind"], manifest["files"], manifest["renamed"]) == ("musubi", 6, 0)
    assert manifest["vae_family"] == "AutoencoderKLWan" and "latents_mean" in manifest["convention"]
    config = tomllib.loads((target / "dataset.toml").read_text())
    assert config["datasets"][0]["cache_directory"] == str(target / "cache")
    assert (config["general"]["resolution"], config["general"]["enable_bucket"]) == ([64, 64], False)
    assert config["datasets"][0]["target_frames"] == [9]


def test_musubi_refuses_two_sizes_its_buckets_would_stack_together(tmp_path: Path) -> None:
    from vaecache.errors import ExportError
    from vaecache.export.musubi import musubi_buckets

    assert musubi_buckets({(832, 480), (480, 832), (624, 624)}, tmp_path) == {
        (832, 480): (832, 480), (480, 832): (480, 832), (624, 624): (624, 624)}
    with pytest.raises(ExportError, match="sizes 48x32 and 56x40 fall into one musubi-tuner bucket"):
        musubi_buckets({(56, 40), (48, 32)}, tmp_path)
    assert musubi_buckets({(56, 40)}, tmp_path) == {(56, 40): (48, 32)}  # one size: one bucket whatever it is


def test_exports_are_deterministic_and_atomic(good_cache: Path, tmp_path: Path, run_cli,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b"):
        assert run_cli(["export", good_cache, "--format", "webdataset", "--out", tmp_path / name]).exit_code == 0
    tars = {name: [p.read_bytes() for p in sorted((tmp_path / name).glob("*.tar"))] for name in ("a", "b")}
    assert tars["a"] == tars["b"] and len(tars["a"]) == 1  # one latent shape, 3 clips: one tar
    assert (tmp_path / "a" / "export.json").read_bytes() == (tmp_path / "b" / "export.json").read_bytes()
    from vaecache.export import export_musubi
    export_musubi(good_cache, tmp_path / "m1")
    export_musubi(good_cache, tmp_path / "m2")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m1" / "cache").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "m2" / "cache").iterdir()}
    # An existing DIR is refused; a failure half-way leaves neither DIR nor its staging folder.
    result = run_cli(["export", good_cache, "--format", "musubi", "--out", tmp_path / "a"])
    assert result.exit_code == 2 and "already exists" in result.output
    import vaecache.export.musubi as export_module
    calls = []
    real = export_module.safetensors_bytes
    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)
    monkeypatch.setattr(export_module, "safetensors_bytes", failing)
    result = run_cli(["export", good_cache, "--format", "musubi", "--out", tmp_path / "crash"])
    assert result.exit_code == 1 and "crash: cannot write the export (No space left on device)" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "m1", "m2"]


def _renamed_copy(cache: Path, tmp_path: Path, scenes: list[str]) -> Path:
    """A copy of `cache` whose records carry these scene ids (a hand-edited or foreign clip table)."""
    out = Path(shutil.copytree(cache, tmp_path / "renamed"))
    records = list(LatentCache(out).records())
    for record, scene in zip(records, scenes):
        record["scene"], record["id"] = scene, f"{scene}/000000-000008"
    written = write_table(out / "clips.parquet", CLIP_TABLE, sorted(records, key=lambda r: r["id"]))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["clips"]["sha256"] = written.sha256
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_export_refuses_ids_encode_refuses(caption_cache: Path, tmp_path: Path, run_cli) -> None:
    hostile = _renamed_copy(caption_cache, tmp_path, ["../../escape", "a/b\nnew line", "nul\x00x"])
    (tmp_path / "exports").mkdir()
    for kind in ("musubi", "webdataset"):
        result = run_cli(["export", hostile, "--format", kind, "-o", tmp_path / "exports" / kind])
        assert result.exit_code == 1 and "clips.parquet: clip id '../../escape/000000-000008'" in result.output
    assert list((tmp_path / "exports").iterdir()) == []  # nothing written, no staging folder left


def test_unusual_ids_get_safe_names_that_stay_in_dir(caption_cache: Path, tmp_path: Path) -> None:
    from vaecache.export import export_musubi, export_webdataset

    unusual = _renamed_copy(caption_cache, tmp_path, ["Scène 1.final", "a b", "x..y"])
    for kind, export in (("musubi", export_musubi), ("webdataset", export_webdataset)):
        target = tmp_path / "exports" / kind
        target.parent.mkdir(exist_ok=True)
        export(unusual, target)
        written = [Path(folder, name) for folder, dirs, names in os.walk(target) for name in names + dirs]
        assert all(Path(os.path.abspath(p)).is_relative_to(target) for p in written)
        entries = [json.loads(line) for line in (target / "index.jsonl").read_text().splitlines()]
        assert len(entries) == (6 if kind == "musubi" else 3) and all(entry.get("renamed") for entry in entries)
        assert {entry["clip"] for entry in entries} == set(LatentCache(unusual).ids())
        names = [entry.get("file", entry.get("key")) for entry in entries]
        assert all(re.fullmatch(r"[A-Za-z0-9_.~/-]+", name) and ".." not in name for name in names)
        assert all("/" not in name.removeprefix("cache/") for name in names)  # no folder of its own
    assert safe_name("scene_000") == "scene_000" and safe_name("a-b") == "a-b"
    assert re.fullmatch(r"a-b~[0-9a-f]{12}", safe_name("a/b")) and safe_name("..") != safe_name("x..y") != "x..y"


def test_webdataset_export_reads_back_with_webdataset(caption_cache: Path, tmp_path: Path, run_cli) -> None:
    target = tmp_path / "wds"
    result = run_cli(["export", caption_cache, "--format", "webdataset", "--out", target, "--samples-per-tar", "2"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((target / "export.json").read_text())
    assert manifest["shards"] == ["shard-2x16x3x8x8-000000.tar", "shard-2x16x3x8x8-000001.tar"]
    urls = [str(target / name) for name in manifest["shards"]]
    cache = LatentCache(caption_cache)
    samples = list(webdataset.WebDataset(urls, shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == ["scene_000_000000-000008", "scene_001_000000-000008",
                                               "scene_002_000000-000008"]
    for sample, item in zip(samples, cache):
        assert sample["json"] == {**json.loads(json.dumps(item.record)), "latent_shape": {"logvar": [2, 16, 3, 8, 8],
                                                                                     "mean": [2, 16, 3, 8, 8]}}
        assert sample["json"]["metadata"]["caption"] == item.metadata["caption"]
        tensors = safetensors_load(sample["latents.safetensors"])
        assert sorted(tensors) == ["logvar", "mean"]
        assert all(torch.equal(tensors[key], item.tensors[key]) for key in tensors)


def test_inspect_json_for_a_cache_and_a_clip(caption_cache: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli(["inspect", caption_cache, "--json", tmp_path / "cache.json"])
    assert result.exit_code == 0, result.output
    assert "3 clips, 6 views, 1 shards" in result.output
    info = json.loads((tmp_path / "cache.json").read_text())
    manifest = json.loads((caption_cache / "manifest.json").read_text())
    assert info["vae"]["family"] == "AutoencoderKLWan" and info["vae"]["spec"] == "builtin:tiny"
    assert info["shapes"] == [{"shape": {"logvar": [2, 16, 3, 8, 8], "mean": [2, 16, 3, 8, 8]}, "clips": 3}]
    assert info["counts"]["clips"] == 3 and info["failures"] == {"count": 0, "by_reason": {}}
    assert info["bytes"]["shards"] == sum(s["bytes"] for s in manifest["shards"]) > 0
    assert info["settings"]["num_frames"] == 9 and info["buckets"] is None

    result = run_cli(["inspect", caption_cache, "--clip", "scene_002/000000-000008", "--json", "-"])
    assert result.exit_code == 0, result.output
    clip = json.loads(result.output[result.output.index("{\n"):])
    assert clip["record"]["metadata"]["caption"] == "night\nline two"
    mean = LatentCache(caption_cache)["scene_002/000000-000008"].mean
    assert clip["tensors"]["mean"]["shape"] == [2, 16, 3, 8, 8]
    assert clip["tensors"]["mean"]["stats"] == tensor_stats(mean) == clip["tensors"]["mean"]["recorded_stats"]

    result = run_cli(["inspect", caption_cache, "--clip", "nope"])
    assert result.exit_code == 2 and "no clip 'nope'" in result.output


# --- each musubi architecture in its own caching's convention ---------------------------------------------

HUNYUAN_TINY = dict(block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                    up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=16, layers_per_block=1,
                    norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4)
"""A tiny AutoencoderKLHunyuanVideo with HunyuanVideo's 16 latent channels and its default scaling factor."""


@pytest.fixture(scope="module")
def hunyuan_cache(demo_data: Path, tmp_path_factory: pytest.TempPathFactory, run_cli) -> Path:
    """The demo data encoded with a tiny random HunyuanVideo VAE (5 frames, 32x32). Read-only."""
    from diffusers import AutoencoderKLHunyuanVideo

    root = tmp_path_factory.mktemp("hunyuan")
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(root / "vae")
    out = root / "cache"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", f"diffusers:{root / 'vae'}", "--num-frames", "5",
                      "--size", "32x32", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def kandinsky5_cache(hunyuan_cache: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory,
                     run_cli) -> Path:
    """The demo data encoded for Kandinsky 5 (--model kandinsky5) with hunyuan_cache's VAE. Read-only."""
    out = tmp_path_factory.mktemp("kandinsky5") / "cache"
    result = run_cli(["encode", demo_data, "--out", out, "--vae", f"diffusers:{hunyuan_cache.parent / 'vae'}",
                      "--model", "kandinsky5", "--num-frames", "5", "--size", "32x32", "--workers", "0",
                      "--no-progress"])
    assert result.exit_code == 0, result.output
    return out


def _musubi_files(target: Path) -> dict[str, dict[str, torch.Tensor]]:
    files = {}
    for path in sorted((target / "cache").iterdir()):
        with safe_open(str(path), "pt") as handle:
            files[path.name] = {key: handle.get_tensor(key) for key in handle.keys()}
    return files


def test_musubi_conventions_are_musubis_arithmetic_in_every_dtype(good_cache: Path) -> None:
    """The conventions themselves, from the recorded constants: Wan normalized with the reciprocal taken in the
    stored dtype (bitwise, fp32, bf16 and fp16), HunyuanVideo raw, Kandinsky 5 times the scaling factor."""
    from vaecache.export import MUSUBI_ARCHITECTURES, musubi_tensors

    cache = LatentCache(good_cache)
    mean = cache[0].mean[0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        stored = mean.to(dtype)
        (key, latent), = musubi_tensors(MUSUBI_ARCHITECTURES["wan"], stored, cache.normalization).items()
        assert key == f"latents_3x8x8_{str(dtype)[6:]}" and latent.dtype == dtype
        assert torch.equal(latent, musubi_wan_normalized(stored, cache.normalization)), dtype
    scaled = {"scaling_factor": 0.476986}
    (key, latent), = musubi_tensors(MUSUBI_ARCHITECTURES["hv"], mean.to(torch.float16), scaled).items()
    assert key == "latents_3x8x8_float16" and torch.equal(latent, mean.to(torch.float16))
    k5 = musubi_tensors(MUSUBI_ARCHITECTURES["k5"], mean.to(torch.bfloat16), scaled)
    # kandinsky5_cache_latents.py:70 latents * scaling_factor (a Python float, the tensor's dtype); :76-80 first
    # and last latent frames as the image latent.
    expected = mean.to(torch.bfloat16) * 0.476986
    assert sorted(k5) == ["latents_3x8x8_bfloat16", "latents_image_2x8x8_bfloat16"]
    assert torch.equal(k5["latents_3x8x8_bfloat16"], expected)
    assert torch.equal(k5["latents_image_2x8x8_bfloat16"], torch.cat([expected[:, :1], expected[:, -1:]], dim=1))


def test_musubi_hunyuan_and_kandinsky5_exports(hunyuan_cache: Path, kandinsky5_cache: Path, tmp_path: Path,
                                               run_cli) -> None:
    """hv from a HunyuanVideo cache, k5 from a Kandinsky 5 one (5-frame clips: both encodes are the whole clip, so the
    latents are the same); each architecture refuses the other model's cache, naming the --model that makes it."""
    cache = LatentCache(hunyuan_cache)
    assert LatentCache(kandinsky5_cache).manifest["vae"]["model"] == "kandinsky5"
    assert run_cli(["export", hunyuan_cache, "--format", "musubi", "-o", tmp_path / "hv"]).exit_code == 0
    refused = run_cli(["export", hunyuan_cache, "--format", "musubi", "-o", tmp_path / "no", "--arch", "k5"])
    assert refused.exit_code == 2 and "encoded for HunyuanVideo" in refused.output
    assert "encode it with --model kandinsky5" in refused.output and not (tmp_path / "no").exists()
    refused = run_cli(["export", kandinsky5_cache, "--format", "musubi", "-o", tmp_path / "no", "--arch", "hv"])
    assert refused.exit_code == 2 and "encode it with --model hunyuanvideo" in refused.output
    result = run_cli(["export", kandinsky5_cache, "--format", "musubi", "-o", tmp_path / "k5"])  # k5: the default
    assert result.exit_code == 0, result.output
    assert "kandinsky5 caching stores them: latent * scaling_factor (the mean" in result.output
    hv, k5 = _musubi_files(tmp_path / "hv"), _musubi_files(tmp_path / "k5")
    entries = [json.loads(line) for line in (tmp_path / "hv" / "index.jsonl").read_text().splitlines()]
    assert len(hv) == len(k5) == len(entries) == 18  # 9 clips of 5 frames x 2 cameras
    for entry in entries:
        name = entry["file"].removeprefix("cache/")
        item = cache[entry["clip"]]
        mean = item.mean[item.cameras.index(entry["camera"])]
        assert name.endswith(f"_{item.frames[0]:05d}-005_0032x0032_hv.safetensors")
        assert list(hv[name]) == ["latents_2x8x8_float32"] and torch.equal(hv[name]["latents_2x8x8_float32"], mean)
        scaled = k5[name.replace("_hv.", "_k5.")]
        assert torch.equal(scaled["latents_2x8x8_float32"], mean * 0.476986)
        assert torch.equal(scaled["latents_image_2x8x8_float32"], (mean * 0.476986)[:, [0, -1]])
    manifest = json.loads((tmp_path / "hv" / "export.json").read_text())
    assert manifest["architecture_full"] == "hunyuan_video" and "posterior sample" in manifest["note"]
    assert manifest["tensor"] == "posterior mean, (C, F, H, W)"


def test_musubi_hunyuan_video_1_5_export_is_the_raw_mean_musubi_caches(demo_data: Path, tmp_path: Path,
                                                                      run_cli) -> None:
    """hv15: musubi-tuner's hv_1_5_cache_latents.py stores vae.encode(...)[0].mode() unscaled, keyed
    latents_{F}x{H}x{W}_{dtype}, and its trainer scales by 1.03682: the export is the stored mean itself."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(block_out_channels=(8, 16, 64), layers_per_block=1, latent_channels=32,
                                spatial_compression_ratio=4, temporal_compression_ratio=4,
                                scaling_factor=1.03682).save_pretrained(tmp_path / "vae")
    result = run_cli(["encode", demo_data, "--out", tmp_path / "cache", "--vae", f"diffusers:{tmp_path / 'vae'}",
                      "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    result = run_cli(["export", tmp_path / "cache", "--format", "musubi", "-o", tmp_path / "hv15"])
    assert result.exit_code == 0, result.output
    cache = LatentCache(tmp_path / "cache")
    files = _musubi_files(tmp_path / "hv15")
    index = [json.loads(line) for line in (tmp_path / "hv15" / "index.jsonl").read_text().splitlines()]
    assert files and all(name.endswith("_hv15.safetensors") for name in files)
    for entry in (e for e in index if e["file"] in files):
        item = cache[cache.ids().index(entry["clip"])]
        mean = item.mean[item.cameras.index(entry["camera"])]
        (key, latent), = files[entry["file"]].items()
        assert key == "latents_2x8x8_float32" and torch.equal(latent, mean)
    assert json.loads((tmp_path / "hv15" / "export.json").read_text())["architecture_full"] == "hunyuan_video_1_5"
    edited = tmp_path / "cache" / "manifest.json"
    manifest = json.loads(edited.read_text())
    manifest["vae"]["normalization"]["scaling_factor"] = 1.0
    edited.write_text(json.dumps(manifest))
    result = run_cli(["export", tmp_path / "cache", "--format", "musubi", "-o", tmp_path / "other", "--verify", "none"])
    assert result.exit_code == 2 and "not HunyuanVideo 1.5's 1.03682" in result.output


def test_musubi_refuses_what_it_cannot_export_before_writing(good_cache: Path, hunyuan_cache: Path, tmp_path: Path,
                                                             run_cli) -> None:
    cases = [
        (good_cache, "fp", "--arch fp trains on AutoencoderKLHunyuanVideo latents, this cache holds AutoencoderKLWan"),
        (hunyuan_cache, "fp", "has 5 frames; FramePack with window 9"),
        (good_cache, "qi", "Qwen-Image is an image architecture"),
        (good_cache, "hv15", "--arch hv15 trains on AutoencoderKLHunyuanVideo15 latents, this cache holds "
                             "AutoencoderKLWan"),
        (good_cache, "hv", "--arch hv trains on AutoencoderKLHunyuanVideo latents, this cache holds AutoencoderKLWan"),
        (good_cache, "k5", "--arch k5 trains on AutoencoderKLHunyuanVideo latents"),
        (hunyuan_cache, "wan",
         "--arch wan trains on AutoencoderKLWan latents, this cache holds AutoencoderKLHunyuanVideo"),
        (good_cache, "xx", "--arch 'xx' is not a musubi-tuner architecture"),
    ]
    for cache, arch, reason in cases:
        result = run_cli(["export", cache, "--format", "musubi", "-o", tmp_path / "out", "--arch", arch])
        assert result.exit_code == 2 and reason in result.output, (arch, result.output)
        assert list(tmp_path.iterdir()) == [], arch  # nothing written, not even the staging folder
    # Another normalization than musubi's hard-coded Wan statistics, or other channels: not the VAE musubi expects.
    edited = Path(shutil.copytree(good_cache, tmp_path / "edited"))
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["vae"]["normalization"]["latents_std"][0] = 2.5
    (edited / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli(["export", edited, "--format", "musubi", "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "latents_mean/latents_std other than the Wan 2.1 statistics" in result.output
    from vaecache.errors import ExportError
    from vaecache.export import musubi_arch

    with pytest.raises(ExportError, match="--arch wan needs 16-channel latents, this AutoencoderKLWan cache has 48"):
        musubi_arch(json.loads((good_cache / "manifest.json").read_text())["vae"], 48, None, good_cache)


def test_case_twin_ids_export_to_names_distinct_after_case_folding(demo_data: Path, tmp_path: Path, run_cli) -> None:
    """`Scene` and `scene` (and cameras differing only in case) keep distinct names on a case-insensitive
    filesystem and in musubi's text-encoder cache named after them; each name is a function of the id alone."""
    videos = sorted(demo_data.glob("scene_000/*.mp4"))
    lines = [{"id": scene, "cameras": {"Front": str(videos[0]), "front": str(videos[1])}, "caption": scene}
             for scene in ("Scene", "scene")]
    index = tmp_path / "index.jsonl"
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    encode = run_cli(["encode", index, "--out", tmp_path / "cache", "--vae", "builtin:tiny", "--num-frames", "5",
                      "--size", "32x32", "--workers", "0", "--no-progress"])
    assert encode.exit_code == 0, encode.output
    for kind in ("musubi", "webdataset"):
        assert run_cli(["export", tmp_path / "cache", "--format", kind, "-o", tmp_path / kind]).exit_code == 0
    items = {entry["item"] for entry in map(json.loads, (tmp_path / "musubi" / "index.jsonl").read_text().splitlines())}
    te_caches = {f"{item}_wan_te.safetensors".casefold() for item in items}
    latents = {p.name.casefold() for p in (tmp_path / "musubi" / "cache").iterdir()}
    assert len(items) == len(te_caches) == 4 and len(latents) == 12  # 2 scenes x 2 cameras; 3 clips each
    assert "scene-front" in items  # an already folded name is kept as it is
    assert all(re.fullmatch(r"[Ss]cene-[Ff]ront~[0-9a-f]{12}", item) for item in items - {"scene-front"})
    keys = {entry["key"].casefold()
            for entry in map(json.loads, (tmp_path / "webdataset" / "index.jsonl").read_text().splitlines())}
    assert len(keys) == 6
    assert safe_name("Scene") == safe_name("Scene") != safe_name("scene") == "scene"  # a function of the id alone
    assert safe_name("nul") != "nul" and safe_name("con.mp4", dots=True) != "con.mp4"  # Windows device names


# --- WebDataset and Energon: one latent shape per tar, batches that never mix shapes --------------------------

def test_webdataset_export_of_a_bucketed_cache_batches_single_shapes_under_shuffling(bucket_cache: Path,
                                                                                   tmp_path: Path, run_cli) -> None:
    """Six clips of four latent shapes: each tar holds one shape; a shuffled webdataset pipeline grouped by
    latent_shape, and Megatron-Energon's own loader over the export prepared by Energon's own code, both give
    single-shape batches that together hold every clip once."""
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        WorkerConfig,
        basic_sample_keys,
        get_loader,
        get_train_dataset,
        stateless,
    )

    from vaecache import collate_latents
    from vaecache.export import batched_by_shape, decode_sample

    target = tmp_path / "wds"
    result = run_cli(["export", bucket_cache, "--format", "webdataset", "-o", target, "--samples-per-tar", "1"])
    assert result.exit_code == 0, result.output
    assert "prepared for Megatron-Energon" in result.output
    manifest = json.loads((target / "export.json").read_text())
    cache = LatentCache(bucket_cache)
    clips = set(cache.ids())
    assert manifest["energon"] is True and len(manifest["shards"]) == len(clips) == 6 and len(manifest["shapes"]) == 4
    for name in manifest["shards"]:  # one shape per tar, named in the tar's name and in each sample's JSON
        shapes = {json.dumps(s["json"]["latent_shape"])
                  for s in webdataset.WebDataset(str(target / name), shardshuffle=False).decode()}
        assert shapes == {json.dumps(manifest["shard_shapes"][name])}
        assert name.startswith("shard-" + "x".join(map(str, manifest["shard_shapes"][name]["mean"])))

    urls = [str(target / name) for name in manifest["shards"]]
    for seed in range(3):
        pipeline = (webdataset.WebDataset(urls, shardshuffle=len(urls), seed=seed).shuffle(10, seed=seed)
                    .map(decode_sample).compose(batched_by_shape(2)))
        batches = list(pipeline)
        seen = [clip for batch in batches for clip in (record["id"] for record in batch["record"])]
        assert sorted(seen) == sorted(clips)
        for batch in batches:  # stacked: one shape, that of every record in the batch
            assert len(set(batch["latent_shape"])) == 1
            assert all(r["tensors"]["mean"]["shape"] == list(batch["mean"].shape[1:]) for r in batch["record"])

    @stateless
    def cook(raw: dict) -> dict:
        return {**basic_sample_keys(raw), **decode_sample(raw)}

    class LatentTaskEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        def batch_group_criterion(self, sample: dict) -> tuple:
            return sample["latent_shape"], 2

        def batch(self, samples: list) -> dict:
            return collate_latents(samples)

    dataset = get_train_dataset(target, batch_size=None, shuffle_buffer_size=10, max_samples_per_sequence=None,
                                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                                task_encoder=LatentTaskEncoder(), repeat=False)
    batches = list(get_loader(dataset))
    assert sorted(key for batch in batches for key in batch["__key__"]) == sorted(
        json.loads(line)["key"] for line in (target / "index.jsonl").read_text().splitlines())
    for batch in batches:
        assert len({json.dumps(shape) for shape in batch["latent_shape"]}) == 1  # the loader turns tuples into lists
        assert batch["mean"].shape[0] == len(batch["__key__"])
        assert all(list(batch["mean"].shape[1:]) == r["tensors"]["mean"]["shape"] for r in batch["record"])


def test_a_sample_only_cache_exports_its_sample_where_musubi_caches_a_sample(demo_data: Path, hunyuan_cache: Path,
                                                                             tmp_path: Path, run_cli) -> None:
    """hv and k5 caching draws a posterior sample: a --store sample cache exports its sample, and says so; Wan
    caches the mean, so the same cache cannot serve --arch wan (refused before writing, exit 2)."""
    manifest = json.loads((hunyuan_cache / "manifest.json").read_text())
    sample_cache = tmp_path / "sample"
    result = run_cli(["encode", demo_data, "--out", sample_cache, "--vae", manifest["settings"]["vae_spec"],
                      "--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress", "--store", "sample"])
    assert result.exit_code == 0, result.output
    result = run_cli(["export", sample_cache, "--format", "musubi", "-o", tmp_path / "hv"])
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "hv" / "export.json").read_text())
    assert info["tensor"] == "posterior sample, (C, F, H, W)" and "stores the sample" in info["note"]
    cache = LatentCache(sample_cache)
    for entry in (json.loads(line) for line in (tmp_path / "hv" / "index.jsonl").read_text().splitlines()):
        (tensor,) = load_file(tmp_path / "hv" / entry["file"]).values()
        item = cache[entry["clip"]]
        assert torch.equal(tensor, item["sample"][item.cameras.index(entry["camera"])])  # hv: the raw latent
    wan = tmp_path / "wan-sample"
    assert run_cli(["encode", demo_data, "--out", wan, "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64",
                    "--workers", "0", "--no-progress", "--store", "sample"]).exit_code == 0
    result = run_cli(["export", wan, "--format", "musubi", "-o", tmp_path / "wan"])
    assert result.exit_code == 2 and "stores no posterior mean (sample)" in result.output, result.output
    assert not (tmp_path / "wan").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--format", "musubi", "--energon", "on"], "--energon applies to --format webdataset only"),
    (["--format", "webdataset", "--energon", "maybe"], "--energon must be one of auto, on, off"),
    (["--format", "webdataset", "--arch", "wan"], "--arch applies to --format musubi only"),
    (["--format", "tar"], "--format must be one of musubi, webdataset"),
])
def test_export_option_combinations_are_refused_before_reading(good_cache: Path, tmp_path: Path, run_cli,
                                                                args: list[str], message: str) -> None:
    result = run_cli(["export", good_cache, "-o", tmp_path / "x", *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "x").exists()


def test_each_musubi_key_is_named_by_its_own_tensors_dtype(tmp_path: Path) -> None:
    """musubi names every key by its tensor's dtype: a bf16 HunyuanVideo 1.5 latent's latents_image is float32 (the
    caching builds it in float32) and is named so, not after the latent."""
    from safetensors.torch import load_file

    from vaecache.export.musubi import MUSUBI_ARCHITECTURES, _write_latent_file

    (tmp_path / "cache").mkdir()
    latent = torch.randn(32, 2, 4, 4).to(torch.bfloat16)
    condition = torch.randn(1, 32, 1, 4, 4)
    _write_latent_file(tmp_path, "a.safetensors", MUSUBI_ARCHITECTURES["hv15"], latent, {}, {}, condition, None, 0,
                       5, 4, 0, 0)
    tensors = load_file(tmp_path / "cache" / "a.safetensors")
    assert sorted(tensors) == ["latents_2x4x4_bfloat16", "latents_image_2x4x4_float32"]
    assert tensors["latents_image_2x4x4_float32"].dtype == torch.float32
