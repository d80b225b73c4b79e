"""A verified chat stream folded into one Response (pure: no I/O).

`ResponseBuilder` takes what the block reader folds (`add`, `add_texts`: the interface of the
chat `Assembler`) and writes it into the Response's output items (``output.py``), which for a
streaming client also makes OpenAI's typed events as the chunks come. What the Response holds
and sends is bounded (``max_bytes``, the gateway's bound on an assembled answer): its text, and
each item, delta and logprob at a fixed cost (`ITEM_COST`, `DELTA_COST`, `LOGPROB_COST`), so
that no run of small deltas makes more than a few times the bound. Past it the answer fails,
never comes back shortened.
"""

from __future__ import annotations

from typing import Any

from .._errors import EngineError, UnverifiedError
from .._relay.verify import TemplateText
from .output import Events, Output, item_id
from .request import Echo

__all__ = ["DELTA_COST", "ITEM_COST", "LOGPROB_COST", "ResponseBuilder", "logprobs_of"]

_REASONING = ("reasoning_content", "reasoning")
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""The engine's finish reasons that leave a Response incomplete, and OpenAI's word for each."""
ITEM_COST = 512
"""What each output item counts against the answer's bound beyond its text: its events (added,
a message's part events, the done events) and its place in the Response, held and sent again
at its end. One-byte deltas of reasoning and text in turn each make an item."""
DELTA_COST = 64
"""What each delta counts beyond its text (a tool call's beyond its arguments, which may be
none): the event it makes, and its piece of the text held."""
LOGPROB_COST = 192
"""What each logprob entry, and each of its alternatives, counts: held for the whole text (a
dict of its token, logprob and bytes), and sent with it."""
_WHOLE = (None, "stop", "tool_calls", "function_call")
"""Those of an answer the engine ended whole; any other (vLLM's ``abort``) fails it."""


class ResponseBuilder:
    """One Response, built from a verified chat stream (see the module's text)."""

    __slots__ = ("_max", "_output", "_size", "events", "finish", "response")

    def __init__(
        self, echo: Echo, *, model: str, created_at: int, max_bytes: int, streaming: bool
    ) -> None:
        self.events = Events(streaming=streaming)
        self._output = Output(self.events)
        self.response = _response(echo, model, created_at, self._output.items)
        self.finish: Any = None
        """The engine's finish reason, as sent."""
        self._size = 0
        self._max = max_bytes
        for kind in ("response.created", "response.in_progress"):
            self.events(kind, response=self.response)
        self.events.keep()

    def add(self, chunk: dict[str, Any] | TemplateText) -> None:
        if isinstance(chunk, TemplateText):
            self._text(chunk.key, chunk.text)
            return
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for key in _REASONING:
                self._text(key, delta.get(key))
            lp = choice.get("logprobs")
            if lp is None:
                self._text("content", delta.get("content"))
            else:  # asked for (include): the text's, in OpenAI's shape
                entries = logprobs_of(lp)
                text = delta.get("content") or ""
                if text or entries:
                    tops = sum(len(e["top_logprobs"]) for e in entries)
                    lps = LOGPROB_COST * (len(entries) + tops)
                    self._grow("message", _size(text) + DELTA_COST + lps)
                    self._output.text("message", text, entries)
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                arguments = fn.get("arguments") or ""
                index = call["index"]
                self._grow(index, _size(arguments) + DELTA_COST)  # empty ones make items too
                self._output.call(index, call.get("id"), fn.get("name"), arguments)
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finish = finish

    def take(self) -> bytes:
        """The events made since the last take, to be written: what the client is sent."""
        self._output.mark()
        return self.events.take()

    def discard(self) -> None:
        """Forget what was made since the last take (the read that failed): its events, and
        its text in the Response's items."""
        self.events.discard()
        self._output.rewind()

    def add_texts(self, key: str, texts: list[str], extra: dict[str, Any]) -> None:
        for text in texts:
            self._text(key, text)

    @property
    def reasoned(self) -> bool:
        """Whether the answer streamed any reasoning text."""
        return any(item["type"] == "reasoning" for item in self._output.items)

    def finished(self, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The Response, whole (its last events made): completed, incomplete where the engine
        stopped at the token limit or its content filter, failed where it ended the answer
        any other way."""
        reason = _INCOMPLETE.get(self.finish)
        if reason is None and self.finish not in _WHOLE:
            said = (
                self.finish if isinstance(self.finish, str) and self.finish.isidentifier() else "?"
            )
            why = f"the engine ended the answer with finish_reason {said[:32]!r}"  # its word only
            return self.failed("engine_error", why)  # never a shortened answer that looks whole
        self._output.close("incomplete" if reason else "completed")
        r = self.response
        if usage is not None:
            r["usage"] = usage
        if reason is None:
            r["status"] = "completed"
            self.events("response.completed", response=r)
        else:
            r["status"], r["incomplete_details"] = "incomplete", {"reason": reason}
            self.events("response.incomplete", response=r)
        return r

    def failed(self, code: str, message: str) -> dict[str, Any]:
        """The Response of an answer that failed part way: an ``error`` event with our
        ``code``, then ``response.failed`` with what it had made so far, its last item
        incomplete. OpenAI's Response names its error by its own codes only: ours is
        ``server_error`` there, with ``code: message`` as its message."""
        self._output.close("incomplete", events=False)
        self.events("error", code=code, message=message, param=None)
        r = self.response
        r["status"] = "failed"
        r["error"] = {"code": "server_error", "message": f"{code}: {message}"}
        self.events("response.failed", response=r)
        return r

    def _text(self, key: str, text: str | None) -> None:
        if text:
            kind = "message" if key == "content" else "reasoning"
            self._grow(kind, _size(text) + DELTA_COST)
            self._output.text(kind, text)

    def _grow(self, kind: str | int, n: int) -> None:
        """Count ``n`` bytes of a delta of ``kind`` (and its item's, where it begins one)
        against the bound, before anything of it is made."""
        if self._output.opens(kind):
            n += ITEM_COST
        self._size += n
        if self._size > self._max:
            raise EngineError(f"the answer is over {self._max} bytes (limits.max_answer_bytes)")


def logprobs_of(lp: Any) -> list[dict[str, Any]]:
    """A chat choice's ``logprobs`` as the Response's text carries them: each token's text,
    logprob, UTF-8 bytes and alternatives. Chat allows ``bytes`` null where a token has none of
    its own: then they are its text's. A shape chat does not have is the engine's fault."""
    try:
        content = lp.get("content") or ()
        return [
            _token(e) | {"top_logprobs": [_token(t) for t in e.get("top_logprobs") or ()]}
            for e in content
        ]
    except (AttributeError, KeyError, TypeError) as exc:
        raise UnverifiedError(f"the engine's logprobs are not chat's: {exc!r}"[:200]) from None


def _token(entry: dict[str, Any]) -> dict[str, Any]:
    token, logprob, given = entry["token"], entry["logprob"], entry.get("bytes")
    if not isinstance(token, str) or type(logprob) not in (int, float):
        raise TypeError("a token is not a string with a number")
    if given is None:
        given = list(token.encode())
    elif not isinstance(given, list) or not all(type(b) is int and 0 <= b < 256 for b in given):
        raise TypeError("bytes is not a list of bytes")
    return {"token": token, "logprob": logprob, "bytes": given}


def _size(text: str) -> int:
    """``text``'s size in UTF-8 bytes, the bound's unit (ASCII, the usual case, is not encoded)."""
    return len(text) if text.isascii() else len(text.encode())


def _response(echo: Echo, model: str, created_at: int, output: list[Any]) -> dict[str, Any]:
    """A Response in progress, its output items to come."""
    return {
        "id": item_id("resp"),
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "metadata": echo.metadata,
        "model": model,
        "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": echo.reasoning,
        "store": False,
        "temperature": echo.temperature,
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        **echo.hints,
    }
