"""The encode loop's start-up order: what can be checked without the VAE fails before the VAE is loaded."""

from __future__ import annotations

from pathlib import Path


def _args(vae: str) -> list[str]:
    return ["--vae", vae, "--num-frames", "9", "--size", "64x64", "--workers", "0", "--no-progress"]


def test_a_missing_dataset_fails_before_the_vae_loads(run_cli, loud_vae, tmp_path: Path) -> None:
    result = run_cli(["encode", tmp_path / "no-such-data", "--out", tmp_path / "out", *_args(loud_vae)])
    assert result.exit_code == 2, result.output
    assert "no-such-data: dataset path does not exist" in result.output
    assert not (tmp_path / "vae-was-loaded").exists() and not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_fails_before_the_vae_loads(run_cli, loud_vae, demo_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("not a folder")
    result = run_cli(["encode", demo_data, "--out", out, *_args(loud_vae)])
    assert result.exit_code == 2, result.output
    assert "--out exists and is not a folder" in result.output
    assert not (tmp_path / "vae-was-loaded").exists()


def test_the_vae_loads_once_data_and_out_are_fine(run_cli, loud_vae, demo_data: Path, tmp_path: Path) -> None:
    # The same fixture, with nothing wrong before the VAE: it is loaded (so the tests above can fail).
    result = run_cli(["encode", demo_data, "--out", tmp_path / "out", *_args(loud_vae)])
    assert result.exit_code != 0
    assert (tmp_path / "vae-was-loaded").exists()



def test_decode_workers_share_the_cores_the_encode_leaves() -> None:
    from vaecache.pipeline import decode_thread_budget

    assert decode_thread_budget(cores=2, workers=1, main_threads=1) == 1  # the 2-core CPU case: one each
    assert decode_thread_budget(cores=16, workers=4, main_threads=1) == 3  # a CUDA rank: main thread + 4 workers
    assert decode_thread_budget(cores=8, workers=2, main_threads=8) == 1  # OMP_NUM_THREADS took every core
    assert decode_thread_budget(cores=6, workers=0, main_threads=6) == 6  # decoding between forwards
    assert decode_thread_budget(cores=0, workers=0, main_threads=1) == 1
