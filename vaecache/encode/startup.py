"""Start-up, shared by encode and plan: the decoder, DATA's scenes, their probes, the job plan and the VAE,
checked in that order so that a typo fails before anything slow runs. It writes nothing."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from vaecache.cache.sets import loaded_on_every_rank
from vaecache.distributed.liveness import set_doing
from vaecache.errors import InputError, UsageError
from vaecache.meter import MeterFactory, meter_phase
from vaecache.parallel.encoders import encoder_for
from vaecache.planning.jobs import JobPlan, plan_job, sp_repeats_advice
from vaecache.settings.clip import ClipSettings, SyncConfig
from vaecache.sources.discover import discover
from vaecache.sources.probing import probe_dataset
from vaecache.sources.scene import Discovery, Scene, SceneProbe, SourceOptions
from vaecache.urls import set_data_storage_options
from vaecache.vae import VaeRunner, load_vae
from vaecache.vae.specs import check_vae_spec
from vaecache.video.backends import Backend, resolve_decoder

log = logging.getLogger("vaecache")


class StartSettings(Protocol):
    """What start-up reads of the settings encode and plan share (EncodeConfig and PlanConfig both answer it):
    where DATA is and how it is read, the VAE, the clip settings, the shape of a batch, the decode workers per rank
    (the decoder backend is resolved for them). The sets an encode adds afterwards (text_encoder, condition,
    image_encoder, image_convention) are read where present: PlanConfig has none."""

    @property
    def data(self) -> Any: ...
    @property
    def vae(self) -> str: ...
    @property
    def vae_config(self) -> str | None: ...
    @property
    def clip(self) -> ClipSettings: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def sp_mode(self) -> str: ...
    @property
    def workers(self) -> int: ...
    @property
    def probe_workers(self) -> int: ...
    @property
    def allow_pickle_weights(self) -> bool: ...
    @property
    def nuscenes_version(self) -> str | None: ...
    @property
    def columns(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def lerobot_state(self) -> bool: ...
    @property
    def storage_options(self) -> tuple[tuple[str, Any], ...]: ...


@dataclass(frozen=True)
class StartRequest:
    """What encode and plan both start from: their settings and the shape of the job."""

    settings: StartSettings
    device: torch.device
    world_size: int = 1
    sp_size: int = 1
    on_error: str = "skip"
    """"fail": the first scene that cannot be used stops the start (InputError)."""
    probe_cache: Path | None = None
    """A folder of per-rank probe-cache files (OUT/probes) that spares opening videos probed before."""
    keep_probes: bool = False
    """Keep every scene's probe in StartUp.probes (plan lists scenes; encode plans from them and lets them go)."""
    out_ready: Callable[[], str | None] | None = None
    """Called once DATA is listed, before the probe cache is read: waits for OUT's records (fetched meanwhile) and
    returns the encoder implementation a run of OUT recorded (None: none), which `--encoder-impl auto` resumes with."""


@dataclass(frozen=True)
class StartUp:
    """What start-up found before OUT is touched."""

    job: JobPlan
    """The job plan, the scenes that cannot be used (job.skipped) included."""
    scenes: int
    vae: VaeRunner
    backend: Backend
    """The resolved --decoder (its threads set later, by the rank's thread budget)."""
    probe_records: tuple[dict[str, Any], ...]
    """This rank's new probe-cache records, written to OUT/probes once OUT is prepared."""
    discovered: Sequence[Scene]
    """Every scene DATA holds (skipped ones too)."""
    left_out_cameras: dict[str, int]
    clip: ClipSettings
    """The clip settings the run encodes with and records, as start-up resolved them from the ones asked: the encoder
    implementation a resume recorded (where `--encoder-impl auto` was asked) and what `--views-per-forward` came to
    for this dataset. The settings asked are left as they were."""
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


def start_up(request: StartRequest, ctx: Any = None, meter: MeterFactory | None = None) -> StartUp:
    """Everything that can be checked without the VAE first (the decoder, DATA, the probes, the plan), then the
    VAE and what the settings need of it. Under several ranks (`ctx`) every rank plans alike (probing.probe_dataset
    shares the probes)."""
    settings = request.settings
    # a typo costs nothing: refused before any video is probed
    check_vae_spec(settings.vae, settings.vae_config, settings.allow_pickle_weights)
    check_embedder_folders(settings)
    set_data_storage_options(dict(settings.storage_options))
    backend = resolve_decoder(settings.clip.decoder, request.device, settings.workers)
    sampling = settings.clip.sampling
    found = discover(settings.data, options=SourceOptions(settings.clip.cameras, sampling.frame_rate,
                                                         settings.nuscenes_version, settings.columns,
                                                         settings.lerobot_state))
    sync = resolved_sync(sampling.sync, found)
    recorded_impl = request.out_ready() if request.out_ready is not None else None
    cache = request.probe_cache
    with meter_phase(meter, "probe", "scenes") as advance:
        probed = probe_dataset(found.scenes, ctx, workers=settings.probe_workers, advance=advance, sync=sync,
                               cache_paths=(lambda: cache.glob("rank-*.jsonl")) if cache is not None else tuple)
    encoder = encoder_for(settings.sp_mode)
    job = plan_job(found.scenes, probed.probes, dataclasses.replace(sampling, sync=sync), request.world_size,
                   request.sp_size,
                   settings.batch_size, sizes=settings.clip.sizes,
                   views_per_forward=encoder.views_per_forward(settings.clip.views_per_forward),
                   device_type=request.device.type)
    job = dataclasses.replace(job, skipped=(*found.rejected, *job.skipped))
    if job.skipped and request.on_error == "fail":
        first = job.skipped[0]
        raise InputError(f"{first.path or first.scene_id}: {first.reason} (scene {first.scene_id}; --on-error fail)")
    set_doing(f"loading the VAE {settings.vae}")
    clip = settings.clip
    if clip.encoder_impl == "auto" and recorded_impl is not None:
        clip = dataclasses.replace(clip, encoder_impl=recorded_impl)
    # every rank hears at once of a rank whose copy of the VAE does not load (a damaged file on its node's disk)
    vae = loaded_on_every_rank(ctx, lambda: load_vae(
        settings.vae, request.device, clip.dtype, tiling=clip.tiling, views_per_forward=job.views_per_forward,
        allow_pickle_weights=settings.allow_pickle_weights, compiled=clip.compiled,
        channels_last=clip.channels_last, vae_config=settings.vae_config,
        # spatial mode runs diffusers' encoder band by band: auto is the reference there
        encoder_impl="reference" if settings.sp_mode == "spatial" and clip.encoder_impl == "auto"
        else clip.encoder_impl), "VAE")
    vae.model.rule.check_buckets(clip.sampling.lengths, clip.sizes)
    if clip.store != "mean" and not vae.model.has_logvar:
        raise UsageError(f"--store {clip.store} needs the posterior log-variance, and {settings.vae} gives only a "
                         "mean; use --store mean")
    encoder.check(clip, vae.model, request.sp_size, settings.vae)
    check_conditions(settings, vae)
    return StartUp(job, len(found.scenes), vae, backend, tuple(probed.records), found.scenes,
                   dict(found.left_out_cameras), dataclasses.replace(clip, views_per_forward=job.views_per_forward),
                   found.scenes[0].cameras if found.scenes else (),
                   probed.probes if request.keep_probes else {}, has_image_cameras(found.scenes))


def check_embedder_folders(settings: Any) -> None:
    """The sets the encode adds once it is done (--text-encoder, --condition, --image-encoder): each option checked
    by the kind or family that owns it, and the encoders' folders, configs and weights files present, before any
    video is probed (a typo must not cost the whole encode)."""
    if getattr(settings, "text_encoder", None):
        from vaecache.text.encoder import text_encoder_folders
        from vaecache.text.families import check_text_spec

        check_text_spec(settings.text_encoder)
        text_encoder_folders(settings.text_encoder)
    if getattr(settings, "condition", None) is not None:
        from vaecache.conditions.kinds import parse_condition_kinds

        kinds = parse_condition_kinds(settings.condition)
        if not kinds:
            raise UsageError("--condition: name at least one kind (first-frame, first-last, image-features)")
    if "image-features" in (getattr(settings, "condition", None) or ""):
        from vaecache.conditions.images import check_image_options, image_encoder_folders

        check_image_options(settings.image_encoder, settings.image_convention)

        image_encoder_folders(settings.image_encoder, settings.image_convention)


def check_conditions(settings: Any, vae: VaeRunner) -> None:
    """encode --condition: what the condition pass after the encode needs, checked before any video is read (a VAE
    without an image-to-video pipeline, a missing image encoder must not be found out after hours of encoding)."""
    condition = getattr(settings, "condition", None)
    if not condition:
        return
    from vaecache.conditions.kinds import LATENT_KINDS, check_condition_vae, parse_condition_kinds

    kinds = parse_condition_kinds(condition)
    if any(kind in LATENT_KINDS for kind in kinds):
        check_condition_vae(vae.model.fingerprint(), f"--vae {settings.vae}")
    if "image-features" in kinds:
        from vaecache.conditions.images import image_encoder_folders

        image_encoder_folders(settings.image_encoder, settings.image_convention)


def resolved_sync(sync: SyncConfig, found: Discovery) -> SyncConfig:
    """--sync timestamps with its reference camera named: --sync-reference, else the layout's, else the first of
    the chosen cameras. A --sync-reference that is not one of them is a UsageError."""
    if sync.mode != "timestamps":
        if found.reference_camera is not None and found.scenes:
            raise UsageError(f"the cameras of this dataset are paired by time (reference {found.reference_camera}); "
                             "pass --sync timestamps")
        return sync
    cameras = found.scenes[0].cameras if found.scenes else ()
    if sync.reference is not None:
        if cameras and sync.reference not in cameras:
            raise UsageError(f"--sync-reference {sync.reference} is not one of the cameras encoded "
                             f"({', '.join(cameras)})")
        return sync
    reference = found.reference_camera if found.reference_camera in cameras else (cameras[0] if cameras else None)
    return dataclasses.replace(sync, reference=reference)


def has_image_cameras(scenes: Sequence[Scene]) -> bool:
    """Whether any camera of `scenes` is an image sequence (a path named like a video is not looked at)."""
    from vaecache.video.frames import is_image_source

    return any((scene.listing is not None and scene.listing.lists_frames) or any(map(is_image_source, scene.paths))
               for scene in scenes)


def start_notes(job: JobPlan, batch_size: int, sp_size: int, sp_mode: str, device: torch.device,
                threads: int | None = None) -> list[str]:
    """What a user should know about this plan before it runs: an SP group that would encode repeats, and views
    batched on CPU (whose bits depend on the thread count). Encode logs them, plan lists them."""
    notes = []
    advice = sp_repeats_advice(batch_size, job.clips.views_per_clip(), job.views_per_forward,
                               sp_size) if sp_mode == "views" else None
    if advice:
        notes.append(advice)
    if job.views_per_forward > 1 and device.type == "cpu":
        per_rank = f" ({threads} per rank here)" if threads is not None else ""
        notes.append(f"{job.views_per_forward} views per forward on CPU: oneDNN gives a batched forward other bits "
                     f"for another intra-op thread count{per_rank}, so every run of one cache needs the same threads "
                     "per rank (OMP_NUM_THREADS) to match bit for bit")
    return notes
