"""The listeners beside the public one, bounded as it is, over real sockets: the server's control
port (TLS first, client certificates optional), a host's ingress, the management and metrics
listeners. Each built as the CLI builds it; the control and ingress ones with small bounds."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from capyctl_gateway import GATEWAY_KEY, GatewayConfig, create_app
from capyctl_gateway._cli_common import (
    LOCAL_MAX_CONNECTIONS,
    TLS_HANDSHAKE_TIMEOUT_S,
    bind,
    local_runners,
)
from capyctl_gateway._cli_machines import control_runner, control_site, ingress_runner
from capyctl_gateway._gateway import Gateway
from capyctl_gateway._machines import pki
from capyctl_gateway._machines.enroll import ServerIdentity
from capyctl_gateway._machines.protocol import NOT_FORWARDED
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


async def test_control_connections_past_the_cap_get_a_503_and_are_closed(
    server: tuple[Gateway, ServerIdentity],
) -> None:
    gw, identity = server
    port = await serve(control_runner(gw, max_connections=2), control_context(identity))
    held = [await connect(port, identity) for _ in range(2)]
    third, _ = await connect(port, identity)
    answer = await closed_by_peer(third)
    assert answer.startswith(b"HTTP/1.1 503 ") and b'"code":"unavailable"' in answer
    await still_served(held)


# -- a host's ingress ----------------------------------------------------------------------------
async def test_ingress_connections_past_the_cap_get_a_503_marked_not_forwarded() -> None:
    port = await serve(ingress_runner(lambda tag, i: None, lambda: None, 2))
    held = [await connect(port) for _ in range(2)]
    third, _ = await connect(port)
    answer = await closed_by_peer(third)
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert f"\r\n{NOT_FORWARDED}: busy\r\n".encode() in answer  # the server tries elsewhere
    await still_served(held)


async def test_an_ingress_connection_that_sends_no_request_is_closed() -> None:
    port = await serve(ingress_runner(lambda tag, i: None, lambda: None, header_timeout=SHORT))
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
