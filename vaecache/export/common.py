"""Exports of a finished cache to the layouts trainers read: musubi-tuner's latent cache and WebDataset tars.

Both stream (one clip's tensors in memory at a time), are atomic (everything is written into a hidden
`.DIR.tmp-PID` beside DIR, fsynced, and renamed to DIR last: a crash leaves nothing that looks like an
export) and deterministic (the same cache exported to the same DIR gives the same bytes: safetensors files
are serialized here with sorted keys, tar members carry a fixed mtime, owner and mode).

A file or sample name derived from a scene id, camera or clip id never escapes DIR: `safe_name` keeps
names made of [A-Za-z0-9_-] (and '.', where allowed) as they are and maps any other to a cleaned prefix and
a hash after a '~' (a character kept names never hold, so two names can never collide). Every name written
is listed in DIR/index.jsonl next to the clip and camera it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from vaecache.errors import OutputError, UsageError
from vaecache.format.io import fsync_dir

EXPORT_FORMATS = ("musubi", "webdataset")
MUSUBI_FORMAT_VERSION = "1.0.1"
"""musubi-tuner's latent cache `format_version` metadata (dataset/cache_io.py)."""
MUSUBI_ARCHITECTURES = {"wan": "wan", "hv": "hunyuan_video", "fp": "framepack", "hv15": "hunyuan_video_1_5",
                        "k5": "kandinsky5", "qi": "qwen_image"}
"""musubi-tuner's architecture short name (in file names) -> full name (in the `architecture` metadata)."""
MUSUBI_ARCH_OF_FAMILY = {"AutoencoderKLWan": "wan", "AutoencoderKLHunyuanVideo": "hv"}
"""The default --arch per VAE family: Wan 2.1/2.2 and HunyuanVideo. FramePack trains on HunyuanVideo latents:
pass --arch fp. Other families (LTX, CogVideoX, image VAEs) have no musubi architecture: --arch is required."""
TAR_MTIME = 0.0
"""mtime of every tar member: tars do not change with the time of the export."""
SAMPLES_PER_TAR = 1000
BYTES_PER_TAR = 1 << 30
EXPORT_MANIFEST = "export.json"
EXPORT_INDEX = "index.jsonl"

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
_SAFE_DOTS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class ExportError(UsageError):
    """The cache cannot be exported as asked (DIR exists, no mean stored, no musubi architecture)."""


def safe_name(text: str, dots: bool = False) -> str:
    """`text` when it is a plain name ([A-Za-z0-9] then [A-Za-z0-9_-], '.' too with `dots` but never '..',
    at most 100 characters); otherwise a cleaned prefix, '~' and 12 hex digits of its sha256. Injective:
    a kept name holds no '~', and a mapped one is fixed by its hash."""
    pattern = _SAFE_DOTS if dots else _SAFE
    if pattern.fullmatch(text) and ".." not in text:
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-_")[:48] or "x"
    return f"{cleaned}~{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int32": "I32", "int64": "I64"}


def safetensors_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file with its header keys sorted: the same tensors give the same bytes in every process
    (safetensors' own writer orders metadata by hash map). Read back by safetensors itself."""
    import torch

    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    blobs, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype} is not exported")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote."""

    out: str
    format: str
    clips: int
    files: int
    bytes: int
    renamed: int
    """Names mapped by safe_name (see DIR/index.jsonl)."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as handle:  # "x": a name can never silently overwrite another
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A hidden sibling folder to write into; renamed to `target` when the block ends without error, removed
    when it raises. `target` must not exist."""
    target = Path(target)
    if target.exists():
        raise ExportError(f"{target}: already exists; export writes a new folder (remove it or choose another --out)")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"{target}: folder {parent} does not exist")
    staging = parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        yield staging
        for folder, _, files in os.walk(staging):
            fsync_dir(Path(folder))
        os.rename(staging, target)
        fsync_dir(parent)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputError(f"{target}: cannot write the export ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class _Index:
    """DIR/index.jsonl, streamed: one line per written name, with the clip (and camera) it holds."""

    def __init__(self, path: Path) -> None:
        self.handle = open(path, "x", encoding="utf-8")
        self.renamed = 0

    def add(self, **entry: Any) -> None:
        self.handle.write(json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()


def _source(cache: Any) -> dict[str, Any]:
    manifest = cache.manifest
    return {"cache": str(Path(cache.out).absolute()), "fingerprint_sha256": manifest.get("fingerprint_sha256"),
            "clips_sha256": (manifest.get("clips") or {}).get("sha256"), "format_version": manifest.get("format_version")}


def _finish(staging: Path, index: _Index, payload: dict[str, Any]) -> None:
    index.close()
    _write_file(staging / EXPORT_MANIFEST, json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n")


def musubi_arch(family: str, arch: str | None) -> tuple[str, str]:
    """(short, full) musubi architecture names for a VAE family, or for an explicit --arch."""
    short = arch or MUSUBI_ARCH_OF_FAMILY.get(family)
    if short is None:
        raise ExportError(f"a {family} cache has no musubi-tuner architecture of its own; pass --arch "
                          f"({', '.join(MUSUBI_ARCHITECTURES)})")
    if short not in MUSUBI_ARCHITECTURES:
        raise ExportError(f"--arch {short!r} is not a musubi-tuner architecture this export knows "
                          f"({', '.join(MUSUBI_ARCHITECTURES)})")
    return short, MUSUBI_ARCHITECTURES[short]


def musubi_item(scene: str, camera: str) -> str:
    """The musubi item name of one camera of a scene: musubi-tuner names latent and text-encoder caches after
    the basename of the video (item_key), so DIR/videos/<item>.<ext> links to that camera's source."""
    return safe_name(f"{scene}-{camera}")


def export_musubi(cache_dir: Path, target: Path, arch: str | None = None, verify: str = "size",
                  on_clip: Callable[[int, int], None] | None = None) -> ExportSummary:
    """Write musubi-tuner's latent cache for every clip and camera (see README, "Export to musubi-tuner")."""
    from vaecache.format.reader import LatentCache

    cache = LatentCache(cache_dir, verify=verify)
    vae = cache.manifest.get("vae") or {}
    short, full = musubi_arch(str(vae.get("family")), arch)
    if "mean" not in (cache.manifest.get("latent") or {}).get("store", []):
        raise ExportError(f"{cache_dir}: stores no posterior mean (--store sample); musubi-tuner caches the mean")
    spatial = int((cache.manifest.get("frame_rule") or {}).get("spatial_factor") or 0)
    if spatial < 1:
        raise ExportError(f"{cache_dir}: manifest.json records no frame_rule.spatial_factor (pixel size unknown)")
    files = size = 0
    sizes: set[tuple[int, int]] = set()
    counts: set[int] = set()
    buckets = [b for b in cache.manifest.get("buckets") or [] if b.get("clips")]
    musubi_buckets({(int(b["width"]), int(b["height"])) for b in buckets}, cache_dir)  # refuse before writing
    with _staging(target) as staging:
        (staging / "cache").mkdir()
        (staging / "videos").mkdir()
        index = _Index(staging / EXPORT_INDEX)
        videos = open(staging / "videos.jsonl", "x", encoding="utf-8")
        linked: set[str] = set()  # items of the current scene (clips of a scene are contiguous: sorted ids)
        scene_now = None
        for number, record in enumerate(cache.records(), 1):
            mean = cache.tensors_of(record)["mean"]
            caption = (record.get("metadata") or {}).get("caption")
            caption = caption if isinstance(caption, str) else ""
            if record["scene"] != scene_now:
                scene_now, linked = record["scene"], set()
            for view, camera in enumerate(record["cameras"]):
                latent = mean[view].contiguous()  # (C, F, H, W)
                _, frames_l, height_l, width_l = latent.shape
                width, height, count = width_l * spatial, height_l * spatial, len(record["frames"])
                sizes.add((width, height))
                counts.add(count)
                item = musubi_item(record["scene"], camera)
                name = f"{item}_{record['frames'][0]:05d}-{count:03d}_{width:04d}x{height:04d}_{short}.safetensors"
                dtype = str(latent.dtype).removeprefix("torch.")
                data = safetensors_bytes({f"latents_{frames_l}x{height_l}x{width_l}_{dtype}": latent},
                                         {"architecture": full, "width": str(width), "height": str(height),
                                          "frame_count": str(count), "format_version": MUSUBI_FORMAT_VERSION})
                _write_file(staging / "cache" / name, data)
                files, size = files + 1, size + len(data)
                renamed = item != f"{record['scene']}-{camera}"
                index.renamed += renamed
                index.add(clip=record["id"], scene=record["scene"], camera=camera, file=f"cache/{name}", item=item,
                          **({"renamed": True} if renamed else {}))
                if item not in linked:
                    linked.add(item)
                    source = record["sources"][view]
                    video = staging / "videos" / f"{item}{safe_suffix(source)}"
                    os.symlink(source, video)
                    final = Path(target).absolute() / "videos" / video.name
                    videos.write(json.dumps({"video_path": str(final), "caption": caption}, ensure_ascii=False) + "\n")
            del mean, latent
            if on_clip is not None:
                on_clip(number, len(cache))
        videos.flush()
        os.fsync(videos.fileno())
        videos.close()
        (staging / "dataset.toml").write_text(musubi_dataset_toml(Path(target).absolute(), sizes, counts))
        _finish(staging, index, {"format": "vaecache-export", "kind": "musubi", "architecture": short,
                                 "architecture_full": full, "source": _source(cache), "clips": len(cache),
                                 "files": files, "bytes": size, "renamed": index.renamed,
                                 "tensor": "posterior mean, (C, F, H, W), as stored"})
    return ExportSummary(str(target), "musubi", len(cache), files, size, index.renamed)


def safe_suffix(path: str) -> str:
    suffix = Path(path).suffix
    return suffix if re.fullmatch(r"\.[A-Za-z0-9]{1,8}", suffix) else ".mp4"


MUSUBI_RESOLUTION_STEP = 16
"""musubi-tuner's BucketSelector steps (every architecture): with bucket_no_upscale a size is floored to it."""


def musubi_buckets(sizes: set[tuple[int, int]], cache_dir: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """Pure: size (W, H) -> the bucket musubi-tuner's training puts its latents in, for a cache of several sizes
    (one size: its own). With `enable_bucket` and `bucket_no_upscale`, musubi floors a cached file's size to
    multiples of 16 when its area is at most `resolution`'s; two sizes flooring alike would be stacked into one
    batch, so they are refused, naming both."""
    step = MUSUBI_RESOLUTION_STEP
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for width, height in sorted(sizes):
        bucket = (width // step * step, height // step * step)
        if bucket in seen.values() and len(sizes) > 1:
            other = next(s for s, b in seen.items() if b == bucket)
            raise ExportError(f"{cache_dir}: sizes {other[0]}x{other[1]} and {width}x{height} fall into one "
                              f"musubi-tuner bucket ({bucket[0]}x{bucket[1]}: it floors sizes to multiples of {step}) "
                              "and would be stacked into one batch; export a cache whose sizes differ after that")
        seen[(width, height)] = bucket
    return seen


def musubi_dataset_toml(target: Path, sizes: set[tuple[int, int]], frames: set[int]) -> str:
    """A musubi-tuner dataset config over the export: captions from videos.jsonl, latents in cache/.

    musubi's training groups cached latents by the bucket its BucketSelector gives their file's size: one
    size is one bucket (enable_bucket off, resolution that size); several sizes need enable_bucket with
    bucket_no_upscale and the largest area as resolution, so that each size is its own bucket (musubi_buckets,
    checked before the export writes anything)."""
    width, height = max(sorted(sizes), key=lambda s: s[0] * s[1]) if sizes else (0, 0)
    several = len(sizes) > 1
    return (f"# Written by vaecache export: musubi-tuner's text-encoder caching and training read this.\n"
            f"[general]\nresolution = [{width}, {height}]\nbatch_size = 1\n"
            f"enable_bucket = {'true' if several else 'false'}\n"
            + ("bucket_no_upscale = true\n" if several else "")
            + f"\n[[datasets]]\nvideo_jsonl_file = {json.dumps(str(target / 'videos.jsonl'))}\n"
            f"cache_directory = {json.dumps(str(target / 'cache'))}\n"
            f"target_frames = [{', '.join(str(f) for f in sorted(frames))}]\nframe_extraction = \"head\"\n")


def webdataset_key(record: dict[str, Any]) -> str:
    """A sample's __key__: `<scene>_<first>-<last>` (a clip id's '/' cannot be in a key), mapped by safe_name
    without dots (webdataset splits a member name at its first '.')."""
    scene, _, window = str(record["id"]).rpartition("/")
    if scene == record.get("scene") and re.fullmatch(r"\d+-\d+", window):
        return f"{safe_name(scene)}_{window}"
    return safe_name(str(record["id"]))


def export_webdataset(cache_dir: Path, target: Path, verify: str = "size", samples_per_tar: int = SAMPLES_PER_TAR,
                      on_clip: Callable[[int, int], None] | None = None) -> ExportSummary:
    """Write WebDataset tars (shard-000000.tar, ...): one sample per clip, `latents.safetensors` (the clip's
    stored tensors: mean, logvar or sample, (cameras, C, F, H, W)) and `json` (its clip record)."""
    import webdataset

    from vaecache.format.reader import LatentCache

    cache = LatentCache(cache_dir, verify=verify)
    size = 0
    with _staging(target) as staging:
        index = _Index(staging / EXPORT_INDEX)
        tars: list[str] = []
        writer = webdataset.ShardWriter(str(staging / "shard-%06d.tar"), maxcount=samples_per_tar,
                                        maxsize=BYTES_PER_TAR, verbose=0, mtime=TAR_MTIME,
                                        post=lambda name: (_fsync_file(Path(name)), tars.append(Path(name).name)))
        try:
            for number, record in enumerate(cache.records(), 1):
                key = webdataset_key(record)
                data = safetensors_bytes(cache.tensors_of(record), {"clip": record["id"]})
                body = json.dumps(record, sort_keys=True, ensure_ascii=False).encode()
                writer.write({"__key__": key, "latents.safetensors": data, "json": body})
                tar = Path(writer.fname).name
                renamed = not key.startswith(f"{record['scene']}_")
                index.renamed += renamed
                index.add(clip=record["id"], key=key, tar=tar, **({"renamed": True} if renamed else {}))
                size += len(data) + len(body)
                if on_clip is not None:
                    on_clip(number, len(cache))
        finally:
            writer.close()
        _finish(staging, index, {"format": "vaecache-export", "kind": "webdataset", "source": _source(cache),
                                 "clips": len(cache), "shards": tars, "bytes": size, "renamed": index.renamed,
                                 "sample": {"latents.safetensors": "the clip's stored tensors by key (mean, logvar, "
                                            "sample), (cameras, C, F, H, W)", "json": "the clip record"}})
    return ExportSummary(str(target), "webdataset", len(cache), len(tars), size, index.renamed)


__all__ = ["EXPORT_FORMATS", "ExportError", "ExportSummary", "MUSUBI_ARCHITECTURES", "export_musubi",
           "export_webdataset", "safe_name", "safetensors_bytes", "webdataset_key"]
