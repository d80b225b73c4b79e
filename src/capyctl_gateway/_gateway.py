"""What one gateway process holds: its configuration, key, routes, engine connections and the
collector that watches the engines. No module globals; the HTTP surface reads it, the rooms
below it never import it.

Two lifetimes are tied to the application's (as aiohttp cleanup contexts): the engine session
(its connection pool, and the connections still draining after an answer) and the collector
(its own small session; it polls every instance and feeds `Settlement`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from canopyx_provider import AiohttpFetcher, Collector, ProviderOptions, adapter_for

from ._config import GatewayConfig
from ._deployments.checks import CheckWatch
from ._deployments.queue import BodyBudget
from ._deployments.routes import EngineInstance, Route, build_routes, usage_penalty
from ._deployments.settle import CutRequest, Settlement
from ._lifecycle.controller import Lifecycle
from ._lifecycle.states import InstanceState, Launched
from ._machines.enroll import Invites, ServerIdentity
from ._machines.protocol import InstanceReport
from ._machines.server import Machines
from ._store import Store, restore
from ._telemetry import Telemetry

__all__ = [
    "IDLE_CONNECTION_S",
    "Gateway",
    "engine_collector",
    "engine_lifecycle",
    "engine_session",
    "candidates",
    "remote_report",
    "skipped",
]

IDLE_CONNECTION_S = 4.0
"""How long an idle engine connection stays pooled: under the 5 s after which llama-server and
uvicorn (vLLM, SGLang) close one, so that the gateway never sends on a connection the engine
is closing at that moment (measured on llama-server b10798: idle 5.5 s, then the next request
met a closed connection)."""


class Gateway:
    """Everything one gateway process holds."""

    def __init__(
        self,
        config: GatewayConfig,
        api_key: str,
        *,
        env: Mapping[str, str] | None = None,
        collector_options: ProviderOptions | None = None,
        clock: Callable[[], float] = time.time,
        engine_logs: Path | None = None,
        state_dir: Path | None = None,
        server: ServerIdentity | None = None,
    ) -> None:
        """Raises ConfigError when an instance's engine key is not in ``env``.
        ``server``: the control identity of a gateway in the server role (its instances run on
        hosts; see `Machines`). ``engine_logs``: where launched engines write their output
        (default: ``<state_dir>/logs``, or a new temporary directory). ``state_dir``: where
        operator intent and cut requests outlive the process (``gateway.sqlite3``); None keeps
        them in memory only."""
        self.config = config
        self._key = api_key.encode()
        self.collector_options = collector_options or ProviderOptions()
        self.clock = clock
        self.collector: Collector | None = None
        self.telemetry = Telemetry()
        """The gateway's own counts and timings (read by the /metrics exposition)."""
        self.store = Store(state_dir / "gateway.sqlite3") if state_dir is not None else None
        store = self.store
        self.settlement = Settlement(
            clock,
            poll=self._set_poll_interval,
            on_cut=store.add_cut if store is not None else None,
            on_settled=self._settled,
        )
        self.routes: dict[str, Route] = build_routes(
            config, os.environ if env is None else env, self.settlement
        )
        self.bodies = BodyBudget(config.limits.max_body_bytes_in_flight)
        """Request-body bytes read and held, over all requests."""
        self.checks = CheckWatch(self.routes)
        if engine_logs is None:
            engine_logs = (
                state_dir / "logs"
                if state_dir is not None
                else Path(tempfile.mkdtemp(prefix="capyctl-engines-"))
            )
        logs = engine_logs
        self.machines: Machines | None = None
        if server is not None:
            invites = Invites((state_dir or server.directory.parent) / "machines.sqlite3")
            self.machines = Machines(
                config, self.routes, self.settlement, identity=server, invites=invites,
                clock=clock, on_report=lambda inst, r: remote_report(self, inst, r),
            )  # fmt: skip
        self.lifecycle = Lifecycle(
            config,
            self.routes,
            self.settlement,
            session=lambda: self.session,
            on_ready=self._engine_ready,
            on_stopped=self._engine_stopped,
            log_dir=logs,
            remote=self.machines.order if self.machines is not None else None,
            remember=(
                (
                    lambda name, stopped, started: store.set_intent(
                        name, stopped=stopped, started=started
                    )
                )
                if store is not None
                else None
            ),
        )
        self.lifecycle.engines.observers.append(self._transition)
        if store is not None:
            restore(store, self.routes, self.settlement, self.lifecycle)
        self.started_at = int(clock())
        self.session: aiohttp.ClientSession | None = None
        self.drains: set[asyncio.Task[None]] = set()
        """Engine connections waiting for the end of a finished answer's body."""
        self.models_document = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": d.name,
                        "object": "model",
                        "created": self.started_at,
                        "owned_by": "capyctl",
                        "capyctl": {"api": d.api.value},
                    }
                    for d in config.deployments
                ],
            }
        )

    def now(self) -> float:
        return self.clock()

    def authorized(self, header: str) -> bool:
        """Whether an ``Authorization`` header value carries the gateway's key."""
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: keep them comparable.
        return hmac.compare_digest(key.lstrip(" ").encode("utf-8", "surrogateescape"), self._key)

    def load(self, instance: EngineInstance) -> int:
        """What routing weighs: the engine's running and waiting requests from a fresh sample,
        never less than the requests the gateway has in flight there, plus a penalty for a
        nearly full KV cache; without a fresh sample, the requests in flight alone."""
        running = instance.ledger.running
        if instance.remote is not None:
            machines = self.machines
            r = machines.fresh(instance, asyncio.get_running_loop().time()) if machines else None
            if r is None or r.running is None or r.waiting is None:
                return running
            return max(running, r.running + r.waiting) + usage_penalty(r.usage)
        snap = self.collector.snapshot(instance.key) if self.collector is not None else None
        if snap is not None:
            m = snap.metrics
            if m.running_requests is not None and m.waiting_requests is not None:
                usage = m.kv_cache_usage_ratio
                penalty = usage_penalty(usage if usage is not None else m.slot_usage_ratio)
                return max(running, int(m.running_requests + m.waiting_requests)) + penalty
        return running

    def _settled(self, key: str, cuts: list[CutRequest], why: str) -> None:
        deployment, _, index = key.rpartition("/")
        self.telemetry.settled[(deployment, index, why)] += len(cuts)
        if self.store is not None:
            self.store.settled(key, cuts)

    def _transition(self, lc: Launched) -> None:
        self.telemetry.transitions[(lc.inst.deployment, lc.state.value)] += 1

    def _engine_ready(self, inst: EngineInstance) -> None:
        """A launched engine answers: the collector watches it from now on."""
        if self.collector is not None and inst.url is not None and inst.remote is None:
            d = self.routes[inst.deployment].deployment
            adapter = adapter_for(d.engine, inst.url, api_key=inst.engine_key, router=d.router)
            self.collector.add(inst.key, adapter, model_id=d.engine_model)

    def _engine_stopped(self, inst: EngineInstance) -> None:
        if self.collector is not None:
            with contextlib.suppress(KeyError):  # never added: it did not answer
                self.collector.remove(inst.key)
        inst.unusable = None  # its next process is checked afresh

    def _set_poll_interval(self, key: str, interval_ms: int | None) -> None:
        if self.collector is not None and key in self.collector.keys():  # noqa: SIM118
            self.collector.set_poll_interval(key, interval_ms)  # (a stopped engine is not)


# -- several machines ----------------------------------------------------------------------
def skipped(gw: Gateway, route: Route) -> list[str]:
    """Why each instance of ``route`` that takes no request now is skipped."""
    out = []
    for i in route.instances:
        if i.unusable:
            out.append(f"{i.where}: {i.unusable}")
        elif i.remote is not None and gw.machines is not None:
            if i.remote not in gw.machines.sessions:
                out.append(f"{i.where}: host_session_lost")
            elif not i.available:
                out.append(f"{i.where}: dispatch_closed")
        elif not i.available:
            out.append(f"{i.where}: not ready")
    return out


def candidates(
    gw: Gateway, route: Route, exclude: set[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a ``router_selection`` event shows: each instance that could take the request with
    its score and the sample it came from, and each one skipped with the reason."""
    loop_now, wall_now = asyncio.get_running_loop().time(), gw.clock()
    chosen: list[dict[str, Any]] = []
    skipped_: list[dict[str, Any]] = []
    machines = gw.machines
    for i in route.instances:
        reason = None
        if i.index in exclude:
            reason = "not_accepted"
        elif i.unusable:
            reason = "failed_checks"
        elif i.remote is not None and machines is not None and i.remote not in machines.sessions:
            reason = "host_session_lost"
        elif not i.available:
            reason = "dispatch_closed"
        if reason is not None:
            skipped_.append({"instance": i.index, "host": i.host, "reason": reason})
            continue
        row: dict[str, Any] = {"instance": i.index, "host": i.host,
                               "router_in_flight": i.ledger.running}  # fmt: skip
        running = waiting = usage = age = None
        if i.remote is not None and machines is not None:
            r = machines.fresh(i, loop_now)
            sample = machines.samples.get(i.key)
            if r is not None and sample is not None:
                running, waiting, usage = r.running, r.waiting, r.usage
                age = loop_now - sample.received_at + (r.age_s or 0.0)
        elif gw.collector is not None:
            snap = gw.collector.snapshot(i.key)
            if snap is not None:
                m = snap.metrics
                running, waiting, age = m.running_requests, m.waiting_requests, None
                usage = m.kv_cache_usage_ratio or m.slot_usage_ratio
                age = wall_now - snap.requested_at
        engine = running is not None and waiting is not None
        row.update(
            engine_running=running, engine_waiting=waiting, usage=usage,
            sample_age_ms=None if age is None else round(age * 1000),
            load_source="engine" if engine else "router_in_flight", score=gw.load(i),
        )  # fmt: skip
        chosen.append(row)
    return chosen, skipped_


def remote_report(gw: Gateway, inst: EngineInstance, report: InstanceReport) -> None:
    """A host says its engine exited: the server's state follows (its next request
    starts it again)."""
    life = gw.lifecycle.lives.get(inst.deployment)
    lc = next((x for x in life.launched if x.inst is inst), None) if life else None
    if lc is None or lc.state not in (InstanceState.READY, InstanceState.PARKED):
        return
    if report.state in ("stopped", "failed"):
        lc.failure = report.failure or "the engine exited on its host"
        gw.lifecycle.engines.move(lc, InstanceState.FAILED, lc.failure)


# -- lifetimes (aiohttp cleanup contexts, in this order; they end in the reverse one) ------
async def engine_lifecycle(gw: Gateway) -> AsyncIterator[None]:
    """Launched engines: the idle watch runs while the app serves; at the end every
    engine the gateway started is stopped (before the collector and the session)."""
    watch = asyncio.get_running_loop().create_task(gw.lifecycle.run())
    try:
        yield
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await gw.lifecycle.shutdown()


async def engine_session(gw: Gateway) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=IDLE_CONNECTION_S
    )
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=gw.config.queue.connect_timeout),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies; skip the jar
    ) as session:
        gw.session = session
        try:
            yield
        finally:
            gw.session = None
            for task in list(gw.drains):
                task.cancel()  # each closes its connection
            await asyncio.gather(*gw.drains, return_exceptions=True)
            if gw.store is not None:
                gw.store.close()  # after the engines' stops have settled what they could


async def engine_collector(gw: Gateway) -> AsyncIterator[None]:
    """Polls each instance, and settles cut requests. It fetches through its own aiohttp
    session (cheaper per GET than the SDK's default httpx client): at most 4 kept-alive
    connections per engine, each GET bounded by the collector's request timeout."""
    timeout_s = gw.collector_options.request_timeout_s
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0, limit_per_host=4, keepalive_timeout=IDLE_CONNECTION_S
        ),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),
    ) as session:
        collector = Collector(
            options=gw.collector_options,
            fetcher=AiohttpFetcher(session, timeout_s=timeout_s, clock=gw.clock),
            clock=gw.clock,
            hooks=[gw.checks, gw.settlement],
        )
        async with collector:
            for route in gw.routes.values():
                d = route.deployment
                for inst in route.instances:
                    # A launched one is added once it answers; a remote one, its host watches.
                    if inst.url is not None and inst.remote is None:
                        adapter = adapter_for(d.engine, inst.url, api_key=inst.engine_key)
                        collector.add(inst.key, adapter, model_id=d.engine_model)
            gw.collector = collector
            try:
                yield
            finally:
                gw.collector = None
