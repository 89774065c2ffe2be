"""Upstream requests spread over several connection pools.

httpcore's pool looks at every connection it holds on each request it places (whether an idle
one has expired, which polls its socket), so one pool holding hundreds of keep-alive
connections to an upstream spends more time looking than sending: profiled under load
(50 streaming clients), a sixth of the proxy's CPU went to that scan. `ShardedTransport`
hands requests round-robin to `SHARDS` pools of their own, each holding a share of the
connections, so each scan is that much shorter. (httpcore's own fix, encode/httpcore#928, is
not released.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import httpx

# Pools upstream requests are spread over (docs/performance: Load, measured against one).
SHARDS = 8


class ShardedTransport(httpx.AsyncBaseTransport):
    """Each request goes to the next of `transports`, in turn."""

    def __init__(self, transports: Sequence[httpx.AsyncBaseTransport]) -> None:
        if not transports:
            raise ValueError("at least one transport")
        self.transports = list(transports)
        self._next = itertools.cycle(self.transports)

    @classmethod
    def pools(cls, shards: int, limits: httpx.Limits) -> ShardedTransport:
        """`shards` connection pools sharing `limits` between them, and one TLS context
        (building one loads the CA bundle: about 50 ms each)."""
        keepalive = limits.max_keepalive_connections
        total = limits.max_connections
        share = httpx.Limits(
            max_connections=None if total is None else max(1, total // shards),
            max_keepalive_connections=None if keepalive is None else max(1, keepalive // shards),
            keepalive_expiry=limits.keepalive_expiry,
        )
        tls = httpx.create_ssl_context()
        return cls([httpx.AsyncHTTPTransport(limits=share, verify=tls) for _ in range(shards)])

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await next(self._next).handle_async_request(request)

    async def aclose(self) -> None:
        for transport in self.transports:
            await transport.aclose()
