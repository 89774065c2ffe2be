"""Cutting documents into passages: never over the limit, never empty, in order, whole
paragraphs and sentences where they fit."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.chunks import chunk_text, counted_chunks
from policies.tokens import count_text


def words(text: str) -> list[str]:
    return re.findall(r"\S+", text)


def test_blank_text_has_no_passages() -> None:
    assert chunk_text("") == []
    assert chunk_text(" \n\n \t\n") == []


def test_a_short_text_is_one_passage() -> None:
    assert chunk_text("  Hello there.\n\nSecond paragraph.  ") == [
        "Hello there.\n\nSecond paragraph."
    ]


def test_whole_paragraphs_are_packed_together_while_they_fit() -> None:
    paragraphs = [f"Paragraph {i} " + "word " * 30 for i in range(10)]
    passages = chunk_text("\n\n".join(paragraphs), max_tokens=100)
    assert len(passages) > 1
    for passage in passages:
        assert count_text(passage) <= 100
        # no paragraph is cut: each passage is a run of whole paragraphs
        assert all(p.strip() in paragraphs[int(p.split()[1])] for p in passage.split("\n\n"))
    assert sum(len(p.split("\n\n")) for p in passages) == 10


def test_a_long_paragraph_is_cut_between_sentences() -> None:
    sentences = [f"Sentence number {i} talks about the harbour and its boats." for i in range(40)]
    passages = chunk_text(" ".join(sentences), max_tokens=60)
    assert len(passages) > 1
    for passage in passages:
        assert count_text(passage) <= 60
        assert passage.endswith(".")  # cut at sentence ends only
    assert " ".join(passages) == " ".join(sentences)


def test_one_huge_sentence_and_one_huge_word_are_hard_split() -> None:
    sentence = " ".join(f"w{i}" for i in range(2_000))
    blob = "x9Q" * 3_000
    passages = chunk_text(f"{sentence}\n\n{blob}", max_tokens=50)
    assert all(0 < count_text(p) <= 50 for p in passages)
    assert words(" ".join(passages))[:2_000] == words(sentence)
    assert "".join(words(" ".join(passages))[2_000:]) == blob


def test_counts_are_the_passages_real_counts_and_the_result_is_deterministic() -> None:
    text = "\n\n".join(
        f"Section {i}. " + "Lorem ipsum dolor sit amet. " * (i * 7) for i in range(8)
    )
    counted = counted_chunks(text, max_tokens=80)
    assert counted == counted_chunks(text, max_tokens=80)
    assert [p for p, _ in counted] == chunk_text(text, max_tokens=80)
    assert all(tokens == count_text(p) for p, tokens in counted)


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_text("text", max_tokens=0)


@settings(max_examples=60, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("ab cdé.!?\n\t-😀1")) | st.characters(codec="utf-8"),
        max_size=600,
    ),
    st.integers(min_value=4, max_value=40),
)
def test_no_passage_is_empty_or_over_the_limit_and_no_word_is_lost(
    text: str, max_tokens: int
) -> None:
    passages = chunk_text(text, max_tokens=max_tokens)
    assert all(p.strip() and count_text(p) <= max_tokens for p in passages)
    assert "".join(words(text)) == "".join("".join(words(p)) for p in passages)
