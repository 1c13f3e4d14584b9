"""musubi-tuner's FramePack (`--arch fp`): every section of every clip as fpack_cache_latents.py caches it (the
inverted default and --f1), the first frame's SigLIP image_embeddings, the text file from a HunyuanVideo set; clips
whose frame count FramePack would trim refused, named. scripts/check_musubi_export.py runs musubi's own caching."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conditions.tiny_image import build_siglip_folder
from vaecache.export.framepack import framepack_sections
from vaecache.training import LatentCache

SCALING = 0.476986


def musubi_inverted(latent: torch.Tensor, window: int) -> dict[int, dict[str, torch.Tensor]]:
    """fpack_cache_latents.py encode_and_save_batch's default branch (30c658c, lines 104-183), as written there, on
    one camera's scaled latent (C, L, H, W): section index -> the tensors it saves."""
    video_lat = latent[None]
    latent_f = latent.shape[1]
    total = (latent_f - 1) // window
    latent_paddings = list(reversed(range(total)))
    if total > 4:
        latent_paddings = [3] + [2] * (total - 3) + [1, 0]
    history_latents = torch.zeros((1, video_lat.shape[1], 1 + 2 + 16, video_lat.shape[3], video_lat.shape[4]),
                                  dtype=video_lat.dtype)
    latent_f_index, section_index, out = latent_f - window, total - 1, {}
    for latent_padding in latent_paddings:
        is_last_section = section_index == 0
        latent_padding_size = latent_padding * window
        indices = torch.arange(0, sum([1, latent_padding_size, window, 1, 2, 16])).unsqueeze(0)
        pre, _, latent_indices, post, idx_2x, idx_4x = indices.split([1, latent_padding_size, window, 1, 2, 16], dim=1)
        clean_latent_indices = torch.cat([pre, post], dim=1)
        clean_pre = video_lat[:, :, 0:1]
        clean_post, clean_2x, clean_4x = history_latents[:, :, :1 + 2 + 16].split([1, 2, 16], dim=2)
        clean = torch.cat([clean_pre, clean_post], dim=2)
        target = video_lat[:, :, latent_f_index:latent_f_index + window]
        out[section_index] = {"latents": target[0], "latent_indices": latent_indices[0], "latents_clean": clean[0],
                              "clean_latent_indices": clean_latent_indices[0], "latents_clean_2x": clean_2x[0],
                              "clean_latent_2x_indices": idx_2x[0], "latents_clean_4x": clean_4x[0],
                              "clean_latent_4x_indices": idx_4x[0]}
        generated = video_lat[:, :, :window + 1] if is_last_section else target
        history_latents = torch.cat([generated, history_latents], dim=2)
        section_index -= 1
        latent_f_index -= window
    return out


@pytest.mark.parametrize("sections", [1, 2, 5, 6])
def test_inverted_sections_are_musubis(sections):
    torch.manual_seed(sections)
    latent = torch.randn(16, sections * 2 + 1, 4, 6)
    ours = dict(framepack_sections(latent, 2, "inverted"))
    theirs = musubi_inverted(latent, 2)
    assert sorted(ours) == sorted(theirs) == list(range(sections))
    for index, tensors in theirs.items():
        assert ours[index].keys() == tensors.keys()
        for key, tensor in tensors.items():
            assert ours[index][key].dtype == tensor.dtype and torch.equal(ours[index][key], tensor), (index, key)


def test_f1_sections_take_the_frames_before_each_section():
    latent = torch.arange(16 * 7 * 2 * 2, dtype=torch.float32).view(16, 7, 2, 2)
    sections = dict(framepack_sections(latent, 3, "f1"))
    assert sorted(sections) == [0, 1]
    second = sections[1]
    assert torch.equal(second["latents"], latent[:, 4:7])
    assert torch.equal(second["latents_clean"], torch.cat([latent[:, :1], latent[:, 3:4]], dim=1))
    assert torch.equal(second["latents_clean_2x"], latent[:, 1:3]) and not second["latents_clean_4x"][:, :15].any()
    assert second["latent_indices"].tolist() == [20, 21, 22] and second["clean_latent_indices"].tolist() == [0, 19]


@pytest.fixture(scope="module")
def fp_cache(tmp_path_factory, demo_data, run_cli) -> Path:
    from diffusers import AutoencoderKLHunyuanVideo

    from tests.export.test_export import HUNYUAN_TINY

    root = tmp_path_factory.mktemp("fp")
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(**HUNYUAN_TINY).save_pretrained(root / "vae")
    build_siglip_folder(root / "siglip")
    result = run_cli(["encode", demo_data, "--out", root / "cache", "--vae", f"diffusers:{root / 'vae'}",
                      "--num-frames", "13", "--size", "32x32", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output
    return root


def test_the_fp_export_writes_every_section_with_its_image_embeddings(fp_cache, run_cli, tmp_path):
    cache = shutil.copytree(fp_cache / "cache", tmp_path / "cache")
    refused = run_cli(["export", cache, "--format", "musubi", "--arch", "fp", "--fp-latent-window-size", "1",
                       "-o", tmp_path / "no"])
    assert refused.exit_code == 2 and "--condition image-features" in refused.output
    result = run_cli(["embed", cache, "--condition", "image-features", "--image-encoder",
                      f"transformers:{fp_cache / 'siglip'}", "--image-convention", "hunyuanvideo15-musubi"])
    assert result.exit_code == 0, result.output
    wrong = run_cli(["export", cache, "--format", "musubi", "--arch", "fp", "-o", tmp_path / "no"])
    assert wrong.exit_code == 2 and "clip" in wrong.output and "--num-frames 37" in wrong.output
    result = run_cli(["export", cache, "--format", "musubi", "--arch", "fp", "--fp-latent-window-size", "1",
                      "-o", tmp_path / "fp"])
    assert result.exit_code == 0, result.output
    latents = LatentCache(cache)
    features = latents.sets()["conditions"]["image-features"]
    index = [json.loads(line) for line in (tmp_path / "fp" / "index.jsonl").read_text().splitlines()]
    assert len(index) == len(latents) * 2 * 3  # 13 frames: 4 latent frames, 3 sections of 1 per camera
    for entry in index:
        item = latents[entry["clip"]]
        view = item.cameras.index(entry["camera"])
        expected = dict(framepack_sections(item.mean[view] * SCALING, 1, "inverted"))[entry["section"]]
        with safe_open(str(tmp_path / "fp" / entry["file"]), "pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            metadata = handle.metadata()
        frames, height, width = 1, *item.mean.shape[3:]
        assert torch.equal(tensors[f"latents_{frames}x{height}x{width}_float32"], expected["latents"])
        assert torch.equal(tensors[f"latents_clean_{frames}x{height}x{width}_float32"], expected["latents_clean"])
        assert torch.equal(tensors["clean_latent_indices_int64"], expected["clean_latent_indices"])
        assert torch.equal(tensors["image_embeddings_float32"], features.stored(entry["clip"])[view])
        assert metadata["architecture"] == "framepack" and metadata["frame_count"] == "13"
        assert entry["file"].endswith(f"-{entry['section']:04d}_0032x0032_fp.safetensors")
    assert "fp_latent_window_size = 1" in (tmp_path / "fp" / "dataset.toml").read_text()
