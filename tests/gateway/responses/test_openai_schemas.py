"""The Responses API schemas taken from OpenAI's spec (tests/gateway/openai_schemas): what they
admit, and that they refuse, so that a test validating the gateway's output through them can fail."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator, ValidationError  # type: ignore[import-untyped]

from tests.gateway.openai_schemas import (
    BUNDLE,
    EVENT_SCHEMAS,
    SOURCE,
    validate_event,
    validate_response,
)


def message_item(text: str = "Hello.", status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_1",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item() -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }


def reasoning_item() -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "The user greets me."}],
        "status": "completed",
    }


def response(
    status: str = "completed", output: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A Response with every field the schema requires, and the usual others."""
    return {
        "id": "resp_x",
        "object": "response",
        "created_at": 1,
        "status": status,
        "completed_at": 2 if status == "completed" else None,
        "model": "m",
        "output": [message_item()] if output is None else output,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "max_output_tokens": None,
        "previous_response_id": None,
        "reasoning": None,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {
            "input_tokens": 5,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 7,
        },
    }


def refused(check: Any, obj: Any, *fragments: str) -> str:
    with pytest.raises(ValidationError) as caught:
        check(obj)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_bundle_names_its_source_and_is_closed() -> None:
    assert SOURCE["repository"] == "https://github.com/openai/openai-openapi"
    assert re.fullmatch(r"[0-9a-f]{40}", SOURCE["commit"])
    assert SOURCE["date"]
    Draft202012Validator.check_schema(BUNDLE)
    text = repr(BUNDLE)
    assert "#/components/" not in text and "nullable" not in text
    defs = BUNDLE["$defs"]
    refs = set(re.findall(r"'\$ref': '#/\$defs/([^']+)'", text))
    assert refs <= set(defs), refs - set(defs)
    assert {"Response", "ResponseStreamEvent"} <= set(defs)


def test_a_minimal_completed_response_passes() -> None:
    validate_response(response())


def test_only_the_fields_the_schema_requires() -> None:
    bare = {
        key: value
        for key, value in response().items()
        if key
        in {
            "id",
            "object",
            "created_at",
            "error",
            "incomplete_details",
            "instructions",
            "model",
            "tools",
            "output",
            "parallel_tool_calls",
            "metadata",
            "tool_choice",
            "temperature",
            "top_p",
        }
    }
    validate_response(bare)
    for key in bare:
        if key == "output":
            continue
        partial = {k: v for k, v in bare.items() if k != key}
        refused(validate_response, partial, f"'{key}' is a required property")


def test_function_call_and_reasoning_items_pass() -> None:
    validate_response(response(output=[reasoning_item(), function_call_item()]))
    validate_response(response(output=[reasoning_item(), message_item()]))


def test_usage_is_left_out_not_null() -> None:
    """The spec's usage is optional but not nullable (the live API has been seen sending null)."""
    started = response("in_progress", output=[])
    del started["usage"]
    validate_response(started)
    refused(
        validate_response, {**started, "usage": None}, "$.usage", "None is not of type 'object'"
    )


def test_a_failed_and_an_incomplete_response_pass() -> None:
    failed = response("failed", output=[])
    failed["error"] = {"code": "server_error", "message": "the engine went away"}
    del failed["usage"]
    validate_response(failed)
    incomplete = response("incomplete", output=[message_item("Hel", "incomplete")])
    incomplete["incomplete_details"] = {"reason": "max_output_tokens"}
    validate_response(incomplete)


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (lambda r: r.update(status="done"), ("$.status", "'done' is not one of")),
        (lambda r: r.update(object="chat.completion"), ("$.object",)),
        (lambda r: r.update(error={"code": "engine_down", "message": "x"}), ("$.error",)),
        (lambda r: r.update(incomplete_details={"reason": "length"}), ("$.incomplete_details",)),
        (
            lambda r: r["output"][0]["content"][0].pop("logprobs"),
            ("$.output[0].content[0]", "'logprobs' is a required property"),
        ),
        (
            lambda r: r["output"][0]["content"][0].update(text=None),
            ("$.output[0].content[0].text", "None is not of type 'string'"),
        ),
        (lambda r: r["output"][0].pop("id"), ("$.output[0]", "'id' is a required property")),
        (
            lambda r: r["usage"]["input_tokens_details"].pop("cached_tokens"),
            ("'cached_tokens' is a required property",),
        ),
        (
            lambda r: r["usage"]["output_tokens_details"].pop("reasoning_tokens"),
            ("'reasoning_tokens' is a required property",),
        ),
        (
            lambda r: r.update(output=[{**function_call_item(), "arguments": {"city": "Paris"}}]),
            ("$.output[0].arguments", "is not of type 'string'"),
        ),
        (
            lambda r: r.update(output=[{**reasoning_item(), "summary": None}]),
            ("$.output[0].summary",),
        ),
    ],
)
def test_broken_responses_are_refused(change: Any, fragments: tuple[str, ...]) -> None:
    broken = copy.deepcopy(response())
    change(broken)
    refused(validate_response, broken, "Response at ", *fragments)


def events() -> list[dict[str, Any]]:
    """A streamed text answer, one event of each kind it has, then a function call's deltas."""
    started = response("in_progress", output=[])
    del started["usage"]
    empty = message_item("", "in_progress")
    empty["content"] = []
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        {"type": "response.created", "sequence_number": 0, "response": started},
        {"type": "response.in_progress", "sequence_number": 1, "response": started},
        {
            "type": "response.output_item.added",
            "sequence_number": 2,
            "output_index": 0,
            "item": empty,
        },
        {
            "type": "response.content_part.added",
            "sequence_number": 3,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "part": part,
        },
        {
            "type": "response.output_text.delta",
            "sequence_number": 4,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "Hello.",
            "logprobs": [],
        },
        {
            "type": "response.output_text.done",
            "sequence_number": 5,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "text": "Hello.",
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            "sequence_number": 6,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "part": {**part, "text": "Hello."},
        },
        {
            "type": "response.output_item.done",
            "sequence_number": 7,
            "output_index": 0,
            "item": message_item(),
        },
        {"type": "response.completed", "sequence_number": 8, "response": response()},
        {
            "type": "response.function_call_arguments.delta",
            "sequence_number": 3,
            "item_id": "fc_1",
            "output_index": 1,
            "delta": '{"city": ',
        },
        {
            "type": "response.function_call_arguments.done",
            "sequence_number": 4,
            "item_id": "fc_1",
            "name": "get_weather",
            "output_index": 1,
            "arguments": '{"city": "Paris"}',
        },
        {
            "type": "response.reasoning_text.delta",
            "sequence_number": 3,
            "item_id": "rs_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "The user",
        },
        {
            "type": "response.reasoning_text.done",
            "sequence_number": 4,
            "item_id": "rs_1",
            "output_index": 0,
            "content_index": 0,
            "text": "The user greets me.",
        },
        {
            "type": "error",
            "sequence_number": 5,
            "code": "server_error",
            "message": "the engine went away",
            "param": None,
        },
    ]


@pytest.mark.parametrize("event", events(), ids=lambda e: f"{e['type']}")
def test_correct_events_pass(event: dict[str, Any]) -> None:
    validate_event(event)


def test_terminal_events_pass() -> None:
    failed = response("failed", output=[])
    failed["error"] = {"code": "server_error", "message": "the engine went away"}
    validate_event({"type": "response.failed", "sequence_number": 9, "response": failed})
    incomplete = response("incomplete")
    incomplete["incomplete_details"] = {"reason": "max_output_tokens"}
    validate_event({"type": "response.incomplete", "sequence_number": 9, "response": incomplete})


def test_broken_events_are_refused() -> None:
    delta = events()[4]
    assert delta["type"] == "response.output_text.delta"

    no_sequence = {k: v for k, v in delta.items() if k != "sequence_number"}
    refused(
        validate_event,
        no_sequence,
        "ResponseTextDeltaEvent",
        "'sequence_number' is a required property",
    )
    refused(validate_event, {**delta, "delta": 5}, "$.delta", "5 is not of type 'string'")
    refused(validate_event, {**delta, "sequence_number": "4"}, "$.sequence_number")
    no_logprobs = {k: v for k, v in delta.items() if k != "logprobs"}
    refused(validate_event, no_logprobs, "'logprobs' is a required property")
    # A type that names another event: the body is judged by that event's schema.
    refused(
        validate_event,
        {**delta, "type": "response.output_text.done"},
        "ResponseTextDoneEvent",
        "'text' is a required property",
    )
    refused(
        validate_event, {**delta, "type": "response.output_text.delta2"}, "no streaming event type"
    )
    refused(validate_event, {**delta, "type": 4}, "needs a string 'type'")
    refused(
        validate_event, {k: v for k, v in delta.items() if k != "type"}, "needs a string 'type'"
    )

    created = events()[0]
    refused(
        validate_event,
        {**created, "response": {**created["response"], "status": "started"}},
        "$.response.status",
    )
    item = events()[2]
    refused(validate_event, {**item, "item": {**item["item"], "type": "output_message"}}, "$.item")
    call = events()[9]
    refused(validate_event, {**call, "delta": {"city": "Paris"}}, "$.delta")
    refused(
        validate_event,
        {k: v for k, v in call.items() if k != "item_id"},
        "'item_id' is a required property",
    )
    error = events()[-1]
    refused(
        validate_event,
        {k: v for k, v in error.items() if k != "param"},
        "'param' is a required property",
    )


def test_every_stream_event_type_has_its_schema() -> None:
    for kind in (
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.failed",
        "response.incomplete",
        "response.queued",
        "response.output_item.added",
        "response.output_item.done",
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.refusal.delta",
        "response.refusal.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "error",
    ):
        assert kind in EVENT_SCHEMAS, kind
