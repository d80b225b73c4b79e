"""A Messages request's ``tools`` and ``tool_choice`` as chat's (pure).

Only client tools are served (no ``type``, or ``custom``): each becomes a chat function with
its ``name``, ``description``, ``input_schema`` as ``parameters`` and ``strict``. Server tools
(web search, code execution, bash, text editor, computer use, tool search, ...) are refused by
their type: the gateway runs no tools. Of a client tool's other fields, ``cache_control`` and
``eager_input_streaming`` are taken with no effect (input is streamed as the engine makes it),
``defer_loading: false`` and ``allowed_callers: ["direct"]`` are what the engine does anyway;
``defer_loading: true`` (it needs Anthropic's tool search), other callers and
``input_examples`` (Anthropic puts them in its prompt; a chat function has no place for them)
are refused by name.

``tool_choice``: ``auto``, ``any`` (chat's ``required``), ``tool`` (one named function) and
``none``; ``disable_parallel_tool_use: true`` is chat's ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import re
from typing import Any

from .._errors import RefusedError, invalid

__all__ = ["tool_choice_of", "tools_of"]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
"""Anthropic's pattern for a tool's name."""
_TOOL = frozenset(
    {
        "type", "name", "description", "input_schema", "cache_control", "strict",
        "eager_input_streaming", "defer_loading", "input_examples", "allowed_callers",
    }
)  # fmt: skip
_CHOICES = {"auto": frozenset({"type", "disable_parallel_tool_use"})}
_CHOICES["any"] = _CHOICES["auto"]
_CHOICES["tool"] = frozenset({"type", "name", "disable_parallel_tool_use"})
_CHOICES["none"] = frozenset({"type"})


def tools_of(tools: Any) -> list[dict[str, Any]]:
    """Chat's ``tools`` for ``tools`` (empty where none were given)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where} must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            said = kind[:64] if isinstance(kind, str) else "(not a string)"
            raise RefusedError(
                f"{where}: tools of type {said!r} are not served: the gateway runs no tools "
                "itself (client tools only)",
                code="unsupported_parameter",
            )
        out.append({"type": "function", "function": _function(tool, where)})
    return out


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    for key in tool:
        if key not in _TOOL:
            raise invalid(f"{where}: field `{key[:64]}` is not accepted")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.name must be 1 to 128 letters, digits, _ or -")
    if not isinstance(schema, dict):
        raise invalid(f"{where}.input_schema must be a JSON schema object")
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid(f"{where}.description must be a string")
        fn["description"] = description
    for key in ("strict", "eager_input_streaming", "defer_loading"):
        if tool.get(key) not in (None, True, False):
            raise invalid(f"{where}.{key} must be true or false")
    if tool.get("strict") is not None:
        fn["strict"] = tool["strict"]
    if tool.get("defer_loading"):
        raise RefusedError(
            f"{where}.defer_loading: deferred tools need Anthropic's tool search, which the "
            "gateway does not run",
            code="unsupported_parameter",
        )
    if tool.get("input_examples"):
        raise RefusedError(
            f"{where}.input_examples are not served: a chat function has no place for them",
            code="unsupported_parameter",
        )
    if tool.get("allowed_callers") not in (None, [], ["direct"]):
        raise RefusedError(
            f"{where}.allowed_callers: only direct calls are served", code="unsupported_parameter"
        )
    return fn


def tool_choice_of(choice: Any, tools: list[dict[str, Any]], chat: dict[str, Any]) -> None:
    """Write chat's ``tool_choice`` (and ``parallel_tool_calls``) for ``choice`` into
    ``chat``, where there are tools to choose among."""
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    allowed = _CHOICES.get(kind) if isinstance(kind, str) else None
    if allowed is None or set(choice) - allowed:
        raise invalid(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": '
            '...} or {"type": "none"} (with disable_parallel_tool_use where it applies)'
        )
    names = {t["function"]["name"] for t in tools}
    if kind in ("any", "tool") and not tools:
        raise invalid(f'tool_choice "{kind}" needs tools')
    if kind == "tool" and choice.get("name") not in names:
        name = choice.get("name")
        said = repr(name[:64]) if isinstance(name, str) else "(not a string)"
        raise invalid(f"tool_choice names the tool {said}, not in tools")
    disable = choice.get("disable_parallel_tool_use")
    if disable not in (None, True, False):
        raise invalid("tool_choice.disable_parallel_tool_use must be true or false")
    if not tools:
        return
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[str(kind)]
    if disable:
        chat["parallel_tool_calls"] = False
