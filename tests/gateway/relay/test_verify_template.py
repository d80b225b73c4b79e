"""The verifier's template path decides exactly as the full check does.

A reference verifier that never learns a template (the full check for every chunk) and the
real one read the same streams: every chunk must get the same verdict, the client the same JSON,
and the metrics the same bookkeeping, whatever the texts and whatever is changed in the bytes.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capyctl_gateway._engines import EngineKind
from capyctl_gateway._relay.assemble import Assembler
from capyctl_gateway._relay.verify import ChunkVerifier, UnverifiedError


class FullCheckOnly(ChunkVerifier):
    """The reference: every chunk through the full check."""

    __slots__ = ()

    def _learn(self, raw: bytes, chunk: dict[str, Any], out: bytes) -> None:
        return None


def vllm_chunk(text: str | None, *, finish: str | None = None, **top: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {} if text is None else {"content": text}
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1796000000,
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    chunk.update(top)
    return chunk


def llama_chunk(text: str | None, *, finish: str | None = None, **top: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {} if text is None else {"content": text}
    chunk = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": 1796000000,
        "id": "chatcmpl-1",
        "model": "tiny",
        "system_fingerprint": "b10798-unknown",
        "object": "chat.completion.chunk",
    }
    chunk.update(top)
    return chunk


def write(chunk: dict[str, Any], style: int) -> bytes:
    if style == 1:  # the way an engine that escapes every non-ASCII character writes it
        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=True).encode()
    if style == 2:  # Python's default spacing
        return json.dumps(chunk).encode()
    return orjson.dumps(chunk)


MUTATIONS: list[tuple[bytes, bytes]] = [
    (b'"created":1796000000', b'"created":1796000001'),
    (b'"id":"chatcmpl-1"', b'"id":"chatcmpl-2"'),
    (b'"model":"tiny"', b'"model":"other"'),
    (b'"content":"', b'"content":"a","content":"'),  # a repeated key
    (b'"content":"', b'"content":"x\\'),  # a dangling escape
    (b'"content":"', b'"content":"\x01'),  # a raw control character
    (b'"content":"', b'"content":"\xff'),  # not UTF-8
    (b'"content":"', b'"content":"","role":"assistant","content":"'),
    (b'"content":"', b'"content":"q","tool_calls":null,"x":"'),
    (b'"index":0', b'"index":1'),
    (b'"finish_reason":null', b'"finish_reason":"stop"'),
    (b"}]", b'},{"index":0,"delta":{}}]'),
    # a repeated key hidden by numbers that re-serialise longer (1e3 is 1000.0): same length
    (b'"created":1796000000', b'"created":1796000000,"y":1e3,"z":1e5,"z":1e5'),
    (b'"},', b"},"),  # the text's closing quote dropped
    (b'"content":"', b'"content": "'),  # a space where the template has none
]

step = st.one_of(
    st.tuples(st.just("text"), st.text(max_size=12), st.integers(0, 2)),
    st.tuples(st.just("mutated"), st.text(max_size=6), st.sampled_from(range(len(MUTATIONS)))),
    st.tuples(st.just("finish"), st.sampled_from(["stop", "length"]), st.booleans()),
    st.tuples(st.just("usage"), st.just(""), st.booleans()),
    # chunk-level fields that change, logprobs, and deltas with more than text
    st.tuples(st.just("extra"), st.text(max_size=4), st.sampled_from([None, 1, "fp"])),
    st.tuples(st.just("logprobs"), st.text(max_size=4), st.booleans()),
    st.tuples(st.just("role"), st.text(max_size=4), st.booleans()),
    st.tuples(st.just("reasoning"), st.text(max_size=4), st.booleans()),
    st.tuples(st.just("float_repeat"), st.text(max_size=4), st.integers(0, 1)),
    st.tuples(st.just("reasoning_only"), st.text(max_size=8), st.integers(0, 1)),
    st.tuples(st.just("truncated"), st.text(max_size=6), st.integers(1, 3)),
)


def run(
    verifier: ChunkVerifier, raws: list[bytes], *, assemble: bool = False
) -> tuple[list[Any], dict[str, Any]]:
    verdicts: list[Any] = []
    assembler = Assembler()
    for i, raw in enumerate(raws):
        try:
            if assemble:
                assembler.add(verifier.collect(raw, float(i)))
                verdicts.append("ok")
                continue
            event = verifier.relay(raw, float(i))
        except UnverifiedError as exc:
            verdicts.append(("unverified", str(exc)))
            break
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        verdicts.append(orjson.loads(event[6:-2]))
    if assemble:
        verdicts.append(assembler.result())
    state = {
        name: getattr(verifier, name)
        for name in (
            "answered",
            "chunks",
            "engine_objects",
            "finished",
            "first_output_at",
            "first_text_at",
            "id",
            "last_at",
            "usage",
        )
    }
    return verdicts, state


@settings(max_examples=600)
@given(st.sampled_from([vllm_chunk, llama_chunk]), st.lists(step, max_size=14), st.booleans())
def test_the_template_path_gives_the_full_check_s_verdicts(
    make: Any, steps: list[tuple[str, Any, Any]], assemble: bool
) -> None:
    raws = [write(make(None) | {"choices": [make("")["choices"][0]]}, 0)]
    for kind, value, extra in steps:
        if kind == "text":
            raws.append(write(make(value), extra))
        elif kind == "mutated":
            old, new = MUTATIONS[extra]
            raws.append(write(make(value), 0).replace(old, new, 1))
        elif kind == "finish":
            raws.append(write(make(None, finish=value), 0))
        elif kind == "extra":
            raws.append(write(make(value, system_fingerprint=extra), 0))
        elif kind == "logprobs":
            chunk = make(value)
            chunk["choices"][0]["logprobs"] = {"content": [{"token": value, "logprob": -0.5}]}
            raws.append(write(chunk, 0))
        elif kind == "role":  # never a template; may change a chunk-level field meanwhile
            chunk = make(value, **({"system_fingerprint": "other"} if extra else {}))
            chunk["choices"][0]["delta"] = {"role": "assistant", "content": value}
            raws.append(write(chunk, 0))
        elif kind == "float_repeat":  # a repeated key the length of the chunk would not show
            raws.append(
                write(make(value), extra).replace(
                    b'"created":1796000000', b'"created":1796000000,"y":1e3,"z":1e5,"z":1e5', 1
                )
            )
        elif kind == "reasoning":
            chunk = make(value)
            key = "reasoning" if make is vllm_chunk else "reasoning_content"
            chunk["choices"][0]["delta"] = {key: "why", "content": value}
            raws.append(write(chunk, 0))
        elif kind == "reasoning_only":  # a reasoning model's thinking, one piece at a time
            chunk = make(value)
            key = "reasoning" if make is vllm_chunk else "reasoning_content"
            chunk["choices"][0]["delta"] = {key: value}
            raws.append(write(chunk, extra))
        elif kind == "truncated":
            raws.append(write(make(value), 0)[:-extra])
        else:
            raws.append(write(make(None, choices=[], usage={"completion_tokens": 3}), 0))
    family = EngineKind.VLLM if make is vllm_chunk else EngineKind.LLAMACPP
    real = ChunkVerifier(family, served="tiny", public="my-model")
    reference = FullCheckOnly(family, served="tiny", public="my-model")
    assert run(real, raws, assemble=assemble) == run(reference, raws, assemble=assemble)


def test_text_chunks_after_the_first_take_the_template_path() -> None:
    verifier = ChunkVerifier(EngineKind.VLLM, served="tiny", public="my-model")
    assert verifier.template.head_len < 0
    verifier.relay(orjson.dumps(vllm_chunk("Hel")), 0.0)
    assert verifier.template.head_len > 0  # learned
    event = verifier.relay(orjson.dumps(vllm_chunk('lo "world"\\')), 1.0)
    doc = orjson.loads(event[6:-2])
    assert doc["model"] == "my-model"
    assert doc["choices"][0]["delta"] == {"content": 'lo "world"\\'}
    assert verifier.chunks == 2 and verifier.first_text_at == 0.0


def same_as_full_check(family: EngineKind, raws: list[bytes], *, assemble: bool) -> None:
    real = ChunkVerifier(family, served="tiny", public="my-model")
    reference = FullCheckOnly(family, served="tiny", public="my-model")
    assert run(real, raws, assemble=assemble) == run(reference, raws, assemble=assemble)


@pytest.mark.parametrize("assemble", [False, True])
def test_known_hard_cases(assemble: bool) -> None:
    llama, vllm = EngineKind.LLAMACPP, EngineKind.VLLM
    # The template's bytes with an empty text and its closing quote gone: head + tail[1:].
    cut = orjson.dumps(vllm_chunk("")).replace(b'"},', b"},", 1)
    same_as_full_check(vllm, [orjson.dumps(vllm_chunk("a")), cut], assemble=assemble)
    # A chunk-level field changed by a chunk that is never a template, then the template again.
    role = llama_chunk("x", system_fingerprint="other")
    role["choices"][0]["delta"] = {"role": "assistant", "content": "x"}
    raws = [orjson.dumps(c) for c in (llama_chunk("a"), role, llama_chunk("b"))]
    raws.append(orjson.dumps(llama_chunk(None, finish="stop", system_fingerprint=None)))
    same_as_full_check(llama, raws, assemble=assemble)
    # A chunk whose text also appears, spelled another way, in a field before it: its
    # re-serialised bytes hold the text twice.
    spaced = b'{"metrics":{"content" :"a"},' + orjson.dumps(vllm_chunk("a"))[1:]
    nxt = b'{"metrics":{"content" :"a"},' + orjson.dumps(vllm_chunk("b"))[1:]
    same_as_full_check(vllm, [spaced, nxt], assemble=assemble)
    # A repeated key that the chunk's length would not show (1e3 re-serialises as 1000.0).
    hidden = b'"created":1796000000,"metrics":1e3,"system_fingerprint":1e5,"system_fingerprint":1e5'
    raws = [
        orjson.dumps(vllm_chunk(t)).replace(b'"created":1796000000', hidden) for t in ("a", "b")
    ]
    same_as_full_check(vllm, raws, assemble=assemble)
    with pytest.raises(UnverifiedError, match="repeats"):
        ChunkVerifier(vllm, served="tiny", public="m").relay(raws[0], 0.0)


def test_reasoning_chunks_take_the_template_path_too() -> None:
    verifier = ChunkVerifier(EngineKind.VLLM, served="tiny", public="my-model")
    thinking = [vllm_chunk(None) for _ in range(3)]
    for chunk, text in zip(thinking, ("Let", " me", ' "think"'), strict=True):
        chunk["choices"][0]["delta"] = {"reasoning": text}
    events = [verifier.relay(orjson.dumps(c), float(i)) for i, c in enumerate(thinking)]
    assert verifier.template.head.endswith(b'"reasoning":"')
    assert [orjson.loads(e[6:-2])["choices"][0]["delta"] for e in events] == [
        {"reasoning": "Let"},
        {"reasoning": " me"},
        {"reasoning": ' "think"'},
    ]
    assert verifier.first_text_at == 0.0 and verifier.chunks == 3
