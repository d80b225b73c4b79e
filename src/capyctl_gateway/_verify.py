"""Verifying every chunk an engine streams, and noting what the metrics need (hot path).

A chunk is relayed only once it passed these checks; the first one that fails ends the client's
stream as unverified. The delta keys allowed are the spec's streamed-field table for the engine.

Most of a stream is text chunks that differ from one another only in their text. Once such a
chunk has passed every check, it becomes a template: a later chunk that is byte for byte the
template with another valid JSON string as its text is the same chunk in every respect the
checks look at, so it is relayed without being parsed as a whole. Anything else (another id,
time, key, a finish, usage) takes the full check, and may become the next template.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import orjson

from ._config import EngineFamily

__all__ = ["ChunkVerifier", "EngineRejectedError", "TemplateText", "UnverifiedError"]

DELTA_KEYS: dict[EngineFamily, frozenset[str]] = {
    EngineFamily.VLLM: frozenset({"role", "content", "reasoning", "tool_calls"}),
    EngineFamily.SGLANG: frozenset({"role", "content", "reasoning_content", "tool_calls"}),
    EngineFamily.TENSORFOLD: frozenset({"role", "content", "reasoning_content", "tool_calls"}),
    EngineFamily.LLAMACPP: frozenset({"role", "content", "reasoning_content", "tool_calls"}),
}
FINISH_REASONS = frozenset({None, "stop", "length", "content_filter", "tool_calls"})
TEXT_KEYS = ("content", "reasoning_content", "reasoning")
TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
FUNCTION_KEYS = frozenset({"name", "arguments"})
ENGINE_OBJECTS = ("metrics", "timings", "tensorfold")
_CHUNK_FRAME = frozenset({"id", "object", "created", "model", "choices"})
"""A chunk's keys that are not chunk-level fields of the answer (usage, metrics, ...)."""


class TemplateText(NamedTuple):
    """A chunk that is the verifier's template but for its text."""

    text: str
    extra: dict[str, Any]
    """The template's non-null chunk-level fields (system_fingerprint, ...)."""
    key: str = "content"
    """The delta key the text is under: content, or the engine's reasoning key."""


class UnverifiedError(Exception):
    """The engine's stream broke a rule: nothing more of it may reach the client."""


class EngineRejectedError(Exception):
    """The engine refused the request inside its stream, before any chunk."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise UnverifiedError("a chunk repeats a JSON key")
    return d


class ChunkVerifier:
    """Checks one engine stream chunk by chunk and keeps what the answer's metrics need."""

    __slots__ = (
        "_delta_keys",
        "_head",
        "_head_len",
        "_out_head",
        "_out_tail",
        "_tail",
        "_tail_len",
        "answered",
        "chunks",
        "engine_objects",
        "finished",
        "first_output_at",
        "first_text_at",
        "id",
        "last_at",
        "_model_out",
        "_model_raw",
        "_template_extra",
        "_template_key",
        "public",
        "served",
        "usage",
    )

    def __init__(self, family: EngineFamily, *, served: str, public: str) -> None:
        self._delta_keys = DELTA_KEYS[family]
        self.served = served
        self.public = public
        # A chunk written as orjson writes it (compact, keys once, numbers and strings in their
        # shortest form, as the engines write them) re-serialises to its own bytes with only
        # the model renamed.
        self._model_raw = b'"model":' + orjson.dumps(served)
        self._model_out = b'"model":' + orjson.dumps(public)
        self.id: str | None = None
        self.finished = False
        self.chunks = 0
        self.answered = False
        """Some generated text arrived (for settling a cut request)."""
        self.first_output_at: float | None = None
        """First chunk that is more than an opening role (for the request deadline)."""
        self.first_text_at: float | None = None
        self.last_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self.engine_objects: dict[str, Any] = {}
        # The template: an engine chunk is _head + text + _tail; the client gets
        # _out_head + text + _out_tail (framed as an SSE event, model renamed).
        self._head = self._tail = self._out_head = self._out_tail = b""
        self._head_len = self._tail_len = -1
        self._template_extra: dict[str, Any] = {}
        self._template_key = "content"

    def relay(self, raw: bytes, now: float) -> bytes:
        """Verify one chunk of a stream that goes to the client; return its SSE event."""
        found = self._template_text(raw, now)
        if found is not None:
            return self._out_head + found[0] + self._out_tail
        chunk, out = self.check(raw, now)
        self._learn(raw, chunk, out)
        return b"data: " + out + b"\n\n"

    def collect(self, raw: bytes, now: float) -> dict[str, Any] | TemplateText:
        """Verify one chunk of a stream the gateway assembles: the chunk, or, when it matches
        the template, its text and the template's chunk-level fields."""
        found = self._template_text(raw, now)
        if found is not None:
            return TemplateText(found[1], self._template_extra, self._template_key)
        chunk, out = self.check(raw, now)
        self._learn(raw, chunk, out)
        return chunk

    def _template_text(self, raw: bytes, now: float) -> tuple[bytes, str] | None:
        """The text of a chunk that is the template but for its text, as written and
        decoded, with the full check's bookkeeping done; else None."""
        head_len = self._head_len
        if (
            head_len < 0
            or not raw.startswith(self._head)
            or not raw.endswith(self._tail)
            or len(raw) < head_len + self._tail_len
            or self.finished
        ):
            return None
        written = raw[head_len : len(raw) - self._tail_len]
        try:
            text = orjson.loads(b'"' + written + b'"')  # a whole JSON string, nothing more
        except orjson.JSONDecodeError:
            return None  # the full check says what is wrong with it
        self.chunks += 1
        self.last_at = now
        if text:  # the same bookkeeping as the full check's for a text chunk
            if self.first_text_at is None:
                self.first_text_at = now
                self.answered = True
            if self.first_output_at is None:
                self.first_output_at = now
        return written, text

    def _learn(self, raw: bytes, chunk: dict[str, Any], out: bytes) -> None:
        """Make ``chunk`` the template if it is a plain text chunk found in its own bytes."""
        choices = chunk["choices"]
        if self.finished or len(choices) != 1 or "usage" in chunk and chunk["usage"] is not None:
            return
        choice = choices[0]
        delta = choice["delta"]
        if len(delta) != 1:
            return
        ((key, text),) = delta.items()
        if key not in TEXT_KEYS or type(text) is not str:
            return
        if choice.get("logprobs") is not None or any(
            chunk.get(key) is not None for key in ENGINE_OBJECTS
        ):
            return
        name = b'"' + key.encode() + b'":'
        needle = name + orjson.dumps(text)
        at = raw.find(needle)
        out_at = out.find(needle)
        if (
            at < 0
            or out_at < 0
            or raw.find(needle, at + 1) >= 0
            or out.find(needle, out_at + 1) >= 0
        ):
            return  # written another way, or twice: no template
        cut = len(name) + 1  # past the opening quote of the text
        back = len(needle) - 1  # to its closing quote
        self._head = raw[: at + cut]
        self._tail = raw[at + back :]
        self._out_head = b"data: " + out[: out_at + cut]
        self._out_tail = out[out_at + back :] + b"\n\n"
        self._head_len, self._tail_len = len(self._head), len(self._tail)
        self._template_extra = {
            k: v for k, v in chunk.items() if k not in _CHUNK_FRAME and v is not None
        }
        self._template_key = key

    def check(self, raw: bytes, now: float) -> tuple[dict[str, Any], bytes]:
        """Parse and verify one chunk; return it with ``model`` set to the public name, and
        its serialisation for the client."""
        try:
            chunk = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UnverifiedError("a chunk is not valid JSON") from None
        if type(chunk) is not dict:
            raise UnverifiedError("a chunk is not a JSON object")
        if "error" in chunk:
            self._error_event(chunk)
        if chunk.get("object") != "chat.completion.chunk":
            raise UnverifiedError("a chunk is not a chat.completion.chunk")
        cid = chunk.get("id")
        if self.id is None:
            if type(cid) is not str or not cid:
                raise UnverifiedError("a chunk has no id")
            self.id = cid
        elif cid != self.id:
            raise UnverifiedError("the chunk id changed within the stream")
        if chunk.get("model") != self.served:
            raise UnverifiedError("a chunk names another model")
        created = chunk.get("created")
        if type(created) is not int or created < 0:
            raise UnverifiedError("a chunk has no creation time")
        choices = chunk.get("choices")
        if type(choices) is not list:
            raise UnverifiedError("a chunk has no choices list")
        output = False
        if choices:
            if len(choices) != 1:
                raise UnverifiedError("a chunk carries more than one choice")
            if self.finished:
                raise UnverifiedError("a choice arrived after the finish")
            output = self._choice(choices[0], now)
        elif type(chunk.get("usage")) is not dict:
            raise UnverifiedError("a chunk without choices carries no usage")
        usage = chunk.get("usage")
        if usage is not None:
            if type(usage) is not dict:
                raise UnverifiedError("usage is not an object")
            self.usage = usage
            output = True
        for key in ENGINE_OBJECTS:
            value = chunk.get(key)
            if value is not None:
                self.engine_objects[key] = value
        if output and self.first_output_at is None:
            self.first_output_at = now
        self.chunks += 1
        self.last_at = now
        chunk["model"] = self.public
        out = orjson.dumps(chunk)
        # orjson keeps the last of repeated keys silently, so a chunk with a repeated key does
        # not re-serialise to its own bytes. Neither does one written another way (spaces,
        # escapes, numbers spelled differently): those take the exact, slower check.
        if out != raw.replace(self._model_raw, self._model_out, 1):
            try:
                json.loads(raw, object_pairs_hook=_reject_duplicates)
            except ValueError:
                raise UnverifiedError("a chunk repeats a JSON key") from None
        return chunk, out

    def _choice(self, choice: Any, now: float) -> bool:
        if type(choice) is not dict or choice.get("index") != 0:
            raise UnverifiedError("the choice is not choice 0")
        delta = choice.get("delta")
        if type(delta) is not dict:
            raise UnverifiedError("the choice has no delta")
        for key in delta:
            if key not in self._delta_keys:
                raise UnverifiedError(
                    f"the delta carries {key!r}, which is not verified for this engine"
                )
        role = delta.get("role")
        if role is not None and role != "assistant":
            raise UnverifiedError("the delta names a role other than assistant")
        text = False
        for key in TEXT_KEYS:
            value = delta.get(key)
            if value is not None:
                if type(value) is not str:
                    raise UnverifiedError(f"delta {key} is not a string")
                if value:
                    text = True
        calls = delta.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls)
        finish = choice.get("finish_reason")
        if finish not in FINISH_REASONS:
            raise UnverifiedError(f"finish_reason {finish!r} is not one the gateway knows")
        if text and self.first_text_at is None:
            self.first_text_at = now
            self.answered = True
        if finish is not None:
            self.finished = True
        # Only a chunk that opens the reply (a role and nothing else) is not output.
        return bool(text or calls or finish or choice.get("logprobs"))

    def _error_event(self, chunk: dict[str, Any]) -> None:
        err = chunk.get("error")
        status = err.get("code") if type(err) is dict else None
        message = err.get("message") if type(err) is dict else None
        if self.chunks == 0 and status in (400, 413, 422):
            raise EngineRejectedError(status, str(message or "rejected by the engine"))
        self.answered = True  # the engine answered, with an error
        raise UnverifiedError(f"the engine sent an error event: {str(message)[:200]}")

    def verify_end(self, done: bool) -> None:
        """At the end of the engine's stream: it must have finished and said [DONE]."""
        if not done:
            raise UnverifiedError("the engine stream ended without [DONE]")
        if not self.finished:
            raise UnverifiedError("the engine said [DONE] before any finish_reason")


def _check_tool_calls(calls: Any) -> None:
    if type(calls) is not list:
        raise UnverifiedError("delta tool_calls is not a list")
    for call in calls:
        if type(call) is not dict or not TOOL_CALL_KEYS.issuperset(call):
            raise UnverifiedError("a tool call has unknown keys")
        if type(call.get("index")) is not int:
            raise UnverifiedError("a tool call has no integer index")
        if call.get("id") is not None and type(call.get("id")) is not str:
            raise UnverifiedError("a tool call id is not a string")
        if call.get("type") not in (None, "function"):
            raise UnverifiedError("a tool call type is not function")
        fn = call.get("function")
        if fn is not None:
            if type(fn) is not dict or not FUNCTION_KEYS.issuperset(fn):
                raise UnverifiedError("a tool call function has unknown keys")
            if any(v is not None and type(v) is not str for v in fn.values()):
                raise UnverifiedError("a tool call function field is not a string")
