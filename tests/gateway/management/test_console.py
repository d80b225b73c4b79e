"""The console's server side and its bounds: the page and its headers, the live event stream
(subscribers capped, a reader that falls behind dropped, the caller's ID never in it), a
launched engine's log lines (lines and bytes capped, masked), the recent window (a fixed
ring), and ``capyctl console``."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from capyctl_gateway import _events
from capyctl_gateway._cli_common import local_runners
from capyctl_gateway._events import BUS, EventBus
from capyctl_gateway._local.enginelog import ShownLog
from capyctl_gateway._log import event
from capyctl_gateway._management import live
from capyctl_gateway._management.console import annotate
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._tally import failed
from capyctl_gateway._telemetry import RECENT_SLOT_S, RECENT_SLOTS, Ending, Recent
from tests.eventually import eventually
from tests.gateway.conftest import Gw
from tests.gateway.lifecycle.test_lifecycle import chat, launched
from tests.gateway.pods.test_pods import Cluster as PodCluster
from tests.gateway.pods.test_pods import cluster, pod_deployment  # noqa: F401
from tests.gateway.pods.test_pods import config as pod_config

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


@dataclass
class Console:
    gw: Gw
    url: str
    """The management listener's base URL."""
    runner: web.AppRunner

    def client(self, key: str | None = None, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key or self.gw.key}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30, **kw)


@pytest.fixture
async def console_of() -> AsyncIterator[Callable[[Gw], Awaitable[Console]]]:
    """Serve a gateway's management application on a loopback port, with the runner
    ``capyctl serve`` uses (its handlers are not cancelled when their client hangs up)."""
    runners: list[web.AppRunner] = []
    BUS.recent.clear()  # the process's bus: what earlier tests logged is not this gateway's

    async def serve(gw: Gw) -> Console:
        runner = local_runners(gw.gateway)[0]
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return Console(gw, f"http://{host}:{port}", runner)

    try:
        yield serve
    finally:
        for runner in runners:
            await runner.cleanup()
        assert not BUS.subscribers, "a stream outlived its listener"


@pytest.fixture
async def launched_console(
    make_gateway: MakeGateway, console_of: Callable[[Gw], Awaitable[Console]], tmp_path: Path
) -> Console:
    dep = launched(extra=["--api-key", "SeCrEt-FlAg-99"])
    gw = await make_gateway({"deployments": [dep]}, engine_logs=tmp_path / "logs")
    return await console_of(gw)


# -- the page ----------------------------------------------------------------------------------
async def test_the_page_and_its_files_need_no_key_and_forbid_inline_scripts(
    launched_console: Console,
) -> None:
    async with httpx.AsyncClient(base_url=launched_console.url) as c:
        page = await c.get("/")
        css = await c.get("/console/console.css")
        js = await c.get("/console/console.js")
        refused = await c.get("/management/v1/recent")
    assert page.status_code == css.status_code == js.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert js.headers["content-type"].startswith("text/javascript")
    for r in (page, css, js):
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer"
    assert '<script src="/console/console.js"' in page.text
    assert "<script>" not in page.text and "http" not in page.text.replace("http-equiv", "")
    assert launched_console.gw.key not in page.text + js.text
    assert refused.status_code == 401


# -- the event stream --------------------------------------------------------------------------
async def events_until(
    resp: httpx.Response, done: Callable[[dict[str, Any]], bool], within: float = 15
) -> list[dict[str, Any]]:
    """The stream's events up to the first one ``done`` says is the last."""
    found: list[dict[str, Any]] = []
    async with asyncio.timeout(within):
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line[6:]))
                if done(found[-1]):
                    break
    return found


async def test_events_stream_lifecycle_and_router_events_without_the_callers_id(
    launched_console: Console,
) -> None:
    async with (
        launched_console.client() as m,
        launched_console.gw.client() as c,
        m.stream("GET", "/management/v1/events") as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        r = await c.post("/v1/chat/completions", json=chat(), headers={"X-Request-Id": "caller-77"})
        assert r.status_code == 200
        rid = r.headers["x-capyctl-request-id"]
        seen = await events_until(resp, lambda e: e["event"] == "router_selection")
    names = {e["event"] for e in seen}
    assert {"lifecycle", "dispatch", "router_selection"} <= names
    selection = next(e for e in seen if e["event"] == "router_selection")
    assert selection["capyctl_request_id"] == rid and selection["deployment"] == "my-model"
    assert "caller-77" not in json.dumps(seen) and "caller_request_id" not in json.dumps(seen)
    assert any(e["event"] == "lifecycle" and e["to"] == "ready" for e in seen)


async def test_a_stream_needs_the_key(launched_console: Console) -> None:
    async with launched_console.client(key="wrong") as m:
        r = await m.get("/management/v1/events")
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert not BUS.subscribers


async def test_subscribers_are_capped(launched_console: Console) -> None:
    assert BUS.max_subscribers == _events.MAX_SUBSCRIBERS == 8
    async with launched_console.client() as m:
        streams = [m.stream("GET", "/management/v1/events") for _ in range(8)]
        opened = [await s.__aenter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            assert len(BUS.subscribers) == 8
            r = await m.get("/management/v1/events")
            assert r.status_code == 503
            assert r.json() == {
                "code": "too_many_subscribers",
                "message": "8 event streams are open already; close one first",
                "retryable": True,
            }
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)
    await eventually(lambda: not BUS.subscribers)  # the handlers notice the hang-ups


async def test_a_stream_whose_client_hangs_up_frees_its_slot_at_once(
    launched_console: Console,
) -> None:
    assert live.HEARTBEAT_S >= 15  # what a hang-up would otherwise wait for
    async with launched_console.client() as m:
        for _ in range(2 * BUS.max_subscribers):  # reloads of the page, one after the other
            async with m.stream("GET", "/management/v1/events") as resp:
                assert resp.status_code == 200
                assert await anext(resp.aiter_lines()) == ": capyctl events"
            await eventually(lambda: not BUS.subscribers, within=2)


async def test_an_open_stream_ends_with_its_end_event_when_the_listener_stops(
    launched_console: Console,
) -> None:
    async with launched_console.client() as m, m.stream("GET", "/management/v1/events") as resp:
        lines = resp.aiter_lines()
        assert await anext(lines) == ": capyctl events"
        stopping = asyncio.create_task(launched_console.runner.cleanup())
        async with asyncio.timeout(10):
            rest = [line async for line in lines]  # to the stream's end
        await stopping
    said = [line for line in rest if line]
    assert said == ["event: end", 'data: {"reason":"the gateway is stopping"}'], rest
    assert not BUS.subscribers


async def test_a_full_queue_drops_its_subscriber_and_publishing_never_waits() -> None:
    bus = EventBus(max_subscribers=2, queue_events=5)
    slow, fast = bus.subscribe(), bus.subscribe()
    assert slow is not None and fast is not None
    for i in range(5):
        bus.publish("e", {"i": i, "caller_request_id": "mine"})
    assert [json.loads(x)["i"] for x in await fast.take(1)] == [0, 1, 2, 3, 4]
    bus.publish("e", {"i": 5})  # the sixth waiting for slow: slow goes, fast stays
    assert bus.subscribers == (fast,)
    assert slow.ended is not None and "5 events waited" in slow.ended
    queued = await slow.take(1)  # what it held it may still read; then its stream ends
    assert len(queued) == 5 and all(b"caller_request_id" not in q for q in queued)
    assert await slow.take(1) == [] and slow.ended is not None
    assert [json.loads(x)["i"] for x in await fast.take(1)] == [5]
    assert bus.subscribe() is not None and bus.subscribe() is None  # two at most


async def test_the_recent_events_are_the_last_ones_not_about_one_request() -> None:
    bus = EventBus(max_subscribers=2, queue_events=100, recent_events=5)
    for i in range(8):
        bus.publish("lifecycle", {"i": i, "caller_request_id": "mine"})
        bus.publish("router_selection", {"i": i, "capyctl_request_id": f"r{i}"})
    assert len(bus.recent) == 5  # the bound, reached: the oldest went
    sub = bus.subscribe(recent=True)
    plain = bus.subscribe()
    assert sub is not None and plain is not None
    bus.publish("dispatch", {"i": 8})
    got = [json.loads(x) for x in await sub.take(1)]
    assert [(e["event"], e["i"]) for e in got] == [
        *(("lifecycle", i) for i in range(3, 8)),
        ("dispatch", 8),  # then the live ones, none twice
    ]
    assert all("caller_request_id" not in e for e in got)
    assert [json.loads(x)["event"] for x in await plain.take(1)] == ["dispatch"]


async def test_a_stream_may_begin_with_the_recent_events_up_to_their_bound(
    launched_console: Console,
) -> None:
    assert live.RECENT_EVENTS == BUS.recent.maxlen == 50
    for i in range(live.RECENT_EVENTS + 10):
        event("console_test", "old %d", i, i=i)
    event("router_selection", "a request", capyctl_request_id="req-1", caller_request_id="theirs")
    async with (
        launched_console.client() as m,
        m.stream("GET", "/management/v1/events", params={"recent": "1"}) as resp,
    ):
        assert resp.status_code == 200
        event("console_test", "new", i="live")
        seen = await events_until(resp, lambda e: e.get("i") == "live")
    assert [e["i"] for e in seen] == [*range(10, live.RECENT_EVENTS + 10), "live"]
    assert "req-1" not in json.dumps(seen)  # a request's line is not kept: the log has it
    async with (
        launched_console.client() as m,
        m.stream("GET", "/management/v1/events") as resp,  # without ?recent=1: live only
    ):
        event("console_test", "newer", i="later")
        assert [e["i"] for e in await events_until(resp, lambda e: True)] == ["later"]


async def test_a_reader_that_takes_nothing_is_dropped_and_its_stream_ends(
    launched_console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(BUS, "queue_events", 10)
    monkeypatch.setattr(live, "WRITE_TIMEOUT_S", 1.0)
    host, port = launched_console.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(
        b"GET /management/v1/events HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + launched_console.gw.key.encode() + b"\r\n\r\n"
    )
    try:
        await eventually(lambda: bool(BUS.subscribers))
        (sub,) = BUS.subscribers
        big = "x" * 100_000
        started = time.monotonic()
        for _ in range(400):  # 40 MB for a reader that reads nothing
            event("console_test", "filler", filler=big)
            await asyncio.sleep(0)
            if sub.ended is not None:
                break
        assert time.monotonic() - started < 10  # the gateway never waited for it
        assert sub.ended is not None and "dropped" in sub.ended
        assert sub not in BUS.subscribers
        # its handler waits on a write the reader never takes: the connection is closed after
        # WRITE_TIMEOUT_S, with the reader still reading nothing
        server = launched_console.runner.server
        assert server is not None
        await eventually(lambda: not server.connections, within=live.WRITE_TIMEOUT_S + 10)
    finally:
        sock.close()


async def test_a_quiet_stream_gets_heartbeats(
    launched_console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "HEARTBEAT_S", 0.05)
    async with launched_console.client() as m, m.stream("GET", "/management/v1/events") as resp:
        beats = 0
        async with asyncio.timeout(10):
            async for line in resp.aiter_lines():
                beats += line == ": keep-alive"
                if beats == 3:
                    break


# -- the engine's log --------------------------------------------------------------------------
async def test_log_lines_are_masked_and_capped_in_lines_and_bytes(
    launched_console: Console,
) -> None:
    async with launched_console.gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    path = "/management/v1/deployments/my-model/instances/0/log"
    async with launched_console.client() as m:
        doc = (await m.get(path)).json()
        assert doc["deployment"] == "my-model" and doc["instance"] == 0
        text = "\n".join(doc["lines"])
        assert "fake engine args" in text and "SeCrEt-FlAg-99" not in text and "***" in text
        assert len((await m.get(path, params={"lines": 1})).json()["lines"]) == 1
        # the engine's log grows past both caps: lines cut to LOG_MAX_LINES, bytes to LOG_MAX_BYTES
        runner = launched_console.gw.gateway.fleet.routes["my-model"].instances[0].runner
        shown = runner.log()
        assert isinstance(shown, ShownLog)
        log = shown.log
        with log.path.open("a") as f:
            f.writelines(f"line {i} {'y' * 20}\n" for i in range(5000))
        many = (await m.get(path, params={"lines": 100000})).json()["lines"]
        assert len(many) == live.LOG_MAX_LINES and many[-1].startswith("line 4999 ")
        with log.path.open("a") as f:
            f.writelines(f"wide {i} {'z' * 2000}\n" for i in range(100))
        wide = (await m.get(path, params={"lines": 1000})).json()["lines"]
        assert sum(len(x) + 1 for x in wide) <= live.LOG_MAX_BYTES
        assert wide[-1].startswith("wide 99 ") and all(x.startswith("wide ") for x in wide)
        assert (await m.get(path, params={"lines": "-1"})).json()["code"] == "invalid_request"
        assert (await m.get(path.replace("/0/", "/3/"))).json()["code"] == "not_found"
        assert (await m.get(path.replace("my-model", "nope"))).json()["code"] == "unknown_model"


@pytest.mark.parametrize("lines", ["\u00b2", "\u0663", "1" * 5000, "1234567", "+5", " 5"])
async def test_log_lines_that_are_not_a_short_ascii_number_are_a_400(
    launched_console: Console, lines: str
) -> None:
    path = "/management/v1/deployments/my-model/instances/0/log"
    async with launched_console.client() as m:
        r = await m.get(path, params={"lines": lines})
    assert r.status_code == 400
    assert r.json() == {"code": "invalid_request", "message": "lines takes a whole number"}


@pytest.mark.parametrize("index", ["9" * 5000, "12345", "\u0663"])
async def test_an_instance_index_past_four_ascii_digits_is_not_found(
    launched_console: Console, index: str
) -> None:
    async with launched_console.client() as m:
        r = await m.get(f"/management/v1/deployments/my-model/instances/{index}/log")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert set(r.json()) == {"code", "message"}


async def test_an_engine_someone_else_runs_has_no_log_here(
    make_gateway: MakeGateway, console_of: Callable[[Gw], Awaitable[Console]], engine: Any
) -> None:
    from tests.gateway.conftest import deployments

    con = await console_of(await make_gateway({"deployments": [deployments(engine.url)]}))
    async with con.client() as m:
        r = await m.get("/management/v1/deployments/my-model/instances/0/log")
    assert r.status_code == 409 and r.json()["code"] == "deployment_not_launched"


# -- the recent window -------------------------------------------------------------------------
def test_the_recent_window_is_a_fixed_ring() -> None:
    w = Recent(1000.0)
    ring = (w.slot, w.requests, w.errors, w.ttft_sum, w.ttft_n, w.wake_sum, w.wake_n)
    w.add(1001.0, False, 0.5, 2.0)
    w.add(1002.0, True, None, None)
    w.add(1003.0, False, 1.5, None)
    assert w.slots(1005.0) == [(5.0, 3, 1, 2.0, 2, 2.0, 1)]  # nothing before the window began
    for t in range(1000, 1000 + 3 * RECENT_SLOTS * RECENT_SLOT_S, 7):  # three laps
        w.add(float(t), t % 2 == 0, None, None)
    assert all(len(x) == RECENT_SLOTS for x in ring)  # the same lists, never grown
    assert (w.slot, w.requests, w.errors, w.ttft_sum, w.ttft_n, w.wake_sum, w.wake_n) == ring
    now = 1000.0 + 3 * RECENT_SLOTS * RECENT_SLOT_S
    slots = w.slots(now)
    assert len(slots) == RECENT_SLOTS and slots[-1][0] == now % RECENT_SLOT_S
    last = int(now // RECENT_SLOT_S)
    kept = [t for t in range(1000, int(now), 7) if t // RECENT_SLOT_S > last - RECENT_SLOTS]
    assert sum(s[1] for s in slots) == len(kept)
    later = w.slots(now + 10 * RECENT_SLOTS * RECENT_SLOT_S)  # quiet since: zeros, no stale
    assert len(later) == RECENT_SLOTS and all(s[1:] == (0, 0, 0.0, 0, 0.0, 0) for s in later)


def test_the_windows_timings_are_weighted_by_requests_not_by_slots() -> None:
    w = Recent(1000.0)
    w.add(1001.0, False, 0.100, None)  # a slot of one slow answer
    for t in (1011.0, 1012.0, 1013.0):  # and one of three quick ones
        w.add(t, False, 0.004, None)
    w.add(1014.0, False, 0.004, 1.5)  # one that waited 1.5 s for a start: apart
    w.add(1015.0, True, None, None)  # no answer, no figure: left out, never 0
    totals = live.window_totals(w.slots(1020.0))
    assert totals["requests"] == 6 and totals["errors"] == 1 and totals["s"] == 20.0
    assert totals["ttft_n"] == 5 and totals["ttft_s"] == pytest.approx(0.116 / 5)
    assert totals["ttft_s"] != pytest.approx((0.100 + 0.004) / 2)  # not the mean of means
    assert totals["wake_n"] == 1 and totals["wake_s"] == 1.5
    quiet = live.window_totals(Recent(0.0).slots(5.0))
    assert quiet == {"s": 5.0, "requests": 0, "errors": 0}  # no timing measured: none shown


async def test_recent_ttft_is_the_answers_own_figure_and_the_start_wait_is_apart(
    launched_console: Console,
) -> None:
    """The deployment is stopped: the first request waits for its start. The window's time to
    first token is the answers' own ``ttft_ms``, weighted by request, and that wait shows as
    its own figure, never inside it."""
    figures = []
    async with launched_console.gw.client() as c:
        for _ in range(3):
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200
            figures.append(r.json()["capyctl"]["metrics"]["ttft_ms"]["value"])
        bad = {"model": "my-model", "messages": [], "n": 2}  # the client's mistake: no error
        assert (await c.post("/v1/chat/completions", json=bad)).status_code == 400
    async with launched_console.client() as m:
        doc = (await m.get("/management/v1/recent")).json()
    assert doc["slot_s"] == RECENT_SLOT_S and doc["slots"] == RECENT_SLOTS
    slots = doc["deployments"]["my-model"]
    assert sum(s["requests"] for s in slots) == 4 and sum(s["errors"] for s in slots) == 0
    top = max(figures) / 1000
    assert all(s["ttft_s"] <= top + 1e-6 for s in slots if "ttft_s" in s)  # no start inside
    totals = doc["totals"]["my-model"]
    assert totals["requests"] == 4 and totals["ttft_n"] == 3
    assert totals["ttft_s"] * 1000 == pytest.approx(sum(figures) / 3, abs=0.001)
    assert totals["wake_n"] == 1  # the first one waited for the start
    assert totals["wake_s"] > top and sum(s.get("wake_n", 0) for s in slots) == 1


async def test_recent_errors_are_what_the_gateway_or_engine_failed_at(
    make_gateway: MakeGateway, console_of: Callable[[Gw], Awaitable[Console]], tmp_path: Path
) -> None:
    dep = launched(extra=["--exit-at-once", "3"])  # its every start fails: 500
    con = await console_of(await make_gateway({"deployments": [dep]}, engine_logs=tmp_path))
    async with con.gw.client() as c:
        failed = await c.post("/v1/chat/completions", json=chat())
        assert failed.json()["code"] == "activation_failed" and failed.status_code == 500
        for bad in ({"model": "my-model", "messages": [], "n": 2}, {**chat(), "bogus": 1}):
            assert (await c.post("/v1/chat/completions", json=bad)).status_code == 400
    async with con.client() as m:
        slots = (await m.get("/management/v1/recent")).json()["deployments"]["my-model"]
    assert sum(s["requests"] for s in slots) == 3 and sum(s["errors"] for s in slots) == 1


@pytest.mark.parametrize(
    ("ending", "status", "error"),
    [
        (Ending.COMPLETED, None, False),
        (Ending.HANG_UP, None, False),
        (Ending.ENGINE_ERROR, 502, True),
        (Ending.UNVERIFIED, 502, True),
        (Ending.DEADLINE, 503, True),
        (Ending.IDLE_TIMEOUT, 503, True),
        (Ending.REFUSED, 400, False),  # invalid_request, unsupported_parameter, engine_rejected
        (Ending.REFUSED, 404, False),
        (Ending.REFUSED, 409, False),  # an operator stopped the deployment
        (Ending.REFUSED, 413, False),
        (Ending.REFUSED, 429, True),  # queue_full: the gateway could not take it
        (Ending.REFUSED, 500, True),  # activation_failed
        (Ending.REFUSED, 503, True),  # unavailable
    ],
)
def test_what_the_console_counts_as_an_error(
    ending: Ending, status: int | None, error: bool
) -> None:
    assert failed(ending, status) is error


# -- the memory budget -------------------------------------------------------------------------
async def test_the_list_shows_each_pools_budget_and_each_deployments_share(
    make_gateway: MakeGateway,
    console_of: Callable[[Gw], Awaitable[Console]],
    cluster: PodCluster,  # noqa: F811
) -> None:
    """Local engines and pods count against pools of their own, each with the whole budget:
    both full is not over it."""
    gib = {"ready": "1GiB"}
    deps = (
        launched("here", served="model-a", memory=gib),
        launched("idle", served="model-b", memory={"ready": "512MiB"}),
        pod_deployment("pod", memory=gib),
    )
    gw = await make_gateway(
        pod_config(*deps) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env
    )
    async with gw.client() as c:
        for name in ("here", "pod"):
            assert (await c.post("/v1/chat/completions", json=chat(name))).status_code == 200
    con = await console_of(gw)
    async with con.client() as m:
        doc = (await m.get("/management/v1/deployments")).json()
    histories = [pool.pop("history") for pool in doc["pools"]]
    assert [h[-1]["held"] for h in histories] == [{"here": 2**30, "idle": 0}, {"pod": 2**30}]
    assert doc["pools"] == [
        {
            "pool": "this machine",
            "held": 2**30,
            "budget": 2**30,
            "deployments": [{"name": "here", "held": 2**30}, {"name": "idle", "held": 0}],
            "resident": ["here"],
            "waiting": [],
        },
        {
            "pool": "kubernetes",
            "held": 2**30,
            "budget": 2**30,
            "deployments": [{"name": "pod", "held": 2**30}],
            "resident": ["pod"],
            "waiting": [],
        },
    ]
    assert "over_budget" not in doc  # each pool holds its budget, none more


# -- the status document's additions and the command -------------------------------------------
async def test_status_offers_only_the_commands_that_change_something(
    launched_console: Console,
) -> None:
    path = "/management/v1/deployments/my-model"

    async def offered(m: httpx.AsyncClient, action: str | None = None) -> list[str]:
        if action is None:
            doc = (await m.get(path)).json()
        else:
            doc = (await m.post(f"{path}/{action}")).json()
        return list(doc["deployment"]["actions"])

    async with launched_console.client() as m:
        assert await offered(m) == ["start", "stop"]  # stopped: a stop keeps it so
        assert await offered(m, "start") == ["stop", "park"]  # it serves
        assert await offered(m, "park") == ["start", "stop"]  # at rest
        assert await offered(m, "stop") == ["start"]  # an operator's stop holds it
        assert await offered(m, "start") == ["stop", "park"]


async def test_a_deployment_only_an_operator_starts_offers_only_a_start(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    explicit = launched(lifecycle={"activation": "explicit"})
    gw = await make_gateway({"deployments": [explicit]}, engine_logs=tmp_path)
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None
    assert annotate(gw.gateway.fleet, doc)["deployment"]["actions"] == ["start"]


async def test_status_says_why_and_the_load_sample(launched_console: Console) -> None:
    async with launched_console.client() as m:
        before = (await m.get("/management/v1/deployments/my-model")).json()
        assert before["deployment"]["why"] == "stopped: the next request starts it"
        started = (await m.post("/management/v1/deployments/my-model/start")).json()
        assert started["deployment"]["why"] == "serving"
        stopped = (await m.post("/management/v1/deployments/my-model/stop")).json()
    assert "stopped by an operator" in stopped["deployment"]["why"]
