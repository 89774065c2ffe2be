"""What the echo upstream answers, deterministically and offline, so that every feature shows
without a model:

- memproxy's own calls, known by how their system prompts open (the constants of the
  policies that build them): intent (the keyword classifier's label), memory extraction (the
  user's first-person statements, "I ..." and "My ...", as facts about "the user"), history
  summaries (the turns, clipped), the attachments' planner (whole documents while they fit,
  then passages) and document summaries (the document's opening);
- a tool call when `tool_choice` forces a function or is `required` (the first tool), or, on
  `auto`, when the newest user message names a tool; its arguments a minimal value valid
  against the tool's parameters;
- `response_format` `json_schema`: a minimal value valid against the schema; `json_object`: an
  object holding the description below;
- anything else: a description of what was received.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from policies.artifact_prompts import DOCUMENT, DOCUMENTS, PLANNER_TASK, SUMMARY_TASK
from policies.extraction import EXCHANGE, EXTRACTION_TASK
from policies.fence import unfence
from policies.intent_keywords import KeywordClassifier
from policies.intent_labels import DEFAULT_LABELS
from policies.intent_llm import INTENT_TASK, NEWEST_MESSAGE
from policies.summaries import ASK, NEW_TURNS, SO_FAR
from policies.summaries import SYSTEM_PROMPT as SUMMARY_PROMPT
from policies.tokens import count_text, message_text
from proxy.upstream.schema_instance import instance

PREVIEW_CHARS = 200
_ROLE_LINE = re.compile(r"^(user|assistant|system|developer|tool):$", re.MULTILINE)


@dataclass(slots=True)
class Answer:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def describe(messages: list[dict[str, Any]], prompt_tokens: int) -> str:
    last_user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    preview = message_text(last_user) if last_user else ""
    if len(preview) > PREVIEW_CHARS:
        preview = preview[:PREVIEW_CHARS] + "..."
    roles = ", ".join(
        f"{r}={sum(m.get('role') == r for m in messages)}"
        for r in dict.fromkeys(m.get("role") for m in messages)
    )
    return (
        f"echo: received {len(messages)} messages ({roles}), {prompt_tokens} prompt tokens. "
        f'Last user message: "{preview}"'
    )


def answer(body: dict[str, Any], prompt_tokens: int) -> Answer:
    messages: list[dict[str, Any]] = body.get("messages") or []
    internal = _internal(messages, body)
    if internal is not None:
        return Answer(internal)
    calls = _tool_calls(body, messages)
    if calls:
        return Answer(None, calls)
    text = describe(messages, prompt_tokens)
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        if response_format.get("type") == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema") if isinstance(spec, dict) else None
            return Answer(json.dumps(instance(schema or {"type": "object"})))
        if response_format.get("type") == "json_object":
            return Answer(json.dumps({"echo": text}))
    return Answer(text)


# --- memproxy's own calls -----------------------------------------------------------------


def _internal(messages: list[dict[str, Any]], body: dict[str, Any]) -> str | None:
    if len(messages) < 2 or messages[0].get("role") != "system":
        return None
    system, user = message_text(messages[0]), message_text(messages[-1])
    budget = body.get("max_tokens")
    limit = budget if isinstance(budget, int) and budget > 0 else 400
    rules: list[tuple[Callable[[str], bool], Callable[[], str]]] = [
        (lambda s: s.startswith(INTENT_TASK), lambda: _intent(system, user)),
        (lambda s: s.startswith(EXTRACTION_TASK), lambda: _extraction(user)),
        (lambda s: s == SUMMARY_PROMPT, lambda: _history_summary(user, limit)),
        (lambda s: s.startswith(PLANNER_TASK), lambda: _plan(system, user)),
        (lambda s: s.startswith(SUMMARY_TASK), lambda: _document_summary(user, limit)),
    ]
    return next((reply() for matches, reply in rules if matches(system)), None)


@cache
def _classifier(labels: frozenset[str]) -> KeywordClassifier:
    return KeywordClassifier({k: v for k, v in DEFAULT_LABELS.items() if k in labels})


def _intent(system: str, user: str) -> str:
    """The keyword classifier's answer, among the labels the prompt lists."""
    listed = frozenset(re.findall(r"^- ([A-Za-z0-9_]+):", system, re.MULTILINE))
    text = unfence(user.rsplit(NEWEST_MESSAGE, 1)[-1])
    result = _classifier(listed).classify(text)
    return json.dumps(
        {
            "label": result.label,
            "confidence": result.confidence,
            "entities": {},
            "reasoning": "echo: keyword rules",
            "is_ambiguous": False,
            "alternative_label": None,
            "clarifying_question": None,
        }
    )


def _said(lines: str) -> list[tuple[str, str]]:
    """("role", text) of the proxy's "role:" lines, each with its text fenced below it."""
    starts = list(_ROLE_LINE.finditer(lines))
    ends = [m.start() for m in starts[1:]] + [len(lines)]
    pairs = zip(starts, ends, strict=True)
    return [(m.group(1), unfence(lines[m.end() : end])) for m, end in pairs]


_FIRST_PERSON = re.compile(r"^(?:I|I'm|I've|I'd|I'll|My|my)\b")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_PREFERENCE = re.compile(
    r"\b(like|likes|love|loves|prefer|prefers|hate|hates|enjoy|enjoys|dislike|dislikes|"
    r"favou?rite)\b",
    re.IGNORECASE,
)


def _extraction(user: str) -> str:
    """Each first-person statement of the user's, as a memory about "the user"."""
    known, _, exchange = user.partition(EXCHANGE)
    seen = known.lower()
    decisions: list[dict[str, Any]] = []
    for role, text in _said(exchange):
        if role != "user":
            continue
        # (a curly apostrophe as a straight one: "I\u2019m")
        for sentence in _SENTENCE_END.split(text.strip().replace("\u2019", "'")):
            sentence = sentence.strip()
            if not _FIRST_PERSON.match(sentence) or sentence.endswith("?"):
                continue
            fact = third_person(sentence.rstrip(".!")) + "."
            if fact.lower() in seen or any(d["text"] == fact for d in decisions):
                continue
            kind = "preference" if _PREFERENCE.search(sentence) else "fact"
            decisions.append({"action": "add", "kind": kind, "text": fact, "confidence": 0.9})
    return json.dumps({"memories": decisions})


_OPENERS = {
    "i'm": "The user is",
    "i am": "The user is",
    "i've": "The user has",
    "i'd": "The user would",
    "i'll": "The user will",
    "my": "The user's",
}
_PRONOUNS = {
    "my": "their",
    "me": "them",
    "mine": "theirs",
    "myself": "themselves",
    "i": "they",
    "i'm": "they're",
    "am": "are",
}
_SAME = {
    "can", "could", "will", "would", "should", "shall", "may", "might", "must", "was",
    "did", "had", "used", "went", "grew", "got", "took", "made", "saw", "began", "came",
    "left", "bought", "met", "ate", "wrote", "spent", "found", "lost", "knew", "thought",
    "can't", "won't", "didn't", "wasn't", "never", "wouldn't", "couldn't",
}  # fmt: skip
_IRREGULAR = {"have": "has", "do": "does", "go": "goes", "am": "is", "be": "is", "don't": "doesn't"}
_ADVERBS = {
    "also", "just", "never", "always", "still", "usually", "often", "really", "now", "only",
    "mostly", "sometimes", "even", "already", "recently", "currently", "actually", "mainly",
}  # fmt: skip


def third_person(sentence: str) -> str:
    """A first-person statement about the user ("I live in Lisbon", "My dog is Rex") in the
    third person ("The user lives in Lisbon", "The user's dog is Rex"). Rules, not grammar:
    good for the common shapes."""
    words = sentence.split()
    lowered = [w.lower() for w in words]
    if len(words) > 1 and f"{lowered[0]} {lowered[1]}" == "i am":
        head, rest = _OPENERS["i am"], words[2:]
    elif lowered[0] in _OPENERS:
        head, rest = _OPENERS[lowered[0]], words[1:]
    else:  # "I <verb> ...": the verb (after any adverbs) in the third person
        rest = words[1:]
        verb_at = next((i for i, w in enumerate(rest) if w.lower() not in _ADVERBS), None)
        if verb_at is not None:
            rest = [*rest[:verb_at], _conjugated(rest[verb_at]), *rest[verb_at + 1 :]]
        head = "The user"
    return " ".join([head, *(_PRONOUNS.get(w.lower(), w) for w in rest)])


def _conjugated(verb: str) -> str:
    low = verb.lower()
    if low in _IRREGULAR:
        return _IRREGULAR[low]
    if low in _SAME or low.endswith("ed") or not low.isalpha():
        return verb
    if low.endswith("y") and len(low) > 1 and low[-2] not in "aeiou":
        return verb[:-1] + "ies"
    if low.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    return verb + "s"


def _within(lines: list[str], limit: int) -> str:
    """The newest of `lines` that fit in `limit` tokens (one at least, clipped)."""
    kept: list[str] = []
    for line in reversed(lines):
        if kept and count_text("\n".join([line, *kept])) > limit:
            break
        kept.insert(0, line)
    text = "\n".join(kept)
    while count_text(text) > limit and len(text) > 20:
        text = text[: len(text) * 3 // 4] + "..."
    return text


def _history_summary(user: str, limit: int) -> str:
    """The summary so far, then one clipped line per new turn; the oldest lines go first
    when it would not fit."""
    so_far, _, rest = user.removeprefix(SO_FAR).partition(NEW_TURNS)
    turns = rest.rsplit(ASK, 1)[0]
    lines = [] if so_far.startswith("(none yet") else unfence(so_far).strip().splitlines()
    for role, text in _said(turns):
        flat = " ".join(text.split())
        lines.append(f"- {role}: {flat[:160] + '...' if len(flat) > 160 else flat}")
    return _within(lines, limit)


_DOCUMENT_LINE = re.compile(r'^- key=("(?:[^"\\]|\\.)*") kind=\S+ tokens=(\d+)$', re.MULTILINE)


def _plan(system: str, user: str) -> str:
    """Whole documents in the order listed while they fit the budget; passages of the rest."""
    found = re.search(r"budget of (\d+) tokens", system)
    room = int(found.group(1)) if found else 0
    plan = []
    for priority, match in enumerate(_DOCUMENT_LINE.finditer(user.partition(DOCUMENTS)[2]), 1):
        tokens = int(match.group(2))
        strategy = "include_full" if tokens <= room else "relevant_passages"
        room -= tokens if strategy == "include_full" else 0
        key = json.loads(match.group(1))
        plan.append({"key": key, "strategy": strategy, "priority": priority})
    return json.dumps({"plan": plan})


def _document_summary(user: str, limit: int) -> str:
    """The document's opening, within the summary's room."""
    document = unfence(user.split(DOCUMENT, 1)[-1])
    if document.startswith("title: "):  # its title line, then a blank one
        document = document.split("\n", 2)[-1]
    return _within([" ".join(document.split()[: max(1, limit // 2)])], limit)


# --- tool calls ----------------------------------------------------------------------------


def _tool_calls(body: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tools = {
        t["function"]["name"]: t["function"]
        for t in body.get("tools") or []
        if isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    }
    if not tools:
        return []
    choice = body.get("tool_choice", "auto")
    name: str | None = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    elif choice == "required":
        name = next(iter(tools))
    elif choice == "auto" and messages and messages[-1].get("role") == "user":
        said = message_text(messages[-1]).lower()
        name = next((n for n in tools if _names(said, n)), None)
    if name not in tools:
        return []
    arguments = json.dumps(instance(tools[name].get("parameters") or {"type": "object"}))
    digest = hashlib.sha256(f"{name}\n{arguments}\n{len(messages)}".encode()).hexdigest()
    return [
        {
            "id": f"call_echo{digest[:20]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
    ]


def _names(text: str, tool: str) -> bool:
    """Whether `text` names the tool: as written, or with its _ and - read as spaces."""
    spoken = re.sub(r"[_\-]+", " ", tool.lower()).strip()
    return any(
        re.search(rf"(?<![\w]){re.escape(form)}(?![\w])", text) for form in {tool.lower(), spoken}
    )
