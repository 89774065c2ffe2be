"""The stored form of embeddings (policies/vectors.py), and the start-up check of what a
configuration's embeddings need (proxy/background/embeddings.py)."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from policies.pricing import Usage
from policies.vectors import DTYPE, BadVector, decode, encode, normalised
from proxy.background import embeddings
from proxy.background.embeddings import UPSTREAM_BATCH, EmbeddingError, UpstreamEmbedder
from proxy.core.config import ConfigError, MemorySettings, UpstreamConfig
from proxy.upstream.base import UpstreamReply
from tests.conftest import make_config


def test_vectors_are_stored_unit_length_as_little_endian_float32() -> None:
    blob = encode([3.0, 4.0])
    assert blob == struct.pack("<2f", 0.6, 0.8)
    assert decode(blob) == pytest.approx([0.6, 0.8])
    assert decode(blob, dims=2) == pytest.approx([0.6, 0.8])
    # numpy reads the same bytes without conversion (how recall reads many at once).
    assert np.frombuffer(blob, dtype=DTYPE).tolist() == pytest.approx([0.6, 0.8])


def test_a_round_trip_keeps_float32_precision() -> None:
    values = [0.1 * i - 0.37 for i in range(384)]
    back = decode(encode(values), dims=384)
    unit = normalised(values)
    assert back == pytest.approx(unit, abs=1e-7)
    assert sum(v * v for v in back) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "values", [[], [0.0, 0.0], [float("nan"), 1.0], [float("inf")], ["a", 1.0]]
)
def test_unusable_vectors_are_refused(values: list[Any]) -> None:
    with pytest.raises(BadVector):
        encode(values)


def test_a_stored_vector_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(BadVector):
        decode(b"\x00\x00\x80?\x00")
    with pytest.raises(BadVector):
        decode(encode([1.0, 2.0]), dims=3)


def config_with(memory: MemorySettings, upstream: UpstreamConfig | None = None) -> Any:
    return make_config(upstream or UpstreamConfig(kind="echo"), memory=memory)


def test_embeddings_off_or_upstream_need_nothing_more() -> None:
    embeddings.check_embeddings(config_with(MemorySettings()))
    embeddings.check_embeddings(config_with(MemorySettings(embeddings="upstream")))
    openai = UpstreamConfig(kind="openai", base_url="http://127.0.0.1:9/v1")
    embeddings.check_embeddings(config_with(MemorySettings(embeddings="upstream"), openai))


def test_local_never_fails_the_start() -> None:
    # Without its model, memproxy starts and recalls by keywords (tests/unit/test_local_model.py).
    embeddings.check_embeddings(config_with(MemorySettings(embeddings="local")))
    litellm = UpstreamConfig(kind="litellm")  # serves no /v1/embeddings: local needs none
    embeddings.check_embeddings(config_with(MemorySettings(embeddings="local"), litellm))


def test_an_upstream_without_embeddings_is_refused() -> None:
    litellm = UpstreamConfig(kind="litellm")
    with pytest.raises(ConfigError, match=r"tenants\.t1\.memory\.embeddings: upstream 'main'"):
        embeddings.check_embeddings(config_with(MemorySettings(embeddings="upstream"), litellm))
    # Another upstream for the embeddings alone is fine.
    ok = config_with(MemorySettings(embeddings="upstream", embedding_upstream="echo"), litellm)
    embeddings.check_embeddings(ok)


class Answering:
    """An embeddings upstream that answers every batch with `usage` (None: leaves it out)."""

    name = "fake"

    def __init__(self, usage: Any) -> None:
        self.usage, self.batches = usage, 0

    async def embeddings(self, body: dict[str, Any]) -> UpstreamReply:
        self.batches += 1
        data = [{"index": i, "embedding": [1.0, 0.0]} for i, _ in enumerate(body["input"])]
        reply: dict[str, Any] = {"data": data}
        if self.usage is not None:
            reply["usage"] = self.usage
        return UpstreamReply(200, body=json.dumps(reply).encode())


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 7, "total_tokens": 7}, Usage(14, 0)),  # as reported, per batch
        ({"total_tokens": 5}, Usage(10, 0)),
        (None, Usage(UPSTREAM_BATCH + 2, 0, estimated=True)),  # counted: "hi" is 1 token
        ("lots", Usage(UPSTREAM_BATCH + 2, 0, estimated=True)),  # not an object: counted
    ],
)
async def test_an_upstreams_embeddings_say_what_they_used(usage: Any, expected: Usage) -> None:
    upstream = Answering(usage)
    embedded = await UpstreamEmbedder(upstream, "m").embed(["hi"] * (UPSTREAM_BATCH + 2))
    assert upstream.batches == 2 and len(embedded.vectors) == UPSTREAM_BATCH + 2
    assert embedded.usage == expected


class FailingAfter(Answering):
    """Answers `answered` batches, then fails."""

    def __init__(self, answered: int) -> None:
        super().__init__({"prompt_tokens": 7})
        self.answered = answered

    async def embeddings(self, body: dict[str, Any]) -> UpstreamReply:
        if self.batches == self.answered:
            return UpstreamReply(503, body=b"{}")
        return await super().embeddings(body)


@pytest.mark.parametrize(("answered", "paid"), [(0, None), (1, Usage(7, 0)), (2, Usage(14, 0))])
async def test_a_failed_embedding_says_what_its_answered_batches_used(
    answered: int, paid: Usage | None
) -> None:
    with pytest.raises(EmbeddingError, match="answered 503") as failed:
        await UpstreamEmbedder(FailingAfter(answered), "m").embed(["hi"] * (UPSTREAM_BATCH * 3))
    assert failed.value.paid == paid
