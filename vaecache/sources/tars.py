"""The WebDataset layout: DATA is a `.tar` shard, a folder of `.tar` shards, or a brace pattern naming them
(`shards/data-{000000..000999}.tar`), as webdataset and video2dataset write them.

Samples are grouped as webdataset groups them (webdataset/tariterators.py): a member's key is its name up to the
first dot of its file name and its suffix the rest, lower-cased (`base_plus_ext`); consecutive members with one key
are one sample (`group_by_keys`); `__*__` members and non-regular entries are skipped (`tar_file_iterator`).
A sample's `key.mp4` (any video extension) makes a single-camera scene with id `key`; `key.<camera>.mp4` members make
a multi-camera scene; `key.json` (an object: its keys) and `key.txt` (as `caption`) become the scene's metadata.
A key found in several shards (writers that number each shard's samples from 0) has its shard's name as a prefix
(`data-000001.tar~000000`); a shard whose members do not account for its bytes is a recorded skip after its good
samples.

Each video is read in place (vaecache.video.members: `TAR#NAME@OFFSET+SIZE`): listing a shard reads its headers and
its small json/txt members, never a video's bytes, and nothing is extracted to disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from vaecache.errors import CaptionError, DatasetError, TarShardError
from vaecache.sources.braces import expand_braces, is_brace_pattern
from vaecache.sources.scene import SINGLE_CAMERA, LayoutScenes, Scene, Skipped, SourceOptions
from vaecache.storage import open_url, url_stat
from vaecache.urls import is_url
from vaecache.video.frames import VIDEO_EXTENSIONS, natural_key
from vaecache.video.members import TarMember

log = logging.getLogger("vaecache")

_KEY_AND_SUFFIX = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""webdataset's base_plus_ext: the key is the name up to the first dot of its file name, the suffix all the rest."""
_META = re.compile(r"__[^/]*__($|/)")
"""webdataset's tar_file_iterator skip_meta."""
_VIDEO_SUFFIXES = tuple(extension.lstrip(".") for extension in VIDEO_EXTENSIONS)
MAX_TEXT_MEMBER = 16 << 20
"""A json or txt member larger than this is not read as metadata (it would be a mistake, and memory): its sample is a
recorded skip naming the member."""


@dataclass
class Sample:
    """One WebDataset sample: its key and members (suffix -> member), where it was found."""

    key: str
    tar: str
    members: dict[str, TarMember] = field(default_factory=dict)
    duplicate: str | None = None


def shard_paths(data: Path) -> list[Path] | None:
    """DATA's shards, in order, or None when DATA is not shards: a .tar file, a folder holding .tar files (naturally
    ordered by name), or a brace pattern (every name it expands to must exist)."""
    text = str(data)
    if is_brace_pattern(text) and not data.exists():
        try:
            names = expand_braces(text)
        except ValueError as exc:
            raise DatasetError(f"{data}: {exc}") from None
        if not all(name.lower().endswith(".tar") for name in names):
            return None
        missing = [name for name in names if not _is_file(name)]
        if missing:
            raise DatasetError(f"{data}: shard {missing[0]} does not exist ({len(missing)} of {len(names)} missing)")
        if is_url(text):
            from vaecache.sources.urlpath import UrlPath

            return [UrlPath(name) for name in names]  # type: ignore[misc]
        return [Path(name) for name in names]
    if data.is_file():
        return [data] if data.suffix.lower() == ".tar" else None
    if data.is_dir():
        shards = sorted((p for p in data.iterdir() if p.suffix.lower() == ".tar" and p.is_file()
                         and not p.name.startswith(".")), key=lambda p: natural_key(p.name))
        return shards or None
    return None


def _is_file(name: str) -> bool:
    if not is_url(name):
        return os.path.isfile(name)
    try:
        url_stat(name)
    except OSError:
        return False
    return True


HEADER_BLOCK = 1 << 16
"""Bytes per ranged GET while a tar at a URL is listed: a header, and the next ones where members are small."""


def _open_shard(tar: Path) -> Any:
    """A shard as a seekable binary file: a local file, or an object read by ranged GETs of HEADER_BLOCK."""
    if isinstance(tar, Path):
        return open(tar, "rb")
    return open_url(str(tar), HEADER_BLOCK)


def read_samples(tar: Path) -> Iterator[Sample]:
    """The samples of one shard, in order (webdataset's grouping; see the module docstring)."""
    name = str(tar.resolve())
    with contextlib.ExitStack() as opened:
        try:  # a tar at a URL: tarfile reads one header after another, each by a small ranged GET
            archive = tarfile.open(tar, "r:") if isinstance(tar, Path) else \
                tarfile.open(fileobj=opened.enter_context(_open_shard(tar)), mode="r:")
        except (tarfile.TarError, OSError) as exc:
            raise DatasetError(f"{tar}: not a readable uncompressed tar ({exc})") from None
        yield from _samples(tar, name, archive)


def _samples(tar: Path, name: str, archive: tarfile.TarFile) -> Iterator[Sample]:
    """The shard's samples; TarShardError after the last good one when its members do not account for its bytes
    (the sample listed last is then left out with the rest: its own header may be the wrong one)."""
    current: Sample | None = None
    with archive:
        while True:
            try:
                info = archive.next()
            except (tarfile.TarError, OSError) as exc:  # a size past the end, or a header tarfile refuses
                raise _damaged(name, archive.offset, current, f"its listing stops at byte {archive.offset} ({exc}: "
                               "cut short, or a header's size field too large)") from None
            if info is None:
                stray = _nonzero_after(archive.fileobj, archive.offset)
                if stray is not None:  # tarfile ends a listing silently at a block that is not a header
                    raise _damaged(name, archive.offset, current, f"its members end at byte {archive.offset}, but "
                                   f"byte {stray} is neither a header nor the end-of-archive marker (a header's "
                                   "size field too small, or bytes that are no member)")
                break
            archive.members = []  # streaming: keep no list of a million headers
            if not info.isreg() or ("/" not in info.name and info.name.startswith("__") and info.name.endswith("__")):
                continue
            if _META.match(info.name):
                continue
            found = _KEY_AND_SUFFIX.match(info.name)
            if found is None:
                continue
            key, suffix = found.group(1), found.group(2).lower()
            if current is None or key != current.key:
                if current is not None:
                    yield current
                current = Sample(key, name)
            if suffix in current.members:
                current.duplicate = current.duplicate or suffix
                continue
            current.members[suffix] = TarMember(name, info.name, info.offset_data, info.size)
    if current is not None:
        yield current


def _damaged(name: str, offset: int, last: Sample | None, reason: str) -> TarShardError:
    lost = f"sample {last.key!r} and any after it are skipped" if last is not None else "no sample is read"
    return TarShardError(name, offset, f"{reason}: {lost}")


def _nonzero_after(handle: Any, offset: int) -> int | None:
    """The first byte from `offset` to the end of the file that is not zero, or None: past its last member a tar
    holds only its end-of-archive marker and zero padding (reads the tail, a block at a time at a URL)."""
    handle.seek(offset)
    while chunk := handle.read(HEADER_BLOCK):
        rest = chunk.lstrip(b"\0")
        if rest:
            return offset + len(chunk) - len(rest)
        offset += len(chunk)
    return None


def _text(member: TarMember, handle: Any) -> str:
    """A json or txt member's text; CaptionError naming the member when it is too large or not UTF-8."""
    if member.size > MAX_TEXT_MEMBER:
        raise CaptionError(member.reference, f"its member {member.name} is {member.size} bytes, more than a json "
                                             f"or txt member may have ({MAX_TEXT_MEMBER})")
    handle.seek(member.offset)
    try:
        return handle.read(member.size).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CaptionError(member.reference, f"its member {member.name} is not UTF-8 text (byte {exc.start})") \
            from None


def shard_names(shards: list[Path]) -> list[str]:
    """Each shard's name relative to the folder holding all of them (`data-000001.tar`; `a/s-8.tar` for a pattern
    over folders): the same whatever the working directory, and for a folder or a pattern naming its shards."""
    folders = [str(shard).split("/")[:-1] for shard in shards]
    common = 0
    while all(len(folder) > common for folder in folders) and len({folder[common] for folder in folders}) == 1:
        common += 1
    return ["/".join(str(shard).split("/")[common:]) for shard in shards]


def _plain_id(key: str) -> str:
    """A sample's scene id where its key is unique: a key with folders (`videos/k1`, `./k1`) with '~' for '/'."""
    return posixpath.normpath(key).replace("/", "~")


def scenes_from_shards(data: Path, options: SourceOptions) -> LayoutScenes:
    shards = shard_paths(data)
    if not shards:
        raise DatasetError(f"{data}: holds no .tar shards")
    order = options.cameras
    found: list[tuple[int, str, Scene | Skipped]] = []  # (shard, plain id, scene or skipped sample)
    holders: dict[str, set[int]] = {}  # plain id -> the shards with a sample of that key
    camera_sets: list[set[str]] = []
    rejected: list[Skipped] = []
    qualifiers = shard_names(shards)
    form: str | None = None  # "single" (key.mp4) or "cameras" (key.<camera>.mp4), from the first sample with video
    for number, tar in enumerate(shards):
        try:
            handle = _open_shard(tar)
        except OSError as exc:
            raise DatasetError(f"{tar}: cannot read the shard ({exc.strerror or exc})") from None
        with handle:
            try:
                for sample in read_samples(tar):
                    plain = _plain_id(sample.key)
                    holders.setdefault(plain, set()).add(number)
                    scene, problem, names = _scene(sample, handle, order, form)
                    if problem is not None:
                        found.append((number, plain, Skipped(sample.key, f"{sample.tar}#{sample.key}", problem)))
                        continue
                    assert scene is not None
                    form = form or ("cameras" if names else "single")
                    if names:
                        camera_sets.append(names)
                    found.append((number, plain, scene))
            except TarShardError as exc:  # the samples before the damage go on
                rejected.append(Skipped(qualifiers[number].replace("/", "~"), exc.shard, exc.reason, incomplete=True))
    # Keys repeated across shards (a writer that numbers each shard's samples from 0) get the shard as a prefix
    scenes: list[Scene] = []
    for number, plain, item in found:
        if len(holders[plain]) > 1:
            qualified = qualifiers[number].replace("/", "~") + "~" + plain
            item = (dataclasses.replace(item, scene_id=qualified) if isinstance(item, Scene) else
                    Skipped(qualified, item.path, item.reason, item.camera))
        if isinstance(item, Scene):
            scenes.append(item)
        else:
            rejected.append(item)
    if not scenes:
        raise DatasetError(f"{data}: the shards hold no video samples ({len(rejected)} sample(s) without a usable "
                           "video)")
    log.info("WebDataset %s: %d samples with video in %d shard(s)", data, len(scenes), len(shards))
    return LayoutScenes(scenes, camera_sets, rejected)


def _scene(sample: Sample, handle: Any, order: tuple[str, ...] | None,
           form: str | None) -> tuple[Scene | None, str | None, set[str]]:
    """(scene, None, its camera names) or (None, why not, ...)."""
    if sample.duplicate is not None:
        return None, f"the sample has two members with suffix {sample.duplicate!r}", set()
    videos = {suffix: member for suffix, member in sample.members.items()
              if suffix.rpartition(".")[2] in _VIDEO_SUFFIXES}
    if not videos:
        return None, "the sample holds no video member (" + ", ".join(sorted(sample.members)) + ")", set()
    single = [suffix for suffix in videos if "." not in suffix]
    if single and len(videos) > 1:
        return None, f"the sample has both a plain video ({single[0]}) and camera videos; give one or the other", set()
    if form is not None and (form == "single") != bool(single):
        return None, ("a single video (key.mp4) among multi-camera samples (key.<camera>.mp4)" if single else
                      "camera videos (key.<camera>.mp4) among single-video samples (key.mp4)"), set()
    metadata: dict[str, Any] = {}
    try:
        if "json" in sample.members:
            try:
                value = json.loads(_text(sample.members["json"], handle))
            except json.JSONDecodeError as exc:
                return None, f"its json member is not valid JSON ({exc.msg})", set()
            if isinstance(value, dict):
                metadata.update(value)
            elif value is not None:
                metadata["json"] = value
        if "txt" in sample.members:
            metadata["caption"] = _text(sample.members["txt"], handle).strip()
        text = json.dumps(metadata, sort_keys=True, ensure_ascii=False, separators=(",", ":")) if metadata else None
    except CaptionError as exc:
        return None, exc.reason, set()
    except RecursionError:  # json nests deeper than the interpreter's recursion limit: one sample, not the run
        return None, f"its json member {sample.members['json'].name} is nested too deeply", set()
    if single:
        camera = (order[0] if order else SINGLE_CAMERA,)
        if order and len(order) != 1:
            return None, f"a single video, but {len(order)} cameras were configured (--cameras)", set()
        paths: tuple[str | None, ...] = (videos[single[0]].reference,)
        names: set[str] = set()
    else:  # suffixes are lower-cased (as webdataset does): --cameras matches them whatever its case
        by_camera = {suffix.rpartition(".")[0]: member for suffix, member in videos.items()}
        spelled = {name.lower(): name for name in order or ()}
        names = {spelled.get(name, name) for name in by_camera}
        camera = tuple(order) if order else tuple(sorted(by_camera))
        paths = tuple(by_camera[name.lower()].reference if name.lower() in by_camera else None for name in camera)
    try:
        return Scene(_plain_id(sample.key), camera, paths, metadata=text), None, names
    except DatasetError as exc:
        return None, str(exc), set()


class WebDatasetShards:
    """.tar shards of videos (a file, a folder of them, or a brace pattern)."""

    name = "webdataset"
    reference_camera = None

    def matches(self, data: Path) -> bool:
        try:
            return shard_paths(data) is not None
        except DatasetError:
            return True  # a pattern with a missing shard: scenes() says which

    def scenes(self, data: Path, options: SourceOptions) -> LayoutScenes:
        return scenes_from_shards(data, options)


WEBDATASET = WebDatasetShards()
