"""A delaying reverse proxy in front of a local S3 server: every request waits a fixed time before it is forwarded.

What it models: the round trip of a real object store. S3 and its kin add roughly 10-50 ms to every request
(time to first byte of a small GET or HEAD, a LIST page, a PUT's answer), while moto's S3 server answers from
memory on loopback in well under a millisecond, so a benchmark against moto alone shows only the client's CPU
cost per request and hides how many requests a run makes one after another. Holding each request `latency_ms`
before forwarding it makes every sequential request cost at least that much, as it would over a network;
requests in flight at the same time are held side by side (one thread per client connection), so concurrency
hides the delay as it would against a real store. Bandwidth is not limited: bodies are streamed at loopback
speed.

Standard library only: in a process of its own (a remote store's delay costs the client neither CPU nor its
interpreter lock), a ThreadingHTTPServer on a free loopback port speaking HTTP/1.1 with keep-alive towards the
client (botocore and aiohttp reuse connections), one http.client connection to the upstream server per client
connection (reused while the upstream keeps it open), request and response bodies streamed in 64 KiB pieces
(Content-Length bodies as they are, chunked request bodies passed through verbatim, responses without a length
re-sent chunked). Headers, Host included, go through unchanged apart from the hop-by-hop ones, so request
signatures and path-style addressing still match; ``Expect: 100-continue`` is answered by the proxy itself.
The upstream's own request log stays the record of what was asked (the proxy forwards each request once).

    with delaying_proxy("http://127.0.0.1:5000", latency_ms=30) as proxy:
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.endpoint
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import Iterator

PIECE = 64 * 1024
COUNT_PATH = "/--proxy-requests"  # no bucket can be named so
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "upgrade", "transfer-encoding", "expect"})


class DelayingProxy(http.server.ThreadingHTTPServer):
    """The server: `endpoint` (its URL), `latency_ms`, `requests` (how many it forwarded)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, upstream: str, latency_ms: float) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"the proxy forwards plain http:// only, not {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.latency_ms = float(latency_ms)
        self.requests = 0
        self.get_bytes = 0
        self._count_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"

    def count(self) -> None:
        with self._count_lock:
            self.requests += 1

    def count_bytes(self, size: int) -> None:
        with self._count_lock:
            self.get_bytes += size


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 300  # an idle client connection is dropped after this many seconds (clients reconnect)
    server: DelayingProxy
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._upstream is not None:
                self._upstream.close()

    def _connection(self) -> http.client.HTTPConnection:
        """This client connection's upstream connection; a new one if the upstream closed the old one (an idle
        socket that is readable has reached EOF, or holds bytes nobody asked for)."""
        conn = self._upstream
        if conn is not None and conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
            conn.close()
        if conn is None:
            conn = self._upstream = http.client.HTTPConnection(*self.server.upstream, timeout=300)
        return conn

    def _proxy(self) -> None:
        if self.path == COUNT_PATH:  # the parent asking how many requests were forwarded; not forwarded itself
            self._send_count()
            return
        self.server.count()
        if self.server.latency_ms > 0:
            time.sleep(self.server.latency_ms / 1000)
        try:
            response = self._forward()
        except (OSError, http.client.HTTPException) as exc:
            if self._upstream is not None:
                self._upstream.close()
            self._fail(exc)
            return
        self._answer(response)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = _proxy

    def _forward(self) -> http.client.HTTPResponse:
        """Send the request line, the end-to-end headers and the body upstream; the upstream's response."""
        conn = self._connection()
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        for name, value in self.headers.items():
            if name.lower() not in HOP_BY_HOP:
                conn.putheader(name, value)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        if chunked:
            self._pass_chunked(conn)
        else:
            self._pass_bytes(conn, int(self.headers.get("Content-Length") or 0), "a request body")
        return conn.getresponse()

    def _pass_bytes(self, conn: http.client.HTTPConnection, left: int, where: str) -> None:
        """Copy `left` bytes of the request from the client to the upstream, in pieces."""
        while left > 0:
            piece = self.rfile.read(min(PIECE, left))
            if not piece:
                raise ConnectionError(f"client closed the connection inside {where}")
            conn.send(piece)
            left -= len(piece)

    def _pass_chunked(self, conn: http.client.HTTPConnection) -> None:
        """Copy a chunked request body as it is, framing included, up to and with its trailer."""
        while True:
            line = self.rfile.readline(65537)
            conn.send(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            self._pass_bytes(conn, size + 2, "a chunked body")  # the data and its CRLF
        while True:  # trailer lines, then the empty line
            line = self.rfile.readline(65537)
            conn.send(line)
            if line in (b"\r\n", b"\n", b""):
                break

    def _answer(self, response: http.client.HTTPResponse) -> None:
        """Status and end-to-end headers to the client, then the body: as long as the upstream's Content-Length
        says, or chunked when the upstream gave none."""
        bodyless = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        length = response.getheader("Content-Length")
        chunked = not bodyless and length is None
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            while not bodyless:
                piece = response.read(PIECE)
                if not piece:
                    break
                if self.command == "GET":
                    self.server.count_bytes(len(piece))
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the client got a cut body: only closing tells it so
            if self._upstream is not None:
                self._upstream.close()
        finally:
            response.close()

    def _send_count(self) -> None:
        data = f"{self.server.requests} {self.server.get_bytes}".encode()
        self.send_response_only(200, "OK")
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, exc: BaseException) -> None:
        body = f"s3 latency proxy: upstream {self.server.upstream[0]}:{self.server.upstream[1]} failed: {exc}\n"
        data = body.encode()
        self.close_connection = True
        try:
            self.send_response_only(502, "Bad Gateway")
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError:
            pass


class ProxyProcess:
    """A DelayingProxy running in its own process: `endpoint`, `latency_ms`, `pid`, `requests` and `get_bytes` (the
    body bytes of the GETs it answered), asked of it."""

    def __init__(self, endpoint: str, latency_ms: float, pid: int) -> None:
        self.endpoint, self.latency_ms, self.pid = endpoint, latency_ms, pid

    def _counts(self) -> list[int]:
        with urllib.request.urlopen(self.endpoint + COUNT_PATH, timeout=30) as answer:
            return [int(value) for value in answer.read().split()]

    @property
    def requests(self) -> int:
        return self._counts()[0]

    @property
    def get_bytes(self) -> int:
        return self._counts()[1]


@contextlib.contextmanager
def delaying_proxy(upstream: str, latency_ms: float, nice: int = 0) -> Iterator[ProxyProcess]:
    """Run a DelayingProxy in front of `upstream` (http://host:port) on a free loopback port while the block runs,
    in a process of its own: a remote store's round trip costs the client no CPU and no hold of its interpreter
    lock, and the proxy's copying of every body in Python would take both from a run in the same process. `nice` >
    0: it runs at that lower CPU priority (nice(1))."""
    child = subprocess.Popen([*(["nice", "-n", str(nice)] if nice else []),
                              sys.executable, __file__, "--serve", upstream, str(latency_ms)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        if not endpoint.startswith("http://"):
            raise RuntimeError(f"the latency proxy did not start (exit {child.poll()})")
        yield ProxyProcess(endpoint, latency_ms, child.pid)
    finally:
        child.terminate()
        child.wait(timeout=30)


def _serve(upstream: str, latency_ms: float) -> None:
    """The proxy's process: print its endpoint, then serve until terminated."""
    proxy = DelayingProxy(upstream, latency_ms)
    print(proxy.endpoint, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        proxy.serve_forever(poll_interval=0.1)
    finally:
        proxy.server_close()


def _selftest(latency_ms: float = 30.0) -> None:
    """Time one small GET direct and through the proxy (needs moto[server] and s3fs): `python _s3_latency.py`."""
    import tempfile
    from pathlib import Path

    import _benchlib as bl
    import s3fs

    with tempfile.TemporaryDirectory() as tmp, bl.s3_server(Path(tmp) / "s3.log") as direct, \
            delaying_proxy(direct, latency_ms) as proxy:
        filesystems = {name: s3fs.S3FileSystem(endpoint_url=url, skip_instance_cache=True, use_listings_cache=False)
                       for name, url in (("direct", direct), ("proxy", proxy.endpoint))}
        filesystems["direct"].mkdir("probe")
        filesystems["direct"].pipe("probe/small", b"x" * 1000)
        filesystems["direct"].pipe("probe/big", bytes(range(256)) * (40 * 1024 * 4))  # 40 MiB
        medians, per_call = {}, 1.0
        for name, fs in filesystems.items():
            fs.cat_file("probe/small")  # connection set up outside the timing
            times, before = [], proxy.requests
            for _ in range(10):
                start = time.perf_counter()
                assert fs.cat_file("probe/small") == b"x" * 1000
                times.append(1000 * (time.perf_counter() - start))
            per_call = (proxy.requests - before) / 10 or per_call  # the direct calls are not seen: the proxy's count
            medians[name] = bl.median(times)
            ranged = fs.cat_file("probe/big", start=1000, end=1000 + 5 * 2**20)
            assert ranged == (bytes(range(256)) * (40 * 1024 * 4))[1000:1000 + 5 * 2**20]
            print(f"{name}: cat_file of 1000 bytes, median of 10: {medians[name]:.1f} ms "
                  f"(min {min(times):.1f}); 5 MiB range read ok")
        print(f"cat_file makes {per_call:g} requests (HEAD, GET); the proxy adds "
              f"{(medians['proxy'] - medians['direct']) / per_call:.1f} ms per request (latency_ms={latency_ms:g})")
        fs = filesystems["proxy"]
        fs.pipe("probe/multi", b"m" * (12 * 2**20), chunksize=5 * 2**20)  # multipart: 3 parts through the proxy
        assert fs.cat_file("probe/multi") == b"m" * (12 * 2**20) and fs.info("probe/multi")["size"] == 12 * 2**20
        assert sorted(fs.ls("probe", detail=False)) == ["probe/big", "probe/multi", "probe/small"]
        fs.rm("probe/multi")
        assert not fs.exists("probe/multi")
        print(f"through the proxy: multipart PUT, HEAD, LIST, DELETE ok; it forwarded {proxy.requests} requests")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2], float(sys.argv[3]))
    else:
        _selftest(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
