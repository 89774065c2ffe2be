"""A strict fake of OpenAI's Responses API (and, inherited, its chat completions), for tests.

Strict like the real API, so that tests notice what the proxy sends wrong:

- every `POST /v1/responses` body is validated against the official `CreateResponse` schema
  (tests/data/openai-schemas.json, `oneOf` read as `anyOf`): 400 in OpenAI's error shape;
- `previous_response_id` must name a stored response (400 `previous_response_not_found`);
  the model then sees that chain's input and output items before the new input, and
  `instructions` are not carried over;
- a `function_call_output` must answer a `function_call` of the context (400 otherwise), and
  an `item_reference` must name an item it knows;
- a response created with `store: false` is not kept: retrieving it or chaining onto it fails;
- a `conversation` must name one made by `POST /v1/conversations`: the model sees its items
  before the new input, and the input and output items are added to it (400 otherwise).

It serves `GET` and `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`,
whole and streamed replies (the event sequence the SDKs consume), and function calls: when
`tool_choice` names a function or is `required`, or the last input is a user message naming
a function tool. A request with `reasoning` (a reasoning model's) gets a `reasoning` item
first, with `encrypted_content` when `include` asks for it. The reply text is deterministic and says what arrived (item counts, the last
user text), so a test sees whether memory context reached the model. `requests` records
everything; `script` (inherited) overrides the next replies, e.g. with a stream that dies.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from tests.fakes.openai_upstream import FakeOpenAI, Recorded, Reply
from tests.openapi_check import openai_shape_errors

_ITEM_PATH = re.compile(r"/responses/([^/]+)(/input_items)?")


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> Reply:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return Reply(status=status, body={"error": error})


class Invalid(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.reply = _error(400, message, param, code)


@dataclass
class Stored:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # as listed by /input_items (with ids)
    context: list[dict[str, Any]]  # what the model saw: the chain's items and this input


def event(kind: str, sequence: int, **fields: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()


class FakeResponses(FakeOpenAI):
    """The ASGI app: FakeOpenAI plus the Responses API, with state like OpenAI's."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.stored: dict[str, Stored] = {}
        self.conversations: dict[str, list[dict[str, Any]]] = {}  # id -> its items
        self._ids = itertools.count(1)

    @property
    def responses_requests(self) -> list[dict[str, Any]]:
        """The bodies of every `POST /v1/responses`, in order."""
        return [
            r.json()
            for r in self.requests
            if r.method == "POST" and r.path.removeprefix("/v1") == "/responses"
        ]

    def _default(self, request: Recorded) -> Reply:
        path = request.path.removeprefix("/v1")
        if path == "/responses" and request.method == "POST":
            try:
                return self._create(request)
            except Invalid as exc:
                return exc.reply
        if path == "/conversations" and request.method == "POST":
            conversation = f"conv_fake{next(self._ids):04d}"
            self.conversations[conversation] = []
            return Reply(
                body={
                    "id": conversation,
                    "object": "conversation",
                    "created_at": 1_700_000_000,
                    "metadata": {},
                }
            )
        if match := _ITEM_PATH.fullmatch(path):
            return self._by_id(request.method, match.group(1), bool(match.group(2)), request)
        return super()._default(request)

    # --- GET / DELETE ---------------------------------------------------------------------------

    def _by_id(self, method: str, response_id: str, items: bool, request: Recorded) -> Reply:
        stored = self.stored.get(response_id)
        if stored is None or method not in ("GET", "DELETE") or (items and method != "GET"):
            return _error(404, f"Response with id '{response_id}' not found.")
        if method == "DELETE":
            del self.stored[response_id]
            return Reply(body={"id": response_id, "object": "response.deleted", "deleted": True})
        if not items:
            return Reply(body=stored.response)
        query = dict(p.split("=", 1) for p in request.query.split("&") if "=" in p)
        data = list(stored.input_items)
        if query.get("order", "desc") == "desc":
            data.reverse()
        data = data[: int(query.get("limit", 20))]
        return Reply(
            body={
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else "",
                "last_id": data[-1]["id"] if data else "",
                "has_more": False,
            }
        )

    # --- POST -----------------------------------------------------------------------------------

    def _create(self, request: Recorded) -> Reply:
        try:
            body = request.json()
        except ValueError:
            raise Invalid("We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise Invalid("The body of your request must be a JSON object.")
        errors = openai_shape_errors("CreateResponse", body)
        if errors:
            param = errors[0].split(":", 1)[0].replace("/", ".")
            raise Invalid(
                f"Invalid request body: {errors[0]}", None if param == "<root>" else param
            )
        if not body.get("model"):
            raise Invalid(
                "Missing required parameter: 'model'.", "model", "missing_required_parameter"
            )
        if body.get("previous_response_id") and body.get("conversation"):
            raise Invalid(
                "Mutually exclusive parameters: 'previous_response_id' and 'conversation'.",
                "previous_response_id",
            )
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous:
            if previous not in self.stored:
                raise Invalid(
                    f"Previous response with id '{previous}' not found.",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            chain = self.stored[previous]
            history = chain.context + chain.response["output"]
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if conversation is not None:
            if conversation not in self.conversations:
                raise Invalid(f"Conversation with id '{conversation}' not found.", "conversation")
            history = list(self.conversations[conversation])
        number = next(self._ids)
        response_id = f"resp_fake{number:04d}"
        new_input = self._normalize(body.get("input"), number, history)
        context = history + new_input
        _check_tool_outputs(context)
        output = self._answer(body, context, len(history), number)
        response = response_object(body, response_id, output, usage_of(context, output))
        if body.get("store") is not False:
            self.stored[response_id] = Stored(response, new_input, context)
        if conversation is not None:
            self.conversations[conversation] += new_input + output
        if not body.get("stream"):
            return Reply(body=response)
        return Reply(chunks=stream_events(response))

    def _normalize(
        self, raw: Any, number: int, history: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Input items as the API lists them: typed, with ids; references resolved."""
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
        known = {
            item["id"]: item
            for stored in self.stored.values()
            for item in stored.context + stored.response["output"]
            if "id" in item
        } | {item["id"]: item for item in history if "id" in item}
        out = []
        for i, item in enumerate(items):
            kind = item.get("type") or ("message" if "role" in item else "item_reference")
            if kind == "item_reference":
                if item["id"] not in known:
                    raise Invalid(f"Item with id '{item['id']}' not found.", f"input[{i}]")
                out.append(known[item["id"]])
                continue
            item = {**item, "type": kind, "id": item.get("id") or f"{kind[:3]}_in{number}_{i}"}
            if kind == "message":
                assistant = item["role"] == "assistant"
                content = item["content"]
                if isinstance(content, str):
                    text_type = "output_text" if assistant else "input_text"
                    content = [{"type": text_type, "text": content}]
                if assistant:
                    content = [{"annotations": [], "logprobs": [], **p} for p in content]
                item["content"] = content
            if kind in ("message", "function_call", "function_call_output"):
                item.setdefault("status", "completed")
            out.append(item)
        return out

    def _answer(
        self, body: dict[str, Any], context: list[dict[str, Any]], prior: int, number: int
    ) -> list[dict[str, Any]]:
        tools = [t["name"] for t in body.get("tools") or [] if t.get("type") == "function"]
        last = context[-1] if context else {}
        user = next((_text(i) for i in reversed(context) if i.get("role") == "user"), "")
        called = _called_tool(body.get("tool_choice"), tools, last)
        thought = _reasoning(body, number)
        if called is not None:
            return [
                *thought,
                {
                    "id": f"fc_fake{number:04d}",
                    "type": "function_call",
                    "status": "completed",
                    "call_id": f"call_fake{number:04d}",
                    "name": called,
                    "arguments": json.dumps({"query": user}),
                },
            ]
        system = sum(i.get("role") in ("system", "developer") for i in context)
        seen = (
            f"({len(context)} input items, {prior} from previous responses, {system} "
            f"system/developer messages, instructions: {'yes' if body.get('instructions') else 'no'})"
        )
        if last.get("type") == "function_call_output":
            text = f'fake response to the output of {last.get("call_id")}: "{_text(last)}" {seen}'
        else:
            text = f'fake response to: "{user}" {seen}'
        fmt = ((body.get("text") or {}).get("format") or {}).get("type")
        if fmt in ("json_object", "json_schema"):
            text = json.dumps({"answer": text})
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return [
            *thought,
            {
                "id": f"msg_fake{number:04d}",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            },
        ]


def _reasoning(body: dict[str, Any], number: int) -> list[dict[str, Any]]:
    """A reasoning model's reasoning item, for a request that sets `reasoning`."""
    if not body.get("reasoning"):
        return []
    item: dict[str, Any] = {"id": f"rs_fake{number:04d}", "type": "reasoning", "summary": []}
    if "reasoning.encrypted_content" in (body.get("include") or []):
        item["encrypted_content"] = f"encrypted-thoughts-{number}"
    return [item]


def _text(item: dict[str, Any]) -> str:
    content = item.get("content", item.get("output"))
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def _called_tool(choice: Any, tools: list[str], last: dict[str, Any]) -> str | None:
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict) and choice.get("type") == "function":
        return str(choice["name"])
    if choice == "required":
        return tools[0]
    if last.get("role") == "user":
        text = _text(last).lower()
        return next((name for name in tools if name.lower() in text), None)
    return None


def _check_tool_outputs(context: list[dict[str, Any]]) -> None:
    calls: set[str] = set()
    for item in context:
        if item.get("type") == "function_call":
            calls.add(item["call_id"])
        elif item.get("type") == "function_call_output" and item["call_id"] not in calls:
            raise Invalid(
                f"No tool call found for function call output with call_id {item['call_id']}.",
                "input",
            )


def usage_of(context: list[dict[str, Any]], output: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(len(_text(i).split()) + 3 for i in context)
    completion = sum(len((_text(i) or i.get("arguments", "")).split()) for i in output)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(
    body: dict[str, Any], response_id: str, output: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    text = body.get("text") or {}
    response = {
        "id": response_id,
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "completed_at": 1_700_000_001,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.get("metadata") or {},
    }
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None:
            response[key] = body[key]
    return response


def stream_events(response: dict[str, Any]) -> list[bytes]:
    """The event sequence of `response`, as the API streams it."""
    sequence = itertools.count()
    start = {**response, "status": "in_progress", "output": [], "completed_at": None}
    start.pop("usage")
    chunks = [
        event("response.created", next(sequence), response=start),
        event("response.in_progress", next(sequence), response=start),
    ]
    for index, item in enumerate(response["output"]):
        where = {"output_index": index}
        if item["type"] == "reasoning":
            chunks.append(event("response.output_item.added", next(sequence), item=item, **where))
        elif item["type"] == "function_call":
            added = {**item, "status": "in_progress", "arguments": ""}
            chunks.append(event("response.output_item.added", next(sequence), item=added, **where))
            arguments = item["arguments"]
            for piece in (arguments[: len(arguments) // 2], arguments[len(arguments) // 2 :]):
                chunks.append(
                    event(
                        "response.function_call_arguments.delta",
                        next(sequence),
                        item_id=item["id"],
                        delta=piece,
                        **where,
                    )
                )
            chunks.append(
                event(
                    "response.function_call_arguments.done",
                    next(sequence),
                    item_id=item["id"],
                    name=item["name"],
                    arguments=arguments,
                    **where,
                )
            )
        else:
            added = {**item, "status": "in_progress", "content": []}
            chunks.append(event("response.output_item.added", next(sequence), item=added, **where))
            part = item["content"][0]
            where = {**where, "item_id": item["id"], "content_index": 0}
            empty = {**part, "text": ""}
            chunks.append(event("response.content_part.added", next(sequence), part=empty, **where))
            words = part["text"].split(" ")
            for i, word in enumerate(words):
                delta = word if i == len(words) - 1 else word + " "
                chunks.append(
                    event(
                        "response.output_text.delta",
                        next(sequence),
                        delta=delta,
                        logprobs=[],
                        **where,
                    )
                )
            chunks.append(
                event(
                    "response.output_text.done",
                    next(sequence),
                    text=part["text"],
                    logprobs=[],
                    **where,
                )
            )
            chunks.append(event("response.content_part.done", next(sequence), part=part, **where))
        chunks.append(
            event("response.output_item.done", next(sequence), item=item, output_index=index)
        )
    chunks.append(event("response.completed", next(sequence), response=response))
    return chunks
