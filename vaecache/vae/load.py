"""Resolving a --vae spec (builtin, diffusers folder, python plugin) into a ready VaeRunner."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch

from vaecache import models
from vaecache.errors import UsageError, VaeSpecError, first_line
from vaecache.models import FastEncoder, VaeClass, require_vae_class, vae_class
from vaecache.models.rules import FrameRule
from vaecache.settings.clip import ENCODER_IMPL_CHOICES
from vaecache.settings.dtypes import check_dtype_name, torch_dtype
from vaecache.vae.model import CHANNELS_LAST, VaeModel
from vaecache.vae.runner import VaeRunner, oom_hook_from_env
from vaecache.vae.specs import check_vae_spec
from vaecache.weights import check_finite, load_pretrained, weights_sha256

log = logging.getLogger("vaecache")

BUILTIN_TINY_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
BUILTIN_TINY_SEED = 20240601
BUILTIN_SMALL_WEIGHTS = Path(__file__).resolve().parent / "weights" / "builtin_small.safetensors"
"""builtin:small: a Wan-architecture VAE trained on demo-style footage (scripts/train_builtin_vae.py); config in
metadata."""
BUILTIN_FAMILY = "wan"
"""The model family whose VAE class the builtins are (BUILTIN_TINY_CONFIG is that class's config)."""
BUILTINS = ("builtin:tiny", "builtin:small")


def load_vae(spec: str, device: torch.device | str = "cpu", dtype: str = "fp32", *, tiling: bool = False,
             views_per_forward: int = 1, tile_options: dict[str, Any] | None = None,
             allow_pickle_weights: bool = False, compiled: bool = False, channels_last: bool = False,
             vae_config: str | None = None, encoder_impl: str = "auto", model: str | None = None,
             reference: Mapping[str, Any] | None = None) -> VaeRunner:
    """Resolve a --vae SPEC (builtin:tiny|small, diffusers:PATH[#subfolder], a single checkpoint file PATH,
    python:module:function) and get it ready. `vae_config`: the config.json of a single checkpoint file whose family
    has no shipped config (vaecache.vae.single_file).

    `tile_options` go to the module's enable_tiling() (e.g. tile_sample_min_height); they are recorded
    in the fingerprint whether or not tiling ends up used. A diffusers folder is read from safetensors
    only, unless `allow_pickle_weights` lets a folder holding only pickled ``.bin`` weights load. `compiled`:
    the runner calls encode through torch.compile; `channels_last`: 3-d and 2-d convolution weights and every
    forward's input in channels-last memory format (both recorded in the fingerprint); `encoder_impl`: auto, fast
    or reference (resolve_encoder_impl; the resolved one is recorded); `model`: the model family the latents are for
    (--model; default: the VAE class's own, vaecache.models), whose trainers' encode every untiled forward runs, or
    `reference`, the encode a cache recorded (decode and --reencode of a cache made before it was recorded).
    """
    check_vae_spec(spec, vae_config, allow_pickle_weights)
    check_dtype_name(dtype)
    if isinstance(views_per_forward, bool) or not isinstance(views_per_forward, int) or views_per_forward < 1:
        raise UsageError(f"--views-per-forward must be an integer >= 1, got {views_per_forward!r}")
    inject_oom = oom_hook_from_env()  # a malformed VAECACHE_FAULT is refused before any weight loads
    kind, _, rest = spec.partition(":")
    if kind == "builtin":
        loaded = _load_builtin(rest, spec)
    elif kind == "python":
        loaded = _load_python(rest, spec)
    else:  # diffusers:PATH, or a bare PATH: a folder, or one checkpoint file
        location = rest if kind == "diffusers" else spec
        target = Path(location.partition("#")[0] if kind == "diffusers" else location).expanduser()
        if target.is_file():
            loaded = _load_file(target, spec, vae_config, allow_pickle_weights)
        else:
            loaded = _load_diffusers(location, spec, allow_pickle_weights)
    loaded = with_family(loaded, model, reference)
    compute_dtype, dtype_note = _compute_dtype(loaded, dtype)
    impl = resolve_encoder_impl(encoder_impl, loaded, tiling=tiling, compiled=compiled, device=device,
                                compute_dtype=compute_dtype)
    exact_cuda_numerics(device)
    module = loaded.module
    module.to(torch.device(device)).eval().requires_grad_(False)
    if compute_dtype != torch.float32:  # weights load as fp32; casting to fp32 again only makes diffusers warn
        module.to(compute_dtype)
    tile_params = _setup_tiling(loaded, tiling, tile_options or {})
    if channels_last:
        for param in module.parameters():
            if param.dim() in CHANNELS_LAST:
                param.data = param.data.contiguous(memory_format=CHANNELS_LAST[param.dim()])
    variant = None
    if impl == "fast":
        variant = _declared(loaded).fast_encoder.implementation().production_description(module, device)
    loaded = replace(loaded, device=torch.device(device), dtype=torch_dtype(dtype), compute_dtype=compute_dtype,
                    dtype_note=dtype_note, tiling=tiling, tile_params=tile_params,
                    views_per_forward=views_per_forward, compiled=compiled,
                    channels_last=channels_last, encoder_impl=impl, encoder_variant=variant)
    return VaeRunner(loaded, inject_oom)


def with_family(loaded: VaeModel, model: str | None, reference: Mapping[str, Any] | None) -> VaeModel:
    """The loaded VAE with its model family (vaecache.models): --model checked against the VAE's class, or the class's
    own family; that family's frame rule and the encode its trainers make (or the one a cache recorded)."""
    family = models.family_for(loaded.family, model, loaded.spec)
    if family is None:
        return loaded
    chosen = family.reference_recorded(reference)
    if chosen is None:
        raise VaeSpecError(f"{loaded.spec}: the encode recorded for {family.label} ({dict(reference or {})}) is not "
                           "one this vaecache knows")
    return replace(loaded, model=family.name, reference=chosen, rule=family.rule(loaded.rule))


def _declared(model: VaeModel) -> Any:
    """What the model's family declares of its class (vaecache.models.VaeClass), or None (a python: plugin)."""
    return vae_class(type(model.module).__name__)


def resolve_encoder_impl(requested: str, model: VaeModel, *, tiling: bool = False, compiled: bool = False,
                         device: torch.device | str = "cpu", compute_dtype: torch.dtype = torch.float32) -> str:
    """--encoder-impl: "fast" or "reference". The fast encoder equals diffusers' within rounding (1e-5 of the
    latent's scale in fp32 on CPU); auto picks it where it was also measured faster and bitwise reproducible
    across processes (its family's FastEncoder.validated), else the reference; fast is refused where it cannot
    run. A resumed run passes the recorded choice instead of auto (encode/command.py), so an upgrade never mixes the two
    in one cache."""
    if requested not in ENCODER_IMPL_CHOICES:
        raise UsageError(f"--encoder-impl must be one of {', '.join(ENCODER_IMPL_CHOICES)}, got {requested!r}")
    if requested == "reference":
        return "reference"
    name = type(model.module).__name__
    declared = _declared(model)
    fast = declared.fast_encoder if declared is not None else None
    if requested == "auto":
        return "fast" if (fast is not None and not tiling and not compiled
                          and _fast_validated(fast, model, device, compute_dtype)) else "reference"
    if fast is None:
        from vaecache.models import registry

        runs = [f"{vae.name} ({vae.fast_encoder.describes})" for vae in registry().vae_classes.values()
                if vae.fast_encoder is not None]
        raise UsageError(f"--encoder-impl fast: {model.spec} is {name}; the fast encoder runs "
                         f"{', '.join(runs)}: use --encoder-impl reference")
    if tiling:
        raise UsageError("--encoder-impl fast cannot be combined with --tiling (every forward would run diffusers' "
                         "tiled encode)")
    if compiled:
        raise UsageError("--encoder-impl fast cannot be combined with --compile (which compiles diffusers' encode)")
    return "fast"


def _fast_validated(fast: FastEncoder, model: VaeModel, device: torch.device | str,
                    compute_dtype: torch.dtype) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    width = getattr(getattr(model.module, "encoder", None), "conv_in", None)
    key = (device.type, str(compute_dtype).removeprefix("torch."), torch.cuda.get_device_capability(device),
           getattr(width, "out_channels", None))
    return key in fast.validated and fast.implementation().triton_available()


CUDA_NUMERICS = {"cudnn_benchmark": False, "cudnn_deterministic": True, "tf32": False}
"""What exact_cuda_numerics sets on CUDA (the manifest's producer.cuda_numerics)."""


def exact_cuda_numerics(device: torch.device | str) -> dict[str, bool]:
    """On CUDA, numerics that do not change from process to process and mean what the dtype says: cuDNN picks
    convolution algorithms by its fixed heuristic (benchmark autotuning may pick another algorithm in another
    process, hence other bits), deterministic algorithms only, and no TF32 (on by default for cuDNN
    convolutions on Ampere and newer, where "fp32" would multiply with 10-bit mantissas). Returns the flags
    (recorded in the manifest's producer); nothing changes on other devices."""
    if torch.device(device).type != "cuda":
        return {}
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return dict(CUDA_NUMERICS)


def _compute_dtype(model: VaeModel, dtype: str) -> tuple[torch.dtype, str | None]:
    """The dtype the module runs in: refuse or upcast fp16 where a family is known to misbehave."""
    requested = torch_dtype(dtype)
    declared = vae_class(model.family)
    if requested != torch.float16 or declared is None or declared.fp16 == "ok":
        return requested, None
    if declared.fp16 == "refuse":
        raise UsageError(f"--dtype fp16 is refused for {model.family}: {declared.fp16_reason}")
    if model.config.get("force_upcast", True):
        note = (f"--dtype fp16: {model.family} runs in fp32 and its latents are stored as fp16, "
                f"because {declared.fp16_reason}")
        log.warning(note)
        return torch.float32, note
    return requested, None


def _setup_tiling(model: VaeModel, tiling: bool, options: dict[str, Any]) -> dict[str, Any]:
    """Configure the module's tiling (on only with --tiling) and return the tile parameters to record."""
    module = model.module
    if (tiling or options) and not model.can_tile:
        raise UsageError(f"--tiling: {model.spec} ({model.family}) has no enable_tiling()/disable_tiling()")
    if not model.can_tile:
        return {}
    try:
        module.enable_tiling(**options)
    except TypeError:  # an image VAE's enable_tiling() takes no sizes: set the attributes it reads
        module.enable_tiling()
        unknown = [k for k in options if not hasattr(module, k)]
        if unknown:
            raise UsageError(f"tile options {unknown} are not known to {model.family}") from None
        for key, value in options.items():
            setattr(module, key, value)
        if "tile_sample_min_size" in options and hasattr(module, "tile_latent_min_size"):
            module.tile_latent_min_size = int(options["tile_sample_min_size"] / model.rule.spatial_factor)
    if not tiling:
        module.disable_tiling()
    return _tile_params(module) or dict(options)


def _can_tile(module: torch.nn.Module) -> bool:
    if not (callable(getattr(module, "enable_tiling", None)) and callable(getattr(module, "disable_tiling", None))):
        return False
    from diffusers.models.autoencoders.vae import AutoencoderMixin

    # diffusers gives every autoencoder enable_tiling(), which raises where the class has no tiling (no use_tiling)
    return hasattr(module, "use_tiling") or not isinstance(module, AutoencoderMixin)


def _clean_config(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps({k: v for k, v in dict(config).items() if not k.startswith("_")}, default=str))


def _tile_params(module: torch.nn.Module) -> dict[str, Any]:
    """The module's tiling knobs (tile sizes, strides, overlaps, framewise encoding): they change latents."""
    keep = ("use_framewise_encoding", "num_sample_frames_batch_size")
    params = {k: v for k, v in vars(module).items()
              if (k.startswith("tile_") or k in keep) and isinstance(v, (bool, int, float, str, list, tuple))}
    return json.loads(json.dumps(params, sort_keys=True))


def _family_model(module: torch.nn.Module, vae: VaeClass, spec: str, untrained: bool = False) -> VaeModel:
    config = _clean_config(module.config)
    return VaeModel(module, spec, vae.name, vae.rule(config), config, weights_sha256(module),
                    latent_channels=int(config.get(vae.channels_key) or 0), untrained=untrained,
                    normalization=vae.normalization(config, module), per_frame=vae.per_frame,
                    can_tile=_can_tile(module))


def _builtin_class() -> tuple[VaeClass, Any]:
    """The VAE class the builtins are (BUILTIN_FAMILY's), and diffusers' class for it."""
    import diffusers

    from vaecache.models import registry

    vae = registry().families[BUILTIN_FAMILY].vaes[0]
    return vae, getattr(diffusers, vae.name)


def _load_builtin(name: str, spec: str) -> VaeModel:
    if name == "tiny":
        return _builtin_tiny(spec)
    if name == "small":
        return _builtin_small(spec)
    raise VaeSpecError(f"unknown builtin VAE {name!r} in {spec!r}: the builtins are {', '.join(BUILTINS)}")


def _builtin_tiny(spec: str) -> VaeModel:
    vae, cls = _builtin_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_TINY_SEED)
        module = cls(**BUILTIN_TINY_CONFIG)
    return _family_model(module, vae, spec, untrained=True)


def _builtin_small(spec: str) -> VaeModel:
    """The trained VAE shipped in the package (scripts/train_builtin_vae.py): fp16 on disk, fp32 here."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = BUILTIN_SMALL_WEIGHTS
    if not path.is_file():
        raise VaeSpecError(f"{spec}: the weights file {path} is missing from this installation")
    try:
        with safe_open(str(path), framework="pt") as handle:
            config = json.loads((handle.metadata() or {})["config"])
        state = load_file(str(path))
    except Exception as exc:  # a damaged file: safetensors and json raise several types
        raise VaeSpecError(f"{spec}: cannot read {path} ({first_line(exc)[:200]})") from None
    with torch.random.fork_rng(devices=[]):  # every tensor is overwritten; the seed only keeps RNG use quiet
        torch.manual_seed(BUILTIN_TINY_SEED)
        vae, cls = _builtin_class()
        module = cls(**config)
    module.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    check_finite(module.state_dict(), str(path))
    return _family_model(module, vae, spec, untrained=False)


def _load_diffusers(location: str, spec: str, allow_pickle_weights: bool) -> VaeModel:
    path_text, _, subfolder = location.partition("#")
    if not path_text:
        raise VaeSpecError(f"{spec!r}: expected diffusers:PATH[#subfolder]")
    path = Path(path_text).expanduser()
    if subfolder:
        path = path / subfolder
    config_file = path / "config.json"
    if not path.is_dir():
        raise VaeSpecError(f"{path}: diffusers VAE folder not found")
    if not config_file.is_file():
        hint = " (a pipeline folder? add #vae)" if (path / "vae" / "config.json").is_file() else ""
        raise VaeSpecError(f"{path}: no config.json (not a diffusers-format model folder){hint}")
    try:
        class_name = json.loads(config_file.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        raise VaeSpecError(f"{config_file}: not valid JSON") from None
    vae = require_vae_class(class_name, str(config_file))
    # Pickled weights can run arbitrary code when loaded: read them only when the user says so.
    has_safetensors = any(path.glob("*.safetensors"))
    pickled = sorted(p.name for p in path.glob("*.bin"))
    if not has_safetensors and pickled and not allow_pickle_weights:
        raise VaeSpecError(f"{path}: holds only pickled weights ({', '.join(pickled)}), which can run code when "
                           "loaded; convert them to safetensors, or pass --allow-pickle-weights if you trust "
                           "this folder")
    import diffusers

    module = load_pretrained(getattr(diffusers, vae.name), path, allow_pickle_weights=allow_pickle_weights,
                             torch_dtype=torch.float32, low_cpu_mem_usage=False,
                             use_safetensors=has_safetensors or not allow_pickle_weights)
    return _family_model(module, vae, spec)


def _load_file(path: Path, spec: str, vae_config: str | None, allow_pickle_weights: bool) -> VaeModel:
    """One checkpoint file (vaecache.vae.single_file); the file's sha256 joins the recorded config, and so do the
    known leftovers it dropped that say which weights were not used (an EMA copy)."""
    from vaecache.vae.single_file import load_single_file

    loaded = load_single_file(path, Path(vae_config).expanduser() if vae_config else None, allow_pickle_weights)
    model = _family_model(loaded.module, require_vae_class(loaded.family, str(path)), spec)
    recorded = {**model.config, "single_file_sha256": loaded.sha256}
    if loaded.skipped:
        recorded["single_file_skipped"] = loaded.skipped
    return replace(model, config=recorded)


def _load_python(target: str, spec: str) -> VaeModel:
    module_name, _, function_name = target.rpartition(":")
    if not module_name or not function_name:
        raise VaeSpecError(f"{spec!r}: expected python:module.path:function")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except ImportError as exc:
        raise VaeSpecError(f"{spec!r}: cannot import {module_name} ({exc})") from None
    except AttributeError:
        raise VaeSpecError(f"{spec!r}: {module_name} has no attribute {function_name}") from None
    module = factory()
    if not isinstance(module, torch.nn.Module) or not callable(getattr(module, "encode", None)):
        raise VaeSpecError(f"{spec!r}: factory must return a torch.nn.Module with an encode(x) method, "
                           f"got {type(module).__name__}")
    temporal = int(getattr(module, "vaecache_temporal_factor", 1))
    spatial = int(getattr(module, "vaecache_spatial_factor", 1))
    if temporal < 1 or spatial < 1:
        raise VaeSpecError(f"{spec!r}: vaecache_temporal_factor and vaecache_spatial_factor must be >= 1")
    rule = FrameRule(temporal, spatial, causal=bool(getattr(module, "vaecache_causal", temporal > 1)),
                     label=type(module).__qualname__)
    config = getattr(module, "config", None)
    config = _clean_config(config) if isinstance(config, dict) else {}
    config["factory"] = target
    return VaeModel(module, spec, type(module).__qualname__, rule, config, weights_sha256(module),
                    latent_channels=int(getattr(module, "vaecache_latent_channels", 0)),
                    has_logvar=bool(getattr(module, "vaecache_has_logvar", True)), can_tile=_can_tile(module))


__all__ = ["BUILTINS", "BUILTIN_SMALL_WEIGHTS", "BUILTIN_TINY_CONFIG", "BUILTIN_TINY_SEED", "CUDA_NUMERICS",
           "exact_cuda_numerics", "load_vae"]
