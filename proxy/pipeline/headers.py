"""memproxy's response headers of a turn (DESIGN.md, response headers), whatever its protocol:
what was attached and whether memory was degraded."""

from __future__ import annotations

from policies.context import Assembly
from proxy.pipeline.turn import Turn


def memory_headers(
    turn: Turn | None,
    assembly: Assembly | None,
    degraded: bool,
    recalled: int = 0,
    attachments: int = 0,
    *,
    unstored: bool = False,
) -> dict[str, str]:
    """`unstored`: neither the database nor the spill could keep the turn (fail-open)."""
    headers = {
        "x-memory-context-tokens": str(assembly.context_tokens if assembly else 0),
        "x-memory-history-messages": str(assembly.history_messages if assembly else 0),
        "x-memory-memories": str(recalled),
        "x-memory-attachments": str(attachments),
        "x-memory-status": "degraded" if degraded else "ok",
    }
    if unstored:
        headers["x-memory-stored"] = "false"
    if turn is not None and turn.conversation_id:
        headers["x-memory-conversation-id"] = turn.conversation_id
    return headers
