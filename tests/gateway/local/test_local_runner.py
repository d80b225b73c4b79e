"""The local runner's room with real processes (the launchable fake engine under the gateway's
reaper): the flags it forces on an engine's command line, a failed start and the engine's own
last words, parking and waking through the engine's own routes (vLLM's sleep mode, SGLang's
memory saver), and no engine outliving the gateway, however it stops. The lifecycle's policy is
tested on the fake runner (``test_lifecycle.py``, ``test_lifecycle_races.py``)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import httpx
import pytest
import yaml

from capyctl_gateway._management.status import deployment_status
from tests.gateway.conftest import WORKERS, Gw
from tests.gateway.lifecycle.test_lifecycle import (
    _free_port,
    chat,
    launched,
    observe,
    pid_of,
    transitions,
    wait_gone,
)
from tests.gateway.serving import listening, serve_command

workers = WORKERS


pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


async def test_the_first_request_starts_the_engine_with_the_forced_flags(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [launched()]})
    async with gw.client() as c:
        models = await c.get("/v1/models")  # never starts anything
        model = await c.get("/v1/models/my-model")  # nor does one model
        assert models.status_code == model.status_code == 200 and transitions(caplog) == []
        assert models.json()["data"] == [model.json()]
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "from tiny"
    assert [(t["from"], t["to"]) for t in transitions(caplog)] == [
        ("stopped", "starting"),
        ("starting", "ready"),
    ]
    pid = pid_of(gw)
    cmdline = (await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
    assert b"--enable-per-request-metrics" in cmdline
    assert cmdline[cmdline.index(b"--host") + 1] == b"127.0.0.1"
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None and doc["deployment"]["lifecycle"] == "ready"


async def test_a_failed_start_answers_activation_failed_and_the_next_request_retries(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [launched(extra=["--exit-at-once", "3"])]})
    async with gw.client() as c:
        first = await c.post("/v1/chat/completions", json=chat())
        second = await c.post("/v1/chat/completions", json=chat())
    for r in (first, second):
        assert (r.status_code, r.json()["code"]) == (500, "activation_failed")
        assert "my-model" in r.json()["message"] and "127.0.0.1" not in r.text
        assert r.headers["x-capyctl-request-id"]
    assert len(transitions(caplog, "starting")) == 2
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "exited with status 3" in logged and "fake engine: exiting with 3 as asked" in logged


async def test_stopping_the_gateway_stops_every_engine_it_launched(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway({"deployments": [launched()]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    pid = pid_of(gw)
    await gw.gateway.fleet.lifecycle.shutdown()
    await anyio.to_thread.run_sync(wait_gone, pid)
    assert gw.gateway.fleet.lifecycle.lives["my-model"].state == "stopped"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_dies_with_a_gateway_killed_outright(tmp_path: Path) -> None:
    # The engine forks a child of its own (as vLLM does): it must not outlive the gateway either.
    config = tmp_path / "g.yaml"
    child_file = tmp_path / "child.pid"
    dep = launched(extra=["--child-pid-file", str(child_file)])
    config.write_text(yaml.safe_dump({"deployments": [dep]}))
    state = tmp_path / "state"
    ports = [_free_port(), _free_port()]
    argv, env = serve_command(config, state, ports[0], ports[1])
    with subprocess.Popen(argv, stderr=subprocess.PIPE, env=env) as gateway:
        try:
            key = listening(gateway, state)
            auth = {"Authorization": f"Bearer {key}"}
            with httpx.Client(timeout=60, headers=auth) as c:
                r = c.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", json=chat())
                assert "from tiny" in r.text
                doc = c.get(f"http://127.0.0.1:{ports[1]}/management/v1/deployments/my-model")
            pid = doc.json()["instances"][0]["process"]["pid"]
            child = int(child_file.read_text())
            gateway.send_signal(signal.SIGKILL)
            gateway.wait(timeout=30)
            wait_gone(pid)
            wait_gone(child)
        finally:
            if gateway.poll() is None:
                gateway.kill()


async def test_an_idle_vllm_with_park_sleep_parks_and_the_next_request_wakes_it(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(lifecycle={"park": "sleep", "ready_idle_timeout": "200ms"})
    gw = await make_gateway({"deployments": [dep]})
    parked = observe(gw, "parked")
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        pid = pid_of(gw)
        cmdline = (await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
        assert b"--enable-sleep-mode" in cmdline
        with anyio.fail_after(10):
            await parked.wait()
        doc = deployment_status(gw.gateway.fleet, "my-model")
        assert doc is not None and doc["deployment"]["lifecycle"] == "parked"
        assert doc["deployment"]["park"] == "sleep"
        r = await c.post("/v1/chat/completions", json=chat())  # asleep, the fake answers 503
        assert r.status_code == 200, r.text
        assert pid_of(gw) == pid  # woken, not restarted
    moves = [(t["from"], t["to"]) for t in transitions(caplog)]
    assert moves[2:] == [("ready", "parking"), ("parking", "parked"), ("parked", "waking"),
                         ("waking", "ready")]  # fmt: skip


async def test_sglang_with_park_sleep_releases_and_resumes_its_memory(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(engine="sglang", engine_version="0.5.21", lifecycle={"park": "sleep"})
    gw = await make_gateway({"deployments": [dep]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        pid = pid_of(gw)
        cmdline = (await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
        assert b"--enable-memory-saver" in cmdline and b"--enable-cache-report" in cmdline
        from capyctl_gateway._lifecycle.operator import operator_park

        await operator_park(gw.gateway.fleet.lifecycle, "my-model", known=True)
        assert gw.gateway.fleet.lifecycle.lives["my-model"].state == "parked"
        r = await c.post("/v1/chat/completions", json=chat())  # released, the fake answers 503
        assert r.status_code == 200, r.text
        assert pid_of(gw) == pid
    assert [t["to"] for t in transitions(caplog)][-2:] == ["waking", "ready"]


async def test_sglang_under_park_auto_is_never_asked_to_release(make_gateway: MakeGateway) -> None:
    gw = await make_gateway({"deployments": [launched(engine="sglang", engine_version="0.5.21")]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    pid = pid_of(gw)
    cmdline = (await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
    assert b"--enable-memory-saver" not in cmdline
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None and doc["deployment"]["park"] == "stop"


def test_a_launched_command_is_shown_without_its_secrets() -> None:
    from capyctl_gateway._management.status import shown

    argv = ["vllm", "serve", "m", "--api-key", "s3cret", "--hf-token=t0k", "--port", "1"]
    assert shown(argv) == [
        "vllm",
        "serve",
        "m",
        "--api-key",
        "***",
        "--hf-token=***",
        "--port",
        "1",
    ]


def test_under_serve_the_routers_figures_are_timed_below_the_millisecond(tmp_path: Path) -> None:
    """``serve`` runs uvloop, whose loop time is whole milliseconds: figures stamped with it
    came out as 1.0 or 2.0. Of six streams, at least one figure has a fractional part."""
    import orjson

    config = tmp_path / "g.yaml"
    config.write_text(yaml.safe_dump({"deployments": [launched()]}))
    state = tmp_path / "state"
    ports = [_free_port(), _free_port()]
    argv, env = serve_command(config, state, ports[0], ports[1])
    figures = []
    with subprocess.Popen(argv, stderr=subprocess.PIPE, env=env) as gateway:
        try:
            key = listening(gateway, state)
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
                for _ in range(6):
                    r = c.post(
                        f"http://127.0.0.1:{ports[0]}/v1/chat/completions",
                        json={**chat(), "stream": True},
                    )
                    line = next(x for x in r.text.split("\n") if x.startswith(": x-capyctl-"))
                    figures.append(orjson.loads(line.split(" ", 2)[2])["ttft_ms"])
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
    assert all(f["source"] == "router" for f in figures)
    assert any(f["value"] != int(f["value"]) for f in figures), figures


async def test_a_start_whose_port_is_taken_before_the_engine_binds_it_starts_on_another(
    make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The port is chosen, then bound by the engine: another process may take it between.
    That start answered the request 500 activation_failed; now it starts on another port, and
    the request never hears of it. (The race is made certain: the first port chosen is one a
    listener holds.)"""
    import socket

    from capyctl_gateway._local.process import free_port

    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        monkeypatch.setattr(
            "capyctl_gateway._local.runner.free_port", lambda: next(ports, None) or free_port()
        )
        gw = await make_gateway({"deployments": [launched()]})
        async with gw.client() as c:
            r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None
    port = doc["instances"][0]["process"]["port"]
    assert port != busy
    assert f"port {busy} was taken before the engine bound it" in caplog.text
    assert [(t["from"], t["to"]) for t in transitions(caplog)] == [
        ("stopped", "starting"),
        ("starting", "ready"),
    ]
