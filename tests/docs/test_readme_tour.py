"""The README's tour runs as written: `memproxy serve` with the shipped config.yaml (its database
a temporary file), then the README's `sh` and `python` blocks in order, port 8080 replaced by
the server's. Blocks marked `<!-- not run -->` (make, a real provider, Docker) are skipped."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.core.config_file import load_config
from tests.docs.markdown import ROOT, Block, blocks
from tests.processes import Replica, spawn, stop, wait_ready

README = ROOT / "README.md"
TOUR = [b for b in blocks(README) if b.lang in ("sh", "python") and b.mark != "not run"]


@pytest.fixture
def shipped_server(tmp_path: Path) -> Iterator[Replica]:
    """The shipped config.yaml as it is, but for the database: a new file in tmp_path."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["database"]["url"] = f"sqlite+aiosqlite:///{tmp_path / 'tour.db'}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    replica = spawn("tour", path, tmp_path)
    try:
        wait_ready(replica)
        yield replica
    finally:
        stop(replica)


def run_block(block: Block, port: int, namespace: dict[str, Any]) -> str:
    """Run one block as a reader would (a shell, or one Python session for all Python
    blocks); its output."""
    body = block.body.replace("8080", str(port))
    if block.lang == "sh":
        done = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + body],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(body, block.where, "exec"), namespace)
    return out.getvalue()


def output_of(outputs: list[tuple[Block, str]], text: str) -> str:
    """The output of the one tour block whose source holds `text`."""
    found = [out for block, out in outputs if text in block.body]
    assert len(found) == 1, f"expected one README tour block with {text!r}, found {len(found)}"
    return found[0]


def json_lines(output: str) -> list[Any]:
    """The JSON documents a curl block printed, one per command."""
    decoder, documents, rest = json.JSONDecoder(), [], output.strip()
    while rest:
        document, end = decoder.raw_decode(rest)
        documents.append(document)
        rest = rest[end:].strip()
    return documents


def test_the_tour_has_shell_and_python_blocks() -> None:
    assert [b.lang for b in TOUR].count("python") >= 3
    assert [b.lang for b in TOUR].count("sh") >= 3
    assert any(b.mark == "not run" for b in blocks(README))  # make serve / make test


def test_readme_tour_runs_as_written(shipped_server: Replica) -> None:
    namespace: dict[str, Any] = {}
    outputs: list[tuple[Block, str]] = []
    try:
        for block in TOUR:
            outputs.append((block, run_block(block, shipped_server.port, namespace)))

        # The first request's headers: what memproxy did.
        headers = output_of(outputs, "grep -i '^x-'").lower()
        for name in ("x-request-id", "x-memory-conversation-id", "x-memory-intent", "x-cost-usd"):
            assert name in headers

        # A fact told in one conversation is recalled in a new one of the same user.
        first, second, third = namespace["first"], namespace["second"], namespace["third"]
        assert first.headers["x-memory-conversation-id"].startswith("conv_")
        assert second.headers["x-memory-conversation-id"] == "trip-packing"
        assert int(second.headers["x-memory-memories"]) >= 1
        assert "system=1" in second.parse().choices[0].message.content
        recalled = namespace["record"]["attached"]["recalled"]
        # (The memory extraction makes of the first turn is among them when its job ended
        # before the second turn: it has no conversation.)
        conversations = {r["conversation_id"] for r in recalled if "message" in r}
        assert first.headers["x-memory-conversation-id"] in conversations

        # A thin client's next turn gets the conversation's history.
        assert third.headers["x-memory-history-messages"] == "2"

        # The management API lists what was stored.
        conversations, messages = json_lines(
            output_of(outputs, "/conversations/trip-packing/messages")
        )
        ids = {c["id"] for c in conversations["data"]}
        assert {"trip-packing", first.headers["x-memory-conversation-id"]} <= ids
        assert [m["role"] for m in messages["data"]] == ["user", "assistant"] * 2
    finally:
        for name in ("client", "memory_api"):
            if name in namespace:
                namespace[name].close()

    # Memories: extracted in the background after each exchange (the echo upstream proposes
    # the user's first-person statements as facts), for a tenant with `memory.extract: llm`.
    memories_block = next(b for b in TOUR if "/v1/memory/memories?user=alice" in b.body)
    assert load_config(ROOT / "config.yaml", {}).tenants["tour"].memory.extract == "llm"
    deadline = time.monotonic() + 20
    while True:  # (extraction is a background job: it may still be running)
        (memories,) = json_lines(run_block(memories_block, shipped_server.port, namespace))
        if memories["data"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert any("Trondheim" in m["text"] for m in memories["data"]), memories
