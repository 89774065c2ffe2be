"""The application factory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from importlib import metadata
from pathlib import Path

import structlog
from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide

from policies.extraction import JOB_KIND as EXTRACTION
from policies.jobs import RetryPolicy
from policies.public_ids import PUBLIC_IDS, PublicIds
from policies.summaries import JOB_KIND as SUMMARIZE
from policies.vectors import EMBED_JOB_KIND as EMBED
from policies.vectors import EMBED_MEMORIES_KIND, EMBED_PASSAGES_KIND
from proxy.accounting.catalog import ModelCatalog
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.costs import COST_HEADERS, Pricer
from proxy.accounting.limits import LimitKeeper
from proxy.accounting.metrics import Metrics
from proxy.background.embedding_backlog import EmbeddingBacklog
from proxy.background.embeddings import check_embeddings
from proxy.background.jobs import JobRunner
from proxy.background.maintenance import Maintenance
from proxy.core.access import access_hook
from proxy.core.config import Config
from proxy.core.errors import EXCEPTION_HANDLERS
from proxy.core.offline import prepare_offline_environment
from proxy.core.requests import before_handler
from proxy.core.slow_bodies import limit_body_waits
from proxy.core.user_paths import keep_user_ids_whole
from proxy.deps import provide_principal, provide_services
from proxy.durability.spill import SpillFile
from proxy.durability.storage_circuit import StorageCircuit
from proxy.pipeline.exchange_batch import DeferredExchanges
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.replay import SpillReplayer
from proxy.pipeline.replay_writes import Wanted
from proxy.pipeline.turn import ANONYMOUS
from proxy.reload import ConfigReloader, Configured, configure, price_book
from proxy.routes import (
    anthropic,
    conversations,
    export,
    memories,
    messages,
    openai,
    ops,
    reference,
    responses,
    traces,
    usage,
    users,
)
from proxy.routes import attachments as attachments_routes
from proxy.routes import jobs as jobs_routes
from proxy.routes import limits as limits_routes
from proxy.state import AppState, new_http_client
from proxy.ui import TEMPLATES
from proxy.ui import routers as inspector
from storage import migrate
from storage.database import Database
from storage.repositories.system import SystemRepository

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
    "x-memory-stored",
    "x-memory-intent",
    *COST_HEADERS,
]


def _register_jobs(jobs: JobRunner, parts: Configured) -> None:
    jobs.register(EXTRACTION, parts.extractor)
    jobs.register(EMBED, parts.embedder)
    jobs.register(EMBED_MEMORIES_KIND, parts.memory_embedder)
    jobs.register(EMBED_PASSAGES_KIND, parts.passage_embedder)
    jobs.register(SUMMARIZE, parts.summarizer)


def _version() -> str:
    try:
        return metadata.version("memproxy")
    except metadata.PackageNotFoundError:  # (run from a checkout that is not installed)
        return "unknown"


def migrate_database(config: Config) -> None:
    """Bring the database up to the latest schema, waiting up to
    `database.connect_wait_seconds` for one that cannot be reached yet, and trying again a
    migration that waited too long for a table in use (each try logged). Blocking; raises
    `StorageError` with the reason."""
    database = config.database

    def waiting(attempt: int, pause: float, reason: str) -> None:
        log.warning(
            "database_unreachable",
            url=migrate.shown_url(database.url),
            attempt=attempt,
            retry_in_s=round(pause, 1),
            error=reason,
        )

    def busy(attempt: int, pause: float, reason: str) -> None:
        log.warning(
            "migration_waiting_for_lock",
            url=migrate.shown_url(database.url),
            attempt=attempt,
            of=migrate.LOCK_ATTEMPTS,
            retry_in_s=round(pause, 1),
            error=reason,
        )

    migrate.upgrade(
        database.url,
        wait_seconds=database.connect_wait_seconds,
        on_wait=waiting,
        on_busy=busy,
    )


def create_app(
    config: Config, *, config_path: str | Path | None = None, migrated: bool = False
) -> Litestar:
    """A ready-to-serve app for `config`; its resources live from startup to shutdown. With
    `config_path`, SIGHUP reloads that file's tenants, keys, upstreams and pricing. Start-up
    migrates the database unless the caller did (`migrated`)."""
    prepare_offline_environment()
    check_embeddings(config)  # an upstream that serves no embeddings fails now, naming the key

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if config.server.log_content:
            log.warning("log_content_on", detail="message content is logged (server.log_content)")
        # The model map now, not on the first request. (The tokenizers and the local embedding
        # model are built when first needed, in worker threads: policies/tokens.py,
        # proxy/background/local_model.py.)
        catalog = await asyncio.to_thread(ModelCatalog.load)
        if not migrated:
            await asyncio.to_thread(migrate_database, config)
        database = config.database
        db = Database(
            database.url, pool_size=database.pool_size, max_overflow=database.max_overflow
        )
        limits = LimitKeeper(db, config, interval=config.server.limits_sync_seconds)
        maintenance = Maintenance(db, config)
        server = config.server
        spill = SpillFile(server.spill_path, server.spill_max_bytes)
        circuit = StorageCircuit(
            server.storage_breaker_threshold, server.storage_breaker_open_seconds
        )
        try:
            ids = PublicIds(
                bytes.fromhex(await db.read(lambda c: SystemRepository(c).secret(PUBLIC_IDS)))
            )
            await limits.start()  # knows today's spend before the first request
            pricer, metrics = Pricer(price_book(config, catalog)), Metrics()
            metrics.storage_circuit_open.set_function(lambda: float(circuit.state() != "closed"))
            async with new_http_client() as http:
                jobs = JobRunner(
                    db,
                    metrics,
                    poll_seconds=server.jobs_poll_seconds,
                    lease_seconds=server.job_lease_seconds,
                    concurrency=server.job_concurrency,
                    retry=RetryPolicy(server.job_max_attempts, server.job_retry_seconds),
                )
                charges = MemoryCharges(db, pricer, limits, metrics)
                memory = ConversationMemory(
                    db, timeout=server.storage_timeout_ms / 1000, circuit=circuit
                )
                parts = await configure(
                    config, db=db, memory=memory, http=http, charges=charges, metrics=metrics
                )
                state = AppState(
                    config=config,
                    keys=parts.keys,
                    http=http,
                    db=db,
                    memory=memory,
                    deferred=DeferredExchanges(db, spill),
                    catalog=catalog,
                    pricer=pricer,
                    metrics=metrics,
                    limits=limits,
                    charges=charges,
                    intents=parts.intents,
                    jobs=jobs,
                    artifacts=parts.artifacts,
                    extractor=parts.extractor,
                    embeddings=parts.embeddings,
                    vectors=parts.vectors,
                    spill=spill,
                    ids=ids,
                    upstreams=parts.upstreams,
                )
                _register_jobs(jobs, parts)
                replayer = SpillReplayer(
                    spill,
                    state.memory,
                    config,
                    metrics,
                    intent_of=lambda tenant: partial(state.intents.keyword, tenant),
                    wanted=lambda tenant, user, mode: Wanted(
                        extract=state.extractor.wanted(tenant, user, mode),
                        embed=state.embeddings.wanted(tenant, user, mode, ANONYMOUS),
                    ),
                    wake_jobs=jobs.wake,
                    interval=server.spill_replay_seconds,
                    heavy=state.heavy_turns,
                )
                current = parts

                async def apply(new: Configured) -> None:
                    """A reloaded config's parts, swapped in at once (no await before the
                    last assignment): each request sees the old parts or the new ones."""
                    nonlocal current
                    current = new
                    state.config, state.keys, state.upstreams = new.config, new.keys, new.upstreams
                    state.intents, state.artifacts = new.intents, new.artifacts
                    state.extractor, state.embeddings = new.extractor, new.embeddings
                    state.vectors = new.vectors
                    pricer.prices = price_book(new.config, catalog)
                    _register_jobs(jobs, new)
                    maintenance.config = replayer.config = new.config
                    await limits.reconfigure(new.config)

                reloader = None
                if config_path is not None:
                    reloader = ConfigReloader(
                        config_path,
                        lambda: current,
                        lambda loaded: configure(
                            loaded,
                            db=db,
                            memory=memory,
                            http=http,
                            charges=charges,
                            metrics=metrics,
                            before=current,
                        ),
                        apply,
                    )
                    if not reloader.install():
                        log.info("config_reload_unavailable", reason="not the main thread")
                state.replayer = replayer
                backlog = EmbeddingBacklog(
                    db,
                    lambda: state.embeddings,
                    metrics,
                    interval=server.maintenance_seconds,
                    anonymous=ANONYMOUS,
                    wake_jobs=jobs.wake,
                )
                await spill.load()  # whose turns a previous run left in it
                await maintenance.start()  # the start-up sweep first, then every interval
                app.state.memproxy = state
                await jobs.start()
                await replayer.start()
                await backlog.start()
                log.info(
                    "started",
                    version=_version(),
                    config=None if config_path is None else str(config_path),
                    database=migrate.shown_url(config.database.url),
                    tenants=len(config.tenants),
                    upstreams=sorted(config.upstreams),
                    spill=str(spill.path),
                )
                try:
                    yield
                finally:
                    if reloader is not None:
                        reloader.uninstall()
                    await backlog.stop()
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
    app = Litestar(
        route_handlers=[
            openai.chat_completions,
            openai.list_models,
            *responses.ROUTES,
            *anthropic.ROUTES,
            openai.passthrough,
            *conversations.ROUTES,
            *messages.ROUTES,
            *users.ROUTES,
            *export.ROUTES,
            *memories.ROUTES,
            attachments_routes.router(config.server),
            *jobs_routes.ROUTES,
            *usage.ROUTES,
            *traces.ROUTES,
            limits_routes.get_limits,
            ops.healthz,
            ops.healthz_head,
            ops.readyz,
            ops.readyz_head,
            ops.metrics,
            reference.docs_router(),
            *inspector(config.server),
        ],
        dependencies={
            "services": Provide(provide_services, sync_to_thread=False),
            "principal": Provide(provide_principal),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        template_config=TEMPLATES,
        before_request=before_handler,
        before_send=[access_hook],
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        cors_config=CORSConfig(allow_origins=cors, expose_headers=EXPOSED_HEADERS)
        if cors
        else None,
        openapi_config=reference.openapi_config(_version()),
        logging_config=None,
    )
    # Before the router: a user id holding "/" stays one path segment (proxy/core/user_paths.py);
    # a body that stops arriving is a 408 (proxy/core/slow_bodies.py).
    app.asgi_handler = keep_user_ids_whole(
        limit_body_waits(app.asgi_handler, config.server.body_timeout_seconds)
    )
    return app
