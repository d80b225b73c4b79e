"""An engine on this machine (a `Runner`): a process the gateway runs (``launch:``) or one
someone else runs (``url:``), its load read from the collector.

Starting runs the process (``process.py``) and waits for its ``/health``; once it answers, the
collector watches it, the process is recorded in the store (``pids.py``: a gateway started
again outlasts it) and its warm cache is restored (``warm.py``), which a stop saves first.
Parking and waking go to the engine's own routes (``parking.py``); stopping stops its process
group. The collector stops watching an engine that stops. An engine
someone else runs is watched from the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import aiohttp

from canopyx_provider import Collector, adapter_for

from .._config import Deployment, Launch
from .._deployments.parking import drive
from .._deployments.routes import EngineInstance
from .._deployments.runner import (
    HERE,
    Described,
    ProcessView,
    Shown,
    Site,
    Tracked,
    never,
)
from .._deployments.seen import Seen, SeenBy
from .._deployments.wakecheck import auth_of, check, record
from .._errors import StartFailedError
from .._log import masked, secrets_in
from .._store import Store
from .enginelog import EngineLog, ShownLog, file_stem
from .pids import remember
from .process import EngineProcess, PortLostError, free_port, launch_argv, launch_env
from .warm import WarmCache

__all__ = ["PORT_TRIES", "LocalRunner"]

PORT_TRIES = 3
"""Starts a start makes when the port it chose is taken before the engine binds it."""

logger = logging.getLogger("capyctl_gateway")


class LocalRunner(SeenBy):
    """One instance's engine on this machine."""

    site: Site = HERE

    def __init__(
        self,
        inst: EngineInstance,
        deployment: Deployment,
        *,
        collector: Collector,
        session: aiohttp.ClientSession,
        log_dir: Path,
        clock: Callable[[], float],
        store: Store | None,
        warm: WarmCache,
    ) -> None:
        self._inst, self._dep, self._session, self._log_dir = inst, deployment, session, log_dir
        self._store, self._warm = store, warm
        self._proc: EngineProcess | None = None
        self.seen = Seen(collector, inst.key, clock)
        self._recorded: str | None = None
        """Its answer to the wake check's prompt when it first became ready."""
        self._log: ShownLog | None = None  # the latest run's, masked
        if inst.launch is None:  # someone else runs it: watched from the start
            self.watch()

    # -- what it reads ------------------------------------------------------------------------
    def watch(self) -> None:
        """Have the collector poll the engine (once it has an address)."""
        inst, d = self._inst, self._dep
        if not self.seen.watched and inst.url is not None:
            adapter = adapter_for(d.engine, inst.url, api_key=inst.engine_key, router=d.router)
            self.seen.watch(adapter, d.engine_model)

    def process(self) -> ProcessView | None:
        proc = self._proc
        if proc is None or proc.reaper_pid is None:
            return None
        return ProcessView(proc.pid, proc.port, proc.argv, reaper_pid=proc.reaper_pid)

    def describe(self) -> Described:
        warm = self._warm.shown()  # None where its engine's kind keeps none
        if warm is None:
            return self.seen.described()
        seen = self.seen.described((Shown("warm_cache", warm.line()),), warm_cache=warm.row())
        return replace(seen, warm=warm)

    def log(self) -> ShownLog | None:
        return self._log

    def holdup(self) -> str | None:
        return None

    def why_unreachable(self) -> str:
        return "dispatch_closed"  # never: this machine is always reached

    def begin(self, exchange: Tracked) -> None:
        """Nothing ends one here from outside; the engine's cache may hold something new."""
        self._warm.began()

    def end(self, exchange: Tracked) -> None:
        """See `begin`."""

    def cannot_start(self) -> str | None:
        return None  # its engine runs here: nothing to reach first

    async def start(self, reason: str) -> str:
        inst, d = self._inst, self._dep
        launch = inst.launch
        if launch is None:
            raise StartFailedError(f"{inst.where} is an engine someone else runs")
        for _ in range(PORT_TRIES):
            proc, self._log = _process(inst, d, launch, self._log_dir, self._warm.flags())
            self._proc = proc
            try:
                await proc.start(self._session, launch.startup_timeout)
                break
            except PortLostError:  # taken between our look and its bind: another, unseen
                self._proc = None
                logger.warning(
                    "%s: port %d was taken before the engine bound it: it starts on another",
                    inst.where,
                    proc.port,
                )
            except StartFailedError as exc:
                self._proc = None
                _failed(inst, exc, self._log, proc.log)
                raise
            except BaseException:
                await proc.stop()
                self._proc = None
                raise
        else:
            raise StartFailedError(f"the engine lost its port {PORT_TRIES} times as it started")
        inst.bind(proc.url)
        self.watch()
        remember(self._store, inst.key, proc.pid)
        if d.parks and not d.router:  # what its wake checks will be compared with
            self._recorded = await record(self._session, inst, d)
        inst.restored = await self._warm.restore(proc.url, auth_of(inst))  # before it admits
        return f"answered on port {proc.port}"

    async def park(self, reason: str) -> None:
        await _drive(self._session, self._inst, self._dep, park=True)

    async def wake(self, reason: str) -> None:
        inst, d = self._inst, self._dep
        await _drive(self._session, inst, d, park=False)
        if self._recorded is not None:
            await check(self._session, inst, d, self._recorded)

    async def stop(self, reason: str) -> bool:
        proc = self._proc  # what it cached, for its next start
        if proc is not None and not proc.exited():
            await self._warm.save(proc.url, auth_of(self._inst), self.seen.silent_s())
        self._warm.stopped()
        self.seen.unwatch()
        if self._proc is not None:
            await self._proc.stop()
            self._proc = None
            remember(self._store, self._inst.key, None)
        return True  # its process group is gone: nothing it counted can still run

    async def gone(self) -> str:
        if self._proc is not None and self._proc.proc is not None:
            await self._proc.proc.wait()
        return self.exited() or await never()  # stopped as asked: nothing to report

    def exited(self) -> str | None:
        proc = self._proc
        if proc is None or not proc.exited():
            return None
        code = proc.proc.returncode if proc.proc is not None else None
        return f"the engine exited with status {code}"


def _process(
    inst: EngineInstance, d: Deployment, launch: Launch, log_dir: Path, extra: list[str]
) -> tuple[EngineProcess, ShownLog]:
    """The engine's process on a free port (not started), and its log as the gateway shows it:
    the engine's output may carry its keys (vLLM prints its arguments), masked as ``status``
    masks a command line, and the engine's own key wherever it appears."""
    port = free_port()
    log = EngineLog(log_dir, file_stem(d.name, inst.index), launch.logs)
    sleep = d.parks and not d.router  # a router parks by unloading: no flags
    argv = [*launch_argv(d.engine, launch, port, sleep=sleep), *extra]
    env = launch_env(d.engine, launch, sleep=sleep)
    secrets = [s for s in (inst.engine_key, *secrets_in(argv, env)) if s]
    return EngineProcess(argv, env, log, port), ShownLog(log, secrets)


def _failed(inst: EngineInstance, exc: StartFailedError, shown: ShownLog, log: EngineLog) -> None:
    tail = masked(exc.log_tail.rstrip(), shown.secrets)
    logger.error(
        "%s did not start: %s; its log %s ends:\n%s", inst.where, exc.message, log.path, tail
    )


async def _drive(
    session: aiohttp.ClientSession, inst: EngineInstance, d: Deployment, *, park: bool
) -> None:
    """Park or wake the engine through its own routes (``parking.py``), with its key, and the
    model's name for a router."""
    if inst.url is None:
        raise StartFailedError(f"{inst.where} has no engine to drive")
    model = d.engine_model if d.router else None
    await drive(session, d.engine, inst.url, auth_of(inst), model, park=park)
