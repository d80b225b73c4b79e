"""One block of an engine's stream at a time: decoded and verified in one pass (hot path).

Engines write whole events, one ``data:`` line each, and most of them are text chunks that
match the verifier's template (``template.py``). For a block made only of whole events, the
reader splits it at the blank lines and matches each event against the template in place,
without first copying out its data; text chunks are counted once per run of them. Any event
it cannot take that way (the opening role, the finish, usage, a comment, a changed field)
goes through `ChunkVerifier.relay` or `collect` as before, and the first one that is not a
single ``data:`` line sends the rest of the block through the line-by-line `SSEDecoder`. A
block that does not end at an event's end, or has a carriage return, takes the decoder whole.

The verdicts, the bytes for the client, the assembled answer and the verifier's bookkeeping
are those of decoding and verifying event by event (a property test holds them to it), but in
a block with bytes that are not SSE: the decoder, reading the whole block first, refuses it
before any of its chunks is checked; the reader checks the chunks before those bytes first, so
a chunk there that fails is the fault reported, and those that pass are counted as read.
Either way the stream ends unverified and nothing of that block reaches the client.
"""

from __future__ import annotations

import orjson

from .assemble import Folding
from .sse import DONE, SSEDecoder
from .verify import ChunkVerifier

__all__ = ["BlockReader"]

_DATA = b"data: "
_DONE_EVENT = b"data: [DONE]"
_loads = orjson.loads
_JSONError = orjson.JSONDecodeError


class BlockReader:
    """Decodes and verifies an engine's stream block by block.

    The template test is written out where each loop needs it rather than called: a call per
    chunk would cost about a tenth of a chunk's whole relay when many come in one read."""

    __slots__ = ("decoder", "verifier")

    def __init__(self, verifier: ChunkVerifier, decoder: SSEDecoder | None = None) -> None:
        self.verifier = verifier
        self.decoder = decoder or SSEDecoder()

    def relay(self, block: bytes, now: float) -> tuple[list[bytes], bool]:
        """The SSE events for the client from ``block``, and whether ``[DONE]`` came."""
        v = self.verifier
        t = v.template
        head_len = t.head_len
        # A generating engine's usual read: one text chunk, whole: its first line break is its
        # last but one byte. (A carriage return would put a control character in the text:
        # the parse refuses it.) A read of several events, from an engine that got ahead of
        # us, is told apart here rather than by a failed parse, whose error is costly to make.
        if (
            head_len >= 0
            and block.startswith(t.data_head)
            and block.endswith(t.tail_event)
            and len(block) >= head_len + t.tail_len + 8
            and block.find(b"\n") == len(block) - 2
            and not v.finished
            and self.decoder.idle
        ):
            quoted = block[head_len + 5 : len(block) - t.tail_len - 1]  # the text, as written
            try:
                text = _loads(quoted)  # a whole JSON string, nothing more
            except _JSONError:
                pass  # the full check says what is wrong with it
            else:
                v.text_chunks(1, bool(text), now)
                return [t.out_open + quoted + t.out_close], False
        return self._relay_events(block, now)

    def _relay_events(self, block: bytes, now: float) -> tuple[list[bytes], bool]:
        """`relay` of any other read: several events (an engine that got ahead of us), whole,
        each matched against the template in place or else verified alone; or part of an
        event, or what is not only ``data:`` lines, which the decoder takes (one call a read,
        not a chunk)."""
        v = self.verifier
        t = v.template
        out: list[bytes] = []
        rest = self.decoder.whole_events(block)
        if rest is not None:
            run: list[bytes] = []  # template chunks not yet counted (their texts, quoted)
            seen_text = False  # whether one of them carried text
            head_len, data_head, tail, least, at, back, out_open, out_close = t.shape
            for i, part in enumerate(rest):
                if (
                    head_len >= 0
                    and part.startswith(data_head)
                    and part.endswith(tail)
                    and len(part) >= least
                    and not v.finished
                ):
                    quoted = part[at : len(part) - back]  # the text within its quotes
                    try:
                        text = _loads(quoted)  # a whole JSON string, nothing more
                    except _JSONError:
                        pass  # the full check says what is wrong with it
                    else:
                        run.append(quoted)
                        seen_text = seen_text or bool(text)
                        continue
                if run:  # the run's events: one join, not a tuple a chunk
                    v.text_chunks(len(run), seen_text, now)
                    out += (out_open, (out_close + out_open).join(run), out_close)
                    run, seen_text = [], False
                if part.startswith(_DATA) and part.find(b"\n") < 0:  # not `in` (sse.py)
                    if part == _DONE_EVENT:
                        self.decoder.feed_events(rest[i + 1 :])  # read, not verified
                        return out, True
                    out.append(v.relay(part[6:], now))
                    head_len, data_head, tail, least, at, back, out_open, out_close = t.shape
                    continue
                block = b"\n\n".join(rest[i:]) + b"\n\n"  # the decoder takes the rest
                break
            else:
                if run:
                    v.text_chunks(len(run), seen_text, now)
                    out += (out_open, (out_close + out_open).join(run), out_close)
                return out, False
        for data in self.decoder.feed(block):
            if data == DONE:
                return out, True
            out.append(self.verifier.relay(data, now))
        return out, False

    def collect(self, block: bytes, now: float, into: Folding) -> bool:
        """Fold ``block``'s chunks into ``into``; whether ``[DONE]`` came."""
        rest = self.decoder.whole_events(block)
        if rest is not None:
            v = self.verifier
            t = v.template
            texts: list[str] = []  # template texts not yet folded in
            seen_text = False
            head_len, data_head, tail, least, at, back, _, _ = t.shape
            for i, part in enumerate(rest):
                if (
                    head_len >= 0
                    and part.startswith(data_head)
                    and part.endswith(tail)
                    and len(part) >= least
                    and not v.finished
                ):
                    try:  # the text within its quotes, as written
                        text = _loads(part[at : len(part) - back])
                    except _JSONError:
                        pass
                    else:
                        texts.append(text)
                        seen_text = seen_text or bool(text)
                        continue
                if texts:
                    v.text_chunks(len(texts), seen_text, now)
                    into.add_texts(t.key, texts, t.extra)
                    texts, seen_text = [], False
                if part.startswith(_DATA) and part.find(b"\n") < 0:
                    if part == _DONE_EVENT:
                        self.decoder.feed_events(rest[i + 1 :])  # read, not verified
                        return True
                    into.add(v.collect(part[6:], now))
                    head_len, data_head, tail, least, at, back, _, _ = t.shape  # learnt, maybe
                    continue
                block = b"\n\n".join(rest[i:]) + b"\n\n"
                break
            else:
                if texts:
                    v.text_chunks(len(texts), seen_text, now)
                    into.add_texts(t.key, texts, t.extra)
                return False
        for data in self.decoder.feed(block):
            if data == DONE:
                return True
            into.add(self.verifier.collect(data, now))
        return False
