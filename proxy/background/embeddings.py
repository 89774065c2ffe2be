"""Embeddings for recall, behind one interface (`Embedder`), per tenant (`memory.embeddings`):

- `upstream`: the tenant's upstream (or `memory.embedding_upstream`) answers OpenAI's
  `POST /v1/embeddings` for `memory.embedding_model`, through the shared HTTP client with the
  upstream's base URL and key; the built-in echo upstream answers with deterministic
  hashed-bag-of-words vectors, so the default install works with embeddings on.
- `local` (the default): all-MiniLM-L6-v2 in this process on onnxruntime, no torch
  (proxy/background/local_model.py). Its files are checked at start-up and it is loaded on
  the first embedding (in a worker thread); if it cannot be (no wheel for the platform, a
  corrupt file, onnxruntime refusing it), memproxy starts, or goes on, all the same, logs it
  once, and those tenants recall by keywords (`status`, shown by /readyz and /metrics).

An upstream that cannot serve embeddings is a `ConfigError` at start-up (`check_embeddings`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import structlog

from policies.pricing import Usage
from policies.tokens import count_text
from policies.vectors import normalised
from proxy.accounting.metrics import Metrics
from proxy.background import local_model
from proxy.core.config import Config, ConfigError, MemorySettings
from proxy.upstream.base import Upstream, UpstreamReply

log = structlog.get_logger("memproxy.embeddings")

LOCAL_MODEL = "all-MiniLM-L6-v2"
# The stored model name of local vectors: never the same as an upstream model's.
LOCAL_MODEL_NAME = "local/" + LOCAL_MODEL
UPSTREAM_BATCH = 64
# What is embedded of a message: its beginning (MiniLM reads 256 word pieces; OpenAI's models
# 8k tokens, but a long message's beginning says what it is about).
EMBED_CHARS = 2000
# The questions' vectors kept (per process) for the stored user messages that are the same
# text: the background job then embeds only the reply of a turn, not its question again.
RECENT_QUESTIONS = 256


class EmbeddingError(Exception):
    """Embeddings could not be had (the upstream failed or answered nonsense, the local model
    failed); recall goes on without them. `paid`: what the calls answered before the failure
    used (a later batch failed), which the tenant's key is billed for all the same."""

    def __init__(self, message: str, paid: Usage | None = None) -> None:
        super().__init__(message)
        self.paid = paid


@dataclass(frozen=True, slots=True)
class Embedded:
    """One vector per text, in order, and what the call used (None: nothing paid for, as
    the local model's)."""

    vectors: list[list[float]]
    usage: Usage | None = None


class Embedder(Protocol):
    # Stored beside each vector: vectors of different models are never compared.
    model: str
    # Whether its calls are paid for (an upstream's): a call is charged to one exchange, so it
    # embeds that exchange's messages only. One that is not (the local model) embeds a user's
    # turns queued behind it in the same call (proxy/background/embedding_jobs.py).
    billed: bool

    async def embed(self, texts: Sequence[str], *, question: bool = False) -> Embedded:
        """One vector per text; `question`: a question's, on the request path (which the
        local model runs beside the background's batches, never behind them)."""
        ...


class EmbeddingsUpstream(Protocol):
    """An upstream that serves OpenAI's embeddings endpoint (the openai and echo kinds)."""

    name: str

    async def embeddings(self, body: dict[str, Any]) -> UpstreamReply: ...


def _parse_embeddings(
    reply: UpstreamReply, texts: Sequence[str], upstream: str
) -> tuple[list[list[float]], Usage]:
    """The vectors of an embeddings reply for `texts`, and the input tokens it reports (or
    our count of `texts`, marked estimated)."""
    count = len(texts)
    if reply.status >= 400:
        raise EmbeddingError(f"upstream {upstream!r} answered {reply.status} to /embeddings")
    try:
        payload = msgspec.json.decode(reply.body or b"")
        data = sorted(payload["data"], key=lambda d: d["index"])
        vectors = [[float(v) for v in d["embedding"]] for d in data]
        usage = payload.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        tokens = usage.get("prompt_tokens", usage.get("total_tokens"))
    except (RecursionError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EmbeddingError(f"upstream {upstream!r}: not an embeddings reply ({exc!r})") from None
    if len(vectors) != count or any(not v for v in vectors):
        raise EmbeddingError(f"upstream {upstream!r}: {len(vectors)} embeddings for {count} inputs")
    if len({len(v) for v in vectors}) > 1:
        raise EmbeddingError(f"upstream {upstream!r}: embeddings of different sizes")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        return vectors, Usage(tokens, 0)
    return vectors, Usage(sum(count_text(t) for t in texts), 0, estimated=True)


class UpstreamEmbedder:
    """OpenAI's `/v1/embeddings` through an upstream, in batches."""

    billed = True

    def __init__(self, upstream: EmbeddingsUpstream, model: str) -> None:
        self.upstream, self.model = upstream, model

    async def embed(self, texts: Sequence[str], *, question: bool = False) -> Embedded:
        """The vectors, and the calls' input tokens as the upstream reports them (or counted):
        what the tenant's key is billed for, charged by the caller."""
        out: list[list[float]] = []
        tokens, estimated = 0, False  # (over the batches)
        for start in range(0, len(texts), UPSTREAM_BATCH):
            try:
                vectors, used = await self._batch(texts[start : start + UPSTREAM_BATCH])
            except EmbeddingError as exc:
                if start:  # the batches before it were answered, and billed
                    exc.paid = Usage(tokens, 0, estimated=estimated)
                raise
            out.extend(vectors)
            tokens, estimated = tokens + used.prompt_tokens, estimated or used.estimated
        return Embedded(out, Usage(tokens, 0, estimated=estimated))

    async def _batch(self, texts: Sequence[str]) -> tuple[list[list[float]], Usage]:
        batch = [t[:EMBED_CHARS] for t in texts]
        body = {"model": self.model, "input": batch, "encoding_format": "float"}
        try:
            reply = await self.upstream.embeddings(body)
        except EmbeddingError:
            raise
        except Exception as exc:
            raise EmbeddingError(
                f"upstream {self.upstream.name!r} could not be reached for embeddings ({exc!r})"
            ) from exc
        return _parse_embeddings(reply, batch, self.upstream.name)


class LocalEmbedder:
    """all-MiniLM-L6-v2 (384 dimensions) in this process (proxy/background/local_model.py):
    checked at start-up (`check`), loaded on its first embedding and run in a worker thread,
    so the event loop never waits on either. Background batches run one at a time, however
    many texts each has (the model uses every core it gets: two at once would only take more
    of them from the request path); a question never waits behind them. A model that cannot
    be loaded is told to `unavailable` (on the event loop)."""

    model = LOCAL_MODEL_NAME
    billed = False

    def __init__(self, unavailable: Callable[[local_model.LocalModelUnavailable], None]) -> None:
        self._run_lock = threading.Lock()
        self._unavailable = unavailable

    def _encode(self, texts: list[str], question: bool) -> list[list[float]]:
        model = local_model.load()
        if question:  # inference is safe to run beside a batch
            vectors = model.encode(texts)
        else:
            with self._run_lock:
                vectors = model.encode(texts)
        return vectors.tolist()  # type: ignore[no-any-return]

    def _loaded_or_not(self, work: asyncio.Future[list[list[float]]]) -> None:
        failure = None if work.cancelled() else work.exception()
        if isinstance(failure, local_model.LocalModelUnavailable):
            self._unavailable(failure)

    async def check(self) -> None:
        """Whether the model can be loaded (without loading it); raises
        `LocalModelUnavailable` when it cannot be."""
        await asyncio.to_thread(local_model.check)

    async def embed(self, texts: Sequence[str], *, question: bool = False) -> Embedded:
        batch = [t[:EMBED_CHARS] for t in texts]
        work = asyncio.ensure_future(asyncio.to_thread(self._encode, batch, question))
        # (told even when the caller stopped waiting: a question's timeout while it loads)
        work.add_done_callback(self._loaded_or_not)
        try:
            return Embedded(await asyncio.shield(work))
        except local_model.LocalModelUnavailable as exc:
            raise EmbeddingError(f"the local embedding model could not be loaded ({exc})") from exc
        except Exception as exc:
            raise EmbeddingError(f"the local embedding model failed ({exc!r})") from exc


def check_embeddings(config: Config) -> None:
    """Fail at start-up, naming the key, when a tenant's upstream embeddings cannot work here.
    (`local` never fails the start: without its model, recall goes on by keywords.)"""
    for name, tenant in config.tenants.items():
        settings = tenant.memory
        if settings.embeddings != "upstream":
            continue
        upstream_name = settings.embedding_upstream or tenant.upstream
        kind = config.upstreams[upstream_name].kind
        if kind not in ("openai", "echo"):
            key = "embedding_upstream" if settings.embedding_upstream else "embeddings"
            raise ConfigError(
                f"tenants.{name}.memory.{key}: upstream {upstream_name!r} is of kind {kind!r}, "
                "which serves no /v1/embeddings; name an openai-kind upstream in "
                "memory.embedding_upstream, or use embeddings: local"
            )


class Embeddings:
    """Each tenant's embedder (None: embeddings off), built from the configuration."""

    def __init__(self, config: Config, upstreams: Mapping[str, Upstream], metrics: Metrics) -> None:
        self.metrics = metrics
        self.settings: dict[str, MemorySettings] = {}
        self._embedders: dict[str, Embedder] = {}
        local: LocalEmbedder | None = None
        for name, tenant in config.tenants.items():
            settings = tenant.memory
            if settings.embeddings == "off":
                continue
            self.settings[name] = settings
            if settings.embeddings == "local":
                local = local or LocalEmbedder(self._local_unavailable)
                self._embedders[name] = local
            else:
                upstream = upstreams[settings.embedding_upstream or tenant.upstream]
                if not hasattr(upstream, "embeddings"):  # check_embeddings said so at start-up
                    raise ConfigError(f"tenants.{name}.memory.embeddings: no embeddings upstream")
                self._embedders[name] = UpstreamEmbedder(upstream, settings.embedding_model)  # type: ignore[arg-type]
        self.local = local
        self.unavailable: str | None = None  # why the local model could not be loaded
        self._recent: OrderedDict[tuple[str, str, str], list[float]] = OrderedDict()

    def embedder(self, tenant_id: str) -> Embedder | None:
        return self._embedders.get(tenant_id)

    def wanted(self, tenant_id: str, user_id: str, mode: str, anonymous: str) -> bool:
        """Whether an exchange of this user, stored in this mode, is to be embedded. The
        anonymous user's turns are not: it gets no cross-conversation recall."""
        return tenant_id in self._embedders and mode == "full" and user_id != anonymous

    async def check_local(self) -> None:
        """At start-up (and a reload): whether the local model can be loaded, known without
        loading it (that waits for its first embedding, `LocalEmbedder`)."""
        if self.local is None:
            return
        try:
            await self.local.check()
        except local_model.LocalModelUnavailable as exc:
            self._local_unavailable(exc)
        else:
            self.metrics.local_embeddings_up.set(1)

    def _local_unavailable(self, failure: local_model.LocalModelUnavailable) -> None:
        """The local model cannot be had (found at start-up, or when its first embedding
        loaded it): its tenants recall by keywords alone from now on (their embedders gone,
        so nothing more is queued for them), logged once per process, and `status` (so
        /readyz and /metrics) says why."""
        self.unavailable = str(failure)
        for name in [n for n, e in self._embedders.items() if e is self.local]:
            del self._embedders[name]
        if not local_model.reported(failure):
            log.error(
                "local_embedding_model_unavailable",
                reason=self.unavailable,
                detail="recall goes on by keywords alone",
            )
        self.metrics.local_embeddings_up.set(0)

    def status(self) -> str | None:
        """The local model's state, for /readyz: None when no tenant uses it; `ok` when it can
        be used (loaded, or to be loaded by the first embedding)."""
        if self.local is None:
            return None
        return f"unavailable: {self.unavailable}" if self.unavailable else "ok"

    async def query(self, tenant_id: str, text: str, *, request_id: str = "") -> Vector | None:
        """The embedding of a question, or None: embeddings off, or failed or too slow (bounded
        by the tenant's `embedding_timeout_ms`), logged and counted; recall then goes on
        full-text only."""
        embedder = self._embedders.get(tenant_id)
        if embedder is None or not text.strip():
            return None
        timeout = self.settings[tenant_id].embedding_timeout_ms / 1000
        loading = embedder is self.local and not local_model.loaded()
        try:
            async with asyncio.timeout(timeout):
                embedded = await embedder.embed([text], question=True)
            (vector,) = embedded.vectors
            values = normalised(vector)
            found = Vector(embedder.model, values, embedded.usage)
        except TimeoutError:
            outcome, found = "timeout", None
            if loading:  # (the first question after start-up: the load goes on, for the next)
                log.info("query_embedding_while_model_loads", request_id=request_id)
            else:
                log.warning("query_embedding_timeout", request_id=request_id, tenant=tenant_id)
        except Exception as exc:  # an addition: whatever went wrong, recall goes on without
            outcome, found = "error", None
            log.warning(
                "query_embedding_failed", request_id=request_id, tenant=tenant_id, error=repr(exc)
            )
        else:
            outcome = "ok"
            self._recent[(tenant_id, embedder.model, text[:EMBED_CHARS])] = values
            if len(self._recent) > RECENT_QUESTIONS:
                self._recent.popitem(last=False)
        self.metrics.embedding_queries.labels(tenant_id, outcome).inc()
        return found

    def recent(self, tenant_id: str, model: str, text: str) -> list[float] | None:
        """The vector a recent question of the tenant had, when it was this very text (a
        stored user message is its turn's question): no need to embed it again."""
        return self._recent.get((tenant_id, model, text[:EMBED_CHARS]))


@dataclass(frozen=True, slots=True)
class Vector:
    """A question's embedding (unit length) and the model that made it."""

    model: str
    values: list[float]
    usage: Usage | None = None  # what embedding it used (None: nothing paid for)
