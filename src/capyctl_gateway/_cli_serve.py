"""What ``capyctl-gateway serve`` does: reads its configuration, makes its keys and binds its
sockets (`prepare`, where every operator error is raised before anything serves), then runs the
public, management, metrics and control listeners, the signals that stop them, and the
orderly stop: the public listener takes no new connection, requests that run or wait get
``limits.shutdown_timeout`` to finish, then each one still open is ended (a stream with an
in-band error event, a waiting request with 503 ``shutting_down``), and the listeners close
after `END_GRACE_S` more for those last words to be written."""

from __future__ import annotations

import asyncio
import math
import signal
import socket
import ssl
from pathlib import Path
from typing import NamedTuple

import typer
from aiohttp import web

from ._cli_common import (
    address,
    bind,
    enough_files,
    files_wanted,
    listen_site,
    local_runners,
    management_address,
    settle_heap,
)
from ._cli_machines import control_runner, control_site, server_control
from ._cli_workers import Workers
from ._config import ConfigError, load_config
from ._config.bounds import fit_workers
from ._http.app import GATEWAY_KEY, GatewayRunner, create_app
from ._identity import (
    credentials_path,
    load_or_create_api_key,
    load_or_create_server_key,
    server_credentials_path,
)
from ._workers.authority import Authority

__all__ = ["END_GRACE_S", "Serving", "prepare", "run"]

END_GRACE_S = 5.0
"""After the requests still open are ended, how long their handlers get to write that."""
QUIET_EVERY_S = 0.1
QUIT_MARGIN_S = 5.0
"""Beyond `END_GRACE_S`, how long the workers get to exit before they are killed."""


class Serving(NamedTuple):
    """What `prepare` made ready: `run`'s arguments but the workers' log format, and how many
    worker processes serve the public listener."""

    listeners: tuple[
        web.Application,
        socket.socket,
        socket.socket,
        str,
        socket.socket | None,
        list[tuple[web.AppRunner, socket.socket, ssl.SSLContext]],
    ]
    workers: int


def prepare(
    config: Path,
    *,
    listen: str,
    state: Path,
    management: str | None,
    metrics: str | None,
    role: str,
    control: str,
    workers: int | None,
) -> Serving:
    """Read the configuration, make or read the key, bind the listeners' sockets; the line
    that says where it listens. Raises OperatorError (ConfigError) for what an operator fixes."""
    host, port = address(listen, "--listen")
    mhost, mport = management_address(management)
    cfg = load_config(config)
    if role not in ("single", "server"):
        raise ConfigError("--role takes single or server")
    problem = cfg.role_problem(server=role == "server")
    if problem is not None:
        raise ConfigError(f"{config}: {problem}")
    extra = []
    if role == "server":
        key = load_or_create_server_key(state)
        identity, csock, context = server_control(state, *address(control, "--control"))
        application = create_app(cfg, key, state_dir=state, server=identity)
        extra.append((control_runner(application[GATEWAY_KEY]), csock, context))
    else:
        key = load_or_create_api_key(state)
        application = create_app(cfg, key, state_dir=state)
    enough_files(files_wanted(cfg.limits.max_connections))
    count = workers or cfg.workers
    fit_workers(cfg.limits, count)  # a body budget set too small to split: refused now
    sock = bind(host, port, reuse_port=count > 1)
    msock = bind(mhost, mport)
    xsock = bind(*address(metrics, "--metrics")) if metrics else None
    keyfile = credentials_path(state) if role == "single" else server_credentials_path(state)
    listening = (
        f"capyctl-gateway listening on http://{host}:{sock.getsockname()[1]}/v1 "
        f"(key in {keyfile}; management on {mhost}:{msock.getsockname()[1]}"
        + (f"; control on {control}" if role == "server" else "")
        + (f"; metrics on {metrics}" if metrics else "")
        + ")"
        + (f" with {count} workers" if count > 1 else "")
    )
    return Serving((application, sock, msock, listening, xsock, extra), count)


async def run(
    application: web.Application,
    sock: socket.socket,
    msock: socket.socket,
    listening: str,
    xsock: socket.socket | None = None,
    extra: list[tuple[web.AppRunner, socket.socket, ssl.SSLContext]] | None = None,
    workers: tuple[int, str] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM. ``workers``: how many worker processes serve the public
    listener on ``sock`` (bound, not listening: they bind its port with ``SO_REUSEPORT``), and
    their log format; this process is then their authority."""
    runner = GatewayRunner(application, shutdown_timeout=END_GRACE_S)
    await runner.setup()
    mrunner, xrunner = local_runners(application[GATEWAY_KEY])
    await mrunner.setup()
    await xrunner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    team: Workers | None = None
    try:
        if workers is None:
            await listen_site(runner, sock).start()
        else:
            host, port = sock.getsockname()[:2]
            authority = Authority(application[GATEWAY_KEY])
            team = Workers(authority, workers[0], host, port, workers[1])
            try:
                await team.start()
            except (RuntimeError, TimeoutError) as exc:
                typer.echo(f"capyctl-gateway: a worker did not start: {exc}", err=True)
                raise typer.Exit(1) from None
        await listen_site(mrunner, msock).start()
        if xsock is not None:
            await listen_site(xrunner, xsock).start()
        for erunner, esock, context in extra or []:
            await erunner.setup()
            await control_site(erunner, esock, context).start()
        settle_heap()
        typer.echo(listening, err=True)  # once it is true, and signals are handled
        await stop.wait()
        await _stop_serving(application, runner, received[0], team)
    finally:
        if team is not None:
            await team.quit(END_GRACE_S + QUIT_MARGIN_S)
        await xrunner.cleanup()
        await mrunner.cleanup()
        await runner.cleanup()  # requests through hosts finish first: their sessions stay up
        for erunner, _, _ in extra or []:
            await erunner.cleanup()
    typer.echo("capyctl-gateway: stopped", err=True)


async def _stop_serving(
    application: web.Application,
    runner: GatewayRunner,
    sig: signal.Signals,
    team: Workers | None,
) -> None:
    """No new connection; running and waiting requests get the shutdown timeout; then what is
    still open is ended in band."""
    fleet = application[GATEWAY_KEY].fleet
    limit = fleet.config.limits.shutdown_timeout
    running = sum(r.queue.running for r in fleet.routes.values())
    waiting = sum(r.queue.waiting for r in fleet.routes.values())
    typer.echo(
        f"capyctl-gateway: stopping on {sig.name}: no new connections; waiting up to "
        f"{limit:.0f} s for {running} running and {waiting} waiting request(s), then ending "
        "those still open",
        err=True,
    )
    for site in list(runner.sites):
        await site.stop()
    if team is not None:
        team.stop_listening()
    for _ in range(math.ceil(limit / QUIET_EVERY_S)):  # counts on the loop: a look each turn
        if fleet.quiet():
            break
        await asyncio.sleep(QUIET_EVERY_S)
    ended = fleet.end_all("the gateway is stopping")
    if ended:
        typer.echo(f"capyctl-gateway: ended {ended} request(s) still open", err=True)
