"""`memproxy`'s read commands against a running server's management API: `trace`,
`conversations` and `memories` (docs/reference/cli.md). Readable tables by default, the API's
JSON with `--json`; the server from `--url` / `MEMPROXY_URL`, the key from `--key` /
`MEMPROXY_KEY` (a `manage`-scoped one)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

DEFAULT_URL = "http://127.0.0.1:8080"
COMMANDS = ("trace", "conversations", "memories")
TIMEOUT = 30.0


class ClientError(Exception):
    """What the command could not do, as one line for the user (exit status 1)."""


def add_commands(sub: Any) -> None:
    """The read commands, on the `memproxy` parser's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the server (default: $MEMPROXY_URL or {DEFAULT_URL})")
    common.add_argument("--key", help="a manage-scoped API key (default: $MEMPROXY_KEY)")
    common.add_argument("--json", action="store_true", help="print the API's JSON")
    trace = sub.add_parser(
        "trace", parents=[common], help="what the model saw for one exchange, and why"
    )
    trace.add_argument("request_id", help="the exchange's id (its x-request-id header)")
    conversations = sub.add_parser(
        "conversations", parents=[common], help="a user's conversations, newest first"
    )
    conversations.add_argument("--user", required=True, help="the end user")
    conversations.add_argument("--limit", type=int, default=20, help="default: 20 (at most 100)")
    memories = sub.add_parser("memories", parents=[common], help="a user's memories")
    memories.add_argument("--user", required=True, help="the end user")
    memories.add_argument("--search", help="only those holding these words, best match first")
    memories.add_argument("--limit", type=int, default=20, help="default: 20 (at most 100)")


def run(args: argparse.Namespace) -> int:
    """Run one read command; its exit status (errors: one line on stderr, status 1 or 2)."""
    key = args.key or os.environ.get("MEMPROXY_KEY")
    if not key:
        print("memproxy: no API key: pass --key or set MEMPROXY_KEY", file=sys.stderr)
        return 2
    url = (args.url or os.environ.get("MEMPROXY_URL") or DEFAULT_URL).rstrip("/")
    url = url.removesuffix("/v1")
    try:
        with httpx.Client(
            base_url=url + "/v1/memory",
            headers={"authorization": f"Bearer {key}"},
            timeout=TIMEOUT,
        ) as http:
            data = _fetch(http, args)
    except ClientError as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return 1
    console = Console(soft_wrap=args.json, width=None if sys.stdout.isatty() else 140)
    if args.json:
        console.print_json(json.dumps(data))
    elif args.command == "trace":
        show_trace(console, data)
    elif args.command == "conversations":
        show_conversations(console, data)
    else:
        show_memories(console, data)
    return 0


def _fetch(http: httpx.Client, args: argparse.Namespace) -> Any:
    if args.command == "trace":
        # (one path segment, whatever it holds: `a/../..` names no other endpoint)
        return _get(http, f"/exchanges/{quote(args.request_id, safe='')}/trace")
    params: dict[str, Any] = {"user": args.user, "limit": args.limit}
    if args.command == "conversations":
        return _get(http, "/conversations", params)
    if args.search:
        params["q"] = args.search
    return _get(http, "/memories", params)


def _get(http: httpx.Client, path: str, params: dict[str, Any] | None = None) -> Any:
    try:
        response = http.get(path, params=params)
    except httpx.TransportError as exc:
        raise ClientError(f"cannot reach the server at {http.base_url.join('/')}: {exc}") from exc
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code < 400 and body is not None:
        return body
    try:
        message = " ".join(str(body["error"]["message"]).split())
    except (KeyError, TypeError):
        raise ClientError(
            f"{response.url} answered {response.status_code} {response.reason_phrase}, not as "
            "memproxy's API does: is --url (or MEMPROXY_URL) a memproxy server?"
        ) from None
    if response.status_code in (401, 403):
        raise ClientError(f"the server refused the key ({response.status_code}): {message}")
    raise ClientError(f"{response.status_code}: {message}")


def _when(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M")


def _text(value: Any, limit: int = 80) -> str:
    """Stored text on one line, cut to `limit`, safe from rich's markup (`[bold]` in a
    message is shown as written)."""
    text = value if isinstance(value, str) else json.dumps(value)
    text = " ".join(text.split())
    return escape(text if len(text) <= limit else text[: limit - 1] + "…")


def _e(value: Any) -> str:
    """A value from the server, safe from rich's markup."""
    return escape(str(value))


def _header(console: Console, t: dict[str, Any]) -> None:
    usage, cost = t.get("usage") or {}, t.get("cost") or {}
    cut = "  (cut: " + ", ".join(t["truncated"]) + ")" if t["truncated"] else ""
    console.print(f"[bold]Exchange {_e(t['id'])}[/bold]  {_e(t['status'])}  model {_e(t['model'])}")
    console.print(
        f"user {_e(t['user'])}  conversation {_e(t['conversation_id'])}  at "
        f"{_when(t['created_at'])}  trace {_e(t['level'])}{_e(cut)}"
    )
    console.print(
        f"tokens: prompt {usage.get('prompt_tokens', '-')}, "
        f"completion {usage.get('completion_tokens', '-')}  cost: ${cost.get('usd')}"
        f" (upstream {cost.get('upstream_usd')}, memory {cost.get('memory_usd')})"
    )


def _sections(t: dict[str, Any]) -> Table:
    budget = t.get("budget") or {}
    table = Table(title=f"Context added (budget {_e(budget.get('token_budget', '-'))} tokens)")
    for column in ("section", "considered", "chosen", "left out", "tokens"):
        table.add_column(column, justify="left" if column == "section" else "right")
    for name, s in (t.get("sections") or {}).items():
        figures = (s.get(k) for k in ("considered", "chosen", "left_out", "tokens"))
        table.add_row(_e(name), *(_e(f) for f in figures))
    return table


def _candidates(recall: dict[str, Any]) -> Table:
    shown = len(recall["candidates"])
    table = Table(title=f"Recall candidates (best {shown} of {recall['ranked']} ranked)")
    for column in ("message", "conversation", "seq", "role", "score", "hit", "tokens", "packed"):
        table.add_column(column)
    for c in recall["candidates"]:
        table.add_row(
            _e(c["message"]),
            _e(c["conversation_id"]),
            _e(c["seq"]),
            _e(c["role"]),
            f"{c['score']:.3f}",
            "yes" if c["hit"] else "",
            _e(c["tokens"]),
            "[green]packed[/green]" if c["packed"] else "",
        )
    return table


def show_trace(console: Console, t: dict[str, Any]) -> None:
    """A trace as tables: the exchange, the sections against the budget, recall's
    candidates, the intent, timings and anything degraded."""
    _header(console, t)
    console.print(_sections(t))
    recall = t.get("recall")
    if recall:
        hits = recall["hits"]
        console.print(
            f"recall terms: {_e(', '.join(recall['terms']) or '-')}  hits: "
            f"{hits['full_text']} full-text, {hits['vector']} vector"
        )
        console.print(_candidates(recall))
    intent = t.get("intent") or {}
    if intent:
        final = intent.get("final")
        console.print(
            f"intent: {_e(intent.get('label', '-'))} ({_e(intent.get('confidence', '-'))}, "
            f"{_e(intent.get('method', '-'))}) decided by {_e(intent.get('decided_by'))}"
            + (f"; final: {_e(final.get('label'))}" if final else "")
        )
    timings = t.get("timings") or {}
    shown = ", ".join(
        f"{k.removesuffix('_ms')} {v:.1f}" for k, v in timings.items() if v is not None
    )
    console.print(f"timings (ms): {_e(shown)}")
    for d in t.get("degraded") or []:
        console.print(f"[yellow]degraded[/yellow] {_e(d['part'])}: {_e(d['reason'])}")
    for message in (t.get("context") or {}).get("messages") or []:
        where = f"{message['section']} at {message['position']}"
        console.print(f"[dim]{_e(where)}:[/dim] {_text(message.get('content'), 300)}")


def show_conversations(console: Console, page: dict[str, Any]) -> None:
    table = Table(title="Conversations")
    for column in ("id", "title", "messages", "updated", "archived"):
        table.add_column(column)
    for c in page["data"]:
        table.add_row(
            _e(c["id"]),
            _text(c["title"] or ""),
            _e(c["message_count"]),
            _when(c["updated_at"]),
            "yes" if c["archived"] else "",
        )
    console.print(table)
    if page.get("has_more"):
        console.print(f"more after {_e(page['last_id'])} (--limit, or the API's ?after=)")


def show_memories(console: Console, page: dict[str, Any]) -> None:
    table = Table(title="Memories")
    for column in ("id", "kind", "pinned", "text", "used", "updated"):
        table.add_column(column)
    for m in page["data"]:
        table.add_row(
            _e(m["id"]),
            _e(m["kind"]),
            "yes" if m["pinned"] else "",
            _text(m["text"]),
            _e(m["access_count"]),
            _when(m["updated_at"]),
        )
    console.print(table)
    if page.get("has_more"):
        console.print(f"more after {_e(page['last_id'])}")
