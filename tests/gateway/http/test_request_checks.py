"""The request checks of chat, Responses and decisions over generated JSON: a valid request of
each API with any JSON value put at any of its fields (nested ones included), fields added and
fields taken away. Whatever is sent, the checks either take it or refuse it with a status and
code that ``docs/openapi.json`` documents for that path; nothing else is ever raised.

The pure checks (what the listener runs between reading a body and placing it: `resolve`, the
surface's checks, the engine's payload and the prefix fingerprints) run on thousands of bodies;
a smaller run goes through a gateway on a real socket in front of the fake engine, where no
answer is a 5xx and nothing is logged with a traceback.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl_gateway import GatewayConfig
from capyctl_gateway._errors import GatewayError
from capyctl_gateway._http.inference import CHAT, DECISIONS, RESPONSES, Surface
from capyctl_gateway._http.validate import (
    _LONG_DIGITS,
    _long_digits,
    check_salt,
    engine_payload,
    resolve,
)
from capyctl_gateway._routing.prefix import fingerprints
from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Reply, vllm_stream
from tests.gateway.openai_schemas import validate_response
from tests.gateway.responses.test_responses import events_of

ROOT = Path(__file__).resolve().parents[3]
OPENAPI = json.loads((ROOT / "docs" / "openapi.json").read_text())
CHECKS = (400, 404, 413)
"""The statuses a request's checks answer (the others come from the key, the queue, the
engine, or the listener before the body is read)."""


def documented(path: str, statuses: tuple[int, ...]) -> set[tuple[int, str]]:
    """Each (status, code) ``docs/openapi.json`` documents for ``POST path`` among
    ``statuses``."""
    out = set()
    answers = OPENAPI["paths"][path]["post"]["responses"]
    for status, answer in answers.items():
        if int(status) not in statuses:
            continue
        name = answer["$ref"].rsplit("/", 1)[-1]
        schema = OPENAPI["components"]["responses"][name]["content"]["application/json"]
        code = schema["schema"]["properties"]["code"]
        out |= {(int(status), c) for c in code.get("enum", [code.get("const")])}
    return out


def check_codes(path: str) -> set[tuple[int, str]]:
    """What the checks of ``path`` may refuse with: its documented 400, 404 and 413 answers,
    less the engine's own refusal."""
    return {(s, c) for s, c in documented(path, CHECKS) if c != "engine_rejected"}


# A valid request of each API that reaches every branch of its checks; the generator changes it.
CHAT_BODY: dict[str, Any] = {
    "model": "my-model",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ],
    "stream": False,
    "stream_options": {"include_usage": True},
    "n": 1,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "cache_salt": "tenant-a",
    "max_tokens": 16,
    "temperature": 0.5,
}
RESPONSES_BODY: dict[str, Any] = {
    "model": "my-model",
    "input": [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hi"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "phase": None,
            "content": [
                {"type": "output_text", "text": "ok", "annotations": [], "logprobs": []},
                {"type": "refusal", "refusal": "no"},
            ],
        },
        {
            "type": "function_call",
            "call_id": "c",
            "name": "f",
            "arguments": "{}",
            "id": "fc_1",
            "caller": {"type": "direct"},
            "async_": None,
        },
        {"type": "function_call_output", "call_id": "c", "output": "42"},
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_text", "text": "4"}],
        },
    ],
    "instructions": "Answer.",
    "tools": [
        {"type": "function", "name": "f", "description": "d", "parameters": {}, "strict": True}
    ],
    "tool_choice": {"type": "function", "name": "f"},
    "parallel_tool_calls": True,
    "max_output_tokens": 16,
    "temperature": 0.5,
    "top_p": 1,
    "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": True}},
    "reasoning": {"effort": "low", "summary": "auto"},
    "metadata": {"k": "v"},
    "stream": False,
    "store": False,
    "cache_salt": "tenant-a",
    "include": ["message.output_text.logprobs"],
    "top_logprobs": 2,
    "prompt_cache_key": "p",
    "truncation": "disabled",
    "user": "u",
    "previous_response_id": None,
}
DECISION_BODY: dict[str, Any] = {
    "model": "decider",
    "state": [{"role": "user", "content": "I was charged twice."}],
    "questions": {"q1": {"type": "noul", "instructions": "Refund?", "criteria": {}}},
    "images": ["data:image/png;base64,AA"],
    "files": [],
}
APIS = {
    "chat": (CHAT, CHAT_BODY),
    "responses": (RESPONSES, RESPONSES_BODY),
    "decisions": (DECISIONS, DECISION_BODY),
}

# Strings the checks look for, so that a generated value often takes a branch past the first.
WORDS = (
    "my-model", "llama", "decider", "user", "assistant", "system", "developer", "tool",
    "message", "function_call", "function_call_output", "reasoning", "item_reference",
    "input_text", "output_text", "refusal", "input_image", "input_file", "text", "function",
    "json_schema", "json_object", "auto", "none", "required", "low", "high", "disabled",
    "reasoning.encrypted_content", "message.output_text.logprobs", "commentary", "direct",
)  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(WORDS)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _paths(doc: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*at, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, (*at, i))


@st.composite
def mutated(draw: st.DrawFn, template: dict[str, Any]) -> Any:
    """``template`` with one to four changes: a value anywhere replaced by any JSON value, a
    field added to any object, or one taken away."""
    doc: Any = copy.deepcopy(template)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(list(_paths(doc))))
        value = draw(json_values)
        if not path:
            doc = value
            continue
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(("replace", "add", "drop")))
        if action == "replace":
            parent[path[-1]] = value
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(WORDS) | st.text(max_size=8))] = value
        elif action == "drop":
            del parent[path[-1]]
    return doc


CONFIG = GatewayConfig.model_validate(
    {
        "deployments": [
            deployments("http://127.0.0.1:9", instances=[{"url": "http://127.0.0.1:9"}] * 2),
            deployments(
                "http://127.0.0.1:9", name="llama", engine="llamacpp", engine_version="b10798"
            ),
            deployments(
                "http://127.0.0.1:9",
                name="decider",
                api="decisions",
                engine="tensorfold",
                engine_version="0.6.1",
            ),
        ]
    },
    context={"devices": Path("/nonexistent-capyctl-devices")},
)


def encode(body: Any) -> bytes:
    """``body`` as a client writes it (integers of any size written out)."""
    return json.dumps(body).encode()


def run_checks(surface: Surface, raw: bytes) -> None:
    """What the listener does with a body once read, up to placing the request: the shared
    checks, the surface's, the engine's payload, and the prefix fingerprints."""
    body, dep = resolve(raw, CONFIG, surface.api, surface.endpoint)
    body, stream, _ = surface.check(body, dep)
    check_salt(body, dep, in_band=stream)
    engine_payload(body, dep, chat=surface.api is CHAT.api, stream=stream)
    salt = body.get("cache_salt")
    fingerprints(body, chat=surface is not DECISIONS, salt=salt, seed=7)


@pytest.mark.parametrize("api", list(APIS))
def test_the_checks_take_any_json_or_refuse_it_as_documented(api: str) -> None:
    surface, template = APIS[api]
    allowed = check_codes(surface.endpoint)
    run_checks(surface, orjson.dumps(template))  # the template itself is served

    @settings(max_examples=1000, deadline=None, derandomize=True)
    @given(body=mutated(template))
    def check(body: Any) -> None:
        try:
            run_checks(surface, encode(body))
        except GatewayError as err:
            assert (err.status, err.code) in allowed, err
            assert len(err.message) <= 1024, err

    check()


E2E = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.anyio
@pytest.mark.parametrize("api", list(APIS))
async def test_a_gateway_answers_any_json_as_documented_and_logs_no_traceback(
    api: str, gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a gateway on a real socket (the fake engine answering whatever reaches it):
    no 5xx, each refusal a documented status and code, nothing logged with a traceback."""
    surface, template = APIS[api]
    caplog.set_level(logging.DEBUG)
    engine.script = vllm_stream()
    engine.decision = Reply(200, b'{"answers": {}, "model": "tiny", "usage": {}}')
    allowed = documented(surface.endpoint, (400, 404, 413))

    @E2E
    @given(body=mutated(template))
    def check(body: Any) -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            r = c.post(
                surface.endpoint,
                content=encode(body),
                headers={"Authorization": f"Bearer {gateway.key}"},
            )
            r.read()
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert (r.status_code, r.json()["code"]) in allowed, r.text
        elif surface is RESPONSES:  # what it echoes of the request is OpenAI's shape too
            if r.headers["content-type"].startswith("application/json"):
                validate_response(r.json())
            else:
                events_of(r.text)

    await anyio.to_thread.run_sync(check)
    traced = [
        r.getMessage()
        for r in caplog.records
        if r.exc_info or "Traceback" in r.getMessage() or "gateway failed" in r.getMessage()
    ]
    assert traced == []


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"role": ["user"], "content": "x"}, "input[0].role must be"),
        ({"role": {"user": 1}, "content": "x"}, "input[0].role must be"),
        ({"role": "user", "content": [{"type": ["input_text"]}]}, "content[0].type must be"),
        ({"role": "user", "content": [{"type": {}, "text": "x"}]}, "content[0].type must be"),
        ({"type": ["message"], "role": "user", "content": "x"}, "input[0].type must be"),
    ],
)
def test_a_role_or_type_that_is_no_string_is_invalid(item: dict[str, Any], words: str) -> None:
    """They were looked up in a dict as they were: a list or an object raised TypeError (500,
    and a traceback in the log)."""
    body = {"model": "my-model", "input": [item]}
    with pytest.raises(GatewayError) as refused:
        run_checks(RESPONSES, encode(body))
    assert (refused.value.status, refused.value.code) == (400, "invalid_request")
    assert words in refused.value.message


LONG = "x" * 100_000


@pytest.mark.parametrize(
    ("surface", "body"),
    [
        (CHAT, {**CHAT_BODY, LONG: 1}),
        (DECISIONS, {**DECISION_BODY, LONG: 1}),
        (RESPONSES, {**RESPONSES_BODY, LONG: 1}),
        (CHAT, {**CHAT_BODY, "model": LONG}),
        (RESPONSES, {"model": "my-model", "input": [{"type": LONG}]}),
        (RESPONSES, {"model": "my-model", "input": [{"role": "user", LONG: 1}]}),
        (
            RESPONSES,
            {"model": "my-model", "input": [{"role": "user", "content": [{"type": LONG}]}]},
        ),
        (RESPONSES, {"model": "my-model", "input": "x", "tools": [{"type": LONG}]}),
        (RESPONSES, {"model": "my-model", "input": "x", "tools": [{"type": "function", LONG: 1}]}),
        (
            RESPONSES,
            {"model": "my-model", "input": "x", "tool_choice": {"type": "function", "name": LONG}},
        ),
        (
            RESPONSES,
            {
                "model": "my-model",
                "input": "x",
                "tool_choice": {"type": "function", "name": [LONG]},
            },
        ),
    ],
)
def test_a_refusal_quotes_little_of_what_was_sent(surface: Surface, body: dict[str, Any]) -> None:
    """A refusal names what it refuses, cut short: a 100,000-character field name, model or
    type is not sent back (nor logged) whole."""
    with pytest.raises(GatewayError) as refused:
        run_checks(surface, encode(body))
    assert refused.value.status in (400, 404)
    assert len(refused.value.message) < 300, refused.value.message[:100]


@settings(max_examples=500, deadline=None)
@given(
    st.binary(max_size=80)
    | st.lists(
        st.text(alphabet="0123456789", min_size=15, max_size=23) | st.sampled_from(["-", " ", "x"]),
        max_size=6,
    ).map(lambda parts: "".join(parts).encode())
)
def test_the_quick_look_for_long_digits_finds_what_the_expression_finds(raw: bytes) -> None:
    """`_long_digits` looks for a run of 19 digits before it runs `_LONG_DIGITS`: what it
    answers is the expression's, on any bytes and on runs of digits about that long, signed
    or not (it fails when the quick look wants 20 digits or 21)."""
    assert _long_digits(raw) == (_LONG_DIGITS.search(raw) is not None)
