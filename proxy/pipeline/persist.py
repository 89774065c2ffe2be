"""Persist: the turn's outcome stored (the reply, usage, cost, intent and context figures),
or kept in the spill when storage cannot take it. Never raised into the response."""

from __future__ import annotations

from collections.abc import Awaitable

import structlog

from proxy.core.access import RequestInfo
from proxy.durability.spill import Spilled
from proxy.pipeline.spill_entries import spilled_outcome
from proxy.pipeline.turn import Outcome, Turn, now
from proxy.state import AppState
from storage.errors import StorageError

log = structlog.get_logger("memproxy.pipeline")
# How long a reply written after its response waits for that response to end (it normally
# ends a moment later; past this the write goes ahead).
RESPONSE_END_WAIT = 1.0


async def record(
    services: AppState, turn: Turn, outcome: Outcome, info: RequestInfo | None = None
) -> None:
    """Store the outcome; a storage failure here is logged, never raised into the response.

    A turn that stored nothing beforehand (mode off) is recorded later, in a batch; a reply may
    be written just after the response (ConversationMemory.reply_after_response), with the next
    request of the same user waiting for it: once the response has gone out (`info`), since the
    write's work in its thread would hold the interpreter while the response's last bytes wait.
    The client waits only for what it must."""
    if turn.pending is not None:
        services.deferred.add(turn, outcome)
    elif services.memory.reply_after_response:
        after = info.ended(RESPONSE_END_WAIT) if info is not None else None
        services.memory.track(turn, services.spawn(_record(services, turn, outcome, after)))
    else:
        await _record(services, turn, outcome)


async def _record(
    services: AppState, turn: Turn, outcome: Outcome, after: Awaitable[None] | None = None
) -> None:
    if after is not None:
        await after
    try:
        await services.memory.finish(turn, outcome)
    except StorageError as exc:
        # The reply and the record wait in the spill for the database.
        log.warning("exchange_spilled", request_id=turn.request_id, error=str(exc))
        head = (turn.tenant_id, turn.user_id, turn.request_id, now())
        await spill_outcome(services, spilled_outcome(*head, outcome, turn=turn))
        return
    if turn.extract or turn.embed or turn.summarize_through is not None:
        services.jobs.wake()  # its extraction / embedding / summary job was queued with the reply


async def spill_outcome(services: AppState, entry: Spilled) -> None:
    """Keep an outcome storage could not take (never refused: its request was answered)."""
    try:
        await services.spill.add(entry, bounded=False)
    except OSError as exc:
        log.error("exchange_not_recorded", request_id=entry.request_id, error=str(exc))
