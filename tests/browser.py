"""A real browser for the tests: Debian's headless Chromium (`/usr/bin/chromium`), driven over the DevTools protocol
on a pipe (`--remote-debugging-pipe`: commands written to the browser's fd 3, replies and events read from its fd 4,
each a JSON message ended by a NUL byte). No driver, no websocket, no browser a tool downloads: only the standard
library and the distribution's package.

`chromium_binary()` finds the browser, installing Debian's `chromium` package with apt when it is missing and this
process is root (as tests/e2e/slurm installs SLURM); `Browser` starts it with a fresh profile and no network of its own
(background networking, component updates, sync and QUIC off), `Browser.open(url)` loads a page and waits for its
load event, and the page's console errors, failed loads and every request it made are kept for the test to read.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
PACKAGE = "chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio", "--hide-scrollbars")
TIMEOUT_S = 60.0


def required() -> bool:
    """Must the browser tests run here (CI=true, or VAECACHE_REQUIRE_CHROMIUM=1), rather than skip?"""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("VAECACHE_REQUIRE_CHROMIUM", "") == "1"


def chromium_binary() -> tuple[Path | None, str]:
    """(the browser, "") where it is or could be installed; (None, why not) otherwise."""
    if CHROMIUM.exists():
        return CHROMIUM, ""
    if os.geteuid() != 0:
        return None, (f"headless Chromium ({CHROMIUM}) is not installed and installing Debian's {PACKAGE!r} package "
                      "needs root: apt-get install chromium, or run the tests as root")
    if shutil.which("apt-get") is None:
        return None, f"headless Chromium ({CHROMIUM}) is not installed and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", PACKAGE]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:  # a fresh machine's package lists may be missing or stale
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=900)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0 or not CHROMIUM.exists():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        return None, f"apt-get install {PACKAGE} failed (exit {done.returncode}): {tail}"
    return CHROMIUM, ""


def _moved_above(fd: int, lowest: int) -> int:
    """`fd` duplicated to the lowest free descriptor >= `lowest` (the original closed)."""
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return moved


class BrowserError(RuntimeError):
    pass


class Browser:
    """Headless Chromium over the DevTools pipe. Use as a context manager; `open(url)` gives a Page."""

    def __init__(self, binary: Path, width: int = 1280, height: int = 900) -> None:
        self.profile = tempfile.mkdtemp(prefix="vaecache-chromium-")
        to_browser_read, self._write = os.pipe()
        self._read, from_browser_write = os.pipe()
        # above 4, so that putting them at 3 and 4 never closes one of them
        to_browser_read, from_browser_write = (_moved_above(fd, 10) for fd in (to_browser_read, from_browser_write))
        # the browser's fd 3 reads our commands, its fd 4 writes its messages: bash puts the pipes there (after
        # subprocess closed every other descriptor) and becomes the browser
        moves = (f"exec 3<&{to_browser_read} 4>&{from_browser_write} {to_browser_read}<&- {from_browser_write}>&- "
                 '"$@"')
        self.process = subprocess.Popen(
            ["/bin/bash", "-c", moves, "bash", str(binary), *FLAGS, f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(to_browser_read, from_browser_write))
        for fd in (to_browser_read, from_browser_write):
            os.close(fd)
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read_messages, daemon=True)
        self._reader.start()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _read_messages(self) -> None:
        buffer = b""
        with os.fdopen(self._read, "rb", buffering=0) as stream:
            while True:
                chunk = stream.read(1 << 16)
                if not chunk:
                    break
                buffer += chunk
                while b"\0" in buffer:
                    raw, buffer = buffer.split(b"\0", 1)
                    message = json.loads(raw)
                    with self._lock:
                        if "id" in message:
                            self._replies[message["id"]] = message
                        else:
                            self.events.append(message)
                        self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = TIMEOUT_S) -> dict[str, Any]:
        """One DevTools command; its result (a BrowserError for an error reply, a closed browser or a timeout)."""
        with self._lock:
            self._next += 1
            number = self._next
        message = {"id": number, "method": method, "params": params or {},
                   **({"sessionId": session} if session else {})}
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._lock:
            while number not in self._replies:
                if self._closed:
                    raise BrowserError(f"{method}: the browser closed ({self.process.stderr.read().decode()[-500:]})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"{method}: no reply in {timeout:.0f} s")
                self._lock.wait(left)
            reply = self._replies.pop(number)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, session: str, since: int, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for event in self.events[since:]:
                    if event.get("method") == method and event.get("sessionId") == session:
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise BrowserError(f"no {method} within {timeout:.0f} s")
                self._lock.wait(left)

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        since = len(self.events)
        navigated = self.send("Page.navigate", {"url": url}, session=session)
        if navigated.get("errorText"):
            raise BrowserError(f"{url}: {navigated['errorText']}")
        self.wait_event("Page.loadEventFired", session, since)
        return Page(self, session, since)

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                try:
                    self.send("Browser.close", timeout=10)
                except BrowserError:
                    pass
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=10)
        finally:
            os.close(self._write)
            shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """A loaded page: run JavaScript in it, capture it, read what went wrong while it loaded."""

    def __init__(self, browser: Browser, session: str, since: int) -> None:
        self.browser, self.session, self.since = browser, session, since

    def evaluate(self, expression: str, await_promise: bool = False) -> Any:
        result = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                        "awaitPromise": await_promise}, session=self.session)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _events(self) -> list[dict[str, Any]]:
        with self.browser._lock:
            return [e for e in self.browser.events[self.since:] if e.get("sessionId") == self.session]

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, failed loads and CSP violations, in words."""
        found = []
        for event in self._events():
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails'].get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                found.append(f"console.{params['type']}: {[a.get('value') for a in params.get('args', [])]}")
            elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
                entry = params["entry"]
                found.append(f"log {entry['level']}: {entry.get('text')} {entry.get('url', '')}")
            elif method == "Network.loadingFailed":
                found.append(f"failed load: {params.get('errorText')} {params.get('blockedReason', '')}")
        return found

    def requests(self) -> list[str]:
        """Every URL the page asked for while loading (and since)."""
        return [e["params"]["request"]["url"] for e in self._events() if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path, full_page: bool = True, clip: dict[str, float] | None = None) -> Path:
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page}
        if full_page and clip is None:
            metrics = self.browser.send("Page.getLayoutMetrics", session=self.session)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": metrics["width"], "height": metrics["height"]}
        if clip is not None:
            params["clip"] = {**clip, "scale": clip.get("scale", 1)}
        data = self.browser.send("Page.captureScreenshot", params, session=self.session)["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)


__all__ = ["Browser", "BrowserError", "Page", "chromium_binary", "required"]
