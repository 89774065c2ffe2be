"""Model facts (context window, prices) from litellm's bundled model map, read as data.

Reading the JSON that litellm ships avoids importing litellm (seconds) and never touches the
network. Loaded once at start-up; lookups are dictionary reads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from policies.pricing import names_of

_MAP_FILE = "model_prices_and_context_window_backup.json"


class ModelCatalog:
    def __init__(self, models: dict[str, dict[str, Any]]) -> None:
        self._models = models

    @classmethod
    def load(cls) -> ModelCatalog:
        """The bundled map, or an empty catalog when litellm is not installed."""
        spec = importlib.util.find_spec("litellm")
        if spec is None or spec.origin is None:
            return cls({})
        path = Path(spec.origin).parent / _MAP_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls({})
        return cls({k: v for k, v in data.items() if isinstance(v, dict)})

    def info(self, model: str) -> dict[str, Any] | None:
        """Facts for `model`, also found without or with only its last provider prefix."""
        return next((f for n in names_of(model) if (f := self._models.get(n))), None)

    def context_window(self, model: str) -> int | None:
        info = self.info(model) or {}
        window = info.get("max_input_tokens") or info.get("max_tokens")
        return window if isinstance(window, int) and window > 0 else None
