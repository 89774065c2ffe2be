"""Intent classification on the request path: the keyword classifier of each tenant, and the LLM
classifier called through the tenant's intent upstream with a timeout.

Intent is metadata: nothing here raises into a request. The LLM classifier's failures (an
error, a timeout, a reply that is not the JSON object asked for) fall back to the keyword result,
are logged, and counted in `memproxy_intent_fallbacks_total`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.intent import Intent, turn_and_history
from policies.intent_keywords import KeywordClassifier
from policies.intent_labels import DEFAULT_LABELS, LabelSpec
from policies.intent_llm import llm_request, parse_llm_reply
from policies.pricing import Usage
from proxy.accounting.costs import usage_or_estimate
from proxy.accounting.metrics import Metrics
from proxy.core.config import Config, IntentSettings
from proxy.upstream.base import Upstream
from proxy.upstream.sse import reply_from_completion
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges

log = structlog.get_logger("memproxy.intent")


@dataclass(frozen=True, slots=True)
class LLMIntent:
    """What the LLM classifier came back with: its intent (None: fall back to keywords) and
    the usage to charge (also for a reply it could not use)."""

    intent: Intent | None
    usage: Usage | None
    model: str


def label_specs(settings: IntentSettings) -> dict[str, LabelSpec]:
    if settings.labels is None:
        return dict(DEFAULT_LABELS)
    specs = {
        name: LabelSpec(label.description, tuple(label.keywords), tuple(label.patterns))
        for name, label in settings.labels.items()
    }
    specs.setdefault("other", DEFAULT_LABELS["other"])
    return specs


class IntentClassifiers:
    """Per tenant: the compiled keyword classifier and the LLM classifier's upstream."""

    def __init__(self, config: Config, upstreams: Mapping[str, Upstream], metrics: Metrics) -> None:
        self.metrics = metrics
        self._keyword: dict[str, KeywordClassifier] = {}
        self._upstream: dict[str, Upstream] = {}
        self._settings: dict[str, IntentSettings] = {}
        for name, tenant in config.tenants.items():
            settings = tenant.intent
            self._settings[name] = settings
            if settings.mode != "off":
                self._keyword[name] = KeywordClassifier(label_specs(settings))
            if settings.mode == "llm":
                self._upstream[name] = upstreams[settings.upstream or tenant.upstream]

    def keyword(self, tenant_id: str, messages: list[dict[str, Any]]) -> Intent | None:
        """The keyword intent of the newest user turn in `messages` (None: intent is off)."""
        classifier = self._keyword.get(tenant_id)
        if classifier is None:
            return None
        settings = self._settings[tenant_id]
        turn = turn_and_history(messages, settings.history_messages)
        if turn is None:
            return None
        intent = classifier.classify(*turn)
        self.metrics.intents.labels(tenant_id, intent.label, "keyword").inc()
        return intent

    def uses_llm(self, tenant_id: str) -> bool:
        return tenant_id in self._upstream

    async def llm(self, tenant_id: str, messages: list[dict[str, Any]]) -> LLMIntent:
        """Ask the tenant's intent model, within `timeout_ms`. Never raises (but for
        cancellation): a failure is an `LLMIntent` without an intent."""
        settings = self._settings[tenant_id]
        classifier = self._keyword[tenant_id]
        text, history = turn_and_history(messages, settings.history_messages) or ("", [])
        body = llm_request(settings.model, text, history, classifier.labels)
        usage: Usage | None = None
        reason = "bad_reply"
        try:
            async with asyncio.timeout(settings.timeout_ms / 1000):
                reply = await self._upstream[tenant_id].chat_completions(body, stream=False)
            if reply.status >= 400:
                reason = f"status_{reply.status}"
            else:
                message, raw_usage = reply_from_completion(reply.body or b"")
                usage = await usage_or_estimate(
                    settings.model, raw_usage, body["messages"], message
                )
                intent = parse_llm_reply((message or {}).get("content"), classifier.labels)
                if intent is not None:
                    self.metrics.intents.labels(tenant_id, intent.label, "llm").inc()
                    return LLMIntent(intent, usage, settings.model)
        except TimeoutError:
            reason = "timeout"
        except Exception as exc:  # an upstream failure of any kind: intent is metadata
            reason = "error"
            log.warning("intent_llm_error", tenant=tenant_id, error=str(exc) or repr(exc))
        log.info("intent_llm_fallback", tenant=tenant_id, reason=reason)
        self.metrics.intent_fallbacks.labels(tenant_id, reason).inc()
        return LLMIntent(None, usage, settings.model)


def record_intent(
    conn: Connection, *, tenant_id: str, request_id: str, detail: dict[str, Any]
) -> bool:
    """The LLM's intent (`Intent.as_dict()`) into an exchange's record and its user turn's
    metadata, replacing the keyword one (also the spill's replay); False if the exchange
    record is not there."""
    found = Exchanges(conn).set_intent(tenant_id, request_id, str(detail["label"]), detail)
    Conversations(conn).set_turn_meta(tenant_id, request_id, "intent", detail)
    return found
