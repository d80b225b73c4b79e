"""Intent and reasons: what an operator started is started again when the gateway restarts; a
deployment kept ready (``activation: always``) starts with the gateway, never idles out and
comes back after a crash without a request; every transition says who asked."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from capyctl_gateway import GATEWAY_KEY, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._lifecycle.operator import operator_start
from tests.gateway.conftest import COLLECTOR, KEY, Gw
from tests.gateway.test_lifecycle import launched, transitions
from tests.gateway.test_lifecycle_processes import moved_to, process
from tests.gateway.test_lifecycle_races import engines_running, said, served

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
