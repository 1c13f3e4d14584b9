"""--vae specs without loading anything (light enough for the CLI): made absolute so a recorded spec works from any
directory, and checked before the dataset is probed (a typo must not cost a probe of a million videos).

A spec is `builtin:tiny|small`, `python:module:function`, `diffusers:PATH[#subfolder]` (a diffusers folder, or a
single checkpoint file), or a bare PATH (a single checkpoint file, or a diffusers folder)."""

from __future__ import annotations

import re
from pathlib import Path

from vaecache.errors import VaeSpecError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_id_answer(spec: str) -> str:
    """One line for a --vae that names a Hugging Face Hub repository: how to get its VAE folder and what to pass."""
    local = spec.rsplit("/", 1)[1]
    return (f"--vae {spec} looks like a Hugging Face Hub id; vaecache reads local files only: download the VAE with "
            f"`huggingface-cli download {spec} --include 'vae/*' --local-dir ./{local}` and pass "
            f"--vae diffusers:./{local}#vae (a single file such as Wan2.1_VAE.pth: --vae PATH)")


BUILTINS = ("builtin:tiny", "builtin:small")
CHECKPOINT_SUFFIXES = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin")
KINDS = "builtin:tiny, builtin:small, diffusers:FOLDER[#subfolder], a checkpoint file (PATH.safetensors), or " \
        "python:module:function"


def _path_part(spec: str) -> tuple[str, str, str] | None:
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
    parts = _path_part(spec)
    if parts is None or not parts[1] or not Path(parts[1]).expanduser().exists():
        return spec  # nothing there: left as typed, for check_vae_spec to answer (a Hub id, a typo)
    prefix, path, sub = parts
    return f"{prefix}{Path(path).expanduser().absolute()}{sub}"


def check_vae_spec(spec: str, vae_config: str | None = None, allow_pickle_weights: bool = False) -> None:
    """Refuse, in one line, a spec that cannot name a VAE: an unknown builtin, a path that does not exist, a Hub id
    (how to download it), a malformed python: spec, a --vae-config that does not exist; and for a single checkpoint
    file what its header already says (vaecache.vae.single_file.check_single_file: its family, its config, a pickle
    without --allow-pickle-weights)."""
    if not spec:
        raise VaeSpecError(f"--vae is required ({KINDS})")
    if spec.startswith("builtin:"):
        if spec not in BUILTINS:
            raise VaeSpecError(f"unknown builtin VAE {spec.partition(':')[2]!r} in {spec!r}: the builtins are "
                               f"{', '.join(BUILTINS)}")
    elif spec.startswith("python:"):
        module, _, function = spec[len("python:"):].rpartition(":")
        if not module or not function:
            raise VaeSpecError(f"{spec!r}: expected python:module.path:function")
    else:
        prefix, path_text, _ = _path_part(spec)  # type: ignore[misc]
        path = Path(path_text).expanduser()
        if not path_text:
            raise VaeSpecError(f"{spec!r}: expected diffusers:PATH[#subfolder]")
        if not path.exists():
            if not prefix and HUB_ID.match(spec):
                raise VaeSpecError(hub_id_answer(spec))
            if f"builtin:{spec}" in BUILTINS:
                raise VaeSpecError(f"unknown VAE spec {spec!r} (did you mean builtin:{spec}?)")
            if not prefix:
                raise VaeSpecError(f"unknown VAE spec {spec!r}: no such file or folder; use {KINDS}")
            raise VaeSpecError(f"{path}: diffusers VAE folder not found (nor a checkpoint file of that name)")
        if path.is_file() and path.suffix.lower() not in CHECKPOINT_SUFFIXES:
            raise VaeSpecError(f"{path}: not a checkpoint file vaecache reads ({', '.join(CHECKPOINT_SUFFIXES)}); a "
                               "diffusers VAE is a folder with config.json")
    if vae_config is not None:
        config = Path(vae_config).expanduser()
        if not config.exists():
            raise VaeSpecError(f"{config}: --vae-config not found")
        if not (spec.startswith("diffusers:") or not spec.startswith(("builtin:", "python:"))) or \
                not Path(_path_part(spec)[1]).expanduser().is_file():  # type: ignore[index]
            raise VaeSpecError("--vae-config goes with a single checkpoint file (--vae PATH.safetensors); a diffusers "
                               "folder has its own config.json")
    parts = _path_part(spec)
    if parts is not None and Path(parts[1]).expanduser().is_file():
        from vaecache.vae.single_file import check_single_file

        check_single_file(Path(parts[1]).expanduser(), Path(vae_config).expanduser() if vae_config else None,
                          allow_pickle_weights)


__all__ = ["BUILTINS", "CHECKPOINT_SUFFIXES", "HUB_ID", "check_vae_spec", "hub_id_answer", "resolve_vae_spec"]
