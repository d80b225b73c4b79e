"""Folding a verified stream into one ``chat.completion`` for a non-streaming client.

The answer has the members OpenAI's chat completion object requires, whatever the engine
streamed: each choice's ``logprobs`` (null when the engine sent none; otherwise its ``content``
and ``refusal`` lists, each joined, or null when the engine sent none of it) and its message's
``refusal``, always null: the verifier's table of delta keys has no ``refusal``, so a stream
whose delta carries one ends unverified and is never assembled.

The parts are gathered in lists extended in place and joined once at the end: an answer of
32k tokens with logprobs costs linear time, not one copy of the list so far per chunk.
"""

from __future__ import annotations

from typing import Any, Protocol

from .verify import TemplateText

__all__ = ["Assembler", "Folding"]


class Folding(Protocol):
    """What a stream's verified chunks are folded into: a chat answer (`Assembler`), or a
    Response (``_responses/build.py``)."""

    def add(self, chunk: dict[str, Any] | TemplateText) -> None:
        """Fold in a verified chunk, or one that is the verifier's template but its text."""

    def add_texts(self, key: str, texts: list[str], extra: dict[str, Any]) -> None:
        """Fold in template chunks (the verifier's template but for their ``texts``)."""


_REASONING = ("reasoning_content", "reasoning")


class Assembler:
    """Collects verified chunks (already carrying the public model name)."""

    __slots__ = (
        "_calls",
        "_chunk_extra",
        "_content",
        "_first",
        "_logprobs",
        "_lp_refusal",
        "_reasoning",
        "finish",
    )

    def __init__(self) -> None:
        self._first: dict[str, Any] | None = None
        self._content: list[str] = []
        self._reasoning: dict[str, list[str]] = {}
        self._calls: dict[int, dict[str, Any]] = {}
        self._logprobs: list[Any] | None = None
        """The engine's ``logprobs.content`` entries; None while it sent none."""
        self._lp_refusal: list[Any] | None = None
        """The engine's ``logprobs.refusal`` entries; None while it sent none."""
        self._chunk_extra: dict[str, Any] = {}
        self.finish: Any = None
        """The finish_reason the engine sent, whatever it is (stop, length, vLLM's abort...)."""

    def add(self, chunk: dict[str, Any] | TemplateText) -> None:
        """Fold in a verified chunk, or one that is the verifier's template but for its text."""
        if isinstance(chunk, TemplateText):
            if chunk.key == "content":
                if chunk.text:
                    self._content.append(chunk.text)
            else:
                self._reasoning.setdefault(chunk.key, []).append(chunk.text)
            if chunk.extra:
                self._chunk_extra.update(chunk.extra)
            return
        if self._first is None:
            self._first = chunk
        if len(chunk) > 5:  # a verified chunk has the five of its frame, and may have more
            for key, value in chunk.items():
                # null ones (vLLM's prompt_text, prompt_token_ids) are left out
                if key not in _FRAME and value is not None:
                    self._chunk_extra[key] = value
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content = delta.get("content")
            if content:
                self._content.append(content)
            for key in _REASONING:
                text = delta.get(key)
                if text is not None:
                    self._reasoning.setdefault(key, []).append(text)
            for call in delta.get("tool_calls") or ():
                self._fold_call(call)
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                self._logprobs = _joined(self._logprobs, lp.get("content"))
                self._lp_refusal = _joined(self._lp_refusal, lp.get("refusal"))
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finish = finish  # as sent: the verifier does not judge it

    def add_texts(self, key: str, texts: list[str], extra: dict[str, Any]) -> None:
        """Fold in template chunks (the verifier's template but for their ``texts``)."""
        if key == "content":
            self._content += filter(None, texts)
        else:
            self._reasoning.setdefault(key, []).extend(texts)
        if extra:
            self._chunk_extra.update(extra)

    def _fold_call(self, call: dict[str, Any]) -> None:
        slot = self._calls.setdefault(call["index"], {"function": {"arguments": ""}})
        if call.get("id") and "id" not in slot:
            slot["id"] = call["id"]
        if call.get("type") and "type" not in slot:
            slot["type"] = call["type"]
        fn = call.get("function") or {}
        if fn.get("name") and "name" not in slot["function"]:
            slot["function"]["name"] = fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def result(self) -> dict[str, Any]:
        first = self._first or {}
        message: dict[str, Any] = {"role": "assistant"}
        message["content"] = "".join(self._content) if self._content or not self._calls else None
        message["refusal"] = None  # never assembled: see the module's docstring
        for key, parts in self._reasoning.items():
            message[key] = "".join(parts)
        if self._calls:
            message["tool_calls"] = [
                {"id": c.get("id"), "type": c.get("type", "function"), "function": c["function"]}
                for _, c in sorted(self._calls.items())
            ]
        logprobs = None
        if self._logprobs is not None or self._lp_refusal is not None:
            logprobs = {"content": self._logprobs, "refusal": self._lp_refusal}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self.finish,
        }
        out: dict[str, Any] = {
            "id": first.get("id"),
            "object": "chat.completion",
            "created": first.get("created"),
            "model": first.get("model"),
            "choices": [choice],
        }
        out.update(self._chunk_extra)  # usage, metrics, timings, tensorfold...: the last non-null
        return out


_FRAME = ("id", "object", "created", "model", "choices")


def _joined(parts: list[Any] | None, more: Any) -> list[Any] | None:
    """``parts`` extended in place by ``more`` when it is a list (the first makes the list)."""
    if not isinstance(more, list):
        return parts
    if parts is None:
        return list(more)
    parts.extend(more)
    return parts
