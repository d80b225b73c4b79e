"""A request's prefix as routing facts: a chain of block fingerprints of what the engine reads
first, so that two requests share a leading run of fingerprints exactly when they share that
much of their prompt (up to a 64-bit collision).

The text fingerprinted is the canonical JSON (keys sorted, no spaces) of what an engine's
prompt begins with: for a chat request its ``tools`` (a chat template renders them first) and
its ``messages`` in order; for a decision its ``state``. Only the first `WINDOW_BYTES` count;
each full block of `BLOCK_BYTES` is hashed with xxh3 seeded by the hash before it, the first
seeded by the gateway's secret seed and the request's ``cache_salt``. Requests under different
salts therefore share no fingerprint at all, so routing never sends a prefix to where another
salt's copy is cached (the engines' isolation holds in routing too). The seed is random per
gateway run and shared with its workers: nobody outside can aim a request at a fingerprint.

xxh3 is not a cryptographic hash; a forged match could at worst move one request to another
instance of the same deployment (the engine's own cache is keyed by its own full hashes).
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
import xxhash

__all__ = [
    "BLOCK_BYTES",
    "MAX_BLOCKS",
    "WHOLE_BELOW",
    "WINDOW_BYTES",
    "fingerprints",
    "pack",
    "unpack",
]

BLOCK_BYTES = 256
"""Prompt bytes per fingerprint (about 60 tokens of English: four of vLLM's 16-token blocks)."""
MAX_BLOCKS = 256
"""Fingerprints per request at most: what routing weighs of a prompt is its first 64 KiB."""
WINDOW_BYTES = BLOCK_BYTES * MAX_BLOCKS

_SORTED = orjson.OPT_SORT_KEYS
_hash = xxhash.xxh3_64_intdigest


WHOLE_BELOW = 16 * WINDOW_BYTES
"""A body sent in fewer bytes than this has its prompt's parts written whole: each part's JSON
is then small, and orjson writes it faster than the window can be found in it."""


def fingerprints(
    body: dict[str, Any], *, chat: bool, salt: str | None, seed: int, sent: int | None = None
) -> tuple[int, ...]:
    """The fingerprint chain of ``body`` (a checked request body, ``sent`` bytes long where
    known): one per full block of its prompt's canonical JSON, within `WINDOW_BYTES`; empty for
    a prompt under one block."""
    text = _canonical(body, chat, whole=sent is not None and sent < WHOLE_BELOW)
    h = _hash(b"\x01" + salt.encode() if salt is not None else b"\x00", seed)
    chain = []
    view = memoryview(text)
    for start in range(0, len(text) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = _hash(view[start : start + BLOCK_BYTES], h)
        chain.append(h)
    return tuple(chain)


def _canonical(body: dict[str, Any], chat: bool, *, whole: bool) -> bytes:
    """The first `WINDOW_BYTES` (or fewer) of the prompt's canonical JSON. Each part is
    written on its own and the writing stops once the window is full; unless the body is
    small (``whole``), a part is first cut to what the window can hold of it (`_cut`)."""
    if not chat:
        parts: list[Any] = [body.get("state")]
    else:
        tools = body.get("tools")
        parts = [{"tools": tools}] if tools is not None else []
        parts.extend(body["messages"])  # checked already: a list
    out = bytearray()
    for part in parts:
        left = WINDOW_BYTES - len(out)
        if left <= 0:
            break
        out += orjson.dumps(part if whole else _cut(part, left)[0], option=_SORTED)
        out += b"\n"  # a separator no JSON value ends with: [a, b] never reads as [ab]
    return bytes(out[:WINDOW_BYTES])


def _cut(value: Any, left: int) -> tuple[Any, int]:
    """``value`` without what its canonical JSON holds past its first ``left`` bytes (those
    bytes are the same either way), and a lower bound of its JSON's length: at least ``left``
    when something was cut. A string longer than ``left`` is cut to ``left`` characters (each is
    a byte at least); a list or an object ends once what it holds reaches ``left`` bytes (a
    character of a key, a value, a comma: a byte each at least). Only what lies within the
    window is visited, however large the body: content written as parts (``[{"type": "text",
    "text": ...}]``) costs what a plain string does."""
    if left <= 0:
        return None, 1  # all of it lies past the window: any value stands in for it
    kind = type(value)
    if kind is str:
        return (value[:left], left + 2) if len(value) > left else (value, len(value) + 2)
    size = 1
    if kind is list:
        items: list[Any] = []
        for item in value:
            if size >= left:
                return items, size
            size += 1 if items else 0
            cut, n = _cut(item, left - size)
            items.append(cut)
            size += n
        return items, size + 1
    if kind is dict:
        members: dict[str, Any] = {}
        for key in sorted(value):  # as OPT_SORT_KEYS writes them
            if size >= left:
                return members, size
            size += len(key) + (4 if members else 3)  # "key": and the comma before it
            members[key], n = _cut(value[key], left - size)
            size += n
        return members, size + 1
    return value, 1


def pack(chain: tuple[int, ...]) -> str:
    """``chain`` as the worker line carries it: base64 of little-endian 64-bit words."""
    return base64.b64encode(struct.pack(f"<{len(chain)}Q", *chain)).decode("ascii")


def unpack(text: str) -> tuple[int, ...]:
    """The chain `pack` wrote; ValueError for anything else (a broken peer)."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 8 or len(raw) // 8 > MAX_BLOCKS:
        raise ValueError("a prefix chain is whole 64-bit words, at most MAX_BLOCKS of them")
    return struct.unpack(f"<{len(raw) // 8}Q", raw)
