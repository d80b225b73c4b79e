"""A Response's output items, written as the chat deltas come, and the numbered events that
tell a streaming client of them (pure).

Each run of one kind of delta is one output item, in the order the engine sent them:
reasoning text a ``reasoning`` item (its text as ``reasoning_text`` content: the gateway makes
no summaries), content text a ``message`` item with one ``output_text`` part, each tool call
(by its index) a ``function_call`` item whose arguments are its deltas joined. A turn with text
and calls keeps both. Events are numbered from 0 in the order made. A message's text carries
the engine's logprobs where it sent them (each delta event its own, the text all of them).
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from .._errors import UnverifiedError

__all__ = ["Events", "Output", "item_id"]

_DELTA = b',"delta":'


def item_id(prefix: str) -> str:
    """An ID as OpenAI's read: a prefix and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


class Events:
    """The numbered SSE events of one Response, kept until the writer takes them; none are
    made for a client that asked for no stream."""

    __slots__ = ("_kept", "_kept_seq", "_made", "_seq", "streaming")

    def __init__(self, *, streaming: bool) -> None:
        self.streaming = streaming
        self._made: list[bytes] = []
        self._seq = self._kept_seq = self._kept = 0

    def __call__(self, kind: str, **fields: Any) -> None:
        if not self.streaming:
            return
        fields = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self._made.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(fields) + b"\n\n")

    def delta(self, head: bytes, text: str, tail: bytes) -> None:
        """A text delta event, from its open item's fixed bytes (hot path: no dict made)."""
        if not self.streaming:
            return
        seq = self._seq
        self._seq = seq + 1
        self._made.append(head + str(seq).encode() + _DELTA + orjson.dumps(text) + tail)

    def take(self) -> bytes:
        """The events made since the last take, to be written."""
        made, self._made = self._made, []
        self._kept, self._kept_seq = 0, self._seq
        return b"".join(made)

    def keep(self) -> None:
        """Keep the events made so far whatever happens next (they wait for the next take)."""
        self._kept, self._kept_seq = len(self._made), self._seq

    def discard(self) -> None:
        """Forget the events made since the last take or keep (their numbers are given
        again)."""
        del self._made[self._kept :]
        self._seq = self._kept_seq


class _Open:
    """The output item being written: its kind (``message``, ``reasoning``, or a tool call's
    index), its place in the output, and its text (and a message's logprobs) so far."""

    __slots__ = ("delta_head", "delta_tail", "index", "item", "kind", "logprobs", "parts")

    def __init__(self, kind: str | int, item: dict[str, Any], index: int) -> None:
        self.kind, self.item, self.index = kind, item, index
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        # A text delta event's bytes but its number and text, made once per item: the event
        # as the general path writes it (a test holds them equal).
        name = "output_text" if kind == "message" else "reasoning_text"
        event = f"response.{name}.delta"
        self.delta_head = f'event: {event}\ndata: {{"type":"{event}","sequence_number":'.encode()
        ids = orjson.dumps({"item_id": item["id"], "output_index": index, "content_index": 0})
        self.delta_tail = (
            b"," + ids[1:-1] + (b',"logprobs":[]}\n\n' if kind == "message" else b"}\n\n")
        )

    def at(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": self.index}


class Output:
    """The output items of one Response (``items``), one open at a time. `mark` notes what
    the client has been sent; `rewind` goes back to it, so that a Response that fails holds
    what its client saw, not the text of the read that failed."""

    __slots__ = ("_calls", "_event", "_mark", "_open", "items")

    def __init__(self, event: Events) -> None:
        self.items: list[dict[str, Any]] = []
        self._event = event
        self._open: _Open | None = None
        self._calls: set[int] = set()
        """The tool calls' indexes begun (a closed one cannot take deltas again)."""
        self._mark: tuple[int, _Open | None, int, int, Any] = (0, None, 0, 0, None)

    def mark(self) -> None:
        """Note what the client has been sent (a tuple a write: this is on the hot path)."""
        o = self._open
        if o is None:
            self._mark = (len(self.items), None, 0, 0, None)
        else:
            self._mark = (len(self.items), o, len(o.parts), len(o.logprobs), o.item.get("name"))

    def rewind(self) -> None:
        """Back to the last `mark`, for a Response that fails there: the items, the open one's
        text and its name as they were (an item closed since is open again: its done events
        were never sent). Only the failure's close comes after, so no delta meets it."""
        n, o, parts, logprobs, name = self._mark
        del self.items[n:]
        self._open = o
        if o is not None:
            del o.parts[parts:]
            del o.logprobs[logprobs:]
            o.item["status"] = "in_progress"
            if name is not None:
                o.item["name"] = name

    def opens(self, kind: str | int) -> bool:
        """Whether a delta of ``kind`` begins an item (any but the open one's)."""
        o = self._open
        return o is None or o.kind != kind

    def text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        """Text of ``kind`` (``message`` or ``reasoning``), and a message's ``logprobs`` for it
        where the engine sent them (OpenAI's shape: `build.logprobs_of`)."""
        o = self._open
        if o is None or o.kind != kind:
            o = self._start(kind)
        o.parts.append(text)
        if logprobs is None:
            self._event.delta(o.delta_head, text, o.delta_tail)
            return
        o.logprobs += logprobs  # a message's only: reasoning text has none in a Response
        self._event(
            "response.output_text.delta", **o.at(), content_index=0, delta=text, logprobs=logprobs
        )

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        """A tool call's delta (its ID and name come with its first)."""
        o = self._open
        if o is None or o.kind != index:
            if index in self._calls:  # its done events are out: it cannot grow again
                raise UnverifiedError(
                    f"tool call {index} resumed after another item began (the Responses API "
                    "has no way to say so)"
                )
            self._calls.add(index)
            o = self._start(index, call_id, name)
        elif name and not o.item["name"]:
            o.item["name"] = name
        if arguments:
            o.parts.append(arguments)
            self._event("response.function_call_arguments.delta", **o.at(), delta=arguments)

    def _start(self, kind: str | int, call_id: str | None = None, name: str | None = None) -> _Open:
        self.close("completed")
        item: dict[str, Any]
        if kind == "message":
            item = {"id": item_id("msg"), "type": "message", "status": "in_progress"}
            item.update(role="assistant", content=[])
        elif kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            item["status"] = "in_progress"
        else:
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress"}
            item.update(call_id=call_id or item_id("call"), name=name or "", arguments="")
        o = self._open = _Open(kind, item, len(self.items))
        self.items.append(item)
        self._event("response.output_item.added", output_index=o.index, item=item)
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._event("response.content_part.added", **o.at(), content_index=0, part=part)
        return o

    def close(self, status: str, *, events: bool = True) -> None:
        """End the open item (with its done events, unless the answer failed)."""
        o, self._open = self._open, None
        if o is None:
            return
        text = "".join(o.parts)
        item, at = o.item, o.at()
        item["status"] = status
        event = self._event if events else _quiet
        if o.kind == "message":
            lp = o.logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lp}
            item["content"] = [part]
            event("response.output_text.done", **at, content_index=0, text=text, logprobs=lp)
            event("response.content_part.done", **at, content_index=0, part=part)
        elif o.kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            event("response.reasoning_text.done", **at, content_index=0, text=text)
        else:
            item["arguments"] = text
            event("response.function_call_arguments.done", **at, name=item["name"], arguments=text)
        event("response.output_item.done", output_index=o.index, item=item)


def _quiet(kind: str, **fields: Any) -> None:
    pass
