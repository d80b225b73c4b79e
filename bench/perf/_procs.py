"""Processes the runner starts: each leads its own session (so its children are found and
stopped with it), logs to a file, and is stopped by process group: SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from ._procfs import session_pids

__all__ = ["ROOT", "Proc", "ProcessSet", "StartupError", "free_port", "log_tail", "tidy"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: the children run ``python -m bench.perf.*`` from here."""


class StartupError(RuntimeError):
    """A process did not come up; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def log_tail(path: Path, max_bytes: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-max_bytes:].decode("utf-8", "replace")


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        """The leader and every process it started (they share its session)."""
        return session_pids(self.pid) or [self.pid]

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise StartupError(f"{self.name} exited with {code}:\n{log_tail(self.log)}")

    def wait_http(
        self,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Poll ``url`` until it answers 200."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{self.name} did not answer {url} within {timeout_s:.0f} s:\n"
                    f"{log_tail(self.log)}"
                )
            time.sleep(0.05)

    def wait_file(self, path: Path, *, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise StartupError(f"{self.name} wrote no {path}:\n{log_tail(self.log)}")
            time.sleep(0.05)


class ProcessSet:
    """Everything the runner started, stopped in reverse order by ``stop_all``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, *, timeout_s: float = 5.0) -> None:
        if proc.popen.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout_s)
        # children that outlived the leader are still in its group
        _signal_group(proc.pid, signal.SIGKILL)
        if proc.popen.poll() is None:
            proc.popen.wait(timeout_s)

    def stop_all(self) -> None:
        while self.procs:
            self.stop(self.procs.pop())


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def tidy(
    old: dict[signal.Signals, Any],
    work: Path,
    *,
    keep: bool = False,
    log: Callable[[str], None] | None = None,
) -> None:
    """A benchmark's last step: the signal handlers it replaced put back, and its work folder
    removed (or, with ``keep``, where it is told to ``log``)."""
    for sig, handler in old.items():
        signal.signal(sig, handler)
    if keep and log is not None:
        log(f"logs in {work}")
    elif not keep:
        shutil.rmtree(work, ignore_errors=True)
