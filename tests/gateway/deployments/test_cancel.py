"""Hang-ups and deadlines in every phase, the waiting queue, and settling cut requests."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web
from typer.testing import CliRunner

from canopyx_provider import (
    Capacity,
    EngineKind,
    EngineMetrics,
    EngineRestarted,
    EngineSnapshot,
    Event,
    ProviderOptions,
    ScrapeFailed,
    ScrapeSucceeded,
)
from capyctl_gateway import create_management_app
from capyctl_gateway._deployments.settle import CutRequest, InstanceLedger, Settlement, SettleRule
from capyctl_gateway.cli import app as cli
from tests.gateway.conftest import WORKERS, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Hold, Pause, chunk, event, vllm_stream

workers = WORKERS


pytestmark = pytest.mark.anyio
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
MakeGateway = Callable[..., Awaitable[Gw]]


def ledger(gw: Gw) -> InstanceLedger:
    return gw.gateway.fleet.settlement.ledgers["my-model/0"]


class Watch:
    """Collector events as they are applied, for waiting on a condition without sleeping."""

    def __init__(self, gw: Gw) -> None:
        self.changed = anyio.Event()
        self.samples: list[EngineSnapshot] = []
        self.restarts = 0
        self.failures: list[float] = []
        """When each failed health check was seen (the collector's clock)."""
        gw.gateway.fleet.settlement.observers.append(self)

    def __call__(self, e: Event, /) -> None:
        if isinstance(e, ScrapeSucceeded):
            self.samples.append(e.snapshot)
        if isinstance(e, EngineRestarted):
            self.restarts += 1
        if isinstance(e, ScrapeFailed) and e.check == "health":
            self.failures.append(e.at)
        self.changed.set()

    async def until(self, predicate: Callable[[], bool], *, within: float = 10) -> None:
        with anyio.fail_after(within):
            while not predicate():
                await self.changed.wait()
                self.changed = anyio.Event()


async def give_up(gw: Gw, engine: FakeEngine) -> None:
    """Send a non-streamed request and hang up once the engine has it, before any token."""
    async with gw.client() as c, anyio.create_task_group() as tg:
        tg.start_soon(partial(c.post, "/v1/chat/completions", json=CHAT))
        with anyio.fail_after(5):
            await engine.arrived.wait()
        tg.cancel_scope.cancel()


async def hang_up_after(gw: Gw, body: dict[str, Any], *, lines: int) -> None:
    """Stream ``body`` and hang up after ``lines`` non-empty lines."""
    async with gw.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            if line:
                seen += 1
            if seen >= lines:
                return


# -- the waiting queue ------------------------------------------------------------------------
async def test_queue_full_is_429_retryable_and_nothing_reaches_the_engine(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = [Hold()]
    gw = await make_gateway(
        {
            "queue": {"max_running_per_deployment": 1, "max_waiting_per_deployment": 1},
            "deployments": [deployments(engine.url)],
        }
    )
    route = gw.gateway.fleet.routes["my-model"]
    async with gw.client() as c, anyio.create_task_group() as tg:
        tg.start_soon(partial(c.post, "/v1/chat/completions", json=CHAT))
        with anyio.fail_after(5):
            await engine.arrived.wait()
        tg.start_soon(partial(c.post, "/v1/chat/completions", json=CHAT))
        watch = Watch(gw)
        await watch.until(lambda: route.queue.waiting == 1)
        third = await c.post("/v1/chat/completions", json=CHAT)
        tg.cancel_scope.cancel()
    assert third.status_code == 429
    assert third.headers["Retry-After"] == "1"
    assert third.json() == {
        "code": "queue_full",
        "message": "this model's waiting queue is full; retry shortly",
        "retryable": True,
    }
    assert "x-capyctl-request-id" in third.headers
    assert len(engine.received) == 1


async def test_a_waiter_past_its_deadline_gets_503_and_never_reaches_the_engine(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = [*vllm_stream()[:2], Hold()]  # the first request has output, and holds on
    gw = await make_gateway(
        {
            "queue": {"max_running_per_deployment": 1, "request_deadline": "400ms"},
            "deployments": [deployments(engine.url)],
        }
    )
    async with gw.client() as c:
        first, second = None, None

        async def one() -> None:
            nonlocal first
            first = await c.post("/v1/chat/completions", json=CHAT)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await engine.arrived.wait()
            second = await c.post("/v1/chat/completions", json=CHAT)
            tg.cancel_scope.cancel()
    assert first is None  # still running when the second gave up; cancelled with the group
    assert second is not None and second.status_code == 503
    assert second.json()["code"] == "unavailable" and second.json()["retryable"] is True
    assert "running slot" in second.json()["message"]
    assert len(engine.received) == 1
    queue = gw.gateway.fleet.routes["my-model"].queue
    settlement = gw.gateway.fleet.settlement
    # The first one's client left too; it had produced text, so an idle engine settles it.
    await Watch(gw).until(lambda: queue.running == 0 and settlement.settled == 1)
    assert ledger(gw).charged == 0


async def test_a_waiter_that_hangs_up_frees_its_place_at_once(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = [Hold()]
    gw = await make_gateway(
        {
            "queue": {"max_running_per_deployment": 1, "max_waiting_per_deployment": 1},
            "deployments": [deployments(engine.url)],
        }
    )
    queue = gw.gateway.fleet.routes["my-model"].queue
    watch = Watch(gw)
    async with gw.client() as c, anyio.create_task_group() as running:
        running.start_soon(partial(c.post, "/v1/chat/completions", json=CHAT))
        await engine.arrived.wait()
        async with anyio.create_task_group() as waiting:
            waiting.start_soon(partial(c.post, "/v1/chat/completions", json=CHAT))
            await watch.until(lambda: queue.waiting == 1)
            waiting.cancel_scope.cancel()  # the waiter hangs up
        await watch.until(lambda: queue.waiting == 0)
        async with anyio.create_task_group() as again:
            again.start_soon(partial(c.post, "/v1/chat/completions", json=CHAT))
            await watch.until(lambda: queue.waiting == 1)  # its place is free again
            again.cancel_scope.cancel()
        running.cancel_scope.cancel()
    assert len(engine.received) == 1


# -- settling ---------------------------------------------------------------------------------
async def test_a_request_cut_after_text_settles_at_the_first_idle_sample_after_the_cut(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [*vllm_stream()[:3], Hold()]
    engine.running = 1
    watch = Watch(gateway)
    await hang_up_after(gateway, {**CHAT, "stream": True}, lines=3)
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    book = ledger(gateway)
    await watch.until(lambda: bool(book.cut))
    (cut,) = book.cut
    assert cut.rule is SettleRule.WHEN_IDLE and cut.reason == "hang_up"
    assert book.running == 0 and book.charged == 1
    # The engine still reports the request running: samples after the cut do not settle it.
    seen = len(watch.samples)
    await watch.until(lambda: len(watch.samples) >= seen + 2)
    assert book.cut == [cut]
    collector = gateway.gateway.fleet.collector
    assert collector.status("my-model/0").poll_interval_s == 0.25
    engine.running = 0
    await watch.until(lambda: not book.cut)
    settling = next(s for s in watch.samples if s.metrics.idle and s.requested_at > cut.cut_at)
    assert settling.requested_at > cut.cut_at
    assert collector.status("my-model/0").poll_interval_s == 0.05  # back to the default


async def test_a_request_cut_before_its_first_token_waits_for_a_restart(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [event(chunk(delta={"role": "assistant", "content": ""})), Hold()]
    watch = Watch(gateway)
    await hang_up_after(gateway, {**CHAT, "stream": True}, lines=1)  # only the role chunk
    book = ledger(gateway)
    await watch.until(lambda: bool(book.cut))
    assert book.cut[0].rule is SettleRule.AT_RESTART
    seen = len(watch.samples)
    await watch.until(lambda: len(watch.samples) >= seen + 3)  # idle samples: still counted
    assert all(s.metrics.idle for s in watch.samples[seen:])
    assert len(book.cut) == 1
    engine.process_start += 100  # the engine restarted
    await watch.until(lambda: not book.cut)
    assert watch.restarts == 1


async def test_one_failed_health_poll_is_no_restart_but_a_long_absence_is(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    """A request cut before its first token waits for the engine's restart. One failed health
    poll followed by a good one was taken as one and settled it (issue 34, item 9b); a busy
    engine's timeout reads the same. A restart is proven: here, by an absence longer than a
    poll's timeout before the engine answers again."""
    engine.publishes_start = False  # no start marker: only the absence can prove it
    gw, watch, book = await cut_before_first_token(engine, make_gateway)
    engine.healthy = False
    await watch.until(lambda: len(watch.failures) >= 1)
    engine.healthy = True  # one failed poll: back at the next
    seen = len(watch.samples)
    await watch.until(lambda: len(watch.samples) >= seen + 3)
    assert len(book.cut) == 1  # not a restart: still counted
    await away_past_the_timeout(engine, watch)
    await watch.until(lambda: not book.cut)
    assert gw.gateway.fleet.settlement.recent[-1].why == "engine back after an absence"


async def test_an_absence_is_no_restart_where_the_start_marker_stayed_the_same(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    """An engine that publishes a start marker and is back with the same one after an absence
    is the same process, back from a stall: what was cut before its first token may still
    run there, and stays counted until the marker changes."""
    gw, watch, book = await cut_before_first_token(engine, make_gateway)
    await away_past_the_timeout(engine, watch)
    seen = len(watch.samples)
    await watch.until(lambda: len(watch.samples) >= seen + 3)
    assert len(book.cut) == 1 and watch.restarts == 0
    engine.process_start += 100
    await watch.until(lambda: not book.cut)
    assert gw.gateway.fleet.settlement.recent[-1].why == "engine restarted"


async def cut_before_first_token(
    engine: FakeEngine, make_gateway: MakeGateway
) -> tuple[Gw, Watch, InstanceLedger]:
    """A gateway polling every 50 ms with a 300 ms timeout, and one request cut before its
    engine's first token (it settles at a proven restart)."""
    options = ProviderOptions(poll_interval_ms=50, request_timeout_ms=300, connect_attempts=1)
    gw = await make_gateway({"deployments": [deployments(engine.url)]}, collector=options)
    engine.script = [Hold()]
    watch = Watch(gw)
    await give_up(gw, engine)  # a non-streaming client gives up before any token
    book = ledger(gw)
    await watch.until(lambda: bool(book.cut))
    assert book.cut[0].rule is SettleRule.AT_RESTART and book.cut[0].reason == "hang_up"
    return gw, watch, book


async def away_past_the_timeout(engine: FakeEngine, watch: Watch) -> None:
    """The engine's health fails for longer than a poll's timeout (300 ms), then it answers."""
    engine.healthy = False
    down = len(watch.failures)
    await watch.until(
        lambda: len(watch.failures) > down and watch.failures[-1] - watch.failures[down] > 0.35
    )
    engine.healthy = True


async def test_a_counter_that_went_down_proves_a_restart() -> None:
    """An engine without a start marker that restarted between two samples: its cumulative
    counters start again from zero."""
    settlement = Settlement(lambda: 100.0, poll=lambda key, ms: None)
    book = settlement.ledger("e/0")
    book.cut.append(CutRequest("r1", 50.0, SettleRule.AT_RESTART, "hang_up"))

    def sample(at: float, prompt: float) -> ScrapeSucceeded:
        metrics = EngineMetrics(running_requests=1, waiting_requests=0, prompt_tokens_total=prompt)
        snap = EngineSnapshot(
            engine=EngineKind.VLLM,
            model_id="m",
            metrics=metrics,
            capacity=Capacity(),
            engine_version="0.31.0",
            requested_at=at,
            collected_at=at,
        )
        return ScrapeSucceeded("e/0", snap)

    settlement(sample(60.0, 500.0))
    settlement(sample(61.0, 800.0))
    assert len(book.cut) == 1  # counters rising: nothing proven
    settlement(sample(62.0, 30.0))
    assert book.cut == [] and settlement.recent[-1].why.startswith("engine restarted")


async def test_a_deadline_cut_is_counted_like_a_hang_up(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = [Hold()]
    gw = await make_gateway(
        {"queue": {"request_deadline": "300ms"}, "deployments": [deployments(engine.url)]}
    )
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert [(c.reason, c.rule) for c in ledger(gw).cut] == [("deadline", SettleRule.AT_RESTART)]


async def test_a_stream_quiet_past_the_idle_timeout_is_cut_and_its_engine_connection_closed(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    # Text keeps coming every 50 ms for a while (each block pushes the idle deadline back,
    # past the 300 ms that would have cut a stream quiet since its first chunk), then stops.
    texts = [event(chunk(delta={"content": "x"})) for _ in range(12)]
    script: list[Any] = [event(chunk(delta={"role": "assistant", "content": ""}))]
    for t in texts:
        script += [Pause(0.05), t]
    engine.script = [*script, Hold()]
    gw = await make_gateway(
        {"queue": {"stream_idle_timeout": "300ms"}, "deployments": [deployments(engine.url)]}
    )
    loop = asyncio.get_running_loop()
    async with gw.client() as c:
        start = loop.time()
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        took = loop.time() - start
    assert r.status_code == 200
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert sum('"content":"x"' in d for d in data) == 12  # all the text arrived first
    assert json.loads(data[-1])["error"]["code"] == "unavailable"
    assert took >= 12 * 0.05 + 0.3  # cut only once quiet for the whole timeout
    with anyio.fail_after(5):
        await engine.hung_up.wait()  # the engine saw its connection close
    assert [(c.reason, c.rule) for c in ledger(gw).cut] == [("idle_timeout", SettleRule.WHEN_IDLE)]


async def test_completed_and_refused_requests_leave_nothing_counted(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    async with gateway.client() as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/v1/chat/completions", json={**CHAT, "n": 3})).status_code == 400
    assert ledger(gateway).charged == 0


# -- status deployment ------------------------------------------------------------------------
async def test_status_deployment_through_the_cli(
    gateway: Gw, engine: FakeEngine, tmp_path: Any
) -> None:
    engine.script = [Hold()]
    watch = Watch(gateway)
    await give_up(gateway, engine)
    book = ledger(gateway)
    await watch.until(lambda: bool(book.cut) and bool(watch.samples))
    runner = web.AppRunner(create_management_app(gateway.gateway))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state = tmp_path / "state"
    (state / "identity").mkdir(parents=True)
    (state / "identity" / "credentials").write_text(f"api_key: {gateway.key}\n")
    (state / "identity" / "credentials").chmod(0o600)
    args = [
        "status",
        "deployment",
        "my-model",
        "--state-dir",
        str(state),
        "--management",
        f"{host}:{port}",
    ]
    # The guide's own words: ``capyctl status deployment <name>``, the installed command.
    capyctl = str(Path(sys.executable).parent / "capyctl")
    try:
        human = await anyio.to_thread.run_sync(
            partial(subprocess.run, [capyctl, *args], capture_output=True, text=True)
        )
        as_json = await anyio.to_thread.run_sync(CliRunner().invoke, cli, [*args, "--json"])
        missing = await anyio.to_thread.run_sync(
            CliRunner().invoke, cli, ["status", "deployment", "nope", *args[3:]]
        )
        async with httpx.AsyncClient() as c:
            unauthorized = await c.get(f"http://{host}:{port}/management/v1/deployments/my-model")
    finally:
        await runner.cleanup()
    assert human.returncode == 0, human.stdout + human.stderr
    short = gateway.gateway.fleet.routes["my-model"].id
    assert f"my-model ({short}): api chat, vllm 0.31.0 (tiny), ready" in human.stdout
    assert "instance 0: 1 cancelled request(s) still counted" in human.stdout
    assert "settles at the engine's next stop or restart" in human.stdout
    doc = json.loads(as_json.output)
    assert doc["deployment"]["id"] == short
    row = doc["instances"][0]
    assert row["state"] == "ready" and row["running"] == 0 and row["waiting"] == 0
    assert row["snapshot_age_s"] is not None
    assert [c["settles"] for c in row["cancelled"]] == ["at the engine's next stop or restart"]
    assert missing.exit_code == 2 and "no deployment named 'nope'" in missing.output
    assert unauthorized.status_code == 401 and unauthorized.headers["www-authenticate"] == "Bearer"
