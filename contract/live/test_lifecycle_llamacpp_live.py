"""capyctl-gateway running llama-server itself: started by the first request with the flags it
forces, stopped when idle (single-model llama.cpp cannot park), started again by the next
request; a wave of requests causes one start; a budget that fits one of two deployments
switches between them, each answer from the right model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from tests.eventually import eventually

from capyctl_gateway._management.status import deployment_status
from contract.conftest import RunningGateway, serve_gateway
from contract.live import gone

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def launched(name: str, binary: Path, model: Path, alias: str, **over: Any) -> dict[str, Any]:
    command = [str(binary), "-m", str(model), "-a", alias, "-c", "2048", "-t", "1"]
    dep: dict[str, Any] = {
        "name": name,
        "engine": "llamacpp",
        "engine_version": "b10798",
        "served_model": alias,
        "instances": [{"launch": {"command": command, "startup_timeout": "120s"}}],
    }
    dep.update(over)
    return dep


@pytest.fixture
async def make_live_gateway(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    stack = contextlib.AsyncExitStack()

    async def make(config: dict[str, Any]) -> RunningGateway:
        serving = serve_gateway(config, engine_logs=tmp_path / "logs")
        stack.push_async_callback(serving.aclose)
        return await anext(serving)

    async with stack:
        yield make


def transitions(caplog: pytest.LogCaptureFixture, to: str) -> list[dict[str, Any]]:
    found = [
        getattr(r, "fields", {}) for r in caplog.records if getattr(r, "event", "") == "lifecycle"
    ]
    return [f for f in found if f["to"] == to]


async def ask(gw: RunningGateway, model: str) -> dict[str, Any]:

    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(
            gw.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {gw.key}"},
            json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


async def test_llama_server_started_by_a_request_stopped_when_idle_and_started_again(
    make_live_gateway: Callable[..., Any],
    llama_server_binary: Path,
    llama_models: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(
        "tiny", llama_server_binary, llama_models / "tiny.gguf", "tiny",
        lifecycle={"ready_idle_timeout": "1s"},
    )  # fmt: skip
    gw = await make_live_gateway({"deployments": [dep]})
    stopped = anyio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: stopped.set() if lc.state.value == "stopped" else None
    )
    answers = await asyncio.gather(*(ask(gw, "tiny") for _ in range(4)))  # a wave: one start
    assert all(a["model"] == "tiny" and a["choices"][0]["message"]["content"] for a in answers)
    assert len(transitions(caplog, "starting")) == 1
    doc = deployment_status(gw.gateway.fleet, "tiny")
    assert doc is not None
    proc = doc["instances"][0]["process"]
    cmdline = (await anyio.Path(f"/proc/{proc['pid']}/cmdline").read_bytes()).split(b"\0")
    assert b"--metrics" in cmdline and cmdline[cmdline.index(b"--host") + 1] == b"127.0.0.1"
    with anyio.fail_after(30):
        await stopped.wait()
    assert await anyio.to_thread.run_sync(gone, proc["pid"])
    again = await ask(gw, "tiny")
    assert again["choices"][0]["message"]["content"]
    assert len(transitions(caplog, "starting")) == 2


async def test_a_budget_for_one_switches_between_two_llama_servers(
    make_live_gateway: Callable[..., Any],
    llama_server_binary: Path,
    llama_models: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory = {"ready": "1GiB"}
    gw = await make_live_gateway(
        {
            "resources": {"memory_budget": "1GiB"},
            "deployments": [
                launched("a", llama_server_binary, llama_models / "tiny.gguf", "a", memory=memory),
                launched("b", llama_server_binary, llama_models / "tiny.gguf", "b", memory=memory),
            ],
        }
    )
    for name in ("a", "b", "a", "b"):
        answer = await ask(gw, name)
        assert answer["model"] == name
        lives = gw.gateway.fleet.lifecycle.lives
        assert lives[name].state == "ready"
        assert lives["b" if name == "a" else "a"].state == "stopped"
    switched = [
        t["deployment"] for t in transitions(caplog, "stopping") if "switched" in t["reason"]
    ]
    assert switched == ["a", "b", "a"]


async def test_a_llama_router_parks_by_unloading_and_wakes_by_loading(
    make_live_gateway: Callable[..., Any],
    llama_server_binary: Path,
    llama_models: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Router mode: a park ends the model's child process (its memory goes) while the router
    stays up; the next request loads it again, in the same router."""
    from capyctl_gateway._lifecycle.operator import operator_park

    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    command = [str(llama_server_binary), "--models-dir", str(llama_models / "router"), "-c", "2048"]
    dep = {
        "name": "routed",
        "engine": "llamacpp",
        "engine_version": "b10798",
        "served_model": "tiny-a",
        "instances": [{"launch": {"command": command, "startup_timeout": "120s"}}],
    }
    gw = await make_live_gateway({"deployments": [dep]})
    first = await ask(gw, "routed")
    assert first["choices"][0]["message"]["content"]
    doc = deployment_status(gw.gateway.fleet, "routed")
    assert doc is not None and doc["deployment"]["park"] == "unload"
    router_pid = doc["instances"][0]["process"]["pid"]
    url = doc["instances"][0]["url"]

    async def status() -> str:
        async with httpx.AsyncClient(timeout=30) as c:
            models = (await c.get(url + "/v1/models")).json()["data"]
        return str(next(m for m in models if m["id"] == "tiny-a")["status"]["value"])

    assert await status() == "loaded"
    await operator_park(gw.gateway.fleet.lifecycle, "routed", known=True)
    assert gw.gateway.fleet.lifecycle.lives["routed"].state == "parked"
    assert await status() == "unloaded"  # the model's process is gone
    assert await anyio.Path(f"/proc/{router_pid}").exists()  # the router is not
    again = await ask(gw, "routed")
    assert again["choices"][0]["message"]["content"]
    assert await status() == "loaded"
    doc = deployment_status(gw.gateway.fleet, "routed")
    assert doc is not None and doc["instances"][0]["process"]["pid"] == router_pid
    moves = [t["to"] for t in transitions(caplog, "parked") + transitions(caplog, "ready")]
    assert moves.count("parked") == 1 and moves.count("ready") == 2  # started, then woken


SWITCH_SOAK_S = float(os.environ.get("CAPYCTL_SWITCH_SOAK_S", "60"))


@pytest.mark.timeout(300)
async def test_four_clients_alternating_between_two_llama_servers_under_a_budget_for_one(
    make_live_gateway: Callable[..., Any],
    llama_server_binary: Path,
    llama_models: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four clients, each alternating between two deployments that fit one at a time, for a
    minute: every request answered by its own model, never two llama-servers at once, never
    more memory held than the budget; the number of switches is reported."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory = {"ready": "1GiB"}
    tiny = llama_models / "tiny.gguf"
    gw = await make_live_gateway(
        {
            "resources": {"memory_budget": "1GiB"},
            "queue": {"request_deadline": "120s"},
            "deployments": [
                launched("a", llama_server_binary, tiny, "a", memory=memory),
                launched("b", llama_server_binary, tiny, "b", memory=memory),
            ],
        }
    )
    lifecycle = gw.gateway.fleet.lifecycle
    broken: list[str] = []

    def check(lc: Any) -> None:
        held = lifecycle.budget.held()
        running = llama_servers(str(tiny))
        if held > 2**30 or len(running) > 1:
            broken.append(f"{held} bytes held, llama-servers {running} at {lc.inst.where}")

    lifecycle.engines.observers.append(check)
    codes: list[int] = []
    end = time.monotonic() + SWITCH_SOAK_S

    async def client(c: httpx.AsyncClient, first: str) -> None:
        name = first
        while time.monotonic() < end:
            r = await c.post(
                gw.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {gw.key}"},
                json={"model": name, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 4},
            )  # fmt: skip
            codes.append(r.status_code)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            name = "b" if name == "a" else "a"

    async with httpx.AsyncClient(timeout=150) as c:
        await asyncio.gather(*(client(c, first) for first in ("a", "b", "a", "b")))
    switches = [t for t in transitions(caplog, "stopping") if "switched" in t["reason"]]
    print(f"switch soak: {len(codes)} requests in {SWITCH_SOAK_S:.0f} s, "
          f"all 200: {set(codes) == {200}}, {len(switches)} switches")  # fmt: skip
    assert broken == []
    assert codes and set(codes) == {200}
    assert switches  # it did switch, under load


@pytest.mark.timeout(300)
@pytest.mark.parametrize("switching", ["on_arrival", "cost_aware"])
async def test_two_agents_taking_turns_on_two_llama_servers_switch_a_bounded_number_of_times(
    make_live_gateway: Callable[..., Any],
    llama_server_binary: Path,
    llama_models: Path,
    caplog: pytest.LogCaptureFixture,
    switching: str,
) -> None:
    """Two closed-loop agents, one per model, twelve turns each, under a budget that holds one
    llama-server: every request answered by its own model, never two llama-servers at once;
    the scheduler switches a handful of times where switching on arrival switches on almost
    every turn (the counts are printed)."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory = {"ready": "1GiB"}
    tiny = llama_models / "tiny.gguf"
    gw = await make_live_gateway(
        {
            "resources": {"memory_budget": "1GiB", "switching": switching},
            "queue": {"request_deadline": "120s"},
            "deployments": [
                launched("a", llama_server_binary, tiny, "a", memory=memory),
                launched("b", llama_server_binary, tiny, "b", memory=memory),
            ],
        }
    )
    lifecycle = gw.gateway.fleet.lifecycle
    broken: list[str] = []

    def check(lc: Any) -> None:
        running = llama_servers(str(tiny))
        if lifecycle.budget.held() > 2**30 or len(running) > 1:
            broken.append(f"llama-servers {running} at {lc.inst.where}")

    lifecycle.engines.observers.append(check)
    turns = 12

    async def agent(c: httpx.AsyncClient, name: str) -> None:
        body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
        for _ in range(turns):
            r = await c.post(
                gw.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {gw.key}"},
                json=body,
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name

    began = time.monotonic()
    async with httpx.AsyncClient(timeout=150) as c:
        await asyncio.gather(agent(c, "a"), agent(c, "b"))
    took = time.monotonic() - began
    starts = len(transitions(caplog, "starting"))
    print(f"{switching}: {2 * turns} requests in {took:.1f} s, {starts} starts")
    assert broken == []
    if switching == "cost_aware":
        assert starts <= 2 * turns // 3  # at least 3 times fewer than a start a request
    else:
        assert starts >= turns  # the thrash it ends: most turns start an engine


def llama_servers(model: str, aliases: tuple[str, ...] = ("a", "b")) -> list[int]:
    """The pids of llama-server processes serving ``model`` under one of ``aliases`` now (the
    session's own llama-server serves the same file under another name)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"llama-server") or model.encode() not in argv:
            continue
        alias = argv[argv.index(b"-a") + 1].decode() if b"-a" in argv else None
        if alias in aliases:
            found.append(int(proc.name))
    return found


async def test_a_spare_llama_server_rests_alone_and_a_full_engine_wakes_it(
    make_live_gateway: Callable[..., Any],
    llama_server_binary: Path,
    llama_models: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two llama-servers of one slot each in one deployment: both serve a request, then one
    idle for ``spare_idle_timeout`` is stopped alone (single-model llama.cpp parks by a stop;
    its process gone) while the other serves on. With the ready engine's one slot full (a long
    generation, as its samples show) a request wakes the spare and is answered by it. The
    spare's start is priced as instant here: measured, it takes about a second, and a tiny
    model's requests take milliseconds, so no wait behind one would outlast it."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = launched(
        "tiny", llama_server_binary, llama_models / "tiny.gguf", "tiny",
        lifecycle={"spare_idle_timeout": "1s"},
    )  # fmt: skip
    launch = dep["instances"][0]["launch"]
    launch["command"] = [*launch["command"], "-np", "1"]
    dep["instances"] = [{"launch": dict(launch)}, {"launch": dict(launch)}]
    gw = await make_live_gateway({"deployments": [dep]})
    lifecycle = gw.gateway.fleet.lifecycle
    life = lifecycle.lives["tiny"]
    await asyncio.gather(ask(gw, "tiny"), ask(gw, "tiny"))
    doc = deployment_status(gw.gateway.fleet, "tiny")
    assert doc is not None
    pids = [int(row["process"]["pid"]) for row in doc["instances"]]
    await eventually(
        lambda: any(lc.rested and lc.state.value == "stopped" for lc in life.launched), within=30
    )
    spare = next(lc for lc in life.launched if lc.rested)
    ready = next(lc for lc in life.launched if not lc.rested)
    assert ready.state.value == "ready" and life.serves_now
    assert await anyio.to_thread.run_sync(gone, pids[spare.inst.index])
    lifecycle.scheduler.costs.last[("tiny", "start")] = 0.0
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count"}],
            "max_tokens": 30000, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {gw.key}"}
    url = gw.url + "/v1/chat/completions"
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream("POST", url, json=body, headers=headers) as long,
    ):
        assert long.status_code == 200

        def full() -> bool:  # a sample shows its one slot taken
            s = ready.inst.runner.sample()
            return s is not None and (s.usage or 0.0) >= 1.0

        await eventually(full, within=30)
        answer = await ask(gw, "tiny")
    assert answer["choices"][0]["message"]["content"]
    assert spare.state.value == "ready" and not spare.rested
    lines = [getattr(r, "fields", {}) for r in caplog.records]
    chosen = [f for f in lines if f.get("spare") is not None]
    assert chosen[-1]["spare"]["chose"] == "wake", chosen[-1]
    assert chosen[-1]["instance"] == spare.inst.index
