"""A torch newer than the tested line: pip keeps it, and the probes decide on it.

- ``pip install -e .`` in an environment whose torch is 2.99.0 installs nothing for torch (no downgrade, no second
  multi-GB build): a throwaway venv sees this environment's packages through a ``.pth`` file, a dist-info that says
  ``torch 2.99.0`` shadows the real torch's metadata, and pip resolves the project offline (``--no-index``), so any
  upper bound on torch would fail to resolve.
- What the user sees: ``shardadopt doctor`` on torch 2.99.0 names it as newer than the tested line once, every torch
  patch's probe still decides (the same states as on the real release) and doctor passes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sysconfig
import venv

from packaging.version import Version

import shardadopt
from shardadopt.cli import main
from shardadopt.patching import registry
from shardadopt.patching.registry import APPLIED, NOT_NEEDED
from shardadopt.upstream import versions

REPO = pathlib.Path(__file__).resolve().parents[2]
NEWER_TORCH = "2.99.0"


def _environment_with_torch(root: pathlib.Path, torch_version: str) -> pathlib.Path:
    """A venv (no pip of its own) that imports this environment's packages but whose torch metadata says
    ``torch_version``; returns its python."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       check=True, capture_output=True, text=True).stdout.strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the venv's own site-packages
    dist_info = site / f"torch-{torch_version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")
    return python


def test_pip_install_keeps_a_torch_newer_than_the_tested_line(tmp_path):
    python = _environment_with_torch(tmp_path / "env", NEWER_TORCH)
    seen = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr  # pip from this environment, through the .pth file
    listed = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                            check=True, capture_output=True, text=True).stdout.strip()
    assert listed == NEWER_TORCH, "the fake torch metadata must shadow the real one"
    report = tmp_path / "report.json"
    out = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                          "--report", str(report), "-e", str(REPO)],
                         capture_output=True, text=True,
                         # no pip configuration: a machine-wide constraints file (a torch cap) is not the project's
                         env={"PIP_CONFIG_FILE": os.devnull, "PIP_CONSTRAINT": "", "PATH": "/usr/bin:/bin",
                              "HOME": str(tmp_path)})
    assert out.returncode == 0, f"pip cannot install shardadopt beside torch {NEWER_TORCH}:\n{out.stderr[-3000:]}"
    to_install = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                  for item in json.loads(report.read_text())["install"]}
    assert set(to_install) == {"shardadopt"}, f"pip would install more than the project: {to_install}"


def test_doctor_on_a_newer_torch_names_it_and_every_probe_decides(monkeypatch, capsys):
    for patch in shardadopt._registry().patches():
        if "torch" in patch.requires:
            for module in patch.modules:
                __import__(module)
    real = {s.id: s.state for s in shardadopt.enable()}
    shardadopt.disable()
    real_version = versions.installed_version

    def installed(name: str) -> Version | None:
        return Version(NEWER_TORCH) if name == "torch" else real_version(name)

    monkeypatch.setattr(versions, "installed_version", installed)
    monkeypatch.setattr(registry, "installed_version", installed)
    code = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], report["untested"]
    assert f"torch {NEWER_TORCH} is newer than the tested range (up to torch {versions.TESTED['torch']})" \
        in report["untested"]
    torch_patches = {p.id for p in shardadopt._registry().patches() if next(iter(p.requires)) == "torch"}
    states = {p["id"]: p["state"] for p in report["patches"]}
    assert torch_patches and all(states[pid] in (APPLIED, NOT_NEEDED) for pid in torch_patches), states
    assert {pid: states[pid] for pid in torch_patches} == {pid: real[pid] for pid in torch_patches}
    main(["doctor"])
    text = capsys.readouterr().out
    assert text.count("newer than the tested range") == 1 and "status: ok" in text, text
