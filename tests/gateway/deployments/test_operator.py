"""What an operator meets in the first hour: misconfiguration caught loudly at start, never
passed on to clients as a misleading error; the version; how the process stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from rich.console import Console
from typer.testing import CliRunner

from canopyx_provider import CheckReport, CheckResult, ChecksCompleted, Event
from capyctl_gateway import GatewayConfig
from capyctl_gateway._deployments.checks import unusable_reason
from capyctl_gateway._management.render import print_status
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway.cli import app as cli
from tests.gateway.conftest import WORKERS, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, vllm_stream

workers = WORKERS


pytestmark = pytest.mark.anyio
CHAT: dict[str, Any] = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
MakeGateway = Callable[..., Awaitable[Gw]]


async def checked(gw: Gw) -> None:
    """Wait for the collector's first startup checks of every instance (no sleeping)."""
    seen: set[str] = set()
    done = anyio.Event()
    keys = set(gw.gateway.fleet.settlement.ledgers)

    def observe(e: Event, /) -> None:
        if isinstance(e, ChecksCompleted):
            seen.add(e.key)
            if seen >= keys:
                done.set()

    gw.gateway.fleet.settlement.observers.append(observe)
    with anyio.fail_after(10):
        await done.wait()


async def test_an_engine_serving_another_model_is_not_routed_to_and_says_why(
    engine: FakeEngine, make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway({"deployments": [deployments(engine.url, served_model="other")]})
    await checked(gw)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["code"]) == (503, "unavailable")
    assert r.json()["retryable"] is True
    assert "failed their startup checks" in r.json()["message"]
    assert engine.url not in r.text and "127.0.0.1" not in r.text
    assert engine.received == []
    assert gw.gateway.fleet.settlement.ledgers["my-model/0"].charged == 0
    # Said at start, naming the deployment and instance, with the reason.
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert any(
        "deployment my-model, instance 0 failed its startup checks (models:" in m
        and "it is not routed to" in m
        for m in errors
    ), errors
    # And in the text status.
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None
    console = Console(width=80, record=True, force_terminal=False)
    print_status(console, doc)
    text = console.export_text()
    assert "not routed: models check failed" in text
    assert doc["instances"][0]["routed"] is False


async def test_a_failed_instance_beside_a_good_one_takes_no_requests(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = vllm_stream()
    good = deployments(engine.url)
    bad = deployments(engine.url, name="other-model", served_model="not-served")
    gw = await make_gateway({"deployments": [good, bad]})
    await checked(gw)
    async with gw.client() as c:
        ok = await c.post("/v1/chat/completions", json=CHAT)
        refused = await c.post("/v1/chat/completions", json={**CHAT, "model": "other-model"})
    assert ok.status_code == 200
    assert refused.status_code == 503
    assert len(engine.received) == 1


@pytest.mark.parametrize("policy", ["warn", "refuse"])
async def test_a_version_other_than_the_configured_one_is_said_and_refused_on_request(
    engine: FakeEngine,
    make_gateway: MakeGateway,
    caplog: pytest.LogCaptureFixture,
    policy: str,
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    engine.script = vllm_stream()
    dep = deployments(engine.url, engine_version="9999", version_mismatch=policy)
    gw = await make_gateway({"deployments": [dep]})
    await checked(gw)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("reports engine version 0.31.0, not the configured 9999" in m for m in warnings)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    if policy == "warn":
        assert r.status_code == 200
    else:
        assert (r.status_code, r.json()["code"]) == (503, "unavailable")
        assert engine.received == []


async def test_the_configured_version_matches_whatever_its_spelling(
    engine: FakeEngine, make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    dep = deployments(engine.url, engine_version="v0.31.0", version_mismatch="refuse")
    gw = await make_gateway({"deployments": [dep]})
    await checked(gw)
    assert not [r for r in caplog.records if "engine version" in r.getMessage()]
    assert gw.gateway.fleet.routes["my-model"].instances[0].unusable is None


def test_version_flag() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("capyctl-gateway ")
    assert result.output.split()[1][0].isdigit()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals as on Linux")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_says_it_is_stopping_and_when_it_stopped(
    tmp_path: Path, engine_url_unused: str, sig: signal.Signals
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "deployments:\n  - name: m\n    engine: vllm\n    engine_version: '0.31.0'\n"
        f"    instances: [{{url: '{engine_url_unused}'}}]\n"
    )
    argv = [
        sys.executable,
        "-m",
        "capyctl_gateway.cli",
        "serve",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--management",
        f"127.0.0.1:{free_port()}",
        "--state-dir",
        str(tmp_path / "state"),
        "--log-format",
        "json",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    with subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env) as proc:
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # the listening line: the gateway is up, signals handled
                if b"listening on" in line:
                    break
            proc.send_signal(sig)
            rest = proc.stderr.read().decode()
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert f"stopping on {sig.name}" in rest
    assert "waiting up to 60 s for 0 running and 0 waiting request(s)" in rest
    assert rest.rstrip().endswith("capyctl-gateway: stopped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def engine_url_unused() -> str:
    return "http://127.0.0.1:9"  # nothing listens: the gateway starts all the same


@pytest.mark.parametrize(
    ("code", "routed"),
    [("unreachable", True), ("timeout", True), ("model_not_listed", False)],
)
def test_only_an_engine_that_answered_without_the_model_is_not_routed_to(
    code: str, routed: bool
) -> None:
    """An engine that never answered its models check (down, or gone while checked: a launched
    engine that exited before its exit was seen) said nothing of its models: requests still go
    to it, and one its port refuses moves on or waits for its restart. It was taken for one
    that serves another model, and not routed to until its next checks (issue 34, item 14)."""
    dep = GatewayConfig.model_validate({"deployments": [deployments("http://127.0.0.1:1")]})
    report = CheckReport(
        checks=(
            CheckResult(name="health", ok=True),
            CheckResult(name="models", ok=False, reason="x", code=code),
        )
    )
    reason = unusable_reason(dep.deployments[0], report)
    assert (reason is None) is routed
