"""Every YAML config example in README.md and docs/ passes what `memproxy check-config` checks.

A block marked `<!-- not config -->` (a compose file, say) is not one. A block marked
`<!-- config error: TEXT -->` shows a mistake on purpose: it must fail with TEXT in the
message. Environment variables the examples name are set to dummies.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.background.embeddings import check_embeddings
from proxy.core.config import ConfigError
from proxy.core.config_file import load_config
from tests.docs.markdown import ROOT, Block, blocks, pages

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
EXAMPLES = [
    block
    for page in pages()
    for block in blocks(page)
    if block.lang in ("yaml", "yml") and not block.mark.startswith("not config")
]


def check_config(path: Path, environ: dict[str, str]) -> None:
    """What `memproxy check-config` runs (proxy/cli.py `_load`)."""
    check_embeddings(load_config(path, environ))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 10
    assert any(block.path == ROOT / "config.yaml" for block in EXAMPLES) is False


def test_the_shipped_config_passes_without_environment() -> None:
    check_config(ROOT / "config.yaml", {})


@pytest.mark.parametrize("block", EXAMPLES, ids=[block.where for block in EXAMPLES])
def test_config_example_passes_check_config(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(block.body)
    environ = {name: f"dummy-{name.lower()}" for name in _VAR.findall(block.body)}
    if block.mark.startswith("config error:"):
        expected = block.mark.removeprefix("config error:").strip()
        with pytest.raises(ConfigError, match=re.escape(expected)):
            check_config(path, environ)
    else:
        try:
            check_config(path, environ)
        except ConfigError as exc:
            pytest.fail(f"{block.where}: memproxy: bad config: {exc}")
