"""A Responses ``input`` as chat messages (pure).

``input`` is a string (one user message) or a list of items:

- messages (``type: message`` or no type) of role user, assistant, system or developer
  (developer becomes system, the role every engine's template knows), with a string or a list
  of parts: ``input_text``, ``output_text`` and ``refusal`` as text, ``input_image`` as chat's
  ``image_url``;
- ``function_call`` items: a tool call of the assistant's turn, joined to that turn's message
  (its text and its calls are one chat message, as the engine sent them);
- ``function_call_output`` items: a ``tool`` message;
- ``reasoning`` items, as a client sends back a turn's output whole: left out (the engines'
  templates drop earlier turns' reasoning too).

Any other item (``item_reference`` needs a stored response; files, audio, built-in tools' calls)
is refused by name.
"""

from __future__ import annotations

from typing import Any

from .._errors import RefusedError, invalid

__all__ = ["messages_of"]

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


def messages_of(given: Any, instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages for ``input`` (required), after a system message of ``instructions``."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    if not isinstance(given, list) or not given:
        raise invalid("input is required: a string, or a non-empty list of items")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise invalid(f"input[{i}].type must be a string")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            _call(item, i, messages)
        elif kind == "function_call_output":
            messages.append(_output(item, i))
        elif kind != "reasoning":
            raise RefusedError(
                f"input[{i}]: items of type {kind[:64]!r} are not served (the gateway keeps no "
                "responses and runs no tools)",
                code="unsupported_parameter",
            )
    return messages


def _keys(item: dict[str, Any], allowed: frozenset[str], i: int) -> None:
    for key in item:
        if key not in allowed:
            raise invalid(f"input[{i}]: field `{key[:64]}` is not accepted")


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"input[{i}].{key} must be a string")
    return value


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    _keys(item, _MESSAGE_KEYS, i)
    given = item.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise invalid(f"input[{i}].role must be user, assistant, system or developer")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid(f"input[{i}].content must be a string or a list of parts")
    parts = [_part(part, i, j) for j, part in enumerate(content)]
    if role != "user" or all(p["type"] == "text" for p in parts):
        if any(p["type"] != "text" for p in parts):
            raise invalid(f"input[{i}]: only a user message may carry images")
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: Any, i: int, j: int) -> dict[str, Any]:
    where = f"input[{i}].content[{j}]"
    if not isinstance(part, dict):
        raise invalid(f"{where} must be an object")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise invalid(f"{where}.type must be a string")
    key = _TEXT_PARTS.get(kind)
    if key is not None:
        text = part.get(key)
        if not isinstance(text, str):
            raise invalid(f"{where}.{key} must be a string")
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or set(part) - {"type", "image_url", "detail"}:
            raise invalid(f"{where}: an input_image takes image_url (a URL or data URI)")
        image: dict[str, Any] = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    raise RefusedError(
        f"{where}: parts of type {kind[:64]!r} are not served", code="unsupported_parameter"
    )


def _call(item: dict[str, Any], i: int, messages: list[dict[str, Any]]) -> None:
    """A tool call, joined to the assistant message just before it (that turn's), or one of
    its own."""
    _keys(item, _CALL_KEYS, i)
    call = {
        "id": _string(item, "call_id", i),
        "type": "function",
        "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _output(item: dict[str, Any], i: int) -> dict[str, Any]:
    _keys(item, _OUTPUT_KEYS, i)
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") != "input_text":
                raise invalid(f"input[{i}].output[{j}]: only input_text parts are taken")
            texts.append(_string(part, "text", i))
        output = "".join(texts)
    if not isinstance(output, str):
        raise invalid(f"input[{i}].output must be a string or a list of text parts")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output}
