"""A VAE held as one file, the way most users have it (`Wan2.1_VAE.pth`, ComfyUI's `wan_2.1_vae.safetensors`,
LTX-Video's and SD's single-file checkpoints): the layout told from the keys by the layouts the model families
declare (vaecache.models.SingleFileLayout), the config the family published (shipped in vaecache/models/configs/) or
--vae-config, converted with the family's conversion (diffusers' own single-file one where diffusers has it:
diffusers/loaders/single_file_model.py SINGLE_FILE_LOADABLE_CLASSES), then loaded strictly: every parameter and
persistent buffer of the module the config builds comes from the file, and no tensor of the file's VAE part is left
unused (diffusers' loader leaves a missing weight at its random initial value and drops unknown tensors with a
warning). A layout a family declares without a loader is refused with the family's reason (convert it with diffusers'
script and pass the folder).

Only safetensors is read unless --allow-pickle-weights (a .pth/.pt/.ckpt is a pickle, which can run code).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from vaecache.errors import VaeSpecError, first_line
from vaecache.models import SingleFileLayout, registry
from vaecache.models.base import CONFIGS
from vaecache.weights import check_finite, safetensors_header

SAFE_SUFFIXES = (".safetensors", ".sft")
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES


def layouts() -> list[SingleFileLayout]:
    """Every single-file layout the registered families declare."""
    return [layout for family in registry().families.values() for layout in family.single_files]


def detect_layout(keys: Iterable[str], path: Path | None = None, shapes: dict[str, Any] | None = None
                  ) -> SingleFileLayout:
    """The layout a checkpoint's keys (and `shapes`, where given) have (its original code's module names), or a
    VaeSpecError saying what the file (`path`, named in the message) is: a layout its family refuses, a diffusers
    weights file without its folder, or nothing vaecache knows."""
    where = f"{path}: " if path is not None else ""
    keys = list(keys)
    found = frozenset(key.removeprefix("vae.").removeprefix("first_stage_model.") for key in keys)
    matching = [layout for layout in layouts() if layout.detects(found, keys, shapes or {})]
    if len(matching) > 1:
        raise VaeSpecError(f"{where}its keys fit {' and '.join(layout.name for layout in matching)}: two families "
                           "declare layouts that overlap")
    if matching and matching[0].refusal:
        raise VaeSpecError(f"{where}{matching[0].refusal}")
    if matching:
        return matching[0]
    if any(key.startswith("encoder.down_blocks.") for key in found) and "encoder.conv_in.weight" in found:
        raise VaeSpecError(f"{where}a diffusers model's weights file on its own: pass the folder that holds it "
                           "with its config.json (--vae diffusers:FOLDER)")
    sample = ", ".join(sorted(found)[:3])
    readable = ", ".join(layout.name for layout in layouts() if layout.vae_class is not None)
    raise VaeSpecError(f"{where}not a VAE checkpoint vaecache knows (keys {sample}, ...): single files read: "
                       f"{readable}")


def detect_family(keys: Iterable[str], path: Path | None = None, shapes: dict[str, Any] | None = None) -> str:
    """The diffusers VAE class a checkpoint's layout loads into (detect_layout)."""
    return str(detect_layout(keys, path, shapes).vae_class)


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
    load_config(vae_config, detect_layout(keys, path, shapes), shapes, path)


def shipped_config_name(family: str, shapes: dict[str, Any]) -> str | None:
    """The file under vaecache/models/configs/ of the published model of class `family` whose layout and shapes the
    checkpoint has (its family's SingleFileLayout.config_name), or None (then --vae-config)."""
    for layout in layouts():
        if layout.vae_class == family and (name := layout.config_name(shapes)):
            return name
    return None


def shipped_config(family: str, shapes: dict[str, Any]) -> dict[str, Any] | None:
    """The published config of the family whose shapes the checkpoint has, or None (then --vae-config)."""
    name = shipped_config_name(family, shapes)
    return json.loads((CONFIGS / name).read_text()) if name else None


def load_config(given: Path | None, layout: SingleFileLayout, shapes: dict[str, Any], path: Path) -> dict[str, Any]:
    """--vae-config (a config.json, or a folder holding one), else the shipped config for these shapes."""
    family = str(layout.vae_class)
    if given is not None:
        file = given / "config.json" if given.is_dir() else given
        try:
            config = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise VaeSpecError(f"{file}: --vae-config is not a readable config.json ({exc})") from None
        named = config.get("_class_name") if isinstance(config, dict) else None
        if named != family and named not in layout.siblings:
            raise VaeSpecError(f"{file}: --vae-config is for {named!r}, the checkpoint {path.name} is a {family}")
        return config
    name = layout.config_name(shapes)
    if name is None:
        raise VaeSpecError(f"{path}: a {family} checkpoint, but {layout.no_config}: pass --vae-config "
                           "CONFIG.json (the config.json of the diffusers folder of the same model)")
    return json.loads((CONFIGS / name).read_text())


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
    layout = detect_layout(keys, path, shapes)
    config = load_config(config_path, layout, shapes, path)
    family = str(config.get("_class_name") or layout.vae_class)  # a sibling the given config names
    if family != layout.vae_class:
        layout = next(sibling for sibling in layouts() if sibling.vae_class == family)
    given = f"--vae-config {config_path}" if config_path else \
        f"the shipped config {layout.config_name(shapes)} (another size: pass --vae-config)"
    try:
        with torch.random.fork_rng(devices=[]):  # every tensor is overwritten from the file below
            module = getattr(diffusers, family).from_config(dict(config))
    except Exception as exc:  # noqa: BLE001  # diffusers raises many kinds for a config it cannot build
        raise VaeSpecError(f"{path}: {given} does not build a {family} ({first_line(exc, 200)})") from None
    tensors = _vae_tensors(path, layout, keys, state)
    if layout.converter is not None:
        convert = layout.converter()
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
    skipped = check_complete(path, family, given, module.state_dict(), tensors, converted, layout.leftovers)
    module.load_state_dict(converted, strict=True)
    check_finite(module.state_dict(), str(path))
    return SingleFile(module.to(torch.float32).eval(), family, file_sha256(path), skipped)


def _vae_tensors(path: Path, layout: SingleFileLayout, keys: list[str], state: dict[str, Any] | None
                 ) -> dict[str, Any]:
    """The tensors of the file's VAE part, by the family converter's own rule (a whole-model checkpoint holds others:
    LTX-Video's its transformer, SD's its UNet and text encoder); a safetensors file reads only these."""
    import torch

    if layout.vae_keys is not None:
        keys = layout.vae_keys(keys)
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


RECORDED_LEFTOVERS = ("model_ema.",)
"""Dropped tensors the recorded VAE config names (`single_file_skipped`: prefix -> count): an EMA copy beside the
weights says which weights were not used."""


def check_complete(path: Path, family: str, given: Any, expected: dict[str, Any], tensors: dict[str, Any],
                   converted: dict[str, Any], leftovers: tuple[str, ...] = ()) -> dict[str, int]:
    """Every parameter and persistent buffer of the module (`expected`) in the converted checkpoint with its shape,
    and every tensor of the file's VAE part used but the `leftovers` (key prefixes its family drops on purpose):
    diffusers' loader keeps a missing one's random initial value, and a converter drops what it does not map (an SD
    level the config does not have) without a word. Returns the recorded leftovers dropped (prefix -> count)."""
    missing = [key for key in expected if key not in converted]
    if missing:
        raise VaeSpecError(f"{path}: an incomplete {family} checkpoint for {given} (a weight would be left random): "
                           f"no tensor for {missing[0]} (diffusers' name), {len(missing)} of {len(expected)} missing")
    objects = {id(value) for value in converted.values()}
    memory = {value.data_ptr() for value in converted.values() if value.numel()}  # an SD attention weight is a view
    unused = [key for key, value in tensors.items()
              if id(value) not in objects and not (value.numel() and value.data_ptr() in memory)]
    skipped = {prefix: [key for key in unused if _bare(key).startswith(prefix)] for prefix in leftovers}
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
