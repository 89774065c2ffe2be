"""Assemble: what the proxy attaches to the turn within the tenant's token budget (DESIGN.md,
step 4). Attachments first (up to their share, never out of the newest messages that are kept
whatever the budget); then recall's share comes off the top of what they leave; history is
chosen for what recall leaves, and recall leaves out what history attaches. The rules are
policies/context.py's; this module reads what they need."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from policies.context import (
    Assembly,
    Budget,
    Recalled,
    StoredTurn,
    assemble,
    history_for,
    mandatory_tokens,
)
from policies.public_ids import PublicIds
from policies.tokens import count_message, count_messages, upper_bound_tokens
from proxy.background.embeddings import Vector
from proxy.pipeline.artifacts import NOTHING_ATTACHED, Attached
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.kept import Kept, kept_for, remember
from proxy.pipeline.load import Loaded
from proxy.pipeline.recall import NOTHING, Recall
from proxy.pipeline.recall_turn import last_user_text, recall_for, semantic_query
from proxy.pipeline.summaries import summarize_history
from proxy.pipeline.turn import Turn, now
from storage.errors import StorageError
from storage.repositories.memories import Memories

log = structlog.get_logger("memproxy.pipeline")


@dataclass(slots=True)
class Assembled:
    """What the proxy attached: the assembly sent (None: nothing), the exchange record's
    `attached`, and the counts for the headers."""

    assembly: Assembly | None
    record: dict[str, Any] = field(default_factory=dict)
    recalled: int = 0
    attachments: int = 0
    # Parts of memory were skipped (storage failed or was too slow) after the turn was stored.
    partial: bool = False


async def assemble_turn(
    req: TurnRequest,
    loaded: Loaded,
    *,
    use_memory: bool,
    by_policy: dict[str, Any] | None,
    question: asyncio.Task[Vector | None] | None,
    paid: Callable[[Attached], None] = lambda _: None,
) -> Assembled:
    """`paid` hears of the attachments' model calls (planner, summaries) as soon as they are
    made: they are charged even if the turn goes no further."""
    turn, tenant, messages = loaded.turn, req.principal.tenant, req.turn.messages
    if turn is not None and turn.pending is not None and not loaded.inline:
        # Mode off, with no documents of its own: nothing to attach or to work out.
        return Assembled(None, attached_record(req.services.ids, None, NOTHING, by_policy))
    ctx = tenant.context
    window = req.services.context_window(req.turn.model)
    budget = Budget(
        token_budget=ctx.token_budget,
        max_history_messages=ctx.max_history_messages,
        min_recent_messages=ctx.min_recent_messages,
        context_window=window,
        reserve_tokens=req.turn.reserve_tokens,
    )
    attach = turn is not None and use_memory and req.turn.attach_history
    history = considered = turn.history if turn is not None and attach else []
    trace = req.trace
    with trace.timed("attachments"):
        attached = await _attach(req, loaded, history, budget, use_memory, question)
    paid(attached)
    left = ctx.token_budget - attached.tokens
    recall_budget = left
    if history:
        recall_budget = min(
            int(ctx.token_budget * ctx.recall_share),
            left - mandatory_tokens(messages, history, budget),
        )
        history = history_for(
            messages, history, replace(budget, token_budget=left - max(0, recall_budget))
        )
    trace.budgeted(
        token_budget=ctx.token_budget,
        attachments=int(ctx.token_budget * tenant.attachments.share),
        recall=max(0, recall_budget),
        context_window=window,
        reserve_tokens=budget.reserve_tokens,
    )
    # Stored turns older than that history: their summary, out of the history's share.
    with trace.timed("summary"):
        summarized = await summarize_history(
            req.services,
            tenant,
            turn,
            messages,
            history,
            replace(budget, token_budget=left - max(0, recall_budget)),
            count_use=not req.dry_run,
        )
    history = summarized.history
    kept = kept_for(req, turn) if use_memory else None
    if kept is not None:
        recall_budget = kept.budget(recall_budget, ctx.token_budget)
    with trace.timed("recall"):
        recalled = (
            await recall_for(
                req, turn, history, recall_budget, question, shown=kept.turns if kept else ()
            )
            if use_memory
            else None
        )
    found = recalled.found if recalled else NOTHING
    partial = _note_skipped(
        req,
        loaded,
        attachments=attached.storage_failed,
        summary=(summarized.record or {}).get("reason") == "unavailable",
        recall=bool(recalled and recalled.failed),
    )
    section = _with_attachments(found.section, attached)
    sections = [(i, Recalled(s.text, s.tokens)) for i, s in kept.sections] if kept else []
    assembly = None
    if history or section is not None or sections:
        client_tokens = None
        prompt = req.turn.prompt  # (all the upstream gets of the client's, in its order)
        if window is not None:
            client_tokens = upper_bound_tokens(prompt)
            if client_tokens + ctx.token_budget + budget.reserve_tokens > window:
                client_tokens = await asyncio.to_thread(count_messages, prompt, req.turn.model)
        assembly = assemble(
            prompt,
            history,
            budget,
            client_tokens,
            recalled=section,
            placement=ctx.placement,
            summary=summarized.section,
            kept=sections,
        )
    sent = assembly is not None and assembly.recalled  # (not dropped for the window)
    if kept is not None:
        _keep_shown(req, kept, assembly, section if sent else None, found)
    if trace.on:
        _trace_window(req, assembly, section is not None, summarized.section is not None)
        trace.assembled(
            assembly,
            considered=considered,
            offered=history,
            recall=found,
            recall_text=section.text if section is not None else None,
            summary=summarized,
            attached=attached,
            placement=ctx.placement,
        )
    shown = found if sent else NOTHING
    if shown.memory_pks and turn is not None and not req.dry_run:
        _count_memory_use(req, turn, shown.memory_pks)
    record = attached_record(
        req.services.ids, assembly, shown, by_policy, recalled.ms if recalled else None
    )
    if recalled and recalled.failed:
        record["recall_storage"] = "unavailable"
    if (summary := summarized.recorded(assembly)) is not None:
        record["summary"] = summary
    if attached.items or attached.storage_failed:
        record["attachments"] = attached.record(sent=sent)
    return Assembled(
        assembly,
        record,
        recalled=shown.messages,
        attachments=attached.count if sent else 0,
        partial=partial,
    )


def _keep_shown(
    req: TurnRequest, kept: Kept, assembly: Assembly | None, section: Recalled | None, found: Recall
) -> None:
    """The conversation's sections after this turn: the kept ones the assembly holds (not
    dropped for the context window) and this turn's own."""
    messages = assembly.messages if assembly is not None else []
    held = {m["content"] for m in messages if isinstance(m.get("content"), str)}
    kept.sections = [(i, s) for i, s in kept.sections if s.text in held]
    turns = [t.text for e in found.excerpts for t in e.turns]
    remember(req, kept, section.text if section else None, section.tokens if section else 0, turns)


def attached_record(
    ids: PublicIds,
    assembly: Assembly | None,
    recalled: Recall,
    by_policy: dict[str, Any] | None,
    recall_ms: float | None = None,
) -> dict[str, Any]:
    """What the exchange record says was attached (`attached`)."""
    record = {
        "history_messages": assembly.history_messages if assembly else 0,
        "context_tokens": assembly.context_tokens if assembly else 0,
        "dropped_for_window": assembly.dropped_for_window if assembly else 0,
        "recalled": recalled.record(ids),
        "recall_ms": recall_ms,
    }
    if by_policy is not None:
        record["intent_policy"] = by_policy
    return record


def _trace_window(
    req: TurnRequest, assembly: Assembly | None, recalled: bool, summarized: bool
) -> None:
    """What the model's context window left out, into the trace."""
    if assembly is None:
        return
    why = "the prompt would not fit the model's context window"
    if recalled and not assembly.recalled:
        req.trace.degrade("recall", f"{why}: the recall section was left out")
    if summarized and not assembly.summarized:
        req.trace.degrade("summary", f"{why}: the history summary was left out")
    if assembly.dropped_for_window:
        req.trace.degrade("history", f"{why}: {assembly.dropped_for_window} messages left out")


def _note_skipped(req: TurnRequest, loaded: Loaded, **failed: bool) -> bool:
    """Parts of memory storage failed (or was too slow) for after the turn was stored: the
    request goes on without them, answered `degraded` and counted (reason `partial`)."""
    skipped = [part for part, yes in failed.items() if yes]
    if not skipped:
        return False
    for part in skipped:
        req.trace.degrade(part, "storage failed or was too slow: left out")
    if not loaded.degraded:  # (a turn that was not stored is counted already, as such)
        req.services.metrics.degraded.labels(req.tenant_id, "partial").inc()
    log.warning("memory_partly_skipped", request_id=req.request_id, parts=skipped)
    return True


async def _attach(
    req: TurnRequest,
    loaded: Loaded,
    history: list[StoredTurn],
    budget: Budget,
    use_memory: bool,
    question: asyncio.Task[Vector | None] | None,
) -> Attached:
    """The conversation's attachments, the request's own (inline, or stored ones it names) and
    earlier tool results, fitted into the attachments' share of the budget. The request's
    inline documents are stored with the conversation first in mode `full`. The request's own
    go in every mode; the conversation's not in mode `off` nor when an intent policy says
    `memory: false`. Stored passages are found by the question's words, and by its vector
    (recall's, `question`) when it was embedded."""
    turn, tenant, inline, messages = (
        loaded.turn,
        req.principal.tenant,
        loaded.inline,
        req.turn.messages,
    )
    # (No turn: storage is away. The request's own documents go in all the same; the spill
    # keeps them with the turn, stored with it when the database is back.)
    keep = conversation = None
    if turn is not None and not req.identity.shared_conversation:
        keep = turn.conversation if turn.mode == "full" and inline else None
        conversation = turn.conversation if turn.mode != "off" and use_memory else None
    if not inline and (
        turn is None or conversation is None or turn.opened or turn.holds_artifacts is False
    ):
        # (a conversation this turn opened holds none yet; nor one `begin()` found without)
        return NOTHING_ATTACHED
    ctx = tenant.context
    room = int(ctx.token_budget * tenant.attachments.share)
    if history:
        room = min(room, ctx.token_budget - mandatory_tokens(messages, history, budget))
    # Tool results the prompt may hold: the client's, and those of the most history could
    # attach (the stored tail read covers a little more than the history window).
    at_most = history_for(messages, history, budget)
    in_prompt = {
        str(m.get("tool_call_id"))
        for m in [*messages, *(h.message for h in at_most)]
        if m.get("role") == "tool"
    }
    stored = conversation is not None or any(i.attachment_id for i in inline)
    semantic = await semantic_query(req, question) if stored else None
    try:  # (what the database fails to do in time is left out inside, and recorded)
        return await req.services.artifacts.attach(
            tenant,
            request_id=req.request_id,
            tenant_id=req.tenant_id,
            user_id=req.user_id,
            conversation_pk=conversation.pk if conversation else None,
            conversation_id=conversation.id if conversation else None,
            conversation_end=conversation.next_seq if conversation else 0,
            inline=inline,
            store_in=keep.pk if keep is not None else None,
            in_prompt_calls=in_prompt,
            # (History held elsewhere, by the upstream or a chain sent whole, holds its tool
            # results too: attaching them again would repeat them.)
            tool_results=req.turn.attach_history,
            question=last_user_text(messages),
            budget=room,
            started_at=req.started_at,
            storage_away=turn is None,
            semantic=semantic,
            model_calls=not req.dry_run,
        )
    except Exception:  # a bug here must not fail the turn: logged, the request goes on
        log.exception("attachments_error", request_id=req.request_id)
        return NOTHING_ATTACHED


def _count_memory_use(req: TurnRequest, turn: Turn, pks: list[int]) -> None:
    """Memories attached to the turn: their access counts, off the request path (a management
    call waits for it)."""
    services = req.services

    async def write() -> None:
        try:
            await services.db.write(lambda conn: Memories(conn).used(turn.tenant_id, pks, now()))
        except StorageError as exc:
            log.warning("memory_use_not_counted", request_id=req.request_id, error=str(exc))

    services.memory.track(turn, services.spawn(write()), metadata=True)


def _with_attachments(recalled: Recalled | None, attached: Attached) -> Recalled | None:
    """One context section: recall's (memories, excerpts), then the attachments'."""
    if not attached.text:
        return recalled
    if recalled is None:
        return Recalled(attached.text, attached.tokens)
    text = recalled.text + "\n\n" + attached.text  # (one message: its overhead counts once)
    return Recalled(text, count_message({"role": "system", "content": text}))
