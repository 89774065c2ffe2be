"""What earlier turns of a conversation were shown (`context.keep_shown`), so that a client
that resends its history gets each turn's context section again where it was, byte for byte,
and the prompt's prefix stays what the provider cached.

Each section is anchored to the chain hash of the client's messages up to the user message it
went before: a later request that resends that message gets the section back right before
it; one that went another way (an edited or regenerated turn) does not. Recall leaves out the
stored turns the kept sections show, and a new turn adds at most TURN_SHARE of the budget, so
the sections add up slowly; when the next would not fit what the kept ones leave of the
budget, they are all let go (the prefix breaks there once) and the turn starts afresh.

Kept in the process, per conversation, bounded (the least recently used conversations go
first): after a restart, or on another replica, a conversation starts afresh the same way."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Conversations remembered.
CONVERSATIONS = 10_000


@dataclass(frozen=True, slots=True)
class Shown:
    """One turn's context section."""

    anchor: str  # chain hash of the client's messages through the user message it preceded
    text: str
    tokens: int
    turns: tuple[str, ...]  # the recalled turns' texts (recall leaves them out afterwards)


class ShownContexts:
    """Per (tenant, conversation), the sections its turns were shown, oldest first."""

    def __init__(self, conversations: int = CONVERSATIONS) -> None:
        self._kept: OrderedDict[tuple[str, str], list[Shown]] = OrderedDict()
        self._conversations = conversations

    def get(self, key: tuple[str, str]) -> list[Shown]:
        shown = self._kept.get(key, [])
        if shown:
            self._kept.move_to_end(key)
        return shown

    def put(self, key: tuple[str, str], shown: list[Shown]) -> None:
        self._kept[key] = shown
        self._kept.move_to_end(key)
        while len(self._kept) > self._conversations:
            self._kept.popitem(last=False)
