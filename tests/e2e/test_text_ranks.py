"""`vaecache embed` under torchrun: two ranks write the files one process writes, byte for byte (a text set and a
condition set in one run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_torchrun
from tests.text.tiny_text import build_wan_text_folder

pytestmark = pytest.mark.slow


def text_files(cache: Path, folder: str = "text") -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted((cache / folder).rglob("*")) if p.is_file()}


def test_two_ranks_write_the_set_one_process_writes(caption_cache, tmp_path, run_cli):
    wan = build_wan_text_folder(tmp_path / "wan")
    args = ["--text-encoder", f"diffusers:{wan}", "--text-batch", "1", "--shard-size", "1KiB",
            "--condition", "first-frame"]
    one, two = (shutil.copytree(caption_cache, tmp_path / name) for name in ("one", "two"))
    assert run_cli(["embed", one, *args]).exit_code == 0
    result = run_torchrun(2, "embed", two, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "added text set 'default'" in printed and printed.count("added text set") == 1  # rank 0 alone
    files = text_files(one)
    assert sum(name.endswith(".safetensors") for name in files) == 3  # one prompt per shard: both ranks wrote some
    assert text_files(two) == files
    assert json.loads((two / "manifest.json").read_text())["text"] == \
        json.loads((one / "manifest.json").read_text())["text"]
    conditions = text_files(one, "conditions")
    assert sum(name.endswith(".safetensors") for name in conditions) == 3  # one clip per shard
    assert text_files(two, "conditions") == conditions
    assert json.loads((two / "manifest.json").read_text())["conditions"] == \
        json.loads((one / "manifest.json").read_text())["conditions"]
    assert (two / "manifest.json").read_bytes() == (one / "manifest.json").read_bytes()
    assert not (two / ".lock").exists()


def test_two_ranks_resume_what_a_killed_rank_committed_and_repair_what_one_rank_owns(caption_cache, tmp_path,
                                                                                    run_cli):
    import subprocess

    from tests.conftest import subprocess_env, torchrun_cmd

    wan = build_wan_text_folder(tmp_path / "wan")
    args = ["--text-encoder", f"diffusers:{wan}", "--text-batch", "1", "--shard-size", "1KiB"]
    one, two = (shutil.copytree(caption_cache, tmp_path / name) for name in ("one", "two"))
    assert run_cli(["embed", one, *args]).exit_code == 0
    killed = subprocess.run(torchrun_cmd(2, "embed", two, *args), capture_output=True, text=True, timeout=300,
                            env=subprocess_env(VAECACHE_FAULT="crash-after-set-shard:text:1@1"))
    assert killed.returncode != 0
    assert "text" not in json.loads((two / "manifest.json").read_text())
    resumed = run_torchrun(2, "embed", two, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "shard(s) an interrupted run committed kept" in resumed.stdout + resumed.stderr
    assert text_files(two) == text_files(one)
    owned_by_rank_1 = sorted((two / "text").rglob("embeddings-00001.safetensors"))[0]
    owned_by_rank_1.unlink()
    repaired = run_torchrun(2, "embed", two, *args)
    assert repaired.returncode == 0, repaired.stderr[-3000:]
    assert "repaired text set 'default'" in repaired.stdout + repaired.stderr
    assert text_files(two) == text_files(one)
    assert (two / "manifest.json").read_bytes() == (one / "manifest.json").read_bytes()
