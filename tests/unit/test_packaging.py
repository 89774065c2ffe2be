"""What an install of memproxy needs is declared in pyproject.toml: every third-party package
the code imports is a dependency of its own (not one that happens to come with another), and
every file the code reads beside its modules (the inspector's templates and stylesheet) is
package data, so an install from a wheel works as one from the source tree."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "storage", "policies")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _imported(path: Path) -> set[str]:
    """The top-level names a module imports (relative imports left out)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    """The distributions pyproject.toml names as runtime dependencies, with those their
    extras bring (`PyJWT[crypto]`: cryptography), normalized."""
    declared: set[str] = set()
    for spec in PYPROJECT["project"]["dependencies"]:
        found = re.match(r"([A-Za-z0-9._-]+)(?:\[([^\]]*)\])?", spec)
        assert found is not None, spec
        name, extras = found.group(1), (found.group(2) or "").split(",")
        declared.add(_normal(name))
        for requirement in metadata.requires(name) or []:
            if any(f'extra == "{e.strip()}"' in requirement for e in extras if e.strip()):
                declared.add(_normal(re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0]))
    return declared


def test_every_third_party_import_is_a_declared_dependency() -> None:
    imported: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            imported |= _imported(path)
    third_party = imported - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}
    owners = metadata.packages_distributions()
    declared = _declared()
    undeclared = sorted(
        name
        for name in third_party
        if name in owners and not any(_normal(d) in declared for d in owners[name])
    )
    assert undeclared == [], f"imported but not in [project] dependencies: {undeclared}"


def test_every_file_read_beside_the_modules_is_package_data() -> None:
    patterns: dict[str, list[str]] = PYPROJECT["tool"]["setuptools"]["package-data"]
    missing = []
    for path in (ROOT / "proxy" / "ui").rglob("*"):
        if not path.is_file() or path.suffix in (".py", ".pyc"):
            continue
        relative = path.relative_to(ROOT)
        covered = any(
            relative.is_relative_to(Path(*package.split(".")))
            and any(
                fnmatch.fnmatch(str(relative.relative_to(Path(*package.split(".")))), pattern)
                for pattern in globs
            )
            for package, globs in patterns.items()
        )
        if not covered:
            missing.append(str(relative))
    assert missing == [], f"not in [tool.setuptools.package-data]: {missing}"
