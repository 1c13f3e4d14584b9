"""vaecache/cache/sets.py: what every set kind shares. Here: a model that fails to load on one rank makes every rank
stop at once with that rank's one line (real ranks, gloo), not wait in the next collective for its timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys
    from vaecache.distributed.agreement import loaded_on_every_rank, same_on_every_rank
    from vaecache.distributed.context import distributed
    from vaecache.weights import WeightsError

    def load(rank):
        if rank == 1:
            raise WeightsError("/node1/wan/text_encoder/model.safetensors: an incomplete checkpoint")
        return {"weights_sha256": "a"}

    with distributed(timeout_s=120) as ctx:
        try:
            loaded = loaded_on_every_rank(ctx, lambda: load(ctx.info.rank), "text encoder")
            same_on_every_rank(ctx, loaded, "text encoder")  # the next collective: nobody may wait in it
        except WeightsError as exc:
            print(f"rank {ctx.info.rank} own: {exc}", flush=True)
            sys.exit(exc.exit_code)
        except Exception as exc:
            print(f"rank {ctx.info.rank} told: {type(exc).__name__}: {exc}", flush=True)
            sys.exit(getattr(exc, "exit_code", 1))
""")


def test_a_rank_that_cannot_load_its_model_stops_every_rank_at_once_with_its_line(tmp_path):
    script = tmp_path / "load.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script)], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    printed = result.stdout + result.stderr
    assert result.returncode != 0
    assert "rank 1 own: /node1/wan/text_encoder/model.safetensors: an incomplete checkpoint" in printed
    assert ("rank 0 told: UsageError: rank 1 could not load its text encoder: /node1/wan/text_encoder/"
            "model.safetensors: an incomplete checkpoint") in printed, printed[-2000:]
    assert time.monotonic() - started < 60  # not the 120 s collective timeout


def test_loaded_on_one_process_is_the_load_itself():
    from vaecache.distributed.agreement import loaded_on_every_rank

    assert loaded_on_every_rank(None, lambda: 7, "VAE") == 7
