"""Settings: flag parsing, validation with flag names in the message, TOML files, and the VAE's frame rule."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from vaecache.cli.encode import build_config
from vaecache.errors import FrameRuleError, UsageError, VaeSpecError
from vaecache.settings.buckets import parse_size
from vaecache.settings.clip import ClipSettings, SamplingConfig
from vaecache.settings.commands import EncodeConfig
from vaecache.settings.loader import PARTS, ROUTES, load_toml
from vaecache.settings.options import parse_bytes
from vaecache.vae import VaeRunner, load_vae


@pytest.fixture(scope="module")
def tiny() -> VaeRunner:
    return load_vae("builtin:tiny")


_CLIP_FIELDS = {f.name for f in fields(ClipSettings)}


def _config(**overrides: object) -> EncodeConfig:
    """An EncodeConfig from flat settings: ClipSettings fields go to its clip settings, the rest to the part the
    loader routes them to (settings.loader.ROUTES)."""
    base: dict = dict(out=Path("o"), vae="builtin:tiny", sampling=SamplingConfig(9), height=64, width=64)
    base.update(overrides)
    clip = ClipSettings(**{k: v for k, v in base.items() if k in _CLIP_FIELDS})
    parts: dict[str, dict] = {"source": {"location": Path("d")}}
    for setting, value in base.items():
        for part, name in ROUTES.get(setting, ()):
            parts.setdefault(part, {})[name] = value
    return EncodeConfig(clip=clip, **{part: PARTS[part](**given) for part, given in parts.items()})


# --------------------------------------------------------------------------- flag parsing


@pytest.mark.parametrize(("text", "expected"), [("64x96", (64, 96)), ("480X832", (480, 832)), (" 8 x 16 ", (8, 16))])
def test_parse_size(text: str, expected: tuple[int, int]) -> None:
    assert parse_size(text) == expected  # (height, width)


@pytest.mark.parametrize(("text", "match"), [
    ("64", "must look like HxW"), ("64x", "must look like HxW"), ("-8x8", "must look like HxW"),
    ("64*64", "must look like HxW"), ("0x64", "must be positive"),
])
def test_parse_size_rejects(text: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("5000", 5000), ("100B", 100), ("1kb", 1000), ("2KiB", 2048), ("256MiB", 256 * 2**20), ("1.5GB", 1_500_000_000),
    ("1 GiB", 2**30), ("3Mi", 3 * 2**20), (4096, 4096),
])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "lots", "5iB", "5i", "0", "0.1", "1 PB", -5])
def test_parse_bytes_rejects_with_a_usage_error(text: str | int) -> None:
    with pytest.raises(UsageError, match="--shard-size"):
        parse_bytes(text)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("overrides", "match"), [
    ({"vae": ""}, "--vae is required"),
    ({"height": 0}, "--size must be positive"),
    ({"dtype": "fp64"}, "--dtype must be one of fp32, bf16, fp16"),
    ({"store": "logvar"}, "--store must be one of mean-logvar, mean, sample"),
    ({"on_error": "ignore"}, "--on-error must be one of skip, fail"),
    ({"batch_size": 0}, "--batch-size must be an integer >= 1"),
    ({"workers": -1}, "--workers must be an integer >= 0"),
    ({"sp_size": 0}, "--sp-size must be an integer >= 1"),
    ({"decoder": "ffmpeg"}, "--decoder must be one of auto, pyav"),
    ({"sp_mode": "rows"}, "--sp-mode must be one of views, spatial"),
    ({"commit_every_s": -1.0}, "--commit-every must be seconds >= 0"),
    ({"liveness_timeout_s": -1.0}, "--liveness-timeout must be >= 0"),
    ({"probe_workers": 0}, "--probe-workers must be an integer >= 1"),
    ({"image_encoder": "diffusers:/m"}, "--image-encoder applies to --condition image-features"),
    ({"shard_size": 0}, "--shard-size must be >= 1 byte"),
    ({"timeout_s": 0}, "--timeout must be > 0"),
    ({"cameras": ("a", "b", "a")}, "lists a camera twice"),
])
def test_encode_config_names_the_bad_flag(overrides: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        _config(**overrides)


def test_latent_settings_hold_what_changes_the_bytes() -> None:
    settings = _config(sampling=SamplingConfig(5, frame_stride=2), dtype="bf16").clip.to_record()
    assert settings["num_frames"] == 5 and settings["frame_stride"] == 2
    assert settings["window_stride"] == 10  # default: no overlap
    assert settings["dtype"] == "bf16" and settings["seed"] is None  # the seed only matters for --store sample
    assert _config(store="sample", seed=7).clip.to_record()["seed"] == 7
    # Settings that do not change stored bytes are not part of it.
    assert _config(batch_size=4, workers=0).clip.to_record() == _config().clip.to_record()


@pytest.mark.parametrize("clip", [
    ClipSettings(SamplingConfig(9), 64, 64),
    ClipSettings(SamplingConfig(5, frame_stride=2, window_stride=3, max_clips_per_scene=2), 32, 48, dtype="bf16",
                 store="sample", seed=7, cameras=("b", "a"), tiling=True, views_per_forward=4),
    ClipSettings(SamplingConfig(5), 32, 32, store="mean", seed=7),  # the seed is not recorded: it changes nothing
])
def test_clip_settings_round_trip_through_their_recorded_form(clip: ClipSettings) -> None:
    import json

    record = json.loads(json.dumps(clip.to_record()))  # as a manifest stores it
    again = ClipSettings.from_record(record)
    assert again.to_record() == record
    if clip.store == "sample" or clip.seed == 0:
        assert again.to_record() == clip.to_record() and (again.height, again.cameras) == (clip.height, clip.cameras)


def test_clip_settings_from_a_record_without_tiling_fields_did_not_tile() -> None:
    record = ClipSettings(SamplingConfig(9), 64, 64).to_record()
    del record["tiling"], record["views_per_forward"]
    clip = ClipSettings.from_record(record)
    assert (clip.tiling, clip.views_per_forward) == (False, 1)
    del record["height"]
    with pytest.raises(UsageError, match="recorded settings lack 'height'"):
        ClipSettings.from_record(record)


# --------------------------------------------------------------------------- TOML and flags


def test_load_toml_accepts_dashes_and_an_encode_section(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[encode]\nnum-frames = 17\nsize = "64x96"\nbatch_size = 2\n')
    assert load_toml(path) == {"num_frames": 17, "size": "64x96", "batch_size": 2}


def test_load_toml_layers_the_top_level_then_encode_then_plan(tmp_path: Path) -> None:
    """One file serves both commands: shared keys at the top, [encode] over them, [plan] over both for plan."""
    path = tmp_path / "c.toml"
    path.write_text('vae = "builtin:tiny"\nnum-frames = 9\nbatch-size = 1\n'
                    '[encode]\nbatch-size = 2\nout = "cache"\n'
                    '[plan]\nworld-size = 8\nbatch-size = 4\n')
    assert load_toml(path) == {"vae": "builtin:tiny", "num_frames": 9, "batch_size": 2, "out": "cache"}
    assert load_toml(path, "plan") == {"vae": "builtin:tiny", "num_frames": 9, "batch_size": 4, "out": "cache",
                                       "world_size": 8}
    path.write_text('vae = "builtin:tiny"\n[plan]\nworld-size = 2\n')  # encode ignores [plan], knows the rest
    assert load_toml(path) == {"vae": "builtin:tiny"}
    path.write_text('[plan]\nworld-size = 2\nnmu-frames = 3\n')  # every table is checked, by both commands
    for command in ("encode", "plan"):
        with pytest.raises(UsageError, match=r"unknown setting\(s\) nmu-frames"):
            load_toml(path, command)
    path.write_text('encode = 3\n')
    with pytest.raises(UsageError, match=r"encode must be a table"):
        load_toml(path)


@pytest.mark.parametrize(("text", "match"), [
    ("nmu_frames = 3\n", r"unknown setting\(s\) nmu_frames"),
    ("num_frames = \n", "not valid TOML"),
])
def test_load_toml_rejects(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=match):
        load_toml(path)
    with pytest.raises(UsageError, match="config file not found"):
        load_toml(tmp_path / "missing.toml")


def test_load_toml_takes_the_cli_spelling_of_timeout(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("timeout = 60\n")
    assert load_toml(path) == {"timeout_s": 60}


@pytest.mark.parametrize(("text", "match"), [
    ('batch-size = "2"\n', r"batch_size = '2' must be int"),
    ("num-frames = 9.5\n", r"num_frames = 9.5 must be int"),
    ("workers = true\n", r"workers = True must be int"),
    ("overwrite = 1\n", r"overwrite = 1 must be bool"),
    ("size = [64, 64]\n", r"size = \[64, 64\] must be str"),
    ("height = 64\n", r"unknown setting\(s\) height"),  # comes from size
])
def test_load_toml_names_a_value_of_the_wrong_type(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=match):
        load_toml(path)


def _hostile_config(tmp_path: Path, kind: str) -> Path:
    import os

    path = tmp_path / "hostile.toml"
    if kind == "fifo":
        os.mkfifo(path)  # opening it would block until a writer comes
    elif kind == "device":
        return Path("/dev/zero")  # never ends
    elif kind == "folder":
        path.mkdir()
    elif kind == "latin-1":
        path.write_bytes('vae = "builtin:tiny"\n# caf\xe9\n'.encode("latin-1"))
    elif kind == "nested":
        path.write_text("num-frames = " + "[" * 5000 + "]" * 5000 + "\n")
    elif kind == "huge":
        path.write_text("# padding\n" * 200_000)
    elif kind == "twice":
        path.write_text("num-frames = 9\nnum_frames = 17\n")
    elif kind == "twice-in-encode":
        path.write_text("[encode]\ntimeout = 60\ntimeout_s = 90\n")
    return path


@pytest.mark.parametrize(("kind", "match"), [
    ("fifo", "--config is not a regular file"),
    ("device", "--config is not a regular file"),
    ("folder", "--config is not a regular file"),
    ("latin-1", r"not valid TOML: not UTF-8 text \(byte 26\)"),
    ("nested", "arrays or tables nested too deep"),
    ("huge", "--config is 2000000 bytes, more than 1048576"),
    ("twice", r"'num-frames' and 'num_frames' in the top level are one setting \(num_frames\) given twice"),
    ("twice-in-encode", r"'timeout' and 'timeout_s' in \[encode\] are one setting \(timeout_s\) given twice"),
])
def test_a_hostile_config_file_is_one_line_and_exit_2_before_anything_is_done(tmp_path: Path, demo_data: Path,
                                                                              run_cli, kind: str, match: str) -> None:
    import re

    path = _hostile_config(tmp_path, kind)
    with pytest.raises(UsageError, match=match):
        load_toml(path)
    out = tmp_path / "out"
    for command in (["encode", demo_data, "--out", out], ["plan", demo_data]):
        result = run_cli([*command, "--config", path, "--vae", "builtin:tiny", "--num-frames", "9", "--size",
                          "64x64"])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and re.search(match, lines[0]), lines
    assert not out.exists()


EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=[p.name for p in EXAMPLE_CONFIGS])
def test_example_configs_build(path: Path) -> None:
    cfg = build_config(Path("data"), {"out": Path("out")}, path)
    assert cfg.vae.spec and cfg.clip.sampling.num_frames >= 1 and cfg.clip.height >= 1


def test_flags_win_over_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('vae = "diffusers:/models/wan"\nnum_frames = 17\nsize = "64x64"\nbatch_size = 4\n'
                    'cameras = ["b", "a"]\nshard_size = "1MiB"\n')
    cfg = build_config(Path("d"), {"out": Path("o"), "vae": "builtin:tiny", "num_frames": 9, "batch_size": None}, path)
    assert cfg.vae.spec == "builtin:tiny"
    assert cfg.clip.sampling.num_frames == 9
    assert cfg.parallel.batch_size == 4  # unset flag: the file's value
    assert cfg.clip.cameras == ("b", "a") and cfg.out.shard_size == 2**20
    assert (cfg.clip.height, cfg.clip.width) == (64, 64)
    from_file = build_config(Path("d"), {"out": Path("o")}, path)
    assert from_file.vae.spec == "diffusers:/models/wan"


def test_config_file_can_name_the_output_folder(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('out = "cache"\nvae = "builtin:tiny"\nnum_frames = 9\nsize = "64x64"\n')
    assert build_config(Path("d"), {}, path).out.location == Path("cache")
    assert build_config(Path("d"), {"out": Path("flag")}, path).out.location == Path("flag")


@pytest.mark.parametrize(("out", "vae", "options", "match"), [
    (None, "builtin:tiny", {"num_frames": 9, "size": "64x64"}, "--out is required"),
    (Path("o"), None, {"num_frames": 9, "size": "64x64"}, "--vae is required"),
    (Path("o"), "builtin:tiny", {"size": "64x64"}, "--num-frames is required"),
    (Path("o"), "builtin:tiny", {"num_frames": 9}, "--size HxW is required"),
    (Path("o"), "builtin:tiny", {"num_frames": 9, "size": "64x64", "cameras": "a, b,a"}, "lists a camera twice"),
])
def test_required_flags(out: Path | None, vae: str | None, options: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        build_config(Path("d"), {"out": out, "vae": vae, **options}, None)


def test_camera_flag_is_a_comma_separated_order() -> None:
    options = {"num_frames": 9, "size": "64x64", "cameras": " c, a ,b "}
    cfg = build_config(Path("d"), {"out": Path("o"), "vae": "builtin:tiny", **options}, None)
    assert cfg.clip.cameras == ("c", "a", "b")


# --------------------------------------------------------------------------- the VAE's frame rule


def test_builtin_tiny_is_wan_style(tiny: VaeRunner) -> None:
    rule = tiny.model.rule
    assert (rule.temporal_factor, rule.spatial_factor, rule.causal) == (4, 8, True)
    assert [rule.latent_frames(n) for n in (1, 5, 9, 17)] == [1, 2, 3, 5]
    assert rule.latent_shape(16, 9, 64, 96) == (16, 3, 8, 12)
    for frames in (1, 5, 9, 13, 81):
        rule.check(frames, 64, 96)


@pytest.mark.parametrize(("frames", "size", "match"), [
    (10, (64, 64), r"--num-frames 10 .*1 \+ 4k frames.*nearest valid\D*9 and 13"),
    (8, (64, 64), r"--num-frames 8 .*nearest valid\D*5 and 9"),
    (2, (64, 64), r"--num-frames 2 .*nearest valid\D*1 and 5"),
    (9, (60, 64), r"--size 60x64: height 60 is not a multiple of 8 .*nearest valid height: 56 and 64"),
    (9, (64, 70), r"width 70 .*nearest valid width: 64 and 72"),
    (9, (4, 64), r"height 4 .*nearest valid height: 8"),
])
def test_frame_rule_names_the_nearest_valid_values(tiny: VaeRunner, frames: int, size: tuple[int, int],
                                                   match: str) -> None:
    with pytest.raises(FrameRuleError, match=match):
        tiny.model.rule.check(frames, *size)
    assert issubclass(FrameRuleError, UsageError)


@pytest.mark.parametrize(("spec", "match"), [
    ("", "--vae is required"),
    ("tiny", "unknown VAE spec 'tiny'"),
    ("builtin:huge", "the builtins are builtin:tiny, builtin:small"),
    ("diffusers:/nonexistent/vae", "diffusers VAE folder not found"),
    ("python:nomodule_xyz:make", "cannot import nomodule_xyz"),
    ("python:justone", "expected python:module.path:function"),
])
def test_bad_vae_specs(spec: str, match: str) -> None:
    with pytest.raises(VaeSpecError, match=match):
        load_vae(spec)


# --------------------------------------------------------------------------- one option table for encode and plan

def _every_encode_key(tmp_path: Path) -> Path:
    """A TOML file giving every setting encode takes (valid values), as one shared by encode and plan would."""
    values = {"out": str(tmp_path / "out"), "vae": "builtin:tiny", "model": "wan", "num_frames": 9, "size": "64x64",
              "frame_stride": 1,
              "frames_policy": "longest", "fit": "cover", "decoder": "pyav", "window_stride": 9,
              "max_clips_per_scene": 4, "max_frame_pixels": 1 << 20, "cameras": ["cam_0", "cam_1"], "dtype": "fp32",
              "device": "cpu", "store": "mean-logvar", "seed": 3, "tiling": False, "compile": False,
              "channels_last": False, "encoder_impl": "fast", "views_per_forward": 1, "batch_size": 1, "workers": 0,
              "probe_workers": 2,
              "sp_size": 1, "sp_mode": "views", "shard_size": "1MiB", "on_error": "skip", "overwrite": False,
              "hash_sources": False, "allow_other_numerics": False, "allow_pickle_weights": False, "timeout": 600,
              "liveness-timeout": 30, "progress": False, "sync": "timestamps", "sync_reference": "cam_0",
              "sync_tolerance": 0.05, "fps": 10.0, "nuscenes_version": "v1.0-mini",
              "column": ["path=video_path", "ranges=timestamp"], "lerobot_state": False, "commit_every": 120.0,
              "storage_option": ["anon=false"], "text_encoder": "diffusers:./wan21",
              "condition": "first-frame,image-features", "image_encoder": "diffusers:./wan21",
              "image_convention": "wan-musubi", "audio_vae": "diffusers:./ltx2#audio_vae", "audio_camera": "cam_1",
              "audio_missing": "silence"}
    from vaecache.settings.options import ENCODE, options_of

    # every one but --vae-config, which goes with a single-file --vae (tests/vae/test_single_file.py), no other
    assert {key.replace("-", "_") for key in values} == {o.name for o in options_of(ENCODE)} - {"vae_config"}
    path = tmp_path / "shared.toml"
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    return path


def test_plan_reads_a_config_with_every_key_encode_accepts(demo_data: Path, tmp_path: Path, run_cli) -> None:
    """`liveness-timeout = 30` in a shared file once ended plan in `unexpected TypeError`."""
    config = _every_encode_key(tmp_path)
    result = run_cli(["plan", demo_data, "--config", config, "--no-measure"])
    assert result.exit_code == 0, result.output
    assert "unexpected" not in result.output
    cfg = build_config(demo_data, {}, config)
    assert (cfg.parallel.liveness_timeout_s, cfg.parallel.timeout_s, cfg.out.shard_size,
            cfg.source.probe_workers) == (30.0, 600, 2**20, 2)


def test_every_flag_of_encode_and_plan_comes_from_the_option_table() -> None:
    """The flags each command declares are exactly the option table's for it (both forms of a boolean), plus
    the few the CLI adds itself."""
    import typer

    from vaecache.cli.app import app
    from vaecache.settings.options import OPTIONS

    commands = typer.main.get_command(app).commands
    own = {"encode": {"--config", "--json", "-o"}, "plan": {"--config", "--json"}}
    for command in ("encode", "plan"):
        declared = {flag for param in commands[command].params for flag in (*param.opts, *param.secondary_opts)
                    if flag.startswith("-")}
        from_table = {flag for option in OPTIONS if command in option.commands for flag in option.flag.split("/")}
        assert declared - own[command] == from_table, command


def test_an_unknown_key_is_named_with_the_nearest_known_one(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("batchsize = 2\nliveness_timout = 3\n")
    with pytest.raises(UsageError, match=r"unknown setting\(s\) batchsize, liveness_timout \(did you mean batch_size "
                                         r"or liveness_timeout\?\)"):
        load_toml(path)


def test_torch_dtype_names_and_a_size_with_a_comma(tmp_path: Path) -> None:
    from vaecache.settings.loader import load_settings

    flags = {"vae": "builtin:tiny", "num_frames": 9, "size": "64x64", "out": tmp_path / "o", "dtype": "bfloat16"}
    assert load_settings("encode", tmp_path, flags).clip.dtype == "bf16"
    with pytest.raises(UsageError, match=r"--size takes HxW \(e.g. 128x128\), got '128,128'"):
        load_settings("encode", tmp_path, {**flags, "size": "128,128"})
