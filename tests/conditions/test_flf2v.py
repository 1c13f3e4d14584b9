"""FLF2V's image features: the first and last frames through the CLIP processor and encoder as one two-image batch,
bit for bit diffusers' WanImageToVideoPipeline.encode_image([image, last_image]), per camera; verified."""

from __future__ import annotations

import shutil
import types

import torch

from tests.conditions.tiny_image import build_clip_pipeline_folder
from vaecache.conditions.images import eight_bit_image
from vaecache.training import LatentCache


def test_the_flf2v_pair_is_the_pipelines_two_image_batch(good_cache, run_cli, tmp_path):
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionModel

    clip = build_clip_pipeline_folder(tmp_path / "clip")
    cache = shutil.copytree(good_cache, tmp_path / "cache")
    result = run_cli(["embed", cache, "--condition", "image-features", "--image-encoder", f"diffusers:{clip}",
                      "--image-convention", "wan-flf2v-diffusers"])
    assert result.exit_code == 0, result.output
    pipeline = types.SimpleNamespace(image_processor=CLIPImageProcessor.from_pretrained(clip / "image_processor"),
                                     image_encoder=CLIPVisionModel.from_pretrained(clip / "image_encoder").eval(),
                                     _execution_device=torch.device("cpu"))
    latents = LatentCache(cache)
    for item in latents:
        frames = latents.source_frames(item.id)
        pair = item["condition/image-features"]
        assert pair.shape == (len(item.cameras), 2, 5, 32) and pair.dtype == torch.float32
        for view in range(len(item.cameras)):
            with torch.no_grad():
                expected = WanImageToVideoPipeline.encode_image(
                    pipeline, [eight_bit_image(frames[view, :, 0]), eight_bit_image(frames[view, :, -1])])
            assert torch.equal(pair[view], expected)
    assert run_cli(["verify", cache]).exit_code == 0
    assert run_cli(["verify", cache, "--reencode", "2"]).exit_code == 0
