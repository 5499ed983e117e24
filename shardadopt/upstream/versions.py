"""The upstream versions shardadopt supports, the newest it was tested on, and what is installed.

The ranges are lower bounds only: a newer torch / transformers / accelerate / peft / trl / optuna is never refused by
version number, and pip never downgrades one to install shardadopt. ``TESTED`` names the newest release line CI ran
(``.ci/constraints/newest.txt`` pins exactly those releases); on a newer release each patch's probe decides (applied,
not-needed, or unsupported with the reason), and ``enable()`` / ``shardadopt doctor`` say once that the release is
newer than the tested range.
"""

from __future__ import annotations

import importlib.metadata
import platform

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Mirrors pyproject.toml's dependency ranges (CI: torch 2.13.0 and 2.15.0, .ci/matrix: 2.14.1). Lower bounds only: a
# release newer than TESTED runs on the probes, and an installed torch is never replaced to install shardadopt.
SUPPORTED: dict[str, str] = {
    "torch": ">=2.13",
    "transformers": ">=5.15",
    "accelerate": ">=1.13",
    # 4.0-4.4 fail Study.best_trial on PostgreSQL with SQLAlchemy 2.1 (an enum compared with a VARCHAR in
    # get_best_trial's query); 4.5 is the oldest release whose storage works with today's SQLAlchemy.
    "optuna": ">=4.5",
    "wrapt": ">=2",
}

# Optional integrations (pyproject.toml's `peft` and `trl` extras), tested in CI on both dependency sets. Absent is
# fine; installed below the minimum is reported as unsupported, like a required dependency out of range.
OPTIONAL: dict[str, str] = {
    "peft": ">=0.21.2",
    "trl": ">=1.16",
    "datasets": ">=5",
}

# The newest release line (major.minor) each upstream was tested on: CI's newest dependency set
# (.ci/constraints/newest.txt) and the release matrix (tests/data/release_matrix.json) end here.
TESTED: dict[str, str] = {
    "torch": "2.15",
    "transformers": "5.25",
    "accelerate": "1.16",
    "optuna": "5.1",
    "peft": "0.22",
    "trl": "1.16",
}


def installed_version(distribution: str) -> Version | None:
    """The installed release of ``distribution``, or None where it is not installed."""
    try:
        return Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        return None


def _line(version: Version) -> tuple[int, int]:
    return (version.release + (0,))[:2]


def tested_range(name: str) -> str:
    """The releases of ``name`` that were tested: from its minimum up to and including the ``TESTED`` line (a
    specifier, e.g. ``>=5.15,<5.26``)."""
    major, minor = (int(part) for part in TESTED[name].split("."))
    return f"{SUPPORTED.get(name) or OPTIONAL[name]},<{major}.{minor + 1}"


def newer_than_tested() -> dict[str, str]:
    """Installed distributions whose release line is newer than ``TESTED``: name -> installed version."""
    newer = {}
    for name, line in TESTED.items():
        version = installed_version(name)
        if version is not None and _line(version) > _line(Version(line)):
            newer[name] = str(version)
    return newer


def supported(*distributions: str) -> dict[str, str]:
    """``SUPPORTED`` for these distributions: a patch's ``requires`` (its first one is the upstream its probe reads,
    whose releases the README's "needed on" column names)."""
    return {name: SUPPORTED.get(name) or OPTIONAL[name] for name in distributions}


def report() -> list[dict[str, str | bool | None]]:
    """One row per dependency: name, installed version (or None), supported range, whether it is inside, the
    newest tested release line (None where the range is the whole story) and whether the installed one is newer."""
    rows: list[dict[str, str | bool | None]] = [
        {"name": "python", "installed": platform.python_version(), "supported": ">=3.10", "ok": True,
         "tested": None, "newer_than_tested": False}]
    newer = newer_than_tested()
    for name, spec in SUPPORTED.items():
        version = installed_version(name)
        rows.append({"name": name, "installed": str(version) if version else None, "supported": spec,
                     "ok": version is not None and version in SpecifierSet(spec), "tested": TESTED.get(name),
                     "newer_than_tested": name in newer})
    return rows


def integrations() -> list[dict[str, str | bool | None]]:
    """One row per optional integration: name, installed version (or None), supported range, ``state``
    (``supported``, ``not installed``, ``unsupported``: installed outside the range, or its import fails), ``ok``
    (False only for ``unsupported``: an absent optional package is not an error), the newest tested release line
    and whether the installed one is newer."""
    rows: list[dict[str, str | bool | None]] = []
    newer = newer_than_tested()
    for name, spec in OPTIONAL.items():
        version = installed_version(name)
        row: dict[str, str | bool | None] = {"name": name, "installed": str(version) if version else None,
                                             "supported": spec, "state": "not installed", "reason": None,
                                             "ok": True, "tested": TESTED.get(name),
                                             "newer_than_tested": name in newer}
        if version is not None and version not in SpecifierSet(spec):
            row.update(state="unsupported", ok=False,
                       reason=f"{name} {version} is outside the supported range: pip install '{name}{spec}'")
        elif version is not None:
            try:
                importlib.import_module(name)
                row["state"] = "supported"
            except Exception as exc:  # a broken install: the integration cannot work
                row.update(state="unsupported", ok=False, reason=f"import {name} fails: {type(exc).__name__}: {exc}")
        rows.append(row)
    return rows
