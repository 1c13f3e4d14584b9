"""A real S3-protocol server for tests: moto's standalone server (the one s3fs's own test suite runs against) as a
child process on a free loopback port, and the AWS environment a user would set for such a store."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

S3_ENV_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_s3_server() -> Iterator[str]:
    """moto's S3 server in its own process; yields its endpoint URL, stops it after."""
    pytest.importorskip("moto.server", reason="moto[server] is in the test extras: pip install -e '.[test]'")
    pytest.importorskip("s3fs")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {endpoint}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": endpoint}


def s3_filesystem(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint},
                             skip_instance_cache=True)


def make_bucket(fs: Any, bucket: str) -> None:
    if not fs.exists(bucket):
        fs.mkdir(bucket)


def upload(fs: Any, local: Path, bucket: str, prefix: str = "cache") -> str:
    """`local` copied under s3://bucket/prefix; returns that URL."""
    make_bucket(fs, bucket)
    fs.put(str(local), f"{bucket}/{prefix}", recursive=True)
    return f"s3://{bucket}/{prefix}"


def download(fs: Any, url: str, local: Path) -> Path:
    """Every object under `url` copied into the folder `local`."""
    fs.invalidate_cache()
    fs.get(url.removeprefix("s3://"), str(local), recursive=True)
    return local
