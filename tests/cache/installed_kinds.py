"""A package that declares set kinds, installed as pip leaves one: a NAME-VERSION.dist-info folder (METADATA,
entry_points.txt with a `[vaecache.kinds]` section, RECORD) in a folder on the path, which importlib.metadata finds by
the same lookup it makes for a package in site-packages (vaecache reads nothing else to find a kind)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def install_kinds(site: Path, points: dict[str, str], name: str = "vaecache_test_kinds") -> Path:
    """`site` holding the metadata of a package `name` whose `vaecache.kinds` entry points are `points`
    ({kind name: MODULE or MODULE:CLASS}); returns `site`, to put on sys.path (and PYTHONPATH for children)."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vaecache.kinds]\n" + "".join(f"{kind} = {target}\n"
                                                                          for kind, target in points.items()))
    (info / "RECORD").write_text("".join(f"{info.name}/{file},,\n" for file in ("METADATA", "entry_points.txt",
                                                                                "RECORD")))
    return site


def child_path(*folders: Path) -> str:
    """PYTHONPATH for a child process: `folders`, then the repository (where tests.cache.latent_mean lives)."""
    return os.pathsep.join([*map(str, folders), str(REPO)])
