"""Headless Chromium driven over the DevTools protocol with aiohttp's websocket client: enough
to open a page, read and click its DOM, and take a screenshot (the console's browser tests and
`bench.console_shot`). No selenium, no downloads:
Debian's ``chromium`` package (``scripts/system-packages`` installs it).

`Browser` starts Chromium in a process group of its own with a fresh profile directory, and
`close` ends the group and deletes the directory (`gone` says whether both are)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["Browser", "chromium"]

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    """The Chromium binary on this machine, if any."""
    for name in CANDIDATES:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


class Browser:
    """One headless Chromium with one page."""

    def __init__(self, binary: str, *, width: int = 1280, height: int = 900) -> None:
        self.binary = binary
        self.size = (width, height)
        self.profile = Path(tempfile.mkdtemp(prefix="capyctl-chromium-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self, within: float = 30.0) -> None:
        width, height = self.size
        argv = [
            self.binary, "--headless=new", "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}", "--no-sandbox", "--disable-gpu",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            "--disable-background-networking", "--disable-dev-shm-usage",
            f"--window-size={width},{height}", "about:blank",
        ]  # fmt: skip
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - it returns at once
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + within
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium wrote no DevToolsActivePort")
            await asyncio.sleep(0.05)
        port = port_file.read_text().split()[0]
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            doc = json.loads(msg.data)
            fut = self._waiting.pop(doc.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(doc)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (an error raises)."""
        assert self._ws is not None
        n = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = fut
        await self._ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
        doc = await asyncio.wait_for(fut, 30)
        if "error" in doc:
            raise RuntimeError(f"{method}: {doc['error']}")
        result: dict[str, Any] = doc.get("result", {})
        return result

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        found = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in found:
            raise RuntimeError(f"{expression}: {found['exceptionDetails']}")
        return found["result"].get("value")

    async def until(self, expression: str, within: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy (its value), for up to ``within`` seconds (an
        element comes back as ``{}``: ask ``!!`` of it)."""
        deadline = time.monotonic() + within
        last: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):  # the page is still loading
                last = await self.js(expression)
                if last:
                    return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"not true within {within} s: {expression} (last {last!r})")

    async def click(self, selector: str) -> None:
        await self.until(f"!!document.querySelector({json.dumps(selector)})")
        await self.js(f"document.querySelector({json.dumps(selector)}).click()")

    async def screenshot(self, path: Path) -> None:
        width, height = self.size
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.send("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):  # Chromium closes its children and exits
                await asyncio.wait_for(self.send("Browser.close"), 5)
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._http is not None:
            await self._http.close()
        if self.proc is not None:
            await _until(lambda: self.proc is None or self.proc.poll() is not None, 10)
            with contextlib.suppress(ProcessLookupError):  # whatever is left of its group
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            pid = self.proc.pid
            await _until(lambda: not _group_alive(pid), 10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def gone(self) -> bool:
        """Whether no process of Chromium's group runs and its profile directory is deleted."""
        alive = self.proc is not None and _group_alive(self.proc.pid)
        return not alive and not self.profile.exists()


async def _until(happened: Callable[[], bool], within: float) -> None:
    """Return once ``happened()`` is true, or after ``within`` seconds (the caller checks)."""
    deadline = time.monotonic() + within
    while True:
        if happened() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies aside)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
