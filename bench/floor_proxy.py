"""The floor: the least any Python proxy adds, a bare Litestar + httpx pass-through.

One shared keep-alive httpx client forwards the raw bytes of POST /v1/chat/completions (and of
POST /v1/responses and POST /v1/messages, the same way) to the upstream and relays the reply, a stream chunk by
chunk. No auth, no parsing, no logging: what memproxy adds beyond this is its own cost.

    python bench/floor_proxy.py --upstream http://127.0.0.1:9000/v1 --port 9001
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

_JSON = {"content-type": "application/json"}


def create_app(upstream: str) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        # The same pool as memproxy's: enough idle connections for every concurrent client.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=upstream, limits=limits, timeout=600) as client:
            app.state.client = client
            yield

    async def forward(request: Request[Any, Any, Any], path: str) -> Response[Any]:
        client: httpx.AsyncClient = request.app.state.client
        body = await request.body()
        sent = client.build_request("POST", path, content=body, headers=_JSON)
        reply = await client.send(sent, stream=True)
        media_type = reply.headers.get("content-type", "application/json")
        if not media_type.startswith("text/event-stream"):
            return Response(
                await reply.aread(), status_code=reply.status_code, media_type=media_type
            )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_bytes():
                    yield chunk
            finally:
                await reply.aclose()

        return Stream(relay(), status_code=reply.status_code, media_type=media_type)

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        return await forward(request, "/chat/completions")

    @post("/v1/responses", status_code=200)
    async def responses(request: Request[Any, Any, Any]) -> Response[Any]:
        return await forward(request, "/responses")

    @post("/v1/messages", status_code=200)
    async def messages(request: Request[Any, Any, Any]) -> Response[Any]:
        return await forward(request, "/messages")

    # No logging config: Litestar's default would log httpx's line for every request.
    return Litestar([chat, responses, messages], lifespan=[lifespan], logging_config=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True, help="base URL ending in /v1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        create_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
