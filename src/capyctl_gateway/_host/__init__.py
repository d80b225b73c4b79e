"""A host: ``capyctl-gateway host serve``. It keeps a control session to its server, runs the
deployments the server places on it (launching, parking, waking and stopping them on the
server's orders, with the same lifecycle code as a single machine), reports their load every
second, and serves its ingress.

The host's engines and collector are a `Fleet` of its own, opened from the server's ``setup``
message; it has no public listener: nothing reaches the engines but the ingress. A session
that is lost closes every forward through the ingress; the engines keep running and the host
connects again (every 1 to 5 s), so a server that comes back finds them as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .._errors import EngineControlError
from .._identity import check_private
from .._log import event
from .._machines import pki
from .._machines.control import PINGS_KEPT
from .._machines.enroll import HostIdentity, JoinError, join
from .._machines.ingress import Gate, close_all
from .._machines.protocol import LOST_AFTER_S, MAX_MESSAGE_BYTES, REPORT_EVERY_S, deployment_tag
from .._tasks import Supervisor
from .placement import Placement

__all__ = ["Host", "join"]  # join: enroll.join, where it lives

logger = logging.getLogger("capyctl_gateway")
RETRY_S = (1.0, 2.0, 5.0)


class Host:
    """One host's runtime: its session to the server, its engines, its gates."""

    def __init__(self, state_dir: Path, ingress_url: str) -> None:
        self.identity = HostIdentity(state_dir / "identity")
        about = self.identity.enrolled()
        if about is None:
            raise JoinError(f"{state_dir} is not enrolled: run `capyctl-gateway host join` first")
        self.name, self.control = about
        check_private(self.identity.key)
        self.state_dir = state_dir
        self.ingress_url = ingress_url
        self.placed = Placement(state_dir / "logs")
        self._tasks = Supervisor(f"host {self.name}")
        """The server's orders being carried out (a fault past `_carry_out`'s is logged)."""
        self.connected = asyncio.Event()
        self.pings: deque[tuple[int, float]] = deque(maxlen=PINGS_KEPT)
        """The server's latest pings and when each arrived (wall clock, as the samples')."""

    def gate(self, tag: str, index: int) -> Gate | None:
        return self.placed.gates.get((tag, index))

    def gates(self) -> Mapping[tuple[str, int], Gate]:
        """Each placed instance's gate, by (deployment tag, index)."""
        return self.placed.gates

    def session(self) -> aiohttp.ClientSession | None:
        return self.placed.fleet.session if self.placed.fleet is not None else None

    # -- the session ------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep a session to the server, forever (cancel to stop)."""
        ctx = pki.client_context(
            self.identity.ca.read_bytes(), self.identity.cert, self.identity.key
        )
        attempt = 0
        try:
            async with aiohttp.ClientSession() as http:
                while True:
                    try:
                        async with http.ws_connect(
                            f"https://{self.control}/v1/session",
                            ssl=ctx,
                            server_hostname=pki.SERVER_NAME,
                            max_msg_size=MAX_MESSAGE_BYTES,
                            timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
                        ) as ws:
                            attempt = 0
                            await self._converse(ws)
                    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                        logger.warning("no session with the server at %s: %s", self.control, exc)
                    except Exception:  # a message it could not use: say so, and connect again
                        logger.exception("the session with the server at %s failed", self.control)
                    self._lost()
                    await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
                    attempt += 1
        finally:
            await self._tasks.aclose()
            await self.placed.teardown()

    async def _converse(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_bytes(orjson.dumps({"t": "hello", "ingress": self.ingress_url}))
        setup = await ws.receive(timeout=LOST_AFTER_S)
        if setup.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            return
        self.pings.clear()
        await self.placed.setup(orjson.loads(setup.data).get("deployments", []))
        event(
            "host_session",
            "host %s: session with %s up",
            self.name,
            self.control,
            host=self.name,
            state="live",
        )
        self.connected.set()
        reporter = asyncio.get_running_loop().create_task(_report(self, ws))
        try:
            while True:
                try:
                    msg = await ws.receive(timeout=LOST_AFTER_S)
                except TimeoutError:
                    logger.warning("nothing heard from the server for %.0f s", LOST_AFTER_S)
                    return
                if reporter.done():  # reports are the session's worth: without them, end it
                    reporter.result()
                    return
                if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    return
                doc = orjson.loads(msg.data)
                if doc.get("t") == "ping":
                    self.pings.append((int(doc["n"]), time.time()))
                    await ws.send_bytes(orjson.dumps({"t": "pong", "n": doc.get("n")}))
                elif doc.get("t") == "order":
                    self._tasks.spawn(_carry_out(self, ws, doc), what=f"order {doc.get('op')}")
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter

    def _lost(self) -> None:
        if self.connected.is_set():
            event("host_session", "host %s: session lost", self.name, host=self.name, state="lost")
        self.connected.clear()
        gates = list(self.placed.gates.values())
        close_all(gates)
        for gate in gates:  # a key that crossed the lost session opens nothing any more:
            gate.key = None  # the next session's first report carries a fresh one


# --- what the host sends its server -----------------------------------------------------------


async def _report(host: Host, ws: aiohttp.ClientWebSocketResponse) -> None:
    """Every `REPORT_EVERY_S`, a report of every placed instance, for as long as the session."""
    while True:
        reports = [r.to_json() for r in host.placed.reports(host.pings)]
        await ws.send_bytes(orjson.dumps({"t": "report", "instances": reports}))
        await asyncio.sleep(REPORT_EVERY_S)


async def _carry_out(host: Host, ws: aiohttp.ClientWebSocketResponse, doc: dict[str, Any]) -> None:
    """One order of the server carried out, and its ``done`` answer sent: ok, or the host's
    words when it could not (never a traceback), with the instance's report as it stands."""
    error = None
    key = ("", -1)
    try:
        key = (deployment_tag(str(doc["deployment"])), int(doc["instance"]))
        await host.placed.do(key, str(doc["op"]), str(doc.get("reason", "the server asked")))
    except EngineControlError as exc:  # the server hears the host's words
        error = exc.message
    except Exception:  # a defect here: logged in full, and the server told it failed
        logger.exception("order %s failed on host %s", doc.get("op"), host.name)
        error = "the host failed to carry it out (see its log)"
    report = next(
        (
            r.to_json()
            for r in host.placed.reports(host.pings)
            if (deployment_tag(r.deployment), r.instance) == key
        ),
        None,
    )
    answer = {
        "t": "done",
        "id": doc.get("id"),
        "ok": error is None,
        "error": error,
        "report": report,
    }
    with contextlib.suppress(ConnectionError):
        await ws.send_bytes(orjson.dumps(answer))
