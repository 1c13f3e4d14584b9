"""Encoding into object storage (vaecache.cache.objects) against a real S3-protocol server process: the cache over S3
equals the one on disk, a crash at any point of a commit resumes to the same cache, strays are deleted, and the lock
is a conditional PUT."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import Result

from tests.conftest import ENCODE_ARGS, assert_same_tensors, invoke, load_tensors, read_clips, subprocess_env
from tests.s3 import StoreProxy, download, make_bucket, upload
from vaecache import LatentCache
from vaecache.cache import lock as lock_module
from vaecache.cache.objects import ObjectOut
from vaecache.demodata import DemoDataSpec, write_demo_dataset
from vaecache.errors import OutputError


def _objects(s3, url: str) -> dict[str, int]:
    s3.invalidate_cache()
    root = url.removeprefix("s3://")
    return {path[len(root) + 1:]: info["size"] for path, info in s3.find(root, detail=True).items()}


def _encode(url: str, data: Path, *extra: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vaecache", "encode", str(data), "--out", url,
                           *map(str, ENCODE_ARGS), *map(str, extra)],
                          capture_output=True, text=True, env=subprocess_env(**(env or {})), timeout=300)


def _encode_here(url: str, data: Path, *extra: object) -> Result:
    """The same encode in this process (CliRunner on the CLI: same exit code, output on `.output`), without a ~4 s
    interpreter and torch start: for every run that need not crash or be killed."""
    return invoke(["encode", data, "--out", url, *ENCODE_ARGS, *extra], env={"VAECACHE_FAULT": None})


def _encode_behind(proxy: StoreProxy, monkeypatch: pytest.MonkeyPatch, s3_endpoint: str, url: str, data: Path,
                   *extra: object) -> Result:
    """`_encode_here` with the store reached through `proxy`, which is closed after; the store is reached direct
    again when it returns."""
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        return _encode_here(url, data, *extra)
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)


def _same_cache(s3, url: str, local: Path, tmp_path: Path) -> None:
    copy = download(s3, url, tmp_path / "copy")
    assert_same_tensors(load_tensors(copy), load_tensors(local))
    def records(out: Path) -> list[dict]:  # a resumed run's shards are another attempt's: other names
        return [{key: value for key, value in record.items() if key != "shard"} for record in read_clips(out)]

    assert records(copy) == records(local)
    result = invoke(["verify", copy])
    assert result.exit_code == 0, result.output


def test_an_encode_into_s3_equals_the_encode_on_disk(s3, demo_data: Path, good_cache: Path, tmp_path: Path) -> None:
    make_bucket(s3, "equal-out")
    url = "s3://equal-out/cache"
    result = invoke(["encode", demo_data, "--out", url, *ENCODE_ARGS])
    assert result.exit_code == 0, result.output
    assert f"vaecache encode -> {url}" in result.output
    _same_cache(s3, url, good_cache, tmp_path)
    found = _objects(s3, url)
    assert ".lock" not in found and "manifest.json" in found
    assert [name for name in found if name.startswith("progress/commits/")] == \
        ["progress/commits/a000-r00000-000000.json"]
    cache = LatentCache(url, verify="sha256")
    assert cache.ids() == LatentCache(good_cache).ids()

    again = invoke(["encode", demo_data, "--out", url, *ENCODE_ARGS])
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    after = _objects(s3, url)
    assert {k: v for k, v in after.items() if not k.startswith("logs/")} == \
        {k: v for k, v in found.items() if not k.startswith("logs/")}


@pytest.mark.parametrize("point", ["crash-before-record:2", "crash-mid-write:2", "crash-after-commit:1"])
def test_a_crash_in_a_commit_resumes_to_the_same_cache(s3, s3_endpoint: str, demo_data: Path, sharded_cache: Path,
                                                       tmp_path: Path, point: str) -> None:
    bucket = "crash-" + point.split(":")[0]
    make_bucket(s3, bucket)
    url = f"s3://{bucket}/cache"
    crashed = _encode(url, demo_data, "--shard-size", "50000", env={"VAECACHE_FAULT": point})
    assert crashed.returncode == 137, crashed.stderr
    found = _objects(s3, url)
    commits = sorted(name for name in found if name.startswith("progress/commits/"))
    shards = sorted(name for name in found if name.startswith("shards/"))
    assert "manifest.json" not in found
    assert len(commits) == {"crash-before-record:2": 1, "crash-mid-write:2": 1, "crash-after-commit:1": 1}[point]
    if point != "crash-after-commit:1":
        assert len(shards) == 2  # the second shard's object, whole or cut, without its commit record
    incomplete = invoke(["verify", url])
    assert incomplete.exit_code == 1 and "incomplete" in incomplete.output, incomplete.output

    resumed = _encode_here(url, demo_data, "--shard-size", "50000")
    assert resumed.exit_code == 0, resumed.output
    _same_cache(s3, url, sharded_cache, tmp_path)
    after = _objects(s3, url)
    committed = {name.replace("progress/commits/", "shards/").replace(".json", ".safetensors")
                 for name in after if name.startswith("progress/commits/")}
    assert {name for name in after if name.startswith("shards/")} == committed  # the stray is gone
    verified = invoke(["verify", url])
    assert verified.exit_code == 0, verified.output


@pytest.mark.slow
def test_kill_9_mid_encode_then_resume_equals_an_uninterrupted_run(s3, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_demo_dataset(data, DemoDataSpec(scenes=16, cameras=2, frames=17, height=64, width=64, fps=10, seed=3))
    reference = tmp_path / "reference"
    assert _encode(str(reference), data, "--shard-size", "1").returncode == 0
    make_bucket(s3, "killed")
    url = "s3://killed/cache"
    child = subprocess.Popen([sys.executable, "-m", "vaecache", "encode", str(data), "--out", url,
                              *map(str, ENCODE_ARGS), "--shard-size", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env())
    try:
        deadline = time.monotonic() + 120
        while not any(name.startswith("progress/commits/") for name in _objects(s3, url)):
            assert child.poll() is None and time.monotonic() < deadline, "no commit before the encode ended"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    found = _objects(s3, url)
    assert "manifest.json" not in found and ".lock" in found  # killed mid-run: its lock is left behind
    resumed = _encode_here(url, data, "--shard-size", "1")  # same host, dead pid: the stale lock is taken over
    assert resumed.exit_code == 0, resumed.output
    kept = re.search(r"clips already committed \(resumed\)\s*│\s*([0-9]+)", resumed.output)
    assert kept and 0 < int(kept.group(1)) < 16, resumed.output
    _same_cache(s3, url, reference, tmp_path)


def test_a_lock_that_is_no_longer_this_job_s_stops_finalize_before_the_manifest(s3) -> None:
    make_bucket(s3, "lock-lost")
    url = "s3://lock-lost/cache"
    out = ObjectOut(url)
    try:
        out.acquire_lock("111")
        for name in ("clips.parquet", "failures.parquet", "manifest.json"):
            (out.work / name).write_bytes(b"table")
        s3.pipe("lock-lost/cache/.lock", json.dumps({"host": "elsewhere", "pid": 1, "job_id": "222"}).encode())
        with pytest.raises(OutputError, match=r"\.lock: the lock is no longer this job's \(now host elsewhere, pid 1, "
                                              r"job 222\); the manifest was not written"):
            out.publish()
        found = _objects(s3, url)
        assert "manifest.json" not in found
        out.release_lock()  # not this job's: left where it is
        assert json.loads(s3.cat("lock-lost/cache/.lock"))["job_id"] == "222"
    finally:
        out.close()


def test_the_locks_release_deletes_only_the_lock_it_read_as_its_own(s3) -> None:
    """The release deletes with If-Match on the ETag of the lock it read holding its token: a lock put there after
    that read (another job's, taking over one it found stale) is left in place, where a plain delete removed it."""
    make_bucket(s3, "lock-release")
    url = "s3://lock-release/cache"
    out = ObjectOut(url)
    try:
        out.acquire_lock("111")
        assert out.lock.still_held()  # read: its token, its ETag
        other = json.dumps({"host": "elsewhere", "pid": 1, "job_id": "222", "token": "theirs"}).encode()
        s3.pipe("lock-release/cache/.lock", other)  # between that read and the delete
        out.release_lock()
        assert s3.cat("lock-release/cache/.lock") == other
        s3.rm("lock-release/cache/.lock")
        out.acquire_lock("333")
        out.release_lock()  # still its own: deleted
        assert ".lock" not in _objects(s3, url)
    finally:
        out.close()


def test_the_lock_is_a_conditional_put_and_a_live_holder_refuses_a_second_job(s3, demo_data: Path) -> None:
    make_bucket(s3, "locked")
    url = "s3://locked/cache"
    first, second = ObjectOut(url), ObjectOut(url)
    try:
        first.acquire_lock("111")
        with pytest.raises(OutputError, match=r"locked by another vaecache job \(host .*, pid .*, job 111\)"):
            second.acquire_lock("222")  # same host, live pid: refused, as on disk
        first.release_lock()
        second.acquire_lock("222")
        second.release_lock()
        assert ".lock" not in _objects(s3, url)
    finally:
        first.close()
        second.close()

    s3.pipe_file("locked/cache/.lock", json.dumps({"host": "another-host", "pid": 4242, "job_id": "7"}).encode())
    refused = invoke(["encode", demo_data, "--out", url, *ENCODE_ARGS])
    assert refused.exit_code == 1
    assert f"{url}: locked by another vaecache job (host another-host, pid 4242, job 7)" in refused.output
    assert "manifest.json" not in _objects(s3, url)

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s3.pipe_file("locked/cache/.lock", json.dumps({"host": socket.gethostname(), "pid": dead.pid}).encode())
    taken = invoke(["encode", demo_data, "--out", url, *ENCODE_ARGS])
    assert taken.exit_code == 0, taken.output
    assert ".lock" not in _objects(s3, url)


def test_two_jobs_taking_over_one_stale_lock_together_one_wins(s3, monkeypatch: pytest.MonkeyPatch) -> None:
    make_bucket(s3, "stale")
    url = "s3://stale/cache"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s3.pipe_file("stale/cache/.lock", json.dumps({"host": socket.gethostname(), "pid": dead.pid}).encode())
    both_read, first_done = threading.Barrier(2, timeout=60), threading.Event()
    rule = lock_module.lock_is_stale

    def racing(holder: dict, me: dict) -> bool:  # both jobs read the stale lock; the second acts after the first won
        stale = rule(holder, me)
        if holder.get("pid") == dead.pid:
            both_read.wait()
            if me["job_id"] == "second":
                first_done.wait(60)
        return stale

    monkeypatch.setattr(lock_module, "lock_is_stale", racing)
    outcomes: dict[str, object] = {}

    def take_over(job: str) -> None:
        objects = ObjectOut(url)
        try:
            objects.acquire_lock(job)
            outcomes[job] = objects
        except OutputError as exc:
            outcomes[job] = exc
            objects.close()
        finally:
            if job == "first":
                first_done.set()

    jobs = [threading.Thread(target=take_over, args=(job,)) for job in ("first", "second")]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(120)
    assert isinstance(outcomes["first"], ObjectOut), outcomes
    assert isinstance(outcomes["second"], OutputError), outcomes  # its If-Match PUT on the stale ETag got 412
    assert f"{url}: locked by another vaecache job (host {socket.gethostname()}, pid {os.getpid()}, job first)" in \
        str(outcomes["second"])
    s3.invalidate_cache()
    assert json.loads(s3.cat_file("stale/cache/.lock"))["job_id"] == "first"
    outcomes["first"].release_lock()
    outcomes["first"].close()
    assert ".lock" not in _objects(s3, url)


def test_a_stale_lock_is_refused_where_the_store_cannot_replace_it_conditionally(s3, demo_data: Path) -> None:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    stale = json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1}).encode()  # past pid_max: never alive
    plain = ObjectOut("memory://vaecache-test/cache")  # a store without ETags
    try:
        plain.fs.pipe_file(plain.store.key(".lock"), stale)
        with pytest.raises(OutputError, match=r"memory://vaecache-test/cache: locked by a vaecache job that is gone "
                           r"\(host .*\), but this store gives no ETag to replace it on, .*; delete "
                           r"memory://vaecache-test/cache/\.lock and rerun"):
            plain.acquire_lock(None)
        assert plain.fs.cat_file(plain.store.key(".lock")) == stale
    finally:
        plain.fs.rm(plain.store.key(".lock"))
        plain.close()

    make_bucket(s3, "nomatch")
    s3.pipe_file("nomatch/cache/.lock", stale)
    objects = ObjectOut("s3://nomatch/cache")
    put = objects.fs.pipe_file

    def without_if_match(path: str, data: bytes, **kwargs: object) -> None:  # what s3fs raises for a 501 answer
        if "IfMatch" in kwargs:
            raise translate_boto_error(ClientError({"Error": {"Code": "NotImplemented", "Message": "If-Match"},
                                                    "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject"))
        put(path, data, **kwargs)

    objects.fs.pipe_file = without_if_match
    try:
        with pytest.raises(OutputError, match=r"but this store does not replace an object conditionally \(If-Match\)"):
            objects.acquire_lock(None)
    finally:
        objects.close()
    assert s3.cat_file("nomatch/cache/.lock") == stale


def test_what_a_user_meets_is_one_line_naming_the_url(s3, demo_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = invoke(["encode", demo_data, "--out", "s3://no-such-bucket-here/cache", *ENCODE_ARGS])
    assert missing.exit_code == 1
    assert "error: s3://no-such-bucket-here/cache: no such bucket (no-such-bucket-here)" in missing.output

    make_bucket(s3, "foreign")
    s3.pipe_file("foreign/cache/notes.txt", b"mine")
    foreign = invoke(["encode", demo_data, "--out", "s3://foreign/cache", *ENCODE_ARGS])
    assert foreign.exit_code == 2 and "not empty and not a vaecache output (holds notes.txt)" in foreign.output

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    anonymous = invoke(["encode", demo_data, "--out", "s3://foreign/other", *ENCODE_ARGS])
    assert anonymous.exit_code == 1
    assert "s3://foreign/other: cannot list (no credentials" in anonymous.output, anonymous.output


def test_verify_of_a_url_names_a_corrupted_a_missing_and_a_stray_object(s3, demo_data: Path) -> None:
    make_bucket(s3, "verified")
    url = "s3://verified/cache"
    made = _encode_here(url, demo_data, "--shard-size", "50000")
    assert made.exit_code == 0, made.output
    good = invoke(["verify", url])
    assert good.exit_code == 0 and "cache OK" in good.output, good.output
    s3.pipe_file("verified/cache/shards/a007-r00003-000000.safetensors", b"left by a crash")
    assert invoke(["verify", url]).exit_code == 1
    repaired = invoke(["verify", url, "--repair"])  # deleted first, then the cache is checked as repaired
    assert repaired.exit_code == 0 and "cache OK" in repaired.output, repaired.output
    assert "--repair deleted 1 stray shard(s): shards/a007-r00003-000000.safetensors" in repaired.output
    shards = sorted(name for name in _objects(s3, url) if name.startswith("shards/"))
    first, second = (f"verified/cache/{name}" for name in shards)
    data = bytearray(s3.cat_file(first))
    data[-1] ^= 0xFF  # same size, other bytes
    s3.pipe_file(first, bytes(data))
    s3.rm(second)
    s3.pipe_file("verified/cache/shards/a009-r00000-000000.safetensors", b"left by a crash")
    bad = invoke(["verify", url])
    assert bad.exit_code == 1
    lines = bad.output
    assert f"{shards[0]}: sha256" in lines and f"{shards[1]}: missing" in lines
    assert "shards/a009-r00000-000000.safetensors: shard file not listed in the manifest" in lines
    quick = invoke(["verify", url, "--quick"])
    assert quick.exit_code == 1 and f"{shards[1]}: missing" in quick.output and "sha256" not in quick.output

    s3.pipe_file("verified/cache/.lock", json.dumps({"host": "another-host", "pid": 1}).encode())
    locked = invoke(["verify", url, "--repair"])
    assert locked.exit_code == 1 and "locked by another vaecache job (host another-host" in locked.output
    s3.rm("verified/cache/.lock")
    repaired = invoke(["verify", url, "--repair"])
    assert "--repair deleted 1 stray shard(s): shards/a009-r00000-000000.safetensors" in repaired.output
    assert "shards/a009-r00000-000000.safetensors" not in _objects(s3, url)


def test_verify_of_an_incomplete_url_names_uncommitted_shards_and_repair_deletes_them(s3, demo_data: Path) -> None:
    make_bucket(s3, "halfway")
    url = "s3://halfway/cache"
    crashed = _encode(url, demo_data, "--shard-size", "50000", env={"VAECACHE_FAULT": "crash-before-record:2"})
    assert crashed.returncode == 137
    report = invoke(["verify", url])
    assert report.exit_code == 1
    assert "incomplete: no final manifest; 2 clips in 1 shards are committed" in report.output
    assert "shards/a000-r00000-000001.safetensors: shard object without a commit record" in report.output
    assert "vaecache verify --repair (or the next encode) deletes them" in report.output
    repaired = invoke(["verify", url, "--repair", "--json", "-"])
    assert "--repair deleted 1 stray shard(s): shards/a000-r00000-000001.safetensors" in repaired.output
    assert sorted(name for name in _objects(s3, url) if name.startswith("shards/")) == \
        ["shards/a000-r00000-000000.safetensors"]


def test_verify_of_a_finished_url_names_a_listed_shard_whose_commit_record_is_gone(s3, demo_data: Path) -> None:
    make_bucket(s3, "uncommitted")
    url = "s3://uncommitted/cache"
    made = _encode_here(url, demo_data, "--shard-size", "50000")
    assert made.exit_code == 0, made.output
    commits = sorted(name for name in _objects(s3, url) if name.startswith("progress/commits/"))
    assert len(commits) == 2
    s3.rm(f"uncommitted/cache/{commits[0]}")
    shard = f"shards/{commits[0].rsplit('/', 1)[1].removesuffix('.json')}.safetensors"
    report = invoke(["verify", url])
    assert report.exit_code == 1, report.output
    assert f"{shard}: shard object without its commit record {commits[0]}" in report.output
    assert "listed shard(s) lost their commit record: rerun the same encode command" in " ".join(report.output.split())
    assert invoke(["verify", url, "--repair"]).exit_code == 1  # nothing to delete: the shard is listed
    assert shard in _objects(s3, url)
    assert _encode_here(url, demo_data, "--shard-size", "50000").exit_code == 0  # its clips are encoded again
    assert invoke(["verify", url]).exit_code == 0


def test_a_cache_written_on_disk_and_copied_to_s3_is_read_and_verified_but_not_resumed(s3, good_cache: Path,
                                                                                       demo_data: Path) -> None:
    url = upload(s3, good_cache, "copied")
    assert invoke(["verify", url]).exit_code == 0
    against = invoke(["verify", url, "--dataset", demo_data, "--reencode", "1", "--json", "-"])  # as on disk
    assert against.exit_code == 0, against.output
    checks = {check["name"]: check for check in json.loads(against.output[against.output.index("{"):])["checks"]}
    assert checks[f"coverage of {demo_data}"]["passed"] == 3 and checks["re-encode 1 clip(s) with builtin:tiny"][
        "passed"] == 1
    refused = invoke(["encode", demo_data, "--out", url, *ENCODE_ARGS])
    assert refused.exit_code == 2
    assert "progress/rank-00000.jsonl: this cache was written on disk and copied here" in refused.output
    assert "manifest.json" in _objects(s3, url)


def test_a_finalize_that_lists_the_commit_records_reads_none_it_holds(s3, s3_endpoint: str, demo_data: Path,
                                                                      sharded_cache: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a multi-rank run rebuilds its logs from the commit records before finalize. Of a resume, it read the
    earlier attempt's records when it prepared OUT, under the lock it still holds, and wrote its own: it reads each
    record once in all (here a one-process resume finalizing as rank 0 of several would)."""
    from vaecache.cache.objects import ObjectOut

    make_bucket(s3, "held-records")
    url = "s3://held-records/cache"
    crashed = _encode(url, demo_data, "--shard-size", "50000", env={"VAECACHE_FAULT": "crash-after-commit:1"})
    assert crashed.returncode == 137, crashed.stderr
    before_finalize = ObjectOut.before_finalize
    monkeypatch.setattr(ObjectOut, "before_finalize", lambda self, only_writer: before_finalize(self, False))
    counting = StoreProxy(s3_endpoint, {})
    resumed = _encode_behind(counting, monkeypatch, s3_endpoint, url, demo_data, "--shard-size", "50000")
    assert resumed.exit_code == 0, resumed.output
    _same_cache(s3, url, sharded_cache, tmp_path)
    commits = sorted(name for name in _objects(s3, url) if name.startswith("progress/commits/"))
    read = sorted(path.split("/cache/", 1)[1] for method, path in counting.paths
                  if method == "GET" and "/cache/progress/commits/" in path)
    assert len(commits) > 1 and read == commits[:1]  # the first attempt's, once, as OUT was prepared


@pytest.mark.slow
def test_two_ranks_under_torchrun_commit_into_s3_and_equal_one_process(s3, s3_endpoint: str, demo_data: Path,
                                                                        good_cache: Path, tmp_path: Path) -> None:
    from tests.conftest import torchrun_cmd

    data = upload(s3, demo_data, "two-ranks", "videos")
    url = "s3://two-ranks/cache"
    counting = StoreProxy(s3_endpoint, {})
    try:
        result = subprocess.run(torchrun_cmd(2, "encode", data, "--out", url, *ENCODE_ARGS, "--shard-size", "1"),
                                capture_output=True, text=True, timeout=300,
                                env=subprocess_env(AWS_ENDPOINT_URL_S3=counting.endpoint))
    finally:
        counting.close()
    assert result.returncode == 0, result.stderr[-3000:]
    commits = sorted(name for name in _objects(s3, url) if name.startswith("progress/commits/"))
    assert {name.split("-")[1] for name in commits} == {"r00000", "r00001"}  # each rank committed its own
    # finalize reads the other rank's commit records, once each; rank 0's own it has
    read = sorted(path.split("/cache/", 1)[1] for method, path in counting.paths
                  if method == "GET" and "/cache/progress/commits/" in path)
    assert read == [name for name in commits if "-r00001-" in name]
    copy = download(s3, url, tmp_path / "copy")
    assert_same_tensors(load_tensors(copy), load_tensors(good_cache))
    verified = subprocess.run(torchrun_cmd(2, "verify", url, "--no-progress"), capture_output=True, text=True,
                              env=subprocess_env(), timeout=300)  # the shard objects split between the ranks
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert (verified.stdout + verified.stderr).count("cache OK") == 1  # rank 0 alone reports


def test_a_throttled_request_is_retried_and_a_refused_one_is_one_line(s3, s3_endpoint: str, demo_data: Path,
                                                                        good_cache: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    make_bucket(s3, "throttled")
    slow = StoreProxy(s3_endpoint, {"PUT": (3, 503, "SlowDown")})  # S3's answer to too many requests
    result = _encode_behind(slow, monkeypatch, s3_endpoint, "s3://throttled/cache", demo_data)
    assert result.exit_code == 0, result.output
    assert slow.answered == {"PUT": 3}  # each retried with backoff, and the run went on
    _same_cache(s3, "s3://throttled/cache", good_cache, tmp_path)

    make_bucket(s3, "refused")
    denied = StoreProxy(s3_endpoint, {"PUT": (10**6, 403, "AccessDenied")})
    result = _encode_behind(denied, monkeypatch, s3_endpoint, "s3://refused/cache", demo_data)
    assert result.exit_code == 1
    assert "error: s3://refused/cache/.lock: cannot write (access denied (" in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1


def test_the_last_commit_record_is_put_beside_the_tables_and_the_manifest_waits_for_it(
        s3, s3_endpoint: str, demo_data: Path, good_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    make_bucket(s3, "beside")
    slow = StoreProxy(s3_endpoint, {}, holds={"PUT /progress/commits/": 1.0})
    result = _encode_behind(slow, monkeypatch, s3_endpoint, "s3://beside/cache", demo_data)
    assert result.exit_code == 0, result.output
    puts = {path.split("?")[0].removeprefix("/beside/cache/"): (arrived, answered)
            for method, path, arrived, answered in slow.times if method == "PUT"}
    commit, shard = puts["progress/commits/a000-r00000-000000.json"], puts["shards/a000-r00000-000000.safetensors"]
    assert shard[1] <= commit[0]  # the shard is there before its commit record is asked for
    assert puts["clips.parquet"][0] < commit[1]  # the tables went while the commit record's PUT was held
    assert commit[1] <= puts["manifest.json"][0]  # and the manifest only once it was there
    _same_cache(s3, "s3://beside/cache", good_cache, tmp_path)

    make_bucket(s3, "refused-commit")
    denied = StoreProxy(s3_endpoint, {"PUT /progress/commits/": (10**6, 403, "AccessDenied")})
    result = _encode_behind(denied, monkeypatch, s3_endpoint, "s3://refused-commit/cache", demo_data)
    assert result.exit_code == 1
    assert "error: s3://refused-commit/cache/progress/commits/a000-r00000-000000.json: cannot write (access denied" \
        in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1
    assert "manifest.json" not in _objects(s3, "s3://refused-commit/cache")
    assert invoke(["verify", "s3://refused-commit/cache"]).exit_code != 0


def test_an_unreadable_commit_record_stops_the_resume_and_deletes_nothing(s3, s3_endpoint: str, demo_data: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    make_bucket(s3, "unreadable")
    url = "s3://unreadable/cache"
    assert _encode(url, demo_data, "--shard-size", "50000",
                   env={"VAECACHE_FAULT": "crash-before-record:2"}).returncode == 137
    before = _objects(s3, url)
    denied = StoreProxy(s3_endpoint, {"GET /progress/commits/": (10**6, 403, "AccessDenied")})
    result = _encode_behind(denied, monkeypatch, s3_endpoint, url, demo_data, "--shard-size", "50000")
    assert result.exit_code == 1 and denied.answered
    assert "progress/commits/a000-r00000-000000.json: cannot read (access denied" in result.output
    after = _objects(s3, url)
    assert {k: v for k, v in after.items() if k.startswith(("shards/", "progress/"))} == \
        {k: v for k, v in before.items() if k.startswith(("shards/", "progress/"))}  # nothing taken for a stray


def _commit_gets(proxy: StoreProxy) -> list[str]:
    return sorted(path.split("/cache/", 1)[1] for method, path in proxy.paths
                  if method == "GET" and "/cache/progress/commits/" in path)


def test_a_finished_cache_holds_its_commit_records_in_one_compacted_object_a_rerun_reads(
        s3, s3_endpoint: str, demo_data: Path, good_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """finalize PUTs progress/compacted/final.jsonl, every commit record's line: a rerun of the finished cache reads
    it and no commit record (one GET where there were as many as shards)."""
    make_bucket(s3, "compacted")
    url = "s3://compacted/cache"
    assert _encode_here(url, demo_data, "--shard-size", "1").exit_code == 0
    objects = _objects(s3, url)
    commits = sorted(name for name in objects if name.startswith("progress/commits/"))
    assert [name for name in objects if name.startswith("progress/compacted/")] == ["progress/compacted/final.jsonl"]
    final = s3.cat_file("compacted/cache/progress/compacted/final.jsonl")
    assert sorted(b"".join(s3.cat_file(f"compacted/cache/{name}") for name in commits).splitlines()) == \
        sorted(final.splitlines()) and len(commits) > 2
    counting = StoreProxy(s3_endpoint, {})
    again = _encode_behind(counting, monkeypatch, s3_endpoint, url, demo_data, "--shard-size", "1")
    assert again.exit_code == 0, again.output
    assert _commit_gets(counting) == []
    _same_cache(s3, url, good_cache, tmp_path)


def test_a_resume_reads_each_process_compacted_object_and_only_the_records_after_it(
        s3, s3_endpoint: str, demo_data: Path, good_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends before finalize (its final compaction left out, its manifest gone) leaves a compacted object
    of its records every COMPACT_EVERY commits: the resume GETs those and the records after them, not every record; a
    record deleted since (a repair) is not taken back from the compacted object; a compacted object that does not
    read is skipped, its records read one by one; the cache is the same."""
    from vaecache.cache import objects

    make_bucket(s3, "compacting")
    url = "s3://compacting/cache"
    every, compact_all = objects.COMPACT_EVERY, ObjectOut.compact_all
    monkeypatch.setattr(objects, "COMPACT_EVERY", 2)
    monkeypatch.setattr(ObjectOut, "compact_all", lambda self: None)
    assert _encode_here(url, demo_data, "--shard-size", "1").exit_code == 0
    monkeypatch.setattr(objects, "COMPACT_EVERY", every)
    monkeypatch.setattr(ObjectOut, "compact_all", compact_all)
    s3.rm("compacting/cache/manifest.json")  # as though the run had stopped before finalize
    objects_now = _objects(s3, url)
    commits = sorted(name for name in objects_now if name.startswith("progress/commits/"))
    compacted = [name for name in objects_now if name.startswith("progress/compacted/")]
    covered = sum(len(s3.cat_file(f"compacting/cache/{name}").splitlines()) for name in compacted)
    assert len(commits) >= 3 and len(compacted) == len(commits) // 2 and covered == len(commits) - len(commits) % 2
    counting = StoreProxy(s3_endpoint, {})
    resumed = _encode_behind(counting, monkeypatch, s3_endpoint, url, demo_data, "--shard-size", "1")
    assert resumed.exit_code == 0, resumed.output
    assert _commit_gets(counting) == commits[covered:]  # only the records after the compacted object
    _same_cache(s3, url, good_cache, tmp_path)

    work = ObjectOut(url)  # a record gone since it was compacted is not committed; a damaged compaction is skipped
    try:
        s3.pipe("compacting/cache/progress/compacted/final.jsonl", b"not a progress line\n")
        s3.pipe("compacting/cache/progress/compacted/a000-r00000-000002.jsonl",
                s3.cat_file(f"compacting/cache/{commits[0]}"))
        s3.rm(f"compacting/cache/{commits[0]}")
        work.pull_records(finished=False)
        lines = b"".join(path.read_bytes() for path in sorted((work.work / "progress").glob("rank-*.jsonl")))
        assert len(lines.splitlines()) == len(commits) - 1
        assert s3.cat_file(f"compacting/cache/{commits[1]}") in lines
    finally:
        work.close()


def _tamper_final(s3, bucket: str, old: bytes, new: bytes) -> str:
    """final.jsonl with its first line's `old` made `new`: returns the commit record that line stands for."""
    key = f"{bucket}/cache/progress/compacted/final.jsonl"
    lines = s3.cat_file(key).splitlines(keepends=True)
    assert old in lines[0], lines[0][:300]
    lines[0] = lines[0].replace(old, new, 1)
    s3.pipe(key, b"".join(lines))
    shard = json.loads(lines[0])["shard"]["file"].rsplit("/", 1)[-1]
    return f"progress/commits/{shard.removesuffix('.safetensors')}.json"


@pytest.mark.parametrize("edit", [(b'"fps":10.0', b'"fps":12.5'), (b'"sha256":"', b'"sha256":"0')],
                         ids=["a-clip-record-changed", "a-wrong-sha256"])
def test_the_commit_record_is_the_truth_over_a_compacted_line_that_disagrees(
        s3, demo_data: Path, good_cache: Path, tmp_path: Path, edit: tuple[bytes, bytes]) -> None:
    """A line of progress/compacted/final.jsonl that is not its commit record's bytes is named by verify, never used
    (the record is read instead: its listed ETag is not the line's MD5), and the rerun verify points to writes the
    compacted object again from the records."""
    bucket = f"disagree-{len(edit[1])}"
    make_bucket(s3, bucket)
    url = f"s3://{bucket}/cache"
    assert _encode_here(url, demo_data, "--shard-size", "1").exit_code == 0
    record = _tamper_final(s3, bucket, *edit)
    checked = invoke(["verify", url])
    assert checked.exit_code == 1, checked.output
    said = " ".join(checked.output.split())
    assert f"{record}: its line in progress/compacted/final.jsonl is not the record's" in said
    assert "rerun the same encode command to write the compacted object again" in said

    again = _encode_here(url, demo_data, "--shard-size", "1")  # the repair verify points to
    assert again.exit_code == 0, again.output
    assert "is already complete: nothing to encode" in again.output and "nothing changed" not in again.output
    assert "repaired: s3://" in again.output and "final.jsonl: rewritten from the commit records" in again.output
    commits = sorted(name for name in _objects(s3, url) if name.startswith("progress/commits/"))
    final = s3.cat_file(f"{bucket}/cache/progress/compacted/final.jsonl")
    assert sorted(final.splitlines()) == sorted(s3.cat_file(f"{bucket}/cache/{name}").strip() for name in commits)
    assert invoke(["verify", url]).exit_code == 0

    _tamper_final(s3, bucket, *edit)  # and a resume (the manifest gone) reads the record, not the line
    s3.rm(f"{bucket}/cache/manifest.json")
    resumed = _encode_here(url, demo_data, "--shard-size", "1")
    assert resumed.exit_code == 0, resumed.output
    _same_cache(s3, url, good_cache, tmp_path)
