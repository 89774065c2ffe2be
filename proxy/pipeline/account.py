"""Account: a turn's exchange counted once it ends (metrics, the tenant's limits), its outcome
persisted, and the proxy's own model calls for it (the LLM intent, the attachments' planner and
summariser, the question's embedding) charged to its record as they finish. When storage was
down for the exchange, or fails for one of these writes, the part waits in the spill with it."""

from __future__ import annotations

import asyncio
from functools import partial

import structlog

from policies.pricing import Usage
from proxy.accounting.charges import EMBEDDING
from proxy.background.embeddings import Vector
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.intent import LLMIntent, record_intent
from proxy.pipeline.persist import record, spill_outcome
from proxy.pipeline.spill_entries import spilled_charge, spilled_intent, spilled_outcome
from proxy.pipeline.turn import Outcome, Turn
from storage.errors import StorageError

log = structlog.get_logger("memproxy.pipeline")
OwnCall = tuple[str, str, Usage]  # (kind, model, usage)


class Ledger:
    """What one turn owes and records, from the end of its upstream call on."""

    def __init__(self, req: TurnRequest) -> None:
        self.req = req
        self.turn: Turn | None = None
        self.spilled = False  # the turn went to the spill (storage was down)
        self.calls: list[OwnCall] = []  # the attachments' planner's and summariser's
        self.question: asyncio.Task[Vector | None] | None = None

    @property
    def owes(self) -> bool:
        return bool(self.calls) or self.question is not None

    async def settle(
        self,
        outcome: Outcome,
        sent: list[dict[str, object]],
        llm_intent: asyncio.Task[LLMIntent] | None,
    ) -> None:
        """Count the exchange (metrics, the tenant's limits) and record it; `sent`: the
        messages the upstream got (logged only with `server.log_content`)."""
        req, turn = self.req, self.turn
        services, tenant = req.services, req.tenant_id
        services.metrics.observe_chat(tenant, services.metrics.model(req.turn.model), outcome)
        if services.config.server.log_content:  # debugging only: off by default
            log.info(
                "chat_content",
                request_id=req.request_id,
                tenant=tenant,
                user=req.user_id,
                sent=sent,
                reply=outcome.reply,
                status=outcome.status,
            )
        if outcome.bill is not None:
            # The upstream call only: the proxy's own calls are counted as they are charged.
            usage = outcome.bill.usage
            services.limits.spend(tenant, usage.total_tokens, outcome.bill.upstream_usd)
        if turn is not None:
            await record(services, turn, outcome, req.info)
        elif self.spilled:  # its turn is in the spill: the outcome goes after it
            entry = spilled_outcome(*req.spill_head(), outcome, turn=None)
            await spill_outcome(services, entry)
        if llm_intent is not None:
            task = services.spawn(self._record_llm_intent(llm_intent))
            if turn is not None:
                # Management calls (the exchange record, usage reports) wait for it.
                services.memory.track(turn, task, metadata=True)
        if self.owes:
            self.charge_later()

    def charge_later(self) -> None:
        task = self.req.services.spawn(self.charge_own_calls())
        if self.turn is not None:
            self.req.services.memory.track(self.turn, task, metadata=True)

    def own_calls(self) -> list[OwnCall]:
        """The proxy's own paid calls for this request so far, but the LLM intent's."""
        calls = list(self.calls)
        task = self.question
        if task is not None and task.done() and not task.cancelled():
            vector = task.result()
            if vector is not None and vector.usage is not None:
                calls.append((EMBEDDING, vector.model, vector.usage))
        return calls

    async def charge_own_calls(self) -> None:
        """`own_calls`, charged to the exchange once it is recorded (those made before the
        headers went out are in the response's `x-cost-memory-usd` already)."""
        turn = self.turn
        if turn is not None and turn.pending is not None:
            await self.req.services.deferred.settle()  # its record is written in a batch
        if self.question is not None:
            await asyncio.wait([self.question])  # (bounded by its own timeout)
        for kind, model, usage in self.own_calls():
            await self._charge(kind, model, usage)

    async def _record_llm_intent(self, task: asyncio.Task[LLMIntent]) -> None:
        """When the LLM's intent arrives (maybe after the response), it replaces the keyword
        one in the records, and its cost is charged to the exchange."""
        result = await task
        req, turn = self.req, self.turn
        services = req.services
        if turn is not None and turn.pending is not None:
            await services.deferred.settle()  # its record is written in a batch
        if result.intent is not None and (turn is not None or self.spilled):
            detail = result.intent.as_dict()
            recorded = False
            if turn is not None:
                try:
                    recorded = await services.db.write(
                        partial(
                            record_intent,
                            tenant_id=req.tenant_id,
                            request_id=turn.request_id,
                            detail=detail,
                        )
                    )
                except StorageError as exc:
                    log.warning("intent_spilled", request_id=req.request_id, error=str(exc))
            if not recorded:
                await spill_outcome(services, spilled_intent(*req.spill_head(), detail))
        if result.usage is not None:
            await self._charge("intent", result.model, result.usage)

    async def _charge(self, kind: str, model: str, usage: Usage) -> None:
        """One of the proxy's own model calls, charged to the exchange (record, budgets,
        metrics); counted against the budgets at once."""
        req, turn = self.req, self.turn
        services = req.services
        part, usd = services.charges.priced(kind, model, usage)
        services.charges.count(req.tenant_id, model, usage, usd, kind)
        if turn is not None:
            try:
                if await services.charges.record(req.tenant_id, turn.request_id, part) != "missing":
                    return
                # (Its record is not there: a mode-off record whose batch went to the spill,
                # or one erased since, which the replay then drops.)
                log.warning("memory_cost_spilled", request_id=turn.request_id, error="no record")
            except StorageError as exc:
                log.warning("memory_cost_spilled", request_id=turn.request_id, error=str(exc))
        elif not self.spilled:
            return  # no exchange to charge it to
        await spill_outcome(services, spilled_charge(*req.spill_head(), part))
