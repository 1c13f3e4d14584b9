"""Check a `vaecache export --format musubi` with musubi-tuner's own code, from a checkout you point at.

    python scripts/check_musubi_export.py --musubi-src path/to/musubi-tuner EXPORT [--json FILE]

musubi-tuner is not on the package index and none of its code is copied into vaecache, so this script imports
its modules from CHECKOUT/src (an environment where musubi-tuner's own requirements are installed) and:

1. for every exported latent file, runs musubi's own caching function for the export's architecture (for a Wan
   export with I2V latents_image, with i2v on and the condition video's mean as its VAE's second answer; for an hv15
   one with latents_image and siglip, with i2v on, the first frame's one-frame mean as its VAE's second answer and
   the image-features set's features as what its SigLIP returned)
   (`wan_cache_latents.encode_and_save_batch`, `cache_latents.encode_and_save_batch` for hv,
   `kandinsky5_cache_latents.encode_and_save_batch`, `hv_1_5_cache_latents.encode_and_save_batch` for hv15)
   with a stand-in VAE that returns vaecache's posterior mean
   of that clip and camera (for Wan: musubi's real `WanVAE`, whose encoder is replaced, so its normalization,
   reciprocal and dtypes run as written), and compares the file musubi writes with the exported one: every
   tensor bitwise (`torch.equal`), every metadata field;
2. writes text-encoder caches with musubi's own `save_text_encoder_output_cache_*` for the items its own
   text-encoder caching enumerates from the export's `videos.jsonl` (random embeddings: only the pairing is
   under test), in a scratch copy of the export's cache folder (the export is not modified);
3. runs musubi's training data path over it: `BlueprintGenerator` -> `VideoDataset.prepare_for_training` ->
   `BucketBatchManager`, and checks every row of every batch against what step 1's musubi caching stored;
4. with `--text-encoder FOLDER` (what `vaecache embed` read): musubi's own Wan text-encoder caching
   (`wan_cache_text_encoder_outputs.encode_and_save_batch`) on the same UMT5 weights, converted to Wan's names and
   loaded into a `T5Encoder` of the same config, with a `HuggingfaceTokenizer` of the same tokenizer files, for
   every exported `<item>_wan_te.safetensors`, compared within `--text-tolerance`; for hv15, its
   `hv_1_5_cache_text_encoder_outputs.encode_and_save_batch` with the folder's Qwen2.5-VL and ByT5 injected, for
   every `<item>_hv15_te.safetensors`.

It prints a table and JSON (`--json FILE`) and exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vaecache import LatentCache  # noqa: E402
from vaecache.cache.layout import inside  # noqa: E402

ARCH_SCRIPTS = {"wan": "musubi_tuner.wan_cache_latents", "hv": "musubi_tuner.cache_latents",
                "hv15": "musubi_tuner.hv_1_5_cache_latents", "fp": "musubi_tuner.fpack_cache_latents",
                "k5": "musubi_tuner.kandinsky5_cache_latents"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="A folder written by vaecache export --format musubi.")
    parser.add_argument("--musubi-src", type=Path, required=True,
                        help="A musubi-tuner checkout (its src/ is imported).")
    parser.add_argument("--cache", type=Path, help="The vaecache cache exported (default: export.json's source).")
    parser.add_argument("--json", type=Path, help="Also write the result as JSON here ('-': stdout).")
    parser.add_argument("--batch-size", type=int, default=2, help="musubi's training batch size for step 3.")
    parser.add_argument("--text-encoder", type=Path, help="Step 4: the diffusers folder `vaecache embed` read (its "
                        "text_encoder/ UMT5 and tokenizer/): the export's Wan text caches against musubi's own T5 "
                        "caching on the same weights.")
    parser.add_argument("--text-tolerance", type=float, default=1e-5,
                        help="Step 4: max |difference| / max |value| allowed (musubi's attention is an einsum, "
                             "transformers' a matmul: the same arithmetic in another order).")
    return parser.parse_args(argv)


def musubi_commit(checkout: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class _Moments(torch.nn.Module):
    """Stands in for musubi's Wan encoder: for each WanVAE_.encode in turn (the clip, then with I2V its condition
    video) returns that video's posterior moments on the first frame chunk (WanVAE_.encode feeds 1 frame, then 4 at a
    time) and nothing on the later chunks, so WanVAE_.encode's chunk loop concatenates exactly these."""

    def __init__(self, moments: list[torch.Tensor]) -> None:
        super().__init__()
        self.moments = list(moments)

    def forward(self, x: torch.Tensor, feat_cache: Any = None, feat_idx: Any = None) -> torch.Tensor:
        if x.shape[2] == 1:
            self.current = self.moments.pop(0)
            return self.current
        return self.current[:, :, :0]


def _wan_vae(vae_module: Any, mean: torch.Tensor, condition: torch.Tensor | None = None) -> Any:
    """musubi's own WanVAE (its __init__: constants, reciprocal, dtype) around a WanVAE_ whose encoder returns
    `mean` (and a zero log-variance), then `condition` (the I2V condition video's mean), and whose conv1 is the
    identity: WanVAE_.encode then normalizes them as written."""
    dtype = mean.dtype
    model = vae_module.WanVAE_(dim=4, z_dim=mean.shape[0], dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                               temperal_downsample=[False, True, True], dropout=0.0)
    model.encoder = _Moments([torch.cat([m, torch.zeros_like(m)]).unsqueeze(0)
                              for m in ([mean] if condition is None else [mean, condition.to(dtype)])])
    model.conv1 = torch.nn.Identity()
    real = vae_module._video_vae
    vae_module._video_vae = lambda **kwargs: model
    try:
        return vae_module.WanVAE(z_dim=mean.shape[0], vae_path="<vaecache mean>", dtype=dtype,
                                 device=torch.device("cpu"))
    finally:
        vae_module._video_vae = real


def _sampling_vae(mean: torch.Tensor, scaling_factor: float | None) -> Any:
    """A stand-in for the diffusers-style VAE musubi's HunyuanVideo and Kandinsky 5 caching call: encode() gives a
    posterior whose sample() is vaecache's mean (the export stores the mean where musubi would draw a sample)."""
    posterior = types.SimpleNamespace(sample=lambda: mean.unsqueeze(0))
    vae = types.SimpleNamespace(device=torch.device("cpu"), dtype=mean.dtype,
                                config=types.SimpleNamespace(scaling_factor=scaling_factor),
                                encode=lambda contents: types.SimpleNamespace(latent_dist=posterior))
    return vae


def musubi_cached(arch: str, modules: dict[str, Any], mean: torch.Tensor, item: Any,
                  normalization: dict[str, Any], condition: torch.Tensor | None = None,
                  features: torch.Tensor | None = None, fp_mode: str = "inverted") -> None:
    """Run musubi's own caching of `item` for `arch` with vaecache's mean as what its VAE returned (and, for Wan
    I2V, the condition video's mean as what it returned for that, and the first frame's CLIP features as what its
    CLIPModel.visual returned)."""
    script = modules[arch]
    if arch == "wan":
        vae = _wan_vae(modules["wan_vae"], mean, condition)
        clip = None if features is None else types.SimpleNamespace(device=torch.device("cpu"),
                                                                   visual=lambda images: features.unsqueeze(0))
        script.encode_and_save_batch(vae, clip, condition is not None, [item])
    elif arch == "hv":
        script.encode_and_save_batch(_sampling_vae(mean, None), [item])
    elif arch == "k5":
        script.encode_and_save_batch(_sampling_vae(mean, float(normalization["scaling_factor"])), [item])
    elif arch == "fp":
        # fpack_cache_latents.py encode_and_save_batch: hunyuan.vae_encode (the VAE's sample times its scaling factor;
        # vaecache's mean answers) and hf_clip_vision_encode (the image-features set's features answer); every section
        posterior = types.SimpleNamespace(sample=lambda: mean.unsqueeze(0))
        vae = types.SimpleNamespace(device=torch.device("cpu"), dtype=mean.dtype,
                                    config=types.SimpleNamespace(scaling_factor=float(normalization["scaling_factor"])),
                                    encode=lambda contents: types.SimpleNamespace(latent_dist=posterior))

        def image_encoder(**inputs: Any) -> Any:
            return types.SimpleNamespace(last_hidden_state=features.unsqueeze(0))

        image_encoder.device, image_encoder.dtype = torch.device("cpu"), features.dtype  # type: ignore[attr-defined]
        processed = types.SimpleNamespace(to=lambda **kwargs: {})
        extractor = types.SimpleNamespace(preprocess=lambda images, return_tensors: processed)
        script.encode_and_save_batch(vae, extractor, image_encoder, [item], vanilla_sampling=fp_mode == "f1")
    elif arch == "hv15":
        # hv_1_5_cache_latents.py:41-44: latent = vae.encode(content)[0].mode(), under autocast to the VAE's dtype;
        # with i2v (48-84) it encodes the first frame alone next (the condition set's one-frame mean), and its SigLIP
        # image encoder gives the first frame's last_hidden_state (the image-features set's)
        answers = iter([mean] + ([condition] if condition is not None else []))
        vae = types.SimpleNamespace(device=torch.device("cpu"), dtype=mean.dtype, encode=lambda contents: (
            types.SimpleNamespace(mode=lambda answer=next(answers): answer.unsqueeze(0)),))
        assets = None
        if features is not None:  # frame_pack/clip_vision.py hf_clip_vision_encode calls these two
            def image_encoder(**inputs: Any) -> Any:
                return types.SimpleNamespace(last_hidden_state=features.unsqueeze(0))

            image_encoder.device, image_encoder.dtype = torch.device("cpu"), features.dtype  # type: ignore[attr-defined]
            processed = types.SimpleNamespace(to=lambda **kwargs: {})
            assets = (types.SimpleNamespace(preprocess=lambda images, return_tensors: processed), image_encoder)
        script.encode_and_save_batch(vae, assets, [item], i2v=condition is not None)
    else:
        raise SystemExit(f"architecture {arch!r} is not one vaecache exports")


def batch_key(key: str) -> str:
    """The key musubi's BucketBatchManager gives a cached tensor in a batch (dataset/bucket.py: the dtype suffix
    removed, and a latent's FxHxW)."""
    key = key.rsplit("_", 1)[0]
    return key.rsplit("_", 1)[0] if key.startswith("latents_") else key


def load_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, dict(handle.metadata() or {})


def write_text_encoder_caches(arch: str, dataset: Any, cache_io: Any) -> int:
    """musubi's own text-encoder cache writers for the items its own TE caching enumerates (captions only)."""
    generator = torch.Generator().manual_seed(0)
    written = 0
    for batch in dataset.retrieve_text_encoder_output_cache_batches(1):
        for item in batch:
            if arch == "wan":
                cache_io.save_text_encoder_output_cache_wan(item, torch.randn(7, 16, generator=generator).bfloat16())
            elif arch == "hv15":
                cache_io.save_text_encoder_output_cache_hunyuan_video_1_5(
                    item, torch.randn(9, 16, generator=generator).bfloat16(),
                    torch.randn(5, 16, generator=generator).bfloat16())
            elif arch == "hv":
                cache_io.save_text_encoder_output_cache(item, torch.randn(8, 16, generator=generator).half(),
                                                        torch.ones(8, dtype=torch.bool), True)
                cache_io.save_text_encoder_output_cache(item, torch.randn(16, generator=generator).half(), None, False)
            else:
                cache_io.save_text_encoder_output_cache_kandinsky5(
                    item, torch.randn(8, 16, generator=generator).bfloat16(),
                    torch.randn(16, generator=generator).bfloat16(), torch.ones(8, dtype=torch.bool))
            written += 1
    return written


def check(args: argparse.Namespace) -> dict[str, Any]:
    export = args.export.resolve()
    sys.path.insert(0, str(args.musubi_src.resolve() / "src"))
    from musubi_tuner.dataset import cache_io, config_utils
    from musubi_tuner.dataset.config_utils import BlueprintGenerator, ConfigSanitizer
    from musubi_tuner.dataset.image_video_dataset import ItemInfo

    info = json.loads((export / "export.json").read_text())
    if info.get("kind") != "musubi":
        raise SystemExit(f"{export}: not a musubi export (export.json kind {info.get('kind')!r})")
    arch = info["architecture"]
    import importlib

    if not torch.cuda.is_available():
        # musubi's wan/modules/t5.py evaluates torch.cuda.current_device() in a default argument at import time;
        # on a machine without a GPU that raises. Nothing here runs on CUDA: answer device 0 for the import.
        torch.cuda.current_device = lambda: 0
    try:
        import torchvision.transforms  # noqa: F401
    except (ImportError, RuntimeError):
        # musubi's wan/modules/clip.py imports torchvision.transforms at import time and uses it only to build a CLIP
        # model's preprocessing (CLIPModel.__init__), which this check never runs: a placeholder lets it import
        # where torchvision is absent (or built for another torch). transformers, which musubi imports too, looks for
        # torchvision first: they are imported before the placeholder exists.
        import diffusers  # noqa: F401
        import transformers  # noqa: F401

        placeholder = types.ModuleType("torchvision")
        placeholder.transforms = types.ModuleType("torchvision.transforms")  # type: ignore[attr-defined]
        # kandinsky5/models/text_embedders.py imports torchvision.transforms.functional, for image edits only
        placeholder.transforms.functional = types.ModuleType("torchvision.transforms.functional")  # type: ignore
        sys.modules.update({"torchvision": placeholder, "torchvision.transforms": placeholder.transforms,
                            "torchvision.transforms.functional": placeholder.transforms.functional})
    modules = {arch: importlib.import_module(ARCH_SCRIPTS[arch])}
    if arch == "wan":
        modules["wan_vae"] = importlib.import_module("musubi_tuner.wan.modules.vae")
    cache = LatentCache(args.cache or info["source"]["cache"])
    normalization = (cache.manifest.get("vae") or {}).get("normalization") or {}
    result: dict[str, Any] = {"export": str(export), "architecture": arch,
                              "musubi_commit": musubi_commit(args.musubi_src),
                              "files": 0, "files_equal": 0, "batches": 0, "rows": 0, "rows_equal": 0, "problems": []}
    problems = result["problems"]

    with tempfile.TemporaryDirectory(prefix="vaecache-musubi-check-") as scratch_name:
        scratch = Path(scratch_name)
        expected_dir, cache_dir = scratch / "musubi-cached", scratch / "cache"
        expected_dir.mkdir()
        cache_dir.mkdir()
        expected: dict[str, dict[str, torch.Tensor]] = {}
        # 1. musubi's own caching of each exported file's latent, compared with the export
        stored_key = info["tensor"].split()[1].rstrip(",")  # "posterior mean, (C, F, H, W)" (or sample: hv, k5)
        item_clip = None
        for line in (export / "index.jsonl").read_text().splitlines():
            entry = json.loads(line)
            exported_path = inside(export, entry["file"], f"{export}/index.jsonl")
            name = exported_path.name
            if item_clip is None or item_clip.id != entry["clip"]:  # a clip's cameras are consecutive lines
                item_clip = cache[entry["clip"]]
            view = item_clip.cameras.index(entry["camera"])
            latent = item_clip.tensors[stored_key][view]
            condition = (cache.condition(entry["clip"], info["condition_set"], normalized=False)[view]
                         if info.get("condition_set") else None)
            features = (cache.condition(entry["clip"], "image-features", normalized=False)[view]
                        if info.get("image_features") or arch == "fp" else None)
            tensors, metadata = load_file(exported_path)
            width, height = int(metadata["width"]), int(metadata["height"])
            frames = int(metadata["frame_count"])
            base = name if "section" not in entry else \
                name.replace(f"-{entry['section']:04d}_", "_", 1)  # musubi appends the section itself
            item = ItemInfo(entry["item"], "", (width, height), (width, height, frames), frame_count=frames,
                            content=np.zeros((frames, height, width, 3), dtype=np.uint8),
                            latent_cache_path=str(expected_dir / base))
            item.fp_latent_window_size = int(info.get("fp_latent_window_size") or 9)
            if not (expected_dir / name).exists():  # an fp clip's sections are written by one call
                musubi_cached(arch, modules, latent, item, normalization, condition, features,
                              str(info.get("fp_mode") or "inverted"))
            theirs, their_metadata = load_file(expected_dir / name)
            expected[name] = theirs
            result["files"] += 1
            same = sorted(theirs) == sorted(tensors) and all(
                theirs[k].dtype == tensors[k].dtype and torch.equal(theirs[k], tensors[k]) for k in theirs)
            if not same:
                worst = {k: float((theirs[k].float() - tensors[k].float()).abs().max()) for k in theirs if k in tensors}
                problems.append(f"{name}: tensors differ from musubi's own caching (keys {sorted(theirs)} vs "
                                f"{sorted(tensors)}; max abs difference {worst})")
            elif their_metadata != metadata:
                problems.append(f"{name}: metadata {metadata} differs from musubi's {their_metadata}")
            else:
                result["files_equal"] += 1
            os.symlink(exported_path, cache_dir / name)

        # 2. text-encoder caches by musubi's own writers, for the items its TE caching reads from videos.jsonl
        user_config = config_utils.load_user_config(str(export / "dataset.toml"))
        for dataset_config in user_config.get("datasets", []):  # this export's files, wherever it was written
            dataset_config.update(video_jsonl_file=str(export / "videos.jsonl"), cache_directory=str(cache_dir))
        namespace = argparse.Namespace(debug_dataset=False)
        blueprint = BlueprintGenerator(ConfigSanitizer()).generate(user_config, namespace, architecture=arch)
        caching = config_utils.generate_dataset_group_by_blueprint(blueprint.dataset_group)
        result["text_encoder_caches"] = sum(write_text_encoder_caches(arch, dataset, cache_io)
                                            for dataset in caching.datasets)

        # 3. musubi's training data path over the export: every batch row against musubi's own cached latent
        training = config_utils.generate_dataset_group_by_blueprint(blueprint.dataset_group, training=True)
        for dataset in training.datasets:
            dataset.batch_size = args.batch_size
            dataset.prepare_for_training()
            manager = dataset.batch_manager
            for index in range(len(manager)):
                batch = manager[index]
                reso, batch_index = manager.bucket_batch_indices[index]
                start = batch_index * manager.batch_size
                items = manager.buckets[reso][start:start + manager.batch_size]
                result["batches"] += 1
                for row, item in enumerate(items):
                    result["rows"] += 1
                    theirs = expected[Path(item.latent_cache_path).name]
                    wanted = {batch_key(key): value for key, value in theirs.items()}
                    mismatched = [key for key, value in wanted.items()
                                  if key not in batch or not torch.equal(batch[key][row], value)]
                    if mismatched:
                        problems.append(f"batch {index} row {row} ({Path(item.latent_cache_path).name}): "
                                        f"{', '.join(mismatched)} differ from musubi's own caching")
                    else:
                        result["rows_equal"] += 1
        if result["rows"] != result["files"]:
            problems.append(f"musubi's training saw {result['rows']} latent files, the export holds {result['files']} "
                            "(an item without its text-encoder cache is skipped by musubi)")
    if args.text_encoder is not None:
        result["text"] = (musubi_own_text_check if arch in ("hv15", "k5", "fp") else musubi_text_check)(
            args, export, problems, arch)
    result["ok"] = not problems
    return result


def wan_t5_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' UMT5EncoderModel state dict in the names of Wan's own T5Encoder (musubi's wan/modules/t5.py,
    which loads Wan's umT5-XXL checkpoint): per block norm1, attn.{q,k,v,o}, pos_embedding (UMT5's per-layer
    relative bias), norm2, ffn.gate.0 (wi_0, through GELU), ffn.fc1 (wi_1), ffn.fc2 (wo); token_embedding; norm."""
    import re

    renamed = {"token_embedding.weight": state["shared.weight"],
               "norm.weight": state["encoder.final_layer_norm.weight"]}
    parts = {"layer.0.layer_norm": "norm1", "layer.0.SelfAttention.q": "attn.q", "layer.0.SelfAttention.k": "attn.k",
             "layer.0.SelfAttention.v": "attn.v", "layer.0.SelfAttention.o": "attn.o",
             "layer.0.SelfAttention.relative_attention_bias": "pos_embedding.embedding",
             "layer.1.layer_norm": "norm2", "layer.1.DenseReluDense.wi_0": "ffn.gate.0",
             "layer.1.DenseReluDense.wi_1": "ffn.fc1", "layer.1.DenseReluDense.wo": "ffn.fc2"}
    for key, value in state.items():
        match = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)\.weight", key)
        if match:
            renamed[f"blocks.{match[1]}.{parts[match[2]]}.weight"] = value
    return renamed


def musubi_caching(arch: str, folder: Path) -> Any:
    """(item) -> musubi's own text-encoder caching of `item` for `arch`, with the folder's tiny modules injected
    where musubi's loaders build the production models:
    hv15: hv_1_5_cache_text_encoder_outputs.encode_and_save_batch (get_qwen_prompt_embeds with its
    PROMPT_TEMPLATE_VIDEO and marker crop, get_glyph_prompt_embeds with ByT5 at 128 tokens) on the folder's Qwen2.5-VL
    text model and ByT5 encoder (its loaders build Qwen2.5-VL-7B and fetch google/byt5-small from the Hub);
    fp: fpack_cache_text_encoder_outputs.encode_and_save_batch on the folder's Llama and CLIP-L (a HunyuanVideo
    pipeline folder's), as its load_text_encoder1/2 would load them;
    k5: kandinsky5_cache_text_encoder_outputs.encode_and_save_batch with its Kandinsky5TextEmbedder made of its own
    Qwen2_5_VLTextEmbedder (the folder's Qwen2_5_VLForConditionalGeneration, and the text part of a processor: the
    folder's tokenizer) and ClipTextEmbedder (the folder's CLIP text model and tokenizer), as get_text_embedder
    builds them from checkpoints. fp32 throughout."""
    from transformers import AutoTokenizer

    if arch == "hv15":
        from musubi_tuner import hv_1_5_cache_text_encoder_outputs as hv15_te
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

        vlm = Qwen2_5_VLTextModel.from_pretrained(str(folder / "text_encoder"), torch_dtype=torch.float32).eval()
        byt5 = T5EncoderModel.from_pretrained(str(folder / "text_encoder_2"), torch_dtype=torch.float32).eval()
        tokenizer, tokenizer_2 = AutoTokenizer.from_pretrained(str(folder / "tokenizer")), \
            ByT5Tokenizer.from_pretrained(str(folder / "tokenizer_2"))
        return lambda item: hv15_te.encode_and_save_batch(tokenizer, vlm, tokenizer_2, byt5, [item],
                                                          torch.device("cpu"), None)
    if arch == "fp":
        from musubi_tuner import fpack_cache_text_encoder_outputs as fp_te
        from transformers import CLIPTextModel, LlamaModel

        llama = LlamaModel.from_pretrained(str(folder / "text_encoder"), torch_dtype=torch.float32).eval()
        clip_l = CLIPTextModel.from_pretrained(str(folder / "text_encoder_2"), torch_dtype=torch.float32).eval()
        tokenizer, tokenizer_2 = AutoTokenizer.from_pretrained(str(folder / "tokenizer")), \
            AutoTokenizer.from_pretrained(str(folder / "tokenizer_2"))
        return lambda item: fp_te.encode_and_save_batch(tokenizer, llama, tokenizer_2, clip_l, [item],
                                                        torch.device("cpu"))
    from musubi_tuner import kandinsky5_cache_text_encoder_outputs as k5_te
    from musubi_tuner.kandinsky5.models import text_embedders
    from transformers import CLIPTextModel, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    qwen = text_embedders.Qwen2_5_VLTextEmbedder.__new__(text_embedders.Qwen2_5_VLTextEmbedder)
    qwen.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder / "text_encoder"),
                                                                    torch_dtype=torch.float32).eval()
    qwen.processor = lambda images=None, videos=None, **kwargs: tokenizer(**kwargs)
    qwen.max_length = 512
    clip = text_embedders.ClipTextEmbedder.__new__(text_embedders.ClipTextEmbedder)
    clip.model = CLIPTextModel.from_pretrained(str(folder / "text_encoder_2"), torch_dtype=torch.float32).eval()
    clip.tokenizer, clip.max_length = AutoTokenizer.from_pretrained(str(folder / "tokenizer_2")), 77
    embedder = text_embedders.Kandinsky5TextEmbedder.__new__(text_embedders.Kandinsky5TextEmbedder)
    embedder.embedder, embedder.clip_embedder = qwen, clip
    return lambda item: k5_te.encode_and_save_batch(embedder, [item], torch.device("cpu"))


def musubi_own_text_check(args: argparse.Namespace, export: Path, problems: list[str], arch: str) -> dict[str, Any]:
    """4. musubi's own text-encoder caching for hv15 and k5 (musubi_caching) on the folder's weights; every exported
    `<item>_<arch>_te.safetensors` compared with the file it writes for the item's caption, within --text-tolerance.
    A prompt without glyph text (hv15): musubi stores ByT5's rows [:0] of its zero tensor, whose width it hard-codes
    (1472, ByT5-small's), so empty entries are compared by row count."""
    from musubi_tuner.dataset.image_video_dataset import ItemInfo

    cache_item = musubi_caching(arch, args.text_encoder)
    captions = {Path(entry["video_path"]).stem: entry["caption"]
                for entry in map(json.loads, (export / "videos.jsonl").read_text().splitlines())}
    checked = {"files": 0, "within_tolerance": 0, "worst_relative": 0.0, "tolerance": args.text_tolerance,
               "empty_glyph_entries": 0}
    with tempfile.TemporaryDirectory(prefix="vaecache-musubi-text-") as scratch_name:
        for exported in sorted((export / "cache").glob(f"*_{arch}_te.safetensors")):
            item_key = exported.name.removesuffix(f"_{arch}_te.safetensors")
            item = ItemInfo(item_key, captions[item_key], (0, 0), (0, 0), frame_count=2)  # a video item
            item.text_encoder_output_cache_path = str(Path(scratch_name) / exported.name)
            cache_item(item)
            theirs, their_metadata = load_file(Path(item.text_encoder_output_cache_path))
            ours, our_metadata = load_file(exported)
            checked["files"] += 1
            if sorted(theirs) != sorted(ours):
                problems.append(f"{exported.name}: keys {sorted(ours)}, musubi's {sorted(theirs)}")
                continue
            fine = True
            for key in theirs:
                if theirs[key].shape[0] == ours[key].shape[0] == 0:
                    checked["empty_glyph_entries"] += 1
                    continue
                if theirs[key].dtype == torch.bool or ours[key].dtype == torch.bool:  # k5's attention_mask
                    if not torch.equal(theirs[key], ours[key]):
                        problems.append(f"{exported.name}: {key} differs from musubi's")
                        fine = False
                    continue
                if theirs[key].shape != ours[key].shape:
                    problems.append(f"{exported.name}: {key} is {tuple(ours[key].shape)}, musubi's "
                                    f"{tuple(theirs[key].shape)}")
                    fine = False
                    continue
                relative = float((theirs[key].float() - ours[key].float()).abs().max()
                                 / ours[key].float().abs().max().clamp_min(1e-30))
                checked["worst_relative"] = max(checked["worst_relative"], relative)
                if relative > args.text_tolerance:
                    problems.append(f"{exported.name}: {key} differs from musubi's own caching by {relative:.3g} of "
                                    f"its max (tolerance {args.text_tolerance:g})")
                    fine = False
            if their_metadata != our_metadata:
                problems.append(f"{exported.name}: metadata {our_metadata} differs from musubi's {their_metadata}")
                fine = False
            checked["within_tolerance"] += fine
    return checked


def musubi_text_check(args: argparse.Namespace, export: Path, problems: list[str], arch: str = "wan") -> dict[str, Any]:
    """4. musubi's own Wan text-encoder caching (wan_cache_text_encoder_outputs.encode_and_save_batch: its
    T5EncoderModel, HuggingfaceTokenizer with its own cleaning, 512 tokens, rows trimmed to the prompt) on the same
    UMT5 weights, converted to Wan's names and loaded into a T5Encoder of the same config, computing in fp32; every
    exported `<item>_wan_te.safetensors` compared with the file it writes for the item's caption in videos.jsonl."""
    from musubi_tuner import wan_cache_text_encoder_outputs as wan_te
    from musubi_tuner.dataset.image_video_dataset import ItemInfo
    from musubi_tuner.wan.modules import t5 as wan_t5
    from musubi_tuner.wan.modules.tokenizers import HuggingfaceTokenizer
    from transformers import UMT5EncoderModel

    hf = UMT5EncoderModel.from_pretrained(str(args.text_encoder / "text_encoder"), torch_dtype=torch.float32)
    config = hf.config
    model = wan_t5.T5Encoder(vocab=config.vocab_size, dim=config.d_model, dim_attn=config.num_heads * config.d_kv,
                             dim_ffn=config.d_ff, num_heads=config.num_heads, num_layers=config.num_layers,
                             num_buckets=config.relative_attention_num_buckets, shared_pos=False, dropout=0.0)
    for block in model.blocks:  # umT5-XXL's 128, which T5RelativeEmbedding hard-codes; the tiny config's own here
        block.pos_embedding.max_dist = config.relative_attention_max_distance
    model.load_state_dict(wan_t5_names(hf.state_dict()), strict=True)
    encoder = wan_t5.T5EncoderModel.__new__(wan_t5.T5EncoderModel)  # its __init__ builds the full umT5-XXL
    encoder.model, encoder.text_len, encoder.dtype, encoder.device = model.eval(), 512, torch.float32, "cpu"
    encoder.tokenizer = HuggingfaceTokenizer(name=str(args.text_encoder / "tokenizer"), seq_len=512,
                                             clean="whitespace")
    captions = {Path(entry["video_path"]).stem: entry["caption"]
                for entry in map(json.loads, (export / "videos.jsonl").read_text().splitlines())}
    checked = {"files": 0, "within_tolerance": 0, "worst_relative": 0.0, "tolerance": args.text_tolerance,
               "caption1_differs": 0}
    with tempfile.TemporaryDirectory(prefix="vaecache-musubi-text-") as scratch_name:
        for exported in sorted((export / "cache").glob("*_wan_te.safetensors")):
            item_key = exported.name.removesuffix("_wan_te.safetensors")
            item = ItemInfo(item_key, captions[item_key], (0, 0), (0, 0))
            item.text_encoder_output_cache_path = str(Path(scratch_name) / exported.name)
            wan_te.encode_and_save_batch(encoder, [item], torch.device("cpu"), None)
            theirs, their_metadata = load_file(Path(item.text_encoder_output_cache_path))
            ours, our_metadata = load_file(exported)
            checked["files"] += 1
            checked["caption1_differs"] += their_metadata.get("caption1") != our_metadata.get("caption1")
            if sorted(theirs) != sorted(ours) or any(theirs[k].shape != ours[k].shape for k in theirs):
                problems.append(f"{exported.name}: keys/shapes {[(k, tuple(v.shape)) for k, v in ours.items()]}, "
                                f"musubi's {[(k, tuple(v.shape)) for k, v in theirs.items()]}")
                continue
            key = next(iter(theirs))
            relative = float((theirs[key].float() - ours[key].float()).abs().max()
                             / ours[key].float().abs().max().clamp_min(1e-30))
            checked["worst_relative"] = max(checked["worst_relative"], relative)
            if relative > args.text_tolerance:
                problems.append(f"{exported.name}: {key} differs from musubi's own T5 caching by {relative:.3g} of "
                                f"its max (tolerance {args.text_tolerance:g})")
            else:
                checked["within_tolerance"] += 1
    return checked


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = check(args)
    rows = [("musubi-tuner commit", result["musubi_commit"] or "unknown"), ("architecture", result["architecture"]),
            ("latent files equal to musubi's own caching", f"{result['files_equal']} / {result['files']}"),
            ("text-encoder caches written by musubi", str(result.get("text_encoder_caches", 0))),
            ("training batches / rows equal", f"{result['batches']} / {result['rows_equal']} of {result['rows']}"),
            *([("text caches within tolerance of musubi's own text caching",
                f"{result['text']['within_tolerance']} / {result['text']['files']} (worst "
                f"{result['text']['worst_relative']:.2g} of the max)")] if "text" in result else []),
            ("verdict", "OK" if result["ok"] else "DIFFERS")]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=sys.stderr)
    for problem in result["problems"][:20]:
        print(f"  {problem}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json is not None:
        if str(args.json) == "-":
            print(text)
        else:
            args.json.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
