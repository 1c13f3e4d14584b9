"""VAEs as one checkpoint file in their original key layout: the family told from the keys, converted by diffusers'
single-file loading, latents equal to those of the same weights as a diffusers folder; Hub ids and typos answered in
one line before any probing; specs recorded as absolute paths."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import assert_same_tensors, invoke, load_tensors, read_manifest
from tests.vae.original_layouts import (
    ldm_vae_original,
    ltx090_original,
    ltx2_original,
    ltx_original,
    wan21_original,
    wan22_original,
)
from vaecache.errors import VaeSpecError
from vaecache.vae.single_file import CONFIGS, detect_family, safetensors_header, shipped_config, shipped_config_name

ARGS = ("--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress")


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory):
    """A tiny Wan 2.1-layout VAE (4 levels, 2 residual blocks per level, as the converter expects) three ways: a
    diffusers folder, the original layout as safetensors, and as a pickled .pth."""
    from diffusers import AutoencoderKLWan

    root = tmp_path_factory.mktemp("single-file")
    torch.manual_seed(3)
    module = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                              temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                              latents_std=[1.5, 2.0, 0.5, 1.0])
    module.save_pretrained(root / "folder")
    original = {key: value.contiguous() for key, value in wan21_original(module.state_dict()).items()}
    save_file(original, root / "Wan2.1_VAE.safetensors")
    torch.save(original, root / "Wan2.1_VAE.pth")
    return root


def test_a_wan_checkpoint_gives_the_latents_of_its_diffusers_folder(wan_files, demo_data, tmp_path):
    config = wan_files / "folder" / "config.json"
    for spec, out, extra in ((f"diffusers:{wan_files / 'folder'}", "folder", ()),
                             (str(wan_files / "Wan2.1_VAE.safetensors"), "file", ("--vae-config", str(config))),
                             (f"diffusers:{wan_files / 'Wan2.1_VAE.pth'}", "pickle",
                              ("--vae-config", str(wan_files / "folder"), "--allow-pickle-weights"))):
        result = invoke(["encode", demo_data, "--out", tmp_path / out, "--vae", spec, *ARGS, *extra])
        assert result.exit_code == 0, result.output
    folder = load_tensors(tmp_path / "folder")
    assert_same_tensors(folder, load_tensors(tmp_path / "file"))
    assert_same_tensors(folder, load_tensors(tmp_path / "pickle"))
    manifest = read_manifest(tmp_path / "file")
    assert manifest["settings"]["vae_config"] == str(config)
    assert len(manifest["vae"]["config"]["single_file_sha256"]) == 64
    checked = invoke(["verify", tmp_path / "file", "--reencode", "1"])  # the recorded spec and --vae-config
    assert checked.exit_code == 0, checked.output


def test_what_a_checkpoint_is_decides_the_answer(wan_files, demo_data, tmp_path):
    def refused(spec, *extra):
        result = invoke(["encode", demo_data, "--out", tmp_path / "o", "--vae", spec, *ARGS, *extra])
        assert result.exit_code == 2 and not (tmp_path / "o").exists(), result.output
        return result.output

    assert "the configs shipped are Wan 2.1's (z_dim 16, base_dim 96) and Wan 2.2 TI2V-5B's" in refused(
        str(wan_files / "Wan2.1_VAE.safetensors"))
    assert "--allow-pickle-weights" in refused(str(wan_files / "Wan2.1_VAE.pth"), "--vae-config",
                                               str(wan_files / "folder"))
    hub = refused("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --include 'vae/*'" in hub
    assert "diffusers:./Wan2.1-T2V-1.3B-Diffusers#vae" in hub
    assert "did you mean builtin:tiny" in refused("tiny")
    assert "--vae-config goes with a single checkpoint file" in refused("builtin:tiny", "--vae-config",
                                                                        str(wan_files / "folder"))
    other = wan_files / "other.json"
    other.write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    assert "--vae-config is for 'AutoencoderKL'" in refused(str(wan_files / "Wan2.1_VAE.safetensors"),
                                                            "--vae-config", str(other))


def test_a_typo_is_answered_before_any_video_is_probed(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "broken.mp4").write_bytes(b"\0" * 100)  # probing it would record a failure, not end the run
    result = invoke(["encode", data, "--out", tmp_path / "o", "--vae", "diffusers:/no/such/vae", *ARGS])
    assert result.exit_code == 2 and "diffusers VAE folder not found" in result.output
    assert "probed" not in result.output and not (tmp_path / "o").exists()


def test_families_from_keys_and_the_shipped_config_from_shapes():
    wan = ["encoder.downsamples.0.residual.0.gamma", "decoder.upsamples.0.residual.0.gamma", "conv1.weight"]
    assert detect_family(wan) == "AutoencoderKLWan"
    assert detect_family(["vae.per_channel_statistics.mean-of-means", "vae.encoder.conv_in.conv.weight"]) == \
        "AutoencoderKLLTXVideo"
    assert detect_family(["first_stage_model.encoder.down.0.block.0.norm1.weight",
                          "first_stage_model.decoder.up.0.block.0.norm1.weight"]) == "AutoencoderKL"
    with pytest.raises(VaeSpecError, match="HunyuanVideo 1.5 VAE in its release layout.*"
                                           "scripts/convert_hunyuan_video1_5_to_diffusers.py"):
        detect_family(["encoder.conv_in.conv.weight", "encoder.down.0.block.0.norm1.gamma",
                       "encoder.down.0.block.0.conv1.conv.weight", "decoder.up.0.block.0.norm1.gamma"])
    with pytest.raises(VaeSpecError, match="CogVideoX VAE in its original"):
        detect_family(["encoder.down.0.block.0.conv1.conv.weight", "encoder.down.0.block.0.norm1.norm_layer.weight"])
    with pytest.raises(VaeSpecError, match="HunyuanVideo VAE checkpoint: diffusers has no single-file loader"):
        detect_family(["encoder.down_blocks.0.resnets.0.conv1.conv.weight"])
    with pytest.raises(VaeSpecError, match="a diffusers model's weights file on its own"):
        detect_family(["encoder.conv_in.weight", "encoder.down_blocks.0.resnets.0.conv1.weight"])
    with pytest.raises(VaeSpecError, match="not a VAE checkpoint vaecache knows"):
        detect_family(["model.diffusion_model.input_blocks.0.0.weight"])
    published = shipped_config("AutoencoderKLWan", {"conv1.weight": (32, 32, 1, 1, 1),
                                                    "encoder.conv1.weight": (96, 3, 3, 3, 3)})
    assert published["z_dim"] == 16 and published["latents_mean"][0] == -0.7571 and published["base_dim"] == 96
    assert shipped_config("AutoencoderKLWan", {"conv1.weight": (8, 8, 1, 1, 1),
                                               "encoder.conv1.weight": (8, 3, 3, 3, 3)}) is None
    assert shipped_config("AutoencoderKL", {}) is None


def test_a_relative_spec_is_recorded_absolute_and_works_from_elsewhere(wan_files, demo_data, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(wan_files / "folder", tmp_path / "model" / "vae")
    monkeypatch.chdir(tmp_path)
    assert invoke(["encode", demo_data, "--out", "out", "--vae", "diffusers:model#vae", *ARGS]).exit_code == 0
    recorded = read_manifest(tmp_path / "out")["settings"]["vae_spec"]
    assert recorded == f"diffusers:{tmp_path / 'model'}#vae"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    checked = invoke(["verify", tmp_path / "out", "--reencode", "1"])
    assert checked.exit_code == 0, checked.output


@pytest.fixture(scope="module")
def ltx_and_kl_files(tmp_path_factory):
    """A tiny LTX-Video 0.9.0-layout VAE and a tiny SD-style AutoencoderKL, each as a diffusers folder and as one
    safetensors file in its original key layout."""
    from diffusers import AutoencoderKL, AutoencoderKLLTXVideo

    root = tmp_path_factory.mktemp("single-file-ltx-kl")
    torch.manual_seed(5)
    ltx = AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 16, 32, 32),
                                decoder_block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=2)
    ltx.latents_mean.copy_(torch.linspace(-1, 1, 8))
    ltx.latents_std.copy_(torch.linspace(0.5, 2, 8))
    ltx.save_pretrained(root / "ltx")
    save_file({k: v.contiguous() for k, v in ltx090_original(ltx.state_dict()).items()},
              root / "ltx-video-vae.safetensors")
    kl = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                       up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4, sample_size=16,
                       scaling_factor=0.3)
    kl.save_pretrained(root / "kl")
    save_file({k: v.contiguous() for k, v in ldm_vae_original(kl.state_dict(), 2).items()}, root / "sd-vae.safetensors")
    return root


@pytest.mark.parametrize("family, frames", [("ltx", "9"), ("kl", "5")])
def test_ltx_and_sd_checkpoints_give_the_latents_of_their_diffusers_folders(ltx_and_kl_files, demo_data, tmp_path,
                                                                              family, frames):
    single = {"ltx": "ltx-video-vae.safetensors", "kl": "sd-vae.safetensors"}[family]
    config = ltx_and_kl_files / family / "config.json"
    args = ("--num-frames", frames, "--size", "32x32", "--workers", "0", "--no-progress")
    assert detect_family(safetensors_header(ltx_and_kl_files / single)) == {
        "ltx": "AutoencoderKLLTXVideo", "kl": "AutoencoderKL"}[family]
    for spec, out, extra in ((f"diffusers:{ltx_and_kl_files / family}", "folder", ()),
                             (str(ltx_and_kl_files / single), "file", ("--vae-config", str(config)))):
        result = invoke(["encode", demo_data, "--out", tmp_path / out, "--vae", spec, *args, *extra])
        assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(tmp_path / "folder"), load_tensors(tmp_path / "file"))
    folder, file = read_manifest(tmp_path / "folder")["vae"], read_manifest(tmp_path / "file")["vae"]
    assert file["family"] == folder["family"] and file["normalization"] == folder["normalization"]
    no_config = invoke(["encode", demo_data, "--out", tmp_path / "refused", "--vae", str(ltx_and_kl_files / single),
                        *args])
    assert no_config.exit_code == 2 and "--vae-config" in no_config.output  # no latent scale is guessed


def _with_header(src, dst, edit):
    """A copy of the safetensors file `src` (written by safetensors) whose JSON header `edit` rewrote."""
    raw = src.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    text = edit(header).encode() if callable(edit) else edit.encode()
    dst.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])
    return dst


def _refused(path, config=None):
    from vaecache.vae.single_file import load_single_file

    with pytest.raises(VaeSpecError) as caught:
        load_single_file(path, config, False)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def _wan_original(wan_files):
    from safetensors.torch import load_file

    return load_file(wan_files / "Wan2.1_VAE.safetensors")


def test_a_checkpoint_missing_a_tensor_is_refused_naming_the_file_and_the_key(wan_files, demo_data, tmp_path):
    state = _wan_original(wan_files)
    del state["decoder.upsamples.0.residual.2.weight"]  # diffusers: decoder.up_blocks.0.resnets.0.conv1.weight
    path = tmp_path / "Wan2.1_VAE.safetensors"
    save_file(state, path)
    config = wan_files / "folder" / "config.json"
    message = _refused(path, config)
    assert "no tensor for decoder.up_blocks.0.resnets.0.conv1.weight" in message and "1 of " in message, message
    result = invoke(["encode", demo_data, "--out", tmp_path / "o", "--vae", path, "--vae-config", config, *ARGS])
    assert result.exit_code == 2 and str(path) in result.output and not (tmp_path / "o" / "manifest.json").exists()


def test_a_checkpoint_with_unknown_tensors_is_refused(wan_files, ltx_and_kl_files, tmp_path):
    state = _wan_original(wan_files)
    state["decoder.upsamples.0.residual.9.weight"] = torch.zeros(2)  # passed through by the converter, unused
    save_file(state, tmp_path / "wan.safetensors")
    message = _refused(tmp_path / "wan.safetensors", wan_files / "folder")
    assert "decoder.upsamples.0.residual.9.weight" in message and "1 unknown" in message, message
    # a level the config does not have: diffusers' SD converter drops it without a word
    from safetensors.torch import load_file

    sd = load_file(ltx_and_kl_files / "sd-vae.safetensors")
    sd["encoder.down.2.block.0.conv1.weight"] = torch.zeros(8, 8, 3, 3)
    sd["encoder.down.2.block.0.conv1.bias"] = torch.zeros(8)
    save_file(sd, tmp_path / "sd.safetensors")
    message = _refused(tmp_path / "sd.safetensors", ltx_and_kl_files / "kl")
    assert "encoder.down.2.block.0.conv1." in message and "2 unknown" in message, message


def _folder_module(folder, family):
    import diffusers

    return getattr(diffusers, family).from_pretrained(str(folder), torch_dtype=torch.float32)


@pytest.mark.parametrize("single", ["Wan2.1_VAE.safetensors", "Wan2.1_VAE.pth"])
def test_a_complete_checkpoint_loads_every_weight_from_the_file(wan_files, single):
    from vaecache.vae.single_file import load_single_file

    module, family, _, _ = load_single_file(wan_files / single, wan_files / "folder", True)
    again = load_single_file(wan_files / single, wan_files / "folder", True).module
    reference = _folder_module(wan_files / "folder", family)
    assert_same_tensors(module.state_dict(), reference.state_dict())
    assert_same_tensors(again.state_dict(), reference.state_dict())
    assert not module.training


def test_the_vae_of_a_whole_model_checkpoint_loads_and_known_leftovers_are_not_unknown(ltx_and_kl_files, tmp_path):
    """A whole SD or LTX-Video checkpoint: its UNet or transformer is not the VAE's part; an SD autoencoder's training
    loss and LTX-Video's unused statistics are dropped on purpose."""
    from safetensors.torch import load_file

    from vaecache.vae.single_file import load_single_file

    sd = load_file(ltx_and_kl_files / "sd-vae.safetensors")
    whole = {f"first_stage_model.{k}": v for k, v in sd.items()}
    whole["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(4, 4, 3, 3)
    save_file(whole, tmp_path / "sd-whole.safetensors")
    save_file({**sd, "loss.logvar": torch.zeros(())}, tmp_path / "sd-trained.safetensors")
    ltx = load_file(ltx_and_kl_files / "ltx-video-vae.safetensors")
    ltx.update({"vae.per_channel_statistics.channel": torch.arange(8), "vae.per_channel_statistics.mean-of-stds":
                torch.ones(8), "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight": torch.zeros(4, 4)})
    save_file(ltx, tmp_path / "ltx-whole.safetensors")
    for single, folder in (("sd-whole", "kl"), ("sd-trained", "kl"), ("ltx-whole", "ltx")):
        module, family, _, _ = load_single_file(tmp_path / f"{single}.safetensors", ltx_and_kl_files / folder, False)
        assert_same_tensors(module.state_dict(), _folder_module(ltx_and_kl_files / folder, family).state_dict())


@pytest.mark.parametrize("edit, problem", [
    (lambda h: json.dumps({**h, "conv1.weight": 5}), "'conv1.weight' is a number, not an object"),
    (lambda h: json.dumps({**h, "conv1.weight": [1, 2]}), "'conv1.weight' is an array, not an object"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "shape": float("nan")}}), "NaN"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "shape": [float("inf"), 1]}}), "Infinity"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "shape": [8, -8, 1, 1, 1]}}),
     "not a list of non-negative integers"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "shape": "8"}}),
     "not a list of non-negative integers"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "shape": [4, 8, 1, 1, 1]}}), "bytes"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "dtype": "F33"}}), "dtype 'F33'"),
    (lambda h: json.dumps({**h, "conv1.weight": {**h["conv1.weight"], "data_offsets": [0]}}), "data_offsets"),
    (lambda h: json.dumps({**h, "conv1.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}),
     "starts at byte"),
    (lambda h: json.dumps({**h, "__metadata__": {"format": 1}}), "__metadata__"),
    (lambda h: json.dumps([h]), "not a JSON object"),
    (lambda h: json.dumps(h)[:-2], "not a readable safetensors file"),
])
def test_a_malformed_safetensors_header_is_one_line_naming_the_file(wan_files, tmp_path, edit, problem):
    from vaecache.vae.single_file import check_single_file

    path = _with_header(wan_files / "Wan2.1_VAE.safetensors", tmp_path / "bad.safetensors", edit)
    message = _refused(path, wan_files / "folder")
    assert problem in message, message
    with pytest.raises(VaeSpecError, match=problem.replace("[", r"\[")):
        check_single_file(path, wan_files / "folder", False)


def test_what_is_not_a_vae_checkpoint_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "unet.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2)}, path)
    assert "not a VAE checkpoint vaecache knows" in _refused(path)
    save_file({"encoder.down_blocks.0.resnets.0.conv1.conv.weight": torch.zeros(2)}, path)
    assert "HunyuanVideo" in _refused(path)
    save_file({"encoder.conv_in.weight": torch.zeros(2), "encoder.down_blocks.0.resnets.0.conv1.weight":
               torch.zeros(2)}, path)
    assert "a diffusers model's weights file on its own" in _refused(path)


# Tiny configs with each release's structure: 0.9.1's decoder (timestep conditioning, noise injection, residual
# upsamplers), 0.9.5's encoder (LTXVideo095DownBlock3D by kind; its last width 2048, which is how diffusers' converter
# tells 0.9.5 and later apart, so the last level has no residual block to keep it small).
LTX_TINY = {
    "0.9.1": dict(latent_channels=8, block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(16, 32, 64),
                  layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                  spatio_temporal_scaling=(True, True, True, False), decoder_spatio_temporal_scaling=(True, True, True),
                  decoder_inject_noise=(True, True, True, False), upsample_residual=(True, True, True),
                  upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4),
    "0.9.5": dict(latent_channels=8, block_out_channels=(8, 16, 32, 256, 2048),
                  down_block_types=("LTXVideo095DownBlock3D",) * 4,
                  downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                  decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 0),
                  decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True,) * 4,
                  decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
                  upsample_residual=(True,) * 3, upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4,
                  spatial_compression_ratio=32, temporal_compression_ratio=8),
}


@pytest.mark.parametrize("release", ["0.9.1", "0.9.5"])
def test_timestep_conditioned_ltx_releases_load_as_folders_and_single_files_to_the_same_latents(
        demo_data, tmp_path, release):
    """0.9.1 and later carry a 0-dim decoder.timestep_scale_multiplier, which the weights hash once failed on."""
    from diffusers import AutoencoderKLLTXVideo
    from diffusers.loaders.single_file_utils import convert_ltx_vae_checkpoint_to_diffusers

    torch.manual_seed(7)
    module = AutoencoderKLLTXVideo(**LTX_TINY[release])
    module.latents_mean.copy_(torch.linspace(-1, 1, 8))
    module.latents_std.copy_(torch.linspace(0.5, 2, 8))
    assert module.state_dict()["decoder.timestep_scale_multiplier"].dim() == 0
    module.save_pretrained(tmp_path / "folder")
    original = {k: v.contiguous() for k, v in ltx_original(module.state_dict(), release).items()}
    assert set(convert_ltx_vae_checkpoint_to_diffusers(dict(original))) == set(module.state_dict())  # the helper
    save_file(original, tmp_path / f"ltx-video-{release}.safetensors")
    args = ("--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress")
    for spec, out, extra in ((f"diffusers:{tmp_path / 'folder'}", "folder", ()),
                             (str(tmp_path / f"ltx-video-{release}.safetensors"), "file",
                              ("--vae-config", str(tmp_path / "folder")))):
        result = invoke(["encode", demo_data, "--out", tmp_path / f"out-{out}", *args, "--vae", spec, *extra])
        assert result.exit_code == 0, result.output
    assert_same_tensors(load_tensors(tmp_path / "out-folder"), load_tensors(tmp_path / "out-file"))
    assert read_manifest(tmp_path / "out-folder")["vae"]["weights_sha256"] == \
        read_manifest(tmp_path / "out-file")["vae"]["weights_sha256"]


RELEASES = [  # (shipped config, original layout, extra keys of a whole checkpoint)
    ("wan2.1_vae.json", wan21_original, {}),
    ("wan2.2_vae.json", wan22_original, {}),
    ("ltx-video-0.9.0_vae.json", lambda state: ltx_original(state, "0.9.0"), {}),
    ("ltx-video-0.9.1_vae.json", lambda state: ltx_original(state, "0.9.1"), {}),
    ("ltx-video-0.9.5_vae.json", lambda state: ltx_original(state, "0.9.5"), {}),
    ("ltx-video-0.9.5_vae.json", lambda state: ltx_original(state, "0.9.5"),  # 0.9.7's whole checkpoint
     {"model.diffusion_model.transformer_blocks.47.scale_shift_table": (2, 4096)}),
    ("ltx-2.0_vae.json", ltx2_original, {}),  # LTX-2's video VAE alone: 0.9.5's encoder, no timestep conditioning
    ("ltx-2.0_vae.json", ltx2_original,  # LTX-2's whole checkpoint: its audio VAE beside
     {"audio_vae.encoder.conv_in.conv.weight": (128, 2, 3, 3), "model.diffusion_model.scale_shift_table": (2, 4096)}),
    ("ltx-2.3_vae.json", ltx2_original, {}),
]


@pytest.mark.parametrize("name, original, extra", RELEASES)
def test_each_release_is_told_from_its_keys_and_its_shipped_config_takes_every_tensor(name, original, extra):
    """At the released sizes, on the meta device (no memory): the release's original layout is told apart, and
    converted it is exactly the keys and shapes of the module its shipped config builds."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    from vaecache.models.wan import convert_wan22_vae, is_wan22_layout

    config = json.loads((CONFIGS / name).read_text())
    family = config["_class_name"]
    with torch.device("meta"):
        module = getattr(diffusers, family).from_config(config)
    state = module.state_dict()
    layout = original(state)
    shapes = {key: tuple(value.shape) for key, value in layout.items()} | extra
    from vaecache.models._ltx2_file import convert_ltx2_video_vae

    assert detect_family(shapes, None, shapes) == family
    assert shipped_config_name(family, shapes) == name
    convert = convert_wan22_vae if is_wan22_layout(layout) else convert_ltx2_video_vae if \
        family == "AutoencoderKLLTX2Video" else SINGLE_FILE_LOADABLE_CLASSES[family]["checkpoint_mapping_fn"]
    converted = convert(config=dict(module.config), checkpoint=dict(layout))
    assert set(converted) == set(state)
    assert all(tuple(converted[key].shape) == tuple(state[key].shape) for key in state)


def test_wan22_checkpoint_gives_the_latents_of_its_diffusers_folder(demo_data, tmp_path):
    """Wan 2.2 TI2V's VAE as Wan2.2_VAE.pth / wan2.2_vae.safetensors hold it (a tiny one: the shipped config is for
    the released size), and its refusal without --vae-config names the shipped configs' sizes."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(11)
    module = AutoencoderKLWan(base_dim=16, decoder_base_dim=24, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                              temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                              out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                              latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.5, 1.0])
    module.save_pretrained(tmp_path / "folder")
    original = {k: v.contiguous() for k, v in wan22_original(module.state_dict()).items()}
    save_file(original, tmp_path / "wan2.2_vae.safetensors")
    torch.save({f"vae.{key}": value for key, value in original.items()}, tmp_path / "Wan2.2_VAE.pth")  # as some save
    args = ("--num-frames", "5", "--size", "32x32", "--workers", "0", "--no-progress")
    for spec, out, extra in ((f"diffusers:{tmp_path / 'folder'}", "folder", ()),
                             (str(tmp_path / "wan2.2_vae.safetensors"), "file",
                              ("--vae-config", str(tmp_path / "folder"))),
                             (str(tmp_path / "Wan2.2_VAE.pth"), "pickle",
                              ("--vae-config", str(tmp_path / "folder"), "--allow-pickle-weights"))):
        result = invoke(["encode", demo_data, "--out", tmp_path / f"out-{out}", *args, "--vae", spec, *extra])
        assert result.exit_code == 0, result.output
    folder = load_tensors(tmp_path / "out-folder")
    assert_same_tensors(folder, load_tensors(tmp_path / "out-file"))
    assert_same_tensors(folder, load_tensors(tmp_path / "out-pickle"))
    refused = invoke(["encode", demo_data, "--out", tmp_path / "refused", *args, "--vae",
                      str(tmp_path / "wan2.2_vae.safetensors")])
    assert refused.exit_code == 2 and "Wan 2.2 TI2V-5B's (z_dim 48, base_dim 160)" in refused.output


def test_an_sd_checkpoint_with_ema_copies_loads_and_the_record_names_them(ltx_and_kl_files, tmp_path):
    """vae-ft-mse-840000-ema-pruned.ckpt and its kin carry LitEma's model_ema.* beside the weights: ldm and diffusers
    ignore them, and so does vaecache, naming them in the recorded config."""
    from safetensors.torch import load_file

    from vaecache.vae.load import load_vae

    state = load_file(ltx_and_kl_files / "sd-vae.safetensors")
    state.update({"model_ema.decay": torch.tensor(0.9999), "model_ema.num_updates": torch.tensor(840000),
                  "model_ema.encoderconv_inweight": state["encoder.conv_in.weight"].clone()})
    torch.save({"state_dict": state}, tmp_path / "vae-ft-mse-ema.ckpt")
    runner = load_vae(str(tmp_path / "vae-ft-mse-ema.ckpt"), vae_config=str(ltx_and_kl_files / "kl"),
                      allow_pickle_weights=True)
    assert runner.model.config["single_file_skipped"] == {"model_ema.": 3}
    plain = load_vae(str(ltx_and_kl_files / "sd-vae.safetensors"), vae_config=str(ltx_and_kl_files / "kl"))
    assert runner.model.weights_sha256 == plain.model.weights_sha256 and "single_file_skipped" not in plain.model.config
