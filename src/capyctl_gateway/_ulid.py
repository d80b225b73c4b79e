"""ULIDs: 48 bits of milliseconds and 80 random bits, in Crockford's base 32.

The random bits come from ``os.urandom`` 4 KiB at a time (one ``getrandom`` system call per
409 IDs instead of one per ID: a request ID is made for every request). A forked child drops
what its parent had drawn, so two processes never hand out the same bits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

__all__ = ["REQUEST_ID", "new_short_ids", "new_ulid"]

REQUEST_ID = "X-CapyCTL-Request-Id"
"""The header that carries the gateway's own ID of a request, on every answer."""

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]
"""Two digits for each 10-bit value: 13 lookups make the 26 digits."""
_SHIFTS = tuple(range(120, -1, -10))
_DRAW = 4096
_pool = b""
_at = 0


def _random80() -> int:
    global _pool, _at
    at = _at
    if at + 10 > len(_pool):
        _pool, at = os.urandom(_DRAW), 0
    _at = at + 10
    return int.from_bytes(_pool[at : at + 10], "big")


def _forget() -> None:
    global _pool, _at
    _pool, _at = b"", 0


os.register_at_fork(after_in_child=_forget)


def new_ulid(now_ms: int | None = None) -> str:
    """A new ULID (26 characters), sortable by creation time."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | _random80()
    return "".join([_PAIRS[(value >> s) & 1023] for s in _SHIFTS])


def new_short_ids(names: Iterable[str], taken: Iterable[str] = ()) -> dict[str, str]:
    """A short ID (12 characters: a ULID's time and two random digits) for each name, none
    equal to another or to one ``taken``."""
    seen = set(taken)
    out: dict[str, str] = {}
    for name in names:
        short = new_ulid()[:12]
        while short in seen:  # made in the same millisecond as another: draw again
            short = new_ulid()[:12]
        seen.add(short)
        out[name] = short
    return out
