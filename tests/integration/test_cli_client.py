"""`memproxy trace`, `conversations` and `memories` against a real running server: readable
tables, `--json` for scripts, and one clear line when the server is unreachable or refuses
the key."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import httpx
import pytest

from proxy.cli import main
from proxy.core.config import Config, ContextSettings, UpstreamConfig
from tests.conftest import CHAT_ONLY_KEY, KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI

ServeProxy = Callable[[Config], str]


@pytest.fixture
def server(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy) -> tuple[str, str]:
    """memproxy with alice's pets conversation, a memory, and one turn that recalled from it:
    (its base URL, that turn's request id)."""
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    base = serve_proxy(make_config(upstream, context=ContextSettings(token_budget=300)))
    base = base.removesuffix("/v1")
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base + "/v1", headers=headers) as http:
        messages = [
            {"role": "user", "content": "We named the beagle [bold]Biscuit[/bold]"},
            {"role": "assistant", "content": "Biscuit is a great name."},
        ]
        created = http.post(
            "/memory/conversations",
            json={"id": "pets", "user": "alice", "title": "Pets", "messages": messages},
        )
        assert created.status_code == 201, created.text
        memory = http.post(
            "/memory/memories", json={"user": "alice", "text": "Alice lives in Lisbon"}
        )
        assert memory.status_code == 201, memory.text
        turn = http.post(
            "/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "beagle?"}]},
            headers={"X-Memory-User-Id": "alice"},
        )
        assert turn.status_code == 200, turn.text
    return base, turn.headers["x-request-id"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def test_trace_prints_the_sections_and_recalls_candidates(
    server: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    base, request_id = server
    status, out, err = run(capsys, "trace", request_id, "--url", base, "--key", KEY)
    assert status == 0, err
    assert f"Exchange {request_id}" in out and "user alice" in out
    for heading in ("Context added (budget 300 tokens)", "Recall candidates", "packed"):
        assert heading in out
    for section in ("history", "recall", "memories", "documents", "summary"):
        assert section in out
    assert "recall terms: beagle" in out and "timings (ms): load" in out


def test_json_is_the_apis_own(
    server: tuple[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, request_id = server
    monkeypatch.setenv("MEMPROXY_URL", base + "/v1")  # (the SDK's base URL does as well)
    monkeypatch.setenv("MEMPROXY_KEY", KEY)
    status, out, _ = run(capsys, "trace", request_id, "--json")
    assert status == 0
    trace = json.loads(out)
    assert trace["id"] == request_id and trace["recall"]["terms"] == ["beagle"]
    status, out, _ = run(capsys, "memories", "--user", "alice", "--json")
    assert status == 0 and json.loads(out)["data"][0]["text"] == "Alice lives in Lisbon"


def test_conversations_and_memories_are_tables(
    server: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = server
    status, out, _ = run(capsys, "conversations", "--user", "alice", "--url", base, "--key", KEY)
    assert status == 0 and "pets" in out and "Pets" in out
    status, out, _ = run(
        capsys, "memories", "--user", "alice", "--search", "Lisbon", "--url", base, "--key", KEY
    )
    assert status == 0 and "Alice lives in Lisbon" in out
    status, out, _ = run(
        capsys, "memories", "--user", "alice", "--search", "Tokyo", "--url", base, "--key", KEY
    )
    assert status == 0 and "Alice lives in Lisbon" not in out


def test_stored_text_is_shown_as_written_not_as_markup(
    server: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    fake_upstream: tuple[FakeOpenAI, str],
) -> None:
    base, _ = server
    status, out, _ = run(capsys, "conversations", "--user", "alice", "--url", base, "--key", KEY)
    assert status == 0
    with httpx.Client(
        base_url=base + "/v1/memory", headers={"authorization": f"Bearer {KEY}"}
    ) as h:
        h.patch("/conversations/pets", json={"title": "[red]Pets[/red]"})
    status, out, _ = run(capsys, "conversations", "--user", "alice", "--url", base, "--key", KEY)
    assert status == 0 and "[red]Pets[/red]" in out


def test_a_refused_key_and_an_unknown_exchange_are_one_line_each(
    server: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = server
    for key in ("wrong-key", CHAT_ONLY_KEY):
        status, out, err = run(capsys, "trace", "req_x", "--url", base, "--key", key)
        assert status == 1 and out == ""
        assert err.startswith("memproxy: the server refused the key (40") and err.count("\n") == 1
    status, _, err = run(capsys, "trace", "req_nope", "--url", base, "--key", KEY)
    assert status == 1 and err == "memproxy: 404: No exchange found with id 'req_nope'.\n"


def test_an_unreachable_server_or_no_key_is_said_plainly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEMPROXY_KEY", raising=False)
    status, _, err = run(capsys, "conversations", "--user", "alice")
    assert status == 2 and "no API key" in err
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    status, _, err = run(capsys, "trace", "req_x", "--url", url, "--key", KEY)
    assert status == 1 and err.startswith(f"memproxy: cannot reach the server at {url}/")


def test_the_console_script_runs_against_the_server(server: tuple[str, str]) -> None:
    base, request_id = server
    env = {**os.environ, "MEMPROXY_URL": base, "MEMPROXY_KEY": KEY}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "trace", request_id, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["id"] == request_id


def test_a_request_id_is_sent_as_one_path_segment(
    server: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = server
    for odd in ("req?user=alice", "req#x"):
        status, out, err = run(capsys, "trace", odd, "--url", base, "--key", KEY)
        assert status == 1 and out == ""
        assert err == f"memproxy: 404: No exchange found with id '{odd}'.\n"
    # (the server takes an encoded slash for a slash: no trace route, and no other endpoint)
    status, out, err = run(capsys, "trace", "req/../../conversations", "--url", base, "--key", KEY)
    assert status == 1 and out == ""
    assert err.startswith("memproxy: 404: ") and "/exchanges/req/../../conversations/trace" in err


class _NotMemproxy(http.server.BaseHTTPRequestHandler):
    """Some other web server: an HTML page, 200 or 404, whatever is asked."""

    def do_GET(self) -> None:
        body = b"<html>\n<body>\n<h1>Welcome</h1>\n</body>\n</html>\n"
        self.send_response(404 if "conversations" in self.path else 200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_that_is_not_memproxy_is_said_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotMemproxy) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{other.server_address[1]}"
        try:
            for argv in (["trace", "req_x"], ["conversations", "--user", "alice"]):
                status, out, err = run(capsys, *argv, "--url", url, "--key", KEY)
                assert status == 1 and out == "", argv
                assert err.startswith("memproxy: ") and err.count("\n") == 1, err
        finally:
            other.shutdown()
