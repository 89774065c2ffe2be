"""A spilled request written to the database, in one transaction, through the same code as a
live request (`begin_in`, `finish_in`), so its conversation is found or created as it would
have been then; `SpillReplayer` (proxy/pipeline/replay.py) drives it.

A request whose exchange is recorded already is skipped (but for its amendments), which makes
a replay safe to repeat. A user erased after the request began is not written back
(`erasures`). A turn whose request was refused by rules that need the database (its
conversation belongs to another user, an idempotency key reused with other messages) is recorded
as an exchange with the reason and no messages, as the live request would have been refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import structlog
from sqlalchemy import Connection

from proxy.accounting.charges import add_part
from proxy.core.config import TenantConfig
from proxy.core.errors import ProxyError
from proxy.durability.spill import Spilled
from proxy.pipeline.artifact_sources import Chunked, store_documents
from proxy.pipeline.intent import record_intent
from proxy.pipeline.reply import answered_since, finish_in
from proxy.pipeline.spill_entries import SpilledRequest, dates_in, kept_of
from proxy.pipeline.turn import IntentOf, Mode, Outcome, TokenCounter, Turn
from proxy.pipeline.turn_store import begin_in, opening
from storage.records import ConversationRecord, ExchangeRecord
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.system import SWEPT

log = structlog.get_logger("memproxy.spill")


@dataclass(frozen=True, slots=True)
class Wanted:
    """What to queue after a replayed reply: memory extraction, embedding."""

    extract: bool
    embed: bool


def _conversation_of(
    conversations: Conversations, found: ExchangeRecord
) -> ConversationRecord | None:
    """The conversation an exchange begun in the database was stored in, locked, if it is
    still that one (not another given its id since); else None."""
    if found.conversation_id is None:
        return None
    return conversations.still(
        found.tenant_id,
        found.conversation_id,
        found.conversation_pk,
        found.user_id,
        for_update=True,
    )


class ReplayWrites:
    """The transaction side of a replay: what one spilled request writes, and what became of
    it (replayed, begun, refused, amended, duplicate, erased, gone)."""

    def __init__(
        self, *, intent_of: Callable[[str], IntentOf], wanted: Callable[[str, str, str], Wanted]
    ) -> None:
        """`intent_of(tenant)` classifies a replayed turn as a live one would be;
        `wanted(tenant, user, mode)` says what to queue after its reply."""
        self.intent_of, self.wanted = intent_of, wanted

    def apply(
        self,
        request: SpilledRequest,
        tenant: TenantConfig,
        count: TokenCounter,
        documents: Chunked,
        conn: Connection,
    ) -> str:
        """One request's entries, written in `conn`'s transaction; what became of it."""
        result = self._apply_exchange(request, tenant, count, documents, conn)
        if result == "erased":
            return result
        # Then what amends its record: the intent replaces the keyword one, as live; each
        # charge is added once, however often the replay repeats.
        wrote = False
        if request.intent is not None:
            head = request.intent
            wrote = record_intent(
                conn,
                tenant_id=head.tenant_id,
                request_id=head.request_id,
                detail=head.data["intent"],
            )
        for charge in request.charges:
            part = charge.data["part"]
            wrote = add_part(conn, charge.tenant_id, charge.request_id, part) == "added" or wrote
        return "amended" if wrote and result == "duplicate" else result

    def _apply_exchange(
        self,
        request: SpilledRequest,
        tenant: TenantConfig,
        count: TokenCounter,
        documents: Chunked,
        conn: Connection,
    ) -> str:
        head = request.first
        tenant_id, user_id, request_id = head.tenant_id, head.user_id, head.request_id
        erasures = Erasures(conn)
        erasures.lock(tenant_id, user_id)
        if erasures.erased_since(tenant_id, user_id, head.at):
            return "erased"
        exchanges = Exchanges(conn)
        found = exchanges.get(tenant_id, request_id)
        if request.record is not None:
            if found is not None:
                return "duplicate"
            exchanges.insert_finished([dates_in(request.record.data)])
            return "replayed"
        if found is None:
            if request.turn is None:
                return "gone"  # begun in the database, deleted since (conversation, retention)
            turn = self._begin(conn, request.turn, tenant, count)
            if turn is None:
                return "refused"
        elif request.outcome is not None and (
            found.status == "in_progress" or found.error == SWEPT
        ):
            turn = self._resumed(conn, found, request.outcome)
        else:
            # The turn's own write landed late (its documents were not stored with it), and
            # its outcome, if any, comes in a later round: the documents go in now, or never.
            if documents and found.mode == "full":
                conv = _conversation_of(Conversations(conn), found)
                if conv is not None:
                    self._store(conn, head, conv.pk, documents)
                    return "amended"
            return "duplicate"
        if documents and turn.mode == "full" and turn.conversation is not None:
            # (Also when the turn's own write landed late: the documents were not stored.)
            self._store(conn, head, turn.conversation.pk, documents)
        if request.outcome is None:
            return "begun"
        data = request.outcome.data
        fields = dates_in(data["fields"])
        reply, at = data.get("reply"), fields.get("finished_at")
        finish_in(
            turn, data["status"], reply, fields, count, conn, replied_at=at, keep=kept_of(data)
        )
        return "replayed"

    def _begin(
        self, conn: Connection, entry: Spilled, tenant: TenantConfig, count: TokenCounter
    ) -> Turn | None:
        data = entry.data
        turn, exchange = opening(
            request_id=entry.request_id,
            tenant_id=entry.tenant_id,
            user_id=entry.user_id,
            conversation_id=data.get("conversation_id"),
            mode=data["mode"],
            idempotency_key=data.get("idempotency_key"),
            model=data["model"],
            upstream=data["upstream"],
            stream=bool(data.get("stream")),
            started_at=entry.at,
        )
        messages = data["messages"]
        try:
            begin_in(
                turn,
                exchange,
                data.get("conversation_id"),
                messages,
                tenant.context,
                count,
                self.intent_of(entry.tenant_id),
                conn,
                forks=False,
            )
        except ProxyError as exc:  # (raised before anything is written)
            log.warning("spill_turn_refused", request_id=entry.request_id, error=exc.message)
            exchange.idempotency_key = None  # (its owner holds it)
            refused = Outcome(
                "error", exc.status, error=f"answered while storage was down, not stored: {exc}"
            )
            Exchanges(conn).insert_finished([exchange.row() | refused.fields()])
            return None
        self._flag(turn, {})
        return turn

    def _flag(self, turn: Turn, flags: dict[str, Any]) -> None:
        """What `finish_in` queues after the reply: as the live request decided, when it
        got as far, else as a live request would now."""
        wanted = self.wanted(turn.tenant_id, turn.user_id, turn.mode)
        turn.extract = bool(flags.get("extract", wanted.extract))
        turn.embed = bool(flags.get("embed", wanted.embed))
        turn.summarize_through = flags.get("summarize_through")

    def _store(
        self, conn: Connection, head: Spilled, conversation_pk: int, documents: Chunked
    ) -> None:
        """A spilled turn's inline documents, with its conversation (those already there, by
        their content, are not stored twice), embedded as a live turn's are."""
        store_documents(
            conn,
            request_id=head.request_id,
            tenant_id=head.tenant_id,
            user_id=head.user_id,
            conversation_pk=conversation_pk,
            documents=documents,
            now=head.at,
            embed=self.wanted(head.tenant_id, head.user_id, "full").embed,
        )

    def _resumed(self, conn: Connection, found: ExchangeRecord, outcome: Spilled | None) -> Turn:
        """The turn of an exchange begun in the database (its `begin()` landed, or its
        `finish()` failed), as `finish_in` needs it."""
        conversations = Conversations(conn)
        conv, last = _conversation_of(conversations, found), None
        if conv is not None:
            last = conversations.first_seq_of_exchange(
                found.tenant_id, conv.pk, found.request_id, last=True
            )
            if last is not None and last + 1 != conv.next_seq:
                # Turns were stored after this one meanwhile: the conversation as this turn
                # left it, so the reply is placed as a late live reply is (`finish_in`: kept
                # beside an answer already there, else after them).
                conv = dataclasses.replace(conv, next_seq=last + 1)
        mode = cast(Mode, found.mode)
        turn = Turn(found.request_id, found.tenant_id, found.user_id, mode, found.model, conv)
        turn.reply_to = found.reply_to
        flags = (outcome.data.get("turn") if outcome else None) or {}
        store = flags.get("store_reply")
        if store is None and conv is not None:
            # Without the live turn's word, as a live turn decides: a reply is stored unless
            # the turn was answered already (a retry of an answered turn stores none; a
            # retry, which stores no messages of its own, of an unanswered one does).
            answered = found.reply_to is None or answered_since(
                conversations,
                dataclasses.replace(conv, next_seq=found.reply_to + 1),
                found.reply_to,
            )
            store = mode == "full" and (last is not None or not answered)
        turn.store_reply = conv is not None and bool(store)
        self._flag(turn, flags)
        return turn
