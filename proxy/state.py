"""What the running app owns: built in the lifespan, closed on exit, reached through DI."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from proxy.auth import KeyRing, Principal
from proxy.config import Config, UpstreamConfig
from proxy.upstream.base import Upstream
from proxy.upstream.echo import EchoUpstream
from proxy.upstream.litellm import LiteLLMUpstream
from proxy.upstream.openai import OpenAIUpstream


@dataclass
class AppState:
    config: Config
    keys: KeyRing
    http: httpx.AsyncClient
    upstreams: dict[str, Upstream] = field(default_factory=dict)

    def upstream_for(self, principal: Principal) -> Upstream:
        return self.upstreams[principal.tenant.upstream]


def build_upstream(name: str, config: UpstreamConfig, http: httpx.AsyncClient) -> Upstream:
    if config.kind == "openai":
        return OpenAIUpstream(name, config, http)
    if config.kind == "litellm":
        return LiteLLMUpstream(name, config)
    return EchoUpstream(name, config)


def new_http_client() -> httpx.AsyncClient:
    """One pooled keep-alive client for every upstream; per-upstream timeouts go per request."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        timeout=httpx.Timeout(600.0, connect=5.0),
        follow_redirects=False,
    )
