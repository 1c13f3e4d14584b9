"""Metadata tables (.csv, .tsv, .parquet) as DATA: clip ranges in seconds or frames, Panda-70M's list of ranges with
captions aligned to it, --column, and the same ranges given as frames in a JSONL index giving identical latents."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import ENCODE_ARGS, assert_same_tensors, invoke, load_tensors, read_clips, read_failures
from tests.videos import LAYOUTS, write_video
from vaecache.errors import DatasetError, UsageError
from vaecache.settings.options import parse_columns
from vaecache.sources.discover import discover
from vaecache.sources.probing import frames_in_time
from vaecache.sources.scene import CameraProbe, SourceOptions
from vaecache.sources.tables import parse_seconds, scenes_from_table
from vaecache.video.reader import VideoReader


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("table-videos")
    write_video(root / "videos" / "a.mp4", LAYOUTS["h264-open-gop"], frames=72, height=48, width=64, fps=24)
    write_video(root / "videos" / "b.mkv", LAYOUTS["h264-mkv"], frames=60, height=48, width=64, fps=24)
    return root


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_time_strings_and_column_roles():
    assert parse_seconds("0:00:07.341", "t") == pytest.approx(7.341)
    assert parse_seconds("1:02.5", "t") == pytest.approx(62.5) and parse_seconds(3, "t") == 3.0
    assert parse_seconds("12.25", "t") == 12.25
    for bad in ("0:61:00", "-1", "abc", "1:2:3:4", True, None):
        with pytest.raises(DatasetError, match="a time must be"):
            parse_seconds(bad, "table.csv:3")
    assert parse_columns("path=video_path, ranges=timestamp") == (("path", "video_path"), ("ranges", "timestamp"))
    assert parse_columns(["id=videoID"]) == (("id", "videoID"),)
    with pytest.raises(UsageError, match="unknown role 'clip'"):
        parse_columns("clip=x")
    with pytest.raises(UsageError, match="ROLE=COLUMN"):
        parse_columns("path")


def test_a_frame_is_in_a_range_by_its_time_at_millisecond_precision():
    probe = CameraProbe(300, 29.97, 64, 48, "h264", 1, 1, 0, 0, round(299 * 1e9 * 1001 / 30000))
    # frame 220 is at 7.3407 s: Panda-70M writes the cut there as 0:00:07.341; it starts the later range
    assert frames_in_time((0, 7_341_000_000), probe) == (0, 220)
    assert frames_in_time((7_341_000_000, 9_000_000_000), probe) == (220, 270)
    assert frames_in_time((9_000_000_000, 20_000_000_000), probe) == (270, 300)
    assert frames_in_time((20_000_000_000, 21_000_000_000), probe) == (300, 300)  # past the end: no frame


def test_a_real_video_s_frames_are_chosen_by_their_presentation_times(videos):
    for name in ("a.mp4", "b.mkv"):
        path = videos / "videos" / name
        with VideoReader(str(path)) as reader:
            times = [t - reader.times_ns()[0] for t in reader.times_ns()]
            probe = CameraProbe(len(reader), reader.fps(), 64, 48, "h264", 1, 1, 0, reader.times_ns()[0],
                                reader.times_ns()[-1])
        for start, end in ((0.5, 2.0), (1.0, 2.4), (0.0, 0.3)):
            wanted = [i for i, t in enumerate(times) if start * 1e9 - 5e5 <= t < end * 1e9 - 5e5]
            assert frames_in_time((round(start * 1e9), round(end * 1e9)), probe) == (wanted[0], wanted[-1] + 1), name


def test_a_csv_and_a_parquet_table_give_the_latents_of_the_same_ranges_as_frames(videos, tmp_path):
    table = write_csv(videos / "clips.csv", [
        {"path": "videos/a.mp4", "start": "0.5", "end": "2.0", "caption": "a red car"},
        {"path": "videos/a.mp4", "start": "0:00:01.000", "end": "0:00:02.500", "caption": "a blue car"},
        {"path": "videos/b.mkv", "start": "", "end": "", "caption": "the whole of b"},
    ])
    panda = videos / "panda.parquet"
    pq.write_table(pa.table({
        "video_path": ["videos/a.mp4", "videos/b.mkv"],
        "timestamp": [[["0:00:00.500", "0:00:02.000"], ["0:00:01.000", "0:00:02.500"]],
                      [["0:00:00.000", "0:00:02.500"]]],
        "caption": [["a red car", "a blue car"], ["the whole of b"]],
        "matching_score": [[0.5, 0.25], [0.75]],
        "url": ["https://example.com/a", "https://example.com/b"],
    }), panda)
    frames = {"videos~a.mp4@0.500-2.000": [12, 48], "videos~a.mp4@1.000-2.500": [24, 60]}
    index = videos / "frames.jsonl"
    index.write_text("".join(json.dumps({"id": scene, "path": "videos/a.mp4", "frames": span}) + "\n"
                             for scene, span in frames.items()))
    for data, out, extra in ((table, "csv", ()), (index, "jsonl", ()),
                             (panda, "panda", ("--column", "path=video_path"))):
        result = invoke(["encode", data, "--out", tmp_path / out, *ENCODE_ARGS, *extra])
        assert result.exit_code == 0, result.output
    from_table, from_index = load_tensors(tmp_path / "csv"), load_tensors(tmp_path / "jsonl")
    assert_same_tensors({k: v for k, v in from_table.items() if not k.startswith("videos~b")}, from_index)
    records = {r["id"]: r for r in read_clips(tmp_path / "csv")}
    assert {r["metadata"]["caption"] for r in records.values()} == {"a red car", "a blue car", "the whole of b"}
    assert sorted({r["id"].split("/")[0] for r in records.values()}) == [*frames, "videos~b.mkv"]
    panda_records = read_clips(tmp_path / "panda")
    by_scene = {r["id"].split("/")[0]: r["metadata"] for r in panda_records}
    assert by_scene["videos~a.mp4@1.000-2.500"] == {"caption": "a blue car", "matching_score": 0.25,
                                                     "url": "https://example.com/a"}
    panda_tensors = load_tensors(tmp_path / "panda")
    assert_same_tensors({k: v for k, v in panda_tensors.items() if not k.startswith("videos~b")}, from_index)
    checked = invoke(["verify", tmp_path / "panda", "--dataset", panda])  # the recorded --column reads it again
    assert checked.exit_code == 0, checked.output


def test_a_panda_csv_with_python_list_cells_and_named_ids(videos, tmp_path):
    table = write_csv(videos / "panda.csv", [
        {"videoID": "abc", "url": "u", "path": "videos/a.mp4",
         "timestamp": "[['0:00:00.500', '0:00:02.000'], ['0:00:01.000', '0:00:02.500']]",
         "caption": "['a red car', \"a car's wheel\"]", "matching_score": "[0.5, 0.25]"},
    ])
    scenes = discover(table, options=SourceOptions(columns=parse_columns("id=videoID"))).scenes
    assert [s.scene_id for s in scenes] == ["abc@0.500-2.000", "abc@1.000-2.500"]
    assert [json.loads(s.metadata) for s in scenes] == [
        {"caption": "a red car", "matching_score": 0.5, "url": "u"},
        {"caption": "a car's wheel", "matching_score": 0.25, "url": "u"}]
    assert scenes[0].time_range == (500_000_000, 2_000_000_000) and scenes[0].paths[0].endswith("videos/a.mp4")


def test_ranges_in_frames_a_tsv_and_an_index_written_from_a_table(videos, tmp_path):
    table = write_csv(videos / "frames.tsv", [{"path": "videos/a.mp4", "start_frame": "12", "end_frame": "48"},
                                              {"path": "videos/a.mp4", "start_frame": "24", "end_frame": "60"}],
                      delimiter="\t")
    assert [s.scene_id for s in discover(table).scenes] == ["videos~a.mp4@f12-48", "videos~a.mp4@f24-60"]
    seconds = write_csv(videos / "seconds.csv", [{"path": "videos/a.mp4", "start": "0.5", "end": "2.0"}])
    index = tmp_path / "index.jsonl"
    assert invoke(["index", seconds, "-o", index, "--no-progress"]).exit_code == 0
    line = json.loads(index.read_text())
    assert line["seconds"] == [0.5, 2.0] and line["id"] == "videos~a.mp4@0.500-2.000" and "probe" in line
    for data, out in ((seconds, "table"), (index, "index")):
        assert invoke(["encode", data, "--out", tmp_path / out, *ENCODE_ARGS]).exit_code == 0
    assert_same_tensors(load_tensors(tmp_path / "table"), load_tensors(tmp_path / "index"))
    assert [r["frames"][0] for r in read_clips(tmp_path / "table")][:1] == [12]


def test_table_mistakes_name_the_table_and_the_row(videos, tmp_path):
    def refused(rows, match, *extra):
        table = write_csv(tmp_path / "t.csv", rows)
        result = invoke(["encode", table, "--out", tmp_path / "out", *ENCODE_ARGS, *extra])
        assert result.exit_code == 2 and match in result.output, result.output
        assert str(table) in result.output and not (tmp_path / "out").exists()

    refused([{"video": "videos/a.mp4"}], 'no "path" column')
    refused([{"video": "videos/a.mp4"}], "no column 'clip_path'", "--column", "path=clip_path")
    refused([{"path": "a.mp4", "start": "1.0", "end": ""}], "needs both 'start' and 'end'")
    refused([{"path": "a.mp4", "start": "2.0", "end": "1.0"}], "t.csv:2: a clip range needs start < end")
    refused([{"path": "a.mp4", "start": "x", "end": "1.0"}], "t.csv:2: a time must be")
    refused([{"path": "a.mp4", "start_frame": "5", "end_frame": "5"}], "0 <= start_frame < end_frame")
    refused([{"path": "", "start": "0", "end": "1"}], "t.csv:2: the path column 'path' is empty")


def test_a_csv_mistake_names_the_line_its_cell_is_on(tmp_path):
    def refused(text: str, match: str) -> None:
        table = tmp_path / "t.csv"
        table.write_bytes(text.encode())
        with pytest.raises(DatasetError) as error:
            scenes_from_table(table, SourceOptions())
        assert f"{table}:{match}" in str(error.value), str(error.value)

    refused("path,start,end\na.mp4," + "9" * 200_000 + ",2\n", "2: not a valid CSV row (field larger")  # csv.Error
    refused("path,start,end\na.mp4,0,1\nb.mp4," + "9" * 200_000 + ",2\n", "3: not a valid CSV row")
    refused('path,start,end,caption\na.mp4,x,1,"two\nlines"\n', "2: a time must be")  # the row ends on line 3
    refused('path,caption,start,end\na.mp4,"two\r\nlines",x,1\n', "3: a time must be")  # its cell is on line 3
    refused('path,caption,end\n\na.mp4,"a\rb",1\n', "4: a clip range needs both")  # a blank line, a lone \r
    refused('path,caption,start,end\na.mp4,"two\nlines",0,1\nb.mp4,x,0,x\n', "4: a time must be")
    refused('path,caption,start,end\na.mp4,"two\nlines",0,1,extra\n', "3: more cells than the header")
    refused('path,caption\n"",x\n', "2: the path column 'path' is empty")


def test_a_range_past_the_end_of_its_video_is_a_recorded_failure(videos, tmp_path):
    table = write_csv(videos / "late.csv", [{"path": "videos/a.mp4", "start": "0.0", "end": "1.0"},
                                            {"path": "videos/a.mp4", "start": "10.0", "end": "11.0"}])
    result = invoke(["encode", table, "--out", tmp_path / "out", *ENCODE_ARGS])
    assert result.exit_code == 3, result.output
    (failure,) = read_failures(tmp_path / "out")
    assert failure["scene"] == "videos~a.mp4@10.000-11.000" and "holds no frame of the video" in failure["reason"]


def test_paths_written_with_dots_dates_and_a_plain_timestamp_column(videos, tmp_path):
    import datetime

    table = write_csv(videos / "dots.csv", [{"path": "./videos/a.mp4", "timestamp": "2021-01-01"},
                                            {"path": "videos/../videos/b.mkv", "timestamp": "2021-02-03"}])
    scenes = discover(table).scenes
    assert [s.scene_id for s in scenes] == ["videos~a.mp4", "videos~b.mkv"]
    assert json.loads(scenes[0].metadata) == {"timestamp": "2021-01-01"}  # not Panda's ranges: metadata
    parquet = videos / "dated.parquet"
    pq.write_table(pa.table({"path": ["../" + videos.name + "/videos/a.mp4"],
                             "recorded": [datetime.datetime(2024, 5, 1, 12, 30)]}), parquet)
    (scene,) = discover(parquet).scenes
    assert scene.scene_id == f"^~{videos.name}~videos~a.mp4"
    assert json.loads(scene.metadata) == {"recorded": "2024-05-01 12:30:00"}


def test_the_ranges_of_one_video_open_it_once(videos, monkeypatch):
    import vaecache.sources.probing as probing

    opened = []
    real = probing.probe_file
    monkeypatch.setattr(probing, "probe_file",
                        lambda source, rate=None, held=None: opened.append(source) or real(source, rate, held))
    table = write_csv(videos / "many.csv", [{"path": "videos/a.mp4", "start": str(s), "end": str(s + 0.5)}
                                            for s in (0.0, 0.5, 1.0, 1.5, 2.0)])
    scenes = discover(table).scenes
    probes = probing.probe_dataset(scenes, workers=1).probes
    assert len(probes) == 5 and all(p.error is None for p in probes.values()) and len(opened) == 1
    opened.clear()
    probing.probe_dataset(scenes, workers=2)  # threads: only the scenes already in flight open it again
    assert 1 <= len(opened) <= 2
