"""Extract the OpenAI response schemas the tests validate against from the official spec.

    python tests/data/extract_openai_schemas.py [SPEC] [OUT]
    python tests/data/extract_openai_schemas.py --reference [SPEC]

SPEC defaults to ../shared/reference/openai-openapi.json (next to the repository), OUT to
tests/data/openai-schemas.json. The output holds the named component schemas and every schema
they reach through `$ref`, unchanged except that documentation-only keys are dropped; it is
committed so that the tests do not depend on the spec being present.

`--reference` writes the schemas that memproxy's own API reference (`/docs`) points to for the
OpenAI shapes, descriptions kept, to proxy/routes/openai-schemas.json (package data).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ErrorResponse",
    "ListModelsResponse",
    "CreateResponse",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
    "TokenCountsResource",
)
REFERENCE_ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ListModelsResponse",
    "CreateResponse",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
    "TokenCountsBody",
    "TokenCountsResource",
    "CompactResponseMethodPublicBody",
    "CompactResource",
)
# Keys that only document a schema; none of them changes what validates.
_DOC_KEYS = frozenset({"description", "example", "examples", "x-oaiMeta", "x-oaiTypeLabel"})
# What the API reference leaves out: OpenAI's own site's extras.
_SITE_KEYS = frozenset({"x-oaiMeta", "x-oaiTypeLabel"})
_PREFIX = "#/components/schemas/"

HERE = Path(__file__).resolve().parent
DEFAULT_SPEC = HERE.parents[2] / "shared" / "reference" / "openai-openapi.json"
DEFAULT_OUT = HERE / "openai-schemas.json"
REFERENCE_OUT = HERE.parents[1] / "proxy" / "routes" / "openai-schemas.json"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _strip_docs(node: Any, *, in_properties: bool = False, keys: frozenset[str] = _DOC_KEYS) -> Any:
    # Inside `properties` the keys are field names (a field may be called "description").
    if isinstance(node, dict):
        return {
            key: _strip_docs(
                value, in_properties=key == "properties" and not in_properties, keys=keys
            )
            for key, value in node.items()
            if in_properties or key not in keys
        }
    if isinstance(node, list):
        return [_strip_docs(value, keys=keys) for value in node]
    return node


def extract(
    spec: dict[str, Any], roots: tuple[str, ...] = ROOTS, *, drop: frozenset[str] = _DOC_KEYS
) -> dict[str, Any]:
    """The closure of `roots` under `$ref`, as `{"components": {"schemas": {...}}}`."""
    available = spec["components"]["schemas"]
    wanted: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted[name] = available[name]
        for ref in _refs(available[name]):
            if not ref.startswith(_PREFIX):
                raise ValueError(f"{name}: unsupported $ref {ref!r}")
            todo.append(ref[len(_PREFIX) :])
    return {
        "source": "OpenAI OpenAPI spec, components.schemas",
        "openapi": spec.get("openapi"),
        "spec_version": spec.get("info", {}).get("version"),
        "roots": list(roots),
        "components": {"schemas": {n: _strip_docs(wanted[n], keys=drop) for n in sorted(wanted)}},
    }


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--reference"]:
        spec_path = Path(argv[2]) if len(argv) > 2 else DEFAULT_SPEC
        spec = json.loads(spec_path.read_text())
        document = extract(spec, REFERENCE_ROOTS, drop=_SITE_KEYS)
        REFERENCE_OUT.write_text(json.dumps(document, separators=(",", ":")) + "\n")
        count = len(document["components"]["schemas"])
        sys.stderr.write(f"wrote {count} schemas to {REFERENCE_OUT}\n")
        return
    spec_path = Path(argv[1]) if len(argv) > 1 else DEFAULT_SPEC
    out_path = Path(argv[2]) if len(argv) > 2 else DEFAULT_OUT
    document = extract(json.loads(spec_path.read_text()))
    out_path.write_text(json.dumps(document, indent=1) + "\n")
    count = len(document["components"]["schemas"])
    sys.stderr.write(f"wrote {count} schemas to {out_path}\n")


if __name__ == "__main__":
    main(sys.argv)
