"""A launched engine's log: bounded by size however chatty the engine, owner-only, a fresh set of
files per run with the old runs pruned, and what a failed start copies into the gateway's log
masked. Real processes: the launchable fake engine run by the gateway, its output through the
pipe the gateway reads."""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from capyctl_gateway._config.parts import EngineLogs
from capyctl_gateway._local.enginelog import EngineLog, ShownLog
from capyctl_gateway._log import masked
from tests.gateway.conftest import Gw
from tests.gateway.lifecycle.test_lifecycle import chat, launched

pytestmark = pytest.mark.anyio
MiB = 2**20
Start = Callable[..., Awaitable[Gw]]


@pytest.fixture
def start(tmp_path: Path, make_gateway: Start) -> Start:
    """Gateways whose launched engines log under ``tmp_path / "logs"``."""

    async def make(config: dict[str, Any], *, env: dict[str, str] | None = None) -> Gw:
        return await make_gateway(config, env=env, engine_logs=tmp_path / "logs")

    return make


def runs(logs: Path, stem: str = "my-model-0") -> dict[int, list[Path]]:
    """Each run's files, newest part first."""
    found: dict[int, list[Path]] = {}
    for f in sorted(logs.iterdir()):
        m = re.fullmatch(re.escape(stem) + r"\.(\d+)\.log(?:\.(\d+))?", f.name)
        assert m is not None, f"unexpected file {f.name}"
        found.setdefault(int(m.group(1)), []).append(f)
    for parts in found.values():
        parts.sort(key=lambda f: int(f.name.rpartition(".")[2]) if f.suffix != ".log" else 0)
    return found


async def test_a_chatty_engine_stays_within_the_default_cap_and_is_not_held_up(
    start: Start, tmp_path: Path
) -> None:
    chatty = 80 * MiB  # past the default cap (16 MiB x 3 files per run)
    gw = await start({"deployments": [launched(extra=["--chatty", str(chatty)])]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text  # it started: its chatter did not hold it up
    await gw.gateway.fleet.lifecycle.shutdown()  # its output is all on disk once stopped
    (parts,) = runs(tmp_path / "logs").values()
    sizes = [p.stat().st_size for p in parts]
    assert len(parts) == 3 and sizes[1:] == [16 * MiB, 16 * MiB] and sizes[0] <= 16 * MiB
    text = b"".join(p.read_bytes() for p in parts[:2]).decode()
    m = re.search(r"chatty wrote (\d+) bytes in ([\d.]+) s", text)
    assert m is not None and int(m.group(1)) == chatty
    took = float(m.group(2))
    assert took < 20, f"the engine wrote {chatty} bytes in {took} s: held up by its log"


async def test_a_configured_cap_is_reached_and_held_and_files_are_owner_only(
    start: Start, tmp_path: Path
) -> None:
    dep = launched(extra=["--chatty", str(5 * MiB)])
    dep["instances"][0]["launch"]["logs"] = {"file_size": "256KiB", "files": 2}
    gw = await start({"deployments": [dep]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    await gw.gateway.fleet.lifecycle.shutdown()
    logs = tmp_path / "logs"
    (parts,) = runs(logs).values()
    assert [p.name for p in parts] == ["my-model-0.1.log", "my-model-0.1.log.1"]
    assert parts[1].stat().st_size == 256 * 1024 and parts[0].stat().st_size <= 256 * 1024
    assert b"chatty wrote" in parts[0].read_bytes() + parts[1].read_bytes()
    for f in [logs, *parts]:
        mode = stat.S_IMODE(f.stat().st_mode)
        assert mode == (0o700 if f == logs else 0o600), f"{f.name}: {oct(mode)}"


async def test_each_run_gets_fresh_files_and_only_the_last_runs_are_kept(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await start({"deployments": [launched(extra=["--exit-at-once", "3"])]})
    async with gw.client() as c:
        for _ in range(6):  # each request tries a fresh start, which fails
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.json()["code"] == "activation_failed"
    kept = runs(tmp_path / "logs")
    assert sorted(kept) == [3, 4, 5, 6]  # the default: the current run and three before it
    for (part,) in kept.values():
        assert part.read_text().count("exiting with 3 as asked") == 1  # not appended to
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "its log " + str(tmp_path / "logs" / "my-model-0.6.log") in logged


async def test_a_failed_starts_excerpt_in_the_gateways_log_is_masked(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    engine_key, flag_key, token = "EnGiNe-KeY-4242", "FlAg-KeY-1717", "hf_ToKeN_9393"
    dep = launched(extra=["--echo-env", "ENGINE_KEY", "--api-key", flag_key, "--exit-at-once", "3"])
    dep["instances"][0]["api_key_env"] = "ENGINE_KEY"
    dep["instances"][0]["launch"]["env"] = {"ENGINE_KEY": engine_key, "HF_TOKEN": token}
    dep["instances"][0]["launch"]["command"] += [f"--hf-token={token}"]
    gw = await start({"deployments": [dep]}, env={"ENGINE_KEY": engine_key})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.json()["code"] == "activation_failed"
    assert engine_key not in r.text
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "exiting with 3 as asked" in logged
    for secret in (engine_key, flag_key, token):
        assert secret not in logged
    assert "fake engine: loaded ***" in logged and "--api-key', '***'" in logged
    (parts,) = runs(tmp_path / "logs").values()
    kept = parts[0].read_text()
    assert all(s in kept for s in (engine_key, flag_key, token))  # the engine printed them


async def logged(tmp_path: Path, data: bytes) -> EngineLog:
    """An engine log of 4 KiB files (three per run) that got ``data`` through its pipe."""
    log = EngineLog(tmp_path / "logs", "e-0", EngineLogs(file_size=4096, files=3))
    log.open()
    read_fd, write_fd = os.pipe()
    log.follow(read_fd)
    os.write(write_fd, data)
    os.close(write_fd)
    assert await log.drained(within=10)
    return log


SECRET = "SeCrEt-FlAg-99"


@pytest.mark.parametrize("line_count", [400, 130, 60])
async def test_the_log_view_and_the_excerpt_show_whole_lines_only(
    tmp_path: Path, line_count: int
) -> None:
    # Each line names the key; rotation cuts at a byte count, mid-line: a view that began in
    # the middle of one would show part of the key, which no mask recognises.
    written = [f"{i:04d} args: --api-key {SECRET} {'p' * (i % 13)}" for i in range(line_count)]
    log = await logged(tmp_path, "".join(line + "\n" for line in written).encode())
    shown = await ShownLog(log, [SECRET]).lines(1000, 64 * 1024)
    assert shown and all(line in {masked(w, [SECRET]) for w in written} for line in shown)
    assert shown[-1].startswith(f"{line_count - 1:04d} ")
    excerpt = log.tail(500).splitlines()
    assert excerpt and all(line in written for line in excerpt)
    assert excerpt[-1] == written[-1]


async def test_a_run_read_from_its_first_byte_keeps_its_first_line(tmp_path: Path) -> None:
    written = [f"{i:04d} {'q' * 40}" for i in range(100)]  # 4,600 bytes: one rotation
    log = await logged(tmp_path, "".join(line + "\n" for line in written).encode())
    assert log.lines(1000, 64 * 1024) == written
