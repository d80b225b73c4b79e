"""Checking a chat request before anything reaches an engine (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ._config import Api, Deployment, GatewayConfig
from ._errors import GatewayError, invalid

__all__ = ["CHAT_FIELDS", "ChatRequest", "caller_request_id", "parse_chat_request", "resolve"]

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
    }
)  # fmt: skip

CACHE_SALT_UNSUPPORTED = (
    "this deployment's engine does not partition its prefix cache by cache_salt"
)
MAX_SALT_BYTES = 1024


@dataclass(frozen=True, slots=True)
class ChatRequest:
    deployment: Deployment
    body: dict[str, Any]
    stream: bool


_ENDPOINT = {Api.CHAT: "/v1/chat/completions", Api.DECISIONS: "/v1/systemone"}


def resolve(raw: bytes, config: GatewayConfig, api: Api) -> tuple[dict[str, Any], Deployment]:
    """The checks every request shares, in order: a JSON object with a string ``model``
    (400), a deployment of that name (404), serving this endpoint's API (400 api_mismatch)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required and must be a non-empty string")
    deployment = config.deployment(model)
    if deployment is None:
        raise GatewayError(404, "unknown_model", f"no deployment serves model {model!r}")
    if deployment.api is not api:
        served = deployment.api
        raise GatewayError(
            400,
            "api_mismatch",
            f"model {model} serves the {served.value} API, which {_ENDPOINT[api]} does not "
            f"answer; send its requests to POST {_ENDPOINT[served]}",
        )
    return body, deployment


def parse_chat_request(raw: bytes, config: GatewayConfig) -> ChatRequest:
    """Validate a chat body in the documented order; raise the documented GatewayError."""
    body, deployment = resolve(raw, config, Api.CHAT)
    for key in body:
        if key not in CHAT_FIELDS:
            raise invalid(f"request field `{key}` is not accepted")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise GatewayError(400, "unsupported_parameter", "n must be 1: one choice is relayed")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise GatewayError(
            400, "unsupported_parameter", "functions and function_call are not supported; use tools"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object")
    if "cache_salt" in body:
        salt = body["cache_salt"]
        if not isinstance(salt, str) or not salt or len(salt.encode()) > MAX_SALT_BYTES:
            raise invalid(
                f"cache_salt must be a non-empty string of at most {MAX_SALT_BYTES} bytes"
            )
        if not deployment.engine.honours_cache_salt:
            raise GatewayError(400, "cache_salt_unsupported", CACHE_SALT_UNSUPPORTED)
    return ChatRequest(deployment, body, bool(stream))


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
