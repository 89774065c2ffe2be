"""The local embedding model (all-MiniLM-L6-v2 on onnxruntime): the same vectors as the
original PyTorch model, its files checked before use, and every way it can fail to load is
an error of its own, kept, never a crash."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.accounting.metrics import Metrics
from proxy.background import embeddings as embeddings_module
from proxy.background import local_model
from proxy.background.embeddings import EmbeddingError, Embeddings, LocalEmbedder
from proxy.background.local_model import LocalModelUnavailable
from proxy.core.config import MemorySettings, UpstreamConfig
from proxy.upstream.echo import EchoUpstream
from tests.conftest import make_config
from tests.polling import eventually

# sentence-transformers' own vectors for these texts (torch, normalize_embeddings=True), made
# once in a separate virtualenv: tests/data/minilm_reference.json says with which versions.
REFERENCE = json.loads(
    (Path(__file__).parent.parent / "data" / "minilm_reference.json").read_text()
)


class Logged:
    """Stands in for the module's logger: what was logged as an error."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, dict[str, Any]]] = []

    def error(self, event: str, **fields: Any) -> None:
        self.errors.append((event, fields))

    def info(self, event: str, **fields: Any) -> None:
        pass

    warning = info


@pytest.fixture
def fresh() -> Iterator[None]:
    """The process's model forgotten before and after: a test that breaks it leaves no trace."""
    local_model.forget()
    yield
    local_model.forget()


def test_the_vectors_are_the_original_models() -> None:
    texts, expected = REFERENCE["texts"], np.array(REFERENCE["vectors"], dtype=np.float32)
    got = local_model.load().encode(texts)
    assert got.shape == (len(texts), local_model.DIMENSIONS)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    cosines = (got * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    # int8 weights: not bit-identical, but the same direction (the empty text included, and
    # one far longer than the model reads, cut where the original cuts it).
    assert cosines.min() > 0.99, dict(zip(texts, cosines.round(4), strict=True))
    # And the same neighbours: each text's nearest other text is the original's.
    ours, theirs = got @ got.T, expected @ expected.T
    np.fill_diagonal(ours, -1)
    np.fill_diagonal(theirs, -1)
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()


def test_a_text_is_embedded_the_same_alone_or_in_a_batch() -> None:
    model = local_model.load()
    texts = ["short", "a much longer text " * 20, "Where do I work?"]
    alone = np.vstack([model.encode([t]) for t in texts])
    assert np.allclose(model.encode(texts), alone, atol=1e-5)  # padding changes nothing


def test_a_batch_is_run_in_runs_of_similar_lengths_within_the_token_budget() -> None:
    # Long texts padded to each other's length cost the model more than run one by one; short
    # ones share a run's fixed cost. Every text is in one run, shortest first.
    lengths = [250, 8, 8, 200, 30, 9, 60, 60, 2, 256, *([16] * 40)]
    runs = local_model.batches(lengths)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    flat = [lengths[i] for run in runs for i in run]
    assert flat == sorted(lengths)
    for run in runs:
        assert len(run) == 1 or (
            len(run) <= local_model.BATCH
            and len(run) * max(lengths[i] for i in run) <= local_model.BATCH_TOKENS
        )
    assert [len(run) for run in runs if max(lengths[i] for i in run) >= 200] == [2, 1]
    assert max(len(run) for run in runs) == local_model.BATCH  # the short ones together
    assert local_model.batches([]) == []


def test_texts_of_very_different_lengths_in_one_call_are_embedded_as_alone() -> None:
    model = local_model.load()
    texts = ["hi", "Where do I work?", "a long text about the garden " * 60, "", "x " * 40] * 3
    alone = np.vstack([model.encode([t]) for t in texts])
    assert np.allclose(model.encode(texts), alone, atol=1e-5)


def test_meaning_without_shared_words() -> None:
    model = local_model.load()
    fact, question, other = model.encode(
        ["My employer is Globex Corporation.", "Where do I work?", "I had pasta for dinner."]
    )
    assert float(fact @ question) > float(other @ question) + 0.1


def test_a_corrupt_model_file_is_refused_not_run(tmp_path: Path, fresh: None) -> None:
    bad = tmp_path / "model.onnx"
    shutil.copyfile(local_model.model_file(), bad)
    with bad.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "model_file", lambda: bad)
        with pytest.raises(LocalModelUnavailable, match="is not the expected file") as first:
            local_model.load()
        # Kept: the same failure again, not a second attempt (and not a second report).
        with pytest.raises(LocalModelUnavailable) as second:
            local_model.load()
    assert second.value is first.value
    assert not local_model.reported(first.value)
    assert local_model.reported(first.value)


def test_a_missing_package_or_file_is_unavailable(tmp_path: Path, fresh: None) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "MODEL_PACKAGE", "no_such_package_here")
        with pytest.raises(LocalModelUnavailable, match="no-such-package-here is not installed"):
            local_model.load()
    local_model.forget()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "vocab_file", lambda: tmp_path / "vocab.txt")
        with pytest.raises(LocalModelUnavailable, match="the vocabulary cannot be read"):
            local_model.load()


def test_a_file_that_is_not_a_model_is_unavailable(tmp_path: Path, fresh: None) -> None:
    junk = tmp_path / "model.onnx"
    junk.write_bytes(b"not a model")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "model_file", lambda: junk)
        patch.setattr(local_model, "MODEL_SHA256", local_model._sha256(junk))
        with pytest.raises(LocalModelUnavailable, match="onnxruntime could not load"):
            local_model.load()


async def test_embeddings_fall_back_to_keywords_when_the_model_is_unavailable(
    tmp_path: Path, fresh: None
) -> None:
    config = make_config(UpstreamConfig(kind="echo"), memory=MemorySettings(embeddings="local"))
    metrics, logged = Metrics(), Logged()
    upstreams = {"main": EchoUpstream("main", UpstreamConfig(kind="echo"))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "model_file", lambda: tmp_path / "gone.onnx")
        patch.setattr(embeddings_module, "log", logged)
        embeddings = Embeddings(config, upstreams, metrics)
        assert embeddings.wanted("t1", "alice", "full", "anonymous")
        await embeddings.check_local()
        # A reload builds them again: the failure is not logged a second time.
        await Embeddings(config, upstreams, metrics).check_local()
    ((event, fields),) = logged.errors
    assert event == "local_embedding_model_unavailable" and "gone.onnx" in fields["reason"]
    status = embeddings.status()
    assert status is not None and status.startswith("unavailable: the model file cannot be read")
    assert metrics.local_embeddings_up._value.get() == 0
    # No embedder, no jobs, no question's vector: recall is by keywords alone.
    assert embeddings.embedder("t1") is None
    assert not embeddings.wanted("t1", "alice", "full", "anonymous")
    assert await embeddings.query("t1", "Where do I work?") is None


async def test_a_local_embedder_that_fails_raises_an_embedding_error(
    tmp_path: Path, fresh: None
) -> None:
    failures: list[LocalModelUnavailable] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "model_file", lambda: tmp_path / "gone.onnx")
        with pytest.raises(EmbeddingError, match="the local embedding model could not be loaded"):
            await LocalEmbedder(failures.append).embed(["anything"])
    # (told to its owner, which takes its tenants' embeddings away and reports it)
    assert len(failures) == 1 and "cannot be read" in str(failures[0])


async def test_background_embeddings_run_one_at_a_time_and_a_question_beside_them() -> None:
    """A background call of one text (a turn's reply) waits for the batch running, as a
    larger one does; a question does not."""
    release, entered = threading.Event(), []

    class Model:
        def encode(self, texts: list[str]) -> Any:
            entered.append(texts[0])
            if texts[0] == "batch":
                release.wait(60)
            return np.zeros((len(texts), local_model.DIMENSIONS), dtype=np.float32)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "load", Model)
        embedder = LocalEmbedder(lambda failure: None)
        batch = asyncio.ensure_future(embedder.embed(["batch", "of two"]))

        async def running() -> bool:
            return entered == ["batch"]

        await eventually(running, "the batch running")
        reply = asyncio.ensure_future(embedder.embed(["reply"]))
        await embedder.embed(["question"], question=True)  # beside the batch
        assert entered == ["batch", "question"]  # the reply still waits
        release.set()
        await asyncio.gather(batch, reply)
    assert entered == ["batch", "question", "reply"]


async def test_the_model_is_checked_at_start_and_loaded_by_the_first_embedding(
    fresh: None,
) -> None:
    # local: the default; a timeout long enough for the load that the first question waits for
    settings = MemorySettings(embedding_timeout_ms=60_000)
    config = make_config(UpstreamConfig(kind="echo"), memory=settings)
    metrics = Metrics()
    embeddings = Embeddings(
        config, {"main": EchoUpstream("main", UpstreamConfig(kind="echo"))}, metrics
    )
    await embeddings.check_local()
    assert embeddings.status() == "ok"
    assert metrics.local_embeddings_up._value.get() == 1
    assert not local_model.loaded()  # ready, and nothing loaded yet
    vector = await embeddings.query("t1", "Where do I work?")
    assert local_model.loaded()
    assert vector is not None and vector.model == "local/all-MiniLM-L6-v2"
    assert len(vector.values) == local_model.DIMENSIONS and vector.usage is None


async def test_a_load_that_fails_after_the_question_stopped_waiting_is_still_reported(
    fresh: None,
) -> None:
    """The first question waits for the load at most its timeout; a load that fails after
    that takes the tenants' embeddings away and is reported all the same."""
    release = threading.Event()

    class SlowlyRefused:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            release.wait(60)
            raise LocalModelUnavailable("onnxruntime could not load it (as a test)")

    settings = MemorySettings(embedding_timeout_ms=1)
    config = make_config(UpstreamConfig(kind="echo"), memory=settings)
    metrics, logged = Metrics(), Logged()
    upstreams = {"main": EchoUpstream("main", UpstreamConfig(kind="echo"))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_model, "MiniLM", SlowlyRefused)
        patch.setattr(embeddings_module, "log", logged)
        embeddings = Embeddings(config, upstreams, metrics)
        await embeddings.check_local()
        assert embeddings.status() == "ok"
        assert await embeddings.query("t1", "Where do I work?") is None  # not waited for
        assert embeddings.status() == "ok"  # (still loading)
        release.set()

        async def reported() -> bool:
            return embeddings.status() != "ok"

        await eventually(reported, "the failed load reported")
    status = embeddings.status()
    assert status == "unavailable: onnxruntime could not load it (as a test)"
    assert [event for event, _ in logged.errors] == ["local_embedding_model_unavailable"]
    assert metrics.local_embeddings_up._value.get() == 0
    assert embeddings.embedder("t1") is None
