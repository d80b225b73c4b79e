"""The listeners beside the public one, bounded as it is, over real sockets: the server's control
port (TLS first, client certificates optional), a host's ingress, the management and metrics
listeners. Each built as the CLI builds it; the control and ingress ones with small bounds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from aiohttp import web
from typer.testing import CliRunner

from capyctl_gateway import GATEWAY_KEY, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._cli_common import (
    KEEPALIVE_TIMEOUT_S,
    LOCAL_MAX_CONNECTIONS,
    TLS_HANDSHAKE_TIMEOUT_S,
    bind,
    local_runners,
)
from capyctl_gateway._cli_machines import (
    MAX_INVITE_S,
    control_runner,
    control_site,
    ingress_runner,
)
from capyctl_gateway._gateway import Gateway
from capyctl_gateway._http.server import SERVER
from capyctl_gateway._machines import pki
from capyctl_gateway._machines.enroll import ServerIdentity
from capyctl_gateway._machines.protocol import NOT_FORWARDED
from capyctl_gateway.cli import app as cli
from tests.eventually import eventually
from tests.gateway.conftest import KEY, deployments

pytestmark = pytest.mark.anyio
SHORT = 0.3


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[Gateway, ServerIdentity]]:
    identity = ServerIdentity(tmp_path / "identity")
    identity.ensure()
    config = GatewayConfig.model_validate({"deployments": [deployments("http://127.0.0.1:9")]})
    app = create_app(config, KEY, env={}, state_dir=tmp_path, server=identity)
    yield app[GATEWAY_KEY], identity


SERVED: list[web.AppRunner] = []
OPENED: list[asyncio.StreamWriter] = []


@pytest.fixture(autouse=True)
async def _clean_up() -> AsyncIterator[None]:
    """Close the test's client connections, then stop its listeners."""
    yield
    while OPENED:
        OPENED.pop().close()
    while SERVED:
        await SERVED.pop().cleanup()


async def serve(runner: web.AppRunner, context: ssl.SSLContext | None = None) -> int:
    """Serve ``runner`` on a loopback port, as the CLI does (`control_site` with TLS), until
    the test ends."""
    SERVED.append(runner)
    await runner.setup()
    sock = bind("127.0.0.1", 0)
    site = web.SockSite(runner, sock) if context is None else control_site(runner, sock, context)
    await site.start()
    return int(sock.getsockname()[1])


async def closed_by_peer(reader: asyncio.StreamReader, within: float = 5) -> bytes:
    """Everything the listener sends until it closes the connection."""
    with anyio.fail_after(within):
        return await reader.read()


def control_context(identity: ServerIdentity) -> ssl.SSLContext:
    return pki.server_context(identity.cert, identity.key, identity.ca_cert)


async def connect(
    port: int, identity: ServerIdentity | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection (TLS to the control port when ``identity`` is given, with no
    certificate, as a host that enrolls); closed after the test."""
    if identity is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    else:
        client = pki.client_context(identity.ca_cert.read_bytes())
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname=pki.SERVER_NAME
        )
    OPENED.append(writer)
    return reader, writer


async def still_served(held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    """Each held connection is served: a request on it gets an answer other than a 503."""
    for reader, writer in held:
        writer.write(b"GET /nothing-here HTTP/1.1\r\nHost: x\r\n\r\n")
        with anyio.fail_after(5):
            status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 ") and b" 503 " not in status, status


# -- the server's control port ---------------------------------------------------------------
async def test_a_control_connection_that_never_starts_its_handshake_is_closed(
    server: tuple[Gateway, ServerIdentity],
) -> None:
    gw, identity = server
    port = await serve(control_runner(gw), control_context(identity))
    reader, _ = await connect(port)  # TCP, and no ClientHello
    assert await closed_by_peer(reader, within=TLS_HANDSHAKE_TIMEOUT_S + 5) == b""


async def test_a_control_connection_that_sends_no_request_is_closed(
    server: tuple[Gateway, ServerIdentity],
) -> None:
    gw, identity = server
    port = await serve(control_runner(gw, header_timeout=SHORT), control_context(identity))
    reader, _ = await connect(port, identity)  # the handshake is done; nothing follows
    assert await closed_by_peer(reader) == b""


async def ended(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the listener closed the connection (an end of stream or a reset) within
    ``within`` seconds, having sent nothing."""
    with anyio.fail_after(within):
        try:
            return await reader.read() == b""
        except ConnectionResetError:
            return True


def host_context(identity: ServerIdentity, tmp_path: Path, name: str) -> ssl.SSLContext:
    """A client context with host ``name``'s certificate, signed by the server's CA."""
    key = pki.new_host_key()
    cert = identity.sign(pki.host_csr(key, name), name)
    pki.write_private(tmp_path / f"{name}.key", key)
    pki.write_private(tmp_path / f"{name}.pem", cert)
    ca = identity.ca_cert.read_bytes()
    return pki.client_context(ca, tmp_path / f"{name}.pem", tmp_path / f"{name}.key")


async def test_control_connections_in_their_handshake_count_and_those_past_the_cap_close_at_once(
    server: tuple[Gateway, ServerIdentity], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gw, identity = server
    runner = control_runner(gw, max_connections=4)
    SERVED.append(runner)
    await runner.setup()
    sock = bind("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    site = control_site(runner, sock, control_context(identity))
    await site.start()
    idle = [await connect(port) for _ in range(4)]  # TCP, and no ClientHello
    for _ in range(40):  # each closed as it comes, long before the handshake bound
        reader, _ = await connect(port)
        assert await ended(reader, within=TLS_HANDSHAKE_TIMEOUT_S / 5)
    assert site.handshaking == 4
    lines = [r for r in caplog.records if "connection closed as it came" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # at most a line a second
    assert "the control port holds its 4 connections (4 of them in their TLS" in lines[0].message
    for _, writer in idle:
        writer.close()
    await eventually(lambda: site.handshaking == 0, within=5)  # they end with them
    client = host_context(identity, tmp_path, "gpu-1")
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client, server_hostname=pki.SERVER_NAME
    )
    OPENED.append(writer)
    await still_served([(reader, writer)])


@contextlib.contextmanager
def out_of_files() -> Iterator[None]:
    """Every file descriptor under the soft open-file limit in use, for the time of the block."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    top = max(fds) + 1
    filler = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        while True:  # the holes under the top, then: nothing more can be opened
            fd = os.open(os.devnull, os.O_RDONLY)
            if fd >= top:
                os.close(fd)
                break
            filler.append(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in filler:
            os.close(fd)


async def test_a_control_port_out_of_open_files_says_so_once_and_serves_again(
    server: tuple[Gateway, ServerIdentity], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gw, identity = server
    runner = control_runner(gw)
    SERVED.append(runner)
    await runner.setup()
    sock = bind("127.0.0.1", 0)
    address = sock.getsockname()
    await control_site(runner, sock, control_context(identity)).start()
    client = host_context(identity, tmp_path, "gpu-1")
    loop = asyncio.get_running_loop()
    clients = [socket.socket() for _ in range(3)]  # made first: connecting takes no new file
    for c in clients:
        c.setblocking(False)
    try:
        with out_of_files():
            for c in clients:
                await loop.sock_connect(c, address)
            await eventually(
                lambda: any("cannot accept" in r.getMessage() for r in caplog.records), within=5
            )
        lines = [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()]
        assert len(lines) == 1 and "open-file limit" in lines[0], lines
        reader, writer = await asyncio.open_connection(
            sock=clients.pop(0), ssl=client, server_hostname=pki.SERVER_NAME
        )  # accepted once files are free again
        OPENED.append(writer)
        await still_served([(reader, writer)])
    finally:
        for c in clients:
            c.close()


# -- a host's ingress ----------------------------------------------------------------------------
async def test_ingress_connections_past_the_cap_get_a_503_marked_not_forwarded() -> None:
    port = await serve(ingress_runner(dict, lambda: None, 2))
    held = [await connect(port) for _ in range(2)]
    third, _ = await connect(port)
    answer = await closed_by_peer(third)
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert f"\r\n{NOT_FORWARDED}: busy\r\n".encode() in answer  # the server tries elsewhere
    await still_served(held)


async def test_an_ingress_connection_that_sends_no_request_is_closed() -> None:
    port = await serve(ingress_runner(dict, lambda: None, header_timeout=SHORT))
    reader, _ = await connect(port)
    assert await closed_by_peer(reader) == b""


# -- management and metrics ----------------------------------------------------------------------
@pytest.mark.parametrize("which", ["management", "metrics"])
async def test_the_local_listeners_refuse_past_their_cap(
    server: tuple[Gateway, ServerIdentity], which: str
) -> None:
    gw, _ = server
    management, metrics = local_runners(gw)
    port = await serve(management if which == "management" else metrics)
    held = [await connect(port) for _ in range(LOCAL_MAX_CONNECTIONS)]
    past, _ = await connect(port)
    assert (await closed_by_peer(past)).startswith(b"HTTP/1.1 503 ")
    await still_served(held)


# -- idle keep-alive, on every listener --------------------------------------------------------
LISTENERS = ["public", "control", "management", "metrics", "ingress"]


async def listener(
    which: str, tmp_path: Path, *, cap: int = 4, keepalive: str = "5s"
) -> tuple[int, int, ServerIdentity | None]:
    """Serve the listener ``which`` as the CLI does, with at most ``cap`` connections (the
    management and metrics listeners have their fixed cap) and idle keep-alive bounded by
    ``keepalive``: its port, its cap, and the identity a client connects with (TLS)."""
    identity = ServerIdentity(tmp_path / "identity")
    identity.ensure()
    limits = {"max_connections": cap, "keepalive_timeout": keepalive}
    config = GatewayConfig.model_validate(
        {"deployments": [deployments("http://127.0.0.1:9")], "limits": limits}
    )
    app = create_app(config, KEY, env={}, state_dir=tmp_path, server=identity)
    gw = app[GATEWAY_KEY]
    if which == "public":
        return await serve(GatewayRunner(app)), cap, None
    if which == "control":
        return await serve(control_runner(gw, cap), control_context(identity)), cap, identity
    if which in ("management", "metrics"):
        management, metrics = local_runners(gw)
        port = await serve(management if which == "management" else metrics)
        return port, LOCAL_MAX_CONNECTIONS, None
    seconds = config.limits.keepalive_timeout
    return await serve(ingress_runner(dict, lambda: None, cap, 10, seconds)), cap, None


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """One request without a key (refused or not found) read to its end: the status."""
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    with anyio.fail_after(5):
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        assert length is not None and b"connection: close" not in head.lower(), head
        await reader.readexactly(int(length[1]))
    return int(head.split()[1])


@pytest.mark.parametrize("which", LISTENERS)
async def test_at_its_cap_a_listener_closes_an_idle_keepalive_connection_for_a_new_one(
    which: str, tmp_path: Path
) -> None:
    port, cap, identity = await listener(which, tmp_path)
    held = [await connect(port, identity) for _ in range(cap)]
    for reader, writer in held:
        assert await ask(reader, writer) != 503
    reader, writer = await connect(port, identity)  # past the cap, all others idle
    assert await ask(reader, writer) != 503
    assert await closed_by_peer(held[0][0]) == b""  # the oldest idle one made room
    await still_served(held[1:])


@pytest.mark.parametrize("which", LISTENERS)
async def test_an_idle_keepalive_connection_is_closed_after_the_configured_time(
    which: str, tmp_path: Path
) -> None:
    port, _, identity = await listener(which, tmp_path, keepalive="300ms")
    reader, writer = await connect(port, identity)
    assert await ask(reader, writer) != 503
    assert await closed_by_peer(reader, within=5) == b""


async def test_idle_keepalive_is_bounded_by_default() -> None:
    config = GatewayConfig.model_validate({"deployments": [deployments("http://127.0.0.1:9")]})
    assert config.limits.keepalive_timeout == KEEPALIVE_TIMEOUT_S == 5.0


async def test_a_refused_connections_request_is_read_so_its_503_is_not_lost_to_a_reset() -> None:
    runner = ingress_runner(dict, lambda: None, 1)
    port = await serve(runner)
    held = await connect(port)
    held[1].write(b"GET / HTTP/1.1\r\n")  # in the middle of a head: not idle
    reader, writer = await connect(port)
    with anyio.fail_after(5):
        head = await reader.readuntil(b"\r\n\r\n")  # answered before it asked
    assert head.startswith(b"HTTP/1.1 503 ") and f"{NOT_FORWARDED}: busy".encode() in head
    writer.write(b"POST /i/x/0/v1/chat/completions HTTP/1.1\r\nContent-Length: 4000000\r\n\r\n")
    writer.write(b"x" * 4_000_000)  # a request the listener reads and drops, not resets
    await writer.drain()
    writer.write_eof()
    with anyio.fail_after(5):
        rest = await reader.read()  # the rest of the 503, then the end: no reset
    assert rest.endswith(b"}") and b'"code":"unavailable"' in rest


# -- what every listener says of itself ----------------------------------------------------------
@pytest.mark.parametrize("which", LISTENERS)
async def test_every_listener_names_itself_neutrally(which: str, tmp_path: Path) -> None:
    port, _, identity = await listener(which, tmp_path)
    for request in (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nBad\x00Name: y\r\n\r\n",  # not HTTP: answered 400
    ):
        reader, writer = await connect(port, identity)
        writer.write(request)
        with anyio.fail_after(5):
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        assert f"\r\nserver: {SERVER}\r\n" in head, head
        assert "python" not in head and "aiohttp" not in head, head


async def test_a_join_file_is_valid_for_at_most_30_days(tmp_path: Path) -> None:
    identity = ServerIdentity(tmp_path / "identity")
    identity.ensure()
    identity.address_file.write_text("10.0.0.1:7445\n", encoding="utf-8")
    out = tmp_path / "gpu-1.join"
    base = ["invite", "host", "gpu-1", "--output", str(out), "--state-dir", str(tmp_path)]
    refused = CliRunner().invoke(cli, [*base, "--valid", "721h"])
    assert refused.exit_code == 2 and "at most 30 days (720h)" in refused.output
    assert not out.exists()
    assert CliRunner().invoke(cli, [*base, "--valid", "720h"]).exit_code == 0
    assert out.exists() and MAX_INVITE_S == 720 * 3600
