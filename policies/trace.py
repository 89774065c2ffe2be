"""What an exchange's trace keeps, and how large it may grow (docs/reference/trace.md).

The turn pipeline's stages fill a collector (proxy/pipeline/trace.py); these functions decide
what of it is stored: per tenant `trace: full | summary | off` (`full` keeps the context the
proxy added as it was sent, `summary` its parts by reference, `off` nothing), lists capped to
their first items, and the whole bounded in bytes. A trace that had to be cut says what was
cut (`truncated`), so a reader never mistakes a shortened list for the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

TraceLevel = Literal["full", "summary", "off"]
LEVELS: tuple[TraceLevel, ...] = ("full", "summary", "off")
VERSION = 1
# A stored trace, at most (JSON bytes): `summary` is a few kB in practice, `full` holds the
# added context's text, which the tenant's token budget bounds (about 4 bytes a token).
MAX_BYTES: dict[TraceLevel, int] = {"summary": 16_000, "full": 96_000, "off": 0}
# Recall's candidates listed (the best ranked, packed or not), and the ids listed per part.
MAX_CANDIDATES = 20
MAX_IDS = 50
# When a trace is still too large: each message of the added context cut to this many
# characters, then fewer candidates and ids.
CUT_TEXT_CHARS = 2_000
CUT_CANDIDATES = 5
CUT_IDS = 10
# A degraded part's reason, at most (characters).
MAX_REASON_CHARS = 300

Trace = dict[str, Any]


def records(level: TraceLevel) -> bool:
    """Whether a tenant at `level` records traces at all."""
    return level != "off"


def keeps_text(level: TraceLevel) -> bool:
    """Whether the added context is kept as it was sent (else by reference only)."""
    return level == "full"


def reason_text(reason: str) -> str:
    """A degraded part's reason as a trace keeps it: its first line, at most
    `MAX_REASON_CHARS`. (A database error's text goes on with the statement and its
    parameters: what was said, which a `summary` trace never holds.)"""
    first = reason.split("\n", 1)[0]
    return first if len(first) <= MAX_REASON_CHARS else first[: MAX_REASON_CHARS - 1] + "…"


def listed(items: Sequence[Any], limit: int = MAX_IDS) -> dict[str, Any]:
    """A list as a trace shows it: the first `limit` items, and how many more there were."""
    shown = list(items[:limit])
    more = len(items) - len(shown)
    return {"items": shown, **({"more": more} if more else {})}


# The keys whose integers are stored messages' rows: a stored trace names messages by row, and
# the API shows each as its public id (`with_public_ids`), so recording one formats none.
MESSAGE_KEYS = frozenset({"message", "messages"})


def with_public_ids(value: Any, public: Callable[[int], str], key: str = "") -> Any:
    """`value` (a stored trace, or a part of one) with the message rows it names shown by
    `public` ids; a new object, the stored one untouched."""
    if isinstance(value, dict):
        return {k: with_public_ids(v, public, k if k != "items" else key) for k, v in value.items()}
    if isinstance(value, list):
        return [with_public_ids(v, public, key) for v in value]
    if key in MESSAGE_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return public(value)
    return value


def _cut_text(trace: Trace) -> bool:
    messages = trace.get("context", {}).get("messages")
    if not messages:
        return False
    for entry in messages:
        content = entry.get("content")
        if isinstance(content, str) and len(content) > CUT_TEXT_CHARS:
            entry["content"] = content[:CUT_TEXT_CHARS]
            entry["content_cut"] = True
    return True


def _drop_text(trace: Trace) -> bool:
    context = trace.get("context", {})
    return context.pop("messages", None) is not None


def _fewer_candidates(trace: Trace) -> bool:
    recall = trace.get("recall") or {}
    candidates = recall.get("candidates")
    if not candidates or len(candidates) <= CUT_CANDIDATES:
        return False
    recall["candidates"] = candidates[:CUT_CANDIDATES]
    recall["candidates_more"] = recall.get("candidates_more", 0) + len(candidates) - CUT_CANDIDATES
    return True


def _fewer_ids(trace: Trace) -> bool:
    cut = False

    def visit(value: Any) -> None:
        nonlocal cut
        if isinstance(value, dict):
            items = value.get("items")
            if isinstance(items, list) and len(items) > CUT_IDS and set(value) <= {"items", "more"}:
                value["more"] = value.get("more", 0) + len(items) - CUT_IDS
                value["items"] = items[:CUT_IDS]
                cut = True
                return
            for child in value.values():
                visit(child)
        elif isinstance(value, list):
            for child in value:
                visit(child)

    visit(trace)
    return cut


def _essentials(trace: Trace) -> bool:
    """The last resort: figures only (sections' counts and tokens, intent, timings)."""
    kept = {"version", "level", "sections", "intent", "timings", "degraded", "budget"}
    dropped = [k for k in list(trace) if k not in kept]
    for key in dropped:
        del trace[key]
    for section in trace.get("sections", {}).values():
        if isinstance(section, dict):
            for key in [k for k, v in section.items() if isinstance(v, (dict, list))]:
                del section[key]
    return bool(dropped)


def _intent_figures(trace: Trace) -> bool:
    """After the figures, the intent's own detail (an LLM classifier's entities and reasoning
    are what it answered): its label, confidence and how it was decided stay."""
    intent = trace.get("intent")
    if not isinstance(intent, dict):
        return False
    kept = {k: v for k, v in intent.items() if k in ("label", "confidence", "method", "decided_by")}
    if kept == intent:
        return False
    trace["intent"] = kept
    return True


# In order: what is cut first when a trace is over its size (the name it is reported by).
CUTS: tuple[tuple[str, Callable[[Trace], bool]], ...] = (
    ("context.messages.content", _cut_text),
    ("context.messages", _drop_text),
    ("recall.candidates", _fewer_candidates),
    ("ids", _fewer_ids),
    ("details", _essentials),
    ("intent", _intent_figures),
)


def serialized(trace: Trace) -> bytes:
    """A trace as stored: compact JSON, UTF-8 (msgspec's encoder: about 7x the standard
    library's speed, on every traced exchange)."""
    return msgspec.json.encode(trace, enc_hook=str)


def bounded(trace: Trace, level: TraceLevel, max_bytes: int | None = None) -> dict[str, Any]:
    """`trace` (cut in place) within its level's size, as stored: `text` (its JSON, made
    once), `size` (bytes), `truncated` (what had to be cut, in order; empty: nothing) and
    `level`. Plain data: it travels in the spill as it is."""
    limit = MAX_BYTES[level] if max_bytes is None else max_bytes
    cut: list[str] = []
    raw = serialized(trace)
    for name, step in CUTS:
        if len(raw) <= limit:
            break
        if step(trace):
            cut.append(name)
            raw = serialized(trace)
    return {"level": level, "size": len(raw), "truncated": cut, "text": raw.decode()}
