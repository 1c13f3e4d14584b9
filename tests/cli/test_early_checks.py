"""What the arguments, OUT's own records and a known family's frame and size rules already say is answered before
torch is imported or DATA probed (vaecache.cli.early_checks): the real console-script entry point runs in a fresh
interpreter, which reports its exit code and whether torch was loaded at the error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vaecache.cli.early_checks import known_frame_rule

_PROBE = """
import json, sys
from vaecache.cli.app import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "diffusers": "diffusers" in sys.modules}),
      file=sys.stderr)
"""


def run_fresh(*args: object) -> tuple[int, bool, str]:
    """(exit code, whether torch or diffusers was imported, the error output) of `vaecache ARGS`."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "VAECACHE_DEBUG")}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=environ)
    *said, last = proc.stderr.strip().splitlines()
    report = json.loads(last)
    return report["code"], report["torch"] or report["diffusers"], "\n".join(said)


STANDARD = ("--vae", "builtin:small", "--num-frames", "9", "--size", "64x64")


@pytest.mark.parametrize("command", ["encode", "plan"])
def test_a_frame_count_the_vae_cannot_take_is_refused_before_torch(demo_data: Path, tmp_path: Path,
                                                                   command: str) -> None:
    out = ("--out", tmp_path / "out") if command == "encode" else ()
    code, heavy, said = run_fresh(command, demo_data, *out, "--vae", "builtin:small", "--num-frames", "8",
                                  "--size", "64x64")
    assert code == 2 and not heavy, said
    assert "--num-frames 8 is not valid for AutoencoderKLWan" in said and "nearest valid: 5 and 9" in said
    assert not (tmp_path / "out").exists()


def test_a_size_the_vae_cannot_take_is_refused_before_torch(demo_data: Path, tmp_path: Path) -> None:
    code, heavy, said = run_fresh("encode", demo_data, "--out", tmp_path / "out", "--vae", "builtin:small",
                                  "--num-frames", "9", "--size", "60x64")
    assert code == 2 and not heavy and "height 60 is not a multiple of 8" in said


def test_a_hub_id_as_vae_is_answered_before_torch_with_hf_download(demo_data: Path, tmp_path: Path) -> None:
    code, heavy, said = run_fresh("encode", demo_data, "--out", tmp_path / "out", "--vae",
                                  "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--num-frames", "9", "--size", "64x64")
    assert code == 2 and not heavy
    assert "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --include 'vae/*'" in said and "huggingface-cli" not in said


def test_a_non_empty_out_that_is_no_cache_is_refused_before_torch(demo_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"not a cache")
    code, heavy, said = run_fresh("encode", demo_data, "--out", out, *STANDARD)
    assert code == 2 and not heavy and f"{out}: not empty and not a vaecache output (holds holiday.jpg)" in said
    assert sorted(path.name for path in out.iterdir()) == ["holiday.jpg"]


def test_an_out_made_with_other_settings_is_refused_before_torch(demo_data: Path, good_cache: Path) -> None:
    code, heavy, said = run_fresh("encode", demo_data, "--out", good_cache, "--vae", "builtin:tiny",
                                  "--num-frames", "13", "--size", "64x64")
    assert code == 2 and not heavy
    assert f"{good_cache} was made with other settings (latents.num_frames: 9 -> 13" in said


def test_an_out_of_the_same_settings_passes_the_early_checks(demo_data: Path, good_cache: Path) -> None:
    from vaecache.cli.early_checks import check_out
    from vaecache.cli.encode import build_config

    flags = {"out": str(good_cache), "vae": "builtin:tiny", "num_frames": "9", "size": "64x64"}
    check_out(build_config(demo_data, flags, None))  # resuming (or confirming) is start-up's to judge


def test_the_rule_of_a_diffusers_folder_is_read_from_its_config(tmp_path: Path) -> None:
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLCogVideoX",
                                                    "temporal_compression_ratio": 4,
                                                    "down_block_types": ["a", "b", "c", "d"]}))
    rule = known_frame_rule(f"diffusers:{folder}", None)
    assert rule is not None and rule.frames_ok(9) and not rule.frames_ok(13)
    assert known_frame_rule("builtin:tiny", None) is None  # its config is known only once vae/load.py is imported
    assert known_frame_rule(f"python:{__name__}:make", None) is None


def test_every_missing_required_option_is_named_in_one_message(demo_data: Path) -> None:
    code, heavy, said = run_fresh("encode", demo_data)
    assert code == 2 and not heavy
    assert said.count("error:") == 1 and "--out, --vae, --num-frames and --size are required" in said
    code, _, said = run_fresh("export")
    assert code == 2 and "Missing 'OUT', '--format' and '--out'." in said


def test_inspect_imports_no_torch(good_cache: Path) -> None:
    code, heavy, said = run_fresh("inspect", good_cache, "--json", "-")
    assert code == 0 and not heavy, said
