"""The application factory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import structlog
from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from policies.extraction import JOB_KIND as EXTRACTION
from policies.jobs import RetryPolicy
from policies.pricing import Price, PriceBook
from policies.summaries import JOB_KIND as SUMMARIZE
from policies.tokens import warm_up_tokenizers
from policies.vectors import EMBED_JOB_KIND as EMBED
from proxy.access import access_hook
from proxy.artifacts import Artifacts
from proxy.auth import KeyRing
from proxy.catalog import ModelCatalog
from proxy.charges import MemoryCharges
from proxy.config import Config
from proxy.costs import COST_HEADERS, Pricer
from proxy.deps import provide_principal, provide_services
from proxy.embedding_jobs import MessageEmbedder
from proxy.embeddings import Embeddings, check_embeddings
from proxy.errors import EXCEPTION_HANDLERS
from proxy.exchange_batch import DeferredExchanges
from proxy.extraction import MemoryExtractor
from proxy.intent import IntentClassifiers
from proxy.jobs import JobRunner
from proxy.limits import LimitKeeper
from proxy.maintenance import Maintenance
from proxy.memory import ANONYMOUS, ConversationMemory
from proxy.metrics import Metrics
from proxy.offline import prepare_offline_environment
from proxy.replay import SpillReplayer, Wanted
from proxy.routes import attachments as attachments_routes
from proxy.routes import export, memories, memory, openai, ops, usage
from proxy.routes import jobs as jobs_routes
from proxy.routes import limits as limits_routes
from proxy.spill import SpillFile
from proxy.state import AppState, build_upstream, new_http_client
from proxy.summaries import HistorySummarizer
from proxy.upstream.litellm import LiteLLMUpstream
from proxy.vector_index import VectorIndex
from storage import migrate
from storage.database import Database

log = structlog.get_logger("memproxy.app")

EXPOSED_HEADERS = [
    "x-request-id",
    "x-upstream-request-id",
    "x-memory-conversation-id",
    "x-memory-context-tokens",
    "x-memory-history-messages",
    "x-memory-memories",
    "x-memory-attachments",
    "x-memory-status",
    "x-memory-intent",
    *COST_HEADERS,
]


def price_book(config: Config, catalog: ModelCatalog) -> PriceBook:
    """config.yaml's `pricing:` over litellm's model map."""
    overrides = {
        model: Price.per_million(p.input_per_mtok, p.output_per_mtok, p.cached_input_per_mtok)
        for model, p in config.pricing.items()
    }
    return PriceBook(overrides, catalog.info)


def create_app(config: Config) -> Litestar:
    """A ready-to-serve app for `config`; its resources live from startup to shutdown."""
    prepare_offline_environment()
    check_embeddings(config)  # a missing optional package fails now, naming the key

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if config.server.log_content:
            log.warning("log_content_on", detail="message content is logged (server.log_content)")
        # Load the tokenizers and the model map now, not on the first request.
        await asyncio.to_thread(warm_up_tokenizers)
        catalog = await asyncio.to_thread(ModelCatalog.load)
        await asyncio.to_thread(migrate.upgrade, config.database.url)
        db = Database(config.database.url)
        limits = LimitKeeper(db, config, interval=config.server.limits_sync_seconds)
        maintenance = Maintenance(db, config)
        server = config.server
        spill = SpillFile(server.spill_path, server.spill_max_bytes)
        try:
            await limits.start()  # knows today's spend before the first request
            pricer, metrics = Pricer(price_book(config, catalog)), Metrics()
            async with new_http_client() as http:
                upstreams = {
                    name: build_upstream(name, upstream, http)
                    for name, upstream in config.upstreams.items()
                }
                jobs = JobRunner(
                    db,
                    metrics,
                    poll_seconds=server.jobs_poll_seconds,
                    lease_seconds=server.job_lease_seconds,
                    concurrency=server.job_concurrency,
                    retry=RetryPolicy(server.job_max_attempts, server.job_retry_seconds),
                )
                charges = MemoryCharges(db, pricer, limits, metrics)
                extractor = MemoryExtractor(config, upstreams, db, charges, metrics)
                jobs.register(EXTRACTION, extractor)
                embeddings = Embeddings(config, upstreams, metrics)
                jobs.register(EMBED, MessageEmbedder(embeddings, db, metrics))
                jobs.register(SUMMARIZE, HistorySummarizer(config, upstreams, db, charges, metrics))
                vectors = None
                if embeddings.settings:
                    vectors = VectorIndex(max_bytes=server.embedding_cache_mb * 2**20)
                    await embeddings.warm_up()
                state = AppState(
                    config=config,
                    keys=KeyRing(config),
                    http=http,
                    db=db,
                    memory=ConversationMemory(db, timeout=server.storage_timeout_ms / 1000),
                    deferred=DeferredExchanges(db, spill),
                    catalog=catalog,
                    pricer=pricer,
                    metrics=metrics,
                    limits=limits,
                    charges=charges,
                    intents=IntentClassifiers(config, upstreams, metrics),
                    jobs=jobs,
                    artifacts=Artifacts(config, upstreams, db, pricer, metrics),
                    extractor=extractor,
                    embeddings=embeddings,
                    vectors=vectors,
                    spill=spill,
                    upstreams=upstreams,
                )
                replayer = SpillReplayer(
                    spill,
                    state.memory,
                    config,
                    metrics,
                    intent_of=lambda tenant: partial(state.intents.keyword, tenant),
                    wanted=lambda tenant, user, mode: Wanted(
                        extract=extractor.wanted(tenant, user, mode),
                        embed=embeddings.wanted(tenant, user, mode, ANONYMOUS),
                    ),
                    wake_jobs=jobs.wake,
                    interval=server.spill_replay_seconds,
                )
                # What the spill holds goes in before the start-up sweep, which would close
                # the exchanges its outcomes complete.
                await replayer.replay()
                await maintenance.start()  # the start-up sweep first, then every interval
                for upstream in state.upstreams.values():
                    inner = getattr(upstream, "inner", upstream)  # (under its retries)
                    if isinstance(inner, LiteLLMUpstream):
                        await inner.load()  # seconds: now rather than on a first request
                app.state.memproxy = state
                await jobs.start()
                await replayer.start()
                try:
                    yield
                finally:
                    await replayer.stop()
                    await jobs.stop()
                    await state.drain()
                    await state.deferred.close()
                    for upstream in state.upstreams.values():
                        await upstream.aclose()
        finally:
            await maintenance.stop()
            await limits.stop()  # writes the counts not yet shared
            await db.dispose()

    cors = config.server.cors_origins
    return Litestar(
        route_handlers=[
            openai.chat_completions,
            openai.list_models,
            openai.passthrough,
            *memory.ROUTES,
            *export.ROUTES,
            *memories.ROUTES,
            attachments_routes.router(config.server),
            *jobs_routes.ROUTES,
            *usage.ROUTES,
            limits_routes.get_limits,
            ops.healthz,
            ops.readyz,
            ops.metrics,
        ],
        dependencies={
            "services": Provide(provide_services, sync_to_thread=False),
            "principal": Provide(provide_principal),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[access_hook],
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        cors_config=CORSConfig(allow_origins=cors, expose_headers=EXPOSED_HEADERS)
        if cors
        else None,
        openapi_config=OpenAPIConfig(title="memproxy", version="0.1.0", path="/schema"),
        logging_config=None,
    )
