"""Validate JSON bodies against OpenAI's own response schemas (tests/data/openai-schemas.json).

    from tests.openapi_check import assert_openai_shape
    assert_openai_shape("CreateChatCompletionResponse", response.json())

The schemas come from the official OpenAPI document (regenerate them with
tests/data/extract_openai_schemas.py). That document says `openapi: 3.1.0` and mostly writes
nullability the 3.1 way (`anyOf: [..., {type: null}]`), but some schemas still use 3.0's
`nullable: true` (e.g. a stream chunk's `finish_reason`, `logprobs` and `usage`), which JSON
Schema ignores. Those are rewritten to `anyOf: [<schema>, {type: null}]` before validating with
Draft 2020-12. Its `oneOf`s overlap (an easy input message is also a typed one, a function
tool's parameters match several shapes), so a valid body can match two branches: every `oneOf`
is read as `anyOf`. OpenAPI-only keywords (`discriminator`, `x-*`) are annotations and are ignored;
`format` is not checked (the spec uses non-standard formats such as `unixtime`).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

SCHEMAS_FILE = Path(__file__).parent / "data" / "openai-schemas.json"


def _to_json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [_to_json_schema(value) for value in node]
    if not isinstance(node, dict):
        return node
    converted = {
        "anyOf" if key == "oneOf" else key: _to_json_schema(value)
        for key, value in node.items()
        if key != "nullable"
    }
    if node.get("nullable") is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


@cache
def _document() -> dict[str, Any]:
    raw = json.loads(SCHEMAS_FILE.read_text())
    # Only schema objects are rewritten: `components.schemas` maps names to schemas.
    schemas = {
        name: _to_json_schema(schema) for name, schema in raw["components"]["schemas"].items()
    }
    return {"components": {"schemas": schemas}}


@cache
def _validator(name: str) -> Draft202012Validator:
    document = _document()
    if name not in document["components"]["schemas"]:
        known = ", ".join(sorted(document["components"]["schemas"]))
        raise KeyError(f"no OpenAI schema named {name!r} (known: {known})")
    # `$ref`s in the spec point into `#/components/schemas/`, so the document is the root.
    schema = {**document, "$ref": f"#/components/schemas/{name}"}
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def openai_shape_errors(schema_name: str, instance: Any) -> list[str]:
    """Every way `instance` differs from OpenAI's schema `schema_name` (empty when it conforms)."""
    errors = sorted(_validator(schema_name).iter_errors(instance), key=lambda e: list(e.path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def assert_openai_shape(schema_name: str, instance: Any) -> None:
    """Fail with a readable list of differences unless `instance` conforms to `schema_name`."""
    errors = openai_shape_errors(schema_name, instance)
    assert not errors, f"not a valid {schema_name}:\n  " + "\n  ".join(errors)
