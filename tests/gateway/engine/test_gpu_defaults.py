"""Defaults for a GPU machine: ``park: auto`` parks vLLM (sleep mode) and SGLang (memory
release) where the machine has a GPU, and stops them where it has none; a launched SGLang gets
``--enable-metrics``. The GPU probe is given a device directory of the test's own: with a
``nvidia0`` file in it, or without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from capyctl_gateway._config import Launch
from capyctl_gateway._engines import EngineKind
from capyctl_gateway._lifecycle.operator import operator_park
from capyctl_gateway._local.process import launch_argv
from capyctl_gateway._management.status import deployment_status
from tests.gateway.lifecycle.test_lifecycle import chat, launched, pid_of, wait_gone


@pytest.fixture
def gpu(tmp_path: Path) -> Path:
    devices = tmp_path / "dev"
    devices.mkdir()
    (devices / "nvidia0").touch()
    return devices


def test_the_probe_finds_an_nvidia_or_rocm_device_and_nothing_else(tmp_path: Path) -> None:
    from capyctl_gateway._engines import gpu_present

    assert not gpu_present(tmp_path)
    (tmp_path / "dri").mkdir()  # any graphics card: not one an engine parks on
    assert not gpu_present(tmp_path)
    for name in ("nvidia0", "nvidiactl", "kfd"):
        (tmp_path / name).touch()
        assert gpu_present(tmp_path)
        (tmp_path / name).unlink()


def test_sglang_is_launched_with_metrics_on_once() -> None:
    bare = launch_argv(EngineKind.SGLANG, Launch(command=["sglang"]), 1)
    assert bare.count("--enable-metrics") == 1 and "--enable-cache-report" in bare
    asked = launch_argv(EngineKind.SGLANG, Launch(command=["sglang", "--enable-metrics"]), 1)
    assert asked.count("--enable-metrics") == 1


async def _cmdline(gw: Any) -> list[bytes]:
    return (await anyio.Path(f"/proc/{pid_of(gw)}/cmdline").read_bytes()).split(b"\0")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("engine", "version", "flag"),
    [("vllm", "0.31.0", b"--enable-sleep-mode"), ("sglang", "0.5.21", b"--enable-memory-saver")],
)
async def test_park_auto_on_a_gpu_parks_with_the_process_up(
    make_gateway: Any, gpu: Path, engine: str, version: str, flag: bytes
) -> None:
    dep = launched(engine=engine, engine_version=version)
    gw = await make_gateway({"deployments": [dep]}, devices=gpu)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        pid = pid_of(gw)
        assert flag in await _cmdline(gw)
        if engine == "sglang":
            assert b"--enable-metrics" in await _cmdline(gw)
        doc = deployment_status(gw.gateway.fleet, "my-model")
        assert doc is not None and doc["deployment"]["park"] == "sleep"
        await operator_park(gw.gateway.fleet.lifecycle, "my-model", known=True)
        assert gw.gateway.fleet.lifecycle.lives["my-model"].state == "parked"
        r = await c.post("/v1/chat/completions", json=chat())  # parked, the fake answers 503
        assert r.status_code == 200, r.text
        assert pid_of(gw) == pid  # woken, not restarted


@pytest.mark.anyio
async def test_park_auto_without_a_gpu_is_a_stop(make_gateway: Any, tmp_path: Path) -> None:
    gw = await make_gateway({"deployments": [launched()]}, devices=tmp_path)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    pid = pid_of(gw)
    assert b"--enable-sleep-mode" not in await _cmdline(gw)
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None and doc["deployment"]["park"] == "stop"
    await operator_park(gw.gateway.fleet.lifecycle, "my-model", known=True)
    assert gw.gateway.fleet.lifecycle.lives["my-model"].state == "stopped"
    await anyio.to_thread.run_sync(wait_gone, pid)


@pytest.mark.anyio
async def test_park_stop_on_a_gpu_is_still_a_stop(make_gateway: Any, gpu: Path) -> None:
    gw = await make_gateway({"deployments": [launched(lifecycle={"park": "stop"})]}, devices=gpu)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    assert b"--enable-sleep-mode" not in await _cmdline(gw)
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None and doc["deployment"]["park"] == "stop"
