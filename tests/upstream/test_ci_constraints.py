"""CI's two dependency sets are locked, and the locks say what the rest of the project says.

``.ci/run`` installs each set with ``.ci/constraints/<set>.txt`` as pip's constraints file, so the same commit gets
the same answer on any day. These tests keep the locks honest:

- the newest lock pins exactly the releases ``versions.TESTED`` names, and the matrix's last row was recorded on them;
- the oldest lock pins the lower bounds of ``versions.SUPPORTED`` / ``OPTIONAL`` for every upstream with a tested line;
- every pin in both locks satisfies the project's own requirements (a lock cannot fall out of pyproject's ranges);
- on an environment installed from a lock (each CI set), nothing installed is missing from it or differs from it:
  no dependency floated to whatever was published that day.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from shardadopt.upstream import versions

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / ".ci" / "constraints"
MATRIX = json.loads((REPO / "tests" / "data" / "release_matrix.json").read_text())["releases"]
# The upstreams whose release defines a set (the freeze script's list).
UPSTREAMS = ("torch", "transformers", "accelerate", "optuna", "peft", "trl", "datasets")
# Not pinned by a lock: the installer itself and the project.
UNLOCKED = {"pip", "setuptools", "wheel", "shardadopt"}


def lock(name: str) -> dict[str, Version]:
    pins = {}
    for line in (LOCKS / f"{name}.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
            assert match, f"{name}.txt: not an exact pin: {line!r}"
            pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def line(version: Version) -> str:
    return f"{version.major}.{version.minor}"


def test_the_newest_lock_is_the_tested_line_and_the_matrix_ends_there():
    newest = lock("newest")
    assert {name: line(newest[name]) for name in versions.TESTED} == versions.TESTED, (
        "raise versions.TESTED and .ci/constraints/newest.txt together (.ci/constraints/freeze newest NAME==VERSION)")
    last = MATRIX[-1]
    for name in ("transformers", "accelerate", "peft", "trl"):
        assert Version(last[name]) == newest[name], f"the matrix's last row has {name} {last[name]}"


def test_the_oldest_lock_is_the_oldest_supported_set():
    oldest = lock("oldest")
    ranges = {**versions.SUPPORTED, **versions.OPTIONAL}
    for name in versions.TESTED:  # datasets (trl's, not patched) is whatever trl 1.16.0 resolved to
        (lower,) = [spec.version for spec in Requirement(f"{name}{ranges[name]}").specifier if spec.operator == ">="]
        assert oldest[name].release == Version(lower).release + (0,) * (3 - len(Version(lower).release)), name
    first = MATRIX[0]
    for name in ("transformers", "accelerate", "peft", "trl"):
        assert Version(first[name]) == oldest[name], f"the matrix's first row has {name} {first[name]}"


@pytest.mark.parametrize("set_name", ["newest", "oldest"])
def test_every_pin_satisfies_the_project_requirements(set_name):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = lock(set_name)
    for requirement in map(Requirement, lines):
        name = canonicalize_name(requirement.name)
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), (set_name, str(requirement))
        else:
            pytest.fail(f"{set_name}.txt does not pin {requirement.name}: rerun .ci/constraints/freeze {set_name}")


def installed_set() -> str | None:
    """The lock this environment was installed from, judged by its upstream releases (None: neither)."""
    installed = {name: Version(importlib.metadata.version(name)) for name in UPSTREAMS}
    for name in ("newest", "oldest"):
        pins = lock(name)
        if all(installed[n].release == pins[n].release for n in UPSTREAMS):
            return name
    return None


def test_nothing_installed_floats_past_the_lock():
    set_name = installed_set()
    if set_name is None:
        pytest.skip("this environment was not installed from a CI lock (.ci/constraints/)")
    pins = lock(set_name)
    floating = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in UNLOCKED:
            continue
        version = Version(dist.version)
        pinned = pins.get(name)
        if pinned is None or Version(pinned.public) != Version(version.public):
            floating[name] = (str(version), str(pinned) if pinned else None)
    assert not floating, f"installed (version, lock) outside {set_name}.txt; rerun .ci/constraints/freeze: {floating}"
