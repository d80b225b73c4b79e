"""The Messages API's checks over generated JSON, as chat's, Responses' and decisions' are
held in ``tests/gateway/http/test_request_checks.py``: a valid Message request (and a
``count_tokens`` one) with any JSON value put at any of its fields, fields added and fields
taken away. The checks take it or refuse it with a status Anthropic's shape has a type for
(400, 404, 413), never anything else; through a gateway on a real socket no answer is a 5xx,
each refusal is Anthropic's error object with its status's type, each Message served holds to
the SDK's types, and nothing is logged with a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capyctl_gateway._errors import GatewayError
from capyctl_gateway._http.messages import COUNT_TOKENS, MESSAGES
from capyctl_gateway._messages.errors import ERROR_TYPES, error_type
from tests.gateway.anthropic_types import (
    sse_events,
    validate_count,
    validate_error,
    validate_message,
)
from tests.gateway.conftest import Gw
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.http.test_request_checks import (
    E2E,
    WORDS,
    encode,
    json_values,
    mutated,
    run_checks,
)
from tests.gateway.messages.test_messages import script

MESSAGE_BODY: dict[str, Any] = {
    "model": "my-model",
    "max_tokens": 64,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "sun"}],
                    "is_error": False,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
    "tools": [
        {
            "name": "weather",
            "description": "d",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
    "thinking": {"type": "disabled"},
    "stop_sequences": ["END"],
    "metadata": {"user_id": "u"},
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "stream": False,
    "cache_salt": "tenant-a",
}
COUNT_BODY = {
    k: v
    for k, v in MESSAGE_BODY.items()
    if k in ("model", "system", "messages", "tools", "tool_choice", "thinking")
}
APIS = {"messages": (MESSAGES, MESSAGE_BODY), "count_tokens": (COUNT_TOKENS, COUNT_BODY)}


@st.composite
def shallow(draw: st.DrawFn, template: dict[str, Any]) -> dict[str, Any]:
    """``template`` with one of its own fields replaced by any JSON value (or taken away, or a
    field added): ``mutated`` picks among every path, and a Message's blocks hold most of
    them, so its top-level fields would seldom change alone (a top-level field of the wrong
    type was reached about 5 times in 1,000 bodies)."""
    doc = dict(template)
    action = draw(st.sampled_from(("replace", "replace", "replace", "replace", "drop", "add")))
    if action == "add":
        doc[draw(st.sampled_from(WORDS) | st.text(max_size=8))] = draw(json_values)
        return doc
    key = draw(st.sampled_from(list(template)))
    if action == "drop":
        del doc[key]
    else:
        doc[key] = draw(json_values)
    return doc


def bodies(template: dict[str, Any]) -> st.SearchStrategy[Any]:
    return st.one_of(mutated(template), shallow(template))


CHECKS = (400, 404, 413)
"""What a request's checks answer: each has a type of its own in Anthropic's shape."""


@pytest.mark.parametrize("api", list(APIS))
def test_the_checks_take_any_json_or_refuse_it_with_a_status_anthropic_names(api: str) -> None:
    surface, template = APIS[api]
    run_checks(surface, orjson.dumps(template))  # the template itself is served
    refused: set[int] = set()

    @settings(max_examples=1000, deadline=None, derandomize=True)
    @given(body=bodies(template))
    def check(body: Any) -> None:
        try:
            run_checks(surface, encode(body))
        except GatewayError as err:
            assert err.status in CHECKS, err
            assert error_type(err.status) == ERROR_TYPES[err.status]
            assert len(err.message) <= 1024, err
            refused.add(err.status)

    check()
    assert 400 in refused  # the generator reaches the field checks


@pytest.mark.anyio
@pytest.mark.parametrize("api", list(APIS))
async def test_a_gateway_answers_any_json_in_anthropics_shape_and_logs_no_traceback(
    api: str, gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a gateway on a real socket, the fake engine answering what reaches it."""
    surface, template = APIS[api]
    caplog.set_level(logging.DEBUG)
    engine.script = script({"content": "Sunny."})
    answered: set[int] = set()

    @E2E
    @given(body=bodies(template))
    def check(body: Any) -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            r = c.post(surface.endpoint, content=encode(body), headers={"x-api-key": gateway.key})
            r.read()
        assert r.status_code < 500, r.text
        answered.add(r.status_code)
        if r.status_code != 200:
            doc = r.json()
            validate_error(doc)
            assert doc["error"]["type"] == ERROR_TYPES[r.status_code], r.text
        elif surface is COUNT_TOKENS:
            validate_count(r.json())
        elif r.headers["content-type"].startswith("application/json"):
            validate_message(r.json())
        else:
            events, _ = sse_events(r.text)  # each event held to its type
            assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"

    await anyio.to_thread.run_sync(check)
    assert 200 in answered and 400 in answered
    traced = [
        r.getMessage()
        for r in caplog.records
        if r.exc_info or "Traceback" in r.getMessage() or "gateway failed" in r.getMessage()
    ]
    assert traced == []
