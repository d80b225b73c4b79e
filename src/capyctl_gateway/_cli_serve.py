"""What ``capyctl-gateway serve`` runs once its configuration is read and its sockets are bound:
the public, management, metrics and control listeners, the signals that stop them, and the
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

import typer
from aiohttp import web

from ._cli_common import listen_site, local_runners, settle_heap
from ._cli_machines import control_site
from ._http.app import GATEWAY_KEY, GatewayRunner

__all__ = ["END_GRACE_S", "run"]

END_GRACE_S = 5.0
"""After the requests still open are ended, how long their handlers get to write that."""
QUIET_EVERY_S = 0.1


async def run(
    application: web.Application,
    sock: socket.socket,
    msock: socket.socket,
    listening: str,
    xsock: socket.socket | None = None,
    extra: list[tuple[web.AppRunner, socket.socket, ssl.SSLContext]] | None = None,
) -> None:
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
    try:
        await listen_site(runner, sock).start()
        await listen_site(mrunner, msock).start()
        if xsock is not None:
            await listen_site(xrunner, xsock).start()
        for erunner, esock, context in extra or []:
            await erunner.setup()
            await control_site(erunner, esock, context).start()
        settle_heap()
        typer.echo(listening, err=True)  # once it is true, and signals are handled
        await stop.wait()
        await _stop_serving(application, runner, received[0])
    finally:
        await xrunner.cleanup()
        await mrunner.cleanup()
        await runner.cleanup()  # requests through hosts finish first: their sessions stay up
        for erunner, _, _ in extra or []:
            await erunner.cleanup()
    typer.echo("capyctl-gateway: stopped", err=True)


async def _stop_serving(
    application: web.Application, runner: GatewayRunner, sig: signal.Signals
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
    for _ in range(math.ceil(limit / QUIET_EVERY_S)):  # counts on the loop: a look each turn
        if fleet.quiet():
            break
        await asyncio.sleep(QUIET_EVERY_S)
    ended = fleet.end_all("the gateway is stopping")
    if ended:
        typer.echo(f"capyctl-gateway: ended {ended} request(s) still open", err=True)
