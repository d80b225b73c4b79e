"""A Responses ``input`` against OpenAI's own schemas of its items (``openai_schemas``): an item
or part of each kind the gateway serves, carrying every field its schema has, is taken, and
becomes the chat message the engine is sent; the fields a chat message has no place for are
checked, not sent."""

from __future__ import annotations

from typing import Any

import pytest

from capyctl_gateway._errors import GatewayError
from capyctl_gateway._responses.items import messages_of
from tests.gateway.openai_schemas import BUNDLE, validate_as

INPUT_TEXT = {"type": "input_text", "text": "Hi", "prompt_cache_breakpoint": {"mode": "explicit"}}
INPUT_IMAGE = {
    "type": "input_image",
    "image_url": "data:image/png;base64,AA",
    "file_id": None,
    "detail": "high",
    "prompt_cache_breakpoint": {"mode": "explicit"},
}
OUTPUT_TEXT = {
    "type": "output_text",
    "text": "Checking.",
    "annotations": [
        {"type": "url_citation", "url": "https://x", "title": "x", "start_index": 0, "end_index": 1}
    ],
    "logprobs": [{"token": "C", "logprob": -0.1, "bytes": [67], "top_logprobs": []}],
}
REFUSAL = {"type": "refusal", "refusal": " No."}
# Each kind of item the gateway serves, in OpenAI's schema's name, with every field it has.
ITEMS: dict[str, dict[str, Any]] = {
    "InputMessage": {
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [INPUT_TEXT, INPUT_IMAGE],
    },
    "EasyInputMessage": {
        "type": "message",
        "role": "developer",
        "phase": "commentary",
        "content": [INPUT_TEXT],
    },
    "ReasoningItem": {
        "type": "reasoning",
        "id": "rs_1",
        "encrypted_content": "gAAAA",
        "summary": [{"type": "summary_text", "text": "s"}],
        "content": [{"type": "reasoning_text", "text": "t"}],
        "status": "completed",
    },
    "OutputMessage": {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "phase": "final_answer",
        "content": [OUTPUT_TEXT, REFUSAL],
    },
    "FunctionToolCall": {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "c1",
        "caller": {"type": "direct"},
        "namespace": "tools",
        "name": "f",
        "arguments": "{}",
        "status": "completed",
    },
    "FunctionCallOutputItemParam": {
        "id": "fco_1",
        "type": "function_call_output",
        "call_id": "c1",
        "output": [{"type": "input_text", "text": "42", "prompt_cache_breakpoint": None}],
        "name": "f",
        "namespace": "tools",
        "caller": {"type": "program", "caller_id": "p1"},
        "status": "incomplete",
    },
}
PARTS = {
    "InputTextContent": INPUT_TEXT,
    "InputImageContent": INPUT_IMAGE,
    "OutputTextContent": OUTPUT_TEXT,
    "RefusalContent": REFUSAL,
    "InputTextContentParam": ITEMS["FunctionCallOutputItemParam"]["output"][0],
}


@pytest.mark.parametrize(("name", "sample"), [*ITEMS.items(), *PARTS.items()])
def test_each_sample_has_every_field_of_openais_schema(name: str, sample: dict[str, Any]) -> None:
    """What the next test sends is OpenAI's own (a field added to the schema fails here)."""
    assert set(sample) == set(BUNDLE["$defs"][name]["properties"])
    validate_as(name, sample)


def test_every_field_openais_schema_has_on_an_item_is_taken() -> None:
    """Before, ``phase``, ``caller``, ``namespace``, ``prompt_cache_breakpoint`` and an image's
    ``file_id`` were refused as fields not accepted."""
    assert messages_of(list(ITEMS.values()), None) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hi"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,AA", "detail": "high"},
                },
            ],
        },
        {"role": "system", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Checking. No.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]


def test_the_openai_clients_own_fields_are_taken() -> None:
    """What ``model_dump()`` writes beside OpenAI's fields: a call's ``async_`` (its name for
    ``async``) and the parse helpers' ``parsed`` and ``parsed_arguments``, all None."""
    items = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{**OUTPUT_TEXT, "parsed": None}],
            "id": "msg_1",
            "status": "completed",
            "phase": None,
        },
        {
            **ITEMS["FunctionToolCall"],
            "async_": None,
            "async": False,
            "parsed_arguments": None,
            "caller": None,
            "namespace": None,
        },
    ]
    assert [m["role"] for m in messages_of(items, None)] == ["assistant"]


@pytest.mark.parametrize(
    ("item", "code", "words"),
    [
        ({**ITEMS["OutputMessage"], "phase": "final"}, "invalid_request", "input[0].phase must be"),
        (
            {**ITEMS["OutputMessage"], "status": "done"},
            "invalid_request",
            "input[0].status must be",
        ),
        ({**ITEMS["OutputMessage"], "id": 7}, "invalid_request", "input[0].id must be"),
        ({**ITEMS["FunctionToolCall"], "caller": "me"}, "invalid_request", "caller must be"),
        ({**ITEMS["FunctionToolCall"], "async": "yes"}, "invalid_request", "async must be"),
        ({**ITEMS["FunctionToolCall"], "cache_control": {}}, "invalid_request", "`cache_control`"),
        (
            {"role": "user", "content": [{**INPUT_TEXT, "prompt_cache_breakpoint": {"mode": "x"}}]},
            "invalid_request",
            "content[0].prompt_cache_breakpoint must be",
        ),
        (
            {"role": "user", "content": [{**INPUT_TEXT, "cache_control": {}}]},
            "invalid_request",
            "content[0]: field `cache_control`",
        ),
        (
            {"role": "user", "content": [{**INPUT_IMAGE, "file_id": "file_1"}]},
            "unsupported_parameter",
            "file_id",
        ),
        (
            {"role": "user", "content": [{**INPUT_IMAGE, "detail": "max"}]},
            "invalid_request",
            "detail must be",
        ),
        (
            {"type": "function_call_output", "call_id": "c", "output": [INPUT_IMAGE]},
            "unsupported_parameter",
            "output[0]: parts of type 'input_image'",
        ),
        (
            {"type": "function_call_output", "call_id": None, "output": "x"},
            "invalid_request",
            "input[0].call_id must be a string",
        ),
    ],
)
def test_a_field_taken_but_not_sent_is_still_checked(
    item: dict[str, Any], code: str, words: str
) -> None:
    with pytest.raises(GatewayError) as refused:
        messages_of([item], None)
    assert refused.value.code == code and words in refused.value.message, refused.value


def test_an_images_original_detail_is_taken_and_the_engines_own_kept() -> None:
    """Chat's ``image_url.detail`` has low, high and auto; OpenAI's ``original`` is not sent."""
    (message,) = messages_of(
        [{"role": "user", "content": [{**INPUT_IMAGE, "detail": "original"}]}], None
    )
    assert message["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    ]
