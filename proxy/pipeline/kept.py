"""One request's side of `context.keep_shown` (proxy/pipeline/shown.py): the sections its
conversation's earlier turns were shown that its prompt holds the turns of (resent by the
client, or a Responses chain memproxy sends again), recall's budget for its own, and the
conversation's sections after it. Positions and anchors are in the prompt's order as the
upstream gets it (NeutralTurn.prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.identity import chain_hashes
from proxy.pipeline.identify import TurnRequest
from proxy.pipeline.shown import Key, Shown
from proxy.pipeline.turn import Turn

# The share of the budget one turn's new section may take while sections are kept.
TURN_SHARE = 0.125


@dataclass(slots=True)
class Kept:
    """One request's kept sections: (the index of the client message each goes before, the
    section), and what it needs to remember its own."""

    key: Key
    hashes: list[str]
    sections: list[tuple[int, Shown]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for _, s in self.sections)

    @property
    def turns(self) -> list[str]:
        return [t for _, s in self.sections for t in s.turns]

    def budget(self, recall_budget: int, token_budget: int) -> int:
        """Recall's budget for this turn's new section; the kept sections all let go first
        when what they leave would not hold one."""
        share = int(token_budget * TURN_SHARE)
        if recall_budget - self.tokens < share:
            self.sections = []
        return min(share, recall_budget - self.tokens)


def kept_for(req: TurnRequest, turn: Turn | None) -> Kept | None:
    """The sections to keep for this request (None: the tenant does not keep them, or there
    is nothing to keep them for)."""
    # (the prompt as the upstream gets it: a chain memproxy sends again is in it, in place)
    ctx, messages = req.principal.tenant.context, req.turn.prompt
    if (
        not ctx.keep_shown
        or ctx.placement != "before_last_user"
        or turn is None
        or turn.conversation is None
        # (history the upstream keeps, a chain or a conversation: no place to keep them in)
        or not (req.turn.attach_history or req.turn.prefix)
        or not messages
        or messages[-1].get("role") != "user"
    ):
        return None
    conversation = turn.conversation
    key = (
        req.tenant_id,
        turn.user_id,
        conversation.id,
        conversation.pk,
        conversation.created_at.timestamp(),
    )
    hashes = chain_hashes(messages)
    at = {h: i for i, h in enumerate(hashes)}
    shown = req.services.shown.get(key)
    kept = Kept(key, hashes, sorted((at[s.anchor], s) for s in shown if s.anchor in at))
    # (this turn's own section, if it is a retry, is made again)
    kept.sections = [(i, s) for i, s in kept.sections if i < len(messages) - 1]
    return kept


def remember(req: TurnRequest, kept: Kept, text: str | None, tokens: int, turns: list[str]) -> None:
    """The conversation's sections from now on: the kept ones and this turn's (if any)."""
    if req.dry_run:
        return
    sections = [s for _, s in kept.sections]
    if text:
        sections.append(Shown(kept.hashes[-1], text, tokens, tuple(turns)))
    req.services.shown.put(kept.key, sections)
