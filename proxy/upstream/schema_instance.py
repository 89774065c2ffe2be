"""A small value that a JSON Schema accepts, for the echo upstream's tool arguments and
structured outputs: required properties only, the first of an enum, a `const` or `default`
when given, the fewest array items allowed, numbers within their bounds.

Not a full generator (a `pattern` or a `not` is not solved); it covers what tool and
response schemas use: types, enums, nested objects and arrays, `$ref` into `$defs`, and the
combinators `allOf`, `anyOf`, `oneOf`.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 32
_FORMATS = {
    "date": "2024-01-01",
    "date-time": "2024-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "hostname": "example.com",
}


def instance(schema: Any, *, text: str = "echo") -> Any:
    """A value valid against `schema` (strings default to `text`)."""
    return _Generator(schema, text).value(schema, 0)


class _Generator:
    def __init__(self, root: Any, text: str) -> None:
        self.root, self.text = root, text

    def value(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return None if schema is False else {}
        if "$ref" in schema:
            target = self._resolve(schema["$ref"])
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self.value({**target, **rest} if rest else target, depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][0]
        if "default" in schema:
            return schema["default"]
        if isinstance(schema.get("allOf"), list):
            merged = _merge([schema, *schema["allOf"]])
            return self.value(merged, depth + 1)
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                # The first option that is not only null: the most telling value.
                chosen = next(
                    (o for o in options if not (isinstance(o, dict) and o.get("type") == "null")),
                    options[0],
                )
                base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return self.value(_merge([base, chosen]), depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind is None:
            kind = _implied_type(schema)
        match kind:
            case "object":
                return self._object(schema, depth)
            case "array":
                return self._array(schema, depth)
            case "string":
                return self._string(schema)
            case "integer":
                return int(self._number(schema, integer=True))
            case "number":
                return self._number(schema, integer=False)
            case "boolean":
                return False
            case "null":
                return None
        return {}

    def _resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return {}
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return {}
            node = node[part]
        return node

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties") or {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        wanted = list(required)
        # minProperties: the declared properties after the required ones.
        extra = [p for p in properties if p not in wanted]
        wanted += extra[: max(0, int(schema.get("minProperties") or 0) - len(wanted))]
        return {name: self.value(properties.get(name, {}), depth + 1) for name in wanted}

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        count = max(int(schema.get("minItems") or 0), len(prefix))
        values = [self.value(p, depth + 1) for p in prefix]
        values += [self.value(items, depth + 1) for _ in range(count - len(values))]
        if schema.get("uniqueItems") and len(values) > 1:
            # Distinct strings or numbers where a single value would repeat.
            values = [_distinct(v, i) for i, v in enumerate(values)]
        return values

    def _string(self, schema: dict[str, Any]) -> str:
        text = _FORMATS.get(str(schema.get("format")), self.text)
        low, high = int(schema.get("minLength") or 0), schema.get("maxLength")
        if len(text) < low:
            text = text + "x" * (low - len(text))
        if isinstance(high, int) and len(text) > high:
            text = text[:high]
        return text

    def _number(self, schema: dict[str, Any], *, integer: bool) -> float:
        low = schema.get("minimum")
        high = schema.get("maximum")
        ex_low = schema.get("exclusiveMinimum")
        ex_high = schema.get("exclusiveMaximum")
        step = schema.get("multipleOf")
        value: float = 0
        if isinstance(low, int | float):
            value = low
        if isinstance(ex_low, int | float) and value <= ex_low:
            value = ex_low + (step or 1)
        if isinstance(high, int | float) and value > high:
            value = high
        if isinstance(ex_high, int | float) and value >= ex_high:
            value = ex_high - (step or 1)
        if isinstance(step, int | float) and step > 0:
            value = math.ceil(value / step) * step
        return math.ceil(value) if integer else value


def _implied_type(schema: dict[str, Any]) -> str | None:
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _merge(schemas: list[Any]) -> dict[str, Any]:
    """allOf's parts as one schema: properties and required lists joined, the rest of the
    later parts winning."""
    merged: dict[str, Any] = {}
    for part in schemas:
        if not isinstance(part, dict):
            continue
        for key, value in part.items():
            if key == "allOf":
                continue
            if key == "properties" and isinstance(value, dict):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged[key] = value
    return merged


def _distinct(value: Any, index: int) -> Any:
    if isinstance(value, str):
        return f"{value}{index}" if index else value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value + index
    return value
