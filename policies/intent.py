"""What the user is trying to do with a turn: the result both classifiers give, and the turn
they read. The keyword classifier is in policies/intent_keywords.py, the pure halves of the LLM
classifier (the request it sends, the reply it accepts) in policies/intent_llm.py, the labels
and their cues in policies/intent_labels.py.

The result object is pinned by DESIGN.md: `label`, `confidence` (0..1), `entities`, `reasoning`,
`is_ambiguous`, `alternative_label`, `clarifying_question`, `method` (`llm` or `keyword`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from policies.model_json import text_of

Method = Literal["llm", "keyword"]


@dataclass(frozen=True, slots=True)
class Intent:
    label: str
    confidence: float
    method: Method
    entities: dict[str, Any] = field(default_factory=dict)
    reasoning: str = ""
    is_ambiguous: bool = False
    alternative_label: str | None = None
    clarifying_question: str | None = None

    def as_dict(self) -> dict[str, Any]:
        # (`asdict` copies field by field, recursively: several times slower on every turn)
        return {
            "label": self.label,
            "confidence": self.confidence,
            "method": self.method,
            "entities": copy.deepcopy(self.entities),
            "reasoning": self.reasoning,
            "is_ambiguous": self.is_ambiguous,
            "alternative_label": self.alternative_label,
            "clarifying_question": self.clarifying_question,
        }

    def header(self) -> str:
        """`x-memory-intent`: `label;confidence;method`."""
        return f"{self.label};{self.confidence:.2f};{self.method}"


def turn_and_history(
    messages: Sequence[Mapping[str, Any]], history_limit: int = 6
) -> tuple[str, list[Mapping[str, Any]]] | None:
    """The newest message's text, if it is the user's, and the user/assistant messages before
    it (the last `history_limit`). None when the newest message is not a user turn (a tool
    result going back to the model: its turn was classified when it was asked)."""
    if not messages or messages[-1].get("role") != "user":
        return None
    earlier = [m for m in messages[:-1] if m.get("role") in ("user", "assistant")]
    return text_of(messages[-1].get("content")), earlier[-history_limit:] if history_limit else []
