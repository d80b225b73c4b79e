"""The lifecycle under concurrent traffic: many clients at once against launched engines, with
switches under a memory budget, operator commands and the idle clock beside them. Each test is a
regression test of a race that lost requests before the queue's gate and the memory ledger
(issue 23). The engines run on the fake runner (the launchable engine's application in this
process, over real sockets): these are the lifecycle's policy, not its processes."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from capyctl_gateway._clock import stamp
from capyctl_gateway._errors import GatewayError
from capyctl_gateway._routing.place import EXIT_SEEN_S
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.fake_runner import Script
from tests.gateway.lifecycle.test_lifecycle import chat, launched, management, pid_of, transitions

workers = WORKERS
fakes = FAKES  # the lifecycle's policy: on the fake runner (engines in this process)
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process


pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
GiB = 2**30
RUN = uuid.uuid4().hex[:8]


def served(name: str) -> str:
    """The model a test's engine for deployment ``name`` serves: unique to this test run, so
    that counting its processes never counts another run's."""
    return f"model-{name}-{RUN}"


def engines_running(served: str) -> list[int]:
    """The pids of launchable fake engines serving ``served`` that really run now."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or b"tests.gateway.launchable_engine" not in argv:
            continue
        if b"capyctl_gateway._local.reaper" in argv:
            continue  # the engine's keeper, not the engine
        if served.encode() in argv:
            found.append(int(proc.name))
    return found


def running(gw: Gw, served: str) -> list[int]:
    """The engines serving ``served`` now: the fake runner's (their fake pids) when the test
    runs on it, else the real processes."""
    return gw.fakes.running(served) if gw.fakes is not None else engines_running(served)


def said(what: str, model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": what}]}


async def long_stream(c: httpx.AsyncClient, model: str, seconds: float) -> asyncio.Task[str]:
    """Start a streamed generation of ``seconds`` and return once its first chunk arrived (it
    runs on the engine then); the task gives its status and body."""
    begun = asyncio.Event()

    async def run() -> str:
        body = {**said(f"take:{seconds}", model), "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            text = f"{r.status_code}\n"
            async for line in r.aiter_lines():
                text += line + "\n"
                begun.set()
            return text

    task = asyncio.ensure_future(run())
    first = asyncio.ensure_future(begun.wait())
    with anyio.fail_after(30):
        await asyncio.wait([task, first], return_when=asyncio.FIRST_COMPLETED)
    first.cancel()
    assert begun.is_set(), task.result()
    return task


class Gates(logging.Handler):
    """The gateway's ``dispatch`` log events for deployments' gates, as they are emitted."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.shut: dict[str, asyncio.Event] = {}
        logging.getLogger("capyctl_gateway").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if getattr(record, "event", "") != "dispatch":
            return  # the deployment's gate, or (before the gate) its instance's
        if fields.get("state") == "closed":
            self.shut.setdefault(fields["deployment"], asyncio.Event()).set()

    async def until_shut(self, name: str) -> None:
        with anyio.fail_after(30):
            await self.shut.setdefault(name, asyncio.Event()).wait()

    def close(self) -> None:
        logging.getLogger("capyctl_gateway").removeHandler(self)
        super().close()


@pytest.fixture
def gates(caplog: pytest.LogCaptureFixture) -> Iterator[Gates]:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    watch = Gates()
    yield watch
    watch.close()


async def test_first_requests_in_one_tick_never_run_more_engines_than_the_budget_holds(
    make_gateway: MakeGateway,
) -> None:
    """Three deployments of 10 GiB under a 15 GiB budget, first requested together: the budget
    was checked in one step and reserved a loop turn later, so all three started at once."""
    memory = {"ready": "10GiB"}
    names = ("a", "b", "c")
    deps = [launched(n, served=served(n), memory=memory) for n in names]
    gw = await make_gateway({"resources": {"memory_budget": "15GiB"}, "deployments": deps})
    lifecycle = gw.gateway.fleet.lifecycle
    peaks: list[tuple[int, int]] = []

    def watch(lc: Any) -> None:
        really = sum(len(running(gw, served(n))) for n in names)
        peaks.append((lifecycle.budget.held(), really))

    lifecycle.engines.observers.append(watch)
    async with gw.client() as c:
        answers = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=chat(n)) for n in names for _ in range(4))
        )
    assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
    assert max(held for held, _ in peaks) <= 15 * GiB
    assert max(really for _, really in peaks) <= 1


async def test_a_switch_under_concurrent_traffic_serves_every_request(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Two deployments that fit one at a time, three clients on each, four requests each:
    half were refused (the switched-out model's requests took running slots, so every drain
    ran to drain_timeout and the waiters' own activation then found no victim)."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory, cycle = {"ready": "1GiB"}, {"drain_timeout": "3s"}
    deps = [launched(n, served=served(n), memory=memory, lifecycle=cycle) for n in ("a", "b")]
    gw = await make_gateway({"resources": {"memory_budget": "1GiB"}, "deployments": deps})
    codes: list[int] = []

    async def client(c: httpx.AsyncClient, name: str) -> None:
        for _ in range(4):
            r = await c.post("/v1/chat/completions", json=said("take:1", name))
            codes.append(r.status_code)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == f"from {served(name)}"

    async with gw.client(timeout=120) as c:
        await asyncio.gather(*(client(c, n) for n in ("a", "b") for _ in range(3)))
    assert codes == [200] * 24
    switches = [t for t in transitions(caplog, "stopping") if "switched out" in t["reason"]]
    assert switches  # it did switch, under load


async def test_a_switch_whose_drain_fails_fails_and_the_old_model_serves_on(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A switch past drain_timeout parked or stopped the old model anyway."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory, cycle = {"ready": "1GiB"}, {"drain_timeout": "300ms"}
    deps = [launched(n, served=served(n), memory=memory, lifecycle=cycle) for n in ("a", "b")]
    resources = {"memory_budget": "1GiB", "switching": "on_arrival"}  # the switch at once
    gw = await make_gateway({"resources": resources, "deployments": deps})
    async with gw.client(timeout=60) as c:
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
        pid = pid_of(gw, "a")
        long = await long_stream(c, "a", 3)
        other = await c.post("/v1/chat/completions", json=chat("b"))
        assert (other.status_code, other.json()["code"]) == (503, "unavailable")
        assert other.json()["retryable"] is True
        assert not long.done()  # refused while the old model's generation still runs
        finished = await long
        assert finished.startswith("200") and "[DONE]" in finished, finished
        assert f"from {served('a')}" in finished
        assert pid_of(gw, "a") == pid and running(gw, served("b")) == []
        again = await c.post("/v1/chat/completions", json=chat("a"))
        assert again.status_code == 200
    assert gw.gateway.fleet.lifecycle.lives["a"].state == "ready"
    assert not [t for t in transitions(caplog, "stopping") if t["deployment"] == "a"]


async def test_a_request_that_meets_an_operators_park_waits_for_the_wake(
    make_gateway: MakeGateway, gates: Gates
) -> None:
    """During the park's drain a request was let through and then waited out its deadline;
    arriving while the engine parked it got a 500 activation_failed."""
    dep = launched(lifecycle={"park": "sleep", "drain_timeout": "20s"})
    gw = await make_gateway({"deployments": [dep], "queue": {"request_deadline": "30s"}})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client(timeout=60) as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            pid = pid_of(gw)
            long = await long_stream(c, "my-model", 1)
            park = asyncio.ensure_future(m.post(f"{base}/deployments/my-model/park"))
            await gates.until_shut("my-model")
            during = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=chat()) for _ in range(3))
            )
            assert [r.status_code for r in during] == [200] * 3, [r.text for r in during]
            assert "[DONE]" in await long
            assert (await park).status_code == 200
            assert pid_of(gw) == pid  # parked and woken, never restarted
    finally:
        await runner.cleanup()


async def test_a_request_that_meets_an_operators_stop_is_refused_at_once(
    make_gateway: MakeGateway, gates: Gates
) -> None:
    dep = launched(lifecycle={"drain_timeout": "20s"})
    gw = await make_gateway({"deployments": [dep]})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client(timeout=60) as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            long = await long_stream(c, "my-model", 2)
            stop = asyncio.ensure_future(m.post(f"{base}/deployments/my-model/stop"))
            await gates.until_shut("my-model")
            refused = await c.post("/v1/chat/completions", json=chat())
            assert (refused.status_code, refused.json()["code"]) == (409, "deployment_stopped")
            assert not long.done()  # refused at once, not after the drain
            assert "[DONE]" in await long  # the running one finished in the drain
            assert (await stop).status_code == 200
    finally:
        await runner.cleanup()


async def test_a_stream_an_operators_stop_outlasts_hears_that_it_was_stopped(
    make_gateway: MakeGateway,
) -> None:
    """Past the drain the stop ends what still runs: the streams heard engine_error (the engine
    connection broke as the engine stopped); now each hears deployment_stopped, not retryable
    (a retry would be refused until it is started), and the engine connection is closed."""
    dep = launched(served=served("o"), lifecycle={"drain_timeout": "300ms"})
    gw = await make_gateway({"deployments": [dep]})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client(timeout=60) as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            longs = [await long_stream(c, "my-model", 30) for _ in range(3)]
            assert (await m.post(f"{base}/deployments/my-model/stop")).status_code == 200
            for long in longs:
                text = await long
                last = [x for x in text.splitlines() if x.startswith("data:")][-1]
                error = json.loads(last.removeprefix("data:"))["error"]
                assert (error["code"], error["retryable"]) == ("deployment_stopped", False), error
                assert "stopped by an operator" in error["message"]
        assert running(gw, served("o")) == []
        assert gw.gateway.fleet.routes["my-model"].queue.running == 0
    finally:
        await runner.cleanup()


async def test_the_idle_clock_runs_from_the_last_requests_end(
    make_gateway: MakeGateway,
) -> None:
    """An engine that had just streamed for longer than its ready_idle_timeout was stopped
    as soon as the stream ended: the clock ran from the request's start."""
    dep = launched(lifecycle={"ready_idle_timeout": "1s"})
    gw = await make_gateway({"deployments": [dep]})
    stopping: list[float] = []
    stopped = asyncio.Event()

    def watch(lc: Any) -> None:
        if lc.state.value == "stopping":
            stopping.append(stamp())
            stopped.set()

    gw.gateway.fleet.lifecycle.engines.observers.append(watch)
    async with gw.client(timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=said("take:2.5", "my-model"))
        ended = stamp()
        assert r.status_code == 200
    with anyio.fail_after(10):
        await stopped.wait()
    assert stopping[0] - ended >= 0.9  # a second after the end, less the clock's tick


async def test_a_cut_heard_after_its_engines_stop_settles_at_once(
    make_gateway: MakeGateway,
) -> None:
    """A worker's word that its request was cut can cross the engine's proven stop (a crash,
    seen by the exit watch first): the cut was then counted on a stopped engine until its next
    stop, for ever if none came (found by the model test on two workers at 400 steps)."""
    gw = await make_gateway({"deployments": [launched()]})
    fleet = gw.gateway.fleet
    inst = fleet.routes["my-model"].instances[0]
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        stopped = asyncio.Event()
        fleet.lifecycle.engines.observers.append(
            lambda lc: stopped.set() if lc.state.value == "failed" else None
        )
        assert gw.fakes is not None
        gw.fakes.exit(inst.key)  # the engine dies; the exit watch stops and fails it
        with anyio.fail_after(10):
            await stopped.wait()
        late = fleet.settlement.cut(inst.ledger, "late", answered=True, reason="hang_up")
        assert inst.ledger.cut == [] and fleet.settlement.recent[-1].cut == late
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        fleet.settlement.cut(inst.ledger, "on-the-new-engine", answered=False, reason="hang_up")
        assert [x.request_id for x in inst.ledger.cut] == ["on-the-new-engine"]


async def test_an_operators_stop_abandons_the_switch_it_meets(
    make_gateway: MakeGateway, gates: Gates
) -> None:
    """Budget for one; a serves a stream; a request for c starts a switch (a drains); an
    operator stops c. c's request got 409, but a was switched out anyway and c launched
    ("a request is waiting", though none was), then stopped (issue 34, item 3). The stop
    abandons the activation it meets: a serves on, c never starts."""
    memory, cycle = {"ready": "1GiB"}, {"drain_timeout": "20s"}
    deps = [launched(n, served=served(n), memory=memory, lifecycle=cycle) for n in ("a", "c")]
    resources = {"memory_budget": "1GiB", "switching": "on_arrival"}  # the switch at once
    gw = await make_gateway({"resources": resources, "deployments": deps})
    assert gw.fakes is not None
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    moves: list[tuple[str, str]] = []
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: moves.append((lc.inst.deployment, lc.state.value))
    )
    try:
        async with gw.client(timeout=60) as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
            long = await long_stream(c, "a", 1)
            asking = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat("c")))
            await gates.until_shut("a")  # the switch drains a
            stop = await m.post(f"{base}/deployments/c/stop")
            refused = await asking
            assert (refused.status_code, refused.json()["code"]) == (409, "deployment_stopped")
            assert stop.status_code == 200, stop.text
            assert "[DONE]" in await long
            after = await c.post("/v1/chat/completions", json=chat("a"))
            assert after.status_code == 200, after.text
    finally:
        await runner.cleanup()
    lives = gw.gateway.fleet.lifecycle.lives
    assert lives["a"].state == "ready" and lives["c"].state == "stopped"
    assert gw.fakes.starts["c/0"] == 0 and gw.fakes.starts["a/0"] == 1
    assert [s for d, s in moves if d == "a"] == ["starting", "ready"], moves
    assert gw.gateway.fleet.lifecycle.budget.held() == 2**30


async def test_requests_refused_by_an_exited_engine_wait_for_its_restart(
    make_gateway: MakeGateway,
) -> None:
    """An engine exits; before its exit is seen, its port already refuses. Requests offered
    to it then (the engine provably never got them) got 502 engine_error, with nothing to
    fail over to (issue 34, item 14). They wait for the instance to open again instead: the
    lifecycle, seeing the exit, starts the engine again for them, and each is answered."""
    gw = await make_gateway({"deployments": [launched()]})
    assert gw.fakes is not None
    fleet = gw.gateway.fleet
    route = fleet.routes["my-model"]
    inst = route.instances[0]
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        gw.fakes.exit(inst.key, seen=False)  # dead, its exit not yet seen
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.post("/v1/chat/completions", json=chat()))

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(ask)
            await eventually(lambda: route.waiters.waiting == 6 or answers)
            assert not answers, [a.text for a in answers]  # refused, and waiting
            gw.fakes.runners[inst.key].report_exit()
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert gw.fakes.starts[inst.key] == 2 and route.waiters.waiting == 0


async def test_a_request_that_comes_while_an_exited_engine_is_stopped_is_answered(
    make_gateway: MakeGateway,
) -> None:
    """An engine exits; its stop (the group killed, its requests settled) takes a moment.
    A request that came meanwhile started an activation that found nothing to start (the
    instance was still stopping, not yet failed): it and those with it got 500
    activation_failed (found by the killed-engine test, issue 34, item 14). The activation
    waits for the stop, then starts the engine again."""
    gw = await make_gateway({"deployments": [launched()]})
    assert gw.fakes is not None
    gw.fakes.scripts["my-model"] = Script(stop_s=0.5)
    fleet = gw.gateway.fleet
    inst = fleet.routes["my-model"].instances[0]
    stopping = asyncio.Event()
    fleet.lifecycle.engines.observers.append(
        lambda lc: stopping.set() if lc.state.value == "stopping" else None
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        gw.fakes.exit(inst.key)
        with anyio.fail_after(5):
            await stopping.wait()
        answers: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(lambda: _append(answers, c))
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert gw.fakes.starts[inst.key] == 2


async def _append(answers: list[httpx.Response], c: httpx.AsyncClient) -> None:
    answers.append(await c.post("/v1/chat/completions", json=chat()))


async def test_a_refusal_whose_exit_is_never_seen_is_answered_as_any_other(
    make_gateway: MakeGateway,
) -> None:
    """A launched engine's port refuses, but no exit comes (a port that refuses for another
    reason): the request waits EXIT_SEEN_S for one, then gets 502 as any refusal did, not 503
    at its deadline (found in review)."""
    gw = await make_gateway({"deployments": [launched()], "queue": {"request_deadline": "20s"}})
    assert gw.fakes is not None
    inst = gw.gateway.fleet.routes["my-model"].instances[0]
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        gw.fakes.exit(inst.key, seen=False)
        began = stamp()
        r = await c.post("/v1/chat/completions", json=chat())
        took = stamp() - began
    assert (r.status_code, r.json()["code"]) == (502, "engine_error"), r.text
    assert EXIT_SEEN_S <= took < EXIT_SEEN_S + 2


async def test_a_start_that_comes_after_the_stop_that_abandoned_a_start_starts_it(
    make_gateway: MakeGateway,
) -> None:
    """An operator starts a; a stop abandons that start, and another start comes before the
    activation has seen the abandonment (issue 43's first clean run with four test workers: the
    prefix routing model's start got 500 activation_failed, as did the first, and a stayed
    stopped). The later start is the operator's last word: a starts and serves."""
    from capyctl_gateway._lifecycle.operator import operator_start

    gw = await make_gateway({"deployments": [launched("a", served=served("a"))]})
    assert gw.fakes is not None
    gw.fakes.scripts["a"] = Script(start_s=5.0)
    lifecycle = gw.gateway.fleet.lifecycle
    starting = asyncio.Event()

    def seen(lc: Any) -> None:
        if lc.state == "starting":
            starting.set()

    lifecycle.engines.observers.append(seen)
    first = asyncio.ensure_future(operator_start(lifecycle, "a", known=True))
    with anyio.fail_after(30):
        await starting.wait()
    await _stop_then_start_serves(gw, first)
    assert gw.fakes.starts["a/0"] == 1  # the abandoned start never came up; the second did


async def test_a_start_that_comes_after_the_stop_that_abandoned_a_crash_backoff_starts_it(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, with the activation waiting out the crash backoff (two failed starts: 1 s)
    when the stop abandons it and the start comes. Before, the abandonment escaped the
    activation as a defect and the later start got 500."""
    from capyctl_gateway._lifecycle.operator import operator_start

    gw = await make_gateway({"deployments": [launched("a", served=served("a"))]})
    assert gw.fakes is not None
    gw.fakes.scripts["a"] = Script(start_fails="no model here")
    lifecycle = gw.gateway.fleet.lifecycle
    for _ in range(2):  # tried at once after the first failure; after 1 s after the second
        with pytest.raises(GatewayError, match="could not be started"):
            await operator_start(lifecycle, "a", known=True)
    gw.fakes.scripts["a"] = Script()
    first = asyncio.ensure_future(operator_start(lifecycle, "a", known=True))
    with anyio.fail_after(30):
        await eventually(lambda: "crashed again" in caplog.text)
    await _stop_then_start_serves(gw, first)


async def _stop_then_start_serves(gw: Gw, first: asyncio.Future[None]) -> None:
    """An operator's stop of deployment a and then a start, while ``first`` (a start) is under
    way: each start and the stop are answered, and a is ready and serves."""
    from capyctl_gateway._lifecycle.operator import operator_start, operator_stop

    lifecycle = gw.gateway.fleet.lifecycle
    # In this order, each up to its first wait: the stop abandons what the activation waits
    # for, the start undoes the stop and joins the activation under way.
    stop = asyncio.ensure_future(operator_stop(lifecycle, "a", known=True))
    again = asyncio.ensure_future(operator_start(lifecycle, "a", known=True))
    with anyio.fail_after(60):
        outcomes = await asyncio.gather(first, stop, again, return_exceptions=True)
    assert list(outcomes) == [None, None, None], outcomes
    life = lifecycle.lives["a"]
    assert life.state == "ready" and not life.operator_stopped
    async with gw.client(timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=chat("a"))
    assert r.status_code == 200, r.text
