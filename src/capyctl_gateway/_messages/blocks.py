"""A Message's content blocks, written as the chat deltas come, and the SSE events that tell
a streaming client of them (pure).

Each run of one kind of delta is one content block, in the order the engine sent them:
reasoning text a ``thinking`` block (its ``signature`` empty: the gateway signs nothing), content
text a ``text`` block, each tool call (by its index) a ``tool_use`` block whose ``input`` is its
argument deltas joined, which must make a JSON object. Every event carries its ``event:`` line
(Anthropic's SDKs skip an event without one).
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from .._errors import EngineError, UnverifiedError

__all__ = ["Blocks", "Events", "new_id"]


def new_id(prefix: str) -> str:
    """An ID as Anthropic's look: a prefix and 24 hex digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


class Events:
    """The SSE events of one Message, kept until the writer takes them; none are made for a
    client that asked for no stream."""

    __slots__ = ("_kept", "_made", "streaming")

    def __init__(self, *, streaming: bool) -> None:
        self.streaming = streaming
        self._made: list[bytes] = []
        self._kept = 0

    def __call__(self, kind: str, **fields: Any) -> None:
        if self.streaming:
            data = orjson.dumps({"type": kind, **fields})
            self._made.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    def delta(self, head: bytes, text: str) -> None:
        """A delta event from its open block's fixed head (hot path: no dict made)."""
        if self.streaming:
            self._made.append(head + orjson.dumps(text) + b"}}\n\n")

    def take(self) -> bytes:
        made, self._made = self._made, []
        self._kept = 0
        return b"".join(made)

    def keep(self) -> None:
        """Keep the events made so far whatever happens next."""
        self._kept = len(self._made)

    def discard(self) -> None:
        """Forget the events made since the last take or keep."""
        del self._made[self._kept :]


_DELTA_KEYS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class _Open:
    """The block being written: its kind (``text``, ``thinking`` or a tool call's index), its
    place in the content, its text so far, and its delta events' head."""

    __slots__ = ("block", "head", "index", "kind", "parts")

    def __init__(self, kind: str | int, block: dict[str, Any], index: int) -> None:
        self.kind, self.block, self.index = kind, block, index
        self.parts: list[str] = []
        named = _DELTA_KEYS.get(kind) if isinstance(kind, str) else None
        delta, key = named or ("input_json_delta", "partial_json")
        self.head = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
            b'"delta":{"type":"%s","%s":' % (index, delta.encode(), key.encode())
        )


class Blocks:
    """The content blocks of one Message (``content``), one open at a time. `mark` notes what
    the client has been sent; `rewind` goes back to it, so that a failed read's text is
    neither sent nor kept."""

    __slots__ = ("_calls", "_event", "_mark", "_open", "_shown", "content")

    def __init__(self, event: Events, *, shown: bool) -> None:
        self.content: list[dict[str, Any]] = []
        self._event = event
        self._open: _Open | None = None
        self._calls: set[int] = set()
        self._shown = shown
        """Whether thinking text is sent (``display: omitted`` sends empty thinking blocks)."""
        self._mark: tuple[int, _Open | None, int] = (0, None, 0)

    def mark(self) -> None:
        o = self._open
        self._mark = (len(self.content), o, 0 if o is None else len(o.parts))

    def rewind(self) -> None:
        n, o, parts = self._mark
        del self.content[n:]
        self._open = o
        if o is not None:
            del o.parts[parts:]

    def opens(self, kind: str | int) -> bool:
        """Whether a delta of ``kind`` begins a block (any but the open one's)."""
        o = self._open
        return o is None or o.kind != kind

    @property
    def called(self) -> bool:
        """Whether the answer holds a tool call."""
        return bool(self._calls)

    def text(self, kind: str, text: str) -> None:
        """Text of ``kind`` (``text`` or ``thinking``)."""
        o = self._open
        if o is None or o.kind != kind:
            o = self._start(kind)
        if kind == "thinking" and not self._shown:
            return  # counted, not kept or sent
        o.parts.append(text)
        self._event.delta(o.head, text)

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        """A tool call's delta (its ID and name come with its first)."""
        o = self._open
        if o is None or o.kind != index:
            if index in self._calls:
                raise UnverifiedError(
                    f"tool call {index} resumed after another block began (a Message has no "
                    "way to say so)"
                )
            if not name:
                raise UnverifiedError(f"tool call {index} began without its function's name")
            self._calls.add(index)
            o = self._start(index, call_id, name)
        if arguments:
            o.parts.append(arguments)
            self._event.delta(o.head, arguments)

    def _start(self, kind: str | int, call_id: str | None = None, name: str | None = None) -> _Open:
        self.close()
        block: dict[str, Any]
        if kind == "text":
            block = {"type": "text", "text": ""}
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "tool_use", "id": call_id or new_id("toolu"), "name": name}
            block["input"] = {}
        o = self._open = _Open(kind, block, len(self.content))
        self.content.append(block)
        self._event("content_block_start", index=o.index, content_block=block)
        return o

    def close(self) -> None:
        """End the open block (its text whole, a tool call's input parsed) with its stop."""
        o, self._open = self._open, None
        if o is None:
            return
        text, block = "".join(o.parts), o.block
        if isinstance(o.kind, str):
            block[o.kind] = text
        elif text:
            try:
                block["input"] = orjson.loads(text)
            except orjson.JSONDecodeError:
                block["input"] = None
            if not isinstance(block["input"], dict):
                raise EngineError(
                    f"tool call {block['name']!r}: its arguments are not a JSON object, which "
                    "a tool_use block's input must be"
                )
        self._event("content_block_stop", index=o.index)
