"""Which memories matter for a turn: by words alone exactly as before embeddings, and with the
question's similarities a memory near it in meaning counts though it shares no word."""

from __future__ import annotations

from policies.memories import rank_by_words_and_meaning, rank_memories

# (pk, text), newest first, as recall reads them.
MEMORIES = [
    (4, "Owns a red bicycle, ridden to work every day"),
    (3, "Adopted a beagle puppy last spring"),
    (2, "Plays the cello in an amateur orchestra"),
    (1, "Bicycle repairs are done at the shop on Main Street"),
]
TERMS = ["bicycle", "chain"]


def test_without_similarities_the_ranking_is_the_words_alone() -> None:
    expected = rank_memories(TERMS, MEMORIES)
    assert expected == [4, 1]  # the shorter of the two that say "bicycle" first
    assert rank_by_words_and_meaning(TERMS, MEMORIES, {}, weight=1.0) == expected
    # Similarities of memories that are not candidates (gone, pinned) change nothing.
    assert rank_by_words_and_meaning(TERMS, MEMORIES, {99: 0.9}, weight=1.0) == expected


def test_a_memory_near_in_meaning_counts_though_it_shares_no_word() -> None:
    ranked = rank_by_words_and_meaning(["hound", "breed"], MEMORIES, {3: 0.62}, weight=1.0)
    assert ranked == [3]  # the others neither share a word nor are near
    both = rank_by_words_and_meaning(TERMS, MEMORIES, {3: 0.7, 4: 0.4}, weight=1.0)
    assert set(both) == {1, 3, 4}
    assert 2 not in both
