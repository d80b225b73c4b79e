"""The fleet: every engine one process serves, and everything that watches and drives them.

`open_fleet` opens the parts in the order each needs the one before: the store, the engine
connections, the collector, settlement (given the collector's poll control), the routes with
a runner for each instance (made by the registry of runner kinds, ``_runners.py``), the
cut requests a previous run left, the lifecycle, and the server's view of its hosts. Nothing in
a `Fleet` is missing or filled in later; closing it ends them in the reverse order (the engines
this process started are stopped before the collector and the connections close).

A gateway opens one fleet for its public listener (``_http/app.py``); a host opens one for the
deployments its server placed on it (``_host.py``). Never imports the HTTP surface, the relay
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

from canopyx_provider import AiohttpFetcher, Collector, EngineRestarted, Event, ProviderOptions

from ._clock import wall
from ._config import GatewayConfig
from ._deployments.build import build_routes
from ._deployments.checks import CheckWatch
from ._deployments.kinds import Opened
from ._deployments.routes import Route
from ._deployments.settle import CutRequest, Settlement
from ._engine_client import IDLE_S, EngineClient
from ._errors import UnavailableError
from ._lifecycle.controller import Lifecycle
from ._lifecycle.states import InstanceState, Launched
from ._lifecycle.watch import boot
from ._loop import running_loop
from ._machines.enroll import Invites, ServerIdentity
from ._machines.server import Machines
from ._runners import KINDS, RunnerKind, host_links, open_rooms, runner_for
from ._store import Store, restore
from ._tasks import Supervisor
from ._telemetry import Telemetry
from ._ulid import new_short_ids

__all__ = ["Fleet", "open_fleet"]

COLLECTOR_CONNECTIONS_PER_ENGINE = 4


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
    logs = engine_logs or (
        state_dir / "logs"
        if state_dir is not None
        else Path(tempfile.mkdtemp(prefix="capyctl-engines-"))
    )
    async with contextlib.AsyncExitStack() as stack:
        store = Store(state_dir / "gateway.sqlite3") if state_dir is not None else None
        if store is not None:
            stack.callback(store.close)  # last: after the engines' stops have settled
        session = await stack.enter_async_context(_engine_session(config))
        engines = EngineClient(connect_timeout=config.queue.connect_timeout)
        stack.push_async_callback(engines.close)
        drains: set[asyncio.Task[None]] = set()
        stack.push_async_callback(_cancel, drains)
        collector = await stack.enter_async_context(_collector(options, clock))
        settlement = Settlement(
            clock,
            poll=_poll_control(collector),
            absence_s=options.request_timeout_s,
            on_cut=store.add_cut if store is not None else None,
            on_settled=_settled(telemetry, store),
        )
        faults: Counter[str] = Counter()  # the lifecycle's and each runner kind's defects
        opened = Opened(
            config=config,
            collector=collector,
            session=session,
            settlement=settlement,
            log_dir=logs,
            clock=clock,
            loop_time=running_loop().time,
            store=store,
            env=env,
            stack=stack,
            faults=faults,
            warm_dir=state_dir / "warm" if state_dir is not None else None,
        )
        rooms = await open_rooms(opened, runners)  # what each kind shares (a cluster's watches)
        names = [d.name for d in config.deployments]
        ids = store.deployment_ids(names) if store is not None else new_short_ids(names)
        routes = build_routes(config, env, settlement, runner_for(rooms, runners), ids)
        collector.subscribe(CheckWatch(routes))
        collector.subscribe(settlement)
        tasks = Supervisor("the lifecycle", faults=faults)
        lifecycle = Lifecycle(
            config,
            routes,
            settlement,
            tasks=tasks,
            remember=(lambda n, s, t: store.set_intent(n, stopped=s, started=t)) if store else None,
        )
        lifecycle.engines.observers.append(_transitions(telemetry))
        lifecycle.engines.observers.append(_left_ready(routes))
        settlement.observers.append(_restarted(routes))
        for room in rooms.values():  # a previous run's engines go before this one starts any
            await room.take_up(lifecycle.found)
        if store is not None:  # the collector polls: a restored cut is polled fast at once
            restore(store, routes, settlement, lifecycle)
        machines = None
        if server is not None:
            invites = Invites((state_dir or server.directory.parent) / "machines.sqlite3")
            links = host_links(rooms)
            machines = Machines(
                config, links, identity=server, invites=invites, found=lifecycle.found, clock=clock
            )
        boot(lifecycle)  # what is kept ready, and what an operator had started
        stack.push_async_callback(lifecycle.shutdown)  # its tasks end, then its engines stop
        lifecycle.watch()
        yield Fleet(
            config=config,
            clock=clock,
            routes=routes,
            settlement=settlement,
            session=session,
            engines=engines,
            drains=drains,
            collector=collector,
            lifecycle=lifecycle,
            machines=machines,
            store=store,
            tasks=tasks,
        )


def _engine_session(config: GatewayConfig) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=IDLE_S
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.queue.connect_timeout),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies; skip the jar
    )


@contextlib.asynccontextmanager
async def _collector(
    options: ProviderOptions, clock: Callable[[], float]
) -> AsyncIterator[Collector]:
    """The collector, fetching through its own aiohttp session (cheaper per GET than the SDK's
    default httpx client): a few kept-alive connections per engine, each GET bounded by the
    collector's request timeout."""
    timeout_s = options.request_timeout_s
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0,
            limit_per_host=COLLECTOR_CONNECTIONS_PER_ENGINE,
            keepalive_timeout=IDLE_S,
        ),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),
    ) as http:
        fetcher = AiohttpFetcher(http, timeout_s=timeout_s, clock=clock)
        async with Collector(options=options, fetcher=fetcher, clock=clock) as collector:
            yield collector


def _poll_control(collector: Collector) -> Callable[[str, int | None], None]:
    def poll(key: str, interval_ms: int | None) -> None:
        if key in collector.keys():  # noqa: SIM118 (a stopped engine, or one on a host, is not)
            collector.set_poll_interval(key, interval_ms)

    return poll


def _settled(
    telemetry: Telemetry, store: Store | None
) -> Callable[[str, list[CutRequest], str], None]:
    def settled(key: str, cuts: list[CutRequest], why: str) -> None:
        deployment, _, index = key.rpartition("/")
        telemetry.settled[(deployment, index, why)] += len(cuts)
        if store is not None:
            store.settled(key, cuts)

    return settled


def _transitions(telemetry: Telemetry) -> Callable[[Launched], None]:
    def count(lc: Launched) -> None:
        telemetry.transitions[(lc.inst.deployment, lc.state.value)] += 1

    return count


def _left_ready(routes: Mapping[str, Route]) -> Callable[[Launched], None]:
    """A launched instance that is not ready (stopping, parking, failed, starting) has lost
    its KV cache, or is about to: prefix routing forgets what it held."""

    def forget(lc: Launched) -> None:
        prefixes = routes[lc.inst.deployment].prefixes
        if prefixes is not None and lc.state is not InstanceState.READY:
            prefixes.forget(lc.inst.index)

    return forget


def _restarted(routes: Mapping[str, Route]) -> Callable[[Event], None]:
    """An engine the collector saw restart (one someone else runs, too) has an empty cache."""
    keyed = {i.key: (r, i.index) for r in routes.values() for i in r.instances}

    def forget(event: Event) -> None:
        if isinstance(event, EngineRestarted) and event.key in keyed:
            route, index = keyed[event.key]
            if route.prefixes is not None:
                route.prefixes.forget(index)

    return forget


async def _cancel(drains: set[asyncio.Task[None]]) -> None:
    for task in list(drains):
        task.cancel()  # each closes its connection
    await asyncio.gather(*drains, return_exceptions=True)
