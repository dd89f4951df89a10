"""A headless Chromium driven over the DevTools protocol, for tests of the dashboard pages.

No browser automation package is needed: Chromium serves the protocol on a websocket and
tornado (which Dask already brings) speaks websockets. The flags keep Chromium off the
network it would otherwise try to reach (updates, sync, QUIC), which on a closed network
makes it hang, and let it run as root in a container.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-allow-origins=*", "--window-size=1600,1800")


NO_CHROMIUM = ("no Chromium to test the dashboard in: none of chromium, chromium-browser or google-chrome is on "
               "PATH. Install one: `apt-get install chromium` (Debian/Ubuntu), or `pip install playwright && "
               "playwright install chromium` and put its chrome binary on PATH")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One Chromium process and one page. Use as a context manager; every call is blocking."""

    def __init__(self, executable: str, timeout: float = 60.0):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="dask-rl-chromium-")  # a fresh profile each time
        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.loop = asyncio.new_event_loop()
        self.ids = itertools.count(1)
        self.socket = None
        try:
            self.socket = self._run(self._connect(self._page_socket_url()))
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _page_socket_url(self) -> str:
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}: "
                                   f"{self.process.stderr.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        while True:
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            if time.monotonic() > deadline:
                raise TimeoutError("chromium opened no page")
            time.sleep(0.1)

    async def _connect(self, url: str):
        from tornado.websocket import websocket_connect

        return await websocket_connect(url, max_message_size=256 * 2**20)

    def _run(self, coroutine):
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, self.timeout))

    async def _call(self, method: str, params: dict) -> dict:
        request_id = next(self.ids)
        await self.socket.write_message(json.dumps({"id": request_id, "method": method, "params": params}))
        while True:  # events arrive in between; only our answer ends the wait
            message = await self.socket.read_message()
            if message is None:
                raise ConnectionError("chromium closed the DevTools connection")
            reply = json.loads(message)
            if reply.get("id") == request_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def call(self, method: str, **params) -> dict:
        return self._run(self._call(method, params))

    def open(self, url: str) -> None:
        """Navigate and wait until the document has loaded."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page (promises are awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page JavaScript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None, interval: float = 0.25):
        """Evaluate until the expression is truthy; returns its value."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout or self.timeout:.0f}s for {expression!r}; last value {value!r}")
            time.sleep(interval)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.loop.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def artifact_dir() -> Path:
    """Where browser tests leave a copy of their screenshots: $DASK_RL_ARTIFACTS, else
    dask-rl-artifacts in the temporary directory (the same place every run)."""
    path = Path(os.environ.get("DASK_RL_ARTIFACTS") or Path(tempfile.gettempdir()) / "dask-rl-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path
