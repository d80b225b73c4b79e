"""The running event loop, without a system call (hot path).

On Python 3.11, ``asyncio.get_running_loop()`` calls ``getpid()`` on every call to notice a
loop inherited across ``fork`` (3.12 dropped the check), and ``asyncio.current_task()``,
``asyncio.ensure_future`` and ``asyncio.timeout`` call it in turn. Under load, the gateway's
own calls were about 10 ``getpid`` system calls per request and 5-7% of its CPU (py-spy
``--native``, strace; ``docs/performance.md``). `running_loop` asks asyncio once per thread
and keeps the answer while that loop runs.

Its one assumption: a loop found running from a thread is the one running in that thread,
which holds unless a loop is stopped and run again in another thread while the first thread
runs a loop of its own. The gateway runs one loop in one thread, and never forks a Python
process (engines start through ``exec``); the cache is dropped in a forked child anyway.
"""

from __future__ import annotations

import asyncio
import os
import threading

__all__ = ["running_loop"]

_get_ident = threading.get_ident
_cached: tuple[int, asyncio.AbstractEventLoop] | None = None


def running_loop() -> asyncio.AbstractEventLoop:
    """The event loop running in this thread (`RuntimeError` outside one), as
    ``asyncio.get_running_loop()``."""
    global _cached
    cached = _cached
    if cached is not None and cached[0] == _get_ident() and cached[1].is_running():
        return cached[1]
    loop = asyncio.get_running_loop()
    _cached = (_get_ident(), loop)
    return loop


def _forget() -> None:
    global _cached
    _cached = None


os.register_at_fork(after_in_child=_forget)
