"""The Messages API and prefix routing, in one process and with two workers: a Messages request
is fingerprinted as the chat request it becomes, so it goes where chat sent the same prefix (and
the other way round), and its router line says so. Claude Code's billing line, which changes
with every request, is no part of the prefix."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.conftest import FAKES, WORKERS
from tests.gateway.fake_engine import FakeEngine, vllm_stream
from tests.gateway.routing.test_prefix_routing import (
    SYSTEM,
    MakeGateway,
    chat,
    pair,
    sampled_gateway,
    selections,
)

workers = WORKERS
fakes = FAKES
pytestmark = pytest.mark.anyio
__all__ = ["pair"]  # the fixture, used here too
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def message(tenant: str, turn: str, cch: str) -> dict[str, Any]:
    system = [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};"},
        {"type": "text", "text": SYSTEM[tenant]},
    ]
    messages = [{"role": "user", "content": turn}]
    return {"model": "my-model", "max_tokens": 8, "system": system, "messages": messages}


async def test_messages_go_where_chat_sent_their_prefix(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    for engine in pair:
        engine.script = vllm_stream(usage=USAGE)
    gw = await sampled_gateway(make_gateway, pair, caplog)
    async with gw.client() as c:
        for tenant in SYSTEM:
            r = await c.post("/v1/chat/completions", json=chat(tenant, "question 0"))
            assert r.status_code == 200, r.text
        for turn in range(2):
            for tenant in SYSTEM:
                body = message(tenant, f"question {turn + 1}", cch=f"{turn}{tenant}")
                r = await c.post("/v1/messages", json=body)
                assert r.status_code == 200, r.text
    picks = selections(caplog)
    assert len(picks) == 9
    first = {tenant: picks[i]["instance"] for i, tenant in enumerate(SYSTEM)}
    for n, pick in enumerate(picks[3:]):
        tenant = list(SYSTEM)[n % 3]
        assert pick["why"] == "prefix" and pick["instance"] == first[tenant], pick
        chosen = next(c for c in pick["candidates"] if c["instance"] == pick["instance"])
        assert chosen["matched_blocks"] >= 10
