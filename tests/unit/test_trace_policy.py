"""What a trace keeps and how large it grows (policies/trace.py)."""

from __future__ import annotations

import json
from typing import Any

from policies.trace import (
    CUT_TEXT_CHARS,
    bounded,
    keeps_text,
    listed,
    records,
    with_public_ids,
)


def big_trace(texts: int = 10, chars: int = 20_000, candidates: int = 20) -> dict[str, Any]:
    return {
        "version": 1,
        "level": "full",
        "context": {
            "parts": [{"section": "history", "messages": listed([f"msg_{i}" for i in range(60)])}],
            "messages": [{"section": "recall", "content": "x" * chars} for _ in range(texts)],
        },
        "sections": {"recall": {"considered": 30, "chosen": 3, "tokens": 900}},
        "recall": {
            "candidates": [{"message": f"msg_{i}", "score": 1.0} for i in range(candidates)]
        },
        "timings": {"load_ms": 1.0},
    }


def test_levels_say_what_is_kept() -> None:
    assert records("summary") and records("full") and not records("off")
    assert keeps_text("full") and not keeps_text("summary")


def test_a_list_shows_its_first_items_and_how_many_more() -> None:
    assert listed(list(range(5)), 3) == {"items": [0, 1, 2], "more": 2}
    assert listed([1], 3) == {"items": [1]}


def test_a_trace_within_its_bound_is_kept_whole() -> None:
    trace = big_trace(texts=1, chars=100)
    stored = bounded(trace, "full")
    assert stored["truncated"] == [] and stored["level"] == "full"
    assert json.loads(stored["text"]) == trace and stored["size"] == len(stored["text"])


def test_a_trace_over_its_bound_is_cut_text_first_and_says_so() -> None:
    stored = bounded(big_trace(), "full", max_bytes=40_000)
    trace = json.loads(stored["text"])
    assert stored["truncated"] == ["context.messages.content"]
    assert all(len(m["content"]) == CUT_TEXT_CHARS for m in trace["context"]["messages"])
    assert stored["size"] <= 40_000 and trace["recall"]["candidates"]


def test_cuts_go_on_until_it_fits_down_to_the_figures() -> None:
    stored = bounded(big_trace(), "full", max_bytes=2_000)
    trace = json.loads(stored["text"])
    assert stored["truncated"][:2] == ["context.messages.content", "context.messages"]
    assert "messages" not in trace.get("context", {})
    assert trace["sections"]["recall"]["tokens"] == 900  # (the figures stay)
    assert stored["size"] <= 2_000


def test_a_stored_trace_names_message_rows_the_api_shows_as_public_ids() -> None:
    stored = {
        "context": {
            "parts": [{"section": "history", "messages": {"items": [3, 4]}, "positions": [1, 2]}],
            "messages": [{"section": "history", "position": 1, "role": "user", "content": "5"}],
        },
        "recall": {"candidates": [{"message": 7, "seq": 2, "hit": True}], "packed": 1},
    }
    shown = with_public_ids(stored, lambda pk: f"msg_{pk}")
    assert shown["context"]["parts"][0]["messages"]["items"] == ["msg_3", "msg_4"]
    assert shown["context"]["parts"][0]["positions"] == [1, 2]
    assert shown["recall"]["candidates"] == [{"message": "msg_7", "seq": 2, "hit": True}]
    assert shown["recall"]["packed"] == 1  # (a count, not a row)
    assert stored["recall"]["candidates"][0]["message"] == 7  # (the stored one untouched)


def test_an_intent_larger_than_the_bound_is_cut_to_its_label_last() -> None:
    """An LLM classifier's entities and reasoning are what it answered: the last cut keeps the
    intent's label, confidence and how it was decided, so the bound holds."""
    trace = big_trace(texts=0)
    trace["intent"] = {
        "label": "question",
        "confidence": 0.8,
        "method": "llm",
        "decided_by": "llm (waited for, intent.wait_for_llm)",
        "entities": {f"e{i}": "x" * 100 for i in range(400)},
        "reasoning": "y" * 500,
    }
    stored = bounded(trace, "summary")
    kept = json.loads(stored["text"])
    assert stored["size"] <= 16_000 and stored["truncated"][-1] == "intent"
    assert kept["intent"] == {
        "label": "question",
        "confidence": 0.8,
        "method": "llm",
        "decided_by": "llm (waited for, intent.wait_for_llm)",
    }
