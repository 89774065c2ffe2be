"""bench/overhead.py's realistic workload (bench/overhead_bench/): what its clients send, and
how the run's figures become issue 37's targets."""

from __future__ import annotations

import json

from bench.overhead_bench import workload
from bench.overhead_bench.goals import goals
from bench.overhead_bench.wire import SHAPES, Lane, Target


async def _close() -> None:
    return None


def _lane(name: str, shape: str = "chat") -> Lane:
    def post(*args: object) -> object:
        raise AssertionError("not sent")

    return Lane(Target(name, post, _close), SHAPES[shape])  # type: ignore[arg-type]


def test_each_client_is_a_named_user_whose_own_conversation_grows_with_new_messages() -> None:
    requests = workload.realistic()
    lane = _lane("memproxy")
    first, second, other = (
        requests(lane, False, 3),
        requests(lane, True, 3),
        requests(lane, False, 4),
    )
    assert first.headers == {
        "x-memory-user-id": "bench-user-03",
        "x-memory-conversation-id": "bench-conv-03-chat",
    }
    assert other.headers is not None and other.headers["x-memory-user-id"] == "bench-user-04"
    bodies = [json.loads(r.body) for r in (first, second)]
    # A thin client: only its new message, a different one each turn.
    assert [len(b["messages"]) for b in bodies] == [1, 1]
    assert bodies[0]["messages"][0]["content"] != bodies[1]["messages"][0]["content"]
    assert bodies[1]["stream"] is True
    # Every target gets the same turns, in the same order.
    again = workload.realistic()(_lane("floor"), False, 3)
    assert again.body == first.body


def test_a_user_s_stored_history_shares_the_words_its_questions_use() -> None:
    stored = workload.seeded_conversation(0, 0, 50)
    assert len(stored) == 100
    words = {w for m in stored for w in m["content"].lower().replace(".", " ").split()}
    asked = set(workload.question(0, 7).rstrip("?").split())
    assert asked & words & set(workload.WORDS)


def _row(added: float, cpu: float, rps: float = 300.0, rss: float = 120.0) -> dict[str, object]:
    return {
        "added_p50_ms": added,
        "added_ttft_ms": added,
        "cpu_ms_per_request": cpu,
        "cpu_ms_per_request_stream_c32": cpu,
        "stream_req_per_s_c32": rps,
        "rss_start_mb": rss,
        "rss_end_mb": rss,
    }


def test_the_targets_are_ratios_against_memproxy_off_in_the_same_run() -> None:
    head = {
        "floor": _row(2.0, 2.0),
        "memproxy-off": _row(2.4, 3.0),
        "memproxy": _row(9.0, 12.0, rps=100.0, rss=232.0),
        "memproxy-keywords": _row(4.8, 6.6, rps=260.0),
        "memproxy-heavy": _row(6.0, 7.0),
    }
    embeddings = {"memproxy-off": "local", "memproxy": "local", "memproxy-keywords": "off"}
    found = {g["goal"]: (g["value"], g["met"]) for g in goals(head, embeddings, postgres=True)}
    assert found == {
        "memproxy-keywords (embeddings off) added p50 / memproxy-off's": (2.0, True),
        "memproxy-keywords CPU per request / memproxy-off's": (2.2, False),
        "memproxy-keywords stream req/s at 32 clients": (260.0, True),
        "memproxy (default config) added p50 - memproxy-off's": (6.6, False),
        "memproxy (default config) RSS at start": (232.0, False),
        "memproxy-off added p50 / floor's": (1.2, True),
        "PostgreSQL: memproxy-keywords over memproxy-off, p50": (2.4, True),
        "memproxy-heavy added p50 / memproxy-keywords's": (1.25, False),
    }
