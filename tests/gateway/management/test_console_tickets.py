"""The console's one-time tickets: ``capyctl console`` prints an address that carries a ticket,
never the key; the page trades it for the key once. What a browser's history keeps of the
address opens nothing afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import httpx
import pytest
from typer.testing import CliRunner

from capyctl_gateway._management.tickets import MAX_TICKETS, TICKET_TTL_S, Tickets
from capyctl_gateway.cli import app as cli_app
from tests.gateway.conftest import Gw
from tests.gateway.management.test_console import Console, console_of, launched_console  # noqa: F401

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_is_traded_once_within_its_time() -> None:
    clock = Clock()
    tickets = Tickets(clock)
    first, second = tickets.issue(), tickets.issue()
    assert first != second and len(first) >= 32
    assert tickets.redeem(first) is True
    assert tickets.redeem(first) is False  # once
    clock.now += TICKET_TTL_S + 0.001
    assert tickets.redeem(second) is False  # expired
    assert tickets.redeem("made-up") is False
    assert len(tickets) == 0


def test_open_tickets_are_bounded_and_the_oldest_goes_first() -> None:
    tickets = Tickets(Clock())
    issued = [tickets.issue() for _ in range(MAX_TICKETS + 3)]
    assert len(tickets) == MAX_TICKETS
    assert [tickets.redeem(t) for t in issued[:3]] == [False, False, False]
    assert all(tickets.redeem(t) for t in issued[3:])


async def test_tickets_over_http(launched_console: Console) -> None:  # noqa: F811
    con = launched_console
    async with httpx.AsyncClient(base_url=con.url) as anyone, con.client() as keyed:
        refused = await anyone.post("/management/v1/console/tickets")
        assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized")
        issued = await keyed.post("/management/v1/console/tickets")
        assert issued.status_code == 200 and issued.headers["Cache-Control"] == "no-store"
        ticket = issued.json()["ticket"]
        assert issued.json()["expires_in_s"] == TICKET_TTL_S
        traded = await anyone.post("/management/v1/console/redeem", json={"ticket": ticket})
        assert traded.status_code == 200 and traded.json() == {"key": con.gw.key}
        assert traded.headers["Cache-Control"] == "no-store"
        again = await anyone.post("/management/v1/console/redeem", json={"ticket": ticket})
        assert (again.status_code, again.json()["code"]) == (401, "unauthorized")
        assert "used or expired" in again.json()["message"] and con.gw.key not in again.text
        for body in (b"not json", b"[1]", b'{"ticket": 7}'):
            bad = await anyone.post("/management/v1/console/redeem", content=body)
            assert bad.status_code in (400, 401), bad.text
            assert con.gw.key not in bad.text
        big = await anyone.post("/management/v1/console/redeem", content=b"x" * 2000)
        assert (big.status_code, big.json()["code"]) == (400, "invalid_request")


async def test_capyctl_console_prints_a_ticket_that_opens_the_console_once(
    launched_console: Console,  # noqa: F811
    tmp_path: Path,
) -> None:
    con = launched_console
    state = tmp_path / "state"
    (state / "identity").mkdir(parents=True, mode=0o700)
    creds = state / "identity" / "credentials"
    creds.write_text(f"api_key: {con.gw.key}\n")
    creds.chmod(0o600)
    port = con.url.rsplit(":", 1)[1]
    capyctl = str(Path(sys.executable).parent / "capyctl")
    printed = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [capyctl, "console", "--state-dir", str(state), "--management", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            check=False,
        )
    )
    assert printed.returncode == 0, printed.stderr
    assert con.gw.key not in printed.stdout + printed.stderr
    found = re.fullmatch(rf"http://127\.0\.0\.1:{port}/#ticket=([\w-]+)\n", printed.stdout)
    assert found, printed.stdout
    async with httpx.AsyncClient(base_url=con.url) as anyone:
        trade = {"ticket": found.group(1)}
        first = await anyone.post("/management/v1/console/redeem", json=trade)
        second = await anyone.post("/management/v1/console/redeem", json=trade)
    assert first.json() == {"key": con.gw.key} and second.status_code == 401


def test_capyctl_console_without_a_gateway_says_so(tmp_path: Path) -> None:
    (tmp_path / "identity").mkdir(mode=0o700)
    creds = tmp_path / "identity" / "credentials"
    creds.write_text(f"api_key: {'abc-DEF_123' * 4}\n")
    creds.chmod(0o600)
    with socket_nobody_listens_on() as port:
        result = CliRunner().invoke(
            cli_app, ["console", "--state-dir", str(tmp_path), "--management", f"127.0.0.1:{port}"]
        )
    assert result.exit_code == 2 and "no gateway answers" in result.output
    assert "abc-DEF_123" not in result.output
    gone = CliRunner().invoke(cli_app, ["console", "--state-dir", str(tmp_path / "none")])
    assert gone.exit_code == 2 and "no credentials" in gone.output


def socket_nobody_listens_on() -> _Port:
    return _Port()


class _Port:
    """A loopback port bound (so nobody else takes it) but not listening: connects are refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        port: int = self.sock.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


async def test_nothing_of_the_console_is_on_the_public_port(gateway: Gw) -> None:
    """The page, its tickets and its streams live on the management listener alone."""
    async with httpx.AsyncClient(base_url=gateway.url) as anyone, gateway.client() as keyed:
        for client in (anyone, keyed):
            for method, path in (
                ("GET", "/"),
                ("GET", "/console/console.js"),
                ("POST", "/management/v1/console/tickets"),
                ("POST", "/management/v1/console/redeem"),
                ("GET", "/management/v1/events"),
                ("GET", "/management/v1/deployments"),
            ):
                r = await client.request(method, path, json={"ticket": "x"})
                assert r.status_code in (404, 405), (method, path, r.status_code)
                assert gateway.key not in r.text
