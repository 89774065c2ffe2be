"""Check a Responses event stream the way a client meets it.

    events = check_stream(body_bytes)      # -> the decoded events, in order

Every event must: carry an `event:` line naming its type, number itself from 0 without gaps,
validate against the official spec (its own event schema), parse with the openai SDK's
`ResponseStreamEvent` union, and fold in the SDK's own stream accumulator (what
`client.responses.stream()` runs), which must end with the final response.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.openapi_check import SCHEMAS_FILE, assert_openai_shape

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@cache
def _event_schemas() -> dict[str, str]:
    """Event type -> the name of its schema in the spec."""
    schemas = json.loads(SCHEMAS_FILE.read_text())["components"]["schemas"]
    names = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        names[schemas[name]["properties"]["type"]["enum"][0]] = name
    return names


@cache
def _adapter() -> TypeAdapter[Any]:
    return TypeAdapter(ResponseStreamEvent)


def split_events(body: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    """(event line, data) of each SSE event in `body`."""
    out = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        out.append((name, json.loads("\n".join(data))))
    return out


def check_stream(body: bytes, *, complete: bool = True) -> list[dict[str, Any]]:
    """The events of `body`, each checked (see the module). `complete`: the stream must end
    with a terminal event carrying the response."""
    events = []
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for number, (name, event) in enumerate(split_events(body)):
        assert name == event["type"], f"event line {name!r} for a {event['type']} event"
        assert event["sequence_number"] == number, event
        assert_openai_shape(_event_schemas()[event["type"]], event)
        parsed = _adapter().validate_python(event)
        state.handle_event(parsed)
        events.append(event)
    if complete:
        assert events and events[-1]["type"] in TERMINAL, [e["type"] for e in events]
        final = Response.model_validate(events[-1]["response"])
        assert final.id == events[0]["response"]["id"]
    return events
