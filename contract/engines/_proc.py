"""Process helpers shared by the engine launchers of the contract suite."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar, Self

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from types import TracebackType

    from contract.engines._progress import Stage, StepProgress

log = logging.getLogger(__name__)

__all__ = [
    "EngineExitedError",
    "EngineProcess",
    "cache_root",
    "engine_log_path",
    "file_lock",
    "free_port",
    "log_tail",
    "run_logged",
    "wait_ready",
]

#: Engine logs kept per name (older ones are deleted when a new one is made).
KEEP_LOGS = 20
#: A log touched this recently is never deleted: its engine may still be running.
_LOG_IN_USE_S = 3600.0


def cache_root() -> Path:
    """``~/.cache/canopyx``: engines, wheels and engine logs live under it."""
    return Path.home() / ".cache" / "canopyx"


def engine_log_path(name: str, port: int, *, keep: int = KEEP_LOGS) -> Path:
    """A new log file path for one engine run: ``<cache_root>/logs/<name>-<time>-<pid>-<port>.log``.

    Logs of ``name`` beyond the newest ``keep`` are deleted, unless touched in the last hour.
    """
    logs = cache_root() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    old = sorted(logs.glob(f"{name}-*.log"), key=_mtime, reverse=True)[max(keep - 1, 0) :]
    now = time.time()
    for path in old:
        if now - _mtime(path) > _LOG_IN_USE_S:
            path.unlink(missing_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return logs / f"{name}-{stamp}-{os.getpid()}-{port}.log"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when asked (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def log_tail(path: Path, *, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` of a log file, decoded leniently ('' if it is missing)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


class EngineExitedError(RuntimeError):
    """The engine process ended while it was expected to run."""


class EngineProcess:
    """A subprocess in its own process group, with stdout and stderr sent to a log file.

    ``stop()`` sends SIGTERM to the whole group, waits up to ``term_timeout_s``, then
    SIGKILLs the group. It is idempotent, and the object is a context manager.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        term_timeout_s: float = 10.0,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.term_timeout_s = term_timeout_s
        self._popen: subprocess.Popen[bytes] | None = None
        self._stopped = False

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise RuntimeError("process not started")
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code if the process has ended, else None (polls without blocking)."""
        if self._popen is None:
            return None
        return self._popen.poll()

    def start(self) -> EngineProcess:
        if self._popen is not None:
            raise RuntimeError("process already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s (log %s)", " ".join(self.argv), self.log_path)
        with self.log_path.open("ab") as out:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, max_bytes: int = 4000) -> str:
        return log_tail(self.log_path, max_bytes=max_bytes)

    def _signal_group(self, sig: signal.Signals) -> bool:
        """Signal the process group; False if it no longer exists."""
        assert self._popen is not None
        try:
            os.killpg(self._popen.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> int | None:
        """Stop the process group (SIGTERM, then SIGKILL). Returns the exit code."""
        popen = self._popen
        if popen is None or self._stopped:
            return None if popen is None else popen.returncode
        self._stopped = True
        if popen.poll() is None:
            log.info("stopping pid %d (SIGTERM to its group)", popen.pid)
        # The group may outlive its leader (children of a router), so signal it anyway.
        self._signal_group(signal.SIGTERM)
        try:
            popen.wait(timeout=self.term_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "pid %d ignored SIGTERM for %.1f s; SIGKILL", popen.pid, self.term_timeout_s
            )
            self._signal_group(signal.SIGKILL)
            popen.wait()
        else:
            # Leader is gone; make sure no straggler of its group survives.
            self._signal_group(signal.SIGKILL)
        return popen.returncode

    def __enter__(self) -> EngineProcess:
        if self._popen is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_ready(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    proc: EngineProcess | None = None,
    interval_s: float = 0.05,
    what: str = "engine",
) -> float:
    """Poll ``check`` until it returns True; return the seconds waited.

    Exceptions raised by ``check`` count as "not ready yet". If ``proc`` exits first,
    raise :class:`EngineExitedError` with its log tail; on timeout raise TimeoutError.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last_error: BaseException | None = None
    while True:
        if proc is not None and proc.returncode is not None:
            raise EngineExitedError(
                f"{what} exited with code {proc.returncode} before it was ready; "
                f"log tail ({proc.log_path}):\n{proc.log_tail()}"
            )
        try:
            if check():
                return time.monotonic() - start
        except Exception as exc:  # any failure means "not ready yet"
            last_error = exc
        if time.monotonic() >= deadline:
            tail = f"\nlog tail ({proc.log_path}):\n{proc.log_tail()}" if proc is not None else ""
            raise TimeoutError(
                f"{what} not ready after {timeout_s:.1f} s (last error: {last_error!r}){tail}"
            )
        time.sleep(interval_s)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for lock %s (held by another process)", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_logged(
    argv: Sequence[str | Path],
    *,
    log_path: Path,
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    progress: StepProgress | None = None,
    parse: Callable[[str], Stage | None] | None = None,
) -> None:
    """Run ``argv`` with stdout and stderr appended to ``log_path``.

    With ``progress``, each output line is also read by ``parse`` to show the stage it
    reports (the log still gets every byte). Raise RuntimeError with the log tail if the
    command exits non-zero.
    """
    args = [str(a) for a in argv]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab", buffering=0) as out:
        out.write(f"\n$ {shlex.join(args)}\n".encode())
        if progress is None:
            rc = subprocess.call(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
            )
        else:
            rc = _run_watched(args, out, progress, parse, env=env, cwd=cwd)
    if rc != 0:
        raise RuntimeError(
            f"{what} failed with exit code {rc}; log {log_path}, tail:\n{log_tail(log_path)}"
        )


def _run_watched(
    args: list[str],
    out: IO[bytes],
    progress: StepProgress,
    parse: Callable[[str], Stage | None] | None,
    *,
    env: dict[str, str] | None,
    cwd: Path | None,
) -> int:
    """Run ``args``, copying its output to ``out`` line by line and showing it on ``progress``.

    A reader thread copies and parses; this thread waits and ticks the display, so that
    plain-mode lines keep coming while the command prints nothing.
    """
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
    )
    stdout = proc.stdout
    assert stdout is not None

    def pump() -> None:
        for raw in stdout:
            out.write(raw)
            if parse is not None:
                progress.feed(raw.decode("utf-8", errors="replace"), parse)

    reader = threading.Thread(target=pump, name="run_logged-reader", daemon=True)
    reader.start()
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                progress.tick()
            else:
                break
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        reader.join(timeout=10.0)
        stdout.close()
    return rc


class ServerProcess(ABC):
    """An engine server as a context manager: started on entry, stopped by process group on exit.

    Subclasses set ``log_name`` and ``_log_path`` (None: a new file under the cache, see
    :meth:`log_path_for`), and ``port`` and ``_proc`` when they start."""

    log_name: ClassVar[str]
    port: int
    _proc: EngineProcess | None
    _log_path: Path | None

    def log_path_for(self, port: int) -> Path:
        """The log of a start on ``port``: the one given, else a new one under
        ``~/.cache/canopyx/logs`` (never loose in the system temp dir)."""
        return self._log_path or engine_log_path(self.log_name, port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def process(self) -> EngineProcess:
        if self._proc is None:
            raise RuntimeError("server not started")
        return self._proc

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def log_tail(self, max_bytes: int = 4000) -> str:
        return self.process.log_tail(max_bytes)

    def serve_until_signalled(self, name: str) -> int:
        """Print the base URL and serve until SIGTERM or SIGINT (0), or until the engine exits
        on its own (1). For the modules' ``up`` commands."""
        stop = threading.Event()

        def _on_signal(signum: int, _frame: object) -> None:
            log.info("signal %d: stopping", signum)
            stop.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        with self:
            print(self.base_url, flush=True)
            while not stop.wait(1.0):
                if not self.process.running():
                    log.error("%s exited:\n%s", name, self.log_tail())
                    return 1
        return 0

    @abstractmethod
    def start(self) -> Self: ...

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
