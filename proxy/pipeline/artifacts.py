"""Attachments and earlier tool results on the request path: gather them
(proxy/pipeline/artifact_sources.py), plan (the rule, or the tenant's planner model), make the
summaries the plan asks for (proxy/pipeline/artifact_summaries.py), and render them into the
proxy's context section (policies/artifacts.py decides; these modules do the I/O).

Every model call here has a timeout and never fails the request: a planner that fails or
answers a bad plan gives way to the rule, a summary that fails leaves its artifact out. Both
are recorded, and their cost is charged to the exchange. Every wait for the database is bounded
by the storage timeout (ConversationMemory.in_time, as storing the turn and recall are), the
model calls are not: a turn goes on without what the database could not read or store in time,
with its own inline documents whatever the database does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.artifact_prompts import parse_plan, planner_request
from policies.artifacts import (
    Artifact,
    Choice,
    Included,
    carry_out,
    fit,
    footprint,
    plan_by_rule,
)
from policies.chunks import counted_chunks
from policies.pricing import Usage
from policies.recall import query_terms
from proxy.accounting.costs import TOKENIZE_INLINE_CHARS, ready_to_count, usage_or_estimate
from proxy.accounting.metrics import Metrics
from proxy.background.embeddings import Embeddings
from proxy.background.semantic_query import SemanticQuery
from proxy.core.config import Config, TenantConfig
from proxy.core.errors import BadRequest
from proxy.core.requests import Inline
from proxy.pipeline.artifact_sources import (
    NO_SOURCES,
    TOOL_WINDOW,
    artifacts_of,
    content_hash,
    read_sources,
    relevance_of,
    store_documents,
)
from proxy.pipeline.artifact_summaries import FocusedSummaries
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.turn import ANONYMOUS
from proxy.upstream.base import Upstream
from proxy.upstream.sse import reply_from_completion
from storage.database import Database
from storage.errors import StorageError
from storage.repositories.attachments import Attachments

log = structlog.get_logger("memproxy.artifacts")


@dataclass(slots=True)
class Attached:
    """What the artifacts contribute to a turn."""

    text: str = ""  # the rendered section ("": nothing)
    tokens: int = 0  # its tokens as a system message of its own (tiktoken)
    items: list[Included] = field(default_factory=list)
    planner: str = "none"  # none (everything fit) | rule | llm | rule (the llm failed: why)
    summaries: dict[str, str] = field(default_factory=dict)  # artifact key -> hit|miss|failed
    summary_texts: dict[str, str] = field(default_factory=dict)  # artifact key -> the summary
    calls: list[tuple[str, str, Usage]] = field(default_factory=list)  # (kind, model, usage)
    # The database failed them (or was too slow): the request's documents were not stored, or
    # what it holds of the rest was not read.
    storage_failed: bool = False

    def included(self, item: Included) -> bool:
        """Whether the item went in (a summary that could not be made did not)."""
        if item.strategy == "summarize":
            return item.artifact.key in self.summary_texts
        return item.strategy != "exclude"

    @property
    def count(self) -> int:
        """Artifacts that went in (what `x-memory-attachments` counts)."""
        return sum(1 for i in self.items if self.included(i))

    def record(self, *, sent: bool = True) -> dict[str, Any]:
        """What the exchange record says about them (`sent`: False when the section was
        dropped because the prompt would not fit the model's window)."""
        items = []
        for item in self.items:
            entry = item.record()
            if item.strategy == "summarize":
                entry["cache"] = self.summaries.get(item.artifact.key, "failed")
            if not self.included(item) or not sent:
                entry["strategy"], entry["included_tokens"] = "exclude", 0
            items.append(entry)
        return {
            "planner": self.planner,
            "items": items,
            "tokens": self.tokens if sent else 0,
            **({} if sent else {"dropped_for_window": True}),
            **({"storage": "unavailable"} if self.storage_failed else {}),
        }


NOTHING_ATTACHED = Attached()


async def chunked(text: str) -> list[tuple[str, int]]:
    """A document's passages and their token counts (a long one's off the event loop)."""
    await ready_to_count("")
    if len(text) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(counted_chunks, text)
    return counted_chunks(text)


class Artifacts:
    """Per tenant: the planner's and summariser's upstream, and the work of one turn."""

    def __init__(
        self,
        config: Config,
        upstreams: Mapping[str, Upstream],
        db: Database,
        memory: ConversationMemory,
        metrics: Metrics,
        embeddings: Embeddings | None = None,
    ) -> None:
        self.db, self.memory, self.metrics, self.embeddings = db, memory, metrics, embeddings
        self.summaries = FocusedSummaries(db, memory, metrics)
        self._upstreams = {
            name: upstreams[tenant.attachments.upstream or tenant.upstream]
            for name, tenant in config.tenants.items()
        }

    async def check_refs(self, tenant_id: str, user_id: str, refs: Sequence[str]) -> None:
        """400 for an `attachment_id` that is not one of this user's attachments (the caller
        bounds the wait, and goes on without the ids when the database cannot tell)."""

        def work(conn: Connection) -> str | None:
            repo = Attachments(conn)
            for attachment_id in refs:
                found = repo.get(tenant_id, attachment_id)
                if found is None or found.user_id != user_id:
                    return attachment_id
            return None

        missing = await self.db.read(work)
        if missing is not None:
            index = list(refs).index(missing)
            raise BadRequest(
                f"No attachment found with id '{missing}'.",
                param=f"attachments[{index}].attachment_id",
                code="attachment_not_found",
            )

    async def _store_inline(
        self,
        got: Attached,
        *,
        request_id: str,
        tenant_id: str,
        user_id: str,
        conversation_pk: int,
        inline: Sequence[Inline],
    ) -> bool:
        """Store a request's inline documents with its conversation (mode `full`); one the
        conversation has already (the same text) is not stored again. False when they were
        not stored (logged): the database failed, or did not answer in time."""
        documents = [i for i in inline if i.content is not None]
        if not documents:
            return True
        prepared = [(doc, await chunked(doc.content or "")) for doc in documents]
        work = partial(
            store_documents,
            request_id=request_id,
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_pk=conversation_pk,
            documents=prepared,
            now=datetime.now(UTC),
            embed=self.embeddings is not None
            and self.embeddings.wanted(tenant_id, user_id, "full", ANONYMOUS),
        )

        try:
            await self.memory.in_time(self.db.write(work, tenant=tenant_id))
        except StorageError as exc:  # (a timed-out write already running may still land, whole)
            log.warning("attachments_not_stored", request_id=request_id, error=str(exc))
            got.storage_failed = True
            return False
        return True

    async def attach(
        self,
        tenant: TenantConfig,
        *,
        request_id: str,
        tenant_id: str,
        user_id: str,
        conversation_pk: int | None,
        conversation_id: str | None,
        conversation_end: int,
        inline: Sequence[Inline],
        store_in: int | None,
        in_prompt_calls: set[str],
        question: str,
        budget: int,
        started_at: datetime,
        storage_away: bool = False,
        tool_results: bool = True,
        semantic: SemanticQuery | None = None,
        model_calls: bool = True,
    ) -> Attached:
        """The artifacts of this turn fitted into `budget` tokens. `model_calls`: False for a
        dry run (count_tokens), fitted by the rule without summaries. `store_in`: the conversation
        (pk) the inline documents are first stored with (mode `full`; they are then read as
        its attachments); `in_prompt_calls`: tool call ids whose results the prompt already
        holds; `conversation_end`: the conversation's next seq (tool results are looked for
        among its last `TOOL_WINDOW` messages); `started_at`: when the request began;
        `storage_away`: the request found the database away already (its turn was not
        stored), so the summary cache is not waited for either; `tool_results`: False when
        the prompt holds the conversation's earlier tool results wherever they are;
        `semantic`: the question's vector, which finds stored passages by meaning too."""
        settings = tenant.attachments
        attached = Attached()
        stored = store_in is not None and await self._store_inline(
            attached,
            request_id=request_id,
            tenant_id=tenant_id,
            user_id=user_id,
            conversation_pk=store_in,
            inline=inline,
        )
        refs = [i.attachment_id for i in inline if i.attachment_id is not None]
        documents = [i for i in inline if i.content is not None]
        unstored = [] if stored and conversation_pk is not None else documents
        if budget <= 0 or (conversation_pk is None and not refs and not unstored):
            return attached
        terms = query_terms(question)
        sources, hits = NO_SOURCES, dict[tuple[int, int], float]()
        try:
            if conversation_pk is not None or refs:  # (else the request's own text alone)
                sources, hits = await self.memory.in_time(
                    self.db.read(
                        lambda conn: read_sources(
                            conn,
                            tenant_id,
                            user_id,
                            conversation_pk,
                            conversation_end - TOOL_WINDOW,
                            refs,
                            terms,
                            settings.tool_results and tool_results,
                            budget,
                            semantic,
                        )
                    )
                )
        except StorageError as exc:  # the request's own documents go in all the same
            log.warning("attachments_not_read", request_id=request_id, error=str(exc))
            attached.storage_failed = True
            unstored = documents
        # (Chunking tool results and scoring unindexed text is CPU work: off the event loop.)
        artifacts = await asyncio.to_thread(artifacts_of, sources, in_prompt_calls)
        known = {a.content_hash for a in sources.stored}
        for i, doc in enumerate(unstored):
            content = doc.content or ""
            if content_hash(content) in known:
                continue  # among the stored ones read (e.g. a write that timed out landed)
            chunks = await chunked(content)
            artifacts.append(
                Artifact.of_text(
                    f"inline:{i}", "attachment", doc.title, chunks, content_hash(content)
                )
            )
        if not artifacts:
            return attached
        relevance = await asyncio.to_thread(relevance_of, artifacts, sources, hits, question)
        summaries_on = tenant.summaries.mode == "llm" and model_calls
        if footprint(artifacts) <= budget:
            choices = plan_by_rule(artifacts, relevance, budget, summaries=summaries_on)
        elif settings.planner == "llm" and model_calls:
            planned = await self._plan(tenant_id, tenant, artifacts, question, budget, attached)
            choices = planned or plan_by_rule(artifacts, relevance, budget, summaries=summaries_on)
        else:
            attached.planner = "rule"
            choices = plan_by_rule(artifacts, relevance, budget, summaries=summaries_on)
        attached.items = carry_out(choices, artifacts, relevance, budget, summaries=summaries_on)
        # The summaries the plan asks for, at once (each call bounded by its own timeout;
        # the cache passed by once this request has found the database away).
        wanted = [item for item in attached.items if item.strategy == "summarize"]
        use_cache = not (storage_away or attached.storage_failed)
        made = await asyncio.gather(
            *(
                self.summaries.summary(
                    tenant_id=tenant_id,
                    user_id=user_id,
                    conversation_id=conversation_id,
                    model=tenant.summaries.model,
                    item=item,
                    question=question,
                    ask=partial(self._call, tenant_id, tenant, attached),
                    started_at=started_at,
                    use_cache=use_cache,
                )
                for item in wanted
            )
        )
        for item, summary in zip(wanted, made, strict=True):
            attached.summaries[item.artifact.key] = summary.cache
            if summary.text is not None:
                attached.summary_texts[item.artifact.key] = summary.text
        fitted = await asyncio.to_thread(
            fit, attached.items, attached.summary_texts, relevance, budget
        )
        attached.items, attached.text, attached.tokens = fitted.items, fitted.text, fitted.tokens
        planner = attached.planner.split(" ", 1)[0]  # (the reason a plan fell back: not a label)
        for item in attached.items:
            strategy = item.strategy if attached.included(item) else "exclude"
            self.metrics.artifacts.labels(tenant_id, strategy, planner).inc()
        return attached

    async def _call(
        self, tenant_id: str, tenant: TenantConfig, got: Attached, body: dict[str, Any], kind: str
    ) -> str | None:
        """One model call within the tenant's timeout; its text, or None on any failure."""
        upstream = self._upstreams[tenant_id]
        try:
            async with asyncio.timeout(tenant.attachments.timeout_ms / 1000):
                reply = await upstream.chat_completions(body, stream=False)
        except TimeoutError:
            log.warning("artifact_call_timeout", tenant=tenant_id, kind=kind)
            return None
        except Exception as exc:  # the upstream failed: the request goes on without it
            log.warning("artifact_call_failed", tenant=tenant_id, kind=kind, error=repr(exc))
            return None
        if reply.status >= 400:
            log.warning("artifact_call_failed", tenant=tenant_id, kind=kind, status=reply.status)
            return None
        message, raw_usage = reply_from_completion(reply.body or b"")
        usage = await usage_or_estimate(body["model"], raw_usage, body["messages"], message)
        got.calls.append((kind, body["model"], usage))
        content = (message or {}).get("content")
        return content if isinstance(content, str) else None

    async def _plan(
        self,
        tenant_id: str,
        tenant: TenantConfig,
        artifacts: Sequence[Artifact],
        question: str,
        budget: int,
        got: Attached,
    ) -> list[Choice] | None:
        body = planner_request(tenant.attachments.planner_model, question, artifacts, budget)
        content = await self._call(tenant_id, tenant, got, body, "planner")
        plan = parse_plan(content, artifacts) if content is not None else None
        if plan is None:
            got.planner = "rule (the planner failed)" if content is None else "rule (bad plan)"
            log.info("artifact_plan_fallback", tenant=tenant_id, reason=got.planner)
            return None
        got.planner = "llm"
        return plan
