"""HunyuanVideo 1.5's image-to-video condition: the first frame encoded alone, scaled, at latent frame 0 with a
one-channel mask (bit for bit diffusers' HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask on the
frame the cache says encode saw), and its SigLIP features (diffusers' _get_image_embeds); verified, re-encoded."""

from __future__ import annotations

import types

import pytest
import torch

from tests.conditions.tiny_image import build_siglip_folder
from vaecache.training import LatentCache

ARGS = ("--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress")


@pytest.fixture(scope="module")
def hv15_cache(tmp_path_factory, demo_data, run_cli):
    from diffusers import AutoencoderKLHunyuanVideo15

    from tests.vae.tiny_vaes import FAMILY_CONFIGS

    root = tmp_path_factory.mktemp("hv15-conditions")
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(**{**FAMILY_CONFIGS["hunyuan15"][1], "block_out_channels": (8, 16, 64),
                                   "latent_channels": 32}).save_pretrained(root / "vae")  # musubi's 32 channels
    result = run_cli(["encode", demo_data, "--out", root / "cache", "--vae", f"diffusers:{root / 'vae'}", *ARGS])
    assert result.exit_code == 0, result.output
    return root


class FrameAsProcessed:
    """Stands in for the pipeline's video_processor: `preprocess` returns the frame as encode saw it (the pipeline
    resizes the user's image to the latents' size; the cache's frame is that already)."""

    def __init__(self, frame: torch.Tensor) -> None:
        self.frame = frame

    def preprocess(self, image, height, width):
        return self.frame[None]


def diffusers_hv15_condition(vae, frame: torch.Tensor, latent_frames: int) -> torch.Tensor:
    """diffusers' own prepare_cond_latents_and_mask (unbound, with the attributes it reads) on one camera's first
    frame (3, H, W): cat([latent_condition, latent_mask], dim=1)[0], as the transformer takes it beside the latents."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import (
        HunyuanVideo15ImageToVideoPipeline,
    )

    pipeline = types.SimpleNamespace(vae=vae, video_processor=FrameAsProcessed(frame),
                                     _get_image_latents=HunyuanVideo15ImageToVideoPipeline._get_image_latents)
    channels, height, width = vae.config.latent_channels, frame.shape[1] // 4, frame.shape[2] // 4
    latents = torch.zeros(1, channels, latent_frames, height, width)
    with torch.no_grad():
        condition, mask = HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask(
            pipeline, latents, None, 1, frame.shape[1], frame.shape[2], torch.float32, torch.device("cpu"))
    return torch.cat([condition, mask], dim=1)[0]


def test_the_first_frame_condition_is_the_pipelines_per_camera(hv15_cache, run_cli, tmp_path):
    import shutil

    from diffusers import AutoencoderKLHunyuanVideo15

    cache = shutil.copytree(hv15_cache / "cache", tmp_path / "cache")
    result = run_cli(["embed", cache, "--condition", "first-frame"])
    assert result.exit_code == 0, result.output
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(hv15_cache / "vae").eval()
    latents = LatentCache(cache)
    for item in latents:
        frames = latents.source_frames(item.id)
        condition = item["condition/first-frame"]
        assert condition.shape == (len(item.cameras), 33, *item.mean.shape[2:]) and condition.dtype == torch.float32
        for view in range(len(item.cameras)):
            expected = diffusers_hv15_condition(vae, frames[view, :, 0], item.mean.shape[2])
            assert torch.equal(condition[view], expected)
    assert run_cli(["verify", cache, "--reencode", "2"]).exit_code == 0
    refused = run_cli(["embed", cache, "--condition", "first-last"])
    assert refused.exit_code == 2 and "has no first-last condition" in refused.output


def test_siglip_features_equal_diffusers_get_image_embeds(hv15_cache, run_cli, tmp_path):
    import shutil

    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import (
        HunyuanVideo15ImageToVideoPipeline,
    )
    from PIL import Image
    from transformers import SiglipImageProcessor, SiglipVisionModel

    siglip = build_siglip_folder(tmp_path / "siglip")
    cache = shutil.copytree(hv15_cache / "cache", tmp_path / "cache")
    for convention in ("hunyuanvideo15-diffusers", "hunyuanvideo15-musubi"):
        result = run_cli(["embed", cache, "--condition", "image-features", "--image-encoder",
                          f"transformers:{siglip}", "--image-convention", convention, "--replace"])
        assert result.exit_code == 0, result.output
        model = SiglipVisionModel.from_pretrained(siglip).eval()
        processor = SiglipImageProcessor.from_pretrained(siglip)
        latents = LatentCache(cache)
        for item in latents:
            frames = latents.source_frames(item.id)
            features = item["condition/image-features"]
            for view in range(len(item.cameras)):
                image = Image.fromarray(((frames[view, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
                                        .permute(1, 2, 0).numpy())
                with torch.no_grad():
                    expected = HunyuanVideo15ImageToVideoPipeline._get_image_embeds(model, processor, image, "cpu")[0]
                if convention == "hunyuanvideo15-diffusers":
                    assert features.dtype == torch.float32 and torch.equal(features[view], expected)
                else:  # musubi's siglip_float16: the same features, as musubi stores them
                    assert features.dtype == torch.float16 and torch.equal(features[view], expected.half())
    assert run_cli(["verify", cache]).exit_code == 0


def test_the_musubi_hv15_export_carries_latents_image_and_siglip_as_musubi_caches_them(hv15_cache, run_cli,
                                                                                      tmp_path):
    """hv_1_5_cache_latents.py with --i2v (30c658c, lines 48-84): latents_image is the first frame's raw one-frame
    latent at latent frame 0 of float32 zeros, then a float32 mask channel 1 on latent frame 0; siglip_float16 the
    first frame's SigLIP last_hidden_state. scripts/check_musubi_export.py runs musubi's own function on it."""
    import json
    import shutil

    from safetensors.torch import load_file

    siglip = build_siglip_folder(tmp_path / "siglip")
    cache = shutil.copytree(hv15_cache / "cache", tmp_path / "cache")
    for args in (["--condition", "first-frame"],
                 ["--condition", "image-features", "--image-encoder", f"transformers:{siglip}", "--image-convention",
                  "hunyuanvideo15-musubi"]):
        result = run_cli(["embed", cache, *args])
        assert result.exit_code == 0, result.output
    result = run_cli(["export", cache, "--format", "musubi", "-o", tmp_path / "musubi"])
    assert result.exit_code == 0, result.output
    assert "siglip_<dtype>" in result.output
    latents = LatentCache(cache)
    conditions, features = latents.sets()["conditions"]["first-frame"], latents.sets()["conditions"]["image-features"]
    index = [json.loads(line) for line in (tmp_path / "musubi" / "index.jsonl").read_text().splitlines()]
    for entry in (e for e in index if "file" in e):
        item = latents[entry["clip"]]
        view = item.cameras.index(entry["camera"])
        tensors = load_file(tmp_path / "musubi" / entry["file"])
        frames, height, width = item.mean.shape[2:]
        image = tensors[f"latents_image_{frames}x{height}x{width}_float32"]
        expected = torch.zeros(33, frames, height, width)
        expected[:32, 0:1] = conditions.stored(entry["clip"])[view]
        expected[32, 0] = 1.0
        assert torch.equal(image, expected)
        assert torch.equal(tensors["siglip_float16"], features.stored(entry["clip"])[view])


def test_the_musubi_hv15_export_writes_musubis_text_caches_from_a_musubi_convention_set(hv15_cache, run_cli,
                                                                                       tmp_path):
    """A text set embedded with --text-convention musubi becomes <item>_hv15_te.safetensors as musubi's
    save_text_encoder_output_cache_hunyuan_video_1_5 writes it (varlen_vl_embed_<dtype>, varlen_byt5_embed_<dtype>);
    a set of diffusers' convention is refused for hv15, naming the flag."""
    import json
    import shutil

    from safetensors import safe_open

    from tests.text.tiny_text import build_hunyuan15_text_folder

    text = build_hunyuan15_text_folder(tmp_path / "text")
    cache = shutil.copytree(hv15_cache / "cache", tmp_path / "cache")
    latents = LatentCache(cache)
    scenes = sorted({latents.record(clip)["scene"] for clip in latents.ids()})  # musubi: one caption per item
    captions = {clip: (f'{scene} with a sign reading "STOP"' if scenes.index(scene) % 2 else f"a quiet {scene}")
                for clip in latents.ids() for scene in [latents.record(clip)["scene"]]}
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{text}", "--set", "pipeline", "--captions",
                      tmp_path / "captions.json"])
    assert result.exit_code == 0, result.output
    refused = run_cli(["export", cache, "--format", "musubi", "--text-set", "pipeline", "-o", tmp_path / "no"])
    assert refused.exit_code == 2 and "--text-convention musubi" in refused.output
    result = run_cli(["embed", cache, "--text-encoder", f"diffusers:{text}", "--set", "musubi", "--captions",
                      tmp_path / "captions.json", "--text-convention", "musubi"])
    assert result.exit_code == 0, result.output
    result = run_cli(["export", cache, "--format", "musubi", "--text-set", "musubi", "-o", tmp_path / "musubi"])
    assert result.exit_code == 0, result.output
    texts = LatentCache(cache).sets()["text"]["musubi"]
    index = [json.loads(line) for line in (tmp_path / "musubi" / "index.jsonl").read_text().splitlines()]
    for entry in index:
        path = tmp_path / "musubi" / "cache" / f"{entry['item']}_hv15_te.safetensors"
        with safe_open(str(path), "pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            metadata = handle.metadata()
        assert sorted(tensors) == ["varlen_byt5_embed_float32", "varlen_vl_embed_float32"]
        assert metadata["architecture"] == "hunyuan_video_1_5"
        assert torch.equal(tensors["varlen_vl_embed_float32"], texts.rows(entry["clip"]))
        assert torch.equal(tensors["varlen_byt5_embed_float32"], texts.glyph(entry["clip"]))
        assert metadata["caption1"] == captions[entry["clip"]]
    assert any(texts.glyph(clip).shape[0] for clip in latents.ids())
