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
import os
import secrets
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from canopyx_provider import EngineRestarted, Event

from ._deployments.routes import EngineInstance
from ._errors import EngineControlError, OrderRefusedError
from ._fleet import Fleet, open_fleet
from ._identity import check_private
from ._lifecycle.states import STARTABLE, InstanceState, Launched
from ._log import event
from ._machines import pki
from ._machines.control import PINGS_KEPT
from ._machines.enroll import HostIdentity, JoinError, join
from ._machines.ingress import Gate, close_all
from ._machines.protocol import (
    LOST_AFTER_S,
    MAX_MESSAGE_BYTES,
    REPORT_EVERY_S,
    InstanceReport,
    deployment_tag,
    host_config,
)
from ._telemetry import Telemetry

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
        self._tasks: set[asyncio.Task[None]] = set()
        self.connected = asyncio.Event()
        self.pings: deque[tuple[int, float]] = deque(maxlen=PINGS_KEPT)
        """The server's latest pings and when each arrived (wall clock, as the samples')."""

    def gate(self, tag: str, index: int) -> Gate | None:
        return self.placed.gates.get((tag, index))

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
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.placed.teardown()

    async def _converse(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_bytes(orjson.dumps({"t": "hello", "ingress": self.ingress_url}))
        setup = await ws.receive(timeout=LOST_AFTER_S)
        if setup.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            return
        self.pings.clear()
        await self.placed.setup(orjson.loads(setup.data).get("deployments", []))
        event("host_session", "host %s: session with %s up", self.name, self.control,
              host=self.name, state="live")  # fmt: skip
        self.connected.set()
        reporter = asyncio.get_running_loop().create_task(self._report(ws))
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
                    self._spawn(self._carry_out(ws, doc))
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter

    def _lost(self) -> None:
        if self.connected.is_set():
            event("host_session", "host %s: session lost", self.name, host=self.name,
                  state="lost")  # fmt: skip
        self.connected.clear()
        close_all(list(self.placed.gates.values()))

    async def _report(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while True:
            reports = [r.to_json() for r in self.placed.reports(self.pings)]
            await ws.send_bytes(orjson.dumps({"t": "report", "instances": reports}))
            await asyncio.sleep(REPORT_EVERY_S)

    # -- orders -------------------------------------------------------------------------------
    async def _carry_out(self, ws: aiohttp.ClientWebSocketResponse, doc: dict[str, Any]) -> None:
        error = None
        key = ("", -1)
        try:
            key = (deployment_tag(str(doc["deployment"])), int(doc["instance"]))
            await self.placed.do(key, str(doc["op"]), str(doc.get("reason", "the server asked")))
        except EngineControlError as exc:  # the server hears the host's words
            error = exc.message
        except Exception:  # a defect here: logged in full, and the server told it failed
            logger.exception("order %s failed on host %s", doc.get("op"), self.name)
            error = "the host failed to carry it out (see its log)"
        report = next((r.to_json() for r in self.placed.reports(self.pings) if (
            deployment_tag(r.deployment), r.instance) == key), None)  # fmt: skip
        answer = {"t": "done", "id": doc.get("id"), "ok": error is None, "error": error,
                  "report": report}  # fmt: skip
        with contextlib.suppress(ConnectionError):
            await ws.send_bytes(orjson.dumps(answer))

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class Placement:
    """The deployments the server placed on this host: their engines (a `Fleet` of the host's
    own) and the ingress's gate of each instance."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self.fleet: Fleet | None = None
        self._view: bytes = b""
        self._stack: contextlib.AsyncExitStack | None = None
        self.gates: dict[tuple[str, int], Gate] = {}
        self._launched: dict[tuple[str, int], Launched | None] = {}
        self._engine: dict[tuple[str, int], tuple[EngineInstance, int]] = {}
        """Each instance by (deployment tag, server index): it and its server index."""
        self._generation: dict[tuple[str, int], int] = {}
        self._procs: dict[tuple[str, int], int] = {}
        """The pid of each instance's engine process, as last seen."""
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def do(self, key: tuple[str, int], op: str, reason: str) -> None:
        """Carry out the server's order ``op`` on one launched instance, after any order
        still running on it; raise unless it reached the state the order asks for."""
        lc = self._launched.get(key)
        if self.fleet is None or lc is None:
            raise OrderRefusedError("no such launched instance on this host")
        async with self._locks.setdefault(key, asyncio.Lock()):
            await self._do(lc, op, reason)
        wanted = {"start": "ready", "wake": "ready", "park": "parked", "stop": "stopped"}
        if lc.state.value != wanted.get(op):
            raise OrderRefusedError(
                lc.failure or f"the engine is {lc.state.value}, not {wanted.get(op)}"
            )

    async def _do(self, lc: Launched, op: str, reason: str) -> None:
        assert self.fleet is not None
        engines = self.fleet.lifecycle.engines
        if op == "start" and lc.state is InstanceState.PARKED:
            op = "wake"
        if op == "start" and lc.state in STARTABLE:
            await engines.start(lc, reason)
        elif op == "wake":
            await engines.wake(lc, reason)
        elif op == "park":
            await engines.park(lc, reason)
        elif op == "stop":
            await engines.stop_one(lc, reason)
        elif op != "start":
            raise OrderRefusedError(f"unknown order {op!r}")

    # -- ----------------------------------------------------------
    async def setup(self, view: list[dict[str, Any]]) -> None:
        raw = orjson.dumps(view, option=orjson.OPT_SORT_KEYS)
        if raw == self._view:
            return  # the same placement: the engines stay as they are
        await self.teardown()
        self._view = raw
        if not view:
            return
        config, indexes = host_config(view)
        stack = contextlib.AsyncExitStack()
        fleet = await stack.enter_async_context(
            open_fleet(config, env=os.environ, telemetry=Telemetry(), engine_logs=self._logs)
        )
        self.fleet, self._stack = fleet, stack
        fleet.settlement.observers.append(self._restarted)
        for route in fleet.routes.values():
            lives = fleet.lifecycle.lives.get(route.deployment.name)
            for inst in route.instances:
                key = (deployment_tag(inst.deployment), indexes[(inst.deployment, inst.index)])
                self._engine[key] = (inst, indexes[(inst.deployment, inst.index)])
                self._launched[key] = next(
                    (lc for lc in lives.launched if lc.inst is inst), None
                ) if lives else None  # fmt: skip
                self._generation[key] = 0
                self.gates[key] = Gate(url=inst.url, headers=dict(inst.headers), key=None)
        self.refresh()

    def _restarted(self, e: Event) -> None:
        """An engine someone else runs restarted (its collector saw a new process): a new
        generation, which settles the requests cut before it on the server."""
        if isinstance(e, EngineRestarted):
            for key, (inst, _) in self._engine.items():
                if inst.key == e.key and self._launched[key] is None:
                    self._generation[key] += 1

    def refresh(self) -> None:
        """Open, close or renew each gate to match its engine."""
        for key, (inst, _) in self._engine.items():
            gate, lc = self.gates[key], self._launched[key]
            proc = inst.runner.process() if lc is not None else None
            if proc is not None and proc.pid != self._procs.get(key):
                self._procs[key] = proc.pid
                self._generation[key] += 1
                gate.key = None  # a new engine process: a new key
            gate.url = inst.url
            open_ = inst.available and not inst.unusable and inst.url is not None
            if not open_:
                gate.key = None
            elif gate.key is None:
                gate.key = secrets.token_bytes(32).hex()

    def reports(self, pings: Sequence[tuple[int, float]] = ()) -> list[InstanceReport]:
        """Each instance's report; ``pings``: the server's pings and when each arrived."""
        self.refresh()
        now = self.fleet.clock() if self.fleet is not None else 0.0
        out = []
        for key, (inst, index) in self._engine.items():
            lc = self._launched[key]
            s = inst.runner.sample()  # the one sample routing and status read too
            proc = inst.runner.process()
            out.append(InstanceReport(
                deployment=inst.deployment, instance=index,
                state=lc.state.value if lc is not None else "external",
                gate=self.gates[key].key, generation=self._generation[key],
                running=_count(s.running) if s is not None else None,
                waiting=_count(s.waiting) if s is not None else None,
                usage=s.usage if s is not None else None,
                age_s=s.age_s if s is not None else None,
                ingress_in_flight=self.gates[key].in_flight,
                quiet_ping=_quiet_ping(self.gates[key], now - s.age_s if s else None, pings),
                pid=proc.pid if proc is not None else None,
                port=proc.port if proc is not None else None,
                command=proc.argv if proc is not None else None,
                failure=lc.failure if lc is not None else None,
            ))  # fmt: skip
        return out

    async def teardown(self) -> None:
        close_all(list(self.gates.values()))
        if self._stack is not None:
            await self._stack.aclose()  # stops the engines this host started
        self.fleet, self._stack, self._view = None, None, b""
        self.gates.clear()
        self._launched.clear()
        self._engine.clear()


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _quiet_ping(
    gate: Gate, requested_at: float | None, pings: Sequence[tuple[int, float]]
) -> int | None:
    """The latest ping received before the sample was requested (``requested_at``), if the
    ingress has nothing in flight for the instance and its last forward there ended before
    that request too."""
    if requested_at is None or gate.in_flight or gate.last_end >= requested_at:
        return None
    before = [n for n, at in pings if at < requested_at]
    return max(before) if before else None
