"""One engine process the gateway runs: started with the flags the gateway forces, watched until
it answers, stopped with its whole process group.

The command is the operator's, plus ``--host 127.0.0.1 --port <free port>`` and the engine's
forced flags (`EngineFacts.forced_flags`). It runs under a reaper (``reaper.py``), a small
process that the kernel signals when the gateway dies (``PR_SET_PDEATHSIG``, even on SIGKILL)
and that then stops the engine's whole process group, children included. Its output goes
through a pipe to its run's bounded log files (``enginelog.py``); the last of it goes to the
gateway's log when a start fails (masked by the runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys

import aiohttp

from .._clock import stamp
from .._config import Launch
from .._engines import EngineKind, facts
from .._errors import StartFailedError
from .enginelog import EngineLog

__all__ = [
    "EngineProcess",
    "PortLostError",
    "StartFailedError",
    "free_port",
    "gone_within",
    "launch_argv",
    "launch_env",
]

STOP_GRACE_S = 15.0
"""A stopping engine's reaper gets SIGTERM (it gives the engine 10 s), and SIGKILL after this."""
REAPER = [sys.executable, "-m", "capyctl_gateway._local.reaper", "--"]
PROBE_EVERY_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_IN_USE = ("address already in use", "couldn't bind", "could not bind", "errno 98")


class PortLostError(StartFailedError):
    """The engine exited while starting because its port was taken before it bound it: its
    last words say so (vLLM's and aiohttp's errno 98, llama.cpp's "couldn't bind HTTP server
    socket")."""


def launch_argv(kind: EngineKind, launch: Launch, port: int, *, sleep: bool = False) -> list[str]:
    """The command line: the operator's, placed on loopback, with the forced flags (and what
    parking needs, with ``sleep``)."""
    f = facts(kind)
    argv = [*launch.command, "--host", "127.0.0.1", "--port", str(port)]
    wanted = [*f.forced_flags, *(f.sleep_flags if sleep else ())]
    argv += [flag for flag in wanted if flag not in launch.command]
    return argv


def launch_env(kind: EngineKind, launch: Launch, *, sleep: bool = False) -> dict[str, str]:
    """What is added to the gateway's environment for the engine."""
    return {**launch.env, **(dict(facts(kind).sleep_env) if sleep else {})}


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1  # SIGTERM, so that the reaper can stop its engine first
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class EngineProcess:
    """A running engine process and its log."""

    def __init__(self, argv: list[str], env: dict[str, str], log: EngineLog, port: int) -> None:
        self.argv = argv
        self.env = env
        self.log = log
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self._engine_pid: int | None = None

    @property
    def reaper_pid(self) -> int | None:
        """The reaper's: its command line is the engine's, after ``--``."""
        return self.proc.pid if self.proc is not None else None

    @property
    def pid(self) -> int | None:
        """The engine's own (the reaper's one child, which leads the engine's process group),
        once it runs; None before and after."""
        if self._engine_pid is None and self.proc is not None and self.proc.returncode is None:
            self._engine_pid = _only_child(self.proc.pid)
        return self._engine_pid

    async def start(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """Start the process; return once its ``/health`` answers 200.

        Raises:
            StartFailedError: it exited, could not be run, or did not answer in time.
        """
        env = {**os.environ, **self.env}
        try:
            self.log.open()
        except OSError as exc:
            raise StartFailedError(f"its log could not be created: {exc}") from None
        read_fd, write_fd = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *REAPER,
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_fd,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            os.close(read_fd)
            self.log.close()
            raise StartFailedError(f"the command could not be run: {exc.strerror}") from None
        finally:
            os.close(write_fd)  # the engine's and its reaper's now
        self.log.follow(read_fd)
        self.started_at = stamp()
        deadline = self.started_at + timeout_s
        health = f"{self.url}/health"
        while True:
            if self.proc.returncode is not None:
                await self.log.drained()
                tail = self.log.tail()
                lost = any(words in tail[-4096:].lower() for words in _IN_USE)
                raise (PortLostError if lost else StartFailedError)(
                    f"the engine exited with status {self.proc.returncode} while starting",
                    log_tail=tail,
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(health, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            if stamp() > deadline:
                await self.stop()
                raise StartFailedError(
                    f"the engine did not answer /health within {timeout_s:.0f} s "
                    "(launch.startup_timeout)",
                    log_tail=self.log.tail(),
                )
            await asyncio.sleep(PROBE_EVERY_S)  # polling a process we cannot be told about

    async def stop(self) -> int | None:
        """SIGTERM to the reaper (it stops the engine's group), SIGKILL to both groups after
        `STOP_GRACE_S`; returns once the engine is gone, with the reaper's exit status."""
        proc = self.proc
        if proc is None:
            return None
        engine = self.pid  # learnt before the reaper goes
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # children that outlived their leader
        if engine is not None:  # a reaper killed outright leaves its engine to the kernel
            _signal_group(engine, signal.SIGKILL)
            await gone_within(engine)
        await self.log.drained()
        return proc.returncode

    def exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None


def _only_child(pid: int) -> int | None:
    """The one child of process ``pid`` (Linux's ``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


async def gone_within(pid: int, within: float = STOP_GRACE_S) -> bool:
    """Whether process ``pid`` has exited within ``within`` s (a pidfd turns readable)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return True  # gone already
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await asyncio.wait_for(exited, within)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
