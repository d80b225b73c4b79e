"""``capyctl-gateway serve`` as a process of its own, for the tests that kill or signal it: its
command line on loopback ports and the environment it runs in (this checkout's code, none of
the caller's ``CAPYCTL_`` variables)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from capyctl_gateway import GATEWAY_KEY, GatewayRunner
from capyctl_gateway._workers.authority import Authority
from capyctl_gateway._workers.messages import Quit, Stop
from capyctl_gateway._workers.worker import Worker, bound

__all__ = ["listening", "serve_command", "serve_workers"]

ROOT = Path(__file__).resolve().parents[2]


def serve_command(
    config: Path, state: Path, listen: int, management: int
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a gateway serving ``config`` with ``state`` as its state
    directory, on 127.0.0.1 ``listen`` and ``management``, logging JSON lines."""
    argv = [
        str(Path(sys.executable).with_name("capyctl-gateway")), "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{listen}", "--management", f"127.0.0.1:{management}",
        "--state-dir", str(state), "--log-format", "json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env["PYTHONPATH"] = str(ROOT)
    return argv, env


def listening(gateway: subprocess.Popen[bytes], state: Path) -> str:
    """Read the gateway's stderr up to its listening line (it is up, its signals handled) and
    return its API key."""
    assert gateway.stderr is not None
    for line in gateway.stderr:
        if b"listening on" in line:
            break
    return (state / "identity" / "credentials").read_text().split()[1]


async def serve_workers(
    app: web.Application, workers: int, *, port: int = 0
) -> tuple[Callable[[], Awaitable[None]], str]:
    """Serve ``app``'s gateway as an authority with ``workers`` workers, all in this process:
    each worker on its own line (a Unix socketpair) and its own ``SO_REUSEPORT`` listener on
    one loopback port, as ``serve --workers`` runs them in processes. Returns the stop (as a
    stopping gateway: ``STOP``, then ``QUIT``) and the public URL."""
    runner = GatewayRunner(app)
    await runner.setup()  # opens the fleet; the authority serves no public listener itself
    authority = Authority(app[GATEWAY_KEY])
    reserved = bound("127.0.0.1", port, reuse_port=True)
    port = reserved.getsockname()[1]
    running: list[tuple[Worker, asyncio.Task[None]]] = []
    for index in range(workers):
        ours, theirs = socket.socketpair()
        line = await authority.attach(ours, index, workers)
        worker = Worker()
        await worker.connect(theirs)
        task = asyncio.get_running_loop().create_task(
            worker.serve(bound("127.0.0.1", port, reuse_port=True))
        )
        running.append((worker, task))
        await line.ready

    async def stop() -> None:
        authority.broadcast(Stop())
        authority.broadcast(Quit())
        for worker, task in running:
            await task
            await worker.close()
        await runner.cleanup()
        reserved.close()

    return stop, f"http://127.0.0.1:{port}"
