"""Embedding stored messages, the background job (`embed_messages`), off the request path.

Queued with each stored exchange of a named user when the tenant has embeddings on (in the
transaction that stores the reply: proxy/pipeline/memory.py), and for messages imported or appended
through the management API (`queue_range`), so imported histories are recalled by meaning too.
A job embeds the messages still without a vector of the tenant's model, up to `CHUNK` per
attempt, and queues a job for the rest; the vectors are written in the transaction that ends
the job, and only for messages that are still there. An upstream's embedding call is charged
as it is made (`embedding` in the cost parts of the job's exchange, the tenant's budgets, the
metrics).

With an embedder whose calls are not paid for (the local model), a turn's job also embeds the
user's turns stored after it whose jobs are queued (not running), in the same call, up to the
chunk (a turn still being answered is not taken: its question's vector is on its way). Under
load, when the jobs queue up, one model call does the work of many (a run of short texts costs
less per text than each alone), and the jobs of those turns end with it, never claimed. A job
still embeds its own turn's messages whatever the others do, so a job that fails leaves no
message of another turn without its vector: that turn's own job embeds it. (An upstream's call
is charged to one exchange: there each job embeds its own turn only.)
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection

from policies.vectors import EMBED_JOB_KIND
from proxy.background.item_embedder import ItemEmbedder, Pending
from storage.records import JobRecord
from storage.repositories.jobs import Jobs
from storage.repositories.vectors import MessageVectors, NewVector


def _now() -> datetime:
    return datetime.now(UTC)


def queue_range(
    conn: Connection,
    tenant_id: str,
    user_id: str,
    conversation_pk: int,
    first_seq: int,
    last_seq: int | None,
    *,
    subject: str,
    now: datetime,
    name: str = "range",
) -> bool:
    """Queue embedding of a conversation's messages from `first_seq` to `last_seq` (None: to
    its end), in the caller's transaction. The job is named by the conversation (`subject`:
    `conversation_subject`) and its whole range: a range queued again (a retried import) is
    queued once, and one that starts where another ended (an append after an import's last
    chunk) is a job of its own. (`name`: the catch-up's ranges are named apart, so one is
    never taken for a range done earlier.)"""
    end = "" if last_seq is None else last_seq
    return Jobs(conn).enqueue(
        tenant_id,
        user_id,
        EMBED_JOB_KIND,
        f"{name}:{subject}:{first_seq}-{end}",
        now=now,
        payload={
            "conversation_pk": conversation_pk,
            "subject": subject,
            "first_seq": first_seq,
            "last_seq": last_seq,
        },
    )


class MessageEmbedder(ItemEmbedder):
    """The handler of `embed_messages` jobs, for every tenant: a stored exchange's messages
    (the job's ref is its request id, charged the call) or a range of a conversation's (an
    import, an append, the catch-up: charged to no exchange)."""

    def pending(self, conn: Connection, job: JobRecord, model: str) -> list[Pending]:
        vectors = MessageVectors(conn)
        payload = job.payload or {}
        if "conversation_pk" in payload:
            found = vectors.unembedded(
                job.tenant_id,
                job.user_id,
                model,
                conversation_pk=int(payload["conversation_pk"]),
                first_seq=int(payload.get("first_seq") or 0),
                last_seq=payload.get("last_seq"),
                limit=self.chunk,
            )
        else:
            found = vectors.unembedded(
                job.tenant_id, job.user_id, model, exchange_id=job.ref, limit=self.chunk
            )
            # Room for the turns after it, short of a whole chunk: a whole chunk means the
            # turn's own messages were more than that, and a job is queued for their rest.
            room = self.chunk - 1 - len(found)
            if found and room > 0 and self._unbilled(job):
                found += vectors.unembedded_of_queued_turns(
                    job.tenant_id,
                    job.user_id,
                    model,
                    job_kind=job.kind,
                    after_pk=max(m.pk for m in found),
                    limit=room,
                )
        return [
            Pending(m.pk, m.seq, m.text, group=m.conversation_pk, source=m.exchange_id or "")
            for m in found
        ]

    def settle_others(
        self, conn: Connection, job: JobRecord, model: str, pending: Sequence[Pending]
    ) -> dict[str, Any]:
        # The turns queued behind it whose messages it embedded: their jobs end with it, never
        # claimed (each would only find its turn done). Only those with nothing left: the
        # chunk may have been full, and a turn's messages need not follow each other (two
        # turns answered at once interleave theirs), so some of a turn taken may not be.
        others = {p.source for p in pending if p.source and p.source != job.ref}
        if not others:
            return {}
        done = Jobs(conn).finish_queued(
            job.tenant_id,
            job.user_id,
            job.kind,
            MessageVectors(conn).embedded_turns(job.tenant_id, job.user_id, model, others),
            now=_now(),
            result={"embedded": 0, "embedded_by": job.ref},
        )
        return {"turns_queued_behind": done} if done else {}

    def _unbilled(self, job: JobRecord) -> bool:
        embedder = self.embeddings.embedder(job.tenant_id)
        return embedder is not None and not embedder.billed

    def known(self, job: JobRecord, model: str, pending: Sequence[Pending]) -> list[Any]:
        # A turn's question was embedded on the request path: its stored message is not again.
        return [self.embeddings.recent(job.tenant_id, model, p.text) for p in pending]

    def charged_to(self, job: JobRecord) -> str | None:
        return None if "conversation_pk" in (job.payload or {}) else job.ref

    def store(self, conn: Connection, job: JobRecord, model: str, rows: Sequence[NewVector]) -> int:
        stored = MessageVectors(conn).store(job.tenant_id, job.user_id, model, rows, now=_now())
        self.metrics.embedded_messages.labels(job.tenant_id).inc(stored)
        return stored

    def queue_rest(self, conn: Connection, job: JobRecord, last: Pending) -> dict[str, Any]:
        payload = job.payload or {}
        through = payload.get("last_seq")
        if through is not None and last.seq >= int(through):
            return {}  # (the range's end)
        queue_range(
            conn,
            job.tenant_id,
            job.user_id,
            last.group,
            last.seq + 1,
            through,
            # (a job queued before subjects named conversations: its pk, as it did)
            subject=str(payload.get("subject") or last.group),
            now=_now(),
        )
        return {"continued_from": last.seq + 1}
