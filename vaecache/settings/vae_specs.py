"""--vae specs without loading anything (light enough for the CLI): made absolute so a recorded spec works from any
directory, and checked before the dataset is probed (a typo must not cost a probe of a million videos).

A spec is `builtin:tiny|small`, `python:module:function`, `diffusers:PATH[#subfolder]` (a diffusers folder, or a
single checkpoint file), or a bare PATH (a single checkpoint file, or a diffusers folder)."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_id_answer(spec: str) -> str:
    """One line for a --vae that names a Hugging Face Hub repository: how to get its VAE folder and what to pass."""
    local = spec.rsplit("/", 1)[1]
    return (f"--vae {spec} looks like a Hugging Face Hub id; vaecache reads local files only: download the VAE with "
            f"`hf download {spec} --include 'vae/*' --local-dir ./{local}` and pass "
            f"--vae diffusers:./{local}#vae (a single file such as Wan2.1_VAE.pth: --vae PATH)")


BUILTINS = ("builtin:tiny", "builtin:small")
CHECKPOINT_SUFFIXES = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin")
KINDS = "builtin:tiny, builtin:small, diffusers:FOLDER[#subfolder], a checkpoint file (PATH.safetensors), or " \
        "python:module:function"


def path_part(spec: str) -> tuple[str, str, str] | None:
    """(prefix, path, #subfolder) of a spec that names a path, else None."""
    if spec.startswith("diffusers:"):
        path, sep, sub = spec[len("diffusers:"):].partition("#")
        return "diffusers:", path, sep + sub
    if spec.startswith(("builtin:", "python:")):
        return None
    return "", spec, ""


def resolve_vae_spec(spec: str) -> str:
    """The spec with its path made absolute (`~` expanded): what a cache records, so `decode` and `verify
    --reencode` find the VAE from any directory."""
    parts = path_part(spec)
    if parts is None or not parts[1] or not Path(parts[1]).expanduser().exists():
        return spec  # nothing there: left as typed, for vae.specs.check_vae_spec to answer (a Hub id, a typo)
    prefix, path, sub = parts
    return f"{prefix}{Path(path).expanduser().absolute()}{sub}"


__all__ = ["BUILTINS", "CHECKPOINT_SUFFIXES", "HUB_ID", "hub_id_answer", "resolve_vae_spec"]
