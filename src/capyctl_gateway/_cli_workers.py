"""``capyctl-gateway serve --workers N``: the authority's side of the processes (start each
worker, keep it running, stop them all as one gateway stops), and a worker process's own main
(``python -m capyctl_gateway._cli_workers FD``, never run by hand).

Each worker gets a Unix socketpair line to the authority (its end passed as an inherited file
descriptor) and binds the public port itself with ``SO_REUSEPORT``; the authority holds the
port bound, never listening, so that the kernel gives it no connection and no other program
takes the port while a worker restarts. A worker that exits unasked is started again (after
`RESTART_FIRST_S`, doubling up to `RESTART_MAX_S` while it keeps failing), and so is one that
answers no ping for `FROZEN_S` (killed first); what it held is settled by the authority as a
lost line's requests are.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time

from ._cli_common import settle_heap, use_uvloop
from ._log import configure_logging, event
from ._tasks import Supervisor
from ._workers.authority import Authority, Line
from ._workers.messages import FROZEN_S, PING_S, Quit, Stop
from ._workers.worker import Worker, bound

__all__ = ["RESTART_FIRST_S", "RESTART_MAX_S", "Workers", "main"]

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 10.0
STEADY_S = 30.0
"""A worker up this long resets its restart delay."""
MISSED = round(FROZEN_S / PING_S)
"""Pings in a row a worker may leave unanswered before it is taken for frozen."""
READY_TIMEOUT_S = 60.0
"""How long a worker gets to listen when the gateway starts."""


class Workers:
    """The worker processes of one gateway, over its `Authority`."""

    def __init__(
        self, authority: Authority, count: int, host: str, port: int, log_format: str
    ) -> None:
        self.authority = authority
        authority.pinging = True  # `_beat`, from their start
        self.count = count
        self.host, self.port, self.log_format = host, port, log_format
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.lines: dict[int, Line] = {}
        self._keepers = Supervisor("the workers' keeper")
        """One task a worker: waits for it to exit and starts it again (a fault is logged)."""
        self._stopping = False

    async def start(self) -> None:
        """Start every worker and wait until each listens (raises if one cannot)."""
        self._keepers.keep(self._beat, every=PING_S, kind="heartbeat", what="pinging the workers")
        for index in range(self.count):
            await asyncio.wait_for(self._spawn(index), READY_TIMEOUT_S)

    async def _beat(self) -> None:
        """Ping every worker; one that answered none of the last `MISSED` pings (`FROZEN_S`:
        stopped, its loop blocked) still holds its share of the port and its clients: it is
        killed, and its keeper starts it again (what it ran is settled as a lost line's
        requests are). A worker still starting is judged by `READY_TIMEOUT_S` alone; a stall
        of the authority's own sends no pings, so it costs no worker its life."""
        self.authority.ping()
        for index, line in list(self.lines.items()):
            proc, missed = self.procs[index], self.authority.unanswered(line)
            ready = line.ready.done() and line.ready.result()  # else READY_TIMEOUT_S bounds it
            if ready and missed > MISSED and proc.returncode is None and not self._stopping:
                event(
                    "worker_frozen",
                    "worker %d answered none of the last %d pings; killing it to start it again",
                    *(index, missed),
                    worker=index,
                )
                del self.lines[index]  # once: its keeper sees the exit
                proc.kill()

    async def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        argv = [sys.executable, "-m", "capyctl_gateway._cli_workers", str(fd), self.host]
        argv += [str(self.port), self.log_format]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, pass_fds=(theirs.fileno(),), start_new_session=True
            )
        finally:
            theirs.close()
        self.procs[index] = proc
        line = self.lines[index] = await self.authority.attach(ours, index, self.count)
        if not await line.ready:
            await proc.wait()
            raise RuntimeError(
                f"worker {index} exited with {proc.returncode} before it listened"
            ) from None
        self._keepers.spawn(self._keep(index, proc), what=f"keeping worker {index}")

    async def _keep(self, index: int, proc: asyncio.subprocess.Process) -> None:
        delay = RESTART_FIRST_S
        while True:
            began = time.monotonic()
            code = await proc.wait()
            self.lines.pop(index, None)  # its silence is no longer anyone's
            if self._stopping:
                return
            if time.monotonic() - began > STEADY_S:
                delay = RESTART_FIRST_S
            event(
                "worker_exited",
                "worker %d exited with %s; starting it again in %.1f s",
                *(index, code, delay),
                worker=index,
                code=code,
            )
            await asyncio.sleep(delay)  # a pause before a retry, not a synchronisation
            if self.stopping():
                return
            delay = min(delay * 2, RESTART_MAX_S)
            try:
                await asyncio.wait_for(self._spawn(index), READY_TIMEOUT_S)
                return  # the new one has its own keeper
            except (RuntimeError, TimeoutError) as exc:
                if (late := self.procs[index]).returncode is None:
                    late.kill()  # started, never listened: it goes before the next try
                event(
                    "worker_restart_failed",
                    "worker %d did not start again: %s",
                    *(index, exc),
                    worker=index,
                )
                proc = self.procs[index]

    def stopping(self) -> bool:
        return self._stopping

    def stop_listening(self) -> None:
        """The gateway is stopping: every worker stops listening, and none is restarted."""
        self._stopping = True
        self.authority.broadcast(Stop())

    async def quit(self, within_s: float) -> None:
        """Tell every worker to finish and wait for them; one still running after
        ``within_s`` is killed. No worker is started again from here on."""
        self._stopping = True
        await self._keepers.aclose()
        self.authority.broadcast(Quit())
        procs = list(self.procs.values())
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), within_s)
        except TimeoutError:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in procs))


async def _work(fd: int, host: str, port: int) -> None:
    worker = Worker()
    line = socket.socket(fileno=fd)
    await worker.connect(line)
    try:
        await worker.serve(bound(host, port, reuse_port=True), on_ready=settle_heap)
    finally:
        await worker.close()


def main() -> None:
    """A worker process: its line's descriptor, the public host and port, the log format."""
    fd, host, port, log_format = sys.argv[1:5]
    configure_logging(log_format)
    # The authority says when to stop (a terminal's ^C, or systemd's SIGTERM to every process of
    # the service, would otherwise cut its streams before the authority's orderly stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    use_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_work(int(fd), host, int(port)))


if __name__ == "__main__":
    main()
