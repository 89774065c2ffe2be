"""Embedding vectors as the database stores them: float32, little-endian, unit length.

Stored unit-length, so cosine similarity is a dot product. Plain Python (the `array` module);
the request path reads many at once with numpy (`numpy.frombuffer(blob, "<f4")`), which this
format is chosen to allow without a copy per vector.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence

DTYPE = "<f4"  # numpy's name for the stored format
_BIG_ENDIAN = sys.byteorder == "big"


class BadVector(ValueError):
    """Not a usable embedding: empty, not finite, all zeros, or the wrong size."""


def normalised(values: Sequence[float]) -> list[float]:
    """`values` scaled to unit length."""
    if not values:
        raise BadVector("an empty vector")
    try:
        norm = math.sqrt(math.fsum(float(v) * float(v) for v in values))
    except (TypeError, ValueError) as exc:
        raise BadVector(f"not a vector of numbers ({exc})") from None
    if not math.isfinite(norm):
        raise BadVector("a vector with values that are not finite")
    if norm == 0:
        raise BadVector("a vector of zeros")
    return [float(v) / norm for v in values]


def encode(values: Sequence[float]) -> bytes:
    """The stored form of a vector: unit length, float32 little-endian."""
    packed = array("f", normalised(values))
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def decode(blob: bytes, dims: int | None = None) -> list[float]:
    """A stored vector back as floats; `dims`, when given, is checked."""
    if len(blob) % 4:
        raise BadVector(f"{len(blob)} bytes is not a whole number of float32 values")
    if dims is not None and len(blob) != dims * 4:
        raise BadVector(f"{len(blob) // 4} dimensions, expected {dims}")
    values = array("f")
    values.frombytes(blob)
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tolist()


# The job queue's name for embedding stored messages (proxy/background/embedding_jobs.py).
EMBED_JOB_KIND = "embed_messages"
# ... and memories and attachments' passages (proxy/background/embedding_items.py).
EMBED_MEMORIES_KIND = "embed_memories"
EMBED_PASSAGES_KIND = "embed_passages"
