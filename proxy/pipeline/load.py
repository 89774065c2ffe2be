"""Load: store the turn (per the memory mode) and read what it continues (DESIGN.md, steps 3
and 7): the stored tail of its conversation, in one transaction. When storage fails or is too
slow, the turn goes on without memory and waits in the spill (or is refused, fail-closed)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import structlog

from proxy.core.errors import ServiceUnavailable
from proxy.core.requests import Inline
from proxy.durability.spill import SpillFull
from proxy.durability.storage_circuit import StorageCircuitOpen
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.spill_entries import spilled_turn
from proxy.pipeline.turn import ANONYMOUS, Turn
from storage.errors import StorageError, StorageTimeout, StorageUnavailable

log = structlog.get_logger("memproxy.pipeline")


@dataclass(slots=True)
class Loaded:
    """The turn as stored (None: storage was away), and the request's documents."""

    turn: Turn | None
    inline: list[Inline]
    # The turn went to the spill: it is stored once the database is back.
    spilled: bool = False
    degraded: bool = False
    # Neither the database nor the spill could keep the turn (fail-open): answered, forgotten.
    unstored: bool = False


async def load(req: TurnRequest, inline: list[Inline]) -> Loaded:
    services, identity = req.services, req.identity
    if req.dry_run:
        return await _peek(req, inline)
    refs = [i.attachment_id for i in inline if i.attachment_id is not None]
    if refs:  # an unknown id is a 400 before anything is stored
        try:
            await services.memory.in_time(
                services.artifacts.check_refs(req.tenant_id, identity.user_id, refs)
            )
        except StorageError:  # unchecked ids are not used; begin() degrades or refuses
            inline = [i for i in inline if i.attachment_id is None]
    try:
        await _after_spilled_turns(req)
        turn = await services.memory.begin(
            intent_of=partial(services.intents.keyword, req.tenant_id),
            request_id=req.request_id,
            tenant_id=req.tenant_id,
            user_id=identity.user_id,
            conversation_id=identity.conversation_id,
            mode=identity.mode,
            idempotency_key=identity.idempotency_key,
            messages=req.turn.messages,
            model=req.turn.model,
            upstream=req.upstream.name,
            stream=req.turn.stream,
            context=req.principal.tenant.context,
        )
        turn.embed = services.embeddings.wanted(req.tenant_id, turn.user_id, turn.mode, ANONYMOUS)
        turn.extract = services.extractor.wanted(req.tenant_id, turn.user_id, turn.mode)
    except StorageError as exc:
        spilled = await _degrade(req, inline, exc)
        return Loaded(None, inline, spilled=spilled, degraded=True, unstored=not spilled)
    return Loaded(turn, inline)


async def _peek(req: TurnRequest, inline: list[Inline]) -> Loaded:
    """The turn as `begin()` would find it, stored nowhere; without storage, no memory (and
    nothing for the spill)."""
    services, identity = req.services, req.identity
    try:
        turn = await services.memory.peek(
            intent_of=partial(services.intents.keyword, req.tenant_id),
            tenant_id=req.tenant_id,
            user_id=identity.user_id,
            conversation_id=identity.conversation_id,
            mode=identity.mode,
            messages=req.turn.messages,
            model=req.turn.model,
            upstream=req.upstream.name,
            context=req.principal.tenant.context,
        )
    except StorageError:
        return Loaded(None, inline, degraded=True)
    return Loaded(turn, inline)


async def _after_spilled_turns(req: TurnRequest) -> None:
    """Earlier turns of this user waiting in the spill go into the database first (or this
    one waits in the spill after them), so they keep their order and conversation.

    The reply of the user's previous turn may still be on its way (written after the
    response, `reply_after_response`), and may yet go to the spill: that is waited for first,
    whether this turn then goes to the database or to the spill. Otherwise a thin client's
    turn stored before that reply would follow an unanswered turn, and one with the same text
    (a "yes" twice) would be taken for that turn resent."""
    services, tenant_id, user_id = req.services, req.tenant_id, req.user_id
    replayer = services.replayer
    if replayer is None or req.identity.mode == "off":
        return
    # (At most that write's storage timeout, plus appending to the spill when it fails; this
    # turn's own timeout starts after.)
    await services.memory.settle(tenant_id, user_id)
    if not services.spill.holds(tenant_id, user_id):
        return

    async def caught_up() -> None:
        if not await replayer.catch_up(tenant_id, user_id):
            raise StorageUnavailable("earlier turns of this user still wait in the spill")

    # Storage on the request path like the turn's own: bounded, and not tried at all while
    # the storage circuit is open.
    await services.memory.in_time(caught_up())


async def _degrade(req: TurnRequest, inline: list[Inline], error: StorageError) -> bool:
    """Storage failed (or was too slow for) the turn: answer without memory and keep the turn
    in the spill, to be stored when the database is back (True); or refuse with 503 when the
    tenant says `fail_open: false` or the spill is full (the bound the operator chose).

    When the spill cannot be written either (a full or read-only disk), a fail-open tenant's
    turn is still answered, and nothing of it is kept (False): fail-open promises that memory's
    storage failing does not take the chat down. The response says so (`x-memory-stored:
    false`), the log (`memory_not_stored`) and the metrics too, and /readyz reports the spill
    (docs/operations/database-away.md)."""
    tenant_id, services, identity = req.tenant_id, req.services, req.identity
    reason = "timeout" if isinstance(error, StorageTimeout) else "unavailable"
    if isinstance(error, StorageCircuitOpen):
        reason = "circuit_open"  # (not tried: the circuit logs its opening, not each request)
    req.trace.degrade("storage", f"{reason}: the turn went on without memory ({error})")
    if not req.principal.tenant.fail_open:
        raise ServiceUnavailable(
            "Memory storage is unavailable. Try again later.",
            code="memory_unavailable",
            headers={"retry-after": "5"},
        ) from error
    entry = spilled_turn(
        documents=[]
        if identity.shared_conversation
        else [i for i in inline if i.content is not None],
        request_id=req.request_id,
        tenant_id=tenant_id,
        user_id=identity.user_id,
        started_at=req.started_at,
        mode=identity.mode,
        model=req.turn.model,
        conversation_id=identity.conversation_id,
        idempotency_key=identity.idempotency_key,
        messages=req.turn.messages,
        upstream=req.upstream.name,
        stream=req.turn.stream,
    )
    try:
        await services.spill.add(entry, bounded=True)
    except OSError as exc:
        services.metrics.degraded.labels(tenant_id, reason).inc()
        services.metrics.not_stored.labels(tenant_id).inc()
        log.error(
            "memory_not_stored",
            request_id=req.request_id,
            reason=reason,
            error=str(error),
            spill_error=str(exc),
        )
        return False
    except SpillFull as exc:
        services.metrics.spill_refused.labels(tenant_id).inc()
        log.error("memory_spill_refused", request_id=req.request_id, reason=reason, error=str(exc))
        raise ServiceUnavailable(
            "Memory storage is unavailable and the proxy cannot keep the turn until it is "
            "back (its spill is full). Try again later.",
            code="memory_spill_full",
            headers={"retry-after": "5"},
        ) from error
    services.metrics.degraded.labels(tenant_id, reason).inc()
    if reason != "circuit_open":
        log.warning("memory_degraded", request_id=req.request_id, reason=reason, error=str(error))
    return True
