"""Warm wake through the gateway, with real processes: a fake llama-server that speaks b10798's
slot routes (``slot_engine.py``) under the local runner. What an engine cached is saved before
a park (a stop here), a switch and an operator's stop, and restored after the next start
(after a crash too) before the instance takes a request; a restore under another model,
context size or salt is refused before the engine sees it; the disk budget holds; nothing a
save cut short leaves is ever restored; requests and operator commands during a save or a
restore wait for it, within its bound. Live on llama-server: ``contract/live/``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web

from capyctl_gateway import GATEWAY_KEY, Gateway, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._lifecycle.operator import operator_park, operator_start, operator_stop
from capyctl_gateway._management.metrics import exposition
from capyctl_gateway._management.status import deployment_status
from tests.eventually import eventually
from tests.gateway.conftest import COLLECTOR, KEY, NO_GPU
from tests.gateway.lifecycle.test_lifecycle import wait_gone

pytestmark = pytest.mark.anyio

SLOT_ENGINE = [sys.executable, "-m", "tests.gateway.slot_engine"]
SYSTEM = "You answer for the canopy desk; be brief and exact. " * 40  # 2,080 tokens here


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


def warm(
    model: Path, journal: Path, *extra: str, name: str = "my-model", faults: str = "", **lc: Any
) -> Any:
    """A launched llama.cpp deployment on the slot engine, its ``faults`` in its environment
    (its flags are in the warm cache's key)."""
    command = [*SLOT_ENGINE, "-m", str(model), "-c", "8192", "--parallel", "2"]
    env = {"SLOT_ENGINE_FAULTS": faults}
    return {
        "name": name,
        "engine": "llamacpp",
        "engine_version": "b10798",
        "served_model": "tiny",
        "lifecycle": lc,
        "instances": [
            {"launch": {"command": [*command, "--journal", str(journal), *extra],
                        "env": env, "startup_timeout": "60s"}}
        ],
    }  # fmt: skip


@asynccontextmanager
async def serving(config: Any, state: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A gateway on state directory ``state``, and a client of it; stopped on the way out."""
    cfg = GatewayConfig.model_validate(config, context={"devices": NO_GPU})
    app = create_app(cfg, KEY, env={}, collector_options=COLLECTOR, state_dir=state)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        async with httpx.AsyncClient(
            base_url=f"http://{host}:{port}", headers=headers, timeout=30
        ) as client:
            yield app[GATEWAY_KEY], client
    finally:
        await runner.cleanup()


async def ask(
    c: httpx.AsyncClient, question: str, model: str = "my-model", system: str = SYSTEM
) -> int:
    """How many of the prompt's tokens the engine found cached."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    r = await c.post("/v1/chat/completions", json={"model": model, "messages": messages})
    assert r.status_code == 200, r.text
    said = r.json()["choices"][0]["message"]["content"]
    found = re.fullmatch(r"cached (\d+) of \d+", said)
    assert found is not None, said
    return int(found.group(1))


def asked(journal: Path, what: str) -> list[str]:
    """The slot actions of ``what`` (``save``, ``restore``) the engine was asked for."""
    lines = journal.read_text().splitlines() if journal.exists() else []
    return [line for line in lines if line.startswith(what)]


def instance_dir(state: Path, name: str = "my-model") -> Path:
    return state / "warm" / name / "0"


def manifest(state: Path) -> Any:
    return json.loads((instance_dir(state) / "manifest.json").read_text())


def warm_row(gw: Gateway, name: str = "my-model") -> Any:
    doc = deployment_status(gw.fleet, name)
    assert doc is not None
    return doc["instances"][0]["warm_cache"]


def selections(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        getattr(r, "fields", {})
        for r in caplog.records
        if getattr(r, "event", "") == "router_selection"
    ]


async def test_a_park_saves_the_slots_and_the_wake_restores_them_before_any_request(
    tmp_path: Path, model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        assert await ask(c, "first question") == 0  # cold
        doc = deployment_status(gw.fleet, "my-model")
        assert doc is not None
        command = doc["instances"][0]["process"]["command"]
        assert command[command.index("--slot-save-path") + 1] == str(instance_dir(state))
        await operator_park(gw.fleet.lifecycle, "my-model", known=True)  # a stop here
        assert len(asked(journal, "save")) == 2  # both slots; the empty one writes nothing
        (saved,) = manifest(state)["slots"]
        assert saved["tokens"] == len(SYSTEM) + len("first question")
        files = sorted(p.name for p in instance_dir(state).iterdir())
        assert files == ["manifest.json", saved["file"]]  # no temporary name left
        for p in (instance_dir(state), instance_dir(state) / saved["file"]):
            assert oct(p.stat().st_mode)[-3:] in ("700", "600")
        assert await ask(c, "second question") >= len(SYSTEM)  # the wake's restore hit
        assert len(asked(journal, "restore")) == 1
        assert await ask(c, "third question") >= len(SYSTEM)
        row = warm_row(gw)
        assert row["last_restore"]["prefixes"] == 1
        assert row["last_restore"]["tokens"] == saved["tokens"]
        assert row["last_restore"]["bytes"] == saved["bytes"] == row["disk_bytes"]
        assert row["last_save"]["prefixes"] == 1 and "failed" not in row["last_save"]
        metrics = exposition(gw).decode()
    first, second, third = selections(caplog)
    assert "warm_cache" not in first and "warm_cache" not in third
    assert second["warm_cache"] == f"1 prefix restored, {saved['tokens']} tokens"
    assert 'capyctl_warm_cache_saves_total{deployment="my-model",instance="0"} 1.0' in metrics
    assert 'capyctl_warm_cache_restores_total{deployment="my-model",instance="0"} 1.0' in metrics
    line = 'capyctl_warm_cache_bytes_total{deployment="my-model",instance="0",op="restore"}'
    assert f"{line} {float(saved['bytes'])}" in metrics


async def test_a_crash_restarts_with_what_was_saved_before_it(tmp_path: Path, model: Path) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "first")
        await operator_park(gw.fleet.lifecycle, "my-model", known=True)
        assert await ask(c, "second") >= len(SYSTEM)
        doc = deployment_status(gw.fleet, "my-model")
        assert doc is not None
        pid = int(doc["instances"][0]["process"]["pid"])
        os.kill(pid, signal.SIGKILL)  # nothing is saved: the engine is gone
        await anyio.to_thread.run_sync(wait_gone, pid)
        assert await ask(c, "third") >= len(SYSTEM)  # restarted, restored from the park's save
    assert len(asked(journal, "save")) == 4  # the park's two, and the gateway's stop's two
    assert len(asked(journal, "restore")) == 2


async def test_a_switch_saves_the_one_switched_out_and_switching_back_restores_it(
    tmp_path: Path, model: Path
) -> None:
    state = tmp_path / "state"
    a, b = warm(model, tmp_path / "a", name="a"), warm(model, tmp_path / "b", name="b")
    a["memory"] = b["memory"] = {"ready": "1GiB"}
    config = {"resources": {"memory_budget": "1GiB"}, "deployments": [a, b]}
    async with serving(config, state) as (gw, c):
        assert await ask(c, "to a", "a") == 0
        assert await ask(c, "to b", "b") == 0  # a is switched out: saved
        assert len(asked(tmp_path / "a", "save")) == 2
        assert await ask(c, "back to a", "a") >= len(SYSTEM)  # b saved, a restored
        assert await ask(c, "back to b", "b") >= len(SYSTEM)
        assert gw.fleet.lifecycle.lives["b"].state == "ready"


@pytest.mark.parametrize("change", ["model", "context", "salt"])
async def test_a_cache_saved_under_another_key_is_refused_before_the_engine_sees_it(
    tmp_path: Path, model: Path, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "first")
    saved_file = manifest(state)["slots"][0]["file"]
    extra: list[str] = []
    if change == "model":  # the same path, other weights: a model updated in place
        await anyio.Path(model).write_bytes((await anyio.Path(model).read_bytes())[::-1])
    elif change == "context":
        extra = ["-c", "16384"]
    else:  # a cache saved for a salted tenant; llama.cpp's requests carry no salt
        doc = manifest(state)
        doc["key"]["salt"] = "tenant-a"
        (instance_dir(state) / "manifest.json").write_text(json.dumps(doc))
    async with serving({"deployments": [warm(model, journal, *extra)]}, state) as (gw, c):
        assert await ask(c, "second") == 0  # cold
        row = warm_row(gw)
        metrics = exposition(gw).decode()
    assert asked(journal, "restore") == []
    words = {"model": "another model", "context": "another context size", "salt": "cache_salt"}
    assert words[change] in row["last_restore"]["failed"]
    assert not (instance_dir(state) / saved_file).exists()  # never usable here: removed
    failures = 'capyctl_warm_cache_failures_total{deployment="my-model",instance="0",'
    assert f'{failures}op="restore",why="mismatch"}} 1.0' in metrics
    assert "saved under" in caplog.text


async def test_the_disk_budget_keeps_the_hottest_and_is_never_passed(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    one = 64 * (len(SYSTEM) + 20) + 200  # one slot's file, about
    config = {"deployments": [warm(model, journal, warm_cache_disk=int(one * 1.5))]}
    async with serving(config, state) as (gw, c):
        await ask(c, "question one")
        await ask(c, "question two", "my-model", "Another desk. " * 150)  # the other slot
        await ask(c, "question one again")  # the hottest slot now
        await operator_park(gw.fleet.lifecycle, "my-model", known=True)
        row = warm_row(gw)
    (kept,) = manifest(state)["slots"]
    held = sum(p.stat().st_size for p in instance_dir(state).glob("*.bin"))
    assert held == kept["bytes"] == row["disk_bytes"] <= int(one * 1.5)
    assert kept["tokens"] == len(SYSTEM) + len("question one again")
    assert "lifecycle.warm_cache_disk" in row["last_save"]["failed"]


async def test_a_deployment_gone_from_the_configuration_or_turned_off_loses_its_files(
    tmp_path: Path, model: Path
) -> None:
    state = tmp_path / "state"
    a, b = warm(model, tmp_path / "a", name="a"), warm(model, tmp_path / "b", name="b")
    async with serving({"deployments": [a, b]}, state) as (gw, c):
        await ask(c, "x", "a")
        await ask(c, "y", "b")
        await operator_stop(gw.fleet.lifecycle, "b", known=True)  # an operator's stop saves
    assert sorted(p.name for p in (state / "warm").iterdir()) == ["a", "b"]
    async with serving({"deployments": [a]}, state) as (gw, c):
        assert [p.name for p in (state / "warm").iterdir()] == ["a"]
    a["lifecycle"] = {"warm_cache": False}  # turned off: nothing kept
    async with serving({"deployments": [a]}, state) as (gw, c):
        assert list((state / "warm").iterdir()) == []


async def test_an_engine_killed_in_a_save_leaves_no_half_file_that_is_restored(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "kept")
    before = manifest(state)
    dies = warm(model, journal, faults="save-dies")
    async with serving({"deployments": [dies]}, state) as (gw, c):
        assert await ask(c, "kept, then more") >= len(SYSTEM)
        await operator_park(gw.fleet.lifecycle, "my-model", known=True)  # dies in the save
        assert "failed" in warm_row(gw)["last_save"]
    assert manifest(state) == before  # the record still names the earlier, whole file
    assert [p.name for p in instance_dir(state).glob("tmp-*")] == []
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        assert await ask(c, "kept, at last") >= len(SYSTEM)


async def test_a_half_file_a_killed_gateway_left_is_removed_never_restored(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "kept")
    half = instance_dir(state) / "tmp-slot1-cut.bin"  # as a gateway killed in a save leaves
    half.write_bytes(b"FSLT" + b"\0" * 100)
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        assert await ask(c, "kept too") >= len(SYSTEM)
    assert not half.exists()
    assert all("tmp-" not in line for line in asked(journal, "restore"))


async def test_a_restore_past_its_bound_serves_cold_and_says_why(
    tmp_path: Path, model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "first")
    slow = warm(model, journal, faults="restore-delay=30", warm_cache_timeout="1s")
    async with serving({"deployments": [slow]}, state) as (gw, c):
        with anyio.fail_after(10):
            assert await ask(c, "second") == 0  # cold, about a second late
        assert "took more than" in warm_row(gw)["last_restore"]["failed"]
    assert "was not all restored (timeout)" in caplog.text


async def test_a_request_whose_deadline_passes_during_a_restore_is_answered_at_its_deadline(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "first")
    slow = warm(model, journal, faults="restore-delay=30")
    config = {"queue": {"request_deadline": "1s"}, "deployments": [slow]}
    async with serving(config, state) as (gw, c):
        messages = [{"role": "user", "content": "second"}]
        with anyio.fail_after(10):
            r = await c.post(
                "/v1/chat/completions", json={"model": "my-model", "messages": messages}
            )
        assert (r.status_code, r.json()["code"]) == (503, "unavailable")
        assert gw.fleet.lifecycle.lives["my-model"].state == "starting"  # still restoring


@pytest.mark.parametrize(
    ("faults", "says"),
    [("save-delay=30", "took more than"), ("huge-slots", "answered no JSON")],
)
async def test_a_save_past_its_bounds_is_given_up_and_the_stop_goes_on(
    tmp_path: Path, model: Path, faults: str, says: str
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "kept")
    before = manifest(state)
    slow = warm(model, journal, faults=faults, warm_cache_timeout="1s")
    async with serving({"deployments": [slow]}, state) as (gw, c):
        await ask(c, "kept, then more")
        with anyio.fail_after(10):  # its second of saving, then the stop
            await operator_park(gw.fleet.lifecycle, "my-model", known=True)
        assert says in warm_row(gw)["last_save"]["failed"]
        assert gw.fleet.lifecycle.lives["my-model"].state == "stopped"
    assert manifest(state) == before  # what was saved before stays whole
    assert [p.name for p in instance_dir(state).glob("tmp-*")] == []


async def test_an_engine_that_refuses_its_files_serves_cold_and_drops_them(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "first")
    refuses = warm(model, journal, faults="refuse-restore")
    async with serving({"deployments": [refuses]}, state) as (gw, c):
        assert await ask(c, "second") == 0
        assert "Unable to restore slot" in warm_row(gw)["last_restore"]["failed"]
    assert manifest(state)["slots"] == [] or not asked(journal, "restore")[1:]


async def test_requests_that_arrive_during_a_restore_wait_for_it(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "one")
        await ask(c, "two", "my-model", "Another desk. " * 150)  # the other slot
    assert len(manifest(state)["slots"]) == 2
    slow = warm(model, journal, faults="restore-delay=0.5")
    async with serving({"deployments": [slow]}, state) as (gw, c):
        found: list[int] = []

        async def one(q: str, system: str) -> None:
            found.append(await ask(c, q, "my-model", system))

        async with anyio.create_task_group() as tg:  # they arrive while it starts, restores
            tg.start_soon(one, "three", SYSTEM)
            tg.start_soon(one, "four", "Another desk. " * 150)
    assert len(found) == 2 and min(found) >= len(SYSTEM)  # none on a slot not yet restored


async def test_operator_commands_during_a_save_wait_for_it(tmp_path: Path, model: Path) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    slow = warm(model, journal, faults="save-delay=0.5")
    async with serving({"deployments": [slow]}, state) as (gw, c):
        await ask(c, "first")
        lifecycle = gw.fleet.lifecycle
        park = asyncio.ensure_future(operator_park(lifecycle, "my-model", known=True))
        await eventually(lambda: asked(journal, "save"))  # under way in the engine (another
        # process: nothing announces it)
        await operator_stop(lifecycle, "my-model", known=True)  # waits for the park's save
        await park
        assert lifecycle.lives["my-model"].state == "stopped"
        (saved,) = manifest(state)["slots"]
        assert (instance_dir(state) / saved["file"]).stat().st_size == saved["bytes"]
        await operator_start(lifecycle, "my-model", known=True)
        assert warm_row(gw)["last_restore"]["prefixes"] == 1
        assert await ask(c, "second") >= len(SYSTEM)


async def test_a_frozen_engine_is_replaced_without_waiting_for_a_save(
    tmp_path: Path, model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    journal, state = tmp_path / "journal", tmp_path / "state"
    frozen = warm(model, journal, unresponsive_timeout="1s", warm_cache_timeout="60s")
    async with serving({"deployments": [frozen]}, state) as (gw, c):
        await ask(c, "first")
        doc = deployment_status(gw.fleet, "my-model")
        assert doc is not None
        pid = int(doc["instances"][0]["process"]["pid"])
        os.kill(pid, signal.SIGSTOP)  # it answers nothing from now on
        with anyio.fail_after(30):  # its silence (1 s), its stop (a grace, then SIGKILL): not 60 s
            await anyio.to_thread.run_sync(wait_gone, pid)
    assert asked(journal, "save") == []


async def test_nothing_is_saved_again_when_nothing_ran_since_the_restore(
    tmp_path: Path, model: Path
) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    async with serving({"deployments": [warm(model, journal)]}, state) as (gw, c):
        await ask(c, "first")
        lifecycle = gw.fleet.lifecycle
        await operator_park(lifecycle, "my-model", known=True)
        for _ in range(2):  # woken and parked with no request between
            await operator_start(lifecycle, "my-model", known=True)
            await operator_park(lifecycle, "my-model", known=True)
        assert len(asked(journal, "save")) == 2 and len(asked(journal, "restore")) == 2


async def test_warm_cache_off_adds_no_flag_and_keeps_nothing(tmp_path: Path, model: Path) -> None:
    journal, state = tmp_path / "journal", tmp_path / "state"
    config = {"deployments": [warm(model, journal, warm_cache=False)]}
    async with serving(config, state) as (gw, c):
        await ask(c, "first")
        doc = deployment_status(gw.fleet, "my-model")
        assert doc is not None
        assert "--slot-save-path" not in doc["instances"][0]["process"]["command"]
        assert warm_row(gw) == {"on": False, "off": "lifecycle.warm_cache: off"}
        await operator_park(gw.fleet.lifecycle, "my-model", known=True)
    assert asked(journal, "save") == [] and not (state / "warm" / "my-model").exists()
