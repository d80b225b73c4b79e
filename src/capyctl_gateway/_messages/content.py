"""A Messages request's ``system`` and ``messages`` as chat messages (pure).

- ``system``: a string, or text blocks joined into one system message. A block that is Claude
  Code's ``x-anthropic-billing-header: ...`` line is left out: it is addressed to Anthropic's
  billing, not to the model, and its hash changes with every request, so sending it would make
  every prompt a new one to the engine's prefix cache and to prefix routing (vLLM's own
  Messages API leaves it out too).
- a ``user`` message: a string, or blocks: ``text``, ``image`` (base64 or URL, as chat's
  ``image_url``: the engine takes it where it takes images, and refuses it otherwise, as on
  chat) and ``tool_result`` (each a chat ``tool`` message, sent before the message's other
  blocks, its content a string or text blocks; its ``is_error`` has no place in a chat tool
  message and is not sent: the result's own text is);
- an ``assistant`` message: a string, or ``text`` and ``tool_use`` blocks (one chat message,
  its text and its tool calls, each call's ``input`` as its JSON arguments); ``thinking`` and
  ``redacted_thinking`` blocks are left out (the engines' templates drop earlier turns'
  reasoning too);
- a ``system`` message in ``messages`` (Anthropic's newer mid-conversation system prompts): a
  chat system message where it stands.

A conversation that ends with an assistant turn asks Anthropic to continue that turn (prefill),
which Anthropic itself refuses on models that do not support it: so does the gateway. Any
other block (documents, search results, server tools' blocks, an image by file ID, an image in
a tool result) is refused by name. ``cache_control`` marks are checked and have no effect.
"""

from __future__ import annotations

from typing import Any

import orjson

from .._errors import RefusedError, invalid

__all__ = ["BILLING", "MAX_MESSAGES", "messages_of", "system_of"]

BILLING = "x-anthropic-billing-header"
MAX_MESSAGES = 100_000
"""Anthropic's bound on the messages of one request."""
_MEDIA = ("image/jpeg", "image/png", "image/gif", "image/webp")
_CACHE = frozenset({"type", "ttl"})
_TEXT = frozenset({"type", "text", "cache_control", "citations"})
_IMAGE = frozenset({"type", "source", "cache_control"})
_RESULT = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
_USE = frozenset({"type", "id", "name", "input", "cache_control", "caller"})
_THINKING = {"thinking": frozenset({"type", "thinking", "signature"}), "redacted_thinking": None}


def system_of(system: Any) -> list[dict[str, Any]]:
    """The chat system message of ``system`` (none where it is absent or only billing)."""
    if system is None:
        return []
    text = system if isinstance(system, str) else _texts(system, "system")
    if text is None:
        raise invalid("system must be a string or a list of text blocks")
    return [{"role": "system", "content": text}] if text else []


def messages_of(given: Any) -> list[dict[str, Any]]:
    """The chat messages of ``messages`` (required: a non-empty list ending with a user turn)."""
    if not isinstance(given, list) or not given:
        raise invalid("messages is required: a non-empty list of messages")
    if len(given) > MAX_MESSAGES:
        raise invalid(f"messages holds more than {MAX_MESSAGES} messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise invalid(f"{where} must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role == "user":
            out += _user(content, where)
        elif role == "assistant":
            out.append(_assistant(content, where))
        elif role == "system":
            text = content if isinstance(content, str) else _texts(content, where)
            if text is None:
                raise invalid(f"{where}: a system message's content is a string or text blocks")
            if text:
                out.append({"role": "system", "content": text})
        else:
            raise invalid(f"{where}.role must be user, assistant or system")
    if given[-1].get("role") == "assistant":
        raise invalid(
            "prefill is not served: the last message must be a user turn (the gateway does "
            "not continue an assistant turn)"
        )
    return out


def _texts(blocks: Any, where: str) -> str | None:
    """Text blocks joined (a billing header's left out); None where they are not text blocks."""
    if not isinstance(blocks, list):
        return None
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            return None
        text = _text(block, f"{where}[{j}]")
        if not text.startswith(BILLING):
            parts.append(text)
    return "".join(parts)


def _fields(block: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    for key in block:
        if key not in allowed:
            raise invalid(f"{where}: field `{key[:64]}` is not accepted")
    cache = block.get("cache_control")
    if cache is not None and (
        not isinstance(cache, dict)
        or cache.get("type") != "ephemeral"
        or set(cache) - _CACHE
        or cache.get("ttl", "5m") not in ("5m", "1h")
    ):
        raise invalid(
            f'{where}.cache_control must be {{"type": "ephemeral"}} with a ttl of 5m or 1h'
        )


def _text(block: dict[str, Any], where: str) -> str:
    _fields(block, _TEXT, where)
    if block.get("citations"):
        raise RefusedError(f"{where}: citations are not served", code="unsupported_parameter")
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text must be a string")
    return text


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise invalid(f"{where} must be an object with a string type")
    kind: str = block["type"]
    return kind


def _unserved(kind: str, where: str) -> RefusedError:
    return RefusedError(
        f"{where}: blocks of type {kind[:64]!r} are not served (the gateway runs no tools and "
        "keeps no files)",
        code="unsupported_parameter",
    )


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks")
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            results.append(_result(block, at))
        else:
            raise _unserved(kind, at)
    if not parts:
        return results
    if all(p["type"] == "text" for p in parts):
        return [*results, {"role": "user", "content": "".join(p["text"] for p in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    _fields(block, _IMAGE, where)
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    kind = source.get("type")
    if kind == "base64" and set(source) == {"type", "media_type", "data"}:
        media, data = source["media_type"], source["data"]
        if media not in _MEDIA or not isinstance(data, str):
            raise invalid(f"{where}.source: media_type one of {', '.join(_MEDIA)}, data a string")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and set(source) == {"type", "url"} and isinstance(source["url"], str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if kind == "file":
        raise RefusedError(
            f"{where}: an image by file_id is not served (the gateway keeps no files)",
            code="unsupported_parameter",
        )
    raise invalid(f"{where}.source must be a base64 source (media_type, data) or a url source")


def _result(block: dict[str, Any], where: str) -> dict[str, Any]:
    _fields(block, _RESULT, where)
    use = block.get("tool_use_id")
    if not isinstance(use, str) or not use:
        raise invalid(f"{where}.tool_use_id must be a non-empty string")
    if block.get("is_error") not in (None, True, False):
        raise invalid(f"{where}.is_error must be true or false")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            kind = _kind(part, at)
            if kind != "text":
                raise RefusedError(
                    f"{at}: a tool result of type {kind[:64]!r} is not served (a chat tool "
                    "message carries text only)",
                    code="unsupported_parameter",
                )
            texts.append(_text(part, at))
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": use, "content": content}


def _assistant(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_use(block, at))
        elif kind in _THINKING:
            _thinking(block, kind, at)
        else:
            raise _unserved(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif not texts:
        message["content"] = ""
    return message


def _use(block: dict[str, Any], where: str) -> dict[str, Any]:
    _fields(block, _USE, where)
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise invalid(f"{where}: a tool_use takes id and name (non-empty strings)")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input must be an object")
    caller = block.get("caller")
    if caller is not None and caller != {"type": "direct"}:
        raise RefusedError(
            f"{where}.caller: only direct calls are served", code="unsupported_parameter"
        )
    text = orjson.dumps(arguments).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _thinking(block: dict[str, Any], kind: str, where: str) -> None:
    """A thinking block sent back: checked, left out."""
    allowed = _THINKING[kind]
    if allowed is None:  # redacted_thinking
        if set(block) != {"type", "data"} or not isinstance(block["data"], str):
            raise invalid(f"{where}: a redacted_thinking block takes data (a string)")
        return
    if set(block) - allowed or not all(
        isinstance(block.get(k), str) for k in ("thinking", "signature")
    ):
        raise invalid(f"{where}: a thinking block takes thinking and signature (strings)")
