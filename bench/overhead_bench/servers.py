"""The servers measured, each in its own process: the fake upstream (direct), the floor,
memproxy in its configurations, the previous revision, LiteLLM's proxy; and a PostgreSQL
server for them with `--postgres`."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.fake_upstream import TAIL_MODEL
from bench.overhead_bench.wire import MODEL

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
API_KEY = "bench-key"
# Target names. memproxy-off is memproxy asked for `X-Memory-Mode: off`, in a process of its
# own: the proxy core.
DIRECT, FLOOR, LITELLM = "direct", "floor", "litellm"
OFF, ON = "memproxy-off", "memproxy"
# memproxy with memory on but `memory.embeddings: off` (with `--embeddings both`: beside the
# default config's memproxy in the same run).
KEYWORDS = "memproxy-keywords"
# memproxy with memory on whose users each have `--heavy-turns` stored turns.
HEAVY = "memproxy-heavy"
# memproxy with its tenant's `trace: off` (--trace-target): what recording each exchange's
# trace (`summary`, the default, on the memproxy target) costs, measured beside it.
UNTRACED = "memproxy-untraced"
PREVIOUS = "memproxy-prev"
MEMORY_ON = (ON, KEYWORDS, HEAVY, UNTRACED, PREVIOUS)
LITELLM_VENV = BENCH / ".litellm-venv"
# LiteLLM's proxy refuses to start without a strong master key, and asks clients for it.
LITELLM_KEY = f"sk-{secrets.token_hex(32)}"
LITELLM_INSTALL = (
    f"python3 -m venv {LITELLM_VENV.relative_to(ROOT)} && "
    f"{(LITELLM_VENV / 'bin' / 'pip').relative_to(ROOT)} install 'litellm[proxy]'"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def spawn(
    name: str,
    command: list[str],
    port: int,
    logdir: Path,
    code: Path = ROOT,
    env: dict[str, str] | None = None,
) -> Server:
    log = logdir / f"{name}.log"
    # The code of `code` (this checkout by default), also when the installed `memproxy` points
    # at another one: PYTHONPATH comes before the editable install's finder.
    if env is None:
        paths = filter(None, [str(code), os.environ.get("PYTHONPATH")])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=code, env=env)
    return Server(name, port, process, log)


def export_revision(rev: str, into: Path) -> Path:
    """The tree of `rev` (a commit of this repository) as plain files under `into`."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        raise SystemExit(f"--baseline-rev {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def wait_ready(server: Server, timeout: float = 60.0) -> None:
    """uvicorn binds its socket only once the app's startup is done: a connect means ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"{server.name} exited at startup:\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server.port)):
            return
        time.sleep(0.05)
    raise SystemExit(f"{server.name} did not start within {timeout:.0f} s (log: {server.log})")


def memproxy_command() -> list[str]:
    script = Path(sys.executable).parent / "memproxy"
    found = str(script) if script.exists() else shutil.which("memproxy")
    return [found] if found else [sys.executable, "-m", "proxy.cli"]


def spawn_memproxy(
    name: str,
    config: Path,
    logdir: Path,
    code: Path = ROOT,
    *,
    port: int | None = None,
    options: Sequence[str] = ("--log-level=warning",),
) -> Server:
    """`memproxy serve` on `config`, on a free port unless given: the code of `code` (this
    checkout, or an exported revision, run as `python -m proxy.cli` so that it is that tree's
    whatever the installed script finds)."""
    port = free_port() if port is None else port
    command = memproxy_command() if code == ROOT else [sys.executable, "-m", "proxy.cli"]
    serve = [*command, "serve", f"--config={config}", f"--port={port}", *options]
    return spawn(name, serve, port, logdir, code)


def memproxy_config(
    upstream: str,
    workdir: Path,
    database_url: str | None = None,
    *,
    storage_breaker: int = 0,
    server: bool = True,
    embeddings: str | None = None,
    trace: str | None = None,
) -> str:
    """`storage_breaker`: `server.storage_breaker_threshold` (0: off, the default). Without
    `server`, no `server:` settings (for a revision older than them, which would refuse them;
    its spill, if it has one, is then in its working directory). `embeddings`: the tenant's
    `memory.embeddings` (None: the revision's default)."""
    database = database_url or f"sqlite+aiosqlite:///{workdir}/memproxy.db"
    settings = (
        # Turns answered degraded (storage slower than its timeout) wait here to be replayed.
        f'server: {{spill_path: "{workdir}/memproxy-spill.jsonl",'
        f" storage_breaker_threshold: {storage_breaker}}}\n"
    )
    return (
        (settings if server else "") + f'database: {{url: "{database}"}}\n'
        "upstreams:\n"
        f"  fake: {{kind: openai, base_url: {upstream}/v1, api_key: bench-upstream-key}}\n"
        "defaults: {upstream: fake}\n"
        f"tenants:\n  bench:\n    api_keys: [{API_KEY}]\n"
        # Every limit on (and never reached), so admitting and counting are measured.
        "    limits: {rpm: 100000000, tpm: 100000000000, budget_usd_day: 1000000,"
        " budget_usd_month: 1000000}\n"
        + ("" if embeddings is None else f"    memory: {{embeddings: {embeddings}}}\n")
        + ("" if trace is None else f"    trace: {trace}\n")
    )


def litellm_binary() -> Path | None:
    found = LITELLM_VENV / "bin" / "litellm"
    return found if found.exists() else None


def litellm_config(upstream: str) -> str:
    """LiteLLM's proxy in front of the fake for the bench's model, with no database."""
    models = "".join(
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: bench-upstream-key\n"
        for model in (MODEL, TAIL_MODEL)  # (the second for the no-buffering check)
    )
    return (
        "model_list:\n" + models + "litellm_settings: {telemetry: false}\n"
        f"general_settings: {{master_key: {LITELLM_KEY}}}\n"
    )


def rss_mb(pid: int) -> float | None:
    """A process's resident set size now (Linux), MB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (name)": state is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memproxy_names(args: argparse.Namespace) -> list[str]:
    """The memproxy targets of this run, in order (memproxy-prev last)."""
    names = [OFF, ON]
    if args.embeddings == "both":
        names.append(KEYWORDS)
    if args.heavy_turns:
        names.append(HEAVY)
    if args.trace_target:
        names.append(UNTRACED)
    if args.baseline_rev:
        names.append(PREVIOUS)
    return names


def embeddings_of(name: str, args: argparse.Namespace) -> str | None:
    """A memproxy target's `memory.embeddings` (None: its revision's default config)."""
    if name == PREVIOUS:
        return getattr(args, "baseline_embeddings", None)
    if name in (KEYWORDS, HEAVY):
        return "off"
    return {"both": "local", None: None}.get(args.embeddings, args.embeddings)


@contextlib.contextmanager
def databases(args: argparse.Namespace, names: list[str]) -> Iterator[dict[str, str | None]]:
    """Each memproxy target's database URL: a PostgreSQL database of its own on a server
    started here with `--postgres`, else `--database-url` (None: a SQLite file of its own)."""
    if not args.postgres:
        urls = {name: args.database_url for name in names}
        if PREVIOUS in urls:  # its own database: the schemas differ
            urls[PREVIOUS] = args.baseline_database_url
        yield urls
        return
    from tests.postgres import PostgresServer, PostgresUnavailable, find_bin_dir

    try:
        cluster = PostgresServer(find_bin_dir())
    except PostgresUnavailable as exc:
        raise SystemExit(f"--postgres: {exc}") from None
    cluster.start()
    try:
        yield {name: cluster.url(cluster.create_database()) for name in names}
    finally:
        cluster.stop()


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, Server]]:
    """The fake upstream, the floor, LiteLLM's proxy (with `--litellm`) and the memproxy
    targets, each in its own process; stopped on exit."""
    names = memproxy_names(args)
    with (
        tempfile.TemporaryDirectory(prefix="memproxy-bench-") as tmp,
        databases(args, names) as urls,
    ):
        workdir = Path(tmp)
        logdir = Path(args.logs) if args.logs else workdir
        logdir.mkdir(parents=True, exist_ok=True)
        started: dict[str, Server] = {}
        try:
            port = free_port()
            fake = spawn(
                DIRECT,
                [
                    sys.executable,
                    str(BENCH / "fake_upstream.py"),
                    f"--port={port}",
                    f"--chunk-delay={args.chunk_delay}",
                    f"--tail={args.tail}",
                ],
                port,
                logdir,
            )
            started[DIRECT] = fake
            port = free_port()
            floor = [sys.executable, str(BENCH / "floor_proxy.py"), f"--upstream={fake.url}/v1"]
            started[FLOOR] = spawn(FLOOR, [*floor, f"--port={port}"], port, logdir)
            if args.litellm:
                started[LITELLM] = spawn_litellm(fake, workdir, logdir)
            code = {name: ROOT for name in names}
            if PREVIOUS in names:
                code[PREVIOUS] = export_revision(args.baseline_rev, workdir / "previous")
            for name in names:
                home = workdir / name
                home.mkdir()
                config = home / "config.yaml"
                config.write_text(
                    memproxy_config(
                        fake.url,
                        home,
                        urls[name],
                        server=name != PREVIOUS,
                        embeddings=embeddings_of(name, args),
                        trace="off" if name == UNTRACED else None,
                    )
                )
                started[name] = spawn_memproxy(
                    name,
                    config,
                    logdir,
                    code[name],
                    options=(f"--log-level={args.memproxy_log_level}", "--log-format=json"),
                )
            for server in started.values():
                wait_ready(server, 180.0 if server.name == LITELLM else 60.0)
            yield started
        finally:
            for server in started.values():
                server.process.terminate()
            for server in started.values():
                try:
                    server.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()


def spawn_litellm(fake: Server, workdir: Path, logdir: Path) -> Server:
    binary = litellm_binary()
    if binary is None:  # (checked before the servers start)
        raise SystemExit(f"--litellm: not installed; install it with: {LITELLM_INSTALL}")
    config = workdir / "litellm.yaml"
    config.write_text(litellm_config(fake.url))
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "DATABASE_URL", "VIRTUAL_ENV")
    }
    # No network: the model cost map that LiteLLM ships, not the one it would download.
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    command = [str(binary), f"--config={config}", "--host=127.0.0.1", f"--port={port}"]
    return spawn(LITELLM, command, port, logdir, workdir, env)
