"""Intent (policies/intent.py): the keyword classifier, the LLM request, and the normalisation of
what an LLM answers."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from policies.intent import Intent, turn_and_history
from policies.intent_keywords import CLASSIFY_CHARS, KeywordClassifier
from policies.intent_labels import DEFAULT_LABELS, LabelSpec
from policies.intent_llm import llm_request, parse_llm_reply
from proxy.core.config import ConfigError, IntentSettings
from proxy.core.config_file import load_config

HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "give me three names for a bakery"},
    {"role": "assistant", "content": "1. Rise & Shine 2. Crumbs 3. The Daily Loaf"},
]
classify = KeywordClassifier().classify


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("what is the capital of australia?", "question"),
        ("write a limerick about a cat", "task"),
        ("could you translate 'good luck' into italian?", "task"),
        ("thanks a lot!", "feedback"),
        ("hello there!", "chitchat"),
        ("asdfghjkl", "other"),
        ("https://example.com/page", "other"),
    ],
)
def test_plain_turns_get_their_label_with_method_keyword(text: str, label: str) -> None:
    intent = classify(text)
    assert (intent.label, intent.method) == (label, "keyword")
    assert 0 <= intent.confidence <= 1


def test_a_reference_is_a_follow_up_only_when_there_is_something_to_refer_to() -> None:
    assert classify("make it shorter", HISTORY).label == "follow_up"
    assert classify("the second one", HISTORY).label == "follow_up"
    assert classify("the second one").label != "follow_up"  # nothing came before


def test_a_follow_up_that_is_also_a_task_is_a_follow_up() -> None:
    assert classify("now do it in french", HISTORY).label == "follow_up"


def test_thanks_with_a_new_request_is_the_request() -> None:
    assert classify("thanks! now can you summarise this for me", HISTORY).label == "task"


def test_pasted_material_is_not_read_as_the_users_own_words() -> None:
    text = "reply to this customer email: 'thanks, but your product is useless and broken'"
    assert classify(text).label == "task"


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("thanks, that helps. also, how long does bread keep?", "question"),
        ("perfect! now put the third name first", "follow_up"),
        ("cheers. btw who invented the croissant?", "question"),  # an aside: a new topic
        ("hey there, hope your week is going well", "chitchat"),
        ("merci beaucoup, c'est parfait", "feedback"),
    ],
)
def test_an_opening_thanks_greeting_or_aside_leaves_the_rest_to_decide(
    text: str, label: str
) -> None:
    assert classify(text, HISTORY).label == label


def test_a_change_to_the_answer_is_a_follow_up_and_a_new_deliverable_a_task() -> None:
    assert classify("add a tagline under each name", HISTORY).label == "follow_up"
    assert classify("could you make the tone more playful", HISTORY).label == "follow_up"
    assert classify("can you write me a haiku about bread", HISTORY).label == "task"


def test_a_short_question_with_no_question_word_leans_on_the_answer() -> None:
    assert classify("price for a dozen loaves?", HISTORY).label == "follow_up"
    assert classify("und auf Deutsch?", HISTORY).label == "follow_up"
    assert classify("price for a dozen loaves?").label == "question"  # nothing came before


def test_a_polite_request_is_a_task_despite_its_question_mark() -> None:
    assert classify("is there a chance you could summarise this in two lines?").label == "task"


def test_corrections_complaints_and_remarks() -> None:
    assert classify("no, the bakery opens at 7, not 8", HISTORY).label == "feedback"
    assert classify("this doesn't even run, the import fails", HISTORY).label == "feedback"
    assert classify("hmm that doesn't look right", HISTORY).label == "feedback"
    assert classify("my cat just knocked my coffee over").label == "chitchat"


def test_a_long_turn_is_classified_by_its_beginning() -> None:
    """What a turn asks is in its first lines: the rules read `CLASSIFY_CHARS` of it, so a
    long paste costs what any turn does (timed against ordinary turns, with turns built to
    make a pattern backtrack, by bench/intent_eval.py)."""
    for text in ("what is rust? " + "ok, " * 5_000, "thanks for the " * 150 + "what is rust?"):
        assert classify(text, HISTORY) == classify(text[:CLASSIFY_CHARS], HISTORY)
    assert classify("what is rust? " + "ok, " * 5_000, HISTORY).label == "question"
    assert classify("thanks for the " * 150, HISTORY).label == "feedback"


def test_the_result_object_has_every_field_of_the_design() -> None:
    result = classify("what is rust?").as_dict()
    assert set(result) == {
        "label",
        "confidence",
        "entities",
        "reasoning",
        "is_ambiguous",
        "alternative_label",
        "clarifying_question",
        "method",
    }


def test_header_is_label_confidence_method() -> None:
    assert Intent("question", 0.923, "llm").header() == "question;0.92;llm"


def test_a_tenants_own_labels_and_cues() -> None:
    labels = {
        "billing": LabelSpec("About invoices and payments.", keywords=("invoice", "refund")),
        "bug": LabelSpec("Reports a defect.", patterns=(r"\bcrash(es|ed)?\b",)),
    }
    custom = KeywordClassifier(labels)
    assert custom.classify("where is my refund for invoice 42").label == "billing"
    assert custom.classify("the app crashes on start").label == "bug"
    assert custom.classify("lovely weather").label == "other"  # `other` is always there


def test_turn_and_history_take_the_newest_user_message() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        *HISTORY,
        {"role": "user", "content": [{"type": "text", "text": "the first"}, {"text": None}]},
    ]
    assert turn_and_history(messages, history_limit=1) == ("the first", [HISTORY[1]])
    assert turn_and_history(messages, history_limit=0) == ("the first", [])


def test_a_request_that_does_not_end_with_a_user_turn_has_no_turn_to_classify() -> None:
    tool_step = [*HISTORY, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert turn_and_history(tool_step) is None
    assert turn_and_history([]) is None


def test_a_huge_turn_is_classified_from_its_beginning() -> None:
    # A megabyte of references and comparatives: the rules read only the first 2,000
    # characters, so this is as quick as any turn (no pattern runs over the whole text).
    huge = "write a poem about it " + "it that this more shorter " * 40_000
    assert len(huge) > 1_000_000
    assert classify(huge, HISTORY).label in {"task", "follow_up"}


# --- the LLM classifier's request and reply ---------------------------------------------------


def test_the_llm_request_asks_for_a_json_object_with_the_history_and_the_labels() -> None:
    body = llm_request("gpt-4o-mini", "and the second?", HISTORY, DEFAULT_LABELS)
    assert body["response_format"] == {"type": "json_object"}
    assert body["temperature"] == 0 and body["max_tokens"] <= 300
    system, user = body["messages"]
    assert all(f"- {label}:" in system["content"] for label in DEFAULT_LABELS)
    assert "The Daily Loaf" in user["content"] and "and the second?" in user["content"]


def reply(**fields: Any) -> str:
    return json.dumps({"label": "question", "confidence": 0.9, **fields})


def test_a_full_reply_is_taken_as_it_is() -> None:
    content = reply(
        entities={"topic": "bread"},
        reasoning="asks about a name",
        is_ambiguous=True,
        alternative_label="follow_up",
        clarifying_question="Which name?",
    )
    assert parse_llm_reply(content, DEFAULT_LABELS) == Intent(
        "question",
        0.9,
        "llm",
        entities={"topic": "bread"},
        reasoning="asks about a name",
        is_ambiguous=True,
        alternative_label="follow_up",
        clarifying_question="Which name?",
    )


@pytest.mark.parametrize(
    ("fields", "label", "confidence"),
    [
        ({"label": "Follow-Up"}, "follow_up", 0.9),  # spelled loosely
        ({"label": "complaint"}, "other", 0.9),  # not a label
        ({"confidence": 7}, "question", 1.0),
        ({"confidence": -1}, "question", 0.0),
        ({"confidence": "0.25"}, "question", 0.25),
        ({"confidence": "high"}, "question", 0.5),
        ({"confidence": None}, "question", 0.5),
    ],
)
def test_replies_are_normalised(fields: dict[str, Any], label: str, confidence: float) -> None:
    intent = parse_llm_reply(reply(**fields), DEFAULT_LABELS)
    assert intent is not None
    assert (intent.label, intent.confidence, intent.method) == (label, confidence, "llm")


def test_wrong_types_in_optional_fields_are_dropped() -> None:
    content = reply(entities=["x"], reasoning=5, alternative_label="nope", is_ambiguous="yes")
    intent = parse_llm_reply(content, DEFAULT_LABELS)
    assert intent is not None
    assert (intent.entities, intent.reasoning, intent.alternative_label) == ({}, "", None)
    assert intent.is_ambiguous is False


def test_a_fenced_json_reply_is_read() -> None:
    assert parse_llm_reply("```json\n" + reply() + "\n```", DEFAULT_LABELS) is not None


@pytest.mark.parametrize(
    "content",
    [None, "", "question", "[1, 2]", '{"confidence": 0.9}', '{"label": 3}', "{not json"],
)
def test_a_reply_that_is_not_the_object_is_a_failure(content: Any) -> None:
    assert parse_llm_reply(content, DEFAULT_LABELS) is None


# --- configuration ---------------------------------------------------------------------------


def test_a_policy_must_name_a_label() -> None:
    with pytest.raises(ValueError, match=r"policies\.smalltalk"):
        IntentSettings(policies={"smalltalk": {"memory": False}})  # type: ignore[dict-item]
    assert IntentSettings(policies={"chitchat": {"memory": False}})  # type: ignore[dict-item]


def test_a_bad_pattern_is_a_config_error_naming_the_key(tmp_path: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "tenants:\n  t:\n    api_keys: [k]\n    intent:\n      labels:\n"
        "        bug: {description: defects, patterns: ['crash(']}\n"
    )
    with pytest.raises(ConfigError, match=r"tenants\.t\.intent\.labels\.bug\.patterns"):
        load_config(path)


def test_an_unknown_intent_upstream_is_a_config_error(tmp_path: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("tenants:\n  t:\n    api_keys: [k]\n    intent: {upstream: nowhere}\n")
    with pytest.raises(ConfigError, match=r"tenants\.t\.intent\.upstream"):
        load_config(path)


DATA = Path(__file__).resolve().parents[1] / "data"


def _texts() -> list[tuple[str, list[dict[str, Any]]]]:
    rows = []
    for name in ("intent_eval.jsonl", "intent_tune.jsonl"):
        with (DATA / name).open(encoding="utf-8") as lines:
            rows += [json.loads(line) for line in lines if line.strip()]
    return [(row["text"], row["history"]) for row in rows]


def test_each_labels_patterns_searched_at_once_find_what_each_alone_finds() -> None:
    # One search over all of a label's patterns first (most turns match none): the same
    # labels, confidences and reasons as searching each pattern, on both intent datasets.
    combined = KeywordClassifier()
    one_by_one = KeywordClassifier()
    one_by_one._compiled = tuple(replace(c, any_pattern=None) for c in one_by_one._compiled)
    assert all(c.any_pattern is not None for c in combined._compiled if c.patterns)
    texts = _texts()
    assert len(texts) > 500
    for text, history in texts:
        assert combined.classify(text, history) == one_by_one.classify(text, history), text


def test_a_pattern_with_a_backreference_is_searched_on_its_own() -> None:
    # Inside one alternation `\1` would name another group: such a label's patterns are
    # searched one by one.
    labels = {
        "echo": LabelSpec(
            description="a word twice", patterns=(r"^(again|more)\b", r"\b(\w+) \1\b")
        )
    }
    classifier = KeywordClassifier(labels)
    assert classifier.classify("it was very very good").label == "echo"
    assert classifier.classify("it was very good").label != "echo"


def test_intent_as_dict_is_every_field() -> None:
    intent = Intent(
        "task",
        0.7,
        "llm",
        entities={"topic": ["bread", {"kind": "rye"}]},
        reasoning="asks for a recipe",
        is_ambiguous=True,
        alternative_label="question",
        clarifying_question="which bread?",
    )
    assert intent.as_dict() == asdict(intent)
    assert intent.as_dict()["entities"] is not intent.entities  # (a copy, as asdict makes)
