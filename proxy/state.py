"""What the running app owns: built in the lifespan, closed on exit, reached through DI."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from policies.public_ids import PublicIds
from proxy.accounting.catalog import ModelCatalog
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.costs import Pricer
from proxy.accounting.limits import LimitKeeper
from proxy.accounting.metrics import Metrics
from proxy.background.embeddings import Embeddings
from proxy.background.extraction import MemoryExtractor
from proxy.background.jobs import JobRunner
from proxy.background.vector_index import VectorIndex
from proxy.core.auth import KeyRing, Principal
from proxy.core.config import Config, ResponsesMode, UpstreamConfig
from proxy.core.shutdown import ShutdownDeadline
from proxy.durability.spill import SpillFile
from proxy.pipeline.artifacts import Artifacts
from proxy.pipeline.exchange_batch import DeferredExchanges
from proxy.pipeline.intent import IntentClassifiers
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.replay import SpillReplayer
from proxy.pipeline.shown import ShownContexts
from proxy.pipeline.turn import HEAVY_TURNS_AT_ONCE
from proxy.upstream.anthropic import AnthropicUpstream
from proxy.upstream.base import Upstream
from proxy.upstream.echo import EchoUpstream
from proxy.upstream.http_shards import SHARDS, ShardedTransport
from proxy.upstream.litellm import LiteLLMUpstream
from proxy.upstream.openai import OpenAIUpstream
from proxy.upstream.resilient import ResilientUpstream
from storage.database import Database
from storage.fair_slots import FairSlots

EXPORTS_AT_ONCE = 2


@dataclass
class AppState:
    config: Config
    keys: KeyRing
    http: httpx.AsyncClient
    db: Database
    memory: ConversationMemory
    deferred: DeferredExchanges
    catalog: ModelCatalog
    pricer: Pricer
    metrics: Metrics
    limits: LimitKeeper
    charges: MemoryCharges
    intents: IntentClassifiers
    jobs: JobRunner
    artifacts: Artifacts
    extractor: MemoryExtractor
    embeddings: Embeddings
    spill: SpillFile
    ids: PublicIds  # the public ids of messages and jobs
    # Writes the spill to the database (set once the app has started).
    replayer: SpillReplayer | None = None
    # Cuts what waits on an upstream when a shutdown's grace is nearly over (the CLI starts it).
    shutdown: ShutdownDeadline = field(default_factory=ShutdownDeadline)
    # Recall's vectors (None while no tenant has embeddings on: numpy is then not needed).
    vectors: VectorIndex | None = None
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    # User exports reading the database at once (each holds a connection while it reads).
    exports: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(EXPORTS_AT_ONCE))
    # Storing a large turn (HEAVY_TURN_MESSAGES or more), one at a time, tenants taking turns
    # (proxy/pipeline/exchange.py).
    heavy_turns: FairSlots = field(default_factory=lambda: FairSlots(HEAVY_TURNS_AT_ONCE))
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # What each conversation's turns were shown (`context.keep_shown`).
    shown: ShownContexts = field(default_factory=ShownContexts)

    def upstream_for(self, principal: Principal) -> Upstream:
        return self.upstreams[principal.tenant.upstream]

    def responses_mode(self, principal: Principal) -> ResponsesMode:
        """How the tenant's upstream serves the Responses API (`native` or `translate`)."""
        return self.config.upstreams[principal.tenant.upstream].responses_mode()

    def context_window(self, model: str) -> int | None:
        return self.catalog.context_window(model)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `work` in the background; shutdown waits for it."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self, seconds: float = 30.0) -> None:
        """Wait for background work, including work it spawns meanwhile, up to `seconds`."""
        deadline = asyncio.get_running_loop().time() + seconds
        while self.tasks:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            await asyncio.wait(set(self.tasks), timeout=left)


def build_upstream(name: str, config: UpstreamConfig, http: httpx.AsyncClient) -> Upstream:
    """The upstream of a config entry, with its retries and circuit breaker (not the echo's:
    it cannot fail)."""
    if config.kind == "echo":
        return EchoUpstream(name, config)
    inner: Upstream
    if config.kind == "openai":
        inner = OpenAIUpstream(name, config, http)
    elif config.kind == "anthropic":
        inner = AnthropicUpstream(name, config, http)
    else:
        inner = LiteLLMUpstream(name, config)
    return ResilientUpstream(inner, config)


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing: the client is shared by every tenant, so a cookie one
    upstream response set must never ride along on another tenant's request."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


def new_http_client() -> httpx.AsyncClient:
    """One pooled keep-alive client for every upstream (its connections in `SHARDS` pools:
    proxy/upstream/http_shards.py); per-upstream timeouts go per request."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    client = httpx.AsyncClient(
        transport=ShardedTransport.pools(SHARDS, limits),
        timeout=httpx.Timeout(600.0, connect=5.0),
        follow_redirects=False,
    )
    # The public setter copies into a plain Cookies; the jar itself has to be replaced.
    client._cookies = _NoCookies()
    return client
