"""Tiny image encoders with random weights, saved as the folders --image-encoder loads: a CLIP vision tower with its
CLIPImageProcessor in a diffusers pipeline folder (Wan 2.1 I2V's layout: image_encoder/, image_processor/), and a
SigLIP vision tower with its SiglipImageProcessor in one transformers folder (FramePack's encoder)."""

from __future__ import annotations

from pathlib import Path

import torch

# ViT-H/14's shapes scaled down (hidden 1280 -> 32, 32 layers -> 3, 224 px -> 28 px at patch 14: 4 + 1 tokens)
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
                   patch_size=14, projection_dim=16)
SIGLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                     patch_size=14)


def build_clip_pipeline_folder(root: Path, seed: int = 0) -> Path:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    CLIPVisionModel(CLIPVisionConfig(**CLIP_VISION)).save_pretrained(root / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(
        root / "image_processor")
    return root


def build_siglip_folder(root: Path, seed: int = 0) -> Path:
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    SiglipVisionModel(SiglipVisionConfig(**SIGLIP_VISION)).save_pretrained(root)
    SiglipImageProcessor(size={"height": 28, "width": 28}).save_pretrained(root)
    return root
