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

import aiohttp
import orjson

from canopyx_provider import AiohttpFetcher, Collector, ProviderOptions, adapter_for

from ._config import GatewayConfig
from ._deployments.checks import CheckWatch
from ._deployments.queue import BodyBudget
from ._deployments.routes import EngineInstance, Route, build_routes, usage_penalty
from ._deployments.settle import CutRequest, Settlement
from ._engine_client import EngineClient
from ._lifecycle.controller import Lifecycle
from ._lifecycle.states import STARTABLE, InstanceState, Launched
from ._loop import running_loop
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
    "remote_report",
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
        """For the engines' other routes (health checks, sleep and wake, the router's loads)."""
        self.engines: EngineClient | aiohttp.ClientSession | None = None
        """What sends requests to the engines (``engine_client``)."""
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
            r = machines.fresh(instance, running_loop().time()) if machines else None
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
def remote_report(gw: Gateway, inst: EngineInstance, report: InstanceReport) -> None:
    """Keep the server's lifecycle state of a launched remote instance true to its host's
    report: an engine that exited there is failed here (its next request starts it again); one
    found running or parked there (a server that restarted, an answer lost with a session) is
    taken up as such, and stopped if an operator stopped its deployment."""
    life = gw.lifecycle.lives.get(inst.deployment)
    lc = next((x for x in life.launched if x.inst is inst), None) if life else None
    if life is None or lc is None:
        return
    if lc.state in (InstanceState.READY, InstanceState.PARKED):
        if report.state in ("stopped", "failed"):
            lc.failure = report.failure or "the engine exited on its host"
            gw.lifecycle.engines.move(lc, InstanceState.FAILED, lc.failure)
        elif (
            lc.state is InstanceState.READY
            and inst.gate_open
            and not inst.available
            and life.closing is None
            and not life.draining
        ):  # back after its host's session was lost (not closed to be drained): open again
            inst.available = True
            life.route.notify()
        return
    busy = life.closing is not None or (life.activation is not None and not life.activation.done())
    if busy or lc.state not in STARTABLE or report.state not in ("ready", "parked"):
        return
    found = InstanceState.READY if report.state == "ready" else InstanceState.PARKED
    lc.failure = None
    gw.lifecycle.engines.move(lc, found, f"found {report.state} on host {inst.remote}")
    if found is InstanceState.READY:
        inst.available = inst.gate_open
        life.route.notify()
    if life.operator_stopped:
        gw.lifecycle.rest(life, "stopped by an operator", may_park=False)


# -- lifetimes (aiohttp cleanup contexts, in this order; they end in the reverse one) ------
async def engine_lifecycle(gw: Gateway) -> AsyncIterator[None]:
    """Launched engines: the idle watch runs while the app serves; at the end every
    engine the gateway started is stopped (before the collector and the session)."""
    watch = running_loop().create_task(gw.lifecycle.run())
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
        lean = EngineClient(connect_timeout=gw.config.queue.connect_timeout)
        gw.engines = lean if gw.config.engine_client == "lean" else session
        try:
            yield
        finally:
            gw.session = gw.engines = None
            for task in list(gw.drains):
                task.cancel()  # each closes its connection
            await asyncio.gather(*gw.drains, return_exceptions=True)
            await lean.close()
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
