"""The fields agent clients send on every turn, most of which change nothing the engine makes,
and the logprobs a client may ask for with one of them (pure).

Coding agents (Codex among them) send ``include``, ``prompt_cache_key`` and sometimes
``truncation`` and ``user`` with each request: refused, they made the Responses surface unusable
for those clients. Each is taken where the gateway's answer is what the field asks for, and
refused by name where it is not:

- ``include``: a list; ``reasoning.encrypted_content`` is taken (the gateway has no encrypted
  reasoning: the reasoning items it returns carry their text and no ``encrypted_content``,
  which a client sees); ``message.output_text.logprobs`` asks the engine for chat's
  ``logprobs``, which the Response's text carries; any other value asks for output the gateway
  cannot make and is refused;
- ``top_logprobs``: 0 to 20, echoed; with the logprobs included, the engine is asked for that
  many alternatives a token (chat's ``top_logprobs``);
- ``prompt_cache_key``: a string, echoed. It asks that requests sharing a prompt reach the same
  cache, which the gateway's routing does from the prompt itself (routing.md);
- ``truncation``: ``disabled`` (what the gateway does: input past the model's context is the
  engine's refusal); ``auto`` is refused, since the gateway never drops input;
- ``user``: a string, sent to the engine as chat's ``user`` (chat takes it) and echoed.
"""

from __future__ import annotations

from typing import Any

from .._errors import RefusedError, invalid

__all__ = ["INCLUDABLE", "LOGPROBS", "MAX_HINT", "MAX_TOP_LOGPROBS", "hints"]

LOGPROBS = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on ``top_logprobs`` (chat's too)."""

INCLUDABLE = frozenset({"reasoning.encrypted_content", LOGPROBS})
MAX_HINT = 1024
"""The longest ``prompt_cache_key`` or ``user`` taken, in characters."""


def hints(body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """Check ``include``, ``prompt_cache_key``, ``truncation``, ``user`` and ``top_logprobs``
    (writing what the engine is sent into ``chat``); what the Response echoes of them."""
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise invalid("include must be a list of strings")
        for value in include:
            if value not in INCLUDABLE:
                raise RefusedError(
                    f"include: {value[:64]!r} is not served (only {', '.join(sorted(INCLUDABLE))})",
                    code="unsupported_parameter",
                )
    truncation = body.get("truncation")
    if truncation == "auto":
        raise RefusedError(
            'truncation "auto" is not served: the gateway never drops input (an input past '
            "the model's context is refused)",
            code="unsupported_parameter",
        )
    if truncation not in (None, "disabled"):
        raise invalid('truncation must be "disabled" or "auto"')
    echo: dict[str, Any] = {}
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > MAX_HINT:
            raise invalid(f"{key} must be a string of at most {MAX_HINT} characters")
        echo[key] = value
    if "user" in echo:
        chat["user"] = echo["user"]
    top = body.get("top_logprobs")
    if top is not None:
        if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        echo["top_logprobs"] = top
    if include is not None and LOGPROBS in include:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    return echo
