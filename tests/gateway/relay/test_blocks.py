"""The block reader gives what decoding and verifying event by event gives.

The same streams (text chunks that match the template, others that take the full check,
mutated ones, comments, carriage returns, events of several lines, garbage) are cut into reads
at random places and read both ways: every read must relay the same bytes, or collect into the
same answer, with the same ``[DONE]`` and the same bookkeeping, and fail where the other fails.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capyctl_gateway._engines import EngineKind
from capyctl_gateway._errors import SSEError, UnverifiedError
from capyctl_gateway._relay.assemble import Assembler
from capyctl_gateway._relay.blocks import BlockReader
from capyctl_gateway._relay.sse import DONE, SSEDecoder
from capyctl_gateway._relay.verify import ChunkVerifier

from .test_verify_template import MUTATIONS, vllm_chunk

STATE = ("answered", "chunks", "engine_objects", "finished", "first_output_at",
         "first_text_at", "id", "last_at", "usage")  # fmt: skip


def event_by_event(blocks: list[bytes], collect: bool) -> list[Any]:
    verifier = ChunkVerifier(EngineKind.VLLM, served="tiny", public="my-model")
    decoder, assembler = SSEDecoder(), Assembler()
    seen: list[Any] = []
    for i, block in enumerate(blocks):
        try:
            out, done = [], False
            for data in decoder.feed(block):
                if data == DONE:
                    done = True
                    break
                if collect:
                    assembler.add(verifier.collect(data, float(i)))
                else:
                    out.append(verifier.relay(data, float(i)))
        except UnverifiedError as exc:
            seen.append(exc)
            break
        seen.append((b"".join(out), done, {k: getattr(verifier, k) for k in STATE}))
        if done:
            break
    seen.append(assembler.result() if collect else None)
    return seen


def by_blocks(blocks: list[bytes], collect: bool) -> list[Any]:
    reader = BlockReader(ChunkVerifier(EngineKind.VLLM, served="tiny", public="my-model"))
    assembler = Assembler()
    seen: list[Any] = []
    for i, block in enumerate(blocks):
        try:
            if collect:
                out, done = list[bytes](), reader.collect(block, float(i), assembler)
            else:
                out, done = reader.relay(block, float(i))
        except UnverifiedError as exc:
            seen.append(exc)
            break
        state = {k: getattr(reader.verifier, k) for k in STATE}
        seen.append((b"".join(out), done, state))
        if done:
            break
    seen.append(assembler.result() if collect else None)
    return seen


def text(value: str) -> bytes:
    return b"data: " + orjson.dumps(vllm_chunk(value)) + b"\n\n"


texts = st.text(max_size=8).map(text)  # text chunks are most of a stream
others = st.one_of(
    st.tuples(st.text(max_size=4), st.sampled_from(range(len(MUTATIONS)))).map(
        lambda c: text(c[0]).replace(*MUTATIONS[c[1]], 1)
    ),
    st.just(b"data: " + orjson.dumps(vllm_chunk(None, finish="stop")) + b"\n\n"),
    st.just(
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1796000000,'
        b'"model":"tiny","choices":[],"usage":{"completion_tokens":3}}\n\n'
    ),  # fmt: skip
    st.just(b"data: [DONE]\n\n"),
    st.just(b": ping\n\n"),
    st.just(b"\n"),
    st.text(max_size=4).map(lambda t: text(t).replace(b"\n\n", b"\r\n\r\n")),
    st.text(max_size=4).map(lambda t: text(t).replace(b'"created"', b'\ndata: "created"', 1)),
    st.sampled_from([b"event: x\n\n", b"data:[DONE]\n\n", b"garbage"]),
)
piece = st.one_of(texts, texts, texts, texts, others)


@st.composite
def cut_streams(draw: st.DrawFn) -> list[bytes]:
    role = vllm_chunk(None)
    role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    pieces = [b"data: " + orjson.dumps(role) + b"\n\n", *draw(st.lists(piece, max_size=16))]
    stream = b"".join(pieces)
    ends = [sum(map(len, pieces[: i + 1])) for i in range(len(pieces) - 1)]
    # Reads end mostly where an event does, as engines write; sometimes anywhere.
    anywhere = st.integers(1, max(1, len(stream) - 1))
    at = st.one_of(st.sampled_from(ends), anywhere) if ends else anywhere
    cuts = sorted(set(draw(st.lists(at, max_size=4))))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


def same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got[:-1], expected[:-1], strict=True):
        if isinstance(e, SSEError):  # refused whole by the decoder; the reader may find an
            assert isinstance(g, UnverifiedError)  # earlier fault in the same block first
        elif isinstance(e, BaseException):
            assert type(g) is type(e) and str(g) == str(e)
        else:
            assert g == e
    if not isinstance(expected[-2], BaseException):
        assert got[-1] == expected[-1]


@settings(max_examples=800)
@given(cut_streams(), st.booleans())
def test_reading_by_blocks_is_reading_event_by_event(blocks: list[bytes], collect: bool) -> None:
    same(by_blocks(blocks, collect), event_by_event(blocks, collect))


@pytest.mark.parametrize("collect", [False, True])
def test_a_whole_answer_in_one_read_takes_the_template_path(collect: bool) -> None:
    stream = text("") + b"".join(text(t) for t in ("He", "llo", ' "w"', "\\")) + b"data: [DONE]\n\n"
    got = by_blocks([stream], collect)
    assert got == event_by_event([stream], collect)
    assert got[0][1] is True and got[0][2]["chunks"] == 5


@pytest.mark.parametrize("collect", [False, True])
def test_a_chunk_that_is_the_template_s_head_and_tail_overlapping_is_checked_in_full(
    collect: bool,
) -> None:
    cut = text("").replace(b'"},', b"},", 1)  # head + tail[1:]: shorter than both together
    stream = text("") + text("a") + cut
    got = by_blocks([stream], collect)
    same(got, event_by_event([stream], collect))
    assert isinstance(got[0], UnverifiedError)


@pytest.mark.parametrize("reads", ["one", "each its own"])
def test_a_text_chunk_after_the_finish_is_refused(reads: str) -> None:
    finish = b"data: " + orjson.dumps(vllm_chunk(None, finish="stop")) + b"\n\n"
    reader = BlockReader(ChunkVerifier(EngineKind.VLLM, served="tiny", public="m"))
    stream = [text(""), text("a"), finish, text("b")]
    with pytest.raises(UnverifiedError, match="after the finish"):
        for block in [b"".join(stream)] if reads == "one" else stream:
            reader.relay(block, 0.0)


@pytest.mark.parametrize("collect", [False, True])
def test_one_event_reads_are_read_as_event_by_event(collect: bool) -> None:
    cut = text("").replace(b'"},', b"},", 1)  # head and tail overlapping
    for tricky in (
        [cut],
        [text("x") + text("y")],
        [text("x").replace(b"x", b"x\r", 1)],
        [text("x")[:-1], text("y")],  # an event not ended: the next read continues it
        [text("x")[:20], text("y")],  # a line not ended
    ):
        reads = [text(""), text("a"), text("b"), *tricky, text("c")]
        same(by_blocks(reads, collect), event_by_event(reads, collect))


def test_bytes_after_done_in_its_read_are_still_read_as_sse() -> None:
    stream = text("a") + b"data: [DONE]\n\nevent: x\n\n"
    with pytest.raises(SSEError, match="field"):
        BlockReader(ChunkVerifier(EngineKind.VLLM, served="tiny", public="m")).relay(stream, 0.0)
