"""docs/reference/configuration.md documents every key of the configuration models, with the
model's own default, so that a new field cannot be added without its documentation."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from proxy.core.config import Config, TenantConfig
from tests.docs.markdown import DOCS

PAGE = DOCS / "reference" / "configuration.md"
# Tenant settings are documented relative to `defaults:` or a tenant (`context.token_budget`);
# keys only a tenant has keep their full path (`tenants.<name>.api_keys`).
TENANT_ONLY = set(TenantConfig.model_fields) - set(TenantConfig.__mro__[1].model_fields)


def _submodels(annotation: Any, suffix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """The models a field holds, with the path step to each: `` (the field is one), `.<*>` (a
    mapping of them), `[]` (a list of them)."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield suffix, annotation
    elif origin is list:
        for arg in typing.get_args(annotation):
            yield from _submodels(arg, suffix + "[]")
    elif origin is dict:
        yield from _submodels(typing.get_args(annotation)[1], suffix + ".<*>")
    elif origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            yield from _submodels(arg, suffix)


def model_keys(
    model: type[BaseModel] = Config, prefix: str = ""
) -> Iterator[tuple[str, Any, bool]]:
    """(dotted path, default, is a section) for every field, recursively. A section (a field
    that is one settings model, such as `server`) is covered by its own fields' rows."""
    for name, field in model.model_fields.items():
        path = prefix + name
        nested = list(_submodels(field.annotation))
        default = "required" if field.default is PydanticUndefined else field.default
        yield path, default, [step for step, _ in nested] == [""]
        for step, sub in nested:
            yield from model_keys(sub, f"{path}{step}.")


def documented_path(path: str) -> str:
    """The model path as the page writes it."""
    if path.startswith("tenants.<*>."):
        rest = path.removeprefix("tenants.<*>.")
        if rest.split(".")[0].split("[")[0] not in TENANT_ONLY:
            return rest
    return path


def documented_rows() -> dict[str, str]:
    """Each table row's key (its first cell, in backticks, `<...>` read as `<*>`) -> the text
    of its default cell (the third)."""
    rows: dict[str, str] = {}
    for line in PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            key = cells[0].strip("`")
            while "<" in key and ">" in key:
                start, end = key.index("<"), key.index(">")
                key = key[:start] + "\x00" + key[end + 1 :]
            rows[key.replace("\x00", "<*>")] = cells[2]
    return rows


def _same_default(cell: str, default: Any) -> bool:
    if default == "required":
        return cell == "required"
    if not (cell.startswith("`") and cell.endswith("`")):
        return False
    value = yaml.safe_load(cell.strip("`"))
    if value is False and default == "off":  # (YAML's `off`, as the config loader reads it)
        value = "off"
    if isinstance(default, BaseModel | dict) and default:
        return False  # (a mapping with content: documented by its fields)
    return bool(value == default)


KEYS = [(documented_path(p), default) for p, default, section in model_keys() if not section]
SECTIONS = {documented_path(p) for p, _, section in model_keys() if section}


def test_the_walk_finds_nested_keys() -> None:
    """The walk goes into sections, mappings of models and lists of them."""
    paths = [path for path, _ in KEYS]
    assert "server.max_body_bytes" in paths
    assert "upstreams.<*>.timeout.connect" in paths
    assert "context.token_budget" in paths
    assert "intent.labels.<*>.patterns" in paths
    assert "tenants.<*>.api_keys[].scopes" in paths
    assert "server" not in paths and "upstreams.<*>.timeout" not in paths


@pytest.mark.parametrize(("path", "default"), KEYS, ids=[path for path, _ in KEYS])
def test_every_config_key_is_documented_with_its_default(path: str, default: Any) -> None:
    rows = documented_rows()
    assert path in rows, f"{path} is a config key but has no row in {PAGE.name}"
    if isinstance(default, BaseModel) or (isinstance(default, dict) and default):
        return  # (`upstreams`' built-in echo: its keys are rows of their own)
    assert _same_default(rows[path], default), (
        f"{path}: the page says the default is {rows[path]}, the model {default!r}"
    )


def test_every_documented_key_exists() -> None:
    """A row for a key that was renamed or removed is caught too."""
    known = {path for path, _ in KEYS} | SECTIONS | {"defaults", "include"}
    extra = set(documented_rows()) - known
    assert not extra, f"{PAGE.name} documents keys the models do not have: {sorted(extra)}"
