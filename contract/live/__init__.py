"""Tests against real engines on this machine (marked ``live``)."""

from __future__ import annotations

import os
import select
from typing import Any

import httpx
import orjson

__all__ = ["gone", "streamed_chunks"]


def gone(pid: int, within: float = 60) -> bool:
    """Whether process ``pid`` is gone, waiting up to ``within`` s (a pidfd turns readable
    when the process exits: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within)[0])
    finally:
        os.close(fd)


async def streamed_chunks(base_url: str) -> list[dict[str, Any]]:
    """One 12-token streamed chat answer with usage, straight from the engine: its chunks,
    after checking that the stream ends in ``data: [DONE]``."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(base_url + "/v1/chat/completions", json=body)
    assert r.text.rstrip().endswith("data: [DONE]")
    return [
        orjson.loads(line[6:])
        for line in r.text.split("\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
