"""Checking a chat request before anything reaches an engine (pure functions)."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import orjson

from .._config import REMOTE_MAX_BODY_BYTES, Api, Deployment, GatewayConfig
from .._engines import facts
from .._errors import RefusedError, TooLargeError, UnknownModelError, invalid
from .._machines.protocol import INGRESS_MAX_BODY_BYTES

__all__ = [
    "CHAT_FIELDS",
    "MAX_PRIORITY",
    "ENDPOINTS",
    "DECISION_FIELDS",
    "MAX_NESTING",
    "caller_request_id",
    "fits_a_host",
    "take_priority",
    "check_chat",
    "check_decision",
    "check_salt",
    "engine_payload",
    "resolve",
]

# Top-level fields a chat request may carry: OpenAI's chat fields and the engines' documented
# sampling, templating, structured-output and reasoning extensions. Anything else is refused
# by name, never dropped, so that a client never believes a field took effect when it did not.
CHAT_FIELDS = frozenset(
    {
        # OpenAI chat completions
        "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty",
        "logit_bias", "logprobs", "top_logprobs", "user", "seed", "tools", "tool_choice",
        "parallel_tool_calls", "response_format", "functions", "function_call",
        "reasoning_effort", "modalities", "metadata",
        # sampling extensions
        "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
        "no_stop_trim", "length_penalty",
        # templating
        "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "echo",
        "documents",
        # structured output
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
        "json_schema", "regex", "ebnf",
        # reasoning
        "separate_reasoning", "stream_reasoning", "include_reasoning",
        # prefix-cache isolation
        "cache_salt",
        # the queue's order (vLLM's and SGLang's field)
        "priority",
    }
)  # fmt: skip
MAX_PRIORITY = 2**31 - 1
"""A request's ``priority`` lies within ±this (a 32-bit integer, as engines take it)."""

DECISION_FIELDS = frozenset({"model", "state", "questions", "images", "files"})
CACHE_SALT_UNSUPPORTED = (
    "this deployment's engine does not partition its prefix cache by cache_salt"
)
MAX_SALT_BYTES = 1024
MAX_NESTING = 254
"""How deep a body may nest, its own object included: orjson reads 1,024 levels but writes at
most 254, and the engine's copy is written by it (a test holds orjson to this figure)."""


_LONG_DIGITS = re.compile(rb"\d{20}|-\d{19}")
"""Digits enough for an integer orjson would read as a float (outside -2^63 .. 2^64-1)."""
_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN = b"0" * 19
_INT_RANGE = range(-(2**63), 2**64)
_TOKENS = (b",", b":", b"[", b"{")


def _tokens_within(raw: bytes, limit: int) -> None:
    """Refuse a body that may hold more than ``limit`` JSON values, before it is parsed (the
    parse's time and memory grow with its values): each value past the first follows one of
    ``,`` ``:`` ``[`` ``{``, so their count bounds them. Counted in strings too: one C pass per
    character, where telling strings apart would cost a parse. (A body of ``limit`` bytes
    or fewer cannot hold more: the caller asks only of a longer one.)"""
    seen = 0
    for ch in _TOKENS:
        seen += raw.count(ch)
        if seen > limit:
            raise TooLargeError(
                f"the body holds more than limits.max_json_tokens ({limit}) of , : [ {{ "
                "(its JSON values, and these characters in its strings)"
            )


def _long_digits(raw: bytes) -> bool:
    """Whether ``raw`` holds what `_LONG_DIGITS` finds. The expression tries every position
    (about 17 ns a byte: 1.5 us for a short chat request, 178 us for a 10 KB prompt), so a
    run of 19 digits is looked for first: every digit made a zero and the run found as a
    substring (two C passes, 0.2 us and 6 us for those two, and one copy of the body, bounded
    as the body is). Only a body with such a run is searched."""
    return raw.translate(_AS_ZEROS).find(_NINETEEN) >= 0 and _LONG_DIGITS.search(raw) is not None


def _out_of_range(body: Any) -> bool:
    """Whether ``body`` (as orjson read it) holds a float that may have been an integer
    outside -2^63 .. 2^64-1 (orjson reads one as a float): whole, and that large."""
    stack = [body]
    while stack:
        x = stack.pop()
        if type(x) is dict:
            stack.extend(x.values())
        elif type(x) is list:
            stack.extend(x)
        elif type(x) is float and abs(x) >= 2.0**63 and x.is_integer():
            return True
    return False


def _exact_integers(raw: bytes, body: Any) -> None:
    """Refuse an integer the engine would not receive exactly: orjson reads one outside
    -2^63 .. 2^64-1 as a float, and the engine would get another number than the one sent.
    Looked for in three steps, each run only where the one before found something: a run of
    digits anywhere (`_long_digits`, the caller's), a float that large in what
    orjson read (a walk of its values, bounded by ``max_json_tokens``), the standard library's
    parse of the integers (as bounded)."""
    if not _out_of_range(body):
        return

    def exact(text: str) -> int:
        value = int(text)
        if value not in _INT_RANGE:
            raise invalid(
                f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is outside "
                "-2^63 .. 2^64-1, which the gateway cannot forward exactly"
            )
        return value

    # orjson took the body; only the integers are looked at here.
    with contextlib.suppress(ValueError, RecursionError):
        json.loads(raw, parse_int=exact)


ENDPOINTS = {Api.CHAT: "/v1/chat/completions", Api.DECISIONS: "/v1/systemone"}
"""Where each API's requests go (a chat deployment answers /v1/responses too)."""


def resolve(
    raw: bytes, config: GatewayConfig, api: Api, endpoint: str
) -> tuple[dict[str, Any], Deployment]:
    """The checks every request shares, in order: no more JSON values than the limit (413), a
    JSON object with a string ``model`` (400), a deployment of that name (404), serving the
    API of ``endpoint`` (400 api_mismatch)."""
    limit = config.limits.max_json_tokens
    if len(raw) > limit:  # a body no longer cannot hold more
        _tokens_within(raw, limit)
    try:
        body = orjson.loads(raw)  # nested past 1,024 levels: refused here, else when written
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    if _long_digits(raw):
        _exact_integers(raw, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required and must be a non-empty string")
    deployment = config.deployment(model)
    if deployment is None:
        raise UnknownModelError(f"no deployment serves model {model[:128]!r}")
    if deployment.api is not api:
        served = deployment.api
        raise RefusedError(
            f"model {model} serves the {served.value} API, which {endpoint} does not "
            f"answer; send its requests to POST {ENDPOINTS[served]}",
            code="api_mismatch",
        )
    return body, deployment


def check_chat(body: dict[str, Any], deployment: Deployment) -> bool:
    """The chat checks after `resolve` (which found ``deployment``), in the documented order
    (`check_salt`, every API's, follows them); whether the client asked for a stream."""
    for key in body:
        if key not in CHAT_FIELDS:
            raise invalid(f"request field `{key[:64]}` is not accepted")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages is required and must be a list")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise RefusedError("n must be 1: one choice is relayed", code="unsupported_parameter")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RefusedError(
            "functions and function_call are not supported; use tools", code="unsupported_parameter"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object")
    return bool(stream)


def check_salt(body: dict[str, Any], deployment: Deployment, *, in_band: bool) -> None:
    """``cache_salt``, where given: a short string, for an engine that honours it. One rule for
    every API: the refusal is told in band where the client asked for a stream (each API in
    its own form), and is a 400 otherwise."""
    if "cache_salt" not in body:
        return
    salt = body["cache_salt"]
    if not isinstance(salt, str) or not salt or len(salt.encode()) > MAX_SALT_BYTES:
        raise invalid(f"cache_salt must be a non-empty string of at most {MAX_SALT_BYTES} bytes")
    if not facts(deployment.engine).honours_cache_salt:
        raise RefusedError(CACHE_SALT_UNSUPPORTED, code="cache_salt_unsupported", in_band=in_band)


def take_priority(body: dict[str, Any], deployment: Deployment) -> int:
    """A chat request's ``priority`` (0 where not given): a whole number within
    ±`MAX_PRIORITY`, the lower served first in the gateway's queue. It stays in the engine's
    request only where its engines schedule by it (`Deployment.schedules_by_priority`)."""
    if "priority" not in body:
        return 0
    priority = body["priority"]
    if type(priority) is not int or abs(priority) > MAX_PRIORITY:
        raise invalid(f"priority must be a whole number from {-MAX_PRIORITY} to {MAX_PRIORITY}")
    if not deployment.schedules_by_priority:
        del body["priority"]
    return priority


def check_decision(body: dict[str, Any], deployment: Deployment) -> None:
    """The decision checks after `resolve` (which found ``deployment``)."""
    for key in body:
        if key not in DECISION_FIELDS:
            raise invalid(f"request field `{key[:64]}` is not accepted")
    for key in ("images", "files"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, list) or not all(isinstance(v, str) for v in value)
        ):
            raise invalid(f"{key} must be a list of data-URI strings")


def engine_payload(
    body: dict[str, Any], deployment: Deployment, *, chat: bool, stream: bool
) -> bytes:
    """The bytes the engine receives: the body addressed to the engine's own model id; a chat
    request always asks for a stream (with usage, when the gateway collects it)."""
    body["model"] = deployment.engine_model
    if chat:
        body["stream"] = True
        if not stream:
            options = body.get("stream_options") or {}
            body["stream_options"] = {**options, "include_usage": True}
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # nested past MAX_NESTING: orjson writes no deeper
        raise invalid(f"the body is nested more than {MAX_NESTING} levels deep") from None


def caller_request_id(values: list[str]) -> str | None:
    """The caller's X-Request-Id: 1 to 128 printable ASCII characters, no spaces, given once."""
    if not values:
        return None
    if len(values) > 1:
        raise invalid("X-Request-Id was given more than once")
    value = values[0]
    if not 1 <= len(value) <= 128 or not all("!" <= c <= "~" for c in value):
        raise invalid("X-Request-Id must be 1 to 128 printable ASCII characters without spaces")
    return value


def fits_a_host(name: str, sent: int, payload: int) -> None:
    """Refuse (413) a request for a deployment on another machine that its host's ingress
    would not take: the body the client sent over 8 MiB, or the engine's copy of it (the
    model renamed, a stream asked for, numbers written out) past the ingress's limit."""
    if sent > REMOTE_MAX_BODY_BYTES:
        raise TooLargeError(
            f"deployment {name} runs on another machine: its requests must fit in "
            f"{REMOTE_MAX_BODY_BYTES} bytes"
        )
    if payload > INGRESS_MAX_BODY_BYTES:
        raise TooLargeError(
            f"deployment {name} runs on another machine: the request as the engine would get "
            f"it is {payload} bytes, over the {INGRESS_MAX_BODY_BYTES} its host takes (the "
            "gateway writes numbers such as 1e5 out in full: 100000.0)"
        )
