"""A verified chat stream folded into one Message (pure: no I/O).

`MessageBuilder` takes what the block reader folds (`add`, `add_texts`: the interface of the
chat `Assembler`) and writes it into the Message's content blocks (``blocks.py``), which for a
streaming client also makes Anthropic's events as the chunks come. What the Message holds and
sends is bounded (``max_bytes``, the gateway's bound on an assembled answer): its text, and
each block and delta at a fixed cost (`BLOCK_COST`, `DELTA_COST`), so that no run of small
deltas makes more than a few times the bound. Past it the answer fails, never comes back
shortened.

The engine's finish reason becomes the ``stop_reason``: ``stop`` is ``end_turn``, or
``stop_sequence`` where the engine names one of the request's stop sequences as what ended it,
or ``tool_use`` where the answer holds a tool call (as with ``tool_calls``); ``length`` is
``max_tokens``; ``content_filter`` is ``refusal``; any other (vLLM's ``abort``) fails the
answer. Usage is the engine's counts (`usage_of`).
"""

from __future__ import annotations

from typing import Any

from .._errors import EngineError
from .._relay.figures import Figures
from .._relay.verify import TemplateText
from .blocks import Blocks, Events, new_id
from .request import Asked

__all__ = ["BLOCK_COST", "DELTA_COST", "MessageBuilder", "usage_of"]

BLOCK_COST = 256
"""What each content block counts against the answer's bound beyond its text: its start and
stop events, and its place in the Message."""
DELTA_COST = 128
"""What each delta counts beyond its text: its event (about a hundred bytes)."""
_REASONING = ("reasoning_content", "reasoning")
_STOPS = {"length": "max_tokens", "content_filter": "refusal"}
_WHOLE = (None, "stop", "tool_calls")
"""The finish reasons of an answer the engine ended whole, or at its bound."""


class MessageBuilder:
    """One Message, built from a verified chat stream (see the module's text)."""

    __slots__ = ("_asked", "_blocks", "_max", "_size", "events", "finish", "message", "said")

    def __init__(self, asked: Asked, *, model: str, max_bytes: int, streaming: bool) -> None:
        self.events = Events(streaming=streaming)
        self._asked = asked
        self._blocks = Blocks(self.events, shown=asked.show_thinking)
        self.message: dict[str, Any] = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": self._blocks.content,
            "stop_reason": None,
            "stop_sequence": None,
            # Not known before the engine's last chunk: message_delta carries the counts.
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        self.finish: Any = None
        self.said: Any = None
        """What the engine names as the stop string that ended the answer, if it does."""
        self._size = 0
        self._max = max_bytes
        self.events("message_start", message=self.message)
        self.events("ping")
        self.events.keep()

    def add(self, chunk: dict[str, Any] | TemplateText) -> None:
        if isinstance(chunk, TemplateText):
            self._text(chunk.key, chunk.text)
            return
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for key in _REASONING:
                self._text(key, delta.get(key))
            self._text("content", delta.get("content"))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                arguments = fn.get("arguments") or ""
                index = call["index"]
                self._grow(index, _size(arguments) + DELTA_COST)
                self._blocks.call(index, call.get("id"), fn.get("name"), arguments)
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finish = finish
                stop_key = self._asked.stop_key
                self.said = choice.get(stop_key) if stop_key is not None else None

    def add_texts(self, key: str, texts: list[str], extra: dict[str, Any]) -> None:
        for text in texts:
            self._text(key, text)

    def take(self) -> bytes:
        """The events made since the last take, to be written: what the client is sent."""
        self._blocks.mark()
        return self.events.take()

    def discard(self) -> None:
        """Forget what was made since the last take (the read that failed)."""
        self.events.discard()
        self._blocks.rewind()

    def finished(self, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The Message, whole (its last events made)."""
        if self.finish not in _WHOLE and self.finish not in _STOPS:
            said = (
                self.finish if isinstance(self.finish, str) and self.finish.isidentifier() else "?"
            )
            raise EngineError(f"the engine ended the answer with finish_reason {said[:32]!r}")
        if usage is None:
            raise EngineError("the engine reported no token counts, which a Message carries")
        self._blocks.close()
        m = self.message
        reason = _STOPS.get(self.finish)
        if reason is None:
            reason = "tool_use" if self._blocks.called else "end_turn"
            if reason == "end_turn" and self.said in self._asked.stop_sequences:
                reason, m["stop_sequence"] = "stop_sequence", self.said
        m["stop_reason"], m["usage"] = reason, usage
        delta = {"stop_reason": reason, "stop_sequence": m["stop_sequence"]}
        self.events("message_delta", delta=delta, usage=usage)
        self.events("message_stop")
        return m

    def _text(self, key: str, text: str | None) -> None:
        if text:
            kind = "text" if key == "content" else "thinking"
            self._grow(kind, _size(text) + DELTA_COST)
            self._blocks.text(kind, text)

    def _grow(self, kind: str | int, n: int) -> None:
        """Count ``n`` bytes of a delta of ``kind`` (and its block's, where it begins one)
        against the bound, before anything of it is made."""
        if self._blocks.opens(kind):
            n += BLOCK_COST
        self._size += n
        if self._size > self._max:
            raise EngineError(f"the answer is over {self._max} bytes (limits.max_answer_bytes)")


def usage_of(usage: dict[str, Any] | None, figures: Figures) -> dict[str, Any] | None:
    """The Message's ``usage`` from the engine's counts and the answer's ``cached_tokens``
    figure (each engine's own count, absent where it gave none or the deployment withholds
    it). Anthropic counts cached input apart: ``input_tokens`` is the prompt's tokens less those
    read from the cache (``cache_read_input_tokens``); ``cache_creation_input_tokens`` is 0,
    as no engine here keeps a cache it bills writes to. Where the cached count is not known,
    ``input_tokens`` is the whole prompt's and neither cache count is given. None where the
    engine gave no counts."""
    if not usage:
        return None
    given, made = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(given) is not int or type(made) is not int:
        return None
    out: dict[str, Any] = {"input_tokens": given, "output_tokens": made}
    cached = figures.get("cached_tokens", {}).get("value")
    if type(cached) is int and 0 <= cached <= given:
        out["input_tokens"] = given - cached
        out["cache_creation_input_tokens"], out["cache_read_input_tokens"] = 0, cached
    details = usage.get("completion_tokens_details")
    thinking = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if type(thinking) is int:
        out["output_tokens_details"] = {"thinking_tokens": thinking}
    return out


def _size(text: str) -> int:
    """``text``'s size in UTF-8 bytes, the bound's unit."""
    return len(text) if text.isascii() else len(text.encode())
