"""`vaecache export`: musubi-tuner's latent cache (parsed with musubi-tuner's own naming and key rules),
WebDataset tars (read back by webdataset), safe names for hostile ids, atomicity, determinism; `inspect`."""

from __future__ import annotations

import json
import os
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import webdataset
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from vaecache import LatentCache
from vaecache.export import safe_name
from vaecache.format.table import CLIP_TABLE, write_table
from vaecache.format.writer import tensor_stats

# musubi-tuner's contract (dataset/image_video_dataset.py, dataset/cache_io.py): latent cache files are
# "{item}_{frame_pos:05d}-{frames:03d}_{W:04d}x{H:04d}_{arch}.safetensors"; training splits the name on "_",
# the item is "_".join(tokens[:-3]) and its text-encoder cache "{item}_{arch}_te.safetensors"; the latent is
# stored under "latents_{F}x{H}x{W}_{dtype}" as (C, F, H, W), dtype as torch names it without "torch.".
MUSUBI_FILE = re.compile(r"^(?P<item>.+)_(?P<pos>\d{5})-(?P<count>\d{3})_(?P<w>\d{4})x(?P<h>\d{4})_(?P<arch>[a-z0-9]+)\.safetensors$")
MUSUBI_KEY = re.compile(r"^latents_(?P<f>\d+)x(?P<h>\d+)x(?P<w>\d+)_(?P<dtype>float32|bfloat16|float16)$")


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
        assert meta == {"architecture": "wan", "width": "64", "height": "64", "frame_count": "9", "format_version": "1.0.1"}
        view = ["cam_0", "cam_1"].index(camera)
        assert torch.equal(latent, cache[f"{scene}/000000-000008"].mean[view])  # the posterior mean, (C, F, H, W)
    manifest = json.loads((target / "export.json").read_text())
    assert (manifest["kind"], manifest["files"], manifest["renamed"]) == ("musubi", 6, 0)
    config = tomllib.loads((target / "dataset.toml").read_text())
    assert config["datasets"][0]["cache_directory"] == str(target / "cache")
    assert (config["general"]["resolution"], config["general"]["enable_bucket"]) == ([64, 64], False)
    assert config["datasets"][0]["target_frames"] == [9]


def test_musubi_refuses_two_sizes_its_buckets_would_stack_together(tmp_path: Path) -> None:
    from vaecache.export import ExportError, musubi_buckets

    assert musubi_buckets({(832, 480), (480, 832), (624, 624)}, tmp_path) == {
        (832, 480): (832, 480), (480, 832): (480, 832), (624, 624): (624, 624)}
    with pytest.raises(ExportError, match="sizes 48x32 and 56x40 fall into one musubi-tuner bucket"):
        musubi_buckets({(56, 40), (48, 32)}, tmp_path)
    assert musubi_buckets({(56, 40)}, tmp_path) == {(56, 40): (48, 32)}  # one size: one bucket whatever it is


def test_exports_are_deterministic_and_atomic(good_cache: Path, tmp_path: Path, run_cli,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b"):
        assert run_cli(["export", good_cache, "--format", "webdataset", "--out", tmp_path / name]).exit_code == 0
    assert (tmp_path / "a" / "shard-000000.tar").read_bytes() == (tmp_path / "b" / "shard-000000.tar").read_bytes()
    from vaecache.export import export_musubi
    export_musubi(good_cache, tmp_path / "m1")
    export_musubi(good_cache, tmp_path / "m2")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m1" / "cache").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "m2" / "cache").iterdir()}
    # An existing DIR is refused; a failure half-way leaves neither DIR nor its staging folder.
    result = run_cli(["export", good_cache, "--format", "musubi", "--out", tmp_path / "a"])
    assert result.exit_code == 2 and "already exists" in result.output
    import vaecache.export as export_module
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


def _hostile_copy(cache: Path, tmp_path: Path) -> Path:
    """A copy of `cache` whose records carry hostile scene ids (a hand-edited or foreign clip table)."""
    out = Path(shutil.copytree(cache, tmp_path / "hostile"))
    scenes = ["../../escape", "a/b\nnew line", "nul\x00x"]
    records = list(LatentCache(out).records())
    for record, scene in zip(records, scenes):
        record["scene"], record["id"] = scene, f"{scene}/000000-000008"
    written = write_table(out / "clips.parquet", CLIP_TABLE, sorted(records, key=lambda r: r["id"]))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["clips"]["sha256"] = written.sha256
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_hostile_ids_never_escape_dir(caption_cache: Path, tmp_path: Path) -> None:
    from vaecache.export import export_musubi, export_webdataset

    hostile = _hostile_copy(caption_cache, tmp_path)
    for kind, export in (("musubi", export_musubi), ("webdataset", export_webdataset)):
        target = tmp_path / "exports" / kind
        target.parent.mkdir(exist_ok=True)
        export(hostile, target)
        written = [Path(folder, name) for folder, dirs, names in os.walk(target) for name in names + dirs]
        assert all(Path(os.path.abspath(p)).is_relative_to(target) for p in written)
        entries = [json.loads(line) for line in (target / "index.jsonl").read_text().splitlines()]
        assert len(entries) == (6 if kind == "musubi" else 3) and all(entry.get("renamed") for entry in entries)
        assert {entry["clip"] for entry in entries} == set(LatentCache(hostile).ids())
        names = [entry.get("file", entry.get("key")) for entry in entries]
        assert not any(bad in name for name in names for bad in ("..", "\x00", "\n")) and all("/" not in n.removeprefix("cache/") for n in names)
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["musubi", "webdataset"]
    assert safe_name("scene_000") == "scene_000" and safe_name("a-b") == "a-b"
    assert re.fullmatch(r"a-b~[0-9a-f]{12}", safe_name("a/b")) and safe_name("..") != safe_name("x..y") != "x..y"


def test_webdataset_export_reads_back_with_webdataset(caption_cache: Path, tmp_path: Path, run_cli) -> None:
    target = tmp_path / "wds"
    result = run_cli(["export", caption_cache, "--format", "webdataset", "--out", target, "--samples-per-tar", "2"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((target / "export.json").read_text())
    assert manifest["shards"] == ["shard-000000.tar", "shard-000001.tar"]
    urls = [str(target / name) for name in manifest["shards"]]
    cache = LatentCache(caption_cache)
    samples = list(webdataset.WebDataset(urls, shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == ["scene_000_000000-000008", "scene_001_000000-000008", "scene_002_000000-000008"]
    for sample, item in zip(samples, cache):
        assert sample["json"] == json.loads(json.dumps(item.record))
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
