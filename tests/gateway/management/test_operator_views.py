"""What an operator reads after the demo's own commands: the refusal of a stopped deployment
names the command the guide uses, a stopped instance shows no address it no longer has, and
``list`` shows no memory figure that nothing measured. The launched engine runs on the fake
runner (``fake_runner.py``)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web
from rich.console import Console

from capyctl_gateway import create_management_app
from capyctl_gateway._management.render import print_list, print_status
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, Gw, deployments
from tests.gateway.fake_engine import FakeEngine

fakes = FAKES
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
CHAT: dict[str, Any] = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
LAUNCHED: dict[str, Any] = {
    "name": "my-model",
    "engine": "vllm",
    "engine_version": "0.31.0",
    "served_model": "tiny",
    "instances": [
        {
            "launch": {
                "command": [sys.executable, "-m", "tests.gateway.launchable_engine"],
                "startup_timeout": "60s",
            }
        }
    ],
}


async def _management(gw: Gw) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_management_app(gw.gateway))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/management/v1"


def _text(print_doc: Callable[[Console, dict[str, Any]], None], doc: dict[str, Any]) -> str:
    console = Console(width=160, record=True)
    print_doc(console, doc)
    return console.export_text()


async def test_a_stopped_deployment_shows_no_port_and_names_the_guides_start(
    make_gateway: MakeGateway,
) -> None:
    """After ``capyctl stop my-model`` the 409 said `capyctl-gateway start my-model` (the guide
    and the demo say ``capyctl``), and ``status`` still printed the stopped engine's address."""
    gw = await make_gateway({"deployments": [LAUNCHED]})
    runner, base = await _management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client() as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            running = (await m.get(f"{base}/deployments/my-model")).json()
            url = running["instances"][0]["url"]
            assert url is not None and url.startswith("http://127.0.0.1:")
            assert f"instance 0: {url} " in _text(print_status, running)

            stopped = await m.post(f"{base}/deployments/my-model/stop")
            assert stopped.json()["deployment"]["lifecycle"] == "stopped"
            refused = await c.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 409
            message = refused.json()["message"]
            assert "`capyctl start my-model` starts it again" in message, message
            assert "capyctl-gateway" not in message

            doc = (await m.get(f"{base}/deployments/my-model")).json()
            assert doc["instances"][0]["url"] is None, doc["instances"][0]
            shown = _text(print_status, doc)
            assert "instance 0: not running" in shown and url not in shown, shown

            await m.post(f"{base}/deployments/my-model/start")
            again = (await m.get(f"{base}/deployments/my-model")).json()
            assert again["instances"][0]["url"] is not None  # running again: its address
    finally:
        await runner.cleanup()


async def test_list_shows_no_memory_figure_for_an_engine_someone_else_runs(
    make_gateway: MakeGateway, engine: FakeEngine
) -> None:
    """``list`` printed "memory held by launched deployments: 0 B" while a ``url:`` engine
    ran: nothing measured it (no deployment has ``memory:``, no budget), so no figure is shown."""
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    runner, base = await _management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with httpx.AsyncClient(headers=auth, timeout=60) as m:
            listing = (await m.get(f"{base}/deployments")).json()
    finally:
        await runner.cleanup()
    shown = _text(print_list, listing)
    assert "my-model" in shown
    assert "0 B" not in shown and "memory held by" not in shown, shown
    # A deployment with ``memory:`` is counted, so its zero is a measured figure and shown.
    counted = {**listing["deployments"][0], "memory_held": 0}
    shown = _text(print_list, {**listing, "deployments": [counted]})
    assert "memory held by launched deployments: 0 B" in shown, shown
