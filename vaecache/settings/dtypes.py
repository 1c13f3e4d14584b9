"""The one table of dtype names: what the CLI accepts, what caches record, and the torch dtype behind each.

Importing this module does not import torch (config parsing and ``--help`` stay fast); only
``torch_dtype`` does, when it is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vaecache.errors import UsageError

if TYPE_CHECKING:
    import torch

RECORDED_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""CLI name (``--dtype``) -> the name manifests and clip records use (torch's, without ``torch.``)."""
DTYPE_CHOICES: tuple[str, ...] = tuple(RECORDED_NAMES)
"""The names ``--dtype`` accepts."""
REENCODE_TOLERANCE: dict[str, float] = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
"""`verify --reencode`'s default tolerance by stored dtype: max abs difference over max abs stored value (latents,
text rows, conditions)."""
SAFETENSORS_NAMES: dict[str, str] = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""Recorded name -> the dtype a safetensors header states."""


DTYPE_ALIASES: dict[str, str] = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                                 "half": "fp16"}
"""torch's names for the --dtype choices, accepted and stored as the short names."""


def canonical_dtype_name(name: str) -> str:
    """fp32, bf16 or fp16 for a --dtype given by torch's name too (bfloat16, float16, float32)."""
    return DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name


def check_dtype_name(name: str) -> str:
    """`name` if it is a ``--dtype`` choice; UsageError otherwise."""
    if name not in RECORDED_NAMES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (fp32, bf16, fp16)."""
    import torch

    return getattr(torch, RECORDED_NAMES[check_dtype_name(name)])


def recorded_name(dtype: torch.dtype) -> str:
    """The recorded name of a torch dtype this table knows (torch.bfloat16 -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in RECORDED_NAMES.values():
        raise UsageError(f"dtype {dtype} is not one of {', '.join(RECORDED_NAMES.values())}")
    return name


__all__ = ["DTYPE_ALIASES", "DTYPE_CHOICES", "RECORDED_NAMES", "SAFETENSORS_NAMES", "canonical_dtype_name",
           "check_dtype_name", "recorded_name", "torch_dtype"]
