"""A launched engine's output, kept bounded: a fresh set of files per run, rotated by size,
owner-only, and the files of the last few runs kept.

The engine (and its reaper) write to a pipe; a thread of the gateway reads it and writes the
files, so the engine never waits on the disk or on the gateway's event loop, and a chatty engine
cannot fill the disk. Each run is numbered: ``<stem>.<run>.log`` is its newest part, and
``.log.1`` up to ``.log.<files - 1>`` its older ones (the oldest part is dropped past that, as
``logging.handlers.RotatingFileHandler`` does). Starting a run deletes the files of all but the
last ``runs - 1`` runs before it. Every file is created mode 0600: an engine prints its
arguments, keys included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .._config.parts import EngineLogs
from .._log import masked

__all__ = ["EngineLog", "ShownLog", "file_stem"]

_PLAIN = re.compile(r"[A-Za-z0-9_-]|(?<!^)\.")
"""What a file name keeps as it is: letters, digits, ``_``, ``-``, and a dot not at its start."""
MAX_STEM = 160
"""A stem longer than this is cut and told apart by a digest (a file name has 255 bytes)."""


def file_stem(name: str, index: int) -> str:
    """The stem of instance ``index`` of deployment ``name``'s log files: one file name inside
    the log directory whatever the name holds (a model ID's ``/``, ``..``, spaces, any
    character): each other byte is written ``%XX``, so two names never share a stem."""
    out = "".join(
        c if _PLAIN.match(name, i) else "".join(f"%{b:02X}" for b in c.encode())
        for i, c in enumerate(name)
    )
    if len(out) > MAX_STEM:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        out = f"{out[:MAX_STEM]}~{digest}"
    return f"{out}-{index}"


CHUNK = 1 << 16
DRAIN_S = 1.0
"""How long a stopped or failed engine's last output may take to reach its file."""


class EngineLog:
    """The files of one instance's engine runs, and the thread that fills the current run's."""

    def __init__(self, directory: Path, stem: str, policy: EngineLogs) -> None:
        self._dir = directory
        self._stem = stem
        self._policy = policy
        self._lock = threading.Lock()
        self._fd = -1
        self._size = 0
        self._parts = 0
        """Files the current run has had (its first, then one per rotation)."""
        self.run = 0
        self.dropped = 0
        """Bytes read but not written (the disk refused them)."""
        self._closed: asyncio.Future[None] | None = None

    @property
    def path(self) -> Path:
        """The current run's newest part."""
        return self._part(0)

    def _part(self, n: int) -> Path:
        suffix = f".{n}" if n else ""
        return self._dir / f"{self._stem}.{self.run}.log{suffix}"

    def open(self) -> None:
        """Begin a new run: prune the old runs and create the run's first file."""
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run = _prune(self._dir, self._stem, self._policy.runs - 1) + 1
        self._fd = _create(self.path)
        self._size = 0
        self._parts = 1

    def follow(self, read_fd: int) -> None:
        """Copy what arrives on ``read_fd`` into the run's files until its last writer closes
        it, on a thread of its own (it owns ``read_fd`` from now on)."""
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        self._closed = closed

        def done() -> None:
            if not closed.done():
                closed.set_result(None)

        def pump() -> None:
            try:
                while data := os.read(read_fd, CHUNK):
                    self._write(memoryview(data))
            except OSError:
                pass
            finally:
                os.close(read_fd)
                self.close()
                with contextlib.suppress(RuntimeError):  # the loop closed first: nobody waits
                    loop.call_soon_threadsafe(done)

        threading.Thread(target=pump, name=f"engine log {self._stem}", daemon=True).start()

    def close(self) -> None:
        """Close the run's file (the pipe's thread does, at its end)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    async def drained(self, within: float = DRAIN_S) -> bool:
        """Wait until every writer has closed the pipe and its output is on disk (a child that
        escaped the engine's process group may hold it open: then up to ``within``)."""
        if self._closed is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), within)
        except TimeoutError:
            return False
        return True

    def _write(self, data: memoryview) -> None:
        cap = self._policy.file_size
        with self._lock:
            try:
                while data:
                    if self._size >= cap or self._fd < 0:
                        self._rotate()
                    piece = data[: cap - self._size]
                    while piece:
                        n = os.write(self._fd, piece)
                        self._size += n
                        data, piece = data[n:], piece[n:]
            except OSError:  # the disk refused it: drop it rather than make the engine wait
                self.dropped += len(data)

    def _rotate(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for n in range(self._policy.files - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self._part(n - 1), self._part(n))
        self._fd = _create(self.path)
        self._size = 0
        self._parts += 1

    def tail(self, max_bytes: int = 2000) -> str:
        """The run's last whole lines within its last ``max_bytes`` of output (from its newest
        two parts)."""
        return self._tail(max_bytes).decode("utf-8", "replace")

    def lines(self, count: int, max_bytes: int) -> list[str]:
        """The run's last ``count`` whole lines, within its last ``max_bytes`` of output."""
        raw = self._tail(max_bytes)
        return raw.decode("utf-8", "replace").splitlines()[-count:] if count > 0 else []

    def _tail(self, max_bytes: int) -> bytes:
        """The whole lines within the last ``max_bytes`` of this log's current run, from its newest
        two parts. Unless the read began at the run's first byte, what comes before its first
        newline is left out: a line cut there (by ``max_bytes``, or by a rotation, which cuts at a
        byte count) could show part of a key that no mask would recognise."""
        with self._lock:
            out = b""
            whole = False
            for n in range(min(self._policy.files, 2)):
                try:
                    with self._part(n).open("rb") as f:
                        f.seek(0, os.SEEK_END)
                        start = max(0, f.tell() - (max_bytes - len(out)))
                        f.seek(start)
                        out = f.read() + out
                except OSError:
                    break
                whole = start == 0 and n == self._parts - 1  # from the first byte of its first file
                if whole or len(out) >= max_bytes:
                    break
        return out if whole else out.partition(b"\n")[2]


@dataclass(frozen=True)
class ShownLog:
    """A run's log as the console shows it: its lines masked as a failed start's excerpt is
    (``secrets``, and any value after a name that says key, token, secret or password)."""

    log: EngineLog
    secrets: list[str]

    async def lines(self, count: int, max_bytes: int) -> list[str]:
        read = await asyncio.to_thread(self.log.lines, count, max_bytes)  # files: off the loop
        return [masked(line, self.secrets) for line in read]


def _create(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an earlier gateway keeps its mode otherwise
    return fd


def _prune(directory: Path, stem: str, keep: int) -> int:
    """Delete the files of all but the last ``keep`` runs of ``stem``; the last run's number
    (0 for none)."""
    pattern = re.compile(re.escape(stem) + r"\.(\d+)\.log(?:\.\d+)?")
    runs: dict[int, list[Path]] = {}
    for entry in directory.iterdir():
        m = pattern.fullmatch(entry.name)
        if m is not None:
            runs.setdefault(int(m.group(1)), []).append(entry)
    for old in sorted(runs)[: max(len(runs) - keep, 0)]:
        for f in runs[old]:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
    return max(runs, default=0)
