"""The benchmark's upstream: the tests' fake OpenAI API, served by uvicorn in its own process.

Streams wait `--chunk-delay` between chunks, so time to first token and "the first chunk
arrives before the upstream has finished" mean something. A request for `TAIL_MODEL` streams
one content chunk, waits `--tail` seconds and only then ends; its last chunk carries
`upstream_end_ns`, the upstream's `time.monotonic_ns()` at that moment (one clock for every
process on the machine), so a client can tell whether the first chunk reached it earlier.

`POST /v1/responses` is answered like a chat completion: the same text ("fake reply to: " and
the last user message), whole or streamed, a `response` object and event sequence as OpenAI's
(those of the strict fake, tests/fakes/openai_responses.py, without its request validation and
its stored responses, which would cost time and memory over thousands of requests). A stream
is sent in as many chunks as the chat one, with the same delays: the events before the first
text delta together (as the role chunk), one chunk per word, the `.done` events together (as
the stop chunk), then `response.completed` with its usage at once (as the usage chunk and
`[DONE]`). So a Responses stream's time to first token and length match the chat one's.

`POST /v1/messages` (Anthropic's Messages API) is answered the same way: the same text, as a
`message` or its event sequence, sent in as many chunks with the same delays (`message_start`,
`content_block_start` and `ping` together, one `text_delta` per word, `content_block_stop`
and `message_delta` together, then `message_stop`).

    python bench/fake_upstream.py --port 9000 --chunk-delay 0.002 --tail 0.3 [--latency 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvicorn

from tests.fakes.anthropic_upstream import sse as anthropic_sse
from tests.fakes.openai_responses import response_object, stream_events
from tests.fakes.openai_upstream import FakeOpenAI, Receive, Recorded, Reply, Send, sse

TAIL_MODEL = "bench-slow-tail"
_TAIL_MARK = "x-bench-tail"


class BenchUpstream(FakeOpenAI):
    def __init__(self, *, chunk_delay: float, tail: float, latency: float = 0.0) -> None:
        super().__init__(chunk_delay=chunk_delay, latency=latency)
        self.tail = tail

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        self.requests.clear()  # a run sends thousands of requests; keep memory flat

    def _default(self, request: Recorded) -> Reply:
        responses = request.method == "POST" and request.path == "/v1/responses"
        messages = request.method == "POST" and request.path == "/v1/messages"
        if TAIL_MODEL.encode() in request.body:
            kind = "responses" if responses else "messages" if messages else "chat"
            return Reply(headers={_TAIL_MARK: kind}, chunks=[])
        if responses:
            return responses_reply(request.json())
        if messages:
            return messages_reply(request.json())
        return super()._default(request)

    async def _send(self, reply: Reply, receive: Receive, send: Send) -> None:
        if _TAIL_MARK not in reply.headers:
            await super()._send(reply, receive, send)
            return
        if reply.headers[_TAIL_MARK] == "responses":
            await self._send_responses_tail(send)
            return
        if reply.headers[_TAIL_MARK] == "messages":
            await self._send_messages_tail(send)
            return
        head = {"id": "chatcmpl-tail", "object": "chat.completion.chunk", "model": TAIL_MODEL}
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        first = {"index": 0, "delta": {"role": "assistant", "content": "first"}}
        chunk = sse({**head, "choices": [first]})
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(self.tail)
        ended = time.monotonic_ns()
        # (also in the text: a stream memproxy translates to another protocol keeps only that)
        last = {
            "index": 0,
            "delta": {"content": f" upstream_end_ns={ended}"},
            "finish_reason": "stop",
        }
        end = sse({**head, "choices": [last], "upstream_end_ns": ended})
        await send({"type": "http.response.body", "body": end + b"data: [DONE]\n\n"})

    async def _send_responses_tail(self, send: Send) -> None:
        """The tail stream as Responses events: up to the first text delta, `--tail` s, the
        rest; `response.completed` carries `upstream_end_ns`."""
        number = _next_id()
        output = _message("first", number)
        events = stream_events(
            response_object({"model": TAIL_MODEL}, f"resp_{number}", output, _usage(1, "first"))
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        first = b"".join(events[:5])  # created, in_progress, item and part added, the delta
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await asyncio.sleep(self.tail)
        completed = events[-1].split(b"\ndata: ", 1)
        payload = json.loads(completed[1])
        payload["upstream_end_ns"] = time.monotonic_ns()
        end = completed[0] + b"\ndata: " + json.dumps(payload).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": b"".join(events[5:-1]) + end})

    async def _send_messages_tail(self, send: Send) -> None:
        """The tail stream as Messages events: up to the first text delta, `--tail` s, the
        rest; `message_delta` carries `upstream_end_ns`."""
        events = messages_events({"model": TAIL_MODEL}, "first", 1)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        first = b"".join(events[:4])  # message_start, content_block_start, ping, the delta
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await asyncio.sleep(self.tail)
        stop, delta, end = events[4:]
        name, data = delta.split(b"\ndata: ", 1)
        payload = json.loads(data)
        payload["upstream_end_ns"] = time.monotonic_ns()
        delta = name + b"\ndata: " + json.dumps(payload).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": stop + delta + end})


# Every response and output item has an id of its own, as OpenAI's: memproxy keeps responses by id.
_IDS = itertools.count(1)
_RUN = secrets.token_hex(4)  # so two runs' ids differ too


def _next_id() -> str:
    return f"{_RUN}{next(_IDS):010d}"


def _message(text: str, number: str) -> list[dict[str, Any]]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return [
        {
            "id": f"msg_{number}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
    ]


def _usage(prompt: int, text: str) -> dict[str, Any]:
    completion = len(text.split())
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _last_user_text(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    for item in reversed(raw or []):
        if item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            return " ".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
    return ""


def responses_reply(body: dict[str, Any]) -> Reply:
    """What the chat fake would say to `body`, as a Responses `response` or event stream."""
    text = f"fake reply to: {_last_user_text(body.get('input'))}"
    prompt = sum(len(str(i).split()) for i in [body.get("instructions"), body.get("input")] if i)
    number = _next_id()
    response = response_object(body, f"resp_{number}", _message(text, number), _usage(prompt, text))
    if not body.get("stream"):
        return Reply(body=response)
    events = stream_events(response)
    words = len(text.split(" "))
    return Reply(
        chunks=[
            b"".join(events[:4]),  # created, in_progress, output_item.added, content_part.added
            *events[4 : 4 + words],  # one output_text.delta per word
            b"".join(events[4 + words : -1]),  # output_text, content_part, output_item .done
            events[-1],  # response.completed, with the usage
        ]
    )


def _messages_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return " ".join(b.get("text", "") for b in content or [] if b.get("type") == "text")
    return ""


def messages_events(body: dict[str, Any], text: str, prompt: int) -> list[bytes]:
    """A Messages API event stream for a reply of `text`, one event per element."""
    usage = {
        "input_tokens": prompt,
        "output_tokens": len(text.split()),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    start = {
        "id": f"msg_{_next_id()}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1},
    }
    words = text.split(" ")
    deltas = [
        {"type": "text_delta", "text": word if i == len(words) - 1 else word + " "}
        for i, word in enumerate(words)
    ]
    stop = {"stop_reason": "end_turn", "stop_sequence": None}
    return [
        anthropic_sse("message_start", {"type": "message_start", "message": start}),
        anthropic_sse(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        anthropic_sse("ping", {"type": "ping"}),
        *(
            anthropic_sse(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": d}
            )
            for d in deltas
        ),
        anthropic_sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        anthropic_sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": stop,
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        ),
        anthropic_sse("message_stop", {"type": "message_stop"}),
    ]


def messages_reply(body: dict[str, Any]) -> Reply:
    """What the chat fake would say to `body`, as a Messages `message` or event stream."""
    text = f"fake reply to: {_messages_text(body)}"
    prompt = len(str(body.get("system") or "").split()) + len(str(body.get("messages")).split())
    if not body.get("stream"):
        message = {
            "id": f"msg_{_next_id()}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt,
                "output_tokens": len(text.split()),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return Reply(body=message)
    events = messages_events(body, text, prompt)
    words = len(text.split(" "))
    return Reply(
        chunks=[
            b"".join(events[:3]),  # message_start, content_block_start, ping
            *events[3 : 3 + words],  # one text_delta per word
            b"".join(events[3 + words : -1]),  # content_block_stop, message_delta
            events[-1],  # message_stop
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-delay", type=float, default=0.002)
    parser.add_argument("--tail", type=float, default=0.3)
    parser.add_argument("--latency", type=float, default=0.0, help="before each response head")
    args = parser.parse_args()
    uvicorn.run(
        BenchUpstream(chunk_delay=args.chunk_delay, tail=args.tail, latency=args.latency),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
