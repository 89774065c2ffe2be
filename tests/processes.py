"""`memproxy serve` of this checkout in processes of their own (replicas, restarts, kills)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.postgres import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def spawn(
    name: str,
    config: Path,
    workdir: Path,
    *,
    log_level: str = "warning",
    log_format: str = "console",
) -> Replica:
    """`memproxy serve` of this checkout in a process of its own."""
    port = free_port()
    log = workdir / f"{name}.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "proxy.cli", "serve", f"--config={config}", f"--port={port}"]
    command += [f"--log-level={log_level}", f"--log-format={log_format}"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=env
        )
    return Replica(name, process, port, log)


def wait_ready(replica: Replica, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            pytest.fail(f"{replica.name} exited at startup:\n{replica.tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(replica.url.removesuffix("/v1") + "/healthz").status_code == 200:
                return
        time.sleep(0.05)
    pytest.fail(f"{replica.name} did not start within {timeout:.0f} s:\n{replica.tail()}")


def kill(replica: Replica) -> None:
    """SIGKILL: no shutdown, as in a crash."""
    replica.process.send_signal(signal.SIGKILL)
    replica.process.wait()


def stop(replica: Replica) -> None:
    replica.process.terminate()
    try:
        replica.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        replica.process.kill()
        replica.process.wait()
