"""The Response builder alone: any run of chat deltas makes events OpenAI's schemas take,
numbered without a gap, whose items hold exactly the text, reasoning and calls sent."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capyctl_gateway._errors import EngineError, UnverifiedError
from capyctl_gateway._responses.build import (
    DELTA_COST,
    ITEM_COST,
    LOGPROB_COST,
    ResponseBuilder,
)
from capyctl_gateway._responses.request import check_responses
from tests.gateway.openai_schemas import validate_event, validate_response

ECHO = check_responses({"model": "m", "input": "x"})[2]
TEXT = st.text(min_size=1, max_size=8)
DELTA = st.one_of(
    st.builds(lambda t: {"content": t}, TEXT),
    st.builds(lambda t: {"content": t, "_lp": True}, TEXT),  # its logprobs with it
    st.builds(lambda t: {"reasoning": t}, TEXT),
    st.builds(
        lambda i, a: {"tool_calls": [{"index": i, "function": {"name": f"f{i}", "arguments": a}}]},
        st.integers(0, 2),
        TEXT,
    ),
)


def _choice(d: dict[str, Any]) -> dict[str, Any]:
    """A chat choice of delta ``d`` (``_lp``: with one logprob entry, its text as the token)."""
    choice = {"index": 0, "delta": {k: v for k, v in d.items() if k != "_lp"}}
    choice["finish_reason"] = None
    if d.get("_lp"):
        entry = {"token": d["content"], "logprob": -1.0, "bytes": None, "top_logprobs": []}
        choice["logprobs"] = {"content": [entry]}
    return choice


def _resumes(deltas: list[dict[str, Any]]) -> bool:
    """Whether a tool call's deltas come again after another item began (which a Response
    cannot say: its done events were out)."""
    kinds = [_kind(d) for d in deltas]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    calls = [k for k in runs if k.startswith("call")]
    return len(calls) != len(set(calls))


def _kind(d: dict[str, Any]) -> str:
    if "content" in d:
        return "message"
    if "reasoning" in d:
        return "reasoning"
    return f"call{d['tool_calls'][0]['index']}"


def _runs(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """What the output items must be: each run of one kind of delta, joined."""
    runs: list[tuple[str, str]] = []
    for d in deltas:
        if "content" in d:
            kind, text = "message", d["content"]
        elif "reasoning" in d:
            kind, text = "reasoning", d["reasoning"]
        else:
            call = d["tool_calls"][0]
            kind, text = f"call{call['index']}", call["function"]["arguments"]
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + text)
        else:
            runs.append((kind, text))
    return runs


def _text_of(item: dict[str, Any]) -> tuple[str, str]:
    if item["type"] == "message":
        return "message", item["content"][0]["text"]
    if item["type"] == "reasoning":
        return "reasoning", item["content"][0]["text"]
    return f"call{item['name'][1:]}", item["arguments"]


@settings(max_examples=150, deadline=None)
@given(st.lists(DELTA, max_size=12), st.sampled_from(["stop", "length", "tool_calls"]))
def test_any_run_of_deltas_makes_valid_numbered_events_and_whole_items(
    deltas: list[dict[str, Any]], finish: str
) -> None:
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=2**20, streaming=True)
    if _resumes(deltas):
        with pytest.raises(UnverifiedError, match="resumed after another item"):
            for d in deltas:
                b.add({"choices": [_choice(d)]})
        return
    for d in deltas:
        b.add({"choices": [_choice(d)]})
    b.add({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    response = b.finished(None)
    validate_response(response)
    events = []
    for block in b.events.take().split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        validate_event(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [_text_of(item) for item in response["output"]] == _runs(deltas)
    deltas_seen = [e for e in events if e["type"].endswith(".delta")]
    assert len(deltas_seen) == len(deltas)
    for e in deltas_seen:  # the hot path's bytes make the event the general path would
        keys = {"type", "sequence_number", "item_id", "output_index", "delta"}
        if e["type"] != "response.function_call_arguments.delta":
            keys.add("content_index")
        if e["type"] == "response.output_text.delta":
            keys.add("logprobs")
        assert set(e) == keys
        assert response["output"][e["output_index"]]["id"] == e["item_id"]
    assert events[-1]["type"] == (
        "response.incomplete" if finish == "length" else "response.completed"
    )


def test_a_failure_discards_the_events_of_the_read_that_failed() -> None:
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=2**20, streaming=True)
    b.add({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]})
    sent = b.events.take()
    b.add({"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": None}]})
    b.events.discard()
    b.failed("engine_error", "gone")
    rest = [orjson.loads(x.split(b"\n")[1][6:]) for x in b.events.take().split(b"\n\n")[:-1]]
    numbers = [
        orjson.loads(x.split(b"\n")[1][6:])["sequence_number"] for x in sent.split(b"\n\n")[:-1]
    ]
    assert [e["sequence_number"] for e in rest] == [numbers[-1] + 1, numbers[-1] + 2]
    assert [e["type"] for e in rest] == ["error", "response.failed"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(DELTA, min_size=1, max_size=4), min_size=1, max_size=5))
def test_a_failed_response_holds_what_its_client_was_sent(
    reads: list[list[dict[str, Any]]],
) -> None:
    """Reads of deltas, each written as it is folded; the last fails. The events sent and the
    failure's make one valid, gapless stream, and ``response.failed`` holds exactly the runs
    of the deltas sent, not the text of the read that failed (it did)."""
    *sent_reads, failing = reads
    sent = [d for r in sent_reads for d in r]
    if _resumes(sent + failing):
        return  # a resumed call ends the stream as unverified: the test above
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=2**20, streaming=True)
    out = b""
    for read in sent_reads:
        for d in read:
            b.add({"choices": [_choice(d)]})
        out += b.take()
    for d in failing:
        b.add({"choices": [_choice(d)]})
    b.discard()
    b.failed("engine_error", "gone")
    out += b.take()
    events = [orjson.loads(x.split(b"\n")[1][6:]) for x in out.split(b"\n\n")[:-1]]
    for e in events:
        validate_event(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    response = events[-1]["response"]
    assert [_text_of(item) for item in response["output"]] == _runs(sent)
    assert [item["status"] for item in response["output"]] == ["completed"] * (
        len(response["output"]) - 1
    ) + ["incomplete"] * bool(response["output"])
    texts = [e["delta"] for e in events if e["type"].endswith(".delta")]
    assert texts == [_delta_text(d) for d in sent]
    tokens = [
        t["token"]
        for item in response["output"]
        if item["type"] == "message"
        for t in item["content"][0]["logprobs"]
    ]  # the logprobs of what was sent, none of the failing read's
    assert tokens == [d["content"] for d in sent if d.get("_lp")]


def _delta_text(d: dict[str, Any]) -> str:
    text = d.get("content") or d.get("reasoning") or d["tool_calls"][0]["function"]["arguments"]
    assert isinstance(text, str)
    return text


def test_an_answer_the_engine_ended_otherwise_fails_never_looks_whole() -> None:
    """vLLM's ``abort`` finish: the answer was cut short; it was reported completed."""
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=2**20, streaming=True)
    b.add({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]})
    b.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
    response = b.finished(None)
    validate_response(response)
    assert response["status"] == "failed"
    assert response["error"]["message"] == (
        "engine_error: the engine ended the answer with finish_reason 'abort'"
    )


def test_tool_calls_without_arguments_still_reach_the_bound() -> None:
    """Each tool call's delta makes an event and perhaps an item: empty arguments counted
    nothing, so an engine could grow a Response's items without end."""
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=4096, streaming=False)
    with pytest.raises(EngineError, match="over 4096 bytes"):
        for i in range(1000):
            call = {"index": i, "function": {"name": "f", "arguments": ""}}
            b.add({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    assert len(b.response["output"]) < 100


def test_logprobs_count_against_the_bound_with_their_alternatives() -> None:
    """Logprobs are kept for the whole text: a token of one character with 20 alternatives
    counts 21 entries against the bound, so its text alone could not hold them within it."""
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=16384, streaming=True)
    alts = [{"token": "x", "logprob": -2.0, "bytes": None} for _ in range(20)]
    entry = {"token": "a", "logprob": -1.0, "bytes": None, "top_logprobs": alts}
    choice = {"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]}}
    with pytest.raises(EngineError, match="over 16384 bytes"):
        for _ in range(1000):
            b.add({"choices": [choice]})
    # A token is 1 + 64 + 21 x 192 bytes and its item 512: three fit in 16,384, the fourth is
    # refused before it is kept
    assert (16384 - ITEM_COST) // (1 + DELTA_COST + 21 * LOGPROB_COST) == 3
    assert b.take().count(b"event: response.output_text.delta\n") == 3


def test_a_finish_reason_reaches_the_client_only_as_a_word() -> None:
    b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=2**20, streaming=False)
    b.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "see http://10.0.0.7:8000/"}]})
    message = b.finished(None)["error"]["message"]
    assert "10.0.0.7" not in message and message.endswith("finish_reason '?'")


BOUND = 64 * 1024
SENT_TIMES, HELD_TIMES = 6, 2
"""What a Response may send and hold, in bounds (responses.md says so): its end events repeat
the whole text four times, so a text of the bound's size is sent five times over."""


def _lp(i: int) -> dict[str, Any]:
    alts = [{"token": "y", "logprob": -2.0, "bytes": [121]} for _ in range(20)]
    entry = {"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": alts}
    return {"index": 0, "delta": {"content": "x"}, "logprobs": {"content": [entry]}}


SHAPES: dict[str, Callable[[int], dict[str, Any]]] = {
    "reasoning and text alternating": lambda i: {"reasoning" if i % 2 else "content": "a"},
    "one-byte text": lambda i: {"content": "a"},
    "one-byte reasoning": lambda i: {"reasoning": "a"},
    "calls without arguments": lambda i: {"tool_calls": [{"index": i, "function": {"name": "f"}}]},
    "one-byte arguments": lambda i: {"tool_calls": [{"index": 0, "function": {"arguments": "a"}}]},
    "text of 1,000 bytes": lambda i: {"content": "a" * 1000},
}


def _read(shape: str, i: int) -> dict[str, Any]:
    """The ``i``th chunk of an engine streaming deltas of ``shape``, as a new object (a parse
    of its bytes, as the relay's)."""
    choice = _lp(i) if shape == "logprobs" else {"index": 0, "delta": SHAPES[shape](i)}
    read: dict[str, Any] = orjson.loads(orjson.dumps({"choices": [choice]}))
    return read


def _stream(shape: str, deltas: int) -> tuple[int, int, int]:
    """A streamed Response of ``deltas`` deltas of ``shape`` (or as many as the bound takes,
    then failed, as the relay fails it): the deltas taken, the bytes it sent, and the most
    memory it held (traced after each write, as the relay writes after each read)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        b = ResponseBuilder(ECHO, model="m", created_at=1, max_bytes=BOUND, streaming=True)
        sent, held, taken = len(b.take()), 0, 0
        try:
            for i in range(deltas):
                b.add(_read(shape, i))
                sent += len(b.take())
                held = max(held, tracemalloc.get_traced_memory()[0] - base)
                taken += 1
            b.finished(None)
        except EngineError:
            b.discard()
            b.failed("engine_error", "over the bound")
        sent += len(b.take())
        held = max(held, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    return taken, sent, held


@pytest.mark.parametrize("shape", [*SHAPES, "logprobs"])
def test_what_a_stream_sends_and_holds_stays_within_a_multiple_of_the_bound(shape: str) -> None:
    """The bound counts what the gateway makes of each delta (its item, its event), not only
    the engine's text: one-byte reasoning and text deltas in turn each made an item, and a
    Response at a 64 KiB bound sent 1,490 times that and held 680 times that. Each shape runs
    to the bound (and fails), then as far as it fits (and completes)."""
    taken, sent, held = _stream(shape, 100 * BOUND)
    assert taken < 100 * BOUND  # the bound was reached
    assert sent <= SENT_TIMES * BOUND and held <= HELD_TIMES * BOUND, (taken, sent, held)
    whole, sent, held = _stream(shape, taken)
    assert whole == taken  # what fitted fits again, and completes
    assert sent <= SENT_TIMES * BOUND and held <= HELD_TIMES * BOUND, (whole, sent, held)
