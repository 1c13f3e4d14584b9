"""Reading a model's weights from files, strictly: every model vaecache loads (a VAE from a diffusers folder or a
single file, a text encoder, an image encoder, any family added later) comes through here, so that a weight the
file lacks, a tensor the model has no place for, a tensor of the wrong shape or a weight that is NaN or Inf is one
line naming the file and the first such key, never a random initialization (transformers and diffusers fill a
missing weight with random values and warn) or latents computed from garbage.

Below every model package: it imports only torch, the errors and, inside the loaders, the library that owns the
class.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from vaecache.errors import VaeSpecError, first_line

SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
"""The safetensors dtypes torch reads, and the bytes of one element."""
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}
HEADER_LIMIT = 100 << 20
"""safetensors' own limit on a header's size."""


class WeightsError(VaeSpecError):
    """A model's weights cannot be used as they are: a damaged file, a weight missing, left over, misshapen or not
    finite (exit 2: the files given are wrong, not the run)."""


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then the JSON): names, dtypes, shapes, read
    without torch or the tensors. Checked as safetensors itself checks it (every entry {dtype, shape, data_offsets}
    whose bytes fit its shape, the entries tiling the data exactly; "__metadata__" strings only), so that whatever
    is wrong is one line naming the file."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            size = int.from_bytes(prefix, "little")
            if len(prefix) < 8 or not 2 <= size <= HEADER_LIMIT:
                raise ValueError(f"a header of {size} bytes" if len(prefix) == 8 else "shorter than 8 bytes")
            text = handle.read(size)
            if len(text) < size:
                raise ValueError(f"the header is cut short ({len(text)} of {size} bytes)")
            header = json.loads(text, parse_constant=_no_constant)
            data_size = os.fstat(handle.fileno()).st_size - 8 - size
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({first_line(exc, 200)})") from None
    problem = _header_problem(header, data_size)
    if problem:
        raise WeightsError(f"{path}: not a readable safetensors file ({problem})")
    return header


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} in the header, which is not JSON")


def _header_problem(header: Any, data_size: int) -> str | None:
    """What is wrong with a parsed safetensors header, or None."""
    if not isinstance(header, dict):
        return f"the header is {JSON_TYPES.get(type(header), 'a value')}, not a JSON object"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(value, str) for value in entry.values()):
                return "__metadata__ is not an object of strings"
            continue
        if not isinstance(entry, dict):
            return f"the entry {name!r} is {JSON_TYPES.get(type(entry), 'a value')}, not an object"
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            return f"{name!r} has dtype {repr(dtype)[:40]}, not one of {', '.join(SAFETENSORS_DTYPES)}"
        if not _counts(shape):
            return f"{name!r} has shape {repr(shape)[:60]}, not a list of non-negative integers"
        if not _counts(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            return f"{name!r} has data_offsets {repr(offsets)[:60]}, not [begin, end]"
        needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if offsets[1] - offsets[0] != needed:
            return f"{name!r} is {dtype} of shape {shape}, {needed} bytes, but its data_offsets hold " \
                   f"{offsets[1] - offsets[0]}"
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            return f"{name!r} starts at byte {begin} of the data, not {end} (tensors overlap or leave a hole)"
        end = stop
    if end != data_size:
        return f"the tensors hold {end} bytes of data, the file {data_size}"
    return None


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(type(item) is int and item >= 0 for item in value)


def weights_sha256(module: Any) -> str:
    """sha256 over every parameter and persistent buffer (name, dtype, shape, bytes) in name order. A 0-dim tensor
    (LTX-Video 0.9.1's decoder.timestep_scale_multiplier) is hashed as its one element."""
    digest = hashlib.sha256()
    state = module.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(_tensor_bytes(tensor) if tensor.numel() else b"")
    return digest.hexdigest()


def _tensor_bytes(tensor: Any) -> bytes:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def check_finite(state: Mapping[str, Any], where: str) -> None:
    """Every floating tensor of `state` (a model's state dict) finite: a NaN or Inf weight would make every latent or
    embedding NaN, so it is refused before anything is written, naming `where` and the first such tensor."""
    import torch

    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
            raise WeightsError(f"{where}: weight {name} holds {kind} ({bad} of {tensor.numel()} values not finite): "
                               "the file is damaged or was saved from a diverged model")


def check_loading_info(info: Mapping[str, Any], where: str, model: str, parts: Iterable[str] | None = None) -> None:
    """The loading report of transformers' or diffusers' from_pretrained(output_loading_info=True) (missing_keys,
    unexpected_keys, mismatched_keys as (key, file shape, model shape)) turned into one refusal naming `where` and the
    first key, or nothing when every weight of the model came from the files and every tensor of the files was used.

    `parts`: the top-level names of the model's own modules and weights, where the files may hold more than the model
    (a transformers base model read from a checkpoint with a task head: a causal LM's `lm_head`, a VLM's `visual`):
    then only an unexpected tensor under one of the model's own parts is refused."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise WeightsError(f"{where}: an incomplete {model} checkpoint (a weight would be left random): no tensor for "
                           f"{missing[0]}, {len(missing)} missing")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if parts is not None:
        own = set(parts)
        unexpected = [key for key in unexpected if key.split(".")[0] in own]
    if unexpected:
        raise WeightsError(f"{where}: tensors the {model} has no place for: {unexpected[0]}, {len(unexpected)} unknown")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda item: item[0])
    if mismatched:
        key, found, wanted = mismatched[0]
        raise WeightsError(f"{where}: tensors of other shapes than the {model} of its config: {key} is "
                           f"{list(found)}, not {list(wanted)}, {len(mismatched)} differ")
    errors = [str(error) for error in info.get("error_msgs") or () if str(error).strip()]
    if errors:
        raise WeightsError(f"{where}: {model} did not load ({first_line(Exception(errors[0]), 200)})")


def weights_files(folder: Path, allow_pickle_weights: bool) -> list[Path]:
    """The weights files a from_pretrained of `folder` reads (safetensors; pickles only where allowed and no
    safetensors file exists)."""
    found = sorted(folder.glob("*.safetensors"))
    if found or not allow_pickle_weights:
        return found
    return sorted(path for pattern in ("*.bin", "*.pt", "*.pth") for path in folder.glob(pattern))


def describe_files(folder: Path, files: list[Path]) -> str:
    """What a message names: the one weights file, or the folder of a sharded checkpoint."""
    return str(files[0]) if len(files) == 1 else f"{folder} ({len(files)} weights files)" if files else str(folder)


def load_pretrained(cls: Any, folder: Path, *, allow_pickle_weights: bool = False, **kwargs: Any) -> Any:
    """`cls.from_pretrained(folder)` (a transformers PreTrainedModel or a diffusers ModelMixin class), strictly: the
    safetensors headers checked first, the library's loading report refused where a weight is missing, left over or
    misshapen (check_loading_info), and every weight finite. Local files only. A WeightsError (one line naming the
    file and the key) for whatever is wrong with the files."""
    files = weights_files(folder, allow_pickle_weights)
    where = describe_files(folder, files)
    for path in files:  # a file cut short by a failed download: one line naming it, not a SafetensorError
        if path.suffix == ".safetensors":
            safetensors_header(path)
    name = getattr(cls, "__name__", str(cls))
    options: dict[str, Any] = {"output_loading_info": True, "ignore_mismatched_sizes": True, **kwargs}
    if _is_transformers(cls):
        options.setdefault("local_files_only", True)
    try:
        module, info = cls.from_pretrained(str(folder), **options)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as exc:
        raise WeightsError(f"{where}: cannot load {name} ({first_line(exc, 200)})") from None
    except Exception as exc:  # noqa: BLE001  # safetensors' and the libraries' own error types
        raise WeightsError(f"{where}: cannot load {name} ({type(exc).__name__}: {first_line(exc, 200)})") from None
    parts = None
    if _is_transformers(cls):  # a base model may be read from a checkpoint that also holds a task head
        parts = [child for child, _ in module.named_children()] + \
            [weight for weight, _ in module.named_parameters(recurse=False)] + \
            [buffer for buffer, _ in module.named_buffers(recurse=False)] + \
            [str(getattr(module, "base_model_prefix", "") or "")]  # a head checkpoint's `model.` is the base model
    check_loading_info(info, where, type(module).__name__, parts)
    check_finite(module.state_dict(), where)
    return module


def _is_transformers(cls: Any) -> bool:
    return any(base.__module__.startswith("transformers.") for base in getattr(cls, "__mro__", ()))


def read_json_file(path: Path, what: str, limit: int = 16 << 20) -> Any:
    """A small JSON file (a config, a processor's settings) read and parsed: a WeightsError naming it when it is not
    a regular file, too large, not UTF-8 or not JSON."""
    try:
        if not path.is_file():
            raise WeightsError(f"{path}: {what} is not a regular file")
        size = path.stat().st_size
        if size > limit:
            raise WeightsError(f"{path}: {what} is {size} bytes, more than the {limit} a config may have")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WeightsError(f"{path}: {what} does not parse ({first_line(exc, 200)})") from None


__all__ = ["SAFETENSORS_DTYPES", "WeightsError", "check_finite", "check_loading_info",
           "load_pretrained", "read_json_file", "safetensors_header", "weights_files", "weights_sha256"]
