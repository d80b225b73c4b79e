"""The OpenAPI document of the public listener, held to a live gateway in front of the fake engine.

schemathesis generates requests from ``docs/openapi.json`` for every operation, valid ones and
invalid ones, sends them to a gateway started by this suite's fixtures, and checks each answer
against the document (status, media type, headers, body schema, and that the key is enforced).
Beside that, each answer must carry ``X-CapyCTL-Request-Id``, hand back a valid
``X-Request-Id``, and be no 500 but ``activation_failed`` (which these ``url`` deployments never
give). A fixed set of requests (the documented examples, each answer that matters) goes first,
so that those answers are checked whatever is generated. The generation is bounded (examples per
operation) and derandomized: the same code sends the same requests (Hypothesis also draws
constants from the source modules loaded, so a run of this file alone and of the whole suite
may differ, each the same every time).

Until ``_http/app.py`` registers ``GET /openapi.json``, the autouse fixture below adds the route
to each gateway the fixtures build; once it is registered there it adds nothing.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import requests
import schemathesis
from aiohttp import web
from anyio import to_thread
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from capyctl_gateway import GATEWAY_KEY, GatewayConfig
from capyctl_gateway import create_app as real_create_app
from capyctl_gateway._http.openapi import OPENAPI_DOCUMENT, openapi_handler
from tests.gateway import conftest
from tests.gateway.conftest import Gw
from tests.gateway.fake_engine import FakeEngine, Reply, vllm_stream

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[3]
DOCS_COPY = ROOT / "docs" / "openapi.json"
PACKAGED = ROOT / "src" / "capyctl_gateway" / "openapi.json"

Operation = schemathesis.APIOperation[Any, Any, Any, Any]
Case = schemathesis.Case[Any]
OPERATIONS = [
    ("/v1/models", "GET"),
    ("/v1/models/{model}", "GET"),
    ("/openapi.json", "GET"),
    ("/v1/chat/completions", "POST"),
    ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"),
    ("/v1/systemone", "POST"),
    ("/v1/messages", "POST"),
    ("/v1/messages/count_tokens", "POST"),
]
"""Every operation of the document, as (path, method)."""

MAX_EXAMPLES = 30
"""Generated requests per operation and generation mode (valid, invalid)."""
STREAMED_EXAMPLES = 10
"""Generated chat requests that ask for a stream (they take the longest to generate)."""
CHAT_MODELS = ["my-model", "llama", "decider"]
"""What the aimed copy sends as a chat ``model``: both chat deployments, and a decisions one."""
DECISION_MODELS = ["decider", "my-model"]
ULID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
CALLER_ID = re.compile(r"[!-~]{1,128}")
CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    ignored_auth,
]
"""schemathesis' conformance checks, and its check that the key is enforced. Not
``negative_data_rejection``: the gateway checks the fields it acts on and leaves the others to
the engine (whose refusal is ``engine_rejected``), and the fake engine refuses nothing. Not
``positive_data_acceptance``: a valid request for a model no deployment has is a 404."""


@pytest.fixture(autouse=True)
def openapi_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gateways built by the fixtures serve ``GET /openapi.json`` (a no-op once app.py does)."""

    def create_app(config: GatewayConfig, api_key: str, **kw: Any) -> web.Application:
        app = real_create_app(config, api_key, **kw)
        if not any(r.canonical == "/openapi.json" for r in app.router.resources()):
            app.router.add_get("/openapi.json", openapi_handler(app[GATEWAY_KEY]))
        return app

    monkeypatch.setattr(conftest, "create_app", create_app)


def _document() -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(DOCS_COPY.read_bytes())
    return doc


def test_docs_copy_is_the_packaged_document() -> None:
    assert DOCS_COPY.read_bytes() == PACKAGED.read_bytes()
    assert orjson.loads(OPENAPI_DOCUMENT) == _document()


def test_document_is_valid_openapi_3_1() -> None:
    doc = _document()
    assert doc["openapi"] == "3.1.0"
    schema = schemathesis.openapi.from_dict(doc, config=schemathesis.Config())
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    documented = {(path, method.upper()) for path, item in doc["paths"].items() for method in item}
    assert documented == set(OPERATIONS)
    for label, operation in _operations(doc).items():
        security = operation.definition.raw.get("security", doc["security"])
        if label in (MESSAGES, COUNT):  # Anthropic's clients send the key as x-api-key
            assert security == [{"bearerKey": []}, {"apiKey": []}]
        else:
            assert security == [{"bearerKey": []}]


async def test_served_document_is_the_file(gateway: Gw) -> None:
    async with gateway.client() as c:
        r = await c.get("/openapi.json", headers={"X-Request-Id": "doc-1"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert ULID.fullmatch(r.headers["x-capyctl-request-id"])
    assert r.headers["x-request-id"] == "doc-1"
    assert r.json() == _document()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic " + "k" * 43},
    ],
    ids=["missing", "wrong", "not-bearer"],
)
async def test_document_needs_the_key(gateway: Gw, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        r = await c.get("/openapi.json", headers={**headers, "X-Request-Id": "doc-2"})
    assert r.status_code == 401
    assert r.json() == {"code": "unauthorized", "message": "missing or invalid api key"}
    assert ULID.fullmatch(r.headers["x-capyctl-request-id"])
    assert r.headers["x-request-id"] == "doc-2"


async def test_document_refuses_a_bad_request_id(gateway: Gw) -> None:
    async with gateway.client() as c:
        r = await c.get("/openapi.json", headers={"X-Request-Id": "has space"})
    assert r.status_code == 400
    assert r.json()["code"] == "invalid_request"
    assert "x-request-id" not in r.headers


@pytest.mark.timeout(180)  # generating the cases is CPU-bound: 10-20 s, beside other tests more
async def test_gateway_conforms_to_its_document(engine: FakeEngine, gateway: Gw) -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    metrics = {"queue_time_ms": 0.5, "time_to_first_token_ms": 2.0, "mean_itl_ms": 1.0}
    engine.script = vllm_stream(usage=usage, metrics=metrics)
    engine.decision = Reply(200, orjson.dumps(DECISION_ANSWER))
    doc = _document()
    problems = await to_thread.run_sync(_fuzz, doc, gateway.url, gateway.key)
    assert not problems, "\n\n".join(problems)


DECISION_ANSWER = {
    "answers": {"angry": {"noul": 0.6226, "type": "noul"}},
    "model": "tiny",
    "usage": {"input_tokens": 87, "output_tokens": 0},
}
HELLO = [{"role": "user", "content": "Hello"}]
ASK = {"model": "my-model", "max_tokens": 16, "messages": HELLO}
DECISION = {
    "model": "decider",
    "state": "I was charged twice for my order last week.",
    "questions": {
        "route": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {"billing": "payments and refunds", "shipping": None, "technical": None},
        },
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this?",
            "criteria": ["can wait", "this week", "today"],
        },
    },
}
CHAT = "POST /v1/chat/completions"
MODEL = "GET /v1/models/{model}"
DECIDE = "POST /v1/systemone"
RESPOND = "POST /v1/responses"
STORED = "GET /v1/responses/{response_id}"
MESSAGES = "POST /v1/messages"
COUNT = "POST /v1/messages/count_tokens"
JSON, SSE = "application/json", "text/event-stream"
ANCHORS: list[tuple[str, Any, dict[str, str], bool, int, str]] = [
    # operation, body (a GET's path parameters), headers, with the key, status, media type
    ("GET /v1/models", None, {"X-Request-Id": "anchor-1"}, True, 200, JSON),
    ("GET /v1/models", None, {"X-Request-Id": "anchor-2"}, False, 401, JSON),
    ("GET /v1/models", None, {"X-Request-Id": "not one"}, True, 400, JSON),
    (MODEL, {"model": "my-model"}, {"X-Request-Id": "anchor-5"}, True, 200, JSON),
    (MODEL, {"model": "decider"}, {}, True, 200, JSON),
    (MODEL, {"model": "nobody"}, {"X-Request-Id": "anchor-6"}, True, 404, JSON),
    (MODEL, {"model": "my-model"}, {}, False, 401, JSON),
    ("GET /openapi.json", None, {}, True, 200, JSON),
    ("GET /openapi.json", None, {}, False, 401, JSON),
    (CHAT, {"model": "my-model", "messages": HELLO}, {"X-Request-Id": "anchor-3"}, True, 200, JSON),
    (CHAT, {"model": "my-model", "messages": HELLO, "stream": True}, {}, True, 200, SSE),
    (CHAT, {"model": "my-model", "messages": HELLO, "stream": True,
            "stream_options": {"include_usage": True}}, {}, True, 200, SSE),
    (CHAT, {"model": "llama", "messages": HELLO, "cache_salt": "a"}, {}, True, 400, JSON),
    (CHAT, {"model": "llama", "messages": HELLO, "cache_salt": "a", "stream": True}, {}, True,
     200, SSE),  # one cache_salt_unsupported event
    (CHAT, {"model": "decider", "messages": HELLO}, {}, True, 400, JSON),
    (CHAT, {"model": "nobody", "messages": HELLO}, {}, True, 404, JSON),
    (CHAT, {"model": "my-model", "messages": HELLO, "n": 2}, {}, True, 400, JSON),
    (CHAT, {"model": "my-model", "messages": HELLO, "best_of": 2}, {}, True, 400, JSON),
    (CHAT, {"model": "my-model", "messages": HELLO}, {}, False, 401, JSON),
    (RESPOND, {"model": "my-model", "input": "Hello"}, {"X-Request-Id": "anchor-7"}, True, 200,
     JSON),
    (RESPOND, {"model": "my-model", "input": HELLO, "stream": True}, {}, True, 200, SSE),
    (RESPOND, {"model": "my-model", "input": "x", "previous_response_id": "r"}, {}, True, 400,
     JSON),
    (RESPOND, {"model": "decider", "input": "x"}, {}, True, 400, JSON),
    (RESPOND, {"model": "llama", "input": "x", "cache_salt": "a"}, {}, True, 400, JSON),
    (RESPOND, {"model": "llama", "input": "x", "cache_salt": "a", "stream": True}, {}, True,
     200, SSE),  # told in band, as on chat: error and response.failed
    (RESPOND, {"model": "my-model", "input": "x"}, {}, False, 401, JSON),
    (STORED, {"response_id": "resp_1"}, {"X-Request-Id": "anchor-8"}, True, 404, JSON),
    (STORED, {"response_id": "resp_1"}, {}, False, 401, JSON),
    (DECIDE, DECISION, {"X-Request-Id": "anchor-4"}, True, 200, JSON),
    (DECIDE, {**DECISION, "stream": False}, {}, True, 400, JSON),
    (DECIDE, {**DECISION, "model": "my-model"}, {}, True, 400, JSON),
    (DECIDE, DECISION, {}, False, 401, JSON),
    (MESSAGES, ASK, {"X-Request-Id": "anchor-9"}, True, 200, JSON),
    (MESSAGES, {**ASK, "stream": True}, {"anthropic-version": "2023-06-01"}, True, 200, SSE),
    (MESSAGES, {**ASK, "model": "decider"}, {}, True, 400, JSON),
    (MESSAGES, {**ASK, "model": "nobody"}, {}, True, 404, JSON),
    (MESSAGES, {**ASK, "model": "llama", "stop_sequences": ["x"]}, {}, True, 400, JSON),
    (MESSAGES, {**ASK, "model": "llama", "cache_salt": "a", "stream": True}, {}, True, 200,
     SSE),  # one error event
    (MESSAGES, ASK, {"anthropic-beta": "files-api-2025-04-14"}, True, 400, JSON),
    (MESSAGES, ASK, {}, False, 401, JSON),
    (COUNT, {"model": "my-model", "messages": HELLO}, {"X-Request-Id": "anchor-10"}, True, 200,
     JSON),
    (COUNT, {"model": "llama", "messages": HELLO}, {}, True, 200, JSON),
    (COUNT, {"model": "decider", "messages": HELLO}, {}, True, 400, JSON),
    (COUNT, {"model": "my-model", "messages": HELLO}, {}, False, 401, JSON),
]  # fmt: skip
"""Requests sent as they are before the generated ones: each documented answer that matters
is checked against the document whatever the generation draws."""


def _aimed(doc: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    """The document with ``model`` limited to this gateway's deployments, so that generated
    requests reach the engine and not only the unknown-model refusal; with ``stream``, chat
    requests that ask for an event stream."""
    aimed = copy.deepcopy(doc)
    schemas = aimed["components"]["schemas"]
    schemas["ChatRequest"]["properties"]["model"] = {"enum": CHAT_MODELS}
    schemas["ResponsesRequest"]["properties"]["model"] = {"enum": CHAT_MODELS}
    schemas["DecisionRequest"]["properties"]["model"] = {"enum": DECISION_MODELS}
    for name in ("MessagesRequest", "CountTokensRequest"):
        schemas[name]["properties"]["model"] = {"enum": CHAT_MODELS}
    if stream:
        for name in ("ChatRequest", "ResponsesRequest", "MessagesRequest"):
            schemas[name]["properties"]["stream"] = {"const": True}
            schemas[name]["required"].append("stream")
    return aimed


def _operations(doc: dict[str, Any]) -> dict[str, Operation]:
    schema = schemathesis.openapi.from_dict(doc, config=schemathesis.Config())
    return {f"{method} {path}": schema[path][method] for path, method in OPERATIONS}


def _runs(doc: dict[str, Any]) -> Iterator[tuple[str, Operation, GenerationMode, int]]:
    """What is fuzzed: each GET with the document as it is, each POST with the aimed copy (its
    negative cases still send other models), and chat streams; valid and invalid requests."""
    both = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    plain, aimed, streamed = (
        _operations(doc),
        _operations(_aimed(doc)),
        _operations(_aimed(doc, stream=True)),
    )
    for label in ("GET /v1/models", MODEL, "GET /openapi.json", STORED):
        for mode in both:
            yield "document", plain[label], mode, MAX_EXAMPLES
    for label in (CHAT, RESPOND, DECIDE, MESSAGES, COUNT):
        for mode in both:
            yield "aimed", aimed[label], mode, MAX_EXAMPLES
    for label in (CHAT, RESPOND, MESSAGES):
        yield "streamed", streamed[label], GenerationMode.POSITIVE, STREAMED_EXAMPLES


class _Fuzz:
    """Requests against one gateway, and what their answers broke (once per rule, operation
    and status)."""

    def __init__(self, session: requests.Session, base_url: str, key: str) -> None:
        self.session = session
        self.base_url = base_url
        self.auth = {"Authorization": f"Bearer {key}"}
        self.found: dict[tuple[str, str, int], str] = {}

    def run(self, name: str, operation: Operation, mode: GenerationMode, examples: int) -> None:
        where = f"{operation.label} ({name}, {mode.value})"

        @settings(
            max_examples=examples,
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: Case) -> None:
            self.check(where, case)

        fuzz()

    def check(self, where: str, case: Case, *, key: bool = True) -> tuple[int, str]:
        """Send ``case`` (with the key unless told not to) and hold its answer to the rules;
        return the answer's status and media type."""
        auth = self.auth if key else None
        response = case.call(base_url=self.base_url, session=self.session, headers=auth, timeout=30)
        curl = case.as_curl_command(headers=dict(response.request.headers))
        for rule, message in _house_rules(case, response):
            self.found.setdefault((rule, where, response.status_code), f"{message}\n{curl}")
        try:
            case.validate_response(response, checks=CHECKS, headers=auth)
        except schemathesis.errors.FailureGroup as group:
            for failure in group.exceptions:
                message = f"{failure.message[:2000]}\n{curl[:2000]}"
                self.found.setdefault((failure.title, where, response.status_code), message)
        return response.status_code, response.headers.get("content-type", [""])[0].split(";")[0]

    def problems(self) -> list[str]:
        return [f"{rule}: {where}, {status}\n{message}" for (rule, where, status), message in
                self.found.items()]  # fmt: skip


def _fuzz(doc: dict[str, Any], base_url: str, key: str) -> list[str]:
    """The anchors, then every run of `_runs`; what broke a rule. Runs in a worker thread: the
    gateway serves on the test's event loop."""
    operations = _operations(doc)
    with requests.Session() as session:
        fuzz = _Fuzz(session, base_url, key)
        for i, (label, body, headers, with_key, status, media) in enumerate(ANCHORS):
            operation = operations[label]
            if label.startswith("GET"):
                case = operation.Case(path_parameters=body, headers=headers)
            else:
                case = operation.Case(body=body, headers=headers, media_type=JSON)
            where = f"{label} (anchor {i})"
            got = fuzz.check(where, case, key=with_key)
            if got != (status, media):
                fuzz.found[("unexpected answer", where, got[0])] = f"expected {status} {media}"
        for run in _runs(doc):
            fuzz.run(*run)
        return fuzz.problems()


def _house_rules(case: Case, response: schemathesis.Response) -> Iterator[tuple[str, str]]:
    """What the document cannot say: every answer's request ID, a caller's ID handed back,
    and no 500 other than a launched engine failing to start."""
    rid = response.headers.get("x-capyctl-request-id")
    if rid is None or not ULID.fullmatch(rid[0]):
        yield "X-CapyCTL-Request-Id", f"missing or not a ULID: {rid}"
    sent = case.headers.get("X-Request-Id") if case.headers else None
    if isinstance(sent, str) and CALLER_ID.fullmatch(sent):
        back = response.headers.get("x-request-id")
        if back != [sent]:
            yield "X-Request-Id", f"sent {sent!r}, got {back}"
    if response.status_code == 500:
        code = _code(response.content)
        if code != "activation_failed":
            yield "500", f"code {code!r}: {response.content[:500]!r}"


def _code(body: bytes) -> Any:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    error = doc.get("error")  # Anthropic's shape: the gateway's code leads its message
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"].split(":")[0]
    return doc.get("code")
