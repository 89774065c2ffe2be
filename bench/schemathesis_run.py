"""schemathesis at scale against `memproxy serve`: thousands of requests generated from the
OpenAPI document the server serves (every operation; valid and invalid parameters and bodies;
its coverage, fuzzing and stateful phases), checked for one thing: no 5xx.

The server runs from this checkout in a process of its own, on the offline echo upstream and a
fresh SQLite file, with two tenants (the key used is the first's, with every scope). Prints
the number of cases and the failures; exits 1 if any request got a 5xx.
tests/integration/test_schemathesis.py is the short run of the default suite.

    .venv/bin/python bench/schemathesis_run.py [--examples 20] [--seed 34]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
KEY = "fuzz-key"


def serve(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    config = workdir / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "database": {"url": f"sqlite+aiosqlite:///{workdir / 'fuzz.db'}"},
                "upstreams": {"echo": {"kind": "echo"}},
                "defaults": {"upstream": "echo", "memory": {"embeddings": "off"}},
                "tenants": {"fuzz": {"api_keys": [KEY]}, "other": {"api_keys": ["other-key"]}},
            }
        )
    )
    log = (workdir / "server.log").open("wb")
    command = [sys.executable, "-m", "proxy.cli", "serve", f"--config={config}"]
    command += [f"--port={port}", "--log-level=warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit(f"the server did not start:\n{(workdir / 'server.log').read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20, help="per operation and phase")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--port", type=int, default=18934)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = serve(Path(tmp), args.port)
        started = time.perf_counter()
        try:
            run = subprocess.run(
                [
                    str(BIN / "schemathesis"),
                    "run",
                    f"http://127.0.0.1:{args.port}/schema/openapi.json",
                    "--header",
                    f"Authorization: Bearer {KEY}",
                    "--checks",
                    "not_a_server_error",
                    "--max-examples",
                    str(args.examples),
                    "--seed",
                    str(args.seed),
                    "--workers",
                    "1",
                    "--warnings",
                    "off",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
        finally:
            server.terminate()
            server.wait(timeout=30)
        seconds = time.perf_counter() - started
        output = run.stdout + run.stderr
        counts = re.search(r"(\d+) generated, (.*)", output)
        print(output[-4000:] if run.returncode else "")
        print(f"seed {args.seed}, {args.examples} examples per operation and phase")
        print(f"cases: {counts.group(0) if counts else 'unknown'} in {seconds:.0f} s")
        print("5xx: none" if run.returncode == 0 else f"5xx found (exit {run.returncode})")
        raise SystemExit(0 if run.returncode == 0 else 1)


if __name__ == "__main__":
    main()
