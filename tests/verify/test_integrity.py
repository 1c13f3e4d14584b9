"""`vaecache verify` against a battery of corruptions, each applied to a fresh copy of one good cache."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import struct
from pathlib import Path
from typing import Any, Callable

import pytest

from vaecache.cache.layout import CLIPS, FAILURES
from vaecache.cache.manifest import write_manifest_last
from vaecache.cache.reader import CacheReader
from vaecache.cache.table import CLIP_TABLE, FAILURE_TABLE, write_table
from vaecache.verify.integrity import verify_cache

CLIP = "scene_001/000000-000008"
"""The clip the corruptions target (the middle one of three)."""


# --------------------------------------------------------------------------- helpers that damage a cache


def _manifest(cache: Path) -> dict[str, Any]:
    return json.loads((cache / "manifest.json").read_text())


def _write_manifest(cache: Path, manifest: dict[str, Any]) -> None:
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _records(cache: Path) -> list[dict[str, Any]]:
    return list(CacheReader(cache).clip_records())


def _write_records(cache: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite clips.parquet with these records, in this order (the manifest's sha256 is left as it was)."""
    write_table(cache / "clips.parquet", CLIP_TABLE, records)


def _shard_of(cache: Path, clip_id: str = CLIP) -> str:
    for record in _records(cache):
        if record["id"] == clip_id:
            return f"shards/{record['shard']}"
    raise AssertionError(f"{clip_id} not in clips.parquet")


def _rehash_shard(cache: Path, file: str) -> None:
    """Make the manifest agree with the shard's current bytes, so only deeper checks can notice."""
    data = (cache / file).read_bytes()
    manifest = _manifest(cache)
    (entry,) = [s for s in manifest["shards"] if s["file"] == file]
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    _write_manifest(cache, manifest)


def _rehash_clips(cache: Path) -> None:
    manifest = _manifest(cache)
    manifest["clips"]["sha256"] = hashlib.sha256((cache / "clips.parquet").read_bytes()).hexdigest()
    _write_manifest(cache, manifest)


def _set_first_value(cache: Path, tensor: str, value: Callable[[float], float]) -> str:
    """Overwrite the first float32 of `tensor` in place; returns the shard's file."""
    file = _shard_of(cache)
    path = cache / file
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8:8 + header_len])[tensor]
    assert entry["dtype"] == "F32"
    at = 8 + header_len + entry["data_offsets"][0]
    (old,) = struct.unpack_from("<f", data, at)
    struct.pack_into("<f", data, at, value(old))
    path.write_bytes(bytes(data))
    return file


def _edit_clip_record(cache: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    records = _records(cache)
    for record in records:
        if record["id"] == CLIP:
            edit(record)
    _write_records(cache, records)


def truncate_shard(cache: Path) -> tuple[set[str], str]:
    file = _shard_of(cache)
    path = cache / file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return {"shard files"}, f"{file}: "


def flip_byte(cache: Path) -> tuple[set[str], str]:
    file = _shard_of(cache)
    path = cache / file
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's data, not the header
    path.write_bytes(bytes(data))
    return {"shard files"}, f"{file}: sha256"


def delete_shard(cache: Path) -> tuple[set[str], str]:
    file = _shard_of(cache)
    (cache / file).unlink()
    return {"shard files", "tensors match records"}, f"{file}: missing"


def orphan_shard(cache: Path) -> tuple[set[str], str]:
    shutil.copy(cache / _shard_of(cache), cache / "shards" / "a000-r00007-000000.safetensors")
    return {"no orphan shards"}, "shards/a000-r00007-000000.safetensors: shard file not listed in the manifest"


def edit_shape(cache: Path) -> tuple[set[str], str]:
    _edit_clip_record(cache, lambda r: r["tensors"]["mean"].update(shape=[2, 16, 4, 8, 8]))
    return {"clip records", "tensors match records"}, f"clip {CLIP}: mean is F32 [2, 16, 3, 8, 8]"


def edit_shape_rehashed(cache: Path) -> tuple[set[str], str]:
    _edit_clip_record(cache, lambda r: r["tensors"]["mean"].update(shape=[2, 16, 4, 8, 8]))
    _rehash_clips(cache)
    return {"tensors match records", "clip records"}, (f"clip {CLIP}: mean is F32 [2, 16, 3, 8, 8] in "
                                                       f"{_shard_of(cache)}, record says float32 [2, 16, 4, 8, 8]")


def swap_tensor_entries_rehashed(cache: Path) -> tuple[set[str], str]:
    """Two records exchange their tensor entries (same shapes, same shard): every tensor is still claimed
    once and matches its record's shape, but each record now points at the other clip's latents."""
    records = _records(cache)
    first = next(i for i, r in enumerate(records) if r["id"] == CLIP)
    other = next(i for i, r in enumerate(records) if r["id"] != CLIP and r["shard"] == records[first]["shard"])
    records[first]["tensors"], records[other]["tensors"] = records[other]["tensors"], records[first]["tensors"]
    _write_records(cache, records)
    _rehash_clips(cache)
    return {"clip records"}, (f"clip {CLIP}: logvar is stored as tensor '{records[other]['id']}/logvar', "
                              f"expected '{CLIP}/logvar'")


def write_nan(cache: Path) -> tuple[set[str], str]:
    file = _set_first_value(cache, f"{CLIP}/mean", lambda old: math.nan)
    _rehash_shard(cache, file)
    return {"values finite and match stats"}, f"clip {CLIP}: mean in {file} has 1 non-finite value(s)"


def alter_value(cache: Path) -> tuple[set[str], str]:
    file = _set_first_value(cache, f"{CLIP}/logvar", lambda old: old + 0.25)
    _rehash_shard(cache, file)
    return {"values finite and match stats"}, f"clip {CLIP}: logvar in {file} "


def swap_channels_rehashed(cache: Path) -> tuple[set[str], str]:
    """Channels 0 and 1 of a clip's mean exchanged in its shard (the shard rehashed): the same values, so the
    per-tensor min, max, mean and std still agree with the record; only its per-channel statistics tell."""
    from safetensors.torch import load_file, save_file

    file = _shard_of(cache)
    tensors = load_file(cache / file)
    mean = tensors[f"{CLIP}/mean"]
    tensors[f"{CLIP}/mean"] = mean[:, [1, 0, *range(2, mean.shape[1])]].contiguous()
    save_file(tensors, cache / file, metadata={"format": "vaecache/2"})
    _rehash_shard(cache, file)
    return {"values finite and match stats"}, f"clip {CLIP}: mean in {file} channel 0 mean is "


def edit_channel_stat_rehashed(cache: Path) -> tuple[set[str], str]:
    def edit(record: dict[str, Any]) -> None:
        record["tensors"]["logvar"]["channel_stats"]["std"][5] *= 1.5

    _edit_clip_record(cache, edit)
    _rehash_clips(cache)
    return {"values finite and match stats"}, f"clip {CLIP}: logvar in {_shard_of(cache)} channel 5 std is "


def duplicate_record(cache: Path) -> tuple[set[str], str]:
    records = _records(cache)
    _write_records(cache, records[:2] + [records[1]] + records[2:])
    _rehash_clips(cache)
    return {"clip records"}, f"clip {CLIP}: recorded twice"


def delete_manifest(cache: Path) -> tuple[set[str], str]:
    (cache / "manifest.json").unlink()
    return {"manifest"}, "incomplete: no final manifest; 3 clips in 1 shards are committed"


def future_version(cache: Path) -> tuple[set[str], str]:
    manifest = _manifest(cache)
    manifest["format_version"] = 99
    _write_manifest(cache, manifest)
    return {"manifest"}, "format version 99 is not supported"


def record_points_elsewhere(cache: Path) -> tuple[set[str], str]:
    _edit_clip_record(cache, lambda r: r.update(shard="a000-r00009-000000.safetensors"))
    _rehash_clips(cache)
    return {"tensors match records"}, f"clip {CLIP}: its shard shards/a000-r00009-000000.safetensors is not in"


def drop_record(cache: Path) -> tuple[set[str], str]:
    records = _records(cache)
    _write_records(cache, records[:1] + records[2:])
    _rehash_clips(cache)
    return ({"clip records", "tensors match records", "manifest declarations"},
            f"tensor {CLIP}/logvar is claimed by no clip record")


def edit_failures(cache: Path) -> tuple[set[str], str]:
    write_table(cache / "failures.parquet", FAILURE_TABLE, [{"key": "x", "reason": "made up", "scene": "x"}])
    return {"failures file", "manifest declarations"}, "failures.parquet: sha256 differs from the manifest"


def flip_clip_table_byte(cache: Path) -> tuple[set[str], str]:
    """One byte of clips.parquet changed on disk: caught by its sha256 (and the page checksums) naming the file."""
    path = cache / "clips.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    return {"clip records"}, "clips.parquet: sha256 differs from the manifest"


def unsorted_records_rehashed(cache: Path) -> tuple[set[str], str]:
    records = _records(cache)
    _write_records(cache, [records[1], records[0], records[2]])
    _rehash_clips(cache)
    return {"clip records"}, f"clips.parquet: clip {records[0]['id']} comes after {CLIP} (records must be sorted by id)"


def _move_shard_out(cache: Path) -> tuple[str, Path]:
    """Move the cache's one shard out of OUT, beside it; returns its old file and new path."""
    file = _shard_of(cache)
    elsewhere = cache.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    moved = elsewhere / Path(file).name
    shutil.move(cache / file, moved)
    return file, moved


def shard_outside_out_rehashed(cache: Path) -> tuple[set[str], str]:
    """The manifest and every record name the shard as shards/../../elsewhere/X (hashes recomputed): the file is
    intact, but outside OUT; never opened, named twice (the manifest entry, each record)."""
    file, moved = _move_shard_out(cache)
    outside = f"../{moved.parent.name}/{moved.name}"
    manifest = _manifest(cache)
    manifest["shards"][0]["file"] = f"shards/../{outside}"
    _write_manifest(cache, manifest)
    records = _records(cache)
    for record in records:
        record["shard"] = f"../{outside}"
    _write_records(cache, records)
    _rehash_clips(cache)
    return {"shard files", "clip records"}, f"shards[].file: 'shards/../{outside}' is not a shard file in"


def absolute_shard_in_manifest(cache: Path) -> tuple[set[str], str]:
    """An absolute path in the manifest's shard list (once, /etc/passwd was opened and hashed)."""
    manifest = _manifest(cache)
    manifest["shards"].append({"file": "/etc/passwd", "bytes": 1, "sha256": "0" * 64, "clips": 0, "tensors": 0})
    _write_manifest(cache, manifest)
    return {"shard files", "manifest declarations"}, "shards[].file: '/etc/passwd' is not a shard file in"


def shard_symlinked_out(cache: Path) -> tuple[set[str], str]:
    """shards/X is a symlink to an identical file outside OUT: same bytes, same hash, still refused."""
    file, moved = _move_shard_out(cache)
    (cache / file).symlink_to(moved)
    return {"shard files"}, f"{file}: '{file}' leads out of {cache} through a symlink"


def clip_table_outside_out(cache: Path) -> tuple[set[str], str]:
    outside = cache.parent / "clips-elsewhere.parquet"
    shutil.copy(cache / "clips.parquet", outside)
    manifest = _manifest(cache)
    manifest["clips"]["file"] = str(outside)
    _write_manifest(cache, manifest)
    return {"manifest"}, f"clips.file: '{outside}' is not a path inside {cache}"


def id_encode_refuses_rehashed(cache: Path) -> tuple[set[str], str]:
    _edit_clip_record(cache, lambda r: r.update(id="../../escape/000000-000008", scene="../../escape"))
    _rehash_clips(cache)
    return ({"clip records", "tensors match records"},
            "clip ../../escape/000000-000008: clip id '../../escape/000000-000008': its scene id is a name with '/'")


def declared_shape_differs(cache: Path) -> tuple[set[str], str]:
    manifest = _manifest(cache)
    manifest["latent"]["shape"]["mean"] = [2, 16, 3, 8, 9]
    _write_manifest(cache, manifest)
    return {"clip records"}, "mean has shape [2, 16, 3, 8, 8], the manifest's latent.shape declares [2, 16, 3, 8, 9]"


def declared_dtype_differs(cache: Path) -> tuple[set[str], str]:
    manifest = _manifest(cache)
    manifest["latent"]["dtype"] = "bfloat16"
    _write_manifest(cache, manifest)
    return {"clip records"}, "logvar is stored as float32, the manifest's latent.dtype is bfloat16"


def declared_counts_differ(cache: Path) -> tuple[set[str], str]:
    manifest = _manifest(cache)
    manifest["counts"]["views"] = 99
    _write_manifest(cache, manifest)
    return {"manifest declarations"}, "counts.views is 99, the cache holds 6"


def manifest_with_nan(cache: Path) -> tuple[set[str], str]:
    """NaN in manifest.json (Python's json writes and reads it; JSON has no such number)."""
    text = (cache / "manifest.json").read_text()
    (cache / "manifest.json").write_text(text.replace('"oom_backoffs": 0', '"oom_backoffs": NaN'))
    return {"manifest"}, "manifest.json: the manifest does not parse (NaN is not a JSON number"


def record_fps_nan_rehashed(cache: Path) -> tuple[set[str], str]:
    _edit_clip_record(cache, lambda r: r.update(fps=math.nan))
    _rehash_clips(cache)
    return {"clip records"}, f"clip {CLIP}: fps or frame times hold a non-finite number (fps nan)"


CORRUPTIONS = [manifest_with_nan, record_fps_nan_rehashed, shard_outside_out_rehashed, absolute_shard_in_manifest,
               shard_symlinked_out, clip_table_outside_out,
               id_encode_refuses_rehashed, declared_shape_differs, declared_dtype_differs, declared_counts_differ,
               truncate_shard, flip_byte, delete_shard, orphan_shard, edit_shape, edit_shape_rehashed,
               swap_tensor_entries_rehashed, write_nan, swap_channels_rehashed, edit_channel_stat_rehashed,
               alter_value, duplicate_record, delete_manifest, future_version, record_points_elsewhere, drop_record,
               edit_failures, flip_clip_table_byte, unsorted_records_rehashed]


def _failing(report: dict[str, Any]) -> set[str]:
    return {check["name"].split(" (")[0] for check in report["checks"] if check["failed"]}


def _problems(report: dict[str, Any]) -> str:
    return "\n".join(p for check in report["checks"] for p in check["problems"] + [check["note"]])


# --------------------------------------------------------------------------- tests


def test_good_cache_passes(good_cache: Path, run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["verify", good_cache, "--json", tmp_path / "report.json"])
    assert result.exit_code == 0, result.output
    assert "cache OK" in result.output and "FAIL" not in result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True and report["complete"] is True
    assert report["summary"]["clips"] == 3 and report["summary"]["views"] == 6 and report["summary"]["failures"] == 0
    assert all(check["failed"] == 0 for check in report["checks"])
    values = next(c for c in report["checks"] if c["name"].startswith("values"))
    assert values["passed"] == 6  # mean and logvar of 3 clips, all re-read and compared with their stats


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_corruption_is_caught_and_named(corrupt: Callable, cache_copy: Path, run_cli: Callable, tmp_path: Path) -> None:
    failing, message = corrupt(cache_copy)
    report_file = tmp_path / "report.json"
    result = run_cli(["verify", cache_copy, "--json", report_file])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "cache has problems" in result.output
    assert message in result.output  # the user sees which shard or clip, in full, on one line
    report = json.loads(report_file.read_text())
    assert report["ok"] is False
    assert _failing(report) == failing, _problems(report)
    assert message in _problems(report)


@pytest.mark.parametrize("corrupt", [truncate_shard, delete_shard, orphan_shard], ids=lambda f: f.__name__)
def test_quick_still_catches_file_level_damage(corrupt: Callable, cache_copy: Path, run_cli: Callable) -> None:
    _, message = corrupt(cache_copy)
    result = run_cli(["verify", "--quick", cache_copy])
    assert result.exit_code == 1, result.output
    assert message in result.output


def test_quick_passes_a_good_cache_and_skips_values(good_cache: Path, run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["verify", good_cache, "--quick", "--json", tmp_path / "r.json"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is True
    assert [c["skipped"] for c in report["checks"] if c["name"].startswith("values")] == [True]


def test_damage_in_one_of_several_shards_names_only_that_shard(sharded_cache: Path, tmp_path: Path) -> None:
    cache = Path(shutil.copytree(sharded_cache, tmp_path / "cache"))
    shards = sorted(p.name for p in (cache / "shards").iterdir())
    assert len(shards) == 2
    target, other = shards[1], shards[0]
    (cache / "shards" / target).write_bytes((cache / "shards" / target).read_bytes()[:-10])
    report = verify_cache(cache)
    assert not report.ok
    problems = "\n".join(p for check in report.checks for p in check.problems)
    assert f"shards/{target}" in problems and other not in problems
    assert verify_cache(sharded_cache).ok


def test_incomplete_cache_after_a_crash_reports_committed_clips(cache_copy: Path) -> None:
    # A run that died before writing the manifest: the progress log says what is committed.
    (cache_copy / "manifest.json").unlink()
    report = verify_cache(cache_copy, quick=True)
    assert not report.complete and not report.ok
    assert "3 clips in 1 shards are committed" in report.checks[0].note


def test_a_cache_with_no_clips_fails(tmp_path: Path) -> None:
    write_manifest_last(tmp_path, {"counts": {"planned_clips": 0}}, [], write_table(tmp_path / CLIPS, CLIP_TABLE, []),
                        write_table(tmp_path / FAILURES, FAILURE_TABLE, []))
    report = verify_cache(tmp_path)
    assert report.complete and not report.ok
    (records,) = [c for c in report.checks if c.name == "clip records"]
    assert records.problems == ["clips.parquet: the cache holds no clips (an empty cache is not a result)"]


def test_most_planned_clips_missing_is_a_warning_not_a_failure(cache_copy: Path) -> None:
    manifest = _manifest(cache_copy)
    manifest["counts"]["planned_clips"] = 10
    _write_manifest(cache_copy, manifest)
    report = verify_cache(cache_copy)
    assert report.ok
    (records,) = [c for c in report.checks if c.name == "clip records"]
    assert records.note == "warning: only 3 of 10 planned clips were encoded; see failures.parquet"
    assert report.summary["planned_clips"] == 10


@pytest.mark.parametrize("target", ["missing", "file"])
def test_verify_on_a_path_that_is_not_a_cache_folder_is_a_usage_error(run_cli: Callable, tmp_path: Path,
                                                                      target: str) -> None:
    path = tmp_path / "nothing-here"
    if target == "file":
        path.write_text("x")
    result = run_cli(["verify", path])
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: ") and str(path) in line


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_must_be_positive(run_cli: Callable, good_cache: Path, threads: str) -> None:
    result = run_cli(["verify", good_cache, "--threads", threads])
    assert result.exit_code == 2 and "--threads must be >= 1" in result.output


def test_threads_do_not_change_the_verdict(good_cache: Path) -> None:
    one, three = verify_cache(good_cache, threads=1), verify_cache(good_cache, threads=3)
    assert one.to_json()["checks"] == three.to_json()["checks"]


def test_a_folder_that_is_not_a_cache_fails_cleanly(run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["verify", tmp_path])
    assert result.exit_code == 1
    assert "no manifest" in result.output and "Traceback" not in result.output


def test_paths_with_brackets_are_printed_verbatim(run_cli: Callable, good_cache: Path, tmp_path: Path) -> None:
    # rich would read "[/x]" as markup; the path must reach the user unchanged, not crash the renderer.
    odd = tmp_path / "[/x]" / "[bold]cache"
    shutil.copytree(good_cache, odd)
    result = run_cli(["verify", odd])
    assert result.exit_code == 0, result.output
    assert "[bold]cache" in result.output.replace("\n", "")
    missing = run_cli(["verify", tmp_path / "[/x]" / "nope"])
    assert missing.exit_code == 2 and f"error: {tmp_path / '[/x]' / 'nope'}: no such folder" in missing.output


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda m: m["buckets"][0].update(clips=m["buckets"][0]["clips"] + 1),
     r"bucket \S+ declares \d+ clips and \d+ views, its records are \d+ clips"),
    (lambda m: m["buckets"].pop(0), r"bucket \S+: \d+ clip record\(s\) name it, the manifest does not list it"),
    (lambda m: next(b for b in m["buckets"] if b["clips"]).pop("shape"),
     r"holds \d+ clips but declares no latent shape"),
    (lambda m: m["latent"].update(shape={"mean": [1, 2, 3]}),
     r"latent.shape is .*, but the cache holds several latent shapes \(see buckets\)"),
])
def test_a_bucketed_manifest_must_declare_what_its_records_hold(bucket_cache: Path, tmp_path: Path, edit: Callable,
                                                                problem: str) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(bucket_cache, cache)
    assert verify_cache(cache, quick=True).ok
    manifest = _manifest(cache)
    edit(manifest)
    _write_manifest(cache, manifest)
    report = verify_cache(cache, quick=True).to_json()
    assert "manifest declarations" in _failing(report)
    assert re.search(problem, _problems(report)), _problems(report)


def test_repair_deletes_stray_shards_under_the_lock_and_keeps_what_is_committed(cache_copy: Path,
                                                                                run_cli: Callable) -> None:
    committed = [_shard_of(cache_copy).split("/")[-1]]
    orphan_shard(cache_copy)
    (cache_copy / "shards" / ".a001-r00000-000000.safetensors.tmp").write_bytes(b"half a shard")
    assert run_cli(["verify", cache_copy]).exit_code == 1
    repaired = run_cli(["verify", cache_copy, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert "--repair deleted 2 stray shard(s): shards/.a001-r00000-000000.safetensors.tmp, " \
           "shards/a000-r00007-000000.safetensors" in repaired.output
    assert sorted(p.name for p in (cache_copy / "shards").iterdir()) == committed
    assert not (cache_copy / ".lock").exists()

    orphan_shard(cache_copy)
    (cache_copy / "manifest.json").unlink()  # an incomplete cache: what the progress logs commit is kept
    run_cli(["verify", cache_copy, "--repair"])
    assert sorted(p.name for p in (cache_copy / "shards").iterdir()) == committed

    (cache_copy / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    with open(cache_copy / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live job holds it
        refused = run_cli(["verify", cache_copy, "--repair"])
    assert refused.exit_code == 1 and "locked by another vaecache job" in refused.output


def test_repair_deletes_nothing_when_nothing_readable_says_what_is_committed(cache_copy: Path,
                                                                            run_cli: Callable) -> None:
    shards = sorted(p.name for p in (cache_copy / "shards").iterdir())
    (cache_copy / "manifest.json").write_text("{not json")
    refused = run_cli(["verify", cache_copy, "--repair"])
    assert refused.exit_code == 1 and "--repair deletes nothing while the manifest cannot be read" in refused.output
    (cache_copy / "manifest.json").unlink()
    shutil.rmtree(cache_copy / "progress")  # a copy without its progress logs
    refused = run_cli(["verify", cache_copy, "--repair"])
    assert refused.exit_code == 1 and "no progress log says which shards are committed" in refused.output
    assert sorted(p.name for p in (cache_copy / "shards").iterdir()) == shards


def test_a_listed_shard_whose_progress_line_is_gone_is_named_and_the_rerun_encodes_its_clips_again(
        sharded_cache: Path, demo_data: Path, tmp_path: Path, run_cli: Callable) -> None:
    """As an object store's verify names a listed shard without its commit record, a folder's names one without its
    progress line: the next encode would take it for a stray; the rerun verify points to encodes its clips again."""
    from tests.conftest import ENCODE_ARGS

    cache = Path(shutil.copytree(sharded_cache, tmp_path / "cache"))
    (log,) = sorted((cache / "progress").glob("rank-*.jsonl"))
    lines = log.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 2
    gone = json.loads(lines[0])["shard"]["file"]
    log.write_bytes(b"".join(lines[1:]))
    report_file = tmp_path / "report.json"
    result = run_cli(["verify", cache, "--json", report_file])
    assert result.exit_code == 1, result.output
    (row,) = [check for check in json.loads(report_file.read_text())["checks"] if check["name"] == "progress lines"]
    assert row["failed"] == 1 and row["passed"] == len(lines) - 1
    assert row["problems"] == [f"{gone}: listed in the manifest, no progress line commits it any more (the next "
                               "encode would take it for a stray, delete it and encode its clips again)"]
    assert "rerun the same encode command to encode their clips again" in row["note"]
    again = run_cli(["encode", demo_data, "--out", cache, *ENCODE_ARGS, "--shard-size", "50000"])
    assert again.exit_code == 0, again.output
    assert run_cli(["verify", cache]).exit_code == 0
    assert [r["id"] for r in _records(cache)] == [r["id"] for r in _records(sharded_cache)]
