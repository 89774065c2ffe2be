"""Settings that keep tiktoken and litellm from reaching the network (see DESIGN.md)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def prepare_offline_environment() -> None:
    """Point tiktoken at litellm's bundled encodings and litellm at its bundled price map.

    Must run before tiktoken loads an encoding or litellm is imported; idempotent, and an
    operator's own settings win.
    """
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        spec = importlib.util.find_spec("litellm")
        if spec and spec.origin:
            bundled = Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"
            if bundled.is_dir():
                os.environ["TIKTOKEN_CACHE_DIR"] = str(bundled)
