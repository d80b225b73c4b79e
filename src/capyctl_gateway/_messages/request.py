"""A Messages request checked and turned into the engine's chat request (pure functions).

Each top-level field is decided by what Anthropic's SDK and Claude Code send today: taken and
sent as chat's, taken with no effect on the answer (said in `MESSAGES_FIELDS`' comments and
docs/gateway/messages.md), or refused by name where serving it would change the answer. Any
other field is refused by name, as on chat. ``count_tokens`` takes the fields that shape the
prompt (`COUNT_FIELDS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._config import Deployment
from .._engines import EngineKind
from .._errors import RefusedError, invalid
from .content import messages_of, system_of
from .tools import tool_choice_of, tools_of

__all__ = ["COUNT_FIELDS", "MESSAGES_FIELDS", "Asked", "check_count", "check_messages"]

MESSAGES_FIELDS = frozenset(
    {
        "model", "max_tokens", "messages", "system", "stop_sequences", "stream",
        "temperature", "top_p", "top_k", "metadata", "tools", "tool_choice", "thinking",
        "output_config", "cache_salt",
        # taken, no effect on the answer: prefix routing does what caching asks; the engine
        # runs at its own speed, in its own place, at one tier
        "cache_control", "speed", "service_tier", "inference_geo", "diagnostics",
        # decided per value: see _context and _unused
        "context_management", "container", "mcp_servers",
    }
)  # fmt: skip
COUNT_FIELDS = frozenset(
    {
        "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
        "cache_control", "speed", "context_management", "mcp_servers",
    }
)  # fmt: skip
STOP_KEYS = {EngineKind.VLLM: "stop_reason", EngineKind.SGLANG: "matched_stop"}
"""Where each engine says which stop string ended an answer (a choice's field); the others
do not say, so ``stop_sequences`` is refused for them."""
MAX_STOP_SEQUENCES = 16
MAX_USER_ID = 1024
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
"""``output_config.effort`` as chat's ``reasoning_effort`` (its highest is high)."""
_SAMPLING = {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0)}
_THINKING = ("enabled", "adaptive", "disabled")


@dataclass(frozen=True, slots=True)
class Asked:
    """What the Message's making needs of the request beyond the chat payload."""

    stop_sequences: tuple[str, ...] = ()
    stop_key: str | None = None
    """The choice's field that names the stop string that ended the answer."""
    show_thinking: bool = True
    """False where ``thinking.display`` is ``omitted``: thinking blocks carry no text."""


def check_messages(body: dict[str, Any], dep: Deployment) -> tuple[dict[str, Any], bool, Asked]:
    """The Messages checks of ``body`` (``cache_salt`` aside, which is chat's rule): the chat
    request for the engine (without its model and stream fields), whether the client asked
    for a stream, and what the Message needs."""
    _only(body, MESSAGES_FIELDS)
    most = body.get("max_tokens")
    if type(most) is not int or most < 1:
        raise invalid("max_tokens is required: a positive integer")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream must be true or false")
    chat = _prompt(body, dep)
    chat["max_tokens"] = most
    for key, (low, high) in _SAMPLING.items():
        value = body.get(key)
        if value is not None:
            if type(value) not in (int, float) or not low <= value <= high:
                raise invalid(f"{key} must be a number from {low:g} to {high:g}")
            chat[key] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if type(top_k) is not int or top_k < 0:
            raise invalid("top_k must be a non-negative integer")
        chat["top_k"] = top_k
    _metadata(body.get("metadata"), chat)
    asked = _stops(body.get("stop_sequences"), dep, chat)
    shown = _thinking(body.get("thinking"), most, dep, chat)
    _unused(body)
    if "cache_salt" in body:
        chat["cache_salt"] = body["cache_salt"]  # checked by chat's rule (its caller)
    chat["stream_options"] = {"include_usage": True}  # the Message reports it
    return chat, bool(stream), Asked(asked, STOP_KEYS.get(dep.engine), shown)


def check_count(body: dict[str, Any], dep: Deployment) -> dict[str, Any]:
    """The count_tokens checks of ``body``: the chat messages and tools whose prompt the
    engine's tokenizer counts."""
    _only(body, COUNT_FIELDS)
    chat = _prompt(body, dep)
    _thinking(body.get("thinking"), None, dep, chat)
    chat.pop("reasoning_effort", None)  # nothing is generated: only the prompt counts
    return chat


def _only(body: dict[str, Any], fields: frozenset[str]) -> None:
    for key in body:
        if key not in fields:
            raise invalid(f"request field `{key[:64]}` is not accepted")


def _prompt(body: dict[str, Any], dep: Deployment) -> dict[str, Any]:
    """What shapes the prompt: system, messages, tools, tool choice, output config."""
    chat: dict[str, Any] = {
        "messages": system_of(body.get("system")) + messages_of(body.get("messages"))
    }
    tools = tools_of(body.get("tools"))
    if tools:
        chat["tools"] = tools
    tool_choice_of(body.get("tool_choice"), tools, chat)
    _output(body.get("output_config"), chat)
    _context(body.get("context_management"))
    if body.get("mcp_servers"):
        raise RefusedError(
            "mcp_servers is not served: the gateway runs no tools itself",
            code="unsupported_parameter",
        )
    return chat


def _metadata(metadata: Any, chat: dict[str, Any]) -> None:
    """``metadata.user_id``, sent as chat's ``user``."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise invalid("metadata must be an object with one field, user_id")
    user = metadata.get("user_id")
    if user is None:
        return
    if not isinstance(user, str) or len(user) > MAX_USER_ID:
        raise invalid(f"metadata.user_id must be a string of at most {MAX_USER_ID} characters")
    chat["user"] = user


def _stops(stops: Any, dep: Deployment, chat: dict[str, Any]) -> tuple[str, ...]:
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise invalid(f"stop_sequences must be a list of at most {MAX_STOP_SEQUENCES} strings")
    if stops and dep.engine not in STOP_KEYS:
        raise RefusedError(
            f"stop_sequences is not served for {dep.engine.value}: the engine does not say "
            "which sequence ended an answer, so stop_reason could not be told",
            code="unsupported_parameter",
        )
    if stops:
        chat["stop"] = stops
    return tuple(stops)


def _thinking(thinking: Any, most: int | None, dep: Deployment, chat: dict[str, Any]) -> bool:
    """``thinking``: whether the thinking blocks carry their text (``display``)."""
    if thinking is None:
        return True
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in _THINKING:
        raise invalid('thinking.type must be "enabled", "adaptive" or "disabled"')
    allowed = {"disabled": {"type"}, "adaptive": {"type", "display"}}.get(kind)
    if set(thinking) - (allowed or {"type", "budget_tokens", "display"}):
        raise invalid(f'thinking of type "{kind}" takes only its own fields')
    if kind == "disabled":
        return True
    if not dep.reasoning:
        raise RefusedError(
            f"thinking is not served: deployment {dep.name}'s engine separates no reasoning "
            "(set reasoning: true on a deployment whose engine runs a reasoning parser)",
            code="unsupported_parameter",
        )
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1024 or (most is not None and budget >= most):
            raise invalid("thinking.budget_tokens must be an integer from 1024 to below max_tokens")
        if dep.engine is EngineKind.VLLM:
            chat["thinking_token_budget"] = budget
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise invalid('thinking.display must be "summarized" or "omitted"')
    return bool(display != "omitted")


def _output(config: Any, chat: dict[str, Any]) -> None:
    """``output_config``: ``effort`` as chat's ``reasoning_effort``, ``format`` (a JSON
    schema) as chat's ``response_format``."""
    if config is None:
        return
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise invalid("output_config must be an object with effort and format")
    effort = config.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise invalid(f"output_config.effort must be one of {', '.join(_EFFORTS)}")
        chat["reasoning_effort"] = _EFFORTS[effort]
    fmt = config.get("format")
    if fmt is not None:
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or set(fmt) != {"type", "schema"}
            or not isinstance(fmt["schema"], dict)
        ):
            raise invalid('output_config.format must be {"type": "json_schema", "schema": {...}}')
        spec = {"name": "output", "schema": fmt["schema"], "strict": True}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}


def _context(management: Any) -> None:
    """``context_management``: clearing earlier thinking is what the gateway does anyway (the
    engine never gets earlier turns' thinking); clearing tool uses would change the prompt past
    its trigger, which the gateway does not do: refused."""
    if management is None:
        return
    edits = management.get("edits") if isinstance(management, dict) else None
    if not isinstance(edits, list) or set(management) - {"edits"}:
        raise invalid("context_management must be an object with a list of edits")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str):
            raise invalid(f"context_management.edits[{i}] must be an object with a string type")
        if not kind.startswith("clear_thinking_"):
            raise RefusedError(
                f"context_management.edits[{i}]: {kind[:64]!r} is not served (the gateway "
                "sends the conversation as it is given)",
                code="unsupported_parameter",
            )


def _unused(body: dict[str, Any]) -> None:
    """The fields taken with no effect, checked; ``container`` (code execution's) refused."""
    if body.get("container") is not None:
        raise RefusedError(
            "container is not served: the gateway runs no code", code="unsupported_parameter"
        )
    checks = {
        "speed": ("standard", "fast"),
        "service_tier": ("auto", "standard_only"),
    }
    for key, values in checks.items():
        if body.get(key) not in (None, *values):
            raise invalid(f"{key} must be one of {', '.join(values)}")
    if not isinstance(body.get("inference_geo"), str | None):
        raise invalid("inference_geo must be a string")
    diagnostics = body.get("diagnostics")
    if diagnostics is not None and (
        not isinstance(diagnostics, dict) or set(diagnostics) - {"previous_message_id"}
    ):
        raise invalid("diagnostics must be an object with previous_message_id")
    cache = body.get("cache_control")
    if cache is not None and (not isinstance(cache, dict) or cache.get("type") != "ephemeral"):
        raise invalid('cache_control must be {"type": "ephemeral"}')
