"""What ``capyctl-gateway serve`` runs once its configuration is read and its sockets are bound:
the public, management, metrics and control listeners, the signals that stop them, and the
orderly stop (requests in flight get `SHUTDOWN_S`)."""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl

import typer
from aiohttp import web

from ._cli_common import local_runners, settle_heap
from ._cli_machines import control_site
from ._http.app import GATEWAY_KEY, GatewayRunner

__all__ = ["SHUTDOWN_S", "run"]

SHUTDOWN_S = 60.0
"""How long a stopping gateway waits for requests in flight before closing them."""


async def run(
    application: web.Application,
    sock: socket.socket,
    msock: socket.socket,
    listening: str,
    xsock: socket.socket | None = None,
    extra: list[tuple[web.AppRunner, socket.socket, ssl.SSLContext]] | None = None,
) -> None:
    runner = GatewayRunner(application, shutdown_timeout=SHUTDOWN_S)
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
        await web.SockSite(runner, sock, backlog=4096).start()
        await web.SockSite(mrunner, msock).start()
        if xsock is not None:
            await web.SockSite(xrunner, xsock).start()
        for erunner, esock, context in extra or []:
            await erunner.setup()
            await control_site(erunner, esock, context).start()
        settle_heap()
        typer.echo(listening, err=True)  # once it is true, and signals are handled
        await stop.wait()
        routes = application[GATEWAY_KEY].fleet.routes
        running = sum(r.queue.running for r in routes.values())
        waiting = sum(r.queue.waiting for r in routes.values())
        typer.echo(
            f"capyctl-gateway: stopping on {received[0].name}: no new connections; waiting up "
            f"to {SHUTDOWN_S:.0f} s for {running} running and {waiting} waiting request(s), "
            "then closing their engine connections",
            err=True,
        )
    finally:
        await xrunner.cleanup()
        await mrunner.cleanup()
        await runner.cleanup()  # requests through hosts finish first: their sessions stay up
        for erunner, _, _ in extra or []:
            await erunner.cleanup()
    typer.echo("capyctl-gateway: stopped", err=True)
