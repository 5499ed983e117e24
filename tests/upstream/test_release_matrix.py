"""Version facts from one source: ``versions.SUPPORTED`` for the ranges, the recorded release matrix for the probes.

``tests/data/release_matrix.json`` holds what ``shardadopt doctor`` said on every release of the supported range
(``tools/release_matrix.py`` writes it). The README's "needed on" column must be what that matrix derives, and the
installed release must still get the states its row records, so neither the README nor a probe can drift unnoticed.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import shardadopt
from shardadopt.patching.registry import APPLIED, NOT_NEEDED
from shardadopt.testing.releases import newer_than_recorded
from shardadopt.testing.scripts import load_tool
from shardadopt.upstream import versions
from shardadopt.upstream.versions import installed_version

REPO = Path(__file__).resolve().parents[2]
DATA = json.loads((REPO / "tests" / "data" / "release_matrix.json").read_text())["releases"]


def _minors(spec: str, candidates) -> list[str]:
    return sorted({c for c in candidates if Version(c) in SpecifierSet(spec)}, key=Version)


def test_pyproject_dependencies_are_the_supported_ranges():
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {(r := Requirement(line)).name: str(r.specifier) for line in project["dependencies"]}
    for name, spec in versions.SUPPORTED.items():
        assert SpecifierSet(declared.get(name, "")) == SpecifierSet(spec), (
            f"pyproject.toml declares {name}{declared.get(name, '')!s}, shardadopt.upstream.versions.SUPPORTED {spec}")
    assert set(declared) - set(versions.SUPPORTED) <= {"packaging"}, declared


def test_every_patch_requires_the_supported_ranges():
    for patch in shardadopt._registry().patches():
        for name, spec in patch.requires.items():
            wanted = versions.SUPPORTED.get(name) or versions.OPTIONAL[name]  # optional: peft
            assert spec == wanted, f"{patch.id} requires {name}{spec}, not the supported range"


def test_the_matrix_covers_the_supported_range_and_decides_every_patch():
    ids = {p.id for p in shardadopt._registry().patches()}
    every_minor = {f"{major}.{minor}" for major in (1, 5) for minor in range(40)}
    for name in ("transformers", "accelerate"):
        recorded = {".".join(row[name].split(".")[:2]) for row in DATA}
        assert recorded == set(_minors(versions.tested_range(name), every_minor)), (
            f"{name}: the matrix has {sorted(recorded)}; rerun tools/release_matrix.py for the tested range")
    for row in DATA:
        assert set(row["patches"]) == ids, f"transformers {row['transformers']}: rerun tools/release_matrix.py"
        undecided = {pid: row["reasons"][pid] for pid, state in row["patches"].items()
                     if state not in (APPLIED, NOT_NEEDED)}
        assert not undecided, f"transformers {row['transformers']}: {undecided}"


def test_readme_needed_on_column_is_what_the_matrix_derives():
    tool = load_tool("release_matrix")
    cells = tool.readme_cells((REPO / "README.md").read_text())
    derived = tool.derived_cells()
    wrong = {pid: (cells.get(pid), cell) for pid, cell in derived.items() if cells.get(pid) != cell}
    assert not wrong, ("README 'needed on' cells (README, matrix) differ; run `python tools/release_matrix.py "
                       f"--readme`: {wrong}")


# What a matrix row is recorded with, besides the patches' states: the installed release of each must match a row.
ROW_UPSTREAMS = ("transformers", "accelerate", "peft", "trl")


def test_the_installed_release_gets_the_states_its_matrix_row_records():
    """Run on each CI dependency set: the probes on this installation agree with the recorded row (the row of the
    installed transformers, accelerate, peft and trl release lines; peft/trl only where installed)."""
    installed = {name: v for name in ROW_UPSTREAMS if (v := installed_version(name)) is not None}
    row = next((r for r in DATA if all(Version(r[n]).release[:2] == installed[n].release[:2] for n in installed)),
               None)
    newer = [reason for n in installed if (reason := newer_than_recorded(n, [r[n] for r in DATA]))]
    if row is None and newer:
        pytest.skip("; ".join(newer))
    assert row is not None, (f"no matrix row for {installed}: add the set to tools/release_matrix.py and rerun it")
    for patch in shardadopt._registry().patches():
        for module in patch.modules:
            importlib.import_module(module)
    try:
        live = {s.id: (s.state, s.reason) for s in shardadopt.enable()}
    finally:
        shardadopt.disable()
    differ = {pid: (state, live[pid]) for pid, state in row["patches"].items() if live[pid][0] != state}
    assert not differ, f"recorded state vs live (state, reason) on {installed}: {differ}"


def test_needed_on_names_runs_of_releases():
    tool = load_tool("release_matrix")
    rows = [{"transformers": t, "accelerate": "1.15.0", "patches": {"p": s}}
            for t, s in [("5.15.0", "applied"), ("5.16.1", "applied"), ("5.17.0", "not-needed"),
                         ("5.18.0", "applied")]]
    assert tool.needed_on(rows, "p", "transformers") == "transformers 5.15–5.16, 5.18"
    assert tool.needed_on(rows[2:3], "p", "transformers") == "none of the tested releases"
    with pytest.raises(ValueError, match="depends on another upstream"):
        tool.needed_on(rows, "p", "accelerate")


def test_tests_of_recorded_data_skip_only_on_a_release_line_newer_than_every_recorded_one(monkeypatch):
    from shardadopt.testing import releases

    recorded = [row["transformers"] for row in DATA]
    newest = max(Version(v) for v in recorded)
    for installed, skips in ((f"{newest.major}.{newest.minor}.7", False), ("5.15.0", False),
                             (f"{newest.major}.{newest.minor + 1}.0", True), ("6.0.0", True)):
        monkeypatch.setattr(releases, "installed_version", lambda _name, v=installed: Version(v))
        reason = releases.newer_than_recorded("transformers", recorded)
        assert (reason is not None) == skips, (installed, reason)
        if skips:
            assert f"transformers {installed} is newer" in reason and f"newest {newest.major}.{newest.minor}" in reason
