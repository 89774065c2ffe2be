"""A Chat Completions stream as a Responses event stream, event by event as chunks arrive.

    response.created, response.in_progress                          start()
    response.output_item.added (message), content_part.added,
      output_text.delta ... (refusal.delta for a refusal)           text as it arrives
    response.output_item.added (function_call),
      function_call_arguments.delta ...                             each tool call (by its index)
    output_text.done, content_part.done, function_call_arguments.done,
      output_item.done (each item, in output order),
      response.completed | response.incomplete                      finish(): after the usage
                                                                    chunk, or at the end
    response.failed                                                 fail(): the upstream broke

Events are `event: <type>\\ndata: <json>\\n\\n` with `sequence_number` from 0, as the API
sends them. Items stay open until the end, so a chat stream that interleaves tool calls (or
sends text after them) still folds into well-formed items.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from proxy.protocols.responses.from_chat import (
    as_object,
    function_call_item,
    item_id,
    message_item,
    output_logprobs,
    response_object,
    status_of,
)
from proxy.protocols.responses.usage import responses_usage


def encode_event(event: dict[str, Any]) -> bytes:
    """One Responses stream event on the wire."""
    data: bytes = msgspec.json.encode(event)
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + data + b"\n\n"


@dataclass(slots=True)
class _Part:
    index: int  # content_index
    pieces: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat's, as they came


@dataclass(slots=True)
class _Message:
    id: str
    output_index: int
    text: _Part | None = None
    refusal: _Part | None = None
    next_part: int = 0


@dataclass(slots=True)
class _Call:
    id: str | None = None  # the chat tool call id (the item's call_id)
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    item: str = ""  # the item id, once added
    output_index: int = -1  # -1: not added yet (no name so far)


class ChatToResponsesStream:
    """Translates chat.completion.chunk payloads (decoded) into Responses events (bytes)."""

    def __init__(
        self,
        request: dict[str, Any],
        response_id: str,
        created_at: int,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.request, self.response_id, self.created_at = request, response_id, created_at
        self.clock = clock
        self.sequence = 0
        self.started = False
        self.ended = False
        self.status: str | None = None  # completed, incomplete or failed, once ended
        self.model: str | None = None
        self.service_tier: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None  # the chat usage, as it came
        self.response: dict[str, Any] = self._response("in_progress", [])
        self._message: _Message | None = None
        self._calls: dict[int, _Call] = {}
        self._order: list[_Message | _Call] = []  # by output_index

    # --- the public steps -----------------------------------------------------------------

    def start(self) -> bytes:
        """response.created and response.in_progress (once)."""
        if self.started:
            return b""
        self.started = True
        return self._emit("response.created", response=self.response) + self._emit(
            "response.in_progress", response=self.response
        )

    def feed(self, chunk: Any) -> bytes:
        """The events for one chat chunk (its payload, decoded)."""
        if self.ended or not isinstance(chunk, dict):
            return b""
        out = self.start()
        if isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            message = error.get("message") if isinstance(error.get("message"), str) else None
            return out + self.fail(message or "The upstream reported an error.")
        if isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        if isinstance(chunk.get("service_tier"), str):
            self.service_tier = chunk["service_tier"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                out += self._delta(delta, choice.get("logprobs"))
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            if self.finish_reason is not None:  # the usage chunk comes last
                out += self.finish()
        return out

    def finish(self) -> bytes:
        """Close every item, then response.completed (or .incomplete); once."""
        if self.ended:
            return b""
        out = self.start()
        out += b"".join(self._close(item) for item in self._order)
        status, reason = status_of(self.finish_reason)
        return out + self._end(status, reason=reason)

    def fail(self, message: str, code: str = "server_error") -> bytes:
        """response.failed with what arrived so far (its items incomplete); once."""
        if self.ended:
            return b""
        out = self.start()
        return out + self._end("failed", error={"code": code, "message": message})

    # --- deltas -----------------------------------------------------------------------------

    def _delta(self, delta: dict[str, Any], logprobs: Any) -> bytes:
        out = b""
        content = delta.get("content")
        if isinstance(content, str) and content:
            message, opened = self._open_message()
            if message.text is None:
                message.text = _Part(message.next_part)
                message.next_part += 1
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                opened += _part_event(
                    self._emit, "response.content_part.added", message, message.text, part
                )
            chat_logprobs = logprobs.get("content") if isinstance(logprobs, dict) else None
            chat_logprobs = [lp for lp in chat_logprobs or [] if isinstance(lp, dict)]
            message.text.pieces.append(content)
            message.text.logprobs.extend(chat_logprobs)
            out += opened + self._emit(
                "response.output_text.delta",
                item_id=message.id,
                output_index=message.output_index,
                content_index=message.text.index,
                delta=content,
                logprobs=[_delta_logprob(lp) for lp in chat_logprobs],
            )
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            message, opened = self._open_message()
            if message.refusal is None:
                message.refusal = _Part(message.next_part)
                message.next_part += 1
                part = {"type": "refusal", "refusal": ""}
                opened += _part_event(
                    self._emit, "response.content_part.added", message, message.refusal, part
                )
            message.refusal.pieces.append(refusal)
            out += opened + self._emit(
                "response.refusal.delta",
                item_id=message.id,
                output_index=message.output_index,
                content_index=message.refusal.index,
                delta=refusal,
            )
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict):
                out += self._call_delta(call)
        return out

    def _open_message(self) -> tuple[_Message, bytes]:
        if self._message is not None:
            return self._message, b""
        index = len(self._order)
        message = _Message(item_id("msg", self.response_id, index), index)
        self._message = message
        self._order.append(message)
        item = message_item(message.id, None, None, "in_progress", [])
        return message, self._emit("response.output_item.added", output_index=index, item=item)

    def _call_delta(self, delta: dict[str, Any]) -> bytes:
        index = delta.get("index", 0)
        if not isinstance(index, int):
            return b""
        call = self._calls.setdefault(index, _Call())
        if isinstance(delta.get("id"), str) and delta["id"]:
            call.id = call.id or delta["id"]
        function = as_object(delta.get("function"))
        if isinstance(function.get("name"), str):
            call.name += function["name"]
        piece = function.get("arguments")
        piece = piece if isinstance(piece, str) else ""
        out = b""
        if call.output_index < 0:
            if not call.name:  # (added once its name is known)
                call.arguments.append(piece)
                return b""
            out += self._add_call(call)
            piece = "".join(call.arguments) + piece
            call.arguments = [piece] if piece else []
        elif piece:
            call.arguments.append(piece)
        if piece:
            out += self._emit(
                "response.function_call_arguments.delta",
                item_id=call.item,
                output_index=call.output_index,
                delta=piece,
            )
        return out

    def _add_call(self, call: _Call) -> bytes:
        call.output_index = len(self._order)
        call.item = item_id("fc", self.response_id, call.output_index)
        self._order.append(call)
        item = _call_shape(call, "in_progress", arguments="")
        return self._emit("response.output_item.added", output_index=call.output_index, item=item)

    # --- the end ------------------------------------------------------------------------------

    def _close(self, item: _Message | _Call) -> bytes:
        if isinstance(item, _Message):
            return _close_message(self._emit, item)
        out = self._add_call(item) if item.output_index < 0 else b""  # (never named)
        out += self._emit(
            "response.function_call_arguments.done",
            item_id=item.item,
            name=item.name,
            output_index=item.output_index,
            arguments="".join(item.arguments),
        )
        done = _call_shape(item, "completed")
        return out + self._emit(
            "response.output_item.done", output_index=item.output_index, item=done
        )

    def _end(
        self, status: str, *, reason: str | None = None, error: dict[str, Any] | None = None
    ) -> bytes:
        self.ended = True
        self.status = status
        item_status = "completed" if status == "completed" else "incomplete"
        output = [
            _call_shape(item, item_status)
            if isinstance(item, _Call)
            else _message_shape(item, item_status)
            for item in self._order
            if not isinstance(item, _Call) or item.output_index >= 0
        ]
        self.response = self._response(status, output, reason=reason, error=error)
        return self._emit(f"response.{status}", response=self.response)

    # --- shapes -------------------------------------------------------------------------------

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return response_object(
            self.request,
            self.response_id,
            self.created_at,
            model=self.model,
            status=status,
            output=output,
            usage=responses_usage(self.usage) if status != "in_progress" else None,
            error=error,
            incomplete_reason=reason,
            completed_at=int(self.clock()),
            service_tier=self.service_tier,
        )

    def _emit(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return encode_event(event)


Emit = Callable[..., bytes]


def _part_event(emit: Emit, kind: str, message: _Message, part: _Part, shape: Any) -> bytes:
    return emit(
        kind,
        item_id=message.id,
        output_index=message.output_index,
        content_index=part.index,
        part=shape,
    )


def _close_message(emit: Emit, item: _Message) -> bytes:
    """The .done events of a message item's parts, then of the item."""
    out = b""
    if item.text is not None:
        text = "".join(item.text.pieces)
        out += emit(
            "response.output_text.done",
            item_id=item.id,
            output_index=item.output_index,
            content_index=item.text.index,
            text=text,
            logprobs=[_delta_logprob(lp) for lp in item.text.logprobs],
        )
        part = {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": output_logprobs({"content": item.text.logprobs}),
        }
        out += _part_event(emit, "response.content_part.done", item, item.text, part)
    if item.refusal is not None:
        refusal = "".join(item.refusal.pieces)
        out += emit(
            "response.refusal.done",
            item_id=item.id,
            output_index=item.output_index,
            content_index=item.refusal.index,
            refusal=refusal,
        )
        shape = {"type": "refusal", "refusal": refusal}
        out += _part_event(emit, "response.content_part.done", item, item.refusal, shape)
    done = _message_shape(item, "completed")
    return out + emit("response.output_item.done", output_index=item.output_index, item=done)


def _message_shape(message: _Message, status: str) -> dict[str, Any]:
    text = "".join(message.text.pieces) if message.text is not None else None
    refusal = "".join(message.refusal.pieces) if message.refusal is not None else None
    logprobs = output_logprobs({"content": message.text.logprobs}) if message.text else []
    item = message_item(message.id, text, refusal, status, logprobs)
    if message.refusal and message.text and message.refusal.index < message.text.index:
        item["content"].reverse()  # (parts in the order they were added)
    return item


def _call_shape(call: _Call, status: str, arguments: str | None = None) -> dict[str, Any]:
    chat_call = {
        "id": call.id,
        "function": {
            "name": call.name,
            "arguments": "".join(call.arguments) if arguments is None else arguments,
        },
    }
    return function_call_item(call.item, chat_call, status)


def _delta_logprob(lp: dict[str, Any]) -> dict[str, Any]:
    """A chat logprob as a delta event's (no bytes)."""
    return {
        "token": lp.get("token", ""),
        "logprob": lp.get("logprob", 0.0),
        "top_logprobs": [
            {"token": t.get("token", ""), "logprob": t.get("logprob", 0.0)}
            for t in lp.get("top_logprobs") or []
            if isinstance(t, dict)
        ],
    }
