"""The trace of one turn: what the model saw and why (docs/reference/trace.md).

The stages fill a `TraceRecorder` as they go (plain data, no I/O: each call is a few
assignments), and the exchange's record takes the trace with its own write
(`Outcome.fields()`): built once, when that write is made (after the response, where the
record is written then). What is kept, and how large it may grow, is policies/trace.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from policies.context import Assembly, StoredTurn
from policies.intent import Intent
from policies.trace import VERSION, TraceLevel, bounded, keeps_text, listed, reason_text, records

if TYPE_CHECKING:  # (read from only: the stages that make them fill the recorder)
    from proxy.pipeline.artifacts import Attached
    from proxy.pipeline.recall import Recall
    from proxy.pipeline.summaries import HistorySummary
    from proxy.pipeline.turn import Outcome

# A part of the added context: (section, its place in the prompt sent, the message, its row).
Added = tuple[str, int, dict[str, Any], int]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


class TraceRecorder:
    """One turn's trace, as its stages record it. At level `off` every call does nothing."""

    def __init__(self, level: TraceLevel) -> None:
        self.level: TraceLevel = level
        self.on = records(level)
        self.timings: dict[str, float] = {}
        self.degraded: list[dict[str, str]] = []
        self.sections: dict[str, dict[str, Any]] = {}
        self.budget: dict[str, Any] = {}
        self.intent: dict[str, Any] | None = None
        self.recall: Recall | None = None
        self.recall_shown = False  # the recall section went out (not dropped for the window)
        self.documents: list[str] = []  # the keys of the documents that went in
        self.added: list[Added] = []
        self.placement: str | None = None
        self.context_tokens = 0
        self._built: dict[str, Any] | None = None

    @classmethod
    def off(cls) -> TraceRecorder:
        return cls("off")

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Time a stage (`<stage>_ms`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self.timings[f"{stage}_ms"] = _ms(time.perf_counter() - started)

    def degrade(self, part: str, reason: str) -> None:
        """A part of memory the turn went without, and why."""
        if self.on:
            self.degraded.append({"part": part, "reason": reason_text(reason)})

    def section(self, name: str, **figures: Any) -> None:
        """One section's figures: considered, chosen, left out, tokens, and its own details."""
        if self.on:
            self.sections[name] = {**self.sections.get(name, {}), **figures}

    def budgeted(self, **figures: Any) -> None:
        """The budget the sections were fitted into."""
        if self.on:
            self.budget.update(figures)

    def decided(self, intent: Intent | None, how: str, policy: dict[str, Any] | None) -> None:
        """The intent the turn acted on, and how it was decided."""
        if self.on:
            self.intent = {
                **({} if intent is None else intent.as_dict()),
                "decided_by": how,
                **({"policy": policy} if policy is not None else {}),
            }

    def assembled(
        self,
        assembly: Assembly | None,
        *,
        considered: Sequence[StoredTurn],
        offered: Sequence[StoredTurn],
        recall: Recall,
        recall_text: str | None,
        summary: HistorySummary,
        attached: Attached,
        placement: str,
    ) -> None:
        """What assembly made of it all: `considered`, the stored tail the client did not send;
        `offered`, what was left of it for assembly to choose from (recall's and the summary's
        shares taken); `recall`, what recall found, and `recall_text` the section it went out
        in (with the documents); `summary`, the history summary's decision; `attached`, the
        documents fitted in."""
        if not self.on:
            return
        chosen = list(offered[len(offered) - assembly.history_messages :]) if assembly else []
        self.placement = placement if assembly else None
        self.context_tokens = assembly.context_tokens if assembly else 0
        self.recall = recall
        shown = self.recall_shown = bool(assembly and assembly.recalled)
        summarized = bool(assembly and assembly.summarized)
        self.section(
            "history",
            considered=len(considered),
            chosen=len(chosen),
            left_out=len(considered) - len(chosen),
            tokens=sum(t.tokens for t in chosen),
            considered_tokens=sum(t.tokens for t in considered),
            dropped_for_window=assembly.dropped_for_window if assembly else 0,
        )
        record = summary.recorded(assembly)
        made = summary.section is not None
        self.section(
            "summary",
            considered=int(made),
            chosen=int(summarized),
            left_out=int(made and not summarized),
            tokens=summary.section.tokens if summary.section is not None and summarized else 0,
            **({"detail": record} if record else {}),
        )
        self._memories_and_recall(recall, shown)
        self._documents_of(attached, shown)
        if assembly is None:
            return
        rows = {id(t.message): t.pk for t in chosen}
        texts: dict[int, str] = {}
        if summary.section is not None and summarized:
            texts[id(summary.section.text)] = "summary"
        if recall_text is not None and shown:
            texts[id(recall_text)] = "recall"
        for position, message in enumerate(assembly.messages):
            if id(message) in rows:
                self.added.append(("history", position, message, rows[id(message)]))
            elif message.get("role") == "system" and id(message.get("content")) in texts:
                self.added.append((texts[id(message.get("content"))], position, message, 0))

    def _memories_and_recall(self, recall: Recall, shown: bool) -> None:
        found = recall.trace
        memories = [*recall.memories, *recall.known] if shown else []
        considered = found.memories_considered if found else 0
        memory_tokens = found.memory_tokens if found and shown else 0
        self.section(
            "memories",
            considered=considered,
            chosen=len(memories),
            left_out=considered - len(memories),
            tokens=memory_tokens,
            pinned=listed(recall.memories if shown else []),
            relevant=listed(recall.known if shown else []),
        )
        packed = sum(len(e.turns) for e in recall.excerpts) if shown else 0
        ranked = found.ranked if found else 0
        section = recall.section
        self.section(
            "recall",
            considered=ranked,
            chosen=packed,
            left_out=ranked - packed,
            tokens=max(0, section.tokens - memory_tokens) if section and shown else 0,
        )

    def _documents_of(self, attached: Attached, shown: bool) -> None:
        if not attached.items and not attached.storage_failed:
            self.section("documents", considered=0, chosen=0, left_out=0, tokens=0)
            return
        record = attached.record(sent=shown)
        items = record["items"]
        chosen = [i["artifact"] for i in items if i["strategy"] != "exclude"]
        self.documents = chosen
        self.section(
            "documents",
            considered=len(items),
            chosen=len(chosen),
            left_out=len(items) - len(chosen),
            tokens=record["tokens"],
            planner=record["planner"],
            items=listed(items),
        )

    # --- the trace, built once, when the exchange's record is written -----------------------

    def build(self, outcome: Outcome) -> dict[str, Any] | None:
        """The trace to store with the exchange (None at level `off`)."""
        if not self.on:
            return None
        if self._built is None:
            self._built = bounded(_trace(self, outcome), self.level)
        return self._built


def _row(pk: int) -> int | None:
    """A stored message, by its row: the API shows its public id (`with_public_ids`)."""
    return pk if pk > 0 else None


def _trace(rec: TraceRecorder, outcome: Outcome) -> dict[str, Any]:
    timings = dict(rec.timings)
    for name in ("overhead_ms", "upstream_ms", "ttft_ms", "latency_ms"):
        value = getattr(outcome, name)
        if value is not None:
            timings[name] = round(value, 3)
    trace: dict[str, Any] = {
        "version": VERSION,
        "level": rec.level,
        "budget": rec.budget,
        "context": _context(rec),
        "sections": rec.sections,
        "recall": _recall_detail(rec),
        "intent": rec.intent,
        "timings": timings,
        "degraded": rec.degraded,
    }
    if outcome.bill is not None:
        fields = outcome.bill.fields()
        trace["usage"] = {
            "prompt_tokens": fields.get("prompt_tokens"),
            "completion_tokens": fields.get("completion_tokens"),
            "estimated": fields.get("usage_estimated"),
        }
        trace["cost"] = {"upstream_usd": fields.get("cost_upstream_usd")}
    return trace


def _context(rec: TraceRecorder) -> dict[str, Any]:
    """The context the proxy added: each part by reference (its source ids), and at level
    `full` each message as it was sent."""
    parts: list[dict[str, Any]] = []
    history = [a for a in rec.added if a[0] == "history"]
    if history:
        parts.append(
            {
                "section": "history",
                "positions": [history[0][1], history[-1][1]],
                "messages": listed([_row(pk) for _, _, _, pk in history]),
            }
        )
    for section, position, _, _ in rec.added:
        if section == "summary":
            detail = rec.sections.get("summary", {}).get("detail") or {}
            parts.append({"section": "summary", "position": position, "source": detail})
        elif section == "recall":
            parts.append({"section": "recall", "position": position, **_sources(rec)})
    context: dict[str, Any] = {
        "placement": rec.placement,
        "tokens": rec.context_tokens,
        "parts": parts,
    }
    if keeps_text(rec.level):
        context["messages"] = [
            {"section": section, "position": position, **message}
            for section, position, message, _ in rec.added
        ]
    return context


def _sources(rec: TraceRecorder) -> dict[str, Any]:
    """Where the recall section's text came from: excerpts (message ids, by conversation),
    memories and documents."""
    recall = rec.recall
    if recall is None:
        return {}
    excerpts = [
        {
            "conversation_id": e.turns[0].conversation,
            "messages": [_row(t.pk) for t in e.turns],
        }
        for e in recall.excerpts
    ]
    return {
        "excerpts": listed(excerpts),
        "memories": listed([*recall.memories, *recall.known]),
        "documents": listed(rec.documents),
    }


def _recall_detail(rec: TraceRecorder) -> dict[str, Any] | None:
    """Recall's search: its terms, hits, and the best ranked candidates (packed or not)."""
    recall = rec.recall
    found = recall.trace if recall is not None else None
    if recall is None or found is None:
        return None
    packed = {t.pk for e in recall.excerpts for t in e.turns} if rec.recall_shown else set()
    return {
        "terms": found.terms,
        "semantic": found.semantic,
        "hits": {"full_text": found.lexical_hits, "vector": found.vector_hits},
        "ranked": found.ranked,
        "candidates": [
            {
                "message": _row(pk),
                "conversation_id": conversation,
                "seq": seq,
                "role": role,
                "score": round(value, 6),
                "search_score": None if score is None else round(score, 6),
                "hit": hit,
                "tokens": tokens,
                "packed": pk in packed,
            }
            for pk, conversation, seq, role, value, score, hit, tokens in found.candidates
        ],
        "packed": len(packed),
    }
