"""The upstream versions shardadopt supports, and what is installed."""

from __future__ import annotations

import platform

from packaging.specifiers import SpecifierSet

from shardadopt.registry import installed_version

# Mirrors pyproject.toml's dependency ranges (CI: torch 2.13.0 and 2.15.0, .ci/matrix: 2.14.1).
SUPPORTED: dict[str, str] = {
    "torch": ">=2.13,<2.16",
    "transformers": ">=5.15",
    "accelerate": ">=1.13",
    "optuna": ">=4,<6",
    "wrapt": ">=2",
}

# Optional integrations (pyproject.toml's `peft` and `trl` extras), tested in CI on both dependency sets. Absent is
# fine; installed outside the range is reported as unsupported, like a required dependency out of range.
OPTIONAL: dict[str, str] = {
    "peft": ">=0.21.2,<0.22",
    "trl": ">=1.16,<1.17",
    "datasets": ">=5,<6",
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


def integrations() -> list[dict[str, str | bool | None]]:
    """One row per optional integration: name, installed version (or None), supported range, ``state``
    (``supported``, ``not installed``, ``unsupported``: installed outside the range, or its import fails) and
    ``ok`` (False only for ``unsupported``: an absent optional package is not an error)."""
    import importlib

    rows: list[dict[str, str | bool | None]] = []
    for name, spec in OPTIONAL.items():
        version = installed_version(name)
        row: dict[str, str | bool | None] = {"name": name, "installed": str(version) if version else None,
                                             "supported": spec, "state": "not installed", "reason": None,
                                             "ok": True}
        if version is not None and version not in SpecifierSet(spec):
            row.update(state="unsupported", ok=False,
                       reason=f"{name} {version} is outside the tested range: pip install '{name}{spec}'")
        elif version is not None:
            try:
                importlib.import_module(name)
                row["state"] = "supported"
            except Exception as exc:  # a broken install: the integration cannot work
                row.update(state="unsupported", ok=False, reason=f"import {name} fails: {type(exc).__name__}: {exc}")
        rows.append(row)
    return rows
