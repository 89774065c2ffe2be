"""The processing plan for attachments and tool results (policies/artifacts.py): everything
whole when it fits; otherwise by relevance, whole, passages, summary or out; a model's plan
checked, and either plan carried out within the budget."""

from __future__ import annotations

import json
from typing import Any

import pytest

from policies.artifact_prompts import parse_plan, planner_request
from policies.artifacts import (
    ARTIFACT_TOKENS,
    SECTION_TOKENS,
    Artifact,
    Choice,
    Passage,
    carry_out,
    fit,
    footprint,
    plan_by_rule,
    render,
    score_passages,
)
from policies.tokens import count_message, count_text


def doc(key: str, *texts: str, tokens_each: int = 100, title: str | None = None) -> Artifact:
    passages = tuple(Passage(i, t, tokens_each) for i, t in enumerate(texts))
    return Artifact(key, "attachment", title or key, tokens_each * len(texts), passages, "h-" + key)


FILLER = "The committee reviewed the minutes of the previous meeting without comment."
MANUAL = doc(
    "manual",
    FILLER,
    "To reset the router, hold the recessed button for ten seconds until the light blinks.",
    FILLER,
    "Warranty claims need the original receipt and the serial number.",
    FILLER,
)
SMALL = doc("note", "The router's admin password is printed under the device.", tokens_each=30)
RECIPE = doc("recipe", "Whisk the eggs with sugar, then fold in the flour.", tokens_each=40)


def test_everything_that_fits_goes_whole_without_ranking() -> None:
    artifacts = [MANUAL, SMALL]
    budget = SECTION_TOKENS + 500 + 30 + 2 * ARTIFACT_TOKENS
    relevance = score_passages("how do I reset the router?", artifacts)
    plan = plan_by_rule(artifacts, relevance, budget, summaries=False)
    assert [c.strategy for c in plan] == ["include_full", "include_full"]
    items = carry_out(plan, artifacts, relevance, budget, summaries=False)
    assert [(i.strategy, i.tokens) for i in items] == [("include_full", 500), ("include_full", 30)]


def test_a_document_larger_than_the_budget_gives_its_relevant_passages_only() -> None:
    artifacts = [MANUAL, SMALL, RECIPE]
    budget = 300
    relevance = score_passages("how do I reset the router?", artifacts)
    plan = plan_by_rule(artifacts, relevance, budget, summaries=False)
    items = {
        i.artifact.key: i for i in carry_out(plan, artifacts, relevance, budget, summaries=False)
    }
    assert items["manual"].strategy == "relevant_passages"
    assert [p.seq for p in items["manual"].passages] == [1]  # the reset passage, not the filler
    assert items["note"].strategy == "include_full"  # relevant and small
    assert items["recipe"].strategy == "exclude"  # no room left for what does not matter
    used = SECTION_TOKENS + sum(
        i.tokens + ARTIFACT_TOKENS for i in items.values() if i.strategy != "exclude"
    )
    assert used <= budget
    text = render(list(items.values()), {})
    assert "hold the recessed button" in text and "committee" not in text
    assert "[document, 500 tokens: 1 of 5 passages]\n> title: manual\n" in text


def test_a_large_document_nothing_matches_is_summarised_or_opened() -> None:
    artifacts = [MANUAL]
    relevance = score_passages("what is this about?", artifacts)
    (choice,) = plan_by_rule(artifacts, relevance, 250, summaries=True)
    assert choice.strategy == "summarize"
    (item,) = carry_out([choice], artifacts, relevance, 250, summaries=True)
    assert (item.strategy, item.summary_tokens) == (
        "summarize",
        250 - SECTION_TOKENS - ARTIFACT_TOKENS,
    )
    assert "a summary focused" in render([item], {"manual": "A router manual."})
    # Without summaries: its opening passages.
    (choice,) = plan_by_rule(artifacts, relevance, 250, summaries=False)
    (item,) = carry_out([choice], artifacts, relevance, 250, summaries=False)
    assert item.strategy == "relevant_passages"
    assert [p.seq for p in item.passages] == [0]


@pytest.mark.parametrize("budget", [0, 50, 120, 200, 333, 700, 2000])
def test_the_budget_holds_for_any_plan(budget: int) -> None:
    artifacts = [MANUAL, SMALL, RECIPE]
    relevance = score_passages("router reset warranty eggs", artifacts)
    for plan in (
        plan_by_rule(artifacts, relevance, budget, summaries=True),
        [Choice(a.key, "include_full", 1) for a in artifacts],
        [Choice(a.key, "summarize", i) for i, a in enumerate(artifacts)],
    ):
        items = carry_out(plan, artifacts, relevance, budget, summaries=True)
        included = [i for i in items if i.strategy != "exclude"]
        if included:
            assert SECTION_TOKENS + sum(i.tokens + ARTIFACT_TOKENS for i in included) <= budget


def test_a_models_plan_is_followed_by_priority_and_downgraded_to_fit() -> None:
    artifacts = [MANUAL, SMALL, RECIPE]
    relevance = score_passages("how do I reset the router?", artifacts)
    plan = [
        Choice("recipe", "include_full", 1),
        Choice("manual", "include_full", 2),  # too big for what is left: its passages
        Choice("note", "exclude", 3),
    ]
    items = {i.artifact.key: i for i in carry_out(plan, artifacts, relevance, 300, summaries=False)}
    assert (items["recipe"].strategy, items["manual"].strategy, items["note"].strategy) == (
        "include_full",
        "relevant_passages",
        "exclude",
    )
    assert items["manual"].record()["planned"] == "include_full"


def reply(plan: Any) -> str:
    return json.dumps({"plan": plan})


def test_the_planner_is_asked_with_previews_sizes_and_the_budget() -> None:
    body = planner_request("cheap", "reset?", [MANUAL, SMALL], 300)
    assert body["response_format"] == {"type": "json_object"}
    asked = body["messages"][1]["content"]
    assert 'key="manual" kind=attachment tokens=500\n> title: manual\n> ' in asked
    assert "hold the recessed button" in asked
    assert "300 tokens" in body["messages"][0]["content"]


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        reply([{"key": "manual", "strategy": "include_full", "priority": 1}]),  # one left out
        reply(
            [
                {"key": "manual", "strategy": "shrink", "priority": 1},
                {"key": "note", "strategy": "exclude", "priority": 2},
            ]
        ),
        reply(
            [
                {"key": "manual", "strategy": "exclude", "priority": "high"},
                {"key": "note", "strategy": "exclude", "priority": 2},
            ]
        ),
        reply(
            [
                {"key": "ghost", "strategy": "exclude", "priority": 1},
                {"key": "note", "strategy": "exclude", "priority": 2},
            ]
        ),
        reply(
            [
                {"key": "note", "strategy": "exclude", "priority": 1},
                {"key": "note", "strategy": "exclude", "priority": 2},
            ]
        ),
        json.dumps({"plan": "all of it"}),
        '{"plan": [{"key": "manual", "strategy": "exclude", "priority": 1e999},'
        ' {"key": "note", "strategy": "exclude", "priority": 2}]}',
        '{"plan": [{"key": "manual", "strategy": "exclude", "priority": NaN},'
        ' {"key": "note", "strategy": "exclude", "priority": 2}]}',
    ],
)
def test_a_plan_that_is_not_valid_is_refused(content: str) -> None:
    assert parse_plan(content, [MANUAL, SMALL]) is None


def test_a_valid_plan_is_read() -> None:
    content = reply(
        [
            {"key": "note", "strategy": "include_full", "priority": 2},
            {"key": "manual", "strategy": "relevant_passages", "priority": 1.0},
        ]
    )
    assert parse_plan(content, [MANUAL, SMALL]) == [
        Choice("note", "include_full", 2),
        Choice("manual", "relevant_passages", 1),
    ]


def test_passages_are_scored_by_the_questions_words() -> None:
    relevance = score_passages("warranty receipt", [MANUAL])
    assert relevance.best(MANUAL) == relevance.of(MANUAL, MANUAL.passages[3]) > 0
    assert relevance.of(MANUAL, MANUAL.passages[0]) == 0
    assert score_passages("the of and", [MANUAL]).scores == {}


def test_the_section_as_sent_fits_even_when_quoting_outgrows_the_estimates() -> None:
    # A table of short lines: quoting costs about a token a line, which the plan's estimates
    # (tokens of the text, a few per passage) do not see.
    lines = [f"{n},{n * 7},ok" for n in range(200)]
    rows = ["\n".join(lines[i : i + 50]) for i in range(0, 200, 50)]
    table = Artifact(
        "table",
        "attachment",
        "table",
        sum(count_text(r) for r in rows),
        tuple(Passage(i, r, count_text(r)) for i, r in enumerate(rows)),
        "h-table",
    )
    question = "which row says 77?"
    relevance = score_passages(question, [table, SMALL])
    relevance.scores[("table", 0)] = 2.0  # the passage that holds row 11 (77) matters most
    relevance.scores[("note", 0)] = 3.0  # and the note more than the table
    budget = footprint([table, SMALL]) + 10  # everything fits, by the estimates
    items = carry_out(
        plan_by_rule([table, SMALL], relevance, budget, summaries=False),
        [table, SMALL],
        relevance,
        budget,
        summaries=False,
    )
    assert [i.strategy for i in items] == ["include_full", "include_full"]
    assert count_message({"role": "system", "content": render(items, {})}) > budget
    fitted = fit(items, {}, relevance, budget)
    assert fitted.tokens == count_message({"role": "system", "content": fitted.text}) <= budget
    table_item, note_item = fitted.items
    assert note_item.strategy == "include_full"  # the more relevant one stays whole
    assert table_item.strategy == "relevant_passages"
    assert 0 in [p.seq for p in table_item.passages] and len(table_item.passages) < 4
    assert "11,77,ok" in fitted.text


def test_fit_leaves_out_everything_when_nothing_fits() -> None:
    relevance = score_passages("router", [MANUAL])
    (item,) = carry_out(
        [Choice("manual", "include_full", 1)], [MANUAL], relevance, 10_000, summaries=False
    )
    fitted = fit([item], {}, relevance, 5)
    assert (fitted.text, fitted.tokens) == ("", 0)
    assert [i.strategy for i in fitted.items] == ["exclude"]
