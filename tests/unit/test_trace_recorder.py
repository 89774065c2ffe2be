"""What the turn pipeline's trace recorder keeps of a degraded part (proxy/pipeline/trace.py)."""

from __future__ import annotations

from proxy.pipeline.trace import TraceRecorder

# A storage error as SQLAlchemy words it: the statement and its parameters (what was said) after
# the first line.
DISK_FULL = (
    "unavailable: the turn went on without memory ((sqlite3.OperationalError) database or disk "
    "is full\n[SQL: INSERT INTO messages (content) VALUES (?)]\n"
    "[parameters: ('my card number is 4111 1111 1111 1111" + " and more" * 5_000 + "',)]\n"
    "(Background on this error at: https://sqlalche.me/e/20/e3q8))"
)


def test_a_degraded_reason_keeps_its_first_line_not_the_statement_or_what_was_said() -> None:
    recorder = TraceRecorder("summary")
    recorder.degrade("storage", DISK_FULL)
    (kept,) = recorder.degraded
    assert kept["part"] == "storage"
    assert kept["reason"].startswith("unavailable: the turn went on without memory")
    assert "database or disk is full" in kept["reason"]
    assert "4111" not in kept["reason"] and "[SQL" not in kept["reason"]
    assert len(kept["reason"]) <= 300


def test_at_level_off_nothing_is_kept() -> None:
    recorder = TraceRecorder("off")
    recorder.degrade("storage", "timeout")
    assert recorder.degraded == []
