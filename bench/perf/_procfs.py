"""What the runner and the SSE client read from ``/proc``: CPU time, peak RSS, session members."""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["TICK_S", "cpu_seconds", "peak_rss_kib", "rss_kib", "session_pids"]

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pids: Iterable[int]) -> float:
    """utime + stime of all threads of ``pids`` (processes that are gone count 0)."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
    return ticks * TICK_S


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def peak_rss_kib(pid: int) -> int | None:
    """VmHWM: the process's peak resident set so far."""
    return _status_kib(pid, "VmHWM:")


def rss_kib(pid: int) -> int | None:
    return _status_kib(pid, "VmRSS:")


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a process started with start_new_session=True
    leads its own session, and its children stay in it)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None and int(fields[3]) == sid:  # field 6 of stat(5): session
            out.append(int(name))
    return sorted(out)


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; only its exit status is left)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"
