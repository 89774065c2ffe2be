"""Focused summaries of a turn's artifacts (the plan's `summarize`): from the summary cache, or
made by the summariser now and cached. Keyed by the user, the document's content hash, the
question's stemmed words, the model and the size asked for: the same document and question
never cost the same user a second call. Stored under the attachment's id (a stored attachment)
or the conversation's (what else it summarises), and deleted with either.

A summary of a user erased while it was made is used for the request but not stored. A
summary never fails the request: a cache the database cannot serve is passed by (the summary
is made anyway), one that cannot be stored is used now and made again next time, and one that
cannot be made leaves its artifact out. Each wait for the database is bounded by the storage
timeout, and a request that already found the database away does not wait for it again (the
cache is passed by: `use_cache`); the summariser's call is not (it has the tenant's
`attachments.timeout_ms`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import structlog
from sqlalchemy import Connection

from policies.artifact_prompts import SUMMARY_SOURCE_CHARS, summary_request, summary_within
from policies.artifacts import SUMMARY_KIND, Included
from policies.memories import stem
from policies.model_json import clip
from policies.recall import query_terms
from proxy.accounting.metrics import Metrics
from proxy.pipeline.memory import ConversationMemory
from storage.database import Database
from storage.errors import StorageError
from storage.repositories.attachments import Attachments
from storage.repositories.erasures import Erasures
from storage.repositories.summaries import Summaries, summary_key

log = structlog.get_logger("memproxy.artifacts")
# One call of the summariser: (request body, kind) -> the text it answered, None on failure.
Ask = Callable[[dict[str, Any], str], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class Summary:
    """An artifact's summary as it came out: from the cache, made now, or not at all."""

    cache: Literal["hit", "miss", "failed"]
    text: str | None = None


FAILED = Summary("failed")


class FocusedSummaries:
    """The summary cache around the summariser's calls."""

    def __init__(self, db: Database, memory: ConversationMemory, metrics: Metrics) -> None:
        self.db, self.memory, self.metrics = db, memory, metrics

    async def summary(
        self,
        *,
        tenant_id: str,
        user_id: str,
        conversation_id: str | None,
        model: str,
        item: Included,
        question: str,
        ask: Ask,
        started_at: datetime,
        use_cache: bool = True,
    ) -> Summary:
        """`item`'s artifact summarised for `question` within the room the plan gave it;
        `started_at`: when the request began (a user erased since keeps no summary of it).
        Without `use_cache` (the request found the database away) the cache is neither read
        nor written."""
        artifact = item.artifact
        stored = artifact.kind == "attachment" and not artifact.key.startswith("inline:")
        subject = artifact.key if stored else conversation_id or ""
        focus = " ".join(sorted({stem(t) for t in query_terms(question)}))
        # Per user: the summary is shaped by the question's words, which are the user's.
        key = summary_key(
            "attachment", user_id, artifact.content_hash, focus, model, str(item.summary_tokens)
        )
        now = datetime.now(UTC)

        def cached(conn: Connection) -> str | None:
            found = Summaries(conn).get(tenant_id, key)
            if found is not None:
                Summaries(conn).hit(tenant_id, key, now)
            return found.text if found else None

        text = None
        try:
            if use_cache:
                text = await self.memory.in_time(self.db.write(cached, tenant=tenant_id))
        except StorageError as exc:  # the cache is an addition: make the summary anyway
            log.warning("summary_cache_unavailable", tenant=tenant_id, error=str(exc))
            use_cache = False  # (nor wait again to store it)
        if text is not None:
            self.metrics.summary_cache.labels(tenant_id, "attachment", "hit").inc()
            return Summary("hit", text)
        self.metrics.summary_cache.labels(tenant_id, "attachment", "miss").inc()
        source = "\n\n".join(p.text for p in artifact.passages)
        if artifact.partial:  # a large stored document: its text, read now
            try:
                record = await self.memory.in_time(
                    self.db.read(lambda conn: Attachments(conn).get(tenant_id, subject))
                )
            except StorageError as exc:
                log.warning("summary_source_unavailable", tenant=tenant_id, error=str(exc))
                record = None
            if record is None:
                return FAILED
            source = clip(record.content, SUMMARY_SOURCE_CHARS)
        body = summary_request(model, question, artifact.title, source, item.summary_tokens)
        made = summary_within(await ask(body, "summary"), item.summary_tokens)
        if made is None:
            return FAILED
        text, tokens = made

        def cache(conn: Connection) -> None:
            erasures = Erasures(conn)
            erasures.share(tenant_id, user_id)  # (wholly before an erasure, or after it)
            if erasures.erased_since(tenant_id, user_id, started_at):
                return  # erased while it was made: it serves this request, and is not kept
            Summaries(conn).put(
                tenant_id,
                key,
                kind=SUMMARY_KIND,
                user_id=user_id,
                subject=subject,
                model=model,
                text=text,
                tokens=tokens,
                now=now,
                covers={"focus": focus},
            )

        try:
            if use_cache:
                await self.memory.in_time(self.db.write(cache, tenant=tenant_id))
        except StorageError as exc:  # used now, made again next time
            log.warning("summary_not_cached", tenant=tenant_id, error=str(exc))
        return Summary("miss", text)
