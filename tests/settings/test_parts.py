"""The parts encode's and plan's settings are built from: every setting lands in exactly one place, each part
validates what it owns, and each writes its own record (what the run fingerprint and the manifest hold)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vaecache.errors import UsageError
from vaecache.settings.clip import ClipSettings, SamplingConfig
from vaecache.settings.commands import EncodeConfig, PlanConfig
from vaecache.settings.loader import CLIP_FIELDS, COMMANDS, PARTS, ROUTES, SAMPLING_FIELDS, load_settings
from vaecache.settings.options import OPTIONS
from vaecache.settings.parts import OutConfig, ParallelConfig, SourceConfig, VaeConfig

CLIP_BY_NAME = {"num_frames", "size", "cameras", "sync", "sync_reference", "sync_tolerance"}
"""The clip settings the loader builds ClipSettings and SamplingConfig from by hand (parsed, or in SyncConfig)."""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_setting_of_a_command_lands_in_one_field_that_exists(command: str) -> None:
    config = COMMANDS[command]
    parts = {f.name for f in dataclasses.fields(config)} & (set(PARTS) | {"clip"})
    own = {f.name for f in dataclasses.fields(config)} - parts
    for option in (o for o in OPTIONS if command in o.commands):
        setting = option.setting
        places = [f"{part}.{name}" for part, name in ROUTES.get(setting, ())]
        places += ["clip"] if setting in CLIP_FIELDS | SAMPLING_FIELDS | CLIP_BY_NAME else []
        places += [setting] if setting in own else []
        assert places, f"{command}: --{option.name} goes nowhere"
        assert len(places) == 1 or setting == "storage_options", f"{command}: --{option.name} goes to {places}"
        for part, name in ROUTES.get(setting, ()):
            if part in parts:
                assert name in {f.name for f in dataclasses.fields(PARTS[part])}, f"{part} has no field {name}"


def test_a_shared_storage_option_reaches_data_and_out_alike(tmp_path: Path) -> None:
    flags = {"out": "s3://b/out", "vae": "builtin:tiny", "num_frames": 9, "size": "64x64",
             "storage_option": ["endpoint_url=http://x:9000,anon=true"]}
    cfg = load_settings("encode", tmp_path, flags)
    assert isinstance(cfg, EncodeConfig)
    assert cfg.source.storage_options == cfg.out.storage_options
    assert dict(cfg.source.storage_options)["endpoint_url"] == "http://x:9000"


def test_plan_is_built_from_the_parts_encode_starts_from(tmp_path: Path) -> None:
    flags = {"vae": "builtin:tiny", "num_frames": 9, "size": "64x64", "sp_size": 2, "world_size": 4,
             "workers": 3, "decoder": "pyav", "nuscenes_version": "v1.0-mini"}
    plan = load_settings("plan", tmp_path, flags)
    assert isinstance(plan, PlanConfig)
    assert (plan.parallel.sp_size, plan.world_size, plan.decode.workers, plan.decode.decoder) == (2, 4, 3, "pyav")
    assert plan.source.nuscenes_version == "v1.0-mini" and plan.vae.spec == "builtin:tiny"
    with pytest.raises(UsageError, match="--sp-size 2 must divide the world size 3"):
        dataclasses.replace(plan, world_size=3)


def test_the_source_records_how_data_is_read_only_where_given() -> None:
    assert SourceConfig(Path("/d")).to_record() == {"data": "/d"}
    given = SourceConfig(Path("/d"), nuscenes_version="v1.0-mini", columns=(("path", "video"),), lerobot_state=True,
                         storage_options=(("anon", True),), probe_workers=3)
    assert given.to_record() == {"data": "/d", "reading": {"nuscenes_version": "v1.0-mini",
                                                           "columns": [["path", "video"]], "lerobot_state": True}}


def test_the_vae_and_the_parallel_layout_record_what_they_own() -> None:
    assert VaeConfig("builtin:tiny").to_record() == {"vae_spec": "builtin:tiny"}
    assert VaeConfig("/m/wan.safetensors", "/m/config.json").to_record() == {
        "vae_spec": "/m/wan.safetensors", "vae_config": "/m/config.json"}
    assert ParallelConfig(batch_size=2, sp_size=4).to_record() == {"batch_size": 2, "sp_size": 4, "sp_mode": "views"}
    assert ParallelConfig(sp_size=4).fingerprint_record() is None  # views mode: latents never depend on the group
    assert ParallelConfig(sp_size=4, sp_mode="spatial").fingerprint_record() == {"mode": "spatial", "sp_size": 4}


def test_the_run_records_keep_the_manifest_settings_in_their_recorded_order(tmp_path: Path) -> None:
    """A manifest's bytes do not change with the code's layout: its settings keep the order caches always had,
    the reading keys between the VAE's spec and its config."""
    from types import SimpleNamespace

    from vaecache.encode.fingerprint import run_records
    from vaecache.vae import load_vae
    from vaecache.video.backends import PYAV

    clip = ClipSettings(SamplingConfig(9), 64, 64)
    cfg = EncodeConfig(SourceConfig(tmp_path, columns=(("path", "video"),)),
                       VaeConfig("builtin:tiny", "/m/config.json"), clip, OutConfig(tmp_path / "o", shard_size=7))
    start = SimpleNamespace(clip=clip, backend=PYAV, vae=load_vae("builtin:tiny"), numerics={"torch": "x"},
                            images=False)
    records = run_records(cfg, start, world_size=2)  # type: ignore[arg-type]
    assert list(records.settings)[len(clip.to_record()):] == [
        "decoder", "data", "batch_size", "sp_size", "sp_mode", "world_size", "shard_size", "max_frame_pixels",
        "vae_spec", "columns", "vae_config"]
    assert records.fingerprint["reading"] == {"columns": [["path", "video"]]} and "parallel" not in records.fingerprint
    assert records.fingerprint["latents"] == clip.to_record() and records.fingerprint["data"] == str(tmp_path)

