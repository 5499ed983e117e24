"""The upstream versions shardadopt supports, and what is installed."""

from __future__ import annotations

import platform

from packaging.specifiers import SpecifierSet

from shardadopt.registry import installed_version

# Mirrors pyproject.toml's dependency ranges (CI: torch 2.13.0 and 2.15.0, .ci/matrix: 2.14.1).
SUPPORTED: dict[str, str] = {
    "torch": ">=2.13,<2.16",
    "transformers": ">=5.15,<5.25",
    "accelerate": ">=1.13,<1.16",
    "optuna": ">=4,<6",
    "wrapt": ">=2",
}

# Optional integrations: not dependencies, but the patches for them are written and tested against these ranges.
OPTIONAL: dict[str, str] = {
    "peft": ">=0.21,<0.22",
}


def supported(*distributions: str) -> dict[str, str]:
    """``SUPPORTED`` for these distributions: a patch's ``requires`` (its first one is the upstream its probe reads,
    whose releases the README's "needed on" column names)."""
    return {name: SUPPORTED.get(name) or OPTIONAL[name] for name in distributions}


def report() -> list[dict[str, str | bool | None]]:
    """One row per dependency: name, installed version (or None), supported range, whether it is inside."""
    rows: list[dict[str, str | bool | None]] = [
        {"name": "python", "installed": platform.python_version(), "supported": ">=3.10", "ok": True}]
    for name, spec in SUPPORTED.items():
        version = installed_version(name)
        rows.append({"name": name, "installed": str(version) if version else None, "supported": spec,
                     "ok": version is not None and version in SpecifierSet(spec)})
    return rows
