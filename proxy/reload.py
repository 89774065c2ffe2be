"""What config.yaml's tenants, keys, upstreams and pricing make, built at start-up and again on
SIGHUP, without dropping a request.

`configure()` builds the parts that depend on them (the key ring, the upstream clients, the
intent classifiers, attachments, memory extraction, embeddings, and the job handlers that use
them); `ConfigReloader` reads the file again on SIGHUP, builds those parts anew (an upstream
whose settings did not change keeps its client, its circuit breaker and litellm's loaded
module) and swaps them into the running app in one step. A request already admitted finishes
with the upstream and the tenant settings it started with; the next one sees the new ones.

`server:` and `database:` need a restart: a reload that changes them says so in the log and
keeps the running values. A file that does not load is logged and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import structlog

from policies.pricing import Price, PriceBook
from proxy.accounting.catalog import ModelCatalog
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.metrics import Metrics
from proxy.background.embedding_items import MemoryEmbedder, PassageEmbedder
from proxy.background.embedding_jobs import MessageEmbedder
from proxy.background.embeddings import Embeddings, check_embeddings
from proxy.background.extraction import MemoryExtractor
from proxy.background.vector_index import VectorIndex
from proxy.core.auth import KeyRing
from proxy.core.config import Config, ConfigError
from proxy.core.config_file import load_config
from proxy.pipeline.artifacts import Artifacts
from proxy.pipeline.intent import IntentClassifiers
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.summaries import HistorySummarizer
from proxy.state import build_upstream
from proxy.upstream.base import Upstream
from proxy.upstream.litellm import LiteLLMUpstream
from storage.database import Database

log = structlog.get_logger("memproxy.config")

RESTART_ONLY = ("server", "database")


def price_book(config: Config, catalog: ModelCatalog) -> PriceBook:
    """config.yaml's `pricing:` over litellm's model map."""
    overrides = {
        model: Price.per_million(p.input_per_mtok, p.output_per_mtok, p.cached_input_per_mtok)
        for model, p in config.pricing.items()
    }
    return PriceBook(overrides, catalog.info)


@dataclass
class Configured:
    """The parts made from the reloadable config."""

    config: Config
    keys: KeyRing
    upstreams: dict[str, Upstream]
    intents: IntentClassifiers
    artifacts: Artifacts
    extractor: MemoryExtractor
    embeddings: Embeddings
    summarizer: HistorySummarizer
    embedder: MessageEmbedder
    memory_embedder: MemoryEmbedder
    passage_embedder: PassageEmbedder
    vectors: VectorIndex | None


async def configure(
    config: Config,
    *,
    db: Database,
    memory: ConversationMemory,
    http: httpx.AsyncClient,
    charges: MemoryCharges,
    metrics: Metrics,
    before: Configured | None = None,
) -> Configured:
    """Build the parts for `config`; `before`'s upstreams are kept where their settings are
    the same, and its vectors (recall's in-memory copy) when embeddings stay on."""
    upstreams: dict[str, Upstream] = {}
    for name, settings in config.upstreams.items():
        if before is not None and before.config.upstreams.get(name) == settings:
            upstreams[name] = before.upstreams[name]
            continue
        upstream = build_upstream(name, settings, http)
        inner = getattr(upstream, "inner", upstream)  # (under its retries)
        if isinstance(inner, LiteLLMUpstream):
            await inner.load()  # seconds: now rather than on a first request
        upstreams[name] = upstream
    embeddings = Embeddings(config, upstreams, metrics)
    vectors = None
    if embeddings.settings:
        vectors = before.vectors if before is not None else None
        if vectors is None:
            max_bytes = config.server.embedding_cache_mb * 2**20
            vectors = VectorIndex(max_bytes=max_bytes)
        await embeddings.check_local()
    return Configured(
        config=config,
        keys=KeyRing(config),
        upstreams=upstreams,
        intents=IntentClassifiers(config, upstreams, metrics),
        artifacts=Artifacts(config, upstreams, db, memory, metrics, embeddings),
        extractor=MemoryExtractor(config, upstreams, db, charges, metrics, embeddings),
        embeddings=embeddings,
        summarizer=HistorySummarizer(config, upstreams, db, charges, metrics),
        embedder=MessageEmbedder(embeddings, db, metrics, charges),
        memory_embedder=MemoryEmbedder(embeddings, db, metrics, charges),
        passage_embedder=PassageEmbedder(embeddings, db, metrics, charges),
        vectors=vectors,
    )


def restart_only_changes(running: Config, loaded: Config) -> list[str]:
    """The sections of `loaded` that differ from `running` and need a restart."""
    return [name for name in RESTART_ONLY if getattr(running, name) != getattr(loaded, name)]


class ConfigReloader:
    """Reads `path` again on SIGHUP (or `reload()`) and hands the new parts to `apply`."""

    def __init__(
        self,
        path: str | Path,
        current: Callable[[], Configured],
        build: Callable[[Config], Awaitable[Configured]],
        apply: Callable[[Configured], Awaitable[None]],
    ) -> None:
        self.path, self.current, self.build, self.apply = Path(path), current, build, apply
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[bool]] = set()

    def install(self) -> bool:
        """Reload on SIGHUP; False where signals cannot be handled (not the main thread)."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_signal)
        except (RuntimeError, ValueError, NotImplementedError):
            return False
        return True

    def uninstall(self) -> None:
        """At shutdown: a SIGHUP now is ignored (its default would end the process and cut
        the streams being drained)."""
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _on_signal(self) -> None:
        task = asyncio.create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> bool:
        """Whether the new config is now in force (a failure is logged, and changes nothing)."""
        async with self._lock:  # one at a time, in the order asked
            running = self.current().config
            try:
                loaded = await asyncio.to_thread(load_config, self.path)
                check_embeddings(loaded)
            except ConfigError as exc:
                log.error("config_reload_failed", path=str(self.path), error=str(exc))
                return False
            fixed = restart_only_changes(running, loaded)
            if fixed:
                log.warning("config_reload_needs_restart", sections=fixed, kept="running values")
                loaded = loaded.model_copy(
                    update={name: getattr(running, name) for name in RESTART_ONLY}
                )
            try:
                parts = await self.build(loaded)
            except Exception as exc:
                log.exception("config_reload_failed", path=str(self.path), error=repr(exc))
                return False
            await self.apply(parts)
            log.info(
                "config_reloaded",
                tenants=len(loaded.tenants),
                upstreams=sorted(loaded.upstreams),
            )
            return True
