"""Starting and stopping launched instances, each transition logged as a ``lifecycle`` event
with the deployment, instance, from, to, reason and how long the state before lasted."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from .._deployments.routes import EngineInstance
from .._deployments.settle import Settlement
from .._log import event
from .parking import ParkFailedError, drive
from .process import EngineProcess, StartFailedError, free_port, launch_argv, launch_env
from .states import HOLDING, DeploymentLife, InstanceState, Launched

__all__ = ["Transitions"]

logger = logging.getLogger("capyctl_gateway")


class Transitions:
    def __init__(
        self,
        lives: dict[str, DeploymentLife],
        settlement: Settlement,
        *,
        session: Callable[[], aiohttp.ClientSession | None],
        on_ready: Callable[[EngineInstance], None],
        on_stopped: Callable[[EngineInstance], None],
        log_dir: Path,
        remote: Callable[[EngineInstance, str, str, float], Awaitable[None]] | None = None,
    ) -> None:
        """``remote(inst, op, reason, timeout)``: has an instance's host carry out ``op``."""
        self.remote = remote
        self.lives = lives
        self._settlement = settlement
        self._session = session
        self._on_ready = on_ready
        self._on_stopped = on_stopped
        self.log_dir = log_dir
        self.observers: list[Callable[[Launched], None]] = []
        """Called after each transition (tests; what status shows is read, not pushed)."""

    async def start(self, lc: Launched) -> None:
        inst = lc.inst
        assert inst.launch is not None
        life = self.lives[inst.deployment]
        dep = life.deployment
        session = self._session()
        if session is None:
            raise StartFailedError("the gateway is stopping")
        self.move(lc, InstanceState.STARTING, "a request is waiting")
        if inst.remote is not None:
            await _order(self, lc, "start", "a request is waiting", inst.launch.startup_timeout)
            return
        port = free_port()
        log = self.log_dir / f"{dep.name}-{inst.index}.log"
        sleep = life.parks and not dep.router  # a router parks by unloading: no flags
        argv = launch_argv(dep.engine, inst.launch, port, sleep=sleep)
        env = launch_env(dep.engine, inst.launch, sleep=sleep)
        proc = EngineProcess(argv, env, log, port)
        lc.process = proc
        try:
            await proc.start(session, inst.launch.startup_timeout)
        except StartFailedError as exc:
            lc.failure = exc.message
            logger.error(
                "%s did not start: %s; its log %s ends:\n%s", inst.where, exc.message, log,
                exc.log_tail.rstrip(),
            )  # fmt: skip
            self.move(lc, InstanceState.FAILED, exc.message)
            lc.process = None
            raise
        except BaseException:
            await proc.stop()
            lc.process = None
            self.move(lc, InstanceState.STOPPED, "start abandoned")
            raise
        lc.failure = None
        inst.bind(proc.url)
        self._on_ready(inst)
        inst.available = True
        life.route.notify()
        self.move(lc, InstanceState.READY, f"answered on port {port}")

    async def park(self, lc: Launched, reason: str) -> None:
        """Park with the process up (the engine gives its memory back); a stop if it fails."""
        inst = lc.inst
        session = self._session()
        if (
            session is None
            or (inst.url is None and inst.remote is None)
            or lc.state is not InstanceState.READY
        ):
            return
        inst.available = False
        self.move(lc, InstanceState.PARKING, reason)
        if inst.remote is not None:
            try:
                await _order(self, lc, "park", reason, 120.0)
            except StartFailedError as exc:
                logger.warning("%s did not park (%s); stopping it instead", inst.where, exc)
                await self.stop_one(lc, f"could not park: {exc}")
            return
        dep = self.lives[inst.deployment].deployment
        model = dep.engine_model if dep.router else None
        assert inst.url is not None
        try:
            await drive(session, dep.engine, inst.url, _auth(inst), model, park=True)
        except ParkFailedError as exc:
            logger.warning("%s did not park (%s); stopping it instead", inst.where, exc)
            await self.stop_one(lc, f"could not park: {exc}")
            return
        self.move(lc, InstanceState.PARKED, reason)

    async def wake(self, lc: Launched) -> None:
        """Wake a parked instance; a wake that fails stops it (StartFailedError)."""
        inst = lc.inst
        session = self._session()
        if session is None or (inst.url is None and inst.remote is None):
            raise StartFailedError("the gateway is stopping")
        self.move(lc, InstanceState.WAKING, "a request is waiting")
        if inst.remote is not None:
            try:
                await _order(self, lc, "wake", "a request is waiting", 600.0)
            except StartFailedError:
                await self.stop_one(lc, "could not wake")
                raise
            return
        dep = self.lives[inst.deployment].deployment
        model = dep.engine_model if dep.router else None
        assert inst.url is not None
        try:
            await drive(session, dep.engine, inst.url, _auth(inst), model, park=False)
        except ParkFailedError as exc:
            await self.stop_one(lc, f"could not wake: {exc}")
            self.move(lc, InstanceState.FAILED, f"could not wake: {exc}")
            raise StartFailedError(f"the engine did not wake: {exc}") from None
        inst.available = True
        self.lives[inst.deployment].route.notify()
        self.move(lc, InstanceState.READY, "woke")

    async def stop(self, life: DeploymentLife, reason: str) -> None:
        await asyncio.gather(*(self.stop_one(lc, reason) for lc in life.launched))

    async def stop_one(self, lc: Launched, reason: str) -> None:
        if lc.state not in HOLDING and lc.state is not InstanceState.PARKED and lc.process is None:
            return
        inst = lc.inst
        inst.available = False
        self.move(lc, InstanceState.STOPPING, reason)
        self._on_stopped(inst)
        if inst.remote is not None:
            try:
                await _order(self, lc, "stop", reason, 60.0)
            except StartFailedError as exc:  # its cut requests stay counted: unproven
                logger.warning("%s: its host did not confirm the stop (%s)", inst.where, exc)
                self.move(lc, InstanceState.STOPPED, f"{reason}; unconfirmed: {exc}")
                return
            self._settlement.settle_all(inst.ledger, "engine stopped by its host")
            return
        if lc.process is not None:
            await lc.process.stop()
            lc.process = None
        # A stopped engine runs nothing: every cut request it still counted is settled.
        self._settlement.settle_all(inst.ledger, "engine stopped by the gateway")
        self.move(lc, InstanceState.STOPPED, reason)

    def move(self, lc: Launched, to: InstanceState, reason: str) -> None:
        now = time.monotonic()
        before, took = lc.state, now - lc.since
        lc.state, lc.since = to, now
        for observe in self.observers:
            observe(lc)
        inst = lc.inst
        event(
            "lifecycle", "%s: %s -> %s (%s; %.1f s)", inst.where, before.value, to.value, reason,
            took, deployment=inst.deployment, instance=inst.index, **{"from": before.value},
            to=to.value, reason=reason, duration_s=round(took, 3),
        )  # fmt: skip


async def _order(engines: Transitions, lc: Launched, op: str, reason: str, within: float) -> None:
    """Have the instance's host carry out ``op``; the state it reaches is the one its
    host reports. Raises StartFailedError when it could not."""
    assert engines.remote is not None
    goal = _GOALS[op]
    try:
        await engines.remote(lc.inst, op, reason, within)
    except Exception as exc:  # the host's words, or its session gone
        lc.failure = str(exc)
        if op != "stop":
            engines.move(lc, InstanceState.FAILED, f"{op} on its host failed: {exc}")
        raise StartFailedError(str(exc)) from None
    lc.failure = None
    if goal is InstanceState.READY:  # its host reported it with its gate open
        lc.inst.available = lc.inst.gate_open
        engines.lives[lc.inst.deployment].route.notify()
    engines.move(lc, goal, f"{reason} (on host {lc.inst.remote})")


_GOALS = {
    "start": InstanceState.READY,
    "wake": InstanceState.READY,
    "park": InstanceState.PARKED,
    "stop": InstanceState.STOPPED,
}


def _auth(inst: EngineInstance) -> dict[str, str]:
    key = inst.engine_key
    return {"Authorization": f"Bearer {key}"} if key is not None else {}
