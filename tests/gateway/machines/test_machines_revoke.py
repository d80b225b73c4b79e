"""A host's name holds one certificate: a second invite needs --replace, ``revoke host`` refuses
the certificate and closes the host's live session, and a name enrolled again refuses the
machine that held it before; over real loopback sockets and the CLI."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import anyio
import pytest
from typer.testing import CliRunner

from capyctl_gateway._host import join
from capyctl_gateway._machines import pki
from capyctl_gateway._machines.enroll import HostIdentity
from capyctl_gateway.cli import app as cli
from tests.gateway.fake_engine import FakeEngine, Hold, vllm_stream
from tests.gateway.machines.test_machines import Cluster, cluster, dep, engines

__all__ = ["cluster", "engines"]

pytestmark = pytest.mark.anyio


async def _invoke(*args: str) -> tuple[int, str]:
    result = await anyio.to_thread.run_sync(CliRunner().invoke, cli, list(args))
    return result.exit_code, result.output


async def _session_status(c: Cluster, state: Path) -> int:
    """The status a session with the certificate in ``state`` gets from the server."""
    identity = HostIdentity(state / "identity")
    ctx = pki.client_context(identity.ca.read_bytes(), identity.cert, identity.key)
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(
                f"https://{c.control}/v1/session", ssl=ctx, server_hostname=pki.SERVER_NAME
            )
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status
        await ws.close()
        return 101


async def test_an_enrolled_name_is_invited_again_only_with_replace(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    state = str(c.server_state)
    out = c.tmp / "again.join"
    invite = ["invite", "host", "gpu-box", "--output", str(out), "--server", c.control]
    code, said = await _invoke(*invite, "--state-dir", state)
    assert code == 0, said  # not enrolled yet: a join file
    out.unlink()
    code, said = await _invoke(*invite, "--state-dir", state)
    assert code != 0 and "still usable" in said and "--replace" in said  # that file is open
    await c.start_host("gpu-box", replace=True)  # a new file, voiding the first
    code, said = await _invoke(*invite, "--state-dir", state)
    assert code != 0 and "enrolled already" in said and "--replace" in said
    assert not out.exists()
    code, said = await _invoke(*invite, "--replace", "--state-dir", state)
    assert code == 0 and out.exists(), said


async def test_a_revoked_host_has_its_live_session_closed_and_the_next_one_refused(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    engine.script = [*vllm_stream(["part"])[:2], Hold()]
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    await c.start_host("gpu-box")
    gw = c.gateway
    assert gw.fleet.machines is not None
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with c.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if "part" in line:
                break
        code, said = await _invoke("revoke", "host", "gpu-box", "--state-dir", str(c.server_state))
        assert code == 0, said
        with anyio.fail_after(5):  # the live session is closed: its stream ends in-band
            rest = [line async for line in lines]
    assert any('"error"' in line for line in rest) and "data: [DONE]" not in rest, rest
    assert "gpu-box" not in gw.fleet.machines.sessions
    assert await _session_status(c, c.tmp / "host-gpu-box") == 403
    code, said = await _invoke("revoke", "host", "gpu-box", "--state-dir", str(c.server_state))
    assert code != 0 and "holds no certificate" in said


async def test_a_name_enrolled_again_refuses_the_machine_that_held_it(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    await c.start_host("gpu-box")
    assert await _session_status(c, c.tmp / "host-gpu-box") == 101
    caplog.set_level("INFO", "capyctl_gateway")
    await join(c.join_file("gpu-box"), c.tmp / "twin")  # a second machine under the name
    assert any("enrolled again, with a new certificate" in r.getMessage() for r in caplog.records)
    assert await _session_status(c, c.tmp / "host-gpu-box") == 403
    assert await _session_status(c, c.tmp / "twin") == 101
