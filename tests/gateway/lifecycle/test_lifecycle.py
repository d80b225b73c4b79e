"""Engines the gateway launches itself, the lifecycle's policy: the configuration's contract,
starting on the first request (one start per wave), stopping and parking when idle, the memory
budget's switch, operator commands, and intent and cut requests across restarts. The engines
run on the fake runner (``fake_runner.py``: the launchable engine's application in this
process); ``test_local_runner.py`` runs the same engine as real processes, and the live tier
real engines."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import select
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml

from capyctl_gateway import ConfigError, GatewayConfig, load_config
from capyctl_gateway._management.render import acted
from capyctl_gateway._management.status import deployment_status
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.fake_runner import Script

workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process


pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
ENGINE = [sys.executable, "-m", "tests.gateway.launchable_engine"]


def launched(name: str = "my-model", *, served: str = "tiny", extra: list[str] | None = None,
             **over: Any) -> dict[str, Any]:  # fmt: skip
    dep: dict[str, Any] = {
        "name": name,
        "engine": "vllm",
        "engine_version": "0.31.0",
        "served_model": served,
        "instances": [
            {"launch": {"command": [*ENGINE, "--served", served, *(extra or [])],
                        "startup_timeout": "60s"}}
        ],
    }  # fmt: skip
    dep.update(over)
    return dep


def chat(model: str = "my-model") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def transitions(caplog: pytest.LogCaptureFixture, to: str | None = None) -> list[dict[str, Any]]:
    found = [
        getattr(r, "fields", {}) for r in caplog.records if getattr(r, "event", "") == "lifecycle"
    ]
    return [f for f in found if to is None or f["to"] == to]


def pid_of(gw: Gw, name: str = "my-model") -> int:
    doc = deployment_status(gw.gateway.fleet, name)
    assert doc is not None
    return int(doc["instances"][0]["process"]["pid"])


async def engine_gone(gw: Gw, pid: int) -> None:
    """Return once engine ``pid`` is gone: the fake runner's record (its stop is over by the
    transition that says so), or a real process's exit."""
    if gw.fakes is not None:
        assert pid not in gw.fakes.live
        return
    await anyio.to_thread.run_sync(wait_gone, pid)


def wait_gone(pid: int, within: float = 15) -> None:
    """Block until process ``pid`` is gone (a pidfd turns readable when it exits)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], within)
        assert ready, f"process {pid} still runs"
    finally:
        os.close(fd)


# -- the configuration's contract -----------------------------------------------------------
def refused(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"extra": ["--port", "9000"]}, "sets --port; the gateway chooses"),
        ({"extra": ["--host=0.0.0.0"]}, "sets --host"),
        ({"extra": ["--no-enable-per-request-metrics"]}, "turns off --enable-per-request-metrics"),
        (
            {"engine": "llamacpp", "engine_version": "b10798", "lifecycle": {"park": "sleep"}},
            "cannot park here",
        ),
        ({"lifecycle": {"activation": "sometimes"}}, "lifecycle.activation"),
        ({"lifecycle": {"ready_idel_timeout": "1m"}}, "unknown key"),
        ({"memory": {"ready": "lots"}}, "is not a size"),
    ],
)
def test_launch_configuration_is_checked_at_load(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    extra = change.pop("extra", None)
    doc = {"deployments": [launched(extra=extra, **change)]}
    assert says in refused(tmp_path, doc)


def test_an_instance_is_either_url_or_launch(tmp_path: Path) -> None:
    both = launched()
    both["instances"][0]["url"] = "http://127.0.0.1:8000"
    assert "either url" in refused(tmp_path, {"deployments": [both]})
    neither = launched()
    neither["instances"] = [{}]
    assert "either url" in refused(tmp_path, {"deployments": [neither]})


def test_env_may_not_place_the_engine(tmp_path: Path) -> None:
    dep = launched(engine="llamacpp", engine_version="b10798")
    dep["instances"][0]["launch"]["env"] = {"LLAMA_ARG_PORT": "9000"}
    assert "env sets LLAMA_ARG_PORT" in refused(tmp_path, {"deployments": [dep]})


def test_a_budget_needs_each_launched_deployments_memory(tmp_path: Path) -> None:
    doc = {"resources": {"memory_budget": "40GiB"}, "deployments": [launched()]}
    assert "memory is required" in refused(tmp_path, doc)
    ok = GatewayConfig.model_validate({**doc, "deployments": [launched(memory={"ready": "2GiB"})]})
    assert ok.resources.memory_budget == 40 * 2**30
    assert ok.deployments[0].memory is not None and ok.deployments[0].memory.ready == 2 * 2**30
    assert ok.deployments[0].memory.parked == 0


# -- starting, idling, stopping --------------------------------------------------------------


async def test_a_wave_of_requests_causes_one_start(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [launched(extra=["--slow-start", "0.5"])]})
    async with gw.client() as c:
        answers = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=chat()) for _ in range(6))
        )
    assert [a.status_code for a in answers] == [200] * 6
    assert len(transitions(caplog, "starting")) == 1


async def test_an_idle_engine_is_stopped_and_the_next_request_starts_it_again(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(lifecycle={"ready_idle_timeout": "200ms"})
    gw = await make_gateway({"deployments": [dep]})
    stopped = anyio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: stopped.set() if lc.state.value == "stopped" else None
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        first = pid_of(gw)
        with anyio.fail_after(10):
            await stopped.wait()  # the idle watch looks once a second
        await engine_gone(gw, first)
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        assert pid_of(gw) != first
    stops = transitions(caplog, "stopped")
    assert stops and "ready_idle_timeout" in stops[0]["reason"]
    assert len(transitions(caplog, "starting")) == 2


async def test_explicit_activation_is_not_started_by_requests(make_gateway: MakeGateway) -> None:
    gw = await make_gateway({"deployments": [launched(lifecycle={"activation": "explicit"})]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert (r.status_code, r.json()["code"]) == (409, "deployment_inactive")
    assert gw.gateway.fleet.lifecycle.lives["my-model"].state == "stopped"


async def test_a_budget_that_fits_one_switches_between_two_deployments(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory = {"ready": "1GiB"}
    config = {
        "resources": {"memory_budget": "1GiB"},
        "deployments": [
            launched("a", served="model-a", memory=memory),
            launched("b", served="model-b", memory=memory),
        ],
    }
    gw = await make_gateway(config)
    lives = gw.gateway.fleet.lifecycle.lives
    async with gw.client() as c:
        for name in ("a", "b", "a"):
            r = await c.post("/v1/chat/completions", json=chat(name))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == f"from model-{name}"
            assert r.json()["model"] == name
            assert gw.gateway.fleet.lifecycle.budget.held() <= 2**30
            other = "b" if name == "a" else "a"
            assert lives[name].state == "ready" and lives[other].state == "stopped"
    switched = [t for t in transitions(caplog, "stopping") if "switched out" in t["reason"]]
    assert [t["deployment"] for t in switched] == ["a", "b"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_lifecycle_line_says_which_state_its_time_was_spent_in(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """``ready -> stopping (idle; 157.3 s)`` read as the stop's duration: the time is the one
    spent in the state before, and the line now names it."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [launched()]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    lines = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "lifecycle"]
    assert any(
        re.fullmatch(r".*: stopped -> starting \(.*; [0-9.]+ s stopped\)", line) for line in lines
    ), lines
    assert any(
        re.fullmatch(r".*: starting -> ready \(.*; [0-9.]+ s starting\)", line) for line in lines
    ), lines


# -- operator commands ------------------------------------------------------------------------
async def management(gw: Gw) -> Any:
    """The management API over a real socket, for the duration of a test."""
    from aiohttp import web

    from capyctl_gateway import create_management_app

    runner = web.AppRunner(create_management_app(gw.gateway))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/management/v1"


async def test_list_shows_a_stop_under_way_as_the_state_it_is_in(make_gateway: MakeGateway) -> None:
    """While an operator's stop drains a running request, ``list`` says the deployment is
    still ready and being stopped, not stopped; once it is, it says so."""
    gw = await make_gateway({"deployments": [launched()]})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    queue = gw.gateway.fleet.routes["my-model"].queue

    async def row(m: httpx.AsyncClient) -> dict[str, Any]:
        listing = (await m.get(f"{base}/deployments")).json()
        return next(d for d in listing["deployments"] if d["name"] == "my-model")

    try:
        async with gw.client() as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            long = {**chat(), "messages": [{"role": "user", "content": "take:3"}]}
            async with anyio.create_task_group() as tg:
                answers: list[int] = []

                async def ask() -> None:
                    answers.append((await c.post("/v1/chat/completions", json=long)).status_code)

                tg.start_soon(ask)
                await eventually(lambda: queue.running == 1)  # the request reaches the engine
                stops: list[int] = []

                async def stop() -> None:
                    stops.append((await m.post(f"{base}/deployments/my-model/stop")).status_code)

                tg.start_soon(stop)

                async def begun() -> dict[str, Any] | None:
                    seen = await row(m)
                    return seen if seen["state"] != "ready" else None

                during = await eventually(begun)  # the stop has begun
                assert during["state"] == "ready (an operator's stop)", during
                assert not stops  # the stop still waits for the running request
            assert answers == [200] and stops == [200]
            assert (await row(m))["state"] == "stopped by an operator"
    finally:
        await runner.cleanup()


async def test_operator_stop_start_and_park(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [launched()]})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client() as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            pid = pid_of(gw)
            stopped = await m.post(f"{base}/deployments/my-model/stop")
            assert stopped.status_code == 200
            assert stopped.json()["deployment"]["lifecycle"] == "stopped"
            await engine_gone(gw, pid)
            refused = await c.post("/v1/chat/completions", json=chat())
            assert (refused.status_code, refused.json()["code"]) == (409, "deployment_stopped")
            # the log said requests "wait" while they were refused
            assert "my-model: admits none; requests get deployment_stopped" in caplog.text
            listing = (await m.get(f"{base}/deployments")).json()
            row = next(d for d in listing["deployments"] if d["name"] == "my-model")
            assert row["state"] == "stopped by an operator" and row["ready"] == 0
            # status said unavailable for a parked model too; now only where no request starts it
            doc = (await m.get(f"{base}/deployments/my-model")).json()
            assert doc["deployment"]["state"] == "unavailable"
            started = await m.post(f"{base}/deployments/my-model/start")
            assert started.json()["deployment"]["lifecycle"] == "ready"
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            parked = await m.post(f"{base}/deployments/my-model/park")
            assert parked.json()["deployment"]["lifecycle"] == "stopped"
            assert parked.json()["deployment"]["state"] == "standby"
            # the CLI printed "stopped" for a park that had to stop the engine
            said = acted("park", parked.json())
            assert said.startswith("parked") and "the next request starts it" in said
            # A park is not an operator stop: the next request starts it again.
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            unknown = await m.post(f"{base}/deployments/nope/start")
            assert (unknown.status_code, unknown.json()["code"]) == (404, "unknown_model")
    finally:
        await runner.cleanup()
    assert len(transitions(caplog, "starting")) == 3


async def test_explicit_activation_serves_once_an_operator_starts_it(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway({"deployments": [launched(lifecycle={"activation": "explicit"})]})
    runner, base = await management(gw)
    try:
        async with gw.client() as c, httpx.AsyncClient(timeout=60) as m:
            auth = {"Authorization": f"Bearer {gw.key}"}
            assert (await m.post(f"{base}/deployments/my-model/start")).status_code == 401
            r = await m.post(f"{base}/deployments/my-model/start", headers=auth)
            assert r.status_code == 200
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    finally:
        await runner.cleanup()


async def test_an_engine_someone_else_runs_is_not_the_operators_to_stop(
    make_gateway: MakeGateway, engine: Any
) -> None:
    from tests.gateway.conftest import deployments

    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    runner, base = await management(gw)
    try:
        async with httpx.AsyncClient(timeout=60) as m:
            r = await m.post(
                f"{base}/deployments/my-model/stop",
                headers={"Authorization": f"Bearer {gw.key}"},
            )
        assert (r.status_code, r.json()["code"]) == (409, "deployment_not_launched")
    finally:
        await runner.cleanup()


# -- parking with the process up (vLLM sleep mode, spoken by the fake) -------------------------
def observe(gw: Gw, state: str) -> anyio.Event:
    seen = anyio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: seen.set() if lc.state.value == state else None
    )
    return seen


async def test_parked_for_parked_idle_timeout_stops(make_gateway: MakeGateway) -> None:
    cycle = {"park": "sleep", "ready_idle_timeout": "200ms", "parked_idle_timeout": "200ms"}
    gw = await make_gateway({"deployments": [launched(lifecycle=cycle)]})
    parked, stopped = observe(gw, "parked"), observe(gw, "stopped")
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    pid = pid_of(gw)
    with anyio.fail_after(15):
        await parked.wait()
        await stopped.wait()
    await engine_gone(gw, pid)


async def test_a_model_with_cut_requests_waiting_for_a_restart_stops_instead_of_parking(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(lifecycle={"park": "sleep", "ready_idle_timeout": "200ms"})
    gw = await make_gateway({"deployments": [dep]})
    stopped = observe(gw, "stopped")
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    settlement = gw.gateway.fleet.settlement
    ledger = settlement.ledgers["my-model/0"]
    settlement.cut(ledger, "cut-early", answered=False, reason="hang_up")
    with anyio.fail_after(10):
        await stopped.wait()
    assert ledger.cut == []  # the stop settled it
    assert not transitions(caplog, "parked")
    assert any("not a park" in t["reason"] for t in transitions(caplog, "stopping"))


async def test_switching_parks_the_other_deployment_when_its_parked_memory_fits(
    make_gateway: MakeGateway,
) -> None:
    memory = {"ready": "1GiB", "parked": 0}
    cycle = {"park": "sleep"}
    config = {
        "resources": {"memory_budget": "1GiB"},
        "deployments": [
            launched("a", served="model-a", memory=memory, lifecycle=cycle),
            launched("b", served="model-b", memory=memory, lifecycle=cycle),
        ],
    }
    gw = await make_gateway(config)
    lives = gw.gateway.fleet.lifecycle.lives
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
        a_pid = pid_of(gw, "a")
        r = await c.post("/v1/chat/completions", json=chat("b"))
        assert r.json()["choices"][0]["message"]["content"] == "from model-b"
        assert lives["a"].state == "parked" and lives["b"].state == "ready"
        r = await c.post("/v1/chat/completions", json=chat("a"))
        assert r.json()["choices"][0]["message"]["content"] == "from model-a"
        assert pid_of(gw, "a") == a_pid  # woken, not restarted
        assert lives["b"].state == "parked"


# -- what outlives the gateway ------------------------------------------------------------------
async def test_an_operators_stop_and_cut_requests_outlive_a_restart(
    tmp_path: Path, engine: Any
) -> None:
    """Two gateways one after the other on one state directory (the restart)."""
    import sqlite3

    from capyctl_gateway import GATEWAY_KEY, GatewayRunner, create_app
    from capyctl_gateway._lifecycle.operator import operator_stop
    from tests.gateway.conftest import COLLECTOR, KEY, deployments

    config = GatewayConfig.model_validate(
        {"deployments": [launched(), deployments(engine.url, name="elsewhere")]}
    )
    state = tmp_path / "state"

    async def run(check: Callable[[Any], Awaitable[None]]) -> None:
        app = create_app(config, KEY, env={}, collector_options=COLLECTOR, state_dir=state)
        runner = GatewayRunner(app)
        await runner.setup()
        try:
            await check(app[GATEWAY_KEY])
        finally:
            await runner.cleanup()

    async def first(gateway: Any) -> None:
        await operator_stop(gateway.fleet.lifecycle, "my-model", known=True)
        s = gateway.fleet.settlement
        s.cut(s.ledgers["elsewhere/0"], "01REQUESTCUTBEFORE", answered=False, reason="hang_up")
        s.cut(s.ledgers["my-model/0"], "01REQUESTOFLAUNCHED", answered=False, reason="hang_up")

    async def second(gateway: Any) -> None:
        assert gateway.fleet.lifecycle.lives["my-model"].operator_stopped
        with pytest.raises(Exception, match="stopped by an operator") as info:
            gateway.fleet.lifecycle.want("my-model")
        assert type(info.value).__name__ == "DeploymentStoppedError"
        # An engine someone else runs may still run the request: still counted, same rule.
        (kept,) = gateway.fleet.settlement.ledgers["elsewhere/0"].cut
        assert kept.request_id == "01REQUESTCUTBEFORE" and kept.rule.value.startswith("at the")
        # The gateway's own engine starts afresh: settled.
        assert gateway.fleet.settlement.ledgers["my-model/0"].cut == []

    await run(first)
    await run(second)
    db = sqlite3.connect(state / "gateway.sqlite3")
    try:
        rows = db.execute("SELECT instance, request_id FROM cut").fetchall()
    finally:
        db.close()
    assert rows == [("elsewhere/0", "01REQUESTCUTBEFORE")]


async def test_a_callers_request_id_is_never_stored(tmp_path: Path, engine: Any) -> None:
    from capyctl_gateway import GATEWAY_KEY, GatewayRunner, create_app
    from tests.gateway.conftest import COLLECTOR, KEY, deployments
    from tests.gateway.fake_engine import Hold, chunk, event

    engine.script = [event(chunk(delta={"role": "assistant", "content": ""})), Hold()]
    config = GatewayConfig.model_validate({"deployments": [deployments(engine.url)]})
    state = tmp_path / "state"
    app = create_app(config, KEY, env={}, collector_options=COLLECTOR, state_dir=state)
    runner = GatewayRunner(app)
    await runner.setup()
    from aiohttp import web

    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with httpx.AsyncClient(timeout=10) as c, anyio.create_task_group() as tg:

            async def send() -> None:
                await c.post(
                    f"http://{host}:{port}/v1/chat/completions",
                    json={**chat(), "stream": True},
                    headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "caller-secret-7"},
                )

            tg.start_soon(send)
            with anyio.fail_after(5):
                await engine.arrived.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):
            await engine.hung_up.wait()
        assert app[GATEWAY_KEY].fleet.settlement.ledgers["my-model/0"].cut  # a cut was recorded
    finally:
        await runner.cleanup()
    data = b"".join(p.read_bytes() for p in state.glob("gateway.sqlite3*"))
    assert b"caller-secret-7" not in data
    assert b"my-model/0" in data


async def test_a_cut_restored_at_startup_is_polled_fast_from_the_first_poll(
    tmp_path: Path, engine: Any
) -> None:
    """Regression: the store was restored before the collector existed, so a cut left by the
    previous run was polled at the default interval, not every 250 ms."""
    from capyctl_gateway import GATEWAY_KEY, GatewayRunner, create_app
    from capyctl_gateway._deployments.settle import FAST_POLL_MS, CutRequest, SettleRule
    from capyctl_gateway._store import Store
    from tests.gateway.conftest import COLLECTOR, KEY, deployments

    state = tmp_path / "state"
    store = Store(state / "gateway.sqlite3")
    store.add_cut("my-model/0", CutRequest("01LEFTBYTHELASTRUN", 1.0, SettleRule.AT_RESTART, "x"))
    store.close()
    config = GatewayConfig.model_validate({"deployments": [deployments(engine.url)]})
    app = create_app(config, KEY, env={}, collector_options=COLLECTOR, state_dir=state)
    runner = GatewayRunner(app)
    await runner.setup()
    try:
        fleet = app[GATEWAY_KEY].fleet
        assert [c.request_id for c in fleet.settlement.ledgers["my-model/0"].cut] == [
            "01LEFTBYTHELASTRUN"
        ]
        assert fleet.collector.status("my-model/0").poll_interval_s == FAST_POLL_MS / 1000
        assert COLLECTOR.poll_interval_ms != FAST_POLL_MS  # the default would not pass
    finally:
        await runner.cleanup()


async def test_a_start_answers_ready_for_the_deployment_it_made_ready(
    make_gateway: MakeGateway,
) -> None:
    """``POST .../start`` said ``state: unavailable`` for a deployment it had just made ready
    (the collector had not polled its engine yet), while ``list`` said ready (issue 34, item
    16): a launched deployment is ready while an instance takes requests."""
    gw = await make_gateway({"deployments": [launched(lifecycle={"activation": "explicit"})]})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with httpx.AsyncClient(headers=auth, timeout=60) as m:
            started = (await m.post(f"{base}/deployments/my-model/start")).json()
            listed = (await m.get(f"{base}/deployments")).json()["deployments"][0]
    finally:
        await runner.cleanup()
    assert started["deployment"]["lifecycle"] == "ready"
    assert started["deployment"]["state"] == "ready" == listed["state"]


async def test_a_park_that_fails_is_a_stop_and_a_wake_that_fails_answers_activation_failed(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The fake runner's scripted failures: an engine that will not park is stopped instead
    (its memory freed, the next request starts it); one that will not wake is stopped and
    failed, and the request that woke it gets 500 activation_failed."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(lifecycle={"park": "sleep", "ready_idle_timeout": "200ms"})
    gw = await make_gateway({"deployments": [dep]})
    assert gw.fakes is not None
    gw.fakes.scripts["my-model"] = Script(park_fails="the engine refused to sleep")
    stopped = observe(gw, "stopped")
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        with anyio.fail_after(10):
            await stopped.wait()  # the idle park failed: a stop
        assert gw.fakes.live == {}
        assert "could not park" in transitions(caplog, "stopped")[0]["reason"]
        gw.fakes.scripts["my-model"] = Script(wake_fails="the weights did not come back")
        parked = observe(gw, "parked")
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        with anyio.fail_after(10):
            await parked.wait()
        r = await c.post("/v1/chat/completions", json=chat())
    assert (r.status_code, r.json()["code"]) == (500, "activation_failed"), r.text
    life = gw.gateway.fleet.lifecycle.lives["my-model"]
    assert life.state == "failed" and gw.fakes.live == {}
    assert gw.fakes.starts["my-model/0"] == 2
