"""Every benchmark script starts: its imports (often of a sibling script's names) resolve and
its options parse. A script broken by a change elsewhere fails here, not on the next rerun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if "__main__" in p.read_text())  # (not modules)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_bench_script_starts_and_shows_its_options(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout, done.stdout[-500:]
