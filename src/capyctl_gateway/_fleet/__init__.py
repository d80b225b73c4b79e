"""The fleet: every engine one process serves, and everything that watches and drives them.

`open_fleet` opens the parts in the order each needs the one before: the store, the engine
connections, the collector, settlement (given the collector's poll control), the routes with
a runner for each instance (made by the registry of runner kinds, ``_runners.py``), the
cut requests a previous run left, the lifecycle, and the server's view of its hosts. Nothing in
a `Fleet` is missing or filled in later; closing it ends them in the reverse order (the engines
this process started are stopped before the collector and the connections close).

A gateway opens one fleet for its public listener (``_http/app.py``); a host opens one for the
deployments its server placed on it (``_host/``). What it opens first and the observers it
wires between the parts are in ``parts.py``. Never imports the HTTP surface, the relay
or management.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from canopyx_provider import Collector, ProviderOptions

from .._clock import wall
from .._config import GatewayConfig, Instance
from .._deployments.build import build_routes
from .._deployments.checks import CheckWatch
from .._deployments.kinds import Opened, Room
from .._deployments.routes import EngineInstance, Route
from .._deployments.runner import Runner
from .._deployments.settle import Settlement
from .._engine_client import EngineClient
from .._errors import UnavailableError
from .._lifecycle.controller import Lifecycle
from .._lifecycle.watch import boot
from .._loop import running_loop
from .._machines.enroll import Invites, ServerIdentity
from .._machines.server import Machines
from .._runners import KINDS, RunnerKind, host_links, open_rooms, runner_for
from .._store import Store, restore
from .._tasks import Supervisor
from .._telemetry import Telemetry
from .._ulid import new_short_ids
from .parts import left_ready, open_links, restarted, transitions

__all__ = ["Fleet", "open_fleet"]


@dataclass(eq=False)
class Fleet:
    """The engines of one process and what watches and drives them (see `open_fleet`)."""

    config: GatewayConfig
    clock: Callable[[], float]
    routes: dict[str, Route]
    settlement: Settlement
    session: aiohttp.ClientSession
    """For the engines' other routes (health checks, sleep and wake, the router's loads)."""
    engines: EngineClient
    """What sends chat and decision requests to the engines."""
    drains: set[asyncio.Task[None]]
    """Engine connections waiting for the end of a finished answer's body."""
    collector: Collector
    lifecycle: Lifecycle
    machines: Machines | None
    """The server role's hosts; None on a gateway that has none."""
    store: Store | None
    """Operator intent and cut requests kept across restarts; None without a state directory."""
    tasks: Supervisor
    """The lifecycle's background tasks (activations, closings, watches), and their faults
    (with those of each runner kind's own tasks: a pod watch, an owed delete)."""

    def now(self) -> float:
        return self.clock()

    def quiet(self) -> bool:
        """Whether no request runs or waits anywhere."""
        return not any(r.queue.running or r.queue.waiting for r in self.routes.values())

    def end_all(self, why: str) -> int:
        """End every request now (a stopping gateway's last word): each exchange in flight is
        ended (a stream with an in-band error event), each waiting request answered 503
        ``shutting_down``; how many were ended."""
        ended = 0
        for route in self.routes.values():
            ended += route.queue.fail_waiters(lambda: UnavailableError(why, code="shutting_down"))
            ended += route.abort_running(why, "shutting_down")
        return ended


@contextlib.asynccontextmanager
async def open_fleet(
    config: GatewayConfig,
    *,
    env: Mapping[str, str],
    telemetry: Telemetry,
    collector_options: ProviderOptions | None = None,
    clock: Callable[[], float] = wall,
    engine_logs: Path | None = None,
    state_dir: Path | None = None,
    server: ServerIdentity | None = None,
    runners: Mapping[str, RunnerKind] = KINDS,
) -> AsyncIterator[Fleet]:
    """Open the fleet for ``config`` (raises ConfigError for an engine key not in ``env``).

    ``server``: the control identity of a gateway in the server role (its instances on hosts
    are reached through them). ``engine_logs``: where launched engines write their output
    (default: ``<state_dir>/logs``, or a new temporary directory). ``state_dir``: where operator
    intent and cut requests outlive the process (``gateway.sqlite3``). ``runners``: the
    registry of runner kinds (a test's, to run its engines elsewhere)."""
    options = collector_options or ProviderOptions()
    async with contextlib.AsyncExitStack() as stack:
        store = _store(stack, state_dir)
        links = await open_links(stack, config, options, clock, store, telemetry)
        opened = Opened(
            config=config,
            collector=links.collector,
            session=links.session,
            settlement=links.settlement,
            log_dir=_log_dir(engine_logs, state_dir),
            clock=clock,
            loop_time=running_loop().time,
            store=store,
            env=env,
            stack=stack,
            faults=Counter(),  # the lifecycle's and each runner kind's defects
            warm_dir=state_dir / "warm" if state_dir is not None else None,
        )
        rooms = await open_rooms(opened, runners)  # what each kind shares (a cluster's watches)
        routes = _routes(opened, runner_for(rooms, runners))
        lifecycle = _lifecycle(opened, routes, telemetry)
        await _take_up(opened, rooms, routes, lifecycle)
        machines = _machines(opened, server, state_dir, rooms, lifecycle) if server else None
        boot(lifecycle)  # what is kept ready, and what an operator had started
        stack.push_async_callback(lifecycle.shutdown)  # its tasks end, then its engines stop
        lifecycle.watch()
        yield Fleet(
            config=config,
            clock=clock,
            routes=routes,
            settlement=links.settlement,
            session=links.session,
            engines=links.engines,
            drains=links.drains,
            collector=links.collector,
            lifecycle=lifecycle,
            machines=machines,
            store=store,
            tasks=lifecycle.tasks,
        )


def _store(stack: contextlib.AsyncExitStack, state_dir: Path | None) -> Store | None:
    """The state directory's store, closed last (after the engines' stops have settled)."""
    if state_dir is None:
        return None
    store = Store(state_dir / "gateway.sqlite3")
    stack.callback(store.close)
    return store


def _machines(
    opened: Opened,
    server: ServerIdentity,
    state_dir: Path | None,
    rooms: Mapping[str, Room],
    lifecycle: Lifecycle,
) -> Machines:
    """The server role's view of its hosts, its invites kept beside its state."""
    invites = Invites((state_dir or server.directory.parent) / "machines.sqlite3")
    return Machines(
        opened.config,
        host_links(rooms),
        identity=server,
        invites=invites,
        found=lifecycle.found,
        clock=opened.clock,
    )


async def _take_up(
    opened: Opened, rooms: Mapping[str, Room], routes: dict[str, Route], lifecycle: Lifecycle
) -> None:
    """What a previous run left: its engines, taken up or stopped before this run starts any,
    and its cut requests (polled fast from the collector's first poll)."""
    for room in rooms.values():
        await room.take_up(lifecycle.found)
    if opened.store is not None:
        restore(opened.store, routes, opened.settlement, lifecycle)


def _log_dir(engine_logs: Path | None, state_dir: Path | None) -> Path:
    """Where launched engines write their output (see `open_fleet`)."""
    if engine_logs is not None:
        return engine_logs
    if state_dir is not None:
        return state_dir / "logs"
    return Path(tempfile.mkdtemp(prefix="capyctl-engines-"))


def _routes(
    opened: Opened, runner: Callable[[Instance], Callable[[EngineInstance], Runner]]
) -> dict[str, Route]:
    """The routes with a runner per instance, under the deployment IDs the store keeps (new
    ones without a store), watched by the startup checks and settlement."""
    config, store = opened.config, opened.store
    names = [d.name for d in config.deployments]
    ids = store.deployment_ids(names) if store is not None else new_short_ids(names)
    routes = build_routes(config, opened.env, opened.settlement, runner, ids)
    opened.collector.subscribe(CheckWatch(routes))
    opened.collector.subscribe(opened.settlement)
    return routes


def _lifecycle(opened: Opened, routes: dict[str, Route], telemetry: Telemetry) -> Lifecycle:
    """The lifecycle over ``routes``, its transitions counted and told to prefix routing,
    operator intent remembered in the store."""
    store = opened.store
    lifecycle = Lifecycle(
        opened.config,
        routes,
        opened.settlement,
        tasks=Supervisor("the lifecycle", faults=opened.faults),
        remember=(lambda n, s, t: store.set_intent(n, stopped=s, started=t)) if store else None,
    )
    lifecycle.engines.observers.append(transitions(telemetry))
    lifecycle.engines.observers.append(left_ready(routes))
    opened.settlement.observers.append(restarted(routes))
    return lifecycle
