"""What a new kind of runner costs, shown: a fourth kind, written here and nowhere else, joins
the gateway through the path the real kinds take (a room with its `Room`, one line in a
registry: ``{"test": RunnerKind(...), **KINDS}``), and the gateway serves, shows, budgets and
stops its engines without a line of its own source changed: the lifecycle drives it through
the seam, ``status``, ``list`` and the console render its typed description, the memory budget
counts it in its own pool.

The kind claims the instances whose launch command begins with ``test-kind`` (a real kind
claims those with its own configuration model, as ``pod:`` is the pods'), and serves each start
with the launchable engine's application in the test's loop. docs/architecture.md lists what a
kind touches; tests/gateway/test_layout.py holds its room to the others' rules (the registry
names the rooms)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rich.console import Console

from canopyx_provider import Collector, adapter_for
from capyctl_gateway._config import GatewayConfig, Instance
from capyctl_gateway._deployments.kinds import Found, Opened
from capyctl_gateway._deployments.routes import EngineInstance
from capyctl_gateway._deployments.runner import (
    Described,
    ProcessView,
    Shown,
    Site,
    Tracked,
    never,
)
from capyctl_gateway._deployments.seen import Seen, SeenBy
from capyctl_gateway._engines import EngineKind
from capyctl_gateway._errors import ParkFailedError
from capyctl_gateway._http.app import GATEWAY_KEY, create_app
from capyctl_gateway._lifecycle.operator import deployments_list, operator_stop
from capyctl_gateway._management.render import print_list, print_status
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._runners import KINDS, RunnerKind
from tests.eventually import eventually
from tests.gateway.conftest import COLLECTOR, KEY, VIRTUAL_CLOCK, Gw, _serve
from tests.gateway.launchable_engine import build_app
from tests.gateway.lifecycle.test_lifecycle import chat, launched

pytestmark = pytest.mark.anyio
anyio_backend = VIRTUAL_CLOCK  # the kind's engines run in this process
SITE = Site(
    pool="the test kind",
    machine=None,
    on="in the test kind",
    stopper="the test kind",
    outlives_gateway=False,
    run_by="the gateway (the test kind)",
)


class KindRunner(SeenBy):
    """One instance's engine in the test's loop."""

    site = SITE

    def __init__(self, inst: EngineInstance, served: str, collector: Collector, clock: Any) -> None:
        self.instance, self._served = inst, served
        self.seen = Seen(collector, inst.key, clock)
        self.server: web.AppRunner | None = None
        self.port: int | None = None

    def describe(self) -> Described:
        if self.port is None:
            return self.seen.described()
        where = f"served in the test's loop on port {self.port}"
        d = self.seen.described((Shown("test_kind", where),), test_kind_port=self.port)
        return Described(d.watched, d.fields, d.lines, placed=where)

    def process(self) -> ProcessView | None:
        return None

    def log(self) -> None:
        return None

    def holdup(self) -> str | None:
        return None

    def why_unreachable(self) -> str:
        return "dispatch_closed"

    def begin(self, exchange: Tracked) -> None:
        """Nothing ends an exchange here from outside."""

    end = begin

    def cannot_start(self) -> str | None:
        return None

    async def start(self, reason: str) -> str:
        app, _ = build_app(self._served, crash=lambda: None)
        self.server = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.server.setup()
        site = web.TCPSite(self.server, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.server.addresses[0][1])
        url = f"http://127.0.0.1:{self.port}"
        self.instance.bind(url)
        self.seen.watch(adapter_for(EngineKind.VLLM, url), self._served)
        return f"served in the test's loop on port {self.port}"

    async def park(self, reason: str) -> None:
        raise ParkFailedError("the test kind does not park")

    async def wake(self, reason: str) -> None:
        raise ParkFailedError("the test kind does not park")

    async def stop(self, reason: str) -> bool:
        self.seen.unwatch()
        if self.server is not None:
            await self.server.cleanup()
        self.server, self.port = None, None
        return True

    def exited(self) -> str | None:
        return None

    async def gone(self) -> str:
        return await never()


class KindRoom:
    """The test kind's room: it makes its runners whole."""

    def __init__(self, opened: Opened) -> None:
        self._opened = opened
        self.runners: list[KindRunner] = []

    @classmethod
    async def open(cls, opened: Opened) -> KindRoom:
        ROOMS.append(room := cls(opened))
        return room

    def runner(self, inst: EngineInstance, configured: Instance) -> KindRunner:
        o = self._opened
        served = o.deployment(inst).engine_model
        runner = KindRunner(inst, served, o.collector, o.clock)
        self.runners.append(runner)
        return runner

    async def take_up(self, found: Found) -> None:
        """A previous run's engines died with its loop."""


ROOMS: list[KindRoom] = []
TEST_KIND = RunnerKind(
    lambda i: i.launch is not None and i.launch.command[:1] == ["test-kind"], KindRoom.open
)


@pytest.fixture
async def gw() -> AsyncIterator[Gw]:
    ROOMS.clear()
    dep = launched("tested", served="tested-model", memory={"ready": "1GiB"})
    dep["instances"][0]["launch"]["command"] = ["test-kind", "--served", "tested-model"]
    config = {"resources": {"memory_budget": "1GiB"}, "deployments": [dep]}
    app = create_app(
        GatewayConfig.model_validate(config),
        KEY,
        env={},
        collector_options=COLLECTOR,
        runners={"test": TEST_KIND, **KINDS},
    )
    runner, url = await _serve(app, gateway=True)
    try:
        yield Gw(url, KEY, app[GATEWAY_KEY])
    finally:
        await runner.cleanup()


async def test_a_kind_written_in_its_own_module_serves_shows_and_stops(gw: Gw) -> None:
    fleet = gw.gateway.fleet
    (room,) = ROOMS
    (engine,) = room.runners
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat("tested"))
        assert r.status_code == 200, r.text
        assert "from tested-model" in r.json()["choices"][0]["message"]["content"]
    port = engine.port
    assert port is not None
    # status, list and the budget render it without knowing its kind (once its collector's
    # first look is over)
    await eventually(lambda: fleet.collector.status("tested/0").state.value == "ready")
    doc = deployment_status(fleet, "tested")
    assert doc is not None
    (row,) = doc["instances"]
    assert row["state"] == "ready" and row["test_kind_port"] == port
    assert row["shown"] == [
        {"name": "test_kind", "text": f"served in the test's loop on port {port}", "alarm": False}
    ]
    text = Console(width=200, record=True)
    print_status(text, doc)
    assert f"  served in the test's loop on port {port}" in text.export_text()
    listing = deployments_list(fleet.lifecycle, fleet.routes, 2**30)
    (listed,) = listing["deployments"]
    assert listed["run_by"] == "the gateway (the test kind)"
    (pool,) = listing["pools"]
    # the pool's change log ends with what it holds now, whatever the clock says of when
    assert pool.pop("history")[-1]["held"] == {"tested": 2**30}
    assert listing["pools"] == [
        {"pool": "the test kind", "held": 2**30, "budget": 2**30, "deployments": [
            {"name": "tested", "held": 2**30}], "resident": ["tested"], "waiting": []}
    ]  # fmt: skip
    text = Console(width=200, record=True)
    print_list(text, listing)
    assert f"tested instance 0: served in the test's loop on port {port}" in text.export_text()
    # the lifecycle stops it through the seam: its engine's port refuses after
    await operator_stop(fleet.lifecycle, "tested", known=True)
    assert engine.server is None and fleet.lifecycle.budget.held() == 0
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health"):
            pass
