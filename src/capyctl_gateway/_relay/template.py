"""The verifier's fast path for text chunks (hot path).

Most of a stream is text chunks that differ from one another only in their text. Once such a
chunk has passed every check it becomes the template: a later chunk that is byte for byte the
template with another valid JSON string as its text is the same chunk in every respect the
checks look at, so it needs no whole parse. The verifier owns the bookkeeping; this module only
recognises such chunks and learns new templates.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from .._engines import FIGURE_OBJECTS

__all__ = ["ENGINE_OBJECTS", "TEXT_KEYS", "Template", "TemplateText"]

TEXT_KEYS = ("content", "reasoning_content", "reasoning")
ENGINE_OBJECTS = FIGURE_OBJECTS
"""The engines' own figure objects a chunk may carry (from the engine facts table)."""
CHUNK_FRAME = frozenset({"id", "object", "created", "model", "choices"})
"""A chunk's keys that are not chunk-level fields of the answer (usage, metrics, ...)."""


class TemplateText(NamedTuple):
    """A chunk that is the verifier's template but for its text."""

    text: str
    extra: dict[str, Any]
    """The template's non-null chunk-level fields (system_fingerprint, ...)."""
    key: str = "content"
    """The delta key the text is under: content, or the engine's reasoning key."""


class Template:
    """An engine chunk is ``head + text + tail``; the client gets ``out_head + text +
    out_tail`` (framed as an SSE event, model renamed)."""

    __slots__ = (
        "data_head",
        "extra",
        "head",
        "head_len",
        "key",
        "out_close",
        "out_head",
        "out_open",
        "out_tail",
        "shape",
        "tail",
        "tail_event",
        "tail_len",
    )

    def __init__(self) -> None:
        self.head = self.tail = self.out_head = self.out_tail = self.out_open = self.out_close = b""
        self.data_head = self.tail_event = b""
        """The head as an SSE event starts: ``data: `` and the head."""
        self.head_len = self.tail_len = -1
        self.extra: dict[str, Any] = {}
        """The template's non-null chunk-level fields (system_fingerprint, ...)."""
        self.key = "content"
        """The delta key the text is under: content, or the engine's reasoning key."""
        self.shape: tuple[int, bytes, bytes, int, int, int, bytes, bytes] = (
            -1,
            b"",
            b"",
            0,
            0,
            0,
            b"",
            b"",
        )
        """What the block reader's loops keep in locals, read again only after a chunk the
        template does not take: ``(head_len, data_head, tail, least, at, back, out_open,
        out_close)``. An event ``data_head + text + tail`` of ``least`` bytes at least has its
        text with its quotes at ``[at:len - back]``; its client gets ``out_open``, that, then
        ``out_close``: one slice a chunk, no concatenation."""

    def match(self, raw: bytes) -> tuple[bytes, str] | None:
        """The text of ``raw`` as written (within its quotes: what goes between `out_open`
        and `out_close`) and decoded, if ``raw`` is the template but for its text; else
        None."""
        head_len = self.head_len
        if (
            head_len < 0
            or not raw.startswith(self.head)
            or not raw.endswith(self.tail)
            or len(raw) < head_len + self.tail_len
        ):
            return None
        quoted = raw[head_len - 1 : len(raw) - self.tail_len + 1]
        try:  # the text within its quotes (the head's last byte, the tail's first), as written
            text = orjson.loads(quoted)  # a whole JSON string, nothing more
        except orjson.JSONDecodeError:
            return None  # the full check says what is wrong with it
        return quoted, text

    def learn(self, raw: bytes, chunk: dict[str, Any], out: bytes, *, finished: bool) -> None:
        """Make ``chunk`` the template if it is a plain text chunk found in its own bytes."""
        choices = chunk["choices"]
        if finished or len(choices) != 1 or "usage" in chunk and chunk["usage"] is not None:
            return
        choice = choices[0]
        delta = choice["delta"]
        if len(delta) != 1:
            return
        ((key, text),) = delta.items()
        if key not in TEXT_KEYS or type(text) is not str:
            return
        if choice.get("logprobs") is not None:
            return
        for name in ENGINE_OBJECTS:
            if chunk.get(name) is not None:
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
        self.head = raw[: at + cut]
        self.data_head = b"data: " + self.head
        self.tail = raw[at + back :]
        self.tail_event = self.tail + b"\n\n"
        self.out_head = b"data: " + out[: out_at + cut]
        self.out_tail = out[out_at + back :] + b"\n\n"
        self.head_len, self.tail_len = len(self.head), len(self.tail)
        # The head ends with the text's opening quote and the tail begins with its closing one
        # (in the engine's bytes and in the client's alike): a slice holds the text quoted.
        self.out_open, self.out_close = self.out_head[:-1], self.out_tail[1:]
        self.shape = (  # least: an event with no text; its quoted text past "data: ", to the end
            self.head_len,
            self.data_head,
            self.tail,
            self.head_len + 6 + self.tail_len,
            self.head_len + 5,
            self.tail_len - 1,
            self.out_open,
            self.out_close,
        )
        self.extra = {k: v for k, v in chunk.items() if k not in CHUNK_FRAME and v is not None}
        self.key = key
