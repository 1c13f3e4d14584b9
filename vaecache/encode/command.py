"""The encode command, stage by stage (what `vaecache encode` and the demo call): plan -> decode (DataLoader
workers) -> encode (SP group) -> gather -> write. `run_encode` hands each stage its part of the settings: OUT's
commit protocol, start-up (vaecache.encode.startup), the run's records (vaecache.encode.fingerprint), and the encode
into OUT (vaecache.encode.into_out) through one run (vaecache.encode.run)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from vaecache.cache.commits import open_out
from vaecache.cache.provenance import source_identities
from vaecache.cache.store import open_store
from vaecache.distributed.context import DistContext
from vaecache.encode.fingerprint import run_records
from vaecache.encode.into_out import Preparation, encode_into
from vaecache.encode.numerics import torch_threads_kept
from vaecache.encode.run import EncodeRun, Reporting
from vaecache.encode.startup import Recorded, StartRequest, start_up
from vaecache.encode.summary import EncodeSummary
from vaecache.meter import Advance, MeterFactory
from vaecache.settings.commands import EncodeConfig
from vaecache.stop import StopRequest
from vaecache.storage import HeldObjects

log = logging.getLogger("vaecache")


def run_encode(cfg: EncodeConfig, ctx: DistContext, on_progress: Advance | None = None,
               meter: MeterFactory | None = None,
               on_failure: Callable[[dict[str, Any]], None] | None = None,
               say: Callable[[str], None] | None = None) -> EncodeSummary:
    """Encode the dataset into OUT on this rank; returns the job-wide summary. Each stage gets its part of `cfg`:
    OUT's commit protocol `cfg.out`, start-up the parts it checks and resolves, the encode loop what it writes with.

    `on_progress(clips_done_now, clips_of_this_rank)` is called after each batch; `meter`, where given,
    shows the probing of this rank's scenes and then its clips; `on_failure(record)` gets each failure record
    (an input that produced no clip) this rank writes, as it writes it; `say(text)`, where given, what start-up is
    doing as it starts each step."""
    started = time.perf_counter()
    overwrite = cfg.out.overwrite
    held = HeldObjects()  # the small videos probing reads whole, for each decode worker's first batch
    out = open_out(open_store(cfg.out.location, dict(cfg.out.storage_options)))  # a URL's work folder goes at the end
    try:
        with torch_threads_kept():
            # Start-up writes nothing, so a Ctrl-C in it ends the command at once (the CLI prints one line).
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaecache-out") as pool:
                # OUT usable as far as can be told before the fingerprint, and a URL's records fetched, while DATA
                # is listed
                pulled = pool.submit(out.pull_start) if not out.store.local else None
                if pulled is None:
                    out.pull_start()

                def out_ready() -> Recorded:
                    if pulled is not None:
                        pulled.result()
                    return Recorded() if overwrite else Recorded(out.recorded_encoder_impl(),
                                                                 out.recorded_cpu_threads())

                start = start_up(StartRequest(
                    cfg.source, cfg.vae, cfg.clip, cfg.decode, cfg.parallel, ctx.device, ctx.info.world_size,
                    ctx.info.local_world_size, cfg.text, cfg.conditions, cfg.audio, probe_cache=out.probes_folder(),
                    held=held, out_ready=out_ready), ctx, meter, say)
            for note in start.notes if ctx.info.rank == 0 else ():
                log.warning("%s", note)
            records = run_records(cfg, start, ctx.info.world_size)
            # what OUT is made from, recorded by rank 0
            sources = source_identities(start.sources(), cfg.out.hash_sources) if ctx.info.rank == 0 else None
            # From here on stop signals are caught, so one arriving while OUT is prepared or the manifest is
            # written cannot kill the rank between commits; the encode loop polls the flag.
            with StopRequest() as stop:
                run = EncodeRun(ctx, out, start, stop, started, cfg.out, cfg.source.on_error, cfg.decode.workers,
                                cfg.parallel.sp_mode, held, Reporting(on_progress, meter, on_failure))
                summary = encode_into(run, Preparation(records, sources, overwrite, cfg.parallel.allow_other_numerics))
    finally:
        out.close()
    summary.out = cfg.out.location
    return summary
