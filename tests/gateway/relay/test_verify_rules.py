"""The verifier's rules from the spec's "Streamed fields" and "When a request is cut short".

* Fields beside delta in a choice are relayed as the engine sent them (and an assembled answer
  keeps the engine's finish_reason), once checked: a finish_reason its engine does not document
  ends the stream (issue 42, item 10); the choice itself, its delta and the delta's keys stay
  checked.
* A stream that produced part of the answer, text or a tool call, has answered.
* A chunk is relayed unchanged except model: the engine's bytes, numbers and escapes included,
  with only the top-level model value renamed.
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
from capyctl_gateway._relay.chunkrules import MAX_TOOL_CALLS
from capyctl_gateway._relay.verify import ChunkVerifier, UnverifiedError

VLLM, LLAMA = EngineKind.VLLM, EngineKind.LLAMACPP
HEAD = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1796000000,"model":"tiny",'
ROLE = HEAD + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'


def vllm(choice: bytes, rest: bytes = b"") -> bytes:
    """A vLLM chunk (model before choices) with this choice, written as given."""
    return HEAD + b'"choices":[' + choice + b"]" + rest + b"}"


def renamed(
    raw: bytes, served: bytes = b'"model":"tiny"', public: bytes = b'"model":"pub"'
) -> bytes:
    """The event the client must get: the engine's bytes, the top-level model renamed."""
    assert raw.count(served) == 1
    return b"data: " + raw.replace(served, public) + b"\n\n"


def verifier(kind: EngineKind = VLLM) -> ChunkVerifier:
    return ChunkVerifier(kind, served="tiny", public="pub")


def relay_all(v: ChunkVerifier, raws: list[bytes]) -> list[bytes]:
    return [v.relay(raw, float(i)) for i, raw in enumerate(raws)]


# Fields beside delta ------------------------------------------------------------------------


DOCUMENTED = [
    (VLLM, ("stop", "length", "tool_calls", "abort", "error", "repetition")),
    (EngineKind.SGLANG, ("stop", "length", "tool_calls", "abort")),
    (LLAMA, ("stop", "length", "tool_calls")),
    (EngineKind.TENSORFOLD, ("stop", "length", "tool_calls")),
]
"""Each engine's finish reasons, from its sources: vLLM's FINISH_REASON_STRINGS, SGLang's
FINISH_* classes, llama-server's and TensorFold's chat handlers; each adds tool_calls where
the answer is a tool call."""


@pytest.mark.parametrize(
    ("kind", "finish"), [(kind, finish) for kind, known in DOCUMENTED for finish in known]
)
def test_a_finish_reason_its_engine_documents_is_relayed_as_sent(
    kind: EngineKind, finish: str
) -> None:
    v = verifier(kind)
    text = vllm(b'{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}')
    last = vllm(b'{"index":0,"delta":{},"finish_reason":"' + finish.encode() + b'"}')
    events = relay_all(v, [ROLE, text, last])
    assert events[2] == renamed(last)
    assert v.finished  # any finish_reason but null finishes the choice
    assert v.first_output_at == 1.0 and v.chunks == 3
    v.verify_end(True)
    with pytest.raises(UnverifiedError, match="after the finish"):
        v.relay(text, 3.0)


@pytest.mark.parametrize(
    ("kind", "finish"),
    [
        (VLLM, b'"cancelled by admin"'),
        (VLLM, b'""'),
        (VLLM, b"7"),
        (VLLM, b'{"x":[]}'),
        (VLLM, b'"function_call"'),  # the gateway refuses functions: no answer ends in one
        (VLLM, b'"content_filter"'),  # OpenAI's; no engine served here sends it
        (LLAMA, b'"abort"'),
        (EngineKind.SGLANG, b'"error"'),
        (EngineKind.TENSORFOLD, b'"abort"'),
    ],
)
def test_a_finish_reason_its_engine_does_not_document_is_unverified(
    kind: EngineKind, finish: bytes
) -> None:
    """Issue 42, item 10: a finish reason was relayed as sent, whatever it was."""
    v = verifier(kind)
    v.relay(ROLE, 0.0)
    last = vllm(b'{"index":0,"delta":{"content":"Hi"},"finish_reason":' + finish + b"}")
    with pytest.raises(UnverifiedError, match="finish_reason") as refused:
        v.relay(last, 1.0)
    assert finish.decode() not in refused.value.message  # the engine's word: the log's only
    assert not v.finished


def test_an_assembled_answer_keeps_the_engine_s_finish_reason() -> None:
    v, assembler = verifier(), Assembler()
    text = vllm(b'{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}')
    last = vllm(b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"abort"}')
    for i, raw in enumerate([ROLE, text, last]):
        assembler.add(v.collect(raw, float(i)))
    v.verify_end(True)
    (choice,) = assembler.result()["choices"]
    assert choice["finish_reason"] == "abort"
    assert choice["message"]["content"] == "Hi"


def test_an_assembled_answer_has_openais_required_logprobs_and_refusal_null_when_not_sent() -> None:
    v, assembler = verifier(), Assembler()
    text = vllm(b'{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}')
    for i, raw in enumerate([ROLE, text]):
        assembler.add(v.collect(raw, float(i)))
    (choice,) = assembler.result()["choices"]
    assert "logprobs" in choice and choice["logprobs"] is None
    assert choice["message"] == {"role": "assistant", "content": "Hi", "refusal": None}


def test_an_assembled_answer_joins_the_engines_logprobs_with_content_and_refusal() -> None:
    v, assembler = verifier(), Assembler()
    first, second = b'[{"token":"a","logprob":-0.5}]', b'[{"token":"b","logprob":-1E-7}]'
    refused = b'[{"token":"no","logprob":-0.1}]'
    for i, lp in enumerate(
        (
            b'{"content":' + first + b"}",
            b"null",
            b'{"content":' + second + b',"refusal":' + refused + b"}",
        )
    ):
        raw = vllm(b'{"index":0,"delta":{"content":"x"},"logprobs":' + lp + b"}")
        assembler.add(v.collect(raw, float(i)))
    (choice,) = assembler.result()["choices"]
    assert choice["logprobs"] == {
        "content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1e-7}],
        "refusal": [{"token": "no", "logprob": -0.1}],
    }


def test_assembled_logprobs_carry_both_members_each_null_when_not_sent() -> None:
    v, assembler = verifier(), Assembler()
    lp = b'{"content":[{"token":"a","logprob":-0.5}]}'
    assembler.add(v.collect(vllm(b'{"index":0,"delta":{"content":"a"},"logprobs":' + lp + b"}"), 0))
    assert assembler.result()["choices"][0]["logprobs"] == {
        "content": [{"token": "a", "logprob": -0.5}],
        "refusal": None,
    }
    v, assembler = verifier(), Assembler()
    lp = b'{"content":null,"refusal":[{"token":"no","logprob":-0.1}]}'
    assembler.add(v.collect(vllm(b'{"index":0,"delta":{"content":"a"},"logprobs":' + lp + b"}"), 0))
    assert assembler.result()["choices"][0]["logprobs"] == {
        "content": None,
        "refusal": [{"token": "no", "logprob": -0.1}],
    }


def test_a_refusal_in_a_delta_ends_the_stream_so_an_answers_refusal_is_always_null() -> None:
    v = verifier()
    refusal = vllm(b'{"index":0,"delta":{"refusal":"I cannot."},"finish_reason":null}')
    with pytest.raises(UnverifiedError):
        v.collect(refusal, 0.0)
    # The verifier's delta table has no refusal, so no assembled answer ever had one; the
    # assembler does not join one even when handed it.
    assembler = Assembler()
    assembler.add({**orjson.loads(ROLE), "choices": [{"index": 0, "delta": {"refusal": "No."}}]})
    assert assembler.result()["choices"][0]["message"]["refusal"] is None


@pytest.mark.parametrize(
    ("kind", "choices", "reason"),
    [
        (VLLM, b"[1]", "the choice is not"),
        (VLLM, b'["choice"]', "the choice is not"),
        (VLLM, b"[null]", "the choice is not"),
        (VLLM, b'[{"index":0,"finish_reason":null}]', "no delta"),
        (VLLM, b'[{"index":0,"delta":null,"finish_reason":null}]', "no delta"),
        (VLLM, b'[{"index":0,"delta":["content"],"finish_reason":null}]', "no delta"),
        (VLLM, b'[{"index":0,"delta":{},"finish_reason":null},{"index":1,"delta":{}}]', "more"),
        (VLLM, b'[{"index":0,"delta":{"reasoning_content":"x"},"finish_reason":null}]', "carries"),
        (VLLM, b'[{"index":0,"delta":{"citations":[]},"finish_reason":null}]', "'citations'"),
        (LLAMA, b'[{"index":0,"delta":{"reasoning":"x"},"finish_reason":null}]', "'reasoning'"),
        (VLLM, b'[{"index":0,"delta":{"content":3},"finish_reason":"stop"}]', "not a string"),
    ],
)
def test_the_choice_its_delta_and_the_delta_keys_stay_checked(
    kind: EngineKind, choices: bytes, reason: str
) -> None:
    v = verifier(kind)
    v.relay(ROLE, 0.0)
    with pytest.raises(UnverifiedError) as refused:
        v.relay(HEAD + b'"choices":' + choices + b"}", 1.0)
    # the key's name, the engine's words, is in the detail the log has, not in the message
    assert reason in f"{refused.value.message} {refused.value.detail}"


# Answered ------------------------------------------------------------------------------------

CALL = vllm(
    b'{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    b'"function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}'
)
CALL_ARGS = vllm(
    b'{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\":'
    b'\\"Paris\\"}"}}]},"logprobs":null,"finish_reason":null}'
)


@pytest.mark.parametrize("assemble", [False, True])
def test_a_stream_whose_first_output_is_a_tool_call_has_answered(assemble: bool) -> None:
    v = verifier()
    step = v.collect if assemble else v.relay
    answered = []
    for i, raw in enumerate([ROLE, CALL, CALL_ARGS]):
        step(raw, float(i))
        answered.append(v.answered)
    # a chunk that only names the assistant role does not count; a tool call does
    assert answered == [False, True, True]
    assert v.first_output_at == 1.0 and v.first_text_at is None


def test_an_empty_tool_call_list_has_not_answered() -> None:
    v = verifier()
    v.relay(vllm(b'{"index":0,"delta":{"role":"assistant","tool_calls":[]}}'), 0.0)
    assert not v.answered and v.first_output_at is None


# One coherent choice (issue 42, item 11) -------------------------------------------------------


@pytest.mark.parametrize("index", [b"1", b"-1", b'"0"', b"true", b"null", None])
def test_a_choice_whose_index_is_not_0_is_unverified(index: bytes | None) -> None:
    """n is 1: a choice of another index is a second choice's text, which would be merged into
    the first."""
    v = verifier()
    v.relay(ROLE, 0.0)
    lead = b"" if index is None else b'"index":' + index + b","
    with pytest.raises(UnverifiedError, match="index"):
        v.relay(vllm(b"{" + lead + b'"delta":{"content":"Hi"},"finish_reason":null}'), 1.0)


def call(index: int = 0, cid: str | None = None, name: str | None = None, args: str = "") -> bytes:
    """A chunk of one tool call's delta, with only the members given."""
    fn: dict[str, str] = {"arguments": args} if name is None else {"name": name, "arguments": args}
    tool: dict[str, Any] = {"index": index, "function": fn}
    if cid is not None:
        tool |= {"id": cid, "type": "function"}
    choice = {"index": 0, "delta": {"tool_calls": [tool]}, "finish_reason": None}
    return vllm(orjson.dumps(choice))


@pytest.mark.parametrize(
    ("chunks", "reason"),
    [
        ([call(cid="call_1", name="f"), call(cid="call_2", args="{}")], "id changed"),
        ([call(cid="call_1", name="f"), call(name="g", args="{}")], "name changed"),
        ([call(cid="call_1", args="{}")], "no name"),
        ([call(cid="call_1", name="", args="{}")], "no name"),
        ([call(cid="a", name="f"), call(index=1, cid="b", name="g"), call(1, "c")], "id changed"),
    ],
)
def test_a_tool_call_that_changes_mid_call_or_has_no_name_is_unverified(
    chunks: list[bytes], reason: str
) -> None:
    v = verifier()
    *good, bad = [ROLE, *chunks]
    relay_all(v, good)
    with pytest.raises(UnverifiedError, match=reason):
        v.relay(bad, 9.0)


def test_an_answer_makes_at_most_max_tool_calls() -> None:
    v = verifier()
    relay_all(v, [ROLE, *(call(i, f"c{i}", "f") for i in range(MAX_TOOL_CALLS))])
    with pytest.raises(UnverifiedError, match=f"more than {MAX_TOOL_CALLS} tool calls"):
        v.relay(call(MAX_TOOL_CALLS, "one-more", "f"), 1.0)


def test_a_tool_call_may_repeat_its_id_and_name_and_calls_may_interleave() -> None:
    v, assembler = verifier(), Assembler()
    chunks = [
        call(cid="a", name="f"),
        call(cid="a", name="f", args='{"x":'),
        call(index=1, cid="b", name="g", args="{}"),
        call(args="1}"),
        vllm(b'{"index":0,"delta":{},"finish_reason":"tool_calls"}'),
    ]
    for i, raw in enumerate([ROLE, *chunks]):
        assembler.add(v.collect(raw, float(i)))
    v.verify_end(True)
    calls = assembler.result()["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", "f", '{"x":1}'),
        ("b", "g", "{}"),
    ]


@pytest.mark.parametrize(
    "usage",
    [
        b'{"prompt_tokens":"12","completion_tokens":3,"total_tokens":15}',
        b'{"prompt_tokens":12,"completion_tokens":3.5,"total_tokens":15}',
        b'{"prompt_tokens":12,"completion_tokens":-3,"total_tokens":15}',
        b'{"prompt_tokens":12,"completion_tokens":true,"total_tokens":15}',
        b'{"prompt_tokens":12,"completion_tokens":[3],"total_tokens":15}',
        b'{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":"all"}}',
        b'{"prompt_tokens":12,"prompt_tokens_details":[8]}',
        b'{"prompt_tokens":12,"completion_tokens_details":{"reasoning_tokens":{"n":1}}}',
    ],
)
def test_usage_whose_counts_are_not_counts_is_unverified(usage: bytes) -> None:
    v = verifier()
    v.relay(ROLE, 0.0)
    with pytest.raises(UnverifiedError, match="usage"):
        v.relay(HEAD + b'"choices":[],"usage":' + usage + b"}", 1.0)


def test_usage_counts_may_be_null_where_an_engine_has_none() -> None:
    v = verifier(EngineKind.SGLANG)
    v.relay(ROLE, 0.0)
    usage = (
        b'{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,'
        b'"prompt_tokens_details":null,"reasoning_tokens":0}'
    )
    v.relay(HEAD + b'"choices":[],"usage":' + usage + b"}", 1.0)
    assert v.usage == orjson.loads(usage)


# Unchanged except model ------------------------------------------------------------------------

USAGE = (
    b'"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15},'
    b'"metrics":{"time_to_first_token_ms":1.0,"generation_time_ms":1e5,"queue_time_ms":0.50,'
    b'"tokens_per_second":123456789012345678901234567890,"spec":18446744073709551615}'
)


@pytest.mark.parametrize(
    "raw",
    [
        # numbers orjson would write otherwise (1e5, 0.50, an integer past 64 bits)
        HEAD + b'"choices":[],' + USAGE + b"}",
        # escapes orjson would write otherwise
        vllm(b'{"index":0,"delta":{"content":"caf\\u00e9 \\/ \\"q\\" \\ud83d\\ude00"}}'),
        vllm(b'{"index":0,"delta":{"content":"x"},"logprobs":{"content":[{"logprob":-1E-7}]}}'),
        # Python's spacing, an engine that escapes all but ASCII
        json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
                    "choices": [{"index": 0, "delta": {"content": "né"}}]}).encode(),
        b' {"choices":[{"index":0,"delta":{"content":"x"}}] , "model" :\t"tiny" ,'
        b'"id":"c","object":"chat.completion.chunk","created":1}\n',
    ],
    ids=["numbers", "escapes", "exponent", "python", "spaces"],
)  # fmt: skip
def test_a_chunk_reaches_the_client_as_the_engine_wrote_it(raw: bytes) -> None:
    v = verifier()
    event = v.relay(raw, 0.0)
    assert event == b"data: " + raw.replace(b'"tiny"', b'"pub"') + b"\n\n"


def test_only_the_top_level_model_is_renamed() -> None:
    # llama.cpp writes model after choices: a model inside a choice comes first in the bytes.
    inner = b'{"index":0,"delta":{"content":"x"},"x":{"model":"tiny"},"finish_reason":null}'
    tail = b'"created":1,"id":"c","model":"tiny","object":"chat.completion.chunk"}'
    for raw in (
        b'{"choices":[' + inner + b"]," + tail,  # as orjson writes it
        b'{"choices":[' + inner + b"], " + tail,  # written another way
        b'{"timings":{"a\\"model":"tiny"},"choices":[' + inner + b"], " + tail,  # ends in "model
    ):
        at = raw.rindex(b"tiny")
        assert (
            verifier(LLAMA).relay(raw, 0.0)
            == b"data: " + raw[:at] + b"pub" + raw[at + 4 :] + b"\n\n"
        )


def test_a_model_value_written_with_escapes_is_renamed_in_place() -> None:
    raw = HEAD.replace(b'"tiny"', b'"t\\u0069ny"') + b'"choices":[{"index":0,"delta": {}}]}'
    assert verifier().relay(raw, 0.0) == renamed(raw, b'"t\\u0069ny"', b'"pub"')


@pytest.mark.parametrize("key", [b'"mod\\u0065l":', b'"\\u006dodel" :'], ids=["end", "start"])
def test_a_model_key_not_found_in_the_bytes_falls_back_to_re_serialising(key: bytes) -> None:
    head = HEAD.replace(b'"model":', key)
    raw = head + b'"choices":[{"index":0,"delta":{"content":"x"}}],"metrics":{"model":"tiny"}}'
    doc = orjson.loads(raw)
    event = verifier().relay(raw, 0.0)
    doc["model"] = "pub"
    assert event == b"data: " + orjson.dumps(doc) + b"\n\n"


def test_a_chunk_full_of_inner_models_is_re_serialised_with_only_the_top_level_renamed() -> None:
    inner = b",".join(b'{"model":"tiny"}' for _ in range(6))
    raw = b'{"choices":[{"index":0,"delta":{},"x":[' + inner + b"]}], " + HEAD[1:-1] + b"}"
    doc = orjson.loads(raw)
    event = verifier(LLAMA).relay(raw, 0.0)
    doc["model"] = "pub"
    assert event == b"data: " + orjson.dumps(doc) + b"\n\n"
    assert orjson.loads(event[6:-2])["choices"][0]["x"] == [{"model": "tiny"}] * 6


def test_template_chunks_keep_the_engine_s_bytes_too() -> None:
    # llama.cpp's chunks, with a fingerprint orjson would write without its escape.
    def chunk(text: bytes) -> bytes:
        return (
            b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"' + text + b'"}}],'
            b'"created":1796000000,"id":"chatcmpl-1","model":"tiny",'
            b'"system_fingerprint":"b10798\\/unknown","object":"chat.completion.chunk"}'
        )

    v = verifier(LLAMA)
    raws = [chunk(t) for t in (b"Hel", b"lo", b" w\\u00f6rld", b"!")]
    assert relay_all(v, raws) == [renamed(raw) for raw in raws]
    assert v.template.head_len > 0 and v.chunks == 4  # the template was learned and used


def test_a_repeated_key_is_still_refused_however_the_chunk_is_written() -> None:
    for raw in (
        vllm(b'{"index":0,"delta":{"content":"a","content":"b"}}'),
        vllm(b'{"index":0, "delta":{"content":"a"},"index":0}'),
        vllm(b'{"index":0,"delta":{"content":"a"}}', b',"metrics":1e3,"metrics":1e3'),
        vllm(b'{"index":0,"delta":{"content":"a"}}', b', "model": "tiny"'),
    ):
        with pytest.raises(UnverifiedError, match="repeats"):
            verifier().relay(raw, 0.0)


# Property: whatever the writer, the client gets the engine's bytes with the model renamed.

TOP = ("id", "object", "created", "model", "choices")
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # what orjson writes
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["model", "a", "é", 'q"']), inner, max_size=3),
    ),
    max_leaves=6,
)


class FullCheckOnly(ChunkVerifier):
    __slots__ = ()

    def _learn(self, raw: bytes, chunk: dict[str, Any], out: bytes) -> None:
        return None


def write(doc: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return orjson.dumps(doc)
    if style == 1:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    return json.dumps(doc, ensure_ascii=False).encode()


@settings(max_examples=150, deadline=None)
@given(
    st.booleans(),
    st.lists(
        st.tuples(st.text(max_size=5), st.integers(0, 2), st.none() | values, st.none() | values),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["stop", "length", "tool_calls"]),
    st.one_of(st.none(), values),
)
def test_every_relayed_chunk_is_the_engine_s_own_bytes(
    llama: bool,
    texts: list[tuple[str, int, Any, Any]],
    finish: str,
    usage_extra: Any,
) -> None:
    def doc(model: str, choice: dict[str, Any], **more: Any) -> dict[str, Any]:
        out = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model}
        out |= {"choices": [choice]} | more
        if llama:  # model after choices
            out = dict(sorted(out.items()))
        return out

    chunks: list[tuple[dict[str, Any], int]] = []
    for text, style, beside, top in texts:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        if beside is not None:
            choice["x"] = beside  # a field beside delta, relayed as sent
        # a chunk-level field both engines may send, with any value
        fields = {} if top is None else {"system_fingerprint": top}
        chunks.append((doc("tiny", choice, **fields), style))
    ending = {"index": 0, "delta": {}, "finish_reason": finish, "x": usage_extra}
    chunks.append((doc("tiny", ending), 1))
    last = doc("tiny", {}, usage={"completion_tokens": 3, "prompt_tokens_details": None})
    last["choices"] = []
    chunks.append((last, 2))
    raws = [write(c, style) for c, style in chunks]
    expected = []
    for c, style in chunks:
        # The same writer with the public name gives the engine's bytes with the model renamed.
        expected.append(b"data: " + write(c | {"model": "pub"}, style) + b"\n\n")
    kind = LLAMA if llama else VLLM
    for v in (verifier(kind), FullCheckOnly(kind, served="tiny", public="pub")):
        assert relay_all(v, raws) == expected
        v.verify_end(True)
