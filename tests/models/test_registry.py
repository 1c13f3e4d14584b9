"""The registry of model families: importable without torch, built-in modules found by walking the package, installed
ones from the `vaecache.families` entry points, a broken plugin refused in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vaecache import models
from vaecache.models import FamilyPluginError, Registry, rule_of_config
from vaecache.models.base import Family, VaeClass
from vaecache.models.rules import FrameRule

REPO = Path(__file__).resolve().parents[2]


def test_import_pulls_no_torch() -> None:
    code = ("import sys, vaecache.models as m; m.registry(); m.rule_of_config({'_class_name': 'AutoencoderKLWan'}); "
            "assert 'torch' not in sys.modules, 'torch imported'; assert 'diffusers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/tmp")


def test_every_family_module_is_found_and_each_vae_class_declared_once() -> None:
    found = {module.__name__.rpartition(".")[2] for module in models.built_in_modules()}
    on_disk = {path.stem for path in (REPO / "vaecache" / "models").glob("*.py")
               if not path.stem.startswith("_") and path.stem not in ("base", "rules")}
    assert found == on_disk
    for family in models.FAMILIES.values():
        for name in family.vae_classes:
            assert name in models.VAE_CLASSES, (family.name, name)
    assert sorted(models.VAE_CLASSES) == sorted({vae.name for f in models.FAMILIES.values() for vae in f.vaes})


def test_rule_of_config_is_the_familys_rule() -> None:
    config = {"_class_name": "AutoencoderKLHunyuanVideo"}
    assert rule_of_config(config).frames_ok(21)
    assert not rule_of_config(config, "kandinsky5").frames_ok(21)  # its trainers' time tiles cover 1 + 8k above 17
    with pytest.raises(models.VaeSpecError, match="'AutoencoderKLNope' is not supported"):
        rule_of_config({"_class_name": "AutoencoderKLNope"})
    with pytest.raises(models.UsageError, match="--model wan: Wan trains on AutoencoderKLWan"):
        rule_of_config(config, "wan")


def test_a_class_declared_twice_is_refused() -> None:
    vae = models.VAE_CLASSES["AutoencoderKLWan"]
    twin = Family("wan-twin", "Wan twin", (vae.name,), models.FAMILIES["wan"].reference, vaes=(vae,))
    with pytest.raises(FamilyPluginError, match="VAE class AutoencoderKLWan is declared twice"):
        Registry([models.FAMILIES["wan"], twin])


def test_declarations_are_validated() -> None:
    with pytest.raises(ValueError, match="needs its reason"):
        VaeClass("AutoencoderKLX", lambda config: FrameRule(), "latent_channels", lambda c, m: {}, fp16="refuse")
    with pytest.raises(ValueError, match="not among its vae_classes"):
        Family("x", "X", ("AutoencoderKLX",), models.FAMILIES["wan"].reference,
               vaes=(models.VAE_CLASSES["AutoencoderKLWan"],))


def _plugin(root: Path, body: str) -> None:
    dist = root / "brokenfam-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenfam\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vaecache.families]\nbroken = brokenfam:FAMILY\n")
    (root / "brokenfam.py").write_text(textwrap.dedent(body))


@pytest.mark.parametrize("body, message", [
    ("raise RuntimeError('no weights here')\n",
     "the vaecache.families entry point broken = brokenfam:FAMILY cannot be loaded: RuntimeError: no weights here"),
    ("FAMILY = 3\n", "the vaecache.families entry point broken = brokenfam:FAMILY is a int, not a vaecache.models"),
])
def test_a_broken_plugin_is_one_line(tmp_path: Path, body: str, message: str) -> None:
    _plugin(tmp_path, body)
    code = ("import vaecache.models as m\ntry:\n    m.registry()\nexcept m.FamilyPluginError as exc:\n"
            "    print(exc)\nelse:\n    raise SystemExit('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd="/tmp",
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip().startswith(message) and "\n" not in out.strip()
