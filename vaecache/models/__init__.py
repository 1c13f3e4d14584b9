"""The model families vaecache knows, one module each, and the registry the engines read.

A family is a model people train (HunyuanVideo, FramePack, Kandinsky 5, ...), not a VAE class: one class can serve
several, each encoding with it as its own trainers do (`base.ReferenceEncode`). `encode --model NAME` names the
family where the VAE class does not tell it; the cache records it (`vae.model` and `vae.reference_encode` in the
manifest). Importable without torch."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any, Mapping

from vaecache.errors import UsageError, VaeSpecError, first_line
from vaecache.models.base import Family, FastEncoder, ReferenceEncode, SingleFileLayout, VaeClass
from vaecache.models.rules import FrameRule

ENTRY_POINT_GROUP = "vaecache.families"
"""Installed packages declare families here: `name = "package.module:FAMILY"`, a `Family` (or a module holding one
as FAMILY), loaded when the registry is first read."""


class FamilyPluginError(UsageError):
    """A `vaecache.families` entry point that cannot be loaded, or declares what another family already does."""


class Registry:
    """The families (built-in modules of this package, then installed entry points) and the VAE classes they
    declare, read once."""

    def __init__(self, families: list[Family]) -> None:
        self.families: dict[str, Family] = {}
        self.vae_classes: dict[str, VaeClass] = {}
        for family in families:
            if family.name in self.families:
                raise FamilyPluginError(f"model family {family.name!r} is declared twice")
            self.families[family.name] = family
            for vae in family.vaes:
                if vae.name in self.vae_classes:
                    raise FamilyPluginError(f"VAE class {vae.name} is declared twice (family {family.name})")
                self.vae_classes[vae.name] = vae


def built_in_modules() -> list[ModuleType]:
    """This package's family modules, by name: every public module holding a FAMILY (a leading underscore marks a
    module a family owns and imports itself, with torch)."""
    found = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)
             if not info.name.startswith("_")]
    return sorted((module for module in found if isinstance(getattr(module, "FAMILY", None), Family)),
                  key=lambda module: module.__name__)


def installed_families() -> list[Family]:
    """The families installed packages declare (`vaecache.families` entry points); a broken one is a one-line
    FamilyPluginError naming it."""
    from importlib.metadata import entry_points

    found: list[Family] = []
    seen: set[str] = set()
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name):
        if point.value in seen:  # one package seen twice on sys.path
            continue
        seen.add(point.value)
        where = f"the {ENTRY_POINT_GROUP} entry point {point.name} = {point.value}"
        try:
            loaded = point.load()
        except Exception as exc:  # noqa: BLE001 - any failure of someone else's import is reported as one line
            raise FamilyPluginError(f"{where} cannot be loaded: {type(exc).__name__}: {first_line(exc)}") from None
        family = getattr(loaded, "FAMILY", loaded) if isinstance(loaded, ModuleType) else loaded
        if not isinstance(family, Family):
            raise FamilyPluginError(f"{where} is a {type(family).__name__}, not a vaecache.models.Family")
        found.append(family)
    return found


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The families and VAE classes vaecache knows, read on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        built_in = [module.FAMILY for module in built_in_modules()]
        _REGISTRY = Registry(built_in + installed_families())
    return _REGISTRY


def __getattr__(name: str) -> Any:
    if name == "FAMILIES":
        return registry().families
    if name == "VAE_CLASSES":
        return registry().vae_classes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def vae_class(name: str | None) -> VaeClass | None:
    """What vaecache knows of a diffusers VAE class (None: no family declares it)."""
    return registry().vae_classes.get(name or "")


def supported_classes() -> str:
    """The VAE classes vaecache loads from a diffusers folder, for messages."""
    return ", ".join(registry().vae_classes)


def require_vae_class(name: Any, where: str) -> VaeClass:
    """The VAE class a config.json's `_class_name` names, or a VaeSpecError listing the ones vaecache knows."""
    found = vae_class(name) if isinstance(name, str) else None
    if found is None:
        raise VaeSpecError(f"{where}: VAE class {name!r} is not supported; supported: {supported_classes()} "
                           "(anything else: --vae python:module:function)")
    return found


def rule_of_config(config: Mapping[str, Any], model: str | None = None, where: str = "config.json") -> FrameRule:
    """The frame rule (frame counts and, through its size rule, frame sizes) a VAE of this config.json encodes for
    `model` (--model; default: its class's own family), without torch: the class from `_class_name`, its rule read
    from the config, then the family's own. A VaeSpecError or UsageError says what is wrong."""
    vae = require_vae_class(config.get("_class_name"), where)
    rule = vae.rule(config)
    family = family_for(vae.name, model, where)
    return family.rule(rule) if family is not None else rule


def families_of_class(class_name: str) -> list[Family]:
    """The families that train on this VAE class's latents, its default first."""
    serving = [family for family in registry().families.values() if class_name in family.vae_classes]
    return sorted(serving, key=lambda family: class_name not in family.default_for)


def family_for(class_name: str, requested: str | None, where: str) -> Family | None:
    """The family a VAE of `class_name` encodes for: `requested` (--model), checked to train on that class, or the
    class's default; None for a class no family declares (a python: plugin). A UsageError names the choices."""
    serving = families_of_class(class_name)
    if requested is None:
        return serving[0] if serving else None
    families = registry().families
    family = families.get(requested)
    if family is None:
        raise UsageError(f"--model {requested!r} is not a model vaecache knows; models: {', '.join(families)}")
    if class_name not in family.vae_classes:
        others = ", ".join(f.name for f in serving) or "none: its latents are recorded without a model"
        raise UsageError(f"--model {requested}: {family.label} trains on {', '.join(family.vae_classes)} latents; "
                         f"{where} is {class_name} (its models: {others})")
    return family


def recorded_family(vae: Mapping[str, Any]) -> tuple[Family | None, ReferenceEncode | None]:
    """The family and reference encode a cache's `vae` record names. A cache written before they were recorded
    gets its class's default family and the encode vaecache ran then: diffusers' default (HunyuanVideo's time tiles
    above 16 frames), the family's own reference for every other class."""
    class_name = str(vae.get("family"))
    name = vae.get("model")
    if isinstance(name, str):
        family = registry().families.get(name)
    else:
        family = (families_of_class(class_name) or [None])[0]
    if family is None:
        return None, None
    record = vae.get("reference_encode")
    if record is None and "model" not in vae:
        return family, (family.legacy_references or (family.reference,))[0]
    return family, family.reference_recorded(record if isinstance(record, Mapping) else None)


def unrecorded_vae_part(vae: Mapping[str, Any]) -> dict[str, Any]:
    """A VAE fingerprint written before the family was recorded, in today's terms (its family and the encode that
    made it), so a resume or a reload compares like with like."""
    if "model" in vae or "family" not in vae:
        return dict(vae)
    family, reference = recorded_family(vae)
    if family is None or reference is None:
        return dict(vae)
    return {**vae, "model": family.name, "reference_encode": reference.record()}


def encode_problem(vae: Mapping[str, Any], settings: Mapping[str, Any], record: Mapping[str, Any]) -> str | None:
    """Why a clip's latents are not the ones its family's trainers make (None where they are): encoded with the VAE's
    own tiling (--tiling, or the out-of-memory fallback), or by an older vaecache's encode that tiled it in time."""
    if settings.get("tiling"):
        return "encoded with the VAE's own tiling (--tiling)"
    encode = record.get("encode")
    if isinstance(encode, Mapping) and encode.get("tiled"):
        cameras = ", ".join(map(str, encode.get("tiled_cameras") or [])) or "some camera"
        return f"{cameras} encoded with the VAE's own tiling after running out of memory"
    family, reference = recorded_family(vae)
    if family is None or reference is None or reference is family.reference:
        return None
    frames = len(record.get("frames") or [])
    if reference.time_tiles_above is not None and frames > reference.time_tiles_above:
        return (f"its {frames} frames were tiled in time ({reference.description}; vaecache 0.6 and earlier, before "
                "the encode was recorded)")
    return None


__all__ = ["ENTRY_POINT_GROUP", "FAMILIES", "VAE_CLASSES", "FastEncoder", "Family", "FamilyPluginError", "FrameRule",
           "ReferenceEncode", "Registry", "SingleFileLayout", "VaeClass", "built_in_modules", "encode_problem",
           "families_of_class",
           "family_for", "installed_families", "recorded_family", "registry", "require_vae_class", "rule_of_config",
           "supported_classes", "unrecorded_vae_part", "vae_class"]
