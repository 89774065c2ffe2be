"""config.yaml: loading, `${VAR}` expansion, includes, defaults merged into tenants, checks.

The file becomes one `Config` (the models are in `proxy.core.config`) at start-up. Anything
wrong with it raises `ConfigError` with a single line that names the offending key, e.g.
``tenants.acme.context.token_budget: Input should be a valid integer``.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import os
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from proxy.core.config import (
    ALL_SCOPES,
    Config,
    ConfigError,
    Scope,
    TenantSettings,
    UpstreamConfig,
)
from proxy.core.user_tokens import UserTokens

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

_HASHED_KEY = re.compile(r"sha256:([0-9a-f]{64})", re.IGNORECASE)


def key_digest(key: str) -> str:
    """The stored form of an API key: `sha256:<hex>` keys as given, plain keys hashed."""
    if hashed := _HASHED_KEY.fullmatch(key):
        return hashed.group(1).lower()
    return hashlib.sha256(key.encode()).hexdigest()


def load_config(path: str | os.PathLike[str], environ: dict[str, str] | None = None) -> Config:
    """Read, expand, merge and validate a config file."""
    path = Path(path)
    env = dict(os.environ) if environ is None else environ
    raw = _read_yaml(path)
    tenants = dict(_mapping(raw.get("tenants") or {}, "tenants"))
    for pattern in _include_patterns(raw.get("include")):
        found = sorted(glob.glob(str(path.parent / pattern)))
        if not found and not glob.has_magic(pattern):
            raise ConfigError(f"include: no file {pattern!r} (next to {path})")
        for included in found:
            for name, body in _mapping(_read_yaml(Path(included)), included).items():
                if name in tenants:
                    raise ConfigError(f"tenants.{name}: defined twice (again in {included})")
                tenants[name] = body
    defaults = _mapping(raw.get("defaults") or {}, "defaults")
    unknown = set(raw) - {
        "server",
        "database",
        "upstreams",
        "pricing",
        "defaults",
        "tenants",
        "include",
    }
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown top-level key")

    merged = {
        name: _deep_merge(defaults, _mapping(body or {}, f"tenants.{name}"))
        for name, body in tenants.items()
    }
    upstreams = dict(_mapping(raw.get("upstreams") or {}, "upstreams"))
    upstreams.setdefault("echo", {"kind": "echo"})
    used = {str(t.get("upstream", "echo")) for t in merged.values()}
    for name, tenant in merged.items():
        for section, key in (
            ("intent", "upstream"),
            ("memory", "upstream"),
            ("memory", "embedding_upstream"),
            ("summaries", "upstream"),
            ("attachments", "upstream"),
        ):
            settings = tenant.get(section)
            if isinstance(settings, dict) and settings.get(key):
                if str(settings[key]) not in upstreams:
                    raise ConfigError(
                        f"tenants.{name}.{section}.{key}: no upstream named {settings[key]!r}"
                    )
                used.add(str(settings[key]))
    for name in used:
        if name not in upstreams:
            where = next(n for n, t in merged.items() if str(t.get("upstream", "echo")) == name)
            raise ConfigError(f"tenants.{where}.upstream: no upstream named {name!r}")
    for name, body in upstreams.items():
        if name not in used:  # not built, but a mistake in it is one before a tenant uses it
            try:
                expanded = _expand(body, f"upstreams.{name}", env)
            except ConfigError:
                continue  # (its variables need not be set while no tenant uses it)
            try:
                UpstreamConfig.model_validate(expanded)
            except ValidationError as exc:
                raise ConfigError(_first_error(exc, f"upstreams.{name}")) from None
    doc = {
        "server": _expand(raw.get("server") or {}, "server", env),
        "database": _expand(raw.get("database") or {}, "database", env),
        # Unused upstreams may name variables that are not set; they are simply not built.
        "upstreams": {
            n: _expand(u, f"upstreams.{n}", env) for n, u in upstreams.items() if n in used
        },
        "pricing": _expand(raw.get("pricing") or {}, "pricing", env),
        "tenants": {n: _expand(t, f"tenants.{n}", env) for n, t in merged.items()},
    }
    try:
        config = Config.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(_in_defaults(exc, defaults, env) or _first_error(exc)) from None
    _check_keys(config)
    _check_identity(config, defaults)
    return config


def _in_defaults(exc: ValidationError, defaults: dict[str, Any], env: dict[str, str]) -> str | None:
    """A tenant's error as one of `defaults:`, when the same key is wrong there."""
    loc = _deepest(exc)["loc"]
    if not defaults or len(loc) < 3 or loc[0] != "tenants":
        return None
    try:
        TenantSettings.model_validate(_expand(defaults, "defaults", env))
    except ValidationError as mine:
        if _deepest(mine)["loc"] == loc[2:]:
            return _first_error(mine, "defaults")
    return None


def _include_patterns(value: Any) -> list[str]:
    """`include:`: one file pattern (relative to the config file) or a list of them."""
    if value is None:
        return []
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError("include: expected a file pattern or a list of them")
    return patterns


def tenant_keys(config: Config) -> dict[str, tuple[str, frozenset[Scope], str | None]]:
    """Map key digest -> (tenant name, scopes, the user the key is bound to or None)."""
    keys: dict[str, tuple[str, frozenset[Scope], str | None]] = {}
    for name, tenant in config.tenants.items():
        for entry in tenant.api_keys:
            if isinstance(entry, str):
                keys[key_digest(entry)] = (name, ALL_SCOPES, None)
            else:
                keys[key_digest(entry.key)] = (name, frozenset(entry.scopes), entry.user)
    return keys


def _check_identity(config: Config, defaults: dict[str, Any]) -> None:
    """Each tenant's tokens verified with key material of its own: a secret or key file that
    two tenants share would let one's tokens act in the other."""
    if "identity" in defaults:
        raise ConfigError(
            "defaults.identity: set identity per tenant (each verifies tokens with key "
            "material of its own)"
        )
    seen: dict[tuple[str, str], str] = {}
    for name, tenant in config.tenants.items():
        identity = tenant.identity
        if identity.mode == "token":
            UserTokens(name, identity)  # (its key file read and parsed now, not at a request)
        for field in ("secret", "public_key_file", "jwks_file"):
            value = getattr(identity, field)
            if value is None:
                continue
            material = (field, value if field == "secret" else str(Path(value).resolve()))
            if material in seen:
                raise ConfigError(
                    f"tenants.{name}.identity.{field}: the same as tenant {seen[material]!r}'s "
                    "(a token signed for one would act in the other)"
                )
            seen[material] = name
        for i, entry in enumerate(tenant.api_keys):
            user = None if isinstance(entry, str) else entry.user
            if user is not None and (not user.strip() or "\x00" in user):
                raise ConfigError(f"tenants.{name}.api_keys.{i}.user: not a usable user id")


def _check_keys(config: Config) -> None:
    """Each key usable (no client sends an empty one, spaces around it, or characters an HTTP
    header does not carry as they are), a hashed one a whole SHA-256 digest, and each listed
    once, for one tenant."""
    seen: dict[str, str] = {}
    for name, tenant in config.tenants.items():
        for i, entry in enumerate(tenant.api_keys):
            key = entry if isinstance(entry, str) else entry.key
            where = f"tenants.{name}.api_keys.{i}"
            if not key.strip() or key != key.strip():
                raise ConfigError(
                    f"{where}: a key may not be empty or begin or end with a space (an "
                    "environment variable set to nothing?)"
                )
            if not (key.isascii() and key.isprintable()):
                raise ConfigError(
                    f"{where}: a key is printable ASCII (a client's header would not match "
                    "other characters)"
                )
            if key[:7].lower() == "sha256:" and not _HASHED_KEY.fullmatch(key):
                raise ConfigError(f"{where}: a hashed key is 'sha256:' and the key's 64 hex digits")
            digest = key_digest(key)
            if digest in seen:
                owner = seen[digest]
                raise ConfigError(
                    f"{where}: key listed twice for this tenant"
                    if owner == name
                    else f"{where}: key already belongs to tenant {owner!r}"
                )
            seen[digest] = name


class _UniqueKeys(yaml.SafeLoader):
    """YAML in which a key given twice in one mapping is an error: PyYAML keeps the last one
    silently, so a tenant written twice would lose its first definition unnoticed."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # (`<<: *defaults`: what it merges in, the mapping's own keys override)
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):
            continue  # (construct_mapping says what is wrong with it)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)  # (which reads the merge keys)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeys)  # (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(
            f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})"
        ) from None
    return _mapping(data or {}, str(path))


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _expand(value: Any, where: str, env: dict[str, str]) -> Any:
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                raise ConfigError(f"{where}: environment variable {name} is not set")
            return env[name]

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", env) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{where}.{i}", env) for i, v in enumerate(value)]
    return value


def _deepest(exc: ValidationError) -> Any:
    # In a union (a key is a string or an object) the deepest error is the one that helps.
    return max(exc.errors(), key=lambda e: len(e["loc"]))


def _first_error(exc: ValidationError, where: str = "") -> str:
    err = _deepest(exc)
    parts = [where] if where else []
    parts += [str(p) for p in err["loc"] if not str(p).startswith(("str", "ApiKeyConfig"))]
    loc = ".".join(parts)
    value = err.get("input")
    # (a URL may hold a password)
    secret = "api_key" in loc or loc == "database.url" or loc.endswith(".secret")
    shown = "" if secret or isinstance(value, dict | list) else f" (got {value!r})"
    more = f" [+{exc.error_count() - 1} more]" if exc.error_count() > 1 else ""
    return f"{loc}: {err['msg']}{shown}{more}"
