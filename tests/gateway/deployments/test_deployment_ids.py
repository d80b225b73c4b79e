"""Each deployment's short ID: kept in the store, the same after a restart, unique, and shown
by ``status``, ``list`` and the router line."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from rich.console import Console

from capyctl_gateway import GATEWAY_KEY, GatewayRunner, create_app, create_management_app
from capyctl_gateway._config import GatewayConfig
from capyctl_gateway._deployments.routes import THIS_MACHINE, machine_of
from capyctl_gateway._management.render import print_list, print_status
from capyctl_gateway._store import Store
from tests.gateway.conftest import COLLECTOR, KEY, deployments
from tests.gateway.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
SHORT = re.compile(r"[0-9A-HJKMNP-TV-Z]{12}")  # Crockford's base 32, a ULID's first 12 digits


def test_ids_outlive_the_store_and_follow_their_names(tmp_path: Path) -> None:
    path = tmp_path / "gateway.sqlite3"
    store = Store(path)
    first = store.deployment_ids(["a", "b"])
    store.close()
    assert all(SHORT.fullmatch(v) for v in first.values()) and first["a"] != first["b"]
    store = Store(path)
    again = store.deployment_ids(["b", "c", "a"])  # reordered, one new
    assert (again["a"], again["b"]) == (first["a"], first["b"])
    assert again["c"] not in (first["a"], first["b"])
    assert store.deployment_ids(["c"]) == {"c": again["c"]}  # "a" out of the config ...
    assert store.deployment_ids(["a"]) == {"a": first["a"]}  # ... and back: the same ID
    store.close()
    rows = sqlite3.connect(path).execute("SELECT name, id FROM deployment ORDER BY name")
    assert dict(rows.fetchall()) == {"a": first["a"], "b": first["b"], "c": again["c"]}


def test_ids_made_in_one_millisecond_are_unique(tmp_path: Path) -> None:
    store = Store(tmp_path / "gateway.sqlite3")
    names = [f"d{i}" for i in range(3000)]  # well past the 1,024 a millisecond's two digits hold
    ids = store.deployment_ids(names)
    store.close()
    assert len(set(ids.values())) == len(names)


@pytest.mark.parametrize(
    ("host", "url", "machine"),
    [
        ("box-a", "http://10.0.0.9:9000", "box-a"),  # on a host: the host's name
        (None, "http://127.0.0.1:8000", THIS_MACHINE),
        (None, "http://[::1]:8000", THIS_MACHINE),
        (None, "http://localhost:8000", THIS_MACHINE),
        (None, None, THIS_MACHINE),  # launched, no port yet
        (None, "http://gpu-7.internal:8000", "gpu-7.internal"),  # someone else's engine
    ],
)
def test_the_machine_an_engine_runs_on(host: str | None, url: str | None, machine: str) -> None:
    assert machine_of(host, url) == machine
    assert THIS_MACHINE not in ("", "127.0.0.1")


async def _gateway(engine: FakeEngine, state: Path) -> tuple[GatewayRunner, web.Application]:
    config = GatewayConfig.model_validate({"deployments": [deployments(engine.url)]})
    app = create_app(config, KEY, env={}, collector_options=COLLECTOR, state_dir=state)
    runner = GatewayRunner(app)
    await runner.setup()
    return runner, app


async def _management(app: web.Application, path: str) -> Any:
    runner = web.AppRunner(create_management_app(app[GATEWAY_KEY]))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as c:
            r = await c.get(f"http://{host}:{port}{path}")
    finally:
        await runner.cleanup()
    assert r.status_code == 200, r.text
    return r.json()


async def test_status_and_list_show_the_same_id_across_a_restart(
    engine: FakeEngine, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    runner, app = await _gateway(engine, state)
    try:
        short = app[GATEWAY_KEY].fleet.routes["my-model"].id
        status = await _management(app, "/management/v1/deployments/my-model")
        listing = await _management(app, "/management/v1/deployments")
    finally:
        await runner.cleanup()
    assert SHORT.fullmatch(short)
    assert status["deployment"]["id"] == short
    assert [(d["name"], d["id"]) for d in listing["deployments"]] == [("my-model", short)]
    assert status["instances"][0]["machine"] == THIS_MACHINE
    text = Console(width=40, record=True)  # narrow: the ID is printed whole all the same
    print_status(text, status)
    out = text.export_text()
    assert f"my-model ({short}): api chat" in out
    assert f"(machine {THIS_MACHINE})" in out
    text = Console(width=60, record=True)
    print_list(text, listing)
    (row,) = [line for line in text.export_text().splitlines() if "my-model" in line]
    assert short in row, text.export_text()
    runner, app = await _gateway(engine, state)  # the gateway restarts: the ID stays
    try:
        assert app[GATEWAY_KEY].fleet.routes["my-model"].id == short
    finally:
        await runner.cleanup()
