"""What earlier turns of a conversation were shown (`context.keep_shown`), so that a client
that resends its history gets each turn's context section again where it was, byte for byte,
and the prompt's prefix stays what the provider cached.

Each section is anchored to the chain hash of the prompt's messages, in the order the upstream
gets them (NeutralTurn.prompt: the client's, with a Responses chain memproxy sends again in its
place), up to the user message it went before: a later request whose prompt holds that message
again gets the section back right before it; one that went another way (an edited or
regenerated turn) does not. Recall leaves out the stored turns the kept sections show, and a
new turn adds at most TURN_SHARE of the budget, so the sections add up slowly; when the next
would not fit what the kept ones leave of the budget, they are all let go (the prefix breaks
there once) and the turn starts afresh.

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

    anchor: str  # chain hash of the prompt's messages through the user message it preceded
    text: str
    tokens: int
    turns: tuple[str, ...]  # the recalled turns' texts (recall leaves them out afterwards)


# (tenant, user, conversation id, its row and when it was made): a conversation deleted and
# made again under the same id (a client's own ids) is another conversation.
Key = tuple[str, str, str, int, float]


class ShownContexts:
    """Per conversation (Key), the sections its turns were shown, oldest first."""

    def __init__(self, conversations: int = CONVERSATIONS) -> None:
        self._kept: OrderedDict[Key, list[Shown]] = OrderedDict()
        self._conversations = conversations

    def forget(self, tenant_id: str, user_id: str) -> int:
        """Let go of a user's sections (the user is erased); how many conversations'."""
        gone = [k for k in self._kept if k[0] == tenant_id and k[1] == user_id]
        for key in gone:
            del self._kept[key]
        return len(gone)

    def get(self, key: Key) -> list[Shown]:
        shown = self._kept.get(key, [])
        if shown:
            self._kept.move_to_end(key)
        return shown

    def put(self, key: Key, shown: list[Shown]) -> None:
        self._kept[key] = shown
        self._kept.move_to_end(key)
        while len(self._kept) > self._conversations:
            self._kept.popitem(last=False)
