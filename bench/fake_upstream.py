"""The benchmark's upstream: the tests' fake OpenAI API, served by uvicorn in its own process.

Streams wait `--chunk-delay` between chunks, so time to first token and "the first chunk
arrives before the upstream has finished" mean something. A request for `TAIL_MODEL` streams
one content chunk, waits `--tail` seconds and only then ends; its last chunk carries
`upstream_end_ns`, the upstream's `time.monotonic_ns()` at that moment (one clock for every
process on the machine), so a client can tell whether the first chunk reached it earlier.

    python bench/fake_upstream.py --port 9000 --chunk-delay 0.002 --tail 0.3 [--latency 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvicorn

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
        if TAIL_MODEL.encode() in request.body:
            return Reply(headers={_TAIL_MARK: "1"}, chunks=[])
        return super()._default(request)

    async def _send(self, reply: Reply, receive: Receive, send: Send) -> None:
        if _TAIL_MARK not in reply.headers:
            await super()._send(reply, receive, send)
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
        last = {"index": 0, "delta": {}, "finish_reason": "stop"}
        end = sse({**head, "choices": [last], "upstream_end_ns": time.monotonic_ns()})
        await send({"type": "http.response.body", "body": end + b"data: [DONE]\n\n"})


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
