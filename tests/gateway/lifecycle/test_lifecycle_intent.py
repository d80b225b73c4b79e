"""Intent and reasons: what an operator started is started again when the gateway restarts; a
deployment kept ready (``activation: always``) starts with the gateway, never idles out and
comes back after a crash without a request; every transition says who asked."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml

from capyctl_gateway import GATEWAY_KEY, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._lifecycle.operator import operator_start
from tests.gateway.conftest import COLLECTOR, KEY, WORKERS, Gw
from tests.gateway.deployments.test_operator import free_port
from tests.gateway.lifecycle.test_lifecycle import launched, transitions
from tests.gateway.lifecycle.test_lifecycle_processes import moved_to, process
from tests.gateway.lifecycle.test_lifecycle_races import engines_running, said, served
from tests.gateway.serving import serve_command

workers = WORKERS


pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


@asynccontextmanager
async def gateway(config: dict[str, Any], state: Path) -> AsyncIterator[Any]:
    """A gateway on ``state`` (its store), stopped on the way out (its engines with it)."""
    app = create_app(
        GatewayConfig.model_validate(config), KEY, env={}, collector_options=COLLECTOR,
        state_dir=state,
    )  # fmt: skip
    runner = GatewayRunner(app)
    await runner.setup()
    try:
        yield app[GATEWAY_KEY]
    finally:
        await runner.cleanup()


async def ready(gw: Any, name: str = "my-model") -> None:
    life = gw.fleet.lifecycle.lives[name]
    assert life.activation is not None  # boot() started it as the fleet opened
    with anyio.fail_after(30):
        await asyncio.shield(life.activation)
    assert life.state == "ready"


async def test_what_an_operator_started_is_started_again_at_the_gateways_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    name = served("kept")
    config = {"deployments": [launched(served=name)]}
    state = tmp_path / "state"
    async with gateway(config, state) as gw:
        await operator_start(gw.fleet.lifecycle, "my-model", known=True)
        assert len(engines_running(name)) == 1
    assert engines_running(name) == []  # the gateway stopped it on its way out
    async with gateway(config, state) as gw:
        await ready(gw)  # no request, no operator: the intent came back
        assert len(engines_running(name)) == 1
    reasons = [t["reason"] for t in transitions(caplog, "starting")]
    assert reasons == [
        "started by an operator",
        "an operator had started it before the gateway restarted",
    ]


async def test_a_deployment_kept_ready_starts_with_the_gateway_and_outlives_idleness_and_crashes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    cycle = {"activation": "always"}
    async with gateway({"deployments": [launched(lifecycle=cycle)]}, tmp_path / "s") as gw:
        await ready(gw)
        first = process_of(gw)
        failed, started = moved_to(Gw("", KEY, gw), "failed"), moved_to(Gw("", KEY, gw), "ready")
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(15):
            await failed.wait()
            await started.wait()  # back without a request
        assert process_of(gw) != first
    reasons = [t["reason"] for t in transitions(caplog, "starting")]
    assert reasons[0] == "kept ready (lifecycle.activation: always)"
    assert reasons[1] == "started again after its engine exited"


def process_of(gw: Any) -> int:
    return int(process(Gw("", KEY, gw))["pid"])


async def test_a_switch_names_the_deployment_it_makes_room_for(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    memory = {"ready": "1GiB"}
    deps = [launched(n, served=served(n), memory=memory) for n in ("a", "b")]
    gw = await make_gateway({"resources": {"memory_budget": "1GiB"}, "deployments": deps})
    async with gw.client() as c:
        for name in ("a", "b"):
            assert (await c.post("/v1/chat/completions", json=said("hi", name))).status_code == 200
    (switched,) = [t for t in transitions(caplog, "stopping") if t["deployment"] == "a"]
    assert switched["reason"] == "switched out for deployment b (the memory budget) (a stop here)"
    starts = {t["deployment"]: t["reason"] for t in transitions(caplog, "starting")}
    assert starts == {"a": "a request is waiting", "b": "a request is waiting"}


def test_a_gateway_started_again_after_a_sigkill_waits_for_the_engine_it_left(
    tmp_path: Path,
) -> None:
    """Started again right after a SIGKILL, the gateway launched a second engine while the
    first was still in its reaper's 10 s grace (here it ignores SIGTERM, so it stays the whole
    grace, and holds a lock a second engine cannot take while it lives)."""
    lock = tmp_path / "engine.lock"
    dep = launched(
        extra=["--ignore-sigterm", "--lock-file", str(lock)], lifecycle={"activation": "always"}
    )
    config = tmp_path / "g.yaml"
    config.write_text(yaml.safe_dump({"deployments": [dep]}))
    state = tmp_path / "state"
    first = serve(config, state)
    try:
        old = engine_pid(first)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=30)
        second = serve(config, state)  # at once: the old engine is still in its grace
        try:
            new = engine_pid(second)
            assert new != old
            assert wait_gone_now(old), "the old engine still runs beside the new one"
            log = second.log()
            assert '"to":"failed"' not in log  # its engine never met the old one's lock
            assert "waiting for 1 engine(s) a previous run left to stop" in log
        finally:
            second.stop()
    finally:
        first.stop()


@dataclass
class Served:
    """``capyctl-gateway serve`` as a process, its log in a file."""

    process: subprocess.Popen[bytes]
    management: str
    key_file: Path
    log_file: Path

    def log(self) -> str:
        return self.log_file.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def serve(config: Path, state: Path) -> Served:
    mport = free_port()
    log = state.parent / f"gateway-{mport}.log"
    argv, env = serve_command(config, state, free_port(), mport)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out, env=env)
    return Served(
        proc, f"http://127.0.0.1:{mport}/management/v1", state / "identity" / "credentials", log
    )


def engine_pid(gw: Served, within: float = 60) -> int:
    """The pid of the deployment's engine once it is ready (read from ``status``, over HTTP:
    the gateway is another process, so this asks until it says so, within a bound)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        assert gw.process.poll() is None, gw.log()
        if gw.key_file.exists():
            key = gw.key_file.read_text().split()[1]
            with contextlib.suppress(httpx.HTTPError):
                doc = httpx.get(
                    f"{gw.management}/deployments/my-model",
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=5,
                ).json()
                inst = doc["instances"][0]
                if inst.get("lifecycle") == "ready" and inst.get("process", {}).get("pid"):
                    return int(inst["process"]["pid"])
        time.sleep(0.1)  # another process's state: asked again, within the bound
    raise AssertionError(f"no ready engine within {within} s:\n{gw.log()}")


def wait_gone_now(pid: int) -> bool:
    """Whether process ``pid`` has already exited (or is a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
