"""The deployments a server placed on this host: their engines (a `Fleet` of the host's own),
the ingress's gate of each instance, and what the host reports of each to its server.

Each placed instance is one `Placed` record, keyed by (deployment tag, the server's index).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._deployments.routes import EngineInstance
from .._errors import OrderRefusedError
from .._fleet import Fleet, open_fleet
from .._lifecycle.states import STARTABLE, InstanceState, Launched
from .._machines.ingress import Gate, close_all
from .._machines.protocol import InstanceReport, deployment_tag, host_config
from .._telemetry import Telemetry

__all__ = ["Placed", "Placement"]

_WANTED = {"start": "ready", "wake": "ready", "park": "parked", "stop": "stopped"}


@dataclass(eq=False)
class Placed:
    """One instance the server placed here."""

    inst: EngineInstance
    index: int
    """The server's index of it in its deployment."""
    gate: Gate
    launched: Launched | None
    """Its lifecycle state, when the host runs its engine (None: someone else does)."""
    generation: int = 0
    """Counts its engine processes (a new one: a restart, which settles cuts on the server)."""
    pid: int | None = None
    """Its engine process, as last seen."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One order at a time."""


class Placement:
    """The deployments the server placed on this host."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self.fleet: Fleet | None = None
        self._view: bytes = b""
        self._stack: contextlib.AsyncExitStack | None = None
        self.placed: dict[tuple[str, int], Placed] = {}

    @property
    def gates(self) -> dict[tuple[str, int], Gate]:
        return {key: p.gate for key, p in self.placed.items()}

    async def do(self, key: tuple[str, int], op: str, reason: str) -> None:
        """Carry out the server's order ``op`` on one launched instance, after any order
        still running on it; raise unless it reached the state the order asks for."""
        p = self.placed.get(key)
        lc = p.launched if p is not None else None
        if self.fleet is None or p is None or lc is None:
            raise OrderRefusedError("no such launched instance on this host")
        async with p.lock:
            await self._do(self.fleet, lc, op, reason)
        if lc.state.value != _WANTED.get(op):
            raise OrderRefusedError(
                lc.failure or f"the engine is {lc.state.value}, not {_WANTED.get(op)}"
            )

    @staticmethod
    async def _do(fleet: Fleet, lc: Launched, op: str, reason: str) -> None:
        engines = fleet.lifecycle.engines
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
        fleet.settlement.restart_observers.append(self._restarted)
        launched = {lc.inst: lc for life in fleet.lifecycle.lives.values() for lc in life.launched}
        for route in fleet.routes.values():
            for inst in route.instances:
                index = indexes[(inst.deployment, inst.index)]
                gate = Gate(url=inst.url, headers=dict(inst.headers), key=None)
                self.placed[(deployment_tag(inst.deployment), index)] = Placed(
                    inst, index, gate, launched.get(inst)
                )
        self.refresh()

    def _restarted(self, key: str) -> None:
        """An engine someone else runs restarted (what its samples proved: a new process, a
        counter that went down, an absence past a poll's timeout): a new generation, which
        settles the requests cut before it on the server."""
        for p in self.placed.values():
            if p.inst.key == key and p.launched is None:
                p.generation += 1

    def refresh(self) -> None:
        """Open, close or renew each gate to match its engine."""
        for p in self.placed.values():
            inst, gate = p.inst, p.gate
            proc = inst.runner.process() if p.launched is not None else None
            # One engine process per reaper: the reaper's pid names the run.
            run = None if proc is None else (proc.reaper_pid or proc.pid)
            if proc is not None and run != p.pid:
                p.pid = run
                p.generation += 1
                gate.key = None  # a new engine process: a new key
            gate.url = inst.url
            if not (inst.available and not inst.unusable and inst.url is not None):
                gate.key = None
            elif gate.key is None:
                gate.key = secrets.token_bytes(32).hex()

    def reports(self, pings: Sequence[tuple[int, float]] = ()) -> list[InstanceReport]:
        """Each instance's report; ``pings``: the server's pings and when each arrived."""
        self.refresh()
        now = self.fleet.clock() if self.fleet is not None else 0.0
        return [_report(p, now, pings) for p in self.placed.values()]

    async def teardown(self) -> None:
        close_all([p.gate for p in self.placed.values()])
        if self._stack is not None:
            await self._stack.aclose()  # stops the engines this host started
        self.fleet, self._stack, self._view = None, None, b""
        self.placed.clear()


def _report(p: Placed, now: float, pings: Sequence[tuple[int, float]]) -> InstanceReport:
    inst, lc = p.inst, p.launched
    s = inst.runner.sample()  # the one sample routing and status read too
    proc = inst.runner.process()
    cache = inst.runner.prefix_cache()
    requested_at = now - s.age_s if s is not None else None
    quiet = _quiet_ping(p.gate, requested_at, pings)
    return InstanceReport(
        deployment=inst.deployment,
        instance=p.index,
        state=lc.state.value if lc is not None else "external",
        gate=p.gate.key,
        generation=p.generation,
        running=_count(s.running) if s is not None else None,
        waiting=_count(s.waiting) if s is not None else None,
        usage=s.usage if s is not None else None,
        age_s=s.age_s if s is not None else None,
        ingress_in_flight=p.gate.in_flight,
        quiet_ping=quiet,
        prefix_queried=cache.queried_tokens if cache is not None else None,
        prefix_hits=cache.hit_tokens if cache is not None else None,
        pid=proc.pid if proc is not None else None,
        port=proc.port if proc is not None else None,
        command=proc.argv if proc is not None else None,
        failure=lc.failure if lc is not None else None,
    )


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
