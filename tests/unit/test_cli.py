from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import uvicorn
from structlog.testing import capture_logs

from proxy.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_check_config_accepts_the_shipped_file(capsys: pytest.CaptureFixture[str]) -> None:
    main(["check-config", "--config", str(REPO / "config.yaml")])
    assert capsys.readouterr().out.startswith("ok: 2 tenants")  # demo, and the tour's


def test_bad_config_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tenants:\n  a: {api_keys: [k], context: {token_budget: lots}}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["check-config", "--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tenants.a.context.token_budget" in err


def test_config_path_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tenants:\n  a: {api_keys: [k]}\n  b: {api_keys: [k2]}\n")
    monkeypatch.setenv("MEMPROXY_CONFIG", str(path))
    main(["check-config"])
    assert capsys.readouterr().out.startswith("ok: 2 tenants")


def test_migrate_creates_the_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The command sets up logging for its process; this one keeps the suite's (structlog's
    # cached loggers would otherwise escape `capture_logs` in later tests).
    monkeypatch.setattr("proxy.core.logs.configure_logging", lambda *args: None)
    db = tmp_path / "m.db"
    path = tmp_path / "c.yaml"
    path.write_text(
        f'database: {{url: "sqlite+aiosqlite:///{db}"}}\ntenants:\n  a: {{api_keys: [k]}}\n'
    )
    main(["migrate", "--config", str(path)])
    tables = {
        r[0]
        for r in sqlite3.connect(db).execute("select name from sqlite_master where type='table'")
    }
    assert {"conversations", "messages", "exchanges", "alembic_version"} <= tables


@pytest.mark.parametrize(
    ("host", "metrics_key", "warned"),
    [
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("10.1.2.3", None, True),
        ("proxy.internal", None, True),
        ("0.0.0.0", "scrape-key", False),
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("localhost", None, False),
    ],
)
def test_serve_warns_when_metrics_are_open_beyond_this_machine(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    host: str,
    metrics_key: str | None,
    warned: bool,
) -> None:
    """/metrics carries every tenant's name and spend: open to any network the port is on,
    the start-up log says so."""
    monkeypatch.setattr("proxy.core.logs.configure_logging", lambda *args: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # (not started)
    path = tmp_path / "c.yaml"
    key = "null" if metrics_key is None else metrics_key
    path.write_text(
        f"server: {{metrics_key: {key}}}\n"
        f'database: {{url: "sqlite+aiosqlite:///{tmp_path / "m.db"}"}}\n'
        "tenants:\n  a: {api_keys: [k]}\n"
    )
    with capture_logs() as logs, pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(path), "--host", host, "--port", "0"])
    assert exit_info.value.code == 3  # (uvicorn's "not started": run() was a no-op)
    open_warnings = [e for e in logs if e["event"] == "metrics_open"]
    assert len(open_warnings) == (1 if warned else 0)
    if warned:
        assert open_warnings[0]["log_level"] == "warning"
        assert open_warnings[0]["host"] == host
