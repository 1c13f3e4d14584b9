"""A VAE held as one file, the way most users have it (`Wan2.1_VAE.pth`, ComfyUI's `wan_2.1_vae.safetensors`,
LTX-Video's and SD's single-file checkpoints): the family told from the keys, the config the family published
(shipped in vaecache/vae/configs/) or --vae-config, converted with diffusers' own single-file loading
(`from_single_file`, diffusers/loaders/single_file_model.py SINGLE_FILE_LOADABLE_CLASSES: AutoencoderKLWan,
AutoencoderKLLTXVideo and AutoencoderKL in the pinned diffusers; each family's key mapping is
diffusers/loaders/single_file_utils.py `convert_wan_vae_to_diffusers`, `convert_ltx_vae_checkpoint_to_diffusers`,
`convert_ldm_vae_checkpoint`), then loaded strictly: every parameter and persistent buffer of the module the config
builds comes from the file, and no tensor of the file's VAE part is left unused (diffusers' loader leaves a missing
weight at its random initial value and drops unknown tensors with a warning). HunyuanVideo and CogVideoX single
files are refused: diffusers has no single-file loader for them (convert with diffusers'
scripts/convert_hunyuan_video_to_diffusers.py or convert_cogvideox_to_diffusers.py and pass the folder).

Only safetensors is read unless --allow-pickle-weights (a .pth/.pt/.ckpt is a pickle, which can run code).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

from vaecache.errors import VaeSpecError, first_line
from vaecache.weights import check_finite, safetensors_header

SAFE_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES
CONFIGS = Path(__file__).resolve().parent / "configs"


def detect_family(keys: Iterable[str], path: Path | None = None) -> str:
    """The VAE family a checkpoint's keys are laid out for (its original code's module names), or a VaeSpecError
    saying what the file (`path`, named in the message) is."""
    where = f"{path}: " if path is not None else ""
    found = {key.removeprefix("vae.").removeprefix("first_stage_model.") for key in keys}
    if "encoder.downsamples.0.residual.0.gamma" in found and "decoder.upsamples.0.residual.0.gamma" in found:
        return "AutoencoderKLWan"  # Wan-Video/Wan2.1 wan/modules/vae.py WanVAE_
    if any(key.startswith("per_channel_statistics") for key in found):
        return "AutoencoderKLLTXVideo"  # Lightricks/LTX-Video ltx_video/models/autoencoders/causal_video_autoencoder.py
    if "encoder.down.0.block.0.norm1.weight" in found and "decoder.up.0.block.0.norm1.weight" in found:
        return "AutoencoderKL"  # the LDM/SD first-stage model (ldm/modules/diffusionmodules/model.py)
    if "encoder.down.0.block.0.conv1.conv.weight" in found:
        raise VaeSpecError(f"{where}a CogVideoX VAE in its original (SAT) layout: diffusers has no single-file "
                           "loader for it; convert it with diffusers' scripts/convert_cogvideox_to_diffusers.py and "
                           "pass --vae diffusers:FOLDER")
    if "encoder.down_blocks.0.resnets.0.conv1.conv.weight" in found:
        raise VaeSpecError(f"{where}a HunyuanVideo VAE checkpoint: diffusers has no single-file loader for it; "
                           "convert it with diffusers' scripts/convert_hunyuan_video_to_diffusers.py and pass --vae "
                           "diffusers:FOLDER")
    if any(key.startswith("encoder.down_blocks.") for key in found) and "encoder.conv_in.weight" in found:
        raise VaeSpecError(f"{where}a diffusers model's weights file on its own: pass the folder that holds it "
                           "with its config.json (--vae diffusers:FOLDER)")
    sample = ", ".join(sorted(found)[:3])
    raise VaeSpecError(f"{where}not a VAE checkpoint vaecache knows (keys {sample}, ...): single files of Wan 2.1, "
                       "LTX-Video and SD-style AutoencoderKL are read")


def read_keys(path: Path, allow_pickle_weights: bool) -> tuple[list[str], dict[str, Any]]:
    """The checkpoint's tensor names and shapes (safetensors: from its header only)."""
    suffix = path.suffix.lower()
    if suffix in SAFE_SUFFIXES:
        header = safetensors_header(path)
        keys = [key for key in header if key != "__metadata__"]
        return keys, {key: tuple(header[key]["shape"]) for key in keys}
    state = read_pickle(path, allow_pickle_weights)
    return list(state), {key: tuple(getattr(value, "shape", ())) for key, value in state.items()}


def read_pickle(path: Path, allow_pickle_weights: bool) -> dict[str, Any]:
    """A pickled checkpoint's state dict (unwrapped from "state_dict" or "model"), read with torch's weights-only
    unpickler, and only with --allow-pickle-weights."""
    suffix = path.suffix.lower()
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
    return state


def check_single_file(path: Path, vae_config: Path | None, allow_pickle_weights: bool) -> None:
    """What can be known of a checkpoint before loading it (and before any dataset is probed): a pickle without
    --allow-pickle-weights, a family vaecache cannot read, a missing or mismatched config. Reads only a
    safetensors header."""
    if path.suffix.lower() not in SAFE_SUFFIXES:
        if not allow_pickle_weights:
            read_keys(path, False)  # refuses the pickle, naming the flag; with it, reading one needs torch
        return
    keys, shapes = read_keys(path, allow_pickle_weights)
    load_config(vae_config, detect_family(keys, path), shapes, path)


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
    """(diffusers module, family, the file's sha256): the checkpoint converted with diffusers' conversion function
    for its family and loaded strictly: a tensor missing from the file, left over in its VAE part or of the wrong
    shape is a VaeSpecError naming the file and the first such tensor."""
    import diffusers
    import torch
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    state = None if path.suffix.lower() in SAFE_SUFFIXES else read_pickle(path, allow_pickle_weights)
    keys, shapes = read_keys(path, allow_pickle_weights) if state is None else \
        (list(state), {key: tuple(getattr(value, "shape", ())) for key, value in state.items()})
    family = detect_family(keys, path)
    config = load_config(config_path, family, shapes, path)
    given = f"--vae-config {config_path}" if config_path else "the shipped config"
    try:
        with torch.random.fork_rng(devices=[]):  # every tensor is overwritten from the file below
            module = getattr(diffusers, family).from_config(dict(config))
    except Exception as exc:  # noqa: BLE001  # diffusers raises many kinds for a config it cannot build
        raise VaeSpecError(f"{path}: {given} does not build a {family} ({first_line(exc, 200)})") from None
    tensors = _vae_tensors(path, family, keys, state)
    convert = SINGLE_FILE_LOADABLE_CLASSES[family]["checkpoint_mapping_fn"]
    try:
        # the module's config (the given one with diffusers' defaults filled in: what the SD converter's level count
        # must match); a copy of the tensors, which the LTX converter pops
        converted = convert(config=dict(module.config), checkpoint=dict(tensors))
    except KeyError as exc:
        raise VaeSpecError(f"{path}: an incomplete {family} checkpoint: no tensor {exc.args[0]!r}, which diffusers' "
                           f"{convert.__name__} needs") from None
    except Exception as exc:  # noqa: BLE001
        raise VaeSpecError(f"{path}: diffusers' {convert.__name__} cannot convert it "
                           f"({first_line(exc, 200)})") from None
    _check_complete(path, family, given, module.state_dict(), tensors, converted)
    module.load_state_dict(converted, strict=True)
    check_finite(module.state_dict(), str(path))
    return module.to(torch.float32).eval(), family, file_sha256(path)


def _vae_tensors(path: Path, family: str, keys: list[str], state: dict[str, Any] | None) -> dict[str, Any]:
    """The tensors of the file's VAE part, by the family converter's own rule (a whole-model checkpoint holds others:
    LTX-Video's its transformer, SD's its UNet and text encoder); a safetensors file reads only these."""
    import torch
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS

    if family == "AutoencoderKLLTXVideo":
        keys = [key for key in keys if "vae." in key]  # convert_ltx_vae_checkpoint_to_diffusers
    elif family == "AutoencoderKL":  # convert_ldm_vae_checkpoint: the last prefix any key has, else none
        prefix = next((p for p in reversed(LDM_VAE_KEYS) if any(key.startswith(p) for key in keys)), "")
        keys = [key for key in keys if key.startswith(prefix)]
    if state is None:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                return {key: handle.get_tensor(key) for key in keys}
        except Exception as exc:  # noqa: BLE001  # safetensors raises its own kinds for a damaged file
            raise VaeSpecError(f"{path}: cannot read its tensors ({first_line(exc, 200)})") from None
    for key in keys:
        if not isinstance(state[key], torch.Tensor):
            raise VaeSpecError(f"{path}: {key!r} is a {type(state[key]).__name__}, not a tensor")
    return {key: state[key] for key in keys}


LEFTOVERS = {"AutoencoderKLLTXVideo": "per_channel_statistics.", "AutoencoderKL": "loss."}
"""Tensors of a family's original checkpoints that its model does not use, dropped on purpose: LTX-Video's
channel index and mean of stds (its converter removes them), the LDM autoencoder's training loss (LPIPS, its
discriminator, logvar)."""


def _check_complete(path: Path, family: str, given: Any, expected: dict[str, Any], tensors: dict[str, Any],
                    converted: dict[str, Any]) -> None:
    """Every parameter and persistent buffer of the module (`expected`) in the converted checkpoint with its shape,
    and every tensor of the file's VAE part used: diffusers' loader keeps a missing one's random initial value, and
    a converter drops what it does not map (an SD level the config does not have) without a word."""
    missing = [key for key in expected if key not in converted]
    if missing:
        raise VaeSpecError(f"{path}: an incomplete {family} checkpoint (a weight would be left random): no tensor for "
                           f"{missing[0]} (diffusers' name), {len(missing)} of {len(expected)} missing")
    objects = {id(value) for value in converted.values()}
    memory = {value.data_ptr() for value in converted.values() if value.numel()}  # an SD attention weight is a view
    leftover = LEFTOVERS.get(family)
    dropped = [key for key, value in tensors.items()
               if id(value) not in objects and not (value.numel() and value.data_ptr() in memory)
               and not (leftover and key.removeprefix("vae.").removeprefix("first_stage_model.").startswith(leftover))]
    unknown = dropped + [key for key in converted if key not in expected]
    if unknown:
        raise VaeSpecError(f"{path}: tensors the {family} of {given} has no place for: {unknown[0]}, "
                           f"{len(unknown)} unknown")
    wrong = [key for key in expected if tuple(converted[key].shape) != tuple(expected[key].shape)]
    if wrong:
        first = wrong[0]
        raise VaeSpecError(f"{path}: tensors of other shapes than the {family} of {given}: {first} (diffusers' "
                           f"name) is {list(converted[first].shape)}, not {list(expected[first].shape)}, "
                           f"{len(wrong)} differ")
