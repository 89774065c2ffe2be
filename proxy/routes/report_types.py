"""The management API's reports, as documented in the OpenAPI document: an exchange record,
usage, limits and health (the other response and request types: api_types.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from proxy.routes.api_types import Timestamp


class ExchangeUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int | None
    total_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None
    estimated: bool
    reported: dict[str, Any] | None


class ExchangeCost(Struct, kw_only=True):
    priced: bool | None
    usd: float | None
    upstream_usd: float | None
    memory_usd: float | None
    parts: Any


class ExchangeTimings(Struct, kw_only=True):
    latency_ms: float | None
    ttft_ms: float | None
    upstream_ms: float | None
    overhead_ms: float | None


class Exchange(Struct, kw_only=True):
    id: str
    object: Literal["memory.exchange"]
    status: Annotated[str, Meta(description="in_progress, then ok, incomplete or error.")]
    final: bool
    http_status: int | None
    user: str
    conversation_id: str | None
    model: str | None
    upstream: str | None
    mode: str
    stream: bool
    intent: Annotated[str | None, Meta(description="The turn's intent label.")]
    created_at: Timestamp
    finished_at: Timestamp | None
    attached: dict[str, Any] | None
    usage: ExchangeUsage | None
    cost: ExchangeCost
    timings: ExchangeTimings
    error: Any


class UsageTotals(Struct, kw_only=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost_usd: float | None
    cost_upstream_usd: float | None
    cost_memory_usd: float | None
    unpriced_requests: int


class UsageReport(Struct, kw_only=True, rename={"from_": "from"}):
    object: Literal["memory.usage"]
    from_: Annotated[str, Meta(description="ISO 8601.")]
    to: str
    group_by: Literal["model", "user", "day", "intent"] | None
    user: str | None
    data: Annotated[
        list[dict[str, Any]],
        Meta(
            description="One entry per group: the group's key under `group_by`'s name and totals."
        ),
    ]
    total: UsageTotals


class LimitUsage(Struct, kw_only=True):
    limit: float
    used: float
    remaining: float
    window: str
    resets_at: Timestamp


class Limits(Struct, kw_only=True):
    object: Literal["memory.limits"]
    limits: dict[str, float | None]
    usage: dict[str, LimitUsage]
    synced_at: float | None
    sync_interval_seconds: float


class Health(Struct, kw_only=True):
    status: str
    database: str | None = None
    storage_circuit: str | None = None
    # The spill: "ok", or "unwritable: <why>" (a full or read-only disk; still ready: fail-open
    # tenants are answered, their turns not kept when the database fails too).
    spill: str | None = None
    # The local embedding model: "ok", or "unavailable: <why>" (recall by keywords alone; still
    # ready). Absent when no tenant uses it.
    embeddings: str | None = None
