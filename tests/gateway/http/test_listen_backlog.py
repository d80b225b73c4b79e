"""Every listener, served as the CLI serves it, lets the kernel take a burst of connections past
the old default queue of 128 while it is busy: none of them waits for the kernel to retry it
(a second or more, during which it is neither answered, nor counted, nor timed out)."""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from capyctl_gateway._cli_common import bind, listen_site, local_runners
from capyctl_gateway._cli_machines import control_runner, control_site, ingress_runner
from capyctl_gateway._gateway import Gateway
from capyctl_gateway._machines.enroll import ServerIdentity
from tests.eventually import eventually
from tests.gateway.http.test_listener_bounds import control_context, server

__all__ = ["server"]

pytestmark = pytest.mark.anyio
BURST = 600
"""Past 128, and under every cap but the management and metrics listeners' (64: the kernel
takes their connections all the same; the listener answers those past its cap)."""


def open_while_busy(port: int, n: int, within: float = 5) -> list[socket.socket]:
    """Open ``n`` connections to ``port`` at once without letting the event loop run (nothing
    is accepted meanwhile): those the kernel completed within ``within`` s (the others are
    closed)."""
    socks = [socket.socket() for _ in range(n)]
    poll = select.poll()
    for s in socks:
        s.setblocking(False)
        assert s.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
        poll.register(s, select.POLLOUT)
    done: set[int] = set()
    end = time.monotonic() + within
    while len(done) < n and time.monotonic() < end:
        for fd, _ in poll.poll(100):
            done.add(fd)
            poll.unregister(fd)
    ok = [
        s
        for s in socks
        if s.fileno() in done and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    ]
    for s in socks:
        if s not in ok:
            s.close()
    OPEN.extend(ok)
    return ok


def ended(socks: list[socket.socket]) -> list[bytes]:
    """What each connection that the listener answered and closed got (b"" for a bare close)."""
    out = []
    for s in socks:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue  # still open, nothing sent
        except ConnectionResetError:
            data = b""
        out.append(data)
    return out


async def settled(socks: list[socket.socket], refused: int, within: float = 10) -> list[bytes]:
    """Poll until ``refused`` of ``socks`` were answered and closed, up to ``within`` s."""

    # No event tells a socket's state: polled, within the deadline (none may be the answer).
    def enough() -> tuple[list[bytes]] | None:
        got = ended(socks)
        return (got,) if len(got) >= refused else None

    return (await eventually(enough, within=within))[0]


OPEN: list[socket.socket] = []


@pytest.fixture
async def sites() -> AsyncIterator[list[tuple[web.BaseSite, web.BaseRunner]]]:
    started: list[tuple[web.BaseSite, web.BaseRunner]] = []
    yield started
    while OPEN:
        with contextlib.suppress(OSError):
            OPEN.pop().close()
    for site, runner in started:
        await site.stop()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("which", "cap"),
    [("ingress", 1024), ("control", 256), ("management", 64), ("metrics", 64)],
)
async def test_a_burst_of_connections_past_128_is_taken_at_once(
    which: str,
    cap: int,
    server: tuple[Gateway, ServerIdentity],
    sites: list[tuple[web.BaseSite, web.BaseRunner]],
) -> None:
    """All of them reach the listener; those past its cap are refused at once (a 503 on the
    plain-HTTP ones, a bare close on the control port, before any TLS)."""
    gw, identity = server
    sock = bind("127.0.0.1", 0)
    if which == "control":
        runner: web.AppRunner = control_runner(gw)
        await runner.setup()
        site: web.BaseSite = control_site(runner, sock, control_context(identity))
    else:
        management, metrics = local_runners(gw)
        runner = {"ingress": ingress_runner(dict, lambda: None), "management": management,
                  "metrics": metrics}[which]  # fmt: skip
        await runner.setup()
        site = listen_site(runner, sock)
    await site.start()
    sites.append((site, runner))
    socks = open_while_busy(int(sock.getsockname()[1]), BURST)
    assert len(socks) == BURST
    refused = max(0, BURST - cap)
    got = await settled(socks, refused)
    assert len(got) == refused
    if which == "control":
        assert set(got) <= {b""}
    else:
        assert all(g.startswith(b"HTTP/1.1 503 ") for g in got), got[:3]
