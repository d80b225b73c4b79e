"""One engine process to show and one to stop, whoever kills which; engines that exit unasked
are seen at once and restarted, with a growing delay when they keep crashing. Real processes
(the launchable fake engine under the gateway's reaper)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml

from capyctl_gateway._management.status import deployment_status
from tests.eventually import eventually
from tests.gateway.conftest import Gw
from tests.gateway.deployments.test_operator import free_port
from tests.gateway.lifecycle.test_lifecycle import chat, launched, wait_gone
from tests.gateway.lifecycle.test_lifecycle_races import engines_running, said, served
from tests.gateway.serving import listening, serve_command

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


def process(gw: Gw, name: str = "my-model") -> dict[str, Any]:
    doc = deployment_status(gw.gateway.fleet, name)
    assert doc is not None
    return dict(doc["instances"][0]["process"])


def moved_to(gw: Gw, state: str) -> asyncio.Event:
    seen = asyncio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: seen.set() if lc.state.value == state else None
    )
    return seen


@pytest.mark.parametrize("whom", ["engine", "reaper"])
async def test_killing_either_pid_status_shows_leaves_no_engine_and_no_second_one(
    make_gateway: MakeGateway, whom: str
) -> None:
    """``status`` showed the reaper's pid; killing it orphaned the engine, and the gateway
    started a second engine for the instance while the first ran on."""
    name = served("solo")
    gw = await make_gateway({"deployments": [launched(served=name)]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        shown = process(gw)
        assert engines_running(name) == [shown["pid"]]  # the engine's own pid
        assert shown["reaper_pid"] != shown["pid"]
        failed = moved_to(gw, "failed")
        os.kill(shown["pid"] if whom == "engine" else shown["reaper_pid"], signal.SIGKILL)
        with anyio.fail_after(10):
            await failed.wait()
        await anyio.to_thread.run_sync(wait_gone, shown["pid"])
        await anyio.to_thread.run_sync(wait_gone, shown["reaper_pid"])
        assert engines_running(name) == []
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        again = process(gw)
        assert engines_running(name) == [again["pid"]] and again["pid"] != shown["pid"]


@pytest.mark.parametrize("whom", ["stop", "reaper"])
async def test_a_child_that_left_the_engines_group_dies_with_the_engine(
    make_gateway: MakeGateway, tmp_path: Path, whom: str
) -> None:
    """A child that left the engine's process group (``setsid``) outlived every stop."""
    stray_file = tmp_path / "stray.pid"
    gw = await make_gateway(
        {"deployments": [launched(extra=["--stray-pid-file", str(stray_file)])]}
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    stray = int(stray_file.read_text())
    assert os.getsid(stray) == stray  # it really left
    shown = process(gw)
    if whom == "stop":
        life = gw.gateway.fleet.lifecycle.lives["my-model"]
        await gw.gateway.fleet.lifecycle.close(life, "a test's stop", may_park=False, must=True)
    else:  # the engine is killed first: its stray is then the reaper's to collect
        os.kill(shown["pid"], signal.SIGKILL)
    await anyio.to_thread.run_sync(wait_gone, stray)
    await anyio.to_thread.run_sync(wait_gone, shown["reaper_pid"])


async def test_an_engine_that_keeps_crashing_is_restarted_later_each_time(
    make_gateway: MakeGateway,
) -> None:
    """A crash loop had no backoff: 31 starts for 30 requests."""
    gw = await make_gateway({"deployments": [launched()], "queue": {"request_deadline": "60s"}})
    starts: list[str] = []
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: starts.append(lc.state.value) if lc.state.value == "starting" else None
    )
    backoffs: list[float] = []
    async with gw.client(timeout=90) as c:
        for _ in range(3):
            failed = moved_to(gw, "failed")
            r = await c.post("/v1/chat/completions", json={**said("crash", "my-model")})
            assert r.status_code in (200, 502), r.text  # cut: in band, or before the head
            with anyio.fail_after(10):
                await failed.wait()
            doc = deployment_status(gw.gateway.fleet, "my-model")
            assert doc is not None
            backoffs.append(doc["instances"][0].get("restart_backoff_s", 0.0))
        assert doc is not None and doc["instances"][0]["failures_in_a_row"] == 3
        ok = await c.post("/v1/chat/completions", json=chat())  # waits out the backoff
        assert ok.status_code == 200, ok.text
    assert backoffs[0] == 0.0 and 0 < backoffs[1] < backoffs[2]  # 1 s, then 2 s
    assert len(starts) == 4


async def test_an_engine_that_stops_answering_is_replaced(make_gateway: MakeGateway) -> None:
    """An engine stopped with SIGSTOP stayed ready for ever; every request waited out its
    deadline."""
    dep = launched(lifecycle={"unresponsive_timeout": "1s"})
    gw = await make_gateway({"deployments": [dep]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        frozen = process(gw)["pid"]
        failed = moved_to(gw, "failed")
        os.kill(frozen, signal.SIGSTOP)
        try:
            with anyio.fail_after(30):
                await failed.wait()
            await anyio.to_thread.run_sync(wait_gone, frozen)  # killed, not left stopped
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert process(gw)["pid"] != frozen


async def test_an_engine_that_fails_a_startup_check_serves_and_is_never_stopped_for_it(
    make_gateway: MakeGateway,
) -> None:
    """An engine whose ``/metrics`` the collector could not read failed its startup checks and
    still served, but was killed every ``unresponsive_timeout``, mid-stream, as "the engine
    answered nothing": it is judged by what it does answer (its health)."""
    dep = launched(extra=["--metrics-down"], lifecycle={"unresponsive_timeout": "1s"})
    gw = await make_gateway({"deployments": [dep]})
    failed = moved_to(gw, "failed")
    collector = gw.gateway.fleet.collector
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        pid = process(gw)["pid"]
        since = time.time()
        # its health answered for three times its unresponsive_timeout, its load never read
        await eventually(
            lambda: (collector.status("my-model/0").answered_at or 0.0) >= since + 3.0, within=20
        )
        status = collector.status("my-model/0")
        assert status.collected_at is None and "/metrics answered 503" in (status.error or "")
        assert not failed.is_set() and process(gw)["pid"] == pid
        doc = deployment_status(gw.gateway.fleet, "my-model")
        assert doc is not None
        assert "/metrics answered 503" in str(doc["instances"][0])  # status names the check
        r = await c.post("/v1/chat/completions", json={**chat(), "stream": True})
        assert r.status_code == 200 and "data: [DONE]" in r.text, r.text


def test_a_stopping_gateway_ends_an_open_stream_in_band_after_its_shutdown_timeout(
    tmp_path: Path,
) -> None:
    """A graceful stop took up to twice the time it printed, and cut a stream still open then
    with no error event."""
    config = tmp_path / "g.yaml"
    dep = launched()
    config.write_text(yaml.safe_dump({"limits": {"shutdown_timeout": "1s"}, "deployments": [dep]}))
    state, port = tmp_path / "state", free_port()
    argv, env = serve_command(config, state, port, free_port())
    with subprocess.Popen(argv, stderr=subprocess.PIPE, env=env) as gateway:
        try:
            key = listening(gateway, state)
            body = {**said("take:60", "my-model"), "stream": True}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            events: list[str] = []
            with (
                httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as c,
                c.stream("POST", url, json=body) as r,
            ):
                for text in r.iter_lines():
                    if text.startswith("data:"):
                        events.append(text)
                        if len(events) == 1:  # it runs: now stop the gateway
                            gateway.send_signal(signal.SIGTERM)
            assert gateway.stderr is not None
            rest = gateway.stderr.read().decode()
            assert gateway.wait(timeout=30) == 0
        finally:
            if gateway.poll() is None:
                gateway.kill()
    assert '"error"' in events[-1] and "[DONE]" not in events[-1], events
    # what happened, and that a retry (to this gateway once back, or another) may work
    error = json.loads(events[-1].removeprefix("data:"))["error"]
    assert (error["code"], error["retryable"]) == ("shutting_down", True), error
    assert "waiting up to 1 s for 1 running" in rest
    assert "ended 1 request(s) still open" in rest
    assert rest.rstrip().endswith("capyctl-gateway: stopped")


async def test_an_engine_that_wakes_with_other_answers_is_stopped_not_served(
    make_gateway: MakeGateway,
) -> None:
    """After a wake the engine answers the check's fixed prompt; an answer other than the one
    recorded at its first start stops it (wake_mismatch) and the next request starts it
    afresh."""
    dep = launched(extra=["--garbled-after-wake"], lifecycle={"park": "sleep"})
    gw = await make_gateway({"deployments": [dep]})
    lifecycle = gw.gateway.fleet.lifecycle
    life = lifecycle.lives["my-model"]
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        first = process(gw)["pid"]
        assert await lifecycle.close(life, "a test's park")
        assert life.state == "parked"
        r = await c.post("/v1/chat/completions", json=chat())
        assert (r.status_code, r.json()["code"]) == (500, "activation_failed")
        await anyio.to_thread.run_sync(wait_gone, first)  # stopped, not serving
        doc = deployment_status(gw.gateway.fleet, "my-model")
        assert doc is not None and "wake_mismatch" in doc["instances"][0]["failure"]
        again = await c.post("/v1/chat/completions", json=chat())
        assert again.status_code == 200, again.text
        assert process(gw)["pid"] != first  # a fresh start: nothing garbled


async def test_requests_sent_to_a_dead_engine_before_its_exit_is_seen_are_answered(
    make_gateway: MakeGateway,
) -> None:
    """A real engine killed, its exit not yet seen by the gateway (its keeper, which reports
    it, is held with SIGSTOP): its port refuses, and requests offered to it then got 502
    engine_error (issue 34, item 14). They wait for the restart that the exit brings once it
    is seen, and are answered; a new engine serves."""
    name = served("window")
    gw = await make_gateway({"deployments": [launched(served=name)]})
    route = gw.gateway.fleet.routes["my-model"]
    async with gw.client(timeout=60) as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        shown = process(gw)
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.post("/v1/chat/completions", json=chat()))

        os.kill(shown["reaper_pid"], signal.SIGSTOP)
        try:
            os.kill(shown["pid"], signal.SIGKILL)
            await anyio.to_thread.run_sync(wait_gone, shown["pid"])  # dead, not yet reaped
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(ask)
                await eventually(lambda: route.waiters.waiting == 6 or answers)
                assert not answers, [a.text for a in answers]  # refused, and waiting
                os.kill(shown["reaper_pid"], signal.SIGCONT)  # the exit is seen now
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone: it reported the exit
                os.kill(shown["reaper_pid"], signal.SIGCONT)
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    again = process(gw)
    assert again["pid"] != shown["pid"] and engines_running(name) == [again["pid"]]
