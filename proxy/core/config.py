"""The configuration's models: one immutable, validated `Config` for the whole process.

Each key's default and its limits live here; `proxy.core.config_file` reads config.yaml into
these models. Anything wrong raises `ConfigError` with a single line that names the offending
key, e.g. ``tenants.acme.context.token_budget: Input should be a valid integer``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from policies.intent_labels import DEFAULT_LABELS, OTHER
from policies.trace import TraceLevel
from proxy.core.config_identity import ApiKeyConfig as ApiKeyConfig
from proxy.core.config_identity import IdentityConfig as IdentityConfig  # (one of the models)
from proxy.core.config_identity import Scope as Scope
from proxy.core.config_server import DatabaseConfig as DatabaseConfig
from proxy.core.config_server import ServerConfig as ServerConfig

ResponsesMode = Literal["native", "translate"]
ALL_SCOPES: frozenset[Scope] = frozenset({"chat", "manage"})


def _yaml_off(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` as false; take it to mean the string "off"."""
    return "off" if value is False else value


Off = BeforeValidator(_yaml_off)


class ConfigError(Exception):
    """The configuration cannot be used; the message names the key and the problem."""


class _Strict(BaseModel):  # (as proxy.core.config_identity's)
    model_config = ConfigDict(extra="forbid", frozen=True)


class TimeoutConfig(_Strict):
    connect: float = Field(5.0, gt=0)
    read: float = Field(600.0, gt=0)


class RetryConfig(_Strict):
    # Further tries of a chat completion that failed before anything reached the client (no
    # connection, a timeout before the response head, 408/409/429/5xx). Off by default: the
    # OpenAI SDKs retry on their own, and retries in both places multiply.
    attempts: int = Field(0, ge=0, le=10)
    backoff_ms: float = Field(250, gt=0)  # doubling, with jitter
    max_backoff_ms: float = Field(4000, gt=0)  # a longer retry-after goes back to the client


class BreakerConfig(_Strict):
    # After this many failures in a row (no connection, timeouts, 5xx) calls fail at once
    # with 503 for `open_seconds`, then one trial call decides. null (the default): no
    # breaker, every call goes to the upstream and its errors pass through.
    failures: int | None = Field(None, ge=1)
    open_seconds: float = Field(30.0, gt=0)


class UpstreamConfig(_Strict):
    kind: Literal["echo", "openai", "litellm", "anthropic"]
    base_url: str | None = None
    api_key: str | None = None
    timeout: TimeoutConfig = TimeoutConfig()
    retries: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    # Served by GET /v1/models when the upstream cannot list its own (litellm, echo).
    models: list[str] | None = None
    # Ask for `stream_options.include_usage` on streams, to know what they cost. Turn off
    # only for an OpenAI-compatible server that rejects the option; streams then get counted
    # with tiktoken (marked estimated).
    stream_usage: bool = True
    # How `/v1/responses` is served: `native` forwards it to the upstream's own Responses API
    # (which keeps the responses); `translate` maps it to chat completions, and memproxy keeps
    # the responses itself (GET/DELETE /v1/responses/{id}, input_items, previous_response_id).
    # null: native for `openai`, translate for `litellm` and `echo` (`responses_mode()`).
    responses: ResponsesMode | None = None

    def responses_mode(self) -> ResponsesMode:
        """How this upstream serves the Responses API, its default resolved."""
        if self.responses is not None:
            return self.responses
        return "native" if self.kind == "openai" else "translate"

    @model_validator(mode="after")
    def _native_needs_openai(self) -> UpstreamConfig:
        if self.responses == "native" and self.kind != "openai":
            raise ValueError(
                f"responses: native needs an openai-kind upstream ({self.kind} has no "
                "Responses API of its own); use translate"
            )
        return self

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        """An http(s) URL with a host (without its last slash): anything else started fine and
        then answered every request 502 `unreachable`."""
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an http:// or https:// URL with a host is needed")
        return value.rstrip("/")


class PriceConfig(_Strict):
    input_per_mtok: float = Field(ge=0)
    output_per_mtok: float = Field(ge=0)
    cached_input_per_mtok: float | None = Field(None, ge=0)


class ContextSettings(_Strict):
    token_budget: int = Field(2000, ge=0)
    max_history_messages: int = Field(20, ge=0)
    min_recent_messages: int = Field(6, ge=0)
    placement: Literal["before_last_user", "after_system"] = "before_last_user"
    # A stabler prompt prefix for clients that resend their history, for less fresh recall:
    # what each turn was shown stays where it was on the conversation's later turns, and a
    # new turn adds only what is not shown yet, at most an eighth of the budget
    # (proxy/pipeline/shown.py). Off: each turn's context is fresh, before its newest message.
    keep_shown: bool = False
    # Recall: stored turns of the user's conversations that match this one (full-text search).
    recall: bool = True
    # The share of token_budget recall may take when there is recent history to attach too
    # (all of it when there is none); history gets what recall leaves.
    recall_share: float = Field(0.5, ge=0, le=1)
    # Search hits ranked per request; null: one per 40 tokens of the recall budget (measured
    # on LoCoMo: fewer starve a large budget, more crowd a small one with weak hits).
    recall_candidates: int | None = Field(None, ge=1, le=500)
    # The share of the recall budget that memories take: every pinned one (whatever this
    # says, while they fit), then the others most relevant to the turn; excerpts of stored
    # turns get what memories leave.
    memory_share: float = Field(0.25, ge=0, le=1)


class IntentLabel(_Strict):
    """One intent label: what it means (the LLM classifier reads it) and the keyword
    classifier's cues: keywords or phrases (whole words, any case) and regular expressions
    (matched against the lower-cased turn)."""

    description: str = Field(min_length=1)
    keywords: list[str] = []
    patterns: list[str] = []

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
        return patterns


class IntentPolicy(_Strict):
    """What a label changes about the context: `memory: false` attaches no stored context."""

    memory: bool = True


class IntentSettings(_Strict):
    mode: Annotated[Literal["off", "keyword", "llm"], Off] = "keyword"
    model: str = "gpt-4o-mini"
    timeout_ms: int = Field(800, gt=0)
    # The upstream the LLM classifier calls; the tenant's own when null.
    upstream: str | None = None
    # The labels; null means the default set (question, task, follow_up, feedback,
    # chitchat, other). `other` is always there.
    labels: dict[str, IntentLabel] | None = None
    # Per label, e.g. {chitchat: {memory: false}}.
    policies: dict[str, IntentPolicy] = {}
    # Act on the LLM's label rather than the keyword one, waiting for it up to timeout_ms.
    wait_for_llm: bool = False
    # Earlier messages the classifiers see.
    history_messages: int = Field(6, ge=0, le=50)

    @model_validator(mode="after")
    def _policies_name_labels(self) -> IntentSettings:
        known = set(DEFAULT_LABELS if self.labels is None else self.labels) | {OTHER}
        for label in self.policies:
            if label not in known:
                raise ValueError(f"policies.{label}: not one of the labels ({sorted(known)})")
        return self


class MemorySettings(_Strict):
    # `llm`: after each stored exchange of a named user, a background job asks `model` which
    # memories it holds and applies its add/update/delete decisions.
    extract: Annotated[Literal["off", "llm"], Off] = "off"
    model: str = "gpt-4o-mini"
    # The upstream the extraction model is called through; the tenant's own when null.
    upstream: str | None = None
    timeout_seconds: float = Field(60.0, gt=0)
    # Existing memories shown to the model so it can update or delete them rather than repeat.
    similar_memories: int = Field(20, ge=0, le=100)
    # Embeddings for recall (hybrid with full-text search): `local` (the default) runs
    # all-MiniLM-L6-v2 in-process on onnxruntime; `upstream` asks the tenant's upstream (or
    # `embedding_upstream`) for `embedding_model`'s vectors at /v1/embeddings.
    # Stored messages are embedded by a background job; the question is embedded on the
    # request path, waiting at most `embedding_timeout_ms` (then recall is full-text only).
    embeddings: Annotated[Literal["off", "upstream", "local"], Off] = "local"
    embedding_model: str = Field("text-embedding-3-small", min_length=1, max_length=128)
    embedding_upstream: str | None = None
    embedding_timeout_ms: int = Field(300, gt=0)
    # How much vector hits weigh against full-text hits when their scores are fused (the best
    # vector hit counts this much of the best full-text hit; policies/fusion.py), and how
    # similar (cosine) a stored message, memory or passage must be to count as a vector hit.
    embedding_weight: float = Field(1.0, ge=0)
    embedding_min_similarity: float = Field(0.2, ge=-1, le=1)


class AttachmentSettings(_Strict):
    """Documents attached to conversations (stored or inline) and earlier tool results: how
    much of the budget they may take, and how they are fitted (policies/artifacts.py)."""

    # The share of context.token_budget they may take; history and recall get the rest.
    share: float = Field(0.6, ge=0, le=1)
    # `llm`: when they do not all fit, one call of `planner_model` picks each one's strategy
    # (validated; a bad or late plan falls back to the rule). `off`: the rule alone.
    planner: Annotated[Literal["off", "llm"], Off] = "off"
    planner_model: str = "gpt-4o-mini"
    # The upstream of the planner and of attachment summaries; the tenant's own when null.
    upstream: str | None = None
    # Each planner or summary call, at most; then the rule, or no summary.
    timeout_ms: int = Field(5000, gt=0)
    # Earlier tool results of the conversation offered as artifacts (0: none).
    tool_results: int = Field(10, ge=0, le=100)


class SummarySettings(_Strict):
    # `llm`: the oldest turns of a long conversation, beyond the history window, are
    # summarised by `model` in a background job (extending the previous summary with the turns
    # that aged out since), and the summary goes with the request in their place.
    mode: Annotated[Literal["off", "llm"], Off] = "off"
    model: str = "gpt-4o-mini"
    # The upstream the summary model is called through; the tenant's own when null.
    upstream: str | None = None
    timeout_seconds: float = Field(60.0, gt=0)
    # A history summary reaches this many messages past those that have aged out when it is
    # made (never past the newest stored one), and is extended when less than half of that
    # lead is left, so that it still reaches the attached history while the next turns push
    # the window on: the larger, the fewer summariser calls.
    lead_messages: int = Field(20, ge=0, le=200)
    # The summary's length (the call's max_tokens), and the new turns one call reads (a job
    # makes several calls, each extending the last, when more than that has aged out).
    max_tokens: int = Field(400, ge=50, le=4000)
    input_tokens: int = Field(6000, ge=500, le=100_000)


class Limits(_Strict):
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    budget_usd_day: float | None = Field(None, ge=0)
    budget_usd_month: float | None = Field(None, ge=0)


class TenantSettings(_Strict):
    """What every tenant has; `defaults:` supplies each key a tenant does not set."""

    upstream: str = "echo"
    models: list[str] | None = None
    context: ContextSettings = ContextSettings()
    intent: IntentSettings = IntentSettings()
    memory: MemorySettings = MemorySettings()
    summaries: SummarySettings = SummarySettings()
    attachments: AttachmentSettings = AttachmentSettings()
    limits: Limits = Limits()
    fail_open: bool = True
    # Conversations idle this many days are deleted with everything made of them (messages,
    # search index, vectors, attachments, summaries), with exchange records as old and
    # memories neither pinned, changed nor used since. null: kept until deleted.
    retention_days: float | None = Field(None, gt=0)
    # Each exchange's trace (what the model saw and why, docs/reference/trace.md): `summary`
    # keeps the added context's parts by reference, `full` its text as sent, `off` nothing.
    trace: Annotated[TraceLevel, Off] = "summary"


class TenantConfig(TenantSettings):
    api_keys: list[str | ApiKeyConfig] = Field(min_length=1)
    identity: IdentityConfig = IdentityConfig()


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    database: DatabaseConfig = DatabaseConfig()
    upstreams: dict[str, UpstreamConfig] = {"echo": UpstreamConfig(kind="echo")}
    pricing: dict[str, PriceConfig] = {}
    tenants: dict[str, TenantConfig] = {}
