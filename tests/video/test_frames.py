"""Image-sequence cameras: frame-exact against a lossless RGB video of the same frames, frame times from every
source they may come from, and bad frames refused naming the file."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from tests.videos import frame_pixels
from vaecache.errors import FrameBudgetError, VideoDecodeError
from vaecache.video.frames import FrameList, FrameSequence, natural_key, parse_timestamp, times_from_names
from vaecache.video.reader import VideoReader


def write_frames(folder: Path, count: int, suffix: str = ".png", height: int = 32, width: int = 48,
                 names: list[str] | None = None, first: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = folder / (names[index] if names else f"{index:04d}{suffix}")
        Image.fromarray(frame_pixels(first + index, height, width)).save(path, quality=90)
        paths.append(path)
    return paths


def write_lossless(path: Path, frames: list[np.ndarray], fps: int = 10, start_ms: int = 0) -> Path:
    """An RGB H.264 (qp 0) Matroska video of `frames` whose first frame is shown at `start_ms`: its pixels decode
    back exactly, its timestamps keep the offset."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264rgb", rate=fps, options={"qp": "0", "preset": "ultrafast"})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "rgb24"
        stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        for index, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            frame.pts, frame.time_base = start_ms + index * 1000 // fps, stream.time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_a_png_folder_reads_exactly_the_frames_of_a_lossless_video_of_them(tmp_path):
    files = write_frames(tmp_path / "cam", 12)
    arrays = [np.asarray(Image.open(f).convert("RGB")) for f in files]
    video = write_lossless(tmp_path / "cam.mkv", arrays)
    with FrameSequence(str(tmp_path / "cam"), fps=10) as images, VideoReader(str(video)) as reader:
        assert len(images) == len(reader) == 12
        for frames in ([0, 1, 2], [3, 5, 7, 9], [11]):
            assert np.array_equal(images.read(frames), reader.read(frames))
        assert images.timestamps([0, 4]) == reader.timestamps([0, 4]) == [0.0, 0.4]


def test_jpeg_frames_decode_as_pillow_decodes_them(tmp_path):
    files = write_frames(tmp_path / "cam", 3, ".jpg")
    with FrameSequence(str(tmp_path / "cam")) as images:
        assert images.codec == "jpeg"
        assert np.array_equal(images.read([1]), np.asarray(Image.open(files[1]).convert("RGB"))[None])
        assert images.fps() == 0.0 and images.timestamps([0]) is None  # no rate given, none in the names


def test_frames_are_ordered_by_name_naturally(tmp_path):
    names = ["frame_10.png", "frame_2.png", "frame_1.png"]
    write_frames(tmp_path / "cam", 3, names=names)
    with FrameSequence(str(tmp_path / "cam")) as images:
        assert [Path(f).name for f in images.files] == ["frame_1.png", "frame_2.png", "frame_10.png"]
    assert sorted(["a10", "a9", "a09b"], key=natural_key) == ["a9", "a09b", "a10"]


def test_exif_orientation_is_applied(tmp_path):
    array = frame_pixels(3, 32, 48)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    folder = tmp_path / "cam"
    folder.mkdir()
    Image.fromarray(array).save(folder / "0.png", exif=exif.tobytes())
    with FrameSequence(str(folder)) as images:
        assert images.frame_size == (32, 48)
        assert np.array_equal(images.read([0])[0], np.rot90(array, k=-1))


def test_frame_times_come_from_a_timestamps_file_or_the_names(tmp_path):
    folder = tmp_path / "image_02" / "data"
    write_frames(folder, 3)
    (tmp_path / "image_02" / "timestamps.txt").write_text(
        "2011-09-26 13:02:25.964389445\n2011-09-26 13:02:26.068389445\n2011-09-26 13:02:26.172389445\n")
    with FrameSequence(str(folder)) as images:  # KITTI: timestamps.txt beside a `data` folder
        assert images.timestamps([0, 1, 2]) == pytest.approx([0.0, 0.104, 0.208])
        assert images.fps() == pytest.approx(1 / 0.104)
    names = [f"n015__CAM_FRONT__15324029276{i}2460.jpg" for i in range(3)]  # nuScenes: microseconds
    assert times_from_names(names) == [1532402927602460000, 1532402927612460000, 1532402927622460000]
    assert times_from_names(["0000000001.png"]) is None  # a frame number, not a time
    assert parse_timestamp("12.5", "x") == 12_500_000_000


def test_a_bad_frame_is_refused_naming_its_file(tmp_path):
    files = write_frames(tmp_path / "cam", 3)
    Image.fromarray(frame_pixels(0, 16, 16)).save(files[1])
    with FrameSequence(str(tmp_path / "cam")) as images:
        with pytest.raises(VideoDecodeError, match="mixed sizes") as error:
            images.read([0, 1])
        assert error.value.path == str(files[1])
    files[2].write_bytes(files[2].read_bytes()[:60])
    with FrameSequence(str(tmp_path / "cam")) as images, pytest.raises(VideoDecodeError, match="not a readable"):
        images.read([2])
    deep = tmp_path / "deep"
    deep.mkdir()
    Image.fromarray(np.full((8, 8), 40000, np.uint16)).save(deep / "0.png")
    with FrameSequence(str(deep)) as images, pytest.raises(VideoDecodeError, match="16-bit"):
        images.read([0])


def test_an_empty_folder_and_backwards_times_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(VideoDecodeError, match="no image frames"):
        FrameSequence(str(tmp_path / "empty"))
    files = write_frames(tmp_path / "cam", 2)
    listed = FrameList("rig#cam", tuple(map(str, files)), (200, 100))
    with pytest.raises(VideoDecodeError, match="not after the previous"):
        FrameSequence(listed)


def write_huge_png(path: Path, width: int = 20000, height: int = 20000) -> Path:
    """A real 1-bit greyscale PNG of width x height black pixels, written chunk by chunk (compressed zeros: ~50 KB
    on disk, fast), without holding the image: Pillow would need width x height bytes to make it."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row = zlib.compressobj(9), b"\0" * (1 + (width + 7) // 8)  # filter byte 0, then the packed bits
    pixels = b"".join(packer.compress(row * 1000) for _ in range(height // 1000))
    pixels += packer.compress(row * (height % 1000)) + packer.flush()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


def test_a_frame_over_the_pixel_budget_is_refused_from_its_header_never_a_decompression_bomb(tmp_path, monkeypatch):
    from PIL import PngImagePlugin

    huge = write_huge_png(tmp_path / "first" / "0000.png")  # 400 MP: Pillow's own check raises past 179 MP
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # to look at it here (vaecache lifts it when it opens one)
    with Image.open(huge) as image:
        assert image.size == (20000, 20000) and image.mode == "1"  # a real PNG
    write_frames(tmp_path / "first", 2, first=1, names=["0001.png", "0002.png"])

    def no_decoding(image):
        raise AssertionError("the pixels of an oversized frame were decoded")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", no_decoding)
    with FrameSequence(str(tmp_path / "first")) as probed:  # a probe: the size, for planning to judge
        assert probed.frame_size == (20000, 20000) and probed.codec == "png"
    with pytest.raises(FrameBudgetError, match="20000x20000 .* exceed the decode budget") as error:
        FrameSequence(str(tmp_path / "first"), max_pixels=8192 * 8192)
    assert error.value.path == str(huge)
    monkeypatch.undo()
    write_frames(tmp_path / "later", 2)
    huge = write_huge_png(tmp_path / "later" / "0002.png")
    with FrameSequence(str(tmp_path / "later"), max_pixels=8192 * 8192) as images:
        assert images.read([0, 1]).shape == (2, 32, 48, 3)
        with pytest.raises(FrameBudgetError, match="exceed the decode budget") as error:
            images.read([1, 2])
        assert error.value.path == str(huge)


def test_an_image_dataset_with_a_huge_frame_records_it_and_encodes_the_rest(tmp_path):
    from tests.conftest import invoke, read_clips, read_failures

    write_frames(tmp_path / "data" / "fine", 5)
    write_huge_png(tmp_path / "data" / "huge" / "0000.png")  # refused from the probe: never decoded
    write_frames(tmp_path / "data" / "huge", 4, first=1, names=[f"{i:04d}.png" for i in range(1, 5)])
    write_frames(tmp_path / "data" / "late", 4)
    write_huge_png(tmp_path / "data" / "late" / "0004.png")  # planned from the first frame, refused at decode
    result = invoke(["encode", tmp_path / "data", "--out", tmp_path / "out", "--vae", "builtin:tiny", "--num-frames",
                     "5", "--size", "32x48", "--workers", "0", "--no-progress"])
    assert result.exit_code == 3, result.output
    reasons = {failure["scene"]: failure["reason"] for failure in read_failures(tmp_path / "out")}
    assert set(reasons) == {"huge", "late"}
    assert all(reason.startswith("frames of 20000x20000 (400,000,000 pixels) exceed the decode budget")
               for reason in reasons.values())
    assert [record["scene"] for record in read_clips(tmp_path / "out")] == ["fine"]
