"""ULIDs: 48 bits of milliseconds and 80 random bits, in Crockford's base 32."""

from __future__ import annotations

import os
import time

__all__ = ["new_ulid"]

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]
"""Two digits for each 10-bit value: 13 lookups make the 26 digits."""
_SHIFTS = tuple(range(120, -1, -10))


def new_ulid(now_ms: int | None = None) -> str:
    """A new ULID (26 characters), sortable by creation time."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join([_PAIRS[(value >> s) & 1023] for s in _SHIFTS])
