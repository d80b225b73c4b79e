"""A fake runner kind for the lifecycle's policy tests, in the style of httpx's MockTransport:
the seam's every member, with no process behind it.

A `FakeRunner` serves each start with an in-process engine: the launchable engine's own
application (``launchable_engine.build_app``) on a loopback port of the test's loop, watched by
the gateway's collector as a local engine is. It reads the launch command the way the
launchable engine does (``--served``, ``--slow-start S``, ``--exit-at-once N``), so a test's
configuration means the same on either runner; a request that says ``crash`` makes the engine
"exit" (its listener and every connection cut at once, as a killed process's are). On top of
that, a `Script` per deployment makes a start, park, wake or stop take time or fail, and
`FakeEngines.exit` ends an engine on demand.

`FakeEngines` is the ground truth the invariants read: which engines serve now (`live`) and
how many starts each instance had. Its `process` is a fake pid (an identity that a restart changes,
never a real process's) and its port; it has no log and no keeper.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from canopyx_provider import Collector, adapter_for
from capyctl_gateway._config import Deployment, Instance
from capyctl_gateway._deployments.kinds import Found, Opened
from capyctl_gateway._deployments.routes import EngineInstance
from capyctl_gateway._deployments.runner import (
    HERE,
    Described,
    ProcessView,
    Site,
    Tracked,
)
from capyctl_gateway._deployments.seen import Seen, SeenBy
from capyctl_gateway._errors import ParkFailedError, StartFailedError
from capyctl_gateway._runners import KINDS, RunnerKind
from tests.gateway.launchable_engine import Sleep, build_app, parser

__all__ = ["FakeEngines", "FakeRunner", "Script", "fake_kinds"]


@dataclass(frozen=True)
class Script:
    """How one deployment's fake engines behave beyond what their launch command says."""

    start_s: float = 0.0
    park_s: float = 0.0
    wake_s: float = 0.0
    stop_s: float = 0.0
    start_fails: str | None = None
    park_fails: str | None = None
    wake_fails: str | None = None


class FakeEngines:
    """Every fake engine of one test: its scripts, and what really serves now."""

    def __init__(self, scripts: Mapping[str, Script] | None = None) -> None:
        self.scripts = dict(scripts or {})
        """deployment -> its `Script` (read at each start, park, wake and stop)."""
        self.starts: Counter[str] = Counter()
        self.runners: dict[str, FakeRunner] = {}
        self.live: dict[int, str] = {}
        """Each engine serving now, by its fake pid (unique for the test), with the model it
        serves: what ``engines_running`` reads of real processes."""
        self._ids = itertools.count(1_000_001)

    def running(self, served: str) -> list[int]:
        """The fake pids of the engines serving ``served`` now."""
        return sorted(pid for pid, model in self.live.items() if model == served)

    def new_pid(self, served: str) -> int:
        pid = next(self._ids)
        self.live[pid] = served
        return pid

    def script(self, deployment: str) -> Script:
        return self.scripts.get(deployment, Script())

    def exit(self, key: str, status: int = 3, *, seen: bool = True) -> None:
        """End instance ``key``'s engine now, as a kill would; with ``seen`` False, its exit is
        not yet reported (`FakeRunner.report_exit`): the moment between a process's death and
        its keeper's word, when its port already refuses."""
        self.runners[key].crash(status, seen=seen)

    async def open(self, opened: Opened) -> FakeRoom:
        return FakeRoom(self, opened)


class FakeRoom:
    """The fake kind's room: each runner it makes is kept by `FakeEngines`."""

    def __init__(self, engines: FakeEngines, opened: Opened) -> None:
        self._engines, self._opened = engines, opened

    def runner(self, inst: EngineInstance, configured: Instance) -> FakeRunner:
        o = self._opened
        runner = FakeRunner(
            inst, o.deployment(inst), self._engines, collector=o.collector, clock=o.clock
        )
        self._engines.runners[inst.key] = runner
        return runner

    async def take_up(self, found: Found) -> None:
        """A previous run's fake engines died with it."""


def fake_kinds(engines: FakeEngines) -> Mapping[str, RunnerKind]:
    """The registry with this machine's kind replaced by the fake (hosts' stay real)."""
    return {**KINDS, "local": RunnerKind(KINDS["local"].claims, engines.open)}


class FakeRunner(SeenBy):
    """One instance's fake engine (see the module's docstring)."""

    site: Site = HERE

    def __init__(
        self,
        inst: EngineInstance,
        dep: Deployment,
        engines: FakeEngines,
        *,
        collector: Collector,
        clock: Callable[[], float],
    ) -> None:
        self._inst, self._dep, self._engines = inst, dep, engines
        self.seen = Seen(collector, inst.key, clock)
        self._server: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._dead: list[web.AppRunner] = []
        """Crashed engines' servers, cleaned up by the stop that follows (`lost`)."""
        self._pid: int | None = None
        self._port: int | None = None
        self._sleep: Sleep | None = None
        self._exited: str | None = None
        self._gone = asyncio.Event()
        if inst.launch is None and inst.url is not None:
            self._watch()

    # -- the view ---------------------------------------------------------------------------
    def process(self) -> ProcessView | None:
        """The fake engine as ``status`` shows a process: its fake pid (an identity a restart
        changes, as a real pid) and its port."""
        launch = self._inst.launch
        if self._pid is None or launch is None:
            return None
        return ProcessView(self._pid, self._port, list(launch.command))

    def describe(self) -> Described:
        return self.seen.described()

    def log(self) -> None:
        return None

    def holdup(self) -> str | None:
        return None

    def why_unreachable(self) -> str:
        return "dispatch_closed"

    def begin(self, exchange: Tracked) -> None:
        pass

    def end(self, exchange: Tracked) -> None:
        pass

    # -- the driver -------------------------------------------------------------------------
    def cannot_start(self) -> str | None:
        return None

    async def start(self, reason: str) -> str:
        inst, key = self._inst, self._inst.key
        if inst.launch is None:
            raise StartFailedError(f"{inst.where} is an engine someone else runs")
        args, _ = parser().parse_known_args(list(inst.launch.command[1:]))
        script = self._engines.script(inst.deployment)
        await asyncio.sleep(script.start_s + args.slow_start)
        if script.start_fails is not None:
            raise StartFailedError(script.start_fails)
        if args.exit_at_once is not None:
            raise StartFailedError(f"the engine exited with status {args.exit_at_once}")
        app, self._sleep = build_app(
            args.served,
            crash=lambda: self.crash(3),
            garbled_after_wake=args.garbled_after_wake,
            max_running=args.max_running,
        )
        server = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await server.setup()
        site = web.TCPSite(server, "127.0.0.1", 0)
        await site.start()
        self._server, self._site = server, site
        self._exited, self._gone = None, asyncio.Event()
        self._engines.starts[key] += 1
        host, port = server.addresses[0][:2]
        self._pid, self._port = self._engines.new_pid(args.served), port
        inst.bind(f"http://{host}:{port}")
        self._watch()
        return f"answered on port {port}"

    async def park(self, reason: str) -> None:
        script = self._engines.script(self._inst.deployment)
        await asyncio.sleep(script.park_s)
        if script.park_fails is not None or self._sleep is None:
            raise ParkFailedError(script.park_fails or "no engine to park")
        self._sleep.asleep = True

    async def wake(self, reason: str) -> None:
        script = self._engines.script(self._inst.deployment)
        await asyncio.sleep(script.wake_s)
        if script.wake_fails is not None or self._sleep is None:
            raise ParkFailedError(script.wake_fails or "no engine to wake")
        self._sleep.asleep = False

    async def stop(self, reason: str) -> bool:
        await asyncio.sleep(self._engines.script(self._inst.deployment).stop_s)
        self.seen.unwatch()
        await self._close()
        return True

    def exited(self) -> str | None:
        return self._exited if self._gone.is_set() else None  # seen once it is reported

    async def gone(self) -> str:
        await self._gone.wait()
        return self._exited or "the engine exited"

    # -- the fake's own ---------------------------------------------------------------------
    def crash(self, status: int, *, seen: bool = True) -> None:
        """The engine exits now: its listener closes and every connection to it is cut (its
        exit reported at once, or, with ``seen`` False, by `report_exit`)."""
        server, site = self._server, self._site
        if server is None or site is None:
            return
        self._exited = f"the engine exited with status {status}"
        self._server = self._site = None
        self._forget()
        if site._server is not None:
            site._server.close()  # a new connection is refused, as by a process gone
        if server.server is not None:
            for handler in server.server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        self._dead.append(server)
        if seen:
            self._gone.set()

    def report_exit(self) -> None:
        """Report the exit of an engine crashed with ``seen`` False."""
        self._gone.set()

    async def _close(self) -> None:
        server, self._server, self._site = self._server, None, None
        if server is not None:
            self._forget()
            await server.cleanup()
        while self._dead:
            await self._dead.pop().cleanup()

    def _forget(self) -> None:
        if self._pid is not None:
            self._engines.live.pop(self._pid, None)
        self._sleep, self._pid, self._port = None, None, None

    def _watch(self) -> None:
        inst, d = self._inst, self._dep
        if not self.seen.watched and inst.url is not None:
            adapter = adapter_for(d.engine, inst.url, api_key=inst.engine_key, router=d.router)
            self.seen.watch(adapter, d.engine_model)
