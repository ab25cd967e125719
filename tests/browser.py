"""A headless Chromium (the system's, from the distribution's packages) driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: JSON messages ended by NUL on fds 3 and 4),
so the report's tests need no websocket library and download no browser.

    with Browser(find_chromium()) as browser:
        page = browser.open("file:///tmp/report.html")
        page.evaluate("document.title"); page.screenshot(clip); page.console_errors
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import zlib

import numpy as np

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Every switch that keeps a headless run quiet and local: no sandbox (root in CI), no GPU,
# no background fetches, updates, sync or first-run work; host names resolve nowhere.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-extensions", "--disable-default-apps", "--mute-audio",
         "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND")
TIMEOUT_S = 60


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless browser process; :meth:`open` loads a page in a new tab."""

    def __init__(self, binary: str, *, width: int = 1280, height: int = 1800):
        self.profile = tempfile.mkdtemp(prefix="kvcanary-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire():   # the browser reads commands on fd 3 and answers on fd 4
            read, write = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.process = subprocess.Popen(
            [binary, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire, pass_fds=(3, 4))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict = {}
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    # ------------------------------------------------------------------ the pipe

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._replies[None] = "closed"
                    self._lock.notify_all()
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._lock:
                        self._replies[message["id"]] = message
                        self._lock.notify_all()
                else:
                    self._events.put(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        with self._lock:
            while ident not in self._replies:
                if None in self._replies or time.monotonic() > deadline:
                    raise BrowserError(f"no answer to {method}")
                self._lock.wait(0.1)
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def events(self, timeout: float):
        """Events as they come, until ``timeout`` seconds pass with none."""
        while True:
            try:
                yield self._events.get(timeout=timeout)
            except queue.Empty:
                return

    # ------------------------------------------------------------------ pages

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self, session["sessionId"])
        page.load(url)
        return page

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except BrowserError:
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Page:
    """A loaded tab: what it logged and requested while loading, and calls into it."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session
        self.console_errors: list = []
        self.requests: list = []

    def call(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def load(self, url: str) -> None:
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", {"url": url})
        loaded = False
        deadline = time.monotonic() + TIMEOUT_S
        for event in self.browser.events(timeout=TIMEOUT_S):
            self._note(event)
            if event.get("method") == "Page.loadEventFired":
                loaded = True
                break
            if time.monotonic() > deadline:
                break
        if not loaded:
            raise BrowserError(f"{url} did not load")
        # Then a quiet second: late requests or errors count too.
        for event in self.browser.events(timeout=1.0):
            self._note(event)

    def _note(self, event: dict) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning",
                                                                            "assert"):
            self.console_errors.append(" ".join(str(a.get("value", a.get("description")))
                                                for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console_errors.append(details.get("exception", {}).get("description")
                                       or details.get("text"))
        elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
            self.console_errors.append(params["entry"].get("text"))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])

    def evaluate(self, expression: str):
        """The JSON value of a script expression in the page."""
        result = self.call("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, clip: dict | None = None) -> np.ndarray:
        """The page (or ``clip``: x, y, width, height in page pixels) as ``(h, w, 3)`` uint8."""
        params = {"format": "png", "captureBeyondViewport": True}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        return decode_png(base64.b64decode(self.call("Page.captureScreenshot", params)["data"]))

    def screenshot_png(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA PNG (what Chromium writes) as ``(h, w, 3)`` uint8."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    at, idat, header = 8, [], None
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        at += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}")
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, -1)
    out = np.zeros((height, width * bpp), dtype=np.uint8)
    previous = np.zeros(width * bpp, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 1:
            line = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) & 0xFF
        elif kind == 2:
            line = (line + previous) & 0xFF
        elif kind in (3, 4):
            line = _unfilter_sequential(kind, line, previous, bpp)
        elif kind != 0:
            raise ValueError(f"PNG filter {kind}")
        out[y] = line
        previous = line.astype(np.int32)
    return out.reshape(height, width, bpp)[:, :, :3]


def _unfilter_sequential(kind: int, line, previous, bpp: int):
    line, up = line.tolist(), previous.tolist()
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        if kind == 3:
            line[i] = (line[i] + (left + up[i]) // 2) & 0xFF
            continue
        corner = up[i - bpp] if i >= bpp else 0
        p = left + up[i] - corner
        pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - corner)
        predictor = left if pa <= pb and pa <= pc else (up[i] if pb <= pc else corner)
        line[i] = (line[i] + predictor) & 0xFF
    return np.array(line, dtype=np.int32)
