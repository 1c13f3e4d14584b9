"""The command line as a user meets it: exit codes, one-line errors, demo commands, reruns of encode."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import vaecache
from tests.conftest import ENCODE_ARGS, assert_same_tensors, load_tensors
from vaecache.cache.reader import CacheReader
from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.errors import DatasetError
from vaecache.video.backends import open_video

STANDARD = {"--vae": "builtin:tiny", "--num-frames": "9", "--size": "64x64"}


def _error_line(output: str) -> str:
    """The one `error:` line of a failed command (and insist there is exactly one)."""
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


def _encode_args(data: Path, out: Path, **overrides: str | None) -> list[str]:
    """The standard encode command with flags replaced (num_frames="5" -> --num-frames 5) or dropped (None)."""
    flags = {**STANDARD, **{f"--{key.replace('_', '-')}": value for key, value in overrides.items()}}
    args = ["encode", str(data), "--out", str(out)]
    for flag, value in flags.items():
        if value is not None:
            args += [flag, value]
    return args + ["--workers", "0", "--no-progress"]


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def empty_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


BAD_INPUT = {
    "missing DATA path": (dict(), "nope", r"nope: dataset path does not exist"),
    "empty folder": (dict(), "empty", r"empty: no videos .* and no scene folders found"),
    "unknown VAE spec": (dict(vae="wan2.1"), None, r"unknown VAE spec 'wan2.1'"),
    "unknown builtin": (dict(vae="builtin:huge"), None, r"the builtins are builtin:tiny, builtin:small"),
    "missing --vae": (dict(vae=None), None, r"--vae is required"),
    "size not HxW": (dict(size="64"), None, r"--size must look like HxW .*got '64'"),
    "size not a multiple of 8": (dict(size="60x64"), None, r"height 60 is not a multiple of 8 .*56 and 64"),
    "num-frames not 1+4k": (dict(num_frames="10"), None, r"--num-frames 10 .*nearest valid\D*9 and 13"),
    "num-frames zero": (dict(num_frames="0"), None, r"--num-frames must be >= 1"),
    "store unknown": (dict(store="latents"), None, r"--store must be one of mean-logvar, mean, sample"),
    "decoder unknown": (dict(decoder="opencv"), None,
                        r"--decoder must be one of auto, pyav, decord, torchcodec, got 'opencv'"),
    "camera typo": (dict(cameras="cam_0,cam_9"), None, r"camera\(s\) cam_9 from --cameras are in no scene"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT), ids=list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case: str, run_cli: Callable, demo_data: Path, empty_folder: Path,
                                          tmp_path: Path) -> None:
    overrides, data_name, pattern = BAD_INPUT[case]
    data = {None: demo_data, "nope": tmp_path / "nope", "empty": empty_folder}[data_name]
    out = tmp_path / "out"
    result = run_cli(_encode_args(data, out, **overrides))
    assert result.exit_code == 2, result.output
    assert re.search(pattern, _error_line(result.output)), result.output
    assert "Traceback" not in result.output
    assert not out.exists()  # refused before OUT was touched


def test_usage_mistakes_typer_catches_are_exit_2(run_cli: Callable, demo_data: Path, tmp_path: Path) -> None:
    assert run_cli(["encode"]).exit_code == 2  # no DATA
    result = run_cli(["encode", demo_data, "--out", tmp_path / "o", "--num-frames", "nine"])
    assert result.exit_code == 2 and "--num-frames" in result.output


def test_version_and_help(run_cli: Callable) -> None:
    version = run_cli(["--version"])
    assert version.exit_code == 0 and version.stdout.strip() == f"vaecache {vaecache.__version__}"
    for command in ("encode", "verify", "demo-data", "demo"):
        assert run_cli([command, "--help"]).exit_code == 0


def test_debug_env_shows_the_traceback_in_process(run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(_encode_args(tmp_path / "nope", tmp_path / "out"), env={"VAECACHE_DEBUG": "1"})
    assert isinstance(result.exception, DatasetError)


# --------------------------------------------------------------------------- real processes


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != "VAECACHE_DEBUG"}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env={**environ, **env})


def test_console_script_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("vaecache")  # the console script of this environment
    command = str(script) if script.exists() else shutil.which("vaecache") or "vaecache"
    proc = _run([command, "encode", str(tmp_path / "nope"), "--out", str(tmp_path / "out"), "--num-frames", "9",
                 "--size", "64x64"])
    assert proc.returncode == 2
    assert "--vae is required" in _error_line(proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_module_entry_point_with_debug_shows_a_traceback(tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "vaecache", "verify", str(tmp_path / "nope")], VAECACHE_DEBUG="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UsageError" in proc.stderr and "no such folder" in proc.stderr


def test_module_entry_point_verifies_a_good_cache(good_cache: Path, tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "vaecache", "verify", str(good_cache), "--json", str(tmp_path / "r.json")])
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    assert "cache OK" in proc.stderr


# --------------------------------------------------------------------------- demo commands


def test_demo_data_writes_the_requested_layout(run_cli: Callable, tmp_path: Path) -> None:
    root = tmp_path / "data"
    result = run_cli(["demo-data", root, "--scenes", "2", "--cameras", "3", "--frames", "6", "--size", "32x40",
                      "--fps", "7", "--seed", "4"])
    assert result.exit_code == 0, result.output
    expected = sorted(root / f"scene_{s:03d}" / f"cam_{c}.mp4" for s in range(2) for c in range(3))
    assert sorted(p for p in root.rglob("*") if p.is_file()) == expected
    with open_video(str(expected[0])) as reader:
        assert len(reader) == 6 and reader.read([0]).shape == (1, 32, 40, 3) and reader.fps() == pytest.approx(7)
    assert "wrote 6 videos" in result.output


def test_a_width_decord_misreads_still_encodes(run_cli: Callable, tmp_path: Path) -> None:
    data = tmp_path / "d"
    assert run_cli(["demo-data", data, "--scenes", "1", "--cameras", "1", "--frames", "9",
                    "--size", "64x48"]).exit_code == 0
    result = run_cli(["encode", data, "--out", tmp_path / "o", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x48", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0, result.output


def test_demo_runs_end_to_end(run_cli: Callable, tmp_path: Path) -> None:
    result = run_cli(["demo", "--dir", tmp_path / "demo"])
    assert result.exit_code == 0, result.output
    cache = tmp_path / "demo" / "cache"
    assert (cache / "manifest.json").is_file() and len(list((tmp_path / "demo" / "data").glob("*/*.mp4"))) == 6
    assert run_cli(["verify", cache]).exit_code == 0
    import av

    with av.open(str(tmp_path / "demo" / "preview.mp4")) as video:  # source row above reconstruction, 2 cameras
        stream = video.streams.video[0]
        assert (stream.width, stream.height) == (128, 128) and len(list(video.decode(stream))) == 9
    psnr = float(re.search(r"PSNR ([0-9.]+) dB, mean over cameras", " ".join(result.output.split())).group(1))
    assert 19.3 <= psnr < 100  # builtin:small is trained (20.3 dB measured on this held-out clip)
    page = tmp_path / "demo" / "report" / "index.html"  # it ends with the cache's report, and says where
    assert f"report: {page} (open it in a browser)" in result.output and page.is_file()
    shown = json.loads((tmp_path / "demo" / "report" / "report.json").read_text())["clips"]
    assert len(shown) == 3 and all(camera["psnr_db"] > 19 for clip in shown for camera in clip["cameras"])

    # the encode command the demo prints is the one it ran: the same bytes into another OUT
    printed = next(line.strip() for line in result.output.splitlines() if line.strip().startswith("vaecache encode "))
    args = shlex.split(printed)[1:]
    again = tmp_path / "again"
    args[args.index("--out") + 1] = str(again)
    assert run_cli(args).exit_code == 0
    assert_same_tensors(load_tensors(cache), load_tensors(again))


# --------------------------------------------------------------------------- JSONL index and skipped scenes


def test_encode_from_an_index_with_frame_ranges_reports_short_scenes(run_cli: Callable, demo_data: Path,
                                                                    tmp_path: Path, cache_io: Any) -> None:
    index = tmp_path / "lists" / "index.jsonl"
    index.parent.mkdir()
    rel = Path("..") / "videos"
    shutil.copytree(demo_data / "scene_000", tmp_path / "videos")
    cams = {"front": str(rel / "cam_0.mp4"), "back": str(rel / "cam_1.mp4")}
    index.write_text(json.dumps({"id": "late", "cameras": cams, "frames": [4, 17]}) + "\n"
                     + json.dumps({"id": "short", "cameras": cams, "frames": [0, 5]}) + "\n")
    out = tmp_path / "out"
    result = run_cli(_encode_args(index, out))
    assert result.exit_code == 3, result.output  # partial: a scene was skipped
    (record,) = cache_io.clips(out)
    assert record["id"] == "late/000004-000012" and record["frames"] == list(range(4, 13))
    assert record["cameras"] == ["back", "front"]
    assert record["sources"] == [str((tmp_path / "videos" / f"cam_{i}.mp4").resolve()) for i in (1, 0)]
    (failure,) = CacheReader(out).failure_records()
    assert failure["scene"] == "short" and failure["reason"].startswith("too short: 5 usable frames")
    assert "skipped inputs" in result.output
    assert f"{out}/failures.parquet" in re.sub(r"[\s│]", "", result.output)  # the summary points at it (cells fold)
    assert run_cli(["verify", out]).exit_code == 0


def test_broken_video_is_skipped_and_named(run_cli: Callable, tmp_path: Path, cache_io: Any) -> None:
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=2, cameras=1, frames=5, height=32, width=32))
    (data / "scene_001" / "cam_0.mp4").write_bytes(b"\x00" * 500)
    out = tmp_path / "out"
    result = run_cli(_encode_args(data, out, num_frames="5", size="32x32"))
    assert result.exit_code == 3, result.output
    assert [r["id"] for r in cache_io.clips(out)] == ["scene_000/000000-000004"]
    (failure,) = CacheReader(out).failure_records()
    assert failure["path"].endswith("scene_001/cam_0.mp4") and "not a readable video" in failure["reason"]


def test_on_error_fail_stops_at_an_unreadable_video(run_cli: Callable, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=2, cameras=1, frames=5, height=32, width=32))
    (data / "scene_001" / "cam_0.mp4").write_bytes(b"\x00" * 500)
    result = run_cli(_encode_args(data, tmp_path / "out", num_frames="5", size="32x32") + ["--on-error", "fail"])
    assert result.exit_code == 1, result.output
    assert "scene_001/cam_0.mp4: not a readable video" in _error_line(result.output)
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- rerunning encode


def test_rerun_of_a_complete_cache_changes_nothing(run_cli: Callable, cache_copy: Path, demo_data: Path,
                                                   cache_io: Any) -> None:
    before = cache_io.tensors(cache_copy)
    shards_before = cache_io.manifest(cache_copy)["shards"]
    result = run_cli(_encode_args(demo_data, cache_copy))
    assert result.exit_code == 0, result.output
    cache_io.same_tensors(cache_io.tensors(cache_copy), before)
    assert cache_io.manifest(cache_copy)["shards"] == shards_before
    assert len(cache_io.clips(cache_copy)) == 3
    assert run_cli(["verify", cache_copy]).exit_code == 0


@pytest.mark.parametrize(("overrides", "differs"), [
    (dict(num_frames="5"), "num_frames: 9 -> 5"),
    (dict(dtype="bf16"), 'dtype: "fp32" -> "bf16"'),
    (dict(store="mean"), 'store: "mean-logvar" -> "mean"'),
])
def test_rerun_with_other_settings_is_refused(run_cli: Callable, cache_copy: Path, demo_data: Path,
                                              overrides: dict, differs: str) -> None:
    result = run_cli(_encode_args(demo_data, cache_copy, **overrides))
    assert result.exit_code == 2, result.output
    line = _error_line(result.output)
    assert "made with other settings" in line and differs in line and "--overwrite" in line
    assert run_cli(["verify", cache_copy]).exit_code == 0  # the refused run left the cache complete


def test_overwrite_starts_over(run_cli: Callable, cache_copy: Path, demo_data: Path, cache_io: Any) -> None:
    result = run_cli(_encode_args(demo_data, cache_copy, num_frames="5") + ["--overwrite"])
    assert result.exit_code == 0, result.output
    manifest = cache_io.manifest(cache_copy)
    assert manifest["settings"]["num_frames"] == 5
    assert len(cache_io.clips(cache_copy)) == 9  # 17 frames -> 3 clips of 5 per scene
    tensors = cache_io.tensors(cache_copy)
    assert {tuple(t.shape) for t in tensors.values()} == {(2, 16, 2, 8, 8)}
    assert all(name.split("/")[1] != "000000-000008" for name in tensors)  # nothing left of the old run
    assert run_cli(["verify", cache_copy]).exit_code == 0


def test_out_that_holds_other_files_is_refused(run_cli: Callable, demo_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    result = run_cli(_encode_args(demo_data, out))
    assert result.exit_code == 2 and "not a vaecache output" in _error_line(result.output)
    assert (out / "thesis.tex").read_text() == "precious"


def test_a_file_url_out_writes_the_folder_it_names(run_cli: Callable, demo_data: Path, tmp_path: Path) -> None:
    result = run_cli(_encode_args(demo_data, f"file://{tmp_path}/by%20url", max_clips_per_scene="1"))  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    assert (tmp_path / "by url" / "manifest.json").is_file()
    assert not Path("file:").exists()
    assert run_cli(["verify", f"file://{tmp_path}/by%20url"]).exit_code == 0


def test_a_dtype_run_stores_that_dtype(run_cli: Callable, demo_data: Path, tmp_path: Path, cache_io: Any) -> None:
    out = tmp_path / "bf16"
    result = run_cli(_encode_args(demo_data, out, dtype="bf16", store="mean", max_clips_per_scene="1"))
    assert result.exit_code == 0, result.output
    assert {t.dtype for t in cache_io.tensors(out).values()} == {torch.bfloat16}
    assert {r["tensors"]["mean"]["dtype"] for r in cache_io.clips(out)} == {"bfloat16"}
    assert run_cli(["verify", out]).exit_code == 0


def test_a_cache_recorded_by_0_3_with_one_view_per_forward_resumes_at_k_1(run_cli: Callable, cache_copy: Path,
                                                                          demo_data: Path, cache_io: Any) -> None:
    """0.3 recorded "max_views_per_forward": 1 (one view per forward), which is K = 1 now; "all" is another run."""
    run_record = json.loads((cache_copy / "run.json").read_text())
    for part in ("vae", "latents"):
        assert run_record["fingerprint"][part].pop("views_per_forward") == 1
        run_record["fingerprint"][part]["max_views_per_forward"] = 1
    (cache_copy / "run.json").write_text(json.dumps(run_record))
    before = cache_io.tensors(cache_copy)
    assert run_cli(_encode_args(demo_data, cache_copy)).exit_code == 0
    cache_io.same_tensors(cache_io.tensors(cache_copy), before)
    refused = run_cli(_encode_args(demo_data, cache_copy) + ["--views-per-forward", "all"])
    assert refused.exit_code == 2 and "views_per_forward: 1 -> 2" in _error_line(refused.output)


def test_a_resume_with_other_numerics_is_refused_and_changes_nothing(run_cli: Callable, cache_copy: Path,
                                                                    demo_data: Path, cache_io: Any) -> None:
    """Another torch (or GPU kind, or CPU thread count) gives other last bits: adding them would mix the cache."""
    run_record = json.loads((cache_copy / "run.json").read_text())
    numerics = run_record["fingerprint"]["numerics"]
    assert numerics["device"] == "cpu" and numerics["torch"] == torch.__version__ and numerics["threads"] >= 1
    assert cache_io.manifest(cache_copy)["producer"]["numerics"] == numerics
    numerics["torch"] = "2.0.0+cpu"
    (cache_copy / "run.json").write_text(json.dumps(run_record))
    before = cache_io.tensors(cache_copy)
    refused = run_cli(_encode_args(demo_data, cache_copy))
    assert refused.exit_code == 2
    assert (f'encoded with other numerics (numerics.torch: "2.0.0+cpu" -> "{torch.__version__}")'
            in _error_line(refused.output))
    cache_io.same_tensors(cache_io.tensors(cache_copy), before)
    assert json.loads((cache_copy / "run.json").read_text()) == run_record


def test_allow_other_numerics_repairs_a_shard_and_the_manifest_lists_both(run_cli: Callable, cache_copy: Path,
                                                                           demo_data: Path, cache_io: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A requeued job lands on other hardware and the cache needs work (here: a damaged shard to re-encode): with
    --allow-other-numerics it goes on, and the manifest says which numerics computed its latents."""
    run_record = json.loads((cache_copy / "run.json").read_text())
    current = dict(run_record["fingerprint"]["numerics"])
    run_record["fingerprint"]["numerics"]["torch"] = "2.0.0+cpu"
    (cache_copy / "run.json").write_text(json.dumps(run_record))
    before = {name: tensor.clone() for name, tensor in cache_io.tensors(cache_copy).items()}  # not mapped views
    shard = sorted((cache_copy / "shards").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse clocks: make the change visible

    other_settings = run_cli(_encode_args(demo_data, cache_copy) + ["--allow-other-numerics", "--views-per-forward",
                                                                     "all"])
    assert other_settings.exit_code == 2 and "made with other settings" in _error_line(other_settings.output)
    resumed = run_cli(_encode_args(demo_data, cache_copy) + ["--allow-other-numerics"])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming as --allow-other-numerics asks" in caplog.text
    producer = cache_io.manifest(cache_copy)["producer"]
    assert producer["numerics"] == current
    assert producer["numerics_history"] == [{**current, "torch": "2.0.0+cpu"}, current]
    cache_io.same_tensors(cache_io.tensors(cache_copy), before)  # (the same torch really computed both here)
    assert run_cli(["verify", cache_copy]).exit_code == 0
    inspected = run_cli(["inspect", cache_copy])
    assert inspected.exit_code == 0 and "latents computed with 2 numerics" in inspected.output
    assert "torch 2.0.0+cpu" in inspected.output
    # run.json now records what this run computed with: a plain resume on it needs no flag
    assert json.loads((cache_copy / "run.json").read_text())["fingerprint"]["numerics"] == current
    assert run_cli(_encode_args(demo_data, cache_copy)).exit_code == 0


def test_a_cpu_resume_computes_with_the_recorded_thread_count(run_cli: Callable, cache_copy: Path, demo_data: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_record = json.loads((cache_copy / "run.json").read_text())
    recorded = 3 if run_record["fingerprint"]["numerics"]["threads"] != 3 else 1
    run_record["fingerprint"]["numerics"]["threads"] = recorded
    (cache_copy / "run.json").write_text(json.dumps(run_record))
    threads = torch.get_num_threads()
    resumed = run_cli(_encode_args(demo_data, cache_copy))
    assert resumed.exit_code == 0, resumed.output
    last = (cache_copy / "logs" / "rank-00000.log").read_text().splitlines()
    assert f"device cpu ({recorded} torch threads)" in next(line for line in reversed(last) if "torch threads" in line)
    assert torch.get_num_threads() == threads  # the caller's own count, as it was


def test_a_record_written_before_numerics_were_recorded_resumes(run_cli: Callable, cache_copy: Path,
                                                                demo_data: Path) -> None:
    run_record = json.loads((cache_copy / "run.json").read_text())
    del run_record["fingerprint"]["numerics"]
    (cache_copy / "run.json").write_text(json.dumps(run_record))
    assert run_cli(_encode_args(demo_data, cache_copy)).exit_code == 0


def test_skipped_inputs_are_named_as_they_happen_and_not_twice(run_cli: Callable, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=13, cameras=1, frames=5, height=32, width=32))
    for scene in range(1, 13):  # 12 broken videos, one good
        (data / f"scene_{scene:03d}" / "cam_0.mp4").write_bytes(b"\x00" * 500)
    out = tmp_path / "out"
    result = run_cli(["encode", data, "--out", out, "--vae", "builtin:tiny", "--num-frames", "5", "--size", "32x32",
                      "--workers", "0", "--no-progress"])
    assert result.exit_code == 3, result.output
    before_table = result.output.split("vaecache encode ->")[0]
    named = [line for line in before_table.splitlines() if line.startswith("skipped ")]
    assert len(named) == 10 and all("cam_0.mp4" in line for line in named)  # the first 10, as they happened
    assert f"more inputs skipped: vaecache inspect {out} --failures lists every one" in before_table
    after_table = result.output.split("vaecache encode ->")[1]
    assert not [line for line in after_table.splitlines() if line.startswith("skipped ")]  # nothing printed twice
    assert len(CacheReader(out).failure_records()) == 12


def test_under_torchrun_the_one_line_error_is_left_for_torchruns_failure_summary(run_cli: Callable,
                                                                                tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"  # torchrun sets TORCHELASTIC_ERROR_FILE for each worker
    result = run_cli(["encode", tmp_path / "missing", "--out", tmp_path / "out", *ENCODE_ARGS],
                     env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert result.exit_code == 2
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == f"vaecache exit 2: error: {tmp_path / 'missing'}: dataset path does not exist"
    assert int(message["extraInfo"]["timestamp"]) > 0  # torchrun orders failures by it
