"""Classify: the intent of the turn's newest user message (DESIGN.md, step 5). The keyword
intent comes from `begin()`, where the history it may refer to is known; the LLM classifier
runs alongside and replaces it in the record when it answers. Intent is metadata: it never
fails a request, but a tenant's policy for a label may say to attach no stored context."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

from policies.intent import Intent
from policies.pricing import ZERO
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.intent import LLMIntent
from proxy.pipeline.turn import Turn, classify


class TurnIntent:
    """One turn's intent: the keyword one now, the LLM's when it answers."""

    def __init__(self, req: TurnRequest) -> None:
        self.req = req
        self.intent: Intent | None = None
        self.llm: asyncio.Task[LLMIntent] | None = None
        # What the record says when the tenant's policy for the label attached nothing.
        self.by_policy: dict[str, Any] | None = None
        self._turn: Turn | None = None
        self.deferred = False

    async def classify(self, turn: Turn | None) -> bool:
        """Classify (the LLM classifier started alongside); False if the tenant's policy for
        the label says to attach no stored context. Mode off leaves the keyword intent for
        later (`deferred`: `classify_later` while the upstream works; nothing attached depends
        on it)."""
        req = self.req
        intents, tenant_id = req.services.intents, req.tenant_id
        self._turn = turn
        history = [t.message for t in turn.history] if turn else []
        if turn is not None:
            if turn.unclassified is not None and not intents.uses_llm(tenant_id):
                self.deferred = True
                return True
            self.intent = classify(turn)
        else:  # storage failed: the request's own messages are all there is
            self.intent = intents.keyword(tenant_id, req.turn.messages)
        if self.intent is not None and intents.uses_llm(tenant_id) and not req.dry_run:
            self.llm = req.services.spawn(intents.llm(tenant_id, history + req.turn.messages))
            if req.principal.tenant.intent.wait_for_llm:
                # Bounded by the classifier's own timeout; shielded so a client leaving does
                # not cancel what the record still wants.
                self.intent = (await asyncio.shield(self.llm)).intent or self.intent
        return self.policy_allows_memory()

    def policy_allows_memory(self) -> bool:
        """False if the tenant's policy for the intent says to attach no stored context."""
        policies = self.req.principal.tenant.intent.policies
        policy = policies.get(self.intent.label) if self.intent else None
        if self.intent is not None and policy is not None and not policy.memory:
            self.by_policy = {"label": self.intent.label, "memory": False}
            return False
        return True

    def classify_later(self, attached: dict[str, Any] | None = None) -> None:
        """Mode off: the keyword intent `begin()` left for later, found now (once); for the
        record only (`attached`, the record's)."""
        turn = self._turn
        if turn is None or turn.unclassified is None:
            return
        self.intent = classify(turn)
        if not self.policy_allows_memory() and attached is not None:
            attached["intent_policy"] = self.by_policy

    def traced(self) -> None:
        """The intent the turn acted on, and how it was decided, into its trace."""
        intent, settings = self.intent, self.req.principal.tenant.intent
        if intent is None:
            how = "none (intent is off)" if settings.mode == "off" else "none"
        elif intent.method == "llm":
            how = "llm (waited for, intent.wait_for_llm)"
        elif self.llm is not None:
            how = "keyword (the LLM's label, when it answers, replaces it in the record)"
        else:
            how = "keyword"
        self.req.trace.decided(intent, how, self.by_policy)

    def now(self) -> tuple[Intent | None, Decimal]:
        """The intent for the headers (the LLM's if it has answered) and what the LLM call
        cost so far (nothing when its model has no price: see Bill)."""
        task = self.llm
        if task is None or not task.done() or task.cancelled():
            return self.intent, ZERO
        result: LLMIntent = task.result()
        if result.usage is None:
            return result.intent or self.intent, ZERO
        cost = self.req.services.pricer.prices.cost(result.model, result.usage)
        return result.intent or self.intent, ZERO if cost is None else cost
