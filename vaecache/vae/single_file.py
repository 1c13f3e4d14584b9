"""A VAE held as one file, the way most users have it (`Wan2.1_VAE.pth`, ComfyUI's `wan_2.1_vae.safetensors`,
LTX-Video's and SD's single-file checkpoints): the family told from the keys, the config the family published
(shipped in vaecache/vae/configs/) or --vae-config, converted with diffusers' own single-file loading
(`from_single_file`, diffusers/loaders/single_file_model.py SINGLE_FILE_LOADABLE_CLASSES: AutoencoderKLWan,
AutoencoderKLLTXVideo and AutoencoderKL in the pinned diffusers; each family's key mapping is
diffusers/loaders/single_file_utils.py `convert_wan_vae_to_diffusers`, `convert_ltx_vae_checkpoint_to_diffusers`,
`convert_ldm_vae_checkpoint`). HunyuanVideo and CogVideoX single files are refused: diffusers has no single-file
loader for them (convert with diffusers' scripts/convert_hunyuan_video_to_diffusers.py or
convert_cogvideox_to_diffusers.py and pass the folder).

Only safetensors is read unless --allow-pickle-weights (a .pth/.pt/.ckpt is a pickle, which can run code).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

from vaecache.errors import VaeSpecError

SAFE_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES
CONFIGS = Path(__file__).resolve().parent / "configs"
def detect_family(keys: Iterable[str]) -> str:
    """The VAE family a checkpoint's keys are laid out for (its original code's module names), or a VaeSpecError
    saying what the file is."""
    found = {key.removeprefix("vae.").removeprefix("first_stage_model.") for key in keys}
    if "encoder.downsamples.0.residual.0.gamma" in found and "decoder.upsamples.0.residual.0.gamma" in found:
        return "AutoencoderKLWan"  # Wan-Video/Wan2.1 wan/modules/vae.py WanVAE_
    if any(key.startswith("per_channel_statistics") for key in found):
        return "AutoencoderKLLTXVideo"  # Lightricks/LTX-Video ltx_video/models/autoencoders/causal_video_autoencoder.py
    if "encoder.down.0.block.0.norm1.weight" in found and "decoder.up.0.block.0.norm1.weight" in found:
        return "AutoencoderKL"  # the LDM/SD first-stage model (ldm/modules/diffusionmodules/model.py)
    if "encoder.down.0.block.0.conv1.conv.weight" in found:
        raise VaeSpecError("a CogVideoX VAE in its original (SAT) layout: diffusers has no single-file loader for it; "
                           "convert it with diffusers' scripts/convert_cogvideox_to_diffusers.py and pass --vae "
                           "diffusers:FOLDER")
    if "encoder.down_blocks.0.resnets.0.conv1.conv.weight" in found:
        raise VaeSpecError("a HunyuanVideo VAE checkpoint: diffusers has no single-file loader for it; convert it "
                           "with diffusers' scripts/convert_hunyuan_video_to_diffusers.py and pass --vae "
                           "diffusers:FOLDER")
    if any(key.startswith("encoder.down_blocks.") for key in found) and "encoder.conv_in.weight" in found:
        raise VaeSpecError("a diffusers model's weights file on its own: pass the folder that holds it with its "
                           "config.json (--vae diffusers:FOLDER)")
    sample = ", ".join(sorted(found)[:3])
    raise VaeSpecError(f"not a VAE checkpoint vaecache knows (keys {sample}, ...): single files of Wan 2.1, "
                       "LTX-Video and SD-style AutoencoderKL are read")


def read_keys(path: Path, allow_pickle_weights: bool) -> tuple[list[str], dict[str, Any]]:
    """The checkpoint's tensor names and shapes (safetensors: from its header only)."""
    suffix = path.suffix.lower()
    if suffix in SAFE_SUFFIXES:
        header = safetensors_header(path)
        keys = [key for key in header if key != "__metadata__"]
        return keys, {key: tuple(header[key].get("shape", ())) for key in keys}
    if suffix in PICKLE_SUFFIXES and not allow_pickle_weights:
        raise VaeSpecError(f"{path}: a {suffix} checkpoint is a pickle, which can run code when loaded; convert it to "
                           "safetensors, or pass --allow-pickle-weights if you trust it")
    if suffix not in SUFFIXES:
        raise VaeSpecError(f"{path}: not a checkpoint file vaecache reads ({', '.join(SUFFIXES)})")
    import torch

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise VaeSpecError(f"{path}: cannot read the checkpoint ({str(exc).splitlines()[0][:160]})") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise VaeSpecError(f"{path}: not a state dict of tensors")
    return list(state), {key: tuple(getattr(value, "shape", ())) for key, value in state.items()}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then the JSON): names, dtypes, shapes, read
    without torch or the tensors."""
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(handle.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not an object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise VaeSpecError(f"{path}: not a readable safetensors file ({exc})") from None
    return header


def check_single_file(path: Path, vae_config: Path | None, allow_pickle_weights: bool) -> None:
    """What can be known of a checkpoint before loading it (and before any dataset is probed): a pickle without
    --allow-pickle-weights, a family vaecache cannot read, a missing or mismatched config. Reads only a
    safetensors header."""
    if path.suffix.lower() not in SAFE_SUFFIXES:
        if not allow_pickle_weights:
            read_keys(path, False)  # refuses the pickle, naming the flag; with it, reading one needs torch
        return
    keys, shapes = read_keys(path, allow_pickle_weights)
    load_config(vae_config, detect_family(keys), shapes, path)


def shipped_config(family: str, shapes: dict[str, Any]) -> dict[str, Any] | None:
    """The published config of the family whose shapes the checkpoint has, or None (then --vae-config)."""
    if family == "AutoencoderKLWan":
        conv = shapes.get("conv1.weight") or shapes.get("vae.conv1.weight")
        first = shapes.get("encoder.conv1.weight") or shapes.get("vae.encoder.conv1.weight")
        if conv and first and conv[0] == 32 and first[0] == 96:  # z_dim 16, base_dim 96: the Wan 2.1 VAE
            return json.loads((CONFIGS / "wan2.1_vae.json").read_text())
    return None


NO_SHIPPED_CONFIG = {
    "AutoencoderKLWan": "only the Wan 2.1 VAE's config is shipped (z_dim 16, base_dim 96); this file has other shapes",
    "AutoencoderKLLTXVideo": "LTX-Video's VAE configs differ between releases (0.9.0, 0.9.1, 0.9.5, ...) with the same "
                             "keys",
    "AutoencoderKL": "SD 1.x, SD 2.x and SDXL VAEs have the same shapes but other scaling factors, and a latent scaled "
                     "wrongly trains wrongly",
}


def load_config(given: Path | None, family: str, shapes: dict[str, Any], path: Path) -> dict[str, Any]:
    """--vae-config (a config.json, or a folder holding one), else the shipped config for these shapes."""
    if given is not None:
        file = given / "config.json" if given.is_dir() else given
        try:
            config = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise VaeSpecError(f"{file}: --vae-config is not a readable config.json ({exc})") from None
        named = config.get("_class_name") if isinstance(config, dict) else None
        if named != family:
            raise VaeSpecError(f"{file}: --vae-config is for {named!r}, the checkpoint {path.name} is a {family}")
        return config
    config = shipped_config(family, shapes)
    if config is None:
        raise VaeSpecError(f"{path}: a {family} checkpoint, but {NO_SHIPPED_CONFIG[family]}: pass --vae-config "
                           "CONFIG.json (the config.json of the diffusers folder of the same model)")
    return config


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def load_single_file(path: Path, config_path: Path | None, allow_pickle_weights: bool) -> tuple[Any, str, str]:
    """(diffusers module, family, the file's sha256): the checkpoint converted with diffusers' own loader."""
    import tempfile

    import diffusers
    import torch

    keys, shapes = read_keys(path, allow_pickle_weights)
    family = detect_family(keys)
    config = load_config(config_path, family, shapes, path)
    with tempfile.TemporaryDirectory(prefix="vaecache-config-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        try:
            module = getattr(diffusers, family).from_single_file(str(path), config=folder, local_files_only=True,
                                                                 torch_dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001  # diffusers raises many kinds for a checkpoint that does not fit
            raise VaeSpecError(f"{path}: could not load it as {family} with "
                               f"{config_path or 'the shipped config'} ({str(exc).splitlines()[0][:200]})") from None
    return module, family, file_sha256(path)
