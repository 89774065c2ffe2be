"""Storing a turn in its conversation, inside the caller's transaction (`begin_in`: the live
path's and the spill's replay's): find or create the conversation, tell what the request adds
from what is stored (a continuation, a retry, a fork), store the new messages, and open the
exchange record."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from policies.context import StoredTurn
from policies.identity import (
    chain_hashes,
    continues,
    fingerprint,
    rewind,
    split_request,
)
from policies.intent import Intent
from policies.summaries import KIND as HISTORY_SUMMARY
from proxy.core.config import ContextSettings
from proxy.core.errors import Conflict, NotFound, Unprocessable
from proxy.core.requests import parse_timestamp
from proxy.pipeline.artifact_sources import TOOL_WINDOW
from proxy.pipeline.turn import (
    IntentOf,
    Mode,
    TokenCounter,
    Turn,
    classify_into,
    new_conversation_id,
    now,
)
from storage.records import (
    KEPT_ITEMS,
    ConversationRecord,
    MessageRecord,
    NewExchange,
    NewMessage,
)
from storage.repositories.conversations import Conversations
from storage.repositories.erasures import Erasures
from storage.repositories.exchanges import Exchanges
from storage.repositories.summaries import Summaries

# Stored messages read beyond the history window, so a tool call's replies are not cut off.
TAIL_SLACK = 8


def _fork_points(tail: Sequence[MessageRecord]) -> list[str | None]:
    """The chain hashes of the stored messages a client may have gone another way from: from
    the first reply stored in the tail on. What came before the first reply is what the
    conversation's opening request carried, which a thin client may send again and again (a
    greeting, instructions as a first user message, few-shot examples): going back there is
    no fork, and taking it for one would set the whole conversation aside."""
    first = next(
        (i for i, m in enumerate(tail) if m.role == "assistant" and "reply_to" in m.meta),
        len(tail),
    )
    return [m.chain_hash for m in tail[first:]]


def _new_messages(
    messages: list[dict[str, Any]],
    hashes: list[str],
    count: TokenCounter,
    exchange_id: str | None = None,
    intent: Intent | None = None,
) -> list[NewMessage]:
    """Rows for complete messages; `created_at` (imports) is honoured when present; the
    intent goes into the metadata of the last user message."""
    rows = [
        NewMessage(
            role=str(m["role"]),
            content=m.get("content"),
            name=m.get("name"),
            tool_calls=m.get("tool_calls"),
            tool_call_id=m.get("tool_call_id"),
            tokens=count(m),
            chain_hash=h,
            exchange_id=exchange_id,
            created_at=parse_timestamp(m["created_at"], "created_at")
            if "created_at" in m
            else None,
            meta={KEPT_ITEMS: m[KEPT_ITEMS]} if m.get(KEPT_ITEMS) else {},
        )
        for m, h in zip(messages, hashes, strict=True)
    ]
    if intent is not None:
        last_user = next((r for r in reversed(rows) if r.role == "user"), None)
        if last_user is not None:
            last_user.meta = {**last_user.meta, "intent": intent.as_dict()}
    return rows


def opening(
    *,
    request_id: str,
    tenant_id: str,
    user_id: str,
    conversation_id: str | None,
    mode: Mode,
    idempotency_key: str | None,
    model: str,
    upstream: str,
    stream: bool,
    started_at: datetime,
) -> tuple[Turn, NewExchange]:
    """A turn about to begin, and its exchange record as it opens."""
    turn = Turn(request_id, tenant_id, user_id, mode, model)
    exchange = NewExchange(
        request_id=request_id,
        tenant_id=tenant_id,
        user_id=user_id,
        model=model,
        upstream=upstream,
        mode=mode,
        stream=stream,
        started_at=started_at,
        conversation_id=conversation_id,
        idempotency_key=idempotency_key,
    )
    return turn, exchange


def _stored(record: MessageRecord) -> StoredTurn:
    return StoredTurn(record.to_openai(), record.tokens, record.seq, record.pk)


def begin_in(
    turn: Turn,
    exchange: NewExchange,
    conversation_id: str | None,
    messages: list[dict[str, Any]],
    context: ContextSettings,
    count: TokenCounter,
    intent_of: IntentOf | None,
    conn: Connection,
    *,
    forks: bool = True,
) -> None:
    """`begin()`'s work inside the caller's transaction (also the spill's replay). A user
    erased since the request began (its turn waited for the erasure) is not stored again
    from it: Conflict, nothing written. Without `forks` (a replay: the conversation may
    have gone on since), a request that went another way from a stored message does not
    move the conversation's chain back to it."""
    erasures = Erasures(conn)
    erasures.share(turn.tenant_id, turn.user_id)  # never half before an erasure
    if erasures.erased_since(turn.tenant_id, turn.user_id, exchange.started_at):
        raise Conflict(
            "The user was erased while this request was on its way; nothing of it was "
            "stored. Send it again to start afresh.",
            code="user_erased",
        )
    hashes = chain_hashes(messages)  # (the last one identifies the request's messages)
    key = _resolve(
        conn,
        turn,
        conversation_id,
        exchange.idempotency_key,
        messages,
        hashes,
        context,
        count,
        lambda history: classify_into(turn, exchange, intent_of, history + messages),
        forks=forks,
    )
    exchange.idempotency_key = key
    exchange.request_hash = hashes[-1] if key and hashes else None  # (kept with the key)
    exchange.reply_to = turn.reply_to
    exchange.conversation_pk = turn.conversation.pk if turn.conversation else None
    exchange.conversation_id = turn.conversation_id or conversation_id
    Exchanges(conn).start(exchange)
    conv = turn.conversation
    if conv is not None and not turn.opened and turn.mode != "off":
        # (in this transaction: the turn's own tool results, just stored, count)
        turn.holds_artifacts = Conversations(conn).holds_artifacts(
            turn.tenant_id, conv.pk, tools_after=conv.next_seq - TOOL_WINDOW
        )


def peek_in(
    turn: Turn,
    conversation_id: str | None,
    messages: list[dict[str, Any]],
    context: ContextSettings,
    count: TokenCounter,
    intent_of: IntentOf | None,
    conn: Connection,
) -> Turn:
    """`begin_in`'s reading half (memory.peek): `turn` filled in as a turn in mode `read`
    would be, nothing written (no conversation opened, no exchange started)."""
    turn.mode = "read"  # (what `_resolve` writes, mode `read` never does)

    def classify(history: list[dict[str, Any]]) -> Intent | None:
        turn.intent = intent_of(history + messages) if intent_of is not None else None
        return turn.intent

    hashes = chain_hashes(messages)
    _resolve(conn, turn, conversation_id, None, messages, hashes, context, count, classify)
    return turn


def _resolve(
    conn: Connection,
    turn: Turn,
    conversation_id: str | None,
    idempotency_key: str | None,
    messages: list[dict[str, Any]],
    hashes: list[str],
    context: ContextSettings,
    count: TokenCounter,
    classify: Callable[[list[dict[str, Any]]], Intent | None],
    *,
    forks: bool = True,
) -> str | None:
    """Fill `turn` in; return the idempotency key to record on the new exchange. `hashes`:
    the messages' chained hashes; `classify(history)` gives the turn's intent once its
    history is known."""
    prior = None
    if idempotency_key:
        # (Each user's own: another user's request with the same key is not a retry.)
        prior = Exchanges(conn).by_idempotency_key(turn.tenant_id, turn.user_id, idempotency_key)
        asked = hashes[-1] if hashes else None
        if prior is not None and prior.request_hash not in (None, asked):
            # Nor is a request with other messages under the key: taken for a retry, it
            # was answered and its turn never stored. (Exchanges recorded before hashes
            # were kept have none.)
            raise Unprocessable(
                "This Idempotency-Key was already used for a request with other messages.",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
    # A replay's exchange is recorded without the key, which its original holds.
    key = idempotency_key if prior is None else None
    if turn.mode == "off":
        classify([])
        return key
    conversations = Conversations(conn)
    writing = turn.mode == "full"
    conv = None
    if prior is not None and prior.conversation_id:
        # The original's conversation, unless it was deleted since (whatever has its id
        # now is another one): then the retry is stored as a new request would be.
        conv = conversations.still(
            turn.tenant_id,
            prior.conversation_id,
            prior.conversation_pk,
            turn.user_id,
            for_update=writing,
        )
    retry = prior if conv is not None else None
    if conv is None and conversation_id:
        conv = conversations.get(turn.tenant_id, conversation_id, for_update=writing)
        if conv is not None and conv.user_id != turn.user_id:
            raise NotFound(
                f"No conversation {conversation_id!r} for user {turn.user_id!r}.",
                param="X-Memory-Conversation-Id",
                code="conversation_not_found",
            )
    elif conv is None:
        conv = conversations.find_by_chain(turn.tenant_id, turn.user_id, hashes, for_update=writing)
    if conv is None:
        intent = classify([])
        if writing:
            # A new conversation: everything the request carries is new, stored as the
            # conversation opens.
            turn.conversation = conversations.create(
                turn.tenant_id,
                turn.user_id,
                conversation_id or new_conversation_id(),
                now=now(),
                fingerprint=fingerprint(messages),
                messages=_new_messages(messages, hashes, count, turn.request_id, intent),
            )
            turn.opened = turn.store_reply = True
            turn.reply_to = turn.conversation.next_seq - 1
        return key
    turn.conversation = conv
    window = max(context.max_history_messages, context.min_recent_messages) + TAIL_SLACK
    tail: list[MessageRecord] = []
    chain_count, chain_hash = conv.chain_count, conv.chain_hash
    if retry is not None:
        # A replay is answered against the conversation as its original found it: without
        # the original's own messages and reply, and without anything stored after them.
        tail = conversations.tail(turn.tenant_id, conv.pk, window)
        cut = next((i for i, m in enumerate(tail) if m.exchange_id == retry.request_id), len(tail))
        dropped = [m.to_openai() for m in tail[cut:]]
        chain_count, chain_hash = rewind(chain_count, chain_hash, hashes, dropped)
        # What the original stored, and everything after it, is hidden from recall too,
        # however far back it now is.
        turn.visible_before = conversations.first_seq_of_exchange(
            turn.tenant_id, conv.pk, retry.request_id
        )
        tail = tail[:cut]
    elif chain_count and not continues(chain_count, chain_hash, hashes):
        tail = conversations.tail(turn.tenant_id, conv.pk, window)
    split = split_request(
        messages,
        hashes,
        chain_count,
        chain_hash,
        [m.to_openai() for m in tail],
        _fork_points(tail) if retry is None and forks else (),
    )
    if split.fork:
        # The client went another way from a stored message (a regenerated answer, an
        # edited turn): the conversation's chain goes back there, so what the request
        # adds (or the reply, if nothing) is stored once and its next request, resending
        # this branch, continues it; the branch left is kept, `superseded` (in mode read,
        # only hidden from this request's recall).
        base = hashes[split.fork - 1]
        at = next(m.seq for m in tail if m.chain_hash == base)
        if writing:
            conv = conversations.fork(conv, at, split.fork, base, now=now())
            # (A history summary may cover the branch left: made again as needed.)
            Summaries(conn).delete_subjects(
                turn.tenant_id, turn.user_id, [conv.id], kind=HISTORY_SUMMARY
            )
        else:
            conv = replace(conv, chain_count=split.fork, chain_hash=base)
        turn.conversation = conv
        turn.visible_before = at + 1
        if not split.new:
            turn.reply_to = at
    if split.attach_history:
        kept = tail[: len(tail) - split.overlap]
        turn.history = [_stored(m) for m in kept if m.role not in ("system", "developer")]
    new = [] if retry is not None else split.new
    if retry is not None:
        # A retry answers its original's turn: where the original's reply belongs (as it
        # recorded it; else, from before it did, after the messages it stored).
        if retry.reply_to is not None:
            turn.reply_to = retry.reply_to
        elif turn.visible_before is not None and split.new:
            turn.reply_to = turn.visible_before + len(split.new) - 1
    intent = classify([t.message for t in turn.history])
    turn.store_reply = writing and (retry is None or retry.status != "complete")
    if turn.visible_before is None:
        turn.visible_before = conv.next_seq  # this turn's own messages come next
    if writing and new:
        hashes = chain_hashes(new, conv.chain_hash)  # (a fork's: the request's own)
        rows = _new_messages(new, hashes, count, turn.request_id, intent)
        turn.conversation = conversations.append(conv, turn.user_id, rows, now=now())
    if turn.reply_to is None:
        turn.reply_to = turn.conversation.next_seq - 1  # (the turn's last message)
    return key


def import_messages(
    conn: Connection,
    conversation: ConversationRecord,
    messages: list[dict[str, Any]],
    count: TokenCounter,
) -> ConversationRecord:
    """Append messages to a conversation without calling a model (management API).
    `conversation` must have been read `for_update` in this transaction."""
    hashes = chain_hashes(messages, conversation.chain_hash)  # created_at is not hashed
    rows = _new_messages(messages, hashes, count)
    return Conversations(conn).append(conversation, conversation.user_id, rows, now=now())
