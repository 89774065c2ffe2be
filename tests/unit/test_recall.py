"""Recall's ranking, packing and rendering (policies/recall.py), with plain data."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from policies.context import Budget, Recalled, assemble
from policies.recall import Turn, fit, pack, query_terms, rank, render
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


def test_a_hit_comes_with_the_turns_around_it_and_a_strong_one_with_two_after() -> None:
    chat = [turn(20 + seq, seq, f"turn {seq}") for seq in range(1, 13)]
    strong, weak = rank({22: 5.0, 29: 2.0}, chat, now=NOW)
    # The best hit (and any within STRONG_HIT of it) reaches the second turn after it, where
    # the answer to what matched often is; a weaker hit keeps one turn either side.
    assert [t.pk for t in strong.turns] == [21, 22, 23, 24]
    assert [t.pk for t in weak.turns] == [28, 29, 30]
    assert (strong.hits, weak.hits) == ([22], [29])
    _, wide = rank({22: 5.0, 29: 2.0}, chat, now=NOW, strong=0.1)
    assert [t.pk for t in wide.turns] == [28, 29, 30, 31]


def test_overlapping_windows_merge_and_more_hits_are_worth_more() -> None:
    excerpts = rank(
        {2: 1.0, 3: 4.0, 5: 2.0, 9: 4.0}, [*DIALOGUE, turn(9, 1, "x", conversation="c2")], now=NOW
    )
    merged = next(e for e in excerpts if e.turns[0].conversation == "c1")
    assert [t.pk for t in merged.turns] == [1, 2, 3, 4, 5]  # windows 1-3, 2-4 and 4-6 touch
    alone = next(e for e in excerpts if e.turns[0].conversation == "c2")
    assert merged.value > alone.value  # three hits beat one as strong as the best of them


def test_what_the_prompt_holds_is_not_recalled_again() -> None:
    excerpts = rank({3: 5.0}, DIALOGUE, now=NOW, exclude=["his NAME is biscuit,  he is a beagle"])
    assert excerpts == []  # the hit itself is in the prompt
    (excerpt,) = rank({3: 5.0}, DIALOGUE, now=NOW, exclude=["Biscuit is a lovely name"])
    assert [t.pk for t in excerpt.turns] == [2, 3, 5]


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
    # Each hit alone (no radius, and none counts as strong enough to bring a turn after it).
    excerpts = rank({t.pk: 1.0 for t in turns}, turns, now=NOW, radius=0, strong=2.0)
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
