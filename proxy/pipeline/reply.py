"""Storing a turn's reply and closing its exchange record (`finish_in`), inside the caller's
transaction: the live path's and the spill's replay's."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.extraction import JOB_KIND as EXTRACTION
from policies.identity import chain_next
from policies.jobs import conversation_subject
from policies.summaries import JOB_KIND as SUMMARIZE
from policies.vectors import EMBED_JOB_KIND as EMBED
from proxy.core.requests import reply_problem
from proxy.pipeline.turn import Outcome, TokenCounter, Turn, now
from storage.errors import StaleConversation
from storage.records import KEPT_ITEMS, ConversationRecord, NewMessage, ResponseRecord
from storage.repositories.conversation_messages import SUPERSEDED
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.responses import Responses

log = structlog.get_logger("memproxy.pipeline")
# A reply's status when the upstream's message is not one a client could send back.
MALFORMED = "malformed"


def answered_since(
    conversations: Conversations, as_begun: ConversationRecord, reply_to: int
) -> bool:
    """Whether an attempt at this turn (the message at seq `reply_to`) stored a complete reply
    to it after `as_begun` (the conversation as an attempt began). A reply to an overlapping
    turn stored meanwhile is not one; nor is a partial reply, nor an imported message. An
    assistant message without `reply_to` (one a client sent back in its history, or a reply
    stored before replies named their turn) counts when it comes right after the turn."""
    replies = conversations.replies_after(as_begun.tenant_id, as_begun.pk, as_begun.next_seq - 1)
    for seq, status, meta in replies:
        if "reply_to" not in meta:
            if seq == as_begun.next_seq:
                return True
        elif meta["reply_to"] == reply_to and status == "complete":
            return True
    return False


def finish_in(
    turn: Turn,
    status: str,
    reply: dict[str, Any] | None,
    fields: dict[str, Any],
    count: TokenCounter,
    conn: Connection,
    *,
    replied_at: datetime | None = None,
    keep: ResponseRecord | None = None,
) -> None:
    """`finish()`'s work inside the caller's transaction (also the spill's replay): `status`
    and `reply` are the outcome's, `fields` the exchange record's columns for it;
    `replied_at` dates the reply (default: now). A complete reply that is not a well-formed
    message (`reply_problem`: the upstream broke the format) is kept as `malformed`, outside
    the chain, never attached or searched, and the record's error says what is wrong."""
    Erasures(conn).share(turn.tenant_id, turn.user_id)
    if status == "complete" and reply is not None and (problem := reply_problem(reply)):
        status = MALFORMED
        fields = {**fields, "error": f"the upstream's reply is malformed: {problem}"}
    conv = turn.conversation
    stored = None
    if turn.store_reply and conv is not None and reply is not None:
        conversations = Conversations(conn)
        tokens = count(reply)
        reply_to = turn.reply_to if turn.reply_to is not None else conv.next_seq - 1

        def store(at: ConversationRecord, as_status: str) -> None:
            in_chain = as_status == "complete"
            message = NewMessage(
                role="assistant",
                content=reply.get("content"),
                tool_calls=reply.get("tool_calls"),
                tokens=tokens,
                chain_hash=chain_next(at.chain_hash, reply) if in_chain else None,
                status=as_status,
                exchange_id=turn.request_id,
                created_at=replied_at,
                meta={"reply_to": reply_to}
                | ({KEPT_ITEMS: reply[KEPT_ITEMS]} if reply.get(KEPT_ITEMS) else {}),
            )
            conversations.append(at, turn.user_id, [message], now=now())
            nonlocal stored
            stored = as_status

        try:
            # Usually nothing was stored since begin(): no need to read the row again.
            store(conv, status)
        except StaleConversation:
            fresh = conversations.still(
                turn.tenant_id, conv.id, conv.pk, conv.user_id, for_update=True
            )
            if fresh is None:  # deleted meanwhile: the reply goes nowhere, nor any job
                conv = None
            elif answered_since(conversations, conv, reply_to) or conversations.set_aside(
                turn.tenant_id, conv.pk, reply_to
            ):
                # Another attempt at the same turn (a retry that overtook this one)
                # answered it first, or the client went another way from before the turn
                # meanwhile (a fork): keep this reply for the record, outside the chain.
                # (A turn stored meanwhile is answered after it: the reply follows it.)
                store(fresh, SUPERSEDED if status == "complete" else status)
            else:
                store(fresh, status)
    elif conv is not None and (turn.embed or turn.summarize_through is not None):
        # Nothing stored now: work is queued for the conversation only if it is still there
        # (not deleted, or its user erased, while the upstream answered).
        conv = Conversations(conn).still(turn.tenant_id, conv.id, conv.pk, conv.user_id)
    # The protocol's object for the reply (a Responses API response), dated when its request
    # began: not for a user erased since (nor a conversation deleted meanwhile).
    if keep is not None and not Erasures(conn).erased_since(
        turn.tenant_id, turn.user_id, keep.created_at
    ):
        record = replace(keep, conversation_id=conv.id if conv else None)
        if turn.conversation is not None and conv is None:
            pass  # (its conversation was deleted while the upstream answered)
        elif not Responses(conn).keep(record):  # (the reply is stored all the same)
            log.warning("response_id_taken", request_id=turn.request_id, response=keep.id)
    if turn.pending is not None:  # nothing was written for it yet
        Exchanges(conn).insert_finished([turn.pending.row() | fields])
    else:
        Exchanges(conn).finish(turn.tenant_id, turn.request_id, **fields)
    if turn.extract and stored == "complete":  # with the reply, or not at all
        Jobs(conn).enqueue(turn.tenant_id, turn.user_id, EXTRACTION, turn.request_id, now=now())
    if turn.embed and conv is not None and turn.mode == "full":
        # The turn's messages (stored at begin) and a complete reply: whatever is there.
        Jobs(conn).enqueue(turn.tenant_id, turn.user_id, EMBED, turn.request_id, now=now())
    if turn.summarize_through is not None and conv is not None:
        # Once per conversation and seq: the next requests that find the same need are
        # not queued again. Charged to this exchange.
        payload = {
            "conversation_id": conv.id,
            "conversation_pk": conv.pk,
            "through_seq": turn.summarize_through,
            "exchange_id": turn.request_id,
        }
        ref = f"{conversation_subject(conv.id, conv.created_at)}:{turn.summarize_through}"
        Jobs(conn).enqueue(turn.tenant_id, turn.user_id, SUMMARIZE, ref, now=now(), payload=payload)


def pending_row(turn: Turn, outcome: Outcome) -> dict[str, Any]:
    """The whole record of an exchange that nothing was written for before it ended."""
    assert turn.pending is not None
    return turn.pending.row() | outcome.fields()
