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


class StoreProxy:
    """An HTTP proxy in front of the S3 server that answers some requests itself with an error, as a real store
    does under load or without permission: `rules` maps a method, or "METHOD text" (a request of that method whose
    path holds the text), to (how many of its requests, status, S3 error code); every other request is forwarded.
    Counts what it answered itself in `answered` (by rule), and every request it saw in `seen` (by method); `paths`
    lists each request's method and path. `holds` maps "METHOD text" to seconds such a request is held before it is
    forwarded; `times` lists (method, path, arrived, answered) on time.monotonic()."""

    def __init__(self, upstream: str, rules: dict[str, tuple[int, int, str]],
                 holds: dict[str, float] | None = None) -> None:
        import http.client
        import http.server
        import threading
        import urllib.parse

        self.rules = {method: list(rule) for method, rule in rules.items()}
        self.answered: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.paths: list[tuple[str, str]] = []
        self.holds = dict(holds or {})
        self.times: list[tuple[str, str, float, float]] = []
        target = urllib.parse.urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy.seen[self.command] = proxy.seen.get(self.command, 0) + 1
                proxy.paths.append((self.command, self.path))
                arrived = time.monotonic()
                for held, seconds in proxy.holds.items():
                    method, _, text = held.partition(" ")
                    if method == self.command and text in self.path:
                        time.sleep(seconds)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                key = next((key for key in proxy.rules if key == self.command
                            or key.startswith(f"{self.command} ") and key.split(" ", 1)[1] in self.path), None)
                rule = proxy.rules.get(key) if key is not None else None
                if rule is not None and rule[0] > 0:
                    rule[0] -= 1
                    proxy.answered[key] = proxy.answered.get(key, 0) + 1
                    error = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{rule[2]}</Code>"
                             f"<Message>{rule[2]} (from the test proxy)</Message></Error>").encode()
                    self.send_response(rule[1])
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error if self.command != "HEAD" else b"")
                    return
                upstream_connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                upstream_connection.request(self.command, self.path, body=body, headers=headers)
                response = upstream_connection.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                        self.send_header(key, value)
                # a HEAD's length is the object's (its body is empty): s3fs opens a file at the size a HEAD gives
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream_connection.close()
                proxy.times.append((self.command, self.path, arrived, time.monotonic()))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
