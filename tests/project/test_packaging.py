"""Version ranges and the optional PEFT/TRL integrations: pyproject dependencies and extras, the ranges and tested
lines `shardadopt doctor` checks, its exit code; shardadopt's own version and its CHANGELOG section."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import shardadopt
from shardadopt.cli import main
from shardadopt.patching import registry
from shardadopt.upstream import versions

PYPROJECT = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())


def _extra(name: str) -> dict[str, str]:
    requirements = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name]]
    return {r.name: str(r.specifier) for r in requirements}


def _same_range(left: str, right: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(left) == SpecifierSet(right)


def test_extras_match_the_ranges_doctor_checks():
    assert _same_range(_extra("peft")["peft"], versions.OPTIONAL["peft"])
    assert _same_range(_extra("trl")["trl"], versions.OPTIONAL["trl"])
    assert _same_range(_extra("trl")["datasets"], versions.OPTIONAL["datasets"])
    test = _extra("test")
    for name, spec in versions.OPTIONAL.items():  # CI installs the test extra: the integrations' tests run there
        assert _same_range(test[name], spec), name


def _doctor_json(capsys) -> tuple[int, dict]:
    code = main(["doctor", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_doctor_reports_installed_integrations(capsys):
    code, report = _doctor_json(capsys)
    rows = {row["name"]: row for row in report["integrations"]}
    assert set(rows) == set(versions.OPTIONAL)
    for name in ("peft", "trl"):
        module = __import__(name)
        assert rows[name]["installed"] == str(Version(module.__version__))
        assert rows[name]["state"] == "supported" and rows[name]["ok"], rows[name]
    assert code == (0 if report["ok"] else 1)


def _fake_versions(monkeypatch, fake: dict[str, str | None]) -> None:
    real = versions.installed_version

    def installed(name: str) -> Version | None:
        return (Version(fake[name]) if fake[name] else None) if name in fake else real(name)

    monkeypatch.setattr(versions, "installed_version", installed)
    monkeypatch.setattr(registry, "installed_version", installed)  # what the patches' version gates read


def test_absent_integrations_are_not_an_error(monkeypatch, capsys):
    baseline, baseline_report = _doctor_json(capsys)
    _fake_versions(monkeypatch, {"peft": None, "trl": None, "datasets": None})
    code, report = _doctor_json(capsys)
    assert {row["state"] for row in report["integrations"]} == {"not installed"}
    assert all(row["ok"] for row in report["integrations"])
    (peft_patch,) = [p for p in report["patches"] if p["id"] == "peft-sharded-adapters"]
    assert peft_patch["reason"].startswith("peft is not installed"), peft_patch
    assert code == baseline and report["untested"] == baseline_report["untested"]  # no warning about it either


def test_an_integration_outside_its_range_makes_doctor_fail(monkeypatch, capsys):
    _fake_versions(monkeypatch, {"trl": "0.9.0"})
    code, report = _doctor_json(capsys)
    (row,) = [row for row in report["integrations"] if row["name"] == "trl"]
    assert row["state"] == "unsupported" and not row["ok"]
    assert f"pip install 'trl{versions.OPTIONAL['trl']}'" in row["reason"]
    assert code == 1 and report["ok"] is False
    main(["doctor"])
    text = capsys.readouterr().out
    assert "BAD trl" in text and "status: BROKEN" in text


# A newer release of these must never make pip downgrade it: lower bounds only, torch included.
UNCAPPED = ("torch", "transformers", "accelerate", "optuna", "peft", "trl", "datasets")
# The upstreams shardadopt patches or drives: each has a tested line, and CI's newest set pins that release.
TRACKED = ("torch", "transformers", "accelerate", "optuna", "peft", "trl")


def test_no_upper_bound_makes_pip_downgrade_a_newer_release():
    lines = PYPROJECT["project"]["dependencies"] + [
        line for extra in PYPROJECT["project"]["optional-dependencies"].values() for line in extra]
    capped = [line for line in lines if (r := Requirement(line)).name in UNCAPPED
              and any(spec.operator not in (">=", ">") for spec in r.specifier)]
    assert capped == []
    for name in UNCAPPED:
        spec = versions.SUPPORTED.get(name) or versions.OPTIONAL[name]
        assert Version("99.0") in SpecifierSet(spec), f"shardadopt.upstream.versions: {name}{spec}"


def test_the_tested_line_ends_the_tested_range():
    assert set(versions.TESTED) == set(TRACKED)
    for name, line in versions.TESTED.items():
        major, minor = (int(part) for part in line.split("."))
        tested = SpecifierSet(versions.tested_range(name))
        assert Version(f"{line}.9") in tested and Version(f"{major}.{minor + 1}.0") not in tested, name
        assert Version(f"{line}.9") in SpecifierSet(versions.SUPPORTED.get(name) or versions.OPTIONAL[name]), name


def test_an_integration_newer_than_tested_is_flagged_not_refused(monkeypatch, capsys):
    baseline, _ = _doctor_json(capsys)
    _fake_versions(monkeypatch, {"peft": "0.99.0"})
    code, report = _doctor_json(capsys)
    (row,) = [row for row in report["integrations"] if row["name"] == "peft"]
    assert row["state"] == "supported" and row["ok"] and row["newer_than_tested"], row
    assert "peft 0.99.0 is newer than the tested range" in report["untested"]
    assert code == baseline


def test_the_version_is_written_once():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shardadopt.__version__"}
    assert str(Version(shardadopt.__version__)) == shardadopt.__version__  # a PEP 440 version in canonical form


def test_the_changelog_has_this_release_below_unreleased():
    text = (pathlib.Path(__file__).parents[2] / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", text, flags=re.MULTILINE)
    assert headings[0] == ("Unreleased", ""), headings[:1]
    releases = [(Version(name), rest) for name, rest in headings[1:]]
    assert releases, "no release section below [Unreleased]"
    for _, rest in releases:
        assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), rest
    versions_in_order = [version for version, _ in releases]
    assert versions_in_order == sorted(versions_in_order, reverse=True), "newest release first"
    installed = Version(shardadopt.__version__)
    if installed.is_devrelease or installed.is_prerelease:  # between releases: the newest one is below it
        assert versions_in_order[0] < installed
    else:
        assert versions_in_order[0] == installed, f"CHANGELOG.md's newest release is not {installed}"


def test_the_command_reports_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardadopt {shardadopt.__version__}"
