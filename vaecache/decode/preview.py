"""`vaecache decode`: decode one clip's stored latents with the VAE that made them, measure the reconstruction
against the source frames (PSNR, SSIM per camera) and write an mp4 grid: source above reconstruction, one
column per camera.

Memory is bounded by `chunk_frames` latent frames per camera (vae/latent_decode.py: chunks are exact), never by
the clip's length: each chunk's source frames are read, its frames scored and written to the mp4, and let go.
The source frames are read exactly as encode read them (vaecache.video.dataset.ViewDecoder: the same frame indices,
the same resize/crop/fit to the clip's bucket size), so they line up pixel for pixel with what was encoded.

Metrics are computed on RGB in [0, 1] as floats: the VAE's input (the resized source, before any 8-bit
rounding) against its output clamped to [-1, 1], before the mp4 quantizes either.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from vaecache.errors import OutputError, UsageError, VaecacheError

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_FRAMES = 4
"""Latent frames decoded per chunk (Wan: 4 latent frames are 13 source frames for the first chunk, 16 after)."""
DEFAULT_CRF = 18
"""libx264 quality of the preview (lower is better; 18 is visually near-lossless)."""
DEFAULT_FPS = 24.0
"""Frame rate of the preview when the clip record has none."""


@dataclass(frozen=True)
class PreviewSettings:
    """How `decode_preview` decodes, measures and writes one clip."""

    vae: str | None = None
    """VAE spec; default the one recorded in the manifest. Must match the recorded fingerprint."""
    device: str = "auto"
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    """Latent frames per decoded chunk (per camera): bounds the frames in flight, not one frame's activations."""
    tiling: bool = False
    """Decode with the module's spatial tiling (enable_tiling()): bounds one frame's activations."""
    overwrite: bool = False
    """Replace an existing output file (refused otherwise)."""
    allow_pickle_weights: bool = False
    crf: int = DEFAULT_CRF

    def __post_init__(self) -> None:
        if isinstance(self.chunk_frames, bool) or not isinstance(self.chunk_frames, int) or self.chunk_frames < 1:
            raise UsageError(f"--chunk-frames must be an integer >= 1, got {self.chunk_frames!r}")
        if isinstance(self.crf, bool) or not isinstance(self.crf, int) or not 0 <= self.crf <= 51:
            raise UsageError(f"crf must be an integer in 0..51, got {self.crf!r}")
        if self.vae is not None and not self.vae.strip():
            raise UsageError("--vae must not be empty")


@dataclass(frozen=True)
class CameraMetrics:
    """One camera's reconstruction against its source frames."""

    camera: str
    frames: int
    psnr_db: float
    """10·log10(1 / MSE) over every pixel, channel and frame of the clip, RGB in [0, 1]; capped at
    vaecache.decode.metrics.PSNR_CAP_DB (100 dB)."""
    ssim: float
    """Mean SSIM over frames (Y of BT.601, 11x11 Gaussian window, sigma 1.5, valid region, K1 0.01, K2 0.03)."""


@dataclass(frozen=True)
class PreviewReport:
    """What `decode_preview` did; `to_json()` is what `vaecache decode --json` writes."""

    out: str
    clip: str
    output: str
    vae: str
    latent_key: str
    """The stored tensor decoded: `mean` (the posterior mean, no noise) where stored, else `sample`."""
    frames: int
    fps: float
    size: tuple[int, int]
    """(height, width) of one camera's frames."""
    grid: tuple[int, int]
    """(height, width) of the mp4's frames: 2 rows x cameras columns, padded to even."""
    decode_mode: str
    """causal-chunks (Wan), per-frame (2D VAE) or whole (other VAEs: one decode call)."""
    chunk_frames: int
    chunks: int
    max_frames_in_flight: int
    """The most decoded frames (per camera) held at once."""
    tiling: bool
    device: str
    cameras: list[CameraMetrics] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["size"], data["grid"] = list(self.size), list(self.grid)
        return data


class ReconstructionScore:
    """Running PSNR/SSIM of one camera over the chunks of a clip."""

    def __init__(self) -> None:
        self.squared_error, self.values, self.ssim_sum, self.frames = 0.0, 0, 0.0, 0

    def add(self, source: torch.Tensor, decoded: torch.Tensor) -> None:
        """(T, 3, H, W) each, in [-1, 1]; scored a frame at a time (float64 copies of one frame, not of T)."""
        from vaecache.decode.metrics import ssim_per_frame

        for src, dec in zip(source.split(1), decoded.split(1)):
            a, b = (src.double() + 1) / 2, (dec.double() + 1) / 2
            self.squared_error += float(((a - b) ** 2).sum())
            self.values += a.numel()
            self.ssim_sum += float(ssim_per_frame(a, b).sum())
            self.frames += 1

    def result(self, camera: str) -> CameraMetrics:
        from vaecache.decode.metrics import psnr_db

        return CameraMetrics(camera, self.frames, psnr_db(self.squared_error / max(1, self.values)),
                             self.ssim_sum / max(1, self.frames))


# --------------------------------------------------------------------------- the mp4 grid


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """[-1, 1] float -> [0, 255] uint8 (round to nearest)."""
    import torch

    return ((frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


def grid_frames(sources: list[torch.Tensor], decoded: list[torch.Tensor]) -> torch.Tensor:
    """Per camera (T, 3, H, W) in [-1, 1] -> (T, H2, W2, 3) uint8: sources in the top row, reconstructions
    below, one column per camera, padded with black on the right and bottom to even sizes (yuv420p)."""
    import torch

    top = torch.cat([to_uint8(s) for s in sources], dim=-1)
    bottom = torch.cat([to_uint8(d) for d in decoded], dim=-1)
    grid = torch.cat([top, bottom], dim=-2)
    pad_h, pad_w = grid.shape[-2] % 2, grid.shape[-1] % 2
    if pad_h or pad_w:
        grid = torch.nn.functional.pad(grid, (0, pad_w, 0, pad_h))
    return grid.permute(0, 2, 3, 1).contiguous()


def grid_size(height: int, width: int, cameras: int) -> tuple[int, int]:
    grid_h, grid_w = 2 * height, cameras * width
    return grid_h + grid_h % 2, grid_w + grid_w % 2


class _Mp4Writer:
    """h264 (libx264, yuv420p) into a temp file beside `path`; `commit()` fsyncs and renames it into place."""

    def __init__(self, path: Path, height: int, width: int, fps: float, crf: int) -> None:
        import av

        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.mp4")
        self.rate = Fraction(fps).limit_denominator(1001)
        self.index = 0
        try:
            self.container = av.open(str(self.tmp), mode="w", format="mp4")
        except OSError as exc:
            raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
        try:
            self.stream = self.container.add_stream("libx264", rate=self.rate, options={"crf": str(crf)})
            self.stream.width, self.stream.height = width, height
            self.stream.pix_fmt = "yuv420p"
            self.time_base = 1 / self.rate
            self.stream.codec_context.time_base = self.time_base
        except BaseException:
            self.abandon()
            raise

    def write(self, frames: torch.Tensor) -> None:
        """(T, H, W, 3) uint8."""
        import av

        for array in frames.numpy():
            frame = av.VideoFrame.from_ndarray(array, format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = self.index, self.time_base
            self.container.mux(self.stream.encode(frame))
            self.index += 1

    def commit(self) -> None:
        from vaecache.cache.io import FILE_MODE, fsync_dir

        self.container.mux(self.stream.encode(None))
        self.container.close()
        try:
            os.chmod(self.tmp, FILE_MODE)
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write ({exc.strerror or exc})") from None

    def abandon(self) -> None:
        try:
            self.container.close()
        except Exception:  # noqa: BLE001 - the file is removed anyway
            pass
        self.tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the command's core


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an output that is not an .mp4 in an existing folder, or that exists (unless `overwrite`)."""
    if output.suffix.lower() != ".mp4":
        raise UsageError(f"{output}: the preview is an mp4; name it *.mp4")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{output}: folder {parent} does not exist")
    if output.is_dir():
        raise UsageError(f"{output}: is a folder")
    if output.exists() and not overwrite:
        raise UsageError(f"{output}: exists; pass --overwrite to replace it")


def default_output(clip_id: str) -> Path:
    """`scene_000/000000-000008` -> `scene_000_000000-000008.mp4` (anything but [A-Za-z0-9._-] becomes _)."""
    import re

    return Path(re.sub(r"[^A-Za-z0-9._-]+", "_", clip_id).strip("._") + ".mp4")


@dataclass(frozen=True)
class ReconstructedChunk:
    """One chunk of a clip decoded: per camera, its source frames and the VAE's reconstruction of them, each
    (T, 3, H, W) float32 in [-1, 1] on the CPU, and the clip frame the chunk starts at."""

    start: int
    sources: list[torch.Tensor]
    decoded: list[torch.Tensor]


def clip_size(record: dict[str, Any], clip_settings: Any) -> tuple[int, int]:
    """(height, width) of a clip's frames: its bucket's, else the cache's (`clip_settings`, a ClipSettings)."""
    bucket = record.get("bucket") if isinstance(record.get("bucket"), dict) else None
    return (bucket["height"], bucket["width"]) if bucket else (clip_settings.height, clip_settings.width)


class ClipDecoder:
    """The VAE a cache records, loaded once (or `settings.vae`, which must match the recorded fingerprint), and the
    way its clips' source frames are read: `chunks(record, latents)` decodes one clip after another, chunk by
    chunk, beside the frames encode read. `vaecache decode` and `vaecache report` decode through it."""

    def __init__(self, out: Any, manifest: dict[str, Any], settings: PreviewSettings) -> None:
        from vaecache.distributed.context import resolve_device
        from vaecache.settings.clip import ClipSettings
        from vaecache.vae.latent_decode import decode_mode
        from vaecache.vae.recorded import load_recorded_vae, recorded_spec
        from vaecache.video.backends import backend_for_record

        self.settings, self.manifest = settings, manifest
        self.spec = recorded_spec(manifest, settings.vae, f"{out}/manifest.json")
        self.device = resolve_device(settings.device)
        vae = load_recorded_vae(out, manifest, self.spec, self.device,
                                allow_pickle_weights=settings.allow_pickle_weights)
        self.model = vae.model
        if settings.tiling and not self.model.can_tile:
            raise UsageError(f"--tiling: {self.model.spec} ({self.model.family}) has no enable_tiling()")
        if self.model.can_tile:  # decoding tiles or not by --tiling alone; the guard above compared the encode's
            if settings.tiling:
                self.model.module.enable_tiling()
            else:
                self.model.module.disable_tiling()
        self.mode = decode_mode(self.model)
        self.clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
        self.backend = backend_for_record((manifest.get("settings") or {}).get("decoder"))

    def size_of(self, record: dict[str, Any]) -> tuple[int, int]:
        return clip_size(record, self.clip_settings)

    def chunks(self, record: dict[str, Any], latents: torch.Tensor) -> Iterator[ReconstructedChunk]:
        """Decode `latents` (cameras, c, t, h, w), the clip's stored raw latents, `settings.chunk_frames` latent
        frames at a time per camera, and read the same frames of each camera's source exactly as encode read them
        (the record's frame indices, backend, resize and fit). Raises VaecacheError when the VAE decodes more
        frames than the clip has, or frames of another size."""
        from vaecache.vae.latent_decode import iter_decoded
        from vaecache.video.dataset import ViewDecoder, recorded_timelines, recorded_views

        clip_id, frames = record["id"], list(record["frames"])
        views = recorded_views(record)  # per camera: its source and its own frames (image files, synced frames)
        timelines = recorded_timelines(record)  # and its frame index around them, where encode recorded it
        height, width = self.size_of(record)
        source = ViewDecoder(height, width, fit=self.clip_settings.fit, backend=self.backend,
                             max_pixels=self.clip_settings.sampling.max_frame_pixels)
        done = 0
        try:
            streams = [iter_decoded(self.model, latents[c:c + 1], self.settings.chunk_frames)
                       for c in range(latents.shape[0])]
            for pieces in _lockstep(streams):
                # (T, 3, H, W); Wan clamps its output itself, other families may overshoot [-1, 1]
                decoded = [piece[0].permute(1, 0, 2, 3).float().cpu().clamp(-1, 1) for piece in pieces]
                count = decoded[0].shape[0]
                if done + count > len(frames):
                    raise VaecacheError(f"{self.model.spec} decoded more frames than clip {clip_id!r} has "
                                        f"({len(frames)}): the latents do not come from this VAE's frame rule")
                if tuple(decoded[0].shape[-2:]) != (height, width):
                    raise VaecacheError(f"{self.model.spec} decoded {tuple(decoded[0].shape[-2:])} frames; clip "
                                        f"{clip_id!r} is {height}x{width}")
                sources = [source.decode(path, list(wanted[done:done + count]), (height, width),
                                         timeline=timeline).permute(1, 0, 2, 3)
                           for (path, wanted), timeline in zip(views, timelines)]
                yield ReconstructedChunk(done, sources, decoded)
                done += count
        finally:
            source.close()


def source_frames_at(record: dict[str, Any], manifest: dict[str, Any], positions: list[int]) -> list[torch.Tensor]:
    """Per camera, the clip's frames at `positions` (indices into the clip's frames) exactly as encode read them
    (its frame indices, the recorded backend, resize and fit to the clip's size): (len(positions), 3, H, W) float32
    in [-1, 1]. What a clip shows where its latents are not decoded."""
    from vaecache.settings.clip import ClipSettings
    from vaecache.video.backends import backend_for_record
    from vaecache.video.dataset import ViewDecoder, recorded_timelines, recorded_views

    clip_settings = ClipSettings.from_record(manifest.get("settings", {}))
    height, width = clip_size(record, clip_settings)
    source = ViewDecoder(height, width, fit=clip_settings.fit,
                         backend=backend_for_record((manifest.get("settings") or {}).get("decoder")),
                         max_pixels=clip_settings.sampling.max_frame_pixels)
    try:
        return [source.decode(path, [wanted[p] for p in positions], (height, width), timeline=timeline)
                .permute(1, 0, 2, 3) for (path, wanted), timeline in zip(recorded_views(record),
                                                                          recorded_timelines(record))]
    finally:
        source.close()


def stored_latents(tensors: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """The stored tensor a decode shows: the posterior `mean` (no noise) where stored, else the `sample`."""
    for key in ("mean", "sample"):
        if key in tensors:
            return key, tensors[key]
    return None


def decode_preview(out: str | Path, clip_id: str, output: str | Path | None = None,
                   settings: PreviewSettings | None = None, storage_options: dict[str, Any] | None = None,
                   **options: Any) -> PreviewReport:
    """Decode clip `clip_id` of cache `out` (a folder or a URL; `storage_options` for the URL and for sources at
    URLs) with its recorded VAE (or `settings.vae`, which must match the recorded fingerprint), score it against its
    source frames and write the grid mp4 to `output` (default `default_output(clip_id)`). `options` are
    PreviewSettings fields (vae=, device=, chunk_frames=, tiling=, overwrite=) when `settings` is not given."""
    from vaecache.cache.store import open_store

    started = time.monotonic()
    settings = settings if settings is not None else PreviewSettings(**options)
    storage_options = dict(storage_options or {})
    store = open_store(out, storage_options)
    out = store.location
    output = Path(output) if output is not None else default_output(clip_id)
    check_output(output, settings.overwrite)

    from vaecache.storage import set_data_storage_options
    from vaecache.training import LatentCache

    store.check_present()
    set_data_storage_options(storage_options)  # the recorded sources at URLs are read as encode read them
    cache = LatentCache(store, verify="size", storage_options=storage_options)
    try:
        record = cache.record(clip_id)
    except KeyError:
        raise UsageError(f"{out}: no clip {clip_id!r} ({_near(cache.ids(), clip_id)})") from None
    tensors = cache.tensors_of(record)
    stored = stored_latents(tensors)
    if stored is None:
        raise UsageError(f"{out}: clip {clip_id!r} stores neither mean nor sample ({sorted(tensors)})")
    latent_key, latents = stored  # (cameras, c, t, h, w), raw: what the decoder takes
    cameras, frames = list(record["cameras"]), list(record["frames"])
    decoder = ClipDecoder(out, cache.manifest, settings)
    height, width = decoder.size_of(record)

    notes: list[str] = []
    fps = float(record.get("fps") or 0.0)
    if fps <= 0:
        fps = DEFAULT_FPS
        notes.append(f"the clip records no fps; the preview plays at {DEFAULT_FPS:g}")
    grid_h, grid_w = grid_size(height, width, len(cameras))
    writer = _Mp4Writer(output, grid_h, grid_w, fps, settings.crf)
    scores = [ReconstructionScore() for _ in cameras]
    done = chunks = in_flight = 0
    try:
        for chunk in decoder.chunks(record, latents):
            for score, src, dec in zip(scores, chunk.sources, chunk.decoded):
                score.add(src, dec)
            writer.write(grid_frames(chunk.sources, chunk.decoded))
            count = chunk.decoded[0].shape[0]
            done += count
            chunks += 1
            in_flight = max(in_flight, count)
        if done < len(frames):
            notes.append(f"decoded {done} frames of the clip's {len(frames)}; the rest are not in the preview")
        writer.commit()
    except BaseException:
        writer.abandon()
        raise
    return PreviewReport(
        out=str(out), clip=clip_id, output=str(output), vae=str(decoder.spec), latent_key=latent_key, frames=done,
        fps=fps, size=(height, width), grid=(grid_h, grid_w), decode_mode=decoder.mode,
        chunk_frames=settings.chunk_frames, chunks=chunks, max_frames_in_flight=in_flight, tiling=settings.tiling,
        device=str(decoder.device), cameras=[score.result(camera) for score, camera in zip(scores, cameras)],
        seconds=round(time.monotonic() - started, 3), notes=notes)


def _near(ids: list[str], clip_id: str) -> str:
    """Where an unknown id would sit among the cache's sorted ids: its neighbours, to spot a typo."""
    import bisect

    if not ids:
        return "the cache holds no clip"
    position = bisect.bisect_left(ids, clip_id)
    near = ", ".join(repr(i) for i in ids[max(0, position - 1):position + 1])
    return f"{len(ids)} clips, ids are <scene>/<first frame>-<last frame>; nearest: {near}"


def _lockstep(streams: list[Iterator[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
    """One piece from every camera's decode at a time (they decode the same number of frames per chunk)."""
    while True:
        pieces = [next(stream, None) for stream in streams]
        if all(piece is None for piece in pieces):
            return
        if any(piece is None for piece in pieces):
            raise VaecacheError("the cameras of the clip decoded to different numbers of frames")
        yield pieces


__all__ = ["CameraMetrics", "ClipDecoder", "PreviewReport", "PreviewSettings", "ReconstructedChunk",
           "ReconstructionScore", "check_output", "decode_preview", "default_output", "grid_frames", "grid_size",
           "source_frames_at", "stored_latents"]
