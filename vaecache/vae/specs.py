"""A --vae spec checked before anything loads: what can be told from the spec and the files it names, in one line
(vaecache.settings.vae_specs holds the spec's grammar; a single checkpoint file's header is vaecache.vae.single_file's
to read)."""

from __future__ import annotations

from pathlib import Path

from vaecache.errors import VaeSpecError
from vaecache.settings.vae_specs import BUILTINS, CHECKPOINT_SUFFIXES, HUB_ID, KINDS, hub_id_answer, path_part


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
        prefix, path_text, _ = path_part(spec)  # type: ignore[misc]
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
                not Path(path_part(spec)[1]).expanduser().is_file():  # type: ignore[index]
            raise VaeSpecError("--vae-config goes with a single checkpoint file (--vae PATH.safetensors); a diffusers "
                               "folder has its own config.json")
    parts = path_part(spec)
    if parts is not None and Path(parts[1]).expanduser().is_file():
        from vaecache.vae.single_file import check_single_file

        check_single_file(Path(parts[1]).expanduser(), Path(vae_config).expanduser() if vae_config else None,
                          allow_pickle_weights)


def spec_family(spec: str) -> str | None:
    """The diffusers class a `diffusers:FOLDER[#subfolder]` spec's config.json names, read without loading anything
    (None: another kind of spec, or a config that does not say)."""
    import json

    parts = path_part(spec)
    if parts is None or parts[0] != "diffusers:":
        return None
    folder = Path(parts[1]).expanduser() / parts[2].lstrip("#") if parts[2] else Path(parts[1]).expanduser()
    try:
        name = json.loads((folder / "config.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


__all__ = ["check_vae_spec", "spec_family"]
