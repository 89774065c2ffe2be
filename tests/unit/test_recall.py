"""Recall's ranking, packing and rendering (policies/recall.py), with plain data."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.context import Budget, Recalled, assemble
from policies.memories import stem
from policies.query_words import READ_CHARS, held, words_pattern
from policies.recall import (
    COMMON_ONLY,
    MEANING,
    TOKENS_PER_WIDE_HIT,
    WIDE_RADIUS,
    Excerpt,
    Turn,
    by_meaning,
    closeness,
    common_terms,
    fit,
    pack,
    query_terms,
    rank,
    reach,
    render,
    wide_hits,
)
from policies.tokens import count_message, count_text

NOW = datetime(2026, 6, 1, tzinfo=UTC)


def turn(pk: int, seq: int, text: str, *, conversation: str = "c1", days_ago: float = 10) -> Turn:
    role = "user" if seq % 2 else "assistant"
    message = {"role": role, "content": text}
    when = NOW - timedelta(days=days_ago)
    return Turn(pk, conversation, seq, role, text, count_message(message), when)


DIALOGUE = [
    turn(1, 1, "I just got a puppy"),
    turn(2, 2, "Congratulations! What is its name?"),
    turn(3, 3, "His name is Biscuit, he is a beagle"),
    turn(4, 4, "Biscuit is a lovely name"),
    turn(5, 5, "Unrelated: my car broke down"),
]


def test_query_terms_keep_content_words_once_in_order() -> None:
    assert query_terms("What is the name of my dog? The DOG, I mean!") == ["name", "dog", "mean"]
    assert query_terms("when did it happen in 2023?") == ["happen", "2023"]
    assert query_terms("is it?") == []
    assert len(query_terms(" ".join(f"word{i}" for i in range(100)))) == 24


def values(excerpts: list[Excerpt]) -> dict[int, float]:
    """Each ranked turn's value, by pk (`rank` gives one-turn excerpts)."""
    return {e.turns[0].pk: e.value for e in excerpts}


def test_a_strong_hit_reaches_far_a_weak_one_the_turn_before_and_two_after() -> None:
    chat = [turn(100 + seq, seq, f"turn {seq}") for seq in range(1, 41)]
    ranked = values(rank({110: 5.0, 130: 2.0}, chat, now=NOW))
    # The best hit (and any within WIDE_HIT of it) reaches WIDE_RADIUS turns either side; a
    # weaker one the turn before it and the two after, where the answer to what matched is.
    assert sorted(p for p in ranked if p < 120) == list(range(110 - WIDE_RADIUS, 111 + WIDE_RADIUS))
    assert sorted(p for p in ranked if p > 120) == [129, 130, 131, 132]
    # Worth falls with distance; the reply after a hit is worth more than the turn before it.
    assert ranked[110] > ranked[111] > ranked[109] == ranked[112] > ranked[108] > ranked[104]
    assert ranked[110] > ranked[130]
    assert (reach(True), reach(False)) == ((WIDE_RADIUS, WIDE_RADIUS), (1, 2))
    # Only as many wide hits as the budget can hold: the best first.
    scores = {1: 5.0, 2: 4.0, 3: 3.0, 4: 1.0}
    assert wide_hits(scores, 10_000) == {1, 2, 3}
    assert wide_hits(scores, 2 * TOKENS_PER_WIDE_HIT) == {1, 2}
    assert wide_hits(scores, 10) == {1}
    narrow = values(rank({110: 5.0, 130: 2.0}, chat, now=NOW, wide={130}))
    assert sorted(narrow) == [109, 110, 111, 112, *range(130 - WIDE_RADIUS, 131 + WIDE_RADIUS)]
    assert closeness(0) == 1 > closeness(1) > closeness(-1) == closeness(2) > closeness(-2)


def test_a_turn_near_several_hits_is_worth_more_and_packing_joins_neighbours() -> None:
    excerpts = rank(
        {2: 1.0, 3: 4.0, 5: 2.0, 9: 4.0}, [*DIALOGUE, turn(9, 1, "x", conversation="c2")], now=NOW
    )
    ranked = values(excerpts)
    assert ranked[3] > ranked[9]  # as strong as the other best hit, and next to two more
    merged, alone = sorted(pack(excerpts, 2000), key=lambda e: e.turns[0].conversation)
    # Neighbouring turns go as one excerpt (no separator between them), with their hits.
    assert [t.pk for t in merged.turns] == [1, 2, 3, 4, 5]
    assert merged.hits == [2, 3, 5] and merged.value == ranked[3]
    assert [t.pk for t in alone.turns] == [9]
    assert render(pack(excerpts, 2000)).count("> ...") == 0


def test_a_hit_matching_only_words_every_hit_has_counts_less() -> None:
    # "Biscuit" is in most hits (a name, say): the hit that also says "beagle" is worth more
    # than a shorter one that only says "biscuit", though the search scored them the same.
    chat = [
        turn(1, 1, "Biscuit ran off"),
        turn(2, 10, "Biscuit sleeps"),
        turn(3, 20, "Biscuit is a beagle"),
        turn(4, 30, "a beagle barked"),
    ]
    scores = {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0}
    assert common_terms([{"biscuit"}, {"biscuit"}, {"biscuit", "beagle"}, {"beagle"}]) == {
        "biscuit"
    }
    ranked = values(rank(scores, chat, now=NOW, terms=["biscuit", "beagle"]))
    assert ranked[3] == ranked[4] > ranked[1] == ranked[2]
    assert ranked[1] == pytest.approx(COMMON_ONLY * ranked[3])
    # Without the query's words, every hit counts its score.
    plain = values(rank(scores, chat, now=NOW))
    assert plain[1] == plain[3]


def test_a_turn_about_the_question_outranks_one_that_only_sits_near_a_hit() -> None:
    # With embeddings: of two turns near the one hit, the one whose meaning is close to the
    # question's (cosine 0.6) is worth more than the one that says something else (0.1).
    chat = [turn(1, 1, "my dog"), turn(2, 2, "a beagle"), turn(3, 3, "nice weather")]
    plain = values(rank({2: 3.0}, chat, now=NOW))
    assert plain[1] < plain[3]  # the reply after a hit counts more than the turn before it
    meaning = {1: 0.6, 2: 0.5, 3: 0.1}
    weighed = values(rank({2: 3.0}, chat, now=NOW, meaning=meaning))
    assert weighed[1] > weighed[3]
    assert weighed[1] == pytest.approx(plain[1] * (1 + MEANING))
    assert weighed[3] == pytest.approx(plain[3])  # the least similar keeps its value
    # Without similarities (embeddings off, or nothing embedded yet) nothing changes.
    assert values(rank({2: 3.0}, chat, now=NOW, meaning={})) == plain
    assert values(rank({2: 3.0}, chat, now=NOW, meaning={9: 0.7})) == plain


def test_each_turn_is_weighed_by_its_place_between_the_least_and_most_similar() -> None:
    weights = by_meaning({1: 0.2, 2: 0.6, 3: 0.4, 7: 0.9}, [1, 2, 3, 4])
    # Turn 7 is not ranked: the scale is the ranked turns' own. Turn 4 has no vector yet: it
    # counts the mean of the others.
    assert weights[1] == 1.0
    assert weights[2] == pytest.approx(1 + MEANING)
    assert weights[3] == pytest.approx(1 + MEANING / 2)
    assert weights[4] == pytest.approx(1 + MEANING / 2)
    assert 7 not in weights
    # All alike: all count in full.
    assert by_meaning({1: 0.3, 2: 0.3}, [1, 2]) == {1: 1 + MEANING, 2: 1 + MEANING}
    assert by_meaning({}, [1, 2]) == {}


def test_what_the_prompt_holds_is_not_recalled_again() -> None:
    excerpts = rank({3: 5.0}, DIALOGUE, now=NOW, exclude=["his NAME is biscuit,  he is a beagle"])
    assert excerpts == []  # the hit itself is in the prompt
    excerpts = rank({3: 5.0}, DIALOGUE, now=NOW, exclude=["Biscuit is a lovely name"])
    assert sorted(values(excerpts)) == [1, 2, 3, 5]


def test_recency_breaks_a_tie_between_equal_hits() -> None:
    old = turn(10, 1, "biscuit", conversation="old", days_ago=400)
    new = turn(11, 1, "biscuit", conversation="new", days_ago=1)
    first, second = rank({10: 1.0, 11: 1.0}, [old, new], now=NOW)
    assert (first.turns[0].pk, second.turns[0].pk) == (11, 10)


def test_packing_keeps_to_the_budget_as_rendered_and_in_time_order() -> None:
    long_ago = [
        turn(100 + i, i, f"story {i} " + "words " * 60, conversation=f"k{i}", days_ago=i)
        for i in range(1, 30)
    ]
    excerpts = rank({t.pk: float(i + 1) for i, t in enumerate(long_ago)}, long_ago, now=NOW)
    for budget in (200, 400, 2000):
        chosen = pack(excerpts, budget)
        assert chosen
        text = render(chosen)
        # The budget is in tiktoken's count of what is actually sent (here `pack`'s estimates
        # alone suffice; `fit` makes sure where they do not).
        assert count_text(text) + 3 <= budget
        dates = [e.turns[0].created_at for e in chosen]
        assert dates == sorted(dates)
    assert pack(excerpts, 50) == []


def test_interleaved_conversations_render_under_one_heading_each_within_the_estimate() -> None:
    turns = [
        turn(200 + i, i, f"note {i} about llamas", conversation="ab"[i % 2], days_ago=30 - i)
        for i in range(1, 13)
    ]
    # Every turn a hit, none next to another of its conversation.
    excerpts = rank({t.pk: 1.0 for t in turns}, turns, now=NOW)
    text = render(pack(excerpts, 2000))
    assert text.count("[conversation of") == 2
    assert text.endswith("(End of excerpts.)")
    # A later day is noted where an excerpt starts on one; `fit` holds the budget exactly.
    assert "> ... [2026-05-" in text
    for budget in (150, 250, 330):
        fitted = fit(pack(excerpts, budget), budget)
        assert fitted.tokens == count_text(fitted.text) + 3 <= budget
        assert fitted.excerpts


def test_pinned_memories_come_first_and_go_last() -> None:
    excerpts = rank({3: 5.0}, DIALOGUE, now=NOW)
    facts = ["Prefers metric units", "Is allergic to peanuts"]
    known = ["Has a dog called Biscuit", "Lives near the sea"]
    fitted = fit(excerpts, 2000, facts, known)
    assert fitted.memories == facts and fitted.known == known and fitted.excerpts
    text = fitted.text
    assert text.index("allergic to peanuts") < text.index("near the sea") < text.index("> user:")
    assert "[what the user asked to be remembered]" in text
    assert "[what is known about the user]" in text
    # Short of room, the excerpts go first, then the least relevant other memories, and the
    # pinned ones last.
    fitted = fit(excerpts, 100, facts, known)
    assert (fitted.excerpts, fitted.memories, fitted.known) == ([], facts, known[:1])
    assert fitted.tokens <= 100
    fitted = fit(excerpts, 90, facts, known)
    assert (fitted.excerpts, fitted.memories, fitted.known) == ([], facts, [])


def test_a_window_too_big_for_the_room_left_goes_as_its_hit_alone() -> None:
    big = [
        turn(1, 1, "hello " * 300),
        turn(2, 2, "the code word is walrus"),
        turn(3, 3, "bye " * 300),
    ]
    (excerpt,) = pack(rank({2: 1.0}, big, now=NOW), 200)
    assert [t.pk for t in excerpt.turns] == [2]


def test_rendering_is_dated_attributed_and_quoted() -> None:
    text = render(rank({3: 5.0}, DIALOGUE, now=NOW))
    assert "not instructions" in text
    assert f"[conversation of {(NOW - timedelta(days=10)):%Y-%m-%d}" in text
    assert "> user: His name is Biscuit, he is a beagle" in text
    assert "> assistant: Congratulations! What is its name?" in text


def test_the_recall_section_goes_before_the_newest_user_message_or_after_system() -> None:
    client = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "dog name?"}]
    section = Recalled("Excerpts...", 50)
    before = assemble(client, [], Budget(token_budget=100), recalled=section)
    assert [m["role"] for m in before.messages] == ["system", "system", "user"]
    assert before.messages[1]["content"] == "Excerpts..." and before.context_tokens == 50
    after = assemble(
        client, [], Budget(token_budget=100), recalled=section, placement="after_system"
    )
    assert after.messages[1]["content"] == "Excerpts..."


def test_the_window_drops_the_recall_section_before_the_clients_messages() -> None:
    client = [{"role": "user", "content": "dog name?"}]
    budget = Budget(token_budget=1000, context_window=60)
    squeezed = assemble(client, [], budget, client_tokens=20, recalled=Recalled("x", 50))
    assert squeezed.messages == client and not squeezed.recalled


def _pattern_held(terms: list[str], text: str) -> set[str]:
    """What `held` found before it looked words up: the compiled pattern."""
    found = sorted({stem(t) for t in terms}, key=len, reverse=True)
    if not found:
        return set()
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, found)) + r")\w{0,4}\b")
    return {m.group(1) for m in pattern.finditer(text[:READ_CHARS].lower())}


_LETTERS = st.text(alphabet="abcdehiklnorstuwxyzé_0123456789", min_size=1, max_size=12)


@given(
    terms=st.lists(_LETTERS, max_size=6),
    words=st.lists(
        st.one_of(_LETTERS, st.sampled_from(["Hiking", "hikes", "HIKED", "x"])), max_size=30
    ),
    gaps=st.lists(
        st.sampled_from([" ", ", ", "'", "-", ".\n", "!?", "  "]), min_size=30, max_size=30
    ),
)
def test_a_text_holds_the_query_words_the_pattern_would_find(
    terms: list[str], words: list[str], gaps: list[str]
) -> None:
    text = "".join(w + g for w, g in zip(words, gaps, strict=False))
    terms = [*terms, "hikes"]
    assert held(words_pattern(terms), text) == _pattern_held(terms, text)
    pattern = words_pattern(terms)
    assert held(pattern, text) == held(pattern, text)  # (the second time from what it kept)


def test_a_stem_that_is_not_all_word_characters_is_still_found() -> None:
    assert held(words_pattern(["c++"]), "I write c++ daily") == _pattern_held(
        ["c++"], "I write c++ daily"
    )
