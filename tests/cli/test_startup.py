"""The CLI answers at once: no heavy import for --help or a usage error, one line on Ctrl-C, rank 0 speaks."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import typer

from vaecache import stop
from vaecache.cli.common import interrupted_message, launcher_rank_world, report_errors
from vaecache.meter import MeterLines

HEAVY = ("torch", "diffusers", "decord", "av")
DEFERRED = ("numpy", "pyarrow", "safetensors", "fsspec", "PIL", "tomllib", "vaecache.cache", "vaecache.export",
            "vaecache.encode", "vaecache.sources", "vaecache.decode.preview", "vaecache.training", "vaecache.meter",
            "vaecache.settings.commands", "vaecache.settings.loader", "vaecache.settings.clip",
            "vaecache.settings.buckets", "vaecache.settings.vae_specs", "vaecache.distributed.mesh", "vaecache.report",
            "matplotlib", "jinja2")
"""Light, but only a command that runs needs them: building the app and rendering --help load none."""

# Runs the real console-script entry point in a fresh interpreter and reports which heavy modules it loaded.
_PROBE = """
import sys
from vaecache.cli.app import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in HEAVY if m in sys.modules)}), file=sys.stderr)
"""


def _probe(args: list[str], watch: tuple[str, ...] = HEAVY, **env: str) -> tuple[int, list[str], str]:
    """(exit code, modules of `watch` loaded, stderr without the probe's own line) of `vaecache ARGS`."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "VAECACHE_DEBUG")}
    code = f"import json\nHEAVY = {watch!r}\n{_PROBE}"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})
    *rest, last = proc.stderr.strip().splitlines() or [""]
    report = json.loads(last)
    return report["code"], report["heavy"], "\n".join(rest)


STANDARD = ["--out", "OUT", "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64"]


@pytest.mark.parametrize("args", [["--help"], ["encode", "--help"], ["plan", "--help"], ["verify", "--help"],
                                  ["demo-data", "--help"], ["index", "--help"], ["inspect", "--help"],
                                  ["export", "--help"], ["decode", "--help"], ["report", "--help"],
                                  ["embed", "--help"]], ids=" ".join)
def test_help_loads_no_heavy_module(args: list[str]) -> None:
    code, loaded, _ = _probe(args, HEAVY + DEFERRED)
    assert code in (0, None)
    assert loaded == []


def test_building_the_app_loads_only_what_parsing_needs() -> None:
    # A module check, not a timing: each of these was once imported at start-up by a command module.
    watch = HEAVY + DEFERRED + ("rich.table", "typer.rich_utils")  # both load only to render --help or an error
    code = ("import sys, typer\nfrom vaecache.cli.app import app\ntyper.main.get_command(app)\n"
            f"print(sorted(m for m in {watch!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(("case", "pattern"), [
    ("missing DATA", "dataset path does not exist"),
    ("bad --size", "--size must look like HxW"),
    ("missing --vae", "--vae is required"),
    ("unknown option", "No such option"),
    ("--sp-size 2 alone", "--sp-size 2 needs 2 ranks"),
    ("plan missing DATA", "dataset path does not exist"),
    ("verify missing OUT", "no such folder"),
    ("index missing DATA", "dataset path does not exist"),
    ("index -o not .jsonl", "the index must be a .jsonl file"),
    ("decode missing OUT", "no such folder"),
    ("decode -o not .mp4", "the preview is an mp4"),
], ids=str)
def test_usage_error_exits_2_before_any_heavy_import(case: str, pattern: str, demo_data: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    standard = [out if a == "OUT" else a for a in STANDARD]
    args = {
        "missing DATA": ["encode", str(tmp_path / "nope"), *standard],
        "bad --size": ["encode", str(demo_data), *standard[:-1], "64"],
        "missing --vae": ["encode", str(demo_data), "--out", out, "--num-frames", "9", "--size", "64x64"],
        "unknown option": ["encode", str(demo_data), *standard, "--frobnicate"],
        "--sp-size 2 alone": ["encode", str(demo_data), *standard, "--sp-size", "2"],
        "plan missing DATA": ["plan", str(tmp_path / "nope"), *standard[2:]],
        "verify missing OUT": ["verify", str(tmp_path / "nope")],
        "index missing DATA": ["index", str(tmp_path / "nope"), "-o", str(tmp_path / "index.jsonl")],
        "index -o not .jsonl": ["index", str(demo_data), "-o", out],
        "decode missing OUT": ["decode", str(tmp_path / "nope"), "--clip", "a/000000-000008", "-o", out + ".mp4"],
        "decode -o not .mp4": ["decode", str(demo_data), "--clip", "a/000000-000008", "-o", out],
    }[case]
    code, heavy, stderr = _probe(args)
    assert code == 2, stderr
    assert heavy == [], stderr
    assert pattern in stderr
    assert not Path(out).exists()


def test_sp_size_without_a_launcher_says_how_to_launch(demo_data: Path, tmp_path: Path) -> None:
    standard = [str(tmp_path / "out") if a == "OUT" else a for a in STANDARD]
    code, _, stderr = _probe(["encode", str(demo_data), *standard, "--sp-size", "4"])
    assert code == 2
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "error: --sp-size 4 needs 4 ranks (or a multiple): torchrun --nproc-per-node 4 -m vaecache encode ... "
        "(or srun --ntasks 4 vaecache encode ...)"]


@pytest.mark.parametrize("kind", ["vaecache usage error", "typer usage error"])
def test_a_usage_error_is_printed_by_rank_0_only(kind: str, tmp_path: Path) -> None:
    args = {"vaecache usage error": ["encode", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                                     "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64"],
            "typer usage error": ["encode", str(tmp_path), "--frobnicate"]}[kind]
    rank0 = _probe(args, RANK="0", WORLD_SIZE="2")
    rank1 = _probe(args, RANK="1", WORLD_SIZE="2")
    assert rank0[0] == rank1[0] == 2
    assert rank0[2].strip()
    assert rank1[2].strip() == ""


@pytest.mark.parametrize(("env", "expected"), [
    ({}, (0, 1)),
    ({"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, (2, 4)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, (0, 1)),  # the sbatch batch shell is not a step
    ({"RANK": "x", "WORLD_SIZE": "2"}, (0, 2)),  # unparsable: dist reports it later
])
def test_launcher_rank_world_reads_torchrun_then_slurm(env: dict[str, str], expected: tuple[int, int]) -> None:
    assert launcher_rank_world(env) == expected


def _wait_for_reader(fifo: Path, proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """Open `fifo` for writing as soon as `proc` has it open for reading; the child then blocks in read()."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            time.sleep(0.05)
    raise AssertionError(f"the CLI never opened {fifo} (exit {proc.poll()}): "
                         f"{proc.stderr.read() if proc.stderr else ''}")


def test_ctrl_c_during_start_up_is_one_line(demo_data: Path, tmp_path: Path) -> None:
    # A --vae python: factory that reads a FIFO holds the CLI in start-up (loading the VAE, before the encode loop
    # takes over the signals) for exactly as long as the test wants (a --config FIFO is refused at once).
    fifo = tmp_path / "hold"
    os.mkfifo(fifo)
    (tmp_path / "held_vae.py").write_text(f"def make():\n    open({str(fifo)!r}).read()\n    raise SystemExit(3)\n")
    out = tmp_path / "out"
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "VAECACHE_DEBUG")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), environ.get("PYTHONPATH")]))
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, and Python keeps
    # an ignored SIGINT ignored: give the CLI the default disposition a user's terminal gives it.
    proc = subprocess.Popen([sys.executable, "-m", "vaecache", "encode", str(demo_data), "--out", str(out),
                             "--vae", "python:held_vae:make", "--num-frames", "9", "--size", "64x64", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environ, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    writer = _wait_for_reader(fifo, proc)
    try:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        os.close(writer)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["interrupted during start-up; nothing was written"]
    assert not out.exists()


def test_ctrl_c_after_the_encode_loop_took_over_says_the_batch_is_abandoned(capsys: pytest.CaptureFixture) -> None:
    @report_errors
    def encode() -> None:
        with stop.StopRequest():
            os.kill(os.getpid(), signal.SIGINT)  # first: a polite stop request
            os.kill(os.getpid(), signal.SIGINT)  # second: abandon the batch now

    with pytest.raises(typer.Exit) as exit_info:
        encode()
    assert exit_info.value.exit_code == 130
    err = capsys.readouterr().err
    assert "abandoned the batch in flight" in err and "Traceback" not in err
    assert interrupted_message("encode") == interrupted_message("verify")  # stop handling began: same answer


def test_second_ctrl_c_logs_plainly_that_it_abandons_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    with stop.StopRequest() as request:
        os.kill(os.getpid(), signal.SIGINT)
        assert request.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert "a second Ctrl-C abandons it" in caplog.text
    assert "second Ctrl-C: abandoning the batch in flight" in caplog.text


def test_interrupt_messages_before_the_encode_loop() -> None:
    stop.begin_command()
    assert interrupted_message("encode") == "interrupted during start-up; nothing was written"
    assert interrupted_message("verify") == "interrupted; nothing was written"
    assert interrupted_message("demo_data") == "interrupted"


def test_encode_help_lists_the_required_options_first_and_no_bool_types(run_cli: Callable) -> None:
    result = run_cli(["encode", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    for flag in ("--out", "--vae", "--num-frames", "--size"):
        line = next(line for line in lines if f" {flag} " in line)
        assert "[required, or in --config]" in line, line
    flags = [found[0] for line in lines if (found := re.findall(r"│ (--[a-z-]+)", line))]
    assert flags[:4] == ["--out", "--vae", "--num-frames", "--size"], flags  # before every optional one
    assert "╭─ Input " in result.output and "Usage: vaecache encode [OPTIONS] {DATA}" in result.output
    tiling = next(line for line in lines if " --tiling " in line)
    assert "<bool>" not in tiling


# --------------------------------------------------------------------------- --json FILE|-


def test_verify_json_dash_is_stdout(run_cli: Callable, good_cache: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_cli(["verify", good_cache, "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"] is True
    assert not (tmp_path / "-").exists()


def test_encode_json_writes_the_summary(run_cli: Callable, demo_data: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
            "--size", "64x64", "--workers", "0", "--no-progress"]
    result = run_cli([*args, "--json", "-"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["clips"], summary["planned_clips"], summary["scenes"], summary["exit_code"]) == (3, 3, 3, 0)
    assert summary["out"] == str(tmp_path / "out")
    assert not (tmp_path / "-").exists()
    rerun = run_cli([*args, "--json", tmp_path / "summary.json"])
    assert rerun.exit_code == 0, rerun.output
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_clips"] == 3


def test_json_into_a_missing_folder_is_refused_before_work(run_cli: Callable, demo_data: Path, tmp_path: Path) -> None:
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x64", "--json", tmp_path / "nope" / "s.json"])
    assert result.exit_code == 2
    assert "--json folder" in result.output
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- progress in logs


def test_progress_lines_are_periodic_plain_lines() -> None:
    now = [0.0]
    written: list[str] = []
    lines = MeterLines("encode", "clips", written.append, interval_s=30, clock=lambda: now[0])
    for t in (1, 10, 31, 50, 60):
        now[0] = float(t)
        lines.advance(1, 5)
    lines.close()
    assert len(written) == 3  # the first step, the first after 30 s, the last
    assert written[0].startswith("encode: 1/5 clips (20%), ")
    assert written[1].startswith("encode: 3/5 clips (60%), ") and "ETA" in written[1]
    assert written[2].startswith("encode: 5/5 clips (100%), ")
    assert not any("\r" in line or "\n" in line for line in written)
    assert ", 0.08 clips/s," in written[2]  # 5 in 60 s: still clips per second, never "12.00s/ clips"


def test_close_prints_the_final_count_once() -> None:
    now = [0.0]
    written: list[str] = []
    lines = MeterLines("verify", "shards", written.append, interval_s=30, clock=lambda: now[0])
    lines.advance(1, 4)
    now[0] = 5.0
    lines.advance(1, 4)
    lines.close()
    lines.close()
    assert [line.split(",")[0] for line in written] == ["verify: 1/4 shards (25%)", "verify: 2/4 shards (50%)"]


def test_encode_progress_in_a_log_is_lines_not_a_redrawn_bar(run_cli: Callable, demo_data: Path,
                                                              tmp_path: Path) -> None:
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x64", "--workers", "0"], env={"VAECACHE_PROGRESS_INTERVAL": "0"})
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith("encode: ")]
    assert [line.split(",")[0] for line in progress] == [f"encode: {n}/3 clips ({p}%)"
                                                         for n, p in ((1, 33), (2, 67), (3, 100))]
    probing = [line.split(",")[0] for line in result.stderr.splitlines() if line.startswith("probe: ")]
    assert probing == [f"probe: {n}/3 scenes ({p}%)" for n, p in ((1, 33), (2, 67), (3, 100))]
    assert "\r" not in result.stderr


def test_verify_hashing_progress_in_a_log_is_lines(run_cli: Callable, sharded_cache: Path) -> None:
    shards = len(json.loads((sharded_cache / "manifest.json").read_text())["shards"])
    assert shards > 1
    result = run_cli(["verify", sharded_cache, "--threads", "1"], env={"VAECACHE_PROGRESS_INTERVAL": "0"})
    assert result.exit_code == 0, result.output
    progress = [line.split(",")[0] for line in result.stderr.splitlines() if line.startswith("verify: ")]
    assert progress == [f"verify: {n}/{shards} shards ({round(100 * n / shards)}%)" for n in range(1, shards + 1)]
    assert "\r" not in result.stderr


@pytest.mark.slow
def test_a_usage_error_under_torchrun_is_printed_once(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "VAECACHE_DEBUG")}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "vaecache", "encode", str(tmp_path / "nope"), "--out", str(tmp_path / "out"),
                             "--vae", "builtin:tiny", "--num-frames", "9", "--size", "64x64"],
                            capture_output=True, text=True, timeout=300, env=environ)
    assert result.returncode != 0
    printed = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(printed) == 1 and printed[0].endswith("dataset path does not exist"), result.stderr  # rank 0 alone
    # ... and torchrun's failure summary, the last thing it prints, ends with the same line and vaecache's exit code
    last = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("traceback :")][-1]
    assert last == f"traceback : vaecache exit 2: {printed[0]}", result.stderr


def test_tables_fit_80_columns_without_cutting_names(run_cli: Callable, good_cache: Path, demo_data: Path) -> None:
    env = {"COLUMNS": "80"}
    verify = run_cli(["verify", good_cache], env=env)
    assert verify.exit_code == 0, verify.output
    assert any("values finite and match stats" in line for line in verify.output.splitlines())  # not wrapped
    plan = run_cli(["plan", demo_data, "--vae", "builtin:tiny", "--num-frames", "9,17", "--size",
                    "64x64,48x80,80x48", "--no-measure"], env=env)
    assert plan.exit_code == 0, plan.output
    table = plan.output[plan.output.index("buckets (--fit cover)"):]
    for name, latent in (("64x64x17", "(16,5,8,8)"), ("48x80x9", "(16,3,6,10)"), ("80x48x17", "(16,5,10,6)")):
        assert any(line.startswith(f"{name} ") and latent in line for line in table.splitlines()), table
    assert all(len(line) <= 80 for line in plan.output.splitlines() + verify.output.splitlines()
               if "│" in line or "┃" in line)
