"""Extract the Responses API schemas from OpenAI's OpenAPI spec into responses.json.

Not run by the tests: it is how responses.json was made, and how it is refreshed (README.md).

    python tests/gateway/openai_schemas/extract.py SPEC --commit SHA --date DATE

SPEC is openapi.yaml (or openapi.json) from github.com/openai/openai-openapi at commit SHA.
The bundle holds, under $defs, every component schema reachable from the roots (Response and
ResponseStreamEvent), converted from OpenAPI's dialect to plain JSON Schema 2020-12:

- ``$ref: #/components/schemas/X`` becomes ``$ref: #/$defs/X``;
- ``$recursiveRef: "#"`` (only CompoundFilter uses it) becomes a ``$ref`` to the component that
  holds it, which is what it means there, and ``$recursiveAnchor`` goes;
- ``nullable: true`` (OpenAPI 3.0, still left in places) admits null: "null" joins ``type`` (and
  null joins ``enum``), or the schema becomes ``anyOf: [schema, {type: null}]`` when it has no type;
- ``discriminator``, ``example``, ``examples``, ``xml``, ``externalDocs`` and every ``x-*`` key
  go; everything else (descriptions included) stays as the spec has it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOTS = ("Response", "ResponseStreamEvent")
REPOSITORY = "https://github.com/openai/openai-openapi"
COMPONENT_REF = re.compile(r"^#/components/schemas/([^/]+)$")

# Keywords whose value is a schema, a list of schemas, or a map of name to schema.
SCHEMA_KEYWORDS = frozenset(
    {
        "items",
        "additionalProperties",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
        "additionalItems",
    }
)
SCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs"})
DROPPED_KEYWORDS = frozenset(
    {"discriminator", "example", "examples", "xml", "externalDocs", "$recursiveAnchor"}
)


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader less YAML 1.1's surprises: on/off/yes/no stay strings, dates stay strings."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [
        (tag, pattern)
        for tag, pattern in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def load_spec(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    spec = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader
    if not isinstance(spec, dict):
        raise SystemExit(f"{path}: not an OpenAPI document")
    return spec


def convert(node: Any, owner: str) -> Any:
    """One schema in OpenAPI's dialect, as JSON Schema 2020-12; owner names its component."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-") or key in DROPPED_KEYWORDS or key == "nullable":
            continue
        if key == "$ref":
            match = COMPONENT_REF.match(value)
            if match is None:
                raise SystemExit(f"{owner}: a $ref this script cannot follow: {value}")
            out["$ref"] = f"#/$defs/{match.group(1)}"
        elif key == "$recursiveRef":
            if value != "#":
                raise SystemExit(f"{owner}: a $recursiveRef this script cannot follow: {value}")
            out["$ref"] = f"#/$defs/{owner}"
        elif key in SCHEMA_KEYWORDS:
            out[key] = (
                [convert(item, owner) for item in value]
                if isinstance(value, list)
                else convert(value, owner)
            )
        elif key in SCHEMA_LIST_KEYWORDS:
            out[key] = [convert(item, owner) for item in value]
        elif key in SCHEMA_MAP_KEYWORDS:
            out[key] = {name: convert(item, owner) for name, item in value.items()}
        else:
            out[key] = value
    if node.get("nullable") is True:
        out = admit_null(out)
    return out


def admit_null(schema: dict[str, Any]) -> dict[str, Any]:
    if "type" not in schema:
        annotations: dict[str, Any] = {
            k: schema.pop(k) for k in ("description", "title", "default") if k in schema
        }
        return {**annotations, "anyOf": [schema, {"type": "null"}]}
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if "null" not in types:
        schema["type"] = [*types, "null"]
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    return schema


def refs(node: Any) -> Iterator[str]:
    """The $defs names a converted schema refers to."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value.removeprefix("#/$defs/")
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def bundle(spec: dict[str, Any], source: dict[str, str]) -> dict[str, Any]:
    components: dict[str, Any] = spec["components"]["schemas"]
    defs: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in defs:
            continue
        if name not in components:
            raise SystemExit(f"the spec has no component schema {name}")
        defs[name] = convert(components[name], name)
        todo.extend(refs(defs[name]))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "source": source,
        "roots": list(ROOTS),
        "$defs": dict(sorted(defs.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("spec", type=Path, help="openapi.yaml (or .json) of openai/openai-openapi")
    parser.add_argument("--commit", required=True, help="the commit SPEC was taken from")
    parser.add_argument("--date", required=True, help="that commit's date")
    parser.add_argument("--path", default="openapi.yaml", help="SPEC's path in the repository")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).with_name("responses.json"),
        help="where the bundle goes (default: responses.json beside this script)",
    )
    args = parser.parse_args(argv)
    spec = load_spec(args.spec)
    source = {
        "repository": REPOSITORY,
        "path": args.path,
        "commit": args.commit,
        "date": args.date,
        "openapi": str(spec.get("openapi")),
        "api_version": str(spec.get("info", {}).get("version")),
        "extracted_by": "tests/gateway/openai_schemas/extract.py",
    }
    result = bundle(spec, source)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    sys.stderr.write(f"{args.out}: {len(result['$defs'])} schemas\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
