"""Token counting with tiktoken, picking the encoding for the model's family.

An encoding is built the first time a count needs it, not at import or start-up: building
one takes about a second and holds 40 MB (cl100k_base) or 70 MB (o200k_base) for good, and a
process may never need one of them. Callers on an event loop build them in a worker thread
first (`encodings_built`, `build_encodings`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import tiktoken

# Per-message framing overhead of the chat format (OpenAI's cookbook figures).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REPLY = 3


@lru_cache(maxsize=64)
def encoding_name(model: str) -> str:
    """o200k_base for the 4o/4.1/o-series/5 family, cl100k_base for everything else."""
    name = model.rsplit("/", 1)[-1].lower()
    if name.startswith(("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3", "o4", "chatgpt-4o")):
        return "o200k_base"
    return "cl100k_base"


# The encodings built so far, by name (tiktoken's own registry keeps them too).
_built: dict[str, tiktoken.Encoding] = {}


def _encoding(name: str) -> tiktoken.Encoding:
    found = _built.get(name)
    if found is None:
        found = _built[name] = tiktoken.get_encoding(name)  # (thread-safe: tiktoken locks)
    return found


def _needed(model: str) -> set[str]:
    """The encodings counting for `model` uses: its own, and the default one that budgets
    and stored texts are counted with (`count_text(text)`)."""
    return {encoding_name(model), encoding_name("")}


def encodings_built(model: str = "") -> bool:
    """Whether counting for `model` can start at once (no encoding left to build)."""
    return _needed(model) <= _built.keys()


def build_encodings(model: str = "") -> None:
    """Build the encodings counting for `model` uses, if not built yet (about a second each)."""
    for name in _needed(model):
        _encoding(name)


# Where a line begins with something other than a space or a slash: tiktoken's encodings
# (cl100k_base, o200k_base) cut a text into pieces before they merge bytes into tokens, and no
# piece holds a line break followed by anything but spaces, or (o200k_base: punctuation, line
# breaks and slashes are one piece) slashes. So a text's count is the sum of its lines' counts,
# cut here: the lines of the sections memproxy builds each turn (recall's excerpts, memories)
# come back turn after turn and are counted once (`_count_line`). tests/unit/test_tokens.py
# checks the sum against whole counts.
_LINE_STARTS = re.compile(r"(?<=\n)(?=[^\s/])")
# Lines counted are kept up to this many, of at most LINE_CHARS characters each (16 MB at
# most, a few MB for text that is mostly ASCII).
COUNTED_LINES = 4096
LINE_CHARS = 1000
# A text shorter than this is counted whole: looking its lines up would cost more.
SHORT_TEXT = 400


def count_text(text: str, model: str = "") -> int:
    name = encoding_name(model)
    if len(text) < SHORT_TEXT or "\n" not in text:
        return len(_encoding(name).encode(text, disallowed_special=()))
    return sum(_count_line(name, line) for line in _LINE_STARTS.split(text))


def _count_line(name: str, line: str) -> int:
    if len(line) > LINE_CHARS:
        return len(_encoding(name).encode(line, disallowed_special=()))
    return _counted_line(name, line)


@lru_cache(maxsize=COUNTED_LINES)
def _counted_line(name: str, line: str) -> int:
    return len(_encoding(name).encode(line, disallowed_special=()))


def message_text(message: dict[str, Any]) -> str:
    """The text a message contributes to the prompt: content (string or text parts),
    name, and tool call names and arguments."""
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
    if isinstance(message.get("name"), str):
        parts.append(message["name"])
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append(str(function.get("name", "")))
            parts.append(str(function.get("arguments", "")))
    return "\n".join(parts)


def count_message(message: dict[str, Any], model: str = "") -> int:
    return TOKENS_PER_MESSAGE + count_text(message_text(message), model)


def upper_bound_tokens(messages: list[dict[str, Any]]) -> int:
    """A cheap bound that no encoding exceeds (a token is at least one byte), so a precise
    count is needed only when the bound alone says a prompt might not fit."""
    return (
        sum(TOKENS_PER_MESSAGE + len(message_text(m).encode()) for m in messages) + TOKENS_PER_REPLY
    )


def count_messages(messages: list[dict[str, Any]], model: str = "") -> int:
    """Prompt tokens of a chat request, as the provider would count them (approximately)."""
    return sum(count_message(m, model) for m in messages) + TOKENS_PER_REPLY


def response_item_text(item: Any) -> str:
    """The text a Responses API input item contributes to the prompt: a message's content
    (a string or text parts), a function call's name and arguments, a call's output. Other
    items (reasoning, images) count as nothing here."""
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        return ""
    kind = item.get("type", "message")
    if kind == "message":
        return message_text({"content": item.get("content")})
    if kind == "function_call":
        return f"{item.get('name', '')}\n{item.get('arguments', '')}"
    if kind == "function_call_output":
        output = item.get("output")
        return output if isinstance(output, str) else message_text({"content": output})
    return ""


def count_response_input(instructions: Any, items: list[Any], model: str = "") -> int:
    """Input tokens of a Responses API request, counted as its translation to chat
    completions would send it (approximately): `instructions` as a system message, each
    input item as a message."""
    texts = [instructions] if isinstance(instructions, str) and instructions else []
    texts += [response_item_text(item) for item in items]
    return sum(TOKENS_PER_MESSAGE + count_text(text, model) for text in texts) + TOKENS_PER_REPLY
