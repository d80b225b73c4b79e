"""A Responses request checked and turned into the engine's chat request (pure functions).

The gateway keeps no responses: a request carries its whole conversation in ``input``, and
what needs a stored one (``previous_response_id``, ``conversation``, ``background``) is
refused with a message saying so. Every other field outside `RESPONSES_FIELDS` is refused by
name, as on chat. What is accepted becomes one chat request (``items.py`` turns the input into
messages); what the Response echoes back is kept as an `Echo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import RefusedError, invalid
from .hints import hints
from .items import messages_of

__all__ = ["RESPONSES_FIELDS", "Echo", "check_responses"]

RESPONSES_FIELDS = frozenset(
    {
        "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
        "max_output_tokens", "temperature", "top_p", "text", "reasoning", "metadata",
        "stream", "cache_salt", "store",
        # what agent clients send with every turn, and the text's logprobs: see hints.py
        "include", "prompt_cache_key", "truncation", "user", "top_logprobs",
        # refused unless empty (they need a stored response): see _STATEFUL
        "previous_response_id", "conversation", "background",
    }
)  # fmt: skip

_STATEFUL = ("previous_response_id", "conversation", "background")
_NO_STATE = (
    "the gateway keeps no responses: send the whole conversation in input (earlier turns' "
    "output items included) instead of {}"
)
_EFFORTS = ("minimal", "low", "medium", "high")
_SUMMARIES = ("auto", "concise", "detailed")
MAX_METADATA = 16
"""OpenAI's bounds on ``metadata``: pairs, and the length of a key and of a value."""
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


@dataclass(frozen=True, slots=True)
class Echo:
    """What a Response says of the request that made it (OpenAI's Response echoes these)."""

    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    reasoning: dict[str, Any]
    metadata: dict[str, str]
    hints: dict[str, Any]
    """``prompt_cache_key``, ``user`` and ``top_logprobs`` where given (`hints`)."""


def check_responses(body: dict[str, Any]) -> tuple[dict[str, Any], bool, Echo]:
    """The Responses checks of ``body`` (``cache_salt`` aside, which is chat's rule): the chat
    request for the engine (without its model and stream fields, which `engine_payload`
    writes), whether the client asked for a stream, and what the Response echoes."""
    for key in body:
        if key not in RESPONSES_FIELDS:
            raise invalid(f"request field `{key[:64]}` is not accepted")
    for key in _STATEFUL:
        if body.get(key) not in (None, False):
            raise invalid(_NO_STATE.format(key))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream must be true or false")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("store must be true or false")
    instructions = _optional_str(body, "instructions")
    chat: dict[str, Any] = {"messages": messages_of(body.get("input"), instructions)}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tools and body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(tool_choice)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("parallel_tool_calls must be true or false")
        if tools:
            chat["parallel_tool_calls"] = parallel
    most = body.get("max_output_tokens")
    if most is not None:
        if type(most) is not int or most < 1:
            raise invalid("max_output_tokens must be a positive integer")
        chat["max_tokens"] = most
    sampling = {k: _number(body, k) for k in ("temperature", "top_p")}
    chat.update({k: v for k, v in sampling.items() if v is not None})
    text = _text(body.get("text"), chat)
    reasoning = _reasoning(body.get("reasoning"), chat)
    metadata = _metadata(body.get("metadata"))
    given = hints(body, chat)
    if "cache_salt" in body:
        chat["cache_salt"] = body["cache_salt"]  # checked by chat's rule (its caller)
    # The engine always streams, with usage: the Response reports it, and nothing of the
    # chat stream reaches the client as it is.
    chat["stream_options"] = {"include_usage": True}
    echo = Echo(
        instructions=instructions,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=True if parallel is None else parallel,
        max_output_tokens=most,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        text=text,
        reasoning=reasoning,
        metadata=metadata,
        hints=given,
    )
    return chat, bool(stream), echo


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise invalid(f"{key} must be a string")
    return value


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) not in (int, float):
        raise invalid(f"{key} must be a number")
    return float(value)


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The function tools as the Response echoes them (``strict`` and ``description`` as
    given, ``parameters`` null where none was)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            if not isinstance(kind, str):
                raise invalid(f"tools[{i}] must be an object with a string type")
            raise RefusedError(
                f"tools[{i}]: only function tools are served (not {kind[:64]!r}): the gateway "
                "runs no tools itself",
                code="unsupported_parameter",
            )
        for key in tool:
            if key not in ("type", "name", "description", "parameters", "strict"):
                raise invalid(f"tools[{i}]: field `{key[:64]}` is not accepted")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}].name must be a non-empty string")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise invalid(f"tools[{i}].parameters must be a JSON schema object")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise invalid(f"tools[{i}].description must be a string")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise invalid(f"tools[{i}].strict must be true or false")
        out.append(
            {
                "type": "function",
                "name": name,
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        )
    return out


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as chat's ``function`` object."""
    fn: dict[str, Any] = {"name": tool["name"]}
    for key in ("description", "parameters", "strict"):
        if tool[key] is not None:
            fn[key] = tool[key]
    return fn


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    if choice is None:
        return "auto"
    if choice in ("none", "auto"):
        return choice
    if choice == "required":
        if not tools:
            raise invalid('tool_choice "required" needs tools')
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice)
        == {
            "type",
            "name",
        }
    ):
        name = choice["name"]
        if not any(t["name"] == name for t in tools):
            said = repr(name[:64]) if isinstance(name, str) else "(not a string)"
            raise invalid(f"tool_choice names the function {said}, not in tools")
        return {"type": "function", "name": choice["name"]}
    raise invalid(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
    )


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text(text: Any, chat: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``; what the Response echoes."""
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise invalid("text must be an object with one field, format")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return {"format": {"type": "text"}}
    if kind == "json_object" and set(fmt) == {"type"}:
        chat["response_format"] = {"type": "json_object"}
        return {"format": {"type": "json_object"}}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        name, schema = fmt.get("name"), fmt.get("schema")
        strict, description = fmt.get("strict"), fmt.get("description")
        if (
            extra
            or not isinstance(name, str)
            or not name
            or not isinstance(schema, dict)
            or not isinstance(strict, bool | None)
            or not isinstance(description, str | None)
        ):
            raise invalid(
                "text.format of type json_schema takes name (a string), schema (an object), "
                "and optionally strict (true or false) and description (a string)"
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        return {"format": {"type": "json_schema", **spec}}
    raise invalid("text.format must be of type text, json_object or json_schema")


def _reasoning(reasoning: Any, chat: dict[str, Any]) -> dict[str, Any]:
    """``reasoning.effort`` as chat's ``reasoning_effort``; ``summary`` is taken and echoed,
    but no summary is ever made (the reasoning's own text is given instead)."""
    if reasoning is None:
        return {"effort": None, "summary": None}
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
        raise invalid("reasoning must be an object with effort and summary")
    effort, summary = reasoning.get("effort"), reasoning.get("summary")
    if effort is not None and effort not in _EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(_EFFORTS)}")
    if summary is not None and summary not in _SUMMARIES:
        raise invalid(f"reasoning.summary must be one of {', '.join(_SUMMARIES)}")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return {"effort": effort, "summary": summary}


def _metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        raise invalid(f"metadata must be an object of at most {MAX_METADATA} pairs")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str):
            raise invalid(
                f"metadata keys are at most {MAX_METADATA_KEY} characters, and values strings"
            )
        if len(value) > MAX_METADATA_VALUE:
            raise invalid(f"metadata values are at most {MAX_METADATA_VALUE} characters")
    return metadata
