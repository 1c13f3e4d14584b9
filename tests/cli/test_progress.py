"""A first run is never silent: encode says what start-up is doing from its first line (before torch is imported),
and the demo shows the encode's progress."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable


def test_encode_says_each_start_up_step_as_it_begins(run_cli: Callable, demo_data: Path, tmp_path: Path) -> None:
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x64", "--workers", "0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    steps = [re.sub(r"^ *[0-9.]+ s  ", "", line) for line in lines if re.match(r"^ *[0-9.]+ s  .* \.\.\.$", line)]
    assert steps[0] == "importing torch and diffusers ..." and lines[0].endswith(steps[0])
    assert steps[1:] == [f"listing the dataset {demo_data} ...",
                         "loading the VAE builtin:tiny and hashing its weights ..."]
    assert any(line.startswith("encode: 3/3 clips (100%)") for line in lines)


def test_no_progress_says_nothing_of_start_up(run_cli: Callable, demo_data: Path, tmp_path: Path) -> None:
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames", "9",
                      "--size", "64x64", "--workers", "0", "--no-progress"])
    assert result.exit_code == 0 and "importing torch" not in result.output and "encode: " not in result.output
