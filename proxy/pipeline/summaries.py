"""Progressive summaries of long conversations (`summaries.mode: llm`).

On the request path (`summarize_history`, no model call): when a conversation has stored turns
older than the history attached, the latest summary of its history is read (one index read)
and, when it reaches those turns and fits the budget, goes with the request in a system
section, taking its tokens from the history's share; otherwise the request goes on with plain
truncation, and the exchange record says why (`attached.summary`). When the summary is missing,
behind or about to fall behind (policies/summaries.py), a job is queued with the reply.

The job (`HistorySummarizer`) extends the latest summary with the turns stored after it, up to
the seq it was queued for, asking the tenant's summary model with a timeout; the summary is
stored in the summary cache (kind `history`, subject: the conversation) and each call charged
to the exchange that queued it (`summary` in its cost parts). A call that fails, times out or
answers no text fails the job, which the queue retries and finally dead-letters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.context import Assembly, Budget, Recalled, StoredTurn
from policies.summaries import (
    KIND,
    BadSummary,
    aged_through,
    chunks,
    fit_summary,
    parse_summary,
    render,
    summary_request,
    target,
    turns_hash,
)
from policies.tokens import count_message
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.metrics import Metrics
from proxy.background.jobs import Apply, JobFailed, ask_model
from proxy.core.config import Config, TenantSettings
from proxy.pipeline.turn import Turn
from proxy.state import AppState
from proxy.upstream.base import Upstream
from storage.database import Database
from storage.errors import StorageError
from storage.records import JobRecord, MessageRecord, SummaryRecord
from storage.repositories.conversations import Conversations
from storage.repositories.summaries import Summaries, summary_key

log = structlog.get_logger("memproxy.summaries")
# Summariser calls in one job; what is left waits for the next job (a long import, say).
MAX_CALLS = 4
# Stored messages one job reads at most.
MAX_MESSAGES = 2000
SKIPPED_ROLES = ("system", "developer")  # the client's own instructions: resent every time


def covered(summary: SummaryRecord | None) -> int | None:
    """The seq a stored history summary covers through."""
    if summary is None:
        return None
    through = summary.covers.get("through_seq")
    return through if isinstance(through, int) else None


@dataclass(slots=True)
class HistorySummary:
    """What `summarize_history` decided: the history to attach, the summary section to
    attach with it (if any), and what the exchange record says."""

    history: list[StoredTurn]
    section: Recalled | None = None
    record: dict[str, Any] | None = None

    def recorded(self, assembly: Assembly | None) -> dict[str, Any] | None:
        """The record, once the assembly is known (the window may have left the section out)."""
        if self.section is not None and (assembly is None or not assembly.summarized):
            return {**(self.record or {}), "used": False, "reason": "window"}
        return self.record


async def summarize_history(
    services: AppState,
    tenant: TenantSettings,
    turn: Turn | None,
    client: Sequence[dict[str, Any]],
    history: list[StoredTurn],
    budget: Budget,
    *,
    count_use: bool = True,
) -> HistorySummary:
    """The history summary for a request whose attached `history` was chosen from the loaded
    tail (`turn.history`) within `budget` (the history's share: recall's is off already).
    `count_use`: a summary used is counted (not for a dry run)."""
    if turn is None or turn.conversation is None or not history:
        return HistorySummary(history)
    loaded = turn.history
    if aged_through(loaded, history) is None:
        return HistorySummary(history)  # the whole conversation goes with the request
    settings = tenant.summaries
    if settings.mode == "off":
        return HistorySummary(history, record={"used": False, "reason": "off"})
    tenant_id, user_id, subject = turn.tenant_id, turn.user_id, turn.conversation.id
    metrics = services.metrics.summary_cache

    def read(conn: Connection) -> SummaryRecord | None:
        return Summaries(conn).latest(tenant_id, user_id, KIND, subject)

    try:
        found = await services.memory.in_time(services.db.read(read))
    except StorageError as exc:  # a summary is an addition: without it the request goes on
        log.warning("summary_not_read", request_id=turn.request_id, error=str(exc))
        return HistorySummary(history, record={"used": False, "reason": "unavailable"})
    through = covered(found)
    text = render(found.text) if found is not None else ""
    tokens = count_message({"role": "system", "content": text}) if found is not None else 0
    fitted = fit_summary(client, loaded, history, budget, through, tokens)
    if fitted.used and found is not None:
        record: dict[str, Any] = {"used": True, "through_seq": through, "tokens": tokens}
        result = HistorySummary(fitted.history, Recalled(text, tokens), record)
        if count_use:
            _count_use(services, turn, found.key)
    else:
        record = {"used": False, "reason": fitted.reason}
        if through is not None:
            record["through_seq"] = through
        result = HistorySummary(history, record=record)
    outcome = "hit" if fitted.used else "miss"
    metrics.labels(tenant_id, KIND, outcome).inc()
    record["cache"] = outcome
    wanted = target(fitted.aged, through, loaded[-1].seq, settings.lead_messages)
    if wanted is not None and turn.mode != "off":
        turn.summarize_through = wanted  # queued with the reply
        record["queued_through"] = wanted
    return result


def _count_use(services: AppState, turn: Turn, key: str) -> None:
    """A cached summary's use, counted off the request path (management calls wait for it)."""

    async def write() -> None:
        try:
            await services.db.write(
                lambda conn: Summaries(conn).hit(turn.tenant_id, key, datetime.now(UTC))
            )
        except StorageError as exc:
            log.warning("summary_use_not_counted", request_id=turn.request_id, error=str(exc))

    services.memory.track(turn, services.spawn(write()), metadata=True)


@dataclass(frozen=True, slots=True)
class _Work:
    """What a job read: the summary it extends and the turns after it."""

    previous: SummaryRecord | None
    turns: list[MessageRecord]
    cached: SummaryRecord | None = None
    key: str = ""
    reached: int = 0  # the last seq read: the job's `through_seq`, or short of it (MAX_MESSAGES)


class HistorySummarizer:
    """The handler of `summarize_history` jobs, for every tenant."""

    def __init__(
        self,
        config: Config,
        upstreams: Mapping[str, Upstream],
        db: Database,
        charges: MemoryCharges,
        metrics: Metrics,
    ) -> None:
        self.config, self.db, self.charges, self.metrics = config, db, charges, metrics
        self._upstreams = {
            name: upstreams[tenant.summaries.upstream or tenant.upstream]
            for name, tenant in config.tenants.items()
            if tenant.summaries.mode == "llm"
        }

    async def __call__(self, job: JobRecord) -> Apply:
        tenant = self.config.tenants.get(job.tenant_id)
        upstream = self._upstreams.get(job.tenant_id)
        if tenant is None or upstream is None:
            raise JobFailed("summaries are off for this tenant now")
        settings = tenant.summaries
        payload = job.payload
        subject, through = str(payload["conversation_id"]), int(payload["through_seq"])
        work = await self.db.read(
            lambda conn: self._read(conn, job, subject, int(payload["conversation_pk"]), through)
        )
        if work is None:
            return lambda conn: {"skipped": "the conversation is gone"}
        if not work.turns:
            return lambda conn: {
                "skipped": "covered already",
                "through_seq": covered(work.previous),
            }
        if work.cached is not None:  # made meanwhile (or before, and found again)
            self.metrics.summary_cache.labels(job.tenant_id, KIND, "hit").inc()
            return lambda conn: {"cached": work.key, "through_seq": covered(work.cached)}
        text = work.previous.text if work.previous is not None else None
        start, calls = 0, 0
        for size in chunks([m.tokens for m in work.turns], settings.input_tokens)[:MAX_CALLS]:
            part = work.turns[start : start + size]
            text = await self._call(job, upstream, text, part, str(payload["exchange_id"]))
            start, calls = start + size, calls + 1
        assert text is not None
        done = work.turns[:start]
        last = done[-1].seq if start < len(work.turns) else work.reached
        key = work.key
        if start < len(work.turns):  # the rest waits for the next job: keyed by what was read
            root = work.previous.key if work.previous else f"{KIND}:{subject}"
            key = summary_key(root, turns_hash([m.to_openai() for m in done]), settings.model)
        tokens = count_message({"role": "system", "content": render(text)})
        final = text

        def apply(conn: Connection) -> dict[str, Any]:
            return self._apply(conn, job, subject, key, final, tokens, last, calls)

        return apply

    def _read(
        self, conn: Connection, job: JobRecord, subject: str, conversation_pk: int, through: int
    ) -> _Work | None:
        conversation = Conversations(conn).still(
            job.tenant_id, subject, conversation_pk, job.user_id
        )
        if conversation is None:
            return None
        summaries = Summaries(conn)
        previous = summaries.latest(job.tenant_id, job.user_id, KIND, subject)
        after = covered(previous) or 0
        if after >= through:
            return _Work(previous, [])
        limit = min(through - after, MAX_MESSAGES)
        found = Conversations(conn).messages(
            job.tenant_id, conversation_pk, after_seq=after, limit=limit
        )
        # Read as far as `through`, unless the limit stopped short: then what a summary of
        # these may claim ends at the last one read, and the rest waits for the next job.
        short = found and len(found) == limit < through - after
        reached = min(found[-1].seq, through) if short else through
        turns = [
            m
            for m in found
            if m.seq <= through and m.status == "complete" and m.role not in SKIPPED_ROLES
        ]
        if not turns:
            return _Work(previous, [])
        model = self.config.tenants[job.tenant_id].summaries.model
        # The first summary's key names its conversation: two conversations that open alike
        # each have their own.
        root = previous.key if previous is not None else f"{KIND}:{subject}"
        key = summary_key(root, turns_hash([m.to_openai() for m in turns]), model)
        return _Work(previous, turns, summaries.get(job.tenant_id, key), key, reached)

    async def _call(
        self,
        job: JobRecord,
        upstream: Upstream,
        previous: str | None,
        turns: Sequence[MessageRecord],
        exchange_id: str,
    ) -> str:
        """One summariser call: `previous` extended with `turns`."""
        settings = self.config.tenants[job.tenant_id].summaries
        body = summary_request(
            settings.model, previous, [m.to_openai() for m in turns], max_tokens=settings.max_tokens
        )
        answer = await ask_model(
            upstream, body, seconds=settings.timeout_seconds, what="the summary model"
        )
        try:
            await self.charges.charge(
                job.tenant_id, exchange_id, kind="summary", model=settings.model, usage=answer.usage
            )
        except StorageError as exc:
            log.error("summary_cost_not_recorded", job=job.pk, error=str(exc))
        try:
            return parse_summary(answer.content)
        except BadSummary as exc:
            raise JobFailed(str(exc), output=answer.output) from exc

    def _apply(
        self,
        conn: Connection,
        job: JobRecord,
        subject: str,
        key: str,
        text: str,
        tokens: int,
        through: int,
        calls: int,
    ) -> dict[str, Any]:
        # The conversation's row, locked: a delete meanwhile means the summary goes nowhere,
        # and two jobs of one conversation store theirs one after the other.
        conversation = Conversations(conn).still(
            job.tenant_id,
            subject,
            int(job.payload["conversation_pk"]),
            job.user_id,
            for_update=True,
        )
        if conversation is None:
            return {"skipped": "the conversation is gone"}
        summaries = Summaries(conn)
        newest = covered(summaries.latest(job.tenant_id, job.user_id, KIND, subject))
        if newest is not None and newest >= through:
            return {"skipped": "a summary reaching as far is there", "through_seq": newest}
        model = self.config.tenants[job.tenant_id].summaries.model
        summaries.put(
            job.tenant_id,
            key,
            kind=KIND,
            user_id=job.user_id,
            subject=subject,
            model=model,
            text=text,
            tokens=tokens,
            now=datetime.now(UTC),
            covers={"through_seq": through},
        )
        return {"through_seq": through, "key": key, "calls": calls, "tokens": tokens}
