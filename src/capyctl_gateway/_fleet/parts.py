"""What `open_fleet` opens before any engine is known (`open_links`: the engine connections,
the collector and settlement) and the observers it wires between the parts: transitions
counted, cut requests settled into the store, prefix routing told of a cache lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import NamedTuple

import aiohttp

from canopyx_provider import AiohttpFetcher, Collector, EngineRestarted, Event, ProviderOptions

from .._config import GatewayConfig
from .._deployments.routes import Route
from .._deployments.settle import CutRequest, Settlement
from .._engine_client import IDLE_S, EngineClient
from .._lifecycle.states import InstanceState, Launched
from .._store import Store
from .._telemetry import Telemetry

COLLECTOR_CONNECTIONS_PER_ENGINE = 4


class Links(NamedTuple):
    """The connections to the engines and what reads them, open for the fleet's life."""

    session: aiohttp.ClientSession
    engines: EngineClient
    drains: set[asyncio.Task[None]]
    collector: Collector
    settlement: Settlement


async def open_links(
    stack: contextlib.AsyncExitStack,
    config: GatewayConfig,
    options: ProviderOptions,
    clock: Callable[[], float],
    store: Store | None,
    telemetry: Telemetry,
) -> Links:
    """Open the engine connections, the collector and settlement (given the collector's poll
    control) on ``stack``, which closes them in the reverse order."""
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
    return Links(session, engines, drains, collector, settlement)


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


def transitions(telemetry: Telemetry) -> Callable[[Launched], None]:
    def count(lc: Launched) -> None:
        telemetry.transitions[(lc.inst.deployment, lc.state.value)] += 1

    return count


def left_ready(routes: Mapping[str, Route]) -> Callable[[Launched], None]:
    """A launched instance that is not ready (stopping, parking, failed, starting) has lost
    its KV cache, or is about to: prefix routing forgets what it held."""

    def forget(lc: Launched) -> None:
        prefixes = routes[lc.inst.deployment].prefixes
        if prefixes is not None and lc.state is not InstanceState.READY:
            prefixes.forget(lc.inst.index)

    return forget


def restarted(routes: Mapping[str, Route]) -> Callable[[Event], None]:
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
