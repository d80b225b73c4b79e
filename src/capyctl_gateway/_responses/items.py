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

Every field OpenAI's schema gives these items and parts is taken, so that an item a client got
back (the openai client's ``model_dump()``, its None fields and its own ``async_``, ``parsed``
and ``parsed_arguments`` included) can be sent as it is. Those a chat message has no place for
(an item's ``id``, ``status`` and ``phase``, a call's ``caller``, ``namespace`` and ``async``, a
text's ``annotations``, ``logprobs`` and ``prompt_cache_breakpoint``) are checked and not sent
(`_NOTED`); any other field is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Any

from .._errors import RefusedError, invalid

__all__ = ["messages_of"]

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}

Check = tuple[Callable[[Any], bool], str]
"""A field taken but not sent: what it may be, and how a refusal says so."""


def _among(*values: str) -> Check:
    return (lambda v: v is None or v in values), f"one of {', '.join(values)}, or null"


_STRING: Check = (lambda v: v is None or isinstance(v, str)), "a string or null"
_FLAG: Check = (lambda v: v is None or isinstance(v, bool)), "true, false or null"
_LIST: Check = (lambda v: v is None or isinstance(v, list)), "a list or null"
_ANY: Check = (lambda v: True), ""
_STATUS = _among("in_progress", "completed", "incomplete")
_CALLER: Check = (
    lambda v: v is None or (isinstance(v, dict) and v.get("type") in ("direct", "program")),
    'an object of type "direct" or "program", or null',
)
_BREAKPOINT: Check = (
    lambda v: v is None or v == {"mode": "explicit"},
    '{"mode": "explicit"} or null',
)
_NOTED_CALL = {
    "id": _STRING,
    "status": _STATUS,
    "caller": _CALLER,
    "namespace": _STRING,
    "async": _FLAG,
    "async_": _FLAG,  # the openai client's name for it (model_dump() writes it so)
    "parsed_arguments": _ANY,  # the openai client's parse helpers add it
}
_NOTED: dict[str, Mapping[str, Check]] = {
    "message": {"id": _STRING, "status": _STATUS, "phase": _among("commentary", "final_answer")},
    "function_call": _NOTED_CALL,
    "function_call_output": {
        "id": _STRING,
        "status": _STATUS,
        "caller": _CALLER,
        "namespace": _STRING,
        "name": _STRING,
    },
    "input_text": {"prompt_cache_breakpoint": _BREAKPOINT},
    "output_text": {"annotations": _LIST, "logprobs": _LIST, "parsed": _ANY},
    "refusal": {},
    "input_image": {"prompt_cache_breakpoint": _BREAKPOINT},
}
"""Each kind's fields that are taken and checked, but not sent to the engine."""
_SENT = {
    "message": frozenset({"type", "role", "content"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments"}),
    "function_call_output": frozenset({"type", "call_id", "output"}),
    "input_text": frozenset({"type", "text"}),
    "output_text": frozenset({"type", "text"}),
    "refusal": frozenset({"type", "refusal"}),
    "input_image": frozenset({"type", "image_url", "detail", "file_id"}),
}
"""Each kind's fields that make what the engine is sent."""
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_MESSAGE_PARTS = frozenset({*_TEXT_PARTS, "input_image"})
_TOOL_PARTS = frozenset({"input_text"})
"""What a tool's output may hold: text (a chat ``tool`` message has no images)."""
_DETAILS = ("low", "high", "auto", "original")
_CHAT_DETAILS = ("low", "high", "auto")
"""The details chat's ``image_url`` has (``original`` is taken, and the engine's own is kept)."""


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


def _fields(obj: dict[str, Any], kind: str, where: str) -> None:
    """Refuse a field ``kind`` does not take, and one taken but not sent of the wrong kind."""
    sent, noted = _SENT[kind], _NOTED[kind]
    for key, value in obj.items():
        if key in sent:
            continue
        check = noted.get(key)
        if check is None:
            raise invalid(f"{where}: field `{key[:64]}` is not accepted")
        accepts, what = check
        if not accepts(value):
            raise invalid(f"{where}.{key} must be {what}")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key} must be a string")
    return value


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    _fields(item, "message", f"input[{i}]")
    given = item.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise invalid(f"input[{i}].role must be user, assistant, system or developer")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid(f"input[{i}].content must be a string or a list of parts")
    parts = [_part(part, f"input[{i}].content[{j}]") for j, part in enumerate(content)]
    if role != "user" or all(p["type"] == "text" for p in parts):
        if any(p["type"] != "text" for p in parts):
            raise invalid(f"input[{i}]: only a user message may carry images")
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: Any, where: str, kinds: Container[str] = _MESSAGE_PARTS) -> dict[str, Any]:
    """A content part of one of ``kinds`` as chat's: text, or an image."""
    if not isinstance(part, dict):
        raise invalid(f"{where} must be an object")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise invalid(f"{where}.type must be a string")
    if kind not in kinds:
        raise RefusedError(
            f"{where}: parts of type {kind[:64]!r} are not served", code="unsupported_parameter"
        )
    key = _TEXT_PARTS.get(kind)
    if key is not None:
        _fields(part, kind, where)
        return {"type": "text", "text": _string(part, key, where)}
    _fields(part, kind, where)  # an input_image
    if part.get("file_id") is not None:
        raise RefusedError(
            f"{where}: an input_image by file_id is not served (the gateway keeps no files): "
            "send image_url, a URL or data URI",
            code="unsupported_parameter",
        )
    url, detail = part.get("image_url"), part.get("detail")
    if not isinstance(url, str):
        raise invalid(f"{where}: an input_image takes image_url (a URL or data URI)")
    if detail is not None and detail not in _DETAILS:
        raise invalid(f"{where}.detail must be one of {', '.join(_DETAILS)}, or null")
    image: dict[str, Any] = {"url": url}
    if detail in _CHAT_DETAILS:
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _call(item: dict[str, Any], i: int, messages: list[dict[str, Any]]) -> None:
    """A tool call, joined to the assistant message just before it (that turn's), or one of
    its own."""
    where = f"input[{i}]"
    _fields(item, "function_call", where)
    call = {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {
            "name": _string(item, "name", where),
            "arguments": _string(item, "arguments", where),
        },
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _output(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A tool's output: a string, or ``input_text`` parts."""
    where = f"input[{i}]"
    _fields(item, "function_call_output", where)
    output = item.get("output")
    if isinstance(output, list):
        parts = [_part(p, f"{where}.output[{j}]", _TOOL_PARTS) for j, p in enumerate(output)]
        output = "".join(p["text"] for p in parts)
    if not isinstance(output, str):
        raise invalid(f"{where}.output must be a string or a list of text parts")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
