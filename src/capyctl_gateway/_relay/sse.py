"""Incremental SSE decoding of an engine's chat stream (pure, no I/O).

Only ``data:`` fields and comments may appear: a comment (llama.cpp's keep-alive pings) is
dropped, any other field line makes the stream unverified. Lines end in ``\\n`` with an
optional ``\\r``; an event ends at a blank line; its data lines are joined with ``\\n``.
"""

from __future__ import annotations

from .._errors import SSEError

__all__ = ["DONE", "MAX_EVENT_BYTES", "SSEDecoder", "SSEError"]

DONE = b"[DONE]"
MAX_EVENT_BYTES = 64 * 1024


class SSEDecoder:
    """Feed it blocks of bytes as they arrive; it returns the complete events' data."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, block: bytes) -> list[bytes]:
        buf = self._buf + block if self._buf else block
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        if len(self._buf) > MAX_EVENT_BYTES:
            raise SSEError("an event line is longer than 64 KiB")
        events: list[bytes] = []
        data = self._data
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
            elif line.startswith(b":"):
                continue
            else:
                name = line.split(b":", 1)[0][:40].decode("ascii", "replace")
                raise SSEError(f"the stream carries a {name!r} field, not only data")
        if len(data) > 16 and sum(map(len, data)) > MAX_EVENT_BYTES:
            raise SSEError("an event is longer than 64 KiB")
        return events

    def whole_events(self, block: bytes) -> list[bytes] | None:
        """``block``'s events when it holds whole events only and nothing of an event is held
        (each still with its ``data: ``, if it has one), for a reader that takes them in place;
        else None (`feed` takes it)."""
        # `find`, not `in`: CPython 3.11's bytes `in` first tries its operand as an integer,
        # and makes and drops a TypeError (about 1,900 instructions) before it searches
        if self._buf or self._data or block.find(b"\r") >= 0:
            return None
        parts = block.split(b"\n\n")
        if parts.pop():  # the block ends inside an event
            return None
        return parts

    def feed_events(self, events: list[bytes]) -> None:
        """Read whole ``events`` (`whole_events`' parts) as `feed` would, for what follows
        ``[DONE]`` in its block: read but not verified, so bytes there that are not SSE still
        fail the stream."""
        if events:
            self.feed(b"\n\n".join(events) + b"\n\n")

    @property
    def idle(self) -> bool:
        """Nothing of an event held: the next block starts at a line's start, in no event."""
        return not self._buf and not self._data

    @property
    def pending(self) -> bool:
        """Bytes or data lines of an event not yet terminated."""
        return bool(self._buf.strip() or self._data)
