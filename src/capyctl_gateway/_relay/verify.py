"""Verifying every chunk an engine streams, and noting what the metrics need (hot path).

A chunk is relayed only once it passed these checks; the first one that fails ends the client's
stream as unverified. The delta keys allowed are the spec's streamed-field table for the engine;
the fields beside the delta in a choice (index, finish_reason, logprobs, ...) are the engine's
to fill and are not judged. A relayed chunk is the engine's own bytes with only the top-level
``model`` value replaced by the public name, so numbers and escapes reach the client as the
engine wrote them; only a chunk whose model cannot be told apart in its bytes is re-serialised.

A text chunk that is the latest template but for its text (``template.py``) is relayed without
a whole parse; anything else (another id, time, key, a finish, usage) takes the full check, and
may become the next template.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson

from .._engines import EngineKind, facts
from .._errors import EngineRejectedError, UnverifiedError
from .chunkrules import (
    Calls,
    ChoiceRules,
    ClientForm,
    check_fields,
    check_frame,
    check_usage,
    client_bytes,
)
from .refusal import EngineRefusalError
from .template import CHUNK_FRAME, ENGINE_OBJECTS, TEXT_KEYS, Template, TemplateText

__all__ = ["ChunkVerifier", "EngineRejectedError", "TemplateText", "UnverifiedError"]


class ChunkVerifier:
    """Checks one engine stream chunk by chunk and keeps what the answer's metrics need."""

    __slots__ = (
        "_calls",
        "_chunk_keys",
        "_form",
        "_rules",
        "answered",
        "chunks",
        "engine_objects",
        "finished",
        "first_output_at",
        "first_text_at",
        "id",
        "last_at",
        "public",
        "served",
        "template",
        "usage",
    )

    def __init__(self, kind: EngineKind, *, served: str, public: str, hide: bool = False) -> None:
        """``hide``: withhold the counts of cached prompt tokens from the client."""
        self._rules, self._chunk_keys, self._form = _fixed(kind, served, public, hide)
        self._calls: Calls = {}
        self.served = served
        self.public = public
        self.id: str | None = None
        self.finished = False
        self.chunks = 0
        self.answered = False
        """Generated text or a tool call arrived, or an error event (for settling a cut
        request)."""
        self.first_output_at: float | None = None
        """First chunk that is more than an opening role (for the request deadline)."""
        self.first_text_at: float | None = None
        self.last_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self.engine_objects: dict[str, Any] = {}
        self.template = Template()
        """The latest text chunk that passed the full check (read by the block reader)."""

    def relay(self, raw: bytes, now: float) -> bytes:
        """Verify one chunk of a stream that goes to the client; return its SSE event."""
        t = self.template
        found = None if self.finished else t.match(raw)
        if found is not None:
            self.text_chunks(1, bool(found[1]), now)
            return t.out_open + found[0] + t.out_close
        chunk, out = self.check(raw, now)
        self._learn(raw, chunk, out)
        return b"data: " + out + b"\n\n"

    def collect(self, raw: bytes, now: float) -> dict[str, Any] | TemplateText:
        """Verify one chunk of a stream the gateway assembles: the chunk, or, when it matches
        the template, its text and the template's chunk-level fields."""
        t = self.template
        found = None if self.finished else t.match(raw)
        if found is not None:
            self.text_chunks(1, bool(found[1]), now)
            return TemplateText(found[1], t.extra, t.key)
        chunk, out = self.check(raw, now)
        self._learn(raw, chunk, out)
        return chunk

    def _learn(self, raw: bytes, chunk: dict[str, Any], out: bytes) -> None:
        self.template.learn(raw, chunk, out, finished=self.finished)

    def text_chunks(self, n: int, text: bool, now: float) -> None:
        """The full check's bookkeeping for ``n`` template chunks, all at ``now``; ``text``:
        whether any of them carried text."""
        self.chunks += n
        self.last_at = now
        if text:
            if self.first_text_at is None:
                self.first_text_at = now
                self.answered = True
            if self.first_output_at is None:
                self.first_output_at = now

    def check(self, raw: bytes, now: float) -> tuple[dict[str, Any], bytes]:
        """Parse and verify one chunk; return it with ``model`` set to the public name, and
        the bytes for the client: the engine's, with only the top-level model renamed."""
        try:
            chunk = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UnverifiedError("a chunk is not valid JSON") from None
        if type(chunk) is not dict:
            raise UnverifiedError("a chunk is not a JSON object")
        if "error" in chunk:
            self._error_event(chunk)
        self.id = check_frame(chunk, self.id, self.served)
        choices = chunk["choices"]
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
            check_usage(usage)
            self.usage = usage
            output = True
        if len(chunk) > len(CHUNK_FRAME):  # more than the frame, all of which it has
            check_fields(chunk, *self._chunk_keys)
            for key in ENGINE_OBJECTS:
                value = chunk.get(key)
                if value is not None:
                    self.engine_objects[key] = value
        if output and self.first_output_at is None:
            self.first_output_at = now
        self.chunks += 1
        self.last_at = now
        chunk["model"] = self.public
        form = self._form  # what its clients get: the engine's bytes, the model renamed
        out = client_bytes(raw, chunk, form.served_member, form.public_json)
        return (chunk, out) if not form.withhold else form.without_counts(chunk, out)

    def _choice(self, choice: Any, now: float) -> bool:
        text, calls, finish = self._rules.check(choice, self._calls)
        if text:
            if self.first_text_at is None:
                self.first_text_at = now
            self.answered = True
        elif calls:
            self.answered = True  # a tool call is part of the answer as much as text is
        if finish:
            self.finished = True  # for any reason its engine documents
        # Only a chunk that opens the reply (a role and nothing else) is not output.
        return text or calls or finish or bool(choice.get("logprobs"))

    def _error_event(self, chunk: dict[str, Any]) -> None:
        err = chunk.get("error")
        status = err.get("code") if type(err) is dict else None
        message = err.get("message") if type(err) is dict else None
        if self.chunks == 0 and status in (400, 413, 422):
            raise EngineRefusalError(status, str(message or "rejected by the engine"))
        self.answered = True  # the engine answered, with an error
        # Its words may name devices or hosts: they go to the log (the exchange masks its key
        # in them), not to the client.
        raise UnverifiedError("the engine sent an error event", detail=str(message))

    def verify_end(self, done: bool) -> None:
        """At the end of the engine's stream: it must have finished and said [DONE]."""
        if not done:
            raise UnverifiedError("the engine stream ended without [DONE]")
        if not self.finished:
            raise UnverifiedError("the engine said [DONE] before any finish_reason")


@functools.lru_cache(maxsize=256)
def _fixed(
    kind: EngineKind, served: str, public: str, hide: bool
) -> tuple[ChoiceRules, tuple[frozenset[str], frozenset[str]], ClientForm]:
    """What a verifier of a deployment needs, the same for each of its requests (made once,
    not at every request): the rules on a choice (the delta keys allowed, the text keys among
    them, the finish reasons), the chunk's fields beside its frame that ``kind`` may send and
    those only as null, and what its clients get of a chunk (the engine's ``model`` member and
    the public name as JSON: a chunk written as orjson writes it, compact, keys once, numbers
    and strings in their shortest form, as the engines write them, re-serialises to its own
    bytes with only the model renamed)."""
    f = facts(kind)
    text_keys = tuple(k for k in TEXT_KEYS if k in f.delta_keys)
    rules = ChoiceRules(f.delta_keys, text_keys, f.finish_reasons)
    chunk_keys = (CHUNK_FRAME | {"usage"} | f.chunk_keys, f.null_chunk_keys)
    served_member = b'"model":' + orjson.dumps(served)
    return rules, chunk_keys, ClientForm(served_member, orjson.dumps(public), hide)
