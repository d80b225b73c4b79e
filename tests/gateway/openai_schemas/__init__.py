"""OpenAI's own schemas for the Responses API, to hold the gateway's /v1/responses to.

responses.json is extracted from OpenAI's published OpenAPI spec (README.md says from which
commit, and how to refresh it). validate_response checks a Response object; validate_event checks
one streaming event, by the schema its ``type`` names. Both raise jsonschema.ValidationError
whose message says which schema, where in the object, and what is wrong.

The schemas are OpenAI's, unchanged in substance: they admit properties they do not name, so a
misspelt optional field passes; a missing required one, a wrong type or a value outside an enum
does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError  # type: ignore[import-untyped]
from jsonschema.exceptions import best_match, relevance  # type: ignore[import-untyped]
from referencing import Registry
from referencing.jsonschema import DRAFT202012

__all__ = [
    "BUNDLE",
    "EVENT_SCHEMAS",
    "SOURCE",
    "validate_as",
    "validate_event",
    "validate_response",
]

_URI = "urn:openai-openapi:responses"
_UNIONS = frozenset({"oneOf", "anyOf"})

BUNDLE: dict[str, Any] = json.loads(
    Path(__file__).with_name("responses.json").read_text(encoding="utf-8")
)
SOURCE: dict[str, str] = BUNDLE["source"]
_DEFS: dict[str, Any] = BUNDLE["$defs"]
_REGISTRY: Registry[Any] = Registry().with_resource(_URI, DRAFT202012.create_resource(BUNDLE))


def _event_type(name: str) -> str:
    """The one ``type`` value the event schema name admits."""
    kind = _DEFS[name].get("properties", {}).get("type", {})
    values = [kind["const"]] if "const" in kind else kind.get("enum", [])
    if len(values) != 1 or not isinstance(values[0], str):
        raise RuntimeError(f"responses.json: {name} does not name one event type: {kind}")
    return str(values[0])


EVENT_SCHEMAS: dict[str, str] = {
    _event_type(name): name
    for name in (
        member["$ref"].removeprefix("#/$defs/") for member in _DEFS["ResponseStreamEvent"]["anyOf"]
    )
}
"""Each streaming event's ``type``, to the name of its schema in responses.json."""

_VALIDATORS: dict[str, Any] = {
    name: Draft202012Validator({"$ref": f"{_URI}#/$defs/{name}"}, registry=_REGISTRY)
    for name in ("Response", *EVENT_SCHEMAS.values())
}


def validate_response(obj: Any) -> None:
    """Raise ValidationError unless obj is a Response object as OpenAI's schema has it."""
    _validate("Response", obj)


def validate_event(obj: Any) -> None:
    """Raise ValidationError unless obj is a streaming event as its ``type``'s schema has it."""
    kind = obj.get("type") if isinstance(obj, Mapping) else None
    if not isinstance(kind, str):
        raise ValidationError(f"a streaming event needs a string 'type', not {kind!r}")
    name = EVENT_SCHEMAS.get(kind)
    if name is None:
        raise ValidationError(
            f"{kind!r} is no streaming event type of OpenAI's ResponseStreamEvent "
            f"({len(EVENT_SCHEMAS)} are; spec commit {SOURCE['commit'][:12]})"
        )
    _validate(name, obj)


def validate_as(name: str, obj: Any) -> None:
    """Raise ValidationError unless obj is what the schema ``name`` of responses.json admits
    (an input item or a content part, say)."""
    if name not in _VALIDATORS:
        ref = {"$ref": f"{_URI}#/$defs/{name}"}
        _VALIDATORS[name] = Draft202012Validator(ref, registry=_REGISTRY)
    _validate(name, obj)


def _validate(name: str, obj: Any) -> None:
    errors = list(_VALIDATORS[name].iter_errors(obj))
    if not errors:
        return
    error = _explain(max(errors, key=relevance))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    raise ValidationError(f"{name} at {error.json_path}: {error.message}{more}") from error


def _explain(error: Any) -> Any:
    """The error that says most: into a union, the branch whose ``type`` the instance names.

    A union of objects told apart by ``type`` (an output item, a content part, a tool) fails as
    a whole; best_match may then pick the complaint of a branch the instance never meant. Where
    exactly one branch found nothing wrong with ``type``, its own complaint is the one to show.
    """
    while error.validator in _UNIONS and error.context:
        branches: dict[int, list[Any]] = {}
        for sub in error.context:
            branches.setdefault(sub.relative_schema_path[0], []).append(sub)
        meant = [subs for subs in branches.values() if not _about_type(subs)]
        if len(meant) != 1:
            break
        error = max(meant[0], key=relevance)
    return best_match([error])


def _about_type(errors: Iterable[Any]) -> bool:
    """Whether a branch's errors include one about the instance's ``type`` (or its shape)."""
    for sub in errors:
        relative = list(sub.relative_path)
        if relative == ["type"] or (not relative and sub.validator in ("type", "const", "enum")):
            return True
    return False
