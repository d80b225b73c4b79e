"""Several machines in one process: a server gateway, its control listener over mutual TLS, and
hosts that enrolled with join files, each with its ingress in front of a fake engine, all on
loopback. (The live tier runs them as separate processes in network namespaces, with real
llama.cpp engines.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from capyctl_gateway import GATEWAY_KEY, Gateway, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._cli_common import TLS_HANDSHAKE_TIMEOUT_S, bind
from capyctl_gateway._cli_machines import control_runner, ingress_runner
from capyctl_gateway._host import Host, join
from capyctl_gateway._http.tls import TLSSite
from capyctl_gateway._machines import pki
from capyctl_gateway._machines.enroll import Invites, JoinError, JoinFile, ServerIdentity
from capyctl_gateway._machines.protocol import (
    INGRESS_MAX_BODY_BYTES,
    NOT_FORWARDED,
    deployment_tag,
    ingress_path,
)
from tests.gateway.conftest import COLLECTOR, KEY, WORKERS
from tests.gateway.fake_engine import FakeEngine, Hold, vllm_stream
from tests.gateway.freezer import Freezer
from tests.gateway.serving import serve_workers

workers = WORKERS  # the server relays through one process, and through two workers

pytestmark = pytest.mark.anyio


async def _site(
    runner: web.AppRunner, ssl_context: Any = None, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    addr = runner.addresses[0]
    return runner, f"{addr[0]}:{addr[1]}"


@dataclass
class Cluster:
    url: str
    server_state: Path
    control: str
    tmp: Path
    stops: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """What stops the server: its public listener (or its workers), then its control port."""
    workers: int = 1
    hosts: dict[str, tuple[Host, asyncio.Task[None], web.AppRunner]] = field(default_factory=dict)
    app: web.Application | None = None
    config: GatewayConfig | None = None
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    @property
    def gateway(self) -> Gateway:
        """The serving server's gateway (it must be serving)."""
        assert self.app is not None
        return self.app[GATEWAY_KEY]

    async def start_server(self) -> None:
        """Serve the server (again, on the same ports when it ran before)."""
        assert self.config is not None
        identity = ServerIdentity(self.server_state / "identity")
        identity.ensure()
        app = create_app(self.config, KEY, env={}, collector_options=COLLECTOR,
                         state_dir=self.server_state, server=identity)  # fmt: skip
        port = int(self.url.rsplit(":", 1)[1]) if self.url else 0
        if self.workers > 1:
            stop, url = await serve_workers(app, self.workers, port=port)
            addr = url.removeprefix("http://")
        else:
            runner, addr = await _site(GatewayRunner(app), port=port)
            stop = runner.cleanup
        gw = app[GATEWAY_KEY]
        assert gw.fleet.machines is not None
        context = pki.server_context(identity.cert, identity.key, identity.ca_cert)
        cport = int(self.control.rsplit(":", 1)[1]) if self.control else 0
        crunner = control_runner(gw)  # served as the CLI serves it
        await crunner.setup()
        site = TLSSite(crunner, bind("127.0.0.1", cport), ssl_context=context,
                       handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)  # fmt: skip
        await site.start()
        control = f"127.0.0.1:{site.port}"
        self.url, self.control, self.app = f"http://{addr}", control, app
        self.stops = [stop, crunner.cleanup]

    async def stop_server(self) -> None:
        for stop in self.stops:
            await stop()
        self.stops = []

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30, **kw
        )

    def join_file(
        self, host: str, valid_s: float = 3600, control: str | None = None, replace: bool = False
    ) -> Path:
        identity = ServerIdentity(self.server_state / "identity")
        invites = Invites(self.server_state / "machines.sqlite3")
        try:
            token, expires = invites.create(host, valid_s, replace=replace)
        finally:
            invites.close()
        ca = identity.ca_cert.read_bytes()
        path = self.tmp / f"{host}-{token[:6]}.join"
        where = control or self.control
        JoinFile(host, where, ca, pki.fingerprint(ca), token, expires).write(path)
        return path

    async def start_host(
        self, name: str, links: list[Freezer] | None = None, *, replace: bool = False
    ) -> Host:
        """Enroll and run host ``name``; with ``links``, its control session and its ingress
        are reached through two `Freezer` proxies appended to it (control, then ingress)."""
        state = self.tmp / f"host-{name}"
        control = self.control
        if links is not None:
            chost, cport = self.control.rsplit(":", 1)
            links.append(await self._stack.enter_async_context(Freezer(chost, int(cport))))
            control = f"127.0.0.1:{links[-1].port}"
        await join(self.join_file(name, control=control, replace=replace), state)
        holder: list[Host] = []
        # A short shutdown: stopping it ends its forwards at once, as a killed process would.
        runner = ingress_runner(
            lambda: holder[0].gates(), lambda: holder[0].session(), shutdown_timeout=0.1
        )
        runner, addr = await _site(runner)
        if links is not None:
            ihost, iport = addr.rsplit(":", 1)
            links.append(await self._stack.enter_async_context(Freezer(ihost, int(iport))))
            addr = f"127.0.0.1:{links[-1].port}"
        host = Host(state, f"http://{addr}")
        holder.append(host)
        task = asyncio.get_running_loop().create_task(host.run())
        self.hosts[name] = (host, task, runner)
        await asyncio.wait_for(host.connected.wait(), 10)
        return host

    async def kill_host(self, name: str) -> None:
        """Like a host process killed: its ingress and session vanish without a word."""
        host, task, runner = self.hosts.pop(name)
        await runner.cleanup()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def cluster(tmp_path: Path, workers: int) -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    made: list[Cluster] = []

    async def make(
        deployments: list[dict[str, Any]], resources: dict[str, Any] | None = None, **queue: Any
    ) -> Cluster:
        config = GatewayConfig.model_validate(
            {"deployments": deployments, "queue": queue, "resources": resources or {}}
        )
        c = Cluster("", tmp_path / "server", "", tmp_path, config=config, workers=workers)
        await c.start_server()
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            for name in list(c.hosts):
                await c.kill_host(name)
            await c.stop_server()
            await c._stack.aclose()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[[], Awaitable[FakeEngine]]]:
    runners = []

    async def make() -> FakeEngine:
        fake = FakeEngine()
        app = web.Application()
        fake.routes(app)
        runner, addr = await _site(web.AppRunner(app, handler_cancellation=True))
        fake.url = f"http://{addr}"
        runners.append(runner)
        return fake

    try:
        yield make
    finally:
        for r in runners:
            await r.cleanup()


def dep(*instances: dict[str, Any], name: str = "m") -> dict[str, Any]:
    return {"name": name, "engine": "vllm", "engine_version": "0.31.0", "served_model": "tiny",
            "instances": list(instances)}  # fmt: skip


def stream(text: str = "hi") -> list[Any]:
    return list(vllm_stream([text]))


async def two_hosts(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    *,
    busy_a: tuple[int, int] = (0, 0),
) -> tuple[Cluster, FakeEngine, FakeEngine]:
    """A server and hosts box-a and box-b, each with a fake engine answering ``ok`` for one
    deployment ``m`` (box-a's engine reporting ``busy_a`` running and waiting requests)."""
    a, b = await engines(), await engines()
    a.script = b.script = stream("ok")
    a.running, a.waiting = busy_a
    c = await cluster([dep({"host": "box-a", "url": a.url}, {"host": "box-b", "url": b.url})])
    await c.start_host("box-a")
    await c.start_host("box-b")
    return c, a, b


async def test_a_request_reaches_the_engine_on_a_host_and_only_the_server_sees_the_caller_id(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    engine.script = stream("from the host")
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    await c.start_host("gpu-box")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        r = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": "caller-7"}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "from the host"
        assert r.headers["X-Request-Id"] == "caller-7"
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200 and "from the host" in r.text
    assert len(engine.received) == 2
    for got in engine.received:
        assert "caller-7" not in json.dumps(got.headers) + json.dumps(got.body)
        assert not any(h.lower() == "x-request-id" for h in got.headers)
        assert got.headers.get("Authorization") is None  # the gate key stays at the ingress


async def test_a_join_file_is_used_once_and_an_expired_one_is_refused(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    path = c.join_file("gpu-box")
    await join(path, c.tmp / "first")
    with pytest.raises(JoinError, match="used or voided already"):
        await join(path, c.tmp / "second")
    assert not (c.tmp / "second" / "identity" / "host.pem").exists()
    with pytest.raises(JoinError, match="expired"):
        await join(c.join_file("gpu-box", valid_s=-1), c.tmp / "third")
    assert (c.tmp / "first" / "identity" / "host.key").stat().st_mode & 0o777 == 0o600


async def test_an_old_join_file_cannot_take_an_enrolled_hosts_name(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    """A second invitation for a name with one open was written without a word, and whichever
    file enrolled last took the name and its traffic. Now a second needs --replace, which voids
    the first, and an enrollment voids every other open invitation for its name."""
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    first = c.join_file("gpu-box")
    with pytest.raises(JoinError, match="--replace"):
        c.join_file("gpu-box")
    second = c.join_file("gpu-box", replace=True)
    with pytest.raises(JoinError, match="voided"):
        await join(first, c.tmp / "old")
    await join(second, c.tmp / "new")
    # A database written before the rule may hold two open invitations: enrolling voids the other.
    db = sqlite3.connect(c.server_state / "machines.sqlite3")
    with db:
        db.execute("UPDATE invite SET spent_at = NULL WHERE host = 'gpu-box'")
    db.close()
    await join(second, c.tmp / "again")
    with pytest.raises(JoinError, match="voided"):
        await join(first, c.tmp / "old")
    assert not (c.tmp / "old" / "identity" / "host.pem").exists()


async def test_the_ingress_refuses_a_request_without_the_gate_key_and_forwards_nothing(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    host = await c.start_host("gpu-box")
    ingress = host.ingress_url + ingress_path("m", 0) + "/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with httpx.AsyncClient() as client:
        for headers in ({}, {"Authorization": "Bearer " + "0" * 64},
                        {"Authorization": f"Bearer {KEY}"}):  # fmt: skip
            r = await client.post(ingress, json=body, headers=headers)
            assert r.status_code == 401 and r.headers[NOT_FORWARDED] == "unauthorized"
    assert engine.received == []


async def test_a_host_that_goes_away_ends_its_streams_in_band_and_then_requests_wait_for_it(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    engine.script = [*vllm_stream(["part"])[:2], Hold()]
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})], request_deadline="2s")
    await c.start_host("gpu-box")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with c.client() as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if "part" in line:
                    break
            await c.kill_host("gpu-box")
            rest = [line async for line in lines]
        assert any('"error"' in line for line in rest), rest
        assert "data: [DONE]" not in rest
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["code"] == "unavailable"
        assert r.json()["retryable"] is True
    gw = c.gateway
    assert gw.fleet.machines is not None
    assert "gpu-box" not in gw.fleet.machines.sessions


async def test_a_request_waits_for_a_host_that_has_not_reported_yet(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    """Before its host's first report an instance has no address: a request for it waits for
    the host, and is answered 503 (retryable) at its deadline, not 502 from a connect to
    nowhere."""
    engine = await engines()
    engine.script = stream("ok")
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})], request_deadline="1s")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
        await c.start_host("gpu-box")
        r = await client.post("/v1/chat/completions", json=body)  # waits for the first report
        assert r.status_code == 200, r.text
    assert len(engine.received) == 1


async def test_requests_fail_over_to_the_other_host_when_one_refuses_connections(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    c, a, b = await two_hosts(cluster, engines)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    caplog.set_level("INFO", "capyctl_gateway")
    async with c.client() as client:
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert len(a.received) == 2 and len(b.received) == 2  # an idle pair: turns rotate
        # box-a's ingress goes down; its session is still live, so it is still offered requests
        await c.hosts["box-a"][2].cleanup()
        for _ in range(4):
            r = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "f"})
            assert r.status_code == 200
    assert len(a.received) == 2 and len(b.received) == 6
    failovers = [getattr(r, "fields", {}) for r in caplog.records
                 if getattr(r, "event", "") == "router_failover"]  # fmt: skip
    assert failovers and all(f["host"] == "box-a" for f in failovers)
    assert all(f["caller_request_id"] == "f" for f in failovers)


async def test_a_network_cut_ends_streams_through_the_host_in_band_within_seconds(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    engine.script = [*vllm_stream(["part"])[:2], Hold()]
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    links: list[Freezer] = []
    await c.start_host("gpu-box", links)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    loop = asyncio.get_running_loop()
    async with c.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if "part" in line:
                break
        for link in links:  # the link goes down: no reset, no close, just silence
            link.freeze()
        cut_at = loop.time()
        rest = [line async for line in lines]
        noticed = loop.time() - cut_at
    assert any('"error"' in line for line in rest) and "data: [DONE]" not in rest, rest
    assert noticed < 6, noticed  # the session's silence, then the stream is ended
    error = json.loads(next(x for x in rest if '"error"' in x).removeprefix("data:"))["error"]
    # the gateway ended it as its host went away: it says so, and another instance may retry it
    assert (error["code"], error["retryable"]) == ("engine_error", True), error
    assert "host gpu-box lost its session" in error["message"]
    # The host, hearing nothing either, closed its forward: the engine connection is closed.
    await asyncio.wait_for(engine.hung_up.wait(), 10)


async def test_a_hang_up_closes_the_engine_connection_on_the_host_and_settles_on_its_report(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    engine.script = [*vllm_stream(["part"])[:2], Hold()]
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    await c.start_host("gpu-box")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    gw = c.gateway
    ledger = gw.fleet.settlement.ledgers["m/0"]
    engine.running = 1  # the engine counts the request as running, and goes on doing so
    async with c.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if "part" in line:
                break
    await asyncio.wait_for(engine.hung_up.wait(), 5)  # the ingress closed its engine connection
    assert len(ledger.cut) == 1 and ledger.running == 0
    cut_at = ledger.cut[0].cut_at
    # Reports taken after the cut, with nothing in flight at the ingress but the engine still
    # busy, settle nothing.
    await reported(c, lambda i, r: r.quiet_ping is not None and r.running == 1)
    await reported(c, lambda i, r: r.quiet_ping is not None and r.running == 1)
    assert len(ledger.cut) == 1
    settled = asyncio.Event()
    gw.fleet.settlement.settled_observers.append(lambda key, cuts, why: settled.set())
    engine.running = 0
    await asyncio.wait_for(settled.wait(), 10)  # the next quiet report settles it
    assert ledger.cut == []
    last = gw.fleet.settlement.recent[-1]
    assert last.why == "engine and ingress idle on its host"
    assert last.sample_requested_at is not None and last.sample_requested_at > cut_at


async def test_a_body_over_8_mib_for_a_remote_deployment_is_refused_before_it_leaves(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    await c.start_host("gpu-box")
    big = "x" * (8 * 1024 * 1024)
    body = {"model": "m", "messages": [{"role": "user", "content": big}]}
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 413 and r.json()["code"] == "request_too_large"
    assert engine.received == []


async def reported(c: Cluster, check: Callable[[Any, Any], bool], within: float = 10) -> None:
    """Wait for a host report that passes ``check(instance, report)`` (hosts report every s)."""
    gw = c.gateway
    assert gw.fleet.machines is not None
    seen = asyncio.Event()
    gw.fleet.machines.observers.append(lambda i, r: seen.set() if check(i, r) else None)
    await asyncio.wait_for(seen.wait(), within)


async def test_routing_weighs_the_load_each_host_reports_for_its_engine(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # box-a's engine is busy with requests that came another way
    c, a, b = await two_hosts(cluster, engines, busy_a=(5, 2))
    await reported(
        c, lambda i, r: i.runner.site.machine == "box-a" and r.running == 5 and r.age_s is not None
    )
    await reported(
        c, lambda i, r: i.runner.site.machine == "box-b" and r.running == 0 and r.age_s is not None
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    caplog.set_level("INFO", "capyctl_gateway")
    async with c.client() as client:
        for _ in range(4):
            r = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Request-Id": "who-1"}
            )
            assert r.status_code == 200
    assert len(a.received) == 0 and len(b.received) == 4
    picks = [getattr(r, "fields", {}) for r in caplog.records
             if getattr(r, "event", "") == "router_selection"]  # fmt: skip
    assert len(picks) == 4 and all(p["host"] == "box-b" for p in picks)
    scores = {row["host"]: row for row in picks[0]["candidates"]}
    assert scores["box-a"]["score"] == 7 and scores["box-a"]["load_source"] == "engine"
    assert scores["box-b"]["score"] == 0 and scores["box-b"]["sample_age_ms"] is not None
    assert picks[0]["caller_request_id"] == "who-1"
    assert any("who-1" in r.getMessage() and "-> box-b instance 1" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # The caller's ID is on the router lines and nowhere else.
    others = [r for r in caplog.records if getattr(r, "event", "") != "router_selection"]
    assert not any("who-1" in r.getMessage() + str(getattr(r, "fields", "")) for r in others)


async def test_a_hosts_engine_prefix_cache_counts_reach_the_servers_status_and_metrics(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
) -> None:
    """The counts travel in the host's report: status shows them per instance and their ratio
    per deployment, the metrics carry them; an engine that publishes none has no series."""
    from prometheus_client.parser import text_string_to_metric_families

    from capyctl_gateway._management.metrics import exposition
    from capyctl_gateway._management.status import deployment_status

    c, a, _ = await two_hosts(cluster, engines)
    a.prefix_cache = (4000.0, 1000.0)
    await reported(c, lambda i, r: r.prefix_queried == 4000 and r.prefix_hits == 1000)
    await reported(c, lambda i, r: i.runner.site.machine == "box-b" and r.age_s is not None)
    doc = deployment_status(c.gateway.fleet, "m")
    assert doc is not None
    rows = {i["host"]: i for i in doc["instances"]}
    assert rows["box-a"]["prefix_cache"] == {"queried_tokens": 4000, "hit_tokens": 1000}
    assert "prefix_cache" not in rows["box-b"]
    assert doc["deployment"]["prefix_cache_hit_ratio"] == 0.25
    got = {
        (s.name, s.labels.get("instance")): s.value
        for f in text_string_to_metric_families(exposition(c.gateway).decode())
        for s in f.samples
        if s.name.startswith("capyctl_engine_prefix_cache")
    }
    assert got == {
        ("capyctl_engine_prefix_cache_queried_tokens_total", "0"): 4000.0,
        ("capyctl_engine_prefix_cache_hit_tokens_total", "0"): 1000.0,
    }


async def test_a_host_launches_and_stops_a_deployment_on_the_servers_orders(
    cluster: Callable[..., Awaitable[Cluster]],
) -> None:
    from capyctl_gateway._lifecycle.operator import operator_stop
    from capyctl_gateway._management.status import deployment_status
    from tests.gateway.lifecycle.test_lifecycle import ENGINE, wait_gone

    launch = {"command": [*ENGINE, "--served", "tiny"], "startup_timeout": "60s"}
    c = await cluster([dep({"host": "gpu-box", "launch": launch})])
    await c.start_host("gpu-box")
    gw = c.gateway
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert "tiny" in r.json()["choices"][0]["message"]["content"]
    doc = deployment_status(gw.fleet, "m")
    assert doc is not None
    row = doc["instances"][0]
    assert row["host"] == "gpu-box" and row["session"] == "live" and row["lifecycle"] == "ready"
    pid = int(row["process"]["pid"])
    await operator_stop(gw.fleet.lifecycle, "m", known=True)
    wait_gone(pid)
    assert gw.fleet.lifecycle.lives["m"].launched[0].state.value == "stopped"
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 409 and r.json()["code"] == "deployment_stopped"


async def test_the_memory_budget_is_each_machines_own(
    cluster: Callable[..., Awaitable[Cluster]],
) -> None:
    from tests.gateway.lifecycle.test_lifecycle import ENGINE

    def on(host: str, name: str) -> dict[str, Any]:
        launch = {"command": [*ENGINE, "--served", "tiny"], "startup_timeout": "60s"}
        return {**dep({"host": host, "launch": launch}, name=name), "memory": {"ready": "10GiB"}}

    config = [on("box-a", "a1"), on("box-a", "a2"), on("box-b", "b1")]
    c = await cluster(config, resources={"memory_budget": "16GiB"})
    await c.start_host("box-a")
    await c.start_host("box-b")
    gw = c.gateway
    lives = gw.fleet.lifecycle.lives
    async with c.client() as client:
        for name in ("a1", "b1"):  # one on each machine: both fit
            body = {"model": name, "messages": [{"role": "user", "content": "x"}]}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert lives["a1"].state == "ready" and lives["b1"].state == "ready"
        body = {"model": "a2", "messages": [{"role": "user", "content": "x"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    # a2 needed box-a's room: a1 was switched out there; b1 on box-b was left alone.
    assert lives["a1"].state == "stopped" and lives["b1"].state == "ready"
    assert gw.fleet.lifecycle.budget.held_in("host box-a") == 10 * 2**30


async def test_a_host_whose_key_others_can_read_does_not_start(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    from capyctl_gateway._identity import CredentialsError

    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    state = c.tmp / "loose"
    await join(c.join_file("gpu-box"), state)
    key = state / "identity" / "host.key"
    key.chmod(0o644)
    with pytest.raises(CredentialsError, match="chmod 600"):
        Host(state, "http://127.0.0.1:1")


async def test_a_restarted_server_takes_up_the_engines_its_hosts_kept_running(
    cluster: Callable[..., Awaitable[Cluster]],
) -> None:
    from capyctl_gateway._management.status import deployment_status
    from tests.gateway.lifecycle.test_lifecycle import ENGINE

    launch = {"command": [*ENGINE, "--served", "tiny"], "startup_timeout": "60s"}
    c = await cluster([dep({"host": "gpu-box", "launch": launch})])
    host = await c.start_host("gpu-box")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    gw = c.gateway
    before = deployment_status(gw.fleet, "m")
    assert before is not None
    pid = before["instances"][0]["process"]["pid"]
    await c.stop_server()
    assert gw.fleet.lifecycle.lives["m"].launched[0].state.value == "ready"  # left running
    host.connected.clear()
    await c.start_server()
    old, gw = gw, c.gateway
    assert gw is not old
    await asyncio.wait_for(host.connected.wait(), 15)  # the host connects again
    await reported(c, lambda i, r: r.state == "ready" and r.gate is not None)
    life = gw.fleet.lifecycle.lives["m"]
    assert life.launched[0].state.value == "ready"  # taken up, not started afresh
    async with c.client() as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    after = deployment_status(gw.fleet, "m")
    assert after is not None and after["instances"][0]["process"]["pid"] == pid


async def test_an_idle_deployment_on_a_host_is_parked_and_woken_on_the_servers_orders(
    cluster: Callable[..., Awaitable[Cluster]],
) -> None:
    from capyctl_gateway._management.status import deployment_status
    from tests.gateway.lifecycle.test_lifecycle import ENGINE

    launch = {"command": [*ENGINE, "--served", "tiny"], "startup_timeout": "60s"}
    d = {**dep({"host": "gpu-box", "launch": launch}),
         "lifecycle": {"park": "sleep", "ready_idle_timeout": "300ms"}}  # fmt: skip
    c = await cluster([d])
    host = await c.start_host("gpu-box")
    gw = c.gateway
    parked = asyncio.Event()
    gw.fleet.lifecycle.engines.observers.append(
        lambda lc: parked.set() if lc.state.value == "parked" else None
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        doc = deployment_status(gw.fleet, "m")
        assert doc is not None
        pid = doc["instances"][0]["process"]["pid"]
        await asyncio.wait_for(parked.wait(), 15)
        # On the host, the engine was put to sleep, its process kept, and its gate closed.
        assert host.placed.fleet is not None
        host_lc = host.placed.fleet.lifecycle.lives["m"].launched[0]
        assert host_lc.state.value == "parked" and host_lc.inst.runner.process() is not None
        assert not gw.fleet.routes["m"].instances[0].available
        r = await client.post("/v1/chat/completions", json=body)  # asleep, it would answer 503
        assert r.status_code == 200, r.text
    assert host_lc.state.value == "ready"
    doc = deployment_status(gw.fleet, "m")
    assert doc is not None and doc["instances"][0]["process"]["pid"] == pid  # woken, not restarted


async def test_the_ingress_bounds_its_bodies_and_its_forwards(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from capyctl_gateway._machines import ingress as ingress_module

    engine = await engines()
    engine.script = [*vllm_stream(["part"])[:2], Hold()]
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    host = await c.start_host("gpu-box")
    await reported(c, lambda i, r: r.gate is not None)
    gate = host.gate(deployment_tag("m"), 0)
    assert gate is not None and gate.key is not None
    url = host.ingress_url + ingress_path("m", 0) + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {gate.key}"}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url, content=b"x" * (INGRESS_MAX_BODY_BYTES + 1), headers=auth)
        assert r.status_code == 413 and r.headers[NOT_FORWARDED] == "request_too_large"
        monkeypatch.setattr(ingress_module, "MAX_FORWARDS", 1)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
        async with client.stream("POST", url, json=body, headers=auth) as held:
            assert held.status_code == 200  # one forward in flight: the bound is reached
            r = await client.post(url, json=body, headers=auth)
            assert r.status_code == 503 and r.headers[NOT_FORWARDED] == "shutting_down"
    assert len(engine.received) == 1  # neither refusal reached the engine


def test_each_role_takes_only_the_configurations_it_can_serve() -> None:
    one = GatewayConfig.model_validate({"deployments": [dep({"url": "http://127.0.0.1:1"})]})
    two = GatewayConfig.model_validate(
        {"deployments": [dep({"host": "gpu-box", "url": "http://127.0.0.1:1"})]}
    )
    assert one.role_problem(server=False) is None and two.role_problem(server=True) is None
    assert "name its host" in (one.role_problem(server=True) or "")
    assert "--role server" in (two.role_problem(server=False) or "")
    with pytest.raises(ValueError, match="not a host name"):
        GatewayConfig.model_validate(
            {"deployments": [dep({"host": "Bad_Name", "url": "http://127.0.0.1:1"})]}
        )


@pytest.mark.parametrize(
    ("announced", "kept"),
    [
        ("http://10.0.0.21:8444", "http://10.0.0.21:8444"),
        ("http://[fd00::5]:8444", "http://[fd00::5]:8444"),
        ("http://10.0.0.21:8444/elsewhere", None),
        ("http://gpu-box:8444", None),
        ("https://10.0.0.21:8444", None),
        ("http://10.0.0.21", None),
        ("http://0.0.0.0:8444", None),
        ("http://u:p@10.0.0.21:8444", None),
        (42, None),
    ],
)
def test_the_server_uses_only_an_ingress_announced_as_an_address_and_port(
    announced: object, kept: str | None
) -> None:
    from capyctl_gateway._machines.control import ingress_origin

    assert ingress_origin(announced) == kept


@pytest.mark.parametrize(
    ("address", "ok"),
    [("10.0.0.21", True), ("100.64.0.21", True), ("127.0.0.1", True), ("fd00::5", True),
     ("0.0.0.0", False), ("8.8.8.8", False), ("gpu-box", False)],  # noqa: S104 - refused
)  # fmt: skip
def test_host_serve_binds_its_ingress_to_private_addresses_only(address: str, ok: bool) -> None:
    from capyctl_gateway._cli_machines import _private
    from capyctl_gateway._config import ConfigError

    if ok:
        _private(address)
    else:
        with pytest.raises(ConfigError):
            _private(address)


async def test_refusals_on_the_control_port_are_logged_at_most_once_a_second(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    ca = (c.server_state / "identity" / "control-ca.pem").read_bytes()
    caplog.set_level("INFO", "capyctl_gateway")
    body = {
        "host": "gpu-box",
        "token": "not-a-token",
        "csr": pki.host_csr(pki.new_host_key(), "gpu-box").decode(),
    }
    async with aiohttp.ClientSession() as client:
        for _ in range(50):  # anyone who reaches the port can try
            async with client.post(
                f"https://{c.control}/v1/enroll", json=body, ssl=pki.client_context(ca),
                server_hostname=pki.SERVER_NAME,
            ) as r:  # fmt: skip
                assert r.status == 403 and (await r.json())["code"] == "join_refused"
    refused = [r for r in caplog.records if "was refused" in r.getMessage()]
    assert 1 <= len(refused) <= 2  # 50 refusals within about a second: one line, two at most


async def test_a_gate_key_works_for_one_host_session_only(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gate key crosses the server–host link in clear: one captured there must stop
    working when the session it was sent over ends."""
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    host = await c.start_host("gpu-box")
    await reported(c, lambda i, r: r.gate is not None)
    (gate,) = host.placed.gates.values()
    captured = gate.key
    assert captured is not None
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    lost = asyncio.Event()
    watch = _SessionLost(lost)
    logging.getLogger("capyctl_gateway").addHandler(watch)
    try:
        await c.stop_server()
        await asyncio.wait_for(lost.wait(), 15)  # the host saw its session go
    finally:
        logging.getLogger("capyctl_gateway").removeHandler(watch)
    assert key_of(gate) is None
    await c.start_server()
    await reported(c, lambda i, r: r.gate is not None, within=20)
    fresh = key_of(gate)
    assert fresh is not None and fresh != captured
    ingress = host.ingress_url + ingress_path("m", 0) + "/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with httpx.AsyncClient() as client:
        r = await client.post(ingress, json=body, headers={"Authorization": f"Bearer {captured}"})
    assert r.status_code == 401 and r.headers[NOT_FORWARDED] == "unauthorized"
    assert engine.received == []


def key_of(gate: Any) -> str | None:
    """The gate's key now (read anew each time)."""
    key: str | None = gate.key
    return key


class _SessionLost(logging.Handler):
    """Sets ``lost`` when a host logs that its session is lost."""

    def __init__(self, lost: asyncio.Event) -> None:
        super().__init__(logging.INFO)
        self.lost = lost

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if getattr(record, "event", "") == "host_session" and fields.get("state") == "lost":
            self.lost.set()
