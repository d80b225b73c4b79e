"""The CLI of several machines: the server's control listener, ``invite host``, ``revoke host``,
``host join`` and ``host serve``."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import sqlite3
import ssl
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

import aiohttp
import typer
from aiohttp import web
from pydantic import TypeAdapter, ValidationError

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
from ._config import ConfigError, Seconds
from ._errors import OperatorError
from ._gateway import Gateway
from ._host import Host, join
from ._log import configure_logging
from ._machines import pki
from ._machines.control import control_app
from ._machines.enroll import Invites, JoinError, JoinFile, ServerIdentity
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


MAX_INVITE_S = 30 * 86400.0
"""The longest a join file may be valid (``--valid``): 30 days. A join file is a bearer secret
that enrolls a machine; a month is enough to post one to a remote site and have it used, and a
file forgotten in a mailbox or a backup stops working within that (11,400 years was accepted)."""


def _duration(value: str) -> float:
    try:
        seconds = float(TypeAdapter(Seconds).validate_python(value))
    except ValidationError:
        raise ConfigError(f"--valid takes a duration such as 1h or 30m, got {value!r}") from None
    if seconds > MAX_INVITE_S:
        raise ConfigError(
            f"--valid {value}: a join file is valid for at most 30 days ({MAX_INVITE_S / 3600:g}h)"
        )
    return seconds


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
StateOpt = Annotated[
    Path | None, typer.Option("--state-dir", help="State directory (env CAPYCTL_STATE_DIR).")
]


def register(
    app: typer.Typer, state_of: Callable[[Path | None], Path], fail: Callable[[str], typer.Exit]
) -> None:
    invite_app = typer.Typer(help="Invite machines to this server.", no_args_is_help=True)
    revoke_app = typer.Typer(help="Cut machines off this server.", no_args_is_help=True)
    host_app = typer.Typer(help="Run this machine as a host of a server.", no_args_is_help=True)
    app.add_typer(invite_app, name="invite")
    app.add_typer(revoke_app, name="revoke")
    app.add_typer(host_app, name="host")

    @invite_app.command("host")
    def invite_host(
        name: Annotated[str, typer.Argument(help="The host's name, as deployments name it.")],
        output: Annotated[Path, typer.Option("--output", help="The join file to write.")],
        valid: Annotated[str, typer.Option("--valid", help="How long it may be used.")] = "1h",
        server: Annotated[
            str | None,
            typer.Option("--server", help="The control address as the host reaches it."),
        ] = None,
        replace: Annotated[
            bool,
            typer.Option(
                "--replace",
                help="NAME is enrolled, or has a join file still usable: enroll a new machine "
                "in its place, voiding that file.",
            ),
        ] = False,
        state_dir: StateOpt = None,
    ) -> None:
        """Write a single-use join file (mode 0600) for host NAME."""
        state = state_of(state_dir)
        identity = ServerIdentity(state / "identity")
        try:
            if not pki.valid_host_name(name):
                raise ConfigError(f"{name!r} cannot name a host: 1 to 63 of a-z, 0-9 and '-'")
            if not identity.ca_cert.exists():
                raise ConfigError(f"no server state in {state}: start `serve --role server` once")
            control = server or identity.address_file.read_text(encoding="utf-8").strip()
            chost, _ = address(control, "--server")
            if chost in ("0.0.0.0", "::"):  # noqa: S104 - what hosts cannot be sent to
                raise ConfigError(
                    f"the server listens on {control}: say how the host reaches it with --server"
                )
            seconds = _duration(valid)
            invites = Invites(state / "machines.sqlite3")
            try:
                if invites.roster.enrolled(name) and not replace:
                    raise ConfigError(
                        f"host {name} is enrolled already: a second machine of that name would "
                        "take its place. To enroll a new machine in its place, add --replace "
                        "(the old one is refused once the new one joins); to cut it off, "
                        f"`capyctl-gateway revoke host {name}`"
                    )
                token, expires = invites.create(name, seconds, replace=replace)
            finally:
                invites.close()
            ca = identity.ca_cert.read_bytes()
            JoinFile(name, control, ca, pki.fingerprint(ca), token, expires).write(output)
        except (ConfigError, JoinError, OSError) as exc:
            raise fail(str(exc)) from None
        typer.echo(f"join file for host {name} written to {output} (valid {valid}, used once)")

    @revoke_app.command("host")
    def revoke_host(
        name: Annotated[str, typer.Argument(help="The host's name.")],
        state_dir: StateOpt = None,
    ) -> None:
        """Refuse host NAME's certificate from now on; a running server closes its session
        within a second (it reads the revocation from its state directory)."""
        state = state_of(state_dir)
        path = state / "machines.sqlite3"
        try:
            if not path.exists():
                raise ConfigError(f"no server state in {state}: no host was enrolled there")
            invites = Invites(path)
            try:
                done = invites.roster.revoke(name)
            finally:
                invites.close()
        except (ConfigError, OSError, sqlite3.Error) as exc:
            raise fail(str(exc)) from None
        if not done:
            raise fail(f"host {name} holds no certificate here (never enrolled, or revoked)")
        typer.echo(
            f"host {name} revoked: its certificate is refused from now on, and a running "
            "server closes its session within a second; to enroll it again, invite it"
        )

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
