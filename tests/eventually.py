"""One way for a test to wait for a fact that no event announces (a socket's state, a count in
another object, a log line, another process): `eventually` polls it, within a deadline.

Where the code under test announces a change (a transition observer, a collector event, a
future), wait on that instead: a poll is for what nothing announces.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import anyio

__all__ = ["eventually"]

T = TypeVar("T")
EVERY_S = 0.01


@overload
async def eventually(
    check: Callable[[], Awaitable[T | None]], *, within: float = 10, every: float = EVERY_S
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T | None], *, within: float = 10, every: float = EVERY_S
) -> T: ...


async def eventually(
    check: Callable[[], Any], *, within: float = 10, every: float = EVERY_S
) -> Any:
    """Ask ``check`` (a function, or a coroutine function) every ``every`` seconds until its
    answer is true; that answer. Raises TimeoutError after ``within`` seconds."""
    with anyio.fail_after(within):
        while True:
            got = check()
            if inspect.isawaitable(got):
                got = await got
            if got:
                return got
            await anyio.sleep(every)
