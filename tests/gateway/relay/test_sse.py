"""The SSE decoder against a plain reference, over every way a stream can be cut into reads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capyctl_gateway._relay.sse import SSEDecoder, SSEError


def reference(stream: bytes) -> list[bytes]:
    """Events of a whole stream, the slow and obvious way."""
    events: list[bytes] = []
    data: list[bytes] = []
    for raw in stream.split(b"\n")[:-1]:
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if not line:
            if data:
                events.append(b"\n".join(data))
                data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return events


payload = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
line = st.one_of(
    payload.map(lambda p: b"data: " + p),
    payload.map(lambda p: b"data:" + p),
    payload.map(lambda p: b":" + p),  # a comment (llama.cpp's pings)
)
event = st.lists(line, min_size=1, max_size=3)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    out = b""
    for ev in draw(st.lists(event, max_size=8)):
        end = draw(st.sampled_from([b"\n", b"\r\n"]))
        out += b"".join(x + end for x in ev) + end * draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, len(out)), max_size=6)))
    return out, cuts


def feed_in_pieces(stream: bytes, cuts: list[int]) -> tuple[list[bytes], SSEDecoder]:
    decoder = SSEDecoder()
    events: list[bytes] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        events += decoder.feed(stream[start:end])
    return events, decoder


@given(streams())
def test_any_cut_of_any_stream_gives_the_reference_events(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    events, decoder = feed_in_pieces(stream, cuts)
    assert events == reference(stream)
    assert not decoder.pending


@given(streams(), st.integers(1, 30))
def test_an_unfinished_event_is_pending_and_completes_later(
    case: tuple[bytes, list[int]], split: int
) -> None:
    stream, _ = case
    tail = b"data: {" + b"x" * split + b"}\n"
    events, decoder = feed_in_pieces(stream + tail, [len(stream) + split // 2])
    assert events == reference(stream)
    assert decoder.pending
    assert decoder.feed(b"\n") == [b"{" + b"x" * split + b"}"]
    assert not decoder.pending


def test_events_complete_across_reads() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DO') == [b'{"a":1}', b'{"b":2}']
    assert decoder.feed(b"NE]\n\n") == [b"[DONE]"]


@pytest.mark.parametrize(
    "block",
    [b"event: ping\ndata: x\n\n", b"data: x\nid: 7\n\n", b"retry: 10\r\n\r\n"],
)
def test_a_field_other_than_data_is_refused(block: bytes) -> None:
    with pytest.raises(SSEError, match="field"):
        SSEDecoder().feed(block)


def test_an_endless_event_is_refused() -> None:
    decoder = SSEDecoder()
    with pytest.raises(SSEError, match="64 KiB"):
        for _ in range(100):
            decoder.feed(b"data: " + b"x" * 1000 + b"\n")
