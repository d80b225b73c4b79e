"""Answers and events held strictly to the official ``anthropic`` SDK's own types: each is
validated in pydantic's strict mode (no coercion, every required field present), and no model
in it, however deep, may carry a field its type does not declare (the SDK's models allow
extra fields; here none is allowed)."""

from __future__ import annotations

from typing import Any

import orjson
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import BaseModel, TypeAdapter

__all__ = ["sse_events", "validate_count", "validate_error", "validate_event", "validate_message"]

_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def _no_extra(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        extra = value.__pydantic_extra__ or {}
        assert not extra, f"{path}: fields the SDK's type does not declare: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_extra(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_extra(item, f"{path}[{i}]")


def validate_message(doc: Any) -> Message:
    message = Message.model_validate(doc, strict=True)
    _no_extra(message, "message")
    return message


def validate_event(doc: Any) -> Any:
    """A stream event: one of the SDK's ``RawMessageStreamEvent``, a ping, or an error."""
    if doc.get("type") == "ping":
        assert doc == {"type": "ping"}, doc
        return doc
    if doc.get("type") == "error":
        return validate_error(doc)
    event = _EVENT.validate_python(doc, strict=True)
    _no_extra(event, doc["type"])
    return event


def validate_error(doc: Any) -> ErrorResponse:
    """An error body or event (``request_too_large``, which Anthropic's reference lists with
    413 and the SDK's union of error objects lacks, is held to the same fields by hand)."""
    if doc.get("error", {}).get("type") == "request_too_large":
        assert set(doc) <= {"type", "error", "request_id"} and doc["type"] == "error", doc
        assert set(doc["error"]) == {"type", "message"}, doc
        doc = {**doc, "error": {**doc["error"], "type": "invalid_request_error"}}
    error = ErrorResponse.model_validate(doc, strict=True)
    _no_extra(error, "error")
    return error


def validate_count(doc: Any) -> MessageTokensCount:
    count = MessageTokensCount.model_validate(doc, strict=True)
    _no_extra(count, "count")
    return count


def sse_events(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A Messages stream's events (each with its ``event:`` line, which the SDK needs, and each
    validated), and its comment lines."""
    events, comments = [], []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        data = [line[6:] for line in lines if line.startswith("data: ")]
        comments += [line for line in lines if line.startswith(":")]
        if data:
            (payload,) = data
            ev = orjson.loads(payload)
            names = [line[7:] for line in lines if line.startswith("event: ")]
            assert names == [ev["type"]], block
            validate_event(ev)
            events.append(ev)
    return events, comments
