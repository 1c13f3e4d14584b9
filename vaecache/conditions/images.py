"""Image-encoder features of a clip's first frame (`--condition image-features`), in a named convention.

SPEC (`--image-encoder`):
  diffusers:PATH          a diffusers pipeline folder: the encoder in PATH/image_encoder, its processor in
                          PATH/image_processor (Wan 2.1 I2V) or PATH/feature_extractor (FramePack)
  transformers:PATH       a transformers vision model folder holding its preprocessor_config.json

Local files only, safetensors weights. Conventions (`--image-convention`), each read from its source:

  wan-diffusers   diffusers WanImageToVideoPipeline.encode_image (pipelines/wan/pipeline_wan_i2v.py, 0.42.1: 241-251):
                  the CLIP image processor (shortest-edge resize, centre crop, rescale, normalize) on the image, then
                  `image_encoder(**image, output_hidden_states=True).hidden_states[-2]`. The pipeline takes the
                  user's image; here it is the clip's first frame as encode saw it, as an 8-bit RGB image
                  (round((x + 1) * 127.5)). Stored as computed (float32 by default).
  wan-musubi      musubi-tuner's Wan I2V caching (wan_cache_latents.py:48-57 and wan/modules/clip.py:537-546, commit
                  30c658c): the [-1, 1] frame squashed to the encoder's image size by `F.interpolate(mode="bicubic",
                  align_corners=False)`, no crop, `* 0.5 + 0.5`, normalized with the processor's mean and std, the
                  output of all blocks but the last (hidden_states[-2]); stored in float16, as musubi stores it.
                  musubi computes it with its own CLIP implementation under fp16 autocast: the same weights give
                  its values to within that rounding, not bit for bit.
  framepack-diffusers  diffusers HunyuanVideoFramepackPipeline.encode_image (pipelines/hunyuan_video/
                  pipeline_hunyuan_video_framepack.py, 0.42.1: 446-453): the [-1, 1] frame (the pipeline's
                  video_processor output, which encode's frame is) mapped to [0, 1], the SigLIP image processor
                  with do_rescale=False, `last_hidden_state`.
  wan-flf2v-diffusers  diffusers WanImageToVideoPipeline.encode_image([image, last_image]) (the FLF2V call,
                  pipeline_wan_i2v.py, 0.42.1: 700-703): the CLIP processor on the first and the last frame as one
                  two-image batch, `hidden_states[-2]`: (2, tokens, hidden) per camera, each camera's pair its own
                  batch as the pipeline's is. Stored as computed (float32).
  hunyuanvideo15-diffusers  diffusers HunyuanVideo15ImageToVideoPipeline._get_image_embeds (pipelines/
                  hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py, 0.42.1: 391-402): the SigLIP image
                  processor (`do_resize=True`, `do_convert_rgb=True`) on the image, `last_hidden_state`; the pipeline
                  takes the user's image, here the clip's first frame as encode saw it as an 8-bit RGB image.
                  Stored as computed (float32).
  hunyuanvideo15-musubi  musubi-tuner's HunyuanVideo 1.5 I2V caching (hv_1_5_cache_latents.py:78-84 and
                  frame_pack/clip_vision.py hf_clip_vision_encode, commit 30c658c): the same processor on the 8-bit
                  frame, `last_hidden_state`, stored in float16 as musubi's `siglip_float16`; musubi computes it in
                  float16, so the same weights give its values to within that rounding, not bit for bit.

The processor's settings and backend (transformers falls back to a PIL processor without torchvision) are part of
the fingerprint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from vaecache.errors import UsageError, VaeSpecError, first_line
from vaecache.weights import WeightsError, load_pretrained, read_json_file

CONVENTIONS = {
    "wan-diffusers": ("clip", "diffusers WanImageToVideoPipeline.encode_image (pipelines/wan/pipeline_wan_i2v.py)"),
    "wan-musubi": ("clip", "musubi-tuner wan_cache_latents.py + wan/modules/clip.py CLIPModel.visual"),
    "wan-flf2v-diffusers": ("clip", "diffusers WanImageToVideoPipeline.encode_image([image, last_image]) "
                                    "(pipelines/wan/pipeline_wan_i2v.py, FLF2V)"),
    "framepack-diffusers": ("siglip", "diffusers HunyuanVideoFramepackPipeline.encode_image "
                                      "(pipelines/hunyuan_video/pipeline_hunyuan_video_framepack.py)"),
    "hunyuanvideo15-diffusers": ("siglip", "diffusers HunyuanVideo15ImageToVideoPipeline._get_image_embeds "
                                           "(pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py)"),
    "hunyuanvideo15-musubi": ("siglip", "musubi-tuner hv_1_5_cache_latents.py + frame_pack/clip_vision.py "
                                        "hf_clip_vision_encode"),
}
LAST_HIDDEN_STATE = ("framepack-diffusers", "hunyuanvideo15-diffusers", "hunyuanvideo15-musubi")
"""The conventions whose features are the encoder's last_hidden_state (the others: hidden_states[-2])."""
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")


def check_image_options(spec: str | None, convention: str | None) -> None:
    if not spec:
        raise UsageError("--condition image-features needs --image-encoder SPEC (diffusers:PATH | transformers:PATH)")
    if not (spec.startswith("diffusers:") or spec.startswith("transformers:")):
        raise UsageError(f"--image-encoder must be diffusers:PATH or transformers:PATH (local files), got {spec!r}")
    if convention not in CONVENTIONS:
        raise UsageError(f"--image-convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")


class ImageEncoder:
    """A loaded image encoder and its convention: `features(frames)` gives each view's first-frame features."""

    def __init__(self, spec: str, convention: str, device: torch.device | str = "cpu") -> None:
        check_image_options(spec, convention)
        import transformers

        self.spec, self.convention, self.device = spec, convention, torch.device(device)
        model_dir, processor_dir = image_encoder_folders(spec, convention)
        family = CONVENTIONS[convention][0]
        weights = sorted(model_dir.glob("*.safetensors"))
        model_class = transformers.CLIPVisionModel if family == "clip" else transformers.SiglipVisionModel
        self.model = load_pretrained(model_class, model_dir, use_safetensors=True,
                                     torch_dtype=torch.float32).to(self.device).eval()
        self.processor = load_processor(processor_dir)
        digest = hashlib.sha256()
        for path in weights:
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
        self._identity = {
            "class": type(self.model).__name__,
            "config": {k: v for k, v in self.model.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS},
            "weights_sha256": digest.hexdigest(), "transformers": transformers.__version__,
            "processor": {k: v for k, v in self.processor.to_dict().items() if k not in VOLATILE_CONFIG_KEYS},
            "processor_backend": type(self.processor).__name__,
        }

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.float16 if self.convention in ("wan-musubi", "hunyuanvideo15-musubi") else torch.float32

    def view_shape(self) -> list[int]:
        """(tokens, hidden) of one view's features; (2, tokens, hidden) for the FLF2V pair."""
        config = self.model.config
        patches = (int(config.image_size) // int(config.patch_size)) ** 2
        shape = [patches + (1 if CONVENTIONS[self.convention][0] == "clip" else 0), int(config.hidden_size)]
        return [2, *shape] if self.convention == "wan-flf2v-diffusers" else shape

    def fingerprint(self) -> dict[str, Any]:
        return {**self._identity, "convention": self.convention, "reference": CONVENTIONS[self.convention][1],
                "layer": "last_hidden_state" if self.convention in LAST_HIDDEN_STATE else "hidden_states[-2]",
                "compute_dtype": "float32", "stored_dtype": str(self.stored_dtype).removeprefix("torch."),
                "frame": "first and last" if self.convention == "wan-flf2v-diffusers" else "first",
                "view_shape": self.view_shape()}

    @torch.no_grad()
    def features(self, frames: torch.Tensor) -> torch.Tensor:
        """(views, 3, T, H, W) frames in [-1, 1] as encode saw them -> (views, tokens, hidden) of the first frame
        ((views, 2, tokens, hidden) of the first and last frames for the FLF2V convention)."""
        first = frames[:, :, 0]
        if self.convention == "wan-flf2v-diffusers":
            pairs = []
            for view in range(frames.shape[0]):  # each camera's pair its own two-image batch, as the pipeline's
                images = [eight_bit_image(frames[view, :, index]) for index in (0, -1)]
                pixels = self.processor(images=images, return_tensors="pt").to(self.device)
                pairs.append(self.model(**pixels, output_hidden_states=True).hidden_states[-2])
            return torch.stack(pairs).to(self.stored_dtype).cpu().contiguous()
        if self.convention in ("wan-diffusers", "hunyuanvideo15-diffusers", "hunyuanvideo15-musubi"):
            images = [eight_bit_image(view) for view in first]
            if self.convention == "wan-diffusers":
                pixels = self.processor(images=images, return_tensors="pt").to(self.device)
                out = self.model(**pixels, output_hidden_states=True).hidden_states[-2]
            else:
                pixels = self.processor.preprocess(images=images, do_resize=True, return_tensors="pt",
                                                   do_convert_rgb=True).to(self.device)
                out = self.model(**pixels).last_hidden_state
        elif self.convention == "wan-musubi":
            size = (int(self.model.config.image_size),) * 2
            x = torch.nn.functional.interpolate(first.to(self.device), size=size, mode="bicubic", align_corners=False)
            x = x.mul_(0.5).add_(0.5)
            mean = torch.tensor(self.processor.image_mean, device=self.device).view(1, 3, 1, 1)
            std = torch.tensor(self.processor.image_std, device=self.device).view(1, 3, 1, 1)
            out = self.model(pixel_values=(x - mean) / std, output_hidden_states=True).hidden_states[-2]
        else:
            image = (first + 1) / 2.0
            pixels = self.processor(images=image, return_tensors="pt", do_rescale=False).to(device=self.device)
            out = self.model(**pixels).last_hidden_state
        return out.to(self.stored_dtype).cpu().contiguous()


def eight_bit_image(frame: torch.Tensor) -> Any:
    """A (3, H, W) frame in [-1, 1] as the 8-bit RGB PIL image a pipeline takes: round((x + 1) * 127.5)."""
    from PIL import Image

    return Image.fromarray(((frame + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())


def image_encoder_folders(spec: str, convention: str) -> tuple[Path, Path]:
    """The model and processor folders of an --image-encoder SPEC, checked without loading anything (encode checks
    them before any video is read): present, a config of the convention's model type, safetensors weights."""
    check_image_options(spec, convention)
    model_dir, processor_dir = _folders(spec)
    config = read_json_file(model_dir / "config.json", "the image encoder's config")
    read_json_file(processor_dir / "preprocessor_config.json", "the image processor's settings")
    if not isinstance(config, dict):
        raise VaeSpecError(f"{model_dir / 'config.json'}: the image encoder's config is not a JSON object")
    family = CONVENTIONS[convention][0]
    model_type = str(config.get("model_type", ""))
    if not model_type.startswith(family):
        wanted = "CLIP" if family == "clip" else "SigLIP"
        raise VaeSpecError(f"{model_dir}: --image-convention {convention} needs a {wanted} vision model, this is "
                           f"{model_type or 'unknown'}")
    if not any(model_dir.glob("*.safetensors")):
        raise VaeSpecError(f"{model_dir}: no .safetensors weights (pickled weights are not loaded)")
    return model_dir, processor_dir


def load_processor(folder: Path) -> Any:
    """The image processor of `folder` (its preprocessor_config.json checked first): a WeightsError naming the file
    when transformers cannot build one from it."""
    import transformers

    settings = folder / "preprocessor_config.json"
    read_json_file(settings, "the image processor's settings")
    try:
        return transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001  # transformers raises many kinds for settings it cannot use
        raise WeightsError(f"{settings}: not an image processor's settings transformers can use "
                           f"({first_line(exc, 200)})") from None


def _folders(spec: str) -> tuple[Path, Path]:
    kind, _, location = spec.partition(":")
    root = Path(location).expanduser()
    if not root.is_dir():
        if "/" in location and not location.startswith((".", "/", "~")) and location.count("/") == 1:
            raise VaeSpecError(f"--image-encoder {spec}: {location} is not a local folder (a Hub id? download it "
                               f"first: hf download {location} --local-dir ./{location.split('/')[1]})")
        raise VaeSpecError(f"--image-encoder {spec}: {root} is not a folder")
    if kind == "transformers":
        if not (root / "preprocessor_config.json").is_file():
            raise VaeSpecError(f"{root}: no preprocessor_config.json beside the model (the image processor)")
        return root, root
    model = root / "image_encoder"
    processor = next((root / name for name in ("image_processor", "feature_extractor") if (root / name).is_dir()),
                     None)
    if not (model / "config.json").is_file() or processor is None:
        raise VaeSpecError(f"{root}: a diffusers pipeline folder with image_encoder/ and image_processor/ (or "
                           "feature_extractor/) is expected")
    return model, processor


__all__ = ["CONVENTIONS", "ImageEncoder", "check_image_options", "image_encoder_folders"]
