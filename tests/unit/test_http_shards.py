"""Upstream requests spread over several connection pools (proxy/upstream/http_shards.py)."""

from __future__ import annotations

import sys

import httpx
import pytest

from proxy.state import new_http_client
from proxy.upstream.http_shards import ShardedTransport


def recording(name: str, seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(name)
        return httpx.Response(200, json={"from": name})

    return httpx.MockTransport(handle)


async def test_requests_go_to_each_pool_in_turn() -> None:
    seen: list[str] = []
    transport = ShardedTransport([recording(n, seen) for n in ("a", "b", "c")])
    async with httpx.AsyncClient(transport=transport, base_url="http://upstream") as client:
        answers = [(await client.get("/v1/models")).json()["from"] for _ in range(7)]
    assert answers == seen == ["a", "b", "c", "a", "b", "c", "a"]


async def test_closing_closes_every_pool() -> None:
    closed: list[int] = []

    class Pool(httpx.AsyncBaseTransport):
        def __init__(self, n: int) -> None:
            self.n = n

        async def aclose(self) -> None:
            closed.append(self.n)

    await ShardedTransport([Pool(1), Pool(2)]).aclose()
    assert closed == [1, 2]


def test_the_pools_share_the_limits() -> None:
    transport = ShardedTransport.pools(
        4, httpx.Limits(max_connections=None, max_keepalive_connections=256)
    )
    assert len(transport.transports) == 4
    pools = [t._pool for t in transport.transports if isinstance(t, httpx.AsyncHTTPTransport)]
    assert len({id(p) for p in pools}) == 4  # a pool each
    # No limit on connections (httpcore's sys.maxsize), a quarter of the keep-alive ones each.
    assert {(p._max_connections, p._max_keepalive_connections) for p in pools} == {
        (sys.maxsize, 64)
    }
    assert len({id(p._ssl_context) for p in pools}) == 1  # the CA bundle loaded once
    with pytest.raises(ValueError):
        ShardedTransport([])


async def test_the_proxy_client_spreads_its_upstream_connections() -> None:
    client = new_http_client()
    try:
        assert isinstance(client._transport, ShardedTransport)
        assert len(client._transport.transports) > 1
    finally:
        await client.aclose()
