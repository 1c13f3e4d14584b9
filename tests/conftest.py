"""Session-wide fixtures: one real demo dataset, one good cache encoded with builtin:tiny, a CLI runner.

Encoding is the slow part (VAE warm-up, h264 decode), so every cache that more than one test reads
is built once per session here and treated as read-only; tests that damage or extend a cache work on
a `shutil.copytree` of it (see `cache_copy`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
from typer.testing import CliRunner, Result

from tests.s3 import s3_env, s3_filesystem, start_s3_server
from tests.videos import VideoLayout, write_video
from vaecache.cache.reader import CacheReader
from vaecache.cli.app import app
from vaecache.demodata import DemoDataSpec, write_demo_dataset

DEMO_SPEC = DemoDataSpec(scenes=3, cameras=2, frames=17, height=64, width=64, fps=10, seed=0)
ENCODE_ARGS = ("--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress")
"""The standard encode of the demo data: one 9-frame clip per scene (17 frames, no overlap)."""


def _quiet_diffusers() -> None:
    # diffusers warns on every `module.to(dtype)` ("modules that should be kept in float32: []") through a
    # StreamHandler bound to whatever sys.stderr was when its logger was first used; under CliRunner that
    # stream is closed afterwards and later warnings print "--- Logging error ---" tracebacks into the output
    # of unrelated tests. Silence it once, before any test runs.
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()


_quiet_diffusers()

# One intra-op thread: on a shared 2-core runner, OpenMP's two spinning threads contend with the decode
# workers, the shard-writer thread and other jobs, and a 3-clip encode went from ~0.3 s to 10+ s. Every
# comparison in this suite is between runs of this same process, so the thread count is the same for both.
# OMP_NUM_THREADS too, so that an encode run in this process keeps the one thread (without it, an encode gives the
# VAE this machine's cores minus its decode workers, and a reference computed beside it would differ in the last
# bits wherever a forward holds several views); tests of that budget unset it.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


# The quick tier (`-m "not slow"`, README: Development) leaves out what costs a process or a server: a test is marked
# slow here, at collection, when it sits under tests/e2e/ (torchrun, SLURM), is marked `slurm`, uses the S3 server
# (the `s3` and `s3_endpoint` fixtures, asked for by name or by getfixturevalue), or starts a process: its code, a
# function of its module it calls, or one of its fixtures calls one of SPAWNS. Nothing is marked by hand, so a new
# test of one of these kinds joins the slow tier by what it does.
SLOW_FIXTURES = {"s3", "s3_endpoint"}
SPAWNS = ("run_vaecache(", "run_torchrun(", "torchrun_cmd(", "subprocess.run(", "subprocess.Popen(", ".Process(",
          "multiprocessing_context=", 'getfixturevalue("s3")', "run_timed(", "Browser(")
"""`Browser(` starts headless Chromium (tests/browser.py)."""
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r'load_script\("(\w+)"\)')
"""A benchmark script a test runs in-process (tests/test_bench_scripts.py): its own code is read for SPAWNS too."""


def _source(function: Any) -> str:
    import inspect

    try:
        return inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return ""


def spawns_processes(item: pytest.Item) -> bool:
    """The test, one of its fixtures, or a function of their modules that these call (three calls deep), starts a
    process or asks for the S3 server."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    module = getattr(item, "module", None)
    todo = [function, *(definition.func for definitions in item._fixtureinfo.name2fixturedefs.values()
                        for definition in definitions
                        if getattr(definition.func, "__module__", "").startswith("tests"))]
    if "getfixturevalue(" in _source(function):  # a fixture named at run time: any of its module's may be the one
        todo += [value._get_wrapped_function() for value in vars(module).values()
                 if hasattr(value, "_get_wrapped_function")]
    seen: set[Any] = set()
    for _ in range(3):
        found = []
        for candidate in todo:
            if candidate in seen:
                continue
            seen.add(candidate)
            source = _source(candidate)
            scripts = [ROOT / "scripts" / f"{name}.py" for name in SCRIPT.findall(source)]
            source += "".join(script.read_text() for script in scripts if script.is_file())
            if any(call in source for call in SPAWNS):
                return True
            home = sys.modules.get(getattr(candidate, "__module__", ""))
            found += [getattr(home, name) for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", source))
                      if callable(getattr(home, name, None)) and not isinstance(getattr(home, name), type)
                      and getattr(getattr(home, name), "__module__", "") == getattr(home, "__name__", None)]
        todo = found
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if (path.startswith("tests/e2e/") or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or item.get_closest_marker("slurm") is not None or spawns_processes(item)):
            item.add_marker(pytest.mark.slow)


# pytest-xdist: CI runs the suite as `-n 2 --dist loadgroup`. Tests that must share one worker are named here by file:
# the SLURM tests start one local cluster per pytest session (tests/e2e/slurm/conftest.py, stopped at its end) and
# submit the jobs of every selected test together, so two workers would start two clusters on the same daemons'
# pidfiles. (xdist 3.8's own `xdist_group` mark does nothing under pytest 9: it renames `item._nodeid`, which
# pytest 9 no longer reads; hence this scheduler, which groups by path and still honours a working `@group`.)
ONE_WORKER = {"tests/e2e/slurm/test_sbatch.py": "slurm"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class PathGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER.get(nodeid.split("::", 1)[0]) or super()._split_scope(nodeid)

    return PathGroups(config, log)


def invoke(args: Sequence[Any], env: dict[str, str] | None = None) -> Result:
    """Run `vaecache ARGS` in-process; stdout and stderr are both in `result.output`.

    VAECACHE_DEBUG is unset unless `env` sets it, so a developer's shell setting cannot change results.
    """
    return CliRunner().invoke(app, [str(a) for a in args], env={"VAECACHE_DEBUG": None, **(env or {})})


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., Result]:
    """`run_cli(args, env=None) -> Result` (typer CliRunner on vaecache.cli.app.app)."""
    return invoke


def encode_ok(data: Path, out: Path, *extra: Any) -> Result:
    """Encode with the standard settings plus `extra` (later flags win) and insist on exit 0."""
    result = invoke(["encode", data, "--out", out, *ENCODE_ARGS, *extra])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="session")
def encode_cli() -> Callable[..., Result]:
    """`encode_cli(data, out, *extra_flags) -> Result`, asserting exit 0."""
    return encode_ok


@pytest.fixture(scope="session")
def demo_spec() -> DemoDataSpec:
    """The spec `demo_data` was written from (render_clip(spec, scene, camera) gives its exact frames)."""
    return DEMO_SPEC


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 scenes x 2 cameras x 17 frames of 64x64 h264, as DATA/scene_00k/cam_j.mp4. Read-only."""
    root = tmp_path_factory.mktemp("demo") / "data"
    write_demo_dataset(root, DEMO_SPEC)
    return root


@pytest.fixture(scope="session")
def good_cache(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo data encoded once with the standard settings (--workers 0). Read-only: copy it to change it."""
    out = tmp_path_factory.mktemp("good") / "cache"
    encode_ok(demo_data, out)
    return out


@pytest.fixture(scope="session")
def sharded_cache(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo data with a small --shard-size: one clip is 48 KiB, so shards hold 2 and 1 clips."""
    out = tmp_path_factory.mktemp("sharded") / "cache"
    encode_ok(demo_data, out, "--shard-size", "50000")
    return out


CAPTIONS = {"scene_000": "a red cube ☃", "scene_001": "two cameras, one road", "scene_002": "night\nline two"}


def caption_metadata(scene: str) -> dict[str, Any]:
    """The metadata keys `caption_cache`'s index line of `scene` carries (any JSON passes through)."""
    return {"caption": CAPTIONS[scene], "tags": ["demo", scene], "score": 0.5, "nested": {"a": [1, None]}}


@pytest.fixture(scope="session")
def index_metadata() -> Callable[[str], dict[str, Any]]:
    """`index_metadata(scene)`: the metadata keys of that scene's line in `caption_cache`'s index."""
    return caption_metadata


@pytest.fixture(scope="session")
def caption_cache(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo data encoded (standard settings) from a JSONL index whose lines carry captions, tags and
    other JSON (caption_metadata). Read-only."""
    import json

    root = tmp_path_factory.mktemp("captioned")
    index = root / "index.jsonl"
    lines = [{"id": scene.name, "cameras": {video.stem: str(video) for video in sorted(scene.glob("*.mp4"))},
              **caption_metadata(scene.name)} for scene in sorted(demo_data.iterdir())]
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = root / "cache"
    encode_ok(index, out)
    return out


# Size and length buckets: real videos of five aspect ratios in one folder, three size buckets, two frame buckets.
H264 = VideoLayout("h264", "libx264", ".mp4", {"preset": "ultrafast", "threads": "1"})
SIZES = "32x56,56x32,40x40"
"""Landscape (1.75), portrait (0.57), square; multiples of builtin:tiny's spatial factor 8."""
FRAMES = "9,5"
VIDEOS = {  # name: (width, height, frames) -> the bucket it must land in (longest frame bucket that fits)
    "wide16x9": ((64, 36, 12), "32x56x9"),
    "tall9x16": ((36, 64, 7), "56x32x5"),
    "cinema235": ((94, 40, 18), "32x56x9"),
    "portrait043": ((28, 64, 10), "56x32x9"),
    "squarish": ((60, 56, 6), "40x40x5"),
}
BASE = ("--vae", "builtin:tiny", "--workers", "0", "--no-progress")


@pytest.fixture(scope="session")
def bucket_videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """VIDEOS as DATA/<name>.mp4 (h264, 10 fps). Read-only."""
    root = tmp_path_factory.mktemp("bucket-videos") / "data"
    for name, ((width, height, frames), _) in VIDEOS.items():
        write_video(root / f"{name}.mp4", H264, frames=frames, height=height, width=width, fps=10)
    return root


@pytest.fixture(scope="session")
def bucket_cache(bucket_videos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bucket_videos encoded with --size SIZES --num-frames FRAMES: six clips of four latent shapes. Read-only."""
    out = tmp_path_factory.mktemp("bucket-cache") / "cache"
    result = invoke(["encode", bucket_videos, "--out", out, "--size", SIZES, "--num-frames", FRAMES, *BASE,
                     "--batch-size", "2", "--shard-size", "1MB"])
    assert result.exit_code == 0, result.output
    assert "32x56x5, 40x40x9" in result.output  # the summary's "empty buckets" row: reported, not an error
    return out


@pytest.fixture
def cache_copy(good_cache: Path, tmp_path: Path) -> Path:
    """A private, writable copy of `good_cache`."""
    return Path(shutil.copytree(good_cache, tmp_path / "cache"))


def read_manifest(out: Path) -> dict[str, Any]:
    return CacheReader(out).manifest


def read_clips(out: Path) -> list[dict[str, Any]]:
    return list(CacheReader(out).clip_records())


def read_failures(out: Path) -> list[dict[str, Any]]:
    """The failure records of a finished cache (failures.parquet, read back by pyarrow)."""
    return CacheReader(out).failure_records()


def load_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard of OUT, by name (refuses unlisted or missing shards, repeated names)."""
    return CacheReader(out).tensors()


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), f"{name} differs"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a vaecache child process: no fault injection or SLURM from the caller, one
    OpenMP thread (two spinning threads per rank on a shared 2-core runner slow everything several-fold)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VAECACHE_FAULT", "SLURM_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_vaecache(*args: Any, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m vaecache ARGS` in a child process (stdout and stderr captured as text)."""
    return subprocess.run([sys.executable, "-m", "vaecache", *map(str, args)], capture_output=True, text=True,
                          env=subprocess_env(**(env or {})), timeout=timeout)


def torchrun_cmd(nproc: int, *args: Any) -> list[str]:
    """The command line of `torchrun --standalone --nproc-per-node=NPROC -m vaecache ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "vaecache", *map(str, args)]


def run_torchrun(nproc: int, *args: Any, timeout: float = 300) -> subprocess.CompletedProcess:
    """`vaecache ARGS` on NPROC local ranks under torchrun (gloo on CPU)."""
    return subprocess.run(torchrun_cmd(nproc, *args), capture_output=True, text=True, env=subprocess_env(),
                          timeout=timeout)


@pytest.fixture(scope="session")
def procs() -> Any:
    """Child-process runners: env(**extra), vaecache(*args), torchrun_cmd(nproc, *args), torchrun(nproc, *args)."""

    class Procs:
        env = staticmethod(subprocess_env)
        vaecache = staticmethod(run_vaecache)
        torchrun_cmd = staticmethod(torchrun_cmd)
        torchrun = staticmethod(run_torchrun)

    return Procs


@pytest.fixture
def loud_vae(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A python: VAE spec whose factory records that it ran (and then fails), so a test can tell it was never loaded."""
    marker = tmp_path / "vae-was-loaded"
    (tmp_path / "loud_vae.py").write_text(textwrap.dedent(f"""
        from pathlib import Path

        def make():
            Path({str(marker)!r}).write_text("loaded")
            raise RuntimeError("the VAE was loaded")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("loud_vae", None)
    return "python:loud_vae:make"


@pytest.fixture(scope="session")
def cache_io() -> Any:
    """Readers for caches: manifest(out), clips(out), failures(out), tensors(out), same_tensors(a, b)."""

    class CacheIO:
        manifest = staticmethod(read_manifest)
        clips = staticmethod(read_clips)
        failures = staticmethod(read_failures)
        tensors = staticmethod(load_tensors)
        same_tensors = staticmethod(assert_same_tensors)

    return CacheIO


@pytest.fixture(scope="session")
def s3_endpoint() -> Any:
    """moto's S3 server as a child process on a free loopback port, shared by the session (tests.s3)."""
    yield from start_s3_server()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An s3fs filesystem on the server, with the AWS environment a user would set for such a store (so vaecache
    finds the endpoint and credentials as it would on a cluster)."""
    for name, value in s3_env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    return s3_filesystem(s3_endpoint)

