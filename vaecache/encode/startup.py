"""Start-up, shared by encode and plan: the decoder, DATA's scenes, their probes, the job plan and the VAE,
checked in that order so that a typo fails before anything slow runs. It writes nothing."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vaecache.distributed.agreement import loaded_on_every_rank
from vaecache.distributed.liveness import set_doing
from vaecache.edges import kind_edges
from vaecache.encode.numerics import peer_numerics, run_numerics, thread_budget
from vaecache.errors import InputError, UsageError
from vaecache.meter import MeterFactory, meter_phase
from vaecache.parallel.encoders import encoder_for
from vaecache.planning.jobs import JobPlan, plan_job, plan_notes
from vaecache.settings.clip import ClipSettings
from vaecache.settings.parts import (
    AudioConfig,
    ConditionsConfig,
    DecodeConfig,
    ParallelConfig,
    SourceConfig,
    TextConfig,
    VaeConfig,
)
from vaecache.sources.discover import discover
from vaecache.sources.probing import probe_dataset
from vaecache.sources.scene import Scene, SceneProbe, SourceOptions
from vaecache.storage import HeldObjects
from vaecache.vae import VaeRunner, load_vae
from vaecache.vae.specs import check_vae_spec, spec_family
from vaecache.video.backends import Backend, resolve_decoder

log = logging.getLogger("vaecache")


@dataclass(frozen=True)
class Recorded:
    """What a run of OUT recorded that a resume computes alike with (none: a new OUT, or --overwrite)."""

    encoder_impl: str | None = None
    """The encoder implementation, which `--encoder-impl auto` resumes with."""
    cpu_threads: int | None = None
    """The torch threads per rank of a CPU run (another count would change the latents' last bits)."""


@dataclass(frozen=True)
class StartRequest:
    """What encode and plan both start from: the parts of their settings start-up reads (the sets an encode adds
    afterwards, `text` and `conditions`, are checked here too; plan has none) and the shape of the job."""

    source: SourceConfig
    vae: VaeConfig
    clip: ClipSettings
    decode: DecodeConfig
    parallel: ParallelConfig
    device: torch.device
    world_size: int = 1
    ranks_on_node: int = 1
    """The ranks sharing this machine's cores (each gets its share, for the encode and its decode workers)."""
    text: TextConfig = TextConfig()
    conditions: ConditionsConfig = ConditionsConfig()
    audio: AudioConfig = AudioConfig()
    probe_cache: Path | None = None
    """A folder of per-rank probe-cache files (OUT/probes) that spares opening videos probed before."""
    keep_probes: bool = False
    """Keep every scene's probe in StartUp.probes (plan lists scenes; encode plans from them and lets them go)."""
    held: HeldObjects | None = None
    """Where probing holds the small videos at URLs it reads whole, for the decode workers' first batches (encode's;
    plan reads nothing again)."""
    out_ready: Callable[[], Recorded] | None = None
    """Called once DATA is listed, before the probe cache is read: waits for OUT's records (fetched meanwhile) and
    returns what a run of OUT recorded."""


@dataclass(frozen=True)
class StartUp:
    """What start-up found before OUT is touched, and what it resolved: the settings asked are left as they were."""

    job: JobPlan
    """The job plan, the scenes that cannot be used (job.skipped) included."""
    scenes: int
    vae: VaeRunner
    backend: Backend
    """The resolved --decoder, with the FFmpeg threads per video of this rank's budget."""
    threads: int
    """The torch intra-op threads this rank computes with (set by start-up on CPU)."""
    numerics: dict[str, Any]
    """What decides the last bits of this rank's latents besides the settings (encode.numerics.run_numerics)."""
    other_numerics: list[dict[str, Any]]
    """Other ranks' numerics where --allow-other-numerics lets them differ (none for plan)."""
    probe_records: tuple[dict[str, Any], ...]
    """This rank's new probe-cache records, written to OUT/probes once OUT is prepared."""
    discovered: Sequence[Scene]
    """Every scene DATA holds (skipped ones too)."""
    left_out_cameras: dict[str, int]
    clip: ClipSettings
    """The clip settings the run encodes with and records: the encoder implementation a resume recorded (where
    `--encoder-impl auto` was asked) and what `--views-per-forward` came to for this dataset."""
    notes: tuple[str, ...]
    """What a user should know about this plan before it runs (planning.jobs.plan_notes): encode logs them, plan
    lists them."""
    cameras: tuple[str, ...] = ()
    """The chosen camera set (the first scene's cameras)."""
    probes: dict[str, SceneProbe] = field(default_factory=dict)
    """With StartRequest.keep_probes: every scene's probe."""
    images: bool = False
    """Some camera is an image sequence (the image decoder then joins the run fingerprint)."""

    def sources(self) -> tuple[Any, ...]:
        """Every camera source the discovered scenes name (a path, or a FrameList), sorted by name (the one rank
        that records them asks)."""
        found = {getattr(source, "key", source): source for scene in self.discovered
                 for source in map(scene.source, range(len(scene.cameras))) if source is not None}
        return tuple(found[name] for name in sorted(found))


def start_up(request: StartRequest, ctx: Any = None, meter: MeterFactory | None = None,
             say: Callable[[str], None] | None = None) -> StartUp:
    """Everything that can be checked without the VAE first (the decoder, DATA, the probes, the plan), then the
    VAE and what the settings need of it. Under several ranks (`ctx`) every rank plans alike (probing.probe_dataset
    shares the probes)."""
    source, vae_config, clip, parallel = request.source, request.vae, request.clip, request.parallel
    # a typo costs nothing: refused before any video is probed
    check_vae_spec(vae_config.spec, vae_config.config, vae_config.allow_pickle_weights)
    views_asked = one_view_family_views(vae_config.spec, clip.views_per_forward)
    for edges in kind_edges():  # each set encode adds once the cache is finished: its options checked now
        edges.check_at_start(request)
    backend = resolve_decoder(request.decode.decoder, request.device, request.decode.workers)
    sampling = clip.sampling
    tell = say or (lambda text: None)  # what start-up is doing, as it starts each step (rank 0's terminal)
    tell(f"listing the dataset {source.location}")
    found = discover(source.location, options=SourceOptions(clip.cameras, sampling.frame_rate,
                                                           source.nuscenes_version, source.columns,
                                                           source.lerobot_state, source.storage_options))
    sampling = dataclasses.replace(sampling, sync=found.resolved_sync(sampling.sync))
    for edges in kind_edges():
        edges.check_scenes(request, found.scenes)
    recorded = request.out_ready() if request.out_ready is not None else Recorded()
    rank = ctx.info.rank if ctx is not None else 0
    threads = thread_budget(request.device, request.ranks_on_node, request.decode.workers, recorded.cpu_threads,
                            warn=rank == 0)
    numerics = run_numerics(request.device, threads.torch)
    # every rank computes with the same numerics, or its latents would differ in the last bits
    other_numerics = peer_numerics(ctx, numerics, parallel.allow_other_numerics) if ctx is not None else []
    cache = request.probe_cache
    with meter_phase(meter, "probe", "scenes") as advance:
        probed = probe_dataset(found.scenes, ctx, workers=source.probe_workers, advance=advance, sync=sampling.sync,
                               cache_paths=(lambda: cache.glob("rank-*.jsonl")) if cache is not None else tuple,
                               held=request.held)
    encoder = encoder_for(parallel.sp_mode)
    job = plan_job(found.scenes, probed.probes, sampling, request.world_size, parallel.sp_size, parallel.batch_size,
                   sizes=clip.sizes, views_per_forward=encoder.views_per_forward(views_asked),
                   device_type=request.device.type)
    job = dataclasses.replace(job, skipped=(*found.rejected, *job.skipped))
    notes = plan_notes(job, parallel, request.device.type, threads.torch)
    if job.skipped and source.on_error == "fail":
        first = job.skipped[0]
        raise InputError(f"{first.path or first.scene_id}: {first.reason} (scene {first.scene_id}; --on-error fail)")
    set_doing(f"loading the VAE {vae_config.spec}")
    tell(f"loading the VAE {vae_config.spec} and hashing its weights")
    if clip.encoder_impl == "auto" and recorded.encoder_impl is not None:
        clip = dataclasses.replace(clip, encoder_impl=recorded.encoder_impl)
    # every rank hears at once of a rank whose copy of the VAE does not load (a damaged file on its node's disk)
    vae = loaded_on_every_rank(ctx, lambda: load_vae(
        vae_config.spec, request.device, clip.dtype, tiling=clip.tiling, views_per_forward=job.views_per_forward,
        allow_pickle_weights=vae_config.allow_pickle_weights, compiled=clip.compiled,
        channels_last=clip.channels_last, vae_config=vae_config.config, model=vae_config.model,
        # spatial mode runs diffusers' encoder band by band: auto is the reference there
        encoder_impl="reference" if parallel.sp_mode == "spatial" and clip.encoder_impl == "auto"
        else clip.encoder_impl), "VAE")
    vae.model.rule.check_buckets(clip.sampling.lengths, clip.sizes)
    notes = [*notes, *family_notes(vae.model, vae_config.model)]
    if clip.store != "mean" and not vae.model.has_logvar:
        raise UsageError(f"--store {clip.store} needs the posterior log-variance, and {vae_config.spec} gives only a "
                         "mean; use --store mean")
    encoder.check(clip, vae.model, parallel.sp_size, vae_config.spec)
    for edges in kind_edges():  # a set the cache's own VAE computes: this VAE must serve it
        edges.check_vae(request, vae.model.fingerprint())
    return StartUp(job, len(found.scenes), vae, dataclasses.replace(backend, threads=threads.decode), threads.torch,
                   numerics, other_numerics, tuple(probed.records), found.scenes, dict(found.left_out_cameras),
                   dataclasses.replace(clip, views_per_forward=job.views_per_forward), tuple(notes),
                   found.scenes[0].cameras if found.scenes else (),
                   probed.probes if request.keep_probes else {}, has_image_cameras(found.scenes))


def family_notes(model: Any, asked: str | None) -> list[str]:
    """What plan and encode say of the model family where the VAE class serves several and --model was not given."""
    from vaecache.models import FAMILIES, families_of_class

    serving = families_of_class(model.family)
    if asked is not None or len(serving) < 2 or model.model not in FAMILIES:
        return []
    chosen = FAMILIES[model.model]
    others = " or ".join(f"--model {family.name}" for family in serving[1:])
    return [f"{model.family} serves {', '.join(family.name for family in serving)}: encoding for {chosen.label} "
            f"({chosen.reference.description}); {others} encodes as that model's trainers do"]


def has_image_cameras(scenes: Sequence[Scene]) -> bool:
    """Whether any camera of `scenes` is an image sequence (a path named like a video is not looked at)."""
    from vaecache.video.frames import is_image_source

    return any((scene.listing is not None and scene.listing.lists_frames) or any(map(is_image_source, scene.paths))
               for scene in scenes)


def one_view_family_views(spec: str, asked: int | str) -> int | str:
    """--views-per-forward for a VAE class that encodes one view per forward (vaecache.models.VaeClass
    .one_view_per_forward): 1 for auto and all (recorded as 1: what was run), a larger K refused naming why."""
    from vaecache.models import vae_class

    vae = vae_class(spec_family(spec))
    if vae is None or not vae.one_view_per_forward:
        return asked
    if isinstance(asked, int) and asked > 1:
        raise UsageError(f"--views-per-forward {asked}: {vae.name} encodes one view per forward "
                         f"({vae.one_view_per_forward})")
    return 1

