"""A VAE held as one file, the way most users have it (`Wan2.1_VAE.pth`, ComfyUI's `wan_2.1_vae.safetensors`,
LTX-Video's and SD's single-file checkpoints): the family told from the keys, the config the family published
(shipped in vaecache/vae/configs/) or --vae-config, converted with diffusers' own single-file loading (LTX-2's:
vaecache.vae.ltx2_file)
(`from_single_file`, diffusers/loaders/single_file_model.py SINGLE_FILE_LOADABLE_CLASSES: AutoencoderKLWan,
AutoencoderKLLTXVideo and AutoencoderKL in the pinned diffusers; each family's key mapping is
diffusers/loaders/single_file_utils.py `convert_wan_vae_to_diffusers`, `convert_ltx_vae_checkpoint_to_diffusers`,
`convert_ldm_vae_checkpoint`), then loaded strictly: every parameter and persistent buffer of the module the config
builds comes from the file, and no tensor of the file's VAE part is left unused (diffusers' loader leaves a missing
weight at its random initial value and drops unknown tensors with a warning). HunyuanVideo (1, 1.5) and CogVideoX
single files are refused: diffusers has no single-file loader for them (convert with diffusers'
scripts/convert_hunyuan_video_to_diffusers.py, convert_hunyuan_video1_5_to_diffusers.py or
convert_cogvideox_to_diffusers.py and pass the folder).

Only safetensors is read unless --allow-pickle-weights (a .pth/.pt/.ckpt is a pickle, which can run code).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from vaecache.errors import VaeSpecError, first_line
from vaecache.vae.ltx2_file import AUDIO_PREFIX, convert_ltx2_video_vae, is_ltx2_checkpoint, video_config_name
from vaecache.weights import check_finite, safetensors_header

SAFE_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES
CONFIGS = Path(__file__).resolve().parent / "configs"


def detect_family(keys: Iterable[str], path: Path | None = None, shapes: dict[str, Any] | None = None) -> str:
    """The VAE family a checkpoint's keys (and `shapes`, where given) are laid out for (its original code's module
    names), or a VaeSpecError saying what the file (`path`, named in the message) is."""
    where = f"{path}: " if path is not None else ""
    keys = list(keys)
    found = {key.removeprefix("vae.").removeprefix("first_stage_model.") for key in keys}
    if "encoder.downsamples.0.residual.0.gamma" in found and "decoder.upsamples.0.residual.0.gamma" in found:
        return "AutoencoderKLWan"  # Wan-Video/Wan2.1 wan/modules/vae.py WanVAE_
    if is_wan22_layout(found):
        return "AutoencoderKLWan"  # Wan-Video/Wan2.2 wan/modules/vae2_2.py WanVAE_ (Down_/Up_ResidualBlock)
    if any(key.startswith("per_channel_statistics") for key in found):
        if is_ltx2_checkpoint(keys, shapes or {}):
            return "AutoencoderKLLTX2Video"  # Lightricks/LTX-2 ltx_core/model/video_vae (vaecache.vae.ltx2_file)
        return "AutoencoderKLLTXVideo"  # Lightricks/LTX-Video ltx_video/models/autoencoders/causal_video_autoencoder.py
    if keys and all(key.startswith(AUDIO_PREFIX) for key in keys):
        raise VaeSpecError(f"{where}LTX-2's audio VAE alone (audio_vae.*): pass it as --audio-vae, with the video "
                           "VAE as --vae")
    if "encoder.down.0.block.0.norm1.weight" in found and "decoder.up.0.block.0.norm1.weight" in found:
        return "AutoencoderKL"  # the LDM/SD first-stage model (ldm/modules/diffusionmodules/model.py)
    if "encoder.down.0.block.0.norm1.gamma" in found:  # HunyuanVideo 1.5's RMS norms, in its release's layout
        raise VaeSpecError(f"{where}a HunyuanVideo 1.5 VAE in its release layout (tencent/HunyuanVideo-1.5): diffusers "
                           "has no single-file loader for it; convert it with diffusers' "
                           "scripts/convert_hunyuan_video1_5_to_diffusers.py and pass --vae diffusers:FOLDER")
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
    raise VaeSpecError(f"{where}not a VAE checkpoint vaecache knows (keys {sample}, ...): single files of Wan 2.1 "
                       "and 2.2, LTX-Video, LTX-2 and SD-style AutoencoderKL are read")


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
    load_config(vae_config, detect_family(keys, path, shapes), shapes, path)


def is_wan22_layout(keys: Iterable[str]) -> bool:
    """Wan 2.2's VAE (the TI2V-5B one, `Wan2.2_VAE.pth`): each level a Down_ResidualBlock / Up_ResidualBlock whose
    blocks sit one level deeper than Wan 2.1's (`encoder.downsamples.0.downsamples.0.residual.0.gamma`)."""
    found = {key.removeprefix("vae.") for key in keys}
    return ("encoder.downsamples.0.downsamples.0.residual.0.gamma" in found
            and "decoder.upsamples.0.upsamples.0.residual.0.gamma" in found)


def shipped_config_name(family: str, shapes: dict[str, Any]) -> str | None:
    """The file under vaecache/vae/configs/ of the published model whose layout and shapes the checkpoint has, or
    None (then --vae-config).

    Wan: 2.1 (z_dim 16, base_dim 96) and 2.2's TI2V-5B VAE (z_dim 48, base_dim 160: diffusers'
    scripts/convert_wan_to_diffusers.py `vae22_diffusers_config`). LTX-Video: each release told from its VAE's keys as
    diffusers' `infer_diffusers_model_type` tells them (loaders/single_file_utils.py: the encoder's last width 2048 is
    0.9.5 and later, a decoder time embedder 0.9.1, else 0.9.0), with the config diffusers'
    scripts/convert_ltx_to_diffusers.py `get_vae_config` gives that release (0.9.7 and 0.9.8 share 0.9.5's VAE)."""
    def shape(key: str) -> tuple[int, ...] | None:
        found = shapes.get(key) or shapes.get(f"vae.{key}")
        return tuple(found) if found else None

    if family == "AutoencoderKLWan":
        conv, first = shape("conv1.weight"), shape("encoder.conv1.weight")
        if conv and first and conv[0] == 32 and first[0] == 96 and not is_wan22_layout(shapes):
            return "wan2.1_vae.json"
        if conv and first and conv[0] == 96 and first[0] == 160 and is_wan22_layout(shapes):
            return "wan2.2_vae.json"
    if family == "AutoencoderKLLTX2Video":
        return video_config_name(shapes)
    if family == "AutoencoderKLLTXVideo":
        last = shapes.get("vae.encoder.conv_out.conv.weight")
        if last and len(last) > 1 and last[1] == 2048:
            return "ltx-video-0.9.5_vae.json"
        if "vae.decoder.last_time_embedder.timestep_embedder.linear_1.weight" in shapes:
            return "ltx-video-0.9.1_vae.json"
        if "vae.decoder.up_blocks.9.res_blocks.0.conv1.conv.weight" in shapes:
            return "ltx-video-0.9.0_vae.json"
    return None


def shipped_config(family: str, shapes: dict[str, Any]) -> dict[str, Any] | None:
    """The published config of the family whose shapes the checkpoint has, or None (then --vae-config)."""
    name = shipped_config_name(family, shapes)
    return json.loads((CONFIGS / name).read_text()) if name else None


NO_SHIPPED_CONFIG = {
    "AutoencoderKLWan": "the configs shipped are Wan 2.1's (z_dim 16, base_dim 96) and Wan 2.2 TI2V-5B's (z_dim 48, "
                        "base_dim 160); this file has other shapes",
    "AutoencoderKLLTXVideo": "its keys are not those of a released LTX-Video VAE (0.9.0, 0.9.1, 0.9.5 to 0.9.8)",
    "AutoencoderKLLTX2Video": "its shapes are not those of a released LTX-2 video VAE (2.0, 2.3)",
    "AutoencoderKL": "SD 1.x, SD 2.x and SDXL VAEs have the same shapes but other scaling factors, and a latent scaled "
                     "wrongly trains wrongly",
}


SIBLINGS = {("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")}
"""(detected, given) families whose checkpoints can have the same keys: LTX-2's video VAE alone, at a size no release
has, keeps LTX-Video's key layout; --vae-config's class then says which it is."""


def load_config(given: Path | None, family: str, shapes: dict[str, Any], path: Path) -> dict[str, Any]:
    """--vae-config (a config.json, or a folder holding one), else the shipped config for these shapes."""
    if given is not None:
        file = given / "config.json" if given.is_dir() else given
        try:
            config = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise VaeSpecError(f"{file}: --vae-config is not a readable config.json ({exc})") from None
        named = config.get("_class_name") if isinstance(config, dict) else None
        if named != family and (family, named) not in SIBLINGS:
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


class SingleFile(NamedTuple):
    module: Any
    """The diffusers module, fp32, eval."""
    family: str
    sha256: str
    """The file's sha256 (recorded as single_file_sha256)."""
    skipped: dict[str, int]
    """Known leftovers dropped that the record names (RECORDED_LEFTOVERS: prefix -> tensors)."""


def load_single_file(path: Path, config_path: Path | None, allow_pickle_weights: bool) -> SingleFile:
    """The checkpoint converted with diffusers' conversion function for its family (Wan 2.2's VAE: convert_wan22_vae)
    and loaded strictly: a tensor missing from the file, left over in its VAE part or of the wrong shape, or a weight
    that is not finite, is a VaeSpecError naming the file and the first such tensor."""
    import diffusers
    import torch
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    state = None if path.suffix.lower() in SAFE_SUFFIXES else read_pickle(path, allow_pickle_weights)
    keys, shapes = read_keys(path, allow_pickle_weights) if state is None else \
        (list(state), {key: tuple(getattr(value, "shape", ())) for key, value in state.items()})
    family = detect_family(keys, path, shapes)
    config = load_config(config_path, family, shapes, path)
    family = str(config.get("_class_name") or family)  # a sibling the given config names (SIBLINGS)
    given = f"--vae-config {config_path}" if config_path else \
        f"the shipped config {shipped_config_name(family, shapes)} (another size: pass --vae-config)"
    try:
        with torch.random.fork_rng(devices=[]):  # every tensor is overwritten from the file below
            module = getattr(diffusers, family).from_config(dict(config))
    except Exception as exc:  # noqa: BLE001  # diffusers raises many kinds for a config it cannot build
        raise VaeSpecError(f"{path}: {given} does not build a {family} ({first_line(exc, 200)})") from None
    tensors = _vae_tensors(path, family, keys, state)
    if family == "AutoencoderKLWan" and is_wan22_layout(keys):
        convert = convert_wan22_vae
    elif family == "AutoencoderKLLTX2Video":
        convert = convert_ltx2_video_vae
    else:
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
    skipped = check_complete(path, family, given, module.state_dict(), tensors, converted)
    module.load_state_dict(converted, strict=True)
    check_finite(module.state_dict(), str(path))
    return SingleFile(module.to(torch.float32).eval(), family, file_sha256(path), skipped)


def _vae_tensors(path: Path, family: str, keys: list[str], state: dict[str, Any] | None) -> dict[str, Any]:
    """The tensors of the file's VAE part, by the family converter's own rule (a whole-model checkpoint holds others:
    LTX-Video's its transformer, SD's its UNet and text encoder); a safetensors file reads only these."""
    import torch
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS

    if family == "AutoencoderKLLTXVideo":
        keys = [key for key in keys if "vae." in key]  # convert_ltx_vae_checkpoint_to_diffusers
    elif family == "AutoencoderKLLTX2Video":
        keys = [key for key in keys if key.startswith("vae.")] or keys  # a whole LTX-2 file, or its video VAE alone
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


LEFTOVERS = {"AutoencoderKLLTXVideo": ("per_channel_statistics.",),
             "AutoencoderKLLTX2Video": ("per_channel_statistics.",),
             "AutoencoderKLLTX2Audio": ("per_channel_statistics.",), "AutoencoderKL": ("loss.", "model_ema.")}
"""Tensors of a family's original checkpoints that its model does not use, dropped on purpose: LTX-Video's (and LTX-2's)
channel index and mean of stds (its converter removes them), the LDM autoencoder's training loss (LPIPS, its
discriminator, logvar) and its LitEma copies (`model_ema.decay`, `model_ema.num_updates` and the shadow weights:
ldm's `instantiate_from_config` loading and diffusers' `convert_ldm_vae_checkpoint` read the model's own weights)."""
RECORDED_LEFTOVERS = ("model_ema.",)
"""Dropped tensors the recorded VAE config names (`single_file_skipped`: prefix -> count): an EMA copy beside the
weights says which weights were not used."""


def check_complete(path: Path, family: str, given: Any, expected: dict[str, Any], tensors: dict[str, Any],
                    converted: dict[str, Any]) -> None:
    """Every parameter and persistent buffer of the module (`expected`) in the converted checkpoint with its shape,
    and every tensor of the file's VAE part used: diffusers' loader keeps a missing one's random initial value, and
    a converter drops what it does not map (an SD level the config does not have) without a word."""
    missing = [key for key in expected if key not in converted]
    if missing:
        raise VaeSpecError(f"{path}: an incomplete {family} checkpoint for {given} (a weight would be left random): "
                           f"no tensor for {missing[0]} (diffusers' name), {len(missing)} of {len(expected)} missing")
    objects = {id(value) for value in converted.values()}
    memory = {value.data_ptr() for value in converted.values() if value.numel()}  # an SD attention weight is a view
    unused = [key for key, value in tensors.items()
              if id(value) not in objects and not (value.numel() and value.data_ptr() in memory)]
    skipped = {prefix: [key for key in unused if _bare(key).startswith(prefix)] for prefix in LEFTOVERS.get(family, ())}
    known = {key for keys in skipped.values() for key in keys}
    dropped = [key for key in unused if key not in known]
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
    return {prefix: len(keys) for prefix, keys in skipped.items() if keys and prefix in RECORDED_LEFTOVERS}


def _bare(key: str) -> str:
    return key.removeprefix("audio_vae.").removeprefix("vae.").removeprefix("first_stage_model.")


_WAN22_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight",
                   "residual.2.bias": "conv1.bias", "residual.3.gamma": "norm2.gamma",
                   "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
                   "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_WAN22_TOP = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
              "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}


def wan22_key(key: str) -> str:
    """One tensor name of Wan 2.2's VAE (Wan-Video/Wan2.2 wan/modules/vae2_2.py WanVAE_) in AutoencoderKLWan's
    (is_residual): the renaming of diffusers' scripts/convert_wan_to_diffusers.py `convert_vae_22`, which is nothing
    but a renaming (diffusers' single-file loading has no Wan 2.2 VAE conversion)."""
    if key in _WAN22_TOP:
        return _WAN22_TOP[key]
    if m := re.fullmatch(r"(encoder|decoder)\.conv1\.(weight|bias)", key):
        return f"{m[1]}.conv_in.{m[2]}"
    if m := re.fullmatch(r"(encoder|decoder)\.head\.0\.gamma", key):
        return f"{m[1]}.norm_out.gamma"
    if m := re.fullmatch(r"(encoder|decoder)\.head\.2\.(weight|bias)", key):
        return f"{m[1]}.conv_out.{m[2]}"
    if (m := re.fullmatch(r"(encoder|decoder)\.middle\.([02])\.(.+)", key)) and m[3] in _WAN22_RESIDUAL:
        return f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_WAN22_RESIDUAL[m[3]]}"
    if m := re.fullmatch(r"(encoder|decoder)\.middle\.1\.(.+)", key):
        return f"{m[1]}.mid_block.attentions.0.{m[2]}"
    if m := re.fullmatch(r"(encoder\.down|decoder\.up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.+)", key):
        side, level, index, rest = m[1], m[2], m[3], m[4]
        blocks = f"{side}_blocks.{level}"
        if rest in _WAN22_RESIDUAL:
            return f"{blocks}.resnets.{index}.{_WAN22_RESIDUAL[rest]}"
        if rest.startswith(("resample.", "time_conv.")):
            return f"{blocks}.{side.partition('.')[2]}sampler.{rest}"
    return key


def convert_wan22_vae(config: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Wan 2.2's VAE checkpoint in AutoencoderKLWan's names (wan22_key); a "vae." prefix, as some tools save it, is
    dropped first. `config` is unused: the renaming does not depend on it (the signature of diffusers' converters)."""
    del config
    return {wan22_key(key.removeprefix("vae.")): value for key, value in checkpoint.items()}
