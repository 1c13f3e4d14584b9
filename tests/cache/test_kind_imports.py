"""A cache never runs code: the kinds a manifest records are read only where an installed package declares them (a
`vaecache.kinds` entry point, found by importlib.metadata); a module the manifest names (the cache's own, one in the
current directory, the standard library's `this`) is never imported by verify, `verify --json -`, LatentCache,
inspect or any export, each of which answers in one line. A malformed kinds record is a one-line refusal, and a kind's
failing hook is named with its kind and set while verify keeps the rest of its report."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.cache.installed_kinds import child_path, install_kinds
from tests.conftest import subprocess_env
from vaecache.errors import KindHookError, ManifestError
from vaecache.training import LatentCache

KIND = ["--kind", "tests.cache.latent_mean", "--shard-size", "1"]
ZEN = "Beautiful is better than ugly"
MARKER_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")

from vaecache.cache.kinds import SetKind, register


class Harmless(SetKind):
    name = "harmless"


register(Harmless())
"""


@pytest.fixture
def cache(good_cache, tmp_path):
    return shutil.copytree(good_cache, tmp_path / "cache")


def with_kinds(cache, record, sets=None):
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["kinds"] = record
    manifest.update(sets or {})
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def child(args, cwd, pythonpath=None):
    """A child process in `cwd` (on its sys.path, as `python -m` and `python -c` put it), PYTHONPATH as given."""
    env = subprocess_env()
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("where", ["own", "cwd", "stdlib"])
def test_a_module_the_manifest_names_never_runs_and_every_reader_answers_in_one_line(cache, tmp_path, where):
    marker = tmp_path / "RAN"
    work = tmp_path / "work"
    work.mkdir()
    if where == "own":  # the cache ships the module it names, read from the cache's own folder
        module, cwd, out = "shipped_kind", cache, "."
        (cache / "shipped_kind.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    elif where == "cwd":  # a module in the current directory of whoever reads the cache
        module, cwd, out = "evil", work, str(cache)
        (work / "evil.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    else:
        module, cwd, out = "this", work, str(cache)
    with_kinds(cache, {"harmless": module}, {"harmless": {"default": {"clips": 3, "shards": [], "tables": {}}}})
    named = f"set kind 'harmless' (module {module}) is declared by no installed package"

    verified = child(["-m", "vaecache", "verify", out], cwd)
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert named in " ".join((verified.stdout + verified.stderr).split()), verified.stderr

    reported = child(["-m", "vaecache", "verify", out, "--json", "-", "--no-progress"], cwd)
    assert reported.returncode == 1
    report = json.loads(reported.stdout)  # nothing but the report on stdout
    assert [problem for check in report["checks"] for problem in check["problems"] if named in problem]

    read = child(["-c", f"from vaecache.training import LatentCache; LatentCache({out!r})[0]"], cwd)
    assert read.returncode == 1
    last = read.stderr.strip().splitlines()[-1]
    assert last.startswith("vaecache.errors.KindNotInstalledError: ") and f"manifest.json: {named}" in last

    shown = child(["-m", "vaecache", "inspect", out], cwd)
    assert shown.returncode == 0, shown.stderr
    shown_text = " ".join((shown.stdout + shown.stderr).split())
    assert f"harmless set default: 3 clips, 0 shard(s), 0 B (declared by {module})" in shown_text
    assert "harmless is not read: no installed package declares it" in shown_text

    for format in ("webdataset", "musubi", "ltx2"):
        target = work / f"export-{format}"
        exported = child(["-m", "vaecache", "export", out, "--format", format, "--out", str(target)], cwd)
        assert exported.returncode == 1, exported.stdout + exported.stderr
        errors = [line for line in (exported.stdout + exported.stderr).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and named in errors[0], exported.stderr
        assert not target.exists()

    for result in (verified, reported, read, shown):
        assert ZEN not in result.stdout + result.stderr
    assert not marker.exists()


def test_a_cache_written_with_kind_reads_where_an_installed_package_declares_its_module(cache, run_cli, tmp_path):
    assert run_cli(["embed", cache, *KIND]).exit_code == 0  # the user named the module: this run imports it
    assert json.loads((cache / "manifest.json").read_text())["kinds"] == {"latent-mean": "tests.cache.latent_mean"}
    # an entry point of another name that declares the recorded module reads it too
    site = install_kinds(tmp_path / "site", {"averaged-latents": "tests.cache.latent_mean"})
    checked = child(["-m", "vaecache", "verify", str(cache)], tmp_path, child_path(site))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # uninstalled, the module stays unimported although the repository (the current directory) holds it
    refused = child(["-m", "vaecache", "verify", str(cache)], shutil.os.getcwd())
    assert refused.returncode == 1
    assert ("set kind 'latent-mean' (module tests.cache.latent_mean) is declared by no installed package: install "
            "the package whose `vaecache.kinds` entry point declares tests.cache.latent_mean") in \
        " ".join((refused.stdout + refused.stderr).split())


@pytest.mark.parametrize("record", [123, "", ["a"], None, {"m": 123}, {"m": ""}, {"m": ["a"]}, {"m": {"a": 1}},
                                    {"m": "not a module"}, {"": "m"}, {"../up": "m"}],
                         ids=repr)
def test_a_malformed_kinds_record_is_a_one_line_refusal(cache, run_cli, record):
    with_kinds(cache, record)
    verified = run_cli(["verify", cache])
    assert verified.exit_code == 1
    assert "unexpected" not in verified.output
    assert '"kinds"' in verified.output
    with pytest.raises(ManifestError, match='manifest.json: "kinds" '):
        LatentCache(cache)[0]
    shown = run_cli(["inspect", cache])
    assert shown.exit_code == 1 and "unexpected" not in shown.output
    assert len(shown.output.strip().splitlines()) == 1 and '"kinds"' in shown.output


@pytest.fixture
def broken(cache, run_cli, tmp_path, monkeypatch):
    """The cache with a set of a kind whose hooks raise where `BrokenMeanKind.broken` says."""
    from tests.cache.broken_mean import BrokenMeanKind

    site = install_kinds(tmp_path / "site", {"broken-mean": "tests.cache.broken_mean"})
    monkeypatch.syspath_prepend(str(site))
    assert run_cli(["embed", cache, "--kind", "tests.cache.broken_mean"]).exit_code == 0
    monkeypatch.setattr(BrokenMeanKind, "broken", set())
    return BrokenMeanKind


@pytest.mark.parametrize("hook", ["check_item", "verify_sets"])
def test_a_kinds_failing_verify_hook_is_named_with_its_kind_and_set_and_the_report_kept(broken, cache, run_cli,
                                                                                        tmp_path, hook):
    broken.broken = {hook}
    verified = run_cli(["verify", cache, "--json", tmp_path / "report.json"])
    assert verified.exit_code == 1, verified.output
    assert "unexpected" not in verified.output
    report = json.loads((tmp_path / "report.json").read_text())
    problems = [problem for check in report["checks"] for problem in check["problems"]]
    assert problems and all(problem.startswith(f"set kind 'broken-mean' (tests.cache.broken_mean): its {hook}")
                            for problem in problems), problems
    assert f"RuntimeError: the kind's own {hook} failed" in problems[0]
    assert ("broken-mean set 'default'" in problems[0]) if hook == "check_item" else ("'default' not checked" in
                                                                                      problems[0])
    kept = {check["name"] for check in report["checks"] if check["failed"] == 0 and check["passed"]}
    assert {"manifest", "clip records", "shard files"} <= kept, kept


def test_a_kinds_failing_reader_is_named_by_latentcache_and_the_export(broken, cache, run_cli, tmp_path):
    broken.broken = {"readers"}
    with pytest.raises(KindHookError, match=r"set kind 'broken-mean' \(tests.cache.broken_mean\): its readers raised "
                                            r"RuntimeError: the kind's own readers failed"):
        LatentCache(cache)[0]
    exported = run_cli(["export", cache, "--format", "webdataset", "--out", tmp_path / "wds"])
    assert exported.exit_code == 1 and "unexpected" not in exported.output
    assert "set kind 'broken-mean' (tests.cache.broken_mean): its readers raised" in exported.output
    assert not (tmp_path / "wds").exists()


@pytest.fixture
def evil_on_path(tmp_path, monkeypatch):
    """evil.py (writing RAN when imported) in the current directory, which is on sys.path (as under `python -c`)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "evil.py").write_text(MARKER_MODULE.format(marker=str(tmp_path / "RAN")) + "\ndef make():\n    pass\n")
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    return tmp_path / "RAN"


def test_a_kind_no_installed_package_declares_is_refused_in_this_process_without_importing_it(cache, run_cli,
                                                                                              evil_on_path):
    with_kinds(cache, {"evil-kind": "evil"})
    named = "set kind 'evil-kind' (module evil) is declared by no installed package"
    with pytest.raises(ManifestError, match=r"manifest.json: " + named.replace("(", r"\(").replace(")", r"\)")):
        LatentCache(cache)[0]
    verified = run_cli(["verify", cache])
    assert verified.exit_code == 1 and named in " ".join(verified.output.split())
    exported = run_cli(["export", cache, "--format", "webdataset", "--out", evil_on_path.parent / "wds"])
    assert exported.exit_code == 1 and named in " ".join(exported.output.split())
    assert not evil_on_path.exists() and "evil" not in sys.modules


@pytest.mark.parametrize("command", [["decode"], ["verify", "--reencode", "1"], ["embed", "--condition",
                                                                                 "first-frame"]])
def test_a_recorded_python_vae_is_loaded_only_when_given_on_the_command_line(cache, run_cli, evil_on_path, command):
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["settings"]["vae_spec"] = "python:evil:make"
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    before = {path: path.read_bytes() for path in cache.rglob("*") if path.is_file()}
    result = run_cli([command[0], cache, *command[1:]])
    assert result.exit_code == 2, result.output
    assert "the VAE is recorded as 'python:evil:make', a Python factory" in " ".join(result.output.split())
    assert "unexpected" not in result.output
    assert not evil_on_path.exists() and "evil" not in sys.modules
    assert {path: path.read_bytes() for path in cache.rglob("*") if path.is_file()} == before
