"""VAE backends (builtin, diffusers, python plugin), their frame/pixel rules, fingerprints, and encoding.

A backend's `encode_views` runs the VAE on one view per forward: convolution kernels may pick other
algorithms for other batch sizes, so encoding views one at a time is what makes stored latents
independent of batch size, SP size and world size.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vaecache.errors import FrameRuleError, VaeSpecError

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

BUILTIN_TINY_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
BUILTIN_TINY_SEED = 20240601


@dataclass(frozen=True)
class FrameRule:
    """How a VAE compresses time and space, and which input sizes it accepts."""

    temporal_factor: int = 1
    spatial_factor: int = 1
    causal: bool = False
    """Causal video VAEs take 1 + k*temporal_factor frames (the first frame is encoded alone)."""

    def latent_frames(self, num_frames: int) -> int:
        if self.causal:
            return 1 + (num_frames - 1) // self.temporal_factor
        return num_frames // self.temporal_factor

    def check(self, num_frames: int, height: int, width: int) -> None:
        """Raise FrameRuleError naming the nearest valid values when the clip shape is not accepted."""
        tf, sf = self.temporal_factor, self.spatial_factor
        if self.causal:
            if (num_frames - 1) % tf:
                low = 1 + (num_frames - 1) // tf * tf
                raise FrameRuleError(
                    f"--num-frames {num_frames} is not valid for this VAE: it needs 1 + {tf}k frames; "
                    f"nearest valid values are {low} and {low + tf}")
        elif num_frames % tf:
            low = num_frames // tf * tf
            options = f"{low} and {low + tf}" if low else f"{tf}"
            raise FrameRuleError(
                f"--num-frames {num_frames} is not valid for this VAE: it needs a multiple of {tf}; nearest valid: {options}")
        for name, value in (("height", height), ("width", width)):
            if value % sf:
                low = value // sf * sf
                options = f"{low} and {low + sf}" if low else f"{sf}"
                raise FrameRuleError(
                    f"--size {height}x{width}: {name} {value} is not a multiple of {sf} (the VAE's spatial factor); "
                    f"nearest valid {name}: {options}")

    def latent_shape(self, channels: int, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return channels, self.latent_frames(num_frames), height // self.spatial_factor, width // self.spatial_factor


@dataclass
class LoadedVae:
    """A ready-to-run VAE: the module, its rule, and what identifies it."""

    module: torch.nn.Module
    spec: str
    family: str
    rule: FrameRule
    latent_channels: int
    config: dict[str, Any]
    weights_sha256: str
    untrained: bool = False
    has_logvar: bool = True
    normalization: dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def fingerprint(self) -> dict[str, Any]:
        """What identifies these weights: class, config and a hash of every parameter and buffer."""
        return {
            "family": self.family,
            "config": self.config,
            "weights_sha256": self.weights_sha256,
            "spec": self.spec,
            "untrained": self.untrained,
            "normalization": self.normalization,
        }

    @torch.inference_mode()
    def encode_views(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(V, C, T, H, W) in [-1, 1] -> posterior (mean, logvar), each (V, c, t, h, w), in the VAE dtype."""
        means, logvars = [], []
        for view in views.split(1):
            mean, logvar = _posterior(self.module.encode(view.to(self.device, self.dtype, non_blocking=True)))
            means.append(mean)
            if logvar is not None:
                logvars.append(logvar)
        return torch.cat(means), (torch.cat(logvars) if logvars else None)


def _posterior(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accept diffusers outputs, a distribution with mean/logvar, or a plain tensor (mean only)."""
    if isinstance(output, tuple) and len(output) == 1:
        output = output[0]
    dist = getattr(output, "latent_dist", output)
    if isinstance(dist, torch.Tensor):
        return dist, None
    mean = getattr(dist, "mean", None)
    if not isinstance(mean, torch.Tensor):
        raise VaeSpecError(f"encode() returned {type(output).__name__}; expected a tensor, or an object with "
                           "latent_dist or mean/logvar tensors")
    logvar = getattr(dist, "logvar", None)
    return mean, logvar if isinstance(logvar, torch.Tensor) else None


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order."""
    digest = hashlib.sha256()
    state = module.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# --------------------------------------------------------------------------- families


def _wan_rule(config: dict[str, Any]) -> FrameRule:
    temporal = 2 ** sum(bool(x) for x in config.get("temperal_downsample", [False, True, True]))
    spatial = 2 ** (len(config.get("dim_mult", [1, 2, 4, 4])) - 1)
    if config.get("patch_size"):
        spatial *= int(config["patch_size"])
    return FrameRule(temporal, spatial, causal=True)


def _normalization(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("scaling_factor", "shift_factor", "latents_mean", "latents_std")
    return {key: config[key] for key in keys if config.get(key) is not None}


FAMILIES: dict[str, Callable[[dict[str, Any]], FrameRule]] = {
    "AutoencoderKLWan": _wan_rule,
}


def _family_channels(family: str, config: dict[str, Any]) -> int:
    return int(config.get("z_dim") or config.get("latent_channels") or 0)


def _clean_config(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps({k: v for k, v in dict(config).items() if not k.startswith("_")}, default=str))


# --------------------------------------------------------------------------- loading


def load_vae(spec: str, device: torch.device | str = "cpu", dtype: str = "fp32") -> LoadedVae:
    """Resolve a --vae SPEC: builtin:tiny, diffusers:PATH, or python:module:function."""
    if not spec:
        raise VaeSpecError("--vae is required (builtin:tiny, diffusers:PATH or python:module:function)")
    kind, _, rest = spec.partition(":")
    if kind == "builtin":
        vae = _load_builtin(rest, spec)
    elif kind == "diffusers":
        vae = _load_diffusers(rest, spec)
    elif kind == "python":
        vae = _load_python(rest, spec)
    else:
        raise VaeSpecError(f"unknown VAE spec {spec!r}: use builtin:tiny, diffusers:PATH or python:module:function")
    vae.device = torch.device(device)
    vae.dtype = TORCH_DTYPES[dtype]
    vae.module.to(vae.device, vae.dtype).eval().requires_grad_(False)
    return vae


def _load_builtin(name: str, spec: str) -> LoadedVae:
    if name != "tiny":
        raise VaeSpecError(f"unknown builtin VAE {name!r} in {spec!r}: the only builtin is builtin:tiny")
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_TINY_SEED)
        module = AutoencoderKLWan(**BUILTIN_TINY_CONFIG)
    config = _clean_config(module.config)
    return LoadedVae(module, spec, "AutoencoderKLWan", _wan_rule(config), _family_channels("AutoencoderKLWan", config),
                     config, weights_sha256(module), untrained=True, normalization=_normalization(config))


def _load_diffusers(location: str, spec: str) -> LoadedVae:
    path_text, _, subfolder = location.partition("#")
    path = Path(path_text).expanduser()
    if subfolder:
        path = path / subfolder
    config_file = path / "config.json"
    if not path.is_dir():
        raise VaeSpecError(f"{path}: diffusers VAE folder not found")
    if not config_file.is_file():
        raise VaeSpecError(f"{path}: no config.json (not a diffusers-format model folder)")
    try:
        family = json.loads(config_file.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError):
        raise VaeSpecError(f"{config_file}: not valid JSON") from None
    if family not in FAMILIES:
        raise VaeSpecError(f"{config_file}: VAE class {family!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    import diffusers

    try:
        module = getattr(diffusers, family).from_pretrained(str(path), torch_dtype=torch.float32)
    except Exception as exc:  # diffusers raises many types for broken folders
        raise VaeSpecError(f"{path}: could not load {family} ({str(exc).splitlines()[0][:200]})") from None
    config = _clean_config(module.config)
    return LoadedVae(module, spec, family, FAMILIES[family](config), _family_channels(family, config), config,
                     weights_sha256(module), normalization=_normalization(config))


def _load_python(target: str, spec: str) -> LoadedVae:
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
        raise VaeSpecError(f"{spec!r}: factory must return a torch.nn.Module with an encode(x) method, got {type(module).__name__}")
    temporal = int(getattr(module, "vaecache_temporal_factor", 1))
    rule = FrameRule(temporal, int(getattr(module, "vaecache_spatial_factor", 1)),
                     causal=bool(getattr(module, "vaecache_causal", temporal > 1)))
    config = getattr(module, "config", None)
    config = _clean_config(config) if isinstance(config, dict) else {}
    config["factory"] = target
    channels = int(getattr(module, "vaecache_latent_channels", 0))
    return LoadedVae(module, spec, type(module).__qualname__, rule, channels, config, weights_sha256(module),
                     has_logvar=bool(getattr(module, "vaecache_has_logvar", True)))
