"""The Messages API end to end, beside chat: the same gateway, the same fake engine and the same
question, asked of ``POST /v1/chat/completions`` and of ``POST /v1/messages`` in turn, with the
gateway's CPU per request read from ``/proc`` around each window (the SSE client, 32 concurrent),
as ``responses_e2e`` measures the Responses API (its harness, run for the Messages API).

`bench.perf.messages_cost` times the translation alone, per chunk; this is what a request costs
through everything: aiohttp, the key and Anthropic's headers, the checks, the engine exchange
and the events written. The two APIs take turns within each round (which goes first
alternates); the ratio is the median over rounds of each round's pair.

Run from the repository root: ``.venv/bin/python -m bench.perf.messages_e2e [--rounds 5]
[--duration 5] [--json FILE]``. It prints a markdown table and stops everything it started.
"""

from __future__ import annotations

import sys

import httpx

from ._loads import Target
from ._procs import StartupError
from .responses_e2e import compare

__all__ = ["main"]

APIS = ("chat", "messages")


def _check(t: Target) -> None:
    """One question each way, answered whole: the load measures answers, not refusals."""
    headers = {"Authorization": f"Bearer {t.key}"}
    chat = httpx.post(
        f"{t.url}/v1/chat/completions",
        json={"model": t.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers=headers,
        timeout=10,
    )
    message = httpx.post(
        f"{t.url}/v1/messages",
        json={"model": t.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"x-api-key": t.key or "", "anthropic-version": "2023-06-01"},
        timeout=10,
    )
    if chat.status_code != 200 or message.status_code != 200:
        raise StartupError(
            f"chat {chat.status_code}, messages {message.status_code}: {message.text}"
        )
    doc = message.json()  # the fake engine stops at max_tokens, as chat's "length"
    if doc["stop_reason"] != "max_tokens" or not doc["content"]:
        raise StartupError(f"the Message is not whole: {message.text}")


def main(argv: list[str] | None = None) -> int:
    return compare(argv, APIS, _check, prog="python -m bench.perf.messages_e2e", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
