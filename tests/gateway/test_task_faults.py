"""No lifecycle task dies without a word: a defect (an exception nobody documented) injected in
an activation, in making room, in the idle watch, in an exit watch or in a closing is logged
once with its traceback, counted in ``capyctl_task_faults_total``, and answered at once with
500 ``internal_error``; a watch that faulted goes on. The first three were silent before (a
500 that blamed the engine's log, a 503 at the request's deadline, an idle watch gone for
good)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from capyctl_gateway._errors import InternalError, InvalidRequestError
from capyctl_gateway._management.metrics import exposition
from capyctl_gateway._tasks import KEEP_BACKOFF_FIRST_S, Supervisor
from tests.gateway.conftest import Gw
from tests.gateway.lifecycle.test_lifecycle import chat, launched, transitions

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


def tracebacks(caplog: pytest.LogCaptureFixture, kind: type[BaseException]) -> list[str]:
    """The messages of the records logged with an exception of ``kind`` attached."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.exc_info is not None and isinstance(r.exc_info[1], kind)
    ]


class ProbeError(KeyError):
    """The injected defect."""


# -- the supervisor itself ----------------------------------------------------------------------
async def test_a_task_that_raises_a_defect_is_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = Supervisor("tests")

    async def boom() -> None:
        raise ProbeError("x")

    async def refused() -> None:
        raise InvalidRequestError("a documented refusal, answered by its own code")

    failing = tasks.spawn(boom(), kind="exit_watch", what="probing")
    answered = tasks.spawn(refused(), kind="activation", what="refusing")
    await asyncio.wait([failing, answered])  # its callbacks ran first: they came first
    assert tracebacks(caplog, ProbeError) == ["tests: internal error while probing"]
    assert tracebacks(caplog, InvalidRequestError) == []
    assert tasks.faults == {"exit_watch": 1}
    assert len(tasks) == 0
    await tasks.aclose()


async def test_a_kept_loop_goes_on_after_a_fault(caplog: pytest.LogCaptureFixture) -> None:
    tasks = Supervisor("tests")
    turns = 0
    third = anyio.Event()

    async def step() -> None:
        nonlocal turns
        turns += 1
        if turns == 1:
            raise ProbeError("the first turn")
        if turns == 3:
            third.set()

    loop = tasks.keep(step, every=0.01, kind="idle_watch", what="the probe loop")
    with anyio.fail_after(10):
        await third.wait()
    assert not loop.done()
    assert tasks.faults == {"idle_watch": 1}
    assert tracebacks(caplog, ProbeError) == ["tests: internal error while the probe loop"]
    await tasks.aclose()
    assert loop.cancelled() and len(tasks) == 0


async def test_a_kept_loop_starts_when_told_and_ends_when_a_turn_says_it_is_done() -> None:
    tasks = Supervisor("tests")
    turns: list[float] = []
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def step() -> bool:
        turns.append(loop.time() - began)
        if len(turns) == 1:
            raise ProbeError("the first turn")
        return len(turns) == 3  # the third turn's work is done

    kept = tasks.keep(step, every=0.0, first=0.0, kind="pod_delete", what="the probe loop")
    with anyio.fail_after(10):
        await kept
    assert len(turns) == 3 and turns[0] < 0.5  # at once, not after a period
    assert turns[1] - turns[0] >= KEEP_BACKOFF_FIRST_S  # a fault waits, however short `every`
    assert tasks.faults == {"pod_delete": 1} and len(tasks) == 0
    await tasks.aclose()


async def test_closing_ends_tasks_spawned_while_it_closes() -> None:
    tasks = Supervisor("tests")
    late: list[asyncio.Task[None]] = []

    async def forever() -> None:
        await asyncio.Event().wait()

    async def last_words() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            late.append(tasks.spawn(forever()))

    tasks.spawn(last_words())
    await asyncio.sleep(0)
    await tasks.aclose()
    assert len(late) == 1 and late[0].cancelled() and len(tasks) == 0


# -- the probe, through a gateway -----------------------------------------------------------------
async def _assert_answered_internal(gw: Gw, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    async with gw.client() as c:
        with anyio.fail_after(30):  # the request's deadline is 10 minutes: a 503 never comes here
            r = await c.post("/v1/chat/completions", json=chat())
    assert (r.status_code, r.json()["code"]) == (500, "internal_error"), r.text
    assert "ProbeError" not in r.text and "127.0.0.1" not in r.text
    assert len(tracebacks(caplog, ProbeError)) == 1
    assert gw.gateway.fleet.tasks.faults == {kind: 1}
    assert f'capyctl_task_faults_total{{task="{kind}"}} 1.0' in exposition(gw.gateway).decode()


async def test_a_defect_in_starting_an_engine_is_answered_at_once(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capyctl_gateway._local.runner import LocalRunner

    real = LocalRunner.start

    async def start(self: LocalRunner, reason: str) -> str:
        raise ProbeError("in the runner's start")

    monkeypatch.setattr(LocalRunner, "start", start)
    gw = await make_gateway({"deployments": [launched()]})
    await _assert_answered_internal(gw, caplog, "activation")
    life = gw.gateway.fleet.lifecycle.lives["my-model"]
    assert life.state == "stopped" and not life.activating
    monkeypatch.setattr(LocalRunner, "start", real)  # nothing is left stuck: the next one starts
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200


async def test_a_defect_in_making_room_is_answered_at_once(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capyctl_gateway._lifecycle.budget import MemoryBudget

    async def make_room(self: MemoryBudget, *args: Any) -> bool:
        raise ProbeError("in making room")

    monkeypatch.setattr(MemoryBudget, "make_room", make_room)
    gw = await make_gateway({"deployments": [launched()]})
    await _assert_answered_internal(gw, caplog, "activation")
    assert transitions(caplog) == []  # nothing was started


async def test_the_idle_watch_goes_on_after_a_defect(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capyctl_gateway._lifecycle import controller, watch

    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    real, looks = watch.look, 0

    async def look(lifecycle: Any, now: float) -> None:
        nonlocal looks
        looks += 1
        if looks == 1:
            raise ProbeError("in the idle watch")
        await real(lifecycle, now)

    monkeypatch.setattr(controller, "look", look)
    gw = await make_gateway({"deployments": [launched(lifecycle={"ready_idle_timeout": "200ms"})]})
    stopped = anyio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: stopped.set() if lc.state.value == "stopped" else None
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    with anyio.fail_after(20):  # the watch faulted once, waits 2 s, and idles it as before
        await stopped.wait()
    assert looks > 1 and gw.gateway.fleet.tasks.faults == {"idle_watch": 1}
    assert tracebacks(caplog, ProbeError) == ["the lifecycle: internal error while the idle watch"]
    assert "ready_idle_timeout" in transitions(caplog, "stopped")[0]["reason"]


async def test_a_defect_in_an_exit_watch_is_logged_and_the_look_still_sees_the_exit(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capyctl_gateway._local.runner import LocalRunner

    async def gone(self: LocalRunner) -> str:
        raise ProbeError("in the exit watch")

    monkeypatch.setattr(LocalRunner, "gone", gone)
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [launched()]})
    failed = anyio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: failed.set() if lc.state.value == "failed" else None
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    assert gw.gateway.fleet.tasks.faults == {"exit_watch": 1}
    assert tracebacks(caplog, ProbeError) == [
        "the lifecycle: internal error while watching deployment my-model, instance 0 for its exit"
    ]
    lc = gw.gateway.fleet.lifecycle.lives["my-model"].launched[0]
    proc = lc.inst.runner.process()
    assert proc is not None and proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    with anyio.fail_after(20):  # the look once a second is the fallback
        await failed.wait()
    assert "exited" in (lc.failure or "")


async def test_a_defect_in_a_closing_answers_the_operator_and_it_serves_on(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capyctl_gateway._lifecycle import rest
    from capyctl_gateway._lifecycle.operator import operator_park

    async def put_to_rest(*args: Any, **kw: Any) -> None:
        raise ProbeError("in a closing")

    monkeypatch.setattr(rest, "put_to_rest", put_to_rest)
    gw = await make_gateway({"deployments": [launched()]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        lifecycle = gw.gateway.fleet.lifecycle
        with pytest.raises(InternalError):
            await operator_park(lifecycle, "my-model", known=True)
        life = lifecycle.lives["my-model"]
        assert life.closing is None and life.serves_now
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    assert gw.gateway.fleet.tasks.faults == {"closing": 1}
    assert len(tracebacks(caplog, ProbeError)) == 1
