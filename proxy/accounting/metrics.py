"""Prometheus metrics, served at `/metrics`.

One registry per app (not the client library's global one), so several apps in one process
(tests, benchmarks) keep their own figures. Labels are bounded: tenants come from config.yaml,
statuses are HTTP codes, and model names, which clients choose, are kept up to `MAX_MODELS`
distinct values per process before further ones are counted as `other`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy.pipeline.turn import Outcome

MAX_MODELS = 100
OTHER_MODEL = "other"
# Without the charset, which the response adds itself.
CONTENT_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")
# Seconds. Chat completions run from a few milliseconds (a cache, a fake) to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The proxy's own share: well under a millisecond to a few when the database is slow.
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "memproxy_chat_requests",
            "Chat completions answered, by tenant, model and HTTP status.",
            ["tenant", "model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "memproxy_chat_latency_seconds",
            "Time from request to the end of the response (streams: the last chunk).",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "memproxy_chat_time_to_first_token_seconds",
            "Streams: time from request to the first chunk from the upstream.",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "memproxy_overhead_seconds",
            "The proxy's own time before forwarding (auth, memory, assembly), per request.",
            ["tenant"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "memproxy_tokens",
            "Tokens of upstream calls, by kind (prompt, completion).",
            ["tenant", "model", "kind"],
            registry=r,
        )
        self.cost = Counter(
            "memproxy_cost_usd",
            "Spend in USD, by part (upstream, memory). Unpriced calls add nothing.",
            ["tenant", "model", "part"],
            registry=r,
        )
        self.unpriced = Counter(
            "memproxy_unpriced_requests",
            "Chat completions whose model has no known price.",
            ["tenant", "model"],
            registry=r,
        )
        self.context_tokens = Counter(
            "memproxy_context_tokens_added",
            "Tokens the proxy added to prompts (history, recall, memories, attachments).",
            ["tenant"],
            registry=r,
        )
        self.in_flight = Gauge(
            "memproxy_chat_in_flight", "Chat completions being answered now.", registry=r
        )
        self.body_disconnects = Counter(
            "memproxy_request_body_disconnects",
            "Requests whose client closed the connection before the whole body arrived (the "
            "access line's status 499, outcome client_disconnected), by tenant (empty: not "
            "authenticated yet).",
            ["tenant"],
            registry=r,
        )
        self.rate_limited = Counter(
            "memproxy_rate_limited_requests",
            "Requests refused by a tenant's limits, by limit.",
            ["tenant", "limit"],
            registry=r,
        )
        self.degraded = Counter(
            "memproxy_memory_degraded_requests",
            "Chat completions answered without memory because storage failed, by reason "
            "(unavailable, timeout, circuit_open: not tried).",
            ["tenant", "reason"],
            registry=r,
        )
        self.storage_circuit_open = Gauge(
            "memproxy_storage_circuit_open",
            "1 while the storage circuit breaker is open or half-open (requests are answered "
            "degraded without trying the database, but for one trial), else 0.",
            registry=r,
        )
        self.not_stored = Counter(
            "memproxy_memory_not_stored_requests",
            "Chat completions of fail-open tenants answered although neither the database nor "
            "the spill could keep their turn (x-memory-stored: false): nothing of them is kept.",
            ["tenant"],
            registry=r,
        )
        self.spill_writable = Gauge(
            "memproxy_spill_writable",
            "0 while the spill file cannot be written (a full or read-only disk: its last "
            "append or /readyz's probe failed), else 1.",
            registry=r,
        )
        self.spill_writable.set(1)
        self.spill_refused = Counter(
            "memproxy_spill_refused_requests",
            "Chat completions refused with 503 because storage failed and the spill was full.",
            ["tenant"],
            registry=r,
        )
        self.spill_bytes = Gauge(
            "memproxy_spill_bytes", "Bytes in the local spill waiting for the database.", registry=r
        )
        self.spill_replayed = Counter(
            "memproxy_spill_replayed_requests",
            "Spilled requests written to the database, by result (replayed, duplicate, erased, "
            "refused, gone, amended, failed).",
            ["result"],
            registry=r,
        )
        self.intents = Counter(
            "memproxy_intents",
            "User turns classified, by label and method (keyword, llm).",
            ["tenant", "label", "method"],
            registry=r,
        )
        self.intent_fallbacks = Counter(
            "memproxy_intent_fallbacks",
            "LLM intent classifications that fell back to keywords, by reason.",
            ["tenant", "reason"],
            registry=r,
        )
        self.jobs = Counter(
            "memproxy_jobs",
            "Background job attempts ended, by kind and outcome (done, retry, dead, dropped).",
            ["kind", "outcome"],
            registry=r,
        )
        self.memory_decisions = Counter(
            "memproxy_memory_decisions",
            "Extracted memory decisions, by action (add, update, delete) and whether applied.",
            ["tenant", "action", "applied"],
            registry=r,
        )
        self.embedding_queries = Counter(
            "memproxy_embedding_queries",
            "Questions embedded for recall, by outcome (ok, timeout, error: full-text only).",
            ["tenant", "outcome"],
            registry=r,
        )
        self.embedded_messages = Counter(
            "memproxy_embedded_messages",
            "Stored messages embedded by the background job.",
            ["tenant"],
            registry=r,
        )
        self.embedded_items = Counter(
            "memproxy_embedded_items",
            "Memories and attachment passages embedded by the background jobs, by kind.",
            ["tenant", "kind"],
            registry=r,
        )
        self.embedding_backlog = Gauge(
            "memproxy_embedding_backlog",
            "Stored messages not embedded yet (found by keywords until they are), per tenant; "
            "read every server.maintenance_seconds.",
            ["tenant"],
            registry=r,
        )
        self.local_embeddings_up = Gauge(
            "memproxy_local_embeddings_up",
            "1 when the local embedding model can be used (its files checked at start-up; it is "
            "loaded by the first embedding); 0 when it could not be checked or loaded (its "
            "tenants recall by keywords alone; the log and /readyz say why) or no tenant uses it.",
            registry=r,
        )
        self.summary_cache = Counter(
            "memproxy_summary_cache",
            "Summary cache lookups, by kind (attachment, history) and outcome (hit, miss).",
            ["tenant", "kind", "outcome"],
            registry=r,
        )
        self.artifacts = Counter(
            "memproxy_artifacts",
            "Attachments and tool results considered, by strategy (include_full, "
            "relevant_passages, summarize, exclude) and planner (rule, llm).",
            ["tenant", "strategy", "planner"],
            registry=r,
        )
        self._models: set[str] = set()

    def model(self, name: str) -> str:
        """`name` as a label value, or `other` once MAX_MODELS distinct names were seen."""
        if name in self._models:
            return name
        if len(self._models) < MAX_MODELS:
            self._models.add(name)
            return name
        return OTHER_MODEL

    def count_request(self, tenant: str, model: str, status: int) -> None:
        """One chat completion answered with `status` (`model` already a label value)."""
        self.requests.labels(tenant, model, str(status)).inc()

    def observe_chat(self, tenant: str, model: str, outcome: Outcome) -> None:
        """Count one settled chat completion (`model` already a label value)."""
        self.count_request(tenant, model, outcome.http_status or 500)
        if outcome.latency_ms is not None:
            self.latency.labels(tenant, model).observe(outcome.latency_ms / 1000)
        if outcome.ttft_ms is not None:
            self.ttft.labels(tenant, model).observe(outcome.ttft_ms / 1000)
        if outcome.overhead_ms is not None:
            self.overhead.labels(tenant).observe(outcome.overhead_ms / 1000)
        context_tokens = outcome.attached.get("context_tokens") or 0
        if context_tokens:
            self.context_tokens.labels(tenant).inc(context_tokens)
        bill = outcome.bill
        if bill is None:
            return
        if bill.usage.prompt_tokens:
            self.tokens.labels(tenant, model, "prompt").inc(bill.usage.prompt_tokens)
        if bill.usage.completion_tokens:
            self.tokens.labels(tenant, model, "completion").inc(bill.usage.completion_tokens)
        if bill.upstream_usd is None:
            self.unpriced.labels(tenant, model).inc()
        elif bill.upstream_usd:
            self.cost.labels(tenant, model, "upstream").inc(float(bill.upstream_usd))
        # (The proxy's own calls are counted as they are charged: proxy/accounting/charges.py.)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class InFlight:
    """One chat completion counted in `memproxy_chat_in_flight` until `end()` (idempotent):
    at the handler's return, or when a relayed stream ends."""

    gauge: Gauge
    ended: bool = field(default=False)

    def __post_init__(self) -> None:
        self.gauge.inc()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.gauge.dec()
