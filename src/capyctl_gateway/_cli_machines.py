"""The CLI of several machines: the server's control listener, ``host join`` and ``host serve``;
``invite host`` and ``revoke host`` are added from `_cli_invite`."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

import aiohttp
import typer
from aiohttp import web

from ._cli_common import (
    CONTROL_MAX_CONNECTIONS,
    HEAD_TIMEOUT_S,
    INGRESS_MAX_CONNECTIONS,
    KEEPALIVE_TIMEOUT_S,
    address,
    bind,
    bounded,
    control_site,
    enough_files,
    listen_site,
    settle_heap,
    use_uvloop,
)
from ._cli_invite import MAX_INVITE_S, StateOpt, invite_app, revoke_app
from ._config import ConfigError
from ._errors import OperatorError
from ._gateway import Gateway
from ._host import Host, join
from ._log import configure_logging
from ._machines import pki
from ._machines.control import control_app
from ._machines.enroll import JoinError, ServerIdentity
from ._machines.ingress import MAX_FORWARDS, Gate, create_ingress_app
from ._machines.protocol import NOT_FORWARDED
from ._machines.server import Machines

__all__ = [
    "MAX_INVITE_S",
    "control_runner",
    "control_site",
    "ingress_runner",
    "register",
    "server_control",
]


def server_control(
    state: Path, host: str, port: int
) -> tuple[ServerIdentity, socket.socket, ssl.SSLContext]:
    """The server's control identity (made on first start), its listening socket and TLS."""
    identity = ServerIdentity(state / "identity")
    identity.ensure()
    sock = bind(host, port)
    identity.address_file.write_text(f"{host}:{sock.getsockname()[1]}\n", encoding="utf-8")
    return identity, sock, pki.server_context(identity.cert, identity.key, identity.ca_cert)


def control_runner(
    gw: Gateway,
    max_connections: int = CONTROL_MAX_CONNECTIONS,
    header_timeout: float = HEAD_TIMEOUT_S,
) -> web.AppRunner:
    """The runner of the server's control listener (serve it with `control_site`, once the
    gateway's application has started); idle keep-alive as ``limits.keepalive_timeout``."""
    app = control_app(lambda: _machines(gw))
    idle = gw.config.limits.keepalive_timeout
    return bounded(app, "control port", max_connections, header_timeout, keepalive_timeout=idle)


def _machines(gw: Gateway) -> Machines:
    machines = gw.fleet.machines
    if machines is None:
        raise OperatorError("this gateway is not a server (--role server)")
    return machines


def ingress_runner(
    gates: Callable[[], Mapping[tuple[str, int], Gate]],
    session: Callable[[], aiohttp.ClientSession | None],
    max_connections: int = INGRESS_MAX_CONNECTIONS,
    header_timeout: float = HEAD_TIMEOUT_S,
    keepalive_timeout: float = KEEPALIVE_TIMEOUT_S,
    **kwargs: object,
) -> web.AppRunner:
    """The runner of a host's ingress (`create_ingress_app`), cancelling a forward when the
    server hangs up; an idle keep-alive connection is closed after ``keepalive_timeout``."""
    app = create_ingress_app(gates, session)
    busy = f"{NOT_FORWARDED}: busy\r\n".encode()  # the server may try another instance
    return bounded(
        app,
        "ingress",
        max_connections,
        header_timeout,
        keepalive_timeout=keepalive_timeout,
        busy_headers=busy,
        handler_cancellation=True,
        **kwargs,
    )


def _private(host: str) -> None:
    """Refuse an ingress address that is not private (RFC 1918, loopback, ULA, 100.64/10)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"--ingress takes a private IP address, not {host!r}") from None
    if ip in _CGNAT or (ip.is_private or ip.is_loopback) and not ip.is_unspecified:
        return
    raise ConfigError(
        f"--ingress {host}: bind the ingress to a private address only the server reaches "
        "(docs/gateway/machines.md)"
    )


_CGNAT = ipaddress.ip_network("100.64.0.0/10")


def register(
    app: typer.Typer, state_of: Callable[[Path | None], Path], fail: Callable[[str], typer.Exit]
) -> None:
    """Add ``invite host``, ``revoke host``, ``host join`` and ``host serve`` to ``app``."""
    app.add_typer(invite_app(state_of, fail), name="invite")
    app.add_typer(revoke_app(state_of, fail), name="revoke")
    app.add_typer(_host_app(state_of, fail), name="host")


def _host_app(
    state_of: Callable[[Path | None], Path], fail: Callable[[str], typer.Exit]
) -> typer.Typer:
    """``host join`` and ``host serve``."""
    host_app = typer.Typer(help="Run this machine as a host of a server.", no_args_is_help=True)

    @host_app.command("join")
    def host_join(
        join_file: Annotated[Path, typer.Option("--join-file", help="From `invite host`.")],
        state_dir: StateOpt = None,
    ) -> None:
        """Enroll this machine with the server that wrote the join file."""
        state = state_of(state_dir)
        try:
            name = asyncio.run(join(join_file, state))
        except JoinError as exc:
            raise fail(str(exc)) from None
        typer.echo(f"enrolled as host {name}; start it with `capyctl-gateway host serve`")

    @host_app.command("serve")
    def host_serve(
        ingress: Annotated[
            str, typer.Option("--ingress", help="Private ADDR:PORT the server forwards to.")
        ],
        state_dir: StateOpt = None,
        log_format: Annotated[str, typer.Option("--log-format", help="text or json.")] = "auto",
    ) -> None:
        """Run this host: its session to the server, its engines and its ingress."""
        fmt = log_format if log_format != "auto" else ("text" if sys.stderr.isatty() else "json")
        configure_logging(fmt)
        state = state_of(state_dir)
        try:
            ihost, iport = address(ingress, "--ingress")
            _private(ihost)
            # Each connection to the ingress, and each forward's engine connection, and room.
            enough_files(INGRESS_MAX_CONNECTIONS + MAX_FORWARDS + 256)
            sock = bind(ihost, iport)
            shown = f"[{ihost}]" if ":" in ihost else ihost
            host = Host(state, f"http://{shown}:{sock.getsockname()[1]}")
        except OperatorError as exc:
            raise fail(str(exc)) from None
        use_uvloop()
        asyncio.run(_serve_host(host, sock))

    return host_app


async def _serve_host(host: Host, sock: socket.socket) -> None:
    runner = ingress_runner(host.gates, host.session)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    session = loop.create_task(host.run())
    try:
        await listen_site(runner, sock).start()
        settle_heap()
        typer.echo(
            f"capyctl-gateway host {host.name}: ingress on {host.ingress_url}, "
            f"server at {host.control}",
            err=True,
        )
        await stop.wait()
    finally:
        session.cancel()
        await asyncio.gather(session, return_exceptions=True)  # stops its engines
        await runner.cleanup()
    typer.echo(f"capyctl-gateway host {host.name}: stopped", err=True)
