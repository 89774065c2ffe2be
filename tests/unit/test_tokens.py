from __future__ import annotations

import tiktoken
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies.tokens import (
    SHORT_TEXT,
    count_messages,
    count_text,
    encoding_name,
    upper_bound_tokens,
)


def test_model_families_get_their_encoding() -> None:
    assert encoding_name("gpt-4o-mini") == "o200k_base"
    assert encoding_name("openai/gpt-4.1") == "o200k_base"
    assert encoding_name("gpt-4") == "cl100k_base"
    assert encoding_name("anthropic/claude-3-5-haiku") == "cl100k_base"


def test_counts_are_real_tiktoken_counts() -> None:
    assert count_text("hello world", "gpt-4") == 2
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}],
    }
    assert count_messages([message], "gpt-4") > 3 + 3  # the call's name and arguments count


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(st.text(max_size=200), min_size=1, max_size=5), st.sampled_from(["gpt-4", "gpt-4o"])
)
def test_upper_bound_never_undercounts(texts: list[str], model: str) -> None:
    messages = [{"role": "user", "content": t} for t in texts]
    assert upper_bound_tokens(messages) >= count_messages(messages, model)


def test_fields_of_the_wrong_type_count_nothing_and_raise_nothing() -> None:
    """An upstream's malformed reply is counted (for its bill and its stored row) before
    anything judges it."""
    plain = count_messages([{"role": "assistant", "content": None}], "gpt-4")
    for odd in (7, "xyz", {"a": 1}, [3, None, {"function": "f"}]):
        message = {"role": "assistant", "content": {"a": 1}, "tool_calls": odd}
        assert count_messages([message], "gpt-4") == plain


# Texts built of what splits a text into tiktoken's pieces: line breaks, spaces and tabs
# around them, punctuation before them, letters, digits, contractions, non-Latin letters.
_PIECES = st.sampled_from(
    [
        "\n",
        "\n\n",
        "\r\n",
        " ",
        "  ",
        "\t",
        ".",
        "!\n",
        "?",
        "'s",
        "'ll",
        " -",
        "//",
        "a",
        "The",
        " word",
        "12",
        "3456",
        "é",
        "日本",
        "🙂",
        "\u00a0",
        "<|endoftext|>",
        "x\n ",
        " \n",
        "\n- ",
        "/",
        "/path",
        "),",
        ">",
        "`",
    ]
)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(_PIECES, max_size=120), st.sampled_from(["gpt-4", "gpt-4o"]))
# o200k_base keeps punctuation, line breaks and the slashes after them in one piece
@example(["- [x]\n", "/path"], "gpt-4o")
@example(["int main() {\n  return 0;\n}\n// done\n"], "gpt-4o")
@example(["),\n", "/usr", "\n"], "gpt-4o")
def test_a_text_counted_line_by_line_counts_what_tiktoken_counts_whole(
    pieces: list[str], model: str
) -> None:
    text = "".join(pieces)
    text *= SHORT_TEXT // max(1, len(text)) + 1  # (long enough to be counted by its lines)
    whole = tiktoken.get_encoding(encoding_name(model)).encode(text, disallowed_special=())
    assert count_text(text, model) == len(whole)
    assert count_text(text, model) == len(whole)  # again, its lines counted already


def test_a_section_counted_again_or_changed_counts_what_tiktoken_counts() -> None:
    encoding = tiktoken.get_encoding("cl100k_base")
    lines = [
        f"- [2026-03-{d:02d}] user: we spoke of item {d}, and then some.\n" for d in range(1, 29)
    ]
    section = "Relevant earlier turns:\n" + "".join(lines) + "\n(end)"
    changed = section.replace("item 7,", "item 7, a cat called Miso,")
    assert [count_text(section), count_text(section)] == [len(encoding.encode(section))] * 2
    assert count_text(changed) == len(encoding.encode(changed))
