"""Rules on a chunk's bytes and on its tool calls, for the verifier (pure functions)."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from .._errors import UnverifiedError

__all__ = [
    "MAX_TOOL_CALLS",
    "Calls",
    "ChoiceRules",
    "ClientForm",
    "check_fields",
    "check_frame",
    "check_tool_calls",
    "check_usage",
    "client_bytes",
    "reject_duplicates",
    "renamed",
    "withheld",
]

TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
FUNCTION_KEYS = frozenset({"name", "arguments"})
_MODEL_MEMBER = re.compile(rb'"model"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")', re.DOTALL)
"""A "model" member with a string value (or text that looks like one), as written."""
_MAX_PROBES = 4
"""How many "model" members of a chunk are tried as its own before it is re-serialised
(each try parses the chunk up to the member)."""


def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise UnverifiedError("a chunk repeats a JSON key")
    return d


def client_bytes(
    raw: bytes, chunk: dict[str, Any], served_member: bytes, public_json: bytes
) -> bytes:
    """What the client gets for a checked chunk: the engine's bytes ``raw``, unchanged but for
    the top-level model (``chunk`` is ``raw`` parsed, with the model already renamed to
    ``public_json``). A chunk that repeats a key is refused here.

    orjson keeps the last of repeated keys silently, so a chunk with a repeated key does not
    re-serialise to its own bytes. Neither does one written another way (spaces, escapes,
    numbers spelled differently): those take the exact, slower check. A chunk that does
    re-serialise to its own bytes with one "model":<served> renamed had that as its top-level
    model (else the two would parse differently), so the re-serialisation is those bytes. In
    one written another way, the top-level model is found in its bytes.
    """
    out = orjson.dumps(chunk)
    if out != raw.replace(served_member, b'"model":' + public_json, 1):
        try:
            json.loads(raw, object_pairs_hook=reject_duplicates)
        except ValueError:
            raise UnverifiedError("a chunk repeats a JSON key") from None
        out = renamed(raw, served_member, public_json) or out
    return out


class ClientForm:
    """What a deployment's clients get of a checked chunk: the engine's bytes with the model
    renamed (`client_bytes`, which the verifier calls itself: a call less per chunk), less,
    where it withholds them, the counts of cached prompt tokens (`without_counts`). Frozen,
    one per deployment."""

    __slots__ = ("public_json", "served_member", "withhold")

    def __init__(self, served_member: bytes, public_json: bytes, withhold: bool) -> None:
        self.served_member, self.public_json, self.withhold = served_member, public_json, withhold

    def without_counts(self, chunk: dict[str, Any], out: bytes) -> tuple[dict[str, Any], bytes]:
        """A checked chunk (``out``: its bytes with the model renamed) as the client of a
        deployment that withholds the counts gets it (`withheld`), and its bytes."""
        kept = withheld(chunk)
        return (chunk, out) if kept is None else (kept, orjson.dumps(kept))


def withheld(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """``chunk`` without what says how many of the prompt's tokens were cached: usage's
    ``prompt_tokens_details.cached_tokens`` and llama.cpp's ``timings`` (its ``cache_n``, and
    ``prompt_n`` beside the prompt's tokens, count them too); None where it has neither."""
    usage: Any = chunk.get("usage")
    details: Any = usage.get("prompt_tokens_details") if type(usage) is dict else None
    cached = type(details) is dict and "cached_tokens" in details
    if not cached and chunk.get("timings") is None:
        return None
    kept = {k: v for k, v in chunk.items() if k != "timings"}
    if cached:
        rest = {k: v for k, v in details.items() if k != "cached_tokens"}
        kept["usage"] = {**usage, "prompt_tokens_details": rest}
    return kept


def renamed(raw: bytes, served_member: bytes, public_json: bytes) -> bytes | None:
    """A verified chunk, written another way than orjson writes it, with only its
    top-level model value replaced by ``public_json``; None if that value is not found.
    ``served_member`` is ``"model":<served>`` as orjson writes it."""
    probes = _MAX_PROBES
    at = raw.find(b'"model"')
    while at >= 0:
        if raw.startswith(served_member, at):  # as the engines write it
            start, end = at + 8, at + len(served_member)
        else:
            member = _MODEL_MEMBER.match(raw, at)
            start, end = (-1, -1) if member is None else member.span(1)
        # Unless its first quote is escaped (the end of a longer key), that quote opens a
        # string: this is a "model" member at some depth, with a string value. It is the
        # chunk's own (the only one: keys are not repeated) if the chunk opened nothing
        # before it, or if closing one object right after it makes valid JSON.
        if start >= 0 and raw[at - 1 : at] != b"\\":
            if raw[0] == 0x7B and raw.find(b"{", 1, at) < 0 and raw.find(b"[", 1, at) < 0:
                return raw[:start] + public_json + raw[end:]
            if not probes:
                return None
            probes -= 1
            try:
                orjson.loads(raw[:end] + b"}")
            except orjson.JSONDecodeError:
                pass  # a member of an object inside the chunk
            else:
                return raw[:start] + public_json + raw[end:]
        at = raw.find(b'"model"', at + 1)
    return None


def check_frame(chunk: dict[str, Any], known_id: str | None, served: str) -> str:
    """Check what every chunk of a stream shares; return the stream's id."""
    if chunk.get("object") != "chat.completion.chunk":
        raise UnverifiedError("a chunk is not a chat.completion.chunk")
    cid = chunk.get("id")
    if known_id is None:
        if type(cid) is not str or not cid:
            raise UnverifiedError("a chunk has no id")
    elif cid != known_id:
        raise UnverifiedError("the chunk id changed within the stream")
    if chunk.get("model") != served:
        raise UnverifiedError("a chunk names another model")
    created = chunk.get("created")
    if type(created) is not int or created < 0:
        raise UnverifiedError("a chunk has no creation time")
    if type(chunk.get("choices")) is not list:
        raise UnverifiedError("a chunk has no choices list")
    return cid


def check_fields(chunk: dict[str, Any], allowed: frozenset[str], nulls: frozenset[str]) -> None:
    """A chunk's own fields must be its engine's (``allowed``, or one of ``nulls`` while null):
    an untested field never reaches a client or an assembled answer."""
    if allowed.issuperset(chunk):  # the usual chunk: one C pass over its keys
        return
    for key, value in chunk.items():
        if key not in allowed and (value is not None or key not in nulls):
            raise UnverifiedError(  # the engine's words name the field: the log's only
                "a chunk carries a field this engine is not verified to send",
                detail=f"the field {key[:64]!r}",
            )


MAX_TOOL_CALLS = 4096
"""Tool calls one answer may make (each is remembered for the rest of the stream)."""


class ChoiceRules:
    """The rules on a stream's one choice, one object per deployment (the stream's own state,
    its tool calls so far, is the caller's: ``calls``).

    n is 1, so the choice's index is 0: another's text would be merged into it. Beside the
    delta, a choice is relayed as the engine sent it, once its finish_reason is one its engine
    documents (``finishes``; vLLM's "abort" among them). A tool call names its function in its
    first delta, and keeps its id and name: a later delta may repeat them, never change them.
    """

    __slots__ = ("delta_keys", "finishes", "text_keys")

    def __init__(
        self, delta_keys: frozenset[str], text_keys: tuple[str, ...], finishes: frozenset[str]
    ) -> None:
        self.delta_keys, self.text_keys, self.finishes = delta_keys, text_keys, finishes

    def check(self, choice: Any, calls: Calls) -> tuple[bool, bool, bool]:
        """Check a chunk's one choice (``calls``: its stream's tool calls so far, kept up to
        date); return whether it carries text, tool calls, and a finish."""
        if type(choice) is not dict:
            raise UnverifiedError("the choice is not an object")
        index = choice.get("index")
        if type(index) is not int or index != 0:
            raise UnverifiedError("the choice's index is not 0 (one choice was asked for)")
        finish = choice.get("finish_reason")
        if finish is not None and (type(finish) is not str or finish not in self.finishes):
            raise UnverifiedError(  # the engine's word: the log's only
                "the choice's finish_reason is not one this engine is verified to send",
                detail=f"finish_reason {str(finish)[:64]!r}",
            )
        delta = choice.get("delta")
        if type(delta) is not dict:
            raise UnverifiedError("the choice has no delta")
        if not self.delta_keys.issuperset(delta):
            key = next(k for k in delta if k not in self.delta_keys)
            raise UnverifiedError(  # the engine's words name the key: the log's only
                "the delta carries a key this engine is not verified to send",
                detail=f"the key {key[:64]!r}",
            )
        role = delta.get("role")
        if role is not None and role != "assistant":
            raise UnverifiedError("the delta names a role other than assistant")
        text = False
        for key in self.text_keys:  # the others are not in the delta: checked above
            value = delta.get(key)
            if value is not None:
                if type(value) is not str:
                    raise UnverifiedError(f"delta {key} is not a string")
                if value:
                    text = True
        made = delta.get("tool_calls")
        if made is not None:
            check_tool_calls(made)
            for call in made:
                _same_call(call, calls)
        return text, bool(made), finish is not None


Calls = dict[int, tuple[int | None, int]]
"""A stream's tool calls so far: each one's index, with the hashes of its id (None until it has
one) and of its function's name: what a later delta of it is held to, in a few bytes."""


def _same_call(call: dict[str, Any], calls: Calls) -> None:
    """Hold a tool call's delta (its shape checked) to what its first one said."""
    cid = call.get("id") or None
    fn = call.get("function")
    name = (fn.get("name") if fn is not None else None) or None
    ids = None if cid is None else hash(cid)
    known = calls.get(call["index"])
    if known is None:
        if name is None:
            raise UnverifiedError("a tool call has no name in its first delta")
        if len(calls) >= MAX_TOOL_CALLS:
            raise UnverifiedError(f"the answer makes more than {MAX_TOOL_CALLS} tool calls")
        calls[call["index"]] = (ids, hash(name))
        return
    if ids is not None and ids != known[0]:
        if known[0] is not None:
            raise UnverifiedError("a tool call's id changed mid-call")
        calls[call["index"]] = (ids, known[1])
    if name is not None and hash(name) != known[1]:
        raise UnverifiedError("a tool call's name changed mid-call")


def check_usage(usage: dict[str, Any]) -> None:
    """Usage is counts: each a whole number or null, and so is each member of its details
    objects (``prompt_tokens_details``, ...)."""
    counts = usage.values()
    if _INT.issuperset(map(type, counts)) and min(counts, default=0) >= 0:
        return  # the usual usage: whole numbers only, told in C
    for key, value in usage.items():
        if value is None or type(value) is int and value >= 0:
            continue
        if type(value) is dict and key.endswith("_details") and all(map(_count, value.values())):
            continue
        raise UnverifiedError(  # the engine's words name the field: the log's only
            "usage carries a count that is not a whole number", detail=f"the field {key[:64]!r}"
        )


_INT = frozenset({int})


def _count(value: Any) -> bool:
    return value is None or type(value) is int and value >= 0


def check_tool_calls(calls: Any) -> None:
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
