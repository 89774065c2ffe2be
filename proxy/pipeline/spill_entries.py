"""What goes into the spill (proxy/durability/spill.py) for one request, and the entries
grouped back by request for replay (proxy/pipeline/replay.py).

A request's entries: a turn (what `begin()` was given), its outcome (what `finish()` was
given), or a whole mode-off record, and what amends its record after it: the costs of the
proxy's own calls (charges) and the LLM's intent. Dates are written as ISO strings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proxy.core.requests import Inline
from proxy.durability.spill import Spilled
from proxy.pipeline.turn import Mode, Outcome, Turn
from storage.records import ResponseRecord

DATE_KEYS = ("started_at", "finished_at")


def dates_out(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.isoformat() if k in DATE_KEYS and isinstance(v, datetime) else v
        for k, v in values.items()
    }


def dates_in(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: datetime.fromisoformat(v) if k in DATE_KEYS and isinstance(v, str) else v
        for k, v in values.items()
    }


def spilled_turn(
    *,
    request_id: str,
    tenant_id: str,
    user_id: str,
    started_at: datetime,
    mode: Mode,
    model: str,
    conversation_id: str | None,
    idempotency_key: str | None,
    messages: list[dict[str, Any]],
    upstream: str,
    stream: bool,
    documents: Sequence[Inline] = (),
) -> Spilled:
    """A turn `begin()` could not store: what it was given, and the request's inline
    documents (`attachments` with content), stored with its conversation in mode `full`."""
    data: dict[str, Any] = {
        "mode": mode,
        "model": model,
        "conversation_id": conversation_id,
        "idempotency_key": idempotency_key,
        "messages": messages,
        "upstream": upstream,
        "stream": stream,
    }
    if documents and mode == "full":
        data["documents"] = [
            {"content": d.content, "title": d.title, "source": d.source} for d in documents
        ]
    return Spilled("turn", tenant_id, user_id, request_id, started_at, data)


def spilled_outcome(
    tenant_id: str,
    user_id: str,
    request_id: str,
    at: datetime,
    outcome: Outcome,
    *,
    turn: Turn | None,
) -> Spilled:
    """An outcome `finish()` could not store. `turn`, when it is in the database (its
    `finish()` failed): what `finish()` would have done with it goes along."""
    data: dict[str, Any] = {
        "status": outcome.status,
        "reply": outcome.reply,
        "fields": dates_out(outcome.fields()),
    }
    if outcome.keep is not None:  # (the protocol's object for the reply, kept with it)
        kept = dataclasses.asdict(outcome.keep)
        data["keep"] = {**kept, "created_at": outcome.keep.created_at.isoformat()}
    if turn is not None:
        data["turn"] = {
            "store_reply": turn.store_reply,
            "extract": turn.extract,
            "embed": turn.embed,
            "summarize_through": turn.summarize_through,
        }
    return Spilled("outcome", tenant_id, user_id, request_id, at, data)


def kept_of(data: dict[str, Any]) -> ResponseRecord | None:
    """The record a spilled outcome keeps with its reply (see `spilled_outcome`), or None."""
    kept = data.get("keep")
    if not isinstance(kept, dict):
        return None
    return ResponseRecord(**{**kept, "created_at": datetime.fromisoformat(kept["created_at"])})


def spilled_charge(
    tenant_id: str, user_id: str, request_id: str, at: datetime, part: dict[str, Any]
) -> Spilled:
    """A cost part of the proxy's own model call (`MemoryCharges.priced`) that its exchange
    record could not take yet."""
    return Spilled("charge", tenant_id, user_id, request_id, at, {"part": part})


def spilled_intent(
    tenant_id: str, user_id: str, request_id: str, at: datetime, detail: dict[str, Any]
) -> Spilled:
    """The LLM's intent for a request (`Intent.as_dict()`) that its exchange record could not
    take yet."""
    return Spilled("intent", tenant_id, user_id, request_id, at, {"intent": detail})


def spilled_record(row: dict[str, Any]) -> Spilled:
    """A whole mode-off exchange record whose batch could not be written."""
    tenant_id, user_id, request_id = row["tenant_id"], row["user_id"], row["request_id"]
    return Spilled("record", tenant_id, user_id, request_id, row["started_at"], dates_out(row))


@dataclass(slots=True)
class SpilledRequest:
    """One request's entries."""

    first: Spilled
    turn: Spilled | None = None
    outcome: Spilled | None = None
    record: Spilled | None = None
    intent: Spilled | None = None
    charges: list[Spilled] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.first.tenant_id, self.first.request_id)

    def entries(self) -> list[Spilled]:
        entries = (self.turn, self.outcome, self.record, self.intent)
        return [e for e in entries if e is not None] + self.charges


def grouped(entries: list[Spilled]) -> list[SpilledRequest]:
    """Entries by request, in the order the requests first appear (so a conversation's turns
    are replayed in their order)."""
    requests: dict[tuple[str, str], SpilledRequest] = {}
    for entry in entries:
        request = requests.setdefault((entry.tenant_id, entry.request_id), SpilledRequest(entry))
        if entry.kind == "charge":
            request.charges.append(entry)
        else:
            setattr(request, entry.kind, entry)
    return list(requests.values())
